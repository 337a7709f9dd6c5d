/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_zmq.c — the ZeroMQ transport's socket loop (see td_zmq.h): reading messages into the request
 * path, and the loop handles that keep the edge-triggered fd serviced.
 *
 * ZeroMQ's ZMQ_FD is edge-triggered: it signals when the socket's state changes, and only after
 * ZMQ_EVENTS has been read. So the socket is serviced by one function, td_zmq_pump(), called from
 * the uv_poll callback AND from a uv_check handle after every loop iteration (completions arrive
 * through libuv's async wake-up, not through the fd). It reads messages until EAGAIN (or the
 * path's in-flight limit, or a fairness budget), and re-reads ZMQ_EVENTS last. Every send happens
 * in a callback of the loop and marks the socket unsettled, and the check handle runs after every
 * iteration's callbacks and pumps an unsettled socket (a timer's sends, which come before the
 * poll, pump at once: td_zmq_send.c), so a send is always followed by a ZMQ_EVENTS read before
 * the loop blocks: no wake-up is lost. A settled socket (nothing to read at the last look, not
 * used since) with nothing in flight is not looked at again until its descriptor calls for it. If
 * input remains that the pump chose not to read yet, a uv_idle handle keeps the loop from blocking
 * in poll so the next iteration continues; otherwise the loop sleeps until the fd or a completion
 * wakes it. At the in-flight limit reading stops, ZeroMQ's receive high-water mark fills and TCP
 * pushes back: nothing is lost. Only a frame over max_frame (far above max_batch) makes ZeroMQ
 * drop the connection (its earlier requests are still read, and their replies kept for it to
 * reconnect: td_zmq.h). Each message's connection, as tallyd tells it, is td_zmq_conn.c's; the
 * socket monitor's events are read first in every pump.
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "td_log.h"
#include "td_path.h"
#include "td_zmq_int.h"

/* Messages read per pump before giving the rest of the loop a turn. */
#define TD_READ_BUDGET 256
/* Frames of one message kept for inspection: identity, delimiter, header, payload. Frames
 * beyond these are counted (to reject the message) and released at once. */
#define TD_FRAMES_KEPT 4
/* How long zmq_close may keep flushing the last replies at shutdown: ZeroMQ writes a reply to a
 * peer that reads at once, so this is only spent on a peer that does not read, which must not
 * hold tallyd up for long. */
#define TD_SHUTDOWN_LINGER_MS 1000

/* Another message ready on the socket (ZMQ_EVENTS; the pump reads it again last, which is what
 * re-arms the descriptor). A failure says yes: the path then hands the request over as usual. */
static bool input_waiting(td_transport_t *transport)
{
    td_zmq_t *z = (td_zmq_t *)transport;
    uint32_t events = 0;
    size_t size = sizeof events;
    bool waiting =
        zmq_getsockopt(z->rt.socket, ZMQ_EVENTS, &events, &size) != 0 || (events & ZMQ_POLLIN) != 0;
    z->settled = false; /* a look that may have taken the descriptor's signal */
    z->none_waiting = !waiting;
    return waiting;
}

static const td_transport_ops_t zmq_ops = {
    .name = "zeromq", .send_reply = td_zmq_send_reply, .input_waiting = input_waiting};

/* ---- Reading ---------------------------------------------------------------------------- */

/* The path is done with a payload frame, held in its request (any thread). */
static void frame_close(void *data, void *hint)
{
    (void)data;
    zmq_msg_close(hint); /* a frame that is not a message: nothing to do, no error to handle */
}

_Static_assert(sizeof(zmq_msg_t) <= TD_PAYLOAD_HOLDER_MAX, "a frame fits a request's holder");

/* td_msg_t.hold: the payload frame moved into its request's room (no allocation, no copy). */
static td_bytes_t hold_frame(void *room, void *frame)
{
    zmq_msg_t *held = room;
    zmq_msg_init(held);
    zmq_msg_move(held, frame);
    return (td_bytes_t){.data = zmq_msg_data(held),
                        .len = zmq_msg_size(held),
                        .free_fn = frame_close,
                        .hint = held};
}

/* No memory for a request: answered `internal` all the same (td_reply_no_memory). */
static void answer_no_memory(td_zmq_t *z, const td_msg_t *m)
{
    td_reply_t reply;
    td_reply_no_memory(m, &reply);
    td_err("out of memory: request %" PRIu64 " answered `internal`", reply.rep.request_id);
    (void)td_zmq_send_now(z, &reply); /* a peer gone or not reading: as for any reply */
    td_zmq_conn_answered(m->from.ctx);
}

