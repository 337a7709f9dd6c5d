/*
 * cuda_backend.c — the CUDA backend of tk_backend.h: the synchronous, host-memory table built on
 * the asynchronous kernels of tk_cuda.h.
 *
 * Everything a call needs is allocated at creation, sized for max_batch_bytes: device input,
 * output (twice the input, for int64 scan output), the kernels' scratch, a small block for the
 * kept count, scan carry and histogram, and one non-blocking stream. A call takes the backend's
 * mutex (the device buffers are one set), copies its input in, launches, copies the result out
 * and synchronises the stream. Results that the kernels accumulate (scan carry, histogram) are
 * copied to the device first, so the kernels continue from the caller's state exactly as the
 * daemon's pipeline does with state that lives on the device.
 *
 * Errors: every CUDA call is checked; a failure becomes TALLY_E_BACKEND, CUDA's string is kept
 * for tk_cuda_error_string(), the stream is drained and the error cleared, so the next call
 * works (except after a sticky error such as an illegal address, which poisons the CUDA context
 * for the whole process; the kernels are tested under compute-sanitizer so that it does not
 * happen).
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
} small_t;

typedef struct {
    int device;
    size_t max_bytes;
    pthread_mutex_t lock;
    cudaStream_t stream;
    void *d_in;
    void *d_out;
    void *d_scratch;
    size_t scratch_bytes;
    small_t *d_small;
    char describe[300];
} cuda_ctx_t;

/* Drains the stream after a failure and clears the non-sticky error, keeping the first one. */
static tally_status_t fail(cuda_ctx_t *c, cudaError_t err)
{
    tally_status_t st = tk_cuda_status(err);
    (void)cudaStreamSynchronize(c->stream);
    (void)cudaGetLastError();
    return st;
}

/* Runs after a sequence of enqueued steps: waits for the stream and maps its error. */
static tally_status_t finish(cuda_ctx_t *c, tally_status_t st)
{
    cudaError_t err = cudaStreamSynchronize(c->stream);
    if (st != TALLY_OK) {
        (void)cudaGetLastError();
        return st;
    }
    return err == cudaSuccess ? TALLY_OK : fail(c, err);
}

#define TRY(c, call)                                                                               \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            st = fail((c), e_);                                                                    \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

static tally_status_t cuda_filter(void *ctx, tally_dtype_t dtype, const void *in, size_t n,
                                  const tk_filter_spec_t *spec, void *out, size_t *kept)
{
    cuda_ctx_t *c = ctx;
    size_t esize = tally_dtype_size(dtype);
    tally_status_t st = TALLY_OK;
    uint64_t k = 0;
    if (dtype != TALLY_DTYPE_I32 && dtype != TALLY_DTYPE_U8)
        return TALLY_E_DTYPE;
    if (n > c->max_bytes / esize)
        return TALLY_E_TOO_LARGE;
    pthread_mutex_lock(&c->lock);
    TRY(c, cudaSetDevice(c->device));
    if (n)
        TRY(c, cudaMemcpyAsync(c->d_in, in, n * esize, cudaMemcpyHostToDevice, c->stream));
    st = tk_cuda_filter(dtype, c->d_in, n, spec, c->d_out, &c->d_small->kept, c->d_scratch,
                        c->scratch_bytes, c->stream);
    if (st != TALLY_OK) { /* bad arguments: drain what was enqueued */
        (void)cudaStreamSynchronize(c->stream);
        goto out;
    }
    TRY(c, cudaMemcpyAsync(&k, &c->d_small->kept, sizeof k, cudaMemcpyDeviceToHost, c->stream));
    TRY(c, cudaStreamSynchronize(c->stream));
    if (k)
        TRY(c,
            cudaMemcpyAsync(out, c->d_out, (size_t)k * esize, cudaMemcpyDeviceToHost, c->stream));
    st = finish(c, st);
    if (st == TALLY_OK)
        *kept = (size_t)k;
out:
    pthread_mutex_unlock(&c->lock);
    return st;
}

