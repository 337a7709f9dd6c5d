/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_security.c — CURVE authentication and protected mode (PROTOCOL.md §12), against the real
 * tallyd:
 *   - a client whose key is allowed (from curve_clients_dir, or the curve_clients list) is
 *     served, over tcp and ipc (whose socket tallyd makes 0660 whatever its umask), and counted
 *     under its user id;
 *   - an unknown key, no key at all, and a wrong server key are refused (no reply) and counted
 *     in tallyd_auth_total{result};
 *   - under CURVE the per-client limits count a key's streams across its connections;
 *   - SIGHUP re-reads the allowed keys: a key added to the configuration is then served;
 *   - a secret key file that group or others can read stops tallyd at start;
 *   - protected mode: a network bind without CURVE, or metrics on a network address without
 *     basic auth, is refused at start with a message saying how to set up keys; allowed (with a
 *     warning) when protected_mode is off; a network bind with CURVE starts; the metrics
 *     endpoint with an auth file answers 401 without the right credentials.
 */
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include <cmocka.h>

#include "harness.h"
#include "td_config.h"
#include "tally.h"
#include "tally_keys.h"

#define KEY 41              /* Z85 and its NUL */
#define REFUSED_WAIT_MS 700 /* how long a refused client waits for a reply that never comes */
#define COUNT_WAIT_MS 10000 /* the monitor counts a refusal shortly after it happens */

static char dir[64];
static char server_pub[KEY], server_sec[KEY];
static char alice_pub[KEY], alice_sec[KEY]; /* allowed, from the directory */
static char bob_pub[KEY], bob_sec[KEY];     /* not allowed (until the reload test adds him) */
static char server_key_path[128], clients_dir[128];
static th_daemon_t daemon_;

static void write_key(const char *path, const char *pub, const char *sec, mode_t mode)
{
    assert_int_equal(th_write_key_file(path, pub, sec, mode), 0);
}

static int setup(void **state)
{
    (void)state;
    th_seed();
    snprintf(dir, sizeof dir, "/tmp/tallyd-security-XXXXXX");
    assert_non_null(mkdtemp(dir));
    assert_int_equal(zmq_curve_keypair(server_pub, server_sec), 0);
    assert_int_equal(zmq_curve_keypair(alice_pub, alice_sec), 0);
    assert_int_equal(zmq_curve_keypair(bob_pub, bob_sec), 0);
    snprintf(server_key_path, sizeof server_key_path, "%s/server.key", dir);
    write_key(server_key_path, server_pub, server_sec, 0600);
    snprintf(clients_dir, sizeof clients_dir, "%s/clients", dir);
    assert_int_equal(mkdir(clients_dir, 0700), 0);
    char path[256];
    snprintf(path, sizeof path, "%s/alice.pub", clients_dir);
    write_key(path, alice_pub, NULL, 0644);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    return th_rmrf(dir);
}

static int stop_daemon(void **state)
{
    (void)state;
    th_use_curve(NULL, NULL, NULL);
    th_daemon_kill(&daemon_);
    return 0;
}

/* Starts tallyd with CURVE (the server key, the clients directory) plus extra arguments; the
 * harness's own sockets use alice's keys. */
static void start_curve(const char *extra1, const char *extra2)
{
    const char *args[] = {"--curve-secret-key",
                          server_key_path,
                          "--curve-clients-dir",
                          clients_dir,
                          extra1,
                          extra2,
                          NULL};
    th_use_curve(server_pub, alice_pub, alice_sec);
    assert_int_equal(th_daemon_start(&daemon_, args), 0);
}

/* Starts daemon_ with --bind tcp://0.0.0.0:PORT (in endpoint, cap bytes) and args
 * (NULL-terminated), on a port chosen anew until one binds: another test's process may take a
 * port the moment after it was chosen. The port, or -1 when five failed. */
static int start_open_bind(const char *const *args, char *endpoint, size_t cap)
{
    for (int i = 0; i < 5; i++) {
        int port = th_free_port();
        snprintf(endpoint, cap, "tcp://0.0.0.0:%d", port);
        const char *bind[] = {"--bind", endpoint, NULL};
        if (th_daemon_start_with(&daemon_, bind, args) == 0)
            return port;
    }
    return -1;
}

/* A ping from a socket with these keys (NULL server: no CURVE): true when answered. */
static bool ping_as(const char *endpoint, const char *server, const char *pub, const char *sec,
                    int timeout_ms)
{
    th_use_curve(server, pub, sec);
    bool ok = th_ping(endpoint, timeout_ms);
    th_use_curve(server_pub, alice_pub, alice_sec);
    return ok;
}

