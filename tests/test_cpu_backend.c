/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_cpu_backend.c — the CPU backend (kernels/cpu_backend.c) against plain references.
 *
 * The references below are deliberately naive: one element at a time, the predicate as an
 * obvious switch on int64, the scan accumulated in uint64_t, the histogram through the bin
 * formula of tally_proto.h. The backend's reductions (threshold clamping, range compares, block
 * skipping, sub-histograms, reciprocal bins) must agree with them on fresh random inputs of
 * awkward sizes and on the edges of every type. The seed is printed; set TALLY_TEST_SEED to
 * replay a failure.
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

#include "reference.h"
#include "tk_backend.h"
#include "tk_u16_slot.h"

/* ---- random inputs ------------------------------------------------------------------------ */

static uint64_t rng_state;

static uint64_t rng_next(void)
{
    /* splitmix64: good enough for test data, and reproducible from one seed. */
    uint64_t z = (rng_state += UINT64_C(0x9E3779B97F4A7C15));
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

/* A value in [a, b], a <= b, any int64 bounds. */
static int64_t rng_range(int64_t a, int64_t b)
{
    uint64_t span = (uint64_t)b - (uint64_t)a;
    uint64_t off = span == UINT64_MAX ? rng_next() : rng_next() % (span + 1);
    return (int64_t)((uint64_t)a + off);
}

static const size_t sizes[] = {0, 1, 2, 31, 32, 33, 1000, 1023, 1024, 1025, 4095, 4096, 65537};
#define N_SIZES (sizeof sizes / sizeof sizes[0])
#define MAX_N 65537

/* int32 data of a few shapes, so that every predicate sees both outcomes. */
static void fill_i32(int32_t *a, size_t n, int shape)
{
    for (size_t i = 0; i < n; i++) {
        switch (shape) {
        case 0: /* full range */
            a[i] = (int32_t)rng_range(INT32_MIN, INT32_MAX);
            break;
        case 1: /* narrow, around zero */
            a[i] = (int32_t)rng_range(-8, 8);
            break;
        case 2: /* the edges of the type */
        {
            static const int32_t edge[] = {INT32_MIN, INT32_MIN + 1, -1,       0,
                                           1,         INT32_MAX - 1, INT32_MAX};
            a[i] = edge[rng_next() % 7];
            break;
        }
        default: /* long runs of one value: whole blocks kept or dropped */
            a[i] = (i / 3000) % 2 ? 5 : -5;
            break;
        }
    }
}

static void fill_u8(uint8_t *a, size_t n, int shape)
{
    for (size_t i = 0; i < n; i++) {
        switch (shape) {
        case 0:
            a[i] = (uint8_t)rng_next();
            break;
        case 1:
            a[i] = (uint8_t)rng_range(0, 3);
            break;
        case 2:
            a[i] = (rng_next() & 1) ? 255 : 0;
            break;
        default:
            a[i] = (i / 3000) % 2 ? 200 : 7;
            break;
        }
    }
}
#define N_SHAPES 4

/* ---- fixture ------------------------------------------------------------------------------ */

typedef struct {
    tk_backend_t *be;
    int32_t *in32, *out32, *ref32;
    uint8_t *in8, *out8, *ref8;
    int64_t *out64, *ref64;
} fx_t;

#define GUARD 64 /* bytes past n that a call must leave alone */
#define POISON 0xA5

static int fx_setup(void **state)
{
    fx_t *f = calloc(1, sizeof *f);
    if (!f || tk_cpu_backend_new(&f->be) != TALLY_OK)
        return -1;
    size_t b32 = MAX_N * 4 + GUARD, b8 = MAX_N + GUARD, b64 = MAX_N * 8 + GUARD;
    f->in32 = malloc(b32);
    f->out32 = malloc(b32);
    f->ref32 = malloc(b32);
    f->in8 = malloc(b8);
    f->out8 = malloc(b8);
    f->ref8 = malloc(b8);
    f->out64 = malloc(b64);
    f->ref64 = malloc(b64);
    if (!f->in32 || !f->out32 || !f->ref32 || !f->in8 || !f->out8 || !f->ref8 || !f->out64 ||
        !f->ref64)
        return -1;
    *state = f;
    return 0;
}

static int fx_teardown(void **state)
{
    fx_t *f = *state;
    f->be->destroy(&f->be);
    free(f->in32);
    free(f->out32);
    free(f->ref32);
    free(f->in8);
    free(f->out8);
    free(f->ref8);
    free(f->out64);
    free(f->ref64);
    free(f);
    return 0;
}

static void assert_guard(const void *buf, size_t used_bytes)
{
    const uint8_t *p = (const uint8_t *)buf + used_bytes;
    for (size_t i = 0; i < GUARD; i++)
        assert_int_equal(p[i], POISON);
}

/* ---- filter ------------------------------------------------------------------------------- */

static const int64_t thr_i32[] = {0,
                                  -1,
                                  1,
                                  5,
                                  -5,
                                  INT32_MIN,
                                  INT32_MIN + 1,
                                  INT32_MAX,
                                  INT32_MAX - 1,
                                  (int64_t)INT32_MIN - 1,
                                  (int64_t)INT32_MAX + 1,
                                  INT64_MIN,
                                  INT64_MIN + 1,
                                  INT64_MAX,
                                  INT64_MAX - 1};
static const int64_t thr_u8[] = {0,   1,   2,   3,  7,  128,       200,      254,
                                 255, 256, 300, -1, -5, INT64_MIN, INT64_MAX};

static unsigned long long filter_checks;

/* Runs one i32 filter (out of place and in place) and compares it with the reference. */
static void check_filter_i32(fx_t *f, size_t n, const tk_filter_spec_t *spec)
{
    size_t kept = 12345;
    size_t k = tr_filter(TALLY_DTYPE_I32, f->in32, n, spec->pred, spec->lo, spec->hi, f->ref32);

    memset(f->out32, POISON, n * 4 + GUARD);
    assert_int_equal(f->be->filter(NULL, TALLY_DTYPE_I32, n ? f->in32 : NULL, n, spec,
                                   n ? f->out32 : NULL, &kept),
                     TALLY_OK);
    if (kept != k)
        fail_msg("i32 n=%zu pred=%d lo=%lld hi=%lld: kept %zu, want %zu", n, (int)spec->pred,
                 (long long)spec->lo, (long long)spec->hi, kept, k);
    assert_memory_equal(f->out32, f->ref32, k * 4);
    assert_guard(f->out32, n * 4);

    /* In place: the result overwrites the front of the input. */
    memcpy(f->out32, f->in32, n * 4);
    kept = 12345;
    assert_int_equal(f->be->filter(NULL, TALLY_DTYPE_I32, f->out32, n, spec, f->out32, &kept),
                     TALLY_OK);
    assert_int_equal(kept, k);
    assert_memory_equal(f->out32, f->ref32, k * 4);
    filter_checks += 2;
}

static void check_filter_u8(fx_t *f, size_t n, const tk_filter_spec_t *spec)
{
    size_t kept = 12345;
    size_t k = tr_filter(TALLY_DTYPE_U8, f->in8, n, spec->pred, spec->lo, spec->hi, f->ref8);

    memset(f->out8, POISON, n + GUARD);
    assert_int_equal(
        f->be->filter(NULL, TALLY_DTYPE_U8, n ? f->in8 : NULL, n, spec, n ? f->out8 : NULL, &kept),
        TALLY_OK);
    if (kept != k)
        fail_msg("u8 n=%zu pred=%d lo=%lld hi=%lld: kept %zu, want %zu", n, (int)spec->pred,
                 (long long)spec->lo, (long long)spec->hi, kept, k);
    assert_memory_equal(f->out8, f->ref8, k);
    assert_guard(f->out8, n);

    memcpy(f->out8, f->in8, n);
    kept = 12345;
    assert_int_equal(f->be->filter(NULL, TALLY_DTYPE_U8, f->out8, n, spec, f->out8, &kept),
                     TALLY_OK);
    assert_int_equal(kept, k);
    assert_memory_equal(f->out8, f->ref8, k);
    filter_checks += 2;
}

/* Every predicate, both modes, thresholds at and beyond the type's edges, and BETWEEN over all
 * pairs (lo > hi included: it keeps nothing). */
static void filter_sweep(fx_t *f, size_t n, int is_u8)
{
    const int64_t *thr = is_u8 ? thr_u8 : thr_i32;
    size_t nthr = is_u8 ? sizeof thr_u8 / sizeof thr_u8[0] : sizeof thr_i32 / sizeof thr_i32[0];
    /* The largest size repeats the whole sweep; a sample of BETWEEN pairs keeps it quick. */
    size_t pair_stride = n > 5000 ? 4 : 1;

    for (int stable = 0; stable <= 1; stable++) {
        for (int pred = TALLY_PRED_GT; pred <= TALLY_PRED_NE; pred++) {
            for (size_t t = 0; t < nthr + 2; t++) {
                tk_filter_spec_t spec = {.pred = (tally_pred_t)pred, .stable = stable};
                /* Two random thresholds besides the fixed ones. */
                spec.lo = t < nthr ? thr[t] : is_u8 ? rng_range(-2, 258) : rng_range(-10, 10);
                spec.hi = (int64_t)rng_next(); /* ignored by these predicates */
                if (is_u8)
                    check_filter_u8(f, n, &spec);
                else
                    check_filter_i32(f, n, &spec);
            }
        }
        for (size_t a = 0; a < nthr; a++) {
            for (size_t b = (a % pair_stride); b < nthr; b += pair_stride) {
                tk_filter_spec_t spec = {.pred = TALLY_PRED_BETWEEN, .stable = stable};
                spec.lo = thr[a];
                spec.hi = thr[b];
                if (is_u8)
                    check_filter_u8(f, n, &spec);
                else
                    check_filter_i32(f, n, &spec);
            }
        }
    }
}

static void test_filter_i32(void **state)
{
    fx_t *f = *state;
    for (size_t s = 0; s < N_SIZES; s++) {
        for (int shape = 0; shape < N_SHAPES; shape++) {
            fill_i32(f->in32, sizes[s], shape);
            filter_sweep(f, sizes[s], 0);
        }
    }
}

static void test_filter_u8(void **state)
{
    fx_t *f = *state;
    for (size_t s = 0; s < N_SIZES; s++) {
        for (int shape = 0; shape < N_SHAPES; shape++) {
            fill_u8(f->in8, sizes[s], shape);
            filter_sweep(f, sizes[s], 1);
        }
    }
}

/* Named cases of "nothing kept" and "everything kept", with the count stated, not computed. */
static void test_filter_none_all(void **state)
{
    fx_t *f = *state;
    const size_t n = 4099;
    size_t kept;
    struct {
        tally_dtype_t dtype;
        tally_pred_t pred;
        int64_t lo, hi;
        int all; /* 1: keeps every element, 0: keeps none */
    } cases[] = {
        {TALLY_DTYPE_U8, TALLY_PRED_GT, 300, 0, 0},
        {TALLY_DTYPE_U8, TALLY_PRED_GT, 255, 0, 0},
        {TALLY_DTYPE_U8, TALLY_PRED_GT, -5, 0, 1},
        {TALLY_DTYPE_U8, TALLY_PRED_GE, 0, 0, 1},
        {TALLY_DTYPE_U8, TALLY_PRED_LT, 0, 0, 0},
        {TALLY_DTYPE_U8, TALLY_PRED_LE, 255, 0, 1},
        {TALLY_DTYPE_U8, TALLY_PRED_LT, INT64_MIN, 0, 0},
        {TALLY_DTYPE_U8, TALLY_PRED_GT, INT64_MAX, 0, 0},
        {TALLY_DTYPE_U8, TALLY_PRED_EQ, 256, 0, 0},
        {TALLY_DTYPE_U8, TALLY_PRED_NE, -1, 0, 1},
        {TALLY_DTYPE_U8, TALLY_PRED_BETWEEN, INT64_MIN, INT64_MAX, 1},
        {TALLY_DTYPE_U8, TALLY_PRED_BETWEEN, 10, 9, 0},
        {TALLY_DTYPE_I32, TALLY_PRED_GT, INT32_MAX, 0, 0},
        {TALLY_DTYPE_I32, TALLY_PRED_GE, INT32_MIN, 0, 1},
        {TALLY_DTYPE_I32, TALLY_PRED_GT, (int64_t)INT32_MIN - 1, 0, 1},
        {TALLY_DTYPE_I32, TALLY_PRED_LT, INT32_MIN, 0, 0},
        {TALLY_DTYPE_I32, TALLY_PRED_LE, INT32_MAX, 0, 1},
        {TALLY_DTYPE_I32, TALLY_PRED_LT, INT64_MIN, 0, 0},
        {TALLY_DTYPE_I32, TALLY_PRED_GT, INT64_MAX, 0, 0},
        {TALLY_DTYPE_I32, TALLY_PRED_LE, INT64_MIN, 0, 0},
        {TALLY_DTYPE_I32, TALLY_PRED_GE, INT64_MAX, 0, 0},
        {TALLY_DTYPE_I32, TALLY_PRED_EQ, (int64_t)INT32_MAX + 1, 0, 0},
        {TALLY_DTYPE_I32, TALLY_PRED_NE, (int64_t)INT32_MIN - 1, 0, 1},
        {TALLY_DTYPE_I32, TALLY_PRED_BETWEEN, INT64_MIN, INT64_MAX, 1},
        {TALLY_DTYPE_I32, TALLY_PRED_BETWEEN, 0, -1, 0},
    };
    fill_i32(f->in32, n, 2); /* includes INT32_MIN and INT32_MAX */
    fill_u8(f->in8, n, 2);   /* 0 and 255 only */
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        tk_filter_spec_t spec = {.pred = cases[c].pred, .lo = cases[c].lo, .hi = cases[c].hi};
        int u8 = cases[c].dtype == TALLY_DTYPE_U8;
        void *out = u8 ? (void *)f->out8 : (void *)f->out32;
        const void *in = u8 ? (const void *)f->in8 : (const void *)f->in32;
        size_t bytes = n * (u8 ? 1 : 4);
        memset(out, POISON, bytes + GUARD);
        assert_int_equal(f->be->filter(NULL, cases[c].dtype, in, n, &spec, out, &kept), TALLY_OK);
        if (kept != (cases[c].all ? n : 0))
            fail_msg("case %zu: kept %zu", c, kept);
        if (cases[c].all)
            assert_memory_equal(out, in, bytes);
        assert_guard(out, bytes);
    }

    /* Everything kept through the range loop (not the whole-type shortcut). */
    for (size_t i = 0; i < n; i++)
        f->in32[i] = (int32_t)rng_range(0, 100);
    tk_filter_spec_t ge0 = {.pred = TALLY_PRED_GE, .lo = 0};
    assert_int_equal(f->be->filter(NULL, TALLY_DTYPE_I32, f->in32, n, &ge0, f->out32, &kept),
                     TALLY_OK);
    assert_int_equal(kept, n);
    assert_memory_equal(f->out32, f->in32, n * 4);
    tk_filter_spec_t gt100 = {.pred = TALLY_PRED_GT, .lo = 100};
    assert_int_equal(f->be->filter(NULL, TALLY_DTYPE_I32, f->in32, n, &gt100, f->out32, &kept),
                     TALLY_OK);
    assert_int_equal(kept, 0);
}

