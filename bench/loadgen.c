/* SPDX-License-Identifier: Apache-2.0 */
/*
 * loadgen.c — tallyd's end-to-end load generator, and the ZeroMQ echo server it is compared to.
 *
 *   loadgen --endpoint EP | --fleet NATS_URL --op filter|scan|hist [--size B] [--producers N]
 *           [--window W]
 *           [--seconds S | --count C] [--stream | --streams K] [--scan-i32] [--shm | --shm-out]
 *           [--send copy|zc] [--pid PID] [--label TEXT] [--server-key KEY|FILE --client-key FILE]
 *   loadgen [--echo-key FILE] [--echo-reply BYTES] [--echo-io-threads N] [--echo-touch N]
 *           [--echo-fronts] --serve-echo EP [EP...]
 *
 * Producers are threads, each with its own libtally client (one DEALER socket) keeping W
 * requests in flight with tally_send/tally_recv, so the numbers include exactly what a real
 * producer pays: encoding, ZeroMQ both ways, tallyd, and the reply's decoding.
 *
 * The echo server is the transport ceiling: a ROUTER socket that sends every request's payload
 * frame straight back (zero copy) behind a reply header naming the request id, so the very same
 * client code path (tally_recv decodes a valid reply) measures it. `--op echo` sends to it.
 * --echo-reply BYTES makes it answer every request with BYTES zero bytes instead (2048: a
 * histogram's reply), so it is the raw transport under tallyd's hist load for the very same
 * producers (bench/run-recv-ab.sh); --echo-io-threads N gives it N ZeroMQ I/O threads (default
 * 1); --echo-touch N hands every received payload to one of N threads that copies it into a
 * buffer of its own and frees it, as tallyd's lane threads copy payloads into pinned staging
 * (the reply does not wait for it): the raw transport with tallyd's memory traffic and none of
 * its code. Otherwise request and reply are the same size; note that a scan's reply is twice its
 * request (int64 sums of int32 input) unless --scan-i32, so its transport work is 1.5x the echo's.
 *
 * --endpoint EP0,EP1,... spreads the producers over several endpoints: producer p connects to
 * EP(p mod n) (tallyd's bind and its fronts, `front` in tallyd.conf; the echo's with
 * --echo-fronts). --echo-fronts gives the echo server a ROUTER socket and a thread per endpoint,
 * in one context, as tallyd's fronts have (without it one socket is bound to every endpoint and
 * served by one thread), so the two compare like with like (bench/NOTES.md, "Several fronts").
 *
 * --streams K names K streams (loadgen/s0 .. loadgen/sK-1) and sends request i of every producer
 * on stream i mod K (--stream: one stream per producer, loadgen/P), so the requests spread over
 * tallyd's shards (issue 31: a stream's shard is tally_partition(name, shards)); then a line
 * after the row gives the requests answered per second on each shard, the shard count taken from
 * tallyd's `info`, so an imbalance between shards shows.
 *
 * --fleet NATS_URL: each producer is a client of a fleet in direct mode (tally_client_new_fleet,
 * PROTOCOL.md §13 "Direct mode") instead of one tallyd: every request goes over ZeroMQ straight to
 * the member owning its stream's partition, so --streams K (K well above the partitions) spreads
 * every producer's requests over every member. The per-shard line is then per partition (the
 * partition count from partition 0's owner's `info`), so an imbalance between members shows.
 * Shared-memory regions are refused by that client (--shm with --fleet is an error).
 *
 * --send zc sends each payload with tally_send_zc, straight from the one payload buffer (ZeroMQ
 * calls a no-op free function when it has sent it), instead of tally_send's copy into a new
 * message: the producers of bench/fanin do the same, so the two compare tallyd with the raw
 * transport for one producer code path (bench/NOTES.md).
 *
 * --shm: each producer registers a shared-memory region (tally_region_create) holding the
 * payload once, and every request references it (tally_send_shm) instead of carrying it: the
 * data path of PROTOCOL.md §10, the GPU copying straight from the region. --shm-out also gives
 * filter and scan an output range per window slot, so the replies carry only their headers.
 *
 * CURVE (PROTOCOL.md §12): --server-key and --client-key make every producer a CURVE client
 * (tally_curve_keys_load, tally_client_new_curve); --echo-key FILE (a `tally keygen` .key) makes
 * the echo server a CURVE server (no ZAP handler: any client key), so bench/run-curve.sh can put
 * CURVE's cost beside the plain runs, for tallyd and for the transport ceiling alike.
 *
 * Output: one markdown table row per run (see BENCH_ROW_HEADER), the throughput counting request
 * payload bytes only, latency from tally_send to the reply, over every request answered in the
 * measured interval (after WARMUP_S). Exit status 1 if any request failed or went unanswered.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "bench_util.h"

#include "tally.h"
#include "tally_proto.h" /* the echo peer speaks the wire protocol directly */
#include "tally_keys.h"