/* Polls a stats counter (asked as alice) until it reaches at least `want`; returns its value. */
static long long wait_stat(const char *name, long long want)
{
    void *sock = th_connect(daemon_.endpoint, 5000);
    long long value = -1;
    for (int waited = 0; waited < COUNT_WAIT_MS; waited += 50) {
        value = th_stat(sock, name);
        if (value >= want)
            break;
        usleep(50000);
    }
    th_close(sock);
    return value;
}

/* Refused handshakes that never reached the ZAP handler: no_curve + bad_handshake. */
static long long failed_handshakes(void)
{
    void *sock = th_connect(daemon_.endpoint, 5000);
    long long n = th_stat(sock, "tallyd_auth_total{result=\"no_curve\"}") +
                  th_stat(sock, "tallyd_auth_total{result=\"bad_handshake\"}");
    th_close(sock);
    return n;
}

static long long wait_failed_handshakes(long long want)
{
    long long n = failed_handshakes();
    for (int waited = 0; n < want && waited < COUNT_WAIT_MS; waited += 50) {
        usleep(50000);
        n = failed_handshakes();
    }
    return n;
}

static void test_allowed_key_served(void **state)
{
    (void)state;
    start_curve(NULL, NULL);
    void *sock = th_connect(daemon_.endpoint, 5000);
    uint8_t bytes[3] = {1, 2, 2};
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 7);
    assert_int_equal(tally_req_set_stream(&req, "cam0"), TALLY_OK);
    th_reply_t reply;
    assert_int_equal(th_call_reply_status(sock, &req, bytes, sizeof bytes, &reply), TALLY_OK);
    assert_int_equal(reply.len, 256 * 8);
    uint64_t bin2;
    memcpy(&bin2, reply.payload + 2 * 8, 8);
    assert_int_equal(bin2, 2);
    th_reply_free(&reply);
    /* Counted under the key's name: the start-up ping, the hist, and this stats request. */
    assert_true(th_stat(sock, "tallyd_client_requests_total{client=\"alice\"}") >= 3);
    assert_true(th_stat(sock, "tallyd_auth_total{result=\"allowed\"}") >= 1);
    tally_req_t info = th_req(TALLY_OP_INFO, TALLY_DTYPE_NONE, 8);
    assert_int_equal(th_call(sock, &info, NULL, 0, &reply), 0);
    assert_non_null(strstr((const char *)reply.payload, "\ncurve=on\n"));
    th_reply_free(&reply);
    th_close(sock);
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 10000), 0);
    assert_true(th_daemon_log_contains(&daemon_, "curve: client 'alice' connected"));
}

static void test_unknown_no_and_wrong_server_key_refused(void **state)
{
    (void)state;
    start_curve(NULL, NULL);
    /* The pings start-up made: more than one when a slow start let one time out unanswered. */
    const char *pings = "tallyd_requests_total{op=\"ping\",status=\"ok\"}";
    long long started = wait_stat(pings, 1);
    char other_pub[KEY], other_sec[KEY];
    assert_int_equal(zmq_curve_keypair(other_pub, other_sec), 0);
    /* An unknown key, no CURVE at all, and alice's own key against another server key. */
    assert_false(ping_as(daemon_.endpoint, server_pub, bob_pub, bob_sec, REFUSED_WAIT_MS));
    assert_int_equal(wait_stat("tallyd_auth_total{result=\"unknown_key\"}", 1), 1);
    /* A client without keys is seen as a mechanism mismatch, unless it hangs up first (it sees
     * the mismatch too), which tallyd can only count as a failed handshake: either way a
     * refusal more. */
    long long before = failed_handshakes();
    assert_false(ping_as(daemon_.endpoint, NULL, NULL, NULL, REFUSED_WAIT_MS));
    assert_true(wait_failed_handshakes(before + 1) > before);
    before = failed_handshakes();
    assert_false(ping_as(daemon_.endpoint, other_pub, alice_pub, alice_sec, REFUSED_WAIT_MS));
    assert_true(wait_stat("tallyd_auth_total{result=\"bad_handshake\"}", 1) >= 1);
    assert_true(wait_failed_handshakes(before + 1) > before);
    /* Nothing of theirs reached the server: only alice's requests are counted. */
    assert_true(ping_as(daemon_.endpoint, server_pub, alice_pub, alice_sec, 5000));
    assert_int_equal(wait_stat(pings, started + 1), started + 1);
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 10000), 0);
    assert_true(th_daemon_log_contains(&daemon_, bob_pub)); /* the refused key is logged */
}