/* ---- scan --------------------------------------------------------------------------------- */

static void check_scan(fx_t *f, size_t n, int exclusive, int out_i32, int64_t carry0)
{
    int64_t carry = carry0;
    uint64_t want_carry = tr_scan(f->in32, n, exclusive, false, (uint64_t)carry0, f->ref64);

    void *out = out_i32 ? (void *)f->out32 : (void *)f->out64;
    size_t bytes = n * (out_i32 ? 4 : 8);
    memset(out, POISON, bytes + GUARD);
    assert_int_equal(
        f->be->scan(NULL, n ? f->in32 : NULL, n, exclusive, out_i32, n ? out : NULL, &carry),
        TALLY_OK);
    assert_int_equal((uint64_t)carry, want_carry);
    for (size_t i = 0; i < n; i++) {
        int64_t got = out_i32 ? f->out32[i] : f->out64[i];
        int64_t want = out_i32 ? (int32_t)(uint32_t)(uint64_t)f->ref64[i] : f->ref64[i];
        if (got != want)
            fail_msg("scan n=%zu excl=%d i32=%d carry=%lld: [%zu] = %lld, want %lld", n, exclusive,
                     out_i32, (long long)carry0, i, (long long)got, (long long)want);
    }
    assert_guard(out, bytes);

    if (out_i32) { /* in place: int32 output over its own input */
        memcpy(f->out32, f->in32, n * 4);
        carry = carry0;
        assert_int_equal(f->be->scan(NULL, f->out32, n, exclusive, 1, f->out32, &carry), TALLY_OK);
        assert_int_equal((uint64_t)carry, want_carry);
        for (size_t i = 0; i < n; i++)
            assert_int_equal(f->out32[i], (int32_t)(uint32_t)(uint64_t)f->ref64[i]);
    }
}

