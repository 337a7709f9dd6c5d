/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_chunk.c — the arithmetic of chunks (tally_internal.h): how big a chunk is and how many an
 * input makes, and how chunk replies add up to the reply for the whole input (a scan's running
 * offset, a histogram's counts). Pure functions, no sockets: the pushes (tally_push.c) and the
 * shared-memory hist in pieces (tally_shm.c) use them, and the unit tests call them directly.
 */
#include "tally.h"
#include "tally_internal.h"

void tally__scan_offset(uint8_t *vals, size_t n, bool out_i32, uint64_t offset)
{
    if (out_i32) {
        uint32_t off32 = (uint32_t)offset;
        for (size_t i = 0; i < n; i++)
            tally_put_u32(vals + 4 * i, tally_get_u32(vals + 4 * i) + off32);
    } else {
        for (size_t i = 0; i < n; i++)
            tally_put_u64(vals + 8 * i, tally_get_u64(vals + 8 * i) + offset);
    }
}

void tally__hist_add(uint8_t *acc, const uint8_t *vals, size_t n)
{
    for (size_t i = 0; i < n; i++)
        tally_put_u64(acc + 8 * i, tally_get_u64(acc + 8 * i) + tally_get_u64(vals + 8 * i));
}

size_t tally__hist_values(uint8_t dtype)
{
    return tally_hist_values(dtype);
}

size_t tally__chunk_bytes(size_t requested, size_t elem_size)
{
    size_t chunk = requested ? requested : TALLY_DEFAULT_CHUNK_BYTES;
    chunk -= chunk % elem_size;
    return chunk ? chunk : elem_size;
}

uint64_t tally__chunk_count(size_t len, size_t chunk_bytes)
{
    return len ? (len + chunk_bytes - 1) / chunk_bytes : 1;
}
