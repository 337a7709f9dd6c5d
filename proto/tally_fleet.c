/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_fleet.c — the partition of a stream and the fleet's names (PROTOCOL.md §13). Pure
 * functions on byte buffers, shared by libtally's NATS producer and the daemon's worker so
 * that both, and any other client that follows the document, put a stream in one partition.
 */
#include <stdio.h>
#include <string.h>

#include "tally_fleet.h"

uint64_t tally_fnv1a64(const void *data, size_t len)
{
    return tally_fnv1a64_from(TALLY_FNV1A64_BASIS, data, len);
}

uint32_t tally_partition(const char *stream, size_t len, uint32_t partitions)
{
    if (partitions == 0)
        return 0;
    return (uint32_t)(tally_fnv1a64(stream, len) % partitions);
}

size_t tally_fleet_name(char *buf, size_t cap, const char *prefix, uint32_t k)
{
    int n = snprintf(buf, cap, "%s%u", prefix, (unsigned)k);
    return n > 0 && (size_t)n < cap ? (size_t)n : 0;
}

bool tally_fleet_member_id_valid(const char *id)
{
    size_t len = id ? strlen(id) : 0;
    if (len == 0 || len > TALLY_NATS_MEMBER_ID_MAX)
        return false;
    for (size_t i = 0; i < len; i++) {
        char c = id[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '-' || c == '_';
        if (!ok)
            return false;
    }
    return true;
}
