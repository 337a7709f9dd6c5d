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
 * and forget a deleted stream.
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
 * stops reading, ZeroMQ's
 * receive high-water mark fills and TCP pushes back on producers: nothing is dropped. Sizes are
 * checked here, not by ZeroMQ: a payload over max_batch gets too_large like any other bad
 * request; only a frame over max_frame (far above max_batch) makes ZeroMQ drop the connection.
 *
 * A reply never waits for its peer. ROUTER_MANDATORY is on, so a send fails at once when the
 * peer has gone (EHOSTUNREACH) or stopped reading and filled its send high-water mark (EAGAIN);
 * the reply is then dropped and counted, and its in-flight slot freed. Queueing it instead would
 * let one peer that never reads hold every slot and stop tallyd serving anyone.
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
#include <sys/stat.h>
#include <uv.h>
#include <zmq.h>

#include "td_auth.h"
#include "td_exec.h"
#include "td_log.h"
#include "td_metrics.h"
#include "td_notify.h"
#include "td_pub.h"
#include "td_peers.h"
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
/* Space for an info/stats reply. */
#define TD_TEXT_REPLY_MAX (64 * 1024)

struct td_server {
    /* A copy; binds and strings are borrowed from the caller's config, except the ones a reload
     * replaces (the allowed CURVE keys), which the server owns (own_reloadable_strings). */
    td_config_t cfg;
    uv_loop_t loop;
    void *zmq_ctx;
    void *router;
    uv_os_sock_t zmq_fd;
    uv_poll_t poll;
    uv_check_t check;
    uv_idle_t idle;
    uv_signal_t sig_int;
    uv_signal_t sig_term;
    uv_signal_t sig_hup;
    uv_timer_t drain_timer; /* the end of reading after a stop signal */
    uv_timer_t quiet_timer; /* a stopping socket that stayed empty long enough */
    uv_timer_t sweep_timer; /* frees idle per-peer entries */
    uint64_t last_input_ns; /* stopping: the signal, or the last message read since */
    bool idle_active;
    bool paused;        /* reading stopped at the in-flight limit */
    bool stopping;      /* a stop signal arrived: start nothing new, answer `shutdown` */
    bool drain_expired; /* drain_ms has passed since: read nothing more */
    bool closed;        /* socket and handles closed */

    unsigned active_conns; /* connections with requests in flight (the fair share's divisor) */

    td_streams_t *streams;
    td_peers_t *peers; /* per-connection and per-client limits */
    td_auth_t *auth;   /* CURVE and its ZAP handler; NULL when CURVE is off */
    tk_backend_t *cpu; /* the CPU backend; the GPU runs through the executor's pipeline */
    td_exec_t *exec;   /* where compute requests run: CPU workers or the GPU pipeline */
    td_sched_t *sched; /* what runs when and where; the in-flight count */
    td_shm_t *shm;     /* shared-memory side channel and regions; NULL when off */
    td_pub_t *pub;     /* the PUB socket (subscriptions); NULL when off */
    char devices[256];
    td_metrics_t metrics;
    td_service_t *service; /* systemd, state persistence, HTTP metrics, reload */
    uint64_t started_ns;
};

static void pump(td_server_t *s);
static void reply(td_server_t *s, td_request_t *r);

/* ---- Replies ---------------------------------------------------------------------------- */

static void free_reply_data(void *data, void *hint)
{
    (void)hint;
    free(data);
}

/* Hands r's reply to ZeroMQ without waiting. Returns 0 when sent, else the errno of the failed
 * send: EHOSTUNREACH (the peer has gone) or EAGAIN (the peer's send high-water mark is full: it
 * is not reading). Only the first frame can meet either: once it is accepted ZeroMQ takes the
 * rest of the message whole, so a later frame failing is a broken socket (logged). */
