/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_nats_watch.c — a subscription to a fleet's histogram publications on tally.watch.<k>
 * (tally_nats_sub_*, what `tally watch --nats` redraws from; PROTOCOL.md §13 "Histogram
 * publications"), on a tally_nats_t's connection: a floor above tally_nats.c.
 *
 * libnats delivers a subscription's messages on a thread of its own: the callback only queues
 * the message under the mutex (bounded in bytes: past TALLY_NATS_SUB_BYTES the oldest go, and
 * are counted) and writes a byte to a pipe, whose read end is the descriptor a caller polls; the
 * caller's thread decodes them in tally_nats_sub_recv, one byte taken per message.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <nats/nats.h>

#include "tally.h"
#include "tally_client_nats.h"
#include "tally_fleet.h"

#define TALLY_NATS_SUB_BYTES (64u << 20)

/* ---- The subscription -------------------------------------------------------------------- */

typedef struct queued {
    struct queued *next;
    natsMsg *msg;
} queued_t;

struct tally_nats_sub {
    tally_nats_t *nats;
    natsSubscription *subs[TALLY_NATS_MAX_PARTITIONS]; /* by partition: NULL until named */
    int pipe[2];
    pthread_mutex_t mu;
    queued_t *head, **tail; /* mu */
    size_t bytes;           /* mu */
    uint64_t dropped;       /* mu */
};

/* libnats' thread: queues m, the oldest dropped past the bound. */
static void on_msg(natsConnection *nc, natsSubscription *sub, natsMsg *m, void *closure)
{
    (void)nc, (void)sub;
    tally_nats_sub_t *self = closure;
    queued_t *q = malloc(sizeof *q);
    if (!q) {
        natsMsg_Destroy(m);
        return;
    }
    *q = (queued_t){.msg = m};
    pthread_mutex_lock(&self->mu);
    *self->tail = q;
    self->tail = &q->next;
    self->bytes += (size_t)natsMsg_GetDataLength(m);
    queued_t *old = NULL;
    if (self->bytes > TALLY_NATS_SUB_BYTES && self->head != q) {
        old = self->head;
        self->head = old->next;
        self->bytes -= (size_t)natsMsg_GetDataLength(old->msg);
        self->dropped++;
    }
    /* Under mu, so that tally_nats_sub_destroy's lock orders its close after the last write. */
    ssize_t w = write(self->pipe[1], "", 1); /* full: the reader has bytes enough to wake */
    (void)w;
    pthread_mutex_unlock(&self->mu);
    if (old) { /* its byte stays in the pipe: a recv finds the queue shorter, and says so */
        natsMsg_Destroy(old->msg);
        free(old);
    }
}

tally_status_t tally_nats_sub_new(tally_nats_t *nats, tally_nats_sub_t **out)
{
    if (!nats || !out)
        return TALLY_E_ARG;
    *out = NULL;
    tally_nats_sub_t *self = calloc(1, sizeof *self);
    if (!self)
        return TALLY_E_NOMEM;
    self->nats = nats;
    self->tail = &self->head;
    pthread_mutex_init(&self->mu, NULL);
    if (pipe2(self->pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
        pthread_mutex_destroy(&self->mu);
        free(self);
        return TALLY_E_NOMEM;
    }
    *out = self;
    return TALLY_OK;
}

tally_status_t tally_nats_sub_stream(tally_nats_sub_t *self, const char *stream)
{
    if (!self || !stream || !tally_stream_name_valid(stream, strlen(stream)))
        return TALLY_E_ARG;
    uint32_t k = tally_partition(stream, strlen(stream), tally_nats_partitions(self->nats));
    if (self->subs[k])
        return TALLY_OK;
    char subject[32];
    tally_fleet_name(subject, sizeof subject, TALLY_NATS_SUBJ_WATCH, k);
    natsStatus s = natsConnection_Subscribe(&self->subs[k], tally__nats_conn(self->nats),
                                            subject, on_msg, self);
    return s == NATS_OK ? TALLY_OK : TALLY_E_TRANSPORT;
}

/* The next message queued, or NULL; takes its byte from the pipe. */
static natsMsg *take(tally_nats_sub_t *self)
{
    pthread_mutex_lock(&self->mu);
    queued_t *q = self->head;
    if (q) {
        self->head = q->next;
        if (!self->head)
            self->tail = &self->head;
        self->bytes -= (size_t)natsMsg_GetDataLength(q->msg);
    }
    pthread_mutex_unlock(&self->mu);
    char byte;
    ssize_t r = read(self->pipe[0], &byte, 1); /* a dropped message's byte, when none is left */
    (void)r;
    natsMsg *m = q ? q->msg : NULL;
    free(q);
    return m;
}

static tally_status_t decode(natsMsg *m, tally_pub_msg_t *msg)
{
    const uint8_t *data = (const uint8_t *)natsMsg_GetData(m);
    size_t len = (size_t)natsMsg_GetDataLength(m);
    const char *name = NULL;
    memset(msg, 0, sizeof *msg);
    if (natsMsgHeader_Get(m, TALLY_NATS_HDR_STREAM, &name) != NATS_OK || !name ||
        !tally_stream_name_valid(name, strlen(name)) || len < TALLY_PUB_HEADER_SIZE ||
        tally_pub_decode(data, TALLY_PUB_HEADER_SIZE, &msg->pub) != TALLY_OK ||
        msg->pub.kind != TALLY_PUB_UPDATE)
        return TALLY_E_REPLY;
    memcpy(msg->stream, name, strlen(name) + 1);
    return tally_stream_info_decode(data + TALLY_PUB_HEADER_SIZE, len - TALLY_PUB_HEADER_SIZE,
                                    &msg->info) == TALLY_OK
               ? TALLY_OK
               : TALLY_E_REPLY;
}

tally_status_t tally_nats_sub_recv(tally_nats_sub_t *self, int timeout_ms, tally_pub_msg_t *msg)
{
    if (!self || !msg)
        return TALLY_E_ARG;
    natsMsg *m = take(self);
    if (!m && timeout_ms > 0) {
        struct pollfd p = {.fd = self->pipe[0], .events = POLLIN};
        if (poll(&p, 1, timeout_ms) < 0 && errno != EINTR)
            return TALLY_E_TRANSPORT;
        m = take(self);
    }
    if (!m)
        return TALLY_E_TIMEOUT;
    tally_status_t st = decode(m, msg);
    natsMsg_Destroy(m);
    return st;
}

int tally_nats_sub_fd(const tally_nats_sub_t *self)
{
    return self ? self->pipe[0] : -1;
}

uint64_t tally_nats_sub_dropped(const tally_nats_sub_t *self)
{
    if (!self)
        return 0;
    pthread_mutex_t *mu = (pthread_mutex_t *)&self->mu;
    pthread_mutex_lock(mu);
    uint64_t n = self->dropped;
    pthread_mutex_unlock(mu);
    return n;
}

void tally_nats_sub_destroy(tally_nats_sub_t **self_p)
{
    tally_nats_sub_t *self = self_p ? *self_p : NULL;
    if (!self)
        return;
    for (uint32_t k = 0; k < TALLY_NATS_MAX_PARTITIONS; k++)
        if (self->subs[k]) { /* drained: no callback runs once it completes */
            if (natsSubscription_Drain(self->subs[k]) == NATS_OK)
                natsSubscription_WaitForDrainCompletion(self->subs[k], 5000);
            else
                natsSubscription_Unsubscribe(self->subs[k]);
            natsSubscription_Destroy(self->subs[k]);
        }
    pthread_mutex_lock(&self->mu); /* after the callbacks' last unlock (TSan sees that order) */
    queued_t *left = self->head;
    self->head = NULL;
    pthread_mutex_unlock(&self->mu);
    for (queued_t *q = left, *next; q; q = next) {
        next = q->next;
        natsMsg_Destroy(q->msg);
        free(q);
    }
    close(self->pipe[0]);
    close(self->pipe[1]);
    pthread_mutex_destroy(&self->mu);
    free(self);
    *self_p = NULL;
}
