/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_cuda_backend.c — the CUDA kernels against the CPU backend and a plain reference.
 *
 * Every kernel is run twice per case: through the asynchronous device-pointer API of tk_cuda.h
 * (on a stream of our own, with poisoned outputs, carries and histograms that stay on the
 * device) and through the daemon's CUDA engine (td_gpu_engine.h: one lane, its pinned staging,
 * the launch and its completion; batches up to ENGINE_MAX_BYTES, as tallyd's lanes take at most
 * 64 MiB). Both results must equal the CPU backend's and a plain loop's (written here from the
 * contract, independent of both backends). Inputs are fresh random data each run; the seed is
 * printed and TALLY_TEST_SEED repeats a run. Sizes: 0, 1, 31, 32, 33, 4095, 4096, 2^20 + 7 and 2^28
 * (TALLY_TEST_QUICK=1 leaves out 2^28, for runs under compute-sanitizer). Unordered filter results
 * are compared as multisets (sorted, or by count and an order-independent hash at 2^28).
 *
 * The scan, histogram and minmax kernels take their shapes from a tuning row (tk_cuda.h,
 * "tuning"); through the async API every result is checked under every row of the table and
 * under variants that reach the kernels no row uses (every scan shape and colour layout, other
 * grids, prefetch distances and loads in flight), so each architecture's row is checked on
 * whatever GPU runs the test. tests/test_cuda_tuning.c checks the table and the selection.
 *
 * Without a usable GPU the program says why and exits 77, which CTest reports as skipped.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>
#include <cuda_runtime_api.h>
#include <pthread.h>

#include "reference.h"
#include "td_gpu_engine.h"
#include "tk_backend.h"
#include "tk_cuda.h"

#define BIG_N ((size_t)1 << 28)
#define MID_N (((size_t)1 << 20) + 7)

static const size_t all_sizes[] = {0, 1, 31, 32, 33, 4095, 4096, MID_N, BIG_N};
static size_t n_sizes;    /* all of them, or all but BIG_N in quick mode */
static int quick;         /* TALLY_TEST_QUICK: also fewer thresholds per predicate */
static tk_backend_t *cpu; /* the reference backend */
static cudaStream_t stream;
static uint64_t rng_state;

/* Device buffers for the async API, sized for the largest case. */
static void *d_in, *d_out, *d_scratch;
static size_t d_scratch_bytes;
static uint64_t *d_small; /* [0] kept, [1] carry, [2..] a tk_hist_t */

/* The tunings every async-API result is checked under: the table's rows, then variants of its
 * first row. */
#define MAX_TUNINGS 16
static tk_cuda_tuning_t tunings[MAX_TUNINGS];
static unsigned n_tunings;

static void tunings_init(void)
{
    for (unsigned r = 0; r < tk_cuda_tuning_rows() && n_tunings < MAX_TUNINGS; r++)
        tunings[n_tunings++] = *tk_cuda_tuning_row(r);
    static const unsigned layouts[] = {TK_RGB_PACKED, TK_RGB_COPIES16, TK_RGB_COPIES32,
                                       TK_RGB_PACKED};
    for (unsigned s = TK_SCAN_V8; s <= TK_SCAN_V16_LEAN && n_tunings < MAX_TUNINGS; s++) {
        tk_cuda_tuning_t t = *tk_cuda_tuning_row(0);
        t.name = "variant";
        t.scan_shape = s;
        t.scan_shape_i32 = TK_SCAN_V16_LEAN - s;
        t.scan_prefetch_tiles = 3 * s; /* near tiles, so that small batches prefetch too */
        t.rgb_layout = layouts[s];
        t.rgb_blocks_per_sm = 1 + s % 3;
        t.rgb_flush_steps = s; /* 0: the longest; 1: after every step */
        t.hist_blocks_per_sm = 1 + s;
        t.minmax_unroll = s & 1 ? 4 : 1;
        t.minmax_blocks_per_sm = 1 + 2 * s;
        tunings[n_tunings++] = t;
    }
    /* The int32 shapes with one more block an SM (int64 output runs as the shape below them). */
    for (unsigned s = TK_SCAN_V12_LEAN_B4; s < TK_SCAN_SHAPES && n_tunings < MAX_TUNINGS; s++) {
        tk_cuda_tuning_t t = *tk_cuda_tuning_row(0);
        t.name = "variant";
        t.scan_shape = t.scan_shape_i32 = s;
        t.scan_prefetch_tiles = s == TK_SCAN_V16_LEAN_B3 ? 2 : 0;
        tunings[n_tunings++] = t;
    }
}

/* Tuning r in use (r = n_tunings: back to the device's own row). */
static void use_tuning(unsigned r)
{
    assert_int_equal(tk_cuda_tuning_use(r < n_tunings ? &tunings[r] : NULL), TALLY_OK);
}

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            fail_msg("%s: %s", #call, cudaGetErrorString(e_));                                     \
    } while (0)

/* ---- the daemon's CUDA engine (td_gpu_cuda.c): one lane, one staging slot ------------------ */

#define ENGINE_MAX_BYTES ((MID_N + 16) * 4)

static td_gpu_engine_t *engine;
static void *lane;
static td_gpu_staging_t staging[1];
static pthread_mutex_t engine_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t engine_cond = PTHREAD_COND_INITIALIZER;
static bool engine_done;

static void engine_done_cb(void *arg) /* CUDA's callback thread */
{
    (void)arg;
    pthread_mutex_lock(&engine_lock);
    engine_done = true;
    pthread_cond_signal(&engine_cond);
    pthread_mutex_unlock(&engine_lock);
}

