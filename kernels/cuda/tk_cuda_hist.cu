/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tk_cuda_hist.cu — 256-bin histograms of uint8 (bin = byte), int32 and uint16 (256 even bins
 * over [lo, hi) plus underflow and overflow), and interleaved RGB/RGBA bytes (one 256-bin
 * histogram per channel), added into a device tk_hist_t.
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
 *
 * The uint16 bin is tally_hist_bin_u16 (one 64-bit multiply and shift, exact for ranges up to
 * 2^16: the proof is in tally_proto.h), the same expression as the CPU backend's, so the two
 * agree by construction; a 32-bit word holds two values.
 *
 * Colour (tk_hist_rgb_kernel): the same privatisation with CH x 256 bins per copy, so 96 KiB
 * (RGB) or 128 KiB (RGBA) of dynamic shared memory for 32 copies, or half that with 16 copies
 * (lanes l and l + 16 share one, a 2-way bank conflict at worst; more resident blocks). The
 * channel of a byte is its offset in the batch modulo CH: for the 16-byte vector i of a body
 * that starts `head` bytes in, byte k is channel (head + 16 i + k) mod CH, which is
 * (head + k) mod 4 for RGBA (16 = 0 mod 4) and (head + i + k) mod 3 for RGB (16 = 1 mod 3).
 * TK_HIST_RGB_COPIES picks the copy count (the kernel benchmark measures both).
 */
#include <limits.h>

#include "tk_cuda_internal.cuh"

typedef unsigned long long u64;

#define TK_HIST_U8_BINS 256
#define TK_HIST_I32_BINS 258 /* 256, then underflow, overflow */

/* What the kernel counts: bytes, int32 or uint16 values (the element size is 1, 4, 2). */
enum { TK_MODE_U8 = 0, TK_MODE_I32 = 1, TK_MODE_U16 = 2 };

struct tk_i32_range {
    long long lo;
    u64 width;    /* hi - lo, 1 .. 2^32 */
    double scale; /* RN(256 / width) */
    /* uint16: lo .. last (= hi - 1) and tally_hist_u16_recip's multiplier and shift */
    unsigned lo16, last16;
    uint64_t mul;
    unsigned shift;
};

static __device__ __forceinline__ unsigned u16_bin(unsigned x, const tk_i32_range &r)
{
    if (x < r.lo16)
        return 256;
    if (x > r.last16)
        return 257;
    return tally_hist_bin_u16(x - r.lo16, r.mul, r.shift);
}

static __device__ __forceinline__ unsigned i32_bin(int x, const tk_i32_range &r)
{
    long long d = (long long)x - r.lo;
    if (d < 0)
        return 256;
    if ((u64)d >= r.width)
        return 257;
    return __double2uint_rz(fma(__ull2double_rn((u64)d), r.scale, 0x1p-40));
}

template <int MODE>
static __device__ __forceinline__ void count_word(unsigned *lane_bins, uint32_t w,
                                                  const tk_i32_range &r)
{
    if (MODE == TK_MODE_I32) {
        atomicAdd(lane_bins + i32_bin((int)w, r) * 32, 1u);
    } else if (MODE == TK_MODE_U16) {
        atomicAdd(lane_bins + u16_bin(w & 0xffffu, r) * 32, 1u);
        atomicAdd(lane_bins + u16_bin(w >> 16, r) * 32, 1u);
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++)
            atomicAdd(lane_bins + ((w >> (8 * j)) & 0xffu) * 32, 1u);
    }
}

/* A grid-stride pass over the 16-byte-aligned body of the input, TK_HIST_UNROLL vectors in flight
 * per thread (all loads first, then the counting): count(v, i) for every vector i. */
