/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cuda_backend.c — the CUDA backend of tk_backend.h: the synchronous, host-memory table built on
 * the asynchronous kernels of tk_cuda.h.
 *
 * Everything a call needs is allocated at creation, sized for max_batch_bytes (tk_cuda_buffers_t:
 * device input, output, the kernels' scratch, a small block for the kept count, scan carry and
 * histogram, and one non-blocking stream). A call takes the backend's
 * mutex (the device buffers are one set), copies its input in, launches, copies the result out
 * and synchronises the stream. Results that the kernels accumulate (scan carry, histogram) are
 * copied to the device first, so the kernels continue from the caller's state exactly as the
 * daemon's pipeline does with state that lives on the device.
 *
 * Errors: every CUDA call is checked; a failure becomes TALLY_E_BACKEND, CUDA's string is kept
 * for tk_cuda_error_string(), the stream is drained and the error cleared (tk_cuda_drain), so
 * the next call works (except after a sticky error such as an illegal address, which poisons the
 * CUDA context for the whole process; the kernels are tested under compute-sanitizer so that it
 * does not happen).
 *
 * This is plain C that includes tk_cuda.h: it also proves that header works for C callers.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "tk_backend.h"
#include "tk_cuda.h"

/* Small per-call values, on the device and read back together. */
typedef struct {
    uint64_t kept;
    int64_t carry;
    tk_hist_t hist;
    int64_t minmax[2];
} small_t;

typedef struct {
    size_t max_bytes;
    pthread_mutex_t lock;
    tk_cuda_buffers_t buf; /* buf.d_small: a small_t */
    char describe[300];
} cuda_ctx_t;

/* Starts a call: takes the lock (the device buffers are one set), makes the device current and
 * enqueues the copy of `bytes` of input. Whatever it returns, call_end follows. */
static tally_status_t call_begin(cuda_ctx_t *c, const void *in, size_t bytes)
{
    tally_status_t st = TALLY_OK;
    pthread_mutex_lock(&c->lock);
    TK_CUDA_TRY(cudaSetDevice(c->buf.device));
    if (bytes)
        TK_CUDA_TRY(cudaMemcpyAsync(c->buf.d_in, in, bytes, cudaMemcpyHostToDevice, c->buf.stream));
fail:
    return st;
}

/* Ends a call whose steps so far returned st: waits for the stream (its error is the call's if
 * none came before), drains it after any failure, and lets the next call in. */
static tally_status_t call_end(cuda_ctx_t *c, tally_status_t st)
{
    cudaError_t err = cudaStreamSynchronize(c->buf.stream);
    if (st == TALLY_OK)
        st = tk_cuda_status(err);
    if (st != TALLY_OK)
        tk_cuda_drain(c->buf.stream);
    pthread_mutex_unlock(&c->lock);
    return st;
}

static tally_status_t cuda_filter(void *ctx, tally_dtype_t dtype, const void *in, size_t n,
                                  const tk_filter_spec_t *spec, void *out, size_t *kept)
{
    cuda_ctx_t *c = ctx;
    small_t *d_small = c->buf.d_small;
    size_t esize = tally_dtype_size(dtype);
    uint64_t k = 0;
    if (dtype != TALLY_DTYPE_I32 && dtype != TALLY_DTYPE_U8)
        return TALLY_E_DTYPE;
    if (n > c->max_bytes / esize)
        return TALLY_E_TOO_LARGE;
    tally_status_t st = call_begin(c, in, n * esize);
    if (st != TALLY_OK)
        goto fail;
    st = tk_cuda_filter(dtype, c->buf.d_in, n, spec, c->buf.d_out, &d_small->kept, c->buf.d_scratch,
                        c->buf.scratch_bytes, c->buf.stream);
    if (st != TALLY_OK) /* bad arguments */
        goto fail;
    /* The count first, so only the kept elements come back. */
    TK_CUDA_TRY(
        cudaMemcpyAsync(&k, &d_small->kept, sizeof k, cudaMemcpyDeviceToHost, c->buf.stream));
    TK_CUDA_TRY(cudaStreamSynchronize(c->buf.stream));
    if (k)
        TK_CUDA_TRY(cudaMemcpyAsync(out, c->buf.d_out, (size_t)k * esize, cudaMemcpyDeviceToHost,
                                    c->buf.stream));
fail:
    st = call_end(c, st);
    if (st == TALLY_OK)
        *kept = (size_t)k;
    return st;
}

