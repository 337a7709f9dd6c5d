/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_daemon.c — integration tests: a real tallyd on a loopback port, driven over a raw
 * ZeroMQ DEALER socket. Covers every operation end to end, stream ordering and state, every
 * malformed-message rejection (and that tallyd keeps serving after each), REQ peers, the
 * stream limit, backpressure at the in-flight limit, and a clean stop that answers what is in
 * flight.
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

#define MAX_BATCH (1 << 20)

static th_daemon_t daemon_main;
static uint64_t next_id = 1000;

static int group_setup(void **state)
{
    (void)state;
    th_seed();
    const char *args[] = {"--max-batch", "1M", NULL};
    return th_daemon_start(&daemon_main, args);
}

static int group_teardown(void **state)
{
    (void)state;
    /* A clean stop is part of the contract: exit status 0. */
    return th_daemon_stop(&daemon_main, SIGTERM, 10000) == 0 ? 0 : -1;
}

static void *connect_main(void)
{
    return th_connect(daemon_main.endpoint, 5000);
}

/* Asserts the daemon still answers a ping on a fresh connection. */
static void assert_still_serving(void)
{
    assert_true(th_ping(daemon_main.endpoint, 5000));
}

static int32_t *random_i32(size_t n)
{
    int32_t *v = malloc(n * sizeof *v + 1);
    for (size_t i = 0; i < n; i++) {
        uint64_t r = th_rand();
        switch (r % 16) {
        case 0:
            v[i] = INT32_MIN;
            break;
        case 1:
            v[i] = INT32_MAX;
            break;
        default:
            v[i] = (int32_t)(uint32_t)(r >> 16);
        }
    }
    return v;
}

/* ---- operations ------------------------------------------------------------------------- */

static void test_ping_info_stats(void **state)
{
    (void)state;
    void *sock = connect_main();
    th_reply_t reply;
    tally_req_t req = th_req(TALLY_OP_INFO, TALLY_DTYPE_NONE, 5);
    assert_int_equal(th_call_reply_status(sock, &req, NULL, 0, &reply), TALLY_OK);
    assert_int_equal(reply.rep.dtype, TALLY_DTYPE_TEXT);
    assert_non_null(strstr((char *)reply.payload, "protocol=1\n"));
    assert_non_null(strstr((char *)reply.payload, "max_batch=1048576\n"));
    assert_non_null(strstr((char *)reply.payload, "backend="));
    th_reply_free(&reply);

    req = th_req(TALLY_OP_STATS, TALLY_DTYPE_NONE, 6);
    assert_int_equal(th_call_reply_status(sock, &req, NULL, 0, &reply), TALLY_OK);
    assert_non_null(
        strstr((char *)reply.payload, "tallyd_requests_total{op=\"info\",status=\"ok\"}"));
    assert_non_null(strstr((char *)reply.payload, "# TYPE tallyd_requests_in_flight gauge"));
    th_reply_free(&reply);
    th_close(sock);
}

static void test_filter_i32_both_modes(void **state)
{
    (void)state;
    void *sock = connect_main();
    size_t n = 10007;
    int32_t *in = random_i32(n);
    int32_t *expect = malloc(n * sizeof *expect + 1);
    size_t kept = 0;
    for (size_t i = 0; i < n; i++)
        if (in[i] > 0)
            expect[kept++] = in[i];
    for (int stable = 0; stable <= 1; stable++) {
        tally_req_t req = th_req(TALLY_OP_FILTER, TALLY_DTYPE_I32, next_id++);
        req.pred = TALLY_PRED_GT;
        req.lo = 0;
        req.flags = stable ? TALLY_FLAG_FILTER_STABLE : 0;
        th_reply_t reply;
        assert_int_equal(th_call_reply_status(sock, &req, in, n * sizeof *in, &reply), TALLY_OK);
        assert_int_equal(reply.rep.count, kept);
        assert_int_equal(reply.rep.aux0, n);
        assert_int_equal(reply.len, kept * sizeof(int32_t));
        int32_t *got = (int32_t *)reply.payload;
        if (!stable) {
            qsort(got, kept, sizeof *got, th_cmp_i32);
            int32_t *sorted = malloc(kept * sizeof *sorted + 1);
            memcpy(sorted, expect, kept * sizeof *sorted);
            qsort(sorted, kept, sizeof *sorted, th_cmp_i32);
            assert_memory_equal(got, sorted, kept * sizeof *got);
            free(sorted);
        } else {
            assert_memory_equal(got, expect, kept * sizeof *got);
        }
        th_reply_free(&reply);
    }
    free(expect);
    free(in);
    th_close(sock);
}

