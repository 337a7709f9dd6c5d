/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_budget.c — the memory budget of stream state against a real tallyd (PROTOCOL.md §7,
 * §8; issue 26): one connection creating streams is stopped at max_state_bytes_per_client with
 * `client_streams`, another then at max_state_bytes with `limit`, each with a message naming the
 * setting; the gauges stay under the budget; a hist that would grow a stream past it is refused,
 * changes nothing a query sees and does not use up its seq; deleting streams makes room again;
 * `info` reports both limits.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "harness.h"
#include "tally_proto.h"

#define BUDGET 40000
#define PER_CLIENT 25000

static uint64_t next_id;

/* A u8 hist of `n` bytes on stream `name` (every byte value `spread` apart from the last:
 * spread 1 touches every bin, 0 one bin) with seq; the reply status, its message in why. */
static int hist(void *sock, const char *name, size_t n, unsigned spread, uint64_t seq, char *why,
                size_t cap)
{
    uint8_t data[1024];
    for (size_t i = 0; i < n && i < sizeof data; i++)
        data[i] = (uint8_t)(i * spread);
    tally_req_t q = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, ++next_id);
    q.stream_len = (uint8_t)strlen(name);
    memcpy(q.stream, name, q.stream_len);
    q.seq = seq;
    th_reply_t r;
    int st = th_call_reply_status(sock, &q, data, n, &r);
    if (why)
        snprintf(why, cap, "%s", st != TALLY_OK && r.payload ? (const char *)r.payload : "");
    th_reply_free(&r);
    return st;
}

/* Creates streams PREFIX0, PREFIX1, ... with a uniform 1 KiB batch each until one is refused;
 * returns how many were created, the refusal's status in *st and message in why. */
static unsigned fill(void *sock, const char *prefix, int *st, char *why, size_t cap)
{
    char name[32];
    for (unsigned i = 0; i < 1000; i++) {
        snprintf(name, sizeof name, "%s%u", prefix, i);
        *st = hist(sock, name, 1024, 1, 0, why, cap);
        if (*st != TALLY_OK)
            return i;
    }
    return 1000;
}

/* Deletes streams PREFIX0 .. PREFIX(n-1). */
static void delete_all(void *sock, const char *prefix, unsigned n)
{
    for (unsigned i = 0; i < n; i++) {
        char name[32];
        snprintf(name, sizeof name, "%s%u", prefix, i);
        tally_req_t q = th_req(TALLY_OP_DELETE, TALLY_DTYPE_NONE, ++next_id);
        q.stream_len = (uint8_t)strlen(name);
        memcpy(q.stream, name, q.stream_len);
        assert_int_equal(th_call_status(sock, &q, NULL, 0), TALLY_OK);
    }
}

static long query_raw(void *sock, const char *name, uint8_t *out, size_t cap)
{
    return th_query_raw(sock, name, ++next_id, out, cap);
}

static void test_budget_end_to_end(void **state)
{
    (void)state;
    th_daemon_t d;
    const char *args[] = {"--max-state-bytes", "40000", "--max-state-bytes-per-client", "25000",
                          NULL};
    assert_int_equal(th_daemon_start(&d, args), 0);
    void *a = th_connect(d.endpoint, 5000), *b = th_connect(d.endpoint, 5000);
    char why[300];
    int st = 0;

    th_reply_t info;
    tally_req_t q = th_req(TALLY_OP_INFO, TALLY_DTYPE_NONE, ++next_id);
    assert_int_equal(th_call_reply_status(a, &q, NULL, 0, &info), TALLY_OK);
    assert_non_null(strstr((const char *)info.payload,
                           "\nmax_state_bytes=40000\nmax_state_bytes_per_client=25000\n"));
    th_reply_free(&info);

    /* A narrow stream made first: one bin, so sparse and small. */
    assert_int_equal(hist(a, "grow", 100, 0, 1, NULL, 0), TALLY_OK);
    /* Connection a (its own client without CURVE) stops at its share. */
    unsigned made_a = fill(a, "a", &st, why, sizeof why);
    assert_int_equal(st, TALLY_E_CLIENT_STREAMS);
    assert_non_null(strstr(why, "max_state_bytes_per_client 25000"));
    assert_true(made_a >= 15 && made_a <= PER_CLIENT / 700);
    /* b goes on until the whole budget is used. */
    unsigned made_b = fill(b, "b", &st, why, sizeof why);
    assert_int_equal(st, TALLY_E_LIMIT);
    assert_non_null(strstr(why, "max_state_bytes 40000"));
    assert_true(made_b >= 10);
    long long bytes = th_stat(a, "tallyd_state_bytes");
    assert_true(bytes > BUDGET - 2000 && bytes <= BUDGET);
    assert_int_equal(th_stat(a, "tallyd_state_bytes_limit"), BUDGET);

    /* "grow" with every bin: more bytes, refused; its record unchanged; seq 2 not used up. */
    static uint8_t before[TALLY_QUERY_PAYLOAD_MAX], after[TALLY_QUERY_PAYLOAD_MAX];
    long len = query_raw(a, "grow", before, sizeof before);
    assert_true(len > 0);
    st = hist(a, "grow", 1024, 1, 2, why, sizeof why);
    assert_true(st == TALLY_E_LIMIT || st == TALLY_E_CLIENT_STREAMS);
    assert_non_null(strstr(why, "the batch was not applied"));
    assert_int_equal(query_raw(a, "grow", after, sizeof after), len);
    assert_memory_equal(before, after, (size_t)len);

    /* Deleting b's streams makes room: the same seq 2 now applies, and a creates again. */
    delete_all(b, "b", made_b);
    delete_all(a, "a", made_a); /* and a's, for its share */
    assert_int_equal(hist(a, "grow", 1024, 1, 2, why, sizeof why), TALLY_OK);
    assert_int_equal(hist(a, "again", 1024, 1, 0, why, sizeof why), TALLY_OK);
    assert_true(th_stat(a, "tallyd_state_bytes") < bytes);
    th_close(b);
    assert_int_equal(th_close_and_stop(a, &d, 5000), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_budget_end_to_end),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
