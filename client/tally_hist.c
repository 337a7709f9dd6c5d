/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_hist.c — summaries of tallyd's 256-bin histograms: count, mean, the non-empty range,
 * quantiles estimated from the bins, and the JSON and CSV renderings `tally query` prints.
 *
 * Everything works on the integer bin edges: bin b of a histogram over [lo, hi) holds exactly
 * the integers [edge(b), edge(b + 1)), edge(b) = lo + ceil(b * (hi - lo) / 256), which is the
 * inverse of tally_hist_bin_i32 (x goes to bin floor((x - lo) * 256 / (hi - lo))). A u8
 * histogram is the special case lo = 0, hi = 256, one integer per bin, so its mean and
 * quantiles are exact. With wider bins the values of a bin are taken as spread evenly over its
 * integers; the quantile rule is spelled out in tally.h (tally_hist_quantile) and
 * docs/histograms.md.
 *
 * Counts are uint64 and ranks are computed in 128-bit integers, never in floating point, so
 * p90 of 10 values is the 9th value, not the 10th that 0.9 * 10 = 9.000000000000002 would give.
 */
#include "tally.h"
#include "tally_proto.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* Quantiles are taken to the nearest millionth, so ranks stay exact integer arithmetic. */
#define QUANTILE_SCALE 1000000u

tally_status_t tally_hist_from_info(const tally_stream_info_t *info, unsigned channel,
                                    tally_hist_t *hist)
{
    if (!info || !hist || channel >= tally_hist_channels(info->hist_dtype))
        return TALLY_E_ARG; /* also: no histogram yet, an unknown type */
    memset(hist, 0, sizeof *hist);
    if (tally_hist_ranged(info->hist_dtype)) {
        if (info->hist_lo >= info->hist_hi)
            return TALLY_E_ARG;
        hist->dtype = (tally_dtype_t)info->hist_dtype;
        hist->lo = info->hist_lo;
        hist->hi = info->hist_hi;
        hist->underflow = info->hist_underflow;
        hist->overflow = info->hist_overflow;
    } else { /* u8, and each byte channel of rgb8/rgba8 */
        hist->dtype = TALLY_DTYPE_U8;
        hist->lo = 0;
        hist->hi = TALLY_HIST_BINS;
    }
    memcpy(hist->bins, info->bins + (size_t)channel * TALLY_HIST_BINS, sizeof hist->bins);
    return TALLY_OK;
}

int64_t tally_hist_edge(const tally_hist_t *hist, unsigned b)
{
    return tally_hist_edge_at(hist->lo, hist->hi, b);
}

/* The part of the type's domain below and above the range: the underflow and overflow
 * entries' edges. */
static void domain(const tally_hist_t *hist, int64_t *min, int64_t *end)
{
    if (hist->dtype == TALLY_DTYPE_I32) {
        *min = INT32_MIN;
        *end = (int64_t)INT32_MAX + 1;
    } else if (hist->dtype == TALLY_DTYPE_U16) {
        *min = 0;
        *end = (int64_t)UINT16_MAX + 1;
    } else {
        *min = hist->lo;
        *end = hist->hi;
    }
}

static bool has_outer_entries(const tally_hist_t *hist)
{
    return hist->dtype != TALLY_DTYPE_U8;
}

static uint64_t in_range_count(const tally_hist_t *hist)
{
    uint64_t n = 0;
    for (unsigned b = 0; b < TALLY_HIST_BINS; b++)
        n += hist->bins[b];
    return n;
}

/* The value of rank j (1-based) among the c values of bin b (see tally_hist_quantile). */
static int64_t value_in_bin(const tally_hist_t *hist, unsigned b, uint64_t j, uint64_t c)
{
    int64_t start = tally_hist_edge(hist, b);
    uint64_t w = (uint64_t)(tally_hist_edge(hist, b + 1) - start);
    if (w == 0) /* counts in a bin with no integers: not from tallyd; stay at the edge */
        return start;
    unsigned __int128 num = (unsigned __int128)(2 * j - 1) * w;
    return start + (int64_t)(num / ((unsigned __int128)2 * c));
}

