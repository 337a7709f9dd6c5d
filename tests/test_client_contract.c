/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_client_contract.c — what libtally's header promises for arguments it cannot use, call by
 * call (client/tally.h): TALLY_E_ARG (or the status the header names) for a NULL where an object
 * is needed, a range outside a region, a quantile outside [0, 1], a channel a histogram lacks,
 * a copy outside a GPU allocation, flags of a device region that do not agree with its event, a
 * key file that exists (tally_keygen never replaces one, nor leaves half a pair), the order in
 * which CURVE keys are looked for and what a half-configured pair says;
 * NULL or 0 from the accessors of a NULL object; destroy functions that take NULL and set the
 * caller's pointer to NULL. test_client.c covers the calls of the request path; these are the
 * rest. A real tallyd (CPU) serves the few that need one.
 */
#include <math.h>
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
#include "tally.h"

static th_daemon_t daemon_;
static tally_client_t *client;

static int setup(void **state)
{
    (void)state;
    if (th_daemon_start(&daemon_, NULL) != 0)
        return -1;
    return tally_client_new(daemon_.endpoint, 10000, &client) == TALLY_OK ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    tally_client_destroy(&client);
    return th_daemon_stop(&daemon_, SIGTERM, 10000) == 0 ? 0 : -1;
}

static void test_info_calls(void **state)
{
    (void)state;
    tally_info_t *info = NULL;
    assert_int_equal(tally_info_fetch(NULL, &info), TALLY_E_ARG);
    assert_int_equal(tally_info_fetch(client, NULL), TALLY_E_ARG);
    assert_int_equal(tally_info_parse(NULL, 4, &info), TALLY_E_ARG);
    assert_int_equal(tally_info_parse("a=1\n", 4, NULL), TALLY_E_ARG);
    assert_int_equal(tally_info(client, TALLY_OP_INFO, NULL), TALLY_E_ARG);
    assert_int_equal(tally_info_count(NULL), 0);
    assert_null(tally_info_key(NULL, 0));
    assert_null(tally_info_value(NULL, 0));
    assert_null(tally_info_lookup(NULL, "a"));
    uint64_t v = 7;
    assert_int_equal(tally_info_u64(NULL, "a", &v), TALLY_E_ARG);
    assert_int_equal(tally_info_parse("a=1\nb=x\nc=01\n", 13, &info), TALLY_OK);
    assert_null(tally_info_key(info, 3));
    assert_null(tally_info_lookup(info, NULL));
    assert_int_equal(tally_info_u64(info, NULL, &v), TALLY_E_ARG);
    assert_int_equal(tally_info_u64(info, "a", NULL), TALLY_E_ARG);
    assert_int_equal(tally_info_u64(info, "b", &v), TALLY_E_REPLY); /* not a number */
    assert_int_equal(tally_info_u64(info, "c", &v), TALLY_E_REPLY); /* a leading zero */
    assert_int_equal(v, 7);                                         /* unchanged on failure */
    tally_info_destroy(&info);
    assert_null(info);
    tally_info_destroy(&info);
    tally_info_destroy(NULL);
}

