/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_security.c — a tallyd fleet is safe to expose (issue 36, PROTOCOL.md §13
 * "Security"), against a real 3-node cluster started from contrib/nats's own files: each node's
 * configuration as shipped with its ports, paths and hosts substituted (so client and route TLS
 * and the route password are the shipped ones), users.conf copied byte for byte (the
 * permissions exactly as shipped), certificates made by contrib/nats/make-certs.sh, and a worker
 * configured by contrib/nats/tallyd-worker.conf (its servers' hosts substituted), with CURVE on
 * for its ZeroMQ clients. One cluster and one worker serve every case. Each case is the
 * attacker's action, then the property:
 *
 *   1. a producer names a Tally-Reply it may not publish to (a watch subject, another user's
 *      inbox, the dead letters, every bucket's key), an analyst a reply subject of the same
 *      kind: nothing is written there, each message is a dead letter `not_permitted`, the
 *      fleet serves on;
 *   2. a producer and an analyst subscribe to every inbox, `>`, the buckets: refused, and
 *      nothing of another user's traffic reaches them;
 *   3. a producer publishes another producer's next dedupe ids first (a reset among them):
 *      nothing of the victim's is dropped (its messages are renamed and published again), the
 *      forgeries are dead letters;
 *   4. an analyst makes a consumer delivering into a partition, or reading one: refused, no
 *      consumer exists; `streams` still works without any consumer;
 *   5. a plaintext, an anonymous and a rogue server (its own CA, the route password) try the
 *      cluster: refused; the rogue's clients see nothing and inject nothing;
 *   6. the worker's log and the CLI's and tallyd's messages never show a password or a token;
 *   7. the documented producer numbers a push (`tally --nats … hist --stream`) through TLS with
 *      --nats-tls-ca (and the environment); a client certificate is presented where a server
 *      asks; the worker's rights cannot change a stream, delete, purge or make foreign consumers;
 *   8. a CURVE client changes a fleet's stream over ZeroMQ: not_permitted, the stream unchanged;
 *   9. direct mode's rights (PROTOCOL.md §13 "Direct mode"): the worker user makes, writes,
 *      reads and deletes in TALLY_ENDPOINTS as td_fleet_route.c does, a direct producer reads
 *      the partition count, the leases and the endpoints (tally_client_new_fleet connects) and
 *      may publish nothing to a partition; a producer that may not read the leases is told
 *      what failed (TALLY_E_TRANSPORT, the server's refusal), not that there is no fleet.
 */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cmocka.h>
#include <nats/nats.h>
#include <zmq.h>

#include "harness.h"
#include "nats_cluster.h"
#include "tally.h"
#include "tally_fleet.h"
#include "td_nats_js.h"

#define NODES 3
#define PARTITIONS 8 /* contrib/nats/tallyd-worker.conf's */
#define CONTRIB TALLY_SOURCE_DIR "/contrib/nats"

static tn_cluster_t cluster;
static char dir[256], tls_dir[300], ca[320], msg[512];
static th_daemon_t worker;
static natsConnection *op_nc; /* the operator of users.conf: reads only */
static jsCtx *op_js;

/* ---- The cluster from contrib/nats ---------------------------------------------------------- */

/* text with every `from` replaced by `to` (malloc'ed); *count: how many. */
static char *replace_all(const char *text, const char *from, const char *to, int *count)
{
    size_t fl = strlen(from), tl = strlen(to), n = 0;
    for (const char *p = text; (p = strstr(p, from)); p += fl)
        n++;
    char *out = malloc(strlen(text) + n * (tl > fl ? tl - fl : 0) + 1);
    assert_non_null(out);
    char *w = out;
    for (const char *p = text, *at; (at = strstr(p, from)); p = at + fl) {
        memcpy(w, p, (size_t)(at - p));
        w += at - p;
        memcpy(w, to, tl);
        w += tl;
        strcpy(w, at + fl); /* the tail, overwritten by the next round */
    }
    if (n == 0)
        strcpy(out, text);
    *count = (int)n;
    return out;
}

/* Replaces `from` in *text, which must hold it exactly `want` times (contrib's shape). */
static void subst(char **text, const char *from, const char *to, int want)
{
    int n = 0;
    char *out = replace_all(*text, from, to, &n);
    if (n != want)
        fail_msg("contrib/nats: '%s' found %d times, expected %d", from, n, want);
    free(*text);
    *text = out;
}

/* dir/users.conf: contrib's, byte for byte. */
static void copy_users(const char *to)
{
    char *users = th_slurp(CONTRIB "/users.conf");
    assert_non_null(users);
    assert_int_equal(th_write_file(to, "users.conf", users, strlen(users)), 0);
    char path[320];
    snprintf(path, sizeof path, "%s/users.conf", to);
    char *copy = th_slurp(path);
    assert_string_equal(copy, users);
    free(copy);
    free(users);
}

/* Node i's configuration: contrib/nats/nats-<i+1>.conf with loopback ports, this test's store and
 * certificates, and the other nodes' route ports for their host names. */
static int write_contrib_node(const tn_cluster_t *c, int i, FILE *f, void *ctx)
{
    (void)ctx;
    char path[512], to[512], from[64];
    if (i == 0)
        copy_users(c->dir); /* beside the node configurations, which include it */
    snprintf(path, sizeof path, "%s/nats-%d.conf", CONTRIB, i + 1);
    char *text = th_slurp(path);
    if (!text)
        return -1;
    snprintf(to, sizeof to, "listen: 127.0.0.1:%d", c->node[i].client_port);
    subst(&text, "listen: 0.0.0.0:4222", to, 1);
    snprintf(to, sizeof to, "listen: 127.0.0.1:%d", c->node[i].cluster_port);
    subst(&text, "listen: 0.0.0.0:6222", to, 1);
    snprintf(to, sizeof to, "%s/", tls_dir);
    subst(&text, "/etc/nats/tls/", to, 5); /* client TLS: cert, key; routes: cert, key, CA */
    snprintf(to, sizeof to, "%s/store%d", c->dir, i);
    subst(&text, "/var/lib/nats/jetstream", to, 1);
    for (int j = 0; j < NODES; j++) {
        if (j == i)
            continue;
        snprintf(from, sizeof from, "nats-%d.example.net:6222", j + 1);
        snprintf(to, sizeof to, "127.0.0.1:%d", c->node[j].cluster_port);
        subst(&text, from, to, 1);
    }
    /* What must be there as shipped: route TLS with verification, a route password, TLS for
     * clients, the users (included from the byte-for-byte copy beside this file). */
    assert_non_null(strstr(text, "verify: true"));
    assert_non_null(strstr(text, "password: \"change-me-route\""));
    assert_non_null(strstr(text, "route://route:change-me-route@127.0.0.1:"));
    assert_non_null(strstr(text, "include \"users.conf\""));
    int rc = fputs(text, f) < 0 ? -1 : 0;
    free(text);
    return rc;
}

/* The fleet's URLs for user (its password is contrib's placeholder), TLS. */
static void urls_for(const char *user, char *out, size_t cap)
{
    size_t used = 0;
    out[0] = 0;
    for (int i = 0; i < NODES; i++)
        used += (size_t)snprintf(out + used, cap - used, "%stls://%s:change-me-%s@127.0.0.1:%d",
                                 i ? "," : "", user, user, cluster.node[i].client_port);
}

/* ---- Peers: raw NATS connections as one of users.conf's users ------------------------------ */

typedef struct {
    natsConnection *nc;
    jsCtx *js;
    atomic_int denied; /* permissions violations the server reported */
} peer_t;

static void on_async_error(natsConnection *nc, natsSubscription *sub, natsStatus err, void *arg)
{
    (void)nc, (void)sub;
    peer_t *p = arg;
    if (err == NATS_NOT_PERMITTED)
        atomic_fetch_add(&p->denied, 1);
}

static void peer_open(peer_t *p, const char *user)
{
    memset(p, 0, sizeof *p);
    char password[64], prefix[64];
    snprintf(password, sizeof password, "change-me-%s", user);
    snprintf(prefix, sizeof prefix, "_INBOX.%s", user);
    const char *urls[NODES];
    for (int i = 0; i < NODES; i++)
        urls[i] = cluster.node[i].url;
    natsOptions *o = NULL;
    assert_int_equal(natsOptions_Create(&o), NATS_OK);
    assert_int_equal(natsOptions_SetServers(o, urls, NODES), NATS_OK);
    assert_int_equal(natsOptions_SetUserInfo(o, user, password), NATS_OK);
    assert_int_equal(natsOptions_SetSecure(o, true), NATS_OK);
    assert_int_equal(natsOptions_LoadCATrustedCertificates(o, ca), NATS_OK);
    assert_int_equal(natsOptions_SetCustomInboxPrefix(o, prefix), NATS_OK);
    assert_int_equal(natsOptions_SetErrorHandler(o, on_async_error, p), NATS_OK);
    assert_int_equal(natsConnection_Connect(&p->nc, o), NATS_OK);
    natsOptions_Destroy(o);
    jsOptions jo;
    jsOptions_Init(&jo);
    jo.Wait = 10000;
    assert_int_equal(natsConnection_JetStream(&p->js, p->nc, &jo), NATS_OK);
}

static void peer_close(peer_t *p)
{
    jsCtx_Destroy(p->js);
    natsConnection_Destroy(p->nc);
    memset(p, 0, sizeof *p);
}

/* Waits until the server has refused the peer `count` things in all. */
static void wait_denied(peer_t *p, int count)
{
    int64_t t0 = th_now_ms();
    while (atomic_load(&p->denied) < count && th_now_ms() - t0 < 15000)
        th_sleep_ms(20);
    assert_int_equal(atomic_load(&p->denied), count);
}

/* Messages a subscription holds; 0 for one the client closed. */
static int pending(natsSubscription *s)
{
    int msgs = 0, bytes = 0;
    return natsSubscription_GetPending(s, &msgs, &bytes) == NATS_OK ? msgs : 0;
}

/* ---- libtally clients, the worker, the operator's view ------------------------------------ */

static tally_nats_t *client_as(const char *user)
{
    char urls[512];
    urls_for(user, urls, sizeof urls);
    tally_nats_opts_t o = {.servers = urls, .tls_ca = ca, .timeout_ms = 15000};
    tally_nats_t *p = NULL;
    if (tally_nats_new(&o, &p, msg, sizeof msg) != TALLY_OK)
        fail_msg("tally_nats_new as %s: %s", user, msg);
    return p;
}

/* A request frame (header, then payload) into out; its length. */
static size_t frame(uint8_t opcode, const char *stream, const void *payload, size_t len,
                    uint8_t *out)
{
    uint8_t dtype = opcode == TALLY_OP_HIST ? TALLY_DTYPE_U8 : TALLY_DTYPE_NONE;
    size_t n = th_frame(th_req(opcode, dtype, 7), stream, payload, len, out);
    assert_int_not_equal(n, 0);
    return n;
}

static uint32_t partition_of(const char *stream)
{
    return tally_partition(stream, strlen(stream), PARTITIONS);
}

/* Sends `rounds` u8 hists of `size` bytes on stream as producer p, each with a reply, and checks
 * every reply. */
static void push(tally_nats_t *p, const char *stream, int rounds, size_t size)
{
    uint8_t *batch = calloc(1, size);
    assert_non_null(batch);
    tally_req_t req;
    memset(&req, 0, sizeof req);
    req.opcode = TALLY_OP_HIST;
    req.dtype = TALLY_DTYPE_U8;
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    for (int i = 0; i < rounds; i++)
        assert_int_equal(tally_nats_send(p, &req, batch, size, true, NULL, NULL), TALLY_OK);
    assert_int_equal(tally_nats_flush(p), TALLY_OK);
    for (int i = 0; i < rounds; i++) {
        tally_reply_t reply;
        tally_reply_init(&reply);
        if (tally_nats_recv(p, 20000, &reply) != TALLY_OK)
            fail_msg("reply %d of %d on %s: %s", i + 1, rounds, stream, tally_nats_error(p));
        tally_reply_clear(&reply);
    }
    free(batch);
}

/* `streams` answers a's request with at least one stream. */
static void expect_streams(tally_nats_t *a)
{
    char **names = NULL;
    size_t count = 0;
    assert_int_equal(tally_nats_streams(a, &names, &count), TALLY_OK);
    assert_true(count >= 1);
    tally_strings_free(names, count);
}

/* The stream's values as the analyst sees them; -1 when it does not exist. */
static long long values_of(const char *stream)
{
    tally_nats_t *a = client_as("analyst");
    tally_stream_info_t info;
    tally_status_t st = tally_nats_query(a, stream, &info);
    tally_nats_destroy(&a);
    if (st == TALLY_E_UNKNOWN_STREAM)
        return -1;
    assert_int_equal(st, TALLY_OK);
    return (long long)info.hist_total;
}

#define REFUSED_REPLY "tallyd_nats_refused_total{reason=\"reply\"}"
#define REFUSED_ID "tallyd_nats_refused_total{reason=\"id\"}"

static void wait_metric(const char *name, long long want)
{
    int64_t t0 = th_now_ms();
    while (th_metric(&worker, name) < want && th_now_ms() - t0 < 20000)
        th_sleep_ms(50);
    assert_int_equal(th_metric(&worker, name), want);
}

/* Messages in a JetStream stream, as the operator sees them. */
static uint64_t stream_msgs(const char *name, uint64_t *last)
{
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    assert_int_equal(js_GetStreamInfo(&si, op_js, name, NULL, &jerr), NATS_OK);
    uint64_t n = si->State.Msgs;
    if (last)
        *last = si->State.LastSeq;
    jsStreamInfo_Destroy(si);
    return n;
}

/* Waits until TALLY_DEAD holds `count` messages; the last `fresh` must each say not_permitted. */
static void expect_dead_letters(uint64_t count, int fresh)
{
    uint64_t last = 0;
    int64_t t0 = th_now_ms();
    while (stream_msgs("TALLY_DEAD", &last) < count && th_now_ms() - t0 < 20000)
        th_sleep_ms(50);
    assert_int_equal(stream_msgs("TALLY_DEAD", &last), count);
    for (uint64_t seq = last - (uint64_t)fresh + 1; seq <= last; seq++) {
        natsMsg *d = NULL;
        jsErrCode jerr = 0;
        assert_int_equal(js_GetMsg(&d, op_js, "TALLY_DEAD", seq, NULL, &jerr), NATS_OK);
        const char *status = NULL;
        assert_int_equal(natsMsgHeader_Get(d, "Tally-Status", &status), NATS_OK);
        assert_string_equal(status, "not_permitted");
        natsMsg_Destroy(d);
    }
}

/* A key of a bucket as the operator reads it: its value (malloc'ed, NUL-terminated) and
 * revision, or NULL when the key is not there. */
static char *kv_get(const char *bucket, const char *key, uint64_t *rev)
{
    kvStore *kv = NULL;
    kvEntry *e = NULL;
    assert_int_equal(js_KeyValue(&kv, op_js, bucket), NATS_OK);
    natsStatus s = kvStore_Get(&e, kv, key);
    char *value = NULL;
    if (s == NATS_OK) {
        value = strndup((const char *)kvEntry_Value(e), (size_t)kvEntry_ValueLen(e));
        if (rev)
            *rev = kvEntry_Revision(e);
    } else {
        assert_int_equal(s, NATS_NOT_FOUND);
    }
    kvEntry_Destroy(e);
    kvStore_Destroy(kv);
    return value;
}

/* Waits until the worker holds every partition's lease. */
static void wait_owned(const char *member)
{
    int held = 0;
    tn_wait_leases(op_js, PARTITIONS, member, PARTITIONS, 60000, &held);
    assert_int_equal(held, PARTITIONS);
}

/* The worker's configuration: contrib/nats/tallyd-worker.conf with this cluster's ports and CA. */
static void write_worker_conf(void)
{
    char *text = th_slurp(CONTRIB "/tallyd-worker.conf");
    assert_non_null(text);
    for (int i = 0; i < NODES; i++) {
        char from[64], to[64];
        snprintf(from, sizeof from, "nats-%d.example.net:4222", i + 1);
        snprintf(to, sizeof to, "127.0.0.1:%d", cluster.node[i].client_port);
        subst(&text, from, to, 1);
    }
    subst(&text, "/etc/tallyd/nats-ca.pem", ca, 1);
    assert_non_null(strstr(text, "tls://worker:change-me-worker@"));
    assert_int_equal(th_write_file(dir, "worker.conf", text, strlen(text)), 0);
    free(text);
}

static char server_pub[41], alice_pub[41], alice_sec[41];

static void start_worker(void)
{
    char server_sec[41], key[512], key_path[320], conf[320], clients[64];
    assert_int_equal(zmq_curve_keypair(server_pub, server_sec), 0);
    assert_int_equal(zmq_curve_keypair(alice_pub, alice_sec), 0);
    int n = snprintf(key, sizeof key, "curve\n    public-key = \"%s\"\n    secret-key = \"%s\"\n",
                     server_pub, server_sec);
    assert_int_equal(th_write_file(dir, "server.key", key, (size_t)n), 0);
    snprintf(key_path, sizeof key_path, "%s/server.key", dir);
    assert_int_equal(chmod(key_path, 0600), 0);
    snprintf(clients, sizeof clients, "alice:%s", alice_pub);
    write_worker_conf();
    snprintf(conf, sizeof conf, "%s/worker.conf", dir);
    /* The shipped [nats] section; this box's: a member id, small partition streams (the node's
     * store reserves each one's limit), CURVE for the ZeroMQ clients. */
    const char *args[] = {"--config",
                          conf,
                          "--metrics",
                          "127.0.0.1:0",
                          "--nats-member-id",
                          "w1",
                          "--nats-partition-max-bytes",
                          "64M",
                          "--curve-secret-key",
                          key_path,
                          "--curve-clients",
                          clients,
                          NULL};
    th_use_curve(server_pub, alice_pub, alice_sec); /* the harness's readiness ping */
    assert_int_equal(th_daemon_start_with(&worker, args, NULL), 0);
    wait_owned("w1");
}

static int setup(void **state)
{
    (void)state;
    if (th_tmpdir(dir, sizeof dir, "tally-natssec") != 0)
        return -1;
    snprintf(tls_dir, sizeof tls_dir, "%s/tls", dir);
    snprintf(ca, sizeof ca, "%s/ca.pem", tls_dir);
    if (th_sh("sh '%s/make-certs.sh' '%s' nats-1=localhost,127.0.0.1 "
              "nats-2=localhost,127.0.0.1 nats-3=localhost,127.0.0.1 client=producer-1",
              CONTRIB, tls_dir) != 0)
        return -1;
    tn_options_t o = {.write_conf = write_contrib_node,
                      .user = "operator",
                      .password = "change-me-operator",
                      .tls_ca = ca};
    if (tn_cluster_start(&cluster, NODES, &o, 60000) != 0 ||
        tn_connect(&cluster, &op_nc, &op_js) != 0)
        return -1;
    start_worker();
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    int rc = th_daemon_stop(&worker, SIGTERM, 30000);
    th_use_curve(NULL, NULL, NULL);
    jsCtx_Destroy(op_js);
    natsConnection_Destroy(op_nc);
    tn_cluster_stop(&cluster);
    th_rmrf(dir);
    return rc == 0 ? 0 : -1;
}

/* ---- 1. Replies only into the requester's inboxes ----------------------------------------- */

static void test_forged_reply_subjects(void **state)
{
    (void)state;
    peer_t p1, p2, ana;
    peer_open(&p1, "producer-1");
    peer_open(&p2, "producer-2");
    peer_open(&ana, "analyst");
    /* Who could see a reply that went astray. */
    natsSubscription *ana_inbox = NULL, *ana_watch = NULL, *p2_inbox = NULL;
    assert_int_equal(natsConnection_SubscribeSync(&ana_inbox, ana.nc, "_INBOX.analyst.>"), NATS_OK);
    assert_int_equal(natsConnection_SubscribeSync(&ana_watch, ana.nc, "tally.watch.>"), NATS_OK);
    assert_int_equal(natsConnection_SubscribeSync(&p2_inbox, p2.nc, "_INBOX.producer-2.>"),
                     NATS_OK);
    assert_int_equal(natsConnection_Flush(ana.nc), NATS_OK);
    assert_int_equal(natsConnection_Flush(p2.nc), NATS_OK);
    uint64_t dead = stream_msgs("TALLY_DEAD", NULL), part_rev = 0, lease_rev = 0;
    long long refused = th_metric(&worker, REFUSED_REPLY);
    char *parts = kv_get("TALLY_FLEET", "partitions", &part_rev);
    char *lease = kv_get("TALLY_LEASES", "p3", &lease_rev);
    assert_string_equal(parts, "8");
    assert_string_equal(lease, "w1");

    /* One ordinary hist each, its Tally-Reply naming a subject the producer may not use. */
    const char *targets[] = {"tally.watch.3",           "_INBOX.analyst.stolen",
                             "_INBOX.producer-2.x",     "tally.dead.3",
                             "$KV.TALLY_MEMBERS.ghost", "$KV.TALLY_LEASES.p3",
                             "$KV.TALLY_CKPT.p3",       "$KV.TALLY_FLEET.partitions"};
    const int n = (int)(sizeof targets / sizeof targets[0]);
    const char *stream = "forge/a";
    char subject[64], id[64];
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, partition_of(stream),
                        "producer-1");
    uint8_t buf[TALLY_REQ_HEADER_SIZE + 16], bytes[16] = {1, 2, 3};
    size_t len = frame(TALLY_OP_HIST, stream, bytes, sizeof bytes, buf);
    for (int i = 0; i < n; i++) {
        natsMsg *m = NULL;
        snprintf(id, sizeof id, "producer-1.forge.%d", i);
        assert_int_equal(natsMsg_Create(&m, subject, NULL, (const char *)buf, (int)len), NATS_OK);
        assert_int_equal(natsMsgHeader_Set(m, "Nats-Msg-Id", id), NATS_OK);
        assert_int_equal(natsMsgHeader_Set(m, "Tally-Reply", targets[i]), NATS_OK);
        jsErrCode jerr = 0;
        assert_int_equal(js_PublishMsg(NULL, p1.js, m, NULL, &jerr), NATS_OK);
        natsMsg_Destroy(m);
    }
    /* And an analyst's query and ping with reply subjects of the same kind. */
    uint8_t q[TALLY_REQ_HEADER_SIZE];
    frame(TALLY_OP_QUERY, stream, NULL, 0, q);
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_QUERY, partition_of(stream),
                        "analyst");
    assert_int_equal(natsConnection_PublishRequest(ana.nc, subject, "$KV.TALLY_FLEET.partitions", q,
                                                   (int)sizeof q),
                     NATS_OK);
    frame(TALLY_OP_PING, NULL, NULL, 0, q);
    assert_int_equal(natsConnection_PublishRequest(ana.nc, "tally.ctl.analyst", "tally.watch.1", q,
                                                   (int)sizeof q),
                     NATS_OK);

    /* Each message is a dead letter `not_permitted`, counted; the requests answered nowhere. */
    expect_dead_letters(dead + (uint64_t)n, n);
    wait_metric(REFUSED_REPLY, refused + n + 2);
    /* Nothing was written where the replies pointed. */
    uint64_t rev = 0;
    char *now = kv_get("TALLY_FLEET", "partitions", &rev);
    assert_string_equal(now, "8");
    assert_int_equal(rev, part_rev);
    free(now);
    now = kv_get("TALLY_LEASES", "p3", &rev);
    assert_string_equal(now, "w1");
    free(now);
    assert_null(kv_get("TALLY_MEMBERS", "ghost", NULL));
    now = kv_get("TALLY_CKPT", "p3", &rev);
    assert_non_null(now);
    assert_memory_equal(now, "TLYC", 4); /* still a checkpoint manifest */
    free(now);
    assert_int_equal(natsConnection_Flush(ana.nc), NATS_OK);
    assert_int_equal(natsConnection_Flush(p2.nc), NATS_OK);
    assert_int_equal(pending(ana_inbox), 0);
    assert_int_equal(pending(p2_inbox), 0);
    natsMsg *w = NULL; /* the worker's own publications only: each names its stream */
    while (natsSubscription_NextMsg(&w, ana_watch, 1) == NATS_OK) {
        const char *name = NULL;
        assert_int_equal(natsMsgHeader_Get(w, "Tally-Stream", &name), NATS_OK);
        natsMsg_Destroy(w);
    }
    /* Nothing was applied, and the fleet serves on. */
    assert_int_equal(values_of(stream), -1);
    tally_nats_t *p = client_as("producer-1");
    push(p, "forge/ok", 2, 100);
    tally_nats_destroy(&p);
    assert_int_equal(values_of("forge/ok"), 200);
    free(parts);
    free(lease);
    natsSubscription_Destroy(ana_inbox);
    natsSubscription_Destroy(ana_watch);
    natsSubscription_Destroy(p2_inbox);
    peer_close(&p1);
    peer_close(&p2);
    peer_close(&ana);
}

/* ---- 2. Every user reads only its own inboxes ---------------------------------------------- */

static void test_inboxes_private(void **state)
{
    (void)state;
    peer_t p2, ana;
    peer_open(&p2, "producer-2");
    peer_open(&ana, "analyst");
    const char *p2_wants[] = {"_INBOX.>",
                              "_INBOX.producer-1.>",
                              "_INBOX.analyst.>",
                              "_INBOX.worker.>",
                              ">",
                              "tally.>",
                              "$KV.>",
                              "$JS.>"};
    const char *ana_wants[] = {"_INBOX.>", "_INBOX.producer-1.>", "_INBOX.worker.>", "tally.in.>",
                               "$KV.>"};
    enum {
        P2 = sizeof p2_wants / sizeof p2_wants[0],
        ANA = sizeof ana_wants / sizeof ana_wants[0]
    };
    natsSubscription *subs[P2 + ANA];
    for (int i = 0; i < P2; i++)
        assert_int_equal(natsConnection_SubscribeSync(&subs[i], p2.nc, p2_wants[i]), NATS_OK);
    for (int i = 0; i < ANA; i++)
        assert_int_equal(natsConnection_SubscribeSync(&subs[P2 + i], ana.nc, ana_wants[i]),
                         NATS_OK);
    wait_denied(&p2, P2);
    wait_denied(&ana, ANA);
    /* Another producer's requests, PubAcks and replies; an analyst's query, `streams`, info. */
    tally_nats_t *p = client_as("producer-1"), *a = client_as("analyst");
    push(p, "private/a", 4, 64);
    tally_stream_info_t info;
    assert_int_equal(tally_nats_query(a, "private/a", &info), TALLY_OK);
    assert_int_equal(info.hist_total, 256);
    expect_streams(a);
    tally_nats_destroy(&p);
    tally_nats_destroy(&a);
    /* Whatever the server had for the attackers it has sent before it answers their flush. */
    assert_int_equal(natsConnection_Flush(p2.nc), NATS_OK);
    assert_int_equal(natsConnection_Flush(ana.nc), NATS_OK);
    for (int i = 0; i < P2 + ANA; i++) {
        if (pending(subs[i]) != 0)
            fail_msg("subscription %s read %d messages", i < P2 ? p2_wants[i] : ana_wants[i - P2],
                     pending(subs[i]));
        natsSubscription_Destroy(subs[i]);
    }
    peer_close(&p2);
    peer_close(&ana);
}

/* ---- 3. Nobody can make another producer's messages vanish -------------------------------- */

static void test_dedupe_ids(void **state)
{
    (void)state;
    const char *stream = "dedupe/b";
    uint32_t k = partition_of(stream);
    tally_nats_t *victim = client_as("producer-1");
    const char *pid = tally_nats_producer_id(victim);
    uint64_t dead = stream_msgs("TALLY_DEAD", NULL);
    long long refused = th_metric(&worker, REFUSED_ID);
    /* The attacker knows the victim's random id (a test can read it: no user can) and publishes
     * its next ten ids first, the first a reset of its stream, under its own subject (the only
     * one the server lets it use: the victim's is refused). */
    peer_t evil;
    peer_open(&evil, "producer-2");
    char subject[64], id[160];
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, k, "producer-1");
    assert_int_equal(natsConnection_PublishString(evil.nc, subject, "x"), NATS_OK);
    wait_denied(&evil, 1);
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, k, "producer-2");
    uint8_t buf[TALLY_REQ_HEADER_SIZE + 16], bytes[16] = {0};
    for (int n = 1; n <= 10; n++) {
        size_t len = frame(n == 1 ? TALLY_OP_RESET : TALLY_OP_HIST, stream, bytes,
                           n == 1 ? 0 : sizeof bytes, buf);
        snprintf(id, sizeof id, "producer-1.%s.%d", pid, n);
        natsMsg *m = NULL;
        assert_int_equal(natsMsg_Create(&m, subject, NULL, (const char *)buf, (int)len), NATS_OK);
        assert_int_equal(natsMsgHeader_Set(m, "Nats-Msg-Id", id), NATS_OK);
        jsPubAck *pa = NULL;
        jsErrCode jerr = 0;
        assert_int_equal(js_PublishMsg(&pa, evil.js, m, NULL, &jerr), NATS_OK);
        assert_false(pa->Duplicate); /* stored: the ids were free */
        jsPubAck_Destroy(pa);
        natsMsg_Destroy(m);
    }
    /* The victim's ten hists, each with a reply. */
    push(victim, stream, 10, 1000);
    tally_nats_stats_t st;
    tally_nats_stats(victim, &st);
    assert_int_equal(st.collisions, 10); /* each renamed and published again */
    assert_int_equal(st.failed, 0);
    tally_nats_destroy(&victim);
    /* Nothing of the victim's dropped, nothing of the attacker's applied. */
    assert_int_equal(values_of(stream), 10 * 1000);
    expect_dead_letters(dead + 10, 10);
    wait_metric(REFUSED_ID, refused + 10);
    peer_close(&evil);
}

