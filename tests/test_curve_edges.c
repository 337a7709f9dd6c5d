/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_curve_edges.c — CURVE (daemon/net/td_auth.c) where test_security.c does not go, against
 * the real tallyd:
 *   - a curve_clients_dir that does not exist, and a NAME.pub in it that holds no public key:
 *     tallyd refuses to start, saying which and why;
 *   - a server key file with only its secret key: tallyd derives the public half, says it, and a
 *     client that knows that public key is served;
 *   - a burst of refused clients (unknown keys, no CURVE, another server key): ten refusals a
 *     second are logged, the rest are counted in tallyd_auth_total under their own result and
 *     summed up in one line when the next second's first refusal comes;
 *   - SIGHUP while the clients directory is gone: the reload is refused with the reason and the
 *     keys allowed before stay allowed;
 *   - a clients directory with other files in it, and more keys than the first allocation
 *     holds: only NAME.pub counts, a long NAME is cut to 64 characters;
 *   - an abstract ipc endpoint (ipc://@NAME) is bound and served, and refused to a second
 *     tallyd while the first holds it;
 *   - a bare KEY in curve_clients is allowed, its client known by the key;
 *   - one key file more than the 65,536 keys tallyd holds: refused at start;
 *   - the ZAP handler itself (td_auth linked in, asked over inproc as libzmq asks it, RFC 27):
 *     an allowed CURVE key is answered 200 with its user id, and every request that is not a
 *     whole CURVE one (another mechanism, a key of 31 bytes, frames missing or too many) 400,
 *     each echoing its request id; td_auth_new's failures (no secret key file, a curve_clients
 *     list over the 65,536 keys, the ZAP endpoint taken, ZeroMQ out of sockets) say why.
 */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <cmocka.h>

#include "harness.h"
#include "td_auth.h"

#define KEY 41
#define BURST 30

static char dir[64], server_key[128], clients[128];
static char server_pub[KEY], server_sec[KEY], alice_pub[KEY], alice_sec[KEY];

static int setup(void **state)
{
    (void)state;
    if (th_tmpdir(dir, sizeof dir, "tally-curve-edges") != 0)
        return -1;
    return th_curve_dir(dir, "alice", server_pub, server_sec, alice_pub, alice_sec, server_key,
                        clients, sizeof server_key);
}

static int teardown(void **state)
{
    (void)state;
    th_use_curve(NULL, NULL, NULL);
    return th_rmrf(dir);
}

/* tallyd with CURVE and `key`/`clients_dir`, run to its exit: its status; its log in log. */
static int refused_start(const char *key, const char *clients_dir, char *log, size_t cap)
{
    const char *args[] = {"--curve-secret-key", key, "--curve-clients-dir", clients_dir, NULL};
    return th_run_refused(dir, args, log, cap, 20000);
}

static void test_clients_dir_unusable(void **state)
{
    (void)state;
    char log[128], missing[128], want[320];
    snprintf(missing, sizeof missing, "%s/none", dir);
    int status = refused_start(server_key, missing, log, sizeof log);
    assert_true(status > 0 && status < 128);
    snprintf(want, sizeof want,
             "curve_clients_dir (--curve-clients-dir): cannot read %s: No such file", missing);
    assert_true(th_file_contains(log, want));

    /* A NAME.pub that holds a secret key only. */
    char odd[128], path[192];
    snprintf(odd, sizeof odd, "%s/odd", dir);
    assert_int_equal(mkdir(odd, 0700), 0);
    snprintf(path, sizeof path, "%s/mallory.pub", odd);
    assert_int_equal(th_write_key_file(path, NULL, alice_sec, 0600), 0);
    status = refused_start(server_key, odd, log, sizeof log);
    assert_true(status > 0 && status < 128);
    snprintf(want, sizeof want, "%s holds no public-key", path);
    assert_true(th_file_contains(log, want));
}

