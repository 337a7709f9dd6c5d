/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_pipeline.c — integration tests of tallyd's executor and GPU pipeline (td_exec.c,
 * td_gpu.c): a real tallyd on a loopback port, driven over a raw DEALER socket.
 *
 * The same tests run on two engines, chosen by TALLY_PIPELINE_ENGINE:
 *   sim  (default, every build): --test-sim-gpus 2, the pipeline over simulated devices, so CI
 *        without a GPU covers lanes, in-order completion, the carry chained on the "device",
 *        the CPU fallback and a device going unusable;
 *   cuda (test_pipeline_gpu, CUDA builds): the real GPUs; skipped (77) when tallyd cannot
 *        start with --backend cuda (no GPU).
 * What they check: every operation against a plain reference; chunked scans on several
 * streams at once, pipelined with queries between, equal to the whole-array scan; a stream
 * switching between the CPU and GPU paths (auto mode threshold); every request answered at a
 * tiny in-flight limit; and the error path forced by --test-fault-every: results still exact,
 * backend_fallbacks counted, and with every request failing the device marked unusable, logged,
 * and the work served by the CPU backend; and a stream's replies in send order when one of its
 * requests is refused while the ones before it are on the GPU.
 */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include <cmocka.h>

#include "harness.h"
#include "reference.h"

#define SKIP 77
/* Streams scanned at once, and the chunks each is cut into. */
#define STREAMS 3
#define MAX_CHUNKS 24

static uint64_t next_id = 1;
static const char *engine_args[8];

static bool use_cuda(void)
{
    const char *e = getenv("TALLY_PIPELINE_ENGINE");
    return e && strcmp(e, "cuda") == 0;
}

/* Starts tallyd on the GPU path of the engine under test, plus extra (NULL-terminated). */
static int start(th_daemon_t *d, const char *const *extra)
{
    return th_daemon_start_with(d, engine_args, extra);
}

static int32_t *random_i32(size_t n, uint32_t range)
{
    int32_t *v = malloc(n * sizeof *v + 4);
    for (size_t i = 0; i < n; i++) {
        uint64_t r = th_rand();
        v[i] = range ? (int32_t)(r % range) - (int32_t)(range / 2) : (int32_t)(uint32_t)(r >> 16);
        if (!range && r % 17 == 0)
            v[i] = r % 2 ? INT32_MAX : INT32_MIN;
    }
    return v;
}

static char *stats_text(void *sock)
{
    tally_req_t req = th_req(TALLY_OP_STATS, TALLY_DTYPE_NONE, next_id++);
    th_reply_t r;
    assert_int_equal(th_call_reply_status(sock, &req, NULL, 0, &r), TALLY_OK);
    return (char *)r.payload; /* malloc'd and NUL-terminated by the harness */
}

/* The value of a metric line "NAME VALUE" (name given with its trailing space). */
static uint64_t stat_value(const char *text, const char *name)
{
    const char *at = text;
    while ((at = strstr(at, name)) && at != text && at[-1] != '\n')
        at++;
    assert_non_null(at);
    return strtoull(at + strlen(name), NULL, 10);
}

/* ---- operations against references ------------------------------------------------------ */