/* ---- 4. Analysts make no consumers --------------------------------------------------------- */

static void test_analyst_no_consumers(void **state)
{
    (void)state;
    peer_t ana;
    peer_open(&ana, "analyst");
    const char *into = "tally.in.0.producer-1"; /* a partition, in a producer's name */
    char body[512];
    struct {
        const char *subject;
        const char *fmt;
    } tries[] = {
        {"$JS.API.CONSUMER.CREATE.KV_TALLY_MEMBERS",
         "{\"stream_name\":\"KV_TALLY_MEMBERS\",\"config\":{\"deliver_subject\":\"%s\","
         "\"ack_policy\":\"none\"}}"},
        {"$JS.API.CONSUMER.DURABLE.CREATE.KV_TALLY_MEMBERS.evil",
         "{\"stream_name\":\"KV_TALLY_MEMBERS\",\"config\":{\"durable_name\":\"evil\","
         "\"deliver_subject\":\"%s\",\"ack_policy\":\"none\"}}"},
        {"$JS.API.CONSUMER.CREATE.TALLY_P0",
         "{\"stream_name\":\"TALLY_P0\",\"config\":{\"ack_policy\":\"explicit\"}}%.0s"},
        {"$JS.API.CONSUMER.CREATE.TALLY_DEAD",
         "{\"stream_name\":\"TALLY_DEAD\",\"config\":{\"deliver_subject\":\"%s\"}}"},
        {"$JS.API.STREAM.INFO.KV_TALLY_MEMBERS", "%.0s"},
    };
    const int n = (int)(sizeof tries / sizeof tries[0]);
    for (int i = 0; i < n; i++) {
        snprintf(body, sizeof body, tries[i].fmt, into);
        assert_int_equal(natsConnection_PublishRequest(ana.nc, tries[i].subject,
                                                       "_INBOX.analyst.api", body,
                                                       (int)strlen(body)),
                         NATS_OK);
    }
    wait_denied(&ana, n);
    /* No consumer but the worker's anywhere: its pull consumers of TALLY_P0, the key listings it
     * makes now and then on the members bucket (delivering to its own inbox), none else. */
    const char *streams[] = {"KV_TALLY_MEMBERS", "TALLY_P0", "TALLY_DEAD"};
    for (int s = 0; s < 3; s++) {
        jsConsumerNamesList *names = NULL;
        jsErrCode jerr = 0;
        natsStatus st = js_ConsumerNames(&names, op_js, streams[s], NULL, &jerr);
        assert_true(st == NATS_OK || st == NATS_NOT_FOUND);
        for (int i = 0; names && i < names->Count; i++) {
            jsConsumerInfo *ci = NULL;
            if (js_GetConsumerInfo(&ci, op_js, streams[s], names->List[i], NULL, &jerr) != NATS_OK)
                continue; /* a listing the worker has deleted meanwhile */
            const char *to = ci->Config->DeliverSubject;
            bool workers = s == 1 ? strncmp(names->List[i], "tally-p0-", 9) == 0 && !to
                                  : s == 0 && to && strncmp(to, "_INBOX.worker.", 14) == 0;
            if (!workers)
                fail_msg("%s has a consumer %s delivering to %s", streams[s], names->List[i],
                         to ? to : "(pull)");
            jsConsumerInfo_Destroy(ci);
        }
        jsConsumerNamesList_Destroy(names);
    }
    /* `streams` needs none: the answers say how many members there are. */
    tally_nats_t *a = client_as("analyst");
    expect_streams(a);
    tally_nats_destroy(&a);
    peer_close(&ana);
}

