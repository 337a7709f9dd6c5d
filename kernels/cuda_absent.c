/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cuda_absent.c — the CUDA entry points of tk_backend.h for builds without CUDA, so the daemon
 * links the same way everywhere and reports "not compiled in" at run time.
 */
#include <stdio.h>

#include "tk_backend.h"

tally_status_t tk_cuda_backend_new(int device, size_t max_batch_bytes, tk_backend_t **out,
                                   char *msg, size_t msg_cap)
{
    (void)device;
    (void)max_batch_bytes;
    *out = NULL;
    if (msg && msg_cap)
        snprintf(msg, msg_cap, "this tallyd was built without CUDA (TALLY_CUDA=OFF or no nvcc)");
    return TALLY_E_BACKEND;
}

int tk_cuda_device_count(void)
{
    return 0;
}
