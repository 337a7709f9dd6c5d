/* SPDX-License-Identifier: Apache-2.0 */
/*
 * hist_view.c — the CLI's views of a stream's histograms (see hist_view.h).
 *
 * The human summary is a small table: one row per figure (count, mean, min, max, p50, p90, p99,
 * and for ranged histograms underflow and overflow), one column per channel, each column as
 * wide as its widest cell. The numbers all come from tally_hist_summarize; a quantile that lies
 * beyond the range is printed as "< lo" or ">= hi", since the bins cannot say more.
 */
#include "hist_view.h"
#include "tally_proto.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static const char *const channel_names[HV_CHANNELS_MAX] = {"r", "g", "b", "a"};

tally_status_t hv_stream_init(hv_stream_t *s, const char *name, const tally_stream_info_t *info)
{
    memset(s, 0, sizeof *s);
    s->name = name;
    s->info = *info;
    if (info->hist_dtype == TALLY_DTYPE_NONE)
        return TALLY_OK;
    unsigned channels = tally_hist_channels(info->hist_dtype);
    if (channels == 0 || channels > HV_CHANNELS_MAX)
        return TALLY_E_REPLY;
    for (unsigned c = 0; c < channels; c++)
        if (tally_hist_from_info(info, c, &s->hist[c]) != TALLY_OK)
            return TALLY_E_REPLY;
    s->channels = channels;
    return TALLY_OK;
}

const char *hv_channel_name(const hv_stream_t *s, unsigned channel)
{
    return s->channels > 1 && channel < HV_CHANNELS_MAX ? channel_names[channel] : NULL;
}

static bool ranged(const hv_stream_t *s)
{
    return s->channels == 1 && s->hist[0].dtype != TALLY_DTYPE_U8;
}

static const char *type_name(const hv_stream_t *s)
{
    const char *name = tally_dtype_name((tally_dtype_t)s->info.hist_dtype);
    return name ? name : "none";
}

/* ---- Human summary ---------------------------------------------------------------------- */

/* The table's rows: count, mean, min, max, one per quantile, and for ranged histograms
 * underflow and overflow. */
enum { ROW_COUNT, ROW_MEAN, ROW_MIN, ROW_MAX, ROW_QUANTILES };
#define ROWS_MAX (ROW_QUANTILES + TALLY_QUANTILES_MAX + 2)
#define CELL 48

static const double default_quantiles[] = {0.50, 0.90, 0.99};

/* The quantiles shown: the ones asked for, else p50, p90, p99. */
static const double *shown_quantiles(const hv_stream_t *s, size_t *n)
{
    *n = s->nquantiles ? s->nquantiles : 3;
    return s->nquantiles ? s->quantiles : default_quantiles;
}

/* The rows' names for s: "count" ... "p99.9" ... "overflow"; returns how many. */
static unsigned row_names(const hv_stream_t *s, bool ranged_rows, char names[ROWS_MAX][CELL])
{
    static const char *const fixed[] = {"count", "mean", "min", "max"};
    unsigned r = 0;
    for (; r < ROW_QUANTILES; r++)
        snprintf(names[r], CELL, "%s", fixed[r]);
    size_t nq;
    const double *qs = shown_quantiles(s, &nq);
    for (size_t i = 0; i < nq; i++)
        tally_quantile_name(qs[i], names[r++], CELL);
    if (ranged_rows) {
        snprintf(names[r++], CELL, "underflow");
        snprintf(names[r++], CELL, "overflow");
    }
    return r;
}

static void quantile_cell(const tally_hist_t *h, const tally_quantile_t *q, char *cell)
{
    if (q->side < 0)
        snprintf(cell, CELL, "< %" PRId64, h->lo);
    else if (q->side > 0)
        snprintf(cell, CELL, ">= %" PRId64, h->hi);
    else
        snprintf(cell, CELL, "%" PRId64, q->value);
}

/* The lowest or highest non-empty bin: its value for one value per bin, else "bin B [lo, hi)". */
static void bin_cell(const tally_hist_t *h, int bin, char *cell)
{
    if (bin < 0) {
        snprintf(cell, CELL, "-");
        return;
    }
    int64_t lo = tally_hist_edge(h, (unsigned)bin), hi = tally_hist_edge(h, (unsigned)bin + 1);
    if (hi - lo == 1)
        snprintf(cell, CELL, "%" PRId64, lo);
    else
        snprintf(cell, CELL, "bin %d [%" PRId64 ", %" PRId64 ")", bin, lo, hi);
}

/* One channel's column. The mean of a ranged histogram leaves the underflow and overflow out,
 * and says so. */
