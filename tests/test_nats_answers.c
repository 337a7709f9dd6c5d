/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_answers.c — a worker's answers by request-reply, and its view of the fleet, when
 * what comes over NATS is not what a member says (PROTOCOL.md §13 "Answers by request-reply",
 * docs/web.md "A fleet"), against a real (one-node) JetStream server and real workers:
 *   - a request whose reply subject is outside the inboxes of the user its subject names is
 *     answered nowhere, counted in tallyd_nats_refused_total{reason="reply"} and logged; one
 *     without a reply subject is answered nowhere and not counted; tally.ctl answers info and
 *     stats too; a query without a stream, or with a stream length past a name's, gets
 *     `bad_stream_name` from the request path; a query of a partition the
 *     fleet does not have gets no answer; a windowed query on tally.seq gets `bad_opcode`; a
 *     `streams` question of another protocol version gets `bad_version` without Tally-Owned;
 *     a partition's message on a subject that names no user, with a Tally-Reply or a
 *     Nats-Msg-Id, is a dead letter `not_permitted` saying the user is (none), counted; a
 *     numbered message whose seq its stream has applied is answered `duplicate`, no dead letter;
 *     one with headers of its producer's own beside the fleet's is applied and answered;
 *   - "ghost", a member the test plays (it holds both partitions' leases and answers on the
 *     query subjects), answers `streams` with frames that are no member's answer (too short, an
 *     error, no Tally-Member, no Tally-Owned, a Tally-Owned of another layout), and with answers
 *     whose lists end at a garbled entry (empty, longer than a stream name, past the frame):
 *     the worker's GET /api/v1/streams lists only the streams of ghost's well-formed answers
 *     (300 and more: the list grows), each once, covering both partitions, not partial; an
 *     answer of both partitions listing nothing is an empty list; one of partition 0 alone is
 *     partial, after the view's whole wait; one of 70,000 streams is cut at the list's 8 MiB
 *     (64,527 entries of 130 bytes) and partial, of both partitions or of partition 0 alone;
 *   - GET /api/v1/streams/NAME of ghost's streams: an answer shorter than a reply header is 502
 *     "not a reply", a reply header that does not decode is 502 bad_reply, no answer at all is
 *     504 after the view's wait ("no owner?"), and ghost's error reply is passed on with its
 *     status and message; while the view waits on a query nobody answers it holds 32
 *     questions, and the next is refused at once (503 busy);
 *   - in direct mode the worker answers a request for ghost's partition not_owner, naming ghost
 *     (which publishes no endpoint), and counts it;
 *   - a worker's `streams` answer leaves out a stream it holds of a partition it does not own
 *     (local_writes), and its Tally-Owned names the one it owns;
 *   - a take-over that cannot finish leaves the partition untaken, logged with why: a checkpoint
 *     of more streams than the worker's max_streams, a take that outlasts the lease;
 *   - a worker that gives a partition up publishes every changed stream of it, 2,500 of them:
 *     more than one tick's 4 MiB;
 *   - a worker that stops publishes each partition's changed streams as it gives it up, those of
 *     the other partition left for its own turn, before its next tick (PROTOCOL.md §13
 *     "Histogram publications").
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
#include <unistd.h>
#include <poll.h>
#include <pthread.h>

#include <cmocka.h>
#include <nats/nats.h>

#include "harness.h"
#include "nats_cluster.h"
#include "tally.h"
#include "tally_fleet.h"

#define cluster tn_suite
#define nc tn_suite_nc
#define js tn_suite_js
#define WAIT_MS 30000

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

/* A fleet worker of 2 partitions, in direct mode when `direct`, publishing every pub_ms, with
 * the options `extra` (NULL-terminated, may be NULL). */
static void start_worker_with(th_daemon_t *d, const char *member, bool direct, const char *pub_ms,
                              const char *const *extra)
{
    const char *args[] = {"--metrics",
                          "127.0.0.1:0",
                          "--nats-servers",
                          cluster.urls,
                          "--nats-replicas",
                          "1",
                          "--nats-partitions",
                          "2",
                          "--nats-lease-ttl-ms",
                          "3000",
                          "--nats-member-id",
                          member,
                          "--window-intervals",
                          "0",
                          "--metrics-max-connections-per-address",
                          "64",
                          "--pub-interval-ms",
                          pub_ms,
                          "--shm",
                          "off",
                          direct ? "--nats-direct" : NULL,
                          "local",
                          direct && strcmp(member, "owner") == 0 ? "--nats-advertise" : NULL,
                          "tcp://owner.example:5555",
                          NULL};
    assert_int_equal(th_daemon_start_with(d, args, extra), 0);
}

static void start_worker(th_daemon_t *d, const char *member, bool direct, const char *pub_ms)
{
    start_worker_with(d, member, direct, pub_ms, NULL);
}

/* The stream name of partition k (of 2) after `after` (NULL: the first). */
static void name_after(uint32_t k, const char *after, char *name, size_t cap)
{
    int i = after ? atoi(after + strlen("ans-")) + 1 : 0;
    for (;; i++) {
        snprintf(name, cap, "ans-%d", i);
        if (tally_partition(name, strlen(name), 2) == k)
            return;
    }
}

/* A stream name of partition k (of 2). */
static void name_in(uint32_t k, char *name, size_t cap)
{
    name_after(k, NULL, name, cap);
}

/* data on subject with reply subject `reply` (NULL: none); what comes back on inbox within
 * wait_ms (NULL: nothing). */
static natsMsg *answer_on(const char *subject, const char *reply, const char *inbox,
                          const void *data, int len, int wait_ms)
{
    natsSubscription *sub = NULL;
    natsMsg *m = NULL;
    assert_int_equal(natsConnection_SubscribeSync(&sub, nc, inbox), NATS_OK);
    assert_int_equal(natsConnection_PublishRequest(nc, subject, reply, data, len), NATS_OK);
    if (natsSubscription_NextMsg(&m, sub, wait_ms) != NATS_OK)
        m = NULL;
    natsSubscription_Destroy(sub);
    return m;
}