/* Under CURVE a client is its key, whatever connections it uses: alice's streams count together
 * across two connections (max_streams_per_client), and her refusals are counted under her name. */
static void test_limits_per_user_across_connections(void **state)
{
    (void)state;
    start_curve("--max-streams-per-client", "2");
    void *one = th_connect(daemon_.endpoint, 5000);
    void *two = th_connect(daemon_.endpoint, 5000);
    uint8_t byte = 1;
    const char *names[] = {"u0", "u1", "u2"};
    void *socks[] = {one, two, two};
    for (int i = 0; i < 3; i++) {
        tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 30 + (uint64_t)i);
        assert_int_equal(tally_req_set_stream(&req, names[i]), TALLY_OK);
        th_reply_t reply;
        assert_int_equal(th_call(socks[i], &req, &byte, 1, &reply), 0);
        assert_int_equal(reply.rep.status, i < 2 ? TALLY_OK : TALLY_E_CLIENT_STREAMS);
        th_reply_free(&reply);
    }
    assert_int_equal(th_stat(one, "tallyd_client_limited_total{client=\"alice\"}"), 1);
    assert_int_equal(th_stat(one, "tallyd_limited_total{reason=\"client_streams\"}"), 1);
    th_close(one);
    th_close(two);
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 10000), 0);
}

/* The allowed keys are read again on SIGHUP: bob, added to the file's list, is then served. */
static void test_reload_adds_a_key(void **state)
{
    (void)state;
    char conf[160];
    snprintf(conf, sizeof conf, "%s/tallyd.conf", dir);
    FILE *f = fopen(conf, "w");
    fprintf(f, "[security]\ncurve_secret_key = %s\ncurve_clients = alice:%s\n", server_key_path,
            alice_pub);
    fclose(f);
    const char *args[] = {"--config", conf, NULL};
    th_use_curve(server_pub, alice_pub, alice_sec);
    assert_int_equal(th_daemon_start(&daemon_, args), 0);
    assert_false(ping_as(daemon_.endpoint, server_pub, bob_pub, bob_sec, REFUSED_WAIT_MS));

    f = fopen(conf, "w");
    fprintf(f, "[security]\ncurve_secret_key = %s\ncurve_clients = alice:%s,bob:%s\n",
            server_key_path, alice_pub, bob_pub);
    fclose(f);
    kill(daemon_.pid, SIGHUP);
    bool served = false;
    for (int i = 0; i < 20 && !served; i++)
        served = ping_as(daemon_.endpoint, server_pub, bob_pub, bob_sec, 500);
    assert_true(served);
    assert_true(wait_stat("tallyd_client_requests_total{client=\"bob\"}", 1) >= 1);
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 10000), 0);
    assert_true(th_daemon_log_contains(&daemon_, "curve client keys: 1 -> 2"));
}

/* CURVE on an ipc endpoint (the harness's tcp one beside it). */
static void test_curve_on_ipc(void **state)
{
    (void)state;
    char endpoint[160];
    snprintf(endpoint, sizeof endpoint, "ipc://%s/tallyd.sock", dir);
    mode_t old = umask(0077); /* as under systemd's UMask=0077: tallyd still makes it 0660 */
    start_curve("--bind", endpoint);
    umask(old);
    struct stat sb;
    assert_int_equal(stat(endpoint + 6, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0660);
    assert_true(ping_as(endpoint, server_pub, alice_pub, alice_sec, 5000));
    assert_false(ping_as(endpoint, server_pub, bob_pub, bob_sec, REFUSED_WAIT_MS));
    assert_false(ping_as(endpoint, NULL, NULL, NULL, REFUSED_WAIT_MS));
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 10000), 0);
}

/* Runs tallyd to its exit (it is expected to refuse to start); returns the exit status and
 * leaves its stderr in log. */
static int run_refused(const char *const *args, const char *log)
{
    const char *argv[32];
    int argc = 0;
    for (int i = 0; args[i] && argc < 26; i++)
        argv[argc++] = args[i];
    argv[argc++] = "--backend";
    argv[argc++] = "cpu";
    argv[argc++] = "--shm"; /* not the default side channel: another test run's tallyd may */
    argv[argc++] = "off";   /* hold it, and this one would refuse for that reason instead */
    argv[argc] = NULL;
    return th_daemon_run_to_exit(argv, log, 20000);
}

