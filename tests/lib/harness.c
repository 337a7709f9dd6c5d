/* SPDX-License-Identifier: Apache-2.0 */
/*
 * harness.c — see harness.h.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "harness.h"

static void *zmq_context;
static char curve_keys[3][41]; /* server public, client public, client secret; "" = no CURVE */

static void *context(void)
{
    if (!zmq_context)
        zmq_context = zmq_ctx_new();
    return zmq_context;
}

void th_use_curve(const char *server_public, const char *client_public, const char *client_secret)
{
    snprintf(curve_keys[0], sizeof curve_keys[0], "%s", server_public ? server_public : "");
    snprintf(curve_keys[1], sizeof curve_keys[1], "%s", client_public ? client_public : "");
    snprintf(curve_keys[2], sizeof curve_keys[2], "%s", client_secret ? client_secret : "");
}

/* Whether a loopback TCP port can be bound now. */
static bool bindable(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in addr = {.sin_family = AF_INET,
                               .sin_addr.s_addr = htonl(INADDR_LOOPBACK),
                               .sin_port = htons((uint16_t)port)};
    bool ok = fd >= 0 && bind(fd, (struct sockaddr *)&addr, sizeof addr) == 0;
    if (fd >= 0)
        close(fd);
    return ok;
}

int th_free_port(void)
{
    static unsigned next; /* where this process looks next: its own walk over the range */
    unsigned from =
        __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED) * 7u + (unsigned)getpid() * 7919u;
    for (unsigned i = 0; i < 4000; i++) {
        int port = TH_PORT_LOW + (int)((from + i * 13u) % (TH_PORT_HIGH - TH_PORT_LOW));
        char path[64];
        snprintf(path, sizeof path, "/tmp/tally-test-port-%d.lock", port);
        int lock = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        if (lock < 0)
            continue;
        if (flock(lock, LOCK_EX | LOCK_NB) == 0 && bindable(port))
            return port; /* the lock stays held, its descriptor open, until this process ends */
        close(lock);
    }
    return -1;
}

int th_refusing_port(int *held)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof addr;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&addr, sizeof addr) == 0 &&
        getsockname(fd, (struct sockaddr *)&addr, &len) == 0) {
        *held = fd;
        return ntohs(addr.sin_port);
    }
    if (fd >= 0)
        close(fd);
    *held = -1;
    return -1;
}

