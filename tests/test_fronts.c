/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_fronts.c — fronts (`front` in tallyd.conf, --front: a ROUTER socket and a thread each,
 * daemon/net/td_zmq_front.c) seen from outside, each tallyd started with --shards 2 and two fronts
 * beside its bind, over raw ZeroMQ:
 *   - order and state: three connections (the bind's, each front's) pipeline numbered scans on
 *     streams of their own and unnumbered ones on one stream they share, all at once: every
 *     request is answered exactly once, ok; each numbered scan's sums continue its stream's
 *     carry exactly (a request out of order would be a gap, or sums off by a chunk); the shared
 *     stream's carry is the model's (every chunk counted once); `stats` counts each front's
 *     requests;
 *   - admission per connection on a front: with max_inflight_per_peer 3 and a simulated GPU that
 *     takes 2 s per launch, a connection on a front that pipelines 10 batches gets exactly 3
 *     answered ok and 7 `busy`, as one on the bind does beside it;
 *   - max_inflight across fronts: at max_inflight 4, two fronts' connections pipelining 6 each
 *     are all answered ok (the fronts stop reading at the limit; nothing is refused or lost),
 *     and the requests in flight never pass the limit by more than a request per front;
 *   - the bind held at max_inflight by a front's requests alone takes its request as soon as they
 *     are answered (their replies wake the loop thread: td_path_wait_for_room), not at its next
 *     timer (the peers' sweep, every second): four rounds, each within 300 ms;
 *   - the drain at SIGTERM with requests in flight on every front and the bind: each is answered
 *     ok, each sent after the signal `shutdown`, and tallyd exits 0;
 *   - CURVE: a front takes an allowed key's requests, nothing from an unknown key or a plain
 *     socket, and tallyd_auth_total counts its handshakes (unknown_key, no_curve, allowed);
 *   - a shared-memory reference on a front resolves against its routing id's regions (the same
 *     counts as the bytes sent), and another connection's reference to it is `bad_ref`;
 *   - odd peers on a front, as on the bind: a REQ socket's envelope (its empty delimiter echoed)
 *     and a message of too many frames (answered `frames`, its extra frames dropped); a reply
 *     whose connection has gone is dropped and counted (tallyd_front_replies_dropped_total);
 *   - the sequence rules on a front (`duplicate`, `sequence_gap` with aux0 = last_seq, a failed
 *     request not using up its seq), the stream read back through the bind;
 *   - every endpoint the whole daemon: streams written through one read through the others;
 *   - max_inflight held by the bind's requests alone holds a front's (it stops reading);
 *   - the drain with a front held at max_inflight: every request read or queued answered once;
 *   - malformed messages on a front answered as on the bind, frame for frame;
 *   - `info`'s fronts= and the /metrics families of the fronts, typed and labelled;
 *   - reading ends at the drain time under a flood of pings on a front;
 *   - refusals: a front with one shard, a front on an endpoint already bound.
 */
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>
#include <zmq.h>

#include "harness.h"
#include "shm_side.h"
#include "tally_proto.h"

#define CONNS 3   /* the bind's and two fronts' */
#define STREAMS 4 /* numbered streams per connection */
#define ROUNDS 24 /* numbered scans per stream */
#define SHARED 16 /* unnumbered scans per connection on the shared stream */
#define CHUNK 16  /* int32 ones per scan */
#define TIMEOUT_MS 30000

typedef struct {
    char dir[128];
    char front[2][200];
    th_daemon_t d;
} fixture_t;

/* The fixture of the test that runs (its daemon killed by the teardown if the test failed). */
static fixture_t *live;

static int kill_left(void **state)
{
    (void)state;
    th_use_curve(NULL, NULL, NULL);
    if (live)
        th_daemon_kill(&live->d);
    live = NULL;
    return 0;
}

/* tallyd with --shards 2, two fronts (ipc, in a directory of the test's own) and args. */
static void start(fixture_t *f, const char *const *args)
{
    if (!f->dir[0]) /* else the test made it (its keys) */
        assert_int_equal(th_tmpdir(f->dir, sizeof f->dir, "tallyd-fronts"), 0);
    for (int i = 0; i < 2; i++)
        snprintf(f->front[i], sizeof f->front[i], "ipc://%s/front%d.sock", f->dir, i);
    const char *fronts[] = {"--shards", "2", "--front", f->front[0], "--front", f->front[1], NULL};
    live = f;
    assert_int_equal(th_daemon_start_with(&f->d, fronts, args), 0);
}

static void *connect_to(const fixture_t *f, int conn)
{
    void *sock = th_connect(conn == 0 ? f->d.endpoint : f->front[conn - 1], TIMEOUT_MS);
    assert_non_null(sock);
    return sock;
}

static tally_req_t scan_req(uint64_t id, const char *stream, uint64_t seq)
{
    tally_req_t req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, id);
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    req.seq = seq;
    return req;
}

/* A numbered scan's request id: its connection, stream and round. */
static uint64_t scan_id(int conn, int stream, int round)
{
    return 1 + ((uint64_t)conn << 16) + ((uint64_t)stream << 8) + (uint64_t)round;
}

/* The last inclusive sum of a scan reply (CHUNK int64), and checks the first is first. */
static int64_t scan_sums(const th_reply_t *r, int64_t first)
{
    assert_int_equal(r->rep.status, TALLY_OK);
    assert_int_equal(r->len, CHUNK * sizeof(int64_t));
    int64_t sums[CHUNK];
    memcpy(sums, r->payload, sizeof sums);
    assert_int_equal(sums[0], first);
    return sums[CHUNK - 1];
}

