/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_plan.c — rendezvous (highest random weight) hashing: each member scores every
 * partition with a hash of (member id, partition) and the highest score owns it. Adding a member
 * changes an owner only where the newcomer scores highest; removing one only where it was the
 * owner; nobody needs to agree on anything but the list of live members.
 *
 * The score is FNV-1a 64 (proto's published one) of "<member>/<k>" passed through SplitMix64's
 * finaliser: FNV alone changes mostly the low bits when only the last character differs, and
 * the comparison of scores is decided by the high ones.
 */
#include <stdio.h>
#include <string.h>

#include "tally_proto.h"
#include "td_fleet_plan.h"

uint64_t td_fleet_score(const char *member, uint32_t k)
{
    char suffix[16];
    int n = snprintf(suffix, sizeof suffix, "/%u", (unsigned)k);
    uint64_t h = tally_fnv1a64_from(TALLY_FNV1A64_BASIS, member, strlen(member));
    h = tally_fnv1a64_from(h, suffix, (size_t)n);
    return tally_mix64(h);
}

/* True when (score a, id a) beats (score b, id b). */
static bool beats(uint64_t sa, const char *a, uint64_t sb, const char *b)
{
    return sa != sb ? sa > sb : strcmp(a, b) > 0;
}

int td_fleet_owner(const char *const *members, size_t n, uint32_t k)
{
    int best = -1;
    uint64_t best_score = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t s = td_fleet_score(members[i], k);
        if (best < 0 || beats(s, members[i], best_score, members[best])) {
            best = (int)i;
            best_score = s;
        }
    }
    return best;
}

uint32_t td_fleet_plan(const char *const *members, size_t n, const char *self, uint32_t partitions,
                       bool *mine)
{
    uint32_t count = 0;
    for (uint32_t k = 0; k < partitions; k++) {
        uint64_t own = td_fleet_score(self, k);
        bool best = true;
        for (size_t i = 0; i < n && best; i++)
            if (strcmp(members[i], self) != 0 &&
                beats(td_fleet_score(members[i], k), members[i], own, self))
                best = false;
        mine[k] = best;
        count += best;
    }
    return count;
}

void td_fleet_plan_next(const char *const *members, size_t n, const char *self, uint32_t partitions,
                        bool *next)
{
    for (uint32_t k = 0; k < partitions; k++) {
        uint64_t own = td_fleet_score(self, k);
        size_t ahead = 0;
        for (size_t i = 0; i < n && ahead < 2; i++)
            ahead += strcmp(members[i], self) != 0 &&
                     beats(td_fleet_score(members[i], k), members[i], own, self);
        next[k] = ahead == 1;
    }
}
