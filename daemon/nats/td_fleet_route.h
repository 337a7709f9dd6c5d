/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_route.h — direct mode (PROTOCOL.md §13 "Direct mode", docs/fleet.md): producers send
 * a stream's requests straight to the member that owns its partition, over ZeroMQ or shared
 * memory, instead of through JetStream.
 *
 * Three jobs, all here so that the files of the apply path keep one call each:
 *   - publishing: every heartbeat, the member's endpoints (its ZeroMQ endpoint, [nats] advertise
 *     or its first bind, and its side channel) under its member id in TALLY_ENDPOINTS, a bucket
 *     with the lease TTL, so a member that dies disappears from it as from TALLY_MEMBERS;
 *   - the table of who owns which partition as the fleet thread knows it (TALLY_LEASES and
 *     TALLY_ENDPOINTS, read at each heartbeat), which words a `not_owner` answer;
 *   - the question each shard asks of a request on a stream (td_route_t, core/td_shard.h): does
 *     this member own its partition with a lease that is valid by its own clock? Each owned
 *     partition's lease end is an atomic the fleet thread sets at a take and a renewal and
 *     clears at a loss or a give-up; a request admitted counts in its partition's in-flight
 *     count until its reply, so a give-up closes the partition, waits for that count to reach
 *     zero, and only then checkpoints: every direct write that was answered is in the
 *     checkpoint the next owner loads. Direct writes since a partition's last checkpoint are
 *     counted (nats_direct_uncommitted): with durability `local`, what a lost host loses.
 *     With `replicated` the route also holds each write's reply until its changelog record is
 *     stored (td_route_t.hold and .settled, td_fleet_changelog.h); a held request stays in its
 *     partition's in-flight count until its reply, so a give-up waits for those too.
 * Every function is a no-op on a fleet without direct mode (f->route NULL).
 */
#ifndef TD_FLEET_ROUTE_H
#define TD_FLEET_ROUTE_H

#include <stdint.h>

#include "td_config.h"
#include "td_err.h"

struct td_fleet;
typedef struct td_fleet_route td_fleet_route_t;

/* [nats] direct's value: false for off (or unset), true for local or replicated (which also
 * opens the changelog, td_fleet_changelog.h); anything else is refused with msg. */
td_err_t td_fleet_route_check_config(const td_config_t *cfg, bool *direct, char *msg, size_t cap);
/* With direct mode on: the bucket, the endpoint published, and the route handed to the request
 * path's shards (before they run). Fleet thread not started yet. */
td_err_t td_fleet_route_open(struct td_fleet *f, const td_config_t *cfg);
/* Removes this member's endpoints (a clean leave) and frees the route. */
void td_fleet_route_close(struct td_fleet *f);
/* Heartbeat (fleet thread, after the renewals): publishes the endpoints, moves every owned
 * partition's lease end to its renewal, and reads who owns the others and where they are. */
void td_fleet_route_beat(struct td_fleet *f);
/* Partition k was taken: direct requests on it run here until valid_until_ms (monotonic). */
void td_fleet_route_owned(struct td_fleet *f, uint32_t k, int64_t valid_until_ms);
/* Partition k is lost or given up: direct requests on it are answered not_owner from now on;
 * waits (up to a third of the lease TTL) until those admitted before have been answered. */
void td_fleet_route_closed(struct td_fleet *f, uint32_t k);
/* Direct writes on partition k answered since its last checkpoint; read before a checkpoint's
 * snapshot and handed back to td_fleet_route_committed once it is written. */
uint64_t td_fleet_route_uncommitted(struct td_fleet *f, uint32_t k);
void td_fleet_route_committed(struct td_fleet *f, uint32_t k, uint64_t count);
/* Partition k is no longer this member's (after td_fleet_route_closed): its count goes, the
 * writes in it checkpointed or lost with the local copy, so that nats_direct_uncommitted is
 * what this member's host would lose now. */
void td_fleet_route_forget(struct td_fleet *f, uint32_t k);

#endif
