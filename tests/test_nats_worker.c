/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_worker.c — tallyd as a fleet worker ([nats] settings, daemon/nats/td_fleet*.c)
 * against a real JetStream server, driven by libtally's producer (PROTOCOL.md §13):
 *   - the worker takes every partition, applies published hist and scan requests in order
 *     (scan carries across requests), answers on the reply subject, once per request, and
 *     answers queries and `streams` by request-reply;
 *   - poison messages (a short frame, a stream of another partition, a query on the ingest
 *     subject, a hist against the stream's histogram) reach the dead letters with their reason,
 *     get an error reply, and do not stop the partition;
 *   - stopped with SIGTERM it checkpoints and releases; another worker resumes from there and
 *     answers the same records;
 *   - two workers share the partitions; kill -9 of one: the other takes its partitions within the
 *     lease TTL and a few seconds, and every stream equals a model that applied each message
 *     once, duplicates published on purpose included;
 *   - at max_inflight the worker's requests wait, in order, through the loop thread and through
 *     a port (4 shards: the fleet thread hands them to the shards itself);
 *   - a partition lost while the request path is full (max_inflight): the worker deletes its
 *     local copy before it takes the partition again, so nothing after the checkpoint is
 *     applied twice;
 *   - a request the request path does not take is answered by the transport: `shutdown` once
 *     the path has closed (tallyd stopping; the partition's messages left to the next owner),
 *     `busy` when the path has no memory for it (a build with allocation-failure hooks);
 *   - [nats] members_per_process = 2: one tallyd is two members that split the partitions,
 *     apply every request once, and hand them over at SIGTERM like any worker;
 *   - protected mode: a NATS server off the loopback without credentials is refused at start.
 */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cmocka.h>
#include <nats/nats.h>
#include <zmq.h>

#include "harness.h"
#include "nats_cluster.h"
#include "tally.h"
#include "tally_fleet.h"
#include "td_fleet_plan.h"
#include "td_nats_ckpt.h"
#include "td_nats_js.h"
#include "td_nats_lease.h"

#define PARTITIONS 4
#define TTL_MS 3000
#define STREAMS 24

#define cluster tn_suite
#define nc tn_suite_nc
#define js tn_suite_js
static char msg[512];
/* The model: each stream's running u8 histogram as the worker should hold it. */
static uint64_t model[STREAMS][256];
static uint64_t model_total[STREAMS];

static int setup(void **state)
{
    (void)state;
    if (tn_suite_setup(1) != 0)
        return -1;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    return tn_suite_teardown();
}

static void start_worker_with(th_daemon_t *d, const char *member, const char *const *extra);

static void start_worker(th_daemon_t *d, const char *member)
{
    start_worker_with(d, member, NULL);
}

static void start_worker_on(th_daemon_t *d, const char *urls, const char *member,
                            const char *const *extra);

static void start_worker_with(th_daemon_t *d, const char *member, const char *const *extra)
{
    start_worker_on(d, cluster.urls, member, extra);
}

/* A worker of the fleet on the NATS servers urls (the suite's cluster, or a test's own). */
static void start_worker_on(th_daemon_t *d, const char *urls, const char *member,
                            const char *const *extra)
{
    const char *args[] = {"--metrics",
                          "127.0.0.1:0",
                          "--nats-servers",
                          urls,
                          "--nats-replicas",
                          "1",
                          "--nats-partitions",
                          "4",
                          "--nats-lease-ttl-ms",
                          "3000",
                          "--nats-checkpoint-interval-ms",
                          "200",
                          "--nats-member-id",
                          member,
                          "--window-intervals",
                          "0",
                          NULL};
    assert_int_equal(th_daemon_start_with(d, args, extra), 0);
}

/* The worker's `info` text, asked by NATS request-reply (tally.ctl); malloc'ed. */
static char *fleet_info(tally_nats_t *p)
{
    tally_req_t req;
    memset(&req, 0, sizeof req);
    req.opcode = TALLY_OP_INFO;
    tally_reply_t reply;
    tally_reply_init(&reply);
    assert_int_equal(tally_nats_call(p, &req, NULL, 0, &reply), TALLY_OK);
    char *text = strndup((const char *)reply.payload, reply.len);
    tally_reply_clear(&reply);
    assert_non_null(text);
    return text;
}

/* Waits until `count` partitions are held by member (NULL: by anyone); the time it took. */
static int64_t wait_owned(const char *member, int count, int timeout_ms)
{
    int held = 0;
    int64_t took = tn_wait_leases(js, PARTITIONS, member, count, timeout_ms, &held);
    assert_int_equal(held, count);
    return took;
}

static tally_nats_t *producer_on(const char *urls, const char *id)
{
    tally_nats_opts_t o = {.servers = urls, .producer_id = id, .timeout_ms = 15000};
    tally_nats_t *p = NULL;
    assert_int_equal(tally_nats_new(&o, &p, msg, sizeof msg), TALLY_OK);
    return p;
}

static tally_nats_t *producer(const char *id)
{
    return producer_on(cluster.urls, id);
}

static void stream_name(char *buf, size_t cap, int i)
{
    snprintf(buf, cap, "cam%d/px", i);
}

/* Sends `rounds` hist batches to every stream (recorded in the model), their bytes drawn from
 * seed (the same seed, the same messages); with replies, reads them all and checks each batch's
 * histogram. */
/* rounds of one u8 hist of `size` random bytes on every stream, kept in the model. */
static void push_hists_of(tally_nats_t *p, int rounds, bool want_reply, uint64_t seed, size_t size)
{
    uint8_t *batch = malloc(size);
    assert_non_null(batch);
    int sent = 0;
    uint64_t x = seed | 1;
    for (int r = 0; r < rounds; r++)
        for (int i = 0; i < STREAMS; i++) {
            for (size_t j = 0; j < size; j++) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                batch[j] = (uint8_t)(x >> 32);
            }
            char name[32];
            stream_name(name, sizeof name, i);
            tally_req_t req;
            memset(&req, 0, sizeof req);
            req.opcode = TALLY_OP_HIST;
            req.dtype = TALLY_DTYPE_U8;
            assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
            assert_int_equal(tally_nats_send(p, &req, batch, size, want_reply, NULL, NULL),
                             TALLY_OK);
            for (size_t j = 0; j < size; j++)
                model[i][batch[j]]++;
            model_total[i] += size;
            sent++;
        }
    assert_int_equal(tally_nats_flush(p), TALLY_OK);
    for (int n = 0; want_reply && n < sent; n++) {
        tally_reply_t reply;
        tally_reply_init(&reply);
        assert_int_equal(tally_nats_recv(p, 20000, &reply), TALLY_OK);
        assert_int_equal(reply.rep.count, 256);
        assert_int_equal(reply.rep.aux0, size);
        tally_reply_clear(&reply);
    }
    free(batch);
}

static void push_hists(tally_nats_t *p, int rounds, bool want_reply, uint64_t seed)
{
    push_hists_of(p, rounds, want_reply, seed, 1000);
}

/* Every stream's record equals the model. */
static void check_model(tally_nats_t *p)
{
    for (int i = 0; i < STREAMS; i++) {
        char name[32];
        stream_name(name, sizeof name, i);
        tally_stream_info_t info;
        assert_int_equal(tally_nats_query(p, name, &info), TALLY_OK);
        assert_int_equal(info.hist_total, model_total[i]);
        for (int b = 0; b < 256; b++)
            if (info.bins[b] != model[i][b])
                fail_msg("%s bin %d: %llu, model %llu", name, b, (unsigned long long)info.bins[b],
                         (unsigned long long)model[i][b]);
    }
}

/* After push_hists with replies: nothing more comes (each request's reply came once), every
 * stream equals the model, and `streams` lists every stream. */
static void check_answered_once(tally_nats_t *p)
{
    tally_reply_t reply;
    tally_reply_init(&reply);
    assert_int_equal(tally_nats_recv(p, 500, &reply), TALLY_E_TIMEOUT);
    check_model(p);
    char **names = NULL;
    size_t count = 0;
    assert_int_equal(tally_nats_streams(p, &names, &count), TALLY_OK);
    assert_int_equal(count, STREAMS);
    tally_strings_free(names, count);
}

static void test_apply_reply_query(void **state)
{
    (void)state;
    th_daemon_t w;
    start_worker(&w, "w1");
    wait_owned("w1", PARTITIONS, 20000);
    tally_nats_t *p = producer("apply");
    push_hists(p, 2, true, th_rand());
    check_answered_once(p);
    tally_reply_t reply;
    tally_reply_init(&reply);

    /* Scan on a stream carries from one request to the next. */
    tally_req_t scan;
    memset(&scan, 0, sizeof scan);
    scan.opcode = TALLY_OP_SCAN;
    scan.dtype = TALLY_DTYPE_I32;
    assert_int_equal(tally_req_set_stream(&scan, "carry"), TALLY_OK);
    int32_t x[4] = {1, 2, 3, 4};
    uint64_t first = 0;
    assert_int_equal(tally_nats_send(p, &scan, x, sizeof x, true, &first, NULL), TALLY_OK);
    assert_int_equal(tally_nats_send(p, &scan, x, sizeof x, true, NULL, NULL), TALLY_OK);
    assert_int_equal(tally_nats_flush(p), TALLY_OK);
    for (int n = 0; n < 2; n++) {
        assert_int_equal(tally_nats_recv(p, 20000, &reply), TALLY_OK);
        bool second = reply.rep.request_id == first + 1;
        assert_int_equal((int64_t)reply.rep.aux0, second ? 20 : 10);
        assert_int_equal((int64_t)tally_get_u64(reply.payload + 24), second ? 20 : 10);
        tally_reply_clear(&reply);
    }
    /* ping through tally.ctl */
    tally_req_t ping;
    memset(&ping, 0, sizeof ping);
    ping.opcode = TALLY_OP_PING;
    assert_int_equal(tally_nats_call(p, &ping, NULL, 0, &reply), TALLY_OK);
    tally_reply_clear(&reply);
    tally_nats_destroy(&p);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
    wait_owned(NULL, 0, 5000); /* released at the stop, not left to expire */
}

/* Every stream's record equals the model once the owners have caught up (after a take-over
 * the new owner applies again what came after the last checkpoint). */
static void check_model_eventually(tally_nats_t *p, int timeout_ms)
{
    int64_t t0 = th_now_ms();
    for (;;) {
        bool equal = true;
        for (int i = 0; i < STREAMS && equal; i++) {
            char name[32];
            stream_name(name, sizeof name, i);
            tally_stream_info_t info;
            if (tally_nats_query(p, name, &info) != TALLY_OK) {
                equal = false; /* no owner right now: ask again */
                break;
            }
            equal = info.hist_total == model_total[i] &&
                    memcmp(info.bins, model[i], sizeof model[i]) == 0;
            if (!equal && info.hist_total > model_total[i])
                fail_msg("%s holds %llu values, more than the %llu sent once: applied twice", name,
                         (unsigned long long)info.hist_total, (unsigned long long)model_total[i]);
        }
        if (equal)
            return;
        if (th_now_ms() - t0 > timeout_ms)
            break;
        th_sleep_ms(100);
    }
    check_model(p); /* fails with the first difference */
}

/* Publishes raw data to tally.in.<k> with a reply subject; the reply's status. */
static uint32_t publish_raw(uint32_t k, const void *data, size_t len, natsSubscription *inbox_sub,
                            const char *inbox)
{
    char subject[48]; /* the cluster has no users: every client is "anon" */
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, k, "anon");
    natsMsg *m = NULL;
    assert_int_equal(natsMsg_Create(&m, subject, NULL, data, (int)len), NATS_OK);
    assert_int_equal(natsMsgHeader_Set(m, "Tally-Reply", inbox), NATS_OK);
    jsErrCode jerr = 0;
    assert_int_equal(js_PublishMsg(NULL, js, m, NULL, &jerr), NATS_OK);
    natsMsg_Destroy(m);
    natsMsg *r = NULL;
    assert_int_equal(natsSubscription_NextMsg(&r, inbox_sub, 20000), NATS_OK);
    tally_rep_t rep;
    assert_true(natsMsg_GetDataLength(r) >= TALLY_REP_HEADER_SIZE);
    assert_int_equal(
        tally_rep_decode((const uint8_t *)natsMsg_GetData(r), TALLY_REP_HEADER_SIZE, &rep),
        TALLY_OK);
    natsMsg_Destroy(r);
    return rep.status;
}

