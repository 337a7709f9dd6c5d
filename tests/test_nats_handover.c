/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_handover.c — a partition changing owner, against a real 3-node NATS cluster
 * (tests/lib/nats_cluster.c; issue 30, items 2 and 8):
 *   - watch publications (PROTOCOL.md §13 "Histogram publications") at hand-overs (a member
 *     joins, a member stops with SIGTERM, a member stopped with SIGSTOP past its lease comes back,
 *     the last worker stops): the old owner publishes a partition's changes before it gives it up
 *     (publication ticks an hour apart, so that only a hand-over can publish them), and the new
 *     owner publishes every stream it loads, changed or not, at its next tick. Before the fix
 *     neither did, and a stream's last record stayed behind its state;
 *   - a take-over that fails (the partition's stream refuses a consumer) releases the lease key at
 *     once, long before its TTL (and is not counted as a take: a take counts once its reader
 *     made the consumer), and the partition is taken once the cause is gone; so does a
 *     partition dropped because its consumer could not be made again (a sequence missing in the
 *     middle: before the fix its key stayed until it expired);
 *   - a member that joins gets its share, and one that leaves (SIGTERM) has its partitions
 *     taken, when their keys change, not at the next heartbeat (a lease of 90 s: heartbeats
 *     30 s apart; the hand-overs must come within 12 s).
 * Waits are bounded loops on what the cluster or the worker reports; no time is asserted but the
 * hand-overs' bound, set against the heartbeat it must beat.
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
#include <nats/nats.h>

#include "harness.h"
#include "nats_cluster.h"
#include "tally.h"
#include "tally_fleet.h"
#include "td_fleet_plan.h"
#include "td_nats_ckpt.h"
#include "td_nats_lease.h"

#define PARTITIONS 4
#define STREAMS 16
#define TTL_MS 3000
#define HIST_BYTES 500

static char msg[512];
static kvStore *leases;
static th_daemon_t worker[2];
/* The model: each stream's u8 histogram. */
static uint64_t model[STREAMS][256];

static int setup(void **state)
{
    (void)state;
    if (tn_suite_setup(3) != 0)
        return -1;
    return 0;
}

/* After each test, whatever its outcome: no worker left (one stopped with SIGSTOP included). */
static int stop_workers(void **state)
{
    (void)state;
    for (int i = 0; i < 2; i++)
        th_daemon_end(&worker[i]);
    return 0;
}

static int teardown(void **state)
{
    stop_workers(state);
    kvStore_Destroy(leases);
    return tn_suite_teardown();
}

/* No fleet on the cluster: each test's workers make their own (a lease TTL is the buckets'). */
static void fresh_fleet(void)
{
    tn_fleet_delete(tn_suite_js, PARTITIONS);
    kvStore_Destroy(leases);
    leases = NULL;
    memset(model, 0, sizeof model);
}

static void start(th_daemon_t *d, const char *member, const char *ttl_ms, const char *pub_ms)
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
                          ttl_ms,
                          "--nats-checkpoint-interval-ms",
                          "200",
                          "--nats-member-id",
                          member,
                          "--window-intervals",
                          "0",
                          "--pub-interval-ms",
                          pub_ms,
                          NULL};
    assert_int_equal(th_daemon_start(d, args), 0);
}

/* Partitions whose lease `member` holds (NULL: anyone). */
static int held_by(const char *member)
{
    if (!leases)
        assert_int_equal(js_KeyValue(&leases, tn_suite_js, TALLY_NATS_BUCKET_LEASES), NATS_OK);
    int held = 0;
    for (uint32_t k = 0; k < PARTITIONS; k++) {
        char holder[80];
        if (td_lease_holder(leases, k, holder, sizeof holder, msg, sizeof msg) == TD_OK &&
            holder[0] && (!member || strcmp(holder, member) == 0))
            held++;
    }
    return held;
}

static void wait_held(const char *member, int count, int timeout_ms)
{
    int64_t until = th_now_ms() + timeout_ms;
    int held;
    while ((held = held_by(member)) != count && th_now_ms() < until)
        th_sleep_ms(50);
    if (held != count)
        fail_msg("%s holds %d partitions, not %d", member ? member : "the fleet", held, count);
}

/* ---- Watch publications through hand-overs --------------------------------------------------- */