static void test_stream_calls(void **state)
{
    (void)state;
    tally_stream_info_t info;
    char **names = NULL;
    size_t count = 0;
    assert_int_equal(tally_query(NULL, "s", &info), TALLY_E_ARG);
    assert_int_equal(tally_query(client, "s", NULL), TALLY_E_ARG);
    assert_int_equal(tally_query_window(client, "s", 0, &info, NULL, NULL), TALLY_E_ARG);
    assert_int_equal(tally_query_window(NULL, "s", 1000, &info, NULL, NULL), TALLY_E_ARG);
    assert_int_equal(tally_reset(NULL, "s"), TALLY_E_ARG);
    assert_int_equal(tally_delete(NULL, "s"), TALLY_E_ARG);
    assert_int_equal(tally_streams(NULL, &names, &count), TALLY_E_ARG);
    assert_int_equal(tally_streams(client, NULL, &count), TALLY_E_ARG);
    assert_int_equal(tally_streams(client, &names, NULL), TALLY_E_ARG);
    tally_strings_free(NULL, 3);
    tally_reply_t reply;
    tally_reply_init(&reply);
    assert_int_equal(tally_reply_stream_info(NULL, &info), TALLY_E_ARG);
    assert_int_equal(tally_reply_stream_info(&reply, NULL), TALLY_E_ARG);
    assert_int_equal(tally_reply_stream_info(&reply, &info), TALLY_E_REPLY); /* not a record */
    tally_reply_clear(&reply);
    tally_reply_clear(NULL);
    assert_int_equal(tally_ping(NULL, NULL), TALLY_E_ARG);
    assert_string_equal(tally_client_error(NULL), "");
    assert_int_equal(tally_client_timeout(NULL), 0);
}

static void test_region_calls(void **state)
{
    (void)state;
    tally_region_t *region = NULL;
    assert_int_equal(tally_region_create(NULL, 4096, &region), TALLY_E_ARG);
    assert_int_equal(tally_region_create(client, 0, &region), TALLY_E_ARG);
    assert_int_equal(tally_region_create(client, 4096, NULL), TALLY_E_ARG);
    assert_null(tally_region_data(NULL));
    assert_int_equal(tally_region_size(NULL), 0);
    tally_region_destroy(NULL);
    tally_region_destroy(&region); /* *region_p NULL */
    assert_int_equal(tally_region_create(client, 4096, &region), TALLY_OK);
    assert_int_equal(tally_region_size(region), 4096);
    tally_req_t hist = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    tally_reply_t reply;
    tally_reply_init(&reply);
    /* Ranges outside the region: refused, nothing sent. */
    assert_int_equal(tally_call_shm(client, &hist, region, 4097, 0, NULL, 0, &reply), TALLY_E_ARG);
    assert_int_equal(tally_call_shm(client, &hist, region, 4000, 200, NULL, 0, &reply),
                     TALLY_E_ARG);
    assert_int_equal(tally_send_shm(client, &hist, region, 0, 8192, NULL, 0, NULL), TALLY_E_ARG);
    assert_int_equal(tally_send_shm(client, &hist, NULL, 0, 16, NULL, 0, NULL), TALLY_E_ARG);
    assert_int_equal(tally_send_shm(NULL, &hist, region, 0, 16, NULL, 0, NULL), TALLY_E_ARG);
    /* No client and a range outside the region: no client's error buffer to report it in. */
    assert_int_equal(tally_send_shm(NULL, &hist, region, 4097, 0, NULL, 0, NULL), TALLY_E_ARG);
    tally_req_t scan = {.opcode = TALLY_OP_SCAN, .dtype = TALLY_DTYPE_I32};
    assert_int_equal(tally_send_shm(client, &scan, region, 0, 16, region, 4097, NULL),
                     TALLY_E_ARG); /* output past its region */
    assert_int_equal(tally_call_shm(client, &hist, region, 0, 16, NULL, 0, NULL), TALLY_E_ARG);
    /* Within: served. */
    memset(tally_region_data(region), 3, 16);
    assert_int_equal(tally_call_shm(client, &hist, region, 0, 16, NULL, 0, &reply), TALLY_OK);
    assert_int_equal(tally_get_u64(reply.payload + 8 * 3), 16);
    tally_reply_clear(&reply);
    tally_region_destroy(&region);
    assert_null(region);
}

/* tally_gpu_*: arguments refused before any allocation or driver call; ranges outside an
 * allocation refused saying so (on a simulated GPU allocation, TALLY_TEST_SIM_GPU=1: no driver). */
