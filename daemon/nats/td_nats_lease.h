/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_nats_lease.h — who is alive and who owns what (PROTOCOL.md §13 "Leases and fencing",
 * "Membership"): heartbeats in TALLY_MEMBERS, partition leases in TALLY_LEASES. Both buckets
 * have the lease TTL, so a key that is not written again within it disappears.
 *
 * A lease is the key p<k> holding the owner's member id, created only if absent (one worker
 * wins), renewed by compare-and-set on the revision the owner holds (a renewal fails once the
 * key expired or another worker took it), and released by a compare-and-set delete (so a stale
 * owner cannot delete its successor's lease). Besides the server's view, the owner keeps its
 * own: the lease is valid until TTL after the renewal was *sent* (a monotonic clock, which runs
 * on while the process is stopped), always before the server lets the key expire, so a worker
 * that wakes from a pause past its lease knows it before it acts.
 *
 * No grace past the TTL, even while the bucket has no leader to renew with (issue 32 asked
 * whether a lease nobody else can take might live on): the key's expiry is each replica's own
 * (the bucket is a stream with a max age, and every replica removes an old message by its own
 * clock), so once the TTL has passed since the last write, the replica that wins the election
 * has no key, and another worker's create succeeds at once. A worker acting past its TTL could
 * then apply beside the new owner; its checkpoint would be refused by the fence, but its
 * replies and watch publications would not. So the lease must outlive the election instead:
 * renewals are tried every second while they fail (td_fleet_int.h), and the default TTL (15 s,
 * TD_DEFAULT_NATS_LEASE_TTL_MS) is several elections long (docs/fleet.md).
 */
#ifndef TD_NATS_LEASE_H
#define TD_NATS_LEASE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <nats/nats.h>

#include "td_err.h"

typedef struct {
    uint64_t revision;      /* the lease key's revision this owner wrote last; 0: none */
    int64_t valid_until_ms; /* monotonic (td_nats_now_ms): TTL after the last renewal was sent */
} td_lease_t;

/* Monotonic milliseconds (CLOCK_MONOTONIC). */
int64_t td_nats_now_ms(void);

/* Tries to take partition k's lease for member. *taken: true when it is now ours (l filled),
 * false when another worker holds it. TD_ERR_LIBRARY when NATS fails (msg). */
td_err_t td_lease_acquire(kvStore *leases, uint32_t k, const char *member, int64_t ttl_ms,
                          td_lease_t *l, bool *taken, char *msg, size_t cap);
/* Renews the lease l holds. *lost: the key expired or was taken (l is cleared). */
td_err_t td_lease_renew(kvStore *leases, uint32_t k, const char *member, int64_t ttl_ms,
                        td_lease_t *l, bool *lost, char *msg, size_t cap);
/* Deletes the lease if it is still the one l holds (compare-and-set); l is cleared either way.
 * js is the bucket's JetStream context. */
td_err_t td_lease_release(jsCtx *js, uint32_t k, td_lease_t *l, char *msg, size_t cap);
/* The lease is ours and unexpired at now_ms (our own clock, PROTOCOL.md §13). */
bool td_lease_valid(const td_lease_t *l, int64_t now_ms);
/* The holder of partition k's lease into holder (cap bytes; "" when free). */
td_err_t td_lease_holder(kvStore *leases, uint32_t k, char *holder, size_t cap, char *msg,
                         size_t msg_cap);

/* When key of a bucket whose TTL is ttl_ms runs out if nobody writes it again: *at_ms on this
 * worker's monotonic clock (td_nats_now_ms), from the server's time of its last write and the
 * wall clocks' difference now (one host's, or NTP-close ones'); 0 when the key is absent. A
 * worker that waits for a key to go (a member that stopped beating, the lease of a partition it
 * should take) looks again then rather than at its next heartbeat (issue 32). */
td_err_t td_kv_expiry(kvStore *kv, const char *key, int64_t ttl_ms, int64_t *at_ms);
/* The lease key's name of partition k ("p<k>") into key (cap bytes). */
void td_lease_key(char *key, size_t cap, uint32_t k);

/* Writes member's heartbeat (its key in TALLY_MEMBERS, value `info`). */
td_err_t td_member_beat(kvStore *members, const char *member, const char *info, char *msg,
                        size_t cap);
/* Removes member's key (a clean leave: the others need not wait for the TTL). */
td_err_t td_member_leave(kvStore *members, const char *member, char *msg, size_t cap);
/* The live members: a malloc'ed array of *n malloc'ed ids (td_member_list_free). */
td_err_t td_member_list(kvStore *members, char ***ids, size_t *n, char *msg, size_t cap);
void td_member_list_free(char **ids, size_t n);

#endif
