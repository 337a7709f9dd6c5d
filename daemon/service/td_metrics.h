/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_metrics.h — the Prometheus text rendering of tallyd's counters (td_counters.h, kept by the
 * request path) and of the gauges the loop reads when asked (td_gauges_t).
 *
 * The counters are plain integers, each shard's owned by its thread and summed on the loop thread
 * while the shards are held still (td_path_sum_metrics), so updating them needs no atomics.
 * Anything that reads them from another thread (the HTTP exporter) asks the loop thread for a
 * rendered snapshot instead.
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
#include "td_counters.h"
#include "td_zmq_front.h"
#include "td_reply.h"
#include "tally_proto.h"
#include "td_stream.h"

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
    unsigned gpu_regions;  /* of them device regions (imported on a GPU), and their bytes */
    uint64_t gpu_region_bytes;
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
    td_reply_gauges_t reply;             /* unread replies (td_reply.h) */
    unsigned shards;                     /* the request path's shards (issue 31), and each one's */
    const struct td_shard_gauges *shard;
    unsigned fronts; /* the fronts (td_zmq_front.h), and what each has done */
    const td_front_counts_t *front;
    const struct td_fleet_status *fleet; /* the NATS fleet worker's (td_fleet_status.h), or NULL */
} td_gauges_t;

size_t td_metrics_render(const td_metrics_t *m, const td_gauges_t *g, char *buf, size_t cap);

#endif
