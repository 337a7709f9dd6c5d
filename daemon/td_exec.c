/*
 * td_exec.c — the executor (see td_exec.h): routing, the CPU path, and the GPU fallback.
 *
 * Routing: a request goes to the GPU when a device is usable and, in auto mode, its payload is
 * at least its operation's threshold (td_config.h, measured) or --gpu-min-batch bytes. A named
 * stream's requests pipeline on the GPU (td_exec_may_ start); on the CPU they run one at a time,
 * because there the carry-in comes from the host copy, which is only current once the previous
 * request has been applied.
 *
 * The fallback, and why it is correct. The GPU pipeline completes a lane's requests in launch
 * order, and a stream's requests all sit on one lane, so when a failed request F of stream S
 * comes back, every earlier request of S has been applied: the host copy of S is exactly the
 * state F must start from. F is rerun right here, on the loop thread, with the CPU backend and
 * a fresh td_request_prepare (carry-in from the host copy). The requests of S enqueued on the
 * GPU behind F chained their scan carry from F's device carry, which cannot be trusted, so S's
 * generation is bumped and each of them, as it comes back (in order), is rerun the same way.
 * Nothing new of S starts until S has drained (exec_resync); the next GPU request then uploads
 * the host carry again, which is how the device carry is resynchronised. A stateless request
 * that failed is simply queued on the CPU path.
 *
 * Rerunning a stream's request on the loop thread blocks the loop for one CPU batch (at most
 * max_batch bytes, milliseconds); it only happens after a GPU failure, and it keeps the
 * ordering argument above trivial. After TD_GPU_DEAD_AFTER failures in a row a device is
 * marked unusable (td_gpu.c) and new work takes the CPU path on the worker pool.
 *
 * Test switch: --test-fault-every N wraps the engine in the fault engine (td_gpu_fault.c): every
 * Nth GPU launch fails after its kernels ran (and leaves its device carry clobbered), so the
 * tests drive all of this on the CPU build through simulated devices (--test-sim-gpus) and on a
 * real GPU alike.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_exec.h"
#include "td_gpu.h"
#include "td_log.h"

struct td_exec {
    td_exec_env_t env;
    td_backend_choice_t choice;
    size_t gpu_min_batch;
    size_t gpu_max_batch; /* the staging size, fixed at start */
    td_gpu_t *gpu;        /* NULL: CPU only */
    char devices[512];    /* td_exec_devices */
};

static void retire(td_exec_t *x, td_request_t *r)
{
    td_stream_t *stream = r->stream;
    if (stream && --stream->exec_submitted == 0) {
        if (x->gpu)
            td_gpu_stream_idle(x->gpu, stream);
        stream->exec_on_gpu = false;
        stream->exec_resync = false;
    }
    x->env.done(x->env.owner, r);
}

/* ---- CPU path ----------------------------------------------------------------------------- */

static void work_cb(uv_work_t *work)
{
    td_request_execute(work->data);
}

static void after_work_cb(uv_work_t *work, int status)
{
    td_request_t *r = work->data;
    td_exec_t *x = r->owner;
    if (status == UV_ECANCELED)
        td_request_fail(r, TALLY_E_SHUTDOWN, "tallyd is shutting down");
    retire(x, r);
}

static void cpu_submit(td_exec_t *x, td_request_t *r)
{
    r->backend = x->env.cpu;
    r->owner = x;
    r->work.data = r;
    r->exec_on_gpu = false;
    int rc = uv_queue_work(x->env.loop, &r->work, work_cb, after_work_cb);
    if (rc != 0) {
        td_request_fail(r, TALLY_E_INTERNAL, "cannot queue work: %s", uv_strerror(rc));
        retire(x, r);
    }
}

/* ---- GPU path ----------------------------------------------------------------------------- */

/* The auto-mode threshold for a request (td_config.h has the measurements). */
static size_t gpu_min_batch(const td_exec_t *x, const td_request_t *r)
{
    if (x->gpu_min_batch)
        return x->gpu_min_batch;
    bool direct_in = r->shm_in && r->shm_in->device_registered;
    bool direct_out =
        r->req.opcode == TALLY_OP_HIST || (r->shm_out && r->shm_out->device_registered);
    if (direct_in && direct_out)
        return TD_GPU_MIN_BATCH_SHM;
    switch (r->req.opcode) {
    case TALLY_OP_HIST:
        return TD_GPU_MIN_BATCH_HIST;
    case TALLY_OP_FILTER:
        return TD_GPU_MIN_BATCH_FILTER;
    default:
        return TD_GPU_MIN_BATCH_SCAN;
    }
}

