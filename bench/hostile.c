/* SPDX-License-Identifier: Apache-2.0 */
/*
 * hostile.c — a well-behaved client's latency beside hostile peers (issue 21, items 1 and 2),
 * and tallyd's resident memory meanwhile.
 *
 *   hostile --endpoint EP --pid PID --attack flood|nonreader [--seconds S] [--cycles N]
 *           [--light-size B] [--attackers N] [--flood-size B] [--flood-window W] [--label TEXT]
 *           [--header]
 *
 * One run measures, against one tallyd, the light client alone (its idle p50) and the same
 * client while the attackers run, in --cycles (10) alternating windows of S / cycles seconds
 * each (the attackers pause in the idle windows), so both figures come from the same daemon and
 * the same minutes of whatever else the machine is doing:
 *   - the light client: one DEALER, one u8 hist of --light-size bytes (default 4 KiB) at a time,
 *     latency from send to reply;
 *   - flood (item 2, a noisy neighbour): each attacker pipelines --flood-window (16) u8 hists of
 *     --flood-size bytes (1 MiB) and reads every reply;
 *   - nonreader (item 1): each attacker pipelines int32 scans of 4 MiB and 16 MiB in turn (a
 *     16 MiB scan has a 32 MiB reply) and never reads a reply; its socket's receive high-water
 *     mark is 1 and its kernel receive buffer small, so the replies stay with tallyd instead of
 *     queueing in the attacker's own process.
 * tallyd's VmRSS is sampled every 20 ms during the attack (its peak is printed) besides VmHWM,
 * the kernel's peak since tallyd started.
 *
 * Output: one markdown row (HOSTILE_ROW_HEADER). Exit status 1 when the light client got an
 * error or no reply.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "bench_util.h"
#include "tally_proto.h"

#define HOSTILE_ROW_HEADER                                                                         \
    "| run | attack | light | idle p50 us | attacked p50 us | ratio | attacked p99 us | light "    \
    "requests | attacker replies ok / busy / sent | tallyd peak VmRSS MiB | VmHWM MiB |\n"         \
    "|---|---|---|---|---|---|---|---|---|---|---|\n"
#define ATTACKERS_MAX 16
#define LAT_MAX (1u << 20)
#define TIMEOUT_MS 30000

typedef struct {
    bench_opts_t c; /* --endpoint --label --seconds --header (the others unused) */
    const char *attack;
    int pid;
    unsigned cycles;
    size_t light_size;
    unsigned attackers;
    size_t flood_size;
    unsigned flood_window;
} opts_t;

typedef struct {
    const opts_t *o;
    unsigned index;
    const uint8_t *payload;
    pthread_t thread;
    atomic_bool *stop;
    atomic_bool *paused; /* an idle window: send nothing new */
    uint64_t sent, ok, busy, other;
} attacker_t;

static void *context_;

static void keep(void *data, void *hint)
{
    (void)data;
    (void)hint;
}

/* A DEALER; rcvhwm, rcvbuf and sndhwm when > 0. */
static void *dealer(int rcvhwm, int rcvbuf, int sndhwm)
{
    void *s = zmq_socket(context_, ZMQ_DEALER);
    int linger = 0, timeo = 200;
    if (sndhwm > 0)
        zmq_setsockopt(s, ZMQ_SNDHWM, &sndhwm, sizeof sndhwm);
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(s, ZMQ_SNDTIMEO, &timeo, sizeof timeo);
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &timeo, sizeof timeo);
    if (rcvhwm > 0)
        zmq_setsockopt(s, ZMQ_RCVHWM, &rcvhwm, sizeof rcvhwm);
    if (rcvbuf > 0)
        zmq_setsockopt(s, ZMQ_RCVBUF, &rcvbuf, sizeof rcvbuf);
    return s;
}

/* Sends a request whose payload is borrowed (zero copy); false when the send timed out. */
static bool send_req(void *s, const tally_req_t *req, const void *payload, size_t len)
{
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(req, header);
    if (zmq_send(s, header, sizeof header, ZMQ_SNDMORE) != (int)sizeof header)
        return false;
    zmq_msg_t body;
    zmq_msg_init_data(&body, (void *)payload, len, keep, NULL);
    if (zmq_msg_send(&body, s, 0) < 0) {
        zmq_msg_close(&body);
        return false; /* cannot happen after the first frame went: ZeroMQ takes the rest */
    }
    return true;
}

/* Receives one reply; its status, or -1 on timeout. */
static int recv_status(void *s, uint64_t *id)
{
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, s, 0) < 0) {
        zmq_msg_close(&m);
        return -1;
    }
    tally_rep_t rep;
    bool ok = tally_rep_decode(zmq_msg_data(&m), zmq_msg_size(&m), &rep) == TALLY_OK;
    bool more = zmq_msg_more(&m);
    while (more) { /* the payload */
        zmq_msg_close(&m);
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, s, 0) < 0)
            break;
        more = zmq_msg_more(&m);
    }
    zmq_msg_close(&m);
    *id = rep.request_id;
    return ok ? (int)rep.status : 1000;
}

