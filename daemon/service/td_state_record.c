/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_state_record.c — see td_state_record.h. Encoding writes the parts in order and seals the
 * record with its CRC; parsing checks every field against the others before anything is
 * trusted, and td_state_record_apply builds the ring apart from the stream first, so a record
 * that turns out to be inconsistent leaves the table as it was.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "td_state_record.h"
#include "td_window.h"

/* Offsets after the name, in a stream record. */
#define AFTER_HEAD TALLY_STREAM_INFO_HEAD_SIZE
#define AFTER_INTERVAL (AFTER_HEAD + 8u)

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

/* ---- Encoding --------------------------------------------------------------------------- */

/* The common start of both kinds; the CRC is sealed last. */
static void put_start(uint8_t *out, uint8_t kind, const char *name, size_t len, size_t size)
{
    memcpy(out, TD_STATE_RECORD_MAGIC, 4);
    tally_put_u32(out + 8, (uint32_t)size);
    out[12] = kind;
    out[13] = (uint8_t)len;
    tally_put_u16(out + 14, 0);
    memcpy(out + TD_STATE_RECORD_NAME_OFF, name, len);
}

static void seal(uint8_t *out, size_t size)
{
    tally_put_u32(out + 4, td_state_crc(out + 8, size - 8));
}

/* The ring's part of a record: the slots changed after `since` (changed) or all of them. */
static size_t encode_ring(const td_stream_t *s, uint64_t now_ms, const td_ring_mark_t *since,
                          bool changed, uint8_t *out)
{
    if (!s->window)
        return 0;
    return changed ? td_window_encode_since(s->window, now_ms, since->stamp, out)
                   : td_window_encode(s->window, now_ms, out);
}

/* The stream's record: kind 3 when `since` is a mark of its ring as it is (its epoch; a ring),
 * only the slots changed after it; otherwise kind 1, whole (since NULL: always). */
static size_t encode_state(const td_stream_t *s, uint64_t now_ms, const td_ring_mark_t *since,
                           uint8_t *out)
{
    /* the counters only: its bins stay zero; per thread (direct mode's changelog encodes on
     * the shards' threads) */
    static _Thread_local tally_stream_info_t head;
    bool changed = since && s->window && since->epoch == s->ring_epoch;
    size_t values = td_stream_values(s->info.hist_dtype);
    size_t at = TD_STATE_RECORD_NAME_OFF + s->name_len + AFTER_INTERVAL;
    size_t bins = td_bins_encode(&s->bins, values, NULL);
    size_t ring = encode_ring(s, now_ms, since, changed, NULL);
    size_t size = at + bins + ring;
    if (!out)
        return size;
    put_start(out, changed ? TD_STATE_RECORD_CHANGED : TD_STATE_RECORD_STREAM, s->name,
              s->name_len, size);
    uint8_t *p = out + TD_STATE_RECORD_NAME_OFF + s->name_len;
    td_stream_info_head(s, &head);
    tally_stream_info_encode_head(&head, p);
    tally_put_u32(p + AFTER_HEAD, s->window ? td_window_interval_ms(s->window) : 0);
    tally_put_u32(p + AFTER_HEAD + 4, 0);
    td_bins_encode(&s->bins, values, out + at);
    encode_ring(s, now_ms, since, changed, out + at + bins);
    seal(out, size);
    return size;
}

size_t td_state_record_encode(const td_stream_t *s, uint64_t now_ms, uint8_t *out)
{
    return encode_state(s, now_ms, NULL, out);
}

size_t td_state_record_encode_next(const td_stream_t *s, uint64_t now_ms, bool replaces,
                                   uint8_t *out)
{
    return encode_state(s, now_ms, replaces ? &s->cl_mark_before : &s->cl_mark, out);
}

void td_state_record_written(td_stream_t *s, bool replaces)
{
    if (!replaces) /* the record it replaced started where this one does */
        s->cl_mark_before = s->cl_mark;
    s->cl_mark = td_stream_ring_mark(s);
}

