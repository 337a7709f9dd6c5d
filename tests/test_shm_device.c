/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_shm_device.c — device regions (PROTOCOL.md §10 "Device memory", issue 23) against
 * simulated GPUs (--backend cuda --test-sim-gpus N), where the "exported allocation" is a sealed
 * memfd of exactly the declared size and a GPU's UUID is "tallyd-sim-gpu", 0, its number:
 * the CPU backend's refusal, every registration refusal (unknown UUID, not an allocation, a
 * wrong size, a malformed op 3), the quotas shared with host regions, the descriptor that tallyd
 * holds until the region is released (counted in /proc/PID/fd), the release deferred while a
 * request uses the region, the handle's bit 63, `info` gpu_uuids, requests by reference read
 * in place with the results a payload gets, and many on no stream in flight at once (the front
 * runs and finishes them on several shards, issue 34) with every stage of each counted. The real import is gpu-check.sh's (test_gpu_region).
 */
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <zmq.h>

#include <cmocka.h>

#include "harness.h"
#include "reference.h"
#include "shm_side.h"
#include "tally.h"

#define SEALS (F_SEAL_SHRINK | F_SEAL_GROW)
#define REGION_BYTES (1u << 20)

static const char *const sim2[] = {"--backend", "cuda", "--test-sim-gpus", "2", NULL};

/* Sends op 3 for fd (declared size bytes, on the GPU with uuid, flags) and reads the answer:
 * its status, or -1 without one. */
static int dev_register(int side, int fd, uint64_t size, const uint8_t *uuid, uint32_t flags,
                        th_answer_t *ans)
{
    tally_shm_msg_t m = {
        .op = TALLY_SHM_OP_REGISTER_DEVICE, .id_len = 8, .dev_size = size, .dev_flags = flags};
    memcpy(m.id, "producer", 8);
    memcpy(m.gpu_uuid, uuid, TALLY_GPU_UUID_SIZE);
    if (flags & TALLY_SHM_DEV_EVENT)
        memset(m.event, 0x11, sizeof m.event);
    uint8_t buf[TALLY_SHM_MSG_MAX];
    size_t len = tally_shm_msg_encode(&m, buf);
    if (th_side_send_raw(side, buf, len, &fd, fd >= 0 ? 1 : 0) != 0)
        return -1;
    return th_side_recv(side, ans, 5000) == 1 ? (int)ans->a.status : -1;
}

/* A sealed memfd of size bytes holding data (len bytes, may be NULL). */
static int filled_memfd(size_t size, const void *data, size_t len)
{
    int fd = th_memfd(size, SEALS);
    if (data)
        assert_int_equal(pwrite(fd, data, len, 0), (ssize_t)len);
    return fd;
}

static void *dealer(void *ctx, const char *endpoint, const char *id)
{
    void *s = th_dealer_id(ctx, endpoint, id, 10000);
    assert_non_null(s);
    return s;
}

/* `info`'s value of key, copied to out. */
static void info_value(void *sock, const char *key, char *out, size_t cap)
{
    th_reply_t r;
    tally_req_t req = th_req(TALLY_OP_INFO, TALLY_DTYPE_NONE, 1);
    assert_int_equal(th_call(sock, &req, NULL, 0, &r), 0);
    char want[64];
    snprintf(want, sizeof want, "\n%s=", key);
    const char *p = strstr((const char *)r.payload, want);
    assert_non_null(p);
    p += strlen(want);
    size_t n = strcspn(p, "\n");
    assert_true(n < cap);
    memcpy(out, p, n);
    out[n] = '\0';
    th_reply_free(&r);
}

/* Closes a test's DEALER, its context and its side connection. */
static void finish_clients(void *ctx, void *sock, int side)
{
    zmq_close(sock);
    zmq_ctx_term(ctx);
    close(side);
}

/* A hist of a payload is answered ok (tallyd serves on, on a GPU or the CPU). */
static void expect_payload_served(void *sock)
{
    int32_t batch[64] = {0};
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_I32, 5);
    req.lo = -100;
    req.hi = 100;
    th_reply_t r;
    assert_int_equal(th_call(sock, &req, batch, sizeof batch, &r), 0);
    assert_int_equal(r.rep.status, TALLY_OK);
    th_reply_free(&r);
}

/* Starts tallyd with args and connects to its side channel; uuid is simulated GPU gpu's. */
static int start_side(th_daemon_t *d, const char *const *args, unsigned gpu, uint8_t *uuid)
{
    assert_int_equal(th_daemon_start(d, args), 0);
    int side = th_side_connect(d->shm_socket);
    assert_true(side >= 0);
    th_sim_uuid(gpu, uuid);
    return side;
}

/* tallyd's descriptors once they stop changing (the harness's ping and other connections close
 * asynchronously): the same count twice, 200 ms apart. */
static int stable_fds(pid_t pid)
{
    int last = th_fd_count(pid);
    for (int i = 0; i < 50; i++) {
        th_sleep_ms(200);
        int now = th_fd_count(pid);
        if (now == last)
            return now;
        last = now;
    }
    return last;
}

/* tallyd's descriptor count once it is want (up to 30 s), else what it is then. */
static int fds_reach(pid_t pid, int want)
{
    int now = th_fd_count(pid);
    for (int64_t t0 = th_now_ms(); now != want && th_now_ms() - t0 < 30000;) {
        th_sleep_ms(50);
        now = th_fd_count(pid);
    }
    return now;
}

static void test_cpu_backend_refuses(void **state)
{
    (void)state;
    th_daemon_t d;
    uint8_t uuid[TALLY_GPU_UUID_SIZE];
    int side = start_side(&d, NULL, 0, uuid);
    th_answer_t ans;
    for (int i = 0; i < 2; i++) { /* refused, and the connection stays */
        int fd = filled_memfd(REGION_BYTES, NULL, 0);
        assert_int_equal(dev_register(side, fd, REGION_BYTES, uuid, 0, &ans), TALLY_E_BAD_REF);
        assert_non_null(strstr(ans.msg, "a GPU is needed"));
        assert_int_equal(ans.a.op, TALLY_SHM_OP_REGISTER_DEVICE);
        close(fd);
    }
    void *ctx = zmq_ctx_new();
    void *sock = dealer(ctx, d.endpoint, "producer");
    char value[256];
    info_value(sock, "gpu_uuids", value, sizeof value);
    assert_string_equal(value, "");
    finish_clients(ctx, sock, side);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
}

