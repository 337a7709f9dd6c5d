/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_bins.h — a histogram's counts in the narrowest form that holds them (issue 26).
 *
 * A stream's all-time histogram and each interval of its window ring are `values` u64 counts
 * (256 per channel: 256, 768 or 1024; the owner knows how many, from the dtype). Most are
 * small and many are zero, so they are kept as one of:
 *   - empty:  every count is 0; nothing is allocated;
 *   - sparse: the non-zero counts as (bin, count) pairs sorted by bin, in an allocation of `cap`
 *             pairs: cap u16 bins, then cap counts of `width` bytes;
 *   - dense:  values counts of `width` bytes.
 * `width` (1, 2, 4 or 8 bytes) is the narrowest that holds the largest count stored so far; a
 * count that outgrows it widens every count (u8 -> u16 -> u32 -> u64). Sparse is kept while its
 * pairs take at most half the bytes dense would (256 u8 counts: up to 42 bins in use), and
 * becomes dense beyond that. Forms only grow (empty -> sparse -> dense, and wider), until
 * td_bins_clear, so a histogram that is busy now does not move between forms at every batch.
 * Counts wrap modulo 2^64, exactly like the u64 counters they stand for: every reader sees the
 * same numbers a dense u64 array would hold.
 *
 * An add is planned first (td_bins_plan: the form and bytes the sum needs), so the caller can
 * check a memory budget before anything changes; td_bins_prepare allocates what the plan
 * needs (the only step that can fail), td_bins_commit installs the sum and cannot fail, and
 * td_bins_abort drops a prepared plan instead.
 *
 * The encoded form (state records, td_state_record.h) is the in-memory form in little-endian:
 *   u8 width (0 = empty, nothing follows), u8 form (0 dense, 1 sparse), u16 pairs (sparse; 0
 *   for dense), then dense: values counts of width bytes; sparse: pairs u16 bins (strictly
 *   increasing, < values), then pairs counts of width bytes (none zero).
 * Not thread-safe: its owner's thread (the loop thread) only.
 */
#ifndef TD_BINS_H
#define TD_BINS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint8_t *data;  /* NULL when empty */
    uint16_t used;  /* sparse: pairs in use */
    uint16_t cap;   /* sparse: pairs allocated; dense: the number of counts */
    uint8_t width;   /* bytes per count: 0 (empty), 1, 2, 4 or 8 */
    bool sparse;
    uint8_t maxbits; /* bits of the largest count: a batch whose largest addend leaves room
                      * fits without reading the counts */
} td_bins_t; /* zeroed = empty */

/* What adding a batch to a histogram needs (td_bins_plan). */
typedef struct {
    uint8_t width;
    bool sparse;
    uint16_t used;
    uint16_t cap;
    bool fresh;     /* the sum needs a new allocation of `bytes` */
    size_t bytes;   /* the histogram's allocation after the add */
    uint8_t *data;  /* the new allocation, once prepared */
} td_bins_plan_t;

/* Bytes allocated for the counts (what td_bins_t's data points to). */
size_t td_bins_bytes(const td_bins_t *b);

/* Plans b += add (values counts). add_max: no addend is larger (a hist batch's element count:
 * the busy case, dense counts whose largest leaves room for it, is then decided without reading
 * the addends), or UINT64_MAX: not known, the addends are read. */
void td_bins_plan(const td_bins_t *b, size_t values, const uint64_t *add, uint64_t add_max,
                  td_bins_plan_t *plan);
/* Allocates what the plan needs; false when out of memory (nothing to abort then). */
bool td_bins_prepare(td_bins_plan_t *plan);
/* b += add, as planned and prepared (the same b, values and add as td_bins_plan). */
void td_bins_commit(td_bins_t *b, size_t values, const uint64_t *add, td_bins_plan_t *plan);
/* Frees a prepared plan that is not committed. */
void td_bins_abort(td_bins_plan_t *plan);

/* One step for callers without a budget: b += add; false (b unchanged) when out of memory. */
bool td_bins_add(td_bins_t *b, size_t values, const uint64_t *add);
/* b = v (values counts) in the narrowest form; false (b unchanged) when out of memory. */
bool td_bins_set(td_bins_t *b, size_t values, const uint64_t *v);
/* Frees the counts: b is empty again. */
void td_bins_clear(td_bins_t *b);

/* out[0..values) = the counts. */
void td_bins_get(const td_bins_t *b, size_t values, uint64_t *out);
/* acc[0..values) += the counts (wrapping). */
void td_bins_accumulate(const td_bins_t *b, size_t values, uint64_t *acc);

/* The encoded form: its size (td_bins_encode writes it to out when out is not NULL). */
size_t td_bins_encode(const td_bins_t *b, size_t values, uint8_t *out);
/* Decodes an encoded form from in (len bytes available) into out[0..values); the bytes it took,
 * or 0 when it is not a valid encoding for `values` counts. */
size_t td_bins_decode(const uint8_t *in, size_t len, size_t values, uint64_t *out);

#endif
