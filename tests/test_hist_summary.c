/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_hist_summary.c — libtally's histogram summaries against references computed here.
 *
 * Each test draws random values (seeded; the seed is printed), histograms them the way tallyd
 * does (one bin per byte, or tally_hist_bin_i32 over [lo, hi) with underflow and overflow),
 * sorts the raw values and takes the exact nearest-rank quantiles, then checks what
 * tally_hist_summarize / tally_hist_quantile estimate from the bins alone: exactly equal for u8
 * and for data that fills every integer of a range evenly, within the true quantile's bin for
 * anything else; the mean within half the widest bin; the edges against tally_hist_bin_i32 for
 * every integer of several ranges; and the JSON and CSV renderings against strings built here.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "reference.h"
#include "tally.h"
#include "tally_proto.h"

/* cmocka before 1.1.6 has no assert_double_equal. */
#define assert_close(a, b, eps) assert_true(fabs((double)(a) - (double)(b)) <= (eps))

static uint64_t rng_state;

static uint64_t rng(void)
{
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return rng_state = x;
}

static int setup(void **state)
{
    (void)state;
    const char *env = getenv("TALLY_TEST_SEED");
    rng_state = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) * 2654435761u;
    if (!rng_state)
        rng_state = 1;
    printf("seed %" PRIu64 " (TALLY_TEST_SEED reproduces)\n", rng_state);
    return 0;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The exact nearest-rank quantile of sorted values: the ceil(q * n)-th, at least the first.
 * q is given in millionths so the reference never rounds through floating point. */
static int64_t exact_quantile(const int64_t *sorted, size_t n, uint64_t q_millionths)
{
    uint64_t rank = ((uint64_t)n * q_millionths + 999999) / 1000000;
    return sorted[rank ? rank - 1 : 0];
}

static const uint64_t qs[] = {0, 10000, 250000, 500000, 750000, 900000, 990000, 999000, 1000000};

/* Every quantile in qs of h is in range and the exact nearest rank of the sorted values x. */
static void assert_quantiles_exact(const tally_hist_t *h, const int64_t *x, size_t n)
{
    for (size_t k = 0; k < sizeof qs / sizeof qs[0]; k++) {
        tally_quantile_t q;
        assert_int_equal(tally_hist_quantile(h, (double)qs[k] / 1e6, &q), TALLY_OK);
        assert_int_equal(q.side, 0);
        assert_int_equal(q.value, exact_quantile(x, n, qs[k]));
    }
}

/* Histograms values (each fits its dtype) as tallyd does: tests/lib/reference.c on a batch of
 * dtype (i32 over [lo, hi), or u8). */
static void hist_of(tally_hist_t *h, unsigned dtype, int64_t lo, int64_t hi, const int64_t *x,
                    size_t n)
{
    memset(h, 0, sizeof *h);
    h->dtype = (tally_dtype_t)dtype;
    h->lo = lo;
    h->hi = hi;
    uint8_t *batch = malloc(4 * n + 4);
    assert_non_null(batch);
    for (size_t i = 0; i < n; i++) {
        int32_t v = (int32_t)x[i];
        if (dtype == TALLY_DTYPE_U8)
            batch[i] = (uint8_t)v;
        else
            memcpy(batch + 4 * i, &v, 4);
    }
    tr_hist_parts(dtype, batch, n, lo, hi, h->bins, &h->underflow, &h->overflow);
    free(batch);
}

static void hist_i32(tally_hist_t *h, int64_t lo, int64_t hi, const int64_t *x, size_t n)
{
    hist_of(h, TALLY_DTYPE_I32, lo, hi, x, n);
}

static void hist_u8(tally_hist_t *h, const int64_t *x, size_t n)
{
    hist_of(h, TALLY_DTYPE_U8, 0, 256, x, n);
}

