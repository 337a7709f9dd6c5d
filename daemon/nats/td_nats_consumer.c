/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_nats_consumer.c — see td_nats_consumer.h.
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally_fleet.h"
#include "tally_nats_conn.h"
#include "td_nats_consumer.h"
#include "td_nats_js.h"

struct td_pull {
    natsConnection *nc;
    natsSubscription *inbox;
    char inbox_subject[256];
    char next[200]; /* $JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer> */
    char stream[32], durable[80];
};

void td_consumer_delete_others(jsCtx *js, const td_pull_t *pull)
{
    jsConsumerNamesList *names = NULL;
    jsErrCode jerr = 0;
    if (js_ConsumerNames(&names, js, pull->stream, NULL, &jerr) != NATS_OK || !names)
        return;
    for (int i = 0; i < names->Count; i++)
        if (strcmp(names->List[i], pull->durable) != 0)
            js_DeleteConsumer(js, pull->stream, names->List[i], NULL, &jerr);
    jsConsumerNamesList_Destroy(names);
}

void td_pull_destroy(td_pull_t **pull)
{
    if (!*pull)
        return;
    /* A pull still open on the server (expired late, or cut short by the batch) may deliver to
     * the inbox meanwhile: closed the way libnats 3.4.1 allows (tally_nats_conn.h). */
    tally__nats_sub_close((*pull)->nc, &(*pull)->inbox);
    free(*pull);
    *pull = NULL;
}

td_err_t td_consumer_start(jsCtx *js, natsConnection *nc, const char *inbox, uint32_t k,
                           uint64_t epoch, unsigned restart, uint64_t start_seq,
                           int64_t ack_wait_ms, td_pull_t **pull, char *msg, size_t cap)
{
    char stream[32], durable[80];
    tally_fleet_name(stream, sizeof stream, TALLY_NATS_STREAM_PREFIX, k);
    snprintf(durable, sizeof durable, "%s%u-%" PRIu64 "-%u", TALLY_NATS_CONSUMER_PREFIX,
             (unsigned)k, epoch, restart);
    *pull = NULL;
    jsConsumerConfig cc;
    jsConsumerConfig_Init(&cc);
    cc.Durable = durable;
    cc.AckPolicy = js_AckAll; /* one acknowledgement per checkpoint */
    cc.AckWait = ack_wait_ms * 1000000;
    cc.MaxAckPending = TD_NATS_ACK_PENDING;
    cc.DeliverPolicy = start_seq > 1 ? js_DeliverByStartSequence : js_DeliverAll;
    cc.OptStartSeq = start_seq > 1 ? start_seq : 0;
    jsConsumerInfo *ci = NULL;
    jsErrCode jerr = 0;
    natsStatus s = js_AddConsumer(&ci, js, stream, &cc, NULL, &jerr);
    /* A name that exists already (a create that timed out here but happened there) must start
     * where this owner needs it; anything else is refused. */
    bool right = s == NATS_OK && ci && ci->Config && ci->Config->OptStartSeq == cc.OptStartSeq &&
                 ci->Delivered.Consumer == 0;
    int64_t pending = right ? ci->Config->MaxAckPending : 0;
    jsConsumerInfo_Destroy(ci);
    if (!right || pending != cc.MaxAckPending) {
        snprintf(msg, cap, "creating consumer %s at %" PRIu64 ": %s", durable, start_seq,
                 s != NATS_OK ? td_nats_last_error(s)
                 : !right     ? "it exists and has delivered already"
                              : "the server did not take its max_ack_pending");
        return TD_ERR_LIBRARY;
    }
    td_pull_t *p = calloc(1, sizeof *p);
    if (!p) {
        snprintf(msg, cap, "out of memory");
        return TD_ERR_NOMEM;
    }
    p->nc = nc;
    snprintf(p->stream, sizeof p->stream, "%s", stream);
    snprintf(p->durable, sizeof p->durable, "%s", durable);
    snprintf(p->inbox_subject, sizeof p->inbox_subject, "%s", inbox);
    snprintf(p->next, sizeof p->next, "$JS.API.CONSUMER.MSG.NEXT.%s.%s", stream, durable);
    s = natsConnection_SubscribeSync(&p->inbox, nc, p->inbox_subject);
    if (s != NATS_OK) {
        snprintf(msg, cap, "subscribing to %s: %s", p->inbox_subject, td_nats_last_error(s));
        free(p);
        return TD_ERR_LIBRARY;
    }
    natsSubscription_SetPendingLimits(p->inbox, -1, -1); /* bounded by the pulls' max bytes */
    *pull = p;
    return TD_OK;
}

/* A status message of a pull (404 no messages, 408 expired, 409 limits; 100 a heartbeat): it
 * carries a Status header and no reply subject. */
static const char *pull_status(natsMsg *m)
{
    const char *st = NULL;
    if (natsMsg_GetReply(m) && strncmp(natsMsg_GetReply(m), "$JS.ACK.", 8) == 0)
        return NULL;
    return natsMsgHeader_Get(m, "Status", &st) == NATS_OK && st ? st : "";
}

