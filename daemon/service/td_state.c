/*
 * td_state.c — see td_state.h for the file format and the guarantees.
 *
 * Decoding checks the header first; only a usable header lets any record in. Then each record
 * stands alone: its checksum, its name and the invariants of its state are checked, and it is
 * either inserted or skipped with a warning, so one damaged record costs one stream. Version 3
 * records have a size of their own: after a record that does not check out (its size field may
 * be what was damaged), the reader looks for the next offset holding "TLYR" and a record whose
 * checksum matches over the size it claims; CRC-32 makes a false match there as unlikely as an
 * undetected error. Version 1 files have one checksum over the whole file: it must match before
 * any record is read, and their records then go through the same per-record checks.
 *
 * Files set aside never replace another: the name carries the time, the pid and a counter, and
 * the rename or copy refuses an existing name (RENAME_NOREPLACE, O_EXCL) and tries the next.
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
#include <zlib.h>

#include "td_config.h"
#include "td_hash.h"
#include "td_log.h"
#include "td_state.h"
#include "td_window.h"

/* A state file larger than this is not one of ours (64 GiB). */
#define STATE_FILE_MAX ((size_t)1 << 36)
/* How many set-aside names to try before giving up (each collision takes the next counter). */
#define ASIDE_TRIES 1000

uint32_t td_state_crc(const uint8_t *buf, size_t len)
{
    uLong crc = crc32(0L, Z_NULL, 0);
    while (len > 0) { /* zlib's length is a uInt */
        uInt chunk = len > (1u << 30) ? (1u << 30) : (uInt)len;
        crc = crc32(crc, buf, chunk);
        buf += chunk;
        len -= chunk;
    }
    return (uint32_t)crc;
}

uint64_t td_state_checksum(const uint8_t *buf, size_t len)
{
    return td_fnv1a64(buf, len);
}

uint64_t td_state_records_digest(const uint8_t *buf, size_t len)
{
    return td_state_checksum(buf + TD_STATE_HEADER_SIZE, len - TD_STATE_HEADER_SIZE);
}

/* ---- Encoding --------------------------------------------------------------------------- */

/* One stream's version-3 record at out (NULL: only its size). */
static size_t encode_record(const td_stream_t *s, uint64_t now_ms, uint8_t *out)
{
    size_t info_len = tally_stream_info_size(&s->info);
    uint32_t slots = 0;
    size_t ring = s->window ? td_window_encode(s->window, now_ms, NULL, &slots) : 0;
    size_t size = TD_STATE_RECORD_INFO_OFF + info_len + ring;
    if (!out)
        return size;
    memcpy(out, TD_STATE_RECORD_MAGIC, 4);
    tally_put_u32(out + 8, (uint32_t)size);
    tally_put_u32(out + 12, (uint32_t)s->name_len);
    memcpy(out + TD_STATE_RECORD_NAME_OFF, s->name, s->name_len);
    tally_put_u32(out + TD_STATE_RECORD_INFO_LEN_OFF, (uint32_t)info_len);
    tally_put_u32(out + TD_STATE_RECORD_SLOTS_OFF, slots);
    tally_put_u32(out + TD_STATE_RECORD_INTERVAL_OFF, slots ? td_window_interval_ms(s->window) : 0);
    tally_stream_info_encode(&s->info, out + TD_STATE_RECORD_INFO_OFF);
    if (slots)
        td_window_encode(s->window, now_ms, out + TD_STATE_RECORD_INFO_OFF + info_len, &slots);
    tally_put_u32(out + 4, td_state_crc(out + 8, size - 8));
    return size;
}

td_err_t td_state_encode(td_streams_t *streams, uint64_t now_ms, uint8_t **buf, size_t *len)
{
    return td_state_encode_some(streams, now_ms, NULL, NULL, buf, len);
}

