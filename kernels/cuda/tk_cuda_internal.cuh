/* SPDX-License-Identifier: Apache-2.0 */
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
 * holding status and value together, so a reader never sees a status without its value, alone on
 * its 128-byte L2 line; published values are relative to the batch (the scan adds its carry-in
 * locally). Tile ids are blockIdx.x:
 * blocks are dispatched in index order, so a tile's predecessors are always resident or done
 * (CUB relies on the same). The states live in caller scratch and are reset by
 * tk_lookback_init_kernel on the same stream before every pass.
 */
#ifndef TK_CUDA_INTERNAL_CUH
#define TK_CUDA_INTERNAL_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "tk_cuda.h"

/* ---- Tuning --------------------------------------------------------------------------------
 * Chosen on an NVIDIA H200 (no H100 could be lent), 1 GiB inputs, ratios to the D2D copy or
 * read-only ceiling of the same run; every version's figures are in bench/NOTES.md. Each constant
 * can be overridden with -D for a sweep (scripts/gpu-check.sh GPU_CHECK_VARIANTS), so a sweep
 * measures exactly the code that ships. What differs between architectures and bandwidth classes
 * (grids, the colour layout, the scan's shape) is a runtime tuning row instead
 * (tk_cuda_tuning.cu), swept in one build by `kernel_bench --sweep`.
 *
 * Threads per block of the filter and scan tiles: 256. 512 was measured no better for the filter
 * (0.52-0.62 vs 0.49-0.62 stable, 4 vectors) and worse for the int64 scan (0.737 vs 0.812, final
 * code), and with 8 vectors the 512-thread filter's staging tile exceeds 48 KiB. */
#ifndef TK_FILTER_THREADS
#define TK_FILTER_THREADS 256
#endif
#ifndef TK_SCAN_THREADS
#define TK_SCAN_THREADS 256
#endif
/* 16-byte vectors each lane loads per tile. 8 for int32 filter and scan (8192-element, 32 KiB
 * tiles): over 4 it lifted the stable filter from 0.49-0.62 to 0.58-0.69 and the int32 scan from
 * 0.56 to 0.69, because each tile pays a fixed look-back latency. uint8 filter: 4 (16 KiB; its
 * 16-bit count fields allow at most 4). The unordered filter is at 0.96-1.05 either way. */
#ifndef TK_FILTER_VECS_I32
#define TK_FILTER_VECS_I32 8
#endif
#ifndef TK_FILTER_VECS_U8
#define TK_FILTER_VECS_U8 4
#endif
#ifndef TK_SCAN_VECS
#define TK_SCAN_VECS 8
#endif
/* Histogram: 512 threads, at most 4 resident blocks per SM (the persistent grid; the tuning row
 * says how many, tk_cuda_tuning.cu), 4 16-byte loads in flight per thread: 0.975-0.985 of the
 * read-only pass (u8 uniform/all-equal/narrow) and 0.96 (i32) in the first measurement, so not
 * swept further. TK_HIST_BLOCKS_PER_SM is also the kernel's launch bound: at most 32 registers, so
 * that 4 blocks fit (the u16 kernel used 36 before its bin became tk_u16_slot: 3 blocks). */
#ifndef TK_HIST_THREADS
#define TK_HIST_THREADS 512
#endif
#ifndef TK_HIST_BLOCKS_PER_SM
#define TK_HIST_BLOCKS_PER_SM 4
#endif
#ifndef TK_HIST_UNROLL
#define TK_HIST_UNROLL 4
#endif
/* Look-back: windows of 32 predecessors read per round trip to L2: 1 (4 and 8 were worse,
 * 0.49-0.64 and 0.35-0.50 stable filter against 0.55-0.70: more traffic on the hot state lines).
 * Sleep between polls of a window that is not ready, doubling from the first value to the
 * second (ns; 0 = spin): 32..512, measured the same as spinning and 100..1000 (within 0.01), kept
 * so that waiting warps leave issue slots to kernels of other streams. */