/* A request frame: header (with `stream`) and payload, into out; its length. */
static size_t frame(uint8_t opcode, uint8_t dtype, const char *stream, const void *payload,
                    size_t len, uint8_t *out)
{
    tally_req_t req = th_req(opcode, dtype, 42);
    if (opcode == TALLY_OP_HIST && dtype == TALLY_DTYPE_I32)
        req.hi = 100;
    size_t n = th_frame(req, stream, payload, len, out);
    assert_int_not_equal(n, 0);
    return n;
}

static void test_poison_dead_letters(void **state)
{
    (void)state;
    th_daemon_t w;
    start_worker(&w, "w1");
    wait_owned("w1", PARTITIONS, 20000);
    const char *inbox = "_INBOX.anon.poison"; /* the worker answers only there */
    natsSubscription *sub = NULL;
    assert_int_equal(natsConnection_SubscribeSync(&sub, nc, inbox), NATS_OK);
    char name0[32];
    stream_name(name0, sizeof name0, 0);
    uint32_t k0 = tally_partition(name0, strlen(name0), PARTITIONS);
    uint8_t buf[TALLY_REQ_HEADER_SIZE + 64];
    int32_t vals[4] = {1, 2, 3, 4};
    /* A frame shorter than a header; a stream of another partition; a query on the ingest
     * subject; a hist whose dtype conflicts with the stream's (refused at apply time). */
    assert_int_equal(publish_raw(k0, "short", 5, sub, inbox), TALLY_E_HEADER);
    const char *other = "x";
    for (int i = 0; tally_partition(other, strlen(other), PARTITIONS) == k0; i++)
        other = i % 2 ? "y" : "zz";
    size_t len = frame(TALLY_OP_HIST, TALLY_DTYPE_U8, other, vals, 4, buf);
    assert_int_equal(publish_raw(k0, buf, len, sub, inbox), TALLY_E_STREAM_NAME);
    len = frame(TALLY_OP_QUERY, TALLY_DTYPE_NONE, name0, NULL, 0, buf);
    assert_int_equal(publish_raw(k0, buf, len, sub, inbox), TALLY_E_OPCODE);
    len = frame(TALLY_OP_HIST, TALLY_DTYPE_I32, name0, vals, sizeof vals, buf);
    assert_int_equal(publish_raw(k0, buf, len, sub, inbox), TALLY_E_STREAM_STATE);
    /* Each is in the dead letters with its reason. */
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    assert_int_equal(js_GetStreamInfo(&si, js, "TALLY_DEAD", NULL, &jerr), NATS_OK);
    assert_int_equal(si->State.Msgs, 4);
    uint64_t last = si->State.LastSeq;
    jsStreamInfo_Destroy(si);
    const char *want[4] = {"bad_header", "bad_stream_name", "bad_opcode", "stream_state"};
    for (int i = 0; i < 4; i++) {
        natsMsg *d = NULL;
        assert_int_equal(js_GetMsg(&d, js, "TALLY_DEAD", last - 3 + (uint64_t)i, NULL, &jerr),
                         NATS_OK);
        const char *status = NULL, *reason = NULL;
        assert_int_equal(natsMsgHeader_Get(d, "Tally-Status", &status), NATS_OK);
        assert_int_equal(natsMsgHeader_Get(d, "Tally-Reason", &reason), NATS_OK);
        assert_string_equal(status, want[i]);
        assert_true(strlen(reason) > 0);
        natsMsg_Destroy(d);
    }
    /* The partition goes on: the model still holds. */
    tally_nats_t *p = producer("after-poison");
    push_hists(p, 1, false, th_rand());
    check_model_eventually(p, 20000);
    /* What the worker reports (PROTOCOL.md §13 "What a worker reports"): its four dead
     * letters, its partitions, no lag once the model holds; and info's fleet keys. */
    assert_int_equal(th_metric(&w, "tallyd_nats_dead_letters_total"), 4);
    assert_int_equal(th_metric(&w, "tallyd_nats_partitions_owned"), PARTITIONS);
    assert_int_equal(th_metric(&w, "tallyd_nats_leases_lost_total"), 0);
    assert_true(th_metric(&w, "tallyd_nats_applied_total") >= 4 + STREAMS);
    assert_true(th_metric(&w, "tallyd_nats_partitions_taken_total") == PARTITIONS);
    char lag[64];
    snprintf(lag, sizeof lag, "tallyd_nats_partition_lag{partition=\"%u\"}", (unsigned)k0);
    assert_int_equal(th_metric(&w, lag), 0);
    char *info = fleet_info(p);
    char want_payload[64];
    snprintf(want_payload, sizeof want_payload, "\nnats_max_payload=%zu\n",
             tally_nats_max_payload(p));
    assert_non_null(strstr(info, "\nnats=on\nnats_member_id=w1\nnats_partitions=4\n"
                                 "nats_partitions_owned=4\nnats_lease_ttl_ms=3000\n"
                                 "nats_checkpoint_interval_ms=200\n"));
    assert_non_null(strstr(info, want_payload));
    free(info);
    tally_nats_destroy(&p);
    natsSubscription_Destroy(sub);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

static void test_restart_resumes_from_checkpoint(void **state)
{
    (void)state;
    /* The previous worker stopped with SIGTERM: every partition's checkpoint holds the model. */
    for (uint32_t k = 0; k < PARTITIONS; k++) {
        td_ckpt_manifest_t m;
        uint8_t *st = NULL;
        size_t len = 0;
        assert_int_equal(td_ckpt_read(js, k, &m, &st, &len, msg, sizeof msg), TD_OK);
        assert_string_equal(m.member, "w1");
        assert_true(m.applied_seq > 0);
        free(st);
    }
    th_daemon_t w;
    start_worker(&w, "w2");
    wait_owned("w2", PARTITIONS, 20000);
    tally_nats_t *p = producer("restart");
    check_model(p);
    push_hists(p, 1, false, th_rand());
    check_model_eventually(p, 20000);
    tally_nats_destroy(&p);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

/* Two members that split the partitions between them (rendezvous: not every pair does). */
static void two_members(char *a, char *b, size_t cap)
{
    for (int i = 0;; i++) {
        snprintf(a, cap, "wa%d", i);
        snprintf(b, cap, "wb%d", i);
        const char *ids[2] = {a, b};
        int owned_a = 0;
        for (uint32_t k = 0; k < PARTITIONS; k++)
            owned_a += td_fleet_owner(ids, 2, k) == 0;
        if (owned_a == PARTITIONS / 2)
            return;
    }
}

static void test_failover_kill9_exactly_once(void **state)
{
    (void)state;
    char a[16], b[16];
    two_members(a, b, sizeof a);
    th_daemon_t wa, wb;
    start_worker(&wa, a);
    start_worker(&wb, b);
    wait_owned(a, PARTITIONS / 2, 20000);
    wait_owned(b, PARTITIONS / 2, 20000);
    tally_nats_t *p = producer("failover"), *again = producer("failover");
    uint64_t seed = th_rand();
    push_hists(p, 2, false, seed);
    /* The same messages once more under the same ids: JetStream keeps one copy. */
    uint64_t saved[STREAMS][256], saved_total[STREAMS];
    memcpy(saved, model, sizeof model);
    memcpy(saved_total, model_total, sizeof model_total);
    push_hists(again, 2, false, seed);
    memcpy(model, saved, sizeof model);
    memcpy(model_total, saved_total, sizeof model_total);
    tally_nats_stats_t st;
    tally_nats_stats(again, &st);
    assert_int_equal(st.duplicates, st.sent);
    /* kill -9 of a worker while its partitions have messages not yet checkpointed. */
    push_hists(p, 1, false, th_rand());
    assert_int_equal(th_daemon_stop(&wa, SIGKILL, 5000), 128 + SIGKILL);
    push_hists(p, 1, false, th_rand());
    int64_t moved = wait_owned(b, PARTITIONS, TTL_MS + 20000);
    print_message("partitions of the killed worker moved in %lld ms (lease %d ms)\n",
                  (long long)moved, TTL_MS);
    check_model_eventually(p, 30000);
    tally_nats_destroy(&p);
    tally_nats_destroy(&again);
    assert_int_equal(th_daemon_stop(&wb, SIGTERM, 20000), 0);
}

/* tallyd --check-config with the arguments: its exit status; its stderr in err. */
static int check_config(const char *args, char *err, size_t cap)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s --check-config %s 2>&1", th_tallyd_bin(), args);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    size_t n = fread(err, 1, cap - 1, f);
    err[n] = 0;
    int status = pclose(f);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Histogram publications (PROTOCOL.md §13): each changed stream of an owned partition on
 * tally.watch.<k> with its §11 header and record, the member and stream in the headers, pub_seq
 * counting up; every stream's last publication equals the model. */
static void test_watch_publications(void **state)
{
    (void)state;
    th_daemon_t w;
    start_worker(&w, "ww");
    wait_owned("ww", PARTITIONS, 20000);
    natsSubscription *sub = NULL;
    assert_int_equal(natsConnection_SubscribeSync(&sub, nc, "tally.watch.>"), NATS_OK);
    tally_nats_t *p = producer("watch");
    push_hists(p, 1, false, th_rand());
    tally_nats_destroy(&p);
    bool seen[STREAMS] = {false};
    int left = STREAMS;
    uint64_t last_seq = 0;
    int64_t t0 = th_now_ms();
    while (left > 0 && th_now_ms() - t0 < 20000) {
        natsMsg *m = NULL;
        if (natsSubscription_NextMsg(&m, sub, 500) != NATS_OK)
            continue;
        const char *member = NULL, *name = NULL;
        assert_int_equal(natsMsgHeader_Get(m, "Tally-Member", &member), NATS_OK);
        assert_string_equal(member, "ww");
        assert_int_equal(natsMsgHeader_Get(m, "Tally-Stream", &name), NATS_OK);
        char subject[48];
        snprintf(subject, sizeof subject, "tally.watch.%u",
                 (unsigned)tally_partition(name, strlen(name), PARTITIONS));
        assert_string_equal(natsMsg_GetSubject(m), subject);
        const uint8_t *data = (const uint8_t *)natsMsg_GetData(m);
        size_t len = (size_t)natsMsg_GetDataLength(m);
        tally_pub_t pub;
        tally_stream_info_t info;
        assert_int_equal(tally_pub_decode(data, TALLY_PUB_HEADER_SIZE, &pub), TALLY_OK);
        assert_int_equal(pub.kind, TALLY_PUB_UPDATE);
        assert_int_equal(pub.interval_ms, 1000);
        assert_true(pub.pub_seq > last_seq);
        last_seq = pub.pub_seq;
        assert_int_equal(tally_stream_info_decode(data + TALLY_PUB_HEADER_SIZE,
                                                  len - TALLY_PUB_HEADER_SIZE, &info),
                         TALLY_OK);
        for (int i = 0; i < STREAMS; i++) {
            char want[32];
            stream_name(want, sizeof want, i);
            if (!seen[i] && strcmp(want, name) == 0 && info.hist_total == model_total[i] &&
                memcmp(info.bins, model[i], sizeof model[i]) == 0) {
                seen[i] = true;
                left--;
            }
        }
        natsMsg_Destroy(m);
    }
    natsSubscription_Destroy(sub);
    assert_int_equal(left, 0);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

/* Backpressure (PROTOCOL.md §13 "Validation"): at max_inflight the worker's requests wait in
 * its transport's queue, in order, until replies free slots: never refused, lost or applied
 * twice. With max_inflight 1, four partitions' windows of 64 KiB hists (up to [nats] inflight
 * each) and a simulated GPU whose every launch takes 50 ms, the path is full while any one
 * request runs and every other message waits; every stream still equals its model, and nothing
 * was answered `busy` and sent again (tallyd_nats_resent_total 0: before issue 32 they were). */
static void backpressure(const char *member, const char *producer_name, const char *const *extra)
{
    th_daemon_t w;
    setenv("TALLYD_TEST_SIM_LATENCY_US", "50000", 1);
    start_worker_with(&w, member, extra);
    unsetenv("TALLYD_TEST_SIM_LATENCY_US");
    wait_owned(member, PARTITIONS, 20000);
    tally_nats_t *p = producer(producer_name); /* its own: its message ids are not duplicates */
    for (int i = 0; i < 3; i++)
        push_hists_of(p, 3, true, th_rand(), 64 << 10);
    check_model_eventually(p, 30000);
    tally_nats_destroy(&p);
    assert_int_equal(th_metric(&w, "tallyd_nats_resent_total"), 0);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

static void test_backpressure_at_max_inflight(void **state)
{
    (void)state;
    const char *extra[] = {"--max-inflight",  "1", "--backend", "cuda",
                           "--test-sim-gpus", "1", NULL};
    backpressure("wb", "backpressure", extra);
}

/* The same through a port (issue 32: with shard threads the fleet thread hands its requests to
 * the shards itself, core/td_path_port.c), whatever TALLYD_TEST_SHARDS says: at max_inflight the
 * port takes nothing and the requests wait in the fleet thread's queue, in order. */
static void test_backpressure_through_a_port(void **state)
{
    (void)state;
    const char *extra[] = {"--max-inflight", "1", "--backend", "cuda", "--test-sim-gpus", "1",
                           "--shards",       "4", NULL};
    backpressure("wp", "backpressure-port", extra);
}

/* Waits until the worker's metric NAME reaches at least want; its last value. */
static long long wait_metric(th_daemon_t *d, const char *name, long long want, int timeout_ms)
{
    int64_t t0 = th_now_ms();
    long long v = th_metric(d, name);
    while (v < want && th_now_ms() - t0 < timeout_ms) {
        th_sleep_ms(50);
        v = th_metric(d, name);
    }
    return v;
}

#define LOST_STREAMS 8
#define LOST_BYTES 1000

/* Sends one LOST_BYTES hist to each of the streams lost0.. (every byte of lost<i> is i). */
static void push_lost_streams(tally_nats_t *p)
{
    uint8_t batch[LOST_BYTES];
    for (int i = 0; i < LOST_STREAMS; i++) {
        char name[32];
        snprintf(name, sizeof name, "lost%d", i);
        memset(batch, i, sizeof batch);
        tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
        assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
        assert_int_equal(tally_nats_send(p, &req, batch, sizeof batch, true, NULL, NULL), TALLY_OK);
    }
    assert_int_equal(tally_nats_flush(p), TALLY_OK);
    for (int i = 0; i < LOST_STREAMS; i++) {
        tally_reply_t reply;
        tally_reply_init(&reply);
        assert_int_equal(tally_nats_recv(p, 20000, &reply), TALLY_OK);
        assert_int_equal(reply.rep.status, TALLY_OK);
        tally_reply_clear(&reply);
    }
}

/* Every stream lost<i> holds its one batch once (bin i = LOST_BYTES), once its owner answers. */
static void check_lost_streams_once(tally_nats_t *p, int timeout_ms)
{
    int64_t t0 = th_now_ms();
    for (int i = 0; i < LOST_STREAMS; i++) {
        char name[32];
        snprintf(name, sizeof name, "lost%d", i);
        tally_stream_info_t info;
        tally_status_t st;
        while ((st = tally_nats_query(p, name, &info)) != TALLY_OK && th_now_ms() - t0 < timeout_ms)
            th_sleep_ms(100); /* no owner right now: ask again */
        assert_int_equal(st, TALLY_OK);
        if (info.hist_total != LOST_BYTES)
            fail_msg("%s holds %llu values, %d were sent once", name,
                     (unsigned long long)info.hist_total, LOST_BYTES);
        assert_int_equal(info.bins[i], LOST_BYTES);
    }
}

/* A partition lost while the request path is full (PROTOCOL.md §13 "Exactly once across
 * crashes"): max_inflight 1, taken by a ZeroMQ client's 1 MiB hist (of no stream) on a simulated
 * GPU whose launches take 4 s, when the test deletes every lease. The worker loses its partitions
 * and, the only member, takes them again from their checkpoints; before it does, its local copy
 * must be gone, though its delete requests meet `busy`: a copy left behind gets the messages after
 * the checkpoint applied a second time. A cluster of its own, so that the checkpoints hold no
 * streams yet (nothing checkpointed for an hour): with records, a restore over a copy left behind
 * is refused, and the next take deletes it once the path is free. */
/* A one-node cluster of a test's own, and the test's connection to it (own_cluster_stop). */
typedef struct {
    tn_cluster_t c;
    natsConnection *nc;
    jsCtx *js;
} own_cluster_t;

static void own_cluster_start(own_cluster_t *own)
{
    *own = (own_cluster_t){0};
    assert_int_equal(tn_cluster_start(&own->c, 1, NULL, 30000), 0);
    assert_int_equal(tn_connect(&own->c, &own->nc, &own->js), 0);
}

static void own_cluster_stop(own_cluster_t *own)
{
    jsCtx_Destroy(own->js);
    natsConnection_Destroy(own->nc);
    tn_cluster_stop(&own->c);
}

static void test_lost_partition_copy_deleted_while_path_full(void **state)
{
    (void)state;
    own_cluster_t own;
    own_cluster_start(&own);
    const char *extra[] = {"--max-inflight",
                           "1",
                           "--backend",
                           "auto", /* the fleet's 1000-byte hists on the CPU, the hold on the GPU */
                           "--test-sim-gpus",
                           "1",
                           "--nats-checkpoint-interval-ms",
                           "3600000",
                           NULL};
    setenv("TALLYD_TEST_SIM_LATENCY_US", "4000000", 1);
    th_daemon_t w;
    start_worker_on(&w, own.c.urls, "wl", extra);
    unsetenv("TALLYD_TEST_SIM_LATENCY_US");
    assert_int_equal(wait_metric(&w, "tallyd_nats_partitions_owned", PARTITIONS, 20000),
                     PARTITIONS);
    tally_nats_t *p = producer_on(own.c.urls, "lost");
    push_lost_streams(p);

    void *hold = th_connect(w.endpoint, 30000);
    size_t big = 1 << 20;
    uint8_t *bytes = calloc(1, big);
    assert_non_null(bytes);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 1); /* no stream: not the fleet's */
    assert_int_equal(th_send_request(hold, &req, bytes, big), 0);
    free(bytes);
    assert_int_equal(wait_metric(&w, "tallyd_requests_in_flight", 1, 20000), 1);
    kvStore *leases = NULL;
    assert_int_equal(js_KeyValue(&leases, own.js, TALLY_NATS_BUCKET_LEASES), NATS_OK);
    for (uint32_t k = 0; k < PARTITIONS; k++) {
        char key[16];
        snprintf(key, sizeof key, "p%u", (unsigned)k);
        assert_int_equal(kvStore_Delete(leases, key), NATS_OK);
    }
    kvStore_Destroy(leases);
    th_reply_t reply;
    assert_int_equal(th_recv_reply(hold, &reply), 0);
    assert_int_equal(reply.rep.status, TALLY_OK);
    th_reply_free(&reply);
    th_close(hold);

    assert_true(wait_metric(&w, "tallyd_nats_partitions_taken_total", 2 * PARTITIONS, 30000) >=
                2 * PARTITIONS);
    assert_int_equal(wait_metric(&w, "tallyd_nats_partitions_owned", PARTITIONS, 30000),
                     PARTITIONS);
    check_lost_streams_once(p, 30000);
    tally_nats_destroy(&p);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
    own_cluster_stop(&own);
}

/* A cluster so slow that taking every partition lasts longer than a lease (each take 2.5 s here,
 * TALLYD_TEST_TAKE_MS; 4 of them, a 6 s lease): the worker takes them over several heartbeats,
 * renewing the ones it holds between, so each is taken once and none runs out. Before, one
 * heartbeat took them all, the first ones' leases ran out meanwhile, and the worker dropped and
 * took them again for ever (test_nats_faults under load: 8 partitions never settled). */
static void test_slow_takes_keep_their_leases(void **state)
{
    (void)state;
    own_cluster_t own;
    own_cluster_start(&own);
    const char *extra[] = {"--nats-lease-ttl-ms", "6000", NULL};
    setenv("TALLYD_TEST_TAKE_MS", "2500", 1);
    th_daemon_t w;
    start_worker_on(&w, own.c.urls, "ws", extra);
    unsetenv("TALLYD_TEST_TAKE_MS");
    assert_int_equal(wait_metric(&w, "tallyd_nats_partitions_owned", PARTITIONS, 120000),
                     PARTITIONS);
    assert_int_equal(th_metric(&w, "tallyd_nats_partitions_taken_total"), PARTITIONS);
    if (th_daemon_log_contains(&w, "lease ran out"))
        fail_msg("a lease ran out:\n%s", th_slurp(w.log_path));
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 30000), 0);
    own_cluster_stop(&own);
}

/* ---- The transport's refusals (td_fleet_path_on_loop) ---------------------------------------- */

#define HALT_STREAMS 4
#define HALT_BYTES 1000

/* The i-th stream of partition 0 of 2 (the refusal test's fleet). */
static void halt_name(char *buf, size_t cap, int i)
{
    for (int n = 0, j = 0;; j++) {
        snprintf(buf, cap, "halt%d", j);
        if (tally_partition(buf, strlen(buf), 2) == 0 && n++ == i)
            return;
    }
}

/* Messages partition k's consumers have handed to their reader (the server's count). */
static uint64_t delivered(jsCtx *cjs, uint32_t k)
{
    char stream[32];
    tally_fleet_name(stream, sizeof stream, TALLY_NATS_STREAM_PREFIX, k);
    jsConsumerInfoList *list = NULL;
    jsErrCode jerr = 0;
    if (js_Consumers(&list, cjs, stream, NULL, &jerr) != NATS_OK)
        return 0;
    uint64_t n = 0;
    for (int i = 0; i < list->Count; i++)
        n += list->List[i]->Delivered.Consumer;
    jsConsumerInfoList_Destroy(list);
    return n;
}

/* A ping on tally.ctl by request-reply, its answer to come on inbox (subscribed here). */
static natsSubscription *ping_async(natsConnection *cnc, const char *inbox)
{
    natsSubscription *sub = NULL;
    assert_int_equal(natsConnection_SubscribeSync(&sub, cnc, inbox), NATS_OK);
    char subject[48]; /* the cluster has no users: every client is "anon" */
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_CTL, -1, TALLY_NATS_USER_ANON);
    uint8_t buf[TALLY_REQ_HEADER_SIZE];
    size_t len = frame(TALLY_OP_PING, TALLY_DTYPE_NONE, NULL, NULL, 0, buf);
    assert_int_equal(natsConnection_PublishRequest(cnc, subject, inbox, buf, (int)len), NATS_OK);
    assert_int_equal(natsConnection_FlushTimeout(cnc, 5000), NATS_OK);
    return sub;
}

