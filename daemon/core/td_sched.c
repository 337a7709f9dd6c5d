/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_sched.c — the scheduler (see td_sched.h for the rules).
 *
 * State: per device and lane the requests placed there and not yet back (`load`; a split request
 * counts on every lane it uses), per lane the device scan carries not held by a stream, and per
 * stream with requests waiting or running a record: its FIFO, the requests in flight, whether
 * the last one started runs on the GPU, and while any runs there the lane and carry the stream is
 * pinned to. A record exists only while the stream is busy, so an idle stream's state is all in
 * its tally_stream_info_t and its next request goes to the least loaded lane again ("least
 * loaded at creation", renewed whenever the stream starts from idle, with no hook needed when a
 * stream is reset or removed).
 *
 * Re-entrancy: starting a request may finish it at once (an inline CPU run), and finishing one
 * starts its stream's next ones; `advancing` marks the stream whose FIFO is being walked, so a
 * request of it finishing meanwhile leaves the walk to the loop already running.
 */
#include <inttypes.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "td_gpu_engine.h"
#include "td_log.h"
#include "td_peers.h"
#include "td_sched.h"

/* The most freed records a scheduler keeps for the next busy stream: a stream of small batches
 * goes idle and busy again at about every request, and a calloc and free each time were 3 % of a
 * shard's instructions for a 64 B hist (bench/NOTES.md, "A shard's instructions for a 64 B
 * hist"). Bounded: at most this many records' bytes a shard. */
#define TD_SCHED_SPARE_RECORDS 256u

typedef struct td_sched_stream {
    td_stream_t *stream;
    td_request_queue_t waiting; /* in arrival order */
    unsigned inflight;          /* started (or waiting in a peer's queue) and not finished */
    unsigned held;              /* of those, waiting in a peer's queue (at most one) */
    td_request_queue_t failed;  /* refused at admission while others ran: answered in turn */
    bool on_gpu;                /* the last one started runs on the GPU */
    bool resync;                /* a GPU failure: start nothing new until the stream drains */
    uint32_t generation; /* bumped by a GPU failure: what it started before reruns on the CPU */
    bool pinned;         /* GPU: device, lane and carry_index hold while inflight > 0 */
    unsigned device;
    unsigned lane;
    unsigned carry_index;
    struct td_sched_stream *prev; /* the scheduler's list of busy streams */
    struct td_sched_stream *next;
} record_t;

typedef struct {
    _Atomic unsigned *load; /* in the machine's table: every shard's requests on the lane */
    unsigned carry_fresh; /* carries base+1 .. base+carry_fresh-1 were handed out once */
    unsigned *carry_free; /* of them, those given back (grown as needed) */
    unsigned carry_free_count;
    unsigned carry_free_cap;
} lane_t;

typedef struct {
    _Atomic unsigned *load; /* likewise for the device */
    lane_t *lanes;
} device_t;

/* A peer's queue of requests for one class of worker (deficit round robin, below). */
typedef struct td_sched_flow {
    td_peer_t *peer; /* NULL: the queue of requests whose connection has no table entry */
    unsigned cls;    /* its slot in the entry (td_peer_flow): this shard's class */
    td_request_queue_t queue;
    uint64_t deficit; /* bytes it may still start in its turn */
    bool turn;        /* its turn has begun (its quantum was added) */
    struct td_sched_flow *next;
} flow_t;

enum { CLASS_CPU = 0, CLASS_GPU = 1 }; /* TD_PEER_FLOWS classes */

/* The flows of one class with requests, in turn order: head is the one whose turn it is. */
typedef struct {
    flow_t *head;
    flow_t *tail;
    unsigned running; /* requests of the class on the machine, not yet back */
    flow_t anonymous;
} drr_t;

struct td_sched {
    const td_config_t *cfg;
    td_metrics_t *metrics;
    td_sched_machine_t machine;
    td_sched_host_t host;
    device_t *devices;
    record_t *busy;
    record_t *spare; /* freed records kept for reuse (through next), spare_count of them */
    unsigned spare_count;
    td_stream_t *advancing;
    unsigned inflight;
    unsigned queued;
    bool stopping;
    drr_t drr[TD_PEER_FLOWS];
    bool dispatching;    /* dispatch() is running: a nested call only asks it to look again */
    bool dispatch_again;
    _Atomic unsigned *own_loads; /* the loads table, when the machine has none */
};

static void advance(td_sched_t *s, record_t *rec);

/* ---- records ------------------------------------------------------------------------------ */

static record_t *record_of(td_sched_t *s, td_stream_t *stream)
{
    if (stream->sched)
        return stream->sched;
    record_t *rec = s->spare;
    if (rec) {
        s->spare = rec->next;
        s->spare_count--;
        memset(rec, 0, sizeof *rec);
    } else if (!(rec = calloc(1, sizeof *rec))) {
        return NULL;
    }
    rec->stream = stream;
    rec->next = s->busy;
    if (s->busy)
        s->busy->prev = rec;
    s->busy = rec;
    stream->sched = rec;
    return rec;
}