/* Runs job (its n elements of input already in staging[0].in) on the lane and waits for its
 * completion: the results are then in staging[0] (out, and small's kept, carry or hist). */
static void engine_run(const td_gpu_job_t *job, const char *what)
{
    engine_done = false;
    td_gpu_err_t err = engine->lane_launch(lane, job, engine_done_cb, NULL);
    if (err != TD_GPU_OK)
        fail_msg("%s: the engine's launch: %d (%s)", what, (int)err, engine->error_string());
    pthread_mutex_lock(&engine_lock);
    while (!engine_done)
        pthread_cond_wait(&engine_cond, &engine_lock);
    pthread_mutex_unlock(&engine_lock);
}

/* Whether the engine takes a batch of this many bytes (its lane's buffers). */
static bool engine_fits(size_t bytes)
{
    return bytes <= ENGINE_MAX_BYTES;
}

/* ---- random data ------------------------------------------------------------------------------
 */

static uint64_t rnd(void)
{
    uint64_t x = rng_state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    rng_state = x;
    return x * 0x2545F4914F6CDD1DULL;
}

static int32_t rnd_between(int64_t lo, int64_t hi) /* inclusive */
{
    return (int32_t)(lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1)));
}

typedef enum { DATA_UNIFORM, DATA_EQUAL, DATA_NARROW, DATA_KINDS } data_kind_t;

static void fill_i32(int32_t *x, size_t n, data_kind_t kind)
{
    int32_t c = (int32_t)rnd();
    int32_t base = rnd_between(-1000000, 1000000);
    for (size_t i = 0; i < n; i++) {
        switch (kind) {
        case DATA_UNIFORM:
            x[i] = (int32_t)(rnd() >> 32);
            break;
        case DATA_EQUAL:
            x[i] = c;
            break;
        default:
            x[i] = base + (int32_t)(rnd() % 64);
            break;
        }
    }
    if (kind == DATA_UNIFORM && n > 8) { /* the extremes, somewhere */
        x[rnd() % n] = INT32_MIN;
        x[rnd() % n] = INT32_MAX;
    }
}

static void fill_u8(uint8_t *x, size_t n, data_kind_t kind)
{
    uint8_t c = (uint8_t)rnd(), base = (uint8_t)(rnd() % 250);
    for (size_t i = 0; i < n; i++) {
        switch (kind) {
        case DATA_UNIFORM:
            x[i] = (uint8_t)(rnd() >> 56);
            break;
        case DATA_EQUAL:
            x[i] = c;
            break;
        default:
            x[i] = (uint8_t)(base + rnd() % 4);
            break;
        }
    }
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    assert_non_null(p);
    return p;
}

/* ---- comparisons --------------------------------------------------------------------------- */

static void expect_bytes(const char *what, const void *got, const void *want, size_t n,
                         size_t esize)
{
    if (n == 0 || memcmp(got, want, n * esize) == 0)
        return;
    for (size_t i = 0; i < n; i++) {
        if (memcmp((const char *)got + i * esize, (const char *)want + i * esize, esize)) {
            int64_t g = 0, w = 0;
            memcpy(&g, (const char *)got + i * esize, esize < 8 ? esize : 8);
            memcpy(&w, (const char *)want + i * esize, esize < 8 ? esize : 8);
            fail_msg("%s: first difference at %zu of %zu: got %lld (0x%llx), want %lld", what, i, n,
                     (long long)g, (unsigned long long)g, (long long)w);
        }
    }
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}

/* got (any order) must be the multiset want (input order); got is sorted in place. */
static void expect_multiset(const char *what, tally_dtype_t dt, void *got, const void *want,
                            size_t k, const tk_filter_spec_t *s)
{
    if (dt == TALLY_DTYPE_U8) {
        size_t cg[256] = {0}, cw[256] = {0};
        for (size_t i = 0; i < k; i++) {
            cg[((uint8_t *)got)[i]]++;
            cw[((const uint8_t *)want)[i]]++;
        }
        expect_bytes(what, cg, cw, 256, sizeof cg[0]);
        return;
    }
    if (k <= MID_N) {
        int32_t *w = xmalloc(k * 4);
        memcpy(w, want, k * 4);
        qsort(got, k, 4, cmp_i32);
        qsort(w, k, 4, cmp_i32);
        expect_bytes(what, got, w, k, 4);
        free(w);
        return;
    }
    /* Too large to sort quickly: every element kept by the predicate, and equal order-free
     * hashes (sum of a 64-bit mix of each value) over the same count. */
    uint64_t hg = 0, hw = 0;
    for (size_t i = 0; i < k; i++) {
        int32_t g = ((int32_t *)got)[i];
        if (!tr_keep(s->pred, s->lo, s->hi, g))
            fail_msg("%s: element %zu (%d) does not satisfy the predicate", what, i, g);
        hg += mix64((uint32_t)g);
        hw += mix64((uint32_t)((const int32_t *)want)[i]);
    }
    if (hg != hw)
        fail_msg("%s: kept elements differ from the reference multiset", what);
}

/* ---- filter ---------------------------------------------------------------------------------- */

