/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally.c — libtally: the ZeroMQ client of tallyd (API and contracts in tally.h).
 *
 * Transport. One ZeroMQ context and one DEALER socket per client. LINGER 0 so destroying a
 * client never waits for a dead daemon; high-water marks sized for a deep pipeline of 1 MiB
 * chunks. Every wait is a zmq_poll against a deadline computed once per call, so a call that
 * sends and then receives is bounded by one timeout, not two.
 *
 * Connection. A request must never be queued toward a daemon that is not connected (a DEALER
 * would hold it and deliver it whenever one appears, perhaps long after the caller gave up).
 * ZMQ_IMMEDIATE would do that, but it has a cost we cannot accept: when the connection breaks,
 * ZeroMQ's session hiccups the pipe and, with IMMEDIATE, the socket terminates it at once
 * (socket_base_t::hiccuped -> pipe_t::terminate(false)), dropping every reply that had arrived
 * but was not yet read. A numbered push stopped by a restart then under-reported what was
 * applied (1-3 of 24 replies lost in about one SIGTERM in four; all of them when the reader is
 * not inside libtally at that moment). So the socket keeps ZeroMQ's default (its pipe outlives
 * the connection and every received reply stays readable), and the client tracks the
 * connection itself from a socket monitor (handshake done / disconnected, on an inproc PAIR):
 * a send waits, within its deadline, until the connection is up. ZeroMQ says when an attempt to
 * connect failed (CONNECT_RETRIED) but not why; when that happens before the client ever
 * reached anything, the wait asks the system once (tally_endpoint_probe, tally_probe.c), and a
 * refused port or a missing socket file fails at once, named, where ZeroMQ would retry in
 * silence until the deadline. Only then: a probe is a connection of its own, which a CURVE
 * tallyd would count as a failed handshake.
 *
 * Replies. A reply is exactly [64-byte header][payload]. The payload frame is kept as a
 * zmq_msg_t inside tally_reply_t (no copy); error payloads are copied into reply->error.
 *
 * Shared memory. A region is a memfd sealed against shrinking and growing (the daemon refuses
 * anything else, so it can never be truncated under the daemon's reads), mapped here and passed
 * to the daemon with SCM_RIGHTS over its side channel, one SOCK_SEQPACKET connection per client
 * opened with the first region. The daemon binds each region to the ZeroMQ routing id of the
 * client that registered it, so every client sets a random routing id on its DEALER socket.
 *
 * tally_run. The input is cut into chunks; chunk k uses slot k % W of a window of W slots,
 * so at most W requests are outstanding or waiting to be merged. Replies arrive in any order
 * and are held in their slot; merging happens strictly in chunk order, which keeps filter
 * output in input order and lets a stateless scan add the running total of the chunks before
 * it (each chunk was scanned from 0 and reported its total in aux0).
 */
#include "tally.h"
#include "tally_args.h"
#include "tally_client_nats.h"
#include "tally_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <zmq.h>

/* Enough for W = 8 windows of 1 MiB chunks many times over, small enough that a stalled
 * daemon pushes back on a producer long before memory is a concern. */
#define TALLY_HWM 1000

/* Bytes of the random ZeroMQ routing id (the daemon binds regions to it). */
#define TALLY_ROUTING_ID_BYTES 16

struct tally_client {
    void *ctx;
    void *sock;
    int timeout_ms;
    uint64_t next_id;
    char error[TALLY_ERROR_MESSAGE_MAX + 1];
    uint8_t routing_id[TALLY_ROUTING_ID_BYTES];
    int side_fd;           /* the shared-memory side channel, -1 until the first region */
    size_t max_batch;      /* the daemon's, from the info side_connect reads; 0 until then */
    tally_bufpool_t *pool; /* tally_send's copies of large payloads (tally_bufpool.c) */
    void *monitor;         /* PAIR receiving sock's connection events */
    bool connected;        /* the last event said: handshake done (not: disconnected) */
    bool reached;          /* ZeroMQ's connection was made once (then a break is waited for) */
    bool retried;          /* a connect attempt failed since the last probe */
    char *endpoint;        /* as connected to: the probe's and the messages' */
    int64_t checked_us;    /* when the monitor was last read */
    tally__natsc_t *natsc; /* tally_client_new_nats: a fleet over NATS, no ZeroMQ socket */
};

struct tally_region {
    tally_client_t *client;
    void *base;
    size_t size;
    uint64_t handle;
    bool device; /* a device region (tally_gpu_register_fd): base is a device address */
};

/* ---- Small helpers ------------------------------------------------------------------------ */

static int64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static int64_t deadline_after(const tally_client_t *self)
{
    return now_us() + (int64_t)self->timeout_ms * 1000;
}

static void set_msg(char *dst, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_msg(char *dst, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dst, TALLY_ERROR_MESSAGE_MAX + 1, fmt, ap);
    va_end(ap);
}

static tally_status_t fail(tally_client_t *self, tally_status_t status, const char *msg)
{
    snprintf(self->error, sizeof self->error, "%s", msg);
    return status;
}

/* Waits until the socket is readable or writable (`events`) or the deadline passes. */
static tally_status_t wait_socket(tally_client_t *self, short events, int64_t deadline)
{
    for (;;) {
        int64_t left_us = deadline - now_us();
        if (left_us <= 0)
            return TALLY_E_TIMEOUT;
        zmq_pollitem_t item = {.socket = self->sock, .events = events};
        long wait_ms = (long)((left_us + 999) / 1000);
        int rc = zmq_poll(&item, 1, wait_ms);
        if (rc < 0 && errno == EINTR)
            continue;
        if (rc < 0)
            return TALLY_E_TRANSPORT;
        if (rc > 0 && (item.revents & events))
            return TALLY_OK;
    }
}

/* Reads and discards the rest of a multipart message; returns how many frames it had. */
static int drain_frames(void *sock)
{
    int frames = 0, more = 1;
    while (more) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, sock, 0) < 0) {
            zmq_msg_close(&part);
            break;
        }
        frames++;
        more = zmq_msg_more(&part);
        zmq_msg_close(&part);
    }
    return frames;
}

const char *tally_version(void)
{
    return TALLY_VERSION;
}

/* ---- Client life cycle -------------------------------------------------------------------- */

static tally_status_t set_int_opt(void *sock, int opt, int value)
{
    return zmq_setsockopt(sock, opt, &value, sizeof value) == 0 ? TALLY_OK : TALLY_E_TRANSPORT;
}

/* ---- The connection's state (see "Connection" above) ---------------------------------------- */

/* The events that say whether requests can go out: the ZMTP handshake is done (the moment
 * ZMQ_IMMEDIATE would attach the pipe), or the connection broke. */
#define TALLY_MONITOR_EVENTS                                                                       \
    (ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_CONNECTED |                \
     ZMQ_EVENT_CONNECT_RETRIED)
#define TALLY_MONITOR_ADDR "inproc://tally-monitor" /* one per context, and a client has its own   \
                                                     */

/* Before the connect, so that no event is missed. */
static tally_status_t monitor_start(tally_client_t *self)
{
    if (zmq_socket_monitor(self->sock, TALLY_MONITOR_ADDR, TALLY_MONITOR_EVENTS) != 0)
        return TALLY_E_TRANSPORT;
    self->monitor = zmq_socket(self->ctx, ZMQ_PAIR);
    if (!self->monitor || set_int_opt(self->monitor, ZMQ_LINGER, 0) != TALLY_OK ||
        zmq_connect(self->monitor, TALLY_MONITOR_ADDR) != 0)
        return TALLY_E_TRANSPORT;
    return TALLY_OK;
}

static void monitor_stop(tally_client_t *self)
{
    zmq_socket_monitor(self->sock, NULL, 0);
    if (self->monitor)
        zmq_close(self->monitor);
    self->monitor = NULL;
}

/* Takes the events that have arrived; the last one decides. An event is two frames: 6 bytes
 * (uint16 event, uint32 value, native order) and the endpoint. */
static void monitor_drain(tally_client_t *self)
{
    for (;;) {
        zmq_msg_t ev;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, self->monitor, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&ev);
            return;
        }
        uint16_t event = 0;
        if (zmq_msg_size(&ev) >= sizeof event)
            memcpy(&event, zmq_msg_data(&ev), sizeof event);
        if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED)
            self->connected = true;
        else if (event == ZMQ_EVENT_DISCONNECTED)
            self->connected = false;
        self->reached |= event == ZMQ_EVENT_CONNECTED;
        self->retried |= event == ZMQ_EVENT_CONNECT_RETRIED;
        bool more = zmq_msg_more(&ev);
        zmq_msg_close(&ev);
        if (more)
            drain_frames(self->monitor);
    }
}

/* Reading the monitor costs a system call (ZeroMQ polls its command mailbox: 0.8-1 us on the
 * loaded 2-core dev box, 2026-11-26), too much for every send of a 4 KiB request; a connection
 * known to be up is taken as up for this long. A disconnect in that time is the same case as one
 * that comes just after the send: the request waits in the queue for the connection. */
#define TALLY_CONNECTED_TRUST_US 1000

/* ZeroMQ's attempts failed and none ever reached the endpoint: whether anything listens there,
 * asked with what is left of the deadline. TALLY_OK (something does now: the handshake is
 * waited for), or the failure with its message. */
static tally_status_t probe_why(tally_client_t *self, int64_t deadline)
{
    int64_t left_ms = (deadline - now_us()) / 1000;
    int err = tally_endpoint_probe(self->endpoint, left_ms > 0 ? (int)left_ms : 1);
    if (err == ETIMEDOUT) {
        snprintf(self->error, sizeof self->error, "cannot connect to %s: no answer within %d ms",
                 self->endpoint, self->timeout_ms);
        return TALLY_E_TIMEOUT;
    }
    if (err)
        snprintf(self->error, sizeof self->error, "cannot connect to %s: %s (is tallyd running?)",
                 self->endpoint, strerror(err));
    return err ? TALLY_E_TRANSPORT : TALLY_OK;
}

/* Waits until the connection is up or the deadline passes; on failure self->error says why. */
static tally_status_t wait_connected(tally_client_t *self, int64_t deadline)
{
    int64_t now = now_us();
    if (self->connected && now - self->checked_us < TALLY_CONNECTED_TRUST_US)
        return TALLY_OK;
    self->checked_us = now;
    monitor_drain(self);
    tally_status_t status = TALLY_OK;
    while (status == TALLY_OK && !self->connected) {
        int64_t left_us = deadline - now_us();
        zmq_pollitem_t item = {.socket = self->monitor, .events = ZMQ_POLLIN};
        if (self->retried && !self->reached) {
            self->retried = false;
            status = probe_why(self, deadline);
        } else if (left_us <= 0)
            status = fail(self, TALLY_E_TIMEOUT,
                          "timed out waiting for a connection to tallyd (is tallyd running? with "
                          "CURVE: does it accept this client's key?)");
        else if (zmq_poll(&item, 1, (long)((left_us + 999) / 1000)) < 0 && errno != EINTR)
            status = fail(self, TALLY_E_TRANSPORT, zmq_strerror(errno));
        else
            monitor_drain(self);
    }
    return status;
}