/* ---- 5. Only the cluster's own servers and authenticated clients get in ------------------ */

/* The rogue: its own CA's certificate, the route password, routes to the three nodes, no
 * JetStream, clients without authentication. */
static int write_rogue(const tn_cluster_t *c, int i, FILE *f, void *ctx)
{
    (void)i;
    const char *rogue_tls = ctx;
    fprintf(f,
            "server_name: rogue\nlisten: 127.0.0.1:%d\n"
            "cluster {\n  name: tally\n  listen: 127.0.0.1:%d\n"
            "  authorization { user: route, password: \"change-me-route\" }\n"
            "  tls { cert_file: \"%s/rogue.pem\", key_file: \"%s/rogue-key.pem\",\n"
            "        ca_file: \"%s/ca.pem\", timeout: 2 }\n  routes: [",
            c->node[0].client_port, c->node[0].cluster_port, rogue_tls, rogue_tls, rogue_tls);
    for (int j = 0; j < NODES; j++)
        fprintf(f, "%s \"nats-route://route:change-me-route@127.0.0.1:%d\"", j ? "," : "",
                cluster.node[j].cluster_port);
    fprintf(f, " ]\n}\n");
    return 0;
}

static void test_rogue_server_and_clients(void **state)
{
    (void)state;
    /* A plaintext client, and a TLS client without a user: refused. */
    natsConnection *nc = NULL;
    assert_int_not_equal(natsConnection_ConnectTo(&nc, cluster.node[0].url), NATS_OK);
    natsOptions *o = NULL;
    assert_int_equal(natsOptions_Create(&o), NATS_OK);
    assert_int_equal(natsOptions_SetURL(o, cluster.node[0].url), NATS_OK);
    assert_int_equal(natsOptions_SetSecure(o, true), NATS_OK);
    assert_int_equal(natsOptions_LoadCATrustedCertificates(o, ca), NATS_OK);
    assert_int_equal(natsOptions_SetAllowReconnect(o, false), NATS_OK);
    assert_int_not_equal(natsConnection_Connect(&nc, o), NATS_OK);
    natsOptions_Destroy(o);
    /* The rogue server. */
    char rogue_tls[320];
    snprintf(rogue_tls, sizeof rogue_tls, "%s/rogue-tls", dir);
    assert_int_equal(
        th_sh("sh '%s/make-certs.sh' '%s' rogue=localhost,127.0.0.1", CONTRIB, rogue_tls), 0);
    tn_cluster_t rogue;
    tn_options_t ro = {.write_conf = write_rogue, .ctx = rogue_tls, .ready_on_connect = true};
    assert_int_equal(tn_cluster_start(&rogue, 1, &ro, 20000), 0);
    /* Its routes are refused: it says so in its log (the nodes' certificate fails its check of
     * theirs, or theirs of its own). */
    int64_t t0 = th_now_ms();
    while (!tn_node_log_contains(&rogue, 0, "TLS route handshake error") &&
           th_now_ms() - t0 < 20000)
        th_sleep_ms(100);
    assert_true(tn_node_log_contains(&rogue, 0, "TLS route handshake error"));
    /* Its clients: one listens to everything, one injects a request and asks for JetStream. */
    natsConnection *spy = NULL, *inject = NULL;
    natsSubscription *all = NULL;
    assert_int_equal(natsConnection_ConnectTo(&spy, rogue.node[0].url), NATS_OK);
    assert_int_equal(natsConnection_ConnectTo(&inject, rogue.node[0].url), NATS_OK);
    assert_int_equal(natsConnection_SubscribeSync(&all, spy, ">"), NATS_OK);
    assert_int_equal(natsConnection_Flush(spy), NATS_OK);
    const char *stream = "rogue/x";
    char subject[64];
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, partition_of(stream),
                        "producer-1");
    uint8_t buf[TALLY_REQ_HEADER_SIZE + 4], bytes[4] = {1};
    size_t len = frame(TALLY_OP_HIST, stream, bytes, sizeof bytes, buf);
    assert_int_equal(natsConnection_Publish(inject, subject, buf, (int)len), NATS_OK);
    natsMsg *r = NULL;
    assert_int_not_equal(natsConnection_RequestString(&r, inject, "$JS.API.INFO", "", 1000),
                         NATS_OK);
    assert_int_equal(natsConnection_Flush(inject), NATS_OK);
    /* The fleet works meanwhile; none of it reaches the rogue's clients, the injection nothing. */
    tally_nats_t *p = client_as("producer-1");
    push(p, "rogue/ok", 2, 10);
    tally_nats_destroy(&p);
    assert_int_equal(natsConnection_Flush(spy), NATS_OK);
    int seen = 0;
    natsMsg *m = NULL;
    while (natsSubscription_NextMsg(&m, all, 1) == NATS_OK) {
        if (strcmp(natsMsg_GetSubject(m), subject) != 0 && /* the rogue's own two */
            strcmp(natsMsg_GetSubject(m), "$JS.API.INFO") != 0)
            fail_msg("the rogue's client saw %s", natsMsg_GetSubject(m));
        seen++;
        natsMsg_Destroy(m);
    }
    assert_int_equal(seen, 2);
    assert_int_equal(values_of(stream), -1);
    assert_int_equal(values_of("rogue/ok"), 20);
    natsSubscription_Destroy(all);
    natsConnection_Destroy(spy);
    natsConnection_Destroy(inject);
    tn_cluster_stop(&rogue);
}

