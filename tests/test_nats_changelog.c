/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_changelog.c — direct mode with replicated durability (`[nats] direct = replicated`;
 * PROTOCOL.md §13 "Direct mode", "Changelog"; issue 33's second step) against a real 3-node
 * NATS cluster (tests/lib/nats_cluster.c), the changelog streams TALLY_CL<k> with 3 replicas.
 * Checkpoints are an hour apart (but in tests 10 and 11), so that between a take and a give-up
 * only the changelog holds the direct writes:
 *   1. answered after the PubAck, in td_state_record's encoding: one member owns every
 *      partition; after each numbered hist's reply (one request in flight), the last message of
 *      its partition's changelog already holds the stream's record with that request's effect:
 *      parsed by td_state_record_parse, its last_seq the request's seq and its bins the model's
 *      (tests/lib/reference.c), with the writer's epoch, batch and member in its headers; info
 *      says nats_direct=replicated; after a clean stop the checkpoint manifest (version 2)
 *      names the changelog sequence it holds, and the changelog is purged whole (its last
 *      sequence kept); a changelog stream removed after that checkpoint is made anew at the
 *      next take, with a warning, and the checkpoint's state kept; another one removed before
 *      a give-up, the give-up's purge fails (said) and the checkpoint holds every write;
 *   1b. a stream written 16 times, commit_ms 1 s, the PubAcks held: the first write's record
 *      goes at once, alone (nothing of the partition in flight), the other 15 wait behind it,
 *      all in flight: fewer changelog messages than writes (two unless the box stalls), each
 *      with one record of the stream, the last one the model's after every write; every reply
 *      once it is stored; where they waited (tallyd_nats_changelog_stage_seconds): a batch, a
 *      publish and a PubAck counted per message stored, the first batch under 0.25 s and each
 *      other 1 s, a release per write, every sum past 0, no flight waited for; the family a
 *      histogram to Prometheus's parser (where installed);
 *   2. kill -9 of an owner under load: two members split the partitions (as the plan says); the
 *      fleet client keeps
 *      16 numbered requests in flight, and the owner of half of them is killed (SIGKILL) after
 *      some of a round's replies: every request ends answered (OK, or `duplicate` for a resend
 *      whose first try was stored), and every stream on the member left equals the model of all
 *      requests (last_seq too): each write the killed owner answered came back through its
 *      changelog (none of it was in a checkpoint), each one it did not answer was applied once.
 *   3. a record that cannot be stored (the partition's changelog stream removed under its
 *      owner): the write is answered not_durable and counted, the owner gives the partition up
 *      and takes it again, and writes are answered again;
 *  3b. a `duplicate` waits for its first try's record: with the PubAcks held, a resend of a
 *      write applied but not stored gets no reply for a second, then `duplicate` after the
 *      PubAck; a resend of a stored write is answered at once; a resend of a write whose record
 *      fails (its changelog stream removed) is answered not_durable, as the write is;
 *   4. group commit by bytes, deletes and resets: with commit_ms at 1 s (commit_when_idle off),
 *      1000 writes (rgba8, 512 in flight, all of one partition) are stored in far fewer
 *      changelog messages than writes (a partition's batch goes out at 256 KiB); a delete and a
 *      reset follow; the owner is killed, and the next one rebuilds every stream from the
 *      changelog alone (the deleted one unknown, the reset one empty), a late message of a's
 *      past 4 MiB among it (the whole history again: replayed in pieces of whole records), then
 *      takes writes and a delete;
 *   5. another writer's record between two of the owner's batches (a deposed owner's late
 *      publish): the owner's next publish is refused (its expected last sequence), the write
 *      answered not_durable, the partition taken again, and the write sent again applied once;
 *   6. changelog messages gone before a checkpoint held them (purged here, as an owner-less
 *      partition_max_age_s would): the next owner takes the partition from its checkpoint and
 *      what remains, logs the loss at error level and counts exactly the messages gone; the lost
 *      write, sent again with its seq, is applied;
 *  6b. a changelog removed and made again below its checkpoint's cl_seq (every changelog stream
 *      deleted after a clean stop): the owner that made them anew is killed after answered
 *      writes; the next owner applies the whole stream (said) and equals the model; its
 *      checkpoint names the new stream's sequence, and after writes past the old cl_seq and a
 *      kill -9 the next owner equals the model again;
 *   7. the engine's purge below a sequence across a replica restart (why tallyd purges a
 *      changelog only whole, at a quiet point: tests 10 and 11): on nats-server before 2.9.18
 *      (Debian's 2.9.10) the restarted replica replays it as a purge of everything the stream
 *      held then, and loses the records above the purge's sequence; a purge of everything at a
 *      quiet point loses nothing on any version;
 *   8. more records at once than a message holds (a server of its own with max_payload 64 KiB,
 *      the owner's commit_when_idle off): the batch goes out as several messages, each within
 * max_payload and of whole records, every write answered OK, and the next owner rebuilds every
 * stream from them; a stream whose window ring grows past a message has every write answered OK,
 * each record after its first carrying only the slot its write changed (kind 3), and the next owner
 *      rebuilds the whole ring from them;
 *   9. a writer racing the fence at a take: a previous owner's late batch stored between the
 *      new owner's reading of the changelog's end and its fence (TALLYD_TEST_FENCE_GATE holds
 *      the take there): the fence is refused, the late batch applied (its stream as it says),
 *      and the fence stored on the next try;
 *  10. compaction at a quiet point (checkpoints 200 ms apart): once the writes stop, each
 *      partition's checkpoint holds its whole changelog, which its owner purges whole (no
 *      message left, the last sequence and the checkpoint's cl_seq equal, counted in /metrics
 *      and info); a stale owner's record is still refused (wrong last sequence) and the owner's
 *      chain goes on; after kill -9 the next owner equals the model; records stored after the
 *      purge survive a restart of the changelog's leader (its raft log replays the purge);
 *  11. no purge past the checkpoint: a record stored between a checkpoint and its compaction's
 *      check (TALLYD_TEST_PURGE_GATE holds the compaction there) keeps the changelog; writes
 *      keep coming, 16 in flight, over many checkpoints; after kill -9 the next owner equals
 *      the model, nothing counted lost;
 *  12. messages in flight: with the PubAcks held (TALLYD_TEST_ACK_GATE), writes 20 ms apart
 *      (commit_ms 1: a message each) are stored up to four messages past the last one answered,
 *      no more; once the PubAcks go, every write is answered; then writes in flight across
 *      elections of the changelog's leader (stepped down twice) are all answered (sent again,
 *      in order, where no leader took them) and the stream equals its model, in the member and
 *      in the changelog's last record;
 * 12b. a record that replaces one a cut batch left waiting (a server of its own with max_payload
 *      64 KiB, window rings on the test clock, the PubAcks held): three messages in flight, a
 *      batch of other streams' records and then stream S's passes a message, its front goes out
 *      as the fourth and S's record waits in the rest, under the ticket of the part that went;
 *      S written an interval later replaces it (the guess made before the lock wrong): every
 *      write is answered OK once, the record stored holds S's ring slots of both intervals, and
 *      the next owner, from the changelog alone, has S's window of every interval;
 * 12c. a record past a message (the same server, the PubAcks held, the 4 messages in flight):
 *      stream S written in a new interval a write, its record grown to pass 60 KiB in the
 *      batch waiting, fails its partition at once, the size in the log, every write of the
 *      batch answered not_durable, and S unknown after the partition is taken again;
 * 12d. a batch on an idle partition goes at once (commit_when_idle), commit_ms 1 s: writes one
 *      at a time are each their own changelog message, each batch under 0.25 s; a write behind
 *      a message whose PubAck is held goes at that PubAck (nothing left in flight), its batch
 *      under 0.25 s too; after a batch of 8 writes, the next write waits commit_ms though
 *      nothing is in flight (a busy partition), and the one after it goes at once again; with
 *      commit_when_idle off, a write on an idle partition waits for commit_ms (its batch 1 s or
 *      more);
 *  13. a fleet that changes its mode member by member: direct writes answered by a replicated
 *      owner killed (SIGKILL) are applied by the next owner, an ingest worker (`direct = off`),
 *      which fences the changelog, takes writes over JetStream ingest and stops cleanly; the
 *      replicated member started again applies nothing of the changelog before that fence, and
 *      every stream equals the model at each step.
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
#include <time.h>

#include <cmocka.h>
#include <nats/nats.h>

#include "fleet_helpers.h"
#include "harness.h"
#include "nats_cluster.h"
#include "reference.h"
#include "tally.h"
#include "tally_fleet.h"
#include "td_fleet_plan.h"
#include "td_nats_ckpt.h"
#include "td_nats_js.h"
#include "td_state_record.h"

#define PARTITIONS 4
#define STREAMS 16
#define TIMEOUT_MS 60000

static char msg[512];
static th_daemon_t member[2];
static const char *const ids[2] = {"cl-a", "cl-b"};
static uint64_t model[STREAMS][256];
static uint64_t seqs[STREAMS];
static const tf_fleet_t test_fleet = {"cl", STREAMS, model, seqs, PARTITIONS, member, ids, 2};
/* The cluster the members and the fleet client use: the suite's, or test 8's own. */
static const char *cluster_urls, *cluster_replicas = "3";
/* Test 8: the test clock file of the members it starts, with window rings on (NULL: neither). */
static const char *member_clock;
/* The members' [nats] direct (test 13 starts one with another). */
static const char *member_direct = "replicated";
/* The members' [nats] commit_when_idle (tests 8 and 12d start one with it off). */
static const char *member_when_idle = "on";

static int setup(void **state)
{
    (void)state;
    return tn_suite_setup(3);
}

static int stop_members(void **state)
{
    (void)state;
    tf_members_end(&test_fleet);
    member_when_idle = "on"; /* a failed test's start_commit_only may have left it off */
    return 0;
}

static int teardown(void **state)
{
    stop_members(state);
    return tn_suite_teardown();
}

/* Member i with lease TTL ttl_ms (a failover waits for it; a clean stop must finish within it,
 * or a partition whose lease ran out is not checkpointed: on a loaded box, a long one) and
 * checkpoints ckpt_ms apart. */
static void start_with(int i, const char *ttl_ms, const char *commit_ms, const char *ckpt_ms)
{
    const char *args[] = {"--nats-servers",
                          cluster_urls ? cluster_urls : tn_suite.urls,
                          "--nats-replicas",
                          cluster_replicas,
                          "--nats-partitions",
                          "4",
                          "--nats-lease-ttl-ms",
                          ttl_ms,
                          "--nats-checkpoint-interval-ms",
                          ckpt_ms,
                          "--nats-member-id",
                          ids[i],
                          "--nats-direct",
                          member_direct,
                          "--nats-commit-ms",
                          commit_ms,
                          "--nats-commit-when-idle",
                          member_when_idle,
                          "--max-inflight", /* test 4's 512 in flight: held replies count */
                          "1024",
                          "--stream-create-rate", /* test 4's 1000 new streams at once */
                          "100000",
                          "--metrics",
                          "127.0.0.1:0",
                          member_clock ? "--test-clock" : NULL, /* the list ends here without */
                          member_clock,
                          "--window-intervals",
                          "64",
                          "--window-interval-ms",
                          "1000",
                          NULL};
    assert_int_equal(th_daemon_start(&member[i], args), 0);
}

/* Checkpoints an hour apart: between a take and a give-up only the changelog holds the writes. */
static void start_commit(int i, const char *ttl_ms, const char *commit_ms)
{
    start_with(i, ttl_ms, commit_ms, "3600000");
}

/* Member i with commit_when_idle off: its batches go at commit_ms or at their bytes only. */
static void start_commit_only(int i, const char *ttl_ms, const char *commit_ms)
{
    member_when_idle = "off";
    start_commit(i, ttl_ms, commit_ms);
    member_when_idle = "on";
}

static void start(int i, const char *ttl_ms)
{
    start_commit(i, ttl_ms, "2");
}

/* Waits until member i has taken `count` partitions or more, since it started (loaded,
 * replayed, fenced: not only leased). */
static void wait_taken(int i, long long count)
{
    int64_t until = th_now_ms() + TIMEOUT_MS;
    while (th_metric(&member[i], "tallyd_nats_partitions_taken_total") < count &&
           th_now_ms() < until)
        th_sleep_ms(50);
    assert_true(th_metric(&member[i], "tallyd_nats_partitions_taken_total") >= count);
}

/* Round r of every stream, one write in flight (so one record per changelog message). */
static void write_round(tally_client_t *c, int r)
{
    for (int s = 0; s < STREAMS; s++) {
        tf_send_hist(&test_fleet, c, s, r);
        tf_recv_applied(c);
    }
}

/* A fleet client of the members' cluster. */
static tally_client_t *fleet_client(void)
{
    return tf_fleet_client(cluster_urls ? cluster_urls : tn_suite.urls, TIMEOUT_MS);
}

/* Member i, started, takes every partition and equals the model, nothing counted lost (a fleet
 * client of its own: none waits for a member gone). */
static void check_taken_model(int i)
{
    wait_taken(i, PARTITIONS);
    tally_client_t *c = fleet_client();
    tf_check_model(&test_fleet, c);
    tally_client_destroy(&c);
    assert_int_equal(th_metric(&member[i], "tallyd_nats_changelog_lost_total"), 0);
}

static const char *info_value(const th_daemon_t *d, const char *key, char *out, size_t cap)
{
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(d->endpoint, TIMEOUT_MS, &c), TALLY_OK);
    tally_info_t *info = NULL;
    assert_int_equal(tally_info_fetch(c, &info), TALLY_OK);
    const char *v = tally_info_lookup(info, key);
    assert_non_null(v);
    snprintf(out, cap, "%s", v);
    tally_info_destroy(&info);
    tally_client_destroy(&c);
    return out;
}

/* Stream `name`'s first sequence and message count, as its leader has them. */
static void stream_state(const char *name, uint64_t *first, uint64_t *msgs)
{
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    assert_int_equal(js_GetStreamInfo(&si, tn_suite_js, name, NULL, &jerr), NATS_OK);
    *first = si->State.FirstSeq;
    *msgs = si->State.Msgs;
    jsStreamInfo_Destroy(si);
}

static uint64_t changelog_last(uint32_t k)
{
    return tf_changelog_last(tn_suite_js, k);
}

/* Partition k's changelog, as its leader has it: *first and *msgs. */
static void changelog_state(uint32_t k, uint64_t *first, uint64_t *msgs)
{
    char cl[32];
    tally_fleet_name(cl, sizeof cl, TALLY_NATS_CL_STREAM_PREFIX, k);
    stream_state(cl, first, msgs);
}

/* Partition k's changelog stream removed (an operator's mistake). */
static void remove_changelog(uint32_t k)
{
    char cl[32];
    jsErrCode jerr = 0;
    tally_fleet_name(cl, sizeof cl, TALLY_NATS_CL_STREAM_PREFIX, k);
    assert_int_equal(js_DeleteStream(tn_suite_js, cl, NULL, &jerr), NATS_OK);
}

