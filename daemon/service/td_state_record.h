/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_state_record.h — one stream's state as a self-checking record of bytes: what the state
 * file and its log hold (td_state.h), and what a fleet's checkpoints can hold (issue 22), with
 * no file in sight: td_state_record_encode writes a stream to a buffer, td_state_record_check
 * and td_state_record_parse read one back, td_state_record_apply puts it into a stream table.
 *
 * Layout (format version 4; integers little-endian):
 *   0    4 bytes  magic "TLYS"
 *   4    u32      CRC-32 (zlib's crc32) of bytes 8..size-1
 *   8    u32      size of the whole record in bytes
 *   12   u8       kind: 1 a stream's state, 2 a stream removed (`delete`; the name only), 3 a
 *                 stream's state with its ring's changes only (direct mode's changelog: below)
 *   13   u8       name length N (1..64)
 *   14   u16      reserved, zero
 *   16   N bytes  the name (printable ASCII, tally_stream_name_valid)
 * kinds 1 and 3 continue at 16+N:
 *   +0   128      the first 128 bytes of the stream's `query` record (PROTOCOL.md: counters,
 *                 scan carry, hist_dtype, range, underflow, overflow, total, last_seq)
 *   +128 u32      the window interval (ms) the ring was counted in; 0: no ring follows
 *   +132 u32      reserved, zero
 *   +136          the all-time bins (td_bins_encode; 256 x the dtype's channels counts)
 *   then          when the interval is not 0: the ring (td_window_encode: u32 M, M slots)
 * and a record is exactly as long as its parts. A stream record is restored only when its
 * state holds every invariant tallyd maintains (td_state_check_info) and its ring is consistent.
 *
 * Records hold the ring's slots that are still inside it when encoded; slots of another interval
 * length than the reader's, or older than its ring reaches, are dropped when applied.
 *
 * Kind 3 (issue 33) is kind 1 whose ring holds only the slots that batches changed since the
 * stream's mark (td_ring_mark_t: an earlier record of the same ring), each slot whole; its
 * interval is never 0. Applied to a stream that has a ring, its slots replace those of their
 * intervals (and any slot on their ring positions), and the ring keeps its other slots; to a
 * stream without one, it is applied as kind 1. So a changelog applied in order, on top of a
 * state at least as new as the one its first record's mark names, ends with the writer's ring:
 * a slot not in a record is one no batch changed since the record before. The state file and
 * checkpoints hold kinds 1 and 2 only; a tallyd before kind 3 refuses such a record.
 * The encoder runs on any thread (the shards' in direct mode's changelog, td_fleet_changelog.c)
 * for a stream that thread owns; the parser on the loop thread only (static buffers).
 */
#ifndef TD_STATE_RECORD_H
#define TD_STATE_RECORD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_stream.h"

#define TD_STATE_RECORD_MAGIC "TLYS"
#define TD_STATE_RECORD_NAME_OFF 16u
#define TD_STATE_RECORD_MIN 17u /* a removal with a one-byte name */
#define TD_STATE_RECORD_STREAM 1u
#define TD_STATE_RECORD_REMOVED 2u
#define TD_STATE_RECORD_CHANGED 3u

/* A record's content, once checked. */
typedef struct {
    uint8_t kind; /* TD_STATE_RECORD_STREAM, _REMOVED or _CHANGED */
    const char *name; /* in the record's bytes */
    size_t name_len;
    tally_stream_info_t info; /* kinds 1 and 3 */
    uint32_t interval_ms;     /* kinds 1 and 3: the ring's interval; 0 = none (kind 1 only) */
    const uint8_t *ring;      /* kinds 1 and 3: the ring's form (td_window_encode), ring_len */
    size_t ring_len;
} td_state_record_t;

/* Writes the stream's record (its ring's slots still inside the ring at now_ms) to out, or only
 * sizes it when out is NULL; returns its size. */
size_t td_state_record_encode(const td_stream_t *stream, uint64_t now_ms, uint8_t *out);
/* Direct mode's changelog (td_fleet_changelog.c): the stream's next record after a write, its
 * ring's changes since its last record (replaces false), or, when this one replaces that
 * record before it was sent, since the one before it (replaces true): kind 3, or kind 1 after
 * the ring was emptied or replaced. td_state_record_written then moves the stream's marks
 * (the same `replaces`), once the record is written. */
size_t td_state_record_encode_next(const td_stream_t *stream, uint64_t now_ms, bool replaces,
                                   uint8_t *out);
void td_state_record_written(td_stream_t *stream, bool replaces);
/* The record that says the stream `name` was removed. */
size_t td_state_record_encode_removed(const char *name, size_t len, uint8_t *out);
/* The size of the well-formed record at p (room bytes available): its magic, a size that fits,
 * and its checksum; 0 when there is none. */
size_t td_state_record_check(const uint8_t *p, size_t room);
/* Reads a well-formed record (td_state_record_check's size) into rec; false with the first
 * problem in why: a name, kind, field or length that is not valid, or a state that breaks an
 * invariant. The stream's name is readable in rec->name whenever rec->name_len is not 0. */
bool td_state_record_parse(const uint8_t *p, size_t size, td_state_record_t *rec, char *why,
                           size_t why_cap);

typedef enum {
    TD_STATE_APPLIED,   /* the stream was set (created or replaced) or removed */
    TD_STATE_REFUSED,   /* its ring is not consistent (why) */
    TD_STATE_NO_ROOM,   /* max_streams or max_state_bytes: not added */
    TD_STATE_NO_MEMORY, /* out of memory (why) */
} td_state_apply_t;

/* Puts a parsed record into streams: a stream record creates the stream (belonging to no
 * client) or replaces the state of the one of that name, its ring rebuilt for the table's
 * windows at now_ms (*dropped counts the slots left out; kind 3 over the ring it has); a
 * removal removes it (nothing when it is not there). A refused record changes nothing. The
 * stream's changelog marks are set to its ring as applied. */
td_state_apply_t td_state_record_apply(td_streams_t *streams, const td_state_record_t *rec,
                                       uint64_t now_ms, unsigned *dropped, char *why,
                                       size_t why_cap);

/* The invariants a restored stream must hold; false with the first violation in msg. */
bool td_state_check_info(const tally_stream_info_t *info, char *msg, size_t msg_cap);
/* The header and record checksum (CRC-32, zlib's crc32). */
uint32_t td_state_crc(const uint8_t *buf, size_t len);

#endif
