/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_reply.h — the bytes that replies hold until their transport is done with them, and the bounds
 * on them (issue 21).
 *
 * A reply is handed to its transport (td_transport.h) at once; what becomes of it there — sent,
 * queued in a socket, kept for a connection that closed (the ZeroMQ transport keeps replies for
 * TD_REPLY_RECONNECT_GRACE_MS, td_zmq.h), dropped — is the transport's. ZeroMQ's high-water mark
 * counts messages, not bytes, so a peer that pipelines large scans and never reads could make
 * tallyd hold gigabytes of replies. This module counts reply bytes per connection and in total:
 *   - reserved: when a request is admitted (td_replies_admit), its largest possible reply (a
 *     filter: its payload; a scan: its payload, or twice that for int64 sums; nothing when the
 *     output goes to a shared-memory region; other operations: nothing, their replies are small)
 *     is reserved, on the loop thread, until its reply is handed to its transport;
 *   - held: a reply's payload counts from the moment it is handed to its transport
 *     (td_replies_hand) until the transport frees it (written out, kept and then dropped, or
 *     dropped at once). Transports free on any thread (ZeroMQ on its I/O thread), so these
 *     counters are atomics, the connection's in its reply meter (td_peers.h), which outlives the
 *     connection's entry while replies hold it.
 * A request is refused (`busy`, before it runs) when its connection already uses something and
 * would go past max_reply_bytes_per_peer with it, or, for a filter or scan that needs a
 * reservation, when all connections already use something and would go past max_reply_bytes. So a
 * connection (and tallyd) with nothing outstanding always gets one request through, whatever the
 * size of its reply; a peer at its bound is answered `busy` (retry-safe, cheap: nothing is
 * computed), until it reads; every other peer keeps being served. Headers, routing ids and error
 * messages are not counted: they are small, and the transports bound their number (ZeroMQ's
 * 1024-message queue).
 *
 * Loop thread, except the free function that transports call.
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
    uint64_t rerouted; /* read after a reconnect took the connection's routing id over (counter) */
} td_reply_gauges_t;

typedef struct td_replies td_replies_t;

/* cfg is the live configuration (the bounds may be reloaded). */
td_err_t td_replies_new(const td_config_t *cfg, td_replies_t **out);
/* After every transport has freed its replies (zmq_ctx_term: ZeroMQ may free them until then). */
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

/* r's reply leaves the path: gives back its reservation and fills r->out (td_transport.h) with
 * its header and its payload, which counts as held until the transport frees it (an error
 * message is not counted). r->reply_data belongs to r->out.body after (reply_len stays). */
void td_replies_hand(td_replies_t *self, td_request_t *r);

/* Fills the reply gauges of g (td_metrics.h): bytes held by transports and reserved now, the
 * most one connection and all of them together have used (held + reserved) since start, and
 * the bounds in force. */
void td_replies_gauges(const td_replies_t *self, td_reply_gauges_t *g);

#endif
