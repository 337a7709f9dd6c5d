/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_sub.c — libtally's subscriptions (tally_sub_*) against a tallyd started with --pub.
 *
 * A subscriber to the prefix "cam" gets the records of "cam0" and "cam01" and nothing of
 * "other"; the last record published for a stream equals what `query` answers once the pushes
 * stop; publication numbers only grow; a deleted stream is announced with an empty record; the
 * fd from tally_sub_fd wakes poll() and is drained with timeout-0 receives. Subscriptions join
 * late (ZeroMQ connects asynchronously), so the first records are awaited while pushing, with
 * generous deadlines.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "tally.h"
#include "tally_proto.h"

#define DEADLINE_MS 60000

static th_daemon_t daemon_;
static char dir[64], pub[128];
static tally_client_t *client;

static int setup(void **state)
{
    (void)state;
    if (th_tmpdir(dir, sizeof dir, "tally-sub") != 0)
        return -1;
    snprintf(pub, sizeof pub, "ipc://%s/pub", dir);
    const char *args[] = {"--pub", pub, "--pub-interval-ms", "100", NULL};
    if (th_daemon_start(&daemon_, args) != 0)
        return -1;
    return tally_client_new(daemon_.endpoint, 20000, &client) == TALLY_OK ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    tally_client_destroy(&client);
    return th_daemon_teardown(&daemon_, 20000, dir);
}

static void push_to(tally_client_t *c, const char *stream, uint8_t value, size_t n)
{
    uint8_t *data = malloc(n);
    assert_non_null(data);
    memset(data, value, n);
    tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    tally_reply_t reply;
    tally_reply_init(&reply);
    assert_int_equal(tally_call(c, &req, data, n, &reply), TALLY_OK);
    tally_reply_clear(&reply);
    free(data);
}

static void push(const char *stream, uint8_t value, size_t n)
{
    push_to(client, stream, value, n);
}

/* A subscription to `prefix` at endpoint, and *msg to receive into (the caller frees both). */
static tally_sub_t *subscribed(const char *endpoint, const char *prefix, tally_pub_msg_t **msg)
{
    tally_sub_t *sub = NULL;
    assert_int_equal(tally_sub_new(endpoint, &sub), TALLY_OK);
    assert_int_equal(tally_sub_subscribe(sub, prefix), TALLY_OK);
    *msg = malloc(sizeof **msg);
    assert_non_null(*msg);
    return sub;
}

static void test_sub_prefix_records(void **state)
{
    (void)state;
    tally_pub_msg_t *msg;
    tally_sub_t *sub = subscribed(pub, "cam", &msg);
    /* Push until the subscription has joined and cam0's first record arrives. */
    int64_t deadline = th_now_ms() + DEADLINE_MS;
    bool joined = false;
    while (!joined) {
        push("cam0", 7, 100);
        push("other", 1, 10);
        tally_status_t st = tally_sub_recv(sub, 200, msg);
        joined = st == TALLY_OK && !strcmp(msg->stream, "cam0");
        assert_true(st == TALLY_OK || st == TALLY_E_TIMEOUT);
        if (th_now_ms() > deadline)
            fail_msg("no publication of cam0 within %d ms", DEADLINE_MS);
    }
    /* Now a fixed amount more on each; then the records settle. */
    push("cam0", 9, 1000);
    push("cam01", 3, 5);
    push("other", 1, 10);
    tally_stream_info_t cam0, cam01;
    assert_int_equal(tally_query(client, "cam0", &cam0), TALLY_OK);
    assert_int_equal(tally_query(client, "cam01", &cam01), TALLY_OK);
    bool cam0_seen = false, cam01_seen = false;
    uint64_t last_seq = msg->pub.pub_seq;
    deadline = th_now_ms() + DEADLINE_MS;
    while (!(cam0_seen && cam01_seen)) {
        tally_status_t st = tally_sub_recv(sub, 500, msg);
        if (th_now_ms() > deadline)
            fail_msg("the settled records never came (cam0 %d, cam01 %d)", cam0_seen, cam01_seen);
        if (st == TALLY_E_TIMEOUT)
            continue;
        assert_int_equal(st, TALLY_OK);
        assert_true(msg->pub.pub_seq > last_seq);
        last_seq = msg->pub.pub_seq;
        assert_int_equal(msg->pub.kind, TALLY_PUB_UPDATE);
        assert_int_equal(msg->pub.interval_ms, 100);
        assert_true(msg->pub.time_ms > 0);
        assert_int_not_equal(strcmp(msg->stream, "other"), 0); /* not subscribed */
        const tally_stream_info_t *want = !strcmp(msg->stream, "cam0") ? &cam0 : &cam01;
        if (msg->info.hist_total != want->hist_total)
            continue; /* an older record, published before the last pushes */
        assert_memory_equal(msg->info.bins, want->bins, 256 * sizeof want->bins[0]);
        assert_int_equal(msg->info.batches, want->batches);
        cam0_seen |= want == &cam0;
        cam01_seen |= want == &cam01;
    }
    assert_int_equal(cam0.bins[9], 1000);
    free(msg);
    tally_sub_destroy(&sub);
    assert_null(sub);
}