static bool wants_gpu(const td_exec_t *x, const td_request_t *r)
{
    if (!x->gpu || !td_gpu_usable(x->gpu))
        return false;
    /* Above the device buffers (TD_GPU_BUFFER_MAX_BYTES, or a reload raised max_batch above
     * what they were sized for) only a batch split into pieces that fit can run there. */
    if (r->payload_len > x->gpu_max_batch && !td_gpu_split_min_pieces(x->gpu, r))
        return false;
    return x->choice == TD_BACKEND_CUDA || r->payload_len >= gpu_min_batch(x, r);
}

/* Loop thread: a request is back from the pipeline. */
static void gpu_complete(void *owner, td_request_t *r)
{
    td_exec_t *x = owner;
    td_stream_t *stream = r->stream;
    bool behind_failure = stream && r->exec_gen != stream->exec_gen;
    if (!r->exec_failed && !behind_failure) {
        int dev = td_gpu_request_device(r);
        if (dev >= 0 && dev < TD_METRICS_GPUS_MAX)
            x->env.metrics->gpu_requests[dev]++;
        retire(x, r);
        return;
    }
    x->env.metrics->backend_fallbacks++;
    if (r->exec_failed)
        td_warn("request %" PRIu64 " failed on the GPU: rerun on the CPU backend",
                r->rep.request_id);
    else
        td_info("request %" PRIu64 " on stream '%s' was queued behind a GPU failure: rerun on "
                "the CPU backend",
                r->rep.request_id, stream->name);
    r->exec_failed = false;
    r->exec_on_gpu = false;
    if (!stream) {
        cpu_submit(x, r);
        return;
    }
    if (!behind_failure) { /* r is the failed one: distrust what follows it on the device */
        stream->exec_gen++;
        stream->exec_resync = true;
    }
    r->backend = x->env.cpu;
    if (td_request_prepare(r)) /* carry-in from the host copy, current up to r */
        td_request_execute(r);
    retire(x, r);
}

/* ---- interface ---------------------------------------------------------------------------- */

bool td_exec_may_start(const td_exec_t *x, const td_stream_t *stream, const td_request_t *r)
{
    if (stream->exec_submitted == 0)
        return true;
    if (!td_op_is_compute(r->req.opcode) || !stream->exec_on_gpu || stream->exec_resync)
        return false;
    if (!wants_gpu(x, r) || !td_gpu_lane_usable(x->gpu, stream->exec_lane))
        return false;
    /* The type check of a stream's first histogram needs the earlier requests applied. */
    return r->req.opcode != TALLY_OP_HIST || stream->info.hist_dtype != TALLY_DTYPE_NONE;
}

void td_exec_stream_failed(td_exec_t *x, td_stream_t *stream)
{
    (void)x;
    /* Its successors still on the GPU chained their scan carry from the device carry it left,
     * which the host copy never took: rerun them from the host copy, as after a GPU failure. */
    if (stream->exec_submitted > 0 && stream->exec_on_gpu) {
        stream->exec_gen++;
        stream->exec_resync = true;
    }
}

void td_exec_submit(td_exec_t *x, td_request_t *r)
{
    td_stream_t *stream = r->stream;
    bool gpu = wants_gpu(x, r);
    r->exec_failed = false;
    r->exec_gen = stream ? stream->exec_gen : 0;
    if (stream) {
        stream->exec_submitted++;
        stream->exec_on_gpu = gpu;
    }
    if (!gpu && r->payload_len <= TD_EXEC_INLINE_MAX) { /* cheaper than two thread hops */
        r->backend = x->env.cpu;
        td_request_execute(r);
        retire(x, r);
        return;
    }
    if (!gpu) {
        cpu_submit(x, r);
        return;
    }
    r->exec_on_gpu = true;
    r->owner = x;
    td_gpu_submit(x->gpu, r);
}

/* The batch bytes the GPU's staging slots and device buffers hold: max_batch, at most
 * TD_GPU_BUFFER_MAX_BYTES (td_config.h says why). TALLYD_TEST_GPU_BUFFER_BYTES lowers the cap,
 * so the tests reach batches above it without gigabytes of buffers. */
static size_t gpu_buffer_bytes(const td_config_t *cfg)
{
    size_t cap = TD_GPU_BUFFER_MAX_BYTES;
    const char *test = getenv("TALLYD_TEST_GPU_BUFFER_BYTES");
    if (test && strtoull(test, NULL, 10) >= 16)
        cap = (size_t)strtoull(test, NULL, 10);
    size_t bytes = cfg->max_batch < cap ? cfg->max_batch : cap;
    return bytes < 16 ? 16 : bytes;
}

