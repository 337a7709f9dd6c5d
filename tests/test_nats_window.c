/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_window.c — a partition's window under refusals (issue 32; PROTOCOL.md §13): one
 * worker whose windows hold two messages each (--nats-inflight 2, --nats-inflight-bytes 64K) and
 * whose tallyd reserves room for one scan reply at a time (--max-reply-bytes 40K: a scan of 4,000
 * i32 values may reply 32,000 bytes), so that a scan sent while another's reply is reserved or
 * held is answered `busy` and sent again (td_part_reply's retry, the step's resend), sometimes
 * behind a later message of its stream (the partition is then taken again from its checkpoint).
 * Scans carry from one request to the next, so a message applied twice, lost or out of order
 * shows in the carries: every message gets one OK reply whose carry-out is its stream's running
 * sum up to it, a last scan of each stream finds the sum of everything sent (each message applied
 * exactly once), and the worker counted its refused messages in tallyd_nats_resent_total.
 * Then a backlog of messages larger than half the window's bytes: taken one at a time, each
 * applied once; and more of them with the worker running, which name no Tally-Reply: their
 * replies' payloads are dropped where they are made, so only the queries' replies count in
 * tallyd_sent_bytes_total. Last, every run and not by luck of timing
 * (test_refused_behind_its_stream): a window whose scan of a stream is refused while a later
 * message of that stream is applied, so that the partition is dropped and taken again from its
 * checkpoint (order_broken), where the window's messages then go one at a time (the same refusals
 * would break it at every take), and such a backlog held by the transport at --max-inflight 1 (its
 * put-back), each message applied once. And where a backlog waits (issue 32's gauges,
 * test_backlog_gauges): a backlog of one stream on a simulated GPU whose every launch takes a
 * second shows its window's two messages in the request path (the whole window) and the other three
 * fetched for the fleet thread, in one scrape, then nothing in any once it is applied; the
 * exposition parsed by Prometheus's parser where python3 has it.
 */
#include <dirent.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <nats/nats.h>

#include "harness.h"
#include "nats_cluster.h"
#include "tally.h"
#include "tally_fleet.h"
#include "tally_proto.h"
#include "td_nats_ckpt.h"

#define PARTITIONS 4
#define STREAMS 12  /* streams of partitions 0 and 2 */
#define ROUNDS 3    /* scans on each */
#define VALUES 4000 /* i32 values of a scan: 16,000 bytes, a reply of up to 32,000 */
#define SENT (STREAMS * ROUNDS)

static char msg[512];
static char names[STREAMS][32];
static int64_t sum[STREAMS];     /* the model: each stream's carry */
static int64_t want_carry[SENT]; /* by request id - first: the carry-out it gets */
static th_daemon_t w;

/* STREAMS stream names, half of partition 0, half of partition 2. */
static void pick_names(void)
{
    int n = 0;
    for (int i = 0; n < STREAMS; i++) {
        char name[32];
        snprintf(name, sizeof name, "win%d/px", i);
        if (tally_partition(name, strlen(name), PARTITIONS) == (uint32_t)(n % 2) * 2)
            memcpy(names[n++], name, sizeof name);
    }
}

/* The worker: windows of inflight messages, and extra's options (NULL-terminated). */
static void start_worker_with(const char *inflight, const char *const *extra)
{
    const char *args[] = {"--metrics",
                          "127.0.0.1:0",
                          "--nats-servers",
                          tn_suite.urls,
                          "--nats-replicas",
                          "1",
                          "--nats-partitions",
                          "4",
                          "--nats-lease-ttl-ms",
                          "3000",
                          "--nats-checkpoint-interval-ms",
                          "200",
                          "--nats-member-id",
                          "win",
                          "--nats-inflight",
                          inflight,
                          "--nats-inflight-bytes",
                          "64K",
                          "--window-intervals",
                          "0",
                          NULL};
    assert_int_equal(th_daemon_start_with(&w, args, extra), 0);
}

static void start_worker(void)
{
    const char *extra[] = {"--max-reply-bytes", "40K", NULL};
    start_worker_with("2", extra);
}

/* A scan of n pseudo-random values (0..999) on stream name, added to its model *carry; its
 * request id. */
