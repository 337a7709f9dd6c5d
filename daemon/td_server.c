/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_server.c — the wiring of the loop: the parts of tallyd made, joined and stopped in order.
 *
 * Design
 * ------
 * One libuv loop thread owns every socket (the ZeroMQ ROUTER socket, td_zmq.h; the HTTP port;
 * the shared-memory side channel; the PUB socket) and the service around them. The request path
 * (td_path.h) takes requests from the transports (td_transport.h; the HTTP API's requests,
 * td_local.h) and answers through them; it runs on shards (issue 31: --shards, td_shard.h), each
 * owning a part of the stream table, with its scheduler and counters: with one shard on this loop
 * thread, with more each on a thread and loop of its own. Compute work goes to the executor
 * (td_exec.h: the CPU inline or on libuv's worker pool, or the GPU pipeline of td_gpu.h, shared by
 * the shards through a port each) and comes back to its shard's loop through exec_done. This file
 * makes the parts, hands each what it needs of the others (the path's answer_here for info and
 * stats, which need the whole daemon and run with the shards held still; the service's host), and
 * runs the life cycle: signals, reload, the sweep of idle per-peer entries, and stopping.
 *
 * Stopping (SIGTERM, SIGINT): nothing new starts. Requests running on a backend finish and are
 * answered; requests waiting on a stream FIFO are answered `shutdown` in order, once the stream's
 * running requests are done; messages still queued in the socket are read and answered
 * `shutdown` for at most drain_ms. Reading ends at that deadline, or earlier once the socket is
 * empty and nothing is in flight; then the shards' threads end, the final state snapshot, then
 * the socket closes with a short linger for the last replies.
 */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "td_auth.h"
#include "td_exec.h"
#include "td_fleet_status.h"
#include "td_http.h"
#include "td_local.h"
#include "td_log.h"
#include "td_metrics.h"
#include "td_ops.h"
#include "td_path.h"
#include "td_zmq_front.h"
#include "td_peers.h"
#include "td_pub.h"
#include "td_reply.h"
#include "td_server.h"
#include "td_service.h"
#include "td_settings.h"
#include "td_shm.h"
#include "td_stream.h"
#include "td_zmq.h"
#include "tk_backend.h"

struct td_server {
    /* A copy; binds and strings are borrowed from the caller's config, except the ones a reload
     * replaces (the allowed CURVE keys), which the server owns (own_reloadable_strings). */
    td_config_t cfg;
    uv_loop_t loop;
    uv_signal_t sig_int;
    uv_signal_t sig_term;
    uv_signal_t sig_hup;
    uv_timer_t drain_timer; /* the end of reading after a stop signal */
    uv_timer_t quiet_timer; /* a stopping socket that stayed empty long enough */
    uv_timer_t sweep_timer; /* frees idle per-peer entries */
    bool quiet;             /* stopping: the quiet timer ran out, nothing read since */
    bool closed;            /* transports and handles closed */

    td_streams_t *streams;
    td_peers_t *peers;     /* per-connection and per-client limits */
    td_replies_t *replies; /* what replies hold; lives until after the transports */
    td_path_t *path;       /* the request path, and its scheduler */
    td_zmq_t *zmq;         /* the ZeroMQ transport: the ROUTER socket, CURVE */
    td_fronts_t *fronts;   /* the endpoints with a thread each (td_zmq_front.h), or none */
    td_local_t *local;     /* the HTTP API's requests */
    tk_backend_t *cpu;     /* the CPU backend; the GPU runs through the executor's pipeline */
    td_exec_t *exec;       /* where compute requests run: CPU workers or the GPU pipeline */
    td_shm_t *shm;         /* shared-memory side channel and regions; NULL when off */
    td_pub_t *pub;         /* the PUB socket (subscriptions); NULL when off */
    char devices[256];
    td_metrics_t metrics; /* this thread's counters; the shards keep theirs (td_path.h) */
    td_shard_gauges_t shard_gauges[TD_SHARDS_LIMIT]; /* sample_gauges' */
    td_front_counts_t front_counts[TD_MAX_BINDS];    /* the same, each front's */
    td_service_t *service; /* systemd, state persistence, HTTP metrics, reload */
    uint64_t started_ns;
    td_fleet_status_t fleet_status; /* a NATS fleet worker's info keys and metrics */
};

/* ---- What the path and the service ask of the whole daemon -------------------------------- */

static void op_info(td_server_t *s, td_request_t *r)
{
    char gpu_uuids[1024];
    td_exec_gpu_uuids(s->exec, gpu_uuids, sizeof gpu_uuids);
    td_info_t info = {.cfg = &s->cfg,
                      .backend = td_exec_backend_name(s->exec),
                      .backends = td_exec_backends(s->exec),
                      .devices = td_exec_devices(s->exec),
                      .shm_path = td_shm_path(s->shm),
                      .pub_endpoint = s->pub ? td_pub_endpoint(s->pub) : NULL,
                      .gpu_uuids = gpu_uuids,
                      .curve = td_zmq_auth(s->zmq) != NULL,
                      .shards = td_path_shard_count(s->path),
                      .fleet = &s->fleet_status};
    td_op_info(&info, r);
}

/* The gauges `stats`, GET /metrics and the systemd status line report (the shards held still
 * by the caller, td_service.c: their queues and per-shard figures). */
static void sample_gauges(void *ctx, td_gauges_t *g)
{
    td_server_t *s = ctx;
    unsigned shards = td_path_shard_count(s->path);
    for (unsigned i = 0; i < shards && i < TD_SHARDS_LIMIT; i++)
        td_path_shard_gauges(s->path, i, &s->shard_gauges[i]);
    unsigned fronts = td_fronts_count(s->fronts);
    for (unsigned i = 0; i < fronts; i++)
        td_fronts_counts(s->fronts, i, &s->front_counts[i]);
    *g = (td_gauges_t){
        .inflight = td_path_inflight(s->path),
        .max_inflight = s->cfg.max_inflight,
        .queued = td_path_queued(s->path),
        .shards = shards,
        .shard = s->shard_gauges,
        .fronts = fronts,
        .front = s->front_counts,
        .stream_count = td_streams_count(s->streams),
        .state_bytes = td_streams_bytes(s->streams),
        .state_bytes_max = s->cfg.max_state_bytes,
        .stopping = td_path_stopping(s->path),
        .gpus_lost = td_exec_devices_lost(s->exec),
        .pub_messages = td_pub_messages(s->pub),
        .pub_failed = td_pub_failed(s->pub),
        .streams = s->streams,
        .metrics_streams = s->cfg.metrics_streams,
        .metrics_histogram_buckets = s->cfg.metrics_histogram_buckets,
        .backend = td_exec_backend_name(s->exec),
        .devices = td_exec_devices(s->exec),
        .device_memory_bytes = td_exec_device_bytes(s->exec),
        .uptime_s = (double)(uv_hrtime() - s->started_ns) / 1e9,
        .peers = td_peers_count(s->peers),
        .users = td_zmq_auth(s->zmq) ? s->peers : NULL,
        .fleet = &s->fleet_status,
    };
    td_replies_gauges(s->replies, &g->reply);
    td_zmq_gauges(s->zmq, &g->reply, &g->curve, &g->auth);
    td_shm_gauges(s->shm, &g->shm_regions, &g->shm_bytes);
    td_shm_device_gauges(s->shm, &g->gpu_regions, &g->gpu_region_bytes);
}

/* Every counter, the shards' summed (td_service_host_t.counters): the shards held still. */
static void sum_counters(void *ctx, td_metrics_t *out)
{
    td_server_t *s = ctx;
    td_path_sum_metrics(s->path, out);
}

/* A stream's record for the HTTP API (td_service_host_t.view): `query`'s, through td_ops.c. */
static tally_status_t host_view(void *ctx, const td_stream_t *stream, uint64_t window_ms,
                                tally_stream_info_t *out, uint64_t *start_ms, uint64_t *end_ms,
                                char *msg, size_t msg_cap)
{
    td_server_t *s = ctx;
    return td_op_view(&s->cfg, stream, window_ms, out, start_ms, end_ms, msg, msg_cap);
}

/* A query, reset or delete from HTTP (td_web.c), through the in-process transport. */
static void host_submit(void *ctx, const tally_req_t *req, td_reply_fn done, void *arg)
{
    td_server_t *s = ctx;
    td_local_submit(s->local, req, done, arg);
}

static td_service_host_t service_host(td_server_t *s)
{
    return (td_service_host_t){.loop = &s->loop,
                               .cfg = &s->cfg,
                               .streams = s->streams,
                               .metrics = &s->metrics,
                               .counters = sum_counters,
                               .gauges = sample_gauges,
                               .view = host_view,
                               .submit = host_submit,
                               .fleet = &s->fleet_status,
                               .ctx = s};
}

static void op_stats(td_server_t *s, td_request_t *r)
{
    td_service_host_t host = service_host(s);
    char *text = NULL;
    size_t len = 0;
    if (td_service_render_metrics(&host, &text, &len) != TD_OK) {
        td_request_fail(r, TALLY_E_INTERNAL, "out of memory");
        return;
    }
    td_request_succeed(r, TALLY_DTYPE_TEXT, text, len, len);
}

/* info and stats (td_path_env_t.answer_here). */
static void answer_here(void *owner, td_request_t *r)
{
    if (r->req.opcode == TALLY_OP_INFO)
        op_info(owner, r);
    else
        op_stats(owner, r);
}

/* The executor (td_exec.h) hands every compute request back here, on the loop thread. */
static void exec_done(void *owner, td_request_t *r)
{
    td_server_t *s = owner;
    td_path_finished(s->path, r);
}

/* ---- Stopping --------------------------------------------------------------------------- */

static void close_all(td_server_t *s);

/* The quiet timer ran out: nothing was read for TD_DRAIN_QUIET_MS since the stop signal or the
 * last message (td_config.h says why a moment is not enough). What came meanwhile is read first:
 * a message read there makes the socket not quiet after all (zmq_pumped). */
static void quiet_cb(uv_timer_t *handle)
{
    td_server_t *s = handle->data;
    s->quiet = true;
    td_zmq_pump(s->zmq);
}

/* Stopping, and input now: the quiet timer starts again. libuv's uv_timer_start fails only
 * without a callback or on a closing handle (after close_all, when nothing pumps any more). */
static void not_quiet(td_server_t *s)
{
    s->quiet = false;
    uv_timer_start(&s->quiet_timer, quiet_cb, TD_DRAIN_QUIET_MS, 0);
}

/* After every read of the ROUTER socket (td_zmq_env_t.pumped): while stopping, the quiet timer
 * again after a read, and the close once nothing is in flight and nothing more will be read, the
 * socket quiet or the drain deadline past. Only the timer says quiet (no clock is read here: this
 * runs after every turn of the loop too, and comparing times here raced the timer). */
static void zmq_pumped(void *owner, bool read_any, bool more)
{
    td_server_t *s = owner;
    if (!td_path_stopping(s->path))
        return;
    if (read_any)
        not_quiet(s);
    if (td_path_inflight(s->path) == 0 && !more && (s->quiet || !td_path_may_read(s->path)))
        close_all(s);
}

/* A stopping front has read (the quiet timer again) or answered: may tallyd close now? */
static void fronts_pumped(void *owner, bool read_any)
{
    td_server_t *s = owner;
    if (read_any && !s->closed)
        not_quiet(s);
    td_zmq_pump(s->zmq); /* zmq_pumped closes once nothing is in flight (the fronts' too) */
}

static void drain_cb(uv_timer_t *handle)
{
    td_server_t *s = handle->data;
    td_path_drain_over(s->path);
    td_notice("drain time over: reading stopped; %u requests still running",
              td_path_inflight(s->path));
    td_zmq_pump(s->zmq);
}

static void stop(td_server_t *s, int signum)
{
    unsigned inflight = td_path_inflight(s->path);
    if (td_path_stopping(s->path)) {
        td_notice("%s again: still stopping, %u requests in flight", strsignal(signum), inflight);
        return;
    }
    td_notice("%s: stopping; finishing %u requests in flight, answering the rest `shutdown` "
              "for up to %u ms",
              strsignal(signum), inflight, s->cfg.drain_ms);
    not_quiet(s); /* the signal counts as input */
    td_fronts_stopping(s->fronts);
    td_service_stopping(s->service);
    int rc = uv_timer_start(&s->drain_timer, drain_cb, s->cfg.drain_ms, 0);
    td_path_stop(s->path); /* answers what waits on a stream, in each stream's order */
    if (rc != 0) {         /* without its deadline the drain could last forever: end reading now */
        td_err("cannot start the drain timer: %s; reading stops now", uv_strerror(rc));
        td_path_drain_over(s->path);
    }
    td_zmq_pump(s->zmq);
}

static void signal_cb(uv_signal_t *handle, int signum)
{
    td_server_t *s = handle->data;
    if (signum == SIGHUP) {
        td_service_reload(s->service);
        td_zmq_reload(s->zmq, &s->cfg); /* the allowed client keys, read again */
        return;
    }
    stop(s, signum);
}

static void close_all(td_server_t *s)
{
    if (s->closed)
        return;
    s->closed = true;
    td_zmq_close(s->zmq);   /* replies kept for connections that closed are dropped */
    td_path_close(s->path); /* the shards' threads end: their state is this thread's now */
    td_fronts_stop(s->fronts); /* their last replies sent, their threads joined */
    uv_close((uv_handle_t *)&s->drain_timer, NULL);
    uv_close((uv_handle_t *)&s->quiet_timer, NULL);
    uv_close((uv_handle_t *)&s->sweep_timer, NULL);
    /* The signal handles stay installed (but no longer keep the loop alive) until
     * td_server_destroy: closing the last handle for a signal restores its default action, and
     * a second SIGTERM during the final flush would then kill tallyd mid-exit. */
    uv_unref((uv_handle_t *)&s->sig_int);
    uv_unref((uv_handle_t *)&s->sig_term);
    uv_unref((uv_handle_t *)&s->sig_hup);
    td_shm_close(s->shm); /* regions stay mapped until their requests are freed */
    td_pub_close(s->pub);
    td_exec_close(s->exec);       /* nothing is in flight any more */
    td_service_close(s->service); /* the final state snapshot: every request is answered */
    td_zmq_close_socket(s->zmq);
    td_notice("stopped");
}

/* ---- Starting ----------------------------------------------------------------------------- */

static void sweep_cb(uv_timer_t *handle)
{
    td_server_t *s = handle->data;
    td_peers_set_rate(s->peers, s->cfg.stream_create_rate);
    td_peers_sweep(s->peers, uv_hrtime()); /* the shards sweep their parts of the table */
}

/* A shard's machine (td_path_machines_t): the executor's port on the shard's loop. */
static td_err_t machine_open(void *ctx, unsigned shard, uv_loop_t *loop, td_sched_machine_t *m)
{
    td_server_t *s = ctx;
    int rc = td_exec_port_open(s->exec, shard, loop);
    if (rc != 0) {
        td_err("cannot open shard %u's way to the backends: %s", shard, uv_strerror(rc));
        return TD_ERR_LIBRARY;
    }
    td_exec_port_machine(s->exec, shard, m);
    return TD_OK;
}

static void machine_close(void *ctx, unsigned shard)
{
    td_server_t *s = ctx;
    td_exec_port_close(s->exec, shard);
}

/* The request path, the executor, and the schedulers that place work on it. */
static td_err_t open_backends(td_server_t *s)
{
    td_path_env_t path_env = {.cfg = &s->cfg,
                              .metrics = &s->metrics,
                              .streams = s->streams,
                              .peers = s->peers,
                              .replies = s->replies,
                              .loop = &s->loop,
                              .answer_here = answer_here,
                              .owner = s};
    td_err_t err = td_path_new(&path_env, &s->path);
    if (err != TD_OK)
        return err;
    tally_status_t st = tk_cpu_backend_new(&s->cpu);
    if (st != TALLY_OK) {
        td_err("cannot start the CPU backend: %s", tally_status_text(st));
        return TD_ERR_BACKEND;
    }
    td_exec_env_t env = {
        .loop = &s->loop,
        .cfg = &s->cfg,
        .metrics = &s->metrics,
        .cpu = s->cpu,
        .ports = td_path_port_count(s->path),
        .done = exec_done,
        .owner = s,
    };
    err = td_exec_new(&env, &s->exec);
    if (err != TD_OK)
        return err;
    td_path_machines_t machines = {.open = machine_open, .close = machine_close, .ctx = s};
    err = td_path_start(s->path, &machines);
    if (err != TD_OK)
        return err;
    td_exec_describe(s->exec, s->devices, sizeof s->devices);
    td_notice("backend %s (%s; chosen by --backend %s); %u shard%s", td_exec_backend_name(s->exec),
              s->devices, td_backend_choice_name(s->cfg.backend), td_path_shard_count(s->path),
              td_path_shard_count(s->path) == 1 ? "" : "s");
    return td_local_new(s->path, &s->local);
}

/* The transports that read: the ROUTER socket (td_zmq.h). */
static td_err_t open_transports(td_server_t *s)
{
    td_zmq_env_t env = {.loop = &s->loop,
                        .cfg = &s->cfg,
                        .path = s->path,
                        .metrics = &s->metrics,
                        .pumped = zmq_pumped,
                        .owner = s};
    td_err_t err = td_zmq_new(&env, &s->zmq);
    if (err != TD_OK)
        return err;
    td_fronts_env_t fronts = {.loop = &s->loop,
                              .cfg = &s->cfg,
                              .path = s->path,
                              .zmq_ctx = td_zmq_context(s->zmq),
                              .auth = td_zmq_auth(s->zmq),
                              .replies = s->replies,
                              .shards = td_path_shard_count(s->path),
                              .pumped = fronts_pumped,
                              .owner = s};
    return td_fronts_new(&fronts, &s->fronts);
}

/* The server's own handles: in td_server_new's order, so that a failure closes what was
 * opened. */
#define TD_LOOP_HANDLES 6
static void loop_handles(td_server_t *s, uv_handle_t *all[TD_LOOP_HANDLES])
{
    uv_handle_t *list[TD_LOOP_HANDLES] = {
        (uv_handle_t *)&s->drain_timer, (uv_handle_t *)&s->quiet_timer,
        (uv_handle_t *)&s->sweep_timer, (uv_handle_t *)&s->sig_int,
        (uv_handle_t *)&s->sig_term,    (uv_handle_t *)&s->sig_hup,
    };
    memcpy(all, list, sizeof list);
}

static int init_handles(td_server_t *s)
{
    int rc = 0;
    uv_timer_t *timers[] = {&s->drain_timer, &s->quiet_timer, &s->sweep_timer};
    for (size_t i = 0; rc == 0 && i < sizeof timers / sizeof timers[0]; i++)
        rc = uv_timer_init(&s->loop, timers[i]);
    uv_signal_t *signals[] = {&s->sig_int, &s->sig_term, &s->sig_hup};
    for (size_t i = 0; rc == 0 && i < sizeof signals / sizeof signals[0]; i++)
        rc = uv_signal_init(&s->loop, signals[i]);
    uv_handle_t *handles[TD_LOOP_HANDLES];
    loop_handles(s, handles);
    for (size_t i = 0; i < TD_LOOP_HANDLES; i++)
        handles[i]->data = s;
    return rc;
}

static int start_handles(td_server_t *s)
{
    int rc = uv_timer_start(&s->sweep_timer, sweep_cb, TD_PEERS_SWEEP_MS, TD_PEERS_SWEEP_MS);
    if (rc == 0)
        uv_unref((uv_handle_t *)&s->sweep_timer);
    if (rc == 0)
        rc = uv_signal_start(&s->sig_int, signal_cb, SIGINT);
    if (rc == 0)
        rc = uv_signal_start(&s->sig_term, signal_cb, SIGTERM);
    if (rc == 0)
        rc = uv_signal_start(&s->sig_hup, signal_cb, SIGHUP);
    return rc;
}

static td_err_t open_handles(td_server_t *s)
{
    int rc = init_handles(s);
    if (rc == 0)
        rc = start_handles(s);
    if (rc != 0) {
        td_err("cannot set up the event loop: %s", uv_strerror(rc));
        return TD_ERR_LIBRARY;
    }
    return TD_OK;
}

/* A failed start: closes the handles that were initialised (a zeroed handle has no type yet). */
static void close_handles(td_server_t *s)
{
    uv_handle_t *handles[TD_LOOP_HANDLES];
    loop_handles(s, handles);
    for (size_t i = 0; i < TD_LOOP_HANDLES; i++)
        if (handles[i]->type != UV_UNKNOWN_HANDLE && !uv_is_closing(handles[i]))
            uv_close(handles[i], NULL);
    uv_run(&s->loop, UV_RUN_NOWAIT);
}

/* A stream was deleted: its subscribers hear of it (td_path calls this only with a PUB socket). */
static void stream_deleted(void *ctx, const char *name, size_t name_len)
{
    td_server_t *s = ctx;
    td_pub_deleted(s->pub, name, name_len);
}

/* What serves beside the ROUTER socket: the shared-memory side channel, the PUB socket, and the
 * service (which restores stream state before READY). */
static td_err_t open_services(td_server_t *s)
{
    td_shm_env_t shm_env = {.loop = &s->loop, .cfg = &s->cfg};
    td_exec_shm_env(s->exec, &shm_env);
    td_err_t err = td_shm_new(&shm_env, &s->shm);
    if (err != TD_OK)
        return err;
    if (s->cfg.pub_endpoint) {
        char why[512];
        err = td_pub_new(&s->loop, td_zmq_context(s->zmq), td_zmq_auth(s->zmq), s->cfg.pub_endpoint,
                         s->cfg.pub_interval_ms, s->streams, &s->pub, why, sizeof why);
        if (err != TD_OK) {
            td_err("%s", why);
            return err;
        }
    }
    td_path_attach(s->path, s->shm, s->pub ? stream_deleted : NULL, s);
    td_service_host_t host = service_host(s);
    return td_service_new(&host, &s->service);
}

/* Undoes open_transports, open_handles and open_services after a failure in one of them. */
static void close_started(td_server_t *s)
{
    close_handles(s);
    if (s->pub) {
        td_pub_close(s->pub);
        uv_run(&s->loop, UV_RUN_NOWAIT);
        td_pub_destroy(&s->pub);
    }
    if (s->shm) {
        td_shm_close(s->shm);
        uv_run(&s->loop, UV_RUN_NOWAIT);
        td_shm_destroy(&s->shm);
    }
    td_fronts_destroy(&s->fronts); /* never ran: before the context's end */
    if (s->zmq) {
        td_zmq_close(s->zmq);
        uv_run(&s->loop, UV_RUN_NOWAIT);
        td_zmq_close_socket(s->zmq);
        td_zmq_destroy(&s->zmq);
    }
}

/* The strings a reload replaces in the live configuration (td_config_apply_runtime frees the
 * old value) must be the server's own, not the caller's. */
static bool own_reloadable_strings(td_server_t *s)
{
    char **fields[] = {&s->cfg.curve_clients_dir, &s->cfg.curve_clients};
    bool ok = true;
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        const char *borrowed = *fields[i];
        *fields[i] = borrowed ? strdup(borrowed) : NULL;
        ok &= !borrowed || *fields[i];
    }
    return ok;
}

