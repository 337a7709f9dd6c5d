/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_ops.h — the operations tallyd answers on the loop thread from what it holds, with no
 * backend: `info` (the settings and limits in force, PROTOCOL.md §5), `streams` (the names) and
 * `query` (a stream's record, or a window of it). Each fills r's reply, or fails r; the server
 * sends it. (`stats` renders the metrics through the service, td_server.c.)
 */
#ifndef TD_OPS_H
#define TD_OPS_H

#include <stdbool.h>

#include "td_config.h"
#include "td_request.h"
#include "td_stream.h"

/* What `info` reports beside the configuration. */
typedef struct {
    const td_config_t *cfg;
    const char *backend;      /* "cpu", "cuda" (or "sim") */
    const char *backends;     /* "cpu,cuda" */
    const char *devices;      /* one line for people */
    const char *shm_path;     /* the side channel; NULL when shared memory is off */
    const char *pub_endpoint; /* NULL when subscriptions are off */
    const char *gpu_uuids;    /* the GPUs device regions may name (PROTOCOL.md §10), or "" */
    bool curve;
    unsigned shards;                     /* the request path's (td_path.h) */
    const struct td_fleet_status *fleet; /* the NATS fleet keys (daemon/core/td_fleet_status.h) */
} td_info_t;

void td_op_info(const td_info_t *info, td_request_t *r);
void td_op_streams(td_streams_t *streams, td_request_t *r);
/* A query of a stream whose earlier requests are done (td_sched); a window query with
 * TALLY_FLAG_QUERY_WINDOW (PROTOCOL.md "Windows"). */
void td_op_query(const td_config_t *cfg, td_request_t *r, const td_stream_t *stream);
/* A stream's record as `query` answers it (td_service_host_t.view, the HTTP API): all time, or
 * with window_ms the histogram of the last ceil(window_ms / interval) intervals (PROTOCOL.md
 * "Windows"), its interval in *start_ms, *end_ms (0, 0 for all time); TALLY_E_WINDOW with msg
 * when the ring is shorter or windows are off. With no stream, only that check. */
tally_status_t td_op_view(const td_config_t *cfg, const td_stream_t *stream, uint64_t window_ms,
                          tally_stream_info_t *view, uint64_t *start_ms, uint64_t *end_ms,
                          char *msg, size_t cap);

#endif
