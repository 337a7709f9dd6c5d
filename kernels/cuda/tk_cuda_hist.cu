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
 * The uint16 bin is tk_u16_slot (kernels/tk_u16_slot.h): the same integer as the CPU backend's
 * tally_hist_bin_u16, in four 32-bit operations without a branch, underflow and overflow
 * folded in as slots 0 and 257 (the kernel's word slot * 32 + lane; bins 1..256 are bins
 * 0..255); a 32-bit word holds two values.
 *
 * Colour: one 256-bin histogram per channel. The channel of a byte is its offset in the batch
 * modulo CH: for the 16-byte vector i of a body that starts `head` bytes in, byte k is channel
 * (head + 16 i + k) mod CH, which is (head + k) mod 4 for RGBA (16 = 0 mod 4) and
 * (head + i + k) mod 3 for RGB (16 = 1 mod 3). Two layouts, the tuning row's rgb_layout:
 *   - TK_RGB_PACKED (tk_hist_rgb_packed_kernel): 32 copies, one per lane (no bank conflict
 *     whatever the data), of 16-bit counters, two to a 32-bit word, 64 KiB a block, so three
 *     512-thread blocks fit on an SM. Which half a byte counts in is known at compile time or
 *     once per vector, never per byte: RGBA counts by the byte's place j in its 32-bit word
 *     (channel (head + j) mod 4 for every word of the body), places 0 and 1 sharing words, 2
 *     and 3 others; RGB counts R and G in the halves of one word and B in the low half of
 *     another, the three places k mod 3 of a vector taking their channel's word and half from
 *     the vector's phase (head + i) mod 3. So a byte costs one extract, one address and one
 *     shared atomic, as in the uint8 kernel. The block adds its counters into 64-bit registers
 *     (thread t owns word row t across the 32 copies) every TK_RGB_ROUND grid-stride steps,
 *     before any 16-bit counter can reach 65536, and once at the end.
 *   - TK_RGB_COPIES16 / TK_RGB_COPIES32 (tk_hist_rgb_kernel): 16 or 32 copies of 32-bit
 *     counters (96 or 128 KiB for 32 copies; with 16, lanes l and l + 16 share one, a 2-way bank
 *     conflict at worst), the channel computed per byte. On the H200 these were bound by issue
 *     (129 instructions a vector for RGB), bank conflicts (16 copies) or occupancy (one RGBA
 *     block of 128 KiB per SM): 0.65-0.79 x read (2026-11-26); the H100's row keeps 16 copies
 *     (0.92-0.98 there) until the packed layout is measured on one.
 */
#include <limits.h>

#include "tk_cuda_internal.cuh"
#include "tk_u16_slot.h"

typedef unsigned long long u64;

#define TK_HIST_U8_BINS 256
#define TK_HIST_I32_BINS 258 /* 256, then underflow, overflow */

/* What the kernel counts: bytes, int32 or uint16 values (the element size is 1, 4, 2). */
enum { TK_MODE_U8 = 0, TK_MODE_I32 = 1, TK_MODE_U16 = 2 };

struct tk_i32_range {
    long long lo;
    u64 width;         /* hi - lo, 1 .. 2^32 */
    double scale;      /* RN(256 / width) */
    tk_u16_slot_t u16; /* uint16 */
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

template <int MODE>
static __device__ __forceinline__ void count_word(unsigned *lane_bins, uint32_t w,
                                                  const tk_i32_range &r)
{
    if (MODE == TK_MODE_I32) {
        atomicAdd(lane_bins + i32_bin((int)w, r) * 32, 1u);
    } else if (MODE == TK_MODE_U16) {
        atomicAdd(lane_bins + tk_u16_slot(w & 0xffffu, &r.u16) * 32, 1u);
        atomicAdd(lane_bins + tk_u16_slot(w >> 16, &r.u16) * 32, 1u);
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++)
            atomicAdd(lane_bins + ((w >> (8 * j)) & 0xffu) * 32, 1u);
    }
}