static void test_scan(void **state)
{
    fx_t *f = *state;
    const int64_t carries[] = {0, 1, -1, INT64_MAX, INT64_MIN, INT32_MAX, (int64_t)INT32_MIN - 7};
    for (size_t s = 0; s < N_SIZES; s++) {
        for (int shape = 0; shape < 6; shape++) {
            size_t n = sizes[s];
            if (shape < N_SHAPES)
                fill_i32(f->in32, n, shape);
            else /* all INT32_MAX or all INT32_MIN: the int32 output wraps at once */
                for (size_t i = 0; i < n; i++)
                    f->in32[i] = shape == 4 ? INT32_MAX : INT32_MIN;
            for (int ex = 0; ex <= 1; ex++)
                for (int o32 = 0; o32 <= 1; o32++) {
                    for (size_t c = 0; c < sizeof carries / sizeof carries[0]; c++)
                        check_scan(f, n, ex, o32, carries[c]);
                    check_scan(f, n, ex, o32, (int64_t)rng_next());
                }
        }
    }
}

/* A long array scanned in random chunks, the carry passed along, equals one whole scan. */
static void test_scan_chunked(void **state)
{
    fx_t *f = *state;
    const size_t n = MAX_N;
    for (int round = 0; round < 40; round++) {
        int ex = round & 1, o32 = (round >> 1) & 1;
        fill_i32(f->in32, n, round % N_SHAPES);
        int64_t carry0 = round < 8 ? 0 : (int64_t)rng_next();
        int64_t whole_carry = carry0, carry = carry0;
        size_t esz = o32 ? 4 : 8;
        uint8_t *whole = (uint8_t *)f->ref64, *chunked = (uint8_t *)f->out64;
        assert_int_equal(f->be->scan(NULL, f->in32, n, ex, o32, whole, &whole_carry), TALLY_OK);
        size_t at = 0;
        while (at < n) {
            size_t len = (size_t)rng_range(0, rng_next() % 3 ? 100 : 9000);
            if (len > n - at)
                len = n - at;
            assert_int_equal(
                f->be->scan(NULL, f->in32 + at, len, ex, o32, chunked + at * esz, &carry),
                TALLY_OK);
            at += len;
        }
        assert_int_equal(carry, whole_carry);
        assert_memory_equal(chunked, whole, n * esz);
    }
}