size_t td_state_record_encode_removed(const char *name, size_t len, uint8_t *out)
{
    size_t size = TD_STATE_RECORD_NAME_OFF + len;
    if (out) {
        put_start(out, TD_STATE_RECORD_REMOVED, name, len, size);
        seal(out, size);
    }
    return size;
}

/* ---- Parsing ---------------------------------------------------------------------------- */

size_t td_state_record_check(const uint8_t *p, size_t room)
{
    if (room < TD_STATE_RECORD_MIN || memcmp(p, TD_STATE_RECORD_MAGIC, 4) != 0)
        return 0;
    size_t size = tally_get_u32(p + 8);
    if (size < TD_STATE_RECORD_MIN || size > room)
        return 0;
    return td_state_crc(p + 8, size - 8) == tally_get_u32(p + 4) ? size : 0;
}

/* A stream record's state after its name (len bytes): head, interval, bins, ring. */
static bool parse_state(const uint8_t *p, size_t len, td_state_record_t *rec, char *why,
                        size_t cap)
{
    tally_stream_info_t *info = &rec->info;
    memset(info, 0, sizeof *info);
    if (len < AFTER_INTERVAL) {
        snprintf(why, cap, "the record is too short for a stream's state");
        return false;
    }
    if (tally_stream_info_decode_head(p, info) != TALLY_OK || tally_get_u32(p + AFTER_HEAD + 4)) {
        snprintf(why, cap, "reserved bytes or the histogram dtype are not valid");
        return false;
    }
    size_t got = td_bins_decode(p + AFTER_INTERVAL, len - AFTER_INTERVAL,
                                td_stream_values(info->hist_dtype), info->bins);
    if (!got) {
        snprintf(why, cap, "the histogram's counts are not a valid encoding");
        return false;
    }
    rec->interval_ms = tally_get_u32(p + AFTER_HEAD);
    rec->ring = p + AFTER_INTERVAL + got;
    rec->ring_len = len - AFTER_INTERVAL - got;
    if ((rec->interval_ms == 0) != (rec->ring_len == 0) ||
        (rec->ring_len && info->hist_dtype == TALLY_DTYPE_NONE)) {
        snprintf(why, cap, "the record's lengths do not fit its histogram and ring");
        return false;
    }
    return td_state_check_info(info, why, cap);
}

bool td_state_record_parse(const uint8_t *p, size_t size, td_state_record_t *rec, char *why,
                           size_t cap)
{
    memset(rec, 0, offsetof(td_state_record_t, info));
    rec->interval_ms = 0;
    rec->ring = NULL;
    rec->ring_len = 0;
    size_t len = p[13];
    if (len < 1 || len > TALLY_STREAM_NAME_MAX || TD_STATE_RECORD_NAME_OFF + len > size ||
        !tally_stream_name_valid((const char *)p + TD_STATE_RECORD_NAME_OFF, len)) {
        snprintf(why, cap, "the name is not a valid stream name");
        return false;
    }
    rec->name = (const char *)p + TD_STATE_RECORD_NAME_OFF;
    rec->name_len = len;
    rec->kind = p[12];
    if (tally_get_u16(p + 14)) {
        snprintf(why, cap, "reserved bytes are set");
        return false;
    }
    const uint8_t *rest = p + TD_STATE_RECORD_NAME_OFF + len;
    size_t rest_len = size - TD_STATE_RECORD_NAME_OFF - len;
    if (rec->kind == TD_STATE_RECORD_REMOVED && rest_len == 0)
        return true;
    if (rec->kind == TD_STATE_RECORD_STREAM)
        return parse_state(rest, rest_len, rec, why, cap);
    if (rec->kind == TD_STATE_RECORD_CHANGED) {
        if (!parse_state(rest, rest_len, rec, why, cap))
            return false;
        if (rec->interval_ms != 0)
            return true;
        snprintf(why, cap, "a ring's changes (kind 3) without a ring");
        return false;
    }
    snprintf(why, cap, "kind %u is not a record this tallyd knows", rec->kind);
    return false;
}