#define WARMUP_S 0.3
#define MAX_WINDOW 1024
#define MAX_PRODUCERS 64
#define TIMEOUT_MS 30000
#define MAX_ENDPOINTS 8
#define MAX_STREAMS 4096
#define MAX_SHARDS 64

typedef struct {
    bench_opts_t c; /* --endpoint --label --size --producers --window --seconds --header */
    const char *op;
    uint64_t count; /* per producer; 0 = by time */
    bool stream;
    unsigned streams;          /* --streams K: 0 = off */
    unsigned shards;           /* tallyd's, from `info` (--streams only) */
    uint16_t *shard_of_stream; /* the shard of each of the K streams */
    bool scan_i32;
    bool shm;          /* input by shared-memory reference */
    bool shm_out;      /* and output into the region (filter, scan) */
    bool send_zc;      /* --send zc: tally_send_zc from the shared payload */
    const char *fleet; /* --fleet NATS_URL: a direct-mode fleet client per producer */
    int pid;
    tally_curve_keys_t curve; /* server_public "" = no CURVE */
    char *endpoints[MAX_ENDPOINTS]; /* --endpoint EP0,EP1,...: producer p connects to p mod n */
    unsigned endpoint_count;
} opts_t;

typedef struct {
    const opts_t *o;
    unsigned index;
    double origin; /* when the first producer started (--stagger-ms) */
    const void *payload;
    pthread_t thread;
    /* results */
    uint64_t sent, answered, errors, measured;
    uint64_t bytes;
    uint64_t per_shard[MAX_SHARDS]; /* --streams: measured replies by the shard of their stream */
    double *lat_us;                 /* measured latencies */
    size_t lat_cap;
    double t_start, t_end; /* measured interval */
    char error[256];
} producer_t;

static tally_req_t make_req(const opts_t *o, unsigned producer)
{
    tally_req_t req;
    memset(&req, 0, sizeof req);
    req.version = TALLY_PROTO_VERSION;
    if (strcmp(o->op, "filter") == 0) {
        req.opcode = TALLY_OP_FILTER;
        req.dtype = TALLY_DTYPE_I32;
        req.pred = TALLY_PRED_GT;
        req.lo = 0;
    } else if (strcmp(o->op, "scan") == 0) {
        req.opcode = TALLY_OP_SCAN;
        req.dtype = TALLY_DTYPE_I32;
        req.flags = o->scan_i32 ? TALLY_FLAG_SCAN_OUT_I32 : 0;
    } else if (strcmp(o->op, "hist") == 0) {
        req.opcode = TALLY_OP_HIST;
        req.dtype = TALLY_DTYPE_U8;
    } else { /* echo: any valid request; the echo server does not look at it */
        req.opcode = TALLY_OP_HIST;
        req.dtype = TALLY_DTYPE_U8;
    }
    if (o->stream) {
        char name[32];
        snprintf(name, sizeof name, "loadgen/%u", producer);
        tally_req_set_stream(&req, name);
    }
    return req;
}

/* A failure of the producer's own (connect, send, recv): counted, and the one reported. */
static void producer_error(producer_t *p, const char *what, const char *why)
{
    snprintf(p->error, sizeof p->error, "%s: %.200s", what, why);
    p->errors++;
}