static void test_u8_exact(void **state)
{
    (void)state;
    for (int round = 0; round < 20; round++) {
        size_t n = 1 + rng() % 20000;
        int64_t *x = malloc(n * sizeof *x);
        assert_non_null(x);
        /* Skewed: the minimum of two uniform bytes, plus a narrow spike, so quantiles differ. */
        long double sum = 0;
        for (size_t i = 0; i < n; i++) {
            uint64_t a = rng() % 256, b = rng() % 256;
            x[i] = (int64_t)(rng() % 5 == 0 ? 200 + rng() % 3 : (a < b ? a : b));
            sum += x[i];
        }
        tally_hist_t h;
        hist_u8(&h, x, n);
        qsort(x, n, sizeof *x, cmp_i64);
        assert_quantiles_exact(&h, x, n);
        tally_hist_summary_t s;
        tally_hist_summarize(&h, &s);
        assert_int_equal(s.count, n);
        assert_int_equal(s.in_range, n);
        assert_int_equal(s.underflow + s.overflow, 0);
        assert_int_equal(s.min_bin, x[0]);
        assert_int_equal(s.max_bin, x[n - 1]);
        assert_int_equal(s.p50.value, exact_quantile(x, n, 500000));
        assert_int_equal(s.p90.value, exact_quantile(x, n, 900000));
        assert_int_equal(s.p99.value, exact_quantile(x, n, 990000));
        assert_true(fabs(s.mean - (double)(sum / n)) < 1e-9 * (1 + fabs(s.mean)));
        free(x);
    }
}

/* Ranks come from integer arithmetic: p90 of 1..10 is the 9th value, not the 10th. */
static void test_nearest_rank_small(void **state)
{
    (void)state;
    int64_t x[10];
    for (int i = 0; i < 10; i++)
        x[i] = i + 1;
    tally_hist_t h;
    hist_u8(&h, x, 10);
    tally_hist_summary_t s;
    tally_hist_summarize(&h, &s);
    assert_int_equal(s.p50.value, 5);
    assert_int_equal(s.p90.value, 9);
    assert_int_equal(s.p99.value, 10);
    tally_quantile_t q;
    assert_int_equal(tally_hist_quantile(&h, 0.0, &q), TALLY_OK);
    assert_int_equal(q.value, 1);
    assert_int_equal(tally_hist_quantile(&h, 1.0, &q), TALLY_OK);
    assert_int_equal(q.value, 10);
    assert_close(s.mean, 5.5, 1e-12);
    assert_int_equal(tally_hist_quantile(&h, -0.1, &q), TALLY_E_ARG);
    assert_int_equal(tally_hist_quantile(&h, 1.5, &q), TALLY_E_ARG);
    assert_int_equal(tally_hist_quantile(&h, NAN, &q), TALLY_E_ARG);
}

/* Wide bins, values outside the range: the estimate lies in the true quantile's bin (or is the
 * edge, with its side, when the true quantile is an underflow or overflow value), the mean of
 * the in-range values within half a bin. */
