/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_client_nats.c — a tally_client_t that reaches a tallyd fleet over NATS JetStream
 * (tally_client_new_nats; PROTOCOL.md §13) instead of one tallyd over ZeroMQ, so every program
 * written against tally_send/tally_recv/tally_call (the `tally` CLI's commands, tally_run,
 * pushes) works against a fleet unchanged.
 *
 * It is a transport (tally_transport.h): the core (tally_call.c, tally_push.c) calls it only
 * through the table at the end of this file, which routes its one send and its one receive here:
 *   - filter, scan, hist, reset and delete are published to their partition with a reply
 *     subject (tally_nats_send, want_reply), each as one message: a payload larger than one
 *     message takes is refused before anything is sent (a request, one reply: the caller's
 *     chunking says how big; natsc_chunk_limit is the bound pushes use);
 *   - query, ping, info and stats are asked by request-reply (tally_nats_call) at once, and their
 *     reply waits here, in send order, for the next receive;
 *   - `streams` gathers every worker's answer (tally_nats_streams) into one reply payload as
 *     tallyd's own `streams` reply encodes it (a length byte, then the name, per stream).
 * Request ids are the producer's message numbers, so a reply's request_id names its request
 * either way. tally_client_new_nats makes the transport, then the client around it
 * (tally__client_new_transport).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <zmq.h>

#include "tally_client_nats.h"
#include "tally_transport.h"

/* A reply answered at send time, waiting for the receive. */
typedef struct stashed {
    struct stashed *next;
    tally_status_t status;
    tally_reply_t reply;
} stashed_t;

typedef struct tally__natsc {
    tally__transport_t base; /* first: the core's handle on it */
    tally_nats_t *nats;
    stashed_t *head, *tail;
} tally__natsc_t;

static tally_status_t natsc_new(const tally_nats_opts_t *opts, tally__natsc_t **out, char *msg,
                                size_t cap)
{
    *out = NULL;
    tally__natsc_t *self = calloc(1, sizeof *self);
    if (!self)
        return TALLY_E_NOMEM;
    tally_status_t st = tally_nats_new(opts, &self->nats, msg, cap);
    if (st != TALLY_OK) {
        free(self);
        return st;
    }
    *out = self;
    return TALLY_OK;
}

static void natsc_destroy(tally__transport_t **self_p)
{
    tally__natsc_t *self = (tally__natsc_t *)*self_p;
    if (!self)
        return;
    while (self->head) {
        stashed_t *s = self->head;
        self->head = s->next;
        tally_reply_clear(&s->reply);
        free(s);
    }
    tally_nats_flush(self->nats); /* what was published gets its PubAck (or times out) */
    tally_nats_destroy(&self->nats);
    free(self);
    *self_p = NULL;
}

static size_t natsc_chunk_limit(const tally__transport_t *base, const tally_req_t *req)
{
    const tally__natsc_t *self = (const tally__natsc_t *)base;
    return tally__nats_chunk_limit(self->nats, req, true);
}

static bool published(uint8_t op)
{
    return op == TALLY_OP_FILTER || op == TALLY_OP_SCAN || op == TALLY_OP_HIST ||
           op == TALLY_OP_RESET || op == TALLY_OP_DELETE;
}

/* A request answered now: its reply (or failure) waits for the next receive. */
static tally_status_t stash(tally__natsc_t *self, tally_status_t status, tally_reply_t *reply)
{
    stashed_t *s = calloc(1, sizeof *s);
    if (!s) {
        tally_reply_clear(reply);
        return TALLY_E_NOMEM;
    }
    s->status = status;
    s->reply = *reply; /* takes over the payload */
    if (self->tail)
        self->tail->next = s;
    else
        self->head = s;
    self->tail = s;
    return TALLY_OK;
}

/* `streams`: every worker's names, as one reply payload of tallyd's own layout (§5). */
static tally_status_t gather_streams(tally__natsc_t *self, uint64_t id, tally_reply_t *reply)
{
    char **names = NULL;
    size_t count = 0;
    tally_status_t st = tally_nats_streams(self->nats, &names, &count);
    reply->rep.request_id = id;
    reply->rep.opcode = TALLY_OP_STREAMS;
    reply->rep.status = (uint8_t)st;
    if (st != TALLY_OK) {
        snprintf(reply->error, sizeof reply->error, "%s", tally_nats_error(self->nats));
        return st;
    }
    size_t len = 0;
    for (size_t i = 0; i < count; i++)
        len += 1 + strlen(names[i]);
    uint8_t *out = malloc(len ? len : 1);
    if (!out) {
        tally_strings_free(names, count);
        return TALLY_E_NOMEM;
    }
    size_t at = 0;
    for (size_t i = 0; i < count; i++) {
        size_t n = strlen(names[i]);
        out[at++] = (uint8_t)n;
        memcpy(out + at, names[i], n);
        at += n;
    }
    tally_strings_free(names, count);
    reply->rep.aux0 = count;
    reply->rep.aux1 = tally_nats_streams_missing(self->nats); /* 0 from one tallyd: whole */
    return tally__reply_take(reply, out, len);
}