static void free_reloadable_strings(td_server_t *s)
{
    free(s->cfg.curve_clients_dir);
    free(s->cfg.curve_clients);
    s->cfg.curve_clients_dir = s->cfg.curve_clients = NULL;
}

/* The stream table (windows, the test clock) and the per-peer table. */
static td_err_t open_tables(td_server_t *s)
{
    unsigned shards = td_config_shards(&s->cfg);
    td_err_t err = td_streams_new_parts(shards, s->cfg.max_streams, &s->streams);
    if (err != TD_OK)
        return err;
    td_streams_set_window(s->streams, s->cfg.window_intervals, s->cfg.window_interval_ms);
    td_streams_set_budget(s->streams, s->cfg.max_state_bytes,
                          td_config_state_bytes_per_client(&s->cfg));
    td_clock_set_test_file(s->cfg.test_clock);
    err = td_replies_new(&s->cfg, &s->replies);
    if (err == TD_OK)
        err = td_peers_new_shards(shards, &s->peers);
    return err;
}

static void close_tables(td_server_t *s)
{
    td_local_destroy(&s->local);
    td_path_destroy(&s->path); /* and the shards' schedulers */
    td_exec_destroy(&s->exec);
    if (s->cpu)
        s->cpu->destroy(&s->cpu);
    td_peers_destroy(&s->peers);
    td_fronts_destroy(&s->fronts);   /* its peers' tables, as the one above */
    td_replies_destroy(&s->replies); /* after the transports: they free replies until then */
    td_streams_destroy(&s->streams);
}

