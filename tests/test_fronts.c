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
 *   - CURVE: a front takes an allowed key's requests and nothing from a plain socket;
 *   - a shared-memory reference on a front resolves against its routing id's regions (the same
 *     counts as the bytes sent), and another connection's reference to it is `bad_ref`;
 *   - odd peers on a front, as on the bind: a REQ socket's envelope (its empty delimiter echoed)
 *     and a message of too many frames (answered `frames`, its extra frames dropped); a reply
 *     whose connection has gone is dropped and counted (tallyd_front_replies_dropped_total);
 *   - refusals: a front with one shard, a front on an endpoint already bound.
 */
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
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
    long long inflight = 0;
    for (int64_t end = th_now_ms() + 2000; inflight < 1 && th_now_ms() < end; th_sleep_ms(100))
        inflight = th_metric(&f.d, "tallyd_requests_in_flight");
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
    long long inflight = 0; /* both launched: the slots are the front's */
    for (int64_t end = th_now_ms() + 5000; inflight < 2 && th_now_ms() < end; th_sleep_ms(5))
        inflight = th_metric(&f->d, "tallyd_requests_in_flight");
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
    th_use_curve(NULL, NULL, NULL);
    void *plain = th_dealer(1500); /* no CURVE: the handshake never completes, nothing is read */
    assert_int_equal(zmq_connect(plain, f.front[1]), 0);
    assert_int_equal(ping_status(plain, 3), -1);
    th_close(plain);
    /* ping, hist and this stats request itself */
    assert_int_equal(th_stat(alice, "tallyd_front_requests_total{front=\"0\"}"), 3);
    assert_int_equal(th_stat(alice, "tallyd_front_requests_total{front=\"1\"}"), 0);
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
    long long inflight = 0; /* taken: its reply is 300 ms away */
    for (int64_t end = th_now_ms() + 5000; inflight < 1 && th_now_ms() < end; th_sleep_ms(5))
        inflight = th_metric(&f.d, "tallyd_requests_in_flight");
    assert_int_equal(inflight, 1);
    th_close(gone);
    long long dropped = 0;
    const char *name = "tallyd_front_replies_dropped_total{front=\"0\"}";
    for (int64_t end = th_now_ms() + 10000; dropped < 1 && th_now_ms() < end; th_sleep_ms(50))
        dropped = th_metric(&f.d, name);
    assert_int_equal(dropped, 1);
    void *sock = connect_to(&f, 1); /* the front serves on */
    send_hists(sock, 2, 1);
    assert_int_equal(replies_with(sock, 2, 1, TALLY_OK, TALLY_OK), 1);
    assert_int_equal(th_close_and_stop(sock, &f.d, 10000), 0);
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
        cmocka_unit_test_teardown(test_refusals, kill_left),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
