/* SPDX-License-Identifier: Apache-2.0 */
/*
 * harness.h — what the integration tests share: start a real tallyd on a free loopback port,
 * stop it with a signal, and speak the protocol over a raw ZeroMQ DEALER socket (so the tests
 * do not depend on libtally and can send anything, malformed messages included).
 */
#ifndef TALLY_TEST_HARNESS_H
#define TALLY_TEST_HARNESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "tally_proto.h"

typedef struct {
    pid_t pid;
    int port;
    char endpoint[128];
    char log_path[128];   /* tallyd's stderr */
    char shm_dir[64];     /* its own directory for the side channel; "" when the test set it */
    char shm_socket[128]; /* the side channel's path in shm_dir */
} th_daemon_t;

/* How long a started tallyd may take to answer its first ping (a fleet worker making its
 * JetStream objects while a cluster forms retries for up to 30 s). */
#define TH_START_WAIT_MS 60000

/* Waits until the tallyd of pid, its stderr in log_path, answers a ping on endpoint: 1 when it
 * did, 0 when it exited first (reaped; its wait status in *status), -1 when it did not answer
 * within timeout_ms, or another process answered on its port (the log does not say it listens
 * there and is ready). One ping on one socket, which ZeroMQ sends once tallyd listens: a socket per
 * try would begin the connection and its handshake anew each time, which a loaded box may not
 * finish in a try's time, and each ping that arrives is one more in tallyd's stats. */
int th_await_pong(const char *endpoint, pid_t pid, const char *log_path, int timeout_ms,
                  int *status);

/* Starts $TALLYD_BIN (or ./tallyd) with --bind on a free port plus extra_args (NULL-terminated,
 * may be NULL) and waits until it answers a ping. Returns 0, or -1 (and logs) on failure.
 * Its stderr goes to log_path, /tmp/tallyd-test-PID-PORT.log, which the test process removes at
 * its exit when it passed, and keeps, naming it on stderr, when it failed (TALLY_TEST_KEEP_LOGS=1
 * keeps it always).
 * Unless extra_args has --shm-socket, the daemon's side channel is shm_socket in a directory of
 * its own (shm_dir, removed when it has exited: th_daemon_wait), so that daemons of concurrent
 * test runs never share the default path, which a second tallyd refuses (PROTOCOL.md §10). */
int th_daemon_start(th_daemon_t *d, const char *const *extra_args);
/* The same with two argument lists, args then extra (each NULL-terminated, may be NULL; 30
 * arguments at most in all). */
int th_daemon_start_with(th_daemon_t *d, const char *const *args, const char *const *extra);
/* Sends sig and waits for the exit; returns the exit status, or -1 if it did not exit within
 * timeout_ms (then it is killed). */
int th_daemon_stop(th_daemon_t *d, int sig, int timeout_ms);
/* The same without a signal: waits for the daemon to exit on its own. */
int th_daemon_wait(th_daemon_t *d, int timeout_ms);
/* Runs tallyd with args (nothing added) to its exit, its stderr in log: for a tallyd that is
 * to refuse to start. Its exit status, or -1 when it did not exit within timeout_ms (killed). */
int th_daemon_run_to_exit(const char *const *args, const char *log, int timeout_ms);
/* A tallyd that is to refuse to start, run to its exit: --backend cpu, --shm off and args
 * (NULL-terminated, 24 at most) and, unless args has --bind, --bind ipc://DIR/refused.sock (in
 * the test's own directory dir: a TCP port picked a moment before could be another process's by
 * the time tallyd binds it, and it would be refused for that instead). Its stderr in
 * DIR/refused.log, whose path goes into log (cap bytes). Its exit status, or -1 when it did not
 * exit within timeout_ms (killed). */
int th_run_refused(const char *dir, const char *const *args, char *log, size_t cap, int timeout_ms);
/* True when the daemon's log contains text. */
bool th_daemon_log_contains(const th_daemon_t *d, const char *text);
/* Waits up to timeout_ms for text in the daemon's log: true when it came; false, saying so and
 * the log's path on stderr, when not. */
bool th_daemon_wait_log(const th_daemon_t *d, const char *text, int64_t timeout_ms);

