/* SPDX-License-Identifier: Apache-2.0 */
/*
 * nats_cluster.c — see nats_cluster.h.
 *
 * Ports: each node's client and cluster ports are taken from th_free_port (free a moment ago).
 * Another process may grab one before nats-server binds it; a node that exits at start is seen
 * by the readiness wait, and the whole start is retried on fresh ports.
 *
 * Light on a 2-core CI box: the servers run with GOMAXPROCS=1 and small store limits; nats-server
 * 2.9 has no `sync_interval` setting (added in 2.10) and does not fsync each message anyway (its
 * file store syncs on a timer), so there is no fsync storm to turn off.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <nats/nats.h>

#include "harness.h"
#include "nats_cluster.h"
#include "tally_fleet.h"

const char *tn_server_bin(void)
{
    static char found[512];
    const char *env = getenv("TALLY_NATS_SERVER");
    if (env && *env)
        return access(env, X_OK) == 0 ? env : NULL;
    const char *path = getenv("PATH");
    if (!path)
        path = "/usr/bin:/bin";
    for (const char *p = path; *p;) {
        const char *end = strchr(p, ':');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        snprintf(found, sizeof found, "%.*s/nats-server", (int)len, p);
        if (len && access(found, X_OK) == 0)
            return found;
        p += len + (end ? 1 : 0);
    }
    return NULL;
}

bool tn_skip(void)
{
    if (tn_server_bin())
        return false;
    fprintf(stderr, "nats-server not found: skipped\n");
    return true;
}

static int write_conf(const tn_cluster_t *c, int i, const tn_options_t *opts)
{
    const tn_node_t *n = &c->node[i];
    FILE *f = fopen(n->conf_path, "w");
    if (!f)
        return -1;
    fprintf(f,
            "server_name: n%d\n"
            "listen: 127.0.0.1:%d\n"
            "max_payload: 8MB\n"
            "jetstream {\n  store_dir: \"%s/store%d\"\n  max_memory_store: 256MB\n"
            "  max_file_store: 16GB\n}\n",
            i, n->client_port, c->dir, i);
    if (c->nodes > 1) {
        /* Named after its own folder: two tests' clusters run at once (ctest -j), and a route
         * to a port the other one took meanwhile must be refused (a cluster name that is not
         * its own), not join the two clusters into one. */
        const char *name = strrchr(c->dir, '/');
        fprintf(f, "cluster {\n  name: %s\n  listen: 127.0.0.1:%d\n  routes: [",
                name ? name + 1 : c->dir, n->cluster_port);
        const char *sep = "";
        for (int j = 0; j < c->nodes; j++)
            if (j != i) {
                fprintf(f, "%s \"nats-route://127.0.0.1:%d\"", sep, c->node[j].cluster_port);
                sep = ",";
            }
        fprintf(f, " ]\n}\n");
    }
    if (opts && opts->extra_conf)
        fprintf(f, "%s\n", opts->extra_conf);
    return fclose(f) == 0 ? 0 : -1;
}

/* Node i's configuration: the caller's (tn_options_t.write_conf), or generated. */
static int node_conf(const tn_cluster_t *c, int i, const tn_options_t *opts)
{
    if (!opts || !opts->write_conf)
        return write_conf(c, i, opts);
    FILE *f = fopen(c->node[i].conf_path, "w");
    if (!f)
        return -1;
    int rc = opts->write_conf(c, i, f, opts->ctx);
    return fclose(f) == 0 ? rc : -1;
}

static int spawn(tn_node_t *n)
{
    const char *bin = tn_server_bin();
    if (!bin)
        return -1;
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        /* The server dies with the test: an orphan would hold ports and the test's pipes. The
         * check after prctl closes the race with a parent that died before it. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(1);
        setenv("GOMAXPROCS", "1", 1);
        /* Nothing of the server writes to the test's pipes: the log goes to -l, a Go panic to
         * nN.log.stderr beside it. */
        char err_path[sizeof n->log_path + 8];
        snprintf(err_path, sizeof err_path, "%s.stderr", n->log_path);
        FILE *out = freopen("/dev/null", "w", stdout);
        FILE *err = freopen(err_path, "w", stderr);
        (void)out;
        (void)err;
        execl(bin, bin, "-c", n->conf_path, "-l", n->log_path, (char *)NULL);
        fprintf(stderr, "exec %s: %s\n", bin, strerror(errno));
        _exit(127);
    }
    n->pid = pid;
    return 0;
}

