/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_compact.c — the compact forms of stream state (issue 26) against plain dense
 * references, over random data:
 *   - td_bins (a histogram's counts in the narrowest width, sparse while few bins are used)
 *     against a u64 array: every count after every add, through widening at the 2^8, 2^16 and
 *     2^32 boundaries and wrapping at 2^64, sparse -> dense transitions, its encoded form round
 *     trip, and the encodings it refuses;
 *   - td_window (only the intervals with data) against the dense ring tallyd kept before (one
 *     u64 slot per ring position, tagged with its interval), with the clock moving forward,
 *     jumping past the whole ring, and stepping back: every window sum, intervals expiring at a
 *     write and at a sweep, reset, and the state record's form round trip.
 *   - td_stream's byte accounting (every stream's bytes, the table's sum and each client's share
 *     agree after random creations, hists, resets, deletes and sweeps) and the memory budget (a
 *     creation or a hist past max_state_bytes or the client's share is refused with `limit` or
 *     `client_streams` and changes nothing).
 * Set TALLY_TEST_SEED to replay a run.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "harness.h"
#include "reference.h"
#include "tally_proto.h"
#include "td_bins.h"
#include "td_peers.h"
#include "td_stream.h"
#include "td_window.h"

static const size_t value_counts[] = {256, 768, 1024}; /* one, three and four channels */

static uint8_t width_for(uint64_t v)
{
    return v <= UINT8_MAX ? 1 : v <= UINT16_MAX ? 2 : v <= UINT32_MAX ? 4 : 8;
}

/* A random batch histogram of `values` counts in one of several shapes: nothing, a few bins,
 * every bin, one bin pushed to just below or at a width boundary, a huge count that wraps. */
static void random_batch(uint64_t *add, size_t values, const uint64_t *have)
{
    memset(add, 0, values * sizeof *add);
    switch (th_rand() % 8) {
    case 0:
        break;
    case 1:
    case 2:
        for (int k = 1 + (int)(th_rand() % 8); k > 0; k--)
            add[th_rand() % values] += 1 + th_rand() % 5;
        break;
    case 3:
    case 4:
        for (size_t i = 0; i < values; i++)
            add[i] = th_rand() % 6;
        break;
    case 5: { /* a bin to a boundary: 2^8, 2^16, 2^32 (or one below) */
        static const uint64_t edges[] = {1ull << 8, 1ull << 16, 1ull << 32};
        size_t b = th_rand() % values;
        uint64_t target = edges[th_rand() % 3] - (th_rand() % 2);
        add[b] = target > have[b] ? target - have[b] : 1;
        break;
    }
    case 6: /* many bins a little */
        for (size_t i = 0; i < values; i += 1 + th_rand() % 5)
            add[i] = 1 + th_rand() % 300;
        break;
    default: /* past 2^64: wraps like the u64 counter */
        add[th_rand() % values] = UINT64_MAX - th_rand() % 4;
        break;
    }
}

/* b holds exactly ref, and its encoded form decodes to ref too. */
static void assert_bins_equal(const td_bins_t *b, size_t values, const uint64_t *ref)
{
    static uint64_t got[TALLY_HIST_VALUES_MAX], acc[TALLY_HIST_VALUES_MAX];
    static uint8_t enc[4 + TALLY_HIST_VALUES_MAX * 10];
    td_bins_get(b, values, got);
    assert_memory_equal(got, ref, values * sizeof *ref);
    for (size_t i = 0; i < values; i++)
        acc[i] = i;
    td_bins_accumulate(b, values, acc);
    for (size_t i = 0; i < values; i++)
        assert_true(acc[i] == ref[i] + i);
    size_t len = td_bins_encode(b, values, NULL);
    assert_true(len <= sizeof enc);
    assert_int_equal(td_bins_encode(b, values, enc), len);
    assert_int_equal(td_bins_decode(enc, len, values, got), len);
    assert_memory_equal(got, ref, values * sizeof *ref);
    assert_int_equal(td_bins_decode(enc, len - 1, values, got), 0); /* one byte short */
}