td_err_t td_consumer_fetch(td_pull_t *pull, int batch, int64_t max_bytes, int64_t wait_ms,
                           natsMsgList *list, char *msg, size_t cap)
{
    memset(list, 0, sizeof *list);
    if (max_bytes <= 0 || max_bytes > TD_NATS_FETCH_MAX_BYTES)
        max_bytes = TD_NATS_FETCH_MAX_BYTES;
    wait_ms = wait_ms > 0 ? wait_ms : 1;
    /* no_wait with expires: the server waits (up to the expiry) for a first message only, then
     * ends the pull with a 408 once it has delivered what the consumer holds. A plain pull is
     * held until its whole batch: the last messages of a backlog, or each message of a stream
     * slower than a batch a wait, waited out the expiry (issue 32: 250 ms at every partition's
     * end of an apply). */
    char body[160];
    int n = snprintf(body, sizeof body,
                     "{\"batch\":%d,\"max_bytes\":%" PRId64 ",\"expires\":%" PRId64
                     ",\"no_wait\":true}",
                     batch, max_bytes, wait_ms * 1000000);
    natsStatus s =
        natsConnection_PublishRequest(pull->nc, pull->next, pull->inbox_subject, body, n);
    if (s == NATS_OK && !(list->Msgs = calloc((size_t)batch, sizeof *list->Msgs)))
        s = NATS_NO_MEMORY;
    /* Until the batch, the bytes, this pull's end (a status), or its expiry and a little more.
     * A message of an earlier pull that comes late is taken too: the consumer delivers in
     * order, whichever pull carries it. */
    int64_t deadline = nats_Now() + wait_ms + 200, bytes = 0;
    while (s == NATS_OK && list->Count < batch && bytes < max_bytes) {
        int64_t left = deadline - nats_Now();
        natsMsg *m = NULL;
        if (left <= 0 || (s = natsSubscription_NextMsg(&m, pull->inbox, left)) == NATS_TIMEOUT) {
            s = NATS_OK;
            break;
        }
        if (s != NATS_OK)
            break;
        const char *st = pull_status(m);
        if (!st) {
            bytes += natsMsg_GetDataLength(m);
            list->Msgs[list->Count++] = m;
            continue;
        }
        bool heartbeat = strcmp(st, "100") == 0;
        natsMsg_Destroy(m);
        if (!heartbeat)
            break;
    }
    if (s == NATS_OK && list->Count == 0) { /* an empty list holds nothing, as libnats' did */
        free(list->Msgs);
        list->Msgs = NULL;
    }
    if (s == NATS_OK)
        return TD_OK;
    natsMsgList_Destroy(list);
    snprintf(msg, cap, "fetch: %s", td_nats_last_error(s));
    return TD_ERR_LIBRARY;
}

/* The stream sequence and pending count of a JetStream ack subject, read in place: tokens 6 and 9
 * of "$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<tm>.<pending>", or 8 and 11 of the
 * form with domain and account hash in front (11 tokens or more). False for anything else. The
 * same reading as natsMsg_GetMetaData, without its allocations (once per message: issue 32). */
static bool ack_seq(const char *ack, uint64_t *seq, uint64_t *pending)
{
    const char *tok[16];
    size_t n = 0;
    if (!ack || strncmp(ack, "$JS.ACK.", 8) != 0)
        return false;
    /* Token by token with strchr, which reads the ~100-byte subject a vector at a time (issue
     * 32: 570 -> 457 instructions a delivery against a loop over every character). */
    for (const char *c = ack; c; c = strchr(c, '.')) {
        if (n == 16)
            return false; /* more tokens than either form has */
        c += n > 0;       /* past the dot */
        tok[n++] = c;
    }
    size_t at = n == 9 ? 5 : n >= 11 ? 7 : 0;
    if (!at)
        return false;
    uint64_t v[2] = {0, 0};
    for (int i = 0; i < 2; i++) {
        const char *c = tok[at + (size_t)i * 3];
        if (*c < '0' || *c > '9')
            return false;
        for (; *c >= '0' && *c <= '9'; c++)
            v[i] = v[i] * 10 + (uint64_t)(*c - '0');
        if (*c && *c != '.')
            return false;
    }
    *seq = v[0];
    *pending = v[1];
    return true;
}

uint64_t td_nats_msg_seq_pending(natsMsg *m, uint64_t *pending)
{
    uint64_t seq = 0;
    *pending = 0;
    if (ack_seq(natsMsg_GetReply(m), &seq, pending))
        return seq;
    jsMsgMetaData *meta = NULL;
    if (natsMsg_GetMetaData(&meta, m) != NATS_OK)
        return 0;
    seq = meta->Sequence.Stream;
    *pending = meta->NumPending;
    jsMsgMetaData_Destroy(meta);
    return seq;
}

uint64_t td_nats_msg_seq(natsMsg *m)
{
    uint64_t pending;
    return td_nats_msg_seq_pending(m, &pending);
}

td_err_t td_consumer_ack_sync(natsConnection *nc, const char *ack_subject, int64_t timeout_ms,
                              char *msg, size_t cap)
{
    natsMsg *reply = NULL;
    natsStatus s = natsConnection_Request(&reply, nc, ack_subject, "+ACK", 4, timeout_ms);
    natsMsg_Destroy(reply);
    if (s != NATS_OK) {
        snprintf(msg, cap, "acknowledging: %s", td_nats_last_error(s));
        return TD_ERR_LIBRARY;
    }
    return TD_OK;
}

uint64_t td_partition_first_seq(jsCtx *js, uint32_t k)
{
    char stream[32];
    tally_fleet_name(stream, sizeof stream, TALLY_NATS_STREAM_PREFIX, k);
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    uint64_t first = 0;
    if (js_GetStreamInfo(&si, js, stream, NULL, &jerr) == NATS_OK)
        first = si->State.FirstSeq;
    jsStreamInfo_Destroy(si);
    return first;
}
