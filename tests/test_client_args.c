/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_client_args.c — what libtally's ZeroMQ client (tally.h) refuses before it sends, with no
 * tallyd at all (the client is made for an address where nothing listens; nothing here waits
 * for a connection):
 *   - tally_client_open: CURVE keys that are not 40 characters of Z85 (the message says so);
 *     an endpoint ZeroMQ does not take; msg may be NULL;
 *   - NULL clients: tally_client_wait_connected, _error, _timeout, _destroy;
 *   - tally_send, tally_call, tally_send_shm, tally_call_shm with NULL or inconsistent
 *     arguments: TALLY_E_ARG; a request the daemon would refuse is refused here with the wire
 *     status and the reason in tally_client_error and reply->error, and nothing is sent;
 *   - tally_send_zc calls free_fn exactly once on every refused path (tally.h), and never
 *     without a payload to free;
 *   - the CSV and JSON helpers given no record or no buffer;
 *   - where tally_curve_keys_load finds keys: empty arguments and variables are none, then
 *     tally.conf (blanks around values dropped); no XDG_CONFIG_HOME nor HOME: CURVE off.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "harness.h"
#include "tally.h"

#define NOBODY "tcp://127.0.0.1:1" /* nothing listens: every call here is refused before */

static tally_client_t *client;

static int setup(void **state)
{
    (void)state;
    char msg[256];
    return tally_client_open(NOBODY, 2000, NULL, &client, msg, sizeof msg) == TALLY_OK ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    tally_client_destroy(&client);
    return client ? -1 : 0;
}

static void test_open(void **state)
{
    (void)state;
    tally_curve_keys_t keys;
    memset(&keys, 0, sizeof keys);
    memset(keys.server_public, 'a', 40);
    memset(keys.client_public, 'b', 40);
    memset(keys.client_secret, '"', 40); /* 40 characters, not Z85 */
    tally_client_t *c = (tally_client_t *)&c;
    char msg[256] = "";
    assert_int_equal(tally_client_open(NOBODY, 1000, &keys, &c, msg, sizeof msg), TALLY_E_ARG);
    assert_null(c);
    assert_string_equal(msg, "CURVE keys that are not 40 characters of Z85");
    keys.client_secret[39] = 0; /* 39 */
    assert_int_equal(tally_client_open(NOBODY, 1000, &keys, &c, NULL, 0), TALLY_E_ARG);
    assert_null(c);
    /* No message wanted: the status alone. */
    assert_int_equal(tally_client_open(NOBODY, 0, NULL, &c, NULL, 0), TALLY_E_ARG);
    msg[0] = 'x'; /* a buffer of no room is not written */
    assert_int_equal(tally_client_open(NOBODY, 0, NULL, &c, msg, 0), TALLY_E_ARG);
    assert_int_equal(msg[0], 'x');
    assert_int_equal(tally_client_open(NOBODY, 1000, NULL, NULL, NULL, 0), TALLY_E_ARG);
}

static void test_null_client(void **state)
{
    (void)state;
    assert_int_equal(tally_client_wait_connected(NULL), TALLY_E_ARG);
    assert_string_equal(tally_client_error(NULL), "");
    assert_int_equal(tally_client_timeout(NULL), 0);
    assert_int_equal(tally_client_timeout(client), 2000);
    tally_client_destroy(NULL);
    tally_client_t *none = NULL;
    tally_client_destroy(&none);
}

static tally_req_t hist_req(void)
{
    tally_req_t r;
    memset(&r, 0, sizeof r);
    r.opcode = TALLY_OP_HIST;
    r.dtype = TALLY_DTYPE_U8;
    return r;
}

