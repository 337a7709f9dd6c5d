/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_seq.c — idempotent requests: per-stream sequence numbers (PROTOCOL.md, "Sequence
 * numbers").
 *
 * Three layers:
 *   - td_request_admit / td_request_apply directly (linked from td_core), for the cases a real
 *     daemon reaches only through a failure after admission: a request whose predecessor failed
 *     after both were admitted is refused at apply time with sequence_gap and changes nothing;
 *   - a real tallyd over a raw DEALER socket: in-order seqs applied, a resent seq gets
 *     duplicate with aux0 = last applied and leaves the stream byte for byte as it was, a gap is
 *     refused, a failed request does not use up its seq, reset keeps it, delete restarts it, seq
 *     survives SIGTERM and a restart with --state-dir, and the same rules hold when the
 *     requests are pipelined on the simulated GPU pipeline (with and without injected faults;
 *     on the real GPUs with TALLY_SEQ_ENGINE=cuda, which test_seq_gpu sets in CUDA builds);
 *   - the `tally` CLI pushing a file in chunks while tallyd is stopped (SIGTERM) and started
 *     again on the same state directory: the stream ends holding exactly the first k chunks,
 *     k being what the CLI reports (or all of them), never a chunk twice; a re-run with the
 *     --seq-base it printed completes the push exactly.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"
#include "reference.h"
#include "td_request.h"
#include "td_stream.h"

static uint64_t next_id = 1;

/* ---- helpers ------------------------------------------------------------------------------ */

static tally_req_t scan_req(const char *stream, uint64_t seq)
{
    tally_req_t req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, next_id++);
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    req.seq = seq;
    return req;
}

/* Sends one scan of x[0..n) with seq and returns the reply's status (reply kept in *r). */
static uint32_t scan(void *sock, const char *stream, uint64_t seq, const int32_t *x, size_t n,
                     th_reply_t *r)
{
    tally_req_t req = scan_req(stream, seq);
    assert_int_equal(th_call(sock, &req, x, n * 4, r), 0);
    return r->rep.status;
}

static void expect_scan_ok(void *sock, const char *stream, uint64_t seq, const int32_t *x, size_t n)
{
    th_reply_t r;
    assert_int_equal(scan(sock, stream, seq, x, n, &r), TALLY_OK);
    th_reply_free(&r);
}

/* Expects a refusal with `status` whose aux0 is the stream's last applied seq. */
static void expect_scan_refused(void *sock, const char *stream, uint64_t seq, const int32_t *x,
                                size_t n, uint32_t status, uint64_t last_seq)
{
    th_reply_t r;
    assert_int_equal(scan(sock, stream, seq, x, n, &r), status);
    assert_int_equal(r.rep.dtype, TALLY_DTYPE_TEXT);
    assert_int_equal(r.rep.count, 0);
    assert_true(r.rep.aux0 == last_seq);
    assert_true(r.len > 0);
    th_reply_free(&r);
}

/* The raw query payload of a stream (TALLY_QUERY_PAYLOAD_SIZE bytes into out). */
static void query_raw(void *sock, const char *stream, uint8_t *out)
{
    long len = th_query_raw(sock, stream, next_id++, out, TALLY_QUERY_PAYLOAD_SIZE);
    assert_int_equal(len, TALLY_QUERY_PAYLOAD_SIZE);
}

static tally_stream_info_t query(void *sock, const char *stream)
{
    uint8_t raw[TALLY_QUERY_PAYLOAD_SIZE];
    query_raw(sock, stream, raw);
    tally_stream_info_t info;
    assert_int_equal(tally_stream_info_decode(raw, sizeof raw, &info), TALLY_OK);
    return info;
}

/* Chunk k of the test inputs: n values derived from k, so each chunk's sum differs. */
static void fill_chunk(int32_t *x, size_t n, uint64_t k)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (int32_t)((k + 1) * 1000 + i) * (k % 2 ? -1 : 1);
}

/* ---- td_request_admit / td_request_apply, without a daemon ------------------------------- */

