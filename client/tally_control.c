/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_control.c — the convenience wrappers around tally_call (tally.h): ping, info and stats,
 * the info as keys and values (parsed by tally_info.c), a stream's record (all time or a window),
 * reset, delete and the stream list. Each is one request and one reply: a stream's name is
 * checked before anything is sent, and a reply that does not decode is TALLY_E_REPLY, the
 * client's error saying which.
 */
#include "tally.h"
#include "tally_client_int.h"

#include <stdlib.h>
#include <string.h>

static void simple_req(tally_req_t *req, tally_op_t op)
{
    memset(req, 0, sizeof *req);
    req->version = TALLY_PROTO_VERSION;
    req->opcode = (uint8_t)op;
    req->dtype = TALLY_DTYPE_NONE;
}

/* A request without a payload; reply is initialised here, cleared by the caller. */
static tally_status_t call_empty(tally_client_t *self, const tally_req_t *req, tally_reply_t *reply)
{
    tally_reply_init(reply);
    return tally_call(self, req, NULL, 0, reply);
}

/* The same for a request that is only an opcode (ping, info, stats, streams). */
static tally_status_t call_op(tally_client_t *self, tally_op_t op, tally_reply_t *reply)
{
    tally_req_t req;
    simple_req(&req, op);
    return call_empty(self, &req, reply);
}

tally_status_t tally_ping(tally_client_t *self, double *rtt_us)
{
    tally_reply_t reply;
    int64_t start = now_us();
    tally_status_t status = call_op(self, TALLY_OP_PING, &reply);
    if (rtt_us)
        *rtt_us = (double)(now_us() - start);
    tally_reply_clear(&reply);
    return status;
}

tally_status_t tally_info(tally_client_t *self, tally_op_t op, char **text)
{
    if (!text || (op != TALLY_OP_INFO && op != TALLY_OP_STATS))
        return TALLY_E_ARG;
    *text = NULL;
    tally_reply_t reply;
    tally_status_t status = call_op(self, op, &reply);
    if (status != TALLY_OK)
        goto out;
    *text = malloc(reply.len + 1);
    if (!*text) {
        status = TALLY_E_NOMEM;
        goto out;
    }
    if (reply.len)
        memcpy(*text, reply.payload, reply.len);
    (*text)[reply.len] = '\0';
out:
    tally_reply_clear(&reply);
    return status;
}

tally_status_t tally_info_fetch(tally_client_t *self, tally_info_t **out)
{
    if (!out)
        return TALLY_E_ARG;
    *out = NULL;
    tally_reply_t reply;
    tally_status_t status = call_op(self, TALLY_OP_INFO, &reply);
    if (status == TALLY_OK) {
        status = tally_info_parse((const char *)reply.payload, reply.len, out);
        if (status == TALLY_E_REPLY)
            fail(self, status, "the daemon's info is not key=value lines (PROTOCOL.md §5 info)");
    }
    tally_reply_clear(&reply);
    return status;
}

/* A query/reset request naming `stream`; the name is checked before anything is sent. */
static tally_status_t stream_req(tally_client_t *self, tally_req_t *req, tally_op_t op,
                                 const char *stream)
{
    simple_req(req, op);
    if (!stream)
        return TALLY_E_ARG;
    tally_status_t status = tally_req_set_stream(req, stream);
    if (status != TALLY_OK) {
        snprintf(self->error, sizeof self->error, "invalid stream name '%.80s'", stream);
    }
    return status;
}

/* query, all time (window_ms 0) or the last window_ms (QUERY_WINDOW); the window's start and
 * end (aux0, aux1) to *start_ms and *end_ms when given. */
static tally_status_t query_call(tally_client_t *self, const char *stream, uint64_t window_ms,
                                 tally_stream_info_t *info, uint64_t *start_ms, uint64_t *end_ms)
{
    if (!self || !info || window_ms > (uint64_t)TALLY_WINDOW_MS_MAX)
        return TALLY_E_ARG;
    tally_req_t req;
    tally_status_t status = stream_req(self, &req, TALLY_OP_QUERY, stream);
    if (status != TALLY_OK)
        return status;
    if (window_ms) {
        req.flags = TALLY_FLAG_QUERY_WINDOW;
        req.lo = (int64_t)window_ms;
    }
    tally_reply_t reply;
    status = call_empty(self, &req, &reply);
    if (status == TALLY_OK &&
        tally_stream_info_decode(reply.payload, reply.len, info) != TALLY_OK) {
        status = fail(self, TALLY_E_REPLY, "query reply does not decode");
    }
    if (status == TALLY_OK && start_ms)
        *start_ms = reply.rep.aux0;
    if (status == TALLY_OK && end_ms)
        *end_ms = reply.rep.aux1;
    tally_reply_clear(&reply);
    return status;
}

