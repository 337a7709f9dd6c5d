/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_route.c — direct mode (PROTOCOL.md §13 "Direct mode"; issue 33, first step) against
 * a real 3-node NATS cluster (tests/lib/nats_cluster.c), with tallyd members started with
 * [nats] direct = local:
 *   1. routing: the owner of a stream's partition takes its requests over ZeroMQ; another member
 *      answers `not_owner` naming the owner and its endpoint (writes and queries alike, counted
 *      in its metrics); over its HTTP API a read is asked of the owner and a write is answered
 *      421 `not_owner`; the endpoints are in TALLY_ENDPOINTS; info says nats_direct=local;
 *   2. a hand-over: one member owns every partition and takes numbered hist requests from the
 *      fleet client (tally_client_new_fleet) with checkpoints an hour apart, so only the
 *      give-up's checkpoint can carry them; a second member joins, the first gives half the
 *      partitions up; the fleet client, still sending to the first, follows its not_owner
 *      answers; every stream equals the model (tests/lib/reference.c) on its new owner; then
 *      the first stops with numbered requests queued to it, and those it does not apply are
 *      sent to the partitions' next owner in their order;
 *   3. kill -9 of an owner: its partitions checkpointed (nats_direct_uncommitted 0), it is
 *      stopped (SIGSTOP) with numbered requests sent to it and unanswered, then killed; the
 *      fleet client sends them again to the new owner once it has taken over, which applies each
 *      exactly once (the model, last_seq); an unnumbered write sent with them is answered
 *      `transport` (it may or may not have been applied) and was not, while requests that
 *      change nothing (no stream) are sent again; an owner stopped past
 *      its lease with direct writes since its checkpoint drops its partitions when woken, and
 *      its nats_direct_uncommitted with them;
 *   3b. an owner killed (SIGKILL) before the next send to it: the fleet client waits a probe
 *      for its connection, not its whole timeout, and asks a push's last_seq of, and sends each
 *      stream's next numbered batch to, the new owner once it holds the partition: all answered
 *      within REROUTE_BOUND_MS, each applied once (the model, last_seq); `streams` through the
 *      fleet client lists every stream once, gathered from both owners, then from the one left;
 *   4. what is refused: an unknown [nats] direct value, at start;
 *      a fleet client on a NATS without a fleet in direct mode;
 *   4b. a stream's order across owners, against fake members (ROUTER sockets the buckets
 *      name, answering by the sequence rules): seq 1 answered `not_owner` and seq 2
 *      `sequence_gap` by an owner taking over, both sent again in order within 800 ms and
 *      answered OK; seq 1 unanswered and seq 2 answered `shutdown` by a stopping owner, the
 *      partition moved: the new owner gets seq 1 then seq 2; an owner answering `not_owner`
 *      naming none, always: asked again until the timeout, which names that answer;
 *   5. shared memory through the fleet client (issue 33): one region, registered with each
 *      member when first used there; numbered hist by reference to every stream, while member a
 *      owns them all, then after b joins on "another host" (TALLYD_TEST_HOST_ID): b's streams
 *      answered TALLY_E_ARG naming route-b (a follow-up refused before it left), a's applied;
 *      b stopped, then restarted on this host: b's streams follow a's not_owner to b and the
 *      region is registered there on the way; each reply and each stream equal to the model; a
 *      stable filter into an output region on each member, that region destroyed: released on
 *      both (tallyd_shm_regions); a restarted at its endpoint: the region registered there
 *      again (its regions went with its process); b stopped with requests by reference in
 *      flight, then killed: each sent again to a with a's handle (b's would be bad_ref there),
 *      applied once; the CLI's `--fleet ... hist --shm`;
 *   5b. members whose records say they cannot take a memfd (no host=, another host, no shm=),
 *      faked in the buckets in front of one plain tallyd: each refused, named; a region of
 *      another client refused; one past the member's regions per peer refused, said, and one
 *      to a member whose record claims a side channel its tallyd does not offer;
 *      shared memory over a client over NATS refused;
 *   5c. a shared-memory hist over the owner's max_batch through the fleet client: cut into
 *      pieces of the owner's max_batch, one reply summing them (a send of the whole: too_large);
 *   6. CURVE through the fleet client: members with CURVE on publish their server keys (curve=);
 *      a fleet client with an allowed key pair reaches both, one without keys or with another
 *      member's server key pinned is refused at once, named; the CLI's --fleet --client-key; a
 *      client with keys sends nothing to a member that publishes none;
 *   6b. a partition moving to a member with another key than the pinned one, a request of it
 *      unanswered: answered TALLY_E_ARG within a few checks, named, not after the timeout;
 *   7. one member past the fleet client's 64: refused at once (TALLY_E_ARG), said.
 * Waits are bounded loops on what the cluster or the members report; one time is asserted (3b).
 */
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>
#include <nats/nats.h>
#include <zmq.h>

#include "fleet_helpers.h"
#include "harness.h"
#include "nats_cluster.h"
#include "reference.h"
#include "stream_check.h"
#include "tally.h"
#include "tally_fleet.h"
#include "tally_proto.h"
#include "td_nats_lease.h"

#define PARTITIONS 4
#define STREAMS 16
#define TIMEOUT_MS 30000
#define API_TOKEN "route-test-api-token-0123456789"  /* 16 characters at least */

static char msg[512];
static kvStore *leases;
static th_daemon_t member[2];
static const char *const ids[2] = {"route-a", "route-b"};
/* The model: each stream's u8 histogram and the last seq sent to it. */
static uint64_t model[STREAMS][256];
static uint64_t seqs[STREAMS];
static const tf_fleet_t test_fleet = {"route", STREAMS, model, seqs, PARTITIONS, member, ids, 2};

static int setup(void **state)
{
    (void)state;
    return tn_suite_setup(3);
}

static int stop_members(void **state)
{
    (void)state;
    tf_members_end(&test_fleet);
    return 0;
}

/* The end of a test: each member still running stops on SIGTERM (its partitions given up,
 * direct writes checkpointed) and exits 0 (under ASan: without a leak). */
static void stop_clean(void)
{
    for (int i = 0; i < 2; i++)
        if (member[i].pid > 0) {
            assert_int_equal(th_daemon_stop(&member[i], SIGTERM, TIMEOUT_MS), 0);
            member[i].pid = 0;
        }
}

static int teardown(void **state)
{
    stop_members(state);
    kvStore_Destroy(leases);
    return tn_suite_teardown();
}

/* No fleet on the cluster: each test's members make their own. */
static void fresh_fleet(void)
{
    tf_fresh(&test_fleet);
    kvStore_Destroy(leases);
    leases = NULL;
}

/* Member i, with another endpoint to advertise (NULL: its first bind, the harness's tcp) and
 * the options in extra (NULL-terminated; NULL: none). */
static void start_with(int i, const char *ckpt_ms, const char *advertise, const char *const *extra)
{
    const char *args[32] = {"--nats-servers",
                            tn_suite.urls,
                            "--nats-replicas",
                            "1",
                            "--nats-partitions",
                            "4",
                            "--nats-lease-ttl-ms",
                            "3000",
                            "--nats-checkpoint-interval-ms",
                            ckpt_ms,
                            "--nats-member-id",
                            ids[i],
                            "--nats-direct",
                            "local",
                            "--metrics",
                            "127.0.0.1:0"};
    size_t n = 16;
    if (advertise) {
        args[n++] = "--bind";
        args[n++] = advertise;
        args[n++] = "--nats-advertise";
        args[n++] = advertise;
    }
    for (; extra && *extra && n < 31; extra++)
        args[n++] = *extra;
    args[n] = NULL;
    assert_int_equal(th_daemon_start(&member[i], args), 0);
}

static void start(int i, const char *ckpt_ms, const char *advertise)
{
    start_with(i, ckpt_ms, advertise, NULL);
}

/* Member id's published ZeroMQ endpoint (TALLY_ENDPOINTS), into out. */
static void published(const char *id, char *out, size_t cap)
{
    kvStore *eps = NULL;
    kvEntry *e = NULL;
    assert_int_equal(js_KeyValue(&eps, tn_suite_js, TALLY_NATS_BUCKET_ENDPOINTS), NATS_OK);
    assert_int_equal(kvStore_Get(&e, eps, id), NATS_OK);
    assert_true(
        tally_fleet_endpoint_get(kvEntry_Value(e), (size_t)kvEntry_ValueLen(e), "zmq", out, cap));
    kvEntry_Destroy(e);
    kvStore_Destroy(eps);
}

/* The holder of partition k ("" when none). */
static void holder(uint32_t k, char *out, size_t cap)
{
    if (!leases)
        assert_int_equal(js_KeyValue(&leases, tn_suite_js, TALLY_NATS_BUCKET_LEASES), NATS_OK);
    if (td_lease_holder(leases, k, out, cap, msg, sizeof msg) != TD_OK)
        out[0] = '\0';
}

static int held_by(const char *id)
{
    int held = 0;
    for (uint32_t k = 0; k < PARTITIONS; k++) {
        char h[80];
        holder(k, h, sizeof h);
        held += strcmp(h, id) == 0;
    }
    return held;
}

static void wait_held(const char *id, int count)
{
    int64_t until = th_now_ms() + TIMEOUT_MS;
    int held;
    while ((held = held_by(id)) != count && th_now_ms() < until)
        th_sleep_ms(50);
    if (held != count)
        fail_msg("%s holds %d partitions, not %d", id, held, count);
}

/* An unnumbered u8 hist request for stream s, its batch of round r into data (600 bytes) and
 * its length into *n. */
static tally_req_t hist_req(int s, int r, uint8_t *data, size_t *n)
{
    *n = tf_batch(s, r, data);
    char name[32];
    tf_stream_name(&test_fleet, s, name, sizeof name);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    return req;
}

/* What send_hist adds to every fourth batch: the fleet client sends a payload this large by
 * reference (by_reference in tally_client_fleet.c), a smaller one by copy, resends included. */
#define LARGE_EXTRA (64u << 10)

/* A numbered hist request for stream s (its next seq), sent; the batch goes into the model. */
static uint64_t send_hist(tally_client_t *c, int s, int r, bool numbered)
{
    static uint8_t data[600 + LARGE_EXTRA];
    size_t n;
    tally_req_t req = hist_req(s, r, data, &n);
    if ((s + r) % 4 == 2) {
        for (size_t j = n; j < n + LARGE_EXTRA; j++)
            data[j] = (uint8_t)(data[j % n] ^ (j >> 9));
        n += LARGE_EXTRA;
    }
    if (numbered)
        req.seq = ++seqs[s];
    uint64_t id = 0;
    tally_status_t st = tally_send(c, &req, data, n, &id);
    if (st != TALLY_OK)
        fail_msg("send to %s: %s: %s", req.stream, tally_status_name(st), tally_client_error(c));
    if (numbered)
        tr_hist_parts(TALLY_DTYPE_U8, data, n, 0, 0, model[s], NULL, NULL);
    return id;
}

/* An unnumbered hist request for stream s that fails to be sent with `want`. */
static void send_hist_status(tally_client_t *c, int s, tally_status_t want)
{
    uint8_t data[600];
    size_t n;
    tally_req_t req = hist_req(s, 0, data, &n);
    assert_int_equal(tally_send(c, &req, data, n, NULL), want);
}