static void check_ops(void *sock)
{
    size_t n = 300007;
    int32_t *in = random_i32(n, 0);
    /* filter gt 0, stable: exact order */
    tally_req_t req = th_req(TALLY_OP_FILTER, TALLY_DTYPE_I32, next_id++);
    req.pred = TALLY_PRED_GT;
    req.flags = TALLY_FLAG_FILTER_STABLE;
    th_reply_t r;
    assert_int_equal(th_call_reply_status(sock, &req, in, n * 4, &r), TALLY_OK);
    int32_t *want = malloc(n * 8);
    assert_non_null(want);
    size_t kept = tr_filter(TALLY_DTYPE_I32, in, n, TALLY_PRED_GT, 0, 0, want);
    assert_int_equal(r.rep.count, kept);
    assert_int_equal(r.len, kept * 4);
    assert_memory_equal(r.payload, want, r.len);
    th_reply_free(&r);

    /* filter unordered: same count and sum */
    req.request_id = next_id++;
    req.flags = 0;
    assert_int_equal(th_call(sock, &req, in, n * 4, &r), 0);
    assert_int_equal(r.rep.count, kept);
    assert_int_equal(tr_sum(r.payload, kept, 0), tr_sum(want, kept, 0));
    th_reply_free(&r);

    /* scan, int64 inclusive, no stream */
    req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, next_id++);
    assert_int_equal(th_call_reply_status(sock, &req, in, n * 4, &r), TALLY_OK);
    assert_int_equal(r.len, n * 8);
    uint64_t carry = tr_scan(in, n, false, false, 0, want);
    assert_memory_equal(r.payload, want, n * 8);
    assert_true(r.rep.aux0 == carry);
    th_reply_free(&r);
    free(want);

    /* hist u8 over the same bytes */
    uint64_t bins[256] = {0};
    tr_hist(TALLY_DTYPE_U8, in, n * 4, 0, 0, bins);
    req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, next_id++);
    assert_int_equal(th_call_reply_status(sock, &req, in, n * 4, &r), TALLY_OK);
    for (int b = 0; b < 256; b++)
        assert_int_equal(tally_get_u64(r.payload + 8 * b), bins[b]);
    th_reply_free(&r);

    /* hist i32 over [-1000, 1000) with out-of-range values */
    int32_t *small = random_i32(n, 4000);
    uint64_t under = 0, over = 0;
    for (size_t i = 0; i < n; i++) {
        under += small[i] < -1000;
        over += small[i] >= 1000;
    }
    req = th_req(TALLY_OP_HIST, TALLY_DTYPE_I32, next_id++);
    req.lo = -1000;
    req.hi = 1000;
    assert_int_equal(th_call_reply_status(sock, &req, small, n * 4, &r), TALLY_OK);
    assert_int_equal(tally_get_u64(r.payload + 8 * 256), under);
    assert_int_equal(tally_get_u64(r.payload + 8 * 257), over);
    th_reply_free(&r);
    free(small);
    free(in);
}

/* ---- chunked scans on several streams at once ------------------------------------------- */

typedef struct {
    char name[32];
    int32_t *in;
    size_t n;
    size_t bounds[MAX_CHUNKS + 1];
    uint64_t ids[MAX_CHUNKS];
    size_t chunks;
    int64_t *joined;
    size_t got;
} scan_stream_t;

/* Cuts n into chunks of random sizes (some below 4 KiB, some above min_big bytes). */
static void cut(scan_stream_t *s, size_t min_big)
{
    size_t at = 0;
    s->chunks = 0;
    while (at < s->n && s->chunks < MAX_CHUNKS - 1) {
        size_t len = th_rand() % 2 ? 1 + th_rand() % 700 : min_big / 4 + th_rand() % 9000;
        if (at + len > s->n)
            len = s->n - at;
        s->bounds[s->chunks++] = at;
        at += len;
    }
    if (at < s->n)
        s->bounds[s->chunks++] = at;
    s->bounds[s->chunks] = s->n;
}

/* Sends STREAMS streams' chunks interleaved (and a query per stream midway), then checks every
 * reply against a host scan, and the streams' state. min_big: bytes of the "large" chunks. */
/* Sends every stream's chunks interleaved (chunk c of each stream in turn), with a query in
 * the middle of each stream's chunks; its id in query_ids. */
static void send_interleaved(void *sock, scan_stream_t st[STREAMS], size_t total,
                             uint64_t query_ids[STREAMS])
{
    size_t sent = 0;
    for (size_t c = 0; sent < total; c++) {
        for (int k = 0; k < STREAMS; k++) {
            scan_stream_t *s = &st[k];
            if (c >= s->chunks)
                continue;
            tally_req_t req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, next_id++);
            assert_int_equal(tally_req_set_stream(&req, s->name), TALLY_OK);
            s->ids[c] = req.request_id;
            size_t len = s->bounds[c + 1] - s->bounds[c];
            assert_int_equal(th_send_request(sock, &req, s->in + s->bounds[c], len * 4), 0);
            sent++;
            if (c == s->chunks / 2) { /* a barrier in the middle of the pipelined chunks */
                tally_req_t q = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, next_id++);
                tally_req_set_stream(&q, s->name);
                query_ids[k] = q.request_id;
                assert_int_equal(th_send_request(sock, &q, NULL, 0), 0);
            }
        }
    }
}

/* Puts reply r where it belongs: a mid-stream query (which must have seen exactly the chunks
 * before it) or a chunk's sums (copied into its stream's joined output). False if r is neither. */