/* A client of the tallyd at --endpoint, or (--fleet) of the fleet's owners. */
static tally_status_t client_new(const opts_t *o, unsigned producer, tally_client_t **c, char *why,
                                 size_t why_cap)
{
    if (o->fleet) {
        tally_nats_opts_t n = {.servers = o->fleet, .timeout_ms = TIMEOUT_MS};
        return tally_client_new_fleet(&n, c, why, why_cap);
    }
    const char *endpoint = o->endpoints[producer % o->endpoint_count];
    tally_status_t st = tally_client_new_curve(endpoint, TIMEOUT_MS, &o->curve, c);
    snprintf(why, why_cap, "%s", tally_status_text(st));
    return st;
}

/* Connects, and with --shm creates the producer's region: the payload, then (--shm-out) one
 * output slice per request in flight, *out_slice bytes each. False (error noted) on failure. */
static bool producer_connect(producer_t *p, const tally_req_t *req, tally_client_t **c,
                             tally_region_t **region, size_t *out_slice)
{
    const opts_t *o = p->o;
    char why[256];
    tally_status_t st = client_new(o, p->index, c, why, sizeof why);
    if (st != TALLY_OK) {
        producer_error(p, "connect", why);
        return false;
    }
    *out_slice = o->shm_out ? (o->scan_i32 || req->opcode != TALLY_OP_SCAN ? 1 : 2) * o->c.size : 0;
    if (!o->shm)
        return true;
    st = tally_region_create(*c, o->c.size + (size_t)o->c.window * *out_slice, region);
    if (st != TALLY_OK) {
        producer_error(p, "region", tally_client_error(*c));
        tally_client_destroy(c);
        return false;
    }
    memcpy(tally_region_data(*region), p->payload, o->c.size);
    return true;
}

/* One reply received at t: counted, and measured inside the interval. */
static void producer_note_reply(producer_t *p, tally_status_t st, const tally_reply_t *reply,
                                double t, double t_stop, const double *sent_at,
                                const uint16_t *stream_at)
{
    p->answered++;
    if (st != TALLY_OK) { /* counted; reported only when nothing else failed before */
        if (!p->error[0])
            snprintf(p->error, sizeof p->error, "reply: %.200s", reply->error);
        p->errors++;
    }
    if (t >= p->t_start && (p->o->count || t < t_stop)) {
        double lat = (t - sent_at[reply->rep.request_id % (MAX_WINDOW * 4)]) * 1e6;
        if (p->measured < p->lat_cap)
            p->lat_us[p->measured] = lat;
        p->measured++;
        p->bytes += p->o->c.size;
        p->t_end = t;
        if (p->o->streams)
            p->per_shard
                [p->o->shard_of_stream[stream_at[reply->rep.request_id % (MAX_WINDOW * 4)]]]++;
    }
}

/* --streams: request i of a producer goes on stream i mod K. */
static void name_stream(tally_req_t *req, unsigned k)
{
    char name[32];
    snprintf(name, sizeof name, "loadgen/s%u", k);
    tally_req_set_stream(req, name);
}

/* --send zc's free function: the payload is run()'s, freed after every producer has joined. */
static void keep_payload(void *data, void *hint)
{
    (void)data;
    (void)hint;
}