tally_status_t tally_reply_stream_info(const tally_reply_t *reply, tally_stream_info_t *info)
{
    if (!reply || !info)
        return TALLY_E_ARG;
    if (reply->rep.status != TALLY_OK || reply->rep.opcode != TALLY_OP_QUERY ||
        tally_stream_info_decode(reply->payload, reply->len, info) != TALLY_OK)
        return TALLY_E_REPLY;
    return TALLY_OK;
}

tally_status_t tally_query(tally_client_t *self, const char *stream, tally_stream_info_t *info)
{
    return query_call(self, stream, 0, info, NULL, NULL);
}

tally_status_t tally_query_window(tally_client_t *self, const char *stream, uint64_t window_ms,
                                  tally_stream_info_t *info, uint64_t *start_ms, uint64_t *end_ms)
{
    if (window_ms == 0)
        return TALLY_E_ARG;
    return query_call(self, stream, window_ms, info, start_ms, end_ms);
}

/* reset and delete: a stream name, an empty reply. */
static tally_status_t stream_control(tally_client_t *self, tally_op_t op, const char *stream)
{
    if (!self)
        return TALLY_E_ARG;
    tally_req_t req;
    tally_status_t status = stream_req(self, &req, op, stream);
    if (status != TALLY_OK)
        return status;
    tally_reply_t reply;
    status = call_empty(self, &req, &reply);
    tally_reply_clear(&reply);
    return status;
}

tally_status_t tally_reset(tally_client_t *self, const char *stream)
{
    return stream_control(self, TALLY_OP_RESET, stream);
}

tally_status_t tally_delete(tally_client_t *self, const char *stream)
{
    return stream_control(self, TALLY_OP_DELETE, stream);
}

void tally_strings_free(char **names, size_t count)
{
    if (!names)
        return;
    for (size_t i = 0; i < count; i++)
        free(names[i]);
    free(names);
}

/* Splits a streams payload, a sequence of [u8 len][name], into strings. */
static tally_status_t parse_streams(const uint8_t *p, size_t len, char ***names, size_t *count)
{
    size_t n = 0;
    for (size_t at = 0; at < len; at += 1 + p[at], n++) {
        if (p[at] == 0 || at + 1 + p[at] > len)
            return TALLY_E_REPLY;
    }
    char **list = calloc(n ? n : 1, sizeof *list);
    if (!list)
        return TALLY_E_NOMEM;
    size_t i = 0;
    for (size_t at = 0; at < len; at += 1 + p[at], i++) {
        list[i] = strndup((const char *)p + at + 1, p[at]);
        if (!list[i]) {
            tally_strings_free(list, i);
            return TALLY_E_NOMEM;
        }
    }
    *names = list;
    *count = n;
    return TALLY_OK;
}

tally_status_t tally_streams(tally_client_t *self, char ***names, size_t *count)
{
    uint32_t missing = 0;
    return tally_streams_missing(self, names, count, &missing);
}

tally_status_t tally_streams_missing(tally_client_t *self, char ***names, size_t *count,
                                     uint32_t *missing)
{
    if (!self || !names || !count || !missing)
        return TALLY_E_ARG;
    *names = NULL;
    *count = 0;
    *missing = 0;
    tally_reply_t reply;
    tally_status_t status = call_op(self, TALLY_OP_STREAMS, &reply);
    if (status == TALLY_OK) {
        *missing = reply.rep.aux1 <= UINT32_MAX ? (uint32_t)reply.rep.aux1 : UINT32_MAX;
        status = parse_streams(reply.payload, reply.len, names, count);
        if (status == TALLY_E_REPLY)
            fail(self, status, "malformed streams reply");
    }
    tally_reply_clear(&reply);
    return status;
}