/* b += add through a plan told that no addend passes add_max (a hist batch's element count). */
static void add_bounded(td_bins_t *b, size_t values, const uint64_t *add, uint64_t add_max)
{
    td_bins_plan_t plan;
    td_bins_plan(b, values, add, add_max, &plan);
    assert_true(td_bins_prepare(&plan));
    td_bins_commit(b, values, add, &plan);
}

/* Random adds against a u64 array: counts equal after every one; the width is the narrowest
 * for the largest count stored so far; bytes are what the form says. A second histogram is
 * given each batch with its largest addend as the bound the plan may use instead of reading the
 * addends (a batch's element count, td_stream.c): the same counts and width. */
static void test_bins_against_dense(void **state)
{
    (void)state;
    static uint64_t ref[TALLY_HIST_VALUES_MAX], add[TALLY_HIST_VALUES_MAX];
    for (int run = 0; run < 300; run++) {
        size_t values = value_counts[run % 3];
        td_bins_t b = {0}, bounded = {0};
        memset(ref, 0, sizeof ref);
        uint64_t max_seen = 0;
        bool was_dense = false;
        for (int step = 0; step < 40; step++) {
            random_batch(add, values, ref);
            size_t used = 0;
            for (size_t i = 0; i < values; i++) {
                ref[i] += add[i];
                max_seen = ref[i] > max_seen ? ref[i] : max_seen;
                used += ref[i] != 0;
            }
            assert_true(td_bins_add(&b, values, add));
            assert_bins_equal(&b, values, ref);
            assert_int_equal(b.width, max_seen ? width_for(max_seen) : 0);
            uint64_t add_max = 0;
            for (size_t i = 0; i < values; i++)
                add_max = add[i] > add_max ? add[i] : add_max;
            add_bounded(&bounded, values, add, add_max);
            assert_bins_equal(&bounded, values, ref);
            assert_int_equal(bounded.width, b.width);
            if (!b.width)
                continue;
            assert_false(was_dense && b.sparse); /* forms only grow */
            was_dense |= !b.sparse;
            size_t bytes = b.sparse ? (size_t)b.cap * (2u + b.width) : values * b.width;
            assert_int_equal(td_bins_bytes(&b), bytes);
            assert_true(bytes <= values * b.width); /* never more than dense */
            if (b.sparse)
                assert_true(b.used == used && b.cap >= used);
        }
        td_bins_clear(&b);
        td_bins_clear(&bounded);
        assert_int_equal(td_bins_bytes(&b), 0);
        assert_null(b.data);
    }
}

/* One bin through every width boundary, one step at a time. */
static void test_bins_widen_at_each_boundary(void **state)
{
    (void)state;
    static uint64_t add[256], ref[256];
    static const struct {
        uint64_t to;
        uint8_t width;
    } steps[] = {{255, 1},         {256, 2},         {65535, 2}, {65536, 4}, {UINT32_MAX, 4},
                 {1ull << 32, 8}, {UINT64_MAX, 8}};
    td_bins_t b = {0};
    memset(ref, 0, sizeof ref);
    for (size_t k = 0; k < sizeof steps / sizeof steps[0]; k++) {
        memset(add, 0, sizeof add);
        add[17] = steps[k].to - ref[17];
        ref[17] = steps[k].to;
        assert_true(td_bins_add(&b, 256, add));
        assert_int_equal(b.width, steps[k].width);
        assert_true(b.sparse);
        assert_bins_equal(&b, 256, ref);
    }
    memset(add, 0, sizeof add); /* UINT64_MAX + 2 wraps to 1, in the same width */
    add[17] = 2;
    ref[17] = 1;
    assert_true(td_bins_add(&b, 256, add));
    assert_int_equal(b.width, 8);
    assert_bins_equal(&b, 256, ref);
    td_bins_clear(&b);
}

/* Bins filled one by one: sparse while the pairs take at most half of dense (42 u8 bins of 256,
 * 64 u16 ones), dense from the next; a wider count later keeps it dense. */
