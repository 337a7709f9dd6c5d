/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_gaps.c — what a fleet worker meets when JetStream no longer holds what it expects,
 * against a real (one-node) JetStream server (PROTOCOL.md §13):
 *   - a partition stream whose messages after the worker's checkpoint were purged before it
 *     applied them: the restarted worker restores the checkpoint, finds the gap (the stream's
 *     first sequence is past the checkpoint's + 1: td_partition_first_seq), counts it in
 *     tallyd_nats_gaps_total, says which sequences are gone, and applies what is left, once;
 *   - a checkpoint whose chunks do not add up (td_nats_ckpt.c): a chunk deleted, a chunk longer
 *     than the manifest says, a chunk shorter (caught by the length, before the CRC), a manifest
 *     whose chunk count does not fit its length, each refused as corrupt with its reason by a
 *     read and by a new owner's take (which then fences nothing); a manifest deleted reads as no
 * checkpoint, and a new owner starts afresh;
 *   - another writer in the worker's way: its lease overwritten (the next renewal finds it lost,
 *     the partition and its local streams are dropped, and taken again once the stranger's key
 *     expires), and its checkpoint fenced by another take (the next checkpoint finds it and drops
 *     the partition, which the worker takes back, fencing the other): either way every message
 *     is applied exactly once in the end;
 *   - a stale release (the previous holder's revision) leaves the successor's lease;
 *   - JetStream refusing the worker's writes: the dead-letter stream deleted (a message that
 *     fails its checks waits, tried again, until it can be a dead letter: then one dead letter,
 *     one error reply, and what came after it applied once); the checkpoint bucket refusing a
 *     manifest (counted in tallyd_nats_checkpoint_failures_total; the worker keeps applying, and
 *     the next checkpoint after the limit is lifted holds everything); a checkpoint that cannot
 *     be loaded at a take (not taken, the lease given back; taken once it is whole again).
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
#include "td_nats_ckpt.h"
#include "td_nats_js.h"
#include "td_nats_lease.h"

#define cluster tn_suite
#define js tn_suite_js
static char msg[512];

static int setup(void **state)
{
    (void)state;
    return tn_suite_setup(1);
}

static int teardown(void **state)
{
    (void)state;
    return tn_suite_teardown();
}

/* ---- a gap in the partition stream -------------------------------------------------------- */

#define MSG_BYTES 100

/* tallyd as the only worker of a one-partition fleet. */
static void start_worker(th_daemon_t *d)
{
    const char *args[] = {"--nats-servers",
                          cluster.urls,
                          "--nats-replicas",
                          "1",
                          "--nats-partitions",
                          "1",
                          "--nats-lease-ttl-ms",
                          "3000",
                          "--nats-checkpoint-interval-ms",
                          "200",
                          "--nats-member-id",
                          "gapper",
                          "--window-intervals",
                          "0",
                          NULL};
    assert_int_equal(th_daemon_start(d, args), 0);
}

/* Waits until the worker holds partition 0 (its lease names it). */
static void wait_owned(void)
{
    kvStore *leases = NULL;
    int64_t t0 = th_now_ms();
    char holder[80] = "";
    while (strcmp(holder, "gapper") != 0 && th_now_ms() - t0 < 20000) {
        if (!leases && js_KeyValue(&leases, js, TALLY_NATS_BUCKET_LEASES) != NATS_OK)
            leases = NULL; /* not made yet: the worker makes the buckets */
        if (!leases || td_lease_holder(leases, 0, holder, sizeof holder, msg, sizeof msg) != TD_OK)
            holder[0] = '\0';
        if (strcmp(holder, "gapper") != 0)
            th_sleep_ms(50);
    }
    kvStore_Destroy(leases);
    assert_string_equal(holder, "gapper");
}

/* Message v: a u8 hist of MSG_BYTES bytes all equal to v, on `stream` (with a reply when
 * asked, which is then awaited). */