static void *producer_main(void *arg)
{
    producer_t *p = arg;
    const opts_t *o = p->o;
    tally_client_t *c = NULL;
    tally_region_t *region = NULL;
    size_t out_slice = 0;
    double sent_at[MAX_WINDOW * 4];
    uint16_t stream_at[MAX_WINDOW * 4]; /* --streams: the stream of each request in flight */
    tally_req_t req = make_req(o, p->index);
    double warmup_from = bench_stagger(&o->c, p->index, p->origin);
    if (!producer_connect(p, &req, &c, &region, &out_slice))
        return NULL;
    tally_reply_t reply;
    tally_reply_init(&reply);
    double t0 = fmax(bench_now_s(), warmup_from);
    p->t_start = t0 + WARMUP_S;
    double t_stop = t0 + WARMUP_S + o->c.seconds;
    uint64_t inflight = 0;
    bool sending = true;
    tally_status_t st;
    while (sending || inflight) {
        while (sending && inflight < o->c.window) {
            uint64_t id = 0;
            unsigned k = o->streams ? (unsigned)((p->sent + p->index) % o->streams) : 0;
            if (o->streams)
                name_stream(&req, k);
            if (region) /* output slices by send count: a benchmark ignores their contents */
                st = tally_send_shm(c, &req, region, 0, o->c.size, out_slice ? region : NULL,
                                    o->c.size + (size_t)(p->sent % o->c.window) * out_slice, &id);
            else if (o->send_zc) /* the buffer outlives every send: nothing to free */
                st = tally_send_zc(c, &req, (void *)p->payload, o->c.size, keep_payload, NULL, &id);
            else
                st = tally_send(c, &req, p->payload, o->c.size, &id);
            if (st != TALLY_OK) {
                producer_error(p, "send", tally_client_error(c));
                sending = false;
                break;
            }
            sent_at[id % (MAX_WINDOW * 4)] = bench_now_s();
            stream_at[id % (MAX_WINDOW * 4)] = (uint16_t)k;
            p->sent++;
            inflight++;
        }
        if (!inflight)
            break;
        st = tally_recv(c, &reply);
        double t = bench_now_s();
        if (st == TALLY_E_TIMEOUT || st == TALLY_E_TRANSPORT) {
            producer_error(p, "recv", tally_client_error(c));
            break;
        }
        inflight--;
        producer_note_reply(p, st, &reply, t, t_stop, sent_at, stream_at);
        if (o->count ? p->sent >= o->count : t >= t_stop)
            sending = false;
    }
    tally_reply_clear(&reply);
    tally_region_destroy(&region);
    tally_client_destroy(&c);
    return NULL;
}

/* --streams: the requests answered per second on each of tallyd's shards. */
static void print_per_shard(const opts_t *o, const producer_t *ps, double span)
{
    if (!o->streams)
        return;
    printf("per %s (%u %ss, %u streams), req/s:", o->fleet ? "partition" : "shard", o->shards,
           o->fleet ? "partition" : "shard", o->streams);
    for (unsigned sh = 0; sh < o->shards; sh++) {
        uint64_t n = 0;
        for (unsigned i = 0; i < o->c.producers; i++)
            n += ps[i].per_shard[sh];
        printf(" %.0f", (double)n / span);
    }
    printf("\n");
}

/* --streams: tallyd's shard count (its `info`; 1 when it does not say), or with --fleet the
 * fleet's partitions, and each stream's shard or partition (tally_partition: the same FNV-1a 64
 * modulo the count as tallyd's, PROTOCOL.md §5 `info`). */
static bool setup_streams(opts_t *o)
{
    o->shards = 1;
    tally_client_t *c = NULL;
    char *text = NULL, why[256];
    const char *key = o->fleet ? "\nnats_partitions=" : "\nshards=";
    if (client_new(o, 0, &c, why, sizeof why) == TALLY_OK &&
        tally_info(c, TALLY_OP_INFO, &text) == TALLY_OK) {
        const char *at = strstr(text, key);
        unsigned n = at ? (unsigned)strtoul(at + strlen(key), NULL, 10) : 1;
        o->shards = n >= 1 && n <= MAX_SHARDS ? n : 1;
    }
    free(text);
    tally_client_destroy(&c);
    o->shard_of_stream = calloc(o->streams, sizeof *o->shard_of_stream);
    for (unsigned k = 0; o->shard_of_stream && k < o->streams; k++) {
        char name[32];
        snprintf(name, sizeof name, "loadgen/s%u", k);
        o->shard_of_stream[k] = (uint16_t)tally_partition(name, strlen(name), o->shards);
    }
    return o->shard_of_stream != NULL;
}

