/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_gpu_lanes.c — the GPU pipeline's lanes and devices (daemon/core/td_gpu.c and
 * td_gpu_device.c) driven directly, on simulated GPUs wrapped in an engine of this test's own
 * whose calls misbehave on command (the engine table is the one seam: nothing above it carries a
 * hook). What the daemon-level tests cannot make a device do is done here:
 *   - a kernel that reports more elements kept than it was given: the batch is distrusted
 *     (gpu_failed), never a reply read past its output;
 *   - a lane whose thread cannot bind to its device: that device is unusable and fails its work;
 *   - failures in a row past TD_GPU_DEAD_AFTER: the device is lost once, every request failed;
 *   - work held on the device: a slow launch (the watchdog asks, finds it running, waits on) and
 *     its completion; a lost context found by the watchdog on two lanes, a failed launch behind
 *     it, the recovery (submissions meanwhile fail at once), the device serving again; without
 *     device_reset it stays unusable; a reply still held by its sender delays the recovery;
 *   - spin-polling (--gpu-spin-us): an engine without lane_finished, a wake-up that cannot be
 *     asked for (the watchdog's wake-ups carry on), a wake-up asked for while one is pending;
 *   - --gpu-spin-loop: the shard's loop keeps an idle handle active while its requests are on
 *     the GPU, and only then;
 *   - a second shard's sink on its own loop: its completions, and the recovery it hands to the
 *     wiring's loop;
 *   - set-up failures: no device, a sink left open at td_gpu_destroy, a region the engine
 *     cannot register, an import the engine cannot do or whose device fails it;
 *     and the small contracts of td_gpu.h (devices out of range, short buffers).
 * Every request's outcome is asserted: its reply (a filter's count and kept elements) or
 * gpu_failed, in submission order per lane.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "td_gpu.h"
#include "td_gpu_engine.h"

#define MAX_BATCH (64u << 10)
#define N 1024 /* int32 elements per batch */
#define HELD_MAX 64

/* ---- the test's engine: sim underneath, misbehaving on command -------------------------- */

typedef struct {
    void *lane;
    unsigned slot;
    td_gpu_done_fn done;
    void *arg;
} held_t;

static struct {
    td_gpu_engine_t *inner; /* the sim engine */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    /* knobs */
    bool no_devices;
    bool bind_fails;
    bool bogus_kept;     /* a filter reports n + 1 elements kept */
    bool fail_launches;  /* every launch fails */
    bool hold;           /* launches run but their completion is withheld until release */
    bool lost;           /* the context is lost: launches and lane_check fail */
    unsigned check_ok;   /* lane_check answers OK this many more times even when lost */
    bool notify_fails;
    bool reset_blocks;   /* device_reset waits for reset_go */
    bool reset_go;
    unsigned reset_entered;
    bool register_fails;
    bool import_fails;
    bool reset_fails;    /* device_reset cannot recreate the context */
    bool notify_at_once; /* a wake-up asked for while work is held comes at once */
    bool no_uuid;        /* device_uuid fails */
    /* what happened */
    held_t held[HELD_MAX];
    unsigned held_count;
    held_t notify[HELD_MAX]; /* wake-ups asked for while work was held */
    unsigned notify_count;
    unsigned woken_at_once; /* wake-ups given at once (notify_at_once) */
    unsigned checks;
    unsigned resets;
    struct {
        void *lane;
        td_gpu_staging_t *staging;
    } lanes[16];
    unsigned lane_count;
} T = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};

static _Thread_local char t_error[128] = "no error";

/* A knob of T as the engine's callers see it (lane threads, workers: under its lock). */
static bool flag(const bool *k)
{
    pthread_mutex_lock(&T.lock);
    bool value = *k;
    pthread_mutex_unlock(&T.lock);
    return value;
}

static void knobs_reset(void)
{
    pthread_mutex_lock(&T.lock);
    T.no_devices = T.bind_fails = T.bogus_kept = T.fail_launches = T.hold = T.lost = false;
    T.notify_fails = T.reset_blocks = T.reset_go = false;
    T.register_fails = T.import_fails = T.reset_fails = T.notify_at_once = T.no_uuid = false;
    T.check_ok = T.held_count = T.notify_count = T.checks = T.resets = T.lane_count = 0;
    T.reset_entered = T.woken_at_once = 0;
    pthread_mutex_unlock(&T.lock);
}

static int t_device_count(void *ctx)
{
    return flag(&T.no_devices) ? 0 : T.inner->device_count(ctx);
}

static td_gpu_err_t t_lane_open(void *ctx, int device, size_t max_batch, unsigned slots,
                                unsigned carries, void **lane, td_gpu_staging_t *staging,
                                uint64_t *device_bytes, char *why, size_t why_cap)
{
    td_gpu_err_t st = T.inner->lane_open(ctx, device, max_batch, slots, carries, lane, staging,
                                         device_bytes, why, why_cap);
    pthread_mutex_lock(&T.lock);
    if (st == TD_GPU_OK && T.lane_count < 16) {
        T.lanes[T.lane_count].lane = *lane;
        T.lanes[T.lane_count++].staging = staging;
    }
    pthread_mutex_unlock(&T.lock);
    return st;
}

