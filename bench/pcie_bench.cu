/* SPDX-License-Identifier: Apache-2.0 */
/*
 * pcie_bench.cu — the PCIe ceiling tallyd's shared-memory path is measured against (issue 9):
 * pinned host-to-device and device-to-host copies of 64 MiB (cudaMallocHost buffers,
 * cudaMemcpyAsync), and both directions at once on two streams (the bound for a filter or scan
 * whose output comes back while the next input goes in).
 *
 * Usage: pcie_bench [--mib N] [--reps R]. Prints `key value` lines (h2d, d2h, both: GB/s, the
 * sum of both directions for `both`), the median of R timed rounds after one warm-up, each round
 * timed with CUDA events. Exit 1 when a CUDA call fails.
 */
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <cuda_runtime.h>

#include "bench_cuda.h"

static size_t bytes = (size_t)64 << 20;
static int reps = 20;
static void *h_in, *h_out, *d_in, *d_out;
static cudaStream_t s_up, s_down;
static cudaEvent_t e0, e1, e_down;

/* One round: the copies of `what` (1 H2D, 2 D2H, 3 both); returns its milliseconds. */
static float round_ms(int what)
{
    CK(cudaEventRecord(e0, s_up));
    CK(cudaStreamWaitEvent(s_down, e0, 0));
    if (what & 1)
        CK(cudaMemcpyAsync(d_in, h_in, bytes, cudaMemcpyHostToDevice, s_up));
    if (what & 2)
        CK(cudaMemcpyAsync(h_out, d_out, bytes, cudaMemcpyDeviceToHost, s_down));
    CK(cudaEventRecord(e_down, s_down));
    CK(cudaStreamWaitEvent(s_up, e_down, 0));
    CK(cudaEventRecord(e1, s_up));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return ms;
}

static double gbps(int what)
{
    std::vector<float> ms;
    round_ms(what);
    for (int i = 0; i < reps; i++)
        ms.push_back(round_ms(what));
    std::sort(ms.begin(), ms.end());
    double moved = (double)bytes * (what == 3 ? 2 : 1);
    return moved / (ms[ms.size() / 2] / 1e3) / 1e9;
}

int main(int argc, char **argv)
{
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--mib") == 0)
            bytes = (size_t)atoi(argv[i + 1]) << 20;
        else if (strcmp(argv[i], "--reps") == 0)
            reps = atoi(argv[i + 1]);
    }
    CK(cudaMallocHost(&h_in, bytes));
    CK(cudaMallocHost(&h_out, bytes));
    CK(cudaMalloc(&d_in, bytes));
    CK(cudaMalloc(&d_out, bytes));
    memset(h_in, 1, bytes);
    CK(cudaMemset(d_out, 2, bytes));
    CK(cudaStreamCreateWithFlags(&s_up, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&s_down, cudaStreamNonBlocking));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventCreate(&e_down));
    printf("h2d %.2f\nd2h %.2f\nboth %.2f\n", gbps(1), gbps(2), gbps(3));
    return 0;
}
