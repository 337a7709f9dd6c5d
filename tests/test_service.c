/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_service.c — tallyd as a service, end to end against the real binary: readiness,
 * status, watchdog and stopping notifications to a NOTIFY_SOCKET the test reads; socket
 * activation with sockets the test binds and passes as LISTEN_FDS; stream state kept across a
 * clean restart and across kill -9; damaged state files (a bad record loses only its stream, a
 * bad header sets the file aside); state write failures (periodic: warned, counted, retried;
 * final: exit 1); a state file that is not a regular file refused at start; the configuration file
 * (errors with FILE:LINE, precedence under the command line) and SIGHUP reload; the HTTP
 * metrics endpoint scraped and parsed, and compared with `stats` and `tally stats`.
 *
 * tallyd is started here rather than through th_daemon_start because these tests need to set
 * its environment and file descriptors; the harness's stop, log and socket helpers are reused.
 */
#include <arpa/inet.h>
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <poll.h>
#include <regex.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include <cmocka.h>

#include "harness.h"
#include "tally.h"
#include "tally_keys.h"
#include "td_state.h" /* the state file layout, to damage it precisely */

#define MAX_ENV 8
#define MAX_FDS 4

typedef struct {
    const char *env[MAX_ENV]; /* "NAME=value" */
    int fds[MAX_FDS];         /* passed as LISTEN_FDS (3, 4, ...) */
    int nfds;
    bool watchdog; /* WATCHDOG_USEC=2000000 and WATCHDOG_PID=<tallyd's pid> */
    bool no_bind;  /* do not add --bind (socket activation) */
    bool no_wait;  /* do not wait for a ping (the start is expected to fail) */
    bool journal;  /* JOURNAL_STREAM names its stderr, as systemd's does the journal's */
} spawn_opts_t;

static char scratch[80];  /* a per-run directory for state, configs and sockets */
static pid_t spawned[64]; /* every tallyd started, so a failed test leaves none running */
static int spawned_count;

static bool ping(const char *endpoint, int timeout_ms)
{
    return th_ping(endpoint, timeout_ms);
}

/* Waits for d's "ready" line, as th_await_pong waits for a pong: 1, 0 when it exited first
 * (reaped: *status), -1 after TH_START_WAIT_MS. */
static int await_ready_line(const th_daemon_t *d, int *status)
{
    for (int64_t t0 = th_now_ms(); th_now_ms() - t0 < TH_START_WAIT_MS; usleep(20000)) {
        if (th_daemon_log_contains(d, "ready"))
            return 1;
        if (waitpid(d->pid, status, WNOHANG) == d->pid)
            return 0;
    }
    return -1;
}

/* In the child: moves the fds to 3.. and sets the variables systemd would. */
static void child_setup(const spawn_opts_t *o)
{
    char value[48];
    struct stat st;
    if (o->journal && fstat(STDERR_FILENO, &st) == 0) {
        snprintf(value, sizeof value, "%llu:%llu", (unsigned long long)st.st_dev,
                 (unsigned long long)st.st_ino);
        setenv("JOURNAL_STREAM", value, 1);
    } else {
        unsetenv("JOURNAL_STREAM"); /* a test run as a service has its own */
    }
    for (int i = 0; i < MAX_ENV && o->env[i]; i++)
        putenv((char *)o->env[i]);
    int high[MAX_FDS];
    for (int i = 0; i < o->nfds; i++)
        high[i] = fcntl(o->fds[i], F_DUPFD, 100);
    for (int i = 0; i < o->nfds; i++) {
        dup2(high[i], 3 + i);
        close(high[i]);
    }
    if (o->nfds) {
        snprintf(value, sizeof value, "%d", o->nfds);
        setenv("LISTEN_FDS", value, 1);
        snprintf(value, sizeof value, "%d", (int)getpid()); /* must be tallyd's own pid */
        setenv("LISTEN_PID", value, 1);
    }
    if (o->watchdog) {
        setenv("WATCHDOG_USEC", "2000000", 1);
        snprintf(value, sizeof value, "%d", (int)getpid());
        setenv("WATCHDOG_PID", value, 1);
    }
}

static void child_setup_of(const void *o)
{
    child_setup(o);
}

/* One start of spawn's: 0, -1, or 1 when tallyd could not bind its TCP port (another process
 * took it after th_free_port chose it) and another port is to be tried. */
static int spawn_once(th_daemon_t *d, const char *const *args, const spawn_opts_t *o)
{
    static int serial;
    memset(d, 0, sizeof *d);
    ++serial;
    if (o->no_wait) { /* expected to fail: an ipc:// endpoint, which no other process takes */
        snprintf(d->endpoint, sizeof d->endpoint, "ipc://%s/tallyd-%d.sock", scratch, serial);
    } else {
        d->port = th_free_port();
        snprintf(d->endpoint, sizeof d->endpoint, "tcp://127.0.0.1:%d", d->port);
    }
    snprintf(d->log_path, sizeof d->log_path, "%s/tallyd-%d.log", scratch, serial);
    const char *argv[48];
    int argc = 0;
    argv[argc++] = th_tallyd_bin();
    if (!o->no_bind) {
        argv[argc++] = "--bind";
        argv[argc++] = d->endpoint;
    }
    argv[argc++] = "--backend";
    argv[argc++] = "cpu";
    /* A side channel of its own: the default path may be another test run's tallyd's. */
    snprintf(d->shm_socket, sizeof d->shm_socket, "%s/shm-%d.sock", scratch, serial);
    argv[argc++] = "--shm-socket";
    argv[argc++] = d->shm_socket;
    for (int i = 0; args && args[i] && argc < 46; i++)
        argv[argc++] = args[i];
    argv[argc] = NULL;
    /* its stdout in the log too: never CTest's output pipe held open */
    pid_t pid = th_spawn(argv, d->log_path, true, child_setup_of, o);
    if (pid < 0)
        return -1;
    d->pid = pid;
    if (spawned_count < (int)(sizeof spawned / sizeof spawned[0]))
        spawned[spawned_count++] = pid;
    if (o->no_wait)
        return 0;
    /* Up once it answers a ping; without --bind (sockets from "systemd"), once it says so. */
    int status;
    int up = o->no_bind ? await_ready_line(d, &status)
                        : th_await_pong(d->endpoint, pid, d->log_path, TH_START_WAIT_MS, &status);
    if (up == 1)
        return 0;
    if (up == 0)
        d->pid = 0;
    else
        th_daemon_stop(d, SIGKILL, 1000);
    char taken[200];
    snprintf(taken, sizeof taken, "cannot bind %s: Address already in use", d->endpoint);
    if (!o->no_bind && th_daemon_log_contains(d, taken))
        return 1;
    fprintf(stderr, "tallyd %s (log %s)\n", up == 0 ? "exited early" : "did not start",
            d->log_path);
    return -1;
}

/* Starts tallyd with args (NULL-terminated) and, unless no_bind, --bind on a free port (an
 * ipc:// path in scratch when no_wait: a start expected to fail); waits for it to answer a ping
 * unless no_wait, starting it again on another port when another process took the first.
 * Returns 0 or -1. */
static int spawn(th_daemon_t *d, const char *const *args, const spawn_opts_t *o)
{
    static const spawn_opts_t none = {.nfds = 0};
    int rc = 1;
    for (int attempt = 0; attempt < 5 && rc == 1; attempt++)
        rc = spawn_once(d, args, o ? o : &none);
    return rc == 0 ? 0 : -1;
}

/* Waits up to timeout_ms for the log to contain text. */
static bool log_waits_for(const th_daemon_t *d, const char *text, int timeout_ms)
{
    for (int waited = 0; waited <= timeout_ms; waited += 20) {
        if (th_daemon_log_contains(d, text))
            return true;
        usleep(20000);
    }
    fprintf(stderr, "log %s lacks '%s'\n", d->log_path, text);
    return false;
}

/* tallyd started with args must exit non-zero before it is ready, and log `says` at err. */
static void assert_start_fails(const char *const *args, const char *says)
{
    spawn_opts_t o = {.no_wait = true};
    th_daemon_t d;
    assert_int_equal(spawn(&d, args, &o), 0);
    int status = 0;
    assert_int_equal(waitpid(d.pid, &status, 0), d.pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) != 0);
    assert_true(th_daemon_log_contains(&d, says));
    assert_true(th_daemon_log_contains(&d, "<3>"));
    assert_false(th_daemon_log_contains(&d, "ready"));
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* ---- protocol helpers ------------------------------------------------------------------- */

/* Closes sock and stops d, which must exit 0. */
static void close_and_stop(th_daemon_t *d, void *sock)
{
    assert_int_equal(th_close_and_stop(sock, d, 10000), 0);
}

