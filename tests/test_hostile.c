/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_hostile.c — issue 21 over the wire, against a real tallyd:
 *   - a peer that pipelines scans and never reads its replies: the reply bytes tallyd holds for
 *     it never pass max_reply_bytes_per_peer (tallyd_reply_bytes_peak), the requests beyond it
 *     are answered `busy` (counted as tallyd_limited_total{reason="reply_bytes_peer"}, and the
 *     replies arrive once it reads), and another client is served meanwhile;
 *   - a client that pipelines valid requests and then one frame over max_frame: ZeroMQ closes
 *     its connection, and once its DEALER reconnects with the same routing id every earlier
 *     request is answered; the loss is counted and logged;
 *   - info reports every per-peer limit, with the values in force;
 *   - tcp://[::1]:PORT binds, and libtally and the CLI connect to it (skipped without an IPv6
 *     loopback).
 * No timing is asserted: waits are bounded loops on what tallyd reports.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include <cmocka.h>

#include "harness.h"

#define MIB (1u << 20)

static th_daemon_t daemon_;

static int stop_daemon(void **state)
{
    (void)state;
    th_daemon_kill(&daemon_);
    return 0;
}

#define NONREADER_SCANS 64

/* A never-reading peer (receive high-water mark 1, a small kernel buffer, so replies stay in
 * tallyd) pipelines 64 scans of 1 MiB, each with a 2 MiB reply, against a bound of 8 MiB per
 * connection: most are answered busy, the bytes held stay within the bound, another client is
 * served, and every reply arrives once the peer reads. */
static void test_reply_bytes_bounded(void **state)
{
    (void)state;
    const char *args[] = {
        "--max-batch", "1M", "--max-reply-bytes-per-peer", "8M", "--max-reply-bytes", "64M", NULL};
    void *other;
    long long n_ok, n_busy;
    void *peer =
        th_nonreader_started(&daemon_, args, NONREADER_SCANS, 1000, &other, &n_ok, &n_busy);
    assert_non_null(peer);
    assert_int_equal(n_ok + n_busy, NONREADER_SCANS);
    fprintf(stderr, "%lld scans ok, %lld busy\n", n_ok, n_busy);
    assert_true(n_ok >= 1 && n_busy >= 1);
    assert_int_equal(th_stat(other, "tallyd_limited_total{reason=\"reply_bytes_peer\"}"), n_busy);
    assert_true(th_stat(other, "tallyd_reply_bytes_peak{scope=\"peer\"}") <= 8 * MIB);
    assert_true(th_stat(other, "tallyd_reply_bytes{state=\"held\"}") <= 8 * MIB);
    assert_int_equal(th_stat(other, "tallyd_reply_bytes_limit{scope=\"peer\"}"), 8 * MIB);
    /* Another client is served while the peer holds its bound. */
    uint8_t bytes[4096] = {1, 2, 3};
    tally_req_t hist = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 7);
    assert_int_equal(th_call_status(other, &hist, bytes, sizeof bytes), TALLY_OK);
    /* The peer reads at last: every reply arrives, ok or busy, each once. */
    bool seen[NONREADER_SCANS] = {false};
    long long got_busy = 0;
    for (int i = 0; i < NONREADER_SCANS; i++) {
        th_reply_t r;
        if (th_recv_reply(peer, &r) != 0)
            fail_msg("%d of the %d replies arrived; tallyd dropped %lld (peer gone) and %lld "
                     "(peer not reading), lost %lld connections (log %s)",
                     i, NONREADER_SCANS,
                     th_stat(other, "tallyd_replies_dropped_total{reason=\"peer_gone\"}"),
                     th_stat(other, "tallyd_replies_dropped_total{reason=\"peer_not_reading\"}"),
                     th_stat(other, "tallyd_connections_lost_total"), daemon_.log_path);
        uint64_t k = r.rep.request_id - 1000;
        assert_true(k < NONREADER_SCANS && !seen[k]);
        seen[k] = true;
        if (r.rep.status == TALLY_E_BUSY) {
            assert_non_null(strstr((const char *)r.payload, "max_reply_bytes_per_peer"));
            got_busy++;
        } else {
            assert_int_equal(r.rep.status, TALLY_OK);
            assert_int_equal(r.len, 2 * MIB);
        }
        th_reply_free(&r);
    }
    assert_int_equal(got_busy, n_busy);
    /* Read and freed by ZeroMQ: nothing is held any more. */
    assert_int_equal(th_stat_wait_at_most(other, "tallyd_reply_bytes{state=\"held\"}", 0, 30000),
                     0);
    th_close(peer);
    assert_int_equal(th_close_and_stop(other, &daemon_, 10000), 0);
    daemon_.pid = 0;
}

