/* SPDX-License-Identifier: Apache-2.0 */
/*
 * alloc_workload.c — one run of the allocation-failure sweep (issue 25; scripts/alloc-sweep.sh
 * runs it for every N, or every Nth, against a tallyd built with -DTALLY_ALLOC_FAULTS=ON).
 *
 *   alloc_workload [--fleet] N [persist]   (TALLYD_BIN: the tallyd; TALLY_STATE_FIXTURE: a
 *                                          state file)
 *
 * Starts tallyd with allocation N failing (TALLYD_ALLOC_FAIL_AT=N; 0: none, which is the run
 * that counts the range) on the CPU backend beside 2 simulated GPUs (batches of 16 KiB and more
 * go to the GPU pipeline), over ipc in a directory of its own, restoring a state file, and sends
 * a representative load: ping, info, streams (every restored stream listed), stats, hist/filter/
 * scan on the CPU and on the GPUs, on streams (one with a sequence number, sent twice), pipelined
 * requests, requests by reference into a shared-memory region registered over the side channel,
 * query (a window too), reset, delete, GETs of /metrics, /healthz and the JSON API on the HTTP
 * port, with a PUB subscriber connected, and a SIGHUP that reloads a changed configuration file
 * (logged, applied or refused); then SIGTERM (the final state snapshot). It passes when:
 *   - every request got exactly one reply with its id (any status: a refusal is fine; an ok one
 *     carries count elements of its dtype), every GET a response, and a ping at the end is
 *     answered ok: tallyd kept serving;
 *   - or tallyd never became ready and exited non-zero having logged an error (a `<3>` line):
 *     a failure at start-up refused cleanly;
 *   - tallyd exited on its own after SIGTERM, by exit() (status 0, or non-zero with an error
 *     logged), with no sanitizer report in its log (ASan, UBSan, LeakSanitizer: the environment's
 *     ASAN_OPTIONS/LSAN_OPTIONS apply to it), and no reply left unfreed at exit (tallyd's own
 *     warnings: pooled GPU reply buffers are invisible to LeakSanitizer);
 *   - with N = 0, every reply is ok as well (the load itself is right).
 * With --fleet (built with NATS; else it exits 77), the same tallyd is a fleet worker of 2
 * partitions, against one nats-server of its own (tests/lib/nats_cluster.h), and only the fleet's
 * allocations (daemon/nats/: TALLYD_ALLOC_FAIL_IN=/nats/) are numbered: the load is then a
 * producer's 8 requests over 4 streams, each asking for its reply (max_inflight 2: most of them
 * wait for room in the request path), and the answers by request-reply (a query, ping, info,
 * stats, the fleet's streams), after which every request must have had exactly one reply (any
 * status; none only where tallyd logged that it had no memory for the reply's frame: a fleet's
 * reply is published at most once) and, with no allocation failing, every one ok; the ZeroMQ
 * load is not sent.
 * With `persist`, every allocation from N on fails: replies and the last ping are not required
 * (tallyd answers what it can), the last three points are. Prints one line, "alloc N: <outcome>
 * (counted C ...)", and tallyd's log when it fails (exit 1) or TALLY_ALLOC_SHOW_LOG is set.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "harness.h"
#include "shm_side.h"
#ifdef TALLY_HAVE_NATS
#include "nats_cluster.h"
#include "tally.h"
#endif

#define REPLY_TIMEOUT_MS 15000 /* a loaded 2-core box under ASan: generous */
#define READY_TIMEOUT_MS 60000
#define STOP_TIMEOUT_MS 60000
#define PEER "alloc-sweep"
#define REGION_BYTES (256u << 10)
#define FIXTURE_STREAMS 11 /* in tests/data/state-v3/streams.state */

typedef struct {
    char dir[64];
    char log[128];
    char endpoint[128];
    char pub[128];
    pid_t pid;
    bool persist;
    const char *nats_url; /* --fleet: the nats-server; NULL: no fleet */
    uint64_t next_id;
    unsigned replies, refused; /* replies received, of which not ok */
    const char *failure;       /* the first thing that went wrong, or NULL */
    char not_ok[1024];         /* the replies that were not ok: id, status, message */
    tally_rep_t last;          /* the last reply's header */
} run_t;

static void fail(run_t *r, const char *what)
{
    if (!r->failure)
        r->failure = what;
}