static tally_status_t open_gpu(td_exec_t *x)
{
    const td_config_t *cfg = x->env.cfg;
    char why[256] = "";
    td_gpu_engine_t *engine = NULL;
    tally_status_t st = cfg->test_sim_gpus ? td_gpu_engine_sim_new(cfg->test_sim_gpus, &engine)
                                           : td_gpu_engine_cuda_new(&engine, why, sizeof why);
    if (st == TALLY_OK && cfg->test_fault_every) {
        td_gpu_fault_opts_t faults = {.fail_every = cfg->test_fault_every};
        st = td_gpu_engine_fault_new(engine, &faults, &engine);
    }
    if (st == TALLY_OK) {
        x->gpu_max_batch = gpu_buffer_bytes(cfg);
        td_gpu_opts_t opts = {
            .max_batch = x->gpu_max_batch,
            .lanes = cfg->gpu_streams ? cfg->gpu_streams : TD_DEFAULT_GPU_STREAMS,
            .slots = TD_GPU_SLOTS_PER_LANE,
            .spin_us = cfg->gpu_spin_us,
            .max_inflight = TD_MAX_INFLIGHT_LIMIT, /* a reload may raise max_inflight */
        };
        st = td_gpu_new(x->env.loop, engine, &opts, gpu_complete, x, &x->gpu, why, sizeof why);
    }
    if (st == TALLY_OK) {
        unsigned devices = td_gpu_device_count(x->gpu);
        x->env.metrics->gpu_devices = devices < TD_METRICS_GPUS_MAX ? devices : TD_METRICS_GPUS_MAX;
        char desc[512];
        td_gpu_describe(x->gpu, desc, sizeof desc);
        td_info("GPU pipeline: %s; %" PRIu64 " bytes of device memory; %s%s", desc,
                td_gpu_device_bytes(x->gpu),
                cfg->backend == TD_BACKEND_CUDA ? "every batch on the GPU"
                                                : "smaller batches on the CPU (--gpu-min-batch)",
                cfg->test_fault_every ? " (test faults on)" : "");
        return TALLY_OK;
    }
    if (cfg->backend == TD_BACKEND_CUDA) {
        td_err("--backend cuda: no usable GPU: %s", why);
        return TALLY_E_BACKEND;
    }
    td_info("no usable GPU (%s): serving on the CPU backend", why);
    return TALLY_OK;
}

tally_status_t td_exec_new(const td_exec_env_t *env, td_exec_t **out)
{
    td_exec_t *x = calloc(1, sizeof *x);
    if (!x)
        return TALLY_E_INTERNAL;
    x->env = *env;
    x->choice = env->cfg->backend;
    x->gpu_min_batch = env->cfg->gpu_min_batch;
    if (x->choice != TD_BACKEND_CPU) {
        tally_status_t st = open_gpu(x);
        if (st != TALLY_OK) {
            free(x);
            return st;
        }
    }
    *out = x;
    return TALLY_OK;
}

void td_exec_close(td_exec_t *x)
{
    if (x && x->gpu)
        td_gpu_close(x->gpu);
}

void td_exec_destroy(td_exec_t **self_p)
{
    td_exec_t *x = *self_p;
    if (!x)
        return;
    td_gpu_destroy(&x->gpu);
    free(x);
    *self_p = NULL;
}

static bool exec_region_register(void *ctx, void *base, size_t size, bool read_only)
{
    return td_gpu_region_register(ctx, base, size, read_only);
}

static void exec_region_unregister(void *ctx, void *base)
{
    td_gpu_region_unregister(ctx, base);
}

void td_exec_shm_env(td_exec_t *x, td_shm_env_t *env)
{
    if (!x->gpu)
        return;
    env->region_register = exec_region_register;
    env->region_unregister = exec_region_unregister;
    env->ctx = x->gpu;
}

const char *td_exec_backend_name(const td_exec_t *x)
{
    return x->gpu && td_gpu_usable(x->gpu) ? td_gpu_engine_name(x->gpu) : "cpu";
}

const char *td_exec_backends(const td_exec_t *x)
{
    if (!x->gpu)
        return "cpu";
    return strcmp(td_gpu_engine_name(x->gpu), "cuda") == 0 ? "cpu,cuda" : "cpu,sim";
}

void td_exec_describe(const td_exec_t *x, char *buf, size_t cap)
{
    if (x->gpu) {
        td_gpu_describe(x->gpu, buf, cap);
        return;
    }
    x->env.cpu->describe(x->env.cpu->ctx, buf, cap);
}

const char *td_exec_devices(td_exec_t *x)
{
    td_exec_describe(x, x->devices, sizeof x->devices);
    return x->devices;
}

unsigned td_exec_devices_lost(const td_exec_t *x)
{
    return x->gpu ? td_gpu_devices_lost(x->gpu) : 0;
}

uint64_t td_exec_device_bytes(const td_exec_t *x)
{
    return x->gpu ? td_gpu_device_bytes(x->gpu) : 0;
}

#ifndef TALLY_HAVE_CUDA
tally_status_t td_gpu_engine_cuda_new(td_gpu_engine_t **out, char *why, size_t why_cap)
{
    *out = NULL;
    snprintf(why, why_cap, "tallyd was built without CUDA");
    return TALLY_E_BACKEND;
}
#endif
