/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_election.c — a lease outlives its bucket's election (issue 32; td_nats_lease.h, "No
 * grace past the TTL"): a worker with the default lease TTL (15 s, none set) owns every
 * partition of a 3-node R3 fleet; kill -9 of the node leading TALLY_LEASES's stream makes the
 * bucket elect a new leader, during which renewals fail (each waits 1 s, tried again); once the
 * TTL has passed since the kill, the worker still holds every lease, has lost none, and went on
 * applying: a message published after the kill is answered by it.
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
#include <nats/nats.h>

#include "fleet_helpers.h"
#include "harness.h"
#include "nats_cluster.h"
#include "tally.h"
#include "tally_fleet.h"

#define PARTITIONS 4
#define TTL_MS 15000 /* TD_DEFAULT_NATS_LEASE_TTL_MS: the worker is given none */

static th_daemon_t w;
static char msg[512];

/* The node leading KV_TALLY_LEASES's stream (asked of any node that answers), or -1. */
static int lease_leader(void)
{
    for (int i = 0; i < 50; i++) {
        jsStreamInfo *si = NULL;
        jsErrCode jerr = 0;
        int leader = -1;
        if (js_GetStreamInfo(&si, tn_suite_js, "KV_" TALLY_NATS_BUCKET_LEASES, NULL, &jerr) ==
                NATS_OK &&
            si->Cluster && si->Cluster->Leader)
            leader = tn_node_index(&tn_suite, si->Cluster->Leader);
        jsStreamInfo_Destroy(si);
        if (leader >= 0)
            return leader;
        th_sleep_ms(100);
    }
    return -1;
}

static void test_lease_survives_the_buckets_election(void **state)
{
    (void)state;
    const char *metrics[] = {"--metrics", "127.0.0.1:0", NULL};
    assert_int_equal(tf_worker_start(&w, "el", PARTITIONS, metrics), 0);
    int held = 0;
    assert_true(tn_wait_leases(tn_suite_js, PARTITIONS, "el", PARTITIONS, 60000, &held) >= 0);
    /* every take finished (a lease key is written before the take's consumer: one cut short by
     * the kill would be released, or wait for its TTL, and prove nothing about renewals) */
    for (int i = 0; i < 300 && th_metric(&w, "tallyd_nats_partitions_owned") < PARTITIONS; i++)
        th_sleep_ms(100);
    assert_int_equal(th_metric(&w, "tallyd_nats_partitions_owned"), PARTITIONS);
    tally_nats_opts_t o = {.servers = tn_suite.urls, .producer_id = "el", .timeout_ms = 20000};
    tally_nats_t *p = NULL;
    assert_int_equal(tally_nats_new(&o, &p, msg, sizeof msg), TALLY_OK);
    int leader = lease_leader();
    assert_true(leader >= 0);
    print_message("TALLY_LEASES is led by node %d; kill -9\n", leader);
    int64_t killed = th_now_ms();
    assert_int_equal(tn_node_kill(&tn_suite, leader, SIGKILL), 0);

    /* A message after the kill is applied; past the TTL since the kill, every renewal after
     * the election came in time. */
    tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    assert_int_equal(tally_req_set_stream(&req, "el/after-the-kill"), TALLY_OK);
    uint8_t data[64] = {1, 2, 3};
    tally_reply_t reply;
    tally_reply_init(&reply);
    tally_status_t st = TALLY_E_TIMEOUT;
    for (int i = 0; i < 3 && st == TALLY_E_TIMEOUT; i++) /* a partition leader moving too */
        st = tally_nats_send(p, &req, data, sizeof data, true, NULL, NULL);
    assert_int_equal(st, TALLY_OK);
    /* Its PubAck waits for the partition's stream to elect a leader too when the killed node led
     * it, and for this client to reconnect when it was connected there: under ASan with the suite
     * running beside it (CI, 2026-12-02) that took over 20 s once. Still waiting is not a failure
     * of what this test checks (the lease); up to 60 s. */
    for (int i = 0; i < 3 && (st = tally_nats_flush(p)) == TALLY_E_TIMEOUT; i++)
        print_message("no PubAck yet at %lld ms: %s\n", (long long)(th_now_ms() - killed),
                      tally_nats_error(p));
    assert_int_equal(st, TALLY_OK);
    assert_int_equal(tally_nats_recv(p, 20000, &reply), TALLY_OK);
    assert_int_equal(reply.rep.status, TALLY_OK);
    tally_reply_clear(&reply);
    print_message("a message published after the kill answered at %lld ms\n",
                  (long long)(th_now_ms() - killed));
    while (th_now_ms() - killed < TTL_MS + 2000)
        th_sleep_ms(200);
    long long lost = th_metric(&w, "tallyd_nats_leases_lost_total");
    long long owned = th_metric(&w, "tallyd_nats_partitions_owned");
    long long taken = th_metric(&w, "tallyd_nats_partitions_taken_total");
    print_message("%lld ms after the kill: %lld partitions owned, %lld taken, %lld leases lost\n",
                  (long long)(th_now_ms() - killed), owned, taken, lost);
    assert_int_equal(lost, 0);
    assert_int_equal(owned, PARTITIONS);
    assert_int_equal(taken, PARTITIONS);
    tally_nats_destroy(&p);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 30000), 0);
}

static int setup(void **state)
{
    (void)state;
    return tn_suite_setup(3);
}

static int teardown(void **state)
{
    (void)state;
    th_daemon_end(&w);
    return tn_suite_teardown();
}

int main(void)
{
    if (tn_skip())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lease_survives_the_buckets_election),
    };
    int failed = cmocka_run_group_tests(tests, setup, teardown);
    nats_Close();
    return failed;
}
