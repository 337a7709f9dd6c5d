/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_state.c — see td_state.h for the files and the guarantees: encoding a base, decoding a
 * base of any version and the log (the files themselves are td_state_file.c's, the snapshots'
 * store td_state_log.c's).
 *
 * Decoding checks the header first; only a usable header lets any record in. Then each record
 * stands alone: its checksum, its name and the invariants of its state are checked, and it is
 * either applied or skipped with a warning, so one damaged record costs one stream. Records of
 * versions 3 and 4 have a size of their own: after a record that does not check out (its size
 * field may be what was damaged), the reader looks for the next offset holding the record magic
 * and a record whose checksum matches over the size it claims (walk_records); CRC-32 makes a
 * false match there as unlikely as an undetected error. Version 1 files have one checksum over
 * the whole file: it must match before any record is read.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "td_config.h"
#include "td_hash.h"
#include "td_log.h"
#include "td_state.h"
#include "td_window.h"

uint64_t td_state_checksum(const uint8_t *buf, size_t len)
{
    return td_fnv1a64(buf, len);
}

/* ---- Encoding --------------------------------------------------------------------------- */

/* A version-4 header (base or log) with its checksum. */
static void put_header(uint8_t *out, const char *magic, uint32_t count, uint64_t generation)
{
    memset(out, 0, TD_STATE_HEADER_SIZE);
    memcpy(out, magic, 8);
    tally_put_u32(out + 8, TD_STATE_VERSION);
    tally_put_u32(out + 12, count);
    tally_put_u64(out + 16, generation);
    tally_put_u64(out + 24, (uint64_t)time(NULL));
    tally_put_u32(out + TD_STATE_HEADER_CRC_OFF, td_state_crc(out, TD_STATE_HEADER_CRC_OFF));
}

void td_state_log_header(uint64_t generation, uint8_t *out)
{
    put_header(out, TD_STATE_LOG_MAGIC, 0, generation);
}

td_err_t td_state_encode(td_streams_t *streams, uint64_t now_ms, uint64_t generation,
                         uint8_t **buf, size_t *len)
{
    return td_state_encode_some(streams, now_ms, generation, NULL, NULL, buf, len);
}

td_err_t td_state_encode_some(td_streams_t *streams, uint64_t now_ms, uint64_t generation,
                              bool (*keep)(const td_stream_t *s, void *arg), void *arg,
                              uint8_t **buf, size_t *len)
{
    uint32_t count = 0;
    size_t total = TD_STATE_HEADER_SIZE;
    for (td_stream_t *s = td_streams_first(streams); s; s = td_streams_next(streams, s))
        if (!keep || keep(s, arg)) {
            total += td_state_record_encode(s, now_ms, NULL);
            count++;
        }
    uint8_t *out = malloc(total);
    if (!out)
        return TD_ERR_NOMEM;
    put_header(out, TD_STATE_MAGIC, count, generation);
    uint8_t *rec = out + TD_STATE_HEADER_SIZE;
    for (td_stream_t *s = td_streams_first(streams); s; s = td_streams_next(streams, s))
        if (!keep || keep(s, arg))
            rec += td_state_record_encode(s, now_ms, rec);
    *buf = out;
    *len = total;
    return TD_OK;
}

/* ---- Decoding: what every version shares ------------------------------------------------ */

static bool all_zero(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i])
            return false;
    return true;
}

/* Logs a record that is not restored, naming its stream when the name reads as one; `what` is
 * "record" or "log record". */
static void warn_skipped(const char *what, unsigned i, unsigned of, const char *name,
                         size_t name_len, const char *why)
{
    char where[48];
    if (of)
        snprintf(where, sizeof where, "%s %u of %u", what, i + 1, of);
    else
        snprintf(where, sizeof where, "%s %u", what, i + 1);
    if (name_len >= 1 && name_len <= TALLY_STREAM_NAME_MAX &&
        tally_stream_name_valid(name, name_len))
        td_warn("state: %s (stream \"%.*s\") not restored: %s", where, (int)name_len, name, why);
    else
        td_warn("state: %s (name unreadable) not restored: %s", where, why);
}

