/*
 * tk_cuda_hist.cu — 256-bin histograms of uint8 (bin = byte) and int32 (256 even bins over
 * [lo, hi) plus underflow and overflow), added into a device tk_hist_t.
 *
 * Shared-memory privatisation with one sub-histogram per lane: a block keeps 32 copies of its
 * bins, laid out bin-major, lane-minor (word bin * 32 + lane). Lane l only ever touches bank l,
 * so a warp's 32 shared-memory atomics never conflict, whatever the data: uniform bytes,
 * narrow data and all-equal data (the case that serialises a single per-block or per-warp
 * histogram 32-fold) all run at the same speed. Warps of a block share the 32 copies through
 * native shared atomics. That is 32 KiB (u8) or 33 KiB (i32, 258 bins) of shared memory.
 *
 * The grid is persistent-ish (TK_HIST_BLOCKS_PER_SM blocks per SM, fewer for small inputs):
 * blocks stride over the 16-byte-aligned body of the input with TK_HIST_UNROLL 16-byte loads in
 * flight per thread; the few unaligned elements at either end are counted by block 0. Each
 * block merges its 32 copies once at the end (reading them rotated by bin, so the reads of a
 * warp fall in 32 different banks) and adds non-zero bins to the global uint64 counts with one
 * atomicAdd each.
 *
 * The int32 bin, exactly tally_hist_bin_i32's floor((x - lo) * 256 / W) with W = hi - lo, without
 * a 64-bit division per element: bin = floor(fma(d, r, 2^-40)) in double precision, where
 * d = x - lo (0 <= d < W <= 2^32, converted exactly) and r = RN(256 / W) is computed once on the
 * host. Proof: let Q = 256 d / W < 256. r = (256 / W)(1 + e1) and the fma rounds once more,
 * (1 + e2), with |e1|, |e2| <= 2^-53, so the computed value is Q + 2^-40 + eta with
 * |eta| <= 256 * 2^-53 + 257 * 2^-53 < 2^-43. If Q is an integer k, the value lies in
 * (k, k + 2^-39), so its floor is k. Otherwise Q's distance to the next integer above is at
 * least 1 / W >= 2^-32 (256 d and W are integers), and the value lies in
 * (floor(Q), ceil(Q) - 2^-32 + 2^-39), so its floor is floor(Q). Either way the bin equals the
 * integer definition; tests/test_cuda_backend.c also checks it against tally_hist_bin_i32 at
 * every bin edge of many widths.
 */
#include <limits.h>

#include "tk_cuda_internal.cuh"

typedef unsigned long long u64;

#define TK_HIST_U8_BINS 256
#define TK_HIST_I32_BINS 258 /* 256, then underflow, overflow */

struct tk_i32_range {
    long long lo;
    u64 width;    /* hi - lo, 1 .. 2^32 */
    double scale; /* RN(256 / width) */
};

static __device__ __forceinline__ unsigned i32_bin(int x, const tk_i32_range &r)
{
    long long d = (long long)x - r.lo;
    if (d < 0)
        return 256;
    if ((u64)d >= r.width)
        return 257;
    return __double2uint_rz(fma(__ull2double_rn((u64)d), r.scale, 0x1p-40));
}

template <bool I32>
static __device__ __forceinline__ void count_word(unsigned *lane_bins, uint32_t w,
                                                  const tk_i32_range &r)
{
    if (I32) {
        atomicAdd(lane_bins + i32_bin((int)w, r) * 32, 1u);
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++)
            atomicAdd(lane_bins + ((w >> (8 * j)) & 0xffu) * 32, 1u);
    }
}

