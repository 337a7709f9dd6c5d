/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_limits.c — the per-peer limits that keep one peer from hurting another (PROTOCOL.md §8,
 * "Per-peer limits"), against the real tallyd over raw ZeroMQ, and their pieces as units:
 *   - a connection over its share of in-flight slots is answered `busy` (others are not), and
 *     tallyd_limited_total{reason="inflight_share"} counts exactly those replies;
 *   - a client over max_streams_per_client is answered `client_streams`, while another client
 *     still creates streams, and a delete gives the slot back (a reset keeps the stream, so it
 *     keeps the slot: §8);
 *   - a client creating streams faster than stream_create_rate is answered `rate_limited`, and
 *     may create again once its bucket refills;
 *   - a request refused on a stream it would create (sequence_gap) uses neither the quota nor a
 *     creation token, and leaves no stream behind (issue 21);
 *   - the fair share's arithmetic and the token bucket's, on a clock the test controls.
 * The flood test (a peer that never reads while another's pings are answered within 100 ms) is
 * in test_lifecycle.c.
 */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include <cmocka.h>

#include "harness.h"
#include "td_config.h"
#include "td_settings.h"
#include "td_peers.h"

static th_daemon_t daemon_;

static int stop_daemon(void **state)
{
    (void)state;
    th_daemon_kill(&daemon_);
    return 0;
}

/* A hist on `stream` (NULL: none) with a one-byte payload; returns the reply's status. */
static int hist_on(void *sock, const char *stream, uint64_t id)
{
    uint8_t byte = 7;
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, id);
    if (stream)
        assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    th_reply_t reply;
    assert_int_equal(th_call(sock, &req, &byte, 1, &reply), 0);
    assert_int_equal(reply.rep.request_id, id);
    int status = reply.rep.status;
    th_reply_free(&reply);
    return status;
}

#define BUSY_BATCH 40
#define BUSY_ROUNDS 10
#define BUSY_BYTES (256 * 1024)

/* One round: BUSY_BATCH hist requests pipelined on sock, every reply collected; returns how many
 * were `busy` (the rest must be ok). */
static int busy_round(void *sock, int round, const uint8_t *bytes)
{
    bool seen[BUSY_BATCH] = {false};
    uint64_t base = (uint64_t)round * BUSY_BATCH;
    for (int i = 0; i < BUSY_BATCH; i++) {
        tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, base + (uint64_t)i);
        assert_int_equal(th_send_request(sock, &req, bytes, BUSY_BYTES), 0);
    }
    int busy = 0;
    for (int i = 0; i < BUSY_BATCH; i++) {
        th_reply_t reply;
        assert_int_equal(th_recv_reply(sock, &reply), 0);
        uint64_t k = reply.rep.request_id - base;
        assert_true(k < BUSY_BATCH);
        assert_false(seen[k]);
        seen[k] = true;
        if (reply.rep.status == TALLY_E_BUSY) {
            assert_non_null(strstr((const char *)reply.payload, "max_inflight_per_peer 1"));
            busy++;
        } else {
            assert_int_equal(reply.rep.status, TALLY_OK);
        }
        th_reply_free(&reply);
    }
    return busy;
}

/* With a share of one request per connection, a connection that pipelines is answered `busy`
 * for what it sends beyond it (rounds until the worker was still busy with one when the next
 * arrived, which on any machine is nearly every round); another connection is unaffected. */