static void test_bins_sparse_to_dense(void **state)
{
    (void)state;
    static uint64_t add[256], ref[256];
    td_bins_t b = {0};
    memset(ref, 0, sizeof ref);
    for (size_t i = 0; i < 256; i++) {
        memset(add, 0, sizeof add);
        add[(i * 7) % 256] = 1;
        ref[(i * 7) % 256] = 1;
        assert_true(td_bins_add(&b, 256, add));
        assert_bins_equal(&b, 256, ref);
        assert_int_equal(b.sparse, i + 1 <= 42);
        if (i + 1 == 42)
            assert_int_equal(td_bins_bytes(&b), 42 * 3);
    }
    assert_int_equal(td_bins_bytes(&b), 256);
    memset(add, 0, sizeof add);
    add[3] = 1000;
    ref[3] += 1000;
    assert_true(td_bins_add(&b, 256, add));
    assert_false(b.sparse);
    assert_int_equal(b.width, 2);
    assert_int_equal(td_bins_bytes(&b), 512);
    assert_bins_equal(&b, 256, ref);
    /* Wider counts from the start allow more pairs: 64 u16 bins stay sparse, 65 do not. */
    td_bins_clear(&b);
    memset(ref, 0, sizeof ref);
    for (size_t i = 0; i < 65; i++) {
        memset(add, 0, sizeof add);
        add[i] = 300;
        ref[i] = 300;
        assert_true(td_bins_add(&b, 256, add));
        assert_int_equal(b.sparse, i + 1 <= 64);
        assert_bins_equal(&b, 256, ref);
    }
    td_bins_clear(&b);
}

/* A plan that is prepared and then aborted changes nothing; td_bins_set picks the narrowest
 * form for what it is given. */
static void test_bins_plan_abort_and_set(void **state)
{
    (void)state;
    static uint64_t add[256], ref[256];
    td_bins_t b = {0};
    memset(ref, 0, sizeof ref);
    ref[9] = 5;
    assert_true(td_bins_set(&b, 256, ref));
    assert_true(b.sparse && b.width == 1);
    for (size_t i = 0; i < 256; i++)
        add[i] = 70000;
    td_bins_plan_t plan;
    td_bins_plan(&b, 256, add, UINT64_MAX, &plan);
    assert_true(plan.fresh && !plan.sparse && plan.width == 4);
    assert_int_equal(plan.bytes, 1024);
    assert_true(td_bins_prepare(&plan));
    td_bins_abort(&plan);
    assert_bins_equal(&b, 256, ref);
    assert_true(b.sparse && b.width == 1);
    for (size_t i = 0; i < 256; i++)
        ref[i] = i * 1000;
    assert_true(td_bins_set(&b, 256, ref));
    assert_true(!b.sparse && b.width == 4);
    assert_bins_equal(&b, 256, ref);
    memset(ref, 0, sizeof ref);
    assert_true(td_bins_set(&b, 256, ref));
    assert_int_equal(b.width, 0);
    assert_null(b.data);
    td_bins_clear(&b);
}

