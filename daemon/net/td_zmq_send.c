/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_zmq_send.c — the ZeroMQ transport's replies (see td_zmq.h): sent at once without waiting,
 * or kept for a connection that has closed, or dropped.
 *
 * A reply's payload goes to ZeroMQ without a copy: zmq_msg_init_data with the free function the
 * request path gave with the bytes (td_transport.h), which uncounts them once ZeroMQ is done
 * (td_reply.h); its header, kept beside it until then (td_reply_t.header_kept), goes without a
 * copy or an allocation too. Replies kept for a connection that has closed sit in a `lost` record
 * per routing id, in order; a reply for that connection that comes later joins them (a stream's
 * replies stay in order). The retry timer sends them while the connection takes them, and drops
 * them all once TD_REPLY_RECONNECT_GRACE_MS have passed since the connection was found closed.
 * Their payloads stay counted meanwhile: they are freed only when sent and written out, or dropped.
 * Each reply ends its request's account with its connection (td_zmq_conn.c), which a reply that
 * finds the connection gone counts and logs as lost.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "td_log.h"
#include "td_zmq_int.h"

/* The reply's payload as a message ZeroMQ frees once written out (an empty one when it has
 * none); true when that message holds the payload's own bytes. When ZeroMQ has no memory for
 * it, a successful reply becomes an `internal` error (the request's effect stands: PROTOCOL.md
 * §7) and an error reply loses only its text; the reply is never lost (alloc sweep, issue 25).
 * The header (reply->header, encoded by the request path on the shard: td_replies_hand) is
 * encoded again here only then. */
static bool body_message(td_reply_t *reply, zmq_msg_t *body)
{
    td_bytes_t *b = &reply->body;
    if (!b->data || !b->len) {
        zmq_msg_init(body);
        return false;
    }
    if (zmq_msg_init_data(body, b->data, b->len, b->free_fn, b->hint) == 0) {
        td_bytes_taken(b);
        return true;
    }
    /* ZeroMQ took nothing: td_reply_end frees the payload */
    td_err("out of memory for the reply to request %" PRIu64 ": answering `internal`",
           reply->rep.request_id);
    if (reply->rep.status == TALLY_OK) {
        static const char text[] = "out of memory for the reply; the request succeeded";
        reply->rep.status = TALLY_E_INTERNAL;
        reply->rep.dtype = TALLY_DTYPE_TEXT;
        reply->rep.count = 0;
        reply->rep.aux0 = 0;
        tally_rep_encode(&reply->rep, reply->header);
        if (zmq_msg_init_size(body, sizeof text - 1) == 0) {
            memcpy(zmq_msg_data(body), text, sizeof text - 1);
            return false;
        }
    }
    zmq_msg_init(body);
    return false;
}

/* A later frame of a reply (after the routing id), retried when a signal interrupts it: a
 * message left without its later frames would take the next reply's frames as its own. 0, or
 * the errno of the failure; the frame is released either way. */
static int send_later(void *router, zmq_msg_t *frame, int flags)
{
    int rc;
    while ((rc = zmq_msg_send(frame, router, flags)) == -1 && errno == EINTR)
        continue;
    if (rc != -1)
        return 0;
    int err = errno;
    zmq_msg_close(frame); /* not sent: still ours */
    return err;
}

/* The same for a frame of bytes ZeroMQ copies. */
static int send_later_copy(void *router, const void *data, size_t len, int flags)
{
    int rc;
    while ((rc = zmq_send(router, data, len, flags)) == -1 && errno == EINTR)
        continue;
    return rc == -1 ? errno : 0;
}

/* The header frame. Beside a payload handed over whole, the copy of the header kept with it
 * (reply->header_kept) goes without a copy and without an allocation: a message of constant
 * data (zmq_msg_init_data with no free function allocates nothing), read by ZeroMQ's I/O thread
 * as it writes the frame out, which is before it takes the payload's frame and so before it
 * frees the payload and, with it, the kept header (a message left incomplete is rolled back
 * unread). Otherwise ZeroMQ copies the header (an allocation above 33 bytes). */
static int send_header(void *router, td_reply_t *reply, bool body_whole, int flags)
{
    zmq_msg_t header;
    void *kept = (void *)reply->header_kept; /* read only: ZeroMQ's type is not const */
    if (body_whole && kept &&
        zmq_msg_init_data(&header, kept, TALLY_REP_HEADER_SIZE, NULL, NULL) == 0)
        return send_later(router, &header, flags);
    return send_later_copy(router, reply->header, sizeof reply->header, flags);
}

/* Sends the reply now: 0, or the errno of the failed send (EHOSTUNREACH: the peer has gone;
 * EAGAIN: its send queue is full). */
