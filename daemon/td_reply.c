/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_reply.c — sending replies and counting what unread replies hold (see td_reply.h).
 *
 * A reply's payload goes to ZeroMQ without a copy (zmq_msg_init_data): a malloc'd buffer, or a
 * pinned buffer the GPU wrote it into, which ZeroMQ frees or gives back once written out. To know
 * when, the payload is sent with a free function of ours, reply_freed, and a small record (a
 * ticket) that says how many bytes to uncount from which meter and how to free the buffer after.
 * ZeroMQ calls it exactly once, on its I/O thread (or on ours, when a send fails and the message
 * is closed), so the counters it touches are atomics: the connection's meter (td_peers.h) and
 * the total here, which lives until after zmq_ctx_term (td_server_destroy).
 *
 * Reservations are loop-thread counters (the connection's in its td_peer_t, the total here):
 * taken when a request is admitted, given back when its reply is sent or dropped. Held bytes are
 * counted before the message is built, so they never go below zero whatever thread frees it.
 *
 * Replies kept for a connection that has closed sit in a `lost` record per connection, in order,
 * their requests' input already freed; a reply for that connection that comes later joins them
 * (a stream's replies stay in order). td_replies_retry, on the server's timer, sends them while
 * the connection takes them, and drops them all once TD_REPLY_RECONNECT_GRACE_MS have passed
 * since the connection was found closed. They count as held meanwhile.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <uv.h>
#include <zmq.h>

#include "td_log.h"
#include "td_peers.h"
#include "td_reply.h"

/* The replies kept for a connection that has closed, in order, since when. */
typedef struct lost {
    td_peer_t *conn; /* referenced by the kept requests */
    td_request_queue_t kept;
    uint64_t since_ns;
    struct lost *next;
} lost_t;

struct td_replies {
    const td_config_t *cfg;
    td_metrics_t *metrics; /* replies dropped */
    td_reply_done_fn done;
    void *owner;
    _Atomic uint64_t held; /* reply bytes inside ZeroMQ or kept, all connections */
    uint64_t reserved;     /* loop thread, like the rest: reserved for requests in flight */
    uint64_t peak_peer;    /* the most one connection has used */
    uint64_t peak_total;
    lost_t *lost;          /* connections that closed with replies kept */
    uint64_t lost_total;   /* connections found closed with requests unanswered */
    uint64_t resent_total; /* kept replies sent once their connection came back */
};

/* What reply_freed needs: the bytes, the meters, and the buffer's own free function. */
typedef struct {
    uint64_t bytes;
    td_reply_meter_t *meter; /* a reference; NULL: no per-peer entry */
    _Atomic uint64_t *total;
    zmq_free_fn *free_fn; /* the buffer's own: free, or the GPU pipeline's give-back */
    void *hint;
} ticket_t;

td_err_t td_replies_new(const td_config_t *cfg, td_metrics_t *metrics, td_reply_done_fn done,
                        void *owner, td_replies_t **out)
{
    td_replies_t *self = calloc(1, sizeof *self);
    if (!self)
        return TD_ERR_NOMEM;
    self->cfg = cfg;
    self->metrics = metrics;
    self->done = done;
    self->owner = owner;
    atomic_init(&self->held, 0);
    *out = self;
    return TD_OK;
}

void td_replies_destroy(td_replies_t **self_p)
{
    td_replies_t *self = *self_p;
    if (!self)
        return;
    td_replies_close(self); /* normally done at close already */
    uint64_t held = atomic_load(&self->held);
    if (held) /* zmq_ctx_term frees every message: a leak of ours if not */
        td_warn("%" PRIu64 " reply bytes still counted at exit", held);
    free(self);
    *self_p = NULL;
}

uint64_t td_reply_need(const td_request_t *r)
{
    if (r->out_ptr) /* the output goes to a shared-memory region: the reply is a header */
        return 0;
    return tally_shm_out_worst(&r->req, r->payload_len); /* filter, scan; others 0 */
}

static uint64_t meter_held(const td_peer_t *conn)
{
    const td_reply_meter_t *m = conn ? td_peer_meter((td_peer_t *)conn) : NULL;
    return m ? atomic_load_explicit(&m->held, memory_order_relaxed) : 0;
}

static uint64_t peer_used(const td_peer_t *conn)
{
    return conn ? meter_held(conn) + td_peer_reserved(conn) : 0;
}

static uint64_t total_used(const td_replies_t *self)
{
    return atomic_load_explicit(&self->held, memory_order_relaxed) + self->reserved;
}

static void note_peaks(td_replies_t *self, const td_peer_t *conn)
{
    uint64_t peer = peer_used(conn), total = total_used(self);
    if (peer > self->peak_peer)
        self->peak_peer = peer;
    if (total > self->peak_total)
        self->peak_total = total;
}

td_reply_admit_t td_replies_admit(td_replies_t *self, td_request_t *r)
{
    if (r->req.opcode == TALLY_OP_PING) /* its reply is a header: always answered */
        return TD_REPLY_ADMITTED;
    uint64_t need = td_reply_need(r);
    uint64_t peer = peer_used(r->conn);
    if (r->conn && peer > 0 && peer + need > td_config_reply_bytes_per_peer(self->cfg))
        return TD_REPLY_OVER_PEER;
    uint64_t total = total_used(self);
    if (need > 0 && total > 0 && total + need > td_config_reply_bytes(self->cfg))
        return TD_REPLY_OVER_TOTAL;
    r->reply_reserved = need;
    self->reserved += need;
    if (r->conn)
        td_peer_reserve(r->conn, need);
    note_peaks(self, r->conn);
    return TD_REPLY_ADMITTED;
}

static void unreserve(td_replies_t *self, td_request_t *r)
{
    self->reserved -= r->reply_reserved;
    if (r->conn)
        td_peer_unreserve(r->conn, r->reply_reserved);
    r->reply_reserved = 0;
}

static void uncount(const ticket_t *t)
{
    atomic_fetch_sub_explicit(t->total, t->bytes, memory_order_relaxed);
    if (t->meter) {
        atomic_fetch_sub_explicit(&t->meter->held, t->bytes, memory_order_relaxed);
        td_reply_meter_release(t->meter);
    }
}

/* ZeroMQ is done with a reply's payload (any thread): uncount it, then free it. */
static void reply_freed(void *data, void *hint)
{
    ticket_t *t = hint;
    uncount(t);
    t->free_fn(data, t->hint);
    free(t);
}

static void free_reply_data(void *data, void *hint)
{
    (void)hint;
    free(data);
}

/* A ticket for r's payload, counted from now on; NULL for an error reply (a message of at most
 * 255 bytes is not counted) or when out of memory (then it goes uncounted: a reply is never
 * dropped for its bookkeeping). */
static ticket_t *ticket_new(td_replies_t *self, td_request_t *r, zmq_free_fn *free_fn)
{
    if (r->rep.status != TALLY_OK)
        return NULL;
    ticket_t *t = malloc(sizeof *t);
    if (!t) {
        td_warn("out of memory: reply to request %" PRIu64 " not counted", r->rep.request_id);
        return NULL;
    }
    *t = (ticket_t){.bytes = r->reply_len,
                    .meter = r->conn ? td_peer_meter(r->conn) : NULL,
                    .total = &self->held,
                    .free_fn = free_fn,
                    .hint = r->reply_hint};
    atomic_fetch_add_explicit(&self->held, t->bytes, memory_order_relaxed);
    if (t->meter) {
        td_reply_meter_hold(t->meter);
        atomic_fetch_add_explicit(&t->meter->held, t->bytes, memory_order_relaxed);
    }
    return t;
}

/* The payload as a message that ZeroMQ frees (or gives back) once written out, counted until
 * then. Returns 0 or an errno. */
static int payload_message(td_replies_t *self, td_request_t *r, zmq_msg_t *body)
{
    zmq_free_fn *free_fn = r->reply_free ? r->reply_free : free_reply_data;
    void *hint = r->reply_hint;
    ticket_t *t = ticket_new(self, r, free_fn);
    if (t) {
        free_fn = reply_freed;
        hint = t;
    }
    if (zmq_msg_init_data(body, r->reply_data, r->reply_len, free_fn, hint) != 0) {
        int err = errno; /* ZeroMQ took nothing: the payload stays the request's */
        if (t) {
            uncount(t);
            free(t);
        }
        return err;
    }
    r->reply_data = NULL; /* ZeroMQ owns it now */
    r->reply_free = NULL;
    note_peaks(self, r->conn);
    return 0;
}

/* r's payload as the reply's last frame (an empty one when it has none). When ZeroMQ has no
 * memory for it, a successful reply becomes an `internal` error (the request's effect stands:
 * PROTOCOL.md §7) and an error reply loses only its text; the reply is never lost. */
static void body_message(td_replies_t *self, td_request_t *r, zmq_msg_t *body)
{
    if (!r->reply_data || !r->reply_len) {
        zmq_msg_init(body);
        return;
    }
    if (payload_message(self, r, body) == 0)
        return;
    td_err("out of memory for the reply to request %" PRIu64 ": answering `internal`",
           r->rep.request_id);
    if (r->rep.status == TALLY_OK)
        td_request_fail(r, TALLY_E_INTERNAL, "out of memory for the reply; the request succeeded");
    if (r->rep.status == TALLY_OK || !r->reply_data || payload_message(self, r, body) != 0)
        zmq_msg_init(body);
}

/* Sends r's reply now: 0, or the errno of the failed send (EHOSTUNREACH: the peer has gone;
 * EAGAIN: its send queue is full). */
static int send_now(td_replies_t *self, void *router, td_request_t *r)
{
    /* Only the first frame can meet EHOSTUNREACH or EAGAIN: once it is accepted ZeroMQ takes
     * the rest of the message whole, so a later frame failing is a broken socket (logged). The
     * payload's message is made after it (a kept reply keeps its payload) and before the header
     * (found out of memory, the reply changes: alloc sweep, issue 25). */
    const int more = ZMQ_DONTWAIT | ZMQ_SNDMORE;
    if (zmq_send(router, r->identity, r->identity_len, more) == -1)
        return errno;
    int err = 0;
    if (r->has_delimiter && zmq_send(router, "", 0, more) == -1)
        err = errno;
    zmq_msg_t body;
    if (!err)
        body_message(self, r, &body);
    uint8_t header[TALLY_REP_HEADER_SIZE];
    tally_rep_encode(&r->rep, header);
    if (!err && zmq_send(router, header, sizeof header, more) == -1) {
        err = errno;
        zmq_msg_close(&body);
    } else if (!err && zmq_msg_send(&body, router, ZMQ_DONTWAIT) == -1) {
        err = errno;
        zmq_msg_close(&body);
    }
    if (err)
        td_err("sending the reply to request %" PRIu64 ": %s", r->rep.request_id,
               zmq_strerror(err));
    return err;
}

/* What a send's errno means for r, counted when r is dropped. */
static td_reply_outcome_t outcome_of(td_replies_t *self, const td_request_t *r, int err)
{
    if (err == 0)
        return TD_REPLY_SENT;
    if (err == EAGAIN) {
        self->metrics->replies_dropped_slow++;
        td_debug("reply to request %" PRIu64 " dropped: the peer is not reading its replies",
                 r->rep.request_id);
        return TD_REPLY_SLOW;
    }
    self->metrics->replies_dropped_gone++; /* a broken socket too (logged by send_now) */
    td_debug("reply to request %" PRIu64 " dropped: the peer has gone", r->rep.request_id);
    return err == EHOSTUNREACH ? TD_REPLY_GONE : TD_REPLY_BROKEN;
}

/* A kept reply counts as held, like one inside ZeroMQ (sign +1 when kept, -1 when it leaves). */
static void count_kept(td_replies_t *self, const td_request_t *r, int sign)
{
    if (r->rep.status != TALLY_OK)
        return;
    uint64_t bytes = r->reply_len;
    td_reply_meter_t *m = r->conn ? td_peer_meter(r->conn) : NULL;
    if (sign > 0) {
        atomic_fetch_add_explicit(&self->held, bytes, memory_order_relaxed);
        if (m)
            atomic_fetch_add_explicit(&m->held, bytes, memory_order_relaxed);
    } else {
        atomic_fetch_sub_explicit(&self->held, bytes, memory_order_relaxed);
        if (m)
            atomic_fetch_sub_explicit(&m->held, bytes, memory_order_relaxed);
    }
}

static lost_t *lost_find(const td_replies_t *self, const td_peer_t *conn)
{
    lost_t *l = self->lost;
    while (l && l->conn != conn)
        l = l->next;
    return l;
}

static void keep(td_replies_t *self, lost_t *l, td_request_t *r)
{
    td_request_release_input(r); /* a kept reply holds only itself */
    count_kept(self, r, +1);
    td_request_queue_push(&l->kept, r);
}

/* r's connection has just been found closed: its replies are kept from now on. NULL when out of
 * memory (then r is dropped). */
static lost_t *lost_new(td_replies_t *self, td_request_t *r)
{
    lost_t *l = calloc(1, sizeof *l);
    if (!l)
        return NULL;
    l->conn = r->conn;
    l->since_ns = uv_hrtime();
    l->next = self->lost;
    self->lost = l;
    self->lost_total++;
    td_notice("connection %s closed with requests unanswered (the client closed it, or ZeroMQ "
              "did after a frame over max_frame); its replies are kept %u ms for it to reconnect",
              td_peer_name(r->conn), TD_REPLY_RECONNECT_GRACE_MS);
    return l;
}

td_reply_outcome_t td_replies_send(td_replies_t *self, void *router, td_request_t *r)
{
    unreserve(self, r);
    lost_t *l = r->conn ? lost_find(self, r->conn) : NULL;
    if (!l) {
        int err = send_now(self, router, r);
        if (err != EHOSTUNREACH || !r->conn || !(l = lost_new(self, r)))
            return outcome_of(self, r, err);
    }
    keep(self, l, r); /* behind the replies kept before it: a stream's order holds */
    return TD_REPLY_KEPT;
}

/* Ends every reply still kept for l (dropped as by a send that failed with err), then l. */
static void lost_free(td_replies_t *self, lost_t *l, int err)
{
    lost_t **link = &self->lost;
    while (*link != l)
        link = &(*link)->next;
    *link = l->next;
    td_request_t *r;
    while ((r = td_request_queue_pop(&l->kept))) {
        count_kept(self, r, -1);
        self->done(self->owner, r, outcome_of(self, r, err));
    }
    free(l);
}

/* Sends l's kept replies in order while its connection takes them. */
static void lost_retry(td_replies_t *self, void *router, lost_t *l)
{
    td_request_t *r;
    while ((r = l->kept.head)) {
        count_kept(self, r, -1);
        int err = send_now(self, router, r);
        if (err == EHOSTUNREACH) { /* not back yet */
            count_kept(self, r, +1);
            return;
        }
        td_request_queue_pop(&l->kept);
        if (!err)
            self->resent_total++;
        self->done(self->owner, r, outcome_of(self, r, err));
    }
}

bool td_replies_retry(td_replies_t *self, void *router, uint64_t now_ns)
{
    uint64_t grace_ns = (uint64_t)TD_REPLY_RECONNECT_GRACE_MS * 1000000u;
    lost_t *next;
    for (lost_t *l = self->lost; l; l = next) {
        next = l->next;
        lost_retry(self, router, l);
        if (!l->kept.head || now_ns - l->since_ns >= grace_ns)
            lost_free(self, l, EHOSTUNREACH);
    }
    return self->lost != NULL;
}

void td_replies_close(td_replies_t *self)
{
    while (self->lost)
        lost_free(self, self->lost, EHOSTUNREACH);
}

void td_replies_gauges(const td_replies_t *self, td_gauges_t *g)
{
    g->reply_held = atomic_load_explicit(&((td_replies_t *)self)->held, memory_order_relaxed);
    g->reply_reserved = self->reserved;
    g->reply_peak_peer = self->peak_peer;
    g->reply_peak_total = self->peak_total;
    g->reply_bound_peer = td_config_reply_bytes_per_peer(self->cfg);
    g->reply_bound_total = td_config_reply_bytes(self->cfg);
    g->connections_lost = self->lost_total;
    g->replies_resent = self->resent_total;
}
