/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_http_guard.h — keeps tallyd's HTTP port answering when peers hold connections open
 * without finishing their requests (slowloris) or open many of them (issue 21, item 5).
 *
 * Three rules, all settings of the [metrics] section:
 *   - a deadline for each whole request (request_timeout_ms): from the moment a connection is
 *     ready for a request (accepted, or its previous response sent) until its response is sent;
 *     past it the connection is closed, however steadily it trickles bytes;
 *   - at most max_connections_per_address connections from one address (an IPv6 /64 counts as
 *     one address) and max_connections in all, event streams apart (below);
 *   - a new connection over either bound closes the oldest connection of that address (or, for
 *     the total, of any address) that is still waiting for a request's headers, and is let in;
 *     only when every such connection is inside a request is the new one refused. So slow
 *     connections cannot lock out a probe, even one from their own address: each new connection
 *     takes the place of the oldest idle one.
 *
 * An event stream (td_web_sse.c) is long-lived by nature and never idle, so it could not make
 * room: 16 of them from one browser would fill the per-address bound for good and shut out
 * /healthz and /metrics from that address (issue 30, item 4). So once a connection streams
 * (td_http_guard_streaming) it leaves both bounds; event streams have a bound of their own,
 * max_sse_clients, which td_web.c enforces before a stream starts, and the guard's hard
 * ceilings have room for them (max_streaming).
 *
 * libmicrohttpd's CONNECTION_TIMEOUT is an idle timeout (any byte resets it) and it has no
 * deadline of its own, so the guard tracks each connection (MHD_OPTION_NOTIFY_CONNECTION), and
 * a thread of its own shuts a connection's socket down (shutdown(2), not close: the descriptor
 * stays libmicrohttpd's) when its deadline passes; libmicrohttpd then sees the end of the stream
 * and closes it. libmicrohttpd's own limits (MHD_OPTION_CONNECTION_LIMIT,
 * MHD_OPTION_PER_IP_CONNECTION_LIMIT) are set TD_HTTP_CLOSING_SLACK above these, as the hard
 * ceiling that also counts connections shut down and not yet closed.
 *
 * Threads: the callbacks run on libmicrohttpd's thread, the deadlines on the guard's; one mutex
 * guards the table. libmicrohttpd tells the guard a connection is closed before it closes the
 * descriptor, so the guard never shuts down a descriptor that has been reused.
 */
#ifndef TD_HTTP_GUARD_H
#define TD_HTTP_GUARD_H

#include <microhttpd.h>
#include <stdint.h>

#include "td_err.h"

/* Connections shut down by the guard that libmicrohttpd has not yet closed: libmicrohttpd
 * accepts at most 10 connections per turn of its loop and closes the ones shut down at the
 * next, so a few dozen is room enough. */
#define TD_HTTP_CLOSING_SLACK 32u

typedef struct {
    unsigned max_connections;
    unsigned max_per_address;
    unsigned max_streaming; /* event streams at once (td_web.c's bound), counted apart */
    unsigned deadline_ms;
} td_http_limits_t;

/* What the guard has done since start (for the log and tests). */
typedef struct {
    uint64_t deadline_closed; /* connections closed at their deadline */
    uint64_t evicted;         /* idle connections closed to let a new one in */
    uint64_t refused;         /* new connections refused: every one of theirs was busy */
} td_http_guard_counts_t;

typedef struct td_http_guard td_http_guard_t;

/* Starts the deadline thread. TD_ERR_NOMEM, or TD_ERR_LIBRARY (a thread, lock or clock). */
td_err_t td_http_guard_new(const td_http_limits_t *limits, td_http_guard_t **out);
/* After MHD_stop_daemon (every connection closed): stops the thread, frees. */
void td_http_guard_destroy(td_http_guard_t **self_p);

/* For MHD_OPTION_CONNECTION_LIMIT and MHD_OPTION_PER_IP_CONNECTION_LIMIT. */
unsigned td_http_guard_mhd_limit(const td_http_guard_t *self);
unsigned td_http_guard_mhd_per_ip_limit(const td_http_guard_t *self);

/* libmicrohttpd's callbacks, cls = the guard: the accept policy (MHD_start_daemon's apc), and
 * MHD_OPTION_NOTIFY_CONNECTION and MHD_OPTION_NOTIFY_COMPLETED. */
enum MHD_Result td_http_guard_accept(void *cls, const struct sockaddr *addr, socklen_t addrlen);
void td_http_guard_notify(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode code);
void td_http_guard_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                             enum MHD_RequestTerminationCode toe);
/* The access handler's first call for a request (its headers are in): the connection is no
 * longer idle, so it is not closed to make room (its deadline still holds). */
void td_http_guard_request(td_http_guard_t *self, struct MHD_Connection *conn);
/* The request's response is an event stream (td_web_sse.c), long-lived by nature: from now
 * until it completes the connection has no deadline, leaves both bounds (event streams have
 * their own, max_streaming), and is never closed to make room. */
void td_http_guard_streaming(td_http_guard_t *self, struct MHD_Connection *conn);

#endif
