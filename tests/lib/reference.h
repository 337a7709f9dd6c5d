/* SPDX-License-Identifier: Apache-2.0 */
/*
 * reference.h — the operations as PROTOCOL.md defines them, in plain C: the one reference every
 * test that checks an answer compares with (the CPU and CUDA backends, libtally against its fake
 * daemon, tallyd end to end, the CLI). Deliberately naive: one element at a time, the defining
 * formulas (a bin is computed by the exact division in 128 bits, not by the product's
 * reciprocals or tally_hist_bin_i32), nothing shared with kernels/ or daemon/, so that a bug
 * there cannot hide in the reference too.
 *
 * Batches are element arrays as on the wire, which on the little-endian hosts tallyd runs on
 * are plain C arrays: int32_t for i32, uint8_t for u8, uint16_t for u16, bytes for rgb8/rgba8.
 * A new operation adds its reference here, one function beside those of its neighbours.
 */
#ifndef TALLY_TEST_REFERENCE_H
#define TALLY_TEST_REFERENCE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tally_proto.h"

/* Element i of a batch of `dtype` (i32, u8 or u16) as an int64_t. */
int64_t tr_elem(unsigned dtype, const void *in, size_t i);

/* ---- minmax (PROTOCOL.md §5 minmax) ---- */

/* The smallest and largest of in[0..n) (i32, u8 or u16); INT64_MAX and INT64_MIN for n = 0. */
void tr_minmax(unsigned dtype, const void *in, size_t n, int64_t *min, int64_t *max);

/* ---- filter (PROTOCOL.md §5 filter) ---- */

/* True when x passes predicate pred (TALLY_PRED_GT .. TALLY_PRED_BETWEEN) with lo and hi. */
bool tr_keep(unsigned pred, int64_t lo, int64_t hi, int64_t x);
/* The elements of in[0..n) (i32 or u8) that pass, in input order (the stable mode's answer;
 * the unordered mode's multiset), written to out (room for n elements; NULL: only counted).
 * Returns how many passed. */
size_t tr_filter(unsigned dtype, const void *in, size_t n, unsigned pred, int64_t lo, int64_t hi,
                 void *out);

/* ---- scan (PROTOCOL.md §5 scan) ---- */

/* Prefix sums of in[0..n) (i32) from carry-in `carry`, inclusive or exclusive, modulo 2^64, into
 * out as int64_t, or as int32_t (the low 32 bits) with out_i32; out may be NULL. Returns the
 * carry-out, carry + x[0] + ... + x[n-1] (mod 2^64). */
uint64_t tr_scan(const void *in, size_t n, bool exclusive, bool out_i32, uint64_t carry, void *out);
/* The same carry-out alone. */
uint64_t tr_sum(const void *in, size_t n, uint64_t carry);

/* ---- hist (PROTOCOL.md §5 hist) ---- */

/* The bin of x in 256 even bins over [lo, hi), lo <= x < hi: floor((x - lo) * 256 / (hi - lo)),
 * exactly, for any int64 lo < hi. */
unsigned tr_hist_bin(int64_t x, int64_t lo, int64_t hi);
/* Adds the histogram of in[0..n) (n elements of dtype: u8, i32, u16, rgb8, rgba8) into bins
 * (channel c's bin b at c * 256 + b), and for the ranged types (i32, u16) its values below lo
 * into *under and from hi on into *over (under and over are not used for the others and may
 * then be NULL). */
void tr_hist_parts(unsigned dtype, const void *in, size_t n, int64_t lo, int64_t hi, uint64_t *bins,
                   uint64_t *under, uint64_t *over);
/* The same added into counts laid out as a reply carries them (tally_hist_values(dtype)
 * values: the bins, then for i32 and u16 underflow and overflow). */
void tr_hist(unsigned dtype, const void *in, size_t n, int64_t lo, int64_t hi, uint64_t *counts);

/* ---- windows (PROTOCOL.md §5 "Windows") ---- */

#define TR_WINDOW_INTERVALS_MAX 8

/* A stream's window ring as the protocol defines it: `intervals` slots of interval_ms, slot
 * interval % intervals holding that interval's counts while the ring still reaches it. */
typedef struct {
    unsigned intervals; /* 1 .. TR_WINDOW_INTERVALS_MAX */
    uint64_t interval_ms;
    uint64_t tag[TR_WINDOW_INTERVALS_MAX]; /* the slot's interval + 1; 0: empty */
    uint64_t under[TR_WINDOW_INTERVALS_MAX], over[TR_WINDOW_INTERVALS_MAX],
        total[TR_WINDOW_INTERVALS_MAX];
    uint64_t bins[TR_WINDOW_INTERVALS_MAX][TALLY_HIST_VALUES_MAX];
} tr_window_t;

/* An empty ring (aborts when intervals is out of range). */
void tr_window_init(tr_window_t *w, unsigned intervals, uint64_t interval_ms);
/* Empties every slot (a stream's reset or delete). */
void tr_window_clear(tr_window_t *w);
/* Drops the slots the ring no longer reaches at now_ms: intervals at least `intervals` before
 * it. */
void tr_window_expire(tr_window_t *w, uint64_t now_ms);
/* Adds one batch's counts (`values` bins: channels x 256, channel c's bin b at c * 256 + b; n
 * elements) to the interval of now_ms. */
void tr_window_add(tr_window_t *w, uint64_t now_ms, const uint64_t *bins, size_t values,
                   uint64_t under, uint64_t over, uint64_t n);
/* The histogram of the last k intervals up to now_ms's (k capped at the ring and at the
 * intervals since the epoch) into info's bins, hist_underflow, hist_overflow and hist_total
 * (its other fields untouched); returns the window's start in ms. */
uint64_t tr_window_sum(const tr_window_t *w, uint64_t now_ms, unsigned k,
                       tally_stream_info_t *info);

#endif