/* answer_on's answer: the reply's status, -1 for nothing, -2 for no reply header. */
static int ask_on(const char *subject, const char *reply, const char *inbox, const void *data,
                  int len, int wait_ms)
{
    natsMsg *m = answer_on(subject, reply, inbox, data, len, wait_ms);
    int st = -1;
    if (m) {
        tally_rep_t rep;
        st = natsMsg_GetDataLength(m) >= TALLY_REP_HEADER_SIZE &&
                     tally_rep_decode((const uint8_t *)natsMsg_GetData(m), TALLY_REP_HEADER_SIZE,
                                      &rep) == TALLY_OK
                 ? (int)rep.status
                 : -2;
    }
    natsMsg_Destroy(m);
    return st;
}

static const char inbox[] = TALLY_NATS_INBOX TALLY_NATS_USER_ANON ".answers";

/* A request header of op (on stream, NULL: none; flags) on subject, answered to the anonymous
 * user's inbox: its status, -1 without an answer within wait_ms. */
static int ask_op(const char *subject, uint8_t op, const char *stream, uint8_t flags, int wait_ms)
{
    tally_req_t req = th_req(op, TALLY_DTYPE_NONE, 7);
    req.flags = flags;
    if (flags & TALLY_FLAG_QUERY_WINDOW)
        req.lo = 1000;
    if (stream)
        assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(&req, header);
    return ask_on(subject, inbox, inbox, header, sizeof header, wait_ms);
}

/* One hist batch of 100 bytes into stream `name` on d (direct mode), sent until d owns its
 * partition and applies it. */
static void write_direct(th_daemon_t *d, const char *name)
{
    void *sock = th_connect(d->endpoint, 10000);
    assert_non_null(sock);
    uint8_t data[100];
    memset(data, 7, sizeof data);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    int st = -1;
    for (int64_t until = th_now_ms() + WAIT_MS; st != TALLY_OK && th_now_ms() < until;)
        if ((st = th_call_status(sock, &req, data, sizeof data)) == TALLY_E_NOT_OWNER)
            th_sleep_ms(50);
    assert_int_equal(st, TALLY_OK);
    th_close(sock);
}

/* The Tally-Stream of each publication on watch within wait_ms, joined with ',' into out. */
static void watched(natsSubscription *watch, int wait_ms, char *out, size_t cap)
{
    natsMsg *m = NULL;
    out[0] = '\0';
    while (natsSubscription_NextMsg(&m, watch, wait_ms) == NATS_OK) {
        const char *name = "?", *member = "?";
        natsMsgHeader_Get(m, TALLY_NATS_HDR_STREAM, &name);
        natsMsgHeader_Get(m, TALLY_NATS_HDR_MEMBER, &member);
        size_t n = strlen(out);
        snprintf(out + n, cap - n, "%s%s@%s", n ? "," : "", name, member);
        natsMsg_Destroy(m);
    }
}

static long long wait_metric(th_daemon_t *d, const char *name, long long want)
{
    long long v = th_metric(d, name);
    for (int64_t until = th_now_ms() + WAIT_MS; v != want && th_now_ms() < until;
         v = th_metric(d, name))
        th_sleep_ms(50);
    return v;
}

/* Partition k's last dead letter once its Tally-Reason holds `want` (waited for: the worker
 * counts a refusal before it publishes the dead letter); asserts its Tally-Status is status. */
static void dead_letter_says(uint32_t k, tally_status_t status, const char *want)
{
    char subject[48], reason[512] = "";
    snprintf(subject, sizeof subject, "%s%u", TALLY_NATS_SUBJ_DEAD, (unsigned)k);
    const char *st = NULL;
    natsMsg *d = NULL;
    for (int64_t until = th_now_ms() + WAIT_MS; !strstr(reason, want) && th_now_ms() < until;) {
        natsMsg_Destroy(d);
        d = NULL;
        jsErrCode jerr = 0;
        const char *r = NULL;
        if (js_GetLastMsg(&d, js, TALLY_NATS_DEAD_STREAM, subject, NULL, &jerr) == NATS_OK &&
            natsMsgHeader_Get(d, TALLY_NATS_HDR_REASON, &r) == NATS_OK)
            snprintf(reason, sizeof reason, "%s", r);
        if (!strstr(reason, want))
            th_sleep_ms(50);
    }
    if (!strstr(reason, want))
        fail_msg("the last dead letter of partition %u says '%s', not '%s'", (unsigned)k, reason,
                 want);
    assert_int_equal(natsMsgHeader_Get(d, TALLY_NATS_HDR_STATUS, &st), NATS_OK);
    assert_string_equal(st, tally_status_name(status));
    natsMsg_Destroy(d);
}

/* A hist of 4 bytes on stream `name` (numbered seq, 0: not), published to partition k's
 * subject of `user` with the headers given (NULL: left out), stored by JetStream. */
static void publish_as(uint32_t k, const char *user, const char *name, uint64_t seq,
                       const char *reply_to, const char *id)
{
    char subject[64];
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, (int64_t)k, user);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    req.seq = seq;
    uint8_t frame[TALLY_REQ_HEADER_SIZE + 4];
    tally_req_encode(&req, frame);
    memset(frame + TALLY_REQ_HEADER_SIZE, 3, 4);
    assert_int_equal(tn_publish(js, subject, frame, sizeof frame, reply_to, id), NATS_OK);
}

