/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_client_daemon.c — libtally and the `tally` CLI against a real tallyd.
 *
 * One tallyd (from $TALLYD_BIN, started by harness.c on a free loopback port) serves every
 * test. The libtally half checks that chunked, pipelined tally_run output equals a plain
 * reference computed here for every operation and mode, with chunk sizes that are not a
 * multiple of anything, and that stream state (scan carry, running histogram, counters) seen
 * through tally_query matches. The CLI half runs $TALLY_BIN through sh and checks the exact
 * output, stderr and exit status of the tour's examples (docs/tour.md), the usage errors and an
 * unreachable daemon. TALLY_TEST_BACKEND=cuda runs it all against the GPU backend.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "reference.h"
#include "tally.h"

static th_daemon_t daemon_;
static char tmpdir[64];

static int setup(void **state)
{
    (void)state;
    if (th_tmpdir(tmpdir, sizeof tmpdir, "tally-cli") != 0)
        return -1;
    /* CPU by default so the suite runs anywhere; TALLY_TEST_BACKEND=cuda (or auto) runs the
     * same checks against the GPU pipeline, whose replies come back out of order. */
    const char *backend = getenv("TALLY_TEST_BACKEND");
    const char *args[] = {"--backend", backend && *backend ? backend : "cpu", NULL};
    return th_daemon_start(&daemon_, args);
}

static int teardown(void **state)
{
    (void)state;
    return th_daemon_teardown(&daemon_, 10000, tmpdir);
}

static tally_client_t *connect_daemon(void)
{
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(daemon_.endpoint, 10000, &c), TALLY_OK);
    return c;
}

/* ---- libtally ---------------------------------------------------------------------------- */

static void test_lib_control(void **state)
{
    (void)state;
    tally_client_t *c = connect_daemon();
    double rtt = -1;
    assert_int_equal(tally_ping(c, &rtt), TALLY_OK);
    assert_true(rtt > 0);
    char *text = NULL;
    assert_int_equal(tally_info(c, TALLY_OP_INFO, &text), TALLY_OK);
    assert_non_null(strstr(text, "protocol=1"));
    /* The same info parsed: §5's first keys in order, each value as the text has it. */
    tally_info_t *parsed = NULL;
    assert_int_equal(tally_info_fetch(c, &parsed), TALLY_OK);
    static const char *const first[] = {"version",  "protocol", "backend",
                                        "backends", "devices",  "max_batch"};
    assert_true(tally_info_count(parsed) > sizeof first / sizeof *first);
    for (size_t i = 0; i < sizeof first / sizeof *first; i++)
        assert_string_equal(tally_info_key(parsed, i), first[i]);
    for (size_t i = 0; i < tally_info_count(parsed); i++) {
        char line[512]; /* "\nkey=value\n": the first line starts the text */
        int n = snprintf(line, sizeof line, "\n%s=%s\n", tally_info_key(parsed, i),
                         tally_info_value(parsed, i));
        assert_true(n > 0 && (size_t)n < sizeof line);
        if (i == 0)
            assert_memory_equal(text, line + 1, (size_t)n - 1);
        else
            assert_non_null(strstr(text, line));
    }
    uint64_t max_batch = 0;
    assert_int_equal(tally_info_u64(parsed, "max_batch", &max_batch), TALLY_OK);
    assert_true(max_batch > 0);
    assert_string_equal(tally_info_lookup(parsed, "protocol"), "1");
    tally_info_destroy(&parsed);
    free(text);
    assert_int_equal(tally_info(c, TALLY_OP_STATS, &text), TALLY_OK);
    assert_non_null(strstr(text, "# TYPE"));
    free(text);

    tally_stream_info_t info;
    assert_int_equal(tally_query(c, "lib/never-used", &info), TALLY_E_UNKNOWN_STREAM);
    assert_non_null(strstr(tally_client_error(c), "lib/never-used"));
    assert_int_equal(tally_reset(c, "lib/never-used"), TALLY_E_UNKNOWN_STREAM);
    assert_int_equal(tally_delete(c, "lib/never-used"), TALLY_E_UNKNOWN_STREAM);
    tally_client_destroy(&c);
}

static void test_lib_filter_chunked(void **state)
{
    (void)state;
    tally_client_t *c = connect_daemon();
    enum { N = 300007 };
    int32_t *x = th_random_i32(N, INT32_MIN, INT32_MAX);
    x[5] = INT32_MIN;
    x[6] = INT32_MAX;
    int32_t *expect = malloc(4 * N);
    static const struct {
        uint8_t pred;
        int64_t lo, hi;
    } cases[] = {{TALLY_PRED_GT, 0, 0},         {TALLY_PRED_LE, INT32_MIN, 0},
                 {TALLY_PRED_NE, INT32_MAX, 0}, {TALLY_PRED_BETWEEN, -1000000, 5000000},
                 {TALLY_PRED_GE, INT64_MAX, 0}, {TALLY_PRED_LT, INT64_MAX, 0}};
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        tally_req_t req = {.opcode = TALLY_OP_FILTER,
                           .dtype = TALLY_DTYPE_I32,
                           .pred = cases[k].pred,
                           .lo = cases[k].lo,
                           .hi = cases[k].hi};
        size_t kept = 0;
        for (size_t i = 0; i < N; i++) {
            int64_t v = x[i];
            bool keep = req.pred == TALLY_PRED_GT   ? v > req.lo
                        : req.pred == TALLY_PRED_LE ? v <= req.lo
                        : req.pred == TALLY_PRED_NE ? v != req.lo
                        : req.pred == TALLY_PRED_GE ? v >= req.lo
                        : req.pred == TALLY_PRED_LT ? v < req.lo
                                                    : v >= req.lo && v <= req.hi;
            if (keep)
                expect[kept++] = x[i];
        }
        for (int stable = 0; stable < 2; stable++) {
            req.flags = stable ? TALLY_FLAG_FILTER_STABLE : 0;
            tally_run_opts_t opts = {.chunk_bytes = 65537 + 1000 * k, .window = 1 + 3 * k};
            tally_buf_t out = {0};
            tally_run_result_t res;
            assert_int_equal(tally_run(c, &req, x, 4 * N, &opts, &out, &res), TALLY_OK);
            assert_int_equal(res.count, kept);
            assert_int_equal(res.seen, N);
            assert_int_equal(out.len, 4 * kept);
            if (!stable) { /* unordered: the same multiset */
                qsort(out.data, kept, 4, th_cmp_i32);
                int32_t *sorted = malloc(4 * kept + 4);
                memcpy(sorted, expect, 4 * kept);
                qsort(sorted, kept, 4, th_cmp_i32);
                assert_memory_equal(out.data, sorted, 4 * kept);
                free(sorted);
            } else if (kept) {
                assert_memory_equal(out.data, expect, 4 * kept);
            }
            tally_buf_free(&out);
        }
    }
    free(expect);
    free(x);
    tally_client_destroy(&c);
}

