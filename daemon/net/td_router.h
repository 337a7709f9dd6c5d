/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_router.h — the ROUTER socket tallyd serves on, and what it takes to open it.
 *
 * td_router_open makes the ZeroMQ context with its I/O threads (td_config_io_threads), the
 * ROUTER socket with the options td_config.h explains (ROUTER_MANDATORY, ROUTER_HANDOVER, the
 * high-water marks, no linger, the max_frame guard), a monitor of its connections, CURVE before any
 * bind (td_auth.h) so that no connection is ever made without it, then binds every endpoint:
 * ZMQ_IPV6 is set for an IPv6 address in brackets (tcp://[::1]:5555), an ipc socket file gets mode
 * 0660, and the sockets systemd passes are bound too (td_notify.h). The server owns the result.
 */
#ifndef TD_ROUTER_H
#define TD_ROUTER_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "td_auth.h"
#include "td_config.h"
#include "td_err.h"

typedef struct {
    void *ctx;       /* the ZeroMQ context */
    void *socket;    /* the ROUTER socket */
    td_auth_t *auth; /* CURVE and its ZAP handler; NULL when CURVE is off */
    uv_os_sock_t fd; /* ZMQ_FD, for the loop's poll */
    void *monitor;   /* a PAIR receiving the ROUTER's connection events (td_zmq_int.h) */
    uv_os_sock_t monitor_fd;
} td_router_t;

/* Fills *rt as far as it gets: on failure (logged) what was made is left in *rt for the caller
 * to close (td_router_close_monitor, zmq_close the socket, td_auth_destroy, zmq_ctx_term). */
td_err_t td_router_open(const td_config_t *cfg, td_router_t *rt);
/* The handshake events CURVE counts (td_auth_event), which every monitor asks for. */
#define TD_ROUTER_HANDSHAKE_EVENTS                                                                 \
    (ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |                        \
     ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)

/* A front's ROUTER socket (td_zmq_front.h) in the ROUTER's context ctx: the same options, CURVE
 * with its handler (auth) when it has one, bound to endpoint. With CURVE, *monitor is a PAIR
 * receiving its handshake events (for td_auth_event, as the ROUTER's are), else NULL. On
 * failure (logged) *out and *monitor, when not NULL, are the caller's to close
 * (td_router_unmonitor, then zmq_close). */
td_err_t td_router_open_front(void *ctx, const td_auth_t *auth, const td_config_t *cfg,
                              const char *endpoint, void **out, void **monitor);
/* The next event a monitor holds (without waiting): false when none. */
bool td_router_monitor_next(void *monitor, uint16_t *event, uint32_t *value);
/* Stops socket's monitor and closes *monitor_p (before socket closes; NULL: nothing). */
void td_router_unmonitor(void *socket, void **monitor_p);
/* Stops the monitor and closes its socket (before the ROUTER socket closes; idempotent). */
void td_router_close_monitor(td_router_t *rt);

#endif
