/* SPDX-License-Identifier: Apache-2.0 */
/*
 * http_slowloris.c — GET /healthz latency while slow connections hold tallyd's HTTP port
 * (issue 21, item 5).
 *
 * Opens N connections to 127.0.0.1:PORT, `per_addr` of them from each loopback source address
 * 127.0.0.2, 127.0.0.3, ... (the whole 127/8 is loopback on Linux, so the per-address limit
 * sees N / per_addr addresses; --per-addr N puts them all on 127.0.0.2). Each sends a request
 * line, then one header byte every `interval` ms and never finishes its headers: the slowloris
 * attack. Meanwhile it asks GET /healthz from 127.0.0.1 every 100 ms (each with a 2 s timeout)
 * and prints the probes' latency (p50, p99, max) and failures, and how many slow connections
 * the server closed and at what age.
 *
 * usage: http_slowloris PORT [CONNS [PER_ADDR [INTERVAL_MS [SECONDS]]]]
 *        defaults 200, 8, 5000, 12
 */
#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "harness.h" /* the tests' TCP and HTTP helpers */

#define PROBE_EVERY_MS 100
#define PROBE_TIMEOUT_MS 2000
#define MAX_CONNS 4096
#define MAX_PROBES 100000

typedef struct {
    int fd;
    double opened_ms, closed_ms; /* closed_ms 0: still open (as far as we know) */
    double next_byte_ms;
} slow_t;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* One GET /healthz; its latency in ms, or -1 (no 200 within PROBE_TIMEOUT_MS). */
static double probe(int port)
{
    static const char req[] = "GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    double start = now_ms();
    char *resp = th_http_exchange(port, NULL, req, PROBE_TIMEOUT_MS);
    bool ok = resp && strncmp(resp, "HTTP/1.", 7) == 0 && strncmp(resp + 8, " 200 ", 5) == 0;
    free(resp);
    return ok ? now_ms() - start : -1;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Sends each open slow connection its next header byte when due, and notes the ones the
 * server closed. */
static void tend(slow_t *slow, int n, double interval_ms)
{
    for (int i = 0; i < n; i++) {
        slow_t *s = &slow[i];
        if (s->closed_ms)
            continue;
        struct pollfd p = {.fd = s->fd, .events = POLLIN | POLLRDHUP};
        char junk[256];
        if (poll(&p, 1, 0) == 1 &&
            (p.revents & (POLLRDHUP | POLLHUP | POLLERR) || read(s->fd, junk, sizeof junk) <= 0)) {
            s->closed_ms = now_ms();
            continue;
        }
        if (now_ms() >= s->next_byte_ms) {
            if (send(s->fd, "x", 1, MSG_NOSIGNAL) != 1)
                s->closed_ms = now_ms();
            s->next_byte_ms += interval_ms;
        }
    }
}

static void report(slow_t *slow, int n, double *lat, int probes, int failed)
{
    qsort(lat, (size_t)(probes - failed), sizeof *lat, cmp_double);
    int ok = probes - failed;
    printf("probes %d, failed %d", probes, failed);
    if (ok)
        printf(", latency ms p50 %.2f p99 %.2f max %.2f", lat[ok / 2], lat[ok * 99 / 100],
               lat[ok - 1]);
    double ages[MAX_CONNS];
    int closed = 0;
    for (int i = 0; i < n; i++)
        if (slow[i].closed_ms)
            ages[closed++] = slow[i].closed_ms - slow[i].opened_ms;
    qsort(ages, (size_t)closed, sizeof *ages, cmp_double);
    printf("\nslow connections %d, closed by the server %d", n, closed);
    if (closed)
        printf(", at age ms min %.0f median %.0f max %.0f", ages[0], ages[closed / 2],
               ages[closed - 1]);
    printf("\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s PORT [CONNS [PER_ADDR [INTERVAL_MS [SECONDS]]]]\n", argv[0]);
        return 2;
    }
    int port = atoi(argv[1]);
    int n = argc > 2 ? atoi(argv[2]) : 200;
    int per_addr = argc > 3 ? atoi(argv[3]) : 8;
    double interval = argc > 4 ? atof(argv[4]) : 5000;
    double seconds = argc > 5 ? atof(argv[5]) : 12;
    if (n < 0 || n > MAX_CONNS || per_addr < 1 || n / per_addr > 250) {
        fprintf(stderr, "at most %d connections over at most 250 source addresses\n", MAX_CONNS);
        return 2;
    }
    static slow_t slow[MAX_CONNS];
    static double lat[MAX_PROBES];
    for (int i = 0; i < n; i++) {
        char src[32];
        snprintf(src, sizeof src, "127.0.0.%d", 2 + i / per_addr);
        slow[i].fd = th_tcp_connect_from(src, port);
        if (slow[i].fd < 0) {
            fprintf(stderr, "connection %d from %s: %s\n", i, src, strerror(errno));
            return 1;
        }
        static const char line[] = "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n";
        slow[i].opened_ms = now_ms();
        slow[i].next_byte_ms = slow[i].opened_ms + interval;
        if (send(slow[i].fd, line, sizeof line - 1, MSG_NOSIGNAL) != (ssize_t)(sizeof line - 1))
            slow[i].closed_ms = now_ms();
    }
    int probes = 0, failed = 0;
    for (double end = now_ms() + seconds * 1e3; now_ms() < end && probes < MAX_PROBES;) {
        tend(slow, n, interval);
        double took = probe(port);
        probes++;
        if (took < 0)
            failed++;
        else
            lat[probes - failed - 1] = took;
        usleep(PROBE_EVERY_MS * 1000);
    }
    report(slow, n, lat, probes, failed);
    for (int i = 0; i < n; i++)
        close(slow[i].fd);
    return 0;
}