static tally_status_t cuda_scan(void *ctx, const int32_t *in, size_t n, int exclusive, int out_i32,
                                void *out, int64_t *carry)
{
    cuda_ctx_t *c = ctx;
    small_t *d_small = c->buf.d_small;
    int64_t cy = *carry;
    if (n > c->max_bytes / 4)
        return TALLY_E_TOO_LARGE;
    tally_status_t st = call_begin(c, in, n * 4);
    if (st != TALLY_OK)
        goto fail;
    TK_CUDA_TRY(
        cudaMemcpyAsync(&d_small->carry, &cy, sizeof cy, cudaMemcpyHostToDevice, c->buf.stream));
    st = tk_cuda_scan(c->buf.d_in, n, exclusive, out_i32, c->buf.d_out, &d_small->carry,
                      &d_small->carry, c->buf.d_scratch, c->buf.scratch_bytes, c->buf.stream);
    if (st != TALLY_OK) /* bad arguments */
        goto fail;
    if (n)
        TK_CUDA_TRY(cudaMemcpyAsync(out, c->buf.d_out, n * (out_i32 ? 4 : 8),
                                    cudaMemcpyDeviceToHost, c->buf.stream));
    TK_CUDA_TRY(
        cudaMemcpyAsync(&cy, &d_small->carry, sizeof cy, cudaMemcpyDeviceToHost, c->buf.stream));
fail:
    st = call_end(c, st);
    if (st == TALLY_OK)
        *carry = cy;
    return st;
}

/* Every histogram: the caller's counts go to the device, the kernel adds, they come back. */
static tally_status_t cuda_hist(cuda_ctx_t *c, tally_dtype_t dtype, const void *in, size_t n,
                                int64_t lo, int64_t hi, tk_hist_t *hist)
{
    small_t *d_small = c->buf.d_small;
    if (n > c->max_bytes / tally_dtype_size(dtype))
        return TALLY_E_TOO_LARGE;
    tally_status_t st = call_begin(c, in, n * tally_dtype_size(dtype));
    if (st != TALLY_OK)
        goto fail;
    TK_CUDA_TRY(
        cudaMemcpyAsync(&d_small->hist, hist, sizeof *hist, cudaMemcpyHostToDevice, c->buf.stream));
    st = tk_cuda_hist(dtype, c->buf.d_in, n, lo, hi, &d_small->hist, c->buf.d_scratch,
                      c->buf.scratch_bytes, c->buf.stream);
    if (st != TALLY_OK) /* bad arguments */
        goto fail;
    /* The caller's hist is pageable, so this copy completes before the call returns; the
     * stream sync in call_end then reports any error of the kernel. */
    TK_CUDA_TRY(
        cudaMemcpyAsync(hist, &d_small->hist, sizeof *hist, cudaMemcpyDeviceToHost, c->buf.stream));
fail:
    return call_end(c, st);
}

static tally_status_t cuda_hist_u8(void *ctx, const uint8_t *in, size_t n, tk_hist_t *hist)
{
    return cuda_hist(ctx, TALLY_DTYPE_U8, in, n, 0, 0, hist);
}

static tally_status_t cuda_hist_i32(void *ctx, const int32_t *in, size_t n, int64_t lo, int64_t hi,
                                    tk_hist_t *hist)
{
    return cuda_hist(ctx, TALLY_DTYPE_I32, in, n, lo, hi, hist);
}

static tally_status_t cuda_hist_u16(void *ctx, const uint16_t *in, size_t n, int64_t lo, int64_t hi,
                                    tk_hist_t *hist)
{
    return cuda_hist(ctx, TALLY_DTYPE_U16, in, n, lo, hi, hist);
}

