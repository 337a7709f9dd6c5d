/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_gpu_device.c — a device's life in the GPU pipeline (see td_gpu.c for the pipeline): its
 * pinned reply buffers and lanes opened and closed, its context recreated after a failure, and
 * the device regions imported on it (PROTOCOL.md §10 "Device memory").
 *
 * Recovery. A device is marked unusable by td_gpu.c after TD_GPU_DEAD_AFTER failures in a row,
 * or at once when the watchdog finds its work failed asynchronously (a sticky CUDA error such as
 * an illegal address: the context is dead and every later call fails). Its work then goes to the
 * other GPUs and the CPU. Only the second is recovered: failures in a row with a working
 * context say the device itself is failing, and a new context would not change that. Once
 * nothing of the lost context's device is in flight — its lanes empty and every pinned reply
 * buffer back from ZeroMQ (polled every TD_GPU_RECOVER_POLL_MS) — a worker closes its lanes,
 * asks the engine to recreate the context (cudaDeviceReset, then a probe: an allocation, a memset
 * and a synchronisation; CUDA documents that after some sticky errors only a new process helps,
 * so the probe decides) and opens the lanes again; then the device serves again. At most
 * TD_GPU_RECOVER_MAX times per device: a GPU that keeps failing stays unusable. Device regions
 * imported in the old context cannot be used any more (their mapping went with it): each import
 * carries its device's context generation, and a reference to one of an older generation is
 * refused (td_gpu_dev_unusable) until the producer registers it again.
 *
 * Peer access (PROTOCOL.md §10 "Device memory", "Which GPU runs it"). A device region is mapped
 * at its import on every other usable device that the driver says can reach its GPU's memory,
 * each with the IPC event opened on it, so the scheduler may run its requests there when its own
 * GPU is busy (td_gpu_region_peers says where, td_sched.c decides). The mapping is the owner's:
 * a peer runs the region's work only while the owner serves and has not been reset since the
 * import, and the owner's recovery waits (device_idle) until no request runs on a peer over one
 * of its regions (peer_users): the reset takes the mapping for every device, and a peer kernel
 * reading it then would fault and lose the peer's context too. A peer recovered since the import
 * is left out of that region's peers (its event went with its old context).
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "td_config.h"
#include "td_gpu_int.h"
#include "td_log.h"

/* ---- reply buffers and lanes -------------------------------------------------------------- */

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

static td_gpu_err_t lane_open(td_gpu_t *g, device_t *d, lane_t *l, unsigned index, char *why,
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
        return TD_GPU_E_NOMEM;
    }
    for (unsigned i = 0; i < slots; i++) {
        l->slots[i].lane = l;
        l->slots[i].index = i;
    }
    uint64_t bytes = 0;
    td_gpu_err_t st = g->engine->lane_open(g->engine->ctx, d->ordinal, g->opts.max_batch, slots,
                                             g->carries, &l->hw, l->staging, &bytes, why, why_cap);
    if (st != TD_GPU_OK)
        return st;
    d->device_bytes += bytes;
    if (pthread_create(&l->thread, NULL, td_gpu_lane_main, l) != 0) {
        snprintf(why, why_cap, "cannot start a lane thread");
        return TD_GPU_E_DEVICE;
    }
    l->thread_started = true;
    return TD_GPU_OK;
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

void td_gpu_device_close(td_gpu_t *g, device_t *d)
{
    for (unsigned i = 0; d->lanes && i < d->lane_count; i++)
        lane_close(g, &d->lanes[i]);
    free(d->lanes);
    d->lanes = NULL;
    d->lane_count = 0;
    d->lanes_open = false;
    d->device_bytes = 0;
    if (d->pool_open)
        pool_close(&d->pool);
    d->pool_open = false;
}

