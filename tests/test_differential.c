/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_differential.c — the GPU path against the CPU backend, reply for reply (issue 10).
 *
 * test_differential_{fixed,random}_seed: one random request sequence, generated from a seed
 * (printed; TALLY_TEST_SEED forces the random run's), is sent to two tallyd: a reference
 * `--backend cpu` and one on the GPU path (`--backend cuda --test-sim-gpus 2` on every build,
 * the real GPUs with TALLY_PIPELINE_ENGINE=cuda; skipped with 77 when that cannot start). The
 * sequence covers every operation, dtype, predicate, flag and output width, sizes around the
 * CUDA kernels' warp and tile sizes (kernels/cuda/tk_cuda_internal.cuh) and the largest batch,
 * INT32_MIN/MAX runs, errors interleaved (bad parameters, hist range conflicts, oversize
 * payloads, unknown streams), and more streams than are in flight at once, reset and recreated
 * so that the GPU's carry slots pass from stream to stream. It is pipelined on several DEALER
 * connections, each owning a disjoint set of streams (so each stream's order is fixed) with a
 * window of requests in flight. Every reply is compared byte for byte between the two daemons
 * (an unordered filter's payload as a sorted multiset), and checked against the test's own model
 * of every stream (status, carry-out, kept count, and each query's payload). In the middle both
 * daemons are stopped with SIGTERM and restarted on their state directories (with another
 * --max-inflight) and every stream's query is compared to the model; again at the end.
 *
 * test_snapshot_prefix_{kill,term}: a GPU-path tallyd with --state-interval 1 under pipelined
 * mixed requests on 24 streams is stopped with SIGKILL (or SIGTERM) at a random moment and
 * restarted: every restored stream must equal the state after some prefix of its requests in
 * order (never a state that skipped or applied twice a request), and after SIGTERM a prefix that
 * holds every request answered ok. The model is computed from the payloads the test sent, and
 * each acknowledged reply is checked against it.
 *
 * Stateless `minmax` requests (i32, u8, u16, every count above, 0 included) check the CUDA
 * minmax kernel (kernels/cuda/tk_cuda_minmax.cu) against the CPU's and the model's min and max.
 *
 * The sequence also covers issue 12: u16, rgb8 and rgba8 histograms, `reset` (zeroed, kept)
 * against `delete` (forgotten), and window queries: both daemons read one test clock file
 * (--test-clock, 4 intervals of 1 s), which the test advances between batches of requests
 * (when nothing is in flight), and the model keeps each stream's per-interval histograms, so a
 * window query's record and its start/end (aux0/aux1) are checked too, across the restart.
 *
 * test_lost_connection_{unnumbered,numbered}: issue 30's fault case (tests/lib/lost_conn.h) on
 * the CPU backend and on the GPU path (`--backend cuda --test-sim-gpus 1`, or the real GPU): a
 * client pipelines 20 scans on one stream and then a frame over max_frame, so ZeroMQ closes its
 * connection in the middle of them. On each daemon the stream holds a subset of the scans, in
 * order, each once, and every reply that came back agrees with it (unnumbered: a refusal may
 * leave a gap); numbered, an exact prefix, and once the client has resent every batch after the
 * reconnect both daemons hold the same record byte for byte, all 20 batches in order.
 *
 * test_differential_shards (issue 31): the same sequence on two CPU-backend tallyd, one with
 * --shards 1 and one with --shards 4, swapping shard counts at the restart (a state file loaded
 * by another shard count than wrote it): every reply and every stream's record equal.
 *
 * test_query_behind_delete: a query, reset and delete pipelined behind a delete get
 * unknown_stream (they used to find the cleared stream, which then stayed listed: the
 * differential test found it, as a reply that depended on timing).
 *
 * Environment: TALLY_DIFF_SCALE (default 1) multiplies the number of requests (the GPU checks
 * run bigger); TALLY_DIFF_FAULT_EVERY=N adds --test-fault-every N to the GPU daemon of the random
 * run (failed GPU requests rerun on the CPU must answer the same); TALLY_DIFF_AUTO=SIZE runs the
 * GPU daemon in auto mode with --gpu-min-batch SIZE (a stream moving between the CPU and GPU);
 * TALLY_DIFF_GPU_SPIN_US=US gives it --gpu-spin-us US (lanes that poll the GPU, no host function
 * per launch: issue 34).
 */
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include <cmocka.h>

#include "harness.h"
#include "lost_conn.h"
#include "reference.h"

#define SKIP 77
#define CONNS 4
#define STREAMS_PER_CONN 7
#define NSTREAMS (CONNS * STREAMS_PER_CONN)
#define WINDOW 8
#define FIXED_SEED 20261123ull
/* Kernel shapes (kernels/cuda/tk_cuda_internal.cuh): a warp's and a tile's elements. */
#define SCAN_TILE 8192       /* 8 warps x 32 lanes x 8 vectors x 4 int32 */
#define SCAN_TILE_V12 12288  /* the 12-vector shape of the tuning rows (16: FILTER_U8_TILE) */
#define FILTER_I32_TILE 8192 /* 8 warps x 1024 */
#define FILTER_U8_TILE 16384 /* 8 warps x 2048 */
#define HIST_U8_PASS 32768   /* 512 threads x 16 bytes x 4 unrolled */
#define HIST_I32_PASS 8192
/* The window ring both daemons keep (--window-intervals, --window-interval-ms) and the test
 * clock they read. */
#define WIN_INTERVALS 4
#define WIN_MS 1000
#define CLOCK_START_MS 1795000000000ull

static bool use_cuda(void)
{
    const char *e = getenv("TALLY_PIPELINE_ENGINE");
    return e && strcmp(e, "cuda") == 0;
}

static unsigned scale(void)
{
    const char *e = getenv("TALLY_DIFF_SCALE");
    unsigned s = e ? (unsigned)strtoul(e, NULL, 10) : 1;
    return s ? s : 1;
}

/* ---- random numbers (own state: each test's sequence depends on its seed alone) --------- */

static uint64_t rng;

static uint64_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static uint64_t below(uint64_t n)
{
    return n ? rnd() % n : 0;
}

/* ---- the model of a stream -------------------------------------------------------------- */

typedef struct {
    char name[TALLY_STREAM_NAME_MAX + 1];
    bool exists;
    tally_stream_info_t info;
    tr_window_t ring; /* its window, as the protocol defines it */
} mstream_t;

static mstream_t model[NSTREAMS];

/* The test clock (ms since the epoch) and the file both daemons read it from. */
static uint64_t clock_ms;
static char clock_path[96];

static void clock_set(uint64_t ms)
{
    clock_ms = ms;
    assert_int_equal(th_write_clock(clock_path, ms), 0);
}

static void model_init(void)
{
    memset(model, 0, sizeof model);
    snprintf(clock_path, sizeof clock_path, "/tmp/tallyd-diff-clock-%d", (int)getpid());
    clock_set(CLOCK_START_MS);
    for (int i = 0; i < NSTREAMS; i++) {
        int conn = i % CONNS;
        tr_window_init(&model[i].ring, WIN_INTERVALS, WIN_MS);
        if (i == NSTREAMS - 1) /* a name of the longest length */
            snprintf(model[i].name, sizeof model[i].name, "%d/%s", conn,
                     "LLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLLL");
        else
            snprintf(model[i].name, sizeof model[i].name, "c%d/line%d~%c", conn, i, 'a' + i % 26);
    }
}

/* ---- requests --------------------------------------------------------------------------- */

typedef struct {
    uint8_t head[TALLY_REP_HEADER_SIZE];
    size_t head_len;
    uint8_t *payload;
    size_t len;
    int frames;
} raw_reply_t;

typedef struct {
    tally_req_t req;
    uint8_t *payload;
    size_t len;
    int conn;
    int stream; /* index in model, or -1 */
    /* What the model expects. */
    uint32_t want_status;
    bool check_aux0;
    uint64_t want_aux0;
    bool check_count;
    uint64_t want_count;
    bool check_aux1;
    uint64_t want_aux1;
    uint8_t *want_payload; /* query: the stream's encoded state */
    size_t want_len;
    uint64_t want_hist[TALLY_HIST_VALUES_MAX]; /* a hist batch's reply */
    raw_reply_t got[2];
} op_t;

typedef struct {
    op_t *v;
    size_t n, cap;
} ops_t;

static op_t *ops_add(ops_t *o, uint8_t opcode, uint8_t dtype, int conn, int stream)
{
    if (o->n == o->cap) {
        o->cap = o->cap ? 2 * o->cap : 256;
        o->v = realloc(o->v, o->cap * sizeof *o->v);
        assert_non_null(o->v);
    }
    op_t *op = &o->v[o->n];
    memset(op, 0, sizeof *op);
    op->req = th_req(opcode, dtype, o->n + 1); /* the id is the index + 1 */
    op->conn = conn;
    op->stream = stream;
    if (stream >= 0)
        assert_int_equal(tally_req_set_stream(&op->req, model[stream].name), TALLY_OK);
    o->n++;
    return op;
}

static void op_free_data(op_t *op)
{
    free(op->payload);
    free(op->want_payload);
    for (int d = 0; d < 2; d++)
        free(op->got[d].payload);
    op->payload = op->want_payload = NULL;
    op->got[0].payload = op->got[1].payload = NULL;
}

static void ops_free(ops_t *o)
{
    for (size_t i = 0; i < o->n; i++)
        op_free_data(&o->v[i]);
    free(o->v);
    memset(o, 0, sizeof *o);
}

/* ---- payloads --------------------------------------------------------------------------- */

static size_t max_batch_bytes(void)
{
    return use_cuda() ? 16u << 20 : 1u << 20;
}

/* Element counts: 0, 1, warp and tile edges and their neighbours, random, the largest batch. */
static size_t pick_count(size_t esize, bool allow_max)
{
    static const size_t edges[] = {0,
                                   1,
                                   2,
                                   3,
                                   31,
                                   32,
                                   33,
                                   127,
                                   128,
                                   129,
                                   1023,
                                   1024,
                                   1025,
                                   2047,
                                   2048,
                                   2049,
                                   SCAN_TILE - 1,
                                   SCAN_TILE,
                                   SCAN_TILE + 1,
                                   SCAN_TILE_V12 - 1,
                                   SCAN_TILE_V12,
                                   SCAN_TILE_V12 + 1,
                                   FILTER_U8_TILE - 1,
                                   FILTER_U8_TILE,
                                   FILTER_U8_TILE + 1,
                                   HIST_U8_PASS - 1,
                                   HIST_U8_PASS,
                                   HIST_U8_PASS + 1,
                                   3 * SCAN_TILE - 1,
                                   3 * SCAN_TILE + 1,
                                   65536 + 31};
    size_t max = max_batch_bytes() / esize;
    uint64_t r = below(100);
    if (allow_max && r < 2)
        return r ? max : max - 1 - below(40);
    if (r < 70)
        return edges[below(sizeof edges / sizeof edges[0])];
    return below(r < 90 ? 600 : 70000);
}

/* Values: uniform, small, INT32_MIN/MAX runs, one value, near the edges. */
static void fill_i32(int32_t *v, size_t n)
{
    int kind = (int)below(6);
    int32_t one = (int32_t)rnd();
    for (size_t i = 0; i < n; i++) {
        uint64_t r = rnd();
        switch (kind) {
        case 0:
            v[i] = (int32_t)(uint32_t)r;
            break;
        case 1:
            v[i] = (int32_t)(r % 2001) - 1000;
            break;
        case 2: /* runs of extremes */
            v[i] = (i / 37) % 2 ? INT32_MAX : INT32_MIN;
            if (r % 11 == 0)
                v[i] = (int32_t)(uint32_t)r;
            break;
        case 3:
            v[i] = INT32_MAX - (int32_t)(r % 3);
            break;
        case 4:
            v[i] = one;
            break;
        default:
            v[i] = r % 5 == 0 ? INT32_MIN + (int32_t)(r % 7) : (int32_t)(r % 300) - 20;
        }
    }
}

static void fill_u8(uint8_t *v, size_t n)
{
    int kind = (int)below(4);
    for (size_t i = 0; i < n; i++) {
        uint64_t r = rnd();
        v[i] = kind == 0   ? (uint8_t)r
               : kind == 1 ? (uint8_t)(r % 2 ? 255 : 0)
               : kind == 2 ? (uint8_t)(250 + r % 6)
                           : (uint8_t)(r % 7);
    }
}

/* uint16: uniform, 12-bit, the extremes, one value, around 4096. */
static void fill_u16(uint8_t *v, size_t n)
{
    int kind = (int)below(5);
    uint16_t one = (uint16_t)rnd();
    for (size_t i = 0; i < n; i++) {
        uint64_t r = rnd();
        uint16_t x = kind == 0   ? (uint16_t)r
                     : kind == 1 ? (uint16_t)(r & 0xfff)
                     : kind == 2 ? (uint16_t)(r % 2 ? 65535 : r % 3)
                     : kind == 3 ? one
                                 : (uint16_t)(4090 + r % 12);
        tally_put_u16(v + 2 * i, x);
    }
}

/* n elements of esize bytes: int32 (4) or bytes (1), or by the request's dtype for uint16
 * and pixels (rgb8 3, rgba8 4 bytes). */
static void make_payload(op_t *op, size_t n, size_t esize)
{
    op->len = n * esize;
    op->payload = malloc(op->len ? op->len : 1);
    assert_non_null(op->payload);
    uint8_t dt = op->req.dtype;
    if (dt == TALLY_DTYPE_U16 && esize == 2)
        fill_u16(op->payload, n);
    else if (tally_hist_channels(dt) > 1 || esize == 1)
        fill_u8(op->payload, op->len);
    else
        fill_i32((int32_t *)op->payload, n);
}

/* ---- the model's expectations ------------------------------------------------------------ */

/* A hist batch: its reply (want_hist, the defining formulas), and on a stream the running
 * histogram and the window slot of the current interval. */
static void expect_hist(op_t *op, size_t n, mstream_t *m)
{
    uint8_t dt = op->req.dtype;
    bool ranged = tally_hist_ranged(dt);
    unsigned channels = tally_hist_channels(dt);
    uint64_t *h = op->want_hist;
    tr_hist(dt, op->payload, n, op->req.lo, op->req.hi, h);
    op->check_aux0 = op->check_count = true;
    op->want_aux0 = n;
    op->want_count = tally_hist_values(dt);
    if (!m)
        return;
    tally_stream_info_t *info = &m->info;
    if (info->hist_dtype == TALLY_DTYPE_NONE) {
        info->hist_dtype = dt;
        info->hist_lo = ranged ? op->req.lo : 0;
        info->hist_hi = ranged ? op->req.hi : 0;
    }
    uint64_t under = ranged ? h[TALLY_HIST_BINS] : 0, over = ranged ? h[TALLY_HIST_BINS + 1] : 0;
    for (size_t b = 0; b < channels * TALLY_HIST_BINS; b++)
        info->bins[b] += h[b];
    info->hist_underflow += under;
    info->hist_overflow += over;
    info->hist_total += n;
    tr_window_add(&m->ring, clock_ms, h, channels * TALLY_HIST_BINS, under, over, n);
}

/* Sets the expectations of a compute request that succeeds, and applies it to its stream. */
static void expect_compute(op_t *op)
{
    size_t esize = tally_dtype_size((tally_dtype_t)op->req.dtype);
    size_t n = op->len / esize;
    tally_stream_info_t *info = op->stream >= 0 ? &model[op->stream].info : NULL;
    op->want_status = TALLY_OK;
    if (op->req.opcode == TALLY_OP_FILTER) {
        uint64_t kept =
            tr_filter(op->req.dtype, op->payload, n, op->req.pred, op->req.lo, op->req.hi, NULL);
        op->check_count = op->check_aux0 = true;
        op->want_count = kept;
        op->want_aux0 = n;
        if (info) {
            info->filter_seen += n;
            info->filter_kept += kept;
        }
    } else if (op->req.opcode == TALLY_OP_SCAN) {
        uint64_t carry = tr_sum(op->payload, n, info ? (uint64_t)info->scan_carry : 0);
        op->check_aux0 = op->check_count = true;
        op->want_aux0 = carry;
        op->want_count = n;
        if (info) {
            info->scan_carry = (int64_t)carry;
            info->scan_elements += n;
        }
    } else {
        expect_hist(op, n, info ? &model[op->stream] : NULL);
    }
    if (info) {
        model[op->stream].exists = true;
        info->batches++;
        info->elements += n;
        info->bytes += op->len;
    }
}

static void expect_query(op_t *op)
{
    mstream_t *m = &model[op->stream];
    if (!m->exists) {
        op->want_status = TALLY_E_UNKNOWN_STREAM;
        return;
    }
    op->want_status = TALLY_OK;
    op->want_payload = malloc(TALLY_QUERY_PAYLOAD_MAX);
    op->want_len = tally_stream_info_encode(&m->info, op->want_payload);
}

/* A window query of the last W ms: the stream's record with the histogram of the last
 * ceil(W / WIN_MS) intervals, aux0 its start and aux1 the clock; bad_window beyond the ring. */
static void gen_window_query(ops_t *o, int conn, int stream)
{
    static const int64_t windows[] = {1, 999, 1000, 1001, 2500, 3000, 4000, 4001, 60000};
    op_t *op = ops_add(o, TALLY_OP_QUERY, TALLY_DTYPE_NONE, conn, stream);
    op->req.flags = TALLY_FLAG_QUERY_WINDOW;
    op->req.lo = windows[below(sizeof windows / sizeof windows[0])];
    mstream_t *m = &model[stream];
    uint64_t k = ((uint64_t)op->req.lo + WIN_MS - 1) / WIN_MS;
    if (!m->exists || k > WIN_INTERVALS) {
        op->want_status = m->exists ? TALLY_E_WINDOW : TALLY_E_UNKNOWN_STREAM;
        return;
    }
    static tally_stream_info_t view;
    view = m->info;
    uint64_t start = tr_window_sum(&m->ring, clock_ms, (unsigned)k, &view);
    op->want_status = TALLY_OK;
    op->want_payload = malloc(TALLY_QUERY_PAYLOAD_MAX);
    op->want_len = tally_stream_info_encode(&view, op->want_payload);
    op->check_aux0 = op->check_aux1 = true;
    op->want_aux0 = start;
    op->want_aux1 = clock_ms;
}

/* ---- generating the sequence -------------------------------------------------------------- */

static const int64_t thresholds[] = {0,
                                     -1,
                                     1,
                                     255,
                                     256,
                                     300,
                                     -300,
                                     INT32_MAX,
                                     INT32_MIN,
                                     (int64_t)INT32_MAX + 1,
                                     (int64_t)INT32_MIN - 1,
                                     INT64_MAX,
                                     INT64_MIN,
                                     1000,
                                     -1000};

static int64_t pick_threshold(const op_t *op)
{
    size_t n = op->len / tally_dtype_size((tally_dtype_t)op->req.dtype);
    if (n && below(3) == 0)
        /* a value the batch holds: eq and ne matter */
        return tr_elem(op->req.dtype, op->payload, below(n));
    return thresholds[below(sizeof thresholds / sizeof thresholds[0])];
}

static void gen_filter(op_t *op, bool allow_max)
{
    op->req.dtype = below(2) ? TALLY_DTYPE_I32 : TALLY_DTYPE_U8;
    size_t esize = tally_dtype_size((tally_dtype_t)op->req.dtype);
    make_payload(op, pick_count(esize, allow_max), esize);
    op->req.pred = (uint8_t)(1 + below(7));
    op->req.flags = below(2) ? TALLY_FLAG_FILTER_STABLE : 0;
    op->req.lo = pick_threshold(op);
    if (op->req.pred == TALLY_PRED_BETWEEN) {
        int64_t other = pick_threshold(op);
        op->req.hi = other > op->req.lo ? other : op->req.lo;
        op->req.lo = other > op->req.lo ? op->req.lo : other;
    }
}

static void gen_scan(op_t *op, bool allow_max)
{
    op->req.dtype = TALLY_DTYPE_I32;
    make_payload(op, pick_count(4, allow_max), 4);
    op->req.flags = (uint8_t)below(4); /* SCAN_EXCLUSIVE | SCAN_OUT_I32 */
}

/* i32 ranges, edges included; a stream keeps the first it saw (later ones may conflict). */
static void pick_range(int64_t *lo, int64_t *hi)
{
    static const int64_t ranges[][2] = {
        {-1000, 1000},
        {INT32_MIN, (int64_t)INT32_MAX + 1},
        {0, 1},
        {INT32_MIN, (int64_t)INT32_MIN + 1},
        {INT32_MAX, (int64_t)INT32_MAX + 1},
        {-20, 237},
        {0, 257},
        {-5, 300},
    };
    size_t k = below(sizeof ranges / sizeof ranges[0]);
    *lo = ranges[k][0];
    *hi = ranges[k][1];
}

/* u16 ranges: 12 bits, 16 bits, one-value bins, the top value, a wide odd one. */
static void pick_range_u16(int64_t *lo, int64_t *hi)
{
    static const int64_t ranges[][2] = {
        {0, 4096}, {0, 65536}, {100, 356}, {65535, 65536}, {7, 60007}};
    size_t k = below(sizeof ranges / sizeof ranges[0]);
    *lo = ranges[k][0];
    *hi = ranges[k][1];
}

static uint8_t pick_hist_dtype(void)
{
    static const uint8_t dtypes[] = {TALLY_DTYPE_I32,  TALLY_DTYPE_I32,  TALLY_DTYPE_U8,
                                     TALLY_DTYPE_U8,   TALLY_DTYPE_U16,  TALLY_DTYPE_U16,
                                     TALLY_DTYPE_RGB8, TALLY_DTYPE_RGBA8};
    return dtypes[below(sizeof dtypes)];
}

static void gen_hist(op_t *op, bool allow_max)
{
    mstream_t *m = op->stream >= 0 ? &model[op->stream] : NULL;
    /* A stream keeps its histogram's type (gen_conflict makes the conflicts). */
    bool keep = m && m->info.hist_dtype != TALLY_DTYPE_NONE;
    op->req.dtype = keep ? m->info.hist_dtype : pick_hist_dtype();
    if (tally_hist_ranged(op->req.dtype)) {
        if (keep) {
            op->req.lo = m->info.hist_lo;
            op->req.hi = m->info.hist_hi;
        } else if (op->req.dtype == TALLY_DTYPE_U16) {
            pick_range_u16(&op->req.lo, &op->req.hi);
        } else {
            pick_range(&op->req.lo, &op->req.hi);
        }
    }
    size_t esize = tally_dtype_size((tally_dtype_t)op->req.dtype);
    make_payload(op, pick_count(esize, allow_max), esize);
}

/* A request that must fail, with the status the protocol gives it. */
static void gen_error(ops_t *o, int conn, int stream)
{
    size_t mb = max_batch_bytes();
    switch (below(9)) {
    case 0: { /* filter with a predicate out of range */
        op_t *op = ops_add(o, TALLY_OP_FILTER, TALLY_DTYPE_I32, conn, stream);
        op->req.pred = below(2) ? 0 : 8;
        make_payload(op, 5, 4);
        op->want_status = TALLY_E_PARAM;
        break;
    }
    case 1: { /* between with lo > hi */
        op_t *op = ops_add(o, TALLY_OP_FILTER, TALLY_DTYPE_U8, conn, stream);
        op->req.pred = TALLY_PRED_BETWEEN;
        op->req.lo = 10;
        op->req.hi = 9;
        make_payload(op, 40, 1);
        op->want_status = TALLY_E_PARAM;
        break;
    }
    case 2: { /* hist i32 with an empty or too wide range */
        op_t *op = ops_add(o, TALLY_OP_HIST, TALLY_DTYPE_I32, conn, stream);
        op->req.lo = below(2) ? 7 : INT32_MIN;
        op->req.hi = op->req.lo == 7 ? 7 : (int64_t)INT32_MAX + 2;
        make_payload(op, 33, 4);
        op->want_status = TALLY_E_PARAM;
        break;
    }
    case 3: { /* a payload not a whole number of int32 */
        op_t *op = ops_add(o, TALLY_OP_SCAN, TALLY_DTYPE_I32, conn, stream);
        make_payload(op, 31, 1);
        op->want_status = TALLY_E_PAYLOAD;
        break;
    }
    case 4: { /* a payload over max_batch (under the transport guard) */
        op_t *op = ops_add(o, TALLY_OP_SCAN, TALLY_DTYPE_I32, conn, stream);
        make_payload(op, mb / 4 + 1 + below(3), 4);
        op->want_status = TALLY_E_TOO_LARGE;
        break;
    }
    case 5: { /* scan flags it does not define */
        op_t *op = ops_add(o, TALLY_OP_SCAN, TALLY_DTYPE_I32, conn, stream);
        op->req.flags = TALLY_FLAG_FILTER_STABLE;
        make_payload(op, 3, 4);
        op->want_status = TALLY_E_PARAM;
        break;
    }
    case 6: { /* scan of u8 */
        op_t *op = ops_add(o, TALLY_OP_SCAN, TALLY_DTYPE_U8, conn, stream);
        make_payload(op, 8, 1);
        op->want_status = TALLY_E_DTYPE;
        break;
    }
    case 7: { /* query without a stream */
        op_t *op = ops_add(o, TALLY_OP_QUERY, TALLY_DTYPE_NONE, conn, -1);
        op->want_status = TALLY_E_STREAM_NAME;
        break;
    }
    default: { /* query of a stream that never existed */
        op_t *op = ops_add(o, TALLY_OP_QUERY, TALLY_DTYPE_NONE, conn, -1);
        char name[40];
        snprintf(name, sizeof name, "nobody/%d", conn);
        tally_req_set_stream(&op->req, name);
        op->want_status = TALLY_E_UNKNOWN_STREAM;
        break;
    }
    }
}

/* A hist whose dtype or range differs from the stream's: stream_state, no effect. */
static bool gen_conflict(ops_t *o, int conn, int stream)
{
    mstream_t *m = &model[stream];
    uint8_t have = m->info.hist_dtype;
    if (have == TALLY_DTYPE_NONE)
        return false;
    /* The same ranged dtype over another range, or another dtype. */
    uint8_t dt = tally_hist_ranged(have) && below(2) ? have : pick_hist_dtype();
    while (dt == have && !tally_hist_ranged(have))
        dt = pick_hist_dtype();
    op_t *op = ops_add(o, TALLY_OP_HIST, dt, conn, stream);
    if (dt == TALLY_DTYPE_I32) {
        bool other = have == TALLY_DTYPE_I32 && m->info.hist_lo == -1000;
        op->req.lo = other ? 0 : -1000;
        op->req.hi = other ? 1 : 1000;
    } else if (dt == TALLY_DTYPE_U16) {
        bool other = have == TALLY_DTYPE_U16 && m->info.hist_hi == 4096 && m->info.hist_lo == 0;
        op->req.lo = 0;
        op->req.hi = other ? 65536 : 4096;
    }
    make_payload(op, 17, tally_dtype_size((tally_dtype_t)op->req.dtype));
    op->want_status = TALLY_E_STREAM_STATE;
    return true;
}

/* A filter, scan or hist that succeeds; cap_len > 0 cuts its payload to at most that. */
static void gen_compute(ops_t *o, int conn, int stream, bool allow_max, size_t cap_len)
{
    uint64_t r = below(10);
    uint8_t opcode = r < 4 ? TALLY_OP_SCAN : r < 7 ? TALLY_OP_FILTER : TALLY_OP_HIST;
    op_t *op = ops_add(o, opcode, TALLY_DTYPE_I32, conn, stream);
    if (opcode == TALLY_OP_SCAN)
        gen_scan(op, allow_max);
    else if (opcode == TALLY_OP_FILTER)
        gen_filter(op, allow_max);
    else
        gen_hist(op, allow_max);
    size_t esize = tally_dtype_size((tally_dtype_t)op->req.dtype);
    if (cap_len && op->len > cap_len)
        op->len = cap_len - cap_len % esize; /* whole elements (an rgb8 pixel is 3 bytes) */
    expect_compute(op);
}

/* minmax (no stream): i32, u8 or u16, every count pick_count gives (0 included); the model's
 * answer is the reference's (tr_minmax), encoded as PROTOCOL.md §5 says
 * (min then max, each little-endian in the batch's type); no payload for an empty batch. */
static void gen_minmax(ops_t *o, int conn)
{
    static const uint8_t types[] = {TALLY_DTYPE_I32, TALLY_DTYPE_U8, TALLY_DTYPE_U16};
    op_t *op = ops_add(o, TALLY_OP_MINMAX, types[below(3)], conn, -1);
    size_t esize = tally_dtype_size((tally_dtype_t)op->req.dtype);
    size_t n = pick_count(esize, true);
    make_payload(op, n, esize);
    int64_t min, max;
    tr_minmax(op->req.dtype, op->payload, n, &min, &max);
    op->want_status = TALLY_OK;
    op->check_aux0 = op->check_count = true;
    op->want_aux0 = n;
    op->want_count = n ? 2 : 0;
    if (!n)
        return;
    op->want_len = 2 * esize;
    op->want_payload = malloc(op->want_len);
    assert_non_null(op->want_payload);
    for (size_t b = 0; b < esize; b++) {
        op->want_payload[b] = (uint8_t)((uint64_t)min >> (8 * b));
        op->want_payload[esize + b] = (uint8_t)((uint64_t)max >> (8 * b));
    }
}

/* One request of connection `conn`: on one of its streams, or stateless. */
static void gen_one(ops_t *o, int conn)
{
    int stream = conn + CONNS * (int)below(STREAMS_PER_CONN);
    mstream_t *m = &model[stream];
    uint64_t r = below(100);
    if (r < 9) {
        gen_compute(o, conn, -1, true, 0);
    } else if (r < 12) {
        gen_minmax(o, conn);
    } else if (r < 75) {
        gen_compute(o, conn, stream, true, 0);
    } else if (r < 80) {
        op_t *op = ops_add(o, TALLY_OP_QUERY, TALLY_DTYPE_NONE, conn, stream);
        expect_query(op);
    } else if (r < 84) {
        gen_window_query(o, conn, stream);
    } else if (r < 87) { /* reset: zeroed, kept with its type, range and last_seq */
        op_t *op = ops_add(o, TALLY_OP_RESET, TALLY_DTYPE_NONE, conn, stream);
        op->want_status = m->exists ? TALLY_OK : TALLY_E_UNKNOWN_STREAM;
        if (m->exists) {
            tally_stream_info_t kept = m->info;
            memset(&m->info, 0, sizeof m->info);
            m->info.hist_dtype = kept.hist_dtype;
            m->info.hist_lo = kept.hist_lo;
            m->info.hist_hi = kept.hist_hi;
            m->info.last_seq = kept.last_seq;
            tr_window_clear(&m->ring);
        }
    } else if (r < 90) { /* delete: forgotten */
        op_t *op = ops_add(o, TALLY_OP_DELETE, TALLY_DTYPE_NONE, conn, stream);
        op->want_status = m->exists ? TALLY_OK : TALLY_E_UNKNOWN_STREAM;
        if (m->exists) {
            memset(&m->info, 0, sizeof m->info);
            tr_window_clear(&m->ring);
            m->exists = false;
        }
    } else if (r < 94) {
        if (!gen_conflict(o, conn, stream))
            gen_compute(o, conn, stream, false, 0);
    } else if (r < 96) {
        op_t *op = ops_add(o, TALLY_OP_PING, TALLY_DTYPE_NONE, conn, -1);
        op->want_status = TALLY_OK;
    } else {
        gen_error(o, conn, below(2) ? stream : -1);
    }
}

/* A query of every stream (each on its own connection), then, alone, `streams`. */
static void gen_sync(ops_t *o)
{
    for (int i = 0; i < NSTREAMS; i++)
        expect_query(ops_add(o, TALLY_OP_QUERY, TALLY_DTYPE_NONE, i % CONNS, i));
}

/* ---- driving the daemons -------------------------------------------------------------- */

static int recv_raw(void *sock, raw_reply_t *out, int flags)
{
    memset(out, 0, sizeof *out);
    for (;;) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, sock, out->frames ? 0 : flags) < 0) {
            zmq_msg_close(&msg);
            return -1;
        }
        size_t len = zmq_msg_size(&msg);
        if (out->frames == 0) {
            out->head_len = len;
            memcpy(out->head, zmq_msg_data(&msg), len < sizeof out->head ? len : sizeof out->head);
        } else if (out->frames == 1) {
            out->len = len;
            out->payload = malloc(len ? len : 1);
            memcpy(out->payload, zmq_msg_data(&msg), len);
        }
        out->frames++;
        bool more = zmq_msg_more(&msg);
        zmq_msg_close(&msg);
        if (!more)
            return 0;
    }
}

static int send_op(void *sock, const op_t *op)
{
    return th_send_request(sock, &op->req, op->payload, op->len);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void connect_all(const th_daemon_t *d, void *socks[CONNS])
{
    for (int k = 0; k < CONNS; k++)
        socks[k] = th_connect(d->endpoint, 60000);
}

static void close_all(void *socks[CONNS])
{
    for (int k = 0; k < CONNS; k++)
        th_close(socks[k]);
}

/* Takes every reply waiting on sock into ops[..].got[which]; returns how many. */
static int take_replies(void *sock, ops_t *o, int which)
{
    int got = 0;
    raw_reply_t rr;
    while (recv_raw(sock, &rr, ZMQ_DONTWAIT) == 0) {
        uint64_t id = rr.head_len >= 16 ? tally_get_u64(rr.head + 8) : 0;
        if (id == 0 || id > o->n || o->v[id - 1].got[which].frames) {
            free(rr.payload);
            fail_msg("reply with unknown or repeated request id %llu", (unsigned long long)id);
        }
        o->v[id - 1].got[which] = rr;
        got++;
    }
    return got;
}

/* After a signal: takes the replies that still come, until none came for a second. */
static void collect_until_quiet(void *socks[CONNS], ops_t *o, int which)
{
    for (double start = now_s(); now_s() - start < 30;) {
        zmq_pollitem_t items[CONNS];
        for (int k = 0; k < CONNS; k++)
            items[k] = (zmq_pollitem_t){.socket = socks[k], .events = ZMQ_POLLIN};
        if (zmq_poll(items, CONNS, 1000) <= 0)
            return;
        for (int k = 0; k < CONNS; k++)
            take_replies(socks[k], o, which);
    }
}

/* Sends ops[from..to) over the connections, each keeping up to WINDOW requests in flight,
 * until all are answered, or (stop_after > 0) until stop_after seconds, when kill_pid gets sig
 * and the replies that still come are collected. */
static void drive(void *socks[CONNS], ops_t *o, size_t from, size_t to, int which,
                  double stop_after, pid_t kill_pid, double pace, int sig)
{
    size_t sent[CONNS] = {0};
    size_t next[CONNS], outstanding[CONNS] = {0};
    for (int k = 0; k < CONNS; k++)
        next[k] = from;
    double start = now_s(), last_progress = start;
    for (;;) {
        bool pending = false;
        for (int k = 0; k < CONNS; k++) {
            /* pace: a burst of WINDOW requests per WINDOW * pace seconds per connection, so a
             * stream still has several requests in flight at once */
            while (outstanding[k] < WINDOW &&
                   (!pace || now_s() - start > (double)(sent[k] / WINDOW * WINDOW) * pace)) {
                while (next[k] < to && o->v[next[k]].conn != k)
                    next[k]++;
                if (next[k] >= to)
                    break;
                assert_int_equal(send_op(socks[k], &o->v[next[k]]), 0);
                next[k]++;
                outstanding[k]++;
                sent[k]++;
            }
            pending |= outstanding[k] > 0 || next[k] < to;
        }
        if (!pending && !stop_after)
            return;
        if (stop_after > 0 && now_s() - start > stop_after) {
            kill(kill_pid, sig);
            collect_until_quiet(socks, o, which);
            return;
        }
        zmq_pollitem_t items[CONNS];
        for (int k = 0; k < CONNS; k++)
            items[k] = (zmq_pollitem_t){.socket = socks[k], .events = ZMQ_POLLIN};
        zmq_poll(items, CONNS, pace ? 2 : 100);
        for (int k = 0; k < CONNS; k++) {
            if (!(items[k].revents & ZMQ_POLLIN))
                continue;
            int got = take_replies(socks[k], o, which);
            assert_true((size_t)got <= outstanding[k]);
            outstanding[k] -= (size_t)got;
            last_progress = now_s();
        }
        if (now_s() - last_progress > 60)
            fail_msg("no reply for 60 s (%zu..%zu, daemon %d)", from, to, which);
    }
}

/* ---- comparing ------------------------------------------------------------------------ */

static int cmp_u8(const void *a, const void *b)
{
    return (int)*(const uint8_t *)a - (int)*(const uint8_t *)b;
}

/* `streams` names as a sorted, NUL-separated list. */
static char *sorted_names(const uint8_t *p, size_t len, size_t *count)
{
    char *names[NSTREAMS + 8];
    size_t n = 0;
    for (size_t at = 0; at < len && n < NSTREAMS + 8; n++) {
        size_t l = p[at];
        names[n] = strndup((const char *)p + at + 1, l);
        at += 1 + l;
    }
    for (size_t i = 1; i < n; i++)
        for (size_t j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
            char *t = names[j];
            names[j] = names[j - 1];
            names[j - 1] = t;
        }
    char *out = calloc(1, len + n + 1);
    for (size_t i = 0, at = 0; i < n; i++) {
        at += (size_t)sprintf(out + at, "%s|", names[i]);
        free(names[i]);
    }
    *count = n;
    return out;
}

/* A `streams` reply lists exactly the streams the model holds. */
static void check_streams_listing(const raw_reply_t *a)
{
    int idx[NSTREAMS], n = 0;
    for (int i = 0; i < NSTREAMS; i++)
        if (model[i].exists)
            idx[n++] = i;
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && strcmp(model[idx[j - 1]].name, model[idx[j]].name) > 0; j--) {
            int t = idx[j];
            idx[j] = idx[j - 1];
            idx[j - 1] = t;
        }
    char want[NSTREAMS * (TALLY_STREAM_NAME_MAX + 2) + 1] = "";
    for (int i = 0; i < n; i++)
        strcat(strcat(want, model[idx[i]].name), "|");
    size_t count;
    char *got = sorted_names(a->payload, a->len, &count);
    if (strcmp(got, want) != 0)
        fail_msg("streams lists %s, the model holds %s", got, want);
    free(got);
}

static void describe(const op_t *op, char *buf, size_t cap)
{
    snprintf(buf, cap,
             "request %llu (conn %d, %s %s flags %u pred %u lo %lld hi %lld, %zu bytes, "
             "stream '%s')",
             (unsigned long long)op->req.request_id, op->conn, tally_op_name(op->req.opcode),
             tally_dtype_name(op->req.dtype), op->req.flags, op->req.pred, (long long)op->req.lo,
             (long long)op->req.hi, op->len, op->req.stream);
}

/* The two daemons' replies to op are equal byte for byte, and as the model expects. */
static void compare_op(op_t *op)
{
    char what[256];
    describe(op, what, sizeof what);
    raw_reply_t *a = &op->got[0], *b = &op->got[1];
    if (a->frames != 2 || b->frames != 2 || a->head_len != 64 || b->head_len != 64)
        fail_msg("%s: malformed reply (%d/%d frames)", what, a->frames, b->frames);
    tally_rep_t ra, rb;
    assert_int_equal(tally_rep_decode(a->head, a->head_len, &ra), TALLY_OK);
    assert_int_equal(tally_rep_decode(b->head, b->head_len, &rb), TALLY_OK);
    if (memcmp(a->head, b->head, 64) != 0)
        fail_msg("%s: reply headers differ: cpu status %u count %llu aux0 %lld, gpu status %u "
                 "count %llu aux0 %lld",
                 what, ra.status, (unsigned long long)ra.count, (long long)ra.aux0, rb.status,
                 (unsigned long long)rb.count, (long long)rb.aux0);
    if (a->len != b->len)
        fail_msg("%s: payload lengths differ: %zu vs %zu", what, a->len, b->len);
    if (ra.status == TALLY_OK && op->req.opcode == TALLY_OP_FILTER &&
        !(op->req.flags & TALLY_FLAG_FILTER_STABLE)) { /* only the multiset is defined */
        size_t es = tally_dtype_size((tally_dtype_t)op->req.dtype);
        qsort(a->payload, a->len / es, es, es == 1 ? cmp_u8 : th_cmp_i32);
        qsort(b->payload, b->len / es, es, es == 1 ? cmp_u8 : th_cmp_i32);
    }
    if (op->req.opcode == TALLY_OP_STREAMS) {
        size_t ca, cb;
        char *na = sorted_names(a->payload, a->len, &ca);
        char *nb = sorted_names(b->payload, b->len, &cb);
        bool same = strcmp(na, nb) == 0;
        if (!same)
            fail_msg("streams differ: cpu %s, gpu %s", na, nb);
        free(na);
        free(nb);
    } else if (a->len && memcmp(a->payload, b->payload, a->len) != 0) {
        size_t i = 0;
        while (a->payload[i] == b->payload[i])
            i++;
        fail_msg("%s: payloads differ at byte %zu of %zu%s%.*s", what, i, a->len,
                 ra.status ? ": " : "", ra.status ? (int)a->len : 0, (const char *)a->payload);
    }
    /* Against the model. */
    if (ra.status != op->want_status)
        fail_msg("%s: status %u (%.*s), the model expects %u", what, ra.status,
                 ra.status ? (int)a->len : 0, ra.status ? (const char *)a->payload : "",
                 op->want_status);
    if (op->check_aux0 && ra.aux0 != op->want_aux0)
        fail_msg("%s: aux0 %lld, the model expects %lld", what, (long long)ra.aux0,
                 (long long)op->want_aux0);
    if (op->check_aux1 && ra.aux1 != op->want_aux1)
        fail_msg("%s: aux1 %lld, the model expects %lld", what, (long long)ra.aux1,
                 (long long)op->want_aux1);
    if (op->check_count && ra.count != op->want_count)
        fail_msg("%s: count %llu, the model expects %llu", what, (unsigned long long)ra.count,
                 (unsigned long long)op->want_count);
    if (ra.status == TALLY_OK && op->req.opcode == TALLY_OP_HIST)
        for (uint64_t i = 0; i < ra.count && 8 * i + 8 <= a->len; i++)
            if (tally_get_u64(a->payload + 8 * i) != op->want_hist[i])
                fail_msg("%s: hist value %llu is %llu, the model expects %llu", what,
                         (unsigned long long)i,
                         (unsigned long long)tally_get_u64(a->payload + 8 * i),
                         (unsigned long long)op->want_hist[i]);
    if (op->req.opcode == TALLY_OP_STREAMS)
        check_streams_listing(a);
    if (op->want_payload &&
        (a->len != op->want_len || memcmp(a->payload, op->want_payload, a->len) != 0)) {
        static tally_stream_info_t got, want;
        tally_stream_info_decode(a->payload, a->len, &got);
        tally_stream_info_decode(op->want_payload, op->want_len, &want);
        fail_msg("%s: query differs from the model: batches %llu/%llu carry %lld/%lld hist "
                 "total %llu/%llu",
                 what, (unsigned long long)got.batches, (unsigned long long)want.batches,
                 (long long)got.scan_carry, (long long)want.scan_carry,
                 (unsigned long long)got.hist_total, (unsigned long long)want.hist_total);
    }
}

/* ---- the differential test ---------------------------------------------------------- */

typedef struct {
    th_daemon_t d[2]; /* 0: cpu reference, 1: GPU path */
    char dir[2][64];
    void *socks[2][CONNS];
    char fault_every[16]; /* --test-fault-every for the GPU daemon, "" for none */
    char lanes[16];       /* --gpu-streams for the GPU daemon, "" for the default */
    /* test_differential_shards: both on the CPU backend, with these --shards (issue 31). */
    const char *shards[2];
} pair_t;

static int start_one(pair_t *p, int which, const char *inflight)
{
    char batch[32];
    snprintf(batch, sizeof batch, "%zu", max_batch_bytes());
    const char *argv[24];
    int argc = 0;
    bool gpu = which && !p->shards[which];
    argv[argc++] = "--backend";
    argv[argc++] = gpu ? (getenv("TALLY_DIFF_AUTO") ? "auto" : "cuda") : "cpu";
    if (p->shards[which]) {
        argv[argc++] = "--shards";
        argv[argc++] = p->shards[which];
    }
    if (gpu && getenv("TALLY_DIFF_AUTO")) { /* small batches on the CPU, larger on the GPU */
        argv[argc++] = "--gpu-min-batch";
        argv[argc++] = getenv("TALLY_DIFF_AUTO");
    }
    if (gpu && !use_cuda()) {
        argv[argc++] = "--test-sim-gpus";
        argv[argc++] = "2";
    }
    argv[argc++] = "--state-dir";
    argv[argc++] = p->dir[which];
    argv[argc++] = "--max-batch";
    argv[argc++] = batch;
    argv[argc++] = "--max-inflight";
    argv[argc++] = inflight;
    argv[argc++] = "--test-clock";
    argv[argc++] = clock_path;
    argv[argc++] = "--window-intervals";
    argv[argc++] = "4";
    if (gpu && p->lanes[0]) {
        argv[argc++] = "--gpu-streams";
        argv[argc++] = p->lanes;
    }
    if (gpu && getenv("TALLY_DIFF_GPU_SPIN_US")) { /* lanes that poll the GPU (issue 34) */
        argv[argc++] = "--gpu-spin-us";
        argv[argc++] = getenv("TALLY_DIFF_GPU_SPIN_US");
    }
    if (gpu && p->fault_every[0]) { /* GPU failures: the CPU reruns must be exact too */
        argv[argc++] = "--test-fault-every";
        argv[argc++] = p->fault_every;
    }
    argv[argc] = NULL;
    if (th_daemon_start(&p->d[which], argv) != 0)
        return -1;
    connect_all(&p->d[which], p->socks[which]);
    return 0;
}

static void stop_one(pair_t *p, int which)
{
    close_all(p->socks[which]);
    int rc = th_daemon_stop(&p->d[which], SIGTERM, 60000);
    if (rc != 0)
        fail_msg("tallyd (%s) exited with %d (log %s)", which ? "gpu" : "cpu", rc,
                 p->d[which].log_path);
    /* Every pinned reply buffer the GPU wrote a reply into came back from ZeroMQ. */
    if (th_daemon_log_contains(&p->d[which], "never given back"))
        fail_msg("tallyd (%s) lost GPU reply buffers (log %s)", which ? "gpu" : "cpu",
                 p->d[which].log_path);
}

/* Runs ops[from..) on both daemons, then compares every reply and frees the data. */
/* What a run covered, printed at its end. */
static struct {
    size_t ok[TALLY_OP_COUNT], errors, largest;
} tally_of_run;

static void run_compare(pair_t *p, ops_t *o, size_t from)
{
    for (int which = 0; which < 2; which++)
        drive(p->socks[which], o, from, o->n, which, 0, 0, 0, 0);
    for (size_t i = from; i < o->n; i++) {
        compare_op(&o->v[i]);
        if (o->v[i].want_status == TALLY_OK)
            tally_of_run.ok[o->v[i].req.opcode]++;
        else
            tally_of_run.errors++;
        if (o->v[i].want_status == TALLY_OK && o->v[i].len == max_batch_bytes())
            tally_of_run.largest++;
        op_free_data(&o->v[i]);
    }
}

static void sync_check(pair_t *p, ops_t *o)
{
    size_t from = o->n;
    gen_sync(o);
    run_compare(p, o, from);
    from = o->n;
    op_t *op = ops_add(o, TALLY_OP_STREAMS, TALLY_DTYPE_NONE, 0, -1);
    op->want_status = TALLY_OK;
    op->check_count = true;
    for (int i = 0; i < NSTREAMS; i++)
        op->want_count += model[i].exists;
    run_compare(p, o, from);
}

static void make_dir(char *dir, size_t cap, const char *tag)
{
    snprintf(dir, cap, "/tmp/tallyd-diff-%d-%s-XXXXXX", (int)getpid(), tag);
    assert_non_null(mkdtemp(dir));
}

static void remove_dir(const char *dir)
{
    assert_int_equal(th_rmrf(dir), 0);
}

static void differential(uint64_t seed, const char *inflight_before, const char *inflight_after,
                         unsigned fault_every, const char *const shards[2])
{
    fprintf(stderr,
            "differential: seed %llu (%s; TALLY_TEST_SEED=%llu reproduces the random "
            "run), scale %u\n",
            (unsigned long long)seed,
            shards       ? "cpu, shards"
            : use_cuda() ? "cuda"
                         : "sim",
            (unsigned long long)seed, scale());
    rng = seed;
    model_init();
    memset(&tally_of_run, 0, sizeof tally_of_run);
    pair_t p;
    memset(&p, 0, sizeof p);
    if (shards) {
        p.shards[0] = shards[0];
        p.shards[1] = shards[1];
    }
    if (fault_every)
        snprintf(p.fault_every, sizeof p.fault_every, "%u", fault_every);
    if (seed != FIXED_SEED) /* 1 to 4 lanes per device: streams share lanes and carries more */
        snprintf(p.lanes, sizeof p.lanes, "%u", 1 + (unsigned)(seed / 2 % 4));
    make_dir(p.dir[0], sizeof p.dir[0], "cpu");
    make_dir(p.dir[1], sizeof p.dir[1], "gpu");
    assert_int_equal(start_one(&p, 0, inflight_before), 0);
    assert_int_equal(start_one(&p, 1, inflight_before), 0);
    ops_t o = {0};
    size_t per_phase = 110 * scale();
    for (int phase = 0; phase < 2; phase++) {
        /* In steps: between them nothing is in flight and the clock moves on 1 to 3
         * intervals, so windows see batches in different intervals, and some age out. */
        for (size_t step = 0; step < 5; step++) {
            size_t from = o.n;
            for (size_t i = step * per_phase / 5; i < (step + 1) * per_phase / 5; i++)
                for (int k = 0; k < CONNS; k++)
                    gen_one(&o, k);
            run_compare(&p, &o, from);
            clock_set(clock_ms + WIN_MS * (1 + below(3)) + below(WIN_MS / 2));
        }
        sync_check(&p, &o);
        if (phase == 0) { /* stop and restore both, in the middle of the sequence */
            for (int which = 0; which < 2; which++)
                stop_one(&p, which);
            const char *swap = p.shards[0]; /* shards: each restores the other's shard count */
            p.shards[0] = p.shards[1];
            p.shards[1] = swap;
            assert_int_equal(start_one(&p, 0, inflight_after), 0);
            assert_int_equal(start_one(&p, 1, inflight_after), 0);
            sync_check(&p, &o);
        }
    }
    fprintf(stderr,
            "differential: %zu requests, every reply equal (ok: %zu filter, %zu scan, %zu hist, "
            "%zu minmax, %zu query, %zu reset, %zu delete; %zu errors; %zu of the largest "
            "batch)\n",
            o.n, tally_of_run.ok[TALLY_OP_FILTER], tally_of_run.ok[TALLY_OP_SCAN],
            tally_of_run.ok[TALLY_OP_HIST], tally_of_run.ok[TALLY_OP_MINMAX],
            tally_of_run.ok[TALLY_OP_QUERY], tally_of_run.ok[TALLY_OP_RESET],
            tally_of_run.ok[TALLY_OP_DELETE], tally_of_run.errors, tally_of_run.largest);
    for (int which = 0; which < 2; which++)
        stop_one(&p, which);
    ops_free(&o);
    remove_dir(p.dir[0]);
    remove_dir(p.dir[1]);
    unlink(clock_path);
}

static void test_differential_fixed_seed(void **state)
{
    (void)state;
    differential(FIXED_SEED, "3", "64", 0, NULL);
}

static void test_differential_random_seed(void **state)
{
    (void)state;
    uint64_t seed = th_seed();
    const char *e = getenv("TALLY_DIFF_FAULT_EVERY");
    differential(seed, seed % 2 ? "64" : "5", seed % 2 ? "2" : "64",
                 e ? (unsigned)strtoul(e, NULL, 10) : 0, NULL);
}

/* Issue 31: the same sequence on one shard and on four (both on the CPU backend), every reply
 * and every stream's record compared, across the restart: the streams of the CONNS connections
 * land on different shards, their requests pipelined at once; stateless ones go to the least
 * loaded shard. At the restart each daemon takes the other's shard count, so each state file is
 * loaded by a tallyd with another --shards than the one that wrote it. */
static void test_differential_shards(void **state)
{
    (void)state;
    if (use_cuda()) /* the GPU build's run covers the GPU path; this one the CPU's shards */
        skip();
    const char *const shards[2] = {"1", "4"};
    differential(th_seed(), "64", "5", 0, shards);
}

/* ---- a query and a reset queued behind a reset ------------------------------------------ */

/* Pipelines ops[0..count) on stream behind/reset, with ids from first_id; a scan's input is
 * 5, 6, 7. */
static void send_on_stream(void *sock, const uint8_t *ops, int count, uint64_t first_id)
{
    static const int32_t in[3] = {5, 6, 7};
    for (int i = 0; i < count; i++) {
        bool scan = ops[i] == TALLY_OP_SCAN;
        tally_req_t q = th_req(ops[i], scan ? TALLY_DTYPE_I32 : TALLY_DTYPE_NONE, first_id + i);
        tally_req_set_stream(&q, "behind/delete");
        assert_int_equal(th_send_request(sock, &q, scan ? in : NULL, scan ? sizeof in : 0), 0);
    }
}

/* They find the stream forgotten (unknown_stream), as they would had they been read after the
 * delete ran; the stream is not listed afterwards, and a scan starts it anew. A reset behind a
 * scan instead finds the stream, zeroes it and keeps it. Simulated launches of 30 ms make sure
 * all of it is read while the first scan is still on the "device". */
static void test_query_behind_delete(void **state)
{
    (void)state;
    th_daemon_t d;
    const char *argv[] = {"--backend", "cuda", "--test-sim-gpus", "1", NULL};
    if (use_cuda())
        skip();
    setenv("TALLYD_TEST_SIM_LATENCY_US", "30000", 1);
    int started = th_daemon_start(&d, argv);
    unsetenv("TALLYD_TEST_SIM_LATENCY_US");
    assert_int_equal(started, 0);
    void *sock = th_connect(d.endpoint, 20000);
    static const uint8_t ops[] = {TALLY_OP_SCAN,   TALLY_OP_DELETE, TALLY_OP_QUERY, TALLY_OP_RESET,
                                  TALLY_OP_DELETE, TALLY_OP_SCAN,   TALLY_OP_QUERY, TALLY_OP_SCAN,
                                  TALLY_OP_RESET,  TALLY_OP_QUERY};
    static const uint32_t want[] = {TALLY_OK,
                                    TALLY_OK,
                                    TALLY_E_UNKNOWN_STREAM,
                                    TALLY_E_UNKNOWN_STREAM,
                                    TALLY_E_UNKNOWN_STREAM,
                                    TALLY_OK,
                                    TALLY_OK,
                                    TALLY_OK,
                                    TALLY_OK,
                                    TALLY_OK};
    send_on_stream(sock, ops, 10, 100);
    for (int i = 0; i < 10; i++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(sock, &r), 0);
        assert_int_equal(r.rep.request_id, 100 + i); /* one stream: replies in order */
        if (r.rep.status != want[i])
            fail_msg("request %d: status %u (%s), want %u", i, r.rep.status,
                     r.rep.status ? (char *)r.payload : "", want[i]);
        if (i == 5) /* started anew: the carry from 0 */
            assert_int_equal(r.rep.aux0, 18);
        if (i == 7) /* continues the carry */
            assert_int_equal(r.rep.aux0, 36);
        if (i == 6 || i == 9) { /* after the reset: zeroed, not forgotten */
            tally_stream_info_t info;
            assert_int_equal(tally_stream_info_decode(r.payload, r.len, &info), TALLY_OK);
            assert_int_equal(info.batches, i == 6 ? 1 : 0);
            assert_true(info.scan_carry == (i == 6 ? 18 : 0));
        }
        th_reply_free(&r);
    }
    /* Delete, then queries queued behind it and nothing else: the name is gone. */
    static const uint8_t tail_ops[] = {TALLY_OP_SCAN, TALLY_OP_DELETE, TALLY_OP_QUERY};
    send_on_stream(sock, tail_ops, 3, 200);
    for (int i = 0; i < 3; i++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(sock, &r), 0);
        assert_int_equal(r.rep.status, i < 2 ? TALLY_OK : TALLY_E_UNKNOWN_STREAM);
        th_reply_free(&r);
    }
    tally_req_t list = th_req(TALLY_OP_STREAMS, TALLY_DTYPE_NONE, 300);
    th_reply_t r;
    assert_int_equal(th_call_reply_status(sock, &list, NULL, 0, &r), TALLY_OK);
    assert_int_equal(r.rep.count, 0);
    th_reply_free(&r);
    assert_int_equal(th_close_and_stop(sock, &d, 20000), 0);
}

