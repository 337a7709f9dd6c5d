/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_fleet_status.c — a fleet worker's `info` keys and metrics (daemon/core/td_fleet_status.c)
 * from a status filled in here, without NATS: the text for a tallyd that is no worker; the
 * partitions owned and each one's lag (0, never a wrapped number, when a checkpoint restored an
 * applied sequence past what the worker has seen yet); nats_max_reply 0 under a max_payload too
 * small for the header room; the metrics' length told whole when the buffer is short (as
 * snprintf), with what fits written and terminated, and nothing for no status or a worker off;
 * the changelog's stage histograms (each time in the first bucket that holds it, cumulative,
 * their sums exact) and the flights' counter and wait; where each owned partition's backlog
 * waits (issue 32: its window, in the request path, in messages and bytes, and fetched for the
 * fleet thread,
 * never a wrapped number when the reader's count is read a message behind the fleet thread's),
 * each family whole under its HELP and TYPE, and the window's limits; the whole metrics text
 * (td_service_render_metrics) while those gauges move under it.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "td_fleet_status.h"
#include "td_service.h"

static td_fleet_status_t st;
static char out[16384];

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
    char whole[sizeof out];
    memcpy(whole, out, n + 1);
    char small[100];
    assert_int_equal(td_fleet_status_render(&st, small, sizeof small), n);
    assert_int_equal(strlen(small), sizeof small - 1);
    assert_memory_equal(small, whole, sizeof small - 1);
    assert_int_equal(td_fleet_status_render(&st, NULL, 0), n);
}

/* The changelog's stages: each observation in the first bucket whose le holds it (the bounds of
 * tallyd_request_duration_seconds, in seconds), cumulative, +Inf the count, the sum exact; the
 * flights' counter and wait. */
static void test_changelog_stages(void **state)
{
    (void)state;
    st.on = true;
    st.partitions = 1;
    td_fleet_status_stage(&st, TD_CL_STAGE_BATCH, 2000000);  /* 2 ms: le 0.0025 */
    td_fleet_status_stage(&st, TD_CL_STAGE_BATCH, 2500000);  /* 2.5 ms: le 0.0025 too */
    td_fleet_status_stage(&st, TD_CL_STAGE_BATCH, 2500001);  /* just past: le 0.005 */
    td_fleet_status_stage(&st, TD_CL_STAGE_ACK, 3000000000); /* 3 s: +Inf only */
    td_fleet_status_stage(&st, TD_CL_STAGE_RELEASE, 0);
    st.cl_flights_full = 4;
    st.cl_flight_wait_ns = 1500000;
    size_t n = td_fleet_status_render(&st, out, sizeof out);
    assert_int_equal(n, strlen(out));
    assert_non_null(strstr(out, "\n# TYPE tallyd_nats_changelog_stage_seconds histogram\n"));
    static const char *const want[] = {
        "tallyd_nats_changelog_stage_seconds_bucket{stage=\"batch\",le=\"0.001\"} 0",
        "tallyd_nats_changelog_stage_seconds_bucket{stage=\"batch\",le=\"0.0025\"} 2",
        "tallyd_nats_changelog_stage_seconds_bucket{stage=\"batch\",le=\"0.005\"} 3",
        "tallyd_nats_changelog_stage_seconds_bucket{stage=\"batch\",le=\"1\"} 3",
        "tallyd_nats_changelog_stage_seconds_bucket{stage=\"batch\",le=\"+Inf\"} 3",
        "tallyd_nats_changelog_stage_seconds_sum{stage=\"batch\"} 0.007000001",
        "tallyd_nats_changelog_stage_seconds_count{stage=\"batch\"} 3",
        "tallyd_nats_changelog_stage_seconds_count{stage=\"publish\"} 0",
        "tallyd_nats_changelog_stage_seconds_bucket{stage=\"ack\",le=\"1\"} 0",
        "tallyd_nats_changelog_stage_seconds_bucket{stage=\"ack\",le=\"+Inf\"} 1",
        "tallyd_nats_changelog_stage_seconds_sum{stage=\"ack\"} 3.000000000",
        "tallyd_nats_changelog_stage_seconds_bucket{stage=\"release\",le=\"2.5e-05\"} 1",
        "tallyd_nats_changelog_stage_seconds_sum{stage=\"release\"} 0.000000000",
        "tallyd_nats_changelog_flights_full_total 4",
        "tallyd_nats_changelog_flight_wait_seconds_total 0.001500000",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        char line[256];
        snprintf(line, sizeof line, "\n%s\n", want[i]);
        if (!strstr(out, line))
            fail_msg("no line %s in:\n%s", want[i], out);
    }
}

/* Where the backlog waits: the gauges of partitions 0 and 2 (owned), none of partition 1's, in
 * the order of the partitions, each family after its HELP and TYPE; fetched is the reader's count
 * less the fleet thread's. */
