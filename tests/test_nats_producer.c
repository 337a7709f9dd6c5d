/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_producer.c — libtally's NATS producer (tally_nats_*, PROTOCOL.md §13) against a
 * real 3-node JetStream cluster (tests/lib/nats_cluster.c) whose fleet objects are made by the
 * worker's own code (td_nats_fleet_ensure):
 *   - without a fleet, connecting says so;
 *   - a message is the request header followed by its payload, on tally.in.<partition>, with
 *     Nats-Msg-Id "<user>.<producer>.<n>" and Tally-Reply when a reply is wanted;
 *   - two producers with one id: the second publish of an id is a duplicate, stored once;
 *   - a batch over max_payload is cut into whole-element requests on the same stream, seq
 *     counting up, their payloads joined the batch; a scan with a reply is cut so the reply fits;
 *     a scan without a stream that would need cutting is refused and sends nothing;
 *   - what cannot go to a partition (an op not published, a shared-memory reference, seq
 *     passing 2^64 - 1 over the parts) is refused and sends nothing;
 *   - options against the cluster (partitions over the maximum, a partition count given), calls
 *     that nobody answers (timeouts, `streams` with every partition missing), and a fleet KV
 *     whose partition count is not valid;
 *   - tally_nats_sub_* with messages written by the test: the ones that do not decode are
 *     consumed as TALLY_E_REPLY, a good one gives its stream and record;
 *   - kill -9 of the partition's stream leader while PubAcks are outstanding: the flush still
 *     succeeds and the stream holds every message exactly once.
 */
#include <setjmp.h>
#include <poll.h>
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
#include "td_nats_js.h"

#define PARTITIONS 4

#define cluster tn_suite
#define nc tn_suite_nc
#define js tn_suite_js

static int setup(void **state)
{
    (void)state;
    if (tn_suite_setup(3) != 0)
        return -1;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    return tn_suite_teardown();
}

static void make_fleet(void)
{
    td_nats_layout_t l = {.partitions = PARTITIONS,
                          .replicas = 3,
                          .partition_max_bytes = 256ll << 20,
                          .partition_max_age_ms = 3600 * 1000,
                          .lease_ttl_ms = 4000,
                          .max_msg_size = (int32_t)natsConnection_GetMaxPayload(nc)};
    char msg[256] = "";
    td_err_t err = TD_ERR_LIBRARY;
    /* Just after start the meta leader may not know all 3 peers yet: R3 can fail at first. */
    for (int i = 0; i < 50 && err != TD_OK; i++) {
        err = td_nats_fleet_ensure(js, &l, msg, sizeof msg);
        if (err != TD_OK)
            th_sleep_ms(200);
    }
    if (err != TD_OK)
        fail_msg("fleet: %s", msg);
}

static tally_nats_t *producer(const char *id, int timeout_ms)
{
    tally_nats_opts_t o = {.servers = cluster.urls, .producer_id = id, .timeout_ms = timeout_ms};
    tally_nats_t *p = NULL;
    char msg[256] = "";
    tally_status_t st = tally_nats_new(&o, &p, msg, sizeof msg);
    if (st != TALLY_OK)
        fail_msg("tally_nats_new: %s", msg);
    return p;
}

static uint64_t stream_msgs(uint32_t k, uint64_t *first, uint64_t *last)
{
    uint64_t n = 0;
    assert_int_equal(tn_partition_seqs(js, k, &n, first, last), 0);
    return n;
}

/* Message seq of partition k's stream. Asked again for up to 10 s while JetStream fails to
 * answer (not a missing message): just after a node's kill the stream's new leader may not
 * serve reads yet (CI's ASan stage, 2026-12-07: NATS_ERR reading the 300 messages that
 * test_pub_ack_after_node_kill had all acknowledged). */