static void test_filter_u8_between(void **state)
{
    (void)state;
    void *sock = connect_main();
    uint8_t in[999];
    for (size_t i = 0; i < sizeof in; i++)
        in[i] = (uint8_t)th_rand();
    tally_req_t req = th_req(TALLY_OP_FILTER, TALLY_DTYPE_U8, next_id++);
    req.pred = TALLY_PRED_BETWEEN;
    req.lo = 10;
    req.hi = 20;
    req.flags = TALLY_FLAG_FILTER_STABLE;
    th_reply_t reply;
    assert_int_equal(th_call_reply_status(sock, &req, in, sizeof in, &reply), TALLY_OK);
    size_t k = 0;
    for (size_t i = 0; i < sizeof in; i++)
        if (in[i] >= 10 && in[i] <= 20) {
            assert_true(k < reply.len);
            assert_int_equal(reply.payload[k++], in[i]);
        }
    assert_int_equal(reply.rep.count, k);
    th_reply_free(&reply);
    th_close(sock);
}

/* The whole array scanned in one message equals it sent in pipelined chunks on a stream. */
static void check_chunked_scan(uint8_t flags, const char *stream)
{
    void *sock = connect_main();
    size_t n = 20011;
    int32_t *in = random_i32(n);
    size_t out_size = (flags & TALLY_FLAG_SCAN_OUT_I32) ? 4 : 8;

    tally_req_t req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, next_id++);
    req.flags = flags;
    th_reply_t whole;
    assert_int_equal(th_call_reply_status(sock, &req, in, n * sizeof *in, &whole), TALLY_OK);
    assert_int_equal(whole.len, n * out_size);

    /* Chunks of odd sizes, all sent before any reply is read. */
    size_t bounds[17], chunks = 0, at = 0; /* up to 16 chunks, then the end */
    uint64_t first_id = next_id;
    while (at < n) {
        size_t len = 1 + th_rand() % 3001;
        if (at + len > n)
            len = n - at;
        tally_req_t c = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, next_id++);
        c.flags = flags;
        assert_int_equal(tally_req_set_stream(&c, stream), TALLY_OK);
        assert_int_equal(th_send_request(sock, &c, in + at, len * sizeof *in), 0);
        bounds[chunks++] = at;
        at += len;
        if (chunks == 15 && at < n) { /* the rest in one last chunk */
            tally_req_t last = c;
            last.request_id = next_id++;
            assert_int_equal(th_send_request(sock, &last, in + at, (n - at) * sizeof *in), 0);
            bounds[chunks++] = at;
            at = n;
        }
    }
    bounds[chunks] = n;
    uint8_t *joined = malloc(n * out_size);
    for (size_t i = 0; i < chunks; i++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(sock, &r), 0);
        assert_int_equal(r.rep.status, TALLY_OK);
        size_t k = r.rep.request_id - first_id;
        assert_true(k < chunks);
        assert_int_equal(r.len, (bounds[k + 1] - bounds[k]) * out_size);
        memcpy(joined + bounds[k] * out_size, r.payload, r.len);
        th_reply_free(&r);
    }
    assert_memory_equal(joined, whole.payload, n * out_size);

    /* The stream's carry is the whole array's total. */
    tally_req_t q = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, next_id++);
    tally_req_set_stream(&q, stream);
    th_reply_t qr;
    assert_int_equal(th_call_reply_status(sock, &q, NULL, 0, &qr), TALLY_OK);
    tally_stream_info_t info;
    assert_int_equal(tally_stream_info_decode(qr.payload, qr.len, &info), TALLY_OK);
    assert_int_equal((uint64_t)info.scan_carry, whole.rep.aux0);
    assert_int_equal(info.scan_elements, n);
    assert_int_equal(info.batches, chunks);
    assert_int_equal(info.bytes, n * sizeof(int32_t));
    th_reply_free(&qr);

    int64_t total = 0;
    for (size_t i = 0; i < n; i++)
        total = (int64_t)((uint64_t)total + (uint64_t)(int64_t)in[i]);
    assert_int_equal((int64_t)whole.rep.aux0, total);
    th_reply_free(&whole);
    free(joined);
    free(in);
    th_close(sock);
}

