/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_info_reply.c — the `info` reply (daemon/core/td_ops.c, td_op_info) built from what a test
 * sets: every key once, in order, the GPU UUIDs empty when there are none (NULL), the fleet's
 * keys last when there is a fleet; and a reply whose parts would pass the 64 KiB it has (a
 * description of devices that long) cut at 64 KiB - 1 bytes, each later part cut with it rather
 * than written past the buffer (the ASan build checks).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "td_fleet_status.h"
#include "td_settings.h"
#include "td_ops.h"

#define TEXT_MAX (64 * 1024) /* td_ops.c's TD_TEXT_REPLY_MAX */

static td_request_t *info_reply(const td_info_t *info)
{
    td_request_t *r = td_request_new();
    assert_non_null(r);
    r->req.opcode = TALLY_OP_INFO;
    td_op_info(info, r);
    assert_int_equal(r->rep.status, TALLY_OK);
    assert_int_equal(r->rep.dtype, TALLY_DTYPE_TEXT);
    assert_int_equal(r->rep.count, r->reply_len);
    return r;
}

/* The text of r's reply, terminated (a copy to free). */
static char *text_of(const td_request_t *r)
{
    char *s = malloc(r->reply_len + 1);
    assert_non_null(s);
    memcpy(s, r->reply_data, r->reply_len);
    s[r->reply_len] = '\0';
    return s;
}

static void test_keys(void **state)
{
    (void)state;
    td_config_t cfg;
    td_config_init(&cfg);
    static td_fleet_status_t fleet; /* zeroed: a tallyd that is no fleet worker */
    td_info_t info = {.cfg = &cfg, .backend = "cpu", .backends = "cpu", .devices = "none",
                      .shards = 2};
    td_request_t *r = info_reply(&info);
    char *s = text_of(r);
    assert_true(strncmp(s, "version=", 8) == 0);
    assert_non_null(strstr(s, "\ndevices=none\n"));
    assert_non_null(strstr(s, "\ngpu_uuids=\nshards=2\nfronts=\n"));
    assert_null(strstr(s, "nats="));
    free(s);
    td_request_destroy(&r);
    info.gpu_uuids = "GPU-0";
    info.fleet = &fleet;
    assert_int_equal(td_config_add_endpoint(cfg.fronts, &cfg.front_count, "ipc:///tmp/f1"), TD_OK);
    assert_int_equal(td_config_add_endpoint(cfg.fronts, &cfg.front_count, "tcp://127.0.0.1:7"),
                     TD_OK);
    r = info_reply(&info);
    s = text_of(r);
    assert_non_null(strstr(s,
                           "\ngpu_uuids=GPU-0\nshards=2\nfronts=ipc:///tmp/f1,tcp://127.0.0.1:7\n"
                           "nats=off\n"));
    assert_int_equal(s[r->reply_len - 1], '\n');
    free(s);
    td_request_destroy(&r);
    td_config_clear(&cfg);
}

static void test_cut_at_the_buffer(void **state)
{
    (void)state;
    td_config_t cfg;
    td_config_init(&cfg);
    static td_fleet_status_t fleet;
    char *devices = malloc(TEXT_MAX + 100);
    assert_non_null(devices);
    memset(devices, 'd', TEXT_MAX + 99);
    devices[TEXT_MAX + 99] = '\0';
    td_info_t info = {.cfg = &cfg, .backend = "cpu", .backends = "cpu", .devices = devices,
                      .gpu_uuids = "GPU-0", .shards = 1, .fleet = &fleet};
    td_request_t *r = info_reply(&info);
    assert_int_equal(r->reply_len, TEXT_MAX - 1);
    const char *s = r->reply_data;
    assert_true(memcmp(s + TEXT_MAX - 101, "dddd", 4) == 0); /* the devices, to the end */
    assert_int_equal(s[TEXT_MAX - 2], 'd');
    td_request_destroy(&r);
    free(devices);
    td_config_clear(&cfg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_keys),
        cmocka_unit_test(test_cut_at_the_buffer),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