/* The answer on sub: its status, and its text (an error's) in why. */
static uint32_t answer_of(natsSubscription *sub, int timeout_ms, char *why, size_t cap)
{
    natsMsg *r = NULL;
    assert_int_equal(natsSubscription_NextMsg(&r, sub, timeout_ms), NATS_OK);
    size_t len = (size_t)natsMsg_GetDataLength(r);
    const uint8_t *data = (const uint8_t *)natsMsg_GetData(r);
    tally_rep_t rep;
    assert_true(len >= TALLY_REP_HEADER_SIZE);
    assert_int_equal(tally_rep_decode(data, TALLY_REP_HEADER_SIZE, &rep), TALLY_OK);
    snprintf(why, cap, "%.*s", (int)(len - TALLY_REP_HEADER_SIZE), data + TALLY_REP_HEADER_SIZE);
    natsMsg_Destroy(r);
    return rep.status;
}

/* A request the fleet queues for the request path once the path has closed (tallyd stopping)
 * is answered `shutdown` by the transport itself: no shard would ever answer it. The fleet
 * thread queues after the close only what one turn of its loop had already begun, so the turn
 * is held in a take (TALLYD_TEST_TAKE_MS: partition 1's, after partition 0 is taken) while
 * partition 0's reader fetches the producer's messages, a ping waits on tally.ctl, and tallyd
 * takes SIGTERM and closes its path. When the take ends, the turn queues both: the ping is
 * answered `shutdown` with the transport's reason, the messages are not applied but left to the
 * next owner (not a dead letter), tallyd exits 0, and the next worker applies each message once
 * and answers it once. */