static void test_send_and_call(void **state)
{
    (void)state;
    tally_req_t r = hist_req();
    uint8_t data[8] = {0};
    uint64_t id = 77;
    assert_int_equal(tally_send(NULL, &r, data, 8, &id), TALLY_E_ARG);
    assert_int_equal(tally_send(client, NULL, data, 8, &id), TALLY_E_ARG);
    assert_int_equal(tally_send(client, &r, NULL, 8, &id), TALLY_E_ARG); /* len without data */
    assert_int_equal(id, 77);
    tally_reply_t reply;
    tally_reply_init(&reply);
    assert_int_equal(tally_call(NULL, &r, data, 8, &reply), TALLY_E_ARG);
    assert_int_equal(tally_call(client, NULL, data, 8, &reply), TALLY_E_ARG);
    assert_int_equal(tally_call(client, &r, data, 8, NULL), TALLY_E_ARG);
    /* A request tallyd would refuse: its wire status, the reason, nothing sent or awaited. */
    r.opcode = 250;
    assert_int_equal(tally_call(client, &r, data, 8, &reply), TALLY_E_OPCODE);
    assert_true(reply.error[0] != 0);
    assert_string_equal(reply.error, tally_client_error(client));
    r = hist_req();
    r.opcode = TALLY_OP_SCAN;
    r.dtype = TALLY_DTYPE_I32;
    assert_int_equal(tally_send(client, &r, data, 6, &id), TALLY_E_PAYLOAD); /* 1.5 elements */
    assert_int_equal(id, 77);
    assert_string_equal(tally_client_error(client),
                        "payload of 6 bytes is not a whole number of int32 elements");
    tally_reply_clear(&reply);
}

static int freed;
static void count_free(void *data, void *hint)
{
    (void)data;
    (void)hint;
    freed++;
}