static void skip_record(td_state_report_t *r, unsigned i, const uint8_t *name, size_t name_len,
                        const char *why)
{
    r->damaged++;
    warn_skipped("record", i, r->records, (const char *)name, name_len, why);
}

/* Walking records that carry their size (versions 3, 4 and the log). */
typedef struct {
    const char *magic;                                  /* 4 bytes */
    size_t (*size_of)(const uint8_t *p, size_t room);   /* a well-formed record's size, or 0 */
    void (*take)(void *ctx, unsigned i, const uint8_t *rec, size_t size);
    void (*bad)(void *ctx, unsigned i, const uint8_t *rec, size_t room); /* a damaged one */
    void *ctx;
} walk_t;

/* The next offset after `from` where a well-formed record starts, or `end`. */
static const uint8_t *resync(const walk_t *w, const uint8_t *from, const uint8_t *end)
{
    for (const uint8_t *q = from + 1; q + 4 <= end; q++) {
        q = memchr(q, w->magic[0], (size_t)(end - q));
        if (!q)
            break;
        if (w->size_of(q, (size_t)(end - q)))
            return q;
    }
    return end;
}

/* Walks at most `max` records from p: each well-formed one to w->take; one that is not goes to
 * w->bad and the walk resumes at the next well-formed one, unless nothing well-formed follows
 * and it is cut off by the end (its magic missing, or a size past the end): then the walk stops
 * there (*stop). Returns the records seen. */
static unsigned walk_records(const walk_t *w, const uint8_t *p, const uint8_t *end, unsigned max,
                             const uint8_t **stop)
{
    unsigned i = 0;
    for (; i < max && p < end; i++) {
        size_t size = w->size_of(p, (size_t)(end - p));
        if (size) {
            w->take(w->ctx, i, p, size);
            p += size;
            continue;
        }
        const uint8_t *next = resync(w, p, end);
        size_t room = (size_t)(end - p);
        bool whole = room >= 12 && memcmp(p, w->magic, 4) == 0 && tally_get_u32(p + 8) <= room;
        if (next == end && !whole)
            break;
        w->bad(w->ctx, i, p, room);
        p = next;
    }
    *stop = p;
    return i;
}

/* ---- Decoding versions 1 to 3: the `query` record as the payload ------------------------- */

/* A record's window slots (version 3); none for older versions. */
typedef struct {
    const uint8_t *slots;
    uint32_t count;
    uint32_t interval_ms;
} saved_ring_t;

static const saved_ring_t no_ring;

/* Rebuilds a restored stream's window ring from its version-3 slots (when windows are on);
 * false, with why, when the slots are inconsistent or memory runs out. */
static bool restore_ring_v3(td_streams_t *streams, td_stream_t *stream, const saved_ring_t *ring,
                            uint64_t now_ms, td_state_report_t *r, char *why, size_t cap)
{
    unsigned intervals = td_streams_window_intervals(streams);
    unsigned channels = tally_hist_channels(stream->info.hist_dtype);
    if (ring->count == 0 || intervals == 0)
        return true;
    stream->window =
        td_window_new(intervals, td_streams_window_interval_ms(streams), channels ? channels : 1);
    long dropped = stream->window ? td_window_decode_v3(stream->window, now_ms, ring->interval_ms,
                                                        ring->slots, ring->count)
                                  : -2;
    if (dropped < 0) {
        snprintf(why, cap, "%s",
                 dropped == -2 ? "out of memory for its window ring"
                               : "a window slot's total is not its bins, or an interval appears "
                                 "twice");
        return false;
    }
    r->window_slots_dropped += (unsigned)dropped;
    td_stream_recount(stream);
    return true;
}