static void *connect_to(const th_daemon_t *d)
{
    return th_connect(d->endpoint, 5000);
}

static void send_hist_u8(void *sock, const char *stream, const uint8_t *data, size_t n)
{
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 11);
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    th_reply_t reply;
    assert_int_equal(th_call_reply_status(sock, &req, data, n, &reply), TALLY_OK);
    th_reply_free(&reply);
}

/* Scans values on a stream; returns the int64 prefix sums (malloc'ed). */
static int64_t *send_scan(void *sock, const char *stream, const int32_t *values, size_t n)
{
    tally_req_t req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, 12);
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    th_reply_t reply;
    assert_int_equal(th_call_reply_status(sock, &req, values, n * sizeof *values, &reply),
                     TALLY_OK);
    assert_int_equal(reply.len, n * sizeof(int64_t));
    int64_t *out = malloc(reply.len + 1);
    memcpy(out, reply.payload, reply.len);
    th_reply_free(&reply);
    return out;
}

/* The query payload of a stream (TALLY_QUERY_PAYLOAD_SIZE bytes), or status when not OK. */
static uint32_t query(void *sock, const char *stream, uint8_t out[TALLY_QUERY_PAYLOAD_SIZE])
{
    tally_req_t req = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, 13);
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    th_reply_t reply;
    assert_int_equal(th_call(sock, &req, NULL, 0, &reply), 0);
    uint32_t status = reply.rep.status;
    if (status == TALLY_OK) {
        assert_int_equal(reply.len, TALLY_QUERY_PAYLOAD_SIZE);
        memcpy(out, reply.payload, TALLY_QUERY_PAYLOAD_SIZE);
    }
    th_reply_free(&reply);
    return status;
}

/* The `info` or `stats` text (malloc'ed). */
static char *text_op(void *sock, uint8_t opcode)
{
    tally_req_t req = th_req(opcode, TALLY_DTYPE_NONE, 14);
    th_reply_t reply;
    assert_int_equal(th_call_reply_status(sock, &req, NULL, 0, &reply), TALLY_OK);
    char *text = (char *)reply.payload; /* NUL-terminated by the harness */
    reply.payload = NULL;
    th_reply_free(&reply);
    return text;
}

/* ---- notifications ---------------------------------------------------------------------- */

static int notify_socket(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    assert_true(fd >= 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
    unlink(path);
    assert_int_equal(bind(fd, (struct sockaddr *)&addr, sizeof addr), 0);
    return fd;
}

/* Reads datagrams until one contains `want` (appending all to log); false on timeout. */
static bool notify_wait(int fd, const char *want, int timeout_ms, char *last, size_t cap)
{
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        long left = timeout_ms -
                    ((now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000);
        if (left <= 0)
            return false;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, (int)left) <= 0)
            continue;
        ssize_t n = recv(fd, last, cap - 1, 0);
        if (n < 0)
            continue;
        last[n] = '\0';
        if (strstr(last, want))
            return true;
    }
}

/* Starts d with NOTIFY_SOCKET at scratch/name (path receives it, 300 bytes), with
 * WATCHDOG_USEC when watchdog; the socket's fd. */
static int spawn_notified(th_daemon_t *d, const char *name, bool watchdog, char *path)
{
    char env[320];
    snprintf(path, 300, "%s/%s", scratch, name);
    snprintf(env, sizeof env, "NOTIFY_SOCKET=%s", path);
    int fd = notify_socket(path);
    spawn_opts_t o = {.env = {env}, .watchdog = watchdog};
    assert_int_equal(spawn(d, NULL, &o), 0);
    return fd;
}

static void test_notify_ready_status_watchdog_stopping(void **state)
{
    (void)state;
    char path[300], msg[1024];
    th_daemon_t d;
    int fd = spawn_notified(&d, "notify.sock", true, path);

    assert_true(notify_wait(fd, "READY=1", 5000, msg, sizeof msg));
    assert_non_null(strstr(msg, "STATUS=serving on cpu"));
    /* WatchdogSec=2 s: tallyd pings every second from its loop. (Not faster: the kernel
     * queues only net.unix.max_dgram_qlen datagrams, often 10, and a sender to a full queue
     * blocks; systemd drains it at once, this test only between its checks.) */
    assert_true(notify_wait(fd, "WATCHDOG=1", 3000, msg, sizeof msg));
    assert_true(notify_wait(fd, "WATCHDOG=1", 3000, msg, sizeof msg));
    assert_true(th_daemon_log_contains(&d, "systemd watchdog: pinging every 1000 ms"));

    kill(d.pid, SIGTERM);
    assert_true(notify_wait(fd, "STOPPING=1", 5000, msg, sizeof msg));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    close(fd);
    unlink(path);
}

static void test_status_line_refreshes(void **state)
{
    (void)state;
    char path[300], msg[1024];
    th_daemon_t d;
    int fd = spawn_notified(&d, "notify2.sock", false, path);
    assert_true(notify_wait(fd, "READY=1", 5000, msg, sizeof msg));
    /* The periodic STATUS= line (every 5 s) counts the pings answered since. */
    assert_true(notify_wait(fd, "requests answered", 8000, msg, sizeof msg));
    assert_null(strstr(msg, "READY=1"));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    close(fd);
    unlink(path);
}

/* ---- the log ---------------------------------------------------------------------------- */

/* Every line of d's log matches re (extended); at least one line. */
static void assert_log_lines(const th_daemon_t *d, const char *re)
{
    regex_t rx;
    assert_int_equal(regcomp(&rx, re, REG_EXTENDED | REG_NOSUB), 0);
    char *log = th_slurp(d->log_path);
    assert_non_null(log);
    int lines = 0;
    for (char *line = strtok(log, "\n"); line; line = strtok(NULL, "\n"), lines++)
        if (regexec(&rx, line, 0, NULL, 0) != 0)
            fail_msg("log line '%s' does not match %s", line, re);
    assert_true(lines > 0);
    free(log);
    regfree(&rx);
}

/* Where stderr is not the journal (JOURNAL_STREAM unset, or another stream's), each log line
 * starts with the local time to the millisecond; where it is, with the priority alone (the
 * journal keeps the time). */
static void test_log_time_unless_journal(void **state)
{
    (void)state;
    const char *timed = "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}"
                        "[+-][0-9]{2}:[0-9]{2} <[3-7]>[^<]";
    th_daemon_t d;
    assert_int_equal(spawn(&d, NULL, NULL), 0);
    assert_true(log_waits_for(&d, "<6>listening on ", 5000));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    assert_log_lines(&d, timed);

    spawn_opts_t o = {.env = {"JOURNAL_STREAM=1:1"}}; /* a journal's stream, not stderr */
    assert_int_equal(spawn(&d, NULL, &o), 0);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    assert_log_lines(&d, timed);

    spawn_opts_t j = {.journal = true};
    assert_int_equal(spawn(&d, NULL, &j), 0);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    assert_log_lines(&d, "^<[3-7]>[^<]");
}

/* ---- socket activation ------------------------------------------------------------------ */

/* A listening TCP socket on addr (INADDR_LOOPBACK, or INADDR_ANY as a .socket unit with
 * ListenStream=5555 makes) and a free port, which *port receives. */
static int listen_tcp(in_addr_t addr, int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in in = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(addr)};
    socklen_t len = sizeof in;
    assert_int_equal(bind(fd, (struct sockaddr *)&in, sizeof in), 0);
    assert_int_equal(listen(fd, 16), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&in, &len), 0);
    *port = ntohs(in.sin_port);
    return fd;
}

/* A listening Unix socket at scratch/name, whose address un receives. */
static int listen_unix(const char *name, struct sockaddr_un *un)
{
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    *un = (struct sockaddr_un){.sun_family = AF_UNIX};
    snprintf(un->sun_path, sizeof un->sun_path, "%s/%s", scratch, name);
    unlink(un->sun_path);
    assert_int_equal(bind(fd, (struct sockaddr *)un, sizeof *un), 0);
    assert_int_equal(listen(fd, 16), 0);
    return fd;
}

