/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_http_edges.c — the HTTP port (daemon/service/td_http.c, daemon/net/td_http_guard.c) where
 * test_http.c does not go, against a real tallyd:
 *   - a dual-stack listener ([metrics] listen = [::]:PORT) takes IPv4 and IPv6 clients, and the
 *     per-address bound counts each IPv4 client (an IPv4-mapped address) and the IPv6 one apart:
 *     with two connections each open from 127.0.0.1, 127.0.0.2 and ::1 and a bound of two, a
 *     probe from one of them closes that address's oldest idle connection and no other (issue
 *     37's fourth survivor: IPv4 clients sharing one budget). Skipped, with a message, where
 *     the box has no IPv6 loopback. (A metrics port that cannot be bound: test_start_failures.c.)
 * Loopback addresses 127.0.0.2 and up are all local on Linux, so the test plays several peers.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"

/* A connection that sent a request line and no end of headers: idle in the guard's eyes (it
 * waits for a request), so it may be closed to make room. */
#define SLOW_LINE "GET /healthz HTTP/1.1\r\nHost: x\r\n"

static char dir[64];

static int make_dir(void **state)
{
    (void)state;
    return th_tmpdir(dir, sizeof dir, "tally-http-edges");
}

static int remove_dir(void **state)
{
    (void)state;
    return th_rmrf(dir);
}

/* True when this box can bind and reach [::1] (an IPv6 loopback). */
static bool have_ipv6_loopback(void)
{
    int fd = socket(AF_INET6, SOCK_STREAM, 0);
    if (fd < 0)
        return false;
    struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    bool ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
    close(fd);
    return ok;
}

static int slow_open(const char *src, int port)
{
    int fd = th_tcp_connect_from(src, port);
    assert_true(fd >= 0);
    assert_int_equal(send(fd, SLOW_LINE, strlen(SLOW_LINE), MSG_NOSIGNAL),
                     (ssize_t)strlen(SLOW_LINE));
    return fd;
}

/* True once the server has closed fd (end of stream or an error), waiting at most wait_ms. */
static bool closed_within(int fd, int wait_ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
    char junk[256];
    if (poll(&p, 1, wait_ms) != 1)
        return false;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) || read(fd, junk, sizeof junk) <= 0;
}

/* GET /healthz from src: the status code (0 when no whole response came within 5 s). */
static int probe(int port, const char *src)
{
    char *resp = th_http_exchange(port, src, "GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n", 5000);
    int code = resp && strncmp(resp, "HTTP/1.", 7) == 0 ? atoi(resp + 9) : 0;
    free(resp);
    return code;
}

enum { A1, A2, B1, B2, C1, C2, CONNS };
static const char *const conn_src[CONNS] = {"127.0.0.1", "127.0.0.1", "127.0.0.2",
                                            "127.0.0.2", "::1",       "::1"};

/* The connections of `open` (a bit per index) are still open, the others closed; the closed
 * ones are waited for (a close is the guard's, on its own thread). */
static void expect_open(const int *fd, unsigned open)
{
    for (int i = 0; i < CONNS; i++) {
        bool closed = closed_within(fd[i], (open >> i) & 1 ? 0 : 5000);
        if (closed == ((open >> i) & 1))
            fail_msg("connection %d from %s is %s", i, conn_src[i], closed ? "closed" : "open");
    }
}

static void test_dual_stack_counts_each_address(void **state)
{
    (void)state;
    if (!have_ipv6_loopback()) {
        print_message("no IPv6 loopback ([::1] cannot be bound): dual-stack test skipped\n");
        skip();
    }
    char auth[128];
    snprintf(auth, sizeof auth, "%s/metrics.auth", dir);
    assert_int_equal(th_write_file(dir, "metrics.auth", "u:secret-password\n", 18), 0);
    assert_int_equal(chmod(auth, 0600), 0);
    const char *args[] = {"--metrics",
                          "[::]:0",
                          "--metrics-auth-file",
                          auth,
                          "--metrics-max-connections-per-address",
                          "2",
                          "--metrics-request-timeout-ms",
                          "60000",
                          NULL};
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, args), 0);
    int port = th_metrics_port(&d);
    assert_true(port > 0);
    assert_true(th_daemon_log_contains(&d, "metrics: serving http://[::]:"));
    int fd[CONNS];
    for (int i = 0; i < CONNS; i++)
        fd[i] = slow_open(conn_src[i], port);
    /* Answered after every connection above was accepted (one listening socket: in order). */
    assert_int_equal(probe(port, "127.0.0.3"), 200);
    expect_open(fd, 0x3f); /* two each: all within the bound */

    assert_int_equal(probe(port, "127.0.0.2"), 200); /* 127.0.0.2's oldest makes room */
    expect_open(fd, 0x3f & ~(1u << B1));
    assert_int_equal(probe(port, "::1"), 200); /* and ::1's */
    expect_open(fd, 0x3f & ~(1u << B1) & ~(1u << C1));
    assert_int_equal(probe(port, "127.0.0.1"), 200);
    expect_open(fd, (1u << A2) | (1u << B2) | (1u << C2));
    for (int i = 0; i < CONNS; i++)
        close(fd[i]);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dual_stack_counts_each_address),
    };
    return cmocka_run_group_tests(tests, make_dir, remove_dir);
}