static void test_requests_answered_nowhere(void **state)
{
    (void)state;
    th_daemon_t w;
    start_worker(&w, "owner", true, "1000");
    /* Direct mode: its endpoints under its member id, zmq= the advertised one, host= ours. */
    kvStore *endpoints = NULL;
    assert_int_equal(js_KeyValue(&endpoints, js, TALLY_NATS_BUCKET_ENDPOINTS), NATS_OK);
    kvEntry *e = NULL;
    for (int64_t until = th_now_ms() + WAIT_MS;
         kvStore_Get(&e, endpoints, "owner") != NATS_OK && th_now_ms() < until;)
        th_sleep_ms(50);
    assert_non_null(e);
    char value[512], host[TALLY_FLEET_HOST_MAX], record[512];
    snprintf(value, sizeof value, "%.*s", kvEntry_ValueLen(e), kvEntry_ValueString(e));
    assert_true(tally_fleet_host_id(host, sizeof host)); /* and this host's boot id */
    snprintf(record, sizeof record, "zmq=tcp://owner.example:5555\nhost=%s\n", host);
    assert_string_equal(value, record);
    kvEntry_Destroy(e);
    kvStore_Destroy(endpoints);
    char q0[64], q5[64], seq0[64], ctl[64], in0[32];
    tally_fleet_subject(q0, sizeof q0, TALLY_NATS_SUBJ_QUERY, 0, TALLY_NATS_USER_ANON);
    tally_fleet_subject(q5, sizeof q5, TALLY_NATS_SUBJ_QUERY, 5, TALLY_NATS_USER_ANON);
    tally_fleet_subject(seq0, sizeof seq0, TALLY_NATS_SUBJ_SEQ, 0, TALLY_NATS_USER_ANON);
    tally_fleet_subject(ctl, sizeof ctl, TALLY_NATS_SUBJ_CTL, -1, TALLY_NATS_USER_ANON);
    name_in(0, in0, sizeof in0);
    /* Until the worker owns partition 0, nobody answers there. */
    int st = -1;
    for (int64_t t0 = th_now_ms(); st != TALLY_E_UNKNOWN_STREAM && th_now_ms() - t0 < WAIT_MS;)
        if ((st = ask_op(q0, TALLY_OP_QUERY, in0, 0, 2000)) != TALLY_E_UNKNOWN_STREAM)
            th_sleep_ms(100);
    assert_int_equal(st, TALLY_E_UNKNOWN_STREAM);

    /* No reply subject, then one of another user's inboxes: neither answered, one counted. */
    tally_req_t req = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, 8);
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(&req, header);
    assert_int_equal(natsConnection_Publish(nc, ctl, header, sizeof header), NATS_OK);
    static const char other[] = TALLY_NATS_INBOX "mallory.x";
    assert_int_equal(ask_on(ctl, other, other, header, sizeof header, 500), -1);
    const char *refused = "tallyd_nats_refused_total{reason=\"reply\"}";
    assert_int_equal(wait_metric(&w, refused, 1), 1);
    assert_true(th_daemon_log_contains(
        &w, "fleet: a request on tally.ctl.anon asks for its answer on _INBOX.mallory.x, outside "
            "the inboxes of user anon (_INBOX.<user>.>): answered nowhere"));
    /* A request on the same subject after them is answered: both were taken, one counted. */
    assert_int_equal(ask_op(ctl, TALLY_OP_PING, NULL, 0, 10000), TALLY_OK);
    assert_int_equal(th_metric(&w, refused), 1);
    /* A subject that names no user (not a member id's characters): no inbox is its. */
    static const char odd[] = TALLY_NATS_INBOX "no~user.x";
    assert_int_equal(ask_on(TALLY_NATS_SUBJ_CTL ".no~user", odd, odd, header, sizeof header, 500),
                     -1);
    assert_int_equal(wait_metric(&w, refused, 2), 2);
    assert_true(th_daemon_log_contains(
        &w, "asks for its answer on _INBOX.no~user.x, outside the inboxes of user (none)"));

    /* What tally.ctl answers besides ping; a query without a stream, or with a stream length
     * past a name's, is the request path's to refuse. */
    assert_int_equal(ask_op(ctl, TALLY_OP_INFO, NULL, 0, 10000), TALLY_OK);
    assert_int_equal(ask_op(ctl, TALLY_OP_STATS, NULL, 0, 10000), TALLY_OK);
    assert_int_equal(ask_op(q0, TALLY_OP_QUERY, NULL, 0, 10000), TALLY_E_STREAM_NAME);
    tally_req_t query = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, 9);
    tally_req_encode(&query, header);
    header[17] = TALLY_STREAM_NAME_MAX + 1;
    assert_int_equal(ask_on(q0, inbox, inbox, header, sizeof header, 10000), TALLY_E_STREAM_NAME);
    /* A partition the fleet does not have: nobody's to answer. */
    assert_int_equal(ask_op(q5, TALLY_OP_QUERY, in0, 0, 500), -1);
    /* tally.seq answers a query without a window: a window is another operation there. */
    assert_int_equal(ask_op(seq0, TALLY_OP_QUERY, in0, TALLY_FLAG_QUERY_WINDOW, 10000),
                     TALLY_E_OPCODE);
    assert_int_equal(ask_op(seq0, TALLY_OP_QUERY, in0, 0, 10000), TALLY_E_UNKNOWN_STREAM);
    write_direct(&w, in0); /* now it exists: its last_seq alone */
    assert_int_equal(ask_op(seq0, TALLY_OP_QUERY, in0, 0, 10000), TALLY_OK);

    /* A `streams` question the request path refuses (a protocol version it does not speak) is
     * answered with its error as it is: no list, so no Tally-Owned to claim partitions by. */
    char streams[64];
    tally_fleet_subject(streams, sizeof streams, TALLY_NATS_SUBJ_STREAMS, -1, TALLY_NATS_USER_ANON);
    tally_req_t list = th_req(TALLY_OP_STREAMS, TALLY_DTYPE_NONE, 10);
    tally_req_encode(&list, header);
    header[4] = TALLY_PROTO_VERSION + 1; /* the version byte (PROTOCOL.md §2) */
    natsMsg *a = answer_on(streams, inbox, inbox, header, sizeof header, 10000);
    assert_non_null(a);
    tally_rep_t rep;
    assert_true(natsMsg_GetDataLength(a) >= TALLY_REP_HEADER_SIZE);
    assert_int_equal(
        tally_rep_decode((const uint8_t *)natsMsg_GetData(a), TALLY_REP_HEADER_SIZE, &rep),
        TALLY_OK);
    assert_int_equal(rep.status, TALLY_E_VERSION);
    const char *owned = NULL, *member = NULL;
    assert_int_not_equal(natsMsgHeader_Get(a, TALLY_NATS_HDR_OWNED, &owned), NATS_OK);
    assert_int_equal(natsMsgHeader_Get(a, TALLY_NATS_HDR_MEMBER, &member), NATS_OK);
    assert_string_equal(member, "owner");
    natsMsg_Destroy(a);

    /* A partition's message published under a subject that names no user (not a member id's
     * characters): no inbox and no dedupe id is its, so one naming either is a dead letter
     * not_permitted, counted by reason, its reason saying the user is (none). */
    const char *refused_id = "tallyd_nats_refused_total{reason=\"id\"}";
    publish_as(0, "no~user", in0, 0, TALLY_NATS_INBOX "no~user.r", NULL);
    assert_int_equal(wait_metric(&w, refused, 3), 3);
    dead_letter_says(
        0, TALLY_E_NOT_PERMITTED,
        "Tally-Reply _INBOX.no~user.r is not an inbox of user (none) (_INBOX.<user>.>)");
    publish_as(0, "no~user", in0, 0, NULL, "no~user.1");
    assert_int_equal(wait_metric(&w, refused_id, 1), 1);
    dead_letter_says(0, TALLY_E_NOT_PERMITTED,
                     "Nats-Msg-Id no~user.1 is outside the ids of user (none) (<user>.*)");

    /* A numbered message whose seq the stream has applied already is answered `duplicate`
     * and is no dead letter (PROTOCOL.md §13 "Dead letters": any reason but duplicate). */
    char dup[32];
    name_after(0, in0, dup, sizeof dup);
    static const char dup_inbox[] = TALLY_NATS_INBOX TALLY_NATS_USER_ANON ".dup";
    natsSubscription *replies = NULL;
    assert_int_equal(natsConnection_SubscribeSync(&replies, nc, dup_inbox), NATS_OK);
    assert_int_equal(natsConnection_Flush(nc), NATS_OK);
    publish_as(0, TALLY_NATS_USER_ANON, dup, 1, dup_inbox, "anon.dup.1");
    publish_as(0, TALLY_NATS_USER_ANON, dup, 1, dup_inbox, "anon.dup.2");
    /* A header of the producer's own beside the fleet's is no concern of the worker's. */
    char subject[48];
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, 0, TALLY_NATS_USER_ANON);
    tally_req_t next = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&next, dup), TALLY_OK);
    next.seq = 2;
    uint8_t frame[TALLY_REQ_HEADER_SIZE + 4] = {0};
    tally_req_encode(&next, frame);
    natsMsg *own = NULL;
    assert_int_equal(natsMsg_Create(&own, subject, NULL, (const char *)frame, sizeof frame),
                     NATS_OK);
    assert_int_equal(natsMsgHeader_Set(own, "Sensor-Site", "north"), NATS_OK);
    assert_int_equal(natsMsgHeader_Set(own, TALLY_NATS_HDR_MSG_ID, "anon.dup.3"), NATS_OK);
    assert_int_equal(natsMsgHeader_Set(own, "Sensor-Shift", "night"), NATS_OK);
    assert_int_equal(natsMsgHeader_Set(own, TALLY_NATS_HDR_REPLY, dup_inbox), NATS_OK);
    jsErrCode jerr = 0;
    assert_int_equal(js_PublishMsg(NULL, js, own, NULL, &jerr), NATS_OK);
    natsMsg_Destroy(own);
    const char *want[] = {"anon.dup.1", "anon.dup.2", "anon.dup.3"};
    const tally_status_t status[] = {TALLY_OK, TALLY_E_DUPLICATE, TALLY_OK};
    for (int i = 0; i < 3; i++) { /* one partition's replies come in sequence order */
        natsMsg *r = NULL;
        assert_int_equal(natsSubscription_NextMsg(&r, replies, WAIT_MS), NATS_OK);
        const char *id = NULL;
        assert_int_equal(natsMsgHeader_Get(r, TALLY_NATS_HDR_REPLY_ID, &id), NATS_OK);
        assert_string_equal(id, want[i]);
        assert_true(natsMsg_GetDataLength(r) >= TALLY_REP_HEADER_SIZE);
        assert_int_equal(
            tally_rep_decode((const uint8_t *)natsMsg_GetData(r), TALLY_REP_HEADER_SIZE, &rep),
            TALLY_OK);
        assert_int_equal(rep.status, status[i]);
        natsMsg_Destroy(r);
    }
    natsSubscription_Destroy(replies);
    assert_int_equal(th_metric(&w, "tallyd_nats_dead_letters_total"), 2); /* the two above */
    dead_letter_says(0, TALLY_E_NOT_PERMITTED, "Nats-Msg-Id no~user.1 is outside the ids");
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