static tally_status_t natsc_send(tally__transport_t *base, const tally_req_t *req,
                                 const void *payload, size_t len, uint64_t *request_id, char *error,
                                 size_t cap)
{
    tally__natsc_t *self = (tally__natsc_t *)base;
    uint64_t id = tally__nats_next_id(self->nats);
    if (request_id)
        *request_id = id;
    if (published(req->opcode)) {
        size_t limit = natsc_chunk_limit(base, req);
        if (len > limit) {
            snprintf(error, cap,
                     "%zu bytes do not fit one NATS message: at most %zu for this request "
                     "(the server's max_payload is %zu); send smaller chunks",
                     len, limit, tally_nats_max_payload(self->nats));
            return TALLY_E_TOO_LARGE;
        }
        tally_status_t st = tally_nats_send(self->nats, req, payload, len, true, NULL, NULL);
        if (st != TALLY_OK)
            snprintf(error, cap, "%s", tally_nats_error(self->nats));
        return st;
    }
    tally_reply_t reply;
    tally_reply_init(&reply);
    tally_status_t st = req->opcode == TALLY_OP_STREAMS
                            ? gather_streams(self, id, &reply)
                            : tally_nats_call(self->nats, req, payload, len, &reply);
    if (st == TALLY_E_TIMEOUT || st == TALLY_E_TRANSPORT || st == TALLY_E_NOMEM ||
        st == TALLY_E_ARG) { /* nothing came back: the sender hears it now */
        snprintf(error, cap, "%s", reply.error[0] ? reply.error : tally_nats_error(self->nats));
        tally_reply_clear(&reply);
        return st;
    }
    reply.rep.request_id = id;
    return stash(self, st, &reply);
}

static tally_status_t natsc_last_seq(tally__transport_t *base, const char *stream, uint64_t *last,
                                     char *error, size_t cap)
{
    tally__natsc_t *self = (tally__natsc_t *)base;
    tally_status_t st = tally__nats_last_seq(self->nats, stream, last);
    if (st == TALLY_E_UNKNOWN_STREAM) { /* a stream's first push */
        *last = 0;
        return TALLY_OK;
    }
    if (st != TALLY_OK)
        snprintf(error, cap, "%s", tally_nats_error(self->nats));
    return st;
}

static tally_status_t natsc_recv(tally__transport_t *base, int timeout_ms, tally_reply_t *reply)
{
    tally__natsc_t *self = (tally__natsc_t *)base;
    tally_reply_clear(reply);
    stashed_t *s = self->head;
    if (!s)
        return tally_nats_recv(self->nats, timeout_ms > 0 ? timeout_ms : 1, reply);
    self->head = s->next;
    if (!self->head)
        self->tail = NULL;
    *reply = s->reply;
    tally_status_t st = s->status;
    free(s);
    return st;
}

static const tally__transport_ops_t natsc_ops = {
    .name = "NATS",
    .send = natsc_send,
    .recv = natsc_recv,
    .chunk_limit = natsc_chunk_limit,
    .last_seq = natsc_last_seq,
    .destroy = natsc_destroy,
};

tally_status_t tally_client_new_nats(const tally_nats_opts_t *opts, tally_client_t **out, char *msg,
                                     size_t msg_cap)
{
    if (!out || !opts)
        return TALLY_E_ARG;
    *out = NULL;
    tally__natsc_t *natsc = NULL;
    tally_status_t status = natsc_new(opts, &natsc, msg, msg_cap);
    if (status != TALLY_OK)
        return status;
    natsc->base.ops = &natsc_ops;
    tally__transport_t *transport = &natsc->base;
    int timeout_ms = opts->timeout_ms > 0 ? opts->timeout_ms : TALLY_DEFAULT_TIMEOUT_MS;
    status = tally__client_new_transport(transport, timeout_ms, out);
    if (status != TALLY_OK)
        natsc_destroy(&transport);
    return status;
}