/* Encodings that are not one td_bins_encode writes are refused. */
static void test_bins_decode_refuses(void **state)
{
    (void)state;
    static uint64_t out[256];
    uint8_t bad_width[4 + 256 * 3] = {3, 0, 0, 0};
    assert_int_equal(td_bins_decode(bad_width, sizeof bad_width, 256, out), 0);
    uint8_t bad_form[8] = {1, 2, 1, 0, 5, 0, 7};
    assert_int_equal(td_bins_decode(bad_form, sizeof bad_form, 256, out), 0);
    /* sparse, two pairs: bins 5 and 9, counts 1 and 2 (valid), then each way of breaking it */
    uint8_t ok[4 + 2 * 3] = {1, 1, 2, 0, 5, 0, 9, 0, 1, 2};
    assert_int_equal(td_bins_decode(ok, sizeof ok, 256, out), sizeof ok);
    assert_true(out[5] == 1 && out[9] == 2);
    uint8_t copy[sizeof ok];
    memcpy(copy, ok, sizeof ok);
    copy[6] = 5; /* bins not increasing */
    assert_int_equal(td_bins_decode(copy, sizeof copy, 256, out), 0);
    memcpy(copy, ok, sizeof ok);
    copy[9] = 0; /* a zero count */
    assert_int_equal(td_bins_decode(copy, sizeof copy, 256, out), 0);
    memcpy(copy, ok, sizeof ok);
    copy[7] = 1; /* bin 265 of 256 */
    assert_int_equal(td_bins_decode(copy, sizeof copy, 256, out), 0);
    memcpy(copy, ok, sizeof ok);
    copy[2] = 0; /* sparse with no pairs */
    assert_int_equal(td_bins_decode(copy, sizeof copy, 256, out), 0);
    uint8_t dense_pairs[4 + 256] = {1, 0, 1, 0}; /* dense that claims pairs */
    assert_int_equal(td_bins_decode(dense_pairs, sizeof dense_pairs, 256, out), 0);
    uint8_t empty[1] = {0};
    assert_int_equal(td_bins_decode(empty, 1, 256, out), 1);
}

/* ---- the window ring against the dense ring --------------------------------------------- */

/* The reference is tests/lib/reference.c's ring (tr_window_t): the ring tallyd kept before
 * issue 26, one dense slot per ring position tagged with its interval, plus the rule the compact
 * ring adds: a slot the ring no longer reaches is dropped at a write and at a sweep. */
#define REF_INTERVALS 8
#define REF_MS 1000

/* Every window sum (k = 1..8) of w equals the reference's at now_ms. */
static void assert_sums_equal(const td_window_t *w, const tr_window_t *r, uint64_t now_ms)
{
    static tally_stream_info_t a, b;
    for (unsigned k = 1; k <= REF_INTERVALS + 1; k++) {
        memset(&a, 0xA5, sizeof a);
        memset(&b, 0xA5, sizeof b);
        assert_true(td_window_sum(w, now_ms, k, &a) == tr_window_sum(r, now_ms, k, &b));
        assert_memory_equal(&a, &b, sizeof a);
    }
}

/* The clock's next step: mostly within an interval or to the next, sometimes past the whole
 * ring, sometimes back (less than a ring, or more). */
static uint64_t next_time(uint64_t now)
{
    switch (th_rand() % 10) {
    case 0:
        return now + REF_MS * (REF_INTERVALS + th_rand() % (3 * REF_INTERVALS));
    case 1:
        return now - (th_rand() % (REF_MS * 3));
    case 2:
        return now - REF_MS * (REF_INTERVALS + th_rand() % REF_INTERVALS);
    default:
        return now + th_rand() % (REF_MS * 3 / 2);
    }
}

/* The ring's state record round trip: decoded into a fresh ring at the same clock, every window
 * sum is the same. */
static void assert_record_round_trip(const td_window_t *w, const tr_window_t *r, unsigned channels,
                                     uint64_t now_ms)
{
    static uint8_t rec[REF_INTERVALS * (32 + 4 + 8 * TALLY_HIST_VALUES_MAX) + 4];
    size_t len = td_window_encode(w, now_ms, NULL);
    assert_true(len <= sizeof rec);
    assert_int_equal(td_window_encode(w, now_ms, rec), len);
    td_window_t *back = td_window_new(REF_INTERVALS, REF_MS, channels);
    unsigned dropped = 1;
    bool nomem = true;
    assert_int_equal(td_window_decode(back, now_ms, REF_MS, rec, len, &dropped, &nomem), len);
    assert_int_equal(dropped, 0);
    assert_false(nomem);
    assert_sums_equal(back, r, now_ms);
    td_window_destroy(&back);
}