static bool place_reply(scan_stream_t st[STREAMS], const uint64_t query_ids[STREAMS],
                        const th_reply_t *r)
{
    for (int k = 0; k < STREAMS; k++) {
        scan_stream_t *s = &st[k];
        if (r->rep.request_id == query_ids[k]) {
            tally_stream_info_t info;
            assert_int_equal(tally_stream_info_decode(r->payload, r->len, &info), TALLY_OK);
            size_t half = s->chunks / 2; /* the query follows chunk `half` */
            assert_int_equal(info.batches, half + 1);
            assert_int_equal(info.scan_elements, s->bounds[half + 1]);
            return true;
        }
        for (size_t c = 0; c < s->chunks; c++) {
            if (s->ids[c] != r->rep.request_id)
                continue;
            size_t len = s->bounds[c + 1] - s->bounds[c];
            assert_int_equal(r->len, len * 8);
            memcpy(s->joined + s->bounds[c], r->payload, r->len);
            s->got++;
            return true;
        }
    }
    return false;
}

/* All of a stream's sums came and are its inclusive scan; the stream's carry and batch count
 * agree. Frees its buffers. */
static void verify_stream(void *sock, scan_stream_t *s)
{
    assert_int_equal(s->got, s->chunks);
    int64_t acc = 0;
    for (size_t i = 0; i < s->n; i++) {
        acc = (int64_t)((uint64_t)acc + (uint64_t)(int64_t)s->in[i]);
        if (s->joined[i] != acc)
            fail_msg("stream %s: scan differs at %zu of %zu", s->name, i, s->n);
    }
    tally_req_t q = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, next_id++);
    tally_req_set_stream(&q, s->name);
    th_reply_t r;
    assert_int_equal(th_call(sock, &q, NULL, 0, &r), 0);
    tally_stream_info_t info;
    assert_int_equal(tally_stream_info_decode(r.payload, r.len, &info), TALLY_OK);
    assert_int_equal(info.scan_carry, acc);
    assert_int_equal(info.batches, s->chunks);
    th_reply_free(&r);
    free(s->in);
    free(s->joined);
}

static void check_streams(void *sock, const char *tag, size_t min_big)
{
    scan_stream_t st[STREAMS];
    for (int k = 0; k < STREAMS; k++) {
        snprintf(st[k].name, sizeof st[k].name, "%s/%d", tag, k);
        st[k].n = 60000 + th_rand() % 40000;
        st[k].in = random_i32(st[k].n, 0);
        st[k].joined = calloc(st[k].n, sizeof(int64_t));
        st[k].got = 0;
        cut(&st[k], min_big);
    }
    size_t total = 0;
    for (int k = 0; k < STREAMS; k++)
        total += st[k].chunks;
    uint64_t query_ids[STREAMS];
    send_interleaved(sock, st, total, query_ids);
    for (size_t i = 0; i < total + STREAMS; i++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(sock, &r), 0);
        assert_int_equal(r.rep.status, TALLY_OK);
        assert_true(place_reply(st, query_ids, &r));
        th_reply_free(&r);
    }
    for (int k = 0; k < STREAMS; k++)
        verify_stream(sock, &st[k]);
}

/* A stream histogram built from pipelined chunks equals the whole input's. */
static void check_stream_hist(void *sock, const char *name)
{
    enum { CHUNKS = 12, LEN = 70001 };
    uint8_t *data = malloc((size_t)CHUNKS * LEN);
    uint64_t expect[256] = {0};
    for (size_t i = 0; i < (size_t)CHUNKS * LEN; i++)
        data[i] = (uint8_t)(i / LEN == 3 ? 9 : th_rand());
    tr_hist(TALLY_DTYPE_U8, data, (size_t)CHUNKS * LEN, 0, 0, expect);
    for (int c = 0; c < CHUNKS; c++) {
        tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, next_id++);
        tally_req_set_stream(&req, name);
        assert_int_equal(th_send_request(sock, &req, data + (size_t)c * LEN, LEN), 0);
    }
    for (int c = 0; c < CHUNKS; c++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(sock, &r), 0);
        assert_int_equal(r.rep.status, TALLY_OK);
        th_reply_free(&r);
    }
    tally_req_t q = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, next_id++);
    tally_req_set_stream(&q, name);
    th_reply_t r;
    assert_int_equal(th_call(sock, &q, NULL, 0, &r), 0);
    tally_stream_info_t info;
    assert_int_equal(tally_stream_info_decode(r.payload, r.len, &info), TALLY_OK);
    assert_memory_equal(info.bins, expect, sizeof expect);
    assert_int_equal(info.hist_total, (uint64_t)CHUNKS * LEN);
    th_reply_free(&r);
    free(data);
}