static void test_refusals(void **state)
{
    (void)state;
    th_daemon_t d;
    uint8_t uuid[TALLY_GPU_UUID_SIZE];
    int side = start_side(&d, sim2, 7, uuid); /* no such GPU */
    th_answer_t ans;
    int fd = filled_memfd(REGION_BYTES, NULL, 0);
    assert_int_equal(dev_register(side, fd, REGION_BYTES, uuid, 0, &ans), TALLY_E_BAD_REF);
    assert_non_null(strstr(ans.msg, "no GPU with UUID GPU-74616c6c-7964-2d73-696d-2d6770750007"));
    th_sim_uuid(1, uuid);
    assert_int_equal(dev_register(side, fd, REGION_BYTES / 2, uuid, 0, &ans), TALLY_E_BAD_REF);
    assert_non_null(strstr(ans.msg, "is not the allocation's size"));
    close(fd);
    int pipefd[2];
    assert_int_equal(pipe(pipefd), 0);
    assert_int_equal(dev_register(side, pipefd[0], 4096, uuid, 0, &ans), TALLY_E_BAD_REF);
    assert_non_null(strstr(ans.msg, "not an exportable GPU allocation"));
    close(pipefd[0]);
    close(pipefd[1]);
    /* Accepted, on GPU 1, with bit 63 set in the handle. */
    fd = filled_memfd(REGION_BYTES, NULL, 0);
    assert_int_equal(dev_register(side, fd, REGION_BYTES, uuid, 0, &ans), TALLY_OK);
    close(fd);
    assert_true(ans.a.handle & TALLY_SHM_DEVICE_HANDLE_BIT);
    assert_int_equal(ans.a.size, REGION_BYTES);
    /* A malformed op 3 (no descriptor) is answered and closes the connection. */
    assert_int_equal(dev_register(side, -1, REGION_BYTES, uuid, 0, &ans), TALLY_E_PARAM);
    assert_true(th_side_closed(side, 5000));
    close(side);
    void *ctx = zmq_ctx_new();
    void *sock = dealer(ctx, d.endpoint, "producer");
    char value[256];
    info_value(sock, "gpu_uuids", value, sizeof value);
    assert_string_equal(value, "GPU-74616c6c-7964-2d73-696d-2d6770750000,"
                               "GPU-74616c6c-7964-2d73-696d-2d6770750001");
    zmq_close(sock);
    zmq_ctx_term(ctx);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
}

/* Device regions count in max_regions_per_peer and, with host regions, in max_bytes. */
static void test_quotas(void **state)
{
    (void)state;
    th_daemon_t d;
    const char *const args[] = {"--backend",
                                "cuda",
                                "--test-sim-gpus",
                                "1",
                                "--shm-max-regions-per-peer",
                                "2",
                                "--shm-max-bytes",
                                "3145728",
                                NULL};
    uint8_t uuid[TALLY_GPU_UUID_SIZE];
    int side = start_side(&d, args, 0, uuid);
    th_answer_t ans;
    int fd = filled_memfd(2 * REGION_BYTES, NULL, 0);
    assert_int_equal(dev_register(side, fd, 2 * REGION_BYTES, uuid, 0, &ans), TALLY_OK);
    close(fd);
    fd = th_memfd(2 * REGION_BYTES, SEALS); /* a host region over the 3 MiB left: 2 + 2 > 3 */
    assert_int_equal(th_side_call(side, TALLY_SHM_OP_REGISTER, "producer", 0, fd, &ans),
                     TALLY_E_QUOTA);
    close(fd);
    fd = filled_memfd(2 * REGION_BYTES, NULL, 0); /* a device one too */
    assert_int_equal(dev_register(side, fd, 2 * REGION_BYTES, uuid, 0, &ans), TALLY_E_QUOTA);
    assert_non_null(strstr(ans.msg, "shm_max_bytes"));
    close(fd);
    fd = th_memfd(REGION_BYTES, SEALS); /* the second region fits */
    assert_int_equal(th_side_call(side, TALLY_SHM_OP_REGISTER, "producer", 0, fd, &ans), TALLY_OK);
    close(fd);
    fd = filled_memfd(4096, NULL, 0); /* a third does not: regions per connection */
    assert_int_equal(dev_register(side, fd, 4096, uuid, 0, &ans), TALLY_E_QUOTA);
    assert_non_null(strstr(ans.msg, "maximum of 2 regions"));
    close(fd);
    close(side);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
}

/* tallyd holds the received descriptor while the region lives (the memory lives while someone
 * holds it), and closes it at release and at the connection's close. */
static void test_descriptor_held_until_release(void **state)
{
    (void)state;
    th_daemon_t d;
    uint8_t uuid[TALLY_GPU_UUID_SIZE];
    int side = start_side(&d, sim2, 0, uuid);
    th_answer_t ans;
    int fd = filled_memfd(4096, NULL, 0);
    /* A base after a first registration: the connection's own descriptor is in it. */
    assert_int_equal(dev_register(side, fd, 4096, uuid, 0, &ans), TALLY_OK);
    uint64_t first = ans.a.handle;
    int base = stable_fds(d.pid);
    assert_int_equal(dev_register(side, fd, 4096, uuid, 0, &ans), TALLY_OK);
    assert_int_equal(fds_reach(d.pid, base + 1), base + 1);
    assert_int_equal(th_side_call(side, TALLY_SHM_OP_RELEASE, NULL, ans.a.handle, -1, &ans),
                     TALLY_OK);
    assert_int_equal(fds_reach(d.pid, base), base);
    assert_int_equal(th_side_call(side, TALLY_SHM_OP_RELEASE, NULL, first, -1, &ans), TALLY_OK);
    assert_int_equal(fds_reach(d.pid, base - 1), base - 1);
    /* Refusals leave nothing behind. */
    assert_int_equal(dev_register(side, fd, 8192, uuid, 0, &ans), TALLY_E_BAD_REF);
    assert_int_equal(fds_reach(d.pid, base - 1), base - 1);
    /* Closing the connection releases its regions and their descriptors; one of them an output
     * region with an IPC event (PROTOCOL.md §10: the import waits on it, the simulated device
     * has nothing to wait for), held the same way. */
    assert_int_equal(dev_register(side, fd, 4096, uuid, 0, &ans), TALLY_OK);
    assert_int_equal(
        dev_register(side, fd, 4096, uuid, TALLY_SHM_DEV_OUTPUT | TALLY_SHM_DEV_EVENT, &ans),
        TALLY_OK);
    assert_true(th_daemon_log_contains(&d, "(4096 bytes on GPU 0, read-write, with an IPC event)"));
    assert_int_equal(fds_reach(d.pid, base + 1), base + 1);
    close(side);
    assert_int_equal(fds_reach(d.pid, base - 2), base - 2);
    close(fd);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
}

static uint32_t ref_call(void *sock, uint8_t opcode, const char *stream, uint64_t handle,
                         uint64_t offset, uint64_t length, uint64_t out_handle, th_reply_t *r)
{
    static uint64_t id = 100;
    tally_req_t req = th_req(opcode, TALLY_DTYPE_I32, ++id);
    req.flags = TALLY_FLAG_SHM_REF;
    if (opcode == TALLY_OP_FILTER)
        req.pred = TALLY_PRED_GT;
    if (opcode == TALLY_OP_HIST) {
        req.lo = -100;
        req.hi = 100;
    }
    if (stream) {
        req.stream_len = (uint8_t)strlen(stream);
        memcpy(req.stream, stream, req.stream_len);
    }
    tally_shm_ref_t ref = {.in_handle = handle, .in_offset = offset, .in_length = length};
    if (out_handle) {
        ref.out_handle = out_handle;
        ref.out_length = 2 * length;
    }
    uint8_t bytes[TALLY_SHM_REF_SIZE];
    tally_shm_ref_encode(&ref, bytes);
    assert_int_equal(th_call(sock, &req, bytes, sizeof bytes, r), 0);
    assert_int_equal(r->rep.request_id, id);
    return r->rep.status;
}

/* The same batch by device reference and as a payload: the same replies, the scan's carry
 * continued on a stream across both forms. */
