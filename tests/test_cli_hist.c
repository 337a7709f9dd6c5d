/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_cli_hist.c — the analyst's side of the `tally` CLI against a real tallyd: `query` as a
 * human summary, --json, --csv and --raw; --last windows; `hist --type u16|rgb|rgba`; `reset`
 * (zeroes, keeps the stream) against `delete` (removes it).
 *
 * Every stream gets data drawn here (seeded, th_seed prints the seed) and every figure the CLI
 * prints is checked against a reference computed here from the raw values: counts per bin, the
 * exact nearest-rank quantiles (which the CLI must reproduce exactly where each bin holds one
 * integer: u8, colour channels, u16 over a range of 256), the mean, underflow and overflow.
 * tallyd runs with windows of 10 x 1 s so that --last can be checked, and refused past 10 s.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "reference.h"
#include "tally.h"
#include "tally_proto.h"

static th_daemon_t daemon_;
static char tmpdir[64];

/* `tally -e ENDPOINT ARGS` in tmpdir. */
#define cli(...) th_cli(tmpdir, daemon_.endpoint, __VA_ARGS__)
typedef th_cli_t cli_result_t;
#define cli_free th_cli_free

static void expect_status(cli_result_t r, int status, const char *err_needle)
{
    if (r.status != status)
        fail_msg("exit %d, expected %d; stderr: %s", r.status, status, r.err);
    if (err_needle && !strstr(r.err, err_needle))
        fail_msg("stderr lacks '%s': %s", err_needle, r.err);
    cli_free(&r);
}

static void write_file(const char *name, const void *data, size_t len)
{
    assert_int_equal(th_write_file(tmpdir, name, data, len), 0);
}

/* A line of the output that starts with `prefix`, copied (without its newline) into buf. */
static const char *line_of(const char *out, const char *prefix, char *buf, size_t cap)
{
    size_t plen = strlen(prefix);
    for (const char *p = out; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
        if (strncmp(p, prefix, plen))
            continue;
        size_t n = strcspn(p, "\n");
        snprintf(buf, cap, "%.*s", (int)(n < cap ? n : cap - 1), p);
        return buf;
    }
    fail_msg("no line starting with '%s' in:\n%s", prefix, out);
    return NULL;
}

