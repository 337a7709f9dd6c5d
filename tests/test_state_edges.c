/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_state_edges.c — what a state record may not claim, at the exact edges test_state.c and
 * test_compact.c pass by (issue 37: mutants of these checks survived them):
 *   - a stream that scanned nothing has no scan carry: a carry of 1 or -1 is refused as surely
 *     as one of 5 (td_state_check_info), and 0 is fine;
 *   - a saved window ring lists its slots oldest first, each interval once: two slots of one
 *     interval, or two in the wrong order, make the ring invalid (nothing restored), where the
 *     same slots in order restore (td_window_decode).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_carry_without_scans_refused),
        cmocka_unit_test(test_ring_slots_in_order_once),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