/* Waits for `count` replies, each TALLY_OK. */
static void recv_ok(tally_client_t *c, int count)
{
    for (int i = 0; i < count; i++) {
        tally_reply_t r;
        tally_reply_init(&r);
        tally_status_t st = tally_recv(c, &r);
        if (st != TALLY_OK)
            fail_msg("reply %d of %d: %s: %s", i + 1, count, tally_status_name(st), r.error);
        tally_reply_clear(&r);
    }
}

/* `streams` through the fleet client lists every test stream once, from every owner, with no
 * partition missing (a member alone lists only the streams it holds). */
static void check_streams(tally_client_t *c)
{
    char **names = NULL;
    size_t count = 0;
    uint32_t missing = 1;
    tally_status_t st = tally_streams_missing(c, &names, &count, &missing);
    if (st != TALLY_OK)
        fail_msg("streams: %s: %s", tally_status_name(st), tally_client_error(c));
    assert_int_equal(missing, 0);
    int seen[STREAMS] = {0};
    for (size_t i = 0; i < count; i++) {
        int s = -1;
        if (sscanf(names[i], "route/%d", &s) != 1 || s < 0 || s >= STREAMS)
            fail_msg("streams lists '%s', not one of the test's", names[i]);
        seen[s]++;
    }
    tally_strings_free(names, count);
    for (int s = 0; s < STREAMS; s++)
        if (seen[s] != 1)
            fail_msg("streams lists route/%d %d times, not once", s, seen[s]);
}

/* A stream whose partition `id` holds. */
static int stream_held_by(const char *id)
{
    for (int s = 0; s < STREAMS; s++) {
        char h[80];
        holder(tf_partition_of(&test_fleet, s), h, sizeof h);
        if (strcmp(h, id) == 0)
            return s;
    }
    fail_msg("%s holds no partition of the test's streams", id);
    return -1;
}

/* info's value of key from a member (plain client). */
static uint64_t info_u64(const th_daemon_t *d, const char *key)
{
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(d->endpoint, TIMEOUT_MS, &c), TALLY_OK);
    tally_info_t *info = NULL;
    assert_int_equal(tally_info_fetch(c, &info), TALLY_OK);
    uint64_t v = 0;
    assert_int_equal(tally_info_u64(info, key, &v), TALLY_OK);
    tally_info_destroy(&info);
    tally_client_destroy(&c);
    return v;
}

/* ---- 1. routing ------------------------------------------------------------------------- */

/* HTTP `method path` with the API token on member i's metrics port: the response's status
 * (0: none), and whether its body holds `holds`. */
static int api_status(int i, const char *method, const char *path, const char *holds)
{
    char *resp = th_http_get(th_metrics_port(&member[i]), method, path,
                             "Authorization: Bearer " API_TOKEN "\r\n");
    int status = 0;
    if (resp && sscanf(resp, "HTTP/%*s %d", &status) == 1 && holds && !strstr(resp, holds))
        status = -status;
    free(resp);
    return status;
}

static void test_owner_and_not_owner(void **state)
{
    (void)state;
    fresh_fleet();
    /* The HTTP API's writes on (an API token file, mode 0600). */
    char tokens[128], token_file[192];
    assert_int_equal(th_tmpdir(tokens, sizeof tokens, "tally-route-token"), 0);
    assert_int_equal(th_write_file(tokens, "token", API_TOKEN "\n", strlen(API_TOKEN) + 1), 0);
    snprintf(token_file, sizeof token_file, "%s/token", tokens);
    assert_int_equal(chmod(token_file, 0600), 0);
    const char *api[] = {"--metrics-api-token-file", token_file, NULL};
    start_with(0, "200", NULL, api);
    wait_held(ids[0], PARTITIONS);
    start_with(1, "200", NULL, api);
    wait_held(ids[0], PARTITIONS / 2);
    wait_held(ids[1], PARTITIONS / 2);
    /* Member a's endpoints, as published. */
    kvStore *eps = NULL;
    kvEntry *e = NULL;
    assert_int_equal(js_KeyValue(&eps, tn_suite_js, TALLY_NATS_BUCKET_ENDPOINTS), NATS_OK);
    assert_int_equal(kvStore_Get(&e, eps, ids[0]), NATS_OK);
    char zmq[256], shm[256];
    assert_true(tally_fleet_endpoint_get(kvEntry_Value(e), (size_t)kvEntry_ValueLen(e), "zmq", zmq,
                                         sizeof zmq));
    assert_string_equal(zmq, member[0].endpoint);
    assert_true(tally_fleet_endpoint_get(kvEntry_Value(e), (size_t)kvEntry_ValueLen(e), "shm", shm,
                                         sizeof shm));
    assert_false(tally_fleet_endpoint_get(kvEntry_Value(e), (size_t)kvEntry_ValueLen(e), "zmq", zmq,
                                          4)); /* too long for the room */
    assert_false(tally_fleet_endpoint_get(kvEntry_Value(e), (size_t)kvEntry_ValueLen(e), "http",
                                          zmq, sizeof zmq));
    kvEntry_Destroy(e);
    kvStore_Destroy(eps);

    /* A stream of b's, sent to a: not_owner naming b at its endpoint, a write and a query. */
    int sb = stream_held_by(ids[1]), sa = stream_held_by(ids[0]);
    tally_client_t *a = NULL;
    assert_int_equal(tally_client_new(member[0].endpoint, TIMEOUT_MS, &a), TALLY_OK);
    char name[32], want[256];
    tf_stream_name(&test_fleet, sb, name, sizeof name);
    snprintf(want, sizeof want, "partition %u is owned by %s at %s",
             (unsigned)tf_partition_of(&test_fleet, sb), ids[1], member[1].endpoint);
    uint8_t data[600];
    size_t n = tf_batch(sb, 0, data);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    tally_reply_t r;
    tally_reply_init(&r);
    /* Until a's next heartbeat has read who took the partition it gave up: "no owner now". */
    long long tries = 0;
    int64_t until = th_now_ms() + TIMEOUT_MS;
    do {
        tally_reply_clear(&r);
        assert_int_equal(tally_call(a, &req, data, n, &r), TALLY_E_NOT_OWNER);
        tries++;
        if (strstr(r.error, "has no owner now"))
            th_sleep_ms(100);
    } while (strstr(r.error, "has no owner now") && th_now_ms() < until);
    assert_string_equal(r.error, want);
    tally_reply_clear(&r);
    tally_stream_info_t info;
    assert_int_equal(tally_query(a, name, &info), TALLY_E_NOT_OWNER);
    assert_string_equal(tally_status_name(TALLY_E_NOT_OWNER), "not_owner");
    /* A stream of a's, sent to a: applied. */
    tf_stream_name(&test_fleet, sa, name, sizeof name);
    n = tf_batch(sa, 0, data);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    assert_int_equal(tally_call(a, &req, data, n, &r), TALLY_OK);
    tally_reply_clear(&r);
    tr_hist_parts(TALLY_DTYPE_U8, data, n, 0, 0, model[sa], NULL, NULL);
    /* Admitted there and failed (the stream's histogram is u8): not a write to checkpoint. */
    tally_req_t wrong = th_req(TALLY_OP_HIST, TALLY_DTYPE_I32, 0);
    assert_int_equal(tally_req_set_stream(&wrong, name), TALLY_OK);
    wrong.lo = 0;
    wrong.hi = 100;
    int32_t values[4] = {1, 2, 3, 4};
    assert_int_equal(tally_call(a, &wrong, values, sizeof values, &r), TALLY_E_STREAM_STATE);
    tally_reply_clear(&r);
    tally_client_destroy(&a);
    assert_int_equal(th_metric(&member[0], "tallyd_nats_not_owner_total"), tries + 1);
    assert_int_equal(th_metric(&member[1], "tallyd_nats_not_owner_total"), 0);
    assert_int_equal(info_u64(&member[0], "nats_direct_uncommitted") +
                             info_u64(&member[1], "nats_direct_uncommitted") <=
                         1,
                     true);

    /* The fleet client: every stream to its owner, numbered, pipelined. */
    tally_client_t *c = tf_fleet_client(tn_suite.urls, TIMEOUT_MS);
    for (int s = 0; s < STREAMS; s++)
        send_hist(c, s, 1, true);
    recv_ok(c, STREAMS);
    tf_check_model(&test_fleet, c);
    tally_client_destroy(&c);
    /* HTTP on a, for a stream of b's: a read is asked of the fleet (b's record); a write is
     * answered 421 `not_owner` (PROTOCOL.md §12, §13). */
    char path[64], body[64];
    snprintf(path, sizeof path, "/api/v1/streams/route%%2F%d", sb);
    snprintf(body, sizeof body, "\"stream\":\"route/%d\"", sb);
    assert_int_equal(api_status(0, "GET", path, body), 200);
    assert_int_equal(api_status(0, "DELETE", path, "\"error\":\"not_owner\""), 421);
    strcat(path, "/reset");
    assert_int_equal(api_status(0, "POST", path, "\"error\":\"not_owner\""), 421);
    th_rmrf(tokens);
    /* The CLI's --fleet: a query of a stream of b's, from its owner. */
    char dir[128];
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-route"), 0);
    th_cli_t q =
        th_cli(dir, member[0].endpoint, "--fleet %s query --json route/%d", tn_suite.urls, sb);
    assert_int_equal(q.status, 0);
    assert_non_null(strstr(q.out, "\"last_seq\":1,"));
    th_cli_free(&q);
    /* `watch` through --fleet: the stream's record from its owner, not from -e (a). */
    th_cli_t wq = th_cli(dir, member[0].endpoint, "--fleet %s watch --once route/%d",
                         tn_suite.urls, sb);
    char line[64];
    snprintf(line, sizeof line, "route/%d  u8  count ", sb);
    assert_int_equal(wq.status, 0);
    assert_non_null(strstr(wq.out, line));
    th_cli_free(&wq);
    th_rmrf(dir);
    assert_int_equal(th_metric(&member[0], "tallyd_nats_not_owner_total"), tries + 3); /* HTTP */
    stop_clean();
}

/* ---- 2. a hand-over: not_owner followed, direct writes in the give-up's checkpoint -------- */

