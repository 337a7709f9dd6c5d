/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cuda_absent.c — the CUDA entry point of tk_backend.h for builds without CUDA, so the daemon
 * links the same way everywhere and finds no device at run time.
 */
#include "tk_backend.h"

int tk_cuda_device_count(void)
{
    return 0;
}
