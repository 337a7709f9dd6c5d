/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_gpu_cuda.c — the CUDA engine of the GPU pipeline (see td_gpu_engine.h), on the one layer
 * of CUDA host code in kernels/cuda (tk_cuda.h: the kernels, tk_cuda_buffers_t, the error and
 * setup helpers; tests/test_cuda_backend.c runs the kernels through this engine too).
 *
 * A lane is one non-blocking CUDA stream (its work runs in lane order) with one set of device
 * buffers (tk_cuda_buffers_t: input, output, kernel scratch, small results; and the carries
 * array) and its staging slots in pinned host memory (cudaMallocHost), all allocated at
 * lane_open. One set of device buffers is enough per lane: the operations of a lane run in
 * order, so the next batch's H2D copy into d_in is only executed after this batch's D2H copy out
 * of d_out. The overlap the design wants (copies of one batch beside kernels of others) comes
 * from the lanes running side by side, and from the lane thread filling the next staging slot
 * while this one is on the device.
 *
 * A launch enqueues, on the lane and without waiting:
 *   H2D input; for the request that starts a named stream's chain (whatever its operation: a
 *   hist or filter may come first, and the scans behind it read the carry it leaves), H2D of the
 *   host carry into the named stream's device carry; the kernel (tk_cuda.h: the scan reads and
 *   updates the device carry in place, the histogram adds into a zeroed per-lane device
 *   histogram); D2H of the output and the small results; the slot's event (what a polling lane
 *   thread queries, cuda_lane_finished); cudaLaunchHostFunc(done) unless it polls. The filter's
 *   output is copied back whole (n elements) rather than kept-count first: reading the count
 *   first would need a synchronisation in the middle of the chain, and PCIe moves the extra
 *   bytes ~20x faster than ZeroMQ moves the request.
 *
 * Errors: a failed enqueue drains the lane (tk_cuda_drain: so no copy still reads the staging
 * slot) and clears the error. A kernel that fails asynchronously never runs its host function
 * (cudaLaunchHostFunc skips it on error), so the pipeline's watchdog asks lane_check
 * (cudaStreamQuery) when a launch takes too long.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "td_cu_driver.h"
#include "td_gpu_engine.h"
#include "tk_cuda.h"

typedef struct {
    tk_cuda_buffers_t dev; /* the lane's CUDA stream and device buffers (small: td_gpu_small_t) */
    size_t max_batch;
    unsigned slots;
    td_gpu_staging_t *staging;
    int64_t *d_carries;
    unsigned carries;
    /* Split jobs this lane launches (cuda_lane_launch_split): its start, each piece's kernel
     * (the next piece's kernel waits for it: the scan carry) and each piece's end (this lane
     * waits for them all). Only this lane's thread records them. */
    cudaEvent_t ev_start;
    cudaEvent_t ev_kernel[TD_GPU_SPLIT_MAX_PIECES];
    cudaEvent_t ev_done[TD_GPU_SPLIT_MAX_PIECES];
    bool events;
    /* Per staging slot, recorded after the last work of a launch into it, before done's host
     * function: what lane_finished asks (the lane thread alone). */
    cudaEvent_t *ev_slot;
    unsigned ev_slots;
} cuda_lane_t;

static int cuda_device_count(void *ctx)
{
    (void)ctx;
    return tk_cuda_device_count();
}

static void cuda_describe(void *ctx, int device, char *buf, size_t cap)
{
    (void)ctx;
    tk_cuda_device_name(device, buf, cap);
}

static void cuda_lane_close(void *lane)
{
    cuda_lane_t *l = lane;
    if (!l)
        return;
    tk_cuda_buffers_close(&l->dev); /* waits for the lane's work first */
    for (unsigned i = 0; l->staging && i < l->slots; i++) {
        cudaFreeHost(l->staging[i].in);
        cudaFreeHost(l->staging[i].out);
        cudaFreeHost(l->staging[i].small);
    }
    cudaFree(l->d_carries);
    if (l->events) {
        cudaEventDestroy(l->ev_start);
        for (unsigned i = 0; i < TD_GPU_SPLIT_MAX_PIECES; i++) {
            cudaEventDestroy(l->ev_kernel[i]);
            cudaEventDestroy(l->ev_done[i]);
        }
    }
    for (unsigned i = 0; i < l->ev_slots; i++)
        cudaEventDestroy(l->ev_slot[i]);
    free(l->ev_slot);
    (void)cudaGetLastError();
    free(l);
}