template <int MODE>
__global__ void __launch_bounds__(TK_HIST_THREADS, TK_HIST_BLOCKS_PER_SM)
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
    tk_for_each_vec<TK_HIST_THREADS, TK_HIST_UNROLL>(body, body_vecs, [&](uint4 v, size_t) {
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
            atomicAdd(lane_bins + tk_u16_slot(x, &r.u16) * 32, 1u);
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
            uint64_t *dst; /* i32: bins, underflow, overflow; u16: underflow, bins, overflow */
            if (MODE == TK_MODE_U16)
                dst = b == 0 ? &hist->underflow : b == 257 ? &hist->overflow : &hist->bins[b - 1];
            else
                dst = b < 256 ? &hist->bins[b] : b == 256 ? &hist->underflow : &hist->overflow;
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

/* The grid: enough blocks for TK_HIST_UNROLL vectors per thread, at most the tuning row's
 * blocks per SM on every SM. */
template <int MODE>
static tally_status_t launch_hist(const void *in, size_t n, tk_hist_t *hist, const tk_i32_range &r,
                                  cudaStream_t stream)
{
    const tk_cuda_tuning_t *t = tk_tuning();
    if (!t)
        return TALLY_E_PARAM;
    const size_t esize = MODE == TK_MODE_U8 ? 1 : MODE == TK_MODE_U16 ? 2 : 4;
    tk_body b = tk_split_body(in, n, esize);
    unsigned blocks =
        tk_persistent_blocks(b.vecs, TK_HIST_THREADS * TK_HIST_UNROLL, t->hist_blocks_per_sm);
    tk_hist_kernel<MODE>
        <<<blocks, TK_HIST_THREADS, 0, stream>>>(in, b.head, b.vecs, b.tail, hist, r);
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
    tk_u16_slot_init(lo, hi, &r.u16);
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
 * In 32 bits: tk_cuda_hist_rgb admits batches under 2^35 bytes, so head + i < 2^31 (a 64-bit
 * modulo per vector would cost more than its 16 atomics' addressing). */
template <int CH> static __device__ __forceinline__ unsigned rgb_c0(size_t head, size_t i)
{
    return CH == 4 ? (unsigned)(head & 3) : ((unsigned)head + (unsigned)i) % 3u;
}

template <int CH, int COPIES>
__global__ void __launch_bounds__(TK_HIST_THREADS)
    tk_hist_rgb_kernel(const uint8_t *__restrict__ in, size_t head, size_t body_vecs, size_t tail,
                       tk_hist_t *hist, int round) /* round: the packed kernel's, unused */
{
    (void)round;
    constexpr int NB = CH * 256;
    extern __shared__ unsigned rgb_bins[];
    for (int i = threadIdx.x; i < NB * COPIES; i += TK_HIST_THREADS)
        rgb_bins[i] = 0;
    __syncthreads();
    unsigned *lane_bins = rgb_bins + (threadIdx.x & (COPIES - 1));

    const uint4 *body = reinterpret_cast<const uint4 *>(in + head);
    tk_for_each_vec<TK_HIST_THREADS, TK_HIST_UNROLL>(body, body_vecs, [&](uint4 v, size_t i) {
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

/* ---- colour, TK_RGB_PACKED: 32 copies of 16-bit counters ----------------------------------- */

/* Word rows per copy: two sets of 256 (one per byte value), word (row * 32 + lane). */
#define TK_RGB_ROWS 512
#define TK_RGB_SET (256 * 32) /* words from one set to the next */
/* Threads that share a copy, and grid-stride steps between two flushes: a counter takes at most
 * 6 bytes of a vector (RGB's place 0: bytes 0, 3, ..., 15; RGBA's places take 4) from each
 * sharer per vector, so after ROUND steps of TK_HIST_UNROLL vectors, then fewer than
 * TK_HIST_UNROLL vectors more and one byte of the ends, it is still below 2^16. */
#define TK_RGB_SHARERS (TK_HIST_THREADS / 32)
#define TK_RGB_ROUND ((65535 - TK_RGB_SHARERS) / (TK_RGB_SHARERS * 6) / TK_HIST_UNROLL - 1)
static_assert(TK_RGB_ROUND >= 1 &&
                  TK_RGB_SHARERS * 6 * (TK_RGB_ROUND + 1) * TK_HIST_UNROLL + TK_RGB_SHARERS <=
                      65535,
              "a 16-bit counter could wrap between flushes");
static_assert(TK_HIST_THREADS == TK_RGB_ROWS, "thread t flushes word row t");

/* Adds inc to the counter of byte value b in the set of this lane's copy that starts at shared
 * address `set` (32-bit shared addresses and an explicit reduction: with C pointers the compiler
 * rebuilt each address from a word index, 6.5 instructions a byte against 3 here). */
static __device__ __forceinline__ void packed_count(unsigned set, unsigned b, unsigned inc)
{
    asm volatile("red.shared.add.u32 [%0], %1;" ::"r"(set + b * 128u), "r"(inc) : "memory");
}

/* Byte j of w, zero-extended (one PRMT). */
static __device__ __forceinline__ unsigned byte_of(uint32_t w, int j)
{
    return __byte_perm(w, 0, 0x4440 + j);
}

/* Where this thread counts each place of its vectors: place c's set (a shared address in this
 * lane's copy) and half (inc). RGBA: place j (byte j of every word) is channel (head + j) mod
 * 4, set j / 2, half j % 2, the same for every vector. RGB: place c (bytes k = c mod 3) is
 * channel (ph + c) mod 3, R low and G high in set 0, B low in set 1, where ph = (head + i) mod 3
 * for vector i; the RGB grid is a multiple of 3 blocks, so the grid stride is a multiple of 3
 * vectors and ph is the same for every vector a thread visits. */
template <int CH> struct packed_places {
    unsigned set[CH == 4 ? 2 : 3], inc[CH == 4 ? 2 : 3];
    __device__ __forceinline__ packed_places(unsigned lane_set0, size_t head, size_t first)
    {
        if (CH == 4) {
            set[0] = lane_set0;
            set[1] = lane_set0 + TK_RGB_SET * 4;
            inc[0] = 1;
            inc[1] = 0x10000u;
        } else {
            unsigned ph = rgb_c0<3>(head, first);
#pragma unroll
            for (int c = 0; c < 3; c++) {
                unsigned ch = ph + c >= 3 ? ph + c - 3 : ph + c;
                set[c] = lane_set0 + (ch == 2 ? TK_RGB_SET * 4 : 0);
                inc[c] = ch == 1 ? 0x10000u : 1u;
            }
        }
    }
    /* The 16 bytes of one vector. */
    __device__ __forceinline__ void count(uint4 v) const
    {
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 16; k++) {
            int c = CH == 4 ? (k & 3) / 2 : k % 3;
            unsigned inc_k = CH == 4 ? ((k & 1) ? inc[1] : inc[0]) : inc[c];
            packed_count(set[c], byte_of(w[k / 4], k & 3), inc_k);
        }
    }
};

/* After a barrier: thread t adds word row t of every copy into its 64-bit totals and zeroes it
 * (copies read rotated by row, so a warp's reads fall in 32 banks); then a barrier. */
static __device__ __forceinline__ void packed_flush(unsigned *words, u64 &lo, u64 &hi)
{
    __syncthreads();
    unsigned *row = words + threadIdx.x * 32;
    unsigned l = 0, h = 0;
#pragma unroll 8
    for (int c = 0; c < 32; c++) {
        unsigned *p = row + ((c + threadIdx.x) & 31);
        l += *p & 0xffffu;
        h += *p >> 16;
        *p = 0;
    }
    lo += l;
    hi += h;
    __syncthreads();
}

template <int CH>
__global__ void __launch_bounds__(TK_HIST_THREADS, 3)
    tk_hist_rgb_packed_kernel(const uint8_t *__restrict__ in, size_t head, size_t body_vecs,
                              size_t tail, tk_hist_t *hist, int round)
{
    extern __shared__ unsigned packed_words[];
    for (int i = threadIdx.x; i < TK_RGB_ROWS * 32; i += TK_HIST_THREADS)
        packed_words[i] = 0;
    __syncthreads();
    const unsigned lane_set0 =
        (unsigned)__cvta_generic_to_shared(packed_words + (threadIdx.x & 31));
    u64 lo = 0, hi = 0;

    /* The body, grid-stride, TK_HIST_UNROLL loads in flight, flushing every `round` (at most
     * TK_RGB_ROUND) steps
     * while any thread of the block has more (a block-wide decision: the flush has barriers). */
    const uint4 *body = reinterpret_cast<const uint4 *>(in + head);
    const size_t stride = (size_t)gridDim.x * TK_HIST_THREADS;
    size_t i = (size_t)blockIdx.x * TK_HIST_THREADS + threadIdx.x;
    const packed_places<CH> places(lane_set0, head, i);
    for (;;) {
        for (int step = 0; step < round && i + (TK_HIST_UNROLL - 1) * stride < body_vecs;
             step++, i += TK_HIST_UNROLL * stride) {
            uint4 v[TK_HIST_UNROLL];
#pragma unroll
            for (int u = 0; u < TK_HIST_UNROLL; u++)
                v[u] = __ldg(body + i + u * stride);
#pragma unroll
            for (int u = 0; u < TK_HIST_UNROLL; u++)
                places.count(v[u]);
        }
        if (!__syncthreads_or(i + (TK_HIST_UNROLL - 1) * stride < body_vecs))
            break;
        packed_flush(packed_words, lo, hi);
    }
    for (; i < body_vecs; i += stride)
        places.count(__ldg(body + i));

    /* The unaligned ends, byte by byte, by block 0: byte e is channel e mod CH, for RGBA place
     * (e - head) mod 4. */
    if (blockIdx.x == 0 && threadIdx.x < head + tail) {
        size_t e = threadIdx.x < head ? threadIdx.x : head + body_vecs * 16 + (threadIdx.x - head);
        unsigned place = CH == 4 ? (unsigned)(e - head) & 3u : (unsigned)(e % 3);
        unsigned set = CH == 4 ? place / 2 : place == 2, half = CH == 4 ? place & 1 : place == 1;
        packed_count(lane_set0 + set * TK_RGB_SET * 4, in[e], half ? 0x10000u : 1u);
    }
    packed_flush(packed_words, lo, hi);

    /* Thread t holds row t: set t / 256, byte value t % 256, the low and high halves' totals. */
    unsigned set = threadIdx.x / 256, b = threadIdx.x % 256;
    unsigned ch_lo = CH == 4 ? ((unsigned)head + 2 * set) & 3 : 2 * set;
    unsigned ch_hi = CH == 4 ? ((unsigned)head + 2 * set + 1) & 3 : 1; /* RGB set 1: none */
    if (lo)
        atomicAdd(reinterpret_cast<u64 *>(&hist->bins[ch_lo * 256 + b]), lo);
    if (hi)
        atomicAdd(reinterpret_cast<u64 *>(&hist->bins[ch_hi * 256 + b]), hi);
}

/* ---- colour: launch ------------------------------------------------------------------------ */

/* kernel<CH, LAYOUT> and its shared memory per block. */
template <int CH, int LAYOUT> struct rgb_kernel {
    static constexpr size_t smem = LAYOUT == TK_RGB_PACKED
                                       ? TK_RGB_ROWS * 32 * sizeof(unsigned)
                                       : (size_t)CH * 256 * LAYOUT * sizeof(unsigned);
    static void (*fn())(const uint8_t *, size_t, size_t, size_t, tk_hist_t *, int)
    {
        constexpr int copies = LAYOUT == TK_RGB_PACKED ? 16 : LAYOUT;
        if (LAYOUT == TK_RGB_PACKED)
            return tk_hist_rgb_packed_kernel<CH>;
        return tk_hist_rgb_kernel<CH, copies>;
    }
};

/* Blocks of rgb_kernel<CH, LAYOUT> that fit on an SM of the current device, into *blocks
 * (cached; the shared-memory opt-in is set on the first call per device). */
template <int CH, int LAYOUT> static tally_status_t rgb_fit(int *blocks)
{
    static int cache[64];
    int dev = 0;
    tally_status_t st = tk_cuda_status(cudaGetDevice(&dev));
    if (st != TALLY_OK)
        return st;
    if (dev >= 0 && dev < 64 && (*blocks = __atomic_load_n(&cache[dev], __ATOMIC_RELAXED)) > 0)
        return TALLY_OK;
    typedef rgb_kernel<CH, LAYOUT> K;
    st = tk_cuda_status(
        cudaFuncSetAttribute(K::fn(), cudaFuncAttributeMaxDynamicSharedMemorySize, (int)K::smem));
    if (st == TALLY_OK)
        st = tk_cuda_status(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            blocks, K::fn(), TK_HIST_THREADS, K::smem));
    if (st != TALLY_OK)
        return st;
    if (*blocks < 1) /* cannot happen on sm_90 (up to 227 KiB per block); be safe */
        return TALLY_E_PARAM;
    if (dev >= 0 && dev < 64)
        __atomic_store_n(&cache[dev], *blocks, __ATOMIC_RELAXED);
    return TALLY_OK;
}

template <int CH, int LAYOUT>
static tally_status_t launch_rgb(const uint8_t *in, size_t pixels, const tk_cuda_tuning_t *t,
                                 tk_hist_t *hist, cudaStream_t stream)
{
    int fit = 0;
    tally_status_t st = rgb_fit<CH, LAYOUT>(&fit);
    if (st != TALLY_OK)
        return st;
    tk_body b = tk_split_body(in, pixels * CH, 1);
    unsigned per_sm = t->rgb_blocks_per_sm;
    unsigned blocks = tk_persistent_blocks(b.vecs, TK_HIST_THREADS * TK_HIST_UNROLL,
                                           per_sm < (unsigned)fit ? per_sm : (unsigned)fit);
    int round = t->rgb_flush_steps && t->rgb_flush_steps < TK_RGB_ROUND ? (int)t->rgb_flush_steps
                                                                        : TK_RGB_ROUND;
    if (CH == 3 && LAYOUT == TK_RGB_PACKED) /* packed_places: a stride of 3k vectors */
        blocks = blocks >= 3 ? blocks - blocks % 3 : 3;
    typedef rgb_kernel<CH, LAYOUT> K;
    K::fn()<<<blocks, TK_HIST_THREADS, K::smem, stream>>>(in, b.head, b.vecs, b.tail, hist, round);
    return tk_cuda_check_launch();
}

extern "C" size_t tk_cuda_hist_rgb_scratch_bytes(size_t n)
{
    (void)n;
    return 0;
}

extern "C" tally_status_t tk_cuda_hist_rgb(const uint8_t *d_in, size_t pixels, unsigned channels,
                                           tk_hist_t *d_hist, void *d_scratch, size_t scratch_bytes,
                                           cudaStream_t stream)
{
    (void)d_scratch;
    (void)scratch_bytes;
    const tk_cuda_tuning_t *t = tk_tuning();
    if (!t || !d_hist || (uintptr_t)d_hist % 8 || (pixels > 0 && !d_in))
        return TALLY_E_PARAM;
    if (channels != 3 && channels != 4)
        return TALLY_E_PARAM;
    if (pixels >= ((size_t)1 << 35) / channels) /* rgb_c0 counts vectors in 32 bits */
        return TALLY_E_PARAM;
    if (pixels == 0)
        return TALLY_OK;
    switch (t->rgb_layout * 8 + channels) {
    case TK_RGB_PACKED * 8 + 3:
        return launch_rgb<3, TK_RGB_PACKED>(d_in, pixels, t, d_hist, stream);
    case TK_RGB_PACKED * 8 + 4:
        return launch_rgb<4, TK_RGB_PACKED>(d_in, pixels, t, d_hist, stream);
    case TK_RGB_COPIES16 * 8 + 3:
        return launch_rgb<3, TK_RGB_COPIES16>(d_in, pixels, t, d_hist, stream);
    case TK_RGB_COPIES16 * 8 + 4:
        return launch_rgb<4, TK_RGB_COPIES16>(d_in, pixels, t, d_hist, stream);
    case TK_RGB_COPIES32 * 8 + 3:
        return launch_rgb<3, TK_RGB_COPIES32>(d_in, pixels, t, d_hist, stream);
    case TK_RGB_COPIES32 * 8 + 4:
        return launch_rgb<4, TK_RGB_COPIES32>(d_in, pixels, t, d_hist, stream);
    default:
        return TALLY_E_PARAM;
    }
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