static td_request_t *unit_req(td_stream_t *stream, uint64_t seq)
{
    td_request_t *r = td_request_new();
    assert_non_null(r);
    r->stream = stream;
    r->req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, 1);
    r->req.seq = seq;
    return r;
}

/* An idle stream named "u" that has applied seq 1..5, in a table of its own (*table). */
static td_stream_t *unit_stream(td_streams_t **table)
{
    td_stream_t *stream = NULL;
    assert_int_equal(td_streams_new(8, table), TD_OK);
    assert_int_equal(td_streams_get(*table, "u", 1, &stream), TALLY_OK);
    stream->info.last_seq = 5;
    return stream;
}

static void test_admit_rules(void **state)
{
    (void)state;
    td_streams_t *table = NULL;
    td_stream_t *stream = unit_stream(&table);
    stream->seq_admitted = 2; /* stale: nothing in flight, so the applied seq counts */

    td_request_t *r = unit_req(stream, 5);
    assert_false(td_request_admit(r, false));
    assert_int_equal(r->rep.status, TALLY_E_DUPLICATE);
    assert_int_equal(r->rep.aux0, 5);
    td_request_destroy(&r);
    r = unit_req(stream, 7);
    assert_false(td_request_admit(r, false));
    assert_int_equal(r->rep.status, TALLY_E_SEQ_GAP);
    assert_int_equal(r->rep.aux0, 5);
    td_request_destroy(&r);
    r = unit_req(stream, 6);
    assert_true(td_request_admit(r, false));
    assert_int_equal(stream->seq_admitted, 6);
    td_request_destroy(&r);

    /* While 6 is in flight, 7 is the next one and may start; 6 again or 8 must wait. */
    r = unit_req(stream, 7);
    assert_false(td_request_seq_waits(r, true));
    r->req.seq = 6;
    assert_true(td_request_seq_waits(r, true));
    r->req.seq = 8;
    assert_true(td_request_seq_waits(r, true));
    r->req.seq = 0; /* unnumbered requests are never held */
    assert_false(td_request_seq_waits(r, true));
    td_request_destroy(&r);
    td_streams_destroy(&table);
}

/* 6 and 7 were admitted (pipelined); 6 failed; 7 must be refused when it comes back. */
static void test_apply_refuses_after_failed_predecessor(void **state)
{
    (void)state;
    td_streams_t *table = NULL;
    td_stream_t *stream = unit_stream(&table);
    stream->info.scan_carry = 40;
    stream->info.batches = 5;
    td_stream_info_t before = stream->info;

    td_request_t *six = unit_req(stream, 6);
    td_request_fail(six, TALLY_E_BACKEND, "test: the backend failed");
    assert_false(td_request_apply(six));
    td_request_destroy(&six);

    td_request_t *seven = unit_req(stream, 7);
    seven->carry = 123; /* its computed carry-out, to be discarded */
    td_request_succeed(seven, TALLY_DTYPE_I64, malloc(8), 8, 1);
    assert_false(td_request_apply(seven));
    assert_int_equal(seven->rep.status, TALLY_E_SEQ_GAP);
    assert_int_equal(seven->rep.aux0, 5);
    assert_int_equal(seven->rep.dtype, TALLY_DTYPE_TEXT);
    assert_memory_equal(&stream->info, &before, sizeof before);
    td_request_destroy(&seven);

    td_request_t *again = unit_req(stream, 6); /* the resent 6 applies */
    again->carry = 77;
    td_request_succeed(again, TALLY_DTYPE_I64, NULL, 0, 0);
    assert_true(td_request_apply(again));
    assert_int_equal(stream->info.last_seq, 6);
    assert_int_equal(stream->info.scan_carry, 77);
    assert_int_equal(stream->info.batches, 6);
    td_request_destroy(&again);
    td_streams_destroy(&table);
}

/* ---- a real tallyd ------------------------------------------------------------------------ */