/* The split jobs' events (a partial set leaks a few events on a failed start; harmless). */
static bool open_events(cuda_lane_t *l, char *why, size_t why_cap)
{
    const unsigned flags = cudaEventDisableTiming;
    int device = l->dev.device;
    if (!tk_cuda_setup_step(cudaEventCreateWithFlags(&l->ev_start, flags), device,
                            "cudaEventCreate", why, why_cap))
        return false;
    for (unsigned i = 0; i < TD_GPU_SPLIT_MAX_PIECES; i++)
        if (!tk_cuda_setup_step(cudaEventCreateWithFlags(&l->ev_kernel[i], flags), device,
                                "cudaEventCreate", why, why_cap) ||
            !tk_cuda_setup_step(cudaEventCreateWithFlags(&l->ev_done[i], flags), device,
                                "cudaEventCreate", why, why_cap))
            return false;
    l->events = true;
    l->ev_slot = calloc(l->slots, sizeof *l->ev_slot);
    if (!l->ev_slot) {
        snprintf(why, why_cap, "CUDA device %d: calloc failed: out of memory", device);
        return false;
    }
    for (; l->ev_slots < l->slots; l->ev_slots++)
        if (!tk_cuda_setup_step(cudaEventCreateWithFlags(&l->ev_slot[l->ev_slots], flags), device,
                                "cudaEventCreate", why, why_cap))
            return false;
    return true;
}

/* The staging slots, in pinned host memory. */
static bool open_staging(cuda_lane_t *l, size_t max_batch, char *why, size_t why_cap)
{
    int device = l->dev.device;
    for (unsigned i = 0; i < l->slots; i++) {
        td_gpu_staging_t *s = &l->staging[i];
        if (!tk_cuda_setup_step(cudaMallocHost(&s->in, max_batch), device,
                                "cudaMallocHost(staging in)", why, why_cap) ||
            !tk_cuda_setup_step(cudaMallocHost(&s->out, 2 * max_batch), device,
                                "cudaMallocHost(staging out)", why, why_cap) ||
            !tk_cuda_setup_step(cudaMallocHost((void **)&s->small, sizeof *s->small), device,
                                "cudaMallocHost(small)", why, why_cap))
            return false;
        memset(s->small, 0, sizeof *s->small);
    }
    return true;
}

static td_gpu_err_t cuda_lane_open(void *ctx, int device, size_t max_batch, unsigned slots,
                                     unsigned carries, void **lane, td_gpu_staging_t *staging,
                                     uint64_t *device_bytes, char *why, size_t why_cap)
{
    (void)ctx;
    memset(staging, 0, slots * sizeof *staging);
    cuda_lane_t *l = calloc(1, sizeof *l);
    if (!l) {
        snprintf(why, why_cap, "CUDA device %d: calloc failed: out of memory", device);
        return TD_GPU_E_DEVICE;
    }
    l->max_batch = max_batch;
    l->slots = slots;
    l->staging = staging;
    l->carries = carries;
    size_t carry_bytes = carries * sizeof(int64_t);
    if (tk_cuda_buffers_open(&l->dev, device, max_batch, sizeof(td_gpu_small_t), why, why_cap) !=
            TALLY_OK ||
        !tk_cuda_setup_step(cudaMalloc((void **)&l->d_carries, carry_bytes), device,
                            "cudaMalloc(carries)", why, why_cap) ||
        !tk_cuda_setup_step(cudaMemset(l->d_carries, 0, carry_bytes), device, "cudaMemset(carries)",
                            why, why_cap) ||
        !open_events(l, why, why_cap) || !open_staging(l, max_batch, why, why_cap)) {
        cuda_lane_close(l);
        return TD_GPU_E_DEVICE;
    }
    *device_bytes = l->dev.device_bytes + carry_bytes;
    *lane = l;
    return TD_GPU_OK;
}

static td_gpu_err_t cuda_lane_bind(void *lane)
{
    return td_gpu_err_from_tk(tk_cuda_status(cudaSetDevice(((cuda_lane_t *)lane)->dev.device)));
}

