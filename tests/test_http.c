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
 *     the busy ones are closed at their deadline too;
 *   - event streams count apart from both bounds: with max_sse_clients of them open from one
 *     address (a browser behind a tunnel), or filling max_connections, /healthz and /metrics
 *     still answer (issue 30, item 4);
 *   - DNS rebinding: a request whose Host is not an IP address, localhost, the listen address's
 *     name or one of allowed_hosts is answered 421, on every path but /healthz (issue 30,
 *     item 3); scrapes by IP pass on a wildcard listener;
 *   - a port that cannot be bound is named in the error, not "port 0" (issue 30, item 7).
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
#include <arpa/inet.h>
#include <netinet/in.h>
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

/* Opens two connections, from src[0] and src[1], inside a request: with Expect: 100-continue,
 * tallyd's "100 Continue" says that the request's headers were handled. */
static void open_busy(slow_t busy[2], const char *const src[2], int port)
{
    static const char post[] = "POST /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                               "Content-Length: 1000\r\nExpect: 100-continue\r\n\r\n";
    for (int i = 0; i < 2; i++) {
        slow_open_with(&busy[i], src[i], port, post);
        char reply[64] = "";
        struct pollfd p = {.fd = busy[i].fd, .events = POLLIN};
        assert_int_equal(poll(&p, 1, 5000), 1);
        assert_true(read(busy[i].fd, reply, sizeof reply - 1) > 0);
        assert_non_null(strstr(reply, " 100 "));
    }
}

/* Keeps the two busy requests trickling until tallyd closes both at the 1500 ms deadline, not
 * before (nor much after), then closes our ends. */
static void trickle_to_deadline(slow_t busy[2])
{
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
    slow_t busy[2];
    open_busy(busy, (const char *[]){"127.0.0.2", "127.0.0.3"}, port);
    assert_int_equal(probe(port, NULL, "/healthz", NULL), 0); /* refused */
    trickle_to_deadline(busy);
    assert_int_equal(probe(port, NULL, "/healthz", NULL), 200);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* The per-address bound the same way: with every connection from 127.0.0.2 inside a request, a
 * new one from there is refused (none of its own is idle to close), while another address is
 * served; after the deadline, 127.0.0.2 is served again. */
static void test_busy_address_refused_others_served(void **state)
{
    (void)state;
    th_daemon_t d;
    int port;
    start(&d, &port,
          (const char *[]){"--metrics-request-timeout-ms", "1500",
                           "--metrics-max-connections-per-address", "2", NULL});
    slow_t busy[2];
    open_busy(busy, (const char *[]){"127.0.0.2", "127.0.0.2"}, port);
    assert_int_equal(probe(port, "127.0.0.2", "/healthz", NULL), 0); /* refused */
    assert_int_equal(probe(port, "127.0.0.3", "/healthz", NULL), 200);
    trickle_to_deadline(busy);
    assert_int_equal(probe(port, "127.0.0.2", "/healthz", NULL), 200);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* ---- Event streams beside probes (issue 30, item 4) ---------------------------------------- */

/* Sends a GET of path with Host (NULL: an HTTP/1.0 request without one) from src and reads the
 * response's head; returns the socket, with the head's status in *status (0: none came). */
static int open_get(int port, const char *src, const char *path, const char *host, int *status)
{
    int fd = th_tcp_connect_from(src, port);
    assert_true(fd >= 0);
    char req[512];
    if (host)
        snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: %s\r\n\r\n", path, host);
    else
        snprintf(req, sizeof req, "GET %s HTTP/1.0\r\n\r\n", path);
    assert_int_equal(send(fd, req, strlen(req), MSG_NOSIGNAL), (ssize_t)strlen(req));
    char head[8192];
    size_t len = 0;
    int64_t end = th_now_ms() + 20000; /* generous: a loaded box under ASan */
    head[0] = '\0';
    while (!strstr(head, "\r\n\r\n") && len + 1 < sizeof head && th_now_ms() < end) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 100) != 1)
            continue;
        ssize_t got = read(fd, head + len, sizeof head - 1 - len);
        if (got <= 0)
            break;
        len += (size_t)got;
        head[len] = '\0';
    }
    *status = strncmp(head, "HTTP/1.", 7) == 0 ? atoi(head + 9) : 0;
    return fd;
}