/* ---- Applying --------------------------------------------------------------------------- */

/* The record's ring, built for the table's windows at now_ms (NULL: no ring: windows off, or
 * nothing saved). False when it is inconsistent or memory runs out (why says which). */
static bool build_ring(td_streams_t *streams, const td_state_record_t *rec, uint64_t now_ms,
                       td_window_t **out, unsigned *dropped, bool *nomem, char *why, size_t cap)
{
    *out = NULL;
    unsigned intervals = td_streams_window_intervals(streams);
    uint32_t interval_ms = td_streams_window_interval_ms(streams);
    unsigned channels = tally_hist_channels(rec->info.hist_dtype);
    if (!rec->ring_len || !intervals || !interval_ms)
        return true;
    td_window_t *w = td_window_new(intervals, interval_ms, channels);
    if (!w) {
        *nomem = true;
        snprintf(why, cap, "out of memory for its window ring");
        return false;
    }
    size_t got = td_window_decode(w, now_ms, rec->interval_ms, rec->ring, rec->ring_len, dropped,
                                  nomem);
    if (got != rec->ring_len) {
        td_window_destroy(&w);
        snprintf(why, cap, *nomem ? "out of memory for its window ring"
                                  : "a window slot's total is not its bins, or the ring's form "
                                    "is not valid");
        return false;
    }
    *out = w;
    return true;
}

td_state_apply_t td_state_record_apply(td_streams_t *streams, const td_state_record_t *rec,
                                       uint64_t now_ms, unsigned *dropped, char *why, size_t cap)
{
    td_stream_t *s = td_streams_find(streams, rec->name, rec->name_len);
    *dropped = 0;
    if (rec->kind == TD_STATE_RECORD_REMOVED) {
        if (s)
            td_streams_remove(streams, &s);
        return TD_STATE_APPLIED;
    }
    td_window_t *ring = NULL;
    bool nomem = false;
    if (!build_ring(streams, rec, now_ms, &ring, dropped, &nomem, why, cap))
        return nomem ? TD_STATE_NO_MEMORY : TD_STATE_REFUSED;
    /* A ring's changes go over the ring they changed: the slots they leave are kept. */
    td_window_t *older = rec->kind == TD_STATE_RECORD_CHANGED && ring && s ? s->window : NULL;
    if (older && !td_window_room_for_older(ring, older, now_ms)) {
        td_window_destroy(&ring);
        snprintf(why, cap, "out of memory for its window ring");
        return TD_STATE_NO_MEMORY;
    }
    tally_status_t st = s ? TALLY_OK : td_streams_get(streams, rec->name, rec->name_len, &s);
    if (st != TALLY_OK) {
        td_window_destroy(&ring);
        snprintf(why, cap, "out of memory");
        return st == TALLY_E_INTERNAL ? TD_STATE_NO_MEMORY : TD_STATE_NO_ROOM;
    }
    if (older)
        s->window = NULL; /* td_stream_set_info frees the ring it has: not this one yet */
    if (!td_stream_set_info(s, &rec->info)) {
        s->window = older;
        td_window_destroy(&ring);
        snprintf(why, cap, "out of memory");
        return TD_STATE_NO_MEMORY;
    }
    if (older) {
        td_window_keep_older(ring, older, now_ms);
        td_window_destroy(&older);
    }
    s->window = ring;
    td_stream_recount(s);
    s->state_dirty = false; /* what it holds is what the record says */
    /* The changelog's next record of it needs only what changes from here. */
    s->cl_mark = s->cl_mark_before = td_stream_ring_mark(s);
    return TD_STATE_APPLIED;
}

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