td_err_t td_state_encode_some(td_streams_t *streams, uint64_t now_ms,
                              bool (*keep)(const td_stream_t *s, void *arg), void *arg,
                              uint8_t **buf, size_t *len)
{
    uint32_t count = 0;
    size_t total = TD_STATE_HEADER_SIZE;
    for (td_stream_t *s = td_streams_first(streams); s; s = s->list_next)
        if (!keep || keep(s, arg)) {
            total += encode_record(s, now_ms, NULL);
            count++;
        }
    uint8_t *out = calloc(1, total); /* zero: reserved bytes and name padding */
    if (!out)
        return TD_ERR_NOMEM;
    memcpy(out, TD_STATE_MAGIC, 8);
    tally_put_u32(out + 8, TD_STATE_VERSION);
    tally_put_u32(out + 12, count);
    tally_put_u64(out + 24, (uint64_t)time(NULL));
    tally_put_u32(out + TD_STATE_HEADER_CRC_OFF, td_state_crc(out, TD_STATE_HEADER_CRC_OFF));
    uint8_t *rec = out + TD_STATE_HEADER_SIZE;
    for (td_stream_t *s = td_streams_first(streams); s; s = s->list_next)
        if (!keep || keep(s, arg))
            rec += encode_record(s, now_ms, rec);
    *buf = out;
    *len = total;
    return TD_OK;
}

/* ---- Invariants ------------------------------------------------------------------------- */

/* The histogram part of td_state_check_info. Sums wrap like the counters they check. */
static bool check_hist(const tally_stream_info_t *in, char *msg, size_t cap)
{
    uint64_t sum = in->hist_underflow + in->hist_overflow;
    bool any_bin = false;
    for (size_t b = 0; b < TALLY_HIST_VALUES_MAX; b++)
        any_bin |= in->bins[b] != 0;
    for (size_t b = 0; b < TALLY_HIST_BINS; b++)
        sum += in->bins[b];
    /* Every channel of a colour histogram counts each pixel once. */
    for (unsigned c = 1; c < tally_hist_channels(in->hist_dtype); c++) {
        uint64_t channel = 0;
        for (size_t b = 0; b < TALLY_HIST_BINS; b++)
            channel += in->bins[c * TALLY_HIST_BINS + b];
        if (channel != in->hist_total) {
            snprintf(msg, cap, "channel %u counts %" PRIu64 " pixels, not hist_total %" PRIu64, c,
                     channel, in->hist_total);
            return false;
        }
    }
    switch (in->hist_dtype) {
    case TALLY_DTYPE_NONE:
        if (any_bin || in->hist_underflow || in->hist_overflow || in->hist_total || in->hist_lo ||
            in->hist_hi) {
            snprintf(msg, cap, "no histogram yet, but nonzero bins, counts or range");
            return false;
        }
        return true;
    case TALLY_DTYPE_U8:
    case TALLY_DTYPE_RGB8:
    case TALLY_DTYPE_RGBA8:
        if (in->hist_underflow || in->hist_overflow || in->hist_lo || in->hist_hi) {
            snprintf(msg, cap, "a %s histogram with underflow, overflow or a range",
                     tally_dtype_name((tally_dtype_t)in->hist_dtype));
            return false;
        }
        break;
    case TALLY_DTYPE_I32:
    case TALLY_DTYPE_U16: {
        int64_t min = in->hist_dtype == TALLY_DTYPE_U16 ? 0 : INT32_MIN;
        int64_t max = in->hist_dtype == TALLY_DTYPE_U16 ? 65536 : (int64_t)INT32_MAX + 1;
        if (in->hist_lo >= in->hist_hi || in->hist_lo < min || in->hist_hi > max) {
            snprintf(msg, cap, "%s histogram range [%" PRId64 ", %" PRId64 ") is not valid",
                     tally_dtype_name((tally_dtype_t)in->hist_dtype), in->hist_lo, in->hist_hi);
            return false;
        }
        break;
    }
    default:
        snprintf(msg, cap, "histogram dtype %u is not one hist takes", in->hist_dtype);
        return false;
    }
    if (tally_hist_channels(in->hist_dtype) < TALLY_HIST_CHANNELS_MAX) {
        for (size_t b = TALLY_HIST_BINS * tally_hist_channels(in->hist_dtype);
             b < TALLY_HIST_VALUES_MAX; b++) {
            if (in->bins[b]) {
                snprintf(msg, cap, "bins beyond the histogram's channels");
                return false;
            }
        }
    }
    if (sum != in->hist_total) {
        snprintf(msg, cap,
                 "histogram total %" PRIu64 " is not bins + underflow + overflow (%" PRIu64 ")",
                 in->hist_total, sum);
        return false;
    }
    return true;
}

/* What td_request_apply maintains: every element of a batch is filtered, scanned or
 * histogrammed, and a stream with no batch has applied nothing. */