static uint64_t send_scan_to(tally_nats_t *p, const char *name, int64_t *carry, size_t n,
                             uint64_t *x)
{
    static int32_t values[VALUES];
    for (size_t j = 0; j < n; j++) {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        values[j] = (int32_t)((*x >> 32) % 1000);
        *carry += values[j];
    }
    tally_req_t req;
    memset(&req, 0, sizeof req);
    req.opcode = TALLY_OP_SCAN;
    req.dtype = TALLY_DTYPE_I32;
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    uint64_t id = 0;
    size_t chunks = 0;
    assert_int_equal(tally_nats_send(p, &req, values, n * sizeof *values, true, &id, &chunks),
                     TALLY_OK);
    assert_int_equal(chunks, 1);
    return id;
}

/* The same on stream i of names. */
static uint64_t send_scan(tally_nats_t *p, int i, size_t n, uint64_t *x)
{
    return send_scan_to(p, names[i], &sum[i], n, x);
}

/* Publishes frame to tally.in.0 (with a Tally-Reply to inbox and a Nats-Msg-Id when sub is
 * given); with sub, the reply's status. */
static uint32_t publish_frame(const uint8_t *frame, size_t len, natsSubscription *sub,
                              const char *inbox, const char *id)
{
    char subject[48]; /* the cluster has no users: every client is "anon" */
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, 0, TALLY_NATS_USER_ANON);
    assert_int_equal(tn_publish(tn_suite_js, subject, frame, (int)len, sub ? inbox : NULL, id),
                     NATS_OK);
    if (!sub)
        return TALLY_OK;
    natsMsg *r = NULL;
    assert_int_equal(natsSubscription_NextMsg(&r, sub, 20000), NATS_OK);
    tally_rep_t rep;
    assert_true(natsMsg_GetDataLength(r) >= (int)TALLY_REP_HEADER_SIZE);
    assert_int_equal(
        tally_rep_decode((const uint8_t *)natsMsg_GetData(r), TALLY_REP_HEADER_SIZE, &rep),
        TALLY_OK);
    natsMsg_Destroy(r);
    return rep.status;
}

/* Waits (10 s at most) until partition k's checkpoint holds every message its stream has now
 * (every 200 ms here): a give-up that finds a refused message in the window writes none, and
 * its next owner applies again, dead letters included, what came after the last one. */
static void checkpointed_to_end(uint32_t k)
{
    uint64_t end = 0;
    assert_int_equal(tn_partition_seqs(tn_suite_js, k, NULL, NULL, &end), 0);
    td_ckpt_manifest_t m = {0};
    for (int64_t t0 = th_now_ms(); th_now_ms() - t0 < 10000; th_sleep_ms(50)) {
        uint8_t *state = NULL;
        size_t len = 0;
        assert_int_equal(td_ckpt_read(tn_suite_js, k, &m, &state, &len, msg, sizeof msg), TD_OK);
        free(state);
        if (m.applied_seq >= end)
            return;
    }
    fail_msg("partition %u checkpointed at %llu, its stream ends at %llu", (unsigned)k,
             (unsigned long long)m.applied_seq, (unsigned long long)end);
}

/* Messages that fail PROTOCOL.md §13's checks before the request path (test_nats_worker has
 * the others): each is a dead letter with its status, answered with it when it asks for a
 * reply, and the partition goes on. */
