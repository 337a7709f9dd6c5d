/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_path.c — the request path's front: a transport's message to its shard, the shard's reply to
 * its transport, the transport's end of it back to the shard; gathering from the shards; their
 * threads (td_path.h, td_shard.h, td_transport.h).
 *
 * Design
 * ------
 * Shared nothing, like Dragonfly's shards and Seastar's sharded<T> (STYLE.md): each shard owns
 * its part of the stream table, its scheduler, its counters, and runs on one thread; a request
 * goes to the shard that owns its stream and everything it does to that stream happens there, so
 * nothing on the hot path takes a lock. The front is the one thread that sees every request: the
 * transports' loop thread, which owns the sockets (a ZeroMQ socket is single-threaded; so are the
 * HTTP API's jobs and the NATS worker's queue). It does the least a request needs before it can
 * go to its shard: the sender's entry in the per-peer table and its share of the in-flight slots
 * (td_admit_identify: judged there, in the order requests are read, as before), the header frame
 * copied (128 bytes) and its stream's name read from it (which names the shard: the shard decodes
 * the rest), the request's in-flight slot. The payload is not touched (the transport's bytes move
 * with the request: no copy).
 *
 * Hand-off (more than one shard): requests and replies travel through mailboxes (td_mailbox.h), one
 * per shard and one for the front, in batches: what the front hands a shard during one callback (a
 * pump of up to 256 messages) is posted once, with one compare-and-swap, from the loop's check
 * and prepare handles and at the end of the front's own mailbox callback (so nothing waits across
 * a blocking poll), and a shard posts its replies to the front the same way. A post wakes its
 * consumer only when it sleeps (td_mailbox.h): a shard's thread takes what came while it ran
 * before it sleeps (shard_main), and the front takes the shards' replies as its transport services
 * the socket (td_path_take_replies, from the ZeroMQ pump) or, when it is about to block, through
 * its own wake-up (front_prepare_cb). FIFO batches per producer: a stream's requests reach their
 * shard in the order the front read them, which is the order ZeroMQ delivered them (a port's, in
 * the order its thread submitted them: a stream of the fleet's comes through one port only).
 *
 * Requests are allocated and retired on the front's thread: the transport ends a reply there
 * (td_reply_end), and its request is counted, released and kept among the front's spares for the
 * next message (at most TD_PATH_SPARES), with no hop back to its shard (that hop woke every shard
 * once more per batch of replies; freeing on the shard sent every request back to the front's
 * malloc arena under its lock: bench/NOTES.md, "The front").
 *
 * In flight: the front counts what it hands each shard and the replies that come back; their
 * difference is what max_inflight bounds (td_path_may_read), exact on the front's thread with no
 * atomic (a reply counts once it is back on that thread). Ports (td_path_port.c: the fronts of
 * transports with threads of their own, the NATS fleet's) count theirs on their threads; the
 * front adds what each has stored in an atomic, and stores its own for them (with any port).
 * Their requests go to the shards and their replies come back without this thread: a shard
 * keeps a batch of replies per port beside its batch for the front (slot_t.to_port).
 *
 * Gathering: `info`, `stats`, `streams`, /metrics, the web page, the snapshots, the PUB socket
 * and the NATS worker read the whole table and every shard's counters on the loop thread, while
 * the shards are held still: td_streams_hold (the whole table's hook, installed here) wakes every
 * shard and waits until each has parked at a barrier (a mutex and two condition variables), and
 * td_streams_release lets them go. The mutex hands over what the shards wrote before they parked
 * and what the loop thread wrote while they were parked. A shard parks only when it is between
 * callbacks, so a hold waits at most for the longest callback running (one inline batch); holds
 * come from timers and requests for the whole daemon, never per request. Shards never wait for
 * the loop thread otherwise, and the loop thread waits for nothing while it holds them, so no
 * cycle of waits can form.
 *
 * Stopping: td_path_stop reaches each shard behind the requests already handed to it; once the
 * wiring finds nothing in flight and nothing left to read it closes the transports (which drop
 * the replies they kept: their ends still go to the shards), then td_path_close hands each shard
 * its last message, the shard closes its handles and its loop ends, and the threads are joined:
 * from then on the loop thread owns every shard's state (the final snapshot reads it). The ports
 * are shut before the last message (td_path_ports_shut): what they posted before it is answered,
 * and what they submit after it they answer themselves.
 */
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_admit.h"
#include "td_hash.h"
#include "td_log.h"
#include "td_mailbox.h"
#include "td_ops.h"
#include "td_path.h"
#include "td_path_int.h"
#include "td_shard.h"

/* A deleted stream's name on its way to the front. */
typedef struct {
    td_hop_t hop;
    size_t len;
    char name[];
} deleted_t;

static void flush_to_shards(td_path_t *p);
static void flush_to_front(slot_t *slot);

/* The most retired requests the front keeps for reuse; more are freed (after a burst). */
#define TD_PATH_SPARES 4096u

/* ---- Holding the shards still ------------------------------------------------------------- */

/* A shard's thread, when it wakes: parks while the loop thread holds the shards. */
static void park_if_held(slot_t *slot)
{
    td_path_t *p = slot->path;
    unsigned want = atomic_load_explicit(&p->want, memory_order_acquire);
    if (want == slot->parked_epoch)
        return;
    pthread_mutex_lock(&p->lock);
    slot->parked_epoch = want;
    p->parked++;
    pthread_cond_signal(&p->parked_cond);
    while (p->released != want)
        pthread_cond_wait(&p->release_cond, &p->lock);
    pthread_mutex_unlock(&p->lock);
}

static unsigned running_shards(const td_path_t *p)
{
    unsigned n = 0;
    for (unsigned i = 0; i < p->count; i++)
        n += p->slots[i].running;
    return n;
}

/* td_streams_hold's hook: stops every running shard at its barrier, or lets them all go. */
static void hold(void *ctx, bool on)
{
    td_path_t *p = ctx;
    if (!on) /* a reload changes the configuration under a hold: the ports read it here */
        atomic_store_explicit(&p->ports_max_inflight, p->env.cfg->max_inflight,
                              memory_order_relaxed);
    if (!p->threads || !running_shards(p))
        return;
    if (!on) {
        if (--p->hold_depth)
            return;
        pthread_mutex_lock(&p->lock);
        p->released = atomic_load_explicit(&p->want, memory_order_relaxed);
        pthread_cond_broadcast(&p->release_cond);
        pthread_mutex_unlock(&p->lock);
        return;
    }
    if (p->hold_depth++)
        return;
    pthread_mutex_lock(&p->lock);
    p->parked = 0;
    atomic_store_explicit(&p->want, p->released + 1, memory_order_release);
    pthread_mutex_unlock(&p->lock);
    for (unsigned i = 0; i < p->count; i++)
        if (p->slots[i].running)
            uv_async_send(&p->slots[i].inbox.async);
    unsigned n = running_shards(p);
    pthread_mutex_lock(&p->lock);
    while (p->parked < n)
        pthread_cond_wait(&p->parked_cond, &p->lock);
    pthread_mutex_unlock(&p->lock);
}

/* ---- The front: a transport's message to its shard ----------------------------------------- */

/* The least loaded shard: the fewest requests in flight, the search starting one further each
 * time so that ties spread. */
static slot_t *least_loaded(td_path_t *p)
{
    unsigned best = p->next_pick % p->count;
    for (unsigned k = 1; k < p->count; k++) {
        unsigned i = (p->next_pick + k) % p->count;
        if (p->slots[i].dispatched - p->slots[i].replied <
            p->slots[best].dispatched - p->slots[best].replied)
            best = i;
    }
    p->next_pick = best + 1;
    return &p->slots[best];
}

/* A named stream's shard owns it; anything else (no stream, or a header its shard will refuse)
 * goes where there is least to do. Only the name is read here: the shard decodes the header. */
unsigned td_path_named_shard(const td_path_t *p, const td_request_t *r)
{
    const char *name;
    size_t len;
    if (r->has_header && tally_req_stream_of(r->header, r->header_len, &name, &len))
        return (unsigned)td_stream_shard(name, len, p->count);
    return p->count;
}

static slot_t *pick(td_path_t *p, const td_request_t *r)
{
    if (p->count == 1)
        return &p->slots[0];
    unsigned i = td_path_named_shard(p, r);
    return i < p->count ? &p->slots[i] : least_loaded(p);
}

/* The envelope into r: its transport and sender (and who that is, held to the per-peer limits;
 * tallyd's own requests are not). */
static void take_envelope(td_path_t *p, td_request_t *r, td_transport_t *t, const td_sender_t *from)
{
    r->transport = t;
    r->transport_word = from->word;
    r->transport_ctx = from->ctx;
    if (!from->id)
        return;
    r->identity_len = from->id_len < TD_IDENTITY_MAX ? from->id_len : TD_IDENTITY_MAX;
    memcpy(r->identity, from->id, r->identity_len);
    td_admit_identify(&p->admit, r, from->user);
}

/* The message's header frame (its first TALLY_REQ_HEADER_SIZE bytes: the decoder reads no more
 * of a longer one, which it refuses by its length) and frame count, for its shard. */
static void copy_header(td_request_t *r, const td_msg_t *m)
{
    r->frames = m->frames;
    r->has_header = m->header != NULL;
    r->header_len = m->header ? m->header_len : 0;
    if (m->header)
        memcpy(r->header, m->header,
               r->header_len < TALLY_REQ_HEADER_SIZE ? r->header_len : TALLY_REQ_HEADER_SIZE);
}

td_request_t *td_path_new_request(td_hop_t **spares, unsigned *spare_count)
{
    if (!*spares)
        return td_request_new();
    td_request_t *r = td_path_hop_request(*spares);
    *spares = (*spares)->next;
    (*spare_count)--;
    td_request_reuse(r);
    return r;
}

void td_path_keep_spare(td_hop_t **spares, unsigned *spare_count, unsigned limit, td_request_t *r)
{
    if (*spare_count >= limit) {
        td_request_destroy(&r);
        return;
    }
    td_request_dispose(r);
    r->hop.next = *spares;
    *spares = &r->hop;
    (*spare_count)++;
}

static td_request_t *new_request(td_path_t *p)
{
    return td_path_new_request(&p->spares, &p->spare_count);
}

/* Several shards: a shared-memory reference is resolved here, as the request is read, so that
 * the regions it names stay for it (referenced) even if their side connection lets them go
 * before its shard takes it: with one thread the request was read and resolved before the
 * loop saw the side connection close, and so it still is. Anything that does not resolve here
 * is left to the shard, which answers it as with one. */
static void pin_regions(td_path_t *p, td_request_t *r)
{
    tally_req_t req;
    tally_shm_ref_t ref;
    char msg[TALLY_ERROR_MESSAGE_MAX + 1];
    uint8_t *in = NULL, *out = NULL;
    if (!p->shm || !r->has_header || !r->arrived.data || r->arrived.len != TALLY_SHM_REF_SIZE ||
        tally_req_decode(r->header, r->header_len, &req, msg, sizeof msg) != TALLY_OK ||
        !(req.flags & TALLY_FLAG_SHM_REF) ||
        tally_shm_ref_decode(r->arrived.data, r->arrived.len, &ref, msg, sizeof msg) != TALLY_OK ||
        td_shm_resolve(p->shm, r->identity, r->identity_len, ref.in_handle, ref.in_offset,
                       ref.in_length, false, &r->shm_in, &in, msg, sizeof msg) != TALLY_OK)
        return;
    if (ref.out_handle &&
        td_shm_resolve(p->shm, r->identity, r->identity_len, ref.out_handle, ref.out_offset,
                       ref.out_length, true, &r->shm_out, &out, msg, sizeof msg) != TALLY_OK) {
        td_shm_region_put(&r->shm_in);
        return;
    }
    r->shm_in_ptr = in;
    r->shm_out_ptr = out;
}

void td_path_take_message(td_request_t *r, td_msg_t *m)
{
    copy_header(r, m);
    if (m->req) { /* the shard need not decode it again */
        r->req = *m->req;
        r->decoded = true;
    }
    r->body_unwanted = m->body_unwanted;
    r->arrived = m->payload;   /* the shard's now */
    if (m->payload_borrowed) { /* the transport's: copied (TD_PAYLOAD_BORROW_MAX at most) */
        memcpy(r->payload_inline, m->payload.data, m->payload.len);
        r->arrived = (td_bytes_t){.data = r->payload_inline, .len = m->payload.len};
    } else if (m->hold) { /* the transport's holder, moved in */
        r->arrived = m->hold(r->payload_holder, m->hold_ctx);
    }
    m->payload = (td_bytes_t){0};
}

/* The front's requests in flight, for the ports' threads (td_path_port.c: max_inflight). */
static void note_inflight(td_path_t *p)
{
    if (atomic_load_explicit(&p->port_count, memory_order_relaxed))
        atomic_store_explicit(&p->front_inflight, (unsigned)(p->dispatched - p->replied),
                              memory_order_relaxed);
}

td_err_t td_path_submit(td_path_t *p, td_transport_t *t, td_msg_t *m)
{
    td_request_t *r = new_request(p);
    if (!r)
        return TD_ERR_NOMEM; /* the transport answers it (td_transport.h) */
    r->received_ns = uv_hrtime();
    take_envelope(p, r, t, &m->from);
    td_path_take_message(r, m);
    if (p->threads)
        pin_regions(p, r);
    slot_t *slot = pick(p, r);
    r->shard = slot->index;
    slot->dispatched++;
    p->dispatched++;
    note_inflight(p);
    if (!p->threads)
        td_shard_take(slot->shard, r);
    else if (!td_path_run_on_front(p, slot, r))
        td_hop_batch_add(&slot->to_shard, &r->hop, HOP_TAKE);
    return TD_OK;
}

bool td_path_wait_for_room(td_path_t *p)
{
    /* Stored before the counts are read again, as a port stores its count before it reads this
     * (td_path_port.c, wake_front_for_room): one of the two sees the other. */
    atomic_store_explicit(&p->front_waits_room, true, memory_order_seq_cst);
    return td_path_may_read(p);
}

bool td_path_may_read(const td_path_t *p)
{
    if (p->closed) /* a transport still open (the fleet's, giving its partitions up) */
        return false;
    if (p->stopping)
        return !p->drain_expired;
    return p->dispatched - p->replied + td_path_ports_inflight(p) < p->env.cfg->max_inflight;
}

/* ---- Replies ------------------------------------------------------------------------------ */

/* The loop thread: a shard's reply, out through its transport. */
static void reply_out(td_path_t *p, td_request_t *r)
{
    p->slots[r->shard].replied++;
    p->replied++;
    note_inflight(p);
    if (r->gpu_stamp[TD_GPU_STAGE_APPLY]) {
        r->gpu_stamp[TD_GPU_STAGE_TO_FRONT] = uv_hrtime();
        td_metrics_gpu_stages(p->env.metrics, r->gpu_stamp, r->received_ns, TD_GPU_STAGE_TO_FRONT,
                              TD_GPU_STAGE_TO_FRONT);
    }
    td_admit_answered(&p->admit, r);
    r->transport->ops->send_reply(r->transport, &r->out);
}

/* The transport is done with r's reply: a dropped one counted (on the front's counters, which
 * td_path_sum_metrics adds to the shards'), its peers' references released, and r kept for a
 * request to come (with threads; at most TD_PATH_SPARES) or freed. On the front's thread, not
 * r's shard's: nothing of the shard's is left in r (its input and its reply's bytes went when it
 * was answered), and a hop back would wake the shard once more for every batch of replies
 * (bench/NOTES.md, "The front"). */
static void retire(td_path_t *p, td_request_t *r, td_reply_outcome_t outcome)
{
    if (outcome == TD_REPLY_SLOW) {
        p->env.metrics->replies_dropped_slow++;
        td_debug("reply to request %" PRIu64 " dropped: the peer is not reading its replies",
                 r->rep.request_id);
    } else if (outcome != TD_REPLY_SENT) { /* a broken transport too (logged there) */
        p->env.metrics->replies_dropped_gone++;
        td_debug("reply to request %" PRIu64 " dropped: the peer has gone", r->rep.request_id);
    }
    td_peers_release(p->env.peers, &r->conn);
    td_peers_release(p->env.peers, &r->client);
    td_path_keep_spare(&p->spares, &p->spare_count, p->threads ? TD_PATH_SPARES : 0, r);
}

void td_reply_end(td_reply_t *reply, td_reply_outcome_t outcome)
{
    td_request_t *r = (td_request_t *)((char *)reply - offsetof(td_request_t, out));
    td_bytes_free(&reply->body); /* what the transport did not take */
    r->outcome = outcome;
    retire(r->transport->path, r, outcome);
}

/* info, stats and streams, from the whole daemon with every shard held still. */
static void gather(td_path_t *p, td_request_t *r)
{
    td_streams_hold(p->env.streams);
    if (r->req.opcode == TALLY_OP_STREAMS)
        td_op_streams(p->env.streams, r);
    else
        p->env.answer_here(p->env.owner, r);
    td_streams_release(p->env.streams);
}

/* ---- What a shard hands the front (td_shard_env_t), on the shard's thread ------------------ */

static void shard_reply(void *front, td_request_t *r)
{
    td_path_t *p = front;
    slot_t *slot = &p->slots[r->shard];
    if (r->port) /* to its port's thread, with the shard's next post (a port needs threads) */
        td_hop_batch_add(&slot->to_port[r->port->index], &r->hop, HOP_REPLY);
    else if (p->threads && !slot->front_has_it)
        td_hop_batch_add(&slot->to_front, &r->hop, HOP_REPLY);
    else
        reply_out(p, r);
}

static void shard_gather(void *front, td_request_t *r)
{
    td_path_t *p = front;
    if (p->threads) {
        td_hop_batch_add(&p->slots[r->shard].to_front, &r->hop, HOP_GATHER);
        return;
    }
    gather(p, r);
    td_shard_resume(p->slots[r->shard].shard, r);
}

/* A deleted stream: its name goes to the loop thread (subscriptions are its). Out of memory,
 * the subscribers do not hear of it (the deletion itself stands). */
static void shard_deleted(void *front, const char *name, size_t len)
{
    td_path_t *p = front;
    if (!p->threads) {
        p->deleted(p->deleted_ctx, name, len);
        return;
    }
    deleted_t *d = malloc(sizeof *d + len);
    if (!d) {
        td_warn("out of memory: the deletion of stream '%.*s' is not published", (int)len, name);
        return;
    }
    d->len = len;
    memcpy(d->name, name, len);
    /* the shard of the stream: the name says which */
    slot_t *slot = &p->slots[td_stream_shard(name, len, p->count)];
    td_hop_batch_add(&slot->to_front, &d->hop, HOP_DELETED);
}

/* Null when nobody listens; the shard tests env.deleted, so it must be set only then. */
static void set_deleted(td_path_t *p, td_path_deleted_fn deleted, void *ctx)
{
    p->deleted = deleted;
    p->deleted_ctx = ctx;
}

/* ---- The mailboxes ------------------------------------------------------------------------- */

static void flush_to_shards(td_path_t *p)
{
    for (unsigned i = 0; i < p->count; i++)
        if (p->slots[i].running)
            td_mailbox_post(&p->slots[i].inbox, &p->slots[i].to_shard);
}

/* The replies for the ports' threads, each port's batch posted to it. */
static void flush_to_ports(slot_t *slot)
{
    td_path_t *p = slot->path;
    unsigned n = atomic_load_explicit(&p->port_count, memory_order_acquire);
    for (unsigned i = 0; i < n; i++) {
        td_path_port_t *port = atomic_load_explicit(&p->ports[i], memory_order_relaxed);
        if (!td_hop_batch_empty(&slot->to_port[i]) && port)
            td_mailbox_post(&port->replies, &slot->to_port[i]);
    }
}

static void flush_to_front(slot_t *slot)
{
    td_mailbox_post(&slot->path->inbox, &slot->to_front);
    flush_to_ports(slot);
}

void td_path_flush_slot(slot_t *slot)
{
    flush_to_front(slot);
}

td_request_t *td_path_hop_request(td_hop_t *hop)
{
    return (td_request_t *)((char *)hop - offsetof(td_request_t, hop));
}

/* The loop thread: what the shards handed back. */
static void front_inbox_cb(uv_async_t *handle)
{
    td_path_t *p = handle->data;
    td_mailbox_wake(&p->inbox);
    td_hop_t *hop = td_mailbox_take(&p->inbox);
    while (hop) {
        td_hop_t *next = hop->next;
        if (hop->kind == HOP_DELETED) {
            deleted_t *d = (deleted_t *)hop;
            if (p->deleted)
                p->deleted(p->deleted_ctx, d->name, d->len);
            free(d);
        } else if (hop->kind == HOP_GATHER) {
            td_request_t *r = td_path_hop_request(hop);
            slot_t *slot = &p->slots[r->shard];
            gather(p, r);
            if (slot->running)
                td_hop_batch_add(&slot->to_shard, &r->hop, HOP_RESUME);
            else /* its thread has ended: this thread owns the shard */
                td_shard_resume(slot->shard, r);
        } else { /* HOP_REPLY */
            reply_out(p, td_path_hop_request(hop));
        }
        hop = next;
    }
    flush_to_shards(p);
}

/* Last before the loop may block: the shards' posts wake it from now on, and what they posted
 * since the transports last took replies (td_path_take_replies) is taken at once, through the
 * wake-up: not here, where a reply sent would not be followed by the transport's look at its
 * socket before the loop blocks (td_zmq.c). */
static void front_prepare_cb(uv_prepare_t *handle)
{
    td_path_t *p = handle->data;
    flush_to_shards(p);
    if (!td_mailbox_sleep(&p->inbox))
        uv_async_send(&p->inbox.async);
}

/* Up again: the shards' posts stop writing the wake-up until the next prepare. */
static void front_check_cb(uv_check_t *handle)
{
    td_path_t *p = handle->data;
    td_mailbox_wake(&p->inbox);
    flush_to_shards(p);
}

void td_path_take_replies(td_path_t *p)
{
    if (!p->front_open)
        return;
    td_mailbox_wake(&p->inbox);
    if (td_mailbox_waiting(&p->inbox))
        front_inbox_cb(&p->inbox.async);
}

static void shard_close_handles(slot_t *slot);

/* A shard's thread: what the front handed it. */
static void shard_inbox_cb(uv_async_t *handle)
{
    slot_t *slot = handle->data;
    park_if_held(slot);
    td_hop_t *hop = td_mailbox_take(&slot->inbox);
    while (hop) {
        td_hop_t *next = hop->next;
        switch (hop->kind) {
        case HOP_TAKE:
            td_shard_take(slot->shard, td_path_hop_request(hop));
            break;
        case HOP_RESUME:
            td_shard_resume(slot->shard, td_path_hop_request(hop));
            break;
        case HOP_FINISH:
            td_shard_finished(slot->shard, td_path_hop_request(hop));
            break;
        case HOP_STOP:
            td_shard_stop(slot->shard);
            break;
        default: /* HOP_CLOSE: nothing is in flight, nothing more comes */
            flush_to_front(slot);
            shard_close_handles(slot);
            return;
        }
        hop = next;
    }
    flush_to_front(slot);
}

static void shard_flush_cb(uv_handle_t *handle)
{
    flush_to_front(handle->data);
}

static void shard_prepare_cb(uv_prepare_t *handle)
{
    shard_flush_cb((uv_handle_t *)handle);
}

static void shard_check_cb(uv_check_t *handle)
{
    shard_flush_cb((uv_handle_t *)handle);
}

/* ---- Shards: their loops and threads ------------------------------------------------------ */

static void sweep_cb(uv_timer_t *timer)
{
    slot_t *slot = timer->data;
    td_streams_sweep(td_shard_streams(slot->shard), td_clock_ms(), TD_STREAMS_SWEEP_PER_TICK);
}

static void held_wake_cb(uv_async_t *handle)
{
    slot_t *slot = handle->data;
    td_shard_release_held(slot->shard);
    flush_to_front(slot); /* with one shard its replies left at once: nothing to post */
}

/* On the shard's loop (the front's with one shard): the sweep of its part, the route's wake-up of
 * its held replies, and with a thread of its own its mailbox and the handles posting batches. */
static int open_slot_handles(slot_t *slot)
{
    /* libuv's uv_timer_init, uv_prepare_init and uv_check_init only fill in the handle and
     * return 0, and their starts fail only without a callback: the mailbox's wake-up (an
     * eventfd) is what can fail. */
    uv_timer_init(slot->loop, &slot->sweep);
    slot->sweep.data = slot;
    slot->sweep_open = true;
    uv_timer_start(&slot->sweep, sweep_cb, TD_PEERS_SWEEP_MS, TD_PEERS_SWEEP_MS);
    uv_unref((uv_handle_t *)&slot->sweep);
    int rc = uv_async_init(slot->loop, &slot->held_wake, held_wake_cb);
    if (rc != 0)
        return rc;
    slot->held_wake.data = slot;
    uv_unref((uv_handle_t *)&slot->held_wake);
    slot->held_wake_open = true; /* before the fleet starts (main.c): no route wakes it yet */
    if (!slot->path->threads)
        return 0;
    rc = td_mailbox_init(&slot->inbox, slot->loop, shard_inbox_cb, slot);
    if (rc != 0)
        return rc;
    uv_prepare_init(slot->loop, &slot->flush_prepare);
    uv_check_init(slot->loop, &slot->flush_check);
    slot->flush_open = true;
    slot->flush_prepare.data = slot->flush_check.data = slot;
    uv_prepare_start(&slot->flush_prepare, shard_prepare_cb);
    uv_check_start(&slot->flush_check, shard_check_cb);
    return 0;
}

/* On the shard's thread (or the loop thread with one shard, or on a failed start): closes what
 * the shard holds on its loop; with a thread, its loop ends once the callbacks have run. */
static void shard_close_handles(slot_t *slot)
{
    td_path_t *p = slot->path;
    if (slot->machine_open && p->machines.close)
        p->machines.close(p->machines.ctx, slot->index);
    slot->machine_open = false;
    if (slot->sweep_open)
        uv_close((uv_handle_t *)&slot->sweep, NULL);
    slot->sweep_open = false;
    pthread_mutex_lock(&p->wake_mu);
    if (slot->held_wake_open)
        uv_close((uv_handle_t *)&slot->held_wake, NULL);
    slot->held_wake_open = false;
    pthread_mutex_unlock(&p->wake_mu);
    td_mailbox_close(&slot->inbox);
    if (slot->flush_open) {
        uv_close((uv_handle_t *)&slot->flush_prepare, NULL);
        uv_close((uv_handle_t *)&slot->flush_check, NULL);
        slot->flush_open = false;
    }
}

static void shard_main(void *arg)
{
    slot_t *slot = arg;
    char name[16]; /* for profiles and top -H: "tdshard-3" */
    snprintf(name, sizeof name, "tdshard-%u", slot->index % 1000);
    pthread_setname_np(pthread_self(), name);
    /* uv_run(UV_RUN_DEFAULT), with `own` let go while it sleeps (run_on_front): the loop's
     * callbacks run without blocking, then the thread waits on the loop's descriptor for what
     * libuv would have waited for (libuv's uv_backend_fd and uv_backend_timeout, for loops run
     * from outside). */
    pthread_mutex_lock(&slot->own);
    while (uv_run(slot->loop, UV_RUN_NOWAIT)) {
        if (!td_mailbox_sleep(&slot->inbox)) { /* posted while it ran: no wake-up was written */
            shard_inbox_cb(&slot->inbox.async);
            continue;
        }
        slot->sleep_ms = uv_backend_timeout(slot->loop);
        pthread_mutex_unlock(&slot->own);
        struct pollfd fd = {.fd = uv_backend_fd(slot->loop), .events = POLLIN};
        uint64_t t0 = uv_hrtime();
        (void)poll(&fd, 1, slot->sleep_ms); /* EINTR: the loop looks again */
        atomic_fetch_add_explicit(&slot->asleep_ns, uv_hrtime() - t0, memory_order_relaxed);
        pthread_mutex_lock(&slot->own);
        td_mailbox_wake(&slot->inbox);
    }
    pthread_mutex_unlock(&slot->own);
}

/* The front's mailbox and the handles that post its batches, on the transports' loop. */
static int open_front(td_path_t *p)
{
    int rc = td_mailbox_init(&p->inbox, p->env.loop, front_inbox_cb, p);
    if (rc != 0)
        return rc;
    p->front_open = true;
    /* Neither the inits nor the starts fail (open_slot_handles says why). */
    uv_prepare_init(p->env.loop, &p->flush_prepare);
    uv_check_init(p->env.loop, &p->flush_check);
    p->flush_prepare.data = p->flush_check.data = p;
    uv_prepare_start(&p->flush_prepare, front_prepare_cb);
    uv_check_start(&p->flush_check, front_check_cb);
    /* They do not keep the loop alive: the transports do. */
    uv_unref((uv_handle_t *)&p->flush_prepare);
    uv_unref((uv_handle_t *)&p->flush_check);
    uv_unref((uv_handle_t *)&p->inbox.async);
    return 0;
}

static void close_front(td_path_t *p)
{
    if (!p->front_open)
        return;
    p->front_open = false;
    td_mailbox_close(&p->inbox);
    uv_close((uv_handle_t *)&p->flush_prepare, NULL); /* open_front opened both with the inbox */
    uv_close((uv_handle_t *)&p->flush_check, NULL);
}

/* ---- Life cycle ------------------------------------------------------------------------------ */

static td_err_t new_slot(td_path_t *p, unsigned i)
{
    slot_t *slot = &p->slots[i];
    *slot = (slot_t){.path = p, .index = i, .loop = p->env.loop};
    slot->own = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    if (p->threads) {
        if (uv_loop_init(&slot->own_loop) != 0)
            return TD_ERR_LIBRARY;
        slot->loop_open = true;
        slot->loop = &slot->own_loop;
    }
    if (slot->loop && !p->threads) /* busy_s: a shard's thread counts its own (shard_main) */
        uv_loop_configure(slot->loop, UV_METRICS_IDLE_TIME);
    td_shard_env_t env = {.index = i,
                          .cfg = p->env.cfg,
                          .metrics = &slot->metrics,
                          .streams = td_streams_part(p->env.streams, i),
                          .peers = p->env.peers,
                          .replies = p->env.replies,
                          .reply = shard_reply,
                          .gather = shard_gather,
                          .front = p};
    return td_shard_new(&env, &slot->shard);
}

td_err_t td_path_new(const td_path_env_t *env, td_path_t **out)
{
    td_path_t *p = calloc(1, sizeof *p);
    if (!p)
        return TD_ERR_NOMEM;
    p->env = *env;
    p->count = td_streams_parts(env->streams);
    p->threads = p->count > 1;
    p->front_thread = pthread_self(); /* the transports' loop thread makes the path */
    p->admit = (td_admit_t){
        .cfg = env->cfg, .peers = env->peers, .replies = env->replies, .metrics = env->metrics};
    p->lock = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER; /* cannot fail, unlike _init */
    p->wake_mu = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    p->parked_cond = p->release_cond = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
    atomic_init(&p->want, 0);
    atomic_init(&p->ports_max_inflight, env->cfg->max_inflight);
    p->slots = calloc(p->count, sizeof *p->slots);
    td_err_t err = p->slots ? TD_OK : TD_ERR_NOMEM;
    for (unsigned i = 0; err == TD_OK && i < p->count; i++)
        err = new_slot(p, i);
    if (err == TD_OK && p->threads && open_front(p) != 0)
        err = TD_ERR_LIBRARY;
    if (err != TD_OK) {
        td_path_destroy(&p);
        return err;
    }
    td_streams_set_hold(env->streams, hold, p);
    *out = p;
    return TD_OK;
}

td_err_t td_path_start(td_path_t *self, const td_path_machines_t *machines)
{
    self->machines = *machines;
    for (unsigned i = 0; i < self->count; i++) {
        slot_t *slot = &self->slots[i];
        td_sched_machine_t machine;
        td_err_t err = machines->open(machines->ctx, i, slot->loop, &machine);
        if (err != TD_OK)
            return err;
        slot->machine_open = true;
        err = td_shard_start(slot->shard, &machine);
        if (err != TD_OK)
            return err;
        if (slot->loop && open_slot_handles(slot) != 0) {
            td_err("cannot set up shard %u's loop", i);
            return TD_ERR_LIBRARY;
        }
    }
    if (self->threads) { /* the front's machine: only its GPU sink is used */
        td_sched_machine_t unused;
        td_err_t err = machines->open(machines->ctx, self->count, self->env.loop, &unused);
        if (err != TD_OK)
            return err;
        self->front_port = true;
    }
    return TD_OK;
}

unsigned td_path_port_count(const td_path_t *self)
{
    return self->count + (self->threads ? 1u : 0u);
}

static void close_front_port(td_path_t *self)
{
    if (self->front_port && self->machines.close)
        self->machines.close(self->machines.ctx, self->count);
    self->front_port = false;
}

td_err_t td_path_run(td_path_t *self)
{
    for (unsigned i = 0; self->threads && i < self->count; i++) {
        slot_t *slot = &self->slots[i];
        slot->start_ns = uv_hrtime();
        int rc = uv_thread_create(&slot->thread, shard_main, slot);
        if (rc != 0) {
            td_err("cannot start shard %u's thread: %s", i, uv_strerror(rc));
            return TD_ERR_LIBRARY;
        }
        slot->running = true;
    }
    if (!self->threads)
        self->slots[0].start_ns = uv_hrtime();
    return TD_OK;
}

void td_path_attach(td_path_t *self, td_shm_t *shm, td_path_deleted_fn deleted, void *ctx)
{
    self->shm = shm;
    set_deleted(self, deleted, ctx);
    for (unsigned i = 0; i < self->count; i++)
        td_shard_attach(self->slots[i].shard, shm, deleted ? shard_deleted : NULL);
}

void td_path_attach_route(td_path_t *self, const td_route_t *route)
{
    for (unsigned i = 0; i < self->count; i++)
        td_shard_attach_route(self->slots[i].shard, route);
}

void td_path_wake_held(td_path_t *self)
{
    pthread_mutex_lock(&self->wake_mu);
    for (unsigned i = 0; i < self->count; i++)
        if (self->slots[i].held_wake_open)
            uv_async_send(&self->slots[i].held_wake);
    pthread_mutex_unlock(&self->wake_mu);
}

void td_path_close(td_path_t *self)
{
    if (self->closed)
        return;
    atomic_store_explicit(&self->ports_refuse, true, memory_order_release);
    if (atomic_load(&self->port_count) &&
        !self->stopping) /* a port's requests in the mailboxes: answered */
        td_path_stop(self);
    self->closed = true;
    self->stopping = true; /* whatever the cause: a transport still open answers `shutdown` */
    td_path_ports_shut(self); /* what the ports posted before is ahead of the last hop */
    for (unsigned i = 0; i < self->count; i++) {
        slot_t *slot = &self->slots[i];
        if (!slot->running) { /* one shard: its handles are on this loop */
            shard_close_handles(slot);
            if (slot->loop_open) /* a shard whose thread never ran (a start that failed later) */
                uv_run(&slot->own_loop, UV_RUN_NOWAIT);
            continue;
        }
        td_hop_batch_add(&slot->to_shard, &slot->close_hop, HOP_CLOSE);
        td_mailbox_post(&slot->inbox, &slot->to_shard);
    }
    for (unsigned i = 0; i < self->count; i++) {
        slot_t *slot = &self->slots[i];
        if (!slot->running)
            continue;
        uv_thread_join(&slot->thread);
        slot->running = false; /* the loop thread owns it from here */
    }
    if (self->front_open)
        front_inbox_cb(&self->inbox.async); /* the shards' last hops (nothing is in flight) */
    for (unsigned i = 0; i < self->count; i++) /* a port's `streams` the front just answered */
        flush_to_ports(&self->slots[i]);
    close_front_port(self);
    close_front(self);
}

void td_path_destroy(td_path_t **self_p)
{
    td_path_t *self = *self_p;
    if (!self)
        return;
    for (unsigned i = 0; self->slots && i < self->count; i++) {
        slot_t *slot = &self->slots[i];
        if (!self->closed &&
            (slot->machine_open || slot->sweep_open || slot->flush_open || slot->inbox.open)) {
            shard_close_handles(slot); /* a failed start: their loops never ran */
            if (slot->loop)            /* with one shard the front's, run below */
                uv_run(slot->loop, UV_RUN_NOWAIT);
        }
        td_shard_destroy(&slot->shard);
        if (slot->loop_open && uv_loop_close(&slot->own_loop) != 0)
            td_warn("shard %u's loop still had handles open at exit", i);
        pthread_mutex_destroy(&slot->own);
    }
    if (!self->closed)
        close_front_port(self); /* a failed start */
    if (self->front_open) {
        close_front(self);
        uv_run(self->env.loop, UV_RUN_NOWAIT);
    }
    free(self->slots);
    td_path_ports_free(self);
    for (td_hop_t *hop = self->spares, *next; hop; hop = next) {
        next = hop->next;
        free(td_path_hop_request(hop));
    }
    pthread_mutex_destroy(&self->lock);
    pthread_mutex_destroy(&self->wake_mu);
    pthread_cond_destroy(&self->parked_cond);
    pthread_cond_destroy(&self->release_cond);
    free(self);
    *self_p = NULL;
}

void td_path_stop(td_path_t *self)
{
    self->stopping = true;
    for (unsigned i = 0; i < self->count; i++) {
        slot_t *slot = &self->slots[i];
        if (slot->running) /* behind the requests handed to it before */
            td_hop_batch_add(&slot->to_shard, &slot->stop_hop, HOP_STOP);
        else
            td_shard_stop(slot->shard);
    }
    flush_to_shards(self);
}

void td_path_drain_over(td_path_t *self)
{
    self->drain_expired = true;
    atomic_store_explicit(&self->ports_refuse, true, memory_order_release);
}

bool td_path_stopping(const td_path_t *self)
{
    return self->stopping;
}

unsigned td_path_inflight(const td_path_t *self)
{
    return (unsigned)(self->dispatched - self->replied) + td_path_ports_inflight(self);
}

unsigned td_path_shard_count(const td_path_t *self)
{
    return self->count;
}

void td_path_shard_gauges(td_path_t *self, unsigned shard, td_shard_gauges_t *out)
{
    slot_t *slot = &self->slots[shard];
    uint64_t now = uv_hrtime();
    /* A shard's thread sleeps outside libuv (shard_main): its own count; one shard runs on the
     * front's loop, which libuv counts. */
    uint64_t idle = self->threads ? atomic_load_explicit(&slot->asleep_ns, memory_order_relaxed)
                                  : (slot->loop ? uv_metrics_idle_time(slot->loop) : 0);
    uint64_t alive = slot->start_ns && now > slot->start_ns ? now - slot->start_ns : 0;
    *out = (td_shard_gauges_t){
        .requests = td_metrics_answered(&slot->metrics),
        .inflight = (unsigned)(slot->dispatched - slot->replied),
        .queued = td_sched_queued(td_shard_sched(slot->shard)),
        .streams = td_streams_part_count(td_shard_streams(slot->shard)),
        .busy_s = alive > idle ? (double)(alive - idle) / 1e9 : 0,
    };
}

void td_path_sum_metrics(td_path_t *self, td_metrics_t *out)
{
    *out = *self->env.metrics;
    for (unsigned i = 0; i < self->count; i++)
        td_metrics_add(out, &self->slots[i].metrics);
}

unsigned td_path_queued(td_path_t *self)
{
    unsigned queued = 0;
    for (unsigned i = 0; i < self->count; i++)
        queued += td_sched_queued(td_shard_sched(self->slots[i].shard));
    return queued;
}