static void test_gpu_calls(void **state)
{
    (void)state;
    tally_gpu_mem_t *mem = NULL;
    uint8_t uuid[16] = {0}, bytes[16] = {0};
    assert_int_equal(setenv("TALLY_TEST_SIM_GPU", "1", 1), 0);
    assert_int_equal(tally_gpu_alloc(0, 4096, NULL), TALLY_E_ARG);
    assert_int_equal(tally_gpu_alloc(0, 0, &mem), TALLY_E_ARG);
    assert_int_equal(tally_gpu_alloc(-1, 4096, &mem), TALLY_E_ARG);
    assert_null(mem);
    assert_null(tally_gpu_ptr(NULL));
    assert_int_equal(tally_gpu_size(NULL), 0);
    assert_int_equal(tally_gpu_register(client, NULL, 0, NULL, &(tally_region_t *){NULL}),
                     TALLY_E_ARG);
    assert_int_equal(tally_gpu_copy_to(NULL, 0, bytes, 1), TALLY_E_ARG);
    assert_int_equal(tally_gpu_copy_from(NULL, 0, bytes, 1), TALLY_E_ARG);
    tally_gpu_free(NULL);
    tally_gpu_free(&mem); /* *mem_p NULL */

    /* tally_gpu_register_fd: each argument it cannot use, before it opens the side channel. */
    tally_region_t *region = NULL;
    int fd = 0; /* any descriptor: refused before it is read */
    unsigned out = TALLY_GPU_OUTPUT, event = TALLY_GPU_EVENT;
    assert_int_equal(tally_gpu_register_fd(NULL, fd, 4096, uuid, 0, NULL, NULL, &region),
                     TALLY_E_ARG);
    assert_int_equal(tally_gpu_register_fd(client, fd, 4096, uuid, 0, NULL, NULL, NULL),
                     TALLY_E_ARG);
    assert_int_equal(tally_gpu_register_fd(client, -1, 4096, uuid, 0, NULL, NULL, &region),
                     TALLY_E_ARG);
    assert_int_equal(tally_gpu_register_fd(client, fd, 0, uuid, 0, NULL, NULL, &region),
                     TALLY_E_ARG);
    assert_int_equal(tally_gpu_register_fd(client, fd, 4096, NULL, 0, NULL, NULL, &region),
                     TALLY_E_ARG);
    assert_int_equal(tally_gpu_register_fd(client, fd, 4096, uuid, 0x80, NULL, NULL, &region),
                     TALLY_E_ARG); /* a flag it does not know */
    assert_int_equal(tally_gpu_register_fd(client, fd, 4096, uuid, event, NULL, NULL, &region),
                     TALLY_E_ARG); /* TALLY_GPU_EVENT without the event */
    assert_int_equal(tally_gpu_register_fd(client, fd, 4096, uuid, out, bytes, NULL, &region),
                     TALLY_E_ARG); /* an event without TALLY_GPU_EVENT */
    assert_null(region);

    /* An allocation rounded up to its granularity; copies within it, and none outside. */
    assert_int_equal(tally_gpu_alloc(0, 1000, &mem), TALLY_OK);
    size_t size = tally_gpu_size(mem);
    assert_int_equal(size, 65536);
    assert_non_null(tally_gpu_ptr(mem));
    memset(bytes, 7, sizeof bytes);
    assert_int_equal(tally_gpu_copy_to(mem, size - 16, bytes, 16), TALLY_OK);
    assert_int_equal(tally_gpu_copy_to(mem, size, bytes, 0), TALLY_OK);
    assert_int_equal(tally_gpu_copy_to(mem, size - 15, bytes, 16), TALLY_E_ARG);
    assert_string_equal(tally_gpu_error(), "copy of 16 bytes at 65521 outside the allocation");
    assert_int_equal(tally_gpu_copy_from(mem, size + 1, bytes, 0), TALLY_E_ARG);
    assert_int_equal(tally_gpu_copy_from(mem, 0, bytes, size + 1), TALLY_E_ARG);
    memset(bytes, 0, sizeof bytes);
    assert_int_equal(tally_gpu_copy_from(mem, size - 16, bytes, 16), TALLY_OK);
    assert_int_equal(bytes[0], 7);
    assert_int_equal(bytes[15], 7);
    tally_gpu_free(&mem);
    assert_null(mem);
    assert_int_equal(unsetenv("TALLY_TEST_SIM_GPU"), 0);
}