static void test_bare_secret_key_derives_public(void **state)
{
    (void)state;
    char bare[128];
    snprintf(bare, sizeof bare, "%s/bare.key", dir);
    assert_int_equal(th_write_key_file(bare, NULL, server_sec, 0600), 0);
    const char *args[] = {"--curve-secret-key", bare, "--curve-clients-dir", clients, NULL};
    th_use_curve(server_pub, alice_pub, alice_sec);
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, args), 0); /* answered alice's ping: the key is right */
    char want[96];
    snprintf(want, sizeof want, "curve: on, server public key %s", server_pub);
    assert_true(th_daemon_log_contains(&d, want));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    th_use_curve(NULL, NULL, NULL);
}

/* The clients the server refuses, counted under tallyd_auth_total's results and logged with
 * their lines, all under one rate limit. Which of a mechanism mismatch and a hang-up the server
 * sees first for a client without CURVE is a race between the two ends (td_auth_event): either
 * result and line is that refusal's. */
typedef struct {
    const char *results[2]; /* tallyd_auth_total{result="..."}; the second may be NULL */
    const char *logged[2];  /* the refusal's log line, or the other */
} refusal_t;

static const refusal_t unknown_key = {{"unknown_key", NULL},
                                      {"is not allowed (curve_clients_dir", NULL}};
static const refusal_t no_curve = {{"no_curve", "bad_handshake"},
                                   {"does not use CURVE", "a client's handshake failed"}};
static const refusal_t wrong_server = {{"bad_handshake", NULL}, {"handshake failed", NULL}};

/* A DEALER the server refuses, sending a ping (never answered): with a fresh key pair the server
 * does not know, without CURVE, or with a server key that is not the server's. */
static void *stranger(const char *endpoint, const refusal_t *kind)
{
    char pub[KEY], sec[KEY];
    assert_int_equal(zmq_curve_keypair(pub, sec), 0);
    if (kind == &no_curve)
        th_use_curve(NULL, NULL, NULL);
    else if (kind == &wrong_server)
        th_use_curve(pub, alice_pub, alice_sec);
    else
        th_use_curve(server_pub, pub, sec);
    void *sock = th_connect(endpoint, 100);
    tally_req_t ping = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, 1);
    th_send_request(sock, &ping, NULL, 0);
    th_use_curve(server_pub, alice_pub, alice_sec);
    return sock;
}

/* The refusals of kind counted so far (its results summed). */
static long long counted(void *sock, const refusal_t *kind)
{
    long long sum = 0;
    for (int i = 0; i < 2 && kind->results[i]; i++) {
        char name[96];
        snprintf(name, sizeof name, "tallyd_auth_total{result=\"%s\"}", kind->results[i]);
        long long v = th_stat(sock, name);
        sum += v > 0 ? v : 0;
    }
    return sum;
}

/* Waits up to 20 s until `opened` refusals of kind are counted: exactly that many for a key
 * refused (ZAP's answer ends it), at least that many for a client without CURVE or with another
 * server key (ZeroMQ tries their handshakes again, each counted). */
static void assert_counted(void *alice, const refusal_t *kind, int opened)
{
    long long n = 0;
    for (int i = 0; i < 400 && (n = counted(alice, kind)) < opened; i++)
        th_sleep_ms(50);
    if (kind == &unknown_key ? n != opened : n < opened)
        fail_msg("%lld refusals counted as %s, %d clients refused", n, kind->results[0], opened);
}

/* Bursts of refused clients of one kind: every one counted, ten a second logged at most, the
 * rest summed in a line the next second. */
