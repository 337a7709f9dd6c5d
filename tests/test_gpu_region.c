/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_gpu_region.c — device regions on a real GPU (PROTOCOL.md §10 "Device memory", issue 23),
 * the GPU host's one decisive run (scripts/gpu-check.sh STEPS=region; label gpu; exits 77 without
 * a GPU). This process is the producer: it allocates exportable device memory (cuMemCreate with
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, rounded to the granularity), fills it, exports the
 * descriptor and registers it with a tallyd on the GPU (--backend cuda), with an IPC event
 * recorded after each fill. Then:
 *   - differential: every operation and dtype by device reference against the same bytes sent as
 *     payloads to a tallyd on the CPU backend, on named streams, twice each (the scan's carry
 *     chained), replies and the streams' records byte for byte;
 *   - refusals on the GPU: a descriptor that is not an exported allocation (a memfd), a wrong
 *     size, a UUID that is not here; tallyd serves on after each;
 *   - a producer (this program re-executed with --producer) killed with requests in flight:
 *     tallyd goes on serving, and releases its region (the descriptor closed) once they finish;
 *   - the bench rows (issue 34): hist u8 on 64 MiB and 256 MiB device regions, filter and scan
 *     of 32 MiB into device output regions, 8 in flight, against the hardware's read or copy
 *     ceiling measured in this run (bench/ceilings.h) and the same kernel at one in flight on
 *     this process's own cudaMalloc memory; and tallyd's cost a request (a 2 MiB region), with
 *     the CPU time of each of tallyd's threads and this client's a request;
 *   - with two GPUs, work on a peer (test_peer, STEPS=peer): GPU 0's region run on GPU 1 by a
 *     tallyd with --test-gpu-peer-always, with and without an IPC event, a scan written from
 *     GPU 1 into GPU 0's output region, against the CPU's replies, and its bench row against
 *     the kernel reading GPU 0's memory from GPU 1 (the peer read ceiling) and locally.
 */
#include <dirent.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include <cmocka.h>
#include <cuda.h>
#include <cuda_runtime_api.h>

#include "ceilings.h"
#include "harness.h"
#include "shm_side.h"
#include "td_cu_driver.h"
#include "tally.h"
#include "tk_cuda.h"

#define MIB (1024u * 1024u)
#define ID "gpu-producer"

typedef struct {
    CUmemGenericAllocationHandle handle;
    CUdeviceptr ptr;
    size_t size;
    int fd;
} galloc_t;

static td_cu_driver_t cu; /* the driver through the runtime: no link to libcuda.so.1 */
static uint8_t uuid[TALLY_GPU_UUID_SIZE];
static th_daemon_t gpu_d, cpu_d;
static int side = -1;
static void *zctx, *gpu_sock, *cpu_sock;

#define CU_OK(call) assert_int_equal((int)(call), (int)CUDA_SUCCESS)
#define RT_OK(call) assert_int_equal((int)(call), (int)cudaSuccess)

/* size bytes (rounded up to the granularity) of exportable memory on device 0, mapped
 * read-write here, and its descriptor. */
