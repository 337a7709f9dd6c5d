/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_pub_curve.c — the PUB socket under CURVE and protected mode (PROTOCOL.md §12), against
 * the real tallyd and libtally's subscriber:
 *   - with CURVE on, the PUB socket (here on tcp://0.0.0.0, which protected mode then allows) is
 *     a CURVE server with the request endpoint's key and allowed clients: alice's keyed
 *     subscriber (tally_sub_new_curve) receives cam0's publications, while a subscriber without
 *     keys, and bob's (keys the daemon does not list), receive nothing over the same pushes; bob's
 *     refusal is logged with his key;
 *   - protected mode refuses `--pub tcp://0.0.0.0:0` without CURVE at start (exit 2, saying
 *     publish and how to set up keys), and starts it with a warning when protected_mode is off.
 * Without CURVE, on loopback and ipc, test_sub.c covers the subscriber as before.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zmq.h>

#include "harness.h"
#include "tally.h"
#include "tally_proto.h"

#define KEY 41
#define DEADLINE_MS 60000
/* After alice's subscriber has its publications, how long the others keep being offered them:
 * 15 publication intervals of 100 ms, each with a fresh push, time enough for any subscriber the
 * daemon admits to have joined (alice's, made at the same moment, already has). */
#define REFUSED_WAIT_MS 1500

static char dir[64], server_key[128], clients[128];
static char server_pub[KEY], server_sec[KEY], alice_pub[KEY], alice_sec[KEY];
static char bob_pub[KEY], bob_sec[KEY];
static th_daemon_t daemon_;

static int setup(void **state)
{
    (void)state;
    if (th_tmpdir(dir, sizeof dir, "tally-pub-curve") != 0)
        return -1;
    assert_int_equal(zmq_curve_keypair(bob_pub, bob_sec), 0); /* not allowed */
    return th_curve_dir(dir, "alice", server_pub, server_sec, alice_pub, alice_sec, server_key,
                        clients, sizeof server_key);
}

static int teardown(void **state)
{
    (void)state;
    th_use_curve(NULL, NULL, NULL);
    return th_rmrf(dir);
}

/* After each test: plain harness sockets again, and no daemon left (a failed test's). */
static int stop_daemon(void **state)
{
    (void)state;
    th_use_curve(NULL, NULL, NULL);
    th_daemon_kill(&daemon_);
    return 0;
}

/* The port of the PUB endpoint tallyd logged ("publishing changed streams on tcp://H:PORT"). */
static int logged_pub_port(const th_daemon_t *d)
{
    FILE *f = fopen(d->log_path, "r");
    assert_non_null(f);
    char line[512];
    int port = -1;
    while (port < 0 && fgets(line, sizeof line, f)) {
        const char *at = strstr(line, "publishing changed streams on tcp://");
        const char *colon = at ? strchr(at + 36, ':') : NULL;
        if (colon)
            port = atoi(colon + 1);
    }
    fclose(f);
    return port;
}

static void push(tally_client_t *client, const char *stream, size_t n)
{
    uint8_t data[256];
    memset(data, 7, sizeof data);
    tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    tally_reply_t reply;
    tally_reply_init(&reply);
    assert_int_equal(tally_call(client, &req, data, n, &reply), TALLY_OK);
    tally_reply_clear(&reply);
}

static tally_sub_t *subscriber(const char *endpoint, const tally_curve_keys_t *keys)
{
    tally_sub_t *sub = NULL;
    assert_int_equal(tally_sub_new_curve(endpoint, keys, &sub), TALLY_OK);
    assert_int_equal(tally_sub_subscribe(sub, ""), TALLY_OK);
    return sub;
}

static tally_curve_keys_t keys_of(const char *pub, const char *sec)
{
    tally_curve_keys_t keys;
    memset(&keys, 0, sizeof keys);
    memcpy(keys.server_public, server_pub, KEY);
    memcpy(keys.client_public, pub, KEY);
    memcpy(keys.client_secret, sec, KEY);
    return keys;
}

static void test_curve_pub_admits_only_allowed(void **state)
{
    (void)state;
    const char *args[] = {"--curve-secret-key",
                          server_key,
                          "--curve-clients-dir",
                          clients,
                          "--pub",
                          "tcp://0.0.0.0:0",
                          "--pub-interval-ms",
                          "100",
                          NULL};
    th_use_curve(server_pub, alice_pub, alice_sec);
    assert_int_equal(th_daemon_start(&daemon_, args), 0);
    assert_true(th_daemon_log_contains(&daemon_, "(CURVE: the request endpoint's key"));
    int port = logged_pub_port(&daemon_);
    assert_true(port > 0);
    char pub[64];
    snprintf(pub, sizeof pub, "tcp://127.0.0.1:%d", port);

    tally_curve_keys_t alice = keys_of(alice_pub, alice_sec), bob = keys_of(bob_pub, bob_sec);
    tally_client_t *client = NULL;
    assert_int_equal(tally_client_new_curve(daemon_.endpoint, 20000, &alice, &client), TALLY_OK);
    tally_sub_t *allowed = subscriber(pub, &alice), *bare = subscriber(pub, NULL),
                *unknown = subscriber(pub, &bob);
    tally_pub_msg_t *msg = malloc(sizeof *msg);
    assert_non_null(msg);

    /* Push until alice's subscription has joined and cam0's record arrives. */
    int64_t deadline = th_now_ms() + DEADLINE_MS;
    for (bool joined = false; !joined;) {
        push(client, "cam0", 100);
        tally_status_t st = tally_sub_recv(allowed, 200, msg);
        assert_true(st == TALLY_OK || st == TALLY_E_TIMEOUT);
        joined = st == TALLY_OK && !strcmp(msg->stream, "cam0");
        if (th_now_ms() > deadline)
            fail_msg("alice's subscriber had no publication of cam0 within %d ms", DEADLINE_MS);
    }
    assert_int_equal(msg->pub.kind, TALLY_PUB_UPDATE);
    assert_true(msg->info.bins[7] >= 100);

    /* The same publications, offered for a while more: neither of the others gets one. */
    for (int64_t end = th_now_ms() + REFUSED_WAIT_MS; th_now_ms() < end;) {
        push(client, "cam0", 10);
        tally_sub_recv(allowed, 100, msg); /* alice's keep coming (checked below) */
        assert_int_equal(tally_sub_recv(bare, 0, msg), TALLY_E_TIMEOUT);
        assert_int_equal(tally_sub_recv(unknown, 0, msg), TALLY_E_TIMEOUT);
    }
    assert_int_equal(tally_sub_recv(bare, 200, msg), TALLY_E_TIMEOUT);
    assert_int_equal(tally_sub_recv(unknown, 200, msg), TALLY_E_TIMEOUT);
    /* bob's handshake reached the ZAP handler, which refused his key and said so; alice's
     * subscription still receives. */
    char refusal[96];
    snprintf(refusal, sizeof refusal, "key %s is not allowed", bob_pub);
    deadline = th_now_ms() + DEADLINE_MS;
    while (!th_daemon_log_contains(&daemon_, refusal) && th_now_ms() < deadline)
        th_sleep_ms(50);
    assert_true(th_daemon_log_contains(&daemon_, refusal));
    deadline = th_now_ms() + DEADLINE_MS;
    for (tally_status_t st = TALLY_E_TIMEOUT; st != TALLY_OK;) {
        push(client, "cam0", 10);
        st = tally_sub_recv(allowed, 200, msg);
        if (th_now_ms() > deadline)
            fail_msg("alice's subscriber stopped receiving");
    }

    free(msg);
    tally_sub_destroy(&allowed);
    tally_sub_destroy(&bare);
    tally_sub_destroy(&unknown);
    tally_client_destroy(&client);
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 20000), 0);
    th_use_curve(NULL, NULL, NULL);
}

