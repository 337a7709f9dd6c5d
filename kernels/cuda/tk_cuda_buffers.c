/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tk_cuda_buffers.c — the host side every caller of tk_cuda.h's kernels shares (see tk_cuda.h):
 * one batch's device buffers on their CUDA stream, setup steps that say what failed, draining a
 * stream after a failure, the device's name. Plain C, like its callers.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "tk_cuda.h"

bool tk_cuda_setup_step(cudaError_t err, int device, const char *what, char *why, size_t why_cap)
{
    if (err == cudaSuccess)
        return true;
    (void)tk_cuda_status(err);
    if (why && why_cap)
        snprintf(why, why_cap, "CUDA device %d: %s failed: %s", device, what,
                 cudaGetErrorString(err));
    return false;
}

void tk_cuda_drain(cudaStream_t stream)
{
    (void)cudaStreamSynchronize(stream);
    (void)cudaGetLastError();
}

void tk_cuda_device_name(int device, char *buf, size_t cap)
{
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, device) == cudaSuccess)
        snprintf(buf, cap, "%s", prop.name);
    else
        snprintf(buf, cap, "CUDA device %d", device);
    (void)cudaGetLastError();
}

tally_status_t tk_cuda_buffers_open(tk_cuda_buffers_t *b, int device, size_t max_batch,
                                    size_t small_bytes, char *why, size_t why_cap)
{
    memset(b, 0, sizeof *b);
    b->device = device;
    b->scratch_bytes = tk_cuda_scratch_bytes_max(max_batch);
    /* The kernels' tuning row is selected here, at start-up, so that a TALLY_CUDA_TUNING naming
     * no row fails the start rather than every request. */
    const tk_cuda_tuning_t *row = NULL;
    if (tk_cuda_tuning_select(device, &row) == TALLY_E_PARAM) {
        if (why && why_cap)
            snprintf(why, why_cap, "CUDA device %d: TALLY_CUDA_TUNING=%s names no tuning row",
                     device, getenv("TALLY_CUDA_TUNING"));
        return TALLY_E_BACKEND;
    }
    bool ok =
        tk_cuda_setup_step(cudaSetDevice(device), device, "cudaSetDevice", why, why_cap) &&
        tk_cuda_setup_step(cudaStreamCreateWithFlags(&b->stream, cudaStreamNonBlocking), device,
                           "cudaStreamCreate", why, why_cap) &&
        tk_cuda_setup_step(cudaMalloc(&b->d_in, max_batch), device, "cudaMalloc(input)", why,
                           why_cap) &&
        tk_cuda_setup_step(cudaMalloc(&b->d_out, 2 * max_batch), device, "cudaMalloc(output)", why,
                           why_cap) &&
        (!b->scratch_bytes || tk_cuda_setup_step(cudaMalloc(&b->d_scratch, b->scratch_bytes),
                                                 device, "cudaMalloc(scratch)", why, why_cap)) &&
        tk_cuda_setup_step(cudaMalloc(&b->d_small, small_bytes), device, "cudaMalloc(small)", why,
                           why_cap);
    if (!ok) {
        tk_cuda_buffers_close(b);
        return TALLY_E_BACKEND;
    }
    b->device_bytes = 3 * max_batch + b->scratch_bytes + small_bytes;
    return TALLY_OK;
}

void tk_cuda_buffers_close(tk_cuda_buffers_t *b)
{
    (void)cudaSetDevice(b->device);
    if (b->stream)
        (void)cudaStreamSynchronize(b->stream);
    cudaFree(b->d_in);
    cudaFree(b->d_out);
    cudaFree(b->d_scratch);
    cudaFree(b->d_small);
    if (b->stream)
        cudaStreamDestroy(b->stream);
    (void)cudaGetLastError();
    memset(b, 0, sizeof *b);
}

int tk_cuda_device_count(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return count;
}
