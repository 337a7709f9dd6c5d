/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_shard.c — one shard of the request path, from a request the front handed over to its reply
 * (td_shard.h).
 *
 * Design
 * ------
 * Everything here runs on the shard's thread, which owns its part of the stream table, its
 * counters and its scheduler's queues, so nothing of that needs a lock. td_shard_take finishes a
 * request the front identified: its header decoded and validated (proto/), the payload checked
 * on its size before it is taken
 * (an oversize one is never copied), the per-connection limits met, a shared-memory reference
 * resolved. Then dispatch answers it at once (ping; info, stats and streams through the front,
 * which holds every shard still while it reads them) or hands it to the scheduler (td_sched.h),
 * which calls back here (sched_*) to fold a result into its stream, run a query, reset or delete,
 * send a reply and forget a deleted stream.
 *
 * Ordering: requests on one named stream apply in arrival order (the stream's FIFO in
 * td_sched.c; they all come to this shard, in the order the front read them): on the GPU they
 * are pipelined on the stream's lane, which completes them in order; on the CPU they run one at a
 * time; requests without a stream run concurrently. Replies are matched to requests by
 * request_id, so they may leave in a different order than requests arrived.
 *
 * Shared memory: a filter, scan or hist with TALLY_FLAG_SHM_REF carries a reference instead of
 * its batch; it is resolved against the regions its sender registered over the side channel
 * (td_shm.h: the region table is shared by the shards, read-mostly, under its own lock), and from
 * then on the request's payload simply points into the producer's mapping (and out_ptr at its
 * output range), so the executor and backends need nothing else. The request holds the regions
 * until its reply is handed to its transport.
 *
 * Who may change a stream: on a fleet worker ([nats] servers set), only the fleet's own transport
 * (td_transport_t.owns_streams): a ZeroMQ, shared-memory or HTTP request on a stream other than a
 * query is answered not_permitted unless [nats] local_writes is on, so that nothing beside its
 * partition's messages changes a fleet's stream (PROTOCOL.md §13 "Security").
 *
 * Bounded memory: every request counts against max_inflight from the moment the front reads it
 * until its reply is back on the front's thread (td_path.c counts both), or, from a port (a
 * transport's own thread: td_path_port.c), until that thread has taken its reply. Sizes are checked
 * here, not by the transport: a payload over max_batch gets too_large like any other bad request.
 *
 * Replicated durability (direct mode, td_route_t.hold): a routed write that succeeded (or was
 * refused `duplicate`, td_route_t.last) is held at reply() instead of leaving (its input released,
 * its in-flight slot kept) until the route has its change durable; the route wakes the shards
 * (td_path_wake_held, any thread) and each looks at its held replies in order
 * (td_shard_release_held): settled ones leave, as they are or as the error the route says
 * (not_durable).
 *
 * The end of every request is reply(): its in-flight slot, its reply handed back with the reply
 * bytes counted (td_reply.h); the transport ends it (td_reply_end, on the front's thread: sent, or
 * dropped and counted there, and the request kept for reuse or freed; td_path.c).
 */
#include <inttypes.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "td_admit.h"
#include "td_log.h"
#include "td_ops.h"
#include "td_shard.h"

struct td_shard {
    td_shard_env_t env;
    td_admit_t admit; /* the reply bounds, the refusals' counts */
    td_sched_t *sched;
    td_shm_t *shm;    /* NULL when off */
    td_route_t route; /* direct mode's owner check (admit NULL: none) */
    bool stopping; /* a stop signal arrived: start nothing new, answer `shutdown` */
    /* Replicated durability: replies that wait for the route (linked by next, in reply order). */
    td_request_t *held_head, *held_tail;
};

/* ---- Replies ---------------------------------------------------------------------------- */

/* The end of every request: its in-flight slot and its counts, then its reply, handed to the
 * front for its transport with its input freed (a reply the transport keeps holds only itself).
 * Counted here, not when the transport is done with it: a client that has its reply and asks for
 * `stats` finds it counted, whichever shard ran it. */
static void reply(td_shard_t *p, td_request_t *r);

/* Replicated durability: a `duplicate` waits, as its first try's reply did, until the stream's
 * last record is stored (the route's last); one whose record failed is answered as that write
 * would be (not_durable: sent again), and one whose record is stored goes at once. */
static bool duplicate_waits(td_shard_t *p, td_request_t *r)
{
    if (!p->route.last(p->route.ctx, &r->req, r->stream, &r->held_ticket))
        return false;
    char msg[TALLY_ERROR_MESSAGE_MAX + 1] = "";
    bool pending = false;
    tally_status_t st =
        p->route.settled(p->route.ctx, &r->req, r->held_ticket, &pending, msg, sizeof msg);
    if (!pending && st != TALLY_OK)
        td_request_fail(r, st, "%s", msg);
    return pending;
}