static bool log_has(const run_t *r, const char *text)
{
    char *log = th_slurp(r->log);
    bool found = log && strstr(log, text);
    free(log);
    return found;
}

/* Copies $TALLY_STATE_FIXTURE into state/streams.state: tallyd restores it at start. */
static int copy_fixture(const char *state)
{
    const char *fixture = getenv("TALLY_STATE_FIXTURE");
    struct stat st;
    if (!fixture || stat(fixture, &st) != 0 || mkdir(state, 0700) != 0)
        return -1;
    char *bytes = th_slurp(fixture);
    int rc = bytes ? th_write_file(state, "streams.state", bytes, (size_t)st.st_size) : -1;
    free(bytes);
    return rc;
}

/* dir/tallyd.conf with a setting a reload applies. */
static int write_conf(const char *dir, unsigned max_inflight)
{
    char text[64];
    int len = snprintf(text, sizeof text, "[server]\nmax_inflight = %u\n", max_inflight);
    return th_write_file(dir, "tallyd.conf", text, (size_t)len);
}

/* SIGHUP with a changed configuration file: the reload is logged, done or refused. */
static void reload(run_t *r)
{
    if (write_conf(r->dir, 48) != 0 || kill(r->pid, SIGHUP) != 0) {
        fail(r, "cannot ask for a reload");
        return;
    }
    for (int waited = 0; waited < READY_TIMEOUT_MS; waited += 10) {
        if (log_has(r, "reload: ") || log_has(r, "reload failed"))
            return;
        th_sleep_ms(10);
    }
    fail(r, "no word of the reload after SIGHUP");
}

/* Starts tallyd in r->dir with TALLYD_ALLOC_FAIL_AT=n; 0, or -1 when it cannot be started. */
static int spawn(run_t *r, const char *n)
{
    char state[96], shm[96];
    snprintf(state, sizeof state, "%s/state", r->dir);
    snprintf(shm, sizeof shm, "%s/shm.sock", r->dir);
    snprintf(r->endpoint, sizeof r->endpoint, "ipc://%s/tallyd.sock", r->dir);
    snprintf(r->log, sizeof r->log, "%s/tallyd.log", r->dir);
    snprintf(r->pub, sizeof r->pub, "ipc://%s/pub.sock", r->dir);
    char conf[96];
    snprintf(conf, sizeof conf, "%s/tallyd.conf", r->dir);
    /* A fleet's 8 messages at once against 2 in flight: the fleet's requests wait for room. */
    if (copy_fixture(state) != 0 || write_conf(r->dir, r->nats_url ? 2 : 64) != 0)
        return -1;
    /* clang-format off */
    const char *argv[] = {th_tallyd_bin(), "--bind", r->endpoint, "--shm-socket", shm,
                          "--state-dir", state, "--backend", "auto", "--test-sim-gpus", "2",
                          "--gpu-streams", "2", "--gpu-min-batch", "16K", "--max-batch", "1M",
                          "--metrics", "127.0.0.1:0", "--pub", r->pub, "--pub-interval-ms", "10",
                          "--config", conf, NULL};
    const char *fleet[] = {"--nats-servers", r->nats_url, "--nats-replicas", "1",
                           "--nats-partitions", "2", "--nats-lease-ttl-ms", "2000",
                           "--nats-checkpoint-interval-ms", "100", "--nats-member-id", "alloc",
                           NULL};
    /* clang-format on */
    const char *all[sizeof argv / sizeof argv[0] + sizeof fleet / sizeof fleet[0]];
    size_t used = sizeof argv / sizeof argv[0] - 1;
    memcpy(all, argv, sizeof argv);
    if (r->nats_url)
        memcpy(all + used, fleet, sizeof fleet);
    r->pid = fork();
    if (r->pid < 0)
        return -1;
    if (r->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        setenv("TALLYD_ALLOC_FAIL_AT", n, 1);
        if (r->nats_url)
            setenv("TALLYD_ALLOC_FAIL_IN", "/nats/", 1);
        if (r->persist)
            setenv("TALLYD_ALLOC_FAIL_PERSIST", "1", 1);
        if (!freopen(r->log, "w", stderr) || !freopen("/dev/null", "w", stdout))
            _exit(127);
        execv(all[0], (char *const *)all);
        _exit(127);
    }
    return 0;
}

