/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_metrics.c — see td_metrics.h. Metric names follow Prometheus conventions (a tallyd_
 * prefix, _total for counters, base units: seconds and bytes).
 */
#include <dirent.h>
#include <stdint.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "td_fleet_status.h"
#include "td_metrics.h"
#include "td_path.h"
#include "td_peers.h"
#include "tally_revision.h"

/* The text being rendered: buf[0..cap), of which len bytes are needed so far. */
typedef struct {
    char *buf;
    size_t cap;
    size_t len;
} out_t;

/* An snprintf that appends at o->len and keeps counting past cap. */
static void emit(out_t *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void emit(out_t *o, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    bool room = o->len < o->cap;
    int n = vsnprintf(room ? o->buf + o->len : NULL, room ? o->cap - o->len : 0, fmt, ap);
    va_end(ap);
    if (n > 0)
        o->len += (size_t)n;
}

static const char *op_label(unsigned op)
{
    const char *name = op ? tally_op_name((tally_op_t)op) : NULL;
    return name ? name : "unknown";
}

/* A stream name as a label value: printable ASCII, with \ and " escaped. */
static void label_value(char *out, size_t cap, const char *name, size_t len)
{
    size_t at = 0;
    for (size_t i = 0; i < len && at + 3 < cap; i++) {
        if (name[i] == '\\' || name[i] == '"')
            out[at++] = '\\';
        out[at++] = name[i];
    }
    out[at] = '\0';
}

/* The per-stream counter families: each is rendered whole under its HELP and TYPE (a parser
 * reads a sample whose family is not the current one as an untyped family of its own). */
typedef enum { STREAM_VALUES, STREAM_BYTES, STREAM_REQUESTS, STREAM_FAMILIES } stream_family_t;

static const char *const stream_family_head[STREAM_FAMILIES] = {
    "# HELP tallyd_stream_values_total Elements applied to the stream (since it was created or "
    "reset), per stream; streams past the first [metrics] streams created are summed as "
    "stream=\"" TD_METRICS_OTHER_STREAMS "\".\n"
    "# TYPE tallyd_stream_values_total counter\n",
    "# HELP tallyd_stream_bytes_total Payload bytes applied to the stream, per stream.\n"
    "# TYPE tallyd_stream_bytes_total counter\n",
    "# HELP tallyd_stream_requests_total Requests that named the stream, per stream.\n"
    "# TYPE tallyd_stream_requests_total counter\n",
};
static const char *const stream_family_name[STREAM_FAMILIES] = {
    "tallyd_stream_values_total", "tallyd_stream_bytes_total", "tallyd_stream_requests_total"};

static uint64_t stream_counter(const td_stream_t *s, stream_family_t f)
{
    return f == STREAM_VALUES ? s->info.elements : f == STREAM_BYTES ? s->info.bytes : s->requests;
}

/* One family: the first metrics_streams streams in creation order, the rest summed. */
static void render_stream_family(const td_gauges_t *g, stream_family_t f, out_t *o)
{
    emit(o, "%s", stream_family_head[f]);
    unsigned n = 0;
    uint64_t other = 0;
    bool any_other = false;
    for (td_stream_t *s = td_streams_first(g->streams); s;
         s = td_streams_next(g->streams, s), n++) {
        if (n >= g->metrics_streams) {
            other += stream_counter(s, f);
            any_other = true;
            continue;
        }
        char label[2 * TALLY_STREAM_NAME_MAX + 1];
        label_value(label, sizeof label, s->name, s->name_len);
        emit(o, "%s{stream=\"%s\"} %llu\n", stream_family_name[f], label,
             (unsigned long long)stream_counter(s, f));
    }
    if (any_other)
        emit(o, "%s{stream=\"" TD_METRICS_OTHER_STREAMS "\"} %llu\n", stream_family_name[f],
             (unsigned long long)other);
}

/* One histogram of a stream (one channel's): its 256 bins folded into `buckets` buckets, bucket
 * i holding bins [i * 256 / buckets, (i + 1) * 256 / buckets). Bins hold integers, so a bucket's
 * `le` is the largest integer in it (the next bucket's first edge minus one); a bucket with no
 * integer (a range narrower than the buckets) shares its le with the one before and is left
 * out (its count is that one's: an empty range takes no value). Ranged histograms get a bucket
 * le = lo - 1 first, holding the underflow, unless lo is the type's least value, so that a
 * quantile in the first bucket interpolates from lo - 1 rather than from 0; the overflow is
 * only in +Inf. _sum takes each value at the centre of its bin's integers (exact for u8 and
 * colour channels), each underflow value at lo - 1 and each overflow value at hi. */
static void render_histogram(out_t *o, const char *labels, const tally_stream_info_t *info,
                             const uint64_t *bins, unsigned buckets)
{
    bool ranged = tally_hist_ranged(info->hist_dtype);
    int64_t lo = ranged ? info->hist_lo : 0, hi = ranged ? info->hist_hi : TALLY_HIST_BINS;
    uint64_t under = ranged ? info->hist_underflow : 0, over = ranged ? info->hist_overflow : 0;
    int64_t least = info->hist_dtype == TALLY_DTYPE_I32 ? INT32_MIN : 0;
    uint64_t cumulative = under;
    long double sum = (long double)under * (long double)(lo - 1) + (long double)over * hi;
    int64_t last_le = lo - 1;
    if (ranged && lo > least)
        emit(o, "tallyd_stream_values_bucket{%s,le=\"%lld\"} %llu\n", labels, (long long)last_le,
             (unsigned long long)under);
    unsigned b = 0;
    for (unsigned i = 1; i <= buckets; i++) {
        for (unsigned end = i * TALLY_HIST_BINS / buckets; b < end; b++) {
            int64_t first = tally_hist_edge_at(lo, hi, b), next = tally_hist_edge_at(lo, hi, b + 1);
            cumulative += bins[b];
            sum += (long double)bins[b] * ((long double)first + (long double)next - 1) / 2;
        }
        int64_t le = tally_hist_edge_at(lo, hi, b) - 1;
        if (le == last_le)
            continue;
        last_le = le;
        emit(o, "tallyd_stream_values_bucket{%s,le=\"%lld\"} %llu\n", labels, (long long)le,
             (unsigned long long)cumulative);
    }
    emit(o,
         "tallyd_stream_values_bucket{%s,le=\"+Inf\"} %llu\n"
         "tallyd_stream_values_sum{%s} %.17g\n"
         "tallyd_stream_values_count{%s} %llu\n",
         labels, (unsigned long long)(cumulative + over), labels, (double)sum, labels,
         (unsigned long long)(cumulative + over));
}

/* The histograms of the first metrics_streams streams that have one (the others are of other
 * types and ranges: they cannot be summed), one per channel for rgb8/rgba8. */
static void render_stream_histograms(const td_gauges_t *g, out_t *o)
{
    unsigned buckets = g->metrics_histogram_buckets < TALLY_HIST_BINS ? g->metrics_histogram_buckets
                                                                      : TALLY_HIST_BINS;
    if (!buckets)
        return;
    emit(o, "# HELP tallyd_stream_values Values histogrammed on the stream (since it was created "
            "or reset), its 256 bins folded into [metrics] histogram_buckets buckets; le is the "
            "largest value in a bucket; per channel (r, g, b, a) for rgb8/rgba8; the first "
            "[metrics] streams streams created only.\n"
            "# TYPE tallyd_stream_values histogram\n");
    unsigned n = 0;
    for (td_stream_t *s = td_streams_first(g->streams); s && n < g->metrics_streams;
         s = td_streams_next(g->streams, s), n++) {
        static tally_stream_info_t view; /* the loop thread renders; 8 KiB off the stack */
        td_stream_info(s, &view);        /* the record, rebuilt from the compact bins */
        unsigned channels = tally_hist_channels(view.hist_dtype);
        char label[2 * TALLY_STREAM_NAME_MAX + 1], labels[sizeof label + 32];
        label_value(label, sizeof label, s->name, s->name_len);
        for (unsigned c = 0; c < channels; c++) {
            if (channels > 1)
                snprintf(labels, sizeof labels, "stream=\"%s\",channel=\"%c\"", label, "rgba"[c]);
            else
                snprintf(labels, sizeof labels, "stream=\"%s\"", label);
            render_histogram(o, labels, &view, view.bins + (size_t)c * TALLY_HIST_BINS, buckets);
        }
    }
}

/* At most metrics_streams + 1 label values per metric, however many streams exist. */
static void render_streams(const td_gauges_t *g, out_t *o)
{
    if (!g->streams)
        return;
    for (stream_family_t f = 0; f < STREAM_FAMILIES; f++)
        render_stream_family(g, f, o);
    render_stream_histograms(g, o);
}

/* The process_* metrics every Prometheus client library exports, from getrusage and /proc. */
static void render_process(const td_gauges_t *g, out_t *o)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double cpu = (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 +
                 (double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
    unsigned long long vsize = 0, rss = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f) {
        if (fscanf(f, "%llu %llu", &vsize, &rss) != 2)
            vsize = rss = 0;
        fclose(f);
    }
    long page = sysconf(_SC_PAGESIZE);
    unsigned fds = 0;
    DIR *d = opendir("/proc/self/fd");
    if (d) {
        for (struct dirent *e; (e = readdir(d));)
            fds += e->d_name[0] != '.';
        closedir(d);
        fds--; /* the directory's own descriptor */
    }
    struct rlimit rl = {0};
    getrlimit(RLIMIT_NOFILE, &rl);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    double start = (double)now.tv_sec + now.tv_nsec / 1e9 - g->uptime_s;
    emit(o,
         "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.\n"
         "# TYPE process_cpu_seconds_total counter\n"
         "process_cpu_seconds_total %.6f\n"
         "# HELP process_resident_memory_bytes Resident memory size in bytes.\n"
         "# TYPE process_resident_memory_bytes gauge\n"
         "process_resident_memory_bytes %llu\n"
         "# HELP process_virtual_memory_bytes Virtual memory size in bytes.\n"
         "# TYPE process_virtual_memory_bytes gauge\n"
         "process_virtual_memory_bytes %llu\n"
         "# HELP process_open_fds Number of open file descriptors.\n"
         "# TYPE process_open_fds gauge\n"
         "process_open_fds %u\n"
         "# HELP process_max_fds Maximum number of open file descriptors.\n"
         "# TYPE process_max_fds gauge\n"
         "process_max_fds %llu\n"
         "# HELP process_start_time_seconds Start time of the process since unix epoch in "
         "seconds.\n"
         "# TYPE process_start_time_seconds gauge\n"
         "process_start_time_seconds %.3f\n",
         cpu, rss * (unsigned long long)page, vsize * (unsigned long long)page, fds,
         (unsigned long long)rl.rlim_cur, start);
}

typedef struct {
    out_t *o;
    bool limited; /* which counter this pass renders */
} user_render_t;

static void render_user(void *ctx, const td_peer_t *user)
{
    user_render_t *u = ctx;
    emit(u->o, "tallyd_client_%s_total{client=\"%s\"} %llu\n", u->limited ? "limited" : "requests",
         td_peer_name(user),
         (unsigned long long)(u->limited ? td_peer_limited(user) : td_peer_requests(user)));
}

/* CURVE: handshakes by outcome, and per client (ZAP user id) its requests and refusals. A user
 * id is the name an operator gave a key (a file name or a list item), so it is a safe label. */
static void render_auth(const td_gauges_t *g, out_t *o)
{
    emit(o,
         "# HELP tallyd_auth_total CURVE handshakes: allowed, or refused because the key is not "
         "allowed (unknown_key), the client used no CURVE (no_curve), or the handshake failed "
         "(bad_handshake: most often a wrong server key).\n"
         "# TYPE tallyd_auth_total counter\n"
         "tallyd_auth_total{result=\"allowed\"} %llu\n"
         "tallyd_auth_total{result=\"unknown_key\"} %llu\n"
         "tallyd_auth_total{result=\"no_curve\"} %llu\n"
         "tallyd_auth_total{result=\"bad_handshake\"} %llu\n",
         (unsigned long long)g->auth.allowed, (unsigned long long)g->auth.unknown_key,
         (unsigned long long)g->auth.no_curve, (unsigned long long)g->auth.bad_handshake);
    emit(o,
         "# HELP tallyd_auth_zap_errors_total CURVE handshakes left unanswered: ZeroMQ refused "
         "the ZAP handler's answer.\n"
         "# TYPE tallyd_auth_zap_errors_total counter\n"
         "tallyd_auth_zap_errors_total %llu\n",
         (unsigned long long)g->auth.zap_errors);
    if (!g->users)
        return;
    user_render_t u = {.o = o};
    emit(o, "# HELP tallyd_client_requests_total Requests read, per CURVE client.\n"
            "# TYPE tallyd_client_requests_total counter\n");
    td_peers_each_user(g->users, render_user, &u);
    u.limited = true;
    emit(o, "# HELP tallyd_client_limited_total Requests refused by a per-peer limit, per CURVE "
            "client.\n"
            "# TYPE tallyd_client_limited_total counter\n");
    td_peers_each_user(g->users, render_user, &u);
}

static void render_build(out_t *o)
{
    emit(o,
         "# HELP tallyd_build_info tallyd's version, protocol, whether CUDA was built in, and "
         "the git revision.\n"
         "# TYPE tallyd_build_info gauge\n"
         "tallyd_build_info{version=\"%s\",protocol=\"%d\",cuda=\"%s\",revision=\"%s\"} 1\n",
         TALLY_VERSION, TALLY_PROTO_VERSION,
#ifdef TALLY_HAVE_CUDA
         "yes",
#else
         "no",
#endif
         tally_build_revision);
}

/* Requests answered by operation and status, and their latency histogram per operation. */
static void render_requests(const td_metrics_t *m, out_t *o)
{
    emit(o, "# HELP tallyd_requests_total Requests answered, by operation and status.\n"
            "# TYPE tallyd_requests_total counter\n");
    for (unsigned op = 0; op < TALLY_OP_COUNT; op++)
        for (unsigned st = 0; st < TALLY_STATUS_WIRE_COUNT; st++)
            if (m->requests[op][st])
                emit(o, "tallyd_requests_total{op=\"%s\",status=\"%s\"} %llu\n", op_label(op),
                     tally_status_name((tally_status_t)st),
                     (unsigned long long)m->requests[op][st]);
    emit(o, "# HELP tallyd_request_duration_seconds Time from receipt to reply, by operation.\n"
            "# TYPE tallyd_request_duration_seconds histogram\n");
    for (unsigned op = 0; op < TALLY_OP_COUNT; op++) {
        uint64_t total = 0;
        for (unsigned b = 0; b <= TD_LATENCY_BUCKETS; b++)
            total += m->latency_buckets[op][b];
        if (total == 0)
            continue;
        uint64_t cumulative = 0;
        for (unsigned b = 0; b < TD_LATENCY_BUCKETS; b++) {
            cumulative += m->latency_buckets[op][b];
            emit(o, "tallyd_request_duration_seconds_bucket{op=\"%s\",le=\"%g\"} %llu\n",
                 op_label(op), td_latency_bounds_us[b] / 1e6, (unsigned long long)cumulative);
        }
        emit(o,
             "tallyd_request_duration_seconds_bucket{op=\"%s\",le=\"+Inf\"} %llu\n"
             "tallyd_request_duration_seconds_sum{op=\"%s\"} %.9f\n"
             "tallyd_request_duration_seconds_count{op=\"%s\"} %llu\n",
             op_label(op), (unsigned long long)total, op_label(op), m->latency_sum_s[op],
             op_label(op), (unsigned long long)total);
    }
}

/* Bytes, dropped replies, fallbacks, read pauses and failures: one value each. */
/* One counter without labels: its HELP, TYPE and value lines. */
static void emit_counter(out_t *o, const char *name, const char *help, uint64_t value)
{
    emit(o, "# HELP %s %s\n# TYPE %s counter\n%s %llu\n", name, help, name, name,
         (unsigned long long)value);
}

static void render_counters(const td_metrics_t *m, out_t *o)
{
    emit_counter(o, "tallyd_received_bytes_total", "Request payload bytes received.", m->bytes_in);
    emit_counter(o, "tallyd_sent_bytes_total", "Reply payload bytes sent.", m->bytes_out);
    emit(o,
         "# HELP tallyd_replies_dropped_total Replies dropped: the peer had disconnected "
         "(peer_gone) or had not read its earlier replies (peer_not_reading).\n"
         "# TYPE tallyd_replies_dropped_total counter\n"
         "tallyd_replies_dropped_total{reason=\"peer_gone\"} %llu\n"
         "tallyd_replies_dropped_total{reason=\"peer_not_reading\"} %llu\n",
         (unsigned long long)m->replies_dropped_gone, (unsigned long long)m->replies_dropped_slow);
    emit_counter(o, "tallyd_backend_fallbacks_total",
                 "Requests rerun on the CPU after a GPU error.", m->backend_fallbacks);
    emit_counter(o, "tallyd_read_pauses_total", "Times reading stopped at the in-flight limit.",
                 m->read_pauses);
    emit_counter(o, "tallyd_state_write_failures_total",
                 "State snapshots that could not be written.", m->state_write_failures);
    emit_counter(o, "tallyd_state_written_bytes_total",
                 "Bytes state snapshots wrote: the records of the streams that changed, or a "
                 "whole state file.",
                 m->state_bytes_written);
    emit_counter(o, "tallyd_notify_failures_total",
                 "systemd notifications (READY, STATUS, WATCHDOG...) that could not be sent.",
                 m->notify_failures);
}

/* Device regions (PROTOCOL.md §10 "Device memory"): mapped, their bytes, and where the requests
 * by device reference ran. */
static void render_gpu_regions(const td_metrics_t *m, const td_gauges_t *g, out_t *o)
{
    if (!m->gpu_devices)
        return;
    emit(o,
         "# HELP tallyd_gpu_regions Device regions imported on the GPUs (registered, or in use).\n"
         "# TYPE tallyd_gpu_regions gauge\n"
         "tallyd_gpu_regions %u\n"
         "# HELP tallyd_gpu_region_bytes Bytes of the device regions imported.\n"
         "# TYPE tallyd_gpu_region_bytes gauge\n"
         "tallyd_gpu_region_bytes %llu\n"
         "# HELP tallyd_gpu_region_requests_total Requests by device reference completed on each "
         "GPU: on the GPU holding the region (owner) or on another one over peer access (peer).\n"
         "# TYPE tallyd_gpu_region_requests_total counter\n",
         g->gpu_regions, (unsigned long long)g->gpu_region_bytes);
    static const char *const where[2] = {"owner", "peer"};
    for (unsigned d = 0; d < m->gpu_devices; d++)
        for (unsigned w = 0; w < 2; w++)
            emit(o, "tallyd_gpu_region_requests_total{device=\"%u\",where=\"%s\"} %llu\n", d,
                 where[w], (unsigned long long)m->gpu_region_requests[d][w]);
}

/* Where GPU requests' time went, by stage (td_gpu_stage_t; docs/service.md). */
static void render_gpu_stages(const td_metrics_t *m, out_t *o)
{
    static const char *const stages[TD_GPU_STAGES] = {"submit", "to_lane", "launch", "device",
                                                      "retire", "back",    "apply",  "to_front"};
    if (!m->gpu_devices)
        return;
    emit(o, "# HELP tallyd_gpu_stage_seconds_total Time GPU requests spent in each stage from "
            "their read to their reply's hand-off (docs/service.md).\n"
            "# TYPE tallyd_gpu_stage_seconds_total counter\n");
    for (unsigned i = 0; i < TD_GPU_STAGES; i++)
        emit(o, "tallyd_gpu_stage_seconds_total{stage=\"%s\"} %.9f\n", stages[i],
             (double)m->gpu_stage_ns[i] / 1e9);
    emit(o, "# HELP tallyd_gpu_stage_requests_total GPU requests counted in each stage.\n"
            "# TYPE tallyd_gpu_stage_requests_total counter\n");
    for (unsigned i = 0; i < TD_GPU_STAGES; i++)
        emit(o, "tallyd_gpu_stage_requests_total{stage=\"%s\"} %llu\n", stages[i],
             (unsigned long long)m->gpu_stage_count[i]);
}

/* Shared memory, requests per GPU and the per-peer limits. */
static void render_resources(const td_metrics_t *m, const td_gauges_t *g, out_t *o)
{
    emit(o,
         "# HELP tallyd_shm_requests_total Requests whose input was in shared memory.\n"
         "# TYPE tallyd_shm_requests_total counter\n"
         "tallyd_shm_requests_total %llu\n"
         "# HELP tallyd_shm_regions Shared-memory regions mapped (registered, or in use).\n"
         "# TYPE tallyd_shm_regions gauge\n"
         "tallyd_shm_regions %u\n"
         "# HELP tallyd_shm_bytes Bytes of the shared-memory regions mapped.\n"
         "# TYPE tallyd_shm_bytes gauge\n"
         "tallyd_shm_bytes %llu\n",
         (unsigned long long)m->shm_requests, g->shm_regions, (unsigned long long)g->shm_bytes);
    if (m->gpu_devices)
        emit(o, "# HELP tallyd_gpu_requests_total Requests completed on each GPU (a request split "
                "over a GPU's streams counts once).\n"
                "# TYPE tallyd_gpu_requests_total counter\n");
    for (unsigned d = 0; d < m->gpu_devices; d++)
        emit(o, "tallyd_gpu_requests_total{device=\"%u\"} %llu\n", d,
             (unsigned long long)m->gpu_requests[d]);
    render_gpu_regions(m, g, o);
    render_gpu_stages(m, o);
    static const char *const limit_names[TD_LIMIT_COUNT] = {
        "inflight_share", "client_streams", "stream_rate", "reply_bytes_peer", "reply_bytes"};
    emit(o, "# HELP tallyd_limited_total Requests refused by a per-peer limit, by reason: "
            "inflight_share (answered busy: the connection's share of in-flight slots), "
            "client_streams (client_streams: the client's streams or their state bytes), "
            "stream_rate (rate_limited: the client's stream creation rate), reply_bytes_peer and "
            "reply_bytes (busy: the reply bytes of the connection, of all connections).\n"
            "# TYPE tallyd_limited_total counter\n");
    for (unsigned i = 0; i < TD_LIMIT_COUNT; i++)
        emit(o, "tallyd_limited_total{reason=\"%s\"} %llu\n", limit_names[i],
             (unsigned long long)m->limited[i]);
}

/* The sampled gauges: peers, load, streams, backend, uptime, health, subscriptions. */
static void render_gauges(const td_gauges_t *g, out_t *o)
{
    emit(o,
         "# HELP tallyd_peers Connections and clients tracked for the per-peer limits.\n"
         "# TYPE tallyd_peers gauge\n"
         "tallyd_peers %u\n",
         g->peers);
    emit(o,
         "# HELP tallyd_requests_in_flight Requests accepted and not yet answered.\n"
         "# TYPE tallyd_requests_in_flight gauge\n"
         "tallyd_requests_in_flight %u\n"
         "# HELP tallyd_requests_in_flight_limit The configured in-flight limit.\n"
         "# TYPE tallyd_requests_in_flight_limit gauge\n"
         "tallyd_requests_in_flight_limit %u\n"
         "# HELP tallyd_queue_depth Requests waiting behind another on their stream.\n"
         "# TYPE tallyd_queue_depth gauge\n"
         "tallyd_queue_depth %u\n"
         "# HELP tallyd_streams Named streams held.\n"
         "# TYPE tallyd_streams gauge\n"
         "tallyd_streams %u\n"
         "# HELP tallyd_state_bytes Bytes of stream state: counters, histograms, window rings.\n"
         "# TYPE tallyd_state_bytes gauge\n"
         "tallyd_state_bytes %llu\n"
         "# HELP tallyd_state_bytes_limit The configured max_state_bytes.\n"
         "# TYPE tallyd_state_bytes_limit gauge\n"
         "tallyd_state_bytes_limit %llu\n"
         "# HELP tallyd_backend_info The compute backend in use and its devices.\n"
         "# TYPE tallyd_backend_info gauge\n"
         "tallyd_backend_info{backend=\"%s\",devices=\"%s\"} 1\n"
         "# HELP tallyd_device_memory_bytes Device memory allocated by tallyd.\n"
         "# TYPE tallyd_device_memory_bytes gauge\n"
         "tallyd_device_memory_bytes %llu\n"
         "# HELP tallyd_uptime_seconds Seconds since tallyd started.\n"
         "# TYPE tallyd_uptime_seconds gauge\n"
         "tallyd_uptime_seconds %.3f\n",
         g->inflight, g->max_inflight, g->queued, g->stream_count,
         (unsigned long long)g->state_bytes, (unsigned long long)g->state_bytes_max, g->backend,
         g->devices, (unsigned long long)g->device_memory_bytes, g->uptime_s);
    emit(o,
         "# HELP tallyd_gpus_lost GPUs marked unusable since tallyd started.\n"
         "# TYPE tallyd_gpus_lost gauge\n"
         "tallyd_gpus_lost %u\n"
         "# HELP tallyd_draining 1 after a stop signal, while tallyd answers what it has read.\n"
         "# TYPE tallyd_draining gauge\n"
         "tallyd_draining %d\n"
         "# HELP tallyd_pub_messages_total Messages published on the PUB socket (subscriptions), "
         "and messages ZeroMQ refused.\n"
         "# TYPE tallyd_pub_messages_total counter\n"
         "tallyd_pub_messages_total{result=\"sent\"} %llu\n"
         "tallyd_pub_messages_total{result=\"failed\"} %llu\n",
         g->gpus_lost, g->stopping ? 1 : 0, (unsigned long long)g->pub_messages,
         (unsigned long long)g->pub_failed);
}

/* Each shard's share of the work (issue 31), so an imbalance shows. */
static void render_shards(const td_gauges_t *g, out_t *o)
{
    static const struct {
        const char *name, *type, *help;
    } families[] = {
        {"tallyd_shards", "gauge", "Shards of the request path (--shards)."},
        {"tallyd_shard_requests_total", "counter", "Requests a shard answered."},
        {"tallyd_shard_requests_in_flight", "gauge",
         "Requests handed to a shard and not yet answered."},
        {"tallyd_shard_queue_depth", "gauge",
         "Requests waiting behind another on their stream, on a shard."},
        {"tallyd_shard_streams", "gauge", "Named streams a shard owns."},
        {"tallyd_shard_busy_seconds_total", "counter",
         "Seconds a shard's loop thread spent working (not waiting for work)."},
    };
    emit(o, "# HELP %s %s\n# TYPE %s %s\n%s %u\n", families[0].name, families[0].help,
         families[0].name, families[0].type, families[0].name, g->shards);
    for (size_t f = 1; f < sizeof families / sizeof families[0]; f++) {
        emit(o, "# HELP %s %s\n# TYPE %s %s\n", families[f].name, families[f].help,
             families[f].name, families[f].type);
        for (unsigned i = 0; g->shard && i < g->shards; i++) {
            const struct td_shard_gauges *s = &g->shard[i];
            double v = f == 1   ? (double)s->requests
                       : f == 2 ? s->inflight
                       : f == 3 ? s->queued
                       : f == 4 ? s->streams
                                : s->busy_s;
            emit(o, f == 5 ? "%s{shard=\"%u\"} %.6f\n" : "%s{shard=\"%u\"} %.0f\n",
                 families[f].name, i, v);
        }
    }
}

/* Each front's requests and replies (td_zmq_front.h), so an imbalance between them shows. */
static void render_fronts(const td_gauges_t *g, out_t *o)
{
    static const struct {
        const char *name, *type, *help;
    } families[] = {
        {"tallyd_fronts", "gauge", "Fronts: endpoints with a socket and a thread each (front)."},
        {"tallyd_front_requests_total", "counter", "Requests a front read."},
        {"tallyd_front_replies_total", "counter", "Replies a front sent."},
        {"tallyd_front_replies_dropped_total", "counter",
         "Replies a front dropped: the connection had gone, or did not read."},
        {"tallyd_front_busy_waits_total", "counter",
         "Times a front stopped reading at max_inflight."},
    };
    emit(o, "# HELP %s %s\n# TYPE %s %s\n%s %u\n", families[0].name, families[0].help,
         families[0].name, families[0].type, families[0].name, g->fronts);
    for (size_t f = 1; g->fronts && f < sizeof families / sizeof families[0]; f++) {
        emit(o, "# HELP %s %s\n# TYPE %s %s\n", families[f].name, families[f].help,
             families[f].name, families[f].type);
        for (unsigned i = 0; g->front && i < g->fronts; i++) {
            const td_front_counts_t *c = &g->front[i];
            uint64_t v = f == 1   ? c->requests
                         : f == 2 ? c->replies
                         : f == 3 ? c->dropped_gone + c->dropped_slow
                                  : c->busy_waits;
            emit(o, "%s{front=\"%u\"} %llu\n", families[f].name, i, (unsigned long long)v);
        }
    }
}

/* What unread replies hold (td_reply.h), the bounds on it, and connections lost with requests
 * unanswered. */
static void render_replies(const td_gauges_t *g, out_t *o)
{
    emit(o,
         "# HELP tallyd_reply_bytes Reply bytes held for peers: handed to ZeroMQ and not yet "
         "written out (held), or reserved for requests in flight at their largest reply "
         "(reserved).\n"
         "# TYPE tallyd_reply_bytes gauge\n"
         "tallyd_reply_bytes{state=\"held\"} %llu\n"
         "tallyd_reply_bytes{state=\"reserved\"} %llu\n"
         "# HELP tallyd_reply_bytes_peak The most reply bytes held and reserved since start, by "
         "one connection (peer) and by all together (total).\n"
         "# TYPE tallyd_reply_bytes_peak gauge\n"
         "tallyd_reply_bytes_peak{scope=\"peer\"} %llu\n"
         "tallyd_reply_bytes_peak{scope=\"total\"} %llu\n"
         "# HELP tallyd_reply_bytes_limit The bounds in force: max_reply_bytes_per_peer (peer) "
         "and max_reply_bytes (total).\n"
         "# TYPE tallyd_reply_bytes_limit gauge\n"
         "tallyd_reply_bytes_limit{scope=\"peer\"} %llu\n"
         "tallyd_reply_bytes_limit{scope=\"total\"} %llu\n",
         (unsigned long long)g->reply.held, (unsigned long long)g->reply.reserved,
         (unsigned long long)g->reply.peak_peer, (unsigned long long)g->reply.peak_total,
         (unsigned long long)g->reply.bound_peer, (unsigned long long)g->reply.bound_total);
    emit_counter(o, "tallyd_connections_lost_total",
                 "Connections that closed while tallyd owed them replies: requests read and not "
                 "yet answered, or read after the close (the client closed it, or ZeroMQ did "
                 "after a frame over max_frame). One whose requests were all answered is not "
                 "counted, though ZeroMQ drops the replies it had not written to it.",
                 g->reply.connections_lost);
    emit_counter(o, "tallyd_replies_resent_total",
                 "Replies kept for such a connection and sent once a connection with its routing "
                 "id came back.",
                 g->reply.resent);
    emit_counter(o, "tallyd_requests_rerouted_total",
                 "Requests read from such a connection after a new connection with its routing "
                 "id took the id over: answered to the new connection.",
                 g->reply.rerouted);
}

size_t td_metrics_render(const td_metrics_t *m, const td_gauges_t *g, char *buf, size_t cap)
{
    out_t o = {.buf = buf, .cap = cap};
    if (cap)
        buf[0] = '\0';
    render_build(&o);
    render_requests(m, &o);
    render_counters(m, &o);
    render_resources(m, g, &o);
    if (g->curve)
        render_auth(g, &o);
    render_gauges(g, &o);
    render_shards(g, &o);
    render_fronts(g, &o);
    render_replies(g, &o);
    render_streams(g, &o);
    render_process(g, &o);
    if (g->fleet) { /* the NATS fleet worker's families (core/td_fleet_status.c) */
        size_t room = o.len < cap ? cap - o.len : 0;
        o.len += td_fleet_status_render(g->fleet, room ? buf + o.len : NULL, room);
    }
    return o.len;
}
