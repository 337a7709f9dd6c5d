/* SPDX-License-Identifier: Apache-2.0 */
/*
 * state_bench.c — drives many streams for the stream-state benchmark (issue 26,
 * bench/run-state.sh): memory per stream, snapshot bytes, restart time, query latency.
 *
 *   state_bench ENDPOINT hist N [--from F] [--window W] [--size B] [--seed S]
 *       one u8 hist batch of B bytes (default 1024, uniform random) on each of streams F..F+N-1
 *       (named s0000000, s0000001, ...), W requests in flight (default 256);
 *   state_bench ENDPOINT query STREAM [--count C]
 *       C (default 2000) plain queries of STREAM one after another: their latency p50 / p99.
 *
 * Prints one line of key=value pairs (`elapsed_s`, `req_per_s`, `errors`; for query `p50_us`,
 * `p99_us`). Exit status 1 when a request failed. The daemon must allow the stream creations:
 * run-state.sh raises stream_create_rate, max_streams_per_client and max_state_bytes for it.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "tally.h"

static void stream_name(tally_req_t *q, unsigned i)
{
    q->stream_len = (uint8_t)snprintf(q->stream, sizeof q->stream, "s%07u", i);
}

/* One reply: false (and counted) when it is an error. */
static bool take_reply(tally_client_t *c, unsigned *errors)
{
    tally_reply_t r;
    tally_reply_init(&r);
    tally_status_t st = tally_recv(c, &r);
    if (st != TALLY_OK) {
        if (*errors < 5)
            fprintf(stderr, "state_bench: status %d: %s\n", st, r.error);
        (*errors)++;
    }
    tally_reply_clear(&r);
    return st == TALLY_OK;
}

static int run_hist(tally_client_t *c, unsigned from, unsigned n, unsigned window, size_t size)
{
    uint8_t *payload = malloc(size);
    if (!payload)
        return 1;
    tally_req_t q = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    unsigned sent = 0, done = 0, errors = 0;
    double t0 = bench_now_s();
    while (done < n) {
        while (sent < n && sent - done < window) {
            for (size_t i = 0; i < size; i++)
                payload[i] = (uint8_t)random();
            stream_name(&q, from + sent);
            tally_status_t st = tally_send(c, &q, payload, size, NULL);
            if (st != TALLY_OK) {
                fprintf(stderr, "state_bench: send: %s\n", tally_client_error(c));
                free(payload);
                return 1;
            }
            sent++;
        }
        take_reply(c, &errors);
        done++;
    }
    double s = bench_now_s() - t0;
    printf("op=hist streams=%u elapsed_s=%.3f req_per_s=%.0f errors=%u\n", n, s, n / s, errors);
    free(payload);
    return errors ? 1 : 0;
}

static int run_query(tally_client_t *c, const char *stream, unsigned count)
{
    double *lat = malloc(count * sizeof *lat);
    if (!lat)
        return 1;
    tally_req_t q = {.opcode = TALLY_OP_QUERY};
    q.stream_len = (uint8_t)snprintf(q.stream, sizeof q.stream, "%s", stream);
    unsigned errors = 0;
    double t0 = bench_now_s();
    for (unsigned i = 0; i < count; i++) {
        double t = bench_now_s();
        if (tally_send(c, &q, NULL, 0, NULL) != TALLY_OK) {
            free(lat);
            return 1;
        }
        take_reply(c, &errors);
        lat[i] = (bench_now_s() - t) * 1e6;
    }
    double s = bench_now_s() - t0;
    qsort(lat, count, sizeof *lat, bench_cmp_double);
    printf("op=query count=%u elapsed_s=%.3f p50_us=%.1f p99_us=%.1f errors=%u\n", count, s,
           bench_percentile(lat, count, 0.5), bench_percentile(lat, count, 0.99), errors);
    free(lat);
    return errors ? 1 : 0;
}

static unsigned opt_uint(int argc, char **argv, const char *name, unsigned def)
{
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return (unsigned)strtoul(argv[i + 1], NULL, 0);
    return def;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: state_bench ENDPOINT hist N [--from F] [--window W] [--size B] "
                        "[--seed S]\n       state_bench ENDPOINT query STREAM [--count C]\n");
        return 2;
    }
    srandom(opt_uint(argc, argv, "--seed", 1));
    tally_client_t *c = NULL;
    if (tally_client_new(argv[1], 30000, &c) != TALLY_OK) {
        fprintf(stderr, "state_bench: cannot connect to %s\n", argv[1]);
        return 1;
    }
    int rc = 2;
    if (strcmp(argv[2], "hist") == 0)
        rc = run_hist(c, opt_uint(argc, argv, "--from", 0), (unsigned)strtoul(argv[3], NULL, 0),
                      opt_uint(argc, argv, "--window", 256), opt_uint(argc, argv, "--size", 1024));
    else if (strcmp(argv[2], "query") == 0)
        rc = run_query(c, argv[3], opt_uint(argc, argv, "--count", 2000));
    tally_client_destroy(&c);
    return rc;
}