static tally_status_t cuda_hist_rgb(void *ctx, const uint8_t *in, size_t pixels, unsigned channels,
                                    tk_hist_t *hist)
{
    if (channels != 3 && channels != 4)
        return TALLY_E_PARAM;
    return cuda_hist(ctx, channels == 3 ? TALLY_DTYPE_RGB8 : TALLY_DTYPE_RGBA8, in, pixels, 0, 0,
                     hist);
}

/* The caller's min and max go to the device, the kernel folds the batch in, they come back. */
static tally_status_t cuda_minmax(void *ctx, tally_dtype_t dtype, const void *in, size_t n,
                                  int64_t *min, int64_t *max)
{
    cuda_ctx_t *c = ctx;
    small_t *d_small = c->buf.d_small;
    size_t esize = tally_dtype_size(dtype);
    int64_t pair[2] = {*min, *max};
    if (esize == 0)
        return TALLY_E_PARAM;
    if (n > c->max_bytes / esize)
        return TALLY_E_TOO_LARGE;
    tally_status_t st = call_begin(c, in, n * esize);
    if (st != TALLY_OK)
        goto fail;
    TK_CUDA_TRY(
        cudaMemcpyAsync(d_small->minmax, pair, sizeof pair, cudaMemcpyHostToDevice, c->buf.stream));
    st = tk_cuda_minmax(dtype, c->buf.d_in, n, d_small->minmax, c->buf.stream);
    if (st != TALLY_OK) /* bad arguments */
        goto fail;
    TK_CUDA_TRY(
        cudaMemcpyAsync(pair, d_small->minmax, sizeof pair, cudaMemcpyDeviceToHost, c->buf.stream));
fail:
    st = call_end(c, st);
    if (st == TALLY_OK) {
        *min = pair[0];
        *max = pair[1];
    }
    return st;
}

static void cuda_describe(void *ctx, char *buf, size_t cap)
{
    cuda_ctx_t *c = ctx;
    if (cap)
        snprintf(buf, cap, "%s", c->describe);
}

static void free_ctx(cuda_ctx_t *c)
{
    if (!c)
        return;
    tk_cuda_buffers_close(&c->buf);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

static void cuda_destroy(tk_backend_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    free_ctx((*self_p)->ctx);
    free(*self_p);
    *self_p = NULL;
}

int tk_cuda_device_count(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return count;
}

static const tk_backend_t cuda_table = TK_BACKEND_TABLE(cuda);

tally_status_t tk_cuda_backend_new(int device, size_t max_batch_bytes, tk_backend_t **out,
                                   char *msg, size_t msg_cap)
{
    int count = tk_cuda_device_count();
    *out = NULL;
    if (device < 0 || device >= count) {
        if (msg && msg_cap)
            snprintf(msg, msg_cap, "no usable CUDA device %d (%d found)", device, count);
        return TALLY_E_BACKEND;
    }
    if (max_batch_bytes < 16)
        max_batch_bytes = 16;
    tk_backend_t *b = calloc(1, sizeof *b);
    cuda_ctx_t *c = calloc(1, sizeof *c);
    if (!b || !c) {
        free(b);
        free(c);
        if (msg && msg_cap)
            snprintf(msg, msg_cap, "out of memory");
        return TALLY_E_INTERNAL;
    }
    c->max_bytes = max_batch_bytes;
    pthread_mutex_init(&c->lock, NULL);
    struct cudaDeviceProp prop;
    if (tk_cuda_buffers_open(&c->buf, device, max_batch_bytes, sizeof(small_t), msg, msg_cap) !=
            TALLY_OK ||
        !tk_cuda_setup_step(cudaGetDeviceProperties(&prop, device), device,
                            "cudaGetDeviceProperties", msg, msg_cap)) {
        free_ctx(c);
        free(b);
        return TALLY_E_BACKEND;
    }
    snprintf(c->describe, sizeof c->describe, "cuda: %d:%s", device, prop.name);
    *b = cuda_table;
    b->ctx = c;
    *out = b;
    return TALLY_OK;
}