td_err_t td_server_check_files(const td_config_t *cfg)
{
    char msg[1536];
    td_err_t err = td_config_check_files(cfg, msg, sizeof msg);
    if (err == TD_OK && (err = td_auth_check(cfg, msg, sizeof msg)) != TD_OK)
        td_err("curve: %s", msg); /* as td_router_open says it */
    else if (err != TD_OK)
        td_err("%s", msg);
    return err == TD_OK ? td_http_check(cfg) : err;
}

td_err_t td_server_new(const td_config_t *cfg, td_server_t **out)
{
    td_server_t *s = calloc(1, sizeof *s);
    if (!s)
        return TD_ERR_NOMEM;
    s->cfg = *cfg;
    s->started_ns = uv_hrtime();
    td_err_t err = TD_ERR_NOMEM;
    if (!own_reloadable_strings(s))
        goto fail_free;
    err = TD_ERR_LIBRARY;
    if (uv_loop_init(&s->loop) != 0)
        goto fail_free;
    err = open_tables(s);
    if (err == TD_OK)
        err = open_backends(s);
    if (err != TD_OK)
        goto fail_tables;
    err = open_transports(s);
    if (err == TD_OK)
        err = open_handles(s);
    if (err == TD_OK)
        err = open_services(s);
    if (err != TD_OK)
        goto fail_started;
    *out = s;
    return TD_OK;

fail_started:
    close_started(s);
fail_tables:
    close_tables(s);
    uv_loop_close(&s->loop);
fail_free:
    free_reloadable_strings(s);
    free(s);
    return err;
}