/* Checks one old record's name and state (its bytes are known to be intact) and inserts it. */
static void restore_old_record(td_streams_t *streams, td_state_report_t *r, unsigned i,
                               const uint8_t *name, size_t name_len, const uint8_t *payload,
                               size_t payload_len, const saved_ring_t *ring, uint64_t now_ms)
{
    static tally_stream_info_t info; /* loop thread only */
    char why[160];
    if (!tally_stream_name_valid((const char *)name, name_len)) {
        skip_record(r, i, name, name_len, "the name is not a valid stream name");
        return;
    }
    if (tally_stream_info_decode(payload, payload_len, &info) != TALLY_OK) {
        skip_record(r, i, name, name_len,
                    "reserved bytes, the histogram dtype or the record's length are not valid");
        return;
    }
    if (!td_state_check_info(&info, why, sizeof why)) {
        skip_record(r, i, name, name_len, why);
        return;
    }
    if (ring->count && info.hist_dtype == TALLY_DTYPE_NONE) {
        skip_record(r, i, name, name_len, "window slots without a histogram");
        return;
    }
    if (td_streams_find(streams, (const char *)name, name_len)) {
        skip_record(r, i, name, name_len, "a second record for the same stream");
        return;
    }
    td_stream_t *stream = NULL;
    tally_status_t st = td_streams_get(streams, (const char *)name, name_len, &stream);
    if (st != TALLY_OK) {
        if (st == TALLY_E_INTERNAL) /* out of memory, not a limit: the restore fails */
            r->nomem++;
        else
            r->over_limit++;
        return;
    }
    snprintf(why, sizeof why, "out of memory");
    bool nomem = !td_stream_set_info(stream, &info);
    if (nomem || !restore_ring_v3(streams, stream, ring, now_ms, r, why, sizeof why)) {
        td_streams_remove(streams, &stream);
        if (nomem || strstr(why, "out of memory"))
            r->nomem++;
        else
            skip_record(r, i, name, name_len, why);
        return;
    }
    stream->state_dirty = false;
    r->restored++;
}

/* Any version's header: all there, and its checksum right. */
static td_err_t check_header_crc(const uint8_t *buf, size_t len, char *msg, size_t cap)
{
    if (len < TD_STATE_HEADER_SIZE) {
        snprintf(msg, cap, "truncated: %zu bytes is shorter than the header", len);
        return TD_ERR_CORRUPT;
    }
    if (td_state_crc(buf, TD_STATE_HEADER_CRC_OFF) !=
        tally_get_u32(buf + TD_STATE_HEADER_CRC_OFF)) {
        snprintf(msg, cap, "header checksum mismatch");
        return TD_ERR_CORRUPT;
    }
    return TD_OK;
}

/* The header of versions 2 and 3: checksum, reserved bytes, the record size field. */
static td_err_t check_header(const uint8_t *buf, size_t len, uint32_t record_size, char *msg,
                             size_t cap)
{
    td_err_t err = check_header_crc(buf, len, msg, cap);
    if (err != TD_OK)
        return err;
    if (tally_get_u32(buf + 16) != record_size || tally_get_u32(buf + 20) ||
        tally_get_u32(buf + 32)) {
        snprintf(msg, cap,
                 "records of %u bytes or reserved header bytes set: not this tallyd's layout",
                 tally_get_u32(buf + 16));
        return TD_ERR_CORRUPT;
    }
    return TD_OK;
}

/* Logs what a truncated or extended base leaves out. */
static void report_tail(td_state_report_t *r, unsigned seen, size_t after)
{
    r->missing = r->records - seen;
    if (r->missing)
        td_warn("state: the file is truncated: %u of its %u records are cut off", r->missing,
                r->records);
    else
        r->extra_bytes = after;
    if (r->extra_bytes)
        td_warn("state: %zu bytes after the last record ignored", r->extra_bytes);
}

/* The records a base's header announces, walked; what is cut off or left over reported. */
static void walk_base(const walk_t *w, const uint8_t *buf, size_t len, td_state_report_t *r)
{
    const uint8_t *stop = NULL, *end = buf + len;
    r->records = tally_get_u32(buf + 12);
    unsigned seen = walk_records(w, buf + TD_STATE_HEADER_SIZE, end, r->records, &stop);
    report_tail(r, seen, (size_t)(end - stop));
}