static void test_push_calls(void **state)
{
    (void)state;
    tally_req_t hist = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    tally_push_t *push = NULL;
    assert_int_equal(tally_push_new(client, &hist, NULL, NULL, NULL, NULL), TALLY_E_ARG);
    assert_int_equal(tally_push_new(NULL, &hist, NULL, NULL, NULL, &push), TALLY_E_ARG);
    assert_null(push);
    assert_int_equal(tally_push_new(client, NULL, NULL, NULL, NULL, &push), TALLY_E_ARG);
    tally_req_t ping = {.opcode = TALLY_OP_PING};
    assert_int_equal(tally_push_new(client, &ping, NULL, NULL, NULL, &push), TALLY_E_ARG);
    assert_non_null(strstr(tally_client_error(client), "a push takes operations with a batch"));
    tally_req_t no_dtype = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_NONE};
    assert_int_equal(tally_push_new(client, &no_dtype, NULL, NULL, NULL, &push), TALLY_E_ARG);
    tally_run_opts_t numbered = {.seq = TALLY_RUN_SEQ_APPEND}; /* but no stream */
    assert_int_equal(tally_push_new(client, &hist, &numbered, NULL, NULL, &push), TALLY_E_ARG);
    assert_non_null(strstr(tally_client_error(client), "sequence numbers need a stream"));
    tally_req_t minmax = {.opcode = TALLY_OP_MINMAX, .dtype = TALLY_DTYPE_I32};
    tally_run_opts_t shm = {.shm = TALLY_RUN_SHM_HOST};
    assert_int_equal(tally_push_new(client, &minmax, &shm, NULL, NULL, &push), TALLY_E_ARG);
    assert_int_equal(tally_push_chunk_bytes(NULL), 0);
    assert_null(tally_push_result(NULL));
    assert_int_equal(tally_push_write(NULL, "x", 1), TALLY_E_ARG);
    assert_int_equal(tally_push_flush(NULL), TALLY_E_ARG);
    assert_int_equal(tally_push_finish(NULL), TALLY_E_ARG);
    tally_push_destroy(NULL);
    tally_push_destroy(&push);
    /* A finished push: writes and flushes refused, finishing again answers the same. */
    assert_int_equal(tally_push_new(client, &hist, NULL, NULL, NULL, &push), TALLY_OK);
    assert_int_equal(tally_push_write(push, NULL, 3), TALLY_E_ARG); /* a length without data */
    assert_int_equal(tally_push_write(push, "abc", 3), TALLY_OK);
    assert_int_equal(tally_push_finish(push), TALLY_OK);
    assert_int_equal(tally_push_finish(push), TALLY_OK);
    assert_int_equal(tally_push_flush(push), TALLY_E_ARG);
    assert_int_equal(tally_push_write(push, "d", 1), TALLY_E_ARG);
    tally_push_destroy(&push);
    assert_null(push);
    int64_t lo, hi;
    assert_int_equal(tally_minmax(client, TALLY_DTYPE_I32, "\1\0\0\0", 4, NULL, &hi), TALLY_E_ARG);
    assert_int_equal(tally_minmax(client, TALLY_DTYPE_I32, "\1\0\0\0", 4, &lo, NULL), TALLY_E_ARG);
}

