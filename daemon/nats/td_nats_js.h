/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_nats_js.h — the fleet's JetStream objects (PROTOCOL.md §13): the partition streams
 * TALLY_P<k> on tally.in.<k>, the dead-letter stream, and the key-value buckets TALLY_FLEET
 * (the number of partitions), TALLY_MEMBERS and TALLY_LEASES (with the lease TTL) and
 * TALLY_CKPT. A worker makes sure they exist when it starts; what exists is left as it is, and
 * a bucket or a partition count that disagrees with the worker's configuration is refused.
 */
#ifndef TD_NATS_JS_H
#define TD_NATS_JS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <nats/nats.h>

#include "td_err.h"

typedef struct {
    uint32_t partitions;          /* 1 .. TALLY_NATS_MAX_PARTITIONS */
    int replicas;                 /* of every stream and bucket */
    int64_t partition_max_bytes;  /* a partition stream's limit (discard new) */
    int64_t partition_max_age_ms; /* how long a partition stream keeps a message */
    int64_t lease_ttl_ms;         /* TTL of TALLY_MEMBERS and TALLY_LEASES */
    int32_t max_msg_size;         /* the server's max_payload: the streams' largest message */
} td_nats_layout_t;

/* Creates what is missing; TD_ERR_CONFIG when the fleet's partition count or a bucket's TTL
 * differs from the layout, TD_ERR_LIBRARY when NATS refuses (msg says why). */
td_err_t td_nats_fleet_ensure(jsCtx *js, const td_nats_layout_t *layout, char *msg, size_t cap);

/* A stream capturing `subject` alone (file storage, limits retention, a message kept
 * max_age_ms), created when missing; one capturing anything else is TD_ERR_CONFIG. */
td_err_t td_nats_stream_ensure(jsCtx *js, const char *name, const char *subject, int replicas,
                               int64_t max_age_ms, int32_t max_msg_size, char *msg, size_t cap);

/* Binds the bucket `name`, creating it (history 1, ttl_ms: 0 = none) when it does not exist.
 * An existing bucket with another TTL is TD_ERR_CONFIG. */
td_err_t td_nats_kv_open(jsCtx *js, const char *name, int64_t ttl_ms, int replicas, kvStore **out,
                         char *msg, size_t cap);

/* The fleet's partition count from TALLY_FLEET; TD_ERR_CONFIG when there is no fleet yet. */
/* The TTL of key-value bucket name (0: none); TD_ERR_CONFIG when there is no such bucket. */
td_err_t td_nats_bucket_ttl(jsCtx *js, const char *name, int64_t *ttl_ms);

td_err_t td_nats_read_partitions(jsCtx *js, uint32_t *partitions, char *msg, size_t cap);

/* How long a key listing waits for its keys, all of them: the fleet thread makes them
 * (membership, a checkpoint's old chunks), and waits as long as for any other bucket call
 * (docs/fleet.md: "each bucket call waits 1 s"). */
#define TD_NATS_KEYS_WAIT_MS 1000

/* The keys of a bucket that match filter (">": every key), deleted ones left out, into *keys
 * (*n of them; td_nats_kv_keys_free them; none when the bucket has none). Not libnats'
 * kvStore_Keys: 3.4.1's subtracts the time since the listing began from its wait after each key,
 * so a listing of a thousand keys, or of a few delivered slowly, timed out within milliseconds
 * (bench/NOTES.md, "The listing that timed out"); and it cannot filter. */
td_err_t td_nats_kv_keys(kvStore *kv, const char *filter, char ***keys, size_t *n, char *msg,
                         size_t cap);
void td_nats_kv_keys_free(char **keys, size_t n);

/* nats_GetLastError's text, or the status's when there is none: for messages. */
const char *td_nats_last_error(natsStatus s);

/* The next message already queued on a synchronous subscription, without waiting: true and *m
 * (natsMsg_Destroy it), or false when none is queued. Only what is queued: a NextMsg that
 * finds nothing costs libnats an error text, several every turn of the fleet thread (issue 32). */
bool td_nats_next_queued(natsSubscription *sub, natsMsg **m);

#endif
