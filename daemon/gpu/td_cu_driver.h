/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_cu_driver.h — the CUDA driver functions that device regions need (PROTOCOL.md §10 "Device
 * memory"), resolved at run time through the runtime (cudaGetDriverEntryPointByVersion), so that
 * neither tallyd nor its tests link libcuda.so.1: a CUDA build still starts, and serves on the
 * CPU, on a host without the driver, as it did before device regions. The runtime loads the
 * driver itself when there is one. Header-only: td_gpu_cuda.c and test_gpu_region.c use it.
 */
#ifndef TD_CU_DRIVER_H
#define TD_CU_DRIVER_H

#include <stdbool.h>
#include <stddef.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

typedef struct {
    CUresult (*mem_create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                           unsigned long long);
    CUresult (*mem_release)(CUmemGenericAllocationHandle);
    CUresult (*mem_granularity)(size_t *, const CUmemAllocationProp *,
                                CUmemAllocationGranularity_flags);
    CUresult (*mem_export)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                           unsigned long long);
    CUresult (*mem_import)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
    CUresult (*address_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*address_free)(CUdeviceptr, size_t);
    CUresult (*mem_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                        unsigned long long);
    CUresult (*mem_unmap)(CUdeviceptr, size_t);
    CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
} td_cu_driver_t;

/* Fills d; false when the runtime finds no driver or a function is missing (then the caller
 * refuses device regions). The version asked for is 12.0's ABI of each function. */
static inline bool td_cu_driver_load(td_cu_driver_t *d)
{
    struct {
        const char *name;
        void **fn;
    } want[] = {
        {"cuMemCreate", (void **)&d->mem_create},
        {"cuMemRelease", (void **)&d->mem_release},
        {"cuMemGetAllocationGranularity", (void **)&d->mem_granularity},
        {"cuMemExportToShareableHandle", (void **)&d->mem_export},
        {"cuMemImportFromShareableHandle", (void **)&d->mem_import},
        {"cuMemAddressReserve", (void **)&d->address_reserve},
        {"cuMemAddressFree", (void **)&d->address_free},
        {"cuMemMap", (void **)&d->mem_map},
        {"cuMemUnmap", (void **)&d->mem_unmap},
        {"cuMemSetAccess", (void **)&d->set_access},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        enum cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
        *want[i].fn = NULL;
        if (cudaGetDriverEntryPointByVersion(want[i].name, want[i].fn, 12000, cudaEnableDefault,
                                             &found) != cudaSuccess ||
            found != cudaDriverEntryPointSuccess || !*want[i].fn) {
            (void)cudaGetLastError();
            return false;
        }
    }
    return true;
}

#endif
