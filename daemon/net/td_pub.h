/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_pub.h — subscriptions: the optional ZeroMQ PUB socket (PROTOCOL.md §11).
 *
 * Every interval a loop timer publishes one message per stream that changed since the last
 * tick (td_stream_t.pub_dirty, set where a request is applied or a stream reset) and one per
 * stream deleted (td_pub_deleted), deletions first, so a stream deleted and used again within
 * one interval is seen deleted, then new. A message is [stream name][64-byte header][the
 * stream's `query` record]; see tally_pub_encode. Sends never block: PUB drops what a slow
 * subscriber does not take (its high-water mark, TD_PUB_SNDHWM), which the header's pub_seq
 * makes visible to it.
 *
 * Cost: one pass over the stream table per interval (a flag test per stream) and, per changed
 * stream, one record encoded (2-8 KiB) — nothing on the request path but setting the flag.
 * Loop thread only.
 */
#ifndef TD_PUB_H
#define TD_PUB_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "td_auth.h"
#include "td_err.h"
#include "td_stream.h"

typedef struct td_pub td_pub_t;

/* Binds a PUB socket of zmq_ctx at endpoint and starts publishing `streams` every interval_ms.
 * With auth (CURVE on; NULL: off) the socket is a CURVE server with the request endpoint's key
 * and ZAP domain (td_auth_secure), so only allowed clients subscribe (PROTOCOL.md §12).
 * TD_ERR_BIND with why when the endpoint cannot be bound (or the socket made a CURVE server);
 * TD_ERR_NOMEM. */
td_err_t td_pub_new(uv_loop_t *loop, void *zmq_ctx, td_auth_t *auth, const char *endpoint,
                    unsigned interval_ms, td_streams_t *streams, td_pub_t **out, char *why,
                    size_t why_cap);
/* Stops the timer and closes the socket (nothing is published after it); the loop must run
 * once more before td_pub_destroy frees it. */
void td_pub_close(td_pub_t *self);
void td_pub_destroy(td_pub_t **self_p);

/* The endpoint bound (a wildcard port resolved). */
const char *td_pub_endpoint(const td_pub_t *self);
/* A stream named name[0..len) was deleted: a `deleted` message goes out at the next tick. */
void td_pub_deleted(td_pub_t *self, const char *name, size_t len);
/* Publishes what changed now (a tick; tests and the final flush at shutdown). */
void td_pub_tick(td_pub_t *self);
/* Messages published, and messages ZeroMQ refused (counted, not retried). */
uint64_t td_pub_messages(const td_pub_t *self);
uint64_t td_pub_failed(const td_pub_t *self);

#endif
