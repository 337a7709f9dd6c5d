/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_service.c — see td_service.h.
 *
 * Design
 * ------
 * Everything here runs on the loop thread, driven by libuv timers; it reads the stream table,
 * the shards' counters and gauges while it holds the table (td_streams_hold: the shards stopped
 * at their barrier, issue 31; with one shard, on this thread, nothing to stop):
 *   - status timer (every TD_STATUS_INTERVAL_MS, only under systemd): STATUS= summary line;
 *   - watchdog timer (when WatchdogSec= is set): WATCHDOG=1 every half interval. Pinging from
 *     the loop thread means a loop that hangs stops pinging, and systemd restarts tallyd;
 *   - state timer (every state_interval seconds, with a state directory): snapshot.
 *
 * State snapshots: the stream table only changes on the loop thread, so taking a snapshot there
 * (td_state_store_begin: the records of the streams changed since the last one, or every
 * stream when the store compacts) is consistent. The write (which fsyncs) runs on a libuv
 * worker so the loop never blocks on the disk. At most one write is in flight; a snapshot asked
 * for meanwhile is taken when the write finishes. A snapshot with nothing changed writes
 * nothing (an idle daemon does not fsync every interval). At shutdown the server calls
 * td_service_close once every request has been answered, so the final snapshot holds everything
 * acknowledged: a clean restart loses nothing. A kill -9 loses what changed since the last
 * snapshot, at most one interval.
 *
 * A periodic write that fails is logged at warning and counted
 * (tallyd_state_write_failures_total); nothing is marked written, so the next interval tries
 * again. A final write that fails is logged at err and makes tallyd exit 1
 * (td_service_exit_code): exiting 0 would tell the service manager that nothing was lost.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "td_http.h"
#include "td_log.h"
#include "td_notify.h"
#include "td_service.h"
#include "td_state.h"
#include "td_settings.h"

typedef struct {
    uv_work_t work;
    td_service_t *owner;
    td_state_job_t *job;
    bool final; /* the shutdown snapshot: its failure decides the exit code */
} state_job_t;

struct td_service {
    td_service_host_t host;
    td_http_t *http;
    uv_timer_t status_timer;
    uv_timer_t watchdog_timer;
    uv_timer_t state_timer;
    size_t timers_open; /* status, watchdog, state: how many of them are initialised */
    bool status_on, watchdog_on, state_on;
    bool closed;
    bool final_failed; /* the shutdown snapshot could not be written */
    char *state_dir;   /* fixed at start: changing it needs a restart */
    /* max_batch at start sized ZeroMQ's frame guard (max_frame's default, fixed when the socket
     * is bound) and the GPU's staging buffers, so a reload may lower max_batch but not raise it
     * above this. */
    size_t start_max_batch;
    td_state_store_t *store; /* the snapshots' (td_state.h); NULL without a state directory */
    bool write_inflight;     /* a state write is running on a worker */
    bool write_again;        /* a snapshot was asked for meanwhile */
};

/* Room beyond the measured text: the fleet's families (td_fleet_status.c) are read live, not from
 * the sample, so the text written may be longer than the one measured (its gauges move with
 * every message, issue 32). */
#define METRICS_SLACK 4096

td_err_t td_service_render_metrics(const td_service_host_t *host, char **text, size_t *len)
{
    td_gauges_t g;
    td_metrics_t counters;
    td_streams_hold(host->streams);
    host->gauges(host->ctx, &g);
    host->counters(host->ctx, &counters);
    size_t cap = td_metrics_render(&counters, &g, NULL, 0) + METRICS_SLACK, n = 0;
    char *out = NULL;
    /* Written again, larger, until it fits: never cut, and its length what was written (the
     * length measured first sent a cut text, or bytes past a shorter one's end). */
    for (;;) {
        free(out);
        if (!(out = malloc(cap)) || (n = td_metrics_render(&counters, &g, out, cap)) < cap)
            break;
        cap = n + METRICS_SLACK;
    }
    td_streams_release(host->streams);
    if (!out)
        return TD_ERR_NOMEM;
    *text = out;
    *len = n;
    return TD_OK;
}

/* The gauges, and the requests answered so far, with the shards held for the moment. */
static void sample(td_service_t *self, td_gauges_t *g, uint64_t *answered)
{
    td_streams_hold(self->host.streams);
    self->host.gauges(self->host.ctx, g);
    if (answered) {
        td_metrics_t counters;
        self->host.counters(self->host.ctx, &counters);
        *answered = td_metrics_answered(&counters);
    }
    td_streams_release(self->host.streams);
    g->streams = NULL; /* not to be read once released */
}

