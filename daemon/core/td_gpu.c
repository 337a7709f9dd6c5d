/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_gpu.c — the GPU pipeline (see td_gpu.h): devices, lanes, staging slots, lane threads and
 * the completion queue into the loop.
 *
 * Design
 * ------
 * Per device, `lanes` lanes (one CUDA stream each, --gpu-streams). Per lane, one thread and
 * `slots` staging slots (pinned host input and output buffers) plus one set of device buffers,
 * all allocated at start by the engine (td_gpu_engine.h), so the request path never allocates
 * device or pinned memory. The total device memory is reported for the device_memory_bytes
 * gauge.
 *
 * Why a thread per lane: the payload must be copied into pinned staging (ZeroMQ's frame is
 * pageable memory) and the reply out of it, and neither copy may run on the loop thread (a
 * 16 MiB memcpy is milliseconds). The CUDA calls of one lane must also be enqueued in the
 * order the requests arrived, because a stream's scan carry chains on the device from one
 * request to the next. One thread per lane gives both: it takes its lane's requests in FIFO
 * order, fills a free slot and enqueues H2D, kernel, D2H and cudaLaunchHostFunc; while that
 * slot is on the device it fills the next one, and the other lanes' threads do the same, so
 * the copies of one batch overlap the kernels of others.
 *
 * Completion: slots retire strictly in launch order: the reply is built (a filter's or scan's
 * output of up to TD_GPU_REPLY_BUF_BYTES was copied by the device straight into one of the
 * device's pinned reply buffers, which becomes the reply payload as it is and goes back to the
 * pool when ZeroMQ has sent it; a larger output, or one launched while every buffer was out, is
 * copied out of pinned staging into a malloc'd reply), the slot is freed, and the request goes onto
 * the pipeline's mutex-protected completion queue with uv_async_send. The async callback on the
 * loop thread drains the whole queue (wake-ups coalesce), so one wake-up can answer many requests.
 * The lane thread does this, not the host function (which only marks the slot done): the brief had
 * the host function push to the completion queue directly, but building the reply there blocks the
 * lane's CUDA stream (see slot_done), and a multi-megabyte copy-out must stay off the loop thread
 * too.
 *
 * Placement is the scheduler's (td_sched.c): each request arrives with the device and lane it
 * goes to, its carry index and whether it starts its stream's chain, and how many pieces it is
 * split into. Ordering: requests of one named stream all go to the lane the stream is pinned to
 * (for as long as it has requests in flight), so they are enqueued on one CUDA stream back to
 * back, retired in that order, and applied to the host copy of the stream's state in that order.
 * A lane's launch failure is retired in its place too (it is marked failed, not completed
 * early), so a later request never overtakes an earlier one.
 *
 * Stream state on the device: only the scan carry. It must chain there, because the next
 * batch's kernel needs it before the previous reply has come back; each stream in flight holds
 * one device int64 of its lane (handed out by the scheduler), initialised from the host copy
 * by the stream's first request in flight, whatever its operation (so a state restored from
 * disk, a reset or a CPU rerun is picked up, and a scan pipelined behind a hist never reads a
 * carry index last used by another stream), and updated in place by tk_cuda_scan. A stream's
 * running histogram stays on the host: every batch's histogram comes back in its reply anyway,
 * adding 256 counters there is free, and query needs no device round trip.
 *
 * Failures: a failed launch (the tests inject them with the fault engine, td_gpu_fault.c) or
 * work the watchdog finds failed (an asynchronous kernel error never runs its host function;
 * lane threads with work on the device wake every TD_GPU_WATCHDOG_MS and ask the engine) comes
 * back with r->gpu_failed; td_sched.c reruns it on the CPU. Here a device counts its failures
 * in a row: at TD_GPU_DEAD_AFTER, or at once for a watchdog failure (the CUDA context is gone),
 * it is marked unusable, logged at err, and its lanes fail what they still hold (in order) so it
 * all reruns on the CPU.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "td_config.h"
#include "td_gpu.h"
#include "td_log.h"

/* How often a lane thread with work on the device checks for an asynchronous failure. Long
 * against any batch (16 MiB runs in well under a millisecond on an H100), short against a
 * client's timeout (5 s by default). */