static size_t count_of(const char *haystack, const char *needle)
{
    size_t n = 0;
    for (const char *p = strstr(haystack, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

/* Nearest rank over sorted values: the ceil(q * n)-th, q in millionths. */
static int64_t exact_q(const int64_t *sorted, size_t n, uint64_t q_millionths)
{
    uint64_t rank = ((uint64_t)n * q_millionths + 999999) / 1000000;
    return sorted[rank ? rank - 1 : 0];
}

static int setup(void **state)
{
    (void)state;
    if (th_tmpdir(tmpdir, sizeof tmpdir, "tally-clihist") != 0 || !getenv("TALLY_BIN"))
        return -1;
    th_seed();
    const char *args[] = {"--window-intervals", "10", "--window-interval-ms", "1000", NULL};
    return th_daemon_start(&daemon_, args);
}

static int teardown(void **state)
{
    (void)state;
    return th_daemon_teardown(&daemon_, 20000, tmpdir);
}

/* ---- query: u8 ------------------------------------------------------------------------------ */

enum { U8_N = 50000 };

/* Skewed bytes: the smaller of two uniform ones. */
static void u8_data(uint8_t *x, int64_t *sorted, uint64_t bins[256])
{
    memset(bins, 0, 256 * sizeof *bins);
    for (size_t i = 0; i < U8_N; i++) {
        uint8_t a = (uint8_t)th_rand(), b = (uint8_t)th_rand();
        x[i] = a < b ? a : b;
        sorted[i] = x[i];
    }
    tr_hist(TALLY_DTYPE_U8, x, U8_N, 0, 0, bins);
    qsort(sorted, U8_N, sizeof *sorted, th_cmp_i64);
}

/* --quantile Q (repeatable): exactly those quantiles, in that order, in every format; bad
 * values refused before anything is sent. */
static void check_quantile_option(const int64_t *sorted)
{
    char want[512], buf[256];
    cli_result_t r = cli("query --quantile 0.999 --quantile 0.001 --quantile 0.999 q/u8");
    assert_int_equal(r.status, 0);
    snprintf(want, sizeof want, "p99.9      %" PRId64, exact_q(sorted, U8_N, 999000));
    assert_string_equal(line_of(r.out, "p99.9 ", buf, sizeof buf), want);
    snprintf(want, sizeof want, "p0.1       %" PRId64, exact_q(sorted, U8_N, 1000));
    assert_string_equal(line_of(r.out, "p0.1 ", buf, sizeof buf), want);
    assert_null(strstr(r.out, "p50"));
    assert_int_equal(count_of(r.out, "p99.9"), 1); /* given twice, shown once */
    assert_true(strstr(r.out, "p99.9") < strstr(r.out, "p0.1"));
    cli_free(&r);
    r = cli("query --json --quantile 0.999 q/u8");
    assert_int_equal(r.status, 0);
    snprintf(want, sizeof want,
             "\"quantiles\":{\"p99.9\":{\"q\":0.999,\"value\":%" PRId64 ",\"side\":\"in_range\"}},",
             exact_q(sorted, U8_N, 999000));
    assert_non_null(strstr(r.out, want));
    cli_free(&r);
    r = cli("query --csv --quantile 0.5 --quantile 1 q/u8");
    assert_int_equal(r.status, 0);
    snprintf(want, sizeof want,
             "quantile,q,value,side\np50,0.5,%" PRId64 ",in_range\np100,1,%" PRId64 ",in_range\n",
             exact_q(sorted, U8_N, 500000), sorted[U8_N - 1]);
    assert_string_equal(r.out, want);
    cli_free(&r);
    expect_status(cli("query --quantile 1.5 q/u8"), 2, "invalid quantile '1.5'");
    expect_status(cli("query --quantile -0.1 q/u8"), 2, "invalid quantile");
    expect_status(cli("query --quantile nan q/u8"), 2, "invalid quantile");
    expect_status(cli("query --quantile 0.5x q/u8"), 2, "invalid quantile");
    expect_status(cli("query --raw --quantile 0.5 q/u8"), 2, "--raw");
}

static void test_query_u8_formats(void **state)
{
    (void)state;
    static uint8_t x[U8_N];
    static int64_t sorted[U8_N];
    uint64_t bins[256];
    u8_data(x, sorted, bins);
    write_file("u8.raw", x, U8_N);
    expect_status(cli("hist --stream q/u8 --in u8.raw > /dev/null"), 0, NULL);
    double sum = 0;
    for (size_t i = 0; i < U8_N; i++)
        sum += x[i];
    char want[256], buf[256];

    /* The human summary: exact figures. */
    cli_result_t r = cli("query q/u8");
    assert_int_equal(r.status, 0);
    assert_string_equal(line_of(r.out, "stream ", buf, sizeof buf), "stream     q/u8");
    snprintf(want, sizeof want, "count      %d", U8_N);
    assert_string_equal(line_of(r.out, "count ", buf, sizeof buf), want);
    snprintf(want, sizeof want, "mean       %.2f", sum / U8_N);
    assert_string_equal(line_of(r.out, "mean ", buf, sizeof buf), want);
    snprintf(want, sizeof want, "min        %" PRId64, sorted[0]);
    assert_string_equal(line_of(r.out, "min ", buf, sizeof buf), want);
    snprintf(want, sizeof want, "max        %" PRId64, sorted[U8_N - 1]);
    assert_string_equal(line_of(r.out, "max ", buf, sizeof buf), want);
    const uint64_t qs[] = {500000, 900000, 990000};
    const char *names[] = {"p50", "p90", "p99"};
    for (int k = 0; k < 3; k++) {
        snprintf(want, sizeof want, "%s        %" PRId64, names[k], exact_q(sorted, U8_N, qs[k]));
        assert_string_equal(line_of(r.out, names[k], buf, sizeof buf), want);
    }
    assert_null(strstr(r.out, "underflow")); /* u8 has none */
    cli_free(&r);

    /* JSON: the figures, then 256 bins with their counts. */
    r = cli("query --json q/u8");
    assert_int_equal(r.status, 0);
    assert_int_equal(strncmp(r.out, "{\"stream\":\"q/u8\",\"type\":\"u8\",", 29), 0);
    snprintf(want, sizeof want, "\"count\":%d,\"in_range\":%d,\"underflow\":0,\"overflow\":0,",
             U8_N, U8_N);
    assert_non_null(strstr(r.out, want));
    snprintf(want, sizeof want,
             "\"quantiles\":{\"p50\":{\"q\":0.5,\"value\":%" PRId64 ",\"side\":\"in_range\"},"
             "\"p90\":{\"q\":0.9,\"value\":%" PRId64 ",\"side\":\"in_range\"},"
             "\"p99\":{\"q\":0.99,\"value\":%" PRId64 ",\"side\":\"in_range\"}}",
             exact_q(sorted, U8_N, qs[0]), exact_q(sorted, U8_N, qs[1]),
             exact_q(sorted, U8_N, qs[2]));
    assert_non_null(strstr(r.out, want));
    assert_int_equal(count_of(r.out, "{\"lo\":"), 256);
    for (unsigned b = 0; b < 256; b++) {
        snprintf(want, sizeof want, "{\"lo\":%u,\"hi\":%u,\"count\":%" PRIu64 "}", b, b + 1,
                 bins[b]);
        assert_non_null(strstr(r.out, want));
    }
    assert_string_equal(r.out + strlen(r.out) - 3, "]}\n");
    cli_free(&r);

    /* CSV: a header and one row per byte value, in order. */
    r = cli("query --csv q/u8");
    assert_int_equal(r.status, 0);
    char csv[8192];
    size_t at = (size_t)snprintf(csv, sizeof csv, "lo,hi,count,kind\n");
    for (unsigned b = 0; b < 256; b++)
        at += (size_t)snprintf(csv + at, sizeof csv - at, "%u,%u,%" PRIu64 ",bin\n", b, b + 1,
                               bins[b]);
    assert_string_equal(r.out, csv);
    cli_free(&r);

    /* --raw: the record's fields, then "bin count". */
    r = cli("query --raw q/u8");
    assert_int_equal(r.status, 0);
    snprintf(want, sizeof want, "hist_type u8\n");
    assert_non_null(strstr(r.out, want));
    snprintf(want, sizeof want, "\n%u %" PRIu64 "\n", 77u, bins[77]);
    assert_non_null(strstr(r.out, want));
    cli_free(&r);

    expect_status(cli("query --json --csv q/u8"), 2, "exclude");
    check_quantile_option(sorted);
}

/* ---- query: i32 and u16 ranges ------------------------------------------------------------ */

/* Values around a range, some beyond each end; the summary's quantiles must lie in the true
 * quantile's bin (or say "< lo" / ">= hi"), the under/overflow counts be exact. */
static void check_ranged(const char *type, const char *stream, int64_t lo, int64_t hi, int64_t vmin,
                         int64_t vmax)
{
    enum { N = 20000 };
    static int64_t v[N];
    static uint8_t raw[4 * N];
    size_t esize = strcmp(type, "u16") ? 4 : 2;
    for (size_t i = 0; i < N; i++) {
        v[i] = vmin + (int64_t)(th_rand() % (uint64_t)(vmax - vmin + 1));
        if (esize == 2)
            tally_put_u16(raw + 2 * i, (uint16_t)v[i]);
        else
            tally_put_u32(raw + 4 * i, (uint32_t)v[i]);
    }
    uint64_t counts[TALLY_HIST_I32_VALUES] = {0};
    tr_hist(esize == 2 ? TALLY_DTYPE_U16 : TALLY_DTYPE_I32, raw, N, lo, hi, counts);
    uint64_t under = counts[TALLY_HIST_BINS], over = counts[TALLY_HIST_BINS + 1];
    qsort(v, N, sizeof *v, th_cmp_i64);
    char file[64], want[256], buf[256];
    snprintf(file, sizeof file, "%s.raw", type);
    write_file(file, raw, esize * N);
    cli_result_t r = cli("hist --type %s --range %" PRId64 " %" PRId64 " --stream %s --in %s "
                         "> /dev/null",
                         type, lo, hi, stream, file);
    expect_status(r, 0, NULL);

    r = cli("query %s", stream);
    assert_int_equal(r.status, 0);
    snprintf(want, sizeof want, "underflow  %" PRIu64, under);
    assert_string_equal(line_of(r.out, "underflow", buf, sizeof buf), want);
    snprintf(want, sizeof want, "overflow   %" PRIu64, over);
    assert_string_equal(line_of(r.out, "overflow", buf, sizeof buf), want);
    const uint64_t qs[] = {500000, 900000, 990000};
    const char *names[] = {"p50 ", "p90 ", "p99 "};
    for (int k = 0; k < 3; k++) {
        int64_t ref = exact_q(v, N, qs[k]);
        const char *got = line_of(r.out, names[k], buf, sizeof buf) + 11;
        if (ref < lo) {
            snprintf(want, sizeof want, "< %" PRId64, lo);
            assert_string_equal(got, want);
        } else if (ref >= hi) {
            snprintf(want, sizeof want, ">= %" PRId64, hi);
            assert_string_equal(got, want);
        } else {
            int64_t est = strtoll(got, NULL, 10);
            assert_true(est >= lo && est < hi);
            if (tally_hist_bin_i32((int32_t)est, lo, hi) !=
                tally_hist_bin_i32((int32_t)ref, lo, hi))
                fail_msg("%s %s: estimate %" PRId64 " is not in the bin of %" PRId64, type,
                         names[k], est, ref);
        }
    }
    cli_free(&r);

    /* JSON: 258 entries, the outer ones over the rest of the type's domain. */
    r = cli("query --json %s", stream);
    assert_int_equal(r.status, 0);
    assert_int_equal(count_of(r.out, "{\"lo\":"), 258);
    snprintf(want, sizeof want, "\"bins\":[{\"lo\":%s,\"hi\":%" PRId64 ",\"count\":%" PRIu64 "},",
             esize == 2 ? "0" : "-2147483648", lo, under);
    assert_non_null(strstr(r.out, want));
    snprintf(want, sizeof want, "{\"lo\":%" PRId64 ",\"hi\":%s,\"count\":%" PRIu64 "}]}\n", hi,
             esize == 2 ? "65536" : "2147483648", over);
    assert_non_null(strstr(r.out, want));
    snprintf(want, sizeof want, "\"type\":\"%s\",\"lo\":%" PRId64 ",\"hi\":%" PRId64 ",", type, lo,
             hi);
    assert_non_null(strstr(r.out, want));
    /* A quantile beyond the range names its side, its value the edge. */
    int64_t p99 = exact_q(v, N, 990000), p50 = exact_q(v, N, 500000);
    if (p99 >= hi) {
        snprintf(want, sizeof want,
                 "\"p99\":{\"q\":0.99,\"value\":%" PRId64 ",\"side\":\"overflow\"}", hi);
        assert_non_null(strstr(r.out, want));
    }
    if (p50 >= lo && p50 < hi)
        assert_non_null(strstr(r.out, "\"p50\":{\"q\":0.5,\"value\":"));
    cli_free(&r);

    /* CSV: the outer rows say what they are. */
    r = cli("query --csv %s", stream);
    assert_int_equal(r.status, 0);
    snprintf(want, sizeof want, "lo,hi,count,kind\n%s,%" PRId64 ",%" PRIu64 ",underflow\n",
             esize == 2 ? "0" : "-2147483648", lo, under);
    assert_int_equal(strncmp(r.out, want, strlen(want)), 0);
    snprintf(want, sizeof want, "\n%" PRId64 ",%s,%" PRIu64 ",overflow\n", hi,
             esize == 2 ? "65536" : "2147483648", over);
    assert_non_null(strstr(r.out, want));
    assert_int_equal(count_of(r.out, ",bin\n"), 256);
    cli_free(&r);

    /* The mean leaves the underflow and overflow out, and says so. */
    r = cli("query %s", stream);
    assert_non_null(strstr(line_of(r.out, "mean ", buf, sizeof buf), " (in range)"));
    cli_free(&r);
}

static void test_query_ranged(void **state)
{
    (void)state;
    check_ranged("i32", "q/i32", -1000, 3000, -2000, 5000);
    check_ranged("u16", "q/u16", 100, 4196, 0, 4500); /* a 12-bit sensor, 16 values a bin */
}

/* u16 over a range of 256: one integer per bin, so the quantiles are exact. */
static void test_u16_exact(void **state)
{
    (void)state;
    enum { N = 3000 };
    uint16_t raw[N];
    int64_t v[N];
    for (size_t i = 0; i < N; i++) {
        v[i] = 40000 + (int64_t)(th_rand() % 256);
        tally_put_u16((uint8_t *)&raw[i], (uint16_t)v[i]);
    }
    qsort(v, N, sizeof *v, th_cmp_i64);
    write_file("u16x.raw", raw, sizeof raw);
    expect_status(cli("hist --type u16 --range 40000 40256 --stream q/u16x --in u16x.raw "
                      "> /dev/null"),
                  0, NULL);
    cli_result_t r = cli("query q/u16x");
    assert_int_equal(r.status, 0);
    char want[64], buf[256];
    snprintf(want, sizeof want, "p50        %" PRId64, exact_q(v, N, 500000));
    assert_string_equal(line_of(r.out, "p50", buf, sizeof buf), want);
    snprintf(want, sizeof want, "p99        %" PRId64, exact_q(v, N, 990000));
    assert_string_equal(line_of(r.out, "p99", buf, sizeof buf), want);
    cli_free(&r);
}

/* ---- rgb, rgba --------------------------------------------------------------------------------
 */

/* `tally query` of the rgba stream: one column per channel, with the counts, the lowest bins
 * and the medians that bins (the channels' histograms of `pixels` pixels) imply. */
static void check_rgba_summary(uint64_t bins[4][256], int pixels)
{
    cli_result_t r = cli("query q/rgba");
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "type       rgba8, 256 bins per channel"));
    char buf[256];
    assert_non_null(strstr(line_of(r.out, "channel", buf, sizeof buf), " r "));
    /* One right-aligned column per channel: the counts, the lowest bins, the medians. */
    int v[4];
    assert_int_equal(sscanf(line_of(r.out, "count", buf, sizeof buf), "count %d %d %d %d", &v[0],
                            &v[1], &v[2], &v[3]),
                     4);
    for (int k = 0; k < 4; k++)
        assert_int_equal(v[k], pixels);
    assert_int_equal(sscanf(line_of(r.out, "min ", buf, sizeof buf), "min %d %d %d %d", &v[0],
                            &v[1], &v[2], &v[3]),
                     4);
    for (int k = 0; k < 4; k++) {
        int lowest = 0;
        while (!bins[k][lowest])
            lowest++;
        assert_int_equal(v[k], lowest);
    }
    assert_int_equal(sscanf(line_of(r.out, "p50 ", buf, sizeof buf), "p50 %d %d %d %d", &v[0],
                            &v[1], &v[2], &v[3]),
                     4);
    for (int k = 0; k < 4; k++) { /* nearest rank from the bins: exact for bytes */
        uint64_t seen = 0, rank = (pixels + 1) / 2;
        int b = 0;
        while ((seen += bins[k][b]) < rank)
            b++;
        assert_int_equal(v[k], b);
    }
    cli_free(&r);
}

/* rgb from --text: three byte tokens a pixel; a partial pixel is an input error. */
static void check_rgb_text(void)
{
    write_file("px.txt", "1 2 3 1 200 3\n", 14);
    cli_result_t r = cli("hist --type rgb --text --in px.txt");
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "r 1 2\n"));
    assert_non_null(strstr(r.out, "g 2 1\ng 3 0\n"));
    assert_non_null(strstr(r.out, "g 200 1\n"));
    assert_non_null(strstr(r.out, "b 3 2\n"));
    cli_free(&r);
    write_file("px2.txt", "1 2 3 4\n", 8);
    expect_status(cli("hist --type rgb --text --in px2.txt"), 2, "whole number");
    expect_status(cli("hist --type u16 --text --in px2.txt"), 2, "--range");
    expect_status(cli("hist --type u16 --range 0 70000 --text --in px2.txt"), 2, "65536");
    expect_status(cli("hist --type rgb --range 0 10 --text --in px2.txt"), 2, "--range");
    /* The types' names are the help's in the messages too (they said rgb8 and rgba8). */
    expect_status(cli("hist --type rgb16 --text --in px2.txt"), 2,
                  "--type: 'rgb16' is not i32, u8, u16, rgb or rgba");
    write_file("px5.txt", "1 2 3 4 5\n", 10);
    expect_status(cli("hist --type rgba --text --in px5.txt"), 2, "4-value rgba pixels");
    cli_result_t help = cli("hist --help");
    assert_non_null(strstr(help.out, "[--type u8|i32|u16|rgb|rgba]"));
    assert_null(strstr(help.out, "rgb8"));
    cli_free(&help);
    write_file("big.txt", "65536\n", 6);
    expect_status(cli("hist --type u16 --range 0 10 --text --in big.txt"), 2, "out of range");
}