td_gpu_err_t td_gpu_device_open(td_gpu_t *g, device_t *d, int ordinal, char *why, size_t cap)
{
    if (!d->described) { /* once: a recovery's reopen leaves what the loop thread reads alone */
        d->ordinal = ordinal;
        g->engine->describe(g->engine->ctx, ordinal, d->name, sizeof d->name);
        d->has_uuid = g->engine->device_uuid(g->engine->ctx, ordinal, d->uuid) == TD_GPU_OK;
        d->described = true;
    }
    pool_open(&d->pool, g->engine, ordinal, g->opts.max_batch);
    d->pool_open = true;
    d->lanes = calloc(g->opts.lanes, sizeof *d->lanes);
    if (!d->lanes) {
        snprintf(why, cap, "out of memory");
        td_gpu_device_close(g, d);
        return TD_GPU_E_NOMEM;
    }
    d->lane_count = g->opts.lanes;
    for (unsigned i = 0; i < d->lane_count; i++) {
        td_gpu_err_t st = lane_open(g, d, &d->lanes[i], i, why, cap);
        if (st != TD_GPU_OK) {
            d->lane_count = i + 1; /* close what was opened, this one included */
            td_gpu_device_close(g, d);
            return st;
        }
    }
    /* Before any request arrives (the lane threads read it under their lock, after a submit). */
    for (unsigned i = 0; i < d->lane_count; i++) {
        lane_t *l = &d->lanes[i];
        l->peer_hw = calloc(d->lane_count, sizeof *l->peer_hw);
        if (!l->peer_hw) {
            snprintf(why, cap, "out of memory");
            td_gpu_device_close(g, d);
            return TD_GPU_E_NOMEM;
        }
        for (unsigned k = 0; k < d->lane_count; k++)
            l->peer_hw[k] = d->lanes[(i + k) % d->lane_count].hw;
    }
    d->lanes_open = true;
    return TD_GPU_OK;
}


/* ---- device regions ----------------------------------------------------------------------- */

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

/* A device region's import as the pipeline hands it out: the engine's, the context generation
 * of its device when it was made (a recovery recreates the context, which unmaps it), and the
 * peers it was mapped on (peer access: td_gpu_dev_reach), each with its own generation then (a
 * peer's recovery takes the IPC event opened there, and whatever access its old context had). */
typedef struct {
    void *engine_import;
    unsigned generation;
    unsigned peer_count;
    unsigned peer[TD_GPU_PEERS_MAX];            /* device numbers here */
    unsigned peer_generation[TD_GPU_PEERS_MAX];
    uint32_t peer_mapped; /* bit k: peer[k] was given access (and the event opened there) */
} gpu_import_t;

void *td_gpu_engine_import(void *import)
{
    return import ? ((gpu_import_t *)import)->engine_import : NULL;
}

/* The other usable devices, to be mapped on too where the driver says they can reach device i:
 * their numbers here in w->peer, their CUDA ordinals in ordinals. */
static void import_peers(const td_gpu_t *g, unsigned i, gpu_import_t *w, int *ordinals)
{
    for (unsigned k = 0; k < g->device_count && w->peer_count < TD_GPU_PEERS_MAX; k++) {
        const device_t *d = &g->devices[k];
        if (k == i || atomic_load(&d->dead))
            continue;
        w->peer[w->peer_count] = k;
        w->peer_generation[w->peer_count] = atomic_load(&d->generation);
        ordinals[w->peer_count++] = d->ordinal;
    }
}

/* A worker thread (td_shm_side.c): device_by_uuid reads only what a recovery changes atomically
 * (dead, generation), and a dead device is not imported on. */
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
    gpu_import_t *w = calloc(1, sizeof *w);
    if (!w) {
        snprintf(why, why_cap, "out of memory");
        return TALLY_E_INTERNAL;
    }
    int ordinals[TD_GPU_PEERS_MAX];
    w->generation = atomic_load(&g->devices[i].generation);
    import_peers(g, (unsigned)i, w, ordinals);
    td_gpu_import_args_t args = {.device = g->devices[i].ordinal,
                                 .peers = ordinals,
                                 .peer_count = w->peer_count,
                                 .fd = fd,
                                 .size = size,
                                 .writable = writable,
                                 .event = event};
    td_gpu_err_t err = g->engine->dev_import(g->engine->ctx, &args, &w->peer_mapped,
                                             &w->engine_import, ptr, why, why_cap);
    *gpu = (unsigned)i;
    if (err != TD_GPU_OK)
        free(w);
    else
        *import = w;
    if (err == TD_GPU_OK && w->peer_mapped)
        td_debug("GPU %d: device region mapped on peers 0x%x (of the other usable GPUs)",
                 g->devices[i].ordinal, (unsigned)w->peer_mapped);
    if (err != TD_GPU_OK && err != TD_GPU_E_CLIENT) /* the device's own failure: logged */
        td_warn("GPU %d: cannot import a device region: %s", g->devices[i].ordinal, why);
    return td_gpu_status(err);
}

