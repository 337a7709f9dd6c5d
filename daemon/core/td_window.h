/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_window.h — a stream's ring of recent intervals (PROTOCOL.md, "Windows").
 *
 * The ring covers `intervals` intervals; interval k is the window-clock milliseconds
 * [k * interval_ms, (k + 1) * interval_ms) and sits at ring position k mod intervals. Only the
 * intervals in which something was counted are kept (issue 26: an interval with no data costs
 * nothing): a slot per such interval, in an array sorted by interval, each holding its
 * underflow, overflow and total and its bins in the compact form of td_bins.h. A slot is freed
 * once the ring no longer reaches it (it is `intervals` or more intervals old: at the stream's
 * next hist, or when td_window_expire sweeps it), or when a hist lands on its ring position in
 * another interval (a clock that stepped back by a whole ring); so the array never holds more
 * than `intervals` slots, and a slot that has left the ring is never counted again, even if
 * the clock steps back. Nothing has to run when time passes: a reader sums only the intervals
 * it asks for.
 *
 * Memory: td_window_bytes, what the ring has allocated: this header, the slot array
 * (48 bytes per slot, the array doubling as it fills) and each slot's bins. A
 * stream that got one batch of bytes holds one slot (~300 bytes for 1 KiB of uniform u8).
 *
 * An add is planned first (td_window_plan: the bytes the ring will hold after it), so the stream
 * can check its memory budget before anything changes; td_window_prepare allocates, and
 * td_window_commit, which cannot fail, applies it (td_bins.h has the same three steps).
 *
 * The window clock (td_clock_ms) is the host's wall clock in milliseconds since the epoch, so
 * the intervals saved in the state file mean the same after a restart. Tests replace it with a
 * file they write (`--test-clock FILE`, read at every call), never with a hook in the core.
 *
 * Loop thread only, like the stream that owns the ring.
 */
#ifndef TD_WINDOW_H
#define TD_WINDOW_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tally_proto.h"
#include "td_bins.h"

/* A version-3 state file's slot, before its bins: interval, underflow, overflow, total (u64
 * each); its bins follow as channels x 256 u64. */
#define TD_WINDOW_SLOT_HEADER 32u

typedef struct td_window td_window_t;

/* What adding a batch to the ring needs (td_window_plan). */
typedef struct {
    uint64_t interval;   /* the batch's interval */
    long slot;           /* its slot's index, or -1: a new slot */
    unsigned cap;        /* the slot array's capacity after the add */
    bool grow;           /* the array must grow to cap */
    size_t bytes;        /* td_window_bytes after the add */
    void *array;         /* the grown slot array, once prepared (NULL: no growth) */
    td_bins_plan_t bins; /* the slot's bins */
} td_window_plan_t;

/* A ring of `intervals` (>= 1) intervals of interval_ms (>= 1) for channels (1, 3 or 4); NULL
 * when out of memory. No slot is allocated until a batch is added. */
td_window_t *td_window_new(unsigned intervals, uint32_t interval_ms, unsigned channels);
void td_window_destroy(td_window_t **self_p);

uint32_t td_window_interval_ms(const td_window_t *self);
/* Slots held (intervals with data, not yet freed). */
unsigned td_window_slots(const td_window_t *self);
/* Bytes allocated for the ring: header, slot array and bins. */
size_t td_window_bytes(const td_window_t *self);

/* Plans adding a batch's histogram (bins: channels x 256) at now_ms; add_max: no bin counts more
 * (the batch's element count), or UINT64_MAX: not known (td_bins_plan). */
void td_window_plan(const td_window_t *self, uint64_t now_ms, const uint64_t *bins,
                    uint64_t add_max, td_window_plan_t *plan);
/* Allocates what the plan needs; false when out of memory (nothing to abort then). A prepared
 * plan is always committed: nothing after it can refuse the batch. */
bool td_window_prepare(td_window_plan_t *plan);
/* Adds the batch as planned and prepared (the same ring, now_ms and bins as td_window_plan):
 * bins, underflow, overflow and n elements to the slot of now_ms's interval. */
