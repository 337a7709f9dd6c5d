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
 * the mutex-protected completion queue of its shard's sink with uv_async_send. The async callback
 * on that shard's loop thread drains the whole queue (wake-ups coalesce), so one wake-up can
 * answer many requests. The lanes are shared by the shards (issue 31): each submits on its own
 * thread, and what they share of a device (whether it takes work, its failures in a row, the
 * requests on its peers) is under the pipeline's state lock; a shard that finds a lost context
 * wakes the wiring's loop, which recovers it.
 * The lane thread does this, not the host function (which only counts a launch done): the brief had
 * the host function push to the completion queue directly, but building the reply there blocks the
 * lane's CUDA stream (see slot_done), and a multi-megabyte copy-out must stay off the loop thread
 * too.
 *
 * Polling (--gpu-spin-us > 0, issue 34): a host function per launch costs a wake-up of CUDA's
 * one callback thread and holds its stream until that thread has run it; on the H200 every
 * device-region row stopped at about 30,000 requests a second whatever its size (bench/NOTES.md).
 * A spinning lane thread instead asks the engine whether its head slot's work has finished
 * (lane_finished: an event query), and its launches enqueue no host function; before it sleeps
 * with work on the device it asks for one wake-up at the stream's tail (lane_notify); with more
 * than one launch there it naps and asks again instead (nap_for_head), so that the head's reply
 * does not wait for the tail's kernel. Either way a slot is done by count, not by a flag its host
 * function sets, so a late host function can never mark a slot that was retired and launched
 * into again. --gpu-spin-loop keeps each shard's loop polling while its requests are on the GPU
 * (the sink's idle handle).
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
 * all reruns on the CPU. A lost context is recreated once the device is idle (td_gpu_device.c:
 * its lanes closed and opened again on a worker); then the device serves again.
 */
#include <inttypes.h>
#include <pthread.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "td_config.h"
#include "td_gpu_int.h"
#include "td_log.h"
#include "td_monotonic.h"

/* How often a lane thread with work on the device checks for an asynchronous failure. Long
 * against any batch (16 MiB runs in well under a millisecond on an H100), short against a
 * client's timeout (5 s by default). */
#define TD_GPU_WATCHDOG_MS 200
/* How often a spinning lane thread asks the engine whether its head slot's work finished. */
#define TD_GPU_POLL_NS 1000u
/* A polling lane with more than one launch on the device, its spin run out: how long it naps
 * between two questions (nap_for_head). */
#define TD_GPU_NAP_US 20u

/* ---- lane thread -------------------------------------------------------------------------- */

/* The host function (CUDA's callback thread): counts one more launch of the lane done and wakes
 * the lane thread, nothing more. A host function blocks its CUDA stream until it returns, so any
 * work here (the reply's copy, even for a 64 KiB batch) delays the lane's next batch; tried, the
 * 64 KiB hist throughput fell 14 - 24 % against the echo (bench/NOTES.md). No CUDA calls here.
 * It counts rather than marking its slot: a spinning lane thread may have seen the launch finish
 * first (lane_finished), retired the slot and launched into it again before this runs. */
static void slot_done(void *arg)
{
    lane_t *l = arg;
    pthread_mutex_lock(&l->lock);
    atomic_fetch_add(&l->done_count, 1);
    atomic_fetch_add(&l->events, 1);
    pthread_cond_signal(&l->cond);
    pthread_mutex_unlock(&l->lock);
}

/* The wake-up a polling lane asked for before sleeping (lane_notify): any thread. */
static void lane_wake(void *arg)
{
    lane_t *l = arg;
    pthread_mutex_lock(&l->lock);
    l->wake_pending = false;
    atomic_fetch_add(&l->events, 1);
    pthread_cond_signal(&l->cond);
    pthread_mutex_unlock(&l->lock);
}

/* Whether the slot at the head of the ring is finished: failed, seen finished while spinning
 * (spin_for_event), or counted done by the host functions. Lock held. */
static bool head_finished(lane_t *l, slot_t *slot)
{
    if (slot->state == SLOT_INFLIGHT && atomic_load(&l->done_count) > slot->seq)
        slot->state = SLOT_DONE;
    return slot->state == SLOT_DONE || slot->state == SLOT_FAILED;
}

/* r->shard is the shard that submitted it (td_path.c: one of the opts.sinks shards), unless
 * the front ran it and takes its completion (r->gpu_to_front: the last sink, the front's). */
static sink_t *sink_of(td_gpu_t *g, const td_request_t *r)
{
    return &g->sinks[r->gpu_to_front ? g->opts.sinks - 1 : r->shard];
}

/* The wake-up is sent under the lock: the loop cannot see (and answer) this request before the
 * send is done, so the last request's send never races td_gpu_sink_close. */
void td_gpu_push_completion(td_gpu_t *g, td_request_t *r)
{
    sink_t *k = sink_of(g, r);
    pthread_mutex_lock(&k->lock);
    td_request_queue_push(&k->done, r);
    if (k->open)
        uv_async_send(&k->async);
    pthread_mutex_unlock(&k->lock);
}

void *td_gpu_pool_take(reply_pool_t *p, size_t bytes)
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
void td_gpu_pool_give_back(void *buf, void *hint)
{
    reply_pool_t *p = hint;
    pthread_mutex_lock(&p->lock);
    p->free_bufs[p->free_count++] = buf;
    pthread_mutex_unlock(&p->lock);
}

/* The most bytes the device writes back for r's output: the filter copies all n elements back
 * (td_gpu_cuda.c says why), the scan n sums. 0 for the ops whose reply is a few values built on
 * the host from the small results (hist). */
static size_t output_bytes(const td_request_t *r)
{
    return (size_t)tally_shm_out_worst(&r->req, r->payload_len);
}

/* Builds the reply from the slot's staging (lane thread, no lock held). */
static void build_reply(lane_t *l, slot_t *slot)
{
    td_request_t *r = slot->r;
    td_gpu_staging_t *s = &l->staging[slot->index];
    if (r->req.opcode == TALLY_OP_HIST) {
        td_request_hist_result(r, &s->small->hist);
        return;
    }
    if (r->req.opcode == TALLY_OP_MINMAX) {
        td_request_minmax_result(r, s->small->minmax[0], s->small->minmax[1]);
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
    unsigned gpu;
    void *import;
    bool direct = lent || td_shm_region_direct(r->shm_out) ||
                  td_shm_region_device(r->shm_out, &gpu, &import); /* never read on the host */
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
        td_request_lend_reply(r, td_gpu_pool_give_back, &l->dev->pool);
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
        td_gpu_pool_give_back(slot->reply_buf, &l->dev->pool);
        slot->reply_buf = NULL;
    }
    r->gpu_stamp[TD_GPU_STAGE_RETIRE] = uv_hrtime();
    pthread_mutex_lock(&l->lock);
    slot->state = SLOT_FREE;
    slot->r = NULL;
    td_gpu_push_completion(l->gpu, r);
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
    void *import;
    if (td_shm_region_device(r->shm_in, &gpu, &import)) {
        job.dev_src = r->payload;
        job.dev_import = td_gpu_engine_import(import);
    }
    if (td_shm_region_device(r->shm_out, &gpu, &import)) { /* written in place */
        job.dev_dst = r->out_ptr;
        job.dev_out_import = td_gpu_engine_import(import);
    }
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
    td_gpu_err_t st = TD_GPU_E_DEVICE;
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
        job.dst = slot->reply_buf = td_gpu_pool_take(&l->dev->pool, output_bytes(r));
    s->small->carry = r->carry;
    slot->seq = l->launched; /* done (slot_done) is called for it only when the launch succeeds */
    td_gpu_done_fn done = l->poll ? NULL : slot_done; /* polling: no host function */
    if (pieces > 1) {
        td_debug("request %" PRIu64 ": %zu bytes split into %u pieces over the %u lanes of GPU %d",
                 r->rep.request_id, r->payload_len, pieces, l->dev->lane_count, l->dev->ordinal);
        st = e->lane_launch_split(l->hw, (void *const *)l->peer_hw, l->dev->lane_count, pieces,
                                  &job, done, l);
    } else {
        st = e->lane_launch(l->hw, &job, done, l);
    }
    if (st == TD_GPU_OK) {
        l->launched += done != NULL;
        return;
    }
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

/* A free slot holds no request: retire frees both at once, under the lock. */
static slot_t *take_free_slot(lane_t *l)
{
    for (unsigned i = 0; i < l->gpu->opts.slots; i++)
        if (l->slots[i].state == SLOT_FREE)
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
    if (!ring_has_inflight(l) || l->gpu->engine->lane_check(l->hw) == TD_GPU_OK)
        return;
    atomic_store(&l->dev->context_lost, true); /* td_gpu_device.c recreates it once idle */
    if (!atomic_exchange(&l->dev->dead, true))
        td_err("GPU %d (%s) is unusable: %s; its work goes to the CPU backend", l->dev->ordinal,
               l->dev->name, l->gpu->engine->error_string());
    watchdog_fail(l);
}

/* With work on the device, polls (lock released) up to spin_us for an event (a request queued,
 * a host function run) or for the head slot's work to finish (lane_finished: the GPU seen done
 * without waiting for CUDA's callback thread to wake and run the host function), before the
 * caller sleeps. Returns true when one came. Lock held on entry and return. */
static bool spin_for_event(lane_t *l)
{
    if (!l->gpu->opts.spin_us || l->napping || !ring_has_inflight(l))
        return false;
    unsigned seen = atomic_load(&l->events);
    /* The head is in flight: a finished or failed head is retired before the lane waits. */
    slot_t *head = &l->slots[l->ring[l->ring_head]];
    bool ask = l->gpu->engine->lane_finished != NULL;
    uint64_t until = td_mono_ns() + (uint64_t)l->gpu->opts.spin_us * 1000u;
    bool got = false, finished = false;
    uint64_t now = 0, asked = 0;
    pthread_mutex_unlock(&l->lock);
    /* Only this thread retires or launches: the head slot and its launch stay put meanwhile.
     * The engine is asked at most every TD_GPU_POLL_NS (a driver call; four lanes asking
     * back to back would contend for the driver with each other's launches). */
    while (!(got = atomic_load(&l->events) != seen) && (now = td_mono_ns()) < until) {
        if (ask && now - asked >= TD_GPU_POLL_NS) {
            asked = now;
            if ((finished = l->gpu->engine->lane_finished(l->hw, head->index)))
                break;
        }
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    pthread_mutex_lock(&l->lock);
    if (finished) /* only this thread changes a slot's state */
        head->state = SLOT_DONE;
    /* An event between the last poll and the lock would otherwise be slept through. */
    return got || finished || atomic_load(&l->events) != seen;
}

/* A polling lane whose spin ran out with more than one launch on the device naps TD_GPU_NAP_US
 * (or until an event) and asks the engine whether the head's work finished. The wake-up of
 * ask_wake comes at the stream's tail, after the last launch: with two 256 MiB histograms on a
 * lane, the first one's reply waited for the second's kernel (H200, 2026-12-02: 0.77-0.89 x read
 * polling against 0.95-1.02 with host functions, bench/NOTES.md). After TD_GPU_WATCHDOG_MS of
 * naps it leaves the head to ask_wake and the watchdog (a failed kernel never finishes). Returns
 * true when it napped. Lock held on entry and return. */
static bool nap_for_head(lane_t *l)
{
    if (!l->poll || l->ring_count < 2 || !ring_has_inflight(l))
        return false;
    slot_t *head = &l->slots[l->ring[l->ring_head]];
    if (head->state != SLOT_INFLIGHT)
        return false;
    if (!l->napping) {
        l->napping = true;
        l->nap_since = td_mono_ns();
    } else if (td_mono_ns() - l->nap_since > (uint64_t)TD_GPU_WATCHDOG_MS * 1000000u) {
        l->napping = false; /* so that the spin after the wake-up sees the head finish */
        return false;
    }
    unsigned seen = atomic_load(&l->events);
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_nsec += (long)TD_GPU_NAP_US * 1000L;
    deadline.tv_sec += deadline.tv_nsec / 1000000000L;
    deadline.tv_nsec %= 1000000000L;
    (void)pthread_cond_timedwait(&l->cond, &l->lock, &deadline);
    if (atomic_load(&l->events) != seen)
        return true;
    pthread_mutex_unlock(&l->lock); /* only this thread retires or launches: the head stays */
    bool finished = l->gpu->engine->lane_finished(l->hw, head->index);
    pthread_mutex_lock(&l->lock);
    if (finished && head->state == SLOT_INFLIGHT)
        head->state = SLOT_DONE;
    return true;
}

/* A polling lane about to sleep with work on the device asks for a wake-up once that work is
 * done (one at a time). Returns true when an event came meanwhile (the sim's wake-up comes at
 * once): look again rather than sleep. Lock held on entry and return. */
static bool ask_wake(lane_t *l)
{
    if (!ring_has_inflight(l) || l->wake_pending)
        return false;
    unsigned seen = atomic_load(&l->events);
    l->wake_pending = true;
    pthread_mutex_unlock(&l->lock);
    td_gpu_err_t st = l->gpu->engine->lane_notify(l->hw, lane_wake, l);
    pthread_mutex_lock(&l->lock);
    if (st != TD_GPU_OK) /* the watchdog's wake-ups remain; it finds a failed device */
        l->wake_pending = false;
    return atomic_load(&l->events) != seen;
}

void *td_gpu_lane_main(void *arg)
{
    lane_t *l = arg;
    unsigned slots = l->gpu->opts.slots;
    char name[16]; /* for profiles and top -H: "tdlane-0.3" is device 0, lane 3 */
    snprintf(name, sizeof name, "tdlane-%d.%u", l->dev->ordinal % 100, l->index % 100);
    pthread_setname_np(pthread_self(), name);
    const td_gpu_engine_t *e = l->gpu->engine;
    l->poll = l->gpu->opts.spin_us && e->lane_finished && e->lane_notify;
#ifdef __linux__
    if (l->poll) /* nap_for_head's naps of 20 us, not 20 + the default 50 us of timer slack */
        (void)prctl(PR_SET_TIMERSLACK, 1000UL);
#endif
    if (l->gpu->engine->lane_bind(l->hw) != TD_GPU_OK)
        atomic_store(&l->dev->dead, true);
    pthread_mutex_lock(&l->lock);
    for (;;) {
        /* 1. Retire finished slots, strictly in launch order (one at a time: retire is done
         * before the thread looks again). */
        if (l->ring_count) {
            slot_t *head = &l->slots[l->ring[l->ring_head]];
            if (head_finished(l, head)) {
                l->ring_head = (l->ring_head + 1) % slots;
                l->ring_count--;
                l->retiring++;
                l->napping = false;
                pthread_mutex_unlock(&l->lock);
                head->r->gpu_stamp[TD_GPU_STAGE_DEVICE] = uv_hrtime();
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
            l->napping = false;
            pthread_mutex_unlock(&l->lock);
            td_request_t *r = slot->r; /* retired by this thread only: still slot's after launch */
            r->gpu_stamp[TD_GPU_STAGE_TO_LANE] = uv_hrtime();
            launch(l, slot);
            r->gpu_stamp[TD_GPU_STAGE_LAUNCH] = uv_hrtime();
            pthread_mutex_lock(&l->lock);
            continue;
        }
        if (l->stop && !l->ring_count && !l->waiting.head)
            break;
        if (spin_for_event(l) || nap_for_head(l) || (l->poll && ask_wake(l)))
            continue;
        wait_with_watchdog(l);
    }
    pthread_mutex_unlock(&l->lock);
    return NULL;
}

/* ---- loop thread -------------------------------------------------------------------------- */

tally_status_t td_gpu_status(td_gpu_err_t err)
{
    switch (err) {
    case TD_GPU_OK:
        return TALLY_OK;
    case TD_GPU_E_CLIENT: /* the client's descriptor, size or event: `bad_ref` (PROTOCOL.md §10) */
        return TALLY_E_BAD_REF;
    default: /* the device's or tallyd's own failure: `internal`, logged where it happened */
        return TALLY_E_INTERNAL;
    }
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

/* The devices' bookkeeping for a batch of completions (state lock held). */
static void note_batch(td_gpu_t *g, td_request_t *r)
{
    for (; r; r = r->next) {
        /* The device, not the lane: a recovery may be reopening its lanes. */
        device_t *d = &g->devices[r->where.device];
        unsigned holder;
        if (td_gpu_region_holder(r, &holder) && holder != r->where.device)
            g->devices[holder].peer_users--;
        if (!d->recovering && d->lanes_open)
            note_result(d, r);
    }
}

/* A lost context may wait for the devices to go idle: checked on the wiring's loop. */
static void check_recovery(td_gpu_t *g, uv_loop_t *here)
{
    if (here == g->loop) {
        pthread_mutex_lock(&g->state_lock);
        td_gpu_recover_check(g);
        pthread_mutex_unlock(&g->state_lock);
        return;
    }
    for (unsigned i = 0; i < g->device_count; i++)
        if (atomic_load(&g->devices[i].context_lost) && g->recovery_open) {
            uv_async_send(&g->recover_async);
            return;
        }
}

/* --gpu-spin-loop: an idle handle keeps the shard's loop polling (epoll with no timeout) while
 * its requests are on the GPU, so a completion's wake-up (uv_async_send) and the next request's
 * arrival are seen without waking a sleeping thread. It does nothing itself. */
static void spin_cb(uv_idle_t *handle)
{
    (void)handle;
}

static void async_cb(uv_async_t *handle)
{
    sink_t *k = handle->data;
    td_gpu_t *g = k->gpu;
    pthread_mutex_lock(&k->lock);
    td_request_t *r = td_request_queue_take_all(&k->done);
    pthread_mutex_unlock(&k->lock);
    pthread_mutex_lock(&g->state_lock);
    note_batch(g, r);
    pthread_mutex_unlock(&g->state_lock);
    uint64_t now = uv_hrtime();
    while (r) {
        td_request_t *next = r->next;
        r->gpu_stamp[TD_GPU_STAGE_BACK] = now;
        if (k->spin_open && --k->submitted == 0) /* each one of this sink's submissions */
            uv_idle_stop(&k->spin);
        k->complete(k->owner, r);
        r = next;
    }
    check_recovery(g, k->loop);
}

static void recover_async_cb(uv_async_t *handle)
{
    check_recovery(handle->data, handle->loop);
}

/* Whether device d takes r now (state lock taken here); r on a peer counts on its holder, whose
 * recovery waits for it (td_gpu_device.c). */
static bool admit_on_device(td_gpu_t *g, device_t *d, const td_request_t *r)
{
    pthread_mutex_lock(&g->state_lock);
    unsigned holder;
    if (td_gpu_region_holder(r, &holder) && holder != r->where.device)
        g->devices[holder].peer_users++;
    bool open = !d->recovering && d->lanes_open;
    pthread_mutex_unlock(&g->state_lock);
    return open;
}

void td_gpu_submit(td_gpu_t *g, td_request_t *r)
{
    r->gpu_stamp[TD_GPU_STAGE_SUBMIT] = uv_hrtime();
    device_t *d = &g->devices[r->where.device];
    sink_t *k = sink_of(g, r); /* this shard's: submit runs on its thread */
    if (k->spin_open && k->submitted++ == 0)
        uv_idle_start(&k->spin, spin_cb);
    if (!admit_on_device(g, d, r)) { /* no lanes to run it: failed, as on a dead device */
        r->gpu_failed = true;
        td_gpu_push_completion(g, r);
        return;
    }
    lane_t *l = &d->lanes[r->where.lane];
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
    td_gpu_err_t st = g->engine->region_register(g->engine->ctx, base, size, read_only);
    if (st != TD_GPU_OK)
        td_warn("cannot register a shared-memory region of %zu bytes with %s (%s): its requests "
                "go through staging",
                size, g->engine->name, g->engine->error_string());
    return st == TD_GPU_OK;
}

void td_gpu_region_unregister(td_gpu_t *g, void *base)
{
    g->engine->region_unregister(g->engine->ctx, base);
}

unsigned td_gpu_device_count(const td_gpu_t *g)
{
    return g->device_count;
}

unsigned td_gpu_ordinals(const td_gpu_t *g)
{
    /* Opened in ordinal order (at least one: td_gpu_new), so a skipped device leaves its number
     * out, not the last one. */
    return (unsigned)g->devices[g->device_count - 1].ordinal + 1;
}

uint64_t td_gpu_device_bytes(const td_gpu_t *g)
{
    uint64_t bytes = 0;
    pthread_mutex_lock(&((td_gpu_t *)g)->state_lock);
    for (unsigned i = 0; i < g->device_count; i++)
        if (!g->devices[i].recovering) /* else its worker is writing it */
            bytes += g->devices[i].device_bytes;
    pthread_mutex_unlock(&((td_gpu_t *)g)->state_lock);
    return bytes;
}

const char *td_gpu_engine_name(const td_gpu_t *g)
{
    return g->engine->name;
}

void td_gpu_describe(const td_gpu_t *g, char *buf, size_t cap)
{
    pthread_mutex_lock(&((td_gpu_t *)g)->state_lock);
    size_t len = (size_t)snprintf(buf, cap, "%s:", g->engine->name);
    for (unsigned i = 0; i < g->device_count && len < cap; i++) {
        const device_t *d = &g->devices[i];
        len += (size_t)snprintf(buf + len, cap - len, "%s %d:%s (%u CUDA streams%s)", i ? "," : "",
                                d->ordinal, d->name, g->opts.lanes,
                                d->recovering              ? ", recovering"
                                : atomic_load(&d->dead)    ? ", unusable"
                                : d->recoveries            ? ", recovered"
                                                           : "");
    }
    pthread_mutex_unlock(&((td_gpu_t *)g)->state_lock);
}

/* The wiring's loop handles: the recovery's timer and wake-up. Neither can fail: the timer only
 * fills in its handle, and uv_async_init fails only when it must make the loop's wake-up
 * descriptor, which uv_loop_init made already (for its threadpool's own uv_async_t). */
static void open_recovery(td_gpu_t *g)
{
    uv_timer_init(g->loop, &g->recover_timer);
    g->recover_timer.data = g;
    (void)uv_async_init(g->loop, &g->recover_async, recover_async_cb);
    g->recover_async.data = g;
    g->recovery_open = true;
}

static td_err_t open_devices(td_gpu_t *g, int count, char *why, size_t why_cap)
{
    g->devices = calloc((size_t)count, sizeof *g->devices);
    if (!g->devices) {
        snprintf(why, why_cap, "out of memory");
        return TD_ERR_NOMEM;
    }
    for (int i = 0; i < count; i++) {
        char reason[256];
        device_t *d = &g->devices[g->device_count];
        atomic_init(&d->dead, false);
        atomic_init(&d->context_lost, false);
        atomic_init(&d->generation, 0);
        if (td_gpu_device_open(g, d, i, reason, sizeof reason) == TD_GPU_OK) {
            g->device_count++;
            continue;
        }
        td_warn("GPU %d skipped: %s", i, reason);
        snprintf(why, why_cap, "%s", reason);
        memset(d, 0, sizeof *d);
    }
    return g->device_count ? TD_OK : TD_ERR_BACKEND;
}

td_err_t td_gpu_new(uv_loop_t *loop, td_gpu_engine_t *engine, const td_gpu_opts_t *opts,
                    td_gpu_t **out, char *why, size_t why_cap)
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
    g->state_lock = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER; /* cannot fail, unlike _init */
    g->opts = *opts;
    g->opts.sinks = opts->sinks ? opts->sinks : 1;
    g->carries = g->opts.sinks * opts->max_inflight + 1;
    g->sinks = calloc(g->opts.sinks, sizeof *g->sinks);
    for (unsigned i = 0; g->sinks && i < g->opts.sinks; i++)
        g->sinks[i].lock = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    int count = engine->device_count(engine->ctx);
    if (!g->sinks) {
        snprintf(why, why_cap, "out of memory");
    } else if (count <= 0) {
        snprintf(why, why_cap, "no device");
        err = TD_ERR_BACKEND;
    } else {
        open_recovery(g);
        err = open_devices(g, count, why, why_cap);
    }
    if (err != TD_OK) {
        td_gpu_destroy(&g);
        return err;
    }
    *out = g;
    return TD_OK;
}

int td_gpu_sink_open(td_gpu_t *g, unsigned index, uv_loop_t *loop, td_gpu_complete_fn complete,
                     void *owner)
{
    sink_t *k = &g->sinks[index];
    *k = (sink_t){.gpu = g, .loop = loop, .complete = complete, .owner = owner, .lock = k->lock};
    int rc = uv_async_init(loop, &k->async, async_cb);
    if (rc != 0)
        return rc;
    k->async.data = k;
    k->open = true;
    if (g->opts.spin_loop) {
        uv_idle_init(loop, &k->spin); /* fills in the handle: returns 0 */
        k->spin_open = true;
    }
    return 0;
}

void td_gpu_sink_close(td_gpu_t *g, unsigned index)
{
    sink_t *k = g ? &g->sinks[index] : NULL;
    if (!k || !k->open)
        return;
    pthread_mutex_lock(&k->lock);
    k->open = false;
    pthread_mutex_unlock(&k->lock);
    uv_close((uv_handle_t *)&k->async, NULL);
    if (k->spin_open) {
        k->spin_open = false;
        uv_close((uv_handle_t *)&k->spin, NULL);
    }
}

void td_gpu_close(td_gpu_t *g)
{
    if (!g->recovery_open)
        return;
    g->recovery_open = false;
    uv_close((uv_handle_t *)&g->recover_timer, NULL);
    uv_close((uv_handle_t *)&g->recover_async, NULL);
}

void td_gpu_destroy(td_gpu_t **self_p)
{
    td_gpu_t *g = *self_p;
    if (!g)
        return;
    td_gpu_recover_wait(g); /* a recovery's worker may still be opening lanes */
    for (unsigned i = 0; i < g->device_count; i++)
        td_gpu_device_close(g, &g->devices[i]);
    free(g->devices);
    for (unsigned i = 0; g->sinks && i < g->opts.sinks; i++) {
        sink_t *k = &g->sinks[i];
        if (k->open) { /* only on a failed start: its loop never ran with it */
            td_gpu_sink_close(g, i);
            uv_run(k->loop, UV_RUN_NOWAIT);
        }
        pthread_mutex_destroy(&k->lock);
    }
    bool handles = g->recovery_open;
    td_gpu_close(g);
    if (handles)
        uv_run(g->loop, UV_RUN_NOWAIT);
    free(g->sinks);
    pthread_mutex_destroy(&g->state_lock);
    g->engine->destroy(&g->engine); /* set before any failure of td_gpu_new */
    free(g);
    *self_p = NULL;
}