static void test_requests_in_place(void **state)
{
    (void)state;
    enum { N = 50000 };
    int32_t *data = th_random_i32(N, -120, 120);
    th_daemon_t d;
    uint8_t uuid[TALLY_GPU_UUID_SIZE];
    int side = start_side(&d, sim2, 1, uuid);
    th_answer_t ans;
    int fd = filled_memfd(REGION_BYTES, data, N * sizeof(int32_t));
    assert_int_equal(dev_register(side, fd, REGION_BYTES, uuid, TALLY_SHM_DEV_OUTPUT, &ans),
                     TALLY_OK);
    close(fd);
    uint64_t h = ans.a.handle;
    void *ctx = zmq_ctx_new();
    void *sock = dealer(ctx, d.endpoint, "producer");
    static const uint8_t ops[] = {TALLY_OP_HIST, TALLY_OP_FILTER, TALLY_OP_SCAN};
    for (size_t i = 0; i < sizeof ops; i++) {
        th_reply_t by_ref, by_payload;
        assert_int_equal(ref_call(sock, ops[i], "s", h, 8, (N - 2) * 4, 0, &by_ref), TALLY_OK);
        tally_req_t req = th_req(ops[i], TALLY_DTYPE_I32, 7);
        req.pred = ops[i] == TALLY_OP_FILTER ? TALLY_PRED_GT : 0;
        req.lo = ops[i] == TALLY_OP_HIST ? -100 : 0;
        req.hi = ops[i] == TALLY_OP_HIST ? 100 : 0;
        req.stream_len = 1;
        req.stream[0] = 't';
        assert_int_equal(th_call(sock, &req, data + 2, (N - 2) * 4, &by_payload), 0);
        assert_int_equal(by_payload.rep.status, TALLY_OK);
        assert_int_equal(by_ref.rep.count, by_payload.rep.count);
        assert_int_equal(by_ref.rep.aux0, by_payload.rep.aux0);
        assert_int_equal(by_ref.len, by_payload.len);
        if (ops[i] != TALLY_OP_FILTER) /* the unordered filter's order may differ */
            assert_memory_equal(by_ref.payload, by_payload.payload, by_ref.len);
        th_reply_free(&by_ref);
        th_reply_free(&by_payload);
    }
    /* Bounds as for host regions. */
    th_reply_t r;
    assert_int_equal(ref_call(sock, TALLY_OP_HIST, NULL, h, REGION_BYTES - 4, 8, 0, &r),
                     TALLY_E_BAD_REF);
    th_reply_free(&r);
    finish_clients(ctx, sock, side);
    free(data);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
}

/* Waits until tallyd counts `regions` shared-memory regions (a device region counts from the
 * moment its import is handed to a worker). */
static void wait_shm_regions(void *sock, long long regions)
{
    int64_t t0 = th_now_ms();
    while (th_stat(sock, "tallyd_shm_regions") != regions) {
        assert_true(th_now_ms() - t0 < 30000);
        th_sleep_ms(20);
    }
}

/* A device region's import runs on a worker (TALLYD_TEST_SIM_REGISTER_US makes each take 3 s
 * here): meanwhile the loop answers (stats that count the region, then a ping) before the
 * producer has its answer, which a loop busy with the import would have sent first (an order,
 * not a time: a loaded box may take long over each reply); the region's handle is not usable
 * yet. A refused import (a wrong size) is answered the same way, its descriptor closed; a
 * connection closed mid-import leaves nothing imported (the descriptor closed). */
static void test_import_off_loop(void **state)
{
    (void)state;
    th_daemon_t d;
    uint8_t uuid[TALLY_GPU_UUID_SIZE];
    setenv("TALLYD_TEST_SIM_REGISTER_US", "3000000", 1);
    int side = start_side(&d, sim2, 0, uuid);
    unsetenv("TALLYD_TEST_SIM_REGISTER_US");
    void *ctx = zmq_ctx_new();
    void *sock = dealer(ctx, d.endpoint, "producer");
    char value[256];
    info_value(sock, "gpu_uuids", value, sizeof value);
    int base = stable_fds(d.pid);
    tally_shm_msg_t m = {.op = TALLY_SHM_OP_REGISTER_DEVICE,
                         .id_len = 8,
                         .dev_size = REGION_BYTES,
                         .dev_flags = 0};
    memcpy(m.id, "producer", 8);
    memcpy(m.gpu_uuid, uuid, TALLY_GPU_UUID_SIZE);
    uint8_t buf[TALLY_SHM_MSG_MAX];
    size_t len = tally_shm_msg_encode(&m, buf);
    int fd = filled_memfd(REGION_BYTES, NULL, 0);
    assert_int_equal(th_side_send_raw(side, buf, len, &fd, 1), 0);
    close(fd);
    wait_shm_regions(sock, 1); /* read, and handed to a worker */
    assert_false(th_side_answer_waiting(side));
    th_reply_t r;
    tally_req_t ping = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, 40);
    assert_int_equal(th_call(sock, &ping, NULL, 0, &r), 0);
    th_reply_free(&r);
    assert_false(th_side_answer_waiting(side));
    th_answer_t ans;
    assert_int_equal(th_side_recv(side, &ans, 10000), 1);
    assert_int_equal(ans.a.status, TALLY_OK);
    assert_int_equal(ans.a.size, REGION_BYTES);
    assert_int_equal(fds_reach(d.pid, base + 1), base + 1); /* the import holds its descriptor */
    /* Refused on the worker (a wrong size): answered, its descriptor closed. */
    fd = filled_memfd(REGION_BYTES, NULL, 0);
    assert_int_equal(dev_register(side, fd, 2 * REGION_BYTES, uuid, 0, &ans), TALLY_E_BAD_REF);
    assert_non_null(strstr(ans.msg, "not the allocation's size"));
    close(fd);
    assert_int_equal(fds_reach(d.pid, base + 1), base + 1);
    assert_int_equal(th_stat(sock, "tallyd_gpu_regions"), 1);
    /* A connection closed mid-import: once the worker is done, nothing of it is left. */
    int side2 = th_side_connect(d.shm_socket);
    assert_true(side2 >= 0);
    fd = filled_memfd(REGION_BYTES, NULL, 0);
    assert_int_equal(th_side_send_raw(side2, buf, len, &fd, 1), 0);
    close(fd);
    wait_shm_regions(sock, 2); /* its import runs */
    close(side2);
    close(side); /* and the first region goes with its connection */
    assert_int_equal(fds_reach(d.pid, base - 1), base - 1);
    wait_shm_regions(sock, 0);
    assert_int_equal(th_stat(sock, "tallyd_gpu_regions"), 0);
    assert_int_equal(th_stat(sock, "tallyd_gpu_region_bytes"), 0);
    zmq_close(sock);
    zmq_ctx_term(ctx);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
}

/* A stop while two imports run on their workers, one that succeeds and one refused (a wrong
 * size): both side connections are closed without an answer, and tallyd exits cleanly with
 * nothing imported left (the region gauges at 0 before the end, every descriptor closed). */