/* Replicated durability: a write that succeeded waits until the route has its change durable
 * (td_route_t.hold); it stays counted in flight, and its partition's, meanwhile. True when held. */
static bool held(td_shard_t *p, td_request_t *r)
{
    if (!r->routed || !p->route.hold || r->held)
        return false;
    td_stream_t *stream = r->req.opcode == TALLY_OP_DELETE ? NULL : r->stream;
    if (r->rep.status == TALLY_E_DUPLICATE) {
        if (!duplicate_waits(p, r))
            return false;
    } else if (r->rep.status != TALLY_OK ||
               !p->route.hold(p->route.ctx, &r->req, stream, &r->held_ticket))
        return false;
    r->held = true;
    td_request_release_input(r); /* applied: only its reply is kept */
    r->next = NULL;
    if (p->held_tail)
        p->held_tail->next = r;
    else
        p->held_head = r;
    p->held_tail = r;
    return true;
}

void td_shard_release_held(td_shard_t *p)
{
    td_request_t **at = &p->held_head, *last = NULL;
    while (*at) {
        td_request_t *r = *at;
        char msg[TALLY_ERROR_MESSAGE_MAX + 1] = "";
        bool pending = false;
        tally_status_t st =
            p->route.settled(p->route.ctx, &r->req, r->held_ticket, &pending, msg, sizeof msg);
        if (pending) {
            last = r;
            at = &r->next;
            continue;
        }
        *at = r->next;
        if (st != TALLY_OK)
            td_request_fail(r, st, "%s", msg);
        reply(p, r);
    }
    p->held_tail = last;
}

static void reply(td_shard_t *p, td_request_t *r)
{
    if (held(p, r))
        return;
    if (r->routed) { /* its partition may be given up once nothing of it is in flight */
        r->routed = false;
        p->route.done(p->route.ctx, &r->req, (tally_status_t)r->rep.status);
    }
    if (r->body_unwanted && r->rep.status == TALLY_OK)
        td_request_drop_reply(r); /* applied: its transport reads the header alone */
    uint64_t now = uv_hrtime();
    td_metrics_observe(p->env.metrics, r->req.opcode, (tally_status_t)r->rep.status, r->payload_len,
                       r->reply_len, now - r->received_ns);
    if (r->where.gpu) { /* where its time went (the last stage, to the front, is the front's) */
        r->gpu_stamp[TD_GPU_STAGE_APPLY] = now;
        td_metrics_gpu_stages(p->env.metrics, r->gpu_stamp, r->received_ns, TD_GPU_STAGE_SUBMIT,
                              TD_GPU_STAGE_APPLY);
    }
    td_sched_answered(p->sched);
    td_request_release_input(r);
    td_replies_hand(p->env.replies, r);
    r->out.to = (td_sender_t){.id = r->identity,
                              .id_len = r->identity_len,
                              .word = r->transport_word,
                              .ctx = r->transport_ctx};
    r->out.peer_name = r->conn ? td_peer_name(r->conn) : "";
    r->out.next = NULL;
    p->env.reply(p->env.front, r);
}

void td_shard_resume(td_shard_t *self, td_request_t *r)
{
    reply(self, r);
}

/* ---- What the scheduler asks of the shard (td_sched.h) ------------------------------------ */

/* A compute request's result: folded into its stream (and the stream's window ring), answered. */
static bool sched_complete(void *owner, td_request_t *r)
{
    td_shard_t *p = owner;
    bool applied = td_request_apply(r);
    if (applied && r->stream)
        r->stream->updated_ms = td_clock_ms(); /* the web page's "last update" */
    reply(p, r);
    return applied;
}

/* query, reset or delete, on a stream whose earlier requests are done. A reset zeroes the stream
 * and keeps it (td_stream_zero); a delete clears it, and td_sched forgets its name. */
static void sched_control(void *owner, td_request_t *r, td_stream_t *stream)
{
    td_shard_t *p = owner;
    switch (r->req.opcode) {
    case TALLY_OP_QUERY:
        td_op_query(p->env.cfg, r, stream);
        return;
    case TALLY_OP_RESET:
        td_stream_zero(stream);
        stream->updated_ms = td_clock_ms();
        break;
    default: /* TALLY_OP_DELETE */
        if (p->env.deleted)
            p->env.deleted(p->env.front, stream->name, stream->name_len);
        td_stream_clear(stream);
        stream->pub_dirty = false;
        break;
    }
    td_request_succeed(r, TALLY_DTYPE_NONE, NULL, 0, 0);
}

