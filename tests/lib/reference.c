/* SPDX-License-Identifier: Apache-2.0 */
/*
 * reference.c — the operations in plain C, one element at a time (reference.h says why).
 */
#include "reference.h"

#include <string.h>

#include "tally_proto.h"

/* Reads go through memcpy: a batch may sit at any address (a reply's payload, a small ZeroMQ
 * message kept inside its zmq_msg_t). */
int64_t tr_elem(unsigned dtype, const void *in, size_t i)
{
    const uint8_t *p = in;
    uint16_t u16;
    int32_t i32;
    switch (dtype) {
    case TALLY_DTYPE_U8:
        return p[i];
    case TALLY_DTYPE_U16:
        memcpy(&u16, p + 2 * i, 2);
        return u16;
    default:
        memcpy(&i32, p + 4 * i, 4);
        return i32;
    }
}

bool tr_keep(unsigned pred, int64_t lo, int64_t hi, int64_t x)
{
    switch (pred) {
    case TALLY_PRED_GT:
        return x > lo;
    case TALLY_PRED_GE:
        return x >= lo;
    case TALLY_PRED_LT:
        return x < lo;
    case TALLY_PRED_LE:
        return x <= lo;
    case TALLY_PRED_EQ:
        return x == lo;
    case TALLY_PRED_NE:
        return x != lo;
    case TALLY_PRED_BETWEEN:
        return lo <= x && x <= hi;
    default:
        return false; /* not a predicate: the validator refuses it before any backend runs */
    }
}

size_t tr_filter(unsigned dtype, const void *in, size_t n, unsigned pred, int64_t lo, int64_t hi,
                 void *out)
{
    size_t esize = tally_dtype_size((tally_dtype_t)dtype);
    size_t kept = 0;
    for (size_t i = 0; i < n; i++) {
        if (!tr_keep(pred, lo, hi, tr_elem(dtype, in, i)))
            continue;
        if (out)
            memcpy((uint8_t *)out + esize * kept, (const uint8_t *)in + esize * i, esize);
        kept++;
    }
    return kept;
}

uint64_t tr_scan(const void *in, size_t n, bool exclusive, bool out_i32, uint64_t carry, void *out)
{
    uint8_t *o = out;
    for (size_t i = 0; i < n; i++) {
        uint64_t inclusive = carry + (uint64_t)tr_elem(TALLY_DTYPE_I32, in, i);
        uint64_t y = exclusive ? carry : inclusive;
        uint32_t low = (uint32_t)y;
        carry = inclusive;
        if (out && out_i32)
            memcpy(o + 4 * i, &low, 4);
        else if (out)
            memcpy(o + 8 * i, &y, 8);
    }
    return carry;
}

uint64_t tr_sum(const void *in, size_t n, uint64_t carry)
{
    return tr_scan(in, n, false, false, carry, NULL);
}

unsigned tr_hist_bin(int64_t x, int64_t lo, int64_t hi)
{
    unsigned __int128 range = (uint64_t)hi - (uint64_t)lo;
    unsigned __int128 off = (uint64_t)x - (uint64_t)lo;
    return (unsigned)(off * 256 / range);
}

void tr_hist_parts(unsigned dtype, const void *in, size_t n, int64_t lo, int64_t hi, uint64_t *bins,
                   uint64_t *under, uint64_t *over)
{
    unsigned channels = tally_hist_channels(dtype);
    bool ranged = tally_hist_ranged(dtype);
    const uint8_t *bytes = in;
    for (size_t i = 0; i < n; i++) {
        if (!ranged) { /* u8, and each byte of a pixel in its channel */
            for (unsigned c = 0; c < channels; c++)
                bins[c * TALLY_HIST_BINS + bytes[channels * i + c]]++;
            continue;
        }
        int64_t x = tr_elem(dtype, in, i);
        if (x < lo)
            (*under)++;
        else if (x >= hi)
            (*over)++;
        else
            bins[tr_hist_bin(x, lo, hi)]++;
    }
}

void tr_hist(unsigned dtype, const void *in, size_t n, int64_t lo, int64_t hi, uint64_t *counts)
{
    if (tally_hist_ranged(dtype))
        tr_hist_parts(dtype, in, n, lo, hi, counts, &counts[TALLY_HIST_BINS],
                      &counts[TALLY_HIST_BINS + 1]);
    else
        tr_hist_parts(dtype, in, n, lo, hi, counts, NULL, NULL);
}