void td_window_commit(td_window_t *self, const uint64_t *bins, uint64_t underflow,
                      uint64_t overflow, uint64_t n, td_window_plan_t *plan);
/* Plan, prepare and commit in one step; false (nothing changed) when out of memory. */
bool td_window_add(td_window_t *self, uint64_t now_ms, const uint64_t *bins, uint64_t underflow,
                   uint64_t overflow, uint64_t n);

/* Frees the slots the ring no longer reaches at now_ms (and the slot array once empty). */
void td_window_expire(td_window_t *self, uint64_t now_ms);
/* Frees every slot (reset). */
void td_window_clear(td_window_t *self);
/* Sums the `k` (1..intervals) intervals ending with now_ms's: sets info's hist_underflow,
 * hist_overflow, hist_total and bins to the sums and returns the window's start (ms). */
uint64_t td_window_sum(const td_window_t *self, uint64_t now_ms, unsigned k,
                       tally_stream_info_t *info);

/* The state record's form (td_state_record.h): u32 M, then M slots, each u64 interval,
 * underflow, overflow and total and its bins (td_bins_encode), for the slots the ring still
 * reaches at now_ms that counted anything. Returns the size, writing to out when not NULL. */
size_t td_window_encode(const td_window_t *self, uint64_t now_ms, uint8_t *out);
/* The ring's stamp: the batches committed to it since it was made. Each slot keeps the stamp of
 * the last batch that changed it (a restored slot, 0), so td_window_encode_since(since) writes,
 * in the same form, only the slots a batch changed after the ring's stamp was `since`: what
 * direct mode's changelog sends (td_state_record.h, kind 3). */
uint64_t td_window_stamp(const td_window_t *self);
size_t td_window_encode_since(const td_window_t *self, uint64_t now_ms, uint64_t since,
                              uint8_t *out);
/* Moves to self, a ring holding a record's changed slots, every slot of `older` (the ring they
 * changed) that self has nothing on the ring position of and that the ring still reaches at
 * now_ms; what stays in older is freed with it. Rings of another shape: nothing moves. In two
 * steps, so that the caller can change other things between them: td_window_room_for_older
 * (false when out of memory; nothing changed), then td_window_keep_older (cannot fail), with
 * both rings as they were. */
bool td_window_room_for_older(td_window_t *self, const td_window_t *older, uint64_t now_ms);
void td_window_keep_older(td_window_t *self, td_window_t *older, uint64_t now_ms);
/* Adds the slots of that form (len bytes available; written by a ring of saved_interval_ms) to
 * an empty ring. Returns the bytes taken, or 0 when the form is not valid, a slot's total is
 * not its bins plus underflow plus overflow (in every channel), or an interval appears twice;
 * *dropped counts the slots not added: of another interval length, or older than the ring
 * reaches at now_ms. *nomem is set (0 returned) when out of memory. */
size_t td_window_decode(td_window_t *self, uint64_t now_ms, uint32_t saved_interval_ms,
                        const uint8_t *in, size_t len, unsigned *dropped, bool *nomem);
/* Version 3's form, for reading old state files: `slots` slots of TD_WINDOW_SLOT_HEADER + 2048 x
 * channels bytes. Returns the slots dropped (as td_window_decode), -1 when a slot is
 * inconsistent or an interval appears twice (nothing added), -2 when out of memory. */
long td_window_decode_v3(td_window_t *self, uint64_t now_ms, uint32_t saved_interval_ms,
                         const uint8_t *in, uint32_t slots);
/* Size of one version-3 slot of `channels`. */
size_t td_window_slot_size_v3(unsigned channels);

/* ---- the window clock ------------------------------------------------------------------ */

/* Milliseconds since the epoch: CLOCK_REALTIME, or the decimal number in the test clock file
 * when one is set (0 when it cannot be read). */
uint64_t td_clock_ms(void);
/* Test only (--test-clock): read the time from `path` from now on; NULL restores the real
 * clock. The path is copied. */
void td_clock_set_test_file(const char *path);

#endif
