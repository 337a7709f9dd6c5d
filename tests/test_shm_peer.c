/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_shm_peer.c — requests by device reference on a GPU other than the region's own, over
 * peer access (PROTOCOL.md §10 "Device memory", "Which GPU runs it"; issue 23), against
 * simulated GPUs: TALLYD_TEST_SIM_PEERS=N makes simulated GPUs 0..N-1 reach each other's memory,
 * and a simulated launch on a GPU where the region is not mapped fails (as a kernel reading
 * memory its GPU has no access to faults), so work placed where it cannot run shows. Asserted by
 * counts (tallyd_gpu_requests_total, tallyd_gpu_region_requests_total{where}): which GPU ran what.
 *   - with --test-gpu-peer-always every reference runs on a peer where there is one, with the
 *     results a payload gets (a scan's carry chained on the peer's lane, a device output region
 *     written from the peer); a region on a GPU no other reaches runs on its own;
 *   - the rule (--gpu-peer-queue N): a burst on one region (each launch held 1 s) goes to the
 *     peer only once N requests are placed on the owner, and only onto an idle lane; 0: never;
 *   - a peer whose context was recreated since the region's import is no longer one of its
 *     peers (its event and access went with the old context): the region runs on its own GPU;
 *   - never on a peer while the region's own GPU is unusable (the mapping is the owner's).
 * The real peer path (two GPUs) is test_gpu_region's test_peer (scripts/gpu-check.sh STEPS=peer).
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
#include "shm_side.h"
#include "tally.h"

#define SEALS (F_SEAL_SHRINK | F_SEAL_GROW)
#define REGION_BYTES (1u << 20)

/* Registers a sealed memfd of REGION_BYTES holding data (len bytes) on simulated GPU gpu with
 * flags; returns the handle (asserting `ok`), the memfd in *fd_out (or closed when NULL). */
static uint64_t dev_region(int side, unsigned gpu, uint32_t flags, const void *data, size_t len,
                           int *fd_out)
{
    int fd = th_memfd(REGION_BYTES, SEALS);
    if (data)
        assert_int_equal(pwrite(fd, data, len, 0), (ssize_t)len);
    tally_shm_msg_t m = {.op = TALLY_SHM_OP_REGISTER_DEVICE,
                         .id_len = 8,
                         .dev_size = REGION_BYTES,
                         .dev_flags = flags};
    memcpy(m.id, "producer", 8);
    th_sim_uuid(gpu, m.gpu_uuid);
    uint8_t buf[TALLY_SHM_MSG_MAX];
    size_t mlen = tally_shm_msg_encode(&m, buf);
    th_answer_t ans;
    assert_int_equal(th_side_send_raw(side, buf, mlen, &fd, 1), 0);
    assert_int_equal(th_side_recv(side, &ans, 5000), 1);
    assert_int_equal(ans.a.status, TALLY_OK);
    if (fd_out)
        *fd_out = fd;
    else
        close(fd);
    return ans.a.handle;
}

/* The request of op (i32; a hist over [-100, 100), a scan, a stable filter > 0) by reference
 * to [0, len) of `in`, its output into `out` at 0 when out is not 0, on stream (may be NULL). */
static tally_req_t ref_req(uint8_t op, const char *stream, uint64_t id, uint64_t in, size_t len,
                           uint64_t out, uint8_t *bytes)
{
    tally_req_t req = th_req(op, TALLY_DTYPE_I32, id);
    req.flags = TALLY_FLAG_SHM_REF | (op == TALLY_OP_FILTER ? TALLY_FLAG_FILTER_STABLE : 0);
    req.pred = op == TALLY_OP_FILTER ? TALLY_PRED_GT : 0;
    req.lo = op == TALLY_OP_HIST ? -100 : 0;
    req.hi = op == TALLY_OP_HIST ? 100 : 0;
    if (stream) {
        req.stream_len = (uint8_t)strlen(stream);
        memcpy(req.stream, stream, req.stream_len);
    }
    tally_shm_ref_t ref = {.in_handle = in, .in_length = len};
    if (out) {
        ref.out_handle = out;
        ref.out_length = 2 * len;
    }
    tally_shm_ref_encode(&ref, bytes);
    return req;
}