static td_gpu_staging_t *staging_of(void *lane)
{
    td_gpu_staging_t *s = NULL;
    pthread_mutex_lock(&T.lock);
    for (unsigned i = 0; i < T.lane_count; i++)
        if (T.lanes[i].lane == lane)
            s = T.lanes[i].staging;
    pthread_mutex_unlock(&T.lock);
    return s;
}

static void t_lane_close(void *lane)
{
    pthread_mutex_lock(&T.lock);
    for (unsigned i = 0; i < T.lane_count; i++)
        if (T.lanes[i].lane == lane)
            T.lanes[i].lane = NULL;
    pthread_mutex_unlock(&T.lock);
    T.inner->lane_close(lane);
}

static td_gpu_err_t t_lane_bind(void *lane)
{
    if (flag(&T.bind_fails))
        return TD_GPU_E_DEVICE;
    return T.inner->lane_bind(lane);
}

static td_gpu_err_t t_lane_launch(void *lane, const td_gpu_job_t *job, td_gpu_done_fn done,
                                  void *arg)
{
    pthread_mutex_lock(&T.lock);
    bool fail = T.lost || T.fail_launches, hold = T.hold, bogus = T.bogus_kept;
    pthread_mutex_unlock(&T.lock);
    if (fail) {
        snprintf(t_error, sizeof t_error, "test engine: launch refused");
        return TD_GPU_E_DEVICE;
    }
    td_gpu_err_t st = T.inner->lane_launch(lane, job, NULL, NULL); /* runs now */
    if (st != TD_GPU_OK)
        return st;
    if (bogus && job->opcode == TALLY_OP_FILTER)
        staging_of(lane)[job->slot].small->kept = job->n + 1;
    if (!hold) {
        if (done)
            done(arg);
        return TD_GPU_OK;
    }
    pthread_mutex_lock(&T.lock);
    assert_true(T.held_count < HELD_MAX);
    T.held[T.held_count++] = (held_t){.lane = lane, .slot = job->slot, .done = done, .arg = arg};
    pthread_cond_broadcast(&T.cond);
    pthread_mutex_unlock(&T.lock);
    return TD_GPU_OK;
}

static bool t_lane_finished(void *lane, unsigned slot)
{
    bool held = false;
    pthread_mutex_lock(&T.lock);
    for (unsigned i = 0; i < T.held_count; i++)
        held |= T.held[i].lane == lane && T.held[i].slot == slot;
    pthread_mutex_unlock(&T.lock);
    return !held && T.inner->lane_finished(lane, slot);
}

static td_gpu_err_t t_lane_notify(void *lane, td_gpu_done_fn done, void *arg)
{
    pthread_mutex_lock(&T.lock);
    if (T.notify_fails) {
        pthread_mutex_unlock(&T.lock);
        snprintf(t_error, sizeof t_error, "test engine: no wake-up");
        return TD_GPU_E_DEVICE;
    }
    bool held = false;
    for (unsigned i = 0; i < T.held_count; i++)
        held |= T.held[i].lane == lane;
    if (held && T.notify_at_once) { /* as if the work finished between the poll and the ask */
        pthread_mutex_unlock(&T.lock);
        done(arg);
        pthread_mutex_lock(&T.lock);
        T.woken_at_once++;
        pthread_mutex_unlock(&T.lock);
        return TD_GPU_OK;
    }
    if (held) { /* once the held work is released */
        T.notify[T.notify_count++] = (held_t){.lane = lane, .done = done, .arg = arg};
        pthread_mutex_unlock(&T.lock);
        return TD_GPU_OK;
    }
    pthread_mutex_unlock(&T.lock);
    return T.inner->lane_notify(lane, done, arg);
}

static td_gpu_err_t t_lane_check(void *lane)
{
    (void)lane;
    pthread_mutex_lock(&T.lock);
    T.checks++;
    pthread_cond_broadcast(&T.cond);
    td_gpu_err_t st = TD_GPU_OK;
    if (T.lost && T.check_ok)
        T.check_ok--;
    else if (T.lost)
        st = TD_GPU_E_DEVICE;
    pthread_mutex_unlock(&T.lock);
    if (st != TD_GPU_OK)
        snprintf(t_error, sizeof t_error, "test engine: context lost");
    return st;
}

static td_gpu_err_t t_device_uuid(void *ctx, int device, uint8_t uuid[TALLY_GPU_UUID_SIZE])
{
    if (flag(&T.no_uuid))
        return TD_GPU_E_DEVICE;
    return T.inner->device_uuid(ctx, device, uuid);
}

static td_gpu_err_t t_region_register(void *ctx, void *base, size_t size, bool read_only)
{
    if (flag(&T.register_fails)) {
        snprintf(t_error, sizeof t_error, "test engine: cannot register");
        return TD_GPU_E_DEVICE;
    }
    return T.inner->region_register(ctx, base, size, read_only);
}

static td_gpu_err_t t_dev_import(void *ctx, const td_gpu_import_args_t *a, uint32_t *peers_mapped,
                                 void **import, void **ptr, char *why, size_t why_cap)
{
    if (flag(&T.import_fails)) {
        snprintf(why, why_cap, "test engine: the device failed the import");
        return TD_GPU_E_DEVICE;
    }
    return T.inner->dev_import(ctx, a, peers_mapped, import, ptr, why, why_cap);
}

