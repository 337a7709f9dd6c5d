/*
 * td_state.h — persistent stream state: every stream's name, tally_stream_info_t (counters,
 * scan carry, running histogram, last applied seq) and window ring in one file, streams.state,
 * in the state directory.
 *
 * File format, version 3 (all integers little-endian). A header, then one record per stream,
 * each with its own checksum and a magic that a reader can find again after a damaged record,
 * so a damaged record costs only its own stream:
 *
 *   header (TD_STATE_HEADER_SIZE = 40 bytes)
 *     0    8 bytes  magic "TLYDSTAT"
 *     8    u32      format version (TD_STATE_VERSION = 3)
 *     12   u32      number of records
 *     16   u32      0 (version 2: the fixed record size)
 *     20   u32      reserved, zero
 *     24   u64      time written (seconds since the epoch; informational)
 *     32   u32      reserved, zero
 *     36   u32      CRC-32 (zlib's crc32) of header bytes 0..35
 *   records, one after the other from byte 40, each
 *     0    4 bytes  magic "TLYR"
 *     4    u32      CRC-32 of record bytes 8..size-1
 *     8    u32      size of the whole record in bytes
 *     12   u32      name length (1..64)
 *     16   64 bytes the name (printable ASCII, tally_stream_name_valid), zero-padded
 *     80   u32      info length L: 2176, or 6272 (rgb8) / 8320 (rgba8)
 *     84   u32      window slots M
 *     88   u32      the window interval (ms) the slots were counted in; 0 when M = 0
 *     92   u32      reserved, zero
 *     96   L        the stream's state exactly as a plain `query` returns it
 *                   (tally_stream_info_encode, layout in PROTOCOL.md), carried as-is: only
 *                   tally_stream_info_decode and td_state_check_info judge its fields
 *     96+L M x S    the ring's non-empty slots still inside the ring (td_window_encode; S =
 *                   32 + 2048 x channels): interval number, underflow, overflow, total, bins
 *
 * Version 2 (still read, never written): the same header with version 2 and the record size
 * 2248 at byte 16, and fixed records: u32 CRC-32 of bytes 4..2247, u32 name length, the
 * 64-byte name, the 2176-byte payload; no window. Version 1 (still read): a 32-byte header
 * (magic, u32 version 1, u32 count, u64 length of the records, u64 time), variable records
 * (u8 name length, the name, the 2176-byte payload) and an 8-byte trailer, the FNV-1a 64 of
 * every byte before it.
 *
 * Writing is atomic: the bytes go to streams.state.tmp in the same directory, which is
 * fsync'ed, renamed over streams.state, and the directory fsync'ed; a crash at any point
 * leaves either the old file or the new one.
 *
 * Restoring, record by record. A record is restored only when its checksum matches and its
 * state is consistent (td_state_check_info: the invariants tallyd maintains; the window's
 * slots: each total is its bins plus under/overflow, no interval twice); any other is skipped
 * with a warning that names the stream when its name is readable, and the reader looks for the
 * next record (the next "TLYR" whose checksum matches), so the rest are restored. Window slots
 * counted in another interval length than the daemon's, or older than its ring reaches now,
 * are dropped (logged); with windows off the ring is not restored. A file with skipped or
 * missing records (or more streams than max_streams) is kept and a copy set aside, so nothing
 * is lost silently. A file whose header is unusable (not a state file, another version, header
 * checksum, a v1 file whose checksum fails) is renamed aside and tallyd starts with no streams.
 * Set-aside files are named streams.state.corrupt-<UTC time>-<pid>-<n> and never replace an
 * existing file. A path that cannot hold the state (streams.state or streams.state.tmp present
 * but not a regular file, or streams.state unreadable) fails the start instead: every snapshot
 * would fail.
 */
#ifndef TD_STATE_H
#define TD_STATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_err.h"
#include "td_stream.h"