static void record_free(td_sched_t *s, record_t *rec)
{
    if (rec->prev)
        rec->prev->next = rec->next;
    else
        s->busy = rec->next;
    if (rec->next)
        rec->next->prev = rec->prev;
    rec->stream->sched = NULL;
    if (s->spare_count < TD_SCHED_SPARE_RECORDS) {
        rec->next = s->spare;
        s->spare = rec;
        s->spare_count++;
        return;
    }
    free(rec);
}

static void push(td_sched_t *s, record_t *rec, td_request_t *r)
{
    r->stream = rec->stream;
    td_request_queue_push(&rec->waiting, r);
    s->queued++;
}

static td_request_t *pop(td_sched_t *s, record_t *rec)
{
    td_request_t *r = td_request_queue_pop(&rec->waiting);
    s->queued--;
    return r;
}

/* ---- placement ---------------------------------------------------------------------------- */

/* What is placed on a device or lane by every scheduler of the machine (the shards share the
 * GPUs: td_sched_machine_t.gpu_loads); the others' counts move meanwhile, which only makes a
 * choice less exact, never wrong. */
static unsigned load_of(_Atomic unsigned *load)
{
    return atomic_load_explicit(load, memory_order_relaxed);
}

static bool gpu_usable(const td_sched_t *s)
{
    for (unsigned d = 0; d < s->machine.gpu_devices; d++)
        if (s->machine.device_usable(s->machine.ctx, d))
            return true;
    return false;
}

/* The auto-mode threshold for a request (td_config.h has the measurements). */
static size_t gpu_min_batch(const td_sched_t *s, const td_request_t *r)
{
    if (s->cfg->gpu_min_batch)
        return s->cfg->gpu_min_batch;
    bool direct_in = td_shm_region_direct(r->shm_in);
    bool direct_out = !tally_op_has_output(r->req.opcode) || td_shm_region_direct(r->shm_out);
    if (direct_in && direct_out)
        return TD_GPU_MIN_BATCH_SHM;
    const td_op_exec_t *exec = td_op_exec(r->req.opcode);
    return exec ? exec->gpu_min_batch : SIZE_MAX;
}

/* The fewest pieces r splits into so that each fits the device buffers; 0 when it cannot be
 * split (then a batch above the buffers cannot run on the GPU). The engines cut pieces of whole
 * 64 KiB multiples of elements (td_gpu_piece_elems), so with 3-byte rgb8 pixels a piece can be
 * up to 64 KiB longer than payload / pieces: the count grows until the engines' pieces fit (more
 * pieces never make a piece longer, so every count from this one up fits too). */
static unsigned split_min_pieces(const td_sched_t *s, const td_request_t *r)
{
    if (!s->machine.splittable || !s->machine.splittable(s->machine.ctx, r))
        return 0;
    size_t buffer = s->machine.gpu_buffer_bytes;
    size_t esize = tally_dtype_size((tally_dtype_t)r->req.dtype);
    size_t pieces = (r->payload_len + buffer - 1) / buffer;
    if (!pieces)
        pieces = 1;
    while (pieces <= TD_GPU_SPLIT_MAX_PIECES && esize &&
           td_gpu_piece_elems(r->payload_len / esize, (unsigned)pieces, esize) * esize > buffer)
        pieces++;
    return pieces <= TD_GPU_SPLIT_MAX_PIECES ? (unsigned)pieces : 0;
}

/* A request whose input or output is a device region: *gpu is the device that holds it (the
 * input's when both are; submit refuses regions on two GPUs). */
static bool device_ref(const td_request_t *r, unsigned *gpu)
{
    void *import;
    return td_shm_region_device(r->shm_in, gpu, &import) ||
           td_shm_region_device(r->shm_out, gpu, &import);
}

static bool wants_gpu(const td_sched_t *s, const td_request_t *r)
{
    unsigned gpu;
    if (device_ref(r, &gpu)) /* never the CPU: the pipeline fails it if its GPU is lost */
        return true;
    if (!gpu_usable(s))
        return false;
    /* Above the device buffers (TD_GPU_BUFFER_MAX_BYTES, or a reload raised max_batch above
     * what they were sized for) only a batch split into pieces that fit can run there. */
    if (r->payload_len > s->machine.gpu_buffer_bytes && !split_min_pieces(s, r))
        return false;
    return s->cfg->backend == TD_BACKEND_CUDA || r->payload_len >= gpu_min_batch(s, r);
}

/* The lanes a job of `pieces` placed on `lane` uses: piece i runs on lane + i (mod lanes). */
static unsigned lanes_used(const td_sched_t *s, unsigned pieces)
{
    return pieces < s->machine.gpu_lanes ? pieces : s->machine.gpu_lanes;
}

static bool lanes_idle(const td_sched_t *s, unsigned device, unsigned lane, unsigned count)
{
    const device_t *d = &s->devices[device];
    for (unsigned i = 0; i < count; i++)
        if (load_of(d->lanes[(lane + i) % s->machine.gpu_lanes].load))
            return false;
    return true;
}