/* ---- a connection lost in the middle of a pipeline (issue 30) -------------------------- */

#define LOST_SCANS 20

/* Issue 30's case on the CPU reference (which 0) and on the GPU path (1); numbered: the
 * client's resend too, and the two records compared. */
static void lost_connection(bool numbered)
{
    uint8_t rec[2][2176];
    long len[2];
    for (int which = 0; which < 2; which++) {
        const char *cpu[] = {"--backend", "cpu", "--max-batch", "64K", NULL};
        const char *gpu[] = {
            "--backend", "cuda", "--max-batch", "64K", use_cuda() ? NULL : "--test-sim-gpus",
            "1",         NULL};
        th_daemon_t d;
        assert_int_equal(th_daemon_start(&d, which ? gpu : cpu), 0);
        void *sock = NULL;
        lc_run_t run;
        assert_int_equal(lc_run(&d, "gap",
                                "\x80"
                                "diff-lost",
                                numbered, LOST_SCANS, 2500, &sock, &run),
                         0);
        fprintf(stderr, "lost connection (%s, %s): %d replies back, %lld ok, %lld busy, %lld gap\n",
                which ? "gpu" : "cpu", numbered ? "numbered" : "unnumbered", run.replies, run.ok,
                run.busy, run.gap);
        const char *bad = lc_check(&run);
        if (!bad && numbered)
            bad = lc_resend(&d, sock, "gap", &run);
        if (bad)
            fail_msg("%s: %s (log %s)", which ? "gpu" : "cpu", bad, d.log_path);
        len[which] = lc_record(&d, "gap", rec[which], sizeof rec[which]);
        th_close(sock);
        assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
    }
    if (numbered) /* every batch once, in order, on both: the same record */
        assert_true(len[0] > 0 && len[0] == len[1] && memcmp(rec[0], rec[1], (size_t)len[0]) == 0);
}