/* A gate for a member's TALLYD_TEST_*_GATE: the path of a file, not there yet, in a fresh
 * folder (dir), into gate. */
static void gate_at(char *dir, size_t dir_cap, char *gate, size_t gate_cap)
{
    assert_int_equal(th_tmpdir(dir, dir_cap, "tally-gate"), 0);
    snprintf(gate, gate_cap, "%s/open", dir);
}

/* Opens the gate: its file exists. */
static void gate_open(const char *gate)
{
    FILE *f = fopen(gate, "w");
    assert_non_null(f);
    fclose(f);
}

/* A fresh fleet and member a with commit_ms, its PubAcks held by a gate (TALLYD_TEST_ACK_GATE,
 * gate_at's dir and gate) open until the test removes it; every partition taken. */
static void start_ack_gated(char *dir, size_t dir_cap, char *gate, size_t gate_cap,
                            const char *commit_ms)
{
    tf_fresh(&test_fleet);
    gate_at(dir, dir_cap, gate, gate_cap);
    gate_open(gate);
    setenv("TALLYD_TEST_ACK_GATE", gate, 1);
    start_commit(0, "15000", commit_ms);
    unsetenv("TALLYD_TEST_ACK_GATE");
    wait_taken(0, PARTITIONS); /* each partition's fence stored */
}

/* A client over NATS (tally_client_new_nats): JetStream ingest, queries by request-reply. */
static tally_client_t *nats_client(void)
{
    tally_nats_opts_t o = {.servers = tn_suite.urls, .timeout_ms = TIMEOUT_MS};
    tally_client_t *c = NULL;
    tally_status_t st = tally_client_new_nats(&o, &c, msg, sizeof msg);
    if (st != TALLY_OK)
        fail_msg("tally_client_new_nats: %s: %s", tally_status_name(st), msg);
    return c;
}

/* ---- 1. answered after the PubAck; the record's format --------------------------------------- */

/* The record that starts at p (len bytes left in its message), parsed into rec; its size. Every
 * byte of a changelog message is a whole record. */
static size_t parse_record(const uint8_t *p, size_t len, td_state_record_t *rec)
{
    size_t size = td_state_record_check(p, len);
    assert_true(size > 0);
    char why[160];
    if (!td_state_record_parse(p, size, rec, why, sizeof why))
        fail_msg("a changelog record: %s", why);
    return size;
}

/* The latest changelog message of stream s's partition that holds a record of s holds one,
 * equal to the model, written by member a under its lease. It is the partition's last message,
 * or one of the few before it when the partition's other streams were written after s and their
 * records went out in a message of their own (a group commit's tick between two writes). */
static void check_last_record(int s)
{
    static td_state_record_t rec;
    char stream[32], name[32];
    tally_fleet_name(stream, sizeof stream, TALLY_NATS_CL_STREAM_PREFIX,
                     tf_partition_of(&test_fleet, s));
    tf_stream_name(&test_fleet, s, name, sizeof name);
    uint64_t last = changelog_last(tf_partition_of(&test_fleet, s));
    size_t found = 0;
    for (uint64_t seq = last; seq > 0 && last - seq < 64 && !found; seq--) {
        natsMsg *m = NULL;
        jsErrCode jerr = 0;
        assert_int_equal(js_GetMsg(&m, tn_suite_js, stream, seq, NULL, &jerr), NATS_OK);
        const uint8_t *p = (const uint8_t *)natsMsg_GetData(m);
        size_t len = (size_t)natsMsg_GetDataLength(m);
        for (size_t at = 0; at < len;) {
            size_t size = parse_record(p + at, len - at, &rec);
            if (rec.name_len == strlen(name) && memcmp(rec.name, name, rec.name_len) == 0) {
                assert_true(rec.kind == TD_STATE_RECORD_STREAM ||
                            rec.kind == TD_STATE_RECORD_CHANGED);
                assert_int_equal(rec.info.last_seq, seqs[s]);
                assert_memory_equal(rec.info.bins, model[s], sizeof model[s]);
                found++;
            }
            at += size;
        }
        if (found) {
            const char *v = NULL;
            assert_int_equal(natsMsgHeader_Get(m, TALLY_NATS_HDR_MEMBER, &v), NATS_OK);
            assert_string_equal(v, ids[0]);
            assert_int_equal(natsMsgHeader_Get(m, TALLY_NATS_HDR_EPOCH, &v), NATS_OK);
            assert_true(strtoull(v, NULL, 10) > 0);
            assert_int_equal(natsMsgHeader_Get(m, TALLY_NATS_HDR_BATCH, &v), NATS_OK);
            assert_true(strtoull(v, NULL, 10) > 0); /* a batch of records, not a fence */
        }
        natsMsg_Destroy(m);
    }
    assert_int_equal(found, 1);
}

static int64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void test_answered_after_ack(void **state)
{
    (void)state;
    tf_fresh(&test_fleet);
    start(0, "15000");
    tf_wait_held(&test_fleet, ids[0], PARTITIONS, TIMEOUT_MS);
    char v[64];
    assert_string_equal(info_value(&member[0], "nats_direct", v, sizeof v), "replicated");
    tally_client_t *c = fleet_client();
    int64_t waited_us = 0; /* a round trip's time, shown (not asserted) */
    for (int r = 0; r < 3; r++)
        for (int s = 0; s < STREAMS; s++) {
            int64_t t0 = now_us();
            tf_send_hist(&test_fleet, c, s, r);
            tf_recv_applied(c);
            waited_us += now_us() - t0;
            check_last_record(s); /* stored before the reply left */
        }
    print_message("a replicated write's round trip, one in flight: %lld us on average\n",
                  (long long)(waited_us / (3 * STREAMS)));
    assert_true(th_metric(&member[0], "tallyd_nats_changelog_commits_total") >= 3 * STREAMS);
    assert_int_equal(th_metric(&member[0], "tallyd_nats_not_durable_total"), 0);
    tf_check_model(&test_fleet, c);
    tally_client_destroy(&c);
    /* A clean stop checkpoints each partition with the changelog sequence its state holds. */
    assert_int_equal(th_daemon_stop(&member[0], SIGTERM, TIMEOUT_MS), 0);
    member[0].pid = 0;
    for (uint32_t k = 0; k < PARTITIONS; k++) {
        td_ckpt_manifest_t m = tf_manifest(k);
        if (m.cl_seq == 0) {
            tf_dump_logs(&test_fleet);
            fail_msg("partition %u's checkpoint names no changelog sequence", (unsigned)k);
        }
        /* The give-up's checkpoint holds the whole changelog, nothing follows it: purged whole,
         * its last sequence (the fence's) kept (test 10 says more). */
        char cl[32];
        uint64_t first = 0, msgs = 0;
        tally_fleet_name(cl, sizeof cl, TALLY_NATS_CL_STREAM_PREFIX, k);
        stream_state(cl, &first, &msgs);
        assert_int_equal(msgs, 0);
        assert_int_equal(first, m.cl_seq + 1); /* an empty stream's first: its last + 1 */
    }
    /* A changelog stream removed after the checkpoint that holds it (an operator's mistake):
     * the next take makes it anew, warns that it ends before the checkpoint, and keeps the
     * checkpoint's state. */
    remove_changelog(tf_partition_of(&test_fleet, 0));
    start(0, "15000");
    tf_wait_held(&test_fleet, ids[0], PARTITIONS, TIMEOUT_MS);
    c = fleet_client();
    tf_check_model(&test_fleet, c);
    /* Another partition's changelog removed before the give-up's checkpoint: the purge that
     * follows it fails, said, and the partition is given up all the same (its checkpoint
     * stored). */
    write_round(c, 3);
    tally_client_destroy(&c);
    uint32_t other = (tf_partition_of(&test_fleet, 0) + 1) % PARTITIONS;
    remove_changelog(other);
    assert_int_equal(th_daemon_stop(&member[0], SIGTERM, TIMEOUT_MS), 0);
    member[0].pid = 0;
    assert_int_equal(th_sh("grep -q 'ends at .*before its checkpoint' %s", member[0].log_path), 0);
    assert_int_equal(th_sh("grep -q 'partition %u.s changelog: a purge at a quiet point failed' %s",
                           (unsigned)other, member[0].log_path),
                     0);
    start(0, "15000");
    tf_wait_held(&test_fleet, ids[0], PARTITIONS, TIMEOUT_MS);
    c = fleet_client();
    tf_check_model(&test_fleet, c);
    tally_client_destroy(&c);
    assert_int_equal(th_daemon_stop(&member[0], SIGTERM, TIMEOUT_MS), 0);
    member[0].pid = 0;
}

/* ---- 1b. a stream written several times before its batch goes out: one record ------------------
 */

#define REWRITES 16

/* The records of stream s in message seq of partition k's changelog. */
static int records_of(uint32_t k, uint64_t seq, int s)
{
    char stream[32], name[32];
    tally_fleet_name(stream, sizeof stream, TALLY_NATS_CL_STREAM_PREFIX, k);
    tf_stream_name(&test_fleet, s, name, sizeof name);
    natsMsg *m = NULL;
    jsErrCode jerr = 0;
    assert_int_equal(js_GetMsg(&m, tn_suite_js, stream, seq, NULL, &jerr), NATS_OK);
    const uint8_t *p = (const uint8_t *)natsMsg_GetData(m);
    size_t len = (size_t)natsMsg_GetDataLength(m);
    int found = 0;
    for (size_t at = 0, size; at < len; at += size) {
        size = td_state_record_check(p + at, len - at);
        assert_true(size > 0);
        found += p[at + 13] == strlen(name) &&
                 memcmp(p + at + TD_STATE_RECORD_NAME_OFF, name, strlen(name)) == 0;
    }
    natsMsg_Destroy(m);
    return found;
}

/* A sample of the member's /metrics, with its labels ("NAME{...}"), as a number; -1 if absent. */
static double metric_of(const th_daemon_t *d, const char *name)
{
    int port = th_metrics_port(d);
    char *body = port > 0 ? th_http_get(port, "GET", "/metrics", NULL) : NULL;
    double v = -1;
    size_t n = strlen(name);
    for (const char *at = body; at && (at = strstr(at, name)) != NULL; at += n)
        if ((at == body || at[-1] == '\n') && at[n] == ' ') {
            v = strtod(at + n + 1, NULL);
            break;
        }
    free(body);
    return v;
}

static double stage_metric(const char *what, const char *stage)
{
    char name[128];
    snprintf(name, sizeof name, "tallyd_nats_changelog_stage_seconds_%s{stage=\"%s\"}", what,
             stage);
    return metric_of(&member[0], name);
}

/* Member 0's changelog batches published within 0.25 s of their first record (the bucket below
 * commit_ms 1 s): those that went at once, their partition with nothing in flight. */
static long long quick_batches(void)
{
    return th_metric(&member[0],
                     "tallyd_nats_changelog_stage_seconds_bucket{stage=\"batch\",le=\"0.25\"}");
}

/* Where member 0's held writes waited: msgs changelog messages (batch, publish, ack), writes
 * writes (release); at_once of the batches went at once (under 0.25 s), every other one at
 * commit_ms 1 s or later; the exposition parsed by Prometheus's parser where python3 has it. */
static void check_stages(long long msgs, int writes, long long at_once)
{
    static const char *const per_message[] = {"batch", "publish", "ack"};
    for (int i = 0; i < 3; i++) {
        assert_int_equal((long long)stage_metric("count", per_message[i]), msgs);
        assert_true(stage_metric("sum", per_message[i]) > 0);
    }
    assert_int_equal((long long)stage_metric("count", "release"), writes);
    assert_true(stage_metric("sum", "release") > 0);
    assert_true(stage_metric("sum", "batch") >= 0.99 * (double)(msgs - at_once));
    assert_int_equal(quick_batches(), at_once);
    assert_int_equal(th_metric(&member[0], "tallyd_nats_changelog_flights_full_total"), 0);
    /* The first python3 with prometheus_client: PATH's may be another than Debian's. */
    int rc = th_sh("py=$(for c in python3 /usr/bin/python3; do $c -c 'import prometheus_client' "
                   "2>/dev/null && echo $c && break; done); [ -n \"$py\" ] || exit 77; curl -sf "
                   "http://127.0.0.1:%d/metrics | $py -c 'import sys\n"
                   "from prometheus_client.parser import text_string_to_metric_families as p\n"
                   "f = {m.name: m.type for m in p(sys.stdin.read())}\n"
                   "sys.exit(f.get(\"tallyd_nats_changelog_stage_seconds\") != \"histogram\" or "
                   "f.get(\"tallyd_nats_changelog_flights_full\") != \"counter\")'",
                   th_metrics_port(&member[0]));
    if (rc == 77)
        print_message("no prometheus_client: the exposition is not parsed\n");
    else
        assert_int_equal(rc, 0);
}

/* Waits until partition k's changelog holds a message at seq or later. */
static void wait_changelog(uint32_t k, uint64_t seq)
{
    int64_t until = th_now_ms() + TIMEOUT_MS;
    while (changelog_last(k) < seq && th_now_ms() < until)
        th_sleep_ms(5);
    assert_true(changelog_last(k) >= seq);
}

/* The last_seq of stream s's record in partition k's last changelog message (0: none in it). */
static uint64_t last_message_seq_of(uint32_t k, int s)
{
    static td_state_record_t rec;
    char stream[32], name[32];
    tally_fleet_name(stream, sizeof stream, TALLY_NATS_CL_STREAM_PREFIX, k);
    tf_stream_name(&test_fleet, s, name, sizeof name);
    natsMsg *m = NULL;
    jsErrCode jerr = 0;
    assert_int_equal(js_GetMsg(&m, tn_suite_js, stream, changelog_last(k), NULL, &jerr), NATS_OK);
    const uint8_t *p = (const uint8_t *)natsMsg_GetData(m);
    size_t len = (size_t)natsMsg_GetDataLength(m);
    uint64_t seq = 0;
    for (size_t at = 0; at < len;) {
        at += parse_record(p + at, len - at, &rec);
        if (rec.name_len == strlen(name) && memcmp(rec.name, name, rec.name_len) == 0)
            seq = rec.info.last_seq;
    }
    natsMsg_Destroy(m);
    return seq;
}

/* REWRITES numbered writes of one stream, commit_ms 1 s, the PubAcks held (TALLYD_TEST_ACK_GATE)
 * from the first write on. The first goes at once, alone (nothing of its partition in flight);
 * the other REWRITES - 1, sent once it is stored, are in flight at once behind it and wait for
 * commit_ms: one message (more only if the box stalls past the second). The gate opens once the
 * last write's record is stored. The messages hold one record of the stream each, the last one
 * equal to the model after all of them; every reply comes once it is stored; the stages count
 * them (check_stages: one batch at once, the others at commit_ms). Before commit_when_idle, no
 * write went before commit_ms and the writes were sent together: one message. */
