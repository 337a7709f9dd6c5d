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
 * All sums use unsigned 64-bit arithmetic, so they wrap modulo 2^64 as the contract says; the
 * int32 output is the low half of the same values. The last, partial tile (and inputs or outputs
 * that are not 16-byte aligned) take guarded scalar loads and stores instead of vectors.
 */
#include "tk_cuda_internal.cuh"

typedef unsigned long long u64;

#define TK_SCAN_WARPS (TK_SCAN_THREADS / 32)
#define TK_SCAN_WARP_ELEMS (32 * TK_SCAN_VECS * 4)
#define TK_SCAN_TILE (TK_SCAN_WARPS * TK_SCAN_WARP_ELEMS)

/* Step 1: the tile's elements into registers (16-byte loads when the whole tile is in range). */
template <bool VEC>
static __device__ __forceinline__ void load_tile(const int32_t *__restrict__ in, size_t n,
                                                 unsigned tile, int (&x)[TK_SCAN_VECS][4])
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t seg = (size_t)tile * TK_SCAN_TILE + (size_t)warp * TK_SCAN_WARP_ELEMS;
    if (VEC && (size_t)(tile + 1) * TK_SCAN_TILE <= n) {
        const int4 *p = reinterpret_cast<const int4 *>(in + seg) + lane;
#pragma unroll
        for (int v = 0; v < TK_SCAN_VECS; v++) {
            int4 t = __ldg(p + v * 32);
            x[v][0] = t.x;
            x[v][1] = t.y;
            x[v][2] = t.z;
            x[v][3] = t.w;
        }
    } else {
#pragma unroll
        for (int v = 0; v < TK_SCAN_VECS; v++)
#pragma unroll
            for (int k = 0; k < 4; k++) {
                size_t i = seg + (size_t)(v * 32 + lane) * 4 + k;
                x[v][k] = i < n ? in[i] : 0;
            }
    }
}

