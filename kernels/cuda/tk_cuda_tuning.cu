/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tk_cuda_tuning.cu — the kernels' tuning table, one row per SM architecture and memory-bandwidth
 * class (as CUB keeps a policy per architecture), each row beside the run that chose it; which
 * row a device gets; and the test switch that forces one (tk_cuda.h, "tuning").
 *
 * Why rows: on the H100 (3.35 TB/s) the kernels are bound by memory; on the H200 (4.8 TB/s, the
 * same SMs) several become bound by instruction issue and by how long a tile's look-back takes,
 * so the same constants are no longer the best on both (issue 34). What a row chooses is what
 * changes with the ratio of memory bandwidth to SM throughput: the colour histograms' shared
 * layout and occupancy, the scan's tile and L2 prefetch, the persistent grids' sizes. The
 * compile-time constants that are the same everywhere stay in tk_cuda_internal.cuh.
 *
 * Selection: the first row whose sm_major matches the device's compute capability (0 = any) and
 * whose min_peak_gbps is at most the device's peak bandwidth (2 x memory clock x bus width, from
 * cudaDeviceGetAttribute); the last row matches every device. It is made once per device and
 * cached (tk_cuda_buffers_open asks first, so tallyd selects at start-up). TALLY_CUDA_TUNING
 * (read at that selection) and tk_cuda_tuning_use override it for every device, so the kernel test
 * and the differential test run each row on any GPU.
 */
#include <stdlib.h>
#include <string.h>

#include "tk_cuda_internal.cuh"

/* Figures: bench/kernel_bench, 1 GiB device-resident inputs, ratio to the read-only pass (hist,
 * minmax) or the device-to-device copy (scan) of the same run; the runs are in bench/runs/. The
 * fields: name, sm_major, min_peak_gbps, hist_blocks_per_sm, rgb_layout, rgb_blocks_per_sm,
 * rgb_flush_steps, scan_shape (int64 out), scan_shape_i32, scan_prefetch_tiles,
 * minmax_blocks_per_sm, minmax_unroll. */
static const tk_cuda_tuning_t rows[] = {
    /* NVIDIA H200 (HBM3e, 4.8 TB/s peak), chosen by the sweep of 2026-12-02 03:31 UTC
     * (bench/runs/kernels-h200-2026-12-02.txt, "sweep" lines; ceilings copy 4184, read 4509,
     * widening copy 3756 GB/s):
     *   hist u8/i32/u16: 4 blocks/SM (3: the same within 0.005; 2: 0.95);
     *   colour: packed, 3 blocks/SM: rgb8 0.972-0.974, rgba8 0.963-0.972 (2 blocks 0.944-0.961;
     *     16 copies 0.64 / 0.71, 32 copies 0.65 / 0.78, rgba8 all-equal 16 copies 0.97);
     *   scan int64 out: V16 lean, no prefetch, 0.898 x copy = 1.00 x the widening copy (V8
     *     0.805, V8 lean 0.865, + prefetch 132 tiles 0.880, V12 lean 0.828); int32 out: V12
     *     lean 0.894 (V8 0.863, V8 lean 0.874, + prefetch 132 0.889, V16 lean 0.837); a prefetch
     *     of 264 tiles or more costs 0.05-0.2 everywhere (L2 thrash), so none;
     *   minmax: 8 blocks/SM x 4 loads 0.965-0.982 (4 x 4 0.961-0.979; 1 load 0.46-0.95).
     * int32 scan output since the sweep of 2026-12-02 17:42 UTC (bench/runs/
     * kernels-h200-2026-12-02-kern2.txt; copy 4192 GB/s): V12 lean x4, 0.923 x copy (prefetch
     * 132: 0.929; V16 lean x3 0.925; V12 lean 0.896, the row before, 0.890 in that run's table):
     * 48K elements in flight an SM instead of 36K, at the cost of 56 bytes of spills (L1);
     * the table with this row, 17:53 UTC (kernels-h200-2026-12-02-kern2-confirm.txt): 0.917. */
    {"sm90-hbm3e", 9, 4000, 4, TK_RGB_PACKED, 3, 0, TK_SCAN_V16_LEAN, TK_SCAN_V12_LEAN_B4, 0, 8,
     4},
    /* NVIDIA H100 SXM (HBM3, 3.35 TB/s) and any other Hopper part: the constants measured on the
     * H100 on 2026-11-26 (kernels-h100-2026-11-26.txt): hist u8 0.98-0.995, i32 0.99, rgb8
     * 0.92-0.94 and rgba8 0.97-0.98 with 16 copies, scan 0.913 / 0.937 x copy. Not yet measured
     * on an H100 (none could be lent on 2026-12-02; a later run decides): the H200's packed
     * colour layout and lean scan shapes, and minmax (4 x 4 here, the histogram's grid). */
    {"sm90-hbm3", 9, 0, 4, TK_RGB_COPIES16, 4, 0, TK_SCAN_V8, TK_SCAN_V8, 0, 4, 4},
    /* Any other device: the H100's row until one is measured. */
    {"default", 0, 0, 4, TK_RGB_COPIES16, 4, 0, TK_SCAN_V8, TK_SCAN_V8, 0, 4, 4},
};
#define TK_TUNING_ROWS (sizeof rows / sizeof rows[0])