static void test_hist_rgb(void **state)
{
    (void)state;
    enum { PIXELS = 30000 };
    static uint8_t px[4 * PIXELS];
    uint64_t bins[4][256] = {{0}};
    /* Channels with different shapes: R uniform, G dark, B bright, A almost all opaque. */
    for (size_t i = 0; i < PIXELS; i++) {
        uint8_t c[4] = {(uint8_t)th_rand(), (uint8_t)(th_rand() % 64),
                        (uint8_t)(192 + th_rand() % 64), th_rand() % 10 ? 255 : 0};
        memcpy(px + 4 * i, c, 4);
    }
    tr_hist(TALLY_DTYPE_RGBA8, px, PIXELS, 0, 0, &bins[0][0]);
    write_file("frame.rgba", px, sizeof px);
    /* The batch's own histogram: "CHANNEL bin count", 1024 lines. */
    cli_result_t r = cli("hist --type rgba --stream q/rgba --in frame.rgba");
    assert_int_equal(r.status, 0);
    assert_int_equal(count_of(r.out, "\n"), 1024);
    char want[128];
    const char *ch = "rgba";
    for (int k = 0; k < 4; k++) {
        snprintf(want, sizeof want, "%c 200 %" PRIu64 "\n", ch[k], bins[k][200]);
        assert_non_null(strstr(r.out, want));
    }
    cli_free(&r);

    check_rgba_summary(bins, PIXELS);

    r = cli("query --json q/rgba");
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "\"type\":\"rgba8\","));
    assert_int_equal(count_of(r.out, "{\"channel\":"), 4);
    assert_int_equal(count_of(r.out, "{\"lo\":"), 1024);
    cli_free(&r);
    r = cli("query --csv q/rgba");
    assert_int_equal(r.status, 0);
    assert_int_equal(strncmp(r.out, "channel,lo,hi,count,kind\nr,0,1,", 31), 0);
    snprintf(want, sizeof want, "\nb,250,251,%" PRIu64 ",bin\n", bins[2][250]);
    assert_non_null(strstr(r.out, want));
    cli_free(&r);

    check_rgb_text();
}