static void refusals_rate_limited(const refusal_t *kind)
{
    const char *args[] = {"--curve-secret-key", server_key, "--curve-clients-dir", clients, NULL};
    th_use_curve(server_pub, alice_pub, alice_sec);
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, args), 0);
    void *alice = th_connect(d.endpoint, 10000);
    /* Bursts until one second's refusals pass the ten it logs (a loaded box may spread a burst
     * over a second boundary). */
    void *socks[4 * BURST];
    int opened = 0;
    while (!th_daemon_log_contains(&d, "more refusals not logged") && opened < 4 * BURST) {
        for (int i = 0; i < BURST; i++)
            socks[opened++] = stranger(d.endpoint, kind);
        assert_counted(alice, kind, opened);
        th_sleep_ms(1100); /* the next second's first refusal says how many were left out */
        socks[opened++] = stranger(d.endpoint, kind);
        assert_counted(alice, kind, opened);
    }
    assert_true(th_daemon_log_contains(&d, "more refusals not logged (tallyd_auth_total counts"));
    assert_true(th_daemon_log_contains(&d, kind->logged[0]) ||
                (kind->logged[1] && th_daemon_log_contains(&d, kind->logged[1])));
    for (int i = 0; i < opened; i++)
        th_close(socks[i]);
    th_close(alice);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    th_use_curve(NULL, NULL, NULL);
}

static void test_refusals_rate_limited(void **state)
{
    (void)state;
    refusals_rate_limited(&unknown_key);
    refusals_rate_limited(&no_curve);
    refusals_rate_limited(&wrong_server);
}

static void test_reload_without_clients_dir_keeps_keys(void **state)
{
    (void)state;
    char moved[128];
    snprintf(moved, sizeof moved, "%s/clients-moved", dir);
    const char *args[] = {"--curve-secret-key", server_key, "--curve-clients-dir", clients, NULL};
    th_use_curve(server_pub, alice_pub, alice_sec);
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, args), 0);
    assert_int_equal(rename(clients, moved), 0);
    kill(d.pid, SIGHUP);
    char want[256];
    snprintf(want, sizeof want,
             "reload: curve_clients_dir %s: No such file or directory; keeping the 1 client keys "
             "allowed",
             clients);
    assert_true(th_daemon_wait_log(&d, want, 20000));
    assert_true(th_ping(d.endpoint, 5000)); /* alice, still allowed */
    assert_int_equal(rename(moved, clients), 0);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    th_use_curve(NULL, NULL, NULL);
}

/* A clients directory as people leave it: a README, a hidden .pub, a backup, 20 keys (more than
 * the first allocation of the set holds), and a key file whose name is longer than a user id:
 * only NAME.pub files count, and the long name is cut to 64 characters (as the user it is
 * counted under). */
static void test_clients_dir_as_found(void **state)
{
    (void)state;
    char many[128], path[256], pub[KEY], sec[KEY];
    snprintf(many, sizeof many, "%s/many", dir);
    assert_int_equal(mkdir(many, 0700), 0);
    for (int i = 0; i < 20; i++) {
        assert_int_equal(zmq_curve_keypair(pub, sec), 0);
        snprintf(path, sizeof path, "%s/cam%d.pub", many, i);
        assert_int_equal(th_write_key_file(path, pub, NULL, 0644), 0);
    }
    const char *skipped[] = {"README", ".hidden.pub", "alice.pub.bak", ".pub", "pub"};
    for (int i = 0; i < 5; i++) {
        snprintf(path, sizeof path, "%s/%s", many, skipped[i]);
        assert_int_equal(th_write_key_file(path, "not a key", NULL, 0644), 0);
    }
    char name[80];
    memset(name, 'n', 70);
    name[70] = '\0';
    snprintf(path, sizeof path, "%s/%s.pub", many, name);
    assert_int_equal(th_write_key_file(path, alice_pub, NULL, 0644), 0);
    const char *args[] = {"--curve-secret-key", server_key, "--curve-clients-dir", many, NULL};
    th_use_curve(server_pub, alice_pub, alice_sec);
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, args), 0); /* alice's key, under the long name */
    assert_true(th_daemon_log_contains(&d, "curve: on, server public key"));
    assert_true(th_daemon_log_contains(&d, "21 client keys allowed"));
    char want[96];
    snprintf(want, sizeof want, "curve: client '%.64s' connected", name);
    assert_true(th_daemon_log_contains(&d, want));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    th_use_curve(NULL, NULL, NULL);
}

