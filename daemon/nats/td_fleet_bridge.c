/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_bridge.c — the fleet's two ways into the daemon:
 *
 *   - the request path, through a ZeroMQ DEALER on the fleet thread connected to tallyd's own
 *     endpoint: a request frame goes in as [header][payload] with its request id replaced by a
 *     tag naming its pending slot, and its reply comes back like any client's. This is the
 *     "bytes and a completion" interface the transport layer of issue 25 will offer in-process;
 *     swapping it in changes this file only.
 *   - the loop thread, through a uv_async handle: td_fleet_on_loop posts a job and waits, for the
 *     work on the stream table that only the loop thread may do.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include "td_fleet_int.h"
#include "td_log.h"

/* With CURVE on, tallyd's own client key pair (td_auth.h), set before the connect: tallyd's
 * ZAP handler allows it as "tallyd-internal". 0, or -1 with errno. */
static int set_curve(td_fleet_t *f)
{
    const td_fleet_host_t *h = &f->host;
    if (!h->curve_server_public[0])
        return 0;
    if (zmq_setsockopt(f->dealer, ZMQ_CURVE_SERVERKEY, h->curve_server_public, TALLY_KEY_LEN) ||
        zmq_setsockopt(f->dealer, ZMQ_CURVE_PUBLICKEY, h->curve_public, TALLY_KEY_LEN) ||
        zmq_setsockopt(f->dealer, ZMQ_CURVE_SECRETKEY, h->curve_secret, TALLY_KEY_LEN))
        return -1;
    return 0;
}

