/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_router.c — the ROUTER socket tallyd serves on (see td_router.h): the context and its I/O
 * threads, the socket's options, CURVE before any bind, the binds (ZMQ_IPV6 for an IPv6 address
 * in brackets) and the sockets systemd passes.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <zmq.h>

#include "tally_args.h"
#include "td_log.h"
#include "td_notify.h"
#include "td_router.h"

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

/* The ROUTER socket's options (td_config.h says why each value). ZMQ_ROUTER_HANDOVER: a
 * connection that comes back with the routing id of one that closed takes the id over at once,
 * even while tallyd has not yet read every request of the closed one; without it libzmq 4.3.4
 * ignores the new connection for good (td_zmq.h says why and what tallyd does about the
 * requests still to read). Each is an option of a ROUTER socket with a value of its type and
 * size, to a socket just made: zmq_setsockopt cannot fail. */
static void set_socket_options(void *router, const td_config_t *cfg)
{
    int one = 1, rcvhwm = TD_DEFAULT_RCVHWM, sndhwm = TD_DEFAULT_SNDHWM, linger = 0;
    /* tallyd checks payload sizes itself (too_large), so a client that sends too much still
     * gets its answer and keeps its connection. ZeroMQ's own limit is only the memory guard
     * max_frame, far above max_batch (td_config.h says why): a frame over it closes the
     * connection. */
    int64_t maxmsg = (int64_t)td_config_max_frame(cfg);
    zmq_setsockopt(router, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    zmq_setsockopt(router, ZMQ_ROUTER_HANDOVER, &one, sizeof one);
    zmq_setsockopt(router, ZMQ_RCVHWM, &rcvhwm, sizeof rcvhwm);
    zmq_setsockopt(router, ZMQ_SNDHWM, &sndhwm, sizeof sndhwm);
    zmq_setsockopt(router, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(router, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
}

/* A PAIR socket of ctx that receives `events` of socket (zmq_socket_monitor), at an inproc
 * address of its own: in *out (NULL on failure, logged). */
static td_err_t monitor_socket(void *ctx, void *socket, int events, void **out)
{
    char addr[64];
    snprintf(addr, sizeof addr, "inproc://tallyd-router-monitor-%p", socket);
    *out = NULL;
    void *monitor = NULL;
    if (zmq_socket_monitor(socket, addr, events) != 0 || !(monitor = zmq_socket(ctx, ZMQ_PAIR)) ||
        zmq_connect(monitor, addr) != 0) {
        td_err("cannot monitor the socket's connections: %s", zmq_strerror(errno));
        if (monitor)
            zmq_close(monitor);
        return TD_ERR_LIBRARY;
    }
    *out = monitor;
    return TD_OK;
}

/* The socket monitor, before any bind so that it sees every connection accepted: a PAIR socket
 * of the same context that receives the ROUTER's ZMQ_EVENT_ACCEPTED and ZMQ_EVENT_DISCONNECTED
 * (each with the connection's descriptor: td_zmq_conn.c) and the handshake events CURVE counts
 * (td_auth_event), and its ZMQ_FD for the loop's poll. One for all: libzmq keeps one monitor per
 * socket (socket_base_t::monitor stops the one before). */
static td_err_t open_monitor(td_router_t *rt)
{
    size_t size = sizeof rt->monitor_fd;
    int events = ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED | TD_ROUTER_HANDSHAKE_EVENTS;
    td_err_t err = monitor_socket(rt->ctx, rt->socket, events, &rt->monitor);
    if (err == TD_OK && zmq_getsockopt(rt->monitor, ZMQ_FD, &rt->monitor_fd, &size) != 0) {
        td_err("cannot monitor the socket's connections: %s", zmq_strerror(errno));
        return TD_ERR_LIBRARY;
    }
    return err;
}

/* CURVE, before any bind, so that no connection is ever made without it. */
static td_err_t open_curve(td_router_t *rt, const td_config_t *cfg)
{
    if (!cfg->curve_secret_key)
        return TD_OK;
    char msg[1024];
    td_err_t err = td_auth_new(rt->ctx, cfg, &rt->auth, msg, sizeof msg);
    if (err != TD_OK) {
        td_err("curve: %s", msg);
        return err;
    }
    return td_auth_apply(rt->auth, rt->socket);
}

/* One socket systemd passed, checked (td_notify.h) and adopted by the ROUTER socket. */
static td_err_t adopt_fd(void *router, const td_config_t *cfg, int index)
{
    char endpoint[160];
    int family = 0, fd = -1;
    td_err_t err = td_listen_fd_endpoint(index, cfg, &fd, endpoint, sizeof endpoint, &family);
    if (err != TD_OK)
        return err;
    /* zmq_setsockopt of an int option, with an int's size, to a socket of a live context does
     * not fail: the bind is what can. */
    int one = 1, use_fd = fd;
    if (family == AF_INET6)
        zmq_setsockopt(router, ZMQ_IPV6, &one, sizeof one);
    zmq_setsockopt(router, ZMQ_USE_FD, &use_fd, sizeof use_fd);
    if (zmq_bind(router, endpoint) != 0) {
        td_err("socket activation: cannot adopt fd %d (%s): %s", fd, endpoint, zmq_strerror(errno));
        return TD_ERR_BIND;
    }
    td_info("listening on %s (socket fd %d from systemd)", endpoint, fd);
    return TD_OK;
}

/* Every socket systemd passed (socket activation), then ZMQ_USE_FD off again. */
static td_err_t bind_passed(void *router, const td_config_t *cfg)
{
    int n = td_listen_fds_count();
    td_err_t err = TD_OK;
    for (int i = 0; i < n && err == TD_OK; i++)
        err = adopt_fd(router, cfg, i);
    int none = -1; /* later binds create their own sockets (an int option: cannot fail) */
    if (n > 0)
        zmq_setsockopt(router, ZMQ_USE_FD, &none, sizeof none);
    return err;
}

/* A bind that failed, with what to do where tallyd can tell: the address is in use. */
static void bind_failed(const char *endpoint, int err)
{
    const char *colon = strrchr(endpoint, ':'); /* a tcp:// endpoint that was bound has a port */
    if (err == EADDRINUSE && !strncmp(endpoint, "tcp://", 6))
        td_err("cannot bind %s: %s (another program listens there, perhaps another tallyd: `ss "
               "-ltnp 'sport = :%s'` names it; stop it, or bind another port)",
               endpoint, zmq_strerror(err), colon + 1);
    else
        td_err("cannot bind %s: %s", endpoint, zmq_strerror(err));
}

static td_err_t bind_endpoints(void *router, const td_config_t *cfg)
{
    for (int i = 0; i < cfg->bind_count; i++) {
        /* systemd's socket holds it (tallyd.socket enabled as well as a bind in tallyd.conf):
         * the bind would fail, or for ipc take the path from under the passed socket. */
        int held = td_listen_fd_holding(cfg->binds[i]);
        if (held >= 0) {
            td_err("cannot bind %s: systemd passed tallyd a socket on this address (fd %d, a "
                   "ListenStream= of tallyd.socket), which tallyd serves: remove this bind "
                   "(`bind` in tallyd.conf, or --bind), or stop passing the socket "
                   "(`systemctl disable --now tallyd.socket`)",
                   cfg->binds[i], held);
            return TD_ERR_BIND;
        }
        int ipv6 = tally_endpoint_ipv6(cfg->binds[i]); /* tcp://[::1]:PORT; read at bind */
        zmq_setsockopt(router, ZMQ_IPV6, &ipv6, sizeof ipv6); /* an int option: cannot fail */
        if (zmq_bind(router, cfg->binds[i]) != 0) {
            bind_failed(cfg->binds[i], errno);
            return TD_ERR_BIND;
        }
        restrict_ipc_socket(cfg->binds[i]);
        td_info("listening on %s", cfg->binds[i]);
    }
    return bind_passed(router, cfg); /* sockets passed by systemd */
}

td_err_t td_router_open(const td_config_t *cfg, td_router_t *rt)
{
    *rt = (td_router_t){0};
    rt->ctx = zmq_ctx_new();
    if (!rt->ctx)
        return TD_ERR_LIBRARY;
    /* Before the first socket: the I/O threads start with it. zmq_ctx_set refuses only a
     * negative count, and the settings bound io_threads to 1 and up. */
    int io_threads = (int)td_config_io_threads(cfg);
    zmq_ctx_set(rt->ctx, ZMQ_IO_THREADS, io_threads);
    td_info("%d ZeroMQ I/O threads", io_threads);
    rt->socket = zmq_socket(rt->ctx, ZMQ_ROUTER);
    if (!rt->socket)
        return TD_ERR_LIBRARY;
    set_socket_options(rt->socket, cfg);
    td_err_t err = open_monitor(rt);
    if (err == TD_OK)
        err = open_curve(rt, cfg);
    if (err == TD_OK)
        err = bind_endpoints(rt->socket, cfg);
    if (err != TD_OK)
        return err;
    size_t size = sizeof rt->fd; /* of an open socket, with its size: cannot fail */
    zmq_getsockopt(rt->socket, ZMQ_FD, &rt->fd, &size);
    return TD_OK;
}

td_err_t td_router_open_front(void *ctx, const td_auth_t *auth, const td_config_t *cfg,
                              const char *endpoint, void **out, void **monitor)
{
    *monitor = NULL;
    *out = zmq_socket(ctx, ZMQ_ROUTER);
    if (!*out)
        return TD_ERR_LIBRARY;
    set_socket_options(*out, cfg);
    if (auth && td_auth_secure(auth, *out) != TD_OK)
        return TD_ERR_LIBRARY;
    /* Before the bind, as the ROUTER's: no handshake goes uncounted. */
    if (auth && monitor_socket(ctx, *out, TD_ROUTER_HANDSHAKE_EVENTS, monitor) != TD_OK)
        return TD_ERR_LIBRARY;
    int ipv6 = tally_endpoint_ipv6(endpoint);
    zmq_setsockopt(*out, ZMQ_IPV6, &ipv6, sizeof ipv6); /* an int option: cannot fail */
    if (zmq_bind(*out, endpoint) != 0) {
        bind_failed(endpoint, errno);
        return TD_ERR_BIND;
    }
    restrict_ipc_socket(endpoint);
    td_info("listening on %s (a front: a thread of its own)", endpoint);
    return TD_OK;
}

bool td_router_monitor_next(void *monitor, uint16_t *event, uint32_t *value)
{
    zmq_msg_t frame;
    zmq_msg_init(&frame);
    if (zmq_msg_recv(&frame, monitor, ZMQ_DONTWAIT) == -1) {
        zmq_msg_close(&frame);
        return false;
    }
    /* [event u16, value u32 (the descriptor)][endpoint]: libzmq 4.3's version 1 events */
    *event = 0;
    *value = UINT32_MAX;
    if (zmq_msg_size(&frame) >= 6) {
        memcpy(event, zmq_msg_data(&frame), sizeof *event);
        memcpy(value, (const uint8_t *)zmq_msg_data(&frame) + 2, sizeof *value);
    }
    while (zmq_msg_more(&frame) && zmq_msg_recv(&frame, monitor, ZMQ_DONTWAIT) != -1)
        continue;
    zmq_msg_close(&frame);
    return true;
}

void td_router_unmonitor(void *socket, void **monitor_p)
{
    if (!*monitor_p)
        return;
    if (socket)
        zmq_socket_monitor(socket, NULL, 0);
    zmq_close(*monitor_p);
    *monitor_p = NULL;
}

void td_router_close_monitor(td_router_t *rt)
{
    td_router_unmonitor(rt->socket, &rt->monitor);
}
