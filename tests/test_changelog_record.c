/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_changelog_record.c — direct mode's changelog records (PROTOCOL.md §13 "Changelog";
 * td_state_record.h, kind 3): a record after a write carries the stream's counters and bins
 * whole and, of its window ring, only the slots changed since the stream's last record. No NATS
 * here: the writer's records are made as td_fleet_changelog.c makes them (td_state_record_encode_next,
 * a record still waiting in the batch replaced by the next one of its stream,
 * td_state_record_written), and "published" batches are applied in order as a next owner does.
 *   1. the records' shapes: a stream's first record holds its whole ring (kind 1), each later
 *      one only the slot its write changed (kind 3, one slot however many the ring holds), one
 *      that replaces a record still waiting the slots of both writes, one after a reset or a
 *      delete the whole (empty) ring; a record applied to a stream that has a ring keeps the
 *      slots it does not name, to a table without the stream makes it;
 *   2. random writes (hist batches of four dtypes over a clock that moves forward by 0-3
 *      intervals, resets, deletes) on 6 streams, batches published at random: a reader that
 *      applies every batch as it comes, and one that loads a checkpoint taken at a random point
 *      (the writer's state then, records waiting included) and applies the batches published
 *      after it, both end with the writer's every stream, record for record (td_state_record_encode
 *      byte for byte: counters, bins, the ring's every slot), for 40 seeds;
 *   3. a kind 3 record without a ring (its interval 0) is refused.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "td_state.h"
#include "td_state_record.h"
#include "td_window.h"

#define INTERVALS 8
#define MS 1000
#define T0 1795000000000ull

/* ---- the writer's batch, as td_fleet_changelog.c keeps it ---------------------------------- */

typedef struct {
    uint8_t *buf;
    size_t len, cap;
} batch_t;

/* Where the waiting record of `name` starts, or b->len. */
static size_t waiting(const batch_t *b, const char *name, size_t len)
{
    for (size_t at = 0; at < b->len; at += tally_get_u32(b->buf + at + 8))
        if (b->buf[at + 13] == len && memcmp(b->buf + at + TD_STATE_RECORD_NAME_OFF, name, len) == 0)
            return at;
    return b->len;
}

static void room(batch_t *b, size_t need)
{
    if (b->len + need <= b->cap)
        return;
    b->cap = (b->len + need) * 2;
    b->buf = realloc(b->buf, b->cap);
    assert_non_null(b->buf);
}

/* The record of a write just applied to s (NULL: `name` deleted); its kind. */
static uint8_t hold(batch_t *b, td_stream_t *s, const char *name, uint64_t now)
{
    size_t len = strlen(name), at = waiting(b, name, len);
    bool replaces = at < b->len;
    size_t size = s ? td_state_record_encode_next(s, now, replaces, NULL)
                    : td_state_record_encode_removed(name, len, NULL);
    if (replaces) {
        size_t old = tally_get_u32(b->buf + at + 8);
        memmove(b->buf + at, b->buf + at + old, b->len - at - old);
        b->len -= old;
    }
    room(b, size);
    uint8_t *out = b->buf + b->len;
    if (s) {
        assert_int_equal(td_state_record_encode_next(s, now, replaces, out), size);
        td_state_record_written(s, replaces);
    } else {
        td_state_record_encode_removed(name, len, out);
    }
    b->len += size;
    return out[12];
}

/* Applies a published batch to t at now: every record applied. */
static void apply(td_streams_t *t, const uint8_t *buf, size_t len, uint64_t now)
{
    static td_state_record_t rec;
    for (size_t at = 0; at < len;) {
        size_t size = td_state_record_check(buf + at, len - at);
        assert_true(size > 0);
        char why[160] = "";
        if (!td_state_record_parse(buf + at, size, &rec, why, sizeof why))
            fail_msg("record at %zu: %s", at, why);
        unsigned dropped = 0;
        if (td_state_record_apply(t, &rec, now, &dropped, why, sizeof why) != TD_STATE_APPLIED)
            fail_msg("record at %zu not applied: %s", at, why);
        at += size;
    }
}

/* The ring's slots in a record (its last part: u32 M at ring). */
static uint32_t slots_in(const uint8_t *rec, size_t size)
{
    static td_state_record_t r;
    char why[160];
    assert_true(td_state_record_parse(rec, size, &r, why, sizeof why));
    return r.ring_len ? tally_get_u32(r.ring) : 0;
}

static td_streams_t *table(void)
{
    td_streams_t *t = NULL;
    assert_int_equal(td_streams_new(1000, &t), TD_OK);
    td_streams_set_window(t, INTERVALS, MS);
    return t;
}

/* A hist batch of n bytes of value v (u8) or of spread values (other dtypes) on s at now. */
static void hist(td_stream_t *s, uint8_t dtype, uint64_t seed, uint64_t now)
{
    static uint64_t bins[TALLY_HIST_VALUES_MAX];
    memset(bins, 0, sizeof bins);
    unsigned channels = tally_hist_channels(dtype);
    uint64_t n = 1 + seed % 50, under = 0, over = 0;
    bool ranged = tally_hist_ranged(dtype);
    if (ranged) {
        under = seed % 3;
        over = (seed >> 8) % 2;
    }
    for (unsigned c = 0; c < channels; c++)
        for (uint64_t i = 0; i < n; i++)
            bins[c * TALLY_HIST_BINS + (seed * 31 + i * 7 + c) % 256]++;
    char msg[160];
    assert_int_equal(td_stream_add_hist(s, dtype, 0, ranged ? 1000 : 0, bins, under,
                                        over, n + under + over, now, msg, sizeof msg),
                     TALLY_OK);
    s->info.elements += n + under + over; /* what td_request_apply counts beside */
    s->info.batches++;
    s->info.bytes += n;
    td_stream_changed(s);
}

static td_stream_t *get(td_streams_t *t, const char *name)
{
    td_stream_t *s = NULL;
    assert_int_equal(td_streams_get(t, name, strlen(name), &s), TALLY_OK);
    s->life = TD_STREAM_LIVE;
    return s;
}

/* Every stream of a is in b and the other way round, each with the same whole record at now. */
static void assert_same_streams(td_streams_t *a, td_streams_t *b, uint64_t now)
{
    assert_int_equal(td_streams_count(a), td_streams_count(b));
    for (td_stream_t *x = td_streams_first(a); x; x = td_streams_next(a, x)) {
        td_stream_t *y = td_streams_find(b, x->name, x->name_len);
        if (!y)
            fail_msg("stream %.*s missing", (int)x->name_len, x->name);
        size_t n = td_state_record_encode(x, now, NULL);
        uint8_t *rx = malloc(n), *ry = malloc(n);
        assert_int_equal(td_state_record_encode(y, now, NULL), n);
        td_state_record_encode(x, now, rx);
        td_state_record_encode(y, now, ry);
        if (memcmp(rx, ry, n) != 0)
            fail_msg("stream %.*s differs", (int)x->name_len, x->name);
        free(rx);
        free(ry);
    }
}

/* ---- 1. the records' shapes ------------------------------------------------------------------ */

static void test_record_shapes(void **state)
{
    (void)state;
    td_streams_t *w = table(), *r = table();
    batch_t b = {0};
    td_stream_t *s = get(w, "cam0");
    uint64_t now = T0;
    /* six writes, each in an interval of its own, each published alone */
    for (int i = 0; i < 6; i++, now += MS) {
        hist(s, TALLY_DTYPE_U8, (uint64_t)i, now);
        uint8_t kind = hold(&b, s, "cam0", now);
        assert_int_equal(kind, i == 0 ? TD_STATE_RECORD_STREAM : TD_STATE_RECORD_CHANGED);
        assert_int_equal(slots_in(b.buf, b.len), 1); /* the ring holds i + 1 */
        apply(r, b.buf, b.len, now);
        b.len = 0;
        assert_same_streams(w, r, now);
    }
    /* two writes before the batch goes out: one record, both writes' slots */
    hist(s, TALLY_DTYPE_U8, 10, now);
    hold(&b, s, "cam0", now);
    now += MS;
    hist(s, TALLY_DTYPE_U8, 11, now);
    assert_int_equal(hold(&b, s, "cam0", now), TD_STATE_RECORD_CHANGED);
    assert_int_equal(td_state_record_check(b.buf, b.len), b.len); /* one record */
    assert_int_equal(slots_in(b.buf, b.len), 2);
    apply(r, b.buf, b.len, now);
    b.len = 0;
    assert_same_streams(w, r, now);
    assert_int_equal(td_window_slots(td_streams_find(r, "cam0", 4)->window), INTERVALS);
    /* a reset: the whole ring, empty; then a write: one slot again */
    td_stream_zero(s);
    assert_int_equal(hold(&b, s, "cam0", now), TD_STATE_RECORD_STREAM);
    assert_int_equal(slots_in(b.buf, b.len), 0);
    hist(s, TALLY_DTYPE_U8, 12, now);
    assert_int_equal(hold(&b, s, "cam0", now), TD_STATE_RECORD_STREAM); /* replaces the reset's */
    assert_int_equal(slots_in(b.buf, b.len), 1);
    apply(r, b.buf, b.len, now);
    b.len = 0;
    assert_same_streams(w, r, now);
    assert_int_equal(td_window_slots(td_streams_find(r, "cam0", 4)->window), 1);
    /* a delete, then a new stream of the name: its first record whole */
    td_streams_remove(w, &s);
    assert_int_equal(hold(&b, NULL, "cam0", now), TD_STATE_RECORD_REMOVED);
    s = get(w, "cam0");
    hist(s, TALLY_DTYPE_RGB8, 13, now);
    assert_int_equal(hold(&b, s, "cam0", now), TD_STATE_RECORD_STREAM);
    apply(r, b.buf, b.len, now);
    b.len = 0;
    assert_same_streams(w, r, now);
    /* a kind 3 record to a table without the stream makes it, with the record's slots */
    now += MS;
    hist(s, TALLY_DTYPE_RGB8, 14, now);
    assert_int_equal(hold(&b, s, "cam0", now), TD_STATE_RECORD_CHANGED);
    td_streams_t *fresh = table();
    apply(fresh, b.buf, b.len, now);
    const td_stream_t *made = td_streams_find(fresh, "cam0", 4);
    assert_non_null(made);
    assert_int_equal(td_window_slots(made->window), 1);
    assert_int_equal(made->info.hist_total, s->info.hist_total);
    free(b.buf);
    td_streams_destroy(&fresh);
    td_streams_destroy(&w);
    td_streams_destroy(&r);
}

/* ---- 2. random writes, two readers ------------------------------------------------------------ */

static uint64_t rng;

static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

#define STREAMS 6
#define STEPS 600

static const uint8_t dtypes[STREAMS] = {TALLY_DTYPE_U8,  TALLY_DTYPE_U8,   TALLY_DTYPE_I32,
                                        TALLY_DTYPE_U16, TALLY_DTYPE_RGB8, TALLY_DTYPE_RGBA8};

/* The published batches, in order (a changelog). */
typedef struct {
    batch_t msgs[STEPS + 1];
    unsigned n;
} log_t;

static void publish(log_t *log, batch_t *b)
{
    if (!b->len)
        return;
    log->msgs[log->n++] = *b;
    *b = (batch_t){0};
}

static void random_run(uint64_t seed, unsigned *changed_records)
{
    rng = seed;
    td_streams_t *w = table(), *standby = table();
    static log_t log;
    memset(&log, 0, sizeof log);
    batch_t b = {0};
    uint64_t now = T0 + next_rand() % MS;
    unsigned ckpt_step = (unsigned)(next_rand() % STEPS), ckpt_from = 0;
    uint8_t *ckpt = NULL;
    size_t ckpt_len = 0;
    for (unsigned step = 0; step < STEPS; step++) {
        if (step == ckpt_step) { /* the writer's state now, its waiting records' effects too */
            assert_int_equal(td_state_encode(w, now, 1, &ckpt, &ckpt_len), TD_OK);
            ckpt_from = log.n;
        }
        unsigned k = (unsigned)(next_rand() % STREAMS), what = (unsigned)(next_rand() % 100);
        char name[16];
        snprintf(name, sizeof name, "s%u", k);
        td_stream_t *s = td_streams_find(w, name, strlen(name));
        if (what < 4 && s) { /* delete */
            td_streams_remove(w, &s);
            hold(&b, NULL, name, now);
        } else if (what < 8 && s) { /* reset */
            td_stream_zero(s);
            hold(&b, s, name, now);
        } else {
            s = s ? s : get(w, name);
            hist(s, dtypes[k], next_rand(), now);
            *changed_records += hold(&b, s, name, now) == TD_STATE_RECORD_CHANGED;
        }
        if (next_rand() % 4 == 0) {
            publish(&log, &b);
            apply(standby, log.msgs[log.n - 1].buf, log.msgs[log.n - 1].len, now);
        }
        if (next_rand() % 8 == 0)
            now += next_rand() % (3 * MS); /* forward by up to 3 intervals */
    }
    if (b.len) {
        publish(&log, &b);
        apply(standby, log.msgs[log.n - 1].buf, log.msgs[log.n - 1].len, now);
    }
    assert_same_streams(w, standby, now);
    /* the next owner: the checkpoint, then every batch stored after it */
    td_streams_t *next = table();
    td_state_report_t report;
    char msg[256] = "";
    assert_int_equal(td_state_decode(ckpt, ckpt_len, now, next, &report, msg, sizeof msg), TD_OK);
    for (unsigned i = ckpt_from; i < log.n; i++)
        apply(next, log.msgs[i].buf, log.msgs[i].len, now);
    assert_same_streams(w, next, now);
    for (unsigned i = 0; i < log.n; i++)
        free(log.msgs[i].buf);
    free(b.buf);
    free(ckpt);
    td_streams_destroy(&w);
    td_streams_destroy(&standby);
    td_streams_destroy(&next);
}

static void test_random_writes_two_readers(void **state)
{
    (void)state;
    unsigned changed = 0;
    for (uint64_t seed = 1; seed <= 40; seed++)
        random_run(0x9e3779b97f4a7c15ull * seed, &changed);
    print_message("%u kind 3 records applied\n", changed);
    assert_true(changed > 40 * STEPS / 4); /* most records are a ring's changes */
}

/* ---- 3. what a kind 3 record may not be -------------------------------------------------------- */

static void test_changed_needs_a_ring(void **state)
{
    (void)state;
    td_streams_t *w = table();
    batch_t b = {0};
    td_stream_t *s = get(w, "cam0");
    hist(s, TALLY_DTYPE_U8, 1, T0);
    hold(&b, s, "cam0", T0);
    b.len = 0;
    hist(s, TALLY_DTYPE_U8, 2, T0);
    assert_int_equal(hold(&b, s, "cam0", T0), TD_STATE_RECORD_CHANGED);
    static td_state_record_t rec;
    char why[160] = "";
    assert_true(td_state_record_parse(b.buf, b.len, &rec, why, sizeof why));
    /* its ring cut off and its interval 0: well formed as kind 1 would be, refused as kind 3 */
    size_t interval_at = TD_STATE_RECORD_NAME_OFF + 4 + TALLY_STREAM_INFO_HEAD_SIZE;
    size_t size = b.len - rec.ring_len;
    tally_put_u32(b.buf + interval_at, 0);
    tally_put_u32(b.buf + 8, (uint32_t)size);
    tally_put_u32(b.buf + 4, td_state_crc(b.buf + 8, size - 8));
    assert_int_equal(td_state_record_check(b.buf, size), size);
    assert_false(td_state_record_parse(b.buf, size, &rec, why, sizeof why));
    assert_string_equal(why, "a ring's changes (kind 3) without a ring");
    b.buf[12] = TD_STATE_RECORD_STREAM; /* the same bytes as kind 1: a stream without a ring */
    tally_put_u32(b.buf + 4, td_state_crc(b.buf + 8, size - 8));
    assert_true(td_state_record_parse(b.buf, size, &rec, why, sizeof why));
    free(b.buf);
    td_streams_destroy(&w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_record_shapes),
        cmocka_unit_test(test_random_writes_two_readers),
        cmocka_unit_test(test_changed_needs_a_ring),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
