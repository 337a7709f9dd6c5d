/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_json.c — a stream's record as one JSON object (tally.h: tally_stream_json), the one
 * rendering that `tally query --json` prints and tallyd's HTTP API serves, so the two cannot
 * drift apart; web/schema/stream.json describes it and the tests check both against it.
 *
 * The counters come first, as the record holds them; the histogram's summary and bins are
 * tally_hist_json_quantiles's, per channel for rgb8/rgba8.
 */
#include "tally.h"
#include "tally_proto.h"

#include <inttypes.h>

static const char *const channel_names[] = {"r", "g", "b", "a"};
#define CHANNELS_MAX (sizeof channel_names / sizeof channel_names[0])

static const double default_quantiles[] = {0.50, 0.90, 0.99};

tally_status_t tally_json_string(const char *str, tally_buf_t *out)
{
    if (!str || !out)
        return TALLY_E_ARG;
    tally_status_t st = tally_buf_printf(out, "\"");
    for (const unsigned char *p = (const unsigned char *)str; *p && st == TALLY_OK; p++) {
        if (*p == '"' || *p == '\\')
            st = tally_buf_printf(out, "\\%c", *p);
        else if (*p < 0x20)
            st = tally_buf_printf(out, "\\u%04x", *p);
        else
            st = tally_buf_append(out, p, 1);
    }
    return st == TALLY_OK ? tally_buf_printf(out, "\"") : st;
}

/* The stream's name, type, range and counters, and the window of a window query. */
static tally_status_t json_head(const tally_stream_view_t *v, const tally_hist_t *first,
                                unsigned channels, tally_buf_t *out)
{
    const tally_stream_info_t *i = v->info;
    const char *type = tally_dtype_name((tally_dtype_t)i->hist_dtype);
    tally_status_t st = tally_buf_printf(out, "{\"stream\":");
    if (st == TALLY_OK)
        st = tally_json_string(v->name, out);
    if (st == TALLY_OK)
        st = channels ? tally_buf_printf(out, ",\"type\":\"%s\"", type)
                      : tally_buf_printf(out, ",\"type\":null");
    if (st == TALLY_OK && channels == 1 && first->dtype != TALLY_DTYPE_U8)
        st = tally_buf_printf(out, ",\"lo\":%" PRId64 ",\"hi\":%" PRId64, first->lo, first->hi);
    if (st == TALLY_OK)
        st = tally_buf_printf(out,
                              ",\"batches\":%" PRIu64 ",\"elements\":%" PRIu64 ",\"bytes\":%" PRIu64
                              ",\"filter_seen\":%" PRIu64 ",\"filter_kept\":%" PRIu64
                              ",\"scan_carry\":%" PRId64 ",\"scan_elements\":%" PRIu64
                              ",\"hist_total\":%" PRIu64 ",\"last_seq\":%" PRIu64 ",",
                              i->batches, i->elements, i->bytes, i->filter_seen, i->filter_kept,
                              i->scan_carry, i->scan_elements, i->hist_total, i->last_seq);
    if (st == TALLY_OK && v->window_end_ms)
        st = tally_buf_printf(out, "\"window\":{\"start_ms\":%" PRIu64 ",\"end_ms\":%" PRIu64 "},",
                              v->window_start_ms, v->window_end_ms);
    return st;
}

tally_status_t tally_stream_json(const tally_stream_view_t *v, tally_buf_t *out)
{
    if (!v || !v->name || !v->info || !out)
        return TALLY_E_ARG;
    unsigned channels = 0;
    tally_hist_t hist[CHANNELS_MAX];
    if (v->info->hist_dtype != TALLY_DTYPE_NONE) {
        channels = tally_hist_channels(v->info->hist_dtype);
        if (channels == 0 || channels > CHANNELS_MAX)
            return TALLY_E_ARG;
        for (unsigned c = 0; c < channels; c++)
            if (tally_hist_from_info(v->info, c, &hist[c]) != TALLY_OK)
                return TALLY_E_ARG;
    }
    const double *qs = v->nquantiles ? v->quantiles : default_quantiles;
    size_t nq = v->nquantiles ? v->nquantiles : 3;
    tally_status_t st = json_head(v, &hist[0], channels, out);
    if (st == TALLY_OK && !channels)
        st = tally_buf_printf(out, "\"count\":0,\"mean\":null,\"quantiles\":null,\"bins\":[]");
    else if (st == TALLY_OK && channels == 1)
        st = tally_hist_json_quantiles(&hist[0], qs, nq, out);
    else if (st == TALLY_OK) {
        st = tally_buf_printf(out, "\"channels\":[");
        for (unsigned c = 0; c < channels && st == TALLY_OK; c++) {
            st = tally_buf_printf(out, "%s{\"channel\":\"%s\",", c ? "," : "", channel_names[c]);
            if (st == TALLY_OK)
                st = tally_hist_json_quantiles(&hist[c], qs, nq, out);
            if (st == TALLY_OK)
                st = tally_buf_printf(out, "}");
        }
        if (st == TALLY_OK)
            st = tally_buf_printf(out, "]");
    }
    return st == TALLY_OK ? tally_buf_printf(out, "}") : st;
}