/* q in millionths (the precision every quantile is taken to); -1 outside [0, 1] or NaN. */
static int64_t q_micros(double q)
{
    if (!(q >= 0.0 && q <= 1.0))
        return -1;
    return (int64_t)(q * QUANTILE_SCALE + 0.5);
}

/* v / 10^digits in decimal, without trailing zeros: (500000, 6) "0.5", (999000, 4) "99.9". */
static void decimal_text(uint64_t v, unsigned digits, char *buf, size_t cap)
{
    uint64_t unit = 1;
    for (unsigned i = 0; i < digits; i++)
        unit *= 10;
    int n = snprintf(buf, cap, "%" PRIu64 ".%0*" PRIu64, v / unit, (int)digits, v % unit);
    while (n > 0 && (size_t)n < cap && buf[n - 1] == '0')
        buf[--n] = '\0';
    if (n > 0 && (size_t)n < cap && buf[n - 1] == '.')
        buf[--n] = '\0';
}

tally_status_t tally_quantile_name(double q, char *buf, size_t cap)
{
    int64_t micros = q_micros(q);
    if (micros < 0 || !buf || cap < TALLY_QUANTILE_NAME_MAX)
        return TALLY_E_ARG;
    buf[0] = 'p';
    decimal_text((uint64_t)micros, 4, buf + 1, cap - 1); /* percent = millionths / 10^4 */
    return TALLY_OK;
}

const char *tally_quantile_side_name(int side)
{
    return side < 0 ? "underflow" : side > 0 ? "overflow" : "in_range";
}

tally_status_t tally_hist_quantile(const tally_hist_t *hist, double q, tally_quantile_t *out)
{
    if (!hist || !out || q_micros(q) < 0)
        return TALLY_E_ARG;
    uint64_t in_range = in_range_count(hist);
    unsigned __int128 n = (unsigned __int128)hist->underflow + in_range + hist->overflow;
    if (n == 0)
        return TALLY_E_ARG;
    uint64_t scaled = (uint64_t)q_micros(q);
    unsigned __int128 rank = (n * scaled + QUANTILE_SCALE - 1) / QUANTILE_SCALE;
    if (rank == 0)
        rank = 1;
    if (rank <= hist->underflow) {
        *out = (tally_quantile_t){.value = hist->lo, .side = -1};
        return TALLY_OK;
    }
    unsigned __int128 before = hist->underflow;
    for (unsigned b = 0; b < TALLY_HIST_BINS; b++) {
        uint64_t c = hist->bins[b];
        if (rank <= before + c) {
            uint64_t j = (uint64_t)(rank - before);
            *out = (tally_quantile_t){.value = value_in_bin(hist, b, j, c), .side = 0};
            return TALLY_OK;
        }
        before += c;
    }
    *out = (tally_quantile_t){.value = hist->hi, .side = 1};
    return TALLY_OK;
}

void tally_hist_summarize(const tally_hist_t *hist, tally_hist_summary_t *out)
{
    memset(out, 0, sizeof *out);
    out->min_bin = out->max_bin = -1;
    long double sum = 0;
    for (unsigned b = 0; b < TALLY_HIST_BINS; b++) {
        uint64_t c = hist->bins[b];
        if (!c)
            continue;
        if (out->min_bin < 0)
            out->min_bin = (int)b;
        out->max_bin = (int)b;
        out->in_range += c;
        /* The centre of the bin's integers, exact in long double (|edges| <= 2^31). */
        long double centre = ((long double)tally_hist_edge(hist, b) +
                              (long double)tally_hist_edge(hist, b + 1) - 1.0L) /
                             2.0L;
        sum += centre * (long double)c;
    }
    out->underflow = hist->underflow;
    out->overflow = hist->overflow;
    out->count = out->in_range + hist->underflow + hist->overflow;
    out->mean = out->in_range ? (double)(sum / (long double)out->in_range) : NAN;
    if (out->count) {
        tally_hist_quantile(hist, 0.50, &out->p50);
        tally_hist_quantile(hist, 0.90, &out->p90);
        tally_hist_quantile(hist, 0.99, &out->p99);
    }
}

