/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bench_util.h — what the end-to-end benchmark programs (loadgen.c, fanin.c) share: one row
 * layout, so bench/run-path.sh reads both with one parser, the clock, percentiles, and the
 * options both take. Header-only (static functions): each program is one file plus this.
 */
#ifndef TALLY_BENCH_UTIL_H
#define TALLY_BENCH_UTIL_H

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tally_args.h"

#define BENCH_ROW_HEADER                                                                           \
    "| run | op | size | producers x window | req/s | GB/s | p50 us | p99 us | p99.9 us | "        \
    "answered | errors | VmHWM MiB |\n"                                                            \
    "|---|---|---|---|---|---|---|---|---|---|---|---|\n"

/* The options every benchmark program takes. */
typedef struct {
    const char *endpoint;
    const char *label;
    size_t size; /* request payload bytes */
    unsigned producers;
    unsigned window;     /* requests in flight per producer */
    double seconds;      /* measured, after the warm-up */
    bool header;         /* print BENCH_ROW_HEADER first */
    unsigned stagger_ms; /* --stagger-ms: producer i connects i x this after the first */
} bench_opts_t;

static inline double bench_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static inline int bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static inline double bench_percentile(const double *sorted, size_t n, double q)
{
    if (!n)
        return NAN;
    size_t i = (size_t)ceil(q * (double)n) - 1;
    return sorted[i < n ? i : n - 1];
}

/* "1 MiB", "4 KiB", "100 B" */
static inline void bench_size_label(size_t size, char *buf, size_t cap)
{
    if (size >= (1u << 20) && size % (1u << 20) == 0)
        snprintf(buf, cap, "%zu MiB", size >> 20);
    else if (size >= 1024 && size % 1024 == 0)
        snprintf(buf, cap, "%zu KiB", size >> 10);
    else
        snprintf(buf, cap, "%zu B", size);
}

/* Takes argv[*i] (and its value) when it is a common option; true when it was one. */
static inline bool bench_common_opt(int argc, char **argv, int *i, bench_opts_t *o)
{
    const char *a = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    if (strcmp(a, "--header") == 0) {
        o->header = true;
        return true;
    }
    if (!v)
        return false;
    if (strcmp(a, "--endpoint") == 0)
        o->endpoint = v;
    else if (strcmp(a, "--label") == 0)
        o->label = v;
    else if (strcmp(a, "--size") == 0) {
        /* tally's and tallyd's parser: 1M is 1 MiB, 1Q is refused (strtoull read 1 and 1). */
        char why[128];
        if (tally_size_parse(v, &o->size, why, sizeof why) != TALLY_OK) {
            const char *slash = strrchr(argv[0], '/');
            fprintf(stderr, "%s: invalid size '%s' for --size: %s\n", slash ? slash + 1 : argv[0],
                    v, why);
            return false;
        }
    } else if (strcmp(a, "--producers") == 0)
        o->producers = (unsigned)strtoul(v, NULL, 0);
    else if (strcmp(a, "--window") == 0)
        o->window = (unsigned)strtoul(v, NULL, 0);
    else if (strcmp(a, "--seconds") == 0)
        o->seconds = strtod(v, NULL);
    else if (strcmp(a, "--stagger-ms") == 0)
        o->stagger_ms = (unsigned)strtoul(v, NULL, 0);
    else
        return false;
    (*i)++;
    return true;
}

/* --stagger-ms: producer `index` waits index x stagger_ms before it connects, because
 * connections that arrive together can land on the same ZeroMQ I/O thread (bench/NOTES.md, "Where
 * tallyd's time goes"). Returns when its warm-up starts: the same moment for every producer,
 * after the last one has connected, so all of them measure the same interval; 0 without
 * staggering (each producer then starts its warm-up when it has connected). origin: when the
 * first producer started (bench_now_s()). */
static inline double bench_stagger(const bench_opts_t *o, unsigned index, double origin)
{
    if (!o->stagger_ms)
        return 0;
    usleep((useconds_t)index * o->stagger_ms * 1000u);
    return origin + (double)(o->producers - 1) * o->stagger_ms / 1000.0 + 0.05;
}

/* A field of /proc/PID/status in KiB ("VmHWM", "VmRSS"); -1 when it cannot be read. */
static inline long bench_proc_kib(int pid, const char *key)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", pid);
    FILE *f = fopen(path, "r");
    long kib = -1;
    if (!f)
        return -1;
    size_t n = strlen(key);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, key, n) == 0 && line[n] == ':') {
            kib = strtol(line + n + 1, NULL, 10);
            break;
        }
    fclose(f);
    return kib;
}

/* A program's own options: takes argv[*i] (advancing *i past a value it takes) and returns
 * true, or false for an option it does not know or a value that is missing. */
typedef bool (*bench_own_opt_fn)(void *ctx, int argc, char **argv, int *i);

/* Parses argv[1..]: the common options into *c, every other one through own(ctx, ...). False
 * on an option neither knows (the caller prints its usage). */
static inline bool bench_parse_opts(int argc, char **argv, bench_opts_t *c, bench_own_opt_fn own,
                                    void *ctx)
{
    for (int i = 1; i < argc; i++)
        if (!bench_common_opt(argc, argv, &i, c) && !own(ctx, argc, argv, &i))
            return false;
    return true;
}

#endif