pid_t th_spawn(const char *const *argv, const char *log, bool stdout_to_log,
               void (*setup)(const void *arg), const void *arg)
{
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    /* If the test dies, its process must not outlive it: an orphan holding the test's output
     * pipe would turn a failure into a CTest timeout. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (!freopen(log, "w", stderr))
        _exit(126);
    if (stdout_to_log ? dup2(STDERR_FILENO, STDOUT_FILENO) < 0 : !freopen("/dev/null", "w", stdout))
        _exit(126);
    if (setup)
        setup(arg);
    execv(argv[0], (char *const *)argv);
    fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
    _exit(127);
}

const char *th_tallyd_bin(void)
{
    const char *bin = getenv("TALLYD_BIN");
    return bin && *bin ? bin : "./tallyd";
}

/* Adds --shm-socket in a fresh directory of d's own to argv, unless args names one. */
static int own_shm_socket(th_daemon_t *d, const char *const *args, const char **argv, int *argc)
{
    for (int i = 0; args && args[i]; i++)
        if (strcmp(args[i], "--shm-socket") == 0 || strncmp(args[i], "--shm-socket=", 13) == 0)
            return 0;
    if (th_tmpdir(d->shm_dir, sizeof d->shm_dir, "tallyd-shm") != 0) {
        d->shm_dir[0] = '\0';
        return -1;
    }
    snprintf(d->shm_socket, sizeof d->shm_socket, "%s/shm.sock", d->shm_dir);
    argv[(*argc)++] = "--shm-socket";
    argv[(*argc)++] = d->shm_socket;
    return 0;
}

/* Removes d's side-channel directory, if it has one. */
static void remove_shm_dir(th_daemon_t *d)
{
    if (d->shm_dir[0])
        th_rmrf(d->shm_dir);
    d->shm_dir[0] = '\0';
}

/* The logs of the tallyds this process started, removed at its exit when it passed (exit status
 * 0, or 77: skipped) and kept when it failed, their paths on stderr, so that a failure in CI can
 * be read and thousands of passing runs leave nothing in /tmp. Only at exit: a test reads its
 * tallyds' logs until its end (grep, th_daemon_log_contains), a teardown's included.
 * TALLY_TEST_KEEP_LOGS=1 keeps them all. */
static struct {
    pthread_mutex_t mu;
    char (*path)[sizeof((th_daemon_t *)0)->log_path];
    size_t n, cap;
    pid_t owner; /* the process whose exit removes them: not a forked child's */
} daemon_logs = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void daemon_logs_at_exit(int status, void *arg)
{
    (void)arg;
    if (getpid() != daemon_logs.owner)
        return;
    const char *keep = getenv("TALLY_TEST_KEEP_LOGS");
    bool failed = status != 0 && status != 77;
    if (failed && daemon_logs.n > 0)
        fprintf(stderr, "the test failed: its tallyds' logs are kept:\n");
    for (size_t i = 0; i < daemon_logs.n; i++) {
        if (failed)
            fprintf(stderr, "  %s\n", daemon_logs.path[i]);
        else if (!(keep && strcmp(keep, "1") == 0))
            unlink(daemon_logs.path[i]);
    }
    free(daemon_logs.path);
    daemon_logs.path = NULL;
    daemon_logs.n = daemon_logs.cap = 0;
}

/* Adds path to the logs removed at a passing exit (once). */
static void daemon_log_remember(const char *path)
{
    pthread_mutex_lock(&daemon_logs.mu);
    if (!daemon_logs.owner) {
        daemon_logs.owner = getpid();
        on_exit(daemon_logs_at_exit, NULL);
    }
    bool known = false;
    for (size_t i = 0; i < daemon_logs.n && !known; i++)
        known = strcmp(daemon_logs.path[i], path) == 0;
    if (!known && daemon_logs.n == daemon_logs.cap) {
        size_t cap = daemon_logs.cap ? 2 * daemon_logs.cap : 16;
        void *grown = realloc(daemon_logs.path, cap * sizeof daemon_logs.path[0]);
        if (grown) { /* else the log stays, as it always did */
            daemon_logs.path = grown;
            daemon_logs.cap = cap;
        }
    }
    if (!known && daemon_logs.n < daemon_logs.cap)
        snprintf(daemon_logs.path[daemon_logs.n++], sizeof daemon_logs.path[0], "%s", path);
    pthread_mutex_unlock(&daemon_logs.mu);
}

int th_daemon_start(th_daemon_t *d, const char *const *extra_args)
{
    for (int attempt = 0; attempt < 5; attempt++) {
        memset(d, 0, sizeof *d);
        d->port = th_free_port();
        snprintf(d->endpoint, sizeof d->endpoint, "tcp://127.0.0.1:%d", d->port);
        snprintf(d->log_path, sizeof d->log_path, "/tmp/tallyd-test-%d-%d.log", (int)getpid(),
                 d->port);
        daemon_log_remember(d->log_path);
        const char *argv[64];
        int argc = 0;
        argv[argc++] = th_tallyd_bin();
        argv[argc++] = "--bind";
        argv[argc++] = d->endpoint;
        argv[argc++] = "--log-level";
        argv[argc++] = "debug";
        bool has_backend = false;
        for (int i = 0; extra_args && extra_args[i] && argc < 56; i++) {
            has_backend |= strcmp(extra_args[i], "--backend") == 0;
            argv[argc++] = extra_args[i];
        }
        if (!has_backend && !getenv("TALLY_TEST_BACKEND")) {
            argv[argc++] = "--backend";
            argv[argc++] = "cpu";
        } else if (!has_backend) {
            argv[argc++] = "--backend";
            argv[argc++] = getenv("TALLY_TEST_BACKEND");
        }
        if (own_shm_socket(d, extra_args, argv, &argc) != 0)
            return -1;
        argv[argc] = NULL;
        pid_t pid = th_spawn(argv, d->log_path, false, NULL, NULL);
        if (pid < 0)
            return -1;
        d->pid = pid;
        /* The daemon is up once it answers; exited, or another process answering on its port:
         * the port was taken meanwhile, try another. */
        int status;
        int up = th_await_pong(d->endpoint, pid, d->log_path, TH_START_WAIT_MS, &status);
        if (up == 1)
            return 0;
        if (up == -1) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
        }
        remove_shm_dir(d);
        fprintf(stderr, "tallyd did not start on %s (log %s)\n", d->endpoint, d->log_path);
    }
    return -1;
}

