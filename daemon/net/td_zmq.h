/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_zmq.h — the ZeroMQ transport: the ROUTER socket (td_router.h) served on the loop thread,
 * its messages handed to the request path and its replies sent back (td_transport.h).
 *
 * Reading: ZMQ_FD is edge-triggered, so the socket is drained until EAGAIN (or the path's
 * in-flight limit, or a fairness budget) from a uv_poll callback and from a uv_check after every
 * loop iteration (td_zmq_pump). A multipart message [routing id][delimiter?][header][payload]
 * becomes one td_msg_t: the routing id is the sender's id, CURVE's User-Id its user, an empty
 * frame after the routing id a REQ delimiter echoed in the reply (PROTOCOL.md §1); the payload
 * frame goes to the path as it is (no copy).
 *
 * Sending: a reply never waits for a connected peer. ROUTER_MANDATORY is on, so a send fails at
 * once when the peer has gone (EHOSTUNREACH) or stopped reading and filled its send high-water
 * mark (EAGAIN); a reply to a peer that does not read is dropped (counted by the path), and its
 * in-flight slot freed. Queueing it instead would let one peer that never reads hold every slot
 * and stop tallyd serving anyone. A reply to a connection that has closed is kept, with the ones
 * after it, for up to TD_REPLY_RECONNECT_GRACE_MS, and sent if a connection with the same routing
 * id comes back (libtally sets one; its DEALER reconnects after 100 ms): ZeroMQ closes a
 * connection that sends a frame over max_frame, and the requests it sent before were accepted and
 * are answered so (issue 21). After the grace they are dropped (peer_gone). The socket monitor
 * cannot tell that close from the client's own (libzmq 4.3.4 reports ZMQ_EVENT_DISCONNECTED for
 * both, and no event names the oversize frame), so the first reply that finds its connection gone
 * is what counts and logs "a connection lost with requests unanswered". Kept replies' bytes stay
 * counted (td_reply.h): their payloads are freed only when sent and written out, or dropped.
 *
 * Loop thread, except the free functions ZeroMQ calls on its I/O thread.
 */
#ifndef TD_ZMQ_H
#define TD_ZMQ_H

#include <stdbool.h>
#include <uv.h>

#include "td_auth.h"
#include "td_config.h"
#include "td_err.h"
#include "td_counters.h"
#include "td_reply.h"
#include "td_transport.h"

typedef struct td_zmq td_zmq_t;

typedef struct {
    uv_loop_t *loop;
    const td_config_t *cfg;
    td_path_t *path;
    td_metrics_t *metrics; /* read_pauses */
    /* After every pump: whether a message was read, and whether input waits that the path may
     * take (the loop is kept from blocking meanwhile). The wiring decides when a stopping tallyd
     * closes; it may call td_zmq_close from here. */
    void (*pumped)(void *owner, bool read_any, bool more);
    void *owner;
} td_zmq_env_t;

/* Opens the context, the socket (CURVE, binds: td_router.h) and the loop handles that serve it,
 * started; on failure (logged) nothing is left behind. */
td_err_t td_zmq_new(const td_zmq_env_t *env, td_zmq_t **out);
/* Reads what the path takes now and re-arms the edge-triggered fd (a no-op once closed). */
void td_zmq_pump(td_zmq_t *self);
/* Reading ends: the loop handles close and replies kept for closed connections are dropped. */
void td_zmq_close(td_zmq_t *self);
/* After the last replies were handed over: the socket closes, with a short linger for them. */
void td_zmq_close_socket(td_zmq_t *self);
/* After the loop has run the handles' close callbacks: CURVE's handler, then the context, which
 * waits (up to the linger) for the last replies to leave and frees every message it holds. */
void td_zmq_destroy(td_zmq_t **self_p);

/* The context, for other ZeroMQ sockets of tallyd (the PUB socket). */
void *td_zmq_context(const td_zmq_t *self);
/* CURVE and its ZAP handler; NULL when CURVE is off. */
td_auth_t *td_zmq_auth(const td_zmq_t *self);
/* SIGHUP: the allowed client keys, read again. */
void td_zmq_reload(td_zmq_t *self, const td_config_t *cfg);
/* The transport's gauges: connections lost with replies kept, replies resent, CURVE's counts. */
void td_zmq_gauges(const td_zmq_t *self, td_reply_gauges_t *replies, bool *curve,
                   td_auth_counts_t *auth);

#endif