static natsMsg *stream_msg(uint32_t k, uint64_t seq)
{
    char name[32];
    tally_fleet_name(name, sizeof name, TALLY_NATS_STREAM_PREFIX, k);
    natsMsg *m = NULL;
    natsStatus s = NATS_ERR;
    for (int i = 0; i < 100; i++) {
        jsErrCode jerr = 0;
        s = js_GetMsg(&m, js, name, seq, NULL, &jerr);
        if (s == NATS_OK || s == NATS_NOT_FOUND || jerr == JSNoMessageFoundErr)
            break;
        th_sleep_ms(100);
    }
    assert_int_equal(s, NATS_OK);
    return m;
}

static const char *header(natsMsg *m, const char *key)
{
    const char *v = NULL;
    return natsMsgHeader_Get(m, key, &v) == NATS_OK ? v : NULL;
}

static tally_req_t hist_u8(const char *stream)
{
    tally_req_t r;
    memset(&r, 0, sizeof r);
    r.opcode = TALLY_OP_HIST;
    r.dtype = TALLY_DTYPE_U8;
    assert_int_equal(tally_req_set_stream(&r, stream), TALLY_OK);
    return r;
}

static void test_no_fleet(void **state)
{
    (void)state;
    tally_nats_opts_t o = {.servers = cluster.urls, .timeout_ms = 3000};
    tally_nats_t *p = NULL;
    char msg[256] = "";
    assert_int_equal(tally_nats_new(&o, &p, msg, sizeof msg), TALLY_E_ARG);
    assert_null(p);
    assert_non_null(strstr(msg, "no tallyd fleet"));
    /* A malformed option is refused before anything is sent. */
    o.producer_id = "bad id";
    assert_int_equal(tally_nats_new(&o, &p, msg, sizeof msg), TALLY_E_ARG);
    make_fleet();
}

static void test_message_and_duplicate(void **state)
{
    (void)state;
    tally_nats_t *a = producer("dup-prod", 5000), *b = producer("dup-prod", 5000);
    assert_int_equal(tally_nats_partitions(a), PARTITIONS);
    uint32_t k = tally_partition("dup", 3, PARTITIONS);
    uint64_t before = stream_msgs(k, NULL, NULL);
    tally_req_t r = hist_u8("dup");
    const uint8_t payload[5] = {1, 2, 3, 4, 5};
    uint64_t id = 0, chunks = 0;
    assert_int_equal(tally_nats_send(a, &r, payload, 5, true, &id, &chunks), TALLY_OK);
    assert_int_equal(id, 1);
    assert_int_equal(chunks, 1);
    assert_int_equal(tally_nats_flush(a), TALLY_OK);
    assert_int_equal(tally_nats_send(b, &r, payload, 5, false, NULL, NULL), TALLY_OK);
    assert_int_equal(tally_nats_flush(b), TALLY_OK);
    tally_nats_stats_t sa, sb;
    tally_nats_stats(a, &sa);
    tally_nats_stats(b, &sb);
    assert_int_equal(sa.acked, 1);
    assert_int_equal(sa.duplicates, 0);
    assert_int_equal(sb.acked, 1);
    assert_int_equal(sb.duplicates, 1); /* same id "anon.dup-prod.1": stored once */
    uint64_t last = 0;
    assert_int_equal(stream_msgs(k, NULL, &last), before + 1);

    natsMsg *m = stream_msg(k, last);
    char subject[48]; /* its publisher's user: the cluster has no users, so "anon" */
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, k, "anon");
    assert_string_equal(natsMsg_GetSubject(m), subject);
    assert_int_equal(natsMsg_GetDataLength(m), TALLY_REQ_HEADER_SIZE + 5);
    tally_req_t got;
    char why[256];
    assert_int_equal(tally_req_decode((const uint8_t *)natsMsg_GetData(m), TALLY_REQ_HEADER_SIZE,
                                      &got, why, sizeof why),
                     TALLY_OK);
    assert_int_equal(got.opcode, TALLY_OP_HIST);
    assert_int_equal(got.request_id, 1);
    assert_memory_equal(natsMsg_GetData(m) + TALLY_REQ_HEADER_SIZE, payload, 5);
    assert_string_equal(header(m, "Nats-Msg-Id"), "anon.dup-prod.1");
    assert_non_null(header(m, "Tally-Reply")); /* a's message: it wanted a reply */
    natsMsg_Destroy(m);
    tally_nats_destroy(&a);
    tally_nats_destroy(&b);
    assert_null(a);
}

