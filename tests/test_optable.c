/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_optable.c — proto/'s operation table (tally_ops.h) and the validator that reads it: for
 * every row, a dtype, flag or stream the row does not list is refused with the status
 * PROTOCOL.md §6 gives, and one it lists is not; max_batch is enforced in one place, with one
 * message, for a payload and a shared-memory reference alike; the reply sizes libtally reserves
 * follow the reply shape. The expected values are written out here from PROTOCOL.md §4 and §5,
 * not read back from the table.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "tally_ops.h"
#include "tally_proto.h"

#define MAX_BATCH 4096

/* What PROTOCOL.md §4's table of opcodes says, one line per operation. */
static const struct {
    uint8_t opcode;
    const char *name;
    const char *dtypes;  /* as tally_op_dtypes_text writes them */
    unsigned dtype_bits; /* bit d: dtype d (PROTOCOL.md §4's numbers) */
    unsigned flags;
    tally_stream_rule_t stream;
    bool batch;
} spec[] = {
    {1, "ping", "none", 0x1, 0, TALLY_STREAM_NONE, false},
    {2, "info", "none", 0x1, 0, TALLY_STREAM_NONE, false},
    {3, "filter", "i32 or u8", 0x6, 0x84, TALLY_STREAM_OPTIONAL, true},
    {4, "scan", "i32", 0x2, 0x83, TALLY_STREAM_OPTIONAL, true},
    {5, "hist", "i32, u8, u16, rgb8 or rgba8", 0x1c6, 0x80, TALLY_STREAM_OPTIONAL, true},
    {6, "query", "none", 0x1, 0x08, TALLY_STREAM_REQUIRED, false},
    {7, "reset", "none", 0x1, 0, TALLY_STREAM_REQUIRED, false},
    {8, "streams", "none", 0x1, 0, TALLY_STREAM_NONE, false},
    {9, "stats", "none", 0x1, 0, TALLY_STREAM_NONE, false},
    {10, "delete", "none", 0x1, 0, TALLY_STREAM_REQUIRED, false},
    {13, "minmax", "i32, u8 or u16", 0x46, 0, TALLY_STREAM_NONE, true},
};
#define SPEC_COUNT (sizeof spec / sizeof spec[0])

/* A request the row accepts: its first dtype, the parameters that dtype needs, a stream when
 * one is required. */
static tally_req_t valid_req(unsigned opcode)
{
    tally_req_t req = {.opcode = (uint8_t)opcode, .request_id = 7};
    for (unsigned d = 0; d < TALLY_DTYPE_COUNT; d++) {
        if (tally_op_takes_dtype(opcode, d)) {
            req.dtype = (uint8_t)d;
            break;
        }
    }
    if (opcode == TALLY_OP_FILTER)
        req.pred = TALLY_PRED_GT;
    if (opcode == TALLY_OP_HIST && tally_hist_ranged(req.dtype))
        req.hi = 256; /* [0, 256) */
    if (tally_op_info(opcode)->stream == TALLY_STREAM_REQUIRED)
        assert_int_equal(tally_req_set_stream(&req, "cam0"), TALLY_OK);
    return req;
}

static tally_status_t check(const tally_req_t *req, size_t payload, char *msg)
{
    return tally_req_validate(req, payload, MAX_BATCH, msg, 256);
}

static void test_rows_match_protocol(void **state)
{
    (void)state;
    char text[64];
    size_t count = 0, rows = 0;
    const tally_op_info_t *table = tally_op_table(&count);
    assert_int_equal(count, TALLY_OP_COUNT);
    for (size_t i = 0; i < count; i++)
        rows += table[i].name != NULL;
    assert_int_equal(rows, SPEC_COUNT);
    for (size_t i = 0; i < SPEC_COUNT; i++) {
        const tally_op_info_t *row = tally_op_info(spec[i].opcode);
        assert_non_null(row);
        assert_int_equal(row->opcode, spec[i].opcode);
        assert_string_equal(row->name, spec[i].name);
        assert_string_equal(tally_op_name((tally_op_t)spec[i].opcode), spec[i].name);
        assert_ptr_equal(tally_op_find(spec[i].name), row);
        assert_string_equal(tally_op_dtypes_text(spec[i].opcode, text, sizeof text),
                            spec[i].dtypes);
        assert_int_equal(row->flags, spec[i].flags);
        assert_int_equal(row->stream, spec[i].stream);
        assert_int_equal(row->batch, spec[i].batch);
        assert_true(row->summary != NULL && strlen(row->summary) > 0);
    }
    static const unsigned unknown[] = {0, 11, 12, TALLY_OP_COUNT, 255, 1000};
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++)
        assert_null(tally_op_info(unknown[i]));
    assert_null(tally_op_find("nope"));
    assert_null(tally_op_find(NULL));
}

/* Every dtype the row does not list is bad_dtype, naming what it takes; every one it lists
 * passes the dtype step (the parameters it needs may still be missing). */
