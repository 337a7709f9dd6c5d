/*
 * td_gpu_cuda.c — the CUDA engine of the GPU pipeline (see td_gpu_engine.h).
 *
 * A lane is one non-blocking CUDA stream with one set of device buffers (input, output,
 * kernel scratch from tk_cuda_scratch_bytes_max, small results, the carries array) and its
 * staging slots in pinned host memory (cudaMallocHost), all allocated at lane_open. One set of
 * device buffers is enough per lane: the operations of a lane run in stream order, so the next
 * batch's H2D copy into d_in is only executed after this batch's D2H copy out of d_out. The
 * overlap the design wants (copies of one batch beside kernels of others) comes from the lanes
 * running side by side, and from the lane thread filling the next staging slot while this one
 * is on the device.
 *
 * A launch enqueues, on the lane's stream and without waiting:
 *   H2D input; for the request that starts a stream's chain (whatever its operation: a hist
 *   or filter may come first, and the scans behind it read the carry it leaves), H2D of the
 *   host carry into the stream's device carry; the kernel (tk_cuda.h: the scan reads and updates
 * the device carry in place, the histogram adds into a zeroed per-lane device histogram); D2H of
 * the output and the small results; cudaLaunchHostFunc(done). The filter's output is copied back
 * whole (n elements) rather than kept-count first: reading the count first would need a
 * synchronisation in the middle of the chain, and PCIe moves the extra bytes ~20x faster than
 * ZeroMQ moves the request.
 *
 * Errors: a failed enqueue drains the stream (so no copy still reads the staging slot) and
 * clears the error. A kernel that fails asynchronously never runs its host function
 * (cudaLaunchHostFunc skips it on error), so the pipeline's watchdog asks lane_check
 * (cudaStreamQuery) when a launch takes too long.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "td_gpu_engine.h"
#include "tk_cuda.h"

typedef struct {
    int device;
    size_t max_batch;
    unsigned slots;
    td_gpu_staging_t *staging;
    cudaStream_t stream;
    void *d_in;
    void *d_out;
    void *d_scratch;
    size_t scratch_bytes;
    td_gpu_small_t *d_small;
    int64_t *d_carries;
    unsigned carries;
    /* Split jobs this lane launches (cuda_lane_launch_split): its start, each piece's kernel
     * (the next piece's kernel waits for it: the scan carry) and each piece's end (this lane
     * waits for them all). Only this lane's thread records them. */
    cudaEvent_t ev_start;
    cudaEvent_t ev_kernel[TD_GPU_SPLIT_MAX_PIECES];
    cudaEvent_t ev_done[TD_GPU_SPLIT_MAX_PIECES];
    bool events;
} cuda_lane_t;

static int cuda_device_count(void *ctx)
{
    (void)ctx;
    return tk_cuda_device_count();
}

static void cuda_describe(void *ctx, int device, char *buf, size_t cap)
{
    (void)ctx;
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, device) == cudaSuccess)
        snprintf(buf, cap, "%s", prop.name);
    else
        snprintf(buf, cap, "CUDA device %d", device);
    (void)cudaGetLastError();
}

static void cuda_lane_close(void *lane)
{
    cuda_lane_t *l = lane;
    if (!l)
        return;
    (void)cudaSetDevice(l->device);
    if (l->stream)
        (void)cudaStreamSynchronize(l->stream);
    for (unsigned i = 0; l->staging && i < l->slots; i++) {
        cudaFreeHost(l->staging[i].in);
        cudaFreeHost(l->staging[i].out);
        cudaFreeHost(l->staging[i].small);
    }
    cudaFree(l->d_in);
    cudaFree(l->d_out);
    cudaFree(l->d_scratch);
    cudaFree(l->d_small);
    cudaFree(l->d_carries);
    if (l->events) {
        cudaEventDestroy(l->ev_start);
        for (unsigned i = 0; i < TD_GPU_SPLIT_MAX_PIECES; i++) {
            cudaEventDestroy(l->ev_kernel[i]);
            cudaEventDestroy(l->ev_done[i]);
        }
    }
    if (l->stream)
        cudaStreamDestroy(l->stream);
    (void)cudaGetLastError();
    free(l);
}