static void test_split(void **state)
{
    (void)state;
    tally_nats_t *p = producer(NULL, 10000);
    size_t max = tally_nats_max_payload(p);
    assert_int_equal(max, 8u << 20);
    size_t len = 20u << 20;
    uint8_t *big = malloc(len);
    assert_non_null(big);
    for (size_t i = 0; i < len; i++)
        big[i] = (uint8_t)(i * 7 + (i >> 20));
    tally_req_t r = hist_u8("big");
    r.seq = 5;
    uint64_t id = 0, chunks = 0;
    uint32_t k = tally_partition("big", 3, PARTITIONS);
    uint64_t last_before = 0;
    stream_msgs(k, NULL, &last_before);
    assert_int_equal(tally_nats_send(p, &r, big, len, false, &id, &chunks), TALLY_OK);
    assert_int_equal(chunks, 3);
    assert_int_equal(tally_nats_flush(p), TALLY_OK);
    size_t off = 0;
    for (uint64_t i = 0; i < chunks; i++) {
        natsMsg *m = stream_msg(k, last_before + 1 + i);
        tally_req_t got;
        char why[256];
        const uint8_t *data = (const uint8_t *)natsMsg_GetData(m);
        size_t mlen = (size_t)natsMsg_GetDataLength(m);
        assert_true(mlen <= max - TALLY_NATS_HEADROOM);
        assert_int_equal(tally_req_decode(data, TALLY_REQ_HEADER_SIZE, &got, why, sizeof why),
                         TALLY_OK);
        assert_int_equal(got.seq, 5 + i);
        assert_int_equal(got.request_id, id + i);
        assert_memory_equal(data + TALLY_REQ_HEADER_SIZE, big + off, mlen - TALLY_REQ_HEADER_SIZE);
        off += mlen - TALLY_REQ_HEADER_SIZE;
        natsMsg_Destroy(m);
    }
    assert_int_equal(off, len);

    /* A scan with a reply: each part's int64 reply must fit a message too. */
    tally_req_t scan;
    memset(&scan, 0, sizeof scan);
    scan.opcode = TALLY_OP_SCAN;
    scan.dtype = TALLY_DTYPE_I32;
    assert_int_equal(tally_nats_send(p, &scan, big, 5u << 20, true, NULL, &chunks),
                     TALLY_E_ARG); /* no stream: cannot be cut */
    assert_non_null(strstr(tally_nats_error(p), "cannot be split"));
    assert_int_equal(tally_nats_send(p, &scan, big, 1u << 20, true, NULL, &chunks), TALLY_OK);
    assert_int_equal(chunks, 1);
    assert_int_equal(tally_req_set_stream(&scan, "carry"), TALLY_OK);
    assert_int_equal(tally_nats_send(p, &scan, big, 12u << 20, true, NULL, &chunks), TALLY_OK);
    assert_int_equal(chunks, 4); /* 12 MiB in parts under (8 MiB - 4 KiB - 64) / 2 */
    assert_int_equal(tally_nats_flush(p), TALLY_OK);
    /* A request that cannot go to a partition. */
    tally_req_t q;
    memset(&q, 0, sizeof q);
    q.opcode = TALLY_OP_QUERY;
    assert_int_equal(tally_req_set_stream(&q, "big"), TALLY_OK);
    assert_int_equal(tally_nats_send(p, &q, NULL, 0, false, NULL, NULL), TALLY_E_ARG);
    assert_non_null(strstr(tally_nats_error(p), "query cannot be published to a partition"));
    q.opcode = 200; /* no operation's */
    assert_int_equal(tally_nats_send(p, &q, NULL, 0, false, NULL, NULL), TALLY_E_ARG);
    assert_non_null(strstr(tally_nats_error(p), "opcode cannot be published to a partition"));
    /* A reference into shared memory means nothing to a worker on another host. */
    r.flags |= TALLY_FLAG_SHM_REF;
    assert_int_equal(tally_nats_send(p, &r, big, 64, false, NULL, NULL), TALLY_E_ARG);
    assert_non_null(strstr(tally_nats_error(p), "shared-memory references do not travel"));
    /* Three parts numbered from seq would pass 2^64 - 1: refused whole. */
    r.flags &= ~TALLY_FLAG_SHM_REF;
    r.seq = UINT64_MAX - 1;
    assert_int_equal(tally_nats_send(p, &r, big, len, false, NULL, NULL), TALLY_E_ARG);
    assert_non_null(strstr(tally_nats_error(p), "seq overflows over 3 chunks"));
    tally_nats_stats_t st;
    tally_nats_stats(p, &st);
    assert_int_equal(st.sent, 3 + 1 + 4);
    assert_int_equal(st.acked, st.sent);
    free(big);
    tally_nats_destroy(&p);
}