static void stream_name(char *buf, size_t cap, int i)
{
    snprintf(buf, cap, "watch%d", i);
}

static uint32_t partition_of(int i)
{
    char name[32];
    stream_name(name, sizeof name, i);
    return tally_partition(name, strlen(name), PARTITIONS);
}

/* One u8 hist on every stream, kept in the model. */
static void push_round(tally_nats_t *p)
{
    uint8_t batch[HIST_BYTES];
    for (int i = 0; i < STREAMS; i++) {
        for (size_t j = 0; j < sizeof batch; j++)
            batch[j] = (uint8_t)th_rand();
        char name[32];
        stream_name(name, sizeof name, i);
        tally_req_t req;
        memset(&req, 0, sizeof req);
        req.opcode = TALLY_OP_HIST;
        req.dtype = TALLY_DTYPE_U8;
        assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
        assert_int_equal(tally_nats_send(p, &req, batch, sizeof batch, false, NULL, NULL),
                         TALLY_OK);
        for (size_t j = 0; j < sizeof batch; j++)
            model[i][batch[j]]++;
    }
    assert_int_equal(tally_nats_flush(p), TALLY_OK);
}

/* Since the last forget_published(): which streams `member` published with their state. */
static bool published[STREAMS];
static char published_by[80];

static void forget_published(const char *member)
{
    memset(published, 0, sizeof published);
    snprintf(published_by, sizeof published_by, "%s", member);
}

/* Takes what the subscription holds (each wait up to wait_ms). */
static void drain(natsSubscription *sub, int wait_ms)
{
    natsMsg *m = NULL;
    while (natsSubscription_NextMsg(&m, sub, wait_ms) == NATS_OK) {
        const char *name = NULL, *member = NULL;
        size_t len = (size_t)natsMsg_GetDataLength(m);
        const uint8_t *data = (const uint8_t *)natsMsg_GetData(m);
        tally_stream_info_t info;
        if (natsMsgHeader_Get(m, TALLY_NATS_HDR_STREAM, &name) == NATS_OK &&
            natsMsgHeader_Get(m, TALLY_NATS_HDR_MEMBER, &member) == NATS_OK &&
            len > TALLY_PUB_HEADER_SIZE &&
            tally_stream_info_decode(data + TALLY_PUB_HEADER_SIZE, len - TALLY_PUB_HEADER_SIZE,
                                     &info) == TALLY_OK)
            for (int i = 0; i < STREAMS; i++) {
                char want[32];
                stream_name(want, sizeof want, i);
                if (strcmp(want, name) == 0 && strcmp(member, published_by) == 0)
                    published[i] = memcmp(info.bins, model[i], sizeof model[i]) == 0;
            }
        natsMsg_Destroy(m);
        wait_ms = 1;
    }
}

/* Waits until the member of the last forget_published() has published every stream of the
 * partitions in `parts` (a bit per partition) with its state; fails after timeout_ms. */
static void wait_published(natsSubscription *sub, unsigned parts, int timeout_ms, const char *when)
{
    int64_t until = th_now_ms() + timeout_ms;
    int missing;
    do {
        drain(sub, 200);
        missing = 0;
        for (int i = 0; i < STREAMS; i++)
            missing += (parts >> partition_of(i) & 1) && !published[i];
    } while (missing && th_now_ms() < until);
    if (missing)
        fail_msg("%s: %s did not publish the state of %d streams", when, published_by, missing);
}

/* Two members that split the partitions between them; the partitions (bits) the second owns. */
static unsigned two_members(char *a, char *b, size_t cap)
{
    for (int i = 0;; i++) {
        snprintf(a, cap, "ha%d", i);
        snprintf(b, cap, "hb%d", i);
        const char *ids[2] = {a, b};
        unsigned of_b = 0;
        for (uint32_t k = 0; k < PARTITIONS; k++)
            of_b |= (td_fleet_owner(ids, 2, k) == 1) << k;
        if (__builtin_popcount(of_b) == PARTITIONS / 2)
            return of_b;
    }
}