/* How many pieces r's job is split into over the device's lanes (1: whole): as many as the
 * device has lanes (pieces of at least TD_GPU_SPLIT_PIECE_MIN_BYTES), at least as many as make
 * every piece fit the buffers (TD_GPU_SPLIT_MIN_BYTES in td_config.h). A request that fits whole
 * is split only onto lanes with nothing else queued or running: among other work, pieces chained
 * by the scan carry serialise where whole requests overlap on the lanes (issue 9, td_sched.h). */
static unsigned split_pieces(const td_sched_t *s, const td_request_t *r, unsigned device,
                             unsigned lane)
{
    unsigned least = split_min_pieces(s, r);
    if (!least || (r->payload_len < TD_GPU_SPLIT_MIN_BYTES && least == 1))
        return 1;
    size_t pieces = r->payload_len / TD_GPU_SPLIT_PIECE_MIN_BYTES;
    if (pieces > s->machine.gpu_lanes)
        pieces = s->machine.gpu_lanes;
    if (pieces < least)
        pieces = least;
    if (pieces > TD_GPU_SPLIT_MAX_PIECES)
        pieces = TD_GPU_SPLIT_MAX_PIECES;
    if (least == 1 && !lanes_idle(s, device, lane, lanes_used(s, (unsigned)pieces)))
        return 1;
    return (unsigned)pieces;
}

static void add_load(td_sched_t *s, const td_placement_t *w, int delta)
{
    device_t *d = &s->devices[w->device];
    atomic_fetch_add_explicit(d->load, (unsigned)delta, memory_order_relaxed);
    for (unsigned i = 0; i < lanes_used(s, w->pieces); i++)
        atomic_fetch_add_explicit(d->lanes[(w->lane + i) % s->machine.gpu_lanes].load,
                                  (unsigned)delta, memory_order_relaxed);
}

/* The least loaded lane of the least loaded usable device. */
static void least_loaded(const td_sched_t *s, unsigned *device, unsigned *lane)
{
    unsigned best = 0;
    bool found = false;
    for (unsigned d = 0; d < s->machine.gpu_devices; d++) {
        if (!s->machine.device_usable(s->machine.ctx, d))
            continue;
        if (!found || load_of(s->devices[d].load) < load_of(s->devices[best].load))
            best = d;
        found = true;
    }
    /* Every device unusable (wants_gpu stops routing here): the pipeline fails it anywhere. */
    const device_t *dev = &s->devices[best];
    unsigned pick = 0;
    for (unsigned i = 1; i < s->machine.gpu_lanes; i++)
        if (load_of(dev->lanes[i].load) < load_of(dev->lanes[pick].load))
            pick = i;
    *device = best;
    *lane = pick;
}

/* Whether a lane of device d has nothing placed on it. */
static bool has_idle_lane(const td_sched_t *s, unsigned d)
{
    for (unsigned i = 0; i < s->machine.gpu_lanes; i++)
        if (!load_of(s->devices[d].lanes[i].load))
            return true;
    return false;
}

/* Whether the rule below lets a request by device reference on `owner`'s region go to a peer:
 * the owner has gpu_peer_queue requests or more placed on it and not back (or the test switch). */
static bool owner_busy(const td_sched_t *s, unsigned owner)
{
    unsigned queue = s->cfg->gpu_peer_queue;
    return s->cfg->test_gpu_peer_always || (queue && load_of(s->devices[owner].load) >= queue);
}

/* The GPU that runs a request by device reference (PROTOCOL.md §10, "Which GPU runs it"): the
 * one holding its region, unless owner_busy and a GPU that reaches the region over peer access
 * (the machine's region_peers: mapped there, serving, the owner serving) has a lane with nothing
 * on it; then the least loaded such GPU. Why the bar is high: the probe of issue 23 (two H200s)
 * read the owner's memory at ~2,100 GB/s in place (hist) and over NVLink from the peer at 370,
 * 0.17 x, so a request takes ~6 x as long on the peer: it gains only behind more than ~6
 * requests on the owner, and takes the peer's lane that long. The default, 16 (TD_DEFAULT_GPU_
 * PEER_QUEUE: the owner's 4 lanes each full to their depth), keeps a wide margin. */
static unsigned region_device(const td_sched_t *s, const td_request_t *r, unsigned owner)
{
    if (!s->machine.region_peers || !owner_busy(s, owner))
        return owner;
    uint32_t peers = s->machine.region_peers(s->machine.ctx, r);
    unsigned best = owner;
    for (unsigned d = 0; d < s->machine.gpu_devices && d < 32; d++) {
        if (!((peers >> d) & 1u) || (!s->cfg->test_gpu_peer_always && !has_idle_lane(s, d)))
            continue;
        if (best == owner || load_of(s->devices[d].load) < load_of(s->devices[best].load))
            best = d;
    }
    return best;
}

