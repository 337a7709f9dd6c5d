/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tk_cuda_common.cu — pieces every kernel file uses: the look-back state reset kernel, the
 * per-thread record of the last CUDA error, the cached multiprocessor count, and the scratch
 * size a pipeline should allocate per stream.
 */
#include "tk_cuda_internal.cuh"

static thread_local cudaError_t tk_last_error = cudaSuccess;

__global__ void tk_lookback_init_kernel(tk_tile_state_t *states, unsigned n)
{
    tk_prologue_done(); /* the pass after it waits for this kernel's writes before any look-back */
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        *tk_tile_at(states, i) = tk_tile_state_t{};
}

void tk_lookback_init(tk_tile_state_t *states, unsigned tiles, cudaStream_t stream)
{
    if (tiles == 0)
        return;
    tk_lookback_init_kernel<<<(unsigned)tk_div_up(tiles, 256), 256, 0, stream>>>(states, tiles);
}

extern "C" tally_status_t tk_cuda_status(cudaError_t err)
{
    if (err == cudaSuccess)
        return TALLY_OK;
    tk_last_error = err;
    return TALLY_E_BACKEND;
}

tally_status_t tk_cuda_check_launch(void)
{
    return tk_cuda_status(cudaGetLastError());
}

/* Enough for any host; devices beyond it are simply not cached. */
#define TK_SM_CACHE 64
static int tk_sm_cache[TK_SM_CACHE];

int tk_cuda_sm_count(void)
{
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess)
        return 132;
    if (dev >= 0 && dev < TK_SM_CACHE && __atomic_load_n(&tk_sm_cache[dev], __ATOMIC_RELAXED))
        return tk_sm_cache[dev];
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        sms <= 0)
        return 132;
    if (dev >= 0 && dev < TK_SM_CACHE)
        __atomic_store_n(&tk_sm_cache[dev], sms, __ATOMIC_RELAXED);
    return sms;
}

extern "C" const char *tk_cuda_error_string(void)
{
    return cudaGetErrorString(tk_last_error);
}

extern "C" size_t tk_cuda_scratch_bytes_max(size_t max_batch_bytes)
{
    size_t m = tk_cuda_filter_scratch_bytes(TALLY_DTYPE_U8, max_batch_bytes, 1);
    size_t s = tk_cuda_filter_scratch_bytes(TALLY_DTYPE_I32, max_batch_bytes / 4, 1);
    m = s > m ? s : m;
    s = tk_cuda_scan_scratch_bytes(max_batch_bytes / 4);
    m = s > m ? s : m;
    s = tk_cuda_hist_u8_scratch_bytes(max_batch_bytes);
    m = s > m ? s : m;
    s = tk_cuda_hist_i32_scratch_bytes(max_batch_bytes / 4);
    m = s > m ? s : m;
    s = tk_cuda_hist_u16_scratch_bytes(max_batch_bytes / 2);
    m = s > m ? s : m;
    s = tk_cuda_hist_rgb_scratch_bytes(max_batch_bytes / 3);
    return s > m ? s : m;
}