/* Every stream's state, asked of its owner, equals the model: the round was applied. */
static void wait_applied(tally_nats_t *p)
{
    int64_t until = th_now_ms() + 30000;
    for (int i = 0; i < STREAMS; i++) {
        char name[32];
        stream_name(name, sizeof name, i);
        tally_stream_info_t info;
        while (tally_nats_query(p, name, &info) != TALLY_OK ||
               memcmp(info.bins, model[i], sizeof model[i]) != 0) {
            if (th_now_ms() > until)
                fail_msg("stream %s: the last batch is not applied", name);
            th_sleep_ms(50);
        }
    }
}

static tally_nats_t *producer(void)
{
    tally_nats_opts_t o = {
        .servers = tn_suite.urls, .producer_id = "handover", .timeout_ms = 15000};
    tally_nats_t *p = NULL; /* made after the fleet: it reads the partition count */
    assert_int_equal(tally_nats_new(&o, &p, msg, sizeof msg), TALLY_OK);
    return p;
}

#define ALL ((1u << PARTITIONS) - 1)
#define HOUR_MS "3600000"

/* One watch test: its two members, the partitions of the second, the subscription, the producer.
 */
typedef struct {
    char a[16], b[16];
    unsigned of_b;
    natsSubscription *sub;
    tally_nats_t *p;
} watch_run_t;

/* A fresh fleet, the subscriber, member a alone with publication ticks pub_ms apart, holding
 * every partition, and a first batch on every stream. */
static void begin(watch_run_t *r, const char *pub_ms)
{
    r->of_b = two_members(r->a, r->b, sizeof r->a);
    fresh_fleet();
    assert_int_equal(natsConnection_SubscribeSync(&r->sub, tn_suite_nc, TALLY_NATS_SUBJ_WATCH ">"),
                     NATS_OK);
    start(&worker[0], r->a, "3000", pub_ms);
    wait_held(r->a, PARTITIONS, 20000);
    r->p = producer();
    push_round(r->p);
}

static void end(watch_run_t *r)
{
    natsSubscription_Destroy(r->sub);
    tally_nats_destroy(&r->p);
}

/* A batch on every stream, applied by its owner, and nothing published by member since. */
static void batch_applied(watch_run_t *r, const char *member)
{
    push_round(r->p);
    wait_applied(r->p);
    forget_published(member);
}

/* The old owner publishes a partition's changes before it gives the partition up. Publication
 * ticks an hour apart (a tick at start, with nothing to say): every publication seen is one a
 * hand-over made. A member joins; a member stops (SIGTERM); a member stopped past its lease
 * (SIGSTOP) comes back and takes its partitions back; the last worker stops. */
static void test_watch_old_owner_publishes_before_giving_up(void **state)
{
    (void)state;
    watch_run_t r;
    begin(&r, HOUR_MS);
    wait_applied(r.p);
    forget_published(r.a);
    start(&worker[1], r.b, "3000", HOUR_MS);
    wait_published(r.sub, r.of_b, 30000, "a member joined");
    wait_held(r.a, PARTITIONS / 2, 20000);
    batch_applied(&r, r.b);
    assert_int_equal(th_daemon_stop(&worker[1], SIGTERM, 20000), 0);
    wait_published(r.sub, r.of_b, 30000, "a member stopped");
    wait_held(r.a, PARTITIONS, 20000);
    start(&worker[1], r.b, "3000", HOUR_MS);
    wait_held(r.b, PARTITIONS / 2, 20000);
    assert_int_equal(kill(worker[1].pid, SIGSTOP), 0);
    wait_held(r.a, PARTITIONS, 3 * TTL_MS + 20000);
    batch_applied(&r, r.a);
    assert_int_equal(kill(worker[1].pid, SIGCONT), 0);
    wait_published(r.sub, r.of_b, 3 * TTL_MS + 30000, "a stopped member came back");
    wait_held(r.b, PARTITIONS / 2, 20000);
    assert_int_equal(th_daemon_stop(&worker[1], SIGTERM, 20000), 0);
    wait_held(r.a, PARTITIONS, 20000);
    batch_applied(&r, r.a);
    assert_int_equal(th_daemon_stop(&worker[0], SIGTERM, 20000), 0);
    wait_published(r.sub, ALL, 30000, "the last worker stopped");
    end(&r);
}

/* The new owner publishes every stream it loads from a checkpoint, changed or not, at its next
 * tick (2 s): when a member joins, when a stopped member's partitions move, when it comes back,
 * when a member stops (SIGTERM). */