/* True when the file at path (a log) contains text; false, saying so on stderr, when not. */
bool th_file_contains(const char *path, const char *text);

/* A loopback TCP port that could be bound a moment ago, this process's until it ends: taken from
 * TH_PORT_LOW..TH_PORT_HIGH, below the kernel's ephemeral ports (32768-60999 on Debian, which
 * bind to port 0 and outgoing connections draw from), under an flock on
 * /tmp/tally-test-port-<port>.lock that stays held (the kernel lets go at the process's end,
 * a crash included). So no test running beside it (CTest runs tests in parallel) is handed the
 * port again, not even after the server on it stopped: a nats-server a test kills and starts
 * again on its port could otherwise meet another test's server there, and this test's clients
 * reconnecting to it. Something outside the tests may still take it before the test binds it:
 * only for a tallyd that th_daemon_start starts (it retries on another port) or a test that
 * retries itself; a tallyd run to its exit binds an ipc:// path in the test's directory, and a
 * port nothing may listen on is th_refusing_port's. -1: none found. */
#define TH_PORT_LOW 20000
#define TH_PORT_HIGH 32000
int th_free_port(void);
/* A loopback TCP port that nothing listens on, bound by the test and held (not listening) so
 * that no other process can take it: a connection to it is refused. Its socket in *held (close
 * it when done); -1 (and *held -1) on failure. */
int th_refusing_port(int *held);
/* Forks and runs argv (argv[0] the program's path; NULL-terminated) with its stderr in the file
 * log (created or truncated) and its stdout there too (stdout_to_log) or in /dev/null; killed
 * when the test dies. setup(arg), unless NULL, runs in the child just before the exec (the
 * environment, descriptors to pass). The child's pid, or -1. */
pid_t th_spawn(const char *const *argv, const char *log, bool stdout_to_log,
               void (*setup)(const void *arg), const void *arg);
/* The tallyd under test: $TALLYD_BIN, or ./tallyd. */
const char *th_tallyd_bin(void);

/* A DEALER socket connected to endpoint (shared context), receive timeout in ms. After
 * th_use_curve, a CURVE client with those keys (th_daemon_start's readiness ping included). */
void *th_connect(const char *endpoint, int timeout_ms);
/* The same socket not yet connected, for options that must come first (ZMQ_ROUTING_ID,
 * ZMQ_RCVHWM, ZMQ_IPV6...); zmq_connect it after. */
void *th_dealer(int timeout_ms);
/* A DEALER of ctx (the caller's context) with routing id `id`, receive timeout timeout_ms and no
 * linger, connected to endpoint: the peer a shared-memory region is registered for. */
void *th_dealer_id(void *ctx, const char *endpoint, const char *id, int timeout_ms);
/* CURVE keys (Z85) for the sockets th_connect makes from now on; NULLs: plain sockets again. */
void th_use_curve(const char *server_public, const char *client_public, const char *client_secret);
void th_close(void *sock);
/* The end of most tests: closes sock and stops d with SIGTERM (th_daemon_stop): d's exit
 * status, or -1. */
int th_close_and_stop(void *sock, th_daemon_t *d, int timeout_ms);

/* A ping with request id `id` from a REQ socket of its own (whose envelope has an empty delimiter
 * frame, which tallyd echoes) at endpoint: the reply's status, or -1 (no reply, or not the ping's).
 */
int th_req_socket_ping(const char *endpoint, uint64_t id, int timeout_ms);
/* Sends frames: each (data, len); returns 0 or -1. */
int th_send_frames(void *sock, int count, const void *const *data, const size_t *lens);
/* Sends a request header (encoded from req) and a payload. */
int th_send_request(void *sock, const tally_req_t *req, const void *payload, size_t len);

typedef struct {
    tally_rep_t rep;
    uint8_t *payload; /* malloc'ed, NUL-terminated for convenience */
    size_t len;
    int frames; /* number of frames received */
} th_reply_t;
/* Receives one reply (both frames) and decodes the header. Returns 0, or -1 on timeout or a
 * reply that does not decode. */
int th_recv_reply(void *sock, th_reply_t *reply);
void th_reply_free(th_reply_t *reply);