static tally_status_t cuda_lane_open(void *ctx, int device, size_t max_batch, unsigned slots,
                                     unsigned carries, void **lane, td_gpu_staging_t *staging,
                                     uint64_t *device_bytes, char *why, size_t why_cap)
{
    (void)ctx;
    cudaError_t err = cudaSuccess;
    const char *step = "calloc";
    cuda_lane_t *l = calloc(1, sizeof *l);
    if (!l)
        goto fail;
    l->device = device;
    l->max_batch = max_batch;
    l->slots = slots;
    l->staging = staging;
    l->carries = carries;
    l->scratch_bytes = tk_cuda_scratch_bytes_max(max_batch);
    memset(staging, 0, slots * sizeof *staging);
#define STEP(what, call)                                                                           \
    do {                                                                                           \
        step = (what);                                                                             \
        if ((err = (call)) != cudaSuccess)                                                         \
            goto fail;                                                                             \
    } while (0)
    STEP("cudaSetDevice", cudaSetDevice(device));
    STEP("cudaStreamCreate", cudaStreamCreateWithFlags(&l->stream, cudaStreamNonBlocking));
    STEP("cudaMalloc(input)", cudaMalloc(&l->d_in, max_batch));
    STEP("cudaMalloc(output)", cudaMalloc(&l->d_out, 2 * max_batch));
    if (l->scratch_bytes)
        STEP("cudaMalloc(scratch)", cudaMalloc(&l->d_scratch, l->scratch_bytes));
    STEP("cudaMalloc(small)", cudaMalloc((void **)&l->d_small, sizeof *l->d_small));
    STEP("cudaMalloc(carries)", cudaMalloc((void **)&l->d_carries, carries * sizeof(int64_t)));
    STEP("cudaMemset(carries)", cudaMemset(l->d_carries, 0, carries * sizeof(int64_t)));
    {
        const unsigned flags = cudaEventDisableTiming;
        STEP("cudaEventCreate", cudaEventCreateWithFlags(&l->ev_start, flags));
        for (unsigned i = 0; i < TD_GPU_SPLIT_MAX_PIECES; i++) {
            STEP("cudaEventCreate", cudaEventCreateWithFlags(&l->ev_kernel[i], flags));
            STEP("cudaEventCreate", cudaEventCreateWithFlags(&l->ev_done[i], flags));
        }
        l->events = true; /* (a partial set leaks a few events on a failed start; harmless) */
    }
    for (unsigned i = 0; i < slots; i++) {
        STEP("cudaMallocHost(staging in)", cudaMallocHost(&staging[i].in, max_batch));
        STEP("cudaMallocHost(staging out)", cudaMallocHost(&staging[i].out, 2 * max_batch));
        STEP("cudaMallocHost(small)",
             cudaMallocHost((void **)&staging[i].small, sizeof *staging[i].small));
        memset(staging[i].small, 0, sizeof *staging[i].small);
    }
#undef STEP
    *device_bytes = 3 * (uint64_t)max_batch + l->scratch_bytes + sizeof(td_gpu_small_t) +
                    carries * sizeof(int64_t);
    *lane = l;
    return TALLY_OK;
fail:
    snprintf(why, why_cap, "CUDA device %d: %s failed: %s", device, step,
             err == cudaSuccess ? "out of memory" : cudaGetErrorString(err));
    (void)tk_cuda_status(err);
    cuda_lane_close(l);
    return TALLY_E_BACKEND;
}

static tally_status_t cuda_lane_bind(void *lane)
{
    return tk_cuda_status(cudaSetDevice(((cuda_lane_t *)lane)->device));
}