static void check_filter(tally_dtype_t dt, const void *in, size_t n, const tk_filter_spec_t *s,
                         size_t in_offset)
{
    size_t es = dt == TALLY_DTYPE_U8 ? 1 : 4;
    char what[160];
    snprintf(what, sizeof what, "filter %s %s %s lo=%lld hi=%lld n=%zu off=%zu",
             es == 1 ? "u8" : "i32", tally_pred_name(s->pred), s->stable ? "stable" : "unordered",
             (long long)s->lo, (long long)s->hi, n, in_offset);
    void *want = xmalloc(n * es), *got = xmalloc(n * es);
    size_t kw = tr_filter(dt, in, n, s->pred, s->lo, s->hi, want);

    /* The CPU backend agrees with the plain loop (as a multiset in unordered mode). */
    size_t kc = (size_t)-1;
    assert_int_equal(cpu->filter(cpu->ctx, dt, in, n, s, got, &kc), TALLY_OK);
    assert_int_equal(kc, kw);
    if (s->stable)
        expect_bytes(what, got, want, kw, es);

    /* The async API, on a poisoned output, from a possibly unaligned input. */
    char *din = (char *)d_in + in_offset * es;
    CK(cudaMemcpyAsync(din, in, n * es, cudaMemcpyHostToDevice, stream));
    CK(cudaMemsetAsync(d_out, 0xA5, n * es + 16, stream));
    CK(cudaMemsetAsync(d_small, 0xA5, 8, stream));
    tally_status_t st =
        tk_cuda_filter(dt, din, n, s, d_out, &d_small[0], d_scratch, d_scratch_bytes, stream);
    if (st != TALLY_OK)
        fail_msg("%s: tk_cuda_filter: %d (%s)", what, st, tk_cuda_error_string());
    uint64_t kg = 0;
    CK(cudaMemcpyAsync(&kg, &d_small[0], 8, cudaMemcpyDeviceToHost, stream));
    CK(cudaStreamSynchronize(stream));
    if (kg != kw)
        fail_msg("%s: async kept %llu, want %zu", what, (unsigned long long)kg, kw);
    CK(cudaMemcpy(got, d_out, kw * es, cudaMemcpyDeviceToHost));
    if (s->stable)
        expect_bytes(what, got, want, kw, es);
    else
        expect_multiset(what, dt, got, want, kw, s);

    /* The engine. */
    if (in_offset == 0 && engine_fits(n * es)) {
        memcpy(staging[0].in, in, n * es);
        memset(staging[0].out, 0x5A, n * es);
        td_gpu_job_t job = {.opcode = TALLY_OP_FILTER, .dtype = dt, .n = n, .spec = *s};
        engine_run(&job, what);
        assert_int_equal(staging[0].small->kept, kw);
        memcpy(got, staging[0].out, kw * es);
        if (s->stable)
            expect_bytes(what, got, want, kw, es);
        else
            expect_multiset(what, dt, got, want, kw, s);
    }
    free(want);
    free(got);
}

/* Thresholds worth trying for an input: values in it, 0, and the edges of both types. */
static int64_t pick_threshold(tally_dtype_t dt, const void *in, size_t n, int which)
{
    static const int64_t edges[] = {
        INT64_MIN, INT32_MIN, -1, 0, 255, 256, INT32_MAX, (int64_t)INT32_MAX + 1, INT64_MAX};
    if (which == 0 && n > 0)
        return dt == TALLY_DTYPE_I32 ? ((const int32_t *)in)[rnd() % n]
                                     : ((const uint8_t *)in)[rnd() % n];
    return edges[rnd() % (sizeof edges / sizeof edges[0])];
}

static void filter_all_preds(tally_dtype_t dt, const void *in, size_t n, int thresholds)
{
    for (int p = TALLY_PRED_GT; p <= TALLY_PRED_BETWEEN; p++) {
        for (int t = 0; t < thresholds; t++) {
            tk_filter_spec_t s = {(tally_pred_t)p, pick_threshold(dt, in, n, t), 0, 0};
            if (p == TALLY_PRED_BETWEEN) {
                int64_t a = s.lo, b = pick_threshold(dt, in, n, t);
                s.lo = a < b ? a : b;
                s.hi = a < b ? b : a;
            }
            for (int stable = 0; stable < 2; stable++) {
                s.stable = stable;
                check_filter(dt, in, n, &s, 0);
            }
        }
    }
}

static void test_filter_i32(void **state)
{
    (void)state;
    for (size_t si = 0; si < n_sizes; si++) {
        size_t n = all_sizes[si];
        int32_t *in = xmalloc(n * 4);
        for (int kind = 0; kind < DATA_KINDS; kind++) {
            fill_i32(in, n, (data_kind_t)kind);
            if (n == BIG_N) { /* one representative case per mode: ~50 % kept */
                tk_filter_spec_t s = {TALLY_PRED_GT, 0, 0, 0};
                check_filter(TALLY_DTYPE_I32, in, n, &s, 0);
                s.stable = 1;
                check_filter(TALLY_DTYPE_I32, in, n, &s, 0);
                break;
            }
            filter_all_preds(TALLY_DTYPE_I32, in, n, quick || n >= MID_N ? 2 : 4);
        }
        free(in);
    }
}

static void test_filter_u8(void **state)
{
    (void)state;
    for (size_t si = 0; si < n_sizes; si++) {
        size_t n = all_sizes[si];
        uint8_t *in = xmalloc(n);
        for (int kind = 0; kind < DATA_KINDS; kind++) {
            fill_u8(in, n, (data_kind_t)kind);
            if (n == BIG_N) {
                tk_filter_spec_t s = {TALLY_PRED_BETWEEN, 10, 200, 0};
                check_filter(TALLY_DTYPE_U8, in, n, &s, 0);
                s.stable = 1;
                check_filter(TALLY_DTYPE_U8, in, n, &s, 0);
                break;
            }
            filter_all_preds(TALLY_DTYPE_U8, in, n, quick || n >= MID_N ? 2 : 4);
        }
        free(in);
    }
}