#define OVERSIZE_EARLIER 20

/* A client (a fixed routing id, as libtally sets) pipelines 20 valid 256 KiB hists, then a frame
 * over max_frame. ZeroMQ closes the connection on that frame's size; the simulated GPU's 100 ms
 * launches make every earlier reply ready after that, and the client's reconnect interval of
 * 500 ms makes the first ones find the connection closed. Once its DEALER has reconnected, all
 * 20 replies arrive; the oversize frame's request gets none. */
static void test_oversize_frame_keeps_earlier_replies(void **state)
{
    (void)state;
    const char *args[] = {"--max-batch",     "1M", "--max-frame", "2M", "--backend", "cuda",
                          "--test-sim-gpus", "1",  NULL};
    setenv("TALLYD_TEST_SIM_LATENCY_US", "100000", 1);
    int started = th_daemon_start(&daemon_, args);
    unsetenv("TALLYD_TEST_SIM_LATENCY_US");
    assert_int_equal(started, 0);
    void *sock = th_dealer(10000);
    static const char id[] = "\x80oversize-client";
    assert_int_equal(zmq_setsockopt(sock, ZMQ_ROUTING_ID, id, sizeof id - 1), 0);
    int reconnect_ms = 500;
    assert_int_equal(zmq_setsockopt(sock, ZMQ_RECONNECT_IVL, &reconnect_ms, sizeof reconnect_ms),
                     0);
    assert_int_equal(zmq_connect(sock, daemon_.endpoint), 0);
    size_t len = 256 * 1024;
    uint8_t *bytes = malloc(2 * MIB + 1);
    for (size_t i = 0; i < 2 * MIB + 1; i++)
        bytes[i] = (uint8_t)th_rand();
    for (int i = 0; i < OVERSIZE_EARLIER; i++) {
        tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 100 + (uint64_t)i);
        assert_int_equal(th_send_request(sock, &req, bytes, len), 0);
    }
    tally_req_t big = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 999);
    assert_int_equal(th_send_request(sock, &big, bytes, 2 * MIB + 1), 0);
    free(bytes);
    bool seen[OVERSIZE_EARLIER] = {false};
    for (int i = 0; i < OVERSIZE_EARLIER; i++) {
        th_reply_t r;
        if (th_recv_reply(sock, &r) != 0)
            fail_msg("%d of the %d earlier replies arrived", i, OVERSIZE_EARLIER);
        uint64_t k = r.rep.request_id - 100;
        assert_true(k < OVERSIZE_EARLIER && !seen[k]);
        seen[k] = true;
        assert_int_equal(r.rep.status, TALLY_OK);
        th_reply_free(&r);
    }
    void *other = th_connect(daemon_.endpoint, 10000);
    assert_true(th_stat(other, "tallyd_connections_lost_total") >= 1);
    assert_true(th_stat(other, "tallyd_replies_resent_total") >= 1);
    th_close(sock);
    assert_int_equal(th_close_and_stop(other, &daemon_, 20000), 0);
    daemon_.pid = 0;
    assert_true(th_daemon_log_contains(&daemon_, "closed with requests unanswered"));
}

/* The value of `key` in an info text, or NULL (a static buffer). */
static const char *info_value(const char *text, const char *key)
{
    static char value[256];
    size_t klen = strlen(key);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (strncmp(p, key, klen) == 0 && p[klen] == '=') {
            const char *v = p + klen + 1;
            size_t n = strcspn(v, "\n");
            snprintf(value, sizeof value, "%.*s", (int)n, v);
            return value;
        }
    return NULL;
}

static char *info_text(void *sock)
{
    tally_req_t req = th_req(TALLY_OP_INFO, TALLY_DTYPE_NONE, 3);
    th_reply_t r;
    assert_int_equal(th_call_reply_status(sock, &req, NULL, 0, &r), TALLY_OK);
    return (char *)r.payload;
}

/* info reports each per-peer limit a client can meet, after the 15 keys of protocol 1, in
 * PROTOCOL.md §5's order: the settings, and the computed defaults where they are 0. */