tally_status_t tally_client_wait_connected(tally_client_t *self)
{
    if (!self)
        return TALLY_E_ARG;
    if (self->natsc)
        return TALLY_OK;
    return wait_connected(self, now_us() + (int64_t)self->timeout_ms * 1000);
}

tally_status_t tally_client_new(const char *endpoint, int timeout_ms, tally_client_t **out)
{
    return tally_client_new_curve(endpoint, timeout_ms, NULL, out);
}

/* CURVE options must be set before the connect: a connection made without them would start a
 * plain handshake that tallyd refuses (and counts). */
static tally_status_t set_curve(void *sock, const tally_curve_keys_t *keys)
{
    if (!keys || !keys->server_public[0])
        return TALLY_OK;
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, keys->server_public, 40) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, keys->client_public, 40) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, keys->client_secret, 40) != 0)
        return TALLY_E_ARG;
    return TALLY_OK;
}

tally_status_t tally_client_new_curve(const char *endpoint, int timeout_ms,
                                      const tally_curve_keys_t *keys, tally_client_t **out)
{
    return tally_client_open(endpoint, timeout_ms, keys, out, NULL, 0);
}

tally_status_t tally_client_open(const char *endpoint, int timeout_ms,
                                 const tally_curve_keys_t *keys, tally_client_t **out, char *msg,
                                 size_t msg_cap)
{
    char none[1], why[320];
    if (!msg || !msg_cap) { /* no message wanted: written into none, cut to "" */
        msg = none;
        msg_cap = sizeof none;
    }
    msg[0] = '\0';
    if (!out) {
        snprintf(msg, msg_cap, "no place for the client (out is NULL)");
        return TALLY_E_ARG;
    }
    *out = NULL;
    if (timeout_ms <= 0) {
        snprintf(msg, msg_cap, "timeout %d ms: it must be above 0", timeout_ms);
        return TALLY_E_ARG;
    }
    if (!endpoint)
        endpoint = TALLY_DEFAULT_ENDPOINT;
    /* ZeroMQ would take "tcp://host:5570x" and connect to nothing */
    if (tally_endpoint_check(endpoint, TALLY_ENDPOINT_CONNECT, why, sizeof why) != TALLY_OK) {
        snprintf(msg, msg_cap, "invalid endpoint '%s': %s", endpoint, why);
        return TALLY_E_ARG;
    }

    tally_status_t status = TALLY_E_NOMEM;
    tally_client_t *self = calloc(1, sizeof *self);
    if (!self)
        goto fail;
    self->timeout_ms = timeout_ms;
    self->next_id = 1;
    self->side_fd = -1;
    self->pool = tally__bufpool_new();
    if (!self->pool || !(self->endpoint = strdup(endpoint)))
        goto fail_free;

    status = TALLY_E_TRANSPORT;
    self->ctx = zmq_ctx_new();
    if (!self->ctx)
        goto fail_free;
    self->sock = zmq_socket(self->ctx, ZMQ_DEALER);
    if (!self->sock)
        goto fail_ctx;
    if (set_int_opt(self->sock, ZMQ_LINGER, 0) || set_int_opt(self->sock, ZMQ_SNDHWM, TALLY_HWM) ||
        set_int_opt(self->sock, ZMQ_RCVHWM, TALLY_HWM) ||
        /* A backstop only: sends wait in wait_socket with the caller's deadline. */
        set_int_opt(self->sock, ZMQ_SNDTIMEO, timeout_ms))
        goto fail_sock;
    /* A random routing id (ZeroMQ reserves ids starting with a zero byte): the daemon accepts a
     * shared-memory reference only from the id that registered the region. */
    if (getrandom(self->routing_id, sizeof self->routing_id, 0) != (ssize_t)sizeof self->routing_id)
        goto fail_sock;
    self->routing_id[0] |= 0x80;
    if (zmq_setsockopt(self->sock, ZMQ_ROUTING_ID, self->routing_id, sizeof self->routing_id))
        goto fail_sock;
    if (set_curve(self->sock, keys) != TALLY_OK) {
        status = TALLY_E_ARG;
        snprintf(msg, msg_cap, "CURVE keys that are not 40 characters of Z85");
        goto fail_sock;
    }
    if (monitor_start(self) != TALLY_OK)
        goto fail_monitor;
    if ((status = tally__connect(self->sock, endpoint)) != TALLY_OK)
        goto fail_monitor;
    *out = self;
    return TALLY_OK;

fail_monitor:
    monitor_stop(self);
fail_sock:
    zmq_close(self->sock);
fail_ctx:
    zmq_ctx_term(self->ctx);
fail_free:
    tally__bufpool_destroy(&self->pool);
    free(self->endpoint);
    free(self);
fail:
    if (!msg[0])
        snprintf(msg, msg_cap, "cannot create a client for %s: %s", endpoint,
                 status == TALLY_E_NOMEM ? "out of memory" : zmq_strerror(zmq_errno()));
    return status;
}

tally_status_t tally_client_new_nats(const tally_nats_opts_t *opts, tally_client_t **out, char *msg,
                                     size_t msg_cap)
{
    if (!out || !opts)
        return TALLY_E_ARG;
    *out = NULL;
    tally_client_t *self = calloc(1, sizeof *self);
    if (!self)
        return TALLY_E_NOMEM;
    self->timeout_ms = opts->timeout_ms > 0 ? opts->timeout_ms : TALLY_DEFAULT_TIMEOUT_MS;
    self->side_fd = -1;
    tally_status_t status = tally__natsc_new(opts, &self->natsc, msg, msg_cap);
    if (status != TALLY_OK) {
        free(self);
        return status;
    }
    *out = self;
    return TALLY_OK;
}

void tally_client_destroy(tally_client_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tally_client_t *self = *self_p;
    if (self->natsc) {
        tally__natsc_destroy(&self->natsc);
        free(self);
        *self_p = NULL;
        return;
    }
    if (self->side_fd >= 0)
        close(self->side_fd);
    monitor_stop(self);
    zmq_close(self->sock);
    zmq_ctx_term(self->ctx); /* gives back every pooled buffer still queued */
    tally__bufpool_destroy(&self->pool);
    free(self->endpoint);
    free(self);
    *self_p = NULL;
}

int tally_client_timeout(const tally_client_t *self)
{
    return self ? self->timeout_ms : 0;
}

const char *tally_client_error(const tally_client_t *self)
{
    return self ? self->error : "";
}

/* ---- Replies ------------------------------------------------------------------------------ */

void tally_reply_init(tally_reply_t *reply)
{
    memset(reply, 0, sizeof *reply);
}

void tally_reply_clear(tally_reply_t *reply)
{
    if (!reply)
        return;
    if (reply->msg_) {
        zmq_msg_close(reply->msg_);
        free(reply->msg_);
    }
    tally_reply_init(reply);
}

/* ---- Send and receive --------------------------------------------------------------------- */

/* Validates req and queues its header frame (with ZMQ_SNDMORE), waiting for the socket until
 * the deadline; *id receives the request id. The caller must then send the payload frame. */