/* Options checked against the cluster: a partition count over TALLY_NATS_MAX_PARTITIONS is
 * refused; one given is used instead of the fleet's. Calls nobody answers (no worker runs in
 * this suite): a query of a malformed stream name is refused (TALLY_E_STREAM_NAME, as
 * tally_query) before it is sent; a call is asked again until the timeout (TALLY_E_TIMEOUT); a
 * query without a stream is not one a worker answers (TALLY_E_ARG); `streams` says no worker
 * answered and counts every partition missing, and through a tally_client_t over NATS too. */
static void test_options_and_silence(void **state)
{
    (void)state;
    tally_nats_opts_t o = {
        .servers = cluster.urls, .timeout_ms = 3000, .partitions = TALLY_NATS_MAX_PARTITIONS + 1};
    tally_nats_t *p = NULL;
    char msg[256] = "";
    assert_int_equal(tally_nats_new(&o, &p, msg, sizeof msg), TALLY_E_ARG);
    assert_null(p);
    assert_non_null(strstr(msg, "partitions: 1..1024"));
    o.partitions = 2;
    o.window_bytes = 1u << 20;
    o.timeout_ms = 1000;
    assert_int_equal(tally_nats_new(&o, &p, msg, sizeof msg), TALLY_OK);
    assert_int_equal(tally_nats_partitions(p), 2);

    tally_stream_info_t info;
    assert_int_equal(tally_nats_query(p, "no spaces allowed", &info), TALLY_E_STREAM_NAME);
    tally_req_t req;
    memset(&req, 0, sizeof req);
    req.opcode = TALLY_OP_STATS; /* any worker's: none here */
    tally_reply_t reply;
    tally_reply_init(&reply);
    int64_t t0 = th_now_ms();
    assert_int_equal(tally_nats_call(p, &req, NULL, 0, &reply), TALLY_E_TIMEOUT);
    assert_true(th_now_ms() - t0 >= 900);
    if (!strstr(reply.error, "within 1000 ms (no worker owns it?)"))
        fail_msg("%s", reply.error);
    tally_reply_clear(&reply);
    req.opcode = TALLY_OP_QUERY; /* a query names its stream (its partition's owner answers) */
    assert_int_equal(tally_nats_call(p, &req, NULL, 0, &reply), TALLY_E_ARG);
    assert_non_null(strstr(tally_nats_error(p), "only query (with a stream), ping, info and"));
    tally_reply_clear(&reply);

    char **names = (char **)&names;
    size_t count = 7;
    assert_int_equal(tally_nats_streams(p, &names, &count), TALLY_E_TIMEOUT);
    assert_null(names);
    assert_int_equal(count, 0);
    assert_non_null(strstr(tally_nats_error(p), "no worker answered within 1000 ms"));
    assert_int_equal(tally_nats_streams_missing(p), 2);
    tally_nats_destroy(&p);

    /* The same through a tally_client_t over NATS: `streams` fails at the send, saying why. */
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new_nats(&o, &c, msg, sizeof msg), TALLY_OK);
    assert_int_equal(tally_client_wait_connected(c), TALLY_OK); /* NATS: connected already */
    assert_int_equal(tally_streams(c, &names, &count), TALLY_E_TIMEOUT);
    assert_null(names);
    assert_non_null(strstr(tally_client_error(c), "no worker answered within 1000 ms"));
    tally_client_destroy(&c);
    assert_null(c);
}