static void test_busy_beyond_the_share(void **state)
{
    (void)state;
    const char *args[] = {"--max-inflight-per-peer", "1", "--workers", "1", NULL};
    assert_int_equal(th_daemon_start(&daemon_, args), 0);
    void *greedy = th_connect(daemon_.endpoint, 20000);
    void *other = th_connect(daemon_.endpoint, 5000);
    uint8_t *bytes = malloc(BUSY_BYTES);
    for (size_t i = 0; i < BUSY_BYTES; i++)
        bytes[i] = (uint8_t)th_rand();
    int busy = 0, rounds = 0;
    while (busy == 0 && rounds < BUSY_ROUNDS)
        busy += busy_round(greedy, rounds++, bytes);
    free(bytes);
    fprintf(stderr, "%d of %d pipelined requests answered busy\n", busy, rounds * BUSY_BATCH);
    assert_true(busy > 0);
    assert_int_equal(th_stat(other, "tallyd_limited_total{reason=\"inflight_share\"}"), busy);
    assert_int_equal(th_stat(other, "tallyd_requests_total{op=\"hist\",status=\"busy\"}"), busy);
    assert_int_equal(hist_on(other, NULL, 1), TALLY_OK); /* one at a time is always served */
    th_close(greedy);
    th_close(other);
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 10000), 0);
}

/* A client may hold max_streams_per_client streams; the next is refused `client_streams` while
 * another client still creates one, and a delete gives the slot back (a reset keeps the stream,
 * so it keeps the slot). */
static void test_streams_per_client(void **state)
{
    (void)state;
    const char *args[] = {"--max-streams-per-client", "3", NULL};
    assert_int_equal(th_daemon_start(&daemon_, args), 0);
    void *a = th_connect(daemon_.endpoint, 5000);
    void *b = th_connect(daemon_.endpoint, 5000);
    const char *names[] = {"a0", "a1", "a2", "a3"};
    for (int i = 0; i < 4; i++)
        assert_int_equal(hist_on(a, names[i], 10 + (uint64_t)i),
                         i < 3 ? TALLY_OK : TALLY_E_CLIENT_STREAMS);
    assert_int_equal(hist_on(a, "a0", 20), TALLY_OK); /* its existing streams still work */
    assert_int_equal(hist_on(b, "b0", 21), TALLY_OK); /* another client is not held back */

    tally_req_t reset = th_req(TALLY_OP_RESET, TALLY_DTYPE_NONE, 22);
    assert_int_equal(tally_req_set_stream(&reset, "a1"), TALLY_OK);
    assert_int_equal(th_call_status(a, &reset, NULL, 0), TALLY_OK);
    assert_int_equal(hist_on(a, "a3", 25), TALLY_E_CLIENT_STREAMS); /* reset kept a1 */

    /* At its quota, a numbered hist that would create a stream and skips seq 1 is a gap before
     * it is over the quota (PROTOCOL.md §6 step 10): sequence_gap with aux0 0, not counted as
     * limited (the count below stays 3). */
    uint8_t byte = 7;
    tally_req_t gap = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 27);
    assert_int_equal(tally_req_set_stream(&gap, "a9"), TALLY_OK);
    gap.seq = 5;
    th_reply_t gap_reply;
    assert_int_equal(th_call(a, &gap, &byte, 1, &gap_reply), 0);
    assert_int_equal(gap_reply.rep.status, TALLY_E_SEQ_GAP);
    assert_int_equal(gap_reply.rep.aux0, 0);
    th_reply_free(&gap_reply);

    tally_req_t del = th_req(TALLY_OP_DELETE, TALLY_DTYPE_NONE, 26);
    assert_int_equal(tally_req_set_stream(&del, "a1"), TALLY_OK);
    assert_int_equal(th_call_status(a, &del, NULL, 0), TALLY_OK);
    assert_int_equal(hist_on(a, "a3", 23), TALLY_OK);
    assert_int_equal(hist_on(a, "a4", 24), TALLY_E_CLIENT_STREAMS);

    assert_int_equal(th_stat(b, "tallyd_limited_total{reason=\"client_streams\"}"), 3);
    assert_int_equal(th_stat(b, "tallyd_streams"), 4); /* a0 a2 a3 b0 */
    /* The family's help names its reasons as the labels spell them, each with its status. */
    const char *reasons[] = {"inflight_share (answered busy", "client_streams (client_streams",
                             "stream_rate (rate_limited", "reply_bytes_peer and reply_bytes (busy"};
    for (size_t i = 0; i < sizeof reasons / sizeof reasons[0]; i++)
        assert_true(th_stat_help_says(b, "tallyd_limited_total", reasons[i]));
    th_close(a);
    th_close(b);
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 10000), 0);
}

