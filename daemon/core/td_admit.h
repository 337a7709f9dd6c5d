/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_admit.h — who sent a request, and the per-connection limits it meets before it runs
 * (PROTOCOL.md §1, §8): the connection's share of the in-flight slots (max_inflight_per_peer),
 * and the bytes its unread replies hold (max_reply_bytes_per_peer, max_reply_bytes: td_reply.h).
 * Either refusal is `busy`, with no effect, counted in tallyd_limited_total and for its client.
 * The stream limits (max_streams_per_client, stream_create_rate) are checked where a stream is
 * created (td_shard.c), with td_admit_count_limited.
 *
 * Threads (issue 31): identifying a request and counting its connection's requests in flight is
 * the transports' thread's (td_path.c: td_admit_identify, td_admit_answered), which sees every
 * request in the order it was read; the fair share is judged there, when the request is counted,
 * and the verdict travels with the request to its shard, which answers `busy` with it after the
 * checks that come first (td_admit_over_share). The reply bounds and the refusal counts are the
 * shard's (td_reply.h's counters are shared atomics). One td_admit_t for the front and one per
 * shard: the front's holds active_conns, a shard's its metrics.
 */
#ifndef TD_ADMIT_H
#define TD_ADMIT_H

#include <stdbool.h>

#include "td_config.h"
#include "td_counters.h"
#include "td_peers.h"
#include "td_reply.h"
#include "td_request.h"

typedef struct td_admit {
    const td_config_t *cfg; /* live: reloads apply */
    td_peers_t *peers;
    td_replies_t *replies;
    td_metrics_t *metrics;
    unsigned active_conns; /* connections with requests in flight (the fair share's divisor) */
    unsigned rate;         /* the stream creation rate last given to peers */
} td_admit_t;

/* Who sent r (td_peers.h): its connection (r->identity), and its client identity — the ZAP user
 * id that CURVE authenticated (`user`, the "User-Id" property of its messages; NULL or empty
 * without CURVE), else the connection itself. The connection counts r as in flight until
 * td_admit_answered, and whether that passes its share of the in-flight slots is noted in r.
 * r->received_ns is the time the peers' table sees. */
void td_admit_identify(td_admit_t *a, td_request_t *r, const char *user);
/* r's reply has left (or was dropped or kept): its connection has one fewer in flight. */
void td_admit_answered(td_admit_t *a, td_request_t *r);
/* A validated request that passed its connection's share of the in-flight slots when it was
 * identified is failed `busy` and counted: true then. */
bool td_admit_over_share(td_admit_t *a, td_request_t *r);
/* The same for the bounds on unread reply bytes (td_reply.h), checked once the request's output
 * is known (after its shared-memory reference is resolved); when it passes, its largest reply is
 * reserved. */
bool td_admit_over_reply_bound(td_admit_t *a, td_request_t *r);
/* r is refused by a per-peer limit: counted for tallyd_limited_total and for its client. */
void td_admit_count_limited(td_admit_t *a, const td_request_t *r, td_limit_t limit);

#endif