static void galloc(size_t size, galloc_t *g)
{
    CUmemAllocationProp prop = {0};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t gran = 0;
    CU_OK(cu.mem_granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    g->size = (size + gran - 1) / gran * gran;
    CU_OK(cu.mem_create(&g->handle, g->size, &prop, 0));
    CU_OK(cu.address_reserve(&g->ptr, g->size, 0, 0, 0));
    CU_OK(cu.mem_map(g->ptr, g->size, 0, g->handle, 0));
    CUmemAccessDesc access = {.location = prop.location,
                              .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CU_OK(cu.set_access(g->ptr, g->size, &access, 1));
    CU_OK(cu.mem_export(&g->fd, g->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
}

static void gfree(galloc_t *g)
{
    cu.mem_unmap(g->ptr, g->size);
    cu.address_free(g->ptr, g->size);
    cu.mem_release(g->handle);
    close(g->fd);
}

/* Op 3 on s with flags (DEV_OUTPUT; DEV_EVENT is added with an event): the answer's status
 * (handle in *handle), -1 without an answer. */
static int dev_register_flags(int s, int fd, uint64_t size, const uint8_t *id_uuid,
                              uint32_t flags, const cudaIpcEventHandle_t *event, uint64_t *handle,
                              char *msg, size_t msg_cap)
{
    tally_shm_msg_t m = {.op = TALLY_SHM_OP_REGISTER_DEVICE,
                         .id_len = (uint8_t)strlen(ID),
                         .dev_size = size,
                         .dev_flags = flags};
    memcpy(m.id, ID, strlen(ID));
    memcpy(m.gpu_uuid, id_uuid, TALLY_GPU_UUID_SIZE);
    if (event) {
        m.dev_flags |= TALLY_SHM_DEV_EVENT;
        memcpy(m.event, event, sizeof *event);
    }
    uint8_t buf[TALLY_SHM_MSG_MAX];
    size_t len = tally_shm_msg_encode(&m, buf);
    th_answer_t ans;
    if (th_side_send_raw(s, buf, len, &fd, 1) != 0 || th_side_recv(s, &ans, 10000) != 1)
        return -1;
    *handle = ans.a.handle;
    if (msg)
        snprintf(msg, msg_cap, "%s", ans.msg);
    return (int)ans.a.status;
}

/* Op 3 on s for an input region: the answer's status (handle in *handle), -1 without one. */
static int dev_register(int s, int fd, uint64_t size, const uint8_t *id_uuid,
                        const cudaIpcEventHandle_t *event, uint64_t *handle, char *msg,
                        size_t msg_cap)
{
    return dev_register_flags(s, fd, size, id_uuid, 0, event, handle, msg, msg_cap);
}

static void *dealer(const char *endpoint, const char *id)
{
    void *s = zmq_socket(zctx, ZMQ_DEALER);
    int timeout = 30000, linger = 0;
    if (id)
        zmq_setsockopt(s, ZMQ_ROUTING_ID, id, strlen(id));
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &timeout, sizeof timeout);
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    assert_int_equal(zmq_connect(s, endpoint), 0);
    return s;
}

static int setup(void **state)
{
    (void)state;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        print_message("no GPU: skipped\n");
        exit(77);
    }
    struct cudaDeviceProp prop;
    if (cudaSetDevice(0) != cudaSuccess || cudaFree(0) != cudaSuccess ||
        cudaGetDeviceProperties(&prop, 0) != cudaSuccess)
        return -1;
    memcpy(uuid, prop.uuid.bytes, sizeof uuid);
    if (!td_cu_driver_load(&cu))
        return -1;
    /* TALLY_REGION_GPU_ARGS: more options for the GPU tallyd, split at spaces (the bench's
     * settings explored by gpu-check's region-tune step, e.g. "--gpu-streams 8"). */
    static char extra[256];
    const char *gpu_args[16] = {"--backend", "cuda", "--max-batch", "268435456"};
    size_t nargs = 4;
    const char *env = getenv("TALLY_REGION_GPU_ARGS");
    snprintf(extra, sizeof extra, "%s", env ? env : "");
    for (char *save = NULL, *w = strtok_r(extra, " ", &save); w && nargs < 15;
         w = strtok_r(NULL, " ", &save))
        gpu_args[nargs++] = w;
    gpu_args[nargs] = NULL;
    const char *const cpu_args[] = {"--backend", "cpu", "--max-batch", "268435456", NULL};
    if (th_daemon_start(&gpu_d, gpu_args) != 0 || th_daemon_start(&cpu_d, cpu_args) != 0)
        return -1;
    side = th_side_connect(gpu_d.shm_socket);
    zctx = zmq_ctx_new();
    gpu_sock = dealer(gpu_d.endpoint, ID);
    cpu_sock = dealer(cpu_d.endpoint, NULL);
    return side >= 0 ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    zmq_close(gpu_sock);
    zmq_close(cpu_sock);
    zmq_ctx_term(zctx);
    close(side);
    int rc = th_daemon_stop(&gpu_d, SIGTERM, 30000);
    return th_daemon_stop(&cpu_d, SIGTERM, 30000) || rc;
}

typedef struct {
    const char *name;
    uint8_t op, dtype, flags, pred;
    int64_t lo, hi;
} diff_case_t;

static const diff_case_t cases[] = {
    {"hist-u8", TALLY_OP_HIST, TALLY_DTYPE_U8, 0, 0, 0, 0},
    {"hist-i32", TALLY_OP_HIST, TALLY_DTYPE_I32, 0, 0, -1000000, 1000000},
    {"hist-u16", TALLY_OP_HIST, TALLY_DTYPE_U16, 0, 0, 0, 4096},
    {"hist-rgb8", TALLY_OP_HIST, TALLY_DTYPE_RGB8, 0, 0, 0, 0},
    {"hist-rgba8", TALLY_OP_HIST, TALLY_DTYPE_RGBA8, 0, 0, 0, 0},
    {"filter-i32", TALLY_OP_FILTER, TALLY_DTYPE_I32, TALLY_FLAG_FILTER_STABLE, TALLY_PRED_GT, 0, 0},
    {"filter-u8", TALLY_OP_FILTER, TALLY_DTYPE_U8, TALLY_FLAG_FILTER_STABLE, TALLY_PRED_GT, 100, 0},
    {"filter-i32-fast", TALLY_OP_FILTER, TALLY_DTYPE_I32, 0, TALLY_PRED_LT, -5, 0},
    {"scan", TALLY_OP_SCAN, TALLY_DTYPE_I32, 0, 0, 0, 0},
    {"scan-excl", TALLY_OP_SCAN, TALLY_DTYPE_I32, TALLY_FLAG_SCAN_EXCLUSIVE, 0, 0, 0},
    {"scan-i32", TALLY_OP_SCAN, TALLY_DTYPE_I32, TALLY_FLAG_SCAN_OUT_I32, 0, 0, 0},
};

static tally_req_t case_req(const diff_case_t *c, uint64_t id, bool by_ref)
{
    tally_req_t req = th_req(c->op, c->dtype, id);
    req.flags = (uint8_t)(c->flags | (by_ref ? TALLY_FLAG_SHM_REF : 0));
    req.pred = c->pred;
    req.lo = c->lo;
    req.hi = c->hi;
    req.stream_len = (uint8_t)strlen(c->name);
    memcpy(req.stream, c->name, req.stream_len);
    return req;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* One case, one batch: by reference on the GPU, as a payload on the CPU; the same reply. */
static void diff_one(const diff_case_t *c, uint64_t handle, const uint8_t *host, size_t off,
                     size_t len, uint64_t id)
{
    tally_req_t req = case_req(c, id, true);
    tally_shm_ref_t ref = {.in_handle = handle, .in_offset = off, .in_length = len};
    uint8_t bytes[TALLY_SHM_REF_SIZE];
    tally_shm_ref_encode(&ref, bytes);
    th_reply_t g, p;
    assert_int_equal(th_call(gpu_sock, &req, bytes, sizeof bytes, &g), 0);
    req = case_req(c, id, false);
    assert_int_equal(th_call(cpu_sock, &req, host + off, len, &p), 0);
    if (g.rep.status != TALLY_OK || p.rep.status != TALLY_OK)
        fail_msg("%s: gpu %s '%s', cpu %s", c->name,
                 tally_status_name((tally_status_t)g.rep.status), (char *)g.payload,
                 tally_status_name((tally_status_t)p.rep.status));
    assert_int_equal(g.rep.count, p.rep.count);
    assert_int_equal(g.rep.aux0, p.rep.aux0);
    assert_int_equal(g.len, p.len);
    if (c->op == TALLY_OP_FILTER && !(c->flags & TALLY_FLAG_FILTER_STABLE)) {
        qsort(g.payload, g.len / 4, 4, cmp_u32); /* the unordered filter: the same multiset */
        qsort(p.payload, p.len / 4, 4, cmp_u32);
    }
    if (memcmp(g.payload, p.payload, g.len) != 0)
        fail_msg("%s at %zu (+%zu): the replies differ", c->name, off, len);
    th_reply_free(&g);
    th_reply_free(&p);
}

/* Every case twice on its stream, by reference against payloads, then the streams' records. */
static void test_differential(void **state)
{
    (void)state;
    const size_t bytes = 24 * MIB;
    galloc_t g;
    galloc(bytes, &g);
    uint8_t *host = malloc(g.size);
    assert_non_null(host);
    for (size_t i = 0; i < g.size; i += 8) {
        uint64_t r = th_rand();
        memcpy(host + i, &r, 8);
    }
    for (size_t i = 0; i < g.size / 4; i += 3) /* i32 values near 0 too, for the filter and hist */
        ((int32_t *)host)[i] = (int32_t)(th_rand() % 2000001) - 1000000;
    cudaEvent_t ev;
    cudaIpcEventHandle_t evh;
    RT_OK(cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming));
    RT_OK(cudaIpcGetEventHandle(&evh, ev));
    uint64_t handle = 0;
    char msg[256];
    assert_int_equal(dev_register(side, g.fd, g.size, uuid, &evh, &handle, msg, sizeof msg),
                     TALLY_OK);
    assert_true(handle & TALLY_SHM_DEVICE_HANDLE_BIT);
    /* The fill is asynchronous; the event recorded after it is what tallyd's stream waits on. */
    RT_OK(cudaMemcpyAsync((void *)(uintptr_t)g.ptr, host, g.size, cudaMemcpyHostToDevice, 0));
    RT_OK(cudaEventRecord(ev, 0));
    uint64_t id = 1;
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const diff_case_t *c = &cases[k];
        size_t esize = tally_dtype_size((tally_dtype_t)c->dtype);
        size_t n = (4 * MIB + 4097 * k) / esize; /* odd lengths, odd offsets for bytes */
        size_t off = k * 12 + (esize == 1 ? 1 : 0);
        diff_one(c, handle, host, off, n * esize, id++);
        diff_one(c, handle, host, off + n * esize, n * esize, id++); /* the next chunk */
        uint8_t rg[TALLY_QUERY_PAYLOAD_MAX], rc[TALLY_QUERY_PAYLOAD_MAX];
        long lg = th_query_raw(gpu_sock, c->name, id++, rg, sizeof rg);
        long lc = th_query_raw(cpu_sock, c->name, id++, rc, sizeof rc);
        assert_true(lg > 0);
        assert_int_equal(lg, lc);
        if (memcmp(rg, rc, (size_t)lg) != 0)
            fail_msg("%s: the streams' records differ", c->name);
        print_message("differential %s: replies and stream record identical\n", c->name);
    }
    th_answer_t ans;
    assert_int_equal(th_side_call(side, TALLY_SHM_OP_RELEASE, NULL, handle, -1, &ans), TALLY_OK);
    cudaEventDestroy(ev);
    gfree(&g);
    free(host);
}

/* One filter or scan case with its output written into a device output region (out, at
 * out_off): the reply carries only its header, and the bytes there equal the CPU's reply. */
static void diff_out_one(const diff_case_t *c, uint64_t in, const uint8_t *host, size_t len,
                         uint64_t out, const galloc_t *og, size_t out_off, uint64_t id)
{
    tally_req_t req = case_req(c, id, true);
    tally_shm_ref_t ref = {.in_handle = in,
                           .in_length = len,
                           .out_handle = out,
                           .out_offset = out_off,
                           .out_length = 2 * len};
    uint8_t bytes[TALLY_SHM_REF_SIZE];
    tally_shm_ref_encode(&ref, bytes);
    th_reply_t g, p;
    assert_int_equal(th_call(gpu_sock, &req, bytes, sizeof bytes, &g), 0);
    req = case_req(c, id, false);
    assert_int_equal(th_call(cpu_sock, &req, host, len, &p), 0);
    if (g.rep.status != TALLY_OK || p.rep.status != TALLY_OK)
        fail_msg("%s (device output): gpu %s '%s', cpu %s", c->name,
                 tally_status_name((tally_status_t)g.rep.status), (char *)g.payload,
                 tally_status_name((tally_status_t)p.rep.status));
    assert_int_equal(g.len, 0);
    assert_int_equal(g.rep.count, p.rep.count);
    assert_int_equal(g.rep.aux0, p.rep.aux0);
    uint8_t *seen = malloc(p.len ? p.len : 1);
    assert_non_null(seen);
    RT_OK(cudaMemcpy(seen, (const uint8_t *)(uintptr_t)og->ptr + out_off, p.len,
                     cudaMemcpyDeviceToHost));
    if (c->op == TALLY_OP_FILTER && !(c->flags & TALLY_FLAG_FILTER_STABLE)) {
        qsort(seen, p.len / 4, 4, cmp_u32);
        qsort(p.payload, p.len / 4, 4, cmp_u32);
    }
    if (memcmp(seen, p.payload, p.len) != 0)
        fail_msg("%s (device output): the output differs from the CPU's reply", c->name);
    free(seen);
    th_reply_free(&g);
    th_reply_free(&p);
}

/* Device output regions (registered with DEV_OUTPUT): every filter and scan case, twice on its
 * stream, written by tallyd's GPU into the output region, against the CPU's replies; a region
 * registered without DEV_OUTPUT is refused as an output (it is mapped read-only). */
static void test_device_output(void **state)
{
    (void)state;
    const size_t len = 4 * MIB + 12;
    galloc_t gi, go;
    galloc(len, &gi);
    galloc(2 * len + 4096, &go);
    uint8_t *host = malloc(gi.size);
    assert_non_null(host);
    for (size_t i = 0; i + 4 <= gi.size; i += 4) {
        int32_t v = (int32_t)(th_rand() % 2001) - 1000;
        memcpy(host + i, &v, 4);
    }
    RT_OK(cudaMemcpy((void *)(uintptr_t)gi.ptr, host, gi.size, cudaMemcpyHostToDevice));
    uint64_t in = 0, out = 0;
    assert_int_equal(dev_register(side, gi.fd, gi.size, uuid, NULL, &in, NULL, 0), TALLY_OK);
    assert_int_equal(dev_register_flags(side, go.fd, go.size, uuid, TALLY_SHM_DEV_OUTPUT, NULL,
                                        &out, NULL, 0),
                     TALLY_OK);
    uint64_t id = 5000;
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const diff_case_t *c = &cases[k];
        if (c->op == TALLY_OP_HIST)
            continue;
        size_t esize = tally_dtype_size((tally_dtype_t)c->dtype);
        size_t n = len / esize - k; /* odd lengths */
        diff_out_one(c, in, host, n * esize, out, &go, 8 * k, id++);
        diff_out_one(c, in, host, n * esize, out, &go, 8 * k, id++);
        print_message("device output %s: outputs identical to the CPU's replies\n", c->name);
    }
    tally_req_t req = case_req(&cases[8], id++, true); /* read-only output region: refused */
    tally_shm_ref_t ref = {
        .in_handle = in, .in_length = 4096, .out_handle = in, .out_length = 8192};
    uint8_t bytes[TALLY_SHM_REF_SIZE];
    tally_shm_ref_encode(&ref, bytes);
    th_reply_t r;
    assert_int_equal(th_call(gpu_sock, &req, bytes, sizeof bytes, &r), 0);
    assert_int_equal(r.rep.status, TALLY_E_BAD_REF);
    th_reply_free(&r);
    th_answer_t ans;
    assert_int_equal(th_side_call(side, TALLY_SHM_OP_RELEASE, NULL, in, -1, &ans), TALLY_OK);
    assert_int_equal(th_side_call(side, TALLY_SHM_OP_RELEASE, NULL, out, -1, &ans), TALLY_OK);
    gfree(&gi);
    gfree(&go);
    free(host);
}