/* One received message (frames[0..kept) of `total`, of sizes[0..kept) bytes) to the path. The
 * envelope: its sender (the routing id its reply goes to, td_zmq_conn_of, and who CURVE says that
 * is) and a REQ peer's delimiter: any peer's empty first frame is taken as one and echoed
 * (PROTOCOL.md §1), a header is never empty. */
static void handle_message(td_zmq_t *z, zmq_msg_t *frames, const size_t *sizes, int kept, int total)
{
    /* A ROUTER's message is the routing id and at least one frame: kept >= 2. */
    bool delimiter = sizes[1] == 0;
    int body = delimiter ? 2 : 1;
    const uint8_t *id = zmq_msg_data(&frames[0]);
    size_t id_len = sizes[0];
    td_zmq_conn_t *conn = td_zmq_conn_of(z, &frames[kept - 1], &id, &id_len);
    /* A metadata lookup is a map search in libzmq (~360 instructions, bench/NOTES.md): only a
     * ZAP handler (CURVE on) sets User-Id, so without one there is none to look up. */
    td_msg_t m = {
        .from = {.id = id,
                 .id_len = id_len,
                 .user = z->rt.auth ? zmq_msg_gets(&frames[kept - 1], "User-Id") : NULL,
                 .word = delimiter ? TD_ZMQ_DELIMITER : 0,
                 .ctx = conn},
        .header = body < kept ? zmq_msg_data(&frames[body]) : NULL,
        .header_len = body < kept ? sizes[body] : 0,
        .frames = total - body,
    };
    if (m.frames == 2 && sizes[body + 1] <= TD_PAYLOAD_BORROW_MAX) {
        /* lent: the path copies it, the frame is released with the others (read_message) */
        m.payload = (td_bytes_t){.data = zmq_msg_data(&frames[body + 1]), .len = sizes[body + 1]};
        m.payload_borrowed = true;
    } else if (m.frames == 2) {
        m.hold = hold_frame; /* moved into the request: the frame closed below is empty */
        m.hold_ctx = &frames[body + 1];
    }
    td_zmq_conn_read(z, conn); /* before: the path may answer at once */
    if (td_path_submit(z->env.path, &z->base, &m) != TD_OK) /* no memory for the request */
        answer_no_memory(z, &m); /* the payload is the frame's still, closed with it */
}

/* Reads one whole message. Returns 1 when one was handled, 0 when none was waiting. The frames
 * kept are received in place (no move from a scratch frame: bench/NOTES.md, "The front's
 * instructions and wake-ups"), their sizes as zmq_msg_recv returns them (no zmq_msg_size
 * calls); those beyond them go through the last slot, released at once. */
static int read_message(td_zmq_t *z)
{
    zmq_msg_t frames[TD_FRAMES_KEPT + 1];
    size_t sizes[TD_FRAMES_KEPT + 1];
    int kept = 0;
    int total = 0;
    for (;;) {
        zmq_msg_t *frame = &frames[kept];
        zmq_msg_init(frame);
        int rc = zmq_msg_recv(frame, z->rt.socket, ZMQ_DONTWAIT);
        if (rc == -1) {
            int err = errno;
            zmq_msg_close(frame);
            if (total == 0 && (err == EAGAIN || err == EINTR))
                return 0;
            /* Cannot happen for the later frames of a message (ZeroMQ delivers multipart
             * messages whole); if it ever does, answer what arrived. */
            td_err("receiving a message: %s", zmq_strerror(err));
            break;
        }
        /* zmq_msg_recv's count stops at INT_MAX */
        sizes[kept] = rc < INT_MAX ? (size_t)rc : zmq_msg_size(frame);
        bool more = zmq_msg_more(frame);
        if (kept < TD_FRAMES_KEPT)
            kept++;
        else
            zmq_msg_close(frame);
        total++;
        if (!more)
            break;
    }
    handle_message(z, frames, sizes, kept, total);
    for (int i = 0; i < kept; i++)
        zmq_msg_close(&frames[i]);
    return 1;
}

/* ---- The pump --------------------------------------------------------------------------- */

static void idle_cb(uv_idle_t *handle)
{
    (void)handle; /* its only job is to keep the loop from blocking; check_cb does the work */
}

