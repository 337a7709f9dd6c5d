/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_standby.c — standby copies (`[nats] standbys = 1`, issue 33; docs/fleet.md
 * "Standbys") against a real 3-node NATS cluster (tests/lib/nats_cluster.c): two members in
 * direct mode, `replicated`, each the other's standby (with two members the next one in a
 * partition's rendezvous order is the other).
 *   1. standby catch-up and a take from the copy: a fleet client sends numbered writes to 16
 *      streams over the 4 partitions, 16 in flight; member a's copy of each of b's partitions
 *      catches up with b's changelog (its /metrics' last applied sequence of the copy equal to
 *      the changelog's last), and with b stopped (SIGSTOP) a answers stale-ok queries of b's
 *      streams from its copies, marked stale and equal to the model (and `tally query
 *      --stale-ok` says so, and Python's tally.query_stale where NumPy is); b is killed
 *      (SIGKILL) with writes in flight, and the client sends the rest again: a takes each of
 *      b's partitions from its copy (its log line and tallyd_nats_takes_total{from="standby"}),
 *      replays fewer changelog messages than b wrote, and every stream equals the model of the
 *      requests (numbered: each applied once);
 *   2. a copy the rule refuses: a's copies held at the first checkpoint they started from
 *      (TALLYD_TEST_STANDBY_HOLD), b checkpointing every 200 ms under the writes: b's manifests
 *      move past the copies', and after b's kill -9 a takes each of b's partitions from the
 *      checkpoint (said, counted from="checkpoint", none from="standby") and equals the model.
 *   3. a copy that runs on across checkpoints (the manifest's cl_since, docs/fleet.md "Standbys
 *      across checkpoints"): b checkpoints every 200 ms under the writes; once a's copies have
 *      started from b's first checkpoint, b's later ones carry cl_since and a keeps its copies
 *      across them (tallyd_nats_standby_checkpoints_total{copy="kept"} up, {copy="restarted"}
 *      not), answers stale-ok queries equal to the model, and after b's kill -9 takes each of
 *      b's partitions from its copy ("run on across checkpoints"), replaying nothing, equal to
 *      the model;
 *   4. JetStream ingest into one of b's partitions: b's next checkpoint of it claims no
 *      cl_since, and a's copy starts again from it ({copy="restarted"} up); then, a's copies
 *      held (TALLYD_TEST_STANDBY_HOLD naming a file), a second ingest message: b's later
 *      checkpoints of that partition do not cover its copy, and after b's kill -9 a takes it
 *      from the checkpoint (the others from their copies), every stream equal to the model, the
 *      ingest stream's two hists too.
 * Waits are bounded loops on what the cluster or the members report; no time is asserted.
 */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <nats/nats.h>

#include "fleet_helpers.h"
#include "harness.h"
#include "nats_cluster.h"
#include "reference.h"
#include "stream_check.h"
#include "tally.h"
#include "tally_fleet.h"
#include "td_fleet_plan.h"

#define PARTITIONS 4
#define STREAMS 16
#define ROUNDS 8
#define TIMEOUT_MS 60000

static char msg[512];
static th_daemon_t member[2];
static const char *const ids[2] = {"sb-a", "sb-b"};
static uint64_t model[STREAMS][256];
static uint64_t seqs[STREAMS];
static const tf_fleet_t test_fleet = {"sb", STREAMS, model, seqs, PARTITIONS, member, ids, 2};

static int setup(void **state)
{
    (void)state;
    return tn_suite_setup(3);
}

static int stop_members(void **state)
{
    (void)state;
    tf_members_end(&test_fleet);
    unsetenv("TALLYD_TEST_STANDBY_HOLD");
    return 0;
}

static int teardown(void **state)
{
    stop_members(state);
    return tn_suite_teardown();
}

/* Member i, replicated, standbys = 1, lease 3 s, checkpoints ckpt_ms apart. */
static void start(int i, const char *ckpt_ms)
{
    const char *args[] = {"--nats-servers",
                          tn_suite.urls,
                          "--nats-replicas",
                          "3",
                          "--nats-partitions",
                          "4",
                          "--nats-lease-ttl-ms",
                          "3000",
                          "--nats-checkpoint-interval-ms",
                          ckpt_ms,
                          "--nats-member-id",
                          ids[i],
                          "--nats-direct",
                          "replicated",
                          "--nats-standbys",
                          "1",
                          "--metrics",
                          "127.0.0.1:0",
                          NULL};
    assert_int_equal(th_daemon_start(&member[i], args), 0);
}

/* Waits until member i's metric `name` is at least `at_least`; its value. */
static long long wait_metric(int i, const char *name, long long at_least)
{
    int64_t until = th_now_ms() + TIMEOUT_MS;
    long long v;
    while ((v = th_metric(&member[i], name)) < at_least && th_now_ms() < until)
        th_sleep_ms(50);
    if (v < at_least) {
        tf_dump_logs(&test_fleet);
        fail_msg("%s of %s: %lld, not %lld or more", name, ids[i], v, at_least);
    }
    return v;
}

/* Rounds from..to-1 of every stream, 16 in flight; b (member 1) killed after half of round
 * kill_round's replies (-1: none killed). */
static void write_rounds(tally_client_t *c, int from, int to, int kill_round)
{
    for (int r = from; r < to; r++) {
        for (int s = 0; s < STREAMS; s++)
            tf_send_hist(&test_fleet, c, s, r);
        for (int i = 0; i < STREAMS; i++) {
            tf_recv_applied(c);
            if (r == kill_round && i == STREAMS / 2)
                th_daemon_kill(&member[1]);
        }
    }
}

/* Member i's copy of partition k has applied its changelog up to the end (bounded wait). */
static void wait_caught_up(int i, uint32_t k)
{
    char name[96];
    snprintf(name, sizeof name, "tallyd_nats_standby_changelog_seq{partition=\"%u\"}", (unsigned)k);
    int64_t until = th_now_ms() + TIMEOUT_MS;
    long long copy = -1, last = -1;
    while ((copy = th_metric(&member[i], name)) !=
               (last = (long long)tf_changelog_last(tn_suite_js, k)) &&
           th_now_ms() < until)
        th_sleep_ms(50);
    if (copy != last) {
        tf_dump_logs(&test_fleet);
        fail_msg("%s's copy of partition %u at %lld, its changelog at %lld", ids[i], (unsigned)k,
                 copy, last);
    }
}

/* How many lines of member i's log hold `text`. */
static int log_lines(int i, const char *text)
{
    return th_sh("exit $(grep -c '%s' %s)", text, member[i].log_path);
}

/* Member i's take-overs as its log says them: for the test's log (bench/NOTES.md's figures). */
static void show_takes(int i)
{
    th_sh("grep -a 'taken from\\|changelog: applied\\|changelog: nothing\\|took partition' %s >&2",
          member[i].log_path);
}

/* The members up, each holding its planned partitions, a's copies of b's started. */
static void start_pair(const char *b_ckpt_ms)
{
    tf_fresh(&test_fleet);
    start(0, "3600000");
    start(1, b_ckpt_ms);
    assert_true(tf_planned(&test_fleet, 1) > 0); /* b has partitions to lose */
    tf_wait_held(&test_fleet, ids[0], tf_planned(&test_fleet, 0), TIMEOUT_MS);
    tf_wait_held(&test_fleet, ids[1], tf_planned(&test_fleet, 1), TIMEOUT_MS);
    wait_metric(0, "tallyd_nats_standby_starts_total", tf_planned(&test_fleet, 1));
}

/* Python's tally.query_stale of stream `name` (last_seq: the model's), b stopped: a stale answer
 * equal to the model's last_seq. Skipped where the binding cannot load (no NumPy). */
static void check_python_stale(const char *name, uint64_t last_seq)
{
    if (th_sh("PYTHONPATH=%s/client/python TALLY_LIBRARY=%s python3 -c 'import tally' "
              "2>/dev/null",
              TALLY_SOURCE_DIR, TALLY_LIBRARY_PATH) != 0) {
        print_message("tally.query_stale not checked: the Python binding does not load here\n");
        return;
    }
    kill(member[1].pid, SIGSTOP);
    int rc = th_sh("PYTHONPATH=%s/client/python TALLY_LIBRARY=%s python3 -c '"
                   "import sys, tally\n"
                   "r, stale = tally.query_stale(sys.argv[1], servers=sys.argv[2], "
                   "timeout_ms=5000)\n"
                   "sys.exit(0 if stale > 0 and r[\"last_seq\"] == int(sys.argv[3]) else 1)' "
                   "%s %s %llu",
                   TALLY_SOURCE_DIR, TALLY_LIBRARY_PATH, name, tn_suite.urls,
                   (unsigned long long)last_seq);
    kill(member[1].pid, SIGCONT);
    assert_int_equal(rc, 0);
}

/* With b stopped (SIGSTOP, well within its lease), a stale-ok query of each of b's streams is
 * a's to answer, from its copy: marked stale (the changelog sequence the copy holds, that of b's
 * partition's last message) and equal to the model, last_seq too. */
static void check_stale_answers(void)
{
    tally_nats_opts_t o = {.servers = tn_suite.urls, .timeout_ms = 5000};
    tally_nats_t *n = NULL;
    assert_int_equal(tally_nats_new(&o, &n, msg, sizeof msg), TALLY_OK);
    tally_stream_info_t *info = calloc(1, sizeof *info);
    assert_non_null(info);
    kill(member[1].pid, SIGSTOP);
    int answered = 0;
    for (int s = 0; s < STREAMS; s++) {
        char name[32];
        tf_stream_name(&test_fleet, s, name, sizeof name);
        uint32_t k = tally_partition(name, strlen(name), PARTITIONS);
        if (td_fleet_owner(ids, 2, k) != 1)
            continue;
        uint64_t stale = 0;
        tally_status_t st = tally_nats_query_stale(n, name, info, &stale);
        if (st != TALLY_OK) {
            kill(member[1].pid, SIGCONT);
            fail_msg("a stale-ok query of %s: %s: %s", name, tally_status_name(st),
                     tally_nats_error(n));
        }
        assert_int_equal(stale, tf_changelog_last(tn_suite_js, k));
        assert_int_equal(info->last_seq, seqs[s]);
        assert_memory_equal(info->bins, model[s], sizeof model[s]);
        answered++;
    }
    kill(member[1].pid, SIGCONT);
    assert_true(answered > 0);
    /* the CLI says where its answer came from */
    for (int s = 0; s < STREAMS; s++) {
        char name[32];
        tf_stream_name(&test_fleet, s, name, sizeof name);
        if (td_fleet_owner(ids, 2, tally_partition(name, strlen(name), PARTITIONS)) != 1)
            continue;
        kill(member[1].pid, SIGSTOP);
        int rc = th_sh("%s --nats %s -t 5000 query --stale-ok %s 2>&1 | grep -q "
                       "'stale: answered from a standby'",
                       th_tally_bin(), tn_suite.urls, name);
        kill(member[1].pid, SIGCONT);
        assert_int_equal(rc, 0);
        check_python_stale(name, seqs[s]);
        break;
    }
    free(info);
    tally_nats_destroy(&n);
}

/* After b's kill: a holds every partition, every stream equals the model, and a took each of
 * b's partitions from its copy (its log says `how` once a take); the changelog messages it
 * replayed since its replayed_total was `replayed`. */
static long long took_from_copies(tally_client_t *c, const char *how, long long replayed)
{
    tf_wait_held(&test_fleet, ids[0], PARTITIONS, TIMEOUT_MS);
    wait_metric(0, "tallyd_nats_partitions_taken_total", PARTITIONS);
    tf_check_model(&test_fleet, c);
    assert_int_equal(th_metric(&member[0], "tallyd_nats_takes_total{from=\"standby\"}"),
                     tf_planned(&test_fleet, 1));
    assert_int_equal(log_lines(0, how), tf_planned(&test_fleet, 1));
    /* each take's own line says it loaded the copy (written as the take is counted: waited for) */
    int64_t until = th_now_ms() + TIMEOUT_MS;
    while (log_lines(0, "(its standby copy: ") < tf_planned(&test_fleet, 1) && th_now_ms() < until)
        th_sleep_ms(50);
    assert_int_equal(log_lines(0, "(its standby copy: "), tf_planned(&test_fleet, 1));
    return th_metric(&member[0], "tallyd_nats_changelog_replayed_total") - replayed;
}

/* ---- 1. catch-up, and a take from the copy ----------------------------------------------- */

static void test_catch_up_and_take(void **state)
{
    (void)state;
    start_pair("3600000"); /* only the changelog holds b's writes */
    tally_client_t *c = tf_fleet_client(tn_suite.urls, TIMEOUT_MS);
    write_rounds(c, 0, ROUNDS / 2, -1);
    uint64_t written = 0; /* b's changelog messages */
    for (uint32_t k = 0; k < PARTITIONS; k++)
        if (td_fleet_owner(ids, 2, k) == 1) {
            wait_caught_up(0, k);
            written += tf_changelog_last(tn_suite_js, k);
        }
    assert_true(th_metric(&member[0], "tallyd_nats_standby_applied_total") > 0);
    assert_true(th_metric(&member[0], "tallyd_nats_standby_bytes") > 0);
    check_stale_answers();
    long long replayed = th_metric(&member[0], "tallyd_nats_changelog_replayed_total");
    write_rounds(c, ROUNDS / 2, ROUNDS, ROUNDS / 2 + 1); /* b killed with writes in flight */
    /* only the tail after each copy: fewer than b wrote in all */
    long long tail = took_from_copies(c, "taken from its standby copy", replayed);
    print_message("b's changelog: %llu messages before the last rounds; a replayed %lld at its "
                  "takes from the copies\n",
                  (unsigned long long)written, tail);
    assert_true(tail >= 0 && (uint64_t)tail < written);
    show_takes(0);
    tally_client_destroy(&c);
}

/* ---- 2. a copy the rule refuses ---------------------------------------------------------- */

static void test_copy_refused(void **state)
{
    (void)state;
    setenv("TALLYD_TEST_STANDBY_HOLD", "1", 1); /* a's copies stay at their first checkpoint */
    start_pair("200");
    unsetenv("TALLYD_TEST_STANDBY_HOLD");
    uint64_t gen[PARTITIONS] = {0};
    for (uint32_t k = 0; k < PARTITIONS; k++)
        gen[k] = tf_manifest(k).generation; /* the copies started from this one or an earlier one */
    tally_client_t *c = tf_fleet_client(tn_suite.urls, TIMEOUT_MS);
    write_rounds(c, 0, ROUNDS / 2, -1);
    for (uint32_t k = 0; k < PARTITIONS; k++) { /* b checkpoints past its copies */
        int64_t until = th_now_ms() + TIMEOUT_MS;
        while (td_fleet_owner(ids, 2, k) == 1 && tf_manifest(k).generation <= gen[k] &&
               th_now_ms() < until)
            th_sleep_ms(50);
        assert_true(td_fleet_owner(ids, 2, k) != 1 || tf_manifest(k).generation > gen[k]);
    }
    long long before = th_metric(&member[0], "tallyd_nats_takes_total{from=\"checkpoint\"}");
    write_rounds(c, ROUNDS / 2, ROUNDS, ROUNDS / 2);
    tf_wait_held(&test_fleet, ids[0], PARTITIONS, TIMEOUT_MS);
    wait_metric(0, "tallyd_nats_takes_total{from=\"checkpoint\"}",
                before + tf_planned(&test_fleet, 1));
    tf_check_model(&test_fleet, c);
    assert_int_equal(th_metric(&member[0], "tallyd_nats_takes_total{from=\"standby\"}"), 0);
    assert_int_equal(log_lines(0, "not the checkpoint fenced"), tf_planned(&test_fleet, 1));
    assert_int_equal(log_lines(0, "(its standby copy: "), 0);
    show_takes(0);
    tally_client_destroy(&c);
}

/* ---- 3. a copy runs on across checkpoints (the manifest's cl_since) --------------------- */

static long long copies(int i, const char *what)
{
    char name[96];
    snprintf(name, sizeof name, "tallyd_nats_standby_checkpoints_total{copy=\"%s\"}", what);
    return th_metric(&member[i], name);
}

/* Writes rounds (from round r on; b checkpoints only while writes come) until each of b's
 * partitions has checkpointed `more` times past now; the next round. */
static int write_until_checkpoints(tally_client_t *c, int r, uint64_t more)
{
    uint64_t want[PARTITIONS] = {0};
    for (uint32_t k = 0; k < PARTITIONS; k++)
        want[k] = td_fleet_owner(ids, 2, k) == 1 ? tf_manifest(k).generation + more : 0;
    int64_t until = th_now_ms() + TIMEOUT_MS;
    for (uint32_t k = 0; k < PARTITIONS; k++)
        while (tf_manifest(k).generation < want[k]) {
            if (th_now_ms() > until) {
                tf_dump_logs(&test_fleet);
                fail_msg("b's partition %u at generation %llu, not %llu", (unsigned)k,
                         (unsigned long long)tf_manifest(k).generation,
                         (unsigned long long)want[k]);
            }
            write_rounds(c, r, r + 1, -1);
            r++;
            th_sleep_ms(40);
        }
    for (uint32_t k = 0; k < PARTITIONS; k++)
        if (want[k])
            wait_caught_up(0, k);
    return r;
}

/* a's copy of each of b's partitions has started from one of b's own checkpoints (b's first one
 * claims no cl_since, so a copy started from b's take's fence starts again at it): from then on
 * b's checkpoints cover every copy (their cl_since is b's first one). */
static void wait_copies_from_b_checkpoints(void)
{
    for (uint32_t k = 0; k < PARTITIONS; k++) {
        int64_t until = th_now_ms() + TIMEOUT_MS;
        while (td_fleet_owner(ids, 2, k) == 1 &&
               th_sh("grep -q \"partition %u's standby copy starts from its checkpoint (epoch "
                     "[0-9]*, generation [1-9]\" %s",
                     (unsigned)k, member[0].log_path) != 0) {
            if (th_now_ms() > until) {
                tf_dump_logs(&test_fleet);
                fail_msg("a's copy of partition %u never started from b's checkpoints",
                         (unsigned)k);
            }
            th_sleep_ms(50);
        }
    }
}

/* b killed right after a round (none of its writes in flight, its last records maybe not in a
 * checkpoint yet): a takes each of b's partitions from its copy, run on across b's
 * checkpoints, and replays at most what the takes from b's last checkpoints would have (the
 * records the copy had not received yet); the writes after the kill go to a. */
static void kill_b_take_from_copies(tally_client_t *c, int r)
{
    write_rounds(c, r, r + 1, -1);
    r++;
    uint64_t ckpt_tail = 0; /* what the takes from b's last checkpoints would replay */
    for (uint32_t k = 0; k < PARTITIONS; k++)
        if (td_fleet_owner(ids, 2, k) == 1)
            ckpt_tail += tf_changelog_last(tn_suite_js, k) - tf_manifest(k).cl_seq;
    long long replayed = th_metric(&member[0], "tallyd_nats_changelog_replayed_total");
    th_daemon_kill(&member[1]);
    write_rounds(c, r, r + 2, -1);
    long long tail = took_from_copies(c, "run on across checkpoints", replayed);
    print_message("a's takes from its copies replayed %lld changelog messages; from b's last "
                  "checkpoints they would have replayed %llu\n",
                  tail, (unsigned long long)ckpt_tail);
    assert_true(tail >= 0 && (uint64_t)tail <= ckpt_tail);
    for (uint32_t k = 0; k < PARTITIONS; k++) /* a's fence ended b's cl_since */
        if (td_fleet_owner(ids, 2, k) == 1)
            assert_int_equal(tf_manifest(k).cl_since_epoch, 0);
    show_takes(0);
}

static void test_runs_on_across_checkpoints(void **state)
{
    (void)state;
    start_pair("200"); /* b checkpoints every 200 ms under the writes */
    tally_client_t *c = tf_fleet_client(tn_suite.urls, TIMEOUT_MS);
    /* b's first checkpoint of each partition claims nothing (what its take loaded is no base):
     * a's copies start again from it; each later one says its changes are in the changelog */
    int r = write_until_checkpoints(c, 0, 2);
    wait_copies_from_b_checkpoints();
    long long kept = copies(0, "kept"), restarted = copies(0, "restarted");
    r = write_until_checkpoints(c, r, 3);
    wait_metric(0, "tallyd_nats_standby_checkpoints_total{copy=\"kept\"}",
                kept + tf_planned(&test_fleet, 1));
    assert_int_equal(copies(0, "restarted"), restarted);
    for (uint32_t k = 0; k < PARTITIONS; k++)
        if (td_fleet_owner(ids, 2, k) == 1)
            assert_int_not_equal(tf_manifest(k).cl_since_epoch, 0);
    print_message("a's copies: %lld new checkpoints run on across, %lld restarted from\n",
                  copies(0, "kept") - kept, copies(0, "restarted") - restarted);
    check_stale_answers();
    kill_b_take_from_copies(c, r);
    tally_client_destroy(&c);
}

/* ---- 4. JetStream ingest into a partition: its copy starts again ---------------------------- */

/* One hist (numbered seq) over JetStream ingest to stream `name`, applied; its effect added to
 * into[]. */
static void ingest_hist(const char *name, uint64_t seq, uint64_t *into)
{
    tally_nats_opts_t o = {.servers = tn_suite.urls, .timeout_ms = TIMEOUT_MS};
    tally_client_t *n = NULL;
    if (tally_client_new_nats(&o, &n, msg, sizeof msg) != TALLY_OK)
        fail_msg("tally_client_new_nats: %s", msg);
    uint8_t data[333];
    for (size_t j = 0; j < sizeof data; j++)
        data[j] = (uint8_t)(j * 37 + seq * 11);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    req.seq = seq;
    assert_int_equal(tally_send(n, &req, data, sizeof data, NULL), TALLY_OK);
    tf_recv_applied(n);
    tally_client_destroy(&n);
    tr_hist_parts(TALLY_DTYPE_U8, data, sizeof data, 0, 0, into, NULL, NULL);
}

static void test_ingest_restarts_copy(void **state)
{
    (void)state;
    char gate[64]; /* a's copies are held (TALLYD_TEST_STANDBY_HOLD) once this file exists */
    snprintf(gate, sizeof gate, "/tmp/tally-standby-hold-%d", (int)getpid());
    unlink(gate);
    setenv("TALLYD_TEST_STANDBY_HOLD", gate, 1);
    start_pair("200");
    unsetenv("TALLYD_TEST_STANDBY_HOLD");
    tally_client_t *c = tf_fleet_client(tn_suite.urls, TIMEOUT_MS);
    int r = write_until_checkpoints(c, 0, 2);
    wait_copies_from_b_checkpoints();
    long long restarted = copies(0, "restarted");
    /* a stream of one of b's partitions fed by JetStream ingest only */
    char name[32];
    for (int i = 0;; i++) {
        snprintf(name, sizeof name, "sb-ingest/%d", i);
        if (td_fleet_owner(ids, 2, tally_partition(name, strlen(name), PARTITIONS)) == 1)
            break;
    }
    static uint64_t ingest_model[256];
    memset(ingest_model, 0, sizeof ingest_model);
    ingest_hist(name, 1, ingest_model);
    /* b's next checkpoint of that partition claims no cl_since: a's copy starts again from it */
    r = write_until_checkpoints(c, r, 2);
    wait_metric(0, "tallyd_nats_standby_checkpoints_total{copy=\"restarted\"}", restarted + 1);
    /* a's copies held from now on; a second ingest: b's checkpoints after it no longer cover
     * that partition's copy, which the take must refuse (the others' still cover theirs) */
    FILE *fp = fopen(gate, "w");
    assert_non_null(fp);
    fclose(fp);
    ingest_hist(name, 2, ingest_model);
    r = write_until_checkpoints(c, r, 2);
    th_daemon_kill(&member[1]);
    write_rounds(c, r, r + 2, -1);
    tf_wait_held(&test_fleet, ids[0], PARTITIONS, TIMEOUT_MS);
    wait_metric(0, "tallyd_nats_partitions_taken_total", PARTITIONS);
    unlink(gate);
    tf_check_model(&test_fleet, c);
    char why[160];
    if (th_stream_differs(c, name, 2, ingest_model, why, sizeof why)) {
        tf_dump_logs(&test_fleet);
        fail_msg("%s", why);
    }
    assert_int_equal(log_lines(0, "nor one its cl_since covers"), 1);
    assert_int_equal(th_metric(&member[0], "tallyd_nats_takes_total{from=\"standby\"}"),
                     tf_planned(&test_fleet, 1) - 1);
    show_takes(0);
    tally_client_destroy(&c);
}

int main(void)
{
    if (tn_skip())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_catch_up_and_take, stop_members),
        cmocka_unit_test_teardown(test_copy_refused, stop_members),
        cmocka_unit_test_teardown(test_runs_on_across_checkpoints, stop_members),
        cmocka_unit_test_teardown(test_ingest_restarts_copy, stop_members),
    };
    const char *only = getenv("TALLY_TEST_FILTER"); /* one test by name (a mutation check) */
    if (only)
        cmocka_set_test_filter(only);
    return cmocka_run_group_tests(tests, setup, teardown);
}