/* ---- tests ------------------------------------------------------------------------------ */

static void test_gpu_ops_and_streams(void **state)
{
    (void)state;
    th_daemon_t d;
    const char *extra[] = {"--gpu-streams", "3", "--gpu-spin-us", "30", NULL};
    assert_int_equal(start(&d, extra), 0);
    void *sock = th_connect(d.endpoint, 20000);
    char *info = stats_text(sock);
    assert_true(stat_value(info, "tallyd_device_memory_bytes ") > 0);
    assert_null(strstr(info, "backend=\"cpu\""));
    free(info);
    check_ops(sock);
    check_streams(sock, "gpu", 64 * 1024);
    check_stream_hist(sock, "gpu/hist");
    char *stats = stats_text(sock);
    assert_int_equal(stat_value(stats, "tallyd_backend_fallbacks_total "), 0);
    free(stats);
    assert_int_equal(th_close_and_stop(sock, &d, 20000), 0);
}

/* auto mode: small chunks on the CPU, large ones on the GPU, on the same streams. */
/* The reported GPU bug: a stream's first request in flight was a hist (or filter), so nothing
 * uploaded the stream's carry, and the scan pipelined behind it read whatever its carry index
 * held (another stream's carry; on the simulated engine, garbage). Each round: a scan to
 * completion (the stream is idle with a nonzero carry), then a hist or filter with scans
 * pipelined behind it (inclusive and exclusive, int64 and int32 output), each checked. */
static void test_scan_behind_hist_or_filter(void **state)
{
    (void)state;
    th_daemon_t d;
    assert_int_equal(start(&d, NULL), 0);
    void *sock = th_connect(d.endpoint, 10000);
    for (int round = 0; round < 12; round++) {
        char name[32];
        snprintf(name, sizeof name, "first-%d", round);
        /* A scan run to completion first: the stream is idle with a nonzero carry, which the
         * next chain must start from. */
        int32_t head[10];
        for (int i = 0; i < 10; i++)
            head[i] = (int32_t)(uint32_t)th_rand();
        tally_req_t lead = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, next_id++);
        tally_req_set_stream(&lead, name);
        th_reply_t lr;
        assert_int_equal(th_call_reply_status(sock, &lead, head, sizeof head, &lr), TALLY_OK);
        uint64_t carry = lr.rep.aux0;
        th_reply_free(&lr);
        uint8_t bytes[1000];
        for (size_t i = 0; i < sizeof bytes; i++)
            bytes[i] = (uint8_t)th_rand();
        tally_req_t first =
            th_req(round % 2 ? TALLY_OP_FILTER : TALLY_OP_HIST, TALLY_DTYPE_U8, next_id++);
        if (round % 2)
            first.pred = TALLY_PRED_GT, first.lo = 100;
        tally_req_set_stream(&first, name);
        assert_int_equal(th_send_request(sock, &first, bytes, sizeof bytes), 0);
        enum { SCANS = 4, N = 100 };
        int32_t in[SCANS][N];
        uint64_t ids[SCANS];
        for (int k = 0; k < SCANS; k++) {
            for (int i = 0; i < N; i++)
                in[k][i] = (int32_t)(uint32_t)th_rand();
            tally_req_t req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, next_id++);
            req.flags = (uint8_t)((k & 1 ? TALLY_FLAG_SCAN_EXCLUSIVE : 0) |
                                  (k & 2 ? TALLY_FLAG_SCAN_OUT_I32 : 0));
            tally_req_set_stream(&req, name);
            ids[k] = req.request_id;
            assert_int_equal(th_send_request(sock, &req, in[k], sizeof in[k]), 0);
        }
        for (int k = 0; k <= SCANS; k++) {
            th_reply_t r;
            assert_int_equal(th_recv_reply(sock, &r), 0);
            assert_int_equal(r.rep.status, TALLY_OK);
            if (r.rep.request_id == first.request_id) {
                th_reply_free(&r);
                continue;
            }
            int s = 0;
            while (s < SCANS && ids[s] != r.rep.request_id)
                s++;
            assert_true(s < SCANS);
            int64_t want[N];
            carry = tr_scan(in[s], N, s & 1, s & 2, carry, want);
            assert_int_equal(r.len, (s & 2 ? 4 : 8) * N);
            if (memcmp(r.payload, want, r.len) != 0)
                fail_msg("round %d scan %d differs", round, s);
            assert_int_equal(r.rep.aux0, carry);
            th_reply_free(&r);
        }
    }
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