static td_err_t render_cb(void *ctx, char **text, size_t *len)
{
    td_service_t *self = ctx;
    return td_service_render_metrics(&self->host, text, len);
}

/* GET /healthz: serving, or draining after a stop signal, or a GPU lost. */
static bool health_cb(void *ctx, const char **why)
{
    td_service_t *self = ctx;
    td_gauges_t g;
    sample(self, &g, NULL);
    *why = g.stopping ? "draining" : g.gpus_lost ? "gpu lost" : NULL;
    return *why == NULL;
}

/* The one-line summary for STATUS=. */
static void summary(td_service_t *self, char *buf, size_t cap)
{
    td_gauges_t g;
    uint64_t answered = 0;
    sample(self, &g, &answered);
    snprintf(buf, cap, "serving on %s: %u streams, %u in flight, %llu requests answered", g.backend,
             g.stream_count, g.inflight, (unsigned long long)answered);
}

/* A systemd notification that could not be sent (td_notify logged it) is counted. */
static void notified(td_service_t *self, td_err_t err)
{
    if (err != TD_OK)
        self->host.metrics->notify_failures++;
}

static void status_cb(uv_timer_t *timer)
{
    td_service_t *self = timer->data;
    char line[256];
    summary(self, line, sizeof line);
    notified(self, td_notify_status(line));
}

static void watchdog_cb(uv_timer_t *timer)
{
    notified(timer->data, td_notify_watchdog());
}

/* ---- State snapshots -------------------------------------------------------------------- */

static void state_save(td_service_t *self);

static void state_work(uv_work_t *work)
{
    state_job_t *job = work->data;
    td_state_job_write(job->job);
}

static void state_after(uv_work_t *work, int status)
{
    state_job_t *job = work->data;
    td_service_t *self = job->owner;
    char msg[512] = "cancelled";
    size_t written = 0;
    unsigned streams = 0;
    bool full = false;
    td_err_t err = td_state_store_end(self->store, &job->job, msg, sizeof msg, &written,
                                      &streams, &full);
    if (status == UV_ECANCELED)
        err = TD_ERR_IO;
    if (err == TD_OK) {
        self->host.metrics->state_bytes_written += written;
        td_debug("state: wrote %u streams (%zu bytes, %s) to %s", streams, written,
                 full ? "a whole state file" : "appended to the log", self->state_dir);
    } else if (job->final) {
        self->host.metrics->state_write_failures++;
        self->final_failed = true;
        td_err("state: the final snapshot failed: %s; %s/%s holds only the last good snapshot; "
               "exiting with status 1",
               msg, self->state_dir, TD_STATE_FILE);
    } else {
        self->host.metrics->state_write_failures++;
        td_warn("state: cannot write a snapshot: %s; the next one writes every stream", msg);
    }
    free(job);
    self->write_inflight = false;
    if (self->write_again) {
        self->write_again = false;
        state_save(self);
    }
}

/* A snapshot that never reached the disk counts as a failed write. */
static void state_not_queued(td_service_t *self, const char *why)
{
    self->host.metrics->state_write_failures++;
    if (self->closed) {
        self->final_failed = true;
        td_err("state: the final snapshot failed: %s; exiting with status 1", why);
    } else {
        td_warn("state: no snapshot: %s; trying again at the next one", why);
    }
}

static void state_save(td_service_t *self)
{
    if (!self->store)
        return;
    if (self->write_inflight) {
        self->write_again = true;
        return;
    }
    td_state_job_t *records = NULL;
    td_streams_hold(self->host.streams);
    td_err_t err = td_state_store_begin(self->store, self->host.streams, td_clock_ms(), &records);
    td_streams_release(self->host.streams);
    if (err != TD_OK) {
        state_not_queued(self, "out of memory for a snapshot");
        return;
    }
    if (!records) /* nothing changed since the last snapshot */
        return;
    state_job_t *job = calloc(1, sizeof *job);
    int rc = job ? 0 : UV_ENOMEM;
    if (job) {
        job->owner = self;
        job->job = records;
        job->final = self->closed;
        job->work.data = job;
        rc = uv_queue_work(self->host.loop, &job->work, state_work, state_after);
    }
    if (rc != 0) {
        char why[128], msg[512];
        size_t written;
        unsigned streams;
        bool full;
        snprintf(why, sizeof why, "cannot queue a write: %s", uv_strerror(rc));
        td_state_store_end(self->store, &records, msg, sizeof msg, &written, &streams, &full);
        state_not_queued(self, why);
        free(job);
        return;
    }
    self->write_inflight = true;
}