/* Keys that are not 40 characters of Z85 are refused before any connection. */
static void test_sub_bad_keys(void **state)
{
    (void)state;
    tally_curve_keys_t keys = keys_of(alice_pub, alice_sec);
    keys.client_secret[10] = '\0';
    tally_sub_t *sub = NULL;
    assert_int_equal(tally_sub_new_curve("tcp://127.0.0.1:1", &keys, &sub), TALLY_E_ARG);
    assert_null(sub);
}

static void test_protected_mode_pub(void **state)
{
    (void)state;
    char log[160];
    const char *open_pub[] = {"--pub", "tcp://0.0.0.0:0", NULL};
    assert_int_equal(th_run_refused(dir, open_pub, log, sizeof log, 20000), 2);
    assert_true(th_file_contains(
        log, "protected mode: refusing to publish (--pub) on tcp://0.0.0.0:0, a network address, "
             "without CURVE: anyone who reaches it could read every stream's histogram"));
    assert_true(th_file_contains(log, "tally keygen"));
    const char *check[] = {"--pub", "tcp://0.0.0.0:0", "--check-config", NULL};
    assert_int_equal(th_run_refused(dir, check, log, sizeof log, 20000), 2);
    assert_true(th_file_contains(log, "refusing to publish (--pub) on tcp://0.0.0.0:0"));

    /* Explicitly allowed: it starts, with a warning. */
    const char *off[] = {"--pub", "tcp://0.0.0.0:0", "--protected-mode", "off", NULL};
    assert_int_equal(th_daemon_start(&daemon_, off), 0);
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 20000), 0);
    assert_true(th_daemon_log_contains(
        &daemon_, "protected_mode is off: PUB endpoint tcp://0.0.0.0:0 is a network address"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_curve_pub_admits_only_allowed, stop_daemon),
        cmocka_unit_test(test_sub_bad_keys),
        cmocka_unit_test_teardown(test_protected_mode_pub, stop_daemon),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