/* Waits for "ready" in the log (1), or for tallyd's exit (0, *status set). */
static int wait_ready(run_t *r, int *status)
{
    for (int waited = 0; waited < READY_TIMEOUT_MS; waited += 10) {
        if (waitpid(r->pid, status, WNOHANG) == r->pid) {
            r->pid = 0;
            return 0;
        }
        if (log_has(r, " ready: "))
            return 1;
        th_sleep_ms(10);
    }
    fail(r, "tallyd neither became ready nor exited");
    return -1;
}

/* Receives replies until `count` have come or one does not: each must carry one of ids[]
 * (cleared when matched), so a reply for no request, a second reply or a lost one fails. */
static void expect_replies(run_t *r, void *sock, uint64_t *ids, int count)
{
    for (int got = 0; got < count; got++) {
        th_reply_t rep;
        if (th_recv_reply(sock, &rep) != 0) {
            th_reply_free(&rep);
            if (!r->persist)
                fail(r, "a request got no reply (or a malformed one)");
            return;
        }
        int i = 0;
        while (i < count && ids[i] != rep.rep.request_id)
            i++;
        if (i == count)
            fail(r, "a reply for no request in flight (a second reply?)");
        else
            ids[i] = 0;
        r->replies++;
        r->last = rep.rep;
        /* An ok reply's payload is what its header says: count elements of its dtype (or none,
         * written into an output region). */
        size_t esize = tally_dtype_size((tally_dtype_t)rep.rep.dtype);
        bool in_region = (rep.rep.flags & TALLY_FLAG_SHM_REF) && rep.len == 0;
        if (rep.rep.status == TALLY_OK && esize && !in_region && rep.len != rep.rep.count * esize)
            fail(r, "an ok reply whose payload is not count elements of its dtype");
        /* duplicate: the answer to the repeated sequence number, as it should be */
        if (rep.rep.status != TALLY_OK && rep.rep.status != TALLY_E_DUPLICATE) {
            size_t used = strlen(r->not_ok);
            snprintf(r->not_ok + used, sizeof r->not_ok - used, "  request %llu: %s: %.80s\n",
                     (unsigned long long)rep.rep.request_id,
                     tally_status_name((tally_status_t)rep.rep.status),
                     rep.payload ? (const char *)rep.payload : "");
            r->refused++;
        }
        th_reply_free(&rep);
    }
}

/* Sends `count` requests at once (payload[i] of len[i] bytes each), then takes their replies. */
static void call_many(run_t *r, void *sock, tally_req_t *reqs, const void *const *payload,
                      const size_t *len, int count)
{
    uint64_t ids[16];
    for (int i = 0; i < count; i++) {
        reqs[i].request_id = ids[i] = ++r->next_id;
        if (th_send_request(sock, &reqs[i], payload[i], len[i]) != 0) {
            fail(r, "cannot send a request");
            return;
        }
    }
    expect_replies(r, sock, ids, count);
}

static void call(run_t *r, void *sock, tally_req_t req, const void *payload, size_t len)
{
    call_many(r, sock, &req, &payload, &len, 1);
}

static tally_req_t on_stream(uint8_t op, uint8_t dtype, const char *stream)
{
    tally_req_t q = th_req(op, dtype, 0);
    if (stream) {
        q.stream_len = (uint8_t)strlen(stream);
        memcpy(q.stream, stream, q.stream_len + 1u);
    }
    if (op == TALLY_OP_FILTER)
        q.pred = TALLY_PRED_GT;
    if (op == TALLY_OP_HIST && dtype == TALLY_DTYPE_I32) {
        q.lo = -1000;
        q.hi = 1000;
    }
    return q;
}