static uint32_t ref_call(void *sock, uint8_t op, const char *stream, uint64_t in, size_t len,
                         uint64_t out, th_reply_t *r)
{
    static uint64_t id = 100;
    uint8_t bytes[TALLY_SHM_REF_SIZE];
    tally_req_t req = ref_req(op, stream, ++id, in, len, out, bytes);
    assert_int_equal(th_call(sock, &req, bytes, sizeof bytes, r), 0);
    assert_int_equal(r->rep.request_id, id);
    return r->rep.status;
}

/* The same operation on the same data sent as a payload (stream "p"): the expected reply. */
static void payload_call(void *sock, uint8_t op, const int32_t *data, size_t n, th_reply_t *r)
{
    uint8_t unused[TALLY_SHM_REF_SIZE];
    tally_req_t req = ref_req(op, "p", 7, 0, 0, 0, unused);
    req.flags &= (uint8_t)~TALLY_FLAG_SHM_REF;
    assert_int_equal(th_call(sock, &req, data, n * 4, r), 0);
    assert_int_equal(r->rep.status, TALLY_OK);
}

static long long region_requests(void *sock, unsigned gpu, const char *where)
{
    char name[128];
    snprintf(name, sizeof name, "tallyd_gpu_region_requests_total{device=\"%u\",where=\"%s\"}",
             gpu, where);
    long long v = th_stat(sock, name);
    return v < 0 ? 0 : v;
}

static long long gpu_requests(void *sock, unsigned gpu)
{
    char name[64];
    snprintf(name, sizeof name, "tallyd_gpu_requests_total{device=\"%u\"}", gpu);
    long long v = th_stat(sock, name);
    return v < 0 ? 0 : v;
}

typedef struct {
    th_daemon_t d;
    int side;
    void *ctx;
    void *sock;
} rig_t;

/* tallyd on simulated GPUs (args), GPUs 0..peers-1 reaching each other, latency_us per launch. */
static void rig_start(rig_t *g, const char *const *args, const char *peers, const char *latency)
{
    if (peers)
        setenv("TALLYD_TEST_SIM_PEERS", peers, 1);
    if (latency)
        setenv("TALLYD_TEST_SIM_LATENCY_US", latency, 1);
    assert_int_equal(th_daemon_start(&g->d, args), 0);
    unsetenv("TALLYD_TEST_SIM_PEERS");
    unsetenv("TALLYD_TEST_SIM_LATENCY_US");
    g->side = th_side_connect(g->d.shm_socket);
    assert_true(g->side >= 0);
    g->ctx = zmq_ctx_new();
    g->sock = th_dealer_id(g->ctx, g->d.endpoint, "producer", 20000);
    assert_non_null(g->sock);
}

static void rig_stop(rig_t *g)
{
    zmq_close(g->sock);
    zmq_ctx_term(g->ctx);
    close(g->side);
    assert_int_equal(th_daemon_stop(&g->d, SIGTERM, 20000), 0);
}

/* Every reference runs on a peer where one reaches the region (--test-gpu-peer-always; GPUs 0
 * and 1 reach each other, GPU 2 reaches none): hists, a scan chained on a stream across two
 * rounds and a stable filter into a device output region of GPU 0, all run on GPU 1 with the
 * results of payloads; a region on GPU 2 runs on GPU 2. */