/* ---- histograms --------------------------------------------------------------------------- */

static void test_hist_u8(void **state)
{
    fx_t *f = *state;
    for (size_t s = 0; s < N_SIZES; s++) {
        for (int shape = 0; shape < N_SHAPES + 1; shape++) {
            size_t n = sizes[s];
            if (shape < N_SHAPES)
                fill_u8(f->in8, n, shape);
            else
                memset(f->in8, 42, n); /* all equal */
            static tk_hist_t got, want;
            memset(&got, 0, sizeof got);
            memset(&want, 0, sizeof want);
            /* Start from a running histogram: the backend adds. */
            for (int b = 0; b < TALLY_HIST_BINS; b++)
                got.bins[b] = want.bins[b] = rng_next() >> 20;
            got.underflow = want.underflow = 3;
            got.overflow = want.overflow = 4;
            tr_hist_parts(TALLY_DTYPE_U8, f->in8, n, 0, 0, want.bins, NULL, NULL);
            assert_int_equal(f->be->hist_u8(NULL, n ? f->in8 : NULL, n, &got), TALLY_OK);
            assert_memory_equal(&got, &want, sizeof got);
        }
    }

    /* Chunked equals whole. */
    tk_hist_t whole = {0}, chunked = {0};
    fill_u8(f->in8, MAX_N, 0);
    assert_int_equal(f->be->hist_u8(NULL, f->in8, MAX_N, &whole), TALLY_OK);
    for (size_t at = 0; at < MAX_N;) {
        size_t len = (size_t)rng_range(0, 5000);
        if (len > MAX_N - at)
            len = MAX_N - at;
        assert_int_equal(f->be->hist_u8(NULL, f->in8 + at, len, &chunked), TALLY_OK);
        at += len;
    }
    assert_memory_equal(&chunked, &whole, sizeof whole);
}

static void check_hist_i32(fx_t *f, size_t n, int64_t lo, int64_t hi)
{
    static tk_hist_t got, want;
    memset(&got, 0, sizeof got);
    memset(&want, 0, sizeof want);
    for (int b = 0; b < TALLY_HIST_BINS; b++)
        got.bins[b] = want.bins[b] = (uint64_t)b * 1000;
    got.underflow = want.underflow = 11;
    got.overflow = want.overflow = 22;
    tr_hist_parts(TALLY_DTYPE_I32, f->in32, n, lo, hi, want.bins, &want.underflow, &want.overflow);
    tally_status_t st = f->be->hist_i32(NULL, n ? f->in32 : NULL, n, lo, hi, &got);
    if (st != TALLY_OK)
        fail_msg("hist [%lld, %lld) n=%zu: status %d", (long long)lo, (long long)hi, n, (int)st);
    if (got.underflow != want.underflow || got.overflow != want.overflow)
        fail_msg("hist [%lld, %lld) n=%zu: under %llu over %llu, want %llu %llu", (long long)lo,
                 (long long)hi, n, (unsigned long long)got.underflow,
                 (unsigned long long)got.overflow, (unsigned long long)want.underflow,
                 (unsigned long long)want.overflow);
    for (int b = 0; b < TALLY_HIST_BINS; b++)
        if (got.bins[b] != want.bins[b])
            fail_msg("hist [%lld, %lld) n=%zu: bin %d = %llu, want %llu", (long long)lo,
                     (long long)hi, n, b, (unsigned long long)got.bins[b],
                     (unsigned long long)want.bins[b]);
}

/* Data that hits every bin edge of [lo, hi): the first and last value of each bin (both found
 * from the reference formula's inverse), the range ends, and the type's ends. */
static size_t fill_bin_edges(int32_t *a, size_t cap, int64_t lo, int64_t hi)
{
    uint64_t r = (uint64_t)hi - (uint64_t)lo;
    size_t n = 0;
    for (uint64_t b = 0; b <= TALLY_HIST_BINS && n + 4 <= cap; b++) {
        /* smallest d with 256 d >= b r, computed in 128 bits */
        unsigned __int128 edge = ((unsigned __int128)b * r + 255) / 256;
        for (int delta = -1; delta <= 1; delta++) {
            __int128 x = (__int128)lo + (__int128)edge + delta;
            if (x >= INT32_MIN && x <= INT32_MAX)
                a[n++] = (int32_t)x;
        }
    }
    a[n++] = INT32_MIN;
    a[n++] = INT32_MAX;
    return n;
}