int th_daemon_start_with(th_daemon_t *d, const char *const *args, const char *const *extra)
{
    const char *argv[32];
    int argc = 0;
    for (int i = 0; args && args[i] && argc < 30; i++)
        argv[argc++] = args[i];
    for (int i = 0; extra && extra[i] && argc < 30; i++)
        argv[argc++] = extra[i];
    argv[argc] = NULL;
    return th_daemon_start(d, argv);
}

int th_daemon_run_to_exit(const char *const *args, const char *log, int timeout_ms)
{
    const char *argv[40];
    int argc = 0;
    argv[argc++] = th_tallyd_bin();
    for (int i = 0; args && args[i] && argc < 39; i++)
        argv[argc++] = args[i];
    argv[argc] = NULL;
    pid_t pid = th_spawn(argv, log, false, NULL, NULL);
    if (pid < 0)
        return -1;
    th_daemon_t d = {.pid = pid};
    return th_daemon_wait(&d, timeout_ms);
}

int th_run_refused(const char *dir, const char *const *args, char *log, size_t cap, int timeout_ms)
{
    char bind[160];
    snprintf(bind, sizeof bind, "ipc://%s/refused.sock", dir);
    snprintf(log, cap, "%s/refused.log", dir);
    const char *argv[32] = {"--backend", "cpu", "--shm", "off"};
    int argc = 4;
    bool has_bind = false;
    for (int i = 0; args && args[i] && argc < 28; i++) {
        has_bind |= strcmp(args[i], "--bind") == 0;
        argv[argc++] = args[i];
    }
    if (!has_bind) {
        argv[argc++] = "--bind";
        argv[argc++] = bind;
    }
    argv[argc] = NULL;
    return th_daemon_run_to_exit(argv, log, timeout_ms);
}

int th_daemon_stop(th_daemon_t *d, int sig, int timeout_ms)
{
    if (d->pid <= 0)
        return -1;
    kill(d->pid, sig);
    return th_daemon_wait(d, timeout_ms);
}

int th_daemon_wait(th_daemon_t *d, int timeout_ms)
{
    if (d->pid <= 0)
        return -1;
    for (int waited = 0; waited < timeout_ms; waited += 10) {
        int status;
        if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
            d->pid = 0;
            remove_shm_dir(d);
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        }
        usleep(10000);
    }
    kill(d->pid, SIGKILL);
    waitpid(d->pid, NULL, 0);
    d->pid = 0;
    remove_shm_dir(d);
    return -1;
}

static bool file_has(const char *path, const char *text)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    char line[2048];
    bool found = false;
    while (!found && fgets(line, sizeof line, f))
        found = strstr(line, text) != NULL;
    fclose(f);
    return found;
}

bool th_daemon_log_contains(const th_daemon_t *d, const char *text)
{
    return file_has(d->log_path, text);
}

bool th_daemon_wait_log(const th_daemon_t *d, const char *text, int64_t timeout_ms)
{
    for (int64_t t0 = th_now_ms(); !th_daemon_log_contains(d, text); th_sleep_ms(50))
        if (th_now_ms() - t0 > timeout_ms) {
            fprintf(stderr, "no '%s' in %s\n", text, d->log_path);
            return false;
        }
    return true;
}

/* Whether a pong on endpoint came from the tallyd of pid: it listens there and is ready (both
 * logged before it serves), and runs. A tallyd that failed after its bind (a metrics port
 * taken) exits without serving, and another test's tallyd may take the port it left and answer
 * (seen on the loaded dev box, where hundreds of tallyd start a minute). */
static bool answered_by(const char *endpoint, pid_t pid, const char *log_path)
{
    char bound[160], bound_sd[160]; /* the whole endpoint: port 4123 is not 41234 */
    snprintf(bound, sizeof bound, "listening on %s\n", endpoint);
    snprintf(bound_sd, sizeof bound_sd, "listening on %s (", endpoint);
    return (file_has(log_path, bound) || file_has(log_path, bound_sd)) &&
           file_has(log_path, " ready: ") && waitpid(pid, NULL, WNOHANG) == 0;
}