/* Publishes data (with a Tally-Stream header of stream unless NULL) on tally.watch.<k>. */
static void watch_publish(uint32_t k, const char *stream, const void *data, int len)
{
    char subject[32];
    tally_fleet_name(subject, sizeof subject, TALLY_NATS_SUBJ_WATCH, k);
    natsMsg *m = NULL;
    assert_int_equal(natsMsg_Create(&m, subject, NULL, data, len), NATS_OK);
    if (stream)
        assert_int_equal(natsMsgHeader_Set(m, TALLY_NATS_HDR_STREAM, stream), NATS_OK);
    assert_int_equal(natsConnection_PublishMsg(nc, m), NATS_OK);
    natsMsg_Destroy(m);
    assert_int_equal(natsConnection_Flush(nc), NATS_OK);
}

/* Waits until sub hears what this suite's connection publishes on tally.watch.<k> (the two
 * connections may be on different nodes: the subscription's interest reaches the other node a
 * little later, and a message published before it is not delivered). Probes (good records of
 * pub_seq 1) until one comes, then a marker (pub_seq 2): ordered after every probe, so once it
 * has come nothing of the sync is left to arrive. rec holds a good record of full bytes. */
static void watch_sync(tally_nats_sub_t *sub, uint32_t k, uint8_t *rec, int full)
{
    tally_pub_t pub = {.kind = TALLY_PUB_UPDATE, .pub_seq = 1, .time_ms = 1, .interval_ms = 1};
    tally_pub_msg_t msg;
    tally_status_t st = TALLY_E_TIMEOUT;
    tally_pub_encode(&pub, rec);
    for (int i = 0; i < 300 && st == TALLY_E_TIMEOUT; i++) {
        watch_publish(k, "w1", rec, full);
        st = tally_nats_sub_recv(sub, 200, &msg);
    }
    assert_int_equal(st, TALLY_OK);
    pub.pub_seq = 2;
    tally_pub_encode(&pub, rec);
    watch_publish(k, "w1", rec, full);
    do
        assert_int_equal(tally_nats_sub_recv(sub, 10000, &msg), TALLY_OK);
    while (msg.pub.pub_seq != 2);
}

/* tally_nats_sub_* (PROTOCOL.md §13 "Histogram publications") with the messages written here:
 * a malformed stream name is refused; naming a stream of a partition already subscribed is a
 * no-op; with nothing queued a receive times out (at once, or after its wait); a message that
 * does not decode (no Tally-Stream, a malformed one, a short or wrong-kind header, a record of
 * the wrong size) is consumed as TALLY_E_REPLY; a good one gives its stream and record; what
 * is still queued at destroy is freed with it. */
