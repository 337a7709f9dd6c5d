/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_state.h — persistent stream state: every stream's counters, histogram, window ring and
 * last applied seq, in the state directory, written so that the bytes of a snapshot follow what
 * changed, not how many streams there are (issue 26).
 *
 * Two files, both format version 4 (integers little-endian), each a 40-byte header and then
 * records (td_state_record.h: one stream's state, or one stream's removal, each with its own
 * size and CRC-32):
 *
 *   streams.state  the base: every stream, as of its writing
 *     0    8 bytes  magic "TLYDSTAT"
 *     8    u32      format version (TD_STATE_VERSION = 4)
 *     12   u32      number of records (stream records only)
 *     16   u64      generation: which log continues this base
 *     24   u64      time written (seconds since the epoch; informational)
 *     32   u32      reserved, zero
 *     36   u32      CRC-32 (zlib's crc32) of header bytes 0..35
 *   streams.log    the changes since the base: stream records and removals, appended
 *     0    8 bytes  magic "TLYDSLOG"
 *     8    u32      format version (4)
 *     12   u32      reserved, zero
 *     16   u64      generation of the base it continues
 *     24   u64      time created; 32 u32 reserved, zero; 36 u32 CRC-32 of bytes 0..35
 *
 * Every format version keeps the magic and version at bytes 0..11, so a tallyd tells a file
 * from a newer release (a higher version, of either file) and refuses to start with a message
 * saying so, leaving the file as it is: it is never misread, nor set aside as damaged.
 *
 * Snapshots (td_state_store_*): a snapshot appends to the log one record per stream changed
 * since the last snapshot (created, applied to, reset, cleared) and one removal per stream
 * deleted, then fsyncs the log: the bytes written follow the activity. A compaction writes a
 * whole new base instead, of the next generation, and an empty log for it: when the log has
 * grown past the base (at least TD_STATE_LOG_MIN bytes), at the first snapshot after a start
 * that did not find a usable base and log of version 4, and after any failed write (whose
 * records may be lost) or a damaged log. Compaction order, each step durable before the next:
 *   1. streams.state.tmp written and fsync'ed, renamed over streams.state, directory fsync'ed;
 *   2. streams.log.tmp (the new generation's header) written and fsync'ed, renamed over
 *      streams.log, directory fsync'ed.
 * A crash before 1's rename leaves the old base and log (the .tmp is ignored and overwritten);
 * between 1 and 2, a new base whose log is the old generation's: that log is ignored (its
 * changes are in the new base); after 2, the new pair. Each state is whole.
 *
 * Restoring: the base, record by record (a record is restored only when its checksum matches
 * and its state is consistent, td_state_record.h; any other is skipped with a warning naming
 * its stream when its name is readable, and the reader finds the next record by its magic and
 * checksum, so one damaged record costs one stream), then the log's records in order: a stream
 * record sets the stream's state (a later one wins), a removal removes it. A log record that is
 * damaged is skipped the same way, and the stream it named keeps the state of the base or of
 * an earlier record: what a kill -9 a snapshot earlier would have left. A last record cut off
 * (a write the crash interrupted) is ignored and cut from the log before the next append.
 * Window slots counted in another interval length than the daemon's, or older than its ring
 * reaches, are dropped (logged); with windows off no ring is restored.
 *
 * Evidence is kept: a base or log with damaged or missing records (or more streams than
 * max_streams or max_state_bytes allow) is copied aside, and one whose header is unusable (not
 * a state file, a format version that no release wrote, header checksum) is renamed aside;
 * tallyd then starts with what it could read. Set-aside files are named
 * streams.state.corrupt-<UTC time>-<pid>-<n> (streams.log.corrupt-... for the log) and never
 * replace an existing file. A path that cannot hold the state (streams.state, streams.log or
 * their .tmp present but not a regular file, or unreadable) fails the start instead: every
 * snapshot would fail.
 *
 * Earlier formats, still read (a base only; the first snapshot compacts them into version 4):
 *   version 3: the same header with u32 0 at 16 and reserved 20..23 and 32..35; records "TLYR",
 *     u32 CRC-32 of bytes 8..size-1, u32 size, u32 name length, the name padded to 64 bytes,
 *     u32 info length L (2176, 6272, 8320), u32 window slots M, u32 their interval (ms), u32 0,
 *     the `query` record (L bytes), M slots of 32 + 2048 x channels bytes (interval, underflow,
 *     overflow, total, bins as u64);
 *   version 2: the same header with 2 and the record size 2248 at byte 16; fixed records: u32
 *     CRC-32 of bytes 4..2247, u32 name length, the 64-byte name, the 2176-byte payload;
 *   version 1: a 32-byte header (magic, u32 1, u32 count, u64 length of the records, u64 time),
 *     records (u8 name length, the name, the 2176-byte payload), an 8-byte FNV-1a 64 trailer.
 */
#ifndef TD_STATE_H
#define TD_STATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_err.h"
#include "td_state_record.h"
#include "td_stream.h"

#define TD_STATE_MAGIC "TLYDSTAT"
#define TD_STATE_LOG_MAGIC "TLYDSLOG"
#define TD_STATE_VERSION 4u
#define TD_STATE_HEADER_SIZE 40u
#define TD_STATE_HEADER_CRC_OFF 36u
/* The log is compacted into a new base once it is larger than the base and than this. */
#define TD_STATE_LOG_MIN (1u << 20)
/* Version 3's records, for reading old files. */
#define TD_STATE_V3_RECORD_MAGIC "TLYR"
#define TD_STATE_V3_RECORD_NAME_OFF 16u
#define TD_STATE_V3_RECORD_INFO_LEN_OFF 80u
#define TD_STATE_V3_RECORD_SLOTS_OFF 84u
#define TD_STATE_V3_RECORD_INTERVAL_OFF 88u
#define TD_STATE_V3_RECORD_INFO_OFF 96u
/* Version 2's fixed records. */
#define TD_STATE_V2_RECORD_NAME_OFF 8u
#define TD_STATE_V2_RECORD_INFO_OFF 72u
#define TD_STATE_V2_RECORD_SIZE (TD_STATE_V2_RECORD_INFO_OFF + TALLY_QUERY_PAYLOAD_SIZE)
/* Version 1's layout. */
#define TD_STATE_V1_HEADER_SIZE 32u
#define TD_STATE_V1_TRAILER_SIZE 8u

/* What a restore found, record by record. */
typedef struct {
    unsigned version;    /* the base's format version */
    uint64_t generation; /* the base's generation (version 4; 0 before) */
    unsigned records;    /* records the base announces */
    unsigned restored;   /* streams added to the table from the base */
    unsigned damaged;    /* base records skipped: checksum, name, invariants, duplicate (logged) */
    unsigned missing;    /* records announced but cut off by a truncated base */
    unsigned over_limit; /* good records not added: max_streams or max_state_bytes (both files) */
    unsigned nomem;      /* good records not added for want of memory (both files): the restore
                          * fails, tallyd does not start (alloc sweep, issue 25) */
    unsigned window_slots_dropped; /* window slots of another interval or too old (logged) */
    size_t extra_bytes;            /* bytes after the base's last announced record */
    size_t base_bytes;             /* the base's size, when it was decoded */
    /* The log. */
    bool log_used;        /* a log of the base's generation was read */
    bool log_stale;       /* a log of another generation: ignored (its changes are in the base) */
    bool log_unusable;    /* a log whose header is unusable: set aside */
    unsigned log_records; /* records read from the log, whole and checked */
    unsigned log_damaged; /* log records skipped (logged) */
    size_t log_good;      /* bytes of the log up to the end of its last whole record */
    size_t log_torn;      /* bytes of a last record cut off, ignored */
} td_state_report_t;

/* Records that were on disk and are not in the table now (beyond a torn last append, which a
 * crash leaves and which was never acknowledged as written). */
static inline bool td_state_report_lossy(const td_state_report_t *r)
{
    return r->damaged || r->missing || r->over_limit || r->extra_bytes || r->log_damaged ||
           r->log_unusable;
}

/* Loop thread: every stream's record in a malloc'ed base image of `generation` (*buf, *len),
 * with the window slots still inside the ring at now_ms. TD_ERR_NOMEM when out of memory. */
td_err_t td_state_encode(td_streams_t *streams, uint64_t now_ms, uint64_t generation,
                         uint8_t **buf, size_t *len);
/* The same with only the streams keep(s, arg) says yes to (a fleet partition's checkpoint,
 * daemon/nats/); keep NULL: all of them. One record encoder (td_state_record_encode) for both. */
td_err_t td_state_encode_some(td_streams_t *streams, uint64_t now_ms, uint64_t generation,
                              bool (*keep)(const td_stream_t *s, void *arg), void *arg,
                              uint8_t **buf, size_t *len);
/* Adds the streams of a base image (version 1 to 4) to `streams`, record by record (see the top
 * of this file), window slots placed for the clock at now_ms. TD_ERR_CORRUPT with a reason in
 * msg, and nothing added, when the header is unusable; TD_ERR_VERSION when a newer tallyd wrote
 * it. */
td_err_t td_state_decode(const uint8_t *buf, size_t len, uint64_t now_ms, td_streams_t *streams,
                         td_state_report_t *report, char *msg, size_t msg_cap);
/* Applies a log image to streams already holding its base (report->generation set by
 * td_state_decode). TD_ERR_CORRUPT (header unusable), TD_ERR_VERSION (newer): nothing applied.
 * A log of another generation is ignored (report->log_stale, TD_OK). */
td_err_t td_state_log_decode(const uint8_t *buf, size_t len, uint64_t now_ms,
                             td_streams_t *streams, td_state_report_t *report, char *msg,
                             size_t msg_cap);
/* A log image's header for generation (TD_STATE_HEADER_SIZE bytes at out). */
void td_state_log_header(uint64_t generation, uint8_t *out);
/* Version 1's whole-file checksum (FNV-1a 64). */
uint64_t td_state_checksum(const uint8_t *buf, size_t len);

/* Loop thread, at start: restores DIR's base and log into `streams` and fills *report. Missing
 * files restore nothing; damaged ones are handled as described at the top of this file.
 * TD_ERR_IO (TD_ERR_NOMEM when a file does not fit in memory) with msg when the state path is
 * unusable, TD_ERR_VERSION when a newer tallyd wrote a file: nothing restored, and tallyd must
 * not start. */
td_err_t td_state_restore(const char *dir, td_streams_t *streams, td_state_report_t *report,
                          char *msg, size_t msg_cap);
/* Any thread: writes buf to DIR/name atomically (name.tmp, fsync, rename, fsync of DIR).
 * TD_ERR_IO with msg on error. */
td_err_t td_state_write_file(const char *dir, const char *name, const uint8_t *buf, size_t len,
                             char *msg, size_t msg_cap);

/* Any thread: appends buf to DIR/streams.log at offset `at` (what was after it, a torn append,
 * is cut) and fsyncs it. TD_ERR_IO with msg on error. */
td_err_t td_state_append(const char *dir, size_t at, const uint8_t *buf, size_t len, char *msg,
                         size_t msg_cap);

/* ---- Snapshots (td_state_log.c) ---------------------------------------------------------- */

typedef struct td_state_store td_state_store_t;
typedef struct td_state_job td_state_job_t;

/* Loop thread, at start: restores DIR (td_state_restore) and makes the store that writes its
 * snapshots; from here on the table remembers removed streams for it. Errors as
 * td_state_restore. */
td_err_t td_state_store_open(const char *dir, td_streams_t *streams, td_state_store_t **out,
                             char *msg, size_t msg_cap);
void td_state_store_close(td_state_store_t **self_p);
/* Loop thread: the next snapshot: the records of what changed since the last one, or a whole
 * base (a compaction); *job NULL when nothing changed. The streams it holds are no longer
 * marked changed. TD_ERR_NOMEM when out of memory (the next snapshot is then a whole one). */
td_err_t td_state_store_begin(td_state_store_t *self, td_streams_t *streams, uint64_t now_ms,
                              td_state_job_t **job);
/* Any thread (a libuv worker): writes the job to disk. */
void td_state_job_write(td_state_job_t *job);
/* Loop thread, after td_state_job_write (or instead of it, when it could not be queued: the job
 * then fails): takes the outcome, frees the job and sets *job_p NULL. TD_ERR_IO with msg when
 * the write failed; the next snapshot is then a whole one. *written the bytes written; *streams
 * the stream records written; *full whether it was a compaction. */
td_err_t td_state_store_end(td_state_store_t *self, td_state_job_t **job_p, char *msg,
                            size_t msg_cap, size_t *written, unsigned *streams, bool *full);

#endif