static void test_scan_chunked_stream_inclusive(void **state)
{
    (void)state;
    check_chunked_scan(0, "scan/inclusive");
}

static void test_scan_chunked_stream_exclusive_i32(void **state)
{
    (void)state;
    check_chunked_scan(TALLY_FLAG_SCAN_EXCLUSIVE | TALLY_FLAG_SCAN_OUT_I32, "scan/excl32");
}

/* Five u8 chunks of 4099 bytes (the third all 7s) on stream `name`, each reply checked; their
 * histogram added to expect. */
static void push_u8_chunks(void *sock, const char *name, uint64_t expect[256])
{
    uint8_t chunk[4099];
    for (int c = 0; c < 5; c++) {
        for (size_t i = 0; i < sizeof chunk; i++)
            chunk[i] = (uint8_t)(c == 2 ? 7 : th_rand()); /* one all-equal chunk */
        uint64_t bins[256] = {0};
        tr_hist(TALLY_DTYPE_U8, chunk, sizeof chunk, 0, 0, bins);
        tr_hist(TALLY_DTYPE_U8, chunk, sizeof chunk, 0, 0, expect);
        tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, next_id++);
        tally_req_set_stream(&req, name);
        th_reply_t r;
        assert_int_equal(th_call_reply_status(sock, &req, chunk, sizeof chunk, &r), TALLY_OK);
        assert_int_equal(r.rep.count, 256);
        assert_int_equal(r.len, 256 * 8);
        assert_int_equal(r.rep.aux0, sizeof chunk);
        assert_true(th_u64s_equal(r.payload, r.len, bins, 256));
        th_reply_free(&r);
    }
}

/* A query of stream `name` that succeeds, its record decoded into info. */
static void query_ok(void *sock, const char *name, tally_stream_info_t *info)
{
    tally_req_t q = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, next_id++);
    tally_req_set_stream(&q, name);
    th_reply_t qr;
    assert_int_equal(th_call_reply_status(sock, &q, NULL, 0, &qr), TALLY_OK);
    assert_int_equal(tally_stream_info_decode(qr.payload, qr.len, info), TALLY_OK);
    th_reply_free(&qr);
}

/* A name-prefixed entry of the streams reply is the 4-byte name "cam0". */
static void assert_cam0_listed(void *sock)
{
    tally_req_t ls = th_req(TALLY_OP_STREAMS, TALLY_DTYPE_NONE, next_id++);
    th_reply_t r;
    assert_int_equal(th_call_reply_status(sock, &ls, NULL, 0, &r), TALLY_OK);
    bool listed = false;
    for (size_t at = 0; at < r.len; at += 1 + r.payload[at])
        listed |= r.payload[at] == 4 && memcmp(r.payload + at + 1, "cam0", 4) == 0;
    assert_true(listed);
    th_reply_free(&r);
}