static void test_watch_new_owner_publishes_what_it_loads(void **state)
{
    (void)state;
    watch_run_t r;
    begin(&r, "2000");
    forget_published(r.a);
    wait_published(r.sub, ALL, 30000, "a batch"); /* applied, published, then checkpointed */
    forget_published(r.b);
    start(&worker[1], r.b, "3000", "2000");
    wait_published(r.sub, r.of_b, 30000, "a member joined");
    forget_published(r.a);
    assert_int_equal(kill(worker[1].pid, SIGSTOP), 0);
    wait_published(r.sub, r.of_b, 3 * TTL_MS + 30000, "a stopped member's partitions moved");
    forget_published(r.b);
    assert_int_equal(kill(worker[1].pid, SIGCONT), 0);
    wait_published(r.sub, r.of_b, 3 * TTL_MS + 30000, "a stopped member came back");
    forget_published(r.a);
    assert_int_equal(th_daemon_stop(&worker[1], SIGTERM, 20000), 0);
    wait_published(r.sub, r.of_b, 30000, "a member stopped");
    assert_int_equal(th_daemon_stop(&worker[0], SIGTERM, 20000), 0);
    end(&r);
}

/* ---- A failed take-over releases its lease ----------------------------------------------------
 */

/* Partition 0's stream, made before any worker, admits one consumer: a worker's take-over can
 * make its first, but not a second while the first is there. */
static void limit_partition_0(char stream[32])
{
    char subject[32]; /* every publisher's subject of the partition, as the fleet's stream */
    tally_fleet_name(stream, 32, TALLY_NATS_STREAM_PREFIX, 0);
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, 0, "*");
    fresh_fleet();
    jsStreamConfig sc;
    jsStreamConfig_Init(&sc);
    const char *subjects[] = {subject};
    sc.Name = stream;
    sc.Subjects = subjects;
    sc.SubjectsLen = 1;
    sc.MaxConsumers = 1;
    jsErrCode jerr = 0;
    assert_int_equal(js_AddStream(NULL, tn_suite_js, &sc, NULL, &jerr), NATS_OK);
}

/* Waits for `text` in the worker's log, then until partition 0's lease is free while the
 * worker holds the others: released, with a TTL (60 s) far beyond the wait, not expired. */
static void assert_released_after(th_daemon_t *w, const char *member, const char *text)
{
    assert_true(th_daemon_wait_log(w, text, 30000));
    wait_held(member, PARTITIONS - 1, 20000);
    char holder[80];
    assert_int_equal(td_lease_holder(leases, 0, holder, sizeof holder, msg, sizeof msg), TD_OK);
    assert_string_equal(holder, "");
}

/* The take-over fails at the consumer (another consumer holds the only place): the lease key is
 * released at once; once that consumer is gone the partition is taken. */
static void test_failed_take_over_releases_the_lease(void **state)
{
    (void)state;
    char stream[32];
    limit_partition_0(stream);
    jsConsumerConfig cc;
    jsConsumerConfig_Init(&cc);
    cc.Durable = "blocker";
    cc.AckPolicy = js_AckExplicit;
    jsErrCode jerr = 0;
    assert_int_equal(js_AddConsumer(NULL, tn_suite_js, stream, &cc, NULL, &jerr), NATS_OK);
    start(&worker[0], "hx", "60000", "1000");
    assert_released_after(&worker[0], "hx", "partition 0 not taken");
    /* A take counts once its reader has made the consumer: the others, never partition 0
     * (whose take is tried again after the back-off, and fails again while the blocker is). */
    int64_t until = th_now_ms() + 30000;
    while (th_metric(&worker[0], "tallyd_nats_partitions_owned") != PARTITIONS - 1 &&
           th_now_ms() < until)
        th_sleep_ms(50);
    assert_int_equal(th_metric(&worker[0], "tallyd_nats_partitions_owned"), PARTITIONS - 1);
    assert_int_equal(th_metric(&worker[0], "tallyd_nats_partitions_taken_total"), PARTITIONS - 1);
    assert_int_equal(js_DeleteConsumer(tn_suite_js, stream, "blocker", NULL, &jerr), NATS_OK);
    wait_held("hx", PARTITIONS, 30000); /* after the worker's back-off */
    assert_int_equal(th_daemon_stop(&worker[0], SIGTERM, 20000), 0);
}

