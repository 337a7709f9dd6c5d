/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tk_cuda_minmax.cu — the smallest and largest element of an int32, uint8 or uint16 batch,
 * folded into a device pair int64 d_minmax[2] (tk_cuda.h).
 *
 * A persistent grid (the tuning row's blocks per SM, fewer for small inputs) strides over the
 * 16-byte-aligned body of the input in 16-byte vectors, the row's number of loads in flight per
 * thread (block 0 also takes the few elements at either end, as the histogram does); each thread
 * keeps its min and max in registers as int (every one of these types fits), a warp reduces them
 * with __shfl_xor_sync, the warps of a block through shared memory, and thread 0 folds the block's
 * pair into d_minmax with one 64-bit atomicMin and one atomicMax. Min and max are exact and
 * order-free, so the result does not depend on the grid or the order the blocks finish in;
 * tests/test_differential.c checks it against the CPU backend on the GPU (scripts/gpu-check.sh).
 */
#include <limits.h>

#include "tk_cuda_internal.cuh"

__global__ void tk_minmax_reset_kernel(long long *d_minmax)
{
    d_minmax[0] = TK_MINMAX_EMPTY_MIN;
    d_minmax[1] = TK_MINMAX_EMPTY_MAX;
}

static __device__ __forceinline__ void fold(int x, int &lo, int &hi)
{
    lo = min(lo, x);
    hi = max(hi, x);
}

/* The elements of one 16-byte vector. */
template <typename T>
static __device__ __forceinline__ void fold_vector(const uint4 &v, int &lo, int &hi)
{
    const T *e = reinterpret_cast<const T *>(&v);
#pragma unroll
    for (unsigned k = 0; k < 16 / sizeof(T); k++)
        fold((int)e[k], lo, hi);
}

/* Blocks stride over the 16-byte-aligned body of the input in vectors, UNROLL loads in flight;
 * block 0 also folds the few elements before it (`head`) and after it. */
template <typename T, int UNROLL>
__global__ void __launch_bounds__(TK_MINMAX_THREADS)
    tk_minmax_kernel(const T *__restrict__ in, size_t n, size_t head, long long *d_minmax)
{
    __shared__ int warp_lo[TK_MINMAX_THREADS / 32], warp_hi[TK_MINMAX_THREADS / 32];
    int lo = INT_MAX, hi = INT_MIN;
    const uint4 *body = reinterpret_cast<const uint4 *>(in + head);
    size_t vectors = (n - head) * sizeof(T) / 16;
    tk_for_each_vec<TK_MINMAX_THREADS, UNROLL>(body, vectors,
                                               [&](uint4 v, size_t) { fold_vector<T>(v, lo, hi); });
    if (blockIdx.x == 0) {
        size_t tail = head + vectors * 16 / sizeof(T);
        if (threadIdx.x < head)
            fold((int)in[threadIdx.x], lo, hi);
        for (size_t i = tail + threadIdx.x; i < n; i += blockDim.x)
            fold((int)in[i], lo, hi);
    }
    for (int d = 16; d > 0; d >>= 1) {
        lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, d));
        hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, d));
    }
    unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        warp_lo[warp] = lo;
        warp_hi[warp] = hi;
    }
    __syncthreads();
    if (threadIdx.x != 0)
        return;
    for (unsigned w = 1; w < blockDim.x / 32; w++) {
        lo = min(lo, warp_lo[w]);
        hi = max(hi, warp_hi[w]);
    }
    if (lo <= hi) { /* the block saw at least one element */
        atomicMin(&d_minmax[0], (long long)lo);
        atomicMax(&d_minmax[1], (long long)hi);
    }
}

template <typename T>
static tally_status_t launch(const void *d_in, size_t n, int64_t *d_minmax, cudaStream_t stream)
{
    const tk_cuda_tuning_t *t = tk_tuning();
    if (!t)
        return TALLY_E_PARAM;
    if (n == 0)
        return TALLY_OK;
    /* Elements before the first 16-byte boundary (the input is aligned to its element, so this
     * is a whole number of them, fewer than 16 / sizeof(T) <= the block's threads). */
    tk_body b = tk_split_body(d_in, n, sizeof(T));
    unsigned unroll = t->minmax_unroll == 4 ? 4 : 1;
    unsigned blocks =
        tk_persistent_blocks(b.vecs, (size_t)TK_MINMAX_THREADS * unroll, t->minmax_blocks_per_sm);
    if (unroll == 4)
        tk_minmax_kernel<T, 4><<<blocks, TK_MINMAX_THREADS, 0, stream>>>((const T *)d_in, n, b.head,
                                                                         (long long *)d_minmax);
    else
        tk_minmax_kernel<T, 1><<<blocks, TK_MINMAX_THREADS, 0, stream>>>((const T *)d_in, n, b.head,
                                                                         (long long *)d_minmax);
    return tk_cuda_check_launch();
}

extern "C" tally_status_t tk_cuda_minmax_reset(int64_t *d_minmax, cudaStream_t stream)
{
    tk_minmax_reset_kernel<<<1, 1, 0, stream>>>((long long *)d_minmax);
    return tk_cuda_check_launch();
}

extern "C" tally_status_t tk_cuda_minmax(uint8_t dtype, const void *d_in, size_t n,
                                         int64_t *d_minmax, cudaStream_t stream)
{
    switch (dtype) {
    case TALLY_DTYPE_I32:
        return launch<int32_t>(d_in, n, d_minmax, stream);
    case TALLY_DTYPE_U8:
        return launch<uint8_t>(d_in, n, d_minmax, stream);
    case TALLY_DTYPE_U16:
        return launch<uint16_t>(d_in, n, d_minmax, stream);
    default:
        return TALLY_E_PARAM;
    }
}