/* ---- reset versus delete -------------------------------------------------------------------- */

static void test_reset_keeps_delete_removes(void **state)
{
    (void)state;
    write_file("five.txt", "1 2 3 4 5\n", 10);
    expect_status(cli("hist --type i32 --range 0 10 --text --stream rd --in five.txt >/dev/null"),
                  0, NULL);
    expect_status(cli("reset rd"), 0, NULL);
    cli_result_t r = cli("streams");
    assert_non_null(strstr(r.out, "rd\n"));
    cli_free(&r);
    r = cli("query rd");
    assert_int_equal(r.status, 0);
    char buf[256];
    assert_string_equal(line_of(r.out, "count", buf, sizeof buf), "count      0");
    assert_non_null(strstr(r.out, "type       i32, 256 bins over [0, 10)"));
    assert_non_null(strstr(r.out, "last_seq 1")); /* kept: a numbered push continues */
    cli_free(&r);
    /* It kept its range: another range conflicts until it is deleted. */
    expect_status(cli("hist --type i32 --range 0 20 --text --stream rd --in five.txt"), 1,
                  "stream_state");
    expect_status(cli("delete rd"), 0, NULL);
    r = cli("streams");
    assert_null(strstr(r.out, "rd\n"));
    cli_free(&r);
    expect_status(cli("query rd"), 1, "unknown_stream");
    expect_status(cli("delete rd"), 1, "unknown_stream");
    expect_status(cli("hist --type i32 --range 0 20 --text --stream rd --in five.txt >/dev/null"),
                  0, NULL);

    /* The help texts say which is which. */
    r = cli("reset --help");
    assert_non_null(strstr(r.out, "Zero a stream and keep it"));
    assert_non_null(strstr(r.out, "'tally delete'"));
    cli_free(&r);
    r = cli("delete --help");
    assert_non_null(strstr(r.out, "Remove a stream"));
    assert_non_null(strstr(r.out, "'tally reset'"));
    cli_free(&r);
}