/* curve_clients with a bare KEY (no NAME:): the key is allowed, and its client is known by the
 * key itself (its user id, PROTOCOL.md §12); a NAME:KEY item beside it keeps its name. */
static void test_clients_list_bare_key(void **state)
{
    (void)state;
    char pub[KEY], sec[KEY], list[160];
    assert_int_equal(zmq_curve_keypair(pub, sec), 0);
    snprintf(list, sizeof list, "%s,cam9:%s", alice_pub, pub);
    const char *args[] = {"--curve-secret-key", server_key, "--curve-clients", list, NULL};
    th_use_curve(server_pub, alice_pub, alice_sec);
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, args), 0); /* answered alice's ping */
    assert_true(th_daemon_log_contains(&d, "2 client keys allowed"));
    char want[96];
    snprintf(want, sizeof want, "curve: client '%s' connected", alice_pub);
    assert_true(th_daemon_log_contains(&d, want));
    th_use_curve(server_pub, pub, sec);
    assert_true(th_ping(d.endpoint, 5000));
    assert_true(th_daemon_log_contains(&d, "curve: client 'cam9' connected"));
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    th_use_curve(NULL, NULL, NULL);
}

/* More client keys than tallyd holds (65,536, PROTOCOL.md §12): a clients directory with one
 * more NAME.pub is refused at start, naming the file and the bound (the same key in every file:
 * the set holds keys, it does not tell them apart). */
static void test_clients_over_the_bound(void **state)
{
    (void)state;
    char over[128], path[192], log[128], want[256];
    snprintf(over, sizeof over, "%s/over", dir);
    assert_int_equal(mkdir(over, 0700), 0);
    for (int i = 0; i <= 65536; i++) {
        snprintf(path, sizeof path, "%s/k%d.pub", over, i);
        assert_int_equal(th_write_key_file(path, alice_pub, NULL, 0644), 0);
    }
    int status = refused_start(server_key, over, log, sizeof log);
    assert_true(status > 0 && status < 128);
    snprintf(want, sizeof want, ".pub: cannot hold its key (out of memory, or over 65536 keys)");
    assert_true(th_file_contains(log, want));
    assert_int_equal(th_rmrf(over), 0);
}

/* An abstract ipc endpoint (ipc://@NAME, no file): bound and served, no file mode to set; a
 * second tallyd on the same name is refused it ("Address already in use", without the hint of
 * a TCP port's `ss -ltnp`: there is no port) and exits non-zero. */
static void test_abstract_ipc(void **state)
{
    (void)state;
    char endpoint[64];
    snprintf(endpoint, sizeof endpoint, "ipc://@tally-37-%d", (int)getpid());
    const char *args[] = {"--bind", endpoint, NULL};
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, args), 0);
    assert_true(th_ping(endpoint, 5000));
    char log[128], want[128];
    const char *again[] = {"--bind", endpoint, NULL};
    int status = th_run_refused(dir, again, log, sizeof log, 20000);
    assert_true(status > 0 && status < 128);
    snprintf(want, sizeof want, "cannot bind %s: Address already in use\n", endpoint);
    assert_true(th_file_contains(log, want));
    assert_false(th_file_contains(log, "ss -ltnp"));
    assert_true(th_ping(endpoint, 5000)); /* the first one's still */
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* ---- The ZAP handler, asked directly --------------------------------------------------------- */

#define ZAP "inproc://zeromq.zap.01"

/* One ZAP request of n frames (sizes[i] bytes of frames[i]) from req: the answer's status code
 * (its version, request id, text and metadata checked here), its user id in user. */