static void test_socket_activation_tcp_and_ipc(void **state)
{
    (void)state;
    int port;
    int tcp = listen_tcp(INADDR_LOOPBACK, &port);
    struct sockaddr_un un;
    int unx = listen_unix("tallyd.sock", &un);

    spawn_opts_t o = {.fds = {tcp, unx}, .nfds = 2, .no_bind = true};
    th_daemon_t d;
    assert_int_equal(spawn(&d, NULL, &o), 0);
    close(tcp); /* tallyd holds them now */
    close(unx);

    char tcp_ep[64], ipc_ep[300];
    snprintf(tcp_ep, sizeof tcp_ep, "tcp://127.0.0.1:%d", port);
    snprintf(ipc_ep, sizeof ipc_ep, "ipc://%s", un.sun_path);
    assert_true(ping(tcp_ep, 5000));
    assert_true(ping(ipc_ep, 5000));
    char line[400];
    snprintf(line, sizeof line, "listening on %s (socket fd 3 from systemd)", tcp_ep);
    assert_true(th_daemon_log_contains(&d, line));
    snprintf(line, sizeof line, "listening on %s (socket fd 4 from systemd)", ipc_ep);
    assert_true(th_daemon_log_contains(&d, line));
    /* With sockets passed and no --bind, the default endpoint is not bound. */
    assert_false(th_daemon_log_contains(&d, "listening on "
                                            "tcp://127.0.0.1:5555\n"));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    /* The socket file belongs to whoever created it (systemd): tallyd leaves it. */
    struct stat sb;
    assert_int_equal(stat(un.sun_path, &sb), 0);
    unlink(un.sun_path);
}

static void make_dir(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/%s", scratch, name);
    mkdir(out, 0700);
}

/* Passed sockets obey protected mode (one on 0.0.0.0 without CURVE stops tallyd) and take
 * CURVE like bound ones: a client with an allowed key is served over them, one without keys is
 * not. */
static void test_socket_activation_protected_and_curve(void **state)
{
    (void)state;
    int port;
    int any = listen_tcp(INADDR_ANY, &port);
    spawn_opts_t o = {.fds = {any}, .nfds = 1, .no_bind = true, .no_wait = true};
    th_daemon_t d;
    assert_int_equal(spawn(&d, NULL, &o), 0);
    int status = 0;
    assert_int_equal(waitpid(d.pid, &status, 0), d.pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) != 0);
    assert_true(th_daemon_log_contains(&d, "protected mode: refusing to listen on tcp://0.0.0.0"));

    char base[200], client_base[240], clients[200], key[260], msg[256];
    char server_pub[41], client_pub[41], client_sec[41];
    snprintf(base, sizeof base, "%s/sa-server", scratch);
    make_dir(clients, sizeof clients, "sa-clients");
    snprintf(client_base, sizeof client_base, "%s/producer", clients);
    assert_int_equal(tally_keygen(base, server_pub, msg, sizeof msg), TALLY_OK);
    assert_int_equal(tally_keygen(client_base, NULL, msg, sizeof msg), TALLY_OK);
    snprintf(key, sizeof key, "%s.key", client_base);
    assert_int_equal(tally_key_file_read(key, true, client_pub, client_sec, msg, sizeof msg),
                     TALLY_OK);
    snprintf(key, sizeof key, "%s.key", base);

    struct sockaddr_un un;
    int unx = listen_unix("curve.sock", &un);
    spawn_opts_t oc = {.fds = {any, unx}, .nfds = 2, .no_bind = true};
    const char *args[] = {"--curve-secret-key", key, "--curve-clients-dir", clients, NULL};
    assert_int_equal(spawn(&d, args, &oc), 0);
    close(any);
    close(unx);
    char tcp_ep[64], ipc_ep[300];
    snprintf(tcp_ep, sizeof tcp_ep, "tcp://127.0.0.1:%d", port);
    snprintf(ipc_ep, sizeof ipc_ep, "ipc://%s", un.sun_path);
    assert_false(ping(tcp_ep, 500)); /* no keys */
    th_use_curve(server_pub, client_pub, client_sec);
    bool tcp_ok = ping(tcp_ep, 5000), ipc_ok = ping(ipc_ep, 5000);
    th_use_curve(NULL, NULL, NULL);
    assert_true(tcp_ok);
    assert_true(ipc_ok);
    assert_true(th_daemon_log_contains(&d, "curve: client 'producer' connected"));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    unlink(un.sun_path);
}

/* tallyd started with args and the passed sockets fds (no --bind of the test's own) must exit
 * non-zero before it is ready, and log `says`. */
static void assert_passed_start_fails(const char *const *args, int *fds, int nfds, const char *says)
{
    spawn_opts_t o = {.nfds = nfds, .no_bind = true, .no_wait = true};
    for (int i = 0; i < nfds; i++)
        o.fds[i] = fds[i];
    th_daemon_t d;
    assert_int_equal(spawn(&d, args, &o), 0);
    int status = 0;
    assert_int_equal(waitpid(d.pid, &status, 0), d.pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 1);
    assert_true(log_waits_for(&d, says, 0));
    assert_false(th_daemon_log_contains(&d, " ready: ")); /* not "already in use" */
}

/* tallyd.socket enabled beside a `bind` of the same address in tallyd.conf: the bind would fail
 * ("Address already in use"), or for ipc take the path from under systemd's socket. tallyd says
 * which socket holds it and what to remove, and leaves the path alone; a port some other program
 * holds gets a hint of its own. */
static void test_socket_activation_bind_collides(void **state)
{
    (void)state;
    int port;
    int tcp = listen_tcp(INADDR_LOOPBACK, &port);
    char bind[64], says[200];
    snprintf(bind, sizeof bind, "tcp://127.0.0.1:%d", port);
    const char *args[] = {"--bind", bind, NULL};
    snprintf(says, sizeof says,
             "<3>cannot bind %s: systemd passed tallyd a socket on this address (fd 3, a "
             "ListenStream= of tallyd.socket)",
             bind);
    assert_passed_start_fails(args, &tcp, 1, says);
    assert_passed_start_fails(args, &tcp, 1,
                              "remove this bind (`bind` in tallyd.conf, or "
                              "--bind), or stop passing the socket (`systemctl "
                              "disable --now tallyd.socket`)");
    snprintf(bind, sizeof bind, "tcp://*:%d", port); /* the wildcard takes the loopback too */
    const char *any_args[] = {"--bind", bind, "--protected-mode", "off", NULL};
    assert_passed_start_fails(any_args, &tcp, 1, "a socket on this address (fd 3,");

    struct sockaddr_un un;
    int unx = listen_unix("held.sock", &un);
    char ipc[300];
    snprintf(ipc, sizeof ipc, "ipc://%s", un.sun_path);
    const char *ipc_args[] = {"--bind", ipc, NULL};
    int both[] = {tcp, unx};
    assert_passed_start_fails(ipc_args, both, 2, "a socket on this address (fd 4,");
    struct stat sb;
    assert_int_equal(stat(un.sun_path, &sb), 0); /* still systemd's socket */
    int client = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_int_equal(connect(client, (struct sockaddr *)&un, sizeof un), 0);
    close(client);
    close(unx);
    unlink(un.sun_path);

    /* Nothing passed, the port some other program's: the hint names the tool to find it. */
    snprintf(bind, sizeof bind, "tcp://127.0.0.1:%d", port);
    snprintf(says, sizeof says,
             "<3>cannot bind %s: Address already in use (another program listens there, perhaps "
             "another tallyd: `ss -ltnp 'sport = :%d'` names it",
             bind, port);
    assert_passed_start_fails(args, NULL, 0, says);
    close(tcp);
}

/* A datagram socket among those passed: tallyd refuses to start at it, naming its fd, and
 * adopts none of the sockets after it. */
static void test_socket_activation_rejects_datagram_socket(void **state)
{
    (void)state;
    int udp = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in in = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(udp, (struct sockaddr *)&in, sizeof in), 0);
    int port;
    int tcp = listen_tcp(INADDR_LOOPBACK, &port);
    spawn_opts_t o = {.fds = {udp, tcp}, .nfds = 2, .no_bind = true, .no_wait = true};
    th_daemon_t d;
    assert_int_equal(spawn(&d, NULL, &o), 0);
    close(udp);
    close(tcp);
    int status = 0;
    assert_int_equal(waitpid(d.pid, &status, 0), d.pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) != 0);
    assert_true(th_daemon_log_contains(&d, "fd 3 is not a listening stream socket"));
    assert_false(th_daemon_log_contains(&d, "(socket fd 4 from systemd)"));
}

/* A passed IPv6 socket ([::1], as ListenStream=[::1]:PORT makes): adopted as tcp://[::1]:PORT
 * and served. Skipped, with a message, where the box has no IPv6 loopback. */
