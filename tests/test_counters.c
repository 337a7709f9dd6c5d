/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_counters.c — the request counters behind /metrics (daemon/core/td_counters.c) at their
 * edges: a status that never goes on the wire (a client-side one) is counted as `internal`, not
 * written past the table; a GPU ordinal below 0 or past TD_METRICS_GPUS_MAX is not counted
 * (td_gpu_device_ordinal's -1 for no such device), the last one that fits is; the shards'
 * counters gathered add up, and the GPU count is the larger of the two.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "td_counters.h"

static uint64_t gpu_requests(const td_metrics_t *m)
{
    uint64_t n = 0;
    for (unsigned g = 0; g < TD_METRICS_GPUS_MAX; g++)
        n += m->gpu_requests[g] + m->gpu_region_requests[g][0] + m->gpu_region_requests[g][1];
    return n;
}

static void test_status_off_the_wire_is_internal(void **state)
{
    (void)state;
    static td_metrics_t m;
    memset(&m, 0, sizeof m);
    td_metrics_observe(&m, TALLY_OP_HIST, TALLY_E_TIMEOUT, 10, 20, 30000);
    td_metrics_observe(&m, TALLY_OP_HIST, TALLY_E_NOT_OWNER, 0, 0, 0);
    assert_int_equal(m.requests[TALLY_OP_HIST][TALLY_E_INTERNAL], 1);
    assert_int_equal(m.requests[TALLY_OP_HIST][TALLY_E_NOT_OWNER], 1);
    assert_int_equal(td_metrics_answered(&m), 2);
    assert_int_equal(m.bytes_in, 10);
    assert_int_equal(m.bytes_out, 20);
}

static void test_gpu_ordinals_out_of_range(void **state)
{
    (void)state;
    static td_metrics_t m;
    memset(&m, 0, sizeof m);
    td_metrics_count_gpu_request(&m, -1);
    td_metrics_count_gpu_request(&m, TD_METRICS_GPUS_MAX);
    td_metrics_count_region_request(&m, -1, false);
    td_metrics_count_region_request(&m, TD_METRICS_GPUS_MAX, true);
    assert_int_equal(gpu_requests(&m), 0);
    td_metrics_count_gpu_request(&m, TD_METRICS_GPUS_MAX - 1);
    td_metrics_count_region_request(&m, TD_METRICS_GPUS_MAX - 1, true);
    assert_int_equal(m.gpu_requests[TD_METRICS_GPUS_MAX - 1], 1);
    assert_int_equal(m.gpu_region_requests[TD_METRICS_GPUS_MAX - 1][1], 1);
    assert_int_equal(gpu_requests(&m), 2);
    td_metrics_set_gpus(&m, TD_METRICS_GPUS_MAX + 4);
    assert_int_equal(m.gpu_devices, TD_METRICS_GPUS_MAX);
}

static void test_gathered_counters_add_up(void **state)
{
    (void)state;
    static td_metrics_t total, shard;
    memset(&total, 0, sizeof total);
    memset(&shard, 0, sizeof shard);
    td_metrics_set_gpus(&total, 1);
    td_metrics_set_gpus(&shard, 3);
    td_metrics_observe(&shard, TALLY_OP_SCAN, TALLY_OK, 8, 16, 1000);
    td_metrics_count_gpu_request(&shard, 2);
    td_metrics_add(&total, &shard);
    td_metrics_add(&total, &shard);
    assert_int_equal(total.gpu_devices, 3); /* the larger */
    assert_int_equal(td_metrics_answered(&total), 2);
    assert_int_equal(total.gpu_requests[2], 2);
    assert_int_equal(total.bytes_out, 32);
    td_metrics_set_gpus(&shard, 2);
    td_metrics_add(&total, &shard);
    assert_int_equal(total.gpu_devices, 3); /* not lowered */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_status_off_the_wire_is_internal),
        cmocka_unit_test(test_gpu_ordinals_out_of_range),
        cmocka_unit_test(test_gathered_counters_add_up),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
