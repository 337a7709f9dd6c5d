/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_gpu_int.h — what the two files of the GPU pipeline share (td_gpu.c: lane threads,
 * completion, submission; td_gpu_device.c: a device's life — its lanes and reply buffers opened
 * and closed, its context recreated after a failure, its device regions); nothing outside them
 * includes it. The design is described at the top of td_gpu.c.
 */
#ifndef TD_GPU_INT_H
#define TD_GPU_INT_H

#include <pthread.h>
#include <stdatomic.h>

#include "td_gpu.h"

typedef enum {
    SLOT_FREE = 0,
    SLOT_INFLIGHT, /* launched, waiting for the host function */
    SLOT_DONE,     /* results in staging */
    SLOT_FAILED,   /* to be retired as failed */
} slot_state_t;

typedef struct device device_t;
typedef struct lane lane_t;

typedef struct {
    lane_t *lane;
    unsigned index;
    slot_state_t state;
    td_request_t *r;
    void *reply_buf; /* a pinned reply buffer the device writes the output to, or NULL */
    uint64_t seq;    /* the lane's launch number (lane thread): done's count passes it when done */
} slot_t;

struct lane {
    td_gpu_t *gpu;
    device_t *dev;
    unsigned index;
    void *hw;
    void **peer_hw; /* this lane's hw, then the device's other lanes': where a split job goes */
    td_gpu_staging_t *staging;
    slot_t *slots;
    pthread_t thread;
    bool thread_started;

    /* Under lock: shared between the loop thread, the lane thread and the host function. */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    td_request_queue_t waiting; /* submitted, waiting for a slot, in order */
    unsigned *ring;             /* slot indices in launch order */
    unsigned ring_head;
    unsigned ring_count;
    unsigned retiring; /* slots popped from the ring whose completion is not pushed yet (read by
                        * device_idle: the lane thread itself finds it 0, its retire done) */
    bool stop;
    atomic_uint events; /* bumped on every slot done and request queued (for spinning) */
    /* Completion by count (td_gpu.c slot_done): the host functions of a lane run in its launch
     * order, so the slot of launch number s is done once more than s of them ran. */
    uint64_t launched;           /* lane thread only: launches whose done will come */
    _Atomic uint64_t done_count; /* host functions run */
    /* Polling (td_gpu.c spin_for_event): launches enqueue no host function; the lane thread
     * asks lane_finished while it spins and, before it sleeps with work on the device, one
     * wake-up at the stream's tail (lane_notify), pending until it ran (under lock). */
    bool poll;
    bool wake_pending;
    /* Polling with more than one launch on the device (td_gpu.c nap_for_head): the spin ran out
     * since the last retire or launch, so the lane naps and polls instead of spinning again. */
    bool napping;
    uint64_t nap_since; /* when it began (ns, CLOCK_MONOTONIC) */
};

/* The device's pinned reply buffers (TD_GPU_REPLY_BUFS in td_config.h says why). Taken by lane
 * threads at launch, given back by whoever frees the reply: ZeroMQ's I/O thread once it has sent
 * it, or the loop thread for a reply dropped or replaced. */
typedef struct {
    pthread_mutex_t lock;
    td_gpu_engine_t *engine;
    size_t buf_bytes;
    void **all;
    unsigned count;
    void **free_bufs; /* under lock */
    unsigned free_count;
} reply_pool_t;

struct device {
    int ordinal;
    reply_pool_t pool;
    char name[128];
    uint8_t uuid[TALLY_GPU_UUID_SIZE]; /* device regions name it (PROTOCOL.md §10) */
    bool has_uuid;
    bool described; /* ordinal, name and uuid set (at the first open) */
    lane_t *lanes;
    unsigned lane_count;
    uint64_t device_bytes; /* what its lanes took */
    bool pool_open;
    atomic_bool dead;
    atomic_bool context_lost; /* the watchdog found work failed asynchronously: recreate it */
    unsigned errors_in_row;   /* loop thread only */
    /* Recovery (td_gpu_device.c): its lanes and pool are open; a recovery runs on a worker (the
     * lanes are closed, the context recreated, the lanes opened again: nothing may be submitted
     * meanwhile); recoveries done; the context's generation, bumped by each, which the device
     * regions imported in it carry (an older one names memory the reset unmapped). */
    bool lanes_open;        /* under state_lock, or the recovery's worker while recovering */
    bool recovering;        /* under state_lock */
    unsigned recoveries;    /* under state_lock */
    atomic_uint generation; /* written on the loop thread, read by importing workers */
    unsigned peer_users; /* under state_lock: requests running on other devices over its regions */
};

