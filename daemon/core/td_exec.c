/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_exec.c — the executor (see td_exec.h): the CPU path, the GPU pipeline, and what the
 * scheduler needs to know of them.
 *
 * The fallback after a GPU failure, and why it is correct (the policy is td_sched.c's, the
 * argument rests on the pipeline). The GPU pipeline completes a lane's requests in launch
 * order, and a stream's requests all sit on one lane, so when a failed request F of stream S
 * comes back, every earlier request of S has been applied: the host copy of S is exactly the
 * state F must start from. F is rerun on the loop thread, with the CPU backend and a fresh
 * td_request_prepare (carry-in from the host copy). The requests of S enqueued on the GPU behind
 * F chained their scan carry from F's device carry, which cannot be trusted, so S's generation
 * is bumped and each of them, as it comes back (in order), is rerun the same way. Nothing new of
 * S starts until S has drained; the next GPU request then uploads the host carry again, which is
 * how the device carry is resynchronised. A stateless request that failed is simply queued on the
 * CPU path.
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
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_exec.h"
#include "td_gpu.h"
#include "td_log.h"

/* A shard's way into the executor. */
typedef struct {
    td_exec_t *x;
    unsigned index;
    uv_loop_t *loop; /* NULL: not open */
} port_t;

struct td_exec {
    td_exec_env_t env;
    size_t gpu_max_batch; /* the staging size, fixed at start */
    td_gpu_t *gpu;        /* NULL: CPU only */
    port_t *ports;
    _Atomic unsigned *gpu_loads; /* the ports' schedulers' shared placement (td_sched.h) */
    char devices[512];           /* td_exec_devices */
};

/* ---- CPU path ----------------------------------------------------------------------------- */

/* The job is the request's cpu_job; its data is the port. */
static td_request_t *job_request(uv_work_t *job)
{
    return (td_request_t *)((char *)job - offsetof(td_request_t, cpu_job));
}

static void work_cb(uv_work_t *job)
{
    port_t *port = job->data;
    td_request_execute(job_request(job), port->x->env.cpu);
}

/* status is 0: libuv passes UV_ECANCELED only for a job that uv_cancel took back, and tallyd
 * calls uv_cancel nowhere. */
static void after_work_cb(uv_work_t *job, int status)
{
    (void)status;
    port_t *port = job->data;
    port->x->env.done(port->x->env.owner, job_request(job));
}

/* On the port's loop: libuv's pool is the process's, each loop gets its own jobs back. */
static void cpu_submit(port_t *port, td_request_t *r)
{
    r->cpu_job.data = port;
    /* Fails only without a work callback (libuv's uv_queue_work: UV_EINVAL). */
    (void)uv_queue_work(port->loop, &r->cpu_job, work_cb, after_work_cb);
}

/* ---- GPU path ----------------------------------------------------------------------------- */

/* The port's loop thread: a request is back from the pipeline (its reply built, or
 * r->gpu_failed). */
static void gpu_complete(void *owner, td_request_t *r)
{
    td_exec_t *x = owner;
    x->env.done(x->env.owner, r);
}

/* ---- the machine (td_sched.h) --------------------------------------------------------------- */

static void exec_run(void *ctx, td_request_t *r)
{
    port_t *port = ctx;
    td_exec_t *x = port->x;
    if (r->where.gpu) {
        td_gpu_submit(x->gpu, r);
        return;
    }
    if (!r->where.cpu_inline) {
        cpu_submit(port, r);
        return;
    }
    td_request_execute(r, x->env.cpu);
    x->env.done(x->env.owner, r);
}

static bool exec_device_usable(void *ctx, unsigned device)
{
    return td_gpu_device_usable(((port_t *)ctx)->x->gpu, device);
}

static int exec_device_ordinal(void *ctx, unsigned device)
{
    return td_gpu_device_ordinal(((port_t *)ctx)->x->gpu, device);
}

static bool exec_splittable(void *ctx, const td_request_t *r)
{
    return td_gpu_splittable(((port_t *)ctx)->x->gpu, r);
}

static uint32_t exec_region_peers(void *ctx, const td_request_t *r)
{
    return td_gpu_region_peers(((port_t *)ctx)->x->gpu, r);
}