static void sched_answer(void *owner, td_request_t *r)
{
    reply(owner, r);
}

/* A deleted stream, or one whose creating request failed (td_stream_t's life): the latter gives
 * its client the stream and the creation token back, as if it had never been made. */
static void sched_forget(void *owner, td_stream_t *stream)
{
    td_shard_t *p = owner;
    td_peer_t *client = stream->owner;
    if (client && stream->life == TD_STREAM_NEW) /* it was never used: PROTOCOL.md §8 */
        td_peer_give_token(p->env.peers, client);
    td_streams_remove(p->env.streams, &stream); /* its bytes leave the client's count */
    if (client)
        td_peer_give_stream(client);
    td_peers_release(p->env.peers, &client);
}

void td_shard_finished(td_shard_t *self, td_request_t *r)
{
    td_sched_finished(self->sched, r);
}

/* ---- Dispatch ----------------------------------------------------------------------------- */

/* A filter, scan or hist names a stream that does not exist yet: its seq (a gap needs none of
 * the limits), its client's stream count and creation rate, then the global max_streams. Each
 * limit is taken as it is checked and given back when a later one refuses (the shards share
 * them). Returns false when the request was failed. */
static bool create_stream(td_shard_t *p, td_request_t *r, td_stream_t **out)
{
    const tally_req_t *q = &r->req;
    td_peer_t *client = r->client;
    unsigned per_client = td_config_streams_per_client(p->env.cfg), held = 0;
    if (!td_request_seq_opens(r))
        return false;
    if (client && !td_peer_take_stream(client, per_client, &held)) {
        td_admit_count_limited(&p->admit, r, TD_LIMIT_STREAMS);
        td_request_fail(r, TALLY_E_CLIENT_STREAMS,
                        "this client already holds %u streams (max_streams_per_client %u); "
                        "delete one it no longer needs",
                        held, per_client);
        return false;
    }
    if (client && !td_peer_take_token(p->env.peers, client, uv_hrtime())) {
        td_peer_give_stream(client);
        td_admit_count_limited(&p->admit, r, TD_LIMIT_RATE);
        td_request_fail(r, TALLY_E_RATE,
                        "this client creates streams faster than stream_create_rate (%u per "
                        "second); retry later",
                        p->env.cfg->stream_create_rate);
        return false;
    }
    char msg[TALLY_ERROR_MESSAGE_MAX];
    tally_status_t st =
        td_streams_create(p->env.streams, q->stream, q->stream_len, client, msg, sizeof msg, out);
    if (st == TALLY_E_CLIENT_STREAMS)
        td_admit_count_limited(&p->admit, r, TD_LIMIT_STREAMS);
    if (st != TALLY_OK) {
        if (client) { /* a refused request uses none of the creation rate (PROTOCOL.md §8) */
            td_peer_give_stream(client);
            td_peer_give_token(p->env.peers, client);
        }
        td_request_fail(r, st, "cannot create stream '%s': %s", q->stream, msg);
        return false;
    }
    if (client)
        td_peer_hold(client);     /* the stream's reference to it */
    (*out)->life = TD_STREAM_NEW; /* until a request is applied to it (td_sched.c) */
    return true;
}

/* ping is answered here, at once; info, stats and streams by the front, from the whole daemon
 * (it gives r back through td_shard_resume). False when r went to the front. */
static bool answer_now(td_shard_t *p, td_request_t *r)
{
    switch (r->req.opcode) {
    case TALLY_OP_INFO:
    case TALLY_OP_STATS:
    case TALLY_OP_STREAMS:
        p->env.gather(p->env.front, r);
        return false;
    default: /* TALLY_OP_PING */
        td_request_succeed(r, TALLY_DTYPE_NONE, NULL, 0, 0);
        return true;
    }
}

/* By the operation's row (tally_ops.h): a batch goes to the scheduler with its stream (made by
 * its first batch), a query, reset or delete waits for its stream, the rest is answered now. */
static void dispatch(td_shard_t *p, td_request_t *r)
{
    const tally_req_t *q = &r->req;
    const tally_op_info_t *op = tally_op_info(q->opcode);
    td_stream_t *stream =
        q->stream_len ? td_streams_find(p->env.streams, q->stream, q->stream_len) : NULL;
    if ((op->batch && (stream || !q->stream_len || create_stream(p, r, &stream))) ||
        (!op->batch && stream)) {
        td_sched_arrived(p->sched, r, stream);
        return;
    }
    if (!op->batch && op->stream == TALLY_STREAM_REQUIRED)
        td_request_fail(r, TALLY_E_UNKNOWN_STREAM, "no stream named '%s'", q->stream);
    else if (!op->batch && !answer_now(p, r))
        return;
    reply(p, r);
}