/* Keeps the loop from blocking in poll while input remains that the pump has not read yet. */
static void set_idle(td_zmq_t *z, bool on)
{
    if (on == z->idle_active)
        return;
    /* libuv's uv_idle_start fails only without a callback, uv_idle_stop never: no error. */
    if (on)
        uv_idle_start(&z->idle, idle_cb);
    else
        uv_idle_stop(&z->idle);
    z->idle_active = on;
}

void td_zmq_pump(td_zmq_t *z)
{
    if (z->closed)
        return;
    td_zmq_monitor_read(z); /* connections closed: before their last replies are sent */
    td_path_t *path = z->env.path;
    td_path_take_replies(path); /* the shards' replies: sent before ZMQ_EVENTS is read below */
    int budget = TD_READ_BUDGET;
    bool read_any = false;
    /* A read that input_waiting has just said would find nothing is not tried (a failed read is
     * two system calls in libzmq); the look at ZMQ_EVENTS below sees what came since. */
    z->none_waiting = false;
    while (td_path_may_read(path) && budget > 0 && !z->none_waiting && read_message(z)) {
        budget--;
        read_any = true;
    }

    /* Reading ZMQ_EVENTS last re-arms the edge-triggered fd. */
    uint32_t events = 0;
    size_t size = sizeof events;
    if (zmq_getsockopt(z->rt.socket, ZMQ_EVENTS, &events, &size) != 0) {
        td_err("reading ZMQ_EVENTS: %s", zmq_strerror(errno));
        events = ZMQ_POLLIN; /* look again on the next iteration rather than sleep */
    }
    bool input = (events & ZMQ_POLLIN) != 0;
    bool reading = td_path_may_read(path);
    if (input && !reading && !td_path_stopping(path)) /* held: the ports' replies wake the loop */
        reading = td_path_wait_for_room(path);
    bool at_limit = !td_path_stopping(path) && !reading;
    if (input && at_limit && !z->paused) {
        z->env.metrics->read_pauses++;
        td_debug("%u requests in flight: reading paused", td_path_inflight(path));
    }
    z->paused = input && at_limit;
    bool more = input && reading;
    set_idle(z, more);
    z->settled = !input && !td_path_stopping(path); /* stopping: zmq_pumped after every turn */
    z->env.pumped(z->env.owner, read_any, more); /* last: it may close the transport */
}

static void poll_cb(uv_poll_t *handle, int status, int events)
{
    (void)status;
    (void)events;
    td_zmq_pump(handle->data);
}

/* After every loop iteration. With the socket settled and nothing in flight (the lone request
 * answered), the pump would only repeat the look its last run ended with (six system calls in
 * libzmq: bench/NOTES.md, "System calls a lone request"), so it is not run. Under load it runs
 * as before: the messages that came meanwhile are read in this iteration, not the next (skipped
 * then too, it cost 8 % of the rate on the H100). */
static void check_cb(uv_check_t *handle)
{
    td_zmq_t *z = handle->data;
    if (z->settled && td_path_inflight(z->env.path) == 0)
        return;
    td_zmq_pump(z);
}

/* ---- Life cycle ------------------------------------------------------------------------- */

#define TD_ZMQ_HANDLES 5
static void zmq_handles(td_zmq_t *z, uv_handle_t *all[TD_ZMQ_HANDLES])
{
    all[0] = (uv_handle_t *)&z->poll;
    all[1] = (uv_handle_t *)&z->check;
    all[2] = (uv_handle_t *)&z->idle;
    all[3] = (uv_handle_t *)&z->retry_timer;
    all[4] = (uv_handle_t *)&z->monitor_poll;
}

static int open_handles(td_zmq_t *z)
{
    uv_loop_t *loop = z->env.loop;
    /* libuv's uv_check_init, uv_idle_init and uv_timer_init only fill in the handle and return
     * 0, and uv_check_start fails only without a callback: the descriptors' polls are what can
     * fail. */
    uv_check_init(loop, &z->check);
    uv_idle_init(loop, &z->idle);
    uv_timer_init(loop, &z->retry_timer);
    int rc = uv_poll_init_socket(loop, &z->poll, z->rt.fd);
    if (rc == 0)
        rc = uv_poll_init_socket(loop, &z->monitor_poll, z->rt.monitor_fd);
    uv_handle_t *handles[TD_ZMQ_HANDLES];
    zmq_handles(z, handles);
    for (size_t i = 0; i < TD_ZMQ_HANDLES; i++)
        handles[i]->data = z;
    if (rc == 0)
        rc = uv_poll_start(&z->poll, UV_READABLE, poll_cb);
    if (rc == 0)
        rc = uv_poll_start(&z->monitor_poll, UV_READABLE, poll_cb);
    if (rc != 0) {
        td_err("cannot set up the event loop: %s", uv_strerror(rc));
        return rc;
    }
    uv_check_start(&z->check, check_cb);
    return 0;
}