/* The harness's credentials and TLS (tn_options_t) on o. */
static natsStatus harness_auth(natsOptions *o, const tn_options_t *opts)
{
    natsStatus s = NATS_OK;
    char prefix[96];
    snprintf(prefix, sizeof prefix, "_INBOX.%s", opts->user ? opts->user : "");
    if (opts->user)
        s = natsOptions_SetUserInfo(o, opts->user, opts->password);
    if (s == NATS_OK && opts->user) /* its inboxes where its permissions let it read */
        s = natsOptions_SetCustomInboxPrefix(o, prefix);
    if (s == NATS_OK && opts->tls_ca)
        s = natsOptions_SetSecure(o, true);
    if (s == NATS_OK && opts->tls_ca)
        s = natsOptions_LoadCATrustedCertificates(o, opts->tls_ca);
    if (s == NATS_OK && opts->tls_cert)
        s = natsOptions_LoadCertificatesChain(o, opts->tls_cert, opts->tls_key);
    return s;
}

/* True when node n answers a JetStream account-info request (so a meta leader exists), or with
 * ready_on_connect, when a client connects. */
static bool node_ready(const tn_node_t *n, const tn_options_t *opts)
{
    natsOptions *o = NULL;
    natsConnection *nc = NULL;
    jsCtx *js = NULL;
    jsAccountInfo *ai = NULL;
    bool ready = false;
    if (natsOptions_Create(&o) != NATS_OK || natsOptions_SetURL(o, n->url) != NATS_OK ||
        natsOptions_SetAllowReconnect(o, false) != NATS_OK ||
        natsOptions_SetTimeout(o, 500) != NATS_OK || harness_auth(o, opts) != NATS_OK)
        goto out;
    if (natsConnection_Connect(&nc, o) != NATS_OK)
        goto out;
    if (opts->ready_on_connect) {
        ready = true;
        goto out;
    }
    jsOptions jo;
    jsOptions_Init(&jo);
    jo.Wait = 1000;
    jsErrCode jerr = 0;
    if (natsConnection_JetStream(&js, nc, &jo) != NATS_OK)
        goto out;
    ready = js_GetAccountInfo(&ai, js, &jo, &jerr) == NATS_OK;
out:
    jsAccountInfo_Destroy(ai);
    jsCtx_Destroy(js);
    natsConnection_Destroy(nc);
    natsOptions_Destroy(o);
    return ready;
}

/* 1 when the node is running, 0 when it has exited (reaped). */
static int node_alive(tn_node_t *n)
{
    if (n->pid <= 0)
        return 0;
    int status;
    if (waitpid(n->pid, &status, WNOHANG) == n->pid) {
        n->pid = 0;
        return 0;
    }
    return 1;
}

int tn_cluster_wait_ready(tn_cluster_t *c, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    for (;;) {
        int ready = 0, running = 0;
        for (int i = 0; i < c->nodes; i++) {
            if (c->node[i].pid <= 0)
                continue;
            if (!node_alive(&c->node[i])) {
                fprintf(stderr, "nats node %d exited (log %s)\n", i, c->node[i].log_path);
                return -1;
            }
            running++;
            ready += node_ready(&c->node[i], &c->opts);
        }
        if (running > 0 && ready == running)
            return 0;
        if (th_now_ms() > deadline) {
            fprintf(stderr, "nats cluster not ready after %d ms (%d of %d nodes; logs in %s)\n",
                    timeout_ms, ready, running, c->dir);
            return -1;
        }
        th_sleep_ms(50);
    }
}

static int start_once(tn_cluster_t *c, const tn_options_t *opts, int timeout_ms)
{
    size_t used = 0;
    c->urls[0] = 0;
    for (int i = 0; i < c->nodes; i++) {
        tn_node_t *n = &c->node[i];
        memset(n, 0, sizeof *n);
        n->client_port = th_free_port();
        n->cluster_port = th_free_port();
        if (n->client_port <= 0 || n->cluster_port <= 0)
            return -1;
        snprintf(n->url, sizeof n->url, "nats://127.0.0.1:%d", n->client_port);
        snprintf(n->conf_path, sizeof n->conf_path, "%s/n%d.conf", c->dir, i);
        snprintf(n->log_path, sizeof n->log_path, "%s/n%d.log", c->dir, i);
        used +=
            (size_t)snprintf(c->urls + used, sizeof c->urls - used, "%s%s", i ? "," : "", n->url);
    }
    for (int i = 0; i < c->nodes; i++)
        if (node_conf(c, i, opts) != 0)
            return -1;
    for (int i = 0; i < c->nodes; i++)
        if (spawn(&c->node[i]) != 0)
            return -1;
    return tn_cluster_wait_ready(c, timeout_ms);
}

