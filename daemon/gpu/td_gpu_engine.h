/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_gpu_engine.h — what the GPU pipeline (td_gpu.c) needs from a device, as a table.
 *
 * The pipeline (lanes, staging slots, lane threads, in-order completion, failure handling)
 * is the same whatever runs the batches, so the device sits behind this small table with two
 * implementations:
 *   - cuda (td_gpu_cuda.c, built with TALLY_HAVE_CUDA): a lane is one CUDA stream with its own
 *     device buffers; a launch is H2D copy -> kernel -> D2H copies -> cudaLaunchHostFunc, all
 *     asynchronous on the lane, from pinned staging.
 *   - sim (td_gpu_sim.c, always built): a lane is host memory and the CPU backend, completing
 *     inside the launch. It exists so that the CPU build and CI test the pipeline itself —
 *     ordering on a lane, the scan carry chained in "device" memory, the fallback after a
 *     failure, a device marked unusable — with `--test-sim-gpus N`.
 * and one that wraps either of them for the tests:
 *   - fault (td_gpu_fault.c): passes everything through, but fails on command as a failing
 *     device does (every Nth launch, out of memory at lane_open, slow completions); tallyd
 *     installs it with `--test-fault-every N`, so no layer above this table has test hooks.
 *
 * A lane owns, allocated once at lane_open: `slots` staging buffers on the host (pinned for
 * cuda) that the pipeline fills and reads, device buffers for one batch at a time (input,
 * output, kernel scratch, small results) and `carries` device int64 scan carries that the
 * pipeline hands out to named streams (index 0 is kept for requests without one).
 * Nothing is allocated after lane_open.
 */
#ifndef TD_GPU_ENGINE_H
#define TD_GPU_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tally_proto.h"
#include "td_config.h"
#include "tk_backend.h"

/* What an engine's functions return: the engine's own outcomes, not the wire's statuses. The
 * pipeline maps them to wire statuses in one place (td_gpu_status, td_gpu.c) where one reaches
 * a client (a device region's import); everywhere else an outcome other than TD_GPU_OK fails the
 * job or the set-up, and the words are in `why` or error_string. */
typedef enum {
    TD_GPU_OK = 0,
    TD_GPU_E_DEVICE, /* the device failed (a CUDA error, out of device memory): not the client's */
    TD_GPU_E_CLIENT, /* the client's input cannot be used: a descriptor that is not an exported
                      * allocation, a wrong size, an IPC event that does not open */
    TD_GPU_E_UNFIT,  /* a job the engine cannot take as given (a split over its buffers) */
    TD_GPU_E_NOMEM,  /* out of host memory */
} td_gpu_err_t;

/* A kernel-layer status (tk_backend.h, tk_cuda.h) as an engine outcome. */
static inline td_gpu_err_t td_gpu_err_from_tk(tally_status_t st)
{
    switch (st) {
    case TALLY_OK:
        return TD_GPU_OK;
    case TALLY_E_PARAM:
        return TD_GPU_E_UNFIT;
    case TALLY_E_NOMEM:
        return TD_GPU_E_NOMEM;
    default:
        return TD_GPU_E_DEVICE;
    }
}

/* The small results of one batch, next to its staging buffers. */
typedef struct {
    uint64_t kept;     /* filter */
    int64_t carry;     /* scan: in, the host carry to upload (carry_upload); out, the carry after */
    tk_hist_t hist;    /* hist: this batch's histogram */
    int64_t minmax[2]; /* minmax: the batch's min and max (TK_MINMAX_EMPTY_* when empty) */
} td_gpu_small_t;

/* One staging slot on the host. */
typedef struct {
    void *in;  /* max_batch bytes */
    void *out; /* 2 * max_batch bytes: an int64 scan of int32 input doubles */
    td_gpu_small_t *small;
} td_gpu_staging_t;

/* One batch to run: the request's parameters, already validated by proto/. `src` and `dst`
 * are host memory registered with region_register (a producer's shared-memory region): the
 * engine copies the input straight from src instead of staging[slot].in, and the filter or
 * scan output straight to dst instead of staging[slot].out. NULL: use the staging slot. */
