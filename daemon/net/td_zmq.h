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
 * id comes back (libtally sets one; its DEALER reconnects after 100 ms). After the grace they are
 * dropped (peer_gone). Kept replies' bytes stay counted (td_reply.h): their payloads are freed
 * only when sent and written out, or dropped.
 *
 * A connection lost in the middle of a pipeline (issue 30; ZeroMQ closes one that sends a frame
 * over max_frame). Where its requests and replies go, in libzmq 4.3.4 (src/, tag v4.3.4):
 *   - Requests are not lost. The engine fails on the frame's size (v2_decoder, EMSGSIZE) after
 *     pushing every message before it into the session's pipe; session_base_t::engine_error
 *     (session_base.cpp 453-504) flushes them (clean_pipes, 251-252) and, through process_term
 *     (532), ends the pipe with a delimiter behind them. The socket's end of a pipe is made with
 *     _delay true (pipe.cpp 123) and no ROUTER changes it, so on the peer's term it waits for the
 *     delimiter (pipe.cpp 340-342): tallyd reads every request sent before the frame, also after
 *     the close, even when the reconnect comes first.
 *   - Replies can be lost, and tallyd cannot tell which. A send succeeds while the socket has not
 *     yet processed the pipe's termination (router.cpp 211-225 only fails a pipe it knows is
 *     ending); a reply in the pipe or the engine when the engine died is deleted with the pipe
 *     (pipe.cpp 390-396), one the kernel had not sent with the socket. The monitor's
 *     disconnection (stream_engine_base.cpp 713) comes with the engine's end, not per reply. So
 *     PROTOCOL.md §1 promises every request read and applied in order, and no reply; numbered
 *     requests make the stream an exact prefix (a refused one does not use up its seq).
 *   - The "gap" of issue 30 is not lost requests: with --max-batch 64K, max_reply_bytes_per_peer
 *     is 1 MiB, eight int64 scans of 64 KiB; the ninth and after are answered `busy` when read,
 *     and those read once earlier ones are done apply. Unnumbered, that is a gap; the busy
 *     replies, sent just before the close, were the lost ones.
 *   - A reconnect with the same routing id was ignored for good while tallyd had not yet read the
 *     old pipe (at its in-flight limit): router_t::identify_peer (router.cpp 452-526) reads the
 *     new pipe's routing id, finds the old pipe still under it and, without ZMQ_ROUTER_HANDOVER,
 *     returns false (495-498); the pipe goes to the anonymous set (95-99) with its id consumed,
 *     and is looked at again only when its reader is activated (174-186), which never happens
 *     while it holds messages. Every reply then failed (the old pipe ending, no new one) and was
 *     dropped, and the client's new requests were never read. td_router.c sets
 *     ZMQ_ROUTER_HANDOVER: the new connection takes the id and the old pipe a temporary one
 *     (router.cpp 500-517), which its unread requests carry (xrecv reads the id from the pipe,
 *     348); td_zmq_conn.c gives them the id back from tallyd's record of their connection.
 * The connections and the count and log of lost ones: td_zmq_conn.c.
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