/* A take of 6 s, well within a lease of 20 s: the test's steps inside it, the stop included,
 * took 0.3 s on a 2-core box. */
static const char *const held_take_args[] = {"--nats-partitions", "2", "--nats-lease-ttl-ms",
                                             "20000", NULL};

/* Worker wz on own's cluster with its second take held 6 s (TALLYD_TEST_TAKE_MS): partition 0
 * taken, partition 1 leased, its take under way. */
static void start_held_take(own_cluster_t *own, th_daemon_t *w)
{
    setenv("TALLYD_TEST_TAKE_MS", "6000", 1);
    start_worker_on(w, own->c.urls, "wz", held_take_args);
    unsetenv("TALLYD_TEST_TAKE_MS");
    int held = 0;
    tn_wait_leases(own->js, 2, "wz", 2, 60000, &held);
    assert_int_equal(held, 2);
}

/* SIGTERM to w, held in its take: its path closes (logged) before the take ends. */
static void stop_in_take(th_daemon_t *w)
{
    assert_int_equal(kill(w->pid, SIGTERM), 0);
    assert_true(th_daemon_wait_log(w, "<5>stopped", 10000));
    if (th_daemon_log_contains(w, "wz took partition 1"))
        fail_msg("partition 1's take ended before the path closed: TALLYD_TEST_TAKE_MS is too "
                 "short for this box (%s)",
                 w->log_path);
}