static void test_order_and_state(void **state)
{
    (void)state;
    static fixture_t f; /* static: the teardown reaches it after a failed assertion */
    memset(&f, 0, sizeof f);
    start(&f, (const char *[]){"--max-inflight", "1024", NULL});
    void *socks[CONNS];
    for (int c = 0; c < CONNS; c++)
        socks[c] = connect_to(&f, c);
    int32_t ones[CHUNK];
    for (int i = 0; i < CHUNK; i++)
        ones[i] = 1;
    char names[CONNS][STREAMS][16];
    for (int c = 0; c < CONNS; c++)
        for (int s = 0; s < STREAMS; s++)
            snprintf(names[c][s], sizeof names[c][s], "front%d/s%d", c, s);
    /* Everything sent before anything is read: the three connections' requests meet on the
     * shards, the shared stream's from every thread at once. */
    for (int round = 0; round < ROUNDS; round++)
        for (int c = 0; c < CONNS; c++) {
            for (int s = 0; s < STREAMS; s++) {
                tally_req_t req = scan_req(scan_id(c, s, round), names[c][s], (uint64_t)round + 1);
                assert_int_equal(th_send_request(socks[c], &req, ones, sizeof ones), 0);
            }
            if (round < SHARED) {
                tally_req_t req = scan_req(scan_id(c, STREAMS, round), "fronts/shared", 0);
                assert_int_equal(th_send_request(socks[c], &req, ones, sizeof ones), 0);
            }
        }
    static bool seen[CONNS][STREAMS + 1][ROUNDS];
    memset(seen, 0, sizeof seen);
    for (int c = 0; c < CONNS; c++)
        for (int n = 0; n < ROUNDS * STREAMS + SHARED; n++) {
            th_reply_t r;
            assert_int_equal(th_recv_reply(socks[c], &r), 0);
            uint64_t id = r.rep.request_id - 1;
            int conn = (int)(id >> 16), stream = (int)((id >> 8) & 0xff), round = (int)(id & 0xff);
            assert_int_equal(conn, c); /* each reply comes back through its own socket */
            assert_true(stream <= STREAMS && round < ROUNDS);
            assert_false(seen[conn][stream][round]); /* exactly once */
            seen[conn][stream][round] = true;
            if (stream < STREAMS) /* its carry continues from the round before */
                assert_int_equal(scan_sums(&r, (int64_t)round * CHUNK + 1),
                                 (int64_t)(round + 1) * CHUNK);
            else
                assert_int_equal(r.rep.status, TALLY_OK);
            th_reply_free(&r);
        }
    /* The model: every chunk of the shared stream counted once, whichever front it came by. */
    th_reply_t r;
    tally_req_t last = scan_req(999999, "fronts/shared", 0);
    assert_int_equal(th_call(socks[2], &last, ones, sizeof ones, &r), 0);
    assert_int_equal(scan_sums(&r, (int64_t)CONNS * SHARED * CHUNK + 1),
                     (int64_t)(CONNS * SHARED + 1) * CHUNK);
    th_reply_free(&r);
    /* Each front's requests, counted apart (the bind's are not a front's). */
    long long per_front = ROUNDS * STREAMS + SHARED;
    assert_int_equal(th_stat(socks[0], "tallyd_fronts"), 2);
    assert_int_equal(th_stat(socks[0], "tallyd_front_requests_total{front=\"0\"}"), per_front);
    assert_int_equal(th_stat(socks[0], "tallyd_front_requests_total{front=\"1\"}"), per_front + 1);
    for (int c = 1; c < CONNS; c++)
        th_close(socks[c]);
    assert_int_equal(th_close_and_stop(socks[0], &f.d, 10000), 0);
    th_rmrf(f.dir);
}

/* d's /metrics value `name` once it is at least `want`, asked every 5 ms for up to 10 s: its
 * last value. */
static long long metric_reaching(const th_daemon_t *d, const char *name, long long want)
{
    long long v = th_metric(d, name);
    for (int64_t end = th_now_ms() + 10000; v < want && th_now_ms() < end; th_sleep_ms(5))
        v = th_metric(d, name);
    return v;
}

/* A simulated GPU that takes latency_us per launch, and the args after. */
static void start_slow(fixture_t *f, const char *latency_us, const char *const *more)
{
    const char *args[24] = {"--backend",       "cuda", "--test-sim-gpus", "1",
                            "--gpu-min-batch", "1",    "--gpu-streams",   "4"};
    int n = 8;
    for (int i = 0; more[i]; i++)
        args[n++] = more[i];
    args[n] = NULL;
    setenv("TALLYD_TEST_SIM_LATENCY_US", latency_us, 1);
    start(f, args);
    unsetenv("TALLYD_TEST_SIM_LATENCY_US");
}

/* `count` hists of 64 KiB pipelined on sock, ids from first. */
static void send_hists(void *sock, uint64_t first, int count)
{
    static uint8_t bytes[64 << 10];
    for (int i = 0; i < count; i++) {
        tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, first + (uint64_t)i);
        assert_int_equal(th_send_request(sock, &req, bytes, sizeof bytes), 0);
    }
}

/* `count` replies on sock, ids first.. first+count-1 each exactly once: how many had `status`
 * (the others must have `other`). */
static int replies_with(void *sock, uint64_t first, int count, uint32_t status, uint32_t other)
{
    bool seen[64] = {false};
    int n = 0;
    for (int i = 0; i < count; i++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(sock, &r), 0);
        assert_true(r.rep.request_id >= first && r.rep.request_id < first + (uint64_t)count);
        assert_false(seen[r.rep.request_id - first]);
        seen[r.rep.request_id - first] = true;
        if (r.rep.status == status)
            n++;
        else
            assert_int_equal(r.rep.status, other);
        th_reply_free(&r);
    }
    return n;
}

static void test_share_on_a_front(void **state)
{
    (void)state;
    static fixture_t f; /* static: the teardown reaches it after a failed assertion */
    memset(&f, 0, sizeof f);
    start_slow(&f, "2000000", (const char *[]){"--max-inflight-per-peer", "3", NULL});
    void *bind = connect_to(&f, 0), *front = connect_to(&f, 1);
    send_hists(front, 1, 10);
    send_hists(bind, 100, 10);
    assert_int_equal(replies_with(front, 1, 10, TALLY_OK, TALLY_E_BUSY), 3);
    assert_int_equal(replies_with(bind, 100, 10, TALLY_OK, TALLY_E_BUSY), 3);
    send_hists(front, 200, 10); /* the slots came back with the replies */
    assert_int_equal(replies_with(front, 200, 10, TALLY_OK, TALLY_E_BUSY), 3);
    assert_int_equal(th_stat(bind, "tallyd_limited_total{reason=\"inflight_share\"}"), 3 * 7);
    th_close(front);
    assert_int_equal(th_close_and_stop(bind, &f.d, 10000), 0);
    th_rmrf(f.dir);
}