static void poison(tally_nats_t *p)
{
    const char *inbox = TALLY_NATS_INBOX TALLY_NATS_USER_ANON ".window";
    natsSubscription *sub = NULL;
    assert_int_equal(natsConnection_SubscribeSync(&sub, tn_suite_nc, inbox), NATS_OK);
    size_t big = ((tally_nats_max_payload(p) - TALLY_NATS_HEADROOM) / 2 + 4096) & ~(size_t)3;
    uint8_t *buf = calloc(1, TALLY_REQ_HEADER_SIZE + big);
    assert_non_null(buf);
    tally_req_t req;
    memset(&req, 0, sizeof req);
    req.version = TALLY_PROTO_VERSION;
    req.opcode = TALLY_OP_SCAN;
    req.dtype = TALLY_DTYPE_I32;
    assert_int_equal(tally_req_set_stream(&req, names[0]), TALLY_OK);
    /* a scan whose i64 output would not fit a NATS message */
    tally_req_encode(&req, buf);
    assert_int_equal(publish_frame(buf, TALLY_REQ_HEADER_SIZE + big, sub, inbox, NULL),
                     TALLY_E_TOO_LARGE);
    /* the same zeros with an i32 output: its reply fits, and it is applied (the carry stays) */
    req.flags = TALLY_FLAG_SCAN_OUT_I32;
    tally_req_encode(&req, buf);
    assert_int_equal(publish_frame(buf, TALLY_REQ_HEADER_SIZE + big, sub, inbox, NULL), TALLY_OK);
    /* a shared-memory reference: no region travels over NATS */
    req.flags = TALLY_FLAG_SHM_REF;
    tally_req_encode(&req, buf);
    assert_int_equal(publish_frame(buf, TALLY_REQ_HEADER_SIZE + TALLY_SHM_REF_SIZE, sub, inbox,
                                   TALLY_NATS_USER_ANON ".window.ref"),
                     TALLY_E_BAD_REF);
    /* a payload of 6 bytes: not a whole number of i32 */
    req.flags = 0;
    tally_req_encode(&req, buf);
    assert_int_equal(publish_frame(buf, TALLY_REQ_HEADER_SIZE + 6, sub, inbox, NULL),
                     TALLY_E_PAYLOAD);
    /* a version tallyd does not speak, with no reply asked for */
    buf[4] = (uint8_t)(TALLY_PROTO_VERSION + 7);
    assert_int_equal(publish_frame(buf, TALLY_REQ_HEADER_SIZE + 4, NULL, NULL, NULL), TALLY_OK);
    free(buf);
    int64_t t0 = th_now_ms();
    while (th_metric(&w, "tallyd_nats_dead_letters_total") < 4 && th_now_ms() - t0 < 10000)
        th_sleep_ms(50);
    assert_int_equal(th_metric(&w, "tallyd_nats_dead_letters_total"), 4);
    const char *want[4] = {"too_large", "bad_ref", "bad_payload", "bad_version"};
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    assert_int_equal(js_GetStreamInfo(&si, tn_suite_js, "TALLY_DEAD", NULL, &jerr), NATS_OK);
    uint64_t last = si->State.LastSeq;
    jsStreamInfo_Destroy(si);
    for (int i = 0; i < 4; i++) {
        natsMsg *d = NULL;
        assert_int_equal(
            js_GetMsg(&d, tn_suite_js, "TALLY_DEAD", last - 3 + (uint64_t)i, NULL, &jerr), NATS_OK);
        const char *status = NULL, *part = NULL;
        assert_int_equal(natsMsgHeader_Get(d, TALLY_NATS_HDR_STATUS, &status), NATS_OK);
        assert_int_equal(natsMsgHeader_Get(d, TALLY_NATS_HDR_PARTITION, &part), NATS_OK);
        assert_string_equal(status, want[i]);
        assert_string_equal(part, "0");
        natsMsg_Destroy(d);
    }
    /* the partition goes on: a scan of stream 0 still carries its sum */
    uint64_t x0 = 0;
    uint64_t id = send_scan(p, 0, 1, &x0);
    assert_int_equal(tally_nats_flush(p), TALLY_OK);
    tally_reply_t reply;
    tally_reply_init(&reply);
    assert_int_equal(tally_nats_recv(p, 20000, &reply), TALLY_OK);
    assert_int_equal(reply.rep.request_id, id);
    assert_int_equal((int64_t)reply.rep.aux0, sum[0]);
    tally_reply_clear(&reply);
    natsSubscription_Destroy(sub);
}

/* count hists of bytes each on the first stream prefix<i> of partition k (its name in name), to
 * tally.in.<k> with no reply asked for: the length of each message. */
static size_t publish_hists(const char *prefix, uint32_t k, size_t bytes, int count, char name[32])
{
    for (int i = 0;; i++) {
        snprintf(name, 32, "%s%d", prefix, i);
        if (tally_partition(name, strlen(name), PARTITIONS) == k)
            break;
    }
    size_t len = TALLY_REQ_HEADER_SIZE + bytes;
    uint8_t *frame = malloc(len);
    assert_non_null(frame);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    tally_req_encode(&req, frame);
    memset(frame + TALLY_REQ_HEADER_SIZE, 9, bytes);
    char subject[48]; /* the cluster has no users: every client is "anon" */
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, k, TALLY_NATS_USER_ANON);
    for (int i = 0; i < count; i++)
        assert_int_equal(tn_publish(tn_suite_js, subject, frame, (int)len, NULL, NULL), NATS_OK);
    free(frame);
    return len;
}

