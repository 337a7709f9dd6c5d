/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_peers.h — who is asking: the bookkeeping behind the limits that keep one peer from hurting
 * another (PROTOCOL.md §8, "Per-peer limits").
 *
 * One table of entries keyed by bytes, of two kinds:
 *   - a connection (its ZeroMQ routing id): the requests it has in flight, held to its fair
 *     share of max_inflight (max_inflight_per_peer, answered `busy`);
 *   - a client identity: the ZAP user id when CURVE is on (one entry per allowed key, whatever
 *     connections it uses), else the connection itself: the streams it created (held to
 *     max_streams_per_client, answered `client_streams`) and a token bucket for the rate at which
 *     it creates streams (stream_create_rate per second, burst of one second's worth, answered
 *     `rate_limited`).
 * Without CURVE the two kinds are the same entry.
 *
 * A connection also carries what its unread replies hold (td_reply.h): the bytes reserved for the
 * replies of its requests in flight (loop thread), and a reply meter, the bytes of its replies
 * handed to ZeroMQ and not yet freed by it. ZeroMQ frees a reply on its I/O thread, possibly
 * after the entry is gone, so the meter is a record of its own with an atomic count and a
 * reference count: the entry holds one reference, every reply inside ZeroMQ another. And it
 * carries the scheduler's per-peer queues (td_sched.c, deficit round robin), one per class of
 * worker, while they hold requests.
 *
 * An entry is referenced by the requests and streams that point to it and lives while they do.
 * Once unreferenced it stays until its token bucket has refilled (td_peers_sweep), so closing and
 * reopening nothing resets a rate; a user entry (CURVE) stays for good, since it carries the
 * per-user counters that the metrics report and there is one per allowed key at most.
 *
 * Threads (issue 31): the table — finding, adding and sweeping entries — and a connection's
 * requests in flight are the transports' thread's (td_path.c identifies every request there,
 * before it goes to its shard). An entry's other counters are shared by the shards that run the
 * peer's requests and hold its streams: its references, streams, state bytes, refusals and
 * reserved reply bytes are atomics, and where a bound applies the check and the count are one
 * step (td_peer_take_stream, td_peer_state_bytes_charge), so a per-client limit stays exact
 * however many shards count toward it; its token bucket (and the table's rate) is under a lock,
 * taken only when a stream is created; each shard has its own scheduler queues in the entry.
 */
#ifndef TD_PEERS_H
#define TD_PEERS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_err.h"

#define TD_PEER_KEY_MAX 256 /* routing ids and ZAP user ids are at most 255 bytes */
#define TD_PEER_NAME_MAX 80 /* printable form for logs and metric labels */

typedef enum {
    TD_PEER_CONNECTION = 'c',
    TD_PEER_USER = 'u',
} td_peer_kind_t;

/* One entry: its fields are td_peers.c's; the functions below read and count them. */
typedef struct td_peer td_peer_t;

typedef struct td_peers td_peers_t;

/* TD_ERR_NOMEM when out of memory. td_peers_new: for one shard. */
td_err_t td_peers_new(td_peers_t **out);
td_err_t td_peers_new_shards(unsigned shards, td_peers_t **out);
void td_peers_destroy(td_peers_t **self_p);

/* Sets the stream creation rate (per second, 0 = unlimited) used by td_peer_take_token and the
 * sweep: taken from the live configuration, so a reload applies. */
void td_peers_set_rate(td_peers_t *self, unsigned per_second);

/* The entry for (kind, id), created when missing, with one more reference. NULL when out of
 * memory (the caller then applies no per-peer limit to this request). */
td_peer_t *td_peers_acquire(td_peers_t *self, td_peer_kind_t kind, const void *id, size_t len,
                            uint64_t now_ns);
/* Drops one reference (and sets *peer_p to NULL); the entry goes once the sweep finds it idle. */
void td_peers_release(td_peers_t *self, td_peer_t **peer_p);

/* Takes one stream creation from the client's bucket; false when it is empty. */
bool td_peer_take_token(td_peers_t *self, td_peer_t *client, uint64_t now_ns);
/* Gives back the token of a creation that did not happen after all (the stream's request
 * failed: PROTOCOL.md §8), up to the burst. */
void td_peer_give_token(td_peers_t *self, td_peer_t *client);

/* Frees the entries nothing refers to whose bucket is full again (user entries stay). */
void td_peers_sweep(td_peers_t *self, uint64_t now_ns);

/* ---- One entry: what the server counts and checks ------------------------------------------ */

/* The printable name: the user id, or the routing id in hex. */
const char *td_peer_name(const td_peer_t *peer);
/* The requests and streams that hold a reference to it (td_peers_acquire, td_peer_stream_added;
 * td_peers_release drops one). */
unsigned td_peer_refs(const td_peer_t *peer);
/* A connection's requests in flight: one more (true when it had none before), one fewer (true
 * when it has none left). */
bool td_peer_inflight_begin(td_peer_t *conn);
bool td_peer_inflight_end(td_peer_t *conn);
unsigned td_peer_inflight(const td_peer_t *conn);
/* A client's streams: how many it holds; one more, unless it holds `max` already (then false,
 * with the count in *held); one fewer (a stream removed, or one taken for a creation that then
 * failed). */
unsigned td_peer_streams(const td_peer_t *client);
bool td_peer_take_stream(td_peer_t *client, unsigned max, unsigned *held);
void td_peer_give_stream(td_peer_t *client);
/* One more reference (a stream the client created: released with td_peers_release). */
void td_peer_hold(td_peer_t *peer);
/* The bytes of stream state a client's streams hold (max_state_bytes_per_client); `growth` more
 * unless that passes `max` (0: no bound; then false, with what it holds in *held); and one of
 * them going from `before` to `after` bytes (kept by td_stream.c). */
size_t td_peer_state_bytes(const td_peer_t *client);
bool td_peer_state_bytes_charge(td_peer_t *client, size_t growth, size_t max, size_t *held);
void td_peer_state_bytes_change(td_peer_t *client, size_t before, size_t after);
/* A user's counters (tallyd_client_*_total): a request read, a request refused by a limit. */
void td_peer_count_request(td_peer_t *user);
void td_peer_count_limited(td_peer_t *user);
uint64_t td_peer_requests(const td_peer_t *user);
uint64_t td_peer_limited(const td_peer_t *user);

/* A connection's reply meter (see the top): created with the entry; NULL when that had no memory.
 * td_reply_meter_hold and _release take and drop a reference from any thread; the last release
 * frees it. */
typedef struct td_reply_meter {
    _Atomic uint64_t held; /* reply bytes held by the transport (inside ZeroMQ) */
    _Atomic unsigned refs;
} td_reply_meter_t;
td_reply_meter_t *td_peer_meter(td_peer_t *conn);
void td_reply_meter_hold(td_reply_meter_t *meter);
void td_reply_meter_release(td_reply_meter_t *meter);
/* A connection's reply bytes reserved for its requests in flight (the shards'): add, returning
 * what was reserved before, or remove. */
uint64_t td_peer_reserved(const td_peer_t *conn);
uint64_t td_peer_reserve(td_peer_t *conn, uint64_t bytes);
void td_peer_unreserve(td_peer_t *conn, uint64_t bytes);

/* The scheduler's queue of this connection for worker class `cls` (< TD_PEER_FLOWS) of shard s,
 * at slot s x TD_PEER_FLOWS + cls, or NULL; the shard's scheduler sets it while the queue holds
 * requests (each of which references the entry). */
#define TD_PEER_FLOWS 2
struct td_sched_flow;
struct td_sched_flow *td_peer_flow(const td_peer_t *conn, unsigned slot);
void td_peer_set_flow(td_peer_t *conn, unsigned slot, struct td_sched_flow *flow);

/* Entries in the table, and iteration over the user entries (for the metrics). */
unsigned td_peers_count(const td_peers_t *self);
typedef void (*td_peer_visit_fn)(void *ctx, const td_peer_t *user);
void td_peers_each_user(const td_peers_t *self, td_peer_visit_fn visit, void *ctx);

#endif
