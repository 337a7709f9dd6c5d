/*
 * td_gpu_engine.h — what the GPU pipeline (td_gpu.c) needs from a device, as a table.
 *
 * The pipeline (lanes, staging slots, lane threads, in-order completion, failure handling)
 * is the same whatever runs the batches, so the device sits behind this small table with two
 * implementations:
 *   - cuda (td_gpu_cuda.c, built with TALLY_HAVE_CUDA): a lane is one CUDA stream with its own
 *     device buffers; a launch is H2D copy -> kernel -> D2H copies -> cudaLaunchHostFunc, all
 *     asynchronous on that stream, from pinned staging.
 *   - sim (td_gpu_sim.c, always built): a lane is host memory and the CPU backend, completing
 *     inside the launch. It exists so that the CPU build and CI test the pipeline itself —
 *     ordering on a lane, the scan carry chained in "device" memory, the fallback after a
 *     failure, a device marked unusable — with `--test-sim-gpus N`.
 *
 * A lane owns, allocated once at lane_open: `slots` staging buffers on the host (pinned for
 * cuda) that the pipeline fills and reads, device buffers for one batch at a time (input,
 * output, kernel scratch, small results) and `carries` device int64 scan carries that the
 * pipeline hands out to named streams (index 0 is kept for requests without a stream).
 * Nothing is allocated after lane_open.
 */
#ifndef TD_GPU_ENGINE_H
#define TD_GPU_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tally_proto.h"
#include "tk_backend.h"

/* The small results of one batch, next to its staging buffers. */
typedef struct {
    uint64_t kept;  /* filter */
    int64_t carry;  /* scan: in, the host carry to upload (carry_upload); out, the carry after */
    tk_hist_t hist; /* hist: this batch's histogram */
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
    bool fault;            /* test only: clobber the device carry; the pipeline then fails it */
    unsigned slot;
    const void *src; /* registered input, or NULL */
    void *dst;       /* registered output (at least the operation's worst case), or NULL */
} td_gpu_job_t;

/* Called once per successful launch when its results are in the staging slot, from any
 * thread (CUDA's callback thread for cuda); it must not call CUDA. */
typedef void (*td_gpu_done_fn)(void *arg);

typedef struct td_gpu_engine td_gpu_engine_t;
struct td_gpu_engine {
    const char *name; /* "cuda" or "sim" */
    void *ctx;
    int (*device_count)(void *ctx);
    /* "NVIDIA H100 80GB HBM3" */
    void (*describe)(void *ctx, int device, char *buf, size_t cap);
    /* Allocates a lane's device buffers and staging[0..slots) on `device`. *device_bytes
     * receives the device memory it took. On failure, why says what failed. */
    tally_status_t (*lane_open)(void *ctx, int device, size_t max_batch, unsigned slots,
                                unsigned carries, void **lane, td_gpu_staging_t *staging,
                                uint64_t *device_bytes, char *why, size_t why_cap);
    /* Waits for the lane's work and frees everything lane_open allocated. */
    void (*lane_close)(void *lane);
    /* The functions below run on the lane's own thread. */
    tally_status_t (*lane_bind)(void *lane); /* once, when the thread starts */
    /* Enqueues the job; done(arg) follows when it succeeded. TALLY_E_BACKEND when enqueuing
     * failed (then done is not called and nothing of the job is still running). */
    tally_status_t (*lane_launch)(void *lane, const td_gpu_job_t *job, td_gpu_done_fn done,
                                  void *arg);
    /* Asks whether work enqueued earlier failed asynchronously (done will never come):
     * TALLY_E_BACKEND then, TALLY_OK when it is still running or finished. */
    tally_status_t (*lane_check)(void *lane);
    /* Registers host memory (a shared-memory region) once for direct copies by every device:
     * cudaHostRegister for cuda (read_only: a read-only mapping, which the device only reads),
     * nothing for sim. TALLY_E_BACKEND when it cannot. Called on the
     * loop thread, never per request. */
    tally_status_t (*region_register)(void *ctx, void *base, size_t size, bool read_only);
    void (*region_unregister)(void *ctx, void *base);
    /* The last error's description on this thread. */
    const char *(*error_string)(void);
    void (*destroy)(td_gpu_engine_t **self_p);
};

/* Simulated devices: host memory and the CPU backend. */
tally_status_t td_gpu_engine_sim_new(unsigned devices, td_gpu_engine_t **out);
/* CUDA devices; TALLY_E_BACKEND with a reason when CUDA is not built in or no GPU is usable. */
tally_status_t td_gpu_engine_cuda_new(td_gpu_engine_t **out, char *why, size_t why_cap);

#endif