static void test_dtypes_follow_rows(void **state)
{
    (void)state;
    char msg[256], want[160], takes[64];
    for (size_t i = 0; i < SPEC_COUNT; i++) {
        for (unsigned d = 0; d < TALLY_DTYPE_COUNT; d++) {
            tally_req_t req = valid_req(spec[i].opcode);
            req.dtype = (uint8_t)d;
            tally_status_t st = check(&req, 0, msg);
            bool listed = (spec[i].dtype_bits >> d) & 1;
            assert_int_equal(tally_op_takes_dtype(spec[i].opcode, d), listed);
            if (listed) {
                assert_int_not_equal(st, TALLY_E_DTYPE);
                continue;
            }
            assert_int_equal(st, TALLY_E_DTYPE);
            snprintf(want, sizeof want, "%s takes dtype %s (got %s)", spec[i].name,
                     tally_op_dtypes_text(spec[i].opcode, takes, sizeof takes),
                     tally_dtype_name((tally_dtype_t)d));
            assert_string_equal(msg, want);
        }
    }
}

/* Every flag bit outside the row's is bad_param; each of the row's own passes the flag step. */
static void test_flags_follow_rows(void **state)
{
    (void)state;
    char msg[256], want[96];
    for (size_t i = 0; i < SPEC_COUNT; i++) {
        for (unsigned bit = 1; bit < 0x100; bit <<= 1) {
            tally_req_t req = valid_req(spec[i].opcode);
            req.flags = (uint8_t)bit;
            tally_status_t st = check(&req, 0, msg);
            if (spec[i].flags & bit) {
                assert_true(st != TALLY_E_PARAM || strstr(msg, "flags") == NULL);
                continue;
            }
            assert_int_equal(st, TALLY_E_PARAM);
            snprintf(want, sizeof want, "flags 0x%02x are not defined for %s", bit, spec[i].name);
            assert_string_equal(msg, want);
        }
    }
}

/* req is accepted when ok, else refused bad_stream_name with the message fmt says. */
static void expect_stream_rule(const tally_req_t *req, bool ok, const char *fmt, const char *op)
{
    char msg[256], want[96];
    tally_status_t st = check(req, 0, msg);
    if (ok) {
        assert_int_equal(st, TALLY_OK);
        return;
    }
    assert_int_equal(st, TALLY_E_STREAM_NAME);
    snprintf(want, sizeof want, fmt, op);
    assert_string_equal(msg, want);
}

static void test_streams_follow_rows(void **state)
{
    (void)state;
    char msg[256];
    for (size_t i = 0; i < SPEC_COUNT; i++) {
        tally_req_t with = valid_req(spec[i].opcode), without = with;
        assert_int_equal(tally_req_set_stream(&with, "cam0"), TALLY_OK);
        assert_int_equal(tally_req_set_stream(&without, NULL), TALLY_OK);
        expect_stream_rule(&with, spec[i].stream != TALLY_STREAM_NONE,
                           "%s takes no stream name (got \"cam0\")", spec[i].name);
        expect_stream_rule(&without, spec[i].stream != TALLY_STREAM_REQUIRED,
                           "%s needs a stream name", spec[i].name);
        /* seq: only a batch on a stream may carry one */
        with.seq = without.seq = 3;
        bool seq_ok = spec[i].batch && spec[i].stream != TALLY_STREAM_NONE;
        if (spec[i].stream != TALLY_STREAM_NONE)
            assert_int_equal(check(&with, 0, msg), seq_ok ? TALLY_OK : TALLY_E_PARAM);
        if (spec[i].stream != TALLY_STREAM_REQUIRED)
            assert_int_equal(check(&without, 0, msg), TALLY_E_PARAM);
    }
}

/* The batch: too_large over max_batch, with the one message, for a payload and a reference;
 * an operation without a batch takes an empty payload. */
static void test_batch_and_max_batch(void **state)
{
    (void)state;
    char msg[256], ref_msg[256];
    for (size_t i = 0; i < SPEC_COUNT; i++) {
        tally_req_t req = valid_req(spec[i].opcode);
        size_t esize = tally_dtype_size((tally_dtype_t)req.dtype);
        if (!spec[i].batch) {
            assert_int_equal(check(&req, 1, msg), TALLY_E_PAYLOAD);
            continue;
        }
        assert_int_equal(check(&req, 0, msg), TALLY_OK); /* an empty batch */
        assert_int_equal(check(&req, MAX_BATCH / esize * esize, msg), TALLY_OK);
        assert_int_equal(check(&req, MAX_BATCH + 1, msg), TALLY_E_TOO_LARGE);
        assert_string_equal(msg, "batch of 4097 bytes exceeds the maximum of 4096");
        if (!(spec[i].flags & TALLY_FLAG_SHM_REF))
            continue;
        tally_shm_ref_t ref = {.in_handle = 1, .in_length = MAX_BATCH + 1};
        req.flags |= TALLY_FLAG_SHM_REF;
        assert_int_equal(tally_shm_ref_validate(&req, &ref, MAX_BATCH, ref_msg, sizeof ref_msg),
                         TALLY_E_TOO_LARGE);
        assert_string_equal(ref_msg, msg);
    }
    assert_int_equal(tally_batch_check(MAX_BATCH, MAX_BATCH, msg, sizeof msg), TALLY_OK);
    assert_int_equal(tally_batch_check(UINT64_MAX, MAX_BATCH, msg, sizeof msg), TALLY_E_TOO_LARGE);
    assert_string_equal(msg, "batch of 18446744073709551615 bytes exceeds the maximum of 4096");
}