static bool file_contains(const char *path, const char *text)
{
    FILE *f = fopen(path, "r");
    static char buf[65536];
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f)
        fclose(f);
    buf[n] = '\0';
    return strstr(buf, text) != NULL;
}

static void test_secret_key_must_be_private(void **state)
{
    (void)state;
    char path[160], log[160], endpoint[160];
    snprintf(path, sizeof path, "%s/open.key", dir);
    snprintf(log, sizeof log, "%s/open.log", dir);
    write_key(path, server_pub, server_sec, 0644);
    /* An ipc:// endpoint in the test's directory: a TCP port picked before could be another
     * process's by the time tallyd binds it, and the refusal asserted is about the key. */
    snprintf(endpoint, sizeof endpoint, "ipc://%s/open.sock", dir);
    const char *args[] = {"--bind", endpoint, "--curve-secret-key", path, "--shm", "off", NULL};
    assert_int_not_equal(run_refused(args, log), 0);
    assert_true(file_contains(log, "chmod 600"));
    /* A public key file is no secret key either, whatever its mode (said before the mode). */
    write_key(path, server_pub, NULL, 0600);
    assert_int_not_equal(run_refused(args, log), 0);
    assert_true(file_contains(log, "no secret-key"));
    assert_int_equal(chmod(path, 0644), 0);
    assert_int_not_equal(run_refused(args, log), 0);
    assert_true(file_contains(log, "no secret-key"));
    assert_false(file_contains(log, "chmod 600"));
}

static void test_protected_mode(void **state)
{
    (void)state;
    char log[160], endpoint[64];
    snprintf(log, sizeof log, "%s/protected.log", dir);
    int port = th_free_port();
    snprintf(endpoint, sizeof endpoint, "tcp://0.0.0.0:%d", port);
    /* Refused, saying how to set up keys; --check-config says the same. */
    const char *bare[] = {"--bind", endpoint, "--shm", "off", NULL};
    assert_int_equal(run_refused(bare, log), 2);
    /* At priority err, as every refused start (docs/service.md: `<3>tallyd: MESSAGE`). */
    assert_true(
        file_contains(log, "<3>tallyd: protected mode: refusing to listen on tcp://0.0.0.0"));
    assert_true(file_contains(log, "tally keygen"));
    const char *bad_list[] = {"--curve-clients", "cam1:not-a-key", "--check-config", NULL};
    assert_int_equal(run_refused(bad_list, log), 2);
    assert_true(file_contains(log, "invalid value 'cam1:not-a-key'"));
    const char *check[] = {"--bind", endpoint, "--check-config", NULL};
    assert_int_equal(run_refused(check, log), 2);
    assert_true(file_contains(log, "protected mode"));

    /* Explicitly allowed: it starts, with a warning. */
    const char *open_args[] = {"--protected-mode", "off", NULL};
    assert_true(start_open_bind(open_args, endpoint, sizeof endpoint) > 0);
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 10000), 0);
    assert_true(th_daemon_log_contains(&daemon_, "protected_mode is off: tcp://0.0.0.0"));

    /* With CURVE a network bind is fine, and clients with keys reach it. */
    const char *curve_args[] = {"--curve-secret-key", server_key_path, "--curve-clients-dir",
                                clients_dir, NULL};
    th_use_curve(server_pub, alice_pub, alice_sec);
    port = start_open_bind(curve_args, endpoint, sizeof endpoint);
    assert_true(port > 0);
    char local[64];
    snprintf(local, sizeof local, "tcp://127.0.0.1:%d", port);
    assert_true(ping_as(local, server_pub, alice_pub, alice_sec, 5000));
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 10000), 0);
    assert_false(th_daemon_log_contains(&daemon_, "protected_mode is off"));
}