static void test_socket_activation_ipv6(void **state)
{
    (void)state;
    int fd = socket(AF_INET6, SOCK_STREAM, 0);
    struct sockaddr_in6 in6 = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    socklen_t len = sizeof in6;
    if (fd < 0 || bind(fd, (struct sockaddr *)&in6, sizeof in6) != 0) {
        if (fd >= 0)
            close(fd);
        print_message("no IPv6 loopback ([::1] cannot be bound): test skipped\n");
        skip();
    }
    assert_int_equal(listen(fd, 16), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&in6, &len), 0);
    spawn_opts_t o = {.fds = {fd}, .nfds = 1, .no_bind = true};
    th_daemon_t d;
    char endpoint[64];
    snprintf(endpoint, sizeof endpoint, "tcp://[::1]:%d", ntohs(in6.sin6_port));
    assert_int_equal(spawn(&d, NULL, &o), 0);
    close(fd);
    void *sock = th_dealer(5000); /* a client of tcp://[::1] sets ZMQ_IPV6 as tallyd does */
    int one = 1;
    assert_int_equal(zmq_setsockopt(sock, ZMQ_IPV6, &one, sizeof one), 0);
    assert_int_equal(zmq_connect(sock, endpoint), 0);
    tally_req_t req = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, 6);
    th_reply_t reply;
    assert_int_equal(th_call(sock, &req, NULL, 0, &reply), 0);
    assert_int_equal(reply.rep.status, TALLY_OK);
    assert_int_equal(reply.rep.request_id, 6);
    th_reply_free(&reply);
    th_close(sock);
    char line[128];
    snprintf(line, sizeof line, "listening on %s (socket fd 3 from systemd)", endpoint);
    assert_true(th_daemon_log_contains(&d, line));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* ---- persistent state ------------------------------------------------------------------- */

/* A state directory and the command line that names it, for every start of a test's daemon. */
typedef struct {
    char dir[300];
    char file[400];      /* dir/streams.state */
    const char *args[3]; /* --state-dir dir */
} state_dir_t;

/* Makes scratch/name the state directory s and starts d on it. */
static void spawn_with_state(th_daemon_t *d, state_dir_t *s, const char *name)
{
    make_dir(s->dir, sizeof s->dir, name);
    snprintf(s->file, sizeof s->file, "%s/streams.state", s->dir);
    s->args[0] = "--state-dir";
    s->args[1] = s->dir;
    s->args[2] = NULL;
    assert_int_equal(spawn(d, s->args, NULL), 0);
}

/* Fills streams cam0 (u8 histogram) and s1 (a scan over 1..n) on a daemon. */
static void fill_streams(const th_daemon_t *d, int32_t *scan_values, size_t n)
{
    void *sock = connect_to(d);
    uint8_t bytes[1000];
    for (size_t i = 0; i < sizeof bytes; i++)
        bytes[i] = (uint8_t)(th_rand() % 7 * 37);
    send_hist_u8(sock, "cam0", bytes, sizeof bytes);
    send_hist_u8(sock, "cam0", bytes, 333);
    free(send_scan(sock, "s1", scan_values, n));
    th_close(sock);
}

/* The records of fill_streams' two streams, then a clean stop. */
static void query_fill_streams_and_stop(th_daemon_t *d, uint8_t cam0[TALLY_QUERY_PAYLOAD_SIZE],
                                        uint8_t s1[TALLY_QUERY_PAYLOAD_SIZE])
{
    void *sock = connect_to(d);
    assert_int_equal(query(sock, "cam0", cam0), TALLY_OK);
    assert_int_equal(query(sock, "s1", s1), TALLY_OK);
    close_and_stop(d, sock);
}

static void test_state_survives_clean_restart(void **state)
{
    (void)state;
    state_dir_t s;
    th_daemon_t d;
    spawn_with_state(&d, &s, "state-clean");
    int32_t values[10];
    for (int i = 0; i < 10; i++)
        values[i] = (i + 1) * 1000003;
    fill_streams(&d, values, 5);
    uint8_t before_cam[TALLY_QUERY_PAYLOAD_SIZE], before_s1[TALLY_QUERY_PAYLOAD_SIZE];
    /* The interval is 30 s: only the shutdown snapshot can have written the file. */
    query_fill_streams_and_stop(&d, before_cam, before_s1);

    assert_int_equal(spawn(&d, s.args, NULL), 0);
    assert_true(th_daemon_log_contains(&d, "state: restored 2 streams"));
    void *sock = connect_to(&d);
    uint8_t after[TALLY_QUERY_PAYLOAD_SIZE];
    assert_int_equal(query(sock, "cam0", after), TALLY_OK);
    assert_memory_equal(after, before_cam, TALLY_QUERY_PAYLOAD_SIZE);
    assert_int_equal(query(sock, "s1", after), TALLY_OK);
    assert_memory_equal(after, before_s1, TALLY_QUERY_PAYLOAD_SIZE);
    tally_stream_info_t info;
    assert_int_equal(tally_stream_info_decode(after, sizeof after, &info), TALLY_OK);
    assert_int_equal(info.scan_elements, 5);

    /* The scan carry continues: the second half gets the prefix sums of the whole array. */
    int64_t *sums = send_scan(sock, "s1", values + 5, 5);
    int64_t expect = 0;
    for (int i = 0; i < 10; i++) {
        expect += values[i];
        if (i >= 5)
            assert_int_equal(sums[i - 5], expect);
    }
    free(sums);
    /* `streams` lists both, in their original order. */
    tally_req_t req = th_req(TALLY_OP_STREAMS, TALLY_DTYPE_NONE, 15);
    th_reply_t reply;
    assert_int_equal(th_call(sock, &req, NULL, 0, &reply), 0);
    assert_int_equal(reply.rep.count, 2);
    assert_memory_equal(reply.payload, "\4cam0\2s1", 8);
    th_reply_free(&reply);
    close_and_stop(&d, sock);
}

/* Stopped with requests in flight: every request that was answered OK is in the restored
 * state, and nothing else (the final snapshot is taken after the last reply). */
static void test_state_stop_under_load_keeps_every_answered_request(void **state)
{
    (void)state;
    state_dir_t s;
    th_daemon_t d;
    spawn_with_state(&d, &s, "state-load");
    void *sock = th_connect(d.endpoint, 2000);
    size_t n = 64 * 1024;
    uint8_t *bytes = malloc(n);
    for (size_t i = 0; i < n; i++)
        bytes[i] = (uint8_t)th_rand();
    int sent = 200;
    for (int i = 0; i < sent; i++) {
        tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, (uint64_t)i);
        assert_int_equal(tally_req_set_stream(&req, "load"), TALLY_OK);
        assert_int_equal(th_send_request(sock, &req, bytes, n), 0);
    }
    free(bytes);
    kill(d.pid, SIGTERM);
    int ok = 0;
    th_reply_t reply;
    while (th_recv_reply(sock, &reply) == 0) {
        ok += reply.rep.status == TALLY_OK;
        th_reply_free(&reply);
    }
    close_and_stop(&d, sock);
    fprintf(stderr, "%d of %d requests answered before the stop\n", ok, sent);

    assert_int_equal(spawn(&d, s.args, NULL), 0);
    sock = connect_to(&d);
    uint8_t raw[TALLY_QUERY_PAYLOAD_SIZE];
    tally_stream_info_t info;
    if (ok == 0) {
        assert_int_equal(query(sock, "load", raw), TALLY_E_UNKNOWN_STREAM);
    } else {
        assert_int_equal(query(sock, "load", raw), TALLY_OK);
        assert_int_equal(tally_stream_info_decode(raw, sizeof raw, &info), TALLY_OK);
        assert_int_equal(info.batches, (uint64_t)ok);
        assert_int_equal(info.hist_total, (uint64_t)ok * n);
    }
    close_and_stop(&d, sock);
}

static void test_state_kill9_loses_at_most_one_interval(void **state)
{
    (void)state;
    char dir[300];
    make_dir(dir, sizeof dir, "state-kill");
    const char *args[] = {"--state-dir", dir, "--state-interval", "1", "--log-level",
                          "debug",       NULL};
    th_daemon_t d;
    assert_int_equal(spawn(&d, args, NULL), 0);
    int32_t values[3] = {1, 2, 3};
    fill_streams(&d, values, 3);
    uint8_t before[TALLY_QUERY_PAYLOAD_SIZE];
    void *sock = connect_to(&d);
    assert_int_equal(query(sock, "cam0", before), TALLY_OK);
    th_close(sock);
    assert_true(log_waits_for(&d, "state: wrote 2 streams", 5000));
    assert_int_equal(th_daemon_stop(&d, SIGKILL, 5000), 128 + SIGKILL);

    assert_int_equal(spawn(&d, args, NULL), 0);
    sock = connect_to(&d);
    uint8_t after[TALLY_QUERY_PAYLOAD_SIZE];
    assert_int_equal(query(sock, "cam0", after), TALLY_OK);
    assert_memory_equal(after, before, TALLY_QUERY_PAYLOAD_SIZE);
    close_and_stop(&d, sock);
}

