/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_gpu_sim.c — simulated GPUs for testing the pipeline (see td_gpu_engine.h).
 *
 * Each lane mirrors a CUDA lane's memory: staging slots, one set of "device" buffers and an
 * array of "device" scan carries, all in host memory. A launch copies staging -> device
 * buffers, runs the CPU backend there (the scan continuing from and updating the carry in the
 * carries array, exactly as tk_cuda_scan does in place), copies the results back to staging
 * and calls done() before returning. Carries start as garbage (TD_GPU_GARBAGE_CARRY), so a
 * chain that begins without uploading the host carry gives wrong sums the tests see. Failures
 * on command come from the fault engine (td_gpu_fault.c) wrapped around this one.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "td_gpu_engine.h"
#include "td_monotonic.h"

typedef struct {
    unsigned devices;
    tk_backend_t *cpu;
    /* Test-only: each simulated launch takes this long (TALLYD_TEST_SIM_LATENCY_US), so a test
     * can be sure a burst of requests is read before the first of them completes. */
    unsigned latency_us;
    /* Test-only: each region registration (host or device) takes this long
     * (TALLYD_TEST_SIM_REGISTER_US), as pinning a large region does, so a test can see that it
     * does not hold up the loop. */
    unsigned register_us;
    /* Test-only: simulated GPUs 0..peers-1 can reach each other's memory (peer access), as two
     * GPUs on NVLink can (TALLYD_TEST_SIM_PEERS=N; unset: none can). */
    unsigned peers;
    /* Test-only: a launch without done (a polling lane's) is seen finished by lane_finished only
     * this long after it returned (TALLYD_TEST_SIM_FINISH_US), as a GPU's work is, so a polling
     * lane spins out and naps (td_gpu.c nap_for_head). */
    unsigned finish_us;
} sim_t;

/* Slots whose finish time a lane keeps (TD_GPU_SLOTS_PER_LANE is 2); any later one is finished. */
#define SIM_FINISH_SLOTS 64

typedef struct {
    sim_t *sim;
    int device;
    size_t max_batch;
    unsigned slots;
    td_gpu_staging_t *staging;
    void *d_in;
    void *d_out;
    td_gpu_small_t d_small;
    int64_t *d_carries;
    unsigned carries;
    uint64_t finish_ns[SIM_FINISH_SLOTS]; /* CLOCK_MONOTONIC: when slot i's launch is finished */
} sim_lane_t;

/* A launch into `slot` has returned: done now, or, polled, finished after finish_us. */
static void sim_launched(sim_lane_t *l, unsigned slot, td_gpu_done_fn done, void *arg)
{
    if (done)
        done(arg);
    else if (slot < SIM_FINISH_SLOTS)
        l->finish_ns[slot] = td_mono_ns() + (uint64_t)l->sim->finish_us * 1000u;
}

static _Thread_local char sim_error[128] = "no error";

static int sim_device_count(void *ctx)
{
    return (int)((sim_t *)ctx)->devices;
}

static void sim_describe(void *ctx, int device, char *buf, size_t cap)
{
    (void)ctx;
    snprintf(buf, cap, "simulated GPU %d", device);
}

static void sim_lane_close(void *lane)
{
    sim_lane_t *l = lane;
    if (!l)
        return;
    for (unsigned i = 0; l->staging && i < l->slots; i++) {
        free(l->staging[i].in);
        free(l->staging[i].out);
        free(l->staging[i].small);
    }
    free(l->d_in);
    free(l->d_out);
    free(l->d_carries);
    free(l);
}

static td_gpu_err_t sim_lane_open(void *ctx, int device, size_t max_batch, unsigned slots,
                                    unsigned carries, void **lane, td_gpu_staging_t *staging,
                                    uint64_t *device_bytes, char *why, size_t why_cap)
{
    sim_lane_t *l = malloc(sizeof *l);
    if (!l)
        goto fail;
    *l = (sim_lane_t){.sim = ctx,
                      .device = device,
                      .max_batch = max_batch,
                      .slots = slots,
                      .staging = staging,
                      .carries = carries};
    memset(staging, 0, slots * sizeof *staging);
    for (unsigned i = 0; i < slots; i++) {
        staging[i].in = malloc(max_batch);
        staging[i].out = malloc(2 * max_batch);
        staging[i].small = calloc(1, sizeof *staging[i].small);
        if (!staging[i].in || !staging[i].out || !staging[i].small)
            goto fail;
    }
    l->d_in = malloc(max_batch);
    l->d_out = malloc(2 * max_batch);
    l->d_carries = calloc(carries, sizeof *l->d_carries);
    if (!l->d_in || !l->d_out || !l->d_carries)
        goto fail;
    /* A carry no request has uploaded into holds garbage, as stale device memory would: a
     * pipeline that reads one without uploading it first gives wrong sums the tests see. */
    for (unsigned c = 0; c < carries; c++)
        l->d_carries[c] = TD_GPU_GARBAGE_CARRY;
    *device_bytes = 3 * (uint64_t)max_batch + carries * sizeof(int64_t);
    *lane = l;
    return TD_GPU_OK;
fail:
    snprintf(why, why_cap, "out of memory for a simulated lane");
    sim_lane_close(l);
    return TD_GPU_E_NOMEM;
}

