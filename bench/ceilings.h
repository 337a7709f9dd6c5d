/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ceilings.h — the hardware ceilings every GPU benchmark compares against, measured in the same
 * run (bench/ceilings.cu): a device-to-device copy (bytes read + written) for filter and scan,
 * a read-only pass (a kernel that reads every 16-byte vector once) for the histograms.
 * kernel_bench (its ceiling rows) and tests/test_gpu_region.c (the device-region bench rows)
 * both take them from here, so the two tables use one definition.
 */
#ifndef TALLY_BENCH_CEILINGS_H
#define TALLY_BENCH_CEILINGS_H

#include <stddef.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Enqueues the read-only pass over `bytes` (a multiple of 16) at p on `stream`: `blocks` blocks
 * of 256 threads, 4 loads of 16 bytes in flight a thread; *sink is written only in theory (it
 * keeps the loads alive). */
cudaError_t bench_read_only_launch(const void *p, size_t bytes, unsigned *sink, int blocks,
                                   cudaStream_t stream);

/* GB/s on the current device, the median of `reps` timed runs after 3 untimed ones, on buffers
 * of `bytes` it allocates (make them several times the L2): the read-only pass (bytes read),
 * a cudaMemcpyAsync device to device (bytes read + written: 2 x bytes). 0 when a CUDA call
 * failed. */
double bench_read_ceiling(size_t bytes, int reps);
double bench_copy_ceiling(size_t bytes, int reps);

#ifdef __cplusplus
}
#endif

#endif
