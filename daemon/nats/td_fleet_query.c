/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_query.c — the fleet's answers by NATS request-reply (PROTOCOL.md §13 "Answers by
 * request-reply"): `query` on tally.q.<k>.<user> by the partition's owner, a stream's last_seq
 * alone on tally.seq.<k>.<user> (what a producer may ask), `ping`/`info`/`stats` on
 * tally.ctl.<user> by one member (queue group), `streams` on tally.streams.<user> by every member
 * for the partitions it owns. Each goes through the request path like the partition's messages
 * (so a query is answered after what was applied before it), and its reply is published to the
 * request's reply subject, but only when that subject is one of the inboxes of the user the
 * request's subject names (_INBOX.<user>.…): the server lets only that user publish there, so a
 * request cannot steer the worker's answer onto a subject of someone else's (PROTOCOL.md §13
 * "Security"); anything else is answered nowhere, counted and logged. A member that does not own
 * the partition (or whose lease ran out) stays silent: the owner answers, or nobody and the
 * requester asks again.
 *
 * Also the fleet's replies in general: error frames made here, and the headers replies carry.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally_nats_conn.h"
#include "td_fleet_int.h"
#include "td_log.h"
#include "td_nats_js.h"

td_err_t td_fleet_query_open(td_fleet_t *f)
{
    natsStatus s = natsConnection_SubscribeSync(&f->q_sub, f->nc, TALLY_NATS_SUBJ_QUERY "*.*");
    if (s == NATS_OK)
        s = natsConnection_SubscribeSync(&f->seq_sub, f->nc, TALLY_NATS_SUBJ_SEQ "*.*");
    if (s == NATS_OK)
        s = natsConnection_QueueSubscribeSync(&f->ctl_sub, f->nc, TALLY_NATS_SUBJ_CTL ".*",
                                              TALLY_NATS_CTL_QUEUE);
    if (s == NATS_OK)
        s = natsConnection_SubscribeSync(&f->streams_sub, f->nc, TALLY_NATS_SUBJ_STREAMS ".*");
    if (s != NATS_OK) {
        td_err("fleet: subscribing to queries: %s", td_nats_last_error(s));
        return TD_ERR_LIBRARY;
    }
    return TD_OK;
}

void td_fleet_query_close(td_fleet_t *f)
{
    /* Questions keep coming (other members' lists, producers' queries) until each is closed:
     * the way libnats 3.4.1 allows (tally_nats_conn.h). */
    tally__nats_sub_close(f->nc, &f->q_sub);
    tally__nats_sub_close(f->nc, &f->seq_sub);
    tally__nats_sub_close(f->nc, &f->ctl_sub);
    tally__nats_sub_close(f->nc, &f->streams_sub);
}

size_t td_fleet_error_reply(const uint8_t *req, size_t len, tally_status_t st, const char *why,
                            uint8_t *out)
{
    tally_rep_t rep;
    memset(&rep, 0, sizeof rep);
    rep.version = TALLY_PROTO_VERSION;
    if (len >= 16) {
        rep.opcode = req[5];
        rep.flags = req[7];
        rep.request_id = tally_get_u64(req + 8);
    }
    rep.dtype = TALLY_DTYPE_TEXT;
    rep.status = st;
    size_t n = strnlen(why, TALLY_ERROR_MESSAGE_MAX);
    tally_rep_encode(&rep, out);
    memcpy(out + TALLY_REP_HEADER_SIZE, why, n);
    return TALLY_REP_HEADER_SIZE + n;
}

/* td_fleet_publish_reply, and for a `streams` answer (owned not NULL) the partitions it covers
 * in Tally-Owned; for an answer from a standby's copy (stale not NULL) Tally-Stale. */
static void publish_reply(td_fleet_t *f, const char *subject, natsMsg *request, uint32_t k,
                          uint64_t seq, const uint8_t *reply, size_t len, const char *owned,
                          const char *stale)
{
    natsMsg *m = NULL;
    natsStatus s = natsMsg_Create(&m, subject, NULL, (const char *)reply, (int)len);
    if (s == NATS_OK && owned)
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_OWNED, owned);
    if (s == NATS_OK && stale)
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_STALE, stale);
    const char *id = NULL;
    if (s == NATS_OK && natsMsgHeader_Get(request, TALLY_NATS_HDR_MSG_ID, &id) == NATS_OK)
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_REPLY_ID, id);
    char num[24];
    if (s == NATS_OK && seq) {
        snprintf(num, sizeof num, "%u", (unsigned)k);
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_PARTITION, num);
        snprintf(num, sizeof num, "%" PRIu64, seq);
        if (s == NATS_OK)
            s = natsMsgHeader_Set(m, TALLY_NATS_HDR_SEQ, num);
    }
    if (s == NATS_OK) /* who answered: a worker paused past its lease must never be it */
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_MEMBER, f->member);
    if (s == NATS_OK && !seq) {
        snprintf(num, sizeof num, "%zu", f->live_members);
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_MEMBERS, num);
    }
    if (s == NATS_OK)
        s = natsConnection_PublishMsg(f->reply_nc, m);
    if (s != NATS_OK) /* a reply is not stored anyway: the requester times out and asks again */
        td_warn("fleet: reply to %s: %s", subject, td_nats_last_error(s));
    natsMsg_Destroy(m);
}