static void test_lost_connection_unnumbered(void **state)
{
    (void)state;
    lost_connection(false);
}

static void test_lost_connection_numbered(void **state)
{
    (void)state;
    lost_connection(true);
}

/* ---- snapshot consistency under SIGKILL ----------------------------------------------- */

#define SNAP_STREAMS 24

/* Each connection's requests on its 6 streams (no resets, no errors), and in after[i] the
 * model's encoded state of op i's stream once op i is applied. */
static uint8_t **gen_snapshot_ops(ops_t *o, size_t per_conn)
{
    enum { PER_STREAM = SNAP_STREAMS / CONNS };
    uint8_t **after = calloc(per_conn * CONNS + 1, sizeof *after);
    for (size_t i = 0; i < per_conn; i++)
        for (int k = 0; k < CONNS; k++) {
            int stream = k + CONNS * (int)below(PER_STREAM);
            gen_compute(o, k, stream, false, 40000); /* quick: small batches, many of them */
            after[o->n - 1] = malloc(TALLY_QUERY_PAYLOAD_MAX);
            tally_stream_info_encode(&model[stream].info, after[o->n - 1]);
        }
    return after;
}

/* Every acknowledged reply agrees with the model (a `shutdown` reply: not run). last_ok[s]
 * receives how many of stream s's requests, in order, were up to its last one answered ok. */
