/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tk_cuda_scan.cu — device-wide prefix sums of int32 into int64 (or wrapping int32), inclusive or
 * exclusive, in one pass over the data, continuing from a carry that stays on the device.
 *
 * One block scans one tile of TK_SCAN_WARPS * 32 * TK_SCAN_VECS * 4 elements:
 *   1. Thread coarsening with 16-byte loads: each warp owns a contiguous segment of the tile and
 *      lane l loads vector v at segment + (v * 32 + l) * 4, so every load instruction reads 512
 *      contiguous bytes (fully coalesced) and each lane holds TK_SCAN_VECS runs of 4 elements.
 *   2. Each lane sums its runs; per vector index v a warp-wide inclusive scan with __shfl_up_sync
 *      gives every run's offset inside its warp segment (element order is v, lane, element).
 *   3. Block scan: the warp totals go through shared memory and warp 0 scans them.
 *   4. Across blocks, decoupled look-back (tk_cuda_internal.cuh): the tile's exclusive prefix
 *      (relative to the batch) arrives without a second pass over the data and without a host
 *      round trip. Every block adds *carry_in, read at its start; the last tile writes
 *      *carry_out.
 *   5. Each lane adds the prefixes to its registers and stores 16-byte vectors. For int64 output
 *      the four values of a lane are first exchanged with shuffles so that each warp store
 *      writes 512 contiguous bytes (two 16-byte stores per lane at a 32-byte stride left half of
 *      every sector to a second instruction: 0.50 of copy before, 0.72 after).
 * The tuning row (tk_cuda_tuning.cu) picks the shape: V (TK_SCAN_VECS by default) vectors a lane
 * with the run offsets of step 2 kept in registers across the look-back (TK_SCAN_V8, the H100's),
 * or a lean variant that keeps only the tile and each lane's total across it and redoes step 2's
 * warp scans in step 5 (a few shuffles per element, far inside the issue budget), with a launch
 * bound that lets more blocks, or bigger tiles, be resident per SM: the inclusive int64 kernel
 * took 108 registers (2 blocks of 256 per SM) with offsets in registers. And how many tiles ahead
 * each block prefetches input into L2 (prefetch.global.L2, one 128-byte line a thread, issued
 * before its own loads): the tile that starts after every resident block has moved on then finds
 * its input in L2, so a tile's fixed latency (load, look-back) is shorter and the DRAM queue
 * stays full while blocks wait in their look-backs.
 * All sums use unsigned 64-bit arithmetic, so they wrap modulo 2^64 as the contract says; the
 * int32 output is the low half of the same values. The last, partial tile (and inputs or outputs
 * that are not 16-byte aligned) take guarded scalar loads and stores instead of vectors.
 */
#include "tk_cuda_internal.cuh"

typedef unsigned long long u64;

#define TK_SCAN_WARPS (TK_SCAN_THREADS / 32)
/* Elements of a warp's segment and of a tile at V vectors a lane. */
#define TK_SCAN_WARP_ELEMS(V) (32 * (V)*4)
#define TK_SCAN_TILE(V) (TK_SCAN_WARPS * TK_SCAN_WARP_ELEMS(V))
/* The smallest tile of any shape: what the scratch is sized for. */
#define TK_SCAN_TILE_MIN TK_SCAN_TILE(TK_SCAN_VECS)

/* Step 1: the tile's elements into registers (16-byte loads when the whole tile is in range). */
template <int V, bool VEC>
static __device__ __forceinline__ void load_tile(const int32_t *__restrict__ in, size_t n,
                                                 unsigned tile, int (&x)[V][4])
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t seg = (size_t)tile * TK_SCAN_TILE(V) + (size_t)warp * TK_SCAN_WARP_ELEMS(V);
    if (VEC && (size_t)(tile + 1) * TK_SCAN_TILE(V) <= n) {
        const int4 *p = reinterpret_cast<const int4 *>(in + seg) + lane;
#pragma unroll
        for (int v = 0; v < V; v++) {
            int4 t = __ldg(p + v * 32);
            x[v][0] = t.x;
            x[v][1] = t.y;
            x[v][2] = t.z;
            x[v][3] = t.w;
        }
    } else {
#pragma unroll
        for (int v = 0; v < V; v++)
#pragma unroll
            for (int k = 0; k < 4; k++) {
                size_t i = seg + (size_t)(v * 32 + lane) * 4 + k;
                x[v][k] = i < n ? in[i] : 0;
            }
    }
}

