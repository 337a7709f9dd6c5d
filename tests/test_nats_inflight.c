/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_inflight.c — the fence of a pipelined partition (issue 32; PROTOCOL.md §13 "Leases
 * and fencing"): a worker paused (SIGSTOP) with messages of several partitions in its request
 * path, woken after another worker took them, writes nothing: none of their replies, no
 * checkpoint under the leases it lost. Its messages run on a simulated GPU whose every launch
 * takes 200 ms, so that when the first reply has come the others are still in the path; when it
 * wakes they complete, and their replies reach the fleet thread while it drops its partitions
 * one by one (dropping one waits on the request path, which hands it the others' replies): only
 * the check right before a reply is published (td_part_reply's td_part_may_write) keeps those
 * in. The mutant fleet-reply-unfenced (tests/mutants.txt) removes it, and this test fails.
 *
 * Replies say who answered (Tally-Member): every message gets its reply from the worker that took
 * over, and none from the paused one after it woke.
 *
 * Then a partition held a second by its full window says so, and why (the mutant
 * fleet-stall-reason-lost makes it say nothing holds it).
 */
#include <pthread.h>
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
#include "tally_fleet.h"
#include "tally_proto.h"
#include "td_nats_ckpt.h"

#define PARTITIONS 4
#define STREAMS 16
#define BYTES (64u << 10) /* a GPU's batch: the simulated launch's latency applies */
#define INBOX TALLY_NATS_INBOX TALLY_NATS_USER_ANON ".inflight"

/* What the test saw: replies by member (time, the message's number + 1 from its Tally-Msg-Id),
 * checkpoint manifest writes by member (time, epoch in seq). */
typedef struct {
    int64_t at_ms;
    char member[TALLY_NATS_MEMBER_ID_MAX + 1];
    uint64_t seq;
    tally_status_t status;
} seen_t;
#define SEEN_MAX 4096
static seen_t replies[SEEN_MAX], ckpts[SEEN_MAX];
static size_t nreplies, nckpts;
static pthread_mutex_t seen_mu = PTHREAD_MUTEX_INITIALIZER;
static th_daemon_t wa, wb, wc;

static void on_reply(natsConnection *c, natsSubscription *s, natsMsg *m, void *closure)
{
    (void)c, (void)s, (void)closure;
    seen_t r = {.at_ms = th_now_ms(), .status = TALLY_E_HEADER};
    const char *v = NULL;
    if (natsMsgHeader_Get(m, TALLY_NATS_HDR_MEMBER, &v) == NATS_OK)
        snprintf(r.member, sizeof r.member, "%s", v);
    const char *prefix = TALLY_NATS_USER_ANON ".inflight.";
    if (natsMsgHeader_Get(m, TALLY_NATS_HDR_REPLY_ID, &v) == NATS_OK &&
        strncmp(v, prefix, strlen(prefix)) == 0)
        r.seq = strtoull(v + strlen(prefix), NULL, 10) + 1; /* the message's number + 1 */
    tally_rep_t rep;
    if (natsMsg_GetDataLength(m) >= (int)TALLY_REP_HEADER_SIZE &&
        tally_rep_decode((const uint8_t *)natsMsg_GetData(m), TALLY_REP_HEADER_SIZE, &rep) ==
            TALLY_OK)
        r.status = (tally_status_t)rep.status;
    pthread_mutex_lock(&seen_mu);
    if (nreplies < SEEN_MAX)
        replies[nreplies++] = r;
    pthread_mutex_unlock(&seen_mu);
    natsMsg_Destroy(m);
}

static void on_ckpt(natsConnection *c, natsSubscription *s, natsMsg *m, void *closure)
{
    (void)c, (void)s, (void)closure;
    seen_t w = {.at_ms = th_now_ms()};
    const uint8_t *v = (const uint8_t *)natsMsg_GetData(m);
    if (!strchr(natsMsg_GetSubject(m) + strlen("$KV." TALLY_NATS_BUCKET_CKPT "."), '.') &&
        natsMsg_GetDataLength(m) >= (int)TD_CKPT_MANIFEST_SIZE) {
        memcpy(w.member, v + TD_CKPT_MEMBER_OFF, TALLY_NATS_MEMBER_ID_MAX);
        w.seq = tally_get_u64(v + 16); /* the epoch */
    }
    pthread_mutex_lock(&seen_mu);
    if (nckpts < SEEN_MAX)
        ckpts[nckpts++] = w;
    pthread_mutex_unlock(&seen_mu);
    natsMsg_Destroy(m);
}

/* Replies (or checkpoint writes) by member since since_ms; distinct: count each sequence once. */
static size_t count(const seen_t *list, const size_t *n, const char *member, int64_t since_ms,
                    bool distinct)
{
    bool got[STREAMS + 1] = {false};
    size_t c = 0;
    pthread_mutex_lock(&seen_mu);
    for (size_t i = 0; i < *n; i++) {
        if (strcmp(list[i].member, member) != 0 || list[i].at_ms < since_ms)
            continue;
        if (distinct && (list[i].seq == 0 || list[i].seq > STREAMS || got[list[i].seq] ||
                         list[i].status != TALLY_OK))
            continue;
        if (distinct)
            got[list[i].seq] = true;
        c++;
    }
    pthread_mutex_unlock(&seen_mu);
    return c;
}

/* latency_us: each simulated launch's (NULL: the CPU backend); inflight: a partition's window,
 * and two shards, so that the fleet thread hands its requests to them itself (a port of the
 * request path) whatever shards the run's other tallyds have (NULL: the defaults). */
static void start(th_daemon_t *d, const char *member, const char *ckpt_ms, const char *latency_us,
                  const char *inflight)
{
    const char *args[] = {"--nats-servers",
                          tn_suite.urls,
                          "--nats-replicas",
                          "1",
                          "--nats-partitions",
                          "4",
                          "--nats-lease-ttl-ms",
                          "2000",
                          "--nats-checkpoint-interval-ms",
                          ckpt_ms,
                          "--nats-member-id",
                          member,
                          "--window-intervals",
                          "0",
                          inflight ? "--nats-inflight" : NULL,
                          inflight,
                          "--shards",
                          "2",
                          NULL};
    const char *sim[] = {"--backend", "cuda", "--test-sim-gpus", "1", NULL};
    if (latency_us)
        setenv("TALLYD_TEST_SIM_LATENCY_US", latency_us, 1);
    assert_int_equal(th_daemon_start_with(d, args, latency_us ? sim : NULL), 0);
    unsetenv("TALLYD_TEST_SIM_LATENCY_US");
}

/* One 64 KiB hist on stream `name` (a GPU's batch: the simulated launch's latency applies),
 * asking for its reply on INBOX under dedupe id "<anon>.<tag>.<i>". */
static void publish_one(const char *name, const char *tag, int i)
{
    static uint8_t data[TALLY_REQ_HEADER_SIZE + BYTES];
    for (size_t j = 0; j < BYTES; j++)
        data[TALLY_REQ_HEADER_SIZE + j] = (uint8_t)(j * 7);
    char subject[64], id[64];
    uint32_t k = tally_partition(name, strlen(name), PARTITIONS);
    assert_int_not_equal(th_frame(th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0), name, NULL, 0, data),
                         0);
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, k, TALLY_NATS_USER_ANON);
    snprintf(id, sizeof id, "%s.%s.%d", TALLY_NATS_USER_ANON, tag, i);
    assert_int_equal(tn_publish(tn_suite_js, subject, data, sizeof data, INBOX, id), NATS_OK);
}

/* One 64 KiB hist on each of STREAMS streams (a stream per message: sequences 1..STREAMS, the
 * partitions spread), each asking for its reply on INBOX. */
static void publish_all(void)
{
    for (int i = 0; i < STREAMS; i++) {
        char name[32];
        snprintf(name, sizeof name, "inflight/%d", i);
        publish_one(name, "inflight", i);
    }
}

static bool wait_for(const char *member, size_t want, int timeout_ms)
{
    int64_t t0 = th_now_ms();
    while (count(replies, &nreplies, member, 0, true) < want && th_now_ms() - t0 < timeout_ms)
        th_sleep_ms(20);
    return count(replies, &nreplies, member, 0, true) >= want;
}

static void test_paused_worker_with_messages_in_flight_writes_nothing(void **state)
{
    (void)state;
    natsSubscription *rs = NULL, *cs = NULL;
    assert_int_equal(natsConnection_Subscribe(&rs, tn_suite_nc, INBOX, on_reply, NULL), NATS_OK);
    assert_int_equal(natsConnection_Subscribe(&cs, tn_suite_nc, "$KV." TALLY_NATS_BUCKET_CKPT ".>",
                                              on_ckpt, NULL),
                     NATS_OK);
    start(&wa, "wa", "60000", "200000", NULL);
    int held = 0;
    assert_true(tn_wait_leases(tn_suite_js, PARTITIONS, "wa", PARTITIONS, 30000, &held) >= 0);
    publish_all();
    assert_true(wait_for("wa", 1, 30000)); /* the first is applied: the others are in the path */
    /* Stopped between two bursts of replies (the simulated launches end 200 ms apart), once
     * none has come for 50 ms: a reply published right before SIGSTOP sat in libnats's buffer
     * until SIGCONT and came "late", though sent under a valid lease (CI's coverage build,
     * 2026-12-03 16:49 UTC: "wa stopped with 3 of 16 replies sent ... after waking, wa sent 1"). */
    for (size_t seen = 0, now = count(replies, &nreplies, "wa", 0, true); seen != now;
         now = count(replies, &nreplies, "wa", 0, true)) {
        seen = now;
        th_sleep_ms(50);
    }
    kill(wa.pid, SIGSTOP);
    int64_t stopped = th_now_ms();
    size_t before = count(replies, &nreplies, "wa", 0, true);
    print_message("wa stopped with %zu of %d replies sent\n", before, STREAMS);
    assert_true(before < STREAMS / 2); /* most of them in flight */

    start(&wb, "wb", "200", NULL, NULL);
    assert_true(tn_wait_leases(tn_suite_js, PARTITIONS, "wb", PARTITIONS, 30000, &held) >= 0);
    assert_true(wait_for("wb", STREAMS, 30000)); /* everything applied by wb before wa wakes */
    th_sleep_ms(300);                            /* wa's writes before its pause have landed */
    int64_t woke = th_now_ms();
    print_message("wb applied all %d after %lld ms; wa wakes\n", STREAMS,
                  (long long)(woke - stopped));
    kill(wa.pid, SIGCONT);
    th_sleep_ms(3000); /* its in-flight messages complete, it drops its partitions, joins again */

    size_t late = count(replies, &nreplies, "wa", woke, false);
    size_t late_ckpts = count(ckpts, &nckpts, "wa", woke, false);
    print_message("after waking, wa sent %zu replies; its checkpoint writes: %zu\n", late,
                  late_ckpts);
    assert_int_equal(late, 0);
    /* wa joins again and may take partitions back (fencing writes of its own, new epochs): none
     * of its writes may carry an epoch it held before the pause */
    pthread_mutex_lock(&seen_mu);
    size_t stale = 0;
    for (size_t i = 0; i < nckpts; i++)
        for (size_t j = 0; j < nckpts && ckpts[i].at_ms >= woke; j++)
            stale += strcmp(ckpts[i].member, "wa") == 0 && strcmp(ckpts[j].member, "wa") == 0 &&
                     ckpts[j].at_ms < stopped && ckpts[j].seq == ckpts[i].seq;
    pthread_mutex_unlock(&seen_mu);
    assert_int_equal(stale, 0);
    assert_true(th_daemon_log_contains(&wa, "lost"));
    /* the pause held the fleet thread, every partition with it: said, part by part */
    assert_true(th_daemon_log_contains(&wa, "fleet: a turn of the fleet thread took "));
    natsSubscription_Destroy(rs);
    natsSubscription_Destroy(cs);
    assert_int_equal(th_daemon_stop(&wb, SIGTERM, 20000), 0);
    assert_int_equal(th_daemon_stop(&wa, SIGTERM, 20000), 0);
}

/* A partition whose full window holds its fetched messages a second says so, once, and why
 * (td_fleet_window.c, say_if_stalled): a window of one message (--nats-inflight 1), on a simulated
 * GPU whose launch takes 2.5 s, with two more of its stream fetched behind it. Then SIGTERM with
 * that launch still running past the partition's give-up: the fleet thread takes its port's
 * last reply (td_fleet.c, await_port), or the stop, which counts it, never ends (found here:
 * tallyd hung with its fleet thread gone). */
static void test_a_partition_held_by_its_full_window_says_so(void **state)
{
    (void)state;
    start(&wc, "wc", "60000", "2500000", "1");
    int held = 0;
    assert_true(tn_wait_leases(tn_suite_js, PARTITIONS, "wc", PARTITIONS, 30000, &held) >= 0);
    for (int i = 0; i < 3; i++)
        publish_one("held/0", "held", i);
    assert_true(
        th_daemon_wait_log(&wc, "and waiting: its window is full (1 of 1 messages, ", 15000));
    assert_int_equal(th_daemon_stop(&wc, SIGTERM, 20000), 0);
    assert_true(th_daemon_log_contains(
        &wc, "fleet: waiting for 1 of its messages still in the request path"));
}

static int setup(void **state)
{
    (void)state;
    return tn_suite_setup(1);
}

static int teardown(void **state)
{
    (void)state;
    th_daemon_end(&wa);
    th_daemon_end(&wb);
    th_daemon_end(&wc);
    return tn_suite_teardown();
}

int main(void)
{
    if (tn_skip())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_paused_worker_with_messages_in_flight_writes_nothing),
        cmocka_unit_test(test_a_partition_held_by_its_full_window_says_so),
    };
    int failed = cmocka_run_group_tests(tests, setup, teardown);
    nats_Close();
    return failed;
}