static void test_info_reports_limits(void **state)
{
    (void)state;
    static const char *const keys[] = {
        "max_inflight_per_peer", "max_streams_per_client",   "stream_create_rate", "max_frame",
        "max_unread_replies",    "max_reply_bytes_per_peer", "max_reply_bytes"};
    const char *args[] = {"--max-batch", "1M", "--max-streams", "100", NULL};
    assert_int_equal(th_daemon_start(&daemon_, args), 0);
    void *sock = th_connect(daemon_.endpoint, 10000);
    char *text = info_text(sock);
    const char *after = strstr(text, "\ncurve=off\n");
    assert_non_null(after);
    after += strlen("\ncurve=off\n");
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) { /* appended in this order */
        size_t klen = strlen(keys[i]);
        if (strncmp(after, keys[i], klen) != 0 || after[klen] != '=')
            fail_msg("info: expected %s next, got '%.40s'", keys[i], after);
        after = strchr(after, '\n') + 1;
    }
    const char *want[] = {"0", "50", "1000", "4194304", "1024", "16777216", "33554432"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        assert_string_equal(info_value(text, keys[i]), want[i]);
    free(text);
    assert_int_equal(th_close_and_stop(sock, &daemon_, 10000), 0);

    const char *set[] = {"--max-inflight-per-peer",
                         "5",
                         "--max-streams-per-client",
                         "7",
                         "--stream-create-rate",
                         "9",
                         "--max-batch",
                         "1M",
                         "--max-frame",
                         "3M",
                         "--max-reply-bytes-per-peer",
                         "10M",
                         "--max-reply-bytes",
                         "20M",
                         NULL};
    assert_int_equal(th_daemon_start(&daemon_, set), 0);
    sock = th_connect(daemon_.endpoint, 10000);
    text = info_text(sock);
    const char *got[] = {"5", "7", "9", "3145728", "1024", "10485760", "20971520"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        assert_string_equal(info_value(text, keys[i]), got[i]);
    free(text);
    assert_int_equal(th_close_and_stop(sock, &daemon_, 10000), 0);
    daemon_.pid = 0;
}

/* A free TCP port on ::1, or -1 when the host has no IPv6 loopback. */
static int free_port_v6(void)
{
    int fd = socket(AF_INET6, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_addr = in6addr_loopback};
    socklen_t alen = sizeof a;
    int port = -1;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &alen) == 0)
        port = ntohs(a.sin6_port);
    close(fd);
    return port;
}

/* tcp://[::1]:PORT binds (ZMQ_IPV6 on the socket for it) and serves a ping over raw ZeroMQ, and
 * to libtally through the CLI. */
static void test_ipv6_loopback(void **state)
{
    (void)state;
    int port = free_port_v6();
    if (port < 0) {
        fprintf(stderr, "no IPv6 loopback (::1) on this host: skipped\n");
        skip();
    }
    char endpoint[64], bind_arg[64];
    snprintf(endpoint, sizeof endpoint, "tcp://[::1]:%d", port);
    snprintf(bind_arg, sizeof bind_arg, "%s", endpoint);
    const char *args[] = {"--bind", bind_arg, NULL};
    assert_int_equal(th_daemon_start(&daemon_, args), 0);
    void *sock = th_dealer(10000);
    int one = 1;
    zmq_setsockopt(sock, ZMQ_IPV6, &one, sizeof one);
    assert_int_equal(zmq_connect(sock, endpoint), 0);
    tally_req_t ping = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, 6);
    assert_int_equal(th_call_status(sock, &ping, NULL, 0), TALLY_OK);
    th_close(sock);
    th_cli_t cli = th_cli(".", endpoint, "ping");
    assert_int_equal(cli.status, 0);
    assert_non_null(strstr(cli.out, "pong"));
    th_cli_free(&cli);
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 10000), 0);
    daemon_.pid = 0;
    assert_true(th_daemon_log_contains(&daemon_, "listening on tcp://[::1]:"));
}

int main(void)
{
    th_seed();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_reply_bytes_bounded, stop_daemon),
        cmocka_unit_test_teardown(test_oversize_frame_keeps_earlier_replies, stop_daemon),
        cmocka_unit_test_teardown(test_info_reports_limits, stop_daemon),
        cmocka_unit_test_teardown(test_ipv6_loopback, stop_daemon),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
