/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_zmq_front.c — fronts: ZeroMQ endpoints with a ROUTER socket and a thread each (see
 * td_zmq_front.h).
 *
 * Design
 * ------
 * ZeroMQ binds one socket to an endpoint, and one socket is read by one thread: on the GPU host
 * the plain ZeroMQ echo on one ROUTER ran at 0.12-0.20 x Redis's pipelined INCR, so nothing
 * behind the loop thread's socket could reach issue 31's target (bench/NOTES.md, "Not done, and
 * why"). A front is that socket again with a thread of its own, on an endpoint of its own; a
 * client connects to any endpoint (libtally to the one it is given), and a producer spreads over
 * several by connecting to each (loadgen --fronts).
 *
 * A front's thread, in a loop:
 *   1. takes the replies its port's mailbox holds (td_path_port_take_replies) and sends each:
 *      [routing id][delimiter, when the request had one][header][payload], the payload handed
 *      to ZeroMQ without a copy (it stays counted in the reply bounds until ZeroMQ frees it);
 *   2. reads up to TD_FRONT_BUDGET messages, each handed to its port as the loop thread hands
 *      its own to the path (td_msg_t: the routing id the sender, CURVE's User-Id the user, a
 *      small payload lent, a larger one's frame moved into the request); at max_inflight the
 *      port says busy and the message waits here, its frames held, until replies free slots:
 *      ZeroMQ's high-water marks push back, as on the loop thread's socket;
 *   3. posts what it read, a batch per shard (td_path_port_flush), counts the handshakes its
 *      socket's monitor reported (with CURVE: tallyd_auth_total counts every endpoint's, as
 *      PROTOCOL.md says), and sleeps in zmq_poll on its socket, that monitor and the eventfd the
 *      shards write when they post a reply to a sleeping port (td_path_port_sleep, last before
 *      the poll).
 * Per-stream order: a connection's requests are read in order and a stream's go to its shard in
 * one batch, in order (td_path_port.c). The sequence rules, `busy` at max_inflight (the port
 * counts its requests with the front's and the other ports'), stream limits, the reply bounds
 * and the scheduler's turns between connections are the shards', as for any request.
 *
 * Admission per connection: the port identifies each request on the front's thread in a peers'
 * table of the front's own (td_path_port_admit; one per front: the table is one thread's), so a
 * connection is held to its share of the in-flight slots (max_inflight_per_peer, judged among
 * the front's connections with requests in flight) and to its reply bytes, and a client to its
 * streams and creation rate. What differs from the loop thread's socket:
 *   - a client (CURVE's user, else the connection) is counted per front: one that uses two
 *     fronts has two entries, each held to the per-client limits; per-user metrics
 *     (tallyd_client_*) are the loop thread's socket's alone;
 *   - the admission reads a copy of the configuration made at start, so a reload's
 *     max_inflight_per_peer, max_inflight and stream_create_rate reach the fronts' shares at
 *     the next start (the shards' checks read the live values as before);
 *   - no record of connections (td_zmq_conn.c): a reply to a connection that has gone is dropped
 *     at once (counted), not kept for it to reconnect; the lost-connection counters are the
 *     loop thread's socket's;
 *   - shared-memory and device references are resolved on the request's shard against the
 *     sender's regions (its routing id, as libtally registers them), not pinned as the front
 *     reads them: a region released between the read and the run is `not_found`, not run.
 *
 * Stopping: the port's requests count in td_path_inflight, so the server waits for them; while
 * stopping the thread tells the loop when it reads or answers (td_fronts_env_t.pumped), so the
 * loop looks again whether it may close. Requests read after the stop are answered `shutdown`
 * by their shards, those after the drain or the close by the port itself. td_fronts_stop (after
 * td_path_close, the shards ended) tells each thread to end: it submits a message it held, takes
 * and sends every reply left (its port's requests all answered), closes its socket with a short
 * linger, and is joined. Every request a front read gets exactly one reply.
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include "td_admit.h"
#include "td_zmq_front.h"
#include "td_log.h"
#include "td_path.h"
#include "td_peers.h"
#include "td_router.h"

/* Messages read per turn before the batches are posted and the replies taken. */
#define TD_FRONT_BUDGET 256
/* Frames of one message kept (as td_zmq.c): routing id, delimiter, header, payload. */
#define TD_FRONT_FRAMES 4
/* How long a stopping front's socket may keep flushing its last replies (as td_zmq.c's). */
#define TD_FRONT_LINGER_MS 1000
/* Held at max_inflight with nothing of its own in flight, a thread looks again this often. */
#define TD_FRONT_FULL_POLL_MS 1
/* While stopping, a sleeping thread looks at its stop flag this often. */
#define TD_FRONT_STOP_POLL_MS 10

/* td_sender_t.word: the message came with a REQ peer's delimiter, echoed (as td_zmq_int.h). */
#define FRONT_DELIMITER 1u

/* A message read and not yet taken by the port (busy at max_inflight). */
typedef struct {
    zmq_msg_t frames[TD_FRONT_FRAMES + 1];
    size_t sizes[TD_FRONT_FRAMES + 1];
    int kept;
    int total;
    bool held;
} message_t;

typedef struct {
    td_transport_t base; /* first: the port's requests name it */
    struct td_fronts *set;
    unsigned index;
    char *endpoint;
    void *socket;
    void *monitor; /* its handshake events, with CURVE (tallyd_auth_total), else NULL */
    int wake_fd;
    td_path_port_t *port;
    td_peers_t *peers;
    td_admit_t admit;
    td_metrics_t admit_metrics; /* td_admit_t's; the shards count refusals in their own */
    message_t msg;
    uint64_t swept_ns; /* the last sweep of its peers' table */
    pthread_t thread;
    bool running;
    _Atomic bool stop;
    _Atomic uint64_t requests, replies, dropped_gone, dropped_slow, busy_waits;
} front_t;

struct td_fronts {
    td_fronts_env_t env;
    td_config_t admit_cfg; /* the admission's copy (see the design) */
    unsigned count;
    front_t *fronts;
    uv_async_t wake; /* a stopping front has read or answered */
    bool wake_open;
    _Atomic bool stopping;
    _Atomic bool read_while_stopping;
};

static const td_transport_ops_t front_ops = {.name = "zeromq-front"};

/* ---- Replies (the front's thread) ------------------------------------------------------- */

static void count(_Atomic uint64_t *counter)
{
    atomic_store_explicit(counter, atomic_load_explicit(counter, memory_order_relaxed) + 1,
                          memory_order_relaxed); /* one writer: its thread */
}

/* The payload as a ZeroMQ message: moved when it has a free function (ZeroMQ frees it on its
 * I/O thread, once written out), else copied. */
static int body_message(td_reply_t *reply, zmq_msg_t *body)
{
    td_bytes_t *b = &reply->body;
    if (b->free_fn && b->len) {
        if (zmq_msg_init_data(body, b->data, b->len, b->free_fn, b->hint) != 0)
            return errno;
        td_bytes_taken(b);
        return 0;
    }
    if (zmq_msg_init_size(body, b->len) != 0)
        return errno;
    if (b->len)
        memcpy(zmq_msg_data(body), b->data, b->len);
    return 0;
}

/* 0, or the errno of the first frame's send (EHOSTUNREACH: gone; EAGAIN: not reading). Once the
 * first frame is taken ZeroMQ takes the rest of the message whole. */
static int send_now(front_t *f, td_reply_t *reply)
{
    const int more = ZMQ_DONTWAIT | ZMQ_SNDMORE;
    if (zmq_send(f->socket, reply->to.id, reply->to.id_len, more) == -1)
        return errno;
    int err = 0;
    if ((reply->to.word & FRONT_DELIMITER) && zmq_send(f->socket, "", 0, more) == -1)
        err = errno;
    if (!err && zmq_send(f->socket, reply->header, TALLY_REP_HEADER_SIZE, more) == -1)
        err = errno;
    zmq_msg_t body;
    if (!err && (err = body_message(reply, &body)) == 0 &&
        zmq_msg_send(&body, f->socket, ZMQ_DONTWAIT) == -1) {
        err = errno;
        zmq_msg_close(&body);
    }
    if (err)
        td_err("front %s: sending the reply to request %" PRIu64 ": %s", f->endpoint,
               reply->rep.request_id, zmq_strerror(err));
    return err;
}

static void send_reply(void *ctx, td_reply_t *reply)
{
    front_t *f = ctx;
    int err = send_now(f, reply);
    if (!err)
        count(&f->replies);
    else if (err == EAGAIN)
        count(&f->dropped_slow);
    else
        count(&f->dropped_gone);
}

/* ---- Reading (the front's thread) ------------------------------------------------------- */

static void frame_close(void *data, void *hint)
{
    (void)data;
    zmq_msg_close(hint);
}

/* td_msg_t.hold: the payload frame moved into its request (no allocation, no copy). */
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

/* Receives one whole message into f->msg: false when none was waiting. */
static bool receive(front_t *f)
{
    message_t *m = &f->msg;
    m->kept = m->total = 0;
    for (;;) {
        zmq_msg_t *frame = &m->frames[m->kept];
        zmq_msg_init(frame);
        int rc = zmq_msg_recv(frame, f->socket, ZMQ_DONTWAIT);
        if (rc == -1) {
            int err = errno;
            zmq_msg_close(frame);
            if (m->total == 0)
                return false;
            td_err("front %s: receiving a message: %s", f->endpoint, zmq_strerror(err));
            break;
        }
        m->sizes[m->kept] = rc < INT_MAX ? (size_t)rc : zmq_msg_size(frame);
        bool more = zmq_msg_more(frame);
        if (m->kept < TD_FRONT_FRAMES)
            m->kept++;
        else
            zmq_msg_close(frame);
        m->total++;
        if (!more)
            break;
    }
    m->held = true;
    return true;
}

static void release(message_t *m)
{
    for (int i = 0; i < m->kept; i++)
        zmq_msg_close(&m->frames[i]);
    m->held = false;
}

/* No memory for a request: answered `internal` all the same (td_reply_no_memory). */
static void answer_no_memory(front_t *f, const td_msg_t *m)
{
    td_reply_t reply;
    td_reply_no_memory(m, &reply);
    td_err("front %s: out of memory: request %" PRIu64 " answered `internal`", f->endpoint,
           reply.rep.request_id);
    send_reply(f, &reply);
}

/* The held message to the port: false when the port is busy (it stays held). */
static bool submit_held(front_t *f)
{
    message_t *h = &f->msg;
    bool delimiter = h->kept > 1 && h->sizes[1] == 0;
    int body = delimiter ? 2 : 1;
    td_msg_t m = {
        .from = {.id = zmq_msg_data(&h->frames[0]),
                 .id_len = h->sizes[0],
                 .user = f->set->env.auth ? zmq_msg_gets(&h->frames[h->kept - 1], "User-Id") : NULL,
                 .word = delimiter ? FRONT_DELIMITER : 0},
        .header = body < h->kept ? zmq_msg_data(&h->frames[body]) : NULL,
        .header_len = body < h->kept ? h->sizes[body] : 0,
        .frames = h->total - body,
    };
    if (m.frames == 2 && body + 1 < h->kept && h->sizes[body + 1] <= TD_PAYLOAD_BORROW_MAX) {
        m.payload =
            (td_bytes_t){.data = zmq_msg_data(&h->frames[body + 1]), .len = h->sizes[body + 1]};
        m.payload_borrowed = true;
    } else if (m.frames == 2 && body + 1 < h->kept) {
        m.hold = hold_frame;
        m.hold_ctx = &h->frames[body + 1];
    }
    td_err_t err = td_path_port_submit(f->port, &m);
    if (err == TD_ERR_BUSY)
        return false;
    if (err != TD_OK)
        answer_no_memory(f, &m);
    else
        count(&f->requests);
    release(h);
    return true;
}

/* Reads and submits up to the budget: whether anything was read. */
static bool read_some(front_t *f)
{
    bool read_any = false;
    for (int budget = TD_FRONT_BUDGET; budget > 0; budget--) {
        if (!f->msg.held && !receive(f))
            break;
        read_any = true;
        if (!submit_held(f)) {
            count(&f->busy_waits);
            break;
        }
    }
    return read_any;
}

/* ---- The thread ------------------------------------------------------------------------- */

static void wake_port(void *ctx)
{
    front_t *f = ctx;
    uint64_t one = 1;
    ssize_t n = write(f->wake_fd, &one, sizeof one); /* full (never): a wake-up is pending */
    (void)n;
}

/* While stopping: the loop looks again (td_fronts_env_t.pumped). */
static void tell_loop(front_t *f, bool read_any)
{
    td_fronts_t *set = f->set;
    if (!atomic_load_explicit(&set->stopping, memory_order_acquire))
        return;
    if (read_any)
        atomic_store_explicit(&set->read_while_stopping, true, memory_order_release);
    uv_async_send(&set->wake);
}

/* The handshakes CURVE counts, as the loop thread counts its socket's (td_zmq_monitor_read):
 * td_auth_event's counters are atomics, its log's rate limit under its lock. */
static void count_handshakes(front_t *f)
{
    uint16_t event;
    uint32_t value;
    while (f->monitor && td_router_monitor_next(f->monitor, &event, &value))
        td_auth_event(f->set->env.auth, event, value);
}

/* Idle entries of its peers' table freed, every TD_PEERS_SWEEP_MS (the loop thread's sweep of
 * its own table, td_server.c): the table is this thread's. */
static void sweep(front_t *f)
{
    uint64_t now = uv_hrtime();
    if (now - f->swept_ns < (uint64_t)TD_PEERS_SWEEP_MS * 1000000u)
        return;
    f->swept_ns = now;
    td_peers_sweep(f->peers, now);
}

static void *front_main(void *arg)
{
    front_t *f = arg;
    f->swept_ns = uv_hrtime();
    zmq_pollitem_t items[3] = {{.socket = f->socket, .events = ZMQ_POLLIN},
                               {.fd = f->wake_fd, .events = ZMQ_POLLIN},
                               {.socket = f->monitor, .events = ZMQ_POLLIN}};
    int polled = f->monitor ? 3 : 2;
    for (;;) {
        bool stop = atomic_load_explicit(&f->stop, memory_order_acquire);
        unsigned answered = td_path_port_take_replies(f->port, send_reply, f);
        bool read_any = !stop && read_some(f);
        if (stop && f->msg.held) /* the path is closed: the port answers it itself */
            submit_held(f);
        td_path_port_flush(f->port);
        count_handshakes(f);
        sweep(f);
        if (read_any || answered)
            tell_loop(f, read_any);
        if (stop && !f->msg.held && td_path_port_inflight(f->port) == 0)
            break;
        /* Input waiting makes zmq_poll return at once (it reads ZMQ_EVENTS first); held at
         * max_inflight, one of its own replies (the eventfd) wakes it, or, with none in flight
         * (the slots are the other fronts' and the loop's, whose replies do not wake it), a
         * look every TD_FRONT_FULL_POLL_MS. */
        long timeout = td_path_port_sleep(f->port) ? -1 : 0;
        if (timeout && f->msg.held && !td_path_port_inflight(f->port))
            timeout = TD_FRONT_FULL_POLL_MS;
        if (stop && timeout)
            timeout = TD_FRONT_STOP_POLL_MS;
        items[0].events = f->msg.held || stop ? 0 : ZMQ_POLLIN;
        if (zmq_poll(items, polled, timeout) > 0 && (items[1].revents & ZMQ_POLLIN)) {
            uint64_t n;
            ssize_t got = read(f->wake_fd, &n, sizeof n);
            (void)got;
        }
    }
    return NULL;
}

/* ---- Life cycle (loop thread) ----------------------------------------------------------- */

static void wake_cb(uv_async_t *handle)
{
    td_fronts_t *set = handle->data;
    bool read_any =
        atomic_exchange_explicit(&set->read_while_stopping, false, memory_order_acq_rel);
    set->env.pumped(set->env.owner, read_any);
}

static td_err_t open_front(td_fronts_t *set, front_t *f, unsigned index)
{
    const td_fronts_env_t *env = &set->env;
    f->set = set;
    f->index = index;
    f->wake_fd = -1;
    f->base = (td_transport_t){.ops = &front_ops, .path = env->path};
    if (!(f->endpoint = strdup(env->cfg->fronts[index])))
        return TD_ERR_NOMEM;
    td_err_t err = td_peers_new_shards(env->shards, &f->peers);
    if (err != TD_OK)
        return err;
    td_peers_set_rate(f->peers, set->admit_cfg.stream_create_rate);
    f->admit = (td_admit_t){.cfg = &set->admit_cfg,
                            .peers = f->peers,
                            .replies = env->replies,
                            .metrics = &f->admit_metrics,
                            .rate = set->admit_cfg.stream_create_rate};
    f->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (f->wake_fd < 0) {
        td_err("front %s: eventfd: %s", f->endpoint, strerror(errno));
        return TD_ERR_LIBRARY;
    }
    err = td_router_open_front(env->zmq_ctx, env->auth, env->cfg, f->endpoint, &f->socket,
                               &f->monitor);
    if (err != TD_OK)
        return err;
    err = td_path_port_open(env->path, &f->base, wake_port, f, &f->port);
    if (err != TD_OK) {
        td_err("front %s: no port of the request path (%s; at most %u)", f->endpoint,
               td_err_name(err), TD_PATH_PORTS_MAX);
        return err;
    }
    td_path_port_admit(f->port, &f->admit);
    return TD_OK;
}

/* What open_front made (the thread has ended or never ran; the path is closed or never ran). */
static void close_front(front_t *f)
{
    if (f->msg.held)
        release(&f->msg);
    td_path_port_close(&f->port);
    td_router_unmonitor(f->socket, &f->monitor);
    if (f->socket) {
        int linger = TD_FRONT_LINGER_MS; /* an int option of an open socket: cannot fail */
        zmq_setsockopt(f->socket, ZMQ_LINGER, &linger, sizeof linger);
        zmq_close(f->socket);
        f->socket = NULL;
    }
    if (f->wake_fd >= 0)
        close(f->wake_fd);
    f->wake_fd = -1;
}

td_err_t td_fronts_new(const td_fronts_env_t *env, td_fronts_t **out)
{
    *out = NULL;
    td_fronts_t *set = calloc(1, sizeof *set);
    if (!set)
        return TD_ERR_NOMEM;
    set->env = *env;
    set->admit_cfg = *env->cfg; /* its numbers only: no string of it is read or freed here */
    set->count = (unsigned)env->cfg->front_count;
    set->fronts = calloc(set->count ? set->count : 1, sizeof *set->fronts);
    td_err_t err = set->fronts ? TD_OK : TD_ERR_NOMEM;
    for (unsigned i = 0; err == TD_OK && i < set->count; i++)
        err = open_front(set, &set->fronts[i], i);
    if (err == TD_OK && set->count) {
        /* uv_async_init fails only without memory for nothing: it fills in the handle */
        err = uv_async_init(env->loop, &set->wake, wake_cb) == 0 ? TD_OK : TD_ERR_LIBRARY;
        set->wake.data = set;
        set->wake_open = err == TD_OK;
    }
    if (err != TD_OK) {
        td_fronts_destroy(&set);
        return err;
    }
    *out = set;
    return TD_OK;
}

td_err_t td_fronts_run(td_fronts_t *self)
{
    for (unsigned i = 0; i < self->count; i++) {
        front_t *f = &self->fronts[i];
        if (pthread_create(&f->thread, NULL, front_main, f) != 0) {
            td_err("front %s: cannot start its thread", f->endpoint);
            return TD_ERR_LIBRARY;
        }
        f->running = true;
    }
    return TD_OK;
}

void td_fronts_stopping(td_fronts_t *self)
{
    atomic_store_explicit(&self->stopping, true, memory_order_release);
    for (unsigned i = 0; i < self->count; i++)
        wake_port(&self->fronts[i]); /* a sleeping thread tells the loop what it has */
}

void td_fronts_stop(td_fronts_t *self)
{
    for (unsigned i = 0; i < self->count; i++) {
        front_t *f = &self->fronts[i];
        atomic_store_explicit(&f->stop, true, memory_order_release);
        if (f->running) {
            wake_port(f);
            pthread_join(f->thread, NULL);
            f->running = false;
        }
        close_front(f);
    }
    if (self->wake_open) {
        uv_close((uv_handle_t *)&self->wake, NULL);
        self->wake_open = false;
    }
}

void td_fronts_destroy(td_fronts_t **self_p)
{
    td_fronts_t *set = *self_p;
    if (!set)
        return;
    td_fronts_stop(set); /* a failed start: nothing ran */
    for (unsigned i = 0; set->fronts && i < set->count; i++) {
        td_peers_destroy(&set->fronts[i].peers);
        free(set->fronts[i].endpoint);
    }
    free(set->fronts);
    free(set);
    *self_p = NULL;
}

unsigned td_fronts_count(const td_fronts_t *self)
{
    return self ? self->count : 0;
}

const char *td_fronts_endpoint(const td_fronts_t *self, unsigned i)
{
    return self->fronts[i].endpoint;
}

void td_fronts_counts(const td_fronts_t *self, unsigned i, td_front_counts_t *out)
{
    front_t *f = &self->fronts[i];
    *out = (td_front_counts_t){
        .requests = atomic_load_explicit(&f->requests, memory_order_relaxed),
        .replies = atomic_load_explicit(&f->replies, memory_order_relaxed),
        .dropped_gone = atomic_load_explicit(&f->dropped_gone, memory_order_relaxed),
        .dropped_slow = atomic_load_explicit(&f->dropped_slow, memory_order_relaxed),
        .busy_waits = atomic_load_explicit(&f->busy_waits, memory_order_relaxed)};
}