/* May r, by device reference on `owner`'s region, pipeline behind its stream on `device`? On the
 * owner always; on a peer only while the rule that sent work there holds (else it waits for its
 * stream to drain and is placed anew). */
static bool region_pipelines(const td_sched_t *s, const td_request_t *r, unsigned owner,
                             unsigned device)
{
    if (device == owner)
        return true;
    return owner_busy(s, owner) && s->machine.region_peers && device < 32 &&
           (s->machine.region_peers(s->machine.ctx, r) >> device) & 1u;
}

/* The stream has nothing in flight: its host copy is authoritative, so this request starts the
 * chain by uploading it, whatever its operation (only a scan's prepare reads the carry; a hist or
 * filter that starts the chain must upload it too, or the scans pipelined behind it read a carry
 * index last used by another stream). The stream is pinned to the lane and a carry of it. */
static void place_first(td_sched_t *s, td_request_t *r, record_t *rec)
{
    td_placement_t *w = &r->where;
    least_loaded(s, &w->device, &w->lane);
    unsigned gpu;
    if (device_ref(r, &gpu) && gpu < s->machine.gpu_devices) { /* its region's GPU, or a peer */
        w->device = region_device(s, r, gpu);
        const device_t *dev = &s->devices[w->device];
        w->lane = 0;
        for (unsigned i = 1; i < s->machine.gpu_lanes; i++)
            if (load_of(dev->lanes[i].load) < load_of(dev->lanes[w->lane].load))
                w->lane = i;
    }
    w->carry_upload = true;
    r->carry = r->stream ? r->stream->info.scan_carry : 0;
    if (!rec)
        return;
    lane_t *l = &s->devices[w->device].lanes[w->lane];
    if (!l->carry_free_count && l->carry_fresh >= s->machine.gpu_carries) {
        /* cannot happen: a shard's carries = max_inflight + 1 */
        td_err("GPU lane out of scan carries; stream '%s' runs unpinned", rec->stream->name);
        return;
    }
    rec->pinned = true;
    rec->device = w->device;
    rec->lane = w->lane;
    rec->carry_index = l->carry_free_count ? l->carry_free[--l->carry_free_count]
                                           : s->machine.gpu_carry_base + l->carry_fresh++;
    w->carry_index = rec->carry_index;
}

static void place_gpu(td_sched_t *s, td_request_t *r, record_t *rec)
{
    td_placement_t *w = &r->where;
    w->gpu = true;
    if (rec && rec->pinned) { /* the stream has requests in flight on this lane */
        w->device = rec->device;
        w->lane = rec->lane;
        w->carry_index = rec->carry_index;
    } else {
        place_first(s, r, rec);
    }
    w->pieces = split_pieces(s, r, w->device, w->lane);
    add_load(s, w, 1);
}

static void unpin(td_sched_t *s, record_t *rec)
{
    if (!rec->pinned)
        return;
    lane_t *l = &s->devices[rec->device].lanes[rec->lane];
    rec->pinned = false;
    if (l->carry_free_count == l->carry_free_cap) {
        unsigned cap = l->carry_free_cap ? 2 * l->carry_free_cap : 64;
        unsigned *grown = realloc(l->carry_free, cap * sizeof *grown);
        if (!grown) /* out of memory: the carry is not handed out again (one int64 of 65,536) */
            return;
        l->carry_free = grown;
        l->carry_free_cap = cap;
    }
    l->carry_free[l->carry_free_count++] = rec->carry_index;
}

/* Runs on the loop thread rather than a worker: a tiny batch is cheaper there than two thread
 * hops. */
static bool runs_inline(const td_request_t *r, bool gpu)
{
    return !gpu && r->payload_len <= TD_EXEC_INLINE_MAX;
}

/* Starts a prepared compute request (counted in its stream's inflight) where it belongs. */
static void start(td_sched_t *s, td_request_t *r, record_t *rec)
{
    bool gpu = wants_gpu(s, r);
    r->gpu_failed = false;
    /* The generation it was admitted in (submit): a GPU failure of its stream since then makes
     * it one queued behind the failure, rerun from the host copy like the others. */
    r->where = (td_placement_t){.generation = r->where.generation, .pieces = 1};
    if (rec)
        rec->on_gpu = gpu;
    if (gpu)
        place_gpu(s, r, rec);
    else
        r->where.cpu_inline = runs_inline(r, false);
    if (gpu || !r->where.cpu_inline)
        s->drr[gpu ? CLASS_GPU : CLASS_CPU].running++;
    s->machine.run(s->machine.ctx, r);
}

/* The stream has nothing in flight any more: its GPU pin and state go. */
static void settle(td_sched_t *s, record_t *rec)
{
    if (rec->inflight)
        return;
    unpin(s, rec);
    rec->on_gpu = false;
    rec->resync = false;
}

/* ---- fair service between peers (deficit round robin) ------------------------------------- */