static void test_auto_threshold_mixes_paths(void **state)
{
    (void)state;
    th_daemon_t d;
    const char *extra[] = {"--backend", "auto", "--gpu-min-batch", "16K", NULL};
    assert_int_equal(start(&d, extra), 0);
    void *sock = th_connect(d.endpoint, 20000);
    check_streams(sock, "auto", 32 * 1024);
    assert_int_equal(th_close_and_stop(sock, &d, 20000), 0);
}

/* Every 3rd GPU request fails after its kernels ran (its device carry clobbered): answers stay
 * exact, the requests queued behind a failure on its stream are rerun too, the fallbacks are
 * counted. (A device may still see 3 failures in a row in its completion order and be retired;
 * the answers must be exact either way.) */
static void test_fault_fallback_exact(void **state)
{
    (void)state;
    th_daemon_t d;
    const char *extra[] = {"--test-fault-every", "3", NULL};
    /* Simulated launches of 20 ms: each stream's burst is surely read, and queued behind the
     * failed request, before that failure comes back, however loaded the machine is. */
    setenv("TALLYD_TEST_SIM_LATENCY_US", "20000", 1);
    int started = start(&d, extra);
    unsetenv("TALLYD_TEST_SIM_LATENCY_US");
    assert_int_equal(started, 0);
    void *sock = th_connect(d.endpoint, 20000);
    check_ops(sock);
    check_streams(sock, "fault3", 64 * 1024);
    check_stream_hist(sock, "fault3/hist");
    char *stats = stats_text(sock);
    assert_true(stat_value(stats, "tallyd_backend_fallbacks_total ") >= 10);
    free(stats);
    assert_int_equal(th_close_and_stop(sock, &d, 20000), 0);
    assert_true(th_daemon_log_contains(&d, "failed on the GPU: rerun on the CPU backend"));
    /* Whether a stream's later requests were still in flight when its failed one came back is
     * a matter of timing on a real GPU (it may finish first; then nothing needs the rerun); the
     * simulated devices' latency above makes it certain. */
    bool behind = th_daemon_log_contains(&d, "was queued behind a GPU failure");
    if (use_cuda())
        fprintf(stderr, "requests rerun behind a failure: %s\n", behind ? "yes" : "none this run");
    else
        assert_true(behind);
}

/* Every GPU request fails: after 3 in a row the device is marked unusable (logged at err) and
 * tallyd goes on serving, exactly, on the CPU. */
static void test_fault_device_unusable(void **state)
{
    (void)state;
    th_daemon_t d;
    const char *extra[] = {"--test-fault-every", "1", NULL};
    assert_int_equal(start(&d, extra), 0);
    void *sock = th_connect(d.endpoint, 20000);
    check_ops(sock);
    check_streams(sock, "fault1", 64 * 1024);
    check_ops(sock);
    char *stats = stats_text(sock);
    assert_true(stat_value(stats, "tallyd_backend_fallbacks_total ") >= 3);
    assert_non_null(strstr(stats, "unusable"));
    assert_non_null(strstr(stats, "backend=\"cpu\""));
    free(stats);
    assert_int_equal(th_close_and_stop(sock, &d, 20000), 0);
    assert_true(th_daemon_log_contains(&d, "<3>GPU "));
    assert_true(th_daemon_log_contains(&d, "is unusable after 3 errors in a row"));
}

/* Two requests in flight at most: 300 pipelined large ones, over streams and none, are all
 * answered exactly once, and the stream's carry is exact. */
static void test_backpressure_gpu(void **state)
{
    (void)state;
    th_daemon_t d;
    const char *extra[] = {"--max-inflight", "2", NULL};
    assert_int_equal(start(&d, extra), 0);
    void *sock = th_connect(d.endpoint, 30000);
    enum { COUNT = 300 };
    size_t n = 64 * 1024;
    int32_t *in = random_i32(n, 1000);
    int64_t chunk_sum = (int64_t)tr_sum(in, n, 0);
    bool seen[COUNT] = {false};
    for (int i = 0; i < COUNT; i++) {
        tally_req_t req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, 5000 + i);
        if (i % 2)
            tally_req_set_stream(&req, "bp/s");
        assert_int_equal(th_send_request(sock, &req, in, n * 4), 0);
    }
    int64_t last_carry = 0;
    for (int i = 0; i < COUNT; i++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(sock, &r), 0);
        assert_int_equal(r.rep.status, TALLY_OK);
        uint64_t k = r.rep.request_id - 5000;
        assert_true(k < COUNT);
        assert_false(seen[k]);
        seen[k] = true;
        if (k % 2) { /* stream replies come back in order: the carry grows by one chunk */
            assert_int_equal((int64_t)r.rep.aux0, last_carry + chunk_sum);
            last_carry += chunk_sum;
        }
        th_reply_free(&r);
    }
    char *stats = stats_text(sock);
    assert_true(stat_value(stats, "tallyd_read_pauses_total ") > 0);
    free(stats);
    free(in);
    assert_int_equal(th_close_and_stop(sock, &d, 20000), 0);
}