#define TD_GPU_WATCHDOG_MS 200

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
    unsigned retiring; /* slots popped from the ring whose completion is not pushed yet */
    bool stop;
    atomic_uint events; /* bumped on every slot done and request queued (for spinning) */
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
    lane_t *lanes;
    unsigned lane_count;
    atomic_bool dead;
    unsigned errors_in_row; /* loop thread only */
};

struct td_gpu {
    uv_loop_t *loop;
    td_gpu_engine_t *engine;
    td_gpu_opts_t opts;
    unsigned carries; /* per lane: index 0 for requests without a stream */
    td_gpu_complete_fn complete;
    void *owner;
    device_t *devices;
    unsigned device_count;
    uint64_t device_bytes;

    uv_async_t async;
    bool async_open; /* written under done_lock once the lane threads run */
    pthread_mutex_t done_lock;
    td_request_queue_t done;
};

/* ---- lane thread -------------------------------------------------------------------------- */

/* The host function (CUDA's callback thread): marks the slot done and wakes the lane thread,
 * nothing more. A host function blocks its CUDA stream until it returns, so any work here (the
 * reply's copy, even for a 64 KiB batch) delays the lane's next batch; tried, the 64 KiB hist
 * throughput fell 14 - 24 % against the echo (bench/NOTES.md). No CUDA calls here. */
static void slot_done(void *arg)
{
    slot_t *slot = arg;
    lane_t *l = slot->lane;
    pthread_mutex_lock(&l->lock);
    if (slot->state == SLOT_INFLIGHT) /* else the watchdog already failed it */
        slot->state = SLOT_DONE;
    atomic_fetch_add(&l->events, 1);
    pthread_cond_signal(&l->cond);
    pthread_mutex_unlock(&l->lock);
}

/* The wake-up is sent under the lock: the loop cannot see (and answer) this request before the
 * send is done, so the last request's send never races td_gpu_close. */
static void push_completion(td_gpu_t *g, td_request_t *r)
{
    pthread_mutex_lock(&g->done_lock);
    td_request_queue_push(&g->done, r);
    if (g->async_open)
        uv_async_send(&g->async);
    pthread_mutex_unlock(&g->done_lock);
}

static void *pool_take(reply_pool_t *p, size_t bytes)
{
    void *buf = NULL;
    if (bytes > p->buf_bytes)
        return NULL;
    pthread_mutex_lock(&p->lock);
    if (p->free_count)
        buf = p->free_bufs[--p->free_count];
    pthread_mutex_unlock(&p->lock);
    return buf;
}

/* A reply's free function (zmq_free_fn): any thread. */
static void pool_give_back(void *buf, void *hint)
{
    reply_pool_t *p = hint;
    pthread_mutex_lock(&p->lock);
    p->free_bufs[p->free_count++] = buf;
    pthread_mutex_unlock(&p->lock);
}

static void pool_open(reply_pool_t *p, td_gpu_engine_t *engine, int ordinal, size_t max_batch)
{
    p->lock = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER; /* cannot fail, unlike _init */
    p->engine = engine;
    p->buf_bytes = 2 * max_batch < TD_GPU_REPLY_BUF_BYTES ? 2 * max_batch : TD_GPU_REPLY_BUF_BYTES;
    p->all = calloc(TD_GPU_REPLY_BUFS, sizeof *p->all);
    p->free_bufs = calloc(TD_GPU_REPLY_BUFS, sizeof *p->free_bufs);
    for (unsigned i = 0; p->all && p->free_bufs && i < TD_GPU_REPLY_BUFS; i++) {
        void *buf = engine->host_alloc(engine->ctx, ordinal, p->buf_bytes);
        if (!buf) /* fewer buffers: more replies take the copy, nothing else changes */
            break;
        p->all[p->count++] = buf;
        p->free_bufs[p->free_count++] = buf;
    }
}

/* After the lanes are closed and ZeroMQ has given back every reply (zmq_ctx_term). */
static void pool_close(reply_pool_t *p)
{
    if (p->free_count != p->count)
        td_warn("GPU reply buffers: %u of %u never given back", p->count - p->free_count, p->count);
    for (unsigned i = 0; i < p->count; i++)
        p->engine->host_free(p->engine->ctx, p->all[i]);
    free(p->all);
    free(p->free_bufs);
    p->all = p->free_bufs = NULL;
    p->count = p->free_count = 0;
    pthread_mutex_destroy(&p->lock);
}

