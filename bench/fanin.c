/* SPDX-License-Identifier: Apache-2.0 */
/*
 * fanin.c — the raw ZeroMQ fan-in: the transport ceiling tallyd's ZeroMQ path is measured against
 * (issue 9, part B).
 *
 *   fanin --endpoint EP [--producers P] [--window W] [--size BYTES] [--reply echo|BYTES]
 *         [--io-threads N] [--seconds S] [--stagger-ms MS] [--send zc|copy] [--hold N]
 *         [--label TEXT] [--header]
 *
 * One process, one application thread: it binds a ROUTER (with N ZeroMQ I/O threads) and serves
 * it in a plain recv/send loop, exactly the shape of tallyd's loop thread minus the work. It forks
 * P producer processes (separate processes, as real producers are: each has its own ZeroMQ context
 * and I/O thread, so the producers themselves never share a core-bound thread); each connects a
 * DEALER and keeps W requests in flight. A request is tallyd's framing: a 128-byte header frame
 * and a payload frame of BYTES (sent zero-copy from one buffer; --send copy copies it into a new
 * message each time, as libtally's tally_send does). The reply is the header frame
 * echoed back and either the request's own payload frame (--reply echo: zero copy, the reply as
 * large as the request) or a BYTES-byte buffer (--reply 2048: a histogram's reply). --hold N keeps
 * the last N request payloads open before closing them, as tallyd holds a request's payload until
 * it has been copied to the device: it tells whether the life of received buffers is what costs
 * (bench/NOTES.md).
 *
 * Each producer measures, after a warm-up, S seconds: requests answered, request payload bytes,
 * and the round-trip latency of each (send to reply). It hands its figures to the parent over a
 * pipe. Output: one markdown row in loadgen's layout (BENCH_ROW_HEADER, bench/bench_util.h), so one
 * parser reads both: GB/s counts request payload bytes, over the union of the producers' intervals;
 * p50/p99 are the median over producers of each producer's own percentile. Exit 1 when a producer
 * failed.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "bench_util.h"

#define WARMUP_S 0.3
#define MAX_PRODUCERS 64
#define MAX_WINDOW 256
#define HEADER_BYTES 128
#define LAT_CAP (1u << 20)

typedef struct {
    bench_opts_t c; /* --endpoint --label --size --producers --window --seconds --header */
    size_t reply;   /* 0: echo the payload frame */
    int io_threads;
    bool send_copy; /* --send copy: zmq_send (a copy per request), else zero-copy */
    unsigned hold;  /* --hold: request payloads kept open, oldest closed first */
} opts_t;

/* What a producer reports to the parent. */
typedef struct {
    uint64_t answered; /* in the measured interval */
    uint64_t sent;
    uint64_t replies; /* all replies received */
    double t_first, t_last;
    double p50, p99, p999;
    int failed;
} result_t;

/* ---- producer process --------------------------------------------------------------------- */

static int send_request(void *sock, uint8_t *header, uint64_t id, void *payload, size_t size,
                        bool copy)
{
    memcpy(header + 8, &id, sizeof id);
    if (zmq_send(sock, header, HEADER_BYTES, ZMQ_SNDMORE) != HEADER_BYTES)
        return -1;
    if (copy)
        return zmq_send(sock, payload, size, 0) == (int)size ? 0 : -1;
    zmq_msg_t body;
    zmq_msg_init_data(&body, payload, size, NULL, NULL); /* the buffer outlives the socket */
    if (zmq_msg_send(&body, sock, 0) < 0) {
        zmq_msg_close(&body);
        return -1;
    }
    return 0;
}

/* Receives one reply (header, body); returns its id, or UINT64_MAX on a timeout or error. */
static uint64_t recv_reply(void *sock)
{
    zmq_msg_t part;
    uint64_t id = UINT64_MAX;
    bool first = true, more = true;
    while (more) {
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, sock, 0) < 0) {
            zmq_msg_close(&part);
            return UINT64_MAX;
        }
        if (first && zmq_msg_size(&part) >= 16)
            memcpy(&id, (uint8_t *)zmq_msg_data(&part) + 8, sizeof id);
        first = false;
        more = zmq_msg_more(&part);
        zmq_msg_close(&part);
    }
    return id;
}