static td_gpu_err_t sim_lane_bind(void *lane)
{
    (void)lane;
    return TD_GPU_OK;
}

/* A simulated device region: the "exported allocation" is a memfd sealed against shrinking and
 * growing (so the mapping cannot fault), mapped as the GPU would map the allocation; the
 * descriptor is kept until release, as the CUDA engine keeps the received one. `reach`: the
 * devices it is mapped on (bit d: device d), its own and the peers that can reach it. */
typedef struct {
    int fd;
    void *base;
    size_t size;
    uint32_t reach;
} sim_import_t;

/* Whether a lane of `device` may touch the region of `import` (NULL: not a device region). On a
 * GPU a kernel reading memory its device has no access to faults (an illegal address, sticky):
 * the simulated launch fails instead, so that the tests see work placed where it cannot run. */
static bool sim_reaches(const void *import, int device)
{
    const sim_import_t *im = import;
    return !im || (device < 32 && (im->reach >> device) & 1u);
}

static tally_status_t sim_run(sim_lane_t *l, const td_gpu_job_t *job)
{
    tk_backend_t *cpu = l->sim->cpu;
    td_gpu_small_t *small = l->staging[job->slot].small;
    size_t esize = tally_dtype_size((tally_dtype_t)job->dtype);
    tally_status_t st = TALLY_E_PARAM;
    size_t kept = 0;
    int64_t *carry = &l->d_carries[job->carry_index];
    /* A registered region is read and written in place, as the CUDA engine's copies do (a device
     * output region mapped read-write by sim_dev_import: the kernel's output lands there). */
    const void *src = job->dev_src ? job->dev_src : job->src ? job->src : l->staging[job->slot].in;
    void *dst = job->dev_dst ? job->dev_dst : job->dst ? job->dst : l->staging[job->slot].out;
    /* A device region is read in place, as the CUDA engine's kernels read it. */
    const void *in = job->dev_src ? job->dev_src : l->d_in;
    if (!job->dev_src)
        memcpy(l->d_in, src, job->n * esize);
    if (job->carry_upload) /* whatever the operation: it starts the named stream's chain */
        *carry = small->carry;
    switch (job->opcode) {
    case TALLY_OP_FILTER:
        st = cpu->filter(cpu->ctx, (tally_dtype_t)job->dtype, in, job->n, &job->spec, l->d_out,
                         &kept);
        l->d_small.kept = kept;
        memcpy(dst, l->d_out, job->n * esize);
        break;
    case TALLY_OP_SCAN:
        st = cpu->scan(cpu->ctx, in, job->n, job->exclusive, job->out_i32, l->d_out, carry);
        l->d_small.carry = *carry;
        memcpy(dst, l->d_out, job->n * (job->out_i32 ? 4 : 8));
        break;
    case TALLY_OP_HIST:
        memset(&l->d_small.hist, 0, sizeof l->d_small.hist);
        st = tk_backend_hist(cpu, job->dtype, in, job->n, job->lo, job->hi, &l->d_small.hist);
        break;
    case TALLY_OP_MINMAX:
        l->d_small.minmax[0] = TK_MINMAX_EMPTY_MIN;
        l->d_small.minmax[1] = TK_MINMAX_EMPTY_MAX;
        st = cpu->minmax(cpu->ctx, (tally_dtype_t)job->dtype, in, job->n, &l->d_small.minmax[0],
                         &l->d_small.minmax[1]);
        break;
    default:
        break;
    }
    *small = l->d_small;
    return st;
}

static td_gpu_err_t sim_lane_launch(void *lane, const td_gpu_job_t *job, td_gpu_done_fn done,
                                      void *arg)
{
    sim_lane_t *l = lane;
    if (!sim_reaches(job->dev_import, l->device) || !sim_reaches(job->dev_out_import, l->device)) {
        snprintf(sim_error, sizeof sim_error,
                 "simulated illegal address: a device region not mapped on GPU %d", l->device);
        return TD_GPU_E_DEVICE;
    }
    if (l->sim->latency_us)
        usleep(l->sim->latency_us);
    tally_status_t st = sim_run(l, job);
    if (st != TALLY_OK) {
        snprintf(sim_error, sizeof sim_error, "simulated kernel failed: %s", tally_status_name(st));
        return TD_GPU_E_DEVICE;
    }
    sim_launched(l, job->slot, done, arg); /* without done the lane polls sim_lane_finished */
    return TD_GPU_OK;
}