/* A hist u8 by reference over the first n bytes of a region of zeros: ok, and its count. */
static void expect_hist_ok(uint64_t handle, size_t n)
{
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 77);
    req.flags = TALLY_FLAG_SHM_REF;
    tally_shm_ref_t ref = {.in_handle = handle, .in_length = n};
    uint8_t bytes[TALLY_SHM_REF_SIZE];
    tally_shm_ref_encode(&ref, bytes);
    th_reply_t r;
    assert_int_equal(th_call(gpu_sock, &req, bytes, sizeof bytes, &r), 0);
    assert_int_equal(r.rep.status, TALLY_OK);
    uint64_t bin0;
    memcpy(&bin0, r.payload, 8);
    assert_int_equal(bin0, n);
    th_reply_free(&r);
}

/* libtally's own allocator and registration (tally_gpu.c, libcuda.so.1 through dlopen): a size
 * rounded up to the granularity, filled here, answered in place. */
static void test_libtally(void **state)
{
    (void)state;
    tally_gpu_mem_t *mem = NULL;
    if (tally_gpu_alloc(0, 3 * MIB, &mem) != TALLY_OK)
        fail_msg("tally_gpu_alloc: %s", tally_gpu_error());
    size_t size = tally_gpu_size(mem);
    assert_true(size >= 3 * MIB && size % (2 * MIB) == 0);
    RT_OK(cudaMemset(tally_gpu_ptr(mem), 5, size));
    RT_OK(cudaDeviceSynchronize());
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(gpu_d.endpoint, 30000, &c), TALLY_OK);
    tally_region_t *region = NULL;
    if (tally_gpu_register(c, mem, 0, NULL, &region) != TALLY_OK)
        fail_msg("tally_gpu_register: %s", tally_client_error(c));
    assert_ptr_equal(tally_region_data(region), tally_gpu_ptr(mem));
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    tally_reply_t reply;
    tally_reply_init(&reply);
    assert_int_equal(tally_call_shm(c, &req, region, 0, size, NULL, 0, &reply), TALLY_OK);
    uint64_t bin5;
    memcpy(&bin5, reply.payload + 5 * 8, 8);
    assert_int_equal(bin5, size);
    tally_reply_clear(&reply);
    tally_region_destroy(&region);
    tally_client_destroy(&c);
    tally_gpu_free(&mem);
    print_message("libtally: tally_gpu_alloc %zu bytes, registered, hist in place right\n", size);
}