/* Batches on the CPU (under 16 KiB) and on the simulated GPUs, on streams and without. */
static void compute_load(run_t *r, void *sock, const int32_t *data)
{
    call(r, sock, on_stream(TALLY_OP_HIST, TALLY_DTYPE_U8, "cam0"), data, 1024);
    call(r, sock, on_stream(TALLY_OP_HIST, TALLY_DTYPE_U8, "cam0"), data, 64u << 10);
    tally_req_t seq = on_stream(TALLY_OP_HIST, TALLY_DTYPE_I32, "line3/pressure");
    seq.seq = 1;
    call(r, sock, seq, data, 4096);
    call(r, sock, seq, data, 4096); /* the same sequence again: applied once, answered again */
    call(r, sock, on_stream(TALLY_OP_FILTER, TALLY_DTYPE_I32, NULL), data, 64u << 10);
    tally_req_t stable = on_stream(TALLY_OP_FILTER, TALLY_DTYPE_I32, NULL);
    stable.flags = TALLY_FLAG_FILTER_STABLE;
    call(r, sock, stable, data, 1024);
    call(r, sock, on_stream(TALLY_OP_SCAN, TALLY_DTYPE_I32, "s1"), data, 64u << 10);
    call(r, sock, on_stream(TALLY_OP_SCAN, TALLY_DTYPE_I32, "s1"), data, 64u << 10);
    tally_req_t excl = on_stream(TALLY_OP_SCAN, TALLY_DTYPE_I32, NULL);
    excl.flags = TALLY_FLAG_SCAN_EXCLUSIVE | TALLY_FLAG_SCAN_OUT_I32;
    call(r, sock, excl, data, 512);
    /* Six at once, over three streams and both backends. */
    tally_req_t many[6] = {on_stream(TALLY_OP_HIST, TALLY_DTYPE_U8, "p0"),
                           on_stream(TALLY_OP_HIST, TALLY_DTYPE_U8, "p1"),
                           on_stream(TALLY_OP_HIST, TALLY_DTYPE_U8, "p0"),
                           on_stream(TALLY_OP_SCAN, TALLY_DTYPE_I32, "p2"),
                           on_stream(TALLY_OP_FILTER, TALLY_DTYPE_I32, NULL),
                           on_stream(TALLY_OP_HIST, TALLY_DTYPE_U8, "p1")};
    const void *payload[6] = {data, data, data, data, data, data};
    size_t len[6] = {32u << 10, 2048, 32u << 10, 32u << 10, 8192, 100};
    call_many(r, sock, many, payload, len, 6);
}

/* Registers a region over the side channel and sends requests by reference into it; a refused
 * registration (the side channel's own allocation failed) ends this part. */
static void shm_load(run_t *r, void *sock, const int32_t *data)
{
    char path[96];
    snprintf(path, sizeof path, "%s/shm.sock", r->dir);
    int side = th_side_connect(path);
    if (side < 0)
        return;
    int fd = th_memfd(REGION_BYTES, F_SEAL_SHRINK | F_SEAL_GROW);
    void *map = mmap(NULL, REGION_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map != MAP_FAILED) {
        memcpy(map, data, 64u << 10);
        munmap(map, REGION_BYTES);
    }
    th_answer_t ans;
    int st = th_side_call(side, TALLY_SHM_OP_REGISTER, PEER, 0, fd, &ans);
    close(fd);
    if (st == TALLY_OK) {
        uint8_t ref[TALLY_SHM_REF_SIZE];
        tally_shm_ref_t hist = {.in_handle = ans.a.handle, .in_length = 64u << 10};
        tally_shm_ref_encode(&hist, ref);
        tally_req_t q = on_stream(TALLY_OP_HIST, TALLY_DTYPE_U8, "cam0");
        q.flags = TALLY_FLAG_SHM_REF;
        call(r, sock, q, ref, sizeof ref);
        tally_shm_ref_t scan = {.in_handle = ans.a.handle,
                                .in_length = 32u << 10,
                                .out_handle = ans.a.handle,
                                .out_offset = 128u << 10,
                                .out_length = 64u << 10};
        tally_shm_ref_encode(&scan, ref);
        q = on_stream(TALLY_OP_SCAN, TALLY_DTYPE_I32, "s2");
        q.flags = TALLY_FLAG_SHM_REF;
        call(r, sock, q, ref, sizeof ref);
        th_side_call(side, TALLY_SHM_OP_RELEASE, NULL, ans.a.handle, -1, &ans);
    } else if (st < 0 && !r->persist && !r->failure && !log_has(r, "alloc-fault: failing")) {
        fail(r, "the side channel did not answer a registration");
    }
    close(side);
}

/* The metrics and the JSON API on the HTTP port: each GET answered (any status; 200 when no
 * allocation fails). */