/* ---- ghost: a member the test plays ------------------------------------------------------ */

static atomic_bool ghost_on;
static atomic_int q1_asked;

/* ghost's answer on `to`: a reply header of status st (version 0: one that does not decode)
 * and tail, cut to `cut` bytes when not 0, with the headers given (NULL: left out). */
static void ghost_send(const char *to, int version, tally_status_t st, const void *tail,
                       size_t tail_len, size_t cut, const char *member, const char *owned,
                       const char *members)
{
    static uint8_t frame[TALLY_REP_HEADER_SIZE + 4096]; /* one callback thread */
    tally_rep_t rep;
    memset(&rep, 0, sizeof rep);
    rep.version = TALLY_PROTO_VERSION;
    rep.opcode = TALLY_OP_STREAMS;
    rep.status = st;
    rep.dtype = st == TALLY_OK ? TALLY_DTYPE_NONE : TALLY_DTYPE_TEXT;
    tally_rep_encode(&rep, frame);
    if (version != TALLY_PROTO_VERSION)
        frame[0] ^= 0xff; /* no reply header of this protocol */
    assert_true(tail_len <= 4096);
    if (tail_len)
        memcpy(frame + TALLY_REP_HEADER_SIZE, tail, tail_len);
    size_t len = cut ? cut : TALLY_REP_HEADER_SIZE + tail_len;
    natsMsg *m = NULL;
    assert_int_equal(natsMsg_Create(&m, to, NULL, (const char *)frame, (int)len), NATS_OK);
    if (member)
        natsMsgHeader_Set(m, TALLY_NATS_HDR_MEMBER, member);
    if (owned)
        natsMsgHeader_Set(m, TALLY_NATS_HDR_OWNED, owned);
    if (members)
        natsMsgHeader_Set(m, TALLY_NATS_HDR_MEMBERS, members);
    natsConnection_PublishMsg(nc, m);
    natsMsg_Destroy(m);
}

/* A `streams` list: names, each as its length byte and its bytes; into out, its length. */
static size_t entries(uint8_t *out, const char *const *names)
{
    size_t n = 0;
    for (int i = 0; names[i]; i++) {
        size_t len = strlen(names[i]);
        out[n++] = (uint8_t)len;
        memcpy(out + n, names[i], len);
        n += len;
    }
    return n;
}

static atomic_int lists_asked;