static int run(const opts_t *o)
{
    uint8_t *payload = malloc(o->c.size ? o->c.size : 1);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < o->c.size; i++) { /* xorshift bytes: int32 of both signs */
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        payload[i] = (uint8_t)x;
    }
    producer_t ps[MAX_PRODUCERS];
    memset(ps, 0, sizeof ps);
    double origin = bench_now_s();
    for (unsigned i = 0; i < o->c.producers; i++) {
        ps[i].o = o;
        ps[i].index = i;
        ps[i].origin = origin;
        ps[i].payload = payload;
        ps[i].lat_cap = 4u << 20;
        ps[i].lat_us = malloc(ps[i].lat_cap * sizeof(double));
        pthread_create(&ps[i].thread, NULL, producer_main, &ps[i]);
    }
    uint64_t sent = 0, answered = 0, errors = 0, measured = 0, bytes = 0;
    double t_start = 1e300, t_end = 0;
    for (unsigned i = 0; i < o->c.producers; i++) {
        pthread_join(ps[i].thread, NULL);
        sent += ps[i].sent;
        answered += ps[i].answered;
        errors += ps[i].errors;
        bytes += ps[i].bytes;
        measured += ps[i].measured < ps[i].lat_cap ? ps[i].measured : ps[i].lat_cap;
        if (ps[i].t_start < t_start)
            t_start = ps[i].t_start;
        if (ps[i].t_end > t_end)
            t_end = ps[i].t_end;
        if (ps[i].error[0])
            fprintf(stderr, "loadgen: producer %u: %s\n", i, ps[i].error);
    }
    double *all = malloc((measured ? measured : 1) * sizeof(double));
    size_t k = 0;
    for (unsigned i = 0; i < o->c.producers; i++) {
        size_t m = ps[i].measured < ps[i].lat_cap ? ps[i].measured : ps[i].lat_cap;
        memcpy(all + k, ps[i].lat_us, m * sizeof(double));
        k += m;
        free(ps[i].lat_us);
    }
    qsort(all, measured, sizeof *all, bench_cmp_double);
    double span = t_end > t_start ? t_end - t_start : NAN;
    double hwm = o->pid > 0 ? (double)bench_proc_kib(o->pid, "VmHWM") / 1024.0 : NAN;
    if (o->c.header)
        printf(BENCH_ROW_HEADER);
    char size[32];
    bench_size_label(o->c.size, size, sizeof size);
    printf("| %s | %s%s%s | %s | %u x %u | %.0f | %.3f | %.1f | %.1f | %.1f | %" PRIu64 "/%" PRIu64
           " | %" PRIu64 " | %.0f |\n",
           o->c.label, o->op, o->scan_i32 ? " (i32 out)" : "", o->send_zc ? " (zc)" : "", size,
           o->c.producers, o->c.window, (double)measured / span, (double)bytes / span / 1e9,
           bench_percentile(all, measured, 0.50), bench_percentile(all, measured, 0.99),
           bench_percentile(all, measured, 0.999), answered, sent, errors, hwm);
    print_per_shard(o, ps, span);
    fflush(stdout);
    free(all);
    free(payload);
    return errors || answered != sent ? 1 : 0;
}

/* ---- the echo server ------------------------------------------------------------------------ */

/* --echo-touch: payloads (references to the received frames) waiting for a touch thread. */
#define TOUCH_QUEUE 64

#define TOUCH_THREADS_MAX 16

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t work; /* a payload queued, or stop */
    pthread_cond_t room; /* the queue has room */
    zmq_msg_t queue[TOUCH_QUEUE];
    unsigned head, count;
    bool stop;
    pthread_t threads[TOUCH_THREADS_MAX];
    unsigned thread_count;
} touch_t;

static void *touch_main(void *arg)
{
    touch_t *t = arg;
    void *staging = NULL;
    size_t cap = 0;
    pthread_mutex_lock(&t->lock);
    for (;;) {
        while (!t->count && !t->stop)
            pthread_cond_wait(&t->work, &t->lock);
        if (!t->count)
            break;
        zmq_msg_t m;
        zmq_msg_init(&m);
        zmq_msg_move(&m, &t->queue[t->head]);
        zmq_msg_close(&t->queue[t->head]);
        t->head = (t->head + 1) % TOUCH_QUEUE;
        t->count--;
        pthread_cond_signal(&t->room);
        pthread_mutex_unlock(&t->lock);
        size_t n = zmq_msg_size(&m);
        if (n > cap) {
            free(staging);
            staging = malloc(n);
            cap = staging ? n : 0;
        }
        if (staging)
            memcpy(staging, zmq_msg_data(&m), n);
        zmq_msg_close(&m); /* the received buffer is freed here, as a lane frees it */
        pthread_mutex_lock(&t->lock);
    }
    pthread_mutex_unlock(&t->lock);
    free(staging);
    return NULL;
}