static void test_stop_mid_import(void **state)
{
    (void)state;
    th_daemon_t d;
    uint8_t uuid[TALLY_GPU_UUID_SIZE];
    setenv("TALLYD_TEST_SIM_REGISTER_US", "1000000", 1);
    int good = start_side(&d, sim2, 0, uuid);
    unsetenv("TALLYD_TEST_SIM_REGISTER_US");
    int bad = th_side_connect(d.shm_socket);
    assert_true(bad >= 0);
    void *ctx = zmq_ctx_new();
    void *sock = dealer(ctx, d.endpoint, "producer");
    const uint64_t sizes[2] = {REGION_BYTES, 2 * REGION_BYTES};
    const int sides[2] = {good, bad};
    for (int i = 0; i < 2; i++) {
        tally_shm_msg_t m = {
            .op = TALLY_SHM_OP_REGISTER_DEVICE, .id_len = 8, .dev_size = sizes[i], .dev_flags = 0};
        memcpy(m.id, "producer", 8);
        memcpy(m.gpu_uuid, uuid, TALLY_GPU_UUID_SIZE);
        uint8_t buf[TALLY_SHM_MSG_MAX];
        size_t len = tally_shm_msg_encode(&m, buf);
        int fd = filled_memfd(REGION_BYTES, NULL, 0);
        assert_int_equal(th_side_send_raw(sides[i], buf, len, &fd, 1), 0);
        close(fd);
    }
    wait_shm_regions(sock, 2); /* both handed to their workers */
    zmq_close(sock);
    zmq_ctx_term(ctx);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
    for (int i = 0; i < 2; i++) {
        th_answer_t ans;
        assert_int_equal(th_side_recv(sides[i], &ans, 5000), 0); /* closed, never answered */
        close(sides[i]);
    }
    assert_false(th_daemon_log_contains(&d, "regions still referenced at exit"));
}

/* `tally hist|filter|scan --gpu-region` (TALLY_TEST_SIM_GPU=1: libtally's "GPU memory" is a
 * sealed memfd that the simulated GPUs import): the chunks go by device reference, filter and
 * scan output is written into the device region by tallyd, and every output equals the one
 * without --gpu-region; the device path was taken (tallyd_gpu_region_requests_total) and its
 * region released at the end. Without a device region to be had (a CPU-backend tallyd, or no
 * CUDA driver) the command fails with the reason. */
static void test_cli_gpu_region(void **state)
{
    (void)state;
    char dir[64];
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-gpuregion"), 0);
    enum { N = 300000 };
    int32_t *data = th_random_i32(N, -1000, 1000);
    assert_int_equal(th_write_file(dir, "in.bin", data, N * sizeof(int32_t)), 0);
    th_daemon_t d;
    uint8_t uuid[TALLY_GPU_UUID_SIZE];
    int side = start_side(&d, sim2, 0, uuid);
    close(side);
    static const char *const cmds[] = {
        "hist --type i32 --range -1000 1000 --in in.bin --chunk 256K",
        "filter --gt 100 --stable --in in.bin --chunk 256K",
        "scan --in in.bin --chunk 256K --stream s1",
        "scan --out32 --exclusive --in in.bin --chunk 64K",
    };
    setenv("TALLY_TEST_SIM_GPU", "1", 1);
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        th_cli_t plain = th_cli(dir, d.endpoint, "%s", cmds[i]);
        th_cli_t dev = th_cli(dir, d.endpoint, "%s --gpu-region", cmds[i]);
        if (plain.status != 0 || dev.status != 0)
            fail_msg("%s: exit %d / %d: %s %s", cmds[i], plain.status, dev.status, plain.err,
                     dev.err);
        if (i == 2) /* the stream's second push continues its sums: compare with a fresh one */
            assert_true(strcmp(plain.out, dev.out) != 0);
        else if (strcmp(plain.out, dev.out) != 0)
            fail_msg("%s: the output differs with --gpu-region", cmds[i]);
        th_cli_free(&plain);
        th_cli_free(&dev);
    }
    th_cli_t fresh = th_cli(dir, d.endpoint, "scan --in in.bin --chunk 256K --gpu-region --stream s2");
    th_cli_t fresh_plain = th_cli(dir, d.endpoint, "scan --in in.bin --chunk 256K --stream s3");
    assert_int_equal(fresh.status, 0);
    assert_string_equal(fresh.out, fresh_plain.out);
    th_cli_free(&fresh);
    th_cli_free(&fresh_plain);
    void *ctx = zmq_ctx_new();
    void *sock = dealer(ctx, d.endpoint, "producer");
    assert_true(th_stat(sock, "tallyd_gpu_region_requests_total{device=\"0\",where=\"owner\"}") >
                10);
    for (int i = 0; i < 100 && th_stat(sock, "tallyd_gpu_regions") != 0; i++)
        th_sleep_ms(50);
    assert_int_equal(th_stat(sock, "tallyd_gpu_regions"), 0);
    zmq_close(sock);
    zmq_ctx_term(ctx);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
    /* A CPU-backend tallyd refuses the region: the reason, exit status 1. */
    side = start_side(&d, NULL, 0, uuid);
    close(side);
    th_cli_t r = th_cli(dir, d.endpoint, "hist --in in.bin --gpu-region");
    assert_int_not_equal(r.status, 0);
    assert_non_null(strstr(r.err, "a GPU is needed for device regions"));
    th_cli_free(&r);
    unsetenv("TALLY_TEST_SIM_GPU");
    if (access("/dev/nvidiactl", F_OK) != 0) { /* no driver: says so */
        r = th_cli(dir, d.endpoint, "hist --in in.bin --gpu-region");
        assert_int_not_equal(r.status, 0);
        assert_non_null(strstr(r.err, "cannot allocate"));
        assert_non_null(strstr(r.err, "CUDA"));
        th_cli_free(&r);
    }
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
    assert_int_equal(th_rmrf(dir), 0);
    free(data);
}

/* A reference with an output range: out_offset and out_length set (the worst case, 2 x the
 * input's bytes for an int64 scan). */
static uint32_t ref_out_call(void *sock, uint8_t opcode, const char *stream, uint64_t in,
                             uint64_t in_length, uint64_t out, uint64_t out_offset, th_reply_t *r)
{
    static uint64_t id = 5000;
    tally_req_t req = th_req(opcode, TALLY_DTYPE_I32, ++id);
    req.flags = TALLY_FLAG_SHM_REF | (opcode == TALLY_OP_FILTER ? TALLY_FLAG_FILTER_STABLE : 0);
    req.pred = opcode == TALLY_OP_FILTER ? TALLY_PRED_GT : 0;
    if (stream) {
        req.stream_len = (uint8_t)strlen(stream);
        memcpy(req.stream, stream, req.stream_len);
    }
    tally_shm_ref_t ref = {.in_handle = in,
                           .in_length = in_length,
                           .out_handle = out,
                           .out_offset = out_offset,
                           .out_length = 2 * in_length};
    uint8_t bytes[TALLY_SHM_REF_SIZE];
    tally_shm_ref_encode(&ref, bytes);
    assert_int_equal(th_call(sock, &req, bytes, sizeof bytes, r), 0);
    assert_int_equal(r->rep.request_id, id);
    return r->rep.status;
}

/* Device output regions (PROTOCOL.md §10 "Device memory"): a filter's and a scan's output is
 * written into a region registered with DEV_OUTPUT and the reply carries only its header, the
 * output equal to a payload's reply (the scan's carry continued on a stream); the input may be a
 * host region too, and the request then runs on the output's GPU; refusals: an output region
 * registered without DEV_OUTPUT (read-only), an unknown device handle, input and output on two
 * GPUs, a range past the end. */