bool td_state_check_info(const tally_stream_info_t *in, char *msg, size_t cap)
{
    if (in->filter_kept > in->filter_seen) {
        snprintf(msg, cap, "filter_kept %" PRIu64 " is above filter_seen %" PRIu64, in->filter_kept,
                 in->filter_seen);
        return false;
    }
    if (in->scan_elements > in->elements) {
        snprintf(msg, cap, "scan_elements %" PRIu64 " is above elements %" PRIu64,
                 in->scan_elements, in->elements);
        return false;
    }
    if (in->filter_seen + in->scan_elements + in->hist_total != in->elements) {
        snprintf(msg, cap, "elements %" PRIu64 " is not filtered + scanned + histogrammed",
                 in->elements);
        return false;
    }
    if (in->batches == 0 && (in->elements || in->bytes)) {
        snprintf(msg, cap, "no batches, yet %" PRIu64 " elements and %" PRIu64 " bytes",
                 in->elements, in->bytes);
        return false;
    }
    if (in->scan_elements == 0 && in->scan_carry != 0) {
        snprintf(msg, cap, "scan carry %" PRId64 " with no element scanned", in->scan_carry);
        return false;
    }
    return check_hist(in, msg, cap);
}

/* ---- Decoding --------------------------------------------------------------------------- */

static bool all_zero(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i])
            return false;
    return true;
}

/* Logs a record that is not restored, naming its stream when the name reads as one. */
static void skip_record(td_state_report_t *r, unsigned i, const uint8_t *name, size_t name_len,
                        const char *why)
{
    r->damaged++;
    if (name_len >= 1 && name_len <= TALLY_STREAM_NAME_MAX &&
        tally_stream_name_valid((const char *)name, name_len))
        td_warn("state: record %u of %u (stream \"%.*s\") not restored: %s", i + 1, r->records,
                (int)name_len, (const char *)name, why);
    else
        td_warn("state: record %u of %u (name unreadable) not restored: %s", i + 1, r->records,
                why);
}

/* A record's window slots (version 3); none for older versions. */
typedef struct {
    const uint8_t *slots;
    uint32_t count;
    uint32_t interval_ms;
} saved_ring_t;

/* Rebuilds a restored stream's window ring from its saved slots (when windows are on); false,
 * with why, when the slots are inconsistent. */
static bool restore_ring(td_streams_t *streams, td_stream_t *stream, const saved_ring_t *ring,
                         uint64_t now_ms, td_state_report_t *r, char *why, size_t cap)
{
    unsigned intervals = td_streams_window_intervals(streams);
    unsigned channels = tally_hist_channels(stream->info.hist_dtype);
    if (ring->count == 0 || intervals == 0)
        return true;
    stream->window =
        td_window_new(intervals, td_streams_window_interval_ms(streams), channels ? channels : 1);
    if (!stream->window) {
        snprintf(why, cap, "out of memory for its window ring");
        return false;
    }
    long dropped =
        td_window_decode(stream->window, now_ms, ring->interval_ms, ring->slots, ring->count);
    if (dropped < 0) {
        snprintf(why, cap, "a window slot's total is not its bins, or an interval appears twice");
        return false;
    }
    r->window_slots_dropped += (unsigned)dropped;
    return true;
}

/* Checks one record's name and state (its bytes are known to be intact) and inserts it. */
static void restore_record(td_streams_t *streams, td_state_report_t *r, unsigned i,
                           const uint8_t *name, size_t name_len, const uint8_t *payload,
                           size_t payload_len, const saved_ring_t *ring, uint64_t now_ms)
{
    char why[160];
    tally_stream_info_t info;
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
    if (td_streams_get(streams, (const char *)name, name_len, &stream) != TALLY_OK) {
        r->over_limit++;
        return;
    }
    stream->info = info;
    if (!restore_ring(streams, stream, ring, now_ms, r, why, sizeof why)) {
        td_streams_remove(streams, &stream);
        skip_record(r, i, name, name_len, why);
        return;
    }
    r->restored++;
}

static const saved_ring_t no_ring;

