/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_gpu.c — exportable device memory for producers whose data is on a GPU (PROTOCOL.md §10
 * "Device memory"; tally.h's tally_gpu_*).
 *
 * libtally must not depend on CUDA: a producer without a GPU links it too. So the driver is
 * opened at run time (dlopen of libcuda.so.1, the driver's stable soname) and the few functions
 * used are looked up by name, with the prototypes of cuda.h written out here (the driver's ABI
 * for them has been stable since CUDA 10.2). An allocation is the virtual-memory-management
 * kind, the only one that exports a descriptor: cuMemCreate with
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, its size rounded up to the granularity (tallyd maps
 * the whole allocation: any other size fails there), reserved, mapped and made read-write for
 * its device in this process, and exported once. The descriptor is what tally_gpu_register
 * sends; tallyd keeps its own copy, so freeing here does not pull the memory from a request in
 * flight (the driver frees it when the last holder has let go). tally_gpu_copy_to and _from copy
 * between host memory and an allocation (cuMemcpyHtoD / DtoH, synchronous: the data is there when
 * they return, which is the producer's promise a request without an IPC event makes).
 *
 * Tests without a GPU: with TALLY_TEST_SIM_GPU=1 in the environment an "allocation" is a sealed
 * memfd mapped here, on simulated GPU `device` (its UUID "tallyd-sim-gpu", 0, the number), which
 * a tallyd with --test-sim-gpus imports as its simulated device memory (PROTOCOL.md §10); copies
 * are memcpy. So the paths built on these functions (tally_run's device ring, the CLI's
 * --gpu-region, the Python GpuRegion) are tested in CI end to end.
 */
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tally.h"
#include "tally_proto.h"

_Static_assert(TALLY_GPU_OUTPUT == TALLY_SHM_DEV_OUTPUT && TALLY_GPU_EVENT == TALLY_SHM_DEV_EVENT,
               "tally.h's flags are the wire's");

/* cuda.h's types, as far as they are used here. */
typedef int cu_result;
typedef unsigned long long cu_deviceptr;
typedef unsigned long long cu_handle;
typedef struct {
    int type;          /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int handle_types;  /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1 */
    int location_type; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    int location_id;
    void *win32_metadata;
    unsigned char compression_type, gpu_direct_rdma_capable;
    unsigned short usage;
    unsigned char reserved[4];
} cu_alloc_prop;
typedef struct {
    int location_type, location_id;
    int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} cu_access_desc;

enum { CU_PINNED = 1, CU_POSIX_FD = 1, CU_LOC_DEVICE = 1, CU_PROT_RW = 3 };

static struct {
    cu_result (*init)(unsigned);
    cu_result (*device_get)(int *, int);
    cu_result (*device_uuid)(unsigned char[16], int);
    cu_result (*primary_retain)(void **, int);
    cu_result (*ctx_set)(void *);
    cu_result (*granularity)(size_t *, const cu_alloc_prop *, int);
    cu_result (*create)(cu_handle *, size_t, const cu_alloc_prop *, unsigned long long);
    cu_result (*release)(cu_handle);
    cu_result (*reserve)(cu_deviceptr *, size_t, size_t, cu_deviceptr, unsigned long long);
    cu_result (*address_free)(cu_deviceptr, size_t);
    cu_result (*map)(cu_deviceptr, size_t, size_t, cu_handle, unsigned long long);
    cu_result (*unmap)(cu_deviceptr, size_t);
    cu_result (*set_access)(cu_deviceptr, size_t, const cu_access_desc *, size_t);
    cu_result (*export_fd)(void *, cu_handle, int, unsigned long long);
    cu_result (*copy_htod)(cu_deviceptr, const void *, size_t);
    cu_result (*copy_dtoh)(void *, cu_deviceptr, size_t);
} cu;
static bool cu_ok;
static char cu_why[160];
static pthread_once_t cu_once = PTHREAD_ONCE_INIT;
static _Thread_local char gpu_error[200];

struct tally_gpu_mem {
    int device;
    unsigned char uuid[16];
    cu_handle handle;
    cu_deviceptr ptr;
    size_t size;
    int fd;
    void *ctx;      /* the device's primary context, made current for each copy */
    bool sim;       /* TALLY_TEST_SIM_GPU: a memfd ... */
    void *sim_base; /* ... mapped here (ptr is its address) */
};

static void cu_load(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(cu_why, sizeof cu_why, "no CUDA driver (libcuda.so.1): %s", dlerror());
        return;
    }
    struct {
        const char *name;
        void **fn;
    } want[] = {
        {"cuInit", (void **)&cu.init},
        {"cuDeviceGet", (void **)&cu.device_get},
        {"cuDeviceGetUuid_v2", (void **)&cu.device_uuid},
        {"cuDevicePrimaryCtxRetain", (void **)&cu.primary_retain},
        {"cuCtxSetCurrent", (void **)&cu.ctx_set},
        {"cuMemGetAllocationGranularity", (void **)&cu.granularity},
        {"cuMemCreate", (void **)&cu.create},
        {"cuMemRelease", (void **)&cu.release},
        {"cuMemAddressReserve", (void **)&cu.reserve},
        {"cuMemAddressFree", (void **)&cu.address_free},
        {"cuMemMap", (void **)&cu.map},
        {"cuMemUnmap", (void **)&cu.unmap},
        {"cuMemSetAccess", (void **)&cu.set_access},
        {"cuMemExportToShareableHandle", (void **)&cu.export_fd},
        {"cuMemcpyHtoD_v2", (void **)&cu.copy_htod},
        {"cuMemcpyDtoH_v2", (void **)&cu.copy_dtoh},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        *want[i].fn = dlsym(lib, want[i].name);
        if (!*want[i].fn) {
            snprintf(cu_why, sizeof cu_why, "the CUDA driver lacks %s", want[i].name);
            return;
        }
    }
    if (cu.init(0) != 0) {
        snprintf(cu_why, sizeof cu_why, "cuInit failed (no usable GPU)");
        return;
    }
    cu_ok = true;
}

static tally_status_t gpu_fail(const char *what, cu_result rc)
{
    snprintf(gpu_error, sizeof gpu_error, "%s failed (CUresult %d)", what, rc);
    return TALLY_E_BACKEND;
}

/* The device's primary context current on this thread, its UUID and the granularity. */
static tally_status_t gpu_prepare(tally_gpu_mem_t *m, cu_alloc_prop *prop, size_t *gran)
{
    int dev = 0;
    void *ctx = NULL;
    cu_result rc;
    if ((rc = cu.device_get(&dev, m->device)) != 0)
        return gpu_fail("cuDeviceGet", rc);
    if ((rc = cu.primary_retain(&ctx, dev)) != 0 || (rc = cu.ctx_set(ctx)) != 0)
        return gpu_fail("cuDevicePrimaryCtxRetain", rc);
    m->ctx = ctx;
    if ((rc = cu.device_uuid(m->uuid, dev)) != 0)
        return gpu_fail("cuDeviceGetUuid", rc);
    *prop = (cu_alloc_prop){.type = CU_PINNED,
                            .handle_types = CU_POSIX_FD,
                            .location_type = CU_LOC_DEVICE,
                            .location_id = dev};
    if ((rc = cu.granularity(gran, prop, 0)) != 0)
        return gpu_fail("cuMemGetAllocationGranularity", rc);
    return TALLY_OK;
}

static void gpu_undo(tally_gpu_mem_t *m, bool mapped)
{
    if (m->fd >= 0)
        close(m->fd);
    if (mapped)
        cu.unmap(m->ptr, m->size);
    if (m->ptr)
        cu.address_free(m->ptr, m->size);
    if (m->handle)
        cu.release(m->handle);
}

/* TALLY_TEST_SIM_GPU: a sealed memfd of size bytes (rounded up to 64 KiB) on simulated GPU
 * device, mapped here. */
static tally_status_t sim_alloc(int device, size_t size, tally_gpu_mem_t *m)
{
    m->size = (size + 65535) / 65536 * 65536;
    memset(m->uuid, 0, sizeof m->uuid);
    memcpy(m->uuid, "tallyd-sim-gpu", 14);
    m->uuid[15] = (unsigned char)device;
    m->fd = memfd_create("tally-sim-gpu", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (m->fd < 0 || ftruncate(m->fd, (off_t)m->size) != 0 ||
        fcntl(m->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
        snprintf(gpu_error, sizeof gpu_error, "simulated GPU memory: memfd failed");
        return TALLY_E_IO;
    }
    m->sim_base = mmap(NULL, m->size, PROT_READ | PROT_WRITE, MAP_SHARED, m->fd, 0);
    if (m->sim_base == MAP_FAILED) {
        m->sim_base = NULL;
        snprintf(gpu_error, sizeof gpu_error, "simulated GPU memory: mmap failed");
        return TALLY_E_IO;
    }
    m->ptr = (cu_deviceptr)(uintptr_t)m->sim_base;
    return TALLY_OK;
}

static bool sim_gpu(void)
{
    const char *v = getenv("TALLY_TEST_SIM_GPU");
    return v && strcmp(v, "1") == 0;
}

tally_status_t tally_gpu_alloc(int device, size_t size, tally_gpu_mem_t **out)
{
    if (!out || size == 0 || device < 0)
        return TALLY_E_ARG;
    *out = NULL;
    if (sim_gpu()) {
        tally_gpu_mem_t *m = calloc(1, sizeof *m);
        if (!m)
            return TALLY_E_NOMEM;
        *m = (tally_gpu_mem_t){.device = device, .fd = -1, .sim = true};
        tally_status_t st = sim_alloc(device, size, m);
        if (st != TALLY_OK) {
            tally_gpu_free(&m);
            return st;
        }
        *out = m;
        return TALLY_OK;
    }
    pthread_once(&cu_once, cu_load);
    if (!cu_ok) {
        snprintf(gpu_error, sizeof gpu_error, "%s", cu_why);
        return TALLY_E_ARG;
    }
    tally_gpu_mem_t *m = calloc(1, sizeof *m);
    if (!m)
        return TALLY_E_NOMEM;
    *m = (tally_gpu_mem_t){.device = device, .fd = -1};
    cu_alloc_prop prop;
    size_t gran = 0;
    bool mapped = false;
    cu_result rc = 0;
    tally_status_t st = gpu_prepare(m, &prop, &gran);
    if (st != TALLY_OK)
        goto fail;
    m->size = (size + gran - 1) / gran * gran;
    cu_access_desc access = {
        .location_type = CU_LOC_DEVICE, .location_id = prop.location_id, .flags = CU_PROT_RW};
    st = TALLY_E_BACKEND;
    if ((rc = cu.create(&m->handle, m->size, &prop, 0)) != 0) {
        gpu_fail("cuMemCreate", rc);
        goto fail;
    }
    if ((rc = cu.reserve(&m->ptr, m->size, 0, 0, 0)) != 0 ||
        (rc = cu.map(m->ptr, m->size, 0, m->handle, 0)) != 0) {
        gpu_fail("cuMemAddressReserve/cuMemMap", rc);
        goto fail;
    }
    mapped = true;
    if ((rc = cu.set_access(m->ptr, m->size, &access, 1)) != 0 ||
        (rc = cu.export_fd(&m->fd, m->handle, CU_POSIX_FD, 0)) != 0) {
        gpu_fail("cuMemSetAccess/cuMemExportToShareableHandle", rc);
        goto fail;
    }
    *out = m;
    return TALLY_OK;
fail:
    gpu_undo(m, mapped);
    free(m);
    return st;
}

void *tally_gpu_ptr(const tally_gpu_mem_t *mem)
{
    return mem ? (void *)(uintptr_t)mem->ptr : NULL;
}

size_t tally_gpu_size(const tally_gpu_mem_t *mem)
{
    return mem ? mem->size : 0;
}

tally_status_t tally_gpu_register(tally_client_t *client, const tally_gpu_mem_t *mem,
                                  unsigned flags, const void *ipc_event, tally_region_t **out)
{
    if (!mem)
        return TALLY_E_ARG;
    return tally_gpu_register_fd(client, mem->fd, mem->size, mem->uuid, flags, ipc_event,
                                 (void *)(uintptr_t)mem->ptr, out);
}

/* A copy of len bytes at offset of mem, checked against its size, with its context current. */
static tally_status_t copy_check(const tally_gpu_mem_t *mem, size_t offset, size_t len)
{
    if (!mem || offset > mem->size || len > mem->size - offset) {
        snprintf(gpu_error, sizeof gpu_error, "copy of %zu bytes at %zu outside the allocation",
                 len, offset);
        return TALLY_E_ARG;
    }
    cu_result rc;
    if (!mem->sim && (rc = cu.ctx_set(mem->ctx)) != 0)
        return gpu_fail("cuCtxSetCurrent", rc);
    return TALLY_OK;
}

tally_status_t tally_gpu_copy_to(tally_gpu_mem_t *mem, size_t offset, const void *src, size_t len)
{
    tally_status_t st = copy_check(mem, offset, len);
    if (st != TALLY_OK || len == 0)
        return st;
    if (mem->sim) {
        memcpy((uint8_t *)mem->sim_base + offset, src, len);
        return TALLY_OK;
    }
    cu_result rc = cu.copy_htod(mem->ptr + offset, src, len);
    return rc ? gpu_fail("cuMemcpyHtoD", rc) : TALLY_OK;
}

tally_status_t tally_gpu_copy_from(const tally_gpu_mem_t *mem, size_t offset, void *dst,
                                   size_t len)
{
    tally_status_t st = copy_check(mem, offset, len);
    if (st != TALLY_OK || len == 0)
        return st;
    if (mem->sim) {
        memcpy(dst, (const uint8_t *)mem->sim_base + offset, len);
        return TALLY_OK;
    }
    cu_result rc = cu.copy_dtoh(dst, mem->ptr + offset, len);
    return rc ? gpu_fail("cuMemcpyDtoH", rc) : TALLY_OK;
}

void tally_gpu_free(tally_gpu_mem_t **mem_p)
{
    if (!mem_p || !*mem_p)
        return;
    tally_gpu_mem_t *m = *mem_p;
    if (m->sim) { /* a simulated allocation: the mapping and the memfd */
        if (m->sim_base)
            munmap(m->sim_base, m->size);
        if (m->fd >= 0)
            close(m->fd);
    } else {
        gpu_undo(m, true);
    }
    free(m);
    *mem_p = NULL;
}

const char *tally_gpu_error(void)
{
    return gpu_error;
}