/* An answer of the partitions `owned` (Tally-Owned) listing `count` streams t/NNNNN. */
static void ghost_many(const char *to, int count, const char *owned)
{
    size_t cap = TALLY_REP_HEADER_SIZE + (size_t)count * 8;
    uint8_t *frame = calloc(1, cap);
    assert_non_null(frame);
    tally_rep_t rep;
    memset(&rep, 0, sizeof rep);
    rep.version = TALLY_PROTO_VERSION;
    rep.opcode = TALLY_OP_STREAMS;
    rep.count = (uint64_t)count;
    tally_rep_encode(&rep, frame);
    size_t n = TALLY_REP_HEADER_SIZE;
    assert_true(count <= 100000);
    for (int i = 0; i < count; i++) {
        char name[16];
        frame[n] = (uint8_t)snprintf(name, sizeof name, "t/%05d", i); /* 7: i < 100,000 */
        memcpy(frame + n + 1, name, 7);
        n += 8;
    }
    natsMsg *m = NULL;
    assert_int_equal(natsMsg_Create(&m, to, NULL, (const char *)frame, (int)n), NATS_OK);
    natsMsgHeader_Set(m, TALLY_NATS_HDR_MEMBER, "ghost");
    natsMsgHeader_Set(m, TALLY_NATS_HDR_OWNED, owned);
    natsConnection_PublishMsg(nc, m);
    natsMsg_Destroy(m);
    free(frame);
}

/* The first `streams` question: answers that are no member's, then well-formed ones; the second:
 * both partitions covered, nothing listed; the third: partition 0 only; the fourth and fifth:
 * 70,000 streams of both partitions, then of partition 0. */
static void on_streams(natsConnection *c, natsSubscription *s, natsMsg *req, void *arg)
{
    (void)c, (void)s, (void)arg;
    char to[128];
    snprintf(to, sizeof to, "%s", natsMsg_GetReply(req));
    int asked = atomic_fetch_add(&lists_asked, 1);
    natsMsg_Destroy(req);
    if (asked == 1) {
        ghost_send(to, TALLY_PROTO_VERSION, TALLY_OK, NULL, 0, 0, "ghost", "3", "2");
        return;
    }
    if (asked == 2) {
        ghost_send(to, TALLY_PROTO_VERSION, TALLY_OK, NULL, 0, 0, "ghost", "1", "2");
        return;
    }
    if (asked == 3 || asked == 4) {
        ghost_many(to, 70000, asked == 3 ? "3" : "1");
        return;
    }
    static uint8_t list[4096];
    size_t n = entries(list, (const char *const[]){"bad/x", NULL});
    /* No member's answer: each covers nothing and lists nothing. */
    ghost_send(to, TALLY_PROTO_VERSION, TALLY_OK, list, n, 10, "ghost", "3", "2");
    ghost_send(to, 0, TALLY_OK, list, n, 0, "ghost", "3", "2");
    ghost_send(to, TALLY_PROTO_VERSION, TALLY_E_BUSY, list, n, 0, "ghost", "3", "2");
    ghost_send(to, TALLY_PROTO_VERSION, TALLY_OK, list, n, 0, NULL, "3", "2");
    ghost_send(to, TALLY_PROTO_VERSION, TALLY_OK, list, n, 0, "ghost", NULL, "2");
    ghost_send(to, TALLY_PROTO_VERSION, TALLY_OK, list, n, 0, "ghost", "4", "2");
    ghost_send(to, TALLY_PROTO_VERSION, TALLY_OK, list, n, 0, "ghost", "33", "2");
    /* Partition 0's answers: a list that ends at an empty entry; one without Tally-Members whose
     * list ends at an entry longer than a stream name; one of 300 streams; one listing none,
     * with a member count past any fleet (not taken). */
    n = entries(list, (const char *const[]){"ghost/b", "ghost/a", "", "hidden/0", NULL});
    ghost_send(to, TALLY_PROTO_VERSION, TALLY_OK, list, n, 0, "ghost", "1", "3");
    n = entries(list, (const char *const[]){"ghost/d", NULL});
    list[n++] = TALLY_STREAM_NAME_MAX + 1;
    memset(list + n, 'h', TALLY_STREAM_NAME_MAX + 1);
    n += TALLY_STREAM_NAME_MAX + 1;
    ghost_send(to, TALLY_PROTO_VERSION, TALLY_OK, list, n, 0, "ghost", "1", NULL);
    n = 0;
    for (int i = 0; i < 300; i++) {
        list[n] = (uint8_t)snprintf((char *)list + n + 1, 16, "g/%03d", i);
        n += 1 + list[n];
    }
    ghost_send(to, TALLY_PROTO_VERSION, TALLY_OK, list, n, 0, "ghost", "1", NULL);
    ghost_send(to, TALLY_PROTO_VERSION, TALLY_OK, NULL, 0, 0, "ghost", "1", "999999");
    /* Partition 1's: ghost/a again (once in the list), then an entry longer than the frame. */
    n = entries(list, (const char *const[]){"ghost/a", "ghost/c", NULL});
    list[n++] = 40;
    memcpy(list + n, "hidden/1", 8);
    n += 8;
    ghost_send(to, TALLY_PROTO_VERSION, TALLY_OK, list, n, 0, "ghost", "2", "2");
}

static void on_query(natsConnection *c, natsSubscription *s, natsMsg *req, void *arg)
{
    (void)c, (void)s, (void)arg;
    const char *to = natsMsg_GetReply(req);
    bool p0 = strncmp(natsMsg_GetSubject(req), "tally.q.0.", 10) == 0;
    static const char why[] = "ghost keeps no such stream";
    if (p0) {
        ghost_send(to, TALLY_PROTO_VERSION, TALLY_OK, NULL, 0, 10, "ghost", NULL, NULL);
    } else {
        int asked = atomic_fetch_add(&q1_asked, 1);
        if (asked == 0 || asked == 3)
            ; /* no answer at all */
        else if (asked == 1)
            ghost_send(to, 0, TALLY_OK, NULL, 0, 0, "ghost", NULL, NULL);
        else
            ghost_send(to, TALLY_PROTO_VERSION, TALLY_E_UNKNOWN_STREAM, why, strlen(why), 0,
                       NULL, NULL, NULL);
    }
    natsMsg_Destroy(req);
}

/* Keeps both partitions' leases ghost's while ghost_on. */
static void *hold_leases(void *arg)
{
    kvStore *leases = arg;
    while (atomic_load(&ghost_on)) {
        uint64_t rev = 0;
        kvStore_PutString(&rev, leases, "p0", "ghost");
        kvStore_PutString(&rev, leases, "p1", "ghost");
        th_sleep_ms(300);
    }
    return NULL;
}