#define TD_STATE_MAGIC "TLYDSTAT"
#define TD_STATE_VERSION 3u
#define TD_STATE_HEADER_SIZE 40u
#define TD_STATE_HEADER_CRC_OFF 36u
#define TD_STATE_RECORD_MAGIC "TLYR"
#define TD_STATE_RECORD_NAME_OFF 16u
#define TD_STATE_RECORD_INFO_LEN_OFF 80u
#define TD_STATE_RECORD_SLOTS_OFF 84u
#define TD_STATE_RECORD_INTERVAL_OFF 88u
#define TD_STATE_RECORD_INFO_OFF 96u
/* Version 2's fixed records, for reading old files. */
#define TD_STATE_V2_RECORD_NAME_OFF 8u
#define TD_STATE_V2_RECORD_INFO_OFF 72u
#define TD_STATE_V2_RECORD_SIZE (TD_STATE_V2_RECORD_INFO_OFF + TALLY_QUERY_PAYLOAD_SIZE)
/* Version 1's layout, for reading old files. */
#define TD_STATE_V1_HEADER_SIZE 32u
#define TD_STATE_V1_TRAILER_SIZE 8u

/* What a restore found, record by record. */
typedef struct {
    unsigned version;    /* the file's format version */
    unsigned records;    /* records the file announces */
    unsigned restored;   /* streams added to the table */
    unsigned damaged;    /* records skipped: checksum, name, invariants, duplicate (logged) */
    unsigned missing;    /* records announced but cut off by a truncated file */
    unsigned over_limit; /* good records not added because max_streams streams exist */
    unsigned window_slots_dropped; /* window slots of another interval or too old (logged) */
    size_t extra_bytes;            /* bytes after the last announced record */
} td_state_report_t;

/* Records that were in the file and are not in the table now. */
static inline bool td_state_report_lossy(const td_state_report_t *r)
{
    return r->damaged || r->missing || r->over_limit || r->extra_bytes;
}

/* Loop thread: serialises every stream into a malloc'ed version-3 file image (*buf, *len),
 * with the window slots still inside the ring at now_ms. TD_ERR_NOMEM when out of memory. */
td_err_t td_state_encode(td_streams_t *streams, uint64_t now_ms, uint8_t **buf, size_t *len);
/* The same with only the streams keep(s, arg) says yes to (a fleet partition's checkpoint,
 * daemon/nats/); keep NULL: all of them. */
td_err_t td_state_encode_some(td_streams_t *streams, uint64_t now_ms,
                              bool (*keep)(const td_stream_t *s, void *arg), void *arg,
                              uint8_t **buf, size_t *len);
/* Adds the streams of a file image (version 1, 2 or 3) to `streams`, record by record (see the
 * top of this file); each skipped record is logged at warning. Window slots are placed for the
 * window clock at now_ms. TD_ERR_CORRUPT with a reason in msg, and nothing added, when the
 * header is unusable. */
td_err_t td_state_decode(const uint8_t *buf, size_t len, uint64_t now_ms, td_streams_t *streams,
                         td_state_report_t *report, char *msg, size_t msg_cap);
/* The invariants a restored stream must hold; false with the first violation in msg. */
bool td_state_check_info(const tally_stream_info_t *info, char *msg, size_t msg_cap);
/* The header and record checksum (CRC-32, zlib's crc32). */
uint32_t td_state_crc(const uint8_t *buf, size_t len);
/* Version 1's whole-file checksum (FNV-1a 64). */
uint64_t td_state_checksum(const uint8_t *buf, size_t len);
/* A digest of an image's records (not its header, which holds the time written): equal
 * digests mean the same streams in the same state. */
uint64_t td_state_records_digest(const uint8_t *buf, size_t len);

/* Any thread: writes the image to DIR/streams.state atomically. TD_ERR_IO with msg on error. */
td_err_t td_state_write(const char *dir, const uint8_t *buf, size_t len, char *msg, size_t msg_cap);
/* Loop thread, at start: restores DIR/streams.state into `streams` and fills *report. A missing
 * file restores nothing; a damaged one is handled as described at the top of this file.
 * TD_ERR_IO (TD_ERR_NOMEM when the file does not fit in memory) with msg, and nothing
 * restored, when the state path is unusable: tallyd must not start then. */
td_err_t td_state_restore(const char *dir, td_streams_t *streams, td_state_report_t *report,
                          char *msg, size_t msg_cap);

#endif