/* ---- 6. No password or token in any message ------------------------------------------------ */

static void expect_masked(const th_cli_t *r, const char *secret, const char *masked)
{
    if (strstr(r->out, secret) || strstr(r->err, secret))
        fail_msg("'%s' shown: out '%s', err '%s'", secret, r->out, r->err);
    if (masked && !strstr(r->out, masked) && !strstr(r->err, masked))
        fail_msg("'%s' not shown: out '%s', err '%s'", masked, r->out, r->err);
}

static void test_secrets_redacted(void **state)
{
    (void)state;
    /* The worker's log: where it joined, without its password. */
    assert_true(th_daemon_log_contains(&worker, "joins on tls://worker:***@127.0.0.1:"));
    assert_false(th_daemon_log_contains(&worker, "change-me-worker"));
    /* A worker that cannot reach its servers says which, without the password. Its request
     * endpoint is an ipc:// path in the test's directory: a TCP port picked before could be
     * another process's by the time it binds. */
    char cmd[1024], out[4096];
    snprintf(cmd, sizeof cmd,
             "%s --bind ipc://%s/unreachable.sock --shm off --nats-servers "
             "tls://worker:change-me-worker@127.0.0.1:1 --nats-tls-ca %s 2>&1",
             th_tallyd_bin(), dir, ca);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = 0;
    assert_int_not_equal(pclose(f), 0);
    if (!strstr(out, "tls://worker:***@127.0.0.1:1") || strstr(out, "change-me-worker"))
        fail_msg("tallyd said: %s", out);
    /* The CLI: nothing listening, a wrong password, a token, and watch's header line. */
    th_cli_t r = th_cli(dir, "tcp://127.0.0.1:1",
                        "--nats tls://producer-1:change-me-producer-1@127.0.0.1:1 "
                        "--nats-tls-ca %s ping",
                        ca);
    assert_int_equal(r.status, 3);
    expect_masked(&r, "change-me-producer-1", "tls://producer-1:***@127.0.0.1:1");
    th_cli_free(&r);
    r = th_cli(dir, "tcp://127.0.0.1:1",
               "--nats tls://producer-1:wr0ng-s3cret@127.0.0.1:%d --nats-tls-ca %s streams",
               cluster.node[0].client_port, ca);
    assert_int_not_equal(r.status, 0);
    expect_masked(&r, "wr0ng-s3cret", "producer-1:***@");
    th_cli_free(&r);
    r = th_cli(dir, "tcp://127.0.0.1:1", "--nats nats://t0ken-s3cret@127.0.0.1:1 ping");
    assert_int_equal(r.status, 3);
    expect_masked(&r, "t0ken-s3cret", "nats://***@127.0.0.1:1");
    th_cli_free(&r);
    char urls[512];
    urls_for("analyst", urls, sizeof urls);
    r = th_cli(dir, "tcp://127.0.0.1:1", "--nats %s --nats-tls-ca %s watch --once forge/ok", urls,
               ca);
    assert_int_equal(r.status, 0);
    expect_masked(&r, "change-me-analyst", "tls://analyst:***@127.0.0.1:");
    th_cli_free(&r);
}