/* The header of versions 2 and 3: checksum, reserved bytes, the record size field. */
static td_err_t check_header(const uint8_t *buf, size_t len, uint32_t record_size, char *msg,
                             size_t cap)
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
    if (tally_get_u32(buf + 16) != record_size || tally_get_u32(buf + 20) ||
        tally_get_u32(buf + 32)) {
        snprintf(msg, cap,
                 "records of %u bytes or reserved header bytes set: not this tallyd's layout",
                 tally_get_u32(buf + 16));
        return TD_ERR_CORRUPT;
    }
    return TD_OK;
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
    r->missing = r->records - present;
    if (r->missing)
        td_warn("state: the file is truncated: %u of its %u records are cut off", r->missing,
                r->records);
    else
        r->extra_bytes = len - TD_STATE_HEADER_SIZE - (size_t)present * TD_STATE_V2_RECORD_SIZE;
    if (r->extra_bytes)
        td_warn("state: %zu bytes after the last record ignored", r->extra_bytes);
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
            restore_record(streams, r, i, name, name_len, rec + TD_STATE_V2_RECORD_INFO_OFF,
                           TALLY_QUERY_PAYLOAD_SIZE, &no_ring, 0);
    }
    return TD_OK;
}

/* The size of a well-formed version-3 record at p (with `room` bytes after p), or 0: the magic,
 * a size that fits and checks out against the info length, slot count and histogram shape,
 * and the checksum over that size. */
static size_t v3_record_size(const uint8_t *p, size_t room)
{
    if (room < TD_STATE_RECORD_INFO_OFF + TALLY_QUERY_PAYLOAD_SIZE ||
        memcmp(p, TD_STATE_RECORD_MAGIC, 4) != 0)
        return 0;
    size_t size = tally_get_u32(p + 8);
    if (size < TD_STATE_RECORD_INFO_OFF + TALLY_QUERY_PAYLOAD_SIZE || size > room)
        return 0;
    if (td_state_crc(p + 8, size - 8) != tally_get_u32(p + 4))
        return 0;
    return size;
}

/* The next offset after `from` where a well-formed record starts, or `end`. */
static const uint8_t *v3_resync(const uint8_t *from, const uint8_t *end)
{
    for (const uint8_t *q = from + 1; q + 4 <= end; q++) {
        q = memchr(q, TD_STATE_RECORD_MAGIC[0], (size_t)(end - q));
        if (!q)
            break;
        if (v3_record_size(q, (size_t)(end - q)))
            return q;
    }
    return end;
}

/* One intact version-3 record: its fields against each other, then restore_record. */
static void v3_restore(td_streams_t *streams, td_state_report_t *r, unsigned i, const uint8_t *rec,
                       size_t size, uint64_t now_ms)
{
    const uint8_t *name = rec + TD_STATE_RECORD_NAME_OFF;
    uint32_t name_len = tally_get_u32(rec + 12);
    size_t info_len = tally_get_u32(rec + TD_STATE_RECORD_INFO_LEN_OFF);
    saved_ring_t ring = {.count = tally_get_u32(rec + TD_STATE_RECORD_SLOTS_OFF),
                         .interval_ms = tally_get_u32(rec + TD_STATE_RECORD_INTERVAL_OFF)};
    if (name_len > TALLY_STREAM_NAME_MAX ||
        !all_zero(name + name_len, TALLY_STREAM_NAME_MAX - name_len)) {
        skip_record(r, i, name, 0, "the name field is not a padded name");
        return;
    }
    unsigned channels = 0;
    if (info_len >= TALLY_QUERY_PAYLOAD_SIZE && info_len <= size - TD_STATE_RECORD_INFO_OFF)
        channels = tally_hist_channels(rec[TD_STATE_RECORD_INFO_OFF + 56]);
    size_t slot = td_window_slot_size(channels ? channels : 1);
    if (channels == 0 && info_len == TALLY_QUERY_PAYLOAD_SIZE && ring.count == 0)
        channels = 1; /* a stream without a histogram, and no ring */
    if (channels == 0 || tally_get_u32(rec + 92) ||
        size != TD_STATE_RECORD_INFO_OFF + info_len + (size_t)ring.count * slot ||
        (ring.count && ring.interval_ms == 0)) {
        skip_record(r, i, name, name_len, "the record's lengths do not fit its histogram");
        return;
    }
    ring.slots = rec + TD_STATE_RECORD_INFO_OFF + info_len;
    restore_record(streams, r, i, name, name_len, rec + TD_STATE_RECORD_INFO_OFF, info_len, &ring,
                   now_ms);
}

