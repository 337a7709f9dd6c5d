/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_config.c — a fleet that does not match what joins it, and requests on the wrong
 * subject, against a real (one-node) JetStream server (PROTOCOL.md §13):
 *   - a producer before any worker has made the fleet: refused, saying to start a worker first;
 *   - a worker configured for another partition count, or another lease TTL, than the fleet it
 *     joins, and a fleet whose partition count is not a number: the worker refuses to start
 *     (start-up failed: exit status 1, as tallyd(8) says) with the reason, and the fleet is left
 *     as it was;
 *   - a worker without a member id is HOST-PID, the host name made of member id characters;
 *   - a worker without a lease TTL takes the fleet's (test_worker_takes_the_fleets_ttl), and
 *     where TALLY_LEASES has none keeps its default, refused by the fleet's other buckets;
 *   - a worker in direct mode finding TALLY_ENDPOINTS of another TTL refuses to start, saying
 *     so, and leaves the bucket as it was;
 *   - on the query subjects a worker answers only what belongs there: a message shorter than a
 *     header gets `header`, a filter on tally.q.K.USER, a query on tally.ctl.USER and a ping on
 *     tally.streams.USER get `opcode`, a query of a stream of another partition gets
 *     `stream_name`; the right ones are answered ok (as the anonymous user, to its inbox);
 *   - protected mode for [nats] servers (tallyd --check-config, no server needed): loopback
 *     URLs (127.x, localhost, [::1], with spaces around them) pass; any URL off the loopback
 *     without credentials is refused (exit 2) with the reason, unless the URL carries a user, a
 *     credentials file or an nkey is set, or protected_mode is off (a warning); a member id with
 *     other characters, a NATS user that cannot name subjects, a direct mode that is not
 *     off, local or replicated, a member id over 61 characters with members_per_process 2
 *     (its members add -0, -1; 62 pass with one member) and members_per_process 2 in direct
 *     mode are refused;
 *   - libtally's producer refuses NATS options that cannot work before connecting: an nkey
 *     without its seed file, a client certificate without its key, a CA file that cannot be
 *     read (TALLY_E_ARG, saying which); a credentials or seed file that cannot be read fails
 *     the connection (TALLY_E_TRANSPORT); what cannot be published or asked (a shared-memory
 *     reference, a seq that would overflow over its chunks, a ping on a partition, a filter as
 *     a question, a bad stream name, missing arguments) is refused before anything is sent; a
 *     partition count given by the producer is used as given.
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

#include "harness.h"
#include "nats_cluster.h"
#include "tally.h"
#include "tally_fleet.h"

#define cluster tn_suite
#define nc tn_suite_nc
#define js tn_suite_js
static char msg[512], dir[64];

static int setup(void **state)
{
    (void)state;
    if (th_tmpdir(dir, sizeof dir, "tally-nats-config") != 0)
        return -1;
    return tn_suite_setup(1);
}

static int teardown(void **state)
{
    (void)state;
    th_rmrf(dir);
    return tn_suite_teardown();
}

static const char *const worker_args[] = {"--nats-servers",
                                          NULL,
                                          "--nats-replicas",
                                          "1",
                                          "--nats-lease-ttl-ms",
                                          "3000",
                                          "--nats-member-id",
                                          "cfg",
                                          "--window-intervals",
                                          "0",
                                          NULL};

static void start_worker(th_daemon_t *d, const char *partitions)
{
    const char *args[16];
    memcpy(args, worker_args, sizeof worker_args);
    args[1] = cluster.urls;
    const char *extra[] = {"--nats-partitions", partitions, NULL};
    assert_int_equal(th_daemon_start_with(d, args, extra), 0);
}

/* A worker with `partitions` and `ttl` that must refuse to start: its exit status; log in log. */
static int refused_worker(const char *partitions, const char *ttl, char *log, size_t cap)
{
    const char *args[] = {"--nats-servers",
                          cluster.urls,
                          "--nats-replicas",
                          "1",
                          "--nats-partitions",
                          partitions,
                          "--nats-lease-ttl-ms",
                          ttl,
                          "--nats-member-id",
                          "misfit",
                          NULL};
    return th_run_refused(dir, args, log, cap, 30000);
}