static tally_status_t send_header_until(tally_client_t *self, const tally_req_t *req, size_t len,
                                        uint64_t *id, int64_t deadline)
{
    tally_req_t wire = *req;
    wire.version = TALLY_PROTO_VERSION;
    wire.request_id = self->next_id;
    char msg[TALLY_ERROR_MESSAGE_MAX + 1] = "";
    tally_status_t status = tally_req_validate(&wire, len, SIZE_MAX, msg, sizeof msg);
    if (status != TALLY_OK)
        return fail(self, status, msg[0] ? msg : tally_status_text(status));

    uint8_t header[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(&wire, header);
    status = wait_connected(self, deadline);
    if (status != TALLY_OK)
        return status; /* self->error says why */
    for (;;) {
        status = wait_socket(self, ZMQ_POLLOUT, deadline);
        if (status == TALLY_E_TIMEOUT)
            return fail(self, status, "timed out waiting to send (is tallyd running?)");
        if (status != TALLY_OK)
            return fail(self, status, zmq_strerror(zmq_errno()));
        if (zmq_send(self->sock, header, sizeof header, ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0)
            break;
        if (zmq_errno() != EAGAIN && zmq_errno() != EINTR)
            return fail(self, TALLY_E_TRANSPORT, zmq_strerror(zmq_errno()));
    }
    *id = self->next_id++;
    return TALLY_OK;
}

/* Queues the payload frame, a copy of payload: into a pooled buffer for a large one (sent
 * without a second copy, given back to the pool once sent), else through zmq_send. */
static int send_payload_copy(tally_client_t *self, const void *payload, size_t len)
{
    void *buf = tally__bufpool_take(self->pool, len);
    if (!buf)
        return zmq_send(self->sock, len ? payload : "", len, 0) < 0 ? -1 : 0;
    memcpy(buf, payload, len);
    zmq_msg_t frame;
    if (zmq_msg_init_data(&frame, buf, len, tally__bufpool_give_back, NULL) != 0) {
        tally__bufpool_give_back(buf, NULL); /* out of memory for ZeroMQ's bookkeeping */
        return zmq_send(self->sock, payload, len, 0) < 0 ? -1 : 0;
    }
    if (zmq_msg_send(&frame, self->sock, 0) >= 0)
        return 0;
    int err = zmq_errno();
    zmq_msg_close(&frame); /* gives buf back */
    errno = err;
    return -1;
}

static tally_status_t send_until(tally_client_t *self, const tally_req_t *req, const void *payload,
                                 size_t len, uint64_t *request_id, int64_t deadline)
{
    if (!self || !req || (len && !payload))
        return TALLY_E_ARG;
    if (self->natsc) /* a fleet over NATS (tally_client_nats.c) */
        return tally__natsc_send(self->natsc, req, payload, len, request_id, self->error,
                                 sizeof self->error);
    uint64_t id;
    tally_status_t status = send_header_until(self, req, len, &id, deadline);
    if (status != TALLY_OK)
        return status;
    /* Multipart messages are atomic: once the first frame is queued the last one is too. */
    if (send_payload_copy(self, payload, len) != 0)
        return fail(self, TALLY_E_TRANSPORT, zmq_strerror(zmq_errno()));
    if (request_id)
        *request_id = id;
    return TALLY_OK;
}

tally_status_t tally_send(tally_client_t *self, const tally_req_t *req, const void *payload,
                          size_t len, uint64_t *request_id)
{
    if (!self)
        return TALLY_E_ARG;
    return send_until(self, req, payload, len, request_id, deadline_after(self));
}

tally_status_t tally_send_zc(tally_client_t *self, const tally_req_t *req, void *payload,
                             size_t len, tally_free_fn *free_fn, void *hint, uint64_t *request_id)
{
    tally_status_t status = TALLY_E_ARG;
    if (!self || !req || !payload || !len || !free_fn)
        goto release;
    if (self->natsc) { /* NATS copies the payload into its message */
        status = send_until(self, req, payload, len, request_id, deadline_after(self));
        goto release;
    }
    uint64_t id;
    status = send_header_until(self, req, len, &id, deadline_after(self));
    if (status != TALLY_OK)
        goto release;
    /* From here ZeroMQ owns the buffer: it calls free_fn once it is sent, or on close. */
    zmq_msg_t frame;
    if (zmq_msg_init_data(&frame, payload, len, free_fn, hint) != 0) {
        /* Cannot happen with a valid buffer, but the header is queued: end the message. */
        zmq_send(self->sock, "", 0, 0);
        status = fail(self, TALLY_E_NOMEM, "out of memory");
        goto release;
    }
    if (zmq_msg_send(&frame, self->sock, 0) < 0) {
        status = fail(self, TALLY_E_TRANSPORT, zmq_strerror(zmq_errno()));
        zmq_msg_close(&frame); /* calls free_fn */
        return status;
    }
    if (request_id)
        *request_id = id;
    return TALLY_OK;

release:
    if (free_fn && payload)
        free_fn(payload, hint);
    return status;
}

/* Fills reply from a header frame and payload frame already received. Takes `payload`. */
static tally_status_t decode_reply(tally_client_t *self, zmq_msg_t *header, zmq_msg_t *payload,
                                   tally_reply_t *reply)
{
    if (tally_rep_decode(zmq_msg_data(header), zmq_msg_size(header), &reply->rep) != TALLY_OK) {
        set_msg(reply->error, "undecodable reply header (%zu bytes)", zmq_msg_size(header));
        goto bad_reply;
    }
    size_t len = zmq_msg_size(payload);
    if (reply->rep.status != TALLY_OK) {
        size_t n = len < TALLY_ERROR_MESSAGE_MAX ? len : TALLY_ERROR_MESSAGE_MAX;
        memcpy(reply->error, zmq_msg_data(payload), n);
        reply->error[n] = '\0';
        if (!n)
            set_msg(reply->error, "%s", tally_status_text((tally_status_t)reply->rep.status));
        zmq_msg_close(payload);
        free(payload);
        fail(self, (tally_status_t)reply->rep.status, reply->error);
        return (tally_status_t)reply->rep.status;
    }
    size_t esize = tally_dtype_size((tally_dtype_t)reply->rep.dtype);
    if (esize && len % esize) {
        set_msg(reply->error, "reply payload of %zu bytes is not a whole number of %s", len,
                tally_dtype_name((tally_dtype_t)reply->rep.dtype));
        goto bad_reply;
    }
    if (len) {
        reply->msg_ = payload;
        reply->payload = zmq_msg_data(payload);
        reply->len = len;
    } else {
        zmq_msg_close(payload);
        free(payload);
    }
    return TALLY_OK;

bad_reply:
    zmq_msg_close(payload);
    free(payload);
    return fail(self, TALLY_E_REPLY, reply->error);
}

static tally_status_t recv_until(tally_client_t *self, tally_reply_t *reply, int64_t deadline)
{
    if (self->natsc) {
        int64_t left_ms = (deadline - now_us()) / 1000;
        tally_status_t st = tally__natsc_recv(self->natsc, left_ms > 0 ? (int)left_ms : 1, reply);
        if (st != TALLY_OK)
            set_msg(self->error, "%s", reply->error);
        return st;
    }
    tally_reply_clear(reply);
    zmq_msg_t header;
    zmq_msg_init(&header);
    for (;;) {
        tally_status_t status = wait_socket(self, ZMQ_POLLIN, deadline);
        if (status == TALLY_E_TIMEOUT) {
            zmq_msg_close(&header);
            set_msg(reply->error, "no reply within %d ms (is tallyd running?)", self->timeout_ms);
            return fail(self, status, reply->error);
        }
        if (status != TALLY_OK) {
            zmq_msg_close(&header);
            goto transport;
        }
        if (zmq_msg_recv(&header, self->sock, ZMQ_DONTWAIT) >= 0)
            break;
        if (zmq_errno() != EAGAIN && zmq_errno() != EINTR) { /* else: a spurious wake-up */
            zmq_msg_close(&header);
            goto transport;
        }
    }
    /* Decoded first, so even a malformed reply names the request it answers (if it can). */
    (void)tally_rep_decode(zmq_msg_data(&header), zmq_msg_size(&header), &reply->rep);
    if (!zmq_msg_more(&header)) {
        zmq_msg_close(&header);
        set_msg(reply->error, "reply has 1 frame, expected 2");
        return fail(self, TALLY_E_REPLY, reply->error);
    }
    zmq_msg_t *payload = malloc(sizeof *payload);
    if (!payload) {
        zmq_msg_close(&header);
        drain_frames(self->sock);
        return fail(self, TALLY_E_NOMEM, "out of memory");
    }
    zmq_msg_init(payload);
    if (zmq_msg_recv(payload, self->sock, 0) < 0) {
        zmq_msg_close(&header);
        zmq_msg_close(payload);
        free(payload);
        goto transport;
    }
    if (zmq_msg_more(payload)) {
        int extra = drain_frames(self->sock);
        zmq_msg_close(&header);
        zmq_msg_close(payload);
        free(payload);
        set_msg(reply->error, "reply has %d frames, expected 2", 2 + extra);
        return fail(self, TALLY_E_REPLY, reply->error);
    }
    tally_status_t status = decode_reply(self, &header, payload, reply);
    zmq_msg_close(&header);
    return status;

transport:
    set_msg(reply->error, "receive failed: %s", zmq_strerror(zmq_errno()));
    return fail(self, TALLY_E_TRANSPORT, reply->error);
}

tally_status_t tally_recv(tally_client_t *self, tally_reply_t *reply)
{
    if (!self || !reply)
        return TALLY_E_ARG;
    return recv_until(self, reply, deadline_after(self));
}

static bool is_local_failure(tally_status_t status)
{
    return status == TALLY_E_TIMEOUT || status == TALLY_E_TRANSPORT || status == TALLY_E_NOMEM;
}

static tally_status_t wait_reply(tally_client_t *self, uint64_t id, int64_t deadline,
                                 tally_reply_t *reply);

tally_status_t tally_call(tally_client_t *self, const tally_req_t *req, const void *payload,
                          size_t len, tally_reply_t *reply)
{
    if (!self || !req || !reply)
        return TALLY_E_ARG;
    tally_reply_clear(reply);
    int64_t deadline = deadline_after(self);
    uint64_t id = 0;
    tally_status_t status = send_until(self, req, payload, len, &id, deadline);
    if (status != TALLY_OK) {
        snprintf(reply->error, sizeof reply->error, "%s", self->error);
        return status;
    }
    return wait_reply(self, id, deadline, reply);
}

/* Replies to older requests (ones that timed out, or a tally_run that failed) may still
 * arrive: skip them until the one for `id` comes. */
static tally_status_t wait_reply(tally_client_t *self, uint64_t id, int64_t deadline,
                                 tally_reply_t *reply)
{
    tally_status_t status;
    for (;;) {
        status = recv_until(self, reply, deadline);
        if (is_local_failure(status))
            return status;
        if (reply->rep.request_id == id)
            return status;
        if (status == TALLY_E_REPLY && reply->rep.request_id == 0)
            return status; /* the header did not decode: cannot tell whose it is */
    }
}

/* ---- Convenience wrappers ----------------------------------------------------------------- */

static void simple_req(tally_req_t *req, tally_op_t op)
{
    memset(req, 0, sizeof *req);
    req->version = TALLY_PROTO_VERSION;
    req->opcode = (uint8_t)op;
    req->dtype = TALLY_DTYPE_NONE;
}

/* A request without a payload; reply is initialised here, cleared by the caller. */
static tally_status_t call_empty(tally_client_t *self, const tally_req_t *req, tally_reply_t *reply)
{
    tally_reply_init(reply);
    return tally_call(self, req, NULL, 0, reply);
}

/* The same for a request that is only an opcode (ping, info, stats, streams). */
static tally_status_t call_op(tally_client_t *self, tally_op_t op, tally_reply_t *reply)
{
    tally_req_t req;
    simple_req(&req, op);
    return call_empty(self, &req, reply);
}

tally_status_t tally_ping(tally_client_t *self, double *rtt_us)
{
    tally_reply_t reply;
    int64_t start = now_us();
    tally_status_t status = call_op(self, TALLY_OP_PING, &reply);
    if (rtt_us)
        *rtt_us = (double)(now_us() - start);
    tally_reply_clear(&reply);
    return status;
}

tally_status_t tally_info(tally_client_t *self, tally_op_t op, char **text)
{
    if (!text || (op != TALLY_OP_INFO && op != TALLY_OP_STATS))
        return TALLY_E_ARG;
    *text = NULL;
    tally_reply_t reply;
    tally_status_t status = call_op(self, op, &reply);
    if (status != TALLY_OK)
        goto out;
    *text = malloc(reply.len + 1);
    if (!*text) {
        status = TALLY_E_NOMEM;
        goto out;
    }
    if (reply.len)
        memcpy(*text, reply.payload, reply.len);
    (*text)[reply.len] = '\0';
out:
    tally_reply_clear(&reply);
    return status;
}

tally_status_t tally_info_fetch(tally_client_t *self, tally_info_t **out)
{
    if (!out)
        return TALLY_E_ARG;
    *out = NULL;
    tally_reply_t reply;
    tally_status_t status = call_op(self, TALLY_OP_INFO, &reply);
    if (status == TALLY_OK) {
        status = tally_info_parse((const char *)reply.payload, reply.len, out);
        if (status == TALLY_E_REPLY)
            fail(self, status, "the daemon's info is not key=value lines (PROTOCOL.md §5 info)");
    }
    tally_reply_clear(&reply);
    return status;
}

/* A query/reset request naming `stream`; the name is checked before anything is sent. */
static tally_status_t stream_req(tally_client_t *self, tally_req_t *req, tally_op_t op,
                                 const char *stream)
{
    simple_req(req, op);
    if (!stream)
        return TALLY_E_ARG;
    tally_status_t status = tally_req_set_stream(req, stream);
    if (status != TALLY_OK) {
        snprintf(self->error, sizeof self->error, "invalid stream name '%.80s'", stream);
    }
    return status;
}

/* query, all time (window_ms 0) or the last window_ms (QUERY_WINDOW); the window's start and
 * end (aux0, aux1) to *start_ms and *end_ms when given. */
static tally_status_t query_call(tally_client_t *self, const char *stream, uint64_t window_ms,
                                 tally_stream_info_t *info, uint64_t *start_ms, uint64_t *end_ms)
{
    if (!self || !info || window_ms > (uint64_t)TALLY_WINDOW_MS_MAX)
        return TALLY_E_ARG;
    tally_req_t req;
    tally_status_t status = stream_req(self, &req, TALLY_OP_QUERY, stream);
    if (status != TALLY_OK)
        return status;
    if (window_ms) {
        req.flags = TALLY_FLAG_QUERY_WINDOW;
        req.lo = (int64_t)window_ms;
    }
    tally_reply_t reply;
    status = call_empty(self, &req, &reply);
    if (status == TALLY_OK &&
        tally_stream_info_decode(reply.payload, reply.len, info) != TALLY_OK) {
        status = fail(self, TALLY_E_REPLY, "query reply does not decode");
    }
    if (status == TALLY_OK && start_ms)
        *start_ms = reply.rep.aux0;
    if (status == TALLY_OK && end_ms)
        *end_ms = reply.rep.aux1;
    tally_reply_clear(&reply);
    return status;
}

tally_status_t tally_reply_stream_info(const tally_reply_t *reply, tally_stream_info_t *info)
{
    if (!reply || !info)
        return TALLY_E_ARG;
    if (reply->rep.status != TALLY_OK || reply->rep.opcode != TALLY_OP_QUERY ||
        tally_stream_info_decode(reply->payload, reply->len, info) != TALLY_OK)
        return TALLY_E_REPLY;
    return TALLY_OK;
}

tally_status_t tally_query(tally_client_t *self, const char *stream, tally_stream_info_t *info)
{
    return query_call(self, stream, 0, info, NULL, NULL);
}

tally_status_t tally_query_window(tally_client_t *self, const char *stream, uint64_t window_ms,
                                  tally_stream_info_t *info, uint64_t *start_ms, uint64_t *end_ms)
{
    if (window_ms == 0)
        return TALLY_E_ARG;
    return query_call(self, stream, window_ms, info, start_ms, end_ms);
}

/* reset and delete: a stream name, an empty reply. */
static tally_status_t stream_control(tally_client_t *self, tally_op_t op, const char *stream)
{
    if (!self)
        return TALLY_E_ARG;
    tally_req_t req;
    tally_status_t status = stream_req(self, &req, op, stream);
    if (status != TALLY_OK)
        return status;
    tally_reply_t reply;
    status = call_empty(self, &req, &reply);
    tally_reply_clear(&reply);
    return status;
}

tally_status_t tally_reset(tally_client_t *self, const char *stream)
{
    return stream_control(self, TALLY_OP_RESET, stream);
}

tally_status_t tally_delete(tally_client_t *self, const char *stream)
{
    return stream_control(self, TALLY_OP_DELETE, stream);
}

void tally_strings_free(char **names, size_t count)
{
    if (!names)
        return;
    for (size_t i = 0; i < count; i++)
        free(names[i]);
    free(names);
}

/* Splits a streams payload, a sequence of [u8 len][name], into strings. */
static tally_status_t parse_streams(const uint8_t *p, size_t len, char ***names, size_t *count)
{
    size_t n = 0;
    for (size_t at = 0; at < len; at += 1 + p[at], n++) {
        if (p[at] == 0 || at + 1 + p[at] > len)
            return TALLY_E_REPLY;
    }
    char **list = calloc(n ? n : 1, sizeof *list);
    if (!list)
        return TALLY_E_NOMEM;
    size_t i = 0;
    for (size_t at = 0; at < len; at += 1 + p[at], i++) {
        list[i] = strndup((const char *)p + at + 1, p[at]);
        if (!list[i]) {
            tally_strings_free(list, i);
            return TALLY_E_NOMEM;
        }
    }
    *names = list;
    *count = n;
    return TALLY_OK;
}

tally_status_t tally_streams(tally_client_t *self, char ***names, size_t *count)
{
    if (!self || !names || !count)
        return TALLY_E_ARG;
    *names = NULL;
    *count = 0;
    tally_reply_t reply;
    tally_status_t status = call_op(self, TALLY_OP_STREAMS, &reply);
    if (status == TALLY_OK) {
        status = parse_streams(reply.payload, reply.len, names, count);
        if (status == TALLY_E_REPLY)
            fail(self, status, "malformed streams reply");
    }
    tally_reply_clear(&reply);
    return status;
}

/* ---- Growable buffers --------------------------------------------------------------------- */

/* ---- Shared memory ------------------------------------------------------------------------ */

/* Opens the side channel named by the daemon's `info` (once per client). */
static tally_status_t side_connect(tally_client_t *self)
{
    if (self->natsc)
        return fail(self, TALLY_E_ARG, "shared memory is not available over NATS");
    if (self->side_fd >= 0)
        return TALLY_OK;
    tally_info_t *info = NULL;
    tally_status_t status = tally_info_fetch(self, &info);
    if (status != TALLY_OK)
        return status;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    const char *on = tally_info_lookup(info, "shm");
    const char *path = tally_info_lookup(info, "shm_socket");
    uint64_t max_batch = 0;
    (void)tally_info_u64(info, "max_batch", &max_batch); /* 0: the daemon did not say */
    self->max_batch = (size_t)max_batch;
    bool offered = on && strcmp(on, "on") == 0 && path && path[0];
    bool fits = offered && strlen(path) < sizeof addr.sun_path;
    if (fits)
        memcpy(addr.sun_path, path, strlen(path) + 1);
    tally_info_destroy(&info);
    if (!offered)
        return fail(self, TALLY_E_ARG, "the daemon offers no shared memory (info: shm=off)");
    if (!fits)
        return fail(self, TALLY_E_REPLY, "the daemon's shm_socket path is too long for a socket");
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        char msg[TALLY_ERROR_MESSAGE_MAX + 1];
        set_msg(msg, "cannot connect to the shared-memory side channel %s: %s", addr.sun_path,
                strerror(errno));
        if (fd >= 0)
            close(fd);
        return fail(self, TALLY_E_IO, msg);
    }
    self->side_fd = fd;
    return TALLY_OK;
}

tally_status_t tally__connect(void *sock, const char *endpoint)
{
    int ipv6 = tally_endpoint_ipv6(endpoint); /* tcp://[::1]:PORT */
    if (zmq_setsockopt(sock, ZMQ_IPV6, &ipv6, sizeof ipv6) != 0)
        return TALLY_E_TRANSPORT;
    if (zmq_connect(sock, endpoint) == 0)
        return TALLY_OK;
    /* An endpoint that does not parse is the caller's mistake, not the network's. */
    return (errno == EINVAL || errno == EPROTONOSUPPORT) ? TALLY_E_ARG : TALLY_E_TRANSPORT;
}

void tally__side_send(int sock, const tally_shm_msg_t *m, int fd)
{
    uint8_t buf[TALLY_SHM_MSG_MAX];
    struct iovec iov = {.iov_base = buf, .iov_len = tally_shm_msg_encode(m, buf)};
    union {
        struct cmsghdr align;
        char space[CMSG_SPACE(sizeof(int))];
    } control;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (fd >= 0) {
        mh.msg_control = control.space;
        mh.msg_controllen = sizeof control.space;
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof fd);
    }
    /* A refused peer may be disconnected before its send: its answer is still readable. */
    (void)sendmsg(sock, &mh, MSG_NOSIGNAL);
}