void td_fleet_publish_reply(td_fleet_t *f, const char *subject, natsMsg *request, uint32_t k,
                            uint64_t seq, const uint8_t *reply, size_t len)
{
    publish_reply(f, subject, request, k, seq, reply, len, NULL, NULL);
}

static void answer_error(td_fleet_t *f, natsMsg *m, tally_status_t st, const char *why)
{
    uint8_t frame[TALLY_REP_HEADER_SIZE + TALLY_ERROR_MESSAGE_MAX];
    size_t len = td_fleet_error_reply((const uint8_t *)natsMsg_GetData(m),
                                      (size_t)natsMsg_GetDataLength(m), st, why, frame);
    td_fleet_publish_reply(f, natsMsg_GetReply(m), m, 0, 0, frame, len);
}

/* True when m's answer may go where it asks: a reply subject among the inboxes of the user its
 * subject names. Otherwise it is counted and logged, and answered nowhere. */
static bool reply_allowed(td_fleet_t *f, natsMsg *m)
{
    const char *subject = natsMsg_GetSubject(m), *reply = natsMsg_GetReply(m);
    const char *user = tally_fleet_subject_user(subject);
    if (!reply)
        return false; /* nothing to answer to */
    if (user && tally_fleet_reply_allowed(reply, user))
        return true;
    TD_FLEET_COUNT(f, refused_reply);
    td_warn("fleet: a request on %s asks for its answer on %s, outside the inboxes of user %s "
            "(%s.>): answered nowhere",
            subject, reply, user ? user : "(none)", TALLY_NATS_INBOX "<user>");
    return false;
}

/* Which operations a subscription answers, and for tally.q and tally.seq the partition:
 * TALLY_OK when m may be run here, else the status its error answer carries (bad_opcode for an
 * operation the subject does not answer, a windowed query on tally.seq included; bad_stream_name
 * for a stream of another partition); *mine false: not this member's (the owner answers). */
static tally_status_t judge(td_fleet_t *f, natsMsg *m, natsSubscription *from, bool *mine)
{
    const uint8_t *data = (const uint8_t *)natsMsg_GetData(m);
    uint8_t op = data[5];
    *mine = true;
    if (from == f->q_sub || from == f->seq_sub) {
        const char *prefix = from == f->q_sub ? TALLY_NATS_SUBJ_QUERY : TALLY_NATS_SUBJ_SEQ;
        unsigned long k = strtoul(natsMsg_GetSubject(m) + strlen(prefix), NULL, 10);
        if (k >= f->partitions || !f->parts[k].owned ||
            !td_lease_valid(&f->parts[k].lease, td_nats_now_ms())) {
            *mine = false;
            return TALLY_E_OPCODE;
        }
        size_t slen = data[17] <= TALLY_STREAM_NAME_MAX ? data[17] : 0;
        bool window = from == f->seq_sub && (data[7] & TALLY_FLAG_QUERY_WINDOW);
        if (op != TALLY_OP_QUERY || window)
            return TALLY_E_OPCODE;
        return slen == 0 || tally_partition((const char *)data + 64, slen, f->partitions) == k
                   ? TALLY_OK
                   : TALLY_E_STREAM_NAME;
    }
    if (from == f->ctl_sub)
        return op == TALLY_OP_PING || op == TALLY_OP_INFO || op == TALLY_OP_STATS
                   ? TALLY_OK
                   : TALLY_E_OPCODE;
    return op == TALLY_OP_STREAMS ? TALLY_OK : TALLY_E_OPCODE;
}

/* A `streams` answer's Tally-Members, read from TALLY_MEMBERS when the question comes (once per
 * TD_FLEET_MEMBERS_FRESH_MS of questions at most), not only at the heartbeat (every lease TTL /
 * 3): a member that joined since is counted in the next answer. */
#define TD_FLEET_MEMBERS_FRESH_MS 100
static void count_members(td_fleet_t *f)
{
    int64_t now = td_nats_now_ms();
    if (f->members_read_ms && now - f->members_read_ms < TD_FLEET_MEMBERS_FRESH_MS)
        return;
    char msg[256], **ids = NULL;
    size_t n = 0;
    if (td_member_list(f->members, &ids, &n, msg, sizeof msg) != TD_OK) {
        td_warn("fleet: %s", msg); /* the heartbeat's count stands */
        return;
    }
    td_member_list_free(ids, n);
    f->live_members = n;
    f->members_read_ms = now;
}