static void kill_all(tn_cluster_t *c)
{
    for (int i = 0; i < c->nodes; i++)
        tn_node_kill(c, i, SIGKILL);
}

int tn_cluster_start(tn_cluster_t *c, int nodes, const tn_options_t *opts, int timeout_ms)
{
    memset(c, 0, sizeof *c);
    if (nodes < 1 || nodes > TN_MAX_NODES || !tn_server_bin())
        return -1;
    if (th_tmpdir(c->dir, sizeof c->dir, "tally-nats") != 0)
        return -1;
    c->nodes = nodes;
    if (opts)
        c->opts = *opts;
    for (int attempt = 0; attempt < 3; attempt++) {
        if (start_once(c, opts, timeout_ms) == 0)
            return 0;
        kill_all(c); /* a port taken meanwhile, most likely: fresh ports, fresh stores */
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'/store*", c->dir);
        if (system(cmd) != 0)
            break;
    }
    tn_cluster_stop(c);
    return -1;
}

int tn_node_kill(tn_cluster_t *c, int i, int sig)
{
    if (i < 0 || i >= c->nodes || c->node[i].pid <= 0)
        return -1;
    if (kill(c->node[i].pid, sig) != 0)
        return -1;
    if (sig != SIGKILL && sig != SIGTERM && sig != SIGINT)
        return 0;
    /* SIGTERM: nats-server shuts down cleanly; give it 5 s, then SIGKILL. */
    for (int waited = 0; waited < 5000; waited += 10) {
        if (!node_alive(&c->node[i]))
            return 0;
        th_sleep_ms(10);
    }
    kill(c->node[i].pid, SIGKILL);
    waitpid(c->node[i].pid, NULL, 0);
    c->node[i].pid = 0;
    return 0;
}

int tn_node_restart(tn_cluster_t *c, int i, int timeout_ms)
{
    if (i < 0 || i >= c->nodes || c->node[i].pid > 0)
        return -1;
    if (spawn(&c->node[i]) != 0)
        return -1;
    return tn_cluster_wait_ready(c, timeout_ms);
}

bool tn_node_log_contains(const tn_cluster_t *c, int i, const char *text)
{
    char *log = th_slurp(c->node[i].log_path);
    bool found = log && strstr(log, text);
    free(log);
    return found;
}

/* natsOptions_SetServers, not a comma-separated natsOptions_SetURL: libnats 3.4.1 accepts such
 * a list and then connects to none of it. */
int tn_connect(const tn_cluster_t *c, natsConnection **nc, jsCtx **js)
{
    natsOptions *o = NULL;
    const char *urls[TN_MAX_NODES];
    for (int i = 0; i < c->nodes; i++)
        urls[i] = c->node[i].url;
    *nc = NULL;
    *js = NULL;
    natsStatus s = natsOptions_Create(&o);
    if (s == NATS_OK)
        s = natsOptions_SetServers(o, urls, c->nodes);
    if (s == NATS_OK)
        s = natsOptions_SetMaxReconnect(o, -1);
    if (s == NATS_OK)
        s = natsOptions_SetReconnectWait(o, 100);
    if (s == NATS_OK)
        s = harness_auth(o, &c->opts);
    if (s == NATS_OK)
        s = natsConnection_Connect(nc, o);
    natsOptions_Destroy(o);
    if (s == NATS_OK)
        s = natsConnection_JetStream(js, *nc, NULL);
    if (s != NATS_OK) {
        fprintf(stderr, "connect to %s: %s\n", c->urls, natsStatus_GetText(s));
        natsConnection_Destroy(*nc);
        *nc = NULL;
        return -1;
    }
    return 0;
}

tn_cluster_t tn_suite;
natsConnection *tn_suite_nc;
jsCtx *tn_suite_js;

int tn_suite_setup(int nodes)
{
    if (tn_cluster_start(&tn_suite, nodes, NULL, 30000) != 0)
        return -1;
    return tn_connect(&tn_suite, &tn_suite_nc, &tn_suite_js);
}

int tn_suite_teardown(void)
{
    jsCtx_Destroy(tn_suite_js);
    natsConnection_Destroy(tn_suite_nc);
    tn_suite_js = NULL;
    tn_suite_nc = NULL;
    tn_cluster_stop(&tn_suite);
    return 0;
}