static tally_req_t request(uint8_t op, uint8_t dtype, uint64_t id)
{
    return (tally_req_t){
        .version = TALLY_PROTO_VERSION, .opcode = op, .dtype = dtype, .request_id = id};
}

static void count(attacker_t *a, int status)
{
    if (status == TALLY_OK)
        a->ok++;
    else if (status == TALLY_E_BUSY)
        a->busy++;
    else
        a->other++;
}

/* Pipelines flood_window hists and reads every reply. */
static void flood(attacker_t *a, void *s)
{
    uint64_t inflight = 0, id = 0;
    while (!atomic_load(a->stop) || inflight) {
        while (!atomic_load(a->stop) && !atomic_load(a->paused) && inflight < a->o->flood_window) {
            tally_req_t req = request(TALLY_OP_HIST, TALLY_DTYPE_U8, ++id);
            if (!send_req(s, &req, a->payload, a->o->flood_size))
                break;
            a->sent++;
            inflight++;
        }
        if (!inflight) { /* paused, nothing to read */
            usleep(1000);
            continue;
        }
        uint64_t got;
        int st = recv_status(s, &got);
        if (st < 0) {
            if (atomic_load(a->stop))
                break;
            continue;
        }
        inflight--;
        count(a, st);
    }
}

/* Scans of 4 MiB and 16 MiB in turn, never reading a reply. */
static void nonreader(attacker_t *a, void *s)
{
    uint64_t id = 0;
    while (!atomic_load(a->stop)) {
        if (atomic_load(a->paused)) {
            usleep(1000);
            continue;
        }
        size_t len = (id % 2 ? 16u : 4u) << 20;
        tally_req_t req = request(TALLY_OP_SCAN, TALLY_DTYPE_I32, ++id);
        if (send_req(s, &req, a->payload, len))
            a->sent++;
    }
}

static void *attacker_main(void *arg)
{
    attacker_t *a = arg;
    bool reads = strcmp(a->o->attack, "flood") == 0;
    /* A short send queue, so that a pause stops the attack at once. */
    void *s = reads ? dealer(0, 0, 4) : dealer(1, 4096, 4);
    if (zmq_connect(s, a->o->c.endpoint) != 0) {
        fprintf(stderr, "hostile: connect: %s\n", zmq_strerror(errno));
        zmq_close(s);
        return NULL;
    }
    if (reads)
        flood(a, s);
    else
        nonreader(a, s);
    zmq_close(s);
    return NULL;
}

typedef struct {
    int pid;
    atomic_bool *stop;
    long peak_kib;
} sampler_t;

static void *sampler_main(void *arg)
{
    sampler_t *m = arg;
    while (!atomic_load(m->stop)) {
        long kib = bench_proc_kib(m->pid, "VmRSS");
        if (kib > m->peak_kib)
            m->peak_kib = kib;
        usleep(20000);
    }
    return NULL;
}

typedef struct {
    double *lat;
    size_t n;
    uint64_t errors;
} light_t;

/* The light client for `seconds`: one hist at a time, its latencies added to l. */
static void light_run(const opts_t *o, void *s, const uint8_t *payload, double seconds, light_t *l)
{
    static uint64_t id;
    double stop = bench_now_s() + seconds;
    while (bench_now_s() < stop && l->n < LAT_MAX) {
        tally_req_t req = request(TALLY_OP_HIST, TALLY_DTYPE_U8, ++id);
        double t0 = bench_now_s();
        if (!send_req(s, &req, payload, o->light_size)) {
            l->errors++;
            continue;
        }
        uint64_t got = 0;
        int st;
        do /* a reply to an earlier request that timed out is skipped */
            st = recv_status(s, &got);
        while (st >= 0 && got != id);
        if (st != TALLY_OK) {
            l->errors++;
            continue;
        }
        l->lat[l->n++] = (bench_now_s() - t0) * 1e6;
    }
}

static bool own_opt(void *ctx, int argc, char **argv, int *i)
{
    opts_t *o = ctx;
    const char *a = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    if (!v)
        return false;
    if (strcmp(a, "--attack") == 0)
        o->attack = v;
    else if (strcmp(a, "--pid") == 0)
        o->pid = atoi(v);
    else if (strcmp(a, "--cycles") == 0)
        o->cycles = (unsigned)strtoul(v, NULL, 0);
    else if (strcmp(a, "--light-size") == 0)
        o->light_size = strtoull(v, NULL, 0);
    else if (strcmp(a, "--attackers") == 0)
        o->attackers = (unsigned)strtoul(v, NULL, 0);
    else if (strcmp(a, "--flood-size") == 0)
        o->flood_size = strtoull(v, NULL, 0);
    else if (strcmp(a, "--flood-window") == 0)
        o->flood_window = (unsigned)strtoul(v, NULL, 0);
    else
        return false;
    (*i)++;
    return true;
}