static void test_handover_follows_not_owner(void **state)
{
    (void)state;
    fresh_fleet();
    /* a advertises an ipc endpoint, bound beside the harness's tcp one: the fleet client
     * reaches it there. */
    char dir[128], ipc[192], seen[256];
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-route"), 0);
    snprintf(ipc, sizeof ipc, "ipc://%s/a.sock", dir);
    start(0, "3600000", ipc); /* no periodic checkpoint: only a give-up writes one */
    wait_held(ids[0], PARTITIONS);
    published(ids[0], seen, sizeof seen);
    assert_string_equal(seen, ipc);
    tally_client_t *c = tf_fleet_client(tn_suite.urls, TIMEOUT_MS);
    for (int r = 0; r < 3; r++) {
        for (int s = 0; s < STREAMS; s++)
            send_hist(c, s, r, true);
        recv_ok(c, STREAMS);
    }
    assert_int_equal(info_u64(&member[0], "nats_direct_uncommitted"), 3 * STREAMS);
    start(1, "3600000", NULL);
    wait_held(ids[1], PARTITIONS / 2);
    wait_held(ids[0], PARTITIONS / 2);
    /* A push numbered from its stream's last_seq, on a stream of b's: the client asks a for it
     * first, and follows a's not_owner to b. */
    int sb = stream_held_by(ids[1]);
    char name[32];
    tf_stream_name(&test_fleet, sb, name, sizeof name);
    uint8_t data[600];
    size_t n = tf_batch(sb, 9, data);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    tally_run_opts_t ro = {.seq = TALLY_RUN_SEQ_APPEND};
    tally_run_result_t res;
    tally_buf_t out = {0};
    tally_status_t st = tally_run(c, &req, data, n, &ro, &out, &res);
    if (st != TALLY_OK)
        fail_msg("tally_run: %s: %s", tally_status_name(st), tally_client_error(c));
    tally_buf_free(&out);
    tr_hist_parts(TALLY_DTYPE_U8, data, n, 0, 0, model[sb], NULL, NULL);
    seqs[sb]++;
    /* A stream's first numbered push: no last_seq yet. */
    assert_int_equal(tally_req_set_stream(&req, "route/new"), TALLY_OK);
    assert_int_equal(tally_run(c, &req, data, n, &ro, &out, &res), TALLY_OK);
    assert_int_equal(res.last_seq, 1);
    tally_buf_free(&out);
    /* A request without a stream, its id not asked for: partition 0's owner answers. */
    tally_req_t ping = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, 0);
    assert_int_equal(tally_send(c, &ping, NULL, 0, NULL), TALLY_OK);
    recv_ok(c, 1);
    /* The client still sends every other stream to a, which answers not_owner for b's. */
    for (int r = 3; r < 5; r++) {
        for (int s = 0; s < STREAMS; s++)
            send_hist(c, s, r, true);
        recv_ok(c, STREAMS);
    }
    tf_check_model(&test_fleet, c);
    assert_true(th_metric(&member[0], "tallyd_nats_not_owner_total") >= 1);
    /* a stops with four numbered requests of each of its streams queued to it (sent while it
     * was stopped, the stop signal pending at its SIGCONT): those it does not apply (answered
     * `shutdown`, or not at all) go to its partitions' next owner, b, once a has given them up,
     * each stream's in their order (none ahead of an earlier one still with a, and one b
     * refuses `sequence_gap` because b answered an earlier one `not_owner` while it took the
     * partition over is sent again after it: test_resends_keep_stream_order); each applied
     * once. */
    int mine[STREAMS], count = 0;
    for (int s = 0; s < STREAMS; s++) {
        char h[80];
        holder(tf_partition_of(&test_fleet, s), h, sizeof h);
        if (strcmp(h, ids[0]) == 0)
            mine[count++] = s;
    }
    assert_true(count > 0);
    assert_int_equal(kill(member[0].pid, SIGSTOP), 0);
    for (int r = 5; r < 9; r++)
        for (int i = 0; i < count; i++)
            send_hist(c, mine[i], r, true);
    assert_int_equal(kill(member[0].pid, SIGTERM), 0);
    assert_int_equal(kill(member[0].pid, SIGCONT), 0);
    recv_ok(c, 4 * count);
    assert_int_equal(th_daemon_wait(&member[0], TIMEOUT_MS), 0);
    member[0].pid = 0;
    wait_held(ids[1], PARTITIONS);
    /* c still names a the owner of the streams whose replies came from a before it stopped:
     * a send there waits a probe for a's connection, not its whole timeout, and goes to b. */
    tf_check_model(&test_fleet, c);
    tally_client_destroy(&c);
    stop_clean();
    th_rmrf(dir);
}

/* ---- 3. kill -9 of an owner: numbered resends applied exactly once ----------------------- */

/* Two members splitting the partitions, and a fleet client that has sent `rounds` numbered
 * batches to every stream, each answered; b's direct writes checkpointed, so that nothing
 * answered is lost with it. */
static tally_client_t *two_owners_written(int rounds)
{
    fresh_fleet();
    start(0, "200", NULL);
    start(1, "200", NULL);
    wait_held(ids[0], PARTITIONS / 2);
    wait_held(ids[1], PARTITIONS / 2);
    tally_client_t *c = tf_fleet_client(tn_suite.urls, TIMEOUT_MS);
    for (int r = 0; r < rounds; r++) {
        for (int s = 0; s < STREAMS; s++)
            send_hist(c, s, r, true);
        recv_ok(c, STREAMS);
    }
    int64_t until = th_now_ms() + TIMEOUT_MS;
    while (info_u64(&member[1], "nats_direct_uncommitted") != 0 && th_now_ms() < until)
        th_sleep_ms(50);
    assert_int_equal(info_u64(&member[1], "nats_direct_uncommitted"), 0);
    return c;
}

static void test_kill_owner_resends_once(void **state)
{
    (void)state;
    tally_client_t *c = two_owners_written(2);
    /* b stops answering; numbered requests on every stream, one unnumbered on a stream of b's. */
    int sb = stream_held_by(ids[1]);
    assert_int_equal(kill(member[1].pid, SIGSTOP), 0);
    for (int s = 0; s < STREAMS; s++)
        send_hist(c, s, 2, true);
    uint64_t lost = send_hist(c, sb, 3, false);
    kill(member[1].pid, SIGKILL);
    th_daemon_wait(&member[1], 5000);
    member[1].pid = 0;
    int ok = 0, transport = 0;
    for (int i = 0; i < STREAMS + 1; i++) {
        tally_reply_t r;
        tally_reply_init(&r);
        tally_status_t st = tally_recv(c, &r);
        if (st == TALLY_E_TRANSPORT) {
            assert_int_equal(r.rep.request_id, lost);
            assert_non_null(strstr(r.error, "no seq"));
            transport++;
        } else if (st == TALLY_OK) {
            ok++;
        } else {
            fail_msg("reply: %s: %s", tally_status_name(st), r.error);
        }
        tally_reply_clear(&r);
    }
    assert_int_equal(ok, STREAMS);
    assert_int_equal(transport, 1);
    wait_held(ids[0], PARTITIONS);
    tf_check_model(&test_fleet,
                   c); /* each resent numbered request applied once; the unnumbered one not */
    tally_client_destroy(&c);
    stop_clean();
}

/* Requests without a stream go to partition 0's owner, a (these members' ids). Unnumbered and
 * changing nothing (a hist of the batch alone, a minmax), they are sent again to b once a is
 * gone, not answered `transport` as an unnumbered write is. */
static void test_kill_owner_resends_what_changes_nothing(void **state)
{
    (void)state;
    tally_client_t *c = two_owners_written(1);
    char p0[80];
    holder(0, p0, sizeof p0);
    assert_string_equal(p0, ids[0]);
    assert_int_equal(kill(member[0].pid, SIGSTOP), 0);
    uint8_t alone[64] = {1, 2, 3};
    tally_req_t hist = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    tally_req_t minmax = th_req(TALLY_OP_MINMAX, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_send(c, &hist, alone, sizeof alone, NULL), TALLY_OK);
    assert_int_equal(tally_send(c, &minmax, alone, sizeof alone, NULL), TALLY_OK);
    kill(member[0].pid, SIGKILL);
    th_daemon_wait(&member[0], 5000);
    member[0].pid = 0;
    recv_ok(c, 2);
    tally_client_destroy(&c);
    stop_clean();
}

/* An owner stopped (SIGSTOP) past its lease with direct writes since its checkpoint, its
 * partitions taken by another member meanwhile: woken, it drops them, and its
 * nats_direct_uncommitted (what its host would lose now) goes with them: those writes are lost
 * already (durability `local`, checkpoints an hour apart). */
static void test_stopped_owner_forgets_uncommitted(void **state)
{
    (void)state;
    fresh_fleet();
    start(0, "3600000", NULL);
    wait_held(ids[0], PARTITIONS);
    tally_client_t *c = tf_fleet_client(tn_suite.urls, TIMEOUT_MS);
    for (int s = 0; s < STREAMS; s++)
        send_hist(c, s, 0, true);
    recv_ok(c, STREAMS);
    tally_client_destroy(&c);
    assert_int_equal(info_u64(&member[0], "nats_direct_uncommitted"), STREAMS);
    assert_int_equal(kill(member[0].pid, SIGSTOP), 0);
    start(1, "3600000", NULL);
    wait_held(ids[1], PARTITIONS); /* after a's leases ran out (3 s) */
    assert_int_equal(kill(member[0].pid, SIGCONT), 0);
    /* Each of a's partitions is dropped (a may take half of them back afterwards, as the plan
     * of two members says: with no write since, its count stays 0). */
    int64_t until = th_now_ms() + TIMEOUT_MS;
    while (th_metric(&member[0], "tallyd_nats_leases_lost_total") < PARTITIONS &&
           th_now_ms() < until)
        th_sleep_ms(50);
    assert_true(th_metric(&member[0], "tallyd_nats_leases_lost_total") >= PARTITIONS);
    while (info_u64(&member[0], "nats_direct_uncommitted") != 0 && th_now_ms() < until)
        th_sleep_ms(50);
    assert_int_equal(info_u64(&member[0], "nats_direct_uncommitted"), 0);
    stop_clean();
}

/* ---- 3b. an owner gone before the next send: it goes to the new owner, not waited on ----- */

/* Bound on the failover seen by a sender: the lease TTL (3 s) and the new owner's take-over,
 * with room for a loaded box, and well below the client's timeout (TIMEOUT_MS). */
#define REROUTE_BOUND_MS 15000

static void test_owner_gone_reroutes(void **state)
{
    (void)state;
    tally_client_t *c = two_owners_written(1); /* every owner known to c, its connection up */
    check_streams(c);                          /* both owners' */
    int sb = stream_held_by(ids[1]);
    /* b killed with nothing in flight: c still names it the owner of its partitions. A push
     * to one of them (seq from the stream's last_seq) and a send to each wait a probe for b's
     * connection, not the timeout, and go (unsent until then) to a once a holds the partition;
     * all answered well within the client's timeout, each applied once. */
    kill(member[1].pid, SIGKILL);
    th_daemon_wait(&member[1], 5000);
    member[1].pid = 0;
    int64_t t0 = th_now_ms();
    /* A push numbered from the stream's last_seq asks it of the new owner, then sends. */
    uint8_t data[600];
    size_t n;
    tally_req_t req = hist_req(sb, 1, data, &n);
    tally_run_opts_t ro = {.seq = TALLY_RUN_SEQ_APPEND};
    tally_buf_t out = {0};
    tally_status_t st = tally_run(c, &req, data, n, &ro, &out, NULL);
    if (st != TALLY_OK)
        fail_msg("push to %s: %s: %s", req.stream, tally_status_name(st), tally_client_error(c));
    tally_buf_free(&out);
    seqs[sb]++;
    tr_hist_parts(TALLY_DTYPE_U8, data, n, 0, 0, model[sb], NULL, NULL);
    for (int s = 0; s < STREAMS; s++)
        send_hist(c, s, 2, true);
    recv_ok(c, STREAMS);
    int64_t took = th_now_ms() - t0;
    print_message("every stream answered %lld ms after its owner was killed\n", (long long)took);
    if (took > REROUTE_BOUND_MS)
        fail_msg("answered %lld ms after the owner was killed (bound %d ms, timeout %d ms)",
                 (long long)took, REROUTE_BOUND_MS, TIMEOUT_MS);
    assert_int_equal(held_by(ids[0]), PARTITIONS);
    tf_check_model(&test_fleet, c); /* each applied once: last_seq and bins equal the model */
    check_streams(c); /* all a's now */
    tally_client_destroy(&c);
    stop_clean();
}

/* ---- 4. refusals ------------------------------------------------------------------------ */