#define RATE 3
#define RATE_TEXT "3"
#define RATE_TRIES 12

#define GAP_QUOTA_TEXT "10"
#define GAP_REQUESTS 12

/* Sends a one-byte hist with `seq` on `stream`. */
static void send_hist_seq(void *sock, const char *stream, uint64_t seq, uint64_t id)
{
    uint8_t byte = 7;
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, id);
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    req.seq = seq;
    assert_int_equal(th_send_request(sock, &req, &byte, 1), 0);
}

/* The `streams` reply: how many streams it lists (and that `only`, if given, is the one). */
static uint64_t streams_listed(void *sock, const char *only)
{
    tally_req_t ls = th_req(TALLY_OP_STREAMS, TALLY_DTYPE_NONE, 900);
    th_reply_t r;
    assert_int_equal(th_call_reply_status(sock, &ls, NULL, 0, &r), TALLY_OK);
    uint64_t count = r.rep.count;
    if (only) {
        assert_int_equal(count, 1);
        assert_int_equal(r.payload[0], strlen(only));
        assert_memory_equal(r.payload + 1, only, strlen(only));
    }
    th_reply_free(&r);
    return count;
}

static int control_on(void *sock, uint8_t op, const char *stream, uint64_t id)
{
    tally_req_t req = th_req(op, TALLY_DTYPE_NONE, id);
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    return th_call_status(sock, &req, NULL, 0);
}

/* Issue 21 (8): a request refused on a stream it would create leaves no stream behind (§3: a
 * failed request has no effect). 12 hists with seq 5 on 12 new streams, pipelined, against a
 * quota of 10 streams and 3 creations a second: each is answered sequence_gap (before the fix
 * they created their streams, the 11th got client_streams and the 4th rate_limited), `streams`
 * lists none, and the client then creates a stream as if they had never been sent. After a
 * delete, a refused request does not bring the stream back either. */