/* Scans chunks seq 1..3 of n elements on `stream` in order; returns the carry they make. */
static int64_t scan_first_three(void *sock, const char *stream, size_t n)
{
    int32_t x[100];
    assert_true(n <= 100);
    int64_t carry = 0;
    for (uint64_t seq = 1; seq <= 3; seq++) {
        fill_chunk(x, n, seq);
        expect_scan_ok(sock, stream, seq, x, n);
        carry += (int64_t)tr_sum(x, n, 0);
    }
    return carry;
}

static void test_in_order_duplicate_gap(void **state)
{
    (void)state;
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, NULL), 0);
    void *sock = th_connect(d.endpoint, 10000);
    int32_t x[100];
    int64_t carry = scan_first_three(sock, "s", 100);
    uint8_t before[TALLY_QUERY_PAYLOAD_SIZE], after[TALLY_QUERY_PAYLOAD_SIZE];
    query_raw(sock, "s", before);
    assert_int_equal(tally_get_u64(before + 104), 3); /* last_seq at payload bytes 104..111 */
    assert_true((int64_t)tally_get_u64(before + 40) == carry);

    /* A resent chunk is not applied again; a gap is refused; the stream does not change. */
    fill_chunk(x, 100, 2);
    expect_scan_refused(sock, "s", 2, x, 100, TALLY_E_DUPLICATE, 3);
    expect_scan_refused(sock, "s", 3, x, 100, TALLY_E_DUPLICATE, 3);
    expect_scan_refused(sock, "s", 5, x, 100, TALLY_E_SEQ_GAP, 3);
    query_raw(sock, "s", after);
    assert_memory_equal(before, after, sizeof before);

    /* The next one applies; unnumbered requests still work and leave last_seq alone. */
    fill_chunk(x, 100, 4);
    th_reply_t r;
    assert_int_equal(scan(sock, "s", 4, x, 100, &r), TALLY_OK);
    carry += (int64_t)tr_sum(x, 100, 0);
    assert_true((int64_t)r.rep.aux0 == carry);
    th_reply_free(&r);
    expect_scan_ok(sock, "s", 0, x, 100);
    carry += (int64_t)tr_sum(x, 100, 0);
    tally_stream_info_t info = query(sock, "s");
    assert_int_equal(info.last_seq, 4);
    assert_int_equal(info.batches, 5);
    assert_true(info.scan_carry == carry);

    /* seq is for batches on a stream: elsewhere it is bad_param. */
    tally_req_t bad = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, next_id++);
    bad.seq = 1;
    assert_int_equal(th_call_status(sock, &bad, x, 4), TALLY_E_PARAM);
    bad = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, next_id++);
    assert_int_equal(tally_req_set_stream(&bad, "s"), TALLY_OK);
    bad.seq = 4;
    assert_int_equal(th_call_status(sock, &bad, NULL, 0), TALLY_E_PARAM);

    /* reset zeroes the stream and keeps last_seq: the producer goes on with seq 5, and the
     * scan carry starts again from 0. */
    tally_req_t reset = th_req(TALLY_OP_RESET, TALLY_DTYPE_NONE, next_id++);
    assert_int_equal(tally_req_set_stream(&reset, "s"), TALLY_OK);
    assert_int_equal(th_call_status(sock, &reset, NULL, 0), TALLY_OK);
    info = query(sock, "s");
    assert_int_equal(info.last_seq, 4);
    assert_int_equal(info.batches, 0);
    assert_true(info.scan_carry == 0);
    expect_scan_refused(sock, "s", 4, x, 100, TALLY_E_DUPLICATE, 4);
    assert_int_equal(scan(sock, "s", 5, x, 100, &r), TALLY_OK);
    assert_true((int64_t)r.rep.aux0 == (int64_t)tr_sum(x, 100, 0));
    th_reply_free(&r);

    /* delete forgets the stream: its sequence starts again at 1. */
    tally_req_t del = th_req(TALLY_OP_DELETE, TALLY_DTYPE_NONE, next_id++);
    assert_int_equal(tally_req_set_stream(&del, "s"), TALLY_OK);
    assert_int_equal(th_call_status(sock, &del, NULL, 0), TALLY_OK);
    expect_scan_refused(sock, "s", 6, x, 100, TALLY_E_SEQ_GAP, 0);
    expect_scan_ok(sock, "s", 1, x, 100);
    assert_int_equal(query(sock, "s").last_seq, 1);

    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