static void print_row(const opts_t *o, const light_t *idle, const light_t *hit,
                      const attacker_t *as, long peak_kib)
{
    uint64_t ok = 0, busy = 0, sent = 0;
    for (unsigned i = 0; i < o->attackers; i++) {
        ok += as[i].ok;
        busy += as[i].busy;
        sent += as[i].sent;
    }
    double p50_idle = bench_percentile(idle->lat, idle->n, 0.5);
    double p50_hit = bench_percentile(hit->lat, hit->n, 0.5);
    char light[32], attack[96];
    bench_size_label(o->light_size, light, sizeof light);
    if (strcmp(o->attack, "flood") == 0) {
        char fs[32];
        bench_size_label(o->flood_size, fs, sizeof fs);
        snprintf(attack, sizeof attack, "%u x flood hist %s x %u", o->attackers, fs,
                 o->flood_window);
    } else {
        snprintf(attack, sizeof attack, "%u x nonreader scan 4+16 MiB", o->attackers);
    }
    if (o->c.header)
        printf(HOSTILE_ROW_HEADER);
    printf("| %s | %s | hist %s x 1 | %.1f | %.1f | %.2f | %.1f | %zu | %" PRIu64 " / %" PRIu64
           " / %" PRIu64 " | %.0f | %.0f |\n",
           o->c.label, attack, light, p50_idle, p50_hit, p50_hit / p50_idle,
           bench_percentile(hit->lat, hit->n, 0.99), hit->n, ok, busy, sent,
           (double)peak_kib / 1024.0, (double)bench_proc_kib(o->pid, "VmHWM") / 1024.0);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    opts_t o = {.c = {.label = "hostile", .seconds = 10},
                .attack = "flood",
                .cycles = 10,
                .light_size = 4096,
                .attackers = 1,
                .flood_size = 1u << 20,
                .flood_window = 16};
    if (!bench_parse_opts(argc, argv, &o.c, own_opt, &o)) {
        fprintf(stderr, "usage: hostile --endpoint EP --pid PID --attack flood|nonreader "
                        "[--seconds S] [--cycles N] [--light-size B] [--attackers N] "
                        "[--flood-size B] [--flood-window W] [--label TEXT] [--header]\n");
        return 2;
    }
    if (!o.c.endpoint || o.attackers > ATTACKERS_MAX || !o.attackers) {
        fprintf(stderr, "hostile: --endpoint is needed; --attackers 1..%d\n", ATTACKERS_MAX);
        return 2;
    }
    context_ = zmq_ctx_new();
    size_t big = 16u << 20;
    uint8_t *payload = malloc(big);
    for (size_t i = 0; i < big; i++)
        payload[i] = (uint8_t)(i * 2654435761u >> 13);
    light_t idle = {.lat = malloc(LAT_MAX * sizeof(double))};
    light_t hit = {.lat = malloc(LAT_MAX * sizeof(double))};
    void *s = dealer(0, 0, 0);
    int timeo = TIMEOUT_MS;
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &timeo, sizeof timeo);
    if (zmq_connect(s, o.c.endpoint) != 0)
        return 2;
    light_run(&o, s, payload, 0.3, &idle); /* warm-up */
    idle.n = idle.errors = 0;

    atomic_bool stop = false, paused = true;
    attacker_t as[ATTACKERS_MAX];
    memset(as, 0, sizeof as);
    for (unsigned i = 0; i < o.attackers; i++) {
        as[i] =
            (attacker_t){.o = &o, .index = i, .payload = payload, .stop = &stop, .paused = &paused};
        pthread_create(&as[i].thread, NULL, attacker_main, &as[i]);
    }
    sampler_t m = {.pid = o.pid, .stop = &stop};
    pthread_t sampler;
    pthread_create(&sampler, NULL, sampler_main, &m);
    /* Alternating windows; the first 0.2 s after each switch is not measured (the attack
     * getting going, or draining). */
    double window = o.c.seconds / (o.cycles ? o.cycles : 1);
    light_t discard = {.lat = malloc(LAT_MAX * sizeof(double))};
    for (unsigned c = 0; c < (o.cycles ? o.cycles : 1); c++) {
        atomic_store(&paused, true);
        discard.n = 0;
        light_run(&o, s, payload, 0.2, &discard);
        light_run(&o, s, payload, window, &idle);
        atomic_store(&paused, false);
        discard.n = 0;
        light_run(&o, s, payload, 0.2, &discard);
        light_run(&o, s, payload, window, &hit);
    }
    free(discard.lat);
    atomic_store(&stop, true);
    for (unsigned i = 0; i < o.attackers; i++)
        pthread_join(as[i].thread, NULL);
    pthread_join(sampler, NULL);
    qsort(idle.lat, idle.n, sizeof *idle.lat, bench_cmp_double);
    qsort(hit.lat, hit.n, sizeof *hit.lat, bench_cmp_double);
    print_row(&o, &idle, &hit, as, m.peak_kib);
    int rc = idle.errors || hit.errors || !hit.n || !idle.n ? 1 : 0;
    if (rc)
        fprintf(stderr, "hostile: light client errors: %" PRIu64 " idle, %" PRIu64 " attacked\n",
                idle.errors, hit.errors);
    zmq_close(s);
    zmq_ctx_term(context_);
    free(idle.lat);
    free(hit.lat);
    free(payload);
    return rc;
}