template <typename F>
static __device__ __forceinline__ void for_each_body_vec(const uint4 *body, size_t body_vecs,
                                                         F count)
{
    const size_t stride = (size_t)gridDim.x * TK_HIST_THREADS;
    size_t i = (size_t)blockIdx.x * TK_HIST_THREADS + threadIdx.x;
    for (; i + (TK_HIST_UNROLL - 1) * stride < body_vecs; i += TK_HIST_UNROLL * stride) {
        uint4 v[TK_HIST_UNROLL];
#pragma unroll
        for (int u = 0; u < TK_HIST_UNROLL; u++)
            v[u] = __ldg(body + i + u * stride);
#pragma unroll
        for (int u = 0; u < TK_HIST_UNROLL; u++)
            count(v[u], i + u * stride);
    }
    for (; i < body_vecs; i += stride)
        count(__ldg(body + i), i);
}

template <int MODE>
__global__ void __launch_bounds__(TK_HIST_THREADS)
    tk_hist_kernel(const void *__restrict__ in, size_t head, size_t body_vecs, size_t tail,
                   tk_hist_t *hist, tk_i32_range r)
{
    constexpr int NB = MODE == TK_MODE_U8 ? TK_HIST_U8_BINS : TK_HIST_I32_BINS;
    constexpr size_t ESIZE = MODE == TK_MODE_U8 ? 1 : MODE == TK_MODE_U16 ? 2 : 4;
    __shared__ unsigned bins[NB * 32];
    for (int i = threadIdx.x; i < NB * 32; i += TK_HIST_THREADS)
        bins[i] = 0;
    __syncthreads();

    const int lane = threadIdx.x & 31;
    unsigned *lane_bins = bins + lane;

    /* The 16-byte-aligned body. */
    const uint4 *body =
        reinterpret_cast<const uint4 *>(static_cast<const char *>(in) + head * ESIZE);
    for_each_body_vec(body, body_vecs, [&](uint4 v, size_t) {
        count_word<MODE>(lane_bins, v.x, r);
        count_word<MODE>(lane_bins, v.y, r);
        count_word<MODE>(lane_bins, v.z, r);
        count_word<MODE>(lane_bins, v.w, r);
    });

    /* The unaligned ends: fewer than 16 bytes each, counted element by element by block 0. */
    if (blockIdx.x == 0 && threadIdx.x < head + tail) {
        size_t e = threadIdx.x < head ? threadIdx.x
                                      : head + body_vecs * (16 / ESIZE) + (threadIdx.x - head);
        if (MODE == TK_MODE_I32) {
            int x = static_cast<const int *>(in)[e];
            atomicAdd(lane_bins + i32_bin(x, r) * 32, 1u);
        } else if (MODE == TK_MODE_U16) {
            unsigned x = static_cast<const uint16_t *>(in)[e];
            atomicAdd(lane_bins + u16_bin(x, r) * 32, 1u);
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
template <int MODE>
static tally_status_t launch_hist(const void *in, size_t n, tk_hist_t *hist, const tk_i32_range &r,
                                  cudaStream_t stream)
{
    const size_t esize = MODE == TK_MODE_U8 ? 1 : MODE == TK_MODE_U16 ? 2 : 4, per_vec = 16 / esize;
    size_t head = (size_t)((16 - (uintptr_t)in % 16) % 16) / esize;
    if (head > n)
        head = n;
    size_t body_vecs = (n - head) / per_vec;
    size_t tail = n - head - body_vecs * per_vec;
    size_t want = tk_div_up(body_vecs, (size_t)TK_HIST_THREADS * TK_HIST_UNROLL);
    size_t most = (size_t)tk_cuda_sm_count() * TK_HIST_BLOCKS_PER_SM;
    unsigned blocks = (unsigned)(want < 1 ? 1 : want > most ? most : want);
    tk_hist_kernel<MODE>
        <<<blocks, TK_HIST_THREADS, 0, stream>>>(in, head, body_vecs, tail, hist, r);
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
    tk_i32_range r = {};
    return launch_hist<TK_MODE_U8>(d_in, n, d_hist, r, stream);
}

/* The arguments of a ranged histogram: an aligned 8-byte d_hist, input aligned to its element
 * (esize) when there is any, and min <= lo < hi <= max. */
static bool ranged_args_ok(const void *d_in, size_t esize, size_t n, int64_t lo, int64_t hi,
                           int64_t min, int64_t max, const tk_hist_t *d_hist)
{
    if (!d_hist || (uintptr_t)d_hist % 8 || (n > 0 && !d_in) || (uintptr_t)d_in % esize)
        return false;
    return min <= lo && lo < hi && hi <= max;
}

extern "C" tally_status_t tk_cuda_hist_i32(const int32_t *d_in, size_t n, int64_t lo, int64_t hi,
                                           tk_hist_t *d_hist, void *d_scratch, size_t scratch_bytes,
                                           cudaStream_t stream)
{
    (void)d_scratch;
    (void)scratch_bytes;
    if (!ranged_args_ok(d_in, 4, n, lo, hi, INT32_MIN, (int64_t)INT32_MAX + 1, d_hist))
        return TALLY_E_PARAM;
    if (n == 0)
        return TALLY_OK;
    tk_i32_range r = {};
    r.lo = lo;
    r.width = (u64)(hi - lo);
    r.scale = 256.0 / (double)r.width;
    return launch_hist<TK_MODE_I32>(d_in, n, d_hist, r, stream);
}

extern "C" size_t tk_cuda_hist_u16_scratch_bytes(size_t n)
{
    (void)n;
    return 0;
}

extern "C" tally_status_t tk_cuda_hist_u16(const uint16_t *d_in, size_t n, int64_t lo, int64_t hi,
                                           tk_hist_t *d_hist, void *d_scratch, size_t scratch_bytes,
                                           cudaStream_t stream)
{
    (void)d_scratch;
    (void)scratch_bytes;
    if (!ranged_args_ok(d_in, 2, n, lo, hi, 0, (int64_t)UINT16_MAX + 1, d_hist))
        return TALLY_E_PARAM;
    if (n == 0)
        return TALLY_OK;
    tk_i32_range r = {};
    r.lo16 = (unsigned)lo;
    r.last16 = (unsigned)(hi - 1);
    tally_hist_u16_recip(lo, hi, &r.mul, &r.shift);
    return launch_hist<TK_MODE_U16>(d_in, n, d_hist, r, stream);
}

/* ---- colour --------------------------------------------------------------------------------- */

/* Counts byte b of channel ch in this lane's copy. */
template <int COPIES>
static __device__ __forceinline__ void rgb_count(unsigned *lane_bins, unsigned ch, unsigned b)
{
    atomicAdd(lane_bins + (ch * 256u + b) * COPIES, 1u);
}

/* The four bytes of word w, the first of channel c0 (0 <= c0 < CH). */
template <int CH, int COPIES>
static __device__ __forceinline__ void rgb_word(unsigned *lane_bins, uint32_t w, unsigned c0)
{
#pragma unroll
    for (int j = 0; j < 4; j++) {
        unsigned ch = c0 + j;
        if (CH == 3)
            ch = ch >= 3 ? ch - 3 : ch; /* c0 <= 2, j <= 3 */
        else
            ch &= 3;
        rgb_count<COPIES>(lane_bins, ch, (w >> (8 * j)) & 0xffu);
    }
}

template <int CH, int COPIES>
static __device__ __forceinline__ void rgb_vec(unsigned *lane_bins, uint4 v, unsigned c0)
{
    /* Byte k of the vector is channel (c0 + k) mod CH; words start at k = 0, 4, 8, 12. */
    rgb_word<CH, COPIES>(lane_bins, v.x, c0);
    rgb_word<CH, COPIES>(lane_bins, v.y, (c0 + 4) % CH);
    rgb_word<CH, COPIES>(lane_bins, v.z, (c0 + 8) % CH);
    rgb_word<CH, COPIES>(lane_bins, v.w, (c0 + 12) % CH);
}

/* The channel of the first byte of body vector i, the body starting `head` (< 16) bytes in.
 * In 32 bits: tk_cuda_hist_rgb_copies admits batches under 2^36 bytes, so i < 2^32 (a 64-bit
 * modulo per vector would cost more than its 16 atomics' addressing). */
template <int CH> static __device__ __forceinline__ unsigned rgb_c0(size_t head, size_t i)
{
    return CH == 4 ? (unsigned)(head & 3) : ((unsigned)head + (unsigned)i) % 3u;
}

template <int CH, int COPIES>
__global__ void __launch_bounds__(TK_HIST_THREADS)
    tk_hist_rgb_kernel(const uint8_t *__restrict__ in, size_t head, size_t body_vecs, size_t tail,
                       tk_hist_t *hist)
{
    constexpr int NB = CH * 256;
    extern __shared__ unsigned rgb_bins[];
    for (int i = threadIdx.x; i < NB * COPIES; i += TK_HIST_THREADS)
        rgb_bins[i] = 0;
    __syncthreads();
    unsigned *lane_bins = rgb_bins + (threadIdx.x & (COPIES - 1));

    const uint4 *body = reinterpret_cast<const uint4 *>(in + head);
    for_each_body_vec(body, body_vecs, [&](uint4 v, size_t i) {
        rgb_vec<CH, COPIES>(lane_bins, v, rgb_c0<CH>(head, i));
    });

    /* The unaligned ends, byte by byte, by block 0: byte e is channel e mod CH. */
    if (blockIdx.x == 0 && threadIdx.x < head + tail) {
        size_t e = threadIdx.x < head ? threadIdx.x : head + body_vecs * 16 + (threadIdx.x - head);
        rgb_count<COPIES>(lane_bins, (unsigned)(e % CH), in[e]);
    }
    __syncthreads();

    for (int b = threadIdx.x; b < NB; b += TK_HIST_THREADS) {
        unsigned s = 0;
#pragma unroll 8
        for (int l = 0; l < COPIES; l++)
            s += rgb_bins[b * COPIES + ((l + b) & (COPIES - 1))];
        if (s)
            atomicAdd(reinterpret_cast<u64 *>(&hist->bins[b]), (u64)s);
    }
}

/* Blocks of tk_hist_rgb_kernel<CH, COPIES> resident per SM on the current device, into
 * *blocks (cached; the shared-memory opt-in is set on the first call per device). */
template <int CH, int COPIES> static tally_status_t rgb_blocks_per_sm(size_t smem, int *blocks)
{
    static int cache[64];
    int dev = 0;
    tally_status_t st = tk_cuda_status(cudaGetDevice(&dev));
    if (st != TALLY_OK)
        return st;
    if (dev >= 0 && dev < 64 && (*blocks = __atomic_load_n(&cache[dev], __ATOMIC_RELAXED)) > 0)
        return TALLY_OK;
    st = tk_cuda_status(cudaFuncSetAttribute(
        tk_hist_rgb_kernel<CH, COPIES>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (st == TALLY_OK)
        st = tk_cuda_status(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            blocks, tk_hist_rgb_kernel<CH, COPIES>, TK_HIST_THREADS, smem));
    if (st != TALLY_OK)
        return st;
    if (*blocks < 1) /* cannot happen on sm_90 (up to 227 KiB per block); be safe */
        return TALLY_E_PARAM;
    if (*blocks > TK_HIST_BLOCKS_PER_SM)
        *blocks = TK_HIST_BLOCKS_PER_SM;
    if (dev >= 0 && dev < 64)
        __atomic_store_n(&cache[dev], *blocks, __ATOMIC_RELAXED);
    return TALLY_OK;
}

template <int CH, int COPIES>
static tally_status_t launch_rgb(const uint8_t *in, size_t pixels, tk_hist_t *hist,
                                 cudaStream_t stream)
{
    const size_t smem = (size_t)CH * 256 * COPIES * sizeof(unsigned);
    int per_sm = 0;
    tally_status_t st = rgb_blocks_per_sm<CH, COPIES>(smem, &per_sm);
    if (st != TALLY_OK)
        return st;
    size_t n = pixels * CH;
    size_t head = (size_t)((16 - (uintptr_t)in % 16) % 16);
    if (head > n)
        head = n;
    size_t body_vecs = (n - head) / 16;
    size_t tail = n - head - body_vecs * 16;
    size_t want = tk_div_up(body_vecs, (size_t)TK_HIST_THREADS * TK_HIST_UNROLL);
    size_t most = (size_t)tk_cuda_sm_count() * per_sm;
    unsigned blocks = (unsigned)(want < 1 ? 1 : want > most ? most : want);
    tk_hist_rgb_kernel<CH, COPIES>
        <<<blocks, TK_HIST_THREADS, smem, stream>>>(in, head, body_vecs, tail, hist);
    return tk_cuda_check_launch();
}

extern "C" size_t tk_cuda_hist_rgb_scratch_bytes(size_t n)
{
    (void)n;
    return 0;
}

extern "C" tally_status_t tk_cuda_hist_rgb_copies(const uint8_t *d_in, size_t pixels,
                                                  unsigned channels, unsigned copies,
                                                  tk_hist_t *d_hist, cudaStream_t stream)
{
    if (!d_hist || (uintptr_t)d_hist % 8 || (pixels > 0 && !d_in))
        return TALLY_E_PARAM;
    if ((channels != 3 && channels != 4) || (copies != 16 && copies != 32))
        return TALLY_E_PARAM;
    if (pixels >= ((size_t)1 << 36) / channels) /* rgb_c0 counts vectors in 32 bits */
        return TALLY_E_PARAM;
    if (pixels == 0)
        return TALLY_OK;
    if (channels == 3)
        return copies == 32 ? launch_rgb<3, 32>(d_in, pixels, d_hist, stream)
                            : launch_rgb<3, 16>(d_in, pixels, d_hist, stream);
    return copies == 32 ? launch_rgb<4, 32>(d_in, pixels, d_hist, stream)
                        : launch_rgb<4, 16>(d_in, pixels, d_hist, stream);
}

extern "C" unsigned tk_cuda_hist_rgb_default_copies(void)
{
    return TK_HIST_RGB_COPIES;
}

extern "C" tally_status_t tk_cuda_hist_rgb(const uint8_t *d_in, size_t pixels, unsigned channels,
                                           tk_hist_t *d_hist, void *d_scratch, size_t scratch_bytes,
                                           cudaStream_t stream)
{
    (void)d_scratch;
    (void)scratch_bytes;
    return tk_cuda_hist_rgb_copies(d_in, pixels, channels, TK_HIST_RGB_COPIES, d_hist, stream);
}

extern "C" tally_status_t tk_cuda_hist(uint8_t dtype, const void *d_in, size_t n, int64_t lo,
                                       int64_t hi, tk_hist_t *d_hist, void *d_scratch,
                                       size_t scratch_bytes, cudaStream_t stream)
{
    switch (dtype) {
    case TALLY_DTYPE_U8:
        return tk_cuda_hist_u8((const uint8_t *)d_in, n, d_hist, d_scratch, scratch_bytes, stream);
    case TALLY_DTYPE_I32:
        return tk_cuda_hist_i32((const int32_t *)d_in, n, lo, hi, d_hist, d_scratch, scratch_bytes,
                                stream);
    case TALLY_DTYPE_U16:
        return tk_cuda_hist_u16((const uint16_t *)d_in, n, lo, hi, d_hist, d_scratch, scratch_bytes,
                                stream);
    case TALLY_DTYPE_RGB8:
    case TALLY_DTYPE_RGBA8:
        return tk_cuda_hist_rgb((const uint8_t *)d_in, n, tally_hist_channels(dtype), d_hist,
                                d_scratch, scratch_bytes, stream);
    default:
        return TALLY_E_PARAM;
    }
}