static void test_hist_i32(void **state)
{
    fx_t *f = *state;
    const int64_t ranges[][2] = {
        {INT32_MIN, (int64_t)INT32_MAX + 1}, /* 2^32, the whole type: a shift */
        {0, 256},                            /* one value per bin */
        {-5, 3},                             /* narrower than the bins */
        {0, 1000},                           /* not a power of two */
        {-1000, 7},
        {1, 2},
        {INT32_MIN, INT32_MAX}, /* 2^32 - 1: the reciprocal with its correction */
        {-100, INT32_MAX},
        {INT32_MIN, 0},
        {-((int64_t)1 << 33), (int64_t)1 << 33},           /* 2^34: shift, wider than int32 */
        {-((int64_t)1 << 32), ((int64_t)1 << 33) + 1},     /* just over 2^33: binary search */
        {-((int64_t)1 << 32) - 1, ((int64_t)1 << 32) - 1}, /* exactly 2^33 */
        {-((int64_t)1 << 32), ((int64_t)1 << 32) + 1},     /* 2^33 + 1 */
        {INT64_MIN / 2, INT64_MAX / 2},
        {-((int64_t)1 << 55), (int64_t)1 << 55},          /* 2^56: the formula's widest */
        {INT64_MIN, INT64_MAX},                           /* beyond the formula: exact floor */
        {(int64_t)INT32_MAX + 1, (int64_t)INT32_MAX + 9}, /* everything underflows */
        {INT64_MIN, INT32_MIN},                           /* everything overflows */
    };
    for (size_t r = 0; r < sizeof ranges / sizeof ranges[0]; r++) {
        int64_t lo = ranges[r][0], hi = ranges[r][1];
        for (size_t s = 0; s < N_SIZES; s++)
            for (int shape = 0; shape < N_SHAPES; shape++) {
                fill_i32(f->in32, sizes[s], shape);
                check_hist_i32(f, sizes[s], lo, hi);
            }
        /* Uniform over the range itself (where it overlaps int32). */
        int64_t a = lo < INT32_MIN ? INT32_MIN : lo, b = hi - 1 > INT32_MAX ? INT32_MAX : hi - 1;
        if (a <= b) {
            for (size_t i = 0; i < MAX_N; i++)
                f->in32[i] = (int32_t)rng_range(a, b);
            check_hist_i32(f, MAX_N, lo, hi);
        }
        check_hist_i32(f, fill_bin_edges(f->in32, MAX_N, lo, hi), lo, hi);
    }
}

/* Random ranges of every width class: each bin edge checked, which is where a reciprocal would
 * go wrong. Widths cluster around the backend's path limits (powers of two, 2^33). */
static void test_hist_i32_random_ranges(void **state)
{
    fx_t *f = *state;
    for (int round = 0; round < 3000; round++) {
        int bits = (int)rng_range(0, 40);
        int64_t r = rng_range(1, (int64_t)1 << bits);
        if (round % 5 == 0)
            r = ((int64_t)1 << bits) + rng_range(-2, 2);
        if (r < 1)
            r = 1;
        int64_t lo = rng_range(-((int64_t)1 << 34), (int64_t)1 << 33);
        if (round % 3 == 0) /* keep most of the range inside int32 */
            lo = rng_range(INT32_MIN, INT32_MAX) - r / 2;
        int64_t hi = lo + r;
        size_t n = fill_bin_edges(f->in32, MAX_N - 200, lo, hi);
        for (int i = 0; i < 198; i++) /* plus random values in and around the range */
            f->in32[n++] = (int32_t)rng_range(INT32_MIN, INT32_MAX);
        check_hist_i32(f, n, lo, hi);
    }
}

static void test_hist_i32_chunked(void **state)
{
    fx_t *f = *state;
    const int64_t ranges[][2] = {{0, 1000}, {INT32_MIN, (int64_t)INT32_MAX + 1}, {-5, 3}};
    for (size_t r = 0; r < 3; r++) {
        tk_hist_t whole = {0}, chunked = {0};
        fill_i32(f->in32, MAX_N, r == 2 ? 1 : 0);
        assert_int_equal(f->be->hist_i32(NULL, f->in32, MAX_N, ranges[r][0], ranges[r][1], &whole),
                         TALLY_OK);
        for (size_t at = 0; at < MAX_N;) {
            size_t len = (size_t)rng_range(0, 5000);
            if (len > MAX_N - at)
                len = MAX_N - at;
            assert_int_equal(
                f->be->hist_i32(NULL, f->in32 + at, len, ranges[r][0], ranges[r][1], &chunked),
                TALLY_OK);
            at += len;
        }
        assert_memory_equal(&chunked, &whole, sizeof whole);
        uint64_t total = whole.underflow + whole.overflow;
        for (int b = 0; b < TALLY_HIST_BINS; b++)
            total += whole.bins[b];
        assert_int_equal(total, MAX_N);
    }
}

/* ---- arguments and the table -------------------------------------------------------------- */