/* Step 2: each run's exclusive offset inside the warp segment; returns the warp's total. */
static __device__ __forceinline__ u64 warp_offsets(const int (&x)[TK_SCAN_VECS][4],
                                                   u64 (&run_prefix)[TK_SCAN_VECS])
{
    const int lane = threadIdx.x & 31;
    u64 acc = 0;
#pragma unroll
    for (int v = 0; v < TK_SCAN_VECS; v++) {
        u64 s = (u64)(long long)x[v][0] + (u64)(long long)x[v][1] + (u64)(long long)x[v][2] +
                (u64)(long long)x[v][3];
        u64 inc = tk_warp_inclusive_scan(s, lane);
        run_prefix[v] = acc + inc - s;
        acc += __shfl_sync(0xffffffffu, inc, 31);
    }
    return acc;
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

/* Step 5: add the prefixes and store (16-byte vectors when the whole tile is in range). */
template <bool EXCL, bool OUT32, bool VEC>
static __device__ __forceinline__ void store_tile(void *__restrict__ out, size_t n, unsigned tile,
                                                  const int (&x)[TK_SCAN_VECS][4],
                                                  const u64 (&run_prefix)[TK_SCAN_VECS], u64 base)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t seg = (size_t)tile * TK_SCAN_TILE + (size_t)warp * TK_SCAN_WARP_ELEMS;
    const bool full = VEC && (size_t)(tile + 1) * TK_SCAN_TILE <= n;
#pragma unroll
    for (int v = 0; v < TK_SCAN_VECS; v++) {
        u64 r = base + run_prefix[v];
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

/* One tile per block, tile = blockIdx.x (blocks start in index order, so every tile's
 * predecessors are running or done). */
template <bool EXCL, bool OUT32, bool VEC>
__global__ void __launch_bounds__(TK_SCAN_THREADS)
    tk_scan_kernel(const int32_t *__restrict__ in, size_t n, void *__restrict__ out,
                   const int64_t *carry_in, int64_t *carry_out, tk_tile_state_t *states,
                   unsigned num_tiles)
{
    __shared__ u64 warp_total[TK_SCAN_WARPS];
    __shared__ u64 warp_prefix[TK_SCAN_WARPS];
    __shared__ u64 carry;
    const unsigned tile = blockIdx.x;
    if (threadIdx.x == 0)
        carry = (u64)*carry_in;
    int x[TK_SCAN_VECS][4];
    u64 run_prefix[TK_SCAN_VECS];
    load_tile<VEC>(in, n, tile, x);
    u64 wt = warp_offsets(x, run_prefix);
    if ((threadIdx.x & 31) == 0)
        warp_total[threadIdx.x >> 5] = wt;
    __syncthreads();
    if (threadIdx.x < 32)
        tile_prefix(tile, num_tiles, warp_total, warp_prefix, carry, carry_out, states);
    __syncthreads();
    store_tile<EXCL, OUT32, VEC>(out, n, tile, x, run_prefix, warp_prefix[threadIdx.x >> 5]);
}

__global__ void tk_scan_empty_kernel(const int64_t *carry_in, int64_t *carry_out)
{
    *carry_out = *carry_in;
}

template <bool EXCL, bool OUT32>
static void launch_scan(bool vec, unsigned tiles, cudaStream_t s, const int32_t *in, size_t n,
                        void *out, const int64_t *ci, int64_t *co, tk_tile_state_t *st)
{
    if (vec)
        tk_scan_kernel<EXCL, OUT32, true>
            <<<tiles, TK_SCAN_THREADS, 0, s>>>(in, n, out, ci, co, st, tiles);
    else
        tk_scan_kernel<EXCL, OUT32, false>
            <<<tiles, TK_SCAN_THREADS, 0, s>>>(in, n, out, ci, co, st, tiles);
}

extern "C" size_t tk_cuda_scan_scratch_bytes(size_t n)
{
    return tk_tile_states_bytes(tk_div_up(n, TK_SCAN_TILE));
}

extern "C" tally_status_t tk_cuda_scan(const int32_t *d_in, size_t n, int exclusive, int out_i32,
                                       void *d_out, const int64_t *d_carry_in, int64_t *d_carry_out,
                                       void *d_scratch, size_t scratch_bytes, cudaStream_t stream)
{
    size_t need = tk_cuda_scan_scratch_bytes(n);
    if (!d_carry_in || !d_carry_out || (n > 0 && (!d_in || !d_out)))
        return TALLY_E_PARAM;
    if (scratch_bytes < need || (need && (!d_scratch || (uintptr_t)d_scratch % 16)))
        return TALLY_E_PARAM;
    if ((uintptr_t)d_in % 4 || (uintptr_t)d_out % (out_i32 ? 4 : 8))
        return TALLY_E_PARAM;
    if (tk_div_up(n, TK_SCAN_TILE) > 0x7fffffffu)
        return TALLY_E_PARAM; /* the grid's size */

    if (n == 0) {
        tk_scan_empty_kernel<<<1, 1, 0, stream>>>(d_carry_in, d_carry_out);
        return tk_cuda_check_launch();
    }
    unsigned tiles = (unsigned)tk_div_up(n, TK_SCAN_TILE);
    tk_tile_state_t *st = static_cast<tk_tile_state_t *>(d_scratch);
    bool vec = (uintptr_t)d_in % 16 == 0 && (uintptr_t)d_out % 16 == 0;
    tk_lookback_init(st, tiles, stream);
    if (exclusive && out_i32)
        launch_scan<true, true>(vec, tiles, stream, d_in, n, d_out, d_carry_in, d_carry_out, st);
    else if (exclusive)
        launch_scan<true, false>(vec, tiles, stream, d_in, n, d_out, d_carry_in, d_carry_out, st);
    else if (out_i32)
        launch_scan<false, true>(vec, tiles, stream, d_in, n, d_out, d_carry_in, d_carry_out, st);
    else
        launch_scan<false, false>(vec, tiles, stream, d_in, n, d_out, d_carry_in, d_carry_out, st);
    return tk_cuda_check_launch();
}
