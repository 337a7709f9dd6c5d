/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_pub.c — see td_pub.h.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "td_auth.h"
#include "td_config.h"
#include "td_log.h"
#include "td_pub.h"
#include "td_window.h"

typedef struct deleted {
    struct deleted *next;
    size_t len;
    char name[TALLY_STREAM_NAME_MAX];
} deleted_t;

struct td_pub {
    void *socket;
    uv_timer_t timer;
    td_streams_t *streams;
    unsigned interval_ms;
    uint64_t seq;
    uint64_t messages;
    uint64_t failed;
    deleted_t *deleted;      /* the deletions to publish, oldest first */
    deleted_t **deleted_end; /* where the next one is linked: &deleted, or the last's next */
    bool closed;
    char endpoint[256];
};

/* One message, [topic][header][record]; record may be empty (a deletion). */
static void publish(td_pub_t *p, const char *name, size_t len, uint8_t kind, const uint8_t *record,
                    size_t record_len, uint64_t now_ms)
{
    tally_pub_t pub = {
        .kind = kind, .pub_seq = ++p->seq, .time_ms = now_ms, .interval_ms = p->interval_ms};
    uint8_t header[TALLY_PUB_HEADER_SIZE];
    tally_pub_encode(&pub, header);
    if (zmq_send(p->socket, name, len, ZMQ_DONTWAIT | ZMQ_SNDMORE) < 0 ||
        zmq_send(p->socket, header, sizeof header, ZMQ_DONTWAIT | ZMQ_SNDMORE) < 0 ||
        zmq_send(p->socket, record, record_len, ZMQ_DONTWAIT) < 0) {
        p->failed++;
        td_debug("publishing stream '%.*s' failed: %s", (int)len, name, zmq_strerror(errno));
        return;
    }
    p->messages++;
}

/* The oldest deletion not yet published (the caller frees it), or NULL. */
static deleted_t *pop_deleted(td_pub_t *p)
{
    deleted_t *d = p->deleted;
    if (d)
        p->deleted = d->next;
    if (!p->deleted)
        p->deleted_end = &p->deleted;
    return d;
}

void td_pub_tick(td_pub_t *p)
{
    static uint8_t record[TALLY_QUERY_PAYLOAD_MAX]; /* loop thread only */
    static tally_stream_info_t info;
    if (p->closed)
        return;
    uint64_t now = td_clock_ms();
    for (deleted_t *d; (d = pop_deleted(p));) {
        publish(p, d->name, d->len, TALLY_PUB_DELETED, NULL, 0, now);
        free(d);
    }
    td_streams_hold(p->streams); /* the shards stopped while their streams are read */
    for (td_stream_t *s = td_streams_first(p->streams); s; s = td_streams_next(p->streams, s)) {
        if (!s->pub_dirty)
            continue;
        s->pub_dirty = false;
        td_stream_info(s, &info);
        size_t len = tally_stream_info_encode(&info, record);
        publish(p, s->name, s->name_len, TALLY_PUB_UPDATE, record, len, now);
    }
    td_streams_release(p->streams);
}

static void timer_cb(uv_timer_t *timer)
{
    td_pub_tick(timer->data);
}

/* The PUB socket, bound at endpoint (a CURVE server first when auth is set: no connection is
 * ever made without it); false with why. */
static bool open_socket(td_pub_t *p, void *zmq_ctx, td_auth_t *auth, const char *endpoint,
                        char *why, size_t why_cap)
{
    p->socket = zmq_socket(zmq_ctx, ZMQ_PUB);
    int hwm = TD_PUB_SNDHWM, linger = 0;
    size_t cap = sizeof p->endpoint;
    if (p->socket) { /* int options, with an int's size: they cannot fail */
        zmq_setsockopt(p->socket, ZMQ_SNDHWM, &hwm, sizeof hwm);
        zmq_setsockopt(p->socket, ZMQ_LINGER, &linger, sizeof linger);
    }
    if (p->socket && auth && td_auth_secure(auth, p->socket) != TD_OK) {
        snprintf(why, why_cap, "cannot make the PUB socket a CURVE server");
        return false;
    }
    if (!p->socket || zmq_bind(p->socket, endpoint) != 0 ||
        zmq_getsockopt(p->socket, ZMQ_LAST_ENDPOINT, p->endpoint, &cap) != 0) {
        snprintf(why, why_cap, "cannot bind the PUB socket to %s: %s", endpoint,
                 zmq_strerror(errno));
        return false;
    }
    return true;
}

td_err_t td_pub_new(uv_loop_t *loop, void *zmq_ctx, td_auth_t *auth, const char *endpoint,
                    unsigned interval_ms, td_streams_t *streams, td_pub_t **out, char *why,
                    size_t why_cap)
{
    td_pub_t *p = calloc(1, sizeof *p);
    if (!p) {
        snprintf(why, why_cap, "out of memory");
        return TD_ERR_NOMEM;
    }
    p->streams = streams;
    p->interval_ms = interval_ms;
    p->deleted_end = &p->deleted;
    td_err_t err = TD_OK;
    if (!open_socket(p, zmq_ctx, auth, endpoint, why, why_cap)) {
        err = TD_ERR_BIND;
        goto fail;
    }
    /* The timer last: a failure above leaves no libuv handle to close. libuv's uv_timer_init
     * only fills in the handle, and uv_timer_start fails only without a callback: no error. */
    uv_timer_init(loop, &p->timer);
    p->timer.data = p;
    uv_timer_start(&p->timer, timer_cb, interval_ms, interval_ms);
    td_info("publishing changed streams on %s every %u ms%s", p->endpoint, interval_ms,
            auth ? " (CURVE: the request endpoint's key and allowed clients)" : "");
    *out = p;
    return TD_OK;

fail:
    if (p->socket)
        zmq_close(p->socket);
    free(p);
    return err;
}

void td_pub_close(td_pub_t *p)
{
    if (!p || p->closed)
        return;
    p->closed = true;
    uv_timer_stop(&p->timer);
    uv_close((uv_handle_t *)&p->timer, NULL);
    zmq_close(p->socket);
    p->socket = NULL;
}

void td_pub_destroy(td_pub_t **self_p)
{
    td_pub_t *p = *self_p;
    if (!p)
        return;
    for (deleted_t *d; (d = pop_deleted(p));)
        free(d);
    free(p);
    *self_p = NULL;
}

const char *td_pub_endpoint(const td_pub_t *p)
{
    return p->endpoint;
}

void td_pub_deleted(td_pub_t *p, const char *name, size_t len)
{
    deleted_t *d = calloc(1, sizeof *d);
    if (!d || len > TALLY_STREAM_NAME_MAX) {
        free(d);
        p->failed++;
        return;
    }
    memcpy(d->name, name, len);
    d->len = len;
    *p->deleted_end = d;
    p->deleted_end = &d->next;
}

uint64_t td_pub_messages(const td_pub_t *p)
{
    return p ? p->messages : 0;
}

uint64_t td_pub_failed(const td_pub_t *p)
{
    return p ? p->failed : 0;
}