/* A request that fails (here: a histogram that conflicts with the stream's) leaves its seq
 * free: the next request with the same seq applies. */
static void test_failed_request_keeps_its_seq(void **state)
{
    (void)state;
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, NULL), 0);
    void *sock = th_connect(d.endpoint, 10000);
    uint8_t bytes[64];
    for (size_t i = 0; i < sizeof bytes; i++)
        bytes[i] = (uint8_t)i;
    tally_req_t u8 = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, next_id++);
    assert_int_equal(tally_req_set_stream(&u8, "h"), TALLY_OK);
    u8.seq = 1;
    th_reply_t r;
    assert_int_equal(th_call_status(sock, &u8, bytes, sizeof bytes), TALLY_OK);

    tally_req_t i32 = th_req(TALLY_OP_HIST, TALLY_DTYPE_I32, next_id++);
    assert_int_equal(tally_req_set_stream(&i32, "h"), TALLY_OK);
    i32.lo = 0;
    i32.hi = 100;
    i32.seq = 2;
    assert_int_equal(th_call(sock, &i32, bytes, sizeof bytes, &r), 0);
    assert_int_equal(r.rep.status, TALLY_E_STREAM_STATE);
    assert_int_equal(r.rep.aux0, 0);
    th_reply_free(&r);
    tally_stream_info_t info = query(sock, "h");
    assert_int_equal(info.last_seq, 1);
    assert_int_equal(info.hist_total, sizeof bytes);

    u8.request_id = next_id++;
    u8.seq = 2;
    assert_int_equal(th_call_status(sock, &u8, bytes, sizeof bytes), TALLY_OK);
    info = query(sock, "h");
    assert_int_equal(info.last_seq, 2);
    assert_int_equal(info.hist_total, 2 * sizeof bytes);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

static void test_seq_survives_restart(void **state)
{
    (void)state;
    char dir[] = "/tmp/tally-seq-XXXXXX";
    assert_non_null(mkdtemp(dir));
    const char *args[] = {"--state-dir", dir, NULL};
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, args), 0);
    void *sock = th_connect(d.endpoint, 10000);
    int32_t x[50];
    int64_t carry = scan_first_three(sock, "keep", 50);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);

    assert_int_equal(th_daemon_start(&d, args), 0);
    sock = th_connect(d.endpoint, 10000);
    tally_stream_info_t info = query(sock, "keep");
    assert_int_equal(info.last_seq, 3);
    assert_true(info.scan_carry == carry);
    fill_chunk(x, 50, 3);
    expect_scan_refused(sock, "keep", 3, x, 50, TALLY_E_DUPLICATE, 3);
    fill_chunk(x, 50, 4);
    expect_scan_ok(sock, "keep", 4, x, 50);
    assert_int_equal(query(sock, "keep").last_seq, 4);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
    th_rmrf(dir);
}

/* ---- pipelined on the simulated GPU ------------------------------------------------------- */

#define PIPE_CHUNKS 40
#define PIPE_N 2000

/* What a pipelined request must get back. */
typedef struct {
    uint64_t id;
    uint64_t seq;
    uint32_t status;
    uint64_t aux0; /* refusals: the last applied seq */
} expect_t;