/* The most bytes the device writes back for r's output: the filter copies all n elements back
 * (td_gpu_cuda.c says why), the scan n sums. 0 for a hist (its reply is built on the host). */
static size_t output_bytes(const td_request_t *r)
{
    size_t n = td_request_elements(r);
    if (r->req.opcode == TALLY_OP_FILTER)
        return n * tally_dtype_size((tally_dtype_t)r->req.dtype);
    if (r->req.opcode == TALLY_OP_SCAN)
        return n * ((r->req.flags & TALLY_FLAG_SCAN_OUT_I32) ? 4 : 8);
    return 0;
}

/* Builds the reply from the slot's staging (lane thread, no lock held). */
static void build_reply(lane_t *l, slot_t *slot)
{
    td_request_t *r = slot->r;
    td_gpu_staging_t *s = &l->staging[slot->index];
    if (r->req.opcode == TALLY_OP_HIST) {
        r->hist = s->small->hist;
        td_request_hist_result(r);
        return;
    }
    size_t n = td_request_elements(r);
    bool scan = r->req.opcode == TALLY_OP_SCAN;
    size_t count = scan ? n : (size_t)s->small->kept;
    size_t bytes = output_bytes(r) / (n ? n : 1) * count; /* bytes per element x count */
    if (count > n) { /* a count the kernel cannot have produced: distrust the batch */
        r->gpu_failed = true;
        return;
    }
    /* The device wrote the output where the reply goes (an output region, or a pinned reply
     * buffer sent as it is), or into staging, from where it is copied into a malloc'd reply. */
    void *lent = slot->reply_buf;
    bool direct = lent || td_shm_region_direct(r->shm_out);
    void *out = r->out_ptr ? r->out_ptr : lent;
    if (!out)
        out = malloc(bytes ? bytes : 1);
    if (!out) {
        td_request_fail(r, TALLY_E_INTERNAL, "out of memory for a reply of %zu bytes", bytes);
        return;
    }
    if (!direct)
        memcpy(out, s->out, bytes);
    if (scan)
        td_request_scan_result(r, out, s->small->carry);
    else
        td_request_filter_result(r, out, count);
    if (lent) { /* the request owns it now, and gives it back to the pool when freed */
        td_request_lend_reply(r, pool_give_back, &l->dev->pool);
        slot->reply_buf = NULL;
    }
}

/* Builds the reply of a slot popped from the ring (l->retiring counts it), frees the slot and
 * pushes the request to the loop. Completions leave in ring order: only one slot of a lane is
 * being retired at a time. */
static void retire(lane_t *l, slot_t *slot)
{
    td_request_t *r = slot->r;
    if (slot->state == SLOT_FAILED)
        r->gpu_failed = true;
    else
        build_reply(l, slot);
    if (slot->reply_buf) { /* not handed to the reply: the request failed */
        pool_give_back(slot->reply_buf, &l->dev->pool);
        slot->reply_buf = NULL;
    }
    pthread_mutex_lock(&l->lock);
    slot->state = SLOT_FREE;
    slot->r = NULL;
    push_completion(l->gpu, r);
    l->retiring--;
    pthread_cond_signal(&l->cond);
    pthread_mutex_unlock(&l->lock);
}

static td_gpu_job_t make_job(const td_request_t *r, unsigned slot)
{
    td_gpu_job_t job = {
        .opcode = r->req.opcode,
        .dtype = r->req.dtype,
        .n = td_request_elements(r),
        .spec =
            {
                .pred = (tally_pred_t)r->req.pred,
                .lo = r->req.lo,
                .hi = r->req.hi,
                .stable = (r->req.flags & TALLY_FLAG_FILTER_STABLE) != 0,
            },
        .exclusive = (r->req.flags & TALLY_FLAG_SCAN_EXCLUSIVE) != 0,
        .out_i32 = (r->req.flags & TALLY_FLAG_SCAN_OUT_I32) != 0,
        .lo = r->req.lo,
        .hi = r->req.hi,
        .carry_index = r->where.carry_index,
        .carry_upload = r->where.carry_upload,
        .slot = slot,
        /* A registered shared-memory region is copied to and from directly. */
        .src = td_shm_region_direct(r->shm_in) ? r->payload : NULL,
        .dst = td_shm_region_direct(r->shm_out) ? r->out_ptr : NULL,
    };
    unsigned gpu; /* a device region is read in place (td_sched placed r on its GPU) */
    if (td_shm_region_device(r->shm_in, &gpu, &job.dev_import))
        job.dev_src = r->payload;
    return job;
}