/* ---- device regions (PROTOCOL.md §10 "Device memory") ------------------------------------ */

/* One imported allocation: the producer exported it as a descriptor (cuMemExportToShareableHandle,
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR); it is imported and mapped once, on the device with
 * the producer's UUID, and stays mapped until released: mapping per request would cost ~140 us
 * (the probe of issue 23), the import once ~1.2 ms. The received descriptor is kept open until
 * release: the memory lives until the last holder closes it, so a producer killed with
 * requests in flight leaves it valid. Peer access: the same mapping (one address space) is made
 * accessible to every other device the driver says can reach this one's memory (over NVLink
 * 370 GB/s on the H200 pair of issue 23, against ~2,100 locally); those are the devices in
 * `reach` after the own one. The IPC event is opened once per device in `reach`, with that
 * device current: opening it on one device and waiting on it from another's stream segfaults
 * (issue 23). */
typedef struct {
    int fd;
    int device;
    size_t size;
    CUmemGenericAllocationHandle handle;
    bool handle_held;
    CUdeviceptr ptr;
    bool reserved, mapped;
    unsigned reach_count;                   /* [0] the own device, then the peers mapped */
    int reach[1 + TD_GPU_PEERS_MAX];        /* CUDA ordinals */
    int reach_peer[1 + TD_GPU_PEERS_MAX];   /* the index in the import's peers; -1 for [0] */
    cudaEvent_t event[1 + TD_GPU_PEERS_MAX]; /* opened on reach[k]; NULL without DEV_EVENT */
} cuda_import_t;

/* The driver functions, resolved once (td_cu_driver.h); cu_ok false: no device regions. */
static td_cu_driver_t cu;
static bool cu_ok;
static pthread_once_t cu_once = PTHREAD_ONCE_INIT;

static void cu_load(void)
{
    cu_ok = td_cu_driver_load(&cu);
}

static td_gpu_err_t cuda_device_uuid(void *ctx, int device, uint8_t uuid[TALLY_GPU_UUID_SIZE])
{
    (void)ctx;
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
        (void)cudaGetLastError();
        return TD_GPU_E_DEVICE;
    }
    memcpy(uuid, prop.uuid.bytes, TALLY_GPU_UUID_SIZE);
    return TD_GPU_OK;
}

/* Undoes what an import got to (its descriptor stays open: the caller's or release's). An
 * event is destroyed with its own device current. `stale`: the own device's context went, with
 * the mapping, the handle and the event opened there; bit i of stale_peers: peer i's context
 * went with the event opened there. */
static void import_undo(cuda_import_t *im, bool stale, uint32_t stale_peers)
{
    for (unsigned k = 0; k < im->reach_count; k++) {
        int peer = im->reach_peer[k];
        if (!im->event[k] || (peer < 0 ? stale : (stale_peers >> peer) & 1u))
            continue;
        if (cudaSetDevice(im->reach[k]) == cudaSuccess)
            (void)cudaEventDestroy(im->event[k]);
    }
    (void)cudaSetDevice(im->device);
    if (stale) {
        (void)cudaGetLastError();
        return;
    }
    if (im->mapped) /* the peers' access goes with the mapping */
        (void)cu.mem_unmap(im->ptr, im->size);
    if (im->reserved)
        (void)cu.address_free(im->ptr, im->size);
    if (im->handle_held)
        (void)cu.mem_release(im->handle);
    (void)cudaGetLastError();
}

/* Gives `device` access to the mapping: read-only for an input region, so a kernel that writes
 * to it faults instead of changing the producer's data. */
static bool import_access(cuda_import_t *im, int device, bool writable)
{
    CUmemAccessDesc access = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device},
                              .flags = writable ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                                                : CU_MEM_ACCESS_FLAGS_PROT_READ};
    return cu.set_access(im->ptr, im->size, &access, 1) == CUDA_SUCCESS;
}