static void test_metrics_protected_mode_and_basic_auth(void **state)
{
    (void)state;
    char log[160], listen[64], auth[160];
    snprintf(log, sizeof log, "%s/metrics.log", dir);
    /* Refused before anything is bound: neither port nor endpoint is taken. */
    snprintf(listen, sizeof listen, "0.0.0.0:%d", th_free_port());
    char endpoint[160];
    snprintf(endpoint, sizeof endpoint, "ipc://%s/metrics.sock", dir);
    const char *bare[] = {"--bind", endpoint, "--metrics", listen, "--shm", "off", NULL};
    assert_int_equal(run_refused(bare, log), 2);
    assert_true(file_contains(log, "refusing to serve metrics on 0.0.0.0"));
    assert_true(file_contains(log, "auth_file"));

    snprintf(auth, sizeof auth, "%s/metrics.auth", dir);
    FILE *f = fopen(auth, "w");
    fprintf(f, "tally:s3cret\n");
    fclose(f);
    assert_int_equal(chmod(auth, 0600), 0);
    /* Its port chosen anew until one binds: another process may take one the moment after. */
    int port = -1;
    for (int i = 0; i < 5 && port < 0; i++) {
        port = th_free_port();
        snprintf(listen, sizeof listen, "0.0.0.0:%d", port);
        const char *args[] = {"--metrics", listen, "--metrics-auth-file", auth, NULL};
        if (th_daemon_start(&daemon_, args) != 0)
            port = -1;
    }
    assert_true(port > 0);
    char *resp = th_http_get(port, "GET", "/metrics", NULL);
    assert_non_null(resp);
    assert_non_null(strstr(resp, " 401 "));
    assert_non_null(strstr(resp, "WWW-Authenticate: Basic"));
    free(resp);
    resp = th_http_get(port, "GET", "/metrics", "Authorization: Basic dGFsbHk6d3Jvbmc=\r\n");
    assert_non_null(strstr(resp, " 401 "));
    free(resp);
    resp = th_http_get(port, "GET", "/metrics", "Authorization: Basic dGFsbHk6czNjcmV0\r\n");
    assert_non_null(strstr(resp, " 200 "));
    assert_non_null(strstr(resp, "tallyd_requests_total"));
    free(resp);
    /* The health probe needs no credentials (it tells only ok / draining / gpu lost). */
    resp = th_http_get(port, "GET", "/healthz", NULL);
    assert_non_null(strstr(resp, " 200 "));
    assert_non_null(strstr(resp, "\r\n\r\nok\n"));
    free(resp);
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 10000), 0);

    /* The password file, like a secret key, must be private. */
    assert_int_equal(chmod(auth, 0640), 0);
    snprintf(listen, sizeof listen, "127.0.0.1:0");
    const char *open_file[] = {"--bind", endpoint, "--metrics", listen, "--metrics-auth-file",
                               auth,     "--shm",  "off",       NULL};
    assert_int_not_equal(run_refused(open_file, log), 0);
    assert_true(file_contains(log, "chmod 600"));
}

