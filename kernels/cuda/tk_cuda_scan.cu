/*
 * tk_cuda_scan.cu — device-wide prefix sums of int32 into int64 (or wrapping int32), inclusive or
 * exclusive, in one pass over the data, continuing from a carry that stays on the device.
 *
 * One block scans one tile of TK_TILE_WARPS * 32 * TK_SCAN_VECS * 4 elements:
 *   1. Thread coarsening with 16-byte loads: each warp owns a contiguous segment of the tile and
 *      lane l loads vector v at segment + (v * 32 + l) * 4, so every load instruction reads 512
 *      contiguous bytes (fully coalesced) and each lane holds TK_SCAN_VECS runs of 4 elements.
 *   2. Each lane sums its runs; per vector index v a warp-wide inclusive scan with __shfl_up_sync
 *      gives every run's offset inside its warp segment (element order is v, lane, element).
 *   3. Block scan: the warp totals go through shared memory and warp 0 scans them.
 *   4. Across blocks, decoupled look-back (tk_cuda_internal.cuh): the tile's exclusive prefix
 *      arrives without a second pass over the data and without a host round trip. Tile 0 starts
 *      from *carry_in; the last tile writes *carry_out.
 *   5. Each lane adds the prefixes to its registers and stores 16-byte vectors.
 * All sums use unsigned 64-bit arithmetic, so they wrap modulo 2^64 as the contract says; the
 * int32 output is the low half of the same values. The last, partial tile (and inputs or outputs
 * that are not 16-byte aligned) take guarded scalar loads and stores instead of vectors.
 */
#include "tk_cuda_internal.cuh"

typedef unsigned long long u64;

#define TK_SCAN_WARP_ELEMS (32 * TK_SCAN_VECS * 4)
#define TK_SCAN_TILE (TK_TILE_WARPS * TK_SCAN_WARP_ELEMS)

static __device__ __forceinline__ u64 warp_inclusive_scan(u64 v, int lane)
{
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        u64 t = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o)
            v += t;
    }
    return v;
}

template <bool EXCL, bool OUT32, bool VEC>
__global__ void __launch_bounds__(TK_TILE_THREADS)
    tk_scan_kernel(const int32_t *__restrict__ in, size_t n, void *__restrict__ out,
                   const int64_t *carry_in, int64_t *carry_out, tk_tile_state_t *states,
                   unsigned num_tiles)
{
    constexpr int V = TK_SCAN_VECS;
    __shared__ u64 warp_total[TK_TILE_WARPS];
    __shared__ u64 warp_prefix[TK_TILE_WARPS];

    const unsigned tile = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const size_t seg = (size_t)tile * TK_SCAN_TILE + (size_t)warp * TK_SCAN_WARP_ELEMS;
    const bool full = VEC && (size_t)(tile + 1) * TK_SCAN_TILE <= n;

    /* 1. Load: all vectors first, so V loads are in flight per lane. */
    int x[V][4];
    if (full) {
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

    /* 2. Run sums and their offsets inside the warp segment. */
    u64 run_prefix[V]; /* exclusive, within the warp segment */
    u64 acc = 0;
#pragma unroll
    for (int v = 0; v < V; v++) {
        u64 s = (u64)(long long)x[v][0] + (u64)(long long)x[v][1] + (u64)(long long)x[v][2] +
                (u64)(long long)x[v][3];
        u64 inc = warp_inclusive_scan(s, lane);
        run_prefix[v] = acc + inc - s;
        acc += __shfl_sync(0xffffffffu, inc, 31);
    }
    if (lane == 0)
        warp_total[warp] = acc;
    __syncthreads();

    /* 3 + 4. Warp 0: block scan of the warp totals, then the tile's prefix across blocks. */
    if (warp == 0) {
        u64 t = lane < TK_TILE_WARPS ? warp_total[lane] : 0;
        u64 inc = warp_inclusive_scan(t, lane);
        u64 tile_total = __shfl_sync(0xffffffffu, inc, 31);
        u64 tile_prefix;
        if (tile == 0) {
            tile_prefix = (u64)*carry_in;
            if (lane == 0)
                tk_tile_store(states, TK_TILE_INCLUSIVE, (long long)(tile_prefix + tile_total));
        } else {
            if (lane == 0)
                tk_tile_store(states + tile, TK_TILE_AGGREGATE, (long long)tile_total);
            tile_prefix = (u64)tk_lookback(states, tile);
            if (lane == 0)
                tk_tile_store(states + tile, TK_TILE_INCLUSIVE,
                              (long long)(tile_prefix + tile_total));
        }
        if (tile == num_tiles - 1 && lane == 0)
            *carry_out = (int64_t)(tile_prefix + tile_total);
        if (lane < TK_TILE_WARPS)
            warp_prefix[lane] = tile_prefix + inc - t;
    }
    __syncthreads();

    /* 5. Add the prefixes and store. */
    const u64 base = warp_prefix[warp];
#pragma unroll
    for (int v = 0; v < V; v++) {
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
                longlong2 *q = reinterpret_cast<longlong2 *>(o64 + i0);
                q[0] = make_longlong2((long long)o[0], (long long)o[1]);
                q[1] = make_longlong2((long long)o[2], (long long)o[3]);
            } else {
#pragma unroll
                for (int k = 0; k < 4; k++)
                    if (i0 + k < n)
                        o64[i0 + k] = (int64_t)o[k];
            }
        }
    }
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
        tk_scan_kernel<EXCL, OUT32, true><<<tiles, TK_TILE_THREADS, 0, s>>>(in, n, out, ci, co, st,
                                                                            tiles);
    else
        tk_scan_kernel<EXCL, OUT32, false><<<tiles, TK_TILE_THREADS, 0, s>>>(in, n, out, ci, co,
                                                                             st, tiles);
}

extern "C" size_t tk_cuda_scan_scratch_bytes(size_t n)
{
    return tk_div_up(n, TK_SCAN_TILE) * sizeof(tk_tile_state_t);
}

extern "C" tally_status_t tk_cuda_scan(const int32_t *d_in, size_t n, int exclusive, int out_i32,
                                       void *d_out, const int64_t *d_carry_in,
                                       int64_t *d_carry_out, void *d_scratch,
                                       size_t scratch_bytes, cudaStream_t stream)
{
    size_t need = tk_cuda_scan_scratch_bytes(n);
    if (!d_carry_in || !d_carry_out || (n > 0 && (!d_in || !d_out)))
        return TALLY_E_PARAM;
    if (scratch_bytes < need || (need && (!d_scratch || (uintptr_t)d_scratch % 16)))
        return TALLY_E_PARAM;
    if ((uintptr_t)d_in % 4 || (uintptr_t)d_out % (out_i32 ? 4 : 8))
        return TALLY_E_PARAM;
    if (tk_div_up(n, TK_SCAN_TILE) > 0x7fffffffu)
        return TALLY_E_PARAM;

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
        launch_scan<false, false>(vec, tiles, stream, d_in, n, d_out, d_carry_in, d_carry_out,
                                  st);
    return tk_cuda_check_launch();
}