/* Sends all of reqs without waiting, then matches every reply by request id. */
static void pipeline(void *sock, const tally_req_t *reqs, int32_t (*inputs)[PIPE_N],
                     const expect_t *want, size_t count)
{
    for (size_t i = 0; i < count; i++)
        assert_int_equal(th_send_request(sock, &reqs[i], inputs[i], PIPE_N * 4), 0);
    bool seen[3 * PIPE_CHUNKS] = {false};
    for (size_t got = 0; got < count; got++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(sock, &r), 0);
        size_t i = 0;
        while (i < count && want[i].id != r.rep.request_id)
            i++;
        assert_true(i < count && !seen[i]);
        seen[i] = true;
        if (r.rep.status != want[i].status)
            fail_msg("seq %" PRIu64 ": status %u, expected %u (%s)", want[i].seq, r.rep.status,
                     want[i].status, (char *)r.payload);
        if (want[i].status != TALLY_OK)
            assert_true(r.rep.aux0 == want[i].aux0);
        th_reply_free(&r);
    }
}

static void run_pipelined(const char *const *args)
{
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, args), 0);
    void *sock = th_connect(d.endpoint, 20000);
    static int32_t inputs[3 * PIPE_CHUNKS][PIPE_N];
    tally_req_t reqs[3 * PIPE_CHUNKS];
    expect_t want[3 * PIPE_CHUNKS];
    size_t count = 0;
    int64_t carry = 0;
    /* seq 1..PIPE_CHUNKS in order, with a resent seq and a gap slipped in mid-way. The resent
     * one waits for the stream to drain and is then judged against what was applied. */
    for (uint64_t k = 1; k <= PIPE_CHUNKS; k++) {
        fill_chunk(inputs[count], PIPE_N, k);
        carry += (int64_t)tr_sum(inputs[count], PIPE_N, 0);
        reqs[count] = scan_req("p", k);
        want[count] = (expect_t){reqs[count].request_id, k, TALLY_OK, 0};
        count++;
        if (k == PIPE_CHUNKS / 2) {
            fill_chunk(inputs[count], PIPE_N, 3);
            reqs[count] = scan_req("p", 3);
            want[count] = (expect_t){reqs[count].request_id, 3, TALLY_E_DUPLICATE, k};
            count++;
            fill_chunk(inputs[count], PIPE_N, 99);
            reqs[count] = scan_req("p", k + 5);
            want[count] = (expect_t){reqs[count].request_id, k + 5, TALLY_E_SEQ_GAP, k};
            count++;
        }
    }
    pipeline(sock, reqs, inputs, want, count);
    tally_stream_info_t info = query(sock, "p");
    assert_int_equal(info.last_seq, PIPE_CHUNKS);
    assert_int_equal(info.batches, PIPE_CHUNKS);
    assert_true(info.scan_carry == carry);
    assert_int_equal(info.scan_elements, (uint64_t)PIPE_CHUNKS * PIPE_N);

    /* A numbered request that fails while its predecessors are on the GPU (a histogram of
     * the wrong type) does not use up its seq: the ones pipelined behind it are refused with
     * sequence_gap, and the stream holds exactly what came before it. */
    uint8_t bytes[16] = {0};
    tally_req_t u8 = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, next_id++);
    assert_int_equal(tally_req_set_stream(&u8, "p"), TALLY_OK);
    u8.seq = PIPE_CHUNKS + 1;
    assert_int_equal(th_call_status(sock, &u8, bytes, sizeof bytes), TALLY_OK);
    count = 0;
    uint64_t base = PIPE_CHUNKS + 1;
    int64_t carry_ok = carry;
    for (uint64_t k = base + 1; k <= base + 6; k++) {
        fill_chunk(inputs[count], PIPE_N, k);
        reqs[count] = scan_req("p", k);
        if (k == base + 3) { /* the failure: an i32 hist on a u8-hist stream */
            reqs[count].opcode = TALLY_OP_HIST;
            reqs[count].lo = 0;
            reqs[count].hi = 10;
        }
        uint32_t st = k < base + 3    ? TALLY_OK
                      : k == base + 3 ? TALLY_E_STREAM_STATE
                                      : TALLY_E_SEQ_GAP;
        if (st == TALLY_OK)
            carry_ok += (int64_t)tr_sum(inputs[count], PIPE_N, 0);
        want[count] =
            (expect_t){reqs[count].request_id, k, st, st == TALLY_E_SEQ_GAP ? base + 2 : 0};
        count++;
    }
    pipeline(sock, reqs, inputs, want, count);
    info = query(sock, "p");
    assert_int_equal(info.last_seq, base + 2);
    assert_true(info.scan_carry == carry_ok);
    /* The sender resends from the failed seq, as a scan this time, and the stream goes on. */
    fill_chunk(inputs[0], PIPE_N, 7);
    expect_scan_ok(sock, "p", base + 3, inputs[0], PIPE_N);
    carry_ok += (int64_t)tr_sum(inputs[0], PIPE_N, 0);
    info = query(sock, "p");
    assert_int_equal(info.last_seq, base + 3);
    assert_true(info.scan_carry == carry_ok);

    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