/* How many times `what` stands in s: one pass (strstr from each hit, under ASan's interceptor,
 * measures the rest of a response of megabytes each time). */
static int count_of(const char *s, const char *what)
{
    int count = 0;
    for (const char *at = s; *at; at++) {
        size_t i = 0;
        while (what[i] && at[i] == what[i])
            i++;
        count += what[i] == '\0';
    }
    return count;
}

/* GET path from d's API: the response, which must have status `code` and contain `want`. */
static void get_expect(th_daemon_t *d, const char *path, const char *code, const char *want)
{
    char *r = th_http_get(th_metrics_port(d), "GET", path, NULL);
    assert_non_null(r);
    if (strncmp(r + 9, code, 3) != 0 || !strstr(r, want))
        fail_msg("GET %s: want %s and '%s', got:\n%s", path, code, want, r);
    free(r);
}

/* A GET of path sent on a connection of its own, its response read later (read_all). */
static int send_get(th_daemon_t *d, const char *path)
{
    int fd = th_tcp_connect_from(NULL, th_metrics_port(d));
    assert_true(fd >= 0);
    char req[160];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\n\r\n", path);
    assert_int_equal(write(fd, req, (size_t)n), n);
    return fd;
}

/* The response on fd (until the server closes it, at most WAIT_MS), NUL-terminated; fd closed. */
static char *read_all(int fd)
{
    static char buf[8192];
    size_t len = 0;
    for (int64_t until = th_now_ms() + WAIT_MS; len < sizeof buf - 1 && th_now_ms() < until;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 100) <= 0)
            continue;
        ssize_t n = read(fd, buf + len, sizeof buf - 1 - len);
        if (n <= 0)
            break;
        len += (size_t)n;
    }
    buf[len] = '\0';
    close(fd);
    return buf;
}

/* While the view waits on a query nobody answers, it holds 32 questions (that one and 31
 * queued); the next is refused at once, 503 busy, and the others are answered in turn. */
static void view_queue_full(th_daemon_t *b, const char *path)
{
    int fds[33];
    fds[0] = send_get(b, path);
    for (int64_t until = th_now_ms() + WAIT_MS; atomic_load(&q1_asked) < 4 && th_now_ms() < until;)
        th_sleep_ms(10);
    assert_int_equal(atomic_load(&q1_asked), 4); /* ghost has it, and keeps silent */
    for (int i = 1; i < 33; i++)
        fds[i] = send_get(b, path);
    int busy = 0, answered = 0;
    assert_non_null(strstr(read_all(fds[0]), " 504 "));
    for (int i = 1; i < 33; i++) {
        const char *r = read_all(fds[i]);
        if (strstr(r, " 503 ") && strstr(r, "too many questions to the fleet wait already"))
            busy++;
        else if (strstr(r, " 404 ") && strstr(r, "ghost keeps no such stream"))
            answered++;
        else
            fail_msg("GET %s: %s", path, r);
    }
    assert_int_equal(busy, 1);
    assert_int_equal(answered, 31);
}

/* Keeps partition 1's lease ghost's while ghost_on. */
static void *hold_p1(void *arg)
{
    kvStore *leases = arg;
    while (atomic_load(&ghost_on)) {
        uint64_t rev = 0;
        kvStore_PutString(&rev, leases, "p1", "ghost");
        th_sleep_ms(300);
    }
    return NULL;
}

/* A worker's `streams` answer lists the streams of the partitions it owns, whatever else it
 * holds: with local_writes, a ZeroMQ client's stream of partition 1, whose lease another
 * member holds, is left out, and Tally-Owned says partition 0 alone (PROTOCOL.md §13 "Answers
 * by request-reply"). */
static void test_streams_answer_only_owned(void **state)
{
    (void)state;
    tn_fleet_delete(js, 2);
    th_daemon_t w;
    start_worker(&w, "maker", false, "1000"); /* makes the fleet's buckets */
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
    kvStore *leases = NULL;
    assert_int_equal(js_KeyValue(&leases, js, TALLY_NATS_BUCKET_LEASES), NATS_OK);
    atomic_store(&ghost_on, true);
    pthread_t holder;
    assert_int_equal(pthread_create(&holder, NULL, hold_p1, leases), 0);
    int held = 0;
    assert_true(tn_wait_leases(js, 2, "ghost", 1, WAIT_MS, &held) >= 0);
    const char *local[] = {"--nats-local-writes", "on", NULL};
    start_worker_with(&w, "half", false, "1000", local);
    assert_true(tn_wait_leases(js, 2, "half", 1, WAIT_MS, &held) >= 0);
    char in0[32], in1[32];
    name_in(0, in0, sizeof in0);
    name_in(1, in1, sizeof in1);
    void *sock = th_connect(w.endpoint, 10000);
    assert_non_null(sock);
    uint8_t data[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    const char *names[] = {in0, in1};
    for (int i = 0; i < 2; i++) {
        tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, (uint64_t)i + 1);
        assert_int_equal(tally_req_set_stream(&req, names[i]), TALLY_OK);
        assert_int_equal(th_call_status(sock, &req, data, sizeof data), TALLY_OK);
    }
    th_close(sock);
    char streams[64];
    tally_fleet_subject(streams, sizeof streams, TALLY_NATS_SUBJ_STREAMS, -1, TALLY_NATS_USER_ANON);
    tally_req_t list = th_req(TALLY_OP_STREAMS, TALLY_DTYPE_NONE, 3);
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(&list, header);
    natsMsg *a = answer_on(streams, inbox, inbox, header, sizeof header, WAIT_MS);
    assert_non_null(a);
    const char *owned = NULL;
    assert_int_equal(natsMsgHeader_Get(a, TALLY_NATS_HDR_OWNED, &owned), NATS_OK);
    assert_string_equal(owned, "1");
    tally_rep_t rep;
    const uint8_t *d = (const uint8_t *)natsMsg_GetData(a);
    size_t len = (size_t)natsMsg_GetDataLength(a);
    assert_true(len >= TALLY_REP_HEADER_SIZE);
    assert_int_equal(tally_rep_decode(d, TALLY_REP_HEADER_SIZE, &rep), TALLY_OK);
    assert_int_equal(rep.status, TALLY_OK);
    assert_int_equal(rep.count, 1);
    assert_int_equal(len, TALLY_REP_HEADER_SIZE + 1 + strlen(in0));
    assert_int_equal(d[TALLY_REP_HEADER_SIZE], strlen(in0));
    assert_memory_equal(d + TALLY_REP_HEADER_SIZE + 1, in0, strlen(in0));
    natsMsg_Destroy(a);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
    atomic_store(&ghost_on, false);
    pthread_join(holder, NULL);
    kvStore_Destroy(leases);
}

