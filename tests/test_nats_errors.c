/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_errors.c — how the worker's JetStream building blocks (daemon/nats/td_nats_js.c,
 * td_nats_lease.c, td_nats_consumer.c, td_nats_ckpt.c) report what goes wrong, against a real
 * single JetStream server (issue 37):
 *   - a connection that is gone: every call answers TD_ERR_LIBRARY (no lease taken, nothing
 *     written, no key's expiry known, a first sequence of 0) with a message that names what it
 *     was doing; before it, no member is an empty list, and a heartbeat without info writes an
 *     empty key;
 *   - a user who may not create streams or consumers: the fleet is not made, and says which;
 *     one who may not write the partition count is told it was not written; one who may not
 *     list consumers makes its own and leaves the previous owner's;
 *   - a fleet that is not this worker's: another partition count, another lease TTL, a stream
 *     that captures other subjects or one more, a partition count that is not a number, no
 *     fleet at all;
 *   - an owner's first write that cannot remove its predecessor's chunks: written all the same;
 *   - a lease key still ours under a revision this holder does not know (a renewal applied
 *     after libnats stopped waiting for its answer): renewed on that revision, not a loss, nor
 *     an error until the lease runs out; a checkpoint manifest written so: committed, not
 *     fenced; a manifest deleted under its owner fences the owner's next write; a consumer
 *     name that exists and has delivered already is refused; a fetch of
 *     more bytes than a pull carries is cut to the most it may;
 *   - a message's sequence read from its ack subject: both of JetStream's forms, and nothing
 *     (0) from a subject of neither;
 *   - a listing of 2000 keys: every key, each once; with a filter, only the keys under it.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <nats/nats.h>

#include "harness.h"
#include "nats_cluster.h"
#include "tally_fleet.h"
#include "tally_nats_conn.h"
#include "td_nats_ckpt.h"
#include "td_nats_consumer.h"
#include "td_nats_js.h"
#include "td_nats_lease.h"

#define PARTITIONS 2
#define TTL_MS 4000

#define cluster tn_suite
#define nc tn_suite_nc
#define js tn_suite_js
static char msg[512];

/* `all`, the test's user; `nomake`, who may not create streams or consumers; `noinfo`, who
 * may not ask about the partitions' streams; `nopurge`, who may not write partition 0's
 * checkpoint chunks of epoch 7; `nopart`, who may not write the fleet's partition count;
 * `nolist`, who may not list a stream's consumers (their requests
 * get no answer: a permission violation, then the API's timeout). */
static const char users[] =
    "authorization { users = [\n"
    "  { user: all, password: all }\n"
    "  { user: nomake, password: nomake,\n"
    "    permissions: { publish: { allow: \">\",\n"
    "      deny: [\"$JS.API.STREAM.CREATE.>\", \"$JS.API.CONSUMER.CREATE.>\",\n"
    "             \"$JS.API.CONSUMER.DURABLE.CREATE.>\"] } } }\n"
    "  { user: noinfo, password: noinfo,\n"
    "    permissions: { publish: { allow: \">\",\n"
    "      deny: [\"$JS.API.STREAM.INFO.TALLY_P0\", \"$JS.API.STREAM.INFO.TALLY_P1\"] } } }\n"
    "  { user: nopurge, password: nopurge,\n"
    "    permissions: { publish: { allow: \">\", deny: \"$KV.TALLY_CKPT.p0.7.>\" } } }\n"
    "  { user: nopart, password: nopart,\n"
    "    permissions: { publish: { allow: \">\", deny: \"$KV.TALLY_FLEET.partitions\" } } }\n"
    "  { user: nolist, password: nolist,\n"
    "    permissions: { publish: { allow: \">\", deny: \"$JS.API.CONSUMER.NAMES.>\" } } }\n"
    "] }";

static td_nats_layout_t layout(uint32_t partitions, int64_t ttl_ms)
{
    td_nats_layout_t l = {.partitions = partitions,
                          .replicas = 1,
                          .partition_max_bytes = 16ll << 20,
                          .partition_max_age_ms = 3600 * 1000,
                          .lease_ttl_ms = ttl_ms,
                          .max_msg_size = (int32_t)natsConnection_GetMaxPayload(nc)};
    return l;
}

static int setup(void **state)
{
    (void)state;
    tn_options_t o = {.extra_conf = users, .user = "all", .password = "all"};
    if (tn_cluster_start(&cluster, 1, &o, 30000) != 0 || tn_connect(&cluster, &nc, &js) != 0)
        return -1;
    td_nats_layout_t l = layout(PARTITIONS, TTL_MS);
    if (td_nats_fleet_ensure(js, &l, msg, sizeof msg) != TD_OK) {
        fprintf(stderr, "fleet: %s\n", msg);
        return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    return tn_suite_teardown();
}

static void msg_has(const char *text)
{
    print_message("%s\n", msg);
    assert_non_null(strstr(msg, text));
}

/* A second connection as `user`, its JetStream context waiting at most wait_ms per call. */
static void connect_as(const char *user, int64_t wait_ms, natsConnection **c, jsCtx **j)
{
    char url[128];
    const char *hostport = strstr(cluster.node[0].url, "//") + 2;
    snprintf(url, sizeof url, "nats://%s:%s@%s", user, user, hostport);
    assert_int_equal(natsConnection_ConnectTo(c, url), NATS_OK);
    jsOptions jo;
    jsOptions_Init(&jo);
    jo.Wait = wait_ms;
    assert_int_equal(natsConnection_JetStream(j, *c, &jo), NATS_OK);
}

static kvStore *open_kv(jsCtx *j, const char *bucket)
{
    kvStore *kv = NULL;
    assert_int_equal(js_KeyValue(&kv, j, bucket), NATS_OK);
    return kv;
}

static void publish_n(uint32_t k, int n)
{
    char subject[48];
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, k, "anon");
    for (int i = 0; i < n; i++) {
        jsErrCode jerr = 0;
        assert_int_equal(js_Publish(NULL, js, subject, "m", 1, NULL, &jerr), NATS_OK);
    }
}

/* Every building block on a connection that is gone (closed: what a worker's calls meet after
 * its connection to NATS is lost for good) fails, saying what it was doing, and changes nothing
 * it was given as if it had succeeded. */
static void test_connection_gone(void **state)
{
    (void)state;
    natsConnection *c = NULL;
    jsCtx *j = NULL;
    connect_as("all", 2000, &c, &j);
    kvStore *leases = open_kv(j, TALLY_NATS_BUCKET_LEASES);
    kvStore *members = open_kv(j, TALLY_NATS_BUCKET_MEMBERS);
    kvStore *ckpts = open_kv(j, TALLY_NATS_BUCKET_CKPT);
    td_pull_t *pull = NULL;
    assert_int_equal(td_consumer_start(j, c, "_INBOX.errors.p1", 1, 9, 0, 1, 30000, &pull, msg,
                                       sizeof msg),
                     TD_OK);
    td_ckpt_t ck;
    uint8_t *st = NULL;
    size_t len = 0;
    bool fenced = true;
    assert_int_equal(
        td_ckpt_take(&ck, j, ckpts, 1, "gone", 9, &st, &len, &fenced, msg, sizeof msg), TD_OK);
    assert_false(fenced);
    /* No member yet: an empty list, not an error. */
    char **none = (char **)1;
    size_t count = 9;
    assert_int_equal(td_member_list(members, &none, &count, msg, sizeof msg), TD_OK);
    assert_int_equal(count, 0);
    td_member_list_free(none, count);
    /* A heartbeat without info writes the member's key all the same, empty. */
    assert_int_equal(td_member_beat(members, "quiet", NULL, msg, sizeof msg), TD_OK);
    kvEntry *beat = NULL;
    assert_int_equal(kvStore_Get(&beat, members, "quiet"), NATS_OK);
    assert_int_equal(kvEntry_ValueLen(beat), 0);
    kvEntry_Destroy(beat);
    assert_int_equal(td_member_leave(members, "quiet", msg, sizeof msg), TD_OK);
    natsConnection_Close(c);

    td_lease_t l;
    bool taken = true, lost = true;
    assert_int_equal(td_lease_acquire(leases, 1, "gone", TTL_MS, &l, &taken, msg, sizeof msg),
                     TD_ERR_LIBRARY);
    assert_false(taken);
    msg_has("reading lease p1: ");
    l.revision = 7;
    l.valid_until_ms = td_nats_now_ms() + TTL_MS;
    assert_int_equal(td_lease_renew(leases, 1, "gone", TTL_MS, &l, &lost, msg, sizeof msg),
                     TD_ERR_LIBRARY);
    assert_false(lost);
    assert_int_equal(l.revision, 7); /* kept: the lease may still be ours */
    assert_int_equal(td_lease_release(j, 1, &l, msg, sizeof msg), TD_ERR_LIBRARY);
    msg_has("releasing lease p1: ");
    assert_int_equal(l.revision, 0); /* forgotten all the same */
    assert_int_equal(td_member_beat(members, "gone", "{}", msg, sizeof msg), TD_ERR_LIBRARY);
    msg_has("heartbeat: ");
    assert_int_equal(td_member_leave(members, "gone", msg, sizeof msg), TD_ERR_LIBRARY);
    msg_has("leaving: ");
    char **ids = (char **)1;
    size_t n = 9;
    assert_int_equal(td_member_list(members, &ids, &n, msg, sizeof msg), TD_ERR_LIBRARY);
    assert_null(ids);
    assert_int_equal(n, 0);
    msg_has("listing the keys of " TALLY_NATS_BUCKET_MEMBERS);
    td_member_list_free(ids, n); /* what a caller does with a failed listing: nothing to free */
    int64_t at = 5;
    assert_int_equal(td_kv_expiry(leases, "p1", TTL_MS, &at), TD_ERR_LIBRARY);
    assert_int_equal(at, 0); /* no expiry known: the caller looks at its next heartbeat */

    kvStore *kv = (kvStore *)1;
    assert_int_equal(td_nats_kv_open(j, TALLY_NATS_BUCKET_LEASES, TTL_MS, 1, &kv, msg, sizeof msg),
                     TD_ERR_LIBRARY);
    assert_null(kv);
    msg_has("key-value bucket " TALLY_NATS_BUCKET_LEASES ": ");
    int64_t ttl = 5;
    assert_int_equal(td_nats_bucket_ttl(j, TALLY_NATS_BUCKET_LEASES, &ttl), TD_ERR_LIBRARY);
    assert_int_equal(ttl, 0);
    uint32_t parts = 0;
    assert_int_equal(td_nats_read_partitions(j, &parts, msg, sizeof msg), TD_ERR_LIBRARY);
    assert_int_equal(parts, 0);
    msg_has(TALLY_NATS_BUCKET_FLEET ": ");
    td_nats_layout_t lay = layout(PARTITIONS, TTL_MS);
    assert_int_equal(td_nats_fleet_ensure(j, &lay, msg, sizeof msg), TD_ERR_LIBRARY);
    msg_has("key-value bucket " TALLY_NATS_BUCKET_FLEET ": ");

    td_pull_t *again = NULL;
    assert_int_equal(td_consumer_start(j, c, "_INBOX.errors.p1b", 1, 9, 1, 1, 30000, &again, msg,
                                       sizeof msg),
                     TD_ERR_LIBRARY);
    assert_null(again);
    msg_has("creating consumer ");
    td_pull_destroy(&again); /* none made: nothing to close */
    assert_null(again);
    natsMsgList list;
    assert_int_equal(td_consumer_fetch(pull, 10, 0, 100, &list, msg, sizeof msg), TD_ERR_LIBRARY);
    assert_int_equal(list.Count, 0);
    assert_null(list.Msgs);
    msg_has("fetch: ");
    assert_int_equal(td_consumer_ack_sync(c, "$JS.ACK.x", 200, msg, sizeof msg), TD_ERR_LIBRARY);
    msg_has("acknowledging: ");
    assert_int_equal(td_partition_first_seq(j, 1), 0);
    td_pull_destroy(&pull);

    /* A checkpoint: inline, its compare-and-set fails and the manifest cannot be read after it;
     * chunked, the first chunk cannot be written. */
    assert_int_equal(td_ckpt_write(&ck, 3, (const uint8_t *)"abc", 3, &fenced, msg, sizeof msg),
                     TD_ERR_LIBRARY);
    assert_false(fenced);
    msg_has("reading checkpoint p1: ");
    size_t big_len = TD_CKPT_CHUNK_BYTES + 10;
    uint8_t *big = calloc(1, big_len);
    assert_non_null(big);
    assert_int_equal(td_ckpt_write(&ck, 4, big, big_len, &fenced, msg, sizeof msg),
                     TD_ERR_LIBRARY);
    msg_has("writing checkpoint chunk p1.9.");
    free(big);
    td_ckpt_manifest_t m;
    assert_int_equal(td_ckpt_read(j, 1, &m, &st, &len, msg, sizeof msg), TD_ERR_LIBRARY);
    assert_null(st);
    msg_has("reading checkpoint p1: ");
    assert_int_equal(td_ckpt_take(&ck, j, ckpts, 1, "gone", 10, &st, &len, &fenced, msg,
                                  sizeof msg),
                     TD_ERR_LIBRARY);
    assert_null(st);

    kvStore_Destroy(leases);
    kvStore_Destroy(members);
    kvStore_Destroy(ckpts);
    jsCtx_Destroy(j);
    natsConnection_Destroy(c);
}

/* A user who may not create streams: a fleet missing its dead-letter stream is refused at it,
 * saying so; one who may not create consumers cannot take a partition; one who may not look at
 * the partitions' streams cannot check the fleet. */
static void test_no_permission(void **state)
{
    (void)state;
    natsConnection *c = NULL;
    jsCtx *j = NULL;
    connect_as("nomake", 500, &c, &j);
    /* A fleet on a bucket of its own that does not exist yet: its dead-letter stream is the
     * first stream it lacks once the partitions' exist; here TALLY_DEAD is deleted first. */
    jsErrCode jerr = 0;
    assert_int_equal(js_DeleteStream(js, TALLY_NATS_DEAD_STREAM, NULL, &jerr), NATS_OK);
    td_nats_layout_t l = layout(PARTITIONS, TTL_MS);
    assert_int_equal(td_nats_fleet_ensure(j, &l, msg, sizeof msg), TD_ERR_LIBRARY);
    msg_has("cannot create stream " TALLY_NATS_DEAD_STREAM " (1 replicas): ");
    assert_int_equal(td_nats_fleet_ensure(js, &l, msg, sizeof msg), TD_OK); /* as `all` */

    td_pull_t *pull = NULL;
    assert_int_equal(td_consumer_start(j, c, "_INBOX.errors.nomake", 0, 3, 0, 1, 30000, &pull,
                                       msg, sizeof msg),
                     TD_ERR_LIBRARY);
    assert_null(pull);
    msg_has("creating consumer " TALLY_NATS_CONSUMER_PREFIX "0-3-0 at 1: ");
    jsCtx_Destroy(j);
    natsConnection_Destroy(c);

    /* One who may not look at the partitions' streams: the fleet is not checked, and a
     * partition's first sequence is unknown (0). */
    connect_as("noinfo", 500, &c, &j);
    assert_int_equal(td_nats_fleet_ensure(j, &l, msg, sizeof msg), TD_ERR_LIBRARY);
    msg_has("stream " TALLY_NATS_STREAM_PREFIX "0: ");
    assert_int_equal(td_partition_first_seq(j, 0), 0);
    jsCtx_Destroy(j);
    natsConnection_Destroy(c);

    /* One who may not write the partition count, on a NATS without a fleet: the count is
     * neither written nor there, which the worker says (and tries again at its start). */
    assert_int_equal(js_DeleteKeyValue(js, TALLY_NATS_BUCKET_FLEET), NATS_OK);
    connect_as("nopart", 500, &c, &j);
    assert_int_equal(td_nats_fleet_ensure(j, &l, msg, sizeof msg), TD_ERR_LIBRARY);
    msg_has(TALLY_NATS_BUCKET_FLEET "/" TALLY_NATS_KEY_PARTITIONS " not written: ");
    jsCtx_Destroy(j);
    natsConnection_Destroy(c);
    assert_int_equal(td_nats_fleet_ensure(js, &l, msg, sizeof msg), TD_OK); /* as `all` */

    /* One who may not list consumers: its consumer is made all the same, and the previous
     * owner's is left behind (td_consumer_delete_others). */
    td_pull_t *old = NULL;
    assert_int_equal(td_consumer_start(js, nc, "_INBOX.errors.old", 0, 5, 0, 1, 30000, &old, msg,
                                       sizeof msg),
                     TD_OK);
    td_pull_destroy(&old);
    connect_as("nolist", 500, &c, &j);
    assert_int_equal(td_consumer_start(j, c, "_INBOX.errors.nolist", 0, 6, 0, 1, 30000, &pull,
                                       msg, sizeof msg),
                     TD_OK);
    td_consumer_delete_others(j, pull);
    jsConsumerInfo *ci = NULL;
    assert_int_equal(js_GetConsumerInfo(&ci, js, TALLY_NATS_STREAM_PREFIX "0",
                                        TALLY_NATS_CONSUMER_PREFIX "0-5-0", NULL, &jerr),
                     NATS_OK);
    jsConsumerInfo_Destroy(ci);
    td_pull_destroy(&pull);
    jsCtx_Destroy(j);
    natsConnection_Destroy(c);
}

/* What a worker finds when the fleet on this NATS is not the one it is configured for. */
static void test_not_this_fleet(void **state)
{
    (void)state;
    td_nats_layout_t l = layout(PARTITIONS + 1, TTL_MS);
    assert_int_equal(td_nats_fleet_ensure(js, &l, msg, sizeof msg), TD_ERR_CONFIG);
    msg_has("the fleet has 2 partitions, this worker is configured for 3");
    l = layout(PARTITIONS, TTL_MS * 2);
    assert_int_equal(td_nats_fleet_ensure(js, &l, msg, sizeof msg), TD_ERR_CONFIG);
    msg_has("has a TTL of 4000 ms, not 8000");
    int64_t ttl = 0;
    assert_int_equal(td_nats_bucket_ttl(js, TALLY_NATS_BUCKET_LEASES, &ttl), TD_OK);
    assert_int_equal(ttl, TTL_MS);
    assert_int_equal(td_nats_bucket_ttl(js, "TALLY_NO_SUCH_BUCKET", &ttl), TD_ERR_CONFIG);
    assert_int_equal(ttl, 0);

    /* Partition 1's stream captures another subject (an older tallyd's). */
    char name[32];
    tally_fleet_name(name, sizeof name, TALLY_NATS_STREAM_PREFIX, 1);
    jsErrCode jerr = 0;
    jsStreamInfo *si = NULL;
    assert_int_equal(js_GetStreamInfo(&si, js, name, NULL, &jerr), NATS_OK);
    const char *old = "tally.in.1";
    jsStreamConfig sc = *si->Config;
    sc.Subjects = &old;
    sc.SubjectsLen = 1;
    jsStreamInfo *si2 = NULL;
    assert_int_equal(js_UpdateStream(&si2, js, &sc, NULL, &jerr), NATS_OK);
    jsStreamInfo_Destroy(si2);
    l = layout(PARTITIONS, TTL_MS);
    assert_int_equal(td_nats_fleet_ensure(js, &l, msg, sizeof msg), TD_ERR_CONFIG);
    msg_has("does not capture exactly");
    /* Its own subjects and another one besides: not exactly what a worker reads either. */
    const char *two[] = {si->Config->Subjects[0], "tally.old.1"};
    sc.Subjects = two;
    sc.SubjectsLen = 2;
    assert_int_equal(js_UpdateStream(&si2, js, &sc, NULL, &jerr), NATS_OK);
    jsStreamInfo_Destroy(si2);
    assert_int_equal(td_nats_fleet_ensure(js, &l, msg, sizeof msg), TD_ERR_CONFIG);
    msg_has("stream " TALLY_NATS_STREAM_PREFIX "1 exists and does not capture exactly "
            "tally.in.1.*");
    sc = *si->Config; /* back as it was */
    assert_int_equal(js_UpdateStream(&si2, js, &sc, NULL, &jerr), NATS_OK);
    jsStreamInfo_Destroy(si2);
    jsStreamInfo_Destroy(si);
    assert_int_equal(td_nats_fleet_ensure(js, &l, msg, sizeof msg), TD_OK);

    /* The partition count: not a number, then no fleet at all. */
    kvStore *fleet = open_kv(js, TALLY_NATS_BUCKET_FLEET);
    uint64_t rev = 0;
    assert_int_equal(kvStore_PutString(&rev, fleet, TALLY_NATS_KEY_PARTITIONS, "two"), NATS_OK);
    uint32_t parts = 0;
    assert_int_equal(td_nats_read_partitions(js, &parts, msg, sizeof msg), TD_ERR_CONFIG);
    msg_has("holds 'two', not a partition count");
    assert_int_equal(parts, 0);
    const char *bad[] = {"0", "", "2x", "99999999", "222222222222222222222"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        assert_int_equal(kvStore_PutString(&rev, fleet, TALLY_NATS_KEY_PARTITIONS, bad[i]),
                         NATS_OK);
        assert_int_equal(td_nats_read_partitions(js, &parts, msg, sizeof msg), TD_ERR_CONFIG);
        msg_has("not a partition count");
    }
    assert_int_equal(kvStore_PutString(&rev, fleet, TALLY_NATS_KEY_PARTITIONS, "2"), NATS_OK);
    assert_int_equal(td_nats_read_partitions(js, &parts, msg, sizeof msg), TD_OK);
    assert_int_equal(parts, PARTITIONS);
    kvStore_Destroy(fleet);
    assert_int_equal(js_DeleteKeyValue(js, TALLY_NATS_BUCKET_FLEET), NATS_OK);
    assert_int_equal(td_nats_read_partitions(js, &parts, msg, sizeof msg), TD_ERR_CONFIG);
    msg_has("no tallyd fleet on this NATS");
    assert_int_equal(td_nats_fleet_ensure(js, &l, msg, sizeof msg), TD_OK); /* made again */
    assert_int_equal(td_nats_read_partitions(js, &parts, msg, sizeof msg), TD_OK);
    assert_int_equal(parts, PARTITIONS);
}

/* The lease key holds this member's id under a revision its holder did not write (a renewal
 * whose answer came after libnats stopped waiting, applied all the same: a loaded server): the
 * renewal takes that revision and renews on it, where it used to fail on it until the lease ran
 * out (test_web_fleet lost partitions so under load). Another holder's: lost. */
static void test_lease_unknown_revision(void **state)
{
    (void)state;
    kvStore *leases = open_kv(js, TALLY_NATS_BUCKET_LEASES);
    td_lease_t l;
    bool taken = false, lost = true;
    assert_int_equal(td_lease_acquire(leases, 1, "A", TTL_MS, &l, &taken, msg, sizeof msg), TD_OK);
    assert_true(taken);
    uint64_t rev = 0;
    assert_int_equal(kvStore_PutString(&rev, leases, "p1", "A"), NATS_OK);
    assert_int_equal(td_lease_renew(leases, 1, "A", TTL_MS, &l, &lost, msg, sizeof msg), TD_OK);
    assert_false(lost);
    assert_true(l.revision > rev); /* renewed on the revision it found */
    kvEntry *e = NULL;
    assert_int_equal(kvStore_Get(&e, leases, "p1"), NATS_OK);
    assert_int_equal(kvEntry_Revision(e), l.revision);
    kvEntry_Destroy(e);
    td_lease_t none = {0}; /* no revision: nothing renewed, though the key names A */
    assert_int_equal(td_lease_renew(leases, 1, "A", TTL_MS, &none, &lost, msg, sizeof msg), TD_OK);
    assert_true(lost);
    assert_int_equal(kvStore_PutString(&rev, leases, "p1", "B"), NATS_OK);
    assert_int_equal(td_lease_renew(leases, 1, "A", TTL_MS, &l, &lost, msg, sizeof msg), TD_OK);
    assert_true(lost);
    assert_int_equal(l.revision, 0);
    /* No revision at all: nothing to renew, and the key is B's: lost. */
    assert_int_equal(td_lease_renew(leases, 1, "A", TTL_MS, &l, &lost, msg, sizeof msg), TD_OK);
    assert_true(lost);
    assert_int_equal(kvStore_Delete(leases, "p1"), NATS_OK);
    kvStore_Destroy(leases);
}

/* A checkpoint write that the server applied but answered after libnats stopped waiting (a
 * loaded server): the owner's next try meets its own manifest at a revision it does not know.
 * Byte for byte the manifest it writes: committed (not fenced, which used to drop the
 * partition), at that revision, and the next write goes on from there. An earlier manifest of
 * its own (its epoch and member) there: it writes again on that revision. Another owner's
 * (another epoch): fenced, as before. */
static void test_ckpt_write_answered_late(void **state)
{
    (void)state;
    kvStore *ckpts = open_kv(js, TALLY_NATS_BUCKET_CKPT);
    td_ckpt_t c;
    uint8_t *st = NULL;
    size_t len = 0;
    bool fenced = true;
    assert_int_equal(td_ckpt_take(&c, js, ckpts, 1, "A", 9, &st, &len, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_false(fenced);
    free(st);
    td_ckpt_t before = c; /* what the owner knows if the next write's answer is lost */
    assert_int_equal(td_ckpt_write(&c, 5, (const uint8_t *)"five", 4, &fenced, msg, sizeof msg),
                     TD_OK);
    uint64_t applied = c.revision;
    td_ckpt_t late = before;
    assert_int_equal(td_ckpt_write(&late, 5, (const uint8_t *)"five", 4, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_false(fenced);
    assert_int_equal(late.revision, applied);
    assert_int_equal(td_ckpt_write(&late, 6, (const uint8_t *)"six", 3, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_false(fenced);
    /* An earlier write of its own landed, and its answer and its read-back were both lost (a
     * worker paused past the server's write deadline): the manifest there has this owner's
     * epoch and member, which no other owner writes, so the next write goes on from its
     * revision: not fenced (which used to drop the partition). */
    late = before;
    assert_int_equal(td_ckpt_write(&late, 7, (const uint8_t *)"seven", 5, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_false(fenced);
    td_ckpt_manifest_t m;
    assert_int_equal(td_ckpt_read(js, 1, &m, &st, &len, msg, sizeof msg), TD_OK);
    assert_int_equal(m.applied_seq, 7);
    assert_int_equal(len, 5);
    assert_memory_equal(st, "seven", 5);
    free(st);
    /* Another owner's take (its own epoch) fences it: the stale owner's next write is fenced. */
    td_ckpt_t other;
    assert_int_equal(
        td_ckpt_take(&other, js, ckpts, 1, "B", 11, &st, &len, &fenced, msg, sizeof msg), TD_OK);
    assert_false(fenced);
    free(st);
    assert_int_equal(td_ckpt_write(&late, 8, (const uint8_t *)"eight", 5, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_true(fenced);
    assert_int_equal(td_ckpt_read(js, 1, &m, &st, &len, msg, sizeof msg), TD_OK);
    assert_int_equal(m.applied_seq, 7);
    assert_int_equal(m.epoch, 11);
    free(st);
    /* The manifest deleted under its owner (by hand): the owner's next write is fenced, and
     * does not make it again. */
    assert_int_equal(td_ckpt_take(&c, js, ckpts, 1, "A", 10, &st, &len, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_false(fenced);
    free(st);
    assert_int_equal(kvStore_Delete(ckpts, "p1"), NATS_OK);
    assert_int_equal(td_ckpt_write(&c, 8, (const uint8_t *)"eight", 5, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_true(fenced);
    msg_has("checkpoint of partition 1 was written by another worker (revision 0,");
    assert_int_equal(td_ckpt_read(js, 1, &m, &st, &len, msg, sizeof msg), TD_ERR_CONFIG);
    kvStore_Destroy(ckpts);
}

/* Publishes to race.x on a connection of its own until told to stop: messages of 128 KiB,
 * whose copy keeps the subscriber's read loop in the middle of a delivery most of the time. */
static atomic_bool flooding;
static void *flood(void *arg)
{
    (void)arg;
    natsConnection *c = NULL;
    jsCtx *j = NULL;
    connect_as("all", 1000, &c, &j);
    static const char data[128 << 10];
    while (atomic_load(&flooding)) {
        for (int i = 0; i < 10; i++)
            natsConnection_Publish(c, "race.x", data, sizeof data);
        natsConnection_Flush(c);
    }
    jsCtx_Destroy(j);
    natsConnection_Destroy(c);
    return NULL;
}

/* Subscriptions closed while messages keep coming to them, as a partition's reader inbox (a
 * pull still open), a list's inbox (late answers) and the questions' subscriptions at a stop
 * are: libnats 3.4.1's read loop may be delivering to one as it goes, and a plain
 * natsSubscription_Destroy then frees what the read loop is about to lock (with it, this test
 * died of SIGSEGV within its first seconds, most often its first rounds, on the 2-core box; a
 * bare abort() and hangs are the other endings, as test_web_fleet's workers met at their
 * stop); tally__nats_sub_close never. */
static void test_sub_closed_while_delivered(void **state)
{
    (void)state;
    pthread_t t[2];
    atomic_store(&flooding, true);
    for (int i = 0; i < 2; i++)
        assert_int_equal(pthread_create(&t[i], NULL, flood, NULL), 0);
    int64_t until = th_now_ms() + 4000;
    int rounds = 0;
    for (; rounds < 1000 && (rounds < 50 || th_now_ms() < until); rounds++) {
        natsSubscription *sub = NULL;
        assert_int_equal(natsConnection_SubscribeSync(&sub, nc, "race.x"), NATS_OK);
        natsMsg *m = NULL;
        assert_int_equal(natsSubscription_NextMsg(&m, sub, 5000), NATS_OK);
        natsMsg_Destroy(m);
        tally__nats_sub_close(nc, &sub);
        assert_null(sub);
    }
    atomic_store(&flooding, false);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    print_message("%d subscriptions closed while delivered to\n", rounds);
}

/* A consumer name that exists and has delivered already is not taken over (it would not start
 * where this owner needs it); a message that is not JetStream's has no sequence. */
static void test_consumer_exists(void **state)
{
    (void)state;
    publish_n(1, 3);
    td_pull_t *pull = NULL, *again = NULL;
    assert_int_equal(td_consumer_start(js, nc, "_INBOX.errors.c1", 1, 40, 0, 1, 30000, &pull, msg,
                                       sizeof msg),
                     TD_OK);
    natsMsgList list;
    int got = 0;
    for (int round = 0; round < 20 && got == 0; round++) {
        assert_int_equal(td_consumer_fetch(pull, 10, 0, 500, &list, msg, sizeof msg), TD_OK);
        got += list.Count;
        if (list.Count) {
            uint64_t pending = 99;
            assert_true(td_nats_msg_seq_pending(list.Msgs[0], &pending) >= 1);
            assert_true(pending < 99);
        }
        natsMsgList_Destroy(&list);
    }
    assert_true(got > 0);
    assert_int_equal(td_consumer_start(js, nc, "_INBOX.errors.c1b", 1, 40, 0, 1, 30000, &again,
                                       msg, sizeof msg),
                     TD_ERR_LIBRARY);
    assert_null(again);
    msg_has("it exists and has delivered already");
    /* A fetch asking for more bytes than a pull may carry is cut to the most it may
     * (TD_NATS_FETCH_MAX_BYTES), not refused: the next messages come. */
    publish_n(1, 2);
    int more = 0;
    for (int round = 0; round < 20 && more < 2; round++) {
        assert_int_equal(td_consumer_fetch(pull, 10, TD_NATS_FETCH_MAX_BYTES * 4, 500, &list, msg,
                                           sizeof msg),
                         TD_OK);
        more += list.Count;
        natsMsgList_Destroy(&list);
    }
    assert_true(more >= 2);
    td_pull_destroy(&pull);

    natsMsg *plain = NULL;
    assert_int_equal(natsMsg_Create(&plain, "x", NULL, "y", 1), NATS_OK);
    uint64_t pending = 5;
    assert_int_equal(td_nats_msg_seq_pending(plain, &pending), 0);
    assert_int_equal(pending, 0);
    assert_int_equal(td_nats_msg_seq(plain), 0);
    natsMsg_Destroy(plain);
}

/* A message's stream sequence and pending count read from its ack subject (td_nats_consumer.c's
 * ack_seq, both of JetStream's forms): the fields named, and 0 for a subject that is neither
 * form (the NATS C client's own reading, the fallback, refuses those too). */
static void test_ack_subjects(void **state)
{
    (void)state;
    static const struct {
        const char *reply;
        uint64_t seq, pending;
    } cases[] = {
        {"$JS.ACK.TALLY_P0.c.1.42.7.1700000000000000000.5", 42, 5},              /* 9 tokens */
        {"$JS.ACK.dom.hash.TALLY_P0.c.1.43.7.1700000000000000000.6", 43, 6},     /* 11 */
        {"$JS.ACK.dom.hash.TALLY_P0.c.1.44.7.1700000000000000000.7.tok", 44, 7}, /* 12 */
        {"$JS.ACK.TALLY_P0.c.1.42.7.1700000000000000000", 0, 0},                 /* 8 tokens */
        {"$JS.ACK.x.TALLY_P0.c.1.42.7.1700000000000000000.5", 0, 0},             /* 10 tokens */
        {"$JS.ACK.TALLY_P0.c.1.x42.7.1700000000000000000.5", 0, 0},              /* not a number */
        {"$JS.ACK.TALLY_P0.c.1.42x.7.1700000000000000000.5", 0, 0}, /* a number and more */
        {"$JS.ACK.TALLY_P0.c.1.42.7.1700000000000000000.", 0, 0},   /* no pending count */
        {"$JS.ACK.a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p", 0, 0},          /* 18 tokens */
        {"$JS.NAK.TALLY_P0.c.1.42.7.1700000000000000000.5", 0, 0},  /* not an ack subject */
        {"$JS.ACK.dom.ACCHASH.TALLY_P3.c.2.77.18.1733190000.0.rnd", 77, 0}, /* 12, pending 0 */
        {"$JS.ACK.S.c.1..7.1700.9", 0, 0},                          /* an empty sequence */
        {"$JS.ACKS.S.c.1.42.7.1700.9", 0, 0},                       /* not $JS.ACK */
        {"_INBOX.S.c.1.42.7.1700.9.a", 0, 0},                       /* an inbox */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        natsMsg *m = NULL;
        assert_int_equal(natsMsg_Create(&m, "x", cases[i].reply, "y", 1), NATS_OK);
        uint64_t pending = 99;
        uint64_t seq = td_nats_msg_seq_pending(m, &pending);
        if (seq != cases[i].seq || pending != cases[i].pending)
            fail_msg("%s: seq %llu pending %llu, not %llu and %llu", cases[i].reply,
                     (unsigned long long)seq, (unsigned long long)pending,
                     (unsigned long long)cases[i].seq, (unsigned long long)cases[i].pending);
        natsMsg_Destroy(m);
    }
}

/* An owner's first write removes its predecessor's chunks; when a removal fails the checkpoint
 * is written all the same (TD_OK, not fenced, read back), and the message says why. */
static void test_ckpt_old_chunks_not_removed(void **state)
{
    (void)state;
    kvStore *ckpts = open_kv(js, TALLY_NATS_BUCKET_CKPT);
    size_t big_len = TD_CKPT_CHUNK_BYTES + 10;
    uint8_t *big = calloc(1, big_len);
    assert_non_null(big);
    td_ckpt_t a, b;
    uint8_t *st = NULL;
    size_t len = 0;
    bool fenced = true;
    assert_int_equal(
        td_ckpt_take(&a, js, ckpts, 0, "A", 7, &st, &len, &fenced, msg, sizeof msg), TD_OK);
    assert_int_equal(td_ckpt_write(&a, 20, big, big_len, &fenced, msg, sizeof msg), TD_OK);
    assert_int_equal(a.cur.chunks, 2);

    natsConnection *c = NULL;
    jsCtx *j = NULL;
    connect_as("nopurge", 500, &c, &j);
    kvStore *kv = open_kv(j, TALLY_NATS_BUCKET_CKPT);
    assert_int_equal(td_ckpt_take(&b, j, kv, 0, "B", 8, &st, &len, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_false(fenced);
    assert_int_equal(len, big_len);
    free(st);
    assert_int_equal(td_ckpt_write(&b, 21, (const uint8_t *)"small", 5, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_false(fenced);
    msg_has("removing old checkpoint chunks: ");
    td_ckpt_manifest_t m;
    assert_int_equal(td_ckpt_read(js, 0, &m, &st, &len, msg, sizeof msg), TD_OK);
    assert_int_equal(m.applied_seq, 21);
    assert_string_equal(m.member, "B");
    assert_int_equal(len, 5);
    assert_memory_equal(st, "small", 5);
    free(st);
    kvEntry *e = NULL; /* still there */
    assert_int_equal(kvStore_Get(&e, ckpts, "p0.7.1.0"), NATS_OK);
    kvEntry_Destroy(e);
    free(big);
    kvStore_Destroy(kv);
    jsCtx_Destroy(j);
    natsConnection_Destroy(c);
    kvStore_Destroy(ckpts);
}

/* A listing of a bucket of 2000 keys (a fleet's checkpoint chunks can be as many): every key,
 * each once, five times over; with a filter, only the
 * keys under it. libnats 3.4.1's kvStore_Keys subtracted the time since the listing began after
 * each key and timed out within milliseconds on most listings of 1000 keys (bench/NOTES.md,
 * "The listing that timed out"). */
static void test_keys_listed_all(void **state)
{
    (void)state;
    enum { KEYS = 2000 };
    kvConfig kc;
    kvConfig_Init(&kc);
    kc.Bucket = "MANY";
    kvStore *kv = NULL;
    assert_int_equal(js_CreateKeyValue(&kv, js, &kc), NATS_OK);
    for (int i = 0; i < KEYS; i++) {
        char key[32];
        snprintf(key, sizeof key, "a.%d", i);
        uint64_t rev = 0;
        assert_int_equal(kvStore_PutString(&rev, kv, key, "{}"), NATS_OK);
    }
    uint64_t rev = 0;
    assert_int_equal(kvStore_PutString(&rev, kv, "b.only", "{}"), NATS_OK);
    assert_int_equal(kvStore_PutString(&rev, kv, "a.gone", "{}"), NATS_OK);
    assert_int_equal(kvStore_Delete(kv, "a.gone"), NATS_OK);
    for (int round = 0; round < 5; round++) {
        char **keys = NULL;
        size_t n = 0;
        if (td_nats_kv_keys(kv, "a.>", &keys, &n, msg, sizeof msg) != TD_OK)
            fail_msg("listing %d: %s", round, msg);
        assert_int_equal(n, KEYS);
        static bool seen[KEYS];
        memset(seen, 0, sizeof seen);
        for (size_t i = 0; i < n; i++) {
            int at = -1;
            assert_int_equal(sscanf(keys[i], "a.%d", &at), 1);
            assert_true(at >= 0 && at < KEYS && !seen[at]);
            seen[at] = true;
        }
        td_nats_kv_keys_free(keys, n);
    }
    char **all = NULL;
    size_t n = 0;
    assert_int_equal(td_member_list(kv, &all, &n, msg, sizeof msg), TD_OK);
    assert_int_equal(n, KEYS + 1); /* the a's and b.only; a.gone deleted */
    td_member_list_free(all, n);
    kvStore_Destroy(kv);
    assert_int_equal(js_DeleteKeyValue(js, "MANY"), NATS_OK);
}

int main(void)
{
    if (tn_skip())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_connection_gone),
        cmocka_unit_test(test_no_permission),
        cmocka_unit_test(test_not_this_fleet),
        cmocka_unit_test(test_lease_unknown_revision),
        cmocka_unit_test(test_ckpt_write_answered_late),
        cmocka_unit_test(test_sub_closed_while_delivered),
        cmocka_unit_test(test_consumer_exists),
        cmocka_unit_test(test_ack_subjects),
        cmocka_unit_test(test_ckpt_old_chunks_not_removed),
        cmocka_unit_test(test_keys_listed_all),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