static void test_sub_deleted_and_fd(void **state)
{
    (void)state;
    tally_pub_msg_t *msg;
    tally_sub_t *sub = subscribed(pub, "gone", &msg);
    int fd = tally_sub_fd(sub);
    assert_true(fd >= 0);
    /* Join first (records of "gone" arrive), through the fd: poll, then drain. */
    int64_t deadline = th_now_ms() + DEADLINE_MS;
    bool got = false;
    while (!got) {
        push("gone", 1, 10);
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 200) < 0)
            fail_msg("poll failed");
        tally_status_t st;
        while ((st = tally_sub_recv(sub, 0, msg)) == TALLY_OK)
            got |= !strcmp(msg->stream, "gone") && msg->pub.kind == TALLY_PUB_UPDATE;
        assert_int_equal(st, TALLY_E_TIMEOUT); /* drained: nothing left */
        if (th_now_ms() > deadline)
            fail_msg("no publication of 'gone' within %d ms", DEADLINE_MS);
    }
    /* Two deletions back to back (most often within one interval): each announced once, in
     * the order they were made ("gone2" is under the "gone" prefix subscribed to). */
    push("gone2", 2, 10);
    assert_int_equal(tally_delete(client, "gone"), TALLY_OK);
    assert_int_equal(tally_delete(client, "gone2"), TALLY_OK);
    const char *const deleted[] = {"gone", "gone2"};
    deadline = th_now_ms() + DEADLINE_MS;
    for (int seen = 0; seen < 2;) {
        tally_status_t st = tally_sub_recv(sub, 500, msg);
        if (st == TALLY_OK && msg->pub.kind == TALLY_PUB_DELETED)
            assert_string_equal(msg->stream, deleted[seen++]);
        assert_true(st == TALLY_OK || st == TALLY_E_TIMEOUT);
        if (th_now_ms() > deadline)
            fail_msg("%d of 2 'deleted' publications within %d ms", seen, DEADLINE_MS);
    }
    free(msg);
    tally_sub_destroy(&sub);
}

/* Pipelined queries (what `tally watch` sends): each reply's record decodes to what tally_query
 * answers; a reply that is not a query's record is refused. */
static void test_reply_stream_info(void **state)
{
    (void)state;
    push("piped/a", 3, 30);
    push("piped/b", 4, 40);
    const char *names[] = {"piped/a", "piped/b", "piped/none"};
    uint64_t ids[3];
    for (int i = 0; i < 3; i++) {
        tally_req_t req = {.opcode = TALLY_OP_QUERY};
        assert_int_equal(tally_req_set_stream(&req, names[i]), TALLY_OK);
        assert_int_equal(tally_send(client, &req, NULL, 0, &ids[i]), TALLY_OK);
    }
    /* All three replies first: a tally_call meanwhile would discard the others. */
    tally_reply_t reply;
    tally_reply_init(&reply);
    tally_stream_info_t piped[2];
    for (int got = 0; got < 3; got++) {
        tally_status_t st = tally_recv(client, &reply);
        if (st == TALLY_E_TIMEOUT || st == TALLY_E_TRANSPORT || st == TALLY_E_REPLY)
            fail_msg("reply %d: %s (%s)", got, tally_status_name(st), reply.error);
        int i = reply.rep.request_id == ids[0] ? 0 : reply.rep.request_id == ids[1] ? 1 : 2;
        assert_int_equal(reply.rep.request_id, ids[i]);
        if (i == 2) {
            tally_stream_info_t none;
            assert_int_equal(st, TALLY_E_UNKNOWN_STREAM);
            assert_int_equal(tally_reply_stream_info(&reply, &none), TALLY_E_REPLY);
            continue;
        }
        assert_int_equal(st, TALLY_OK);
        assert_int_equal(tally_reply_stream_info(&reply, &piped[i]), TALLY_OK);
    }
    tally_reply_clear(&reply);
    for (int i = 0; i < 2; i++) {
        tally_stream_info_t direct;
        assert_int_equal(tally_query(client, names[i], &direct), TALLY_OK);
        assert_int_equal(piped[i].bins[3 + i], 30 + 10 * (uint64_t)i);
        assert_memory_equal(piped[i].bins, direct.bins, 256 * sizeof direct.bins[0]);
        assert_int_equal(piped[i].batches, direct.batches);
    }
    tally_req_t ping = {.opcode = TALLY_OP_PING};
    tally_stream_info_t info;
    assert_int_equal(tally_call(client, &ping, NULL, 0, &reply), TALLY_OK);
    assert_int_equal(tally_reply_stream_info(&reply, &info), TALLY_E_REPLY); /* not a query */
    tally_reply_clear(&reply);
}