static void test_hist_calls(void **state)
{
    (void)state;
    tally_stream_info_t info;
    memset(&info, 0, sizeof info);
    tally_hist_t hist;
    assert_int_equal(tally_hist_from_info(&info, 0, &hist), TALLY_E_ARG); /* no histogram yet */
    info.hist_dtype = TALLY_DTYPE_U8;
    info.bins[5] = 2;
    info.hist_total = 2;
    assert_int_equal(tally_hist_from_info(&info, 1, &hist), TALLY_E_ARG); /* no channel 1 */
    assert_int_equal(tally_hist_from_info(NULL, 0, &hist), TALLY_E_ARG);
    assert_int_equal(tally_hist_from_info(&info, 0, NULL), TALLY_E_ARG);
    info.hist_dtype = TALLY_DTYPE_I32; /* a ranged type with an empty range: not from tallyd */
    info.hist_lo = info.hist_hi = 10;
    assert_int_equal(tally_hist_from_info(&info, 0, &hist), TALLY_E_ARG);
    info.hist_dtype = TALLY_DTYPE_U8;
    assert_int_equal(tally_hist_from_info(&info, 0, &hist), TALLY_OK);
    tally_quantile_t q;
    assert_int_equal(tally_hist_quantile(&hist, -0.1, &q), TALLY_E_ARG);
    assert_int_equal(tally_hist_quantile(&hist, 1.5, &q), TALLY_E_ARG);
    assert_int_equal(tally_hist_quantile(&hist, NAN, &q), TALLY_E_ARG);
    assert_int_equal(tally_hist_quantile(NULL, 0.5, &q), TALLY_E_ARG);
    assert_int_equal(tally_hist_quantile(&hist, 0.5, NULL), TALLY_E_ARG);
    char name[TALLY_QUANTILE_NAME_MAX];
    assert_int_equal(tally_quantile_name(2, name, sizeof name), TALLY_E_ARG);
    assert_int_equal(tally_quantile_name(0.5, name, 4), TALLY_E_ARG); /* room too small */
    assert_int_equal(tally_quantile_name(0.5, NULL, sizeof name), TALLY_E_ARG);
    assert_int_equal(tally_quantile_name(0.125, name, sizeof name), TALLY_OK);
    assert_string_equal(name, "p12.5");
    tally_buf_t out = {0};
    double too_many[TALLY_QUANTILES_MAX + 1];
    for (int i = 0; i <= TALLY_QUANTILES_MAX; i++)
        too_many[i] = i / 100.0;
    assert_int_equal(tally_hist_json_quantiles(&hist, too_many, TALLY_QUANTILES_MAX + 1, &out),
                     TALLY_E_ARG);
    assert_int_equal(tally_hist_json_quantiles(&hist, NULL, 2, &out), TALLY_E_ARG);
    double bad[] = {0.5, 1.01};
    assert_int_equal(tally_hist_csv_quantiles(&hist, NULL, false, bad, 2, &out), TALLY_E_ARG);
    assert_int_equal(tally_hist_json(NULL, &out), TALLY_E_ARG);
    assert_int_equal(tally_hist_json(&hist, NULL), TALLY_E_ARG);
    assert_int_equal(tally_hist_csv(NULL, NULL, true, &out), TALLY_E_ARG);
    assert_int_equal(out.len, 0); /* nothing appended by a refusal */
    tally_stream_view_t view = {.name = NULL, .info = &info};
    assert_int_equal(tally_stream_json(&view, &out), TALLY_E_ARG);
    assert_int_equal(tally_stream_json(NULL, &out), TALLY_E_ARG);
    assert_int_equal(tally_json_string(NULL, &out), TALLY_E_ARG);
    assert_int_equal(tally_json_string("x", NULL), TALLY_E_ARG);
    /* A control character goes out as \\u00XX. */
    assert_int_equal(tally_json_string("a\x01", &out), TALLY_OK);
    assert_string_equal((const char *)out.data, "\"a\\u0001\"");
    tally_buf_free(&out);
    assert_int_equal(tally_buf_append(NULL, "x", 1), TALLY_E_ARG);
    assert_int_equal(tally_buf_printf(NULL, "%d", 1), TALLY_E_ARG);
    assert_int_equal(tally_buf_append(&out, "x", 1), TALLY_OK);
    assert_int_equal(tally_buf_reserve(&out, SIZE_MAX), TALLY_E_ARG); /* len + extra overflows */
    tally_buf_free(&out);
    tally_buf_free(NULL);
}