/* What a request costs its peer's turn: its bytes, plus the fixed cost of any request. */
static uint64_t cost_of(const td_request_t *r)
{
    return (uint64_t)r->payload_len + TD_SCHED_REQUEST_COST;
}

/* How many requests of a class may be on the machine at once: beyond it they wait in their
 * peer's queue, where the turns decide which starts next (0 from the machine: no limit). */
static unsigned capacity(const td_sched_t *s, unsigned cls)
{
    const td_sched_machine_t *m = &s->machine;
    unsigned n = cls == CLASS_CPU ? m->cpu_workers + (m->cpu_workers ? TD_SCHED_CPU_AHEAD : 0)
                                  : m->gpu_devices * m->gpu_lanes * m->gpu_lane_depth;
    return n ? n : UINT_MAX;
}

static flow_t *flow_of(td_sched_t *s, td_peer_t *peer, unsigned cls)
{
    if (!peer)
        return &s->drr[cls].anonymous;
    unsigned slot = s->host.shard * TD_PEER_FLOWS + cls;
    flow_t *f = td_peer_flow(peer, slot);
    if (f)
        return f;
    f = calloc(1, sizeof *f);
    if (!f)
        return &s->drr[cls].anonymous; /* out of memory: shares the anonymous queue */
    f->peer = peer;
    f->cls = slot;
    td_peer_set_flow(peer, slot, f);
    return f;
}

/* A flow whose queue emptied leaves the turns (and forgets its deficit, as DRR does). */
static void flow_retire(drr_t *d, flow_t *f)
{
    d->head = f->next;
    if (!d->head)
        d->tail = NULL;
    f->next = NULL;
    f->deficit = 0;
    f->turn = false;
    if (f == &d->anonymous)
        return;
    td_peer_set_flow(f->peer, f->cls, NULL); /* cls: its slot */
    free(f);
}

/* The next request of a class: the head flow's first, when its deficit (topped up by a quantum
 * once per turn) covers it; else the turn passes to the next flow. Terminates: each pass adds a
 * quantum to some flow's deficit. */
static td_request_t *drr_next(drr_t *d)
{
    for (;;) {
        flow_t *f = d->head;
        if (!f->turn) {
            f->deficit += TD_SCHED_QUANTUM;
            f->turn = true;
        }
        uint64_t cost = cost_of(f->queue.head);
        if (cost <= f->deficit) {
            f->deficit -= cost;
            td_request_t *r = td_request_queue_pop(&f->queue);
            if (!f->queue.head)
                flow_retire(d, f);
            return r;
        }
        f->turn = false;
        if (f->next) { /* to the back of the turns */
            d->head = f->next;
            f->next = NULL;
            d->tail->next = f;
            d->tail = f;
        }
    }
}

/* Starts a request taken from its peer's queue, then lets its stream go on: the next request of
 * the stream may enter a queue now that this one has its lane. The stream is held busy across
 * the start, which may finish the request at once (a failed submission). */
static void launch(td_sched_t *s, td_request_t *r)
{
    td_stream_t *stream = r->stream;
    record_t *rec = stream ? stream->sched : NULL;
    if (rec) {
        rec->held--;
        rec->inflight++;
    }
    start(s, r, rec);
    if (!rec)
        return;
    rec->inflight--;
    settle(s, rec);
    if (stream != s->advancing) /* else advance's own loop goes on */
        advance(s, rec);
}

/* Starts queued requests, each class up to its capacity, in the peers' turns. */
static void dispatch(td_sched_t *s)
{
    if (s->dispatching) {
        s->dispatch_again = true;
        return;
    }
    s->dispatching = true;
    do {
        s->dispatch_again = false;
        for (unsigned c = 0; c < TD_PEER_FLOWS; c++)
            while (s->drr[c].head && s->drr[c].running < capacity(s, c))
                launch(s, drr_next(&s->drr[c]));
    } while (s->dispatch_again);
    s->dispatching = false;
}

/* An admitted compute request (prepared): a tiny CPU batch runs at once on the loop thread;
 * any other waits in its peer's queue for its class (CPU workers, or GPU lanes) and starts in
 * turn. It counts in its stream's inflight from now. */
/* What a GPU cannot run by device reference (PROTOCOL.md §10 "Device memory"): a filter or scan
 * above its buffers (the kernels' scratch, and the output when it comes back in the reply), and
 * input and output device regions on two GPUs. False when r may go on. */
static bool device_ref_refused(const td_sched_t *s, td_request_t *r)
{
    unsigned in_gpu, out_gpu;
    void *import;
    if (!device_ref(r, &in_gpu))
        return false;
    if (tally_op_has_output(r->req.opcode) && r->payload_len > s->machine.gpu_buffer_bytes) {
        td_request_fail(r, TALLY_E_TOO_LARGE,
                        "a filter or scan by device reference is limited to %zu bytes (the GPU's "
                        "buffers)",
                        s->machine.gpu_buffer_bytes);
        return true;
    }
    if (td_shm_region_device(r->shm_in, &in_gpu, &import) &&
        td_shm_region_device(r->shm_out, &out_gpu, &import) && in_gpu != out_gpu) {
        td_request_fail(r, TALLY_E_BAD_REF,
                        "the input region is on GPU %u and the output region on GPU %u: both "
                        "must be on one GPU",
                        in_gpu, out_gpu);
        return true;
    }
    return false;
}