#ifndef TK_LOOKBACK_WINDOWS
#define TK_LOOKBACK_WINDOWS 1
#endif
#ifndef TK_LOOKBACK_SLEEP_NS
#define TK_LOOKBACK_SLEEP_NS 32
#endif
#ifndef TK_LOOKBACK_SLEEP_MAX_NS
#define TK_LOOKBACK_SLEEP_MAX_NS 512
#endif
/* Spacing of consecutive tiles' states, in 16-byte states: 8, one 128-byte L2 line per tile.
 * The states of the newest tiles are written by many SMs and polled by many warps at once;
 * sharing lines serialises them. Adjacent states: scan int64 0.717, stable filter 0.67-0.78;
 * 2 (one sector): 0.783, 0.73-0.83; 8: 0.811, 0.76-0.86; 16: 0.802, 0.74-0.85. */
#ifndef TK_LOOKBACK_STRIDE
#define TK_LOOKBACK_STRIDE 8
#endif

/* ---- Look-back tile states ------------------------------------------------------------------ */

enum { TK_TILE_INVALID = 0, TK_TILE_AGGREGATE = 1, TK_TILE_INCLUSIVE = 2 };

/* A tile state as read: its status and its value (a sum or a count, relative to the batch). */
struct tk_tile_view {
    int status;
    long long value;
};

/* One 16-byte word {status, value}, written and read with single 16-byte volatile accesses
 * (the technique CUB uses for 8-byte values). An 8-byte packed word (value << 2 | status) was
 * measured slower (scan int64 0.628 vs 0.717 before the stride below): twice as many states per
 * L2 line. */
typedef longlong2 tk_tile_state_t;

static __device__ __forceinline__ void tk_tile_store(tk_tile_state_t *p, int status,
                                                     long long value)
{
    asm volatile("st.volatile.global.v2.s64 [%0], {%1, %2};" ::"l"(p), "l"((long long)status),
                 "l"(value)
                 : "memory");
}

static __device__ __forceinline__ tk_tile_view tk_tile_load(const tk_tile_state_t *p)
{
    long long st, v;
    asm volatile("ld.volatile.global.v2.s64 {%0, %1}, [%2];"
                 : "=l"(st), "=l"(v)
                 : "l"(p)
                 : "memory");
    return tk_tile_view{(int)st, v};
}

/* The state of tile i. */
static __device__ __forceinline__ tk_tile_state_t *tk_tile_at(tk_tile_state_t *states, long long i)
{
    return states + i * TK_LOOKBACK_STRIDE;
}
static __device__ __forceinline__ const tk_tile_state_t *tk_tile_at(const tk_tile_state_t *states,
                                                                    long long i)
{
    return states + i * TK_LOOKBACK_STRIDE;
}
/* Scratch bytes for the states of n tiles. */
static inline size_t tk_tile_states_bytes(size_t tiles)
{
    return tiles * TK_LOOKBACK_STRIDE * sizeof(tk_tile_state_t);
}

/* ---- Programmatic dependent launch (sm_90) ---------------------------------------------------
 * A kernel's small prologue on the same stream (the look-back states' reset, the filter's counter
 * set to zero) used to cost a launch gap and its own run before the main kernel's first load.
 * Measured on the H200 (issue 34, bench/NOTES.md): 32 MiB filters and scans back to back 4 %
 * faster, nothing at 1 GiB. The prologue kernel now lets its dependent
 * start at once (tk_prologue_done, first thing), and the main kernel, launched with
 * tk_launch_after, loads its tile beside it and waits (tk_after_prologue) only before it touches
 * what the prologue writes. Everything before the prologue on the stream is complete when the
 * main kernel starts, as without it: the prologue itself started only after that work. After a
 * kernel that does not call tk_prologue_done, or after a copy, the launch is an ordinary one. */
