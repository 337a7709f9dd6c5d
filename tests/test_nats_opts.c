/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_opts.c — what libtally's NATS producer (tally_nats_new, tally.h's tally_nats_opts_t,
 * PROTOCOL.md §13) refuses before any server answers, and its calls given nothing to work on.
 * No nats-server is needed: every refusal here comes before a connection or from a connection
 * refused (127.0.0.1 port 1, where nothing listens):
 *   - NULL options or out: TALLY_E_ARG (tally_nats_new, tally_client_new_nats);
 *   - a server list of commas and spaces names no URL; spaces around each URL are dropped;
 *   - a user (given, or the user:password@ of a URL) that cannot name the fleet's subjects; a
 *     token@ names no user (the producer is "anon");
 *   - an nkey without its seed file, a seed without its nkey, a TLS certificate without its key
 *     and the reverse; CA and certificate files that cannot be read (credentials and seed files
 *     are read only when a server asks for them: libnats);
 *   - a server that cannot be reached: TALLY_E_TRANSPORT, the message naming the servers with
 *     their passwords and tokens redacted; msg may be NULL;
 *   - the getters and calls given NULL answer "", 0, -1 or TALLY_E_ARG, and touch nothing.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include <nats/nats.h>

#include "tally.h"

#define NOBODY "nats://127.0.0.1:1" /* a privileged port nothing listens on: refused at once */

/* tally_nats_new with o; its status, msg holding the reason. */
static tally_status_t open_with(const tally_nats_opts_t *o, char *msg, size_t cap)
{
    tally_nats_t *p = (tally_nats_t *)&p; /* not NULL: tally_nats_new must clear it */
    msg[0] = 0;
    tally_status_t st = tally_nats_new(o, &p, msg, cap);
    assert_null(p);
    return st;
}

static void expect_refused(const tally_nats_opts_t *o, tally_status_t status, const char *text)
{
    char msg[512];
    tally_status_t st = open_with(o, msg, sizeof msg);
    if (st != status || !strstr(msg, text))
        fail_msg("got status %d '%s', wanted %d with '%s'", st, msg, status, text);
}

static void test_null_arguments(void **state)
{
    (void)state;
    tally_nats_opts_t o = {.servers = NOBODY};
    tally_nats_t *p = NULL;
    char msg[64];
    assert_int_equal(tally_nats_new(NULL, &p, msg, sizeof msg), TALLY_E_ARG);
    assert_int_equal(tally_nats_new(&o, NULL, msg, sizeof msg), TALLY_E_ARG);
    /* A client over NATS (tally_client_new_nats): the same, and the producer's failure. */
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new_nats(NULL, &c, msg, sizeof msg), TALLY_E_ARG);
    assert_int_equal(tally_client_new_nats(&o, NULL, msg, sizeof msg), TALLY_E_ARG);
    assert_int_equal(tally_client_new_nats(&o, &c, msg, sizeof msg), TALLY_E_TRANSPORT);
    assert_null(c);
    assert_non_null(strstr(msg, "cannot connect to " NOBODY));
}

static void test_servers(void **state)
{
    (void)state;
    tally_nats_opts_t o = {.servers = " , ,", .timeout_ms = 2000};
    expect_refused(&o, TALLY_E_ARG, "servers ' , ,': no URL");
    /* Spaces around a URL are dropped: the one URL is tried (and refused). */
    o.servers = "  " NOBODY "  , ";
    expect_refused(&o, TALLY_E_TRANSPORT, "cannot connect to   " NOBODY);
    /* No message wanted: the same status. */
    tally_nats_t *p = NULL;
    assert_int_equal(tally_nats_new(&o, &p, NULL, 0), TALLY_E_TRANSPORT);
    assert_null(p);
}

static void test_users(void **state)
{
    (void)state;
    tally_nats_opts_t o = {.servers = NOBODY, .user = "bad user!", .timeout_ms = 2000};
    expect_refused(&o, TALLY_E_ARG, "NATS user 'bad user!' cannot name the fleet's subjects");
    /* Without .user, the first URL with user:password@ names it. */
    o.user = NULL;
    o.servers = "nats://127.0.0.1:1,nats://bad.user:secret@127.0.0.1:1";
    expect_refused(&o, TALLY_E_ARG, "NATS user 'bad.user' cannot name");
    /* A valid one: the connection is tried, and the password does not appear. */
    char msg[512];
    o.servers = "nats://alice:secret@127.0.0.1:1";
    assert_int_equal(open_with(&o, msg, sizeof msg), TALLY_E_TRANSPORT);
    assert_non_null(strstr(msg, "cannot connect to nats://alice:***@127.0.0.1:1"));
    assert_null(strstr(msg, "secret"));
    /* A token names no user, and is not shown either. */
    o.servers = "nats://s3cr3t-token@127.0.0.1:1";
    assert_int_equal(open_with(&o, msg, sizeof msg), TALLY_E_TRANSPORT);
    assert_non_null(strstr(msg, "nats://***@127.0.0.1:1"));
    assert_null(strstr(msg, "s3cr3t"));
    /* A malformed producer id is refused before any connection. */
    o.producer_id = "no spaces";
    expect_refused(&o, TALLY_E_ARG, "producer id 'no spaces': 1..64 characters");
}

