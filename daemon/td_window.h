/*
 * td_window.h — a stream's ring of recent intervals (PROTOCOL.md, "Windows").
 *
 * The ring holds `intervals` slots; the slot of interval k (the window-clock milliseconds
 * [k * interval_ms, (k + 1) * interval_ms)) is k mod intervals, tagged with k, so a slot whose
 * tag is not the interval being asked about is stale and counts as empty: nothing has to run
 * when time passes, and a ring restored after a long stop is simply empty. A slot is the
 * histogram of the hist batches applied in its interval: underflow, overflow, total and
 * channels x 256 bins, all u64.
 *
 * Memory: intervals x (TD_WINDOW_SLOT_HEADER + 2048 x channels) bytes, allocated once when the
 * stream's first hist is applied (td_window_new), never on the query path.
 *
 * The window clock (td_clock_ms) is the host's wall clock in milliseconds since the epoch, so
 * the intervals saved in the state file mean the same after a restart. Tests replace it with a
 * file they write (`--test-clock FILE`, read at every call), never with a hook in the core.
 *
 * Loop thread only, like the stream that owns the ring.
 */
#ifndef TD_WINDOW_H
#define TD_WINDOW_H

#include <stddef.h>
#include <stdint.h>

#include "tally_proto.h"

/* Per slot, before the bins: interval tag, underflow, overflow, total (u64 each). */
#define TD_WINDOW_SLOT_HEADER 32u

typedef struct td_window td_window_t;

/* Bytes of a ring of `intervals` slots for `channels` channels (what a stream pays). */
size_t td_window_bytes(unsigned intervals, unsigned channels);

/* A ring of `intervals` (>= 1) slots of interval_ms (>= 1) for channels (1, 3 or 4); NULL when
 * out of memory. */
td_window_t *td_window_new(unsigned intervals, uint32_t interval_ms, unsigned channels);
void td_window_destroy(td_window_t **self_p);

unsigned td_window_intervals(const td_window_t *self);
uint32_t td_window_interval_ms(const td_window_t *self);

/* Adds a batch's histogram (bins: channels x 256, underflow, overflow) of n elements to the
 * slot of now_ms's interval. */
void td_window_add(td_window_t *self, uint64_t now_ms, const uint64_t *bins, uint64_t underflow,
                   uint64_t overflow, uint64_t n);
/* Empties every slot (reset). */
void td_window_clear(td_window_t *self);
/* Sums the `k` (1..intervals) intervals ending with now_ms's: sets info's hist_underflow,
 * hist_overflow, hist_total and bins to the sums and returns the window's start (ms). */
uint64_t td_window_sum(const td_window_t *self, uint64_t now_ms, unsigned k,
                       tally_stream_info_t *info);

/* The state file's form (td_state.h): the non-empty slots that are still inside the ring at
 * now_ms, each its interval, underflow, overflow, total and bins as u64 LE. Returns the bytes
 * td_window_encode writes, which it writes to out when out is not NULL; *slots the slot count. */
size_t td_window_encode(const td_window_t *self, uint64_t now_ms, uint8_t *out, uint32_t *slots);
/* Size of one encoded slot of `channels`. */
size_t td_window_slot_size(unsigned channels);
/* Adds `slots` encoded slots (written by a ring of saved_interval_ms) to the ring. Slots of
 * another interval length, or that are older than the ring reaches at now_ms, are dropped and
 * counted in the return value. Returns -1 (nothing added) when a slot's total is not its bins
 * plus underflow plus overflow, or two slots name the same interval. */
long td_window_decode(td_window_t *self, uint64_t now_ms, uint32_t saved_interval_ms,
                      const uint8_t *in, uint32_t slots);

/* ---- the window clock ------------------------------------------------------------------ */

/* Milliseconds since the epoch: CLOCK_REALTIME, or the decimal number in the test clock file
 * when one is set (0 when it cannot be read). */
uint64_t td_clock_ms(void);
/* Test only (--test-clock): read the time from `path` from now on; NULL restores the real
 * clock. The path is copied. */
void td_clock_set_test_file(const char *path);

#endif
