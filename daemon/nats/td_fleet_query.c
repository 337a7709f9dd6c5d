/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_query.c — the fleet's answers by NATS request-reply (PROTOCOL.md §13 "Answers by
 * request-reply"): `query` on tally.q.<k> by the partition's owner, `ping`/`info`/`stats` on
 * tally.ctl by one member (queue group), `streams` on tally.streams by every member for the
 * partitions it owns. Each goes through the request path like the partition's messages (so a
 * query is answered after what was applied before it), and its reply is published to the
 * request's reply subject. A member that does not own the partition (or whose lease ran out)
 * stays silent: the owner answers, or nobody and the requester asks again.
 *
 * Also the fleet's replies in general: error frames made here, and the headers replies carry.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_fleet_int.h"
#include "td_log.h"
#include "td_nats_js.h"

td_err_t td_fleet_query_open(td_fleet_t *f)
{
    natsStatus s = natsConnection_SubscribeSync(&f->q_sub, f->nc, TALLY_NATS_SUBJ_QUERY "*");
    if (s == NATS_OK)
        s = natsConnection_QueueSubscribeSync(&f->ctl_sub, f->nc, TALLY_NATS_SUBJ_CTL,
                                              TALLY_NATS_CTL_QUEUE);
    if (s == NATS_OK)
        s = natsConnection_SubscribeSync(&f->streams_sub, f->nc, TALLY_NATS_SUBJ_STREAMS);
    if (s != NATS_OK) {
        td_err("fleet: subscribing to queries: %s", td_nats_last_error(s));
        return TD_ERR_LIBRARY;
    }
    return TD_OK;
}

void td_fleet_query_close(td_fleet_t *f)
{
    natsSubscription_Destroy(f->q_sub);
    natsSubscription_Destroy(f->ctl_sub);
    natsSubscription_Destroy(f->streams_sub);
    f->q_sub = f->ctl_sub = f->streams_sub = NULL;
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

void td_fleet_publish_reply(td_fleet_t *f, const char *subject, natsMsg *request, uint32_t k,
                            uint64_t seq, const uint8_t *reply, size_t len)
{
    natsMsg *m = NULL;
    natsStatus s = natsMsg_Create(&m, subject, NULL, (const char *)reply, (int)len);
    const char *id = NULL;
    if (s == NATS_OK && natsMsgHeader_Get(request, TALLY_NATS_HDR_MSG_ID, &id) == NATS_OK && id)
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_REPLY_ID, id);
    char num[24];
    if (s == NATS_OK && seq) {
        snprintf(num, sizeof num, "%u", (unsigned)k);
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_PARTITION, num);
        snprintf(num, sizeof num, "%" PRIu64, seq);
        if (s == NATS_OK)
            s = natsMsgHeader_Set(m, TALLY_NATS_HDR_SEQ, num);
    }
    if (s == NATS_OK && !seq)
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_MEMBER, f->member);
    if (s == NATS_OK)
        s = natsConnection_PublishMsg(f->nc, m);
    if (s != NATS_OK) /* a reply is not stored anyway: the requester times out and asks again */
        td_warn("fleet: reply to %s: %s", subject, td_nats_last_error(s));
    natsMsg_Destroy(m);
}

bool td_fleet_owns_stream(td_fleet_t *f, const char *name, size_t len)
{
    td_part_t *p = &f->parts[tally_partition(name, len, f->partitions)];
    return p->owned && td_lease_valid(&p->lease, td_nats_now_ms());
}

static void answer_error(td_fleet_t *f, natsMsg *m, tally_status_t st, const char *why)
{
    uint8_t frame[TALLY_REP_HEADER_SIZE + TALLY_ERROR_MESSAGE_MAX];
    size_t len = td_fleet_error_reply((const uint8_t *)natsMsg_GetData(m),
                                      (size_t)natsMsg_GetDataLength(m), st, why, frame);
    td_fleet_publish_reply(f, natsMsg_GetReply(m), m, 0, 0, frame, len);
}