static td_err_t decode_v3(const uint8_t *buf, size_t len, uint64_t now_ms, td_streams_t *streams,
                          td_state_report_t *r, char *msg, size_t cap)
{
    td_err_t st = check_header(buf, len, 0, msg, cap);
    if (st != TD_OK)
        return st;
    r->records = tally_get_u32(buf + 12);
    const uint8_t *p = buf + TD_STATE_HEADER_SIZE, *end = buf + len;
    unsigned i = 0;
    for (; i < r->records && p < end; i++) {
        size_t size = v3_record_size(p, (size_t)(end - p));
        if (size) {
            v3_restore(streams, r, i, p, size, now_ms);
            p += size;
            continue;
        }
        /* Damaged where it starts (then the next good record follows) or cut off at the end. */
        const uint8_t *next = v3_resync(p, end);
        size_t claimed = (size_t)(end - p) >= 12 ? tally_get_u32(p + 8) : SIZE_MAX;
        if (next == end && claimed > (size_t)(end - p))
            break;
        uint32_t name_len = (size_t)(end - p) >= 80 ? tally_get_u32(p + 12) : 0;
        skip_record(r, i, p + TD_STATE_RECORD_NAME_OFF,
                    name_len <= TALLY_STREAM_NAME_MAX ? name_len : 0,
                    "record checksum mismatch (or a damaged magic or size)");
        p = next;
    }
    r->missing = r->records - i;
    if (r->missing)
        td_warn("state: the file is truncated: %u of its %u records are cut off", r->missing,
                r->records);
    else
        r->extra_bytes = (size_t)(end - p);
    if (r->extra_bytes)
        td_warn("state: %zu bytes after the last record ignored", r->extra_bytes);
    if (r->window_slots_dropped)
        td_info("state: %u window slots dropped (another interval length, or older than the "
                "ring reaches)",
                r->window_slots_dropped);
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
        restore_record(streams, r, i, p + 1, *p, p + 1 + *p, TALLY_QUERY_PAYLOAD_SIZE, &no_ring, 0);
        p += 1 + *p + TALLY_QUERY_PAYLOAD_SIZE;
    }
    return TD_OK;
}

td_err_t td_state_decode(const uint8_t *buf, size_t len, uint64_t now_ms, td_streams_t *streams,
                         td_state_report_t *report, char *msg, size_t msg_cap)
{
    memset(report, 0, sizeof *report);
    if (len < 12) {
        snprintf(msg, msg_cap, "truncated: %zu bytes is shorter than the header", len);
        return TD_ERR_CORRUPT;
    }
    if (memcmp(buf, TD_STATE_MAGIC, 8) != 0) {
        snprintf(msg, msg_cap, "not a tallyd state file (bad magic)");
        return TD_ERR_CORRUPT;
    }
    report->version = tally_get_u32(buf + 8);
    td_err_t st = TD_ERR_CORRUPT;
    if (report->version == TD_STATE_VERSION)
        st = decode_v3(buf, len, now_ms, streams, report, msg, msg_cap);
    else if (report->version == 2)
        st = decode_v2(buf, len, streams, report, msg, msg_cap);
    else if (report->version == 1)
        st = decode_v1(buf, len, streams, report, msg, msg_cap);
    else
        snprintf(msg, msg_cap, "format version %u, this tallyd reads versions 1 to %u",
                 report->version, TD_STATE_VERSION);
    if (report->over_limit)
        td_warn("state: %u of %u streams not restored: max_streams is reached", report->over_limit,
                report->records);
    return st;
}

/* ---- Writing ---------------------------------------------------------------------------- */

/* false with errno on error. */
static bool write_all(int fd, const uint8_t *buf, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return false;
        buf += n;
        len -= (size_t)n;
    }
    return true;
}

/* A rename is durable only once the directory entry is on disk. -1 with errno on error. */
static int fsync_dir(const char *dir)
{
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0)
        return -1;
    int rc = fsync(dfd);
    int saved = errno;
    close(dfd);
    errno = saved;
    return rc;
}

td_err_t td_state_write(const char *dir, const uint8_t *buf, size_t len, char *msg, size_t msg_cap)
{
    char path[4096], tmp[4096];
    snprintf(path, sizeof path, "%s/%s", dir, TD_STATE_FILE);
    snprintf(tmp, sizeof tmp, "%s/%s.tmp", dir, TD_STATE_FILE);
    const char *step = "create";
    const char *target = tmp;
    bool made_tmp = false; /* a failure from here on removes the temporary file */
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        goto fail;
    made_tmp = true;
    step = "write";
    if (!write_all(fd, buf, len))
        goto fail;
    step = "fsync";
    if (fsync(fd) != 0)
        goto fail;
    step = "close";
    int rc = close(fd);
    fd = -1;
    if (rc != 0)
        goto fail;
    step = "rename";
    if (rename(tmp, path) != 0)
        goto fail;
    made_tmp = false; /* renamed: it is the state file now */
    step = "fsync";
    target = dir;
    if (fsync_dir(dir) != 0)
        goto fail;
    return TD_OK;

fail:
    snprintf(msg, msg_cap, "%s %s: %s", step, target, strerror(errno));
    if (fd >= 0)
        close(fd);
    if (made_tmp)
        unlink(tmp);
    return TD_ERR_IO;
}