/* Maps the imported handle at a reserved range and gives the own device access. */
static td_gpu_err_t import_map(cuda_import_t *im, bool writable, char *why, size_t why_cap)
{
    /* A size that is no multiple of the granularity fails here, another wrong one at cuMemMap:
     * either way the client's (running out of addresses in 2^47 bytes is not plausible). */
    if (cu.address_reserve(&im->ptr, im->size, 0, 0, 0) != CUDA_SUCCESS) {
        snprintf(why, why_cap, "size %zu is not the allocation's size (no such address range)",
                 im->size);
        return TD_GPU_E_CLIENT;
    }
    im->reserved = true;
    CUresult rc = cu.mem_map(im->ptr, im->size, 0, im->handle, 0);
    if (rc != CUDA_SUCCESS) { /* NOT_SUPPORTED: any size but the whole allocation's */
        snprintf(why, why_cap, "size %zu is not the allocation's size (cuMemMap: %d)", im->size,
                 (int)rc);
        return TD_GPU_E_CLIENT;
    }
    im->mapped = true;
    if (!import_access(im, im->device, writable)) {
        snprintf(why, why_cap, "cannot give GPU %d access to the allocation", im->device);
        return TD_GPU_E_DEVICE;
    }
    im->reach[0] = im->device;
    im->reach_peer[0] = -1;
    im->reach_count = 1;
    return TD_GPU_OK;
}

/* Opens the producer's IPC event with reach[k] current (see cuda_import_t). */
static bool import_event(cuda_import_t *im, unsigned k, const uint8_t *event)
{
    cudaIpcEventHandle_t h;
    memcpy(&h, event, sizeof h < TALLY_GPU_EVENT_SIZE ? sizeof h : TALLY_GPU_EVENT_SIZE);
    if (cudaSetDevice(im->reach[k]) != cudaSuccess ||
        cudaIpcOpenEventHandle(&im->event[k], h) != cudaSuccess) {
        (void)cudaGetLastError();
        im->event[k] = NULL;
        return false;
    }
    return true;
}

/* Peer access (see cuda_import_t): each peer the driver says can reach the own device's memory
 * gets the same access and its own opening of the event; one that fails either is left out (its
 * access, if given, stays until the unmap: harmless, nothing of ours runs there). */
static uint32_t import_peers(cuda_import_t *im, const td_gpu_import_args_t *a)
{
    uint32_t mapped = 0;
    for (unsigned i = 0; i < a->peer_count && i < TD_GPU_PEERS_MAX; i++) {
        int can = 0, peer = a->peers[i];
        unsigned k = im->reach_count;
        if (peer == im->device || cudaDeviceCanAccessPeer(&can, peer, im->device) != cudaSuccess ||
            !can || !import_access(im, peer, a->writable)) {
            (void)cudaGetLastError();
            continue;
        }
        im->reach[k] = peer;
        im->reach_peer[k] = (int)i;
        if (a->event && !import_event(im, k, a->event))
            continue;
        im->reach_count++;
        mapped |= 1u << i;
    }
    (void)cudaSetDevice(im->device);
    return mapped;
}