static void test_refusals(void **state)
{
    (void)state;
    fresh_fleet();
    char dir[128], log[192];
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-route"), 0);
    snprintf(log, sizeof log, "%s/tallyd.log", dir);
    const char *values[] = {"fast"};
    const char *says[] = {"[nats] direct 'fast': off, local or replicated"};
    for (int i = 0; i < 1; i++) {
        const char *args[] = {
            "--nats-servers",           tn_suite.urls, "--nats-direct", values[i], "--bind",
            "ipc:///nonexistent/never", NULL};
        assert_int_not_equal(th_daemon_run_to_exit(args, log, TIMEOUT_MS), 0);
        assert_true(th_file_contains(log, says[i]));
    }
    /* off is a value too (the default). */
    const char *off[] = {"--nats-servers", tn_suite.urls, "--nats-direct", "off",
                         "--check-config", NULL};
    assert_int_equal(th_daemon_run_to_exit(off, log, TIMEOUT_MS), 0);
    th_rmrf(dir);
    /* No fleet in direct mode on this NATS. */
    tally_nats_opts_t o = {.servers = tn_suite.urls, .timeout_ms = 2000};
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new_fleet(&o, &c, msg, sizeof msg), TALLY_E_ARG);
    assert_null(c);
    assert_int_equal(tally_client_new_fleet(NULL, &c, msg, sizeof msg), TALLY_E_ARG);
    assert_int_equal(tally_client_new_fleet(&o, NULL, msg, sizeof msg), TALLY_E_ARG);
    o.timeout_ms = 0; /* the default timeout; and no room for the reason */
    assert_int_equal(tally_client_new_fleet(&o, &c, NULL, 0), TALLY_E_ARG);
    o.timeout_ms = 2000;
    assert_non_null(strstr(msg, "no tallyd fleet on this NATS"));
    /* A fleet (its partition count), but none of direct mode's buckets. */
    kvConfig kc;
    kvConfig_Init(&kc);
    kc.Bucket = TALLY_NATS_BUCKET_FLEET;
    kvStore *kv = NULL;
    assert_int_equal(js_CreateKeyValue(&kv, tn_suite_js, &kc), NATS_OK);
    uint64_t rev = 0;
    assert_int_equal(kvStore_PutString(&rev, kv, TALLY_NATS_KEY_PARTITIONS, "4"), NATS_OK);
    kvStore_Destroy(kv);
    assert_int_equal(tally_client_new_fleet(&o, &c, msg, sizeof msg), TALLY_E_ARG);
    assert_non_null(strstr(msg, "no tallyd fleet in direct mode"));
    tn_fleet_delete(tn_suite_js, PARTITIONS);
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-route"), 0);
    th_cli_t r = th_cli(dir, "tcp://127.0.0.1:1", "--fleet %s ping", tn_suite.urls);
    assert_int_equal(r.status, 2);
    assert_non_null(strstr(r.err, "no tallyd fleet on this NATS"));
    th_cli_free(&r);
    th_rmrf(dir);
}

/* ---- 5. partitions without a reachable owner -------------------------------------------- */

static kvStore *bucket(const char *name)
{
    kvConfig kc;
    kvConfig_Init(&kc);
    kc.Bucket = name;
    kvStore *kv = NULL;
    assert_int_equal(js_CreateKeyValue(&kv, tn_suite_js, &kc), NATS_OK);
    return kv;
}

static void put(kvStore *kv, const char *key, const char *value)
{
    uint64_t rev = 0;
    assert_int_equal(kvStore_PutString(&rev, kv, key, value), NATS_OK);
}

/* The end of a test whose buckets were faked in front of member 0: they go, and it stops. */
static void end_faked(kvStore *fleet, kvStore *ls, kvStore *eps)
{
    kvStore_Destroy(fleet);
    kvStore_Destroy(ls);
    kvStore_Destroy(eps);
    fresh_fleet();
    assert_int_equal(th_daemon_stop(&member[0], SIGTERM, TIMEOUT_MS), 0);
    member[0].pid = 0;
}

/* A stream of partition k. */
static int stream_in(uint32_t k)
{
    for (int s = 0; s < STREAMS; s++)
        if (tf_partition_of(&test_fleet, s) == k)
            return s;
    fail_msg("no test stream in partition %u", (unsigned)k);
    return -1;
}

/* The buckets of a fleet whose owners cannot be reached: partition 0's owner publishes an
 * endpoint that is not one, partition 1's none, partition 2 has no owner, partition 3's owner
 * one where nothing listens. Every way in waits for an owner, or a reply, and times out, saying
 * which partition or that the fleet did not answer. */
static void test_no_owner(void **state)
{
    (void)state;
    fresh_fleet();
    kvStore *fleet = bucket(TALLY_NATS_BUCKET_FLEET), *ls = bucket(TALLY_NATS_BUCKET_LEASES),
            *eps = bucket(TALLY_NATS_BUCKET_ENDPOINTS);
    put(fleet, TALLY_NATS_KEY_PARTITIONS, "4");
    put(ls, "p0", "ghost");
    put(ls, "p1", "ghost-2");
    put(ls, "p3", "ghost-3");
    put(eps, "ghost", "zmq=nowhere\n");
    put(eps, "ghost-3", "zmq=tcp://127.0.0.1:1\n");
    tally_nats_opts_t o = {.servers = tn_suite.urls, .timeout_ms = 300};
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new_fleet(&o, &c, msg, sizeof msg), TALLY_OK);
    tally_reply_t r;
    tally_reply_init(&r);
    assert_int_equal(tally_recv(c, &r), TALLY_E_TIMEOUT); /* nothing in flight */
    assert_string_equal(tally_client_error(c), "no request in flight");
    assert_int_equal(tally_ping(c, NULL), TALLY_E_TIMEOUT); /* no stream: partition 0's owner */
    assert_non_null(strstr(tally_client_error(c), "partition 0 has no owner in direct mode"));
    assert_non_null(strstr(tally_client_error(c), /* and why: its owner's endpoint is not one */
                           "; member ghost's endpoint in TALLY_ENDPOINTS: invalid endpoint "
                           "'nowhere'"));
    int s1 = stream_in(1), s2 = stream_in(2);
    send_hist_status(c, s1, TALLY_E_TIMEOUT);
    assert_non_null(strstr(tally_client_error(c), "partition 1 has no owner"));
    /* A push numbered from the stream's last_seq: no owner to ask it of. */
    char name[32];
    tf_stream_name(&test_fleet, s2, name, sizeof name);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    tally_run_opts_t ro = {.seq = TALLY_RUN_SEQ_APPEND};
    tally_buf_t out = {0};
    uint8_t data[16] = {1, 2, 3};
    assert_int_equal(tally_run(c, &req, data, sizeof data, &ro, &out, NULL), TALLY_E_TIMEOUT);
    tally_buf_free(&out);
    /* An owner that is not there: its connection refused, the request not kept. */
    send_hist_status(c, stream_in(3), TALLY_E_TRANSPORT);
    assert_non_null(strstr(tally_client_error(c), "cannot connect to tcp://127.0.0.1:1"));
    assert_int_equal(tally_recv(c, &r), TALLY_E_TIMEOUT); /* nothing in flight */
    tally_client_destroy(&c);
    kvStore_Destroy(fleet);
    kvStore_Destroy(ls);
    kvStore_Destroy(eps);
    fresh_fleet();
}

/* ---- 4b. a stream's order across owners, against fake members --------------------------- */

/* A member played by a ROUTER socket the buckets name: it answers a stream's numbered hist
 * requests by the sequence rules (PROTOCOL.md §5: the next seq applied, a later one
 * `sequence_gap`, an earlier one `duplicate`), except for its script: the request of seq `hold`
 * is never answered, the first `unowned` requests of seq `not_owner` are answered `not_owner`
 * naming no owner (a member taking the partition over, before it holds it), and with
 * `stopping` every other one `shutdown`. */
typedef struct {
    void *ctx, *sock;
    char endpoint[64];
    pthread_t thread;
    atomic_bool stop;
    uint64_t hold, not_owner;
    int unowned;
    bool stopping;
    _Atomic uint64_t last; /* the stream's last seq applied */
    uint64_t arrived[32];  /* each request's seq, in the order it came */
    atomic_int count;      /* of arrived[] */
} fake_member_t;

static void fake_answer(fake_member_t *f, zmq_msg_t *id, const tally_req_t *req, tally_status_t st,
                        const char *why)
{
    static uint8_t bins[256 * 8]; /* a hist's reply: its counts are not what is tested */
    tally_rep_t rep = {.version = TALLY_PROTO_VERSION,
                       .opcode = req->opcode,
                       .request_id = req->request_id,
                       .status = (uint16_t)st,
                       .dtype = st == TALLY_OK ? TALLY_DTYPE_U64 : TALLY_DTYPE_TEXT,
                       .count = st == TALLY_OK ? 256 : 0};
    uint8_t header[TALLY_REP_HEADER_SIZE];
    tally_rep_encode(&rep, header);
    zmq_msg_send(id, f->sock, ZMQ_SNDMORE);
    zmq_send(f->sock, header, sizeof header, ZMQ_SNDMORE);
    if (st == TALLY_OK)
        zmq_send(f->sock, bins, sizeof bins, 0);
    else
        zmq_send(f->sock, why, strlen(why), 0);
}

/* f's answer to req, by its script, then by the sequence rules. */
static void fake_script(fake_member_t *f, zmq_msg_t *id, const tally_req_t *req,
                        int *not_owner_said)
{
    uint64_t last = atomic_load(&f->last);
    char why[96];
    snprintf(why, sizeof why, "seq %llu: the stream is at seq %llu", (unsigned long long)req->seq,
             (unsigned long long)last);
    if (req->seq == f->hold)
        return; /* never answered */
    if (req->seq == f->not_owner && *not_owner_said < f->unowned) {
        ++*not_owner_said;
        fake_answer(f, id, req, TALLY_E_NOT_OWNER, "partition 0 has no owner now");
    } else if (f->stopping) {
        fake_answer(f, id, req, TALLY_E_SHUTDOWN, "shutting down");
    } else if (req->seq == last + 1) {
        atomic_store(&f->last, last + 1);
        fake_answer(f, id, req, TALLY_OK, "");
    } else {
        fake_answer(f, id, req, req->seq <= last ? TALLY_E_DUPLICATE : TALLY_E_SEQ_GAP, why);
    }
}

static void *fake_member_main(void *arg)
{
    fake_member_t *f = arg;
    int not_owner_said = 0;
    while (!atomic_load(&f->stop)) {
        zmq_pollitem_t item = {.socket = f->sock, .events = ZMQ_POLLIN};
        if (zmq_poll(&item, 1, 20) <= 0)
            continue;
        zmq_msg_t id, header, payload;
        zmq_msg_init(&id);
        zmq_msg_init(&header);
        zmq_msg_init(&payload);
        zmq_msg_recv(&id, f->sock, 0);
        zmq_msg_recv(&header, f->sock, 0);
        zmq_msg_recv(&payload, f->sock, 0);
        tally_req_t req;
        if (tally_req_decode(zmq_msg_data(&header), zmq_msg_size(&header), &req, NULL, 0) ==
            TALLY_OK) {
            int n = atomic_load(&f->count);
            if (n < 32) {
                f->arrived[n] = req.seq;
                atomic_store(&f->count, n + 1);
            }
            fake_script(f, &id, &req, &not_owner_said);
        }
        zmq_msg_close(&id);
        zmq_msg_close(&header);
        zmq_msg_close(&payload);
    }
    return NULL;
}

