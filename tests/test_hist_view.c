/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_hist_view.c — the CLI's histogram views (cli/hist_view.c): folding 256 bins into a
 * terminal's width, the bars' heights (linear and log, UTF-8 and ASCII), the human summary of
 * `tally query` (exact text for a u8 and an i32 stream, and quantiles beyond the range), and
 * the JSON and CSV forms against strings built here from libtally's renderers.
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

#include "hist_view.h"
#include "tally_proto.h"

#define assert_close(a, b, eps) assert_true(fabs((double)(a) - (double)(b)) <= (eps))

static char *text_of(tally_buf_t *b)
{
    assert_int_equal(tally_buf_append(b, "", 1), TALLY_OK);
    return (char *)b->data;
}

/* Every bin lands in exactly one column, for every width from 1 to 256, and a column shows its
 * count per integer: u8 (one integer a bin) and an i32 range of 3- and 4-integer bins. */
static void test_fold(void **state)
{
    (void)state;
    tally_hist_t h = {.dtype = TALLY_DTYPE_U8, .hi = 256};
    for (unsigned b = 0; b < 256; b++)
        h.bins[b] = (uint64_t)1 << (b % 40);
    for (unsigned cols = 1; cols <= 256; cols++) {
        double out[256];
        hv_fold(&h, cols, out);
        unsigned next = 0;
        for (unsigned c = 0; c < cols; c++) {
            uint64_t sum = 0;
            unsigned from = next;
            while (next < 256 && (next + 1) * cols <= (c + 1) * 256)
                sum += h.bins[next++];
            assert_true(next > from); /* no empty column: cols <= 256 */
            assert_close(out[c], (double)sum / (next - from), 1e-9 * out[c]);
        }
        assert_int_equal(next, 256);
    }
    /* Uniform i32 data, each integer of [0, 1000) twice: every column is 2 per integer,
     * though the bins hold 3 or 4 integers and the columns 2 or 3 bins. */
    tally_hist_t u = {.dtype = TALLY_DTYPE_I32, .lo = 0, .hi = 1000};
    for (int x = 0; x < 1000; x++)
        u.bins[tally_hist_bin_i32(x, 0, 1000)] += 2;
    double out[100];
    hv_fold(&u, 100, out);
    for (unsigned c = 0; c < 100; c++)
        assert_close(out[c], 2.0, 1e-12);
    /* A range narrower than the columns: columns without integers are 0. */
    tally_hist_t n = {.dtype = TALLY_DTYPE_I32, .lo = 0, .hi = 10};
    for (int x = 0; x < 10; x++)
        n.bins[tally_hist_bin_i32(x, 0, 10)] = 5;
    double narrow[256];
    hv_fold(&n, 256, narrow);
    unsigned nonzero = 0;
    for (unsigned c = 0; c < 256; c++) {
        assert_true(narrow[c] == 0 || narrow[c] == 5);
        nonzero += narrow[c] == 5;
    }
    assert_int_equal(nonzero, 10);
}

static void test_bars(void **state)
{
    (void)state;
    /* One line: heights 0, 1/8 (the minimum for a non-zero column), 4/8, a full cell. */
    const double cols[] = {0, 1, 4, 8};
    tally_buf_t out = {0};
    assert_int_equal(hv_bars(cols, 4, 1, false, true, &out), TALLY_OK);
    assert_string_equal(text_of(&out), " \u2581\u2584\u2588\n");
    tally_buf_free(&out);
    assert_int_equal(hv_bars(cols, 4, 1, false, false, &out), TALLY_OK);
    assert_string_equal(text_of(&out), " ..#\n");
    tally_buf_free(&out);

    /* Two lines (16 eighths): 8 of 16 fills the lower line only; 12 of 16 half the upper. */
    const double two[] = {16, 8, 12, 0};
    assert_int_equal(hv_bars(two, 4, 2, false, true, &out), TALLY_OK);
    assert_string_equal(text_of(&out), "\u2588 \u2584 \n"
                                       "\u2588\u2588\u2588 \n");
    tally_buf_free(&out);

    /* Log scale: log(1 + 9) / log(1 + 99) = 1/2 of the maximum, where linear gives 1/11. */
    const double logs[] = {99, 9};
    assert_int_equal(hv_bars(logs, 2, 1, true, true, &out), TALLY_OK);
    assert_string_equal(text_of(&out), "\u2588\u2584\n");
    tally_buf_free(&out);
    assert_int_equal(hv_bars(logs, 2, 1, false, true, &out), TALLY_OK);
    assert_string_equal(text_of(&out), "\u2588\u2581\n");
    tally_buf_free(&out);
}

