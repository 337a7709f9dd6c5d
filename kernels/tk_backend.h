/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tk_backend.h — the compute backend interface: a table of functions the daemon calls.
 *
 * kernels/ knows nothing about sockets, requests or streams. A backend computes one batch at a
 * time on host memory that the caller owns, synchronously, and returns a tally_status_t. State
 * that outlives a batch (a stream's scan carry and running histogram) is passed in and out
 * explicitly, so the daemon owns it and the backends stay stateless apart from their own
 * resources (the CUDA backend's device buffers).
 *
 * Thread safety: every function may be called from several threads at once with different
 * arguments; a backend that needs exclusive resources serialises internally.
 *
 * The CUDA backend also exposes an asynchronous, device-pointer API (kernels/cuda/tk_cuda.h)
 * that the daemon's GPU pipeline uses directly; this table is the portable synchronous path.
 */
#ifndef TK_BACKEND_H
#define TK_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "tally_proto.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a filter keeps: pred(x) with thresholds lo (and hi for BETWEEN), compared exactly. */
typedef struct {
    tally_pred_t pred;
    int64_t lo;
    int64_t hi;
    int stable; /* non-zero: output keeps input order; zero: any order (the right multiset) */
} tk_filter_spec_t;

/* A running 256-bin histogram, one per channel for colour data (channel c's bin b at
 * bins[c * TALLY_HIST_BINS + b]). Backends ADD into it, so one value serves a single batch
 * (start from zero) and a stream's running histogram alike. */
typedef struct {
    uint64_t bins[TALLY_HIST_VALUES_MAX];
    uint64_t underflow; /* int32, uint16 only: x < lo */
    uint64_t overflow;  /* int32, uint16 only: x >= hi */
} tk_hist_t;

/* What minmax folds into for a batch of its own: nothing seen yet. */
#define TK_MINMAX_EMPTY_MIN INT64_MAX
#define TK_MINMAX_EMPTY_MAX INT64_MIN

typedef struct tk_backend tk_backend_t;
struct tk_backend {
    const char *name; /* "cpu" or "cuda" */
    void *ctx;        /* backend-private state, passed back as the first argument */

    /* Keeps the elements of in[0..n) that satisfy spec; writes them to out (room for n
     * elements) and their number to *kept. dtype is TALLY_DTYPE_I32 or TALLY_DTYPE_U8. */
    tally_status_t (*filter)(void *ctx, tally_dtype_t dtype, const void *in, size_t n,
                             const tk_filter_spec_t *spec, void *out, size_t *kept);

    /* Prefix sums of in[0..n) starting from *carry (the sum of everything before this batch).
     * Inclusive: out[i] = carry + in[0] + ... + in[i]; exclusive: out[i] = carry + in[0] + ...
     * + in[i-1]. out is int64_t[n], or int32_t[n] (the low 32 bits) when out_i32 is set.
     * Arithmetic wraps modulo 2^64. On return *carry = carry + sum(in). */
    tally_status_t (*scan)(void *ctx, const int32_t *in, size_t n, int exclusive, int out_i32,
                           void *out, int64_t *carry);

    /* Adds the byte values of in[0..n) to hist->bins (bin = byte value). */
    tally_status_t (*hist_u8)(void *ctx, const uint8_t *in, size_t n, tk_hist_t *hist);

    /* Adds in[0..n) to hist: x < lo -> underflow, x >= hi -> overflow, else bin
     * tally_hist_bin_i32(x, lo, hi). Requires lo < hi. */
    tally_status_t (*hist_i32)(void *ctx, const int32_t *in, size_t n, int64_t lo, int64_t hi,
                               tk_hist_t *hist);

    /* Adds in[0..n) to hist like hist_i32, for 0 <= lo < hi <= 65536; the bin of an in-range x
     * is tally_hist_bin_u16(x - lo, ...), which equals floor((x - lo) * 256 / (hi - lo)). */
    tally_status_t (*hist_u16)(void *ctx, const uint16_t *in, size_t n, int64_t lo, int64_t hi,
                               tk_hist_t *hist);

    /* Adds `pixels` interleaved pixels of `channels` bytes (3: RGB, 4: RGBA) to hist: byte c of
     * a pixel counts in channel c's bins. */
    tally_status_t (*hist_rgb)(void *ctx, const uint8_t *in, size_t pixels, unsigned channels,
                               tk_hist_t *hist);

    /* Folds in[0..n) (dtype i32, u8 or u16) into *min and *max: each becomes the smaller (the
     * larger) of itself and every element. Start from TK_MINMAX_EMPTY_MIN and _MAX for one
     * batch; an empty batch leaves them as they were. */
    tally_status_t (*minmax)(void *ctx, tally_dtype_t dtype, const void *in, size_t n, int64_t *min,
                             int64_t *max);

    /* One line describing the backend's devices for `info` ("cpu: 16 threads",
     * "cuda: 0:NVIDIA H100 80GB HBM3"). Writes at most cap bytes including the NUL. */
    void (*describe)(void *ctx, char *buf, size_t cap);

    /* Frees the backend; sets *self_p to NULL. */
    void (*destroy)(tk_backend_t **self_p);
};

/* The hist entry of `b` that dtype (u8, i32, u16, rgb8, rgba8) takes, applied to in[0..n). */
static inline tally_status_t tk_backend_hist(tk_backend_t *b, uint8_t dtype, const void *in,
                                             size_t n, int64_t lo, int64_t hi, tk_hist_t *hist)
{
    switch (dtype) {
    case TALLY_DTYPE_U8:
        return b->hist_u8(b->ctx, (const uint8_t *)in, n, hist);
    case TALLY_DTYPE_I32:
        return b->hist_i32(b->ctx, (const int32_t *)in, n, lo, hi, hist);
    case TALLY_DTYPE_U16:
        return b->hist_u16(b->ctx, (const uint16_t *)in, n, lo, hi, hist);
    case TALLY_DTYPE_RGB8:
    case TALLY_DTYPE_RGBA8:
        return b->hist_rgb(b->ctx, (const uint8_t *)in, n, tally_hist_channels(dtype), hist);
    default:
        return TALLY_E_PARAM;
    }
}

/* A backend's table, its functions named after it: TK_BACKEND_TABLE(cpu) takes cpu_filter,
 * cpu_scan, cpu_hist_u8, cpu_hist_i32, cpu_hist_u16, cpu_hist_rgb, cpu_minmax, cpu_describe and
 * cpu_destroy, and the name "cpu" (ctx is set at creation). */
#define TK_BACKEND_TABLE(prefix)                                                                   \
    {                                                                                              \
        .name = #prefix, .filter = prefix##_filter, .scan = prefix##_scan,                         \
        .hist_u8 = prefix##_hist_u8, .hist_i32 = prefix##_hist_i32, .hist_u16 = prefix##_hist_u16, \
        .hist_rgb = prefix##_hist_rgb, .minmax = prefix##_minmax, .describe = prefix##_describe,   \
        .destroy = prefix##_destroy,                                                               \
    }

/* The CPU backend: always available. */
tally_status_t tk_cpu_backend_new(tk_backend_t **out);

/* The GPU is not a table here: the daemon's one GPU interface is its engine table
 * (daemon/gpu/td_gpu_engine.h), whose CUDA engine calls the kernels of cuda/tk_cuda.h. */
/* Number of usable CUDA devices (0 when CUDA is not compiled in or no driver/GPU). */
int tk_cuda_device_count(void);

#ifdef __cplusplus
}
#endif
#endif /* TK_BACKEND_H */
