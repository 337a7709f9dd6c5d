/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_shards.c — issue 31's shards seen from outside, each on a tallyd started with --shards 4
 * (whatever TALLYD_TEST_SHARDS says), over raw ZeroMQ:
 *   - gathering: `info` says shards=4; `streams` lists the streams of every shard; `stats` has
 *     tallyd_shards 4 and, per shard, the streams it owns (exactly those whose names' published
 *     FNV-1a 64 modulo 4 is its number: tally_partition), the requests it answered and its busy
 *     seconds;
 *   - the limits of the whole daemon stay exact when one connection pipelines creations that land
 *     on every shard at once (PROTOCOL.md §8 "Shards"): max_streams and max_streams_per_client
 *     admit exactly their number; max_state_bytes is never passed, and once the burst is answered
 *     creations one at a time fill it to within the bytes one stream gives back at its delete;
 *   - a stream's order when its requests alternate between the front's thread (a lone request,
 *     td_path.c run_on_front) and its shard's (pipelined ones): a scan's running carry continues
 *     exactly across both; and an idle shard's busy seconds stay well under the uptime (its
 *     thread sleeps outside libuv, and counts that sleep itself).
 * The rest of the suite runs again at 4 shards in scripts/test.sh's sanitizer pass; these are the
 * checks that need the shards to be more than one, whatever the suite's setting.
 */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <zmq.h>

#include "harness.h"
#include "tally_proto.h"

#define SHARDS 4
#define NAMES 16

static uint64_t next_id = 1;

/* NAMES stream names of one length ("sh00".."sh15"), and each one's shard. */
static void names_of(char names[NAMES][8], unsigned shard_of[NAMES], unsigned per_shard[SHARDS])
{
    memset(per_shard, 0, SHARDS * sizeof *per_shard);
    for (unsigned i = 0; i < NAMES; i++) {
        snprintf(names[i], 8, "sh%02u", i);
        shard_of[i] = (unsigned)(tally_mix64(tally_fnv1a64(names[i], strlen(names[i]))) % SHARDS);
        per_shard[shard_of[i]]++;
    }
}

static tally_req_t hist_req(const char *name)
{
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, next_id++);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    return req;
}

/* Sends a hist of `len` bytes (every value, in turn) on each of the NAMES streams before reading
 * any reply, then reads them all; counts[s] is how many replies had status s, status[i] the
 * reply to names[i] (when given). */
static void burst(void *sock, char names[NAMES][8], size_t len, unsigned counts[64],
                  int status[NAMES])
{
    uint8_t data[1024];
    for (size_t i = 0; i < sizeof data; i++)
        data[i] = (uint8_t)i;
    memset(counts, 0, 64 * sizeof *counts);
    uint64_t first = next_id;
    for (unsigned i = 0; i < NAMES; i++) {
        tally_req_t req = hist_req(names[i]);
        assert_int_equal(th_send_request(sock, &req, data, len), 0);
    }
    for (unsigned i = 0; i < NAMES; i++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(sock, &r), 0);
        assert_true(r.rep.status < 64);
        assert_true(r.rep.request_id >= first && r.rep.request_id < first + NAMES);
        counts[r.rep.status]++;
        if (status)
            status[r.rep.request_id - first] = r.rep.status;
        th_reply_free(&r);
    }
}

static void start(th_daemon_t *d, const char *const *limits)
{
    const char *args[16] = {"--shards", "4", "--window-intervals", "0"};
    unsigned n = 4;
    for (unsigned i = 0; limits && limits[i] && n < 15; i++)
        args[n++] = limits[i];
    args[n] = NULL;
    assert_int_equal(th_daemon_start(d, args), 0);
}