static void test_device_output(void **state)
{
    (void)state;
    enum { N = 30000 };
    int32_t *data = th_random_i32(N, -120, 120);
    th_daemon_t d;
    uint8_t uuid1[TALLY_GPU_UUID_SIZE], uuid0[TALLY_GPU_UUID_SIZE];
    int side = start_side(&d, sim2, 1, uuid1);
    th_sim_uuid(0, uuid0);
    th_answer_t ans;
    int in_fd = filled_memfd(REGION_BYTES, data, N * sizeof(int32_t));
    int out_fd = filled_memfd(REGION_BYTES, NULL, 0);
    int far_fd = filled_memfd(REGION_BYTES, NULL, 0);
    assert_int_equal(dev_register(side, in_fd, REGION_BYTES, uuid1, 0, &ans), TALLY_OK);
    uint64_t in = ans.a.handle;
    assert_int_equal(dev_register(side, out_fd, REGION_BYTES, uuid1, TALLY_SHM_DEV_OUTPUT, &ans),
                     TALLY_OK);
    uint64_t out = ans.a.handle;
    assert_int_equal(dev_register(side, far_fd, REGION_BYTES, uuid0, TALLY_SHM_DEV_OUTPUT, &ans),
                     TALLY_OK);
    uint64_t far = ans.a.handle;
    const uint8_t *seen = mmap(NULL, REGION_BYTES, PROT_READ, MAP_SHARED, out_fd, 0);
    assert_true(seen != MAP_FAILED);
    void *ctx = zmq_ctx_new();
    void *sock = dealer(ctx, d.endpoint, "producer");
    for (int round = 0; round < 2; round++) { /* the scan's carry runs on across both */
        static const uint8_t ops[] = {TALLY_OP_FILTER, TALLY_OP_SCAN};
        for (size_t i = 0; i < sizeof ops; i++) {
            th_reply_t by_ref, by_payload;
            assert_int_equal(ref_out_call(sock, ops[i], "o", in, N * 4, out, 64, &by_ref),
                             TALLY_OK);
            assert_int_equal(by_ref.len, 0);
            tally_req_t req = th_req(ops[i], TALLY_DTYPE_I32, 7);
            req.flags = ops[i] == TALLY_OP_FILTER ? TALLY_FLAG_FILTER_STABLE : 0;
            req.pred = ops[i] == TALLY_OP_FILTER ? TALLY_PRED_GT : 0;
            req.stream_len = 1;
            req.stream[0] = 'p';
            assert_int_equal(th_call(sock, &req, data, N * 4, &by_payload), 0);
            assert_int_equal(by_payload.rep.status, TALLY_OK);
            assert_int_equal(by_ref.rep.count, by_payload.rep.count);
            assert_int_equal(by_ref.rep.aux0, by_payload.rep.aux0);
            assert_memory_equal(seen + 64, by_payload.payload, by_payload.len);
            th_reply_free(&by_ref);
            th_reply_free(&by_payload);
        }
    }
    /* The payloads ran on the least loaded GPU; the references on the regions' GPU 1. */
    assert_int_equal(th_stat(sock, "tallyd_gpu_requests_total{device=\"1\"}"), 4);
    th_reply_t r;
    assert_int_equal(ref_out_call(sock, TALLY_OP_SCAN, NULL, in, 4096, in, 0, &r),
                     TALLY_E_BAD_REF);
    assert_non_null(strstr((const char *)r.payload, "read-only"));
    th_reply_free(&r);
    /* A device handle no region has, on a tallyd with GPUs: unknown, not "a GPU is needed". */
    assert_int_equal(ref_out_call(sock, TALLY_OP_SCAN, NULL, in ^ 2, 4096, out, 0, &r),
                     TALLY_E_BAD_REF);
    assert_non_null(strstr((const char *)r.payload, "is not a region registered by this peer"));
    th_reply_free(&r);
    assert_int_equal(ref_out_call(sock, TALLY_OP_SCAN, NULL, in, 4096, far, 0, &r),
                     TALLY_E_BAD_REF);
    assert_non_null(strstr((const char *)r.payload, "both must be on one GPU"));
    th_reply_free(&r);
    assert_int_equal(ref_out_call(sock, TALLY_OP_SCAN, NULL, in, 4096, out, REGION_BYTES - 4096,
                                  &r),
                     TALLY_E_BAD_REF);
    assert_non_null(strstr((const char *)r.payload, "output range"));
    th_reply_free(&r);
    /* A host region's input, a device region's output: run on the output's GPU (0 here). */
    int host_fd = filled_memfd(REGION_BYTES, data, N * sizeof(int32_t));
    assert_int_equal(th_side_call(side, TALLY_SHM_OP_REGISTER, "producer", 0, host_fd, &ans),
                     TALLY_OK);
    close(host_fd);
    long long on0 = th_stat(sock, "tallyd_gpu_requests_total{device=\"0\"}");
    assert_int_equal(ref_out_call(sock, TALLY_OP_FILTER, NULL, ans.a.handle, N * 4, far, 0, &r),
                     TALLY_OK);
    assert_int_equal(r.len, 0);
    uint64_t kept = r.rep.count;
    th_reply_free(&r);
    const int32_t *far_seen = mmap(NULL, REGION_BYTES, PROT_READ, MAP_SHARED, far_fd, 0);
    assert_true(far_seen != MAP_FAILED);
    uint64_t want = 0;
    for (int i = 0; i < N; i++)
        if (data[i] > 0)
            assert_int_equal(far_seen[want++], data[i]); /* stable: in input order */
    assert_int_equal(kept, want);
    assert_int_equal(th_stat(sock, "tallyd_gpu_requests_total{device=\"0\"}"), on0 + 1);
    munmap((void *)far_seen, REGION_BYTES);
    munmap((void *)seen, REGION_BYTES);
    close(in_fd);
    close(out_fd);
    close(far_fd);
    finish_clients(ctx, sock, side);
    free(data);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
}

/* The CPU backend refuses a reference that names a device handle (bit 63) with the reason, as it
 * refuses registering one. */
static void test_cpu_backend_refuses_device_handles(void **state)
{
    (void)state;
    th_daemon_t d;
    uint8_t uuid[TALLY_GPU_UUID_SIZE];
    int side = start_side(&d, NULL, 0, uuid);
    int fd = filled_memfd(REGION_BYTES, NULL, 0);
    th_answer_t ans;
    assert_int_equal(th_side_call(side, TALLY_SHM_OP_REGISTER, "producer", 0, fd, &ans), TALLY_OK);
    close(fd);
    void *ctx = zmq_ctx_new();
    void *sock = dealer(ctx, d.endpoint, "producer");
    th_reply_t r;
    const uint64_t device_handle = TALLY_SHM_DEVICE_HANDLE_BIT | 0x1234;
    assert_int_equal(ref_out_call(sock, TALLY_OP_SCAN, NULL, ans.a.handle, 4096, device_handle,
                                  0, &r),
                     TALLY_E_BAD_REF);
    assert_non_null(strstr((const char *)r.payload, "a GPU is needed for device regions"));
    th_reply_free(&r);
    assert_int_equal(ref_call(sock, TALLY_OP_HIST, NULL, device_handle, 0, 4096, 0, &r),
                     TALLY_E_BAD_REF);
    assert_non_null(strstr((const char *)r.payload, "a GPU is needed for device regions"));
    th_reply_free(&r);
    finish_clients(ctx, sock, side);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
}

/* A request by device reference runs on the GPU that holds the region, even where the
 * scheduler would otherwise pick the least loaded one (GPU 0 when both are idle). */