static void test_max_inflight_across_fronts(void **state)
{
    (void)state;
    static fixture_t f; /* static: the teardown reaches it after a failed assertion */
    memset(&f, 0, sizeof f);
    start_slow(&f, "1000000",
               (const char *[]){"--max-inflight", "4", "--metrics", "127.0.0.1:0", NULL});
    void *a = connect_to(&f, 1), *b = connect_to(&f, 2);
    send_hists(a, 1, 6);
    send_hists(b, 100, 6);
    /* The first launches under way (a second each), the rest waiting: at most one over the
     * limit per front, whenever it is looked at. */
    long long inflight = metric_reaching(&f.d, "tallyd_requests_in_flight", 1);
    assert_true(inflight >= 1 && inflight <= 4 + 2);
    assert_int_equal(replies_with(a, 1, 6, TALLY_OK, TALLY_OK), 6);
    assert_int_equal(replies_with(b, 100, 6, TALLY_OK, TALLY_OK), 6);
    assert_true(th_stat(a, "tallyd_front_busy_waits_total{front=\"0\"}") +
                    th_stat(a, "tallyd_front_busy_waits_total{front=\"1\"}") >=
                1);
    th_close(b);
    assert_int_equal(th_close_and_stop(a, &f.d, 10000), 0);
    th_rmrf(f.dir);
}

/* The ms from the last of the front's two replies to the bind's one, whose request waited for
 * their slots: its own 200 ms on the simulated GPU, and the loop thread's wake-up. */
static long long bind_wait_after_front(const fixture_t *f, void *bind, void *front, uint64_t id)
{
    send_hists(front, id, 2);
    /* both launched: the slots are the front's */
    long long inflight = metric_reaching(&f->d, "tallyd_requests_in_flight", 2);
    assert_int_equal(inflight, 2);
    send_hists(bind, id + 100, 1);
    assert_int_equal(replies_with(front, id, 2, TALLY_OK, TALLY_OK), 2);
    int64_t freed = th_now_ms();
    assert_int_equal(replies_with(bind, id + 100, 1, TALLY_OK, TALLY_OK), 1);
    return th_now_ms() - freed;
}

static void test_bind_woken_by_a_front(void **state)
{
    (void)state;
    static fixture_t f; /* static: the teardown reaches it after a failed assertion */
    memset(&f, 0, sizeof f);
    start_slow(&f, "200000",
               (const char *[]){"--max-inflight", "2", "--metrics", "127.0.0.1:0", NULL});
    void *bind = connect_to(&f, 0), *front = connect_to(&f, 1);
    for (int round = 0; round < 4; round++) {
        long long waited = bind_wait_after_front(&f, bind, front, 1 + 1000 * (uint64_t)round);
        if (waited >= 200 + 300)
            fail_msg("round %d: the bind's reply came %lld ms after the front's", round, waited);
    }
    th_close(front);
    assert_int_equal(th_close_and_stop(bind, &f.d, 10000), 0);
    th_rmrf(f.dir);
}

static void test_drain_on_every_front(void **state)
{
    (void)state;
    static fixture_t f; /* static: the teardown reaches it after a failed assertion */
    memset(&f, 0, sizeof f);
    start_slow(&f, "3000000", (const char *[]){"--metrics", "127.0.0.1:0", NULL});
    void *socks[CONNS];
    for (int c = 0; c < CONNS; c++) {
        socks[c] = connect_to(&f, c);
        send_hists(socks[c], 100 * (uint64_t)c + 1, 2);
    }
    /* All six read, on the simulated GPU for 3 s: then the stop. */
    long long inflight = 0;
    for (int64_t end = th_now_ms() + 2000; inflight < 2 * CONNS && th_now_ms() < end;
         th_sleep_ms(50))
        inflight = th_metric(&f.d, "tallyd_requests_in_flight");
    assert_int_equal(inflight, 2 * CONNS);
    assert_int_equal(kill(f.d.pid, SIGTERM), 0);
    th_sleep_ms(100);
    for (int c = 0; c < CONNS; c++) /* during the drain: answered, not run */
        send_hists(socks[c], 100 * (uint64_t)c + 50, 1);
    for (int c = 0; c < CONNS; c++) { /* the late one's comes first: nothing runs it */
        bool seen[3] = {false};
        for (int i = 0; i < 3; i++) {
            th_reply_t r;
            assert_int_equal(th_recv_reply(socks[c], &r), 0);
            uint64_t k = r.rep.request_id - 100 * (uint64_t)c;
            assert_true(k == 1 || k == 2 || k == 50);
            int slot = k == 50 ? 2 : (int)k - 1;
            assert_false(seen[slot]);
            seen[slot] = true;
            assert_int_equal(r.rep.status, k == 50 ? TALLY_E_SHUTDOWN : TALLY_OK);
            th_reply_free(&r);
        }
        th_close(socks[c]);
    }
    assert_int_equal(th_daemon_wait(&f.d, 20000), 0);
    th_rmrf(f.dir);
}

/* A ping on sock: its reply's status, or -1 when none came (the receive timeout). */
static int ping_status(void *sock, uint64_t id)
{
    tally_req_t req = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, id);
    th_reply_t r;
    if (th_call(sock, &req, NULL, 0, &r) != 0)
        return -1;
    int st = (int)r.rep.status;
    th_reply_free(&r);
    return st;
}