typedef struct {
    uint8_t opcode;
    uint8_t dtype;
    size_t n;              /* elements in staging[slot].in */
    tk_filter_spec_t spec; /* filter */
    int exclusive;         /* scan */
    int out_i32;           /* scan */
    int64_t lo, hi;        /* hist int32, uint16 */
    unsigned carry_index;  /* scan: the device carry it continues from and updates */
    bool carry_upload;     /* scan: first load the carry from staging[slot].small->carry */
    unsigned slot;
    const void *src; /* registered input, or NULL */
    void *dst;       /* registered output (at least the operation's worst case), or NULL */
    /* Input in a device region (PROTOCOL.md §10 "Device memory"): the kernel reads it in place,
     * no copy; NULL otherwise. dev_import is that region's import (dev_import's *import): when
     * it opened an IPC event, the lane waits on it first (the event opened on the lane's device).
     * The lane's device is the region's own or one of the peers it was mapped on; an engine
     * refuses (TD_GPU_E_DEVICE, nothing enqueued) a job on any other device, which would fault. */
    const void *dev_src;
    void *dev_import;
    /* Filter or scan output into a device output region (registered with DEV_OUTPUT, on this
     * lane's device): the kernel writes it there, nothing is copied back; NULL otherwise.
     * dev_out_import is that region's import: the lane waits on its IPC event too. */
    void *dev_dst;
    void *dev_out_import;
} td_gpu_job_t;

/* What a device scan carry holds in the sim and fault engines when no request uploaded it, or
 * after a failure clobbered it, as stale or corrupted device memory would: far from any test's
 * sums, so a pipeline that chains from it gives wrong answers the tests see. */
#define TD_GPU_GARBAGE_CARRY 0x5A5A5A5A5A5A5A5All

/* Called once per successful launch when its results are in the staging slot, from any
 * thread (CUDA's callback thread for cuda); it must not call CUDA. */
typedef void (*td_gpu_done_fn)(void *arg);

/* The elements in each piece of a split job of n elements over `count` lanes (the last piece
 * may be shorter, and with rounding fewer than `count` pieces may be needed): whole 64 KiB
 * multiples, so every piece but the last starts and ends on a kernel tile boundary. */
static inline size_t td_gpu_piece_elems(size_t n, unsigned count, size_t esize)
{
    size_t unit = (64u << 10) / esize;
    size_t per = (n + count - 1) / count;
    return (per + unit - 1) / unit * unit;
}

/* Can `job` be split into `count` pieces on lanes opened for max_batch bytes: few enough pieces,
 * its input (and a scan's output) in registered memory, and every piece within the device
 * buffers? With 3-byte pixels the rounding above can make a piece up to 64 KiB longer than
 * n / count elements, so a count that only divides the bytes evenly may not fit; the engines
 * refuse such a job (TD_GPU_E_UNFIT) rather than overrun their buffers. */
static inline bool td_gpu_split_fits(const td_gpu_job_t *job, unsigned count, size_t max_batch)
{
    size_t esize = tally_dtype_size((tally_dtype_t)job->dtype);
    return count <= TD_GPU_SPLIT_MAX_PIECES && job->src &&
           (job->opcode != TALLY_OP_SCAN || job->dst) &&
           td_gpu_piece_elems(job->n, count, esize) * esize <= max_batch;
}

/* The most peers a device region is mapped on besides its own GPU (the masks are 32 bits). */
#define TD_GPU_PEERS_MAX 16u

/* What dev_import imports, and where (td_gpu_engine_t.dev_import). */
typedef struct {
    int device;          /* the GPU that holds the allocation (the producer's UUID) */
    const int *peers;    /* other GPUs to give access too, where the driver says they can */
    unsigned peer_count; /* at most TD_GPU_PEERS_MAX */
    int fd;
    uint64_t size;
    bool writable;
    const uint8_t *event; /* NULL without DEV_EVENT */
} td_gpu_import_args_t;