static void test_refusals(void **state)
{
    (void)state;
    char msg[256];
    uint64_t handle;
    int memfd = th_memfd(2 * MIB, F_SEAL_SHRINK | F_SEAL_GROW); /* not an exported allocation */
    assert_int_equal(dev_register(side, memfd, 2 * MIB, uuid, NULL, &handle, msg, sizeof msg),
                     TALLY_E_BAD_REF);
    assert_non_null(strstr(msg, "not an exportable GPU allocation"));
    close(memfd);
    galloc_t g;
    galloc(2 * MIB, &g);
    RT_OK(cudaMemset((void *)(uintptr_t)g.ptr, 0, g.size));
    RT_OK(cudaDeviceSynchronize());
    assert_int_equal(dev_register(side, g.fd, g.size / 2, uuid, NULL, &handle, msg, sizeof msg),
                     TALLY_E_BAD_REF);
    print_message("wrong size: %s\n", msg);
    uint8_t other[TALLY_GPU_UUID_SIZE];
    for (int i = 0; i < TALLY_GPU_UUID_SIZE; i++)
        other[i] = (uint8_t)~uuid[i];
    assert_int_equal(dev_register(side, g.fd, g.size, other, NULL, &handle, msg, sizeof msg),
                     TALLY_E_BAD_REF);
    assert_non_null(strstr(msg, "no GPU with UUID"));
    /* tallyd serves on, and the right registration works (the producer's promise: synced). */
    assert_int_equal(dev_register(side, g.fd, g.size, uuid, NULL, &handle, msg, sizeof msg),
                     TALLY_OK);
    expect_hist_ok(handle, g.size);
    th_answer_t ans;
    assert_int_equal(th_side_call(side, TALLY_SHM_OP_RELEASE, NULL, handle, -1, &ans), TALLY_OK);
    gfree(&g);
}

/* --producer SIDE ENDPOINT: registers 64 MiB, sends 16 hists by reference, says "1" on stdout
 * once the first reply is in, and waits to be killed. */
static int producer(const char *side_path, const char *endpoint)
{
    if (cudaSetDevice(0) != cudaSuccess || cudaFree(0) != cudaSuccess || !td_cu_driver_load(&cu))
        return 2;
    struct cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    galloc_t g;
    galloc(64 * MIB, &g);
    cudaMemset((void *)(uintptr_t)g.ptr, 3, g.size);
    cudaDeviceSynchronize();
    int s = th_side_connect(side_path);
    uint64_t handle;
    if (dev_register(s, g.fd, g.size, (const uint8_t *)prop.uuid.bytes, NULL, &handle, NULL, 0) !=
        TALLY_OK)
        return 3;
    zctx = zmq_ctx_new();
    void *sock = dealer(endpoint, "killed-producer");
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 1);
    req.flags = TALLY_FLAG_SHM_REF;
    tally_shm_ref_t ref = {.in_handle = handle, .in_length = g.size};
    uint8_t bytes[TALLY_SHM_REF_SIZE];
    tally_shm_ref_encode(&ref, bytes);
    for (int i = 0; i < 16; i++)
        th_send_request(sock, &req, bytes, sizeof bytes);
    th_reply_t r;
    th_recv_reply(sock, &r);
    if (write(1, "1", 1) != 1)
        return 4;
    for (;;)
        pause();
}

static void test_producer_killed(void **state)
{
    (void)state;
    int base = th_fd_count(gpu_d.pid);
    int out[2];
    assert_int_equal(pipe(out), 0);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(out[1], 1);
        char self[4096];
        ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
        self[n > 0 ? n : 0] = '\0';
        execl(self, self, "--producer", gpu_d.shm_socket, gpu_d.endpoint, (char *)NULL);
        _exit(127);
    }
    close(out[1]);
    char c = 0;
    assert_int_equal(read(out[0], &c, 1), 1); /* registered, requests in flight */
    close(out[0]);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    /* tallyd answers (or drops, the peer gone) the requests, then releases the region. */
    int now = -1;
    for (int i = 0; i < 200 && (now = th_fd_count(gpu_d.pid)) > base; i++)
        th_sleep_ms(50);
    assert_true(now <= base);
    assert_true(th_ping(gpu_d.endpoint, 5000));
    print_message("producer killed with 15 requests in flight: tallyd serves on, descriptors "
                  "back to %d\n",
                  now);
}

static double seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Records b on the default stream, waits for it and returns the seconds since a; destroys both. */
static double stop_timing(cudaEvent_t a, cudaEvent_t b)
{
    RT_OK(cudaEventRecord(b, 0));
    RT_OK(cudaEventSynchronize(b));
    float ms = 0;
    RT_OK(cudaEventElapsedTime(&ms, a, b));
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return ms * 1e-3;
}

/* Each bench row moves this many input bytes, after a warm-up of BENCH_WARM_BYTES: at 1-4 TB/s
 * a tenth of a second to half a second, long enough for the GPU's clocks to have risen and for
 * the figure to settle (400 requests of 64 MiB, 10 ms, gave 0.59 and 0.84 x the kernel in two
 * runs on one H200, 2026-11-26). */
#define BENCH_BYTES (512ull << 30)
#define BENCH_WARM_BYTES (32ull << 30)

/* The in-flight count of the bench rows: 8 (TALLY_REGION_INFLIGHT sets another number, for
 * gpu-check's region-tune step; the rows still say 8 only at 8). */