static size_t check_acked(const ops_t *o, size_t last_ok[SNAP_STREAMS])
{
    size_t acked = 0, position[SNAP_STREAMS] = {0};
    for (size_t i = 0; i < o->n; i++) {
        const op_t *op = &o->v[i];
        const raw_reply_t *g = &op->got[0];
        position[op->stream]++;
        if (!g->frames)
            continue;
        acked++;
        tally_rep_t rep;
        assert_int_equal(tally_rep_decode(g->head, g->head_len, &rep), TALLY_OK);
        if (rep.status == TALLY_E_SHUTDOWN)
            continue;
        char what[256];
        describe(op, what, sizeof what);
        if (rep.status != TALLY_OK || rep.aux0 != op->want_aux0 || rep.count != op->want_count)
            fail_msg("%s: status %u count %llu aux0 %lld, the model expects 0, %llu, %lld", what,
                     rep.status, (unsigned long long)rep.count, (long long)rep.aux0,
                     (unsigned long long)op->want_count, (long long)op->want_aux0);
        if (op->req.opcode == TALLY_OP_HIST)
            for (uint64_t b = 0; b < rep.count; b++)
                if (tally_get_u64(g->payload + 8 * b) != op->want_hist[b])
                    fail_msg("%s: bin %llu differs from the model", what, (unsigned long long)b);
        last_ok[op->stream] = position[op->stream];
    }
    return acked;
}

