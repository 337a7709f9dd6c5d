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

#include "tally_proto.h"

#define TD_FNV1A64_BASIS 1469598103934665603ull

/* The NATS partition of a stream is not this hash: it is proto's tally_partition, the published
 * FNV-1a 64 that every client computes the same (PROTOCOL.md §13). */
static inline uint64_t td_fnv1a64(const void *data, size_t len)
{
    return tally_fnv1a64_from(TD_FNV1A64_BASIS, data, len);
}

/* The shard that owns a stream (issue 31): the published FNV-1a 64 of its name, the one of the
 * NATS partitions (PROTOCOL.md §13), mixed (tally_mix64, the rendezvous scores' mix64), modulo
 * the shards; 0 with one shard. A stream never moves while tallyd runs. Unmixed, a fleet worker's
 * shards were its partitions' (the hash modulo 2 of a partition's streams is its number modulo 2
 * when the partitions are 8): a worker owning partitions 1, 3 and 5 ran them all on one of its two
 * shards. */
static inline unsigned td_stream_shard(const char *name, size_t len, unsigned shards)
{
    return shards > 1 ? (unsigned)(tally_mix64(tally_fnv1a64(name, len)) % shards) : 0;
}

#endif