static void fill_cells(const hv_stream_t *s, const tally_hist_t *h, char cells[ROWS_MAX][CELL])
{
    tally_hist_summary_t sum;
    tally_hist_summarize(h, &sum);
    snprintf(cells[ROW_COUNT], CELL, "%" PRIu64, sum.count);
    if (sum.in_range)
        snprintf(cells[ROW_MEAN], CELL, "%.2f%s", sum.mean,
                 h->dtype != TALLY_DTYPE_U8 ? " (in range)" : "");
    else
        snprintf(cells[ROW_MEAN], CELL, "-");
    bin_cell(h, sum.min_bin, cells[ROW_MIN]);
    bin_cell(h, sum.max_bin, cells[ROW_MAX]);
    size_t nq;
    const double *qs = shown_quantiles(s, &nq);
    unsigned r = ROW_QUANTILES;
    for (size_t i = 0; i < nq; i++, r++) {
        tally_quantile_t q;
        if (sum.count && tally_hist_quantile(h, qs[i], &q) == TALLY_OK)
            quantile_cell(h, &q, cells[r]);
        else
            snprintf(cells[r], CELL, "-");
    }
    snprintf(cells[r++], CELL, "%" PRIu64, sum.underflow);
    snprintf(cells[r], CELL, "%" PRIu64, sum.overflow);
}

/* "i32, 256 bins over [0, 1000), 3-4 values each". */
static tally_status_t type_line(const hv_stream_t *s, tally_buf_t *out)
{
    if (!s->channels)
        return tally_buf_printf(out, "%-10s none (no hist on this stream yet)\n", "type");
    const tally_hist_t *h = &s->hist[0];
    if (s->channels > 1)
        return tally_buf_printf(out, "%-10s %s, 256 bins per channel, one per byte value\n", "type",
                                type_name(s));
    if (!ranged(s))
        return tally_buf_printf(out, "%-10s %s, 256 bins, one per byte value\n", "type",
                                type_name(s));
    uint64_t width = (uint64_t)(h->hi - h->lo), narrow = width / 256, wide = (width + 255) / 256;
    char each[64];
    if (narrow == wide)
        snprintf(each, sizeof each, "%" PRIu64 " value%s each", wide, wide == 1 ? "" : "s");
    else
        snprintf(each, sizeof each, "%" PRIu64 "-%" PRIu64 " values each", narrow, wide);
    return tally_buf_printf(out, "%-10s %s, 256 bins over [%" PRId64 ", %" PRId64 "), %s\n", "type",
                            type_name(s), h->lo, h->hi, each);
}

static void format_utc(uint64_t ms, char *buf, size_t cap)
{
    time_t t = (time_t)(ms / 1000);
    struct tm tm;
    gmtime_r(&t, &tm);
    size_t n = strftime(buf, cap, "%H:%M:%S", &tm);
    snprintf(buf + n, cap - n, ".%03u", (unsigned)(ms % 1000));
}

static tally_status_t window_line(const hv_stream_t *s, tally_buf_t *out)
{
    if (!s->window_end_ms)
        return TALLY_OK;
    char from[32], to[32];
    format_utc(s->window_start_ms, from, sizeof from);
    format_utc(s->window_end_ms, to, sizeof to);
    double secs = (double)(s->window_end_ms - s->window_start_ms) / 1000.0;
    char rate[32];
    hv_short_count(secs > 0 ? (double)s->info.hist_total / secs : 0, rate, sizeof rate);
    return tally_buf_printf(out, "%-10s %s - %s UTC (%.3f s), %s values/s\n", "window", from, to,
                            secs, rate);
}

static tally_status_t counters_line(const tally_stream_info_t *i, tally_buf_t *out)
{
    tally_status_t st = tally_buf_printf(
        out,
        "%-10s batches %" PRIu64 ", elements %" PRIu64 ", bytes %" PRIu64 ", last_seq %" PRIu64,
        "counters", i->batches, i->elements, i->bytes, i->last_seq);
    if (st == TALLY_OK && i->filter_seen)
        st = tally_buf_printf(out, "; filter kept %" PRIu64 " of %" PRIu64, i->filter_kept,
                              i->filter_seen);
    if (st == TALLY_OK && i->scan_elements)
        st = tally_buf_printf(out, "; scan carry %" PRId64 " after %" PRIu64 " elements",
                              i->scan_carry, i->scan_elements);
    return st == TALLY_OK ? tally_buf_printf(out, "\n") : st;
}

static tally_status_t table(const hv_stream_t *s, tally_buf_t *out)
{
    char cells[HV_CHANNELS_MAX][ROWS_MAX][CELL];
    char names[ROWS_MAX][CELL];
    unsigned rows = row_names(s, ranged(s), names);
    int width[HV_CHANNELS_MAX];
    for (unsigned c = 0; c < s->channels; c++) {
        fill_cells(s, &s->hist[c], cells[c]);
        width[c] = s->channels > 1 ? 1 : 0;
        for (unsigned r = 0; r < rows; r++)
            if ((int)strlen(cells[c][r]) > width[c])
                width[c] = (int)strlen(cells[c][r]);
    }
    tally_status_t st = TALLY_OK;
    if (s->channels > 1) { /* the channel names over right-aligned columns */
        st = tally_buf_printf(out, "%-10s", "channel");
        for (unsigned c = 0; c < s->channels && st == TALLY_OK; c++)
            st = tally_buf_printf(out, " %*s", width[c], hv_channel_name(s, c));
        if (st == TALLY_OK)
            st = tally_buf_printf(out, "\n");
    }
    for (unsigned r = 0; r < rows && st == TALLY_OK; r++) {
        st = tally_buf_printf(out, "%-10s", names[r]);
        for (unsigned c = 0; c < s->channels && st == TALLY_OK; c++)
            st = s->channels > 1 ? tally_buf_printf(out, " %*s", width[c], cells[c][r])
                                 : tally_buf_printf(out, " %s", cells[c][r]);
        if (st == TALLY_OK)
            st = tally_buf_printf(out, "\n");
    }
    return st;
}

