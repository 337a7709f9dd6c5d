/*
 * tk_cuda_internal.cuh — what the kernel files share: the tuning constants (all in one place,
 * each with the measurement that chose it), the single-pass decoupled look-back used by the
 * stable filter and the scan, vector-load helpers and the launch-error plumbing.
 *
 * Decoupled look-back (Merrill & Garland, "Single-pass Parallel Prefix Scan with Decoupled
 * Look-back", 2016): tile i publishes its own aggregate as soon as it knows it (status AGGREGATE),
 * then warp 0 walks back over the predecessors 32 at a time, summing aggregates until it meets a
 * tile that already published an INCLUSIVE prefix; it then publishes its own inclusive prefix.
 * A tile therefore waits only for its predecessors' local reductions, not for their look-backs,
 * and the whole scan reads and writes each element once. Each tile's state is one 16-byte word
 * {status, value} written and read with a single 16-byte volatile access, so a reader never sees
 * a status without its value (the technique CUB uses for 8-byte values). Tile ids are blockIdx.x:
 * blocks are dispatched in index order, so a tile's predecessors are always resident or done
 * (CUB relies on the same). The states live in caller scratch and are reset by
 * tk_lookback_init_kernel on the same stream before every pass.
 */
#ifndef TK_CUDA_INTERNAL_CUH
#define TK_CUDA_INTERNAL_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "tk_cuda.h"

/* ---- Tuning (H100 80GB HBM3, 1 GiB inputs; history in bench/NOTES.md) ------------------------
 * Threads per block for filter and scan tiles: 256 (8 warps) gives 8 resident blocks per SM
 * with the registers these kernels use, so ~128 KiB of loads are in flight per SM. */
#define TK_TILE_THREADS 256
#define TK_TILE_WARPS (TK_TILE_THREADS / 32)
/* 16-byte vectors each lane loads per tile. Filter int32: 4 (4096 elements, 16 KiB per tile);
 * filter uint8: 4 (16 KiB per tile); scan: 4 (4096 elements). See NOTES.md for the sweep. */
#ifndef TK_FILTER_VECS_I32
#define TK_FILTER_VECS_I32 4
#endif
#ifndef TK_FILTER_VECS_U8
#define TK_FILTER_VECS_U8 4
#endif
#ifndef TK_SCAN_VECS
#define TK_SCAN_VECS 4
#endif
/* Histogram: threads per block, resident blocks per SM for the persistent grid, and 16-byte
 * vectors each thread loads before it starts counting (memory-level parallelism). */
#ifndef TK_HIST_THREADS
#define TK_HIST_THREADS 512
#endif
#ifndef TK_HIST_BLOCKS_PER_SM
#define TK_HIST_BLOCKS_PER_SM 4
#endif
#ifndef TK_HIST_UNROLL
#define TK_HIST_UNROLL 4
#endif

/* ---- Look-back tile states ------------------------------------------------------------------ */

enum { TK_TILE_INVALID = 0, TK_TILE_AGGREGATE = 1, TK_TILE_INCLUSIVE = 2 };

/* One tile's published state: x = status, y = value (an int64 sum or count). */
typedef longlong2 tk_tile_state_t;

static __device__ __forceinline__ void tk_tile_store(tk_tile_state_t *p, long long status,
                                                     long long value)
{
    asm volatile("st.volatile.global.v2.s64 [%0], {%1, %2};" ::"l"(p), "l"(status), "l"(value)
                 : "memory");
}

static __device__ __forceinline__ tk_tile_state_t tk_tile_load(const tk_tile_state_t *p)
{
    tk_tile_state_t s;
    asm volatile("ld.volatile.global.v2.s64 {%0, %1}, [%2];"
                 : "=l"(s.x), "=l"(s.y)
                 : "l"(p)
                 : "memory");
    return s;
}

/* Resets n tile states to INVALID. Launched on the caller's stream before each pass. */
__global__ void tk_lookback_init_kernel(tk_tile_state_t *states, unsigned n);
/* Launches tk_lookback_init_kernel (no launch when n is 0). */
void tk_lookback_init(tk_tile_state_t *states, unsigned n, cudaStream_t stream);

static __device__ __forceinline__ long long tk_warp_sum64(long long v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Called by all 32 lanes of one warp of tile `tile` (> 0), after the tile published its
 * aggregate: returns (to every lane) the sum of all tiles before it. Sums are modulo 2^64. */
static __device__ __forceinline__ long long tk_lookback(const tk_tile_state_t *states,
                                                        long long tile)
{
    const int lane = threadIdx.x & 31;
    unsigned long long prefix = 0;
    long long pos = tile - 1 - lane;
    for (;;) {
        tk_tile_state_t s;
        for (;;) {
            /* Out-of-range lanes read as an inclusive zero; tile 0 is inclusive, so such lanes
             * are never the nearest inclusive predecessor. */
            s = pos >= 0 ? tk_tile_load(states + pos) : make_longlong2(TK_TILE_INCLUSIVE, 0);
            if (!__any_sync(0xffffffffu, s.x == TK_TILE_INVALID))
                break;
        }
        unsigned incl = __ballot_sync(0xffffffffu, s.x == TK_TILE_INCLUSIVE);
        /* Lane 0 is the nearest predecessor: sum lanes up to the nearest inclusive one. */
        int stop = incl ? __ffs(incl) - 1 : 31;
        long long v = lane <= stop ? s.y : 0;
        prefix += (unsigned long long)tk_warp_sum64(v);
        if (incl)
            return (long long)prefix;
        pos -= 32;
    }
}

/* ---- Errors --------------------------------------------------------------------------------- */

/* cudaGetLastError after a launch: TALLY_OK or tk_cuda_status's TALLY_E_BACKEND. */
tally_status_t tk_cuda_check_launch(void);
/* Multiprocessors of the current device (cached per device). */
int tk_cuda_sm_count(void);

static inline size_t tk_div_up(size_t a, size_t b)
{
    return (a + b - 1) / b;
}

#endif /* TK_CUDA_INTERNAL_CUH */