/* A fake member published as member `id` in eps. */
static fake_member_t *fake_member_start(kvStore *eps, const char *id)
{
    fake_member_t *f = calloc(1, sizeof *f);
    assert_non_null(f);
    f->ctx = zmq_ctx_new();
    f->sock = zmq_socket(f->ctx, ZMQ_ROUTER);
    int linger = 0;
    zmq_setsockopt(f->sock, ZMQ_LINGER, &linger, sizeof linger);
    assert_int_equal(zmq_bind(f->sock, "tcp://127.0.0.1:*"), 0);
    size_t len = sizeof f->endpoint;
    zmq_getsockopt(f->sock, ZMQ_LAST_ENDPOINT, f->endpoint, &len);
    char record[96];
    snprintf(record, sizeof record, "zmq=%s\n", f->endpoint);
    put(eps, id, record);
    return f;
}

static void fake_member_run(fake_member_t *f)
{
    assert_int_equal(pthread_create(&f->thread, NULL, fake_member_main, f), 0);
}

static void fake_member_stop(fake_member_t **f_p)
{
    fake_member_t *f = *f_p;
    atomic_store(&f->stop, true);
    pthread_join(f->thread, NULL);
    zmq_close(f->sock);
    zmq_ctx_term(f->ctx);
    free(f);
    *f_p = NULL;
}

/* The seqs that reached f, in their order, as "1 2 1 2". */
static const char *arrivals(fake_member_t *f, char *out, size_t cap)
{
    size_t at = 0;
    out[0] = '\0';
    for (int i = 0; i < atomic_load(&f->count) && at < cap; i++)
        at += (size_t)snprintf(out + at, cap - at, "%s%llu", i ? " " : "",
                               (unsigned long long)f->arrived[i]);
    return out;
}

/* Seq 1 and seq 2 of one stream sent through the fleet client; both answered TALLY_OK. */
static void send_two_recv_ok(tally_client_t *c, const char *name, void (*between)(void *),
                             void *arg)
{
    uint8_t data[16] = {1, 2, 3};
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    for (uint64_t seq = 1; seq <= 2; seq++) {
        req.seq = seq;
        assert_int_equal(tally_send(c, &req, data, sizeof data, NULL), TALLY_OK);
    }
    if (between)
        between(arg);
    recv_ok(c, 2);
}

/* Waits until f has seen `n` requests. */
static void wait_arrived(fake_member_t *f, int n)
{
    int64_t until = th_now_ms() + TIMEOUT_MS;
    while (atomic_load(&f->count) < n && th_now_ms() < until)
        th_sleep_ms(10);
    assert_int_equal(atomic_load(&f->count), n);
}

typedef struct {
    fake_member_t *x;
    kvStore *ls;
    const char *key;
} move_t;

/* x has answered seq 2 `shutdown` and holds seq 1: the partition moves to route-fake-y. */
static void move_to_y(void *arg)
{
    move_t *mv = arg;
    wait_arrived(mv->x, 2);
    put(mv->ls, mv->key, "route-fake-y");
}

/* A stream's requests reach a member in the order they were first sent, whatever the order of
 * the answers that send them again, and a `not_owner` naming no owner is sent again at the next
 * read of the buckets (PROTOCOL.md §13, "The fleet client"):
 *   - an owner answers seq 1 `not_owner` (taking the partition over, not holding it yet) and
 *     seq 2, which came after, `sequence_gap` (it held the partition by then): the gap is the
 *     client's, not the caller's: seq 2 is sent again after seq 1, both answered OK;
 *   - an owner stopping holds seq 1 unanswered and answers seq 2 `shutdown`, and the partition
 *     moves: seq 2 waits for seq 1 (sent to the new owner once it is late), and the new owner
 *     sees seq 1, then seq 2, nothing else;
 *   - an owner that answers `not_owner` naming none, always: the request goes to it again every
 *     read of the buckets until the caller's timeout, whose message names that answer. */
static void test_resends_keep_stream_order(void **state)
{
    (void)state;
    fresh_fleet();
    kvStore *fleet = bucket(TALLY_NATS_BUCKET_FLEET), *ls = bucket(TALLY_NATS_BUCKET_LEASES),
            *eps = bucket(TALLY_NATS_BUCKET_ENDPOINTS);
    put(fleet, TALLY_NATS_KEY_PARTITIONS, "4");
    fake_member_t *x = fake_member_start(eps, "route-fake-x");
    fake_member_t *y = fake_member_start(eps, "route-fake-y");
    x->not_owner = 1;
    x->unowned = 1;
    fake_member_run(x);
    fake_member_run(y);
    for (int k = 0; k < PARTITIONS; k++) {
        char key[8];
        snprintf(key, sizeof key, "p%d", k);
        put(ls, key, "route-fake-x");
    }
    tally_nats_opts_t o = {.servers = tn_suite.urls, .timeout_ms = 10000};
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new_fleet(&o, &c, msg, sizeof msg), TALLY_OK);
    char seen[128];
    int64_t began = th_now_ms();
    send_two_recv_ok(c, "order/a", NULL, NULL);
    assert_string_equal(arrivals(x, seen, sizeof seen), "1 2 1 2");
    assert_int_equal(x->last, 2);
    /* sent again at the next read of the buckets (200 ms), not 1 s after the first send */
    assert_true(th_now_ms() - began < 800);
    tally_client_destroy(&c);
    /* x stopping, holding seq 1 of another stream; the partition moves to y. */
    fake_member_stop(&x);
    x = fake_member_start(eps, "route-fake-x");
    x->hold = 1;
    x->stopping = true;
    fake_member_run(x);
    assert_int_equal(tally_client_new_fleet(&o, &c, msg, sizeof msg), TALLY_OK);
    char key[8];
    snprintf(key, sizeof key, "p%u", (unsigned)tally_partition("order/b", 7, PARTITIONS));
    move_t mv = {.x = x, .ls = ls, .key = key};
    send_two_recv_ok(c, "order/b", move_to_y, &mv);
    assert_string_equal(arrivals(x, seen, sizeof seen), "1 2");
    assert_string_equal(arrivals(y, seen, sizeof seen), "1 2");
    assert_int_equal(y->last, 2);
    tally_client_destroy(&c);
    fake_member_stop(&x);
    fake_member_stop(&y);
    /* An owner that answers not_owner naming no owner, again and again: sent again at each read
     * of the buckets until the caller's timeout, which says what the last answer was. */
    fake_member_t *z = fake_member_start(eps, "route-fake-z");
    z->not_owner = 1;
    z->unowned = 1000;
    fake_member_run(z);
    put(ls, key, "route-fake-z");
    o.timeout_ms = 700;
    assert_int_equal(tally_client_new_fleet(&o, &c, msg, sizeof msg), TALLY_OK);
    uint8_t data[16] = {1};
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, "order/b"), TALLY_OK);
    req.seq = 1;
    assert_int_equal(tally_send(c, &req, data, sizeof data, NULL), TALLY_OK);
    tally_reply_t r;
    tally_reply_init(&r);
    assert_int_equal(tally_recv(c, &r), TALLY_E_TIMEOUT);
    if (!strstr(r.error, "no reply from the fleet within ") ||
        !strstr(r.error, " ms (the last answer: not_owner, partition 0 has no owner now)"))
        fail_msg("the timeout says: %s", r.error);
    tally_reply_clear(&r);
    assert_true(atomic_load(&z->count) >= 2);
    tally_client_destroy(&c);
    fake_member_stop(&z);
    kvStore_Destroy(fleet);
    kvStore_Destroy(ls);
    kvStore_Destroy(eps);
    fresh_fleet();
}

/* ---- 5. shared memory through the fleet client ------------------------------------------- */

#define SLOT 1024 /* bytes of the region for each stream's batch (tf_batch writes up to 500) */

/* Stream s's numbered hist of round r by reference to its slot of region `in`: the batch
 * written there, its counts into want (256) and the model. The request id into *id. */
static tally_status_t send_hist_shm(tally_client_t *c, tally_region_t *in, int s, int r,
                                    uint64_t *want, uint64_t *id)
{
    uint8_t *at = (uint8_t *)tally_region_data(in) + (size_t)s * SLOT;
    size_t n = tf_batch(s, r, at);
    char name[32];
    tf_stream_name(&test_fleet, s, name, sizeof name);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    req.seq = seqs[s] + 1;
    tally_status_t st = tally_send_shm(c, &req, in, (size_t)s * SLOT, n, NULL, 0, id);
    if (st == TALLY_OK) {
        seqs[s]++;
        memset(want, 0, 256 * sizeof *want);
        tr_hist_parts(TALLY_DTYPE_U8, at, n, 0, 0, want, NULL, NULL);
        for (int b = 0; b < 256; b++)
            model[s][b] += want[b];
    }
    return st;
}

/* Every stream in `which` (NULL: all) sent its round-r hist by reference, pipelined, then
 * `between` run (NULL: nothing); each reply equals its batch's counts. */
static void hist_shm_all(tally_client_t *c, tally_region_t *in, int r, const bool *which,
                         void (*between)(void))
{
    static uint64_t want[STREAMS][256];
    uint64_t req_ids[STREAMS] = {0};
    int sent = 0;
    for (int s = 0; s < STREAMS; s++) {
        if (which && !which[s])
            continue;
        tally_status_t st = send_hist_shm(c, in, s, r, want[s], &req_ids[s]);
        if (st != TALLY_OK)
            fail_msg("send_shm route/%d: %s: %s", s, tally_status_name(st), tally_client_error(c));
        sent++;
    }
    if (between)
        between();
    for (int i = 0; i < sent; i++) {
        tally_reply_t rep;
        tally_reply_init(&rep);
        tally_status_t st = tally_recv(c, &rep);
        if (st != TALLY_OK)
            fail_msg("reply %d of %d: %s: %s", i + 1, sent, tally_status_name(st), rep.error);
        int s = 0;
        while (s < STREAMS && (!req_ids[s] || req_ids[s] != rep.rep.request_id))
            s++;
        assert_true(s < STREAMS);
        req_ids[s] = 0;
        assert_int_equal(rep.len, 256 * 8);
        for (int b = 0; b < 256; b++)
            assert_int_equal(tally_get_u64((const uint8_t *)rep.payload + 8 * b), want[s][b]);
        tally_reply_clear(&rep);
    }
}

/* A stable filter (> 100) of stream s's slot into an output region on its owner: the count and
 * the output equal the reference's. Its stream is "shmf/<s>", of s's partition. */