static void window_run(unsigned channels)
{
    static tr_window_t ref;
    static uint64_t bins[TALLY_HIST_VALUES_MAX], zero[TALLY_HIST_VALUES_MAX];
    tr_window_init(&ref, REF_INTERVALS, REF_MS);
    td_window_t *w = td_window_new(REF_INTERVALS, REF_MS, channels);
    assert_non_null(w);
    size_t values = channels * (size_t)TALLY_HIST_BINS;
    uint64_t now = 1795000000000ull + th_rand() % 100000;
    for (int step = 0; step < 400; step++) {
        now = next_time(now);
        unsigned op = (unsigned)(th_rand() % 20);
        if (op < 14) {
            random_batch(bins, values, zero);
            uint64_t under = th_rand() % 3, over = th_rand() % 3, n = under + over;
            for (size_t b = 0; b < TALLY_HIST_BINS; b++)
                n += bins[b];
            if (n == 0) /* a count that wrapped the total to 0: nothing a batch can do */
                memset(bins, 0, sizeof bins), under = over = 0;
            for (unsigned c = 1; c < channels; c++) /* every channel counts the same elements */
                memcpy(bins + c * TALLY_HIST_BINS, bins, TALLY_HIST_BINS * sizeof *bins);
            assert_true(td_window_add(w, now, bins, under, over, n));
            tr_window_add(&ref, now, bins, values, under, over, n);
        } else if (op < 16) {
            td_window_expire(w, now);
            tr_window_expire(&ref, now);
        } else if (op == 16) {
            td_window_clear(w);
            tr_window_clear(&ref);
            assert_int_equal(td_window_slots(w), 0);
        }
        assert_true(td_window_slots(w) <= REF_INTERVALS);
        assert_sums_equal(w, &ref, now);
        if (step % 10 == 0)
            assert_record_round_trip(w, &ref, channels, now);
    }
    td_window_destroy(&w);
}

static void test_window_against_dense_ring(void **state)
{
    (void)state;
    for (int run = 0; run < 20; run++)
        window_run(run % 4 == 3 ? 4 : run % 4 == 2 ? 3 : 1);
}

/* Memory follows what happened: an empty ring holds no slot; one batch holds one; a slot that
 * has left the ring is freed by a sweep, and the ring's bytes come back to the empty ring's. */
static void test_window_memory_follows_data(void **state)
{
    (void)state;
    static uint64_t bins[256];
    td_window_t *w = td_window_new(60, 1000, 1);
    size_t empty = td_window_bytes(w);
    assert_true(empty < 64);
    memset(bins, 0, sizeof bins);
    bins[3] = 10;
    uint64_t t = 1795000000000ull;
    assert_true(td_window_add(w, t, bins, 0, 0, 10));
    assert_int_equal(td_window_slots(w), 1);
    size_t one = td_window_bytes(w);
    assert_true(one > empty && one < empty + 128);
    for (int k = 1; k < 60; k++)
        assert_true(td_window_add(w, t + 1000ull * (uint64_t)k, bins, 0, 0, 10));
    assert_int_equal(td_window_slots(w), 60);
    td_window_expire(w, t + 60000 + 30 * 1000ull); /* 30 s later: the oldest 31 are gone */
    assert_int_equal(td_window_slots(w), 29);
    td_window_expire(w, t + 3600000);
    assert_int_equal(td_window_slots(w), 0);
    assert_int_equal(td_window_bytes(w), empty);
    /* The record of an empty ring is its count only; decoding slots of another interval
     * length, or too old, drops them. */
    assert_int_equal(td_window_encode(w, t, NULL), 4);
    assert_true(td_window_add(w, t, bins, 0, 0, 10));
    uint8_t rec[64];
    size_t len = td_window_encode(w, t, rec);
    td_window_t *back = td_window_new(60, 1000, 1);
    unsigned dropped = 0;
    bool nomem = false;
    assert_int_equal(td_window_decode(back, t, 500, rec, len, &dropped, &nomem), len);
    assert_int_equal(dropped, 1);
    assert_int_equal(td_window_decode(back, t + 61000, 1000, rec, len, &dropped, &nomem), len);
    assert_int_equal(dropped, 1);
    assert_int_equal(td_window_slots(back), 0);
    td_window_destroy(&back);
    td_window_destroy(&w);
}

/* ---- accounting and the budget ---------------------------------------------------------- */