static void test_metrics_backlog(void **state)
{
    (void)state;
    st.on = true;
    st.partitions = 3;
    st.inflight = 256;
    st.inflight_bytes = 16u << 20;
    st.owned[0] = st.owned[2] = true;
    st.window[0] = 7; /* 5 in the path, 2 answered behind its head */
    st.in_path[0] = 5;
    st.in_path_bytes[0] = 5 * 1152;
    st.fetched[0] = 300;
    st.taken[0] = 290;
    st.in_path[1] = 9; /* not owned: no line */
    st.fetched[1] = 40;
    st.fetched[2] = 7; /* the reader's store read before the fleet thread's: 0 */
    st.taken[2] = 8;
    td_fleet_status_render(&st, out, sizeof out);
    static const char *const want[] = {
        "# TYPE tallyd_nats_partition_window gauge\n"
        "tallyd_nats_partition_window{partition=\"0\"} 7\n"
        "tallyd_nats_partition_window{partition=\"2\"} 0\n# HELP ",
        "# TYPE tallyd_nats_partition_in_path gauge\n"
        "tallyd_nats_partition_in_path{partition=\"0\"} 5\n"
        "tallyd_nats_partition_in_path{partition=\"2\"} 0\n# HELP ",
        "# TYPE tallyd_nats_partition_in_path_bytes gauge\n"
        "tallyd_nats_partition_in_path_bytes{partition=\"0\"} 5760\n"
        "tallyd_nats_partition_in_path_bytes{partition=\"2\"} 0\n# HELP ",
        "# TYPE tallyd_nats_partition_fetched gauge\n"
        "tallyd_nats_partition_fetched{partition=\"0\"} 10\n"
        "tallyd_nats_partition_fetched{partition=\"2\"} 0\n# HELP ",
        "# TYPE tallyd_nats_inflight_limit gauge\ntallyd_nats_inflight_limit 256\n",
        "# TYPE tallyd_nats_inflight_limit_bytes gauge\ntallyd_nats_inflight_limit_bytes "
        "16777216\n",
        "\n# HELP tallyd_nats_partition_in_path Messages of an owned partition's window in the "
        "request path now",
        "\n# HELP tallyd_nats_partition_fetched Messages of an owned partition its reader has "
        "fetched that wait for the fleet thread",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (!strstr(out, want[i]))
            fail_msg("no text\n%s\nin:\n%s", want[i], out);
    assert_null(strstr(out, "partition=\"1\""));
    /* each family once */
    const char *families[] = {"window", "in_path", "in_path_bytes", "fetched", "lag"};
    for (size_t i = 0; i < sizeof families / sizeof families[0]; i++) {
        char type[96];
        snprintf(type, sizeof type, "# TYPE tallyd_nats_partition_%s gauge\n", families[i]);
        const char *at = strstr(out, type);
        assert_non_null(at);
        assert_null(strstr(at + 1, type));
    }
}

/* A thread that flips every partition's lag, in_path and fetched between 1 and 19 digits. */
static atomic_bool flipping;

static void *flip(void *arg)
{
    (void)arg;
    for (uint64_t v = 0; atomic_load(&flipping); v++)
        for (uint32_t k = 0; k < st.partitions; k++) {
            uint64_t x = v % 2 ? UINT64_MAX / 2 : 1;
            atomic_store_explicit(&st.last_seq[k], x, memory_order_relaxed);
            atomic_store_explicit(&st.in_path[k], x, memory_order_relaxed);
            atomic_store_explicit(&st.fetched[k], x, memory_order_relaxed);
        }
    return NULL;
}

static void sample_gauges(void *ctx, td_gauges_t *g)
{
    (void)ctx;
    memset(g, 0, sizeof *g);
    g->backend = "cpu";
    g->devices = "none";
    g->fleet = &st;
}

static void sample_counters(void *ctx, td_metrics_t *m)
{
    (void)ctx;
    memset(m, 0, sizeof *m);
}

/* The fleet's families are read live while the metrics text is written (the rest from a sample
 * taken with the shards held): with every partition's gauges flipping between 1 and 19 digits,
 * each text is whole (its last line is the fleet's last family's) and its length is what was
 * written. The length measured before the writing was sent as it was: a longer text cut at it, a
 * shorter one followed by bytes past its end. */
static void test_metrics_whole_while_gauges_move(void **state)
{
    (void)state;
    st.on = true;
    st.partitions = TALLY_NATS_MAX_PARTITIONS;
    for (uint32_t k = 0; k < st.partitions; k++)
        st.owned[k] = true;
    td_streams_t *streams = NULL;
    assert_int_equal(td_streams_new(16, &streams), TD_OK);
    td_service_host_t host = {
        .streams = streams, .gauges = sample_gauges, .counters = sample_counters, .fleet = &st};
    atomic_store(&flipping, true);
    pthread_t flipper;
    assert_int_equal(pthread_create(&flipper, NULL, flip, NULL), 0);
    const char *last = "\ntallyd_nats_changelog_flight_wait_seconds_total 0.000000000\n";
    for (int i = 0; i < 200; i++) {
        char *text = NULL;
        size_t len = 0;
        assert_int_equal(td_service_render_metrics(&host, &text, &len), TD_OK);
        assert_int_equal(strlen(text), len);
        assert_true(len > strlen(last));
        assert_string_equal(text + len - strlen(last), last);
        free(text);
    }
    atomic_store(&flipping, false);
    pthread_join(flipper, NULL);
    td_streams_destroy(&streams);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_not_a_worker, fresh),
        cmocka_unit_test_setup(test_info_keys, fresh),
        cmocka_unit_test_setup(test_members_per_process, fresh),
        cmocka_unit_test_setup(test_metrics_lag_and_length, fresh),
        cmocka_unit_test_setup(test_changelog_stages, fresh),
        cmocka_unit_test_setup(test_metrics_backlog, fresh),
        cmocka_unit_test_setup(test_metrics_whole_while_gauges_move, fresh),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