static void filter_shm(tally_client_t *c, tally_region_t *in, tally_region_t *out, int s)
{
    const uint8_t *at = (const uint8_t *)tally_region_data(in) + (size_t)s * SLOT;
    size_t n = tf_batch(s, 0, (uint8_t *)tally_region_data(in) + (size_t)s * SLOT);
    char name[32];
    int j = 0; /* a filter stream in s's partition, apart from the model's */
    do
        snprintf(name, sizeof name, "shmf/%d", j++);
    while (tally_partition(name, strlen(name), PARTITIONS) != tf_partition_of(&test_fleet, s));
    tally_req_t req = th_req(TALLY_OP_FILTER, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    req.flags |= TALLY_FLAG_FILTER_STABLE;
    req.pred = TALLY_PRED_GT;
    req.lo = 100;
    uint8_t ref[SLOT];
    size_t kept = tr_filter(TALLY_DTYPE_U8, at, n, TALLY_PRED_GT, 100, 0, ref);
    tally_reply_t r;
    tally_reply_init(&r);
    tally_status_t st = tally_call_shm(c, &req, in, (size_t)s * SLOT, n, out, 0, &r);
    if (st != TALLY_OK)
        fail_msg("filter route/%d: %s: %s", s, tally_status_name(st), r.error);
    assert_int_equal(r.rep.count, kept);
    assert_int_equal(r.rep.aux0, n);
    assert_int_equal(r.len, 0);
    assert_memory_equal(tally_region_data(out), ref, kept);
    tally_reply_clear(&r);
}

/* Member b, stopped with requests sent to it, killed (kill -9). */
static void kill_b(void)
{
    kill(member[1].pid, SIGKILL);
    th_daemon_wait(&member[1], 5000);
    member[1].pid = 0;
}

static void wait_regions(const th_daemon_t *d, long long want)
{
    int64_t until = th_now_ms() + TIMEOUT_MS;
    while (th_metric(d, "tallyd_shm_regions") != want && th_now_ms() < until)
        th_sleep_ms(50);
    assert_int_equal(th_metric(d, "tallyd_shm_regions"), want);
}

static void test_shm_through_fleet(void **state)
{
    (void)state;
    fresh_fleet();
    /* a advertises an ipc endpoint: started again there, it is the same member to the client */
    char dir[128], ipc[192];
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-route"), 0);
    snprintf(ipc, sizeof ipc, "ipc://%s/a.sock", dir);
    start(0, "200", ipc);
    wait_held(ids[0], PARTITIONS);
    /* a's record names this host: the kernel's boot id */
    char host[TALLY_FLEET_HOST_MAX], mine[TALLY_FLEET_HOST_MAX];
    kvStore *eps = NULL;
    kvEntry *e = NULL;
    assert_int_equal(js_KeyValue(&eps, tn_suite_js, TALLY_NATS_BUCKET_ENDPOINTS), NATS_OK);
    assert_int_equal(kvStore_Get(&e, eps, ids[0]), NATS_OK);
    assert_true(tally_fleet_endpoint_get(kvEntry_Value(e), (size_t)kvEntry_ValueLen(e), "host",
                                         host, sizeof host));
    kvEntry_Destroy(e);
    kvStore_Destroy(eps);
    assert_true(tally_fleet_host_id(mine, sizeof mine));
    assert_int_equal(strlen(mine), 36);
    assert_string_equal(host, mine);

    tally_client_t *c = tf_fleet_client(tn_suite.urls, TIMEOUT_MS);
    tally_region_t *in = NULL, *out = NULL;
    assert_int_equal(tally_region_create(c, STREAMS * SLOT, &in), TALLY_OK);
    assert_int_equal(tally_region_create(c, SLOT, &out), TALLY_OK);
    wait_regions(&member[0], 0); /* registered when first used */
    hist_shm_all(c, in, 0, NULL, NULL);
    wait_regions(&member[0], 1);

    /* b joins on "another host": a gives half up; b's streams, sent to a, follow its
     * not_owner (or the buckets) to b, which cannot take the region: answered here. */
    setenv("TALLYD_TEST_HOST_ID", "another-host", 1);
    start(1, "200", NULL);
    unsetenv("TALLYD_TEST_HOST_ID");
    wait_held(ids[0], PARTITIONS / 2);
    wait_held(ids[1], PARTITIONS / 2);
    int sb = stream_held_by(ids[1]);
    uint64_t want[256], id = 0;
    assert_int_equal(send_hist_shm(c, in, sb, 1, want, &id), TALLY_OK);
    seqs[sb]--; /* refused: not applied */
    for (int b = 0; b < 256; b++)
        model[sb][b] -= want[b];
    tally_reply_t r;
    tally_reply_init(&r);
    assert_int_equal(tally_recv(c, &r), TALLY_E_ARG);
    assert_int_equal(r.rep.request_id, id);
    if (!strstr(r.error, "member route-b (") || !strstr(r.error, "is on another host"))
        fail_msg("refusal: %s", r.error);
    tally_reply_clear(&r);
    /* sent to b straight (its owner known now): refused before it is sent */
    assert_int_equal(send_hist_shm(c, in, sb, 1, want, &id), TALLY_E_ARG);
    assert_non_null(strstr(tally_client_error(c), "is on another host (host=another-host; "));
    bool of_a[STREAMS];
    for (int s = 0; s < STREAMS; s++) {
        char h[80];
        holder(tf_partition_of(&test_fleet, s), h, sizeof h);
        of_a[s] = strcmp(h, ids[0]) == 0;
    }
    hist_shm_all(c, in, 1, of_a, NULL);
    wait_regions(&member[1], 0);

    /* b stopped: every stream to a (b's partitions rerouted from b, which is gone); b again,
     * on this host: its streams, sent to a, follow a's not_owner to b and are registered there
     * on the way; every reply and every stream equal to the model */
    assert_int_equal(th_daemon_stop(&member[1], SIGTERM, TIMEOUT_MS), 0);
    member[1].pid = 0;
    wait_held(ids[0], PARTITIONS);
    hist_shm_all(c, in, 2, NULL, NULL);
    start(1, "200", NULL);
    wait_held(ids[0], PARTITIONS / 2);
    wait_held(ids[1], PARTITIONS / 2);
    wait_regions(&member[1], 0);
    long long followed = th_metric(&member[0], "tallyd_nats_not_owner_total");
    hist_shm_all(c, in, 3, NULL, NULL);
    assert_true(th_metric(&member[0], "tallyd_nats_not_owner_total") > followed);
    hist_shm_all(c, in, 4, NULL, NULL);
    tf_check_model(&test_fleet, c);
    filter_shm(c, in, out, stream_held_by(ids[0]));
    filter_shm(c, in, out, stream_held_by(ids[1]));
    wait_regions(&member[0], 2);
    wait_regions(&member[1], 2);
    tally_region_destroy(&out); /* released on both */
    assert_null(out);
    wait_regions(&member[0], 1);
    wait_regions(&member[1], 1);

    /* a stopped and started again at the same endpoint: its regions went with its process (its
     * side connection closed); the next request to it registers the region again */
    assert_int_equal(th_daemon_stop(&member[0], SIGTERM, TIMEOUT_MS), 0);
    member[0].pid = 0;
    wait_held(ids[1], PARTITIONS);
    start(0, "200", ipc);
    wait_held(ids[0], PARTITIONS / 2);
    wait_held(ids[1], PARTITIONS / 2);
    wait_regions(&member[0], 0);
    hist_shm_all(c, in, 5, NULL, NULL);
    tf_check_model(&test_fleet, c);
    wait_regions(&member[0], 1);

    /* b stopped (SIGSTOP) with a numbered request by reference on every stream of its, then
     * killed: each is sent again to a once it has taken over, with a's handle (b's would be
     * bad_ref there), and applied once */
    int64_t until = th_now_ms() + TIMEOUT_MS;
    while (info_u64(&member[1], "nats_direct_uncommitted") != 0 && th_now_ms() < until)
        th_sleep_ms(50);
    assert_int_equal(info_u64(&member[1], "nats_direct_uncommitted"), 0);
    assert_int_equal(kill(member[1].pid, SIGSTOP), 0);
    hist_shm_all(c, in, 6, NULL, kill_b);
    wait_held(ids[0], PARTITIONS);
    tf_check_model(&test_fleet, c);
    tally_region_destroy(&in);
    assert_null(in);
    wait_regions(&member[0], 0);
    tally_client_destroy(&c);

    /* The CLI: `tally --fleet URL hist --stream S --in FILE --shm`, to b's stream */
    char path[160], name[32];
    snprintf(path, sizeof path, "%s/in.bin", dir);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint8_t data[600];
    size_t n = tf_batch(sb, 9, data);
    assert_int_equal(fwrite(data, 1, n, f), n);
    fclose(f);
    tf_stream_name(&test_fleet, sb, name, sizeof name);
    th_cli_t q = th_cli(dir, member[0].endpoint, "--fleet %s hist --stream %s --in %s --shm",
                        tn_suite.urls, name, path);
    if (q.status != 0)
        fail_msg("tally --fleet hist --shm: %d: %s", q.status, q.err);
    th_cli_free(&q);
    tr_hist_parts(TALLY_DTYPE_U8, data, n, 0, 0, model[sb], NULL, NULL);
    seqs[sb]++; /* the CLI numbers a stream's chunks from its last_seq */
    c = tf_fleet_client(tn_suite.urls, TIMEOUT_MS);
    char why[160];
    tf_stream_name(&test_fleet, sb, name, sizeof name);
    if (th_stream_differs(c, name, seqs[sb], model[sb], why, sizeof why))
        fail_msg("%s", why);
    tally_client_destroy(&c);
    wait_regions(&member[0], 0);
    stop_clean();
    th_rmrf(dir);
}

/* Records that say no: partition 0's owner publishes no host, 1's another host, 2's no side
 * channel, 3's all of it; every one of them is one plain tallyd (no fleet member: it runs what
 * it is sent), so only the records differ. */
static void test_shm_refusals(void **state)
{
    (void)state;
    fresh_fleet();
    const char *args[] = {"--metrics", "127.0.0.1:0", "--shm-max-regions-per-peer", "1", NULL};
    assert_int_equal(th_daemon_start(&member[0], args), 0);
    char host[TALLY_FLEET_HOST_MAX], rec[512];
    assert_true(tally_fleet_host_id(host, sizeof host));
    kvStore *fleet = bucket(TALLY_NATS_BUCKET_FLEET), *ls = bucket(TALLY_NATS_BUCKET_LEASES),
            *eps = bucket(TALLY_NATS_BUCKET_ENDPOINTS);
    put(fleet, TALLY_NATS_KEY_PARTITIONS, "4");
    const char *owners[PARTITIONS] = {"no-host", "elsewhere", "no-shm", "local"};
    for (uint32_t k = 0; k < PARTITIONS; k++) {
        char key[8];
        snprintf(key, sizeof key, "p%u", (unsigned)k);
        put(ls, key, owners[k]);
    }
    const char *ep = member[0].endpoint, *side = member[0].shm_socket;
    snprintf(rec, sizeof rec, "zmq=%s\nshm=%s\n", ep, side);
    put(eps, "no-host", rec);
    snprintf(rec, sizeof rec, "zmq=%s\nhost=elsewhere\nshm=%s\n", ep, side);
    put(eps, "elsewhere", rec);
    snprintf(rec, sizeof rec, "zmq=%s\nhost=%s\n", ep, host);
    put(eps, "no-shm", rec);
    snprintf(rec, sizeof rec, "zmq=%s\nhost=%s\nshm=%s\n", ep, host, side);
    put(eps, "local", rec);
    tally_client_t *c = tf_fleet_client(tn_suite.urls, TIMEOUT_MS);
    tally_region_t *in = NULL;
    assert_int_equal(tally_region_create(c, STREAMS * SLOT, &in), TALLY_OK);
    const char *why[PARTITIONS] = {"member no-host (", "member elsewhere (", "member no-shm (",
                                   NULL};
    const char *because[PARTITIONS] = {"publishes no host (host= in TALLY_ENDPOINTS)",
                                       "is on another host (host=elsewhere; ",
                                       "offers no shared memory", NULL};
    uint64_t want[256], id;
    for (uint32_t k = 0; k < PARTITIONS - 1; k++) {
        int s = stream_in(k);
        assert_int_equal(send_hist_shm(c, in, s, 0, want, &id), TALLY_E_ARG);
        const char *e = tally_client_error(c);
        if (!strstr(e, why[k]) || !strstr(e, because[k]) || !strstr(e, ep))
            fail_msg("partition %u: %s", (unsigned)k, e);
    }
    /* the local one takes it, with tally_call_shm too */
    int s3 = stream_in(3);
    assert_int_equal(send_hist_shm(c, in, s3, 0, want, &id), TALLY_OK);
    recv_ok(c, 1);
    char name[32];
    tf_stream_name(&test_fleet, s3, name, sizeof name);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    tally_reply_t r;
    tally_reply_init(&r);
    assert_int_equal(tally_call_shm(c, &req, in, 0, 64, NULL, 0, &r), TALLY_OK);
    assert_int_equal(r.rep.aux0, 64);
    tally_reply_clear(&r);
    assert_int_equal(th_metric(&member[0], "tallyd_shm_regions"), 1);
    /* a second region, past the member's regions per peer: its registration refused, said */
    tally_region_t *second = NULL;
    assert_int_equal(tally_region_create(c, 4096, &second), TALLY_OK);
    assert_int_equal(tally_call_shm(c, &req, second, 0, 64, NULL, 0, &r), TALLY_E_QUOTA);
    if (!strstr(r.error, "registering a region with member local: "))
        fail_msg("%s", r.error);
    tally_region_destroy(&second);
    /* a record that claims a side channel its tallyd does not offer (--shm off): the member's
     * own answer, said */
    const char *off[] = {"--shm", "off", NULL};
    assert_int_equal(th_daemon_start(&member[1], off), 0);
    snprintf(rec, sizeof rec, "zmq=%s\nhost=%s\nshm=/nowhere\n", member[1].endpoint, host);
    put(eps, "liar", rec);
    put(ls, "p3", "liar");
    tally_client_t *c2 = tf_fleet_client(tn_suite.urls, TIMEOUT_MS);
    tally_region_t *third = NULL;
    assert_int_equal(tally_region_create(c2, 4096, &third), TALLY_OK);
    assert_int_equal(tally_call_shm(c2, &req, third, 0, 64, NULL, 0, &r), TALLY_E_ARG);
    if (!strstr(r.error, "registering a region with member liar: the daemon offers no shared"))
        fail_msg("%s", r.error);
    tally_region_destroy(&third);
    tally_client_destroy(&c2);
    assert_int_equal(th_daemon_stop(&member[1], SIGTERM, TIMEOUT_MS), 0);
    member[1].pid = 0;
    /* a region of another client: not this fleet client's to register */
    tally_client_t *plain = NULL;
    tally_region_t *other = NULL;
    assert_int_equal(tally_client_new(ep, TIMEOUT_MS, &plain), TALLY_OK);
    assert_int_equal(tally_region_create(plain, 4096, &other), TALLY_OK);
    assert_int_equal(tally_call_shm(c, &req, other, 0, 64, NULL, 0, &r), TALLY_E_ARG);
    assert_non_null(strstr(r.error, "the region was not made by this client"));
    /* a client over NATS (tally_client_new_nats) has no member to hand a region to */
    tally_nats_opts_t no = {.servers = tn_suite.urls, .timeout_ms = 1000, .partitions = PARTITIONS};
    tally_client_t *nc = NULL;
    tally_region_t *none = NULL;
    assert_int_equal(tally_client_new_nats(&no, &nc, msg, sizeof msg), TALLY_OK);
    assert_int_equal(tally_region_create(nc, 4096, &none), TALLY_E_ARG);
    assert_string_equal(tally_client_error(nc), "shared memory is not available over NATS");
    assert_int_equal(tally_send_shm(nc, &req, other, 0, 64, NULL, 0, NULL), TALLY_E_ARG);
    assert_string_equal(tally_client_error(nc), "shared memory is not available over NATS");
    tally_client_destroy(&nc);
    tally_region_destroy(&other);
    tally_client_destroy(&plain);
    tally_region_destroy(&in);
    wait_regions(&member[0], 0);
    tally_client_destroy(&c);
    end_faked(fleet, ls, eps);
}

/* 5c. A shared-memory hist over the owner's max_batch (64 KiB here) through the fleet client:
 * tally_call_shm cuts it into pieces of the owner's max_batch, as for one tallyd, one reply
 * with the counts of all and aux0 the elements of all; the stream holds them; a tally_send_shm
 * of the whole (no pieces) is the owner's too_large. */
static void test_shm_pieces_through_fleet(void **state)
{
    (void)state;
    fresh_fleet();
    const char *extra[] = {"--max-batch", "64K", NULL};
    start_with(0, "200", NULL, extra);
    wait_held(ids[0], PARTITIONS);
    tally_client_t *c = tf_fleet_client(tn_suite.urls, TIMEOUT_MS);
    size_t len = (1u << 20) + 5; /* 16 pieces and 5 bytes */
    tally_region_t *in = NULL;
    assert_int_equal(tally_region_create(c, len, &in), TALLY_OK);
    uint8_t *data = tally_region_data(in);
    for (size_t j = 0; j < len; j++)
        data[j] = (uint8_t)(j * 7 + (j >> 9));
    uint64_t want[256] = {0};
    tr_hist_parts(TALLY_DTYPE_U8, data, len, 0, 0, want, NULL, NULL);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, "route/pieces"), TALLY_OK);
    tally_reply_t r;
    tally_reply_init(&r);
    tally_status_t st = tally_call_shm(c, &req, in, 0, len, NULL, 0, &r);
    if (st != TALLY_OK)
        fail_msg("tally_call_shm of %zu bytes: %s: %s", len, tally_status_name(st), r.error);
    assert_int_equal(r.rep.aux0, len);
    assert_true(th_u64s_equal(r.payload, r.len, want, 256));
    tally_reply_clear(&r);
    char why[160];
    if (th_stream_differs(c, "route/pieces", 0, want, why, sizeof why))
        fail_msg("%s", why);
    uint64_t id = 0;
    assert_int_equal(tally_send_shm(c, &req, in, 0, len, NULL, 0, &id), TALLY_OK);
    assert_int_equal(tally_recv(c, &r), TALLY_E_TOO_LARGE);
    assert_int_equal(r.rep.request_id, id);
    tally_reply_clear(&r);
    tally_region_destroy(&in);
    tally_client_destroy(&c);
    stop_clean();
}