static int bench_inflight(void)
{
    const char *env = getenv("TALLY_REGION_INFLIGHT");
    return env && atoi(env) > 0 ? atoi(env) : 8;
}

/* Requests a second of req by reference (ref) through tallyd, `inflight` in flight, `total` in
 * all. */
static double ref_requests_per_s(void *sock, const tally_req_t *req, const tally_shm_ref_t *ref,
                                 int total, int inflight)
{
    uint8_t bytes[TALLY_SHM_REF_SIZE];
    tally_shm_ref_encode(ref, bytes);
    double t0 = seconds();
    int sent = 0, got = 0;
    for (; sent < inflight && sent < total; sent++)
        assert_int_equal(th_send_request(sock, req, bytes, sizeof bytes), 0);
    while (got < total) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(sock, &r), 0);
        assert_int_equal(r.rep.status, TALLY_OK);
        th_reply_free(&r);
        got++;
        if (sent < total) {
            assert_int_equal(th_send_request(sock, req, bytes, sizeof bytes), 0);
            sent++;
        }
    }
    return total / (seconds() - t0);
}

/* GB/s (input bytes) of req by reference (ref) through tallyd, bench_inflight() in flight. */
static double ref_rate(void *sock, const tally_req_t *req, const tally_shm_ref_t *ref, int total)
{
    return (double)ref->in_length * ref_requests_per_s(sock, req, ref, total, bench_inflight()) /
           1e9;
}

/* GB/s (input bytes) of the filter (i32 > 0, unordered) or the scan (int64 out) kernel on this
 * process's own memory, n elements, back to back on one stream. */
static double kernel_out_rate(uint8_t op, size_t n, int total)
{
    void *d_in = NULL, *d_out = NULL, *d_small = NULL, *d_scratch = NULL;
    size_t scratch = op == TALLY_OP_SCAN ? tk_cuda_scan_scratch_bytes(n)
                                         : tk_cuda_filter_scratch_bytes(TALLY_DTYPE_I32, n, 0);
    RT_OK(cudaMalloc(&d_in, n * 4));
    RT_OK(cudaMalloc(&d_out, n * 8));
    RT_OK(cudaMalloc(&d_small, 64));
    RT_OK(cudaMalloc(&d_scratch, scratch ? scratch : 16));
    RT_OK(cudaMemset(d_in, 1, n * 4));
    RT_OK(cudaMemset(d_small, 0, 64));
    tk_filter_spec_t spec = {.pred = TALLY_PRED_GT, .lo = 0};
    cudaEvent_t a, b;
    RT_OK(cudaEventCreate(&a));
    RT_OK(cudaEventCreate(&b));
    for (int i = -1; i < total; i++) { /* i = -1: the warm-up */
        if (i == 0)
            RT_OK(cudaEventRecord(a, 0));
        tally_status_t st =
            op == TALLY_OP_SCAN
                ? tk_cuda_scan(d_in, n, 0, 0, d_out, d_small, d_small, d_scratch, scratch, 0)
                : tk_cuda_filter(TALLY_DTYPE_I32, d_in, n, &spec, d_out, d_small, d_scratch,
                                 scratch, 0);
        assert_int_equal(st, TALLY_OK);
    }
    double elapsed = stop_timing(a, b);
    cudaFree(d_in);
    cudaFree(d_out);
    cudaFree(d_small);
    cudaFree(d_scratch);
    return (double)n * 4 * total / elapsed / 1e9;
}

/* Where tallyd's GPU requests spent their time, stage by stage (tallyd_gpu_stage_*_total in its
 * stats, docs/service.md): read before and after a run, the difference is that run's. */
static const char *const stage_names[] = {"submit", "to_lane", "launch", "device",
                                          "retire", "back",    "apply",  "to_front"};
#define STAGES (sizeof stage_names / sizeof stage_names[0])

typedef struct {
    double seconds[STAGES];
    double requests[STAGES];
} stages_t;

static double stat_value(const char *text, const char *family, const char *stage)
{
    char key[160];
    snprintf(key, sizeof key, "\n%s{stage=\"%s\"} ", family, stage);
    const char *at = strstr(text, key);
    return at ? strtod(at + strlen(key), NULL) : 0;
}

static stages_t stages_read(void *sock)
{
    stages_t st = {0};
    tally_req_t req = th_req(TALLY_OP_STATS, TALLY_DTYPE_NONE, 999998);
    th_reply_t reply;
    assert_int_equal(th_call(sock, &req, NULL, 0, &reply), 0);
    for (size_t i = 0; i < STAGES; i++) {
        st.seconds[i] = stat_value((const char *)reply.payload, "tallyd_gpu_stage_seconds_total",
                                   stage_names[i]);
        st.requests[i] = stat_value((const char *)reply.payload, "tallyd_gpu_stage_requests_total",
                                    stage_names[i]);
    }
    th_reply_free(&reply);
    return st;
}

/* One line: each stage's microseconds a request between `before` and now, and their sum. */
static void stages_print(void *sock, const char *what, const stages_t *before)
{
    stages_t now = stages_read(sock);
    char line[512];
    double total = 0;
    size_t len = (size_t)snprintf(line, sizeof line, "bench: stages, %s:", what);
    for (size_t i = 0; i < STAGES && len < sizeof line; i++) {
        double n = now.requests[i] - before->requests[i];
        double us = n > 0 ? (now.seconds[i] - before->seconds[i]) / n * 1e6 : 0;
        total += us;
        len += (size_t)snprintf(line + len, sizeof line - len, " %s %.1f;", stage_names[i], us);
    }
    print_message("%s in tallyd %.1f us a request\n", line, total);
}

/* The hardware's ceilings in this run (bench/ceilings.h, as kernel_bench measures them: 1 GiB
 * buffers, the median of 15 runs), which issue 34's targets compare the rows against: read for
 * the histograms, the device-to-device copy (bytes read + written) for filter and scan. */
typedef struct {
    double read, copy; /* GB/s */
} ceilings_t;

static ceilings_t measure_ceilings(void)
{
    ceilings_t c = {bench_read_ceiling(1ull << 30, 15), bench_copy_ceiling(1ull << 30, 15)};
    assert_true(c.read > 0 && c.copy > 0);
    print_message("bench: ceilings in this run: read %.0f GB/s, d2d copy %.0f GB/s (read + "
                  "written)\n",
                  c.read, c.copy);
    return c;
}

/* The bench rows of device output regions: filter (i32 > 0, unordered; every element kept: the
 * input is 0x01010101s) and scan (int64 out) on a 32 MiB device input region written into a
 * device output region, 8 in flight, against the copy ceiling (bytes read + written: 8 a
 * filtered element, 12 a scanned one) and the kernels on local memory, in the same run. */