/* ---- --last -------------------------------------------------------------------------------------
 */

static void test_query_last(void **state)
{
    (void)state;
    write_file("w1.txt", "1 1 1\n", 6);
    expect_status(cli("hist --text --stream win --in w1.txt > /dev/null"), 0, NULL);
    cli_result_t r = cli("query --last 10s win");
    assert_int_equal(r.status, 0);
    char buf[256];
    assert_string_equal(line_of(r.out, "count", buf, sizeof buf), "count      3");
    assert_non_null(strstr(line_of(r.out, "window", buf, sizeof buf), " UTC ("));
    cli_free(&r);
    r = cli("query --json --last 5s win");
    assert_int_equal(r.status, 0);
    assert_non_null(strstr(r.out, "\"window\":{\"start_ms\":"));
    assert_non_null(strstr(r.out, "\"count\":3,"));
    cli_free(&r);
    /* The daemon keeps 10 s: more is refused by tallyd, bad durations by the CLI. */
    expect_status(cli("query --last 1h win"), 1, "bad_window");
    expect_status(cli("query --last 10x win"), 2, "--last");
    expect_status(cli("query --last 0 win"), 2, "--last");
    expect_status(cli("query --last -5s win"), 2, "--last");
}

/* ---- watch --once (no terminal needed; the live view is test_watch's, under tmux) ---------- */