/* Stateless scans: each chunk is scanned from 0 by the daemon and offset by the client. */
static void test_lib_scan_chunked(void **state)
{
    (void)state;
    tally_client_t *c = connect_daemon();
    enum { N = 200003 };
    int32_t *x = th_random_i32(N, INT32_MAX - 100, INT32_MAX); /* int32 sums wrap every step */
    for (size_t i = 0; i < N; i += 3)
        x[i] = INT32_MIN;
    for (uint8_t flags = 0; flags < 4; flags++) {
        tally_req_t req = {.opcode = TALLY_OP_SCAN, .dtype = TALLY_DTYPE_I32, .flags = flags};
        tally_run_opts_t opts = {.chunk_bytes = 40000 + 4 * flags + 1, .window = 2 + 2 * flags};
        tally_buf_t out = {0};
        tally_run_result_t res;
        assert_int_equal(tally_run(c, &req, x, 4 * N, &opts, &out, &res), TALLY_OK);
        bool out_i32 = flags & TALLY_FLAG_SCAN_OUT_I32;
        assert_int_equal(out.len, (size_t)N * (out_i32 ? 4 : 8));
        uint64_t run = 0;
        for (size_t i = 0; i < N; i++) {
            uint64_t incl = run + (uint64_t)(int64_t)x[i];
            uint64_t v = (flags & TALLY_FLAG_SCAN_EXCLUSIVE) ? run : incl;
            run = incl;
            uint64_t got =
                out_i32 ? tally_get_u32(out.data + 4 * i) : tally_get_u64(out.data + 8 * i);
            if (got != (out_i32 ? (uint32_t)v : v))
                fail_msg("flags %u: element %zu is %" PRIu64 ", expected %" PRIu64, flags, i, got,
                         v);
        }
        assert_true((uint64_t)res.carry == run);
        tally_buf_free(&out);
    }
    free(x);
    tally_client_destroy(&c);
}

/* A stream carries across chunks and across runs; query shows the carry and counters. */
static void test_lib_scan_stream(void **state)
{
    (void)state;
    tally_client_t *c = connect_daemon();
    enum { N = 100001 };
    int32_t *x = th_random_i32(N, INT32_MIN, INT32_MAX);
    tally_req_t req = {.opcode = TALLY_OP_SCAN, .dtype = TALLY_DTYPE_I32};
    assert_int_equal(tally_req_set_stream(&req, "lib/scan"), TALLY_OK);
    uint64_t run = 0;
    for (int round = 0; round < 2; round++) {
        tally_run_opts_t opts = {.chunk_bytes = 12345, .window = 8};
        tally_buf_t out = {0};
        tally_run_result_t res;
        assert_int_equal(tally_run(c, &req, x, 4 * N, &opts, &out, &res), TALLY_OK);
        int64_t *sums = malloc(8 * N);
        assert_non_null(sums);
        run = tr_scan(x, N, false, false, run, sums);
        assert_int_equal(out.len, 8 * N);
        if (memcmp(out.data, sums, 8 * N) != 0)
            fail_msg("round %d differs", round);
        free(sums);
        assert_true((uint64_t)res.carry == run);
        tally_buf_free(&out);
    }
    tally_stream_info_t info;
    assert_int_equal(tally_query(c, "lib/scan", &info), TALLY_OK);
    assert_true((uint64_t)info.scan_carry == run);
    assert_int_equal(info.scan_elements, 2 * N);
    assert_int_equal(info.elements, 2 * N);
    assert_int_equal(info.batches, 2 * ((4 * N + 12343) / 12344));
    assert_int_equal(tally_reset(c, "lib/scan"), TALLY_OK); /* zeroed, kept */
    assert_int_equal(tally_query(c, "lib/scan", &info), TALLY_OK);
    assert_int_equal(info.scan_carry, 0);
    assert_int_equal(info.elements, 0);
    assert_int_equal(tally_delete(c, "lib/scan"), TALLY_OK); /* gone */
    assert_int_equal(tally_query(c, "lib/scan", &info), TALLY_E_UNKNOWN_STREAM);
    free(x);
    tally_client_destroy(&c);
}

static void test_lib_hist_stream(void **state)
{
    (void)state;
    tally_client_t *c = connect_daemon();
    enum { N = 1000003 };
    uint8_t *bytes = malloc(N);
    uint64_t expect[256] = {0};
    for (size_t i = 0; i < N; i++)
        bytes[i] = (uint8_t)(th_rand() % 7 ? th_rand() : 42);
    tr_hist(TALLY_DTYPE_U8, bytes, N, 0, 0, expect);
    tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    assert_int_equal(tally_req_set_stream(&req, "lib/cam"), TALLY_OK);
    tally_run_opts_t opts = {.chunk_bytes = 99999, .window = 4};
    tally_buf_t out = {0};
    tally_run_result_t res;
    assert_int_equal(tally_run(c, &req, bytes, N, &opts, &out, &res), TALLY_OK);
    assert_true(th_u64s_equal(out.data, out.len, expect, 256));
    tally_buf_free(&out);
    /* Twice: the stream's running histogram holds both. */
    assert_int_equal(tally_run(c, &req, bytes, N, NULL, &out, &res), TALLY_OK);
    tally_buf_free(&out);
    tally_stream_info_t info;
    assert_int_equal(tally_query(c, "lib/cam", &info), TALLY_OK);
    assert_int_equal(info.hist_dtype, TALLY_DTYPE_U8);
    assert_int_equal(info.hist_total, 2 * N);
    for (int b = 0; b < 256; b++)
        assert_int_equal(info.bins[b], 2 * expect[b]);

    /* i32 with a range, stateless, chunked. */
    int32_t *x = th_random_i32(N, -3000, 3000);
    uint64_t iexp[TALLY_HIST_I32_VALUES] = {0};
    tr_hist(TALLY_DTYPE_I32, x, N, -1000, 2000, iexp);
    tally_req_t ireq = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_I32, .lo = -1000, .hi = 2000};
    assert_int_equal(tally_run(c, &ireq, x, 4 * (size_t)N, &opts, &out, &res), TALLY_OK);
    assert_true(th_u64s_equal(out.data, out.len, iexp, TALLY_HIST_I32_VALUES));
    tally_buf_free(&out);

    char **names = NULL;
    size_t count = 0;
    assert_int_equal(tally_streams(c, &names, &count), TALLY_OK);
    bool found = false;
    for (size_t i = 0; i < count; i++)
        found |= !strcmp(names[i], "lib/cam");
    assert_true(found);
    tally_strings_free(names, count);
    free(x);
    free(bytes);
    tally_client_destroy(&c);
}

/* The push's output function: appends to a tally_buf_t and counts the calls. */
typedef struct {
    tally_buf_t buf;
    int calls;
} collect_t;

