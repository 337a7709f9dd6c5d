/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_request_exec.c — td_request_execute (daemon/core/td_request.c) with a backend that fails:
 * no real backend fails on good input, so these answers are reached only here. Each compute
 * operation's request becomes the backend's error reply, with its status and a message naming
 * the backend and the operation, and no result left behind (the output buffer freed: the ASan
 * build's leak check); a request whose opcode is not a compute operation is TALLY_E_INTERNAL
 * saying so; an empty minmax batch is a reply without values, count 0, even from this backend
 * (it is not asked); an error message is cut to what the wire allows and replaces a result set
 * before; the request queue is first in, first out.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "td_request.h"
#include "tk_backend.h"

static int calls; /* the failing backend's calls */

static tally_status_t fail_filter(void *ctx, tally_dtype_t dtype, const void *in, size_t n,
                                  const tk_filter_spec_t *spec, void *out, size_t *kept)
{
    (void)ctx, (void)dtype, (void)in, (void)n, (void)spec, (void)out;
    *kept = n; /* what it says it kept must not become a reply */
    calls++;
    return TALLY_E_BACKEND;
}

static tally_status_t fail_scan(void *ctx, const int32_t *in, size_t n, int exclusive, int out_i32,
                                void *out, int64_t *carry)
{
    (void)ctx, (void)in, (void)n, (void)exclusive, (void)out_i32, (void)out;
    *carry = 99;
    calls++;
    return TALLY_E_PARAM;
}

static tally_status_t fail_hist_u8(void *ctx, const uint8_t *in, size_t n, tk_hist_t *hist)
{
    (void)ctx, (void)in, (void)n;
    hist->bins[0] = 1;
    calls++;
    return TALLY_E_BACKEND;
}

static tally_status_t fail_minmax(void *ctx, tally_dtype_t dtype, const void *in, size_t n,
                                  int64_t *min, int64_t *max)
{
    (void)ctx, (void)dtype, (void)in, (void)n;
    *min = *max = 0;
    calls++;
    return TALLY_E_BACKEND;
}

static tk_backend_t failing = {
    .name = "failing",
    .filter = fail_filter,
    .scan = fail_scan,
    .hist_u8 = fail_hist_u8,
    .minmax = fail_minmax,
};

static const int32_t batch[64];

/* Request `op` of `bytes` of batch, as dtype. */
static td_request_t *request(uint8_t op, uint8_t dtype, size_t bytes)
{
    td_request_t *r = td_request_new();
    assert_non_null(r);
    r->req.opcode = op;
    r->req.dtype = dtype;
    r->req.pred = TALLY_PRED_GT;
    r->payload = batch;
    r->payload_len = bytes;
    return r;
}

/* r failed with status, its reply the text `message`. */
static void assert_failed(td_request_t *r, tally_status_t status, const char *message)
{
    assert_int_equal(r->rep.status, status);
    assert_int_equal(r->rep.dtype, TALLY_DTYPE_TEXT);
    assert_int_equal(r->rep.count, 0);
    assert_int_equal(r->rep.aux0, 0);
    assert_int_equal(r->reply_len, strlen(message));
    assert_memory_equal(r->reply_data, message, r->reply_len);
}

static void test_backend_failure_is_the_reply(void **state)
{
    (void)state;
    struct {
        uint8_t op, dtype;
        tally_status_t status;
        const char *message;
    } cases[] = {
        {TALLY_OP_FILTER, TALLY_DTYPE_I32, TALLY_E_BACKEND, "failing backend failed the filter"},
        {TALLY_OP_SCAN, TALLY_DTYPE_I32, TALLY_E_PARAM, "failing backend failed the scan"},
        {TALLY_OP_HIST, TALLY_DTYPE_U8, TALLY_E_BACKEND, "failing backend failed the histogram"},
        {TALLY_OP_MINMAX, TALLY_DTYPE_I32, TALLY_E_BACKEND, "failing backend failed the minmax"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        calls = 0;
        td_request_t *r = request(cases[i].op, cases[i].dtype, sizeof batch);
        td_request_execute(r, &failing);
        assert_int_equal(calls, 1);
        assert_failed(r, cases[i].status, cases[i].message);
        td_request_destroy(&r);
        assert_null(r);
    }
}

static void test_not_a_compute_operation(void **state)
{
    (void)state;
    calls = 0;
    td_request_t *r = request(TALLY_OP_QUERY, TALLY_DTYPE_I32, sizeof batch);
    td_request_execute(r, &failing);
    assert_int_equal(calls, 0);
    assert_failed(r, TALLY_E_INTERNAL, "opcode 6 is not a compute operation");
    td_request_destroy(&r);
}

static void test_empty_minmax_is_a_reply_without_values(void **state)
{
    (void)state;
    td_request_t *r = request(TALLY_OP_MINMAX, TALLY_DTYPE_I32, 0);
    td_request_minmax_result(r, TK_MINMAX_EMPTY_MIN, TK_MINMAX_EMPTY_MAX);
    assert_int_equal(r->rep.status, TALLY_OK);
    assert_int_equal(r->rep.count, 0);
    assert_int_equal(r->rep.aux0, 0);
    assert_int_equal(r->reply_len, 0);
    td_request_destroy(&r);
}

/* An error message longer than the wire allows is cut to TALLY_ERROR_MESSAGE_MAX bytes; an
 * empty one is an empty reply payload; a failure replaces a result set before. */
static void test_error_messages_bounded(void **state)
{
    (void)state;
    td_request_t *r = request(TALLY_OP_HIST, TALLY_DTYPE_U8, sizeof batch);
    char long_text[TALLY_ERROR_MESSAGE_MAX + 40];
    memset(long_text, 'e', sizeof long_text - 1);
    long_text[sizeof long_text - 1] = '\0';
    td_request_fail(r, TALLY_E_PARAM, "%s", long_text);
    assert_int_equal(r->rep.status, TALLY_E_PARAM);
    assert_int_equal(r->reply_len, TALLY_ERROR_MESSAGE_MAX);
    assert_memory_equal(r->reply_data, long_text, TALLY_ERROR_MESSAGE_MAX);
    td_request_fail(r, TALLY_E_BUSY, "%s", "");
    assert_int_equal(r->rep.status, TALLY_E_BUSY);
    assert_int_equal(r->reply_len, 0);
    td_request_destroy(&r);

    r = request(TALLY_OP_MINMAX, TALLY_DTYPE_I32, sizeof batch);
    td_request_minmax_result(r, -3, 7);
    assert_int_equal(r->rep.status, TALLY_OK);
    assert_int_equal(r->rep.count, 2);
    td_request_fail(r, TALLY_E_INTERNAL, "late");
    assert_failed(r, TALLY_E_INTERNAL, "late");
    td_request_destroy(&r);
    td_request_destroy(&r); /* NULL: nothing */
}

/* The queue of requests: FIFO, empty after the last pop and after take_all. */
static void test_queue(void **state)
{
    (void)state;
    td_request_queue_t q = {0};
    assert_null(td_request_queue_pop(&q));
    td_request_t *a = request(TALLY_OP_HIST, TALLY_DTYPE_U8, 1),
                 *b = request(TALLY_OP_HIST, TALLY_DTYPE_U8, 2);
    td_request_queue_push(&q, a);
    td_request_queue_push(&q, b);
    assert_ptr_equal(td_request_queue_pop(&q), a);
    assert_null(a->next);
    assert_ptr_equal(td_request_queue_pop(&q), b);
    assert_null(td_request_queue_pop(&q));
    assert_null(q.tail);
    td_request_queue_push(&q, a);
    td_request_queue_push(&q, b);
    assert_ptr_equal(td_request_queue_take_all(&q), a);
    assert_ptr_equal(a->next, b);
    assert_null(q.head);
    assert_null(td_request_queue_pop(&q));
    a->next = NULL;
    td_request_destroy(&a);
    td_request_destroy(&b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_backend_failure_is_the_reply),
        cmocka_unit_test(test_not_a_compute_operation),
        cmocka_unit_test(test_empty_minmax_is_a_reply_without_values),
        cmocka_unit_test(test_error_messages_bounded),
        cmocka_unit_test(test_queue),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