/* After the first (whole) snapshot, snapshots append the streams that changed to the log: a
 * kill -9 after such appends restores the last appended state of each stream, byte for byte,
 * and a deleted stream stays deleted. */
static void test_state_kill9_after_appends(void **state)
{
    (void)state;
    char dir[300];
    make_dir(dir, sizeof dir, "state-append");
    const char *args[] = {"--state-dir", dir, "--state-interval", "1", "--log-level",
                          "debug",       NULL};
    th_daemon_t d;
    assert_int_equal(spawn(&d, args, NULL), 0);
    int32_t values[3] = {7, 8, 9};
    fill_streams(&d, values, 3);
    assert_true(log_waits_for(&d, "a whole state file", 5000));
    fill_streams(&d, values, 2); /* both change again */
    assert_true(log_waits_for(&d, "state: wrote 2 streams", 5000));
    assert_true(log_waits_for(&d, "appended to the log", 5000));
    void *sock = connect_to(&d);
    tally_req_t q = th_req(TALLY_OP_DELETE, TALLY_DTYPE_NONE, 77);
    q.stream_len = 2;
    memcpy(q.stream, "s1", 2);
    assert_int_equal(th_call_status(sock, &q, NULL, 0), TALLY_OK);
    uint8_t before[TALLY_QUERY_PAYLOAD_SIZE];
    assert_int_equal(query(sock, "cam0", before), TALLY_OK);
    th_close(sock);
    assert_true(log_waits_for(&d, "state: wrote 0 streams", 5000)); /* the deletion's record */
    assert_int_equal(th_daemon_stop(&d, SIGKILL, 5000), 128 + SIGKILL);

    assert_int_equal(spawn(&d, args, NULL), 0);
    assert_true(th_daemon_log_contains(&d, "changes from"));
    sock = connect_to(&d);
    uint8_t after[TALLY_QUERY_PAYLOAD_SIZE];
    assert_int_equal(query(sock, "cam0", after), TALLY_OK);
    assert_memory_equal(after, before, TALLY_QUERY_PAYLOAD_SIZE);
    assert_int_equal(query(sock, "s1", after), TALLY_E_UNKNOWN_STREAM);
    close_and_stop(&d, sock);
}

/* True when dir holds a streams.state.corrupt-* file. */
static bool has_corrupt_file(const char *dir)
{
    DIR *dp = opendir(dir);
    bool found = false;
    struct dirent *e;
    while (dp && (e = readdir(dp)))
        found |= strncmp(e->d_name, "streams.state.corrupt-", 22) == 0;
    if (dp)
        closedir(dp);
    return found;
}

typedef enum {
    CORRUPT_TRUNCATE, /* s1's record cut in half: s1 lost, cam0 restored */
    CORRUPT_FLIP,     /* one bit of cam0's histogram: cam0 lost, s1 restored */
    CORRUPT_HEADER,   /* one bit of the header: the file set aside */
    CORRUPT_VERSION,
    CORRUPT_GARBAGE,
} corruption_t;

/* Restores cam0 and s1 from a damaged file: the streams whose records are intact come back
 * byte for byte, the others are gone, a warning names the reason, the file is kept as a
 * set-aside copy (moved aside when its header is unusable), and the next snapshot is clean. */