static int try_send(td_server_t *s, td_request_t *r)
{
    const int more = ZMQ_DONTWAIT | ZMQ_SNDMORE;
    if (zmq_send(s->router, r->identity, r->identity_len, more) == -1)
        return errno;
    int err = 0;
    if (r->has_delimiter && zmq_send(s->router, "", 0, more) == -1)
        err = errno;
    uint8_t header[TALLY_REP_HEADER_SIZE];
    tally_rep_encode(&r->rep, header);
    if (!err && zmq_send(s->router, header, sizeof header, more) == -1)
        err = errno;
    zmq_msg_t body;
    if (!err && r->reply_data && r->reply_len) {
        /* Sent where it was built (a malloc'd reply, or a pinned buffer the GPU wrote it to):
         * ZeroMQ frees or gives it back once the bytes have left. */
        zmq_free_fn *give_back = r->reply_free ? r->reply_free : free_reply_data;
        if (zmq_msg_init_data(&body, r->reply_data, r->reply_len, give_back, r->reply_hint) == 0) {
            r->reply_data = NULL; /* ZeroMQ owns it now */
            r->reply_free = NULL;
        } else
            err = errno;
    } else if (!err) {
        zmq_msg_init(&body);
    }
    if (!err && zmq_msg_send(&body, s->router, ZMQ_DONTWAIT) == -1) {
        err = errno;
        zmq_msg_close(&body);
    }
    if (err)
        td_err("sending the reply to request %" PRIu64 ": %s", r->rep.request_id,
               zmq_strerror(err));
    return err;
}

/* The end of every request: send its reply (or drop it), metrics, in-flight slot, memory. */
static void reply(td_server_t *s, td_request_t *r)
{
    int err = try_send(s, r);
    if (err == EHOSTUNREACH) {
        s->metrics.replies_dropped_gone++;
        td_debug("reply to request %" PRIu64 " dropped: the peer has gone", r->rep.request_id);
    } else if (err == EAGAIN) {
        s->metrics.replies_dropped_slow++;
        td_debug("reply to request %" PRIu64 " dropped: the peer is not reading its replies",
                 r->rep.request_id);
    } else if (err) {
        s->metrics.replies_dropped_gone++; /* a broken connection; logged by try_send */
    }
    td_metrics_observe(&s->metrics, r->req.opcode, (tally_status_t)r->rep.status, r->payload_len,
                       r->reply_len, uv_hrtime() - r->received_ns);
    td_sched_answered(s->sched);
    if (r->conn && td_peer_inflight_end(r->conn))
        s->active_conns--;
    td_peers_release(s->peers, &r->conn);
    td_peers_release(s->peers, &r->client);
    td_request_destroy(&r);
}

/* ---- Operations answered on the loop thread -------------------------------------------- */

static void reply_text(td_server_t *s, td_request_t *r, char *text, size_t len)
{
    (void)s;
    if (len > TD_TEXT_REPLY_MAX - 1)
        len = TD_TEXT_REPLY_MAX - 1;
    td_request_succeed(r, TALLY_DTYPE_TEXT, text, len, len);
}

static void op_info(td_server_t *s, td_request_t *r)
{
    char *text = malloc(TD_TEXT_REPLY_MAX);
    if (!text) {
        td_request_fail(r, TALLY_E_INTERNAL, "out of memory");
        return;
    }
    int n = snprintf(text, TD_TEXT_REPLY_MAX,
                     "version=%s\nprotocol=%d\nbackend=%s\nbackends=%s\ndevices=%s\n"
                     "max_batch=%zu\nmax_inflight=%u\nmax_streams=%u\nshm=%s\nshm_socket=%s\n"
                     "window_intervals=%u\nwindow_interval_ms=%u\npub=%s\npub_interval_ms=%u\n"
                     "curve=%s\n",
                     TALLY_VERSION, TALLY_PROTO_VERSION, td_exec_backend_name(s->exec),
                     td_exec_backends(s->exec), td_exec_devices(s->exec), s->cfg.max_batch,
                     s->cfg.max_inflight, s->cfg.max_streams, s->shm ? "on" : "off",
                     s->shm ? td_shm_path(s->shm) : "", s->cfg.window_intervals,
                     s->cfg.window_interval_ms, s->pub ? td_pub_endpoint(s->pub) : "",
                     s->cfg.pub_interval_ms, s->auth ? "on" : "off");
    reply_text(s, r, text, n > 0 ? (size_t)n : 0);
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
        .stopping = s->stopping,
        .gpus_lost = td_exec_devices_lost(s->exec),
        .pub_messages = td_pub_messages(s->pub),
        .pub_failed = td_pub_failed(s->pub),
        .streams = s->streams,
        .metrics_streams = s->cfg.metrics_streams,
        .backend = td_exec_backend_name(s->exec),
        .devices = td_exec_devices(s->exec),
        .device_memory_bytes = td_exec_device_bytes(s->exec),
        .uptime_s = (double)(uv_hrtime() - s->started_ns) / 1e9,
        .peers = td_peers_count(s->peers),
        .users = s->auth ? s->peers : NULL,
    };
    if (s->auth) {
        g->curve = true;
        td_auth_counts(s->auth, &g->auth);
    }
    td_shm_gauges(s->shm, &g->shm_regions, &g->shm_bytes);
}