/* Where a shard's completions go (issue 31): the completion queue of the loop that submitted
 * them, and its wake-up. One per shard; the lane threads push a request to the sink its shard
 * names (r->shard). */
typedef struct {
    td_gpu_t *gpu;
    uv_loop_t *loop;
    td_gpu_complete_fn complete;
    void *owner;
    uv_async_t async;
    bool open; /* written under lock once the lane threads run */
    pthread_mutex_t lock;
    td_request_queue_t done;
    /* --gpu-spin-loop (issue 34): this shard's loop polls instead of sleeping while its requests
     * are on the GPU. submitted: the shard's thread's count of those. */
    uv_idle_t spin;
    bool spin_open;
    unsigned submitted;
} sink_t;

struct td_gpu {
    uv_loop_t *loop; /* the wiring's: recoveries run from it */
    td_gpu_engine_t *engine;
    td_gpu_opts_t opts;
    unsigned carries; /* per lane: index 0 for requests without a stream, then each shard's */
    device_t *devices;
    unsigned device_count;
    /* The devices' bookkeeping that the shards share (lanes_open, recovering, recoveries,
     * errors_in_row, peer_users): every shard submits and completes on its own thread, and the
     * recoveries run from the wiring's loop. Taken once per submission and once per batch of
     * completions. */
    pthread_mutex_t state_lock;
    /* Polls the unusable devices until they are idle enough to recover (td_gpu_device.c); a
     * shard's completions that find a lost context wake it (recover_async). */
    uv_timer_t recover_timer;
    uv_async_t recover_async;
    bool recovery_open; /* both, opened together by td_gpu_new, closed by td_gpu_close */
    atomic_uint recovering; /* recoveries whose worker has not finished */
    sink_t *sinks;          /* opts.sinks of them */
};

/* ---- td_gpu.c ----------------------------------------------------------------------------- */

/* A lane's thread (started by td_gpu_lane_open). */
void *td_gpu_lane_main(void *arg);
/* Hands r to the loop (the completion queue and its wake-up); any thread. */
void td_gpu_push_completion(td_gpu_t *g, td_request_t *r);
/* A reply's free function for the device's pinned reply buffers (zmq_free_fn): any thread. */
void td_gpu_pool_give_back(void *buf, void *hint);
void *td_gpu_pool_take(reply_pool_t *p, size_t bytes);

/* ---- td_gpu_device.c ---------------------------------------------------------------------- */

/* Opens the device's reply buffers and lanes (with their threads) on `ordinal`; on failure
 * closes what it opened. Does not touch `dead`. */
td_gpu_err_t td_gpu_device_open(td_gpu_t *g, device_t *d, int ordinal, char *why, size_t cap);
/* Stops and joins its lane threads, closes its lanes and reply buffers (idle ones: a recovery
 * waits for that, td_gpu_destroy runs after the loop). */
void td_gpu_device_close(td_gpu_t *g, device_t *d);
/* The wiring's loop thread, state_lock held: starts the recovery of unusable devices that are
 * idle, and keeps polling for the others. */
void td_gpu_recover_check(td_gpu_t *g);
/* Waits for a recovery's worker still running (td_gpu_destroy, after the loop stopped). */
void td_gpu_recover_wait(td_gpu_t *g);
/* The engine's import of a device region (td_gpu_dev_import's *import), for a job. */
void *td_gpu_engine_import(void *import);

#endif