static void test_one_record_a_stream_a_batch(void **state)
{
    (void)state;
    char dir[256], gate[300];
    start_ack_gated(dir, sizeof dir, gate, sizeof gate, "1000");
    uint32_t k = tf_partition_of(&test_fleet, 0);
    uint64_t before = changelog_last(k);
    tally_client_t *c = fleet_client();
    assert_int_equal(unlink(gate), 0); /* the PubAcks held from here */
    tf_send_hist(&test_fleet, c, 0, 0);
    wait_changelog(k, before + 1); /* in flight: the others wait behind it */
    for (int r = 1; r < REWRITES; r++)
        tf_send_hist(&test_fleet, c, 0, r);
    int64_t until = th_now_ms() + TIMEOUT_MS;
    while (last_message_seq_of(k, 0) != seqs[0] && th_now_ms() < until)
        th_sleep_ms(5);
    gate_open(gate);
    assert_int_equal(last_message_seq_of(k, 0), seqs[0]);
    for (int r = 0; r < REWRITES; r++)
        tf_recv_applied(c);
    uint64_t last = changelog_last(k);
    print_message("%d writes of one stream in %llu changelog messages\n", REWRITES,
                  (unsigned long long)(last - before));
    assert_true(last > before + 1 && last - before < REWRITES);
    for (uint64_t seq = before + 1; seq <= last; seq++)
        assert_int_equal(records_of(k, seq, 0), 1);
    check_stages((long long)(last - before), REWRITES, 1);
    check_last_record(0); /* the model after all of them */
    tf_check_stream(&test_fleet, c, 0);
    tally_client_destroy(&c);
    th_rmrf(dir);
}

/* ---- 2. kill -9 of an owner under load --------------------------------------------------------
 */

#define ROUNDS 6

static void test_kill_owner_under_load(void **state)
{
    (void)state;
    tf_fresh(&test_fleet);
    start(0, "3000");
    start(1, "3000");
    assert_true(tf_planned(&test_fleet, 1) > 0); /* b has partitions to lose */
    tf_wait_held(&test_fleet, ids[0], tf_planned(&test_fleet, 0), TIMEOUT_MS);
    tf_wait_held(&test_fleet, ids[1], tf_planned(&test_fleet, 1), TIMEOUT_MS);
    tally_client_t *c = fleet_client();
    for (int r = 0; r < ROUNDS; r++) {
        for (int s = 0; s < STREAMS; s++)
            tf_send_hist(&test_fleet, c, s, r);
        for (int i = 0; i < STREAMS; i++) {
            tf_recv_applied(c);
            if (r == 2 && i == STREAMS / 2) { /* b has answered writes no checkpoint holds */
                assert_true(th_metric(&member[1], "tallyd_nats_changelog_commits_total") > 0);
                th_daemon_kill(&member[1]);
            }
        }
    }
    tf_wait_held(&test_fleet, ids[0], PARTITIONS, TIMEOUT_MS);
    tf_check_model(&test_fleet,
                   c); /* every answered write survived; every other one applied once */
    assert_true(th_metric(&member[0], "tallyd_nats_changelog_replayed_total") > 0);
    tally_client_destroy(&c);
    assert_int_equal(th_daemon_stop(&member[0], SIGTERM, TIMEOUT_MS), 0);
    member[0].pid = 0;
}

/* One request and its reply (tally_run would number a numbered one's chunks itself): the
 * status, and the reply's error into why. */
static tally_status_t call_numbered(tally_client_t *c, const tally_req_t *req, const void *data,
                                    size_t len, char *why, size_t cap)
{
    tally_status_t st = tally_send(c, req, data, len, NULL);
    if (st != TALLY_OK)
        return st;
    tally_reply_t r;
    tally_reply_init(&r);
    st = tally_recv(c, &r);
    snprintf(why, cap, "%s", r.error);
    tally_reply_clear(&r);
    return st;
}

/* The request sent until its partition is owned and its write stored again (after a give-up:
 * not_owner, then not_durable until the take is done): answered OK in the end. */
static void call_until_stored(tally_client_t *c, const tally_req_t *req, const void *data,
                              size_t len)
{
    char why[TALLY_ERROR_MESSAGE_MAX + 1];
    tally_status_t st;
    int64_t until = th_now_ms() + TIMEOUT_MS;
    while (((st = call_numbered(c, req, data, len, why, sizeof why)) == TALLY_E_NOT_OWNER ||
            st == TALLY_E_NOT_DURABLE) &&
           th_now_ms() < until)
        th_sleep_ms(100);
    if (st != TALLY_OK)
        tf_dump_logs(&test_fleet);
    assert_int_equal(st, TALLY_OK);
}

/* ---- 3. a record that cannot be stored ---------------------------------------------------- */

/* The changelog stream of a partition removed under its owner: the next write on it is run but
 * answered not_durable (counted), the owner gives the partition up, takes it again (the stream
 * made anew), and takes writes again. */
static void test_not_stored_not_durable(void **state)
{
    (void)state;
    tf_fresh(&test_fleet);
    start(0, "15000");
    tf_wait_held(&test_fleet, ids[0], PARTITIONS, TIMEOUT_MS);
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(member[0].endpoint, TIMEOUT_MS, &c), TALLY_OK);
    uint8_t data[16] = {1, 2, 3};
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, "cl/0"), TALLY_OK);
    tally_buf_t out = {0};
    assert_int_equal(tally_run(c, &req, data, sizeof data, NULL, &out, NULL), TALLY_OK);
    remove_changelog(tf_partition_of(&test_fleet, 0));
    wait_taken(0, PARTITIONS); /* every take done, not only its lease held */
    assert_int_equal(tally_run(c, &req, data, sizeof data, NULL, &out, NULL), TALLY_E_NOT_DURABLE);
    assert_non_null(strstr(tally_client_error(c), "was not stored"));
    assert_int_equal(th_metric(&member[0], "tallyd_nats_not_durable_total"), 1);
    wait_taken(0, PARTITIONS + 1); /* dropped, then taken again after a back-off */
    call_until_stored(c, &req, data, sizeof data);
    tally_buf_free(&out);
    tally_client_destroy(&c);
    assert_int_equal(th_daemon_stop(&member[0], SIGTERM, TIMEOUT_MS), 0);
    member[0].pid = 0;
}

/* ---- 3b. a duplicate waits for its first try's record -------------------------------------- */

/* A numbered hist of stream `name` with seq, sent on c (its reply not awaited). */
static void send_seq(tally_client_t *c, const char *name, uint64_t seq)
{
    static const uint8_t data[16] = {1, 2, 3};
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    req.seq = seq;
    assert_int_equal(tally_send(c, &req, data, sizeof data, NULL), TALLY_OK);
}

/* The status of c's next reply, waited for up to TIMEOUT_MS (c's timeout a try). */
static tally_status_t next_status(tally_client_t *c)
{
    tally_reply_t r;
    tally_reply_init(&r);
    tally_status_t st;
    int64_t until = th_now_ms() + TIMEOUT_MS;
    while ((st = tally_recv(c, &r)) == TALLY_E_TIMEOUT && th_now_ms() < until)
        ;
    tally_reply_clear(&r);
    return st;
}

/* With the PubAcks held (TALLYD_TEST_ACK_GATE), a resend of a write applied but not yet stored is
 * answered `duplicate` only once the write's record is stored: none within a second (dup's
 * timeout), then after the PubAck, with the write's OK. A resend of a stored write is answered at
 * once (held, it would wait for a PubAck that never comes). A resend of a write whose record
 * fails (its changelog stream removed) is answered not_durable, as the write is. */
static void test_duplicate_waits_for_record(void **state)
{
    (void)state;
    char dir[256], gate[300], name[32];
    start_ack_gated(dir, sizeof dir, gate, sizeof gate, "2");
    uint32_t k = tf_partition_of(&test_fleet, 0);
    tf_stream_name(&test_fleet, 0, name, sizeof name);
    tally_client_t *c = NULL, *dup = NULL;
    assert_int_equal(tally_client_new(member[0].endpoint, TIMEOUT_MS, &c), TALLY_OK);
    assert_int_equal(tally_client_new(member[0].endpoint, 1000, &dup), TALLY_OK);
    int64_t until = th_now_ms() + TIMEOUT_MS;
    while (tally_client_wait_connected(dup) == TALLY_E_TIMEOUT && th_now_ms() < until)
        ;
    send_seq(c, name, 1);
    assert_int_equal(next_status(c), TALLY_OK);
    send_seq(dup, name, 1);
    assert_int_equal(next_status(dup), TALLY_E_DUPLICATE);
    /* seq 2 applied, its record published, its PubAck held. */
    uint64_t before = changelog_last(k);
    assert_int_equal(unlink(gate), 0);
    send_seq(c, name, 2);
    wait_changelog(k, before + 1);
    send_seq(dup, name, 2);
    tally_reply_t r;
    tally_reply_init(&r);
    assert_int_equal(tally_recv(dup, &r), TALLY_E_TIMEOUT);
    gate_open(gate);
    assert_int_equal(next_status(c), TALLY_OK);
    assert_int_equal(next_status(dup), TALLY_E_DUPLICATE);
    /* seq 3's record not stored: its resend is not answered as applied. */
    assert_int_equal(unlink(gate), 0);
    remove_changelog(k);
    send_seq(c, name, 3);
    send_seq(dup, name, 3);
    assert_int_equal(tally_recv(dup, &r), TALLY_E_TIMEOUT);
    gate_open(gate);
    assert_int_equal(next_status(c), TALLY_E_NOT_DURABLE);
    assert_int_equal(next_status(dup), TALLY_E_NOT_DURABLE);
    tally_reply_clear(&r);
    tally_client_destroy(&dup);
    tally_client_destroy(&c);
    th_rmrf(dir);
}

/* ---- 5. another writer's record: the fence ----------------------------------------------------
 */

/* A record stored in partition k's changelog by someone else (a deposed owner's late publish,
 * here the test's own, empty and unsigned) between two of the owner's batches: the owner's next
 * publish expects its own last sequence and is refused, so that write is answered not_durable,
 * the partition given up and taken again (the foreign record replayed: it holds nothing), and
 * writes are answered again with their effect kept. */
static void test_other_writer_fenced(void **state)
{
    (void)state;
    tf_fresh(&test_fleet);
    start(0, "15000");
    tf_wait_held(&test_fleet, ids[0], PARTITIONS, TIMEOUT_MS);
    wait_taken(0, PARTITIONS);
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(member[0].endpoint, TIMEOUT_MS, &c), TALLY_OK);
    uint8_t data[16] = {1, 2, 3};
    uint64_t bins[256] = {0};
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, "cl/0"), TALLY_OK);
    char why[TALLY_ERROR_MESSAGE_MAX + 1];
    req.seq = 1;
    assert_int_equal(call_numbered(c, &req, data, sizeof data, why, sizeof why), TALLY_OK);
    tr_hist_parts(TALLY_DTYPE_U8, data, sizeof data, 0, 0, bins, NULL, NULL);
    char subject[32];
    tally_fleet_name(subject, sizeof subject, TALLY_NATS_SUBJ_CL, tf_partition_of(&test_fleet, 0));
    jsErrCode jerr = 0;
    assert_int_equal(js_Publish(NULL, tn_suite_js, subject, "", 0, NULL, &jerr), NATS_OK);
    req.seq = 2;
    assert_int_equal(call_numbered(c, &req, data, sizeof data, why, sizeof why),
                     TALLY_E_NOT_DURABLE);
    assert_non_null(strstr(why, "was not stored"));
    assert_int_equal(th_metric(&member[0], "tallyd_nats_not_durable_total"), 1);
    wait_taken(0, PARTITIONS + 1); /* dropped, then taken again after a back-off */
    /* seq 2 again: its first try ran but was not stored, and the state came back from the
     * changelog without it, so it applies now (once). */
    call_until_stored(c, &req, data, sizeof data);
    tr_hist_parts(TALLY_DTYPE_U8, data, sizeof data, 0, 0, bins, NULL, NULL);
    tally_stream_info_t info;
    assert_int_equal(tally_query(c, "cl/0", &info), TALLY_OK);
    if (info.last_seq != 2) {
        tf_dump_logs(&test_fleet);
        fail_msg("cl/0: last_seq %llu, %llu batches, %llu elements",
                 (unsigned long long)info.last_seq, (unsigned long long)info.batches,
                 (unsigned long long)info.hist_total);
    }
    assert_memory_equal(info.bins, bins, sizeof bins);
    tally_client_destroy(&c);
    assert_int_equal(th_daemon_stop(&member[0], SIGTERM, TIMEOUT_MS), 0);
    member[0].pid = 0;
}

/* ---- 4. group commit by bytes; deletes and resets through the changelog ---------------------- */

#define MANY 1000  /* streams, all of partition 0 */
#define WINDOW 512 /* requests in flight: below tallyd's reply queue per peer (SNDHWM) */
#define PIXELS 256 /* rgba8: every value of every channel once, so a record's 1024 bins are dense  \
                    */

static char many_names[MANY][32];
static uint64_t many_model[MANY][4 * 256];

/* The first n names `prefix` and a number from `from` on that are of partition 0, into names. */
static void partition0_names(char (*names)[32], int n, const char *prefix, int from)
{
    for (int i = from, picked = 0; picked < n; i++) {
        snprintf(names[picked], sizeof names[picked], "%s%d", prefix, i);
        if (tally_partition(names[picked], strlen(names[picked]), PARTITIONS) == 0)
            picked++;
    }
}

/* MANY stream names of partition 0, so that its batch fills up: ~1.1 KiB records, WINDOW of
 * them held at once, over TD_NATS_COMMIT_BYTES (256 KiB) long before commit_ms (1 s) */
static void many_pick(void)
{
    partition0_names(many_names, MANY, "gc/", 0);
}

static tally_status_t many_send(tally_client_t *c, int s, uint64_t seq)
{
    uint8_t data[4 * PIXELS];
    for (size_t j = 0; j < sizeof data; j++) /* channel j % 4 of pixel j / 4: a permutation */
        data[j] = (uint8_t)((j / 4) * 5 + (size_t)s + seq + (j % 4));
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_RGBA8, 0);
    assert_int_equal(tally_req_set_stream(&req, many_names[s]), TALLY_OK);
    req.seq = seq;
    tr_hist_parts(TALLY_DTYPE_RGBA8, data, PIXELS, 0, 0, many_model[s], NULL, NULL);
    return tally_send(c, &req, data, sizeof data, NULL);
}

/* Streams from..MANY-1, one numbered hist each (seq), WINDOW in flight; all answered once
 * stored, in far fewer changelog messages than writes. */
static void many_writes(tally_client_t *c, const th_daemon_t *d, int from, uint64_t seq)
{
    long long before = th_metric(d, "tallyd_nats_changelog_commits_total");
    int sent = from, got = from;
    while (got < MANY) {
        while (sent < MANY && sent - got < WINDOW) {
            tally_status_t st = many_send(c, sent, seq);
            if (st != TALLY_OK)
                fail_msg("send to %s: %s: %s", many_names[sent], tally_status_name(st),
                         tally_client_error(c));
            sent++;
        }
        tally_reply_t r;
        tally_reply_init(&r);
        tally_status_t st = tally_recv(c, &r);
        if (st != TALLY_OK && st != TALLY_E_DUPLICATE) { /* what the member saw, for the report */
            th_sh("curl -s http://127.0.0.1:%d/metrics | grep -E '^tallyd_(requests_total|shard_"
                  "requests|requests_in_flight|replies_dropped|nats_(changelog|not_))' >&2",
                  th_metrics_port(d));
            tf_dump_logs(&test_fleet);
            fail_msg("reply %d of %d: %s: %s", got - from + 1, MANY - from, tally_status_name(st),
                     r.error);
        }
        tally_reply_clear(&r);
        got++;
    }
    long long commits = th_metric(d, "tallyd_nats_changelog_commits_total") - before;
    print_message("%d writes stored in %lld changelog messages\n", MANY - from, commits);
    assert_true(commits > 0);
    assert_true(commits <= MANY / 10); /* grouped: one message per write would be MANY */
}