template <bool I32>
__global__ void __launch_bounds__(TK_HIST_THREADS)
    tk_hist_kernel(const void *__restrict__ in, size_t head, size_t body_vecs, size_t tail,
                   tk_hist_t *hist, tk_i32_range r)
{
    constexpr int NB = I32 ? TK_HIST_I32_BINS : TK_HIST_U8_BINS;
    __shared__ unsigned bins[NB * 32];
    for (int i = threadIdx.x; i < NB * 32; i += TK_HIST_THREADS)
        bins[i] = 0;
    __syncthreads();

    const int lane = threadIdx.x & 31;
    unsigned *lane_bins = bins + lane;

    /* The 16-byte-aligned body, TK_HIST_UNROLL vectors in flight per thread. */
    const uint4 *body =
        reinterpret_cast<const uint4 *>(static_cast<const char *>(in) + head * (I32 ? 4 : 1));
    const size_t stride = (size_t)gridDim.x * TK_HIST_THREADS;
    size_t i = (size_t)blockIdx.x * TK_HIST_THREADS + threadIdx.x;
    for (; i + (TK_HIST_UNROLL - 1) * stride < body_vecs; i += TK_HIST_UNROLL * stride) {
        uint4 v[TK_HIST_UNROLL];
#pragma unroll
        for (int u = 0; u < TK_HIST_UNROLL; u++)
            v[u] = __ldg(body + i + u * stride);
#pragma unroll
        for (int u = 0; u < TK_HIST_UNROLL; u++) {
            count_word<I32>(lane_bins, v[u].x, r);
            count_word<I32>(lane_bins, v[u].y, r);
            count_word<I32>(lane_bins, v[u].z, r);
            count_word<I32>(lane_bins, v[u].w, r);
        }
    }
    for (; i < body_vecs; i += stride) {
        uint4 v = __ldg(body + i);
        count_word<I32>(lane_bins, v.x, r);
        count_word<I32>(lane_bins, v.y, r);
        count_word<I32>(lane_bins, v.z, r);
        count_word<I32>(lane_bins, v.w, r);
    }

    /* The unaligned ends: fewer than 16 bytes each, counted element by element by block 0. */
    if (blockIdx.x == 0 && threadIdx.x < head + tail) {
        size_t e = threadIdx.x < head ? threadIdx.x
                                      : head + body_vecs * (I32 ? 4 : 16) + (threadIdx.x - head);
        if (I32) {
            int x = static_cast<const int *>(in)[e];
            atomicAdd(lane_bins + i32_bin(x, r) * 32, 1u);
        } else {
            unsigned b = static_cast<const uint8_t *>(in)[e];
            atomicAdd(lane_bins + b * 32, 1u);
        }
    }
    __syncthreads();

    /* Merge the 32 copies once, rotated by bin so a warp's reads hit 32 different banks. */
    for (int b = threadIdx.x; b < NB; b += TK_HIST_THREADS) {
        unsigned s = 0;
#pragma unroll 8
        for (int l = 0; l < 32; l++)
            s += bins[b * 32 + ((l + b) & 31)];
        if (s) {
            uint64_t *dst = b < 256    ? &hist->bins[b]
                            : b == 256 ? &hist->underflow
                                       : &hist->overflow;
            atomicAdd(reinterpret_cast<u64 *>(dst), (u64)s);
        }
    }
}

extern "C" size_t tk_cuda_hist_u8_scratch_bytes(size_t n)
{
    (void)n;
    return 0;
}

extern "C" size_t tk_cuda_hist_i32_scratch_bytes(size_t n)
{
    (void)n;
    return 0;
}

/* Splits [in, in + n * esize) into an unaligned head, 16-byte vectors and a tail, and picks
 * the grid: enough blocks for TK_HIST_UNROLL vectors per thread, at most a full machine. */
template <bool I32>
static tally_status_t launch_hist(const void *in, size_t n, tk_hist_t *hist, const tk_i32_range &r,
                                  cudaStream_t stream)
{
    const size_t esize = I32 ? 4 : 1, per_vec = 16 / esize;
    size_t head = (size_t)((16 - (uintptr_t)in % 16) % 16) / esize;
    if (head > n)
        head = n;
    size_t body_vecs = (n - head) / per_vec;
    size_t tail = n - head - body_vecs * per_vec;
    size_t want = tk_div_up(body_vecs, (size_t)TK_HIST_THREADS * TK_HIST_UNROLL);
    size_t most = (size_t)tk_cuda_sm_count() * TK_HIST_BLOCKS_PER_SM;
    unsigned blocks = (unsigned)(want < 1 ? 1 : want > most ? most : want);
    tk_hist_kernel<I32><<<blocks, TK_HIST_THREADS, 0, stream>>>(in, head, body_vecs, tail, hist, r);
    return tk_cuda_check_launch();
}

extern "C" tally_status_t tk_cuda_hist_u8(const uint8_t *d_in, size_t n, tk_hist_t *d_hist,
                                          void *d_scratch, size_t scratch_bytes,
                                          cudaStream_t stream)
{
    (void)d_scratch;
    (void)scratch_bytes;
    if (!d_hist || (uintptr_t)d_hist % 8 || (n > 0 && !d_in))
        return TALLY_E_PARAM;
    if (n == 0)
        return TALLY_OK;
    tk_i32_range r = {0, 1, 0.0};
    return launch_hist<false>(d_in, n, d_hist, r, stream);
}

extern "C" tally_status_t tk_cuda_hist_i32(const int32_t *d_in, size_t n, int64_t lo, int64_t hi,
                                           tk_hist_t *d_hist, void *d_scratch, size_t scratch_bytes,
                                           cudaStream_t stream)
{
    (void)d_scratch;
    (void)scratch_bytes;
    if (!d_hist || (uintptr_t)d_hist % 8 || (n > 0 && !d_in) || (uintptr_t)d_in % 4)
        return TALLY_E_PARAM;
    if (lo >= hi || lo < INT32_MIN || hi > (int64_t)INT32_MAX + 1)
        return TALLY_E_PARAM;
    if (n == 0)
        return TALLY_OK;
    tk_i32_range r;
    r.lo = lo;
    r.width = (u64)(hi - lo);
    r.scale = 256.0 / (double)r.width;
    return launch_hist<true>(d_in, n, d_hist, r, stream);
}