/* ---- Restoring -------------------------------------------------------------------------- */

static const char *file_kind(mode_t mode)
{
    if (S_ISDIR(mode))
        return "a directory";
    if (S_ISLNK(mode))
        return "a symbolic link";
    if (S_ISFIFO(mode))
        return "a FIFO";
    if (S_ISSOCK(mode))
        return "a socket";
    return "a device or other non-regular file";
}

/* Every snapshot is written to the temporary name and renamed over the state file: something
 * other than a regular file at either name would make every snapshot fail (or, for a symbolic
 * link, be replaced by the first one). */
static td_err_t check_tmp(const char *tmp, char *msg, size_t cap)
{
    struct stat sb;
    if (lstat(tmp, &sb) == 0 && !S_ISREG(sb.st_mode)) {
        snprintf(msg, cap, "%s is %s, where tallyd writes every snapshot; remove it", tmp,
                 file_kind(sb.st_mode));
        return TD_ERR_IO;
    }
    return TD_OK;
}

/* Opens the state file for reading: absent (TD_OK, *fd_out -1), a regular file (TD_OK, *fd_out)
 * or unusable (TD_ERR_IO, msg). O_NONBLOCK so a FIFO cannot block the start; O_NOFOLLOW so a
 * link is refused, not replaced. */
static td_err_t open_state(const char *path, int *fd_out, struct stat *sb, char *msg, size_t cap)
{
    *fd_out = -1;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0 && errno == ENOENT)
        return TD_OK;
    if (fd < 0 && errno == ELOOP) {
        snprintf(msg, cap,
                 "%s is a symbolic link; tallyd replaces the file on every snapshot, "
                 "so point the state directory at the real one",
                 path);
        return TD_ERR_IO;
    }
    if (fd < 0) {
        snprintf(msg, cap, "cannot open %s: %s", path, strerror(errno));
        return TD_ERR_IO;
    }
    if (fstat(fd, sb) != 0 || !S_ISREG(sb->st_mode)) {
        snprintf(msg, cap,
                 "%s is %s, not a regular file; remove it or choose another state "
                 "directory",
                 path, file_kind(sb->st_mode));
        close(fd);
        return TD_ERR_IO;
    }
    *fd_out = fd;
    return TD_OK;
}

/* Reads the whole state file into *buf (NULL when there is none). TD_ERR_CORRUPT when it is too
 * large to be ours; TD_ERR_IO or TD_ERR_NOMEM when it cannot be read. */
static td_err_t read_state(const char *path, uint8_t **buf, size_t *len, char *msg, size_t cap)
{
    struct stat sb = {0};
    int fd = -1;
    *buf = NULL;
    td_err_t st = open_state(path, &fd, &sb, msg, cap);
    if (st != TD_OK || fd < 0)
        return st;
    uint8_t *data = NULL;
    size_t size = (size_t)sb.st_size, got = 0;
    if (sb.st_size < 0 || size > STATE_FILE_MAX) {
        snprintf(msg, cap, "%lld bytes is too large for a state file", (long long)sb.st_size);
        st = TD_ERR_CORRUPT;
        goto cleanup;
    }
    st = TD_ERR_NOMEM;
    data = malloc(size ? size : 1);
    if (!data) {
        snprintf(msg, cap, "out of memory for %zu bytes of %s", size, path);
        goto cleanup;
    }
    st = TD_ERR_IO;
    while (got < size) {
        ssize_t n = read(fd, data + got, size - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            snprintf(msg, cap, "cannot read %s: %s", path, strerror(errno));
            goto cleanup;
        }
        if (n == 0)
            break;
        got += (size_t)n;
    }
    *buf = data;
    *len = got;
    data = NULL;
    st = TD_OK;
cleanup:
    free(data);
    close(fd);
    return st;
}