/* Streams from..MANY-1 equal the model. */
static void check_many_from(tally_client_t *c, int from)
{
    for (int s = from; s < MANY; s++) {
        tally_stream_info_t info;
        tally_status_t st = tally_query(c, many_names[s], &info);
        if (st != TALLY_OK)
            fail_msg("query %s: %s: %s", many_names[s], tally_status_name(st),
                     tally_client_error(c));
        assert_memory_equal(info.bins, many_model[s], sizeof many_model[s]);
    }
}

/* Streams from..MANY-1 equal the model; stream `gone` is unknown. */
static void check_many(tally_client_t *c, int gone, int from)
{
    tally_stream_info_t info;
    tally_status_t st = tally_query(c, many_names[gone], &info);
    if (st != TALLY_E_UNKNOWN_STREAM)
        tf_dump_logs(&test_fleet);
    assert_int_equal(st, TALLY_E_UNKNOWN_STREAM);
    check_many_from(c, from);
}

/* Publishes len bytes of records on subject (a changelog's) with the writer's headers of
 * message `from` (its epoch, batch and member): a late batch of that writer. */
static void publish_as(const char *subject, const void *data, size_t len, natsMsg *from)
{
    natsMsg *late = NULL;
    assert_int_equal(natsMsg_Create(&late, subject, NULL, data, (int)len), NATS_OK);
    const char *keys[] = {TALLY_NATS_HDR_EPOCH, TALLY_NATS_HDR_BATCH, TALLY_NATS_HDR_MEMBER};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        const char *v = NULL;
        assert_int_equal(natsMsgHeader_Get(from, keys[i], &v), NATS_OK);
        assert_int_equal(natsMsgHeader_Set(late, keys[i], v), NATS_OK);
    }
    jsErrCode jerr = 0;
    assert_int_equal(js_PublishMsg(NULL, tn_suite_js, late, NULL, &jerr), NATS_OK);
    natsMsg_Destroy(late);
}

#define APPLY_BYTES (4u << 20) /* td_changelog_owner.c's CL_APPLY_BYTES: a replay's piece */

/* Stores after partition k's changelog one message holding every record of it so far, in order,
 * repeated to pass APPLY_BYTES (with the headers of its last batch: its writer's late batch). A
 * stream's last record is the same in it as before it, so it changes no state; a replay applies
 * it in pieces of whole records, cut at APPLY_BYTES. */
static void store_history_again(uint32_t k)
{
    char cl[32], subject[32];
    tally_fleet_name(cl, sizeof cl, TALLY_NATS_CL_STREAM_PREFIX, k);
    tally_fleet_name(subject, sizeof subject, TALLY_NATS_SUBJ_CL, k);
    uint64_t last = changelog_last(k);
    uint8_t *all = NULL;
    size_t len = 0;
    natsMsg *headers = NULL;
    for (uint64_t seq = 1; seq <= last; seq++) {
        natsMsg *m = NULL;
        jsErrCode jerr = 0;
        assert_int_equal(js_GetMsg(&m, tn_suite_js, cl, seq, NULL, &jerr), NATS_OK);
        size_t n = (size_t)natsMsg_GetDataLength(m);
        if (n == 0) { /* a fence */
            natsMsg_Destroy(m);
            continue;
        }
        assert_non_null(all = realloc(all, len + n));
        memcpy(all + len, natsMsg_GetData(m), n);
        len += n;
        natsMsg_Destroy(headers);
        headers = m;
    }
    assert_non_null(headers);
    size_t reps = APPLY_BYTES / len + 1, size = reps * len; /* past APPLY_BYTES by < len */
    assert_true(size <= (8u << 20) - TALLY_NATS_HEADROOM);  /* the suite's max_payload */
    uint8_t *data = malloc(size);
    assert_non_null(data);
    for (size_t r = 0; r < reps; r++)
        memcpy(data + r * len, all, len);
    print_message("partition %u's %zu bytes of records, %zu times: %zu bytes in one message\n",
                  (unsigned)k, len, reps, size);
    publish_as(subject, data, size, headers);
    natsMsg_Destroy(headers);
    free(data);
    free(all);
}

/* A commit_ms of 1 s (its limit) and commit_when_idle off, so that batches go out by bytes (on,
 * a batch goes at each PubAck that leaves nothing in flight, holding what came in one round
 * trip, whatever its bytes: 15 messages for the 1000 writes on the dev box, and 157 under TSan,
 * whose member applies them slower than the cluster answers). Member a: 1000 writes, a
 * delete and a reset, then killed (SIGKILL) with none of it in a checkpoint; member b rebuilds
 * every stream from the changelog alone (the deleted one unknown, the reset one empty, the rest
 * the model), takes 998 writes and a delete itself, and stops cleanly. */
static void test_group_commit_delete_reset(void **state)
{
    (void)state;
    tf_fresh(&test_fleet);
    many_pick();
    memset(many_model, 0, sizeof many_model);
    start_commit_only(0, "3000", "1000");
    tf_wait_held(&test_fleet, ids[0], PARTITIONS, TIMEOUT_MS);
    wait_taken(0, PARTITIONS);
    tally_client_t *c = fleet_client();
    many_writes(c, &member[0], 0, 1);
    assert_int_equal(tally_delete(c, many_names[0]), TALLY_OK);
    assert_int_equal(tally_reset(c, many_names[1]), TALLY_OK);
    memset(many_model[1], 0, sizeof many_model[1]);
    th_daemon_kill(&member[0]);
    store_history_again(0); /* a's late batch over APPLY_BYTES: replayed in pieces */
    start_commit_only(1, "3000", "1000");
    tf_wait_held(&test_fleet, ids[1], PARTITIONS, TIMEOUT_MS);
    wait_taken(1, PARTITIONS);
    check_many(c, 0, 1);
    assert_true(th_metric(&member[1], "tallyd_nats_changelog_replayed_total") > 0);
    many_writes(c, &member[1], 2, 2);
    assert_int_equal(tally_delete(c, many_names[2]), TALLY_OK);
    check_many(c, 2, 3);
    tally_client_destroy(&c);
    assert_int_equal(th_daemon_stop(&member[1], SIGTERM, TIMEOUT_MS), 0);
    member[1].pid = 0;
}

/* ---- 8. more records at once than a message holds ------------------------------------------- */

#define SMALL_PAYLOAD 65536 /* max_payload of test 8's server: some 27 rgba8 records (~2.2 KiB) */

/* Every message of partition 0's changelog on js holds whole records, and fits a message
 * (max_payload less TALLY_NATS_HEADROOM for the headers); how many hold records, and (*full)
 * how many are filled to within 2 KiB of that: cut from a larger batch, since a batch goes out
 * whole once it reaches the size, or after commit_ms below it. */
static int check_message_sizes(jsCtx *js, int *full)
{
    uint64_t first = 0, last = 0;
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    char stream[32];
    tally_fleet_name(stream, sizeof stream, TALLY_NATS_CL_STREAM_PREFIX, 0);
    assert_int_equal(js_GetStreamInfo(&si, js, stream, NULL, &jerr), NATS_OK);
    first = si->State.FirstSeq;
    last = si->State.LastSeq;
    jsStreamInfo_Destroy(si);
    int batches = 0;
    *full = 0;
    for (uint64_t seq = first; seq <= last; seq++) {
        natsMsg *m = NULL;
        assert_int_equal(js_GetMsg(&m, js, stream, seq, NULL, &jerr), NATS_OK);
        const uint8_t *p = (const uint8_t *)natsMsg_GetData(m);
        size_t len = (size_t)natsMsg_GetDataLength(m), at = 0;
        assert_true(len <= SMALL_PAYLOAD - TALLY_NATS_HEADROOM);
        while (at < len) {
            size_t size = td_state_record_check(p + at, len - at);
            assert_true(size > 0);
            at += size;
        }
        batches += len > 0;
        *full += len > SMALL_PAYLOAD - TALLY_NATS_HEADROOM - 2048;
        natsMsg_Destroy(m);
    }
    return batches;
}

/* A server of its own whose max_payload is SMALL_PAYLOAD (a cluster of one node: the changelog
 * is one replica), the members' and the fleet client's until small_server_stop; *js on it. */
static void small_server_start(tn_cluster_t *small, natsConnection **nc, jsCtx **js)
{
    char conf[64];
    snprintf(conf, sizeof conf, "max_payload: %d", SMALL_PAYLOAD); /* the last one counts */
    tn_options_t o = {.extra_conf = conf};
    assert_int_equal(tn_cluster_start(small, 1, &o, TIMEOUT_MS), 0);
    assert_int_equal(tn_connect(small, nc, js), 0);
    cluster_urls = small->urls;
    cluster_replicas = "1";
}

static void small_server_stop(tn_cluster_t *small, natsConnection *nc, jsCtx *js)
{
    cluster_urls = NULL;
    cluster_replicas = "3";
    jsCtx_Destroy(js);
    natsConnection_Destroy(nc);
    tn_cluster_stop(small);
}

#define RING_T0 1795000000500ull /* the test clock: half way into an interval */

/* A changelog message of one write in flight: one record, parsed into rec; its length. */
static size_t one_record(natsMsg *m, td_state_record_t *rec)
{
    size_t len = (size_t)natsMsg_GetDataLength(m);
    assert_int_equal(parse_record((const uint8_t *)natsMsg_GetData(m), len, rec), len);
    return len;
}

/* A window ring larger than a message, on member b (64 window intervals of 1 s on the test
 * clock): stream ring/0's ring grows by a slot of ~1 KiB (rgba8, 1024 counts of 1) per write,
 * each in an interval of its own, to ~64 KiB, past what a message holds (60 KiB). Every write
 * is answered OK: after its first, a record of ring/0 carries only the slot its write changed
 * (td_state_record.h, kind 3), so the last changelog message holds one record of it, kind 3,
 * with one slot, under 4 KiB. b is killed; a, started again, takes the partitions and rebuilds
 * the whole ring from those records: a window query over the 64 intervals counts every write. */
static void ring_past_a_message(const char *clock, jsCtx *js)
{
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(member[1].endpoint, TIMEOUT_MS, &c), TALLY_OK);
    uint8_t data[4 * 256];
    for (size_t j = 0; j < sizeof data; j++)
        data[j] = (uint8_t)(j / 4);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_RGBA8, 0);
    assert_int_equal(tally_req_set_stream(&req, "ring/0"), TALLY_OK);
    char why[TALLY_ERROR_MESSAGE_MAX + 1];
    for (int i = 0; i < 64; i++) {
        assert_int_equal(th_write_clock(clock, RING_T0 + (uint64_t)i * 1000), 0);
        tally_status_t st = call_numbered(c, &req, data, sizeof data, why, sizeof why);
        if (st != TALLY_OK)
            fail_msg("ring/0: write %d answered %s: %s", i, tally_status_name(st), why);
    }
    tally_client_destroy(&c);
    static td_state_record_t rec;
    char stream[32], subject[32];
    uint32_t k = tally_partition("ring/0", 6, PARTITIONS);
    tally_fleet_name(stream, sizeof stream, TALLY_NATS_CL_STREAM_PREFIX, k);
    tally_fleet_name(subject, sizeof subject, TALLY_NATS_SUBJ_CL, k);
    natsMsg *m = NULL;
    jsErrCode jerr = 0;
    assert_int_equal(js_GetLastMsg(&m, js, stream, subject, NULL, &jerr), NATS_OK);
    size_t len = one_record(m, &rec);
    print_message("ring/0's last changelog message: %zu bytes\n", len);
    assert_int_equal(rec.kind, TD_STATE_RECORD_CHANGED);
    assert_int_equal(rec.info.hist_total, 64 * 256);
    assert_int_equal(tally_get_u32(rec.ring), 1);
    assert_true(len < 4096);
    natsMsg_Destroy(m);
    th_daemon_kill(&member[1]);
    member_clock = clock;
    start_commit(0, "3000", "2");
    member_clock = NULL;
    wait_taken(0, PARTITIONS);
    assert_int_equal(tally_client_new(member[0].endpoint, TIMEOUT_MS, &c), TALLY_OK);
    static tally_stream_info_t info;
    assert_int_equal(tally_query_window(c, "ring/0", 64000, &info, NULL, NULL), TALLY_OK);
    assert_int_equal(info.hist_total, 64 * 256);
    for (size_t v = 0; v < 4 * 256; v++)
        assert_int_equal(info.bins[v], 64);
    tally_client_destroy(&c);
}

/* A server whose max_payload is 64 KiB (a cluster of its own, one node: the changelog is one
 * replica), commit_ms 1 s: member a's 1000 writes, 512 in flight, pile up to ~1.1 MiB of
 * records (~2.2 KiB each) while a batch is in flight, far over one message. Member a has
 * commit_when_idle off: this one node's PubAcks come back far sooner than commit_ms, so with it
 * on a batch goes at every PubAck that leaves none in flight, a few records each, and the
 * records never pile up past a message (221 messages, bench/NOTES.md, "Group commit at once
 * when idle"); test 12b cuts a batch with it on. Every write is
 * answered OK (none not_durable); every changelog message fits max_payload and holds whole
 * records, at least 1000 x 1.1 KiB / 60 KiB of them (a bound under what they need), some cut
 * from a larger batch; a is killed, and member b
 * rebuilds every stream from them; then a window ring past a message (ring_past_a_message). */