/* Inputs that are not 16-byte aligned take the scalar path of every filter tile. */
static void test_filter_unaligned(void **state)
{
    (void)state;
    size_t n = 4096 * 3 + 17;
    int32_t *in = xmalloc(n * 4);
    uint8_t *in8 = xmalloc(n);
    fill_i32(in, n, DATA_UNIFORM);
    fill_u8(in8, n, DATA_UNIFORM);
    for (int stable = 0; stable < 2; stable++) {
        tk_filter_spec_t s = {TALLY_PRED_LT, 0, 0, stable};
        check_filter(TALLY_DTYPE_I32, in, n, &s, 1);
        s.lo = 100;
        check_filter(TALLY_DTYPE_U8, in8, n, &s, 3);
    }
    free(in);
    free(in8);
}

/* ---- scan ------------------------------------------------------------------------------------ */

static void check_scan(const int32_t *in, size_t n, int excl, int out32, int64_t carry,
                       size_t in_offset)
{
    size_t os = out32 ? 4 : 8;
    char what[160];
    snprintf(what, sizeof what, "scan %s %s carry=%lld n=%zu off=%zu",
             excl ? "exclusive" : "inclusive", out32 ? "i32" : "i64", (long long)carry, n,
             in_offset);
    void *want = xmalloc(n * os), *got = xmalloc(n * os);
    int64_t cw = (int64_t)tr_scan(in, n, excl, out32, (uint64_t)carry, want);

    int64_t cc = carry;
    assert_int_equal(cpu->scan(cpu->ctx, in, n, excl, out32, got, &cc), TALLY_OK);
    assert_int_equal(cc, cw);
    expect_bytes(what, got, want, n, os);

    /* Async API, under every tuning: carry in and out through the same device word (a
     * stream's running total). */
    int32_t *din = (int32_t *)d_in + in_offset;
    CK(cudaMemcpyAsync(din, in, n * 4, cudaMemcpyHostToDevice, stream));
    for (unsigned r = 0; r < n_tunings; r++) {
        char what_r[200];
        snprintf(what_r, sizeof what_r, "%s, tuning %u (%s)", what, r, tunings[r].name);
        use_tuning(r);
        CK(cudaMemsetAsync(d_out, 0xA5, n * os, stream));
        CK(cudaMemcpyAsync(&d_small[1], &carry, 8, cudaMemcpyHostToDevice, stream));
        tally_status_t st =
            tk_cuda_scan(din, n, excl, out32, d_out, (int64_t *)&d_small[1], (int64_t *)&d_small[1],
                         d_scratch, d_scratch_bytes, stream);
        if (st != TALLY_OK)
            fail_msg("%s: tk_cuda_scan: %d (%s)", what_r, st, tk_cuda_error_string());
        int64_t cg = 0;
        CK(cudaMemcpyAsync(&cg, &d_small[1], 8, cudaMemcpyDeviceToHost, stream));
        CK(cudaStreamSynchronize(stream));
        if (cg != cw)
            fail_msg("%s: carry %lld, want %lld", what_r, (long long)cg, (long long)cw);
        CK(cudaMemcpy(got, d_out, n * os, cudaMemcpyDeviceToHost));
        expect_bytes(what_r, got, want, n, os);
    }
    use_tuning(n_tunings);

    if (in_offset == 0 && engine_fits(n * 4)) { /* the carry uploaded, chained on the device */
        memcpy(staging[0].in, in, n * 4);
        memset(staging[0].out, 0x5A, n * os);
        staging[0].small->carry = carry;
        td_gpu_job_t job = {.opcode = TALLY_OP_SCAN,
                            .dtype = TALLY_DTYPE_I32,
                            .n = n,
                            .exclusive = excl,
                            .out_i32 = out32,
                            .carry_index = 1,
                            .carry_upload = true};
        engine_run(&job, what);
        assert_int_equal(staging[0].small->carry, cw);
        expect_bytes(what, staging[0].out, want, n, os);
    }
    free(want);
    free(got);
}

static void test_scan(void **state)
{
    (void)state;
    const int64_t carries[] = {0, INT64_MAX - 1000, INT64_MIN + 5};
    for (size_t si = 0; si < n_sizes; si++) {
        size_t n = all_sizes[si];
        int32_t *in = xmalloc(n * 4);
        for (int kind = 0; kind < DATA_KINDS; kind++) {
            fill_i32(in, n, (data_kind_t)kind);
            if (kind == DATA_EQUAL && n)
                for (size_t i = 0; i < n; i++) /* big values: int32 output wraps quickly */
                    in[i] = INT32_MAX - 3;
            for (int mode = 0; mode < 4; mode++) {
                int64_t c = kind == DATA_UNIFORM ? (int64_t)rnd() : carries[(mode + kind) % 3];
                check_scan(in, n, mode & 1, mode >> 1, c, 0);
            }
            if (n == BIG_N)
                break;
        }
        free(in);
    }
}

/* Unaligned input (scalar path), and an array scanned in two chunks with the carry kept on the
 * device between them gives exactly the whole array's prefix sums. */