/* A query of a partition this member does not own, asking Tally-Stale-Ok: answered from the
 * standby's copy here, marked Tally-Stale (PROTOCOL.md §13 "Answers by request-reply"); true
 * when it was (m is then gone). Only a well-formed plain `query` of a stream of partition k:
 * anything else is the owner's to answer or refuse. */
static bool answer_stale(td_fleet_t *f, natsMsg *m)
{
    const char *ok = NULL;
    tally_req_t req;
    uint8_t frame[TD_STANDBY_ANSWER_MAX];
    uint64_t cl_seq = 0;
    unsigned long k = strtoul(natsMsg_GetSubject(m) + strlen(TALLY_NATS_SUBJ_QUERY), NULL, 10);
    size_t len = (size_t)natsMsg_GetDataLength(m), n = 0;
    char why[128], stale[24];
    if (natsMsgHeader_Get(m, TALLY_NATS_HDR_STALE_OK, &ok) != NATS_OK || k >= f->partitions ||
        len < TALLY_REQ_HEADER_SIZE ||
        tally_req_decode((const uint8_t *)natsMsg_GetData(m), TALLY_REQ_HEADER_SIZE, &req, why,
                         sizeof why) != TALLY_OK ||
        req.opcode != TALLY_OP_QUERY || (req.flags & TALLY_FLAG_QUERY_WINDOW) || !req.stream_len ||
        tally_partition(req.stream, req.stream_len, f->partitions) != k ||
        !natsMsg_GetReply(m) || /* a refused reply subject: take_query counts it */
        !tally_fleet_reply_allowed(natsMsg_GetReply(m),
                                   tally_fleet_subject_user(natsMsg_GetSubject(m))) ||
        !(n = td_standby_answer(f, (uint32_t)k, &req, frame, &cl_seq)))
        return false;
    snprintf(stale, sizeof stale, "%" PRIu64, cl_seq);
    publish_reply(f, natsMsg_GetReply(m), m, 0, 0, frame, n, NULL, stale);
    natsMsg_Destroy(m);
    return true;
}

/* Whether this member answers m at all, and with what; forwards it when it is to be run. */
static void take_query(td_fleet_t *f, natsMsg *m, natsSubscription *from)
{
    const uint8_t *data = (const uint8_t *)natsMsg_GetData(m);
    size_t len = (size_t)natsMsg_GetDataLength(m);
    bool mine = true;
    tally_status_t why = len >= TALLY_REQ_HEADER_SIZE ? judge(f, m, from, &mine) : TALLY_E_HEADER;
    if (!mine && from == f->q_sub && answer_stale(f, m))
        return;
    if (!mine || !reply_allowed(f, m)) {
        natsMsg_Destroy(m); /* not ours, or nowhere it may go */
        return;
    }
    if (why == TALLY_OK && from == f->streams_sub)
        count_members(f);
    if (why != TALLY_OK) {
        answer_error(f, m, why,
                     why == TALLY_E_HEADER ? "a request is a 128-byte header and a payload"
                                           : "not answered on this subject (PROTOCOL.md §13)");
        natsMsg_Destroy(m);
        return;
    }
    int slot = td_fleet_path_send(f, PEND_QUERY, data, len);
    if (slot < 0) {
        answer_error(f, m, TALLY_E_BUSY, "the worker has too many requests in flight");
        natsMsg_Destroy(m);
        return;
    }
    f->pend[slot].msg = m;
    f->pend[slot].streams_filter = from == f->streams_sub;
    f->pend[slot].seq_only = from == f->seq_sub;
}

/* The queries waiting for the request path's answer. */
static bool queries_waiting(const td_fleet_t *f)
{
    for (size_t i = 0; i < f->pend_cap; i++)
        if (f->pend[i].kind == PEND_QUERY && f->pend[i].msg)
            return true;
    return false;
}

void td_fleet_query_finish(td_fleet_t *f, int wait_ms)
{
    int64_t until = td_nats_now_ms() + wait_ms;
    while (queries_waiting(f) && td_nats_now_ms() < until)
        td_fleet_path_poll(f, 10);
    for (size_t i = 0; i < f->pend_cap; i++) {
        td_pend_t *p = &f->pend[i];
        if (p->kind != PEND_QUERY || !p->msg)
            continue;
        answer_error(f, p->msg, TALLY_E_SHUTDOWN,
                     "the member stopped before it answered (ask again: another member takes "
                     "its partitions)");
        natsMsg_Destroy(p->msg);
        memset(p, 0, sizeof *p);
    }
}