/* ---- 7. The documented producer; client certificates; the worker's narrow rights --------- */

/* A JetStream server that asks every client for a certificate of the fleet's CA. */
static int write_verifying(const tn_cluster_t *c, int i, FILE *f, void *ctx)
{
    (void)i, (void)ctx;
    fprintf(f,
            "listen: 127.0.0.1:%d\njetstream { store_dir: \"%s/store0\" }\n"
            "tls { cert_file: \"%s/nats-1.pem\", key_file: \"%s/nats-1-key.pem\",\n"
            "      ca_file: \"%s\", verify: true }\n",
            c->node[0].client_port, c->dir, tls_dir, tls_dir, ca);
    return 0;
}

static void test_producer_cli_and_worker_rights(void **state)
{
    (void)state;
    uint8_t data[3000];
    memset(data, 5, sizeof data);
    assert_int_equal(th_write_file(dir, "in.bin", data, sizeof data), 0);
    char urls[512];
    urls_for("producer-1", urls, sizeof urls);
    /* A numbered push as producer-1 (its seq base from tally.seq), twice: options, then the
     * environment. */
    th_cli_t r = th_cli(dir, "tcp://127.0.0.1:1",
                        "--nats %s --nats-tls-ca %s hist --stream seq/cam0 --chunk 1000 "
                        "--in in.bin",
                        urls, ca);
    if (r.status != 0)
        fail_msg("tally hist: %d %s", r.status, r.err);
    th_cli_free(&r);
    setenv("TALLY_NATS", urls, 1);
    setenv("TALLY_NATS_TLS_CA", ca, 1);
    r = th_cli(dir, "tcp://127.0.0.1:1", "hist --stream seq/cam0 --chunk 1000 --in in.bin");
    unsetenv("TALLY_NATS");
    unsetenv("TALLY_NATS_TLS_CA");
    if (r.status != 0)
        fail_msg("tally hist (environment): %d %s", r.status, r.err);
    th_cli_free(&r);
    tally_nats_t *a = client_as("analyst");
    tally_stream_info_t info;
    assert_int_equal(tally_nats_query(a, "seq/cam0", &info), TALLY_OK);
    assert_int_equal(info.hist_total, 6000);
    assert_int_equal(info.last_seq, 6); /* the second push went on from the first's 3 */
    tally_nats_destroy(&a);

    /* A client certificate where the server asks for one. */
    tn_cluster_t v;
    char client_cert[340], client_key[340];
    snprintf(client_cert, sizeof client_cert, "%s/client.pem", tls_dir);
    snprintf(client_key, sizeof client_key, "%s/client-key.pem", tls_dir);
    tn_options_t vo = {.write_conf = write_verifying,
                       .tls_ca = ca,
                       .tls_cert = client_cert,
                       .tls_key = client_key};
    assert_int_equal(tn_cluster_start(&v, 1, &vo, 20000), 0);
    r = th_cli(dir, "tcp://127.0.0.1:1",
               "--nats tls://127.0.0.1:%d --nats-tls-ca %s --nats-tls-cert %s --nats-tls-key %s "
               "ping",
               v.node[0].client_port, ca, client_cert, client_key);
    if (!strstr(r.err, "no tallyd fleet on this NATS")) /* connected: no worker there */
        fail_msg("with a certificate: %d %s", r.status, r.err);
    th_cli_free(&r);
    r = th_cli(dir, "tcp://127.0.0.1:1", "--nats tls://127.0.0.1:%d --nats-tls-ca %s ping",
               v.node[0].client_port, ca);
    assert_int_equal(r.status, 3);
    assert_non_null(strstr(r.err, "cannot connect"));
    th_cli_free(&r);
    tn_cluster_stop(&v);

    /* The worker's rights: no stream changed, deleted or purged, no consumer elsewhere. */
    uint64_t msgs1 = stream_msgs("TALLY_P1", NULL);
    peer_t wk;
    peer_open(&wk, "worker");
    const char *tries[][2] = {
        {"$JS.API.STREAM.UPDATE.TALLY_P0",
         "{\"name\":\"TALLY_P0\",\"subjects\":[\"tally.in.0.*\",\"tally.evil\"]}"},
        {"$JS.API.STREAM.DELETE.TALLY_P1", ""},
        {"$JS.API.STREAM.PURGE.TALLY_P1", ""},
        {"$JS.API.STREAM.MSG.DELETE.TALLY_P1", "{\"seq\":1}"},
        {"$JS.API.CONSUMER.CREATE.TALLY_DEAD",
         "{\"stream_name\":\"TALLY_DEAD\",\"config\":{\"deliver_subject\":\"tally.in.0.x\"}}"},
        {"$JS.API.CONSUMER.DURABLE.CREATE.KV_TALLY_LEASES.evil",
         "{\"stream_name\":\"KV_TALLY_LEASES\",\"config\":{\"durable_name\":\"evil\"}}"},
        {"$JS.API.STREAM.CREATE.EVIL", "{\"name\":\"EVIL\",\"subjects\":[\"_INBOX.>\"]}"},
    };
    const int n = (int)(sizeof tries / sizeof tries[0]);
    for (int i = 0; i < n; i++)
        assert_int_equal(natsConnection_PublishRequest(wk.nc, tries[i][0], "_INBOX.worker.api",
                                                       tries[i][1], (int)strlen(tries[i][1])),
                         NATS_OK);
    wait_denied(&wk, n);
    peer_close(&wk);
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    assert_int_equal(js_GetStreamInfo(&si, op_js, "TALLY_P0", NULL, &jerr), NATS_OK);
    assert_int_equal(si->Config->SubjectsLen, 1);
    assert_string_equal(si->Config->Subjects[0], "tally.in.0.*");
    jsStreamInfo_Destroy(si);
    assert_int_equal(stream_msgs("TALLY_P1", NULL), msgs1);
    assert_int_equal(js_GetStreamInfo(&si, op_js, "EVIL", NULL, &jerr), NATS_NOT_FOUND);
}