static void test_invalid_args(void **state)
{
    fx_t *f = *state;
    tk_backend_t *be = f->be;
    tk_filter_spec_t spec = {.pred = TALLY_PRED_GT, .lo = 0};
    size_t kept = 0;
    int64_t carry = 0;
    tk_hist_t h = {0};

    f->in32[0] = 1;
    /* dtypes the filter does not take */
    const int bad_dtypes[] = {
        TALLY_DTYPE_NONE, TALLY_DTYPE_I64, TALLY_DTYPE_U64, TALLY_DTYPE_TEXT, 99, -1};
    for (size_t i = 0; i < sizeof bad_dtypes / sizeof bad_dtypes[0]; i++)
        assert_int_equal(
            be->filter(NULL, (tally_dtype_t)bad_dtypes[i], f->in32, 1, &spec, f->out32, &kept),
            TALLY_E_PARAM);
    /* predicates outside the enum, also with n == 0 */
    const int bad_preds[] = {0, 8, -1, 1000};
    for (size_t i = 0; i < sizeof bad_preds / sizeof bad_preds[0]; i++) {
        tk_filter_spec_t bad = {.pred = (tally_pred_t)bad_preds[i]};
        assert_int_equal(be->filter(NULL, TALLY_DTYPE_I32, f->in32, 1, &bad, f->out32, &kept),
                         TALLY_E_PARAM);
        assert_int_equal(be->filter(NULL, TALLY_DTYPE_U8, NULL, 0, &bad, NULL, &kept),
                         TALLY_E_PARAM);
    }
    /* missing pointers */
    assert_int_equal(be->filter(NULL, TALLY_DTYPE_I32, f->in32, 1, NULL, f->out32, &kept),
                     TALLY_E_PARAM);
    assert_int_equal(be->filter(NULL, TALLY_DTYPE_I32, f->in32, 1, &spec, f->out32, NULL),
                     TALLY_E_PARAM);
    assert_int_equal(be->filter(NULL, TALLY_DTYPE_I32, NULL, 1, &spec, f->out32, &kept),
                     TALLY_E_PARAM);
    assert_int_equal(be->filter(NULL, TALLY_DTYPE_I32, f->in32, 1, &spec, NULL, &kept),
                     TALLY_E_PARAM);
    assert_int_equal(be->scan(NULL, f->in32, 1, 0, 0, f->out64, NULL), TALLY_E_PARAM);
    assert_int_equal(be->scan(NULL, NULL, 1, 0, 0, f->out64, &carry), TALLY_E_PARAM);
    assert_int_equal(be->scan(NULL, f->in32, 1, 0, 0, NULL, &carry), TALLY_E_PARAM);
    assert_int_equal(be->hist_u8(NULL, f->in8, 1, NULL), TALLY_E_PARAM);
    assert_int_equal(be->hist_u8(NULL, NULL, 1, &h), TALLY_E_PARAM);
    assert_int_equal(be->hist_i32(NULL, f->in32, 1, 0, 10, NULL), TALLY_E_PARAM);
    assert_int_equal(be->hist_i32(NULL, NULL, 1, 0, 10, &h), TALLY_E_PARAM);
    /* empty or reversed ranges, also with n == 0 */
    assert_int_equal(be->hist_i32(NULL, f->in32, 1, 5, 5, &h), TALLY_E_PARAM);
    assert_int_equal(be->hist_i32(NULL, f->in32, 1, 6, 5, &h), TALLY_E_PARAM);
    assert_int_equal(be->hist_i32(NULL, NULL, 0, INT64_MAX, INT64_MIN, &h), TALLY_E_PARAM);
    tk_hist_t zero = {0};
    assert_memory_equal(&h, &zero, sizeof h); /* rejected calls had no effect */

    /* n == 0 with NULL buffers is valid everywhere and touches nothing. */
    kept = 99;
    assert_int_equal(be->filter(NULL, TALLY_DTYPE_U8, NULL, 0, &spec, NULL, &kept), TALLY_OK);
    assert_int_equal(kept, 0);
    spec.pred = TALLY_PRED_NE;
    spec.lo = -1; /* the keep-everything shortcut */
    kept = 99;
    assert_int_equal(be->filter(NULL, TALLY_DTYPE_I32, NULL, 0, &spec, NULL, &kept), TALLY_OK);
    assert_int_equal(kept, 0);
    carry = 42;
    assert_int_equal(be->scan(NULL, NULL, 0, 1, 1, NULL, &carry), TALLY_OK);
    assert_int_equal(carry, 42);
    assert_int_equal(be->hist_u8(NULL, NULL, 0, &h), TALLY_OK);
    assert_int_equal(be->hist_i32(NULL, NULL, 0, INT64_MIN, INT64_MAX, &h), TALLY_OK);
    assert_memory_equal(&h, &zero, sizeof h);
}

/* uint16: the multiply-shift bin equals the defining division for every value of many ranges
 * (exhaustively for 300 random widths and the edge cases), and the backend matches a plain
 * loop on random, all-equal and edge-heavy data, adding into a running histogram. */
static void test_hist_u16(void **state)
{
    fx_t *f = *state;
    for (int t = 0; t < 300 + 4; t++) {
        int64_t lo = 0, hi;
        if (t < 4) {
            hi = (int64_t[]){1, 2, 4096, 65536}[t];
        } else {
            lo = (int64_t)(rng_next() % 65535);
            hi = lo + 1 + (int64_t)(rng_next() % (uint64_t)(65536 - lo));
        }
        uint64_t mul;
        unsigned shift;
        tally_hist_u16_recip(lo, hi, &mul, &shift);
        for (int64_t x = lo; x < hi; x++) {
            unsigned want = tr_hist_bin(x, lo, hi);
            unsigned got = tally_hist_bin_u16((uint32_t)(x - lo), mul, shift);
            if (got != want)
                fail_msg("[%lld, %lld): x=%lld bin %u, want %u", (long long)lo, (long long)hi,
                         (long long)x, got, want);
        }
    }
    uint16_t *in = (uint16_t *)f->in32;
    static tk_hist_t got, want;
    for (size_t s = 0; s < N_SIZES; s++) {
        for (int shape = 0; shape < 3; shape++) {
            size_t n = sizes[s];
            int64_t lo = (int64_t)(rng_next() % 4000), hi = lo + 1 + (int64_t)(rng_next() % 5000);
            for (size_t i = 0; i < n; i++)
                in[i] = shape == 0   ? (uint16_t)rng_next()
                        : shape == 1 ? (uint16_t)lo
                                     : (uint16_t)(lo - 2 + (int64_t)(rng_next() % 5) +
                                                  (rng_next() & 1) * (hi - lo));
            memset(&got, 0, sizeof got);
            for (int b = 0; b < TALLY_HIST_BINS; b++)
                got.bins[b] = rng_next() >> 20;
            got.underflow = 5, got.overflow = 6;
            want = got;
            tr_hist_parts(TALLY_DTYPE_U16, in, n, lo, hi, want.bins, &want.underflow,
                          &want.overflow);
            assert_int_equal(f->be->hist_u16(NULL, n ? in : NULL, n, lo, hi, &got), TALLY_OK);
            assert_memory_equal(&got, &want, sizeof got);
        }
    }
    assert_int_equal(f->be->hist_u16(NULL, in, 1, 0, 65537, &got), TALLY_E_PARAM);
    assert_int_equal(f->be->hist_u16(NULL, in, 1, -1, 10, &got), TALLY_E_PARAM);
    assert_int_equal(f->be->hist_u16(NULL, in, 1, 5, 5, &got), TALLY_E_PARAM);
}