bool td_fleet_query_step(td_fleet_t *f)
{
    natsSubscription *subs[4] = {f->q_sub, f->seq_sub, f->ctl_sub, f->streams_sub};
    bool any = false;
    for (int i = 0; i < 4; i++) {
        natsMsg *m = NULL;
        while (td_nats_next_queued(subs[i], &m)) {
            take_query(f, m, subs[i]);
            any = true;
        }
    }
    return any;
}

/* A `streams` reply cut to the streams of the partitions this member owns now (owned[k], judged
 * once for the whole answer, so that the list and its Tally-Owned header agree). */
static uint8_t *filter_streams(td_fleet_t *f, const bool *owned, const uint8_t *reply, size_t len,
                               size_t *out_len)
{
    uint8_t *out = malloc(len);
    if (!out)
        return NULL;
    memcpy(out, reply, TALLY_REP_HEADER_SIZE);
    size_t at = TALLY_REP_HEADER_SIZE, w = TALLY_REP_HEADER_SIZE;
    uint64_t count = 0;
    while (at < len && at + 1 + reply[at] <= len) {
        size_t n = reply[at];
        if (owned[tally_partition((const char *)reply + at + 1, n, f->partitions)]) {
            memcpy(out + w, reply + at, 1 + n);
            w += 1 + n;
            count++;
        }
        at += 1 + n;
    }
    tally_put_u64(out + 24, count);
    *out_len = w;
    return out;
}

/* A `query` reply cut to what tally.seq answers: the header alone, aux0 = the stream's last_seq
 * (PROTOCOL.md §13 "Answers by request-reply"), into out; its length, 0 when it does not
 * decode. */
static size_t seq_only(const uint8_t *reply, size_t len, uint8_t *out)
{
    tally_rep_t rep;
    tally_stream_info_t info;
    if (tally_rep_decode(reply, TALLY_REP_HEADER_SIZE, &rep) != TALLY_OK ||
        tally_stream_info_decode(reply + TALLY_REP_HEADER_SIZE, len - TALLY_REP_HEADER_SIZE,
                                 &info) != TALLY_OK)
        return 0;
    rep.dtype = TALLY_DTYPE_NONE;
    rep.count = 0;
    rep.aux0 = info.last_seq;
    rep.aux1 = 0;
    tally_rep_encode(&rep, out);
    return TALLY_REP_HEADER_SIZE;
}

void td_fleet_query_reply(td_fleet_t *f, td_pend_t *pend, const uint8_t *reply, size_t len)
{
    natsMsg *m = pend->msg;
    pend->msg = NULL;
    const uint8_t *send = reply;
    uint8_t *filtered = NULL;
    uint8_t head[TALLY_REP_HEADER_SIZE];
    bool ok = tally_get_u32(reply + 16) == TALLY_OK;
    bool owned[TALLY_NATS_MAX_PARTITIONS];
    char owned_text[TALLY_NATS_MAX_PARTITIONS / 4 + 1];
    if (pend->streams_filter && ok) {
        int64_t now = td_nats_now_ms();
        for (uint32_t k = 0; k < f->partitions; k++)
            owned[k] = f->parts[k].owned && td_lease_valid(&f->parts[k].lease, now);
        tally_fleet_owned_format(owned, f->partitions, owned_text, sizeof owned_text);
        filtered = filter_streams(f, owned, reply, len, &len);
        if (!filtered) { /* not the whole table, which would claim other members' streams */
            answer_error(f, m, TALLY_E_NOMEM, "out of memory");
            natsMsg_Destroy(m);
            return;
        }
        send = filtered;
    }
    if (pend->seq_only && ok) {
        len = seq_only(reply, len, head);
        send = head;
    }
    if (len == 0) { /* an answer that did not decode: nothing a producer may be given */
        natsMsg_Destroy(m);
        return;
    }
    publish_reply(f, natsMsg_GetReply(m), m, 0, 0, send, len, filtered ? owned_text : NULL, NULL);
    free(filtered);
    natsMsg_Destroy(m);
}

void td_fleet_on_reply(td_fleet_t *f, int slot, const uint8_t *header, const uint8_t *body,
                       size_t body_len)
{
    td_pend_t *pend = &f->pend[slot];
    if (pend->kind == PEND_PART) {
        td_part_reply(f, &f->parts[pend->k], pend, header, body, body_len);
    } else { /* PEND_QUERY: dispatch (td_fleet_transport.c) keeps PEND_SYNC's, drops free ones */
        size_t len = 0;
        uint8_t *frame = td_fleet_frame(header, body, body_len, NULL, 0, &len);
        if (frame)
            td_fleet_query_reply(f, pend, frame, len);
        else
            natsMsg_Destroy(pend->msg); /* unanswered: its asker times out */
        free(frame);
    }
    memset(pend, 0, sizeof *pend);
}