/* Step 2: each run's exclusive offset inside the warp segment; returns the warp's total. */
/* The sum of a lane's run v (4 elements). */
template <int V> static __device__ __forceinline__ u64 run_sum(const int (&x)[V][4], int v)
{
    return (u64)(long long)x[v][0] + (u64)(long long)x[v][1] + (u64)(long long)x[v][2] +
           (u64)(long long)x[v][3];
}

template <int V>
static __device__ __forceinline__ u64 warp_offsets(const int (&x)[V][4], u64 (&run_prefix)[V])
{
    const int lane = threadIdx.x & 31;
    u64 acc = 0;
#pragma unroll
    for (int v = 0; v < V; v++) {
        u64 s = run_sum(x, v);
        u64 inc = tk_warp_inclusive_scan(s, lane);
        run_prefix[v] = acc + inc - s;
        acc += __shfl_sync(0xffffffffu, inc, 31);
    }
    return acc;
}

/* The lean shapes' step 2: only the warp's total (a reduction, no scan). */
template <int V> static __device__ __forceinline__ u64 warp_total_of(const int (&x)[V][4])
{
    u64 t = 0;
#pragma unroll
    for (int v = 0; v < V; v++)
        t += run_sum(x, v);
    return tk_warp_sum64((long long)t);
}

/* Steps 3 + 4, warp 0 only: block scan of the warp totals, the tile's prefix across blocks by
 * decoupled look-back (batch-relative sums), and each warp's starting value, carry included,
 * into warp_prefix. carry was read from *carry_in at the start of the block, long before this
 * tile publishes anything, and the last tile writes *carry_out only after every tile has
 * published: so carry_out may be the same word as carry_in. */
static __device__ __forceinline__ void tile_prefix(unsigned tile, unsigned num_tiles,
                                                   const u64 *warp_total, u64 *warp_prefix,
                                                   u64 carry, int64_t *carry_out,
                                                   tk_tile_state_t *states)
{
    const int lane = threadIdx.x & 31;
    u64 t = lane < TK_SCAN_WARPS ? warp_total[lane] : 0;
    u64 inc = tk_warp_inclusive_scan(t, lane);
    u64 tile_total = __shfl_sync(0xffffffffu, inc, 31);
    u64 prefix = tk_tile_publish(states, tile, tile_total, lane);
    if (tile == num_tiles - 1 && lane == 0)
        *carry_out = (int64_t)(carry + prefix + tile_total);
    if (lane < TK_SCAN_WARPS)
        warp_prefix[lane] = carry + prefix + inc - t;
}

/* Step 5: add the prefixes and store (16-byte vectors when the whole tile is in range). `base`
 * is the warp's first value; run v's offset in the warp is run_prefix[v], or (LEAN) the warp
 * scan of step 2 done again here. */
template <int V, bool LEAN, bool EXCL, bool OUT32, bool VEC>
static __device__ __forceinline__ void store_tile(void *__restrict__ out, size_t n, unsigned tile,
                                                  const int (&x)[V][4], const u64 (&run_prefix)[V],
                                                  u64 base)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t seg = (size_t)tile * TK_SCAN_TILE(V) + (size_t)warp * TK_SCAN_WARP_ELEMS(V);
    const bool full = VEC && (size_t)(tile + 1) * TK_SCAN_TILE(V) <= n;
    u64 acc = base;