/* Enqueues the kernel of one job on the lane's stream. */
static tally_status_t enqueue_kernel(cuda_lane_t *l, const td_gpu_job_t *job)
{
    switch (job->opcode) {
    case TALLY_OP_FILTER:
        return tk_cuda_filter((tally_dtype_t)job->dtype, l->d_in, job->n, &job->spec, l->d_out,
                              &l->d_small->kept, l->d_scratch, l->scratch_bytes, l->stream);
    case TALLY_OP_SCAN: {
        int64_t *carry = &l->d_carries[job->carry_index];
        return tk_cuda_scan(l->d_in, job->n, job->exclusive, job->out_i32, l->d_out, carry, carry,
                            l->d_scratch, l->scratch_bytes, l->stream);
    }
    case TALLY_OP_HIST: {
        tally_status_t st = tk_cuda_status(
            cudaMemsetAsync(&l->d_small->hist, 0, sizeof l->d_small->hist, l->stream));
        if (st != TALLY_OK)
            return st;
        return tk_cuda_hist(job->dtype, l->d_in, job->n, job->lo, job->hi, &l->d_small->hist,
                            l->d_scratch, l->scratch_bytes, l->stream);
    }
    default:
        return TALLY_E_PARAM;
    }
}

#define TRY(call)                                                                                  \
    do {                                                                                           \
        st = tk_cuda_status(call);                                                                 \
        if (st != TALLY_OK)                                                                        \
            goto fail;                                                                             \
    } while (0)

static tally_status_t cuda_lane_launch(void *lane, const td_gpu_job_t *job, td_gpu_done_fn done,
                                       void *arg)
{
    cuda_lane_t *l = lane;
    td_gpu_staging_t *s = &l->staging[job->slot];
    size_t esize = tally_dtype_size((tally_dtype_t)job->dtype);
    tally_status_t st = TALLY_OK;
    int64_t *d_carry = &l->d_carries[job->carry_index];

    /* From a registered shared-memory region directly, else from pinned staging. */
    const void *src = job->src ? job->src : s->in;
    void *dst = job->dst ? job->dst : s->out;
    if (job->n)
        TRY(cudaMemcpyAsync(l->d_in, src, job->n * esize, cudaMemcpyHostToDevice, l->stream));
    if (job->carry_upload) /* whatever the operation: it starts the stream's chain */
        TRY(cudaMemcpyAsync(d_carry, &s->small->carry, sizeof(int64_t), cudaMemcpyHostToDevice,
                            l->stream));
    st = enqueue_kernel(l, job);
    if (st != TALLY_OK)
        goto fail;
    switch (job->opcode) {
    case TALLY_OP_FILTER:
        if (job->n)
            TRY(cudaMemcpyAsync(dst, l->d_out, job->n * esize, cudaMemcpyDeviceToHost, l->stream));
        TRY(cudaMemcpyAsync(&s->small->kept, &l->d_small->kept, sizeof(uint64_t),
                            cudaMemcpyDeviceToHost, l->stream));
        break;
    case TALLY_OP_SCAN:
        if (job->n)
            TRY(cudaMemcpyAsync(dst, l->d_out, job->n * (job->out_i32 ? 4 : 8),
                                cudaMemcpyDeviceToHost, l->stream));
        TRY(cudaMemcpyAsync(&s->small->carry, d_carry, sizeof(int64_t), cudaMemcpyDeviceToHost,
                            l->stream));
        break;
    default:
        TRY(cudaMemcpyAsync(&s->small->hist, &l->d_small->hist, sizeof(tk_hist_t),
                            cudaMemcpyDeviceToHost, l->stream));
        break;
    }
    TRY(cudaLaunchHostFunc(l->stream, done, arg));
    return TALLY_OK;
fail:
    /* Nothing of this job may still read the slot once we return: drain the stream. The first
     * error is already recorded for tk_cuda_error_string(). */
    (void)cudaStreamSynchronize(l->stream);
    (void)cudaGetLastError();
    return TALLY_E_BACKEND;
}

/* One piece of a split job on lane li: its input copy, (for a scan, a wait for the previous
 * piece's kernel, which leaves the carry this one starts from,) its kernel adding into l0's
 * histogram or continuing l0's carry, and a scan's output copy straight into the region. */