static void http_load(run_t *r, bool count_only)
{
    static const char *const paths[] = {"/metrics", "/healthz", "/api/v1/streams",
                                        "/api/v1/streams/cam0"};
    th_daemon_t d = {0};
    snprintf(d.log_path, sizeof d.log_path, "%s", r->log);
    int port = th_metrics_port(&d);
    if (port <= 0) {
        fail(r, "no metrics port in the log");
        return;
    }
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
        char *got = th_http_get(port, "GET", paths[i], NULL);
        if (!got || strncmp(got, "HTTP/1.", 7) != 0)
            fail(r, "an HTTP request without a response");
        else if (count_only && strncmp(got + 8, " 200", 4) != 0)
            fail(r, "an HTTP request failed with no allocation failing");
        free(got);
    }
}

#ifdef TALLY_HAVE_NATS
#define FLEET_REQUESTS 8

/* An answer by request-reply: with no allocation failing it must be ok; with one failing any
 * status will do (a timeout too: an answer whose allocation failed is not sent, and the
 * requester gives up), for the fleet must only keep serving and stop cleanly. */
static void fleet_answered(run_t *r, tally_status_t st, bool count_only, const char *what)
{
    if (st != TALLY_OK && count_only)
        fail(r, what);
}

/* The fleet's load: a producer's requests over 4 streams (hist and scan, each asking for its
 * reply), each of which must get exactly one reply; then a query, ping, info, stats and the
 * fleet's streams by request-reply. */
static void fleet_load(run_t *r, bool count_only, const int32_t *data)
{
    tally_nats_opts_t opts = {.servers = r->nats_url, .timeout_ms = REPLY_TIMEOUT_MS};
    tally_nats_t *p = NULL;
    char msg[256];
    if (tally_nats_new(&opts, &p, msg, sizeof msg) != TALLY_OK) {
        fail(r, "the producer cannot connect (or finds no fleet)");
        return;
    }
    uint64_t ids[FLEET_REQUESTS];
    for (int i = 0; i < FLEET_REQUESTS; i++) {
        char stream[8];
        snprintf(stream, sizeof stream, "f%d", i % 4);
        tally_req_t q = i % 2 ? on_stream(TALLY_OP_SCAN, TALLY_DTYPE_I32, stream)
                              : on_stream(TALLY_OP_HIST, TALLY_DTYPE_U8, stream);
        if (tally_nats_send(p, &q, data, 4096, true, &ids[i], NULL) != TALLY_OK)
            fail(r, "the producer cannot publish");
    }
    if (tally_nats_flush(p) != TALLY_OK)
        fail(r, "the producer's messages were not all stored");
    /* In slices, so that a run whose one missing reply had no memory for its frame (logged;
     * its reply is not published) ends as soon as the others have come. */
    int64_t deadline = th_now_ms() + REPLY_TIMEOUT_MS;
    for (int got = 0; got < FLEET_REQUESTS && !r->failure;) {
        tally_reply_t rep;
        tally_reply_init(&rep);
        tally_status_t st = tally_nats_recv(p, 100, &rep);
        if (st == TALLY_E_TIMEOUT) {
            tally_reply_clear(&rep);
            if (got == FLEET_REQUESTS - 1 && log_has(r, "out of memory for a reply frame"))
                break;
            if (th_now_ms() >= deadline)
                fail(r, "a fleet request got no reply");
            continue;
        }
        int i = 0;
        while (i < FLEET_REQUESTS && ids[i] != rep.rep.request_id)
            i++;
        if (st == TALLY_E_TRANSPORT || st == TALLY_E_REPLY)
            fail(r, "a fleet request got no reply (or a malformed one)");
        else if (i == FLEET_REQUESTS)
            fail(r, "a fleet reply for no request in flight (a second reply?)");
        else
            ids[i] = 0;
        got++;
        r->replies++;
        if (st != TALLY_OK) {
            r->refused++;
            size_t used = strlen(r->not_ok);
            snprintf(r->not_ok + used, sizeof r->not_ok - used, "  fleet request: %s: %.80s\n",
                     tally_status_name(st), rep.error);
        }
        tally_reply_clear(&rep);
    }
    tally_stream_info_t info;
    fleet_answered(r, tally_nats_query(p, "f0", &info), count_only, "a fleet query failed");
    static const uint8_t ops[] = {TALLY_OP_PING, TALLY_OP_INFO, TALLY_OP_STATS};
    for (size_t i = 0; i < sizeof ops; i++) {
        tally_reply_t rep;
        tally_reply_init(&rep);
        tally_req_t q = on_stream(ops[i], TALLY_DTYPE_NONE, NULL);
        fleet_answered(r, tally_nats_call(p, &q, NULL, 0, &rep), count_only,
                       "a fleet ping, info or stats failed");
        tally_reply_clear(&rep);
    }
    char **names = NULL;
    size_t count = 0;
    fleet_answered(r, tally_nats_streams(p, &names, &count), count_only,
                   "the fleet's streams were not listed");
    if (count_only && count != 4)
        fail(r, "the fleet's streams are not the 4 written");
    tally_strings_free(names, count);
    tally_nats_destroy(&p);
}
#endif

