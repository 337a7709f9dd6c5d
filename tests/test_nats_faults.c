/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_faults.c — the fleet under faults, end to end (issue 22's test; PROTOCOL.md §13):
 * a 3-node JetStream cluster (R3), 3 tallyd workers, 8 partitions, 200 streams, a producer
 * pushing numbered hist and scan batches (seq per stream) with whole rounds published twice
 * under the same ids. During the run:
 *   - the workers join one by one: each join moves exactly the partitions rendezvous hashing
 *     gives the newcomer, nothing between the others;
 *   - kill -9 of a worker: its partitions move to the others within the lease TTL and a few
 *     seconds;
 *   - kill -9 of a NATS server (then its restart);
 *   - SIGSTOP of a worker past its lease, then SIGCONT: its partitions move, and after it wakes
 *     it writes nothing under the leases it lost (every checkpoint write on the cluster is
 *     watched: none carries its old epochs);
 * and at the end every stream's state (histogram, scan carry, batches, last seq) equals a
 * single-process model that applied each batch once.
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

#include "fleet_helpers.h"
#include "harness.h"
#include "nats_cluster.h"
#include "tally.h"
#include "tally_fleet.h"
#include "td_fleet_plan.h"
#include "td_nats_ckpt.h"
#include "td_nats_lease.h"

#define PARTITIONS 8
#define WORKERS 3
#define STREAMS 200
#define TTL_MS 4000
#define HIST_BYTES 256

typedef struct {
    uint64_t bins[256];
    uint64_t hist_total;
    int64_t carry;
    uint64_t batches;
    uint64_t seq;
} stream_model_t;

static stream_model_t model[STREAMS];
static th_daemon_t workers[WORKERS];
static const char *ids[WORKERS] = {"fa", "fb", "fc"};
static char msg[512];

/* Every checkpoint write seen on the cluster ($KV.TALLY_CKPT.>): its time, the member and
 * epoch of a manifest, or the epoch of a chunk key. */
#define WRITES_MAX 100000
typedef struct {
    int64_t at_ms;
    char member[TALLY_NATS_MEMBER_ID_MAX + 1];
    uint64_t epoch;
} ckpt_write_t;
static ckpt_write_t writes[WRITES_MAX];
static size_t nwrites;
static pthread_mutex_t writes_mu = PTHREAD_MUTEX_INITIALIZER;

static void on_ckpt_write(natsConnection *c, natsSubscription *s, natsMsg *m, void *closure)
{
    (void)c, (void)s, (void)closure;
    const char *key = natsMsg_GetSubject(m) + strlen("$KV." TALLY_NATS_BUCKET_CKPT ".");
    ckpt_write_t w = {.at_ms = th_now_ms()};
    const uint8_t *v = (const uint8_t *)natsMsg_GetData(m);
    if (strchr(key, '.')) { /* a chunk p<k>.<epoch>.<slot>.<i> */
        w.epoch = strtoull(strchr(key, '.') + 1, NULL, 10);
    } else if (natsMsg_GetDataLength(m) >= (int)TD_CKPT_MANIFEST_SIZE) {
        w.epoch = tally_get_u64(v + 16);
        memcpy(w.member, v + TD_CKPT_MEMBER_OFF, TALLY_NATS_MEMBER_ID_MAX);
    }
    pthread_mutex_lock(&writes_mu);
    if (nwrites < WRITES_MAX)
        writes[nwrites++] = w;
    pthread_mutex_unlock(&writes_mu);
    natsMsg_Destroy(m);
}

/* Worker 1 is the one paused later: it checkpoints seldom, so that it holds applied messages
 * not yet checkpointed when it is stopped (what it must then never write). */
static void start_worker(int i)
{
    const char *extra[] = {"--nats-lease-ttl-ms", "4000", "--nats-checkpoint-interval-ms",
                           i == 1 ? "10000" : "250", NULL};
    assert_int_equal(tf_worker_start(&workers[i], ids[i], PARTITIONS, extra), 0);
}

/* The holder of every partition's lease into holders[k] ("" when free). */
static void holders_now(char holders[PARTITIONS][80])
{
    kvStore *leases = NULL;
    if (js_KeyValue(&leases, tn_suite_js, TALLY_NATS_BUCKET_LEASES) != NATS_OK) {
        /* not made yet: the first worker makes the fleet's buckets, retrying while the cluster
         * forms (seen in CI under ASan 2 s in), so no lease is held */
        for (uint32_t k = 0; k < PARTITIONS; k++)
            holders[k][0] = 0;
        return;
    }
    for (uint32_t k = 0; k < PARTITIONS; k++)
        if (td_lease_holder(leases, k, holders[k], 80, msg, sizeof msg) != TD_OK)
            holders[k][0] = 0;
    kvStore_Destroy(leases);
}

/* Waits until every partition is held as rendezvous hashing over members[0..n) says; the time
 * it took. */
static int64_t wait_plan(const char *const *members, size_t n, int timeout_ms)
{
    int64_t t0 = th_now_ms();
    char holders[PARTITIONS][80];
    for (;;) {
        holders_now(holders);
        bool done = true;
        for (uint32_t k = 0; k < PARTITIONS && done; k++)
            done = strcmp(holders[k], members[td_fleet_owner(members, n, k)]) == 0;
        if (done)
            return th_now_ms() - t0;
        if (th_now_ms() - t0 > timeout_ms) {
            for (uint32_t k = 0; k < PARTITIONS; k++)
                print_message("partition %u: held by '%s', belongs to %s\n", (unsigned)k,
                              holders[k], members[td_fleet_owner(members, n, k)]);
            fail_msg("the partitions did not settle within %d ms", timeout_ms);
        }
        th_sleep_ms(100);
    }
}

static void stream_name(char *buf, size_t cap, int i)
{
    snprintf(buf, cap, "site/%03d", i);
}

/* tally_nats_send, again while it times out (a stream leader away: its last PubAck is late). */
static void send_retrying(tally_nats_t *p, const tally_req_t *req, const void *data, size_t len)
{
    tally_status_t st = TALLY_E_TIMEOUT;
    for (int i = 0; i < 12 && st == TALLY_E_TIMEOUT; i++)
        st = tally_nats_send(p, req, data, len, false, NULL, NULL);
    if (st != TALLY_OK) {
        for (uint32_t k = 0; k < PARTITIONS; k++) {
            char name[32];
            tally_fleet_name(name, sizeof name, TALLY_NATS_STREAM_PREFIX, k);
            jsStreamInfo *si = NULL;
            jsErrCode jerr = 0;
            natsStatus s = js_GetStreamInfo(&si, tn_suite_js, name, NULL, &jerr);
            char subject[48];
            tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, k, "anon");
            jsPubOptions po;
            jsPubOptions_Init(&po);
            po.MaxWait = 3000;
            jerr = 0;
            natsStatus ps = js_Publish(NULL, tn_suite_js, subject, "", 0, &po, &jerr);
            if (ps != NATS_OK)
                print_message("  %s: %d %s\n", subject, (int)jerr, nats_GetLastError(NULL));
            print_message("%s: %s, leader %s, %llu msgs; a publish now: %s\n", name,
                          natsStatus_GetText(s),
                          si && si->Cluster && si->Cluster->Leader ? si->Cluster->Leader : "-",
                          si ? (unsigned long long)si->State.Msgs : 0ull, natsStatus_GetText(ps));
            jsStreamInfo_Destroy(si);
        }
        fail_msg("send: %s", tally_nats_error(p));
    }
}