static void test_watch_messages(void **state)
{
    (void)state;
    tally_nats_t *p = producer("watcher", 3000);
    tally_nats_sub_t *sub = NULL;
    assert_int_equal(tally_nats_sub_new(p, &sub), TALLY_OK);
    assert_true(tally_nats_sub_fd(sub) >= 0);
    assert_int_equal(tally_nats_sub_stream(sub, "bad name"), TALLY_E_ARG);
    assert_int_equal(tally_nats_sub_stream(sub, "w1"), TALLY_OK);
    assert_int_equal(tally_nats_sub_stream(sub, "w1"), TALLY_OK); /* its partition's, again */
    tally_pub_msg_t msg;
    assert_int_equal(tally_nats_sub_recv(sub, 0, &msg), TALLY_E_TIMEOUT);
    assert_int_equal(tally_nats_sub_recv(sub, 50, &msg), TALLY_E_TIMEOUT);

    uint32_t k = tally_partition("w1", 2, PARTITIONS);
    static uint8_t rec[TALLY_PUB_HEADER_SIZE + TALLY_QUERY_PAYLOAD_MAX];
    tally_pub_t pub = {.kind = TALLY_PUB_UPDATE, .pub_seq = 9, .time_ms = 1, .interval_ms = 1000};
    tally_pub_encode(&pub, rec);
    tally_stream_info_t info;
    memset(&info, 0, sizeof info);
    info.batches = 3;
    info.hist_dtype = TALLY_DTYPE_U8;
    info.bins[7] = 11;
    int full =
        (int)(TALLY_PUB_HEADER_SIZE + tally_stream_info_encode(&info, rec + TALLY_PUB_HEADER_SIZE));
    watch_sync(sub, k, rec, full);
    tally_pub_encode(&pub, rec);             /* pub_seq 9 again */
    watch_publish(k, NULL, rec, full);       /* no stream named */
    watch_publish(k, "bad name", rec, full); /* a malformed one */
    watch_publish(k, "w1", rec, 10);         /* a short header */
    watch_publish(k, "w1", rec, full - 1);   /* a record of the wrong size */
    watch_publish(k, "w1", rec, full);       /* good */
    for (int i = 0; i < 4; i++)
        assert_int_equal(tally_nats_sub_recv(sub, 10000, &msg), TALLY_E_REPLY);
    assert_int_equal(tally_nats_sub_recv(sub, 10000, &msg), TALLY_OK);
    assert_string_equal(msg.stream, "w1");
    assert_int_equal(msg.pub.pub_seq, 9);
    assert_int_equal(msg.info.batches, 3);
    assert_int_equal(msg.info.bins[7], 11);
    pub.kind = TALLY_PUB_DELETED; /* not what a fleet publishes */
    tally_pub_encode(&pub, rec);
    watch_publish(k, "w1", rec, full);
    assert_int_equal(tally_nats_sub_recv(sub, 10000, &msg), TALLY_E_REPLY);
    assert_int_equal(tally_nats_sub_dropped(sub), 0);
    /* Two left queued: freed by destroy (ASan's leak check says so). */
    watch_publish(k, "w1", rec, full);
    watch_publish(k, "w1", rec, full);
    struct pollfd pfd = {.fd = tally_nats_sub_fd(sub), .events = POLLIN};
    assert_int_equal(poll(&pfd, 1, 10000), 1);
    tally_nats_sub_destroy(&sub);
    assert_null(sub);
    tally_nats_destroy(&p);
}

/* The fleet's partition count as the fleet's KV holds it: one out of 1..1024, or not a number,
 * is refused (TALLY_E_REPLY, the value quoted); the fleet's own value is put back. */
static void test_bad_partition_count(void **state)
{
    (void)state;
    kvStore *kv = NULL;
    assert_int_equal(js_KeyValue(&kv, js, TALLY_NATS_BUCKET_FLEET), NATS_OK);
    const char *bad[] = {"0", "1025", "four", "12345678901234567890"};
    const char *shown[] = {"'0'", "'1025'", "'four'", "''"}; /* 15 bytes or more: none shown */
    for (size_t i = 0; i < 4; i++) {
        assert_int_equal(kvStore_PutString(NULL, kv, TALLY_NATS_KEY_PARTITIONS, bad[i]), NATS_OK);
        tally_nats_opts_t o = {.servers = cluster.urls, .timeout_ms = 3000};
        tally_nats_t *p = NULL;
        char msg[256] = "";
        assert_int_equal(tally_nats_new(&o, &p, msg, sizeof msg), TALLY_E_REPLY);
        assert_null(p);
        char want[64];
        snprintf(want, sizeof want, "the fleet's partition count %s is not valid", shown[i]);
        if (!strstr(msg, want))
            fail_msg("'%s': %s", bad[i], msg);
    }
    char good[16];
    snprintf(good, sizeof good, "%d", PARTITIONS);
    assert_int_equal(kvStore_PutString(NULL, kv, TALLY_NATS_KEY_PARTITIONS, good), NATS_OK);
    kvStore_Destroy(kv);
    tally_nats_t *p = producer("after", 3000);
    assert_int_equal(tally_nats_partitions(p), PARTITIONS);
    tally_nats_destroy(&p);
}