static td_err_t decode_v2(const uint8_t *buf, size_t len, td_streams_t *streams,
                          td_state_report_t *r, char *msg, size_t cap)
{
    td_err_t st = check_header(buf, len, TD_STATE_V2_RECORD_SIZE, msg, cap);
    if (st != TD_OK)
        return st;
    r->records = tally_get_u32(buf + 12);
    size_t room = (len - TD_STATE_HEADER_SIZE) / TD_STATE_V2_RECORD_SIZE;
    unsigned present = r->records < room ? r->records : (unsigned)room;
    report_tail(r, present, len - TD_STATE_HEADER_SIZE - (size_t)present * TD_STATE_V2_RECORD_SIZE);
    for (unsigned i = 0; i < present; i++) {
        const uint8_t *rec = buf + TD_STATE_HEADER_SIZE + (size_t)i * TD_STATE_V2_RECORD_SIZE;
        const uint8_t *name = rec + TD_STATE_V2_RECORD_NAME_OFF;
        uint32_t name_len = tally_get_u32(rec + 4);
        if (td_state_crc(rec + 4, TD_STATE_V2_RECORD_SIZE - 4) != tally_get_u32(rec))
            skip_record(r, i, name, name_len, "record checksum mismatch");
        else if (name_len > TALLY_STREAM_NAME_MAX ||
                 !all_zero(name + name_len, TALLY_STREAM_NAME_MAX - name_len))
            skip_record(r, i, name, 0, "the name field is not a padded name");
        else
            restore_old_record(streams, r, i, name, name_len, rec + TD_STATE_V2_RECORD_INFO_OFF,
                               TALLY_QUERY_PAYLOAD_SIZE, &no_ring, 0);
    }
    return TD_OK;
}

/* The size of a well-formed version-3 record at p (room bytes after p), or 0. */
static size_t v3_record_size(const uint8_t *p, size_t room)
{
    if (room < TD_STATE_V3_RECORD_INFO_OFF + TALLY_QUERY_PAYLOAD_SIZE ||
        memcmp(p, TD_STATE_V3_RECORD_MAGIC, 4) != 0)
        return 0;
    size_t size = tally_get_u32(p + 8);
    if (size < TD_STATE_V3_RECORD_INFO_OFF + TALLY_QUERY_PAYLOAD_SIZE || size > room)
        return 0;
    if (td_state_crc(p + 8, size - 8) != tally_get_u32(p + 4))
        return 0;
    return size;
}

/* What a walk over a base needs. */
typedef struct {
    td_streams_t *streams;
    td_state_report_t *r;
    uint64_t now_ms;
} base_walk_t;

/* One intact version-3 record: its fields against each other, then restore_old_record. */
static void v3_take(void *ctx, unsigned i, const uint8_t *rec, size_t size)
{
    base_walk_t *b = ctx;
    const uint8_t *name = rec + TD_STATE_V3_RECORD_NAME_OFF;
    uint32_t name_len = tally_get_u32(rec + 12);
    size_t info_len = tally_get_u32(rec + TD_STATE_V3_RECORD_INFO_LEN_OFF);
    saved_ring_t ring = {.count = tally_get_u32(rec + TD_STATE_V3_RECORD_SLOTS_OFF),
                         .interval_ms = tally_get_u32(rec + TD_STATE_V3_RECORD_INTERVAL_OFF)};
    if (name_len > TALLY_STREAM_NAME_MAX ||
        !all_zero(name + name_len, TALLY_STREAM_NAME_MAX - name_len)) {
        skip_record(b->r, i, name, 0, "the name field is not a padded name");
        return;
    }
    unsigned channels = 0;
    if (info_len >= TALLY_QUERY_PAYLOAD_SIZE && info_len <= size - TD_STATE_V3_RECORD_INFO_OFF)
        channels = tally_hist_channels(rec[TD_STATE_V3_RECORD_INFO_OFF + 56]);
    size_t slot = td_window_slot_size_v3(channels ? channels : 1);
    if (channels == 0 && info_len == TALLY_QUERY_PAYLOAD_SIZE && ring.count == 0)
        channels = 1; /* a stream without a histogram, and no ring */
    if (channels == 0 || tally_get_u32(rec + 92) ||
        size != TD_STATE_V3_RECORD_INFO_OFF + info_len + (size_t)ring.count * slot ||
        (ring.count && ring.interval_ms == 0)) {
        skip_record(b->r, i, name, name_len, "the record's lengths do not fit its histogram");
        return;
    }
    ring.slots = rec + TD_STATE_V3_RECORD_INFO_OFF + info_len;
    restore_old_record(b->streams, b->r, i, name, name_len, rec + TD_STATE_V3_RECORD_INFO_OFF,
                       info_len, &ring, b->now_ms);
}