/* ---- 8. Over ZeroMQ a fleet's stream is read-only ----------------------------------------- */

static void test_zmq_mutation_refused(void **state)
{
    (void)state;
    const char *stream = "zmq/a";
    tally_nats_t *p = client_as("producer-1");
    push(p, stream, 1, 100);
    tally_nats_destroy(&p);
    void *z = th_connect(worker.endpoint, 10000); /* a CURVE client the worker allows */
    uint8_t bytes[10] = {0};
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 1);
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    assert_int_equal(th_call_status(z, &req, bytes, sizeof bytes), TALLY_E_NOT_PERMITTED);
    req = th_req(TALLY_OP_RESET, TALLY_DTYPE_NONE, 2);
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    assert_int_equal(th_call_status(z, &req, NULL, 0), TALLY_E_NOT_PERMITTED);
    req = th_req(TALLY_OP_DELETE, TALLY_DTYPE_NONE, 3);
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    assert_int_equal(th_call_status(z, &req, NULL, 0), TALLY_E_NOT_PERMITTED);
    req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, 4);
    assert_int_equal(tally_req_set_stream(&req, "zmq/s"), TALLY_OK);
    assert_int_equal(th_call_status(z, &req, bytes, 8), TALLY_E_NOT_PERMITTED);
    /* Reads and stream-less batches are served. */
    req = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, 5);
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    assert_int_equal(th_call_status(z, &req, NULL, 0), TALLY_OK);
    req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 6);
    assert_int_equal(th_call_status(z, &req, bytes, sizeof bytes), TALLY_OK);
    th_close(z);
    assert_int_equal(values_of(stream), 100);
    assert_int_equal(values_of("zmq/s"), -1);
}

