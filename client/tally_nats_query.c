/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_nats_query.c — a stream's record from the fleet by request-reply (PROTOCOL.md §13
 * "Answers by request-reply"): from its partition's owner (tally_nats_query), from the owner or
 * a standby's copy, whichever answers first (tally_nats_query_stale, issue 33's `--stale-ok`),
 * and a stream's last_seq alone for a producer (tally__nats_last_seq). Each is one
 * tally__nats_ask (tally_nats.c) on the partition's subject. Only with libnats (the stub
 * answers TALLY_E_ARG).
 */
#include "tally.h"
#include "tally_client_nats.h"
#include "tally_fleet.h"

/* The stream's record on tally.q.<k>.<user>, a standby's answer allowed when stale_ok. */
static tally_status_t ask_record(tally_nats_t *self, const char *stream, bool stale_ok,
                                 tally_stream_info_t *info, uint64_t *stale)
{
    if (!self || !stream || !info)
        return TALLY_E_ARG;
    tally_reply_t reply;
    tally_reply_init(&reply);
    tally_status_t st =
        tally__nats_ask(self, TALLY_NATS_SUBJ_QUERY, stream, stale_ok, &reply, stale);
    if (st == TALLY_OK)
        st = tally_reply_stream_info(&reply, info);
    tally_reply_clear(&reply);
    return st;
}

tally_status_t tally_nats_query(tally_nats_t *self, const char *stream, tally_stream_info_t *info)
{
    uint64_t stale = 0;
    return ask_record(self, stream, false, info, &stale);
}

tally_status_t tally_nats_query_stale(tally_nats_t *self, const char *stream,
                                      tally_stream_info_t *info, uint64_t *stale)
{
    if (!stale)
        return TALLY_E_ARG;
    return ask_record(self, stream, true, info, stale);
}

tally_status_t tally__nats_last_seq(tally_nats_t *self, const char *stream, uint64_t *last)
{
    *last = 0;
    uint64_t stale = 0;
    tally_reply_t reply;
    tally_reply_init(&reply);
    tally_status_t st = tally__nats_ask(self, TALLY_NATS_SUBJ_SEQ, stream, false, &reply, &stale);
    if (st == TALLY_OK)
        *last = reply.rep.aux0;
    tally_reply_clear(&reply);
    return st;
}