/* A record of a base (version 3 or 4) that does not check out. */
static void base_bad(void *ctx, unsigned i, const uint8_t *rec, size_t room, size_t name_off,
                     uint32_t name_len)
{
    base_walk_t *b = ctx;
    if (room < name_off + name_len)
        name_len = 0;
    skip_record(b->r, i, rec + name_off, name_len <= TALLY_STREAM_NAME_MAX ? name_len : 0,
                "record checksum mismatch (or a damaged magic or size)");
}

static void v3_bad(void *ctx, unsigned i, const uint8_t *rec, size_t room)
{
    base_bad(ctx, i, rec, room, TD_STATE_V3_RECORD_NAME_OFF,
             room >= 16 ? tally_get_u32(rec + 12) : 0);
}

static td_err_t decode_v3(const uint8_t *buf, size_t len, uint64_t now_ms, td_streams_t *streams,
                          td_state_report_t *r, char *msg, size_t cap)
{
    td_err_t st = check_header(buf, len, 0, msg, cap);
    if (st != TD_OK)
        return st;
    base_walk_t b = {streams, r, now_ms};
    walk_t w = {TD_STATE_V3_RECORD_MAGIC, v3_record_size, v3_take, v3_bad, &b};
    walk_base(&w, buf, len, r);
    return TD_OK;
}

/* Version 1: the whole-file checksum, then the framing of every record, before any insert. */
static td_err_t decode_v1(const uint8_t *buf, size_t len, td_streams_t *streams,
                          td_state_report_t *r, char *msg, size_t cap)
{
    if (len < TD_STATE_V1_HEADER_SIZE + TD_STATE_V1_TRAILER_SIZE) {
        snprintf(msg, cap, "truncated: %zu bytes is shorter than the header", len);
        return TD_ERR_CORRUPT;
    }
    size_t body = len - TD_STATE_V1_HEADER_SIZE - TD_STATE_V1_TRAILER_SIZE;
    if (tally_get_u64(buf + 16) != body) {
        snprintf(msg, cap,
                 "truncated or extended: header says %" PRIu64 " bytes of records, "
                 "file has %zu",
                 tally_get_u64(buf + 16), body);
        return TD_ERR_CORRUPT;
    }
    if (td_state_checksum(buf, len - TD_STATE_V1_TRAILER_SIZE) !=
        tally_get_u64(buf + len - TD_STATE_V1_TRAILER_SIZE)) {
        snprintf(msg, cap, "checksum mismatch");
        return TD_ERR_CORRUPT;
    }
    r->records = tally_get_u32(buf + 12);
    const uint8_t *start = buf + TD_STATE_V1_HEADER_SIZE, *end = start + body, *p = start;
    for (uint32_t i = 0; i < r->records; i++) {
        if (p >= end || (size_t)(end - p) < 1u + *p + TALLY_QUERY_PAYLOAD_SIZE) {
            snprintf(msg, cap, "record %u of %u is malformed", i + 1, r->records);
            return TD_ERR_CORRUPT;
        }
        p += 1 + *p + TALLY_QUERY_PAYLOAD_SIZE;
    }
    if (p != end) {
        snprintf(msg, cap, "%zu bytes after the last record", (size_t)(end - p));
        return TD_ERR_CORRUPT;
    }
    p = start;
    for (uint32_t i = 0; i < r->records; i++) {
        restore_old_record(streams, r, i, p + 1, *p, p + 1 + *p, TALLY_QUERY_PAYLOAD_SIZE,
                           &no_ring, 0);
        p += 1 + *p + TALLY_QUERY_PAYLOAD_SIZE;
    }
    return TD_OK;
}

/* ---- Decoding version 4: the base and the log ------------------------------------------- */