/* The CUDA histogram's form of the uint16 bin (kernels/tk_u16_slot.h, issue 34) is
 * tally_hist_bin_u16 plus one, 0 below the range and 257 above it, for every width R: checked on
 * both sides of every bin edge and of both ends, which covers every value because the slot is
 * monotone in the value. Ranges start at 0 for even R, elsewhere for odd R. */
static void test_u16_slot(void **state)
{
    (void)state;
    for (int64_t r = 1; r <= 65536; r++) {
        int64_t lo = r % 2 ? (r * 7919) % (65537 - r) : 0, hi = lo + r;
        uint64_t mul;
        unsigned shift;
        tally_hist_u16_recip(lo, hi, &mul, &shift);
        tk_u16_slot_t p;
        tk_u16_slot_init(lo, hi, &p);
        for (unsigned b = 0; b <= TALLY_HIST_BINS; b++) {
            int64_t edge = tally_hist_edge_at(lo, hi, b);
            for (int64_t x = edge - 1; x <= edge; x++) {
                if (x < 0 || x > 65535)
                    continue;
                int want = x < lo    ? 0
                           : x >= hi ? 257
                                     : 1 + (int)tally_hist_bin_u16((uint32_t)(x - lo), mul, shift);
                int got = tk_u16_slot((unsigned)x, &p);
                if (got != want)
                    fail_msg("[%lld, %lld): x=%lld slot %d, want %d", (long long)lo, (long long)hi,
                             (long long)x, got, want);
            }
        }
        if (lo > 0)
            assert_int_equal(tk_u16_slot(0, &p), 0);
        if (hi <= 65535)
            assert_int_equal(tk_u16_slot(65535, &p), 257);
    }
}

/* RGB and RGBA: channel c of every pixel in its own 256 bins, odd pixel counts included. */
static void test_hist_rgb(void **state)
{
    fx_t *f = *state;
    static tk_hist_t got, want;
    for (unsigned channels = 3; channels <= 4; channels++) {
        for (size_t s = 0; s < N_SIZES; s++) {
            size_t pixels = sizes[s] / channels;
            fill_u8(f->in8, pixels * channels, (int)(s % 3));
            memset(&got, 0, sizeof got);
            for (size_t b = 0; b < channels * TALLY_HIST_BINS; b++)
                got.bins[b] = rng_next() >> 30;
            want = got;
            tr_hist_parts(channels == 3 ? TALLY_DTYPE_RGB8 : TALLY_DTYPE_RGBA8, f->in8, pixels, 0,
                          0, want.bins, NULL, NULL);
            assert_int_equal(f->be->hist_rgb(NULL, pixels ? f->in8 : NULL, pixels, channels, &got),
                             TALLY_OK);
            assert_memory_equal(&got, &want, sizeof got);
        }
    }
    assert_int_equal(f->be->hist_rgb(NULL, f->in8, 1, 2, &got), TALLY_E_PARAM);
    assert_int_equal(f->be->hist_rgb(NULL, NULL, 1, 3, &got), TALLY_E_PARAM);
}

/* minmax folds each batch into a running pair: a batch inside what was seen moves neither end,
 * one past an end moves only that end, an empty batch moves nothing; the extremes of every type
 * arrive exact. Refused: a missing pointer, data missing for n > 0, a type it does not take. */
static void test_minmax(void **state)
{
    fx_t *f = *state;
    tk_backend_t *be = f->be;
    int64_t min = TK_MINMAX_EMPTY_MIN, max = TK_MINMAX_EMPTY_MAX;
    const int32_t i32[] = {7, -3, 12, 0};
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_I32, i32, 4, &min, &max), TALLY_OK);
    assert_int_equal(min, -3);
    assert_int_equal(max, 12);
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_I32, i32, 1, &min, &max), TALLY_OK); /* 7 */
    assert_int_equal(min, -3);
    assert_int_equal(max, 12);
    const int32_t ends[] = {INT32_MAX, INT32_MIN};
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_I32, ends, 1, &min, &max), TALLY_OK);
    assert_int_equal(min, -3);
    assert_int_equal(max, INT32_MAX);
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_I32, ends + 1, 1, &min, &max), TALLY_OK);
    assert_int_equal(min, INT32_MIN);
    assert_int_equal(max, INT32_MAX);
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_I32, NULL, 0, &min, &max), TALLY_OK);
    assert_int_equal(min, INT32_MIN);
    assert_int_equal(max, INT32_MAX);

    const uint8_t u8[] = {200, 5, 255, 0, 17};
    min = TK_MINMAX_EMPTY_MIN, max = TK_MINMAX_EMPTY_MAX;
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_U8, u8 + 1, 1, &min, &max), TALLY_OK);
    assert_int_equal(min, 5);
    assert_int_equal(max, 5);
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_U8, u8 + 4, 1, &min, &max), TALLY_OK); /* 17 */
    assert_int_equal(min, 5);
    assert_int_equal(max, 17);
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_U8, u8, 5, &min, &max), TALLY_OK);
    assert_int_equal(min, 0);
    assert_int_equal(max, 255);
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_U8, u8 + 4, 1, &min, &max), TALLY_OK);
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_U8, NULL, 0, &min, &max), TALLY_OK);
    assert_int_equal(min, 0);
    assert_int_equal(max, 255);

    const uint16_t u16[] = {1000, 65535, 3, 40000};
    min = TK_MINMAX_EMPTY_MIN, max = TK_MINMAX_EMPTY_MAX;
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_U16, u16, 1, &min, &max), TALLY_OK);
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_U16, u16 + 2, 1, &min, &max), TALLY_OK); /* 3 */
    assert_int_equal(min, 3);
    assert_int_equal(max, 1000);
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_U16, u16 + 3, 1, &min, &max), TALLY_OK);
    assert_int_equal(min, 3);
    assert_int_equal(max, 40000);
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_U16, u16, 4, &min, &max), TALLY_OK);
    assert_int_equal(min, 3);
    assert_int_equal(max, 65535);
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_U16, NULL, 0, &min, &max), TALLY_OK);
    assert_int_equal(min, 3);
    assert_int_equal(max, 65535);

    /* Refused, and the pair untouched. */
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_I32, i32, 4, NULL, &max), TALLY_E_PARAM);
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_I32, i32, 4, &min, NULL), TALLY_E_PARAM);
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_I32, NULL, 4, &min, &max), TALLY_E_PARAM);
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_I64, i32, 2, &min, &max), TALLY_E_PARAM);
    assert_int_equal(be->minmax(NULL, TALLY_DTYPE_RGB8, u8, 3, &min, &max), TALLY_E_PARAM);
    assert_int_equal(min, 3);
    assert_int_equal(max, 65535);
}

