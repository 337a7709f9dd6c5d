/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_http.c — the metrics/health port under slow and many connections (issue 21, item 5;
 * td_http_guard.c), against a real tallyd:
 *
 *   - slow connections (a header byte every 200 ms, never finishing) are closed at the request
 *     deadline, not before and not much after;
 *   - with 200 slow connections open (8 from each of 25 loopback addresses), every GET /healthz
 *     answers within a generous 1 s (the 100 ms figure is measured by bench/http_slowloris and
 *     written in bench/RESULTS.md), and /metrics answers too;
 *   - connections from one address beyond max_connections_per_address, and from all beyond
 *     max_connections, close the oldest idle one, so a probe gets in even from the slow
 *     connections' own address, and other addresses' connections are untouched;
 *   - when every connection is inside a request (a body sent slowly) a new one is refused, and
 *     the busy ones are closed at their deadline too.
 *
 * Loopback addresses 127.0.0.2 and up are all local on Linux, so the test plays many peers.
 */
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
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"

#define SLOW_LINE "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"
/* A probe's bound: generous for a loaded 2-core CI box under AddressSanitizer. */
#define PROBE_MS 1000

typedef struct {
    int fd;
    int64_t opened_ms;
    int64_t closed_ms; /* 0 while open */
} slow_t;

/* A connection from src that sends text (by default SLOW_LINE: the request line and Host, and
 * no end of headers). */
static void slow_open_with(slow_t *s, const char *src, int port, const char *text)
{
    s->fd = th_tcp_connect_from(src, port);
    assert_true(s->fd >= 0);
    s->opened_ms = th_now_ms();
    s->closed_ms = 0;
    assert_int_equal(send(s->fd, text, strlen(text), MSG_NOSIGNAL), (ssize_t)strlen(text));
}

static void slow_open(slow_t *s, const char *src, int port)
{
    slow_open_with(s, src, port, SLOW_LINE);
}

/* Notes whether the server has closed s (end of stream or an error); true when it has. */
static bool slow_closed(slow_t *s)
{
    if (s->closed_ms)
        return true;
    struct pollfd p = {.fd = s->fd, .events = POLLIN | POLLRDHUP};
    char junk[256];
    if (poll(&p, 1, 0) == 1 &&
        ((p.revents & (POLLRDHUP | POLLHUP | POLLERR)) || read(s->fd, junk, sizeof junk) <= 0))
        s->closed_ms = th_now_ms();
    return s->closed_ms != 0;
}

/* One more header byte on every open one. */
static void slow_trickle(slow_t *s, int n)
{
    for (int i = 0; i < n; i++)
        if (!slow_closed(&s[i]) && send(s[i].fd, "x", 1, MSG_NOSIGNAL) != 1)
            s[i].closed_ms = th_now_ms();
}

static int count_closed(slow_t *s, int n)
{
    int closed = 0;
    for (int i = 0; i < n; i++)
        closed += slow_closed(&s[i]);
    return closed;
}

static void slow_close_all(slow_t *s, int n)
{
    for (int i = 0; i < n; i++)
        close(s[i].fd);
}

/* GET path from src within PROBE_MS: the status code (0 when no whole response came); *took_ms
 * the time it took. */
static int probe(int port, const char *src, const char *path, double *took_ms)
{
    char req[256];
    snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", path);
    int64_t start = th_now_ms();
    char *resp = th_http_exchange(port, src, req, PROBE_MS);
    if (took_ms)
        *took_ms = (double)(th_now_ms() - start);
    int code = 0;
    if (resp && strncmp(resp, "HTTP/1.", 7) == 0)
        code = atoi(resp + 9);
    free(resp);
    return code;
}

static void start(th_daemon_t *d, int *port, const char *const *extra)
{
    const char *base[] = {"--metrics", "127.0.0.1:0", NULL};
    assert_int_equal(th_daemon_start_with(d, base, extra), 0);
    *port = th_metrics_port(d);
    assert_true(*port > 0);
}