static td_service_host_t service_host(td_server_t *s)
{
    return (td_service_host_t){.loop = &s->loop,
                               .cfg = &s->cfg,
                               .streams = s->streams,
                               .metrics = &s->metrics,
                               .gauges = sample_gauges,
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

static void op_streams(td_server_t *s, td_request_t *r)
{
    size_t len = 0;
    uint64_t count = 0;
    for (td_stream_t *st = td_streams_first(s->streams); st; st = st->list_next)
        len += 1 + st->name_len;
    uint8_t *out = malloc(len ? len : 1);
    if (!out) {
        td_request_fail(r, TALLY_E_INTERNAL, "out of memory");
        return;
    }
    size_t at = 0;
    for (td_stream_t *st = td_streams_first(s->streams); st; st = st->list_next) {
        out[at++] = (uint8_t)st->name_len;
        memcpy(out + at, st->name, st->name_len);
        at += st->name_len;
        count++;
    }
    td_request_succeed(r, TALLY_DTYPE_NONE, out, len, count);
}

/* A window query (PROTOCOL.md "Windows"): the stream's record with the histogram of the last
 * ceil(W / interval) intervals; false (r failed) when the ring is shorter or windows are off. */
static bool window_view(td_server_t *s, td_request_t *r, const td_stream_t *stream,
                        tally_stream_info_t *view)
{
    unsigned intervals = s->cfg.window_intervals;
    uint64_t interval_ms = s->cfg.window_interval_ms;
    uint64_t want = ((uint64_t)r->req.lo + interval_ms - 1) / interval_ms;
    if (intervals == 0) {
        td_request_fail(r, TALLY_E_WINDOW, "windows are off (window_intervals = 0)");
        return false;
    }
    if (want > intervals) {
        td_request_fail(r, TALLY_E_WINDOW,
                        "a window of %" PRId64 " ms needs %" PRIu64 " intervals; tallyd keeps %u "
                        "of %" PRIu64 " ms (%" PRIu64 " ms)",
                        r->req.lo, want, intervals, interval_ms, intervals * interval_ms);
        return false;
    }
    uint64_t now = td_clock_ms();
    *view = stream->info;
    if (stream->window) {
        r->rep.aux0 = td_window_sum(stream->window, now, (unsigned)want, view);
    } else { /* no hist yet: nothing counted in any interval */
        view->hist_underflow = view->hist_overflow = view->hist_total = 0;
        memset(view->bins, 0, sizeof view->bins);
        uint64_t current = now / interval_ms;
        r->rep.aux0 = (current + 1 - (want < current + 1 ? want : current + 1)) * interval_ms;
    }
    r->rep.aux1 = now;
    return true;
}

static void op_query(td_server_t *s, td_request_t *r, const td_stream_t *stream)
{
    static tally_stream_info_t view; /* loop thread only; 8 KiB off the stack */
    const tally_stream_info_t *info = &stream->info;
    if (r->req.flags & TALLY_FLAG_QUERY_WINDOW) {
        if (!window_view(s, r, stream, &view))
            return;
        info = &view;
    }
    size_t size = tally_stream_info_size(info);
    uint8_t *out = malloc(size);
    if (!out) {
        td_request_fail(r, TALLY_E_INTERNAL, "out of memory");
        return;
    }
    tally_stream_info_encode(info, out);
    uint64_t start = r->rep.aux0, end = r->rep.aux1;
    td_request_succeed(r, TALLY_DTYPE_NONE, out, size, 1);
    r->rep.aux0 = start;
    r->rep.aux1 = end;
}

/* ---- What the scheduler asks of the server (td_sched.h) ---------------------------------- */

/* A compute request's result: folded into its stream (and the stream's window ring), answered. */
static bool sched_complete(void *owner, td_request_t *r)
{
    td_server_t *s = owner;
    td_stream_t *stream = r->stream;
    bool applied = td_request_apply(r);
    if (applied && stream && r->req.opcode == TALLY_OP_HIST &&
        !td_stream_window_add(s->streams, stream, r->hist.bins, r->hist.underflow, r->hist.overflow,
                              td_request_elements(r), td_clock_ms()))
        td_warn("stream '%s': out of memory for its window ring; its window queries count "
                "nothing",
                stream->name);
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
        op_query(s, r, stream);
        return;
    case TALLY_OP_RESET:
        td_stream_zero(stream);
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

static void sched_forget(void *owner, td_stream_t *stream)
{
    td_server_t *s = owner;
    if (stream->owner)
        td_peer_stream_removed(stream->owner);
    td_peers_release(s->peers, &stream->owner);
    td_streams_remove(s->streams, &stream);
}

/* The executor (td_exec.h) hands every compute request back here, on the loop thread. */
static void exec_done(void *owner, td_request_t *r)
{
    td_server_t *s = owner;
    td_sched_finished(s->sched, r);
}

/* r is refused by a per-peer limit: counted for tallyd_limited_total and for its client. */
static void count_limited(td_server_t *s, const td_request_t *r, td_limit_t limit)
{
    s->metrics.limited[limit]++;
    if (r->client)
        td_peer_count_limited(r->client);
}

/* A filter, scan or hist names a stream that does not exist yet: its client's stream count and
 * creation rate, then the global max_streams. Returns false when the request was failed. */
static bool create_stream(td_server_t *s, td_request_t *r, td_stream_t **out)
{
    const tally_req_t *q = &r->req;
    td_peer_t *client = r->client;
    unsigned per_client = td_config_streams_per_client(&s->cfg);
    if (client && td_peer_streams(client) >= per_client) {
        count_limited(s, r, TD_LIMIT_STREAMS);
        td_request_fail(r, TALLY_E_CLIENT_STREAMS,
                        "this client already holds %u streams (max_streams_per_client %u); "
                        "delete one it no longer needs",
                        td_peer_streams(client), per_client);
        return false;
    }
    if (client && !td_peer_take_token(s->peers, client, uv_hrtime())) {
        count_limited(s, r, TD_LIMIT_RATE);
        td_request_fail(r, TALLY_E_RATE,
                        "this client creates streams faster than stream_create_rate (%u per "
                        "second); retry later",
                        s->cfg.stream_create_rate);
        return false;
    }
    tally_status_t st = td_streams_get(s->streams, q->stream, q->stream_len, out);
    if (st == TALLY_E_LIMIT) {
        td_request_fail(r, st, "tallyd already holds its maximum of %u streams",
                        s->cfg.max_streams);
        return false;
    }
    if (st != TALLY_OK) {
        td_request_fail(r, st, "cannot create stream '%s'", q->stream);
        return false;
    }
    if (client) {
        td_peer_stream_added(client); /* and the stream's reference to it */
        (*out)->owner = client;
    }
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
        op_streams(s, r);
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

/* Who sent r (td_peers.h): its connection, and its client identity — the ZAP user id that CURVE
 * authenticated (the "User-Id" property of every message of the connection), else the connection
 * itself. The connection counts r as in flight until its reply. */
static void identify(td_server_t *s, td_request_t *r, zmq_msg_t *frames, int kept)
{
    uint64_t now = uv_hrtime();
    td_peers_set_rate(s->peers, s->cfg.stream_create_rate); /* the live value: reloads apply */
    r->conn = td_peers_acquire(s->peers, TD_PEER_CONNECTION, r->identity, r->identity_len, now);
    if (r->conn && td_peer_inflight_begin(r->conn))
        s->active_conns++;
    const char *user = kept > 1 ? zmq_msg_gets(&frames[kept - 1], "User-Id") : NULL;
    if (user && user[0])
        r->client = td_peers_acquire(s->peers, TD_PEER_USER, user, strlen(user), now);
    else
        r->client =
            td_peers_acquire(s->peers, TD_PEER_CONNECTION, r->identity, r->identity_len, now);
    if (r->client && user && user[0])
        td_peer_count_request(r->client);
}

/* The connection's fair share of max_inflight: past it the request is answered `busy` at once,
 * so one peer that floods tallyd (or never reads) cannot keep every slot and stop tallyd reading
 * for everyone else. A peer alone may use every slot (at the limit tallyd stops reading, as
 * before); once others have requests in flight each is held to its share, and as the greedy
 * peer's slots turn over ZeroMQ's fair queueing hands the freed ones to the others. Returns true
 * when r was failed. */
static bool over_share(td_server_t *s, td_request_t *r)
{
    unsigned share = td_config_inflight_per_peer(&s->cfg, s->active_conns);
    if (!r->conn || td_peer_inflight(r->conn) <= share) /* it counts r itself */
        return false;
    count_limited(s, r, TD_LIMIT_INFLIGHT);
    td_request_fail(r, TALLY_E_BUSY,
                    "this connection already has %u requests in flight (max_inflight_per_peer "
                    "%u); send more once replies arrive",
                    td_peer_inflight(r->conn) - 1, share);
    return true;
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
    size_t id_len = zmq_msg_size(&frames[0]);
    r->identity_len = id_len < TD_IDENTITY_MAX ? id_len : TD_IDENTITY_MAX;
    memcpy(r->identity, zmq_msg_data(&frames[0]), r->identity_len);
    identify(s, r, frames, kept);

    /* A REQ peer puts an empty delimiter frame before its body. Any peer's empty first frame is
     * taken as one and echoed (PROTOCOL.md §1): a header is never empty. */
    int body = 1;
    if (kept > 1 && zmq_msg_size(&frames[1]) == 0) {
        r->has_delimiter = true;
        body = 2;
    }
    /* Decoded even when the frame count is wrong, so that every reply echoes the first request
     * frame's opcode, flags and id (§3); with no request frame at all they stay 0. */
    bool have_header = body < kept;
    const uint8_t *header = have_header ? zmq_msg_data(&frames[body]) : NULL;
    size_t header_len = have_header ? zmq_msg_size(&frames[body]) : 0;
    char msg[TALLY_ERROR_MESSAGE_MAX + 1];
    tally_status_t st = tally_req_decode(header, header_len, &r->req, msg, sizeof msg);
    r->rep.opcode = r->req.opcode;
    r->rep.flags = r->req.flags;
    r->rep.request_id = r->req.request_id;

    int body_frames = total - body;
    if (s->stopping) {
        answer_stopping(s, r, st == TALLY_OK && body_frames == 2);
        return;
    }
    if (body_frames != 2) {
        td_request_fail(r, TALLY_E_FRAMES,
                        "a request is 2 frames (header, payload) after the routing envelope; "
                        "this message has %d",
                        body_frames);
        goto answer;
    }
    if (st != TALLY_OK) {
        td_request_fail(r, st, "%s", msg);
        goto answer;
    }
    /* Validated on the frame's size before the payload is taken, so an oversize payload is
     * never copied (realigned). */
    r->payload_len = zmq_msg_size(&frames[body + 1]);
    st = tally_req_validate(&r->req, r->payload_len, s->cfg.max_batch, msg, sizeof msg);
    if (st != TALLY_OK) {
        td_request_fail(r, st, "%s", msg);
        goto answer;
    }
    if (over_share(s, r))
        goto answer;
    st = td_request_take_payload(r, &frames[body + 1]);
    if (st != TALLY_OK) {
        td_request_fail(r, st, "out of memory for a payload of %zu bytes", r->payload_len);
        goto answer;
    }
    /* After the take: the reference is decoded from the taken payload, which then points into
     * the producer's region instead. */
    if (r->req.flags & TALLY_FLAG_SHM_REF) {
        st = resolve_shm_ref(s, r, msg, sizeof msg);
        if (st != TALLY_OK) {
            td_request_fail(r, st, "%s", msg);
            goto answer;
        }
    }
    dispatch(s, r);
    return;
answer:
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
        if (zmq_msg_recv(&frame, s->router, ZMQ_DONTWAIT) == -1) {
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
    if (zmq_getsockopt(s->router, ZMQ_EVENTS, &events, &size) != 0) {
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
            td_auth_reload(s->auth, &s->cfg); /* the allowed client keys, read again */
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
    if (zmq_setsockopt(s->router, ZMQ_LINGER, &linger, sizeof linger) != 0)
        td_warn("setting the socket's linger: %s", zmq_strerror(errno));
    if (zmq_close(s->router) != 0)
        td_warn("closing the socket: %s", zmq_strerror(errno));
    s->router = NULL;
    td_notice("stopped");
}

/* An ipc socket that tallyd made: mode 0660 whatever the umask (UMask=0077 under systemd), so
 * tallyd's group can connect and nobody else. Without CURVE whoever connects may use every
 * stream, so the socket's mode is the access control (PROTOCOL.md §12). */
static void restrict_ipc_socket(const char *endpoint)
{
    if (strncmp(endpoint, "ipc://", 6) != 0 || endpoint[6] == '@') /* @: abstract, no file */
        return;
    if (chmod(endpoint + 6, TD_IPC_SOCKET_MODE) != 0)
        td_warn("cannot set mode %04o on %s: %s", TD_IPC_SOCKET_MODE, endpoint + 6,
                strerror(errno));
}

/* The ROUTER socket's options (td_config.h says why each value). */
static td_err_t set_socket_options(td_server_t *s)
{
    int one = 1, rcvhwm = TD_DEFAULT_RCVHWM, sndhwm = TD_DEFAULT_SNDHWM, linger = 0;
    /* tallyd checks payload sizes itself (too_large), so a client that sends too much still
     * gets its answer and keeps its connection. ZeroMQ's own limit is only the memory guard
     * max_frame, far above max_batch (td_config.h says why): a frame over it closes the
     * connection. */
    int64_t maxmsg = (int64_t)td_config_max_frame(&s->cfg);
    struct {
        int option;
        const void *value;
        size_t len;
        const char *name;
    } opts[] = {
        {ZMQ_ROUTER_MANDATORY, &one, sizeof one, "ZMQ_ROUTER_MANDATORY"},
        {ZMQ_RCVHWM, &rcvhwm, sizeof rcvhwm, "ZMQ_RCVHWM"},
        {ZMQ_SNDHWM, &sndhwm, sizeof sndhwm, "ZMQ_SNDHWM"},
        {ZMQ_LINGER, &linger, sizeof linger, "ZMQ_LINGER"},
        {ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg, "ZMQ_MAXMSGSIZE"},
    };
    for (size_t i = 0; i < sizeof opts / sizeof opts[0]; i++) {
        if (zmq_setsockopt(s->router, opts[i].option, opts[i].value, opts[i].len) != 0) {
            td_err("cannot set %s: %s", opts[i].name, zmq_strerror(errno));
            return TD_ERR_LIBRARY;
        }
    }
    return TD_OK;
}

/* CURVE, before any bind, so that no connection is ever made without it. */
static td_err_t open_curve(td_server_t *s)
{
    if (!s->cfg.curve_secret_key)
        return TD_OK;
    char msg[1024];
    td_err_t err = td_auth_new(s->zmq_ctx, &s->cfg, &s->auth, msg, sizeof msg);
    if (err != TD_OK) {
        td_err("curve: %s", msg);
        return err;
    }
    return td_auth_apply(s->auth, s->router);
}

static td_err_t bind_endpoints(td_server_t *s)
{
    for (int i = 0; i < s->cfg.bind_count; i++) {
        if (zmq_bind(s->router, s->cfg.binds[i]) != 0) {
            td_err("cannot bind %s: %s", s->cfg.binds[i], zmq_strerror(errno));
            return TD_ERR_BIND;
        }
        restrict_ipc_socket(s->cfg.binds[i]);
        td_info("listening on %s", s->cfg.binds[i]);
    }
    return td_listen_fds_bind(s->router, &s->cfg); /* sockets passed by systemd */
}

static td_err_t open_socket(td_server_t *s)
{
    s->zmq_ctx = zmq_ctx_new();
    if (!s->zmq_ctx)
        return TD_ERR_LIBRARY;
    /* Before the first socket: the I/O threads start with it. */
    int io_threads = (int)td_config_io_threads(&s->cfg);
    if (zmq_ctx_set(s->zmq_ctx, ZMQ_IO_THREADS, io_threads) != 0)
        td_warn("cannot set %d ZeroMQ I/O threads: %s", io_threads, zmq_strerror(errno));
    td_info("%d ZeroMQ I/O threads", io_threads);
    s->router = zmq_socket(s->zmq_ctx, ZMQ_ROUTER);
    if (!s->router)
        return TD_ERR_LIBRARY;
    td_err_t err = set_socket_options(s);
    if (err == TD_OK)
        err = open_curve(s);
    if (err == TD_OK)
        err = bind_endpoints(s);
    if (err != TD_OK)
        return err;
    size_t size = sizeof s->zmq_fd;
    if (zmq_getsockopt(s->router, ZMQ_FD, &s->zmq_fd, &size) != 0) {
        td_err("reading ZMQ_FD: %s", zmq_strerror(errno));
        return TD_ERR_LIBRARY;
    }
    return TD_OK;
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
#define TD_LOOP_HANDLES 9
static void loop_handles(td_server_t *s, uv_handle_t *all[TD_LOOP_HANDLES])
{
    uv_handle_t *list[TD_LOOP_HANDLES] = {
        (uv_handle_t *)&s->poll,        (uv_handle_t *)&s->check,
        (uv_handle_t *)&s->idle,        (uv_handle_t *)&s->drain_timer,
        (uv_handle_t *)&s->quiet_timer, (uv_handle_t *)&s->sweep_timer,
        (uv_handle_t *)&s->sig_int,     (uv_handle_t *)&s->sig_term,
        (uv_handle_t *)&s->sig_hup,
    };
    memcpy(all, list, sizeof list);
}

static int init_handles(td_server_t *s)
{
    int rc = uv_poll_init_socket(&s->loop, &s->poll, s->zmq_fd);
    if (rc == 0)
        rc = uv_check_init(&s->loop, &s->check);
    if (rc == 0)
        rc = uv_idle_init(&s->loop, &s->idle);
    uv_timer_t *timers[] = {&s->drain_timer, &s->quiet_timer, &s->sweep_timer};
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
        err = td_pub_new(&s->loop, s->zmq_ctx, s->cfg.pub_endpoint, s->cfg.pub_interval_ms,
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
    if (s->router && zmq_close(s->router) != 0)
        td_warn("closing the socket: %s", zmq_strerror(errno));
    td_auth_destroy(&s->auth); /* its sockets are in the context */
    while (s->zmq_ctx && zmq_ctx_term(s->zmq_ctx) == -1 && errno == EINTR)
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
    td_clock_set_test_file(s->cfg.test_clock);
    return td_peers_new(&s->peers);
}

static void close_tables(td_server_t *s)
{
    td_sched_destroy(&s->sched);
    td_exec_destroy(&s->exec);
    if (s->cpu)
        s->cpu->destroy(&s->cpu);
    td_peers_destroy(&s->peers);
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
    err = open_socket(s);
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
    td_auth_destroy(&s->auth); /* its sockets are in the context */
    /* Waits (up to the linger) for the last replies to leave. A signal (a second SIGTERM)
     * interrupts the wait with EINTR and leaves the context, its I/O thread and every message
     * it holds allocated: wait again. */
    while (zmq_ctx_term(s->zmq_ctx) == -1 && errno == EINTR)
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