static void submit(td_sched_t *s, td_request_t *r, record_t *rec)
{
    if (device_ref_refused(s, r)) {
        if (rec && rec->inflight > 0) /* answered in its stream's turn, as a refusal */
            td_request_queue_push(&rec->failed, r);
        else
            s->host.answer(s->host.owner, r);
        return;
    }
    bool gpu = wants_gpu(s, r);
    /* Admitted now, its carry-in chosen now (td_request_admit): the stream's generation too, so
     * that a GPU failure while it waits in a queue reruns it (issue 21: a scan launched after an
     * earlier one of its stream failed on the GPU chained the distrusted device carry). */
    r->where.generation = rec ? rec->generation : 0;
    if (rec)
        rec->inflight++;
    if (runs_inline(r, gpu)) {
        start(s, r, rec);
        return;
    }
    if (rec) {
        rec->held++;
        rec->on_gpu = gpu;
    }
    unsigned cls = gpu ? CLASS_GPU : CLASS_CPU;
    drr_t *d = &s->drr[cls];
    flow_t *f = flow_of(s, r->conn, cls);
    if (!f->queue.head) { /* joins the turns at the back */
        if (d->tail)
            d->tail->next = f;
        else
            d->head = f;
        d->tail = f;
    }
    td_request_queue_push(&f->queue, r);
    dispatch(s);
}

/* ---- a stream's order --------------------------------------------------------------------- */

/* May r (the next request waiting on its stream) start now, while the stream's earlier
 * requests are still in flight? Always when none is; otherwise only when both run on the GPU
 * (pipelined on the stream's lane, the carry chained on the device). */
static bool may_start(const td_sched_t *s, const record_t *rec, const td_request_t *r)
{
    if (rec->inflight == 0)
        return true;
    /* One waiting in a peer's queue has no lane yet; a refused one waits for the stream to
     * drain (it is answered then, in its turn). */
    if (rec->held || rec->failed.head)
        return false;
    if (!td_op_is_compute(r->req.opcode) || !rec->on_gpu || rec->resync || !rec->pinned)
        return false;
    if (!wants_gpu(s, r) || !s->machine.device_usable(s->machine.ctx, rec->device))
        return false;
    unsigned gpu; /* pipelined only where its regions may run: else after the stream drains */
    if (device_ref(r, &gpu) && !region_pipelines(s, r, gpu, rec->device))
        return false;
    /* The type check of a stream's first histogram needs the earlier requests applied. */
    return r->req.opcode != TALLY_OP_HIST || rec->stream->info.hist_dtype != TALLY_DTYPE_NONE;
}

/* Stopping: a waiting request is answered `shutdown` once nothing of its stream runs any more,
 * so a stream's replies still leave in order. */
static bool may_advance(const td_sched_t *s, const record_t *rec, const td_request_t *r)
{
    if (s->stopping)
        return rec->inflight == 0;
    return !td_request_seq_waits(r, rec->inflight > 0) && may_start(s, rec, r);
}

/* A query, reset or delete at the head of the drained stream: the host runs it. After a delete
 * the stream's name is forgotten (PROTOCOL.md, `delete`), even while requests that were queued
 * behind the delete still hold the stream object: a query, reset or delete among them gets
 * unknown_stream, exactly as if it had been read after the delete ran, and the next filter, scan
 * or hist that is applied starts the stream anew. (They used to find the cleared stream: the
 * answer depended on whether the query was read before or after the delete ran.) The same holds
 * for a stream created by a request not applied yet: it does not exist until one is. */
static void run_control(td_sched_t *s, record_t *rec, td_request_t *r)
{
    td_stream_t *stream = rec->stream;
    if (stream->life != TD_STREAM_LIVE) {
        td_request_fail(r, TALLY_E_UNKNOWN_STREAM, "no stream named '%s'", r->req.stream);
        r->stream = NULL;
    } else {
        s->host.control(s->host.owner, r, stream);
        if (r->req.opcode == TALLY_OP_DELETE) {
            r->stream = NULL;
            stream->life = TD_STREAM_DELETED;
        }
    }
    s->host.answer(s->host.owner, r);
}

/* Requests refused at admission while others of their stream were in flight: answered once
 * those are done, so that the stream's replies leave in arrival order (issue 21: a `hist` of the
 * wrong type overtook the GPU requests before it). */
static void answer_failed(td_sched_t *s, record_t *rec)
{
    while (rec->inflight == 0 && rec->failed.head) {
        td_request_t *r = td_request_queue_pop(&rec->failed);
        s->host.answer(s->host.owner, r);
    }
}

