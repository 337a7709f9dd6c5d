/* SPDX-License-Identifier: Apache-2.0 */
/*
 * nats_bench.c — the NATS fleet's rates beside JetStream's own (issue 22; run-nats.sh runs it):
 *
 *   nats_bench fill URL STREAM COUNT SIZE     publish COUNT hist u8 requests of SIZE bytes on
 *                                             STREAM with libtally's producer (PubAcks awaited)
 *   nats_bench bare URL STREAM COUNT          a bare pull consumer (ephemeral, from the first
 *                                             message) reads COUNT messages of STREAM's partition:
 *                                             the engine's ceiling for a reader
 *   nats_bench applied URL STREAM VALUES MS   waits (query by request-reply) until STREAM holds
 *                                             VALUES histogrammed values, up to MS ms
 *
 * Each prints one line "what seconds bytes GB/s". The fleet must exist (a worker started once).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <nats/nats.h>

#include "tally.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static tally_nats_t *producer(const char *url)
{
    tally_nats_opts_t o = {.servers = url, .timeout_ms = 30000, .window_bytes = 64u << 20};
    tally_nats_t *p = NULL;
    char why[256];
    if (tally_nats_new(&o, &p, why, sizeof why) != TALLY_OK) {
        fprintf(stderr, "nats_bench: %s\n", why);
        exit(1);
    }
    return p;
}

static void report(const char *what, double secs, double bytes)
{
    printf("%s %.3f %.0f %.3f\n", what, secs, bytes, bytes / secs / 1e9);
}

static int fill(const char *url, const char *stream, long count, size_t size)
{
    tally_nats_t *p = producer(url);
    uint8_t *data = malloc(size);
    for (size_t i = 0; i < size; i++)
        data[i] = (uint8_t)(i * 131 + (i >> 8));
    tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    tally_req_set_stream(&req, stream);
    double t0 = now_s();
    tally_status_t st = TALLY_OK;
    for (long i = 0; i < count && st == TALLY_OK; i++)
        st = tally_nats_send(p, &req, data, size, false, NULL, NULL);
    if (st == TALLY_OK)
        st = tally_nats_flush(p);
    double t1 = now_s();
    if (st != TALLY_OK)
        fprintf(stderr, "nats_bench: %s\n", tally_nats_error(p));
    else
        report("publish", t1 - t0, (double)count * (double)size);
    tally_nats_destroy(&p);
    free(data);
    return st == TALLY_OK ? 0 : 1;
}

static int bare(const char *url, const char *stream, long count)
{
    tally_nats_t *p = producer(url); /* for the partition count */
    char stream_name[32], subject[32];
    uint32_t k = tally_partition(stream, strlen(stream), tally_nats_partitions(p));
    snprintf(stream_name, sizeof stream_name, "TALLY_P%u", (unsigned)k);
    snprintf(subject, sizeof subject, "tally.in.%u", (unsigned)k);
    tally_nats_destroy(&p);
    natsConnection *nc = NULL;
    jsCtx *js = NULL;
    natsSubscription *sub = NULL;
    jsErrCode jerr = 0;
    jsSubOptions so;
    jsSubOptions_Init(&so);
    so.Stream = stream_name;
    so.Config.AckPolicy = js_AckNone;
    so.Config.DeliverPolicy = js_DeliverAll;
    if (natsConnection_ConnectTo(&nc, url) != NATS_OK ||
        natsConnection_JetStream(&js, nc, NULL) != NATS_OK ||
        js_PullSubscribe(&sub, js, subject, NULL, NULL, &so, &jerr) != NATS_OK) {
        fprintf(stderr, "nats_bench: %s\n", nats_GetLastError(NULL));
        return 1;
    }
    double t0 = now_s(), bytes = 0;
    long got = 0;
    while (got < count) {
        natsMsgList list;
        jsFetchRequest fr;
        jsFetchRequest_Init(&fr);
        fr.Batch = count - got < 256 ? (int)(count - got) : 256; /* the last fetch: no wait */
        fr.MaxBytes = 32 << 20; /* under libnats' 64 MiB pending limit, as the worker */
        fr.Expires = 5000000000ll;
        if (natsSubscription_FetchRequest(&list, sub, &fr) != NATS_OK)
            break;
        for (int i = 0; i < list.Count; i++)
            bytes += natsMsg_GetDataLength(list.Msgs[i]);
        got += list.Count;
        natsMsgList_Destroy(&list);
    }
    double t1 = now_s();
    report("bare-consumer", t1 - t0, bytes);
    natsSubscription_Destroy(sub);
    jsCtx_Destroy(js);
    natsConnection_Destroy(nc);
    return got >= count ? 0 : 1;
}

/* From the first answer showing values to the one showing all: the worker's applying rate once
 * it owns the partition (run-nats.sh also reports the rate from its start). */
static int applied(const char *url, const char *stream, uint64_t values, long ms)
{
    tally_nats_t *p = producer(url);
    double start = now_s(), t0 = 0;
    uint64_t v0 = 0;
    tally_stream_info_t info = {0};
    while ((now_s() - start) * 1000 < ms) {
        if (tally_nats_query(p, stream, &info) == TALLY_OK && info.hist_total > 0 && t0 == 0) {
            t0 = now_s();
            v0 = info.hist_total;
        }
        if (info.hist_total >= values)
            break;
        nats_Sleep(5);
    }
    double t1 = now_s();
    tally_nats_destroy(&p);
    if (info.hist_total < values) {
        fprintf(stderr, "nats_bench: %" PRIu64 " of %" PRIu64 " values after %ld ms\n",
                info.hist_total, values, ms);
        return 1;
    }
    report("worker-applied", t1 - t0, (double)(values - v0));
    return 0;
}

int main(int argc, char **argv)
{
    int rc = 2;
    if (argc == 6 && strcmp(argv[1], "fill") == 0)
        rc = fill(argv[2], argv[3], atol(argv[4]), (size_t)atol(argv[5]));
    else if (argc == 5 && strcmp(argv[1], "bare") == 0)
        rc = bare(argv[2], argv[3], atol(argv[4]));
    else if (argc == 6 && strcmp(argv[1], "applied") == 0)
        rc = applied(argv[2], argv[3], strtoull(argv[4], NULL, 10), atol(argv[5]));
    else
        fprintf(stderr, "usage: nats_bench fill|bare|applied URL STREAM ... (see the source)\n");
    nats_Close();
    return rc;
}
