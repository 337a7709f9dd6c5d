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
 * For a fleet of several workers (run-nats-fleet.sh), over per_part streams named PREFIX-<i> in
 * every partition (NATS_BENCH_STREAMS of them, default 4; chosen by tally_partition, so every
 * partition has the same work):
 *   nats_bench fleet-fill URL PREFIX COUNT SIZE [RATE]   COUNT requests, partition after
 *                                             partition in turn; RATE > 0: that many a second
 *   nats_bench bare-part URL K [FROM]         a bare pull consumer reads every message partition K
 *                                             holds from sequence FROM (default 1; run one per
 *                                             partition at once)
 *   nats_bench part-seqs URL                  "seqs S0 S1 ...": each partition's last sequence
 *   nats_bench bare-follow URL K MS           a bare durable (R3) consumer follows partition K's
 *                                             new messages for MS ms: "bare-gap K SECONDS COUNT",
 *                                             the longest wait between two messages
 *   nats_bench leader URL STREAM              the name of STREAM's leader (n<i>)
 *   nats_bench stored URL PREFIX PARTS        "stored BYTES MESSAGES": what the streams
 *                                             PREFIX0 .. PREFIX<PARTS-1> hold, in all (direct
 *                                             mode's changelogs, TALLY_CL: run-nats-direct.sh)
 *   nats_bench cl-ceiling URL PARTS SIZE DEPTH SECONDS   the broker's own ceiling for direct
 *                                             mode's changelog: messages of SIZE bytes published
 *                                             to tally.cl.<k> for k < PARTS, round the partitions,
 *                                             DEPTH in flight a partition, each expecting the
 *                                             last sequence before it and with a changelog
 *                                             message's headers (the committer's work, without
 *                                             tallyd): "cl-ceiling SECONDS BYTES GB/s MESSAGES"
 *   nats_bench fleet-applied URL PREFIX VALUES MS   waits until PREFIX's streams hold VALUES
 *   nats_bench failover URL PREFIX PID MS     a watcher per partition; once every partition
 *                                             applies, kill -9 PID (a worker, or a nats-server),
 *                                             then the pause: from the kill until each partition
 *                                             has gone past what it showed at the kill
 *                                             ("failover SECONDS" and per partition)
 *
 * Each prints one line "what seconds bytes GB/s". The fleet must exist (a worker started once).
 */
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <nats/nats.h>

#include "tally.h"
#include "tally_fleet.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static tally_nats_t *producer_t(const char *url, int timeout_ms)
{
    tally_nats_opts_t o = {.servers = url, .timeout_ms = timeout_ms, .window_bytes = 64u << 20};
    tally_nats_t *p = NULL;
    char why[256];
    if (tally_nats_new(&o, &p, why, sizeof why) != TALLY_OK) {
        fprintf(stderr, "nats_bench: %s\n", why);
        exit(1);
    }
    return p;
}

static tally_nats_t *producer(const char *url)
{
    return producer_t(url, 30000);
}

static void report(const char *what, double secs, double bytes)
{
    printf("%s %.3f %.0f %.3f\n", what, secs, bytes, bytes / secs / 1e9);
}

/* SIZE bytes of a fixed pattern: every request the same values. */
static uint8_t *pattern(size_t size)
{
    uint8_t *data = malloc(size);
    if (!data) {
        fprintf(stderr, "nats_bench: no memory for %zu bytes\n", size);
        exit(1);
    }
    for (size_t i = 0; i < size; i++)
        data[i] = (uint8_t)(i * 131 + (i >> 8));
    return data;
}