static void test_producer_before_the_fleet(void **state)
{
    (void)state;
    tally_nats_opts_t o = {.servers = cluster.urls, .producer_id = "early", .timeout_ms = 5000};
    tally_nats_t *p = NULL;
    assert_int_not_equal(tally_nats_new(&o, &p, msg, sizeof msg), TALLY_OK);
    assert_null(p);
    assert_non_null(strstr(msg, "no tallyd fleet on this NATS"));
}

static void test_worker_that_does_not_fit(void **state)
{
    (void)state;
    th_daemon_t w;
    start_worker(&w, "2"); /* makes the fleet: 2 partitions, lease 3000 ms */
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
    char log[128];
    assert_int_equal(refused_worker("3", "3000", log, sizeof log), 1);
    assert_true(
        th_file_contains(log, "the fleet has 2 partitions, this worker is configured for 3"));
    assert_int_equal(refused_worker("2", "4000", log, sizeof log), 1);
    assert_true(th_file_contains(
        log, "has a TTL of 3000 ms, not 4000 (every worker of a fleet needs the same "
             "lease_ttl_ms)"));

    /* A partition count that is not one. */
    kvStore *fleet = NULL;
    assert_int_equal(js_KeyValue(&fleet, js, TALLY_NATS_BUCKET_FLEET), NATS_OK);
    uint64_t rev = 0;
    assert_int_equal(kvStore_PutString(&rev, fleet, TALLY_NATS_KEY_PARTITIONS, "lots"), NATS_OK);
    assert_int_equal(refused_worker("2", "3000", log, sizeof log), 1);
    assert_true(
        th_file_contains(log, "TALLY_FLEET/partitions holds 'lots', not a partition count"));
    assert_int_equal(kvStore_PutString(&rev, fleet, TALLY_NATS_KEY_PARTITIONS, "2"), NATS_OK);
    kvStore_Destroy(fleet);
    start_worker(&w, "2"); /* the fleet as it was: a worker that fits joins */
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

/* Without --nats-member-id a worker is HOST-PID, the host name's other characters made '-'. */
static void test_default_member_id(void **state)
{
    (void)state;
    char host[64] = "tallyd";
    gethostname(host, sizeof host - 1);
    for (char *c = host; *c; c++)
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9')))
            *c = '-';
    const char *args[] = {"--nats-servers",
                          cluster.urls,
                          "--nats-replicas",
                          "1",
                          "--nats-partitions",
                          "2",
                          "--nats-lease-ttl-ms",
                          "3000",
                          NULL};
    th_daemon_t w;
    assert_int_equal(th_daemon_start(&w, args), 0);
    char want[160];
    snprintf(want, sizeof want, "fleet: %.40s-%d joins", host, (int)w.pid);
    assert_true(th_daemon_wait_log(&w, want, 10000));
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

/* A worker with no lease_ttl_ms joins an existing fleet with the fleet's TTL (its TALLY_LEASES
 * bucket's, 3000 ms here), says so, and does not refuse to start (issue 32: before, its default
 * differed from the fleet's and it was refused). */
static void test_worker_takes_the_fleets_ttl(void **state)
{
    (void)state;
    const char *args[] = {"--nats-servers", cluster.urls, "--nats-replicas", "1",
                          "--nats-partitions", "2", "--nats-member-id", "adopter", NULL};
    th_daemon_t w;
    assert_int_equal(th_daemon_start(&w, args), 0);
    const char *want = "fleet: adopter joins on";
    assert_true(th_daemon_wait_log(&w, want, 10000));
    assert_true(th_daemon_log_contains(
        &w, "fleet: lease TTL 3000 ms, the fleet's (bucket TALLY_LEASES; [nats] lease_ttl_ms is "
            "not set)"));
    assert_true(th_daemon_log_contains(&w, "2 partitions, lease 3000 ms"));
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);

    /* A TALLY_LEASES without a TTL (made by hand, not by a worker) gives it none to take: it
     * keeps its default (15000 ms), which the fleet's other buckets refuse. */
    assert_int_equal(js_DeleteKeyValue(js, TALLY_NATS_BUCKET_LEASES), NATS_OK);
    kvConfig kc;
    kvConfig_Init(&kc);
    kc.Bucket = TALLY_NATS_BUCKET_LEASES;
    kvStore *kv = NULL;
    assert_int_equal(js_CreateKeyValue(&kv, js, &kc), NATS_OK);
    kvStore_Destroy(kv);
    const char *no_ttl[] = {"--nats-servers", cluster.urls, "--nats-replicas", "1",
                            "--nats-partitions", "2", "--nats-member-id", "adopter", NULL};
    char log[128];
    assert_int_equal(th_run_refused(dir, no_ttl, log, sizeof log, 30000), 1);
    assert_true(th_file_contains(log, "has a TTL of 3000 ms, not 15000"));
    assert_false(th_file_contains(log, "the fleet's (bucket"));
    assert_int_equal(js_DeleteKeyValue(js, TALLY_NATS_BUCKET_LEASES), NATS_OK); /* made again */
}

/* `data` (len bytes) on subject as a request from the anonymous user (PROTOCOL.md §13
 * "Security": the reply comes to an inbox under _INBOX.anon.): the reply's status (-1 without
 * a reply within 10 s). */
static int ask(const char *subject, const void *data, int len)
{
    static const char inbox[] = TALLY_NATS_INBOX TALLY_NATS_USER_ANON ".test37";
    natsSubscription *sub = NULL;
    natsMsg *reply = NULL;
    assert_int_equal(natsConnection_SubscribeSync(&sub, nc, inbox), NATS_OK);
    assert_int_equal(natsConnection_PublishRequest(nc, subject, inbox, data, len), NATS_OK);
    int st = -1;
    if (natsSubscription_NextMsg(&reply, sub, 10000) == NATS_OK) {
        tally_rep_t rep;
        st = natsMsg_GetDataLength(reply) >= TALLY_REP_HEADER_SIZE &&
                     tally_rep_decode((const uint8_t *)natsMsg_GetData(reply),
                                      TALLY_REP_HEADER_SIZE, &rep) == TALLY_OK
                 ? (int)rep.status
                 : -2;
    }
    natsMsg_Destroy(reply);
    natsSubscription_Destroy(sub);
    return st;
}

/* A header of op (on `stream`, NULL: none) on subject: the reply's status. */
static int ask_op(const char *subject, uint8_t op, const char *stream)
{
    tally_req_t req = th_req(op, TALLY_DTYPE_NONE, 9);
    if (op == TALLY_OP_FILTER) {
        req.dtype = TALLY_DTYPE_I32;
        req.pred = TALLY_PRED_GT;
    }
    if (stream)
        assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(&req, header);
    return ask(subject, header, sizeof header);
}

/* A stream name of partition k (of 2). */
static void name_in(uint32_t k, char *name, size_t cap)
{
    for (int i = 0;; i++) {
        snprintf(name, cap, "cfg/%d", i);
        if (tally_partition(name, strlen(name), 2) == k)
            return;
    }
}

static void test_wrong_subjects_refused(void **state)
{
    (void)state;
    th_daemon_t w;
    start_worker(&w, "2");
    char q0[64], ctl[64], streams[64], in0[32], in1[32];
    tally_fleet_subject(q0, sizeof q0, TALLY_NATS_SUBJ_QUERY, 0, TALLY_NATS_USER_ANON);
    tally_fleet_subject(ctl, sizeof ctl, TALLY_NATS_SUBJ_CTL, -1, TALLY_NATS_USER_ANON);
    tally_fleet_subject(streams, sizeof streams, TALLY_NATS_SUBJ_STREAMS, -1, TALLY_NATS_USER_ANON);
    name_in(0, in0, sizeof in0);
    name_in(1, in1, sizeof in1);
    /* Until the worker owns partition 0, its query subject has nobody to answer: ask until it
     * does. */
    int st = -1;
    for (int64_t t0 = th_now_ms(); st != TALLY_E_UNKNOWN_STREAM && th_now_ms() - t0 < 30000;)
        if ((st = ask_op(q0, TALLY_OP_QUERY, in0)) != TALLY_E_UNKNOWN_STREAM)
            th_sleep_ms(100);
    assert_int_equal(st, TALLY_E_UNKNOWN_STREAM); /* the right subject: answered (no such stream) */
    assert_int_equal(ask(q0, "short", 5), TALLY_E_HEADER);
    assert_int_equal(ask_op(q0, TALLY_OP_FILTER, NULL), TALLY_E_OPCODE);
    assert_int_equal(ask_op(q0, TALLY_OP_QUERY, in1), TALLY_E_STREAM_NAME);
    assert_int_equal(ask_op(ctl, TALLY_OP_QUERY, in0), TALLY_E_OPCODE);
    assert_int_equal(ask_op(streams, TALLY_OP_PING, NULL), TALLY_E_OPCODE);
    assert_int_equal(ask_op(ctl, TALLY_OP_PING, NULL), TALLY_OK);
    assert_int_equal(ask_op(streams, TALLY_OP_STREAMS, NULL), TALLY_OK);
    assert_int_equal(th_daemon_stop(&w, SIGTERM, 20000), 0);
}

/* A worker in direct mode finding TALLY_ENDPOINTS made with another TTL than its lease's (by
 * hand, or a fleet of another lease_ttl_ms) refuses to start, saying so, as for the fleet's
 * other buckets; the bucket is left as it was. */
static void test_endpoints_of_another_ttl(void **state)
{
    (void)state;
    kvConfig kc;
    kvConfig_Init(&kc);
    kc.Bucket = TALLY_NATS_BUCKET_ENDPOINTS;
    kc.TTL = 60000ll * 1000000; /* 60 s, in nanoseconds */
    kvStore *kv = NULL;
    assert_int_equal(js_CreateKeyValue(&kv, js, &kc), NATS_OK);
    kvStore_Destroy(kv);
    const char *args[] = {"--nats-servers", cluster.urls, "--nats-replicas", "1",
                          "--nats-partitions", "2", "--nats-lease-ttl-ms", "3000",
                          "--nats-member-id", "direct", "--nats-direct", "local", NULL};
    char log[128];
    assert_int_equal(th_run_refused(dir, args, log, sizeof log, 30000), 1);
    assert_true(th_file_contains(log, "key-value bucket " TALLY_NATS_BUCKET_ENDPOINTS
                                      " has a TTL of 60000 ms, not 3000"));
    kvStatus *st = NULL;
    assert_int_equal(js_KeyValue(&kv, js, TALLY_NATS_BUCKET_ENDPOINTS), NATS_OK);
    assert_int_equal(kvStore_Status(&st, kv), NATS_OK);
    assert_int_equal(kvStatus_TTL(st), kc.TTL);
    kvStatus_Destroy(st);
    kvStore_Destroy(kv);
    assert_int_equal(js_DeleteKeyValue(js, TALLY_NATS_BUCKET_ENDPOINTS), NATS_OK);
}

/* tallyd --check-config with `extra`: its exit status; stderr in the log. */
static int check_config(const char *const *extra, char *log, size_t cap)
{
    snprintf(log, cap, "%s/check.log", dir);
    const char *args[24] = {"--check-config", "--shm", "off"};
    int n = 3;
    for (int i = 0; extra[i] && n < 23; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    return th_daemon_run_to_exit(args, log, 20000);
}

static void test_protected_mode_for_nats(void **state)
{
    (void)state;
    char log[128];
    const char *local[] = {"nats://127.0.0.1:4222", "nats://[::1]:4222",
                           " nats://localhost:4222 , nats://127.0.0.2:4222 ", NULL};
    for (int i = 0; local[i]; i++) {
        const char *args[] = {"--nats-servers", local[i], NULL};
        if (check_config(args, log, sizeof log) != 0)
            fail_msg("'%s' refused (%s)", local[i], log);
    }
    const char *remote[] = {"nats://10.1.2.3:4222", "nats://127.0.0.1:4222,tls://nats.example:4222",
                            NULL};
    for (int i = 0; remote[i]; i++) {
        const char *args[] = {"--nats-servers", remote[i], NULL};
        assert_int_equal(check_config(args, log, sizeof log), 2);
        assert_true(th_file_contains(log, "protected mode: [nats] servers"));
    }
    const char *with_user[] = {"--nats-servers", "nats://worker:pw@10.1.2.3:4222", NULL};
    assert_int_equal(check_config(with_user, log, sizeof log), 0);
    char creds[128], seed[128];
    snprintf(creds, sizeof creds, "%s/worker.creds", dir);
    snprintf(seed, sizeof seed, "%s/worker.nk", dir);
    assert_int_equal(th_write_file(dir, "worker.creds", "creds\n", 6), 0);
    assert_int_equal(th_write_file(dir, "worker.nk", "SUAEXAMPLE\n", 11), 0);
    const char *with_creds[] = {"--nats-servers", "nats://10.1.2.3:4222", "--nats-credentials",
                                creds, NULL};
    assert_int_equal(check_config(with_creds, log, sizeof log), 0);
    const char *with_nkey[] = {"--nats-servers",
                               "nats://10.1.2.3:4222",
                               "--nats-nkey",
                               "UAEXAMPLE",
                               "--nats-nkey-seed",
                               seed,
                               NULL};
    assert_int_equal(check_config(with_nkey, log, sizeof log), 0);
    const char *unprotected[] = {"--nats-servers", "nats://10.1.2.3:4222", "--protected-mode",
                                 "off", NULL};
    assert_int_equal(check_config(unprotected, log, sizeof log), 0);
    assert_true(th_file_contains(log,
                                 "protected_mode is off: NATS servers nats://10.1.2.3:4222 without "
                                 "credentials"));
    const char *bad_id[] = {"--nats-servers", "nats://127.0.0.1:4222", "--nats-member-id",
                            "two words", NULL};
    assert_int_equal(check_config(bad_id, log, sizeof log), 2);
    assert_true(th_file_contains(log, "[nats] member_id 'two words': 1..64 characters"));
    /* A NATS user that cannot name the fleet's subjects, and a durability direct mode has not. */
    const char *bad_user[] = {"--nats-servers", "nats://127.0.0.1:4222", "--nats-user",
                              "two words", NULL};
    assert_int_equal(check_config(bad_user, log, sizeof log), 2);
    assert_true(th_file_contains(log, "NATS user 'two words' cannot name the fleet's subjects"));
    const char *bad_direct[] = {"--nats-servers", "nats://127.0.0.1:4222", "--nats-direct",
                                "always", NULL};
    assert_int_equal(check_config(bad_direct, log, sizeof log), 2);
    assert_true(th_file_contains(log, "[nats] direct 'always': off, local or replicated"));
    /* Several members a process: ids MEMBER_ID-0 .. -(K-1) within 64 characters; not direct. */
    char id62[63];
    memset(id62, 'm', 62);
    id62[62] = '\0';
    const char *long_base[] = {"--nats-servers", "nats://127.0.0.1:4222", "--nats-member-id",
                               id62, "--nats-members-per-process", "2", NULL};
    assert_int_equal(check_config(long_base, log, sizeof log), 2);
    assert_true(th_file_contains(log, "at most 61 characters with members_per_process 2 (the "
                                      "members are named MEMBER_ID-0 .. MEMBER_ID-1)"));
    const char *one_member[] = {"--nats-servers", "nats://127.0.0.1:4222", "--nats-member-id",
                                id62, NULL}; /* 62 characters are a member id of their own */
    assert_int_equal(check_config(one_member, log, sizeof log), 0);
    const char *direct_members[] = {"--nats-servers",
                                    "nats://127.0.0.1:4222",
                                    "--nats-direct",
                                    "local",
                                    "--nats-members-per-process",
                                    "2",
                                    NULL};
    assert_int_equal(check_config(direct_members, log, sizeof log), 2);
    assert_true(th_file_contains(log, "[nats] members_per_process 2: direct mode runs one member "
                                      "a process"));
}

/* tally_nats_new with opts: TALLY_E_ARG, and the message holds `why`. */
static void refused_opts(const tally_nats_opts_t *o, const char *why)
{
    tally_nats_t *p = NULL;
    msg[0] = '\0';
    tally_status_t st = tally_nats_new(o, &p, msg, sizeof msg);
    if (st != TALLY_E_ARG)
        fail_msg("%s: %s (%s)", why, tally_status_name(st), msg);
    assert_null(p);
    if (!strstr(msg, why))
        fail_msg("'%s', not '%s'", msg, why);
}

static void test_client_options_refused(void **state)
{
    (void)state;
    char missing[128];
    snprintf(missing, sizeof missing, "%s/none.pem", dir);
    tally_nats_opts_t base = {.servers = cluster.urls, .timeout_ms = 2000};
    tally_nats_opts_t o = base;
    o.nkey = "UAEXAMPLE";
    refused_opts(&o, "an nkey needs its seed file, and a seed file its nkey");
    o = base;
    o.nkey_seed = missing;
    refused_opts(&o, "an nkey needs its seed file");
    o = base;
    o.tls_cert = missing;
    refused_opts(&o, "a TLS client certificate needs its key, and a key its certificate");
    o = base;
    o.tls_ca = missing;
    refused_opts(&o, "TLS CA file");
    /* A credentials or seed file is read when connecting: then the connection fails. */
    for (int i = 0; i < 2; i++) {
        o = base;
        if (i == 0)
            o.credentials = missing;
        else
            o.nkey = "UAEXAMPLE", o.nkey_seed = missing;
        tally_nats_t *p = NULL;
        assert_int_equal(tally_nats_new(&o, &p, msg, sizeof msg), TALLY_E_TRANSPORT);
        assert_null(p);
    }
}

/* libtally's producer refuses what cannot be published or asked, before sending anything; an
 * explicit partition count is used as given (no fleet read). */
static void test_producer_refusals(void **state)
{
    (void)state;
    tally_nats_opts_t o = {.servers = cluster.urls,
                           .producer_id = "refusals",
                           .timeout_ms = 5000,
                           .partitions = TALLY_NATS_MAX_PARTITIONS + 1};
    tally_nats_t *p = NULL;
    assert_int_equal(tally_nats_new(&o, &p, msg, sizeof msg), TALLY_E_ARG);
    assert_non_null(strstr(msg, "partitions: 1.."));
    assert_int_equal(tally_nats_new(NULL, &p, msg, sizeof msg), TALLY_E_ARG);
    assert_int_equal(tally_nats_new(&o, NULL, msg, sizeof msg), TALLY_E_ARG);
    o.partitions = 7; /* not the fleet's: taken as given */
    assert_int_equal(tally_nats_new(&o, &p, msg, sizeof msg), TALLY_OK);
    assert_int_equal(tally_nats_partitions(p), 7);
    assert_string_equal(tally_nats_producer_id(p), "refusals");
    uint8_t bytes[16] = {0};
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, "refused/x"), TALLY_OK);
    req.flags = TALLY_FLAG_SHM_REF;
    assert_int_equal(tally_nats_send(p, &req, bytes, sizeof bytes, false, NULL, NULL), TALLY_E_ARG);
    assert_non_null(strstr(tally_nats_error(p), "shared-memory references do not travel"));
    req.flags = 0;
    req.seq = UINT64_MAX; /* two chunks would overflow it */
    size_t big = 2 * tally_nats_max_payload(p);
    uint8_t *large = calloc(1, big);
    assert_non_null(large);
    assert_int_equal(tally_nats_send(p, &req, large, big, false, NULL, NULL), TALLY_E_ARG);
    assert_non_null(strstr(tally_nats_error(p), "seq overflows"));
    free(large);
    tally_req_t ping = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, 0);
    assert_int_equal(tally_nats_send(p, &ping, NULL, 0, false, NULL, NULL), TALLY_E_ARG);
    assert_int_equal(tally_nats_send(NULL, &req, NULL, 0, false, NULL, NULL), TALLY_E_ARG);
    assert_int_equal(tally_nats_send(p, &req, NULL, 4, false, NULL, NULL), TALLY_E_ARG);
    tally_reply_t reply;
    tally_reply_init(&reply);
    tally_req_t filter = th_req(TALLY_OP_FILTER, TALLY_DTYPE_I32, 0);
    filter.pred = TALLY_PRED_GT;
    assert_int_equal(tally_nats_call(p, &filter, NULL, 0, &reply), TALLY_E_ARG);
    assert_non_null(strstr(tally_nats_error(p), "only query (with a stream), ping, info"));
    assert_int_equal(tally_nats_call(p, NULL, NULL, 0, &reply), TALLY_E_ARG);
    tally_stream_info_t info;
    assert_int_equal(tally_nats_query(p, "two words", &info), TALLY_E_STREAM_NAME);
    assert_int_equal(tally_nats_query(p, NULL, &info), TALLY_E_ARG);
    assert_int_equal(tally_nats_recv(NULL, 10, &reply), TALLY_E_ARG);
    assert_int_equal(tally_nats_flush(NULL), TALLY_E_ARG);
    tally_reply_clear(&reply);
    tally_nats_destroy(&p);
    assert_null(p);
    tally_nats_destroy(&p); /* twice is harmless */
    tally_nats_destroy(NULL);
}

int main(void)
{
    if (tn_skip())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_producer_before_the_fleet),
        cmocka_unit_test(test_worker_that_does_not_fit),
        cmocka_unit_test(test_default_member_id),
        cmocka_unit_test(test_worker_takes_the_fleets_ttl),
        cmocka_unit_test(test_wrong_subjects_refused),
        cmocka_unit_test(test_endpoints_of_another_ttl),
        cmocka_unit_test(test_protected_mode_for_nats),
        cmocka_unit_test(test_client_options_refused),
        cmocka_unit_test(test_producer_refusals),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