/* ---- 9. Direct mode's buckets ----------------------------------------------------------- */

/* A key just put, read: a read may be served by a replica that has not applied the put yet
 * (the bucket's direct gets), so NATS_NOT_FOUND is read again, for up to 5 s; a right refused
 * is NATS_NOT_PERMITTED at once. */
static natsStatus get_put_key(kvStore *kv, const char *key, kvEntry **e)
{
    natsStatus got = NATS_NOT_FOUND;
    for (int i = 0; i < 100 && got == NATS_NOT_FOUND; i++) {
        got = kvStore_Get(e, kv, key);
        if (got == NATS_NOT_FOUND)
            th_sleep_ms(50);
    }
    return got;
}

static void test_direct_rights(void **state)
{
    (void)state;
    /* The worker user, as a member in direct mode: the bucket made (or found) with the lease
     * TTL and the fleet's replicas, its key written, read back and deleted. */
    peer_t wk, pd;
    peer_open(&wk, "worker");
    kvStore *eps = NULL;
    assert_int_equal(
        td_nats_kv_open(wk.js, TALLY_NATS_BUCKET_ENDPOINTS, 10000, 3, &eps, msg, sizeof msg),
        TD_OK);
    uint64_t rev = 0;
    kvEntry *e = NULL;
    assert_int_equal(kvStore_PutString(&rev, eps, "w9", "zmq=tcp://127.0.0.1:1\n"), NATS_OK);
    assert_int_equal(get_put_key(eps, "w9", &e), NATS_OK);
    kvEntry_Destroy(e);
    assert_int_equal(kvStore_Delete(eps, "w9"), NATS_OK);
    assert_int_equal(kvStore_PutString(&rev, eps, "w9", "zmq=tcp://127.0.0.1:1\n"), NATS_OK);
    kvStore_Destroy(eps);
    /* A direct producer: the three buckets read, nothing published to a partition. */
    peer_open(&pd, "producer-direct");
    kvStore *ls = NULL;
    assert_int_equal(js_KeyValue(&eps, pd.js, TALLY_NATS_BUCKET_ENDPOINTS), NATS_OK);
    assert_int_equal(get_put_key(eps, "w9", &e), NATS_OK);
    kvEntry_Destroy(e);
    assert_int_equal(js_KeyValue(&ls, pd.js, TALLY_NATS_BUCKET_LEASES), NATS_OK);
    assert_int_equal(kvStore_Get(&e, ls, "p0"), NATS_OK); /* w1 holds every partition */
    assert_int_equal(kvEntry_ValueLen(e), 2);
    kvEntry_Destroy(e);
    kvStore_Destroy(ls);
    kvStore_Destroy(eps);
    assert_int_equal(natsConnection_PublishString(pd.nc, "tally.in.0.producer-direct", "x"),
                     NATS_OK);
    natsConnection_Flush(pd.nc);
    wait_denied(&pd, 1);
    assert_int_equal(atomic_load(&wk.denied), 0);
    peer_close(&pd);
    peer_close(&wk);
    char urls[512];
    urls_for("producer-direct", urls, sizeof urls);
    tally_nats_opts_t o = {.servers = urls, .tls_ca = ca, .timeout_ms = 15000};
    tally_client_t *c = NULL;
    if (tally_client_new_fleet(&o, &c, msg, sizeof msg) != TALLY_OK)
        fail_msg("tally_client_new_fleet as producer-direct: %s", msg);
    tally_client_destroy(&c);
    /* A producer that may read the partition count but not the leases: the buckets are there,
     * so not "no fleet in direct mode", but what failed, and the server's refusal. */
    urls_for("producer-1", urls, sizeof urls);
    o.timeout_ms = 2000;
    tally_status_t st = tally_client_new_fleet(&o, &c, msg, sizeof msg);
    if (st != TALLY_E_TRANSPORT || !strstr(msg, "looking up TALLY_LEASES and TALLY_ENDPOINTS: ") ||
        !strstr(msg, "the NATS server refused it: ") || strstr(msg, "no tallyd fleet"))
        fail_msg("tally_client_new_fleet as producer-1: %s: %s", tally_status_name(st), msg);
    assert_null(c);
}

int main(void)
{
    if (tn_skip())
        return 77;
    if (system("command -v openssl >/dev/null 2>&1") != 0) {
        fprintf(stderr, "openssl not found: skipped\n");
        return 77;
    }
    th_seed();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forged_reply_subjects),
        cmocka_unit_test(test_inboxes_private),
        cmocka_unit_test(test_dedupe_ids),
        cmocka_unit_test(test_analyst_no_consumers),
        cmocka_unit_test(test_rogue_server_and_clients),
        cmocka_unit_test(test_secrets_redacted),
        cmocka_unit_test(test_producer_cli_and_worker_rights),
        cmocka_unit_test(test_zmq_mutation_refused),
        cmocka_unit_test(test_direct_rights),
    };
    int failed = cmocka_run_group_tests(tests, setup, teardown);
    nats_Close(); /* libnats' threads and globals: gone before the leak check */
    return failed;
}