tally_status_t hv_summary_text(const hv_stream_t *s, tally_buf_t *out)
{
    tally_status_t st = tally_buf_printf(out, "%-10s %s\n", "stream", s->name);
    if (st == TALLY_OK)
        st = type_line(s, out);
    if (st == TALLY_OK)
        st = window_line(s, out);
    if (st == TALLY_OK && s->channels)
        st = table(s, out);
    if (st == TALLY_OK)
        st = counters_line(&s->info, out);
    return st;
}

/* ---- JSON and CSV ------------------------------------------------------------------------- */

/* One rendering for the CLI and tallyd's HTTP API: libtally's (tally_json.c). */
tally_status_t hv_json(const hv_stream_t *s, tally_buf_t *out)
{
    tally_stream_view_t view = {.name = s->name,
                                .info = &s->info,
                                .window_start_ms = s->window_start_ms,
                                .window_end_ms = s->window_end_ms,
                                .quantiles = s->quantiles,
                                .nquantiles = s->nquantiles};
    tally_status_t st = tally_stream_json(&view, out);
    return st == TALLY_OK ? tally_buf_printf(out, "\n") : st;
}

tally_status_t hv_csv(const hv_stream_t *s, tally_buf_t *out)
{
    if (!s->channels)
        return tally_buf_printf(out,
                                s->nquantiles ? "quantile,q,value,side\n" : "lo,hi,count,kind\n");
    tally_status_t st = TALLY_OK;
    for (unsigned c = 0; c < s->channels && st == TALLY_OK; c++) {
        const char *label = hv_channel_name(s, c);
        st = s->nquantiles ? tally_hist_csv_quantiles(&s->hist[c], label, c == 0, s->quantiles,
                                                      s->nquantiles, out)
                           : tally_hist_csv(&s->hist[c], label, c == 0, out);
    }
    return st;
}

/* ---- Bars --------------------------------------------------------------------------------- */

void hv_fold(const tally_hist_t *h, unsigned cols, double *out)
{
    for (unsigned c = 0; c < cols; c++) {
        unsigned from = c * TALLY_HIST_BINS / cols, to = (c + 1) * TALLY_HIST_BINS / cols;
        uint64_t count = 0;
        for (unsigned b = from; b < to; b++)
            count += h->bins[b];
        int64_t integers = tally_hist_edge(h, to) - tally_hist_edge(h, from);
        out[c] = integers > 0 ? (double)count / (double)integers : 0;
    }
}

/* A column's height in eighths of a line, 0..rows*8. */
static unsigned bar_height(double v, double max, unsigned rows, bool log)
{
    if (!(v > 0))
        return 0;
    double f = log ? log1p(v) / log1p(max) : v / max;
    unsigned h = (unsigned)lround(f * rows * 8);
    return h ? h : 1;
}

tally_status_t hv_bars(const double *columns, unsigned cols, unsigned rows, bool log, bool utf8,
                       tally_buf_t *out)
{
    /* U+2581..U+2588: a lower eighth up to a full block, three bytes each in UTF-8. */
    static const char *const blocks[9] = {" ",      "\u2581", "\u2582", "\u2583", "\u2584",
                                          "\u2585", "\u2586", "\u2587", "\u2588"};
    double max = 0;
    for (unsigned c = 0; c < cols; c++)
        max = columns[c] > max ? columns[c] : max;
    tally_status_t st = tally_buf_reserve(out, (size_t)rows * (cols * 3 + 1));
    for (unsigned r = 0; r < rows && st == TALLY_OK; r++) {
        unsigned base = (rows - 1 - r) * 8; /* eighths below this line */
        for (unsigned c = 0; c < cols && st == TALLY_OK; c++) {
            unsigned h = bar_height(columns[c], max, rows, log);
            unsigned level = h <= base ? 0 : h - base >= 8 ? 8 : h - base;
            const char *cell = utf8 ? blocks[level] : level == 8 ? "#" : level ? "." : " ";
            st = tally_buf_append(out, cell, strlen(cell));
        }
        if (st == TALLY_OK)
            st = tally_buf_append(out, "\n", 1);
    }
    return st;
}

void hv_short_count(double v, char *buf, size_t cap)
{
    static const char suffix[] = {'k', 'M', 'G', 'T', 'P', 'E'};
    if (v < 1000) {
        snprintf(buf, cap, v == floor(v) ? "%.0f" : "%.1f", v);
        return;
    }
    int k = -1;
    while (v >= 999.5 && k < 5) {
        v /= 1000;
        k++;
    }
    snprintf(buf, cap, v < 9.995 ? "%.2f%c" : v < 99.95 ? "%.1f%c" : "%.0f%c", v, suffix[k]);
}
