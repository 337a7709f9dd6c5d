/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_hash.h — the one FNV-1a 64 of the daemon: the stream and peer tables hash names with it,
 * and version-1 state files carry it as their checksum (td_state.h).
 *
 * The offset basis is the one tallyd has always used, 1469598103934665603: one digit short of
 * FNV's published 14695981039346656037. Version-1 state files on disk were summed with it, so it
 * stays; for a table hash any odd-enough start does.
 */
#ifndef TD_HASH_H
#define TD_HASH_H

#include <stddef.h>
#include <stdint.h>

#define TD_FNV1A64_BASIS 1469598103934665603ull
#define TD_FNV1A64_PRIME 1099511628211ull

static inline uint64_t td_fnv1a64(const void *data, size_t len)
{
    const uint8_t *p = data;
    uint64_t h = TD_FNV1A64_BASIS;
    for (size_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= TD_FNV1A64_PRIME;
    }
    return h;
}

#endif
