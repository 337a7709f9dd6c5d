/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_ops.c — the operations answered on the loop thread from what tallyd holds (see td_ops.h).
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_fleet_status.h"
#include "td_ops.h"
#include "td_shm.h"
#include "td_window.h"

/* Space for an info reply. */
#define TD_TEXT_REPLY_MAX (64 * 1024)

/* An info reply as it is written: at most TD_TEXT_REPLY_MAX - 1 bytes and its NUL. What would
 * pass that is cut (the reply holds a few KiB), so that no part needs a check of its own. */
typedef struct {
    char *text;
    size_t len;
} info_text_t;

/* n bytes were written at the end, as snprintf counts them: what passed the end was cut. */
static void info_grew(info_text_t *t, size_t n)
{
    size_t room = TD_TEXT_REPLY_MAX - 1 - t->len;
    t->len += n < room ? n : room;
}

static void info_add(info_text_t *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void info_add(info_text_t *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(t->text + t->len, TD_TEXT_REPLY_MAX - t->len, fmt, ap);
    va_end(ap);
    info_grew(t, n > 0 ? (size_t)n : 0);
}

void td_op_info(const td_info_t *info, td_request_t *r)
{
    info_text_t t = {.text = malloc(TD_TEXT_REPLY_MAX)};
    if (!t.text) {
        td_request_fail(r, TALLY_E_INTERNAL, "out of memory");
        return;
    }
    const td_config_t *c = info->cfg;
    info_add(&t,
             "version=%s\nprotocol=%d\nbackend=%s\nbackends=%s\ndevices=%s\n"
             "max_batch=%zu\nmax_inflight=%u\nmax_streams=%u\nshm=%s\nshm_socket=%s\n"
             "window_intervals=%u\nwindow_interval_ms=%u\npub=%s\npub_interval_ms=%u\n"
             "curve=%s\n",
             TALLY_VERSION, TALLY_PROTO_VERSION, info->backend, info->backends, info->devices,
             c->max_batch, c->max_inflight, c->max_streams, info->shm_path ? "on" : "off",
             info->shm_path ? info->shm_path : "", c->window_intervals, c->window_interval_ms,
             info->pub_endpoint ? info->pub_endpoint : "", c->pub_interval_ms,
             info->curve ? "on" : "off");
    /* The per-peer limits a client can meet (PROTOCOL.md §8), as in force: 0 for the in-flight
     * share means the fair share, which changes with the connections in flight. */
    info_add(&t,
             "max_inflight_per_peer=%u\nmax_streams_per_client=%u\n"
             "stream_create_rate=%u\nmax_frame=%zu\nmax_unread_replies=%d\n"
             "max_reply_bytes_per_peer=%" PRIu64 "\nmax_reply_bytes=%" PRIu64 "\n",
             c->max_inflight_per_peer, td_config_streams_per_client(c), c->stream_create_rate,
             td_config_max_frame(c), TD_DEFAULT_SNDHWM, td_config_reply_bytes_per_peer(c),
             td_config_reply_bytes(c));
    /* The shared-memory side channel's limits (PROTOCOL.md §10), after the per-peer ones. */
    info_grew(&t, td_shm_info(c, t.text + t.len, TD_TEXT_REPLY_MAX - t.len));
    /* The stream state's memory budget (PROTOCOL.md §8). */
    info_add(&t, "max_state_bytes=%zu\nmax_state_bytes_per_client=%zu\n", c->max_state_bytes,
             td_config_state_bytes_per_client(c));
    /* The GPUs a device region may be registered on (PROTOCOL.md §10 "Device memory"), and the
     * request path's shards (issue 31). */
    info_add(&t, "gpu_uuids=%s\nshards=%u\n", info->gpu_uuids ? info->gpu_uuids : "", info->shards);
    /* The endpoints with a socket and a thread each (`front`), beside the binds. */
    info_add(&t, "fronts=");
    for (int i = 0; i < c->front_count; i++)
        info_add(&t, "%s%s", i ? "," : "", c->fronts[i]);
    info_add(&t, "\n");
    /* The NATS fleet (PROTOCOL.md §13): on or off, and a worker's limits and partitions. */
    if (info->fleet)
        info_grew(&t, td_fleet_status_info(info->fleet, t.text + t.len, TD_TEXT_REPLY_MAX - t.len));
    td_request_succeed(r, TALLY_DTYPE_TEXT, t.text, t.len, t.len);
}

void td_op_streams(td_streams_t *streams, td_request_t *r)
{
    size_t len = 0;
    uint64_t count = 0;
    for (td_stream_t *st = td_streams_first(streams); st; st = td_streams_next(streams, st))
        len += 1 + st->name_len;
    uint8_t *out = malloc(len ? len : 1);
    if (!out) {
        td_request_fail(r, TALLY_E_INTERNAL, "out of memory");
        return;
    }
    size_t at = 0;
    for (td_stream_t *st = td_streams_first(streams); st; st = td_streams_next(streams, st)) {
        out[at++] = (uint8_t)st->name_len;
        memcpy(out + at, st->name, st->name_len);
        at += st->name_len;
        count++;
    }
    td_request_succeed(r, TALLY_DTYPE_NONE, out, len, count);
}

tally_status_t td_op_view(const td_config_t *cfg, const td_stream_t *stream, uint64_t window_ms,
                          tally_stream_info_t *view, uint64_t *start_ms, uint64_t *end_ms,
                          char *msg, size_t cap)
{
    *start_ms = *end_ms = 0;
    if (!window_ms) {
        if (stream)
            td_stream_info(stream, view);
        return TALLY_OK;
    }
    unsigned intervals = cfg->window_intervals;
    uint64_t interval_ms = cfg->window_interval_ms;
    if (intervals == 0) {
        snprintf(msg, cap, "windows are off (window_intervals = 0)");
        return TALLY_E_WINDOW;
    }
    uint64_t want = (window_ms + interval_ms - 1) / interval_ms;
    if (want > intervals) {
        snprintf(msg, cap,
                 "a window of %" PRIu64 " ms needs %" PRIu64 " intervals; tallyd keeps %u of "
                 "%" PRIu64 " ms (%" PRIu64 " ms)",
                 window_ms, want, intervals, interval_ms, intervals * interval_ms);
        return TALLY_E_WINDOW;
    }
    if (!stream) /* only the window's check */
        return TALLY_OK;
    uint64_t now = td_clock_ms();
    *start_ms = td_stream_window_info(stream, now, (unsigned)want, (uint32_t)interval_ms, view);
    *end_ms = now;
    return TALLY_OK;
}

/* A window query (PROTOCOL.md "Windows"): the stream's record with the histogram of the last
 * ceil(W / interval) intervals; false (r failed) when the ring is shorter or windows are off. */
static bool window_view(const td_config_t *cfg, td_request_t *r, const td_stream_t *stream,
                        tally_stream_info_t *view)
{
    char msg[TALLY_ERROR_MESSAGE_MAX + 1];
    uint64_t start = 0, end = 0;
    tally_status_t st =
        td_op_view(cfg, stream, (uint64_t)r->req.lo, view, &start, &end, msg, sizeof msg);
    if (st != TALLY_OK) {
        td_request_fail(r, st, "%s", msg);
        return false;
    }
    r->rep.aux0 = start;
    r->rep.aux1 = end;
    return true;
}

void td_op_query(const td_config_t *cfg, td_request_t *r, const td_stream_t *stream)
{
    static _Thread_local tally_stream_info_t view; /* per shard thread; 8 KiB off the stack */
    const tally_stream_info_t *info = &view;
    if (r->req.flags & TALLY_FLAG_QUERY_WINDOW) {
        if (!window_view(cfg, r, stream, &view))
            return;
    } else {
        td_stream_info(stream, &view);
    }
    size_t size = tally_stream_info_size(info);
    uint8_t *out = malloc(size);
    if (!out) {
        td_request_fail(r, TALLY_E_INTERNAL, "out of memory");
        return;
    }
    tally_stream_info_encode(info, out);
    uint64_t start = r->rep.aux0, end = r->rep.aux1;
    td_request_succeed(r, TALLY_DTYPE_NONE, out, size, 1);
    r->rep.aux0 = start;
    r->rep.aux1 = end;
}
