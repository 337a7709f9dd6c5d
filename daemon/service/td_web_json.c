/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_web_json.c — the HTTP API's JSON documents (see td_web.h; the schemas are in web/schema/).
 *
 * A stream's record is libtally's rendering (tally_stream_json), the very bytes `tally query
 * --json` prints, from the record the `query` opcode would answer (td_service_host_t.view):
 * one source for both, so the CLI and the API cannot disagree. The list and the errors are
 * small documents of their own, built here. Loop thread (stream state), except
 * td_web_error_json, which is pure.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_log.h"
#include "td_web_int.h"

char *td_web_error_json(size_t *len, const char *code, const char *fmt, ...)
{
    char message[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    tally_buf_t out = {0};
    tally_status_t st = tally_buf_printf(&out, "{\"error\":\"%s\",\"message\":", code);
    if (st == TALLY_OK)
        st = tally_json_string(message, &out);
    if (st == TALLY_OK)
        st = tally_buf_printf(&out, "}");
    if (st != TALLY_OK) {
        tally_buf_free(&out);
        return NULL;
    }
    *len = out.len;
    return (char *)out.data;
}

unsigned td_web_http_status(tally_status_t st)
{
    switch (st) {
    case TALLY_OK:
        return MHD_HTTP_OK;
    case TALLY_E_UNKNOWN_STREAM:
        return MHD_HTTP_NOT_FOUND;
    case TALLY_E_WINDOW:
    case TALLY_E_STREAM_NAME:
    case TALLY_E_PARAM:
        return MHD_HTTP_BAD_REQUEST;
    case TALLY_E_NOT_PERMITTED: /* a fleet worker's stream changed outside its partitions */
        return MHD_HTTP_FORBIDDEN;
    case TALLY_E_NOT_OWNER: /* direct mode: the stream's partition is another member's */
        return MHD_HTTP_MISDIRECTED_REQUEST;
    case TALLY_E_RATE:
        return MHD_HTTP_TOO_MANY_REQUESTS;
    case TALLY_E_SHUTDOWN:
    case TALLY_E_BUSY:
    case TALLY_E_NOT_DURABLE: /* may or may not be stored: the next owner's state says */
        return MHD_HTTP_SERVICE_UNAVAILABLE;
    default:
        return MHD_HTTP_INTERNAL_SERVER_ERROR;
    }
}

/* The record's scratch: 8 KiB per channel, too much for the stack; loop thread only. */
static tally_stream_info_t scratch;

/* A stream's rate: values histogrammed per second over the last window_ms, from its window
 * ring (the same sums as a window query); negative when there is no such window. */
static double stream_rate(td_web_t *self, const td_stream_t *s, uint64_t window_ms)
{
    uint64_t start = 0, end = 0;
    char msg[160];
    if (!window_ms ||
        self->host.view(self->host.ctx, s, window_ms, &scratch, &start, &end, msg, sizeof msg) !=
            TALLY_OK ||
        end <= start)
        return -1;
    return (double)scratch.hist_total * 1000.0 / (double)(end - start);
}

/* Ends an entry: its owner when in a fleet. */
static tally_status_t end_entry(const char *member, tally_buf_t *out)
{
    tally_status_t st = TALLY_OK;
    if (member) {
        st = tally_buf_printf(out, ",\"member\":");
        if (st == TALLY_OK)
            st = tally_json_string(member, out);
    }
    return st == TALLY_OK ? tally_buf_printf(out, "}") : st;
}

/* One entry of the list; member: its owner in a fleet, or NULL. */
static tally_status_t list_entry(td_web_t *self, const td_stream_t *s, uint64_t rate_ms,
                                 bool first, const char *member, tally_buf_t *out)
{
    const char *type = tally_dtype_name((tally_dtype_t)s->info.hist_dtype);
    tally_status_t st = tally_buf_printf(out, "%s{\"stream\":", first ? "" : ",");
    if (st == TALLY_OK)
        st = tally_json_string(s->name, out);
    if (st == TALLY_OK)
        st = s->info.hist_dtype != TALLY_DTYPE_NONE && type
                 ? tally_buf_printf(out, ",\"type\":\"%s\"", type)
                 : tally_buf_printf(out, ",\"type\":null");
    if (st == TALLY_OK)
        st = tally_buf_printf(out,
                              ",\"values\":%" PRIu64 ",\"elements\":%" PRIu64
                              ",\"batches\":%" PRIu64,
                              s->info.hist_total, s->info.elements, s->info.batches);
    double rate = stream_rate(self, s, rate_ms);
    if (st == TALLY_OK)
        st = rate >= 0 ? tally_buf_printf(out, ",\"rate\":%.6g", rate)
                       : tally_buf_printf(out, ",\"rate\":null");
    if (st == TALLY_OK)
        st = s->updated_ms ? tally_buf_printf(out, ",\"updated_ms\":%" PRIu64, s->updated_ms)
                           : tally_buf_printf(out, ",\"updated_ms\":null");
    return st == TALLY_OK ? end_entry(member, out) : st;
}

/* The list's first fields, up to the opening of "streams". */
static tally_status_t list_head(td_web_t *self, uint64_t *rate_ms, tally_buf_t *out)
{
    const td_config_t *cfg = self->host.cfg;
    uint64_t ring = (uint64_t)cfg->window_intervals * cfg->window_interval_ms;
    *rate_ms = ring < TD_WEB_RATE_WINDOW_MS ? ring : TD_WEB_RATE_WINDOW_MS;
    return tally_buf_printf(out,
                            "{\"time_ms\":%" PRIu64 ",\"interval_ms\":%u,"
                            "\"window_ms\":%" PRIu64 ",\"streams\":[",
                            td_clock_ms(), td_web_tick_ms(cfg), ring);
}

/* This worker's member id when it is one of a fleet, else NULL. */
static const char *fleet_member(const td_web_t *self)
{
    return self->host.fleet && self->host.fleet->on ? self->host.fleet->member : NULL;
}

/* Closes "streams" and, for a fleet worker, adds "fleet" (a: how much of the fleet answered, or
 * NULL for this worker's own list). */
static tally_status_t list_tail(td_web_t *self, const td_fleet_answer_t *a, tally_buf_t *out)
{
    const char *member = fleet_member(self);
    tally_status_t st = tally_buf_printf(out, "]");
    if (st == TALLY_OK && member) {
        st = tally_buf_printf(out, ",\"fleet\":{\"member\":");
        if (st == TALLY_OK)
            st = tally_json_string(member, out);
        if (st == TALLY_OK && a)
            st = tally_buf_printf(out,
                                  ",\"partitions\":%" PRIu32 ",\"covered\":%" PRIu32
                                  ",\"answered\":%zu,\"members\":%zu,\"partial\":%s",
                                  a->partitions, a->covered, a->answered, a->members,
                                  a->covered < a->partitions || a->truncated ? "true" : "false");
        if (st == TALLY_OK)
            st = tally_buf_printf(out, "}");
    }
    return st == TALLY_OK ? tally_buf_printf(out, "}") : st;
}

tally_status_t td_web_list_json(td_web_t *self, tally_buf_t *out)
{
    uint64_t rate_ms = 0;
    const char *member = fleet_member(self);
    tally_status_t st = list_head(self, &rate_ms, out);
    bool first = true;
    for (td_stream_t *s = td_streams_first(self->host.streams); s && st == TALLY_OK;
         s = td_streams_next(self->host.streams, s), first = false)
        st = list_entry(self, s, rate_ms, first, member, out);
    return st == TALLY_OK ? list_tail(self, NULL, out) : st;
}

tally_status_t td_web_fleet_list_json(td_web_t *self, const td_fleet_answer_t *a,
                                      tally_buf_t *out)
{
    uint64_t rate_ms = 0;
    const char *member = fleet_member(self);
    tally_status_t st = list_head(self, &rate_ms, out);
    for (size_t i = 0; i < a->count && st == TALLY_OK; i++) {
        const td_fleet_entry_t *e = &a->entries[i];
        const td_stream_t *s = member && td_fleet_status_is_self(self->host.fleet, e->member)
                                   ? td_streams_find(self->host.streams, e->name, strlen(e->name))
                                   : NULL;
        if (s) { /* this worker's own: in full */
            st = list_entry(self, s, rate_ms, i == 0, member, out);
            continue;
        }
        st = tally_buf_printf(out, "%s{\"stream\":", i ? "," : "");
        if (st == TALLY_OK)
            st = tally_json_string(e->name, out);
        if (st == TALLY_OK)
            st = end_entry(e->member, out);
    }
    return st == TALLY_OK ? list_tail(self, a, out) : st;
}

tally_status_t td_web_reply_json(const char *name, const td_web_params_t *p,
                                 const tally_rep_t *rep, const void *payload, size_t len,
                                 tally_buf_t *out, char *msg, size_t cap)
{
    tally_status_t st = (tally_status_t)rep->status;
    if (st != TALLY_OK) {
        snprintf(msg, cap, "%.*s", payload ? (int)len : 0, payload ? (const char *)payload : "");
        return st;
    }
    tally_stream_view_t view = {.name = name,
                                .info = &scratch,
                                .window_start_ms = p->last_ms ? rep->aux0 : 0,
                                .window_end_ms = p->last_ms ? rep->aux1 : 0,
                                .quantiles = p->quantiles,
                                .nquantiles = p->nquantiles};
    if (tally_stream_info_decode(payload, len, &scratch) != TALLY_OK) {
        snprintf(msg, cap, "the query's record does not decode");
        return TALLY_E_INTERNAL;
    }
    st = tally_stream_json(&view, out);
    if (st != TALLY_OK)
        snprintf(msg, cap, "out of memory");
    return st == TALLY_OK ? TALLY_OK : TALLY_E_NOMEM;
}

tally_status_t td_web_record_json(td_web_t *self, const char *name, const td_web_params_t *p,
                                  tally_buf_t *out, char *msg, size_t cap)
{
    const td_stream_t *s = td_streams_find(self->host.streams, name, strlen(name));
    if (!s) {
        snprintf(msg, cap, "no stream named '%s'", name);
        return TALLY_E_UNKNOWN_STREAM;
    }
    tally_stream_view_t view = {.name = name,
                                .info = &scratch,
                                .quantiles = p->quantiles,
                                .nquantiles = p->nquantiles};
    tally_status_t st = self->host.view(self->host.ctx, s, p->last_ms, &scratch,
                                        &view.window_start_ms, &view.window_end_ms, msg, cap);
    if (st != TALLY_OK)
        return st;
    st = tally_stream_json(&view, out);
    if (st != TALLY_OK)
        snprintf(msg, cap, "out of memory");
    return st == TALLY_OK ? TALLY_OK : TALLY_E_NOMEM;
}