static void corrupt_and_restart(const char *name, corruption_t how, const char *reason)
{
    state_dir_t s;
    th_daemon_t d;
    spawn_with_state(&d, &s, name);
    int32_t values[3] = {1, 2, 3};
    fill_streams(&d, values, 3);
    uint8_t before_cam[TALLY_QUERY_PAYLOAD_SIZE], before_s1[TALLY_QUERY_PAYLOAD_SIZE];
    query_fill_streams_and_stop(&d, before_cam, before_s1);

    struct stat sb;
    assert_int_equal(stat(s.file, &sb), 0);
    int fd = open(s.file, O_RDWR);
    assert_true(fd >= 0);
    uint8_t byte, size_field[4];
    /* The first snapshot is a whole state file (td_state.h), its records with their sizes:
     * two of them fill it. */
    assert_int_equal(pread(fd, size_field, 4, TD_STATE_HEADER_SIZE + 8), 4);
    off_t first = tally_get_u32(size_field);
    assert_int_equal(pread(fd, size_field, 4, TD_STATE_HEADER_SIZE + first + 8), 4);
    assert_int_equal(sb.st_size, TD_STATE_HEADER_SIZE + first + tally_get_u32(size_field));
    off_t at = TD_STATE_HEADER_SIZE + TD_STATE_RECORD_NAME_OFF + 4 + 8; /* cam0's elements */
    switch (how) {
    case CORRUPT_TRUNCATE:
        assert_int_equal(
            ftruncate(fd, TD_STATE_HEADER_SIZE + first + tally_get_u32(size_field) / 2), 0);
        break;
    case CORRUPT_FLIP:
    case CORRUPT_HEADER:
        at = how == CORRUPT_HEADER ? 25 : at; /* 25: the time written, under the checksum */
        assert_int_equal(pread(fd, &byte, 1, at), 1);
        byte ^= 0x10;
        assert_int_equal(pwrite(fd, &byte, 1, at), 1);
        break;
    case CORRUPT_VERSION: /* one below any this tallyd reads (a newer one: test_upgrade.c) */
        byte = 0;
        assert_int_equal(pwrite(fd, &byte, 1, 8), 1);
        break;
    case CORRUPT_GARBAGE:
        assert_int_equal(ftruncate(fd, 0), 0);
        static const char text[] = "hello, this is not a tallyd state file, just some text\n";
        assert_int_equal(pwrite(fd, text, sizeof text - 1, 0), (ssize_t)sizeof text - 1);
        break;
    }
    close(fd);

    bool cam0_kept = how == CORRUPT_TRUNCATE, s1_kept = how == CORRUPT_FLIP;
    bool partial = cam0_kept || s1_kept;
    assert_int_equal(spawn(&d, s.args, NULL), 0);
    assert_true(th_daemon_log_contains(&d, "<4>state: "));
    assert_true(th_daemon_log_contains(&d, reason));
    assert_true(th_daemon_log_contains(&d, partial ? "a copy of the file is set aside as"
                                                   : "starting with no streams"));
    assert_true(has_corrupt_file(s.dir));
    /* An unusable file is moved away, not left to be read again; a partly good one stays
     * until the next snapshot replaces it. */
    assert_int_equal(stat(s.file, &sb), partial ? 0 : -1);
    void *sock = connect_to(&d);
    uint8_t info[TALLY_QUERY_PAYLOAD_SIZE];
    assert_int_equal(query(sock, "cam0", info), cam0_kept ? TALLY_OK : TALLY_E_UNKNOWN_STREAM);
    if (cam0_kept)
        assert_memory_equal(info, before_cam, sizeof info);
    assert_int_equal(query(sock, "s1", info), s1_kept ? TALLY_OK : TALLY_E_UNKNOWN_STREAM);
    if (s1_kept)
        assert_memory_equal(info, before_s1, sizeof info);
    fill_streams(&d, values, 3); /* and serves */
    assert_int_equal(query(sock, "cam0", info), TALLY_OK);
    close_and_stop(&d, sock);
    assert_int_equal(stat(s.file, &sb), 0); /* a fresh, good file */
    assert_int_equal(spawn(&d, s.args, NULL), 0);
    assert_true(th_daemon_log_contains(&d, "state: restored 2 streams"));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

static void test_state_truncated_file_keeps_whole_records(void **state)
{
    (void)state;
    corrupt_and_restart("state-trunc", CORRUPT_TRUNCATE, "1 of its 2 records are cut off");
}

static void test_state_bit_flip_loses_only_its_stream(void **state)
{
    (void)state;
    corrupt_and_restart("state-flip", CORRUPT_FLIP,
                        "(stream \"cam0\") not restored: record checksum mismatch");
}

static void test_state_header_damage_set_aside(void **state)
{
    (void)state;
    corrupt_and_restart("state-header", CORRUPT_HEADER, "header checksum mismatch");
}

static void test_state_wrong_version_set_aside(void **state)
{
    (void)state;
    corrupt_and_restart("state-version", CORRUPT_VERSION, "format version 0");
}

static void test_state_garbage_set_aside(void **state)
{
    (void)state;
    corrupt_and_restart("state-garbage", CORRUPT_GARBAGE, "bad magic");
}

/* The value of a counter in the `stats` text, or -1 when it is missing. */
static long long stats_counter(const th_daemon_t *d, const char *name)
{
    void *sock = connect_to(d);
    char *text = text_op(sock, TALLY_OP_STATS);
    th_close(sock);
    char line[128];
    snprintf(line, sizeof line, "\n%s ", name);
    const char *at = strstr(text, line);
    long long value = at ? strtoll(at + strlen(line), NULL, 10) : -1;
    free(text);
    return value;
}

/* A periodic snapshot that cannot be written (a directory where the temporary file goes: a
 * failure root cannot bypass) is logged at warning and counted, tallyd keeps serving, and the
 * next interval writes once the way is clear. */
static void test_state_periodic_write_failure_retried(void **state)
{
    (void)state;
    char dir[300], tmp[400];
    make_dir(dir, sizeof dir, "state-retry");
    snprintf(tmp, sizeof tmp, "%s/streams.state.tmp", dir);
    const char *args[] = {"--state-dir", dir, "--state-interval", "1", "--log-level",
                          "debug",       NULL};
    th_daemon_t d;
    assert_int_equal(spawn(&d, args, NULL), 0);
    assert_int_equal(mkdir(tmp, 0700), 0);
    int32_t values[3] = {4, 5, 6};
    fill_streams(&d, values, 3);
    assert_true(log_waits_for(&d, "<4>state: cannot write", 10000));
    assert_true(th_daemon_log_contains(&d, "Is a directory"));
    assert_true(stats_counter(&d, "tallyd_state_write_failures_total") >= 1);
    assert_false(th_daemon_log_contains(&d, "state: wrote"));
    assert_int_equal(rmdir(tmp), 0);
    assert_true(log_waits_for(&d, "state: wrote 2 streams", 10000));
    long long failures = stats_counter(&d, "tallyd_state_write_failures_total");
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    fprintf(stderr, "%lld failed periodic writes before the way was clear\n", failures);
    assert_false(th_daemon_log_contains(&d, "<3>"));

    assert_int_equal(spawn(&d, args, NULL), 0);
    assert_true(th_daemon_log_contains(&d, "state: restored 2 streams"));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* A final snapshot that cannot be written: tallyd says why at err and exits 1, not 0. */
static void test_state_final_write_failure_exits_nonzero(void **state)
{
    (void)state;
    state_dir_t s;
    th_daemon_t d;
    spawn_with_state(&d, &s, "state-final");
    char tmp[410];
    snprintf(tmp, sizeof tmp, "%s.tmp", s.file);
    int32_t values[3] = {7, 8, 9};
    fill_streams(&d, values, 3);
    assert_int_equal(mkdir(tmp, 0700), 0);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 1);
    assert_true(th_daemon_log_contains(&d, "<3>state: the final snapshot failed"));
    assert_true(th_daemon_log_contains(&d, "Is a directory"));
    assert_true(th_daemon_log_contains(&d, "exiting with status 1"));
    struct stat sb;
    assert_int_equal(stat(s.file, &sb), -1); /* nothing claims to hold what was lost */
    assert_int_equal(rmdir(tmp), 0);

    /* The same daemon with a clear path exits 0 and its state comes back. */
    assert_int_equal(spawn(&d, s.args, NULL), 0);
    fill_streams(&d, values, 3);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    assert_int_equal(stat(s.file, &sb), 0);
}

/* streams.state that is not a regular file stops tallyd at start with the reason at err,
 * instead of serving while every snapshot fails. */
static void test_state_file_not_regular_fails_start(void **state)
{
    (void)state;
    static const struct {
        const char *name;
        bool fifo;
        const char *says;
    } cases[] = {{"state-isdir", false, "streams.state is a directory, not a regular file"},
                 {"state-fifo", true, "streams.state is a FIFO, not a regular file"}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char dir[300], path[400];
        make_dir(dir, sizeof dir, cases[c].name);
        snprintf(path, sizeof path, "%s/streams.state", dir);
        assert_int_equal(cases[c].fifo ? mkfifo(path, 0600) : mkdir(path, 0700), 0);
        const char *args[] = {"--state-dir", dir, NULL};
        assert_start_fails(args, cases[c].says);
    }
}

/* ---- configuration file and reload ------------------------------------------------------ */

static void test_config_file_errors_exit_2(void **state)
{
    (void)state;
    static const struct {
        const char *text;
        const char *message;
    } cases[] = {
        {"[server]\nmax_inflight = 8\nbogus = 1\n", ".conf:3: unknown key 'bogus' in [server]"},
        {"[server]\n\nmax_inflight = lots\n", ".conf:3: invalid value 'lots' for max_inflight"},
        {"[nope]\nx = 1\n", ".conf:1: unknown section [nope]"},
        {"[server]\nmax_inflight = 8\n[nope]\n", ".conf:3: unknown section [nope]"}, /* no keys */
        {"log_level = debug\n", ".conf:1: key 'log_level' outside any [section]"},
        {"[server]\nthis line has no equals sign\n", ".conf:2: syntax error"},
        {"[state]\ninterval = 0\n", ".conf:2: invalid value '0' for interval in [state]"},
        /* 0 publishes nothing; between 0 and 10 is no interval, and 0 beside an endpoint none */
        {"[pub]\ninterval_ms = 5\n", "[pub] interval_ms 5: 0 (publish nothing) or 10 to 3600000"},
        {"[pub]\nendpoint = tcp://127.0.0.1:1\ninterval_ms = 0\n",
         "[pub] endpoint tcp://127.0.0.1:1 with interval_ms = 0 would publish nothing"},
    };
    char conf[300];
    snprintf(conf, sizeof conf, "%s/bad.conf", scratch);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_file(conf, cases[i].text);
        const char *args[] = {"--config", conf, NULL};
        spawn_opts_t o = {.no_wait = true};
        th_daemon_t d;
        assert_int_equal(spawn(&d, args, &o), 0);
        int status = 0;
        assert_int_equal(waitpid(d.pid, &status, 0), d.pid);
        assert_true(WIFEXITED(status));
        assert_int_equal(WEXITSTATUS(status), 2);
        if (!th_daemon_log_contains(&d, cases[i].message))
            fail_msg("case %zu: no '%s' in %s", i, cases[i].message, d.log_path);
    }
    /* An explicitly named file that does not exist is an error too. */
    const char *args[] = {"--config", "/nonexistent/tallyd.conf", NULL};
    spawn_opts_t o = {.no_wait = true};
    th_daemon_t d;
    assert_int_equal(spawn(&d, args, &o), 0);
    int status = 0;
    assert_int_equal(waitpid(d.pid, &status, 0), d.pid);
    assert_int_equal(WEXITSTATUS(status), 2);
}

/* tallyd with args (NULL-terminated, at most 8) and opts, to its exit: the status, 256 for a
 * signal; its log in d. */
static int run_to_exit(th_daemon_t *d, const char *const *args, bool check,
                       const spawn_opts_t *opts)
{
    const char *all[10];
    int n = 0;
    if (check)
        all[n++] = "--check-config";
    for (; *args && n < 9; args++)
        all[n++] = *args;
    all[n] = NULL;
    spawn_opts_t o = opts ? *opts : (spawn_opts_t){0};
    o.no_wait = true;
    assert_int_equal(spawn(d, all, &o), 0);
    int status = 0;
    assert_int_equal(waitpid(d->pid, &status, 0), d->pid);
    d->pid = 0;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 256;
}

/* scratch/name holding text with mode; its path into path (300 bytes). */
static void scratch_file(char *path, const char *name, const char *text, mode_t mode)
{
    snprintf(path, 300, "%s/%s", scratch, name);
    write_file(path, text);
    assert_int_equal(chmod(path, mode), 0);
}

/* --check-config reads every file the start would read and fails as the start does: the same
 * exit status and the same message. Without it, a missing curve_secret_key or metrics
 * auth_file / api_token_file was "configuration ok" and the start then failed. */