static void test_peer_always(void **state)
{
    (void)state;
    enum { N = 30000 };
    const char *const args[] = {"--backend", "cuda", "--test-sim-gpus", "3",
                                "--test-gpu-peer-always", NULL};
    rig_t g;
    rig_start(&g, args, "2", NULL);
    int32_t *data = th_random_i32(N, -120, 120);
    int out_fd = -1;
    uint64_t in = dev_region(g.side, 0, 0, data, N * 4, NULL);
    uint64_t out = dev_region(g.side, 0, TALLY_SHM_DEV_OUTPUT, NULL, 0, &out_fd);
    uint64_t lone = dev_region(g.side, 2, 0, data, N * 4, NULL);
    const uint8_t *seen = mmap(NULL, REGION_BYTES, PROT_READ, MAP_SHARED, out_fd, 0);
    assert_true(seen != MAP_FAILED);
    static const uint8_t ops[] = {TALLY_OP_HIST, TALLY_OP_SCAN, TALLY_OP_FILTER};
    for (int round = 0; round < 2; round++) /* the scan's carry runs on across both */
        for (size_t i = 0; i < sizeof ops; i++) {
            th_reply_t by_ref, by_payload;
            uint64_t o = ops[i] == TALLY_OP_HIST ? 0 : out;
            assert_int_equal(ref_call(g.sock, ops[i], "o", in, N * 4, o, &by_ref), TALLY_OK);
            payload_call(g.sock, ops[i], data, N, &by_payload);
            assert_int_equal(by_ref.rep.count, by_payload.rep.count);
            assert_int_equal(by_ref.rep.aux0, by_payload.rep.aux0);
            if (o) /* written by GPU 1 into GPU 0's region */
                assert_memory_equal(seen, by_payload.payload, by_payload.len);
            else
                assert_memory_equal(by_ref.payload, by_payload.payload, by_payload.len);
            th_reply_free(&by_ref);
            th_reply_free(&by_payload);
        }
    th_reply_t r;
    assert_int_equal(ref_call(g.sock, TALLY_OP_HIST, NULL, lone, N * 4, 0, &r), TALLY_OK);
    th_reply_free(&r);
    assert_int_equal(region_requests(g.sock, 1, "peer"), 6);
    assert_int_equal(region_requests(g.sock, 0, "owner"), 0);
    assert_int_equal(region_requests(g.sock, 2, "owner"), 1);
    assert_int_equal(region_requests(g.sock, 2, "peer"), 0);
    /* GPU 1 ran the 6 references and no payload (GPU 0 was the least loaded for those). */
    assert_int_equal(gpu_requests(g.sock, 1), 6);
    munmap((void *)seen, REGION_BYTES);
    close(out_fd);
    free(data);
    rig_stop(&g);
}

/* A burst of 8 hists on one region of GPU 0 (one lane per GPU, each launch held 1 s, so all
 * 8 are placed before the first completes): with --gpu-peer-queue 2 the first two go to GPU 0,
 * the third (2 placed on GPU 0) to GPU 1's idle lane, the rest to GPU 0 (GPU 1's one lane is
 * busy); with 0, all 8 run on GPU 0. Returns the requests that ran on the peer. */
static long long burst(const char *queue)
{
    enum { N = 1024, COUNT = 8 };
    const char *const args[] = {"--backend",     "cuda", "--test-sim-gpus", "2", "--gpu-streams",
                                "1",             "--gpu-peer-queue", queue, NULL};
    rig_t g;
    rig_start(&g, args, "2", "1000000");
    int32_t *data = th_random_i32(N, -120, 120);
    uint64_t in = dev_region(g.side, 0, 0, data, N * 4, NULL);
    uint8_t bytes[TALLY_SHM_REF_SIZE];
    for (uint64_t id = 1; id <= COUNT; id++) {
        tally_req_t req = ref_req(TALLY_OP_HIST, NULL, id, in, N * 4, 0, bytes);
        assert_int_equal(th_send_request(g.sock, &req, bytes, sizeof bytes), 0);
    }
    for (int i = 0; i < COUNT; i++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(g.sock, &r), 0);
        assert_int_equal(r.rep.status, TALLY_OK);
        th_reply_free(&r);
    }
    long long peer = region_requests(g.sock, 1, "peer");
    assert_int_equal(region_requests(g.sock, 0, "owner") + peer, COUNT);
    assert_int_equal(gpu_requests(g.sock, 1), peer);
    free(data);
    rig_stop(&g);
    return peer;
}

static void test_peer_queue_rule(void **state)
{
    (void)state;
    assert_int_equal(burst("2"), 1);
    assert_int_equal(burst("0"), 0);
}

/* `info` lists simulated GPU gpu among the usable ones within timeout_ms. */
static bool gpu_listed(void *sock, unsigned gpu, int timeout_ms)
{
    char want[48];
    snprintf(want, sizeof want, "GPU-74616c6c-7964-2d73-696d-2d67707500%02x", gpu);
    for (int waited = 0;; waited += 50) {
        th_reply_t r;
        tally_req_t req = th_req(TALLY_OP_INFO, TALLY_DTYPE_NONE, 1);
        assert_int_equal(th_call(sock, &req, NULL, 0, &r), 0);
        bool listed = r.payload && strstr((const char *)r.payload, want);
        th_reply_free(&r);
        if (listed)
            return true;
        if (waited >= timeout_ms)
            return false;
        th_sleep_ms(50);
    }
}

/* tallyd on two simulated GPUs that reach each other, --test-gpu-peer-always, whose first launch
 * loses its GPU's context (TALLYD_TEST_FAULT_STICKY=1); a region of GPU 0 holding *data
 * (STICKY_N int32 values): its handle. */