static void test_closed_path_answers_shutdown(void **state)
{
    (void)state;
    own_cluster_t own;
    own_cluster_start(&own);
    th_daemon_t w;
    start_held_take(&own, &w);

    tally_nats_t *p = producer_on(own.c.urls, "halt");
    uint8_t batch[HALT_BYTES];
    for (int i = 0; i < HALT_STREAMS; i++) {
        char name[32];
        halt_name(name, sizeof name, i);
        memset(batch, i, sizeof batch);
        tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
        assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
        assert_int_equal(tally_nats_send(p, &req, batch, sizeof batch, true, NULL, NULL), TALLY_OK);
    }
    assert_int_equal(tally_nats_flush(p), TALLY_OK);
    natsSubscription *pong = ping_async(own.nc, TALLY_NATS_INBOX TALLY_NATS_USER_ANON ".halt");
    for (int64_t t0 = th_now_ms(); delivered(own.js, 0) < HALT_STREAMS; th_sleep_ms(20))
        if (th_now_ms() - t0 > 10000)
            fail_msg("partition 0's reader fetched %llu of %d messages",
                     (unsigned long long)delivered(own.js, 0), HALT_STREAMS);
    stop_in_take(&w);

    char why[TALLY_ERROR_MESSAGE_MAX + 1];
    assert_int_equal(answer_of(pong, 30000, why, sizeof why), TALLY_E_SHUTDOWN);
    assert_string_equal(why, "tallyd reads nothing more (stopping)");
    natsSubscription_Destroy(pong);
    assert_int_equal(th_daemon_wait(&w, 30000), 0);
    assert_true(th_daemon_log_contains(&w, "fleet: wz gave partition 0 up at sequence 0"));
    tally_reply_t reply;
    tally_reply_init(&reply);
    assert_int_equal(tally_nats_recv(p, 200, &reply), TALLY_E_TIMEOUT); /* none answered */

    th_daemon_t next;
    start_worker_on(&next, own.c.urls, "wz2", held_take_args);
    for (int i = 0; i < HALT_STREAMS; i++) {
        assert_int_equal(tally_nats_recv(p, 30000, &reply), TALLY_OK);
        assert_int_equal(reply.rep.aux0, HALT_BYTES);
        tally_reply_clear(&reply);
    }
    assert_int_equal(tally_nats_recv(p, 500, &reply), TALLY_E_TIMEOUT); /* each once */
    for (int i = 0; i < HALT_STREAMS; i++) {
        char name[32];
        halt_name(name, sizeof name, i);
        tally_stream_info_t info;
        assert_int_equal(tally_nats_query(p, name, &info), TALLY_OK);
        assert_int_equal(info.hist_total, HALT_BYTES);
        assert_int_equal(info.bins[i], HALT_BYTES);
    }
    tally_nats_destroy(&p);
    assert_int_equal(th_daemon_stop(&next, SIGTERM, 20000), 0);
    own_cluster_stop(&own);
}