static void test_send_zc_frees_once(void **state)
{
    (void)state;
    tally_req_t r = hist_req();
    static uint8_t data[8];
    struct {
        tally_client_t *c;
        const tally_req_t *req;
        void *payload;
        size_t len;
        tally_status_t want;
        int frees;
    } cases[] = {
        {NULL, &r, data, 8, TALLY_E_ARG, 1},
        {client, NULL, data, 8, TALLY_E_ARG, 1},
        {client, &r, data, 0, TALLY_E_ARG, 1},
        {client, &r, NULL, 8, TALLY_E_ARG, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        freed = 0;
        assert_int_equal(tally_send_zc(cases[i].c, cases[i].req, cases[i].payload, cases[i].len,
                                       count_free, NULL, NULL),
                         cases[i].want);
        assert_int_equal(freed, cases[i].frees);
    }
    assert_int_equal(tally_send_zc(client, &r, data, 8, NULL, NULL, NULL), TALLY_E_ARG);
    /* Refused by the checks tallyd would make: freed once too. */
    freed = 0;
    r.opcode = 250;
    assert_int_equal(tally_send_zc(client, &r, data, 8, count_free, NULL, NULL), TALLY_E_OPCODE);
    assert_int_equal(freed, 1);
}

static void test_shm_arguments(void **state)
{
    (void)state;
    tally_req_t r = hist_req();
    tally_reply_t reply;
    tally_reply_init(&reply);
    uint64_t id = 0;
    assert_int_equal(tally_send_shm(NULL, &r, NULL, 0, 8, NULL, 0, &id), TALLY_E_ARG);
    assert_int_equal(tally_send_shm(client, &r, NULL, 0, 8, NULL, 0, &id), TALLY_E_ARG);
    assert_string_equal(tally_client_error(client), "the range is not inside the region");
    assert_int_equal(tally_send_shm(client, NULL, NULL, 0, 8, NULL, 0, &id), TALLY_E_ARG);
    assert_int_equal(tally_call_shm(client, NULL, NULL, 0, 8, NULL, 0, &reply), TALLY_E_ARG);
    assert_int_equal(tally_call_shm(NULL, &r, NULL, 0, 8, NULL, 0, &reply), TALLY_E_ARG);
    assert_int_equal(tally_call_shm(client, &r, NULL, 0, 8, NULL, 0, NULL), TALLY_E_ARG);
    assert_int_equal(tally_call_shm(client, &r, NULL, 0, 8, NULL, 0, &reply), TALLY_E_ARG);
    assert_string_equal(reply.error, "the range is not inside the region");
    assert_null(tally_region_data(NULL));
    assert_int_equal(tally_region_size(NULL), 0);
    tally_region_destroy(NULL);
    tally_reply_clear(&reply);
}

/* Output helpers given nothing to write to, or no record: TALLY_E_ARG and nothing appended;
 * a CSV row without a label has no label column (empty quantile rows included). */
static void test_output_arguments(void **state)
{
    (void)state;
    tally_stream_info_t info;
    memset(&info, 0, sizeof info);
    info.hist_dtype = TALLY_DTYPE_U8;
    tally_hist_t hist;
    assert_int_equal(tally_hist_from_info(&info, 0, &hist), TALLY_OK);
    tally_buf_t out = {0};
    const double q50 = 0.5;
    assert_int_equal(tally_hist_csv(&hist, "x", false, NULL), TALLY_E_ARG);
    assert_int_equal(tally_hist_csv_quantiles(NULL, NULL, false, &q50, 1, &out), TALLY_E_ARG);
    assert_int_equal(tally_hist_csv_quantiles(&hist, NULL, false, &q50, 1, NULL), TALLY_E_ARG);
    assert_int_equal(out.len, 0);
    /* An empty histogram has no median: the row has no value, and no label column. */
    assert_int_equal(tally_hist_csv_quantiles(&hist, NULL, true, &q50, 1, &out), TALLY_OK);
    assert_int_equal(tally_buf_append(&out, "", 1), TALLY_OK);
    assert_string_equal((const char *)out.data, "quantile,q,value,side\np50,0.5,,\n");
    tally_buf_free(&out);

    tally_stream_view_t v = {.name = "s", .info = NULL};
    assert_int_equal(tally_stream_json(&v, &out), TALLY_E_ARG);
    v.info = &info;
    assert_int_equal(tally_stream_json(&v, NULL), TALLY_E_ARG);
    assert_int_equal(tally_stream_json(NULL, &out), TALLY_E_ARG);
    info.hist_dtype = 99; /* no histogram type */
    assert_int_equal(tally_stream_json(&v, &out), TALLY_E_ARG);
    assert_int_equal(out.len, 0);
    tally_buf_free(&out);
}

/* tally_curve_keys_load's order (tally.h): an empty argument or environment variable is as
 * none, then tally.conf under $XDG_CONFIG_HOME (blanks around values dropped); with
 * neither XDG_CONFIG_HOME nor HOME there is no file to read, and CURVE is off. */
static void test_curve_config(void **state)
{
    (void)state;
    char dir[128], path[256], pub[41];
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-args"), 0);
    snprintf(path, sizeof path, "%s/tally", dir);
    assert_int_equal(mkdir(path, 0700), 0);
    snprintf(path, sizeof path, "%s/tally/me", dir);
    char msg[512] = "";
    assert_int_equal(tally_keygen(path, pub, msg, sizeof msg), TALLY_OK);
    snprintf(path, sizeof path, "%s/tally/tally.conf", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "# keys\n  server_key =  %s \t \nclient_key\t= %s/tally/me.key\t\n", pub, dir);
    fclose(f);

    const char *saved_home = getenv("HOME");
    char home[256];
    snprintf(home, sizeof home, "%s", saved_home ? saved_home : "");
    assert_int_equal(setenv("XDG_CONFIG_HOME", dir, 1), 0);
    assert_int_equal(setenv("TALLY_SERVER_KEY", "", 1), 0);
    assert_int_equal(setenv("TALLY_CLIENT_KEY", "", 1), 0);
    tally_curve_keys_t keys;
    assert_int_equal(tally_curve_keys_load("", "", &keys, msg, sizeof msg), TALLY_OK);
    assert_string_equal(keys.server_public, pub);
    assert_string_equal(keys.client_public, pub); /* its own pair: one key file for both here */

    assert_int_equal(unsetenv("XDG_CONFIG_HOME"), 0);
    assert_int_equal(unsetenv("HOME"), 0);
    memset(keys.server_public, 'x', 8);
    assert_int_equal(tally_curve_keys_load(NULL, NULL, &keys, msg, sizeof msg), TALLY_OK);
    assert_string_equal(keys.server_public, ""); /* CURVE off */
    if (saved_home)
        assert_int_equal(setenv("HOME", home, 1), 0);
    unsetenv("TALLY_SERVER_KEY");
    unsetenv("TALLY_CLIENT_KEY");
    assert_int_equal(tally_curve_keys_load(NULL, NULL, NULL, msg, sizeof msg), TALLY_E_ARG);
    th_rmrf(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_open),          cmocka_unit_test(test_null_client),
        cmocka_unit_test(test_send_and_call), cmocka_unit_test(test_send_zc_frees_once),
        cmocka_unit_test(test_shm_arguments), cmocka_unit_test(test_output_arguments),
        cmocka_unit_test(test_curve_config),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