/* One round: a numbered hist and a numbered scan on every stream, bytes from seed. With
 * `record`, the model takes them (a replay under the same ids must not count). */
static void push_round(tally_nats_t *p, uint64_t seed, uint64_t first_seq, bool record)
{
    uint64_t x = seed | 1;
    for (int i = 0; i < STREAMS; i++) {
        char name[32];
        stream_name(name, sizeof name, i);
        uint8_t hist[HIST_BYTES];
        int32_t scan[8];
        for (size_t j = 0; j < sizeof hist; j++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            hist[j] = (uint8_t)(x >> 24);
        }
        for (size_t j = 0; j < 8; j++)
            scan[j] = (int32_t)(x >> (j * 4)) % 1000;
        tally_req_t h = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8, .seq = first_seq};
        tally_req_t s = {.opcode = TALLY_OP_SCAN, .dtype = TALLY_DTYPE_I32, .seq = first_seq + 1};
        assert_int_equal(tally_req_set_stream(&h, name), TALLY_OK);
        assert_int_equal(tally_req_set_stream(&s, name), TALLY_OK);
        send_retrying(p, &h, hist, sizeof hist);
        send_retrying(p, &s, scan, sizeof scan);
        if (!record)
            continue;
        stream_model_t *m = &model[i];
        for (size_t j = 0; j < sizeof hist; j++)
            m->bins[hist[j]]++;
        m->hist_total += sizeof hist;
        for (size_t j = 0; j < 8; j++)
            m->carry += scan[j];
        m->batches += 2;
        m->seq = first_seq + 1;
    }
    tally_status_t st = TALLY_E_TIMEOUT;
    for (int i = 0; i < 12 && st == TALLY_E_TIMEOUT; i++) /* a server or leader may be away */
        st = tally_nats_flush(p);
    assert_int_equal(st, TALLY_OK);
}

/* Debugging a failure: what the partition's JetStream stream and the dead letters still hold
 * of stream i. */