static void test_scan_chunks_unaligned(void **state)
{
    (void)state;
    size_t n = 3 * 4096 + 123;
    int32_t *in = xmalloc(n * 4);
    fill_i32(in, n, DATA_UNIFORM);
    check_scan(in, n, 0, 0, 42, 1);
    check_scan(in, n, 1, 1, -42, 3);

    int64_t *want = xmalloc(n * 8), *got = xmalloc(n * 8);
    int64_t c0 = (int64_t)rnd();
    int64_t cw = (int64_t)tr_scan(in, n, false, false, (uint64_t)c0, want);
    size_t cut = 4096 + 77;
    CK(cudaMemcpyAsync(d_in, in, n * 4, cudaMemcpyHostToDevice, stream));
    for (unsigned r = 0; r < n_tunings; r++) {
        use_tuning(r);
        CK(cudaMemcpyAsync(&d_small[1], &c0, 8, cudaMemcpyHostToDevice, stream));
        int64_t *carry = (int64_t *)&d_small[1];
        int64_t *out = d_out;
        CK(cudaMemsetAsync(out, 0xA5, n * 8, stream));
        assert_int_equal(
            tk_cuda_scan(d_in, cut, 0, 0, out, carry, carry, d_scratch, d_scratch_bytes, stream),
            TALLY_OK);
        /* The second chunk starts 77 elements past a 16-byte boundary: the scalar path. */
        assert_int_equal(tk_cuda_scan((int32_t *)d_in + cut, n - cut, 0, 0, out + cut, carry, carry,
                                      d_scratch, d_scratch_bytes, stream),
                         TALLY_OK);
        int64_t cg = 0;
        CK(cudaMemcpyAsync(got, out, n * 8, cudaMemcpyDeviceToHost, stream));
        CK(cudaMemcpyAsync(&cg, carry, 8, cudaMemcpyDeviceToHost, stream));
        CK(cudaStreamSynchronize(stream));
        if (cg != cw)
            fail_msg("scan in two chunks, tuning %u: carry %lld, want %lld", r, (long long)cg,
                     (long long)cw);
        expect_bytes(tunings[r].name, got, want, n, 8);
    }
    use_tuning(n_tunings);
    free(in);
    free(want);
    free(got);
}

/* ---- histogram --------------------------------------------------------------------------------
 */

static void check_hist(tally_dtype_t dt, const void *in, size_t n, int64_t lo, int64_t hi,
                       size_t in_offset)
{
    size_t es = tally_dtype_size(dt), align = tally_dtype_align(dt);
    char what[160];
    snprintf(what, sizeof what, "hist %s [%lld, %lld) n=%zu off=%zu", tally_dtype_name(dt),
             (long long)lo, (long long)hi, n, in_offset);
    /* Start from a non-empty histogram: the kernels add. */
    static tk_hist_t start, want, got;
    memset(&start, 0, sizeof start);
    for (size_t b = 0; b < tally_hist_channels(dt) * TALLY_HIST_BINS; b++)
        start.bins[b] = rnd() % 1000;
    start.underflow = tally_hist_ranged(dt) ? rnd() % 1000 : 0;
    start.overflow = tally_hist_ranged(dt) ? rnd() % 1000 : 0;
    want = start;
    tr_hist_parts(dt, in, n, lo, hi, want.bins, &want.underflow, &want.overflow);

    got = start;
    tally_status_t st = tk_backend_hist(cpu, dt, in, n, lo, hi, &got);
    assert_int_equal(st, TALLY_OK);
    expect_bytes(what, &got, &want, sizeof got / 8, 8);

    char *din = (char *)d_in + in_offset * align;
    tk_hist_t *dh = (tk_hist_t *)&d_small[2];
    CK(cudaMemcpyAsync(din, in, n * es, cudaMemcpyHostToDevice, stream));
    for (unsigned r = 0; r < n_tunings; r++) {
        char what_r[200];
        snprintf(what_r, sizeof what_r, "%s, tuning %u (%s)", what, r, tunings[r].name);
        use_tuning(r);
        CK(cudaMemcpyAsync(dh, &start, sizeof start, cudaMemcpyHostToDevice, stream));
        st = tk_cuda_hist(dt, din, n, lo, hi, dh, d_scratch, d_scratch_bytes, stream);
        if (st != TALLY_OK)
            fail_msg("%s: tk_cuda_hist: %d (%s)", what_r, st, tk_cuda_error_string());
        CK(cudaMemcpyAsync(&got, dh, sizeof got, cudaMemcpyDeviceToHost, stream));
        CK(cudaStreamSynchronize(stream));
        expect_bytes(what_r, &got, &want, sizeof got / 8, 8);
    }
    use_tuning(n_tunings);

    if (in_offset == 0 && engine_fits(n * es)) { /* the engine's hist starts from zero */
        memcpy(staging[0].in, in, n * es);
        td_gpu_job_t job = {.opcode = TALLY_OP_HIST, .dtype = dt, .n = n, .lo = lo, .hi = hi};
        engine_run(&job, what);
        got = staging[0].small->hist;
        for (size_t b = 0; b < sizeof got.bins / 8; b++)
            got.bins[b] += start.bins[b];
        got.underflow += start.underflow;
        got.overflow += start.overflow;
        expect_bytes(what, &got, &want, sizeof got / 8, 8);
    }
}

static void test_hist_u8(void **state)
{
    (void)state;
    for (size_t si = 0; si < n_sizes; si++) {
        size_t n = all_sizes[si];
        uint8_t *in = xmalloc(n + 16);
        for (int kind = 0; kind < DATA_KINDS; kind++) {
            fill_u8(in, n + 16, (data_kind_t)kind);
            check_hist(TALLY_DTYPE_U8, in, n, 0, 0, 0);
            if (n < MID_N) /* unaligned head and tail */
                check_hist(TALLY_DTYPE_U8, in, n, 0, 0, 1 + rnd() % 15);
        }
        free(in);
    }
}