static int zap_ask(void *req, const char *const *frames, const size_t *sizes, int n, char *user,
                   size_t user_cap)
{
    for (int i = 0; i < n; i++)
        assert_int_equal(zmq_send(req, frames[i], sizes[i], i + 1 < n ? ZMQ_SNDMORE : 0),
                         (int)sizes[i]);
    char f[6][80];
    int len[6];
    for (int i = 0; i < 6; i++) {
        len[i] = zmq_recv(req, f[i], sizeof f[i] - 1, 0);
        assert_true(len[i] >= 0 && len[i] < (int)sizeof f[i]); /* 10 s at most: RCVTIMEO */
        f[i][len[i]] = '\0';
        int more = 0;
        size_t size = sizeof more;
        assert_int_equal(zmq_getsockopt(req, ZMQ_RCVMORE, &more, &size), 0);
        assert_int_equal(more, i < 5);
    }
    assert_string_equal(f[0], "1.0");
    assert_int_equal(len[1], (int)sizes[1]); /* the request id, echoed */
    assert_memory_equal(f[1], frames[1], sizes[1]);
    assert_int_equal(len[5], 0); /* no metadata */
    snprintf(user, user_cap, "%s", f[4]);
    int status = atoi(f[2]);
    assert_string_equal(f[3], status == 200 ? "OK" : "key not allowed");
    return status;
}

/* A CURVE request for key (32 bytes) from address, with `extra` frames after it, the mechanism
 * and the key's length changed as asked: the answer's status, its user id in user. */
static int zap_curve(void *req, const char *mechanism, const uint8_t *key, size_t key_len,
                     const char *address, int frames, char *user, size_t cap)
{
    static unsigned id;
    char rid[16];
    snprintf(rid, sizeof rid, "req-%u", ++id);
    const char *f[9] = {"1.0", rid, "tallyd", address, "", mechanism, (const char *)key, "", ""};
    size_t s[9] = {3, strlen(rid), 6, strlen(address), 0, strlen(mechanism), key_len, 0, 0};
    return zap_ask(req, f, s, frames, user, cap);
}

static td_config_t curve_config(const char *clients_dir, const char *list)
{
    return (td_config_t){.curve_secret_key = server_key,
                         .curve_clients_dir = (char *)clients_dir,
                         .curve_clients = (char *)list};
}

static void test_zap_answers(void **state)
{
    (void)state;
    void *ctx = zmq_ctx_new();
    void *router = zmq_socket(ctx, ZMQ_ROUTER);
    td_config_t cfg = curve_config(clients, NULL);
    char msg[256];
    td_auth_t *auth = NULL;
    assert_int_equal(td_auth_new(ctx, &cfg, &auth, msg, sizeof msg), TD_OK);
    assert_int_equal(td_auth_apply(auth, router), TD_OK);
    void *req = zmq_socket(ctx, ZMQ_REQ);
    int timeout = 10000;
    zmq_setsockopt(req, ZMQ_RCVTIMEO, &timeout, sizeof timeout);
    assert_int_equal(zmq_connect(req, ZAP), 0);

    uint8_t alice[32], other[32];
    assert_non_null(zmq_z85_decode(alice, alice_pub));
    memcpy(other, alice, 32);
    other[0] ^= 1;
    char user[80];
    /* alice's key, with no address (an ipc peer may have none): 200, her name */
    assert_int_equal(zap_curve(req, "CURVE", alice, 32, "", 7, user, sizeof user), 200);
    assert_string_equal(user, "alice");
    assert_int_equal(zap_curve(req, "CURVE", other, 32, "127.0.0.1", 7, user, sizeof user), 400);
    assert_string_equal(user, "");
    /* Her key, but not a whole CURVE request: refused, every one. */
    assert_int_equal(zap_curve(req, "PLAIN", alice, 32, "127.0.0.1", 7, user, sizeof user), 400);
    assert_int_equal(zap_curve(req, "NULL", alice, 32, "127.0.0.1", 7, user, sizeof user), 400);
    assert_int_equal(zap_curve(req, "CURVE", alice, 31, "127.0.0.1", 7, user, sizeof user), 400);
    assert_int_equal(zap_curve(req, "CURVE", alice, 32, "127.0.0.1", 6, user, sizeof user), 400);
    assert_int_equal(zap_curve(req, "CURVE", alice, 32, "127.0.0.1", 9, user, sizeof user), 400);
    assert_int_equal(zap_curve(req, "CURVE", alice, 32, "", 3, user, sizeof user), 400);
    assert_string_equal(user, "");
    /* and still answering */
    assert_int_equal(zap_curve(req, "CURVE", alice, 32, "::1", 7, user, sizeof user), 200);

    /* The monitor's events: a handshake counted under its result, any other event under none. */
    td_auth_counts_t before, after;
    td_auth_counts(auth, &before);
    td_auth_event(auth, ZMQ_EVENT_CONNECTED, 7);
    td_auth_event(auth, ZMQ_EVENT_HANDSHAKE_SUCCEEDED, 0);
    td_auth_counts(auth, &after);
    before.allowed++;
    assert_memory_equal(&before, &after, sizeof before);

    /* A second handler in the same context: the endpoint is the first one's. */
    td_auth_t *again = NULL;
    assert_int_equal(td_auth_new(ctx, &cfg, &again, msg, sizeof msg), TD_ERR_LIBRARY);
    assert_string_equal(msg, "cannot start the ZAP handler: Address already in use");
    assert_null(again);
    td_auth_destroy(&auth);
    assert_null(auth);
    zmq_close(req);
    zmq_close(router);
    assert_int_equal(zmq_ctx_term(ctx), 0);
}