static void dump_stream_messages(int i)
{
    char name[32], stream[32];
    stream_name(name, sizeof name, i);
    uint32_t k = tally_partition(name, strlen(name), PARTITIONS);
    tally_fleet_name(stream, sizeof stream, TALLY_NATS_STREAM_PREFIX, k);
    const char *streams[2] = {stream, "TALLY_DEAD"};
    for (int s = 0; s < 2; s++) {
        jsStreamInfo *si = NULL;
        jsErrCode jerr = 0;
        if (js_GetStreamInfo(&si, tn_suite_js, streams[s], NULL, &jerr) != NATS_OK)
            continue;
        print_message("%s: first %llu last %llu msgs %llu\n", streams[s],
                      (unsigned long long)si->State.FirstSeq, (unsigned long long)si->State.LastSeq,
                      (unsigned long long)si->State.Msgs);
        for (uint64_t q = si->State.FirstSeq; q <= si->State.LastSeq; q++) {
            natsMsg *m = NULL;
            if (js_GetMsg(&m, tn_suite_js, streams[s], q, NULL, &jerr) != NATS_OK)
                continue;
            tally_req_t r;
            char why[256];
            if (natsMsg_GetDataLength(m) >= TALLY_REQ_HEADER_SIZE &&
                tally_req_decode((const uint8_t *)natsMsg_GetData(m), TALLY_REQ_HEADER_SIZE, &r,
                                 why, sizeof why) == TALLY_OK &&
                r.stream_len == strlen(name) && memcmp(r.stream, name, r.stream_len) == 0) {
                const char *id = NULL;
                natsMsgHeader_Get(m, "Nats-Msg-Id", &id);
                print_message("  %s seq %llu: op %u seq %llu id %s\n", streams[s],
                              (unsigned long long)q, r.opcode, (unsigned long long)r.seq,
                              id ? id : "-");
            }
            natsMsg_Destroy(m);
        }
        jsStreamInfo_Destroy(si);
    }
}

/* Every stream equals the model once the owners have caught up. */
static void check_model_eventually(tally_nats_t *p, int timeout_ms)
{
    int64_t t0 = th_now_ms();
    int bad = -1;
    tally_stream_info_t info;
    memset(&info, 0, sizeof info);
    while (th_now_ms() - t0 < timeout_ms) {
        bad = -1;
        for (int i = 0; i < STREAMS && bad < 0; i++) {
            char name[32];
            stream_name(name, sizeof name, i);
            const stream_model_t *m = &model[i];
            if (tally_nats_query(p, name, &info) != TALLY_OK) {
                memset(&info, 0, sizeof info); /* no owner right now: ask again */
                bad = i;
                continue;
            }
            if (info.hist_total != m->hist_total || info.scan_carry != m->carry ||
                info.batches != m->batches || info.last_seq != m->seq ||
                memcmp(info.bins, m->bins, sizeof m->bins) != 0)
                bad = i;
            if (info.hist_total > m->hist_total || info.batches > m->batches)
                fail_msg("stream %d applied a batch twice: %llu batches, model %llu", i,
                         (unsigned long long)info.batches, (unsigned long long)m->batches);
        }
        if (bad < 0)
            return;
        th_sleep_ms(200);
    }
    dump_stream_messages(bad);
    fail_msg("stream %d: batches %llu (model %llu), hist_total %llu (%llu), carry %lld (%lld), "
             "last_seq %llu (%llu)",
             bad, (unsigned long long)info.batches, (unsigned long long)model[bad].batches,
             (unsigned long long)info.hist_total, (unsigned long long)model[bad].hist_total,
             (long long)info.scan_carry, (long long)model[bad].carry,
             (unsigned long long)info.last_seq, (unsigned long long)model[bad].seq);
}

/* The epochs (lease revisions) of the checkpoints member wrote last, partition by partition. */
static size_t epochs_of(const char *member, uint64_t *epochs)
{
    size_t n = 0;
    for (uint32_t k = 0; k < PARTITIONS; k++) {
        td_ckpt_manifest_t m;
        uint8_t *st = NULL;
        size_t len = 0;
        if (td_ckpt_read(tn_suite_js, k, &m, &st, &len, msg, sizeof msg) == TD_OK &&
            strcmp(m.member, member) == 0)
            epochs[n++] = m.epoch;
        free(st);
    }
    return n;
}