static void test_hist_i32(void **state)
{
    (void)state;
    const int64_t ranges[][2] = {
        {0, 256},
        {-1000, 1000},
        {-7, 5},
        {0, 1},
        {INT32_MIN, (int64_t)INT32_MAX + 1},
        {INT32_MIN, 0},
        {-3, 1000003},
        {INT32_MIN, INT32_MIN + 1},
        {INT32_MAX, (int64_t)INT32_MAX + 1},
        {-123456789, 987654321},
    };
    const size_t nr = sizeof ranges / sizeof ranges[0];
    for (size_t si = 0; si < n_sizes; si++) {
        size_t n = all_sizes[si];
        int32_t *in = xmalloc(n * 4 + 16);
        for (int kind = 0; kind < DATA_KINDS; kind++) {
            fill_i32(in, n + 4, (data_kind_t)kind);
            for (size_t r = 0; r < nr; r++) {
                if (n >= MID_N && r % 3 != 0 && r != 4)
                    continue;
                int64_t lo = ranges[r][0], hi = ranges[r][1];
                if (kind == DATA_NARROW) { /* centre the data on the range's edges */
                    int64_t c = (r & 1) ? lo : hi - 32;
                    for (size_t i = 0; i < n + 4; i++) {
                        int64_t v = c + (int64_t)(rnd() % 64) - 32;
                        in[i] = (int32_t)(v < INT32_MIN   ? INT32_MIN
                                          : v > INT32_MAX ? INT32_MAX
                                                          : v);
                    }
                }
                check_hist(TALLY_DTYPE_I32, in, n, lo, hi, 0);
                if (n < MID_N && r < 3)
                    check_hist(TALLY_DTYPE_I32, in, n, lo, hi, 1 + rnd() % 3);
            }
            if (n == BIG_N)
                break;
        }
        free(in);
    }
}

/* uint16: 12-bit and full ranges, odd ones, one-value bins, data around the edges; every
 * result equal to the CPU backend and to the defining division. */
static void test_hist_u16(void **state)
{
    (void)state;
    const int64_t ranges[][2] = {{0, 4096},      {0, 65536},   {100, 356}, {0, 1},
                                 {65535, 65536}, {1000, 1003}, {7, 60007}};
    const size_t nr = sizeof ranges / sizeof ranges[0];
    for (size_t si = 0; si < n_sizes; si++) {
        size_t n = all_sizes[si];
        uint16_t *in = xmalloc(n * 2 + 16);
        for (int kind = 0; kind < DATA_KINDS; kind++) {
            fill_u8((uint8_t *)in, n * 2 + 16, (data_kind_t)kind);
            for (size_t r = 0; r < nr; r++) {
                if (n >= MID_N && r > 1)
                    continue;
                check_hist(TALLY_DTYPE_U16, in, n, ranges[r][0], ranges[r][1], 0);
                if (n < MID_N)
                    check_hist(TALLY_DTYPE_U16, in, n, ranges[r][0], ranges[r][1], 1 + rnd() % 7);
            }
        }
        free(in);
    }
}

/* One minmax of n elements of dtype dt: the CPU backend, the kernel (async API) and the daemon's
 * CUDA engine against the reference; an empty batch leaves the pair empty. */
static void check_minmax(tally_dtype_t dt, const uint8_t *in, size_t n, int kind)
{
    int64_t lo, hi, clo = INT64_MAX, chi = INT64_MIN, glo, ghi;
    tr_minmax(dt, in, n, &lo, &hi);
    assert_int_equal(cpu->minmax(cpu->ctx, dt, in, n, &clo, &chi), TALLY_OK);
    int64_t *d_pair = (int64_t *)d_small, pair[2];
    size_t es = tally_dtype_size(dt);
    CK(cudaMemcpyAsync(d_in, in, n * es, cudaMemcpyHostToDevice, stream));
    for (unsigned r = 0; r < n_tunings; r++) {
        use_tuning(r);
        assert_int_equal(tk_cuda_minmax_reset(d_pair, stream), TALLY_OK);
        assert_int_equal(tk_cuda_minmax(dt, d_in, n, d_pair, stream), TALLY_OK);
        CK(cudaMemcpyAsync(pair, d_pair, sizeof pair, cudaMemcpyDeviceToHost, stream));
        CK(cudaStreamSynchronize(stream));
        glo = pair[0];
        ghi = pair[1];
        if (clo != lo || chi != hi || glo != lo || ghi != hi)
            fail_msg("minmax %s n=%zu kind %d, tuning %u (%s): want %lld..%lld, cpu %lld..%lld, "
                     "gpu %lld..%lld",
                     tally_dtype_name(dt), n, kind, r, tunings[r].name, (long long)lo,
                     (long long)hi, (long long)clo, (long long)chi, (long long)glo, (long long)ghi);
    }
    use_tuning(n_tunings);
    if (engine_fits(n * es)) {
        char what[96];
        snprintf(what, sizeof what, "minmax %s n=%zu kind %d (engine)", tally_dtype_name(dt), n,
                 kind);
        memcpy(staging[0].in, in, n * es);
        td_gpu_job_t job = {.opcode = TALLY_OP_MINMAX, .dtype = dt, .n = n};
        engine_run(&job, what);
        if (staging[0].small->minmax[0] != lo || staging[0].small->minmax[1] != hi)
            fail_msg("%s: %lld..%lld, want %lld..%lld", what,
                     (long long)staging[0].small->minmax[0], (long long)staging[0].small->minmax[1],
                     (long long)lo, (long long)hi);
    }
}

/* minmax: i32, u8 and u16 at every size and data kind. */
static void test_minmax(void **state)
{
    (void)state;
    static const tally_dtype_t types[] = {TALLY_DTYPE_I32, TALLY_DTYPE_U8, TALLY_DTYPE_U16};
    for (size_t si = 0; si < n_sizes; si++) {
        size_t n = all_sizes[si];
        uint8_t *in = xmalloc(n * 4 + 16);
        for (int kind = 0; kind < DATA_KINDS; kind++) {
            fill_u8(in, n * 4 + 16, (data_kind_t)kind);
            for (size_t t = 0; t < 3; t++)
                check_minmax(types[t], in, n, kind);
        }
        free(in);
    }
}

