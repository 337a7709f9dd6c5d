/* SPDX-License-Identifier: Apache-2.0 */
/*
 * reference.c — the operations in plain C, one element at a time (reference.h says why).
 */
#include "reference.h"

#include <stdlib.h>
#include <string.h>

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

void tr_minmax(unsigned dtype, const void *in, size_t n, int64_t *min, int64_t *max)
{
    *min = INT64_MAX;
    *max = INT64_MIN;
    for (size_t i = 0; i < n; i++) {
        int64_t x = tr_elem(dtype, in, i);
        *min = x < *min ? x : *min;
        *max = x > *max ? x : *max;
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

void tr_window_init(tr_window_t *w, unsigned intervals, uint64_t interval_ms)
{
    if (intervals == 0 || intervals > TR_WINDOW_INTERVALS_MAX || interval_ms == 0)
        abort();
    w->intervals = intervals;
    w->interval_ms = interval_ms;
    tr_window_clear(w);
}

void tr_window_clear(tr_window_t *w)
{
    memset(w->tag, 0, sizeof w->tag);
}

void tr_window_expire(tr_window_t *w, uint64_t now_ms)
{
    uint64_t now = now_ms / w->interval_ms;
    for (unsigned p = 0; p < w->intervals; p++)
        if (w->tag[p] && w->tag[p] - 1 <= now && now - (w->tag[p] - 1) >= w->intervals)
            w->tag[p] = 0;
}

void tr_window_add(tr_window_t *w, uint64_t now_ms, const uint64_t *bins, size_t values,
                   uint64_t under, uint64_t over, uint64_t n)
{
    uint64_t interval = now_ms / w->interval_ms;
    unsigned p = (unsigned)(interval % w->intervals);
    tr_window_expire(w, now_ms);
    if (w->tag[p] != interval + 1) {
        w->tag[p] = interval + 1;
        w->under[p] = w->over[p] = w->total[p] = 0;
        memset(w->bins[p], 0, sizeof w->bins[p]);
    }
    w->under[p] += under;
    w->over[p] += over;
    w->total[p] += n;
    for (size_t b = 0; b < values; b++)
        w->bins[p][b] += bins[b];
}

uint64_t tr_window_sum(const tr_window_t *w, uint64_t now_ms, unsigned k, tally_stream_info_t *info)
{
    /* The window is the intervals first .. now: k of them, as many as the ring keeps at most,
     * none before the epoch. */
    uint64_t now = now_ms / w->interval_ms;
    uint64_t span = k < w->intervals ? k : w->intervals;
    uint64_t first = span > now ? 0 : now + 1 - span;
    memset(info->bins, 0, sizeof info->bins);
    info->hist_underflow = info->hist_overflow = info->hist_total = 0;
    for (uint64_t t = first; t <= now; t++) {
        unsigned p = (unsigned)(t % w->intervals);
        if (w->tag[p] != t + 1)
            continue; /* that interval counted nothing, or its slot holds another since */
        info->hist_underflow += w->under[p];
        info->hist_overflow += w->over[p];
        info->hist_total += w->total[p];
        for (size_t b = 0; b < TALLY_HIST_VALUES_MAX; b++)
            info->bins[b] += w->bins[p][b];
    }
    return first * w->interval_ms;
}