int th_await_pong(const char *endpoint, pid_t pid, const char *log_path, int timeout_ms,
                  int *status)
{
    void *sock = th_connect(endpoint, 200);
    tally_req_t ping = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, 1);
    int up = th_send_request(sock, &ping, NULL, 0) == 0 ? 0 : -1;
    for (int64_t t0 = th_now_ms(); up == 0 && th_now_ms() - t0 < timeout_ms;) {
        th_reply_t reply;
        if (th_recv_reply(sock, &reply) == 0) {
            th_reply_free(&reply);
            up = answered_by(endpoint, pid, log_path) ? 1 : -1;
        } else if (waitpid(pid, status, WNOHANG) == pid) {
            th_close(sock);
            return 0;
        }
    }
    th_close(sock);
    return up == 1 ? 1 : -1;
}

bool th_file_contains(const char *path, const char *text)
{
    th_daemon_t d = {0};
    snprintf(d.log_path, sizeof d.log_path, "%s", path);
    bool found = th_daemon_log_contains(&d, text);
    if (!found)
        fprintf(stderr, "no '%s' in %s\n", text, path);
    return found;
}

void *th_connect(const char *endpoint, int timeout_ms)
{
    void *sock = th_dealer(timeout_ms);
    zmq_connect(sock, endpoint);
    return sock;
}

void *th_dealer_id(void *ctx, const char *endpoint, const char *id, int timeout_ms)
{
    void *s = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(s, ZMQ_ROUTING_ID, id, strlen(id));
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms);
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_connect(s, endpoint) != 0) {
        zmq_close(s);
        return NULL;
    }
    return s;
}

void *th_dealer(int timeout_ms)
{
    void *sock = zmq_socket(context(), ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(sock, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms);
    zmq_setsockopt(sock, ZMQ_SNDTIMEO, &timeout_ms, sizeof timeout_ms);
    if (curve_keys[0][0]) {
        zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, curve_keys[0], 40);
        zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, curve_keys[1], 40);
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, curve_keys[2], 40);
    }
    return sock;
}

void th_close(void *sock)
{
    if (sock)
        zmq_close(sock);
}

int th_close_and_stop(void *sock, th_daemon_t *d, int timeout_ms)
{
    th_close(sock);
    return th_daemon_stop(d, SIGTERM, timeout_ms);
}

int th_req_socket_ping(const char *endpoint, uint64_t id, int timeout_ms)
{
    void *ctx = zmq_ctx_new();
    void *req_sock = zmq_socket(ctx, ZMQ_REQ);
    int linger = 0, status = -1;
    zmq_setsockopt(req_sock, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms);
    zmq_setsockopt(req_sock, ZMQ_LINGER, &linger, sizeof linger);
    tally_req_t req = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, id);
    uint8_t header[TALLY_REQ_HEADER_SIZE], reply[TALLY_REP_HEADER_SIZE];
    tally_req_encode(&req, header);
    tally_rep_t rep;
    if (zmq_connect(req_sock, endpoint) == 0 &&
        zmq_send(req_sock, header, sizeof header, ZMQ_SNDMORE) == (int)sizeof header &&
        zmq_send(req_sock, "", 0, 0) == 0 &&
        zmq_recv(req_sock, reply, sizeof reply, 0) == TALLY_REP_HEADER_SIZE &&
        tally_rep_decode(reply, sizeof reply, &rep) == TALLY_OK && rep.request_id == id)
        status = (int)rep.status;
    zmq_close(req_sock);
    zmq_ctx_term(ctx);
    return status;
}

int th_send_frames(void *sock, int count, const void *const *data, const size_t *lens)
{
    for (int i = 0; i < count; i++)
        if (zmq_send(sock, data[i], lens[i], i + 1 < count ? ZMQ_SNDMORE : 0) < 0)
            return -1;
    return 0;
}

int th_send_request(void *sock, const tally_req_t *req, const void *payload, size_t len)
{
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(req, header);
    const void *data[2] = {header, payload ? payload : ""};
    size_t lens[2] = {sizeof header, len};
    return th_send_frames(sock, 2, data, lens);
}