static tally_status_t enqueue_piece(cuda_lane_t *l0, cuda_lane_t *li, const td_gpu_job_t *job,
                                    unsigned i, size_t first, size_t n)
{
    tally_status_t st = TALLY_OK;
    size_t esize = tally_dtype_size((tally_dtype_t)job->dtype);
    const uint8_t *src = (const uint8_t *)job->src + first * esize;
    TRY(cudaMemcpyAsync(li->d_in, src, n * esize, cudaMemcpyHostToDevice, li->stream));
    if (job->opcode == TALLY_OP_HIST) {
        if (i > 0) /* l0's histogram is zeroed (and its earlier jobs done with it) */
            TRY(cudaStreamWaitEvent(li->stream, l0->ev_start, 0));
        if (job->dtype == TALLY_DTYPE_U8)
            return tk_cuda_hist_u8(li->d_in, n, &l0->d_small->hist, li->d_scratch,
                                   li->scratch_bytes, li->stream);
        return tk_cuda_hist_i32(li->d_in, n, job->lo, job->hi, &l0->d_small->hist, li->d_scratch,
                                li->scratch_bytes, li->stream);
    }
    int64_t *carry = &l0->d_carries[job->carry_index];
    size_t osize = job->out_i32 ? 4 : 8;
    if (i > 0) /* the carry of the pieces before it */
        TRY(cudaStreamWaitEvent(li->stream, l0->ev_kernel[i - 1], 0));
    st = tk_cuda_scan(li->d_in, n, job->exclusive, job->out_i32, li->d_out, carry, carry,
                      li->d_scratch, li->scratch_bytes, li->stream);
    if (st != TALLY_OK)
        return st;
    TRY(cudaEventRecord(l0->ev_kernel[i], li->stream));
    TRY(cudaMemcpyAsync((uint8_t *)job->dst + first * osize, li->d_out, n * osize,
                        cudaMemcpyDeviceToHost, li->stream));
fail:
    return st;
}

/* A split job (td_gpu_engine.h): every piece is enqueued from this one thread, in order, so a
 * piece only ever waits for work enqueued before it and no two split jobs can wait on each other.
 * Lane 0 (this thread's) starts the chain (carry upload, zeroed histogram), runs piece 0 (and
 * every lane_count-th), then waits for every other piece before it copies the small results back
 * and calls done. */
static tally_status_t cuda_lane_launch_split(void *lane, void *const *lanes, unsigned lane_count,
                                             unsigned count, const td_gpu_job_t *job,
                                             td_gpu_done_fn done, void *arg)
{
    cuda_lane_t *l0 = lane;
    td_gpu_staging_t *s = &l0->staging[job->slot];
    tally_status_t st = TALLY_OK;
    int64_t *d_carry = &l0->d_carries[job->carry_index];
    size_t per = td_gpu_piece_elems(job->n, count, tally_dtype_size((tally_dtype_t)job->dtype));
    unsigned used = 0;
    if (count > TD_GPU_SPLIT_MAX_PIECES || !job->src || (job->opcode == TALLY_OP_SCAN && !job->dst))
        return TALLY_E_PARAM;
    if (job->carry_upload)
        TRY(cudaMemcpyAsync(d_carry, &s->small->carry, sizeof(int64_t), cudaMemcpyHostToDevice,
                            l0->stream));
    if (job->opcode == TALLY_OP_HIST)
        TRY(cudaMemsetAsync(&l0->d_small->hist, 0, sizeof l0->d_small->hist, l0->stream));
    TRY(cudaEventRecord(l0->ev_start, l0->stream));
    for (size_t first = 0; first < job->n; first += per, used++) {
        cuda_lane_t *li = lanes[used % lane_count];
        size_t n = job->n - first < per ? job->n - first : per;
        st = enqueue_piece(l0, li, job, used, first, n);
        if (st != TALLY_OK)
            goto fail;
        if (used % lane_count)
            TRY(cudaEventRecord(l0->ev_done[used], li->stream));
    }
    /* Lane 0 goes on only once every piece is done. Its waits come after all the pieces: waiting
     * inside the loop would hold lane 0's own later pieces (more pieces than lanes) behind them. */
    for (unsigned i = 0; i < used; i++)
        if (i % lane_count)
            TRY(cudaStreamWaitEvent(l0->stream, l0->ev_done[i], 0));
    if (job->opcode == TALLY_OP_HIST)
        TRY(cudaMemcpyAsync(&s->small->hist, &l0->d_small->hist, sizeof(tk_hist_t),
                            cudaMemcpyDeviceToHost, l0->stream));
    else
        TRY(cudaMemcpyAsync(&s->small->carry, d_carry, sizeof(int64_t), cudaMemcpyDeviceToHost,
                            l0->stream));
    TRY(cudaLaunchHostFunc(l0->stream, done, arg));
    return TALLY_OK;
fail:
    /* Nothing of the job may still run once we return: drain every lane it touched. */
    for (unsigned i = 0; i <= used && i < lane_count; i++)
        (void)cudaStreamSynchronize(((cuda_lane_t *)lanes[i])->stream);
    (void)cudaGetLastError();
    return TALLY_E_BACKEND;
}