/* Starts the requests waiting on a stream, in order, as far as the rules allow. */
static void advance_locked(td_sched_t *s, record_t *rec)
{
    answer_failed(s, rec);
    while (rec->waiting.head && may_advance(s, rec, rec->waiting.head)) {
        td_request_t *r = pop(s, rec);
        if (s->stopping) {
            td_request_fail(r, TALLY_E_SHUTDOWN, "tallyd is shutting down; not run");
            r->stream = NULL;
            s->host.answer(s->host.owner, r);
            continue;
        }
        if (!td_op_is_compute(r->req.opcode)) {
            run_control(s, rec, r);
            continue;
        }
        if (!td_request_admit(r, rec->inflight > 0)) {
            if (rec->inflight > 0)
                td_request_queue_push(&rec->failed, r);
            else
                s->host.answer(s->host.owner, r);
            continue;
        }
        submit(s, r, rec);
    }
}

/* Once its FIFO is empty and nothing of it runs, a stream that no request was applied to since
 * it was created or deleted is removed (PROTOCOL.md §5 "Streams": a request that fails, for
 * whatever reason, creates no stream); a stream that other queued requests are about to use
 * stays until they are done. */
static void advance(td_sched_t *s, record_t *rec)
{
    td_stream_t *outer = s->advancing;
    td_stream_t *stream = rec->stream;
    s->advancing = stream;
    advance_locked(s, rec);
    s->advancing = outer;
    if (rec->waiting.head || rec->inflight)
        return;
    record_free(s, rec);
    if (stream->life != TD_STREAM_LIVE)
        s->host.forget(s->host.owner, stream);
}

/* ---- what follows a result ---------------------------------------------------------------- */

/* r ran on the GPU and failed, or was queued there behind a failed request of its stream (its
 * device carry cannot be trusted): run it again on the CPU (td_exec.c says why that is correct).
 * Returns false when r's GPU result stands. */
static bool rerun_on_cpu(td_sched_t *s, td_request_t *r, record_t *rec)
{
    bool behind_failure = rec && r->where.generation != rec->generation;
    if (!r->gpu_failed && !behind_failure)
        return false;
    unsigned gpu;
    if (device_ref(r, &gpu)) { /* its input or output is on the GPU: the CPU cannot reach it */
        s->metrics->backend_fallbacks++;
        td_warn("request %" PRIu64 " on device region of GPU %u failed on the GPU: answered "
                "internal",
                r->rep.request_id, gpu);
        td_request_fail(r, TALLY_E_INTERNAL,
                        "the GPU failed while running this device-region "
                        "request; it was not run");
        if (rec && !behind_failure) { /* distrust what follows it on the device */
            rec->generation++;
            rec->resync = true;
        }
        return false;
    }
    s->metrics->backend_fallbacks++;
    if (r->gpu_failed)
        td_warn("request %" PRIu64 " failed on the GPU: rerun on the CPU backend",
                r->rep.request_id);
    else
        td_info("request %" PRIu64 " on stream '%s' was queued behind a GPU failure: rerun on "
                "the CPU backend",
                r->rep.request_id, rec->stream->name);
    r->gpu_failed = false;
    r->where = (td_placement_t){.generation = r->where.generation, .pieces = 1};
    if (!rec) { /* stateless: on a worker, ahead of the queues (it was started once) */
        s->drr[CLASS_CPU].running++;
        s->machine.run(s->machine.ctx, r);
        return true;
    }
    if (!behind_failure) { /* r is the failed one: distrust what follows it on the device */
        rec->generation++;
        rec->resync = true;
    }
    /* On the loop thread, so that the stream's order argument stays trivial: every earlier
     * request of the stream has been applied, so the host copy is what r starts from. */
    r->where.cpu_inline = true;
    if (td_request_prepare(r)) /* carry-in from the host copy, current up to r */
        s->machine.run(s->machine.ctx, r);
    else
        td_sched_finished(s, r);
    return true;
}

void td_sched_finished(td_sched_t *s, td_request_t *r)
{
    td_stream_t *stream = r->stream;
    record_t *rec = stream ? stream->sched : NULL;
    if (r->where.gpu || !r->where.cpu_inline)
        s->drr[r->where.gpu ? CLASS_GPU : CLASS_CPU].running--;
    if (r->where.gpu) {
        add_load(s, &r->where, -1);
        if (rerun_on_cpu(s, r, rec)) {
            dispatch(s);
            return;
        }
        int ordinal = s->machine.device_ordinal(s->machine.ctx, r->where.device);
        unsigned holder;
        td_metrics_count_gpu_request(s->metrics, ordinal);
        if (device_ref(r, &holder))
            td_metrics_count_region_request(s->metrics, ordinal, holder != r->where.device);
    }
    if (rec) {
        rec->inflight--;
        settle(s, rec);
    }
    bool applied = s->host.complete(s->host.owner, r); /* r is freed */
    if (rec) {
        if (applied) /* the stream exists now, if it did not (a new or deleted one) */
            stream->life = TD_STREAM_LIVE;
        /* Its successors still on the GPU chained their scan carry from the device carry it
         * left, which the host copy never took: rerun them from the host copy, as after a GPU
         * failure. */
        if (!applied && rec->inflight > 0 && rec->on_gpu) {
            rec->generation++;
            rec->resync = true;
        }
        if (stream != s->advancing) /* else advance's own loop goes on */
            advance(s, rec);
    }
    dispatch(s); /* a worker or lane is free: the next peer in turn */
}