#pragma unroll
    for (int v = 0; v < V; v++) {
        u64 r;
        if constexpr (LEAN) {
            u64 s = run_sum(x, v);
            u64 inc = tk_warp_inclusive_scan(s, lane);
            r = acc + inc - s;
            acc += __shfl_sync(0xffffffffu, inc, 31);
        } else {
            r = base + run_prefix[v];
        }
        u64 o[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u64 nr = r + (u64)(long long)x[v][k];
            o[k] = EXCL ? r : nr;
            r = nr;
        }
        size_t i0 = seg + (size_t)(v * 32 + lane) * 4;
        if (OUT32) {
            int32_t *o32 = static_cast<int32_t *>(out);
            if (full) {
                reinterpret_cast<int4 *>(o32 + i0)[0] =
                    make_int4((int)o[0], (int)o[1], (int)o[2], (int)o[3]);
            } else {
#pragma unroll
                for (int k = 0; k < 4; k++)
                    if (i0 + k < n)
                        o32[i0 + k] = (int32_t)(uint32_t)o[k];
            }
        } else {
            int64_t *o64 = static_cast<int64_t *>(out);
            if (full) {
                /* Two 16-byte stores per lane, each warp store covering 512 contiguous bytes:
                 * half h takes elements 64 h + 2 j, +1 (lane j) from lane 16 h + j / 2. */
                longlong2 *q = reinterpret_cast<longlong2 *>(o64 + seg + (size_t)v * 128);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int src = 16 * h + (lane >> 1);
                    u64 a0 = __shfl_sync(0xffffffffu, o[0], src);
                    u64 a1 = __shfl_sync(0xffffffffu, o[1], src);
                    u64 a2 = __shfl_sync(0xffffffffu, o[2], src);
                    u64 a3 = __shfl_sync(0xffffffffu, o[3], src);
                    q[32 * h + lane] = (lane & 1) ? make_longlong2((long long)a2, (long long)a3)
                                                  : make_longlong2((long long)a0, (long long)a1);
                }
            } else {
#pragma unroll
                for (int k = 0; k < 4; k++)
                    if (i0 + k < n)
                        o64[i0 + k] = (int64_t)o[k];
            }
        }
    }
}