/* Opens n event streams (GET /api/v1/events) from src; each must start (200). */
static void open_streams(slow_t *s, int n, int port, const char *src)
{
    for (int i = 0; i < n; i++) {
        int status = 0;
        s[i].fd = open_get(port, src, "/api/v1/events", "127.0.0.1", &status);
        s[i].opened_ms = th_now_ms();
        s[i].closed_ms = 0;
        if (status != 200)
            fail_msg("event stream %d from %s: status %d", i, src, status);
    }
}

/* max_sse_clients (16) event streams from one address fill max_connections_per_address (16) as
 * well: /healthz and /metrics from that address must still answer, and the streams stay. */
static void test_event_streams_leave_room_for_probes(void **state)
{
    (void)state;
    th_daemon_t d;
    int port;
    start(&d, &port, (const char *[]){"--pub-interval-ms", "100", NULL});
    enum { N = 16 };
    slow_t s[N];
    open_streams(s, N, port, "127.0.0.1");
    /* One more is over max_sse_clients: answered 503, not left without a reply. */
    char *resp = th_http_exchange(port, "127.0.0.1",
                                  "GET /api/v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                  "Connection: close\r\n\r\n",
                                  20000);
    assert_non_null(resp);
    assert_non_null(strstr(resp, " 503 "));
    assert_non_null(strstr(resp, "too_many_event_streams"));
    free(resp);
    for (int i = 0; i < 10; i++) {
        const char *path = i % 2 ? "/metrics" : "/healthz";
        int code = probe(port, "127.0.0.1", path, NULL);
        if (code != 200)
            fail_msg("GET %s beside %d event streams from its address: status %d", path, N, code);
    }
    assert_int_equal(count_closed(s, N), 0);
    slow_close_all(s, N);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* Event streams filling max_connections (from several addresses) leave room for a probe too. */
static void test_event_streams_leave_room_in_total(void **state)
{
    (void)state;
    th_daemon_t d;
    int port;
    start(
        &d, &port,
        (const char *[]){"--metrics-max-connections", "4", "--metrics-max-sse-clients", "4", NULL});
    slow_t s[4];
    for (int i = 0; i < 4; i++) {
        char src[32];
        snprintf(src, sizeof src, "127.0.0.%d", 2 + i);
        open_streams(&s[i], 1, port, src);
    }
    for (int i = 0; i < 4; i++) {
        const char *path = i % 2 ? "/metrics" : "/healthz";
        int code = probe(port, "127.0.0.9", path, NULL);
        if (code != 200)
            fail_msg("GET %s beside 4 event streams (max_connections 4): status %d", path, code);
    }
    assert_int_equal(count_closed(s, 4), 0);
    slow_close_all(s, 4);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* ---- Host (issue 30, item 3) ------------------------------------------------------------- */

/* The status of GET path with Host host (NULL: HTTP/1.0 without one); *body, when not NULL,
 * the whole response (malloc'ed). Not for an event stream that starts: it would not end. */
static int host_get(int port, const char *path, const char *host, char **body)
{
    char req[512];
    if (host)
        snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", path,
                 host);
    else
        snprintf(req, sizeof req, "GET %s HTTP/1.0\r\n\r\n", path);
    char *resp = th_http_exchange(port, NULL, req, 20000);
    int code = resp && strncmp(resp, "HTTP/1.", 7) == 0 ? atoi(resp + 9) : 0;
    if (body)
        *body = resp;
    else
        free(resp);
    return code;
}

static void expect_host(int port, const char *path, const char *host, int want)
{
    int got = host_get(port, path, host, NULL);
    if (got != want)
        fail_msg("GET %s with Host %s: %d, expected %d", path, host ? host : "(none)", got, want);
}

static const char *const host_paths[] = {
    "/", "/app.js", "/metrics", "/api/v1/streams", "/api/v1/streams/cam0", NULL};

/* A loopback listener answers its IP addresses, localhost and no Host; any other name is
 * answered 421 with what to do, JSON on the API; /healthz answers whatever the Host. */
static void test_host_checked_against_rebinding(void **state)
{
    (void)state;
    th_daemon_t d;
    int port;
    start(&d, &port, NULL);
    char with_port[64], v4[64], v6[64];
    snprintf(with_port, sizeof with_port, "localhost:%d", port);
    snprintf(v4, sizeof v4, "127.0.0.1:%d", port);
    snprintf(v6, sizeof v6, "[::1]:%d", port);
    const char *good[] = {with_port,   "localhost", "LocalHost",     "localhost.", v4,
                          "127.0.0.1", v6,          "10.0.0.5:9464", NULL};
    const char *bad[] = {"evil.example",
                         "evil.example:9464",
                         "localhost.evil.example",
                         "127.0.0.1.evil.example",
                         "evil.example.",
                         "::1",
                         "localhost:80x",
                         "[::1",
                         NULL};
    for (int p = 0; host_paths[p]; p++) {
        int ok = strstr(host_paths[p], "cam0") ? 404 : 200; /* no such stream, but served */
        for (int i = 0; good[i]; i++)
            expect_host(port, host_paths[p], good[i], ok);
        expect_host(port, host_paths[p], NULL, ok);
        for (int i = 0; bad[i]; i++)
            expect_host(port, host_paths[p], bad[i], 421);
        expect_host(port, "/healthz", bad[p], 200);
    }
    char *body = NULL;
    assert_int_equal(host_get(port, "/api/v1/streams", "evil.example:9464", &body), 421);
    assert_non_null(strstr(body, "{\"error\":\"misdirected\""));
    assert_non_null(strstr(body, "not to 'evil.example:9464'"));
    assert_non_null(strstr(body, "allowed_hosts"));
    free(body);
    assert_int_equal(host_get(port, "/", "evil.example", &body), 421);
    assert_non_null(strstr(body, "text/plain"));
    assert_non_null(strstr(body, "not to 'evil.example'"));
    free(body);
    /* Event streams: refused before they start, or started. */
    int status = 0;
    int fd = open_get(port, NULL, "/api/v1/events", "evil.example", &status);
    assert_int_equal(status, 421);
    close(fd);
    fd = open_get(port, NULL, "/api/v1/events?stream=cam0", with_port, &status);
    assert_int_equal(status, 200);
    close(fd);
    /* Another method on /metrics or /healthz: 405 with the methods they take (RFC 9110), as
     * every 405 of the page and the API. */
    const char *const plain[] = {"/metrics", "/healthz", "/", "/api/v1/streams"};
    for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++) {
        char *resp = th_http_get(port, "POST", plain[i], NULL);
        assert_non_null(resp);
        assert_int_equal(strncmp(resp, "HTTP/1.", 7) == 0 ? atoi(resp + 9) : 0, 405);
        assert_non_null(strstr(resp, "\r\nAllow: GET, HEAD\r\n"));
        free(resp);
    }
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* allowed_hosts: names, .domain for a domain and its subdomains, * for any. */
static void test_host_allowed_list(void **state)
{
    (void)state;
    th_daemon_t d;
    int port;
    start(&d, &port,
          (const char *[]){"--metrics-allowed-hosts", " tally.lan, .corp.example", NULL});
    const char *good[] = {"tally.lan", "TALLY.LAN:9464", "corp.example", "a.b.corp.example:80",
                          NULL};
    const char *bad[] = {"evil.example", "tally.lan.evil", "evilcorp.example", "lan", NULL};
    for (int i = 0; good[i]; i++)
        expect_host(port, "/api/v1/streams", good[i], 200);
    for (int i = 0; bad[i]; i++)
        expect_host(port, "/api/v1/streams", bad[i], 421);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    start(&d, &port, (const char *[]){"--metrics-allowed-hosts", "*", NULL});
    expect_host(port, "/api/v1/streams", "evil.example", 200);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* The port in the log line "serving http://PREFIX:PORT/metrics", or -1. */
static int logged_port(const th_daemon_t *d, const char *prefix)
{
    char *log = th_slurp(d->log_path);
    char mark[128];
    snprintf(mark, sizeof mark, "metrics: serving http://%s:", prefix);
    const char *at = log ? strstr(log, mark) : NULL;
    int port = at ? atoi(at + strlen(mark)) : -1;
    free(log);
    return port;
}

/* On a wildcard listener Prometheus scrapes by IP (Host: 10.0.0.5:9464) and is answered; a
 * name is answered only when it is localhost or in allowed_hosts. */
static void test_host_on_wildcard_listener(void **state)
{
    (void)state;
    th_daemon_t d;
    const char *base[] = {"--metrics", "0.0.0.0:0", "--protected-mode", "off", NULL};
    assert_int_equal(th_daemon_start_with(&d, base, NULL), 0);
    int port = logged_port(&d, "0.0.0.0");
    assert_true(port > 0);
    expect_host(port, "/metrics", "10.0.0.5:9464", 200);
    expect_host(port, "/metrics", "[fe80::1]:9464", 200);
    expect_host(port, "/metrics", "localhost:9464", 200);
    expect_host(port, "/metrics", "gpu-box:9464", 421);
    expect_host(port, "/", "gpu-box", 421);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
    assert_int_equal(th_daemon_start_with(
                         &d, base, (const char *[]){"--metrics-allowed-hosts", "gpu-box", NULL}),
                     0);
    port = logged_port(&d, "0.0.0.0");
    expect_host(port, "/metrics", "gpu-box:9464", 200);
    expect_host(port, "/", "GPU-BOX", 200);
    expect_host(port, "/", "evil.example", 421);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 10000), 0);
}