/* The length of an encoded stream record, from its histogram dtype (byte 56). */
static size_t record_len(const uint8_t *rec)
{
    unsigned channels = tally_hist_channels(rec[56]);
    return 128 + 2048 * (size_t)(channels ? channels : 1);
}

/* The restored state of stream s equals the state after one prefix of its requests, of at
 * least min_prefix of them; returns that prefix's length (0: the stream was not restored). */
static size_t check_restored(void *sock, const ops_t *o, uint8_t **after, int s, size_t min_prefix)
{
    tally_req_t q = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, 1000000 + s);
    tally_req_set_stream(&q, model[s].name);
    th_reply_t r;
    assert_int_equal(th_call(sock, &q, NULL, 0, &r), 0);
    size_t prefix = 0, matched = 0;
    if (r.rep.status == TALLY_OK) {
        for (size_t i = 0; i < o->n && !matched; i++)
            if (o->v[i].stream == s && ++prefix && r.len == record_len(after[i]) &&
                memcmp(after[i], r.payload, r.len) == 0)
                matched = prefix;
        if (!matched) {
            tally_stream_info_t info;
            tally_stream_info_decode(r.payload, r.len, &info);
            fail_msg("stream '%s' restored with batches %llu, carry %lld, hist total %llu: not "
                     "the state after any prefix of its %zu requests",
                     model[s].name, (unsigned long long)info.batches, (long long)info.scan_carry,
                     (unsigned long long)info.hist_total, prefix);
        }
    } else {
        assert_int_equal(r.rep.status, TALLY_E_UNKNOWN_STREAM); /* the empty prefix */
    }
    th_reply_free(&r);
    if (matched < min_prefix)
        fail_msg("stream '%s' restored after %zu of its requests, but %zu were answered before "
                 "the daemon stopped",
                 model[s].name, matched, min_prefix);
    return matched;
}

