/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_reply_bounds.c — the two rules of the reply bounds (daemon/core/td_reply.h) that the
 * never-reading peer of test_hostile.c does not reach, over the wire against a real tallyd:
 *   - a connection with nothing outstanding always gets one request through, whatever the size
 *     of its reply: a scan whose reply is 32 times max_reply_bytes_per_peer is answered ok, in
 *     full, from a fresh connection (issue 37's first survivor: without the rule it is `busy`);
 *   - the bound of all connections together: while a peer that does not read holds reply bytes,
 *     another connection with nothing of its own outstanding is answered `busy` (counted as
 *     tallyd_limited_total{reason="reply_bytes"}, with max_reply_bytes in the message) for a scan
 *     whose reply would pass max_reply_bytes, and is served a histogram (no reply bytes to
 *     reserve) meanwhile; once the peer reads, the same scan is answered ok (the second
 *     survivor: without the check nothing is refused).
 * No timing is asserted: waits are bounded loops on what tallyd reports.
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

#define MIB (1u << 20)

static th_daemon_t daemon_;

static int stop_daemon(void **state)
{
    (void)state;
    th_daemon_kill(&daemon_);
    return 0;
}

/* A scan of `bytes` of int32 (its reply: twice that, int64 sums) from sock: the reply. */
static int scan_call(void *sock, size_t bytes, uint64_t id, th_reply_t *r)
{
    int32_t *in = th_random_i32(bytes / 4, -100, 100);
    tally_req_t req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, id);
    int st = th_call_reply_status(sock, &req, in, bytes, r);
    free(in);
    return st;
}

/* One large reply from a fresh connection, over the per-connection bound: ok, whole. */
static void test_fresh_connection_gets_one_large_reply(void **state)
{
    (void)state;
    const char *args[] = {"--max-reply-bytes-per-peer", "64K", "--max-reply-bytes", "64M", NULL};
    assert_int_equal(th_daemon_start(&daemon_, args), 0);
    void *sock = th_connect(daemon_.endpoint, 30000);
    th_reply_t r;
    assert_int_equal(scan_call(sock, MIB, 1, &r), TALLY_OK);
    assert_int_equal(r.len, 2 * MIB);
    th_reply_free(&r);
    /* Read at once: nothing outstanding again, so the next one is let through too. */
    assert_int_equal(scan_call(sock, MIB, 2, &r), TALLY_OK);
    th_reply_free(&r);
    assert_int_equal(th_stat(sock, "tallyd_limited_total{reason=\"reply_bytes_peer\"}"), 0);
    assert_int_equal(th_close_and_stop(sock, &daemon_, 10000), 0);
    daemon_.pid = 0;
}

#define HOLDER_SCANS 24

/* A peer that does not read (receive high-water mark 1, a small kernel buffer) pipelines 24
 * scans with 2 MiB replies against a total bound of 16 MiB (per peer: 64 MiB, out of the way):
 * the bytes its unread replies hold stay above zero until it reads. Another connection then
 * asks for a scan with a 16 MiB reply: total + 16 MiB passes the bound, so `busy`. */
static void test_total_bound_refuses_another_connection(void **state)
{
    (void)state;
    const char *args[] = {
        "--max-batch", "8M", "--max-reply-bytes-per-peer", "64M", "--max-reply-bytes", "16M", NULL};
    void *other;
    long long n_ok, n_busy;
    void *holder = th_nonreader_started(&daemon_, args, HOLDER_SCANS, 100, &other, &n_ok, &n_busy);
    assert_non_null(holder);
    assert_int_equal(n_ok + n_busy, HOLDER_SCANS);
    assert_true(th_stat(other, "tallyd_reply_bytes{state=\"held\"}") > 0);
    long long refused_before = th_stat(other, "tallyd_limited_total{reason=\"reply_bytes\"}");

    /* The other connection: a histogram reserves nothing and is served ... */
    uint8_t bytes[4096] = {1, 2, 3};
    tally_req_t hist = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 7);
    assert_int_equal(th_call_status(other, &hist, bytes, sizeof bytes), TALLY_OK);
    /* ... a scan whose reply would pass the total bound is not, though its connection holds
     * nothing. */
    th_reply_t r;
    assert_int_equal(scan_call(other, 8 * MIB, 8, &r), TALLY_E_BUSY);
    assert_non_null(strstr((const char *)r.payload, "max_reply_bytes ("));
    th_reply_free(&r);
    assert_int_equal(th_stat(other, "tallyd_limited_total{reason=\"reply_bytes\"}"),
                     refused_before + 1);
    assert_int_equal(th_stat(other, "tallyd_reply_bytes_limit{scope=\"total\"}"), 16 * MIB);

    /* The peer reads everything: held drops to nothing, and the same scan is served. */
    for (int i = 0; i < HOLDER_SCANS; i++) {
        th_reply_t got;
        assert_int_equal(th_recv_reply(holder, &got), 0);
        assert_true(got.rep.status == TALLY_OK || got.rep.status == TALLY_E_BUSY);
        th_reply_free(&got);
    }
    assert_int_equal(th_stat_wait_at_most(other, "tallyd_reply_bytes{state=\"held\"}", 0, 30000),
                     0);
    assert_int_equal(scan_call(other, 8 * MIB, 9, &r), TALLY_OK);
    assert_int_equal(r.len, 16 * MIB);
    th_reply_free(&r);
    assert_true(th_stat(other, "tallyd_reply_bytes_peak{scope=\"total\"}") >= 16 * MIB);
    th_close(holder);
    assert_int_equal(th_close_and_stop(other, &daemon_, 10000), 0);
    daemon_.pid = 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_fresh_connection_gets_one_large_reply, stop_daemon),
        cmocka_unit_test_teardown(test_total_bound_refuses_another_connection, stop_daemon),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