static void bench_device_output(const char *gpu_name, const ceilings_t *c)
{
    const size_t len = 32 * MIB;
    galloc_t gi, go;
    galloc(len, &gi);
    galloc(2 * len, &go);
    RT_OK(cudaMemset((void *)(uintptr_t)gi.ptr, 1, gi.size));
    RT_OK(cudaDeviceSynchronize());
    uint64_t in, out;
    assert_int_equal(dev_register(side, gi.fd, gi.size, uuid, NULL, &in, NULL, 0), TALLY_OK);
    assert_int_equal(dev_register_flags(side, go.fd, go.size, uuid, TALLY_SHM_DEV_OUTPUT, NULL,
                                        &out, NULL, 0),
                     TALLY_OK);
    static const uint8_t ops[] = {TALLY_OP_FILTER, TALLY_OP_SCAN};
    for (size_t k = 0; k < 2; k++) {
        tally_req_t req = th_req(ops[k], TALLY_DTYPE_I32, 1);
        req.flags = TALLY_FLAG_SHM_REF;
        req.pred = ops[k] == TALLY_OP_FILTER ? TALLY_PRED_GT : 0;
        tally_shm_ref_t ref = {
            .in_handle = in, .in_length = len, .out_handle = out, .out_length = 2 * len};
        (void)ref_rate(gpu_sock, &req, &ref, (int)(BENCH_WARM_BYTES / len)); /* warm-up */
        stages_t st = stages_read(gpu_sock);
        double via = ref_rate(gpu_sock, &req, &ref, (int)(BENCH_BYTES / len));
        stages_print(gpu_sock, ops[k] == TALLY_OP_SCAN ? "scan 32 MiB" : "filter 32 MiB", &st);
        double kernel = kernel_out_rate(ops[k], len / 4, (int)(BENCH_BYTES / len));
        double moved = ops[k] == TALLY_OP_SCAN ? 3.0 : 2.0; /* bytes moved an input byte */
        print_message("bench: %s, %s i32 32 MiB device region -> device output region via "
                      "tallyd (%d in flight): %.0f GB/s in, %.0f moved; %.3f x the copy ceiling "
                      "(%.0f); the kernel at one in flight on local memory: %.0f GB/s in, "
                      "ratio %.2f\n",
                      gpu_name, ops[k] == TALLY_OP_SCAN ? "scan" : "filter", bench_inflight(), via,
                      via * moved, via * moved / c->copy, c->copy, kernel, via / kernel);
    }
    th_answer_t ans;
    assert_int_equal(th_side_call(side, TALLY_SHM_OP_RELEASE, NULL, in, -1, &ans), TALLY_OK);
    assert_int_equal(th_side_call(side, TALLY_SHM_OP_RELEASE, NULL, out, -1, &ans), TALLY_OK);
    gfree(&gi);
    gfree(&go);
}

/* On-CPU nanoseconds of each thread of process `pid` (/proc/PID/task/TID/schedstat), with its
 * name (comm), into t[0..cap); returns how many. Threads of one name are summed. */
typedef struct {
    char name[24];
    double ns;
} thread_cpu_t;

static int threads_cpu(pid_t pid, thread_cpu_t *t, int cap)
{
    char path[320];
    snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
    DIR *dir = opendir(path);
    int n = 0;
    for (struct dirent *e; dir && (e = readdir(dir));) {
        if (e->d_name[0] == '.')
            continue;
        char name[24] = "", buf[96];
        unsigned long long ns = 0;
        snprintf(path, sizeof path, "/proc/%d/task/%s/comm", (int)pid, e->d_name);
        FILE *f = fopen(path, "r");
        if (f && fgets(name, sizeof name, f))
            name[strcspn(name, "\n")] = 0;
        if (f)
            fclose(f);
        snprintf(path, sizeof path, "/proc/%d/task/%s/schedstat", (int)pid, e->d_name);
        f = fopen(path, "r");
        if (f && fgets(buf, sizeof buf, f))
            ns = strtoull(buf, NULL, 10);
        if (f)
            fclose(f);
        int k = 0;
        while (k < n && strcmp(t[k].name, name) != 0)
            k++;
        if (k == n && n < cap) {
            snprintf(t[n].name, sizeof t[n].name, "%s", name);
            t[n++].ns = 0;
        }
        if (k < n)
            t[k].ns += (double)ns;
    }
    if (dir)
        closedir(dir);
    return n;
}

/* Prints each thread's CPU microseconds a request between `before` and now (those above 0.5):
 * the thread near the wall time a request is the one that bounds the rate. */
static void print_threads_cpu(const char *who, pid_t pid, const thread_cpu_t *before, int nb,
                              int requests)
{
    thread_cpu_t now[64];
    int n = threads_cpu(pid, now, 64);
    char line[1024];
    size_t len = (size_t)snprintf(line, sizeof line, "bench: CPU a request, %s:", who);
    for (int i = 0; i < n && len < sizeof line; i++) {
        double was = 0;
        for (int k = 0; k < nb; k++)
            if (strcmp(before[k].name, now[i].name) == 0)
                was = before[k].ns;
        double us = (now[i].ns - was) / 1e3 / requests;
        if (us >= 0.5)
            len += (size_t)snprintf(line + len, sizeof line - len, " %s %.1f us;", now[i].name, us);
    }
    print_message("%s\n", line);
}

/* tallyd's cost a request, without the GPU's: hist u8 on a 2 MiB device region (about a
 * microsecond on the GPU), at one in flight (the round trip) and bench_inflight() (the rate
 * tallyd and this client sustain: the most requests a second any row can reach). */
static void bench_overhead(void)
{
    galloc_t g;
    galloc(2 * MIB, &g);
    RT_OK(cudaMemset((void *)(uintptr_t)g.ptr, 3, g.size));
    RT_OK(cudaDeviceSynchronize());
    uint64_t handle;
    assert_int_equal(dev_register(side, g.fd, g.size, uuid, NULL, &handle, NULL, 0), TALLY_OK);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 1);
    req.flags = TALLY_FLAG_SHM_REF;
    tally_shm_ref_t ref = {.in_handle = handle, .in_length = g.size};
    (void)ref_requests_per_s(gpu_sock, &req, &ref, 2000, bench_inflight()); /* warm-up */
    stages_t st = stages_read(gpu_sock);
    double one = ref_requests_per_s(gpu_sock, &req, &ref, 4000, 1);
    stages_print(gpu_sock, "2 MiB, one in flight", &st);
    thread_cpu_t tallyd[64], self[64];
    int nt = threads_cpu(gpu_d.pid, tallyd, 64), ns = threads_cpu(getpid(), self, 64);
    st = stages_read(gpu_sock);
    double many = ref_requests_per_s(gpu_sock, &req, &ref, 40000, bench_inflight());
    stages_print(gpu_sock, "2 MiB, 8 in flight", &st);
    print_message("bench: tallyd's cost a request (hist u8 2 MiB device region): one in flight "
                  "%.1f us a round trip; %d in flight %.0f requests/s (%.1f us a request)\n",
                  1e6 / one, bench_inflight(), many, 1e6 / many);
    print_threads_cpu("tallyd's threads", gpu_d.pid, tallyd, nt, 40000);
    print_threads_cpu("this client's threads", getpid(), self, ns, 40000);
    th_answer_t ans;
    assert_int_equal(th_side_call(side, TALLY_SHM_OP_RELEASE, NULL, handle, -1, &ans), TALLY_OK);
    gfree(&g);
}

