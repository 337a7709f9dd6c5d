/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_stream.h — named streams: the state tallyd keeps between requests.
 *
 * A stream holds its counters (td_stream_info_t: every field of the `query` record but the
 * bins), its all-time histogram in the compact form of td_bins.h, and its window ring
 * (td_window.h); td_stream_info rebuilds the record `query` puts on the wire. The requests
 * waiting or running on it are the scheduler's (td_sched.h). The table is owned by the loop
 * thread and is only ever touched there: workers compute into their request and the loop thread
 * applies the result, so reads (query, metrics, state snapshots) never race with updates.
 *
 * Memory (issue 26): every stream knows the bytes it has allocated (td_stream_bytes: the stream
 * itself with its name, its histogram's counts, its window ring), and the table keeps the sum
 * (plus its hash buckets) and each creating client's share. A memory budget bounds them:
 * max_state_bytes for the table, max_state_bytes_per_client for the streams one client created;
 * a stream is not created, and a hist that would grow one is not applied, past either. These
 * are the sizes tallyd asks malloc for; the allocator's own overhead (8 to 16 bytes per
 * allocation, a few per stream) is not in them.
 *
 * Parts (issue 31): tallyd's whole table is made of one part per shard (td_streams_new_parts);
 * a stream lives in the part td_stream_shard names (the published FNV-1a 64 of its name, so it
 * never moves while tallyd runs), and each part is touched only by its shard's thread. What the
 * parts share is the budget: the stream count (max_streams), the bytes (max_state_bytes), the
 * order of creation, kept in atomics and charged before anything grows (a check and its charge
 * are one step, so two shards never both take the last byte or the last stream: the limits stay
 * exact). A table made by td_streams_new is a whole of one part, which is itself. The whole's
 * operations by name (find, get, remove) go to the name's part; td_streams_first and
 * td_streams_next walk every part in creation order. A thread other than the shards' reads or
 * changes the whole only while td_streams_hold holds it (the shards stopped at a barrier,
 * td_path.c); the budget's counters may be read at any time.
 */
#ifndef TD_STREAM_H
#define TD_STREAM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tally_proto.h"
#include "td_bins.h"
#include "td_err.h"
#include "td_window.h"

struct td_sched_stream;
struct td_peer;
typedef struct td_streams td_streams_t;

/* A stream's counters: the fields of tally_stream_info_t but its bins, with the same names and
 * meanings (PROTOCOL.md, `query`). */
typedef struct {
    uint64_t batches;
    uint64_t elements;
    uint64_t bytes;
    uint64_t filter_seen;
    uint64_t filter_kept;
    int64_t scan_carry;
    uint64_t scan_elements;
    uint8_t hist_dtype;
    int64_t hist_lo;
    int64_t hist_hi;
    uint64_t hist_underflow;
    uint64_t hist_overflow;
    uint64_t hist_total;
    uint64_t last_seq;
} td_stream_info_t;

typedef enum {
    TD_STREAM_LIVE = 0, /* a stream restored from the state file is live */
    TD_STREAM_NEW,
    TD_STREAM_DELETED,
} td_stream_life_t;

/* The window ring as a changelog record saw it: its epoch (td_stream_t.ring_epoch) and its
 * stamp (td_window_stamp, 0 without a ring). */
typedef struct {
    uint64_t epoch;
    uint64_t stamp;
} td_ring_mark_t;