/* The same with a query alone in flight: no partition of the leaving member waits for replies,
 * so only the fleet thread's last turns read the path's answers, and the query is answered
 * `shutdown` all the same (td_fleet_query_finish waits for it) and tallyd exits 0. Without
 * td_fleet_query_finish it went unanswered (its asker timed out) in 1 of 4 runs on a 2-core box,
 * when the path's refusal came after the thread's last read: not a mutant's test, the check of
 * a race. */
static void test_closed_path_query_alone(void **state)
{
    (void)state;
    own_cluster_t own;
    own_cluster_start(&own);
    th_daemon_t w;
    start_held_take(&own, &w);
    natsSubscription *pong = ping_async(own.nc, TALLY_NATS_INBOX TALLY_NATS_USER_ANON ".alone");
    stop_in_take(&w);
    char why[TALLY_ERROR_MESSAGE_MAX + 1];
    assert_int_equal(answer_of(pong, 30000, why, sizeof why), TALLY_E_SHUTDOWN);
    print_message("the query's answer: shutdown: %s\n", why);
    natsSubscription_Destroy(pong);
    assert_int_equal(th_daemon_wait(&w, 30000), 0);
    own_cluster_stop(&own);
}

/* A request the request path has no memory for (td_path_submit: TD_ERR_NOMEM) is answered
 * `busy` by the transport, and the worker goes on. Needs tallyd's allocation-failure hooks
 * (-DTALLY_ALLOC_FAULTS=ON; skipped without them): only td_request.c's allocations numbered, and
 * one shard, which allocates every request (several keep spares); the harness's ping at the
 * start is the first, the producer's ping the second, which fails. */