static void test_batch_over_max_payload(void **state)
{
    (void)state;
    static tn_cluster_t small;
    natsConnection *nc = NULL;
    jsCtx *js = NULL;
    small_server_start(&small, &nc, &js);
    many_pick();
    memset(many_model, 0, sizeof many_model);
    start_commit_only(0, "3000", "1000");
    wait_taken(0, PARTITIONS);
    char v[64];
    assert_int_equal(atoi(info_value(&member[0], "nats_max_payload", v, sizeof v)), SMALL_PAYLOAD);
    tally_client_t *c = fleet_client();
    many_writes(c, &member[0], 0, 1);
    assert_int_equal(th_metric(&member[0], "tallyd_nats_not_durable_total"), 0);
    int full = 0, batches = check_message_sizes(js, &full);
    print_message("%d writes stored in %d changelog messages of at most %d bytes, %d of them "
                  "cut from a larger batch\n",
                  MANY, batches, SMALL_PAYLOAD - (int)TALLY_NATS_HEADROOM, full);
    assert_true(batches >= MANY * 1100 / (SMALL_PAYLOAD - (int)TALLY_NATS_HEADROOM));
    assert_true(full > 0);
    th_daemon_kill(&member[0]);
    char dir[256], clock[300];
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-clock"), 0);
    snprintf(clock, sizeof clock, "%s/clock", dir);
    assert_int_equal(th_write_clock(clock, RING_T0), 0);
    member_clock = clock;
    start_commit(1, "3000", "2"); /* ring/0's writes, one at a time, wait for no group */
    member_clock = NULL;
    wait_taken(1, PARTITIONS);
    assert_true(th_metric(&member[1], "tallyd_nats_changelog_replayed_total") >= batches);
    check_many_from(c, 0);
    tally_client_destroy(&c);
    ring_past_a_message(clock, js);
    /* a clean stop (its checkpoints do not fit 64 KiB: logged), so that what it ran is counted
     * by a coverage build (a process killed writes no counters) */
    assert_int_equal(th_daemon_stop(&member[0], SIGTERM, TIMEOUT_MS), 0);
    member[0].pid = 0;
    th_rmrf(dir);
    small_server_stop(&small, nc, js);
}

/* ---- 9. a writer racing the fence at a take ------------------------------------------------- */

/* The partition whose `what` (fence, purge) waits at its test gate first, from member i's log
 * (-1: none yet). */
static int gated_partition(int i, const char *what)
{
    char *log = th_slurp(member[i].log_path), line[64];
    snprintf(line, sizeof line, ": test: its %s waits for ", what);
    const char *hit = log ? strstr(log, line) : NULL, *at = NULL;
    for (const char *p = log; hit && (p = strstr(p, "partition ")) && p < hit; p++)
        at = p;
    int k = at ? atoi(at + strlen("partition ")) : -1;
    free(log);
    return k;
}

/* Waits until member i's `what` waits at its test gate: that partition. */
static int wait_gated(int i, const char *what)
{
    int k = -1;
    for (int64_t until = th_now_ms() + TIMEOUT_MS; k < 0 && th_now_ms() < until;)
        if ((k = gated_partition(i, what)) < 0)
            th_sleep_ms(20);
    assert_true(k >= 0 && k < PARTITIONS);
    return k;
}

/* Stores, after the last message of partition k's changelog, a copy of its message at seq (data
 * and the writer's headers): a previous owner's late batch. The stream its one record names. */
static int store_late_copy(uint32_t k, uint64_t seq)
{
    static td_state_record_t rec;
    char cl[32], subject[32];
    tally_fleet_name(cl, sizeof cl, TALLY_NATS_CL_STREAM_PREFIX, k);
    tally_fleet_name(subject, sizeof subject, TALLY_NATS_SUBJ_CL, k);
    natsMsg *orig = NULL;
    jsErrCode jerr = 0;
    assert_int_equal(js_GetMsg(&orig, tn_suite_js, cl, seq, NULL, &jerr), NATS_OK);
    size_t len = one_record(orig, &rec);
    publish_as(subject, natsMsg_GetData(orig), len, orig);
    int stream = -1;
    for (int s = 0; s < STREAMS; s++) {
        char name[32];
        tf_stream_name(&test_fleet, s, name, sizeof name);
        if (rec.name_len == strlen(name) && memcmp(rec.name, name, rec.name_len) == 0)
            stream = s;
    }
    natsMsg_Destroy(orig);
    assert_true(stream >= 0);
    return stream;
}

/* Member a writes every stream twice (rounds 0 and 1, one write in flight: a record per
 * message), noting each partition's last changelog sequence after round 0, and is killed.
 * Member b starts with its fences held (TALLYD_TEST_FENCE_GATE): its first take reads its
 * changelog's end, replays it and waits; the test stores after that end a copy of a's message
 * at round 0's last sequence of the partition (a's late batch: a's epoch, the record of a stream
 * s after round 0 only) and opens the gate. b's fence is refused (the last sequence is no longer
 * the one it expects): b applies the late message, says so, and fences again; s is as that
 * record says (round 0), every other stream as after round 1. */
static void test_writer_races_fence(void **state)
{
    (void)state;
    tf_fresh(&test_fleet);
    start(0, "6000"); /* b's gated take must end within its lease */
    wait_taken(0, PARTITIONS);
    tally_client_t *c = fleet_client();
    static uint64_t model0[STREAMS][256];
    uint64_t seqs0[STREAMS], last0[PARTITIONS];
    write_round(c, 0);
    memcpy(model0, model, sizeof model0);
    memcpy(seqs0, seqs, sizeof seqs0);
    for (uint32_t k = 0; k < PARTITIONS; k++)
        last0[k] = changelog_last(k);
    write_round(c, 1);
    tally_client_destroy(&c);
    th_daemon_kill(&member[0]);
    char dir[256], gate[300];
    gate_at(dir, sizeof dir, gate, sizeof gate);
    setenv("TALLYD_TEST_FENCE_GATE", gate, 1);
    start(1, "6000");
    unsetenv("TALLYD_TEST_FENCE_GATE");
    int k = wait_gated(1, "fence");
    int s = store_late_copy((uint32_t)k, last0[k]);
    gate_open(gate);
    wait_taken(1, PARTITIONS);
    assert_int_equal(th_sh("grep -q 'partition %d: its changelog.s fence lost to a message' %s", k,
                           member[1].log_path),
                     0);
    memcpy(model[s], model0[s], sizeof model[s]);
    seqs[s] = seqs0[s];
    c = fleet_client();
    tf_check_model(&test_fleet, c);
    tally_client_destroy(&c);
    assert_int_equal(th_daemon_stop(&member[1], SIGTERM, TIMEOUT_MS), 0);
    member[1].pid = 0;
    th_rmrf(dir);
}

/* ---- 6. changelog messages gone before a checkpoint held them ------------------------------- */

/* Streams x and y of one partition. Member a writes x (seq 1) and stops cleanly: its checkpoint
 * holds it, at cl_seq c. It starts again (a fence at c + 1), writes x (seq 2) and y (seq 1),
 * one batch each (c + 2, c + 3), each answered, and is killed. The changelog is purged below
 * y's batch, as partition_max_age_s passing without an owner would: a's fence and x's second
 * record are gone. Member b takes the partition anyway, from the checkpoint and what remains:
 * it says so at error level and counts the 2 messages lost; x is as the checkpoint holds it
 * (seq 1), y as its record; x's seq 2, sent again, is applied (not a duplicate). */
static void test_records_gone_before_checkpoint(void **state)
{
    (void)state;
    tf_fresh(&test_fleet);
    int x = 0, y = 1;
    while (y < STREAMS && tf_partition_of(&test_fleet, y) != tf_partition_of(&test_fleet, x))
        y++;
    assert_true(y < STREAMS);
    uint32_t k = tf_partition_of(&test_fleet, x);
    start(0, "15000");
    wait_taken(0, PARTITIONS);
    tally_client_t *c = fleet_client();
    tf_send_hist(&test_fleet, c, x, 0);
    tf_recv_applied(c);
    uint64_t after_first[256];
    memcpy(after_first, model[x], sizeof after_first);
    tally_client_destroy(&c);
    assert_int_equal(th_daemon_stop(&member[0], SIGTERM, TIMEOUT_MS), 0);
    member[0].pid = 0;
    td_ckpt_manifest_t m = tf_manifest(k);
    start(0, "15000");
    wait_taken(0, PARTITIONS);
    c = fleet_client();
    tf_send_hist(&test_fleet, c, x, 1);
    tf_recv_applied(c);
    tf_send_hist(&test_fleet, c, y, 0);
    tf_recv_applied(c);
    tally_client_destroy(&c);
    th_daemon_kill(&member[0]);
    char cl[32];
    uint64_t first = 0, msgs = 0, last;
    tally_fleet_name(cl, sizeof cl, TALLY_NATS_CL_STREAM_PREFIX, k);
    stream_state(cl, &first, &msgs);
    last = first + msgs - 1;
    assert_int_equal(last, m.cl_seq + 3); /* the fence, x's batch, y's batch */
    jsOptions po;
    jsOptions_Init(&po);
    po.Stream.Purge.Sequence = last; /* up to, not including: y's batch stays */
    jsErrCode jerr = 0;
    assert_int_equal(js_PurgeStream(tn_suite_js, cl, &po, &jerr), NATS_OK);
    start(1, "15000");
    wait_taken(1, PARTITIONS);
    assert_int_equal(th_metric(&member[1], "tallyd_nats_changelog_lost_total"), 2);
    assert_int_equal(th_sh("grep -q 'partition %u: changelog messages %llu..%llu are gone before "
                           "a checkpoint held them' %s",
                           (unsigned)k, (unsigned long long)m.cl_seq + 1,
                           (unsigned long long)last - 1, member[1].log_path),
                     0);
    c = fleet_client();
    tf_check_stream(&test_fleet, c, y);
    memcpy(model[x], after_first, sizeof after_first);
    seqs[x] = 1;
    tf_check_stream(&test_fleet, c, x); /* its second write is lost */
    tf_send_hist(&test_fleet, c, x, 1); /* seq 2 again: applied, not a duplicate */
    tally_reply_t r;
    tally_reply_init(&r);
    assert_int_equal(tally_recv(c, &r), TALLY_OK);
    tally_reply_clear(&r);
    tf_check_stream(&test_fleet, c, x);
    tally_client_destroy(&c);
    assert_int_equal(th_daemon_stop(&member[1], SIGTERM, TIMEOUT_MS), 0);
    member[1].pid = 0;
}

/* ---- 6b. a changelog removed and made again, below its checkpoint's cl_seq ------------------ */

/* Member a writes 3 rounds and stops cleanly: each partition's checkpoint holds its changelog
 * up to cl_seq C[k] (its start, a fence and 3 records a stream). Every changelog stream is
 * removed (an operator's mistake); a takes the partitions again, which makes them anew (the
 * start, a fence), writes a round (a record a stream: below C[k]), each answered, and is killed
 * before a checkpoint. Member b's take finds the changelog ending before the checkpoint's
 * cl_seq: it says so and applies the whole stream, and equals the model. b writes a round and
 * stops cleanly: its checkpoint names the changelog's own last sequence, not C[k] (its base
 * restarted from its fence), and the give-up purges the changelog whole. b takes again, writes
 * rounds until every changelog passes C[k], and is killed: a equals the model (the records between
 * b's checkpoint and C[k] applied too), nothing counted lost. */
static void test_changelog_made_again(void **state)
{
    (void)state;
    tf_fresh(&test_fleet);
    start(0, "3000");
    wait_taken(0, PARTITIONS);
    tally_client_t *c = fleet_client(); /* one a member's life: none waits for a member gone */
    int r = 0;
    for (; r < 3; r++)
        write_round(c, r);
    tally_client_destroy(&c);
    assert_int_equal(th_daemon_stop(&member[0], SIGTERM, TIMEOUT_MS), 0);
    member[0].pid = 0;
    uint64_t before[PARTITIONS]; /* C[k] */
    for (uint32_t k = 0; k < PARTITIONS; k++) {
        before[k] = tf_manifest(k).cl_seq;
        remove_changelog(k);
    }
    /* a makes the changelogs anew; its answered writes land below C[k], in no checkpoint. */
    start(0, "3000");
    wait_taken(0, PARTITIONS);
    c = fleet_client();
    write_round(c, r++);
    tally_client_destroy(&c);
    th_daemon_kill(&member[0]);
    uint32_t k0 = tf_partition_of(&test_fleet, 0);
    assert_true(changelog_last(k0) < before[k0]);
    start(1, "3000");
    check_taken_model(1);
    assert_int_equal(
        th_sh("grep -q 'partition %u: its changelog ends at .*before its checkpoint' %s",
              (unsigned)k0, member[1].log_path),
        0);
    /* b's checkpoint names the new stream's sequence, which it holds whole: purged. */
    c = fleet_client();
    write_round(c, r++);
    tally_client_destroy(&c);
    assert_int_equal(th_daemon_stop(&member[1], SIGTERM, TIMEOUT_MS), 0);
    member[1].pid = 0;
    for (uint32_t k = 0; k < PARTITIONS; k++) {
        uint64_t first = 0, msgs = 0;
        assert_int_equal(tf_manifest(k).cl_seq, changelog_last(k));
        changelog_state(k, &first, &msgs);
        assert_int_equal(msgs, 0);
    }
    /* b again, its records past C[k] after ones below it, then killed: a applies them all. */
    start(1, "3000");
    wait_taken(1, PARTITIONS);
    c = fleet_client();
    for (bool past = false; !past; r++) {
        assert_true(r < 16);
        write_round(c, r);
        past = true;
        for (uint32_t k = 0; k < PARTITIONS; k++)
            past &= changelog_last(k) > before[k];
    }
    tally_client_destroy(&c);
    th_daemon_kill(&member[1]);
    start(0, "3000");
    check_taken_model(0);
    assert_int_equal(th_daemon_stop(&member[0], SIGTERM, TIMEOUT_MS), 0);
    member[0].pid = 0;
}

/* ---- 7. the engine's purge across a replica restart ------------------------------------------ */

/* nats-server's version, major * 10000 + minor * 100 + patch (0 when it cannot be read). */
static int server_version(void)
{
    char cmd[600], line[128] = "";
    snprintf(cmd, sizeof cmd, "'%s' --version 2>&1", tn_server_bin());
    FILE *f = popen(cmd, "r");
    if (!f)
        return 0;
    if (!fgets(line, sizeof line, f))
        line[0] = 0;
    pclose(f);
    const char *v = strstr(line, " v");
    int major = 0, minor = 0, patch = 0;
    if (!v || sscanf(v + 2, "%d.%d.%d", &major, &minor, &patch) != 3)
        return 0;
    return major * 10000 + minor * 100 + patch;
}

/* The node that leads stream `name`, once it has one (-1 after TIMEOUT_MS). */
static int stream_leader(const char *name)
{
    int64_t until = th_now_ms() + TIMEOUT_MS;
    do {
        jsStreamInfo *si = NULL;
        jsErrCode jerr = 0;
        int leader = -1;
        if (js_GetStreamInfo(&si, tn_suite_js, name, NULL, &jerr) == NATS_OK && si->Cluster &&
            si->Cluster->Leader)
            leader = tn_node_index(&tn_suite, si->Cluster->Leader);
        jsStreamInfo_Destroy(si);
        if (leader >= 0)
            return leader;
        th_sleep_ms(100);
    } while (th_now_ms() < until);
    return -1;
}

/* Asks stream `name`'s leader to step down until node i leads it (an election picks among the
 * replicas that are current: a few rounds). */
static void make_leader(const char *name, int i)
{
    char subject[128];
    snprintf(subject, sizeof subject, "$JS.API.STREAM.LEADER.STEPDOWN.%s", name);
    int64_t until = th_now_ms() + TIMEOUT_MS;
    int leader;
    while ((leader = stream_leader(name)) != i && th_now_ms() < until) {
        natsMsg *reply = NULL;
        natsConnection_RequestString(&reply, tn_suite_nc, subject, "", 5000);
        natsMsg_Destroy(reply); /* whatever it says: the loop looks at the leader */
        int64_t moved = th_now_ms() + 10000;
        while (stream_leader(name) == leader && th_now_ms() < moved)
            th_sleep_ms(100);
    }
    assert_int_equal(leader, i);
}

