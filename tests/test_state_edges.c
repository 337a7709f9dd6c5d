/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_state_edges.c — what a state record may not claim, at the exact edges test_state.c and
 * test_compact.c pass by (issue 37: mutants of these checks survived them):
 *   - a stream that scanned nothing has no scan carry: a carry of 1 or -1 is refused as surely
 *     as one of 5 (td_state_check_info), and 0 is fine;
 *   - a saved window ring lists its slots oldest first, each interval once: two slots of one
 *     interval, or two in the wrong order, make the ring invalid (nothing restored), where the
 *     same slots in order restore (td_window_decode); a record cut short, or decoded into a ring
 *     that holds slots already, is refused too; version 3's fixed-size slots likewise (an
 *     interval twice, a slot whose bins do not add up to its total);
 *   - a ring is made only with intervals, an interval length and 1..4 channels;
 *   - a window query longer than the time since the epoch of the clock sums from 0;
 *   - a saved slot whose bins do not add up or do not decode invalidates the ring; one of another
 *     interval length, or from the future of a clock that stepped back, is dropped (the rest
 *     restored);
 *   - the test clock file: its milliseconds, 0 while it is missing or empty.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "td_state_record.h"
#include "td_window.h"

static void test_carry_without_scans_refused(void **state)
{
    (void)state;
    tally_stream_info_t info;
    memset(&info, 0, sizeof info);
    char why[160];
    assert_true(td_state_check_info(&info, why, sizeof why)); /* an empty stream */
    const int64_t carries[] = {1, -1, 5, INT64_MIN};
    for (size_t i = 0; i < sizeof carries / sizeof carries[0]; i++) {
        info.scan_carry = carries[i];
        why[0] = '\0';
        assert_false(td_state_check_info(&info, why, sizeof why));
        assert_true(why[0] != '\0');
    }
    info.scan_carry = -7; /* with scanned elements, any carry */
    info.scan_elements = info.elements = 3;
    info.batches = 1;
    assert_true(td_state_check_info(&info, why, sizeof why));
}

#define INTERVALS 60
#define MS 1000

/* The record of a ring holding one batch of `n` at interval `at` (ms): its length; the slot's
 * bytes (the record less its 4-byte count) at *slot. */
static size_t one_slot(uint64_t at_ms, uint64_t n, uint8_t *rec, size_t cap)
{
    td_window_t *w = td_window_new(INTERVALS, MS, 1);
    assert_non_null(w);
    uint64_t bins[256] = {0};
    bins[7] = n;
    assert_true(td_window_add(w, at_ms, bins, 0, 0, n));
    size_t len = td_window_encode(w, at_ms, NULL);
    assert_true(len <= cap);
    td_window_encode(w, at_ms, rec);
    td_window_destroy(&w);
    return len;
}

/* A two-slot record of slots a and b in that order; decoded at now_ms: what decode returned. */
static size_t decode_pair(const uint8_t *a, size_t alen, const uint8_t *b, size_t blen,
                          uint64_t now_ms, unsigned *slots)
{
    uint8_t rec[4096];
    assert_true(4 + alen + blen <= sizeof rec);
    tally_put_u32(rec, 2);
    memcpy(rec + 4, a, alen);
    memcpy(rec + 4 + alen, b, blen);
    td_window_t *back = td_window_new(INTERVALS, MS, 1);
    unsigned dropped = 0;
    bool nomem = false;
    size_t got = td_window_decode(back, now_ms, MS, rec, 4 + alen + blen, &dropped, &nomem);
    assert_false(nomem);
    *slots = td_window_slots(back);
    td_window_destroy(&back);
    return got;
}

static void test_ring_slots_in_order_once(void **state)
{
    (void)state;
    uint64_t t = 1000000;
    uint8_t r1[2048], r2[2048];
    size_t l1 = one_slot(t, 3, r1, sizeof r1) - 4, l2 = one_slot(t + MS, 4, r2, sizeof r2) - 4;
    unsigned slots = 99;
    /* In order: both restored. */
    assert_int_equal(decode_pair(r1 + 4, l1, r2 + 4, l2, t + MS, &slots), 4 + l1 + l2);
    assert_int_equal(slots, 2);
    /* One interval twice, or out of order: invalid, nothing restored. */
    assert_int_equal(decode_pair(r1 + 4, l1, r1 + 4, l1, t + MS, &slots), 0);
    assert_int_equal(slots, 0);
    assert_int_equal(decode_pair(r2 + 4, l2, r1 + 4, l1, t + MS, &slots), 0);
    assert_int_equal(slots, 0);
}