void td_gpu_dev_release(td_gpu_t *g, unsigned gpu, void *import)
{
    gpu_import_t *w = import;
    bool stale = w->generation != atomic_load(&g->devices[gpu].generation);
    uint32_t stale_peers = 0;
    for (unsigned k = 0; k < w->peer_count; k++)
        if (w->peer_generation[k] != atomic_load(&g->devices[w->peer[k]].generation))
            stale_peers |= 1u << k;
    g->engine->dev_release(g->engine->ctx, w->engine_import, stale, stale_peers);
    free(w);
}

const char *td_gpu_dev_unusable(const td_gpu_t *g, unsigned gpu, const void *import)
{
    const gpu_import_t *w = import;
    if (gpu >= g->device_count || atomic_load(&g->devices[gpu].dead))
        return "is unusable";
    if (w && w->generation != atomic_load(&g->devices[gpu].generation))
        return "was reset after a failure since the region was registered (its mapping went with "
               "the old context): register the region again";
    return NULL;
}

/* Whether device d takes work now: usable, its lanes open, not recovering (loop thread). */
static bool device_serves(const device_t *d)
{
    return !atomic_load(&d->dead) && d->lanes_open && !d->recovering;
}

/* Loop thread. The devices other than `gpu` that can run work on the region now: mapped there at
 * the import, serving, and in the context generation of then. None while the owner itself does
 * not serve or was reset since the import: the mapping is the owner's (made in its context), a
 * recovery of the owner takes it for every device, and a peer kernel reading it then faults,
 * which would kill the peer's context too. */
static uint32_t dev_reach(const td_gpu_t *g, unsigned gpu, const gpu_import_t *w)
{
    uint32_t reach = 0;
    if (!w || gpu >= g->device_count || !device_serves(&g->devices[gpu]) ||
        w->generation != atomic_load(&g->devices[gpu].generation))
        return 0;
    for (unsigned k = 0; k < w->peer_count; k++) {
        const device_t *d = &g->devices[w->peer[k]];
        if ((w->peer_mapped >> k) & 1u && w->peer[k] < 32 && device_serves(d) &&
            w->peer_generation[k] == atomic_load(&d->generation))
            reach |= 1u << w->peer[k];
    }
    return reach;
}

static uint32_t region_peers_locked(const td_gpu_t *g, const td_request_t *r)
{
    unsigned gpu;
    void *import;
    uint32_t peers = UINT32_MAX;
    bool any = false;
    if (td_shm_region_device(r->shm_in, &gpu, &import)) {
        peers &= dev_reach(g, gpu, import);
        any = true;
    }
    if (td_shm_region_device(r->shm_out, &gpu, &import)) { /* on the input's GPU (td_sched) */
        peers &= dev_reach(g, gpu, import);
        any = true;
    }
    return any ? peers : 0;
}

uint32_t td_gpu_region_peers(const td_gpu_t *g, const td_request_t *r)
{
    pthread_mutex_lock(&((td_gpu_t *)g)->state_lock); /* device_serves' fields */
    uint32_t peers = region_peers_locked(g, r);
    pthread_mutex_unlock(&((td_gpu_t *)g)->state_lock);
    return peers;
}

bool td_gpu_region_holder(const td_request_t *r, unsigned *gpu)
{
    void *import;
    return td_shm_region_device(r->shm_in, gpu, &import) ||
           td_shm_region_device(r->shm_out, gpu, &import);
}


/* ---- recovery ---------------------------------------------------------------------------- */

/* Whether nothing of the device is on its lanes or in a reply being sent: closing its lanes and
 * recreating its context frees the staging slots and the pinned reply buffers. */
static bool device_idle(device_t *d)
{
    bool idle = !d->peer_users; /* a peer still reads its regions: their mapping must stay */
    for (unsigned i = 0; idle && i < d->lane_count; i++) {
        lane_t *l = &d->lanes[i];
        pthread_mutex_lock(&l->lock);
        idle = !l->ring_count && !l->waiting.head && !l->retiring;
        pthread_mutex_unlock(&l->lock);
    }
    if (idle) { /* the pool is open while the lanes are (asked only then) */
        pthread_mutex_lock(&d->pool.lock);
        idle = d->pool.free_count == d->pool.count;
        pthread_mutex_unlock(&d->pool.lock);
    }
    return idle;
}