/* Stream name's record, asked on sock until it holds `batches` batches (or 20 s passed); each
 * reply's payload bytes added to *sent. */
static tally_stream_info_t await_batches(void *sock, const char *name, uint64_t batches,
                                         uint64_t *sent)
{
    tally_req_t query = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, 1);
    assert_int_equal(tally_req_set_stream(&query, name), TALLY_OK);
    tally_stream_info_t info;
    memset(&info, 0, sizeof info);
    for (int64_t until = th_now_ms() + 20000; info.batches < batches && th_now_ms() < until;) {
        th_reply_t r = {0};
        int st = th_call_reply_status(sock, &query, NULL, 0, &r);
        assert_true(st >= 0);
        *sent += r.len;
        if (st == TALLY_OK)
            assert_int_equal(tally_stream_info_decode(r.payload, r.len, &info), TALLY_OK);
        th_reply_free(&r);
        if (info.batches < batches)
            th_sleep_ms(50);
    }
    return info;
}

/* A backlog of hist messages of 40,000 bytes each on a stream of partition 0, published while
 * no worker runs: two do not fit the window's 64 KiB (--nats-inflight-bytes), so the worker
 * started then takes them one at a time (one message always goes), each applied once. Then
 * more of them with the worker running: none names a Tally-Reply, so none is answered, and
 * their replies' payloads (2 KiB of counts each) are dropped where they are made: only the
 * queries' replies count in tallyd_sent_bytes_total meanwhile. */