int th_recv_reply(void *sock, th_reply_t *reply)
{
    memset(reply, 0, sizeof *reply);
    int ok = 0;
    for (;;) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, sock, 0) < 0) {
            zmq_msg_close(&msg);
            return -1;
        }
        reply->frames++;
        if (reply->frames == 1) {
            ok = tally_rep_decode(zmq_msg_data(&msg), zmq_msg_size(&msg), &reply->rep) == TALLY_OK;
        } else if (reply->frames == 2) {
            reply->len = zmq_msg_size(&msg);
            reply->payload = malloc(reply->len + 1);
            memcpy(reply->payload, zmq_msg_data(&msg), reply->len);
            reply->payload[reply->len] = 0;
        }
        int more = zmq_msg_more(&msg);
        zmq_msg_close(&msg);
        if (!more)
            break;
    }
    return ok && reply->frames == 2 ? 0 : -1;
}

void th_reply_free(th_reply_t *reply)
{
    free(reply->payload);
    memset(reply, 0, sizeof *reply);
}

void *th_nonreader_started(th_daemon_t *d, const char *const *args, int scans, uint64_t first_id,
                           void **other, long long *n_ok, long long *n_busy)
{
    *other = NULL;
    if (th_daemon_start(d, args) != 0)
        return NULL;
    *other = th_connect(d->endpoint, 30000);
    void *peer = th_nonreader_scans(d->endpoint, *other, scans, first_id, n_ok, n_busy);
    if (peer && *n_ok + *n_busy != scans) {
        fprintf(stderr, "%d scans pipelined, %lld answered ok and %lld busy\n", scans, *n_ok,
                *n_busy);
        th_close(peer);
        peer = NULL;
    }
    return peer;
}

long long th_stat_wait_at_most(void *sock, const char *name, long long want, int timeout_ms)
{
    long long v = -1;
    for (int64_t t0 = th_now_ms();
         (v = th_stat(sock, name)) > want && th_now_ms() - t0 < timeout_ms;)
        th_sleep_ms(50);
    return v;
}

void th_daemon_kill(th_daemon_t *d)
{
    if (d->pid > 0)
        th_daemon_stop(d, SIGKILL, 5000);
    d->pid = 0;
}

void th_daemon_end(th_daemon_t *d)
{
    if (d->pid > 0) {
        kill(d->pid, SIGCONT);
        th_daemon_stop(d, SIGTERM, 10000);
    }
    d->pid = 0;
}

void *th_nonreader_scans(const char *endpoint, void *stats, int scans, uint64_t first_id,
                         long long *n_ok, long long *n_busy)
{
    void *peer = th_dealer(30000);
    /* 4 KiB: with 256 KiB (tried 2026-12-03) ZeroMQ writes replies out faster, and a 4-shard
     * ASan run saw tallyd_reply_bytes_peak{scope="peer"} pass the bound: two shards can admit
     * in the moment between a reply's reservation given back and its held bytes counted
     * (td_replies_hand), a race to fix in td_reply.c. */
    int one = 1, small = 4096;
    zmq_setsockopt(peer, ZMQ_RCVHWM, &one, sizeof one);
    zmq_setsockopt(peer, ZMQ_RCVBUF, &small, sizeof small);
    if (zmq_connect(peer, endpoint) != 0) {
        th_close(peer);
        return NULL;
    }
    size_t bytes = 1u << 20;
    int32_t *in = th_random_i32(bytes / 4, -1000, 1000);
    for (int i = 0; i < scans; i++) {
        tally_req_t req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, first_id + (uint64_t)i);
        if (th_send_request(peer, &req, in, bytes) != 0)
            break;
    }
    free(in);
    /* Every scan answered (sent, or queued for the peer), whatever its status. */
    const char *ok = "tallyd_requests_total{op=\"scan\",status=\"ok\"}";
    const char *busy = "tallyd_requests_total{op=\"scan\",status=\"busy\"}";
    *n_ok = *n_busy = 0;
    for (int i = 0; i < 600 && *n_ok + *n_busy < scans; i++, th_sleep_ms(50)) {
        *n_ok = th_stat(stats, ok);
        *n_busy = th_stat(stats, busy);
    }
    return peer;
}