/* libtally: keys from the user's configuration file, the environment, or arguments. */
static void test_libtally_curve_keys(void **state)
{
    (void)state;
    char home[160], conf_dir[200], conf[240], alice_key[160], bob_key[160], server_file[160];
    snprintf(home, sizeof home, "%s/home", dir);
    snprintf(conf_dir, sizeof conf_dir, "%s/.config", home);
    mkdir(home, 0700);
    mkdir(conf_dir, 0700);
    snprintf(conf_dir, sizeof conf_dir, "%s/.config/tally", home);
    mkdir(conf_dir, 0700);
    snprintf(conf, sizeof conf, "%s/tally.conf", conf_dir);
    snprintf(alice_key, sizeof alice_key, "%s/alice.key", dir);
    snprintf(bob_key, sizeof bob_key, "%s/bob.key", dir);
    snprintf(server_file, sizeof server_file, "%s/server.pub", dir);
    write_key(alice_key, alice_pub, alice_sec, 0600);
    write_key(bob_key, bob_pub, bob_sec, 0600);
    write_key(server_file, server_pub, NULL, 0644);
    setenv("HOME", home, 1);
    unsetenv("XDG_CONFIG_HOME");
    unsetenv("TALLY_SERVER_KEY");
    unsetenv("TALLY_CLIENT_KEY");
    tally_curve_keys_t keys;
    char msg[512];
    /* Nothing configured: CURVE off. */
    assert_int_equal(tally_curve_keys_load(NULL, NULL, &keys, msg, sizeof msg), TALLY_OK);
    assert_string_equal(keys.server_public, "");

    FILE *f = fopen(conf, "w");
    fprintf(f, "# tally's keys\nserver_key = %s\nclient_key = %s\n", server_file, alice_key);
    fclose(f);
    start_curve(NULL, NULL);
    tally_client_t *client = NULL;
    assert_int_equal(tally_curve_keys_load(NULL, NULL, &keys, msg, sizeof msg), TALLY_OK);
    assert_string_equal(keys.server_public, server_pub);
    assert_string_equal(keys.client_public, alice_pub);
    long long failed = failed_handshakes();
    assert_int_equal(tally_client_new_curve(daemon_.endpoint, 5000, &keys, &client), TALLY_OK);
    assert_int_equal(tally_ping(client, NULL), TALLY_OK);
    tally_client_destroy(&client);
    /* The keys were set before connecting: no plain handshake was tried (and refused) first. */
    assert_int_equal(failed_handshakes(), failed);

    /* The environment wins over the file: bob is not allowed, so no answer. */
    setenv("TALLY_CLIENT_KEY", bob_key, 1);
    assert_int_equal(tally_curve_keys_load(NULL, NULL, &keys, msg, sizeof msg), TALLY_OK);
    assert_string_equal(keys.client_public, bob_pub);
    assert_int_equal(tally_client_new_curve(daemon_.endpoint, REFUSED_WAIT_MS, &keys, &client),
                     TALLY_OK);
    assert_int_equal(tally_ping(client, NULL), TALLY_E_TIMEOUT);
    tally_client_destroy(&client);
    /* Arguments win over both; a server key may be given as the key itself. */
    assert_int_equal(tally_curve_keys_load(server_pub, alice_key, &keys, msg, sizeof msg),
                     TALLY_OK);
    assert_string_equal(keys.client_public, alice_pub);
    assert_int_equal(tally_client_new_curve(daemon_.endpoint, 5000, &keys, &client), TALLY_OK);
    assert_int_equal(tally_ping(client, NULL), TALLY_OK);
    tally_client_destroy(&client);

    /* Mistakes are named: a readable secret key, a server key without a client key. */
    assert_int_equal(chmod(alice_key, 0644), 0);
    assert_int_equal(tally_curve_keys_load(server_pub, alice_key, &keys, msg, sizeof msg),
                     TALLY_E_ARG);
    assert_non_null(strstr(msg, "chmod 600"));
    /* The public file given as the client key: what it holds is said first, not its mode
     * (a chmod of a .pub file would only lead to the next error). */
    assert_int_equal(tally_curve_keys_load(server_pub, server_file, &keys, msg, sizeof msg),
                     TALLY_E_ARG);
    assert_non_null(strstr(msg, "holds no secret-key (is it the public file?)"));
    assert_null(strstr(msg, "chmod"));
    unsetenv("TALLY_CLIENT_KEY");
    unlink(conf);
    assert_int_equal(tally_curve_keys_load(server_pub, NULL, &keys, msg, sizeof msg), TALLY_E_ARG);
    assert_non_null(strstr(msg, "tally keygen"));
    assert_int_equal(tally_curve_keys_load("short", NULL, &keys, msg, sizeof msg), TALLY_E_IO);
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 10000), 0);
}

/* The CLI: `tally keygen` writes a pair (a private .key, a .pub), tallyd runs on its server key,
 * and `tally --server-key --client-key ping` is answered; without keys it gets no reply. */