extern "C" unsigned tk_cuda_tuning_rows(void)
{
    return (unsigned)TK_TUNING_ROWS;
}

extern "C" const tk_cuda_tuning_t *tk_cuda_tuning_row(unsigned i)
{
    return i < TK_TUNING_ROWS ? &rows[i] : NULL;
}

extern "C" const tk_cuda_tuning_t *tk_cuda_tuning_find(const char *name)
{
    for (unsigned i = 0; name && i < TK_TUNING_ROWS; i++)
        if (strcmp(rows[i].name, name) == 0)
            return &rows[i];
    return NULL;
}

extern "C" const tk_cuda_tuning_t *tk_cuda_tuning_suited(int sm_major, unsigned peak_gbps)
{
    for (unsigned i = 0; i < TK_TUNING_ROWS; i++)
        if ((rows[i].sm_major == 0 || rows[i].sm_major == sm_major) &&
            peak_gbps >= rows[i].min_peak_gbps)
            return &rows[i];
    return &rows[TK_TUNING_ROWS - 1];
}

extern "C" tally_status_t tk_cuda_tuning_select(int device, const tk_cuda_tuning_t **row)
{
    *row = NULL;
    const char *forced = getenv("TALLY_CUDA_TUNING");
    if (forced && *forced)
        return (*row = tk_cuda_tuning_find(forced)) ? TALLY_OK : TALLY_E_PARAM;
    int major = 0, clock_khz = 0, bus_bits = 0;
    tally_status_t st =
        tk_cuda_status(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    if (st != TALLY_OK)
        return st;
    /* Either may read 0 where the platform does not say: then no bandwidth-specific row. */
    if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess)
        clock_khz = bus_bits = 0;
    (void)cudaGetLastError();
    /* Double data rate: 2 x clock (kHz) x bus (bits) / 8, in GB/s. */
    unsigned gbps = (unsigned)((unsigned long long)clock_khz * (unsigned)bus_bits / 4000000u);
    *row = tk_cuda_tuning_suited(major, gbps);
    return TALLY_OK;
}

/* tk_cuda_tuning_use's row, when one is in use. */
static tk_cuda_tuning_t used;
static int use_set;

static bool valid(const tk_cuda_tuning_t *t)
{
    return t->hist_blocks_per_sm >= 1 && t->hist_blocks_per_sm <= 4 &&
           (t->rgb_layout == TK_RGB_PACKED || t->rgb_layout == TK_RGB_COPIES16 ||
            t->rgb_layout == TK_RGB_COPIES32) &&
           t->rgb_blocks_per_sm >= 1 && t->rgb_blocks_per_sm <= 4 && t->rgb_flush_steps <= 65535 &&
           t->scan_shape < TK_SCAN_SHAPES && t->scan_shape_i32 < TK_SCAN_SHAPES &&
           t->scan_prefetch_tiles <= 4096 && t->minmax_blocks_per_sm >= 1 &&
           t->minmax_blocks_per_sm <= 8 && (t->minmax_unroll == 1 || t->minmax_unroll == 4);
}

extern "C" tally_status_t tk_cuda_tuning_use(const tk_cuda_tuning_t *t)
{
    if (!t) {
        __atomic_store_n(&use_set, 0, __ATOMIC_RELEASE);
        return TALLY_OK;
    }
    if (!valid(t))
        return TALLY_E_PARAM;
    used = *t;
    __atomic_store_n(&use_set, 1, __ATOMIC_RELEASE);
    return TALLY_OK;
}

/* Enough for any host; devices beyond it are selected at every call. */
#define TK_TUNING_CACHE 64
static const tk_cuda_tuning_t *selected[TK_TUNING_CACHE];

const tk_cuda_tuning_t *tk_tuning(void)
{
    if (__atomic_load_n(&use_set, __ATOMIC_ACQUIRE))
        return &used;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    bool cacheable = dev >= 0 && dev < TK_TUNING_CACHE;
    const tk_cuda_tuning_t *row =
        cacheable ? __atomic_load_n(&selected[dev], __ATOMIC_ACQUIRE) : NULL;
    if (row)
        return row;
    if (tk_cuda_tuning_select(dev, &row) != TALLY_OK)
        return NULL;
    if (cacheable)
        __atomic_store_n(&selected[dev], row, __ATOMIC_RELEASE);
    return row;
}