static void load(run_t *r, bool count_only)
{
    void *ctx = zmq_ctx_new();
    void *sock = th_dealer_id(ctx, r->endpoint, PEER, REPLY_TIMEOUT_MS);
    void *sub = zmq_socket(ctx, ZMQ_SUB); /* a subscriber, so that tallyd publishes */
    int zero = 0;
    zmq_setsockopt(sub, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "", 0);
    zmq_connect(sub, r->pub);
    int32_t *data = th_random_i32(64u << 10, -1000, 1000); /* 256 KiB; the batches take parts */
    if (!sock || !data) {
        fail(r, "no socket or no memory in the driver");
        goto done;
    }
    if (r->nats_url) {
#ifdef TALLY_HAVE_NATS
        fleet_load(r, count_only, data);
#endif
        goto done;
    }
    call(r, sock, on_stream(TALLY_OP_PING, TALLY_DTYPE_NONE, NULL), NULL, 0);
    call(r, sock, on_stream(TALLY_OP_INFO, TALLY_DTYPE_NONE, NULL), NULL, 0);
    /* Every stream of the state file is there (or tallyd would not have started). */
    call(r, sock, on_stream(TALLY_OP_STREAMS, TALLY_DTYPE_NONE, NULL), NULL, 0);
    if (r->last.status == TALLY_OK && r->last.count != FIXTURE_STREAMS)
        fail(r, "tallyd started without every stream of its state file");
    compute_load(r, sock, data);
    reload(r);
    shm_load(r, sock, data);
    call(r, sock, on_stream(TALLY_OP_QUERY, TALLY_DTYPE_NONE, "cam0"), NULL, 0);
    tally_req_t window = on_stream(TALLY_OP_QUERY, TALLY_DTYPE_NONE, "cam0");
    window.flags = TALLY_FLAG_QUERY_WINDOW;
    window.lo = 10000; /* the last 10 s */
    call(r, sock, window, NULL, 0);
    http_load(r, count_only);
    call(r, sock, on_stream(TALLY_OP_STREAMS, TALLY_DTYPE_NONE, NULL), NULL, 0);
    call(r, sock, on_stream(TALLY_OP_STATS, TALLY_DTYPE_NONE, NULL), NULL, 0);
    call(r, sock, on_stream(TALLY_OP_RESET, TALLY_DTYPE_NONE, "p0"), NULL, 0);
    call(r, sock, on_stream(TALLY_OP_DELETE, TALLY_DTYPE_NONE, "p1"), NULL, 0);
    /* Still serving: a ping answered ok (one allocation fails: the first ping may be the one
     * it hits, not the second), and nothing more arrives after it. */
    unsigned refused = r->refused;
    for (int i = 0; i < 2 && (i == 0 || r->refused != refused); i++) {
        refused = r->refused;
        call(r, sock, on_stream(TALLY_OP_PING, TALLY_DTYPE_NONE, NULL), NULL, 0);
    }
    if (r->refused != refused && !r->persist)
        fail(r, "the last ping was not answered ok: tallyd stopped serving");
    th_reply_t extra;
    int timeout = 200;
    zmq_setsockopt(sock, ZMQ_RCVTIMEO, &timeout, sizeof timeout);
    if (th_recv_reply(sock, &extra) == 0)
        fail(r, "a reply after the last one (a second reply)");
    th_reply_free(&extra);
done:
    free(data);
    if (sock)
        zmq_close(sock);
    zmq_close(sub);
    zmq_ctx_term(ctx);
}