typedef struct {
    uv_work_t work;
    td_gpu_t *g;
    device_t *d;
    td_gpu_err_t status;
    char why[256];
} recover_work_t;

/* A worker thread (lane threads are joined, pinned memory freed and reallocated, the context
 * recreated: tens of milliseconds, never on the loop): closes the device's lanes, has the engine
 * recreate its context (engine->device_reset), and opens them again. Nothing is submitted to
 * the device meanwhile (td_gpu_submit fails what comes while it is recovering). */
static void recover_work(uv_work_t *work)
{
    recover_work_t *w = work->data;
    td_gpu_t *g = w->g;
    device_t *d = w->d;
    td_gpu_device_close(g, d);
    w->status = g->engine->device_reset(g->engine->ctx, d->ordinal, w->why, sizeof w->why);
    if (w->status == TD_GPU_OK)
        w->status = td_gpu_device_open(g, d, d->ordinal, w->why, sizeof w->why);
    atomic_fetch_sub(&g->recovering, 1);
}

static void recover_done(recover_work_t *w, device_t *d)
{
    d->recovering = false;
    d->recoveries++;
    if (w->status == TD_GPU_OK) {
        atomic_fetch_add(&d->generation, 1);
        d->errors_in_row = 0;
        atomic_store(&d->context_lost, false);
        atomic_store(&d->dead, false);
        td_warn("GPU %d (%s): context recreated after a failure (recovery %u of at most %u); it "
                "serves again; device regions registered on it before must be registered again",
                d->ordinal, d->name, d->recoveries, TD_GPU_RECOVER_MAX);
    } else {
        td_err("GPU %d (%s): cannot recreate its context (%s); it stays unusable, and tallyd "
               "serves on with the other GPUs and the CPU",
               d->ordinal, d->name, w->why);
    }
}

/* Loop thread: the device serves again, in a new context generation (its device regions must
 * be registered again), or stays unusable. */
static void recover_after(uv_work_t *work, int status)
{
    (void)status;
    recover_work_t *w = work->data;
    device_t *d = w->d;
    pthread_mutex_lock(&w->g->state_lock);
    recover_done(w, d);
    pthread_mutex_unlock(&w->g->state_lock);
    free(w);
}

static void start_recovery(td_gpu_t *g, device_t *d)
{
    recover_work_t *w = calloc(1, sizeof *w);
    if (!w)
        return; /* tried again at the next check */
    *w = (recover_work_t){.g = g, .d = d};
    w->work.data = w;
    d->recovering = true;
    atomic_fetch_add(&g->recovering, 1);
    td_info("GPU %d (%s): idle after it was marked unusable: recreating its context", d->ordinal,
            d->name);
    /* Fails only without a work callback (libuv's uv_queue_work: UV_EINVAL). */
    (void)uv_queue_work(g->loop, &w->work, recover_work, recover_after);
}

static void recover_timer_cb(uv_timer_t *timer)
{
    td_gpu_t *g = timer->data;
    pthread_mutex_lock(&g->state_lock);
    td_gpu_recover_check(g);
    pthread_mutex_unlock(&g->state_lock);
}

void td_gpu_recover_check(td_gpu_t *g)
{
    bool waiting = false;
    if (!g->engine->device_reset)
        return;
    for (unsigned i = 0; i < g->device_count; i++) {
        device_t *d = &g->devices[i];
        if (!atomic_load(&d->context_lost) || d->recovering || !d->lanes_open ||
            d->recoveries >= TD_GPU_RECOVER_MAX)
            continue;
        if (device_idle(d))
            start_recovery(g, d);
        else
            waiting = true;
    }
    /* Replies still being sent hold the device's pinned buffers: look again shortly. */
    if (waiting && g->recovery_open && !uv_is_active((uv_handle_t *)&g->recover_timer))
        uv_timer_start(&g->recover_timer, recover_timer_cb, TD_GPU_RECOVER_POLL_MS, 0);
}

void td_gpu_recover_wait(td_gpu_t *g)
{
    while (atomic_load(&g->recovering))
        usleep(10000);
}
