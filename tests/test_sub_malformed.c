/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_sub_malformed.c — libtally's subscriber (client/tally_sub.c) against a publisher that
 * sends what tallyd never would (PROTOCOL.md §11: three frames, a stream name, a 64-byte header,
 * the record or, for a deletion, nothing): two frames, four, a name with a space, a short header,
 * a deletion with a record, an update whose record does not decode. Each is one TALLY_E_REPLY,
 * consumed whole, and the good publication after it is received as sent.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <zmq.h>

#include <cmocka.h>

#include "tally.h"
#include "harness.h"

static void *ctx, *pub;
static tally_sub_t *sub;

/* One message of `n` frames. */
static void send_frames(int n, const void *const *data, const size_t *len)
{
    for (int i = 0; i < n; i++)
        assert_true(zmq_send(pub, data[i], len[i], i + 1 < n ? ZMQ_SNDMORE : 0) >= 0);
}

static void header(uint8_t kind, uint64_t seq, uint8_t out[TALLY_PUB_HEADER_SIZE])
{
    tally_pub_t p = {.kind = kind, .pub_seq = seq, .time_ms = 1, .interval_ms = 1000};
    tally_pub_encode(&p, out);
}

/* A well-formed deletion of `name`, numbered seq. */
static void send_deleted(const char *name, uint64_t seq)
{
    uint8_t h[TALLY_PUB_HEADER_SIZE];
    header(TALLY_PUB_DELETED, seq, h);
    const void *d[] = {name, h, ""};
    size_t l[] = {strlen(name), sizeof h, 0};
    send_frames(3, d, l);
}

static int setup(void **state)
{
    (void)state;
    ctx = zmq_ctx_new();
    pub = zmq_socket(ctx, ZMQ_PUB);
    /* Port 0 ("*"): the kernel picks a free one as it binds, so no other process can take it
     * between a choice and the bind. */
    char endpoint[64];
    size_t cap = sizeof endpoint;
    if (zmq_bind(pub, "tcp://127.0.0.1:*") != 0 ||
        zmq_getsockopt(pub, ZMQ_LAST_ENDPOINT, endpoint, &cap) != 0 ||
        tally_sub_new(endpoint, &sub) != TALLY_OK || tally_sub_subscribe(sub, "") != TALLY_OK)
        return -1;
    /* A subscription reaches the publisher some time after the connect: publish until one
     * arrives. */
    tally_pub_msg_t m;
    for (uint64_t seq = 1; seq < 400; seq++) {
        send_deleted("sync", seq);
        if (tally_sub_recv(sub, 50, &m) == TALLY_OK)
            break;
    }
    while (tally_sub_recv(sub, 100, &m) == TALLY_OK) /* what else of the sync arrived */
        ;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tally_sub_destroy(&sub);
    zmq_close(pub);
    zmq_ctx_term(ctx);
    return 0;
}

/* Sends the malformed message, then a good deletion of "after": one TALLY_E_REPLY, then it. */
static void refused_then_next(const char *what, int n, const void *const *d, const size_t *l)
{
    send_frames(n, d, l);
    send_deleted("after", 7);
    tally_pub_msg_t m;
    tally_status_t st = tally_sub_recv(sub, 5000, &m);
    if (st != TALLY_E_REPLY)
        fail_msg("%s: %s, not reply", what, tally_status_name(st));
    assert_int_equal(tally_sub_recv(sub, 5000, &m), TALLY_OK);
    assert_string_equal(m.stream, "after");
    assert_int_equal(m.pub.kind, TALLY_PUB_DELETED);
    assert_int_equal(m.pub.pub_seq, 7);
}

static void test_malformed_publications(void **state)
{
    (void)state;
    uint8_t del[TALLY_PUB_HEADER_SIZE], upd[TALLY_PUB_HEADER_SIZE];
    header(TALLY_PUB_DELETED, 3, del);
    header(TALLY_PUB_UPDATE, 3, upd);
    {
        const void *d[] = {"s", del};
        size_t l[] = {1, sizeof del};
        refused_then_next("two frames", 2, d, l);
    }
    {
        const void *d[] = {"s", del, "", "extra"};
        size_t l[] = {1, sizeof del, 0, 5};
        refused_then_next("four frames", 4, d, l);
    }
    {
        const void *d[] = {"a b", del, ""};
        size_t l[] = {3, sizeof del, 0};
        refused_then_next("a name with a space", 3, d, l);
    }
    {
        const void *d[] = {"s", del, ""};
        size_t l[] = {1, 10, 0};
        refused_then_next("a short header", 3, d, l);
    }
    {
        const void *d[] = {"s", del, "x"};
        size_t l[] = {1, sizeof del, 1};
        refused_then_next("a deletion with a record", 3, d, l);
    }
    {
        const void *d[] = {"s", upd, "abc"};
        size_t l[] = {1, sizeof upd, 3};
        refused_then_next("an update whose record does not decode", 3, d, l);
    }
    tally_pub_msg_t m;
    assert_int_equal(tally_sub_recv(sub, 0, &m), TALLY_E_TIMEOUT); /* nothing left over */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_malformed_publications),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