/* The exit: by exit(), 0 or non-zero with an error logged, and no sanitizer report. */
static void check_exit(run_t *r, int status, bool must_be_clean)
{
    if (!WIFEXITED(status))
        fail(r, "tallyd died of a signal");
    else if (WEXITSTATUS(status) != 0 && (must_be_clean || !log_has(r, "<3>")))
        fail(r, "tallyd exited non-zero without an error message");
    if (log_has(r, "Sanitizer") || log_has(r, "runtime error"))
        fail(r, "a sanitizer report in tallyd's log");
    /* tallyd's own leak checks at exit, for what LeakSanitizer cannot see (pool buffers). */
    if (log_has(r, "never given back") || log_has(r, "still counted at exit"))
        fail(r, "replies left behind at exit");
}

static void print_result(run_t *r, const char *n, const char *outcome, int status)
{
    char *log = th_slurp(r->log);
    const char *counted = log ? strstr(log, "alloc-fault: counted ") : NULL;
    unsigned long long c = counted ? strtoull(counted + 21, NULL, 10) : 0;
    const char *site = log ? strstr(log, "failing allocation ") : NULL;
    int site_len = site ? (int)strcspn(site, "\n") : 0;
    printf("alloc %s: %s, exit %d, %u replies (%u not ok), counted %llu%s%.*s\n", n, outcome,
           WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), r->replies, r->refused,
           c, site ? "; " : "", site_len, site ? site : "");
    if (r->failure)
        printf("FAIL: %s\n", r->failure);
    if (r->failure || getenv("TALLY_ALLOC_SHOW_LOG")) /* the log of a run that passed, too */
        printf("%s---- tallyd's log (%s)\n%s----\n", r->not_ok, r->log, log ? log : "");
    free(log);
}

int main(int argc, char **argv)
{
    bool fleet = argc > 1 && strcmp(argv[1], "--fleet") == 0;
    argc -= fleet;
    argv += fleet;
    if (argc < 2) {
        fprintf(stderr, "usage: alloc_workload [--fleet] N [persist]\n");
        return 2;
    }
    run_t r = {.persist = argc > 2 && strcmp(argv[2], "persist") == 0};
    bool count_only = strtoull(argv[1], NULL, 10) == 0;
#ifdef TALLY_HAVE_NATS
    tn_cluster_t nats = {0};
    if (fleet && tn_cluster_start(&nats, 1, NULL, READY_TIMEOUT_MS) != 0) {
        fprintf(stderr, "alloc %s: cannot start a nats-server\n", argv[1]);
        return 2;
    }
    r.nats_url = fleet ? nats.node[0].url : NULL;
#else
    if (fleet) {
        printf("alloc_workload: built without NATS: no --fleet (skipped)\n");
        return 77;
    }
#endif
    if (th_tmpdir(r.dir, sizeof r.dir, "tallyd-alloc") != 0 || spawn(&r, argv[1]) != 0) {
        fprintf(stderr, "alloc %s: cannot start tallyd\n", argv[1]);
        return 2;
    }
    int status = 0;
    const char *outcome = "start-up refused";
    int ready = wait_ready(&r, &status);
    if (ready == 1) {
        outcome = "served";
        load(&r, count_only);
        if (count_only && r.refused)
            fail(&r, "a request failed with no allocation failing");
        kill(r.pid, SIGTERM);
        for (int waited = 0; waited < STOP_TIMEOUT_MS && r.pid; waited += 10) {
            if (waitpid(r.pid, &status, WNOHANG) == r.pid)
                r.pid = 0;
            th_sleep_ms(10);
        }
        if (r.pid)
            fail(&r, "tallyd did not stop within 60 s of SIGTERM");
    } else if (ready == 0 && (count_only || !WIFEXITED(status) || WEXITSTATUS(status) == 0)) {
        fail(&r, "tallyd exited at start-up without an error status");
    }
    if (r.pid) {
        kill(r.pid, SIGKILL);
        waitpid(r.pid, &status, 0);
    } else {
        check_exit(&r, status, count_only);
    }
    print_result(&r, argv[1], outcome, status);
    int code = r.failure ? 1 : 0;
    if (!r.failure)
        th_rmrf(r.dir);
#ifdef TALLY_HAVE_NATS
    tn_cluster_stop(&nats);
#endif
    return code;
}
