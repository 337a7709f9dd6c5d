/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally.c — libtally's core: a client and its connection to tallyd (API and contracts in tally.h).
 * The rest of the library stands on it, and it calls none of the rest (Floors, below).
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
 * Other transports. A client made by tally_client_new_nats reaches a fleet over NATS JetStream
 * instead of one tallyd over ZeroMQ: it has no socket, only a tally__transport_t whose table of
 * functions the NATS client filled (tally_transport.h). The core reaches it only through that
 * table, so no code of the core names NATS, and the NATS client is a floor above it, not beside it.
 *
 * Floors. libtally's files each call only files on the floors below them (the core reaches a
 * transport only through its table); tests/test_walls.sh checks it on the objects with nm
 * (scripts/check-floors.py), which prints the floors as the linker sees them:
 *
 *   6  tally_push.c         pushes, tally_run, tally_minmax  ▶ gpu, shm, control, call, chunk, buf
 *   5  tally_gpu.c          exportable device memory         ▶ shm
 *      tally_client_nats.c  a client over NATS: a transport  ▶ nats, control, call, tally.c
 *      tally_nats_watch.c   a fleet's publications (NATS)    ▶ nats
 *   4  tally_shm.c          shared memory, device regions    ▶ control, call, chunk, info
 *      tally_nats.c         the NATS producer and queries    ▶ control, call, nats_conn,
 *                                                              nats_names
 *   3  tally_control.c      ping, info, query, reset, delete, streams            ▶ call, info
 *   2  tally_call.c         send, receive, tally_call        ▶ tally.c, bufpool
 *      tally_sub.c          subscriptions (PUB)              ▶ tally.c
 *      tally_json.c         a record as JSON                 ▶ hist, buf
 *   1  tally.c              the client, its connection       ▶ bufpool, probe
 *      tally_hist.c         summaries and quantiles          ▶ buf
 *   0  tally_chunk.c, tally_buf.c, tally_bufpool.c, tally_probe.c, tally_info.c, tally_curve.c,
 *      tally_nats_conn.c, tally_nats_names.c (and tally_nats_stub.c, in place of tally_nats.c
 *      and tally_nats_watch.c without libnats)
 *
 *   the table of transports: tally_call.c, tally_push.c ── ops ──▶ tally_client_nats.c
 */
#include "tally.h"
#include "tally_args.h"
#include "tally_client_int.h"
#include "tally_keys.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include <zmq.h>

/* Enough for W = 8 windows of 1 MiB chunks many times over, small enough that a stalled
 * daemon pushes back on a producer long before memory is a concern. */
#define TALLY_HWM 1000

int tally__drain_frames(void *sock)
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
#define TALLY_MONITOR_ADDR                                                                         \
    "inproc://tally-monitor" /* one per context, and a client has its own                          \
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
            tally__drain_frames(self->monitor);
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

tally_status_t tally__wait_connected(tally_client_t *self, int64_t deadline)
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
    if (self->transport)
        return TALLY_OK;
    return tally__wait_connected(self, now_us() + (int64_t)self->timeout_ms * 1000);
}

tally_status_t tally_client_new(const char *endpoint, int timeout_ms, tally_client_t **out)
{
    return tally_client_new_curve(endpoint, timeout_ms, NULL, out);
}

/* CURVE options must be set before the connect: a connection made without them would start a
 * plain handshake that tallyd refuses (and counts). */
tally_status_t tally__set_curve(void *sock, const tally_curve_keys_t *keys)
{
    if (!keys || !keys->server_public[0])
        return TALLY_OK;
    /* ZeroMQ takes any 40 bytes it can decode, so a short key padded with NULs got through. */
    const char *const each[] = {keys->server_public, keys->client_public, keys->client_secret};
    for (int i = 0; i < 3; i++)
        if (strnlen(each[i], TALLY_KEY_LEN + 1) != TALLY_KEY_LEN ||
            !tally_key_valid(each[i], TALLY_KEY_LEN))
            return TALLY_E_ARG;
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, keys->server_public, 40) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, keys->client_public, 40) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, keys->client_secret, 40) != 0)
        return TALLY_E_ARG;
    return TALLY_OK;
}

/* The DEALER socket's options (see "Transport" above) and its routing id. */
static tally_status_t set_socket_options(tally_client_t *self, int timeout_ms)
{
    if (set_int_opt(self->sock, ZMQ_LINGER, 0) || set_int_opt(self->sock, ZMQ_SNDHWM, TALLY_HWM) ||
        set_int_opt(self->sock, ZMQ_RCVHWM, TALLY_HWM) ||
        /* A backstop only: sends wait in wait_socket with the caller's deadline. */
        set_int_opt(self->sock, ZMQ_SNDTIMEO, timeout_ms))
        return TALLY_E_TRANSPORT;
    /* A random routing id (ZeroMQ reserves ids starting with a zero byte): the daemon accepts a
     * shared-memory reference only from the id that registered the region. */
    if (getrandom(self->routing_id, sizeof self->routing_id, 0) != (ssize_t)sizeof self->routing_id)
        return TALLY_E_TRANSPORT;
    self->routing_id[0] |= 0x80;
    if (zmq_setsockopt(self->sock, ZMQ_ROUTING_ID, self->routing_id, sizeof self->routing_id))
        return TALLY_E_TRANSPORT;
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
    if (set_socket_options(self, timeout_ms) != TALLY_OK)
        goto fail_sock;
    if (tally__set_curve(self->sock, keys) != TALLY_OK) {
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

tally_status_t tally__client_new_transport(tally__transport_t *transport, int timeout_ms,
                                           tally_client_t **out)
{
    *out = NULL;
    tally_client_t *self = calloc(1, sizeof *self);
    if (!self)
        return TALLY_E_NOMEM;
    self->timeout_ms = timeout_ms;
    self->side_fd = -1;
    self->transport = transport;
    *out = self;
    return TALLY_OK;
}

void tally_client_destroy(tally_client_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tally_client_t *self = *self_p;
    if (self->transport) {
        self->transport->ops->destroy(&self->transport);
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