/* d's log holds `want` (waited for: a take-over is tried again after a back-off). */
static void log_says(const th_daemon_t *d, const char *want)
{
    for (int64_t until = th_now_ms() + WAIT_MS;
         !th_daemon_log_contains(d, want) && th_now_ms() < until;)
        th_sleep_ms(50);
    if (!th_daemon_log_contains(d, want)) {
        char cmd[200];
        snprintf(cmd, sizeof cmd, "tail -30 %s >&2", d->log_path);
        if (system(cmd) != 0)
            print_message("(no log)\n");
        fail_msg("no '%s' in the worker's log", want);
    }
}

/* A take-over that cannot finish leaves the partition untaken (its lease released, tried again
 * after a back-off), saying why in the log (PROTOCOL.md §13 "Membership and who owns what"): a
 * checkpoint holding more streams than the worker's max_streams (the state would not be whole),
 * and a take that outlasts the lease (TALLYD_TEST_TAKE_MS: a cluster that slow). */
static void test_partitions_not_taken(void **state)
{
    (void)state;
    tn_fleet_delete(js, 2); /* a fleet of its own */
    th_daemon_t w;
    char a[32], b[32];
    name_in(0, a, sizeof a);
    name_after(0, a, b, sizeof b);
    start_worker(&w, "full", true, "1000");
    write_direct(&w, a);
    write_direct(&w, b);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0); /* partition 0's checkpoint: both */

    const char *small[] = {"--max-streams", "1", NULL};
    start_worker_with(&w, "small", true, "1000", small);
    log_says(&w, "fleet: partition 0 not taken: its checkpoint: 1 of 2 streams restored");
    void *sock = th_connect(w.endpoint, 10000);
    assert_non_null(sock);
    tally_req_t req = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, 1);
    assert_int_equal(tally_req_set_stream(&req, a), TALLY_OK);
    assert_int_equal(th_call_status(sock, &req, NULL, 0), TALLY_E_NOT_OWNER);
    th_close(sock);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);

    setenv("TALLYD_TEST_TAKE_MS", "3500", 1); /* the lease is 3000 ms */
    start_worker(&w, "slow", true, "1000");
    unsetenv("TALLYD_TEST_TAKE_MS");
    log_says(&w, "not taken: the lease ran out while taking it");
    assert_int_equal(th_metric(&w, "tallyd_nats_partitions_owned"), 0);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 30000), 0);
}

/* A worker that gives a partition up publishes all of its changed streams first, also more
 * than one tick takes (4 MiB of records, about 1,800 byte histograms): a tick's bytes at a time
 * until none is left (PROTOCOL.md §13 "Histogram publications"). */
static void test_give_up_publishes_past_a_tick(void **state)
{
    (void)state;
    enum { STREAMS = 2500 };
    tn_fleet_delete(js, 2);
    natsSubscription *watch = NULL;
    assert_int_equal(natsConnection_SubscribeSync(&watch, nc, TALLY_NATS_SUBJ_WATCH "0"), NATS_OK);
    assert_int_equal(natsSubscription_SetPendingLimits(watch, -1, -1), NATS_OK);
    assert_int_equal(natsConnection_Flush(nc), NATS_OK);
    th_daemon_t w;
    /* One client makes them all; a tick at start, and none more before the give-up. */
    const char *unlimited[] = {"--stream-create-rate", "0", NULL};
    start_worker_with(&w, "giver", true, "600000", unlimited);
    char name[32];
    name_in(0, name, sizeof name);
    write_direct(&w, name); /* partition 0 is its own */
    void *sock = th_connect(w.endpoint, 10000);
    assert_non_null(sock);
    uint8_t data[16];
    memset(data, 1, sizeof data);
    for (int i = 1; i < STREAMS; i++) {
        name_after(0, name, name, sizeof name);
        tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, (uint64_t)i);
        assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
        assert_int_equal(th_call_status(sock, &req, data, sizeof data), TALLY_OK);
    }
    th_close(sock);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 30000), 0);
    int got = 0;
    natsMsg *m = NULL;
    while (got < STREAMS && natsSubscription_NextMsg(&m, watch, WAIT_MS) == NATS_OK) {
        const char *member = NULL;
        assert_int_equal(natsMsgHeader_Get(m, TALLY_NATS_HDR_MEMBER, &member), NATS_OK);
        assert_string_equal(member, "giver");
        got++;
        natsMsg_Destroy(m);
    }
    assert_int_equal(got, STREAMS); /* each changed stream once: none was published before */
    assert_int_not_equal(natsSubscription_NextMsg(&m, watch, 200), NATS_OK);
    natsSubscription_Destroy(watch);
}

/* d's GET /api/v1/streams: ghost's 70,000 streams cut at the list's 8 MiB (64,527 entries of
 * 130 bytes), partial, its fleet part holding `covered`. */
static void cut_list(th_daemon_t *d, const char *covered)
{
    char *r = th_http_get(th_metrics_port(d), "GET", "/api/v1/streams", NULL);
    assert_non_null(r);
    assert_int_equal(strncmp(r + 9, "200", 3), 0);
    assert_int_equal(count_of(r, "{\"stream\":\"t/"), (8 << 20) / 130);
    assert_non_null(strstr(r, covered));
    assert_non_null(strstr(r, "\"partial\":true"));
    free(r);
}

