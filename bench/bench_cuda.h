/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bench_cuda.h — what the CUDA benchmark programs (kernel_bench.cu, pcie_bench.cu) share: a
 * failed CUDA call ends the run with its place and CUDA's words (a benchmark has no recovery).
 */
#ifndef TALLY_BENCH_CUDA_H
#define TALLY_BENCH_CUDA_H

#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#endif