static tally_status_t collect(void *arg, const void *data, size_t len)
{
    collect_t *c = arg;
    c->calls++;
    return tally_buf_append(&c->buf, data, len);
}

/* A streaming push: chunks of any size up to chunk_bytes, output in order chunk by chunk, the
 * same sums as one message, sequence numbers on a stream; misuse is refused. */
static void test_lib_push(void **state)
{
    (void)state;
    enum { N = 100003 };
    int32_t *x = th_random_i32(N, -1000, 1000);
    tally_client_t *c = connect_daemon();
    tally_req_t req = {.opcode = TALLY_OP_SCAN, .dtype = TALLY_DTYPE_I32};
    assert_int_equal(tally_req_set_stream(&req, "push1"), TALLY_OK);
    tally_run_opts_t opts = {.chunk_bytes = 40000, .window = 3, .seq = TALLY_RUN_SEQ_APPEND};
    collect_t got = {0};
    tally_push_t *push = NULL;
    assert_int_equal(tally_push_new(c, &req, &opts, collect, &got, &push), TALLY_OK);
    assert_int_equal(tally_push_chunk_bytes(push), 40000);
    size_t at = 0, writes = 0;
    while (at < N) { /* 1..10000 elements at a time */
        size_t n = 1 + th_rand() % 10000;
        n = n > N - at ? N - at : n;
        assert_int_equal(tally_push_write(push, x + at, 4 * n), TALLY_OK);
        at += n;
        writes++;
    }
    assert_int_equal(tally_push_write(push, x, 40004), TALLY_E_ARG); /* over chunk_bytes */
    assert_non_null(strstr(tally_client_error(c), "40004 bytes"));
    assert_int_equal(tally_push_write(push, x, 6), TALLY_E_ARG); /* not whole elements */
    assert_int_equal(tally_push_finish(push), TALLY_OK);         /* refused chunks were not sent */
    assert_int_equal(tally_push_result(push)->applied, writes);
    tally_push_destroy(&push);
    assert_null(push);
    /* The stream applied every chunk once, numbered. */
    tally_stream_info_t info;
    assert_int_equal(tally_query(c, "push1", &info), TALLY_OK);
    assert_int_equal(info.last_seq, writes);
    assert_int_equal(info.scan_elements, N);
    assert_int_equal(got.buf.len, 8 * N);
    int64_t *sums = malloc(8 * N);
    assert_non_null(sums);
    tr_scan(x, N, false, false, 0, sums);
    assert_memory_equal(got.buf.data, sums, 8 * N);
    free(sums);
    assert_int_equal(got.calls, (int)writes); /* one output per chunk, in order */
    tally_buf_free(&got.buf);

    /* A clean one: result counters, and a write after finish is refused. */
    req.opcode = TALLY_OP_HIST;
    req.dtype = TALLY_DTYPE_U8;
    assert_int_equal(tally_req_set_stream(&req, NULL), TALLY_OK);
    got = (collect_t){0};
    assert_int_equal(tally_push_new(c, &req, NULL, collect, &got, &push), TALLY_OK);
    assert_int_equal(tally_push_write(push, "abca", 4), TALLY_OK);
    assert_int_equal(tally_push_write(push, "", 0), TALLY_OK); /* an empty chunk is a request */
    assert_int_equal(tally_push_finish(push), TALLY_OK);
    const tally_run_result_t *res = tally_push_result(push);
    assert_int_equal(res->chunks, 2);
    assert_int_equal(res->applied, 2);
    assert_int_equal(res->applied_bytes, 4);
    assert_int_equal(res->hist_total, 4);
    assert_int_equal(got.calls, 1); /* hist: the summed counts, once */
    assert_int_equal(tally_get_u64(got.buf.data + 8 * 'a'), 2);
    assert_int_equal(tally_push_write(push, "a", 1), TALLY_E_ARG);
    tally_push_destroy(&push);
    tally_buf_free(&got.buf);
    tally_client_destroy(&c);
    free(x);
}

/* A chunk over the daemon's maximum batch is the daemon's TALLY_E_TOO_LARGE, with its text. */
static void test_lib_chunk_too_large(void **state)
{
    (void)state;
    tally_client_t *c = connect_daemon();
    size_t len = (16u << 20) + 4;
    uint8_t *data = calloc(1, len);
    tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    tally_run_opts_t opts = {.chunk_bytes = len, .window = 1};
    tally_buf_t out = {0};
    tally_run_result_t res;
    assert_int_equal(tally_run(c, &req, data, len, &opts, &out, &res), TALLY_E_TOO_LARGE);
    assert_string_not_equal(res.error, "");
    /* The same input in default chunks works. */
    tally_buf_free(&out);
    assert_int_equal(tally_run(c, &req, data, len, NULL, &out, &res), TALLY_OK);
    assert_int_equal(tally_get_u64(out.data), len);
    assert_int_equal(res.chunks, 17);
    tally_buf_free(&out);
    free(data);
    tally_client_destroy(&c);
}

/* ---- Across a daemon that stops --------------------------------------------------------- */

/* A tallyd of the test's own at an ipc:// path in `dir`, so that a restart comes back at the
 * same endpoint; with its state in `dir` too. */
static void start_own(th_daemon_t *d, const char *dir, char *ipc, size_t cap)
{
    static char state[128], bind[160];
    snprintf(state, sizeof state, "%s", dir);
    snprintf(ipc, cap, "ipc://%s/own.sock", dir);
    snprintf(bind, sizeof bind, "%s", ipc);
    const char *args[] = {"--backend", "cpu", "--state-dir", state, "--bind", bind, NULL};
    assert_int_equal(th_daemon_start(d, args), 0);
}

/* A scratch folder `dir` (64 bytes) named after prefix, a tallyd in it at `ipc` (128 bytes),
 * and a client of it with timeout_ms. */
static tally_client_t *own_start(th_daemon_t *d, char *dir, char *ipc, const char *prefix,
                                 int timeout_ms)
{
    assert_int_equal(th_tmpdir(dir, 64, prefix), 0);
    start_own(d, dir, ipc, 128);
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(ipc, timeout_ms, &c), TALLY_OK);
    return c;
}

/* The stream's record through a fresh client (its own connection). */
static tally_status_t query_fresh(const char *endpoint, const char *stream,
                                  tally_stream_info_t *info)
{
    tally_client_t *q = NULL;
    assert_int_equal(tally_client_new(endpoint, 10000, &q), TALLY_OK);
    tally_status_t st = tally_query(q, stream, info);
    tally_client_destroy(&q);
    return st;
}

/* Replies that arrived before tallyd closed the connection stay readable. 24 hists go out
 * unread; once tallyd has applied all of them (so their replies were sent), it is stopped, and
 * only then are the replies read: all 24, ok. With ZMQ_IMMEDIATE the DEALER dropped every one
 * of them at the disconnect. */
