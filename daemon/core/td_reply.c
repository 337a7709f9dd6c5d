/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_reply.c — counting what replies hold until their transport frees them (see td_reply.h).
 *
 * A reply's payload goes to its transport without a copy: a malloc'd buffer, or a pinned buffer
 * the GPU wrote it into, which the transport frees or gives back once it is done with it (ZeroMQ:
 * once written out). To know when, the payload is handed over with a free function of ours,
 * reply_freed, and a small record (a ticket) that says how many bytes to uncount from which meter
 * and how to free the buffer after. The transport calls it exactly once, on any thread (ZeroMQ's
 * I/O thread), so the counters it touches are atomics: the connection's meter (td_peers.h) and
 * the total here, which lives until after every transport is gone (td_server_destroy).
 *
 * Reservations are counted the same way (the connection's in its td_peer_t, the total here),
 * since a connection's requests run on every shard (issue 31): taken when a request is admitted,
 * given back when its reply is handed to its transport (after the reply's held bytes are counted:
 * never a moment with neither). A reservation is added first and taken
 * back when the sum passes a bound, so the check and the count are one step and two shards never
 * both fit under a bound that has room for one. Held bytes are counted before the transport gets
 * them, so they never go below zero whatever thread frees them. The peaks are the values the
 * checks saw, raised with a compare-and-swap.
 */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "td_log.h"
#include "td_peers.h"
#include "td_reply.h"

struct td_replies {
    const td_config_t *cfg;
    _Atomic uint64_t held;      /* reply bytes held by transports, all connections */
    _Atomic uint64_t reserved;  /* reserved for requests in flight */
    _Atomic uint64_t peak_peer; /* the most one connection has used */
    _Atomic uint64_t peak_total;
};

/* What reply_freed needs: the bytes, the meters, and the buffer's own free function. Written by
 * the shard, read by whichever thread the transport frees on (ZeroMQ's I/O thread, after
 * ZeroMQ's own hand-off); `published` makes that hand-off one a race detector sees too. */
typedef struct {
    _Atomic bool published;
    uint64_t bytes;
    td_reply_meter_t *meter; /* a reference; NULL: no per-peer entry */
    _Atomic uint64_t *total;
    void (*free_fn)(void *data, void *hint); /* the buffer's own: free, or the GPU's give-back */
    void *hint;
    uint8_t header[TALLY_REP_HEADER_SIZE]; /* td_reply_t.header_kept */
} ticket_t;

td_err_t td_replies_new(const td_config_t *cfg, td_replies_t **out)
{
    td_replies_t *self = calloc(1, sizeof *self);
    if (!self)
        return TD_ERR_NOMEM;
    self->cfg = cfg;
    atomic_init(&self->held, 0);
    atomic_init(&self->reserved, 0);
    atomic_init(&self->peak_peer, 0);
    atomic_init(&self->peak_total, 0);
    *out = self;
    return TD_OK;
}

void td_replies_destroy(td_replies_t **self_p)
{
    td_replies_t *self = *self_p;
    if (!self)
        return;
    uint64_t held = atomic_load(&self->held);
    if (held) /* every transport has freed its replies by now: a leak of ours if not */
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

static uint64_t total_used(td_replies_t *self)
{
    return atomic_load_explicit(&self->held, memory_order_relaxed) +
           atomic_load_explicit(&self->reserved, memory_order_relaxed);
}

static void raise_peak(_Atomic uint64_t *peak, uint64_t value)
{
    uint64_t seen = atomic_load_explicit(peak, memory_order_relaxed);
    while (value > seen && !atomic_compare_exchange_weak_explicit(
                               peak, &seen, value, memory_order_relaxed, memory_order_relaxed))
        continue;
}

static void note_peaks(td_replies_t *self, const td_peer_t *conn)
{
    raise_peak(&self->peak_peer, peer_used(conn));
    raise_peak(&self->peak_total, total_used(self));
}

/* Reserves `need` for r's connection, or says it would pass the connection's bound (nothing
 * reserved then). A connection with nothing outstanding always gets one request through.
 * *used: what the connection uses with it, as the check saw it (its peak). */
static bool reserve_peer(td_replies_t *self, td_request_t *r, uint64_t need, uint64_t *used)
{
    *used = 0;
    if (!r->conn)
        return true;
    uint64_t before = td_peer_reserve(r->conn, need) + meter_held(r->conn);
    if (before > 0 && before + need > td_config_reply_bytes_per_peer(self->cfg)) {
        td_peer_unreserve(r->conn, need);
        return false;
    }
    *used = before + need;
    return true;
}

/* The same for all connections together, for a reply that needs a reservation. */
static bool reserve_total(td_replies_t *self, uint64_t need, uint64_t *used)
{
    *used = 0;
    if (need == 0)
        return true;
    uint64_t before = atomic_fetch_add_explicit(&self->reserved, need, memory_order_relaxed) +
                      atomic_load_explicit(&self->held, memory_order_relaxed);
    if (before > 0 && before + need > td_config_reply_bytes(self->cfg)) {
        atomic_fetch_sub_explicit(&self->reserved, need, memory_order_relaxed);
        return false;
    }
    *used = before + need;
    return true;
}

td_reply_admit_t td_replies_admit(td_replies_t *self, td_request_t *r)
{
    if (r->req.opcode == TALLY_OP_PING) /* its reply is a header: always answered */
        return TD_REPLY_ADMITTED;
    uint64_t need = td_reply_need(r), peer_used_now, total_used_now;
    if (!reserve_peer(self, r, need, &peer_used_now))
        return TD_REPLY_OVER_PEER;
    if (!reserve_total(self, need, &total_used_now)) {
        if (r->conn)
            td_peer_unreserve(r->conn, need);
        return TD_REPLY_OVER_TOTAL;
    }
    r->reply_reserved = need;
    if (need) { /* the values the checks saw: a read now could count another shard's reply twice */
        raise_peak(&self->peak_peer, peer_used_now);
        raise_peak(&self->peak_total, total_used_now);
    }
    return TD_REPLY_ADMITTED;
}

static void unreserve(td_replies_t *self, td_request_t *r)
{
    if (!r->reply_reserved)
        return;
    atomic_fetch_sub_explicit(&self->reserved, r->reply_reserved, memory_order_relaxed);
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

/* The transport is done with a reply's payload (any thread): uncount it, then free it. */
static void reply_freed(void *data, void *hint)
{
    ticket_t *t = hint;
    (void)atomic_load_explicit(&t->published, memory_order_acquire);
    uncount(t);
    t->free_fn(data, t->hint);
    free(t);
}

static void free_reply_data(void *data, void *hint)
{
    (void)hint;
    free(data);
}

/* A ticket for r's payload, counted from now on, with a copy of the encoded reply header that
 * lives as long as the payload (td_reply_t.header_kept); NULL for an error reply (a message of at
 * most 255 bytes is not counted) or when out of memory (then it goes uncounted: a reply is never
 * dropped for its bookkeeping). */
static ticket_t *ticket_new(td_replies_t *self, td_request_t *r,
                            void (*free_fn)(void *data, void *hint), const uint8_t *header)
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
    memcpy(t->header, header, sizeof t->header);
    atomic_fetch_add_explicit(&self->held, t->bytes, memory_order_relaxed);
    if (t->meter) {
        td_reply_meter_hold(t->meter);
        atomic_fetch_add_explicit(&t->meter->held, t->bytes, memory_order_relaxed);
    }
    atomic_store_explicit(&t->published, true, memory_order_release);
    return t;
}

void td_replies_hand(td_replies_t *self, td_request_t *r)
{
    td_reply_t *out = &r->out;
    out->rep = r->rep;
    tally_rep_encode(&r->rep, out->header);
    out->body = (td_bytes_t){0};
    out->header_kept = NULL;
    if (!r->reply_data) {
        unreserve(self, r);
        return;
    }
    void (*free_fn)(void *, void *) = r->reply_free ? r->reply_free : free_reply_data;
    void *hint = r->reply_hint;
    bool reserved = r->reply_reserved != 0;
    ticket_t *t = r->reply_len ? ticket_new(self, r, free_fn, out->header) : NULL;
    /* The reservation goes after the held bytes are counted: given back first, another shard
     * admitting in between would see neither and could pass the bound (a 4-shard ASan run of
     * test_hostile did, 2026-12-03). A reply within its reservation (reply_len <= need) adds
     * nothing to the peak its admission noted; only a reply without one is noted here. */
    unreserve(self, r);
    if (t) {
        free_fn = reply_freed;
        hint = t;
        out->header_kept = t->header;
    }
    out->body =
        (td_bytes_t){.data = r->reply_data, .len = r->reply_len, .free_fn = free_fn, .hint = hint};
    r->reply_data = NULL; /* the transport's now; reply_len stays for the metrics */
    r->reply_free = NULL;
    r->reply_hint = NULL;
    if (t && !reserved)
        note_peaks(self, r->conn);
}

void td_replies_gauges(const td_replies_t *self, td_reply_gauges_t *g)
{
    td_replies_t *m = (td_replies_t *)self; /* atomics are read through a non-const pointer */
    g->held = atomic_load_explicit(&m->held, memory_order_relaxed);
    g->reserved = atomic_load_explicit(&m->reserved, memory_order_relaxed);
    g->peak_peer = atomic_load_explicit(&m->peak_peer, memory_order_relaxed);
    g->peak_total = atomic_load_explicit(&m->peak_total, memory_order_relaxed);
    g->bound_peer = td_config_reply_bytes_per_peer(self->cfg);
    g->bound_total = td_config_reply_bytes(self->cfg);
}