typedef struct td_stream {
    td_stream_info_t info;
    /* The all-time histogram: tally_hist_channels(info.hist_dtype) x 256 counts. */
    td_bins_t bins;
    /* The ring of recent intervals (td_window.h): NULL until the first hist is applied, or
     * when windows are off. */
    td_window_t *window;
    td_streams_t *table;
    /* Bytes allocated for the stream (td_stream_bytes), as last counted into the table. */
    size_t bytes;
    /* Changed since it was last published on the PUB socket (td_pub.h). */
    bool pub_dirty;
    /* Changed since a NATS fleet worker last published it (daemon/nats/td_fleet_watch.c). */
    bool fleet_dirty;
    /* Changed since the last state snapshot took it (td_state.h): its record is due. */
    bool state_dirty;
    /* Direct mode's changelog (td_state_record.h, kind 3): ring_epoch counts the times the
     * ring was emptied or replaced (1 when the stream is made), so that a record whose mark is
     * of an earlier epoch carries the whole ring; cl_mark is the ring as the stream's last
     * record saw it, cl_mark_before where that record's changes start. */
    uint64_t ring_epoch;
    td_ring_mark_t cl_mark, cl_mark_before;
    /* Whether clients can see it yet (PROTOCOL.md §5 "Streams": a failed request has no
     * effect, so it creates no stream). TD_STREAM_NEW: created by a filter, scan or hist that
     * is not applied yet; TD_STREAM_DELETED: deleted while requests queued behind the delete
     * still hold it. td_sched removes such a stream once nothing of it waits or runs, unless a
     * request was applied to it meanwhile (that makes it TD_STREAM_LIVE); a query, reset or
     * delete that reaches it meanwhile gets unknown_stream. */
    td_stream_life_t life;
    /* The low 32 bits of the changelog batch (its ticket) that took the stream's last record:
     * whether that record may still wait there, guessed before the changelog's lock
     * (td_changelog_hold; a wrong guess is found under it). In the hole after life, so that a
     * stream's bytes (max_state_bytes) stay as they were. */
    uint32_t cl_ticket;
    /* Requests that named the stream (for per-stream metrics). */
    uint64_t requests;
    /* Its place in the order of creation, across the parts (td_streams_next). */
    uint64_t created;
    /* When a request last changed it (applied, reset): the window clock (td_clock_ms); 0 when
     * nothing has since tallyd started. The web page's "last update". */
    uint64_t updated_ms;
    /* Sequence numbers (PROTOCOL.md, "Sequence numbers"): info.last_seq is the last one applied;
     * seq_admitted the last one started, which runs ahead of it while GPU-pipelined requests are
     * in flight (it equals info.last_seq whenever nothing is). */
    uint64_t seq_admitted;
    /* The client that created it (td_peers.h; a reference, counted in its `streams` and its
     * state bytes), NULL for a stream restored from the state file. */
    struct td_peer *owner;
    /* The scheduler's record of the stream (td_sched.c: its FIFO, requests in flight, GPU lane
     * and carry); NULL while nothing of the stream waits or runs. */
    struct td_sched_stream *sched;
    /* Table links: hash chain and the creation-ordered list used by `streams`. */
    struct td_stream *hash_next;
    struct td_stream *list_prev;
    struct td_stream *list_next;
    size_t name_len;
    char name[]; /* name_len bytes and a NUL, allocated with the stream */
} td_stream_t;

/* TD_ERR_NOMEM when out of memory. */
td_err_t td_streams_new(unsigned max_streams, td_streams_t **out);
/* The whole table of `parts` parts (one per shard, 1 to TD_SHARDS_LIMIT), sharing one budget;
 * with one part, the part itself. */
td_err_t td_streams_new_parts(unsigned parts, unsigned max_streams, td_streams_t **out);
/* Destroys a whole with its parts (not a part on its own). */
void td_streams_destroy(td_streams_t **self_p);
/* The parts of a whole (1 for a table of one part), and part i. */
unsigned td_streams_parts(const td_streams_t *self);
td_streams_t *td_streams_part(td_streams_t *self, unsigned i);
/* The whole is read (or changed) by a thread other than its parts' shards: between
 * td_streams_hold and td_streams_release the shards are stopped (nested holds count; a table
 * without a hook installed holds nothing: one part, on the caller's thread). */
void td_streams_hold(td_streams_t *self);
void td_streams_release(td_streams_t *self);
typedef void (*td_streams_hold_fn)(void *ctx, bool hold);
void td_streams_set_hold(td_streams_t *self, td_streams_hold_fn hold, void *ctx);

/* NULL when no stream of that name exists. */
td_stream_t *td_streams_find(td_streams_t *self, const char *name, size_t len);
/* Finds or creates a stream that belongs to no client (the state file's, tests');
 * TALLY_E_LIMIT when max_streams exist already or max_state_bytes is reached. */
tally_status_t td_streams_get(td_streams_t *self, const char *name, size_t len, td_stream_t **out);
/* Creates a stream for `owner` (a client entry, or NULL): TALLY_E_LIMIT past max_streams or
 * max_state_bytes, TALLY_E_CLIENT_STREAMS past the owner's max_state_bytes_per_client, each
 * with a message in msg; TALLY_E_INTERNAL when out of memory. The owner's bytes count the
 * stream from here on; the caller counts the stream in the owner's `streams` and holds the
 * reference stream->owner stands for. */
tally_status_t td_streams_create(td_streams_t *self, const char *name, size_t len,
                                 struct td_peer *owner, char *msg, size_t msg_cap,
                                 td_stream_t **out);
/* Removes and frees a stream that has no running or queued request (stream->sched NULL); its
 * bytes leave its owner's count (the caller then releases its reference to the owner). */
void td_streams_remove(td_streams_t *self, td_stream_t **stream_p);

/* The window ring every stream gets at its first hist: `intervals` (0 = windows off) of
 * interval_ms. Set at start, before streams exist. */
void td_streams_set_window(td_streams_t *self, unsigned intervals, uint32_t interval_ms);
unsigned td_streams_window_intervals(const td_streams_t *self);
uint32_t td_streams_window_interval_ms(const td_streams_t *self);

