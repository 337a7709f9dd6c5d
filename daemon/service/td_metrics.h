/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_metrics.h — tallyd's counters and the Prometheus text rendering of them.
 *
 * The counters are plain integers owned by the loop thread (every request is accepted and
 * answered there), so updating them needs no atomics. Anything that reads them from another
 * thread (the HTTP exporter) asks the loop thread for a rendered snapshot instead.
 *
 * A counter that is one increment is written directly (`m->read_pauses++`: the field's name and
 * comment say what it counts, and a function per counter would say nothing more); a write that
 * needs more than that goes through a function here (a request's status and latency bucket, a
 * GPU's ordinal kept inside the table), and so does the sum the status line reads.
 */
#ifndef TD_METRICS_H
#define TD_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "td_auth.h"
#include "tally_proto.h"
#include "td_stream.h"

/* GPUs whose completed requests are counted one by one (tallyd_gpu_requests_total{device}). */
#define TD_METRICS_GPUS_MAX 16

/* Latency histogram upper bounds in microseconds (Prometheus `le` labels), plus +Inf. */
#define TD_LATENCY_BUCKETS 14
extern const double td_latency_bounds_us[TD_LATENCY_BUCKETS];

/* The per-peer limits (td_peers.h), for tallyd_limited_total{reason}. */
typedef enum {
    TD_LIMIT_INFLIGHT = 0, /* busy: the connection's share of max_inflight */
    TD_LIMIT_STREAMS = 1,  /* client_streams: max_streams_per_client */
    TD_LIMIT_RATE = 2,     /* rate_limited: stream_create_rate */
    TD_LIMIT_REPLY_PEER = 3,  /* busy: max_reply_bytes_per_peer (td_reply.h) */
    TD_LIMIT_REPLY_TOTAL = 4, /* busy: max_reply_bytes */
    TD_LIMIT_COUNT = 5,
} td_limit_t;

typedef struct {
    uint64_t requests[TALLY_OP_COUNT]
                     [TALLY_STATUS_WIRE_COUNT]; /* [opcode][status]; 0 = unknown op */
    uint64_t latency_buckets[TALLY_OP_COUNT][TD_LATENCY_BUCKETS + 1]; /* non-cumulative */
    double latency_sum_s[TALLY_OP_COUNT];
    uint64_t bytes_in;
    uint64_t bytes_out;
    uint64_t replies_dropped_gone; /* the peer was gone when its reply was ready */
    uint64_t replies_dropped_slow; /* the peer's send queue was full: it does not read */
    uint64_t backend_fallbacks;    /* requests rerun on the CPU after a GPU failure */
    uint64_t read_pauses;          /* times reading stopped because max_inflight was reached */
    uint64_t state_write_failures; /* state snapshots that could not be written */
    uint64_t state_bytes_written;  /* bytes state snapshots wrote (td_state.h) */
    uint64_t notify_failures;      /* systemd notifications that could not be sent */
    uint64_t shm_requests;         /* requests whose input was a shared-memory reference */
    uint64_t gpu_requests[TD_METRICS_GPUS_MAX]; /* completed on each GPU (by ordinal) */
    unsigned gpu_devices;                       /* how many of those to report */
    uint64_t limited[TD_LIMIT_COUNT];           /* requests refused by a per-peer limit */
} td_metrics_t;

/* Values that are not counters: sampled when rendering. */
typedef struct {
    unsigned inflight;
    unsigned max_inflight;
    unsigned queued; /* requests waiting behind another on their stream */
    unsigned stream_count;
    uint64_t state_bytes;     /* bytes of stream state (td_streams_bytes) */
    uint64_t state_bytes_max; /* max_state_bytes */
    const char *backend; /* "cpu" or "cuda" */
    const char *devices; /* the backend's one-line description */
    uint64_t device_memory_bytes;
    double uptime_s;
    unsigned shm_regions;  /* shared-memory regions mapped */
    uint64_t shm_bytes;    /* their bytes */
    bool stopping;         /* a stop signal arrived: draining */
    unsigned gpus_lost;    /* GPUs marked unusable since start */
    uint64_t pub_messages; /* subscriptions: messages published, and refused by ZeroMQ */
    uint64_t pub_failed;
    /* Per-stream series: the first metrics_streams streams (creation order) by name, the rest
     * summed under TD_METRICS_OTHER_STREAMS. NULL: none. */
    td_streams_t *streams;
    unsigned metrics_streams;
    unsigned metrics_histogram_buckets; /* tallyd_stream_values buckets per histogram; 0 = none */
    unsigned peers;               /* connections and clients tracked for the per-peer limits */
    const struct td_peers *users; /* CURVE users and their counters; NULL without CURVE */
    bool curve;
    td_auth_counts_t auth; /* handshakes allowed and refused, with CURVE */
    /* Unread replies (td_reply.h): bytes inside ZeroMQ and reserved for requests in flight, the
     * most one connection and all together have used since start, and the bounds. */
    uint64_t reply_held;
    uint64_t reply_reserved;
    uint64_t reply_peak_peer;
    uint64_t reply_peak_total;
    uint64_t reply_bound_peer;
    uint64_t reply_bound_total;
    uint64_t connections_lost; /* found closed with requests unanswered (counter) */
    uint64_t replies_resent;   /* kept for such a connection and sent once it came back */
    const struct td_fleet_status
        *fleet; /* the NATS fleet worker's (td_fleet_status.h); NULL: none */
} td_gauges_t;

/* The `stream` label of the streams beyond metrics_streams: a space and parentheses, which no
 * stream name holds (names are printable ASCII without spaces), so it never collides. */
#define TD_METRICS_OTHER_STREAMS "(other streams)"

/* A request answered: its opcode and status, bytes in and out, and latency. */
void td_metrics_observe(td_metrics_t *m, unsigned opcode, tally_status_t status, size_t bytes_in,
                        size_t bytes_out, uint64_t latency_ns);
/* Requests answered so far, whatever their operation and status. */
uint64_t td_metrics_answered(const td_metrics_t *m);
/* How many GPUs the pipeline has (by ordinal), and a request completed on GPU `ordinal`; only the
 * first TD_METRICS_GPUS_MAX are counted. */
void td_metrics_set_gpus(td_metrics_t *m, unsigned devices);
void td_metrics_count_gpu_request(td_metrics_t *m, int ordinal);

/* Renders the Prometheus text format into buf; returns the length it needed (like snprintf).
 * Besides tallyd's own: tallyd_build_info, the per-stream series (tallyd_stream_*), and the
 * standard process_* metrics of the process (CPU, memory, descriptors, start time), read from
 * getrusage and /proc at each call. */
size_t td_metrics_render(const td_metrics_t *m, const td_gauges_t *g, char *buf, size_t cap);

#endif