/* The signals of td_server_block_signals. */
static void signal_set(sigset_t *set)
{
    sigemptyset(set);
    sigaddset(set, SIGTERM);
    sigaddset(set, SIGINT);
    sigaddset(set, SIGHUP);
}

void td_server_block_signals(void)
{
    sigset_t set;
    signal_set(&set);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
}

int td_server_run(td_server_t *s)
{
    td_notice("tallyd %s ready: %u in flight max, batches up to %zu bytes", TALLY_VERSION,
              s->cfg.max_inflight, s->cfg.max_batch);
    td_service_ready(s->service);
    if (td_path_run(s->path) != TD_OK || td_fronts_run(s->fronts) != TD_OK) {
        /* the shards' threads, the fronts': stop at once, cleanly */
        stop(s, SIGTERM);
        td_path_drain_over(s->path);
    }
    td_zmq_pump(s->zmq); /* messages may have queued between bind and the first poll */
    sigset_t set;
    signal_set(&set);
    pthread_sigmask(SIG_UNBLOCK, &set, NULL); /* every thread is up, each with them blocked */
    uv_run(&s->loop, UV_RUN_DEFAULT);
    return td_service_exit_code(s->service); /* the final snapshot: did it reach the disk? */
}

uv_loop_t *td_server_loop(td_server_t *self)
{
    return &self->loop;
}

