/* SPDX-License-Identifier: Apache-2.0 */
/*
 * hist_view.h — how the `tally` CLI shows a stream's histograms: the human summary of `tally
 * query`, its --json and --csv forms, and the bar charts of `tally watch`.
 *
 * A stream's query record is turned into one tally_hist_t per channel (one for u8, i32 and u16
 * streams, three or four for rgb8/rgba8) and each is summarised by libtally
 * (tally_hist_summarize); this file only lays the numbers out. Everything renders into a
 * tally_buf_t, so the same text goes to stdout, to the terminal of `watch`, or to a test.
 */
#ifndef TALLY_HIST_VIEW_H
#define TALLY_HIST_VIEW_H

#include <stdbool.h>
#include <stdint.h>

#include "tally.h"

#define HV_CHANNELS_MAX 4

/* A stream as the views show it. */
typedef struct {
    const char *name;
    tally_stream_info_t info;
    unsigned channels; /* 0 while the stream has no histogram */
    tally_hist_t hist[HV_CHANNELS_MAX];
    /* A window query: the interval the counts cover, ms since the epoch; 0, 0 for all time. */
    uint64_t window_start_ms, window_end_ms;
    /* The quantiles to show (`tally query --quantile`), nquantiles <= TALLY_QUANTILES_MAX; 0
     * for the default p50, p90, p99 (and for CSV: the bins instead of the quantiles). */
    const double *quantiles;
    size_t nquantiles;
} hv_stream_t;

/* Fills *s from a query record; TALLY_E_REPLY for a histogram type this CLI cannot show. */
tally_status_t hv_stream_init(hv_stream_t *s, const char *name, const tally_stream_info_t *info);

/* The channel's name in a multi-channel stream ("r", "g", "b", "a"); NULL for one channel. */
const char *hv_channel_name(const hv_stream_t *s, unsigned channel);

/* `tally query`: the human summary, the JSON object (one line) and the CSV of the bins (of the
 * quantiles, when s->nquantiles > 0). */
tally_status_t hv_summary_text(const hv_stream_t *s, tally_buf_t *out);
tally_status_t hv_json(const hv_stream_t *s, tally_buf_t *out);
tally_status_t hv_csv(const hv_stream_t *s, tally_buf_t *out);

/* ---- Bars (tally watch) ------------------------------------------------------------------ */

/* Folds the 256 bins into `cols` columns (1..256): column c covers bins
 * [c * 256 / cols, (c + 1) * 256 / cols), and out[c] is their count per integer (their counts
 * over the integers they hold), so columns of 2 and of 3 bins, and i32 bins of 3 and of 4
 * integers, compare fairly: uniform data draws a flat line. A column with no integers is 0. */
void hv_fold(const tally_hist_t *h, unsigned cols, double *out);

/* Draws columns as vertical bars `rows` lines high, appending `rows` lines (each ended by '\n')
 * of `cols` cells. Heights are in eighths of a line, scaled so the largest column fills all
 * rows: linear, or with `log` by log(1 + value); a non-zero column is always at least one
 * eighth high, an empty one blank. With `utf8` the cells are the block elements U+2581..U+2588,
 * otherwise ASCII ('#' a full cell, '.' a partly filled top cell). */
tally_status_t hv_bars(const double *columns, unsigned cols, unsigned rows, bool log, bool utf8,
                       tally_buf_t *out);

/* A count in a short human form: 999, 12.3k, 4.56M, 7.89G, ... */
void hv_short_count(double v, char *buf, size_t cap);

#endif
