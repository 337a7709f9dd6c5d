/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tk_cuda.h — tallyd's CUDA kernels as an asynchronous, device-pointer C API.
 *
 * This is what the daemon's GPU pipeline calls directly: it owns pinned staging, device buffers,
 * streams and per-stream state, and chains H2D copy -> kernel -> D2H copy on one cudaStream_t.
 * (It is the only way to the kernels: there is no synchronous CUDA backend table.)
 *
 * Rules every function here keeps:
 *   - It only enqueues work on `stream`: it never allocates, never synchronises the device or
 *     the stream, and never reads or writes device memory from the host. Results (kept count,
 *     scan carry, histogram) stay on the device until the caller copies them.
 *   - Device scratch comes from the caller. Ask the matching *_scratch_bytes(n, ...) function
 *     for its size (it may be 0; then d_scratch may be NULL); it must be 16-byte aligned (any
 *     cudaMalloc'd pointer is). The scratch is (re)initialised by a kernel on `stream` at every
 *     call, so one scratch buffer serves any number of calls on that stream, in order. Two calls
 *     in flight at once (different streams) need different scratch buffers.
 *   - Inputs and outputs of any alignment are accepted (element alignment is required); 16-byte
 *     aligned pointers take the fast vectorised path.
 *   - Returns TALLY_OK, TALLY_E_PARAM for arguments the kernels cannot take (unknown dtype or
 *     predicate, hist range outside [INT32_MIN, INT32_MAX + 1) or empty, scratch too small or
 *     misaligned, NULL device pointers with n > 0), or TALLY_E_BACKEND when a launch failed
 *     (cudaGetLastError is checked after every launch). On TALLY_E_BACKEND,
 *     tk_cuda_error_string() gives CUDA's description of the error on this thread.
 *
 * The device must be the current device of the calling thread (cudaSetDevice) and all pointers
 * must belong to it.
 */
#ifndef TK_CUDA_H
#define TK_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "tally_proto.h"
#include "tk_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- filter ---------------------------------------------------------------------------------
 * Keeps the elements of d_in[0..n) (int32 or uint8 per dtype) that satisfy spec (exact integer
 * comparisons, as tk_backend.h), writing them to d_out (room for n elements) and their number
 * to *d_kept (a device uint64). spec->stable selects the mode: stable keeps input order
 * (single-pass decoupled look-back compaction); unordered gives the same multiset in any order
 * (one global atomic per block tile) and is the faster one. d_in and d_out must not overlap. */
size_t tk_cuda_filter_scratch_bytes(tally_dtype_t dtype, size_t n, int stable);
tally_status_t tk_cuda_filter(tally_dtype_t dtype, const void *d_in, size_t n,
                              const tk_filter_spec_t *spec, void *d_out, uint64_t *d_kept,
                              void *d_scratch, size_t scratch_bytes, cudaStream_t stream);

/* ---- scan -----------------------------------------------------------------------------------
 * Prefix sums of d_in[0..n) starting from *d_carry_in (a device int64: the sum of everything
 * before this batch, e.g. a stream's running total). Inclusive: out[i] = carry + in[0..i];
 * exclusive: out[i] = carry + in[0..i-1]. d_out is int64_t[n], or int32_t[n] (the low 32 bits,
 * wrapping) when out_i32 is set. Arithmetic wraps modulo 2^64. *d_carry_out (a device int64)
 * receives carry + sum(in); d_carry_out may equal d_carry_in, so a stream's running total can be
 * updated in place without a host round trip. d_in and d_out must not overlap. */
size_t tk_cuda_scan_scratch_bytes(size_t n);
tally_status_t tk_cuda_scan(const int32_t *d_in, size_t n, int exclusive, int out_i32, void *d_out,
                            const int64_t *d_carry_in, int64_t *d_carry_out, void *d_scratch,
                            size_t scratch_bytes, cudaStream_t stream);

/* ---- histogram ------------------------------------------------------------------------------
 * All ADD into *d_hist, a tk_hist_t in device memory (uint64 bins, then underflow and
 * overflow), so it can be a stream's running histogram; zero it once to start a fresh one.
 * hist_u8: bin = byte value; underflow/overflow untouched.
 * hist_i32: x < lo -> underflow, x >= hi -> overflow, else bin tally_hist_bin_i32(x, lo, hi),
 * exactly (see tk_cuda_hist.cu for the proof); needs INT32_MIN <= lo < hi <= INT32_MAX + 1. */
size_t tk_cuda_hist_u8_scratch_bytes(size_t n);
tally_status_t tk_cuda_hist_u8(const uint8_t *d_in, size_t n, tk_hist_t *d_hist, void *d_scratch,
                               size_t scratch_bytes, cudaStream_t stream);
size_t tk_cuda_hist_i32_scratch_bytes(size_t n);
tally_status_t tk_cuda_hist_i32(const int32_t *d_in, size_t n, int64_t lo, int64_t hi,
                                tk_hist_t *d_hist, void *d_scratch, size_t scratch_bytes,
                                cudaStream_t stream);

/* hist_u16: like hist_i32 for uint16 values and 0 <= lo < hi <= 65536, the bin of an in-range
 * x being tally_hist_bin_u16 (= floor((x - lo) * 256 / (hi - lo))).
 * hist_rgb: `pixels` interleaved pixels of `channels` (3 or 4) bytes, any alignment; byte c of a
 * pixel counts in bins[c * 256 + byte]. The sub-histogram layout is the tuning row's
 * (rgb_layout, below). */
size_t tk_cuda_hist_u16_scratch_bytes(size_t n);
tally_status_t tk_cuda_hist_u16(const uint16_t *d_in, size_t n, int64_t lo, int64_t hi,
                                tk_hist_t *d_hist, void *d_scratch, size_t scratch_bytes,
                                cudaStream_t stream);
size_t tk_cuda_hist_rgb_scratch_bytes(size_t n);
tally_status_t tk_cuda_hist_rgb(const uint8_t *d_in, size_t pixels, unsigned channels,
                                tk_hist_t *d_hist, void *d_scratch, size_t scratch_bytes,
                                cudaStream_t stream);

/* The histogram of dtype (u8, i32, u16, rgb8, rgba8; n elements, pixels for colour), with
 * the function above that takes it. */
tally_status_t tk_cuda_hist(uint8_t dtype, const void *d_in, size_t n, int64_t lo, int64_t hi,
                            tk_hist_t *d_hist, void *d_scratch, size_t scratch_bytes,
                            cudaStream_t stream);

/* ---- minmax --------------------------------------------------------------------------------- */

/* Folds the n elements of d_in (dtype i32, u8 or u16) into d_minmax[0] (the smallest) and
 * d_minmax[1] (the largest), on the device, in stream order; tk_cuda_minmax_reset first sets
 * them to TK_MINMAX_EMPTY_MIN and _MAX (what an empty batch leaves). No scratch. */
tally_status_t tk_cuda_minmax_reset(int64_t *d_minmax, cudaStream_t stream);
tally_status_t tk_cuda_minmax(uint8_t dtype, const void *d_in, size_t n, int64_t *d_minmax,
                              cudaStream_t stream);

/* ---- tuning ---------------------------------------------------------------------------------
 * The kernels' launch shapes are one row of a table (tk_cuda_tuning.cu), as CUB keeps a policy
 * per architecture: a row per SM architecture and memory-bandwidth class, each chosen by
 * measurement and written beside it. The row for a device is selected from its properties
 * (compute capability, peak memory bandwidth = 2 x memory clock x bus width) the first time it is
 * needed on that device (tk_cuda_buffers_open asks, so tallyd selects at start-up), and kept.
 *
 * The test switch: the environment variable TALLY_CUDA_TUNING=NAME (read when a device's row is
 * selected) selects row NAME on every device instead, so each architecture's row runs on whatever
 * GPU the tests have; an unknown NAME fails tk_cuda_tuning_select (and so tallyd's GPU start-up)
 * and every kernel call with TALLY_E_PARAM. tk_cuda_tuning_use does the same from code (the kernel
 * test and benchmark). */
enum {
    TK_RGB_PACKED = 1, /* 32 copies (one per lane) of 16-bit counters, flushed before they wrap */
    TK_RGB_COPIES16 = 16, /* 16 copies of 32-bit counters (lanes l and l + 16 share one) */
    TK_RGB_COPIES32 = 32  /* 32 copies of 32-bit counters */
};
enum {
    TK_SCAN_V8 = 0,       /* 8 vectors a lane (8192-element tiles), run offsets kept in registers */
    TK_SCAN_V8_LEAN = 1,  /* 8 vectors, offsets recomputed after the look-back (fewer registers) */
    TK_SCAN_V12_LEAN = 2, /* 12 vectors (12288-element tiles), offsets recomputed */
    TK_SCAN_V16_LEAN = 3, /* 16 vectors (16384-element tiles), offsets recomputed */
    /* int32 output with one block an SM more than V12 / V16 lean (registers capped to fit, a few
     * spilled); int64 output, which cannot fit it, runs as V12 / V16 lean: */
    TK_SCAN_V12_LEAN_B4 = 4, /* 12 vectors, 4 blocks an SM */
    TK_SCAN_V16_LEAN_B3 = 5, /* 16 vectors, 3 blocks an SM */
    TK_SCAN_SHAPES = 6
};
typedef struct {
    const char *name;
    int sm_major;           /* the row suits devices of this compute capability major (0: any) */
    unsigned min_peak_gbps; /* ... whose peak memory bandwidth is at least this (GB/s) */
    /* histograms of u8, i32 and u16: resident blocks per SM of the persistent grid (1..4) */
    unsigned hist_blocks_per_sm;
    /* colour histograms: TK_RGB_*, and resident blocks per SM (at most what fits) */
    unsigned rgb_layout;
    unsigned rgb_blocks_per_sm;
    /* TK_RGB_PACKED: grid-stride steps between two flushes of the 16-bit counters (0: the most
     * that cannot wrap; the tests use 1 to run the flush often) */
    unsigned rgb_flush_steps;
    /* scan: TK_SCAN_* for int64 and for int32 output, and how many tiles ahead each tile of
     * the lean shapes prefetches its input into L2 (0: no prefetch) */
    unsigned scan_shape;
    unsigned scan_shape_i32;
    unsigned scan_prefetch_tiles;
    /* minmax: resident blocks per SM, 16-byte loads in flight per thread (1 or 4) */
    unsigned minmax_blocks_per_sm;
    unsigned minmax_unroll;
} tk_cuda_tuning_t;

/* The table: row i (NULL past the last), and how many. */
unsigned tk_cuda_tuning_rows(void);
const tk_cuda_tuning_t *tk_cuda_tuning_row(unsigned i);
/* The row named `name`, or NULL. */
const tk_cuda_tuning_t *tk_cuda_tuning_find(const char *name);
/* The first row that suits a device of compute capability major sm_major and peak memory
 * bandwidth peak_gbps (GB/s; 0 when unknown): the selection without the switch. */
const tk_cuda_tuning_t *tk_cuda_tuning_suited(int sm_major, unsigned peak_gbps);
/* The row the kernels use on `device` (TALLY_CUDA_TUNING's, else the first row that suits it),
 * into *row; TALLY_E_PARAM (and *row NULL) when TALLY_CUDA_TUNING names no row, TALLY_E_BACKEND
 * when the device's properties cannot be read. */
tally_status_t tk_cuda_tuning_select(int device, const tk_cuda_tuning_t **row);
/* From now on every device uses a copy of *t (NULL: back to the selection above), for tests and
 * benchmarks; call it while no kernel is being launched. TALLY_E_PARAM for fields outside what
 * the kernels were built for. */
tally_status_t tk_cuda_tuning_use(const tk_cuda_tuning_t *t);

/* ---- helpers --------------------------------------------------------------------------------- */

/* The largest scratch any operation needs for a batch of at most max_batch_bytes, so a pipeline
 * can allocate one scratch buffer per CUDA stream at start. */
size_t tk_cuda_scratch_bytes_max(size_t max_batch_bytes);

/* Maps a CUDA error to TALLY_OK (cudaSuccess) or TALLY_E_BACKEND, recording it for
 * tk_cuda_error_string(): the one place CUDA errors become tally statuses, for the pipeline's
 * own copies and synchronisations as for the launches here. */
tally_status_t tk_cuda_status(cudaError_t err);

/* CUDA's description of the last error a tk_cuda_* function on this thread returned
 * TALLY_E_BACKEND for ("no error" if none). */
const char *tk_cuda_error_string(void);

/* ---- host side: what every caller of the functions above needs ----------------------------
 * The one layer of CUDA host code: the daemon's GPU lanes (daemon/gpu/td_gpu_cuda.c) build on it
 * (tk_cuda_buffers.c). */

/* The device buffers for one batch at a time on one CUDA stream, allocated once for batches of
 * at most max_batch bytes: a non-blocking stream, input (max_batch bytes), output (2 x
 * max_batch: an int64 scan of int32 input doubles), the kernels' scratch
 * (tk_cuda_scratch_bytes_max) and small_bytes for the caller's small results (kept count,
 * carry, histogram). One set is enough for work that runs in stream order: the next batch's
 * input copy only runs after this batch's output copy. */
typedef struct {
    int device;
    cudaStream_t stream;
    void *d_in;
    void *d_out;
    void *d_scratch;
    size_t scratch_bytes;
    void *d_small;
    size_t device_bytes; /* what open allocated on the device */
} tk_cuda_buffers_t;

/* Makes `device` current on this thread and allocates. On failure it frees what it took, says
 * which step failed in why (as tk_cuda_setup_step) and returns TALLY_E_BACKEND. */
tally_status_t tk_cuda_buffers_open(tk_cuda_buffers_t *b, int device, size_t max_batch,
                                    size_t small_bytes, char *why, size_t why_cap);
/* Waits for the stream and frees everything open allocated (what a failed open left too). */
void tk_cuda_buffers_close(tk_cuda_buffers_t *b);

/* One step of a setup (an allocation, a stream, an event): true when err is cudaSuccess; else
 * false, err recorded (tk_cuda_status), and why (may be NULL) says
 * "CUDA device D: WHAT failed: CUDA's words". */
bool tk_cuda_setup_step(cudaError_t err, int device, const char *what, char *why, size_t why_cap);

/* After a failure on `stream`: waits for what it still runs (so no copy reads the caller's
 * buffers any more) and clears the error if it is not sticky. The first error stays recorded
 * for tk_cuda_error_string(). */
void tk_cuda_drain(cudaStream_t stream);

/* The device's name ("NVIDIA H100 80GB HBM3"), or "CUDA device N" when it cannot be read. */
void tk_cuda_device_name(int device, char *buf, size_t cap);

/* In a function with a tally_status_t st and a `fail:` label: runs a CUDA call, and goes to
 * fail with st = TALLY_E_BACKEND (the error recorded) when it failed. */
#define TK_CUDA_TRY(call)                                                                          \
    do {                                                                                           \
        if ((st = tk_cuda_status(call)) != TALLY_OK)                                               \
            goto fail;                                                                             \
    } while (0)

#ifdef __cplusplus
}
#endif
#endif /* TK_CUDA_H */