static void test_cli_keygen_and_keys(void **state)
{
    (void)state;
    const char *tally = getenv("TALLY_BIN");
    if (!tally) {
        print_message("TALLY_BIN not set: cannot run the CLI\n");
        skip();
    }
    char base[160], cdir[160], path[200], pub[KEY], sec[KEY];
    FILE *f;
    snprintf(base, sizeof base, "%s/cli-server", dir);
    snprintf(cdir, sizeof cdir, "%s/cli-clients", dir);
    assert_int_equal(mkdir(cdir, 0700), 0);
    assert_int_equal(th_sh("%s keygen %s >%s/keygen.out", tally, base, dir), 0);
    assert_int_equal(th_sh("%s keygen %s 2>/dev/null", tally, base), 2); /* never overwrites */
    assert_int_equal(th_sh("cd %s && %s keygen cli-clients/cam1 >/dev/null", dir, tally), 0);
    /* Into a directory that does not exist: said, with what to do (it was a bare ENOENT). */
    assert_int_equal(th_sh("%s keygen %s/no-such-dir/server 2>%s/keygen.err", tally, dir, dir), 2);
    char said[512], want[512];
    snprintf(path, sizeof path, "%s/keygen.err", dir);
    f = fopen(path, "r");
    assert_non_null(fgets(said, sizeof said, f));
    fclose(f);
    snprintf(want, sizeof want,
             "tally: keygen: cannot create %s/no-such-dir/server.key: the directory "
             "%s/no-such-dir does not exist (make it first: mkdir -p %s/no-such-dir)\n",
             dir, dir, dir);
    assert_string_equal(said, want);
    struct stat sb;
    snprintf(path, sizeof path, "%s.key", base);
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0600);
    /* What it printed is the public key in both files; the .pub holds no secret. */
    char printed[64] = "";
    snprintf(path, sizeof path, "%s/keygen.out", dir);
    f = fopen(path, "r");
    assert_non_null(fgets(printed, sizeof printed, f));
    fclose(f);
    printed[strcspn(printed, "\n")] = '\0';
    char msg[256];
    snprintf(path, sizeof path, "%s.key", base);
    assert_int_equal(tally_key_file_read(path, true, pub, sec, msg, sizeof msg), TALLY_OK);
    assert_string_equal(pub, printed);
    snprintf(path, sizeof path, "%s.pub", base);
    assert_int_equal(tally_key_file_read(path, false, pub, sec, msg, sizeof msg), TALLY_OK);
    assert_string_equal(pub, printed);
    assert_string_equal(sec, "");

    /* tallyd on that key; the harness pings as cam1. */
    char cam_key[200], cam_pub_file[200], cam_pub[KEY], cam_sec[KEY], server_key[200];
    snprintf(cam_key, sizeof cam_key, "%s/cam1.key", cdir);
    snprintf(cam_pub_file, sizeof cam_pub_file, "%s/cam1.pub", cdir);
    assert_int_equal(tally_key_file_read(cam_key, true, cam_pub, cam_sec, msg, sizeof msg),
                     TALLY_OK);
    snprintf(server_key, sizeof server_key, "%s.key", base);
    const char *args[] = {"--curve-secret-key", server_key, "--curve-clients-dir", cdir, NULL};
    th_use_curve(printed, cam_pub, cam_sec);
    assert_int_equal(th_daemon_start(&daemon_, args), 0);
    unsetenv("TALLY_SERVER_KEY");
    unsetenv("TALLY_CLIENT_KEY");
    setenv("HOME", dir, 1); /* no ~/.config/tally/tally.conf there */
    assert_int_equal(th_sh("%s -e %s --server-key %s.pub --client-key %s ping >/dev/null", tally,
                           daemon_.endpoint, base, cam_key),
                     0);
    assert_int_equal(th_sh("TALLY_SERVER_KEY='%s' TALLY_CLIENT_KEY=%s %s -e %s ping >/dev/null",
                           printed, cam_key, tally, daemon_.endpoint),
                     0);
    assert_int_equal(th_sh("%s -e %s -t 500 ping 2>/dev/null", tally, daemon_.endpoint), 3);
    assert_int_equal(
        th_sh("%s -e %s --server-key %s.pub ping 2>/dev/null", tally, daemon_.endpoint, base),
        2); /* a server key without a client key */
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 10000), 0);
    assert_true(th_daemon_log_contains(&daemon_, "curve: client 'cam1' connected"));
}

/* A key of 40 Z85 characters that is no key: each 5 characters are a base-85 number that must
 * fit 32 bits ("%nSc0" is 2^32 - 1), and ZeroMQ decodes nothing above. tally_key_valid took it
 * for a key, so tallyd said "curve_clients: cannot add" for one in the list, and "curve: " and
 * nothing more for one in a client key file. Now refused where it is written: by the settings
 * (curve_clients), and in a key file with the file's name, at start and at a reload (which keeps
 * the keys it had). */