enum { STICKY_N = 4096 };
static uint64_t sticky_rig(rig_t *g, int32_t **data)
{
    const char *const args[] = {"--backend", "cuda", "--test-sim-gpus", "2",
                                "--test-gpu-peer-always", NULL};
    setenv("TALLYD_TEST_FAULT_STICKY", "1", 1);
    rig_start(g, args, "2", NULL);
    unsetenv("TALLYD_TEST_FAULT_STICKY");
    *data = th_random_i32(STICKY_N, -120, 120);
    return dev_region(g->side, 0, 0, *data, STICKY_N * 4, NULL);
}

/* A peer whose context was recreated since the import is not one of the region's peers any more
 * (the event opened there and its access went with its old context): the first launch, on GPU 1
 * (--test-gpu-peer-always), loses GPU 1's context (TALLYD_TEST_FAULT_STICKY=1) and is answered
 * `internal`; once GPU 1 serves again, the region's requests run on GPU 0, its own. */
static void test_peer_reset_leaves_region(void **state)
{
    (void)state;
    enum { N = STICKY_N };
    rig_t g;
    int32_t *data;
    uint64_t in = sticky_rig(&g, &data);
    th_reply_t r;
    assert_int_equal(ref_call(g.sock, TALLY_OP_HIST, NULL, in, N * 4, 0, &r), TALLY_E_INTERNAL);
    assert_non_null(strstr((const char *)r.payload, "the GPU failed"));
    th_reply_free(&r);
    assert_true(gpu_listed(g.sock, 1, 10000));
    long long peer = region_requests(g.sock, 1, "peer");
    for (int i = 0; i < 3; i++) {
        assert_int_equal(ref_call(g.sock, TALLY_OP_HIST, NULL, in, N * 4, 0, &r), TALLY_OK);
        th_reply_free(&r);
    }
    assert_int_equal(region_requests(g.sock, 0, "owner"), 3);
    assert_int_equal(region_requests(g.sock, 1, "peer"), peer);
    free(data);
    rig_stop(&g);
}

/* Never on a peer while the region's own GPU is unusable (the mapping is the owner's): a payload
 * hist starts stream "s" on GPU 0 and loses GPU 0's context (TALLYD_TEST_FAULT_STICKY=1; the
 * watchdog finds it within 200 ms and the CPU reruns it); a hist by reference on GPU 0's region,
 * sent right behind it on "s", waits for it (a stream's first hist is applied before the next),
 * then finds GPU 0 unusable: it is refused (`internal`, or `bad_ref` when it was read after GPU 0
 * was marked unusable), never run on GPU 1, although --test-gpu-peer-always would send it there. */
static void test_peer_not_for_unusable_owner(void **state)
{
    (void)state;
    enum { N = STICKY_N };
    rig_t g;
    int32_t *data;
    uint64_t in = sticky_rig(&g, &data);
    uint8_t bytes[TALLY_SHM_REF_SIZE];
    tally_req_t first = ref_req(TALLY_OP_HIST, "s", 1, 0, 0, 0, bytes);
    first.flags &= (uint8_t)~TALLY_FLAG_SHM_REF;
    assert_int_equal(th_send_request(g.sock, &first, data, N * 4), 0);
    tally_req_t by_ref = ref_req(TALLY_OP_HIST, "s", 2, in, N * 4, 0, bytes);
    assert_int_equal(th_send_request(g.sock, &by_ref, bytes, sizeof bytes), 0);
    th_reply_t r;
    assert_int_equal(th_recv_reply(g.sock, &r), 0);
    assert_int_equal(r.rep.request_id, 1);
    assert_int_equal(r.rep.status, TALLY_OK); /* rerun on the CPU */
    th_reply_free(&r);
    assert_int_equal(th_recv_reply(g.sock, &r), 0);
    assert_int_equal(r.rep.request_id, 2);
    assert_true(r.rep.status == TALLY_E_INTERNAL || r.rep.status == TALLY_E_BAD_REF);
    th_reply_free(&r);
    assert_int_equal(region_requests(g.sock, 1, "peer"), 0);
    assert_int_equal(gpu_requests(g.sock, 1), 0);
    free(data);
    rig_stop(&g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_peer_always),
        cmocka_unit_test(test_peer_queue_rule),
        cmocka_unit_test(test_peer_reset_leaves_region),
        cmocka_unit_test(test_peer_not_for_unusable_owner),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