static void test_sub_and_keys(void **state)
{
    (void)state;
    tally_sub_t *sub = NULL;
    assert_int_equal(tally_sub_new(NULL, &sub), TALLY_E_ARG);
    assert_int_equal(tally_sub_new("", &sub), TALLY_E_ARG);
    assert_int_equal(tally_sub_new("tcp://127.0.0.1:1", NULL), TALLY_E_ARG);
    assert_int_equal(tally_sub_subscribe(NULL, ""), TALLY_E_ARG);
    tally_pub_msg_t m;
    assert_int_equal(tally_sub_recv(NULL, 0, &m), TALLY_E_ARG);
    assert_int_equal(tally_sub_fd(NULL), -1);
    tally_sub_destroy(NULL);
    assert_int_equal(tally_sub_new("tcp://127.0.0.1:1", &sub), TALLY_OK);
    char long_prefix[TALLY_STREAM_NAME_MAX + 2];
    memset(long_prefix, 'p', sizeof long_prefix - 1);
    long_prefix[sizeof long_prefix - 1] = '\0';
    assert_int_equal(tally_sub_subscribe(sub, long_prefix), TALLY_E_ARG);
    assert_int_equal(tally_sub_subscribe(sub, NULL), TALLY_E_ARG);
    assert_int_equal(tally_sub_recv(sub, 0, NULL), TALLY_E_ARG);
    assert_true(tally_sub_fd(sub) >= 0);
    assert_int_equal(tally_sub_recv(sub, 0, &m), TALLY_E_TIMEOUT); /* nothing came */
    tally_sub_destroy(&sub);
    assert_null(sub);

    char msg[256];
    char pub[41];
    assert_int_equal(tally_keygen(NULL, pub, msg, sizeof msg), TALLY_E_ARG);
    assert_int_equal(tally_keygen("", pub, msg, sizeof msg), TALLY_E_ARG);
    assert_int_equal(tally_curve_keys_load("x", "y", NULL, msg, sizeof msg), TALLY_E_ARG);
    tally_client_t *c = NULL;
    tally_curve_keys_t bad = {
        .server_public = "short", .client_public = "short", .client_secret = "short"};
    assert_int_equal(tally_client_new_curve(daemon_.endpoint, 1000, &bad, &c), TALLY_E_ARG);
    assert_null(c);
}

/* tally_keygen never replaces a key file, and never leaves half a pair: a second keygen of the
 * same name is refused naming the file, the pair left as it was; a stray NAME.pub refuses the
 * pair and takes the NAME.key just written away again; a name too long for a path is refused. */
static void test_keygen_never_replaces(void **state)
{
    (void)state;
    char dir[64], base[96], path[128], msg[512], want[256], pub[41], again[41] = "";
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-keygen"), 0);
    snprintf(base, sizeof base, "%s/a", dir);
    assert_int_equal(tally_keygen(base, pub, msg, sizeof msg), TALLY_OK);
    assert_int_equal(strlen(pub), 40);
    char *key_before = th_slurp(strcat(strcpy(path, base), ".key"));
    assert_non_null(key_before);
    assert_int_equal(tally_keygen(base, again, msg, sizeof msg), TALLY_E_IO);
    snprintf(want, sizeof want, "cannot create %s.key: File exists", base);
    assert_string_equal(msg, want);
    assert_string_equal(again, ""); /* no key said made */
    char *key_after = th_slurp(path);
    assert_string_equal(key_after, key_before);
    free(key_before);
    free(key_after);

    snprintf(base, sizeof base, "%s/b", dir);
    assert_int_equal(th_write_file(dir, "b.pub", "stray\n", 6), 0);
    assert_int_equal(tally_keygen(base, pub, msg, sizeof msg), TALLY_E_IO);
    snprintf(want, sizeof want, "cannot create %s.pub: File exists", base);
    assert_string_equal(msg, want);
    snprintf(path, sizeof path, "%s.key", base);
    assert_int_equal(access(path, F_OK), -1); /* no half a pair */

    snprintf(base, sizeof base, "%s/b.pub/c", dir); /* under a file: not a directory */
    assert_int_equal(tally_keygen(base, pub, msg, sizeof msg), TALLY_E_IO);
    snprintf(want, sizeof want, "cannot create %s.key: Not a directory", base);
    assert_string_equal(msg, want);
    char too_long[5000];
    memset(too_long, 'k', sizeof too_long - 1);
    too_long[sizeof too_long - 1] = '\0';
    assert_int_equal(tally_keygen(too_long, pub, msg, sizeof msg), TALLY_E_ARG);
    assert_int_equal(th_rmrf(dir), 0);
}