/* What libtally reserves for a reply and the largest output region (PROTOCOL.md §5, §10). */
static void test_reply_sizes(void **state)
{
    (void)state;
    tally_req_t req = {.opcode = TALLY_OP_FILTER, .dtype = TALLY_DTYPE_I32};
    assert_int_equal(tally_op_reply_bytes(&req, 400), 400);
    assert_int_equal(tally_op_reply_elem(&req), 4);
    assert_int_equal(tally_shm_out_worst(&req, 400), 400);
    req = (tally_req_t){.opcode = TALLY_OP_SCAN, .dtype = TALLY_DTYPE_I32};
    assert_int_equal(tally_op_reply_bytes(&req, 400), 800);
    assert_int_equal(tally_shm_out_worst(&req, 400), 800);
    req.flags = TALLY_FLAG_SCAN_OUT_I32;
    assert_int_equal(tally_op_reply_bytes(&req, 400), 400);
    assert_int_equal(tally_op_reply_elem(&req), 4);
    req = (tally_req_t){.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    assert_int_equal(tally_op_reply_bytes(&req, 400), 2048);
    assert_int_equal(tally_shm_out_worst(&req, 400), 0); /* hist takes no output region */
    req.dtype = TALLY_DTYPE_I32;
    assert_int_equal(tally_op_reply_bytes(&req, 400), 2064);
    req.dtype = TALLY_DTYPE_RGB8;
    assert_int_equal(tally_op_reply_bytes(&req, 300), 6144);
    req = (tally_req_t){.opcode = TALLY_OP_QUERY};
    assert_int_equal(tally_op_reply_bytes(&req, 0), 0);
    assert_false(tally_op_has_output(TALLY_OP_HIST));
    assert_true(tally_op_has_output(TALLY_OP_FILTER));
    assert_true(tally_op_has_output(TALLY_OP_SCAN));
    /* minmax: two elements of the batch's dtype, whatever the batch's length */
    req = (tally_req_t){.opcode = TALLY_OP_MINMAX, .dtype = TALLY_DTYPE_I32};
    assert_int_equal(tally_op_reply_bytes(&req, 4000), 8);
    assert_int_equal(tally_op_reply_elem(&req), 4);
    assert_int_equal(tally_shm_out_worst(&req, 4000), 0);
    req.dtype = TALLY_DTYPE_U8;
    assert_int_equal(tally_op_reply_bytes(&req, 4000), 2);
    req.dtype = TALLY_DTYPE_U16;
    assert_int_equal(tally_op_reply_bytes(&req, 4000), 4);
    assert_false(tally_op_has_output(TALLY_OP_MINMAX));
    assert_false(tally_op_has_output(TALLY_OP_PING));
}

/* minmax's reply payload: min then max in the batch's type, little-endian (PROTOCOL.md §5). */
static void test_minmax_payload(void **state)
{
    (void)state;
    uint8_t out[16];
    int64_t min = 0, max = 0;
    assert_int_equal(tally_minmax_encode(TALLY_DTYPE_I32, INT32_MIN, -2, out), 8);
    static const uint8_t i32[8] = {0x00, 0x00, 0x00, 0x80, 0xfe, 0xff, 0xff, 0xff};
    assert_memory_equal(out, i32, 8);
    tally_minmax_decode(TALLY_DTYPE_I32, out, &min, &max);
    assert_int_equal(min, INT32_MIN);
    assert_int_equal(max, -2);
    assert_int_equal(tally_minmax_encode(TALLY_DTYPE_U16, 7, 65535, out), 4);
    static const uint8_t u16[4] = {0x07, 0x00, 0xff, 0xff};
    assert_memory_equal(out, u16, 4);
    tally_minmax_decode(TALLY_DTYPE_U16, out, &min, &max);
    assert_int_equal(min, 7);
    assert_int_equal(max, 65535);
    assert_int_equal(tally_minmax_encode(TALLY_DTYPE_U8, 0, 255, out), 2);
    tally_minmax_decode(TALLY_DTYPE_U8, out, &min, &max);
    assert_int_equal(min, 0);
    assert_int_equal(max, 255);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rows_match_protocol), cmocka_unit_test(test_dtypes_follow_rows),
        cmocka_unit_test(test_flags_follow_rows),   cmocka_unit_test(test_streams_follow_rows),
        cmocka_unit_test(test_batch_and_max_batch), cmocka_unit_test(test_reply_sizes),
        cmocka_unit_test(test_minmax_payload),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