static void test_runs_on_its_gpu(void **state)
{
    (void)state;
    enum { N = 1024, COUNT = 6 };
    th_daemon_t d;
    uint8_t uuid[TALLY_GPU_UUID_SIZE];
    int side = start_side(&d, sim2, 1, uuid);
    th_answer_t ans;
    int fd = filled_memfd(REGION_BYTES, NULL, 0);
    assert_int_equal(dev_register(side, fd, REGION_BYTES, uuid, 0, &ans), TALLY_OK);
    close(fd);
    void *ctx = zmq_ctx_new();
    void *sock = dealer(ctx, d.endpoint, "producer");
    for (int i = 0; i < COUNT; i++) {
        th_reply_t r;
        assert_int_equal(
            ref_call(sock, TALLY_OP_HIST, i % 2 ? "cam" : NULL, ans.a.handle, 0, N * 4, 0, &r),
            TALLY_OK);
        assert_int_equal(r.len, 258 * 8);
        th_reply_free(&r);
    }
    assert_int_equal(th_stat(sock, "tallyd_gpu_requests_total{device=\"1\"}"), COUNT);
    long long on0 = th_stat(sock, "tallyd_gpu_requests_total{device=\"0\"}");
    assert_true(on0 <= 0);
    /* The device-region metrics: the region and its bytes, where its requests ran. */
    assert_int_equal(th_stat(sock, "tallyd_gpu_regions"), 1);
    assert_int_equal(th_stat(sock, "tallyd_gpu_region_bytes"), REGION_BYTES);
    assert_int_equal(
        th_stat(sock, "tallyd_gpu_region_requests_total{device=\"1\",where=\"owner\"}"), COUNT);
    assert_int_equal(
        th_stat(sock, "tallyd_gpu_region_requests_total{device=\"1\",where=\"peer\"}"), 0);
    assert_int_equal(
        th_stat(sock, "tallyd_gpu_region_requests_total{device=\"0\",where=\"owner\"}"), 0);
    th_answer_t rel;
    assert_int_equal(th_side_call(side, TALLY_SHM_OP_RELEASE, NULL, ans.a.handle, -1, &rel),
                     TALLY_OK);
    assert_int_equal(th_stat(sock, "tallyd_gpu_regions"), 0);
    assert_int_equal(th_stat(sock, "tallyd_gpu_region_bytes"), 0);
    finish_clients(ctx, sock, side);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
}

/* Requests by device reference on no stream, many in flight (issue 34): on several shards the
 * front runs them and takes their GPU completions itself (td_path.c, run_on_front and
 * finish_on_front), with and without the loop's polling (--gpu-spin-loop keeps completions on
 * the shards); each is answered once with the histogram a payload gets, and every stage of each
 * is counted in tallyd_gpu_stage_requests_total. */
static void test_pipelined_unnamed(void **state)
{
    (void)state;
    enum { N = 1024, INFLIGHT = 48, ROUNDS = 4 };
    static const char *const stages[] = {"submit", "to_lane", "launch", "device",
                                         "retire", "back",    "apply",  "to_front"};
    for (int loop_spin = 0; loop_spin < 2; loop_spin++) {
        const char *const args[] = {
            "--backend", "cuda", "--test-sim-gpus", "1", loop_spin ? "--gpu-spin-loop" : NULL,
            NULL};
        th_daemon_t d;
        uint8_t uuid[TALLY_GPU_UUID_SIZE];
        int side = start_side(&d, args, 0, uuid);
        int32_t values[N];
        for (int i = 0; i < N; i++)
            values[i] = i % 201 - 100;
        int fd = filled_memfd(REGION_BYTES, values, sizeof values);
        th_answer_t ans;
        assert_int_equal(dev_register(side, fd, REGION_BYTES, uuid, 0, &ans), TALLY_OK);
        close(fd);
        void *ctx = zmq_ctx_new();
        void *sock = dealer(ctx, d.endpoint, "producer");
        th_reply_t want;
        assert_int_equal(ref_call(sock, TALLY_OP_HIST, NULL, ans.a.handle, 0, N * 4, 0, &want),
                         TALLY_OK);
        tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_I32, 0);
        req.flags = TALLY_FLAG_SHM_REF;
        req.lo = -100;
        req.hi = 100;
        tally_shm_ref_t ref = {.in_handle = ans.a.handle, .in_length = N * 4};
        uint8_t bytes[TALLY_SHM_REF_SIZE];
        tally_shm_ref_encode(&ref, bytes);
        bool seen[INFLIGHT * ROUNDS] = {false};
        for (int round = 0; round < ROUNDS; round++) {
            for (int i = 0; i < INFLIGHT; i++) {
                req.request_id = (uint64_t)(round * INFLIGHT + i + 1);
                assert_int_equal(th_send_request(sock, &req, bytes, sizeof bytes), 0);
            }
            for (int i = 0; i < INFLIGHT; i++) {
                th_reply_t r;
                assert_int_equal(th_recv_reply(sock, &r), 0);
                assert_int_equal(r.rep.status, TALLY_OK);
                assert_true(r.rep.request_id >= 1 && r.rep.request_id <= INFLIGHT * ROUNDS);
                assert_false(seen[r.rep.request_id - 1]);
                seen[r.rep.request_id - 1] = true;
                assert_int_equal(r.len, want.len);
                assert_memory_equal(r.payload, want.payload, want.len);
                th_reply_free(&r);
            }
        }
        th_reply_free(&want);
        for (size_t k = 0; k < sizeof stages / sizeof stages[0]; k++) {
            char name[96];
            snprintf(name, sizeof name, "tallyd_gpu_stage_requests_total{stage=\"%s\"}", stages[k]);
            assert_int_equal(th_stat(sock, name), INFLIGHT * ROUNDS + 1);
        }
        finish_clients(ctx, sock, side);
        assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
    }
}

/* Failure is contained (issue 23): a device-referenced request whose GPU fails is answered
 * `internal` (its input is on the GPU: the CPU cannot rerun it), the GPU is marked unusable
 * after TD_GPU_DEAD_AFTER (3) failures in a row, then references to its regions get bad_ref,
 * `info` no longer lists it, new device regions on it are refused, and tallyd serves on (a
 * payload runs on the CPU). Every launch fails here (--test-fault-every 1). */
static void test_gpu_failure_contained(void **state)
{
    (void)state;
    const char *const args[] = {"--backend", "cuda", "--test-sim-gpus", "1", "--test-fault-every",
                                "1",         NULL};
    th_daemon_t d;
    uint8_t uuid[TALLY_GPU_UUID_SIZE];
    int side = start_side(&d, args, 0, uuid);
    th_answer_t ans;
    int fd = filled_memfd(REGION_BYTES, NULL, 0);
    assert_int_equal(dev_register(side, fd, REGION_BYTES, uuid, 0, &ans), TALLY_OK);
    uint64_t h = ans.a.handle;
    void *ctx = zmq_ctx_new();
    void *sock = dealer(ctx, d.endpoint, "producer");
    th_reply_t r;
    for (int i = 0; i < 3; i++) {
        assert_int_equal(ref_call(sock, TALLY_OP_HIST, NULL, h, 0, 4096, 0, &r), TALLY_E_INTERNAL);
        assert_non_null(strstr((const char *)r.payload, "the GPU failed"));
        th_reply_free(&r);
    }
    assert_int_equal(ref_call(sock, TALLY_OP_HIST, NULL, h, 0, 4096, 0, &r), TALLY_E_BAD_REF);
    assert_non_null(strstr((const char *)r.payload, "is unusable"));
    th_reply_free(&r);
    char value[256];
    info_value(sock, "gpu_uuids", value, sizeof value);
    assert_string_equal(value, "");
    assert_int_equal(dev_register(side, fd, REGION_BYTES, uuid, 0, &ans), TALLY_E_BAD_REF);
    assert_non_null(strstr(ans.msg, "a GPU is needed"));
    close(fd);
    expect_payload_served(sock);
    finish_clients(ctx, sock, side);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
}