/* One message on the side connection and its answer (n bytes in buf): 1, 0 when the connection
 * had been closed by tallyd (no answer), -1 on a timeout, -2 on another error. */
static int side_exchange(tally_client_t *self, const tally_shm_msg_t *m, int fd, uint8_t *buf,
                         size_t cap, ssize_t *n)
{
    tally__side_send(self->side_fd, m, fd);
    struct pollfd p = {.fd = self->side_fd, .events = POLLIN};
    int rc = poll(&p, 1, self->timeout_ms);
    *n = rc > 0 ? recv(self->side_fd, buf, cap, MSG_DONTWAIT) : -1;
    if (*n == 0 || (*n < 0 && rc > 0 && (errno == ECONNRESET || errno == EPIPE)))
        return 0;
    return *n > 0 ? 1 : rc == 0 ? -1 : -2;
}

static void side_disconnect(tally_client_t *self)
{
    if (self->side_fd >= 0)
        close(self->side_fd);
    self->side_fd = -1;
}

/* Sends one side-channel message (with `fd` attached when >= 0) and waits for its answer. A
 * register on a connection tallyd has closed (one that registered nothing within its
 * register_timeout_ms) was not applied: it is sent again once on a new connection. After an
 * answer with op 0 (a refusal of the connection itself) tallyd has closed it: the next message
 * opens a new one (PROTOCOL.md §10). */
static tally_status_t side_call(tally_client_t *self, const tally_shm_msg_t *m, int fd,
                                tally_shm_answer_t *answer)
{
    uint8_t buf[TALLY_SHM_ANSWER_SIZE + TALLY_ERROR_MESSAGE_MAX];
    ssize_t n = -1;
    int got = side_exchange(self, m, fd, buf, sizeof buf, &n);
    if (got == 0 && m->op != TALLY_SHM_OP_RELEASE) { /* op 1 or 3 */
        side_disconnect(self);
        tally_status_t status = side_connect(self);
        if (status != TALLY_OK)
            return status;
        got = side_exchange(self, m, fd, buf, sizeof buf, &n);
    }
    if (got != 1 || tally_shm_answer_decode(buf, (size_t)n, answer) != TALLY_OK) {
        side_disconnect(self);
        return fail(self, got == -1 ? TALLY_E_TIMEOUT : TALLY_E_TRANSPORT,
                    "no answer from the shared-memory side channel");
    }
    if (answer->op == 0)
        side_disconnect(self);
    if (answer->status != TALLY_OK) {
        char msg[TALLY_ERROR_MESSAGE_MAX + 1];
        size_t mlen = (size_t)n - TALLY_SHM_ANSWER_SIZE;
        set_msg(msg, "%.*s", (int)(mlen > TALLY_ERROR_MESSAGE_MAX ? TALLY_ERROR_MESSAGE_MAX : mlen),
                (char *)buf + TALLY_SHM_ANSWER_SIZE);
        return fail(self, (tally_status_t)answer->status, msg);
    }
    return TALLY_OK;
}

