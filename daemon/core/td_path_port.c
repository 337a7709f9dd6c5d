/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_path_port.c — a port: the request path's front for a transport that has a thread of its own
 * (td_transport.h; the NATS fleet's, issue 32).
 *
 * Design
 * ------
 * The front (td_path.c) runs on the loop thread; a transport with a thread of its own reached it
 * through a queue and a wake-up of the loop, and its replies came back the same way: two more
 * hand-offs per message, and the loop thread the busiest of a fleet worker's (bench/NOTES.md, "A
 * pinned worker's wake-ups"). A port does the front's part of a request on the transport's own
 * thread instead, and the loop thread is out of the way:
 *
 *   port's thread ── batch per shard ──▶ shard's mailbox ──▶ shard ── batch per port ──▶ port
 *
 * What the front does per request, and what the port does instead:
 *   - admission (td_admit_identify): the fleet's port none: its requests are tallyd's own (no
 *     sender id), so no per-peer share; the shard still meets them with every other limit, and
 *     counts their reply bytes (td_reply.h: atomics). A port given a td_admit_t of its own
 *     (td_path_port_admit: a ZeroMQ front, net/td_zmq_front.c) identifies each request that names a
 *     sender on its own thread, in the order it read them, against a peers' table of its own,
 *     and the connection's in-flight share and reply bytes are judged as the front's are: the
 *     verdict travels with the request to its shard (td_admit.h); the connection counts its
 *     request answered once the transport has read the reply;
 *   - the shard: a named stream's (td_path_named_shard: the hash, pure), the others the next
 *     shard in turn (the front's least-loaded pick reads counts of the loop thread's). Every
 *     request of one port reaches its shard through the port's one batch for it: a stream's
 *     requests arrive in the order the port submitted them (td_mailbox.h);
 *   - max_inflight: the port counts its own requests (submitted, replies not taken) and takes no
 *     more than max_inflight with the front's and the other ports' (TD_ERR_BUSY: the transport
 *     submits it again later; the limit as the path stored it when a hold of the shards last
 *     ended, since a reload changes it under one, and the front's count as it stored it); the
 *     loop thread adds every port's count (an atomic the port's thread stores) to its own in
 *     td_path_may_read and td_path_inflight, so the front reads less while ports are busy and
 *     the server's stop waits for the ports' requests too; a port's replies that free slots
 *     wake the loop thread while its transport holds input at the limit (td_path_wait_for_room:
 *     no reply of its own may come to wake it). Each thread reads the others'
 *     counts as they are: threads submitting at the same moment may pass the limit by one
 *     request each;
 *   - shared-memory references are not resolved here (the front pins regions for ZeroMQ's
 *     requests); a port's request runs on its shard as any other, never on the port's thread
 *     (td_path_run_on_front is the loop's); the front's counters (td_path_env_t.metrics) are not
 *     touched: the shards count every request, and a port's replies are never dropped;
 *   - the replies come back in the shards' batches to the port's mailbox, whose wake-up is the
 *     transport's function (the fleet's eventfd), written only when the port's thread sleeps
 *     (td_path_port_sleep, last before it blocks); the port's thread takes them, the transport
 *     reads each, and the port ends it: its body freed, the request kept among the port's
 *     spares (at most TD_PATH_PORT_SPARES) or freed, on the port's thread;
 *   - `info`, `stats` and `streams` go from the shard to the front, which gathers with the shards
 *     held, and back to the shard, which replies to the port (r->port), as for any transport.
 *
 * Stopping: td_path_stop reaches the shards through the front's batches; a port's requests that
 * arrive after it are answered `shutdown` by their shard. Once the drain is over or the path is
 * closed (td_path_drain_over, td_path_close: ports_refuse), the port answers every request
 * `shutdown` itself, and they come back with the replies. td_path_close shuts each port
 * (td_path_ports_shut, under the port's mutex, which each flush holds while it posts) before
 * it posts the shards' last hop: what a port posted before is ahead of it in the mailboxes and
 * answered (`shutdown`, the shards stopped), and a batch the port flushes after is answered by
 * the port. Nothing is posted to a shard's mailbox after it closed.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "td_path_int.h"
#include "td_reply.h"

/* The most retired requests a port keeps for reuse (as the front's TD_PATH_SPARES). */
#define TD_PATH_PORT_SPARES 4096u

/* ---- Opening and closing (loop thread) ----------------------------------------------------- */

td_err_t td_path_port_open(td_path_t *p, td_transport_t *t, void (*wake)(void *ctx), void *ctx,
                           td_path_port_t **out)
{
    *out = NULL;
    unsigned count = atomic_load_explicit(&p->port_count, memory_order_relaxed);
    if (!p->threads || count >= TD_PATH_PORTS_MAX || !p->slots[0].inbox.open || p->slots[0].running)
        return TD_ERR_CONFIG; /* through the loop thread: td_path_submit */
    td_path_port_t *port = calloc(1, sizeof *port);
    if (!port || !(port->to_shard = calloc(p->count, sizeof *port->to_shard))) {
        free(port);
        return TD_ERR_NOMEM;
    }
    port->path = p;
    port->transport = t;
    td_mailbox_init_wake(&port->replies, wake, ctx);
    atomic_init(&port->inflight, 0);
    port->mu = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    port->index = count;
    port->admit = NULL;
    atomic_store_explicit(&p->ports[count], port, memory_order_relaxed);
    atomic_store_explicit(&p->port_count, count + 1, memory_order_release); /* after the entry */
    *out = port;
    return TD_OK;
}

void td_path_port_admit(td_path_port_t *port, td_admit_t *admit)
{
    port->admit = admit;
}

/* The requests in flight of every open port but `but`. */
static unsigned ports_inflight(const td_path_t *p, const td_path_port_t *but)
{
    td_path_t *mp = (td_path_t *)p; /* atomics are read through a non-const pointer */
    unsigned n = 0, count = atomic_load_explicit(&mp->port_count, memory_order_acquire);
    for (unsigned i = 0; i < count; i++) {
        td_path_port_t *port = atomic_load_explicit(&mp->ports[i], memory_order_relaxed);
        if (port && port != but)
            n += atomic_load_explicit(&port->inflight, memory_order_acquire);
    }
    return n;
}

unsigned td_path_ports_inflight(const td_path_t *p)
{
    return ports_inflight(p, NULL);
}

/* The loop thread: fn on each port of the table, in the order opened (an entry freed already is
 * NULL: skipped). */
static void each_port(td_path_t *p, void (*fn)(td_path_port_t *port))
{
    unsigned count = atomic_load_explicit(&p->port_count, memory_order_relaxed);
    for (unsigned i = 0; i < count; i++) {
        td_path_port_t *port = atomic_load_explicit(&p->ports[i], memory_order_relaxed);
        if (port)
            fn(port);
    }
}

static void shut_port(td_path_port_t *port)
{
    pthread_mutex_lock(&port->mu);
    port->closed = true;
    pthread_mutex_unlock(&port->mu);
}

void td_path_ports_shut(td_path_t *p)
{
    each_port(p, shut_port);
}

static void free_hops(td_hop_t *hop)
{
    while (hop) {
        td_hop_t *next = hop->next;
        td_request_t *r = td_path_hop_request(hop);
        td_request_destroy(&r);
        hop = next;
    }
}

static void count_inflight(td_path_port_t *port);

static void drop_reply(void *ctx, td_reply_t *reply)
{
    (void)ctx;
    (void)reply; /* its body is freed as the port ends it */
}

void td_path_port_close(td_path_port_t **port_p)
{
    td_path_port_t *port = *port_p;
    if (!port)
        return;
    td_path_port_take_replies(port, drop_reply, NULL);
    for (unsigned i = 0; i < port->path->count; i++) { /* never posted (a failed start) */
        free_hops(port->to_shard[i].newest);
        port->to_shard[i] = (td_hop_batch_t){0};
    }
    for (td_hop_t *hop = port->spares, *next; hop; hop = next) {
        next = hop->next;
        free(td_path_hop_request(hop)); /* disposed as it was retired */
    }
    port->spares = NULL;
    port->spare_count = 0;
    port->own_inflight = 0;
    count_inflight(port);
    td_mailbox_close(&port->replies);
    *port_p = NULL; /* the path frees it (td_path_ports_free): other ports' threads read it */
}

static void free_port(td_path_port_t *port)
{
    atomic_store_explicit(&port->path->ports[port->index], NULL, memory_order_relaxed);
    pthread_mutex_destroy(&port->mu);
    free(port->to_shard);
    free(port);
}

void td_path_ports_free(td_path_t *p)
{
    each_port(p, free_port);
}

/* ---- Requests (the port's thread) ---------------------------------------------------------- */

static void count_inflight(td_path_port_t *port)
{
    atomic_store_explicit(&port->inflight, port->own_inflight, memory_order_release);
}

/* r answered `shutdown` here, its reply echoing its header (PROTOCOL.md §3), for the port's
 * thread to take with the shards' replies. */
static void refuse(td_path_port_t *port, td_request_t *r)
{
    char msg[TALLY_ERROR_MESSAGE_MAX + 1];
    tally_req_t q;
    if (!r->decoded && r->has_header &&
        tally_req_decode(r->header, r->header_len, &q, msg, sizeof msg) == TALLY_OK) {
        r->req = q;
        r->decoded = true;
    }
    r->rep.opcode = r->req.opcode;
    r->rep.flags = r->req.flags;
    r->rep.request_id = r->req.request_id;
    td_request_fail(r, TALLY_E_SHUTDOWN, "tallyd reads nothing more (stopping)");
    td_request_release_input(r);
    td_replies_hand(port->path->env.replies, r);
    r->out.to = (td_sender_t){.id = r->identity,
                              .id_len = r->identity_len,
                              .word = r->transport_word,
                              .ctx = r->transport_ctx};
    td_hop_batch_add(&port->refused, &r->hop, HOP_REPLY);
}

/* At max_inflight: this port's requests, the front's and the other ports', as this thread reads
 * them now (the others may submit at the same moment: the bound is passed by at most one request
 * of each thread, as with the front alone, which counts the ports' too). */
static bool path_full(const td_path_t *p, const td_path_port_t *port)
{
    td_path_t *mp = (td_path_t *)p;
    unsigned n = port->own_inflight +
                 atomic_load_explicit(&mp->front_inflight, memory_order_relaxed) +
                 ports_inflight(p, port);
    return n >= atomic_load_explicit(&mp->ports_max_inflight, memory_order_relaxed);
}

td_err_t td_path_port_submit(td_path_port_t *port, td_msg_t *m)
{
    td_path_t *p = port->path;
    bool refusing = atomic_load_explicit(&p->ports_refuse, memory_order_acquire);
    if (!refusing && path_full(p, port))
        return TD_ERR_BUSY;
    td_request_t *r = td_path_new_request(&port->spares, &port->spare_count);
    if (!r)
        return TD_ERR_NOMEM;
    r->received_ns = uv_hrtime();
    r->transport = port->transport;
    r->transport_word = m->from.word;
    r->transport_ctx = m->from.ctx;
    r->port = port;
    if (port->admit && m->from.id) { /* a connection's: its share judged now (td_admit.h) */
        r->identity_len = m->from.id_len < TD_IDENTITY_MAX ? m->from.id_len : TD_IDENTITY_MAX;
        memcpy(r->identity, m->from.id, r->identity_len);
        td_admit_identify(port->admit, r, m->from.user);
    }
    td_path_take_message(r, m);
    unsigned shard = td_path_named_shard(p, r);
    if (shard >= p->count)
        shard = port->next_pick++ % p->count;
    r->shard = shard;
    port->own_inflight++;
    count_inflight(port);
    if (refusing)
        refuse(port, r);
    else
        td_hop_batch_add(&port->to_shard[shard], &r->hop, HOP_TAKE);
    return TD_OK;
}

/* The batch's hops, oldest first (a batch is newest first); the batch is empty after. */
static td_hop_t *take_batch(td_hop_batch_t *batch)
{
    td_hop_t *oldest_first = NULL;
    for (td_hop_t *hop = batch->newest, *next; hop; hop = next) {
        next = hop->next;
        hop->next = oldest_first;
        oldest_first = hop;
    }
    *batch = (td_hop_batch_t){0};
    return oldest_first;
}

/* A batch the port could not post (the path closed): each request answered here, oldest first. */
static void refuse_batch(td_path_port_t *port, td_hop_batch_t *batch)
{
    for (td_hop_t *hop = take_batch(batch), *next; hop; hop = next) {
        next = hop->next;
        refuse(port, td_path_hop_request(hop));
    }
}

void td_path_port_flush(td_path_port_t *port)
{
    td_path_t *p = port->path;
    unsigned waiting = 0;
    for (unsigned i = 0; i < p->count; i++)
        waiting += !td_hop_batch_empty(&port->to_shard[i]);
    if (!waiting)
        return;
    pthread_mutex_lock(&port->mu);
    bool closed = port->closed;
    for (unsigned i = 0; !closed && i < p->count; i++)
        td_mailbox_post(&p->slots[i].inbox, &port->to_shard[i]);
    pthread_mutex_unlock(&port->mu);
    for (unsigned i = 0; closed && i < p->count; i++)
        refuse_batch(port, &port->to_shard[i]);
}

/* ---- Replies (the port's thread) ----------------------------------------------------------- */

bool td_path_port_sleep(td_path_port_t *port)
{
    return td_hop_batch_empty(&port->refused) && td_mailbox_sleep(&port->replies);
}

/* The transport has read r's reply: its body's rest freed, r kept for a request to come or
 * freed. */
static void retire(td_path_port_t *port, td_request_t *r)
{
    td_bytes_free(&r->out.body);
    td_path_keep_spare(&port->spares, &port->spare_count, TD_PATH_PORT_SPARES, r);
}

static unsigned hand_over(td_path_port_t *port, td_hop_t *hop,
                          void (*fn)(void *ctx, td_reply_t *reply), void *ctx)
{
    unsigned n = 0;
    while (hop) {
        td_hop_t *next = hop->next;
        td_request_t *r = td_path_hop_request(hop);
        fn(ctx, &r->out);
        if (port->admit) { /* the connection has one fewer in flight, its entries let go */
            td_admit_answered(port->admit, r);
            td_peers_release(port->admit->peers, &r->conn);
            td_peers_release(port->admit->peers, &r->client);
        }
        retire(port, r);
        n++;
        hop = next;
    }
    return n;
}

/* Slots freed while the front's transport holds its input at max_inflight (td_path_wait_for_room):
 * the loop thread woken, which no reply of its own may do. Under the port's mutex, which
 * td_path_close takes (td_path_ports_shut) before the front's wake-up is closed. */
static void wake_front_for_room(td_path_port_t *port)
{
    td_path_t *p = port->path;
    atomic_thread_fence(memory_order_seq_cst); /* the count stored, before the flag is read */
    if (!atomic_load_explicit(&p->front_waits_room, memory_order_relaxed))
        return;
    pthread_mutex_lock(&port->mu);
    if (!port->closed && p->front_open && atomic_exchange(&p->front_waits_room, false))
        uv_async_send(&p->inbox.async);
    pthread_mutex_unlock(&port->mu);
}

unsigned td_path_port_take_replies(td_path_port_t *port, void (*fn)(void *ctx, td_reply_t *reply),
                                   void *ctx)
{
    unsigned n = hand_over(port, take_batch(&port->refused), fn, ctx);
    td_mailbox_wake(&port->replies);
    n += hand_over(port, td_mailbox_take(&port->replies), fn, ctx);
    if (n) {
        port->own_inflight -= n;
        count_inflight(port);
        wake_front_for_room(port);
    }
    return n;
}

unsigned td_path_port_inflight(td_path_port_t *port)
{
    return atomic_load_explicit(&port->inflight, memory_order_acquire);
}