static void test_curve_on_a_front(void **state)
{
    (void)state;
    static fixture_t f; /* static: the teardown reaches it after a failed assertion */
    memset(&f, 0, sizeof f);
    char server_pub[41], server_sec[41], alice_pub[41], alice_sec[41], key[256], clients[256];
    assert_int_equal(th_tmpdir(f.dir, sizeof f.dir, "tallyd-fronts"), 0);
    assert_int_equal(th_curve_dir(f.dir, "alice", server_pub, server_sec, alice_pub, alice_sec, key,
                                  clients, sizeof key),
                     0);
    th_use_curve(server_pub, alice_pub, alice_sec);
    start(&f, (const char *[]){"--curve-secret-key", key, "--curve-clients-dir", clients, NULL});
    void *alice = connect_to(&f, 1); /* CURVE, an allowed key */
    assert_int_equal(ping_status(alice, 1), TALLY_OK);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 2);
    assert_int_equal(tally_req_set_stream(&req, "fronts/curve"), TALLY_OK);
    th_reply_t r;
    assert_int_equal(th_call(alice, &req, "abc", 3, &r), 0);
    assert_int_equal(r.rep.status, TALLY_OK);
    th_reply_free(&r);
    char other_pub[41], other_sec[41]; /* CURVE, a key not in the clients' directory: ZAP says no */
    assert_int_equal(zmq_curve_keypair(other_pub, other_sec), 0);
    th_use_curve(server_pub, other_pub, other_sec);
    void *stranger = th_dealer(1500);
    assert_int_equal(zmq_connect(stranger, f.front[1]), 0);
    assert_int_equal(ping_status(stranger, 4), -1);
    th_close(stranger);
    th_use_curve(NULL, NULL, NULL);
    void *plain = th_dealer(1500); /* no CURVE: the handshake never completes, nothing is read */
    assert_int_equal(zmq_connect(plain, f.front[1]), 0);
    assert_int_equal(ping_status(plain, 3), -1);
    th_close(plain);
    /* ping, hist and this stats request itself */
    assert_int_equal(th_stat(alice, "tallyd_front_requests_total{front=\"0\"}"), 3);
    assert_int_equal(th_stat(alice, "tallyd_front_requests_total{front=\"1\"}"), 0);
    /* The front's handshakes counted as the bind's are (PROTOCOL.md, "Security"; the bind saw
     * no refusal): the refused key (once or more: its socket tries again), the client without
     * CURVE (no_curve, or bad_handshake when it hangs up first), the monitor's events a moment
     * later; allowed: the readiness ping's on the bind and alice's on the front. */
    long long unknown = 0, plain_refused = 0;
    for (int64_t end = th_now_ms() + 10000; (unknown < 1 || plain_refused < 1) && th_now_ms() < end;
         th_sleep_ms(50)) {
        unknown = th_stat(alice, "tallyd_auth_total{result=\"unknown_key\"}");
        plain_refused = th_stat(alice, "tallyd_auth_total{result=\"no_curve\"}") +
                        th_stat(alice, "tallyd_auth_total{result=\"bad_handshake\"}");
    }
    assert_true(unknown >= 1);
    assert_true(plain_refused >= 1);
    assert_true(th_stat(alice, "tallyd_auth_total{result=\"allowed\"}") >= 2);
    assert_int_equal(th_close_and_stop(alice, &f.d, 10000), 0);
    th_rmrf(f.dir);
}

/* A hist u8 of [0, len) of region `handle` by reference (stream: may be NULL) on sock. */
static void ref_hist(void *sock, uint64_t id, const char *stream, uint64_t handle, size_t len,
                     th_reply_t *r)
{
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, id);
    req.flags = TALLY_FLAG_SHM_REF;
    if (stream)
        assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    tally_shm_ref_t ref = {.in_handle = handle, .in_length = len};
    uint8_t bytes[TALLY_SHM_REF_SIZE];
    tally_shm_ref_encode(&ref, bytes);
    assert_int_equal(th_call(sock, &req, bytes, sizeof bytes, r), 0);
}

static void test_shm_ref_on_a_front(void **state)
{
    (void)state;
    static fixture_t f; /* static: the teardown reaches it after a failed assertion */
    memset(&f, 0, sizeof f);
    start(&f, (const char *[]){NULL});
    int side = th_side_connect(f.d.shm_socket);
    assert_true(side >= 0);
    enum { LEN = 4096 };
    uint8_t data[LEN];
    for (int i = 0; i < LEN; i++)
        data[i] = (uint8_t)(i * 7);
    int fd = th_memfd(65536, F_SEAL_SHRINK | F_SEAL_GROW);
    assert_int_equal(pwrite(fd, data, LEN, 0), LEN);
    th_answer_t ans;
    assert_int_equal(th_side_call(side, TALLY_SHM_OP_REGISTER, "producer", 0, fd, &ans), TALLY_OK);
    close(fd);
    /* The region is the routing id's, whichever endpoint its requests come by. */
    void *ctx = zmq_ctx_new();
    void *front = th_dealer_id(ctx, f.front[0], "producer", TIMEOUT_MS);
    void *other = th_dealer_id(ctx, f.front[1], "someone", TIMEOUT_MS);
    assert_non_null(front);
    assert_non_null(other);
    th_reply_t by_ref, by_payload;
    ref_hist(front, 1, "fronts/shm", ans.a.handle, LEN, &by_ref);
    assert_int_equal(by_ref.rep.status, TALLY_OK);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 2);
    assert_int_equal(th_call(front, &req, data, LEN, &by_payload), 0);
    assert_int_equal(by_payload.rep.status, TALLY_OK);
    assert_int_equal(by_ref.len, by_payload.len); /* the same counts as the bytes sent */
    assert_memory_equal(by_ref.payload, by_payload.payload, by_ref.len);
    th_reply_free(&by_ref);
    th_reply_free(&by_payload);
    th_reply_t r;
    ref_hist(other, 3, NULL, ans.a.handle, LEN, &r); /* not its region */
    assert_int_equal(r.rep.status, TALLY_E_BAD_REF);
    th_reply_free(&r);
    zmq_close(front);
    zmq_close(other);
    zmq_ctx_term(ctx);
    close(side);
    assert_int_equal(th_daemon_stop(&f.d, SIGTERM, 10000), 0);
    th_rmrf(f.dir);
}