/* One request, one reply. */
int th_call(void *sock, const tally_req_t *req, const void *payload, size_t len, th_reply_t *reply);
/* The value of the line `name value` in tallyd's stats text (name with its labels, e.g.
 * `tallyd_limited_total{reason="stream_rate"}`), asked on sock; -1 when absent or on no reply. */
long long th_stat(void *sock, const char *name);
/* Whether the `# HELP family ...` line of tallyd's stats text, asked on sock, holds `words`. */
bool th_stat_help_says(void *sock, const char *family, const char *words);

/* A peer that never reads (receive high-water mark 1, a 4 KiB kernel buffer, so its replies stay
 * in tallyd), connected to endpoint, that pipelines `scans` scans of 1 MiB of int32 (each reply
 * 2 MiB of int64 sums), request ids first_id on; returns once tallyd has answered all of them
 * (sent, or queued for the peer: ok or busy, counted in *n_ok and *n_busy as read on `stats`, a
 * first tallyd's only scans), or after 30 s. The DEALER (th_close it), or NULL. */
void *th_nonreader_scans(const char *endpoint, void *stats, int scans, uint64_t first_id,
                         long long *n_ok, long long *n_busy);
/* What test_hostile and test_reply_bounds begin with: starts d with args (NULL-terminated),
 * connects *other (a DEALER, 30 s receive timeout) and has a th_nonreader_scans peer pipeline
 * `scans` scans, request ids first_id on, counting them in *n_ok and *n_busy as read on *other.
 * The peer, or NULL (said on stderr) when tallyd did not start or did not answer them all. */
void *th_nonreader_started(th_daemon_t *d, const char *const *args, int scans, uint64_t first_id,
                           void **other, long long *n_ok, long long *n_busy);
/* Asks sock for the stat `name` (th_stat) every 50 ms until it is at most `want`, for at most
 * timeout_ms: its last value. */
long long th_stat_wait_at_most(void *sock, const char *name, long long want, int timeout_ms);
/* The end of a test's daemon that may still run (a teardown after a failed test): SIGKILL and
 * reaped, its pid 0. */
void th_daemon_kill(th_daemon_t *d);
/* The end of a test's daemon as an operator would end it (a teardown): continued if stopped,
 * SIGTERM, SIGKILL after 10 s, reaped, its pid 0. Its exit runs, so that a coverage build writes
 * its counters (a daemon killed with SIGKILL loses everything it counted). */
void th_daemon_end(th_daemon_t *d);

/* One request, one reply in *reply (th_reply_free it): the reply's status, or -1 without a
 * reply. */
int th_call_reply_status(void *sock, const tally_req_t *req, const void *payload, size_t len,
                         th_reply_t *reply);
/* One request, one reply, only its status kept: the reply's status, or -1 without a reply. */
int th_call_status(void *sock, const tally_req_t *req, const void *payload, size_t len);

/* A query of `stream` (request id `id`): its record copied into out (at most cap bytes); the
 * record's length, or -1 when the name is invalid or no ok reply came. */
long th_query_raw(void *sock, const char *stream, uint64_t id, uint8_t *out, size_t cap);

/* One ping on a fresh th_connect socket: true when answered ok, with the ping's request id,
 * within timeout_ms. */
bool th_ping(const char *endpoint, int timeout_ms);

/* A request with the common fields set. */
tally_req_t th_req(uint8_t opcode, uint8_t dtype, uint64_t id);

/* req's frame into out: its header, naming `stream` (none when NULL), then len bytes of payload;
 * the frame's length, or 0 when the stream's name is not one a request may carry. */
size_t th_frame(tally_req_t req, const char *stream, const void *payload, size_t len, uint8_t *out);

/* The whole file at path, NUL-terminated, malloc'ed; NULL when it cannot be read. */
char *th_slurp(const char *path);
/* Writes len bytes to dir/name (created or truncated); 0, or -1. */
int th_write_file(const char *dir, const char *name, const void *data, size_t len);
/* HTTP: `method path` on 127.0.0.1:port over HTTP/1.0 with extra header lines (each ending in
 * \r\n; may be NULL); the whole response (status line, headers, body), malloc'ed and
 * NUL-terminated, or NULL when the connection fails. */
