/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ceilings.cu — the read and copy ceilings of bench/ceilings.h: the read-only kernel kernel_bench
 * has used since issue 3, and a timed device-to-device copy, each the median of several runs
 * timed with CUDA events on a stream of its own.
 */
#include <algorithm>
#include <vector>

#include "ceilings.h"

/* The read-only ceiling: every 16-byte vector read once, 4 in flight per thread. */
__global__ void __launch_bounds__(256) read_only(const uint4 *p, size_t nv, unsigned *sink)
{
    unsigned acc = 0;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < nv; i += 4 * stride) {
        uint4 a = __ldg(p + i), b = __ldg(p + i + stride), c = __ldg(p + i + 2 * stride),
              d = __ldg(p + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^
               d.z ^ d.w;
    }
    for (; i < nv; i += stride) {
        uint4 a = __ldg(p + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == 0x12345678u) /* never in practice; keeps the loads alive */
        *sink = acc;
}

cudaError_t bench_read_only_launch(const void *p, size_t bytes, unsigned *sink, int blocks,
                                   cudaStream_t stream)
{
    read_only<<<blocks, 256, 0, stream>>>((const uint4 *)p, bytes / 16, sink);
    return cudaGetLastError();
}

/* The median milliseconds of reps runs of what(i) on s, after 3 untimed ones; < 0 on failure. */
template <typename F> static float median_ms(cudaStream_t s, int reps, F what)
{
    cudaEvent_t a, b;
    std::vector<float> t;
    if (cudaEventCreate(&a) != cudaSuccess || cudaEventCreate(&b) != cudaSuccess)
        return -1;
    bool ok = true;
    for (int i = 0; i < 3 && ok; i++)
        ok = what() == cudaSuccess;
    for (int i = 0; i < reps && ok; i++) {
        float ms = 0;
        ok = cudaEventRecord(a, s) == cudaSuccess && what() == cudaSuccess &&
             cudaEventRecord(b, s) == cudaSuccess && cudaEventSynchronize(b) == cudaSuccess &&
             cudaEventElapsedTime(&ms, a, b) == cudaSuccess;
        t.push_back(ms);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    if (!ok || t.empty())
        return -1;
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

/* Runs one ceiling on fresh buffers: copy (2 buffers) or read (1 buffer and a sink). */
static double ceiling(size_t bytes, int reps, bool copy)
{
    void *src = nullptr, *dst = nullptr;
    cudaStream_t s = nullptr;
    int device = 0, sms = 0;
    double gbps = 0;
    if (cudaGetDevice(&device) == cudaSuccess &&
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess &&
        cudaMalloc(&src, bytes) == cudaSuccess &&
        cudaMalloc(&dst, copy ? bytes : 64) == cudaSuccess &&
        cudaMemsetAsync(src, 0x5a, bytes, s) == cudaSuccess) {
        float ms = median_ms(s, reps, [&] {
            return copy ? cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s)
                        : bench_read_only_launch(src, bytes, (unsigned *)dst, sms * 8, s);
        });
        if (ms > 0)
            gbps = (copy ? 2.0 : 1.0) * (double)bytes / (ms * 1e-3) / 1e9;
    }
    cudaFree(src);
    cudaFree(dst);
    if (s)
        cudaStreamDestroy(s);
    (void)cudaGetLastError();
    return gbps;
}

double bench_read_ceiling(size_t bytes, int reps)
{
    return ceiling(bytes, reps, false);
}

double bench_copy_ceiling(size_t bytes, int reps)
{
    return ceiling(bytes, reps, true);
}