bool td_gpu_splittable(const td_gpu_t *g, const td_request_t *r)
{
    bool direct_in = td_shm_region_direct(r->shm_in);
    bool direct_out = td_shm_region_direct(r->shm_out);
    return g->engine->lane_launch_split && direct_in &&
           (r->req.opcode == TALLY_OP_HIST || (r->req.opcode == TALLY_OP_SCAN && direct_out));
}

/* Fills the slot and launches it (lane thread, no lock held; the slot is already in the ring
 * as SLOT_INFLIGHT, or SLOT_FAILED when the device is unusable). */
static void launch(lane_t *l, slot_t *slot)
{
    td_request_t *r = slot->r;
    if (slot->state == SLOT_FAILED)
        return;
    td_gpu_staging_t *s = &l->staging[slot->index];
    td_gpu_job_t job = make_job(r, slot->index);
    const td_gpu_engine_t *e = l->gpu->engine;
    unsigned pieces = r->where.pieces;
    tally_status_t st = TALLY_E_BACKEND;
    /* A batch above the buffers only comes here when it splits (td_sched.c); never overrun the
     * staging slot should that ever not hold: fail it, and the CPU reruns it. */
    bool in_place_hist = job.dev_src && r->req.opcode == TALLY_OP_HIST; /* no device buffer */
    if (pieces < 2 && r->payload_len > l->gpu->opts.max_batch && !in_place_hist)
        goto failed;
    /* A ZeroMQ payload (pageable) goes through pinned staging; a device region's payload is a
     * device address, never read here. */
    if (job.src == NULL && job.dev_src == NULL)
        memcpy(s->in, r->payload, r->payload_len);
    if (job.dst == NULL && !r->out_ptr && output_bytes(r)) /* the reply, built in place */
        job.dst = slot->reply_buf = pool_take(&l->dev->pool, output_bytes(r));
    s->small->carry = r->carry;
    if (pieces > 1) {
        td_debug("request %" PRIu64 ": %zu bytes split into %u pieces over the %u lanes of GPU %d",
                 r->rep.request_id, r->payload_len, pieces, l->dev->lane_count, l->dev->ordinal);
        st = e->lane_launch_split(l->hw, (void *const *)l->peer_hw, l->dev->lane_count, pieces,
                                  &job, slot_done, slot);
    } else {
        st = e->lane_launch(l->hw, &job, slot_done, slot);
    }
    if (st == TALLY_OK)
        return;
failed:
    td_warn("GPU %d (%s) lane %u: launch of request %" PRIu64 " failed: %s", l->dev->ordinal,
            l->dev->name, l->index, r->rep.request_id, e->error_string());
    pthread_mutex_lock(&l->lock);
    slot->state = SLOT_FAILED;
    pthread_cond_signal(&l->cond);
    pthread_mutex_unlock(&l->lock);
}

/* The device failed under work that will never complete: fail everything on it. Lock held. */
static void watchdog_fail(lane_t *l)
{
    for (unsigned i = 0; i < l->ring_count; i++) {
        slot_t *slot = &l->slots[l->ring[(l->ring_head + i) % l->gpu->opts.slots]];
        if (slot->state == SLOT_INFLIGHT)
            slot->state = SLOT_FAILED;
    }
}

static bool ring_has_inflight(const lane_t *l)
{
    for (unsigned i = 0; i < l->ring_count; i++)
        if (l->slots[l->ring[(l->ring_head + i) % l->gpu->opts.slots]].state == SLOT_INFLIGHT)
            return true;
    return false;
}

static slot_t *take_free_slot(lane_t *l)
{
    for (unsigned i = 0; i < l->gpu->opts.slots; i++)
        if (l->slots[i].state == SLOT_FREE && !l->slots[i].r)
            return &l->slots[i];
    return NULL;
}