static void test_sub_arguments(void **state)
{
    (void)state;
    tally_sub_t *sub = NULL;
    assert_int_equal(tally_sub_new("nonsense", &sub), TALLY_E_ARG);
    assert_null(sub);
    assert_int_equal(tally_sub_new(NULL, &sub), TALLY_E_ARG);
    assert_int_equal(tally_sub_new(pub, &sub), TALLY_OK);
    char long_prefix[TALLY_STREAM_NAME_MAX + 2];
    memset(long_prefix, 'x', sizeof long_prefix - 1);
    long_prefix[sizeof long_prefix - 1] = '\0';
    assert_int_equal(tally_sub_subscribe(sub, long_prefix), TALLY_E_ARG);
    tally_pub_msg_t msg;
    assert_int_equal(tally_sub_recv(sub, 0, &msg), TALLY_E_TIMEOUT); /* nothing subscribed */
    assert_int_equal(tally_sub_recv(sub, 0, NULL), TALLY_E_ARG);
    tally_sub_destroy(&sub);
    tally_sub_destroy(&sub); /* a second destroy of NULL is harmless */
}

/* At four shards a deletion reaches the subscribers from the deleting stream's shard through the
 * request path's front (td_path.c shard_deleted): eight streams, spread over the shards, deleted
 * one after the other, each announced exactly once. */
static void test_sub_deleted_at_shards(void **state)
{
    (void)state;
    enum { N = 8 };
    char pub4[160];
    snprintf(pub4, sizeof pub4, "ipc://%s/pub4", dir);
    const char *args[] = {"--pub", pub4, "--pub-interval-ms", "100", "--shards", "4", NULL};
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, args), 0);
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(d.endpoint, 20000, &c), TALLY_OK);
    tally_pub_msg_t *msg;
    tally_sub_t *sub = subscribed(pub4, "del", &msg);
    int64_t deadline = th_now_ms() + DEADLINE_MS;
    for (bool joined = false; !joined;) { /* the subscription joins late */
        push_to(c, "del0", 1, 10);
        joined = tally_sub_recv(sub, 200, msg) == TALLY_OK;
        if (th_now_ms() > deadline)
            fail_msg("no publication of 'del0' within %d ms", DEADLINE_MS);
    }
    char names[N][8];
    unsigned shards = 0;
    for (unsigned i = 0; i < N; i++) {
        snprintf(names[i], sizeof names[i], "del%u", i);
        shards |= 1u << tally_partition(names[i], strlen(names[i]), 4);
        push_to(c, names[i], (uint8_t)i, 10);
    }
    assert_true(shards != 1 && shards != 2 && shards != 4 && shards != 8); /* several shards */
    for (unsigned i = 0; i < N; i++)
        assert_int_equal(tally_delete(c, names[i]), TALLY_OK);
    unsigned seen[N] = {0}, total = 0;
    while (total < N) {
        tally_status_t st = tally_sub_recv(sub, 500, msg);
        assert_true(st == TALLY_OK || st == TALLY_E_TIMEOUT);
        if (st == TALLY_OK && msg->pub.kind == TALLY_PUB_DELETED) {
            unsigned i = (unsigned)atoi(msg->stream + 3);
            assert_true(i < N);
            assert_string_equal(msg->stream, names[i]);
            seen[i]++;
            total++;
        }
        if (th_now_ms() > deadline)
            fail_msg("%u of %d 'deleted' publications within %d ms", total, N, DEADLINE_MS);
    }
    for (unsigned i = 0; i < N; i++)
        assert_int_equal(seen[i], 1);
    assert_false(tally_sub_recv(sub, 300, msg) == TALLY_OK &&
                 msg->pub.kind == TALLY_PUB_DELETED); /* none twice */
    free(msg);
    tally_sub_destroy(&sub);
    tally_client_destroy(&c);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sub_prefix_records),
        cmocka_unit_test(test_sub_deleted_and_fd),
        cmocka_unit_test(test_sub_deleted_at_shards),
        cmocka_unit_test(test_reply_stream_info),
        cmocka_unit_test(test_sub_arguments),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