/* Stream `name`'s leader killed (SIGKILL: its raft log not yet snapshotted), restarted, and
 * made the stream's leader again, so that the stream is read as that replica recovered it. */
static void stream_leader_restarted(const char *name)
{
    int victim = stream_leader(name);
    assert_true(victim >= 0);
    assert_int_equal(tn_node_kill(&tn_suite, victim, SIGKILL), 0);
    assert_int_equal(tn_node_restart(&tn_suite, victim, TIMEOUT_MS), 0);
    make_leader(name, victim);
}

/* Stream `name` on subject, 3 replicas, made as TALLY_CL<k> is (no max age), with `count`
 * messages. */
static void purge_stream(const char *name, const char *subject, int count)
{
    jsErrCode jerr = 0;
    js_DeleteStream(tn_suite_js, name, NULL, &jerr); /* a run before this one's */
    assert_int_equal(td_nats_stream_ensure(tn_suite_js, name, subject, 3, 0, -1, msg, sizeof msg),
                     TD_OK);
    for (int i = 0; i < count; i++)
        assert_int_equal(tn_publish(tn_suite_js, subject, "record", 6, NULL, NULL), NATS_OK);
}

/* What compaction of a changelog by purge would rely on (issue 33), on the cluster's own
 * nats-server. Stream A: 20 records, purged below 11 (records 11..20 kept), 5 more; stream B: 20
 * records, all purged (below 21, nothing left after it: a quiet point), 5 more. Their leader is
 * killed (SIGKILL: its raft log, purge included, not yet snapshotted) and restarted, then made
 * the leader of each. Before 2.9.18 the restarted replica replays A's purge as a purge of
 * everything A held when it was made (nats-server#4196): records 11..20 are gone on it and kept
 * on the others (asserted: this is why tallyd does not purge its changelogs, PROTOCOL.md §13
 * "Changelog"); from 2.9.18 on every record >= 11 is kept. B loses nothing after its purge on
 * any version: a purge of everything at a quiet point is safe. */
static void test_purge_across_replica_restart(void **state)
{
    (void)state;
    int version = server_version();
    assert_true(version > 0);
    purge_stream("PURGE_A", "purge.a", 20);
    purge_stream("PURGE_B", "purge.b", 20);
    int victim = stream_leader("PURGE_A");
    assert_true(victim >= 0);
    make_leader("PURGE_B", victim); /* its raft log holds both purges */
    jsOptions po;
    jsOptions_Init(&po);
    jsErrCode jerr = 0;
    po.Stream.Purge.Sequence = 11; /* up to, not including */
    assert_int_equal(js_PurgeStream(tn_suite_js, "PURGE_A", &po, &jerr), NATS_OK);
    po.Stream.Purge.Sequence = 21;
    assert_int_equal(js_PurgeStream(tn_suite_js, "PURGE_B", &po, &jerr), NATS_OK);
    for (int i = 0; i < 5; i++) {
        assert_int_equal(tn_publish(tn_suite_js, "purge.a", "record", 6, NULL, NULL), NATS_OK);
        assert_int_equal(tn_publish(tn_suite_js, "purge.b", "record", 6, NULL, NULL), NATS_OK);
    }
    uint64_t first = 0, msgs = 0;
    stream_state("PURGE_A", &first, &msgs);
    assert_int_equal(first, 11);
    assert_int_equal(msgs, 15);
    assert_int_equal(tn_node_kill(&tn_suite, victim, SIGKILL), 0);
    assert_int_equal(tn_node_restart(&tn_suite, victim, TIMEOUT_MS), 0);
    make_leader("PURGE_A", victim);
    stream_state("PURGE_A", &first, &msgs);
    print_message("nats-server %d.%d.%d: after a restart, the purge below 11 left %llu records "
                  "from %llu on the restarted replica\n",
                  version / 10000, version / 100 % 100, version % 100, (unsigned long long)msgs,
                  (unsigned long long)first);
    if (version < 20918) { /* nats-server#4196: records 11..20 lost on this replica */
        assert_int_equal(first, 21);
        assert_int_equal(msgs, 5);
        make_leader("PURGE_A", (victim + 1) % 3); /* another replica still has them */
        stream_state("PURGE_A", &first, &msgs);
    }
    assert_int_equal(first, 11);
    assert_int_equal(msgs, 15);
    make_leader("PURGE_B", victim);
    stream_state("PURGE_B", &first, &msgs);
    assert_int_equal(first, 21);
    assert_int_equal(msgs, 5);
    js_DeleteStream(tn_suite_js, "PURGE_A", NULL, &jerr);
    js_DeleteStream(tn_suite_js, "PURGE_B", NULL, &jerr);
}

/* ---- 10. compaction at a quiet point -------------------------------------------------------- */

/* Waits until partition k's changelog holds no message: purged by its owner after a checkpoint
 * that holds it all, its last sequence still `last` (the fence's), its checkpoint's cl_seq too. */
static void wait_purged(uint32_t k, uint64_t last)
{
    uint64_t first = 0, msgs = 0;
    int64_t until = th_now_ms() + TIMEOUT_MS;
    for (changelog_state(k, &first, &msgs); msgs > 0 && th_now_ms() < until;
         changelog_state(k, &first, &msgs))
        th_sleep_ms(50);
    if (msgs > 0) {
        tf_dump_logs(&test_fleet);
        fail_msg("partition %u's changelog still holds %llu messages from %llu", (unsigned)k,
                 (unsigned long long)msgs, (unsigned long long)first);
    }
    assert_int_equal(first, last + 1); /* an empty stream's first: its last + 1 */
    assert_int_equal(changelog_last(k), last);
    assert_int_equal(tf_manifest(k).cl_seq, last);
}

/* A record on partition k's changelog expecting `expect` as its last sequence (a stale owner's
 * chain) is refused: JetStream's wrong last sequence, after a purge as before it. */
static void stale_publish_refused(uint32_t k, uint64_t expect)
{
    char subject[32];
    tally_fleet_name(subject, sizeof subject, TALLY_NATS_SUBJ_CL, k);
    jsPubOptions po;
    jsPubOptions_Init(&po);
    po.ExpectLastSeq = expect;
    jsErrCode jerr = 0;
    assert_int_not_equal(js_Publish(NULL, tn_suite_js, subject, "", 0, &po, &jerr), NATS_OK);
    assert_int_equal(jerr, 10071); /* JSStreamWrongLastSequenceErr */
}

/* Member a, checkpoints 200 ms apart, writes every stream twice and goes quiet: each partition's
 * next checkpoint holds its whole changelog, which a then purges whole (every TALLY_CL<k> holds
 * no message, its last sequence unchanged and its checkpoint's cl_seq; counted in /metrics and
 * info). A stale owner's record expecting an earlier sequence is refused after the purge, and
 * a's next round is stored behind it. a is killed (SIGKILL): b finds nothing after the
 * checkpoints but a's last round and equals the model, nothing counted lost. b writes a round
 * (its fence and records after a's purge) and is killed; the changelog's leader, whose raft log
 * holds the purges, is killed and restarted and made leader again: it holds every message after
 * the purge (nats-server 2.9.10 replays a whole purge without loss; test 7's stream B). a takes
 * the partitions again and equals the model. */
static void test_compaction_at_quiet_point(void **state)
{
    (void)state;
    tf_fresh(&test_fleet);
    start_with(0, "6000", "2", "200");
    wait_taken(0, PARTITIONS);
    tally_client_t *c = fleet_client();
    write_round(c, 0);
    write_round(c, 1);
    uint64_t last[PARTITIONS];
    for (uint32_t k = 0; k < PARTITIONS; k++)
        last[k] = changelog_last(k);
    for (uint32_t k = 0; k < PARTITIONS; k++)
        wait_purged(k, last[k]);
    char v[64];
    assert_true(th_metric(&member[0], "tallyd_nats_changelog_purges_total") >= PARTITIONS);
    assert_true(atoll(info_value(&member[0], "nats_changelog_purges", v, sizeof v)) >= PARTITIONS);
    uint32_t k0 = tf_partition_of(&test_fleet, 0);
    stale_publish_refused(k0, last[k0] - 1);
    write_round(c, 2); /* a's chain goes on: the purge kept its last sequence */
    assert_true(changelog_last(k0) > last[k0]);
    assert_int_equal(th_metric(&member[0], "tallyd_nats_not_durable_total"), 0);
    th_daemon_kill(&member[0]);
    start(1, "6000");
    wait_taken(1, PARTITIONS);
    tf_check_model(&test_fleet, c);
    assert_int_equal(th_metric(&member[1], "tallyd_nats_changelog_lost_total"), 0);
    write_round(c, 3); /* b's fence and records: after the purges, in no checkpoint */
    tally_client_destroy(&c);
    th_daemon_kill(&member[1]);
    char cl[32];
    tally_fleet_name(cl, sizeof cl, TALLY_NATS_CL_STREAM_PREFIX, k0);
    uint64_t first0 = 0, msgs0 = 0, first = 0, msgs = 0;
    stream_state(cl, &first0, &msgs0);
    assert_true(first0 > last[k0]); /* purged before */
    assert_true(msgs0 >= 2);        /* b's fence, and stream 0's record */
    stream_leader_restarted(cl);
    stream_state(cl, &first, &msgs);
    print_message("partition %u's changelog after its leader's restart: %llu messages from %llu "
                  "(before: %llu from %llu)\n",
                  (unsigned)k0, (unsigned long long)msgs, (unsigned long long)first,
                  (unsigned long long)msgs0, (unsigned long long)first0);
    assert_int_equal(first, first0);
    assert_int_equal(msgs, msgs0);
    start_with(0, "6000", "2", "200");
    check_taken_model(0);
    assert_int_equal(th_daemon_stop(&member[0], SIGTERM, TIMEOUT_MS), 0);
    member[0].pid = 0;
}

/* ---- 11. no purge past the checkpoint ------------------------------------------------------- */

/* What member i decided at partition k's first compaction: its log line from "kept" or
 * "purged" on, into out (false: none yet). */
static bool first_compaction(int i, int k, char *out, size_t cap)
{
    char *log = th_slurp(member[i].log_path), head[64];
    snprintf(head, sizeof head, "partition %d's changelog ", k);
    const char *hit = log ? strstr(log, head) : NULL;
    if (hit) {
        hit += strlen(head);
        size_t n = strcspn(hit, "\n");
        snprintf(out, cap, "%.*s", (int)(n < cap ? n : cap - 1), hit);
    }
    free(log);
    return hit != NULL;
}

/* Rounds from..from + n - 1 of every stream, all 16 writes of a round in flight. */
static void write_rounds_in_flight(tally_client_t *c, int from, int n)
{
    for (int r = from; r < from + n; r++) {
        for (int s = 0; s < STREAMS; s++)
            tf_send_hist(&test_fleet, c, s, r);
        for (int s = 0; s < STREAMS; s++)
            tf_recv_applied(c);
    }
}

/* Member a, checkpoints 200 ms apart, its compactions held at a gate (TALLYD_TEST_PURGE_GATE)
 * until the test opens it: a round of writes, then the first checkpoint's compaction waits; a
 * write of a stream of that partition is stored after the checkpoint's cl_seq (answered: nothing
 * waits); the gate opens, and the changelog is kept (said at debug level), not purged. Then
 * writes keep coming, 16 in flight, over many checkpoints (each purging only at a quiet point),
 * and a is killed (SIGKILL) after the last replies: b equals the model, nothing counted lost;
 * b (its records grouped every 20 ms) takes writes the same way and equals the model. */
static void test_no_purge_past_checkpoint(void **state)
{
    (void)state;
    tf_fresh(&test_fleet);
    char dir[256], gate[300];
    gate_at(dir, sizeof dir, gate, sizeof gate);
    setenv("TALLYD_TEST_PURGE_GATE", gate, 1);
    start_with(0, "15000", "2", "200"); /* its fleet thread held at the gate: a long lease */
    unsetenv("TALLYD_TEST_PURGE_GATE");
    wait_taken(0, PARTITIONS);
    tally_client_t *c = fleet_client();
    write_round(c, 0);
    int k = wait_gated(0, "purge");
    int s = 0;
    while (tf_partition_of(&test_fleet, s) != (uint32_t)k)
        s++; /* the plan's hash spreads 16 streams over 4 partitions: one is there */
    tf_send_hist(&test_fleet, c, s, 1);
    tf_recv_applied(c); /* stored after the gated checkpoint's cl_seq; nothing waits */
    gate_open(gate);
    char said[256] = "";
    for (int64_t until = th_now_ms() + TIMEOUT_MS;
         !first_compaction(0, k, said, sizeof said) && th_now_ms() < until;)
        th_sleep_ms(20);
    print_message("partition %d's first compaction: %s\n", k, said);
    if (!strstr(said, "kept") || !strstr(said, "records were stored after the checkpoint"))
        tf_dump_logs(&test_fleet);
    assert_non_null(strstr(said, "kept"));
    assert_non_null(strstr(said, "records were stored after the checkpoint"));
    write_rounds_in_flight(c, 2, ROUNDS); /* records newer than each checkpoint */
    th_daemon_kill(&member[0]);
    start_with(1, "15000", "20", "200"); /* records wait 20 ms: often at a checkpoint */
    wait_taken(1, PARTITIONS);
    tf_check_model(&test_fleet, c);
    assert_int_equal(th_metric(&member[1], "tallyd_nats_changelog_lost_total"), 0);
    /* The same on b, stopped cleanly (a coverage build counts what a killed process ran not),
     * its compactions meeting records waiting in a batch or for their PubAck. */
    write_rounds_in_flight(c, 2 + ROUNDS, 4 * ROUNDS);
    tf_check_model(&test_fleet, c);
    tally_client_destroy(&c);
    assert_int_equal(th_daemon_stop(&member[1], SIGTERM, TIMEOUT_MS), 0);
    member[1].pid = 0;
    th_rmrf(dir);
}

/* ---- 12. messages in flight ----------------------------------------------------------------- */

#define IN_FLIGHT_WRITES 6
#define CL_DEPTH_WANT 4 /* td_changelog_int.h's CL_DEPTH */