static void send_value_to(tally_nats_t *p, const char *stream, uint8_t v, bool reply)
{
    uint8_t batch[MSG_BYTES];
    memset(batch, v, sizeof batch);
    tally_req_t req;
    memset(&req, 0, sizeof req);
    req.opcode = TALLY_OP_HIST;
    req.dtype = TALLY_DTYPE_U8;
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    assert_int_equal(tally_nats_send(p, &req, batch, sizeof batch, reply, NULL, NULL), TALLY_OK);
    assert_int_equal(tally_nats_flush(p), TALLY_OK);
    if (reply) {
        tally_reply_t r;
        tally_reply_init(&r);
        assert_int_equal(tally_nats_recv(p, 20000, &r), TALLY_OK);
        assert_int_equal(r.rep.status, TALLY_OK);
        tally_reply_clear(&r);
    }
}

static void send_value(tally_nats_t *p, uint8_t v, bool reply)
{
    send_value_to(p, "gap", v, reply);
}

static uint64_t partition_first_seq(uint64_t *last)
{
    char stream[32];
    tally_fleet_name(stream, sizeof stream, TALLY_NATS_STREAM_PREFIX, 0);
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    assert_int_equal(js_GetStreamInfo(&si, js, stream, NULL, &jerr), NATS_OK);
    uint64_t first = si->State.FirstSeq;
    *last = si->State.LastSeq;
    jsStreamInfo_Destroy(si);
    return first;
}

/* Values 1..5 applied and checkpointed (a clean stop); 6..9 published with no worker running;
 * 6 and 7 purged. The worker comes back: 8 and 9 applied, the gap 6..7 counted and named. */
static void test_gap_after_purge(void **state)
{
    (void)state;
    th_daemon_t w;
    start_worker(&w);
    wait_owned();
    tally_nats_opts_t o = {.servers = cluster.urls, .producer_id = "gaps", .timeout_ms = 15000};
    tally_nats_t *p = NULL;
    assert_int_equal(tally_nats_new(&o, &p, msg, sizeof msg), TALLY_OK);
    for (uint8_t v = 1; v <= 5; v++)
        send_value(p, v, true);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0); /* checkpoints at 5, releases */
    uint64_t last = 0, first = partition_first_seq(&last);
    assert_int_equal(first, 1);
    assert_int_equal(last, 5);
    for (uint8_t v = 6; v <= 9; v++)
        send_value(p, v, false);
    char stream[32];
    tally_fleet_name(stream, sizeof stream, TALLY_NATS_STREAM_PREFIX, 0);
    jsOptions po;
    jsOptions_Init(&po);
    po.Stream.Purge.Sequence = 8; /* up to, not including */
    jsErrCode jerr = 0;
    assert_int_equal(js_PurgeStream(js, stream, &po, &jerr), NATS_OK);
    assert_int_equal(partition_first_seq(&last), 8);
    assert_int_equal(last, 9);

    start_worker(&w);
    wait_owned();
    tally_stream_info_t info = {0};
    for (int64_t t0 = th_now_ms(); info.batches < 7 && th_now_ms() - t0 < 20000;)
        if (tally_nats_query(p, "gap", &info) != TALLY_OK || info.batches < 7)
            th_sleep_ms(50);
    assert_int_equal(info.batches, 7);
    assert_int_equal(info.hist_total, 7 * MSG_BYTES);
    for (int b = 0; b < 256; b++) {
        bool sent = (b >= 1 && b <= 5) || b == 8 || b == 9;
        assert_int_equal(info.bins[b], sent ? MSG_BYTES : 0);
    }
    void *sock = th_connect(w.endpoint, 10000);
    assert_int_equal(th_stat(sock, "tallyd_nats_gaps_total"), 1);
    th_close(sock);
    assert_true(th_daemon_log_contains(
        &w, "partition 0: sequences 6..7 were removed from its stream before they were applied"));
    tally_nats_destroy(&p);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

/* ---- another writer in the worker's way ----------------------------------------------------- */

/* A producer; each test has its own id (JetStream drops a message id it saw within its
 * duplicate window, and a producer numbers its messages from 1). */