/* The context is recreated: what was held on the device went with the old one. */
static td_gpu_err_t t_device_reset(void *ctx, int device, char *why, size_t why_cap)
{
    pthread_mutex_lock(&T.lock);
    T.reset_entered++;
    while (T.reset_blocks && !T.reset_go)
        pthread_cond_wait(&T.cond, &T.lock);
    T.resets++;
    bool fails = T.reset_fails;
    T.lost = fails;
    T.held_count = T.notify_count = 0;
    pthread_mutex_unlock(&T.lock);
    if (fails) {
        snprintf(why, why_cap, "test engine: the context cannot be recreated");
        return TD_GPU_E_DEVICE;
    }
    return T.inner->device_reset(ctx, device, why, why_cap);
}

static const char *t_error_string(void)
{
    return t_error;
}

static void t_destroy(td_gpu_engine_t **self_p)
{
    T.inner->destroy(&T.inner);
    free(*self_p);
    *self_p = NULL;
}

/* The test engine over `devices` simulated GPUs; without_* leave a member out (NULL), as an
 * engine that cannot do it has. */
typedef enum {
    WITH_ALL = 0,
    WITHOUT_FINISHED = 1,
    WITHOUT_IMPORT = 2,
    WITHOUT_RESET = 4,
    WITHOUT_NOTIFY = 8,
    WITHOUT_SPLIT = 16,
} without_t;

static td_gpu_engine_t *engine_new(unsigned devices, unsigned without)
{
    assert_int_equal(td_gpu_engine_sim_new(devices, &T.inner), TD_GPU_OK);
    td_gpu_engine_t *e = malloc(sizeof *e);
    assert_non_null(e);
    *e = *T.inner;
    e->name = "test";
    e->device_count = t_device_count;
    e->lane_open = t_lane_open;
    e->lane_close = t_lane_close;
    e->lane_bind = t_lane_bind;
    e->lane_launch = t_lane_launch;
    e->lane_finished = (without & WITHOUT_FINISHED) ? NULL : t_lane_finished;
    e->lane_notify = (without & WITHOUT_NOTIFY) ? NULL : t_lane_notify;
    e->lane_launch_split = (without & WITHOUT_SPLIT) ? NULL : T.inner->lane_launch_split;
    e->device_uuid = t_device_uuid;
    e->lane_check = t_lane_check;
    e->region_register = t_region_register;
    e->dev_import = (without & WITHOUT_IMPORT) ? NULL : t_dev_import;
    e->device_reset = (without & WITHOUT_RESET) ? NULL : t_device_reset;
    e->error_string = t_error_string;
    e->destroy = t_destroy;
    return e;
}

/* Releases the held work: each launch completes (its done), then the wake-ups asked for. */
static void release_held(void)
{
    pthread_mutex_lock(&T.lock);
    held_t held[HELD_MAX], notify[HELD_MAX];
    unsigned held_count = T.held_count, notify_count = T.notify_count;
    memcpy(held, T.held, sizeof held);
    memcpy(notify, T.notify, sizeof notify);
    T.held_count = T.notify_count = 0;
    pthread_mutex_unlock(&T.lock);
    for (unsigned i = 0; i < held_count; i++)
        if (held[i].done)
            held[i].done(held[i].arg);
    for (unsigned i = 0; i < notify_count; i++)
        notify[i].done(notify[i].arg);
}

/* Sets a knob of T (the lane threads read them under its lock). */
static void knob(bool *k, bool value)
{
    pthread_mutex_lock(&T.lock);
    *k = value;
    pthread_cond_broadcast(&T.cond);
    pthread_mutex_unlock(&T.lock);
}