/* GB/s of hist u8 by reference on a region of `size` bytes through the tallyd of sock, 8 in
 * flight. */
static double tallyd_rate(void *sock, uint64_t handle, size_t size, int total)
{
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 1);
    req.flags = TALLY_FLAG_SHM_REF;
    tally_shm_ref_t ref = {.in_handle = handle, .in_length = size};
    return ref_rate(sock, &req, &ref, total);
}

/* GB/s of the hist kernel reading d_in (size bytes) on the current GPU, back to back on one
 * stream: its own memory, or another GPU's over peer access. */
static double kernel_rate_at(const void *d_in, size_t size, int total)
{
    void *d_hist = NULL;
    RT_OK(cudaMalloc(&d_hist, sizeof(tk_hist_t)));
    cudaEvent_t a, b;
    RT_OK(cudaEventCreate(&a));
    RT_OK(cudaEventCreate(&b));
    assert_int_equal(tk_cuda_hist_u8(d_in, size, d_hist, NULL, 0, 0), TALLY_OK); /* warm-up */
    RT_OK(cudaEventRecord(a, 0));
    for (int i = 0; i < total; i++) {
        RT_OK(cudaMemsetAsync(d_hist, 0, sizeof(tk_hist_t), 0));
        assert_int_equal(tk_cuda_hist_u8(d_in, size, d_hist, NULL, 0, 0), TALLY_OK);
    }
    double elapsed = stop_timing(a, b);
    cudaFree(d_hist);
    return (double)size * total / elapsed / 1e9;
}

/* GB/s of the same kernel on this process's own memory. */
static double kernel_rate(size_t size, int total)
{
    void *d_in = NULL;
    RT_OK(cudaMalloc(&d_in, size));
    RT_OK(cudaMemset(d_in, 3, size));
    double rate = kernel_rate_at(d_in, size, total);
    cudaFree(d_in);
    return rate;
}

static void test_bench(void **state)
{
    (void)state;
    if (getenv("TALLY_REGION_QUICK")) { /* under compute-sanitizer: no figures to take */
        print_message("bench skipped (TALLY_REGION_QUICK)\n");
        return;
    }
    const size_t sizes[] = {64 * MIB, 256 * MIB};
    struct cudaDeviceProp prop;
    RT_OK(cudaGetDeviceProperties(&prop, 0));
    ceilings_t c = measure_ceilings();
    bench_overhead();
    for (size_t k = 0; k < 2; k++) {
        galloc_t g;
        galloc(sizes[k], &g);
        RT_OK(cudaMemset((void *)(uintptr_t)g.ptr, 3, g.size));
        RT_OK(cudaDeviceSynchronize());
        uint64_t handle;
        assert_int_equal(dev_register(side, g.fd, g.size, uuid, NULL, &handle, NULL, 0), TALLY_OK);
        int total = (int)(BENCH_BYTES / g.size);
        (void)tallyd_rate(gpu_sock, handle, g.size, (int)(BENCH_WARM_BYTES / g.size));
        stages_t st = stages_read(gpu_sock);
        double in_place = tallyd_rate(gpu_sock, handle, g.size, total);
        char what[64];
        snprintf(what, sizeof what, "hist %zu MiB, %d in flight", g.size / MIB, bench_inflight());
        stages_print(gpu_sock, what, &st);
        double kernel = kernel_rate(g.size, total);
        print_message("bench: %s, hist u8 %zu MiB device region via tallyd (%d in flight): %.0f "
                      "GB/s; %.3f x the read ceiling (%.0f); the kernel at one in flight on local "
                      "memory: %.0f GB/s, ratio %.2f\n",
                      prop.name, g.size / MIB, bench_inflight(), in_place, in_place / c.read,
                      c.read, kernel, in_place / kernel);
        th_answer_t ans;
        assert_int_equal(th_side_call(side, TALLY_SHM_OP_RELEASE, NULL, handle, -1, &ans),
                         TALLY_OK);
        gfree(&g);
    }
    bench_device_output(prop.name, &c);
}

/* ---- peer access (PROTOCOL.md §10 "Which GPU runs it"; scripts/gpu-check.sh STEPS=peer) ---- */

/* A tallyd that runs every reference on a peer GPU where one reaches the region
 * (--test-gpu-peer-always), its side connection and a DEALER with the producer's routing id. */
static th_daemon_t peer_d;
static int peer_side = -1;
static void *peer_sock;

static long long peer_stat(const char *where, int device)
{
    char name[128];
    snprintf(name, sizeof name, "tallyd_gpu_region_requests_total{device=\"%d\",where=\"%s\"}",
             device, where);
    long long v = th_stat(peer_sock, name);
    return v < 0 ? 0 : v;
}

/* One request by reference to [0, len) of `in` (op, dtype; a scan's output into `out` when not
 * 0, on stream "peer-scan") through the peer tallyd against the same bytes as a payload on the
 * CPU tallyd: the same reply (a scan's output read back from `out_ptr`). */
static void peer_diff(uint8_t op, uint8_t dtype, uint64_t in, const uint8_t *host, size_t len,
                      uint64_t out, CUdeviceptr out_ptr, uint64_t id)
{
    tally_req_t req = th_req(op, dtype, id);
    if (op == TALLY_OP_SCAN) {
        req.stream_len = 9;
        memcpy(req.stream, "peer-scan", 9);
    }
    th_reply_t p, c;
    assert_int_equal(th_call(cpu_sock, &req, host, len, &c), 0);
    assert_int_equal(c.rep.status, TALLY_OK);
    req.flags |= TALLY_FLAG_SHM_REF;
    tally_shm_ref_t ref = {.in_handle = in, .in_length = len};
    if (out) {
        ref.out_handle = out;
        ref.out_length = 2 * len;
    }
    uint8_t bytes[TALLY_SHM_REF_SIZE];
    tally_shm_ref_encode(&ref, bytes);
    assert_int_equal(th_call(peer_sock, &req, bytes, sizeof bytes, &p), 0);
    assert_int_equal(p.rep.status, TALLY_OK);
    assert_int_equal(p.rep.count, c.rep.count);
    assert_int_equal(p.rep.aux0, c.rep.aux0);
    if (out) {
        uint8_t *seen = malloc(c.len);
        assert_non_null(seen);
        RT_OK(cudaMemcpy(seen, (void *)(uintptr_t)out_ptr, c.len, cudaMemcpyDeviceToHost));
        assert_memory_equal(seen, c.payload, c.len);
        free(seen);
    } else {
        assert_int_equal(p.len, c.len);
        assert_memory_equal(p.payload, c.payload, c.len);
    }
    th_reply_free(&p);
    th_reply_free(&c);
}

