/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_service.h — what makes tallyd a well-kept service, around the server's loop: systemd
 * notifications and watchdog, periodic and final stream-state snapshots, the HTTP metrics
 * endpoint, and SIGHUP reload. td_server.c calls the five lifecycle hooks below; the service
 * reaches the server's state only through td_service_host_t.
 */
#ifndef TD_SERVICE_H
#define TD_SERVICE_H

#include <uv.h>

#include "td_config.h"
#include "td_err.h"
#include "td_metrics.h"
#include "td_stream.h"

/* A reply to a request handed over by submit, on the loop thread (td_local.h). */
typedef void (*td_reply_fn)(void *arg, const tally_rep_t *rep, const void *payload, size_t len);

typedef struct {
    uv_loop_t *loop;
    td_config_t *cfg;      /* the server's live configuration; reload updates it */
    /* The whole table: read while held (td_streams_hold: the shards stopped, issue 31). */
    td_streams_t *streams;
    td_metrics_t *metrics; /* the loop thread's counters: the service counts state writes in it */
    /* Every counter, the shards' summed into out (the table held). */
    void (*counters)(void *ctx, td_metrics_t *out);
    void (*gauges)(void *ctx, td_gauges_t *out); /* samples the server's gauges (held) */
    /* A stream's record as `query` answers it (PROTOCOL.md §5 query): all time when window_ms
     * is 0, else over the last window_ms ("Windows"), with the window's start and end (ms since
     * the epoch; 0 for all time). TALLY_E_WINDOW with msg when the ring is shorter or off.
     * With stream NULL only that check is made. */
    tally_status_t (*view)(void *ctx, const td_stream_t *stream, uint64_t window_ms,
                           tally_stream_info_t *out, uint64_t *start_ms, uint64_t *end_ms,
                           char *msg, size_t msg_cap);
    /* Hands a query, reset or delete of req->stream to the request path through the in-process
     * transport (td_local.h), as if it had come over ZeroMQ (the scheduler orders it after the
     * stream's queued requests; tallyd stopping answers it `shutdown`); done is called exactly
     * once, on the loop thread. */
    void (*submit)(void *ctx, const tally_req_t *req, td_reply_fn done, void *arg);
    /* The fleet worker's status and its questions to the whole fleet (td_fleet_status.h):
     * settings and hooks filled before the loop runs; NULL or not `on`: not in a fleet. */
    struct td_fleet_status *fleet;
    void *ctx;
} td_service_host_t;

typedef struct td_service td_service_t;

/* Loop thread, before the loop runs: restores stream state, starts the metrics endpoint and
 * the timers. Fails (leaving no libuv handle behind, the reason logged at err) when the state
 * directory or the state file in it cannot be used, or the metrics endpoint cannot start. */
td_err_t td_service_new(const td_service_host_t *host, td_service_t **out);
/* The server is ready to serve: READY=1. */
void td_service_ready(td_service_t *self);
/* SIGHUP: re-read the configuration and apply what can change at run time. */
void td_service_reload(td_service_t *self);
/* A stop signal arrived: STOPPING=1. */
void td_service_stopping(td_service_t *self);
/* Every request is answered: write the final state snapshot, close timers and the endpoint. */
void td_service_close(td_service_t *self);
/* After the loop has finished: the process exit code the service asks for, 0, or 1 when the
 * final state snapshot could not be written (what was acknowledged since the last good
 * snapshot is lost, and the service manager must hear of it). */
int td_service_exit_code(const td_service_t *self);
/* After the loop has finished. */
void td_service_destroy(td_service_t **self_p);

/* The metrics text (what `stats` returns and GET /metrics serves), malloc'ed; TD_ERR_NOMEM. */
td_err_t td_service_render_metrics(const td_service_host_t *host, char **text, size_t *len);

#endif