/* DIR/streams.state.corrupt-<UTC time>-<pid>-<n>: a new n for every try, in this process. */
static void aside_name(char *out, size_t cap, const char *dir)
{
    static unsigned serial;
    char stamp[32];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &tm);
    snprintf(out, cap, "%s/%s.corrupt-%s-%ld-%u", dir, TD_STATE_FILE, stamp, (long)getpid(),
             ++serial);
}

/* rename() that fails with EEXIST instead of replacing `to`. */
static int rename_noreplace(const char *from, const char *to)
{
    if (renameat2(AT_FDCWD, from, AT_FDCWD, to, RENAME_NOREPLACE) == 0)
        return 0;
    if (errno != EINVAL && errno != ENOSYS)
        return -1;
    /* A file system without RENAME_NOREPLACE: link() refuses an existing name too. */
    if (link(from, to) != 0)
        return -1;
    return unlink(from);
}

/* Moves the state file aside (buf NULL) or writes a copy of buf beside it; the name it got is
 * in aside, or -1 with errno. */
static int set_aside(const char *dir, const char *path, const uint8_t *buf, size_t len, char *aside,
                     size_t cap)
{
    for (int i = 0; i < ASIDE_TRIES; i++) {
        aside_name(aside, cap, dir);
        if (!buf) {
            if (rename_noreplace(path, aside) == 0)
                return 0;
        } else {
            int fd = open(aside, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
            if (fd >= 0) {
                int rc = write_all(fd, buf, len) && fsync(fd) == 0 ? 0 : -1;
                int saved = errno;
                close(fd);
                errno = saved;
                return rc;
            }
        }
        if (errno != EEXIST)
            return -1;
    }
    return -1;
}

/* Logs what a restore found and keeps the evidence: an unusable file is moved aside, a file
 * that lost records is copied aside (it stays in place until the next snapshot replaces it). */
static void report_restore(const char *dir, const char *path, td_err_t st, const uint8_t *buf,
                           size_t len, const td_state_report_t *r, const char *why)
{
    char aside[4200];
    if (st != TD_OK) {
        if (set_aside(dir, path, NULL, 0, aside, sizeof aside) == 0)
            td_warn("state: %s is unusable (%s); set aside as %s; starting with no streams", path,
                    why, aside);
        else
            td_warn("state: %s is unusable (%s) and cannot be set aside (%s); starting with no "
                    "streams",
                    path, why, strerror(errno));
        return;
    }
    if (!td_state_report_lossy(r)) {
        td_notice("state: restored %u streams from %s (format version %u)", r->restored, path,
                  r->version);
        return;
    }
    if (set_aside(dir, path, buf, len, aside, sizeof aside) == 0)
        td_warn("state: restored %u of the %u streams in %s (%u damaged, %u cut off, %u over "
                "max_streams); a copy of the file is set aside as %s",
                r->restored, r->records, path, r->damaged, r->missing, r->over_limit, aside);
    else
        td_warn("state: restored %u of the %u streams in %s (%u damaged, %u cut off, %u over "
                "max_streams); no copy could be set aside: %s",
                r->restored, r->records, path, r->damaged, r->missing, r->over_limit,
                strerror(errno));
}

td_err_t td_state_restore(const char *dir, td_streams_t *streams, td_state_report_t *report,
                          char *msg, size_t msg_cap)
{
    char path[4096], tmp[4096], why[256] = "";
    snprintf(path, sizeof path, "%s/%s", dir, TD_STATE_FILE);
    snprintf(tmp, sizeof tmp, "%s/%s.tmp", dir, TD_STATE_FILE);
    memset(report, 0, sizeof *report);
    td_err_t st = check_tmp(tmp, msg, msg_cap);
    if (st != TD_OK)
        return st;
    uint8_t *buf = NULL;
    size_t len = 0;
    st = read_state(path, &buf, &len, msg, msg_cap);
    if (st == TD_OK && !buf) {
        td_info("state: no %s yet; starting with no streams", path);
        return TD_OK;
    }
    if (st != TD_OK && st != TD_ERR_CORRUPT) /* the path is unusable: every snapshot would fail */
        return st;
    if (st == TD_OK)
        st = td_state_decode(buf, len, td_clock_ms(), streams, report, why, sizeof why);
    else
        snprintf(why, sizeof why, "%s", msg);
    report_restore(dir, path, st, buf, len, report, why);
    free(buf);
    return TD_OK;
}