/* TALLY_SEQ_ENGINE=cuda (test_seq_gpu, CUDA builds): the real GPUs instead of simulated ones. */
static bool use_cuda(void)
{
    const char *e = getenv("TALLY_SEQ_ENGINE");
    return e && strcmp(e, "cuda") == 0;
}

static void test_pipelined_gpu(void **state)
{
    (void)state;
    const char *sim[] = {"--backend", "cuda", "--test-sim-gpus", "2", NULL};
    const char *cuda[] = {"--backend", "cuda", NULL};
    run_pipelined(use_cuda() ? cuda : sim);
}

/* Every 3rd GPU request fails and reruns on the CPU: the sequence is unaffected. */
static void test_pipelined_gpu_faults(void **state)
{
    (void)state;
    const char *sim[] = {"--backend", "cuda", "--test-sim-gpus", "2", "--test-fault-every",
                         "3",         NULL};
    const char *cuda[] = {"--backend", "cuda", "--test-fault-every", "3", NULL};
    run_pipelined(use_cuda() ? cuda : sim);
}

/* ---- the CLI across a restart ------------------------------------------------------------- */

#define PUSH_CHUNKS 6000
#define PUSH_N 16 /* int32 per chunk: small chunks, so the push takes a while */

/* Runs `tally -e endpoint -t 5000 scan --stream big --in FILE --chunk 64 --window 2 [extra]`
 * in the background, its stderr to err_path. */
static pid_t start_push(const char *endpoint, const char *in, const char *err_path,
                        const char *extra)
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int null = open("/dev/null", O_WRONLY);
        dup2(fd, 2);
        dup2(null, 1);
        const char *bin = getenv("TALLY_BIN");
        const char *argv[] = {bin && *bin ? bin : "./tally",
                              "-e",
                              endpoint,
                              "-t",
                              "5000",
                              "scan",
                              "--stream",
                              "big",
                              "--in",
                              in,
                              "--chunk",
                              "64",
                              "--window",
                              "2",
                              extra,
                              extra ? "0" : NULL,
                              NULL};
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    return pid;
}