static void test_messages_in_flight(void **state)
{
    (void)state;
    char dir[256], gate[300];
    start_ack_gated(dir, sizeof dir, gate, sizeof gate, "1");
    uint32_t k = tf_partition_of(&test_fleet, 0);
    tally_client_t *c = fleet_client();
    write_round(c, 0);
    assert_int_equal(unlink(gate), 0); /* the PubAcks held from here */
    uint64_t before = changelog_last(k);
    for (int r = 1; r <= IN_FLIGHT_WRITES; r++) {
        tf_send_hist(&test_fleet, c, 0, r);
        th_sleep_ms(20);
    }
    /* The PubAck of the first is held: the member goes on to CL_DEPTH messages, not further. */
    int64_t until = th_now_ms() + TIMEOUT_MS;
    while (changelog_last(k) - before < CL_DEPTH_WANT && th_now_ms() < until)
        th_sleep_ms(10);
    th_sleep_ms(200);
    uint64_t stored = changelog_last(k) - before;
    gate_open(gate);
    print_message("%llu messages stored with the first PubAck held\n", (unsigned long long)stored);
    assert_int_equal(stored, CL_DEPTH_WANT);
    for (int r = 1; r <= IN_FLIGHT_WRITES; r++)
        tf_recv_applied(c);
    tf_check_stream(&test_fleet, c, 0);
    check_last_record(0);
    /* Writes in flight across two elections of partition k's changelog leader. */
    char cl[32];
    tally_fleet_name(cl, sizeof cl, TALLY_NATS_CL_STREAM_PREFIX, k);
    int streams[STREAMS], n = 0;
    for (int s = 0; s < STREAMS; s++)
        if (tf_partition_of(&test_fleet, s) == k)
            streams[n++] = s;
    char stepdown[128];
    snprintf(stepdown, sizeof stepdown, "$JS.API.STREAM.LEADER.STEPDOWN.%s", cl);
    for (int e = 0; e < 2; e++) {
        assert_true(stream_leader(cl) >= 0);
        natsMsg *reply = NULL; /* answered before the election ends: the writes meet it */
        natsConnection_RequestString(&reply, tn_suite_nc, stepdown, "", 5000);
        natsMsg_Destroy(reply);
        for (int r = 0; r < 8; r++)
            for (int i = 0; i < n; i++)
                tf_send_hist(&test_fleet, c, streams[i], 10 + 10 * e + r);
        for (int r = 0; r < 8; r++)
            for (int i = 0; i < n; i++)
                tf_recv_applied(c);
    }
    for (int i = 0; i < n; i++) {
        tf_check_stream(&test_fleet, c, streams[i]);
        check_last_record(streams[i]);
    }
    assert_int_equal(th_metric(&member[0], "tallyd_nats_not_durable_total"), 0);
    tally_client_destroy(&c);
    th_rmrf(dir);
}

/* ---- 12b. a record that replaces one a cut batch left waiting ------------------------------- */

#define CUT_STREAMS 400 /* names of partition 0: S, then the others of CUT_TRIES tries */
#define CUT_TRIES 3

static char cut_names[CUT_STREAMS][32];

/* A numbered hist of 256 rgba8 pixels, each channel's values once: every bin counts 1. */
static void cut_send(tally_client_t *c, const char *name, uint64_t seq)
{
    uint8_t data[4 * 256];
    for (size_t j = 0; j < sizeof data; j++)
        data[j] = (uint8_t)(j / 4);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_RGBA8, 0);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    req.seq = seq;
    tally_status_t st = tally_send(c, &req, data, sizeof data, NULL);
    if (st != TALLY_OK)
        fail_msg("send to %s: %s: %s", name, tally_status_name(st), tally_client_error(c));
}

/* Waits until stream `name` has taken `seq` (its write applied, its reply maybe held). */
static void wait_applied(tally_client_t *c, const char *name, uint64_t seq)
{
    static tally_stream_info_t info;
    int64_t until = th_now_ms() + TIMEOUT_MS;
    tally_status_t st;
    while (((st = tally_query(c, name, &info)) == TALLY_E_UNKNOWN_STREAM ||
            (st == TALLY_OK && info.last_seq < seq)) &&
           th_now_ms() < until)
        th_sleep_ms(1);
    if (st != TALLY_OK || info.last_seq != seq)
        fail_msg("%s: %s, last_seq %llu, not %llu", name, tally_status_name(st),
                 (unsigned long long)info.last_seq, (unsigned long long)seq);
}

/* A changelog message's records: how many, and of one stream's (its last one in the message). */
typedef struct {
    int records, of_name;
    size_t size; /* that stream's record: its size, kind, last_seq and ring slots */
    uint8_t kind;
    uint64_t last_seq;
    uint32_t slots;
} cut_message_t;

/* Partition 0's changelog message seq on js, its records parsed; those of stream `name`. */
static cut_message_t cut_message(jsCtx *js, uint64_t seq, const char *name)
{
    static td_state_record_t rec;
    cut_message_t out = {0};
    char stream[32];
    tally_fleet_name(stream, sizeof stream, TALLY_NATS_CL_STREAM_PREFIX, 0);
    natsMsg *m = NULL;
    jsErrCode jerr = 0;
    assert_int_equal(js_GetMsg(&m, js, stream, seq, NULL, &jerr), NATS_OK);
    const uint8_t *p = (const uint8_t *)natsMsg_GetData(m);
    size_t len = (size_t)natsMsg_GetDataLength(m);
    for (size_t at = 0, size; at < len; at += size, out.records++) {
        size = parse_record(p + at, len - at, &rec);
        if (rec.name_len == strlen(name) && memcmp(rec.name, name, rec.name_len) == 0) {
            out.of_name++;
            out.size = size;
            out.kind = rec.kind;
            out.last_seq = rec.info.last_seq;
            out.slots = rec.ring_len >= 4 ? tally_get_u32(rec.ring) : 0;
        }
    }
    natsMsg_Destroy(m);
    return out;
}

/* Waits until partition 0's changelog on js holds `count` messages after `before`, or more;
 * how many it holds. */
static uint64_t wait_stored(jsCtx *js, uint64_t before, uint64_t count)
{
    int64_t until = th_now_ms() + TIMEOUT_MS;
    while (tf_changelog_last(js, 0) - before < count && th_now_ms() < until)
        th_sleep_ms(1);
    uint64_t stored = tf_changelog_last(js, 0) - before;
    assert_true(stored >= count);
    return stored;
}

/* Replies to n writes, each OK (no duplicate: every write answered once). */
static void recv_ok(tally_client_t *c, int n)
{
    for (int i = 0; i < n; i++) {
        tally_reply_t r;
        tally_reply_init(&r);
        tally_status_t st = tally_recv(c, &r);
        if (st != TALLY_OK)
            fail_msg("reply %d of %d: %s: %s", i + 1, n, tally_status_name(st), r.error);
        tally_reply_clear(&r);
    }
}

/* Partition 0's batch cut with stream s's record in its rest, the PubAcks held from here (the
 * gate removed): a write to others[0], its record alone in a message (it goes at once: nothing
 * of the partition in flight), then 3 x per_msg writes to the next `others` (new streams) behind
 * it, all applied, then s's write seq. True when s's record passed a message: the batch's first
 * per_msg records went out as the fourth message in flight, s's record left waiting. False when
 * that rest went at its commit_ms before s's write came (a box too slow for the others' writes
 * in 1 s): the PubAcks go, the others' writes are answered, and s's is not sent. Before
 * commit_when_idle, 4 x per_msg writes to others made the four messages: the first one alone
 * keeps a message in flight, so that the rest group as they did. */
static bool cut_with_s_left(tally_client_t *w, tally_client_t *q, jsCtx *js, const char *gate,
                            char (*others)[32], int per_msg, const char *s, uint64_t seq,
                            uint64_t *before)
{
    *before = tf_changelog_last(js, 0);
    assert_int_equal(unlink(gate), 0);
    cut_send(w, others[0], 1);
    assert_int_equal(wait_stored(js, *before, 1), 1);
    for (int i = 1; i <= 3 * per_msg; i++)
        cut_send(w, others[i], 1);
    for (int i = 1; i <= 3 * per_msg; i++)
        wait_applied(q, others[i], 1);
    if (wait_stored(js, *before, 3) > 3) {
        gate_open(gate);
        recv_ok(w, 1 + 3 * per_msg);
        return false;
    }
    cut_send(w, s, seq);
    assert_int_equal(wait_stored(js, *before, 4), 4);
    for (uint64_t i = 1; i <= 4; i++) {
        cut_message_t m = cut_message(js, *before + i, s);
        assert_int_equal(m.records, i == 1 ? 1 : per_msg);
        assert_int_equal(m.of_name, 0);
    }
    return true;
}

/* Tests 12b and 12c: a server of their own (max_payload SMALL_PAYLOAD), member a on a test
 * clock with its PubAcks held by a gate, and two clients of a: writes (their replies held) and
 * queries. */
typedef struct {
    tn_cluster_t small;
    natsConnection *nc;
    jsCtx *js;
    char dir[256], clock[300], gate_dir[256], gate[300];
    tally_client_t *w, *q;
} clock_gate_t;

/* The server, and member a with window rings on a new test clock at t0, its PubAcks held by a
 * gate open until the test removes it, commit_ms; every partition taken; the two clients. */
static void start_clock_gate(clock_gate_t *g, uint64_t t0, const char *commit_ms)
{
    small_server_start(&g->small, &g->nc, &g->js);
    assert_int_equal(th_tmpdir(g->dir, sizeof g->dir, "tally-clock"), 0);
    snprintf(g->clock, sizeof g->clock, "%s/clock", g->dir);
    assert_int_equal(th_write_clock(g->clock, t0), 0);
    gate_at(g->gate_dir, sizeof g->gate_dir, g->gate, sizeof g->gate);
    gate_open(g->gate);
    setenv("TALLYD_TEST_ACK_GATE", g->gate, 1);
    member_clock = g->clock;
    start_commit(0, "3000", commit_ms);
    member_clock = NULL;
    unsetenv("TALLYD_TEST_ACK_GATE");
    wait_taken(0, PARTITIONS);
    assert_int_equal(tally_client_new(member[0].endpoint, TIMEOUT_MS, &g->w), TALLY_OK);
    assert_int_equal(tally_client_new(member[0].endpoint, TIMEOUT_MS, &g->q), TALLY_OK);
}

/* Member i stopped cleanly (so that a coverage build counts what it ran; its checkpoints do not
 * fit 64 KiB: logged), the clients, folders and server gone. */
static void stop_clock_gate(clock_gate_t *g, int i)
{
    tally_client_destroy(&g->q);
    tally_client_destroy(&g->w);
    assert_int_equal(th_daemon_stop(&member[i], SIGTERM, TIMEOUT_MS), 0);
    member[i].pid = 0;
    th_rmrf(g->gate_dir);
    th_rmrf(g->dir);
    small_server_stop(&g->small, g->nc, g->js);
}

/* A write's record that replaces its stream's record left waiting in the rest of a batch cut in
 * parts: td_changelog_hold's guess, made before its lock, is wrong (the rest's records were held
 * under the ticket of the part that went out), and the record is encoded again under the lock.
 * A server of its own with max_payload 64 KiB; member a with window rings on the test clock,
 * the PubAcks held (TALLYD_TEST_ACK_GATE), commit_ms 1 s; S (cut_names[0]) written at interval
 * t-1 and stored, its record's size that of every first record here (names all as long), so a
 * message holds per_msg of them:
 *   - a write to another stream of partition 0, its record alone in the first message (nothing
 *     of the partition in flight: it goes at once, commit_when_idle), then 3 x per_msg writes
 *     to others: their batch, behind it, reaches a message at each (per_msg+1)-th record and
 *     goes out per_msg records at a time: three messages in flight, per_msg records left
 *     (cut_with_s_left);
 *   - once all are applied, S's write at interval t: its record passes a message, the batch's
 *     first per_msg records go out as the fourth message in flight, S's record is left waiting;
 *   - the clock an interval on, S's write at t+1 replaces that record: its ring's changes since
 *     before the replaced record, slots t and t+1;
 * the PubAcks go, every write is answered OK once, and the changelog's last message holds S's one
 * record, kind 3, with both slots. a is killed; b rebuilds from the changelog alone: S's window
 * over the last one, two and three intervals counts one, two and three writes. Trusting the
 * guess, that record held slot t+1 only, and b's ring of S lost interval t. A try whose rest
 * went at its commit_ms before S's write came (a box too slow) is made again with new streams. */
static void test_record_replaces_cut_rest(void **state)
{
    (void)state;
    static clock_gate_t g;
    start_clock_gate(&g, RING_T0 - 1000, "1000");
    partition0_names(cut_names, CUT_STREAMS, "cut/", 1000); /* all as long, as are their records */
    tally_client_t *w = g.w, *q = g.q;
    jsCtx *js = g.js;
    /* S's first write (interval t-1), stored: the size of a stream's first record. */
    const char *s = cut_names[0]; /* S */
    cut_send(w, s, 1);
    tf_recv_applied(w);
    cut_message_t m = cut_message(js, tf_changelog_last(js, 0), s);
    assert_int_equal(m.records, 1);
    assert_int_equal(m.of_name, 1);
    size_t first_size = m.size;
    size_t max_msg = SMALL_PAYLOAD - TALLY_NATS_HEADROOM;
    int per_msg = (int)(max_msg / first_size);
    assert_true(per_msg * first_size < max_msg && 1 + CUT_TRIES * (1 + 3 * per_msg) <= CUT_STREAMS);
    assert_int_equal(th_write_clock(g.clock, RING_T0), 0);
    /* S's second write (interval t) left in the rest of a cut batch, four messages in flight. */
    uint64_t before = 0;
    int tries = 0;
    int64_t t0 = 0;
    bool cut = false;
    for (; !cut && tries < CUT_TRIES; tries++) {
        t0 = th_now_ms();
        cut = cut_with_s_left(w, q, js, g.gate, cut_names + 1 + tries * (1 + 3 * per_msg), per_msg,
                              s, 2, &before);
    }
    if (!cut)
        fail_msg("the batch went at its commit_ms before S's write, %d times", CUT_TRIES);
    int64_t cut_ms = th_now_ms() - t0;
    assert_int_equal(th_write_clock(g.clock, RING_T0 + 1000), 0);
    cut_send(w, s, 3);
    wait_applied(q, s, 3);
    /* S's record waits: every flight is out */
    assert_int_equal(tf_changelog_last(js, 0) - before, 4);
    gate_open(g.gate);
    print_message("%d records of %zu bytes a message; the batch cut in %lld ms, the PubAcks held "
                  "%lld ms (try %d)\n",
                  per_msg, first_size, (long long)cut_ms, (long long)(th_now_ms() - t0), tries);
    recv_ok(w, 1 + 3 * per_msg + 2);
    /* The last message: S's one record, its ring's slots of both intervals. */
    assert_int_equal(tf_changelog_last(js, 0) - before, 5);
    m = cut_message(js, before + 5, s);
    assert_int_equal(m.records, 1);
    assert_int_equal(m.of_name, 1);
    assert_int_equal(m.kind, TD_STATE_RECORD_CHANGED);
    assert_int_equal(m.last_seq, 3);
    assert_int_equal(m.slots, 2);
    tally_client_destroy(&g.q);
    tally_client_destroy(&g.w);
    th_daemon_kill(&member[0]);
    member_clock = g.clock;
    start_commit(1, "3000", "2");
    member_clock = NULL;
    wait_taken(1, PARTITIONS);
    assert_int_equal(tally_client_new(member[1].endpoint, TIMEOUT_MS, &g.q), TALLY_OK);
    q = g.q;
    static tally_stream_info_t info;
    for (int n = 1; n <= 3; n++) { /* the last interval, the last two, all three */
        assert_int_equal(tally_query_window(q, s, (uint64_t)n * 1000, &info, NULL, NULL), TALLY_OK);
        assert_int_equal(info.hist_total, (uint64_t)n * 256);
        for (size_t v = 0; v < 4 * 256; v++)
            assert_int_equal(info.bins[v], n);
    }
    assert_int_equal(tally_query(q, s, &info), TALLY_OK);
    assert_int_equal(info.last_seq, 3);
    assert_int_equal(info.hist_total, 3 * 256);
    stop_clock_gate(&g, 1);
}