static tally_status_t cuda_lane_check(void *lane)
{
    cudaError_t err = cudaStreamQuery(((cuda_lane_t *)lane)->stream);
    if (err == cudaSuccess || err == cudaErrorNotReady)
        return TALLY_OK;
    return tk_cuda_status(err);
}

/* Once per region, on a libuv worker thread (td_shm.c), not the loop: portable, so the lanes of
 * every device copy from it. (cudaHostRegister of 1 GiB took 52-55 ms on the H100 host, which is
 * why it is never done per request.) */
static tally_status_t cuda_region_register(void *ctx, void *base, size_t size, bool read_only)
{
    (void)ctx;
    unsigned flags = cudaHostRegisterPortable | (read_only ? cudaHostRegisterReadOnly : 0);
    return tk_cuda_status(cudaHostRegister(base, size, flags));
}

static void cuda_region_unregister(void *ctx, void *base)
{
    (void)ctx;
    (void)cudaHostUnregister(base);
    (void)cudaGetLastError();
}

static void *cuda_host_alloc(void *ctx, int device, size_t size)
{
    (void)ctx;
    void *p = NULL;
    if (cudaSetDevice(device) != cudaSuccess || cudaMallocHost(&p, size) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

static void cuda_host_free(void *ctx, void *p)
{
    (void)ctx;
    cudaFreeHost(p);
}

static void cuda_engine_destroy(td_gpu_engine_t **self_p)
{
    free(*self_p);
    *self_p = NULL;
}

tally_status_t td_gpu_engine_cuda_new(td_gpu_engine_t **out, char *why, size_t why_cap)
{
    int count = tk_cuda_device_count();
    if (count <= 0) {
        snprintf(why, why_cap, "no CUDA device found");
        return TALLY_E_BACKEND;
    }
    td_gpu_engine_t *e = calloc(1, sizeof *e);
    if (!e) {
        snprintf(why, why_cap, "out of memory");
        return TALLY_E_INTERNAL;
    }
    e->name = "cuda";
    e->device_count = cuda_device_count;
    e->describe = cuda_describe;
    e->lane_open = cuda_lane_open;
    e->lane_close = cuda_lane_close;
    e->lane_bind = cuda_lane_bind;
    e->lane_launch = cuda_lane_launch;
    e->lane_launch_split = cuda_lane_launch_split;
    e->lane_check = cuda_lane_check;
    e->region_register = cuda_region_register;
    e->region_unregister = cuda_region_unregister;
    e->host_alloc = cuda_host_alloc;
    e->host_free = cuda_host_free;
    e->error_string = tk_cuda_error_string;
    e->destroy = cuda_engine_destroy;
    *out = e;
    return TALLY_OK;
}