/* ---- 6. CURVE through the fleet client ----------------------------------------------------- */

/* Three key pairs in a new folder dir (128 bytes), named names: each one's key file in path,
 * its public key in pub. */
static void keys_in(char *dir, const char *const names[3], char path[3][192], char pub[3][41])
{
    assert_int_equal(th_tmpdir(dir, 128, "tally-route"), 0);
    for (int i = 0; i < 3; i++) {
        char base[160];
        snprintf(base, sizeof base, "%s/%s", dir, names[i]);
        assert_int_equal(tally_keygen(base, pub[i], msg, sizeof msg), TALLY_OK);
        snprintf(path[i], sizeof path[i], "%s.key", base);
    }
}

/* Member i in direct mode with CURVE on: its server key file, one client key allowed. The harness
 * reaches it with server_pub and that client's pair. */
static void start_curve(int i, const char *key_file, const char *server_pub,
                        const tally_curve_keys_t *client)
{
    const char *extra[] = {"--curve-secret-key", key_file, "--curve-clients", client->client_public,
                           NULL};
    th_use_curve(server_pub, client->client_public, client->client_secret);
    start_with(i, "200", NULL, extra);
    th_use_curve(NULL, NULL, NULL);
}

/* Member id's published server key (curve=), into out ("" when none). */
static void published_key(const char *id, char *out, size_t cap)
{
    kvStore *eps = NULL;
    kvEntry *e = NULL;
    assert_int_equal(js_KeyValue(&eps, tn_suite_js, TALLY_NATS_BUCKET_ENDPOINTS), NATS_OK);
    assert_int_equal(kvStore_Get(&e, eps, id), NATS_OK);
    if (!tally_fleet_endpoint_get(kvEntry_Value(e), (size_t)kvEntry_ValueLen(e), "curve", out, cap))
        out[0] = '\0';
    kvEntry_Destroy(e);
    kvStore_Destroy(eps);
}

/* An unnumbered hist to stream s through c is refused TALLY_E_ARG at once (no wait for an owner
 * that its keys cannot reach), the error naming the member and saying `because`. */
static void refused_keys(tally_client_t *c, int s, const char *id, const char *because)
{
    int64_t t0 = th_now_ms();
    send_hist_status(c, s, TALLY_E_ARG);
    const char *e = tally_client_error(c);
    char who[64];
    snprintf(who, sizeof who, "member %s (", id);
    if (!strstr(e, who) || !strstr(e, because))
        fail_msg("stream route/%d: %s", s, e);
    if (th_now_ms() - t0 > TIMEOUT_MS / 2)
        fail_msg("refused after %lld ms, as if waiting for an owner",
                 (long long)(th_now_ms() - t0));
}

/* Two members with CURVE on, each its own server key, published as curve= in TALLY_ENDPOINTS;
 * a fleet client with the allowed client key pair (tally_curve_client_keys_load, no server key)
 * applies numbered hists to every stream on both owners, equal to the model; a fleet client
 * without keys, or with another member's server key pinned, is refused for the members it
 * cannot reach (TALLY_E_ARG, named), not left to time out; the CLI's --fleet with --client-key
 * queries, without it is refused; and a client with keys sends nothing to a member that
 * publishes no key (a record faked in the buckets in front of a plain tallyd). */