static void test_i32_within_bin(void **state)
{
    (void)state;
    for (int round = 0; round < 20; round++) {
        int64_t lo = -(int64_t)(rng() % 100000), hi = lo + 1 + (int64_t)(rng() % 1000000);
        size_t n = 1 + rng() % 50000;
        int64_t *x = malloc(n * sizeof *x);
        assert_non_null(x);
        int64_t span = (hi - lo) + (hi - lo) / 4 + 2;
        long double sum = 0;
        size_t in_range = 0;
        for (size_t i = 0; i < n; i++) {
            /* Mostly a triangle-shaped bump in range, with a few values beyond each end. */
            int64_t a = (int64_t)(rng() % (uint64_t)span), b = (int64_t)(rng() % (uint64_t)span);
            x[i] = lo - (hi - lo) / 8 - 1 + (a + b) / 2;
            if (x[i] >= lo && x[i] < hi)
                sum += x[i], in_range++;
        }
        tally_hist_t h;
        hist_i32(&h, lo, hi, x, n);
        qsort(x, n, sizeof *x, cmp_i64);
        for (size_t k = 0; k < sizeof qs / sizeof qs[0]; k++) {
            tally_quantile_t q;
            int64_t ref = exact_quantile(x, n, qs[k]);
            assert_int_equal(tally_hist_quantile(&h, (double)qs[k] / 1e6, &q), TALLY_OK);
            if (ref < lo) {
                assert_int_equal(q.side, -1);
                assert_int_equal(q.value, lo);
            } else if (ref >= hi) {
                assert_int_equal(q.side, 1);
                assert_int_equal(q.value, hi);
            } else {
                assert_int_equal(q.side, 0);
                assert_true(q.value >= lo && q.value < hi);
                assert_int_equal(tally_hist_bin_i32((int32_t)q.value, lo, hi),
                                 tally_hist_bin_i32((int32_t)ref, lo, hi));
            }
        }
        tally_hist_summary_t s;
        tally_hist_summarize(&h, &s);
        assert_int_equal(s.count, n);
        assert_int_equal(s.in_range, in_range);
        assert_int_equal(s.underflow + s.overflow + s.in_range, n);
        if (in_range) {
            double half_bin = (double)(hi - lo) / 256 / 2 + 0.5;
            assert_true(fabs(s.mean - (double)(sum / in_range)) <= half_bin);
        } else {
            assert_true(isnan(s.mean));
            assert_int_equal(s.min_bin, -1);
        }
        free(x);
    }
}

/* Every integer of [lo, hi) the same number of times: spreading a bin's values evenly over its
 * integers is then the truth, so every estimate is exact, for widths that are and are not
 * multiples of 256 and for ranges narrower than 256 (bins with no integers). */
static void test_i32_even_fill_exact(void **state)
{
    (void)state;
    const int64_t ranges[][2] = {{0, 512}, {-500, 500}, {7, 7 + 1000}, {-10, 90}, {0, 1}, {3, 259}};
    for (size_t r = 0; r < sizeof ranges / sizeof ranges[0]; r++) {
        int64_t lo = ranges[r][0], hi = ranges[r][1];
        size_t reps = 1 + rng() % 4, n = (size_t)(hi - lo) * reps;
        int64_t *x = malloc(n * sizeof *x);
        assert_non_null(x);
        for (size_t i = 0; i < n; i++)
            x[i] = lo + (int64_t)(i / reps);
        tally_hist_t h;
        hist_i32(&h, lo, hi, x, n);
        assert_quantiles_exact(&h, x, n);
        tally_hist_summary_t s;
        tally_hist_summarize(&h, &s);
        assert_close(s.mean, (double)(lo + hi - 1) / 2, 1e-9);
        free(x);
    }
}

/* tally_hist_edge is the inverse of tally_hist_bin_i32: x is in bin b exactly when
 * edge(b) <= x < edge(b + 1), checked for every integer of small ranges and at sampled points
 * (plus every edge and its neighbour) of the widest one. */
static void check_edges(int64_t lo, int64_t hi, int64_t x)
{
    tally_hist_t h = {.dtype = TALLY_DTYPE_I32, .lo = lo, .hi = hi};
    unsigned b = tally_hist_bin_i32((int32_t)x, lo, hi);
    assert_true(tally_hist_edge(&h, b) <= x);
    assert_true(x < tally_hist_edge(&h, b + 1));
}

