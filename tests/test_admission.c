/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_admission.c — the in-flight share at its exact bound (daemon/core/td_admit.c), against a
 * real tallyd whose simulated GPU takes 2 s per launch, so that what is admitted stays in flight
 * while the rest arrives: a connection with max_inflight_per_peer 3 that pipelines 10 batches gets
 * exactly 3 answered ok and 7 `busy` (test_limits.c shows that `busy` comes at all; this, that it
 * comes at the bound and not one later), and once those 3 are answered the next 3 are let in.
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

#define SHARE 3
#define SENT 10

/* SENT hists of 64 KiB pipelined on sock (ids from first): how many were answered ok. */
static int pipelined_ok(void *sock, uint64_t first)
{
    static uint8_t bytes[64 << 10];
    for (int i = 0; i < SENT; i++) {
        tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, first + (uint64_t)i);
        assert_int_equal(th_send_request(sock, &req, bytes, sizeof bytes), 0);
    }
    int ok = 0;
    for (int i = 0; i < SENT; i++) {
        th_reply_t r;
        assert_int_equal(th_recv_reply(sock, &r), 0);
        if (r.rep.status == TALLY_OK)
            ok++;
        else
            assert_int_equal(r.rep.status, TALLY_E_BUSY);
        th_reply_free(&r);
    }
    return ok;
}

static void test_share_is_exact(void **state)
{
    (void)state;
    setenv("TALLYD_TEST_SIM_LATENCY_US", "2000000", 1);
    const char *args[] = {"--backend",
                          "cuda",
                          "--test-sim-gpus",
                          "1",
                          "--gpu-min-batch",
                          "1",
                          "--gpu-streams",
                          "4",
                          "--max-inflight-per-peer",
                          "3",
                          NULL};
    th_daemon_t d;
    int started = th_daemon_start(&d, args);
    unsetenv("TALLYD_TEST_SIM_LATENCY_US");
    assert_int_equal(started, 0);
    void *sock = th_connect(d.endpoint, 30000);
    assert_int_equal(pipelined_ok(sock, 1), SHARE);
    assert_int_equal(pipelined_ok(sock, 100), SHARE); /* the slots came back with the replies */
    assert_int_equal(th_stat(sock, "tallyd_limited_total{reason=\"inflight_share\"}"),
                     2 * (SENT - SHARE));
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_share_is_exact),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