static void wait_with_watchdog(lane_t *l)
{
    if (!ring_has_inflight(l)) {
        pthread_cond_wait(&l->cond, &l->lock);
        return;
    }
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_nsec += (long)TD_GPU_WATCHDOG_MS * 1000000L;
    deadline.tv_sec += deadline.tv_nsec / 1000000000L;
    deadline.tv_nsec %= 1000000000L;
    if (pthread_cond_timedwait(&l->cond, &l->lock, &deadline) == 0)
        return;
    if (!ring_has_inflight(l) || l->gpu->engine->lane_check(l->hw) == TALLY_OK)
        return;
    if (!atomic_exchange(&l->dev->dead, true))
        td_err("GPU %d (%s) is unusable: %s; its work goes to the CPU backend", l->dev->ordinal,
               l->dev->name, l->gpu->engine->error_string());
    watchdog_fail(l);
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* With work on the device, polls (lock released) up to spin_us for an event before the caller
 * sleeps. Returns true when one came. Lock held on entry and return. */
static bool spin_for_event(lane_t *l)
{
    if (!l->gpu->opts.spin_us || !ring_has_inflight(l))
        return false;
    unsigned seen = atomic_load(&l->events);
    uint64_t until = now_ns() + (uint64_t)l->gpu->opts.spin_us * 1000u;
    bool got = false;
    pthread_mutex_unlock(&l->lock);
    while (!(got = atomic_load(&l->events) != seen) && now_ns() < until) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    pthread_mutex_lock(&l->lock);
    /* An event between the last poll and the lock would otherwise be slept through. */
    return got || atomic_load(&l->events) != seen;
}

static void *lane_main(void *arg)
{
    lane_t *l = arg;
    unsigned slots = l->gpu->opts.slots;
    char name[16]; /* for profiles and top -H: "tdlane-0.3" is device 0, lane 3 */
    snprintf(name, sizeof name, "tdlane-%d.%u", l->dev->ordinal % 100, l->index % 100);
    pthread_setname_np(pthread_self(), name);
    if (l->gpu->engine->lane_bind(l->hw) != TALLY_OK)
        atomic_store(&l->dev->dead, true);
    pthread_mutex_lock(&l->lock);
    for (;;) {
        /* 1. Retire finished slots, strictly in launch order. */
        if (l->ring_count && !l->retiring) {
            slot_t *head = &l->slots[l->ring[l->ring_head]];
            if (head->state == SLOT_DONE || head->state == SLOT_FAILED) {
                l->ring_head = (l->ring_head + 1) % slots;
                l->ring_count--;
                l->retiring++;
                pthread_mutex_unlock(&l->lock);
                retire(l, head);
                pthread_mutex_lock(&l->lock);
                continue;
            }
        }
        /* 2. Start the next waiting request when a slot is free. */
        slot_t *slot = l->waiting.head ? take_free_slot(l) : NULL;
        if (slot) {
            slot->r = td_request_queue_pop(&l->waiting);
            slot->state = atomic_load(&l->dev->dead) ? SLOT_FAILED : SLOT_INFLIGHT;
            l->ring[(l->ring_head + l->ring_count) % slots] = slot->index;
            l->ring_count++;
            pthread_mutex_unlock(&l->lock);
            launch(l, slot);
            pthread_mutex_lock(&l->lock);
            continue;
        }
        if (l->stop && !l->ring_count && !l->waiting.head && !l->retiring)
            break;
        if (!spin_for_event(l))
            wait_with_watchdog(l);
    }
    pthread_mutex_unlock(&l->lock);
    return NULL;
}

/* ---- loop thread -------------------------------------------------------------------------- */

static lane_t *lane_of(const td_gpu_t *g, const td_request_t *r)
{
    return &g->devices[r->where.device].lanes[r->where.lane];
}

static void note_result(device_t *d, const td_request_t *r)
{
    if (!r->gpu_failed) {
        d->errors_in_row = 0;
        return;
    }
    d->errors_in_row++;
    if (d->errors_in_row >= TD_GPU_DEAD_AFTER && !atomic_exchange(&d->dead, true))
        td_err("GPU %d (%s) is unusable after %u errors in a row; its work goes to the CPU "
               "backend",
               d->ordinal, d->name, d->errors_in_row);
}

static void async_cb(uv_async_t *handle)
{
    td_gpu_t *g = handle->data;
    pthread_mutex_lock(&g->done_lock);
    td_request_t *r = td_request_queue_take_all(&g->done);
    pthread_mutex_unlock(&g->done_lock);
    while (r) {
        td_request_t *next = r->next;
        note_result(lane_of(g, r)->dev, r);
        g->complete(g->owner, r);
        r = next;
    }
}

void td_gpu_submit(td_gpu_t *g, td_request_t *r)
{
    lane_t *l = lane_of(g, r);
    pthread_mutex_lock(&l->lock);
    td_request_queue_push(&l->waiting, r);
    atomic_fetch_add(&l->events, 1);
    pthread_cond_signal(&l->cond);
    pthread_mutex_unlock(&l->lock);
}

bool td_gpu_usable(const td_gpu_t *g)
{
    for (unsigned i = 0; i < g->device_count; i++)
        if (!atomic_load(&g->devices[i].dead))
            return true;
    return false;
}

unsigned td_gpu_devices_lost(const td_gpu_t *g)
{
    unsigned lost = 0;
    for (unsigned i = 0; i < g->device_count; i++)
        lost += atomic_load(&g->devices[i].dead);
    return lost;
}

bool td_gpu_device_usable(const td_gpu_t *g, unsigned device)
{
    return device < g->device_count && !atomic_load(&g->devices[device].dead);
}

int td_gpu_device_ordinal(const td_gpu_t *g, unsigned device)
{
    return device < g->device_count ? g->devices[device].ordinal : -1;
}

unsigned td_gpu_lanes(const td_gpu_t *g)
{
    return g->opts.lanes;
}

unsigned td_gpu_carries(const td_gpu_t *g)
{
    return g->carries;
}

bool td_gpu_region_register(td_gpu_t *g, void *base, size_t size, bool read_only)
{
    tally_status_t st = g->engine->region_register(g->engine->ctx, base, size, read_only);
    if (st != TALLY_OK)
        td_warn("cannot register a shared-memory region of %zu bytes with %s (%s): its requests "
                "go through staging",
                size, g->engine->name, g->engine->error_string());
    return st == TALLY_OK;
}

void td_gpu_region_unregister(td_gpu_t *g, void *base)
{
    g->engine->region_unregister(g->engine->ctx, base);
}

/* The usable device with this UUID, or -1. */
static int device_by_uuid(const td_gpu_t *g, const uint8_t *uuid)
{
    for (unsigned i = 0; i < g->device_count; i++) {
        const device_t *d = &g->devices[i];
        if (d->has_uuid && !atomic_load(&d->dead) && memcmp(d->uuid, uuid, sizeof d->uuid) == 0)
            return (int)i;
    }
    return -1;
}

void td_gpu_uuid_string(const uint8_t *uuid, char *buf, size_t cap)
{
    const uint8_t *u = uuid;
    snprintf(buf, cap, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
             u[14], u[15]);
}

size_t td_gpu_uuids(const td_gpu_t *g, char *buf, size_t cap)
{
    size_t len = 0;
    if (cap)
        buf[0] = '\0';
    for (unsigned i = 0; g && i < g->device_count; i++) {
        const device_t *d = &g->devices[i];
        if (!d->has_uuid || atomic_load(&d->dead) || len + 42 > cap)
            continue;
        if (len)
            buf[len++] = ',';
        td_gpu_uuid_string(d->uuid, buf + len, cap - len);
        len += strlen(buf + len);
    }
    return len;
}

tally_status_t td_gpu_dev_import(td_gpu_t *g, const uint8_t *uuid, int fd, uint64_t size,
                                 bool writable, const uint8_t *event, unsigned *gpu, void **import,
                                 void **ptr, char *why, size_t why_cap)
{
    int i = device_by_uuid(g, uuid);
    if (i < 0) {
        char s[48];
        td_gpu_uuid_string(uuid, s, sizeof s);
        snprintf(why, why_cap, "no GPU with UUID %s", s);
        return TALLY_E_BAD_REF;
    }
    if (!g->engine->dev_import) {
        snprintf(why, why_cap, "the %s engine cannot import GPU memory", g->engine->name);
        return TALLY_E_BAD_REF;
    }
    tally_status_t st = g->engine->dev_import(g->engine->ctx, g->devices[i].ordinal, fd, size,
                                              writable, event, import, ptr, why, why_cap);
    *gpu = (unsigned)i;
    if (st == TALLY_E_BACKEND) { /* the device's own failure: `internal` (PROTOCOL.md §10) */
        td_warn("GPU %d: cannot import a device region: %s", g->devices[i].ordinal, why);
        st = TALLY_E_INTERNAL;
    }
    return st;
}

void td_gpu_dev_release(td_gpu_t *g, unsigned gpu, void *import)
{
    (void)gpu;
    g->engine->dev_release(g->engine->ctx, import);
}

unsigned td_gpu_device_count(const td_gpu_t *g)
{
    return g->device_count;
}

unsigned td_gpu_ordinals(const td_gpu_t *g)
{
    unsigned n = 0; /* ordinals, so a skipped device leaves its number out, not the last one */
    for (unsigned i = 0; i < g->device_count; i++)
        if ((unsigned)g->devices[i].ordinal + 1 > n)
            n = (unsigned)g->devices[i].ordinal + 1;
    return n;
}

uint64_t td_gpu_device_bytes(const td_gpu_t *g)
{
    return g->device_bytes;
}

const char *td_gpu_engine_name(const td_gpu_t *g)
{
    return g->engine->name;
}

void td_gpu_describe(const td_gpu_t *g, char *buf, size_t cap)
{
    size_t len = (size_t)snprintf(buf, cap, "%s:", g->engine->name);
    for (unsigned i = 0; i < g->device_count && len < cap; i++) {
        const device_t *d = &g->devices[i];
        len += (size_t)snprintf(buf + len, cap - len, "%s %d:%s (%u CUDA streams%s)", i ? "," : "",
                                d->ordinal, d->name, d->lane_count,
                                atomic_load(&d->dead) ? ", unusable" : "");
    }
}

/* ---- life cycle --------------------------------------------------------------------------- */

static tally_status_t lane_open(td_gpu_t *g, device_t *d, lane_t *l, unsigned index, char *why,
                                size_t why_cap)
{
    unsigned slots = g->opts.slots;
    l->gpu = g;
    l->dev = d;
    l->index = index;
    l->lock = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER; /* cannot fail, unlike _init */
    l->cond = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
    atomic_init(&l->events, 0);
    l->staging = calloc(slots, sizeof *l->staging);
    l->slots = calloc(slots, sizeof *l->slots);
    l->ring = calloc(slots, sizeof *l->ring);
    if (!l->staging || !l->slots || !l->ring) {
        snprintf(why, why_cap, "out of memory");
        return TALLY_E_INTERNAL;
    }
    for (unsigned i = 0; i < slots; i++) {
        l->slots[i].lane = l;
        l->slots[i].index = i;
    }
    uint64_t bytes = 0;
    tally_status_t st = g->engine->lane_open(g->engine->ctx, d->ordinal, g->opts.max_batch, slots,
                                             g->carries, &l->hw, l->staging, &bytes, why, why_cap);
    if (st != TALLY_OK)
        return st;
    g->device_bytes += bytes;
    if (pthread_create(&l->thread, NULL, lane_main, l) != 0) {
        snprintf(why, why_cap, "cannot start a lane thread");
        return TALLY_E_INTERNAL;
    }
    l->thread_started = true;
    return TALLY_OK;
}

static void lane_close(td_gpu_t *g, lane_t *l)
{
    if (l->thread_started) {
        pthread_mutex_lock(&l->lock);
        l->stop = true;
        pthread_cond_signal(&l->cond);
        pthread_mutex_unlock(&l->lock);
        pthread_join(l->thread, NULL);
    }
    if (l->hw)
        g->engine->lane_close(l->hw);
    free(l->staging);
    free(l->slots);
    free(l->ring);
    free(l->peer_hw);
    pthread_cond_destroy(&l->cond);
    pthread_mutex_destroy(&l->lock);
}

static void device_close(td_gpu_t *g, device_t *d)
{
    for (unsigned i = 0; d->lanes && i < d->lane_count; i++)
        lane_close(g, &d->lanes[i]);
    free(d->lanes);
    d->lanes = NULL;
    pool_close(&d->pool);
}

static tally_status_t device_open(td_gpu_t *g, device_t *d, int ordinal, char *why, size_t cap)
{
    d->ordinal = ordinal;
    atomic_init(&d->dead, false);
    g->engine->describe(g->engine->ctx, ordinal, d->name, sizeof d->name);
    d->has_uuid = g->engine->device_uuid(g->engine->ctx, ordinal, d->uuid) == TALLY_OK;
    pool_open(&d->pool, g->engine, ordinal, g->opts.max_batch);
    d->lanes = calloc(g->opts.lanes, sizeof *d->lanes);
    if (!d->lanes) {
        snprintf(why, cap, "out of memory");
        pool_close(&d->pool);
        return TALLY_E_INTERNAL;
    }
    d->lane_count = g->opts.lanes;
    for (unsigned i = 0; i < d->lane_count; i++) {
        tally_status_t st = lane_open(g, d, &d->lanes[i], i, why, cap);
        if (st != TALLY_OK) {
            d->lane_count = i + 1; /* close what was opened, this one included */
            device_close(g, d);
            return st;
        }
    }
    /* Before any request arrives (the lane threads read it under their lock, after a submit). */
    for (unsigned i = 0; i < d->lane_count; i++) {
        lane_t *l = &d->lanes[i];
        l->peer_hw = calloc(d->lane_count, sizeof *l->peer_hw);
        if (!l->peer_hw) {
            snprintf(why, cap, "out of memory");
            device_close(g, d);
            return TALLY_E_INTERNAL;
        }
        for (unsigned k = 0; k < d->lane_count; k++)
            l->peer_hw[k] = d->lanes[(i + k) % d->lane_count].hw;
    }
    return TALLY_OK;
}

td_err_t td_gpu_new(uv_loop_t *loop, td_gpu_engine_t *engine, const td_gpu_opts_t *opts,
                    td_gpu_complete_fn complete, void *owner, td_gpu_t **out, char *why,
                    size_t why_cap)
{
    td_err_t err = TD_ERR_NOMEM;
    td_gpu_t *g = calloc(1, sizeof *g);
    if (!g) {
        snprintf(why, why_cap, "out of memory");
        engine->destroy(&engine);
        return TD_ERR_NOMEM;
    }
    g->loop = loop;
    g->engine = engine; /* owned from here: td_gpu_destroy frees it */
    g->done_lock = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER; /* cannot fail, unlike _init */
    int count = engine->device_count(engine->ctx);
    if (count <= 0) {
        snprintf(why, why_cap, "no device");
        err = TD_ERR_BACKEND;
        goto fail;
    }
    g->opts = *opts;
    g->carries = opts->max_inflight + 1;
    g->complete = complete;
    g->owner = owner;
    if (uv_async_init(loop, &g->async, async_cb) != 0) {
        snprintf(why, why_cap, "cannot create the completion wake-up");
        err = TD_ERR_LIBRARY;
        goto fail;
    }
    g->async.data = g;
    g->async_open = true;
    g->devices = calloc((size_t)count, sizeof *g->devices);
    if (!g->devices) {
        snprintf(why, why_cap, "out of memory");
        goto fail;
    }
    for (int i = 0; i < count; i++) {
        char reason[256];
        device_t *d = &g->devices[g->device_count];
        if (device_open(g, d, i, reason, sizeof reason) == TALLY_OK) {
            g->device_count++;
            continue;
        }
        td_warn("GPU %d skipped: %s", i, reason);
        snprintf(why, why_cap, "%s", reason);
        memset(d, 0, sizeof *d);
    }
    if (g->device_count == 0) {
        err = TD_ERR_BACKEND;
        goto fail;
    }
    *out = g;
    return TD_OK;
fail:
    td_gpu_destroy(&g);
    return err;
}

void td_gpu_close(td_gpu_t *g)
{
    if (!g || !g->async_open)
        return;
    pthread_mutex_lock(&g->done_lock);
    g->async_open = false;
    pthread_mutex_unlock(&g->done_lock);
    uv_close((uv_handle_t *)&g->async, NULL);
}

void td_gpu_destroy(td_gpu_t **self_p)
{
    td_gpu_t *g = *self_p;
    if (!g)
        return;
    for (unsigned i = 0; i < g->device_count; i++)
        device_close(g, &g->devices[i]);
    free(g->devices);
    if (g->async_open) { /* only on a failed td_gpu_new: the loop never ran with it */
        uv_close((uv_handle_t *)&g->async, NULL);
        uv_run(g->loop, UV_RUN_NOWAIT);
    }
    pthread_mutex_destroy(&g->done_lock);
    if (g->engine)
        g->engine->destroy(&g->engine);
    free(g);
    *self_p = NULL;
}
