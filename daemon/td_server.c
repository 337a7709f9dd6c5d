/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_server.c — the loop thread: ZeroMQ in, backends, ZeroMQ out.
 *
 * Design
 * ------
 * One libuv loop thread owns the ROUTER socket and every piece of shared state (the stream
 * table, the metrics, the scheduler's queues). The scheduler (td_sched.h) decides when and where
 * a request runs; compute work goes to the executor (td_exec.h: the CPU on libuv's worker pool,
 * or the GPU pipeline of td_gpu.h) and comes back to the loop thread through exec_done, so
 * nothing here needs a lock. The server reads, validates and answers; the scheduler calls back
 * into it (sched_*) to fold a result into its stream, run a query, reset or delete, send a reply
 * and forget a deleted stream. Beside it, leaf parts that call nothing here: td_router (opening
 * the socket), td_admit (who sent a request, the per-connection limits), td_ops (info, streams,
 * query) and td_reply (sending replies, the bytes unread replies hold).
 *
 * ZeroMQ's ZMQ_FD is edge-triggered: it signals when the socket's state changes, and only
 * after ZMQ_EVENTS has been read. So the socket is serviced by one function, pump(), called
 * from the uv_poll callback AND from a uv_check handle after every loop iteration (completions
 * arrive through libuv's async wake-up, not through the fd). pump() reads messages until
 * EAGAIN (or the in-flight limit, or a fairness budget), and re-reads ZMQ_EVENTS last. Every
 * send happens in a callback of the loop, and the check handle runs after every iteration's
 * callbacks, so a send is always followed by a ZMQ_EVENTS read before the loop blocks: no
 * wake-up is lost. If input remains that pump() chose not to read yet, a uv_idle handle keeps
 * the loop from blocking in poll so the next iteration continues; otherwise the loop sleeps
 * until the fd or a completion wakes it.
 *
 * Ordering: requests on one named stream apply in arrival order (the stream's FIFO in
 * td_sched.c): on the GPU they are pipelined on the stream's lane, which completes them in
 * order; on the CPU they run one at a time; requests without a stream run concurrently. Replies are
 * matched to requests by request_id, so they may leave in a different order than requests arrived.
 *
 * Shared memory: a filter, scan or hist with TALLY_FLAG_SHM_REF carries a reference instead of
 * its batch; handle_message resolves it against the regions producers registered over the side
 * channel (td_shm.h, also served on this loop), and from then on the request's payload simply
 * points into the producer's mapping (and out_ptr at its output range), so the executor and
 * backends need nothing else. The request holds the regions until it is destroyed.
 *
 * Bounded memory: every request counts against max_inflight from the moment it is read until
 * its reply is handed to ZeroMQ (or dropped) (td_sched_received/answered). At the limit pump()
 * stops reading, ZeroMQ's receive high-water mark fills and TCP pushes back: nothing is lost. Sizes
 * are checked here, not by ZeroMQ: a payload over max_batch gets too_large like any other bad
 * request; only a frame over max_frame (far above max_batch) makes ZeroMQ drop the connection
 * (the replies to its earlier requests are then kept for it to reconnect: td_reply.h).
 *
 * A reply never waits for a connected peer. ROUTER_MANDATORY is on, so a send fails at once when
 * the peer has gone (EHOSTUNREACH) or stopped reading and filled its send high-water mark
 * (EAGAIN); a reply to a peer that does not read is dropped and counted, and its in-flight slot
 * freed. Queueing it instead would let one peer that never reads hold every slot and stop tallyd
 * serving anyone. What unread replies hold in bytes is bounded, and a reply to a connection that
 * has closed is kept a while for it to come back: td_reply.h.
 *
 * Stopping (SIGTERM, SIGINT): nothing new starts. Requests running on a backend finish and are
 * answered; requests waiting on a stream FIFO are answered `shutdown` in order, once the stream's
 * running requests are done; messages still queued in the socket are read and answered
 * `shutdown` for at most drain_ms. Reading ends at that deadline, or earlier once the socket is
 * empty and nothing is in flight; then the final state snapshot, then the socket closes with a
 * short linger for the last replies.
 */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>
#include <zmq.h>

#include "td_admit.h"
#include "td_auth.h"
#include "td_exec.h"
#include "td_fleet_status.h"
#include "td_log.h"
#include "td_metrics.h"
#include "td_pub.h"
#include "td_peers.h"
#include "td_ops.h"
#include "td_reply.h"
#include "td_router.h"
#include "td_request.h"
#include "td_server.h"
#include "td_sched.h"
#include "td_service.h"
#include "td_shm.h"
#include "td_stream.h"
#include "tk_backend.h"

/* Messages read per pump() before giving the rest of the loop a turn. */
#define TD_READ_BUDGET 256
/* Frames of one message kept for inspection: identity, delimiter, header, payload. Frames
 * beyond these are counted (to reject the message) and released at once. */
#define TD_FRAMES_KEPT 4
/* How long zmq_close may keep flushing the last replies at shutdown: ZeroMQ writes a reply to a
 * peer that reads at once, so this is only spent on a peer that does not read, which must not
 * hold tallyd up for long. */
#define TD_SHUTDOWN_LINGER_MS 1000

struct td_server {
    /* A copy; binds and strings are borrowed from the caller's config, except the ones a reload
     * replaces (the allowed CURVE keys), which the server owns (own_reloadable_strings). */
    td_config_t cfg;
    uv_loop_t loop;
    td_router_t zmq; /* the context, the ROUTER socket, CURVE */
    uv_poll_t poll;
    uv_check_t check;
    uv_idle_t idle;
    uv_signal_t sig_int;
    uv_signal_t sig_term;
    uv_signal_t sig_hup;
    uv_timer_t drain_timer; /* the end of reading after a stop signal */
    uv_timer_t quiet_timer; /* a stopping socket that stayed empty long enough */
    uv_timer_t sweep_timer; /* frees idle per-peer entries */
    uv_timer_t retry_timer; /* replies kept for connections that closed (td_reply.h) */
    uint64_t last_input_ns; /* stopping: the signal, or the last message read since */
    bool idle_active;
    bool paused;        /* reading stopped at the in-flight limit */
    bool stopping;      /* a stop signal arrived: start nothing new, answer `shutdown` */
    bool drain_expired; /* drain_ms has passed since: read nothing more */
    bool closed;        /* socket and handles closed */

    td_streams_t *streams;
    td_peers_t *peers;     /* per-connection and per-client limits */
    td_replies_t *replies; /* what unread replies hold; lives until after zmq_ctx_term */
    td_admit_t admit;      /* who sent a request, and its per-connection limits */
    tk_backend_t *cpu;     /* the CPU backend; the GPU runs through the executor's pipeline */
    td_exec_t *exec;       /* where compute requests run: CPU workers or the GPU pipeline */
    td_sched_t *sched;     /* what runs when and where; the in-flight count */
    td_shm_t *shm;         /* shared-memory side channel and regions; NULL when off */
    td_pub_t *pub;         /* the PUB socket (subscriptions); NULL when off */
    char devices[256];
    td_metrics_t metrics;
    td_service_t *service; /* systemd, state persistence, HTTP metrics, reload */
    uint64_t started_ns;
    td_fleet_status_t fleet_status; /* a NATS fleet worker's info keys and metrics */
};

static void pump(td_server_t *s);
static void reply(td_server_t *s, td_request_t *r);

/* ---- Replies ---------------------------------------------------------------------------- */

/* A reply's end (sent, or dropped and counted by td_reply): its metrics and memory. */
static void retire(void *owner, td_request_t *r, td_reply_outcome_t outcome)
{
    td_server_t *s = owner;
    (void)outcome;
    td_metrics_observe(&s->metrics, r->req.opcode, (tally_status_t)r->rep.status, r->payload_len,
                       r->reply_len, uv_hrtime() - r->received_ns);
    td_peers_release(s->peers, &r->conn);
    td_peers_release(s->peers, &r->client);
    td_request_destroy(&r);
}

static void retry_cb(uv_timer_t *handle)
{
    td_server_t *s = handle->data;
    if (!td_replies_retry(s->replies, s->zmq.socket, uv_hrtime()))
        uv_timer_stop(handle);
}

/* The end of every request: its in-flight slot, then its reply: sent, kept a while for a
 * connection that has closed (td_reply.h; retried on a timer), or dropped. */
static void reply(td_server_t *s, td_request_t *r)
{
    td_sched_answered(s->sched);
    td_admit_answered(&s->admit, r);
    if (r->done) { /* another transport's request (td_service_host_t.submit) */
        r->done(r->done_arg, &r->rep, r->reply_data, r->reply_len);
        retire(s, r, TD_REPLY_SENT);
        return;
    }
    td_reply_outcome_t outcome = td_replies_send(s->replies, s->zmq.socket, r);
    if (outcome != TD_REPLY_KEPT) {
        retire(s, r, outcome);
        return;
    }
    if (!uv_is_active((uv_handle_t *)&s->retry_timer) &&
        uv_timer_start(&s->retry_timer, retry_cb, TD_REPLY_RETRY_MS, TD_REPLY_RETRY_MS) != 0)
        td_replies_close(s->replies); /* cannot happen; without retries nothing may wait */
}

/* ---- Operations answered on the loop thread (td_ops.h) ---------------------------------- */

static void op_info(td_server_t *s, td_request_t *r)
{
    char gpu_uuids[1024];
    td_exec_gpu_uuids(s->exec, gpu_uuids, sizeof gpu_uuids);
    td_info_t info = {.cfg = &s->cfg,
                      .backend = td_exec_backend_name(s->exec),
                      .backends = td_exec_backends(s->exec),
                      .devices = td_exec_devices(s->exec),
                      .shm_path = s->shm ? td_shm_path(s->shm) : NULL,
                      .pub_endpoint = s->pub ? td_pub_endpoint(s->pub) : NULL,
                      .gpu_uuids = gpu_uuids,
                      .curve = s->zmq.auth != NULL,
                      .fleet = &s->fleet_status};
    td_op_info(&info, r);
}

/* The gauges `stats`, GET /metrics and the systemd status line report. */
static void sample_gauges(void *ctx, td_gauges_t *g)
{
    td_server_t *s = ctx;
    *g = (td_gauges_t){
        .inflight = td_sched_inflight(s->sched),
        .max_inflight = s->cfg.max_inflight,
        .queued = td_sched_queued(s->sched),
        .stream_count = td_streams_count(s->streams),
        .state_bytes = td_streams_bytes(s->streams),
        .state_bytes_max = s->cfg.max_state_bytes,
        .stopping = s->stopping,
        .gpus_lost = td_exec_devices_lost(s->exec),
        .pub_messages = td_pub_messages(s->pub),
        .pub_failed = td_pub_failed(s->pub),
        .streams = s->streams,
        .metrics_streams = s->cfg.metrics_streams,
        .metrics_histogram_buckets = s->cfg.metrics_histogram_buckets,
        .backend = td_exec_backend_name(s->exec),
        .devices = td_exec_devices(s->exec),
        .device_memory_bytes = td_exec_device_bytes(s->exec),
        .uptime_s = (double)(uv_hrtime() - s->started_ns) / 1e9,
        .peers = td_peers_count(s->peers),
        .users = s->zmq.auth ? s->peers : NULL,
        .fleet = &s->fleet_status,
    };
    td_replies_gauges(s->replies, g);
    if (s->zmq.auth) {
        g->curve = true;
        td_auth_counts(s->zmq.auth, &g->auth);
    }
    td_shm_gauges(s->shm, &g->shm_regions, &g->shm_bytes);
}

static tally_status_t host_view(void *ctx, const td_stream_t *stream, uint64_t window_ms,
                                tally_stream_info_t *out, uint64_t *start_ms, uint64_t *end_ms,
                                char *msg, size_t msg_cap);
static void host_submit(void *ctx, const tally_req_t *req, td_reply_fn done, void *arg);

static td_service_host_t service_host(td_server_t *s)
{
    return (td_service_host_t){.loop = &s->loop,
                               .cfg = &s->cfg,
                               .streams = s->streams,
                               .metrics = &s->metrics,
                               .gauges = sample_gauges,
                               .view = host_view,
                               .submit = host_submit,
                               .ctx = s};
}

static void op_stats(td_server_t *s, td_request_t *r)
{
    td_service_host_t host = service_host(s);
    char *text = NULL;
    size_t len = 0;
    if (td_service_render_metrics(&host, &text, &len) != TD_OK) {
        td_request_fail(r, TALLY_E_INTERNAL, "out of memory");
        return;
    }
    td_request_succeed(r, TALLY_DTYPE_TEXT, text, len, len);
}

/* A stream's record for the HTTP API (td_service_host_t.view): `query`'s, through td_ops.c. */
static tally_status_t host_view(void *ctx, const td_stream_t *stream, uint64_t window_ms,
                                tally_stream_info_t *out, uint64_t *start_ms, uint64_t *end_ms,
                                char *msg, size_t msg_cap)
{
    td_server_t *s = ctx;
    return td_op_view(&s->cfg, stream, window_ms, out, start_ms, end_ms, msg, msg_cap);
}

/* ---- What the scheduler asks of the server (td_sched.h) ---------------------------------- */

/* A compute request's result: folded into its stream (and the stream's window ring), answered. */
static bool sched_complete(void *owner, td_request_t *r)
{
    td_server_t *s = owner;
    bool applied = td_request_apply(r);
    if (applied && r->stream)
        r->stream->updated_ms = td_clock_ms(); /* the web page's "last update" */
    reply(s, r);
    return applied;
}

/* query, reset or delete, on a stream whose earlier requests are done. A reset zeroes the stream
 * and keeps it (td_stream_zero); a delete clears it, and td_sched forgets its name. */
static void sched_control(void *owner, td_request_t *r, td_stream_t *stream)
{
    td_server_t *s = owner;
    switch (r->req.opcode) {
    case TALLY_OP_QUERY:
        td_op_query(&s->cfg, r, stream);
        return;
    case TALLY_OP_RESET:
        td_stream_zero(stream);
        stream->updated_ms = td_clock_ms();
        break;
    default: /* TALLY_OP_DELETE */
        if (s->pub)
            td_pub_deleted(s->pub, stream->name, stream->name_len);
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
    td_server_t *s = owner;
    td_peer_t *client = stream->owner;
    if (client && stream->life == TD_STREAM_NEW) /* it was never used: PROTOCOL.md §8 */
        td_peer_give_token(s->peers, client);
    td_streams_remove(s->streams, &stream); /* its bytes leave the client's count */
    if (client)
        td_peer_stream_removed(client);
    td_peers_release(s->peers, &client);
}

/* The executor (td_exec.h) hands every compute request back here, on the loop thread. */
static void exec_done(void *owner, td_request_t *r)
{
    td_server_t *s = owner;
    td_sched_finished(s->sched, r);
}

/* A filter, scan or hist names a stream that does not exist yet: its client's stream count and
 * creation rate, then the global max_streams. Returns false when the request was failed. */
static bool create_stream(td_server_t *s, td_request_t *r, td_stream_t **out)
{
    const tally_req_t *q = &r->req;
    td_peer_t *client = r->client;
    unsigned per_client = td_config_streams_per_client(&s->cfg);
    if (client && td_peer_streams(client) >= per_client) {
        td_admit_count_limited(&s->admit, r, TD_LIMIT_STREAMS);
        td_request_fail(r, TALLY_E_CLIENT_STREAMS,
                        "this client already holds %u streams (max_streams_per_client %u); "
                        "delete one it no longer needs",
                        td_peer_streams(client), per_client);
        return false;
    }
    if (client && !td_peer_take_token(s->peers, client, uv_hrtime())) {
        td_admit_count_limited(&s->admit, r, TD_LIMIT_RATE);
        td_request_fail(r, TALLY_E_RATE,
                        "this client creates streams faster than stream_create_rate (%u per "
                        "second); retry later",
                        s->cfg.stream_create_rate);
        return false;
    }
    char msg[TALLY_ERROR_MESSAGE_MAX];
    tally_status_t st =
        td_streams_create(s->streams, q->stream, q->stream_len, client, msg, sizeof msg, out);
    if (st == TALLY_E_CLIENT_STREAMS)
        td_admit_count_limited(&s->admit, r, TD_LIMIT_STREAMS);
    if (st != TALLY_OK) {
        if (client) /* a refused request uses none of the creation rate (PROTOCOL.md §8) */
            td_peer_give_token(s->peers, client);
        td_request_fail(r, st, "cannot create stream '%s': %s", q->stream, msg);
        return false;
    }
    if (client)
        td_peer_stream_added(client); /* and the stream's reference to it */
    (*out)->life = TD_STREAM_NEW; /* until a request is applied to it (td_sched.c) */
    return true;
}

static void dispatch(td_server_t *s, td_request_t *r)
{
    const tally_req_t *q = &r->req;
    td_stream_t *stream = NULL;
    switch (q->opcode) {
    case TALLY_OP_PING:
        td_request_succeed(r, TALLY_DTYPE_NONE, NULL, 0, 0);
        break;
    case TALLY_OP_INFO:
        op_info(s, r);
        break;
    case TALLY_OP_STATS:
        op_stats(s, r);
        break;
    case TALLY_OP_STREAMS:
        td_op_streams(s->streams, r);
        break;
    case TALLY_OP_QUERY:
    case TALLY_OP_RESET:
    case TALLY_OP_DELETE:
        stream = td_streams_find(s->streams, q->stream, q->stream_len);
        if (!stream) {
            td_request_fail(r, TALLY_E_UNKNOWN_STREAM, "no stream named '%s'", q->stream);
            break;
        }
        td_sched_arrived(s->sched, r, stream);
        return;
    default: /* filter, scan, hist; without a stream nothing to wait for */
        if (q->stream_len != 0) {
            stream = td_streams_find(s->streams, q->stream, q->stream_len);
            if (!stream && !create_stream(s, r, &stream))
                break;
        }
        td_sched_arrived(s->sched, r, stream);
        return;
    }
    reply(s, r);
}

/* ---- Reading ---------------------------------------------------------------------------- */

/* A request whose payload is a shared-memory reference: checks it and points the request's
 * payload (and output) into the regions, which it references until it is destroyed. */
static tally_status_t resolve_shm_ref(td_server_t *s, td_request_t *r, char *msg, size_t cap)
{
    tally_shm_ref_t ref;
    tally_status_t st = tally_shm_ref_decode(r->payload, r->payload_len, &ref, msg, cap);
    if (st == TALLY_OK)
        st = tally_shm_ref_validate(&r->req, &ref, s->cfg.max_batch, msg, cap);
    uint8_t *in = NULL, *out = NULL;
    if (st == TALLY_OK)
        st = td_shm_resolve(s->shm, r->identity, r->identity_len, ref.in_handle, ref.in_offset,
                            ref.in_length, false, &r->shm_in, &in, msg, cap);
    if (st == TALLY_OK && ref.out_handle)
        st = td_shm_resolve(s->shm, r->identity, r->identity_len, ref.out_handle, ref.out_offset,
                            ref.out_length, true, &r->shm_out, &out, msg, cap);
    if (st != TALLY_OK)
        return st;
    r->payload = in;
    r->payload_len = (size_t)ref.in_length;
    r->out_ptr = out;
    s->metrics.shm_requests++;
    return TALLY_OK;
}

/* Stopping: every message read is answered `shutdown`, whatever it holds (the header is decoded
 * only to echo its id). One that names a stream with requests still waiting or running queues
 * behind them, so that stream's replies keep their order. */
static void answer_stopping(td_server_t *s, td_request_t *r, bool decoded)
{
    td_request_fail(r, TALLY_E_SHUTDOWN, "tallyd is shutting down; not run");
    td_stream_t *stream = decoded && r->req.stream_len
                              ? td_streams_find(s->streams, r->req.stream, r->req.stream_len)
                              : NULL;
    td_sched_arrived(s->sched, r, stream);
}

/* A query, reset or delete from HTTP (td_web.c): a request like the opcode's, in the same
 * scheduler path and metrics, answered through done instead of ZeroMQ (reply). */
static void host_submit(void *ctx, const tally_req_t *req, td_reply_fn done, void *arg)
{
    td_server_t *s = ctx;
    td_request_t *r = td_request_new();
    if (!r) {
        tally_rep_t rep = {.opcode = req->opcode, .status = TALLY_E_INTERNAL};
        done(arg, &rep, "out of memory", 13);
        return;
    }
    td_sched_received(s->sched);
    r->received_ns = uv_hrtime();
    r->req = *req;
    r->rep.opcode = req->opcode;
    r->rep.flags = req->flags;
    r->done = done;
    r->done_arg = arg;
    char msg[TALLY_ERROR_MESSAGE_MAX + 1];
    tally_status_t st = tally_req_validate(&r->req, 0, s->cfg.max_batch, msg, sizeof msg);
    if (s->stopping) {
        answer_stopping(s, r, true);
    } else if (st != TALLY_OK) {
        td_request_fail(r, st, "%s", msg);
        reply(s, r);
    } else {
        dispatch(s, r);
    }
}

/* The envelope of a message into r: its sender (its routing id, and who that is) and a REQ
 * peer's delimiter: any peer's empty first frame is taken as one and echoed (PROTOCOL.md §1), a
 * header is never empty. Returns the index of the first request frame. */
static int read_envelope(td_server_t *s, td_request_t *r, zmq_msg_t *frames, int kept)
{
    size_t id_len = zmq_msg_size(&frames[0]);
    r->identity_len = id_len < TD_IDENTITY_MAX ? id_len : TD_IDENTITY_MAX;
    memcpy(r->identity, zmq_msg_data(&frames[0]), r->identity_len);
    td_admit_identify(&s->admit, r, kept > 1 ? zmq_msg_gets(&frames[kept - 1], "User-Id") : NULL);
    r->has_delimiter = kept > 1 && zmq_msg_size(&frames[1]) == 0;
    return r->has_delimiter ? 2 : 1;
}

/* A request with a valid header: its payload checked on the frame's size before it is taken (an
 * oversize one is never copied), the per-connection limits, then the payload taken (and a
 * shared-memory reference resolved from it). False when r was failed. */
static bool take_request(td_server_t *s, td_request_t *r, zmq_msg_t *payload, char *msg, size_t cap)
{
    r->payload_len = zmq_msg_size(payload);
    tally_status_t st = tally_req_validate(&r->req, r->payload_len, s->cfg.max_batch, msg, cap);
    if (st != TALLY_OK) {
        td_request_fail(r, st, "%s", msg);
        return false;
    }
    if (td_admit_over_share(&s->admit, r))
        return false;
    st = td_request_take_payload(r, payload);
    if (st != TALLY_OK) {
        td_request_fail(r, st, "out of memory for a payload of %zu bytes", r->payload_len);
        return false;
    }
    /* After the take: the reference is decoded from the taken payload, which then points into
     * the producer's region instead. */
    if ((r->req.flags & TALLY_FLAG_SHM_REF) && (st = resolve_shm_ref(s, r, msg, cap)) != TALLY_OK) {
        td_request_fail(r, st, "%s", msg);
        return false;
    }
    return !td_admit_over_reply_bound(&s->admit, r);
}

/* Turns one received message (frames[0..kept) of `total`) into a request and dispatches it,
 * or answers it with an error. */
static void handle_message(td_server_t *s, zmq_msg_t *frames, int kept, int total)
{
    td_request_t *r = td_request_new();
    if (!r) {
        td_err("out of memory: dropping a message of %d frames", total);
        return;
    }
    td_sched_received(s->sched);
    r->received_ns = uv_hrtime();
    int body = read_envelope(s, r, frames, kept);
    /* Decoded even when the frame count is wrong, so that every reply echoes the first request
     * frame's opcode, flags and id (§3); with no request frame at all they stay 0. */
    bool have_header = body < kept;
    char msg[TALLY_ERROR_MESSAGE_MAX + 1];
    tally_status_t st =
        tally_req_decode(have_header ? zmq_msg_data(&frames[body]) : NULL,
                         have_header ? zmq_msg_size(&frames[body]) : 0, &r->req, msg, sizeof msg);
    r->rep.opcode = r->req.opcode;
    r->rep.flags = r->req.flags;
    r->rep.request_id = r->req.request_id;
    int body_frames = total - body;
    if (s->stopping) {
        answer_stopping(s, r, st == TALLY_OK && body_frames == 2);
        return;
    }
    if (body_frames != 2)
        td_request_fail(r, TALLY_E_FRAMES,
                        "a request is 2 frames (header, payload) after the routing envelope; "
                        "this message has %d",
                        body_frames);
    else if (st != TALLY_OK)
        td_request_fail(r, st, "%s", msg);
    else if (take_request(s, r, &frames[body + 1], msg, sizeof msg)) {
        dispatch(s, r);
        return;
    }
    td_debug("request %" PRIu64 " answered %s", r->rep.request_id,
             tally_status_name((tally_status_t)r->rep.status));
    reply(s, r);
}

/* Reads one whole message. Returns 1 when one was handled, 0 when none was waiting. */
static int read_message(td_server_t *s)
{
    zmq_msg_t frames[TD_FRAMES_KEPT];
    int kept = 0;
    int total = 0;
    for (;;) {
        zmq_msg_t frame;
        zmq_msg_init(&frame);
        if (zmq_msg_recv(&frame, s->zmq.socket, ZMQ_DONTWAIT) == -1) {
            int err = errno;
            zmq_msg_close(&frame);
            if (total == 0 && (err == EAGAIN || err == EINTR))
                return 0;
            /* Cannot happen for the later frames of a message (ZeroMQ delivers multipart
             * messages whole); if it ever does, answer what arrived. */
            td_err("receiving a message: %s", zmq_strerror(err));
            break;
        }
        bool more = zmq_msg_more(&frame);
        if (kept < TD_FRAMES_KEPT) {
            zmq_msg_init(&frames[kept]);
            zmq_msg_move(&frames[kept], &frame);
            kept++;
        }
        zmq_msg_close(&frame);
        total++;
        if (!more)
            break;
    }
    handle_message(s, frames, kept, total);
    for (int i = 0; i < kept; i++)
        zmq_msg_close(&frames[i]);
    return 1;
}

static void close_all(td_server_t *s);
static void idle_cb(uv_idle_t *handle);

static void quiet_cb(uv_timer_t *handle)
{
    pump(handle->data);
}

/* Stopping, nothing in flight, nothing to read: close once the socket has stayed empty for
 * TD_DRAIN_QUIET_MS (td_config.h says why a moment is not enough), or at the deadline. */
static void stop_when_quiet(td_server_t *s)
{
    uint64_t quiet_ns = (uint64_t)TD_DRAIN_QUIET_MS * 1000000u;
    uint64_t since = uv_hrtime() - s->last_input_ns;
    if (s->drain_expired || since >= quiet_ns) {
        close_all(s);
        return;
    }
    uint64_t wait_ms = (quiet_ns - since) / 1000000u + 1;
    if (uv_timer_start(&s->quiet_timer, quiet_cb, wait_ms, 0) != 0)
        close_all(s);
}

/* Reading goes on while under the in-flight limit; once stopping, every message is answered
 * `shutdown` at once, so the limit no longer applies, until the drain deadline. */
static bool may_read(const td_server_t *s)
{
    if (s->stopping)
        return !s->drain_expired;
    return td_sched_may_read(s->sched);
}

/* Keeps the loop from blocking in poll while input remains that pump() has not read yet. */
static void set_idle(td_server_t *s, bool on)
{
    if (on == s->idle_active)
        return;
    int rc = on ? uv_idle_start(&s->idle, idle_cb) : uv_idle_stop(&s->idle);
    if (rc != 0) { /* cannot happen (a valid handle and callback); the check handle still pumps */
        td_err("%s the idle handle: %s", on ? "starting" : "stopping", uv_strerror(rc));
        return;
    }
    s->idle_active = on;
}

static void pump(td_server_t *s)
{
    if (s->closed)
        return;
    int budget = TD_READ_BUDGET;
    while (may_read(s) && budget > 0 && read_message(s)) {
        budget--;
        if (s->stopping)
            s->last_input_ns = uv_hrtime();
    }

    /* Reading ZMQ_EVENTS last re-arms the edge-triggered fd. */
    uint32_t events = 0;
    size_t size = sizeof events;
    if (zmq_getsockopt(s->zmq.socket, ZMQ_EVENTS, &events, &size) != 0) {
        td_err("reading ZMQ_EVENTS: %s", zmq_strerror(errno));
        events = ZMQ_POLLIN; /* look again on the next iteration rather than sleep */
    }
    bool input = (events & ZMQ_POLLIN) != 0;
    bool reading = may_read(s);
    bool at_limit = !s->stopping && !reading;
    if (input && at_limit && !s->paused) {
        s->metrics.read_pauses++;
        td_debug("%u requests in flight: reading paused", td_sched_inflight(s->sched));
    }
    s->paused = input && at_limit;
    bool more = input && reading;
    set_idle(s, more);
    if (s->stopping && td_sched_inflight(s->sched) == 0 && !more)
        stop_when_quiet(s);
}

static void poll_cb(uv_poll_t *handle, int status, int events)
{
    (void)status;
    (void)events;
    pump(handle->data);
}

static void check_cb(uv_check_t *handle)
{
    pump(handle->data);
}

static void idle_cb(uv_idle_t *handle)
{
    (void)handle; /* its only job is to keep the loop from blocking; check_cb does the work */
}

/* ---- Lifecycle -------------------------------------------------------------------------- */

static void sweep_cb(uv_timer_t *handle)
{
    td_server_t *s = handle->data;
    td_peers_set_rate(s->peers, s->cfg.stream_create_rate);
    td_peers_sweep(s->peers, uv_hrtime());
    td_streams_sweep(s->streams, td_clock_ms(), TD_STREAMS_SWEEP_PER_TICK);
}

static void drain_cb(uv_timer_t *handle)
{
    td_server_t *s = handle->data;
    s->drain_expired = true;
    td_notice("drain time over: reading stopped; %u requests still running",
              td_sched_inflight(s->sched));
    pump(s);
}

static void signal_cb(uv_signal_t *handle, int signum)
{
    td_server_t *s = handle->data;
    if (signum == SIGHUP) {
        td_service_reload(s->service);
        if (!s->closed)
            td_auth_reload(s->zmq.auth, &s->cfg); /* the allowed client keys, read again */
        return;
    }
    if (s->stopping) {
        td_notice("%s again: still stopping, %u requests in flight", strsignal(signum),
                  td_sched_inflight(s->sched));
        return;
    }
    td_notice("%s: stopping; finishing %u requests in flight, answering the rest `shutdown` "
              "for up to %u ms",
              strsignal(signum), td_sched_inflight(s->sched), s->cfg.drain_ms);
    s->stopping = true;
    s->last_input_ns = uv_hrtime();
    td_service_stopping(s->service);
    int rc = uv_timer_start(&s->drain_timer, drain_cb, s->cfg.drain_ms, 0);
    if (rc != 0) { /* without its deadline the drain could last forever: end reading now */
        td_err("cannot start the drain timer: %s; reading stops now", uv_strerror(rc));
        s->drain_expired = true;
    }
    td_sched_stop(s->sched); /* answers what waits on a stream, in each stream's order */
    pump(s);
}

static void close_all(td_server_t *s)
{
    if (s->closed)
        return;
    s->closed = true;
    uv_poll_stop(&s->poll); /* before zmq_close: libuv must stop watching the fd first */
    uv_close((uv_handle_t *)&s->poll, NULL);
    uv_close((uv_handle_t *)&s->check, NULL);
    uv_close((uv_handle_t *)&s->idle, NULL);
    uv_close((uv_handle_t *)&s->drain_timer, NULL);
    uv_close((uv_handle_t *)&s->quiet_timer, NULL);
    uv_close((uv_handle_t *)&s->sweep_timer, NULL);
    uv_close((uv_handle_t *)&s->retry_timer, NULL);
    td_replies_close(s->replies); /* replies kept for connections that closed are dropped */
    /* The signal handles stay installed (but no longer keep the loop alive) until
     * td_server_destroy: closing the last handle for a signal restores its default action, and
     * a second SIGTERM during the final flush would then kill tallyd mid-exit. */
    uv_unref((uv_handle_t *)&s->sig_int);
    uv_unref((uv_handle_t *)&s->sig_term);
    uv_unref((uv_handle_t *)&s->sig_hup);
    td_shm_close(s->shm); /* regions stay mapped until their requests are freed */
    td_pub_close(s->pub);
    td_exec_close(s->exec);       /* nothing is in flight any more */
    td_service_close(s->service); /* the final state snapshot: every request is answered */
    int linger = TD_SHUTDOWN_LINGER_MS;
    if (zmq_setsockopt(s->zmq.socket, ZMQ_LINGER, &linger, sizeof linger) != 0)
        td_warn("setting the socket's linger: %s", zmq_strerror(errno));
    if (zmq_close(s->zmq.socket) != 0)
        td_warn("closing the socket: %s", zmq_strerror(errno));
    s->zmq.socket = NULL;
    td_notice("stopped");
}

/* The executor, and the scheduler that places work on it. */
static td_err_t open_backends(td_server_t *s)
{
    tally_status_t st = tk_cpu_backend_new(&s->cpu);
    if (st != TALLY_OK) {
        td_err("cannot start the CPU backend: %s", tally_status_text(st));
        return TD_ERR_BACKEND;
    }
    td_exec_env_t env = {
        .loop = &s->loop,
        .cfg = &s->cfg,
        .metrics = &s->metrics,
        .cpu = s->cpu,
        .done = exec_done,
        .owner = s,
    };
    td_err_t err = td_exec_new(&env, &s->exec);
    if (err != TD_OK)
        return err;
    td_sched_machine_t machine;
    td_exec_machine(s->exec, &machine);
    td_sched_host_t host = {.owner = s,
                            .complete = sched_complete,
                            .control = sched_control,
                            .answer = sched_answer,
                            .forget = sched_forget};
    err = td_sched_new(&s->cfg, &s->metrics, &machine, &host, &s->sched);
    if (err != TD_OK)
        return err;
    td_exec_describe(s->exec, s->devices, sizeof s->devices);
    td_notice("backend %s (%s; chosen by --backend %s)", td_exec_backend_name(s->exec), s->devices,
              td_backend_choice_name(s->cfg.backend));
    return TD_OK;
}

/* The loop's handles: in td_server_new's order, so that a failure closes what was opened. */
#define TD_LOOP_HANDLES 10
static void loop_handles(td_server_t *s, uv_handle_t *all[TD_LOOP_HANDLES])
{
    uv_handle_t *list[TD_LOOP_HANDLES] = {
        (uv_handle_t *)&s->poll,        (uv_handle_t *)&s->check,
        (uv_handle_t *)&s->idle,        (uv_handle_t *)&s->drain_timer,
        (uv_handle_t *)&s->quiet_timer, (uv_handle_t *)&s->sweep_timer,
        (uv_handle_t *)&s->retry_timer, (uv_handle_t *)&s->sig_int,
        (uv_handle_t *)&s->sig_term,    (uv_handle_t *)&s->sig_hup,
    };
    memcpy(all, list, sizeof list);
}

static int init_handles(td_server_t *s)
{
    int rc = uv_poll_init_socket(&s->loop, &s->poll, s->zmq.fd);
    if (rc == 0)
        rc = uv_check_init(&s->loop, &s->check);
    if (rc == 0)
        rc = uv_idle_init(&s->loop, &s->idle);
    uv_timer_t *timers[] = {&s->drain_timer, &s->quiet_timer, &s->sweep_timer, &s->retry_timer};
    for (size_t i = 0; rc == 0 && i < sizeof timers / sizeof timers[0]; i++)
        rc = uv_timer_init(&s->loop, timers[i]);
    uv_signal_t *signals[] = {&s->sig_int, &s->sig_term, &s->sig_hup};
    for (size_t i = 0; rc == 0 && i < sizeof signals / sizeof signals[0]; i++)
        rc = uv_signal_init(&s->loop, signals[i]);
    uv_handle_t *handles[TD_LOOP_HANDLES];
    loop_handles(s, handles);
    for (size_t i = 0; i < TD_LOOP_HANDLES; i++)
        handles[i]->data = s;
    return rc;
}

static int start_handles(td_server_t *s)
{
    int rc = uv_poll_start(&s->poll, UV_READABLE, poll_cb);
    if (rc == 0)
        rc = uv_check_start(&s->check, check_cb);
    if (rc == 0)
        rc = uv_timer_start(&s->sweep_timer, sweep_cb, TD_PEERS_SWEEP_MS, TD_PEERS_SWEEP_MS);
    if (rc == 0)
        uv_unref((uv_handle_t *)&s->sweep_timer);
    if (rc == 0)
        rc = uv_signal_start(&s->sig_int, signal_cb, SIGINT);
    if (rc == 0)
        rc = uv_signal_start(&s->sig_term, signal_cb, SIGTERM);
    if (rc == 0)
        rc = uv_signal_start(&s->sig_hup, signal_cb, SIGHUP);
    return rc;
}

static td_err_t open_handles(td_server_t *s)
{
    int rc = init_handles(s);
    if (rc == 0)
        rc = start_handles(s);
    if (rc != 0) {
        td_err("cannot set up the event loop: %s", uv_strerror(rc));
        return TD_ERR_LIBRARY;
    }
    return TD_OK;
}

/* A failed start: closes the handles that were initialised (a zeroed handle has no type yet). */
static void close_handles(td_server_t *s)
{
    uv_handle_t *handles[TD_LOOP_HANDLES];
    loop_handles(s, handles);
    for (size_t i = 0; i < TD_LOOP_HANDLES; i++)
        if (handles[i]->type != UV_UNKNOWN_HANDLE && !uv_is_closing(handles[i]))
            uv_close(handles[i], NULL);
    uv_run(&s->loop, UV_RUN_NOWAIT);
}

/* What serves beside the ROUTER socket: the shared-memory side channel, the PUB socket, and the
 * service (which restores stream state before READY). */
static td_err_t open_services(td_server_t *s)
{
    td_shm_env_t shm_env = {.loop = &s->loop, .cfg = &s->cfg};
    td_exec_shm_env(s->exec, &shm_env);
    td_err_t err = td_shm_new(&shm_env, &s->shm);
    if (err != TD_OK)
        return err;
    if (s->cfg.pub_endpoint) {
        char why[512];
        err = td_pub_new(&s->loop, s->zmq.ctx, s->cfg.pub_endpoint, s->cfg.pub_interval_ms,
                         s->streams, &s->pub, why, sizeof why);
        if (err != TD_OK) {
            td_err("%s", why);
            return err;
        }
    }
    td_service_host_t host = service_host(s);
    return td_service_new(&host, &s->service);
}

/* Undoes open_socket, open_handles and open_services after a failure in one of them. */
static void close_started(td_server_t *s)
{
    close_handles(s);
    if (s->pub) {
        td_pub_close(s->pub);
        uv_run(&s->loop, UV_RUN_NOWAIT);
        td_pub_destroy(&s->pub);
    }
    if (s->shm) {
        td_shm_close(s->shm);
        uv_run(&s->loop, UV_RUN_NOWAIT);
        td_shm_destroy(&s->shm);
    }
    if (s->zmq.socket && zmq_close(s->zmq.socket) != 0)
        td_warn("closing the socket: %s", zmq_strerror(errno));
    td_auth_destroy(&s->zmq.auth); /* its sockets are in the context */
    while (s->zmq.ctx && zmq_ctx_term(s->zmq.ctx) == -1 && errno == EINTR)
        continue;
}

/* The strings a reload replaces in the live configuration (td_config_apply_runtime frees the
 * old value) must be the server's own, not the caller's. */
static bool own_reloadable_strings(td_server_t *s)
{
    char **fields[] = {&s->cfg.curve_clients_dir, &s->cfg.curve_clients};
    bool ok = true;
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        const char *borrowed = *fields[i];
        *fields[i] = borrowed ? strdup(borrowed) : NULL;
        ok &= !borrowed || *fields[i];
    }
    return ok;
}

static void free_reloadable_strings(td_server_t *s)
{
    free(s->cfg.curve_clients_dir);
    free(s->cfg.curve_clients);
    s->cfg.curve_clients_dir = s->cfg.curve_clients = NULL;
}

/* The stream table (windows, the test clock) and the per-peer table. */
static td_err_t open_tables(td_server_t *s)
{
    td_err_t err = td_streams_new(s->cfg.max_streams, &s->streams);
    if (err != TD_OK)
        return err;
    td_streams_set_window(s->streams, s->cfg.window_intervals, s->cfg.window_interval_ms);
    td_streams_set_budget(s->streams, s->cfg.max_state_bytes,
                          td_config_state_bytes_per_client(&s->cfg));
    td_clock_set_test_file(s->cfg.test_clock);
    err = td_replies_new(&s->cfg, &s->metrics, retire, s, &s->replies);
    if (err == TD_OK)
        err = td_peers_new(&s->peers);
    s->admit = (td_admit_t){
        .cfg = &s->cfg, .peers = s->peers, .replies = s->replies, .metrics = &s->metrics};
    return err;
}

static void close_tables(td_server_t *s)
{
    td_sched_destroy(&s->sched);
    td_exec_destroy(&s->exec);
    if (s->cpu)
        s->cpu->destroy(&s->cpu);
    td_peers_destroy(&s->peers);
    td_replies_destroy(&s->replies); /* after zmq_ctx_term: ZeroMQ frees replies until then */
    td_streams_destroy(&s->streams);
}

td_err_t td_server_new(const td_config_t *cfg, td_server_t **out)
{
    td_server_t *s = calloc(1, sizeof *s);
    if (!s)
        return TD_ERR_NOMEM;
    s->cfg = *cfg;
    s->started_ns = uv_hrtime();
    td_err_t err = TD_ERR_NOMEM;
    if (!own_reloadable_strings(s))
        goto fail_free;
    err = TD_ERR_LIBRARY;
    if (uv_loop_init(&s->loop) != 0)
        goto fail_free;
    err = open_tables(s);
    if (err == TD_OK)
        err = open_backends(s);
    if (err != TD_OK)
        goto fail_tables;
    err = td_router_open(&s->cfg, &s->zmq);
    if (err == TD_OK)
        err = open_handles(s);
    if (err == TD_OK)
        err = open_services(s);
    if (err != TD_OK)
        goto fail_started;
    *out = s;
    return TD_OK;

fail_started:
    close_started(s);
fail_tables:
    close_tables(s);
    uv_loop_close(&s->loop);
fail_free:
    free_reloadable_strings(s);
    free(s);
    return err;
}

int td_server_run(td_server_t *s)
{
    td_notice("tallyd %s ready: %u in flight max, batches up to %zu bytes", TALLY_VERSION,
              s->cfg.max_inflight, s->cfg.max_batch);
    td_service_ready(s->service);
    pump(s); /* messages may have queued between bind and the first poll */
    uv_run(&s->loop, UV_RUN_DEFAULT);
    return td_service_exit_code(s->service); /* the final snapshot: did it reach the disk? */
}

uv_loop_t *td_server_loop(td_server_t *self)
{
    return &self->loop;
}

td_streams_t *td_server_streams(td_server_t *self)
{
    return self->streams;
}

td_fleet_status_t *td_server_fleet_status(td_server_t *self)
{
    return &self->fleet_status;
}

bool td_server_internal_curve(td_server_t *self, char server_public[TALLY_KEY_LEN + 1],
                              char public_key[TALLY_KEY_LEN + 1], char secret_key[TALLY_KEY_LEN + 1])
{
    if (!self->zmq.auth)
        return false;
    memcpy(server_public, td_auth_public_key(self->zmq.auth), TALLY_KEY_LEN + 1);
    td_auth_internal_keys(self->zmq.auth, public_key, secret_key);
    return true;
}

void td_server_destroy(td_server_t **self_p)
{
    td_server_t *s = *self_p;
    if (!s)
        return;
    if (!s->closed) { /* not stopped by a signal: close what the loop still holds */
        close_all(s);
        uv_run(&s->loop, UV_RUN_DEFAULT);
    }
    td_service_destroy(&s->service);
    td_auth_destroy(&s->zmq.auth); /* its sockets are in the context */
    /* Waits (up to the linger) for the last replies to leave. A signal (a second SIGTERM)
     * interrupts the wait with EINTR and leaves the context, its I/O thread and every message
     * it holds allocated: wait again. */
    while (zmq_ctx_term(s->zmq.ctx) == -1 && errno == EINTR)
        continue;
    uv_close((uv_handle_t *)&s->sig_int, NULL);
    uv_close((uv_handle_t *)&s->sig_term, NULL);
    uv_close((uv_handle_t *)&s->sig_hup, NULL);
    /* Closing them restored the default actions; tallyd is exiting, so a late SIGTERM (a
     * second Ctrl-C, systemd's stop) must not turn a clean exit into death by signal. */
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    td_pub_destroy(&s->pub);
    td_shm_destroy(&s->shm); /* before the executor: regions unregister from the GPU */
    close_tables(s);         /* td_exec_destroy joins the GPU lane threads */
    if (uv_loop_close(&s->loop) != 0)
        td_warn("the event loop still had handles open at exit");
    free_reloadable_strings(s);
    free(s);
    *self_p = NULL;
}