static void test_auth_new_failures(void **state)
{
    (void)state;
    void *ctx = zmq_ctx_new();
    assert_int_equal(zmq_ctx_set(ctx, ZMQ_MAX_SOCKETS, 1), 0);
    td_auth_t *auth = NULL;
    char msg[256], missing[128];

    snprintf(missing, sizeof missing, "%s/none.key", dir);
    td_config_t cfg = curve_config(clients, NULL);
    cfg.curve_secret_key = missing;
    assert_int_equal(td_auth_new(ctx, &cfg, &auth, msg, sizeof msg), TD_ERR_IO);
    assert_non_null(strstr(msg, missing));
    assert_null(auth);

    /* One item more than the 65,536 keys tallyd holds (the same key: the set does not tell
     * keys apart). */
    size_t items = 65537, len = items * KEY;
    char *list = malloc(len);
    assert_non_null(list);
    for (size_t i = 0; i < items; i++) {
        memcpy(list + i * KEY, alice_pub, KEY - 1);
        list[i * KEY + KEY - 1] = i + 1 < items ? ',' : '\0';
    }
    cfg = curve_config(NULL, list);
    assert_int_equal(td_auth_new(ctx, &cfg, &auth, msg, sizeof msg), TD_ERR_NOMEM);
    char want[128];
    snprintf(want, sizeof want,
             "curve_clients: cannot hold '%s' (out of memory, or over 65536 keys)", alice_pub);
    assert_string_equal(msg, want);
    assert_null(auth);
    free(list);

    /* ZeroMQ out of sockets (the context's one is taken): no handler. */
    void *taken = zmq_socket(ctx, ZMQ_PAIR);
    assert_non_null(taken);
    cfg = curve_config(clients, NULL);
    assert_int_equal(td_auth_new(ctx, &cfg, &auth, msg, sizeof msg), TD_ERR_LIBRARY);
    assert_string_equal(msg, "cannot start the ZAP handler: Too many open files");
    assert_null(auth);
    zmq_close(taken);
    assert_int_equal(zmq_ctx_term(ctx), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_clients_dir_unusable),
        cmocka_unit_test(test_bare_secret_key_derives_public),
        cmocka_unit_test(test_refusals_rate_limited),
        cmocka_unit_test(test_reload_without_clients_dir_keeps_keys),
        cmocka_unit_test(test_clients_dir_as_found),
        cmocka_unit_test(test_abstract_ipc),
        cmocka_unit_test(test_clients_list_bare_key),
        cmocka_unit_test(test_clients_over_the_bound),
        cmocka_unit_test(test_zap_answers),
        cmocka_unit_test(test_auth_new_failures),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