static void test_pub_ack_after_node_kill(void **state)
{
    (void)state;
    uint32_t k = tally_partition("killed", 6, PARTITIONS);
    char name[32];
    tally_fleet_name(name, sizeof name, TALLY_NATS_STREAM_PREFIX, k);
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    assert_int_equal(js_GetStreamInfo(&si, js, name, NULL, &jerr), NATS_OK);
    int leader = tn_node_index(&cluster, si->Cluster ? si->Cluster->Leader : NULL);
    jsStreamInfo_Destroy(si);
    assert_true(leader >= 0);

    tally_nats_t *p = producer("killer", 2000);
    uint64_t before = stream_msgs(k, NULL, NULL);
    enum { N = 300, NAMES = 16 };
    /* 16 streams of the partition: a stream keeps one message without PubAck at a time (its
     * order), so 16 are outstanding when the leader dies. */
    tally_req_t reqs[NAMES];
    for (int j = 0, n = 0; n < NAMES; j++) {
        char sname[32];
        snprintf(sname, sizeof sname, "killed-%d", j);
        if (tally_partition(sname, strlen(sname), PARTITIONS) == k)
            reqs[n++] = hist_u8(sname);
    }
    uint8_t payload[4096];
    memset(payload, 9, sizeof payload);
    bool killed = false;
    for (int i = 0; i < N; i++) {
        if (i == N / 2 && !killed) /* PubAcks are outstanding now: the leader dies under them */
            killed = tn_node_kill(&cluster, leader, SIGKILL) == 0;
        tally_status_t st =
            tally_nats_send(p, &reqs[i % NAMES], payload, sizeof payload, false, NULL, NULL);
        assert_true(st == TALLY_OK || st == TALLY_E_TIMEOUT);
        if (st == TALLY_E_TIMEOUT) /* the window stayed full during the election: retry it */
            i--;
    }
    assert_true(killed);
    tally_status_t st = TALLY_E_TIMEOUT;
    for (int i = 0; i < 15 && st == TALLY_E_TIMEOUT; i++)
        st = tally_nats_flush(p); /* each resends what is still missing, with the same ids */
    assert_int_equal(st, TALLY_OK);
    tally_nats_stats_t stats;
    tally_nats_stats(p, &stats);
    print_message("killed n%d: sent %llu, acked %llu, duplicates %llu, resent %llu\n", leader,
                  (unsigned long long)stats.sent, (unsigned long long)stats.acked,
                  (unsigned long long)stats.duplicates, (unsigned long long)stats.resent);
    assert_int_equal(stats.sent, N);
    assert_int_equal(stats.pending, 0);
    uint64_t first = 0, last = 0;
    assert_int_equal(stream_msgs(k, &first, &last), before + N); /* each exactly once */
    /* And the ids are the N distinct ones. */
    static bool seen[N + 1];
    for (uint64_t seq = last - N + 1; seq <= last; seq++) {
        natsMsg *m = stream_msg(k, seq);
        const char *id = header(m, "Nats-Msg-Id");
        assert_non_null(id);
        assert_int_equal(strncmp(id, "anon.killer.", 12), 0);
        unsigned long n = strtoul(id + 12, NULL, 10);
        assert_true(n >= 1 && n <= N && !seen[n]);
        seen[n] = true;
        natsMsg_Destroy(m);
    }
    tally_nats_destroy(&p);
    assert_int_equal(tn_node_restart(&cluster, leader, 60000), 0);
}

int main(void)
{
    if (tn_skip())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_fleet),
        cmocka_unit_test(test_message_and_duplicate),
        cmocka_unit_test(test_split),
        cmocka_unit_test(test_options_and_silence),
        cmocka_unit_test(test_watch_messages),
        cmocka_unit_test(test_bad_partition_count),
        cmocka_unit_test(test_pub_ack_after_node_kill),
    };
    int failed = cmocka_run_group_tests(tests, setup, teardown);
    nats_Close(); /* libnats' threads and globals: gone before the leak check */
    return failed;
}