/* A version-4 header of `magic`: checksum and reserved bytes (the version is known to be 4). */
static td_err_t check_v4_header(const uint8_t *buf, size_t len, bool log, char *msg, size_t cap)
{
    td_err_t err = check_header_crc(buf, len, msg, cap);
    if (err != TD_OK)
        return err;
    if ((log && tally_get_u32(buf + 12)) || tally_get_u32(buf + 32) ||
        tally_get_u64(buf + 16) == 0) {
        snprintf(msg, cap, "reserved header bytes set, or generation 0: not this tallyd's layout");
        return TD_ERR_CORRUPT;
    }
    return TD_OK;
}

/* Applies one parsed record; what became of it, for the caller to count. */
static td_state_apply_t apply(td_streams_t *streams, const td_state_record_t *rec,
                              uint64_t now_ms, td_state_report_t *r, char *why, size_t cap)
{
    unsigned dropped = 0;
    td_state_apply_t got = td_state_record_apply(streams, rec, now_ms, &dropped, why, cap);
    r->window_slots_dropped += dropped;
    if (got == TD_STATE_NO_ROOM)
        r->over_limit++;
    else if (got == TD_STATE_NO_MEMORY)
        r->nomem++;
    return got;
}

static void v4_take(void *ctx, unsigned i, const uint8_t *p, size_t size)
{
    static td_state_record_t rec; /* loop thread only: 8 KiB of bins */
    base_walk_t *b = ctx;
    char why[160];
    if (!td_state_record_parse(p, size, &rec, why, sizeof why)) {
        skip_record(b->r, i, (const uint8_t *)rec.name, rec.name_len, why);
        return;
    }
    if (rec.kind != TD_STATE_RECORD_STREAM) {
        skip_record(b->r, i, (const uint8_t *)rec.name, rec.name_len, "a removal in a base");
        return;
    }
    if (td_streams_find(b->streams, rec.name, rec.name_len)) {
        skip_record(b->r, i, (const uint8_t *)rec.name, rec.name_len,
                    "a second record for the same stream");
        return;
    }
    td_state_apply_t got = apply(b->streams, &rec, b->now_ms, b->r, why, sizeof why);
    if (got == TD_STATE_APPLIED)
        b->r->restored++;
    else if (got != TD_STATE_NO_ROOM && got != TD_STATE_NO_MEMORY)
        skip_record(b->r, i, (const uint8_t *)rec.name, rec.name_len, why);
}

static void v4_bad(void *ctx, unsigned i, const uint8_t *rec, size_t room)
{
    base_bad(ctx, i, rec, room, TD_STATE_RECORD_NAME_OFF, room >= 14 ? rec[13] : 0);
}

static td_err_t decode_v4(const uint8_t *buf, size_t len, uint64_t now_ms, td_streams_t *streams,
                          td_state_report_t *r, char *msg, size_t cap)
{
    td_err_t st = check_v4_header(buf, len, false, msg, cap);
    if (st != TD_OK)
        return st;
    r->generation = tally_get_u64(buf + 16);
    base_walk_t b = {streams, r, now_ms};
    walk_t w = {TD_STATE_RECORD_MAGIC, td_state_record_check, v4_take, v4_bad, &b};
    walk_base(&w, buf, len, r);
    return TD_OK;
}

/* The magic and version every format version keeps at bytes 0..11: TD_ERR_VERSION for a
 * version above this tallyd's, TD_ERR_CORRUPT for a file that is not one of `magic`. */
static td_err_t check_magic(const uint8_t *buf, size_t len, const char *magic, const char *what,
                            unsigned *version, char *msg, size_t cap)
{
    if (len < 12) {
        snprintf(msg, cap, "truncated: %zu bytes is shorter than the header", len);
        return TD_ERR_CORRUPT;
    }
    if (memcmp(buf, magic, 8) != 0) {
        snprintf(msg, cap, "not a tallyd %s (bad magic)", what);
        return TD_ERR_CORRUPT;
    }
    *version = tally_get_u32(buf + 8);
    if (*version > TD_STATE_VERSION) {
        snprintf(msg, cap,
                 "written by a newer tallyd (format version %u; this tallyd reads versions 1 to "
                 "%u): run that tallyd or a newer one, or move the file away to start without "
                 "its streams",
                 *version, TD_STATE_VERSION);
        return TD_ERR_VERSION;
    }
    return TD_OK;
}