static void test_odd_peers_on_a_front(void **state)
{
    (void)state;
    static fixture_t f; /* static: the teardown reaches it after a failed assertion */
    memset(&f, 0, sizeof f);
    start(&f, (const char *[]){NULL});
    assert_int_equal(th_req_socket_ping(f.front[0], 61, TIMEOUT_MS), TALLY_OK);

    void *sock = connect_to(&f, 2);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 62);
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(&req, header);
    const void *data[8] = {header, "a", "b", "c", "d", "e", "f", "g"};
    size_t lens[8] = {sizeof header, 1, 1, 1, 1, 1, 1, 1};
    assert_int_equal(th_send_frames(sock, 8, data, lens), 0);
    th_reply_t r;
    assert_int_equal(th_recv_reply(sock, &r), 0);
    assert_int_equal(r.rep.request_id, 62);
    assert_int_equal(r.rep.status, TALLY_E_FRAMES);
    th_reply_free(&r);
    assert_int_equal(th_close_and_stop(sock, &f.d, 10000), 0);
    th_rmrf(f.dir);
}

static void test_reply_to_a_gone_peer(void **state)
{
    (void)state;
    static fixture_t f; /* static: the teardown reaches it after a failed assertion */
    memset(&f, 0, sizeof f);
    start_slow(&f, "300000", (const char *[]){"--metrics", "127.0.0.1:0", NULL});
    void *gone = connect_to(&f, 1);
    send_hists(gone, 1, 1);
    /* taken: its reply is 300 ms away */
    long long inflight = metric_reaching(&f.d, "tallyd_requests_in_flight", 1);
    assert_int_equal(inflight, 1);
    th_close(gone);
    const char *name = "tallyd_front_replies_dropped_total{front=\"0\"}";
    long long dropped = metric_reaching(&f.d, name, 1);
    assert_int_equal(dropped, 1);
    void *sock = connect_to(&f, 1); /* the front serves on */
    send_hists(sock, 2, 1);
    assert_int_equal(replies_with(sock, 2, 1, TALLY_OK, TALLY_OK), 1);
    assert_int_equal(th_close_and_stop(sock, &f.d, 10000), 0);
    th_rmrf(f.dir);
}

/* A hist u8 of `bytes` on `stream` with `seq` (0: none) on sock: its reply's status, aux0 in
 * *aux0 when not NULL. */
static uint32_t seq_hist(void *sock, uint64_t id, const char *stream, uint64_t seq,
                         const char *bytes, uint64_t *aux0)
{
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, id);
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    req.seq = seq;
    th_reply_t r;
    assert_int_equal(th_call(sock, &req, bytes, strlen(bytes), &r), 0);
    assert_int_equal(r.rep.request_id, id);
    if (aux0)
        *aux0 = r.rep.aux0;
    uint32_t status = r.rep.status;
    th_reply_free(&r);
    return status;
}

/* A stream's record (query) on sock: its last_seq, and its bin `bin` in *count. */
static uint64_t query_bin(void *sock, const char *stream, int bin, uint64_t *count)
{
    uint8_t rec[2176];
    assert_int_equal(th_query_raw(sock, stream, 7777, rec, sizeof rec), (long)sizeof rec);
    uint64_t last_seq;
    memcpy(&last_seq, rec + 104, 8); /* PROTOCOL.md §5 "query": little-endian u64s */
    memcpy(count, rec + 128 + 8 * bin, 8);
    return last_seq;
}

/* PROTOCOL.md §5 "Sequence numbers" on a front: seq 1 and 2 run; 2 again is `duplicate` and 4 a
 * `sequence_gap`, each with aux0 = last_seq 2; pipelined, a seq 3 that fails (`stream_state`: an
 * i32 hist on a u8 stream) does not use up its seq, so the seq 4 behind it is a `sequence_gap`,
 * answered after it (a stream's replies in order); seq 3 sent again runs. The bind reads the
 * stream back: last_seq 3 and the bytes of the three applied batches only. */
static void test_sequence_on_a_front(void **state)
{
    (void)state;
    static fixture_t f; /* static: the teardown reaches it after a failed assertion */
    memset(&f, 0, sizeof f);
    start(&f, (const char *[]){NULL});
    void *bind = connect_to(&f, 0), *front = connect_to(&f, 1);
    const char *name = "fronts/seq";
    uint64_t aux0 = 99;
    assert_int_equal(seq_hist(front, 1, name, 1, "a", NULL), TALLY_OK);
    assert_int_equal(seq_hist(front, 2, name, 2, "a", NULL), TALLY_OK);
    assert_int_equal(seq_hist(front, 3, name, 2, "a", &aux0), TALLY_E_DUPLICATE);
    assert_int_equal(aux0, 2);
    aux0 = 99;
    assert_int_equal(seq_hist(front, 4, name, 4, "a", &aux0), TALLY_E_SEQ_GAP);
    assert_int_equal(aux0, 2);
    tally_req_t wrong = th_req(TALLY_OP_HIST, TALLY_DTYPE_I32, 5);
    assert_int_equal(tally_req_set_stream(&wrong, name), TALLY_OK);
    wrong.seq = 3;
    wrong.hi = 256;
    int32_t one = 1;
    tally_req_t next = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 6);
    assert_int_equal(tally_req_set_stream(&next, name), TALLY_OK);
    next.seq = 4;
    assert_int_equal(th_send_request(front, &wrong, &one, sizeof one), 0);
    assert_int_equal(th_send_request(front, &next, "a", 1), 0);
    th_reply_t r;
    assert_int_equal(th_recv_reply(front, &r), 0);
    assert_int_equal(r.rep.request_id, 5);
    assert_int_equal(r.rep.status, TALLY_E_STREAM_STATE);
    th_reply_free(&r);
    assert_int_equal(th_recv_reply(front, &r), 0);
    assert_int_equal(r.rep.request_id, 6);
    assert_int_equal(r.rep.status, TALLY_E_SEQ_GAP);
    assert_int_equal(r.rep.aux0, 2);
    th_reply_free(&r);
    assert_int_equal(seq_hist(front, 7, name, 3, "a", NULL), TALLY_OK);
    uint64_t count = 0;
    assert_int_equal(query_bin(bind, name, 'a', &count), 3);
    assert_int_equal(count, 3);
    th_close(front);
    assert_int_equal(th_close_and_stop(bind, &f.d, 10000), 0);
    th_rmrf(f.dir);
}