char *th_http_get(int port, const char *method, const char *path, const char *headers);
/* A TCP connection from src (a dotted IPv4 address, e.g. another loopback address 127.0.0.N;
 * NULL: any) to 127.0.0.1:port, or from an IPv6 address (src with a colon, e.g. "::1") to
 * [::1]:port; the descriptor, or -1. */
int th_tcp_connect_from(const char *src, int port);
/* Sends request (the whole HTTP request) from src (as above) and reads the response until the
 * server closes the connection: the response, malloc'ed and NUL-terminated, or NULL when the
 * connection fails or the response has not ended within timeout_ms (-1: no limit). */
char *th_http_exchange(int port, const char *src, const char *request, int timeout_ms);
/* The port of the daemon's metrics endpoint, from its log ("metrics: serving http://..."), or
 * -1. */
int th_metrics_port(const th_daemon_t *d);
/* The value of the line "NAME VALUE" of the daemon's /metrics (name with its labels); -1 when
 * absent or the endpoint does not answer. */
long long th_metric(const th_daemon_t *d, const char *name);
/* Runs a shell command (formatted like printf): its exit status, -1 when it did not exit. */
int th_sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* A CURVE key file in CZMQ's certificate format, as `tally keygen` writes it, with the public
 * key, the secret key or both (NULL: that line left out), made with `mode`; 0, or -1. */
int th_write_key_file(const char *path, const char *pub, const char *sec, mode_t mode);
/* A CURVE test's keys in dir: a server pair (its file DIR/server.key, mode 0600, in server_key)
 * and a client's, whose public half is DIR/clients/CLIENT.pub, the only key allowed (the
 * directory in clients); server_key and clients hold cap bytes. 0, or -1. */
int th_curve_dir(const char *dir, const char *client, char server_pub[41], char server_sec[41],
                 char client_pub[41], char client_sec[41], char *server_key, char *clients,
                 size_t cap);

/* Writes the time ms (decimal, ms since the epoch) to path atomically (a temporary file renamed
 * over it): the file a tallyd started with --test-clock reads its window clock from. */
int th_write_clock(const char *path, uint64_t ms);

/* Monotonic time in milliseconds, and a sleep of ms milliseconds (resumed after signals). */
int64_t th_now_ms(void);
void th_sleep_ms(int ms);

/* The `tally` CLI under test (th_tally_bin) run through sh in `dir`, so ARGS may redirect:
 * `tally -e ENDPOINT ARGS`; its exit status (-1 when it did not exit), stdout and stderr. */
typedef struct {
    int status;
    char *out;
    char *err;
} th_cli_t;
th_cli_t th_cli(const char *dir, const char *endpoint, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void th_cli_free(th_cli_t *r);

/* The `tally` CLI under test: $TALLY_BIN, or ./cli/tally. */
const char *th_tally_bin(void);

/* A fresh scratch directory /tmp/PREFIX-XXXXXX, its path in dir (cap bytes); 0, or -1. */
int th_tmpdir(char *dir, size_t cap, const char *prefix);
/* Removes dir and all in it (rm -rf); 0, or -1. */
int th_rmrf(const char *dir);
/* What most suites' teardowns do: stop d with SIGTERM (timeout_ms), then remove dir; 0 when
 * the daemon exited 0 and the directory is gone, else -1. */
int th_daemon_teardown(th_daemon_t *d, int timeout_ms, const char *dir);

/* Seeded xorshift so failures reproduce: the seed is printed by th_seed(). */
uint64_t th_seed(void);
uint64_t th_rand(void);
/* n values uniform in [lo, hi] from th_rand, malloc'ed with room for one more (n may be 0);
 * aborts when out of memory. */
int32_t *th_random_i32(size_t n, int64_t lo, int64_t hi);
/* True when the len bytes at le are the n little-endian uint64_t of expect (a histogram as a
 * reply or tally_run carries it); the first difference is printed on stderr. */
bool th_u64s_equal(const uint8_t *le, size_t len, const uint64_t *expect, size_t n);
/* qsort's order of int32_t and of int64_t. */
int th_cmp_i32(const void *a, const void *b);
int th_cmp_i64(const void *a, const void *b);

#endif