/* ---- Start failures (issue 30, item 7) --------------------------------------------------- */

/* tallyd with args, run to its exit (it is to refuse to start), its log in log (cap bytes): its
 * exit status. Its request endpoint is an ipc:// path in a directory of this run's own, so the
 * only endpoint that can be refused is the one the test chose: a TCP port picked free before
 * tallyd bound it was taken meanwhile by another test's process on the loaded box, and tallyd
 * stopped at that bind instead, saying nothing of the metrics port. */
static int run_refused(const char *const *args, char *log, size_t cap)
{
    char dir[64], bind[128];
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-http-refused"), 0);
    snprintf(bind, sizeof bind, "ipc://%s/tallyd.sock", dir);
    static int runs;
    snprintf(log, cap, "/tmp/tallyd-test-http-%d-%d.log", (int)getpid(), runs++);
    const char *argv[16] = {"--bind", bind, "--backend", "cpu", "--shm", "off"};
    int argc = 6;
    for (int i = 0; args[i] && argc < 15; i++)
        argv[argc++] = args[i];
    int status = th_daemon_run_to_exit(argv, log, TH_START_WAIT_MS);
    th_rmrf(dir);
    return status;
}

/* A listen port another socket holds: the error names that port, never "port 0"; an
 * allowed_hosts item that is not a name stops tallyd with the reason. Each exits 1 (start-up
 * failed). */