/* A GPU-path tallyd with 1 s snapshots, requests pipelined on 24 streams, stopped with sig at a
 * random moment in the middle of them, restarted on its state: every stream is a prefix of its
 * requests; after SIGTERM, one that holds every request answered ok. */
static void snapshot_round(int sig)
{
    uint64_t seed = th_seed();
    rng = seed ^ 0x9E3779B97F4A7C15ull;
    model_init();
    size_t per_conn = 900 * (scale() > 2 ? 2 : scale()); /* its payloads are all kept */
    ops_t o = {0};
    uint8_t **after = gen_snapshot_ops(&o, per_conn);
    char dir[64];
    make_dir(dir, sizeof dir, "snap");
    const char *argv[] = {"--backend",
                          "cuda",
                          use_cuda() ? "--gpu-streams" : "--test-sim-gpus",
                          "2",
                          "--state-dir",
                          dir,
                          "--state-interval",
                          "1",
                          "--max-batch",
                          "1M",
                          NULL};
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, argv), 0);
    void *socks[CONNS];
    connect_all(&d, socks);
    double stop_at = 1.8 + (double)below(1200) / 1000.0;
    /* Paced so the requests span about 3.2 s: the signal lands in the middle of them. */
    drive(socks, &o, 0, o.n, 0, stop_at, d.pid, 3.2 / (double)per_conn, sig);
    int rc = th_daemon_stop(&d, 0, 60000); /* signalled already: reap it */
    close_all(socks);
    if (sig == SIGTERM && rc != 0)
        fail_msg("tallyd exited with %d after SIGTERM (log %s)", rc, d.log_path);
    size_t last_ok[SNAP_STREAMS] = {0};
    size_t acked = check_acked(&o, last_ok);
    assert_int_equal(th_daemon_start(&d, argv), 0);
    void *sock = th_connect(d.endpoint, 30000);
    int restored = 0;
    for (int s = 0; s < SNAP_STREAMS; s++)
        restored += check_restored(sock, &o, after, s, sig == SIGTERM ? last_ok[s] : 0) > 0;
    fprintf(stderr,
            "snapshot: %s after %.2f s, %zu of %zu requests acknowledged, %d streams restored\n",
            sig == SIGTERM ? "SIGTERM" : "SIGKILL", stop_at, acked, o.n, restored);
    /* Requests ran for over a second with 1 s snapshots: some state was saved. */
    assert_true(restored > 0);
    assert_int_equal(th_close_and_stop(sock, &d, 30000), 0);
    for (size_t i = 0; i < o.n; i++)
        free(after[i]);
    free(after);
    ops_free(&o);
    remove_dir(dir);
    unlink(clock_path);
}

static void test_snapshot_prefix_kill(void **state)
{
    (void)state;
    snapshot_round(SIGKILL);
}

static void test_snapshot_prefix_term(void **state)
{
    (void)state;
    snapshot_round(SIGTERM);
}

int main(void)
{
    if (use_cuda()) { /* no GPU here: skip rather than fail */
        th_daemon_t probe;
        const char *argv[] = {"--backend", "cuda", NULL};
        if (th_daemon_start(&probe, argv) != 0) {
            fprintf(stderr, "tallyd --backend cuda does not start: no usable GPU, skipping\n");
            return SKIP;
        }
        th_daemon_stop(&probe, SIGTERM, 20000);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_differential_fixed_seed),
        cmocka_unit_test(test_differential_random_seed),
        cmocka_unit_test(test_differential_shards),
        cmocka_unit_test(test_snapshot_prefix_kill),
        cmocka_unit_test(test_snapshot_prefix_term),
        cmocka_unit_test(test_query_behind_delete),
        cmocka_unit_test(test_lost_connection_unnumbered),
        cmocka_unit_test(test_lost_connection_numbered),
    };
    return cmocka_run_group_tests_name(use_cuda() ? "differential (cuda)" : "differential (sim)",
                                       tests, NULL, NULL);
}