/* Slow connections die at the deadline (1 s here), whatever they trickle. */
static void test_deadline_closes_slow_connections(void **state)
{
    (void)state;
    th_daemon_t d;
    int port;
    start(&d, &port, (const char *[]){"--metrics-request-timeout-ms", "1000", NULL});
    slow_t s[5];
    for (int i = 0; i < 5; i++)
        slow_open(&s[i], "127.0.0.2", port);
    int64_t t0 = th_now_ms();
    while (count_closed(s, 5) < 5 && th_now_ms() - t0 < 4000) {
        slow_trickle(s, 5);
        th_sleep_ms(50);
    }
    for (int i = 0; i < 5; i++) {
        assert_true(s[i].closed_ms != 0);
        int64_t age = s[i].closed_ms - s[i].opened_ms;
        if (age < 950 || age > 3000)
            fail_msg("slow connection %d closed at %lld ms, not at the 1000 ms deadline", i,
                     (long long)age);
    }
    slow_close_all(s, 5);
    assert_int_equal(probe(port, NULL, "/healthz", NULL), 200);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* 200 slow connections open, and /healthz and /metrics still answer each probe. */
static void test_healthz_answers_under_slowloris(void **state)
{
    (void)state;
    th_daemon_t d;
    int port;
    start(&d, &port, (const char *[]){"--metrics-request-timeout-ms", "60000", NULL});
    enum { N = 200, PER_ADDRESS = 8 };
    static slow_t s[N];
    for (int i = 0; i < N; i++) {
        char src[32];
        snprintf(src, sizeof src, "127.0.0.%d", 2 + i / PER_ADDRESS);
        slow_open(&s[i], src, port);
    }
    double worst = 0;
    for (int i = 0; i < 20; i++) {
        double took;
        int code = probe(port, NULL, i % 5 ? "/healthz" : "/metrics", &took);
        if (code != 200)
            fail_msg("probe %d with %d slow connections open: status %d after %.0f ms", i, N, code,
                     took);
        worst = took > worst ? took : worst;
        slow_trickle(s, N);
    }
    print_message("20 probes with %d slow connections open: the slowest took %.1f ms\n", N, worst);
    /* All under the bounds (16 per address, 256 in all): none was closed to make room. */
    assert_int_equal(count_closed(s, N), 0);
    slow_close_all(s, N);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* Over the per-address bound, the oldest idle connection of that address makes room: a probe
 * from the slow connections' own address gets in; another address's are untouched. */
static void test_address_bound_closes_oldest_idle(void **state)
{
    (void)state;
    th_daemon_t d;
    int port;
    start(&d, &port,
          (const char *[]){"--metrics-request-timeout-ms", "60000",
                           "--metrics-max-connections-per-address", "4", NULL});
    slow_t mine[4], other[4];
    for (int i = 0; i < 4; i++) {
        slow_open(&mine[i], "127.0.0.1", port);
        slow_open(&other[i], "127.0.0.3", port);
    }
    th_sleep_ms(100); /* all four accepted before the probe */
    assert_int_equal(probe(port, "127.0.0.1", "/healthz", NULL), 200);
    int64_t t0 = th_now_ms();
    while (!slow_closed(&mine[0]) && th_now_ms() - t0 < 2000)
        th_sleep_ms(10);
    assert_true(slow_closed(&mine[0])); /* the oldest went */
    for (int i = 1; i < 4; i++)
        assert_false(slow_closed(&mine[i]));
    assert_int_equal(count_closed(other, 4), 0);
    slow_close_all(mine, 4);
    slow_close_all(other, 4);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* Over the total bound, the oldest idle connection of any address makes room. */
static void test_total_bound_closes_oldest_idle(void **state)
{
    (void)state;
    th_daemon_t d;
    int port;
    start(&d, &port,
          (const char *[]){"--metrics-request-timeout-ms", "60000", "--metrics-max-connections",
                           "8", NULL});
    slow_t s[8];
    for (int i = 0; i < 8; i++) {
        char src[32];
        snprintf(src, sizeof src, "127.0.0.%d", 2 + i);
        slow_open(&s[i], src, port);
        th_sleep_ms(5); /* accepted in this order */
    }
    th_sleep_ms(100);
    assert_int_equal(probe(port, NULL, "/healthz", NULL), 200);
    int64_t t0 = th_now_ms();
    while (!slow_closed(&s[0]) && th_now_ms() - t0 < 2000)
        th_sleep_ms(10);
    assert_true(slow_closed(&s[0]));
    for (int i = 1; i < 8; i++)
        assert_false(slow_closed(&s[i]));
    slow_close_all(s, 8);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* A connection inside a request (its headers in, its body still coming) is not closed to make
 * room: a new one is refused instead, until the busy ones reach their deadline. */
static void test_busy_connections_refuse_then_expire(void **state)
{
    (void)state;
    th_daemon_t d;
    int port;
    start(&d, &port,
          (const char *[]){"--metrics-request-timeout-ms", "1500", "--metrics-max-connections", "2",
                           NULL});
    /* With Expect: 100-continue, tallyd's "100 Continue" says that the request's headers were
     * handled: the connection is inside its request. */
    static const char post[] = "POST /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                               "Content-Length: 1000\r\nExpect: 100-continue\r\n\r\n";
    slow_t busy[2];
    for (int i = 0; i < 2; i++) {
        slow_open_with(&busy[i], i ? "127.0.0.3" : "127.0.0.2", port, post);
        char reply[64] = "";
        struct pollfd p = {.fd = busy[i].fd, .events = POLLIN};
        assert_int_equal(poll(&p, 1, 5000), 1);
        assert_true(read(busy[i].fd, reply, sizeof reply - 1) > 0);
        assert_non_null(strstr(reply, " 100 "));
    }
    assert_int_equal(probe(port, NULL, "/healthz", NULL), 0); /* refused */
    assert_int_equal(count_closed(busy, 2), 0);
    int64_t t0 = th_now_ms();
    while (count_closed(busy, 2) < 2 && th_now_ms() - t0 < 4000) {
        slow_trickle(busy, 2);
        th_sleep_ms(50);
    }
    for (int i = 0; i < 2; i++) {
        assert_true(slow_closed(&busy[i]));
        int64_t age = busy[i].closed_ms - busy[i].opened_ms;
        if (age < 1400 || age > 4000)
            fail_msg("busy connection %d closed at %lld ms, not at the 1500 ms deadline", i,
                     (long long)age);
    }
    slow_close_all(busy, 2);
    assert_int_equal(probe(port, NULL, "/healthz", NULL), 200);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_deadline_closes_slow_connections),
        cmocka_unit_test(test_healthz_answers_under_slowloris),
        cmocka_unit_test(test_address_bound_closes_oldest_idle),
        cmocka_unit_test(test_total_bound_closes_oldest_idle),
        cmocka_unit_test(test_busy_connections_refuse_then_expire),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