static void test_lib_replies_survive_disconnect(void **state)
{
    (void)state;
    enum { N = 24 };
    char dir[64], ipc[128];
    th_daemon_t d;
    tally_client_t *c = own_start(&d, dir, ipc, "tally-keep", 10000);
    static uint8_t chunk[64 << 10];
    tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    assert_int_equal(tally_req_set_stream(&req, "kept"), TALLY_OK);
    uint64_t ids[N];
    for (int i = 0; i < N; i++)
        assert_int_equal(tally_send(c, &req, chunk, sizeof chunk, &ids[i]), TALLY_OK);
    tally_stream_info_t info = {0};
    for (int64_t end = th_now_ms() + 20000; info.batches < N && th_now_ms() < end;)
        if (query_fresh(ipc, "kept", &info) != TALLY_OK)
            th_sleep_ms(10);
    assert_int_equal(info.batches, N);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
    th_sleep_ms(200); /* the disconnect reaches the client's I/O thread */
    tally_reply_t reply;
    tally_reply_init(&reply);
    for (int i = 0; i < N; i++) {
        assert_int_equal(tally_recv(c, &reply), TALLY_OK);
        assert_int_equal(reply.rep.request_id, ids[i]); /* one stream: in send order */
    }
    tally_reply_clear(&reply);
    tally_client_destroy(&c);
    assert_int_equal(th_rmrf(dir), 0);
}

/* A request sent while tallyd is down is not queued to go out when it comes back: the send
 * waits for the connection, within the timeout, and fails; tallyd, back at the same endpoint,
 * never sees it, though the client is still there. */
static void test_lib_no_send_while_down(void **state)
{
    (void)state;
    char dir[64], ipc[128];
    th_daemon_t d;
    tally_client_t *c = own_start(&d, dir, ipc, "tally-down", 500);
    assert_int_equal(tally_ping(c, NULL), TALLY_OK);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
    th_sleep_ms(200);
    tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    assert_int_equal(tally_req_set_stream(&req, "held"), TALLY_OK);
    int64_t start = th_now_ms();
    assert_int_equal(tally_send(c, &req, "abcd", 4, NULL), TALLY_E_TIMEOUT);
    assert_true(th_now_ms() - start >= 400);
    assert_non_null(strstr(tally_client_error(c), "connection to tallyd"));
    start_own(&d, dir, ipc, sizeof ipc);
    tally_status_t st = TALLY_E_TIMEOUT;
    for (int64_t end = th_now_ms() + 20000; st != TALLY_OK && th_now_ms() < end;)
        st = tally_ping(c, NULL); /* the same client, connected again */
    assert_int_equal(st, TALLY_OK);
    tally_stream_info_t info;
    assert_int_equal(tally_query(c, "held", &info), TALLY_E_UNKNOWN_STREAM);
    tally_client_destroy(&c);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
    assert_int_equal(th_rmrf(dir), 0);
}

/* A numbered push that tallyd's stop cuts short knows exactly what the stream holds from the
 * replies alone (every reply kept; the first failed chunk k after k answered ok means k applied),
 * though tallyd cannot be asked afterwards; the restarted tallyd agrees, and the bytes are
 * those of the same chunks. */
static void test_lib_push_cut_by_stop_is_exact(void **state)
{
    (void)state;
    enum { CHUNK = 256 << 10 };
    char dir[64], ipc[128];
    th_daemon_t d;
    tally_client_t *c = own_start(&d, dir, ipc, "tally-cut", 2000);
    tally_req_t req = {.opcode = TALLY_OP_SCAN, .dtype = TALLY_DTYPE_I32};
    assert_int_equal(tally_req_set_stream(&req, "cut"), TALLY_OK);
    tally_run_opts_t opts = {.chunk_bytes = CHUNK, .window = 4, .seq = TALLY_RUN_SEQ_APPEND};
    tally_push_t *push = NULL;
    assert_int_equal(tally_push_new(c, &req, &opts, NULL, NULL, &push), TALLY_OK);
    static int32_t data[CHUNK / 4];
    for (size_t i = 0; i < CHUNK / 4; i++)
        data[i] = (int32_t)i;
    int writes = 0;
    while (writes < 10000 && tally_push_write(push, data, CHUNK) == TALLY_OK)
        if (++writes == 20)
            kill(d.pid, SIGTERM); /* the next chunks meet a stopping tallyd */
    assert_true(writes >= 20 && writes < 10000);
    assert_int_not_equal(tally_push_finish(push), TALLY_OK);
    const tally_run_result_t *res = tally_push_result(push);
    print_message("push stopped with %s after %d writes: applied %" PRIu64 " (%s)\n",
                  tally_status_name(res->status), writes, res->applied,
                  res->applied_known ? "known" : "at least");
    assert_true(res->applied_known);
    assert_int_equal(res->applied_bytes, res->applied * CHUNK);
    uint64_t applied = res->applied;
    tally_push_destroy(&push);
    tally_client_destroy(&c);
    assert_int_equal(th_daemon_wait(&d, 20000), 0);
    start_own(&d, dir, ipc, sizeof ipc);
    tally_stream_info_t info;
    assert_int_equal(query_fresh(ipc, "cut", &info), TALLY_OK);
    assert_int_equal(info.last_seq, applied);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
    assert_int_equal(th_rmrf(dir), 0);
}

/* ---- The CLI ----------------------------------------------------------------------------- */

typedef th_cli_t cli_result_t;

static char *slurp(const char *path)
{
    char *text = th_slurp(path);
    assert_non_null(text);
    return text;
}

static void write_file(const char *name, const void *data, size_t len)
{
    assert_int_equal(th_write_file(tmpdir, name, data, len), 0);
}

/* `tally -e ENDPOINT <args>` in tmpdir through sh (so args may redirect stdin). */
#define cli_at(endpoint, ...) th_cli(tmpdir, (endpoint), __VA_ARGS__)
#define cli(...) cli_at(daemon_.endpoint, __VA_ARGS__)
#define cli_free th_cli_free

/* Checks an exact stdout, an empty stderr and exit 0. */
static void expect_ok(cli_result_t r, const char *out)
{
    assert_string_equal(r.err, "");
    assert_int_equal(r.status, 0);
    if (out)
        assert_string_equal(r.out, out);
    cli_free(&r);
}