/* ---- Taking a request --------------------------------------------------------------------- */

/* A request whose payload is a shared-memory reference: checks it and points the request's
 * payload (and output) into the regions, which it references until it is destroyed. */
static tally_status_t resolve_shm_ref(td_shard_t *p, td_request_t *r, char *msg, size_t cap)
{
    tally_shm_ref_t ref;
    tally_status_t st = tally_shm_ref_decode(r->payload, r->payload_len, &ref, msg, cap);
    if (st == TALLY_OK)
        st = tally_shm_ref_validate(&r->req, &ref, p->env.cfg->max_batch, msg, cap);
    uint8_t *in = r->shm_in_ptr, *out = r->shm_out_ptr;
    bool pinned = r->shm_in != NULL; /* the front resolved them as it read r (td_path.c) */
    if (st == TALLY_OK && !pinned)
        st = td_shm_resolve(p->shm, r->identity, r->identity_len, ref.in_handle, ref.in_offset,
                            ref.in_length, false, &r->shm_in, &in, msg, cap);
    if (st == TALLY_OK && !pinned && ref.out_handle)
        st = td_shm_resolve(p->shm, r->identity, r->identity_len, ref.out_handle, ref.out_offset,
                            ref.out_length, true, &r->shm_out, &out, msg, cap);
    if (st != TALLY_OK)
        return st;
    r->payload = in;
    r->payload_len = (size_t)ref.in_length;
    r->out_ptr = out;
    p->env.metrics->shm_requests++;
    return TALLY_OK;
}

/* Stopping: every request is answered `shutdown`, whatever it holds (the header was decoded
 * only to echo its id). One that names a stream with requests still waiting or running queues
 * behind them, so that stream's replies keep their order. */
static void answer_stopping(td_shard_t *p, td_request_t *r)
{
    bool decoded = r->decoded && r->frames == 2;
    td_request_fail(r, TALLY_E_SHUTDOWN, "tallyd is shutting down; not run");
    td_stream_t *stream = decoded && r->req.stream_len
                              ? td_streams_find(p->env.streams, r->req.stream, r->req.stream_len)
                              : NULL;
    td_sched_arrived(p->sched, r, stream);
}

/* On a fleet worker a stream changes only through its partition (PROTOCOL.md §13 "Security"):
 * a request of another transport that would change one (any operation on a stream but a query)
 * is refused, unless [nats] local_writes is on. True when r was failed. */
static bool refused_on_worker(const td_shard_t *p, td_request_t *r)
{
    const td_config_t *cfg = p->env.cfg;
    if (!cfg->nats_servers || cfg->nats_local_writes || p->route.admit ||
        r->transport->owns_streams || !r->req.stream_len || r->req.opcode == TALLY_OP_QUERY)
        return false;
    td_request_fail(r, TALLY_E_NOT_PERMITTED,
                    "stream %.*s is a fleet's: on a worker it changes only through its partition "
                    "(tally.in.<k>); [nats] local_writes = on lets other clients change streams",
                    (int)r->req.stream_len, r->req.stream);
    return true;
}

/* Direct mode: a request on a stream whose partition this member does not own is answered by
 * the route (`not_owner`); one it owns runs, and the route hears of its end. True when r was
 * failed. */
static bool routed_elsewhere(td_shard_t *p, td_request_t *r, char *msg, size_t cap)
{
    if (!p->route.admit || r->transport->owns_streams || !r->req.stream_len)
        return false;
    tally_status_t st = p->route.admit(p->route.ctx, &r->req, msg, cap);
    if (st != TALLY_OK) {
        td_request_fail(r, st, "%s", msg);
        return true;
    }
    r->routed = true;
    return false;
}

/* A request with a valid header: its payload checked on its size before it is taken (an
 * oversize one is never copied), the per-connection limits, then the payload taken (and a
 * shared-memory reference resolved from it). False when r was failed. */