static __device__ __forceinline__ void tk_prologue_done(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

static __device__ __forceinline__ void tk_after_prologue(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* Launches kernel k (grid x block threads, no dynamic shared memory) on `stream`, allowed to start
 * before the kernel ahead of it has finished (see above); the launch's error. */
template <typename... P, typename... A>
static cudaError_t tk_launch_after(void (*k)(P...), unsigned grid, unsigned block,
                                   cudaStream_t stream, A... args)
{
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(block);
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, k, args...);
}

/* Resets the states of n tiles to INVALID (the padding between them is never read). */
__global__ void tk_lookback_init_kernel(tk_tile_state_t *states, unsigned n);
/* Resets the states of `tiles` tiles, launched on the caller's stream before each pass (no
 * launch when tiles is 0). */
void tk_lookback_init(tk_tile_state_t *states, unsigned tiles, cudaStream_t stream);

/* Inclusive scan of v across the 32 lanes of a warp (lane = threadIdx.x & 31), all lanes. */
template <typename U> static __device__ __forceinline__ U tk_warp_inclusive_scan(U v, int lane)
{
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        U t = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o)
            v += t;
    }
    return v;
}

static __device__ __forceinline__ long long tk_warp_sum64(long long v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Called by all 32 lanes of one warp of tile `tile` (> 0), after the tile published its
 * aggregate: returns (to every lane) the sum of all tiles before it. Sums are modulo 2^64.
 * Each round trip to L2 reads TK_LOOKBACK_WINDOWS windows of 32 predecessors at once (lane l,
 * window m: tile - 1 - l - 32 m), then consumes them nearest first; a window that still holds an
 * unpublished tile is re-read, with the ones behind it, after a sleep that doubles from
 * TK_LOOKBACK_SLEEP_NS up to TK_LOOKBACK_SLEEP_MAX_NS: spinning warps otherwise flood the few
 * L2 lines that hold the newest states and slow down the very tiles they wait for. */
static __device__ __forceinline__ long long tk_lookback(const tk_tile_state_t *states,
                                                        long long tile)
{
    const int lane = threadIdx.x & 31;
    unsigned long long prefix = 0;
    long long pos = tile - 1 - lane; /* this lane's tile in window 0 */
    unsigned sleep_ns = TK_LOOKBACK_SLEEP_NS;
    for (;;) {
        tk_tile_view s[TK_LOOKBACK_WINDOWS];
#pragma unroll
        for (int m = 0; m < TK_LOOKBACK_WINDOWS; m++) {
            /* Tiles before 0 read as an inclusive zero; tile 0 is inclusive, so they are never
             * the nearest inclusive predecessor. */
            long long p = pos - 32 * m;
            s[m] =
                p >= 0 ? tk_tile_load(tk_tile_at(states, p)) : tk_tile_view{TK_TILE_INCLUSIVE, 0};
        }
#pragma unroll
        for (int m = 0; m < TK_LOOKBACK_WINDOWS; m++) {
            if (__any_sync(0xffffffffu, s[m].status == TK_TILE_INVALID)) {
                if (TK_LOOKBACK_SLEEP_NS) {
                    __nanosleep(sleep_ns);
                    sleep_ns = sleep_ns * 2 < TK_LOOKBACK_SLEEP_MAX_NS ? sleep_ns * 2
                                                                       : TK_LOOKBACK_SLEEP_MAX_NS;
                }
                break; /* re-read from this window on */
            }
            unsigned incl = __ballot_sync(0xffffffffu, s[m].status == TK_TILE_INCLUSIVE);
            /* Lane 0 is the nearest: sum the lanes up to the nearest inclusive one. */
            int stop = incl ? __ffs(incl) - 1 : 31;
            prefix += (unsigned long long)tk_warp_sum64(lane <= stop ? s[m].value : 0);
            if (incl)
                return (long long)prefix;
            pos -= 32;
        }
    }
}

/* Called by all 32 lanes of one warp of tile `tile`: publishes the tile's total (lane 0) and
 * returns, to every lane, the sum of all tiles before it (0 for tile 0) by the look-back. */
template <typename T>
static __device__ __forceinline__ unsigned long long
tk_tile_publish(tk_tile_state_t *states, unsigned tile, T total, int lane)
{
    unsigned long long prefix = 0;
    if (tile == 0) {
        if (lane == 0)
            tk_tile_store(tk_tile_at(states, 0), TK_TILE_INCLUSIVE, (long long)total);
    } else {
        if (lane == 0)
            tk_tile_store(tk_tile_at(states, tile), TK_TILE_AGGREGATE, (long long)total);
        prefix = (unsigned long long)tk_lookback(states, tile);
        if (lane == 0)
            tk_tile_store(tk_tile_at(states, tile), TK_TILE_INCLUSIVE, (long long)(prefix + total));
    }
    return prefix;
}

/* minmax: 256 threads a block; blocks per SM and loads in flight per thread are the tuning
 * row's. */
#ifndef TK_MINMAX_THREADS
#define TK_MINMAX_THREADS 256
#endif

/* ---- Tuning rows (tk_cuda_tuning.cu) --------------------------------------------------------- */

/* The row the kernels use on the current device (tk_cuda.h, "tuning"); NULL when
 * TALLY_CUDA_TUNING names no row or the device cannot be read (the caller returns
 * TALLY_E_PARAM). */
const tk_cuda_tuning_t *tk_tuning(void);

/* ---- Persistent grids over 16-byte vectors (histograms, minmax) ------------------------------ */

/* [in, in + n * esize) as an unaligned head and tail (fewer than 16 bytes each, in elements)
 * around `vecs` 16-byte vectors. */
struct tk_body {
    size_t head, vecs, tail;
};
static inline tk_body tk_split_body(const void *in, size_t n, size_t esize)
{
    tk_body b;
    b.head = (size_t)((16 - (uintptr_t)in % 16) % 16) / esize;
    if (b.head > n)
        b.head = n;
    b.vecs = (n - b.head) * esize / 16;
    b.tail = n - b.head - b.vecs * (16 / esize);
    return b;
}

/* Multiprocessors of the current device (cached per device). */
int tk_cuda_sm_count(void);

/* Blocks for `vecs` vectors at `per_block` vectors a block per grid-stride step, at most
 * per_sm on every SM, at least 1. */
static inline unsigned tk_persistent_blocks(size_t vecs, size_t per_block, unsigned per_sm)
{
    size_t want = (vecs + per_block - 1) / per_block;
    size_t most = (size_t)tk_cuda_sm_count() * per_sm;
    return (unsigned)(want < 1 ? 1 : want > most ? most : want);
}

/* A grid-stride pass over `vecs` 16-byte vectors, UNROLL loads in flight per thread (all loads
 * first, then the work): f(v, i) for every vector i. */
template <int THREADS, int UNROLL, typename F>
static __device__ __forceinline__ void tk_for_each_vec(const uint4 *body, size_t vecs, F f)
{
    const size_t stride = (size_t)gridDim.x * THREADS;
    size_t i = (size_t)blockIdx.x * THREADS + threadIdx.x;
    for (; i + (UNROLL - 1) * stride < vecs; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            v[u] = __ldg(body + i + u * stride);
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            f(v[u], i + u * stride);
    }
    for (; i < vecs; i += stride)
        f(__ldg(body + i), i);
}

/* ---- Errors --------------------------------------------------------------------------------- */

/* cudaGetLastError after a launch: TALLY_OK or tk_cuda_status's TALLY_E_BACKEND. */
tally_status_t tk_cuda_check_launch(void);

static inline size_t tk_div_up(size_t a, size_t b)
{
    return (a + b - 1) / b;
}

#endif /* TK_CUDA_INTERNAL_CUH */