/* The table's bytes are its streams' plus its buckets (64 x 8 for up to 64 streams), and each
 * client's are its streams'. */
static void assert_accounts(td_streams_t *t, td_peer_t *const *clients, size_t n_clients)
{
    size_t sum = 0, per[4] = {0};
    for (td_stream_t *s = td_streams_first(t); s; s = s->list_next) {
        assert_int_equal(s->bytes, td_stream_bytes(s));
        sum += s->bytes;
        for (size_t c = 0; c < n_clients; c++)
            if (s->owner == clients[c])
                per[c] += s->bytes;
    }
    assert_int_equal(td_streams_bytes(t), sum + 64 * sizeof(td_stream_t *));
    for (size_t c = 0; c < n_clients; c++)
        assert_int_equal(td_peer_state_bytes(clients[c]), per[c]);
}

/* A random hist batch for stream s (its dtype, or u8 for a new one). */
static tally_status_t random_hist(td_stream_t *s, uint64_t now_ms, char *msg, size_t cap)
{
    static uint64_t bins[TALLY_HIST_VALUES_MAX], zero[TALLY_HIST_VALUES_MAX];
    uint8_t dtype = s->info.hist_dtype ? s->info.hist_dtype : TALLY_DTYPE_U8;
    size_t values = td_stream_values(dtype);
    random_batch(bins, values, zero);
    uint64_t n = 0;
    for (size_t b = 0; b < TALLY_HIST_BINS; b++)
        n += bins[b];
    return td_stream_add_hist(s, dtype, 0, 0, bins, 0, 0, n, now_ms, msg, cap);
}

static void test_accounting_follows_every_change(void **state)
{
    (void)state;
    td_peers_t *peers = NULL;
    assert_int_equal(td_peers_new(&peers), TD_OK);
    td_peer_t *clients[2] = {td_peers_acquire(peers, TD_PEER_CONNECTION, "a", 1, 0),
                             td_peers_acquire(peers, TD_PEER_CONNECTION, "b", 1, 0)};
    td_streams_t *t = NULL;
    assert_int_equal(td_streams_new(64, &t), TD_OK);
    td_streams_set_window(t, 8, 1000);
    uint64_t now = 1795000000000ull;
    char msg[256], name[16];
    for (int step = 0; step < 3000; step++) {
        now += th_rand() % 700;
        unsigned k = (unsigned)(th_rand() % 40);
        snprintf(name, sizeof name, "s%u", k);
        td_stream_t *s = td_streams_find(t, name, strlen(name));
        unsigned op = (unsigned)(th_rand() % 10);
        if (!s) {
            td_peer_t *owner = k % 3 == 2 ? NULL : clients[k % 3];
            assert_int_equal(td_streams_create(t, name, strlen(name), owner, msg, sizeof msg, &s),
                             TALLY_OK);
        } else if (op < 6) {
            assert_int_equal(random_hist(s, now, msg, sizeof msg), TALLY_OK);
        } else if (op == 6) {
            td_stream_zero(s);
        } else if (op == 7) {
            td_stream_clear(s);
        } else if (op == 8) {
            td_streams_remove(t, &s);
        } else {
            td_streams_sweep(t, now, 7);
        }
        assert_accounts(t, clients, 2);
    }
    td_streams_destroy(&t);
    td_peers_release(peers, &clients[0]);
    td_peers_release(peers, &clients[1]);
    td_peers_destroy(&peers);
}

/* Everything a query could see of s: its record and every window sum. */
static void snapshot_of(const td_stream_t *s, uint64_t now_ms, tally_stream_info_t *out)
{
    td_stream_info(s, &out[0]);
    for (unsigned k = 1; k <= 8; k++)
        td_stream_window_info(s, now_ms, k, 1000, &out[k]);
}