static bool take_request(td_shard_t *p, td_request_t *r, char *msg, size_t cap)
{
    r->payload_len = r->arrived.len;
    tally_status_t st =
        tally_req_validate(&r->req, r->payload_len, p->env.cfg->max_batch, msg, cap);
    if (st != TALLY_OK) {
        td_request_fail(r, st, "%s", msg);
        return false;
    }
    if (routed_elsewhere(p, r, msg, cap) || refused_on_worker(p, r))
        return false;
    if (td_admit_over_share(&p->admit, r))
        return false;
    st = td_request_take_payload(r, &r->arrived);
    if (st != TALLY_OK) {
        td_request_fail(r, st, "out of memory for a payload of %zu bytes", r->payload_len);
        return false;
    }
    /* After the take: the reference is decoded from the taken payload, which then points into
     * the producer's region instead. */
    if ((r->req.flags & TALLY_FLAG_SHM_REF) && (st = resolve_shm_ref(p, r, msg, cap)) != TALLY_OK) {
        td_request_fail(r, st, "%s", msg);
        return false;
    }
    return !td_admit_over_reply_bound(&p->admit, r);
}

/* The message's frame count and header (decode failed r if it did not decode), then the
 * request itself (take_request). True when r may go on to dispatch; false when
 * it was failed, to be answered. */
static bool check_message(td_shard_t *p, td_request_t *r, char *msg, size_t cap)
{
    if (r->frames != 2) {
        td_request_fail(r, TALLY_E_FRAMES,
                        "a request is 2 frames (header, payload) after the routing envelope; "
                        "this message has %d",
                        r->frames);
        return false;
    }
    return r->decoded && take_request(p, r, msg, cap);
}

/* Decoded even when the frame count is wrong, so that every reply echoes the first request
 * frame's opcode, flags and id (§3); with no request frame at all they stay 0. A header that
 * does not decode fails r (check_message answers it). One its transport decoded (td_msg_t's
 * req) is not decoded again. */
static void decode(td_request_t *r)
{
    char msg[TALLY_ERROR_MESSAGE_MAX + 1];
    tally_status_t st = r->decoded ? TALLY_OK
                                   : tally_req_decode(r->has_header ? r->header : NULL,
                                                      r->header_len, &r->req, msg, sizeof msg);
    r->rep.opcode = r->req.opcode;
    r->rep.flags = r->req.flags;
    r->rep.request_id = r->req.request_id;
    r->decoded = st == TALLY_OK;
    if (!r->decoded)
        td_request_fail(r, st, "%s", msg);
}

void td_shard_take(td_shard_t *p, td_request_t *r)
{
    td_sched_received(p->sched);
    decode(r);
    char msg[TALLY_ERROR_MESSAGE_MAX + 1];
    if (p->stopping) {
        answer_stopping(p, r);
    } else if (check_message(p, r, msg, sizeof msg)) {
        dispatch(p, r);
    } else {
        td_debug("request %" PRIu64 " answered %s", r->rep.request_id,
                 tally_status_name((tally_status_t)r->rep.status));
        reply(p, r); /* its input, taken or not, was released there (r may be gone now) */
    }
}

/* ---- Life cycle ------------------------------------------------------------------------------ */

td_err_t td_shard_new(const td_shard_env_t *env, td_shard_t **out)
{
    td_shard_t *p = calloc(1, sizeof *p);
    if (!p)
        return TD_ERR_NOMEM;
    p->env = *env;
    p->admit = (td_admit_t){
        .cfg = env->cfg, .peers = env->peers, .replies = env->replies, .metrics = env->metrics};
    *out = p;
    return TD_OK;
}

td_err_t td_shard_start(td_shard_t *self, const td_sched_machine_t *machine)
{
    td_sched_host_t host = {.owner = self,
                            .shard = self->env.index,
                            .complete = sched_complete,
                            .control = sched_control,
                            .answer = sched_answer,
                            .forget = sched_forget};
    return td_sched_new(self->env.cfg, self->env.metrics, machine, &host, &self->sched);
}

void td_shard_attach(td_shard_t *self, td_shm_t *shm,
                     void (*deleted)(void *front, const char *name, size_t name_len))
{
    self->shm = shm;
    self->env.deleted = deleted;
}

void td_shard_attach_route(td_shard_t *self, const td_route_t *route)
{
    self->route = *route;
}

void td_shard_destroy(td_shard_t **self_p)
{
    td_shard_t *self = *self_p;
    if (!self)
        return;
    td_sched_destroy(&self->sched);
    free(self);
    *self_p = NULL;
}

void td_shard_stop(td_shard_t *self)
{
    self->stopping = true;
    td_sched_stop(self->sched); /* answers what waits on a stream, in each stream's order */
}

td_sched_t *td_shard_sched(const td_shard_t *self)
{
    return self->sched;
}

td_metrics_t *td_shard_metrics(const td_shard_t *self)
{
    return self->env.metrics;
}

td_streams_t *td_shard_streams(const td_shard_t *self)
{
    return self->env.streams;
}