typedef struct td_gpu_engine td_gpu_engine_t;
struct td_gpu_engine {
    const char *name; /* "cuda" or "sim" */
    void *ctx;
    int (*device_count)(void *ctx);
    /* "NVIDIA H100 80GB HBM3" */
    void (*describe)(void *ctx, int device, char *buf, size_t cap);
    /* Allocates a lane's device buffers and staging[0..slots) on `device`. *device_bytes
     * receives the device memory it took. On failure, why says what failed. */
    td_gpu_err_t (*lane_open)(void *ctx, int device, size_t max_batch, unsigned slots,
                                unsigned carries, void **lane, td_gpu_staging_t *staging,
                                uint64_t *device_bytes, char *why, size_t why_cap);
    /* Waits for the lane's work and frees everything lane_open allocated. */
    void (*lane_close)(void *lane);
    /* The functions below run on the lane's own thread. */
    td_gpu_err_t (*lane_bind)(void *lane); /* once, when the thread starts */
    /* Enqueues the job; done(arg) follows when it succeeded. TD_GPU_E_DEVICE when enqueuing
     * failed (then done is not called and nothing of the job is still running). done NULL: no
     * host function, the lane thread polls lane_finished instead (--gpu-spin-us). */
    td_gpu_err_t (*lane_launch)(void *lane, const td_gpu_job_t *job, td_gpu_done_fn done,
                                  void *arg);
    /* The same job split into `count` pieces of consecutive elements (each at most the
     * max_batch the lanes were opened with), piece i on lanes[i % lane_count] (lanes[0] is
     * `lane`, the one whose thread calls this and whose slot, carries and small results the job
     * uses; the others are lanes of the same device; pieces on one lane run in its order). Only
     * for a hist, or a scan with job->dst, with job->src set: the pieces read src and write dst
     * directly. The scan's carry chains from piece to piece through lane's carry
     * job->carry_index (each piece's kernel waits for the one before it; the copies do not), the
     * hist's pieces add into one device histogram; done(arg) follows once every piece is
     * complete, in `lane`'s order, so that lane's later jobs see the final carry. Work enqueued
     * on the other lanes runs in their order beside their own jobs. TD_GPU_E_DEVICE when
     * enqueuing failed (then nothing of the job is still running). NULL when the engine cannot
     * split. */
    td_gpu_err_t (*lane_launch_split)(void *lane, void *const *lanes, unsigned lane_count,
                                        unsigned count, const td_gpu_job_t *job,
                                        td_gpu_done_fn done, void *arg);
    /* Whether everything the last successful launch into `slot` enqueued has finished, asked
     * by a spinning lane thread (--gpu-spin-us) so that it sees a completion without waiting
     * for done, whose host function runs only once CUDA's callback thread has woken (done still
     * follows, later). cudaEventQuery of an event recorded before done for cuda, true for sim
     * (done came before the launch returned); false when only done can tell. */
    bool (*lane_finished)(void *lane, unsigned slot);
    /* done(arg) once everything enqueued on the lane so far has finished: the wake-up a polling
     * lane thread asks for before it sleeps (cudaLaunchHostFunc at the stream's tail; the sim
     * calls it at once). Not called when that work fails (the watchdog finds it). */
    td_gpu_err_t (*lane_notify)(void *lane, td_gpu_done_fn done, void *arg);
    /* Asks whether work enqueued earlier failed asynchronously (done will never come):
     * TD_GPU_E_DEVICE then, TD_GPU_OK when it is still running or finished. */
    td_gpu_err_t (*lane_check)(void *lane);
    /* Registers host memory (a shared-memory region) once for direct copies by every device:
     * cudaHostRegister for cuda (read_only: a read-only mapping, which the device only reads),
     * nothing for sim. TD_GPU_E_DEVICE when it cannot. Called on a
     * libuv worker thread (pinning a large region takes milliseconds), never per request. */
    td_gpu_err_t (*region_register)(void *ctx, void *base, size_t size, bool read_only);
    void (*region_unregister)(void *ctx, void *base);
    /* Device regions (PROTOCOL.md §10 "Device memory"). The device's UUID, as cuDeviceGetUuid
     * gives it (sim: "tallyd-sim-gpu", 0, the device number). */
    td_gpu_err_t (*device_uuid)(void *ctx, int device, uint8_t uuid[TALLY_GPU_UUID_SIZE]);
    /* Imports an allocation another process exported as a descriptor (a->fd, a->size bytes: the
     * whole allocation) on a->device, maps it once and gives a->device access to it, read-only
     * unless a->writable; with a->event (TALLY_GPU_EVENT_SIZE bytes) opens that IPC event on
     * a->device (where the streams that wait on it are). Peer access: each of a->peers that the
     * driver says can reach a->device's memory (cudaDeviceCanAccessPeer) is given the same
     * access (cuMemSetAccess) and has the event opened on it too (opened on one device and waited
     * on from another's stream, it segfaults: issue 23); bit i of *peers_mapped says peers[i]
     * can run the region's work, and a peer that fails any of it is simply left out. TD_GPU_OK:
     * *import is what dev_release takes, *ptr the address every one of those devices reads (one
     * address space), and the import owns fd (closed at dev_release: only then can the
     * producer's driver free the memory). TD_GPU_E_CLIENT with why when the client is at fault
     * (not an exported allocation, a wrong size, an event that does not open on a->device),
     * TD_GPU_E_DEVICE for the device's own failure; fd stays the caller's. On a libuv worker
     * thread (an import takes about a millisecond), never per request. NULL: the engine cannot
     * import. */
    td_gpu_err_t (*dev_import)(void *ctx, const td_gpu_import_args_t *a, uint32_t *peers_mapped,
                                 void **import, void **ptr, char *why, size_t why_cap);
    /* Unmaps, releases the imported handle and the events, closes the descriptor. `stale`: the
     * import was made before a device_reset of its device, whose context took the mapping, the
     * handle and its event with it: only the events opened on peers are destroyed and the
     * descriptor closed. Bit i of `stale_peers`: peer i (as in the import's peers) was reset
     * since, and the event opened there went with its context. */
    void (*dev_release)(void *ctx, void *import, bool stale, uint32_t stale_peers);
    /* Recreates `device`'s context after a failure left it unusable (a sticky error), once its
     * lanes are closed and nothing of it is in flight, then checks it works: cudaDeviceReset and
     * a probe for cuda, nothing for sim. TD_GPU_E_DEVICE with why when the device stays unusable.
     * On a libuv worker thread. NULL: the engine cannot. */
    td_gpu_err_t (*device_reset)(void *ctx, int device, char *why, size_t why_cap);
    /* Host memory the devices copy to and from directly (cudaMallocHost for cuda, malloc for
     * sim), allocated at start only: the pipeline's pinned reply buffers. NULL when it cannot. */
    void *(*host_alloc)(void *ctx, int device, size_t size);
    void (*host_free)(void *ctx, void *p);
    /* The last error's description on this thread. */
    const char *(*error_string)(void);
    void (*destroy)(td_gpu_engine_t **self_p);
};