static void state_cb(uv_timer_t *timer)
{
    state_save(timer->data);
}

static td_err_t restore_state(td_service_t *self)
{
    char msg[4400];
    td_err_t err =
        td_state_store_open(self->state_dir, self->host.streams, &self->store, msg, sizeof msg);
    if (err != TD_OK)
        td_err("state: %s", msg);
    return err;
}

/* Persistence was asked for: a directory that cannot hold the state file stops tallyd at
 * start rather than losing every snapshot later. A missing last component is created. */
static td_err_t check_state_dir(const char *dir)
{
    struct stat sb;
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        td_err("state: cannot create the state directory %s: %s", dir, strerror(errno));
        return TD_ERR_IO;
    }
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        td_err("state: %s is not a directory", dir);
        return TD_ERR_IO;
    }
    if (access(dir, W_OK | X_OK) != 0) {
        td_err("state: cannot write to the state directory %s: %s", dir, strerror(errno));
        return TD_ERR_IO;
    }
    return TD_OK;
}

/* ---- Lifecycle -------------------------------------------------------------------------- */

/* With a state directory: checks it and restores the streams saved in it. */
static td_err_t open_state(td_service_t *self)
{
    const td_config_t *cfg = self->host.cfg;
    if (!cfg->state_dir) {
        td_info("state: no state directory (--state-dir); streams are not persisted");
        return TD_OK;
    }
    self->state_dir = strdup(cfg->state_dir);
    if (!self->state_dir)
        return TD_ERR_NOMEM;
    td_err_t err = check_state_dir(self->state_dir);
    if (err == TD_OK)
        err = restore_state(self);
    if (err == TD_OK)
        td_info("state: snapshots to %s/%s every %u s", self->state_dir, TD_STATE_FILE,
                cfg->state_interval);
    return err;
}

/* Starts `timer` (initialised by open_timers) when `on`; records that it runs. */
static td_err_t start_timer(uv_timer_t *timer, bool on, uv_timer_cb cb, uint64_t first_ms,
                            uint64_t every_ms, bool *running, const char *what)
{
    if (!on)
        return TD_OK;
    int rc = uv_timer_start(timer, cb, first_ms, every_ms);
    if (rc != 0) {
        td_err("cannot start the %s timer: %s", what, uv_strerror(rc));
        return TD_ERR_LIBRARY;
    }
    *running = true;
    return TD_OK;
}

/* The status, watchdog and state timers (each only where it has work). */
static td_err_t open_timers(td_service_t *self)
{
    uv_timer_t *timers[] = {&self->status_timer, &self->watchdog_timer, &self->state_timer};
    for (size_t i = 0; i < sizeof timers / sizeof timers[0]; i++) {
        int rc = uv_timer_init(self->host.loop, timers[i]);
        if (rc != 0) {
            td_err("cannot create a service timer: %s", uv_strerror(rc));
            return TD_ERR_LIBRARY;
        }
        timers[i]->data = self;
        self->timers_open = i + 1;
    }
    uint64_t watchdog_usec = td_notify_watchdog_usec();
    uint64_t watchdog_ms = watchdog_usec / 2000 ? watchdog_usec / 2000 : 1;
    uint64_t state_ms = (uint64_t)self->host.cfg->state_interval * 1000;
    td_err_t err =
        start_timer(&self->status_timer, getenv("NOTIFY_SOCKET") != NULL, status_cb,
                    TD_STATUS_INTERVAL_MS, TD_STATUS_INTERVAL_MS, &self->status_on, "status");
    if (err == TD_OK)
        err = start_timer(&self->watchdog_timer, watchdog_usec != 0, watchdog_cb, 0, watchdog_ms,
                          &self->watchdog_on, "watchdog");
    if (err == TD_OK && self->watchdog_on)
        td_info("systemd watchdog: pinging every %llu ms", (unsigned long long)watchdog_ms);
    if (err == TD_OK)
        err = start_timer(&self->state_timer, self->state_dir != NULL, state_cb, state_ms, state_ms,
                          &self->state_on, "state snapshot");
    return err;
}