static void test_hist_stream_query_reset(void **state)
{
    (void)state;
    void *sock = connect_main();
    uint64_t expect[256] = {0};
    const char *name = "cam0";
    push_u8_chunks(sock, name, expect);
    tally_stream_info_t info;
    query_ok(sock, name, &info);
    assert_int_equal(info.hist_dtype, TALLY_DTYPE_U8);
    assert_int_equal(info.batches, 5);
    assert_int_equal(info.hist_total, 5 * 4099);
    assert_memory_equal(info.bins, expect, sizeof expect);

    /* A histogram of another type on the same stream conflicts until the stream is deleted. */
    int32_t values[3] = {1, 2, 3};
    tally_req_t h32 = th_req(TALLY_OP_HIST, TALLY_DTYPE_I32, next_id++);
    h32.lo = 0;
    h32.hi = 100;
    tally_req_set_stream(&h32, name);
    th_reply_t r;
    assert_int_equal(th_call(sock, &h32, values, sizeof values, &r), 0);
    assert_int_equal(r.rep.status, TALLY_E_STREAM_STATE);
    assert_non_null(strstr((char *)r.payload, "delete"));
    th_reply_free(&r);

    /* reset zeroes it and keeps it: listed, type kept (the i32 batch still conflicts), every
     * count 0. */
    tally_req_t reset = th_req(TALLY_OP_RESET, TALLY_DTYPE_NONE, next_id++);
    tally_req_set_stream(&reset, name);
    assert_int_equal(th_call_status(sock, &reset, NULL, 0), TALLY_OK);
    query_ok(sock, name, &info);
    assert_int_equal(info.hist_dtype, TALLY_DTYPE_U8);
    assert_int_equal(info.batches, 0);
    assert_int_equal(info.elements, 0);
    assert_int_equal(info.hist_total, 0);
    for (int b = 0; b < 256; b++)
        assert_int_equal(info.bins[b], 0);
    h32.request_id = next_id++;
    assert_int_equal(th_call_status(sock, &h32, values, sizeof values), TALLY_E_STREAM_STATE);

    /* streams lists it; delete removes it; then query says unknown and hist i32 works. */
    assert_cam0_listed(sock);
    tally_req_t del = th_req(TALLY_OP_DELETE, TALLY_DTYPE_NONE, next_id++);
    tally_req_set_stream(&del, name);
    assert_int_equal(th_call_status(sock, &del, NULL, 0), TALLY_OK);
    tally_req_t q = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, next_id++);
    tally_req_set_stream(&q, name);
    assert_int_equal(th_call_status(sock, &q, NULL, 0), TALLY_E_UNKNOWN_STREAM);
    h32.request_id = next_id++;
    assert_int_equal(th_call_reply_status(sock, &h32, values, sizeof values, &r), TALLY_OK);
    assert_int_equal(r.rep.count, TALLY_HIST_I32_VALUES);
    /* bins of 1, 2, 3 over [0, 100): floor(x * 256 / 100) = 2, 5, 7 */
    assert_int_equal(tally_get_u64(r.payload + 8 * 2), 1);
    assert_int_equal(tally_get_u64(r.payload + 8 * 5), 1);
    assert_int_equal(tally_get_u64(r.payload + 8 * 7), 1);
    th_reply_free(&r);
    th_close(sock);
}

/* Requests on one stream apply in arrival order even when pipelined with a query between. */
static void test_stream_order_with_queries(void **state)
{
    (void)state;
    void *sock = connect_main();
    const char *name = "order/check";
    int32_t one[1000];
    for (int i = 0; i < 1000; i++)
        one[i] = 1;
    uint64_t first = next_id;
    for (int i = 0; i < 40; i++) {
        tally_req_t req = th_req(i % 4 == 3 ? TALLY_OP_QUERY : TALLY_OP_SCAN,
                                 i % 4 == 3 ? TALLY_DTYPE_NONE : TALLY_DTYPE_I32, next_id++);
        tally_req_set_stream(&req, name);
        assert_int_equal(th_send_request(sock, &req, one, i % 4 == 3 ? 0 : sizeof one), 0);
    }
    for (int i = 0; i < 40; i++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(sock, &r), 0);
        assert_int_equal(r.rep.status, TALLY_OK);
        uint64_t k = r.rep.request_id - first;
        uint64_t scans_before = (k + 1) - (k + 1) / 4; /* scans at or before position k */
        if (k % 4 == 3) {
            tally_stream_info_t info;
            assert_int_equal(tally_stream_info_decode(r.payload, r.len, &info), TALLY_OK);
            assert_int_equal(info.scan_carry, (int64_t)(scans_before * 1000));
        } else {
            assert_int_equal((int64_t)r.rep.aux0, (int64_t)(scans_before * 1000));
            assert_int_equal(((int64_t *)r.payload)[0], (int64_t)((scans_before - 1) * 1000 + 1));
        }
        th_reply_free(&r);
    }
    th_close(sock);
}

