/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_gpu_spin.c — the GPU lanes' spin-polling (--gpu-spin-us, daemon/core/td_gpu.c:
 * spin_for_event), over simulated GPUs whose every launch takes a set time
 * (TALLYD_TEST_SIM_LATENCY_US), against a real tallyd:
 *   - a spin longer than a launch: the lane sees each completion while it polls;
 *   - a spin shorter than a launch: it gives up and sleeps, and the completion wakes it;
 *   - launches seen finished only some time after they returned (TALLYD_TEST_SIM_FINISH_US, as
 *     a GPU's work is), a short spin, two launches on the lane: it naps and asks again
 *     (nap_for_head), for 3 ms, and for 300 ms, past its 200 ms of naps, after which it sleeps
 *     until woken and spins again;
 * either way 24 pipelined histograms on one stream all run on the GPU (tallyd_gpu_requests_total),
 * each reply is the batch's histogram, they come back in send order, and the stream holds the
 * sum of all. No timing is asserted.
 */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "harness.h"
#include "reference.h"

#define BATCHES 24
#define BATCH (256u << 10) /* over the GPU threshold of hist (64 KiB) */

/* tallyd on one simulated GPU (2 lanes) with launches of latency_us, seen finished finish_us
 * after they return, and spin_us of polling. */
static void spin_run_finish(const char *latency_us, const char *finish_us, const char *spin_us)
{
    setenv("TALLYD_TEST_SIM_LATENCY_US", latency_us, 1);
    setenv("TALLYD_TEST_SIM_FINISH_US", finish_us, 1);
    const char *args[] = {"--backend", "cuda",          "--test-sim-gpus", "1", "--gpu-streams",
                          "2",         "--gpu-spin-us", spin_us,           NULL};
    th_daemon_t d;
    int started = th_daemon_start(&d, args);
    unsetenv("TALLYD_TEST_SIM_LATENCY_US");
    unsetenv("TALLYD_TEST_SIM_FINISH_US");
    assert_int_equal(started, 0);
    void *sock = th_connect(d.endpoint, 30000);
    static uint8_t batch[BATCHES][BATCH];
    uint64_t total[256] = {0};
    for (int i = 0; i < BATCHES; i++) {
        for (size_t j = 0; j < BATCH; j++)
            batch[i][j] = (uint8_t)(th_rand() >> 24);
        tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 1 + (uint64_t)i);
        assert_int_equal(tally_req_set_stream(&req, "spin"), TALLY_OK);
        assert_int_equal(th_send_request(sock, &req, batch[i], BATCH), 0);
    }
    for (int i = 0; i < BATCHES; i++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(sock, &r), 0);
        assert_int_equal(r.rep.request_id, 1 + (uint64_t)i); /* one stream: in send order */
        assert_int_equal(r.rep.status, TALLY_OK);
        uint64_t want[256] = {0};
        tr_hist(TALLY_DTYPE_U8, batch[i], BATCH, 0, 0, want);
        assert_true(th_u64s_equal(r.payload, r.len, want, 256));
        for (int b = 0; b < 256; b++)
            total[b] += want[b];
        th_reply_free(&r);
    }
    assert_int_equal(th_stat(sock, "tallyd_gpu_requests_total{device=\"0\"}"), BATCHES);
    tally_req_t q = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, 100);
    assert_int_equal(tally_req_set_stream(&q, "spin"), TALLY_OK);
    th_reply_t r;
    assert_int_equal(th_call_reply_status(sock, &q, NULL, 0, &r), TALLY_OK);
    tally_stream_info_t info;
    assert_int_equal(tally_stream_info_decode(r.payload, r.len, &info), TALLY_OK);
    assert_int_equal(info.batches, BATCHES);
    assert_int_equal(info.hist_total, (uint64_t)BATCHES * BATCH);
    for (int b = 0; b < 256; b++)
        assert_int_equal(info.bins[b], total[b]);
    th_reply_free(&r);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

static void spin_run(const char *latency_us, const char *spin_us)
{
    spin_run_finish(latency_us, "0", spin_us);
}

/* Launches of 1 ms, polling up to 8 ms: each completion is seen while polling. */
static void test_spin_sees_completions(void **state)
{
    (void)state;
    spin_run("1000", "8000");
}

/* Launches of 30 ms, polling 200 us: the lane gives up polling and sleeps until woken. */
static void test_spin_gives_up_and_sleeps(void **state)
{
    (void)state;
    spin_run("30000", "200");
}

/* Launches seen finished 3 ms after they return, polling 200 us: the lane naps between its
 * questions while its two slots are on the device. */
static void test_spin_naps(void **state)
{
    (void)state;
    spin_run_finish("0", "3000", "200");
}

/* Launches seen finished 300 ms after they return: past 200 ms of naps the lane sleeps until
 * woken (the simulated wake-up comes at once) and spins and naps again until it sees each one. */
static void test_spin_naps_past_watchdog(void **state)
{
    (void)state;
    spin_run_finish("0", "300000", "200");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_spin_sees_completions),
        cmocka_unit_test(test_spin_gives_up_and_sleeps),
        cmocka_unit_test(test_spin_naps),
        cmocka_unit_test(test_spin_naps_past_watchdog),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