/* Issue 21: a request refused at admission (a hist i32 on a u8 stream: stream_state) while the
 * stream's earlier requests are on the GPU is answered after them, and the ones sent after it
 * after it: the replies of a stream leave in send order (PROTOCOL.md §1). It overtook them
 * before (reply order 0, 2, 1, 3 on two H200s). Simulated launches of 20 ms keep the earlier
 * ones on the "device" while the refusal is decided. */
static void test_refusal_keeps_stream_order(void **state)
{
    (void)state;
    th_daemon_t d;
    setenv("TALLYD_TEST_SIM_LATENCY_US", "20000", 1);
    int started = start(&d, NULL);
    unsetenv("TALLYD_TEST_SIM_LATENCY_US");
    assert_int_equal(started, 0);
    void *sock = th_connect(d.endpoint, 20000);
    enum { BEFORE = 3, AFTER = 3, ALL = BEFORE + 1 + AFTER };
    static uint8_t bytes[256 * 1024];
    for (size_t i = 0; i < sizeof bytes; i++)
        bytes[i] = (uint8_t)th_rand();
    tally_req_t first = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, next_id++);
    tally_req_set_stream(&first, "order/u8");
    assert_int_equal(th_call_status(sock, &first, bytes, sizeof bytes), TALLY_OK);
    uint64_t ids[ALL];
    for (int k = 0; k < ALL; k++) {
        bool wrong = k == BEFORE;
        tally_req_t req = th_req(TALLY_OP_HIST, wrong ? TALLY_DTYPE_I32 : TALLY_DTYPE_U8,
                                 next_id++);
        if (wrong)
            req.lo = 0, req.hi = 256;
        tally_req_set_stream(&req, "order/u8");
        ids[k] = req.request_id;
        assert_int_equal(th_send_request(sock, &req, bytes, sizeof bytes), 0);
    }
    for (int k = 0; k < ALL; k++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(sock, &r), 0);
        if (r.rep.request_id != ids[k])
            fail_msg("reply %d is request %llu, want %llu (send order)", k,
                     (unsigned long long)r.rep.request_id, (unsigned long long)ids[k]);
        assert_int_equal(r.rep.status, k == BEFORE ? TALLY_E_STREAM_STATE : TALLY_OK);
        th_reply_free(&r);
    }
    assert_int_equal(th_close_and_stop(sock, &d, 20000), 0);
}

int main(void)
{
    th_seed();
    int i = 0;
    if (use_cuda()) {
        engine_args[i++] = "--backend";
        engine_args[i++] = "cuda";
    } else {
        engine_args[i++] = "--backend";
        engine_args[i++] = "cuda";
        engine_args[i++] = "--test-sim-gpus";
        engine_args[i++] = "2";
    }
    engine_args[i] = NULL;
    if (use_cuda()) { /* no GPU here: skip rather than fail */
        th_daemon_t probe;
        if (start(&probe, NULL) != 0) {
            fprintf(stderr, "tallyd --backend cuda does not start: no usable GPU, skipping\n");
            return SKIP;
        }
        th_daemon_stop(&probe, SIGTERM, 20000);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gpu_ops_and_streams),
        cmocka_unit_test(test_scan_behind_hist_or_filter),
        cmocka_unit_test(test_auto_threshold_mixes_paths),
        cmocka_unit_test(test_fault_fallback_exact),
        cmocka_unit_test(test_fault_device_unusable),
        cmocka_unit_test(test_backpressure_gpu),
        cmocka_unit_test(test_refusal_keeps_stream_order),
    };
    return cmocka_run_group_tests_name(use_cuda() ? "pipeline (cuda)" : "pipeline (sim)", tests,
                                       NULL, NULL);
}