td_err_t td_fleet_bridge_open(td_fleet_t *f)
{
    f->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (f->wake_fd < 0)
        return TD_ERR_LIBRARY;
    f->zctx = zmq_ctx_new();
    if (!f->zctx)
        return TD_ERR_LIBRARY;
    f->dealer = zmq_socket(f->zctx, ZMQ_DEALER);
    int linger = 0, hwm = 0;
    if (!f->dealer || zmq_setsockopt(f->dealer, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_setsockopt(f->dealer, ZMQ_RCVHWM, &hwm, sizeof hwm) != 0 || set_curve(f) != 0 ||
        zmq_connect(f->dealer, f->endpoint) != 0) {
        td_err("fleet: cannot connect to tallyd's own endpoint %s: %s", f->endpoint,
               zmq_strerror(errno));
        td_fleet_bridge_close(f);
        return TD_ERR_LIBRARY;
    }
    explicit_bzero(f->host.curve_secret, sizeof f->host.curve_secret); /* in the socket now */
    return TD_OK;
}

void td_fleet_bridge_close(td_fleet_t *f)
{
    if (f->dealer)
        zmq_close(f->dealer);
    f->dealer = NULL;
    if (f->zctx)
        zmq_ctx_term(f->zctx);
    f->zctx = NULL;
    for (int i = 0; i < TD_FLEET_PENDING_MAX; i++)
        free(f->pend[i].reply);
    if (f->wake_fd >= 0)
        close(f->wake_fd);
    f->wake_fd = -1;
}

int td_fleet_bridge_send(td_fleet_t *f, td_pend_kind_t kind, const uint8_t *data, size_t len)
{
    if (len < TALLY_REQ_HEADER_SIZE)
        return -1;
    int slot = -1;
    for (int i = 0; i < TD_FLEET_PENDING_MAX && slot < 0; i++)
        if (f->pend[i].kind == PEND_FREE)
            slot = i;
    if (slot < 0)
        return -1;
    td_pend_t *p = &f->pend[slot];
    memset(p, 0, sizeof *p);
    p->kind = kind;
    p->tag = (++f->next_tag << 8) | (uint64_t)slot;
    p->orig_id = tally_get_u64(data + 8);
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    memcpy(header, data, sizeof header);
    tally_put_u64(header + 8, p->tag);
    /* The payload frame is sent from the NATS message's memory: ZeroMQ copies it at send. */
    if (zmq_send(f->dealer, header, sizeof header, ZMQ_SNDMORE) < 0 ||
        zmq_send(f->dealer, data + sizeof header, len - sizeof header, 0) < 0) {
        td_warn("fleet: sending to the request path: %s", zmq_strerror(errno));
        p->kind = PEND_FREE;
        return -1;
    }
    return slot;
}

/* One reply from the socket (both frames) into a malloc'ed frame; NULL on a malformed one. */
static uint8_t *recv_reply(td_fleet_t *f, size_t *len, bool *got)
{
    zmq_msg_t h, pl;
    zmq_msg_init(&h);
    zmq_msg_init(&pl);
    *got = false;
    uint8_t *out = NULL;
    if (zmq_msg_recv(&h, f->dealer, ZMQ_DONTWAIT) < 0)
        goto done;
    *got = true;
    bool more = zmq_msg_more(&h);
    if (!more || zmq_msg_recv(&pl, f->dealer, 0) < 0 || zmq_msg_more(&pl) ||
        zmq_msg_size(&h) != TALLY_REP_HEADER_SIZE)
        goto done; /* tallyd's replies are always two frames; anything else is dropped */
    *len = TALLY_REP_HEADER_SIZE + zmq_msg_size(&pl);
    out = malloc(*len);
    if (out) {
        memcpy(out, zmq_msg_data(&h), TALLY_REP_HEADER_SIZE);
        memcpy(out + TALLY_REP_HEADER_SIZE, zmq_msg_data(&pl), zmq_msg_size(&pl));
    }
done:
    zmq_msg_close(&h);
    zmq_msg_close(&pl);
    return out;
}

static void dispatch(td_fleet_t *f, uint8_t *reply, size_t len)
{
    uint64_t tag = tally_get_u64(reply + 8);
    int slot = (int)(tag & 0xff);
    td_pend_t *p = slot < TD_FLEET_PENDING_MAX ? &f->pend[slot] : NULL;
    if (!p || p->kind == PEND_FREE || p->tag != tag) {
        free(reply); /* a reply to a request given up (its partition was dropped) */
        return;
    }
    tally_put_u64(reply + 8, p->orig_id);
    if (p->kind == PEND_SYNC) {
        p->done = true;
        p->reply = reply;
        p->reply_len = len;
        return;
    }
    td_fleet_on_reply(f, slot, reply, len);
    free(reply);
}

void td_fleet_bridge_poll(td_fleet_t *f, int timeout_ms)
{
    zmq_pollitem_t items[2] = {{.socket = f->dealer, .events = ZMQ_POLLIN},
                               {.fd = f->wake_fd, .events = ZMQ_POLLIN}};
    if (zmq_poll(items, 2, timeout_ms) <= 0)
        return;
    if (items[1].revents & ZMQ_POLLIN) { /* a reader queued messages: the next turn takes them */
        uint64_t count;
        ssize_t n = read(f->wake_fd, &count, sizeof count);
        (void)n;
    }
    for (;;) { /* ZMQ_FD semantics: drain until nothing is left */
        size_t len = 0;
        bool got = false;
        uint8_t *reply = recv_reply(f, &len, &got);
        if (!got)
            return;
        if (reply)
            dispatch(f, reply, len);
    }
}

uint8_t *td_fleet_bridge_call(td_fleet_t *f, const uint8_t *data, size_t len, int timeout_ms,
                              size_t *reply_len)
{
    int slot = td_fleet_bridge_send(f, PEND_SYNC, data, len);
    if (slot < 0)
        return NULL;
    td_pend_t *p = &f->pend[slot];
    int64_t deadline = td_nats_now_ms() + timeout_ms;
    while (!p->done && td_nats_now_ms() < deadline)
        td_fleet_bridge_poll(f, 10);
    uint8_t *reply = p->reply;
    *reply_len = p->reply_len;
    if (!p->done) /* given up: its late reply is dropped (the tag no longer matches) */
        td_warn("fleet: no answer from the request path within %d ms", timeout_ms);
    memset(p, 0, sizeof *p);
    return reply;
}

/* ---- Loop calls ---------------------------------------------------------------------------- */

void td_fleet_on_loop(td_fleet_t *f, void (*fn)(td_fleet_t *f, void *arg), void *arg)
{
    td_fleet_job_t job = {.fn = fn, .arg = arg};
    pthread_mutex_lock(&f->mu);
    f->job = &job;
    pthread_mutex_unlock(&f->mu);
    uv_async_send(&f->async);
    pthread_mutex_lock(&f->mu);
    while (!job.done)
        pthread_cond_wait(&f->cond, &f->mu);
    pthread_mutex_unlock(&f->mu);
}