/* The tour's walk-through (docs/tour.md), in order, with its exact outputs. */
static void test_cli_readme_examples(void **state)
{
    (void)state;
    write_file("numbers.txt", "5 -3 0 12 7 -1\n", 15);
    expect_ok(cli("filter --gt 0 --stable --text < numbers.txt"), "5\n12\n7\n");
    expect_ok(cli("scan --exclusive --stream s1 --text < numbers.txt"), "0\n5\n2\n2\n14\n21\n");
    expect_ok(cli("scan --stream s1 --text < numbers.txt"), "25\n22\n22\n34\n41\n40\n");

    enum { FRAME = 1000000 };
    uint8_t *frame = malloc(FRAME);
    uint64_t bins[256] = {0};
    for (size_t i = 0; i < FRAME; i++)
        frame[i] = (uint8_t)th_rand();
    tr_hist(TALLY_DTYPE_U8, frame, FRAME, 0, 0, bins);
    write_file("frame.raw", frame, FRAME);
    char *expect = malloc(256 * 32);
    size_t at = 0;
    for (int b = 0; b < 256; b++)
        at += (size_t)sprintf(expect + at, "%d %" PRIu64 "\n", b, bins[b]);
    expect_ok(cli("hist --type u8 --stream cam0 --in frame.raw"), expect);

    /* The summary's first lines (the tour shows them), then every field with --raw. */
    expect_ok(cli("query cam0 | head -3"), "stream     cam0\n"
                                           "type       u8, 256 bins, one per byte value\n"
                                           "count      1000000\n");
    cli_result_t r = cli("query --raw cam0");
    assert_int_equal(r.status, 0);
    const char *head = "batches 1\nelements 1000000\nbytes 1000000\nfilter_seen 0\n"
                       "filter_kept 0\nscan_carry 0\nscan_elements 0\nhist_type u8\n"
                       "hist_lo 0\nhist_hi 0\nhist_underflow 0\nhist_overflow 0\n"
                       "hist_total 1000000\nlast_seq 1\n"; /* one chunk, numbered */
    assert_int_equal(strncmp(r.out, head, strlen(head)), 0);
    assert_string_equal(r.out + strlen(head), expect); /* all 256 bins */
    cli_free(&r);

    r = cli("streams");
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "s1\n"));
    assert_non_null(strstr(r.out, "cam0\n"));
    cli_free(&r);

    expect_ok(cli("reset s1"), "");
    r = cli("query nope");
    assert_int_equal(r.status, 1);
    assert_string_equal(r.out, "");
    assert_string_equal(r.err, "tally: query: unknown_stream: no stream named 'nope'\n");
    cli_free(&r);

    r = cli("ping");
    assert_int_equal(r.status, 0);
    assert_int_equal(strncmp(r.out, "pong ", 5), 0);
    assert_non_null(strstr(r.out, " ms\n"));
    cli_free(&r);
    r = cli("info");
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "protocol=1\n"));
    cli_free(&r);
    r = cli("stats");
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "# TYPE"));
    cli_free(&r);
    free(expect);
    free(frame);
}

/* --text takes signs, any whitespace, no trailing newline, and the extremes of the type. */
static void test_cli_text_forms(void **state)
{
    (void)state;
    write_file("forms.txt", "+5 -0\t7\r\n\n  -2147483648\v2147483647", 34);
    expect_ok(cli("scan --text --in forms.txt"), "5\n5\n12\n-2147483636\n11\n");
    expect_ok(cli("scan --out32 --text --in forms.txt"), "5\n5\n12\n-2147483636\n11\n");
    expect_ok(cli("filter --ge -2147483648 --stable --text --in forms.txt"),
              "5\n0\n7\n-2147483648\n2147483647\n");
    write_file("bytes.txt", "0 255 +7 -0\n", 12);
    expect_ok(cli("filter --type u8 --between 1 255 --stable --text --in bytes.txt"), "255\n7\n");
    write_file("empty.txt", "", 0);
    expect_ok(cli("scan --text --in empty.txt"), "");
    expect_ok(cli("filter --ne 0 --in empty.txt"), "");
}

/* Binary in, binary out, chunked: the same bytes as a whole-message reference. */
static void test_cli_binary_chunked(void **state)
{
    (void)state;
    enum { N = 250001 };
    int32_t *x = th_random_i32(N, -1000, 1000);
    write_file("data.i32", x, 4 * N);
    int64_t *sums = malloc(8 * N);
    int32_t *kept = malloc(4 * N);
    tr_scan(x, N, false, false, 0, sums);
    size_t k = tr_filter(TALLY_DTYPE_I32, x, N, TALLY_PRED_GT, 0, 0, kept);
    expect_ok(cli("scan --in data.i32 --out sums.i64 --chunk 10000 --window 3"), "");
    char path[128];
    snprintf(path, sizeof path, "%s/sums.i64", tmpdir);
    FILE *f = fopen(path, "rb");
    int64_t *got = malloc(8 * N + 8);
    assert_int_equal(fread(got, 8, N + 1, f), N);
    fclose(f);
    assert_memory_equal(got, sums, 8 * N);

    expect_ok(cli("filter --gt 0 --stable --in data.i32 --out kept.i32 --chunk 3K"), "");
    snprintf(path, sizeof path, "%s/kept.i32", tmpdir);
    f = fopen(path, "rb");
    assert_int_equal(fread(got, 4, N, f), k);
    fclose(f);
    assert_memory_equal(got, kept, 4 * k);

    char count[32];
    snprintf(count, sizeof count, "%zu\n", k);
    expect_ok(cli("filter --gt 0 --count < data.i32"), count);

    /* i32 histogram text output ends with the underflow and overflow lines. */
    cli_result_t r = cli("hist --type i32 --range -500 500 --in data.i32 --chunk 65536");
    assert_int_equal(r.status, 0);
    uint64_t counts[TALLY_HIST_I32_VALUES] = {0};
    tr_hist(TALLY_DTYPE_I32, x, N, -500, 500, counts);
    assert_non_null(strstr(r.out, "\n255 "));
    char tail[96];
    snprintf(tail, sizeof tail, "underflow %" PRIu64 "\noverflow %" PRIu64 "\n",
             counts[TALLY_HIST_BINS], counts[TALLY_HIST_BINS + 1]);
    assert_string_equal(r.out + strlen(r.out) - strlen(tail), tail);
    cli_free(&r);
    free(got);
    free(kept);
    free(sums);
    free(x);
}

static void expect_usage(cli_result_t r, const char *needle)
{
    assert_int_equal(r.status, 2);
    assert_string_equal(r.out, "");
    assert_int_equal(strncmp(r.err, "tally: ", 7), 0);
    if (needle && !strstr(r.err, needle))
        fail_msg("stderr '%s' does not mention '%s'", r.err, needle);
    cli_free(&r);
}