/* Whether this member answers m at all, and with what; forwards it when it is to be run. */
static void take_query(td_fleet_t *f, natsMsg *m, natsSubscription *from)
{
    const uint8_t *data = (const uint8_t *)natsMsg_GetData(m);
    size_t len = (size_t)natsMsg_GetDataLength(m);
    const char *reply_to = natsMsg_GetReply(m);
    if (!reply_to || len < TALLY_REQ_HEADER_SIZE) {
        if (reply_to)
            answer_error(f, m, TALLY_E_HEADER, "a request is a 128-byte header and a payload");
        natsMsg_Destroy(m);
        return;
    }
    uint8_t op = data[5];
    bool ok;
    if (from == f->q_sub) {
        unsigned long k = strtoul(natsMsg_GetSubject(m) + strlen(TALLY_NATS_SUBJ_QUERY), NULL, 10);
        if (k >= f->partitions || !f->parts[k].owned ||
            !td_lease_valid(&f->parts[k].lease, td_nats_now_ms())) {
            natsMsg_Destroy(m); /* not ours: the owner answers */
            return;
        }
        size_t slen = data[17] <= TALLY_STREAM_NAME_MAX ? data[17] : 0;
        ok = op == TALLY_OP_QUERY &&
             (slen == 0 || tally_partition((const char *)data + 64, slen, f->partitions) == k);
    } else if (from == f->ctl_sub) {
        ok = op == TALLY_OP_PING || op == TALLY_OP_INFO || op == TALLY_OP_STATS;
    } else {
        ok = op == TALLY_OP_STREAMS;
    }
    if (!ok) {
        answer_error(
            f, m, from == f->q_sub && op == TALLY_OP_QUERY ? TALLY_E_STREAM_NAME : TALLY_E_OPCODE,
            "not answered on this subject (PROTOCOL.md §13)");
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
}

bool td_fleet_query_step(td_fleet_t *f)
{
    natsSubscription *subs[3] = {f->q_sub, f->ctl_sub, f->streams_sub};
    bool any = false;
    for (int i = 0; i < 3; i++) {
        natsMsg *m = NULL;
        while (natsSubscription_NextMsg(&m, subs[i], 0) == NATS_OK) {
            take_query(f, m, subs[i]);
            any = true;
        }
    }
    return any;
}

/* A `streams` reply cut to the streams of the partitions this member owns. */
static uint8_t *filter_streams(td_fleet_t *f, const uint8_t *reply, size_t len, size_t *out_len)
{
    uint8_t *out = malloc(len);
    if (!out)
        return NULL;
    memcpy(out, reply, TALLY_REP_HEADER_SIZE);
    size_t at = TALLY_REP_HEADER_SIZE, w = TALLY_REP_HEADER_SIZE;
    uint64_t count = 0;
    while (at < len && at + 1 + reply[at] <= len) {
        size_t n = reply[at];
        if (td_fleet_owns_stream(f, (const char *)reply + at + 1, n)) {
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

void td_fleet_query_reply(td_fleet_t *f, td_pend_t *pend, const uint8_t *reply, size_t len)
{
    natsMsg *m = pend->msg;
    pend->msg = NULL;
    const uint8_t *send = reply;
    uint8_t *filtered = NULL;
    if (pend->streams_filter && tally_get_u32(reply + 16) == TALLY_OK &&
        (filtered = filter_streams(f, reply, len, &len)))
        send = filtered;
    td_fleet_publish_reply(f, natsMsg_GetReply(m), m, 0, 0, send, len);
    free(filtered);
    natsMsg_Destroy(m);
}

void td_fleet_on_reply(td_fleet_t *f, int slot, const uint8_t *reply, size_t len)
{
    td_pend_t *pend = &f->pend[slot];
    if (pend->kind == PEND_PART)
        td_part_reply(f, &f->parts[pend->k], pend, reply, len);
    else if (pend->kind == PEND_QUERY)
        td_fleet_query_reply(f, pend, reply, len);
    memset(pend, 0, sizeof *pend);
}