/* Queues a reference to payload for a touch thread (waits while the queue is full). */
static void touch_push(touch_t *t, zmq_msg_t *payload)
{
    pthread_mutex_lock(&t->lock);
    while (t->count == TOUCH_QUEUE)
        pthread_cond_wait(&t->room, &t->lock);
    zmq_msg_t *slot = &t->queue[(t->head + t->count) % TOUCH_QUEUE];
    zmq_msg_init(slot);
    zmq_msg_copy(slot, payload);
    t->count++;
    pthread_cond_signal(&t->work);
    pthread_mutex_unlock(&t->lock);
}

/* Starts up to n touch threads (TOUCH_THREADS_MAX at most); returns how many run. */
static unsigned touch_start(touch_t *t, unsigned n)
{
    for (unsigned i = 0; i < n && i < TOUCH_THREADS_MAX; i++)
        if (pthread_create(&t->threads[t->thread_count], NULL, touch_main, t) == 0)
            t->thread_count++;
    return t->thread_count;
}

/* Lets the touch threads finish the queue, and joins them. */
static void touch_stop(touch_t *t)
{
    pthread_mutex_lock(&t->lock);
    t->stop = true;
    pthread_cond_broadcast(&t->work);
    pthread_mutex_unlock(&t->lock);
    for (unsigned i = 0; i < t->thread_count; i++)
        pthread_join(t->threads[i], NULL);
}

static volatile sig_atomic_t echo_stop;

static void on_signal(int sig)
{
    (void)sig;
    echo_stop = 1;
}

/* One echo socket and what its thread needs. */
typedef struct {
    void *sock;
    touch_t *touch;
    unsigned touch_threads;
    const void *reply;
    size_t reply_bytes;
    pthread_t thread;
} echo_t;

/* Answers every request on e->sock until a signal (its receive timeout looks at echo_stop). */
static void *echo_loop(void *arg)
{
    echo_t *e = arg;
    while (!echo_stop) {
        zmq_msg_t id, header, payload;
        zmq_msg_init(&id);
        if (zmq_msg_recv(&id, e->sock, 0) < 0) {
            zmq_msg_close(&id);
            continue;
        }
        zmq_msg_init(&header);
        zmq_msg_init(&payload);
        zmq_msg_recv(&header, e->sock, 0);
        zmq_msg_recv(&payload, e->sock, 0);
        if (e->touch_threads)
            touch_push(e->touch, &payload);
        tally_req_t req;
        tally_rep_t rep;
        memset(&rep, 0, sizeof rep);
        char msg[64];
        if (tally_req_decode(zmq_msg_data(&header), zmq_msg_size(&header), &req, msg, sizeof msg) ==
            TALLY_OK) {
            rep.version = TALLY_PROTO_VERSION;
            rep.opcode = req.opcode;
            rep.request_id = req.request_id;
            rep.status = TALLY_OK;
            rep.dtype = TALLY_DTYPE_U8;
            rep.count = e->reply ? e->reply_bytes : zmq_msg_size(&payload);
        }
        uint8_t out[TALLY_REP_HEADER_SIZE];
        tally_rep_encode(&rep, out);
        zmq_msg_send(&id, e->sock, ZMQ_SNDMORE);
        zmq_send(e->sock, out, sizeof out, ZMQ_SNDMORE);
        if (e->reply)
            zmq_send(e->sock, e->reply, e->reply_bytes, 0);
        else
            zmq_msg_send(&payload, e->sock, 0); /* the request's own frame: no copy */
        zmq_msg_close(&header);
        zmq_msg_close(&id);
        zmq_msg_close(&payload);
    }
    return NULL;
}