static void test_short_count(void **state)
{
    (void)state;
    char buf[32];
    const struct {
        double v;
        const char *want;
    } cases[] = {{0, "0"},           {999, "999"},     {12.5, "12.5"},    {1000, "1.00k"},
                 {12345, "12.3k"},   {999499, "999k"}, {999500, "1.00M"}, {4.56e6, "4.56M"},
                 {7.891e9, "7.89G"}, {1.5e12, "1.50T"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        hv_short_count(cases[i].v, buf, sizeof buf);
        assert_string_equal(buf, cases[i].want);
    }
}

static tally_stream_info_t u8_info(void)
{
    tally_stream_info_t info = {.batches = 2, .elements = 10, .bytes = 10, .last_seq = 2};
    info.hist_dtype = TALLY_DTYPE_U8;
    info.hist_total = 10;
    for (unsigned v = 1; v <= 10; v++)
        info.bins[v * 10]++; /* 10, 20, ..., 100 */
    return info;
}

/* The summary text of a stream `name` with record info is exactly `want`. */
static void expect_summary(const char *name, const tally_stream_info_t *info, const char *want)
{
    hv_stream_t s;
    assert_int_equal(hv_stream_init(&s, name, info), TALLY_OK);
    tally_buf_t out = {0};
    assert_int_equal(hv_summary_text(&s, &out), TALLY_OK);
    assert_string_equal(text_of(&out), want);
    tally_buf_free(&out);
}

static void test_summary_u8(void **state)
{
    (void)state;
    tally_stream_info_t info = u8_info();
    expect_summary("cam0", &info,
                   "stream     cam0\n"
                   "type       u8, 256 bins, one per byte value\n"
                   "count      10\n"
                   "mean       55.00\n"
                   "min        10\n"
                   "max        100\n"
                   "p50        50\n"
                   "p90        90\n"
                   "p99        100\n"
                   "counters   batches 2, elements 10, bytes 10, last_seq 2\n");
}

static void test_summary_i32_out_of_range(void **state)
{
    (void)state;
    tally_stream_info_t info = {.batches = 1, .elements = 8, .bytes = 32};
    info.hist_dtype = TALLY_DTYPE_I32;
    info.hist_lo = 0;
    info.hist_hi = 1000;
    info.bins[0] = 2;   /* [0, 4) */
    info.bins[255] = 1; /* [997, 1000) */
    info.hist_underflow = 1;
    info.hist_overflow = 4;
    info.hist_total = 8;
    info.filter_seen = 6;
    info.filter_kept = 3;
    /* 8 values: rank 1 underflow, 2-3 bin 0, 4 bin 255, 5-8 overflow. p50 = rank 4: 997 +
     * floor(1 * 3 / 2) = 998; p90 and p99 are overflow values. */
    expect_summary("line3/pressure", &info,
                   "stream     line3/pressure\n"
                   "type       i32, 256 bins over [0, 1000), 3-4 values each\n"
                   "count      8\n"
                   "mean       333.67 (in range)\n"
                   "min        bin 0 [0, 4)\n"
                   "max        bin 255 [997, 1000)\n"
                   "p50        998\n"
                   "p90        >= 1000\n"
                   "p99        >= 1000\n"
                   "underflow  1\n"
                   "overflow   4\n"
                   "counters   batches 1, elements 8, bytes 32, last_seq 0; filter kept 3 "
                   "of 6\n");
}

static void test_summary_no_hist(void **state)
{
    (void)state;
    tally_stream_info_t info = {.batches = 1, .elements = 3, .bytes = 12, .scan_elements = 3};
    info.scan_carry = -7;
    expect_summary("s1", &info,
                   "stream     s1\n"
                   "type       none (no hist on this stream yet)\n"
                   "counters   batches 1, elements 3, bytes 12, last_seq 0; "
                   "scan carry -7 after 3 elements\n");
    hv_stream_t s;
    assert_int_equal(hv_stream_init(&s, "s1", &info), TALLY_OK);
    tally_buf_t out = {0};
    assert_int_equal(hv_json(&s, &out), TALLY_OK);
    assert_non_null(strstr(text_of(&out), "\"type\":null,"));
    assert_non_null(strstr((char *)out.data, "\"count\":0,\"mean\":null,\"quantiles\":null,"
                                             "\"bins\":[]}\n"));
    tally_buf_free(&out);
    assert_int_equal(hv_csv(&s, &out), TALLY_OK);
    assert_string_equal(text_of(&out), "lo,hi,count,kind\n");
    tally_buf_free(&out);
}

/* --quantile: the summary's quantile rows are the ones asked for, in that order, named by
 * tally_quantile_name; the JSON's too; the CSV becomes the quantiles. */
static void test_quantiles_asked(void **state)
{
    (void)state;
    tally_stream_info_t info = u8_info();
    hv_stream_t s;
    assert_int_equal(hv_stream_init(&s, "cam0", &info), TALLY_OK);
    const double qs[] = {0.999, 0.25};
    s.quantiles = qs;
    s.nquantiles = 2;
    tally_buf_t out = {0};
    assert_int_equal(hv_summary_text(&s, &out), TALLY_OK);
    assert_string_equal(text_of(&out), "stream     cam0\n"
                                       "type       u8, 256 bins, one per byte value\n"
                                       "count      10\n"
                                       "mean       55.00\n"
                                       "min        10\n"
                                       "max        100\n"
                                       "p99.9      100\n"
                                       "p25        30\n"
                                       "counters   batches 2, elements 10, bytes 10, last_seq 2\n");
    tally_buf_free(&out);
    assert_int_equal(hv_json(&s, &out), TALLY_OK);
    assert_non_null(strstr(text_of(&out), "\"quantiles\":{\"p99.9\":{\"q\":0.999,\"value\":100,"
                                          "\"side\":\"in_range\"},\"p25\":{\"q\":0.25,\"value\":30,"
                                          "\"side\":\"in_range\"}},\"bins\":["));
    tally_buf_free(&out);
    assert_int_equal(hv_csv(&s, &out), TALLY_OK);
    assert_string_equal(text_of(&out), "quantile,q,value,side\np99.9,0.999,100,in_range\n"
                                       "p25,0.25,30,in_range\n");
    tally_buf_free(&out);
}

/* The JSON is the stream's fields, then exactly libtally's histogram members; names are
 * escaped. */
static void test_json_csv(void **state)
{
    (void)state;
    tally_stream_info_t info = u8_info();
    hv_stream_t s;
    assert_int_equal(hv_stream_init(&s, "a\"b\\c", &info), TALLY_OK);
    tally_buf_t out = {0}, members = {0};
    assert_int_equal(hv_json(&s, &out), TALLY_OK);
    assert_int_equal(tally_hist_json(&s.hist[0], &members), TALLY_OK);
    char want[65536];
    snprintf(want, sizeof want,
             "{\"stream\":\"a\\\"b\\\\c\",\"type\":\"u8\",\"batches\":2,\"elements\":10,"
             "\"bytes\":10,\"filter_seen\":0,\"filter_kept\":0,\"scan_carry\":0,"
             "\"scan_elements\":0,\"hist_total\":10,\"last_seq\":2,%s}\n",
             text_of(&members));
    assert_string_equal(text_of(&out), want);
    assert_non_null(strstr(want, "\"quantiles\":{\"p50\":{\"q\":0.5,\"value\":50,\"side\":"
                                 "\"in_range\"},\"p90\":{\"q\":0.9,\"value\":90,\"side\":"
                                 "\"in_range\"},\"p99\":{\"q\":0.99,\"value\":100,\"side\":"
                                 "\"in_range\"}}"));
    tally_buf_free(&out);
    tally_buf_free(&members);

    /* A window query adds its interval. */
    s.window_start_ms = 1000;
    s.window_end_ms = 3500;
    assert_int_equal(hv_json(&s, &out), TALLY_OK);
    assert_non_null(strstr(text_of(&out), ",\"window\":{\"start_ms\":1000,\"end_ms\":3500},"));
    tally_buf_free(&out);
    assert_int_equal(hv_summary_text(&s, &out), TALLY_OK);
    assert_non_null(strstr(text_of(&out), "window     00:00:01.000 - 00:00:03.500 UTC (2.500 s), "
                                          "4 values/s\n"));
    tally_buf_free(&out);

    assert_int_equal(hv_csv(&s, &out), TALLY_OK);
    assert_int_equal(tally_hist_csv(&s.hist[0], NULL, true, &members), TALLY_OK);
    assert_string_equal(text_of(&out), text_of(&members));
    assert_int_equal(strncmp((char *)out.data, "lo,hi,count,kind\n0,1,0,bin\n", 27), 0);
    tally_buf_free(&out);
    tally_buf_free(&members);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fold),
        cmocka_unit_test(test_bars),
        cmocka_unit_test(test_short_count),
        cmocka_unit_test(test_summary_u8),
        cmocka_unit_test(test_summary_i32_out_of_range),
        cmocka_unit_test(test_summary_no_hist),
        cmocka_unit_test(test_json_csv),
        cmocka_unit_test(test_quantiles_asked),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