/* Prefetches tile `tile`'s input (if any) into L2, one 128-byte line a thread at a time. */
template <int V>
static __device__ __forceinline__ void prefetch_tile(const int32_t *in, size_t n, size_t tile)
{
    size_t first = tile * TK_SCAN_TILE(V);
    if (first >= n)
        return;
    size_t bytes = (n - first < (size_t)TK_SCAN_TILE(V) ? n - first : (size_t)TK_SCAN_TILE(V)) * 4;
    const char *p = reinterpret_cast<const char *>(in + first);
    for (size_t off = (size_t)threadIdx.x * 128; off < bytes; off += TK_SCAN_THREADS * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
}

/* One tile per block, tile = blockIdx.x (blocks start in index order, so every tile's
 * predecessors are running or done). V vectors a lane, LEAN as store_tile; the lean shapes
 * prefetch prefetch_tiles ahead (0: none). */
template <int V, bool LEAN, bool EXCL, bool OUT32, bool VEC>
static __device__ __forceinline__ void
scan_tile(const int32_t *__restrict__ in, size_t n, void *__restrict__ out, const int64_t *carry_in,
          int64_t *carry_out, tk_tile_state_t *states, unsigned num_tiles, unsigned prefetch_tiles)
{
    __shared__ u64 warp_total[TK_SCAN_WARPS];
    __shared__ u64 warp_prefix[TK_SCAN_WARPS];
    __shared__ u64 carry;
    const unsigned tile = blockIdx.x;
    if (threadIdx.x == 0)
        carry = (u64)*carry_in;
    if (LEAN && prefetch_tiles)
        prefetch_tile<V>(in, n, (size_t)tile + prefetch_tiles);
    int x[V][4];
    u64 run_prefix[V];
    load_tile<V, VEC>(in, n, tile, x);
    u64 wt;
    if constexpr (LEAN)
        wt = warp_total_of(x);
    else
        wt = warp_offsets(x, run_prefix);
    if ((threadIdx.x & 31) == 0)
        warp_total[threadIdx.x >> 5] = wt;
    /* The states' reset (tk_lookback_init, the kernel before this one) is done from here on;
     * the loads above ran beside it (programmatic dependent launch, tk_launch_after). */
    tk_after_prologue();
    __syncthreads();
    if (threadIdx.x < 32)
        tile_prefix(tile, num_tiles, warp_total, warp_prefix, carry, carry_out, states);
    __syncthreads();
    store_tile<V, LEAN, EXCL, OUT32, VEC>(out, n, tile, x, run_prefix,
                                          warp_prefix[threadIdx.x >> 5]);
}

/* TK_SCAN_V8: no register cap (an explicit minimum of one block per SM changes nvcc's
 * allocation: 114 registers instead of 108 for the inclusive int64 kernel). */
template <bool EXCL, bool OUT32, bool VEC>
__global__ void __launch_bounds__(TK_SCAN_THREADS)
    tk_scan_kernel(const int32_t *__restrict__ in, size_t n, void *__restrict__ out,
                   const int64_t *carry_in, int64_t *carry_out, tk_tile_state_t *states,
                   unsigned num_tiles, unsigned prefetch_tiles)
{
    scan_tile<TK_SCAN_VECS, false, EXCL, OUT32, VEC>(in, n, out, carry_in, carry_out, states,
                                                     num_tiles, prefetch_tiles);
}

/* Resident blocks per SM that the lean shapes' aligned kernels are built for (the launch bound
 * caps their registers to fit): as many as fit without spilling (nvcc 13.0, sm_90: int64 output
 * needs about 16 registers more), or MORE = one block more for int32 output (TK_SCAN_V12_LEAN_B4,
 * TK_SCAN_V16_LEAN_B3: 64 and 80 registers, each with 56 bytes of spill stores and 72 of loads,
 * around the look-back, in L1). The unaligned kernels have no cap. */
template <int V, bool MORE, bool OUT32, bool VEC> struct scan_min_blocks {
    static constexpr int value = !VEC      ? 1
                                 : V == 8  ? (OUT32 ? 4 : 3)
                                 : V == 12 ? (OUT32 ? 3 : 2) + MORE
                                           : 2 + MORE;
};

template <int V, bool MORE, bool EXCL, bool OUT32, bool VEC>
__global__ void __launch_bounds__(TK_SCAN_THREADS, (scan_min_blocks<V, MORE, OUT32, VEC>::value))
    tk_scan_lean_kernel(const int32_t *__restrict__ in, size_t n, void *__restrict__ out,
                        const int64_t *carry_in, int64_t *carry_out, tk_tile_state_t *states,
                        unsigned num_tiles, unsigned prefetch_tiles)
{
    scan_tile<V, true, EXCL, OUT32, VEC>(in, n, out, carry_in, carry_out, states, num_tiles,
                                         prefetch_tiles);
}

__global__ void tk_scan_empty_kernel(const int64_t *carry_in, int64_t *carry_out)
{
    *carry_out = *carry_in;
}

/* One call's arguments, for the launches below. */
struct scan_args {
    const int32_t *in;
    size_t n;
    void *out;
    const int64_t *carry_in;
    int64_t *carry_out;
    tk_tile_state_t *states;
    unsigned prefetch_tiles;
    cudaStream_t stream;
};

/* The scan kernel, launched to start beside the states' reset before it (tk_launch_after). */
template <int V, bool LEAN, bool MORE, bool EXCL, bool OUT32, bool VEC>
static cudaError_t launch_kernel(const scan_args &a, unsigned tiles)
{
    if (LEAN)
        return tk_launch_after(tk_scan_lean_kernel<V, MORE, EXCL, OUT32, VEC>, tiles,
                               TK_SCAN_THREADS, a.stream, a.in, a.n, a.out, a.carry_in,
                               a.carry_out, a.states, tiles, a.prefetch_tiles);
    return tk_launch_after(tk_scan_kernel<EXCL, OUT32, VEC>, tiles, TK_SCAN_THREADS, a.stream,
                           a.in, a.n, a.out, a.carry_in, a.carry_out, a.states, tiles,
                           a.prefetch_tiles);
}

template <int V, bool LEAN, bool MORE, bool EXCL, bool OUT32>
static cudaError_t launch_mode(bool vec, const scan_args &a)
{
    unsigned tiles = (unsigned)tk_div_up(a.n, TK_SCAN_TILE(V));
    if (vec)
        return launch_kernel<V, LEAN, MORE, EXCL, OUT32, true>(a, tiles);
    return launch_kernel<V, LEAN, MORE, EXCL, OUT32, false>(a, tiles);
}

/* Resets the states of the shape's tiles, then the scan. */
template <int V, bool LEAN, bool MORE = false>
static cudaError_t launch_shape(bool exclusive, bool out_i32, bool vec, const scan_args &a)
{
    tk_lookback_init(a.states, (unsigned)tk_div_up(a.n, TK_SCAN_TILE(V)), a.stream);
    if (exclusive && out_i32)
        return launch_mode<V, LEAN, MORE, true, true>(vec, a);
    if (exclusive)
        return launch_mode<V, LEAN, false, true, false>(vec, a);
    if (out_i32)
        return launch_mode<V, LEAN, MORE, false, true>(vec, a);
    return launch_mode<V, LEAN, false, false, false>(vec, a);
}

extern "C" size_t tk_cuda_scan_scratch_bytes(size_t n)
{
    return tk_tile_states_bytes(tk_div_up(n, TK_SCAN_TILE_MIN));
}

extern "C" tally_status_t tk_cuda_scan(const int32_t *d_in, size_t n, int exclusive, int out_i32,
                                       void *d_out, const int64_t *d_carry_in, int64_t *d_carry_out,
                                       void *d_scratch, size_t scratch_bytes, cudaStream_t stream)
{
    const tk_cuda_tuning_t *t = tk_tuning();
    size_t need = tk_cuda_scan_scratch_bytes(n);
    if (!t || !d_carry_in || !d_carry_out || (n > 0 && (!d_in || !d_out)))
        return TALLY_E_PARAM;
    if (scratch_bytes < need || (need && (!d_scratch || (uintptr_t)d_scratch % 16)))
        return TALLY_E_PARAM;
    if ((uintptr_t)d_in % 4 || (uintptr_t)d_out % (out_i32 ? 4 : 8))
        return TALLY_E_PARAM;
    if (tk_div_up(n, TK_SCAN_TILE_MIN) > 0x7fffffffu)
        return TALLY_E_PARAM; /* the grid's size */

    if (n == 0) {
        tk_scan_empty_kernel<<<1, 1, 0, stream>>>(d_carry_in, d_carry_out);
        return tk_cuda_check_launch();
    }
    scan_args a = {d_in,
                   n,
                   d_out,
                   d_carry_in,
                   d_carry_out,
                   static_cast<tk_tile_state_t *>(d_scratch),
                   t->scan_prefetch_tiles,
                   stream};
    bool vec = (uintptr_t)d_in % 16 == 0 && (uintptr_t)d_out % 16 == 0;
    cudaError_t err;
    switch (out_i32 ? t->scan_shape_i32 : t->scan_shape) {
    case TK_SCAN_V8:
        err = launch_shape<TK_SCAN_VECS, false>(exclusive, out_i32, vec, a);
        break;
    case TK_SCAN_V8_LEAN:
        err = launch_shape<8, true>(exclusive, out_i32, vec, a);
        break;
    case TK_SCAN_V12_LEAN:
        err = launch_shape<12, true>(exclusive, out_i32, vec, a);
        break;
    case TK_SCAN_V16_LEAN:
        err = launch_shape<16, true>(exclusive, out_i32, vec, a);
        break;
    case TK_SCAN_V12_LEAN_B4:
        err = launch_shape<12, true, true>(exclusive, out_i32, vec, a);
        break;
    case TK_SCAN_V16_LEAN_B3:
        err = launch_shape<16, true, true>(exclusive, out_i32, vec, a);
        break;
    default:
        return TALLY_E_PARAM;
    }
    return err != cudaSuccess ? tk_cuda_status(err) : tk_cuda_check_launch();
}