static void test_edges_match_binning(void **state)
{
    (void)state;
    const int64_t small[][2] = {{0, 256}, {-10, 90}, {0, 1}, {5, 1000}, {-300, -44}, {0, 257}};
    for (size_t r = 0; r < sizeof small / sizeof small[0]; r++)
        for (int64_t x = small[r][0]; x < small[r][1]; x++)
            check_edges(small[r][0], small[r][1], x);
    const int64_t wide[][2] = {{INT32_MIN, (int64_t)INT32_MAX + 1}, {-1000000007, 999999937}};
    for (size_t r = 0; r < 2; r++) {
        int64_t lo = wide[r][0], hi = wide[r][1];
        tally_hist_t h = {.dtype = TALLY_DTYPE_I32, .lo = lo, .hi = hi};
        assert_int_equal(tally_hist_edge(&h, 0), lo);
        assert_int_equal(tally_hist_edge(&h, 256), hi);
        for (unsigned b = 1; b < 256; b++) {
            check_edges(lo, hi, tally_hist_edge(&h, b));
            check_edges(lo, hi, tally_hist_edge(&h, b) - 1);
        }
        for (int i = 0; i < 100000; i++)
            check_edges(lo, hi, lo + (int64_t)(rng() % (uint64_t)(hi - lo)));
    }
}

/* Counts near 2^64: ranks computed in 128 bits, no overflow. */
static void test_huge_counts(void **state)
{
    (void)state;
    tally_hist_t h = {.dtype = TALLY_DTYPE_U8, .lo = 0, .hi = 256};
    h.bins[10] = h.bins[20] = h.bins[30] = UINT64_C(1) << 62;
    tally_hist_summary_t s;
    tally_hist_summarize(&h, &s);
    assert_int_equal(s.count, UINT64_C(3) << 62);
    assert_int_equal(s.p50.value, 20);
    assert_int_equal(s.p90.value, 30);
    assert_int_equal(s.min_bin, 10);
    assert_int_equal(s.max_bin, 30);
    assert_close(s.mean, 20.0, 1e-9);
}

static void test_empty(void **state)
{
    (void)state;
    tally_hist_t h = {.dtype = TALLY_DTYPE_I32, .lo = 0, .hi = 100};
    tally_hist_summary_t s;
    tally_hist_summarize(&h, &s);
    assert_int_equal(s.count, 0);
    assert_true(isnan(s.mean));
    assert_int_equal(s.min_bin, -1);
    assert_int_equal(s.max_bin, -1);
    tally_quantile_t q;
    assert_int_equal(tally_hist_quantile(&h, 0.5, &q), TALLY_E_ARG);
    /* Only values beyond the range: quantiles are the edges, with their side. */
    h.underflow = 3;
    h.overflow = 7;
    tally_hist_summarize(&h, &s);
    assert_int_equal(s.count, 10);
    assert_true(isnan(s.mean));
    assert_int_equal(s.p50.side, 1);
    assert_int_equal(s.p50.value, 100);
    assert_int_equal(tally_hist_quantile(&h, 0.3, &q), TALLY_OK);
    assert_int_equal(q.side, -1);
    assert_int_equal(q.value, 0);
    tally_buf_t out = {0};
    assert_int_equal(tally_hist_json(&h, &out), TALLY_OK);
    assert_int_equal(tally_buf_append(&out, "", 1), TALLY_OK);
    assert_non_null(strstr((char *)out.data, "\"mean\":null,\"min\":null,\"max\":null,"));
    /* Each quantile says which side of the range it fell on: never a bare edge. */
    assert_non_null(strstr((char *)out.data,
                           "\"quantiles\":{\"p50\":{\"q\":0.5,\"value\":100,\"side\":\"overflow\"},"
                           "\"p90\":{\"q\":0.9,\"value\":100,\"side\":\"overflow\"},"
                           "\"p99\":{\"q\":0.99,\"value\":100,\"side\":\"overflow\"}}"));
    tally_buf_free(&out);
    const double low[] = {0.3};
    assert_int_equal(tally_hist_json_quantiles(&h, low, 1, &out), TALLY_OK);
    assert_int_equal(tally_buf_append(&out, "", 1), TALLY_OK);
    assert_non_null(
        strstr((char *)out.data,
               "\"quantiles\":{\"p30\":{\"q\":0.3,\"value\":0,\"side\":\"underflow\"}}"));
    tally_buf_free(&out);
    memset(&h, 0, sizeof h);
    h.dtype = TALLY_DTYPE_U8, h.hi = 256;
    assert_int_equal(tally_hist_json(&h, &out), TALLY_OK);
    assert_int_equal(tally_buf_append(&out, "", 1), TALLY_OK);
    assert_non_null(strstr((char *)out.data, "\"quantiles\":null,\"bins\":["));
    tally_buf_free(&out);
}