/* The threads of libuv's pool that runs the CPU path: UV_THREADPOOL_SIZE, which main.c sets
 * from --workers unless the environment has it, read as libuv reads it (4 when unset, 1 for 0
 * or what is not a number, at most 1024). */
static unsigned cpu_workers(void)
{
    const char *size = getenv("UV_THREADPOOL_SIZE");
    unsigned long n = size ? strtoul(size, NULL, 10) : 4;
    if (n == 0)
        n = 1;
    return n > 1024 ? 1024 : (unsigned)n;
}

int td_exec_port_open(td_exec_t *x, unsigned index, uv_loop_t *loop)
{
    port_t *port = &x->ports[index];
    if (x->gpu) {
        int rc = td_gpu_sink_open(x->gpu, index, loop, gpu_complete, x);
        if (rc != 0)
            return rc;
    }
    port->loop = loop;
    return 0;
}

void td_exec_port_close(td_exec_t *x, unsigned index)
{
    if (!x || !x->ports[index].loop)
        return;
    td_gpu_sink_close(x->gpu, index);
    x->ports[index].loop = NULL;
}

void td_exec_port_machine(td_exec_t *x, unsigned index, td_sched_machine_t *m)
{
    *m = (td_sched_machine_t){
        .ctx = &x->ports[index],
        .cpu_workers = cpu_workers(),
        .gpu_lane_depth = TD_SCHED_LANE_DEPTH,
        .device_usable = exec_device_usable,
        .device_ordinal = exec_device_ordinal,
        .splittable = exec_splittable,
        .run = exec_run,
    };
    if (!x->gpu)
        return;
    m->gpu_devices = td_gpu_device_count(x->gpu);
    m->gpu_lanes = td_gpu_lanes(x->gpu);
    m->gpu_carries = TD_MAX_INFLIGHT_LIMIT + 1; /* each port its own (td_gpu_opts_t.sinks) */
    m->gpu_carry_base = index * TD_MAX_INFLIGHT_LIMIT;
    m->gpu_loads = x->gpu_loads;
    m->gpu_buffer_bytes = x->gpu_max_batch;
    m->region_peers = exec_region_peers;
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

static td_err_t open_gpu(td_exec_t *x)
{
    const td_config_t *cfg = x->env.cfg;
    char why[256] = "";
    td_gpu_engine_t *engine = NULL;
    td_gpu_err_t st = cfg->test_sim_gpus ? td_gpu_engine_sim_new(cfg->test_sim_gpus, &engine)
                                         : td_gpu_engine_cuda_new(&engine, why, sizeof why);
    /* Test only: TALLYD_TEST_FAULT_STICKY=N loses a device's context at the Nth launch, and
     * TALLYD_TEST_FAULT_RESET_FAILS=1 makes recreating it fail (td_gpu_fault.c). */
    const char *sticky = getenv("TALLYD_TEST_FAULT_STICKY");
    const char *reset_fails = getenv("TALLYD_TEST_FAULT_RESET_FAILS");
    td_gpu_fault_opts_t faults = {
        .fail_every = cfg->test_fault_every,
        .sticky_at = sticky ? (unsigned)strtoul(sticky, NULL, 10) : 0,
        .reset_fails = reset_fails && strcmp(reset_fails, "1") == 0,
    };
    if (st == TD_GPU_OK && (faults.fail_every || faults.sticky_at))
        st = td_gpu_engine_fault_new(engine, &faults, &engine);
    td_err_t err = st == TD_GPU_OK ? TD_OK : TD_ERR_BACKEND;
    if (err == TD_OK) {
        x->gpu_max_batch = gpu_buffer_bytes(cfg);
        td_gpu_opts_t opts = {
            .max_batch = x->gpu_max_batch,
            .lanes = cfg->gpu_streams ? cfg->gpu_streams : TD_DEFAULT_GPU_STREAMS,
            .slots = TD_GPU_SLOTS_PER_LANE,
            .spin_us = cfg->gpu_spin_us != TD_GPU_SPIN_US_UNSET ? cfg->gpu_spin_us
                       : cfg->test_sim_gpus                     ? 0
                                                                : TD_GPU_SPIN_US_DEFAULT,
            .spin_loop = cfg->gpu_spin_loop,
            .max_inflight = TD_MAX_INFLIGHT_LIMIT, /* a reload may raise max_inflight */
            .sinks = x->env.ports,
        };
        err = td_gpu_new(x->env.loop, engine, &opts, &x->gpu, why, sizeof why);
    }
    if (err == TD_OK) {
        size_t loads = (size_t)td_gpu_device_count(x->gpu) * (1 + td_gpu_lanes(x->gpu));
        x->gpu_loads = calloc(loads, sizeof *x->gpu_loads);
        if (!x->gpu_loads) {
            td_gpu_destroy(&x->gpu);
            return TD_ERR_NOMEM;
        }
        td_metrics_set_gpus(x->env.metrics, td_gpu_ordinals(x->gpu));
        char desc[512];
        td_gpu_describe(x->gpu, desc, sizeof desc);
        td_info("GPU pipeline: %s; %" PRIu64 " bytes of device memory; %s%s", desc,
                td_gpu_device_bytes(x->gpu),
                cfg->backend == TD_BACKEND_CUDA ? "every batch on the GPU"
                                                : "smaller batches on the CPU (--gpu-min-batch)",
                faults.fail_every || faults.sticky_at ? " (test faults on)" : "");
        return TD_OK;
    }
    if (cfg->backend == TD_BACKEND_CUDA) {
        td_err("--backend cuda: no usable GPU: %s", why);
        return TD_ERR_BACKEND;
    }
    td_info("no usable GPU (%s): serving on the CPU backend", why);
    return TD_OK;
}

td_err_t td_exec_new(const td_exec_env_t *env, td_exec_t **out)
{
    td_exec_t *x = malloc(sizeof *x);
    if (!x)
        return TD_ERR_NOMEM;
    *x = (td_exec_t){.env = *env};
    x->env.ports = env->ports ? env->ports : 1;
    x->ports = calloc(x->env.ports, sizeof *x->ports);
    if (!x->ports) {
        free(x);
        return TD_ERR_NOMEM;
    }
    for (unsigned i = 0; i < x->env.ports; i++)
        x->ports[i] = (port_t){.x = x, .index = i};
    if (env->cfg->backend != TD_BACKEND_CPU) {
        td_err_t err = open_gpu(x);
        if (err != TD_OK) {
            free(x->ports);
            free(x);
            return err;
        }
    }
    *out = x;
    return TD_OK;
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
    free(x->gpu_loads);
    free(x->ports);
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

static tally_status_t exec_dev_import(void *ctx, const uint8_t *uuid, int fd, uint64_t size,
                                      bool writable, const uint8_t *event, unsigned *gpu,
                                      void **import, void **ptr, char *why, size_t why_cap)
{
    if (!td_gpu_usable(ctx)) {
        snprintf(why, why_cap, "a GPU is needed for device regions (every GPU is unusable)");
        return TALLY_E_BAD_REF;
    }
    return td_gpu_dev_import(ctx, uuid, fd, size, writable, event, gpu, import, ptr, why, why_cap);
}

static void exec_dev_release(void *ctx, unsigned gpu, void *import)
{
    td_gpu_dev_release(ctx, gpu, import);
}

static const char *exec_dev_unusable(void *ctx, unsigned gpu, const void *import)
{
    return td_gpu_dev_unusable(ctx, gpu, import);
}

size_t td_exec_gpu_uuids(const td_exec_t *x, char *buf, size_t cap)
{
    if (cap)
        buf[0] = '\0';
    return x->gpu ? td_gpu_uuids(x->gpu, buf, cap) : 0;
}

void td_exec_shm_env(td_exec_t *x, td_shm_env_t *env)
{
    if (!x->gpu)
        return;
    env->region_register = exec_region_register;
    env->region_unregister = exec_region_unregister;
    env->dev_import = exec_dev_import;
    env->dev_release = exec_dev_release;
    env->dev_unusable = exec_dev_unusable;
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
td_gpu_err_t td_gpu_engine_cuda_new(td_gpu_engine_t **out, char *why, size_t why_cap)
{
    *out = NULL;
    snprintf(why, why_cap, "tallyd was built without CUDA");
    return TD_GPU_E_DEVICE;
}
#endif