static void test_view_of_a_member_that_answers_badly(void **state)
{
    (void)state;
    /* A worker makes the fleet and gives both partitions up when it stops. */
    th_daemon_t w;
    char in0[32], in1[32], path[64];
    name_in(0, in0, sizeof in0);
    name_in(1, in1, sizeof in1);
    natsSubscription *watch = NULL;
    assert_int_equal(natsConnection_SubscribeSync(&watch, nc, TALLY_NATS_SUBJ_WATCH ">"), NATS_OK);
    tn_fleet_delete(js, 2); /* a fleet of its own: no stream of the first test's checkpoints */
    start_worker(&w, "maker", true, "60000"); /* its first tick at start, the next far later */
    int held = 0;
    assert_true(tn_wait_leases(js, 2, "maker", 2, WAIT_MS, &held) >= 0);
    /* A changed stream in each partition: each published as its partition is given up. */
    write_direct(&w, in0);
    write_direct(&w, in1);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
    char seen[256], want[128];
    watched(watch, 1000, seen, sizeof seen);
    snprintf(want, sizeof want, "%s@maker,%s@maker", in0, in1);
    assert_string_equal(seen, want);
    natsSubscription_Destroy(watch);
    kvStore *leases = NULL;
    assert_int_equal(js_KeyValue(&leases, js, TALLY_NATS_BUCKET_LEASES), NATS_OK);
    atomic_store(&ghost_on, true);
    pthread_t holder;
    assert_int_equal(pthread_create(&holder, NULL, hold_leases, leases), 0);
    assert_true(tn_wait_leases(js, 2, "ghost", 2, WAIT_MS, &held) >= 0);
    natsSubscription *streams_sub = NULL, *q_sub = NULL;
    assert_int_equal(natsConnection_Subscribe(&streams_sub, nc, "tally.streams.anon", on_streams,
                                              NULL),
                     NATS_OK);
    assert_int_equal(natsConnection_Subscribe(&q_sub, nc, "tally.q.*.anon", on_query, NULL),
                     NATS_OK);
    assert_int_equal(natsConnection_Flush(nc), NATS_OK);

    th_daemon_t b;
    start_worker(&b, "bystander", true, "1000");
    char *r = th_http_get(th_metrics_port(&b), "GET", "/api/v1/streams", NULL);
    assert_non_null(r);
    if (!strstr(r, "{\"stream\":\"g/299\",\"member\":\"ghost\"},{\"stream\":\"ghost/a\","
                   "\"member\":\"ghost\"},{\"stream\":\"ghost/b\",\"member\":\"ghost\"},{"
                   "\"stream\":\"ghost/c\",\"member\":\"ghost\"},{\"stream\":\"ghost/d\","
                   "\"member\":\"ghost\"}]") ||
        !strstr(r, "\"partitions\":2,\"covered\":2,") ||
        !strstr(r, "\"members\":3,\"partial\":false"))
        fail_msg("the fleet's list: %s", r);
    assert_int_equal(count_of(r, "\"member\":\"ghost\""), 300 + 4);
    assert_non_null(strstr(r, "\"streams\":[{\"stream\":\"g/000\",\"member\":\"ghost\"}"));
    assert_null(strstr(r, "bad/x"));
    assert_null(strstr(r, "hidden"));
    assert_null(strstr(r, "hhhh"));
    free(r);
    /* Both partitions covered, nothing listed; then partition 0 only: partial, after the wait. */
    get_expect(&b, "/api/v1/streams", "200", "\"streams\":[],\"fleet\":{\"member\":"
                                             "\"bystander\",\"partitions\":2,\"covered\":2,");
    int64_t t0 = th_now_ms();
    r = th_http_get(th_metrics_port(&b), "GET", "/api/v1/streams", NULL);
    assert_non_null(r);
    if (!strstr(r, "\"partitions\":2,\"covered\":1,") || !strstr(r, "\"partial\":true"))
        fail_msg("a list of partition 0 only: %s", r);
    free(r);
    /* 70,000 streams: the list is cut at its 8 MiB (64,527 entries) and says partial; then the
     * same of partition 0 alone, without partition 1's answer. */
    cut_list(&b, "\"partitions\":2,\"covered\":2,");
    assert_true(th_now_ms() - t0 >= 1900); /* the view's whole wait */
    cut_list(&b, "\"partitions\":2,\"covered\":1,");

    snprintf(path, sizeof path, "/api/v1/streams/%s", in0);
    get_expect(&b, path, "502", "the owner's answer on tally.q.0.anon is not a reply");
    snprintf(path, sizeof path, "/api/v1/streams/%s", in1);
    t0 = th_now_ms();
    get_expect(&b, path, "504", "no member answered on tally.q.1.anon in time (no owner?)");
    assert_true(th_now_ms() - t0 >= 1900); /* the view's whole wait */
    get_expect(&b, path, "502", "the owner's reply does not decode");
    get_expect(&b, path, "404", "ghost keeps no such stream");
    view_queue_full(&b, path);

    /* Direct mode: a request for ghost's partition is not this worker's. */
    void *sock = th_connect(b.endpoint, 10000);
    assert_non_null(sock);
    tally_req_t req = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, 1);
    assert_int_equal(tally_req_set_stream(&req, in0), TALLY_OK);
    th_reply_t rep;
    snprintf(want, sizeof want, "partition 0 is owned by ghost");
    long long tries = 0;
    bool named = false;
    for (int64_t until = th_now_ms() + WAIT_MS; !named && th_now_ms() < until; tries++) {
        assert_int_equal(th_call_reply_status(sock, &req, NULL, 0, &rep), TALLY_E_NOT_OWNER);
        named = rep.len == strlen(want) && memcmp(rep.payload, want, strlen(want)) == 0;
        th_reply_free(&rep);
        if (!named)
            th_sleep_ms(100); /* "no owner now" until its next heartbeat has read the lease */
    }
    assert_true(named);
    th_close(sock);
    assert_int_equal(wait_metric(&b, "tallyd_nats_not_owner_total", tries), tries);

    assert_int_equal(th_daemon_stop(&b, SIGTERM, 20000), 0);
    natsSubscription_Destroy(streams_sub);
    natsSubscription_Destroy(q_sub);
    atomic_store(&ghost_on, false);
    pthread_join(holder, NULL);
    kvStore_Delete(leases, "p0");
    kvStore_Delete(leases, "p1");
    kvStore_Destroy(leases);
}

int main(void)
{
    if (tn_skip())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_requests_answered_nowhere),
        cmocka_unit_test(test_view_of_a_member_that_answers_badly),
        cmocka_unit_test(test_partitions_not_taken),
        cmocka_unit_test(test_give_up_publishes_past_a_tick),
        cmocka_unit_test(test_streams_answer_only_owned),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