/* minmax's kernel on inputs that start off a 16-byte boundary (every element offset), and
 * lengths shorter than the head: the elements block 0 folds outside the vectors. */
static void test_minmax_unaligned(void **state)
{
    (void)state;
    static const tally_dtype_t types[] = {TALLY_DTYPE_I32, TALLY_DTYPE_U8, TALLY_DTYPE_U16};
    static const size_t lengths[] = {1, 2, 3, 5, 15, 16, 17, 100, 4099};
    uint8_t *in = xmalloc(4 * 4099 + 16);
    fill_u8(in, 4 * 4099 + 16, DATA_UNIFORM);
    assert_int_equal(cudaMemcpy(d_in, in, 4 * 4099 + 16, cudaMemcpyHostToDevice), cudaSuccess);
    int64_t *d_pair = (int64_t *)d_small;
    for (size_t t = 0; t < 3; t++) {
        size_t es = tally_dtype_size(types[t]);
        for (size_t off = 0; off < 16; off += es) {
            for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
                size_t n = lengths[li];
                int64_t want[2] = {INT64_MAX, INT64_MIN}, got[2];
                assert_int_equal(cpu->minmax(cpu->ctx, types[t], in + off, n, &want[0], &want[1]),
                                 TALLY_OK);
                for (unsigned r = 0; r < n_tunings; r++) {
                    use_tuning(r);
                    assert_int_equal(tk_cuda_minmax_reset(d_pair, stream), TALLY_OK);
                    assert_int_equal(
                        tk_cuda_minmax(types[t], (uint8_t *)d_in + off, n, d_pair, stream),
                        TALLY_OK);
                    assert_int_equal(cudaMemcpy(got, d_pair, sizeof got, cudaMemcpyDeviceToHost),
                                     cudaSuccess);
                    if (got[0] != want[0] || got[1] != want[1])
                        fail_msg("minmax %s off=%zu n=%zu tuning %u: gpu %lld..%lld, cpu "
                                 "%lld..%lld",
                                 tally_dtype_name(types[t]), off, n, r, (long long)got[0],
                                 (long long)got[1], (long long)want[0], (long long)want[1]);
                }
                use_tuning(n_tunings);
            }
        }
    }
    free(in);
}

/* RGB and RGBA pixels at every byte offset 0..15 (the channel of a vector's bytes depends on
 * where the body starts), every data kind. */
static void test_hist_rgb(void **state)
{
    (void)state;
    for (size_t si = 0; si < n_sizes; si++) {
        size_t n = all_sizes[si] / 4 + 1; /* pixels */
        uint8_t *in = xmalloc(n * 4 + 16);
        for (int kind = 0; kind < DATA_KINDS; kind++) {
            fill_u8(in, n * 4 + 16, (data_kind_t)kind);
            for (tally_dtype_t dt = TALLY_DTYPE_RGB8; dt <= TALLY_DTYPE_RGBA8; dt++) {
                check_hist(dt, in, n, 0, 0, 0);
                if (n < MID_N)
                    for (size_t off = 1; off < 16; off += 1 + (n > 1000) * 4)
                        check_hist(dt, in, n, 0, 0, off);
            }
        }
        free(in);
    }
    /* Arguments the colour kernels refuse, whatever the tuning. */
    tk_hist_t *dh = (tk_hist_t *)&d_small[2];
    assert_int_equal(tk_cuda_hist_rgb(d_in, 16, 5, dh, NULL, 0, stream), TALLY_E_PARAM);
    assert_int_equal(tk_cuda_hist_rgb(d_in, (size_t)1 << 34, 3, dh, NULL, 0, stream),
                     TALLY_E_PARAM);
}

/* Every bin edge of many widths: the values just below, at and above the first value of each
 * bin (the places where a rounded reciprocal would go wrong) land in the bin of the defining
 * division (tr_hist_bin). */
static void test_hist_i32_bin_edges(void **state)
{
    (void)state;
    int64_t widths[64] = {1,
                          2,
                          3,
                          7,
                          255,
                          256,
                          257,
                          1000,
                          65535,
                          65537,
                          1000003,
                          (1LL << 31) - 1,
                          1LL << 31,
                          (1LL << 31) + 1,
                          (1LL << 32) - 1,
                          1LL << 32};
    int nw = 16;
    while (nw < 64)
        widths[nw++] = 1 + (int64_t)(rnd() % (1ULL << 32));
    int32_t *in = xmalloc(256 * 3 * 4 + 8);
    for (int w = 0; w < nw; w++) {
        int64_t W = widths[w];
        int64_t lo = INT32_MIN + (int64_t)(rnd() % (uint64_t)((1LL << 32) - W + 1));
        size_t n = 0;
        for (int64_t k = 0; k < 256; k++) {
            int64_t d = (k * W + 255) / 256; /* the first d in bin k */
            for (int64_t e = d - 1; e <= d + 1; e++)
                if (e >= 0 && e < W)
                    in[n++] = (int32_t)(lo + e);
        }
        check_hist(TALLY_DTYPE_I32, in, n, lo, lo + W, 0);
    }
    free(in);
}

/* ---- failure paths --------------------------------------------------------------------------- */