/* The refusals of the uint16 and colour histograms that test_hist_u16 and test_hist_rgb do not
 * make (no histogram, no data for n > 0, a range past 65535 or below 0, five channels), and
 * tk_backend_hist's for a type with no histogram: each leaves the histogram as it was. */
static void test_hist_refusals(void **state)
{
    fx_t *f = *state;
    tk_backend_t *be = f->be;
    static tk_hist_t h, zero;
    memset(&h, 0, sizeof h);
    uint16_t in[2] = {1, 2};
    assert_int_equal(be->hist_u16(NULL, in, 2, 0, 10, NULL), TALLY_E_PARAM);
    assert_int_equal(be->hist_u16(NULL, NULL, 2, 0, 10, &h), TALLY_E_PARAM);
    assert_int_equal(be->hist_u16(NULL, in, 2, -5, -1, &h), TALLY_E_PARAM);
    assert_int_equal(be->hist_u16(NULL, in, 2, 70000, 70001, &h), TALLY_E_PARAM);
    assert_int_equal(be->hist_rgb(NULL, f->in8, 1, 3, NULL), TALLY_E_PARAM);
    assert_int_equal(be->hist_rgb(NULL, f->in8, 1, 5, &h), TALLY_E_PARAM);
    assert_int_equal(be->hist_rgb(NULL, NULL, 0, 5, &h), TALLY_E_PARAM);
    assert_int_equal(tk_backend_hist(be, TALLY_DTYPE_I64, f->in32, 1, 0, 10, &h), TALLY_E_PARAM);
    assert_int_equal(tk_backend_hist(be, TALLY_DTYPE_TEXT, f->in8, 1, 0, 0, &h), TALLY_E_PARAM);
    assert_memory_equal(&h, &zero, sizeof h);
    /* ...while every type it takes reaches its own entry. */
    const uint8_t pixel[4] = {1, 2, 3, 4};
    assert_int_equal(tk_backend_hist(be, TALLY_DTYPE_RGBA8, pixel, 1, 0, 0, &h), TALLY_OK);
    assert_int_equal(h.bins[0 * TALLY_HIST_BINS + 1], 1);
    assert_int_equal(h.bins[3 * TALLY_HIST_BINS + 4], 1);
    assert_int_equal(tk_backend_hist(be, TALLY_DTYPE_U16, in, 2, 0, 2, &h), TALLY_OK);
    assert_int_equal(h.overflow, 1); /* 2 is past [0, 2) */
}

static void test_table(void **state)
{
    (void)state;
    tk_backend_t *be = NULL;
    char buf[64];

    assert_int_equal(tk_cpu_backend_new(NULL), TALLY_E_PARAM);
    assert_int_equal(tk_cpu_backend_new(&be), TALLY_OK);
    assert_non_null(be);
    assert_string_equal(be->name, "cpu");
    assert_non_null(be->filter);
    assert_non_null(be->scan);
    assert_non_null(be->hist_u8);
    assert_non_null(be->hist_i32);
    assert_non_null(be->hist_u16);
    assert_non_null(be->hist_rgb);
    be->describe(be->ctx, buf, sizeof buf);
    unsigned threads = 0;
    char tail[16] = "";
    assert_int_equal(sscanf(buf, "cpu: %u %15s", &threads, tail), 2);
    assert_true(threads >= 1);
    assert_string_equal(tail, "threads");
    memset(buf, 'x', sizeof buf);
    be->describe(be->ctx, buf, 4); /* truncated, still terminated */
    assert_string_equal(buf, "cpu");
    be->describe(be->ctx, NULL, 0);
    memset(buf, 'x', sizeof buf);
    be->describe(be->ctx, buf, 0); /* no room: nothing written */
    assert_int_equal(buf[0], 'x');
    void (*destroy)(tk_backend_t **) = be->destroy;
    destroy(&be);
    assert_null(be);
    destroy(&be); /* destroying NULL is a no-op */
    assert_null(be);
    destroy(NULL); /* and so is no pointer at all */
}

int main(void)
{
    const char *env = getenv("TALLY_TEST_SEED");
    uint64_t seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) ^ (uint64_t)clock();
    rng_state = seed;
    printf("test_cpu_backend: seed %llu (replay with TALLY_TEST_SEED=%llu)\n",
           (unsigned long long)seed, (unsigned long long)seed);

    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_table),
        cmocka_unit_test_setup_teardown(test_invalid_args, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_filter_i32, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_filter_u8, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_filter_none_all, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_scan, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_scan_chunked, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_hist_u8, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_hist_i32, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_hist_i32_random_ranges, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_hist_i32_chunked, fx_setup, fx_teardown),
        cmocka_unit_test(test_u16_slot),
        cmocka_unit_test_setup_teardown(test_hist_u16, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_hist_rgb, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_minmax, fx_setup, fx_teardown),
        cmocka_unit_test_setup_teardown(test_hist_refusals, fx_setup, fx_teardown),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    printf("test_cpu_backend: %llu filter calls checked\n", filter_checks);
    return failed;
}