static void test_watch_once(void **state)
{
    (void)state;
    write_file("once.txt", "10 10 20 250\n", 13);
    expect_status(cli("hist --text --stream once --in once.txt > /dev/null"), 0, NULL);
    setenv("COLUMNS", "80", 1); /* not a terminal: watch takes the width from $COLUMNS */
    cli_result_t r = cli("watch --once --ascii --interval 200ms once");
    assert_int_equal(r.status, 0);
    assert_string_equal(r.err, "");
    assert_null(strchr(r.out, '\x1b')); /* no terminal control */
    char buf[512];
    assert_string_equal(line_of(r.out, "once ", buf, sizeof buf),
                        "once  u8  count 4  rate 0/s  mean 72.5  p50 10  p90 250  p99 250");
    /* 80 columns: bins 0..255 folded into 80; the axis spans them. */
    line_of(r.out, "0 ", buf, sizeof buf);
    assert_int_equal(strlen(buf), 80);
    assert_string_equal(buf + 76, " 255");
    assert_non_null(strstr(r.out, "#"));
    cli_free(&r);

    /* A stream tallyd does not have: exit 1 and the daemon's words, in the frame (no blank
     * lines kept for it) and on stderr; the other streams are still drawn. */
    r = cli("watch --once --ascii --interval 200ms never-made once");
    assert_int_equal(r.status, 1);
    assert_string_equal(r.err, "tally: watch: never-made: unknown_stream: no stream named "
                               "'never-made'\n");
    assert_string_equal(line_of(r.out, "never-made", buf, sizeof buf),
                        "never-made  unknown_stream: no stream named 'never-made'");
    assert_null(strstr(r.out, "\n\n\n")); /* the title's empty status line, then no others */
    assert_non_null(strstr(r.out, "once  u8  count 4"));
    cli_free(&r);

    /* --size draws for that screen whatever $COLUMNS says. */
    r = cli("watch --once --ascii --interval 200ms --size 50x10 once");
    assert_int_equal(r.status, 0);
    line_of(r.out, "0 ", buf, sizeof buf);
    assert_int_equal(strlen(buf), 50);
    cli_free(&r);
    expect_status(cli("watch --once --size 10x2 once"), 2, "--size");
    expect_status(cli("watch --once --size 80 once"), 2, "--size");

    /* Nothing listening: the reason, not a timeout, and no "retrying" (exit 3). The port is
     * held (bound, not listening) so that no other test's process can listen there meanwhile. */
    int held;
    int refusing = th_refusing_port(&held);
    assert_true(refusing > 0);
    r = cli("watch -e tcp://127.0.0.1:%d --once once", refusing);
    close(held);
    assert_int_equal(r.status, 3);
    assert_non_null(strstr(r.err, "cannot connect: Connection refused"));
    assert_null(strstr(r.err, "retrying"));
    cli_free(&r);
    setenv("COLUMNS", "40", 1);
    r = cli("watch --once --ascii --interval 200ms once");
    unsetenv("COLUMNS");
    assert_int_equal(r.status, 0);
    line_of(r.out, "0 ", buf, sizeof buf);
    assert_int_equal(strlen(buf), 40);
    cli_free(&r);
    r = cli("watch --once --interval 1x once");
    assert_int_equal(r.status, 2);
    assert_non_null(strstr(r.err, "--interval"));
    cli_free(&r);
    expect_status(cli("watch"), 2, "at least one");
}