int td_zmq_send_now(td_zmq_t *z, td_reply_t *reply)
{
    /* Only the first frame can meet EHOSTUNREACH or EAGAIN: once it is accepted ZeroMQ takes
     * the rest of the message whole, so a later frame failing is a broken socket (logged). The
     * payload's message is made after it (a kept reply keeps its payload) and before the header
     * (found out of memory, the reply changes: alloc sweep, issue 25). */
    void *router = z->rt.socket;
    const int more = ZMQ_DONTWAIT | ZMQ_SNDMORE;
    z->settled = false; /* a send may take the descriptor's signal: the pump looks again */
    if (zmq_send(router, reply->to.id, reply->to.id_len, more) == -1)
        return errno;
    int err = 0;
    if (reply->to.word & TD_ZMQ_DELIMITER)
        err = send_later_copy(router, "", 0, more);
    if (!err) {
        zmq_msg_t body;
        bool whole = body_message(reply, &body);
        err = send_header(router, reply, whole, more);
        if (err)
            zmq_msg_close(&body);
        else
            err = send_later(router, &body, ZMQ_DONTWAIT);
    }
    if (err)
        td_err("sending the reply to request %" PRIu64 ": %s", reply->rep.request_id,
               zmq_strerror(err));
    return err;
}

/* What a send's errno means for the reply. */
static td_reply_outcome_t outcome_of(int err)
{
    if (err == 0)
        return TD_REPLY_SENT;
    if (err == EAGAIN)
        return TD_REPLY_SLOW;
    return err == EHOSTUNREACH ? TD_REPLY_GONE : TD_REPLY_BROKEN;
}

static td_zmq_lost_t *lost_find(const td_zmq_t *z, const td_reply_t *reply)
{
    td_zmq_lost_t *l = z->lost;
    while (l && (l->id_len != reply->to.id_len || memcmp(l->id, reply->to.id, l->id_len) != 0))
        l = l->next;
    return l;
}

static void keep(td_zmq_lost_t *l, td_reply_t *reply)
{
    reply->next = NULL;
    if (l->tail)
        l->tail->next = reply;
    else
        l->head = reply;
    l->tail = reply;
}

/* The reply's connection has just been found closed: its replies are kept from now on. NULL when
 * out of memory (then the reply is dropped). */
static td_zmq_lost_t *lost_new(td_zmq_t *z, const td_reply_t *reply)
{
    td_zmq_lost_t *l = calloc(1, sizeof *l + reply->to.id_len);
    if (!l)
        return NULL;
    l->id_len = reply->to.id_len;
    memcpy(l->id, reply->to.id, l->id_len);
    l->since_ns = uv_hrtime();
    l->next = z->lost;
    z->lost = l;
    return l;
}

/* Ends every reply still kept for l (dropped as by a send that failed with EHOSTUNREACH), then
 * l. */
static void lost_free(td_zmq_t *z, td_zmq_lost_t *l)
{
    td_zmq_lost_t **link = &z->lost;
    while (*link != l)
        link = &(*link)->next;
    *link = l->next;
    td_reply_t *reply;
    while ((reply = l->head)) {
        l->head = reply->next;
        td_reply_end(reply, outcome_of(EHOSTUNREACH));
    }
    free(l);
}

/* Sends l's kept replies in order while its connection takes them. */
static void lost_retry(td_zmq_t *z, td_zmq_lost_t *l)
{
    td_reply_t *reply;
    while ((reply = l->head)) {
        int err = td_zmq_send_now(z, reply);
        if (err == EHOSTUNREACH) /* not back yet */
            return;
        l->head = reply->next;
        if (!l->head)
            l->tail = NULL;
        if (!err)
            z->resent_total++;
        td_reply_end(reply, outcome_of(err));
    }
}

static void retry_cb(uv_timer_t *handle)
{
    td_zmq_t *z = handle->data;
    uint64_t grace_ns = (uint64_t)TD_REPLY_RECONNECT_GRACE_MS * 1000000u;
    uint64_t now_ns = uv_hrtime();
    td_zmq_lost_t *next;
    for (td_zmq_lost_t *l = z->lost; l; l = next) {
        next = l->next;
        lost_retry(z, l);
        if (!l->head || now_ns - l->since_ns >= grace_ns)
            lost_free(z, l);
    }
    if (!z->lost)
        uv_timer_stop(handle);
    /* Timers run before the loop's poll, the check after it: a send here is looked after now,
     * not after the poll has slept on a descriptor the send may have taken the signal of. */
    if (!z->settled)
        td_zmq_pump(z); /* last: it may close the transport */
}

void td_zmq_send_reply(td_transport_t *transport, td_reply_t *reply)
{
    td_zmq_t *z = (td_zmq_t *)transport;
    td_zmq_conn_t *conn = reply->to.ctx;
    reply->to.ctx = NULL; /* the record may end with this reply (td_zmq_conn_answered) */
    td_zmq_lost_t *l = lost_find(z, reply);
    if (!l) {
        int err = td_zmq_send_now(z, reply);
        if (err == EHOSTUNREACH)
            td_zmq_conn_gone(z, conn, reply->peer_name);
        td_zmq_conn_answered(conn);
        if (err != EHOSTUNREACH || !(l = lost_new(z, reply))) {
            td_reply_end(reply, outcome_of(err));
            return;
        }
    } else {
        td_zmq_conn_answered(conn);
    }
    keep(l, reply); /* behind the replies kept before it: a stream's order holds */
    /* uv_timer_start fails only without a callback. */
    if (!uv_is_active((uv_handle_t *)&z->retry_timer))
        uv_timer_start(&z->retry_timer, retry_cb, TD_REPLY_RETRY_MS, TD_REPLY_RETRY_MS);
}

void td_zmq_drop_kept(td_zmq_t *z)
{
    while (z->lost)
        lost_free(z, z->lost);
}