static void test_cli_usage_errors(void **state)
{
    (void)state;
    /* --text: what is wrong and where (line, column), the token escaped and cut short. */
    write_file("bad.txt", "1 2\n300 4\n", 10);
    expect_usage(cli("filter --gt 0 --type u8 --text --in bad.txt"),
                 "bad.txt: line 2, column 1: '300' is out of range for u8 [0, 255]");
    write_file("junk.txt", "1 2 x3\n", 7);
    expect_usage(cli("scan --text --in junk.txt"), "junk.txt: line 1, column 5: 'x3' is not");
    write_file("big.txt", "2147483648\n", 11);
    expect_usage(cli("scan --text --in big.txt"), "'2147483648'");
    write_file("nul.txt", "1\0 2", 4);
    expect_usage(cli("scan --text --in nul.txt"), "line 1, column 1: '1\\x00' is binary");
    write_file("json.txt", "[1, 2,\n {\"x\": 3}]\n", 18);
    expect_usage(cli("scan --text --in json.txt"), "json.txt: line 1, column 1: '[1,' is not");
    /* JSON (any text) is not binary i32: refused without --text, as decimal text is. */
    expect_usage(cli("scan --in json.txt"), "json.txt looks like text ('[1, 2,'), not binary i32");
    write_file("esc.txt", "1 2 \x1b[31mred\x7f 4\n", 16);
    cli_result_t esc = cli("scan --text --in esc.txt");
    assert_null(strchr(esc.err, '\x1b')); /* no control sequence reaches the terminal */
    assert_non_null(strstr(esc.err, "line 1, column 5: '\\x1b[31mred\\x7f' is binary"));
    expect_usage(esc, NULL);
    write_file("long.txt", "1 aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n", 53);
    expect_usage(cli("scan --text --in long.txt"), "'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa...'");
    expect_usage(cli("scan --window 257"), "--window");
    write_file("odd.bin", "\x01\x02\x03\x04\x05\x06\x07", 7);
    expect_usage(cli("scan --in odd.bin"), "odd.bin is 7 bytes, not a whole number of 4-byte i32 "
                                           "elements: nothing was sent");
    expect_usage(cli("filter --in numbers.txt"), "predicate");
    expect_usage(cli("filter --gt 1 --lt 2"), "exactly one");
    expect_usage(cli("filter --gt abc"), "'abc'");
    expect_usage(cli("filter --between 5"), "--between");
    expect_usage(cli("hist --type i32"), "--range");
    expect_usage(cli("hist --type i64"), "i64");
    expect_usage(cli("scan --stream 'a b'"), "'a b'");
    expect_usage(cli("scan --chunk 0"), "--chunk");
    expect_usage(cli("scan --window 0"), "--window");
    expect_usage(cli("scan --bogus"), "--bogus");
    expect_usage(cli("scan --in /nonexistent/file"), "/nonexistent/file");
    expect_usage(cli("query"), "argument");
    expect_usage(cli("query a b"), "argument");
    expect_usage(cli("frobnicate"), "frobnicate");
    expect_usage(cli("-t 0 ping"), "--timeout");

    /* --help everywhere: exit 0, usage on stdout. */
    static const char *const cmds[] = {"",       "filter ", "scan ",    "hist ",
                                       "query ", "reset ",  "streams ", "ping ",
                                       "info ",  "stats ",  "watch ",   "delete "};
    for (size_t i = 0; i < sizeof cmds / sizeof *cmds; i++) {
        cli_result_t r = cli("%s--help", cmds[i]);
        assert_int_equal(r.status, 0);
        assert_int_equal(strncmp(r.out, "usage: tally ", 13), 0);
        assert_string_equal(r.err, "");
        cli_free(&r);
    }
}

static void test_cli_daemon_errors_and_timeout(void **state)
{
    (void)state;
    /* A daemon-reported error: exit 1, the status name and the daemon's message. */
    cli_result_t r = cli("reset never-was");
    assert_int_equal(r.status, 1);
    assert_non_null(strstr(r.err, "tally: reset: unknown_stream: "));
    cli_free(&r);
    /* The stream fixed its histogram type with u8; i32 on it conflicts. */
    write_file("one.i32", "\1\0\0\0", 4);
    r = cli("hist --type i32 --range 0 10 --stream cam0 --in one.i32");
    assert_int_equal(r.status, 1);
    assert_int_equal(strncmp(r.err, "tally: hist: ", 13), 0);
    cli_free(&r);

    /* Nobody listening: exit 3 at once (not after the timeout), naming the endpoint and the
     * reason. Port 1 is privileged: nobody there. */
    const char *endpoint = "tcp://127.0.0.1:1";
    int64_t start = th_now_ms();
    r = cli_at(endpoint, "-t 20000 ping");
    assert_int_equal(r.status, 3);
    assert_string_equal(r.err, "tally: cannot connect to tcp://127.0.0.1:1: Connection refused "
                               "(is tallyd running?)\n");
    cli_free(&r);
    r = cli_at(endpoint, "-t 20000 scan --text --in numbers.txt");
    assert_int_equal(r.status, 3);
    cli_free(&r);
    char ipc[128];
    snprintf(ipc, sizeof ipc, "ipc://%s/nobody.sock", tmpdir);
    r = cli_at(ipc, "-t 20000 ping");
    assert_int_equal(r.status, 3);
    assert_non_null(strstr(r.err, ipc));
    assert_non_null(strstr(r.err, "No such file or directory"));
    cli_free(&r);
    /* Generous: the old path waited for the whole 20 s timeout. */
    assert_true(th_now_ms() - start < 10000);
}

/* A tallyd that is stopped (SIGSTOP: its socket accepts, nothing answers) costs one timeout,
 * not one per request the command would make: a data command asked the daemon's max_batch
 * first and, its timeout ignored, pushed into a second one (2 s for -t 1000). It now fails
 * where it connects, with one line and exit 3, before anything is read or sent. */
static void test_cli_stopped_daemon_one_timeout(void **state)
{
    (void)state;
    char dir[64], ipc[128];
    th_daemon_t d;
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-stopped"), 0);
    start_own(&d, dir, ipc, sizeof ipc);
    write_file("numbers.txt", "5 -3 0 12 7 -1\n", 15);
    assert_int_equal(kill(d.pid, SIGSTOP), 0);
    static const char *const cmds[] = {"scan --text < numbers.txt", "ping", "query s1"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        cli_result_t r = cli_at(ipc, "-t 1000 %s", cmds[i]);
        assert_int_equal(r.status, 3);
        assert_string_equal(r.err, "tally: timed out waiting for a connection to tallyd (is "
                                   "tallyd running? with CURVE: does it accept this client's "
                                   "key?)\n");
        cli_free(&r);
    }
    assert_int_equal(kill(d.pid, SIGCONT), 0);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
    assert_int_equal(th_rmrf(dir), 0);
}

/* --shm and --gpu-region against a tallyd with shared memory off: said with what to do (it was
 * only libtally's "the daemon offers no shared memory"), before anything is read or sent. */
static void test_cli_shm_off_says_what_to_do(void **state)
{
    (void)state;
    th_daemon_t d;
    const char *args[] = {"--backend", "cpu", "--shm", "off", NULL};
    assert_int_equal(th_daemon_start(&d, args), 0);
    write_file("bytes.txt", "1 2 3\n", 6);
    static const char *const opts[] = {"--shm", "--gpu-region"};
    for (size_t i = 0; i < 2; i++) {
        cli_result_t r = cli_at(d.endpoint, "hist %s --text < bytes.txt", opts[i]);
        char want[256];
        snprintf(want, sizeof want,
                 "tally: hist: this tallyd offers no shared memory (info: shm=off): run without "
                 "%s (the chunks then go over its socket), or start tallyd with --shm on\n",
                 opts[i]);
        assert_int_equal(r.status, 2);
        assert_string_equal(r.err, want);
        cli_free(&r);
    }
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
}