/* ---- 12c. a record past a message ------------------------------------------------------------ */

/* Waits until stream `name` (written before when seq > 1) has taken `seq`: TALLY_OK; or is
 * gone with its partition (unknown, or its partition not owned for a while): that status. */
static tally_status_t applied_or_dropped(tally_client_t *q, const char *name, uint64_t seq)
{
    static tally_stream_info_t info;
    int64_t until = th_now_ms() + TIMEOUT_MS;
    for (;;) {
        tally_status_t st = tally_query(q, name, &info);
        if (st == TALLY_OK && info.last_seq >= seq)
            return st;
        bool waiting = st == TALLY_OK || (st == TALLY_E_UNKNOWN_STREAM && seq == 1);
        if (!waiting || th_now_ms() >= until)
            return st;
        th_sleep_ms(1);
    }
}

/* On a server whose max_payload is 64 KiB, with the PubAcks held (TALLYD_TEST_ACK_GATE): four
 * writes to other streams of partition 0 fill its 4 messages in flight, so nothing more goes
 * out; then stream S's numbered rgba8 writes, each in an interval of its own (64 intervals of
 * 1 s on the test clock), each applied before the next is sent. Each write's record replaces
 * the one before it in the waiting batch and holds every ring slot written since (~1 KiB a
 * write), so S's record passes a message (60 KiB) at about the 59th write. That write fails the
 * partition at once: the log gives the record's size, just past a message, and every write of
 * S (those the test sent before it saw the partition dropped) and of the four is answered
 * not_durable; the member takes the partition again and S is unknown (none of its records was
 * stored). Let through, S's writes went on to the 64th, none dropped. */
static void test_record_past_a_message(void **state)
{
    (void)state;
    static clock_gate_t g;
    start_clock_gate(&g, RING_T0, "2");
    static char names[5][32]; /* S, then the four that fill the flights */
    partition0_names(names, 5, "over/", 0);
    tally_client_t *w = g.w, *q = g.q;
    jsCtx *js = g.js;
    uint64_t before = tf_changelog_last(js, 0);
    assert_int_equal(unlink(g.gate), 0);
    for (uint64_t i = 1; i <= 4; i++) { /* a message each, none settled */
        cut_send(w, names[i], 1);
        assert_int_equal(wait_stored(js, before, i), i);
    }
    const char *s = names[0];
    int sent = 0;
    long long lost = 0; /* partitions dropped */
    while (!lost && sent < 64) {
        assert_int_equal(th_write_clock(g.clock, RING_T0 + (uint64_t)sent * 1000), 0);
        cut_send(w, s, (uint64_t)++sent);
        tally_status_t st = applied_or_dropped(q, s, (uint64_t)sent);
        lost = th_metric(&member[0], "tallyd_nats_leases_lost_total");
        assert_true(st == TALLY_OK || lost); /* S gone with its partition only */
    }
    gate_open(g.gate);
    print_message("the partition was dropped after write %d of S\n", sent);
    assert_true(lost == 1 && sent >= 50);
    char *log = th_slurp(member[0].log_path);
    const char *hit = log ? strstr(log, "a record of ") : NULL;
    unsigned long size = hit ? strtoul(hit + strlen("a record of "), NULL, 10) : 0;
    char tail[96];
    snprintf(tail, sizeof tail, " bytes does not fit a message (max_payload %d less %u",
             SMALL_PAYLOAD, (unsigned)TALLY_NATS_HEADROOM);
    assert_non_null(hit);
    assert_non_null(strstr(hit, tail));
    free(log);
    size_t max_msg = SMALL_PAYLOAD - TALLY_NATS_HEADROOM;
    assert_true(size > max_msg && size < max_msg + 2048);
    for (int i = 0; i < 4 + sent; i++) {
        tally_reply_t r;
        tally_reply_init(&r);
        tally_status_t st = tally_recv(w, &r);
        if (st != TALLY_E_NOT_DURABLE)
            fail_msg("reply %d of %d: %s: %s", i + 1, 4 + sent, tally_status_name(st), r.error);
        tally_reply_clear(&r);
    }
    wait_taken(0, PARTITIONS + 1);
    static tally_stream_info_t info;
    assert_int_equal(tally_query(q, s, &info), TALLY_E_UNKNOWN_STREAM);
    stop_clock_gate(&g, 0);
}

/* ---- 12d. a batch on an idle partition goes at once ----------------------------------------- */

#define IDLE_WRITES 6
#define BUSY_WRITES 8 /* a batch of so many writes makes its partition busy (CL_BUSY_WRITES 4) */

/* Test 12d's busy partition k (stream 0's), its last batch of one write and its PubAcks in: A2
 * with its PubAck held goes at once, BUSY_WRITES writes behind it at commit_ms; with every
 * PubAck in, C waits commit_ms (the last batch held many writes), D goes at once (C's held one).
 * The batches at once counted: A2 and D. */
static void busy_then_idle(tally_client_t *c, uint32_t k, const char *gate)
{
    int r = IDLE_WRITES + 2;
    long long quick = quick_batches();
    assert_int_equal(unlink(gate), 0);
    uint64_t was = changelog_last(k);
    tf_send_hist(&test_fleet, c, 0, r++); /* A2 */
    wait_changelog(k, was + 1);
    for (int i = 0; i < BUSY_WRITES; i++)
        tf_send_hist(&test_fleet, c, 0, r++);
    wait_changelog(k, was + 2);
    gate_open(gate);
    for (int i = 0; i <= BUSY_WRITES; i++)
        tf_recv_applied(c);
    assert_int_equal(quick_batches(), quick + 1);
    double waited = stage_metric("sum", "batch");
    uint64_t mid = changelog_last(k);
    tf_send_hist(&test_fleet, c, 0, r++); /* C */
    tf_recv_applied(c);
    assert_int_equal(changelog_last(k), mid + 1);
    assert_int_equal(quick_batches(), quick + 1);
    assert_true(stage_metric("sum", "batch") - waited >= 0.99);
    tf_send_hist(&test_fleet, c, 0, r); /* D */
    tf_recv_applied(c);
    assert_int_equal(changelog_last(k), mid + 2);
    assert_int_equal(quick_batches(), quick + 2);
}

/* commit_ms 1 s, member a's PubAcks held by a gate (TALLYD_TEST_ACK_GATE) only where said:
 *   - IDLE_WRITES writes of stream 0, one at a time: each comes with nothing of its partition
 *     in flight, so its record goes at once, alone: IDLE_WRITES messages of one record, every
 *     batch (stage `batch`) under 0.25 s;
 *   - write A, its PubAck held (it went at once), then write B, applied, its record waiting
 *     behind A's message; the gate opens: A's PubAck leaves nothing in flight and B's record
 *     goes at once, a message of its own, its batch under 0.25 s as well;
 *   - write A2, its PubAck held, then BUSY_WRITES writes behind it: their batch goes at
 *     commit_ms; once every PubAck is in, write C finds nothing in flight but a last batch of
 *     many writes, and waits commit_ms; write D, after C's batch of one, goes at once again;
 *   - member a again with commit_when_idle off: a write on its idle partition waits commit_ms,
 *     its batch 1 s or more (the rule before it).
 * Without the rule every batch here waits commit_ms; without the PubAck's wake-up B's does;
 * without the bound on a busy partition C's goes at once; with it never lifted D's waits. The
 * times asserted are the member's own stages, 0.25 s against 1 s: none of the test's clock. */
static void test_idle_partition_at_once(void **state)
{
    (void)state;
    char dir[256], gate[300];
    start_ack_gated(dir, sizeof dir, gate, sizeof gate, "1000");
    tally_client_t *c = fleet_client();
    uint32_t k = tf_partition_of(&test_fleet, 0);
    uint64_t before = changelog_last(k); /* writes one at a time: nothing in flight at each */
    for (int r = 0; r < IDLE_WRITES; r++) {
        tf_send_hist(&test_fleet, c, 0, r);
        tf_recv_applied(c);
    }
    print_message("%d writes one at a time: %llu changelog messages, %lld batches under 0.25 s\n",
                  IDLE_WRITES, (unsigned long long)(changelog_last(k) - before), quick_batches());
    assert_int_equal(changelog_last(k) - before, IDLE_WRITES);
    for (uint64_t seq = before + 1; seq <= before + IDLE_WRITES; seq++)
        assert_int_equal(records_of(k, seq, 0), 1);
    assert_int_equal((long long)stage_metric("count", "batch"), IDLE_WRITES);
    assert_int_equal(quick_batches(), IDLE_WRITES);
    /* B behind A's message, its PubAck held; B goes at it. */
    tally_client_t *q = NULL;
    assert_int_equal(tally_client_new(member[0].endpoint, TIMEOUT_MS, &q), TALLY_OK);
    assert_int_equal(unlink(gate), 0);
    tf_send_hist(&test_fleet, c, 0, IDLE_WRITES);
    wait_changelog(k, before + IDLE_WRITES + 1);
    tf_send_hist(&test_fleet, c, 0, IDLE_WRITES + 1);
    wait_applied(q, "cl/0", seqs[0]);
    gate_open(gate);
    tf_recv_applied(c);
    tf_recv_applied(c);
    assert_int_equal(changelog_last(k) - before, IDLE_WRITES + 2);
    assert_int_equal(records_of(k, before + IDLE_WRITES + 2, 0), 1);
    assert_int_equal(quick_batches(), IDLE_WRITES + 2);
    busy_then_idle(c, k, gate);
    check_last_record(0);
    tf_check_stream(&test_fleet, c, 0);
    tally_client_destroy(&q);
    tally_client_destroy(&c);
    assert_int_equal(th_daemon_stop(&member[0], SIGTERM, TIMEOUT_MS), 0);
    member[0].pid = 0;
    /* Off: a batch waits commit_ms, idle partition or not. */
    start_commit_only(0, "15000", "1000");
    wait_taken(0, PARTITIONS);
    c = fleet_client();
    tf_send_hist(&test_fleet, c, 0, IDLE_WRITES + 2);
    tf_recv_applied(c);
    assert_int_equal((long long)stage_metric("count", "batch"), 1);
    assert_int_equal(quick_batches(), 0);
    assert_true(stage_metric("sum", "batch") >= 0.99);
    tf_check_stream(&test_fleet, c, 0);
    tally_client_destroy(&c);
    th_rmrf(dir);
}

/* ---- 13. a fleet that changes its mode, member by member ------------------------------------ */

/* Direct `replicated` to JetStream ingest and back, each owner after the first taking the
 * partitions from the one before without a clean hand-over where that loses most:
 *   - a (replicated) takes two rounds of numbered direct writes, every one answered once its
 *     record is stored (checkpoints an hour apart: only the changelog holds them), and is
 *     killed (SIGKILL);
 *   - b, an ingest worker (`direct = off`), takes every partition: it applies a's changelog and
 *     fences it (every stream equals the model, through a client over NATS), takes a round over
 *     JetStream ingest, and stops cleanly (its give-up checkpoints name the fence's sequence);
 *   - a, replicated again, takes every partition from b's checkpoints: nothing of the changelog
 *     before b's fence is applied again (a's old records over b's state would lose b's round),
 *     and every stream equals the model; a direct round after it is stored and applied.
 * A member that is not replicated used to leave the changelog alone: b lacked a's two rounds,
 * and a's records came back over b's state at a's return. */
static void test_mode_changes(void **state)
{
    (void)state;
    tf_fresh(&test_fleet);
    start(0, "3000");
    wait_taken(0, PARTITIONS);
    tally_client_t *c = fleet_client();
    write_round(c, 0);
    write_round(c, 1);
    tally_client_destroy(&c);
    th_daemon_kill(&member[0]);
    member_direct = "off";
    start(1, "3000");
    member_direct = "replicated";
    wait_taken(1, PARTITIONS);
    c = nats_client();
    tf_check_model(&test_fleet, c); /* a's answered writes, from its changelog */
    write_round(c, 2);
    tf_check_model(&test_fleet, c);
    tally_client_destroy(&c);
    assert_int_equal(th_metric(&member[1], "tallyd_nats_changelog_lost_total"), 0);
    assert_int_equal(th_daemon_stop(&member[1], SIGTERM, TIMEOUT_MS), 0);
    member[1].pid = 0;
    for (uint32_t k = 0; k < PARTITIONS; k++) /* b's checkpoints hold a's records and its fence */
        assert_int_equal(tf_manifest(k).cl_seq, changelog_last(k));
    start(0, "3000");
    check_taken_model(0);
    assert_int_equal(th_metric(&member[0], "tallyd_nats_changelog_replayed_total"), 0);
    assert_true(th_daemon_log_contains(&member[0], "changelog: nothing to replay from"));
    assert_false(th_daemon_log_contains(&member[0], "changelog: applied"));
    c = fleet_client();
    write_round(c, 3);
    tf_check_model(&test_fleet, c);
    tally_client_destroy(&c);
}

int main(void)
{
    if (tn_skip())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_answered_after_ack, stop_members),
        cmocka_unit_test_teardown(test_one_record_a_stream_a_batch, stop_members),
        cmocka_unit_test_teardown(test_kill_owner_under_load, stop_members),
        cmocka_unit_test_teardown(test_not_stored_not_durable, stop_members),
        cmocka_unit_test_teardown(test_duplicate_waits_for_record, stop_members),
        cmocka_unit_test_teardown(test_group_commit_delete_reset, stop_members),
        cmocka_unit_test_teardown(test_other_writer_fenced, stop_members),
        cmocka_unit_test_teardown(test_records_gone_before_checkpoint, stop_members),
        cmocka_unit_test_teardown(test_changelog_made_again, stop_members),
        cmocka_unit_test(test_purge_across_replica_restart),
        cmocka_unit_test_teardown(test_batch_over_max_payload, stop_members),
        cmocka_unit_test_teardown(test_writer_races_fence, stop_members),
        cmocka_unit_test_teardown(test_compaction_at_quiet_point, stop_members),
        cmocka_unit_test_teardown(test_no_purge_past_checkpoint, stop_members),
        cmocka_unit_test_teardown(test_messages_in_flight, stop_members),
        cmocka_unit_test_teardown(test_record_replaces_cut_rest, stop_members),
        cmocka_unit_test_teardown(test_record_past_a_message, stop_members),
        cmocka_unit_test_teardown(test_idle_partition_at_once, stop_members),
        cmocka_unit_test_teardown(test_mode_changes, stop_members),
    };
    const char *only = getenv("TALLY_TEST_FILTER"); /* one test by name (a mutation check) */
    if (only)
        cmocka_set_test_filter(only);
    return cmocka_run_group_tests(tests, setup, teardown);
}