static void test_from_info(void **state)
{
    (void)state;
    tally_stream_info_t info = {0};
    tally_hist_t h;
    assert_int_equal(tally_hist_from_info(&info, 0, &h), TALLY_E_ARG); /* no hist yet */
    info.hist_dtype = TALLY_DTYPE_I32;
    info.hist_lo = -5;
    info.hist_hi = 1000;
    info.hist_underflow = 4;
    info.hist_overflow = 9;
    for (unsigned b = 0; b < 256; b++)
        info.bins[b] = b * 3;
    assert_int_equal(tally_hist_from_info(&info, 0, &h), TALLY_OK);
    assert_int_equal(h.dtype, TALLY_DTYPE_I32);
    assert_int_equal(h.lo, -5);
    assert_int_equal(h.hi, 1000);
    assert_int_equal(h.underflow, 4);
    assert_int_equal(h.overflow, 9);
    assert_memory_equal(h.bins, info.bins, sizeof h.bins);
    info.hist_dtype = TALLY_DTYPE_U8;
    assert_int_equal(tally_hist_from_info(&info, 0, &h), TALLY_OK);
    assert_int_equal(h.lo, 0);
    assert_int_equal(h.hi, 256);
    assert_int_equal(h.underflow + h.overflow, 0);
    assert_int_equal(tally_hist_from_info(&info, 1, &h), TALLY_E_ARG); /* one channel */
    info.hist_dtype = TALLY_DTYPE_TEXT;
    assert_int_equal(tally_hist_from_info(&info, 0, &h), TALLY_E_ARG);

    /* u16: a range like i32, its own domain for the outer entries. */
    info.hist_dtype = TALLY_DTYPE_U16;
    info.hist_lo = 100;
    info.hist_hi = 4196; /* a 12-bit sensor's range, offset: 16 values a bin */
    assert_int_equal(tally_hist_from_info(&info, 0, &h), TALLY_OK);
    assert_int_equal(h.dtype, TALLY_DTYPE_U16);
    assert_int_equal(tally_hist_edge(&h, 1), 116);
    tally_buf_t out = {0};
    assert_int_equal(tally_hist_csv(&h, NULL, false, &out), TALLY_OK);
    assert_int_equal(tally_buf_append(&out, "", 1), TALLY_OK);
    const char *head = "0,100,4,underflow\n100,116,0,bin\n116,132,3,bin\n";
    assert_int_equal(strncmp((char *)out.data, head, strlen(head)), 0);
    assert_non_null(strstr((char *)out.data, "\n4180,4196,765,bin\n4196,65536,9,overflow\n"));
    tally_buf_free(&out);

    /* rgba8: channel c's bins at c * 256, each a byte histogram. */
    info.hist_dtype = TALLY_DTYPE_RGBA8;
    info.hist_lo = info.hist_hi = 0;
    info.hist_underflow = info.hist_overflow = 0;
    for (unsigned c = 0; c < 4; c++)
        for (unsigned b = 0; b < 256; b++)
            info.bins[c * 256 + b] = c == 2 && b == 77 ? 5 : 0;
    for (unsigned c = 0; c < 4; c++) {
        assert_int_equal(tally_hist_from_info(&info, c, &h), TALLY_OK);
        assert_int_equal(h.dtype, TALLY_DTYPE_U8);
        assert_int_equal(h.hi, 256);
        tally_hist_summary_t sum;
        tally_hist_summarize(&h, &sum);
        assert_int_equal(sum.count, c == 2 ? 5 : 0);
        if (c == 2)
            assert_int_equal(sum.p50.value, 77);
    }
    assert_int_equal(tally_hist_from_info(&info, 4, &h), TALLY_E_ARG);
}