/* Endpoints are checked before anything connects or binds; sizes name the option and why. */
static void test_cli_endpoint_and_size_errors(void **state)
{
    (void)state;
    cli_result_t r = cli_at("tcp://127.0.0.1:5570x", "ping");
    assert_int_equal(r.status, 2);
    assert_string_equal(r.err, "tally: invalid endpoint 'tcp://127.0.0.1:5570x': port '5570x' "
                               "is not a number from 1 to 65535\n");
    cli_free(&r);
    expect_usage(cli_at("udp://127.0.0.1:5", "ping"), "unsupported transport");
    expect_usage(cli_at("tcp://no-such-host.invalid:5555", "ping"), "cannot resolve host");
    expect_usage(cli("scan --chunk 1T"),
                 "invalid size '1T' for --chunk: unknown suffix 'T' (use K, M or G)");
    expect_usage(cli("scan --chunk -5"), "invalid size '-5' for --chunk");
    expect_usage(cli("scan --window 2x"), "invalid number '2x' for --window");
    /* TALLY_ENDPOINT is the default endpoint (documented in --help). */
    char cmd[512];
    snprintf(cmd, sizeof cmd, "TALLY_ENDPOINT='%s' '%s' ping > /dev/null", daemon_.endpoint,
             th_tally_bin());
    assert_int_equal(system(cmd), 0);
    r = cli("--help");
    assert_non_null(strstr(r.out, "TALLY_ENDPOINT"));
    cli_free(&r);
    /* hist --help describes hist's own output, not 'one value per line'. */
    r = cli("hist --help");
    assert_non_null(strstr(r.out, "258"));
    assert_null(strstr(r.out, "one value per line"));
    cli_free(&r);

    /* tallyd refuses the same endpoint, and names the option of a bad size. */
    snprintf(cmd, sizeof cmd, "'%s' --bind tcp://127.0.0.1:5570x 2> '%s/d.err'", th_tallyd_bin(),
             tmpdir);
    assert_int_equal(WEXITSTATUS(system(cmd)), 2);
    char path[128];
    snprintf(path, sizeof path, "%s/d.err", tmpdir);
    char *err = slurp(path);
    assert_non_null(strstr(err, "invalid endpoint 'tcp://127.0.0.1:5570x' for --bind: port"));
    free(err);
    snprintf(cmd, sizeof cmd, "'%s' --max-batch 1T 2> '%s/d.err'", th_tallyd_bin(), tmpdir);
    assert_int_equal(WEXITSTATUS(system(cmd)), 2);
    err = slurp(path);
    assert_non_null(strstr(err, "invalid value '1T' for --max-batch"));
    free(err);
}

/* The refusals that come before anything is sent, each in its exact words with exit 2 (nothing
 * on stdout): the options before the command, a command's own options and arguments, the
 * combinations that contradict each other, and files that cannot be had. Then what reaches the
 * terminal of a daemon's words (a backslash escaped) and a stdout that cannot be written. */
static void expect_said(cli_result_t r, const char *err)
{
    assert_int_equal(r.status, 2);
    assert_string_equal(r.out, "");
    assert_string_equal(r.err, err);
    cli_free(&r);
}

/* Which fleet a command goes to (docs/cli.md): --nats and --fleet together are refused; either
 * on the command line wins over $TALLY_FLEET and $TALLY_NATS, $TALLY_FLEET over $TALLY_NATS, and a
 * fleet over -e. --resume's record is keyed by the fleet's servers (no password), so the message
 * of a missing one names them: that is how each case shows its choice, before NATS is reached. */
static void test_cli_fleet_precedence(void **state)
{
    (void)state;
    setenv("XDG_STATE_HOME", tmpdir, 1); /* no record from elsewhere */
    expect_said(cli("--nats nats://127.0.0.1:1 --fleet nats://127.0.0.1:1 ping"),
                "tally: ping: --nats and --fleet are two ways to a fleet (through JetStream, or "
                "direct mode): give one (see 'tally ping --help')\n");
    expect_said(cli("hist --nats nats://127.0.0.1:1 --fleet nats://127.0.0.1:2 --stream s"),
                "tally: hist: --nats and --fleet are two ways to a fleet (through JetStream, or "
                "direct mode): give one (see 'tally hist --help')\n");
    const char *resume = "hist --stream s --resume --text";
    expect_said(cli("--fleet nats://u:secret@127.0.0.1:1 %s", resume),
                "tally: hist: --resume: no stopped push to stream 's' at nats://u:***@127.0.0.1:1 "
                "is recorded here; give --seq-base N (the stop message printed N) (see 'tally "
                "hist --help')\n");
    setenv("TALLY_NATS", "nats://127.0.0.1:3", 1);
    expect_said(cli("%s", resume), "tally: hist: --resume: no stopped push to stream 's' at "
                                   "nats://127.0.0.1:3 is recorded here; give --seq-base N (the "
                                   "stop message printed N) (see 'tally hist --help')\n");
    setenv("TALLY_FLEET", "nats://127.0.0.1:2", 1);
    expect_said(cli("%s", resume), "tally: hist: --resume: no stopped push to stream 's' at "
                                   "nats://127.0.0.1:2 is recorded here; give --seq-base N (the "
                                   "stop message printed N) (see 'tally hist --help')\n");
    expect_said(cli("--nats nats://127.0.0.1:1 %s", resume),
                "tally: hist: --resume: no stopped push to stream 's' at nats://127.0.0.1:1 is "
                "recorded here; give --seq-base N (the stop message printed N) (see 'tally hist "
                "--help')\n");
    expect_said(cli("%s --fleet nats://127.0.0.1:4", resume),
                "tally: hist: --resume: no stopped push to stream 's' at nats://127.0.0.1:4 is "
                "recorded here; give --seq-base N (the stop message printed N) (see 'tally hist "
                "--help')\n");
    unsetenv("TALLY_FLEET");
    unsetenv("TALLY_NATS");
    unsetenv("XDG_STATE_HOME");
}