static td_gpu_err_t cuda_dev_import(void *ctx, const td_gpu_import_args_t *a,
                                      uint32_t *peers_mapped, void **import, void **ptr,
                                      char *why, size_t why_cap)
{
    (void)ctx;
    td_gpu_err_t st = TD_GPU_E_DEVICE;
    int device = a->device;
    cuda_import_t *im = calloc(1, sizeof *im);
    if (!im) {
        snprintf(why, why_cap, "out of memory");
        return TD_GPU_E_NOMEM;
    }
    *im = (cuda_import_t){.fd = a->fd, .device = device, .size = (size_t)a->size};
    pthread_once(&cu_once, cu_load);
    if (!cu_ok) {
        snprintf(why, why_cap, "the CUDA driver lacks the virtual memory management API");
        goto fail;
    }
    /* The runtime's primary context of the device, current on this thread for the driver calls. */
    if (cudaSetDevice(device) != cudaSuccess || cudaFree(0) != cudaSuccess) {
        snprintf(why, why_cap, "GPU %d: %s", device, cudaGetErrorString(cudaGetLastError()));
        goto fail;
    }
    /* A garbage descriptor gives CUDA_ERROR_UNKNOWN here, not sticky: the client's fault. */
    if (cu.mem_import(&im->handle, (void *)(uintptr_t)a->fd,
                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != CUDA_SUCCESS) {
        snprintf(why, why_cap, "the descriptor is not an exportable GPU allocation");
        st = TD_GPU_E_CLIENT;
        goto fail;
    }
    im->handle_held = true;
    st = import_map(im, a->writable, why, why_cap);
    if (st == TD_GPU_OK && a->event && !import_event(im, 0, a->event)) {
        snprintf(why, why_cap, "the IPC event does not open");
        st = TD_GPU_E_CLIENT;
    }
    if (st != TD_GPU_OK)
        goto fail;
    *peers_mapped = import_peers(im, a);
    *import = im;
    *ptr = (void *)(uintptr_t)im->ptr;
    return TD_GPU_OK;
fail:
    import_undo(im, false, 0);
    free(im);
    return st;
}

static void cuda_dev_release(void *ctx, void *import, bool stale, uint32_t stale_peers)
{
    (void)ctx;
    cuda_import_t *im = import;
    /* No kernel of ours still reads it: the last request using it has been answered, after its
     * kernel completed. So no synchronisation, which would stall the loop thread. Stale (the
     * device was reset since): the old context took the mapping, handle and event with it; a
     * peer reset since took only its own event. */
    import_undo(im, stale, stale_peers);
    close(im->fd); /* now the producer's driver may free the memory */
    free(im);
}

/* Recreates the device's primary context after a sticky error (td_gpu_device.c), its lanes
 * closed: cudaDeviceReset, then a probe (an allocation, a memset, a synchronisation). CUDA says
 * that after some errors only a new process helps; then the probe fails and the device stays
 * unusable. */
static td_gpu_err_t cuda_device_reset(void *ctx, int device, char *why, size_t why_cap)
{
    (void)ctx;
    void *probe = NULL;
    cudaError_t err = cudaSetDevice(device);
    if (err == cudaSuccess)
        err = cudaDeviceReset();
    if (err == cudaSuccess)
        err = cudaSetDevice(device);
    if (err == cudaSuccess)
        err = cudaMalloc(&probe, 4096);
    if (err == cudaSuccess)
        err = cudaMemset(probe, 0, 4096);
    if (err == cudaSuccess)
        err = cudaDeviceSynchronize();
    if (probe)
        (void)cudaFree(probe);
    if (err != cudaSuccess) {
        snprintf(why, why_cap, "cudaDeviceReset and a probe on GPU %d: %s", device,
                 cudaGetErrorString(err));
        (void)cudaGetLastError();
        return TD_GPU_E_DEVICE;
    }
    return TD_GPU_OK;
}

/* The lane's stream (on `device`) waits on the region's IPC event opened on that device, when
 * it has one: the producer recorded it after filling the range and before sending the request.
 * A device the region is not mapped on is refused before anything is enqueued: its kernel would
 * read an address it has no access to, an illegal address that kills the device's context. */
static tally_status_t cuda_dev_wait(void *import, int device, cudaStream_t stream)
{
    cuda_import_t *im = import;
    if (!im)
        return TALLY_OK;
    for (unsigned k = 0; k < im->reach_count; k++)
        if (im->reach[k] == device)
            return im->event[k] ? tk_cuda_status(cudaStreamWaitEvent(stream, im->event[k], 0))
                                : TALLY_OK;
    return TALLY_E_PARAM;
}

/* The lane's small results on the device. */
static td_gpu_small_t *lane_small(const cuda_lane_t *l)
{
    return l->dev.d_small;
}

/* Enqueues the kernel of one job on the lane, reading d_in (the lane's input buffer, or a device
 * region in place) and writing a filter's or scan's output to the lane's output buffer, or
 * straight into a device output region (job->dev_dst). */
static tally_status_t enqueue_kernel(cuda_lane_t *l, const td_gpu_job_t *job, const void *d_in)
{
    void *d_out = job->dev_dst ? job->dev_dst : l->dev.d_out;
    switch (job->opcode) {
    case TALLY_OP_FILTER:
        return tk_cuda_filter((tally_dtype_t)job->dtype, d_in, job->n, &job->spec, d_out,
                              &lane_small(l)->kept, l->dev.d_scratch, l->dev.scratch_bytes,
                              l->dev.stream);
    case TALLY_OP_SCAN: {
        int64_t *carry = &l->d_carries[job->carry_index];
        return tk_cuda_scan(d_in, job->n, job->exclusive, job->out_i32, d_out, carry, carry,
                            l->dev.d_scratch, l->dev.scratch_bytes, l->dev.stream);
    }
    case TALLY_OP_HIST: {
        tally_status_t st = tk_cuda_status(
            cudaMemsetAsync(&lane_small(l)->hist, 0, sizeof lane_small(l)->hist, l->dev.stream));
        if (st != TALLY_OK)
            return st;
        return tk_cuda_hist(job->dtype, d_in, job->n, job->lo, job->hi, &lane_small(l)->hist,
                            l->dev.d_scratch, l->dev.scratch_bytes, l->dev.stream);
    }
    case TALLY_OP_MINMAX: {
        tally_status_t st = tk_cuda_minmax_reset(lane_small(l)->minmax, l->dev.stream);
        if (st != TALLY_OK)
            return st;
        return tk_cuda_minmax(job->dtype, d_in, job->n, lane_small(l)->minmax, l->dev.stream);
    }
    default:
        return TALLY_E_PARAM;
    }
}

static td_gpu_err_t cuda_lane_launch(void *lane, const td_gpu_job_t *job, td_gpu_done_fn done,
                                       void *arg)
{
    cuda_lane_t *l = lane;
    td_gpu_staging_t *s = &l->staging[job->slot];
    size_t esize = tally_dtype_size((tally_dtype_t)job->dtype);
    tally_status_t st = TALLY_OK;
    int64_t *d_carry = &l->d_carries[job->carry_index];

    /* A device region is read in place (after its producer's event); a registered
     * shared-memory region is copied directly, anything else from pinned staging. */
    const void *src = job->src ? job->src : s->in;
    void *dst = job->dst ? job->dst : s->out;
    /* A device output region's event too: its producer may still be reading the last output. */
    if (job->dev_dst &&
        (st = cuda_dev_wait(job->dev_out_import, l->dev.device, l->dev.stream)) != TALLY_OK)
        goto fail;
    if (job->dev_src)
        st = cuda_dev_wait(job->dev_import, l->dev.device, l->dev.stream);
    else if (job->n)
        TK_CUDA_TRY(cudaMemcpyAsync(l->dev.d_in, src, job->n * esize, cudaMemcpyHostToDevice,
                                    l->dev.stream));
    if (st != TALLY_OK)
        goto fail;
    if (job->carry_upload) /* whatever the operation: it starts the named stream's chain */
        TK_CUDA_TRY(cudaMemcpyAsync(d_carry, &s->small->carry, sizeof(int64_t),
                                    cudaMemcpyHostToDevice, l->dev.stream));
    st = enqueue_kernel(l, job, job->dev_src ? job->dev_src : l->dev.d_in);
    if (st != TALLY_OK)
        goto fail;
    switch (job->opcode) {
    case TALLY_OP_FILTER:
        if (job->n && !job->dev_dst) /* a device output region already holds it */
            TK_CUDA_TRY(cudaMemcpyAsync(dst, l->dev.d_out, job->n * esize, cudaMemcpyDeviceToHost,
                                        l->dev.stream));
        TK_CUDA_TRY(cudaMemcpyAsync(&s->small->kept, &lane_small(l)->kept, sizeof(uint64_t),
                                    cudaMemcpyDeviceToHost, l->dev.stream));
        break;
    case TALLY_OP_SCAN:
        if (job->n && !job->dev_dst)
            TK_CUDA_TRY(cudaMemcpyAsync(dst, l->dev.d_out, job->n * (job->out_i32 ? 4 : 8),
                                        cudaMemcpyDeviceToHost, l->dev.stream));
        TK_CUDA_TRY(cudaMemcpyAsync(&s->small->carry, d_carry, sizeof(int64_t),
                                    cudaMemcpyDeviceToHost, l->dev.stream));
        break;
    case TALLY_OP_MINMAX:
        TK_CUDA_TRY(cudaMemcpyAsync(s->small->minmax, lane_small(l)->minmax,
                                    sizeof s->small->minmax, cudaMemcpyDeviceToHost,
                                    l->dev.stream));
        break;
    default:
        TK_CUDA_TRY(cudaMemcpyAsync(&s->small->hist, &lane_small(l)->hist, sizeof(tk_hist_t),
                                    cudaMemcpyDeviceToHost, l->dev.stream));
        break;
    }
    TK_CUDA_TRY(cudaEventRecord(l->ev_slot[job->slot], l->dev.stream));
    if (done) /* else the lane thread polls the event (cuda_lane_finished) */
        TK_CUDA_TRY(cudaLaunchHostFunc(l->dev.stream, done, arg));
    return TD_GPU_OK;
fail:
    /* Nothing of this job may still read the slot once we return: drain the lane. The first
     * error is already recorded for tk_cuda_error_string(). */
    tk_cuda_drain(l->dev.stream);
    return TD_GPU_E_DEVICE;
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
    TK_CUDA_TRY(
        cudaMemcpyAsync(li->dev.d_in, src, n * esize, cudaMemcpyHostToDevice, li->dev.stream));
    if (job->opcode == TALLY_OP_HIST) {
        if (i > 0) /* l0's histogram is zeroed (and its earlier jobs done with it) */
            TK_CUDA_TRY(cudaStreamWaitEvent(li->dev.stream, l0->ev_start, 0));
        return tk_cuda_hist(job->dtype, li->dev.d_in, n, job->lo, job->hi, &lane_small(l0)->hist,
                            li->dev.d_scratch, li->dev.scratch_bytes, li->dev.stream);
    }
    int64_t *carry = &l0->d_carries[job->carry_index];
    size_t osize = job->out_i32 ? 4 : 8;
    if (i > 0) /* the carry of the pieces before it */
        TK_CUDA_TRY(cudaStreamWaitEvent(li->dev.stream, l0->ev_kernel[i - 1], 0));
    st = tk_cuda_scan(li->dev.d_in, n, job->exclusive, job->out_i32, li->dev.d_out, carry, carry,
                      li->dev.d_scratch, li->dev.scratch_bytes, li->dev.stream);
    if (st != TALLY_OK)
        return st;
    TK_CUDA_TRY(cudaEventRecord(l0->ev_kernel[i], li->dev.stream));
    TK_CUDA_TRY(cudaMemcpyAsync((uint8_t *)job->dst + first * osize, li->dev.d_out, n * osize,
                                cudaMemcpyDeviceToHost, li->dev.stream));
fail:
    return st;
}

/* A split job (td_gpu_engine.h): every piece is enqueued from this one thread, in order, so a
 * piece only ever waits for work enqueued before it and no two split jobs can wait on each other.
 * Lane 0 (this thread's) starts the chain (carry upload, zeroed histogram), runs piece 0 (and
 * every lane_count-th), then waits for every other piece before it copies the small results back
 * and calls done. */
static td_gpu_err_t cuda_lane_launch_split(void *lane, void *const *lanes, unsigned lane_count,
                                             unsigned count, const td_gpu_job_t *job,
                                             td_gpu_done_fn done, void *arg)
{
    cuda_lane_t *l0 = lane;
    td_gpu_staging_t *s = &l0->staging[job->slot];
    tally_status_t st = TALLY_OK;
    int64_t *d_carry = &l0->d_carries[job->carry_index];
    size_t per = td_gpu_piece_elems(job->n, count, tally_dtype_size((tally_dtype_t)job->dtype));
    unsigned used = 0;
    if (!td_gpu_split_fits(job, count, l0->max_batch))
        return TD_GPU_E_UNFIT;
    if (job->carry_upload)
        TK_CUDA_TRY(cudaMemcpyAsync(d_carry, &s->small->carry, sizeof(int64_t),
                                    cudaMemcpyHostToDevice, l0->dev.stream));
    if (job->opcode == TALLY_OP_HIST)
        TK_CUDA_TRY(
            cudaMemsetAsync(&lane_small(l0)->hist, 0, sizeof lane_small(l0)->hist, l0->dev.stream));
    TK_CUDA_TRY(cudaEventRecord(l0->ev_start, l0->dev.stream));
    for (size_t first = 0; first < job->n; first += per, used++) {
        cuda_lane_t *li = lanes[used % lane_count];
        size_t n = job->n - first < per ? job->n - first : per;
        st = enqueue_piece(l0, li, job, used, first, n);
        if (st != TALLY_OK)
            goto fail;
        if (used % lane_count)
            TK_CUDA_TRY(cudaEventRecord(l0->ev_done[used], li->dev.stream));
    }
    /* Lane 0 goes on only once every piece is done. Its waits come after all the pieces: waiting
     * inside the loop would hold lane 0's own later pieces (more pieces than lanes) behind them. */
    for (unsigned i = 0; i < used; i++)
        if (i % lane_count)
            TK_CUDA_TRY(cudaStreamWaitEvent(l0->dev.stream, l0->ev_done[i], 0));
    if (job->opcode == TALLY_OP_HIST)
        TK_CUDA_TRY(cudaMemcpyAsync(&s->small->hist, &lane_small(l0)->hist, sizeof(tk_hist_t),
                                    cudaMemcpyDeviceToHost, l0->dev.stream));
    else
        TK_CUDA_TRY(cudaMemcpyAsync(&s->small->carry, d_carry, sizeof(int64_t),
                                    cudaMemcpyDeviceToHost, l0->dev.stream));
    TK_CUDA_TRY(cudaEventRecord(l0->ev_slot[job->slot], l0->dev.stream));
    if (done)
        TK_CUDA_TRY(cudaLaunchHostFunc(l0->dev.stream, done, arg));
    return TD_GPU_OK;
fail:
    /* Nothing of the job may still run once we return: drain every lane it touched. */
    for (unsigned i = 0; i <= used && i < lane_count; i++)
        tk_cuda_drain(((cuda_lane_t *)lanes[i])->dev.stream);
    return TD_GPU_E_DEVICE;
}

static bool cuda_lane_finished(void *lane, unsigned slot)
{
    cuda_lane_t *l = lane;
    cudaError_t err = cudaEventQuery(l->ev_slot[slot]);
    if (err == cudaSuccess)
        return true;
    if (err != cudaErrorNotReady) /* a failure: done never comes, the watchdog finds it */
        (void)cudaGetLastError();
    return false;
}

static td_gpu_err_t cuda_lane_notify(void *lane, td_gpu_done_fn done, void *arg)
{
    cuda_lane_t *l = lane;
    return td_gpu_err_from_tk(tk_cuda_status(cudaLaunchHostFunc(l->dev.stream, done, arg)));
}

static td_gpu_err_t cuda_lane_check(void *lane)
{
    cudaError_t err = cudaStreamQuery(((cuda_lane_t *)lane)->dev.stream);
    if (err == cudaSuccess || err == cudaErrorNotReady)
        return TD_GPU_OK;
    return td_gpu_err_from_tk(tk_cuda_status(err));
}

/* Once per region, on a libuv worker thread (td_shm.c), not the loop: portable, so the lanes of
 * every device copy from it. (cudaHostRegister of 1 GiB took 52-55 ms on the H100 host, which is
 * why it is never done per request.) */
static td_gpu_err_t cuda_region_register(void *ctx, void *base, size_t size, bool read_only)
{
    (void)ctx;
    unsigned flags = cudaHostRegisterPortable | (read_only ? cudaHostRegisterReadOnly : 0);
    return td_gpu_err_from_tk(tk_cuda_status(cudaHostRegister(base, size, flags)));
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

static const char *cuda_error_string(void)
{
    return tk_cuda_error_string();
}

static void cuda_destroy(td_gpu_engine_t **self_p)
{
    free(*self_p);
    *self_p = NULL;
}

static const td_gpu_engine_t cuda_engine = TD_GPU_ENGINE_TABLE(cuda);

td_gpu_err_t td_gpu_engine_cuda_new(td_gpu_engine_t **out, char *why, size_t why_cap)
{
    int count = tk_cuda_device_count();
    if (count <= 0) {
        snprintf(why, why_cap, "no CUDA device found");
        return TD_GPU_E_DEVICE;
    }
    td_gpu_engine_t *e = calloc(1, sizeof *e);
    if (!e) {
        snprintf(why, why_cap, "out of memory");
        return TD_GPU_E_NOMEM;
    }
    *e = cuda_engine;
    *out = e;
    return TD_GPU_OK;
}