/* ---- interface ---------------------------------------------------------------------------- */

void td_sched_arrived(td_sched_t *s, td_request_t *r, td_stream_t *stream)
{
    if (s->stopping && (!stream || !stream->sched)) {
        s->host.answer(s->host.owner, r);
        return;
    }
    if (!stream) {
        td_request_prepare(r); /* nothing to read without a stream: cannot fail */
        submit(s, r, NULL);
        return;
    }
    record_t *rec = record_of(s, stream);
    if (!rec) {
        td_request_fail(r, TALLY_E_INTERNAL, "out of memory");
        s->host.answer(s->host.owner, r);
        if (stream->life != TD_STREAM_LIVE) /* nothing of it waits or runs (no record) */
            s->host.forget(s->host.owner, stream);
        return;
    }
    stream->requests++;
    push(s, rec, r);
    advance(s, rec);
}

void td_sched_stop(td_sched_t *s)
{
    s->stopping = true;
    record_t *next;
    for (record_t *rec = s->busy; rec; rec = next) {
        next = rec->next; /* advance frees rec (only) once it is idle */
        advance(s, rec);
    }
}

void td_sched_received(td_sched_t *s)
{
    s->inflight++;
}

void td_sched_answered(td_sched_t *s)
{
    s->inflight--;
}

bool td_sched_may_read(const td_sched_t *s)
{
    return s->stopping || s->inflight < s->cfg->max_inflight;
}

unsigned td_sched_inflight(const td_sched_t *s)
{
    return s->inflight;
}

unsigned td_sched_queued(const td_sched_t *s)
{
    return s->queued;
}

static td_err_t devices_new(td_sched_t *s)
{
    const td_sched_machine_t *m = &s->machine;
    if (!m->gpu_devices)
        return TD_OK;
    s->devices = calloc(m->gpu_devices, sizeof *s->devices);
    if (!s->devices)
        return TD_ERR_NOMEM;
    _Atomic unsigned *loads = m->gpu_loads;
    if (!loads) { /* a machine of its own (the tests'): the scheduler keeps the table */
        loads = s->own_loads = calloc((size_t)m->gpu_devices * (1 + m->gpu_lanes), sizeof *loads);
        if (!loads)
            return TD_ERR_NOMEM;
    }
    for (unsigned d = 0; d < m->gpu_devices; d++) {
        _Atomic unsigned *row = loads + (size_t)d * (1 + m->gpu_lanes);
        s->devices[d].load = row;
        s->devices[d].lanes = calloc(m->gpu_lanes, sizeof *s->devices[d].lanes);
        if (!s->devices[d].lanes)
            return TD_ERR_NOMEM;
        for (unsigned i = 0; i < m->gpu_lanes; i++) {
            s->devices[d].lanes[i].load = row + 1 + i;
            s->devices[d].lanes[i].carry_fresh = 1; /* low indices handed out first */
        }
    }
    return TD_OK;
}

td_err_t td_sched_new(const td_config_t *cfg, td_metrics_t *metrics,
                      const td_sched_machine_t *machine, const td_sched_host_t *host,
                      td_sched_t **out)
{
    td_sched_t *s = calloc(1, sizeof *s);
    if (!s)
        return TD_ERR_NOMEM;
    s->cfg = cfg;
    s->metrics = metrics;
    s->machine = *machine;
    s->host = *host;
    td_err_t err = devices_new(s);
    if (err != TD_OK) {
        td_sched_destroy(&s);
        return err;
    }
    *out = s;
    return TD_OK;
}

void td_sched_destroy(td_sched_t **self_p)
{
    td_sched_t *s = *self_p;
    if (!s)
        return;
    while (s->busy) /* only when tallyd did not stop cleanly: nothing refers to them now */
        record_free(s, s->busy);
    for (record_t *rec = s->spare, *next; rec; rec = next) {
        next = rec->next;
        free(rec);
    }
    for (unsigned c = 0; c < TD_PEER_FLOWS; c++) /* likewise */
        while (s->drr[c].head) {
            td_request_t *r = drr_next(&s->drr[c]);
            td_request_destroy(&r);
        }
    for (unsigned d = 0; s->devices && d < s->machine.gpu_devices; d++) {
        for (unsigned i = 0; s->devices[d].lanes && i < s->machine.gpu_lanes; i++)
            free(s->devices[d].lanes[i].carry_free);
        free(s->devices[d].lanes);
    }
    free(s->devices);
    free(s->own_loads);
    free(s);
    *self_p = NULL;
}