static void test_no_memory_answers_busy(void **state)
{
    (void)state;
#ifndef TALLY_ALLOC_FAULTS
    skip();
#else
    own_cluster_t own;
    own_cluster_start(&own);
    const char *extra[] = {"--shards", "1", NULL};
    setenv("TALLYD_ALLOC_FAIL_IN", "td_request.c", 1);
    setenv("TALLYD_ALLOC_FAIL_AT", "2", 1);
    th_daemon_t w;
    start_worker_on(&w, own.c.urls, "wm", extra);
    unsetenv("TALLYD_ALLOC_FAIL_AT");
    unsetenv("TALLYD_ALLOC_FAIL_IN");
    tally_nats_t *p = producer_on(own.c.urls, "nomem");
    tally_req_t ping = {.opcode = TALLY_OP_PING};
    tally_reply_t reply;
    tally_reply_init(&reply);
    assert_int_equal(tally_nats_call(p, &ping, NULL, 0, &reply), TALLY_E_BUSY);
    assert_string_equal(reply.error, "out of memory for the request");
    assert_true(th_daemon_log_contains(&w, "failing allocation 2 (malloc at td_request.c:"));
    assert_int_equal(tally_nats_call(p, &ping, NULL, 0, &reply), TALLY_OK); /* it goes on */
    tally_reply_clear(&reply);
    tally_nats_destroy(&p);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
    assert_true(th_daemon_log_contains(&w, " allocations, failed 1"));
    own_cluster_stop(&own);
#endif
}

/* A worker with CURVE on for its ZeroMQ clients (PROTOCOL.md §13 "Security"): its partitions'
 * requests reach the request path as a transport of their own, not through a socket, so it
 * applies and answers as without CURVE. With [nats] local_writes on, a CURVE client may change a
 * stream too (by default not_permitted: test_nats_security). */
static void test_curve_worker(void **state)
{
    (void)state;
    char server_pub[41], server_sec[41], alice_pub[41], alice_sec[41];
    assert_int_equal(zmq_curve_keypair(server_pub, server_sec), 0);
    assert_int_equal(zmq_curve_keypair(alice_pub, alice_sec), 0);
    char dir[256], key[512], path[320], clients[64];
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-nats-curve"), 0);
    int n = snprintf(key, sizeof key, "curve\n    public-key = \"%s\"\n    secret-key = \"%s\"\n",
                     server_pub, server_sec);
    assert_int_equal(th_write_file(dir, "server.key", key, (size_t)n), 0);
    snprintf(path, sizeof path, "%s/server.key", dir);
    assert_int_equal(chmod(path, 0600), 0);
    snprintf(clients, sizeof clients, "alice:%s", alice_pub);
    const char *extra[] = {
        "--curve-secret-key", path, "--curve-clients", clients, "--nats-local-writes", "on", NULL};
    th_use_curve(server_pub, alice_pub, alice_sec); /* the harness's readiness ping */
    th_daemon_t w;
    start_worker_with(&w, "wc", extra);
    wait_owned("wc", PARTITIONS, 20000);
    tally_nats_t *p = producer("curve");
    check_model(p); /* restored from the checkpoints; queried through the worker's connection */
    push_hists(p, 1, true, th_rand());
    check_model_eventually(p, 20000);
    void *z = th_connect(w.endpoint, 10000);
    uint8_t bytes[8] = {0};
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 1);
    assert_int_equal(tally_req_set_stream(&req, "local/z"), TALLY_OK);
    assert_int_equal(th_call_status(z, &req, bytes, sizeof bytes), TALLY_OK);
    req = th_req(TALLY_OP_DELETE, TALLY_DTYPE_NONE, 2);
    assert_int_equal(tally_req_set_stream(&req, "local/z"), TALLY_OK);
    assert_int_equal(th_call_status(z, &req, NULL, 0), TALLY_OK);
    th_close(z);
    char *info = fleet_info(p);
    assert_non_null(strstr(info, "\ncurve=on\n"));
    assert_non_null(strstr(info, "\nnats=on\nnats_member_id=wc\n"));
    free(info);
    tally_nats_destroy(&p);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
    th_use_curve(NULL, NULL, NULL);
    th_rmrf(dir);
}

/* The CLI's --nats (PROTOCOL.md §13 "A client over NATS"): every command against the fleet, the
 * data commands' output equal to the same command's over ZeroMQ, a push cut to fit one message
 * per chunk; libtally's NATS client refuses a payload over one message and shared memory. Each
 * command may wait a minute for a reply (CLI_WAIT): tally's default 5 s is short for the 20 MiB
 * push under ASan on a loaded box. */
#define CLI_WAIT "-t 60000"
#define nats_cli(dir, fmt, ...)                                                                    \
    th_cli((dir), "tcp://127.0.0.1:1", CLI_WAIT " --nats %s " fmt, __VA_ARGS__)

static void test_cli_over_nats(void **state)
{
    (void)state;
    th_daemon_t w;
    start_worker(&w, "w1");
    wait_owned("w1", PARTITIONS, 20000);
    char dir[256];
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-nats-cli"), 0);
    size_t n = (20u << 20) + 3; /* over the cluster's max_payload (8 MB): several messages */
    uint8_t *data = malloc(n);
    assert_non_null(data);
    for (size_t i = 0; i < n; i++)
        data[i] = (uint8_t)(th_rand() >> 7);
    assert_int_equal(th_write_file(dir, "in.bin", data, n), 0);
    free(data);
    const char *u = cluster.urls;

    th_cli_t z = th_cli(dir, w.endpoint, CLI_WAIT " hist --in in.bin");
    th_cli_t r = nats_cli(dir, "hist --stream clip/a --chunk 16M --in in.bin", u);
    assert_int_equal(z.status, 0);
    assert_int_equal(r.status, 0);
    assert_string_equal(r.out, z.out); /* the same counts, over NATS */
    th_cli_free(&z);
    th_cli_free(&r);
    assert_int_equal(th_write_file(dir, "t.txt", "1 2 3 -4 5", 10), 0);
    char reset[512], del[512];
    snprintf(reset, sizeof reset, "reset clip/a && %s " CLI_WAIT " --nats %s query clip/a",
             th_tally_bin(), u);
    snprintf(del, sizeof del, "delete clip/a && %s " CLI_WAIT " --nats %s query clip/a",
             th_tally_bin(), u);
    /* In order: each command, its exit status, and what its stdout (or stderr) holds. */
    const struct {
        const char *args;
        int status;
        const char *holds;
    } steps[] = {
        {"query clip/a", 0, "count      20971523\n"},
        {"streams", 0, "clip/a\n"},
        {"scan --stream clip/s --text --in t.txt", 0, "1\n3\n6\n2\n7\n"},
        {"scan --stream clip/s --text --in t.txt", 0, "8\n10\n13\n9\n14\n"}, /* carried */
        {"filter --gt 2 --text --in t.txt", 0, "3\n5\n"},
        {"ping", 0, "pong "},
        {"info", 0, "\nnats=on\nnats_member_id=w1\n"},
        {"watch --once clip/a", 0, "clip/a  u8  count 21.0M  rate 0/s  mean "},
        {reset, 0, "count      0\n"},
        {del, 1, "unknown_stream"},
    };
    for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
        r = nats_cli(dir, "%s", u, steps[i].args);
        if (r.status != steps[i].status || !strstr(r.status ? r.err : r.out, steps[i].holds))
            fail_msg("tally --nats %s: exit %d, out '%s', err '%s'", steps[i].args, r.status, r.out,
                     r.err);
        th_cli_free(&r);
    }
    r = th_cli(dir, w.endpoint, "--nats nats://127.0.0.1:1 ping");
    assert_int_equal(r.status, 3);
    assert_non_null(strstr(r.err, "cannot connect to NATS at nats://127.0.0.1:1"));
    th_cli_free(&r);

    /* libtally: one request is one message, shared memory does not travel. */
    tally_nats_opts_t o = {.servers = u, .timeout_ms = 15000};
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new_nats(&o, &c, msg, sizeof msg), TALLY_OK);
    size_t big = (8u << 20);
    uint8_t *payload = calloc(1, big);
    assert_non_null(payload);
    tally_req_t req;
    memset(&req, 0, sizeof req);
    req.opcode = TALLY_OP_HIST;
    req.dtype = TALLY_DTYPE_U8;
    assert_int_equal(tally_send(c, &req, payload, big, NULL), TALLY_E_TOO_LARGE);
    assert_non_null(strstr(tally_client_error(c), "do not fit one NATS message"));
    free(payload);
    tally_region_t *region = NULL;
    assert_int_equal(tally_region_create(c, 4096, &region), TALLY_E_ARG);
    tally_client_destroy(&c);
    th_rmrf(dir);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