static void producer_run(const opts_t *o, unsigned index, double origin, result_t *res)
{
    double warmup_from = bench_stagger(&o->c, index, origin);
    void *ctx = zmq_ctx_new();
    void *sock = zmq_socket(ctx, ZMQ_DEALER);
    int hwm = 1000, timeout = 10000, linger = 0;
    zmq_setsockopt(sock, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(sock, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(sock, ZMQ_RCVTIMEO, &timeout, sizeof timeout);
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
    uint8_t header[HEADER_BYTES] = {'T', 'L', 'Y', '1'};
    uint8_t *payload = malloc(o->c.size ? o->c.size : 1);
    double *lat = malloc(LAT_CAP * sizeof *lat);
    double sent_at[MAX_WINDOW * 4];
    size_t nlat = 0;
    memset(res, 0, sizeof *res);
    if (!payload || !lat || zmq_connect(sock, o->c.endpoint) != 0) {
        res->failed = 1;
        goto out;
    }
    for (size_t i = 0; i < o->c.size; i++)
        payload[i] = (uint8_t)(i * 2654435761u >> 24);
    double t0 = fmax(bench_now_s(), warmup_from), t_start = t0 + WARMUP_S;
    double t_stop = t_start + o->c.seconds;
    res->t_first = 1e300;
    unsigned inflight = 0;
    bool sending = true;
    while (sending || inflight) {
        while (sending && inflight < o->c.window) {
            sent_at[res->sent % (MAX_WINDOW * 4)] = bench_now_s();
            if (send_request(sock, header, res->sent, payload, o->c.size, o->send_copy) != 0) {
                res->failed = 1;
                goto out;
            }
            res->sent++;
            inflight++;
        }
        uint64_t id = recv_reply(sock);
        double t = bench_now_s();
        if (id == UINT64_MAX) {
            res->failed = 1;
            goto out;
        }
        inflight--;
        res->replies++;
        if (t >= t_start && t < t_stop) {
            if (nlat < LAT_CAP)
                lat[nlat++] = (t - sent_at[id % (MAX_WINDOW * 4)]) * 1e6;
            res->answered++;
            if (t < res->t_first)
                res->t_first = t;
            res->t_last = t;
        }
        if (t >= t_stop)
            sending = false;
    }
    qsort(lat, nlat, sizeof *lat, bench_cmp_double);
    res->p50 = bench_percentile(lat, nlat, 0.50);
    res->p99 = bench_percentile(lat, nlat, 0.99);
    res->p999 = bench_percentile(lat, nlat, 0.999);
out:
    free(lat);
    free(payload);
    zmq_close(sock);
    zmq_ctx_term(ctx);
}

/* ---- the ROUTER, one application thread --------------------------------------------------- */

/* The request payloads --hold keeps open: a ring, the oldest closed when a new one comes. */
typedef struct {
    zmq_msg_t *msgs;
    unsigned cap, next, count;
} held_t;

/* Keeps body (moved) in the ring, closing the oldest when it is full; with no ring, closes it. */
static void hold_body(held_t *h, zmq_msg_t *body)
{
    if (!h->cap) {
        zmq_msg_close(body);
        return;
    }
    if (h->count == h->cap)
        zmq_msg_close(&h->msgs[h->next]);
    else
        h->count++;
    zmq_msg_init(&h->msgs[h->next]);
    zmq_msg_move(&h->msgs[h->next], body);
    zmq_msg_close(body);
    h->next = (h->next + 1) % h->cap;
}

/* Serves one message if one arrives within the receive timeout: 1 served, 0 none, -1 error. */
static int serve_one(void *router, const void *reply, size_t reply_len, held_t *held)
{
    zmq_msg_t id, header, body;
    zmq_msg_init(&id);
    if (zmq_msg_recv(&id, router, 0) < 0) {
        zmq_msg_close(&id);
        return errno == EAGAIN || errno == EINTR ? 0 : -1;
    }
    zmq_msg_init(&header);
    zmq_msg_init(&body);
    int rc = -1;
    if (zmq_msg_recv(&header, router, 0) < 0 || zmq_msg_recv(&body, router, 0) < 0)
        goto out;
    if (zmq_msg_send(&id, router, ZMQ_SNDMORE) < 0 ||
        zmq_msg_send(&header, router, ZMQ_SNDMORE) < 0)
        goto out;
    if (reply_len) { /* a small reply built by the application, as tallyd's histogram */
        if (zmq_send(router, reply, reply_len, 0) < 0)
            goto out;
    } else if (zmq_msg_send(&body, router, 0) < 0) { /* echo: the request's frame, no copy */
        goto out;
    }
    rc = 1;
out:
    zmq_msg_close(&id);
    zmq_msg_close(&header);
    hold_body(held, &body); /* echoed: body is empty now */
    return rc;
}

static void print_row(const opts_t *o, const result_t *rs, unsigned n, int errors)
{
    double t_first = 1e300, t_last = 0, p50[MAX_PRODUCERS], p99[MAX_PRODUCERS], p999[MAX_PRODUCERS];
    uint64_t answered = 0, sent = 0, replies = 0;
    for (unsigned i = 0; i < n; i++) {
        answered += rs[i].answered;
        sent += rs[i].sent;
        replies += rs[i].replies;
        t_first = rs[i].t_first < t_first ? rs[i].t_first : t_first;
        t_last = rs[i].t_last > t_last ? rs[i].t_last : t_last;
        p50[i] = rs[i].p50;
        p99[i] = rs[i].p99;
        p999[i] = rs[i].p999;
    }
    qsort(p50, n, sizeof(double), bench_cmp_double);
    qsort(p99, n, sizeof(double), bench_cmp_double);
    qsort(p999, n, sizeof(double), bench_cmp_double);
    double span = t_last > t_first ? t_last - t_first : NAN;
    char size[32], op[80];
    bench_size_label(o->c.size, size, sizeof size);
    char hold[32] = "";
    if (o->hold)
        snprintf(hold, sizeof hold, ", hold %u", o->hold);
    if (o->reply)
        snprintf(op, sizeof op, "fan-in %zu B reply, %d io%s%s", o->reply, o->io_threads,
                 o->send_copy ? ", copy" : "", hold);
    else
        snprintf(op, sizeof op, "fan-in echo, %d io%s%s", o->io_threads,
                 o->send_copy ? ", copy" : "", hold);
    if (o->c.header)
        printf(BENCH_ROW_HEADER);
    printf("| %s | %s | %s | %u x %u | %.0f | %.3f | %.1f | %.1f | %.1f | %" PRIu64 "/%" PRIu64
           " | %d | - |\n",
           o->c.label, op, size, o->c.producers, o->c.window, (double)answered / span,
           (double)answered * (double)o->c.size / span / 1e9, n ? p50[n / 2] : NAN,
           n ? p99[n / 2] : NAN, n ? p999[n / 2] : NAN, replies, sent, errors);
    fflush(stdout);
}

static int run(opts_t *o)
{
    void *ctx = zmq_ctx_new();
    zmq_ctx_set(ctx, ZMQ_IO_THREADS, o->io_threads);
    void *router = zmq_socket(ctx, ZMQ_ROUTER);
    int hwm = 1000, timeout = 100, one = 1, linger = 0;
    zmq_setsockopt(router, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(router, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(router, ZMQ_RCVTIMEO, &timeout, sizeof timeout);
    zmq_setsockopt(router, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    zmq_setsockopt(router, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_bind(router, o->c.endpoint) != 0) {
        fprintf(stderr, "fanin: cannot bind %s: %s\n", o->c.endpoint, zmq_strerror(errno));
        return 2;
    }
    /* A wildcard port (tcp://127.0.0.1:0) becomes the port bound, for the producers. */
    char bound[256];
    size_t bound_len = sizeof bound;
    if (zmq_getsockopt(router, ZMQ_LAST_ENDPOINT, bound, &bound_len) == 0)
        o->c.endpoint = bound;
    int pipes[MAX_PRODUCERS][2];
    pid_t pids[MAX_PRODUCERS];
    fflush(stdout);
    double origin = bench_now_s();
    for (unsigned i = 0; i < o->c.producers; i++) {
        if (pipe(pipes[i]) != 0)
            return 2;
        pids[i] = fork();
        if (pids[i] == 0) { /* never touches the parent's context: a fresh one of its own */
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            result_t res;
            producer_run(o, i, origin, &res);
            ssize_t w = write(pipes[i][1], &res, sizeof res);
            _exit(w == (ssize_t)sizeof res && !res.failed ? 0 : 1);
        }
        close(pipes[i][1]);
    }
    void *reply = calloc(1, o->reply ? o->reply : 1);
    held_t held = {.msgs = o->hold ? calloc(o->hold, sizeof(zmq_msg_t)) : NULL};
    held.cap = held.msgs ? o->hold : 0;
    unsigned running = o->c.producers;
    int errors = 0;
    while (running) {
        int rc = serve_one(router, reply, o->reply, &held);
        if (rc < 0) {
            fprintf(stderr, "fanin: serving: %s\n", zmq_strerror(errno));
            errors++;
            break;
        }
        if (rc == 0) /* nothing within the timeout: have the producers finished? */
            while (running && waitpid(-1, NULL, WNOHANG) > 0)
                running--;
    }
    result_t rs[MAX_PRODUCERS];
    for (unsigned i = 0; i < o->c.producers; i++) {
        if (read(pipes[i][0], &rs[i], sizeof rs[i]) != (ssize_t)sizeof rs[i] || rs[i].failed) {
            memset(&rs[i], 0, sizeof rs[i]);
            errors++;
        }
        close(pipes[i][0]);
    }
    while (waitpid(-1, NULL, 0) > 0)
        continue;
    print_row(o, rs, o->c.producers, errors);
    for (unsigned i = 0; i < held.count; i++)
        zmq_msg_close(&held.msgs[(held.next + held.cap - held.count + i) % held.cap]);
    free(held.msgs);
    free(reply);
    zmq_close(router);
    zmq_ctx_term(ctx);
    return errors ? 1 : 0;
}

static void usage(void)
{
    fprintf(stderr, "usage: fanin --endpoint EP [--producers P] [--window W] [--size BYTES]\n"
                    "             [--reply echo|BYTES] [--io-threads N] [--seconds S]\n"
                    "             [--stagger-ms MS] [--send zc|copy] [--hold N]\n"
                    "             [--label TEXT] [--header]\n");
}

/* --reply, --io-threads, --send and --hold (bench_own_opt_fn). */
static bool own_opt(void *ctx, int argc, char **argv, int *i)
{
    opts_t *o = ctx;
    const char *a = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    if (!v)
        return false;
    if (strcmp(a, "--reply") == 0)
        o->reply = strcmp(v, "echo") == 0 ? 0 : strtoull(v, NULL, 0);
    else if (strcmp(a, "--io-threads") == 0)
        o->io_threads = atoi(v);
    else if (strcmp(a, "--send") == 0 && (strcmp(v, "zc") == 0 || strcmp(v, "copy") == 0))
        o->send_copy = strcmp(v, "copy") == 0;
    else if (strcmp(a, "--hold") == 0)
        o->hold = (unsigned)strtoul(v, NULL, 0);
    else
        return false;
    (*i)++;
    return true;
}

int main(int argc, char **argv)
{
    opts_t o = {
        .c = {.label = "raw", .producers = 8, .window = 8, .size = 1u << 20, .seconds = 1.5},
        .reply = 2048,
        .io_threads = 1};
    if (!bench_parse_opts(argc, argv, &o.c, own_opt, &o)) {
        usage();
        return 2;
    }
    if (!o.c.endpoint || !o.c.producers || o.c.producers > MAX_PRODUCERS || !o.c.window ||
        o.c.window > MAX_WINDOW || o.io_threads < 1 || o.c.seconds <= 0) {
        usage();
        return 2;
    }
    return run(&o);
}