/* A failed start: the handles that were initialised (a zeroed handle has no type yet), then the
 * socket, CURVE and the context. */
static void close_failed(td_zmq_t *z)
{
    uv_handle_t *handles[TD_ZMQ_HANDLES];
    zmq_handles(z, handles);
    for (size_t i = 0; i < TD_ZMQ_HANDLES; i++)
        if (handles[i]->type != UV_UNKNOWN_HANDLE && !uv_is_closing(handles[i]))
            uv_close(handles[i], NULL);
    uv_run(z->env.loop, UV_RUN_NOWAIT);
    td_router_close_monitor(&z->rt);
    if (z->rt.socket)
        zmq_close(z->rt.socket); /* fails only for what is not a socket */
    td_auth_destroy(&z->rt.auth); /* its sockets are in the context */
    while (z->rt.ctx && zmq_ctx_term(z->rt.ctx) == -1 && errno == EINTR)
        continue;
    free(z);
}

td_err_t td_zmq_new(const td_zmq_env_t *env, td_zmq_t **out)
{
    td_zmq_t *z = calloc(1, sizeof *z);
    if (!z)
        return TD_ERR_NOMEM;
    z->base = (td_transport_t){.ops = &zmq_ops, .path = env->path};
    z->env = *env;
    td_err_t err = td_router_open(env->cfg, &z->rt);
    if (err == TD_OK && open_handles(z) != 0)
        err = TD_ERR_LIBRARY;
    if (err != TD_OK) {
        close_failed(z);
        return err;
    }
    *out = z;
    return TD_OK;
}

void td_zmq_close(td_zmq_t *z)
{
    if (z->closed)
        return;
    z->closed = true;
    uv_poll_stop(&z->poll); /* before zmq_close: libuv must stop watching the fd first */
    uv_poll_stop(&z->monitor_poll);
    uv_handle_t *handles[TD_ZMQ_HANDLES];
    zmq_handles(z, handles);
    for (size_t i = 0; i < TD_ZMQ_HANDLES; i++)
        uv_close(handles[i], NULL);
    td_zmq_drop_kept(z); /* replies kept for connections that closed are dropped */
    td_zmq_conns_free(z);
}

void td_zmq_close_socket(td_zmq_t *z)
{
    if (!z->rt.socket)
        return;
    td_router_close_monitor(&z->rt);
    /* Neither fails on a socket of a context not yet terminated (zmq_ctx_term comes after, in
     * td_zmq_destroy), with an int's size for ZMQ_LINGER. */
    int linger = TD_SHUTDOWN_LINGER_MS;
    zmq_setsockopt(z->rt.socket, ZMQ_LINGER, &linger, sizeof linger);
    zmq_close(z->rt.socket);
    z->rt.socket = NULL;
}

void td_zmq_destroy(td_zmq_t **self_p)
{
    td_zmq_t *z = *self_p;
    if (!z)
        return;
    td_auth_destroy(&z->rt.auth); /* its sockets are in the context */
    /* Waits (up to the linger) for the last replies to leave. A signal (a second SIGTERM)
     * interrupts the wait with EINTR and leaves the context, its I/O thread and every message
     * it holds allocated: wait again. */
    while (zmq_ctx_term(z->rt.ctx) == -1 && errno == EINTR)
        continue;
    free(z);
    *self_p = NULL;
}

void *td_zmq_context(const td_zmq_t *self)
{
    return self->rt.ctx;
}

td_auth_t *td_zmq_auth(const td_zmq_t *self)
{
    return self->rt.auth;
}

void td_zmq_reload(td_zmq_t *self, const td_config_t *cfg)
{
    if (!self->closed)
        td_auth_reload(self->rt.auth, cfg);
}

void td_zmq_gauges(const td_zmq_t *self, td_reply_gauges_t *replies, bool *curve,
                   td_auth_counts_t *auth)
{
    replies->connections_lost = self->lost_total;
    replies->resent = self->resent_total;
    replies->rerouted = self->rerouted_total;
    if (self->rt.auth) {
        *curve = true;
        td_auth_counts(self->rt.auth, auth);
    }
}