/* A zero-filled memfd of `size` bytes, sealed so that it can neither shrink nor grow. */
static int sealed_memfd(size_t size)
{
    int fd = memfd_create("tally-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return -1;
    if (ftruncate(fd, (off_t)size) != 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

tally_status_t tally_region_create(tally_client_t *client, size_t size, tally_region_t **out)
{
    if (!client || !out || size == 0)
        return TALLY_E_ARG;
    *out = NULL;
    tally_status_t status = side_connect(client);
    if (status != TALLY_OK)
        return status;
    tally_region_t *region = calloc(1, sizeof *region);
    int fd = sealed_memfd(size);
    void *base = fd >= 0 ? mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (!region || base == MAP_FAILED) {
        status = fail(client, region ? TALLY_E_IO : TALLY_E_NOMEM, "cannot create a memfd region");
        goto fail;
    }
    tally_shm_msg_t m = {.op = TALLY_SHM_OP_REGISTER, .id_len = TALLY_ROUTING_ID_BYTES};
    memcpy(m.id, client->routing_id, TALLY_ROUTING_ID_BYTES);
    tally_shm_answer_t answer;
    status = side_call(client, &m, fd, &answer);
    if (status != TALLY_OK)
        goto fail;
    close(fd);
    *region =
        (tally_region_t){.client = client, .base = base, .size = size, .handle = answer.handle};
    *out = region;
    return TALLY_OK;
fail:
    if (base != MAP_FAILED)
        munmap(base, size);
    if (fd >= 0)
        close(fd);
    free(region);
    return status;
}

void *tally_region_data(const tally_region_t *region)
{
    return region ? region->base : NULL;
}

size_t tally_region_size(const tally_region_t *region)
{
    return region ? region->size : 0;
}

void tally_region_destroy(tally_region_t **region_p)
{
    if (!region_p || !*region_p)
        return;
    tally_region_t *region = *region_p;
    tally_client_t *client = region->client;
    if (client->side_fd >= 0) {
        tally_shm_msg_t m = {.op = TALLY_SHM_OP_RELEASE, .handle = region->handle};
        tally_shm_answer_t answer;
        (void)side_call(client, &m, -1, &answer);
    }
    if (!region->device) /* device memory is its allocator's (tally_gpu_free) */
        munmap(region->base, region->size);
    free(region);
    *region_p = NULL;
}

tally_status_t tally_gpu_register_fd(tally_client_t *client, int fd, size_t size,
                                     const uint8_t uuid[16], unsigned flags, const void *ipc_event,
                                     void *device_ptr, tally_region_t **out)
{
    if (!client || !out || fd < 0 || size == 0 || !uuid ||
        (flags & ~(unsigned)(TALLY_GPU_OUTPUT | TALLY_GPU_EVENT)) ||
        (!ipc_event != !(flags & TALLY_GPU_EVENT)))
        return TALLY_E_ARG;
    *out = NULL;
    tally_status_t status = side_connect(client);
    if (status != TALLY_OK)
        return status;
    tally_region_t *region = calloc(1, sizeof *region);
    if (!region)
        return fail(client, TALLY_E_NOMEM, "out of memory");
    tally_shm_msg_t m = {.op = TALLY_SHM_OP_REGISTER_DEVICE,
                         .id_len = TALLY_ROUTING_ID_BYTES,
                         .dev_size = size,
                         .dev_flags = flags};
    memcpy(m.id, client->routing_id, TALLY_ROUTING_ID_BYTES);
    memcpy(m.gpu_uuid, uuid, TALLY_GPU_UUID_SIZE);
    if (ipc_event)
        memcpy(m.event, ipc_event, TALLY_GPU_EVENT_SIZE);
    tally_shm_answer_t answer;
    status = side_call(client, &m, fd, &answer);
    if (status != TALLY_OK) {
        free(region);
        return status;
    }
    *region = (tally_region_t){.client = client,
                               .base = device_ptr,
                               .size = size,
                               .handle = answer.handle,
                               .device = true};
    *out = region;
    return TALLY_OK;
}

/* Encodes the reference of a shared-memory request into ref_bytes. */
static tally_status_t shm_ref(tally_client_t *self, const tally_req_t *req,
                              const tally_region_t *in, size_t offset, size_t length,
                              const tally_region_t *out, size_t out_offset,
                              uint8_t ref_bytes[TALLY_SHM_REF_SIZE])
{
    if (!self || !req || !in || offset > in->size || length > in->size - offset ||
        (out && out_offset > out->size))
        return fail(self, TALLY_E_ARG, "the range is not inside the region");
    tally_shm_ref_t ref = {.in_handle = in->handle, .in_offset = offset, .in_length = length};
    if (out) {
        ref.out_handle = out->handle;
        ref.out_offset = out_offset;
        ref.out_length = out->size - out_offset;
    }
    tally_shm_ref_encode(&ref, ref_bytes);
    return TALLY_OK;
}

tally_status_t tally_send_shm(tally_client_t *self, const tally_req_t *req,
                              const tally_region_t *in, size_t offset, size_t length,
                              const tally_region_t *out, size_t out_offset, uint64_t *request_id)
{
    uint8_t ref[TALLY_SHM_REF_SIZE];
    tally_status_t status = shm_ref(self, req, in, offset, length, out, out_offset, ref);
    if (status != TALLY_OK)
        return status;
    tally_req_t wire = *req;
    wire.flags |= TALLY_FLAG_SHM_REF;
    return tally_send(self, &wire, ref, sizeof ref, request_id);
}

/* ---- A shared-memory hist over max_batch, in pieces ---------------------------------------- */

#define SHM_PIECES_WINDOW TALLY_DEFAULT_WINDOW

/* One hist of [offset, offset + length) of `in`, sent as `count` pieces of piece_bytes (the
 * last one shorter), at most SHM_PIECES_WINDOW in flight, their counts summed into `sum`. */
typedef struct {
    tally_client_t *client;
    const tally_req_t *req;
    const tally_region_t *in;
    size_t offset, length, piece_bytes, count;
    size_t next;                        /* the next piece never sent */
    size_t retry[SHM_PIECES_WINDOW];    /* pieces answered `busy`, to send again */
    size_t retries;                     /* in retry[] */
    uint64_t ids[SHM_PIECES_WINDOW];    /* the request in flight in each slot; 0: free */
    size_t piece_of[SHM_PIECES_WINDOW]; /* and its piece */
    size_t inflight, applied;           /* pieces in flight, and answered ok */
    bool was_busy;                      /* the last reply was `busy` */
    tally_reply_t *sum;                 /* the first ok reply, the others added into it */
    tally_status_t failed;              /* the first failure; TALLY_OK while none */
    size_t failed_piece;
    char error[TALLY_ERROR_MESSAGE_MAX + 1];
} shm_pieces_t;

static tally_status_t piece_send(shm_pieces_t *p)
{
    size_t k = p->retries ? p->retry[--p->retries] : p->next++;
    size_t at = k * p->piece_bytes;
    size_t len = p->length - at < p->piece_bytes ? p->length - at : p->piece_bytes;
    size_t slot = 0;
    while (p->ids[slot])
        slot++;
    tally_status_t st =
        tally_send_shm(p->client, p->req, p->in, p->offset + at, len, NULL, 0, &p->ids[slot]);
    p->piece_of[slot] = k;
    p->inflight += st == TALLY_OK;
    return st;
}

/* Adds an ok reply into the sum (the first one becomes it). */
static tally_status_t piece_add(shm_pieces_t *p, tally_reply_t *r)
{
    size_t values = tally__hist_values(p->req->dtype);
    if (r->len != values * 8)
        return fail(p->client, TALLY_E_REPLY, "a hist reply of the wrong length");
    if (!p->sum->payload) {
        *p->sum = *r; /* takes over the payload */
        tally_reply_init(r);
    } else { /* the frame's data is ours until the reply is cleared */
        tally__hist_add((uint8_t *)p->sum->payload, r->payload, values);
        p->sum->rep.aux0 += r->rep.aux0;
    }
    p->applied++;
    return TALLY_OK;
}

/* One reply of a piece: summed, its piece queued again (`busy`: it had no effect, and a hist's
 * pieces add up in any order), or the first failure kept. A local failure is returned. */
static tally_status_t piece_receive(shm_pieces_t *p)
{
    tally_reply_t r;
    tally_reply_init(&r);
    tally_status_t st = tally_recv(p->client, &r);
    size_t slot = 0;
    while (slot < SHM_PIECES_WINDOW && (!p->ids[slot] || p->ids[slot] != r.rep.request_id))
        slot++;
    if (is_local_failure(st) || slot == SHM_PIECES_WINDOW) { /* or a reply to an earlier call */
        tally_reply_clear(&r);
        return is_local_failure(st) ? st : TALLY_OK;
    }
    p->ids[slot] = 0;
    p->inflight--;
    p->was_busy = st == TALLY_E_BUSY;
    if (st == TALLY_OK)
        st = piece_add(p, &r);
    if (st == TALLY_E_BUSY) {
        p->retry[p->retries++] = p->piece_of[slot];
    } else if (st != TALLY_OK && p->failed == TALLY_OK) {
        p->failed = st;
        p->failed_piece = p->piece_of[slot];
        snprintf(p->error, sizeof p->error, "%s", r.error[0] ? r.error : p->client->error);
    }
    tally_reply_clear(&r);
    return TALLY_OK;
}

/* tally_call_shm's hist over the daemon's max_batch (PROTOCOL.md §10): pieces of at most
 * max_batch bytes in whole elements, one reply with their counts summed and aux0 the elements
 * of all. After the first failure no more pieces are sent; those in flight are waited for, and
 * the error says how many pieces were applied. */
static tally_status_t call_shm_pieces(tally_client_t *self, const tally_req_t *req,
                                      const tally_region_t *in, size_t offset, size_t length,
                                      tally_reply_t *reply)
{
    size_t esize = tally_dtype_size((tally_dtype_t)req->dtype);
    shm_pieces_t p = {.client = self,
                      .req = req,
                      .in = in,
                      .offset = offset,
                      .length = length,
                      .piece_bytes = self->max_batch - self->max_batch % esize,
                      .sum = reply};
    p.count = (length + p.piece_bytes - 1) / p.piece_bytes;
    tally_status_t st = TALLY_OK;
    while (st == TALLY_OK && (p.inflight || (p.failed == TALLY_OK && p.applied < p.count))) {
        while (st == TALLY_OK && p.failed == TALLY_OK && p.inflight < SHM_PIECES_WINDOW &&
               (p.retries || p.next < p.count)) {
            if (p.was_busy && !p.inflight)
                usleep(1000); /* busy with nothing of ours in flight: others hold the slots */
            st = piece_send(&p);
        }
        if (st == TALLY_OK && p.inflight)
            st = piece_receive(&p);
    }
    if (st == TALLY_OK && p.failed != TALLY_OK) {
        st = p.failed;
        set_msg(self->error, "hist piece %zu of %zu failed: %s (%zu of the %zu pieces applied)",
                p.failed_piece + 1, p.count, p.error, p.applied, p.count);
    }
    if (st != TALLY_OK) {
        tally_reply_clear(reply);
        reply->rep.status = (uint32_t)st;
        snprintf(reply->error, sizeof reply->error, "%s", self->error);
    }
    return st;
}

tally_status_t tally_call_shm(tally_client_t *self, const tally_req_t *req,
                              const tally_region_t *in, size_t offset, size_t length,
                              const tally_region_t *out, size_t out_offset, tally_reply_t *reply)
{
    if (!self || !reply)
        return TALLY_E_ARG;
    tally_reply_clear(reply);
    if (req && req->opcode == TALLY_OP_HIST && !req->seq && !out && self->max_batch &&
        length > self->max_batch &&
        tally_dtype_size((tally_dtype_t)req->dtype) <= self->max_batch && in &&
        offset <= in->size && length <= in->size - offset)
        return call_shm_pieces(self, req, in, offset, length, reply);
    int64_t deadline = deadline_after(self);
    uint8_t ref[TALLY_SHM_REF_SIZE];
    uint64_t id = 0;
    tally_status_t status = shm_ref(self, req, in, offset, length, out, out_offset, ref);
    if (status == TALLY_OK) {
        tally_req_t wire = *req;
        wire.flags |= TALLY_FLAG_SHM_REF;
        status = send_until(self, &wire, ref, sizeof ref, &id, deadline);
    }
    if (status != TALLY_OK) {
        snprintf(reply->error, sizeof reply->error, "%s", self->error);
        return status;
    }
    return wait_reply(self, id, deadline, reply);
}

void tally_buf_free(tally_buf_t *buf)
{
    if (!buf)
        return;
    free(buf->data);
    memset(buf, 0, sizeof *buf);
}

tally_status_t tally_buf_reserve(tally_buf_t *buf, size_t extra)
{
    if (!buf || extra > SIZE_MAX - buf->len)
        return TALLY_E_ARG;
    size_t need = buf->len + extra;
    if (need <= buf->cap)
        return TALLY_OK;
    size_t cap = buf->cap ? buf->cap : 4096;
    while (cap < need)
        cap = cap > SIZE_MAX / 2 ? need : cap * 2;
    uint8_t *data = realloc(buf->data, cap);
    if (!data)
        return TALLY_E_NOMEM;
    buf->data = data;
    buf->cap = cap;
    return TALLY_OK;
}

tally_status_t tally_buf_append(tally_buf_t *buf, const void *data, size_t len)
{
    tally_status_t status = tally_buf_reserve(buf, len);
    if (status != TALLY_OK)
        return status;
    if (len)
        memcpy(buf->data + buf->len, data, len);
    buf->len += len;
    return TALLY_OK;
}

tally_status_t tally_buf_printf(tally_buf_t *buf, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (!buf || n < 0)
        return TALLY_E_ARG;
    /* Room for vsnprintf's terminator too; it stays after the text, not counted in len. */
    tally_status_t status = tally_buf_reserve(buf, (size_t)n + 1);
    if (status != TALLY_OK)
        return status;
    va_start(ap, fmt);
    vsnprintf((char *)buf->data + buf->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    buf->len += (size_t)n;
    return TALLY_OK;
}

/* ---- Reassembly arithmetic (tally_internal.h) --------------------------------------------- */

void tally__scan_offset(uint8_t *vals, size_t n, bool out_i32, uint64_t offset)
{
    if (out_i32) {
        uint32_t off32 = (uint32_t)offset;
        for (size_t i = 0; i < n; i++)
            tally_put_u32(vals + 4 * i, tally_get_u32(vals + 4 * i) + off32);
    } else {
        for (size_t i = 0; i < n; i++)
            tally_put_u64(vals + 8 * i, tally_get_u64(vals + 8 * i) + offset);
    }
}

void tally__hist_add(uint8_t *acc, const uint8_t *vals, size_t n)
{
    for (size_t i = 0; i < n; i++)
        tally_put_u64(acc + 8 * i, tally_get_u64(acc + 8 * i) + tally_get_u64(vals + 8 * i));
}

size_t tally__hist_values(uint8_t dtype)
{
    return tally_hist_values(dtype);
}

size_t tally__chunk_bytes(size_t requested, size_t elem_size)
{
    size_t chunk = requested ? requested : TALLY_DEFAULT_CHUNK_BYTES;
    chunk -= chunk % elem_size;
    return chunk ? chunk : elem_size;
}

uint64_t tally__chunk_count(size_t len, size_t chunk_bytes)
{
    return len ? (len + chunk_bytes - 1) / chunk_bytes : 1;
}

/* ---- Streaming pushes (tally_push_*) and tally_run ------------------------------------------ */

/* "Applied k chunks, B bytes" must take B from the same k, whatever k the daemon reports (a
 * tallyd restarted from an older snapshot may hold fewer chunks than it acknowledged). A chunk
 * is chunk_bytes long except the short ones (a live input's pause, the input's end), so
 * bytes(k) = k x chunk_bytes - the shortfall of the short chunks before chunk k. The push keeps
 * the last PUSH_SHORT_KEPT short chunks (index, shortfall through it), which answers every k
 * after the newest one it let go; a file has one short chunk at most. Memory: 64 KiB at most,
 * taken at the first short chunk. */
#define PUSH_SHORT_KEPT 4096u

typedef struct {
    uint64_t index;     /* the chunk */
    uint64_t shortfall; /* chunk_bytes minus the length, summed over short chunks up to it */
} short_chunk_t;

typedef struct {
    short_chunk_t *kept; /* a ring: kept[(first + i) % PUSH_SHORT_KEPT], i < count */
    unsigned first, count;
    uint64_t shortfall; /* over every short chunk so far */
    bool let_go;        /* records were dropped; `newest_gone` is the last one dropped */
    short_chunk_t newest_gone;
} short_chunks_t;

typedef struct {
    uint64_t request_id;
    size_t len;     /* the chunk's input bytes */
    bool in_flight; /* sent, reply not yet received */
    bool done;      /* reply received and held, not yet merged */
    tally_reply_t reply;
} push_slot_t;

struct tally_push {
    tally_client_t *client;
    tally_req_t req;
    tally_output_fn *output;
    void *output_arg;
    size_t elem_size;
    size_t chunk_bytes;
    unsigned window;
    push_slot_t *slots;
    uint64_t first;        /* chunks before it were skipped (applied already: a resumed push) */
    uint64_t next_send;    /* chunks written so far (sent or skipped) */
    uint64_t next_merge;   /* the next chunk to merge, in order */
    uint64_t total_chunks; /* opts->total_bytes in chunks; 0 when unknown */
    short_chunks_t shorts;
    bool sequenced; /* chunk k carries seq res.seq_base + 1 + k */
    bool finished;
    uint64_t scan_offset;                    /* stateless scan: total of the chunks merged so far */
    uint8_t hist[8 * TALLY_HIST_VALUES_MAX]; /* hist: the counts summed over chunks */
    int64_t min, max; /* minmax: over the chunks so far (min > max while none had an element) */
    /* opts->shm: window input slices of in_slice bytes, then window output slices of
     * out_slice bytes (0 for hist), in one region. TALLY_RUN_SHM_GPU: the region is device
     * memory (gpu_mem): the chunks are copied into it, and the output slices copied out of it
     * into gpu_out (window slices on the host) before they are merged. */
    tally_region_t *region;
    tally_gpu_mem_t *gpu_mem;
    uint8_t *gpu_out;
    size_t in_slice;
    size_t out_slice;
    tally_run_result_t res;
};

static tally_status_t push_fail(tally_push_t *push, tally_status_t status, const char *msg)
{
    /* msg may be the client's own error buffer (a failed tally_send): copy through res. */
    push->res.status = status;
    snprintf(push->res.error, sizeof push->res.error, "%s", msg);
    memcpy(push->client->error, push->res.error, sizeof push->client->error);
    return status;
}

/* A reply's output: its payload, or with shared memory the chunk's output slice (the reply then
 * carries only the header, its count saying how much of the slice holds output). Writable: a
 * stateless scan adds its offset in place. */
static uint8_t *reply_output(const tally_push_t *push, uint64_t k, const tally_reply_t *reply,
                             size_t *len)
{
    if (!push->region || !push->out_slice) {
        *len = reply->len;
        return reply->len ? zmq_msg_data(reply->msg_) : NULL;
    }
    *len = (size_t)reply->rep.count * tally_op_reply_elem(&push->req);
    if (*len > push->out_slice)
        *len = push->out_slice; /* a count the daemon cannot have sent: merge_* rejects it */
    size_t slice = (size_t)(k % push->window) * push->out_slice;
    if (push->gpu_mem) /* copied out of the device by device_output */
        return push->gpu_out + slice;
    uint8_t *base = tally_region_data(push->region);
    return base + push->window * push->in_slice + slice;
}

/* TALLY_RUN_SHM_GPU: a filter's or scan's output slice of chunk k, copied out of the device
 * region into the host slice reply_output reads (its count elements). */
static tally_status_t device_output(tally_push_t *push, uint64_t k, const tally_reply_t *reply)
{
    if (!push->gpu_mem || !push->out_slice || reply->rep.status != TALLY_OK)
        return TALLY_OK;
    size_t len;
    uint8_t *host = reply_output(push, k, reply, &len);
    size_t at = push->window * push->in_slice + (size_t)(k % push->window) * push->out_slice;
    tally_status_t st = tally_gpu_copy_from(push->gpu_mem, at, host, len);
    return st == TALLY_OK ? TALLY_OK : push_fail(push, st, tally_gpu_error());
}

static tally_status_t emit(tally_push_t *push, const void *data, size_t len)
{
    if (!push->output || !len)
        return TALLY_OK;
    tally_status_t status = push->output(push->output_arg, data, len);
    if (status != TALLY_OK)
        return push_fail(push, status, "the output callback failed");
    return TALLY_OK;
}

static tally_status_t merge_filter(tally_push_t *push, uint64_t k, const tally_reply_t *reply)
{
    size_t len;
    const uint8_t *data = reply_output(push, k, reply, &len);
    push->res.count += len / push->elem_size;
    push->res.seen += reply->rep.aux0;
    return emit(push, data, len);
}

static tally_status_t merge_scan(tally_push_t *push, uint64_t k, const tally_reply_t *reply,
                                 size_t in_len)
{
    bool out_i32 = push->req.flags & TALLY_FLAG_SCAN_OUT_I32;
    size_t n = in_len / push->elem_size;
    size_t len;
    uint8_t *data = reply_output(push, k, reply, &len);
    if (len != n * (out_i32 ? 4 : 8)) {
        char msg[128];
        snprintf(msg, sizeof msg, "scan reply has %zu bytes for %zu elements", len, n);
        return push_fail(push, TALLY_E_REPLY, msg);
    }
    if (push->req.stream_len) {
        push->res.carry = (int64_t)reply->rep.aux0; /* the daemon carried */
    } else {
        tally__scan_offset(data, n, out_i32, push->scan_offset);
        push->scan_offset += reply->rep.aux0;
        push->res.carry = (int64_t)push->scan_offset;
    }
    push->res.count += n;
    return emit(push, data, len);
}

static tally_status_t merge_hist(tally_push_t *push, const tally_reply_t *reply)
{
    size_t values = tally__hist_values(push->req.dtype);
    if (reply->len != values * 8) {
        char msg[128];
        snprintf(msg, sizeof msg, "hist reply has %zu bytes, expected %zu", reply->len, values * 8);
        return push_fail(push, TALLY_E_REPLY, msg);
    }
    tally__hist_add(push->hist, reply->payload, values);
    push->res.hist_total += reply->rep.aux0;
    return TALLY_OK;
}

/* A chunk's min and max (none for an empty chunk) into the push's. */
static tally_status_t merge_minmax(tally_push_t *push, const tally_reply_t *reply)
{
    uint64_t count = reply->rep.count;
    if ((count != 0 && count != 2) || reply->len != count * push->elem_size) {
        char msg[128];
        snprintf(msg, sizeof msg, "minmax reply has %" PRIu64 " values in %zu bytes", count,
                 reply->len);
        return push_fail(push, TALLY_E_REPLY, msg);
    }
    if (count) {
        int64_t lo, hi;
        tally_minmax_decode(push->req.dtype, reply->payload, &lo, &hi);
        push->min = lo < push->min ? lo : push->min;
        push->max = hi > push->max ? hi : push->max;
    }
    push->res.seen += reply->rep.aux0;
    return TALLY_OK;
}

/* By the reply's shape (tally_ops.h): the output of each chunk, in order. */
static tally_status_t merge_chunk(tally_push_t *push, uint64_t k, const push_slot_t *slot)
{
    tally_status_t st = device_output(push, k, &slot->reply);
    if (st != TALLY_OK)
        return st;
    switch (tally_op_info(push->req.opcode)->reply) {
    case TALLY_REPLY_KEPT:
        return merge_filter(push, k, &slot->reply);
    case TALLY_REPLY_PREFIX:
        return merge_scan(push, k, &slot->reply, slot->len);
    case TALLY_REPLY_PAIR:
        return merge_minmax(push, &slot->reply);
    default:
        return merge_hist(push, &slot->reply);
    }
}

static tally_status_t push_send(tally_push_t *push, uint64_t k, const void *chunk, size_t len)
{
    push_slot_t *slot = &push->slots[k % push->window];
    tally_req_t wire = push->req;
    wire.seq = push->sequenced ? push->res.seq_base + 1 + k : 0;
    tally_status_t status;
    if (push->region) { /* the chunk's slice is free: its previous chunk has been merged */
        size_t slice = (size_t)(k % push->window);
        uint8_t *base = tally_region_data(push->region);
        if (push->gpu_mem) { /* synchronous: the data is on the device before the request */
            status = tally_gpu_copy_to(push->gpu_mem, slice * push->in_slice, chunk, len);
            if (status != TALLY_OK)
                return push_fail(push, status, tally_gpu_error());
        } else if (len) {
            memcpy(base + slice * push->in_slice, chunk, len);
        }
        size_t out_at = push->window * push->in_slice + slice * push->out_slice;
        status = tally_send_shm(push->client, &wire, push->region, slice * push->in_slice, len,
                                push->out_slice ? push->region : NULL, out_at, &slot->request_id);
    } else {
        status = tally_send(push->client, &wire, chunk, len, &slot->request_id);
    }
    if (status != TALLY_OK)
        return push_fail(push, status, push->client->error);
    slot->len = len;
    slot->in_flight = true;
    push->res.chunks++;
    return TALLY_OK;
}

/* A numbered chunk in slot `slot` failed with the daemon's `status`: what the stream holds, when
 * the reply says it. duplicate and sequence_gap carry the stream's last_seq. Any other failure
 * of chunk k, once every chunk before it has been answered ok, means exactly k chunks are in:
 * replies on a stream come in send order, a failed request does not use up its seq, and every
 * later one then gets sequence_gap (PROTOCOL.md, "Sequence numbers"). */
static void push_failed_at(tally_push_t *push, unsigned slot, tally_status_t status,
                           const tally_reply_t *reply)
{
    if (!push->sequenced)
        return;
    if (status == TALLY_E_DUPLICATE || status == TALLY_E_SEQ_GAP) {
        push->res.last_seq = reply->rep.aux0; /* the stream's position, exactly */
        push->res.applied_known = true;
        return;
    }
    for (uint64_t k = push->next_merge; k < push->next_send; k++) {
        const push_slot_t *s = &push->slots[k % push->window];
        if (k % push->window == slot) {
            push->res.last_seq = push->res.seq_base + k;
            push->res.applied_known = true;
            return;
        }
        if (!s->done)
            return; /* an earlier chunk is still unanswered: ask the daemon */
    }
}

/* Receives one reply and parks it in its slot; replies to requests not in the window (left
 * over from an earlier failed call) are dropped. */
static tally_status_t push_receive(tally_push_t *push, tally_reply_t *reply)
{
    tally_status_t status = tally_recv(push->client, reply);
    if (status != TALLY_OK && (is_local_failure(status) || reply->rep.request_id == 0))
        return push_fail(push, status, reply->error);
    for (unsigned i = 0; i < push->window; i++) {
        push_slot_t *slot = &push->slots[i];
        if (!slot->in_flight || slot->request_id != reply->rep.request_id)
            continue;
        if (status != TALLY_OK) {
            push_failed_at(push, i, status, reply);
            return push_fail(push, status, reply->error);
        }
        slot->in_flight = false;
        slot->done = true;
        slot->reply = *reply; /* the slot takes over the payload */
        tally_reply_init(reply);
        return TALLY_OK;
    }
    tally_reply_clear(reply);
    return TALLY_OK;
}

/* Waits for one reply, then merges every chunk that is next in order. */
static tally_status_t push_step(tally_push_t *push)
{
    tally_reply_t reply;
    tally_reply_init(&reply);
    tally_status_t status = push_receive(push, &reply);
    tally_reply_clear(&reply);
    while (status == TALLY_OK && push->next_merge < push->next_send) {
        push_slot_t *slot = &push->slots[push->next_merge % push->window];
        if (!slot->done)
            break;
        status = merge_chunk(push, push->next_merge, slot);
        tally_reply_clear(&slot->reply);
        slot->done = false;
        push->next_merge++;
    }
    return status;
}

/* TALLY_RUN_SHM_GPU: the rings in device memory on GPU 0 (tally_gpu_alloc: CUDA_VISIBLE_DEVICES
 * picks it), registered as an output region, and the host slices the outputs are copied into. */
static tally_status_t push_open_gpu(tally_push_t *push, size_t size)
{
    tally_status_t status = tally_gpu_alloc(0, size, &push->gpu_mem);
    if (status != TALLY_OK) {
        char msg[256];
        snprintf(msg, sizeof msg, "cannot allocate %zu bytes of GPU memory: %s", size,
                 tally_gpu_error());
        return push_fail(push, status, msg);
    }
    status = tally_gpu_register(push->client, push->gpu_mem, TALLY_GPU_OUTPUT, NULL, &push->region);
    if (status != TALLY_OK)
        return push_fail(push, status, push->client->error);
    push->gpu_out = malloc(push->window * push->out_slice + 1);
    return push->gpu_out ? TALLY_OK : push_fail(push, TALLY_E_NOMEM, "out of memory");
}

/* Checks the request and options, and sizes chunks and the window. */
static tally_status_t push_prepare(tally_push_t *push, const tally_run_opts_t *opts)
{
    const tally_req_t *req = &push->req;
    const tally_op_info_t *op = tally_op_info(req->opcode);
    if (!op || !op->batch)
        return push_fail(push, TALLY_E_ARG, "a push takes operations with a batch");
    push->elem_size = tally_dtype_size((tally_dtype_t)req->dtype);
    if (!push->elem_size || !tally_op_takes_dtype(req->opcode, req->dtype))
        return push_fail(push, TALLY_E_ARG, "request has no input dtype");
    push->chunk_bytes = tally__chunk_bytes(opts ? opts->chunk_bytes : 0, push->elem_size);
    if (push->client->natsc) { /* over NATS: one chunk, one message (and one reply) */
        size_t limit = tally__natsc_chunk_limit(push->client->natsc, req);
        if (limit < push->elem_size)
            return push_fail(push, TALLY_E_TOO_LARGE,
                             "NATS messages are too small for one element");
        if (push->chunk_bytes > limit)
            push->chunk_bytes = limit / push->elem_size * push->elem_size;
    }
    push->window = opts && opts->window ? opts->window : TALLY_DEFAULT_WINDOW;
    if (push->window > TALLY_MAX_WINDOW)
        push->window = TALLY_MAX_WINDOW;
    if (opts && opts->total_bytes) {
        push->total_chunks = tally__chunk_count(opts->total_bytes, push->chunk_bytes);
        if (push->window > push->total_chunks)
            push->window = (unsigned)push->total_chunks;
    }
    if (req->opcode == TALLY_OP_HIST)
        push->res.count = tally__hist_values(req->dtype);
    push->min = INT64_MAX;
    push->max = INT64_MIN;
    if (opts && opts->shm && !(op->flags & TALLY_FLAG_SHM_REF))
        return push_fail(push, TALLY_E_ARG, "this operation takes no shared-memory input");
    push->slots = calloc(push->window, sizeof *push->slots);
    if (!push->slots)
        return push_fail(push, TALLY_E_NOMEM, "out of memory");
    if (!opts || !opts->shm)
        return TALLY_OK;
    /* One region holding the input ring and (filter, scan) the output ring. */
    push->in_slice = push->chunk_bytes;
    push->out_slice = (size_t)tally_shm_out_worst(req, push->chunk_bytes);
    size_t size = push->window * (push->in_slice + push->out_slice);
    if (opts->shm == TALLY_RUN_SHM_GPU)
        return push_open_gpu(push, size);
    tally_status_t status = tally_region_create(push->client, size, &push->region);
    if (status != TALLY_OK)
        return push_fail(push, status, push->client->error);
    return TALLY_OK;
}

/* The stream's last_seq, or 0 for a stream that does not exist (yet). */
static tally_status_t stream_last_seq(tally_client_t *self, const char *stream, uint64_t *last)
{
    if (self->natsc) /* a fleet: asked of tally.seq, which a producer may (PROTOCOL.md §13) */
        return tally__natsc_last_seq(self->natsc, stream, last, self->error, sizeof self->error);
    tally_stream_info_t info;
    tally_status_t status = tally_query(self, stream, &info);
    *last = status == TALLY_OK ? info.last_seq : 0;
    return status == TALLY_E_UNKNOWN_STREAM ? TALLY_OK : status;
}

/* Sequence numbers: where the push starts (seq_base) and how many chunks the stream has
 * already (a resumed push skips them). */
static tally_status_t push_sequence(tally_push_t *push, const tally_run_opts_t *opts)
{
    tally_run_result_t *res = &push->res;
    if (!opts || opts->seq == TALLY_RUN_SEQ_OFF)
        return TALLY_OK;
    if (!push->req.stream_len)
        return push_fail(push, TALLY_E_ARG, "sequence numbers need a stream");
    uint64_t last = 0;
    tally_status_t status = stream_last_seq(push->client, push->req.stream, &last);
    if (status != TALLY_OK)
        return push_fail(push, status, push->client->error);
    push->sequenced = true;
    res->seq_base = opts->seq == TALLY_RUN_SEQ_RESUME ? opts->seq_base : last;
    if (last > res->seq_base) /* resuming: these chunks are in the stream already */
        push->first = last - res->seq_base;
    res->input_chunks = push->total_chunks;
    return TALLY_OK;
}

tally_status_t tally_push_new(tally_client_t *client, const tally_req_t *req,
                              const tally_run_opts_t *opts, tally_output_fn *output, void *arg,
                              tally_push_t **out)
{
    if (!out)
        return TALLY_E_ARG;
    *out = NULL;
    if (!client || !req)
        return TALLY_E_ARG;
    tally_push_t *push = calloc(1, sizeof *push);
    if (!push)
        return TALLY_E_NOMEM;
    *push = (tally_push_t){.client = client, .req = *req, .output = output, .output_arg = arg};
    tally_status_t status = push_prepare(push, opts);
    if (status == TALLY_OK)
        status = push_sequence(push, opts);
    if (status != TALLY_OK) {
        snprintf(client->error, sizeof client->error, "%s", push->res.error);
        tally_push_destroy(&push);
        return status;
    }
    *out = push;
    return TALLY_OK;
}

size_t tally_push_chunk_bytes(const tally_push_t *push)
{
    return push ? push->chunk_bytes : 0;
}

/* Records chunk `index`, `shortfall` bytes shorter than chunk_bytes (indexes grow). */
static tally_status_t short_chunk_note(short_chunks_t *sc, uint64_t index, uint64_t shortfall)
{
    if (!sc->kept && !(sc->kept = malloc(PUSH_SHORT_KEPT * sizeof *sc->kept)))
        return TALLY_E_NOMEM;
    sc->shortfall += shortfall;
    if (sc->count == PUSH_SHORT_KEPT) { /* the oldest goes */
        sc->newest_gone = sc->kept[sc->first];
        sc->let_go = true;
        sc->first = (sc->first + 1) % PUSH_SHORT_KEPT;
        sc->count--;
    }
    sc->kept[(sc->first + sc->count++) % PUSH_SHORT_KEPT] =
        (short_chunk_t){.index = index, .shortfall = sc->shortfall};
    return TALLY_OK;
}

tally_status_t tally_push_write(tally_push_t *push, const void *data, size_t len)
{
    if (!push || (len && !data) || push->finished)
        return TALLY_E_ARG;
    if (push->res.status != TALLY_OK)
        return push->res.status;
    if (len % push->elem_size || len > push->chunk_bytes) {
        char msg[160];
        snprintf(msg, sizeof msg, "a chunk of %zu bytes is not 1..%zu whole %zu-byte elements", len,
                 push->chunk_bytes, push->elem_size);
        return fail(push->client, TALLY_E_ARG, msg); /* refused; the push goes on */
    }
    uint64_t k = push->next_send;
    if (len < push->chunk_bytes &&
        short_chunk_note(&push->shorts, k, push->chunk_bytes - len) != TALLY_OK)
        return push_fail(push, TALLY_E_NOMEM, "out of memory");
    if (k < push->first) { /* a resumed push: the stream has this chunk already */
        push->next_send = push->next_merge = k + 1;
        push->res.skipped++;
    } else {
        tally_status_t status = TALLY_OK;
        while (status == TALLY_OK && push->next_send - push->next_merge >= push->window)
            status = push_step(push);
        if (status == TALLY_OK)
            status = push_send(push, k, data, len);
        if (status != TALLY_OK)
            return status;
        push->next_send = k + 1;
    }
    push->res.bytes += len;
    push->res.elements += len / push->elem_size;
    return TALLY_OK;
}

/* Input bytes of the first `applied` chunks; UINT64_MAX when the records that would say were let
 * go (see PUSH_SHORT_KEPT). */
static uint64_t applied_bytes(const tally_push_t *push, uint64_t applied)
{
    const short_chunks_t *sc = &push->shorts;
    uint64_t before = 0; /* the shortfall of the short chunks before chunk `applied` */
    bool found = false;
    for (unsigned i = sc->count; i-- > 0 && !found;) {
        const short_chunk_t *r = &sc->kept[(sc->first + i) % PUSH_SHORT_KEPT];
        if (r->index < applied) {
            before = r->shortfall;
            found = true;
        }
    }
    if (!found && sc->let_go) {
        if (sc->newest_gone.index >= applied)
            return UINT64_MAX;
        before = sc->newest_gone.shortfall;
    }
    return applied * push->chunk_bytes - before;
}

/* After a push: how many chunks of the input the stream holds. A failed push asks the daemon
 * unless a duplicate or sequence_gap reply said it already; if it cannot be asked, the chunks
 * acknowledged are a lower bound. Every chunk counts once, whatever the replies. */
static void push_account(tally_push_t *push)
{
    tally_run_result_t *res = &push->res;
    if (!res->input_chunks || res->input_chunks < push->next_send)
        res->input_chunks = push->next_send;
    if (!push->sequenced) {
        res->applied = push->next_merge;
        res->applied_known = true;
    } else if (res->status == TALLY_OK) {
        res->last_seq = res->seq_base + push->next_send;
        res->applied_known = true;
    } else if (!res->applied_known) {
        char error[sizeof res->error];
        memcpy(error, res->error, sizeof error); /* the query must not hide the first failure */
        res->applied_known =
            stream_last_seq(push->client, push->req.stream, &res->last_seq) == TALLY_OK;
        memcpy(push->client->error, error, sizeof error);
        if (!res->applied_known)
            res->last_seq = res->seq_base + push->next_merge;
    }
    if (push->sequenced) {
        uint64_t applied = res->last_seq > res->seq_base ? res->last_seq - res->seq_base : 0;
        res->applied = applied < push->next_send ? applied : push->next_send;
    }
    res->applied_bytes = applied_bytes(push, res->applied);
}

tally_status_t tally_push_flush(tally_push_t *push)
{
    if (!push || push->finished)
        return TALLY_E_ARG;
    tally_status_t status = push->res.status;
    while (status == TALLY_OK && push->next_merge < push->next_send)
        status = push_step(push);
    return status;
}

/* minmax: the smallest and largest element of the whole input, two values of its dtype. */
static tally_status_t emit_minmax(tally_push_t *push)
{
    uint8_t out[16];
    size_t len = tally_minmax_encode(push->req.dtype, push->min, push->max, out);
    push->res.count = 2;
    return emit(push, out, len);
}

tally_status_t tally_push_finish(tally_push_t *push)
{
    if (!push)
        return TALLY_E_ARG;
    if (push->finished)
        return push->res.status;
    tally_status_t status = push->res.status;
    while (status == TALLY_OK && push->next_merge < push->next_send)
        status = push_step(push);
    if (status == TALLY_OK && push->req.opcode == TALLY_OP_HIST)
        status = emit(push, push->hist, 8 * tally__hist_values(push->req.dtype));
    if (status == TALLY_OK && push->req.opcode == TALLY_OP_MINMAX && push->min <= push->max)
        status = emit_minmax(push);
    push->finished = true;
    push->res.status = status;
    if (status == TALLY_OK)
        push->res.error[0] = '\0';
    push_account(push);
    return status;
}

const tally_run_result_t *tally_push_result(const tally_push_t *push)
{
    return push ? &push->res : NULL;
}

void tally_push_destroy(tally_push_t **push_p)
{
    if (!push_p || !*push_p)
        return;
    tally_push_t *push = *push_p;
    if (push->slots) {
        for (unsigned i = 0; i < push->window; i++)
            tally_reply_clear(&push->slots[i].reply);
        free(push->slots);
    }
    tally_region_destroy(&push->region);
    tally_gpu_free(&push->gpu_mem);
    free(push->gpu_out);
    free(push->shorts.kept);
    free(push);
    *push_p = NULL;
}

/* tally_run's output: appended to its buffer. */
static tally_status_t append_output(void *arg, const void *data, size_t len)
{
    return tally_buf_append(arg, data, len);
}

/* Writes the whole input through `push`, one chunk at a time (one empty chunk for none). */
static tally_status_t run_chunks(tally_push_t *push, const uint8_t *input, size_t len)
{
    tally_status_t status = TALLY_OK;
    size_t at = 0;
    do {
        size_t n = len - at < push->chunk_bytes ? len - at : push->chunk_bytes;
        status = tally_push_write(push, n ? input + at : NULL, n);
        at += n;
    } while (status == TALLY_OK && at < len);
    return status;
}

tally_status_t tally_run(tally_client_t *self, const tally_req_t *req, const void *input,
                         size_t len, const tally_run_opts_t *opts, tally_buf_t *out,
                         tally_run_result_t *result)
{
    tally_run_result_t local;
    if (!result)
        result = &local;
    memset(result, 0, sizeof *result);
    if (!self || !req || !out || (len && !input))
        return result->status = TALLY_E_ARG;
    size_t esize = tally_dtype_size((tally_dtype_t)req->dtype);
    if (esize && len % esize) {
        snprintf(result->error, sizeof result->error,
                 "input of %zu bytes is not a whole number of %zu-byte %s", len, esize,
                 tally_dtype_name((tally_dtype_t)req->dtype));
        snprintf(self->error, sizeof self->error, "%s", result->error);
        return result->status = TALLY_E_ARG;
    }
    /* The output's size is known from the operation's row: reserve it once (filter keeps at
     * most the input, scan writes 4 or 8 bytes per element, hist one set of counts), so
     * appending never reallocates. */
    size_t need = (size_t)tally_op_reply_bytes(req, len);
    if (tally_buf_reserve(out, need ? need : 1) != TALLY_OK) {
        snprintf(result->error, sizeof result->error, "out of memory for the output");
        return result->status = TALLY_E_NOMEM;
    }
    tally_run_opts_t o = opts ? *opts : (tally_run_opts_t){0};
    o.total_bytes = len;
    tally_push_t *push = NULL;
    tally_status_t status = tally_push_new(self, req, &o, append_output, out, &push);
    if (status != TALLY_OK) {
        snprintf(result->error, sizeof result->error, "%s", self->error);
        return result->status = status;
    }
    status = run_chunks(push, input, len);
    tally_status_t finished = tally_push_finish(push);
    *result = push->res;
    if (status == TALLY_OK)
        status = finished;
    tally_push_destroy(&push);
    return result->status = status;
}

tally_status_t tally_minmax(tally_client_t *self, tally_dtype_t dtype, const void *input,
                            size_t len, int64_t *min, int64_t *max)
{
    if (!min || !max)
        return TALLY_E_ARG;
    *min = INT64_MAX;
    *max = INT64_MIN;
    tally_req_t req = {.opcode = TALLY_OP_MINMAX, .dtype = (uint8_t)dtype};
    tally_buf_t out = {0};
    tally_status_t status = tally_run(self, &req, input, len, NULL, &out, NULL);
    if (status == TALLY_OK && out.len == 2 * tally_dtype_size(dtype))
        tally_minmax_decode(req.dtype, out.data, min, max);
    tally_buf_free(&out);
    return status;
}