/* An engine's table, its functions named after it: TD_GPU_ENGINE_TABLE(sim) takes
 * sim_device_count, sim_describe, sim_lane_open ... sim_destroy (one per member, in the order
 * above), and the name "sim" (ctx is set at creation). */
#define TD_GPU_ENGINE_TABLE(prefix)                                                                \
    {                                                                                              \
        .name = #prefix, .device_count = prefix##_device_count, .describe = prefix##_describe,     \
        .lane_open = prefix##_lane_open, .lane_close = prefix##_lane_close,                        \
        .lane_bind = prefix##_lane_bind, .lane_launch = prefix##_lane_launch,                      \
        .lane_launch_split = prefix##_lane_launch_split, .lane_finished = prefix##_lane_finished,  \
        .lane_notify = prefix##_lane_notify, .lane_check = prefix##_lane_check,                    \
        .region_register = prefix##_region_register,                                               \
        .region_unregister = prefix##_region_unregister, .device_uuid = prefix##_device_uuid,      \
        .dev_import = prefix##_dev_import, .dev_release = prefix##_dev_release,                    \
        .device_reset = prefix##_device_reset,                                                     \
        .host_alloc = prefix##_host_alloc, .host_free = prefix##_host_free,                        \
        .error_string = prefix##_error_string, .destroy = prefix##_destroy,                        \
    }

/* Simulated devices: host memory and the CPU backend. */
td_gpu_err_t td_gpu_engine_sim_new(unsigned devices, td_gpu_engine_t **out);
/* Faults on command, for the tests (td_gpu_fault.c). */
typedef struct {
    unsigned fail_every;       /* every Nth launch runs, clobbers its carry and fails; 0: none */
    bool oom_at_open;          /* lane_open fails, out of memory, ... */
    unsigned lanes_before_oom; /* ... after this many lanes opened */
    unsigned slow_us;          /* every completion comes this much later */
    /* The sticky_at-th launch (1-based, counted over all lanes; 0: none) loses its device's
     * context, as an illegal address does on a GPU: it never completes, lane_check reports the
     * failure and every later launch on that device fails, until device_reset recreates it
     * (which fails instead with reset_fails). */
    unsigned sticky_at;
    bool reset_fails;
} td_gpu_fault_opts_t;
/* Wraps `inner`, which it owns from here (destroyed with it, or at once on failure). */
td_gpu_err_t td_gpu_engine_fault_new(td_gpu_engine_t *inner, const td_gpu_fault_opts_t *opts,
                                       td_gpu_engine_t **out);
/* CUDA devices; TD_GPU_E_DEVICE with a reason when CUDA is not built in or no GPU is usable. */
td_gpu_err_t td_gpu_engine_cuda_new(td_gpu_engine_t **out, char *why, size_t why_cap);

#endif