static void test_security_files(void **state)
{
    (void)state;
    tally_nats_opts_t o = {.servers = NOBODY, .nkey = "UABC", .timeout_ms = 2000};
    expect_refused(&o, TALLY_E_ARG, "an nkey needs its seed file, and a seed file its nkey");
    o = (tally_nats_opts_t){.servers = NOBODY, .nkey_seed = "/nonexistent/seed"};
    expect_refused(&o, TALLY_E_ARG, "an nkey needs its seed file");
    o = (tally_nats_opts_t){.servers = NOBODY, .nkey = "UABC", .nkey_seed = "/nonexistent/seed"};
    /* The seed file is read only when a server asks for it (libnats): here, none answers. */
    expect_refused(&o, TALLY_E_TRANSPORT, "cannot connect to " NOBODY);
    o = (tally_nats_opts_t){.servers = NOBODY, .credentials = "/nonexistent/u.creds"};
    expect_refused(&o, TALLY_E_TRANSPORT, "cannot connect to " NOBODY); /* read on asking, too */
    o = (tally_nats_opts_t){.servers = NOBODY, .tls_ca = "/nonexistent/ca.pem"};
    expect_refused(&o, TALLY_E_ARG, "TLS CA file /nonexistent/ca.pem: ");
    o = (tally_nats_opts_t){.servers = NOBODY, .tls_cert = "/nonexistent/c.pem"};
    expect_refused(&o, TALLY_E_ARG, "a TLS client certificate needs its key");
    o = (tally_nats_opts_t){.servers = NOBODY, .tls_key = "/nonexistent/k.pem"};
    expect_refused(&o, TALLY_E_ARG, "a TLS client certificate needs its key");
    o = (tally_nats_opts_t){
        .servers = NOBODY, .tls_cert = "/nonexistent/c.pem", .tls_key = "/nonexistent/k.pem"};
    expect_refused(&o, TALLY_E_ARG, "TLS certificate /nonexistent/c.pem: ");
    /* Empty strings are "none", as NULL: the connection is tried. */
    o = (tally_nats_opts_t){.servers = NOBODY,
                            .nkey = "",
                            .nkey_seed = "",
                            .credentials = "",
                            .tls_ca = "",
                            .tls_cert = "",
                            .tls_key = "",
                            .user = ""};
    expect_refused(&o, TALLY_E_TRANSPORT, "cannot connect to " NOBODY);
}

static void test_null_producer(void **state)
{
    (void)state;
    tally_req_t req;
    memset(&req, 0, sizeof req);
    req.opcode = TALLY_OP_HIST;
    tally_reply_t reply;
    tally_reply_init(&reply);
    tally_stream_info_t info;
    char **names = NULL;
    size_t count = 0;
    assert_int_equal(tally_nats_partitions(NULL), 0);
    assert_int_equal(tally_nats_max_payload(NULL), 0);
    assert_string_equal(tally_nats_error(NULL), "");
    assert_string_equal(tally_nats_producer_id(NULL), "");
    assert_int_equal(tally_nats_streams_missing(NULL), 0);
    assert_int_equal(tally_nats_send(NULL, &req, NULL, 0, false, NULL, NULL), TALLY_E_ARG);
    assert_int_equal(tally_nats_recv(NULL, 10, &reply), TALLY_E_ARG);
    assert_int_equal(tally_nats_call(NULL, &req, NULL, 0, &reply), TALLY_E_ARG);
    assert_int_equal(tally_nats_query(NULL, "s", &info), TALLY_E_ARG);
    assert_int_equal(tally_nats_streams(NULL, &names, &count), TALLY_E_ARG);
    assert_null(names);
    tally_nats_destroy(NULL);
    tally_nats_t *none = NULL;
    tally_nats_destroy(&none);

    tally_nats_sub_t *sub = NULL;
    assert_int_equal(tally_nats_sub_new(NULL, &sub), TALLY_E_ARG);
    assert_int_equal(tally_nats_sub_stream(NULL, "s"), TALLY_E_ARG);
    tally_pub_msg_t msg;
    assert_int_equal(tally_nats_sub_recv(NULL, 0, &msg), TALLY_E_ARG);
    assert_int_equal(tally_nats_sub_fd(NULL), -1);
    assert_int_equal(tally_nats_sub_dropped(NULL), 0);
    tally_nats_sub_destroy(NULL);
    tally_nats_sub_t *no_sub = NULL;
    tally_nats_sub_destroy(&no_sub);
    tally_reply_clear(&reply);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_null_arguments), cmocka_unit_test(test_servers),
        cmocka_unit_test(test_users),          cmocka_unit_test(test_security_files),
        cmocka_unit_test(test_null_producer),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    nats_Close();
    return failed;
}