static void test_refused_request_creates_no_stream(void **state)
{
    (void)state;
    const char *args[] = {"--max-streams-per-client", GAP_QUOTA_TEXT, "--stream-create-rate",
                          RATE_TEXT, NULL};
    assert_int_equal(th_daemon_start(&daemon_, args), 0);
    void *sock = th_connect(daemon_.endpoint, 5000);
    for (int i = 0; i < GAP_REQUESTS; i++) {
        char name[16];
        snprintf(name, sizeof name, "gap%d", i);
        send_hist_seq(sock, name, 5, 100 + (uint64_t)i);
    }
    bool answered[GAP_REQUESTS] = {false}; /* 12 streams: their replies in any order (shards) */
    for (int i = 0; i < GAP_REQUESTS; i++) {
        th_reply_t reply;
        assert_int_equal(th_recv_reply(sock, &reply), 0);
        uint64_t k = reply.rep.request_id - 100;
        assert_true(k < GAP_REQUESTS && !answered[k]);
        answered[k] = true;
        assert_int_equal(reply.rep.status, TALLY_E_SEQ_GAP);
        assert_int_equal(reply.rep.aux0, 0);
        th_reply_free(&reply);
    }
    assert_int_equal(streams_listed(sock, NULL), 0);
    assert_int_equal(th_stat(sock, "tallyd_streams"), 0);
    assert_int_equal(control_on(sock, TALLY_OP_QUERY, "gap0", 200), TALLY_E_UNKNOWN_STREAM);

    /* The quota and the creation tokens are untouched: 2 of the burst of 3 now. */
    assert_int_equal(hist_on(sock, "ok0", 201), TALLY_OK);
    assert_int_equal(hist_on(sock, "ok1", 202), TALLY_OK);
    assert_int_equal(th_stat(sock, "tallyd_limited_total{reason=\"client_streams\"}"), 0);
    assert_int_equal(th_stat(sock, "tallyd_limited_total{reason=\"stream_rate\"}"), 0);

    /* A delete queued behind a large batch, then a refused request on the name: the stream is
     * gone all the same (and whether the refused request found the deleted stream still held
     * by its queue or created it anew, the last creation token is still there after). */
    size_t big_len = 4u << 20;
    uint8_t *big = calloc(1, big_len);
    assert_non_null(big);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 210);
    assert_int_equal(tally_req_set_stream(&req, "ok1"), TALLY_OK);
    assert_int_equal(th_send_request(sock, &req, big, big_len), 0);
    free(big);
    req = th_req(TALLY_OP_DELETE, TALLY_DTYPE_NONE, 211);
    assert_int_equal(tally_req_set_stream(&req, "ok1"), TALLY_OK);
    assert_int_equal(th_send_request(sock, &req, NULL, 0), 0);
    send_hist_seq(sock, "ok1", 2, 212);
    uint32_t want[] = {TALLY_OK, TALLY_OK, TALLY_E_SEQ_GAP};
    for (int i = 0; i < 3; i++) {
        th_reply_t reply;
        assert_int_equal(th_recv_reply(sock, &reply), 0);
        assert_int_equal(reply.rep.request_id, 210 + (uint64_t)i);
        assert_int_equal(reply.rep.status, want[i]);
        th_reply_free(&reply);
    }
    assert_int_equal(control_on(sock, TALLY_OP_QUERY, "ok1", 213), TALLY_E_UNKNOWN_STREAM);
    assert_int_equal(streams_listed(sock, "ok0"), 1);
    assert_int_equal(hist_on(sock, "ok2", 214), TALLY_OK);
    assert_int_equal(streams_listed(sock, NULL), 2);
    th_close(sock);
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 10000), 0);
}

/* A client that creates streams back to back gets about RATE of them per second (a burst of RATE,
 * then RATE a second), the rest `rate_limited`; after a pause it creates again. */
static void test_stream_create_rate(void **state)
{
    (void)state;
    const char *args[] = {"--stream-create-rate", RATE_TEXT, NULL};
    assert_int_equal(th_daemon_start(&daemon_, args), 0);
    void *sock = th_connect(daemon_.endpoint, 5000);
    int64_t t0 = th_now_ms();
    int created = 0, limited = 0;
    for (int i = 0; i < RATE_TRIES; i++) {
        char name[16];
        snprintf(name, sizeof name, "r%d", i);
        int status = hist_on(sock, name, 100 + (uint64_t)i);
        assert_true(status == TALLY_OK || status == TALLY_E_RATE);
        created += status == TALLY_OK;
        limited += status == TALLY_E_RATE;
    }
    double elapsed_s = (double)(th_now_ms() - t0) / 1e3;
    fprintf(stderr, "%d streams created, %d rate_limited in %.3f s\n", created, limited, elapsed_s);
    assert_true(created >= RATE);
    assert_true(created <= RATE + (int)(RATE * elapsed_s) + 1);
    assert_true(limited > 0);
    assert_int_equal(th_stat(sock, "tallyd_limited_total{reason=\"stream_rate\"}"), limited);
    assert_int_equal(hist_on(sock, "r0", 200), TALLY_OK); /* existing streams are not limited */
    usleep(1100 * 1000);                                  /* the bucket refills */
    assert_int_equal(hist_on(sock, "later", 201), TALLY_OK);
    th_close(sock);
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 10000), 0);
}

/* ---- units ------------------------------------------------------------------------------ */