td_err_t td_state_decode(const uint8_t *buf, size_t len, uint64_t now_ms, td_streams_t *streams,
                         td_state_report_t *report, char *msg, size_t msg_cap)
{
    memset(report, 0, sizeof *report);
    td_err_t st = check_magic(buf, len, TD_STATE_MAGIC, "state file", &report->version, msg,
                              msg_cap);
    if (st != TD_OK)
        return st;
    st = TD_ERR_CORRUPT;
    if (report->version == TD_STATE_VERSION)
        st = decode_v4(buf, len, now_ms, streams, report, msg, msg_cap);
    else if (report->version == 3)
        st = decode_v3(buf, len, now_ms, streams, report, msg, msg_cap);
    else if (report->version == 2)
        st = decode_v2(buf, len, streams, report, msg, msg_cap);
    else if (report->version == 1)
        st = decode_v1(buf, len, streams, report, msg, msg_cap);
    else
        snprintf(msg, msg_cap, "format version %u, this tallyd reads versions 1 to %u",
                 report->version, TD_STATE_VERSION);
    if (report->over_limit)
        td_warn("state: %u streams not restored: max_streams or max_state_bytes is reached",
                report->over_limit);
    return st;
}

/* What a walk over the log needs. */
typedef struct {
    td_streams_t *streams;
    td_state_report_t *r;
    uint64_t now_ms;
} log_walk_t;

static void log_take(void *ctx, unsigned i, const uint8_t *p, size_t size)
{
    static td_state_record_t rec; /* loop thread only */
    log_walk_t *l = ctx;
    char why[160];
    l->r->log_records++;
    if (!td_state_record_parse(p, size, &rec, why, sizeof why)) {
        l->r->log_damaged++;
        warn_skipped("log record", i, 0, rec.name, rec.name_len, why);
        return;
    }
    td_state_apply_t got = apply(l->streams, &rec, l->now_ms, l->r, why, sizeof why);
    if (got == TD_STATE_REFUSED) {
        l->r->log_damaged++;
        warn_skipped("log record", i, 0, rec.name, rec.name_len, why);
    }
}

static void log_bad(void *ctx, unsigned i, const uint8_t *rec, size_t room)
{
    log_walk_t *l = ctx;
    l->r->log_damaged++;
    size_t name_len = room >= 14 ? rec[13] : 0;
    warn_skipped("log record", i, 0, (const char *)rec + TD_STATE_RECORD_NAME_OFF,
                 room >= TD_STATE_RECORD_NAME_OFF + name_len ? name_len : 0,
                 "record checksum mismatch (or a damaged magic or size); the stream keeps its "
                 "state from an earlier snapshot");
}

td_err_t td_state_log_decode(const uint8_t *buf, size_t len, uint64_t now_ms,
                             td_streams_t *streams, td_state_report_t *r, char *msg, size_t cap)
{
    unsigned version = 0;
    td_err_t st = check_magic(buf, len, TD_STATE_LOG_MAGIC, "state log", &version, msg, cap);
    if (st == TD_OK && version != TD_STATE_VERSION) {
        snprintf(msg, cap, "format version %u, this tallyd writes logs of version %u", version,
                 TD_STATE_VERSION);
        st = TD_ERR_CORRUPT;
    }
    if (st == TD_OK)
        st = check_v4_header(buf, len, true, msg, cap);
    if (st != TD_OK)
        return st;
    if (tally_get_u64(buf + 16) != r->generation) { /* a compaction stopped after its base */
        r->log_stale = true;
        return TD_OK;
    }
    r->log_used = true;
    log_walk_t l = {streams, r, now_ms};
    walk_t w = {TD_STATE_RECORD_MAGIC, td_state_record_check, log_take, log_bad, &l};
    const uint8_t *stop = NULL, *end = buf + len;
    walk_records(&w, buf + TD_STATE_HEADER_SIZE, end, UINT32_MAX, &stop);
    r->log_good = (size_t)(stop - buf);
    r->log_torn = (size_t)(end - stop);
    if (r->log_torn)
        td_notice("state: the log's last %zu bytes are a record cut off (a snapshot a crash "
                  "interrupted): ignored",
                  r->log_torn);
    return TD_OK;
}