/* watch --once waits for a reply as any command does (--timeout), however short the interval:
 * on a tallyd whose simulated GPU takes 3 s per launch, a query queued behind a hist on its
 * stream is answered after up to 3 s, and --interval 200ms (whose rounds wait 250 ms in the live
 * view) still prints the frame instead of "cannot reach tallyd" (exit 3). */
static void test_watch_once_waits_for_a_slow_reply(void **state)
{
    (void)state;
    th_daemon_t slow;
    const char *args[] = {"--backend", "cuda", "--test-sim-gpus", "1", NULL};
    setenv("TALLYD_TEST_SIM_LATENCY_US", "3000000", 1);
    int started = th_daemon_start(&slow, args);
    unsetenv("TALLYD_TEST_SIM_LATENCY_US");
    assert_int_equal(started, 0);
    void *sock = th_connect(slow.endpoint, 30000);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 1);
    assert_int_equal(tally_req_set_stream(&req, "slow"), TALLY_OK);
    assert_int_equal(th_send_request(sock, &req, "\x0a\x0a\x14\xfa", 4), 0);
    int64_t t0 = th_now_ms();
    while (th_stat(sock, "tallyd_requests_in_flight") < 2) /* the hist on the GPU, the stats */
        assert_true(th_now_ms() - t0 < 30000);
    th_cli_t r =
        th_cli(tmpdir, slow.endpoint, "-t 60000 watch --once --ascii --interval 200ms slow");
    if (r.status != 0)
        fail_msg("exit %d; stderr: %s", r.status, r.err);
    assert_non_null(strstr(r.out, "slow  u8  count 4  "));
    th_cli_free(&r);
    th_reply_t reply;
    assert_int_equal(th_recv_reply(sock, &reply), 0);
    assert_int_equal(reply.rep.status, TALLY_OK);
    th_reply_free(&reply);
    th_close(sock);
    assert_int_equal(th_daemon_stop(&slow, SIGTERM, 20000), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_query_u8_formats),
        cmocka_unit_test(test_query_ranged),
        cmocka_unit_test(test_u16_exact),
        cmocka_unit_test(test_hist_rgb),
        cmocka_unit_test(test_reset_keeps_delete_removes),
        cmocka_unit_test(test_query_last),
        cmocka_unit_test(test_watch_once),
        cmocka_unit_test(test_watch_once_waits_for_a_slow_reply),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
