/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_sched.h — the scheduler: what may run now, where, and what follows when it finishes.
 *
 * Every rule that orders requests or places them lives here, on the loop thread:
 *   - order on a named stream: requests apply in arrival order (the stream's FIFO); compute
 *     requests of a stream pipeline on the GPU (all on the lane the stream is pinned to, which
 *     completes them in order, the scan carry chained on the device); a CPU batch, a query, reset
 *     or delete, a histogram whose type is not yet known, a request whose seq is not the next one
 *     and anything after a GPU failure wait until the stream's earlier requests are done;
 *   - delete forgets the stream's name at once: a query, reset or delete queued behind it answers
 *     unknown_stream, the next compute request applied starts the stream anew, and a forgotten
 *     stream is removed once its FIFO is empty; so is a stream created by a request that failed
 *     (td_stream_t's life: a request that fails leaves no stream behind);
 *   - where a compute request runs: the CPU (on the loop thread for a batch of at most
 *     TD_EXEC_INLINE_MAX bytes, else a worker) or the GPU (in auto mode from its operation's
 *     threshold, td_config.h), on which device and lane (a stream's pinned lane, else the least
 *     loaded lane of the least loaded usable device; a request by device reference on its
 *     region's GPU, or on a GPU that reaches the region over peer access while the region's GPU
 *     has gpu_peer_queue requests placed on it and the other an idle lane), and whether a large
 *     shared-memory request is split over the device's lanes: only when those lanes have nothing else queued or running,
 *     or when it only fits the device buffers split (issue 9: with 8 requests in flight, pieces
 *     chained by the scan carry serialised where whole requests overlapped on the lanes; H100,
 *     16 MiB shm scan 0.68 x the H2D+D2H bound against above 0.8 unsplit);
 *   - what follows a result: a request that failed on the GPU, or was queued on the device behind
 *     one of its stream that did, runs again on the CPU (td_exec.c says why that is correct), then
 *     the host folds it into the stream and answers it, then the stream's next requests start;
 *   - a request refused at admission (a hist of another type: stream_state) while earlier
 *     requests of its stream run is answered once they are done, and nothing of the stream starts
 *     meanwhile, so its reply keeps its place in the stream's order;
 *   - fair service between peers: a compute request that will run on a CPU worker or a GPU lane
 *     waits in its connection's queue for that class while the workers (cpu_workers, +
 *     TD_SCHED_CPU_AHEAD) or the lanes (gpu_lane_depth each) are full, and the queues take turns
 *     by bytes (deficit round robin, TD_SCHED_QUANTUM, td_config.h); a stream has at most one
 *     request in such a queue, and its next waits until that one has its lane, so a stream's
 *     order holds; a tiny CPU batch runs at once on the loop thread (its shard's). With shards
 *     (issue 31) each has its own scheduler: the turns are between the connections whose
 *     requests that shard runs, and each shard fills the workers and lanes up to these bounds
 *     on its own (so with N shards up to N times as much waits on the shared machine); the
 *     placement on the lanes sees every shard's load (gpu_loads);
 *   - backpressure: every request counts against max_inflight from the moment it is read until
 *     it is answered; the server stops reading at the limit;
 *   - stopping: nothing new starts; a waiting request is answered `shutdown` once nothing of its
 *     stream runs any more, so a stream's replies still leave in order.
 *
 * The scheduler owns its per-stream record (FIFO, requests in flight, the GPU pin and carry);
 * it does not run anything itself: the machine (td_exec.c in tallyd, a fake in test_sched.c)
 * runs a request where td_placement_t says and hands it back with td_sched_finished, and the
 * host (the request path, td_path.c) answers, runs control operations and forgets deleted
 * streams.
 */
#ifndef TD_SCHED_H
#define TD_SCHED_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>

#include "td_config.h"
#include "td_err.h"
#include "td_counters.h"
#include "td_request.h"
#include "td_stream.h"

typedef struct td_sched td_sched_t;

/* What the scheduler places work on, and how it runs it. The GPU's shape is fixed at start
 * (gpu_devices 0: no GPU pipeline). */
typedef struct {
    void *ctx;
    unsigned gpu_devices;
    unsigned gpu_lanes;      /* per device */
    unsigned gpu_carries;    /* device scan carries per lane; index 0 is for stateless requests */
    /* This scheduler hands out carries gpu_carry_base + 1 .. gpu_carry_base + gpu_carries - 1 (the
     * shards share the lanes, each with a range of its own: td_exec_port_machine). */
    unsigned gpu_carry_base;
    /* What is placed on each device and lane and not back, shared by every scheduler on the
     * machine (the shards': their placement is the least loaded lane of all, and a device's
     * queue for the peer rule counts every shard's requests): gpu_devices x (1 + gpu_lanes)
     * counters, a device's then its lanes'. NULL: the scheduler keeps its own. */
    _Atomic unsigned *gpu_loads;
    size_t gpu_buffer_bytes; /* the most a lane's buffers hold of one batch (whole) */
    /* How much work is handed to the machine at once; the rest waits in the peers' queues, which
     * take turns (deficit round robin): requests on the CPU workers, cpu_workers (+
     * TD_SCHED_CPU_AHEAD), and per GPU lane gpu_lane_depth. 0: no limit. */
    unsigned cpu_workers;
    unsigned gpu_lane_depth;
    bool (*device_usable)(void *ctx, unsigned device);
    int (*device_ordinal)(void *ctx, unsigned device); /* for the per-GPU request counter */
    /* Can r run split over a device's lanes (the engine splits, r's input (and a scan's output)
     * in regions registered with the device, a hist or a scan)? */
    bool (*splittable)(void *ctx, const td_request_t *r);
    /* The devices other than its regions' own GPU that can run r, a request by device reference,
     * now (peer access; bit d: device d). NULL: none ever. */
    uint32_t (*region_peers)(void *ctx, const td_request_t *r);
    /* Runs r where r->where says; r comes back through td_sched_finished (at once, for an inline
     * CPU run). */
    void (*run)(void *ctx, td_request_t *r);
} td_sched_machine_t;

/* What the scheduler asks of the server. Each callback gets `owner`. */
typedef struct {
    void *owner;
    /* A compute request's result is in (r->stream, if any, is current up to r): fold it into its
     * stream and answer it. Returns false when it failed (nothing was applied). */
    bool (*complete)(void *owner, td_request_t *r);
    /* A query, reset or delete at the head of its drained stream: run it (r's reply is then
     * sent by `answer`). */
    void (*control)(void *owner, td_request_t *r, td_stream_t *stream);
    /* Sends r's reply (or drops it) and frees r; td_sched_answered follows from it. */
    void (*answer)(void *owner, td_request_t *r);
    /* A stream nothing refers to any more that is not live (td_stream_t's life: deleted, or
     * created by requests that all failed): forget its name (and free it). */
    void (*forget)(void *owner, td_stream_t *stream);
    unsigned shard; /* its queues in the per-peer entries: td_peer_flow's slots of this shard */
} td_sched_host_t;

/* cfg is the live configuration (max_inflight may be reloaded); metrics for the fallbacks and
 * the per-GPU counters. */
td_err_t td_sched_new(const td_config_t *cfg, td_metrics_t *metrics,
                      const td_sched_machine_t *machine, const td_sched_host_t *host,
                      td_sched_t **out);
void td_sched_destroy(td_sched_t **self_p);

/* ---- backpressure ------------------------------------------------------------------------ */

/* A message was read (it counts until td_sched_answered). */
void td_sched_received(td_sched_t *self);
/* Its reply was handed to its transport (td_transport.h). */
void td_sched_answered(td_sched_t *self);
/* Under max_inflight; always while stopping (every message is answered at once then). */
bool td_sched_may_read(const td_sched_t *self);
unsigned td_sched_inflight(const td_sched_t *self);
/* Requests waiting behind another one on their stream. */
unsigned td_sched_queued(const td_sched_t *self);

/* ---- requests ---------------------------------------------------------------------------- */

/* A request arrived. stream NULL: a stateless compute request, run at once. Else a compute
 * request or a query, reset or delete on `stream`: queued on its FIFO and started when the rules
 * allow. While stopping r is already failed (`shutdown`): it is answered at once, or queued
 * behind its stream's requests so that stream's replies keep their order. */
void td_sched_arrived(td_sched_t *self, td_request_t *r, td_stream_t *stream);
/* The machine hands r back with its result, or r->gpu_failed set. */
void td_sched_finished(td_sched_t *self, td_request_t *r);
/* Stopping: start nothing new; answer every waiting request `shutdown`, each once its stream's
 * running requests are done (then as they finish). */
void td_sched_stop(td_sched_t *self);

#endif
