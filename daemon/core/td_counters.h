/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_counters.h — tallyd's counters, kept by the request path (td_metrics_t: requests by op and
 * status, latency buckets, bytes, fallbacks, refusals by limit). service/td_metrics.h renders
 * them as Prometheus text; they live here, below it, so the request path counts without
 * depending on the service around it.
 *
 * The counters are plain integers owned by one thread: each shard has its own (issue 31; every
 * request is answered on its shard's thread), and the loop thread its own for what it counts (the
 * transports, the snapshots), so updating them needs no atomics. The loop thread sums them while
 * it holds the shards still (td_path_sum_metrics); anything that reads them from another thread
 * (the HTTP exporter) asks the loop thread for a rendered snapshot instead.
 *
 * A counter that is one increment is written directly (`m->read_pauses++`: the field's name and
 * comment say what it counts, and a function per counter would say nothing more); a write that
 * needs more than that goes through a function here (a request's status and latency bucket, a
 * GPU's ordinal kept inside the table), and so does the sum the status line reads.
 */
#ifndef TD_COUNTERS_H
#define TD_COUNTERS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tally_proto.h"

/* GPUs whose completed requests are counted one by one (tallyd_gpu_requests_total{device}). */
#define TD_METRICS_GPUS_MAX 16

/* Latency histogram upper bounds in microseconds (Prometheus `le` labels), plus +Inf. */
#define TD_LATENCY_BUCKETS 14
extern const double td_latency_bounds_us[TD_LATENCY_BUCKETS];

/* Where a GPU request's time goes, stage by stage (issue 34: tallyd_gpu_stage_seconds_total).
 * Stage i ends at the request's stamp i (td_request_t.gpu_stamp); stage 0 starts when the front
 * read it. Every stage is counted on the shard at the reply, but the last, the reply's way back
 * to the front, which the front counts. */
typedef enum {
    TD_GPU_STAGE_SUBMIT = 0,   /* read by the front -> handed to its lane by its shard */
    TD_GPU_STAGE_TO_LANE = 1,  /* -> started by its lane thread */
    TD_GPU_STAGE_LAUNCH = 2,   /* -> the launch's CUDA calls returned */
    TD_GPU_STAGE_DEVICE = 3,   /* -> its lane saw the device's work done */
    TD_GPU_STAGE_RETIRE = 4,   /* -> its reply built, on its shard's completion queue */
    TD_GPU_STAGE_BACK = 5,     /* -> taken off that queue on the shard's loop */
    TD_GPU_STAGE_APPLY = 6,    /* -> applied to its stream and answered */
    TD_GPU_STAGE_TO_FRONT = 7, /* -> its reply handed to its transport on the front */
    TD_GPU_STAGES = 8,
} td_gpu_stage_t;

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
    /* Of them, requests by device reference (PROTOCOL.md §10 "Device memory"): [0] run on the GPU
     * that holds the region, [1] on another one (peer access). */
    uint64_t gpu_region_requests[TD_METRICS_GPUS_MAX][2];
    uint64_t gpu_stage_ns[TD_GPU_STAGES];       /* summed over the requests counted in it */
    uint64_t gpu_stage_count[TD_GPU_STAGES];    /* requests counted in each stage */
    unsigned gpu_devices;                       /* how many of those to report */
    uint64_t limited[TD_LIMIT_COUNT];           /* requests refused by a per-peer limit */
} td_metrics_t;

/* Values that are not counters: sampled when rendering. */
/* A request answered: its opcode and status, bytes in and out, and latency. */
void td_metrics_observe(td_metrics_t *m, unsigned opcode, tally_status_t status, size_t bytes_in,
                        size_t bytes_out, uint64_t latency_ns);
/* Requests answered so far, whatever their operation and status. */
uint64_t td_metrics_answered(const td_metrics_t *m);
/* Adds every counter of src to dst (the shards' counters gathered, issue 31); the GPU count is
 * the larger. */
void td_metrics_add(td_metrics_t *dst, const td_metrics_t *src);
/* How many GPUs the pipeline has (by ordinal), and a request completed on GPU `ordinal`; only the
 * first TD_METRICS_GPUS_MAX are counted. */
void td_metrics_set_gpus(td_metrics_t *m, unsigned devices);
void td_metrics_count_gpu_request(td_metrics_t *m, int ordinal);
/* A request by device reference completed on GPU `ordinal`: peer when that is not the GPU
 * holding its region. */
void td_metrics_count_region_request(td_metrics_t *m, int ordinal, bool peer);
/* A GPU request's stages [first, last] from its stamps (stamp[i] ends stage i; `start` begins
 * stage 0): counted only when every one of them was stamped (a request rerun on the CPU is not). */
void td_metrics_gpu_stages(td_metrics_t *m, const uint64_t stamp[TD_GPU_STAGES], uint64_t start,
                           unsigned first, unsigned last);

/* Renders the Prometheus text format into buf; returns the length it needed (like snprintf).
 * Besides tallyd's own: tallyd_build_info, the per-stream series (tallyd_stream_*), and the
 * standard process_* metrics of the process (CPU, memory, descriptors, start time), read from
 * getrusage and /proc at each call. */
#endif