static int wait_exit(pid_t pid)
{
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static char *read_text(const char *path)
{
    static char buf[8192];
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    return buf;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void test_cli_push_across_restart(void **state)
{
    (void)state;
    char dir[] = "/tmp/tally-push-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char ipc[128], in[128], err[128];
    snprintf(ipc, sizeof ipc, "ipc://%s/sock", dir);
    snprintf(in, sizeof in, "%s/big.i32", dir);
    snprintf(err, sizeof err, "%s/err", dir);
    static int32_t data[PUSH_CHUNKS][PUSH_N];
    static int64_t prefix[PUSH_CHUNKS + 1]; /* carry after the first k chunks */
    for (uint64_t k = 0; k < PUSH_CHUNKS; k++) {
        fill_chunk(data[k], PUSH_N, k);
        prefix[k + 1] = (int64_t)tr_sum(data[k], PUSH_N, (uint64_t)prefix[k]);
    }
    FILE *f = fopen(in, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, sizeof data, 1, f), 1);
    fclose(f);

    const char *args[] = {"--state-dir", dir, "--bind", ipc, NULL};
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, args), 0);
    void *sock = th_connect(d.endpoint, 10000);
    pid_t push = start_push(ipc, in, err, NULL);
    /* Stop tallyd once the push is under way (or over: then it must simply be complete). */
    for (int i = 0; i < 20000; i++) {
        tally_req_t req = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, next_id++);
        assert_int_equal(tally_req_set_stream(&req, "big"), TALLY_OK);
        th_reply_t r;
        assert_int_equal(th_call(sock, &req, NULL, 0, &r), 0);
        uint64_t last = r.rep.status == TALLY_OK ? tally_get_u64(r.payload + 104) : 0;
        th_reply_free(&r);
        if (last >= 10)
            break;
        sleep_ms(1);
    }
    assert_int_equal(th_close_and_stop(sock, &d, 20000), 0);
    assert_int_equal(th_daemon_start(&d, args), 0);
    int rc = wait_exit(push);
    const char *text = read_text(err);
    sock = th_connect(d.endpoint, 10000);
    tally_stream_info_t info = query(sock, "big");
    print_message("push exit %d, stream at seq %" PRIu64 ": %s", rc, info.last_seq, text);
    if (rc == 0) { /* the restart fell between two chunks: the push went on, exactly */
        assert_int_equal(info.last_seq, PUSH_CHUNKS);
    } else {
        unsigned long long k = 0, total = 0;
        const char *at = strstr(text, "stopped: ");
        assert_non_null(at);
        bool exact = sscanf(at, "stopped: applied %llu of %llu chunks", &k, &total) == 2;
        if (!exact) /* tallyd could not be asked: k is a lower bound */
            assert_int_equal(sscanf(at, "stopped: applied at least %llu of %llu", &k, &total), 2);
        assert_int_equal(total, PUSH_CHUNKS);
        assert_non_null(strstr(text, "re-run with --resume (or --seq-base 0) to continue"));
        if (exact)
            assert_int_equal(info.last_seq, k);
        assert_true(info.last_seq >= k);
    }
    /* Never a chunk twice, never one missing: the carry is the sum of the first last_seq. */
    assert_true(info.last_seq <= PUSH_CHUNKS);
    assert_true(info.scan_carry == prefix[info.last_seq]);
    assert_int_equal(info.scan_elements, info.last_seq * PUSH_N);
    assert_int_equal(info.batches, info.last_seq);

    /* Continuing with the base it printed completes the push exactly. */
    push = start_push(d.endpoint, in, err, "--seq-base");
    assert_int_equal(wait_exit(push), 0);
    info = query(sock, "big");
    assert_int_equal(info.last_seq, PUSH_CHUNKS);
    assert_true(info.scan_carry == prefix[PUSH_CHUNKS]);
    assert_int_equal(info.scan_elements, (uint64_t)PUSH_CHUNKS * PUSH_N);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);

    assert_int_equal(th_rmrf(dir), 0);
}

int main(void)
{
    th_seed();
    if (use_cuda()) { /* the pipelined tests on the real GPU; skipped (77) without one */
        th_daemon_t probe;
        const char *args[] = {"--backend", "cuda", NULL};
        if (th_daemon_start(&probe, args) != 0) {
            fprintf(stderr, "tallyd --backend cuda does not start: no usable GPU, skipping\n");
            return 77;
        }
        th_daemon_stop(&probe, SIGTERM, 20000);
        const struct CMUnitTest gpu[] = {
            cmocka_unit_test(test_pipelined_gpu),
            cmocka_unit_test(test_pipelined_gpu_faults),
        };
        return cmocka_run_group_tests_name("seq (cuda)", gpu, NULL, NULL);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_admit_rules),
        cmocka_unit_test(test_apply_refuses_after_failed_predecessor),
        cmocka_unit_test(test_in_order_duplicate_gap),
        cmocka_unit_test(test_failed_request_keeps_its_seq),
        cmocka_unit_test(test_seq_survives_restart),
        cmocka_unit_test(test_pipelined_gpu),
        cmocka_unit_test(test_pipelined_gpu_faults),
        cmocka_unit_test(test_cli_push_across_restart),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
