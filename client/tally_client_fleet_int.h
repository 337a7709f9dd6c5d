/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_client_fleet_int.h — what the fleet client's two files lend each other: the client
 * (tally_client_fleet.c: sending, resending, receiving, shared memory) and who owns what
 * (tally_client_fleet_owners.c: the members it connects to, their records in TALLY_ENDPOINTS,
 * each partition's owner from TALLY_LEASES). Private to libtally; not installed.
 */
#ifndef TALLY_CLIENT_FLEET_INT_H
#define TALLY_CLIENT_FLEET_INT_H

#include <stdbool.h>
#include <stdint.h>

#include <nats/nats.h>

#include "tally.h"
#include "tally_fleet.h"
#include "tally_keys.h"
#include "tally_transport.h"

#define TALLY_FLEET_MEMBERS_MAX 64
#define TALLY_FLEET_SUSPECT_MS 1000
#define TALLY_FLEET_POLL_MS 50

typedef struct {
    char member[TALLY_NATS_MEMBER_ID_MAX + 1];
    char endpoint[TALLY_NATS_ENDPOINT_MAX];
    char key[TALLY_KEY_LEN + 1]; /* the server key it publishes (curve=), or "" */
    tally_client_t *c;
    bool down; /* its connection did not come up within a probe: not waited for again */
} member_t;

typedef struct pending pending_t;           /* a request kept until its reply */
typedef struct registration registration_t; /* a region registered with a member */

typedef struct fleetc fleetc_t;
struct fleetc {
    tally__transport_t base; /* first: the core's handle on it */
    tally_nats_t *nats;      /* the connection (a producer's, tally_nats.c) */
    kvStore *leases, *endpoints;
    uint32_t partitions;
    int timeout_ms;
    member_t members[TALLY_FLEET_MEMBERS_MAX];
    int count;
    int owner[TALLY_NATS_MAX_PARTITIONS]; /* the member each partition's requests go to; -1 */
    pending_t *head, **tail; /* in the order sent: a stream's numbered requests resent in order */
    uint64_t next_id;
    int64_t checked_us;
    registration_t *regs;
    char host[TALLY_FLEET_HOST_MAX]; /* this host's identity ("": unknown, no member is local) */
    tally_curve_keys_t keys;         /* the client's pair ("": plain) and a server key pinned */
    /* Why the last tally__fleet_owner_now or member_index refused a member (its keys, or one
     * member past TALLY_FLEET_MEMBERS_MAX; "": it did not): no wait mends that. */
    char refused[TALLY_ERROR_MESSAGE_MAX + 1];
    /* The last failure to read a bucket other than a missing key, or to make a client for the
     * endpoint a member publishes ("": none since tally__fleet_owner_now began): what the "no
     * owner" message adds. */
    char lookup[TALLY_ERROR_MESSAGE_MAX + 1];
    /* The last `not_owner` that named no owner, since a request was last answered ("": none):
     * what a timeout adds. */
    char unowned[TALLY_ERROR_MESSAGE_MAX + 1];
    char error[TALLY_ERROR_MESSAGE_MAX + 1];
};

/* A member's record in TALLY_ENDPOINTS (PROTOCOL.md §13), each value "" when it has none. */
typedef struct {
    char zmq[TALLY_NATS_ENDPOINT_MAX];
    char curve[TALLY_KEY_LEN + 1];
    char host[TALLY_FLEET_HOST_MAX];
    char shm[TALLY_NATS_ENDPOINT_MAX];
} record_t;

/* Member's record into r; false when it has none (it left, or NATS did not answer). */
bool tally__fleet_member_record(fleetc_t *self, const char *member, record_t *r);
/* Partition k's owner now, as the buckets say: its member index, or -1 (none with direct mode
 * yet, or NATS did not answer). */
int tally__fleet_owner_now(fleetc_t *self, uint32_t k);
/* Waits for partition k's owner until deadline (us). */
int tally__fleet_owner_until(fleetc_t *self, uint32_t k, int64_t deadline);
/* At most TALLY_FLEET_SUSPECT_MS (and the timeout) for a member's connection to come up. */
int tally__fleet_probe_ms(const fleetc_t *self);
/* When a wait for member o's connection gives up: a probe from now, or now when it is known
 * down. */
int64_t tally__fleet_probe_deadline(const fleetc_t *self, const member_t *o);
/* Partition k's owner for a call made now: the one known, unless its connection does not come
 * up within a probe (it exited): then the one the routing names next, waited for until
 * deadline (us); -1 when none is up by then (self->error says why). */
int tally__fleet_owner_up(fleetc_t *self, uint32_t k, int64_t deadline);
/* A not_owner answer's "partition K is owned by M at ENDPOINT": M's member index, or -1. */
int tally__fleet_named_owner(fleetc_t *self, const char *why);

#endif