static void test_gathering_sees_every_shard(void **state)
{
    (void)state;
    char names[NAMES][8];
    unsigned shard_of[NAMES], per_shard[SHARDS];
    names_of(names, shard_of, per_shard);
    for (unsigned s = 0; s < SHARDS; s++)
        assert_true(per_shard[s] > 0); /* the names reach every shard */
    th_daemon_t d;
    start(&d, NULL);
    void *sock = th_connect(d.endpoint, 10000);

    th_reply_t r;
    tally_req_t req = th_req(TALLY_OP_INFO, TALLY_DTYPE_NONE, next_id++);
    assert_int_equal(th_call_reply_status(sock, &req, NULL, 0, &r), TALLY_OK);
    assert_non_null(strstr((const char *)r.payload, "\nshards=4\n"));
    th_reply_free(&r);

    unsigned counts[64];
    burst(sock, names, 64, counts, NULL);
    assert_int_equal(counts[TALLY_OK], NAMES);

    req = th_req(TALLY_OP_STREAMS, TALLY_DTYPE_NONE, next_id++);
    assert_int_equal(th_call_reply_status(sock, &req, NULL, 0, &r), TALLY_OK);
    assert_int_equal(r.rep.count, NAMES);
    for (unsigned i = 0; i < NAMES; i++) {
        char entry[9] = {4};
        memcpy(entry + 1, names[i], 4);
        assert_non_null(memmem(r.payload, r.len, entry, 5));
    }
    th_reply_free(&r);

    assert_int_equal(th_stat(sock, "tallyd_shards"), SHARDS);
    assert_int_equal(th_stat(sock, "tallyd_streams"), NAMES);
    long long answered = 0;
    for (unsigned s = 0; s < SHARDS; s++) {
        char name[80];
        snprintf(name, sizeof name, "tallyd_shard_streams{shard=\"%u\"}", s);
        assert_int_equal(th_stat(sock, name), per_shard[s]);
        snprintf(name, sizeof name, "tallyd_shard_requests_total{shard=\"%u\"}", s);
        long long requests = th_stat(sock, name);
        assert_true(requests >= per_shard[s]); /* its hists, and any stream-less request */
        answered += requests;
        snprintf(name, sizeof name, "tallyd_shard_busy_seconds_total{shard=\"%u\"}", s);
        assert_true(th_stat(sock, name) >= 0);
        snprintf(name, sizeof name, "tallyd_shard_requests_in_flight{shard=\"%u\"}", s);
        assert_true(th_stat(sock, name) >= 0);
    }
    assert_true(answered >= NAMES);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

/* max_streams 5 of 16 creations landing on four shards at once: exactly 5; then the
 * per-client quota, 3 of 16. */
static void test_stream_counts_exact(void **state)
{
    (void)state;
    char names[NAMES][8];
    unsigned shard_of[NAMES], per_shard[SHARDS], counts[64];
    names_of(names, shard_of, per_shard);
    th_daemon_t d;
    const char *global[] = {"--max-streams", "5", "--max-streams-per-client", "100", NULL};
    start(&d, global);
    void *sock = th_connect(d.endpoint, 10000);
    burst(sock, names, 1, counts, NULL);
    assert_int_equal(counts[TALLY_OK], 5);
    assert_int_equal(counts[TALLY_E_LIMIT], NAMES - 5);
    assert_int_equal(th_stat(sock, "tallyd_streams"), 5);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);

    const char *client[] = {"--max-streams", "100", "--max-streams-per-client", "3", NULL};
    start(&d, client);
    sock = th_connect(d.endpoint, 10000);
    burst(sock, names, 1, counts, NULL);
    assert_int_equal(counts[TALLY_OK], 3);
    assert_int_equal(counts[TALLY_E_CLIENT_STREAMS], NAMES - 3);
    assert_int_equal(th_stat(sock, "tallyd_streams"), 3);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

static int delete_stream(void *sock, const char *name)
{
    tally_req_t req = th_req(TALLY_OP_DELETE, TALLY_DTYPE_NONE, next_id++);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    return th_call_status(sock, &req, NULL, 0);
}

/* max_state_bytes: creations (1 KiB of every byte value each) landing on four shards at once
 * never pass it; afterwards, one at a time, they fill it to within one stream: the bytes one
 * stream gives back at its delete. (A stream's cost is not a constant: each shard's part of the
 * table counts its own hash buckets.) */
static void test_state_bytes_never_passed(void **state)
{
    (void)state;
    enum { BUDGET = 5000 };
    char names[NAMES][8];
    unsigned shard_of[NAMES], per_shard[SHARDS], counts[64];
    int status[NAMES];
    names_of(names, shard_of, per_shard);
    th_daemon_t d;
    const char *budget[] = {"--max-state-bytes", "5000", "--max-state-bytes-per-client", "12000",
                            NULL};
    start(&d, budget);
    void *sock = th_connect(d.endpoint, 10000);
    burst(sock, names, 1024, counts, status);
    unsigned made = counts[TALLY_OK];
    assert_true(made >= 1 && made < NAMES); /* 500 to 900 bytes each: 5 to 8 fit */
    assert_int_equal(counts[TALLY_E_LIMIT], NAMES - made);
    assert_int_equal(th_stat(sock, "tallyd_streams"), made);
    long long bytes = th_stat(sock, "tallyd_state_bytes");
    assert_true(bytes > 0 && bytes <= BUDGET);

    /* One at a time until the budget refuses one: room left by the burst is used. */
    uint8_t data[1024];
    for (size_t i = 0; i < sizeof data; i++)
        data[i] = (uint8_t)i;
    int st = TALLY_OK;
    for (unsigned i = 0; i < 100 && st == TALLY_OK; i++) {
        char name[8];
        snprintf(name, sizeof name, "sq%02u", i);
        tally_req_t req = hist_req(name);
        st = th_call_status(sock, &req, data, sizeof data);
    }
    assert_int_equal(st, TALLY_E_LIMIT);
    long long full = th_stat(sock, "tallyd_state_bytes");
    assert_true(full <= BUDGET);

    /* What one stream gives back is more than the room that was left; it is room for one. */
    unsigned victim = 0;
    while (status[victim] != TALLY_OK)
        victim++;
    assert_int_equal(delete_stream(sock, names[victim]), TALLY_OK);
    long long one = full - th_stat(sock, "tallyd_state_bytes");
    fprintf(stderr, "burst made %u (%lld bytes); full at %lld of %d; one stream %lld\n", made,
            bytes, full, BUDGET, one);
    assert_true(one > 0 && BUDGET - full < one);
    tally_req_t req = hist_req(names[victim]);
    assert_int_equal(th_call_status(sock, &req, data, sizeof data), TALLY_OK);
    assert_int_equal(th_stat(sock, "tallyd_state_bytes"), full);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

/* A scan of `n` ones on stream "carry" after `before` elements: its inclusive sums are
 * before + 1 .. before + n. */
static void check_sums(const th_reply_t *r, int64_t before, unsigned n)
{
    assert_int_equal(r->rep.status, TALLY_OK);
    assert_int_equal(r->len, n * sizeof(int64_t));
    for (unsigned i = 0; i < n; i++) {
        int64_t v;
        memcpy(&v, r->payload + i * sizeof v, sizeof v);
        assert_int_equal(v, before + i + 1);
    }
}

static void test_lone_and_pipelined_keep_order(void **state)
{
    (void)state;
    enum { N = 8, BURST = 12, ROUNDS = 6 };
    int32_t ones[N];
    for (unsigned i = 0; i < N; i++)
        ones[i] = 1;
    th_daemon_t d;
    start(&d, NULL);
    void *sock = th_connect(d.endpoint, 10000);
    int64_t total = 0;
    for (unsigned round = 0; round < ROUNDS; round++) {
        /* Alone: nothing else in flight, so the front runs it. */
        tally_req_t req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, next_id++);
        assert_int_equal(tally_req_set_stream(&req, "carry"), TALLY_OK);
        th_reply_t r;
        assert_int_equal(th_call(sock, &req, ones, sizeof ones, &r), 0);
        check_sums(&r, total, N);
        th_reply_free(&r);
        total += N;
        /* Pipelined: handed to the shard's thread, applied in the order sent. */
        uint64_t first = next_id;
        for (unsigned k = 0; k < BURST; k++) {
            req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, next_id++);
            assert_int_equal(tally_req_set_stream(&req, "carry"), TALLY_OK);
            assert_int_equal(th_send_request(sock, &req, ones, sizeof ones), 0);
        }
        for (unsigned k = 0; k < BURST; k++) {
            assert_int_equal(th_recv_reply(sock, &r), 0);
            check_sums(&r, total + (int64_t)(r.rep.request_id - first) * N, N);
            th_reply_free(&r);
        }
        total += BURST * N;
    }
    /* Idle for over two seconds: a shard's busy seconds (whole seconds here) stay at least 2
     * under the uptime (they were the uptime when the shards' sleep went uncounted; a loaded box
     * may still stretch the little work above into a second). */
    th_sleep_ms(2200);
    long long uptime = th_stat(sock, "tallyd_uptime_seconds");
    assert_true(uptime >= 2);
    for (unsigned s = 0; s < SHARDS; s++) {
        char name[80];
        snprintf(name, sizeof name, "tallyd_shard_busy_seconds_total{shard=\"%u\"}", s);
        long long busy = th_stat(sock, name);
        assert_true(busy >= 0 && busy + 2 <= uptime);
    }
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

/* The status of the next reply on sock, after the delimiter frame when it has one (§1). */
static uint32_t raw_status(void *sock, bool delimiter)
{
    zmq_msg_t frames[4];
    int n = 0, more = 1;
    while (more && n < 4) {
        zmq_msg_init(&frames[n]);
        assert_true(zmq_msg_recv(&frames[n], sock, 0) >= 0);
        more = zmq_msg_more(&frames[n]);
        n++;
    }
    assert_false(more);
    int at = delimiter ? 1 : 0;
    assert_int_equal(n, at + 2);
    if (delimiter)
        assert_int_equal(zmq_msg_size(&frames[0]), 0);
    tally_rep_t rep;
    assert_int_equal(tally_rep_decode(zmq_msg_data(&frames[at]), zmq_msg_size(&frames[at]), &rep),
                     TALLY_OK);
    for (int i = 0; i < n; i++)
        zmq_msg_close(&frames[i]);
    return rep.status;
}

/* What names no stream, at four shards with the side channel on (the request path looks at a
 * request's header for its stream, and for a shared-memory reference to pin, before its shard
 * decodes it): no request frame, an undecodable header, a payload of a reference's size without
 * the flag; each answered as one shard answers it, by whichever shard had least to do. */
static void test_streamless_messages(void **state)
{
    (void)state;
    th_daemon_t d;
    start(&d, NULL);
    void *sock = th_connect(d.endpoint, 10000);
    const void *empty[1] = {""};
    size_t empty_len[1] = {0};
    assert_int_equal(th_send_frames(sock, 1, empty, empty_len), 0);
    assert_int_equal(raw_status(sock, true), TALLY_E_FRAMES);

    uint8_t payload[TALLY_SHM_REF_SIZE];
    memset(payload, 7, sizeof payload);
    const void *garbled[2] = {"not a header", payload};
    size_t garbled_len[2] = {12, sizeof payload};
    assert_int_equal(th_send_frames(sock, 2, garbled, garbled_len), 0);
    assert_int_equal(raw_status(sock, false), TALLY_E_HEADER);

    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, next_id++);
    th_reply_t r;
    assert_int_equal(th_call_reply_status(sock, &req, payload, sizeof payload, &r), TALLY_OK);
    assert_int_equal(r.len, 256 * 8);
    uint64_t sevens = 0;
    memcpy(&sevens, r.payload + 7 * 8, 8);
    assert_int_equal(sevens, sizeof payload); /* every byte counted: no reference taken */
    th_reply_free(&r);

    long long answered = 0;
    for (unsigned s = 0; s < SHARDS; s++) {
        char name[80];
        snprintf(name, sizeof name, "tallyd_shard_requests_total{shard=\"%u\"}", s);
        answered += th_stat(sock, name);
    }
    assert_true(answered >= 3);
    assert_int_equal(th_stat(sock, "tallyd_streams"), 0);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

int main(void)
{
    th_seed();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gathering_sees_every_shard),
        cmocka_unit_test(test_stream_counts_exact),
        cmocka_unit_test(test_state_bytes_never_passed),
        cmocka_unit_test(test_lone_and_pipelined_keep_order),
        cmocka_unit_test(test_streamless_messages),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
