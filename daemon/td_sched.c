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
#include <stdlib.h>
#include <string.h>

#include "td_gpu_engine.h"
#include "td_log.h"
#include "td_sched.h"

typedef struct td_sched_stream {
    td_stream_t *stream;
    td_request_queue_t waiting; /* in arrival order */
    unsigned inflight;          /* started and not yet finished */
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
    unsigned load;
    unsigned *carry_free; /* carry indices 1..carries-1 not held by a stream */
    unsigned carry_free_count;
} lane_t;

typedef struct {
    unsigned load;
    lane_t *lanes;
} device_t;

struct td_sched {
    const td_config_t *cfg;
    td_metrics_t *metrics;
    td_sched_machine_t machine;
    td_sched_host_t host;
    device_t *devices;
    record_t *busy;
    td_stream_t *advancing;
    unsigned inflight;
    unsigned queued;
    bool stopping;
};

static void advance(td_sched_t *s, record_t *rec);

/* ---- records ------------------------------------------------------------------------------ */

static record_t *record_of(td_sched_t *s, td_stream_t *stream)
{
    if (stream->sched)
        return stream->sched;
    record_t *rec = calloc(1, sizeof *rec);
    if (!rec)
        return NULL;
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
    bool direct_out = r->req.opcode == TALLY_OP_HIST || td_shm_region_direct(r->shm_out);
    if (direct_in && direct_out)
        return TD_GPU_MIN_BATCH_SHM;
    switch (r->req.opcode) {
    case TALLY_OP_HIST:
        return TD_GPU_MIN_BATCH_HIST;
    case TALLY_OP_FILTER:
        return TD_GPU_MIN_BATCH_FILTER;
    default:
        return TD_GPU_MIN_BATCH_SCAN;
    }
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

/* A request whose input is a device region: *gpu is the device that holds it. */
static bool device_ref(const td_request_t *r, unsigned *gpu)
{
    void *import;
    return td_shm_region_device(r->shm_in, gpu, &import);
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
        if (d->lanes[(lane + i) % s->machine.gpu_lanes].load)
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
    d->load += (unsigned)delta;
    for (unsigned i = 0; i < lanes_used(s, w->pieces); i++)
        d->lanes[(w->lane + i) % s->machine.gpu_lanes].load += (unsigned)delta;
}

/* The least loaded lane of the least loaded usable device. */
static void least_loaded(const td_sched_t *s, unsigned *device, unsigned *lane)
{
    unsigned best = 0;
    bool found = false;
    for (unsigned d = 0; d < s->machine.gpu_devices; d++) {
        if (!s->machine.device_usable(s->machine.ctx, d))
            continue;
        if (!found || s->devices[d].load < s->devices[best].load)
            best = d;
        found = true;
    }
    /* Every device unusable (wants_gpu stops routing here): the pipeline fails it anywhere. */
    const device_t *dev = &s->devices[best];
    unsigned pick = 0;
    for (unsigned i = 1; i < s->machine.gpu_lanes; i++)
        if (dev->lanes[i].load < dev->lanes[pick].load)
            pick = i;
    *device = best;
    *lane = pick;
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
    if (device_ref(r, &gpu) && gpu < s->machine.gpu_devices) { /* the GPU holding its input */
        const device_t *dev = &s->devices[gpu];
        w->device = gpu;
        w->lane = 0;
        for (unsigned i = 1; i < s->machine.gpu_lanes; i++)
            if (dev->lanes[i].load < dev->lanes[w->lane].load)
                w->lane = i;
    }
    w->carry_upload = true;
    r->carry = r->stream ? r->stream->info.scan_carry : 0;
    if (!rec)
        return;
    lane_t *l = &s->devices[w->device].lanes[w->lane];
    if (!l->carry_free_count) { /* cannot happen: carries = max_inflight + 1 */
        td_err("GPU lane out of scan carries; stream '%s' runs unpinned", rec->stream->name);
        return;
    }
    rec->pinned = true;
    rec->device = w->device;
    rec->lane = w->lane;
    rec->carry_index = l->carry_free[--l->carry_free_count];
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
    l->carry_free[l->carry_free_count++] = rec->carry_index;
    rec->pinned = false;
}

/* Starts a prepared compute request where it belongs. */
static void start(td_sched_t *s, td_request_t *r, record_t *rec)
{
    bool gpu = wants_gpu(s, r);
    r->gpu_failed = false;
    r->where = (td_placement_t){.generation = rec ? rec->generation : 0, .pieces = 1};
    if (rec) {
        rec->inflight++;
        rec->on_gpu = gpu;
    }
    unsigned dev;
    if (device_ref(r, &dev) && r->req.opcode != TALLY_OP_HIST &&
        r->payload_len > s->machine.gpu_buffer_bytes) { /* its output must fit the GPU's buffers */
        td_request_fail(r, TALLY_E_TOO_LARGE,
                        "a filter or scan by device reference is limited to %zu bytes (the GPU's "
                        "buffers)",
                        s->machine.gpu_buffer_bytes);
        td_sched_finished(s, r);
        return;
    }
    if (gpu)
        place_gpu(s, r, rec);
    else /* a tiny batch is cheaper on the loop thread than two thread hops */
        r->where.cpu_inline = r->payload_len <= TD_EXEC_INLINE_MAX;
    s->machine.run(s->machine.ctx, r);
}

/* ---- a stream's order --------------------------------------------------------------------- */

/* May r (the next request waiting on its stream) start now, while the stream's earlier
 * requests are still in flight? Always when none is; otherwise only when both run on the GPU
 * (pipelined on the stream's lane, the carry chained on the device). */
static bool may_start(const td_sched_t *s, const record_t *rec, const td_request_t *r)
{
    if (rec->inflight == 0)
        return true;
    if (!td_op_is_compute(r->req.opcode) || !rec->on_gpu || rec->resync || !rec->pinned)
        return false;
    if (!wants_gpu(s, r) || !s->machine.device_usable(s->machine.ctx, rec->device))
        return false;
    unsigned gpu; /* pipelined only on the GPU holding its input: else after the stream drains */
    if (device_ref(r, &gpu) && gpu != rec->device)
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
 * or hist starts the stream anew. (They used to find the cleared stream: the answer depended on
 * whether the query was read before or after the delete ran.) */
static void run_control(td_sched_t *s, record_t *rec, td_request_t *r, bool *forgotten)
{
    if (*forgotten) {
        td_request_fail(r, TALLY_E_UNKNOWN_STREAM, "no stream named '%s'", r->req.stream);
        r->stream = NULL;
    } else {
        s->host.control(s->host.owner, r, rec->stream);
        if (r->req.opcode == TALLY_OP_DELETE) {
            r->stream = NULL;
            *forgotten = true;
        }
    }
    s->host.answer(s->host.owner, r);
}

/* Starts the requests waiting on a stream, in order, as far as the rules allow. Returns true when
 * the stream was deleted and nothing queued behind the delete started it anew. */
static bool advance_locked(td_sched_t *s, record_t *rec)
{
    bool forgotten = false;
    while (rec->waiting.head && may_advance(s, rec, rec->waiting.head)) {
        td_request_t *r = pop(s, rec);
        if (s->stopping) {
            td_request_fail(r, TALLY_E_SHUTDOWN, "tallyd is shutting down; not run");
            r->stream = NULL;
            s->host.answer(s->host.owner, r);
            continue;
        }
        if (!td_op_is_compute(r->req.opcode)) {
            run_control(s, rec, r, &forgotten);
            continue;
        }
        forgotten = false; /* a filter, scan or hist starts the stream anew */
        if (!td_request_admit(r, rec->inflight > 0)) {
            s->host.answer(s->host.owner, r);
            continue;
        }
        start(s, r, rec);
    }
    return forgotten;
}

/* A forgotten stream is removed once its FIFO is empty; nothing can be in flight on it, since a
 * delete only runs on a drained stream and a forgotten one starts nothing. */
static void advance(td_sched_t *s, record_t *rec)
{
    td_stream_t *outer = s->advancing;
    td_stream_t *stream = rec->stream;
    s->advancing = stream;
    bool forgotten = advance_locked(s, rec);
    s->advancing = outer;
    if (rec->waiting.head || rec->inflight)
        return;
    record_free(s, rec);
    if (forgotten)
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
    if (device_ref(r, &gpu)) { /* its input is on the GPU: the CPU cannot read it */
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
    if (!rec) { /* stateless: on a worker */
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
    if (r->where.gpu) {
        add_load(s, &r->where, -1);
        if (rerun_on_cpu(s, r, rec))
            return;
        td_metrics_count_gpu_request(s->metrics,
                                     s->machine.device_ordinal(s->machine.ctx, r->where.device));
    }
    if (rec && --rec->inflight == 0) {
        unpin(s, rec);
        rec->on_gpu = false;
        rec->resync = false;
    }
    bool applied = s->host.complete(s->host.owner, r); /* r is freed */
    if (!rec)
        return;
    /* Its successors still on the GPU chained their scan carry from the device carry it left,
     * which the host copy never took: rerun them from the host copy, as after a GPU failure. */
    if (!applied && rec->inflight > 0 && rec->on_gpu) {
        rec->generation++;
        rec->resync = true;
    }
    if (stream != s->advancing) /* else advance's own loop goes on */
        advance(s, rec);
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
        start(s, r, NULL);
        return;
    }
    record_t *rec = record_of(s, stream);
    if (!rec) {
        td_request_fail(r, TALLY_E_INTERNAL, "out of memory");
        s->host.answer(s->host.owner, r);
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
    for (unsigned d = 0; d < m->gpu_devices; d++) {
        s->devices[d].lanes = calloc(m->gpu_lanes, sizeof *s->devices[d].lanes);
        if (!s->devices[d].lanes)
            return TD_ERR_NOMEM;
        for (unsigned i = 0; i < m->gpu_lanes; i++) {
            lane_t *l = &s->devices[d].lanes[i];
            l->carry_free = calloc(m->gpu_carries ? m->gpu_carries : 1, sizeof *l->carry_free);
            if (!l->carry_free)
                return TD_ERR_NOMEM;
            for (unsigned c = m->gpu_carries; c-- > 1;) /* low indices handed out first */
                l->carry_free[l->carry_free_count++] = c;
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
    for (unsigned d = 0; s->devices && d < s->machine.gpu_devices; d++) {
        for (unsigned i = 0; s->devices[d].lanes && i < s->machine.gpu_lanes; i++)
            free(s->devices[d].lanes[i].carry_free);
        free(s->devices[d].lanes);
    }
    free(s->devices);
    free(s);
    *self_p = NULL;
}