static void test_check_config_reads_every_file(void **state)
{
    (void)state;
    char key[300], bad_key[300], loose[300], token[300], auth[300], creds_env[320];
    snprintf(key, sizeof key, "%s/check-server", scratch);
    char msg[256];
    assert_int_equal(tally_keygen(key, NULL, msg, sizeof msg), TALLY_OK);
    strcat(key, ".key");
    scratch_file(bad_key, "check-bad.key", "not a key\n", 0600);
    scratch_file(auth, "check-auth", "user:password\n", 0600);
    scratch_file(loose, "check-loose", "user:password\n", 0644);
    scratch_file(token, "check-token", "short\n", 0600);
    snprintf(creds_env, sizeof creds_env, "CREDENTIALS_DIRECTORY=%s", scratch);
    static const char missing[] = "/nonexistent/tallyd-check";
    const struct {
        const char *args[8];
        const char *says;
        bool creds; /* CREDENTIALS_DIRECTORY set */
    } cases[] = {
        {.args = {"--curve-secret-key", missing},
         .says = "<3>[security] curve_secret_key (--curve-secret-key): cannot read "
                 "/nonexistent/tallyd-check: No such file or directory"},
        {.args = {"--curve-secret-key", bad_key}, .says = "<3>curve: "},
        {.args = {"--curve-secret-key", key, "--curve-clients-dir", missing},
         .says = "<3>[security] curve_clients_dir (--curve-clients-dir): cannot read"},
        {.args = {"--metrics", "127.0.0.1:0", "--metrics-auth-file", missing},
         .says =
             "<3>[metrics] auth_file (--metrics-auth-file): cannot read /nonexistent/tallyd-check"},
        {.args = {"--metrics", "127.0.0.1:0", "--metrics-auth-file", loose},
         .says = "has mode 0644: a secret file must not be accessible to group or others"},
        {.args = {"--metrics", "127.0.0.1:0", "--metrics-api-token-file", missing},
         .says = "<3>[metrics] api_token_file (--metrics-api-token-file): cannot read"},
        {.args = {"--metrics", "127.0.0.1:0", "--metrics-auth-file", auth,
                  "--metrics-api-token-file", token},
         .says = "is too short: 16 characters at least"},
        /* A relative key file: where it was looked up, and why there. */
        {.args = {"--curve-secret-key", "tallyd-check-server.key"},
         .says =
             "cannot read tallyd-check-server.key: No such file or directory (a relative path is "
             "looked up in $CREDENTIALS_DIRECTORY, which systemd's LoadCredential= sets; it is not "
             "set, so it was looked up in /"},
        {.args = {"--curve-secret-key", "tallyd-check-server.key"},
         .says = "(looked up in $CREDENTIALS_DIRECTORY: does the unit have "
                 "LoadCredential=tallyd-check-server.key:PATH?)",
         .creds = true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        spawn_opts_t o = {.env = {cases[i].creds ? creds_env : NULL}};
        th_daemon_t d;
        for (int check = 1; check >= 0; check--) {
            int code = run_to_exit(&d, cases[i].args, check, &o);
            if (code != 1 || !th_daemon_log_contains(&d, cases[i].says))
                fail_msg("case %zu%s: exit %d, '%s' wanted in %s", i,
                         check ? " (--check-config)" : "", code, cases[i].says, d.log_path);
            assert_false(th_daemon_log_contains(&d, "configuration ok"));
        }
    }
    /* What the start reads, all there: ok. */
    const char *good[] = {"--curve-secret-key",  key,  "--metrics", "127.0.0.1:0",
                          "--metrics-auth-file", auth, NULL};
    th_daemon_t d;
    assert_int_equal(run_to_exit(&d, good, true, NULL), 0);
    assert_true(th_daemon_log_contains(&d, "configuration ok"));
}

/* `info` holds each of the NULL-terminated lines ("max_inflight=64\n"...). */
static void assert_info_has(void *sock, const char *const *lines)
{
    char *info = text_op(sock, TALLY_OP_INFO);
    for (; *lines; lines++)
        assert_non_null(strstr(info, *lines));
    free(info);
}

/* Debug lines appear: a rejected request (one frame) is logged at debug. */
static void assert_debug_logged(th_daemon_t *d, void *sock)
{
    const void *frames[1] = {"x"};
    size_t lens[1] = {1};
    assert_int_equal(th_send_frames(sock, 1, frames, lens), 0);
    th_reply_t reply;
    assert_int_equal(th_recv_reply(sock, &reply), 0);
    assert_int_equal(reply.rep.status, TALLY_E_FRAMES);
    th_reply_free(&reply);
    assert_true(log_waits_for(d, "<7>", 2000));
}

static void test_config_file_and_sighup_reload(void **state)
{
    (void)state;
    char conf[300];
    snprintf(conf, sizeof conf, "%s/reload.conf", scratch);
    write_file(conf, "; tallyd test configuration\n"
                     "[server]\n"
                     "log_level = info\n"
                     "max_inflight = 64\n"
                     "max_streams = 20\n"
                     "max_batch = 1M\n");
    /* max_streams on the command line wins over the file, also on reload. */
    const char *args[] = {"--config", conf, "--max-streams", "10", NULL};
    th_daemon_t d;
    assert_int_equal(spawn(&d, args, NULL), 0);
    void *sock = connect_to(&d);
    assert_info_has(sock, (const char *[]){"max_inflight=64\n", "max_streams=10\n",
                                           "max_batch=1048576\n", NULL});
    assert_false(th_daemon_log_contains(&d, "<7>")); /* log_level info: no debug lines */

    /* A good change: log level and limits apply at once, each logged. */
    write_file(conf, "[server]\n"
                     "log_level = debug\n"
                     "max_inflight = 8\n"
                     "max_streams = 30\n"
                     "max_batch = 512K\n"
                     "[gpu]\n"
                     "streams = 2\n"
                     "[metrics]\n"
                     "listen = 127.0.0.1:0\n");
    kill(d.pid, SIGHUP);
    assert_true(log_waits_for(&d, "reload: log_level: info -> debug", 5000));
    assert_true(th_daemon_log_contains(&d, "reload: max_inflight: 64 -> 8"));
    assert_true(th_daemon_log_contains(&d, "reload: max_batch: 1048576 -> 524288"));
    assert_true(th_daemon_log_contains(&d, "reload: gpu streams changed; ignored until tallyd "
                                           "restarts"));
    assert_true(th_daemon_log_contains(&d, "reload: metrics listen changed; ignored until tallyd "
                                           "restarts"));
    assert_false(th_daemon_log_contains(&d, "max_streams: 10"));
    assert_info_has(
        sock, (const char *[]){"max_inflight=8\n", "max_streams=10\n", "max_batch=524288\n", NULL});
    assert_debug_logged(&d, sock);

    /* A bad file is logged and the running configuration kept. */
    write_file(conf, "[server]\nmax_inflight = -3\n");
    kill(d.pid, SIGHUP);
    assert_true(log_waits_for(&d, "reload failed: ", 5000));
    assert_true(th_daemon_log_contains(&d, "reload.conf:2: invalid value '-3' for max_inflight"));
    assert_info_has(sock, (const char *[]){"max_inflight=8\n", NULL});

    /* max_inflight may rise past its start value; max_batch may not (it sized ZeroMQ's frame
     * limit and the GPU's staging buffers), so it is capped at the start value. */
    write_file(conf, "[server]\nmax_inflight = 1000\nmax_batch = 4M\n");
    kill(d.pid, SIGHUP);
    assert_true(log_waits_for(&d, "reload: max_inflight: 8 -> 1000", 5000));
    assert_true(th_daemon_log_contains(&d, "max_batch 4194304 is above the 1048576 tallyd"));
    assert_true(th_daemon_log_contains(&d, "reload: max_batch: 524288 -> 1048576"));
    assert_info_has(sock, (const char *[]){"max_inflight=1000\n", "max_batch=1048576\n", NULL});
    th_close(sock);
    assert_true(ping(d.endpoint, 5000));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* ---- metrics over HTTP ------------------------------------------------------------------ */

/* GET path from 127.0.0.1:port; returns the malloc'ed response (headers and body). */
static char *http_get(int port, const char *method, const char *path)
{
    char *resp = th_http_get(port, method, path, NULL);
    assert_non_null(resp);
    return resp;
}

/* Checks every sample line is `name{labels} value` with a numeric value; returns the count. */
static int check_exposition(const char *body)
{
    int samples = 0;
    const char *line = body;
    while (*line) {
        const char *end = strchr(line, '\n');
        assert_non_null(end); /* every line ends in a newline */
        size_t len = (size_t)(end - line);
        char text[1024];
        assert_true(len < sizeof text);
        memcpy(text, line, len);
        text[len] = '\0';
        line = end + 1;
        if (text[0] == '#') {
            assert_true(strncmp(text, "# HELP ", 7) == 0 || strncmp(text, "# TYPE ", 7) == 0);
            continue;
        }
        const char *p = text;
        assert_true(isalpha((unsigned char)*p) || *p == '_');
        while (isalnum((unsigned char)*p) || *p == '_' || *p == ':')
            p++;
        if (*p == '{') {
            const char *close = strrchr(p, '}');
            assert_non_null(close);
            p = close + 1;
        }
        assert_int_equal(*p, ' ');
        char *num_end = NULL;
        strtod(p + 1, &num_end);
        if (num_end == p + 1 || *num_end != '\0')
            fail_msg("not a number in '%s'", text);
        samples++;
    }
    return samples;
}

/* The lines of text starting with prefix, concatenated (malloc'ed). */
static char *lines_with(const char *text, const char *prefix)
{
    char *out = calloc(1, strlen(text) + 1);
    for (const char *line = text; line && *line;) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line + 1) : strlen(line);
        if (strncmp(line, prefix, strlen(prefix)) == 0)
            strncat(out, line, len);
        line = end ? end + 1 : NULL;
    }
    return out;
}