static void big_backlog(void)
{
    enum { BIG = 40000, BACKLOG = 3, MORE = 4 };
    char name[32];
    publish_hists("winbig", 0, BIG, BACKLOG, name);
    start_worker();
    void *sock = th_connect(w.endpoint, 10000);
    assert_non_null(sock);
    uint64_t sent = 0;
    tally_stream_info_t info = await_batches(sock, name, BACKLOG, &sent);
    assert_int_equal(info.batches, BACKLOG);
    assert_int_equal(info.hist_total, (uint64_t)BACKLOG * BIG);
    long long before = th_metric(&w, "tallyd_sent_bytes_total");
    assert_true(before >= 0);
    sent = 0;
    publish_hists("winbig", 0, BIG, MORE, name);
    info = await_batches(sock, name, BACKLOG + MORE, &sent);
    th_close(sock);
    assert_int_equal(info.batches, BACKLOG + MORE);
    long long after = -1;
    for (int64_t until = th_now_ms() + 5000;
         (after = th_metric(&w, "tallyd_sent_bytes_total")) != before + (long long)sent &&
         th_now_ms() < until;)
        th_sleep_ms(50);
    assert_int_equal(after, before + (long long)sent);
    assert_int_equal(th_metric(&w, "tallyd_nats_dead_letters_total"), 0);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

static void test_refused_messages_applied_once(void **state)
{
    (void)state;
    pick_names();
    start_worker();
    int held = 0;
    assert_true(tn_wait_leases(tn_suite_js, PARTITIONS, "win", PARTITIONS, 20000, &held) >= 0);
    assert_int_equal(held, PARTITIONS);
    tally_nats_opts_t o = {.servers = tn_suite.urls, .producer_id = "window", .timeout_ms = 15000};
    tally_nats_t *p = NULL;
    assert_int_equal(tally_nats_new(&o, &p, msg, sizeof msg), TALLY_OK);
    uint64_t x = th_rand() | 1, first = 0;
    int64_t t0 = th_now_ms();
    for (int r = 0; r < ROUNDS; r++)
        for (int i = 0; i < STREAMS; i++) {
            uint64_t id = send_scan(p, i, VALUES, &x);
            if (r == 0 && i == 0)
                first = id;
            assert_true(id - first < SENT);
            want_carry[id - first] = sum[i];
        }
    assert_int_equal(tally_nats_flush(p), TALLY_OK);
    bool got[SENT] = {false};
    for (int n = 0; n < SENT; n++) {
        tally_reply_t reply;
        tally_reply_init(&reply);
        assert_int_equal(tally_nats_recv(p, 20000, &reply), TALLY_OK);
        assert_int_equal(reply.rep.status, TALLY_OK);
        uint64_t k = reply.rep.request_id - first;
        assert_true(k < SENT);
        assert_false(got[k]); /* one reply each */
        got[k] = true;
        assert_int_equal(reply.rep.count, VALUES);
        assert_int_equal((int64_t)reply.rep.aux0, want_carry[k]); /* in order, once */
        /* asked for: the sums themselves, the last one the carry-out (an inclusive scan) */
        assert_int_equal(reply.len, VALUES * sizeof(int64_t));
        assert_int_equal((int64_t)tally_get_u64(reply.payload + reply.len - 8), want_carry[k]);
        tally_reply_clear(&reply);
    }
    int64_t took = th_now_ms() - t0;
    tally_reply_t extra;
    tally_reply_init(&extra);
    assert_int_equal(tally_nats_recv(p, 300, &extra), TALLY_E_TIMEOUT);
    /* a last scan of one zero on each stream: its carry-out is everything applied there */
    for (int i = 0; i < STREAMS; i++) {
        uint64_t x0 = 0; /* the generator at 0 stays 0: the value is 0 */
        uint64_t id = send_scan(p, i, 1, &x0);
        assert_int_equal(tally_nats_flush(p), TALLY_OK);
        tally_reply_t reply;
        tally_reply_init(&reply);
        assert_int_equal(tally_nats_recv(p, 20000, &reply), TALLY_OK);
        assert_int_equal(reply.rep.request_id, id);
        assert_int_equal(reply.rep.status, TALLY_OK);
        if ((int64_t)reply.rep.aux0 != sum[i])
            fail_msg("%s carries %lld, the model %lld", names[i], (long long)reply.rep.aux0,
                     (long long)sum[i]);
        tally_reply_clear(&reply);
    }
    long long resent = th_metric(&w, "tallyd_nats_resent_total");
    print_message("%d scans on %d streams applied in %lld ms; %lld answered busy and sent again\n",
                  SENT, STREAMS, (long long)took, resent);
    assert_true(resent > 0);
    assert_true(th_metric(&w, "tallyd_nats_applied_total") >= SENT + STREAMS);
    assert_int_equal(th_metric(&w, "tallyd_nats_dead_letters_total"), 0);
    poison(p);
    checkpointed_to_end(0);
    /* stopped with scans queued: those refused `shutdown` are the next owner's, each applied
     * once (the worker started again finds every carry equal to the model) */
    for (int i = 0; i < STREAMS; i++)
        send_scan(p, i, VALUES, &x);
    assert_int_equal(tally_nats_flush(p), TALLY_OK);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
    start_worker();
    assert_true(tn_wait_leases(tn_suite_js, PARTITIONS, "win", PARTITIONS, 20000, &held) >= 0);
    uint64_t final = 0;
    for (int i = 0; i < STREAMS; i++) {
        uint64_t x0 = 0, id = send_scan(p, i, 1, &x0);
        if (i == 0)
            final = id;
    }
    assert_int_equal(tally_nats_flush(p), TALLY_OK);
    int64_t last[STREAMS];
    bool seen[2 * STREAMS] = {false}; /* the queued scans' replies, then the last ones' */
    int left = STREAMS;
    while (left > 0) {
        tally_reply_t reply;
        tally_reply_init(&reply);
        assert_int_equal(tally_nats_recv(p, 20000, &reply), TALLY_OK);
        assert_int_equal(reply.rep.status, TALLY_OK);
        uint64_t k = reply.rep.request_id - (final - STREAMS);
        assert_true(k < 2 * STREAMS);
        assert_false(seen[k]); /* one reply each */
        seen[k] = true;
        if (k >= STREAMS) {
            last[k - STREAMS] = (int64_t)reply.rep.aux0;
            left--;
        }
        tally_reply_clear(&reply);
    }
    for (int i = 0; i < STREAMS; i++)
        if (last[i] != sum[i])
            fail_msg("%s carries %lld after the restart, the model %lld", names[i],
                     (long long)last[i], (long long)sum[i]);
    assert_int_equal(th_metric(&w, "tallyd_nats_dead_letters_total"), 0);
    tally_nats_destroy(&p);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
    big_backlog();
}

/* The next reply: OK, to one of the n requests of ids not answered before (got), with the
 * carry-out want gives it. */
static void recv_carry(tally_nats_t *p, const uint64_t *ids, const int64_t *want, bool *got, int n)
{
    tally_reply_t reply;
    tally_reply_init(&reply);
    assert_int_equal(tally_nats_recv(p, 20000, &reply), TALLY_OK);
    assert_int_equal(reply.rep.status, TALLY_OK);
    int k = 0;
    while (k < n && ids[k] != reply.rep.request_id)
        k++;
    assert_true(k < n);
    assert_false(got[k]); /* one reply each */
    got[k] = true;
    assert_int_equal((int64_t)reply.rep.aux0, want[k]);
    tally_reply_clear(&reply);
}

/* Publishes, while no worker runs, a backlog of partition 1 (no other test writes there) that a
 * worker takes into one window (--nats-inflight 3) and sends to the request path in one batch:
 * X0, a scan of stream t (4,000 values: a 32,000-byte reply); X1, a scan of stream s (4,000
 * values); X2, a scan of one value of s. ids and want: each one's request id and carry-out. */
static void publish_backlog(tally_nats_t *p, char two[2][32], int64_t carry[2], uint64_t *x,
                            uint64_t ids[3], int64_t want[3])
{
    uint64_t x0 = 0;
    for (int i = 0; i < 3; i++) { /* flushed one by one: stored in this order */
        ids[i] = send_scan_to(p, two[i > 0], &carry[i > 0], i < 2 ? VALUES : 1, i < 2 ? x : &x0);
        want[i] = carry[i > 0];
        assert_int_equal(tally_nats_flush(p), TALLY_OK);
    }
}

/* Three replies, one to each of ids, OK with its carry-out, and none more within 300 ms. */
static void recv_three(tally_nats_t *p, const uint64_t ids[3], const int64_t want[3])
{
    bool got[3] = {false};
    for (int n = 0; n < 3; n++)
        recv_carry(p, ids, want, got, 3);
    tally_reply_t extra;
    tally_reply_init(&extra);
    assert_int_equal(tally_nats_recv(p, 300, &extra), TALLY_E_TIMEOUT);
}

/* The backlog above at one shard with --max-reply-bytes 40K: X0's reply is reserved or held
 * until the fleet thread has taken it, so X1 would pass the bound beside it and is answered
 * `busy` (no effect), and X2, whose 8 bytes fit, is applied: s's order is broken (order_broken)
 * and the partition dropped with its local state. The same refusals would break it again at
 * every take, and X1 and X2 would never be answered; the worker takes it again (after the take
 * back-off) and sends what its window held one at a time: each message applied once, in order,
 * answered once (X0's maybe already before the drop: the client drops a second). Then a second
 * backlog, started without the bound at --max-inflight 1 on two shards: the transport holds X1
 * and X2 until X0 is answered, then sends them (its put-back), none refused. */
static void test_refused_behind_its_stream(void **state)
{
    (void)state;
    char two[2][32]; /* t, s */
    for (int i = 0, n = 0; n < 2; i++) {
        snprintf(two[n], sizeof two[n], "winorder%d", i);
        n += tally_partition(two[n], strlen(two[n]), PARTITIONS) == 1;
    }
    tally_nats_opts_t o = {
        .servers = tn_suite.urls, .producer_id = "winorder", .timeout_ms = 15000};
    tally_nats_t *p = NULL;
    assert_int_equal(tally_nats_new(&o, &p, msg, sizeof msg), TALLY_OK);
    int64_t carry[2] = {0, 0}, want[3];
    uint64_t x = th_rand() | 1, x0 = 0, ids[3];
    publish_backlog(p, two, carry, &x, ids, want);
    const char *bound[] = {"--max-reply-bytes", "40K", "--shards", "1", NULL};
    start_worker_with("3", bound);
    assert_true(th_daemon_wait_log(
        &w, "partition 1 lost: a message was applied before a refused one of its stream", 20000));
    assert_true(th_metric(&w, "tallyd_nats_resent_total") >= 1);
    recv_three(p, ids, want); /* the take after the back-off: one at a time */
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
    publish_backlog(p, two, carry, &x, ids, want);
    const char *held[] = {"--max-inflight", "1", "--shards", "2", NULL};
    start_worker_with("3", held);
    recv_three(p, ids, want);
    for (int i = 0; i < 2; i++) { /* a scan of one zero: everything applied on the stream, once */
        uint64_t id = send_scan_to(p, two[i], &carry[i], 1, &x0);
        bool once = false;
        assert_int_equal(tally_nats_flush(p), TALLY_OK);
        recv_carry(p, &id, &carry[i], &once, 1);
    }
    assert_int_equal(th_metric(&w, "tallyd_nats_resent_total"), 0);
    tally_nats_destroy(&p);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

/* Whether a thread of pid has the name `name` (its libnats threads are named after their
 * connection's role: td_fleet_connect). */
static bool has_thread(pid_t pid, const char *name)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
    DIR *dir = opendir(path);
    bool found = false;
    for (struct dirent *e; dir && !found && (e = readdir(dir));) {
        char comm[32] = "", task[sizeof path + sizeof e->d_name + 8];
        snprintf(task, sizeof task, "%s/%s/comm", path, e->d_name);
        FILE *f = e->d_name[0] == '.' ? NULL : fopen(task, "r");
        if (f && fgets(comm, sizeof comm, f)) {
            comm[strcspn(comm, "\n")] = 0;
            found = strcmp(comm, name) == 0;
        }
        if (f)
            fclose(f);
    }
    if (dir)
        closedir(dir);
    return found;
}

/* The value of the sample "NAME VALUE" of a /metrics body (name with its labels); -1 if absent. */
static long long sample_of(const char *body, const char *name)
{
    size_t n = strlen(name);
    for (const char *at = body; at && (at = strstr(at, name)) != NULL; at += n)
        if ((at == body || at[-1] == '\n') && at[n] == ' ')
            return strtoll(at + n + 1, NULL, 10);
    return -1;
}

/* Partition k's gauges of kind ("in_path", "in_path_bytes", "fetched", "lag") from body. */
static long long gauge_of(const char *body, const char *kind, uint32_t k)
{
    char name[96];
    snprintf(name, sizeof name, "tallyd_nats_partition_%s{partition=\"%u\"}", kind, (unsigned)k);
    return sample_of(body, name);
}

/* A backlog of BACKLOG hists of 1,000 bytes on one stream of partition 3 (no other test writes
 * there), published while no worker runs; the worker's window holds 2 (--nats-inflight 2) and
 * each simulated launch takes 1 s (--backend cuda: every batch on the GPU). The reader fetches
 * all of them at once, the window sends two to the path (the first running, the second behind it
 * in its stream's order) and holds the third for room: for the first second, one scrape shows 2
 * in the path with their bytes, 3 fetched and waiting for the fleet thread, and all 5 as lag.
 * Two more published then count in the lag as soon as they are fetched, long before the fleet
 * thread takes them. Once every message is applied, 0 in each. */
static void test_backlog_gauges(void **state)
{
    (void)state;
    enum { BACKLOG = 5, BYTES = 1000 };
    const uint32_t k = 3;
    char name[32];
    size_t len = publish_hists("wingauge", k, BYTES, BACKLOG, name);
    const char *sim[] = {"--backend", "cuda", "--test-sim-gpus", "1", NULL};
    setenv("TALLYD_TEST_SIM_LATENCY_US", "1000000", 1);
    start_worker_with("2", sim);
    unsetenv("TALLYD_TEST_SIM_LATENCY_US");
    int port = th_metrics_port(&w);
    assert_true(port > 0);
    long long window = -1, in_path = -1, bytes = -1, fetched = -1, lag = -1;
    bool held = false;
    for (int64_t until = th_now_ms() + 20000; !held && th_now_ms() < until; th_sleep_ms(10)) {
        char *body = th_http_get(port, "GET", "/metrics", NULL);
        if (!body)
            continue;
        window = gauge_of(body, "window", k);
        in_path = gauge_of(body, "in_path", k);
        bytes = gauge_of(body, "in_path_bytes", k);
        fetched = gauge_of(body, "fetched", k);
        lag = gauge_of(body, "lag", k);
        free(body);
        held = in_path == 2 && fetched == BACKLOG - 2;
    }
    print_message("held: window %lld, in_path %lld (%lld bytes), fetched %lld, lag %lld\n", window,
                  in_path, bytes, fetched, lag);
    assert_true(held);
    /* The reader's connection, made on the fleet thread at the take, names its libnats threads
     * after itself: a profile tells them from the fleet thread. */
    char reader[16];
    snprintf(reader, sizeof reader, "nats/reader-%u", (unsigned)k);
    assert_true(has_thread(w.pid, reader));
    assert_true(has_thread(w.pid, "tdfleet"));
    assert_int_equal(window, 2);
    assert_int_equal(bytes, 2 * (long long)len);
    assert_int_equal(lag, BACKLOG);
    /* MORE published now: the lag counts them once the reader has fetched them, while the fleet
     * thread still waits for room (it takes the first of them about 3 s later, one launch per
     * second). Here lag + applied_total is every message published. */
    enum { MORE = 2 };
    publish_hists("wingauge", k, BYTES, MORE, name);
    long long seen = -1;
    for (int64_t until = th_now_ms() + 2000; seen != BACKLOG + MORE && th_now_ms() < until;
         th_sleep_ms(10)) {
        char *body = th_http_get(port, "GET", "/metrics", NULL);
        if (!body)
            continue;
        seen = gauge_of(body, "lag", k) + sample_of(body, "tallyd_nats_applied_total");
        free(body);
    }
    assert_int_equal(seen, BACKLOG + MORE);
    char lag_name[64];
    snprintf(lag_name, sizeof lag_name, "tallyd_nats_partition_lag{partition=\"%u\"}", (unsigned)k);
    for (int64_t until = th_now_ms() + 20000; th_metric(&w, lag_name) != 0 && th_now_ms() < until;)
        th_sleep_ms(50);
    char *body = th_http_get(port, "GET", "/metrics", NULL);
    assert_non_null(body);
    assert_int_equal(gauge_of(body, "lag", k), 0);
    assert_int_equal(gauge_of(body, "window", k), 0);
    assert_int_equal(gauge_of(body, "in_path", k), 0);
    assert_int_equal(gauge_of(body, "in_path_bytes", k), 0);
    assert_int_equal(gauge_of(body, "fetched", k), 0);
    assert_int_equal(sample_of(body, "tallyd_nats_inflight_limit"), 2);
    assert_int_equal(sample_of(body, "tallyd_nats_inflight_limit_bytes"), 64 << 10);
    free(body);
    /* A checkpoint after the backlog: its time and its drain's are counted. */
    for (int64_t until = th_now_ms() + 20000;
         th_metric(&w, "tallyd_nats_checkpoints_total") < 1 && th_now_ms() < until;)
        th_sleep_ms(50);
    assert_true(th_metric(&w, "tallyd_nats_checkpoints_total") >= 1);
    /* The first python3 with prometheus_client: PATH's may be another than Debian's. */
    int rc = th_sh("py=$(for c in python3 /usr/bin/python3; do $c -c 'import prometheus_client' "
                   "2>/dev/null && echo $c && break; done); [ -n \"$py\" ] || exit 77; curl -sf "
                   "http://127.0.0.1:%d/metrics | $py -c 'import sys\n"
                   "from prometheus_client.parser import text_string_to_metric_families as p\n"
                   "f = {m.name: m for m in p(sys.stdin.read())}\n"
                   "names = [\"tallyd_nats_partition_\" + n for n in "
                   "(\"lag\", \"window\", \"in_path\", \"in_path_bytes\", \"fetched\")]\n"
                   "ok = all(f[n].type == \"gauge\" and len(f[n].samples) == 4 for n in names)\n"
                   "ok = ok and f[\"tallyd_nats_inflight_limit\"].samples[0].value == 2\n"
                   "c = [f[\"tallyd_nats_checkpoint_\" + n] for n in (\"seconds\", "
                   "\"drain_seconds\")]\n"
                   "ok = ok and all(m.type == \"counter\" and m.samples[0].value > 0 for m in c)\n"
                   "sys.exit(0 if ok else 1)'",
                   port);
    if (rc == 77)
        print_message("no prometheus_client: the exposition is not parsed\n");
    else
        assert_int_equal(rc, 0);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

static int setup(void **state)
{
    (void)state;
    return tn_suite_setup(1);
}

/* After each test: its worker ends, whatever the test did (a failed one leaves it running,
 * and the next test's worker would share the partitions with it). */
static int end_worker(void **state)
{
    (void)state;
    th_daemon_end(&w);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    th_daemon_end(&w);
    return tn_suite_teardown();
}

int main(void)
{
    if (tn_skip())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_refused_messages_applied_once, end_worker),
        cmocka_unit_test_teardown(test_refused_behind_its_stream, end_worker),
        cmocka_unit_test_teardown(test_backlog_gauges, end_worker),
    };
    int failed = cmocka_run_group_tests(tests, setup, teardown);
    nats_Close();
    return failed;
}