static void test_fair_share_arithmetic(void **state)
{
    (void)state;
    td_config_t cfg;
    td_config_init(&cfg);
    assert_int_equal(cfg.max_inflight, 64);
    assert_int_equal(td_config_inflight_per_peer(&cfg, 0), 64); /* alone: every slot */
    assert_int_equal(td_config_inflight_per_peer(&cfg, 1), 64);
    assert_int_equal(td_config_inflight_per_peer(&cfg, 2), 32);
    assert_int_equal(td_config_inflight_per_peer(&cfg, 8), 8); /* 8 producers x 8 fit */
    assert_int_equal(td_config_inflight_per_peer(&cfg, 100), TD_FAIR_SHARE_MIN);
    cfg.max_inflight = 2;
    assert_int_equal(td_config_inflight_per_peer(&cfg, 5), 2); /* the floor is the limit */
    cfg.max_inflight_per_peer = 5;
    assert_int_equal(td_config_inflight_per_peer(&cfg, 1), 5); /* set: fixed */
    assert_int_equal(td_config_streams_per_client(&cfg), TD_DEFAULT_MAX_STREAMS / 2);
    cfg.max_streams_per_client = 9;
    assert_int_equal(td_config_streams_per_client(&cfg), 9);
    td_config_clear(&cfg);
}

#define SEC 1000000000ull

static void test_token_bucket_and_sweep(void **state)
{
    (void)state;
    td_peers_t *peers = NULL;
    assert_int_equal(td_peers_new(&peers), TALLY_OK);
    td_peers_set_rate(peers, 2);
    td_peer_t *c = td_peers_acquire(peers, TD_PEER_CONNECTION, "\x01\x02", 2, 10 * SEC);
    assert_non_null(c);
    assert_string_equal(td_peer_name(c), "0102");
    assert_ptr_equal(td_peers_acquire(peers, TD_PEER_CONNECTION, "\x01\x02", 2, 10 * SEC), c);
    assert_int_equal(td_peer_refs(c), 2);
    /* A burst of 2, then one every half second. */
    assert_true(td_peer_take_token(peers, c, 10 * SEC));
    assert_true(td_peer_take_token(peers, c, 10 * SEC));
    assert_false(td_peer_take_token(peers, c, 10 * SEC));
    assert_false(td_peer_take_token(peers, c, 10 * SEC + SEC / 4));
    assert_true(td_peer_take_token(peers, c, 10 * SEC + SEC / 2));
    assert_false(td_peer_take_token(peers, c, 10 * SEC + SEC / 2));

    td_peer_t *u = td_peers_acquire(peers, TD_PEER_USER, "cam1", 4, 10 * SEC);
    assert_string_equal(td_peer_name(u), "cam1");
    assert_int_equal(td_peers_count(peers), 2);
    td_peers_release(peers, &u);
    assert_null(u);
    td_peers_release(peers, &c);
    td_peer_t *again = td_peers_acquire(peers, TD_PEER_CONNECTION, "\x01\x02", 2, 11 * SEC);
    td_peers_release(peers, &c); /* NULL: a no-op */
    td_peers_release(peers, &again);
    /* Still referenced once: kept. Unreferenced with an empty bucket: kept (else closing and
     * reconnecting would reset the rate). A user: kept for its metrics. */
    td_peers_sweep(peers, 11 * SEC);
    assert_int_equal(td_peers_count(peers), 2);
    c = td_peers_acquire(peers, TD_PEER_CONNECTION, "\x01\x02", 2, 11 * SEC);
    assert_int_equal(td_peer_refs(c), 2);
    td_peer_t *other = c;
    td_peers_release(peers, &other); /* the other holder lets go */
    td_peers_release(peers, &c);
    td_peers_sweep(peers, 11 * SEC); /* refs 0, bucket 1.0 of 2: kept */
    assert_int_equal(td_peers_count(peers), 2);
    td_peers_sweep(peers, 20 * SEC); /* refilled: freed; the user stays */
    assert_int_equal(td_peers_count(peers), 1);
    td_peers_set_rate(peers, 0); /* unlimited */
    c = td_peers_acquire(peers, TD_PEER_CONNECTION, "x", 1, 21 * SEC);
    for (int i = 0; i < 100; i++)
        assert_true(td_peer_take_token(peers, c, 21 * SEC));
    td_peers_destroy(&peers);
    assert_null(peers);
}