unsigned td_streams_count(const td_streams_t *self);
void td_streams_set_max(td_streams_t *self, unsigned max_streams);
/* The memory budget (0 = none): all streams, and the streams one client created. */
void td_streams_set_budget(td_streams_t *self, size_t max_bytes, size_t max_bytes_per_client);
/* Bytes allocated for stream state: every stream's td_stream_bytes plus the hash buckets. */
size_t td_streams_bytes(const td_streams_t *self);
/* Iteration in creation order, over every part: for (s = td_streams_first(t); s;
 * s = td_streams_next(t, s)); one walk of a whole at a time (it keeps a place in each part), and
 * the walk must not remove streams. */
td_stream_t *td_streams_first(td_streams_t *self);
td_stream_t *td_streams_next(td_streams_t *self, const td_stream_t *stream);
/* Streams and bytes of one part (a shard's, for its metrics). */
unsigned td_streams_part_count(const td_streams_t *part);
size_t td_streams_part_bytes(const td_streams_t *part);
/* Frees, in up to `max` streams of a part from where the last call stopped, the window slots that
 * have left the ring at now_ms, so a stream gone quiet gives its intervals back without a batch. */
void td_streams_sweep(td_streams_t *self, uint64_t now_ms, unsigned max);

/* Change tracking for incremental snapshots (td_state.h): on, every stream removed from now on
 * leaves its name in a list td_streams_take_removed hands over. */
void td_streams_track_removed(td_streams_t *self, bool on);
/* The names removed since the last call, as `count` entries of [u8 length][name] in *names
 * (malloc'ed, the caller frees; NULL when none); *lost when a name could not be kept (out of
 * memory): the list is incomplete. */
void td_streams_take_removed(td_streams_t *self, uint8_t **names, size_t *len, unsigned *count,
                             bool *lost);

/* ---- One stream ----------------------------------------------------------------------- */

/* The counts a histogram of hist_dtype keeps: 256 per channel (256 for a stream without one). */
size_t td_stream_values(uint8_t hist_dtype);
/* Bytes the stream has allocated: itself with its name, its histogram's counts, its ring. */
size_t td_stream_bytes(const td_stream_t *stream);
/* The stream's counters into out: every field of its record but the bins (left as they are). */
void td_stream_info_head(const td_stream_t *stream, tally_stream_info_t *out);
/* The stream's `query` record (all time). */
void td_stream_info(const td_stream_t *stream, tally_stream_info_t *out);
/* The record of a window query for the k intervals ending with now_ms's (interval_ms each):
 * counters as td_stream_info, the histogram fields over those intervals only (zero without a
 * ring yet). Returns the window's start, ms since the epoch. */
uint64_t td_stream_window_info(const td_stream_t *stream, uint64_t now_ms, unsigned k,
                               uint32_t interval_ms, tally_stream_info_t *out);
/* Sets the stream's whole state from a record (a restore): its counters and bins, its ring
 * emptied (a new ring epoch). False (the stream unchanged) when out of memory. No budget check. */
bool td_stream_set_info(td_stream_t *stream, const tally_stream_info_t *info);

/* A hist batch on the stream: its histogram (tally_hist_channels(dtype) x 256 bins, underflow,
 * overflow) of n elements, counted all-time and in the window ring at now_ms. The stream's first
 * hist fixes its dtype and range (dtype, lo, hi; the caller has checked that a later one
 * matches). TALLY_E_LIMIT or TALLY_E_CLIENT_STREAMS when the growth would pass the budget,
 * TALLY_E_INTERNAL when out of memory, each with msg; then nothing changed. */
tally_status_t td_stream_add_hist(td_stream_t *stream, uint8_t dtype, int64_t lo, int64_t hi,
                                  const uint64_t *bins, uint64_t underflow, uint64_t overflow,
                                  uint64_t n, uint64_t now_ms, char *msg, size_t msg_cap);
/* The ring as it is now (td_ring_mark_t). */
td_ring_mark_t td_stream_ring_mark(const td_stream_t *stream);
/* Counts the stream's bytes again, after its ring was set from outside (a restore). */
void td_stream_recount(td_stream_t *stream);
/* The stream changed: due for publication and for the next snapshot. */
void td_stream_changed(td_stream_t *stream);

/* `delete` (PROTOCOL.md): clears counters, carry, histogram, window and sequence numbers, as
 * for a new stream (the object stays while requests queued behind the delete hold it). */
void td_stream_clear(td_stream_t *stream);
/* `reset` (PROTOCOL.md): zeroes counters, carry and histogram; keeps the histogram's dtype and
 * range and last_seq. Runs on a drained stream only, so seq_admitted equals last_seq. */
void td_stream_zero(td_stream_t *stream);

#endif