static void test_protected_mode(void **state)
{
    (void)state;
    char out[2048];
    assert_int_equal(check_config("--nats-servers nats://10.1.2.3:4222", out, sizeof out), 2);
    assert_non_null(strstr(out, "protected mode"));
    assert_int_equal(check_config("--nats-servers nats://127.0.0.1:4222", out, sizeof out), 0);
    /* Credentials that can be read (check-config reads every file the start would). */
    assert_int_equal(
        check_config("--nats-servers nats://10.1.2.3:4222 --nats-credentials /dev/null", out,
                     sizeof out),
        0);
    assert_int_equal(check_config("--nats-servers nats://10.1.2.3:4222 --nats-credentials /x.creds",
                                  out, sizeof out),
                     1);
    assert_non_null(strstr(out, "[nats] credentials (--nats-credentials): cannot read /x.creds"));
    assert_int_equal(check_config("--nats-servers nats://user:pw@10.1.2.3:4222", out, sizeof out),
                     0);
    assert_int_equal(
        check_config("--nats-servers nats://10.1.2.3:4222 --protected-mode off", out, sizeof out),
        0);
    assert_int_equal(
        check_config("--nats-servers nats://127.0.0.1:4222 --nats-member-id a.b", out, sizeof out),
        2);
}

/* [nats] members_per_process = 2: one tallyd joins as two members, BASE-0 and BASE-1, which
 * split the partitions as two workers would (a base chosen so that rendezvous gives each two);
 * every request is applied once (the model) and answered once; `info` says the process's id
 * and its members; `streams` lists every stream (both members answer for their own). After a
 * SIGTERM every lease is released and a worker of one member takes every partition from the
 * checkpoints they wrote. A cluster of its own: its checkpoints hold none of the suite's
 * streams, so the model starts empty. */
static void test_members_per_process(void **state)
{
    (void)state;
    own_cluster_t own;
    own_cluster_start(&own);
    memset(model, 0, sizeof model);
    memset(model_total, 0, sizeof model_total);
    char base[16], m0[24], m1[24];
    for (int i = 0;; i++) {
        snprintf(base, sizeof base, "wk%d", i);
        snprintf(m0, sizeof m0, "%s-0", base);
        snprintf(m1, sizeof m1, "%s-1", base);
        const char *ids[2] = {m0, m1};
        int owned_0 = 0;
        for (uint32_t k = 0; k < PARTITIONS; k++)
            owned_0 += td_fleet_owner(ids, 2, k) == 0;
        if (owned_0 == PARTITIONS / 2)
            break;
    }
    const char *extra[] = {"--nats-members-per-process", "2", NULL};
    th_daemon_t w;
    start_worker_on(&w, own.c.urls, base, extra);
    int held = 0;
    tn_wait_leases(own.js, PARTITIONS, m0, PARTITIONS / 2, 20000, &held);
    assert_int_equal(held, PARTITIONS / 2);
    tn_wait_leases(own.js, PARTITIONS, m1, PARTITIONS / 2, 20000, &held);
    assert_int_equal(held, PARTITIONS / 2);
    assert_int_equal(wait_metric(&w, "tallyd_nats_partitions_owned", PARTITIONS, 20000),
                     PARTITIONS);

    tally_nats_t *p = producer_on(own.c.urls, "members");
    char *info = fleet_info(p);
    char want[64];
    snprintf(want, sizeof want, "\nnats_member_id=%s\n", base);
    assert_non_null(strstr(info, want));
    assert_non_null(strstr(info, "\nnats_partitions_owned=4\n"));
    assert_non_null(strstr(info, "\nnats_members_per_process=2\n"));
    free(info);
    push_hists(p, 2, true, th_rand());
    check_answered_once(p);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
    tn_wait_leases(own.js, PARTITIONS, NULL, 0, 5000, &held); /* released, not left to expire */
    assert_int_equal(held, 0);

    th_daemon_t z;
    start_worker_on(&z, own.c.urls, "wz", NULL);
    tn_wait_leases(own.js, PARTITIONS, "wz", PARTITIONS, 20000, &held);
    assert_int_equal(held, PARTITIONS);
    check_model(p); /* from the two members' checkpoints */
    push_hists(p, 1, false, th_rand());
    check_model_eventually(p, 20000);
    tally_nats_destroy(&p);
    assert_int_equal(th_daemon_stop(&z, SIGTERM, 20000), 0);
    own_cluster_stop(&own);
}

int main(void)
{
    if (tn_skip())
        return 77;
    th_seed();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_apply_reply_query),
        cmocka_unit_test(test_poison_dead_letters),
        cmocka_unit_test(test_restart_resumes_from_checkpoint),
        cmocka_unit_test(test_failover_kill9_exactly_once),
        cmocka_unit_test(test_watch_publications),
        cmocka_unit_test(test_backpressure_at_max_inflight),
        cmocka_unit_test(test_backpressure_through_a_port),
        cmocka_unit_test(test_lost_partition_copy_deleted_while_path_full),
        cmocka_unit_test(test_slow_takes_keep_their_leases),
        cmocka_unit_test(test_closed_path_answers_shutdown),
        cmocka_unit_test(test_closed_path_query_alone),
        cmocka_unit_test(test_no_memory_answers_busy),
        cmocka_unit_test(test_curve_worker),
        cmocka_unit_test(test_cli_over_nats),
        cmocka_unit_test(test_members_per_process), /* the model starts again: after the rest */
        cmocka_unit_test(test_protected_mode),
    };
    const char *only = getenv("TALLY_TEST_FILTER"); /* one test by name (a mutation check) */
    if (only)
        cmocka_set_test_filter(only);
    int failed = cmocka_run_group_tests(tests, setup, teardown);
    nats_Close(); /* libnats' threads and globals: gone before the leak check */
    return failed;
}