/* ---- malformed messages ----------------------------------------------------------------- */

/* Sends raw frames, expects one reply with the status (and the request id when given). */
static void expect_rejection(int frames, const void *const *data, const size_t *lens,
                             tally_status_t status, uint64_t id)
{
    void *sock = connect_main();
    assert_int_equal(th_send_frames(sock, frames, data, lens), 0);
    th_reply_t r;
    assert_int_equal(th_recv_reply(sock, &r), 0);
    assert_int_equal(r.frames, 2);
    assert_int_equal(r.rep.status, status);
    assert_int_equal(r.rep.dtype, TALLY_DTYPE_TEXT);
    assert_true(r.len > 0); /* a human-readable message */
    if (id)
        assert_int_equal(r.rep.request_id, id);
    th_reply_free(&r);
    th_close(sock);
    assert_still_serving();
}

static void expect_request_rejected(const tally_req_t *req, const void *payload, size_t len,
                                    tally_status_t status)
{
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(req, header);
    const void *data[2] = {header, payload ? payload : ""};
    size_t lens[2] = {sizeof header, len};
    expect_rejection(2, data, lens, status, req->request_id);
}

static void test_reject_header_size(void **state)
{
    (void)state;
    tally_req_t req = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, 4242);
    uint8_t header[TALLY_REQ_HEADER_SIZE + 1] = {0};
    tally_req_encode(&req, header);
    const void *data[2] = {header, ""};
    size_t lens[2] = {100, 0};
    expect_rejection(2, data, lens, TALLY_E_HEADER, 4242); /* truncated: id still echoed */
    lens[0] = sizeof header;
    expect_rejection(2, data, lens, TALLY_E_HEADER, 4242); /* oversized */
    lens[0] = 3;
    expect_rejection(2, data, lens, TALLY_E_HEADER, 0);
}

static void test_reject_magic_version_opcode_dtype(void **state)
{
    (void)state;
    tally_req_t req = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, 11);
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    const void *data[2] = {header, ""};
    size_t lens[2] = {sizeof header, 0};
    tally_req_encode(&req, header);
    header[0] = 'X';
    expect_rejection(2, data, lens, TALLY_E_MAGIC, 11);
    tally_req_encode(&req, header);
    header[4] = 2;
    expect_rejection(2, data, lens, TALLY_E_VERSION, 11);
    req.opcode = 99;
    expect_request_rejected(&req, NULL, 0, TALLY_E_OPCODE);
    req = th_req(TALLY_OP_FILTER, 9, 12);
    req.pred = TALLY_PRED_GT;
    expect_request_rejected(&req, NULL, 0, TALLY_E_DTYPE);
    req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_U8, 13);
    expect_request_rejected(&req, NULL, 0, TALLY_E_DTYPE);
}

static void test_reject_payload_and_params(void **state)
{
    (void)state;
    uint8_t bytes[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    tally_req_t req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, 21);
    expect_request_rejected(&req, bytes, 7, TALLY_E_PAYLOAD);
    req = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, 22);
    expect_request_rejected(&req, bytes, 4, TALLY_E_PAYLOAD);
    req = th_req(TALLY_OP_FILTER, TALLY_DTYPE_I32, 23);
    req.pred = 42;
    expect_request_rejected(&req, bytes, 8, TALLY_E_PARAM);
    req = th_req(TALLY_OP_HIST, TALLY_DTYPE_I32, 24);
    req.lo = 5;
    req.hi = 5;
    expect_request_rejected(&req, bytes, 8, TALLY_E_PARAM);
}