static tally_status_t cuda_scan(void *ctx, const int32_t *in, size_t n, int exclusive, int out_i32,
                                void *out, int64_t *carry)
{
    cuda_ctx_t *c = ctx;
    tally_status_t st = TALLY_OK;
    int64_t cy = *carry;
    if (n > c->max_bytes / 4)
        return TALLY_E_TOO_LARGE;
    pthread_mutex_lock(&c->lock);
    TRY(c, cudaSetDevice(c->device));
    if (n)
        TRY(c, cudaMemcpyAsync(c->d_in, in, n * 4, cudaMemcpyHostToDevice, c->stream));
    TRY(c, cudaMemcpyAsync(&c->d_small->carry, &cy, sizeof cy, cudaMemcpyHostToDevice, c->stream));
    st = tk_cuda_scan(c->d_in, n, exclusive, out_i32, c->d_out, &c->d_small->carry,
                      &c->d_small->carry, c->d_scratch, c->scratch_bytes, c->stream);
    if (st != TALLY_OK) { /* bad arguments: drain what was enqueued */
        (void)cudaStreamSynchronize(c->stream);
        goto out;
    }
    if (n)
        TRY(c, cudaMemcpyAsync(out, c->d_out, n * (out_i32 ? 4 : 8), cudaMemcpyDeviceToHost,
                               c->stream));
    TRY(c, cudaMemcpyAsync(&cy, &c->d_small->carry, sizeof cy, cudaMemcpyDeviceToHost, c->stream));
    st = finish(c, st);
    if (st == TALLY_OK)
        *carry = cy;
out:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Every histogram: the caller's counts go to the device, the kernel adds, they come back. */
static tally_status_t cuda_hist(cuda_ctx_t *c, tally_dtype_t dtype, const void *in, size_t n,
                                int64_t lo, int64_t hi, tk_hist_t *hist)
{
    size_t esize = tally_dtype_size(dtype);
    tally_status_t st = TALLY_OK;
    if (n > c->max_bytes / esize)
        return TALLY_E_TOO_LARGE;
    pthread_mutex_lock(&c->lock);
    TRY(c, cudaSetDevice(c->device));
    if (n)
        TRY(c, cudaMemcpyAsync(c->d_in, in, n * esize, cudaMemcpyHostToDevice, c->stream));
    TRY(c,
        cudaMemcpyAsync(&c->d_small->hist, hist, sizeof *hist, cudaMemcpyHostToDevice, c->stream));
    st = tk_cuda_hist(dtype, c->d_in, n, lo, hi, &c->d_small->hist, c->d_scratch, c->scratch_bytes,
                      c->stream);
    if (st != TALLY_OK) { /* bad arguments: drain what was enqueued */
        (void)cudaStreamSynchronize(c->stream);
        goto out;
    }
    /* The caller's hist is pageable, so this copy completes before the call returns; the
     * stream sync below then reports any error of the kernel. */
    TRY(c,
        cudaMemcpyAsync(hist, &c->d_small->hist, sizeof *hist, cudaMemcpyDeviceToHost, c->stream));
    st = finish(c, st);
out:
    pthread_mutex_unlock(&c->lock);
    return st;
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
    (void)cudaSetDevice(c->device);
    if (c->stream)
        (void)cudaStreamSynchronize(c->stream);
    cudaFree(c->d_in);
    cudaFree(c->d_out);
    cudaFree(c->d_scratch);
    cudaFree(c->d_small);
    if (c->stream)
        cudaStreamDestroy(c->stream);
    (void)cudaGetLastError();
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

tally_status_t tk_cuda_backend_new(int device, size_t max_batch_bytes, tk_backend_t **out,
                                   char *msg, size_t msg_cap)
{
    tk_backend_t *b = NULL;
    cuda_ctx_t *c = NULL;
    struct cudaDeviceProp prop;
    cudaError_t err = cudaSuccess;
    const char *step = "";
    int count = tk_cuda_device_count();

    *out = NULL;
    if (device < 0 || device >= count) {
        if (msg && msg_cap)
            snprintf(msg, msg_cap, "no usable CUDA device %d (%d found)", device, count);
        return TALLY_E_BACKEND;
    }
    if (max_batch_bytes < 16)
        max_batch_bytes = 16;
    b = calloc(1, sizeof *b);
    c = calloc(1, sizeof *c);
    if (!b || !c) {
        free(b);
        free(c);
        if (msg && msg_cap)
            snprintf(msg, msg_cap, "out of memory");
        return TALLY_E_INTERNAL;
    }
    c->device = device;
    c->max_bytes = max_batch_bytes;
    c->scratch_bytes = tk_cuda_scratch_bytes_max(max_batch_bytes);
    pthread_mutex_init(&c->lock, NULL);

#define STEP(what, call)                                                                           \
    do {                                                                                           \
        step = (what);                                                                             \
        if ((err = (call)) != cudaSuccess)                                                         \
            goto fail;                                                                             \
    } while (0)
    STEP("cudaSetDevice", cudaSetDevice(device));
    STEP("cudaGetDeviceProperties", cudaGetDeviceProperties(&prop, device));
    STEP("cudaStreamCreate", cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    STEP("cudaMalloc(input)", cudaMalloc(&c->d_in, max_batch_bytes));
    STEP("cudaMalloc(output)", cudaMalloc(&c->d_out, 2 * max_batch_bytes));
    if (c->scratch_bytes)
        STEP("cudaMalloc(scratch)", cudaMalloc(&c->d_scratch, c->scratch_bytes));
    STEP("cudaMalloc(small)", cudaMalloc((void **)&c->d_small, sizeof(small_t)));
#undef STEP

    snprintf(c->describe, sizeof c->describe, "cuda: %d:%s", device, prop.name);
    b->name = "cuda";
    b->ctx = c;
    b->filter = cuda_filter;
    b->scan = cuda_scan;
    b->hist_u8 = cuda_hist_u8;
    b->hist_i32 = cuda_hist_i32;
    b->hist_u16 = cuda_hist_u16;
    b->hist_rgb = cuda_hist_rgb;
    b->describe = cuda_describe;
    b->destroy = cuda_destroy;
    *out = b;
    return TALLY_OK;

fail:
    if (msg && msg_cap)
        snprintf(msg, msg_cap, "CUDA device %d: %s failed: %s", device, step,
                 cudaGetErrorString(err));
    (void)tk_cuda_status(err);
    free_ctx(c);
    free(b);
    return TALLY_E_BACKEND;
}