static void test_budget_refuses_and_changes_nothing(void **state)
{
    (void)state;
    static tally_stream_info_t before[9], after[9];
    static uint64_t bins[256];
    td_peers_t *peers = NULL;
    assert_int_equal(td_peers_new(&peers), TD_OK);
    td_peer_t *a = td_peers_acquire(peers, TD_PEER_CONNECTION, "a", 1, 0);
    td_streams_t *t = NULL;
    assert_int_equal(td_streams_new(64, &t), TD_OK);
    td_streams_set_window(t, 8, 1000);
    char msg[256];
    td_stream_t *s = NULL, *x = NULL;
    uint64_t now = 1795000000000ull;
    assert_int_equal(td_streams_create(t, "narrow", 6, a, msg, sizeof msg, &s), TALLY_OK);
    memset(bins, 0, sizeof bins);
    bins[40] = 3;
    assert_int_equal(td_stream_add_hist(s, TALLY_DTYPE_U8, 0, 0, bins, 0, 0, 3, now, msg,
                                        sizeof msg),
                     TALLY_OK);
    /* The whole table's budget: just what it holds now. A batch over every bin would make both
     * histograms dense: refused, and nothing a query sees changes. */
    td_streams_set_budget(t, td_streams_bytes(t), 0);
    for (size_t b = 0; b < 256; b++)
        bins[b] = 1;
    snapshot_of(s, now, before);
    size_t bytes = td_streams_bytes(t);
    assert_int_equal(td_stream_add_hist(s, TALLY_DTYPE_U8, 0, 0, bins, 0, 0, 256, now, msg,
                                        sizeof msg),
                     TALLY_E_LIMIT);
    assert_non_null(strstr(msg, "max_state_bytes"));
    snapshot_of(s, now, after);
    assert_memory_equal(before, after, sizeof before);
    assert_int_equal(td_streams_bytes(t), bytes);
    /* A new stream does not fit either; a batch that needs no new byte does. */
    assert_int_equal(td_streams_create(t, "more", 4, a, msg, sizeof msg, &x), TALLY_E_LIMIT);
    assert_null(td_streams_find(t, "more", 4));
    memset(bins, 0, sizeof bins);
    bins[40] = 1;
    assert_int_equal(td_stream_add_hist(s, TALLY_DTYPE_U8, 0, 0, bins, 0, 0, 1, now, msg,
                                        sizeof msg),
                     TALLY_OK);
    /* The client's share: the same refusals as client_streams, the table's budget lifted. */
    td_streams_set_budget(t, 0, td_peer_state_bytes(a));
    assert_int_equal(td_streams_create(t, "more", 4, a, msg, sizeof msg, &x),
                     TALLY_E_CLIENT_STREAMS);
    assert_non_null(strstr(msg, "max_state_bytes_per_client"));
    assert_int_equal(td_streams_create(t, "other", 5, NULL, msg, sizeof msg, &x), TALLY_OK);
    for (size_t b = 0; b < 256; b++)
        bins[b] = 1;
    snapshot_of(s, now, before);
    assert_int_equal(td_stream_add_hist(s, TALLY_DTYPE_U8, 0, 0, bins, 0, 0, 256, now, msg,
                                        sizeof msg),
                     TALLY_E_CLIENT_STREAMS);
    snapshot_of(s, now, after);
    assert_memory_equal(before, after, sizeof before);
    /* Deleting frees the share: the stream fits again. */
    td_streams_remove(t, &s);
    assert_int_equal(td_peer_state_bytes(a), 0);
    assert_int_equal(td_streams_create(t, "more", 4, a, msg, sizeof msg, &x), TALLY_OK);
    td_streams_destroy(&t);
    td_peers_release(peers, &a);
    td_peers_destroy(&peers);
}

int main(void)
{
    th_seed();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bins_against_dense),
        cmocka_unit_test(test_bins_widen_at_each_boundary),
        cmocka_unit_test(test_bins_sparse_to_dense),
        cmocka_unit_test(test_bins_plan_abort_and_set),
        cmocka_unit_test(test_bins_decode_refuses),
        cmocka_unit_test(test_window_against_dense_ring),
        cmocka_unit_test(test_window_memory_follows_data),
        cmocka_unit_test(test_accounting_follows_every_change),
        cmocka_unit_test(test_budget_refuses_and_changes_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
