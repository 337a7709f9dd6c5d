/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_fleet_status.c — a fleet worker's `info` keys and metrics (daemon/core/td_fleet_status.c)
 * from a status filled in here, without NATS: the text for a tallyd that is no worker; the
 * partitions owned and each one's lag (0, never a wrapped number, when a checkpoint restored an
 * applied sequence past what the worker has seen yet); nats_max_reply 0 under a max_payload too
 * small for the header room; the metrics' length told whole when the buffer is short (as
 * snprintf), with what fits written and terminated, and nothing for no status or a worker off.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "td_fleet_status.h"

static td_fleet_status_t st;
static char out[8192];

static int fresh(void **state)
{
    (void)state;
    memset(&st, 0, sizeof st);
    return 0;
}

static void test_not_a_worker(void **state)
{
    (void)state;
    assert_int_equal(td_fleet_status_info(&st, out, sizeof out), strlen("nats=off\n"));
    assert_string_equal(out, "nats=off\n");
    assert_int_equal(td_fleet_status_owned(&st), 0);
    out[0] = 'x';
    assert_int_equal(td_fleet_status_render(&st, out, sizeof out), 0);
    assert_string_equal(out, "");
    out[0] = 'x';
    assert_int_equal(td_fleet_status_render(NULL, out, sizeof out), 0);
    assert_string_equal(out, "");
    assert_int_equal(td_fleet_status_render(NULL, NULL, 0), 0);
}

static void test_info_keys(void **state)
{
    (void)state;
    st.on = true;
    snprintf(st.member, sizeof st.member, "w-1");
    st.partitions = 4;
    st.lease_ttl_ms = 5000;
    st.checkpoint_interval_ms = 700;
    st.max_payload = 1024; /* under the 4096 bytes kept for a reply's header */
    st.owned[1] = st.owned[3] = true;
    size_t n = td_fleet_status_info(&st, out, sizeof out);
    const char *want = "nats=on\nnats_member_id=w-1\nnats_partitions=4\nnats_partitions_owned=2\n"
                       "nats_lease_ttl_ms=5000\nnats_checkpoint_interval_ms=700\n"
                       "nats_max_payload=1024\nnats_max_reply=0\nnats_direct=off\n"
                       "nats_direct_uncommitted=0\nnats_changelog_commits=0\nnats_not_durable=0\n"
                       "nats_changelog_purges=0\n";
    assert_string_equal(out, want);
    assert_int_equal(n, strlen(want));
    st.max_payload = 1 << 20;
    td_fleet_status_info(&st, out, sizeof out);
    assert_non_null(strstr(out, "\nnats_max_reply=1044480\n"));
    st.direct = true;
    st.direct_uncommitted = 7;
    td_fleet_status_info(&st, out, sizeof out);
    assert_non_null(strstr(out, "\nnats_direct=local\nnats_direct_uncommitted=7\n"));
    st.direct = false;
    st.direct_uncommitted = 0;
}

/* [nats] members_per_process: the key follows the others only where it is not 1, and a cap
 * too small for it still counts what it needs; which member ids are the process's. */
static void test_members_per_process(void **state)
{
    (void)state;
    st.on = true;
    snprintf(st.member, sizeof st.member, "w");
    st.partitions = 4;
    st.members_per_process = 1; /* as a worker sets it by default */
    size_t one = td_fleet_status_info(&st, out, sizeof out);
    assert_null(strstr(out, "members_per_process"));
    assert_true(td_fleet_status_is_self(&st, "w"));
    assert_false(td_fleet_status_is_self(&st, "w-0"));
    st.members_per_process = 3;
    size_t three = td_fleet_status_info(&st, out, sizeof out);
    const char *tail = "\nnats_changelog_purges=0\nnats_members_per_process=3\n";
    assert_int_equal(three, one + strlen("nats_members_per_process=3\n"));
    assert_string_equal(out + strlen(out) - strlen(tail), tail);
    assert_int_equal(td_fleet_status_info(&st, out, one), three); /* the key past the cap */
    assert_int_equal(out[one - 1], 0);
    assert_true(td_fleet_status_is_self(&st, "w-0"));
    assert_true(td_fleet_status_is_self(&st, "w-2"));
    const char *others[] = {"w", "w-3", "w-00", "w-01", "w-", "w-1x", "x-1", "w1", "ww-1"};
    for (size_t i = 0; i < sizeof others / sizeof *others; i++)
        if (td_fleet_status_is_self(&st, others[i]))
            fail_msg("%s taken for one of w's 3 members", others[i]);
    st.on = false;
    assert_false(td_fleet_status_is_self(&st, "w-0"));
}

static void test_metrics_lag_and_length(void **state)
{
    (void)state;
    st.on = true;
    st.partitions = 3;
    st.owned[0] = st.owned[2] = true;
    st.last_seq[0] = 10; /* 3 behind */
    st.applied_seq[0] = 7;
    st.last_seq[1] = 50; /* not owned: no line */
    st.applied_seq[1] = 0;
    st.last_seq[2] = 4; /* restored past what it has seen: 0 */
    st.applied_seq[2] = 9;
    st.refused_reply = 5;
    size_t n = td_fleet_status_render(&st, out, sizeof out);
    assert_int_equal(n, strlen(out));
    assert_non_null(strstr(out, "\ntallyd_nats_partitions_owned 2\n"));
    assert_non_null(strstr(out, "\ntallyd_nats_partition_lag{partition=\"0\"} 3\n"));
    assert_null(strstr(out, "partition=\"1\""));
    assert_non_null(strstr(out, "\ntallyd_nats_partition_lag{partition=\"2\"} 0\n"));
    assert_non_null(strstr(out, "\ntallyd_nats_refused_total{reason=\"reply\"} 5\n"));
    assert_non_null(strstr(out, "\ntallyd_nats_direct_uncommitted 0\n"));
    assert_non_null(strstr(out, "\ntallyd_nats_not_owner_total 0\n"));

    /* A short buffer: the whole length told, what fits written, terminated. */
    char whole[8192];
    memcpy(whole, out, n + 1);
    char small[100];
    assert_int_equal(td_fleet_status_render(&st, small, sizeof small), n);
    assert_int_equal(strlen(small), sizeof small - 1);
    assert_memory_equal(small, whole, sizeof small - 1);
    assert_int_equal(td_fleet_status_render(&st, NULL, 0), n);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_not_a_worker, fresh),
        cmocka_unit_test_setup(test_info_keys, fresh),
        cmocka_unit_test_setup(test_members_per_process, fresh),
        cmocka_unit_test_setup(test_metrics_lag_and_length, fresh),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