/* A ROUTER socket of ctx with the echo's options (CURVE with sec, when not NULL). */
static void *echo_socket(void *ctx, const char *sec)
{
    void *sock = zmq_socket(ctx, ZMQ_ROUTER);
    int hwm = 1000, timeout = 200, one = 1;
    if (sec) {
        zmq_setsockopt(sock, ZMQ_CURVE_SERVER, &one, sizeof one);
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, sec, TALLY_KEY_LEN);
    }
    zmq_setsockopt(sock, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(sock, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(sock, ZMQ_RCVTIMEO, &timeout, sizeof timeout);
    zmq_setsockopt(sock, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    return sock;
}

/* The echo server: one ROUTER socket bound to every endpoint, served by this thread; or
 * (--echo-fronts, as tallyd's fronts) a socket and a thread per endpoint, in one context. */
static int serve_echo(char **endpoints, int count, const char *key_file, size_t reply_bytes,
                      int io_threads, unsigned touch_threads, bool fronts)
{
    touch_t touch = {.lock = PTHREAD_MUTEX_INITIALIZER,
                     .work = PTHREAD_COND_INITIALIZER,
                     .room = PTHREAD_COND_INITIALIZER};
    touch_threads = touch_start(&touch, touch_threads);
    void *reply = reply_bytes ? calloc(1, reply_bytes) : NULL;
    void *ctx = zmq_ctx_new();
    zmq_ctx_set(ctx, ZMQ_IO_THREADS, io_threads);
    char pub[TALLY_KEY_LEN + 1], sec[TALLY_KEY_LEN + 1], msg[512];
    if (key_file && tally_key_file_read(key_file, true, pub, sec, msg, sizeof msg) != TALLY_OK) {
        fprintf(stderr, "loadgen: %s\n", msg);
        return 2;
    }
    echo_t echo[MAX_ENDPOINTS];
    int sockets = fronts ? count : 1;
    for (int i = 0; i < sockets; i++)
        echo[i] = (echo_t){.sock = echo_socket(ctx, key_file ? sec : NULL),
                           .touch = &touch,
                           .touch_threads = touch_threads,
                           .reply = reply,
                           .reply_bytes = reply_bytes};
    for (int i = 0; i < count; i++)
        if (zmq_bind(echo[fronts ? i : 0].sock, endpoints[i]) != 0) {
            fprintf(stderr, "loadgen: cannot bind %s: %s\n", endpoints[i], zmq_strerror(errno));
            return 2;
        }
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    for (int i = 1; i < sockets; i++)
        pthread_create(&echo[i].thread, NULL, echo_loop, &echo[i]);
    echo_loop(&echo[0]);
    for (int i = 1; i < sockets; i++)
        pthread_join(echo[i].thread, NULL);
    touch_stop(&touch);
    free(reply);
    for (int i = 0; i < sockets; i++)
        zmq_close(echo[i].sock);
    zmq_ctx_term(ctx);
    return 0;
}

/* --endpoint EP0,EP1,...: the endpoints producers spread over (tallyd's binds and fronts). */
static bool split_endpoints(opts_t *o)
{
    const char *at = o->c.endpoint;
    while (*at && o->endpoint_count < MAX_ENDPOINTS) {
        size_t len = strcspn(at, ",");
        if (len && !(o->endpoints[o->endpoint_count++] = strndup(at, len)))
            return false;
        at += len + (at[len] == ',');
    }
    return o->endpoint_count > 0 && !*at;
}

static void usage(void)
{
    fprintf(stderr,
            "usage: loadgen --endpoint EP | --fleet NATS_URL --op filter|scan|hist|echo\n"
            "               [--size BYTES]\n"
            "               [--producers N] [--window W] [--seconds S | --count C]\n"
            "               [--stream | --streams K]\n"
            "               [--scan-i32] [--shm | --shm-out] [--pid PID] [--stagger-ms MS]\n"
            "               [--send copy|zc] [--label TEXT]\n"
            "               [--header] [--server-key KEY|FILE --client-key FILE]\n"
            "       loadgen [--echo-key FILE] [--echo-reply BYTES] [--echo-io-threads N]\n"
            "               [--echo-touch N] [--echo-fronts] --serve-echo EP [EP...]\n");
}

/* Loadgen's own options (bench_own_opt_fn); --serve-echo takes the rest of the line. */
typedef struct {
    opts_t *o;
    const char *echo_key, *server_key, *client_key;
    size_t echo_reply; /* --echo-reply: bytes of every echo reply; 0 = the request's payload */
    int echo_io_threads;
    unsigned echo_touch; /* --echo-touch: threads that copy each payload out */
    bool echo_fronts;    /* --echo-fronts: a socket and a thread per endpoint */
    char **serve_echo;   /* the endpoints after --serve-echo, or NULL */
    int serve_echo_count;
} args_t;

static bool own_opt(void *ctx, int argc, char **argv, int *i)
{
    args_t *g = ctx;
    opts_t *o = g->o;
    const char *a = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    if (strcmp(a, "--stream") == 0) {
        o->stream = true;
        return true;
    }
    if (strcmp(a, "--echo-fronts") == 0) {
        g->echo_fronts = true;
        return true;
    }
    if (strcmp(a, "--scan-i32") == 0) {
        o->scan_i32 = true;
        return true;
    }
    if (strcmp(a, "--shm") == 0 || strcmp(a, "--shm-out") == 0) {
        o->shm = true;
        o->shm_out = strcmp(a, "--shm-out") == 0;
        return true;
    }
    if (!v)
        return false;
    if (strcmp(a, "--serve-echo") == 0) {
        g->serve_echo = argv + *i + 1;
        g->serve_echo_count = argc - *i - 1 < MAX_ENDPOINTS ? argc - *i - 1 : MAX_ENDPOINTS;
        *i = argc;
        return true;
    }
    if (strcmp(a, "--op") == 0)
        o->op = v;
    else if (strcmp(a, "--fleet") == 0)
        o->fleet = v;
    else if (strcmp(a, "--streams") == 0)
        o->streams = (unsigned)strtoul(v, NULL, 0);
    else if (strcmp(a, "--send") == 0 && (strcmp(v, "zc") == 0 || strcmp(v, "copy") == 0))
        o->send_zc = strcmp(v, "zc") == 0;
    else if (strcmp(a, "--count") == 0)
        o->count = strtoull(v, NULL, 0);
    else if (strcmp(a, "--pid") == 0)
        o->pid = atoi(v);
    else if (strcmp(a, "--echo-key") == 0)
        g->echo_key = v;
    else if (strcmp(a, "--echo-reply") == 0)
        g->echo_reply = strtoull(v, NULL, 0);
    else if (strcmp(a, "--echo-io-threads") == 0)
        g->echo_io_threads = atoi(v);
    else if (strcmp(a, "--echo-touch") == 0)
        g->echo_touch = (unsigned)strtoul(v, NULL, 0);
    else if (strcmp(a, "--server-key") == 0)
        g->server_key = v;
    else if (strcmp(a, "--client-key") == 0)
        g->client_key = v;
    else
        return false;
    (*i)++;
    return true;
}

int main(int argc, char **argv)
{
    opts_t o = {.c = {.label = "run", .size = 65536, .producers = 1, .window = 8, .seconds = 2.0},
                .op = "hist"};
    args_t g = {.o = &o};
    if (!bench_parse_opts(argc, argv, &o.c, own_opt, &g)) {
        usage();
        return 2;
    }
    if (g.serve_echo)
        return serve_echo(g.serve_echo, g.serve_echo_count, g.echo_key, g.echo_reply,
                          g.echo_io_threads > 0 ? g.echo_io_threads : 1, g.echo_touch,
                          g.echo_fronts);
    if (!o.c.endpoint == !o.fleet || (o.fleet && o.shm) || !o.c.producers ||
        o.c.producers > MAX_PRODUCERS || !o.c.window || o.c.window > MAX_WINDOW ||
        (o.c.size % 4 && strcmp(o.op, "hist") && strcmp(o.op, "echo"))) {
        usage();
        return 2;
    }
    if (o.c.endpoint && !split_endpoints(&o)) {
        usage();
        return 2;
    }
    char why[512];
    if (g.server_key &&
        tally_curve_keys_load(g.server_key, g.client_key, &o.curve, why, sizeof why) != TALLY_OK) {
        fprintf(stderr, "loadgen: CURVE keys: %s\n", why);
        return 2;
    }
    if (o.streams > MAX_STREAMS || (o.streams && (o.stream || !setup_streams(&o)))) {
        usage();
        return 2;
    }
    int rc = run(&o);
    free(o.shard_of_stream);
    for (unsigned i = 0; i < o.endpoint_count; i++)
        free(o.endpoints[i]);
    return rc;
}