static void test_reject_too_large(void **state)
{
    (void)state;
    size_t len = MAX_BATCH + 4;
    uint8_t *big = calloc(1, len);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 31);
    expect_request_rejected(&req, big, len, TALLY_E_TOO_LARGE);
    free(big);
}

static void test_reject_stream_names(void **state)
{
    (void)state;
    tally_req_t req = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, 41);
    expect_request_rejected(&req, NULL, 0, TALLY_E_STREAM_NAME); /* query needs a name */
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    const void *data[2] = {header, ""};
    size_t lens[2] = {sizeof header, 0};
    tally_req_t hist = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 42);
    tally_req_encode(&hist, header);
    header[17] = 3; /* stream_len */
    memcpy(header + 64, "a b", 3);
    expect_rejection(2, data, lens, TALLY_E_STREAM_NAME, 42);
    header[17] = 65; /* too long */
    memset(header + 64, 'x', 64);
    expect_rejection(2, data, lens, TALLY_E_STREAM_NAME, 42);
    req.request_id = 43;
    assert_int_equal(tally_req_set_stream(&req, "never-created"), TALLY_OK);
    expect_request_rejected(&req, NULL, 0, TALLY_E_UNKNOWN_STREAM);
}

static void test_reject_frame_counts(void **state)
{
    (void)state;
    tally_req_t req = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, 51);
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(&req, header);
    const void *data[6] = {header, "", "", "x", "y", "z"};
    size_t lens[6] = {sizeof header, 0, 0, 1, 1, 1};
    expect_rejection(1, data, lens, TALLY_E_FRAMES, 51); /* payload frame missing */
    expect_rejection(3, data, lens, TALLY_E_FRAMES, 51); /* one extra */
    expect_rejection(6, data, lens, TALLY_E_FRAMES, 51); /* many extra */
}

/* A REQ peer's envelope has an empty delimiter frame, which tallyd echoes. */
static void test_req_socket_peer(void **state)
{
    (void)state;
    assert_int_equal(th_req_socket_ping(daemon_main.endpoint, 61, 5000), TALLY_OK);
}

/* ---- limits and lifecycle (each with its own daemon) ------------------------------------ */

static void test_stream_limit(void **state)
{
    (void)state;
    th_daemon_t d;
    /* The global limit (the per-client one is set above it, so it does not bite first). */
    const char *args[] = {"--max-streams", "2", "--max-streams-per-client", "3", NULL};
    assert_int_equal(th_daemon_start(&d, args), 0);
    void *sock = th_connect(d.endpoint, 5000);
    uint8_t byte = 1;
    const char *names[3] = {"a", "b", "c"};
    for (int i = 0; i < 3; i++) {
        tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 70 + i);
        tally_req_set_stream(&req, names[i]);
        assert_int_equal(th_call_status(sock, &req, &byte, 1), i < 2 ? TALLY_OK : TALLY_E_LIMIT);
    }
    th_close(sock);
    assert_int_equal(th_daemon_stop(&d, SIGINT, 10000), 0);
}

/* With two requests allowed in flight, 200 pipelined ones are all answered: tallyd stops
 * reading at the limit instead of dropping anything. */