/* The per-peer table's edges: a routing id of ZeroMQ's longest (255 bytes) is named by as many
 * of its bytes in hex as the name holds; ids are told apart by their first TD_PEER_KEY_MAX
 * bytes; a token given back never lifts the bucket over its burst, and with no rate nothing is
 * counted; the sweep keeps a connection whose replies still sit in ZeroMQ (its meter holds
 * bytes) and frees it once they have left, and with no rate an idle entry goes at once. */
static void test_peer_names_tokens_and_held_replies(void **state)
{
    (void)state;
    td_peers_t *peers = NULL;
    assert_int_equal(td_peers_new(&peers), TALLY_OK);
    uint8_t id[TD_PEER_KEY_MAX + 44];
    for (size_t i = 0; i < sizeof id; i++)
        id[i] = (uint8_t)(0xa0 + i % 16);
    td_peer_t *c = td_peers_acquire(peers, TD_PEER_CONNECTION, id, 255, SEC);
    const char *name = td_peer_name(c);
    assert_int_equal(strlen(name), (TD_PEER_NAME_MAX - 1) / 2 * 2);
    assert_memory_equal(name, "a0a1a2a3a4a5a6a7a8a9aaabacadaeaf", 32);
    td_peer_t *longest = td_peers_acquire(peers, TD_PEER_CONNECTION, id, TD_PEER_KEY_MAX, SEC);
    td_peer_t *longer = td_peers_acquire(peers, TD_PEER_CONNECTION, id, sizeof id, SEC);
    assert_ptr_equal(longer, longest);
    assert_ptr_not_equal(longest, c);
    assert_int_equal(td_peers_count(peers), 2);
    assert_int_equal(td_peer_refs(longest), 2);
    td_peers_release(peers, &longest);
    td_peers_release(peers, &longer);
    td_peers_release(peers, &c);

    td_peers_set_rate(peers, 2);
    c = td_peers_acquire(peers, TD_PEER_CONNECTION, "\x05", 1, SEC);
    assert_true(td_peer_take_token(peers, c, SEC));
    for (int i = 0; i < 3; i++)
        td_peer_give_token(peers, c); /* one back, then over the burst: capped */
    assert_true(td_peer_take_token(peers, c, SEC));
    assert_true(td_peer_take_token(peers, c, SEC));
    assert_false(td_peer_take_token(peers, c, SEC));
    td_peers_set_rate(peers, 0);
    td_peer_give_token(peers, c); /* unlimited: nothing to give back */

    /* Unreferenced with 100 reply bytes inside ZeroMQ: kept; once they left, swept (no rate:
     * nothing to wait for), with the other unreferenced connections. */
    atomic_store(&td_peer_meter(c)->held, 100);
    td_peers_release(peers, &c);
    td_peers_sweep(peers, 2 * SEC);
    assert_int_equal(td_peers_count(peers), 1);
    c = td_peers_acquire(peers, TD_PEER_CONNECTION, "\x05", 1, 2 * SEC);
    atomic_store(&td_peer_meter(c)->held, 0);
    td_peers_release(peers, &c);
    td_peers_sweep(peers, 2 * SEC);
    assert_int_equal(td_peers_count(peers), 0);
    td_peers_destroy(&peers);
}

int main(void)
{
    th_seed();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fair_share_arithmetic),
        cmocka_unit_test(test_token_bucket_and_sweep),
        cmocka_unit_test(test_peer_names_tokens_and_held_replies),
        cmocka_unit_test_teardown(test_busy_beyond_the_share, stop_daemon),
        cmocka_unit_test_teardown(test_streams_per_client, stop_daemon),
        cmocka_unit_test_teardown(test_stream_create_rate, stop_daemon),
        cmocka_unit_test_teardown(test_refused_request_creates_no_stream, stop_daemon),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