/* Closes the endpoint and the timers opened so far. */
static void close_handles(td_service_t *self)
{
    uv_timer_t *timers[] = {&self->status_timer, &self->watchdog_timer, &self->state_timer};
    if (self->http)
        td_http_destroy(&self->http);
    for (size_t i = 0; i < self->timers_open; i++)
        uv_close((uv_handle_t *)timers[i], NULL);
    self->timers_open = 0;
}

td_err_t td_service_new(const td_service_host_t *host, td_service_t **out)
{
    td_service_t *self = calloc(1, sizeof *self);
    if (!self)
        return TD_ERR_NOMEM;
    *self = (td_service_t){.host = *host, .start_max_batch = host->cfg->max_batch};
    td_err_t err = open_state(self);
    if (err == TD_OK && host->cfg->metrics_listen)
        err = td_http_new(&self->host, render_cb, health_cb, self, &self->http);
    if (err == TD_OK)
        err = open_timers(self);
    if (err != TD_OK) {
        bool had_handles = self->http || self->timers_open;
        close_handles(self);
        if (had_handles) /* their close callbacks run before self goes */
            uv_run(host->loop, UV_RUN_NOWAIT);
        td_state_store_close(&self->store);
        free(self->state_dir);
        free(self);
        return err;
    }
    *out = self;
    return TD_OK;
}

void td_service_ready(td_service_t *self)
{
    char line[256];
    summary(self, line, sizeof line);
    notified(self, td_notify_ready(line));
}

void td_service_reload(td_service_t *self)
{
    if (!self || self->closed) { /* SIGHUP during the final flush: nothing to apply it to */
        td_notice("SIGHUP while stopping: ignored");
        return;
    }
    td_config_t next;
    char msg[512];
    const char *file =
        self->host.cfg->config_file ? self->host.cfg->config_file : TD_DEFAULT_CONFIG_FILE;
    td_notice("SIGHUP: reloading the configuration (%s)", file);
    notified(self, td_notify_reloading()); /* Type=notify-reload: systemd waits for READY=1 */
    if (td_config_reload(self->host.cfg, &next, msg, sizeof msg) != TD_OK) {
        td_err("reload failed: %s; keeping the running configuration", msg);
        notified(self, td_notify_reloaded());
        return;
    }
    if (next.max_batch > self->start_max_batch) {
        td_warn("reload: max_batch %zu is above the %zu tallyd started with, which sized its "
                "buffers; using %zu until tallyd restarts",
                next.max_batch, self->start_max_batch, self->start_max_batch);
        next.max_batch = self->start_max_batch;
    }
    td_config_t *live = self->host.cfg;
    unsigned old_interval = live->state_interval;
    td_streams_hold(self->host.streams); /* the shards read the live configuration */
    td_config_apply_runtime(live, &next);
    td_streams_release(self->host.streams);
    td_config_clear(&next);

    td_streams_set_max(self->host.streams, live->max_streams);
    td_streams_set_budget(self->host.streams, live->max_state_bytes,
                          td_config_state_bytes_per_client(live));
    if (self->state_on && old_interval != live->state_interval) {
        uint64_t ms = (uint64_t)live->state_interval * 1000;
        int rc = uv_timer_start(&self->state_timer, state_cb, ms, ms);
        if (rc != 0) /* cannot happen to an open timer; the old interval would stay */
            td_err("reload: cannot restart the state snapshot timer: %s", uv_strerror(rc));
    }
    if (self->status_on)
        status_cb(&self->status_timer);
    notified(self, td_notify_reloaded());
}

void td_service_stopping(td_service_t *self)
{
    td_err_t err = td_notify_stopping();
    if (self)
        notified(self, err);
}

void td_service_close(td_service_t *self)
{
    if (!self || self->closed)
        return;
    self->closed = true;
    close_handles(self);
    /* The final snapshot; the loop keeps running until its write has finished. */
    state_save(self);
}

int td_service_exit_code(const td_service_t *self)
{
    return self && self->final_failed ? 1 : 0;
}

void td_service_destroy(td_service_t **self_p)
{
    td_service_t *self = *self_p;
    if (!self)
        return;
    td_state_store_close(&self->store);
    free(self->state_dir);
    free(self);
    *self_p = NULL;
}
