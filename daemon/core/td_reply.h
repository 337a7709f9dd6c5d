/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_reply.h — sending replies over the ROUTER socket, and the bytes that unread replies hold.
 *
 * A reply never waits for a peer that is connected: it is handed to ZeroMQ at once, or dropped
 * when the peer's 1024-message send queue is full (it does not read). A reply to a connection
 * that has closed (EHOSTUNREACH) is kept, with the ones after it, for up to
 * TD_REPLY_RECONNECT_GRACE_MS, and sent if a connection with the same routing id comes back
 * (libtally sets one; its DEALER reconnects after 100 ms): ZeroMQ closes a connection that sends
 * a frame over max_frame, and the requests it sent before were accepted and are answered so
 * (issue 21). After the grace they are dropped (peer_gone). The socket monitor cannot tell that
 * close from the client's own (libzmq 4.3.4 reports ZMQ_EVENT_DISCONNECTED for both, and no
 * event names the oversize frame), so the first reply that finds its connection gone is what
 * counts and logs "a connection lost with requests unanswered".
 *
 * ZeroMQ's high-water mark counts messages, not bytes, so a peer that pipelines large scans and
 * never reads could make tallyd hold gigabytes of replies (issue 21). This module counts reply
 * bytes per connection and in total:
 *   - reserved: when a request is admitted (td_replies_admit), its largest possible reply (a
 *     filter: its payload; a scan: its payload, or twice that for int64 sums; nothing when the
 *     output goes to a shared-memory region; other operations: nothing, their replies are small)
 *     is reserved, on the loop thread, until its reply is sent or dropped;
 *   - held: a reply's payload handed to ZeroMQ counts until ZeroMQ frees it (written out, or
 *     dropped with its connection), and so does a reply kept for a connection that closed. ZeroMQ
 * calls the free function on its I/O thread, so these counters are atomics, the connection's in its
 * reply meter (td_peers.h), which outlives the connection's entry while replies hold it. A request
 * is refused (`busy`, before it runs) when its connection already uses something and would go past
 * max_reply_bytes_per_peer with it, or, for a filter or scan that needs a reservation, when all
 * connections already use something and would go past max_reply_bytes. So a connection (and tallyd)
 * with nothing outstanding always gets one request through, whatever the size of its reply; a peer
 * at its bound is answered `busy` (retry-safe, cheap: nothing is computed), until it reads; every
 * other peer keeps being served. Headers, routing ids and error messages are not counted: they are
 * small, and the 1024-message queue bounds them.
 *
 * Loop thread, except the free function that ZeroMQ calls.
 */
#ifndef TD_REPLY_H
#define TD_REPLY_H

#include <stdbool.h>
#include <stdint.h>

#include "td_config.h"
#include "td_err.h"
#include "td_counters.h"
#include "td_request.h"

/* Unread replies, for the metrics: bytes inside ZeroMQ and reserved for requests in flight, the
 * most one connection and all together have used since start, and the bounds. */
typedef struct {
    uint64_t held;
    uint64_t reserved;
    uint64_t peak_peer;
    uint64_t peak_total;
    uint64_t bound_peer;
    uint64_t bound_total;
    uint64_t connections_lost; /* found closed with requests unanswered (counter) */
    uint64_t resent;           /* kept for such a connection and sent once it came back */
} td_reply_gauges_t;

typedef struct td_replies td_replies_t;

/* What became of a reply (a dropped one is counted already). */
typedef enum {
    TD_REPLY_SENT = 0,
    TD_REPLY_KEPT,   /* its connection has closed: kept for a while (td_replies_retry) */
    TD_REPLY_GONE,   /* dropped: the peer has gone (and did not come back in time) */
    TD_REPLY_SLOW,   /* dropped: the peer's send queue is full, it does not read its replies */
    TD_REPLY_BROKEN, /* dropped: the socket failed (logged) */
} td_reply_outcome_t;

/* A kept reply's end (sent after all, or dropped), on the loop thread. */
typedef void (*td_reply_done_fn)(void *owner, td_request_t *r, td_reply_outcome_t outcome);

/* cfg is the live configuration (the bounds may be reloaded); dropped replies are counted in
 * metrics (replies_dropped_gone, _slow); done is called for each kept reply when it is finally
 * sent or dropped. */
td_err_t td_replies_new(const td_config_t *cfg, td_metrics_t *metrics, td_reply_done_fn done,
                        void *owner, td_replies_t **out);
/* After zmq_ctx_term: ZeroMQ may free replies until then. */
void td_replies_destroy(td_replies_t **self_p);

typedef enum {
    TD_REPLY_ADMITTED = 0,
    TD_REPLY_OVER_PEER,  /* the connection's bound */
    TD_REPLY_OVER_TOTAL, /* the bound of all connections together */
} td_reply_admit_t;

/* A validated request (payload and output region known) from r->conn: reserves its largest
 * reply, or says which bound it would pass (nothing reserved). r->conn NULL (no memory for the
 * per-peer table): only the total applies. */
td_reply_admit_t td_replies_admit(td_replies_t *self, td_request_t *r);
/* The largest reply payload r can have, as td_replies_admit reserves it. */
uint64_t td_reply_need(const td_request_t *r);

/* Hands r's reply to ZeroMQ without waiting, and gives back its reservation; or keeps it
 * (TD_REPLY_KEPT: r now belongs here, its input already freed) when its connection has closed,
 * or has replies kept before it. Otherwise r stays the caller's. */
td_reply_outcome_t td_replies_send(td_replies_t *self, void *router, td_request_t *r);
/* Tries the kept replies again, in order per connection, and drops those kept longer than the
 * grace (each ends through `done`). Returns true while replies are still kept. */
bool td_replies_retry(td_replies_t *self, void *router, uint64_t now_ns);
/* The socket is closing: every kept reply is dropped. */
void td_replies_close(td_replies_t *self);

/* Fills the reply gauges of g (td_metrics.h): bytes held inside ZeroMQ and reserved now, the
 * most one connection and all of them together have used (held + reserved) since start, and
 * the bounds in force. */
void td_replies_gauges(const td_replies_t *self, td_reply_gauges_t *g);

#endif