/* Every endpoint is the whole daemon: a stream written through a front is read back through
 * the bind and the other front, and one written through the bind through a front; numbered
 * writes of one stream go on across endpoints (one client at a time, each reply awaited). */
static void test_streams_across_endpoints(void **state)
{
    (void)state;
    static fixture_t f; /* static: the teardown reaches it after a failed assertion */
    memset(&f, 0, sizeof f);
    start(&f, (const char *[]){NULL});
    void *socks[CONNS];
    for (int c = 0; c < CONNS; c++)
        socks[c] = connect_to(&f, c);
    uint64_t count = 0;
    assert_int_equal(seq_hist(socks[1], 1, "fronts/by-front", 1, "xxy", NULL), TALLY_OK);
    assert_int_equal(query_bin(socks[0], "fronts/by-front", 'x', &count), 1);
    assert_int_equal(count, 2);
    assert_int_equal(query_bin(socks[2], "fronts/by-front", 'y', &count), 1);
    assert_int_equal(count, 1);
    assert_int_equal(seq_hist(socks[0], 2, "fronts/by-bind", 1, "zz", NULL), TALLY_OK);
    assert_int_equal(query_bin(socks[1], "fronts/by-bind", 'z', &count), 1);
    assert_int_equal(count, 2);
    for (uint64_t seq = 2; seq <= 7; seq++) /* the bind, a front, the other front in turn */
        assert_int_equal(seq_hist(socks[seq % CONNS], 10 + seq, "fronts/by-bind", seq, "z", NULL),
                         TALLY_OK);
    assert_int_equal(query_bin(socks[2], "fronts/by-bind", 'z', &count), 7);
    assert_int_equal(count, 8);
    for (int c = 1; c < CONNS; c++)
        th_close(socks[c]);
    assert_int_equal(th_close_and_stop(socks[0], &f.d, 10000), 0);
    th_rmrf(f.dir);
}

/* max_inflight is counted over the bind and the fronts: with max_inflight 2 held by two of the
 * bind's requests (3 s each on the simulated GPU), a front's request is held (its thread stops
 * reading: tallyd_front_busy_waits_total; the request not handed on: requests_total 0) and runs
 * once they are answered; nothing is refused. */
static void test_bind_slots_hold_a_front(void **state)
{
    (void)state;
    static fixture_t f; /* static: the teardown reaches it after a failed assertion */
    memset(&f, 0, sizeof f);
    start_slow(&f, "3000000",
               (const char *[]){"--max-inflight", "2", "--metrics", "127.0.0.1:0", NULL});
    void *bind = connect_to(&f, 0), *front = connect_to(&f, 1);
    send_hists(bind, 1, 2);
    /* both launched: the slots are the bind's */
    long long inflight = metric_reaching(&f.d, "tallyd_requests_in_flight", 2);
    assert_int_equal(inflight, 2);
    send_hists(front, 100, 1);
    const char *name = "tallyd_front_busy_waits_total{front=\"0\"}";
    long long waits = metric_reaching(&f.d, name, 1);
    assert_true(waits >= 1);
    assert_int_equal(th_metric(&f.d, "tallyd_requests_in_flight"), 2);
    /* read, and held: not handed to the request path while the bind's hold the slots */
    assert_int_equal(th_metric(&f.d, "tallyd_front_requests_total{front=\"0\"}"), 0);
    assert_int_equal(replies_with(bind, 1, 2, TALLY_OK, TALLY_OK), 2);
    assert_int_equal(replies_with(front, 100, 1, TALLY_OK, TALLY_OK), 1);
    assert_int_equal(th_metric(&f.d, "tallyd_front_requests_total{front=\"0\"}"), 1);
    th_close(front);
    assert_int_equal(th_close_and_stop(bind, &f.d, 10000), 0);
    th_rmrf(f.dir);
}

/* The drain at SIGTERM with a front held at max_inflight: two requests running, a third read
 * and held (the front stopped reading), a fourth in the socket. Each of the four gets exactly
 * one reply: the two running their result, the others `shutdown`; tallyd exits 0. */
static void test_drain_with_a_front_held(void **state)
{
    (void)state;
    static fixture_t f; /* static: the teardown reaches it after a failed assertion */
    memset(&f, 0, sizeof f);
    start_slow(&f, "2000000",
               (const char *[]){"--max-inflight", "2", "--drain-ms", "20000", "--metrics",
                                "127.0.0.1:0", NULL});
    void *front = connect_to(&f, 1);
    send_hists(front, 1, 4);
    const char *name = "tallyd_front_busy_waits_total{front=\"0\"}";
    long long waits = metric_reaching(&f.d, name, 1);
    assert_true(waits >= 1);
    assert_int_equal(th_metric(&f.d, "tallyd_requests_in_flight"), 2);
    assert_int_equal(kill(f.d.pid, SIGTERM), 0);
    bool seen[4] = {false};
    for (int i = 0; i < 4; i++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(front, &r), 0);
        uint64_t k = r.rep.request_id;
        assert_true(k >= 1 && k <= 4);
        assert_false(seen[k - 1]);
        seen[k - 1] = true;
        assert_int_equal(r.rep.status, k <= 2 ? TALLY_OK : TALLY_E_SHUTDOWN);
        th_reply_free(&r);
    }
    th_close(front);
    assert_int_equal(th_daemon_wait(&f.d, 30000), 0);
    th_rmrf(f.dir);
}

/* Every frame of one reply: how many, and each's bytes (the first 512). */
typedef struct {
    int n;
    size_t len[8];
    uint8_t data[8][512];
} frames_t;

static void recv_frames(void *sock, frames_t *out)
{
    memset(out, 0, sizeof *out);
    int more = 1;
    while (more) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        assert_true(zmq_msg_recv(&msg, sock, 0) >= 0);
        assert_true(out->n < 8);
        size_t len = zmq_msg_size(&msg);
        out->len[out->n] = len;
        memcpy(out->data[out->n], zmq_msg_data(&msg), len < 512 ? len : 512);
        out->n++;
        more = zmq_msg_more(&msg);
        zmq_msg_close(&msg);
    }
}

