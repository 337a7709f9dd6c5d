/*
 * td_reply.h — sending replies over the ROUTER socket, and the bytes that unread replies hold.
 *
 * A reply never waits for its peer: it is handed to ZeroMQ at once (or dropped when the peer has
 * gone or its 1024-message send queue is full). ZeroMQ's high-water mark counts messages, not
 * bytes, so a peer that pipelines large scans and never reads could make tallyd hold gigabytes
 * of replies (issue 21). This module counts reply bytes per connection and in total:
 *   - reserved: when a request is admitted (td_replies_admit), its largest possible reply (a
 *     filter: its payload; a scan: its payload, or twice that for int64 sums; nothing when the
 *     output goes to a shared-memory region; other operations: nothing, their replies are small)
 *     is reserved, on the loop thread, until its reply is sent or dropped;
 *   - held: a reply's payload handed to ZeroMQ counts until ZeroMQ frees it (written out, or
 *     dropped with its connection). ZeroMQ calls the free function on its I/O thread, so these
 *     counters are atomics, the connection's in its reply meter (td_peers.h), which outlives the
 *     connection's entry while replies hold it.
 * A request is refused (`busy`, before it runs) when its connection already uses something and
 * would go past max_reply_bytes_per_peer with it, or, for a filter or scan that needs a
 * reservation, when all connections already use something and would go past max_reply_bytes.
 * So a connection (and tallyd) with nothing outstanding always gets one request through,
 * whatever the size of its reply; a peer at its bound is answered `busy` (retry-safe, cheap:
 * nothing is computed), until it reads; every other peer keeps being served. Headers, routing
 * ids and error messages are not counted: they are small, and the 1024-message queue bounds them.
 *
 * Loop thread, except the free function that ZeroMQ calls.
 */
#ifndef TD_REPLY_H
#define TD_REPLY_H

#include <stdbool.h>
#include <stdint.h>

#include "td_config.h"
#include "td_err.h"
#include "td_metrics.h"
#include "td_request.h"

typedef struct td_replies td_replies_t;

/* cfg is the live configuration (the bounds may be reloaded). */
td_err_t td_replies_new(const td_config_t *cfg, td_replies_t **out);
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

/* Hands r's reply to ZeroMQ without waiting, and gives back its reservation. Returns 0 when
 * sent, else the errno of the failed send: EHOSTUNREACH (the peer has gone) or EAGAIN (its send
 * queue is full: it does not read its replies). */
int td_replies_send(td_replies_t *self, void *router, td_request_t *r);

/* Fills the reply gauges of g (td_metrics.h): bytes held inside ZeroMQ and reserved now, the
 * most one connection and all of them together have used (held + reserved) since start, and
 * the bounds in force. */
void td_replies_gauges(const td_replies_t *self, td_gauges_t *g);

#endif