static void test_fleet_under_faults(void **state)
{
    (void)state;
    natsSubscription *watch = NULL;
    assert_int_equal(natsConnection_Subscribe(&watch, tn_suite_nc,
                                              "$KV." TALLY_NATS_BUCKET_CKPT ".>", on_ckpt_write,
                                              NULL),
                     NATS_OK);
    /* Joins, one by one: each moves only the newcomer's share. */
    for (int i = 0; i < WORKERS; i++) {
        start_worker(i);
        int64_t took = wait_plan(ids, (size_t)i + 1, 60000);
        print_message("%d worker(s): partitions as planned after %lld ms\n", i + 1,
                      (long long)took);
    }
    tally_nats_opts_t o = {.servers = tn_suite.urls, .producer_id = "faults", .timeout_ms = 10000};
    tally_nats_t *p = NULL, *replay = NULL;
    assert_int_equal(tally_nats_new(&o, &p, msg, sizeof msg), TALLY_OK);
    assert_int_equal(tally_nats_new(&o, &replay, msg, sizeof msg), TALLY_OK);
    uint64_t seq = 1;
    uint64_t seed0 = th_rand();
    push_round(p, seed0, seq, true);
    push_round(replay, seed0, seq, false); /* the same ids again: JetStream keeps one */
    seq += 2;
    push_round(p, th_rand(), seq, true);
    seq += 2;

    /* kill -9 of a worker. */
    assert_int_equal(th_daemon_stop(&workers[0], SIGKILL, 5000), 128 + SIGKILL);
    push_round(p, th_rand(), seq, true);
    seq += 2;
    int64_t moved = wait_plan(ids + 1, 2, TTL_MS + 30000);
    print_message("kill -9 of %s: its partitions moved in %lld ms (lease %d ms)\n", ids[0],
                  (long long)moved, TTL_MS);
    assert_true(moved <= TTL_MS + 15000);

    /* kill -9 of a NATS server; the producer and the workers go on; it comes back. */
    assert_int_equal(tn_node_kill(&tn_suite, 1, SIGKILL), 0);
    push_round(p, th_rand(), seq, true);
    seq += 2;
    assert_int_equal(tn_node_restart(&tn_suite, 1, 60000), 0);
    print_message("NATS node 1 restarted (%s)\n", tn_suite.node[1].url);
    push_round(p, th_rand(), seq, true);
    seq += 2;
    check_model_eventually(p, 60000);

    /* SIGSTOP past the lease, then SIGCONT: stopped right after a round was applied, while it
     * holds messages not yet checkpointed (it checkpoints every 10 s). */
    wait_plan(ids + 1, 2, TTL_MS + 30000);
    uint64_t old_epochs[PARTITIONS];
    size_t n_old = epochs_of(ids[1], old_epochs);
    assert_true(n_old > 0);
    push_round(p, th_rand(), seq, true);
    seq += 2;
    check_model_eventually(p, 60000); /* applied: by the paused one too, not checkpointed */
    kill(workers[1].pid, SIGSTOP);
    push_round(p, th_rand(), seq, true);
    seq += 2;
    const char *left[1] = {ids[2]};
    moved = wait_plan(left, 1, TTL_MS + 30000);
    print_message("SIGSTOP of %s: its partitions moved in %lld ms\n", ids[1], (long long)moved);
    int64_t woke = th_now_ms();
    kill(workers[1].pid, SIGCONT);
    push_round(p, th_rand(), seq, true);
    seq += 2;
    wait_plan(ids + 1, 2, TTL_MS + 30000); /* awake, it is a member again */
    push_round(p, th_rand(), seq, true);
    seq += 2;
    check_model_eventually(p, 60000);

    /* After waking it wrote no checkpoint under a lease it had lost. */
    natsSubscription_Unsubscribe(watch);
    pthread_mutex_lock(&writes_mu);
    size_t total = nwrites, stale = 0;
    for (size_t i = 0; i < total; i++)
        for (size_t j = 0; j < n_old; j++)
            stale += writes[i].at_ms >= woke && writes[i].epoch == old_epochs[j];
    pthread_mutex_unlock(&writes_mu);
    print_message("%zu checkpoint writes seen, %zu under the paused worker's lost leases\n", total,
                  stale);
    assert_true(total > 0);
    assert_int_equal(stale, 0);
    natsSubscription_Destroy(watch);
    tally_nats_destroy(&p);
    tally_nats_destroy(&replay);
    for (int i = 1; i < WORKERS; i++)
        assert_int_equal(th_daemon_stop(&workers[i], SIGTERM, 30000), 0);
}

static int setup(void **state)
{
    (void)state;
    return tn_suite_setup(3);
}

static int teardown(void **state)
{
    (void)state;
    for (int i = 0; i < WORKERS; i++)
        th_daemon_end(&workers[i]);
    return tn_suite_teardown();
}

int main(void)
{
    if (tn_skip())
        return 77;
    th_seed();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fleet_under_faults),
    };
    int failed = cmocka_run_group_tests(tests, setup, teardown);
    nats_Close(); /* libnats' threads and globals: gone before the leak check */
    return failed;
}