/* Malformed messages on a front get the replies they get on the bind (PROTOCOL.md §1, §6): the
 * same frames, header and message, each the status §6 says. */
static void test_malformed_on_a_front(void **state)
{
    (void)state;
    static fixture_t f; /* static: the teardown reaches it after a failed assertion */
    memset(&f, 0, sizeof f);
    start(&f, (const char *[]){"--max-batch", "65536", NULL});
    void *bind = connect_to(&f, 0), *front = connect_to(&f, 1);
    uint8_t ok[TALLY_REQ_HEADER_SIZE], magic[TALLY_REQ_HEADER_SIZE], opcode[TALLY_REQ_HEADER_SIZE],
        seq[TALLY_REQ_HEADER_SIZE], dtype[TALLY_REQ_HEADER_SIZE], name[TALLY_REQ_HEADER_SIZE];
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 41);
    tally_req_encode(&req, ok);
    memcpy(magic, ok, sizeof ok);
    magic[0] ^= 0xff;
    req = th_req(0, TALLY_DTYPE_NONE, 42);
    tally_req_encode(&req, opcode);
    req = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, 43);
    req.seq = 5;
    tally_req_encode(&req, seq);
    req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_U8, 44);
    tally_req_encode(&req, dtype);
    req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 45);
    assert_int_equal(tally_req_set_stream(&req, "ok"), TALLY_OK);
    tally_req_encode(&req, name);
    name[TALLY_REQ_HEADER_SIZE - 64] = ' '; /* into the name's bytes: not printable ASCII */
    static uint8_t big[65537];
    const struct {
        int n;
        const void *data[4];
        size_t len[4];
        uint32_t status;
    } cases[] = {
        {1, {ok}, {sizeof ok}, TALLY_E_FRAMES},
        {3, {ok, "a", "b"}, {sizeof ok, 1, 1}, TALLY_E_FRAMES},
        {1, {""}, {0}, TALLY_E_FRAMES},
        {2, {"", "a"}, {0, 1}, TALLY_E_FRAMES},
        {3, {"", "", "a"}, {0, 0, 1}, TALLY_E_HEADER},
        {2, {ok, "a"}, {sizeof ok - 1, 1}, TALLY_E_HEADER},
        {2, {magic, "a"}, {sizeof ok, 1}, TALLY_E_MAGIC},
        {2, {opcode, ""}, {sizeof ok, 0}, TALLY_E_OPCODE},
        {2, {seq, ""}, {sizeof ok, 0}, TALLY_E_PARAM},
        {2, {dtype, "a"}, {sizeof ok, 1}, TALLY_E_DTYPE},
        {2, {name, "a"}, {sizeof ok, 1}, TALLY_E_STREAM_NAME},
        {2, {ok, big}, {sizeof ok, sizeof big}, TALLY_E_TOO_LARGE},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        frames_t on_bind, on_front;
        assert_int_equal(th_send_frames(bind, cases[i].n, cases[i].data, cases[i].len), 0);
        recv_frames(bind, &on_bind);
        assert_int_equal(th_send_frames(front, cases[i].n, cases[i].data, cases[i].len), 0);
        recv_frames(front, &on_front);
        int head = on_bind.n - 2; /* after the delimiter echoed, if any */
        assert_true(head >= 0);
        tally_rep_t rep;
        assert_int_equal(tally_rep_decode(on_bind.data[head], on_bind.len[head], &rep), TALLY_OK);
        if (rep.status != cases[i].status)
            fail_msg("case %zu: status %u, not %u", i, rep.status, cases[i].status);
        assert_int_equal(on_front.n, on_bind.n);
        for (int k = 0; k < on_bind.n; k++) {
            assert_int_equal(on_front.len[k], on_bind.len[k]);
            assert_memory_equal(on_front.data[k], on_bind.data[k],
                                on_bind.len[k] < 512 ? on_bind.len[k] : 512);
        }
    }
    th_close(front);
    assert_int_equal(th_close_and_stop(bind, &f.d, 10000), 0);
    th_rmrf(f.dir);
}

/* `info`'s fronts= (the endpoints in the order configured, on every endpoint), and the /metrics
 * families docs/service.md names, typed, each with a line per front labelled front="0", "1". */
static void test_info_and_metrics(void **state)
{
    (void)state;
    static fixture_t f; /* static: the teardown reaches it after a failed assertion */
    memset(&f, 0, sizeof f);
    start(&f, (const char *[]){"--metrics", "127.0.0.1:0", NULL});
    char want[512];
    snprintf(want, sizeof want, "\nfronts=%s,%s\n", f.front[0], f.front[1]);
    void *socks[CONNS];
    for (int c = 0; c < CONNS; c++) {
        socks[c] = connect_to(&f, c);
        tally_req_t req = th_req(TALLY_OP_INFO, TALLY_DTYPE_NONE, 1);
        th_reply_t r;
        assert_int_equal(th_call(socks[c], &req, NULL, 0, &r), 0);
        assert_int_equal(r.rep.status, TALLY_OK);
        assert_non_null(strstr((const char *)r.payload, want));
        th_reply_free(&r);
    }
    for (int i = 0; i < 3; i++) /* three pings on the second front */
        assert_int_equal(ping_status(socks[2], 10 + (uint64_t)i), TALLY_OK);
    const char *replies = "tallyd_front_replies_total{front=\"1\"}";
    /* counted once ZeroMQ took them: maybe a moment after they arrived */
    long long sent = metric_reaching(&f.d, replies, 4);
    assert_int_equal(sent, 4); /* the info and the pings */
    char *text = th_http_get(th_metrics_port(&f.d), "GET", "/metrics", NULL);
    assert_non_null(text);
    assert_non_null(strstr(text, "\ntallyd_fronts 2\n"));
    assert_non_null(strstr(text, "\n# TYPE tallyd_fronts gauge\n"));
    static const char *const counters[] = {
        "tallyd_front_requests_total", "tallyd_front_replies_total",
        "tallyd_front_replies_dropped_total", "tallyd_front_busy_waits_total"};
    for (int i = 0; i < 4; i++) {
        char line[160];
        snprintf(line, sizeof line, "\n# TYPE %s counter\n", counters[i]);
        assert_non_null(strstr(text, line));
        for (int k = 0; k < 2; k++) {
            snprintf(line, sizeof line, "\n%s{front=\"%d\"} ", counters[i], k);
            assert_non_null(strstr(text, line));
        }
    }
    free(text);
    assert_int_equal(th_metric(&f.d, "tallyd_front_requests_total{front=\"1\"}"), 4);
    assert_int_equal(th_metric(&f.d, "tallyd_front_requests_total{front=\"0\"}"), 1);
    assert_int_equal(th_metric(&f.d, "tallyd_front_replies_dropped_total{front=\"1\"}"), 0);
    assert_int_equal(th_metric(&f.d, "tallyd_front_busy_waits_total{front=\"1\"}"), 0);
    for (int c = 1; c < CONNS; c++)
        th_close(socks[c]);
    assert_int_equal(th_close_and_stop(socks[0], &f.d, 10000), 0);
    th_rmrf(f.dir);
}