static void test_key_that_does_not_decode(void **state)
{
    (void)state;
    char top[KEY], over[KEY], percent[KEY];
    for (int i = 0; i < 8; i++) {
        memcpy(top + 5 * i, "%nSc0", 5);
        memcpy(over + 5 * i, i == 7 ? "%nSc1" : "%nSc0", 5);
    }
    memset(percent, '%', TALLY_KEY_LEN);
    top[TALLY_KEY_LEN] = over[TALLY_KEY_LEN] = percent[TALLY_KEY_LEN] = '\0';
    uint8_t bin[32];
    assert_true(tally_key_valid(top, TALLY_KEY_LEN)); /* as ZeroMQ has it */
    assert_non_null(zmq_z85_decode(bin, top));
    assert_false(tally_key_valid(over, TALLY_KEY_LEN));
    assert_null(zmq_z85_decode(bin, over));
    assert_false(tally_key_valid(percent, TALLY_KEY_LEN));

    /* In curve_clients: the settings' refusal, at start and by --check-config. */
    char log[160], item[80];
    snprintf(log, sizeof log, "%s/undecodable.log", dir);
    snprintf(item, sizeof item, "cam1:%s", over);
    const char *list[] = {
        "--curve-secret-key", server_key_path, "--curve-clients", item, "--check-config", NULL};
    assert_int_equal(run_refused(list, log), 2);
    assert_true(file_contains(log, "invalid value 'cam1:%nSc0"));

    /* In a client key file: its name and what is wrong with it. */
    char keys[160], bad[200], said[400];
    snprintf(keys, sizeof keys, "%s/undecodable-clients", dir);
    assert_int_equal(mkdir(keys, 0700), 0);
    snprintf(bad, sizeof bad, "%s/alice.pub", keys);
    write_key(bad, alice_pub, NULL, 0644);
    snprintf(bad, sizeof bad, "%s/cam1.pub", keys);
    write_key(bad, over, NULL, 0644);
    snprintf(said, sizeof said, "curve: %s: the public key is not 40 characters of Z85 text", bad);
    const char *from_dir[] = {"--curve-secret-key", server_key_path, "--curve-clients-dir", keys,
                              NULL};
    assert_int_not_equal(run_refused(from_dir, log), 0);
    assert_true(file_contains(log, said));

    /* The same file appearing at a reload: said, and the key allowed before still is. */
    assert_int_equal(unlink(bad), 0);
    th_use_curve(server_pub, alice_pub, alice_sec);
    assert_int_equal(th_daemon_start(&daemon_, from_dir), 0);
    write_key(bad, over, NULL, 0644);
    kill(daemon_.pid, SIGHUP);
    snprintf(said, sizeof said,
             "reload: %s: the public key is not 40 characters of Z85 text; keeping the 1 client "
             "keys allowed",
             bad);
    bool logged = false;
    for (int i = 0; i < 400 && !logged; i++, th_sleep_ms(50)) /* 20 s at most */
        logged = th_daemon_log_contains(&daemon_, said);
    assert_true(logged);
    assert_true(ping_as(daemon_.endpoint, server_pub, alice_pub, alice_sec, 5000));
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 10000), 0);
}

/* What protected mode counts as local: only loopback tcp, ipc and inproc. */
static void test_endpoint_is_local(void **state)
{
    (void)state;
    static const char *const local[] = {
        "tcp://127.0.0.1:5555", "tcp://127.1.2.3:1",
        "tcp://localhost:5555", "tcp://lo:5555",
        "tcp://[::1]:5555",     "ipc:///run/tallyd/tallyd.sock",
        "inproc://x",           "127.0.0.1:9464",
        "[::1]:9464",           "tcp://[::ffff:127.0.0.1]:5555",
    };
    static const char *const network[] = {
        "tcp://0.0.0.0:5555",   "tcp://*:5555",           "tcp://[::]:5555", "tcp://eth0:5555",
        "tcp://10.0.0.5:5555",  "tcp://example.org:5555", "0.0.0.0:9464",    "[::]:9464",
        "tcp://128.0.0.1:5555", "ws://127.0.0.1:5555",    "tcp://:5555",
    };
    for (size_t i = 0; i < sizeof local / sizeof local[0]; i++)
        if (!td_endpoint_is_local(local[i]))
            fail_msg("%s should count as local", local[i]);
    for (size_t i = 0; i < sizeof network / sizeof network[0]; i++)
        if (td_endpoint_is_local(network[i]))
            fail_msg("%s should count as a network endpoint", network[i]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_endpoint_is_local),
        cmocka_unit_test_teardown(test_allowed_key_served, stop_daemon),
        cmocka_unit_test_teardown(test_unknown_no_and_wrong_server_key_refused, stop_daemon),
        cmocka_unit_test_teardown(test_limits_per_user_across_connections, stop_daemon),
        cmocka_unit_test_teardown(test_reload_adds_a_key, stop_daemon),
        cmocka_unit_test_teardown(test_curve_on_ipc, stop_daemon),
        cmocka_unit_test_teardown(test_libtally_curve_keys, stop_daemon),
        cmocka_unit_test_teardown(test_cli_keygen_and_keys, stop_daemon),
        cmocka_unit_test(test_secret_key_must_be_private),
        cmocka_unit_test_teardown(test_protected_mode, stop_daemon),
        cmocka_unit_test_teardown(test_metrics_protected_mode_and_basic_auth, stop_daemon),
        cmocka_unit_test_teardown(test_key_that_does_not_decode, stop_daemon),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