/* How many of the partitions' leases member holds (NULL: anyone). */
static int leases_held(kvStore *leases, uint32_t partitions, const char *member)
{
    int held = 0;
    for (uint32_t k = 0; k < partitions; k++) {
        char key[16];
        kvEntry *e = NULL;
        snprintf(key, sizeof key, "p%u", (unsigned)k);
        if (kvStore_Get(&e, leases, key) == NATS_OK) {
            size_t len = (size_t)kvEntry_ValueLen(e);
            held +=
                len > 0 &&
                (!member || (strlen(member) == len && memcmp(kvEntry_Value(e), member, len) == 0));
        }
        kvEntry_Destroy(e);
    }
    return held;
}

int64_t tn_wait_leases(jsCtx *js, uint32_t partitions, const char *member, int count,
                       int timeout_ms, int *held)
{
    int64_t t0 = th_now_ms();
    *held = -1;
    for (;;) {
        kvStore *leases = NULL;
        if (js_KeyValue(&leases, js, "TALLY_LEASES") == NATS_OK)
            *held = leases_held(leases, partitions, member);
        kvStore_Destroy(leases); /* no bucket yet (no worker has started): none held */
        if (*held == count)
            return th_now_ms() - t0;
        if (th_now_ms() - t0 > timeout_ms)
            return -1;
        th_sleep_ms(50);
    }
}

int tn_node_index(const tn_cluster_t *c, const char *name)
{
    for (int i = 0; name && i < c->nodes; i++)
        if (name[0] == 'n' && atoi(name + 1) == i && name[1] >= '0' && name[1] <= '9')
            return i;
    return -1;
}

void tn_cluster_stop(tn_cluster_t *c)
{
    kill_all(c); /* nothing of the servers' state is kept, so no clean shutdown is needed */
    if (c->dir[0] && !getenv("TALLY_KEEP_NATS"))
        th_rmrf(c->dir);
    c->dir[0] = 0;
    c->nodes = 0;
}

int tn_publish(jsCtx *js, const char *subject, const void *data, int len, const char *reply_to,
               const char *id)
{
    natsMsg *m = NULL;
    natsStatus s = natsMsg_Create(&m, subject, NULL, data, len);
    if (s == NATS_OK && reply_to)
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_REPLY, reply_to);
    if (s == NATS_OK && id)
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_MSG_ID, id);
    jsErrCode jerr = 0;
    if (s == NATS_OK)
        s = js_PublishMsg(NULL, js, m, NULL, &jerr);
    natsMsg_Destroy(m);
    return (int)s;
}

int tn_partition_seqs(jsCtx *js, uint32_t k, uint64_t *msgs, uint64_t *first, uint64_t *last)
{
    char name[32];
    tally_fleet_name(name, sizeof name, TALLY_NATS_STREAM_PREFIX, k);
    jsStreamInfo *si = NULL;
    natsStatus s = NATS_ERR;
    for (int i = 0; i < 100 && s != NATS_OK; i++) { /* a new leader after a kill: 10 s */
        jsErrCode jerr = 0;
        s = js_GetStreamInfo(&si, js, name, NULL, &jerr);
        if (s == NATS_NOT_FOUND || jerr == JSStreamNotFoundErr)
            return -1;
        if (s != NATS_OK)
            th_sleep_ms(100);
    }
    if (s != NATS_OK)
        return -1;
    if (msgs)
        *msgs = si->State.Msgs;
    if (first)
        *first = si->State.FirstSeq;
    if (last)
        *last = si->State.LastSeq;
    jsStreamInfo_Destroy(si);
    return 0;
}

void tn_fleet_delete(jsCtx *js, uint32_t partitions)
{
    jsErrCode jerr = 0;
    for (uint32_t k = 0; k < partitions; k++) {
        char stream[32];
        tally_fleet_name(stream, sizeof stream, TALLY_NATS_STREAM_PREFIX, k);
        js_DeleteStream(js, stream, NULL, &jerr);
        tally_fleet_name(stream, sizeof stream, TALLY_NATS_CL_STREAM_PREFIX, k);
        js_DeleteStream(js, stream, NULL, &jerr);
    }
    js_DeleteStream(js, TALLY_NATS_DEAD_STREAM, NULL, &jerr);
    const char *buckets[] = {TALLY_NATS_BUCKET_FLEET, TALLY_NATS_BUCKET_MEMBERS,
                             TALLY_NATS_BUCKET_LEASES, TALLY_NATS_BUCKET_CKPT,
                             TALLY_NATS_BUCKET_ENDPOINTS};
    for (size_t i = 0; i < sizeof buckets / sizeof buckets[0]; i++)
        js_DeleteKeyValue(js, buckets[i]);
}