static void test_metrics_http_endpoint(void **state)
{
    (void)state;
    const char *args[] = {"--metrics", "127.0.0.1:0", NULL};
    th_daemon_t d;
    assert_int_equal(spawn(&d, args, NULL), 0);
    int port = th_metrics_port(&d);
    assert_true(port > 0);
    int32_t values[4] = {4, 3, 2, 1};
    fill_streams(&d, values, 4);

    char *resp = http_get(port, "GET", "/metrics");
    assert_true(strncmp(resp, "HTTP/1.0 200", 12) == 0 || strncmp(resp, "HTTP/1.1 200", 12) == 0);
    assert_non_null(strstr(resp, "text/plain; version=0.0.4"));
    char *body = strstr(resp, "\r\n\r\n");
    assert_non_null(body);
    body += 4;
    assert_true(check_exposition(body) > 20);
    assert_non_null(strstr(body, "tallyd_requests_total{op=\"hist\",status=\"ok\"} 2\n"));
    assert_non_null(strstr(body, "tallyd_requests_total{op=\"scan\",status=\"ok\"} 1\n"));
    assert_non_null(strstr(body, "tallyd_streams 2\n"));
    assert_non_null(strstr(body, "tallyd_backend_info{backend=\"cpu\""));
    assert_non_null(strstr(body, "tallyd_device_memory_bytes "));

    /* The `stats` opcode renders the same counters. */
    void *sock = connect_to(&d);
    char *stats = text_op(sock, TALLY_OP_STATS);
    th_close(sock);
    check_exposition(stats);
    const char *same[] = {"tallyd_requests_total{op=\"hist\"", "tallyd_requests_total{op=\"scan\"",
                          "tallyd_received_bytes_total", "tallyd_streams ",
                          "tallyd_request_duration_seconds_bucket{op=\"hist\""};
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
        char *a = lines_with(body, same[i]), *b = lines_with(stats, same[i]);
        assert_true(a[0] != '\0');
        assert_string_equal(a, b);
        free(a);
        free(b);
    }
    free(stats);

    /* And so does `tally stats`. */
    const char *tally = getenv("TALLY_BIN");
    if (tally && *tally && access(tally, X_OK) == 0) {
        char cmd[512];
        snprintf(cmd, sizeof cmd, "%s -e %s stats", tally, d.endpoint);
        FILE *p = popen(cmd, "r");
        assert_non_null(p);
        char *out = calloc(1, 1 << 20);
        size_t got = fread(out, 1, (1 << 20) - 1, p);
        out[got] = '\0';
        assert_int_equal(pclose(p), 0);
        for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
            char *a = lines_with(body, same[i]), *b = lines_with(out, same[i]);
            assert_string_equal(a, b);
            free(a);
            free(b);
        }
        free(out);
    }
    free(resp);

    resp = http_get(port, "GET", "/other");
    assert_non_null(strstr(resp, " 404 "));
    free(resp);
    resp = http_get(port, "POST", "/metrics");
    assert_non_null(strstr(resp, " 405 "));
    free(resp);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

static void test_metrics_bad_address_fails_start(void **state)
{
    (void)state;
    const char *args[] = {"--metrics", "localhost-ish", NULL};
    assert_start_fails(args, "is not IP:PORT");
    const char *bad_port[] = {"--metrics", "127.0.0.1:94x", NULL};
    assert_start_fails(bad_port, "is not IP:PORT");
}

/* The listen address goes through getaddrinfo: a host name works. */
static void test_metrics_host_name(void **state)
{
    (void)state;
    const char *args[] = {"--metrics", "localhost:0", NULL};
    th_daemon_t d;
    assert_int_equal(spawn(&d, args, NULL), 0); /* it started: the name resolved */
    assert_true(th_daemon_log_contains(&d, "metrics: serving http://localhost:"));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* After each test: kills any tallyd a failed assertion left running (our children only:
 * waitpid tells a live child from one already reaped). */
static int kill_leftovers(void **state)
{
    (void)state;
    for (int i = 0; i < spawned_count; i++) {
        if (waitpid(spawned[i], NULL, WNOHANG) == 0) {
            kill(spawned[i], SIGKILL);
            waitpid(spawned[i], NULL, 0);
        }
    }
    spawned_count = 0;
    return 0;
}

static void test_state_dir_unusable_fails_start(void **state)
{
    (void)state;
    char file[300];
    snprintf(file, sizeof file, "%s/not-a-dir", scratch);
    write_file(file, "x");
    const char *args[] = {"--state-dir", file, NULL};
    assert_start_fails(args, "is not a directory");
    th_daemon_t d;

    /* A missing last component is created. */
    char dir[300];
    snprintf(dir, sizeof dir, "%s/created-by-tallyd", scratch);
    const char *args2[] = {"--state-dir", dir, NULL};
    assert_int_equal(spawn(&d, args2, NULL), 0);
    struct stat sb;
    assert_int_equal(stat(dir, &sb), 0);
    assert_true(S_ISDIR(sb.st_mode));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

static int setup(void **state)
{
    (void)state;
    th_seed();
    snprintf(scratch, sizeof scratch, "%s/tallyd-service-XXXXXX",
             getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(scratch))
        return -1;
    fprintf(stderr, "scratch directory %s\n", scratch);
    signal(SIGPIPE, SIG_IGN);
    return 0;
}

static int remove_entry(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb;
    (void)type;
    (void)ftw;
    return remove(path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_notify_ready_status_watchdog_stopping, kill_leftovers),
        cmocka_unit_test_teardown(test_status_line_refreshes, kill_leftovers),
        cmocka_unit_test_teardown(test_log_time_unless_journal, kill_leftovers),
        cmocka_unit_test_teardown(test_socket_activation_tcp_and_ipc, kill_leftovers),
        cmocka_unit_test_teardown(test_socket_activation_rejects_datagram_socket, kill_leftovers),
        cmocka_unit_test_teardown(test_socket_activation_ipv6, kill_leftovers),
        cmocka_unit_test_teardown(test_socket_activation_bind_collides, kill_leftovers),
        cmocka_unit_test_teardown(test_socket_activation_protected_and_curve, kill_leftovers),
        cmocka_unit_test_teardown(test_state_survives_clean_restart, kill_leftovers),
        cmocka_unit_test_teardown(test_state_stop_under_load_keeps_every_answered_request,
                                  kill_leftovers),
        cmocka_unit_test_teardown(test_state_kill9_loses_at_most_one_interval, kill_leftovers),
        cmocka_unit_test_teardown(test_state_kill9_after_appends, kill_leftovers),
        cmocka_unit_test_teardown(test_state_truncated_file_keeps_whole_records, kill_leftovers),
        cmocka_unit_test_teardown(test_state_bit_flip_loses_only_its_stream, kill_leftovers),
        cmocka_unit_test_teardown(test_state_header_damage_set_aside, kill_leftovers),
        cmocka_unit_test_teardown(test_state_wrong_version_set_aside, kill_leftovers),
        cmocka_unit_test_teardown(test_state_garbage_set_aside, kill_leftovers),
        cmocka_unit_test_teardown(test_state_periodic_write_failure_retried, kill_leftovers),
        cmocka_unit_test_teardown(test_state_final_write_failure_exits_nonzero, kill_leftovers),
        cmocka_unit_test_teardown(test_state_dir_unusable_fails_start, kill_leftovers),
        cmocka_unit_test_teardown(test_state_file_not_regular_fails_start, kill_leftovers),
        cmocka_unit_test_teardown(test_config_file_errors_exit_2, kill_leftovers),
        cmocka_unit_test_teardown(test_check_config_reads_every_file, kill_leftovers),
        cmocka_unit_test_teardown(test_config_file_and_sighup_reload, kill_leftovers),
        cmocka_unit_test_teardown(test_metrics_http_endpoint, kill_leftovers),
        cmocka_unit_test_teardown(test_metrics_bad_address_fails_start, kill_leftovers),
        cmocka_unit_test_teardown(test_metrics_host_name, kill_leftovers),
    };
    int failed = cmocka_run_group_tests(tests, setup, NULL);
    if (failed)
        fprintf(stderr, "tallyd logs, state and configurations kept in %s\n", scratch);
    else
        nftw(scratch, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    return failed;
}
