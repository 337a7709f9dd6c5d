/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_nats_consumer.c — see td_nats_consumer.h.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "tally_fleet.h"
#include "td_nats_consumer.h"
#include "td_nats_js.h"

/* Deletes every consumer of stream but `keep`: a previous owner's (it may still deliver). A
 * failure only leaves one for InactiveThreshold to remove. */
static void delete_others(jsCtx *js, const char *stream, const char *keep)
{
    jsConsumerNamesList *names = NULL;
    jsErrCode jerr = 0;
    if (js_ConsumerNames(&names, js, stream, NULL, &jerr) != NATS_OK || !names)
        return;
    for (int i = 0; i < names->Count; i++)
        if (strcmp(names->List[i], keep) != 0)
            js_DeleteConsumer(js, stream, names->List[i], NULL, &jerr);
    jsConsumerNamesList_Destroy(names);
}

td_err_t td_consumer_start(jsCtx *js, uint32_t k, uint64_t epoch, unsigned restart,
                           uint64_t start_seq, int64_t ack_wait_ms, natsSubscription **sub,
                           char *msg, size_t cap)
{
    char stream[32], durable[80], subject[32];
    tally_fleet_name(stream, sizeof stream, TALLY_NATS_STREAM_PREFIX, k);
    snprintf(durable, sizeof durable, "%s%u-%" PRIu64 "-%u", TALLY_NATS_CONSUMER_PREFIX,
             (unsigned)k, epoch, restart);
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, k, "*");
    *sub = NULL;
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
    jsSubOptions so;
    jsSubOptions_Init(&so);
    so.Stream = stream;
    so.Consumer = durable; /* bind: the subscription does not own (nor delete) the consumer */
    s = js_PullSubscribe(sub, js, subject, durable, NULL, &so, &jerr);
    if (s != NATS_OK) {
        snprintf(msg, cap, "binding consumer %s: %s", durable, td_nats_last_error(s));
        *sub = NULL;
        return TD_ERR_LIBRARY;
    }
    delete_others(js, stream, durable);
    return TD_OK;
}

td_err_t td_consumer_fetch(natsSubscription *sub, int batch, int64_t max_bytes, int64_t wait_ms,
                           natsMsgList *list, char *msg, size_t cap)
{
    jsFetchRequest fr;
    jsFetchRequest_Init(&fr);
    fr.Batch = batch;
    fr.MaxBytes =
        max_bytes > 0 && max_bytes < TD_NATS_FETCH_MAX_BYTES ? max_bytes : TD_NATS_FETCH_MAX_BYTES;
    /* A wait is needed: NoWait with an expiry still waits the expiry on nats-server 2.9, and
     * without one libnats returns before the server's answer can arrive. */
    fr.Expires = (wait_ms > 0 ? wait_ms : 1) * 1000000;
    memset(list, 0, sizeof *list);
    jsErrCode jerr = 0;
    natsStatus s = natsSubscription_FetchRequest(list, sub, &fr);
    (void)jerr;
    if (s == NATS_OK || s == NATS_TIMEOUT)
        return TD_OK;
    snprintf(msg, cap, "fetch: %s", td_nats_last_error(s));
    return TD_ERR_LIBRARY;
}

uint64_t td_nats_msg_seq_pending(natsMsg *m, uint64_t *pending)
{
    jsMsgMetaData *meta = NULL;
    *pending = 0;
    if (natsMsg_GetMetaData(&meta, m) != NATS_OK)
        return 0;
    uint64_t seq = meta->Sequence.Stream;
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