/* `info` lists simulated GPU gpu among the usable ones within timeout_ms: true, else false. */
static bool gpu_listed(void *sock, unsigned gpu, int timeout_ms)
{
    char want[48], value[256];
    snprintf(want, sizeof want, "GPU-74616c6c-7964-2d73-696d-2d67707500%02x", gpu);
    for (int waited = 0;; waited += 50) {
        info_value(sock, "gpu_uuids", value, sizeof value);
        if (strstr(value, want))
            return true;
        if (waited >= timeout_ms)
            return false;
        th_sleep_ms(50);
    }
}

/* A lost context is contained and recreated (issue 23): the first launch loses GPU 0's context
 * (TALLYD_TEST_FAULT_STICKY=1: it never completes, and the device fails everything after, as a
 * CUDA context after an illegal address does). The device-region request on it is answered
 * `internal`; tallyd serves on (payloads, GPU 1's regions); once GPU 0 is idle its context is
 * recreated: it is listed again, a region registered before the reset is refused ("was reset",
 * register it again), its release still closes its descriptor, and a region registered again
 * runs on GPU 0. With TALLYD_TEST_FAULT_RESET_FAILS=1 the recreation fails: GPU 0 stays out,
 * regions on it are refused, and tallyd serves on with GPU 1 and the CPU. */
static void context_lost_run(bool reset_fails, bool polling)
{
    th_daemon_t d;
    uint8_t uuid0[TALLY_GPU_UUID_SIZE], uuid1[TALLY_GPU_UUID_SIZE];
    setenv("TALLYD_TEST_FAULT_STICKY", "1", 1);
    if (reset_fails)
        setenv("TALLYD_TEST_FAULT_RESET_FAILS", "1", 1);
    /* Polling lanes (--gpu-spin-us, issue 34): no host function per launch; the lost launch is
     * never seen finished and its wake-up never comes, so the watchdog must still find it. */
    static const char *const sim2_polling[] = {
        "--backend", "cuda", "--test-sim-gpus", "2", "--gpu-spin-us", "50", NULL};
    int side = start_side(&d, polling ? sim2_polling : sim2, 0, uuid0);
    unsetenv("TALLYD_TEST_FAULT_STICKY");
    unsetenv("TALLYD_TEST_FAULT_RESET_FAILS");
    th_sim_uuid(1, uuid1);
    void *ctx = zmq_ctx_new();
    void *sock = dealer(ctx, d.endpoint, "producer");
    th_answer_t ans;
    int fd0 = filled_memfd(REGION_BYTES, NULL, 0), fd1 = filled_memfd(REGION_BYTES, NULL, 0);
    assert_int_equal(dev_register(side, fd0, REGION_BYTES, uuid0, 0, &ans), TALLY_OK);
    uint64_t h0 = ans.a.handle;
    assert_int_equal(dev_register(side, fd1, REGION_BYTES, uuid1, 0, &ans), TALLY_OK);
    uint64_t h1 = ans.a.handle;
    th_reply_t r;
    assert_int_equal(ref_call(sock, TALLY_OP_HIST, NULL, h0, 0, 4096, 0, &r), TALLY_E_INTERNAL);
    assert_non_null(strstr((const char *)r.payload, "the GPU failed"));
    th_reply_free(&r);
    expect_payload_served(sock); /* served on: a payload, and the other GPU's region */
    assert_int_equal(ref_call(sock, TALLY_OP_HIST, NULL, h1, 0, 4096, 0, &r), TALLY_OK);
    th_reply_free(&r);
    int base = stable_fds(d.pid);
    if (reset_fails) {
        assert_false(gpu_listed(sock, 0, 1000));
        assert_true(th_daemon_log_contains(&d, "cannot recreate its context"));
        assert_int_equal(dev_register(side, fd0, REGION_BYTES, uuid0, 0, &ans), TALLY_E_BAD_REF);
        assert_non_null(strstr(ans.msg, "no GPU with UUID"));
        assert_int_equal(ref_call(sock, TALLY_OP_HIST, NULL, h0, 0, 4096, 0, &r), TALLY_E_BAD_REF);
        assert_non_null(strstr((const char *)r.payload, "is unusable"));
        th_reply_free(&r);
    } else {
        assert_true(gpu_listed(sock, 0, 10000));
        assert_true(th_daemon_log_contains(&d, "context recreated after a failure"));
        assert_int_equal(ref_call(sock, TALLY_OP_HIST, NULL, h0, 0, 4096, 0, &r), TALLY_E_BAD_REF);
        assert_non_null(strstr((const char *)r.payload, "register the region again"));
        th_reply_free(&r);
        assert_int_equal(th_side_call(side, TALLY_SHM_OP_RELEASE, NULL, h0, -1, &ans), TALLY_OK);
        assert_int_equal(fds_reach(d.pid, base - 1), base - 1); /* its descriptor closed */
        long long on0 = th_stat(sock, "tallyd_gpu_requests_total{device=\"0\"}");
        assert_int_equal(dev_register(side, fd0, REGION_BYTES, uuid0, 0, &ans), TALLY_OK);
        assert_int_equal(ref_call(sock, TALLY_OP_HIST, NULL, ans.a.handle, 0, 4096, 0, &r),
                         TALLY_OK);
        th_reply_free(&r);
        assert_int_equal(th_stat(sock, "tallyd_gpu_requests_total{device=\"0\"}"), on0 + 1);
    }
    close(fd0);
    close(fd1);
    finish_clients(ctx, sock, side);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
}

static void test_context_recreated(void **state)
{
    (void)state;
    context_lost_run(false, false);
}

static void test_context_not_recreated(void **state)
{
    (void)state;
    context_lost_run(true, false);
}

static void test_context_recreated_polling(void **state)
{
    (void)state;
    context_lost_run(false, true);
}

/* A filter or scan by device reference above the GPU's buffers (64 MiB) is refused too_large,
 * without counting as a GPU failure; a hist that long reads in place and is answered. */
static void test_device_buffers_bound(void **state)
{
    (void)state;
    const char *const args[] = {"--backend", "cuda", "--test-sim-gpus", "1", "--max-batch",
                                "134217728", NULL};
    const size_t big = 80u << 20;
    th_daemon_t d;
    uint8_t uuid[TALLY_GPU_UUID_SIZE];
    int side = start_side(&d, args, 0, uuid);
    th_answer_t ans;
    int fd = filled_memfd(big, NULL, 0);
    assert_int_equal(dev_register(side, fd, big, uuid, 0, &ans), TALLY_OK);
    close(fd);
    void *ctx = zmq_ctx_new();
    void *sock = dealer(ctx, d.endpoint, "producer");
    th_reply_t r;
    for (int i = 0; i < 4; i++) { /* more than TD_GPU_DEAD_AFTER: the GPU stays usable */
        assert_int_equal(ref_call(sock, TALLY_OP_FILTER, NULL, ans.a.handle, 0, big, 0, &r),
                         TALLY_E_TOO_LARGE);
        assert_non_null(strstr((const char *)r.payload, "limited to 67108864 bytes"));
        th_reply_free(&r);
    }
    assert_int_equal(ref_call(sock, TALLY_OP_HIST, "big", ans.a.handle, 0, big, 0, &r), TALLY_OK);
    uint64_t under; /* the region is zeros: all of it in the bin of 0, none below -100 */
    memcpy(&under, r.payload + 256 * 8, 8);
    assert_int_equal(under, 0);
    th_reply_free(&r);
    char value[256];
    info_value(sock, "gpu_uuids", value, sizeof value);
    assert_string_equal(value, "GPU-74616c6c-7964-2d73-696d-2d6770750000");
    finish_clients(ctx, sock, side);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
}