static void test_bad_arguments(void **state)
{
    (void)state;
    tk_filter_spec_t bad = {(tally_pred_t)99, 0, 0, 0};
    assert_int_equal(tk_cuda_filter(TALLY_DTYPE_I32, d_in, 10, &bad, d_out, &d_small[0], d_scratch,
                                    d_scratch_bytes, stream),
                     TALLY_E_PARAM);
    tk_filter_spec_t gt = {TALLY_PRED_GT, 0, 0, 1};
    assert_int_equal(tk_cuda_filter(TALLY_DTYPE_I64, d_in, 10, &gt, d_out, &d_small[0], d_scratch,
                                    d_scratch_bytes, stream),
                     TALLY_E_PARAM);
    assert_int_equal(tk_cuda_filter(TALLY_DTYPE_I32, d_in, 1 << 20, &gt, d_out, &d_small[0],
                                    d_scratch, 16, stream),
                     TALLY_E_PARAM); /* scratch too small */
    assert_int_equal(tk_cuda_scan(d_in, 1 << 20, 0, 0, d_out, (int64_t *)&d_small[1],
                                  (int64_t *)&d_small[1], d_scratch, 0, stream),
                     TALLY_E_PARAM);
    tk_hist_t *dh = (tk_hist_t *)&d_small[2];
    assert_int_equal(tk_cuda_hist_i32(d_in, 10, 5, 5, dh, NULL, 0, stream), TALLY_E_PARAM);
    assert_int_equal(tk_cuda_hist_i32(d_in, 10, INT32_MIN - 1LL, 0, dh, NULL, 0, stream),
                     TALLY_E_PARAM);

    /* The engine: a lane on a device that is not there fails with the reason, and a split job
     * over its buffers is refused (TD_GPU_E_UNFIT) rather than overrun them. */
    char msg[200] = "";
    void *none = NULL;
    td_gpu_staging_t st_none[1];
    uint64_t bytes = 0;
    assert_int_equal(engine->lane_open(engine->ctx, tk_cuda_device_count(), 1024, 1, 2, &none,
                                       st_none, &bytes, msg, sizeof msg),
                     TD_GPU_E_DEVICE);
    assert_true(strlen(msg) > 0);
    char d[200] = "";
    engine->describe(engine->ctx, 0, d, sizeof d);
    assert_true(strlen(d) > 0);
    td_gpu_job_t big = {.opcode = TALLY_OP_HIST,
                        .dtype = TALLY_DTYPE_U8,
                        .n = 3 * ENGINE_MAX_BYTES,
                        .src = staging[0].in};
    void *lanes[1] = {lane};
    assert_int_equal(engine->lane_launch_split(lane, lanes, 1, 2, &big, engine_done_cb, NULL),
                     TD_GPU_E_UNFIT);
}

/* ---- set-up ---------------------------------------------------------------------------------- */

static int setup(void **state)
{
    (void)state;
    size_t max_n = all_sizes[n_sizes - 1];
    size_t max_bytes = max_n * 4 + 64;
    char msg[256] = "";
    uint64_t bytes = 0;
    if (td_gpu_engine_cuda_new(&engine, msg, sizeof msg) != TD_GPU_OK ||
        engine->lane_open(engine->ctx, 0, ENGINE_MAX_BYTES, 1, 2, &lane, staging, &bytes, msg,
                          sizeof msg) != TD_GPU_OK ||
        engine->lane_bind(lane) != TD_GPU_OK) {
        fprintf(stderr, "the CUDA engine: %s\n", msg);
        return -1;
    }
    if (tk_cpu_backend_new(&cpu) != TALLY_OK)
        return -1;
    if (cudaStreamCreate(&stream) != cudaSuccess)
        return -1;
    d_scratch_bytes = tk_cuda_scratch_bytes_max(max_bytes);
    if (cudaMalloc(&d_in, max_bytes) != cudaSuccess ||
        cudaMalloc(&d_out, 2 * max_bytes + 64) != cudaSuccess ||
        cudaMalloc(&d_scratch, d_scratch_bytes ? d_scratch_bytes : 16) != cudaSuccess ||
        cudaMalloc((void **)&d_small, 16 + sizeof(tk_hist_t)) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc failed\n");
        return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    cudaFree(d_in);
    cudaFree(d_out);
    cudaFree(d_scratch);
    cudaFree(d_small);
    cudaStreamDestroy(stream);
    if (lane)
        engine->lane_close(lane);
    if (engine)
        engine->destroy(&engine);
    if (cpu)
        cpu->destroy(&cpu);
    return 0;
}

int main(void)
{
    if (tk_cuda_device_count() == 0) {
        printf("test_cuda_backend: skipped: no usable CUDA device (no GPU or no driver)\n");
        return 77;
    }
    const char *q = getenv("TALLY_TEST_QUICK");
    n_sizes = sizeof all_sizes / sizeof all_sizes[0];
    quick = q && *q && strcmp(q, "0") != 0;
    if (quick)
        n_sizes--; /* leave out 2^28 */
    const char *seed = getenv("TALLY_TEST_SEED");
    rng_state = seed ? strtoull(seed, NULL, 0) : (uint64_t)time(NULL) * 2654435761u + 1;
    if (rng_state == 0)
        rng_state = 1;
    tunings_init();
    printf("test_cuda_backend: TALLY_TEST_SEED=%llu, largest size %zu, %u tunings\n",
           (unsigned long long)rng_state, all_sizes[n_sizes - 1], n_tunings);

    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hist_i32_bin_edges),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_filter_unaligned),
        cmocka_unit_test(test_scan_chunks_unaligned),
        cmocka_unit_test(test_filter_i32),
        cmocka_unit_test(test_filter_u8),
        cmocka_unit_test(test_scan),
        cmocka_unit_test(test_hist_u8),
        cmocka_unit_test(test_hist_i32),
        cmocka_unit_test(test_hist_u16),
        cmocka_unit_test(test_hist_rgb),
        cmocka_unit_test(test_minmax),
        cmocka_unit_test(test_minmax_unaligned),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
