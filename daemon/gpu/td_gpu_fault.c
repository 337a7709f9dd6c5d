/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_gpu_fault.c — an engine that fails on command, for the tests (see td_gpu_engine.h).
 *
 * It wraps a real engine (sim or cuda) and passes every call through, except that it can fail
 * the way a failing device does, so the pipeline's failure handling (td_gpu.c) and the
 * executor's CPU fallback (td_exec.c) are driven through their real paths and no layer above
 * the engine table carries a test hook (SQLite's way: faults come from a wrapping layer):
 *   - every Nth launch fails (fail_every; tallyd's --test-fault-every N installs this): the job
 *     runs, then its device scan carry is clobbered, and the launch reports failure, as a
 *     device that fails mid-job leaves it. A pipeline that trusted the carries chained behind
 *     it would give wrong sums, which the tests would see. Split jobs count as one launch.
 *   - out of memory at lane_open, after lanes_before_oom lanes (oom_at_open), as cudaMalloc
 *     fails on a device that is full;
 *   - slow completions (slow_us): done() comes that much later, on the thread that completes
 *     the job (for cuda, CUDA's callback thread, holding up the lane as a slow device would);
 *     lane_finished answers as the inner engine does (the job itself has finished);
 *   - a lost context (sticky_at): one launch is accepted and never completes, and from then on
 *     the device fails lane_check and every launch, as a CUDA context after a sticky error
 *     (an illegal address) does, until device_reset recreates it (or, with reset_fails, cannot).
 *
 * A failed launch must leave nothing of the job running (the table's contract), so an injected
 * failure waits for the job, and then for the clobber, before it returns: slow, but only ever
 * in tests. The count is per engine, over all lanes, in launch order.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "td_gpu_engine.h"

#define FAULT_DEVICES_MAX 64 /* devices whose context can be lost (the sim has at most 16) */

typedef struct {
    td_gpu_engine_t *inner;
    td_gpu_fault_opts_t opts;
    atomic_ulong launches;
    atomic_ulong sticky_launches;
    atomic_uint lanes_opened;
    atomic_bool lost[FAULT_DEVICES_MAX]; /* the device's context is lost (sticky_at) */
} fault_t;

/* The pipeline's completion of one slot's job, delayed (slow_us). */
typedef struct {
    td_gpu_done_fn done;
    void *arg;
    unsigned delay_us;
} delayed_done_t;

typedef struct {
    fault_t *f;
    void *inner;
    int device;
    td_gpu_staging_t *staging;
    delayed_done_t *delayed; /* one per staging slot */
} fault_lane_t;

/* How a job is launched on the inner engine: whole (lanes NULL), or split over lanes. */
typedef struct {
    void *const *lanes; /* fault lanes */
    unsigned lane_count;
    unsigned count;
} split_t;

/* Waits for the completions of jobs launched on the inner engine. */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool done;
} waiter_t;

/* The last failure on this thread: an injected one, or the inner engine's words, copied when
 * one of its calls failed through here (error_string has no context to reach the inner). */
static _Thread_local char fault_error[256] = "no error";

/* The status of a call passed through to the inner engine, its words kept when it failed. */
static td_gpu_err_t passed(const fault_t *f, td_gpu_err_t st)
{
    if (st != TD_GPU_OK)
        snprintf(fault_error, sizeof fault_error, "%s", f->inner->error_string());
    return st;
}

static bool fault_due(fault_t *f)
{
    if (!f->opts.fail_every)
        return false;
    return (atomic_fetch_add(&f->launches, 1) + 1) % f->opts.fail_every == 0;
}

static void delayed_done(void *arg)
{
    delayed_done_t *d = arg;
    usleep(d->delay_us);
    d->done(d->arg);
}

static void waiter_done(void *arg)
{
    waiter_t *w = arg;
    pthread_mutex_lock(&w->lock);
    w->done = true;
    pthread_cond_signal(&w->cond);
    pthread_mutex_unlock(&w->lock);
}

static void waiter_wait(waiter_t *w)
{
    pthread_mutex_lock(&w->lock);
    while (!w->done)
        pthread_cond_wait(&w->cond, &w->lock);
    w->done = false;
    pthread_mutex_unlock(&w->lock);
}

static td_gpu_err_t inner_launch(fault_lane_t *l, const split_t *split, const td_gpu_job_t *job,
                                   td_gpu_done_fn done, void *arg)
{
    const td_gpu_engine_t *e = l->f->inner;
    if (!split)
        return passed(l->f, e->lane_launch(l->inner, job, done, arg));
    /* Piece i goes on lanes[i % lane_count] and i < count <= TD_GPU_SPLIT_MAX_PIECES: lanes past
     * that many are never used, so fewer inner lanes place every piece the same. */
    void *inner[TD_GPU_SPLIT_MAX_PIECES];
    unsigned used =
        split->lane_count < TD_GPU_SPLIT_MAX_PIECES ? split->lane_count : TD_GPU_SPLIT_MAX_PIECES;
    for (unsigned i = 0; i < used; i++)
        inner[i] = ((fault_lane_t *)split->lanes[i])->inner;
    return passed(l->f, e->lane_launch_split(l->inner, inner, used, split->count, job, done, arg));
}

/* The job runs, then its device carry is overwritten with TD_GPU_GARBAGE_CARRY (a scan of no
 * elements that uploads it), and the launch reports failure. Each step is waited for: the
 * garbage goes into the staging slot the job's own carry comes back to. */
static td_gpu_err_t inject(fault_lane_t *l, const split_t *split, const td_gpu_job_t *job)
{
    /* Static initialisers: nothing to fail (pthread_*_init returns would need checking). */
    waiter_t w = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};
    td_gpu_err_t st = inner_launch(l, split, job, waiter_done, &w);
    if (st == TD_GPU_OK) {
        waiter_wait(&w);
        td_gpu_job_t clobber = {
            .opcode = TALLY_OP_SCAN,
            .dtype = TALLY_DTYPE_I32,
            .n = 0,
            .carry_index = job->carry_index,
            .carry_upload = true,
            .slot = job->slot,
        };
        l->staging[job->slot].small->carry = TD_GPU_GARBAGE_CARRY;
        st = inner_launch(l, NULL, &clobber, waiter_done, &w);
        if (st == TD_GPU_OK)
            waiter_wait(&w);
    }
    pthread_cond_destroy(&w.cond);
    pthread_mutex_destroy(&w.lock);
    if (st != TD_GPU_OK)
        return st; /* the inner engine's own failure, its words kept */
    snprintf(fault_error, sizeof fault_error,
             "injected fault: 1 launch in %u fails (a test setting)", l->f->opts.fail_every);
    return TD_GPU_E_DEVICE;
}

/* The lane's device has lost its context (sticky_at), or loses it with this launch: true, and
 * *st says what the launch returns (accepted, never completing; or failed). */
static bool context_lost(fault_lane_t *l, td_gpu_err_t *st)
{
    fault_t *f = l->f;
    if (l->device < 0 || l->device >= FAULT_DEVICES_MAX)
        return false;
    if (atomic_load(&f->lost[l->device])) {
        snprintf(fault_error, sizeof fault_error,
                 "injected fault: the context of device %d is lost (a test setting)", l->device);
        *st = TD_GPU_E_DEVICE;
        return true;
    }
    if (!f->opts.sticky_at || atomic_fetch_add(&f->sticky_launches, 1) + 1 != f->opts.sticky_at)
        return false;
    atomic_store(&f->lost[l->device], true); /* this job never completes: done is not called */
    *st = TD_GPU_OK;
    return true;
}

static td_gpu_err_t launch(fault_lane_t *l, const split_t *split, const td_gpu_job_t *job,
                             td_gpu_done_fn done, void *arg)
{
    td_gpu_err_t st;
    if (context_lost(l, &st))
        return st;
    if (fault_due(l->f))
        return inject(l, split, job);
    if (!l->f->opts.slow_us || !done) /* no done to delay: the lane polls */
        return inner_launch(l, split, job, done, arg);
    delayed_done_t *d = &l->delayed[job->slot];
    *d = (delayed_done_t){.done = done, .arg = arg, .delay_us = l->f->opts.slow_us};
    return inner_launch(l, split, job, delayed_done, d);
}

static td_gpu_err_t fault_lane_launch(void *lane, const td_gpu_job_t *job, td_gpu_done_fn done,
                                        void *arg)
{
    return launch(lane, NULL, job, done, arg);
}

static td_gpu_err_t fault_lane_launch_split(void *lane, void *const *lanes, unsigned lane_count,
                                              unsigned count, const td_gpu_job_t *job,
                                              td_gpu_done_fn done, void *arg)
{
    split_t split = {.lanes = lanes, .lane_count = lane_count, .count = count};
    return launch(lane, &split, job, done, arg);
}

static void fault_lane_close(void *lane)
{
    fault_lane_t *l = lane;
    if (!l)
        return;
    if (l->inner)
        l->f->inner->lane_close(l->inner);
    free(l->delayed);
    free(l);
}

static td_gpu_err_t fault_lane_open(void *ctx, int device, size_t max_batch, unsigned slots,
                                      unsigned carries, void **lane, td_gpu_staging_t *staging,
                                      uint64_t *device_bytes, char *why, size_t why_cap)
{
    fault_t *f = ctx;
    if (f->opts.oom_at_open && atomic_fetch_add(&f->lanes_opened, 1) >= f->opts.lanes_before_oom) {
        snprintf(why, why_cap, "device %d: out of memory (injected fault)", device);
        return TD_GPU_E_DEVICE;
    }
    fault_lane_t *l = calloc(1, sizeof *l);
    if (l)
        l->delayed = calloc(slots, sizeof *l->delayed);
    if (!l || !l->delayed) {
        snprintf(why, why_cap, "out of memory");
        fault_lane_close(l);
        return TD_GPU_E_NOMEM;
    }
    l->f = f;
    l->device = device;
    l->staging = staging;
    td_gpu_err_t st = f->inner->lane_open(f->inner->ctx, device, max_batch, slots, carries,
                                            &l->inner, staging, device_bytes, why, why_cap);
    if (st != TD_GPU_OK) {
        l->inner = NULL;
        fault_lane_close(l);
        return st;
    }
    *lane = l;
    return TD_GPU_OK;
}

static td_gpu_err_t fault_lane_bind(void *lane)
{
    fault_lane_t *l = lane;
    return passed(l->f, l->f->inner->lane_bind(l->inner));
}

/* The device's context is lost (sticky_at): nothing ever finishes. */
static bool lane_lost(const fault_lane_t *l)
{
    return l->device >= 0 && l->device < FAULT_DEVICES_MAX && atomic_load(&l->f->lost[l->device]);
}

/* The inner engine's answer (slow_us delays only done: the work itself has finished), none on a
 * lost context. */
static bool fault_lane_finished(void *lane, unsigned slot)
{
    fault_lane_t *l = lane;
    return !lane_lost(l) && l->f->inner->lane_finished(l->inner, slot);
}

/* Withheld on a lost context, as CUDA never runs a host function behind a failed kernel. */
static td_gpu_err_t fault_lane_notify(void *lane, td_gpu_done_fn done, void *arg)
{
    fault_lane_t *l = lane;
    if (lane_lost(l))
        return TD_GPU_OK;
    return passed(l->f, l->f->inner->lane_notify(l->inner, done, arg));
}

static td_gpu_err_t fault_lane_check(void *lane)
{
    fault_lane_t *l = lane;
    if (lane_lost(l)) {
        snprintf(fault_error, sizeof fault_error,
                 "injected fault: the context of device %d is lost (a test setting)", l->device);
        return TD_GPU_E_DEVICE;
    }
    return passed(l->f, l->f->inner->lane_check(l->inner));
}

static int fault_device_count(void *ctx)
{
    fault_t *f = ctx;
    return f->inner->device_count(f->inner->ctx);
}

static void fault_describe(void *ctx, int device, char *buf, size_t cap)
{
    fault_t *f = ctx;
    f->inner->describe(f->inner->ctx, device, buf, cap);
}

static td_gpu_err_t fault_region_register(void *ctx, void *base, size_t size, bool read_only)
{
    fault_t *f = ctx;
    return passed(f, f->inner->region_register(f->inner->ctx, base, size, read_only));
}

static void fault_region_unregister(void *ctx, void *base)
{
    fault_t *f = ctx;
    f->inner->region_unregister(f->inner->ctx, base);
}

static td_gpu_err_t fault_device_uuid(void *ctx, int device, uint8_t uuid[TALLY_GPU_UUID_SIZE])
{
    fault_t *f = ctx;
    return f->inner->device_uuid(f->inner->ctx, device, uuid);
}

static td_gpu_err_t fault_dev_import(void *ctx, const td_gpu_import_args_t *a,
                                       uint32_t *peers_mapped, void **import, void **ptr,
                                       char *why, size_t why_cap)
{
    fault_t *f = ctx;
    return f->inner->dev_import(f->inner->ctx, a, peers_mapped, import, ptr, why, why_cap);
}

static void fault_dev_release(void *ctx, void *import, bool stale, uint32_t stale_peers)
{
    fault_t *f = ctx;
    f->inner->dev_release(f->inner->ctx, import, stale, stale_peers);
}

/* Recreates a lost context (sticky_at), unless reset_fails; then the inner engine's reset. */
static td_gpu_err_t fault_device_reset(void *ctx, int device, char *why, size_t why_cap)
{
    fault_t *f = ctx;
    if (f->opts.reset_fails) {
        snprintf(why, why_cap, "injected fault: the context of device %d cannot be recreated",
                 device);
        return TD_GPU_E_DEVICE;
    }
    if (device >= 0 && device < FAULT_DEVICES_MAX)
        atomic_store(&f->lost[device], false);
    return f->inner->device_reset(f->inner->ctx, device, why, why_cap);
}

static void *fault_host_alloc(void *ctx, int device, size_t size)
{
    fault_t *f = ctx;
    return f->inner->host_alloc(f->inner->ctx, device, size);
}

static void fault_host_free(void *ctx, void *p)
{
    fault_t *f = ctx;
    f->inner->host_free(f->inner->ctx, p);
}

static const char *fault_error_string(void)
{
    return fault_error;
}

static void fault_destroy(td_gpu_engine_t **self_p)
{
    td_gpu_engine_t *e = *self_p;
    if (!e)
        return;
    fault_t *f = e->ctx;
    f->inner->destroy(&f->inner);
    free(f);
    free(e);
    *self_p = NULL;
}

/* (Its name is the inner engine\'s.) */
static const td_gpu_engine_t fault_engine = TD_GPU_ENGINE_TABLE(fault);

td_gpu_err_t td_gpu_engine_fault_new(td_gpu_engine_t *inner, const td_gpu_fault_opts_t *opts,
                                       td_gpu_engine_t **out)
{
    td_gpu_engine_t *e = calloc(1, sizeof *e);
    fault_t *f = calloc(1, sizeof *f);
    if (!e || !f) {
        free(f);
        free(e);
        inner->destroy(&inner);
        return TD_GPU_E_NOMEM;
    }
    f->inner = inner;
    f->opts = *opts;
    atomic_init(&f->launches, 0);
    atomic_init(&f->sticky_launches, 0);
    atomic_init(&f->lanes_opened, 0);
    for (unsigned i = 0; i < FAULT_DEVICES_MAX; i++)
        atomic_init(&f->lost[i], false);
    *e = fault_engine;
    e->name = inner->name; /* what runs the batches: the metrics and info say "sim" or "cuda" */
    e->ctx = f;
    if (!inner->lane_launch_split)
        e->lane_launch_split = NULL;
    if (!inner->device_reset)
        e->device_reset = NULL;
    *out = e;
    return TD_GPU_OK;
}