int th_call(void *sock, const tally_req_t *req, const void *payload, size_t len, th_reply_t *reply)
{
    if (th_send_request(sock, req, payload, len) != 0)
        return -1;
    return th_recv_reply(sock, reply);
}

int th_call_reply_status(void *sock, const tally_req_t *req, const void *payload, size_t len,
                         th_reply_t *reply)
{
    if (th_call(sock, req, payload, len, reply) != 0)
        return -1;
    return (int)reply->rep.status;
}

int th_call_status(void *sock, const tally_req_t *req, const void *payload, size_t len)
{
    th_reply_t reply;
    int status = th_call_reply_status(sock, req, payload, len, &reply);
    if (status >= 0)
        th_reply_free(&reply);
    return status;
}

long th_query_raw(void *sock, const char *stream, uint64_t id, uint8_t *out, size_t cap)
{
    tally_req_t q = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, id);
    th_reply_t r;
    if (tally_req_set_stream(&q, stream) != TALLY_OK || th_call(sock, &q, NULL, 0, &r) != 0)
        return -1;
    long len = r.rep.status == TALLY_OK ? (long)r.len : -1;
    if (len >= 0)
        memcpy(out, r.payload, r.len < cap ? r.len : cap);
    th_reply_free(&r);
    return len;
}

bool th_ping(const char *endpoint, int timeout_ms)
{
    void *sock = th_connect(endpoint, timeout_ms);
    tally_req_t req = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, 77);
    th_reply_t reply;
    if (th_call(sock, &req, NULL, 0, &reply) != 0) {
        th_close(sock);
        return false;
    }
    bool ok = reply.rep.status == TALLY_OK && reply.rep.request_id == req.request_id;
    th_reply_free(&reply);
    th_close(sock);
    return ok;
}

long long th_stat(void *sock, const char *name)
{
    tally_req_t req = th_req(TALLY_OP_STATS, TALLY_DTYPE_NONE, 999999);
    th_reply_t reply;
    if (th_call(sock, &req, NULL, 0, &reply) != 0)
        return -1;
    long long value = -1;
    size_t len = strlen(name);
    for (const char *at = strstr((const char *)reply.payload, name); at && value < 0;
         at = strstr(at + 1, name))
        if ((at == (const char *)reply.payload || at[-1] == '\n') && at[len] == ' ')
            value = strtoll(at + len + 1, NULL, 10);
    th_reply_free(&reply);
    return value;
}

bool th_stat_help_says(void *sock, const char *family, const char *words)
{
    tally_req_t req = th_req(TALLY_OP_STATS, TALLY_DTYPE_NONE, 999998);
    th_reply_t reply;
    if (th_call(sock, &req, NULL, 0, &reply) != 0)
        return false;
    char head[160];
    snprintf(head, sizeof head, "# HELP %s ", family);
    const char *help = strstr((const char *)reply.payload, head);
    const char *end = help ? strchr(help, '\n') : NULL;
    const char *at = help ? strstr(help, words) : NULL;
    bool says = at && (!end || at < end);
    th_reply_free(&reply);
    return says;
}

tally_req_t th_req(uint8_t opcode, uint8_t dtype, uint64_t id)
{
    tally_req_t req;
    memset(&req, 0, sizeof req);
    req.version = TALLY_PROTO_VERSION;
    req.opcode = opcode;
    req.dtype = dtype;
    req.request_id = id;
    return req;
}

size_t th_frame(tally_req_t req, const char *stream, const void *payload, size_t len, uint8_t *out)
{
    if (stream && tally_req_set_stream(&req, stream) != TALLY_OK)
        return 0;
    tally_req_encode(&req, out);
    if (len)
        memcpy(out + TALLY_REQ_HEADER_SIZE, payload, len);
    return TALLY_REQ_HEADER_SIZE + len;
}

static uint64_t rng_state;

uint64_t th_seed(void)
{
    const char *env = getenv("TALLY_TEST_SEED");
    uint64_t seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) ^ (uint64_t)getpid() << 20;
    if (!seed)
        seed = 1;
    rng_state = seed;
    fprintf(stderr, "seed %llu (set TALLY_TEST_SEED to reproduce)\n", (unsigned long long)seed);
    return seed;
}