/* libtally: tally_gpu_register_fd registers a descriptor as a device region (a sealed memfd on
 * simulated GPUs), tally_call_shm answers from it, tally_region_destroy releases it (tallyd
 * closes its copy of the descriptor), the descriptor stays the caller's, and refusals come back
 * with tallyd's reason. tally_gpu_alloc without a CUDA driver says so. */
static void test_libtally_gpu_register(void **state)
{
    (void)state;
    enum { N = 8192 };
    uint8_t data[N];
    for (int i = 0; i < N; i++)
        data[i] = (uint8_t)(i * 7);
    th_daemon_t d;
    uint8_t uuid[TALLY_GPU_UUID_SIZE];
    int side = start_side(&d, sim2, 1, uuid);
    close(side); /* libtally opens its own */
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(d.endpoint, 10000, &c), TALLY_OK);
    int fd = filled_memfd(N, data, N);
    tally_region_t *region = NULL;
    uint8_t other[TALLY_GPU_UUID_SIZE];
    th_sim_uuid(5, other);
    assert_int_equal(tally_gpu_register_fd(c, fd, N, other, 0, NULL, NULL, &region),
                     TALLY_E_BAD_REF);
    assert_non_null(strstr(tally_client_error(c), "no GPU with UUID"));
    int base = stable_fds(d.pid);
    assert_int_equal(tally_gpu_register_fd(c, fd, N, uuid, 0, NULL, NULL, &region), TALLY_OK);
    assert_int_equal(fds_reach(d.pid, base + 1), base + 1);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    tally_reply_t reply;
    tally_reply_init(&reply);
    assert_int_equal(tally_call_shm(c, &req, region, 0, N, NULL, 0, &reply), TALLY_OK);
    uint64_t bin7;
    memcpy(&bin7, (const uint8_t *)reply.payload + 7 * 8, 8);
    assert_int_equal(bin7, tr_filter(TALLY_DTYPE_U8, data, N, TALLY_PRED_EQ, 7, 0, NULL));
    tally_reply_clear(&reply);
    tally_region_destroy(&region);
    assert_int_equal(fds_reach(d.pid, base), base);
    assert_true(fcntl(fd, F_GETFD) >= 0); /* still the caller's */
    close(fd);
    tally_gpu_mem_t *mem = NULL;
    if (access("/dev/nvidiactl", F_OK) != 0) { /* no driver here: a clear refusal */
        assert_int_equal(tally_gpu_alloc(0, 1 << 20, &mem), TALLY_E_ARG);
        assert_non_null(strstr(tally_gpu_error(), "CUDA"));
        assert_null(mem);
    }
    tally_client_destroy(&c);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
}

/* A region released (its connection closed) while requests use it stays until they are
 * answered: their replies are right, and only then is the descriptor closed. */
static void test_deferred_release(void **state)
{
    (void)state;
    enum { N = 4096, INFLIGHT = 4 };
    int32_t data[N];
    for (int i = 0; i < N; i++)
        data[i] = i % 50;
    th_daemon_t d;
    setenv("TALLYD_TEST_SIM_LATENCY_US", "1000000", 1);
    uint8_t uuid[TALLY_GPU_UUID_SIZE];
    int side = start_side(&d, sim2, 0, uuid);
    unsetenv("TALLYD_TEST_SIM_LATENCY_US");
    th_answer_t ans;
    int fd = filled_memfd(REGION_BYTES, data, sizeof data);
    void *ctx = zmq_ctx_new();
    void *sock = dealer(ctx, d.endpoint, "producer");
    char value[256];
    info_value(sock, "gpu_uuids", value, sizeof value); /* the DEALER's connection is up */
    int base = stable_fds(d.pid); /* the side and the DEALER connections are in it */
    assert_int_equal(dev_register(side, fd, REGION_BYTES, uuid, 0, &ans), TALLY_OK);
    close(fd);
    assert_int_equal(fds_reach(d.pid, base + 1), base + 1);
    for (int i = 0; i < INFLIGHT; i++) {
        tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_I32, 1000 + (uint64_t)i);
        req.flags = TALLY_FLAG_SHM_REF;
        req.lo = 0;
        req.hi = 256;
        tally_shm_ref_t ref = {.in_handle = ans.a.handle, .in_length = sizeof data};
        uint8_t bytes[TALLY_SHM_REF_SIZE];
        tally_shm_ref_encode(&ref, bytes);
        assert_int_equal(th_send_request(sock, &req, bytes, sizeof bytes), 0);
    }
    /* An `info` behind them on the same socket: its reply (immediate, while the hists take a
     * second each) says that tallyd has read and resolved them. Then the producer goes. */
    tally_req_t info = th_req(TALLY_OP_INFO, TALLY_DTYPE_NONE, 999);
    assert_int_equal(th_send_request(sock, &info, NULL, 0), 0);
    th_reply_t ir;
    assert_int_equal(th_recv_reply(sock, &ir), 0);
    assert_int_equal(ir.rep.request_id, 999);
    th_reply_free(&ir);
    close(side);
    assert_int_equal(fds_reach(d.pid, base), base); /* the side socket gone, the region's kept */
    uint64_t want7 = tr_filter(TALLY_DTYPE_I32, data, N, TALLY_PRED_EQ, 7, 0, NULL);
    for (int i = 0; i < INFLIGHT; i++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(sock, &r), 0);
        assert_int_equal(r.rep.status, TALLY_OK);
        assert_int_equal(r.len, 258 * 8); /* i32: 256 bins, under- and overflow */
        uint64_t bin7;
        memcpy(&bin7, r.payload + 7 * 8, 8);
        assert_int_equal(bin7, want7);
        th_reply_free(&r);
    }
    assert_int_equal(fds_reach(d.pid, base - 1), base - 1);
    zmq_close(sock);
    zmq_ctx_term(ctx);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu_backend_refuses),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_quotas),
        cmocka_unit_test(test_descriptor_held_until_release),
        cmocka_unit_test(test_requests_in_place),
        cmocka_unit_test(test_import_off_loop),
        cmocka_unit_test(test_stop_mid_import),
        cmocka_unit_test(test_cli_gpu_region),
        cmocka_unit_test(test_device_output),
        cmocka_unit_test(test_cpu_backend_refuses_device_handles),
        cmocka_unit_test(test_runs_on_its_gpu),
        cmocka_unit_test(test_gpu_failure_contained),
        cmocka_unit_test(test_context_recreated),
        cmocka_unit_test(test_context_not_recreated),
        cmocka_unit_test(test_context_recreated_polling),
        cmocka_unit_test(test_device_buffers_bound),
        cmocka_unit_test(test_libtally_gpu_register),
        cmocka_unit_test(test_deferred_release),
        cmocka_unit_test(test_pipelined_unnamed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