static void test_ring_records_refused(void **state)
{
    (void)state;
    uint64_t t = 1000000;
    uint8_t rec[2048];
    size_t len = one_slot(t, 3, rec, sizeof rec);
    td_window_t *back = td_window_new(INTERVALS, MS, 1);
    unsigned dropped = 0;
    bool nomem = false;
    assert_int_equal(td_window_decode(back, t, MS, rec, 3, &dropped, &nomem), 0); /* < count */
    tally_put_u32(rec, 2); /* two slots announced, one there */
    assert_int_equal(td_window_decode(back, t, MS, rec, len, &dropped, &nomem), 0);
    assert_int_equal(td_window_slots(back), 0);
    tally_put_u32(rec, 1);
    assert_int_equal(td_window_decode(back, t, MS, rec, len, &dropped, &nomem), len);
    assert_int_equal(td_window_decode(back, t, MS, rec, len, &dropped, &nomem), 0); /* not empty */
    assert_int_equal(td_window_slots(back), 1);
    td_window_destroy(&back);

    /* A slot of another interval length, or from the future of a clock that stepped back since
     * it was saved: dropped, the rest restored. Bins that do not add up to the slot's total, or
     * that do not decode (cut): the ring is invalid. */
    back = td_window_new(INTERVALS, MS, 1);
    assert_int_equal(td_window_decode(back, t - 5 * MS, MS, rec, len, &dropped, &nomem), len);
    assert_int_equal(dropped, 1);
    assert_int_equal(td_window_decode(back, t, 2 * MS, rec, len, &dropped, &nomem), len);
    assert_int_equal(dropped, 1);
    assert_int_equal(td_window_slots(back), 0);
    tally_put_u64(rec + 4 + 24, 4); /* the total: one more than the bins hold */
    assert_int_equal(td_window_decode(back, t, MS, rec, len, &dropped, &nomem), 0);
    tally_put_u64(rec + 4 + 24, 3);
    assert_int_equal(td_window_decode(back, t, MS, rec, 4 + 32, &dropped, &nomem), 0); /* no bins */
    assert_int_equal(td_window_slots(back), 0);
    assert_int_equal(td_window_decode(back, t, MS, rec, len, &dropped, &nomem), len);
    assert_int_equal(dropped, 0);
    assert_int_equal(td_window_slots(back), 1);
    assert_false(nomem);
    td_window_destroy(&back);
}

/* Version 3's slot: interval, underflow, overflow, total, then 256 bins. */
static void put_v3(uint8_t *p, uint64_t interval, uint64_t total, uint64_t bin7)
{
    memset(p, 0, td_window_slot_size_v3(1));
    tally_put_u64(p, interval);
    tally_put_u64(p + 24, total);
    tally_put_u64(p + TD_WINDOW_SLOT_HEADER + 8 * 7, bin7);
}

static void test_v3_ring_refused(void **state)
{
    (void)state;
    size_t size = td_window_slot_size_v3(1);
    uint8_t *in = calloc(2, size);
    assert_non_null(in);
    uint64_t t = 1000000, now = t / MS;
    td_window_t *w = td_window_new(INTERVALS, MS, 1);
    put_v3(in, now - 1, 4, 4);
    put_v3(in + size, now, 5, 5);
    assert_int_equal(td_window_decode_v3(w, t, MS, in, 2), 0); /* both placed */
    assert_int_equal(td_window_slots(w), 2);
    td_window_destroy(&w);
    w = td_window_new(INTERVALS, MS, 1);
    put_v3(in + size, now - 1, 5, 5); /* the same interval twice */
    assert_int_equal(td_window_decode_v3(w, t, MS, in, 2), -1);
    put_v3(in + size, now, 6, 5); /* a total its bins do not make */
    assert_int_equal(td_window_decode_v3(w, t, MS, in, 2), -1);
    assert_int_equal(td_window_slots(w), 0);
    td_window_destroy(&w);
    free(in);
}

static void test_ring_made_only_when_valid(void **state)
{
    (void)state;
    assert_null(td_window_new(0, MS, 1));
    assert_null(td_window_new(INTERVALS, 0, 1));
    assert_null(td_window_new(INTERVALS, MS, 0));
    assert_null(td_window_new(INTERVALS, MS, TALLY_HIST_CHANNELS_MAX + 1));
    td_window_t *w = td_window_new(INTERVALS, MS, TALLY_HIST_CHANNELS_MAX);
    assert_non_null(w);
    td_window_destroy(&w);
    /* A clock 2.5 intervals after the epoch: a query of 10 intervals sums the 3 there are, from
     * 0. */
    w = td_window_new(INTERVALS, MS, 1);
    uint64_t bins[256] = {0};
    bins[1] = 2;
    assert_true(td_window_add(w, 500, bins, 0, 0, 2));
    assert_true(td_window_add(w, 2500, bins, 0, 0, 2));
    tally_stream_info_t info;
    assert_int_equal(td_window_sum(w, 2500, 10, &info), 0);
    assert_int_equal(info.hist_total, 4);
    assert_int_equal(td_window_sum(w, 2500, 2, &info), MS); /* intervals 1 and 2 */
    assert_int_equal(info.hist_total, 2);
    td_window_destroy(&w);
}

/* The test clock (--test-clock FILE): the milliseconds the file holds; 0 while the file is
 * missing or empty (a test writing it anew). */
static void test_clock_file(void **state)
{
    (void)state;
    char path[] = "/tmp/tally-clock-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    td_clock_set_test_file(path);
    assert_int_equal(td_clock_ms(), 0); /* empty */
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("123456\n", f);
    fclose(f);
    assert_int_equal(td_clock_ms(), 123456);
    assert_int_equal(unlink(path), 0);
    assert_int_equal(td_clock_ms(), 0); /* missing */
    td_clock_set_test_file(NULL);
    assert_true(td_clock_ms() > 1700000000000ull); /* the wall clock again */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_carry_without_scans_refused),
        cmocka_unit_test(test_ring_slots_in_order_once),
        cmocka_unit_test(test_ring_records_refused),
        cmocka_unit_test(test_v3_ring_refused),
        cmocka_unit_test(test_ring_made_only_when_valid),
        cmocka_unit_test(test_clock_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