static void test_curve_through_fleet(void **state)
{
    (void)state;
    fresh_fleet();
    char dir[128], path[3][192], pub[3][41];
    keys_in(dir, (const char *const[3]){"a", "b", "client"}, path, pub);
    tally_curve_keys_t keys, none;
    assert_int_equal(tally_curve_client_keys_load(NULL, path[2], &keys, msg, sizeof msg), TALLY_OK);
    assert_string_equal(keys.client_public, pub[2]);
    assert_string_equal(keys.server_public, ""); /* each member's own, from the bucket */
    start_curve(0, path[0], pub[0], &keys);
    wait_held(ids[0], PARTITIONS);
    start_curve(1, path[1], pub[1], &keys);
    wait_held(ids[0], PARTITIONS / 2);
    wait_held(ids[1], PARTITIONS / 2);
    for (int i = 0; i < 2; i++) {
        char seen[64];
        published_key(ids[i], seen, sizeof seen);
        assert_string_equal(seen, pub[i]);
    }
    tally_nats_opts_t o = {.servers = tn_suite.urls, .timeout_ms = TIMEOUT_MS};
    tally_client_t *c = NULL;
    if (tally_client_new_fleet_curve(&o, &keys, &c, msg, sizeof msg) != TALLY_OK)
        fail_msg("tally_client_new_fleet_curve: %s", msg);
    for (int s = 0; s < STREAMS; s++)
        send_hist(c, s, 0, true);
    recv_ok(c, STREAMS);
    tf_check_model(&test_fleet, c);
    tally_client_destroy(&c);

    /* no keys: refused for either member; member a's key pinned: b refused, a's taken */
    int sa = stream_held_by(ids[0]), sb = stream_held_by(ids[1]);
    tally_client_t *plain = tf_fleet_client(tn_suite.urls, TIMEOUT_MS);
    refused_keys(plain, sa, ids[0], "takes CURVE connections only");
    refused_keys(plain, sb, ids[1], "takes CURVE connections only");
    tally_client_destroy(&plain);
    tally_curve_keys_t pinned;
    assert_int_equal(tally_curve_client_keys_load(pub[0], path[2], &pinned, msg, sizeof msg),
                     TALLY_OK);
    assert_string_equal(pinned.server_public, pub[0]);
    assert_int_equal(tally_client_new_fleet_curve(&o, &pinned, &c, msg, sizeof msg), TALLY_OK);
    refused_keys(c, sb, ids[1], "has another server key than the one given");
    send_hist(c, sa, 1, true);
    recv_ok(c, 1);
    char name[32], why[160];
    tf_stream_name(&test_fleet, sa, name, sizeof name);
    if (th_stream_differs(c, name, seqs[sa], model[sa], why, sizeof why))
        fail_msg("%s", why);
    tally_client_destroy(&c);

    /* the CLI: --client-key reaches b's stream; without it, refused, named */
    th_cli_t q = th_cli(dir, member[0].endpoint, "--fleet %s --client-key %s query --json route/%d",
                        tn_suite.urls, path[2], sb);
    if (q.status != 0 || !strstr(q.out, "\"last_seq\":1,"))
        fail_msg("tally --fleet --client-key: %d: %s%s", q.status, q.out, q.err);
    th_cli_free(&q);
    q = th_cli(dir, member[0].endpoint, "--fleet %s query --json route/%d", tn_suite.urls, sb);
    assert_int_not_equal(q.status, 0);
    if (!strstr(q.err, "takes CURVE connections only"))
        fail_msg("tally --fleet without keys: %s", q.err);
    th_cli_free(&q);
    stop_clean();

    /* a member that publishes no key, in front of a plain tallyd: not sent to with keys */
    fresh_fleet();
    const char *args[] = {"--metrics", "127.0.0.1:0", NULL};
    assert_int_equal(th_daemon_start(&member[0], args), 0);
    kvStore *fleet = bucket(TALLY_NATS_BUCKET_FLEET), *ls = bucket(TALLY_NATS_BUCKET_LEASES),
            *eps = bucket(TALLY_NATS_BUCKET_ENDPOINTS);
    put(fleet, TALLY_NATS_KEY_PARTITIONS, "4");
    char rec[512];
    snprintf(rec, sizeof rec, "zmq=%s\n", member[0].endpoint);
    put(eps, "plain", rec);
    for (uint32_t k = 0; k < PARTITIONS; k++) {
        char key[8];
        snprintf(key, sizeof key, "p%u", (unsigned)k);
        put(ls, key, "plain");
    }
    assert_int_equal(tally_client_new_fleet_curve(&o, &keys, &c, msg, sizeof msg), TALLY_OK);
    refused_keys(c, 0, "plain", "sends nothing in plain text");
    tally_client_destroy(&c);
    memset(&none, 0, sizeof none); /* a pinned server key without a pair: refused */
    memcpy(none.server_public, pinned.server_public, sizeof none.server_public);
    assert_int_equal(tally_client_new_fleet_curve(&o, &none, &c, msg, sizeof msg), TALLY_E_ARG);
    assert_null(c);
    assert_non_null(strstr(msg, "a server key is set but no client key"));
    memset(&none, 0, sizeof none); /* no pair: a plain client, which that member takes */
    assert_int_equal(tally_client_new_fleet_curve(&o, &none, &c, msg, sizeof msg), TALLY_OK);
    send_hist(c, 0, 0, false);
    recv_ok(c, 1);
    tally_client_destroy(&c);
    end_faked(fleet, ls, eps);
    explicit_bzero(&keys, sizeof keys);
    explicit_bzero(&pinned, sizeof pinned);
    th_rmrf(dir);
}

/* A partition's owner moves to a member whose CURVE key is not the one pinned, with a numbered
 * request of that partition unanswered (its old owner stopped, SIGSTOP): the request is
 * answered TALLY_E_ARG within a few checks, naming the new member and the key (as a first send
 * to that member is), not left to wait out the client's timeout; faked in the buckets in front
 * of one tallyd with CURVE on, published as member a with its key and as b with another. */
static void test_curve_owner_moves_to_refused_key(void **state)
{
    (void)state;
    fresh_fleet();
    char dir[128], path[3][192], pub[3][41];
    keys_in(dir, (const char *const[3]){"a", "other", "client"}, path, pub);
    tally_curve_keys_t pinned;
    assert_int_equal(tally_curve_client_keys_load(pub[0], path[2], &pinned, msg, sizeof msg),
                     TALLY_OK);
    const char *args[] = {"--curve-secret-key", path[0], "--curve-clients", pinned.client_public,
                          NULL};
    th_use_curve(pub[0], pinned.client_public, pinned.client_secret);
    assert_int_equal(th_daemon_start(&member[0], args), 0);
    th_use_curve(NULL, NULL, NULL);
    kvStore *fleet = bucket(TALLY_NATS_BUCKET_FLEET), *ls = bucket(TALLY_NATS_BUCKET_LEASES),
            *eps = bucket(TALLY_NATS_BUCKET_ENDPOINTS);
    put(fleet, TALLY_NATS_KEY_PARTITIONS, "4");
    char rec[512];
    snprintf(rec, sizeof rec, "zmq=%s\ncurve=%s\n", member[0].endpoint, pub[0]);
    put(eps, "a", rec);
    snprintf(rec, sizeof rec, "zmq=%s\ncurve=%s\n", member[0].endpoint, pub[1]);
    put(eps, "b", rec);
    for (uint32_t k = 0; k < PARTITIONS; k++) {
        char key[8];
        snprintf(key, sizeof key, "p%u", (unsigned)k);
        put(ls, key, "a");
    }
    tally_nats_opts_t o = {.servers = tn_suite.urls, .timeout_ms = 10000};
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new_fleet_curve(&o, &pinned, &c, msg, sizeof msg), TALLY_OK);
    int s = stream_in(1), s0 = stream_in(0);
    send_hist(c, s, 0, true);
    recv_ok(c, 1);
    assert_int_equal(kill(member[0].pid, SIGSTOP), 0);
    uint64_t id = send_hist(c, s, 1, true); /* to a, which does not answer */
    put(ls, "p1", "b");
    int64_t t0 = th_now_ms();
    tally_reply_t r;
    tally_reply_init(&r);
    tally_status_t st = tally_recv(c, &r);
    int64_t took = th_now_ms() - t0;
    if (st != TALLY_E_ARG || r.rep.request_id != id || !strstr(r.error, "member b (") ||
        !strstr(r.error, pub[1]) || !strstr(r.error, "has another server key than the one given"))
        fail_msg("after %lld ms: %s: %s", (long long)took, tally_status_name(st), r.error);
    if (took > 5000)
        fail_msg("answered after %lld ms, as if waiting for an owner", (long long)took);
    tally_reply_clear(&r);
    assert_int_equal(kill(member[0].pid, SIGCONT), 0);
    /* a send to b's partition is refused at once too; a's partitions are still served */
    refused_keys(c, s, "b", "has another server key than the one given");
    send_hist(c, s0, 0, true);
    recv_ok(c, 1);
    tally_client_destroy(&c);
    explicit_bzero(&pinned, sizeof pinned);
    end_faked(fleet, ls, eps);
    th_rmrf(dir);
}

/* One member past TALLY_FLEET_MEMBERS_MAX (64): 65 members published in the buckets (each a
 * partition's owner, every one the same tallyd); the first 64 are sent to, and a request for the
 * 65th's partition is answered TALLY_E_ARG at once, saying why (not left to time out as a
 * partition without an owner). */
static void test_members_past_cap(void **state)
{
    (void)state;
    enum { MEMBERS = 65 };
    fresh_fleet();
    const char *args[] = {"--metrics", "127.0.0.1:0", NULL};
    assert_int_equal(th_daemon_start(&member[0], args), 0);
    kvStore *fleet = bucket(TALLY_NATS_BUCKET_FLEET), *ls = bucket(TALLY_NATS_BUCKET_LEASES),
            *eps = bucket(TALLY_NATS_BUCKET_ENDPOINTS);
    char text[16], rec[512];
    snprintf(text, sizeof text, "%d", MEMBERS);
    put(fleet, TALLY_NATS_KEY_PARTITIONS, text);
    snprintf(rec, sizeof rec, "zmq=%s\n", member[0].endpoint);
    for (int k = 0; k < MEMBERS; k++) {
        char key[8], id[16];
        snprintf(key, sizeof key, "p%d", k);
        snprintf(id, sizeof id, "m%d", k);
        put(ls, key, id);
        put(eps, id, rec);
    }
    tally_nats_opts_t o = {.servers = tn_suite.urls, .timeout_ms = TIMEOUT_MS};
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new_fleet(&o, &c, msg, sizeof msg), TALLY_OK);
    char name[MEMBERS][32];
    for (int k = 0, i = 0; k < MEMBERS; i++) { /* a stream of each partition, in order */
        snprintf(name[k], sizeof name[k], "cap/%d", i);
        if (tally_partition(name[k], strlen(name[k]), MEMBERS) == (uint32_t)k)
            k++;
    }
    uint8_t data[64] = {1};
    for (int k = 0; k < MEMBERS; k++) {
        tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
        assert_int_equal(tally_req_set_stream(&req, name[k]), TALLY_OK);
        tally_reply_t r;
        tally_reply_init(&r);
        int64_t t0 = th_now_ms();
        tally_status_t st = tally_call(c, &req, data, sizeof data, &r);
        if (k < MEMBERS - 1 && st != TALLY_OK)
            fail_msg("member m%d: %s: %s", k, tally_status_name(st), r.error);
        if (k == MEMBERS - 1 &&
            (st != TALLY_E_ARG || !strstr(r.error, "member m64 (") ||
             !strstr(r.error, "past the 64 members a fleet client connects to") ||
             th_now_ms() - t0 > TIMEOUT_MS / 2))
            fail_msg("member m64: %s: %s", tally_status_name(st), r.error);
        tally_reply_clear(&r);
    }
    tally_client_destroy(&c);
    end_faked(fleet, ls, eps);
}

int main(void)
{
    if (tn_skip())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_refusals, stop_members),
        cmocka_unit_test_teardown(test_no_owner, stop_members),
        cmocka_unit_test_teardown(test_resends_keep_stream_order, stop_members),
        cmocka_unit_test_teardown(test_owner_and_not_owner, stop_members),
        cmocka_unit_test_teardown(test_handover_follows_not_owner, stop_members),
        cmocka_unit_test_teardown(test_kill_owner_resends_once, stop_members),
        cmocka_unit_test_teardown(test_stopped_owner_forgets_uncommitted, stop_members),
        cmocka_unit_test_teardown(test_kill_owner_resends_what_changes_nothing, stop_members),
        cmocka_unit_test_teardown(test_owner_gone_reroutes, stop_members),
        cmocka_unit_test_teardown(test_shm_refusals, stop_members),
        cmocka_unit_test_teardown(test_shm_through_fleet, stop_members),
        cmocka_unit_test_teardown(test_shm_pieces_through_fleet, stop_members),
        cmocka_unit_test_teardown(test_curve_through_fleet, stop_members),
        cmocka_unit_test_teardown(test_curve_owner_moves_to_refused_key, stop_members),
        cmocka_unit_test_teardown(test_members_past_cap, stop_members),
    };
    const char *only = getenv("TALLY_TEST_FILTER"); /* one test by name (a mutation check) */
    if (only)
        cmocka_set_test_filter(only);
    return cmocka_run_group_tests(tests, setup, teardown);
}