td_streams_t *td_server_streams(td_server_t *self)
{
    return self->streams;
}

td_fleet_status_t *td_server_fleet_status(td_server_t *self)
{
    return &self->fleet_status;
}

td_path_t *td_server_path(td_server_t *self)
{
    return self->path;
}

void td_server_destroy(td_server_t **self_p)
{
    td_server_t *s = *self_p;
    if (!s)
        return;
    if (!s->closed) { /* not stopped by a signal: close what the loop still holds */
        close_all(s);
        uv_run(&s->loop, UV_RUN_DEFAULT);
    }
    td_service_destroy(&s->service);
    td_zmq_destroy(&s->zmq); /* waits (up to the linger) for the last replies to leave */
    uv_close((uv_handle_t *)&s->sig_int, NULL);
    uv_close((uv_handle_t *)&s->sig_term, NULL);
    uv_close((uv_handle_t *)&s->sig_hup, NULL);
    /* Closing them restored the default actions; tallyd is exiting, so a late SIGTERM (a
     * second Ctrl-C, systemd's stop) must not turn a clean exit into death by signal. */
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    td_pub_destroy(&s->pub);
    td_shm_destroy(&s->shm); /* before the executor: regions unregister from the GPU */
    close_tables(s);         /* td_exec_destroy joins the GPU lane threads */
    if (uv_loop_close(&s->loop) != 0)
        td_warn("the event loop still had handles open at exit");
    free_reloadable_strings(s);
    free(s);
    *self_p = NULL;
}