/* The JSON and CSV of a random i32 histogram, against strings built here from the definition:
 * bin b of [0, 512) is [2b, 2b + 2); underflow and overflow are entries over the rest of int32. */
static void test_json_csv(void **state)
{
    (void)state;
    tally_hist_t h = {.dtype = TALLY_DTYPE_I32, .lo = 0, .hi = 512, .underflow = 5, .overflow = 2};
    h.bins[3] = 4; /* values 6, 7 */
    h.bins[100] = 4;
    char want[32768], *p = want;
    char *end = want + sizeof want;
    /* 15 values: ranks 1-5 underflow, 6-9 bin 3, 10-13 bin 100, 14-15 overflow. p50 is rank 8,
     * the 3rd of bin 3's four: 6 + floor(5 * 2 / 8) = 7; p90 (rank 14) and p99 (rank 15) are
     * overflow values, given as hi. The mean is of the in-range values at their bins' centres,
     * (4 * 6.5 + 4 * 200.5) / 8. */
    p += snprintf(p, (size_t)(end - p),
                  "\"count\":15,\"in_range\":8,\"underflow\":5,\"overflow\":2,\"mean\":103.5,"
                  "\"min\":{\"bin\":3,\"lo\":6,\"hi\":8},\"max\":{\"bin\":100,\"lo\":200,\"hi\":"
                  "202},\"quantiles\":{\"p50\":{\"q\":0.5,\"value\":7,\"side\":\"in_range\"},"
                  "\"p90\":{\"q\":0.9,\"value\":512,\"side\":\"overflow\"},"
                  "\"p99\":{\"q\":0.99,\"value\":512,\"side\":\"overflow\"}},\"bins\":["
                  "{\"lo\":-2147483648,\"hi\":0,\"count\":5}");
    for (unsigned b = 0; b < 256; b++)
        p += snprintf(p, (size_t)(end - p), ",{\"lo\":%u,\"hi\":%u,\"count\":%" PRIu64 "}", 2 * b,
                      2 * b + 2, h.bins[b]);
    p += snprintf(p, (size_t)(end - p), ",{\"lo\":512,\"hi\":2147483648,\"count\":2}]");
    tally_buf_t out = {0};
    assert_int_equal(tally_hist_json(&h, &out), TALLY_OK);
    assert_int_equal(out.len, strlen(want));
    assert_memory_equal(out.data, want, out.len);
    tally_buf_free(&out);

    p = want;
    p += snprintf(p, (size_t)(end - p), "channel,lo,hi,count,kind\ng,-2147483648,0,5,underflow\n");
    for (unsigned b = 0; b < 256; b++)
        p += snprintf(p, (size_t)(end - p), "g,%u,%u,%" PRIu64 ",bin\n", 2 * b, 2 * b + 2,
                      h.bins[b]);
    p += snprintf(p, (size_t)(end - p), "g,512,2147483648,2,overflow\n");
    assert_int_equal(tally_hist_csv(&h, "g", true, &out), TALLY_OK);
    assert_int_equal(out.len, strlen(want));
    assert_memory_equal(out.data, want, out.len);
    tally_buf_free(&out);

    /* u8: 256 entries, no underflow or overflow; rows without a label or header. */
    tally_hist_t u = {.dtype = TALLY_DTYPE_U8, .lo = 0, .hi = 256};
    u.bins[255] = 1;
    assert_int_equal(tally_hist_csv(&u, NULL, false, &out), TALLY_OK);
    size_t lines = 0;
    for (size_t i = 0; i < out.len; i++)
        lines += out.data[i] == '\n';
    assert_int_equal(lines, 256);
    assert_memory_equal(out.data, "0,1,0,bin\n", 10);
    assert_memory_equal(out.data + out.len - 14, "255,256,1,bin\n", 14);
    tally_buf_free(&out);
}