/* ---- Renderers ------------------------------------------------------------------------------ */

/* One entry of the bins list: entry 0 is the underflow for histograms that have one, then the
 * 256 bins, then the overflow. Returns the number of entries. */
static unsigned entry_count(const tally_hist_t *hist)
{
    return TALLY_HIST_BINS + (has_outer_entries(hist) ? 2u : 0u);
}

static void entry(const tally_hist_t *hist, unsigned i, int64_t *lo, int64_t *hi, uint64_t *count)
{
    int64_t min, end;
    domain(hist, &min, &end);
    if (has_outer_entries(hist)) {
        if (i == 0) {
            *lo = min, *hi = hist->lo, *count = hist->underflow;
            return;
        }
        if (i == TALLY_HIST_BINS + 1) {
            *lo = hist->hi, *hi = end, *count = hist->overflow;
            return;
        }
        i--;
    }
    *lo = tally_hist_edge(hist, i);
    *hi = tally_hist_edge(hist, i + 1);
    *count = hist->bins[i];
}

static tally_status_t json_bin_ref(const tally_hist_t *hist, const char *key, int bin,
                                   tally_buf_t *out)
{
    if (bin < 0)
        return tally_buf_printf(out, "\"%s\":null,", key);
    return tally_buf_printf(out, "\"%s\":{\"bin\":%d,\"lo\":%" PRId64 ",\"hi\":%" PRId64 "},", key,
                            bin, tally_hist_edge(hist, (unsigned)bin),
                            tally_hist_edge(hist, (unsigned)bin + 1));
}

/* "quantiles":{"p50":{"q":0.5,"value":V,"side":"in_range"},...}, or null when empty. */
static tally_status_t json_quantiles(const tally_hist_t *hist, uint64_t count, const double *qs,
                                     size_t n, tally_buf_t *out)
{
    if (!count)
        return tally_buf_printf(out, "\"quantiles\":null,");
    tally_status_t st = tally_buf_printf(out, "\"quantiles\":{");
    for (size_t i = 0; i < n && st == TALLY_OK; i++) {
        char name[TALLY_QUANTILE_NAME_MAX], q[16];
        tally_quantile_t v;
        st = tally_quantile_name(qs[i], name, sizeof name);
        if (st == TALLY_OK)
            st = tally_hist_quantile(hist, qs[i], &v);
        if (st != TALLY_OK)
            break;
        decimal_text((uint64_t)q_micros(qs[i]), 6, q, sizeof q);
        st = tally_buf_printf(out, "%s\"%s\":{\"q\":%s,\"value\":%" PRId64 ",\"side\":\"%s\"}",
                              i ? "," : "", name, q, v.value, tally_quantile_side_name(v.side));
    }
    return st == TALLY_OK ? tally_buf_printf(out, "},") : st;
}

static tally_status_t json_head(const tally_hist_t *hist, const tally_hist_summary_t *s,
                                const double *qs, size_t nq, tally_buf_t *out)
{
    tally_status_t st = tally_buf_printf(out,
                                         "\"count\":%" PRIu64 ",\"in_range\":%" PRIu64
                                         ",\"underflow\":%" PRIu64 ",\"overflow\":%" PRIu64 ",",
                                         s->count, s->in_range, s->underflow, s->overflow);
    if (st == TALLY_OK)
        st = s->in_range ? tally_buf_printf(out, "\"mean\":%.10g,", s->mean)
                         : tally_buf_printf(out, "\"mean\":null,");
    if (st == TALLY_OK)
        st = json_bin_ref(hist, "min", s->min_bin, out);
    if (st == TALLY_OK)
        st = json_bin_ref(hist, "max", s->max_bin, out);
    return st == TALLY_OK ? json_quantiles(hist, s->count, qs, nq, out) : st;
}