static void test_bind_error_names_the_port(void **state)
{
    (void)state;
    int holder = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in in = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof in;
    assert_int_equal(bind(holder, (struct sockaddr *)&in, sizeof in), 0);
    assert_int_equal(listen(holder, 1), 0);
    assert_int_equal(getsockname(holder, (struct sockaddr *)&in, &len), 0);
    int held = ntohs(in.sin_port);
    char listen_at[64], port_words[32], ours[128];
    snprintf(listen_at, sizeof listen_at, "127.0.0.1:%d", held);
    snprintf(port_words, sizeof port_words, "port %d", held);
    snprintf(ours, sizeof ours, "metrics: cannot listen on %s: Address already in use", listen_at);
    th_daemon_t d = {0};
    const char *taken[] = {"--metrics", listen_at, NULL};
    assert_int_equal(run_refused(taken, d.log_path, sizeof d.log_path), 1);
    if (th_daemon_log_contains(&d, "port 0") || !th_daemon_log_contains(&d, port_words))
        fail_msg("the bind error does not name port %d:\n%s", held, th_slurp(d.log_path));
    assert_true(th_daemon_log_contains(&d, ours));
    assert_true(th_daemon_log_contains(&d, "ss -ltnp"));
    close(holder);
    unlink(d.log_path);
    const char *bad_host[] = {"--metrics", "127.0.0.1:0", "--metrics-allowed-hosts",
                              "tally.lan,evil:80", NULL};
    assert_int_equal(run_refused(bad_host, d.log_path, sizeof d.log_path), 1);
    assert_true(th_daemon_log_contains(&d, "allowed_hosts: 'evil:80' is not a host name"));
    unlink(d.log_path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_deadline_closes_slow_connections),
        cmocka_unit_test(test_healthz_answers_under_slowloris),
        cmocka_unit_test(test_address_bound_closes_oldest_idle),
        cmocka_unit_test(test_total_bound_closes_oldest_idle),
        cmocka_unit_test(test_busy_connections_refuse_then_expire),
        cmocka_unit_test(test_busy_address_refused_others_served),
        cmocka_unit_test(test_event_streams_leave_room_for_probes),
        cmocka_unit_test(test_event_streams_leave_room_in_total),
        cmocka_unit_test(test_host_checked_against_rebinding),
        cmocka_unit_test(test_host_allowed_list),
        cmocka_unit_test(test_host_on_wildcard_listener),
        cmocka_unit_test(test_bind_error_names_the_port),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