static void test_cli_refusals_word_for_word(void **state)
{
    (void)state;
    /* Before the command. */
    cli_result_t r = cli("%s", "");
    assert_int_equal(r.status, 2);
    assert_string_equal(r.out, "");
    assert_int_equal(strncmp(r.err, "usage: tally [-e ENDPOINT] [-t TIMEOUT_MS] COMMAND", 50), 0);
    cli_free(&r);
    r = cli("help");
    assert_int_equal(r.status, 0);
    assert_int_equal(strncmp(r.out, "usage: tally [-e ENDPOINT] [-t TIMEOUT_MS] COMMAND", 50), 0);
    assert_non_null(strstr(r.out, "\nCommands:\n  filter "));
    assert_string_equal(r.err, "");
    cli_free(&r);
    expect_said(cli("--bogus ping"), "tally: unknown option '--bogus' (see 'tally --help')\n");
    expect_said(cli("-e"), "tally: option '-e' needs an argument (see 'tally --help')\n");
    expect_said(cli("-t '' ping"), "tally: invalid number '' for --timeout: expected "
                                   "1..2147483647 (see 'tally --help')\n");
    /* A command's options and arguments. */
    expect_said(cli("ping extra"),
                "tally: ping: unexpected argument 'extra' (see 'tally ping --help')\n");
    expect_said(cli("scan --window"),
                "tally: scan: option '--window' needs an argument (see 'tally scan --help')\n");
    expect_said(cli("scan -Z"), "tally: scan: unknown option '-Z' (see 'tally scan --help')\n");
    expect_said(cli("filter --between 5 1 --text"),
                "tally: filter: --between: LO must be <= HI (see 'tally filter --help')\n");
    expect_said(cli("hist --type i32 --range 5 5"),
                "tally: hist: --range: LO must be < HI (see 'tally hist --help')\n");
    expect_said(cli("hist --frames 6 --type i32 --range 0 10"),
                "tally: hist: --frames: 6 bytes is not a whole number of 4-byte i32 (see 'tally "
                "hist --help')\n");
    expect_said(cli("hist --frames 4 --text"), "tally: hist: --frames applies to binary input, "
                                               "not --text (see 'tally hist --help')\n");
    expect_said(cli("scan --no-seq --resume --stream s"),
                "tally: scan: --seq-base and --resume need sequence numbers, which --no-seq "
                "turns off (see 'tally scan --help')\n");
    expect_said(cli("scan --seq-base 1"),
                "tally: scan: --seq-base and --resume need --stream (see 'tally scan --help')\n");
    expect_said(cli("scan --resume --seq-base 3 --stream s"),
                "tally: scan: give --seq-base or --resume, not both (see 'tally scan --help')\n");
    expect_said(cli("reset 'a b'"), "tally: reset: invalid stream name 'a b': 1-64 printable "
                                    "ASCII bytes, no spaces (see 'tally reset --help')\n");
    char quantiles[65 * 18 + 1] = "";
    for (int i = 1; i <= 65; i++) /* one more than TALLY_QUANTILES_MAX, each its own */
        snprintf(quantiles + strlen(quantiles), sizeof quantiles - strlen(quantiles),
                 "--quantile 0.%03d ", i);
    expect_said(cli("query %s s", quantiles),
                "tally: query: at most 64 --quantile (see 'tally query --help')\n");
    expect_said(cli("watch 'a b'"),
                "tally: watch: invalid stream name 'a b' (see 'tally watch --help')\n");
    expect_said(cli("watch --sub tcp://127.0.0.1:1 --nats nats://127.0.0.1:1 s"),
                "tally: watch: --sub takes tallyd's PUB socket; with --nats or --fleet watch "
                "subscribes to the fleet's publications itself (see 'tally watch --help')\n");
    expect_said(cli("watch --sub tcp://127.0.0.1:1 --fleet nats://127.0.0.1:1 s"),
                "tally: watch: --sub takes tallyd's PUB socket; with --nats or --fleet watch "
                "subscribes to the fleet's publications itself (see 'tally watch --help')\n");
    expect_said(cli_at("udp://127.0.0.1:1", "watch s"),
                "tally: watch: invalid endpoint 'udp://127.0.0.1:1' for -e: unsupported "
                "transport (use tcp://HOST:PORT or ipc://PATH) (see 'tally watch --help')\n");
    expect_said(cli("watch --sub bogus://1 s"),
                "tally: watch: invalid endpoint 'bogus://1' for --sub: unsupported transport (use "
                "tcp://HOST:PORT or ipc://PATH) (see 'tally watch --help')\n");
    expect_said(cli("watch s"), "tally: watch: stdout is not a terminal (use --once for one "
                                "frame) (see 'tally watch --help')\n");
    expect_said(cli("keygen ''"), "tally: keygen: bad NAME (see 'tally keygen --help')\n");
    /* Files that cannot be had. */
    expect_said(cli("watch --once --server-key /nonexistent/server.pub s"),
                "tally: CURVE keys: cannot read /nonexistent/server.pub: No such file or "
                "directory\n");
    write_file("three.txt", "1 2 3\n", 6);
    expect_said(cli("scan --text --in three.txt --out /nonexistent/sums.i64"),
                "tally: cannot open '/nonexistent/sums.i64' for writing: No such file or "
                "directory\n");

    /* The daemon's words reach the terminal escaped: a backslash in a stream's name doubled. */
    r = cli("-t 60000 query 'a\\b'"); /* a bound a loaded tallyd never reaches */
    assert_int_equal(r.status, 1);
    assert_string_equal(r.out, "");
    assert_string_equal(r.err, "tally: query: unknown_stream: no stream named 'a\\\\b'\n");
    cli_free(&r);
    /* A stdout that cannot take the reply: said, exit 2. */
    char cmd[512], path[128];
    snprintf(path, sizeof path, "%s/full.err", tmpdir);
    snprintf(cmd, sizeof cmd, "'%s' -e '%s' -t 60000 ping > /dev/full 2> '%s'", th_tally_bin(),
             daemon_.endpoint, path);
    assert_int_equal(WEXITSTATUS(system(cmd)), 2);
    char *err = slurp(path);
    assert_string_equal(err, "tally: cannot write to stdout: No space left on device\n");
    free(err);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lib_control),
        cmocka_unit_test(test_lib_filter_chunked),
        cmocka_unit_test(test_lib_scan_chunked),
        cmocka_unit_test(test_lib_scan_stream),
        cmocka_unit_test(test_lib_hist_stream),
        cmocka_unit_test(test_lib_push),
        cmocka_unit_test(test_lib_chunk_too_large),
        cmocka_unit_test(test_lib_replies_survive_disconnect),
        cmocka_unit_test(test_lib_no_send_while_down),
        cmocka_unit_test(test_lib_push_cut_by_stop_is_exact),
        cmocka_unit_test(test_cli_readme_examples),
        cmocka_unit_test(test_cli_text_forms),
        cmocka_unit_test(test_cli_binary_chunked),
        cmocka_unit_test(test_cli_usage_errors),
        cmocka_unit_test(test_cli_daemon_errors_and_timeout),
        cmocka_unit_test(test_cli_stopped_daemon_one_timeout),
        cmocka_unit_test(test_cli_shm_off_says_what_to_do),
        cmocka_unit_test(test_cli_endpoint_and_size_errors),
        cmocka_unit_test(test_cli_refusals_word_for_word),
        cmocka_unit_test(test_cli_fleet_precedence),
    };
    th_seed();
    return cmocka_run_group_tests_name("client_daemon", tests, setup, teardown);
}