/* The bench row: hist u8 on a 64 MiB region of GPU 0 run on GPU 1 through tallyd, 8 in flight,
 * against the same kernel on GPU 1 reading GPU 0's memory over peer access (the peer read
 * ceiling) and on GPU 0's own memory, in the same run. */
static void bench_peer(galloc_t *g, uint64_t handle)
{
    struct cudaDeviceProp prop;
    RT_OK(cudaGetDeviceProperties(&prop, 1));
    int total = (int)(BENCH_BYTES / 8 / g->size); /* 64 GiB: ~0.2 s at 370 GB/s */
    (void)tallyd_rate(peer_sock, handle, g->size, (int)(BENCH_WARM_BYTES / 8 / g->size));
    long long before = peer_stat("peer", 1);
    double via = tallyd_rate(peer_sock, handle, g->size, total);
    assert_int_equal(peer_stat("peer", 1), before + total);
    double local = kernel_rate(g->size, (int)(BENCH_BYTES / g->size)); /* as test_bench's */
    CUmemAccessDesc access = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 1},
                              .flags = CU_MEM_ACCESS_FLAGS_PROT_READ};
    CU_OK(cu.set_access(g->ptr, g->size, &access, 1));
    RT_OK(cudaSetDevice(1));
    double ceiling = kernel_rate_at((const void *)(uintptr_t)g->ptr, g->size, total);
    RT_OK(cudaSetDevice(0));
    print_message("bench: %s x2, hist u8 64 MiB device region of GPU 0 run on GPU 1 via tallyd "
                  "(peer access, 8 in flight): %.0f GB/s; the kernel on GPU 1 reading GPU 0's "
                  "memory (the peer read ceiling): %.0f GB/s; on GPU 0's own memory: %.0f GB/s; "
                  "ratio %.2f of the ceiling, %.2f of local\n",
                  prop.name, via, ceiling, local, via / ceiling, via / local);
}

/* Work on a peer GPU (issue 23): a region of GPU 0, registered without and with an IPC event
 * (opened by tallyd on GPU 1 too), read on GPU 1; a scan on a stream written from GPU 1 into a
 * device output region of GPU 0; each against the CPU tallyd's replies, all counted
 * where="peer" on GPU 1. Needs two GPUs, the second reaching the first (else skipped). */
static void test_peer(void **state)
{
    (void)state;
    int count = 0, can = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2 ||
        cudaDeviceCanAccessPeer(&can, 1, 0) != cudaSuccess || !can) {
        print_message("peer: needs two GPUs, GPU 1 reaching GPU 0's memory: skipped\n");
        skip();
    }
    const char *const args[] = {"--backend", "cuda", "--max-batch", "268435456",
                                "--test-gpu-peer-always", NULL};
    assert_int_equal(th_daemon_start(&peer_d, args), 0);
    peer_side = th_side_connect(peer_d.shm_socket);
    assert_true(peer_side >= 0);
    peer_sock = dealer(peer_d.endpoint, ID);
    const size_t len = 16 * MIB;
    galloc_t g, o;
    galloc(64 * MIB, &g);
    galloc(2 * len, &o);
    uint8_t *host = malloc(len);
    assert_non_null(host);
    for (size_t i = 0; i < len; i += 8) {
        uint64_t r = th_rand();
        memcpy(host + i, &r, 8);
    }
    RT_OK(cudaMemset((void *)(uintptr_t)g.ptr, 3, g.size));
    RT_OK(cudaMemcpy((void *)(uintptr_t)g.ptr, host, len, cudaMemcpyHostToDevice));
    cudaEvent_t ev;
    cudaIpcEventHandle_t evh;
    RT_OK(cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming));
    RT_OK(cudaIpcGetEventHandle(&evh, ev));
    RT_OK(cudaEventRecord(ev, 0));
    uint64_t plain, evented, out;
    char msg[256];
    assert_int_equal(dev_register(peer_side, g.fd, g.size, uuid, NULL, &plain, msg, sizeof msg),
                     TALLY_OK);
    assert_int_equal(dev_register(peer_side, g.fd, g.size, uuid, &evh, &evented, msg, sizeof msg),
                     TALLY_OK);
    assert_int_equal(dev_register_flags(peer_side, o.fd, o.size, uuid, TALLY_SHM_DEV_OUTPUT, NULL,
                                        &out, msg, sizeof msg),
                     TALLY_OK);
    peer_diff(TALLY_OP_HIST, TALLY_DTYPE_U8, plain, host, len, 0, 0, 1);
    if (peer_stat("peer", 1) != 1)
        fail_msg("peer: the region of GPU 0 ran on GPU %s, not on GPU 1",
                 peer_stat("owner", 0) ? "0 (not mapped on GPU 1?)" : "?");
    peer_diff(TALLY_OP_HIST, TALLY_DTYPE_U8, evented, host, len, 0, 0, 2);
    if (peer_stat("peer", 1) != 2)
        fail_msg("peer: the region with an IPC event ran on GPU 0: the event did not open on "
                 "GPU 1 (tallyd leaves such a peer out)");
    for (uint64_t id = 3; id < 5; id++) /* the scan's carry chained on GPU 1's lane */
        peer_diff(TALLY_OP_SCAN, TALLY_DTYPE_I32, evented, host, len, out, o.ptr, id);
    assert_int_equal(peer_stat("peer", 1), 4);
    assert_int_equal(peer_stat("owner", 0), 0);
    print_message("peer: 2 hists and 2 scans (into GPU 0's output region) of GPU 0's region run "
                  "on GPU 1, replies identical to the CPU's\n");
    if (!getenv("TALLY_REGION_QUICK"))
        bench_peer(&g, plain);
    th_answer_t ans;
    assert_int_equal(th_side_call(peer_side, TALLY_SHM_OP_RELEASE, NULL, plain, -1, &ans), 0);
    zmq_close(peer_sock);
    close(peer_side);
    assert_int_equal(th_daemon_stop(&peer_d, SIGTERM, 30000), 0);
    cudaEventDestroy(ev);
    gfree(&g);
    gfree(&o);
    free(host);
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "--producer") == 0)
        return producer(argv[2], argv[3]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_differential), cmocka_unit_test(test_device_output),
        cmocka_unit_test(test_libtally),
        cmocka_unit_test(test_refusals),     cmocka_unit_test(test_producer_killed),
        cmocka_unit_test(test_bench),       cmocka_unit_test(test_peer),
    };
    const char *only = getenv("TALLY_REGION_ONLY"); /* one test, e.g. test_peer (STEPS=peer) */
    if (only)
        cmocka_set_test_filter(only);
    return cmocka_run_group_tests(tests, setup, teardown);
}
