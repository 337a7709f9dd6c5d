/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_transport.h — the wall between libtally's core and a way to reach tallyd other than the
 * client's own ZeroMQ socket (private to libtally; not installed).
 *
 * Design
 * ------
 * A client made by tally_client_new talks ZeroMQ itself (tally.c, tally_call.c). A client made
 * another way — tally_client_new_nats: a fleet over NATS JetStream, tally_client_nats.c — holds a
 * tally__transport_t, and for the few things that differ the core calls the transport's ops: send
 * one request, receive the next reply, how big a chunk one request may carry, a stream's
 * last_seq, and the end. The transport calls the core (tally__client_new_transport makes the
 * client around it; the replies it fills are tally.h's); the core calls the transport only through
 * its ops. So the core never names NATS, and libtally's files stand in floors with no circle
 * (tests/test_walls.sh): as the daemon's td_transport_t (daemon/core/td_transport.h), libuv's
 * uv_stream_t and nginx's event actions.
 *
 *   program ── tally_send, tally_recv, tally_push_* ──▶ core (tally_call.c, tally_push.c)
 *   core ── ops->send, recv, chunk_limit, last_seq ──▶ transport (tally_client_nats.c)
 *   transport ── tally__client_new_transport, tally_reply_* ──▶ core
 *
 * The rest of tally.h works on such a client unchanged: tally_call, the wrappers, tally_run and
 * pushes are sends and receives. What needs the ZeroMQ connection is refused in the transport's
 * name: shared memory needs tallyd's host and side channel ("shared memory is not available over
 * NATS"), unless the transport sends to tallyds on this host itself (send_shm: the fleet's direct
 * mode registers a region with each member it is used with), and tally_client_wait_connected has
 * nothing to wait for.
 */
#ifndef TALLY_TRANSPORT_H
#define TALLY_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#include "tally.h"

typedef struct tally__transport tally__transport_t;

typedef struct {
    const char *name; /* "NATS": what the core's messages call it */
    /* Sends req with its payload (copied, or sent, before it returns: tally_send_zc frees the
     * caller's buffer after); *request_id (may be NULL) receives the id its reply will carry. A
     * failure is said in error (cap bytes). */
    tally_status_t (*send)(tally__transport_t *self, const tally_req_t *req, const void *payload,
                           size_t len, uint64_t *request_id, char *error, size_t cap);
    /* The next reply, in any order, waiting up to timeout_ms (at least 1); reply->error says why
     * it failed. */
    tally_status_t (*recv)(tally__transport_t *self, int timeout_ms, tally_reply_t *reply);
    /* The largest payload one request may carry with its reply (a push cuts its chunks to it). */
    size_t (*chunk_limit)(const tally__transport_t *self, const tally_req_t *req);
    /* The stream's last_seq (0 for a stream that does not exist yet), for a push that numbers
     * its chunks; a failure is said in error (cap bytes). */
    tally_status_t (*last_seq)(tally__transport_t *self, const char *stream, uint64_t *last,
                               char *error, size_t cap);
    /* Optional (NULL: shared memory is refused in the transport's name). Sends req (its flags
     * with TALLY_FLAG_SHM_REF) with the reference `ref` (TALLY_SHM_REF_SIZE bytes, checked, handles
     * 0) to the regions in and out (NULL: none), as tally_send_shm; the transport registers
     * each region (region->fd) with the tallyd it sends to (tally__region_register) and puts
     * that tallyd's handles in the reference. */
    tally_status_t (*send_shm)(tally__transport_t *self, const tally_req_t *req, const uint8_t *ref,
                               const tally_region_t *in, const tally_region_t *out,
                               uint64_t *request_id, char *error, size_t cap);
    /* With send_shm: releases the region on every tallyd it was registered with (the region is
     * freed after). */
    void (*region_release)(tally__transport_t *self, const tally_region_t *region);
    /* With send_shm, optional (NULL: 0): the max_batch of the tallyd that a shared-memory req
     * reading region `in` goes to now, its region registered there on the way; 0 when not
     * known (no such tallyd, or it cannot take the region: the send then says why), so that
     * tally_call_shm cuts a hist over it into pieces as for one tallyd. */
    size_t (*shm_max_batch)(tally__transport_t *self, const tally_req_t *req,
                            const tally_region_t *in);
    /* Ends the transport (what it published first gets its acknowledgement, or times out) and
     * frees it; sets *self_p to NULL. */
    void (*destroy)(tally__transport_t **self_p);
} tally__transport_ops_t;

/* A transport: embedded first in the transport's own struct. */
struct tally__transport {
    const tally__transport_ops_t *ops;
};

/* A client that reaches tallyd through `transport`, which it takes (ended by
 * tally_client_destroy); timeout_ms bounds each call as tally_client_new's. TALLY_E_NOMEM leaves
 * the transport the caller's. */
tally_status_t tally__client_new_transport(tally__transport_t *transport, int timeout_ms,
                                           tally_client_t **out);
/* A reply a transport makes itself: its payload becomes buf (malloc'ed, len bytes; freed by
 * tally_reply_clear, or here when out of memory). */
tally_status_t tally__reply_take(tally_reply_t *reply, uint8_t *buf, size_t len);

#endif /* TALLY_TRANSPORT_H */