static void test_backpressure_answers_everything(void **state)
{
    (void)state;
    th_daemon_t d;
    const char *args[] = {"--max-inflight", "2", NULL};
    assert_int_equal(th_daemon_start(&d, args), 0);
    void *sock = th_connect(d.endpoint, 20000);
    size_t n = 256 * 1024;
    int32_t *in = random_i32(n);
    enum { COUNT = 200 };
    bool seen[COUNT] = {false};
    for (int i = 0; i < COUNT; i++) {
        tally_req_t req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, 1000 + i);
        assert_int_equal(th_send_request(sock, &req, in, n * sizeof *in), 0);
    }
    for (int i = 0; i < COUNT; i++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(sock, &r), 0);
        assert_int_equal(r.rep.status, TALLY_OK);
        uint64_t k = r.rep.request_id - 1000;
        assert_true(k < COUNT);
        assert_false(seen[k]);
        seen[k] = true;
        th_reply_free(&r);
    }
    tally_req_t stats = th_req(TALLY_OP_STATS, TALLY_DTYPE_NONE, 9);
    th_reply_t r;
    assert_int_equal(th_call(sock, &stats, NULL, 0, &r), 0);
    assert_non_null(
        strstr((char *)r.payload, "tallyd_requests_total{op=\"scan\",status=\"ok\"} 200\n"));
    assert_null(strstr((char *)r.payload, "tallyd_read_pauses_total 0\n"));
    th_reply_free(&r);
    free(in);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

/* SIGTERM with work in flight: every request already read is answered, then exit 0. The scan
 * running at the signal finishes (ok); the ones waiting behind it on the stream get `shutdown`,
 * in order after it (PROTOCOL.md §1, "Shutdown"). */
static void test_stop_answers_inflight(void **state)
{
    (void)state;
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, NULL), 0);
    void *sock = th_connect(d.endpoint, 20000);
    size_t n = 4 * 1024 * 1024 / 4 - 16;
    int32_t *in = random_i32(n);
    enum { COUNT = 8 };
    for (int i = 0; i < COUNT; i++) {
        tally_req_t req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, 500 + i);
        tally_req_set_stream(&req, "shutdown/s");
        assert_int_equal(th_send_request(sock, &req, in, n * sizeof *in), 0);
    }
    /* stats is answered at once, after the scans on this connection have been read. */
    tally_req_t stats = th_req(TALLY_OP_STATS, TALLY_DTYPE_NONE, 600);
    assert_int_equal(th_send_request(sock, &stats, NULL, 0), 0);
    int answered = 0, ok = 0;
    bool signalled = false;
    for (int i = 0; i < COUNT + 1; i++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(sock, &r), 0);
        if (r.rep.request_id == 600) {
            assert_int_equal(r.rep.status, TALLY_OK);
            kill(d.pid, SIGTERM);
            signalled = true;
        } else {
            /* One stream: replies in order, the ok ones first. */
            assert_int_equal(r.rep.request_id, 500 + answered);
            if (r.rep.status == TALLY_OK)
                assert_int_equal(ok++, answered);
            else
                assert_int_equal(r.rep.status, TALLY_E_SHUTDOWN);
            answered++;
        }
        th_reply_free(&r);
    }
    assert_true(signalled);
    assert_int_equal(answered, COUNT);
    assert_true(ok >= 1); /* the first was running when stats was answered */
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
    assert_true(th_daemon_log_contains(&d, "stopping"));
    free(in);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ping_info_stats),
        cmocka_unit_test(test_filter_i32_both_modes),
        cmocka_unit_test(test_filter_u8_between),
        cmocka_unit_test(test_scan_chunked_stream_inclusive),
        cmocka_unit_test(test_scan_chunked_stream_exclusive_i32),
        cmocka_unit_test(test_hist_stream_query_reset),
        cmocka_unit_test(test_stream_order_with_queries),
        cmocka_unit_test(test_reject_header_size),
        cmocka_unit_test(test_reject_magic_version_opcode_dtype),
        cmocka_unit_test(test_reject_payload_and_params),
        cmocka_unit_test(test_reject_too_large),
        cmocka_unit_test(test_reject_stream_names),
        cmocka_unit_test(test_reject_frame_counts),
        cmocka_unit_test(test_req_socket_peer),
        cmocka_unit_test(test_stream_limit),
        cmocka_unit_test(test_backpressure_answers_everything),
        cmocka_unit_test(test_stop_answers_inflight),
    };
    return cmocka_run_group_tests_name("daemon", tests, group_setup, group_teardown);
}