/* Every quantile in [0, 1], and not too many. */
static bool quantiles_valid(const double *qs, size_t n)
{
    if (n > TALLY_QUANTILES_MAX || (n && !qs))
        return false;
    for (size_t i = 0; i < n; i++)
        if (q_micros(qs[i]) < 0)
            return false;
    return true;
}

static const double default_quantiles[] = {0.50, 0.90, 0.99};

tally_status_t tally_hist_json(const tally_hist_t *hist, tally_buf_t *out)
{
    return tally_hist_json_quantiles(hist, default_quantiles, 3, out);
}

tally_status_t tally_hist_json_quantiles(const tally_hist_t *hist, const double *qs, size_t n,
                                         tally_buf_t *out)
{
    if (!hist || !out || !quantiles_valid(qs, n))
        return TALLY_E_ARG;
    tally_hist_summary_t s;
    tally_hist_summarize(hist, &s);
    tally_status_t st = json_head(hist, &s, qs, n, out);
    if (st == TALLY_OK)
        st = tally_buf_printf(out, "\"bins\":[");
    unsigned entries = entry_count(hist);
    for (unsigned i = 0; i < entries && st == TALLY_OK; i++) {
        int64_t lo, hi;
        uint64_t count;
        entry(hist, i, &lo, &hi, &count);
        st =
            tally_buf_printf(out, "%s{\"lo\":%" PRId64 ",\"hi\":%" PRId64 ",\"count\":%" PRIu64 "}",
                             i ? "," : "", lo, hi, count);
    }
    return st == TALLY_OK ? tally_buf_printf(out, "]") : st;
}

tally_status_t tally_hist_csv(const tally_hist_t *hist, const char *label, bool header,
                              tally_buf_t *out)
{
    if (!hist || !out)
        return TALLY_E_ARG;
    tally_status_t st = TALLY_OK;
    if (header)
        st = tally_buf_printf(out, "%slo,hi,count,kind\n", label ? "channel," : "");
    unsigned n = entry_count(hist);
    for (unsigned i = 0; i < n && st == TALLY_OK; i++) {
        int64_t lo, hi;
        uint64_t count;
        entry(hist, i, &lo, &hi, &count);
        const char *kind = !has_outer_entries(hist) ? "bin"
                           : i == 0                 ? "underflow"
                           : i == n - 1             ? "overflow"
                                                    : "bin";
        st = tally_buf_printf(out, "%s%s%" PRId64 ",%" PRId64 ",%" PRIu64 ",%s\n",
                              label ? label : "", label ? "," : "", lo, hi, count, kind);
    }
    return st;
}

tally_status_t tally_hist_csv_quantiles(const tally_hist_t *hist, const char *label, bool header,
                                        const double *qs, size_t n, tally_buf_t *out)
{
    if (!hist || !out || !quantiles_valid(qs, n))
        return TALLY_E_ARG;
    tally_status_t st = TALLY_OK;
    if (header)
        st = tally_buf_printf(out, "%squantile,q,value,side\n", label ? "channel," : "");
    for (size_t i = 0; i < n && st == TALLY_OK; i++) {
        char name[TALLY_QUANTILE_NAME_MAX], q[16];
        tally_quantile_t v;
        tally_quantile_name(qs[i], name, sizeof name);
        decimal_text((uint64_t)q_micros(qs[i]), 6, q, sizeof q);
        if (tally_hist_quantile(hist, qs[i], &v) != TALLY_OK) /* empty: no value to give */
            st = tally_buf_printf(out, "%s%s%s,%s,,\n", label ? label : "", label ? "," : "", name,
                                  q);
        else
            st = tally_buf_printf(out, "%s%s%s,%s,%" PRId64 ",%s\n", label ? label : "",
                                  label ? "," : "", name, q, v.value,
                                  tally_quantile_side_name(v.side));
    }
    return st;
}