static tally_nats_t *producer(const char *id)
{
    tally_nats_opts_t o = {.servers = cluster.urls, .producer_id = id, .timeout_ms = 15000};
    tally_nats_t *p = NULL;
    assert_int_equal(tally_nats_new(&o, &p, msg, sizeof msg), TALLY_OK);
    return p;
}

/* `stream` holds values first..last, each once (MSG_BYTES of each), within 30 s. */
static void holds_each_once(tally_nats_t *p, const char *stream, int first, int last)
{
    tally_stream_info_t info = {0};
    uint64_t want = (uint64_t)(last - first + 1) * MSG_BYTES;
    for (int64_t t0 = th_now_ms(); th_now_ms() - t0 < 30000; th_sleep_ms(100))
        if (tally_nats_query(p, stream, &info) == TALLY_OK && info.hist_total >= want)
            break;
    assert_int_equal(info.hist_total, want);
    for (int b = first; b <= last; b++)
        assert_int_equal(info.bins[b], MSG_BYTES);
}

/* The lease key overwritten by a stranger that never renews it. */
static void test_lease_overwritten(void **state)
{
    (void)state;
    th_daemon_t w;
    start_worker(&w);
    wait_owned();
    tally_nats_t *p = producer("steal");
    for (uint8_t v = 1; v <= 3; v++)
        send_value_to(p, "steal", v, true);
    kvStore *leases = NULL;
    assert_int_equal(js_KeyValue(&leases, js, TALLY_NATS_BUCKET_LEASES), NATS_OK);
    uint64_t rev = 0;
    assert_int_equal(kvStore_PutString(&rev, leases, "p0", "stranger"), NATS_OK);
    assert_true(th_daemon_wait_log(
        &w, "partition 0 lost: its lease was lost; its local state is dropped", 30000));
    for (uint8_t v = 4; v <= 6; v++) /* while nobody applies them */
        send_value_to(p, "steal", v, false);
    /* The stranger's key expires (the bucket's TTL); the worker takes the partition again from
     * its last checkpoint and applies what came after, once. */
    wait_owned();
    holds_each_once(p, "steal", 1, 6);
    void *sock = th_connect(w.endpoint, 10000);
    assert_true(th_stat(sock, "tallyd_nats_leases_lost_total") >= 1);
    th_close(sock);
    kvStore_Destroy(leases);
    tally_nats_destroy(&p);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

/* Another take of the partition's checkpoint (a stranger's epoch) while the worker owns it. */
static void test_checkpoint_fenced(void **state)
{
    (void)state;
    th_daemon_t w;
    start_worker(&w);
    wait_owned();
    tally_nats_t *p = producer("fence");
    for (uint8_t v = 1; v <= 3; v++)
        send_value_to(p, "fence", v, true);
    kvStore *ckpts = NULL;
    assert_int_equal(td_nats_kv_open(js, TALLY_NATS_BUCKET_CKPT, 0, 1, &ckpts, msg, sizeof msg),
                     TD_OK);
    td_ckpt_t other;
    uint8_t *st = NULL;
    size_t len = 0;
    bool fenced = true;
    assert_int_equal(td_ckpt_take(&other, js, ckpts, 0, "stranger", 1ull << 40, &st, &len, &fenced,
                                  msg, sizeof msg),
                     TD_OK);
    assert_false(fenced);
    free(st);
    /* The worker's next checkpoint (after this message) meets the fence. */
    send_value_to(p, "fence", 4, true);
    assert_true(
        th_daemon_wait_log(&w, "partition 0 lost: another worker holds its checkpoint", 30000));
    send_value_to(p, "fence", 5, false);
    /* Its own lease runs out (it stopped renewing it), it takes the partition again, fencing the
     * stranger, and catches up from the checkpoint the stranger took over. */
    assert_true(th_daemon_wait_log(&w, "gapper took partition 0", 30000));
    holds_each_once(p, "fence", 1, 5);
    kvStore_Destroy(ckpts);
    tally_nats_destroy(&p);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

/* A release is a compare-and-set on the releaser's revision: B's stale release, after A took the
 * partition, leaves A's lease (one node: every read is the latest, none served by a replica that
 * lags, as test_nats_fleet's three nodes may). */
static void test_stale_release_keeps_successor(void **state)
{
    (void)state;
    kvStore *leases = NULL;
    assert_int_equal(
        td_nats_kv_open(js, TALLY_NATS_BUCKET_LEASES, 3000, 1, &leases, msg, sizeof msg), TD_OK);
    enum { K = 9 }; /* a partition of its own in the bucket */
    td_lease_t a = {0}, b = {0};
    bool taken = false;
    char holder[80];
    assert_int_equal(td_lease_acquire(leases, K, "B", 3000, &b, &taken, msg, sizeof msg), TD_OK);
    assert_true(taken);
    td_lease_t stale_b = b;
    assert_int_equal(td_lease_release(js, K, &b, msg, sizeof msg), TD_OK);
    assert_int_equal(td_lease_holder(leases, K, holder, sizeof holder, msg, sizeof msg), TD_OK);
    assert_string_equal(holder, "");
    assert_int_equal(td_lease_acquire(leases, K, "A", 3000, &a, &taken, msg, sizeof msg), TD_OK);
    assert_true(taken);
    assert_int_equal(td_lease_release(js, K, &stale_b, msg, sizeof msg), TD_OK);
    assert_int_equal(td_lease_holder(leases, K, holder, sizeof holder, msg, sizeof msg), TD_OK);
    assert_string_equal(holder, "A");
    assert_int_equal(td_lease_release(js, K, &a, msg, sizeof msg), TD_OK);
    kvStore_Destroy(leases);
}

/* ---- checkpoint chunks that do not add up ------------------------------------------------- */

#define CK 7 /* a partition number of its own in the bucket (the worker above used 0) */

static void chunk_key(char *key, size_t cap, const td_ckpt_t *c, unsigned i)
{
    snprintf(key, cap, "p%u.%llu.%u.%u", CK, (unsigned long long)c->cur.chunk_epoch,
             (unsigned)(c->cur.generation % 2), i);
}

/* Both a read and a new owner's take refuse the checkpoint as corrupt, saying `why`; the take
 * fences nothing (the next take's epoch still sees the old manifest). */
static void refused(kvStore *kv, const char *why)
{
    td_ckpt_manifest_t m;
    uint8_t *st = (uint8_t *)"x";
    size_t len = 1;
    assert_int_equal(td_ckpt_read(js, CK, &m, &st, &len, msg, sizeof msg), TD_ERR_CORRUPT);
    if (!strstr(msg, why))
        fail_msg("read: '%s', not '%s'", msg, why);
    assert_null(st);
    assert_int_equal(len, 0);
    td_ckpt_t other;
    bool fenced = true;
    assert_int_equal(
        td_ckpt_take(&other, js, kv, CK, "other", 900, &st, &len, &fenced, msg, sizeof msg),
        TD_ERR_CORRUPT);
    assert_non_null(strstr(msg, why));
    assert_false(fenced);
    assert_null(st);
    assert_int_equal(td_ckpt_read(js, CK, &m, &st, &len, msg, sizeof msg), TD_ERR_CORRUPT);
    assert_string_equal(m.member, "owner"); /* still the owner's manifest */
}

static void test_ckpt_chunks_that_do_not_add_up(void **state)
{
    (void)state;
    kvStore *kv = NULL;
    assert_int_equal(td_nats_kv_open(js, TALLY_NATS_BUCKET_CKPT, 0, 1, &kv, msg, sizeof msg),
                     TD_OK);
    size_t big_len = 2 * TD_CKPT_CHUNK_BYTES + 1000; /* three chunks, the last one short */
    uint8_t *big = malloc(big_len + 1);
    assert_non_null(big);
    for (size_t i = 0; i < big_len + 1; i++)
        big[i] = (uint8_t)(th_rand() >> 24);
    td_ckpt_t c;
    uint8_t *st = NULL;
    size_t len = 0;
    bool fenced = true;
    assert_int_equal(
        td_ckpt_take(&c, js, kv, CK, "owner", 800, &st, &len, &fenced, msg, sizeof msg), TD_OK);
    assert_false(fenced);
    assert_int_equal(len, 0); /* none before */
    assert_int_equal(td_ckpt_write(&c, 11, big, big_len, &fenced, msg, sizeof msg), TD_OK);
    assert_int_equal(c.cur.chunks, 3);
    char key[64];
    uint64_t rev = 0;

    /* Chunk 1 deleted. */
    chunk_key(key, sizeof key, &c, 1);
    assert_int_equal(kvStore_Delete(kv, key), NATS_OK);
    refused(kv, "missing");
    assert_int_equal(
        kvStore_Put(&rev, kv, key, big + TD_CKPT_CHUNK_BYTES, (int)TD_CKPT_CHUNK_BYTES), NATS_OK);
    td_ckpt_manifest_t m;
    assert_int_equal(td_ckpt_read(js, CK, &m, &st, &len, msg, sizeof msg), TD_OK); /* whole */
    assert_int_equal(len, big_len);
    assert_memory_equal(st, big, big_len);
    free(st);

    /* The last chunk one byte longer than the manifest says. */
    chunk_key(key, sizeof key, &c, 2);
    assert_int_equal(kvStore_Put(&rev, kv, key, big + 2 * TD_CKPT_CHUNK_BYTES, 1001), NATS_OK);
    refused(kv, "longer than the manifest says");
    /* ... and one byte shorter. */
    assert_int_equal(kvStore_Put(&rev, kv, key, big + 2 * TD_CKPT_CHUNK_BYTES, 999), NATS_OK);
    refused(kv, "chunks shorter than the manifest says");

    /* A manifest that counts two chunks for three chunks' worth of state: inconsistent, refused
     * before any chunk is read. */
    assert_int_equal(kvStore_Put(&rev, kv, key, big + 2 * TD_CKPT_CHUNK_BYTES, 1000), NATS_OK);
    td_ckpt_manifest_t wrong = c.cur;
    wrong.chunks = 2;
    uint8_t value[TD_CKPT_MANIFEST_SIZE];
    td_ckpt_manifest_encode(&wrong, value);
    char manifest_key[16];
    tally_fleet_name(manifest_key, sizeof manifest_key, "p", CK);
    assert_int_equal(kvStore_Put(&rev, kv, manifest_key, value, (int)sizeof value), NATS_OK);
    refused(kv, "checkpoint manifest inconsistent");

    /* The manifest deleted: no checkpoint to read; a new owner starts from nothing. */
    char manifest[16];
    tally_fleet_name(manifest, sizeof manifest, "p", CK);
    assert_int_equal(kvStore_Delete(kv, manifest), NATS_OK);
    assert_int_equal(td_ckpt_read(js, CK, &m, &st, &len, msg, sizeof msg), TD_ERR_CONFIG);
    assert_non_null(strstr(msg, "has no checkpoint"));
    td_ckpt_t fresh;
    assert_int_equal(
        td_ckpt_take(&fresh, js, kv, CK, "fresh", 1000, &st, &len, &fenced, msg, sizeof msg),
        TD_OK);
    assert_false(fenced);
    assert_null(st);
    assert_int_equal(len, 0);
    assert_int_equal(td_ckpt_write(&fresh, 1, big, 10, &fenced, msg, sizeof msg), TD_OK);
    assert_int_equal(td_ckpt_read(js, CK, &m, &st, &len, msg, sizeof msg), TD_OK);
    assert_int_equal(len, 10);
    assert_int_equal(m.applied_seq, 1);
    assert_string_equal(m.member, "fresh");
    free(st);
    free(big);
    kvStore_Destroy(kv);
}

/* ---- JetStream refusing the worker's writes ------------------------------------------------- */

/* The fleet's objects as the worker makes them (partitions 1, lease TTL 3000 ms): made again
 * after a test removed one. */
static void fleet_ensure(void)
{
    td_nats_layout_t l = {.partitions = 1,
                          .replicas = 1,
                          .partition_max_bytes = 64ll << 20,
                          .partition_max_age_ms = 3600 * 1000,
                          .lease_ttl_ms = 3000,
                          .max_msg_size = (int32_t)natsConnection_GetMaxPayload(tn_suite_nc)};
    assert_int_equal(td_nats_fleet_ensure(js, &l, msg, sizeof msg), TD_OK);
}

static long long stat_of(const th_daemon_t *w, const char *name)
{
    void *sock = th_connect(w->endpoint, 10000);
    long long v = th_stat(sock, name);
    th_close(sock);
    return v;
}

/* The dead-letter stream deleted behind the worker's back: a message that fails its checks
 * cannot be put there, so it is not done with (no reply, nothing after it applied) but tried
 * again, saying why, until the stream is back; then it is a dead letter once, its publisher
 * gets one error reply, and the message after it is applied once. */
static void test_dead_letters_gone(void **state)
{
    (void)state;
    th_daemon_t w;
    start_worker(&w);
    wait_owned();
    jsErrCode jerr = 0;
    assert_int_equal(js_DeleteStream(js, TALLY_NATS_DEAD_STREAM, NULL, &jerr), NATS_OK);
    natsSubscription *inbox = NULL;
    assert_int_equal(natsConnection_SubscribeSync(&inbox, tn_suite_nc, "_INBOX.anon.dead"),
                     NATS_OK);
    char subject[48];
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, 0, TALLY_NATS_USER_ANON);
    natsMsg *bad = NULL;
    assert_int_equal(natsMsg_Create(&bad, subject, NULL, "too short", 9), NATS_OK);
    assert_int_equal(natsMsgHeader_Set(bad, TALLY_NATS_HDR_REPLY, "_INBOX.anon.dead"), NATS_OK);
    jsPubAck *pa = NULL;
    assert_int_equal(js_PublishMsg(&pa, js, bad, NULL, &jerr), NATS_OK);
    uint64_t seq = pa->Sequence;
    jsPubAck_Destroy(pa);
    natsMsg_Destroy(bad);
    tally_nats_t *p = producer("dead");
    send_value_to(p, "afterdead", 5, false);
    char text[96];
    snprintf(text, sizeof text, "dead letter of partition 0 sequence %llu: ",
             (unsigned long long)seq);
    assert_true(th_daemon_wait_log(&w, text, 30000));
    natsMsg *r = NULL;
    assert_int_equal(natsSubscription_NextMsg(&r, inbox, 300), NATS_TIMEOUT);
    tally_stream_info_t info = {0};
    assert_true(tally_nats_query(p, "afterdead", &info) != TALLY_OK || info.batches == 0);
    assert_int_equal(stat_of(&w, "tallyd_nats_dead_letters_total"), 0);

    fleet_ensure(); /* the stream is back */
    assert_int_equal(natsSubscription_NextMsg(&r, inbox, 20000), NATS_OK);
    tally_rep_t rep;
    assert_true(natsMsg_GetDataLength(r) >= TALLY_REP_HEADER_SIZE);
    assert_int_equal(tally_rep_decode((const uint8_t *)natsMsg_GetData(r), TALLY_REP_HEADER_SIZE,
                                      &rep),
                     TALLY_OK);
    assert_int_equal(rep.status, TALLY_E_HEADER);
    natsMsg_Destroy(r);
    holds_each_once(p, "afterdead", 5, 5);
    assert_int_equal(natsSubscription_NextMsg(&r, inbox, 300), NATS_TIMEOUT); /* one reply */
    assert_int_equal(stat_of(&w, "tallyd_nats_dead_letters_total"), 1);
    natsMsg *d = NULL;
    assert_int_equal(js_GetLastMsg(&d, js, TALLY_NATS_DEAD_STREAM, TALLY_NATS_SUBJ_DEAD ">", NULL,
                                   &jerr),
                     NATS_OK);
    assert_int_equal(natsMsg_GetSequence(d), 1); /* the only one */
    const char *v = NULL;
    assert_int_equal(natsMsgHeader_Get(d, TALLY_NATS_HDR_STATUS, &v), NATS_OK);
    assert_string_equal(v, tally_status_name(TALLY_E_HEADER));
    char seqs[24];
    snprintf(seqs, sizeof seqs, "%llu", (unsigned long long)seq);
    assert_int_equal(natsMsgHeader_Get(d, TALLY_NATS_HDR_SEQ, &v), NATS_OK);
    assert_string_equal(v, seqs);
    natsMsg_Destroy(d);
    natsSubscription_Destroy(inbox);

    /* The same for a message the request path refuses (a reset of no stream): its dead letter
     * fails, it is sent again until the stream is back; the worker stopped meanwhile gives the
     * partition up at the message before it, and the next run makes it one dead letter. */
    assert_int_equal(js_DeleteStream(js, TALLY_NATS_DEAD_STREAM, NULL, &jerr), NATS_OK);
    tally_req_t req;
    memset(&req, 0, sizeof req);
    req.opcode = TALLY_OP_RESET;
    assert_int_equal(tally_req_set_stream(&req, "nosuch"), TALLY_OK);
    assert_int_equal(tally_nats_send(p, &req, NULL, 0, false, NULL, NULL), TALLY_OK);
    assert_int_equal(tally_nats_flush(p), TALLY_OK);
    snprintf(text, sizeof text, "dead letter of partition 0 sequence %llu: ",
             (unsigned long long)seq + 2);
    assert_true(th_daemon_wait_log(&w, text, 30000));
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
    assert_true(th_daemon_log_contains(&w, "gave partition 0 up at sequence "));
    fleet_ensure();
    start_worker(&w);
    wait_owned();
    for (int64_t t0 = th_now_ms();
         stat_of(&w, "tallyd_nats_dead_letters_total") < 1 && th_now_ms() - t0 < 20000;)
        th_sleep_ms(50);
    assert_int_equal(stat_of(&w, "tallyd_nats_dead_letters_total"), 1); /* this run's */
    assert_int_equal(js_GetLastMsg(&d, js, TALLY_NATS_DEAD_STREAM, TALLY_NATS_SUBJ_DEAD ">", NULL,
                                   &jerr),
                     NATS_OK);
    assert_int_equal(natsMsg_GetSequence(d), 1);
    assert_int_equal(natsMsgHeader_Get(d, TALLY_NATS_HDR_STATUS, &v), NATS_OK);
    assert_string_equal(v, tally_status_name(TALLY_E_UNKNOWN_STREAM));
    natsMsg_Destroy(d);
    tally_nats_destroy(&p);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

/* The checkpoint bucket's stream limited to messages smaller than a manifest behind the
 * worker's back: each checkpoint fails (its manifest still the one the worker knows, so not
 * fenced), is counted and said, and the worker keeps the partition and goes on applying; once
 * the limit is lifted the next checkpoint holds everything applied. */
static void test_checkpoint_refused(void **state)
{
    (void)state;
    th_daemon_t w;
    start_worker(&w);
    wait_owned();
    tally_nats_t *p = producer("limit");
    send_value_to(p, "limit", 1, true);
    jsStreamInfo *si = NULL, *si2 = NULL;
    jsErrCode jerr = 0;
    assert_int_equal(js_GetStreamInfo(&si, js, "KV_" TALLY_NATS_BUCKET_CKPT, NULL, &jerr),
                     NATS_OK);
    jsStreamConfig sc = *si->Config;
    sc.MaxMsgSize = 16;
    assert_int_equal(js_UpdateStream(&si2, js, &sc, NULL, &jerr), NATS_OK);
    jsStreamInfo_Destroy(si2);
    send_value_to(p, "limit", 2, true);
    assert_true(th_daemon_wait_log(
        &w, "fleet: checkpoint of partition 0: writing checkpoint of partition 0: ", 30000));
    assert_true(stat_of(&w, "tallyd_nats_checkpoint_failures_total") >= 1);
    send_value_to(p, "limit", 3, true); /* still its owner */
    holds_each_once(p, "limit", 1, 3);

    sc = *si->Config;
    assert_int_equal(js_UpdateStream(&si2, js, &sc, NULL, &jerr), NATS_OK);
    jsStreamInfo_Destroy(si2);
    jsStreamInfo_Destroy(si);
    uint64_t last = 0;
    partition_first_seq(&last);
    td_ckpt_manifest_t m = {0};
    for (int64_t t0 = th_now_ms(); m.applied_seq != last && th_now_ms() - t0 < 20000;
         th_sleep_ms(100)) {
        uint8_t *st = NULL;
        size_t len = 0;
        if (td_ckpt_read(js, 0, &m, &st, &len, msg, sizeof msg) != TD_OK)
            m.applied_seq = 0;
        free(st);
    }
    assert_int_equal(m.applied_seq, last);
    assert_string_equal(m.member, "gapper");
    tally_nats_destroy(&p);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

/* A checkpoint that cannot be loaded when the worker takes the partition (a manifest that is not
 * one; then a whole checkpoint whose state is not a state table): not taken, saying why, its
 * lease given back at once (not held until it expires); once the checkpoint is good again the
 * worker takes it (after its back-off) and has what it held. */
static void test_take_refused_corrupt_checkpoint(void **state)
{
    (void)state;
    kvStore *ckpts = NULL, *leases = NULL;
    assert_int_equal(js_KeyValue(&ckpts, js, TALLY_NATS_BUCKET_CKPT), NATS_OK);
    assert_int_equal(js_KeyValue(&leases, js, TALLY_NATS_BUCKET_LEASES), NATS_OK);
    kvEntry *good = NULL;
    assert_int_equal(kvStore_Get(&good, ckpts, "p0"), NATS_OK);
    uint64_t rev = 0;
    assert_int_equal(kvStore_Put(&rev, ckpts, "p0", "not a manifest", 14), NATS_OK);
    th_daemon_t w;
    start_worker(&w);
    assert_true(th_daemon_wait_log(
        &w, "partition 0 not taken: not a version-1, 2 or 3 checkpoint manifest (14 bytes)",
        30000));
    char holder[80] = "?";
    for (int64_t t0 = th_now_ms(); holder[0] && th_now_ms() - t0 < 10000; th_sleep_ms(50))
        assert_int_equal(td_lease_holder(leases, 0, holder, sizeof holder, msg, sizeof msg),
                         TD_OK);
    assert_string_equal(holder, ""); /* released */
    /* A whole checkpoint (CRC right) of a state that is not one: not taken either. */
    assert_int_equal(kvStore_Purge(ckpts, "p0", NULL), NATS_OK);
    td_ckpt_t c;
    uint8_t *st = NULL;
    size_t len = 0;
    bool fenced = true;
    assert_int_equal(
        td_ckpt_take(&c, js, ckpts, 0, "stranger", 999, &st, &len, &fenced, msg, sizeof msg),
        TD_OK);
    assert_int_equal(td_ckpt_write(&c, 1, (const uint8_t *)"no state table", 14, &fenced, msg,
                                   sizeof msg),
                     TD_OK);
    assert_false(fenced);
    assert_true(th_daemon_wait_log(&w, "partition 0 not taken: its checkpoint: ", 30000));
    assert_int_equal(kvStore_Put(&rev, ckpts, "p0", kvEntry_Value(good), kvEntry_ValueLen(good)),
                     NATS_OK);
    kvEntry_Destroy(good);
    wait_owned();
    tally_nats_t *p = producer("corrupt");
    holds_each_once(p, "limit", 1, 3); /* test_checkpoint_refused's */
    tally_nats_destroy(&p);
    kvStore_Destroy(ckpts);
    kvStore_Destroy(leases);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

int main(void)
{
    if (tn_skip())
        return 77;
    th_seed();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gap_after_purge),
        cmocka_unit_test(test_lease_overwritten),
        cmocka_unit_test(test_checkpoint_fenced),
        cmocka_unit_test(test_stale_release_keeps_successor),
        cmocka_unit_test(test_ckpt_chunks_that_do_not_add_up),
        cmocka_unit_test(test_dead_letters_gone),
        cmocka_unit_test(test_checkpoint_refused),
        cmocka_unit_test(test_take_refused_corrupt_checkpoint),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