/* A split job, simulated: the same pieces as the CUDA engine's (td_gpu_piece_elems), run one
 * after the other through this lane's own "device" buffers (another lane's buffers belong to its
 * thread here), the scan carry chained through the job's device carry from piece to piece and
 * the pieces' histograms added into one, so a slip in the piece offsets or the chaining gives
 * wrong replies the tests see. */
static tally_status_t sim_run_split(sim_lane_t *l, unsigned count, const td_gpu_job_t *job)
{
    tk_backend_t *cpu = l->sim->cpu;
    td_gpu_small_t *small = l->staging[job->slot].small;
    size_t esize = tally_dtype_size((tally_dtype_t)job->dtype);
    size_t osize = job->out_i32 ? 4 : 8;
    size_t per = td_gpu_piece_elems(job->n, count, esize);
    int64_t *carry = &l->d_carries[job->carry_index];
    tally_status_t st = TALLY_OK;
    if (job->carry_upload)
        *carry = small->carry;
    memset(&l->d_small.hist, 0, sizeof l->d_small.hist);
    for (size_t first = 0; first < job->n && st == TALLY_OK; first += per) {
        size_t n = job->n - first < per ? job->n - first : per;
        memcpy(l->d_in, (const uint8_t *)job->src + first * esize, n * esize);
        if (job->opcode == TALLY_OP_SCAN) {
            st = cpu->scan(cpu->ctx, l->d_in, n, job->exclusive, job->out_i32, l->d_out, carry);
            memcpy((uint8_t *)job->dst + first * osize, l->d_out, n * osize);
        } else {
            st = tk_backend_hist(cpu, job->dtype, l->d_in, n, job->lo, job->hi, &l->d_small.hist);
        }
    }
    l->d_small.carry = *carry;
    *small = l->d_small;
    return st;
}

static td_gpu_err_t sim_lane_launch_split(void *lane, void *const *lanes, unsigned lane_count,
                                            unsigned count, const td_gpu_job_t *job,
                                            td_gpu_done_fn done, void *arg)
{
    sim_lane_t *l = lane;
    (void)lanes;
    (void)lane_count;
    if (!td_gpu_split_fits(job, count, l->max_batch)) {
        snprintf(sim_error, sizeof sim_error, "split job does not fit the lanes' buffers");
        return TD_GPU_E_UNFIT;
    }
    if (l->sim->latency_us)
        usleep(l->sim->latency_us);
    if (sim_run_split(l, count, job) != TALLY_OK) {
        snprintf(sim_error, sizeof sim_error, "simulated split kernel failed");
        return TD_GPU_E_DEVICE;
    }
    sim_launched(l, job->slot, done, arg); /* without done the lane polls sim_lane_finished */
    return TD_GPU_OK;
}

/* done came before the launch returned: a launch that succeeded has finished (finish_us after
 * it returned, when set). */
static bool sim_lane_finished(void *lane, unsigned slot)
{
    const sim_lane_t *l = lane;
    return slot >= SIM_FINISH_SLOTS || td_mono_ns() >= l->finish_ns[slot];
}

/* Everything enqueued has finished (each launch ran before it returned): done at once. */
static td_gpu_err_t sim_lane_notify(void *lane, td_gpu_done_fn done, void *arg)
{
    (void)lane;
    done(arg);
    return TD_GPU_OK;
}

static td_gpu_err_t sim_lane_check(void *lane)
{
    (void)lane;
    return TD_GPU_OK;
}

/* Host memory is what the simulated device reads: nothing to register (but the time it takes,
 * when a test asks for it). */
static td_gpu_err_t sim_region_register(void *ctx, void *base, size_t size, bool read_only)
{
    sim_t *sim = ctx;
    if (sim->register_us)
        usleep(sim->register_us);
    (void)read_only;
    (void)base;
    (void)size;
    return TD_GPU_OK;
}

static void sim_region_unregister(void *ctx, void *base)
{
    (void)ctx;
    (void)base;
}

/* A simulated GPU's UUID: "tallyd-sim-gpu", 0, then the device number (PROTOCOL.md §10). */
static td_gpu_err_t sim_device_uuid(void *ctx, int device, uint8_t uuid[TALLY_GPU_UUID_SIZE])
{
    (void)ctx;
    memset(uuid, 0, TALLY_GPU_UUID_SIZE);
    memcpy(uuid, "tallyd-sim-gpu", 14);
    uuid[15] = (uint8_t)device;
    return TD_GPU_OK;
}