/* COUNT requests, message i on names[i % n]; rate > 0: that many a second. */
static int send_all(const char *url, const char *const *names, long n, long count, size_t size,
                    double rate)
{
    tally_nats_t *p = producer(url);
    uint8_t *data = pattern(size);
    tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    double t0 = now_s();
    tally_status_t st = TALLY_OK;
    for (long i = 0; i < count && st == TALLY_OK; i++) {
        tally_req_set_stream(&req, names[i % n]);
        while (rate > 0 && now_s() - t0 < i / rate)
            nats_Sleep(1);
        st = tally_nats_send(p, &req, data, size, false, NULL, NULL);
        for (int again = 0; again < 10 && st == TALLY_E_TIMEOUT; again++) /* a lost server */
            st = tally_nats_send(p, &req, data, size, false, NULL, NULL);
    }
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

static int fill(const char *url, const char *stream, long count, size_t size)
{
    return send_all(url, &stream, 1, count, size, 0);
}

/* A bare pull consumer of partition k: count messages, or (count < 0) all it holds now. */
static int bare_k(const char *url, uint32_t k, long count, uint64_t from);

static int bare(const char *url, const char *stream, long count)
{
    tally_nats_t *p = producer(url); /* for the partition count */
    uint32_t k = tally_partition(stream, strlen(stream), tally_nats_partitions(p));
    tally_nats_destroy(&p);
    return bare_k(url, k, count, 1);
}

/* A bare pull consumer of partition k (AckNone) on a connection of its own that reconnects for
 * ever: from sequence `from` (<= 1: the first), or (follow) from the next message published, as
 * a durable (replicated with its stream, so it outlives a lost server). 0, or 1 (said why). */
static int bare_subscribe(const char *url, uint32_t k, bool follow, uint64_t from,
                          natsConnection **nc, jsCtx **js, natsSubscription **sub)
{
    char stream_name[32], subject[32], durable[32], copy[1024];
    snprintf(stream_name, sizeof stream_name, "TALLY_P%u", (unsigned)k);
    snprintf(subject, sizeof subject, "tally.in.%u.*", (unsigned)k); /* every publisher */
    snprintf(durable, sizeof durable, "bench-follow-%u", (unsigned)k);
    jsErrCode jerr = 0;
    jsSubOptions so;
    jsSubOptions_Init(&so);
    so.Stream = stream_name;
    so.Config.AckPolicy = js_AckNone;
    so.Config.DeliverPolicy = follow     ? js_DeliverNew
                              : from > 1 ? js_DeliverByStartSequence
                                         : js_DeliverAll;
    so.Config.OptStartSeq = !follow && from > 1 ? from : 0;
    const char *servers[8];
    int ns = 0;
    snprintf(copy, sizeof copy, "%s", url);
    for (char *save = NULL, *u = strtok_r(copy, ",", &save); u && ns < 8;
         u = strtok_r(NULL, ",", &save))
        servers[ns++] = u;
    natsOptions *o = NULL;
    bool ok =
        natsOptions_Create(&o) == NATS_OK && natsOptions_SetServers(o, servers, ns) == NATS_OK &&
        natsOptions_SetMaxReconnect(o, -1) == NATS_OK &&
        natsOptions_SetReconnectWait(o, 250) == NATS_OK &&
        natsConnection_Connect(nc, o) == NATS_OK &&
        natsConnection_JetStream(js, *nc, NULL) == NATS_OK &&
        js_PullSubscribe(sub, *js, subject, follow ? durable : NULL, NULL, &so, &jerr) == NATS_OK;
    natsOptions_Destroy(o);
    if (!ok)
        fprintf(stderr, "nats_bench: %s\n", nats_GetLastError(NULL));
    return ok ? 0 : 1;
}

static int bare_k(const char *url, uint32_t k, long count, uint64_t from)
{
    char stream_name[32];
    snprintf(stream_name, sizeof stream_name, "TALLY_P%u", (unsigned)k);
    natsConnection *nc = NULL;
    jsCtx *js = NULL;
    natsSubscription *sub = NULL;
    jsErrCode jerr = 0;
    if (bare_subscribe(url, k, false, from, &nc, &js, &sub) != 0)
        return 1;
    if (count < 0) {
        jsStreamInfo *si = NULL;
        if (js_GetStreamInfo(&si, js, stream_name, NULL, &jerr) != NATS_OK) {
            fprintf(stderr, "nats_bench: %s\n", nats_GetLastError(NULL));
            return 1;
        }
        count =
            (long)(si->State.LastSeq + 1 - (from > si->State.FirstSeq ? from : si->State.FirstSeq));
        jsStreamInfo_Destroy(si);
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

static int part_seqs(const char *url)
{
    natsConnection *nc = NULL;
    jsCtx *js = NULL;
    tally_nats_t *p = producer(url);
    uint32_t parts = tally_nats_partitions(p);
    tally_nats_destroy(&p);
    if (natsConnection_ConnectTo(&nc, url) != NATS_OK ||
        natsConnection_JetStream(&js, nc, NULL) != NATS_OK)
        return 1;
    printf("seqs");
    for (uint32_t k = 0; k < parts; k++) {
        char name[32];
        snprintf(name, sizeof name, "TALLY_P%u", (unsigned)k);
        jsStreamInfo *si = NULL;
        jsErrCode jerr = 0;
        uint64_t last = 0;
        if (js_GetStreamInfo(&si, js, name, NULL, &jerr) == NATS_OK)
            last = si->State.LastSeq;
        jsStreamInfo_Destroy(si);
        printf(" %" PRIu64, last);
    }
    printf("\n");
    jsCtx_Destroy(js);
    natsConnection_Destroy(nc);
    return 0;
}

static int leader(const char *url, const char *stream)
{
    natsConnection *nc = NULL;
    jsCtx *js = NULL;
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    if (natsConnection_ConnectTo(&nc, url) != NATS_OK ||
        natsConnection_JetStream(&js, nc, NULL) != NATS_OK ||
        js_GetStreamInfo(&si, js, stream, NULL, &jerr) != NATS_OK || !si->Cluster ||
        !si->Cluster->Leader) {
        fprintf(stderr, "nats_bench: %s: %s\n", stream, nats_GetLastError(NULL));
        return 1;
    }
    printf("%s\n", si->Cluster->Leader);
    jsStreamInfo_Destroy(si);
    jsCtx_Destroy(js);
    natsConnection_Destroy(nc);
    return 0;
}

/* Connects to url as the user it names, with the inboxes _INBOX.<user> (contrib/nats/users.conf
 * lets each user read only its own), and its JetStream context (jo: NULL for the defaults). */
static int connect_as_user(const char *url, jsOptions *jo, natsConnection **nc, jsCtx **js)
{
    natsOptions *no = NULL;
    char inbox[96] = "";
    const char *user = strstr(url, "://"), *end = user ? strpbrk(user + 3, ":@") : NULL;
    if (end && *end && strchr(user, '@'))
        snprintf(inbox, sizeof inbox, "_INBOX.%.*s", (int)(end - user - 3), user + 3);
    if (natsOptions_Create(&no) != NATS_OK || natsOptions_SetURL(no, url) != NATS_OK ||
        (inbox[0] && natsOptions_SetCustomInboxPrefix(no, inbox) != NATS_OK) ||
        natsConnection_Connect(nc, no) != NATS_OK ||
        natsConnection_JetStream(js, *nc, jo) != NATS_OK) {
        fprintf(stderr, "nats_bench: %s\n", nats_GetLastError(NULL));
        natsOptions_Destroy(no);
        natsConnection_Destroy(*nc);
        *nc = NULL;
        return 1;
    }
    natsOptions_Destroy(no);
    return 0;
}

/* What streams prefix0 .. prefix<parts-1> hold (their stream info): bytes and messages. */
static int stored(const char *url, const char *prefix, uint32_t parts)
{
    natsConnection *nc = NULL;
    jsCtx *js = NULL;
    if (connect_as_user(url, NULL, &nc, &js) != 0)
        return 1;
    uint64_t bytes = 0, msgs = 0;
    for (uint32_t k = 0; k < parts; k++) {
        char name[64];
        snprintf(name, sizeof name, "%s%u", prefix, (unsigned)k);
        jsStreamInfo *si = NULL;
        jsErrCode jerr = 0;
        if (js_GetStreamInfo(&si, js, name, NULL, &jerr) == NATS_OK) {
            bytes += si->State.Bytes;
            msgs += si->State.Msgs;
        }
        jsStreamInfo_Destroy(si);
    }
    printf("stored %" PRIu64 " %" PRIu64 "\n", bytes, msgs);
    jsCtx_Destroy(js);
    natsConnection_Destroy(nc);
    return 0;
}

/* cl-ceiling's partitions: messages in flight and sent, the stream's last sequence at the
 * start, and the PubAcks' outcome, under one lock. */
#define CL_CEILING_PARTS_MAX 64
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cond;
    unsigned inflight[CL_CEILING_PARTS_MAX];
    uint64_t base[CL_CEILING_PARTS_MAX], sent[CL_CEILING_PARTS_MAX];
    uint64_t acked, failed;
} cl_ceiling_t;

static void cl_ceiling_ack(jsCtx *js, natsMsg *m, jsPubAck *pa, jsPubAckErr *pae, void *closure)
{
    (void)js;
    cl_ceiling_t *c = closure;
    unsigned long k = strtoul(natsMsg_GetSubject(m) + strlen(TALLY_NATS_SUBJ_CL), NULL, 10);
    pthread_mutex_lock(&c->mu);
    if (k < CL_CEILING_PARTS_MAX)
        c->inflight[k]--;
    if (pa && !pae)
        c->acked++;
    else
        c->failed++;
    pthread_cond_signal(&c->cond);
    pthread_mutex_unlock(&c->mu);
    natsMsg_Destroy(m);
}

static int cl_ceiling(const char *url, uint32_t parts, size_t size, unsigned depth, double secs)
{
    static cl_ceiling_t c = {.mu = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};
    natsConnection *nc = NULL;
    jsCtx *js = NULL;
    jsOptions jo;
    jsOptions_Init(&jo);
    jo.PublishAsync.MaxPending = (int64_t)parts * depth + 16;
    jo.PublishAsync.AckHandler = cl_ceiling_ack;
    jo.PublishAsync.AckHandlerClosure = &c;
    if (parts == 0 || parts > CL_CEILING_PARTS_MAX || depth == 0 ||
        connect_as_user(url, &jo, &nc, &js) != 0)
        return 1;
    for (uint32_t k = 0; k < parts; k++) {
        char name[32];
        snprintf(name, sizeof name, "TALLY_CL%u", (unsigned)k);
        jsStreamInfo *si = NULL;
        jsErrCode jerr = 0;
        if (js_GetStreamInfo(&si, js, name, NULL, &jerr) != NATS_OK) {
            fprintf(stderr, "nats_bench: %s: %s (a replicated member makes it)\n", name,
                    nats_GetLastError(NULL));
            return 1;
        }
        c.base[k] = si->State.LastSeq;
        jsStreamInfo_Destroy(si);
    }
    uint8_t *data = pattern(size);
    natsStatus s = NATS_OK;
    double t0 = now_s(), t1 = t0;
    for (uint32_t k = 0; s == NATS_OK && (t1 = now_s()) - t0 < secs; k = (k + 1) % parts) {
        pthread_mutex_lock(&c.mu);
        while (c.inflight[k] >= depth)
            pthread_cond_wait(&c.cond, &c.mu);
        uint64_t expect = c.base[k] + c.sent[k]++;
        c.inflight[k]++;
        pthread_mutex_unlock(&c.mu);
        char subject[32], num[24];
        snprintf(subject, sizeof subject, TALLY_NATS_SUBJ_CL "%u", (unsigned)k);
        snprintf(num, sizeof num, "%" PRIu64, c.sent[k]);
        natsMsg *m = NULL;
        jsPubOptions po;
        jsPubOptions_Init(&po);
        po.ExpectLastSeq = expect;
        s = natsMsg_Create(&m, subject, NULL, (const char *)data, (int)size);
        if (s == NATS_OK)
            s = natsMsgHeader_Set(m, TALLY_NATS_HDR_EPOCH, "1");
        if (s == NATS_OK)
            s = natsMsgHeader_Set(m, TALLY_NATS_HDR_BATCH, num);
        if (s == NATS_OK)
            s = natsMsgHeader_Set(m, TALLY_NATS_HDR_MEMBER, "cl-ceiling");
        if (s == NATS_OK)
            s = js_PublishMsgAsync(js, &m, &po);
        natsMsg_Destroy(m); /* NULL once published */
    }
    jsPubOptions po;
    jsPubOptions_Init(&po);
    po.MaxWait = 30000;
    if (s == NATS_OK)
        s = js_PublishAsyncComplete(js, &po);
    t1 = now_s();
    if (s != NATS_OK || c.failed)
        fprintf(stderr, "nats_bench: cl-ceiling: %s, %" PRIu64 " PubAcks failed\n",
                nats_GetLastError(NULL), c.failed);
    else
        printf("cl-ceiling %.3f %.0f %.3f %" PRIu64 "\n", t1 - t0, (double)c.acked * (double)size,
               (double)c.acked * (double)size / (t1 - t0) / 1e9, c.acked);
    free(data);
    jsCtx_Destroy(js);
    natsConnection_Destroy(nc);
    return s == NATS_OK && !c.failed ? 0 : 1;
}

/* A durable consumer (replicated with its stream, so it outlives a lost server) following
 * partition k's new messages for ms: the longest wait between two messages once they flow. */
static int bare_follow(const char *url, uint32_t k, long ms)
{
    natsConnection *nc = NULL;
    jsCtx *js = NULL;
    natsSubscription *sub = NULL;
    if (bare_subscribe(url, k, true, 0, &nc, &js, &sub) != 0)
        return 1;
    double start = now_s(), last = 0, gap = 0;
    long got = 0;
    while (now_s() - start < ms / 1000.0) {
        natsMsgList list;
        jsFetchRequest fr;
        jsFetchRequest_Init(&fr);
        fr.Batch = 256;
        fr.MaxBytes = 32 << 20;
        fr.Expires = 200000000ll;
        natsStatus s = natsSubscription_FetchRequest(&list, sub, &fr);
        if (s != NATS_OK && s != NATS_TIMEOUT) {
            nats_Sleep(50);
            continue;
        }
        if (s == NATS_OK && list.Count > 0) {
            double t = now_s();
            if (last > 0 && t - last > gap)
                gap = t - last;
            last = t;
            got += list.Count;
        }
        natsMsgList_Destroy(&list);
    }
    printf("bare-gap %u %.3f %ld\n", (unsigned)k, gap, got);
    natsSubscription_Unsubscribe(sub); /* the durable goes with it */
    natsSubscription_Destroy(sub);
    jsCtx_Destroy(js);
    natsConnection_Destroy(nc);
    return 0;
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

/* ---- a fleet of several workers (run-nats-fleet.sh) ---- */

enum { MAX_PER_PART = 64, MAX_PARTS = 64 };
/* Streams per partition: NATS_BENCH_STREAMS (1 to MAX_PER_PART), 4 without it (main). */
static uint32_t per_part = 4;

typedef struct {
    uint32_t parts;
    char name[MAX_PARTS * MAX_PER_PART][64]; /* partition after partition: [k * per_part + j] */
} names_t;

/* per_part stream names PREFIX-<i> for each partition, the first ones tally_partition puts
 * there, so every partition has the same work. */
static void fleet_names(const char *url, const char *prefix, names_t *n)
{
    tally_nats_t *p = producer(url);
    n->parts = tally_nats_partitions(p);
    tally_nats_destroy(&p);
    if (n->parts == 0 || n->parts > MAX_PARTS) {
        fprintf(stderr, "nats_bench: %u partitions (at most %d here)\n", n->parts, MAX_PARTS);
        exit(1);
    }
    uint32_t have[MAX_PARTS] = {0};
    uint32_t left = n->parts * per_part;
    for (long i = 0; left > 0; i++) {
        char s[64];
        snprintf(s, sizeof s, "%s-%ld", prefix, i);
        uint32_t k = tally_partition(s, strlen(s), n->parts);
        if (have[k] < per_part) {
            snprintf(n->name[k * per_part + have[k]++], sizeof n->name[0], "%s", s);
            left--;
        }
    }
}

static int fleet_fill(const char *url, const char *prefix, long count, size_t size, double rate)
{
    static names_t n;
    static const char *order[MAX_PARTS * MAX_PER_PART];
    fleet_names(url, prefix, &n);
    for (uint32_t j = 0; j < per_part; j++) /* partition after partition in turn */
        for (uint32_t k = 0; k < n.parts; k++)
            order[j * n.parts + k] = n.name[k * per_part + j];
    return send_all(url, order, (long)n.parts * per_part, count, size, rate);
}

/* The values partition k's streams hold; 0 with no answer (no owner yet: no responders). */
static uint64_t part_values(tally_nats_t *p, const names_t *n, uint32_t k, bool *answered)
{
    uint64_t sum = 0;
    *answered = true;
    for (uint32_t j = 0; j < per_part; j++) {
        tally_stream_info_t info = {0};
        tally_status_t st = tally_nats_query(p, n->name[k * per_part + j], &info);
        if (st == TALLY_OK)
            sum += info.hist_total;
        else if (st != TALLY_E_UNKNOWN_STREAM) /* a stream not applied yet is unknown */
            *answered = false;
    }
    return sum;
}

static int fleet_applied(const char *url, const char *prefix, uint64_t values, long ms)
{
    static names_t n;
    fleet_names(url, prefix, &n);
    tally_nats_t *p = producer_t(url, 1000);
    double start = now_s(), t0 = 0;
    uint64_t v0 = 0, sum = 0;
    while ((now_s() - start) * 1000 < ms && sum < values) {
        sum = 0;
        for (uint32_t k = 0; k < n.parts; k++) {
            bool answered;
            sum += part_values(p, &n, k, &answered);
        }
        if (sum > 0 && t0 == 0) {
            t0 = now_s();
            v0 = sum;
        }
        nats_Sleep(5);
    }
    double t1 = now_s();
    tally_nats_destroy(&p);
    if (sum < values) {
        fprintf(stderr, "nats_bench: %" PRIu64 " of %" PRIu64 " values after %ld ms\n", sum, values,
                ms);
        return 1;
    }
    report("fleet-applied", t1 - t0, (double)(values - v0));
    printf("fleet-applied-from-start %.3f %.0f %.3f\n", t1 - start, (double)values,
           values / (t1 - start) / 1e9);
    return 0;
}

/* A query waits this long for its partition's owner: the owner of a live partition answers in
 * a few milliseconds, and a partition between owners is asked again at once after it. The
 * watcher's resolution is one such wait (issue 32: four queries of 300 ms in turn, all needed,
 * added up to 1.2 s to a take-over's figure). */
#define WATCH_QUERY_MS 100

typedef struct {
    const char *url;
    const names_t *n;
    uint32_t k;
    double deadline;
    _Atomic double *kill_at; /* 0 until the kill */
    uint64_t last[MAX_PER_PART]; /* each stream's last value answered by a query sent before it */
    double back;             /* when one of them went past it after the kill; 0: not yet */
    _Atomic int progressed;  /* it has shown values */
} watch_t;

/* Asks the partition's streams in turn; after the kill, the partition is back as soon as any of
 * its streams shows more than it did at the kill (each stream on its own, so a stream whose
 * query timed out during the take-over does not hold the others' answers back). */
static void *watch(void *arg)
{
    watch_t *w = arg;
    tally_nats_t *p = producer_t(w->url, WATCH_QUERY_MS);
    for (uint32_t j = 0; now_s() < w->deadline && w->back == 0; j = (j + 1) % per_part) {
        double before = now_s();
        tally_stream_info_t info = {0};
        tally_status_t st = tally_nats_query(p, w->n->name[w->k * per_part + j], &info);
        if (st != TALLY_OK || info.hist_total <= w->last[j]) {
            if (j == per_part - 1)
                nats_Sleep(st == TALLY_OK ? 10 : 0);
            continue;
        }
        double ka = atomic_load(w->kill_at);
        if (ka == 0 || before < ka) {
            w->last[j] = info.hist_total;
            atomic_store(&w->progressed, 1);
        } else {
            w->back = now_s();
        }
    }
    tally_nats_destroy(&p);
    return NULL;
}

static int failover(const char *url, const char *prefix, pid_t pid, long ms)
{
    static names_t n;
    fleet_names(url, prefix, &n);
    static watch_t w[MAX_PARTS];
    pthread_t th[MAX_PARTS];
    _Atomic double kill_at = 0;
    double start = now_s();
    for (uint32_t k = 0; k < n.parts; k++) {
        w[k] = (watch_t){
            .url = url, .n = &n, .k = k, .deadline = start + ms / 1000.0, .kill_at = &kill_at};
        pthread_create(&th[k], NULL, watch, &w[k]);
    }
    for (uint32_t k = 0; k < n.parts && now_s() - start < ms / 2000.0; k++)
        while (!atomic_load(&w[k].progressed) && now_s() - start < ms / 2000.0)
            nats_Sleep(10);
    nats_Sleep(1000);     /* steady: every partition applying for a second */
    struct timespec wall; /* the kill on the logs' clock, to line them up (run-nats-fleet.sh) */
    clock_gettime(CLOCK_REALTIME, &wall);
    atomic_store(&kill_at, now_s());
    kill(pid, SIGKILL);
    printf("killed-at %.3f\n", (double)wall.tv_sec + wall.tv_nsec / 1e9);
    int rc = 0;
    double worst = 0;
    for (uint32_t k = 0; k < n.parts; k++) {
        pthread_join(th[k], NULL);
        if (w[k].back == 0) {
            printf("partition %u applies no more after %.1f s\n", k, now_s() - kill_at);
            rc = 1;
            continue;
        }
        double pause = w[k].back - kill_at;
        printf("partition %u: %.3f s\n", k, pause);
        if (pause > worst)
            worst = pause;
    }
    if (rc == 0)
        printf("failover %.3f\n", worst);
    return rc;
}

int main(int argc, char **argv)
{
    int rc = 2;
    const char *streams = getenv("NATS_BENCH_STREAMS");
    if (streams) {
        long v = atol(streams);
        if (v < 1 || v > MAX_PER_PART) {
            fprintf(stderr, "nats_bench: NATS_BENCH_STREAMS is 1 to %d\n", MAX_PER_PART);
            return 2;
        }
        per_part = (uint32_t)v;
    }
    if (argc == 6 && strcmp(argv[1], "fill") == 0)
        rc = fill(argv[2], argv[3], atol(argv[4]), (size_t)atol(argv[5]));
    else if (argc == 5 && strcmp(argv[1], "bare") == 0)
        rc = bare(argv[2], argv[3], atol(argv[4]));
    else if (argc == 6 && strcmp(argv[1], "applied") == 0)
        rc = applied(argv[2], argv[3], strtoull(argv[4], NULL, 10), atol(argv[5]));
    else if ((argc == 6 || argc == 7) && strcmp(argv[1], "fleet-fill") == 0)
        rc = fleet_fill(argv[2], argv[3], atol(argv[4]), (size_t)atol(argv[5]),
                        argc == 7 ? atof(argv[6]) : 0);
    else if ((argc == 4 || argc == 5) && strcmp(argv[1], "bare-part") == 0)
        rc = bare_k(argv[2], (uint32_t)atol(argv[3]), -1,
                    argc == 5 ? strtoull(argv[4], NULL, 10) : 1);
    else if (argc == 3 && strcmp(argv[1], "part-seqs") == 0)
        rc = part_seqs(argv[2]);
    else if (argc == 5 && strcmp(argv[1], "bare-follow") == 0)
        rc = bare_follow(argv[2], (uint32_t)atol(argv[3]), atol(argv[4]));
    else if (argc == 4 && strcmp(argv[1], "leader") == 0)
        rc = leader(argv[2], argv[3]);
    else if (argc == 5 && strcmp(argv[1], "stored") == 0)
        rc = stored(argv[2], argv[3], (uint32_t)atol(argv[4]));
    else if (argc == 7 && strcmp(argv[1], "cl-ceiling") == 0)
        rc = cl_ceiling(argv[2], (uint32_t)atol(argv[3]), (size_t)atol(argv[4]),
                        (unsigned)atol(argv[5]), atof(argv[6]));
    else if (argc == 6 && strcmp(argv[1], "fleet-applied") == 0)
        rc = fleet_applied(argv[2], argv[3], strtoull(argv[4], NULL, 10), atol(argv[5]));
    else if (argc == 6 && strcmp(argv[1], "failover") == 0)
        rc = failover(argv[2], argv[3], (pid_t)atol(argv[4]), atol(argv[5]));
    else
        fprintf(stderr,
                "usage: nats_bench fill|bare|applied|fleet-fill|bare-part|fleet-applied|failover "
                "URL STREAM ... (see the source)\n");
    nats_Close();
    return rc;
}
