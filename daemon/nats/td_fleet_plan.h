/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_plan.h — who owns which partition (PROTOCOL.md §13 "Membership and who owns what"):
 * rendezvous hashing of partitions over the live members. Pure arithmetic on member ids, no
 * NATS, so the rule that a join or a loss moves only its share is unit-tested on its own.
 */
#ifndef TD_FLEET_PLAN_H
#define TD_FLEET_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* mix64(FNV-1a-64(member, "/", k in decimal)): the member's score for partition k. */
uint64_t td_fleet_score(const char *member, uint32_t k);
/* The index in members[0..n) of partition k's owner (highest score, ties to the id that sorts
 * last), or -1 when n is 0. */
int td_fleet_owner(const char *const *members, size_t n, uint32_t k);
/* mine[k] (k < partitions) = whether partition k belongs to `self` among members[0..n) (self
 * need not be listed: it is counted as a member either way). The number of partitions that
 * are its. */
uint32_t td_fleet_plan(const char *const *members, size_t n, const char *self, uint32_t partitions,
                       bool *mine);
/* next[k] (k < partitions) = whether `self` comes right after partition k's owner among
 * members[0..n) (self counted whether listed or not): exactly one other member beats it. The
 * member a partition's standby copy lives on ([nats] standbys = 1, docs/fleet.md "Standbys"),
 * and the one the plan gives it to when its owner leaves. */
void td_fleet_plan_next(const char *const *members, size_t n, const char *self, uint32_t partitions,
                        bool *next);

#endif