/* Quantile names: "p" and 100 q to four decimals, no trailing zeros; q outside [0, 1] refused. */
static void test_quantile_names(void **state)
{
    (void)state;
    static const struct {
        double q;
        const char *name;
    } cases[] = {{0.5, "p50"},       {0.9, "p90"},
                 {0.99, "p99"},      {0.999, "p99.9"},
                 {0.9999, "p99.99"}, {0, "p0"},
                 {1, "p100"},        {0.000001, "p0.0001"},
                 {0.25, "p25"},      {0.123456, "p12.3456"},
                 {0.0005, "p0.05"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[TALLY_QUANTILE_NAME_MAX];
        assert_int_equal(tally_quantile_name(cases[i].q, name, sizeof name), TALLY_OK);
        assert_string_equal(name, cases[i].name);
    }
    char name[TALLY_QUANTILE_NAME_MAX];
    assert_int_equal(tally_quantile_name(1.01, name, sizeof name), TALLY_E_ARG);
    assert_int_equal(tally_quantile_name(-0.1, name, sizeof name), TALLY_E_ARG);
    assert_int_equal(tally_quantile_name(NAN, name, sizeof name), TALLY_E_ARG);
    assert_string_equal(tally_quantile_side_name(-1), "underflow");
    assert_string_equal(tally_quantile_side_name(0), "in_range");
    assert_string_equal(tally_quantile_side_name(1), "overflow");
}

/* Arbitrary quantiles: JSON and CSV in the order given, each with its value and side, equal to
 * tally_hist_quantile's; a bad quantile or too many refused. */
static void test_arbitrary_quantiles(void **state)
{
    (void)state;
    /* u8: values 0..199 once each and 255 800 times: p99.9 is 255, p10 (rank 100) is 99. */
    tally_hist_t h = {.dtype = TALLY_DTYPE_U8, .lo = 0, .hi = 256};
    for (unsigned v = 0; v < 200; v++)
        h.bins[v] = 1;
    h.bins[255] = 800;
    const double asked[] = {0.999, 0.1, 0};
    tally_buf_t out = {0};
    assert_int_equal(tally_hist_json_quantiles(&h, asked, 3, &out), TALLY_OK);
    assert_int_equal(tally_buf_append(&out, "", 1), TALLY_OK);
    assert_non_null(strstr((char *)out.data,
                           "\"quantiles\":{\"p99.9\":{\"q\":0.999,\"value\":255,\"side\":"
                           "\"in_range\"},\"p10\":{\"q\":0.1,\"value\":99,\"side\":\"in_range\"},"
                           "\"p0\":{\"q\":0,\"value\":0,\"side\":\"in_range\"}},\"bins\":["));
    tally_buf_free(&out);
    assert_int_equal(tally_hist_csv_quantiles(&h, NULL, true, asked, 3, &out), TALLY_OK);
    assert_int_equal(tally_buf_append(&out, "", 1), TALLY_OK);
    assert_string_equal((char *)out.data, "quantile,q,value,side\np99.9,0.999,255,in_range\n"
                                          "p10,0.1,99,in_range\np0,0,0,in_range\n");
    tally_buf_free(&out);
    /* Ranged, with a label, beyond both ends; an empty histogram has no values to give. */
    tally_hist_t r = {.dtype = TALLY_DTYPE_I32, .lo = 0, .hi = 10, .underflow = 1, .overflow = 1};
    const double ends[] = {0.01, 1};
    assert_int_equal(tally_hist_csv_quantiles(&r, "g", false, ends, 2, &out), TALLY_OK);
    assert_int_equal(tally_buf_append(&out, "", 1), TALLY_OK);
    assert_string_equal((char *)out.data, "g,p1,0.01,0,underflow\ng,p100,1,10,overflow\n");
    tally_buf_free(&out);
    memset(&r, 0, sizeof r);
    r.dtype = TALLY_DTYPE_I32, r.hi = 10;
    assert_int_equal(tally_hist_csv_quantiles(&r, NULL, false, ends, 1, &out), TALLY_OK);
    assert_int_equal(tally_buf_append(&out, "", 1), TALLY_OK);
    assert_string_equal((char *)out.data, "p1,0.01,,\n");
    tally_buf_free(&out);
    const double bad[] = {0.5, 1.5};
    assert_int_equal(tally_hist_json_quantiles(&h, bad, 2, &out), TALLY_E_ARG);
    assert_int_equal(tally_hist_csv_quantiles(&h, NULL, true, bad, 2, &out), TALLY_E_ARG);
    static double many[TALLY_QUANTILES_MAX + 1];
    assert_int_equal(tally_hist_json_quantiles(&h, many, TALLY_QUANTILES_MAX + 1, &out),
                     TALLY_E_ARG);
    assert_int_equal(tally_hist_json_quantiles(&h, many, TALLY_QUANTILES_MAX, &out), TALLY_OK);
    tally_buf_free(&out);
}

/* A stream's whole record (the rendering `tally query --json` and tallyd's HTTP API share):
 * the name escaped, no histogram, then an rgb8 window with one quantile asked for, in the
 * quantile object form of tally_hist_json_quantiles. */
static void test_stream_json(void **state)
{
    (void)state;
    const double asked[] = {0.5};
    tally_buf_t out = {0};
    static tally_stream_info_t info; /* 8 KiB per channel: off the stack */
    memset(&info, 0, sizeof info);
    info.batches = 2;
    tally_stream_view_t v = {.name = "a\"b\\c", .info = &info};
    assert_int_equal(tally_stream_json(&v, &out), TALLY_OK);
    assert_string_equal((char *)out.data,
                        "{\"stream\":\"a\\\"b\\\\c\",\"type\":null,\"batches\":2,\"elements\":0,"
                        "\"bytes\":0,\"filter_seen\":0,\"filter_kept\":0,\"scan_carry\":0,"
                        "\"scan_elements\":0,\"hist_total\":0,\"last_seq\":0,\"count\":0,\"mean\":"
                        "null,\"quantiles\":null,\"bins\":[]}");
    tally_buf_free(&out);
    info.hist_dtype = TALLY_DTYPE_RGB8;
    info.bins[2 * 256 + 7] = 3; /* blue 7, three times */
    v.window_start_ms = 1000;
    v.window_end_ms = 2000;
    v.quantiles = asked;
    v.nquantiles = 1;
    assert_int_equal(tally_stream_json(&v, &out), TALLY_OK);
    assert_non_null(strstr((char *)out.data, "\"window\":{\"start_ms\":1000,\"end_ms\":2000},"
                                             "\"channels\":[{\"channel\":\"r\",\"count\":0,"));
    assert_non_null(strstr((char *)out.data, "{\"channel\":\"b\",\"count\":3,"));
    assert_non_null(strstr((char *)out.data,
                           "\"quantiles\":{\"p50\":{\"q\":0.5,\"value\":7,\"side\":\"in_range\"}},"));
    assert_null(strstr((char *)out.data, "\"channel\":\"a\""));
    tally_buf_free(&out);
    info.hist_dtype = 99; /* not a histogram type */
    assert_int_equal(tally_stream_json(&v, &out), TALLY_E_ARG);
    tally_buf_free(&out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_u8_exact),
        cmocka_unit_test(test_nearest_rank_small),
        cmocka_unit_test(test_i32_within_bin),
        cmocka_unit_test(test_i32_even_fill_exact),
        cmocka_unit_test(test_edges_match_binning),
        cmocka_unit_test(test_huge_counts),
        cmocka_unit_test(test_empty),
        cmocka_unit_test(test_from_info),
        cmocka_unit_test(test_json_csv),
        cmocka_unit_test(test_quantile_names),
        cmocka_unit_test(test_arbitrary_quantiles),
        cmocka_unit_test(test_stream_json),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