/* A stream name of partition 0. */
static void name_in_partition_0(char *name, size_t cap)
{
    for (int i = 0;; i++) {
        snprintf(name, cap, "p0s%d", i);
        if (tally_partition(name, strlen(name), PARTITIONS) == 0)
            return;
    }
}

/* Taken, then a sequence is missing in the middle of the partition (deleted): the worker reads
 * again from the one it lacks with a new consumer, which the stream refuses; the partition is
 * dropped, and before the fix its key stayed until it expired. */
static void test_dropped_partition_releases_the_lease(void **state)
{
    (void)state;
    char stream[32], subject[32], name[32];
    limit_partition_0(stream);
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, 0, TALLY_NATS_USER_ANON);
    name_in_partition_0(name, sizeof name);
    uint8_t frame[TALLY_REQ_HEADER_SIZE + 16] = {0};
    assert_int_not_equal(th_frame(th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0), name, NULL, 0, frame),
                         0);
    jsErrCode jerr = 0;
    for (int i = 0; i < 3; i++)
        assert_int_equal(js_Publish(NULL, tn_suite_js, subject, frame, sizeof frame, NULL, &jerr),
                         NATS_OK);
    assert_int_equal(js_DeleteMsg(tn_suite_js, stream, 2, NULL, &jerr), NATS_OK);
    start(&worker[0], "hy", "60000", "1000");
    assert_released_after(&worker[0], "hy", "its consumer could not be made again");
    assert_int_equal(th_daemon_stop(&worker[0], SIGTERM, 20000), 0);
}

/* ---- Hand-overs at the keys' changes, not at the next heartbeat ------------------------------ */

/* A lease of 90 s: a heartbeat every 30 s, so only the key watch (td_fleet_keys.c) brings a
 * hand-over within HANDOVER_MS; at the heartbeat's timing the joining member's share comes at
 * its second heartbeat, 30 s after its start, and the leaving member's partitions up to 30 s
 * after it left. */
#define LONG_TTL_MS "90000"
#define HANDOVER_MS 12000

static void test_hand_over_at_key_changes(void **state)
{
    (void)state;
    char a[16], b[16];
    unsigned of_b = two_members(a, b, sizeof a);
    fresh_fleet();
    start(&worker[0], a, LONG_TTL_MS, HOUR_MS);
    wait_held(a, PARTITIONS, 20000);
    /* b joins: a gives b's share up as soon as b's member key is written, and b takes it as
     * soon as a has released each lease. */
    int64_t t0 = th_now_ms();
    start(&worker[1], b, LONG_TTL_MS, HOUR_MS);
    wait_held(b, __builtin_popcount(of_b), HANDOVER_MS);
    wait_held(a, PARTITIONS - __builtin_popcount(of_b), HANDOVER_MS);
    int64_t t1 = th_now_ms();
    /* b leaves (SIGTERM): it releases its leases and deletes its member key; a takes them. */
    assert_int_equal(th_daemon_stop(&worker[1], SIGTERM, 20000), 0);
    wait_held(a, PARTITIONS, HANDOVER_MS);
    fprintf(stderr, "b joined: its share %lld ms after its start; b left: a held all %lld ms after "
                    "the SIGTERM\n",
            (long long)(t1 - t0), (long long)(th_now_ms() - t1));
    assert_int_equal(th_daemon_stop(&worker[0], SIGTERM, 20000), 0);
}

int main(void)
{
    if (tn_skip())
        return 77;
    th_seed();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_failed_take_over_releases_the_lease, stop_workers),
        cmocka_unit_test_teardown(test_dropped_partition_releases_the_lease, stop_workers),
        cmocka_unit_test_teardown(test_watch_old_owner_publishes_before_giving_up, stop_workers),
        cmocka_unit_test_teardown(test_watch_new_owner_publishes_what_it_loads, stop_workers),
        cmocka_unit_test_teardown(test_hand_over_at_key_changes, stop_workers),
    };
    int failed = cmocka_run_group_tests(tests, setup, teardown);
    nats_Close(); /* libnats' threads and globals: gone before the leak check */
    return failed;
}