uint64_t th_rand(void)
{
    if (!rng_state)
        rng_state = 88172645463325252ull;
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

int32_t *th_random_i32(size_t n, int64_t lo, int64_t hi)
{
    int32_t *x = malloc(4 * n + 4);
    if (!x)
        abort(); /* a failed test, as an assertion would be */
    for (size_t i = 0; i < n; i++)
        x[i] = (int32_t)(lo + (int64_t)(th_rand() % (uint64_t)(hi - lo + 1)));
    return x;
}

int th_cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

int th_cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

const char *th_tally_bin(void)
{
    const char *bin = getenv("TALLY_BIN");
    return bin && *bin ? bin : "./cli/tally";
}

int th_tmpdir(char *dir, size_t cap, const char *prefix)
{
    int n = snprintf(dir, cap, "/tmp/%s-XXXXXX", prefix);
    if (n < 0 || (size_t)n >= cap)
        return -1;
    return mkdtemp(dir) ? 0 : -1;
}

int th_rmrf(const char *dir)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd) == 0 ? 0 : -1;
}

int th_daemon_teardown(th_daemon_t *d, int timeout_ms, const char *dir)
{
    int status = th_daemon_stop(d, SIGTERM, timeout_ms);
    if (th_rmrf(dir) != 0)
        return -1;
    return status == 0 ? 0 : -1;
}

char *th_slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, len = 0, n;
    char *buf = malloc(cap);
    while (buf && (n = fread(buf + len, 1, cap - len - 1, f)) > 0) {
        len += n;
        if (cap - len < 2) {
            char *more = realloc(buf, cap *= 2);
            if (!more)
                free(buf);
            buf = more;
        }
    }
    fclose(f);
    if (buf)
        buf[len] = '\0';
    return buf;
}

int th_write_file(const char *dir, const char *name, const void *data, size_t len)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    int rc = fwrite(data, 1, len, f) == len ? 0 : -1;
    return fclose(f) == 0 ? rc : -1;
}

int th_tcp_connect_from(const char *src, int port)
{
    bool v6 = src && strchr(src, ':');
    int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_storage ss = {0};
    struct sockaddr_in *in = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)&ss;
    socklen_t len = v6 ? sizeof *in6 : sizeof *in;
    ss.ss_family = v6 ? AF_INET6 : AF_INET;
    if (src && (inet_pton(ss.ss_family, src, v6 ? (void *)&in6->sin6_addr : &in->sin_addr) != 1 ||
                bind(fd, (struct sockaddr *)&ss, len) != 0))
        goto fail;
    if (v6) {
        in6->sin6_port = htons((uint16_t)port);
        in6->sin6_addr = in6addr_loopback;
    } else {
        in->sin_port = htons((uint16_t)port);
        in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    }
    if (connect(fd, (struct sockaddr *)&ss, len) != 0)
        goto fail;
    return fd;
fail:
    close(fd);
    return -1;
}

char *th_http_exchange(int port, const char *src, const char *request, int timeout_ms)
{
    int fd = th_tcp_connect_from(src, port);
    if (fd < 0)
        return NULL;
    size_t cap = 1 << 16, len = 0, n = strlen(request);
    char *buf = malloc(cap);
    if (!buf || write(fd, request, n) != (ssize_t)n) {
        free(buf);
        close(fd);
        return NULL;
    }
    int64_t end = th_now_ms() + timeout_ms;
    bool complete = false;
    while (!complete) {
        if (len + 1 >= cap) {
            char *bigger = realloc(buf, cap *= 2);
            if (!bigger)
                break;
            buf = bigger;
        }
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int left = timeout_ms < 0 ? -1 : (int)(end - th_now_ms());
        if (timeout_ms >= 0 && (left <= 0 || poll(&p, 1, left) != 1))
            break;
        ssize_t got = read(fd, buf + len, cap - len - 1);
        complete = got <= 0;
        len += got > 0 ? (size_t)got : 0;
    }
    buf[len] = '\0';
    close(fd);
    if (!complete) {
        free(buf);
        return NULL;
    }
    return buf;
}

char *th_http_get(int port, const char *method, const char *path, const char *headers)
{
    char req[1024];
    snprintf(req, sizeof req, "%s %s HTTP/1.0\r\nHost: 127.0.0.1\r\n%s\r\n", method, path,
             headers ? headers : "");
    return th_http_exchange(port, NULL, req, -1);
}