/* Where tally_curve_keys_load finds the keys, first match wins: the argument, TALLY_SERVER_KEY
 * and TALLY_CLIENT_KEY, then `server_key` and `client_key` in $XDG_CONFIG_HOME/tally/tally.conf
 * (else ~/.config/tally/tally.conf), whose lines may be indented and padded and whose other keys
 * that start with the same letters are not these; and what each half-configured pair says. */
static void test_curve_keys_where_from(void **state)
{
    (void)state;
    char dir[64], path[160], conf[256], msg[512], me[41], other[41], sec[41], xdg[96], me_key[128];
    tally_curve_keys_t keys;
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-curve-keys"), 0);
    snprintf(path, sizeof path, "%s/me", dir);
    assert_int_equal(tally_keygen(path, me, msg, sizeof msg), TALLY_OK);
    snprintf(me_key, sizeof me_key, "%s/me.key", dir);
    assert_int_equal(zmq_curve_keypair(other, sec), 0);
    snprintf(xdg, sizeof xdg, "%s/xdg", dir);
    snprintf(path, sizeof path, "%s/xdg/tally", dir);
    assert_int_equal(mkdir(xdg, 0700), 0);
    assert_int_equal(mkdir(path, 0700), 0);
    int n = snprintf(conf, sizeof conf,
                     "# keys\n\tserver_key\t=  %s \t\r\n  server_key_old = %s\nclient_key=%s\n"
                     "client_keyring\n",
                     other, me, me_key);
    assert_int_equal(th_write_file(path, "tally.conf", conf, (size_t)n), 0);
    char *home = getenv("HOME") ? strdup(getenv("HOME")) : NULL;
    assert_int_equal(setenv("XDG_CONFIG_HOME", xdg, 1), 0);
    unsetenv("TALLY_SERVER_KEY");
    unsetenv("TALLY_CLIENT_KEY");

    /* The configuration file: server_key, not server_key_old; the value without its padding. */
    assert_int_equal(tally_curve_keys_load(NULL, NULL, &keys, msg, sizeof msg), TALLY_OK);
    assert_string_equal(keys.server_public, other);
    assert_string_equal(keys.client_public, me);
    /* The environment before the file, the argument before both. */
    assert_int_equal(setenv("TALLY_SERVER_KEY", me, 1), 0);
    assert_int_equal(tally_curve_keys_load(NULL, NULL, &keys, msg, sizeof msg), TALLY_OK);
    assert_string_equal(keys.server_public, me);
    assert_int_equal(tally_curve_keys_load(other, NULL, &keys, msg, sizeof msg), TALLY_OK);
    assert_string_equal(keys.server_public, other);
    unsetenv("TALLY_SERVER_KEY");

    /* A server key file with no public key in it; a client key file with no public key. */
    char secret_only[128], want[512];
    snprintf(secret_only, sizeof secret_only, "%s/secret-only.key", dir);
    assert_int_equal(th_write_key_file(secret_only, NULL, sec, 0600), 0);
    assert_int_equal(tally_curve_keys_load(secret_only, me_key, &keys, msg, sizeof msg),
                     TALLY_E_ARG);
    snprintf(want, sizeof want, "%s holds no public-key (the server's public key)", secret_only);
    assert_string_equal(msg, want);
    assert_string_equal(keys.server_public, ""); /* nothing half loaded */
    assert_int_equal(tally_curve_keys_load(other, secret_only, &keys, msg, sizeof msg),
                     TALLY_E_ARG);
    snprintf(want, sizeof want, "%s: no public-key beside the secret key (use `tally keygen`)",
             secret_only);
    assert_string_equal(msg, want);
    assert_string_equal(keys.client_public, "");

    /* A server key and no client key anywhere: how to make one. */
    n = snprintf(conf, sizeof conf, "server_key = %s\n", other);
    assert_int_equal(th_write_file(path, "tally.conf", conf, (size_t)n), 0);
    assert_int_equal(tally_curve_keys_load(NULL, NULL, &keys, msg, sizeof msg), TALLY_E_ARG);
    assert_non_null(strstr(msg, "a server key is set but no client key: make one with `tally "
                                "keygen NAME`"));
    assert_string_equal(keys.server_public, "");

    /* For a fleet (tally_curve_client_keys_load): the client's pair alone, from the file or the
     * environment, is CURVE on with each member's own key; a server key given is kept (pinned);
     * a bad client key is refused as above; neither anywhere: all "" (plain). */
    n = snprintf(conf, sizeof conf, "client_key = %s\n", me_key);
    assert_int_equal(th_write_file(path, "tally.conf", conf, (size_t)n), 0);
    assert_int_equal(tally_curve_keys_load(NULL, NULL, &keys, msg, sizeof msg), TALLY_OK);
    assert_string_equal(keys.client_public, ""); /* one tallyd: no server key, CURVE off */
    assert_int_equal(tally_curve_client_keys_load(NULL, NULL, &keys, msg, sizeof msg), TALLY_OK);
    assert_string_equal(keys.server_public, "");
    assert_string_equal(keys.client_public, me);
    assert_int_equal(strlen(keys.client_secret), 40);
    assert_int_equal(tally_curve_client_keys_load(other, NULL, &keys, msg, sizeof msg), TALLY_OK);
    assert_string_equal(keys.server_public, other);
    assert_string_equal(keys.client_public, me);
    assert_int_equal(setenv("TALLY_CLIENT_KEY", secret_only, 1), 0);
    assert_int_equal(tally_curve_client_keys_load(NULL, NULL, &keys, msg, sizeof msg), TALLY_E_ARG);
    assert_string_equal(keys.client_public, "");
    unsetenv("TALLY_CLIENT_KEY");
    assert_int_equal(th_write_file(path, "tally.conf", "", 0), 0);
    assert_int_equal(tally_curve_client_keys_load(NULL, NULL, &keys, msg, sizeof msg), TALLY_OK);
    assert_string_equal(keys.client_secret, "");
    assert_int_equal(tally_curve_client_keys_load(NULL, NULL, NULL, msg, sizeof msg), TALLY_E_ARG);

    /* No XDG_CONFIG_HOME: ~/.config/tally/tally.conf, here none: CURVE off. */
    unsetenv("XDG_CONFIG_HOME");
    assert_int_equal(setenv("HOME", dir, 1), 0);
    assert_int_equal(tally_curve_keys_load(NULL, NULL, &keys, msg, sizeof msg), TALLY_OK);
    assert_string_equal(keys.server_public, "");
    if (home)
        setenv("HOME", home, 1);
    free(home);
    assert_int_equal(th_rmrf(dir), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_info_calls),
        cmocka_unit_test(test_stream_calls),
        cmocka_unit_test(test_region_calls),
        cmocka_unit_test(test_push_calls),
        cmocka_unit_test(test_hist_calls),
        cmocka_unit_test(test_sub_and_keys),
        cmocka_unit_test(test_gpu_calls),
        cmocka_unit_test(test_keygen_never_replaces),
        cmocka_unit_test(test_curve_keys_where_from),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