/* A client that keeps sending pings on a front, reading what comes back, until told to stop. */
typedef struct {
    const char *endpoint;
    atomic_bool stop;
    atomic_long answered; /* replies read (the test reads it while the flood goes on) */
} flood_t;

static void *flood_main(void *arg)
{
    flood_t *fl = arg;
    void *sock = th_connect(fl->endpoint, TIMEOUT_MS);
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    tally_req_t req = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, 1);
    tally_req_encode(&req, header);
    th_reply_t r; /* connected: the flood's sends are taken from here on */
    if (th_call(sock, &req, NULL, 0, &r) == 0)
        th_reply_free(&r);
    while (!atomic_load(&fl->stop)) {
        for (int i = 0; i < 64; i++) /* EAGAIN (its queue full): the replies are read below */
            if (zmq_send(sock, header, sizeof header, ZMQ_DONTWAIT | ZMQ_SNDMORE) >= 0)
                zmq_send(sock, "", 0, ZMQ_DONTWAIT); /* a message's first frame taken: all */
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        while (zmq_msg_recv(&msg, sock, ZMQ_DONTWAIT) >= 0)
            if (!zmq_msg_more(&msg))
                atomic_fetch_add(&fl->answered, 1);
        zmq_msg_close(&msg);
    }
    th_close(sock);
    return NULL;
}

/* PROTOCOL.md §1 "Shutdown": reading ends at the drain deadline, on a front as on the bind, so a
 * client that keeps sending on a front cannot hold tallyd open past it: with --drain-ms 500 and
 * pings flooding a front from before the signal, tallyd exits 0 within a few seconds. */
static void test_drain_deadline_under_a_flood(void **state)
{
    (void)state;
    static fixture_t f; /* static: the teardown reaches it after a failed assertion */
    memset(&f, 0, sizeof f);
    start(&f, (const char *[]){"--drain-ms", "500", NULL});
    static flood_t fl;
    fl = (flood_t){.endpoint = f.front[0]};
    pthread_t flooder;
    assert_int_equal(pthread_create(&flooder, NULL, flood_main, &fl), 0);
    for (int64_t end = th_now_ms() + 10000; atomic_load(&fl.answered) < 1000 && th_now_ms() < end;)
        th_sleep_ms(10);
    assert_int_equal(kill(f.d.pid, SIGTERM), 0);
    int64_t signalled = th_now_ms();
    int rc = th_daemon_wait(&f.d, 20000);
    int64_t took = th_now_ms() - signalled;
    atomic_store(&fl.stop, true);
    pthread_join(flooder, NULL);
    assert_true(atomic_load(&fl.answered) >= 1000);
    assert_int_equal(rc, 0);
    if (took > 5000)
        fail_msg("tallyd took %lld ms to stop under a flood on a front (drain 500 ms)",
                 (long long)took);
    th_rmrf(f.dir);
}

static void test_refusals(void **state)
{
    (void)state;
    char dir[128], log[256], front[200];
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tallyd-fronts"), 0);
    snprintf(front, sizeof front, "ipc://%s/front.sock", dir);
    const char *one_shard[] = {"--shards", "1", "--front", front, NULL};
    assert_int_not_equal(th_run_refused(dir, one_shard, log, sizeof log, 20000), 0);
    assert_true(th_file_contains(log, "needs 2 shards or more"));
    char port[64];
    snprintf(port, sizeof port, "tcp://127.0.0.1:%d", th_free_port());
    const char *twice[] = {"--shards", "2", "--front", port, "--front", port, NULL};
    assert_int_not_equal(th_run_refused(dir, twice, log, sizeof log, 20000), 0);
    assert_true(th_file_contains(log, "cannot bind tcp://127.0.0.1:"));
    th_rmrf(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_order_and_state, kill_left),
        cmocka_unit_test_teardown(test_share_on_a_front, kill_left),
        cmocka_unit_test_teardown(test_max_inflight_across_fronts, kill_left),
        cmocka_unit_test_teardown(test_bind_woken_by_a_front, kill_left),
        cmocka_unit_test_teardown(test_drain_on_every_front, kill_left),
        cmocka_unit_test_teardown(test_curve_on_a_front, kill_left),
        cmocka_unit_test_teardown(test_shm_ref_on_a_front, kill_left),
        cmocka_unit_test_teardown(test_odd_peers_on_a_front, kill_left),
        cmocka_unit_test_teardown(test_reply_to_a_gone_peer, kill_left),
        cmocka_unit_test_teardown(test_sequence_on_a_front, kill_left),
        cmocka_unit_test_teardown(test_streams_across_endpoints, kill_left),
        cmocka_unit_test_teardown(test_bind_slots_hold_a_front, kill_left),
        cmocka_unit_test_teardown(test_drain_with_a_front_held, kill_left),
        cmocka_unit_test_teardown(test_malformed_on_a_front, kill_left),
        cmocka_unit_test_teardown(test_info_and_metrics, kill_left),
        cmocka_unit_test_teardown(test_drain_deadline_under_a_flood, kill_left),
        cmocka_unit_test_teardown(test_refusals, kill_left),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