static unsigned counted(const unsigned *what)
{
    pthread_mutex_lock(&T.lock);
    unsigned n = *what;
    pthread_mutex_unlock(&T.lock);
    return n;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Waits (generously: a loaded box) until `what` of T reaches `want`. */
static void wait_for(const unsigned *what, unsigned want)
{
    double deadline = now_s() + 30;
    pthread_mutex_lock(&T.lock);
    while (*what < want) {
        pthread_mutex_unlock(&T.lock);
        assert_true(now_s() < deadline);
        usleep(1000);
        pthread_mutex_lock(&T.lock);
    }
    pthread_mutex_unlock(&T.lock);
}

/* ---- the pipeline under test ------------------------------------------------------------- */

typedef struct {
    uv_loop_t loop, loop2; /* the wiring's (sink 0), and a second shard's (sink 1) */
    td_gpu_t *gpu;
    unsigned sinks;
    td_request_t *done[64]; /* completions, in the order they came */
    unsigned done_count;
} rig_t;

static int32_t batch[N]; /* half of it positive */

static void complete(void *owner, td_request_t *r)
{
    rig_t *g = owner;
    assert_true(g->done_count < 64);
    g->done[g->done_count++] = r;
}

static td_err_t rig_open_opts(rig_t *g, td_gpu_engine_t *e, const td_gpu_opts_t *opts,
                              char *why, size_t why_cap)
{
    memset(g, 0, sizeof *g);
    for (int i = 0; i < N; i++)
        batch[i] = (i % 2) ? i : -i;
    assert_int_equal(uv_loop_init(&g->loop), 0);
    assert_int_equal(uv_loop_init(&g->loop2), 0);
    td_err_t err = td_gpu_new(&g->loop, e, opts, &g->gpu, why, why_cap);
    if (err != TD_OK)
        return err;
    assert_int_equal(td_gpu_sink_open(g->gpu, 0, &g->loop, complete, g), 0);
    g->sinks = opts->sinks > 1 ? 2 : 1;
    if (g->sinks > 1)
        assert_int_equal(td_gpu_sink_open(g->gpu, 1, &g->loop2, complete, g), 0);
    return TD_OK;
}

static void rig_open(rig_t *g, td_gpu_engine_t *e, unsigned lanes, unsigned spin_us)
{
    td_gpu_opts_t opts = {.max_batch = MAX_BATCH, .lanes = lanes, .slots = 4, .spin_us = spin_us,
                          .max_inflight = 8, .sinks = 1};
    char why[256] = "";
    assert_int_equal(rig_open_opts(g, e, &opts, why, sizeof why), TD_OK);
}

static void rig_free_done(rig_t *g)
{
    for (unsigned i = 0; i < g->done_count; i++)
        td_request_destroy(&g->done[i]);
    g->done_count = 0;
}

static void rig_close(rig_t *g)
{
    rig_free_done(g);
    for (unsigned i = 0; i < g->sinks; i++)
        td_gpu_sink_close(g->gpu, i);
    td_gpu_close(g->gpu);
    uv_run(&g->loop, UV_RUN_DEFAULT);
    uv_run(&g->loop2, UV_RUN_DEFAULT);
    td_gpu_destroy(&g->gpu);
    assert_null(g->gpu);
    assert_int_equal(uv_loop_close(&g->loop), 0);
    assert_int_equal(uv_loop_close(&g->loop2), 0);
}

/* A filter (> 0) of the batch on device 0, lane `lane`, shard `shard`. */
static td_request_t *submit(rig_t *g, unsigned lane, unsigned shard, uint64_t id)
{
    td_request_t *r = td_request_new();
    assert_non_null(r);
    r->req.opcode = TALLY_OP_FILTER;
    r->req.dtype = TALLY_DTYPE_I32;
    r->req.pred = TALLY_PRED_GT;
    r->req.lo = 0;
    r->rep.request_id = id;
    r->payload = batch;
    r->payload_len = sizeof batch;
    r->shard = shard;
    r->where = (td_placement_t){.gpu = true, .device = 0, .lane = lane, .pieces = 1};
    td_gpu_submit(g->gpu, r);
    return r;
}

/* Runs both loops until `want` completions came (30 s at most). */
static void pump(rig_t *g, unsigned want)
{
    double deadline = now_s() + 30;
    while (g->done_count < want) {
        uv_run(&g->loop, UV_RUN_NOWAIT);
        uv_run(&g->loop2, UV_RUN_NOWAIT);
        assert_true(now_s() < deadline);
        usleep(500);
    }
}

/* Runs both loops for a while (5 ms): what completes meanwhile is delivered. */
static void pump_briefly(rig_t *g)
{
    double until = now_s() + 0.005;
    while (now_s() < until) {
        uv_run(&g->loop, UV_RUN_NOWAIT);
        uv_run(&g->loop2, UV_RUN_NOWAIT);
        usleep(500);
    }
}

/* Runs the wiring's loop until the description of the pipeline contains `what`. */
static void pump_until_described(rig_t *g, const char *what)
{
    double deadline = now_s() + 30;
    char desc[256];
    for (;;) {
        td_gpu_describe(g->gpu, desc, sizeof desc);
        if (strstr(desc, what))
            return;
        assert_true(now_s() < deadline);
        uv_run(&g->loop, UV_RUN_NOWAIT);
        usleep(1000);
    }
}

/* The filter's correct reply: the N / 2 positive elements, each > 0. */
static void assert_filtered(const td_request_t *r, uint64_t id)
{
    assert_int_equal(r->rep.request_id, id);
    assert_false(r->gpu_failed);
    assert_int_equal(r->rep.status, TALLY_OK);
    assert_int_equal(r->rep.count, N / 2);
    assert_int_equal(r->reply_len, (N / 2) * sizeof(int32_t));
    const int32_t *kept = r->reply_data;
    for (int i = 0; i < N / 2; i++)
        assert_true(kept[i] > 0);
}

/* Releases the held work; the first n requests (ids 1..n) are then answered right, in order,
 * and the rig is closed. */
static void finish(rig_t *g, unsigned n)
{
    release_held();
    pump(g, n);
    for (unsigned i = 0; i < n; i++)
        assert_filtered(g->done[i], i + 1);
    rig_close(g);
}

static void assert_gpu_failed(const td_request_t *r, uint64_t id)
{
    assert_int_equal(r->rep.request_id, id);
    assert_true(r->gpu_failed);
}

/* ---- tests ------------------------------------------------------------------------------- */

/* A kernel that says it kept more than it was given: the batch is failed (the CPU reruns it),
 * the output never read past the n elements; the next batch is answered. */
static void test_impossible_count_is_distrusted(void **state)
{
    (void)state;
    knobs_reset();
    rig_t g;
    rig_open(&g, engine_new(1, WITH_ALL), 1, 0);
    knob(&T.bogus_kept, true);
    submit(&g, 0, 0, 1);
    pump(&g, 1);
    assert_gpu_failed(g.done[0], 1);
    knob(&T.bogus_kept, false);
    submit(&g, 0, 0, 2);
    pump(&g, 2);
    assert_filtered(g.done[1], 2);
    assert_true(td_gpu_device_usable(g.gpu, 0)); /* a success in between: not in a row */
    rig_close(&g);
}

/* A lane thread that cannot bind to its device: the device is unusable from the start, and
 * what is submitted to it fails (for the CPU) rather than waits. */
static void test_lane_bind_fails(void **state)
{
    (void)state;
    knobs_reset();
    knob(&T.bind_fails, true);
    rig_t g;
    rig_open(&g, engine_new(1, WITH_ALL), 1, 0);
    double deadline = now_s() + 30;
    while (td_gpu_usable(g.gpu)) { /* the lane thread binds after td_gpu_new returns */
        assert_true(now_s() < deadline);
        usleep(1000);
    }
    assert_false(td_gpu_device_usable(g.gpu, 0));
    assert_int_equal(td_gpu_devices_lost(g.gpu), 1);
    submit(&g, 0, 0, 1);
    submit(&g, 0, 0, 2);
    pump(&g, 2);
    assert_gpu_failed(g.done[0], 1);
    assert_gpu_failed(g.done[1], 2);
    rig_close(&g);
}

/* Every launch fails: TD_GPU_DEAD_AFTER in a row mark the device lost (once), and the requests
 * queued behind them fail too, in order. */
static void test_failures_in_a_row(void **state)
{
    (void)state;
    knobs_reset();
    knob(&T.fail_launches, true);
    rig_t g;
    rig_open(&g, engine_new(1, WITH_ALL), 1, 0);
    for (uint64_t id = 1; id <= TD_GPU_DEAD_AFTER + 2; id++)
        submit(&g, 0, 0, id);
    pump(&g, TD_GPU_DEAD_AFTER + 2);
    for (unsigned i = 0; i < TD_GPU_DEAD_AFTER + 2; i++)
        assert_gpu_failed(g.done[i], i + 1);
    assert_false(td_gpu_usable(g.gpu));
    assert_int_equal(td_gpu_devices_lost(g.gpu), 1);
    char desc[256];
    td_gpu_describe(g.gpu, desc, sizeof desc);
    assert_string_equal(desc, "test: 0:simulated GPU 0 (1 CUDA streams, unusable)");
    rig_close(&g);
}

/* A launch slower than the watchdog's period: the lane asks the engine, finds the work still
 * running (lane_check OK) and waits on; the completion then wakes it and the reply is right. */
static void test_slow_launch_outlives_the_watchdog(void **state)
{
    (void)state;
    knobs_reset();
    knob(&T.hold, true);
    rig_t g;
    rig_open(&g, engine_new(1, WITH_ALL), 1, 0);
    submit(&g, 0, 0, 1);
    wait_for(&T.checks, 1); /* the watchdog asked: still running */
    pump_briefly(&g);
    assert_int_equal(g.done_count, 0);
    assert_true(td_gpu_usable(g.gpu));
    finish(&g, 1);
}

/* A lost context found by the watchdog: the held work of both lanes fails (one of them finds
 * the device already lost), so does a launch refused behind it; the device is recovered once
 * idle, work submitted during the recovery fails at once, and afterwards it serves again. */
static void test_lost_context_and_recovery(void **state)
{
    (void)state;
    knobs_reset();
    knob(&T.hold, true);
    knob(&T.reset_blocks, true);
    rig_t g;
    rig_open(&g, engine_new(1, WITH_ALL), 2, 0);
    submit(&g, 0, 0, 1);
    submit(&g, 1, 0, 2);
    wait_for(&T.held_count, 2);
    knob(&T.lost, true); /* the next launch is refused, the watchdog finds both lanes failed */
    submit(&g, 0, 0, 3);
    pump(&g, 3);
    for (unsigned i = 0; i < 3; i++)
        assert_true(g.done[i]->gpu_failed);
    assert_int_equal(td_gpu_devices_lost(g.gpu), 1);
    /* The recovery started on the loop once the device was idle; its reset waits. */
    pump_until_described(&g, "recovering");
    wait_for(&T.reset_entered, 1);
    uint64_t bytes = td_gpu_device_bytes(g.gpu);
    assert_int_equal(bytes, 0); /* its lanes are being reopened: not counted */
    submit(&g, 0, 0, 4);
    pump(&g, 4);
    assert_gpu_failed(g.done[3], 4);
    knob(&T.hold, false);
    knob(&T.reset_go, true);
    pump_until_described(&g, "recovered");
    assert_true(td_gpu_usable(g.gpu));
    assert_int_equal(counted(&T.resets), 1);
    submit(&g, 0, 0, 5);
    pump(&g, 5);
    assert_filtered(g.done[4], 5);
    rig_close(&g);
}

/* Loses device 0's context by the watchdog: one held request on lane 0, failed. */
static void lose_context(rig_t *g, uint64_t id)
{
    knob(&T.hold, true);
    unsigned before = g->done_count;
    submit(g, 0, 0, id);
    wait_for(&T.held_count, 1);
    knob(&T.lost, true);
    pump(g, before + 1);
    assert_gpu_failed(g->done[before], id);
    knob(&T.hold, false);
}

/* An engine that cannot recreate a context (no device_reset): the lost device stays unusable. */
static void test_no_reset_stays_unusable(void **state)
{
    (void)state;
    knobs_reset();
    rig_t g;
    rig_open(&g, engine_new(1, WITHOUT_RESET), 1, 0);
    lose_context(&g, 1);
    char desc[256];
    td_gpu_describe(g.gpu, desc, sizeof desc); /* checked at the completion: nothing started */
    assert_non_null(strstr(desc, ", unusable)"));
    assert_false(td_gpu_usable(g.gpu));
    rig_close(&g);
}

/* A context that cannot be recreated: the device stays unusable with its lanes closed, and a
 * request placed on it fails at once. */
static void test_reset_fails(void **state)
{
    (void)state;
    knobs_reset();
    knob(&T.reset_fails, true);
    rig_t g;
    rig_open(&g, engine_new(1, WITH_ALL), 1, 0);
    lose_context(&g, 1);
    wait_for(&T.resets, 1);
    double deadline = now_s() + 30;
    uint64_t bytes;
    char desc[256];
    do { /* the recovery's end, on the loop */
        assert_true(now_s() < deadline);
        uv_run(&g.loop, UV_RUN_NOWAIT);
        usleep(1000);
        td_gpu_describe(g.gpu, desc, sizeof desc);
        bytes = td_gpu_device_bytes(g.gpu);
    } while (strstr(desc, "recovering"));
    assert_non_null(strstr(desc, ", unusable)"));
    assert_int_equal(bytes, 0); /* no lanes */
    submit(&g, 0, 0, 2);
    pump(&g, 2);
    assert_gpu_failed(g.done[1], 2);
    assert_false(td_gpu_usable(g.gpu));
    rig_close(&g);
}

/* A reply still lent out (its pinned buffer not given back) holds the recovery back: the device
 * stays unusable while the sender holds it, and recovers once it is given back (the recovery's
 * timer looks again). After TD_GPU_RECOVER_MAX recoveries, a lost device stays unusable. */
static void test_recovery_waits_for_lent_replies(void **state)
{
    (void)state;
    knobs_reset();
    rig_t g;
    rig_open(&g, engine_new(1, WITH_ALL), 1, 0);
    submit(&g, 0, 0, 1);
    pump(&g, 1);
    assert_filtered(g.done[0], 1);
    assert_non_null(g.done[0]->reply_free); /* a pinned reply buffer, lent */
    lose_context(&g, 2);
    char desc[256];
    td_gpu_describe(g.gpu, desc, sizeof desc);
    assert_non_null(strstr(desc, ", unusable)")); /* not recovering: a buffer is out */
    submit(&g, 0, 0, 3); /* placed before it was lost: fails, and the recovery waits on */
    pump(&g, 3);
    assert_gpu_failed(g.done[2], 3);
    td_gpu_describe(g.gpu, desc, sizeof desc);
    assert_non_null(strstr(desc, ", unusable)"));
    assert_int_equal(counted(&T.resets), 0);
    rig_free_done(&g); /* the reply is sent: its buffer is back */
    pump_until_described(&g, "recovered");
    assert_int_equal(counted(&T.resets), 1);
    for (unsigned round = 2; round <= TD_GPU_RECOVER_MAX; round++) {
        lose_context(&g, 10 + round);
        rig_free_done(&g);
        wait_for(&T.resets, round);
        pump_until_described(&g, "recovered");
    }
    lose_context(&g, 100); /* one too many */
    td_gpu_describe(g.gpu, desc, sizeof desc);
    assert_non_null(strstr(desc, ", unusable)"));
    assert_int_equal(counted(&T.resets), TD_GPU_RECOVER_MAX);
    rig_close(&g);
}

/* Spin-polling on an engine that cannot say whether a launch finished (no lane_finished), or
 * cannot wake a lane when its work is done (no lane_notify): the lane does not poll; it spins
 * only for events, sleeps, and its host functions complete the work. */
static void test_spin_without_polling(void **state)
{
    (void)state;
    unsigned engines[] = {WITHOUT_FINISHED, WITHOUT_NOTIFY};
    for (unsigned i = 0; i < 2; i++) {
        knobs_reset();
        knob(&T.hold, true);
        rig_t g;
        rig_open(&g, engine_new(1, engines[i]), 1, 200);
        submit(&g, 0, 0, 1);
        submit(&g, 0, 0, 2);
        wait_for(&T.held_count, 2);
        pump_briefly(&g); /* the lane spins, gives up and sleeps: nothing completes */
        assert_int_equal(g.done_count, 0);
        finish(&g, 2);
    }
}

/* A polling lane whose wake-up comes as soon as it is asked for (the work finished between the
 * poll and the ask) looks again rather than sleeps, until the work is seen finished. */
static void test_spin_wake_at_once(void **state)
{
    (void)state;
    knobs_reset();
    knob(&T.hold, true);
    knob(&T.notify_at_once, true);
    rig_t g;
    rig_open(&g, engine_new(1, WITH_ALL), 1, 100);
    submit(&g, 0, 0, 1);
    wait_for(&T.woken_at_once, 2); /* asked, woken at once, polled, asked again */
    pump_briefly(&g);
    assert_int_equal(g.done_count, 0);
    finish(&g, 1);
}

/* A polling lane that cannot ask for a wake-up (lane_notify fails): the watchdog's wake-ups
 * carry on, and it finds the work finished on one of them. */
static void test_spin_notify_fails(void **state)
{
    (void)state;
    knobs_reset();
    knob(&T.hold, true);
    knob(&T.notify_fails, true);
    rig_t g;
    rig_open(&g, engine_new(1, WITH_ALL), 1, 100);
    submit(&g, 0, 0, 1);
    wait_for(&T.checks, 1); /* slept until the watchdog, which found it running */
    finish(&g, 1); /* no host function: only the poll sees it finished */
}

/* A polling lane with a wake-up pending when more work comes: it launches it, spins, and does
 * not ask again; the one wake-up then finishes both. */
static void test_spin_wake_pending(void **state)
{
    (void)state;
    knobs_reset();
    knob(&T.hold, true);
    rig_t g;
    rig_open(&g, engine_new(1, WITH_ALL), 1, 100);
    submit(&g, 0, 0, 1);
    wait_for(&T.notify_count, 1); /* asked for its wake-up */
    submit(&g, 0, 0, 2);
    wait_for(&T.held_count, 2);
    pump_briefly(&g); /* spins again, and sleeps without asking twice */
    assert_int_equal(counted(&T.notify_count), 1);
    assert_int_equal(g.done_count, 0);
    finish(&g, 2);
}

static void count_active_idle(uv_handle_t *h, void *arg)
{
    if (h->type == UV_IDLE && uv_is_active(h))
        (*(int *)arg)++;
}

static int active_idles(uv_loop_t *loop)
{
    int n = 0;
    uv_walk(loop, count_active_idle, &n);
    return n;
}

/* --gpu-spin-loop: the shard's loop holds an active idle handle (it polls) while its requests
 * are on the GPU, and none once they are answered. */
static void test_spin_loop_while_on_the_gpu(void **state)
{
    (void)state;
    knobs_reset();
    rig_t g;
    td_gpu_opts_t opts = {.max_batch = MAX_BATCH, .lanes = 1, .slots = 4, .spin_loop = true,
                          .max_inflight = 8, .sinks = 1};
    char why[256] = "";
    assert_int_equal(rig_open_opts(&g, engine_new(1, WITH_ALL), &opts, why, sizeof why), TD_OK);
    assert_int_equal(active_idles(&g.loop), 0);
    knob(&T.hold, true);
    submit(&g, 0, 0, 1);
    submit(&g, 0, 0, 2);
    assert_int_equal(active_idles(&g.loop), 1);
    wait_for(&T.held_count, 2);
    release_held();
    pump(&g, 2);
    assert_int_equal(active_idles(&g.loop), 0);
    assert_filtered(g.done[0], 1);
    assert_filtered(g.done[1], 2);
    rig_close(&g);
}

/* A second shard's sink on its own loop gets its own completions there; a lost context found
 * in them is handed to the wiring's loop, which recovers the device. */
static void test_second_shard(void **state)
{
    (void)state;
    knobs_reset();
    rig_t g;
    td_gpu_opts_t opts = {.max_batch = MAX_BATCH, .lanes = 1, .slots = 4, .max_inflight = 8,
                          .sinks = 2};
    char why[256] = "";
    assert_int_equal(rig_open_opts(&g, engine_new(1, WITH_ALL), &opts, why, sizeof why), TD_OK);
    submit(&g, 0, 1, 1);
    while (g.done_count < 1) /* only shard 1's loop runs */
        uv_run(&g.loop2, UV_RUN_ONCE);
    assert_filtered(g.done[0], 1);
    knob(&T.hold, true);
    submit(&g, 0, 1, 2);
    wait_for(&T.held_count, 1);
    knob(&T.lost, true);
    while (g.done_count < 2)
        uv_run(&g.loop2, UV_RUN_ONCE);
    assert_gpu_failed(g.done[1], 2);
    assert_int_equal(counted(&T.resets), 0);
    rig_free_done(&g);
    pump_until_described(&g, "recovered"); /* the wiring's loop, woken by shard 1's */
    assert_int_equal(counted(&T.resets), 1);
    rig_close(&g);
}

/* Set-up failures: an engine without devices; a sink never closed is closed by td_gpu_destroy
 * (a start that failed after it), leaving its loop closable. */
static void test_setup_failures(void **state)
{
    (void)state;
    knobs_reset();
    knob(&T.no_devices, true);
    rig_t g;
    td_gpu_opts_t opts = {.max_batch = MAX_BATCH, .lanes = 1, .slots = 4, .max_inflight = 8};
    char why[256] = "";
    assert_int_equal(rig_open_opts(&g, engine_new(1, WITH_ALL), &opts, why, sizeof why),
                     TD_ERR_BACKEND);
    assert_string_equal(why, "no device");
    assert_null(g.gpu);
    knob(&T.no_devices, false);
    /* A pipeline whose sink is never closed (a start that failed after it opened). */
    assert_int_equal(td_gpu_new(&g.loop, engine_new(1, WITH_ALL), &opts, &g.gpu, why, sizeof why),
                     TD_OK);
    assert_int_equal(td_gpu_sink_open(g.gpu, 0, &g.loop, complete, &g), 0);
    td_gpu_destroy(&g.gpu); /* the sink still open: closed here */
    assert_int_equal(uv_loop_close(&g.loop), 0);
    assert_int_equal(uv_loop_close(&g.loop2), 0);
}

/* The small contracts of td_gpu.h: devices out of range, short buffers, a region the engine
 * cannot register, an import the engine cannot do or whose device fails it. */
static void test_contracts(void **state)
{
    (void)state;
    knobs_reset();
    rig_t g;
    rig_open(&g, engine_new(2, WITHOUT_IMPORT | WITHOUT_SPLIT), 1, 0);
    assert_false(td_gpu_device_usable(g.gpu, 2));
    assert_int_equal(td_gpu_device_ordinal(g.gpu, 2), -1);
    assert_int_equal(td_gpu_device_ordinal(g.gpu, 1), 1);
    assert_int_equal(td_gpu_ordinals(g.gpu), 2);
    char desc[24];
    td_gpu_describe(g.gpu, desc, sizeof desc); /* cut, after the first device */
    assert_string_equal(desc, "test: 0:simulated GPU 0");
    char uuids[128];
    assert_int_equal(td_gpu_uuids(g.gpu, uuids, 0), 0);
    assert_int_equal(td_gpu_uuids(NULL, uuids, sizeof uuids), 0);
    assert_string_equal(uuids, "");
    assert_int_equal(td_gpu_uuids(g.gpu, uuids, 50), 40); /* room for one */
    assert_int_equal(td_gpu_uuids(g.gpu, uuids, sizeof uuids), 81);
    knob(&T.register_fails, true);
    static uint8_t region[4096];
    assert_false(td_gpu_region_register(g.gpu, region, sizeof region, true));
    knob(&T.register_fails, false);
    assert_true(td_gpu_region_register(g.gpu, region, sizeof region, true));
    td_gpu_region_unregister(g.gpu, region);
    uint8_t uuid[TALLY_GPU_UUID_SIZE] = "tallyd-sim-gpu";
    unsigned gpu = 9;
    void *import = NULL, *ptr = NULL;
    char why[128] = "";
    assert_int_equal(td_gpu_dev_import(g.gpu, uuid, -1, 4096, false, NULL, &gpu, &import, &ptr,
                                       why, sizeof why),
                     TALLY_E_BAD_REF);
    assert_string_equal(why, "the test engine cannot import GPU memory");
    assert_string_equal(td_gpu_dev_unusable(g.gpu, 5, NULL), "is unusable");
    assert_null(td_gpu_dev_unusable(g.gpu, 1, NULL));
    /* A plain request: no device region, no peers; an engine that cannot split. */
    td_request_t *r = td_request_new();
    assert_non_null(r);
    r->req.opcode = TALLY_OP_HIST;
    r->req.dtype = TALLY_DTYPE_U8;
    assert_false(td_gpu_region_holder(r, &gpu));
    assert_int_equal(td_gpu_region_peers(g.gpu, r), 0);
    assert_false(td_gpu_splittable(g.gpu, r));
    td_request_destroy(&r);
    rig_close(&g);
    /* Devices without a UUID: none listed, none to import on. */
    knobs_reset();
    knob(&T.no_uuid, true);
    rig_open(&g, engine_new(1, WITH_ALL), 1, 0);
    assert_int_equal(td_gpu_uuids(g.gpu, uuids, sizeof uuids), 0);
    assert_string_equal(uuids, "");
    assert_int_equal(td_gpu_dev_import(g.gpu, uuid, -1, 4096, false, NULL, &gpu, &import, &ptr,
                                       why, sizeof why),
                     TALLY_E_BAD_REF);
    assert_string_equal(why, "no GPU with UUID GPU-74616c6c-7964-2d73-696d-2d6770750000");
    rig_close(&g);
    /* An engine that imports, on a device that fails the import: `internal`, logged. */
    knobs_reset();
    rig_open(&g, engine_new(1, WITH_ALL), 1, 0);
    knob(&T.import_fails, true);
    assert_int_equal(td_gpu_dev_import(g.gpu, uuid, -1, 4096, false, NULL, &gpu, &import, &ptr,
                                       why, sizeof why),
                     TALLY_E_INTERNAL);
    assert_int_equal(gpu, 0);
    assert_null(import);
    assert_string_equal(why, "test engine: the device failed the import");
    rig_close(&g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_impossible_count_is_distrusted),
        cmocka_unit_test(test_lane_bind_fails),
        cmocka_unit_test(test_failures_in_a_row),
        cmocka_unit_test(test_slow_launch_outlives_the_watchdog),
        cmocka_unit_test(test_lost_context_and_recovery),
        cmocka_unit_test(test_no_reset_stays_unusable),
        cmocka_unit_test(test_reset_fails),
        cmocka_unit_test(test_recovery_waits_for_lent_replies),
        cmocka_unit_test(test_spin_without_polling),
        cmocka_unit_test(test_spin_wake_at_once),
        cmocka_unit_test(test_spin_notify_fails),
        cmocka_unit_test(test_spin_wake_pending),
        cmocka_unit_test(test_spin_loop_while_on_the_gpu),
        cmocka_unit_test(test_second_shard),
        cmocka_unit_test(test_setup_failures),
        cmocka_unit_test(test_contracts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