static td_gpu_err_t sim_dev_import(void *ctx, const td_gpu_import_args_t *a,
                                     uint32_t *peers_mapped, void **import, void **ptr, char *why,
                                     size_t why_cap)
{
    sim_t *sim = ctx;
    /* a->event: the simulated device runs synchronously, nothing to wait for */
    if (sim->register_us) /* as an import on a busy driver, when a test asks for it */
        usleep(sim->register_us);
    int seals = fcntl(a->fd, F_GET_SEALS);
    struct stat st;
    if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW) ||
        fstat(a->fd, &st) != 0 || st.st_size <= 0) {
        snprintf(why, why_cap, "the descriptor is not an exportable GPU allocation");
        return TD_GPU_E_CLIENT;
    }
    if ((uint64_t)st.st_size != a->size) { /* CUDA: mapping another size is NOT_SUPPORTED */
        snprintf(why, why_cap, "size %llu is not the allocation's size",
                 (unsigned long long)a->size);
        return TD_GPU_E_CLIENT;
    }
    sim_import_t *im = calloc(1, sizeof *im);
    void *base = mmap(NULL, a->size, PROT_READ | (a->writable ? PROT_WRITE : 0), MAP_SHARED,
                      a->fd, 0);
    if (!im || base == MAP_FAILED) {
        snprintf(why, why_cap, "cannot map the allocation: %s", im ? strerror(errno) : "no memory");
        free(im);
        return TD_GPU_E_CLIENT;
    }
    *im = (sim_import_t){.fd = a->fd, .base = base, .size = a->size, .reach = 1u << a->device};
    *peers_mapped = 0;
    for (unsigned i = 0; i < a->peer_count && i < TD_GPU_PEERS_MAX; i++) {
        int peer = a->peers[i];
        if (peer != a->device && (unsigned)peer < sim->peers && (unsigned)a->device < sim->peers) {
            *peers_mapped |= 1u << i;
            im->reach |= 1u << peer;
        }
    }
    *import = im;
    *ptr = base;
    return TD_GPU_OK;
}

static void sim_dev_release(void *ctx, void *import, bool stale, uint32_t stale_peers)
{
    (void)ctx;
    (void)stale; /* a simulated reset leaves the mapping: unmapped either way */
    (void)stale_peers;
    sim_import_t *im = import;
    munmap(im->base, im->size);
    close(im->fd);
    free(im);
}

/* A simulated device has no context to recreate. */
static td_gpu_err_t sim_device_reset(void *ctx, int device, char *why, size_t why_cap)
{
    (void)ctx;
    (void)device;
    (void)why;
    (void)why_cap;
    return TD_GPU_OK;
}

static void *sim_host_alloc(void *ctx, int device, size_t size)
{
    (void)ctx;
    (void)device;
    return malloc(size);
}

static void sim_host_free(void *ctx, void *p)
{
    (void)ctx;
    free(p);
}

static const char *sim_error_string(void)
{
    return sim_error;
}

static void sim_destroy(td_gpu_engine_t **self_p)
{
    td_gpu_engine_t *e = *self_p;
    if (!e)
        return;
    sim_t *sim = e->ctx;
    if (sim && sim->cpu)
        sim->cpu->destroy(&sim->cpu);
    free(sim);
    free(e);
    *self_p = NULL;
}

static const td_gpu_engine_t sim_engine = TD_GPU_ENGINE_TABLE(sim);

td_gpu_err_t td_gpu_engine_sim_new(unsigned devices, td_gpu_engine_t **out)
{
    td_gpu_engine_t *e = calloc(1, sizeof *e);
    sim_t *sim = calloc(1, sizeof *sim);
    if (!e || !sim || tk_cpu_backend_new(&sim->cpu) != TALLY_OK) {
        free(sim);
        free(e);
        return TD_GPU_E_NOMEM;
    }
    sim->devices = devices;
    const char *latency = getenv("TALLYD_TEST_SIM_LATENCY_US");
    sim->latency_us = latency ? (unsigned)strtoul(latency, NULL, 10) : 0;
    const char *reg = getenv("TALLYD_TEST_SIM_REGISTER_US");
    sim->register_us = reg ? (unsigned)strtoul(reg, NULL, 10) : 0;
    const char *peers = getenv("TALLYD_TEST_SIM_PEERS");
    sim->peers = peers ? (unsigned)strtoul(peers, NULL, 10) : 0;
    const char *finish = getenv("TALLYD_TEST_SIM_FINISH_US");
    sim->finish_us = finish ? (unsigned)strtoul(finish, NULL, 10) : 0;
    *e = sim_engine;
    e->ctx = sim;
    *out = e;
    return TD_GPU_OK;
}