int th_metrics_port(const th_daemon_t *d)
{
    static const char mark[] = "metrics: serving http://"; /* then ADDRESS:PORT/metrics */
    FILE *f = fopen(d->log_path, "r");
    if (!f)
        return -1;
    char line[512];
    int port = -1;
    while (fgets(line, sizeof line, f)) {
        const char *at = strstr(line, mark);
        const char *slash = at ? strchr(at + strlen(mark), '/') : NULL;
        const char *colon = slash ? memrchr(at, ':', (size_t)(slash - at)) : NULL;
        if (colon)
            port = atoi(colon + 1);
    }
    fclose(f);
    return port;
}

long long th_metric(const th_daemon_t *d, const char *name)
{
    int port = th_metrics_port(d);
    char *body = port > 0 ? th_http_get(port, "GET", "/metrics", NULL) : NULL;
    long long v = -1;
    size_t n = strlen(name);
    for (const char *at = body; at && (at = strstr(at, name)) != NULL; at += n)
        if ((at == body || at[-1] == '\n') && at[n] == ' ') {
            v = atoll(at + n + 1);
            break;
        }
    free(body);
    return v;
}

int th_sh(const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    int status = system(cmd);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int th_write_key_file(const char *path, const char *pub, const char *sec, mode_t mode)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, mode);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    fprintf(f, "#   ZeroMQ CURVE certificate\nmetadata\ncurve\n");
    if (pub)
        fprintf(f, "    public-key = \"%s\"\n", pub);
    if (sec)
        fprintf(f, "    secret-key = \"%s\"\n", sec);
    int rc = fclose(f) == 0 ? 0 : -1;
    return rc == 0 ? chmod(path, mode) : -1;
}

int th_curve_dir(const char *dir, const char *client, char server_pub[41], char server_sec[41],
                 char client_pub[41], char client_sec[41], char *server_key, char *clients,
                 size_t cap)
{
    char path[512];
    snprintf(server_key, cap, "%s/server.key", dir);
    snprintf(clients, cap, "%s/clients", dir);
    snprintf(path, sizeof path, "%s/%s.pub", clients, client);
    if (zmq_curve_keypair(server_pub, server_sec) != 0 ||
        zmq_curve_keypair(client_pub, client_sec) != 0 ||
        th_write_key_file(server_key, server_pub, server_sec, 0600) != 0 ||
        mkdir(clients, 0700) != 0)
        return -1;
    return th_write_key_file(path, client_pub, NULL, 0644);
}

int th_write_clock(const char *path, uint64_t ms)
{
    char tmp[512];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f)
        return -1;
    fprintf(f, "%llu\n", (unsigned long long)ms);
    if (fclose(f) != 0)
        return -1;
    return rename(tmp, path); /* a daemon never reads half a number */
}

int64_t th_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void th_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

th_cli_t th_cli(const char *dir, const char *endpoint, const char *fmt, ...)
{
    char args[2048], cmd[4096], path[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "cd '%s' && '%s' -e '%s' %s > cli.out 2> cli.err", dir,
             th_tally_bin(), endpoint, args);
    int rc = system(cmd);
    th_cli_t r = {.status = rc != -1 && WIFEXITED(rc) ? WEXITSTATUS(rc) : -1};
    snprintf(path, sizeof path, "%s/cli.out", dir);
    r.out = th_slurp(path);
    snprintf(path, sizeof path, "%s/cli.err", dir);
    r.err = th_slurp(path);
    if (!r.out)
        r.out = strdup("");
    if (!r.err)
        r.err = strdup("");
    return r;
}

void th_cli_free(th_cli_t *r)
{
    free(r->out);
    free(r->err);
    r->out = r->err = NULL;
}

bool th_u64s_equal(const uint8_t *le, size_t len, const uint64_t *expect, size_t n)
{
    if (len != 8 * n) {
        fprintf(stderr, "%zu bytes, expected %zu uint64_t (%zu bytes)\n", len, n, 8 * n);
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        if (tally_get_u64(le + 8 * i) != expect[i]) {
            fprintf(stderr, "value %zu is %" PRIu64 ", expected %" PRIu64 "\n", i,
                    tally_get_u64(le + 8 * i), expect[i]);
            return false;
        }
    }
    return true;
}
