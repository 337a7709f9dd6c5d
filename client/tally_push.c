/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_push.c — chunked, pipelined operations: streaming pushes (tally_push_*), tally_run for an
 * input in memory, and tally_minmax; the arithmetic of chunks is tally_chunk.c's.
 *
 * tally_run. The input is cut into chunks; chunk k uses slot k % W of a window of W slots,
 * so at most W requests are outstanding or waiting to be merged. Replies arrive in any order
 * and are held in their slot; merging happens strictly in chunk order, which keeps filter
 * output in input order and lets a stateless scan add the running total of the chunks before
 * it (each chunk was scanned from 0 and reported its total in aux0).
 *
 * A push is that loop for an input that comes a chunk at a time (tally_run is a push of one
 * buffer). Its chunks go as payloads, or through a shared-memory ring (tally_shm.c), or through
 * device memory (tally_gpu.c); over a transport whose messages are smaller (NATS), a chunk is one
 * message.
 */
#include "tally.h"
#include "tally_client_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

/* ---- Streaming pushes (tally_push_*) and tally_run ------------------------------------------ */

/* "Applied k chunks, B bytes" must take B from the same k, whatever k the daemon reports (a
 * tallyd restarted from an older snapshot may hold fewer chunks than it acknowledged). A chunk
 * is chunk_bytes long except the short ones (a live input's pause, the input's end), so
 * bytes(k) = k x chunk_bytes - the shortfall of the short chunks before chunk k. The push keeps
 * the last PUSH_SHORT_KEPT short chunks (index, shortfall through it), which answers every k
 * after the newest one it let go; a file has one short chunk at most. Memory: 64 KiB at most,
 * taken at the first short chunk. */
#define PUSH_SHORT_KEPT 4096u

typedef struct {
    uint64_t index;     /* the chunk */
    uint64_t shortfall; /* chunk_bytes minus the length, summed over short chunks up to it */
} short_chunk_t;

typedef struct {
    short_chunk_t *kept; /* a ring: kept[(first + i) % PUSH_SHORT_KEPT], i < count */
    unsigned first, count;
    uint64_t shortfall; /* over every short chunk so far */
    bool let_go;        /* records were dropped; `newest_gone` is the last one dropped */
    short_chunk_t newest_gone;
} short_chunks_t;

typedef struct {
    uint64_t request_id;
    size_t len;     /* the chunk's input bytes */
    bool in_flight; /* sent, reply not yet received */
    bool done;      /* reply received and held, not yet merged */
    tally_reply_t reply;
} push_slot_t;

struct tally_push {
    tally_client_t *client;
    tally_req_t req;
    tally_output_fn *output;
    void *output_arg;
    size_t elem_size;
    size_t chunk_bytes;
    unsigned window;
    push_slot_t *slots;
    uint64_t first;        /* chunks before it were skipped (applied already: a resumed push) */
    uint64_t next_send;    /* chunks written so far (sent or skipped) */
    uint64_t next_merge;   /* the next chunk to merge, in order */
    uint64_t total_chunks; /* opts->total_bytes in chunks; 0 when unknown */
    short_chunks_t shorts;
    bool sequenced; /* chunk k carries seq res.seq_base + 1 + k */
    bool finished;
    uint64_t scan_offset;                    /* stateless scan: total of the chunks merged so far */
    uint8_t hist[8 * TALLY_HIST_VALUES_MAX]; /* hist: the counts summed over chunks */
    int64_t min, max; /* minmax: over the chunks so far (min > max while none had an element) */
    /* opts->shm: window input slices of in_slice bytes, then window output slices of
     * out_slice bytes (0 for hist), in one region. TALLY_RUN_SHM_GPU: the region is device
     * memory (gpu_mem): the chunks are copied into it, and the output slices copied out of it
     * into gpu_out (window slices on the host) before they are merged. */
    tally_region_t *region;
    tally_gpu_mem_t *gpu_mem;
    uint8_t *gpu_out;
    size_t in_slice;
    size_t out_slice;
    tally_run_result_t res;
};

static tally_status_t push_fail(tally_push_t *push, tally_status_t status, const char *msg)
{
    /* msg may be the client's own error buffer (a failed tally_send): copy through res. */
    push->res.status = status;
    snprintf(push->res.error, sizeof push->res.error, "%s", msg);
    memcpy(push->client->error, push->res.error, sizeof push->client->error);
    return status;
}

/* A reply's output: its payload, or with shared memory the chunk's output slice (the reply then
 * carries only the header, its count saying how much of the slice holds output). Writable: a
 * stateless scan adds its offset in place. */
static uint8_t *reply_output(const tally_push_t *push, uint64_t k, const tally_reply_t *reply,
                             size_t *len)
{
    if (!push->region || !push->out_slice) {
        *len = reply->len;
        return reply->len ? zmq_msg_data(reply->msg_) : NULL;
    }
    *len = (size_t)reply->rep.count * tally_op_reply_elem(&push->req);
    if (*len > push->out_slice)
        *len = push->out_slice; /* a count the daemon cannot have sent: merge_* rejects it */
    size_t slice = (size_t)(k % push->window) * push->out_slice;
    if (push->gpu_mem) /* copied out of the device by device_output */
        return push->gpu_out + slice;
    uint8_t *base = tally_region_data(push->region);
    return base + push->window * push->in_slice + slice;
}

/* TALLY_RUN_SHM_GPU: a filter's or scan's output slice of chunk k, copied out of the device
 * region into the host slice reply_output reads (its count elements). */
static tally_status_t device_output(tally_push_t *push, uint64_t k, const tally_reply_t *reply)
{
    if (!push->gpu_mem || !push->out_slice || reply->rep.status != TALLY_OK)
        return TALLY_OK;
    size_t len;
    uint8_t *host = reply_output(push, k, reply, &len);
    size_t at = push->window * push->in_slice + (size_t)(k % push->window) * push->out_slice;
    tally_status_t st = tally_gpu_copy_from(push->gpu_mem, at, host, len);
    return st == TALLY_OK ? TALLY_OK : push_fail(push, st, tally_gpu_error());
}

static tally_status_t emit(tally_push_t *push, const void *data, size_t len)
{
    if (!push->output || !len)
        return TALLY_OK;
    tally_status_t status = push->output(push->output_arg, data, len);
    if (status != TALLY_OK)
        return push_fail(push, status, "the output callback failed");
    return TALLY_OK;
}

static tally_status_t merge_filter(tally_push_t *push, uint64_t k, const tally_reply_t *reply)
{
    size_t len;
    const uint8_t *data = reply_output(push, k, reply, &len);
    push->res.count += len / push->elem_size;
    push->res.seen += reply->rep.aux0;
    return emit(push, data, len);
}

static tally_status_t merge_scan(tally_push_t *push, uint64_t k, const tally_reply_t *reply,
                                 size_t in_len)
{
    bool out_i32 = push->req.flags & TALLY_FLAG_SCAN_OUT_I32;
    size_t n = in_len / push->elem_size;
    size_t len;
    uint8_t *data = reply_output(push, k, reply, &len);
    if (len != n * (out_i32 ? 4 : 8)) {
        char msg[128];
        snprintf(msg, sizeof msg, "scan reply has %zu bytes for %zu elements", len, n);
        return push_fail(push, TALLY_E_REPLY, msg);
    }
    if (push->req.stream_len) {
        push->res.carry = (int64_t)reply->rep.aux0; /* the daemon carried */
    } else {
        tally__scan_offset(data, n, out_i32, push->scan_offset);
        push->scan_offset += reply->rep.aux0;
        push->res.carry = (int64_t)push->scan_offset;
    }
    push->res.count += n;
    return emit(push, data, len);
}

static tally_status_t merge_hist(tally_push_t *push, const tally_reply_t *reply)
{
    size_t values = tally__hist_values(push->req.dtype);
    if (reply->len != values * 8) {
        char msg[128];
        snprintf(msg, sizeof msg, "hist reply has %zu bytes, expected %zu", reply->len, values * 8);
        return push_fail(push, TALLY_E_REPLY, msg);
    }
    tally__hist_add(push->hist, reply->payload, values);
    push->res.hist_total += reply->rep.aux0;
    return TALLY_OK;
}

/* A chunk's min and max (none for an empty chunk) into the push's. */
static tally_status_t merge_minmax(tally_push_t *push, const tally_reply_t *reply)
{
    uint64_t count = reply->rep.count;
    if ((count != 0 && count != 2) || reply->len != count * push->elem_size) {
        char msg[128];
        snprintf(msg, sizeof msg, "minmax reply has %" PRIu64 " values in %zu bytes", count,
                 reply->len);
        return push_fail(push, TALLY_E_REPLY, msg);
    }
    if (count) {
        int64_t lo, hi;
        tally_minmax_decode(push->req.dtype, reply->payload, &lo, &hi);
        push->min = lo < push->min ? lo : push->min;
        push->max = hi > push->max ? hi : push->max;
    }
    push->res.seen += reply->rep.aux0;
    return TALLY_OK;
}

/* By the reply's shape (tally_ops.h): the output of each chunk, in order. */
static tally_status_t merge_chunk(tally_push_t *push, uint64_t k, const push_slot_t *slot)
{
    tally_status_t st = device_output(push, k, &slot->reply);
    if (st != TALLY_OK)
        return st;
    switch (tally_op_info(push->req.opcode)->reply) {
    case TALLY_REPLY_KEPT:
        return merge_filter(push, k, &slot->reply);
    case TALLY_REPLY_PREFIX:
        return merge_scan(push, k, &slot->reply, slot->len);
    case TALLY_REPLY_PAIR:
        return merge_minmax(push, &slot->reply);
    default:
        return merge_hist(push, &slot->reply);
    }
}

static tally_status_t push_send(tally_push_t *push, uint64_t k, const void *chunk, size_t len)
{
    push_slot_t *slot = &push->slots[k % push->window];
    tally_req_t wire = push->req;
    wire.seq = push->sequenced ? push->res.seq_base + 1 + k : 0;
    tally_status_t status;
    if (push->region) { /* the chunk's slice is free: its previous chunk has been merged */
        size_t slice = (size_t)(k % push->window);
        uint8_t *base = tally_region_data(push->region);
        if (push->gpu_mem) { /* synchronous: the data is on the device before the request */
            status = tally_gpu_copy_to(push->gpu_mem, slice * push->in_slice, chunk, len);
            if (status != TALLY_OK)
                return push_fail(push, status, tally_gpu_error());
        } else if (len) {
            memcpy(base + slice * push->in_slice, chunk, len);
        }
        size_t out_at = push->window * push->in_slice + slice * push->out_slice;
        status = tally_send_shm(push->client, &wire, push->region, slice * push->in_slice, len,
                                push->out_slice ? push->region : NULL, out_at, &slot->request_id);
    } else {
        status = tally_send(push->client, &wire, chunk, len, &slot->request_id);
    }
    if (status != TALLY_OK)
        return push_fail(push, status, push->client->error);
    slot->len = len;
    slot->in_flight = true;
    push->res.chunks++;
    return TALLY_OK;
}

/* A numbered chunk in slot `slot` failed with the daemon's `status`: what the stream holds, when
 * the reply says it. duplicate and sequence_gap carry the stream's last_seq. Any other failure
 * of chunk k, once every chunk before it has been answered ok, means exactly k chunks are in:
 * replies on a stream come in send order, a failed request does not use up its seq, and every
 * later one then gets sequence_gap (PROTOCOL.md, "Sequence numbers"). */
static void push_failed_at(tally_push_t *push, unsigned slot, tally_status_t status,
                           const tally_reply_t *reply)
{
    if (!push->sequenced)
        return;
    if (status == TALLY_E_DUPLICATE || status == TALLY_E_SEQ_GAP) {
        push->res.last_seq = reply->rep.aux0; /* the stream's position, exactly */
        push->res.applied_known = true;
        return;
    }
    for (uint64_t k = push->next_merge; k < push->next_send; k++) {
        const push_slot_t *s = &push->slots[k % push->window];
        if (k % push->window == slot) {
            push->res.last_seq = push->res.seq_base + k;
            push->res.applied_known = true;
            return;
        }
        if (!s->done)
            return; /* an earlier chunk is still unanswered: ask the daemon */
    }
}

/* Receives one reply and parks it in its slot; replies to requests not in the window (left
 * over from an earlier failed call) are dropped. */
static tally_status_t push_receive(tally_push_t *push, tally_reply_t *reply)
{
    tally_status_t status = tally_recv(push->client, reply);
    if (status != TALLY_OK && (is_local_failure(status) || reply->rep.request_id == 0))
        return push_fail(push, status, reply->error);
    for (unsigned i = 0; i < push->window; i++) {
        push_slot_t *slot = &push->slots[i];
        if (!slot->in_flight || slot->request_id != reply->rep.request_id)
            continue;
        if (status != TALLY_OK) {
            push_failed_at(push, i, status, reply);
            return push_fail(push, status, reply->error);
        }
        slot->in_flight = false;
        slot->done = true;
        slot->reply = *reply; /* the slot takes over the payload */
        tally_reply_init(reply);
        return TALLY_OK;
    }
    tally_reply_clear(reply);
    return TALLY_OK;
}

/* Waits for one reply, then merges every chunk that is next in order. */
static tally_status_t push_step(tally_push_t *push)
{
    tally_reply_t reply;
    tally_reply_init(&reply);
    tally_status_t status = push_receive(push, &reply);
    tally_reply_clear(&reply);
    while (status == TALLY_OK && push->next_merge < push->next_send) {
        push_slot_t *slot = &push->slots[push->next_merge % push->window];
        if (!slot->done)
            break;
        status = merge_chunk(push, push->next_merge, slot);
        tally_reply_clear(&slot->reply);
        slot->done = false;
        push->next_merge++;
    }
    return status;
}

/* TALLY_RUN_SHM_GPU: the rings in device memory on GPU 0 (tally_gpu_alloc: CUDA_VISIBLE_DEVICES
 * picks it), registered as an output region, and the host slices the outputs are copied into. */
static tally_status_t push_open_gpu(tally_push_t *push, size_t size)
{
    tally_status_t status = tally_gpu_alloc(0, size, &push->gpu_mem);
    if (status != TALLY_OK) {
        char msg[256];
        snprintf(msg, sizeof msg, "cannot allocate %zu bytes of GPU memory: %s", size,
                 tally_gpu_error());
        return push_fail(push, status, msg);
    }
    status = tally_gpu_register(push->client, push->gpu_mem, TALLY_GPU_OUTPUT, NULL, &push->region);
    if (status != TALLY_OK)
        return push_fail(push, status, push->client->error);
    push->gpu_out = malloc(push->window * push->out_slice + 1);
    return push->gpu_out ? TALLY_OK : push_fail(push, TALLY_E_NOMEM, "out of memory");
}

/* Checks the request and options, and sizes chunks and the window. */
static tally_status_t push_prepare(tally_push_t *push, const tally_run_opts_t *opts)
{
    const tally_req_t *req = &push->req;
    const tally_op_info_t *op = tally_op_info(req->opcode);
    if (!op || !op->batch)
        return push_fail(push, TALLY_E_ARG, "a push takes operations with a batch");
    push->elem_size = tally_dtype_size((tally_dtype_t)req->dtype);
    if (!push->elem_size || !tally_op_takes_dtype(req->opcode, req->dtype))
        return push_fail(push, TALLY_E_ARG, "request has no input dtype");
    push->chunk_bytes = tally__chunk_bytes(opts ? opts->chunk_bytes : 0, push->elem_size);
    const tally__transport_t *transport = push->client->transport;
    if (transport) { /* over NATS: one chunk, one message (and one reply) */
        size_t limit = transport->ops->chunk_limit(transport, req);
        if (limit < push->elem_size) {
            char msg[96];
            snprintf(msg, sizeof msg, "%s messages are too small for one element",
                     transport->ops->name);
            return push_fail(push, TALLY_E_TOO_LARGE, msg);
        }
        if (push->chunk_bytes > limit)
            push->chunk_bytes = limit / push->elem_size * push->elem_size;
    }
    push->window = opts && opts->window ? opts->window : TALLY_DEFAULT_WINDOW;
    if (push->window > TALLY_MAX_WINDOW)
        push->window = TALLY_MAX_WINDOW;
    if (opts && opts->total_bytes) {
        push->total_chunks = tally__chunk_count(opts->total_bytes, push->chunk_bytes);
        if (push->window > push->total_chunks)
            push->window = (unsigned)push->total_chunks;
    }
    if (req->opcode == TALLY_OP_HIST)
        push->res.count = tally__hist_values(req->dtype);
    push->min = INT64_MAX;
    push->max = INT64_MIN;
    if (opts && opts->shm && !(op->flags & TALLY_FLAG_SHM_REF))
        return push_fail(push, TALLY_E_ARG, "this operation takes no shared-memory input");
    push->slots = calloc(push->window, sizeof *push->slots);
    if (!push->slots)
        return push_fail(push, TALLY_E_NOMEM, "out of memory");
    if (!opts || !opts->shm)
        return TALLY_OK;
    /* One region holding the input ring and (filter, scan) the output ring. */
    push->in_slice = push->chunk_bytes;
    push->out_slice = (size_t)tally_shm_out_worst(req, push->chunk_bytes);
    size_t size = push->window * (push->in_slice + push->out_slice);
    if (opts->shm == TALLY_RUN_SHM_GPU)
        return push_open_gpu(push, size);
    tally_status_t status = tally_region_create(push->client, size, &push->region);
    if (status != TALLY_OK)
        return push_fail(push, status, push->client->error);
    return TALLY_OK;
}

/* The stream's last_seq, or 0 for a stream that does not exist (yet). */
static tally_status_t stream_last_seq(tally_client_t *self, const char *stream, uint64_t *last)
{
    if (self->transport) /* a fleet: asked of tally.seq, which a producer may (PROTOCOL.md §13) */
        return self->transport->ops->last_seq(self->transport, stream, last, self->error,
                                              sizeof self->error);
    tally_stream_info_t info;
    tally_status_t status = tally_query(self, stream, &info);
    *last = status == TALLY_OK ? info.last_seq : 0;
    return status == TALLY_E_UNKNOWN_STREAM ? TALLY_OK : status;
}

/* Sequence numbers: where the push starts (seq_base) and how many chunks the stream has
 * already (a resumed push skips them). */
static tally_status_t push_sequence(tally_push_t *push, const tally_run_opts_t *opts)
{
    tally_run_result_t *res = &push->res;
    if (!opts || opts->seq == TALLY_RUN_SEQ_OFF)
        return TALLY_OK;
    if (!push->req.stream_len)
        return push_fail(push, TALLY_E_ARG, "sequence numbers need a stream");
    uint64_t last = 0;
    tally_status_t status = stream_last_seq(push->client, push->req.stream, &last);
    if (status != TALLY_OK)
        return push_fail(push, status, push->client->error);
    push->sequenced = true;
    res->seq_base = opts->seq == TALLY_RUN_SEQ_RESUME ? opts->seq_base : last;
    if (last > res->seq_base) /* resuming: these chunks are in the stream already */
        push->first = last - res->seq_base;
    res->input_chunks = push->total_chunks;
    return TALLY_OK;
}

tally_status_t tally_push_new(tally_client_t *client, const tally_req_t *req,
                              const tally_run_opts_t *opts, tally_output_fn *output, void *arg,
                              tally_push_t **out)
{
    if (!out)
        return TALLY_E_ARG;
    *out = NULL;
    if (!client || !req)
        return TALLY_E_ARG;
    tally_push_t *push = calloc(1, sizeof *push);
    if (!push)
        return TALLY_E_NOMEM;
    *push = (tally_push_t){.client = client, .req = *req, .output = output, .output_arg = arg};
    tally_status_t status = push_prepare(push, opts);
    if (status == TALLY_OK)
        status = push_sequence(push, opts);
    if (status != TALLY_OK) {
        snprintf(client->error, sizeof client->error, "%s", push->res.error);
        tally_push_destroy(&push);
        return status;
    }
    *out = push;
    return TALLY_OK;
}

size_t tally_push_chunk_bytes(const tally_push_t *push)
{
    return push ? push->chunk_bytes : 0;
}

/* Records chunk `index`, `shortfall` bytes shorter than chunk_bytes (indexes grow). */
static tally_status_t short_chunk_note(short_chunks_t *sc, uint64_t index, uint64_t shortfall)
{
    if (!sc->kept && !(sc->kept = malloc(PUSH_SHORT_KEPT * sizeof *sc->kept)))
        return TALLY_E_NOMEM;
    sc->shortfall += shortfall;
    if (sc->count == PUSH_SHORT_KEPT) { /* the oldest goes */
        sc->newest_gone = sc->kept[sc->first];
        sc->let_go = true;
        sc->first = (sc->first + 1) % PUSH_SHORT_KEPT;
        sc->count--;
    }
    sc->kept[(sc->first + sc->count++) % PUSH_SHORT_KEPT] =
        (short_chunk_t){.index = index, .shortfall = sc->shortfall};
    return TALLY_OK;
}

tally_status_t tally_push_write(tally_push_t *push, const void *data, size_t len)
{
    if (!push || (len && !data) || push->finished)
        return TALLY_E_ARG;
    if (push->res.status != TALLY_OK)
        return push->res.status;
    if (len % push->elem_size || len > push->chunk_bytes) {
        char msg[160];
        snprintf(msg, sizeof msg, "a chunk of %zu bytes is not 1..%zu whole %zu-byte elements", len,
                 push->chunk_bytes, push->elem_size);
        return fail(push->client, TALLY_E_ARG, msg); /* refused; the push goes on */
    }
    uint64_t k = push->next_send;
    if (len < push->chunk_bytes &&
        short_chunk_note(&push->shorts, k, push->chunk_bytes - len) != TALLY_OK)
        return push_fail(push, TALLY_E_NOMEM, "out of memory");
    if (k < push->first) { /* a resumed push: the stream has this chunk already */
        push->next_send = push->next_merge = k + 1;
        push->res.skipped++;
    } else {
        tally_status_t status = TALLY_OK;
        while (status == TALLY_OK && push->next_send - push->next_merge >= push->window)
            status = push_step(push);
        if (status == TALLY_OK)
            status = push_send(push, k, data, len);
        if (status != TALLY_OK)
            return status;
        push->next_send = k + 1;
    }
    push->res.bytes += len;
    push->res.elements += len / push->elem_size;
    return TALLY_OK;
}

/* Input bytes of the first `applied` chunks; UINT64_MAX when the records that would say were let
 * go (see PUSH_SHORT_KEPT). */
static uint64_t applied_bytes(const tally_push_t *push, uint64_t applied)
{
    const short_chunks_t *sc = &push->shorts;
    uint64_t before = 0; /* the shortfall of the short chunks before chunk `applied` */
    bool found = false;
    for (unsigned i = sc->count; i-- > 0 && !found;) {
        const short_chunk_t *r = &sc->kept[(sc->first + i) % PUSH_SHORT_KEPT];
        if (r->index < applied) {
            before = r->shortfall;
            found = true;
        }
    }
    if (!found && sc->let_go) {
        if (sc->newest_gone.index >= applied)
            return UINT64_MAX;
        before = sc->newest_gone.shortfall;
    }
    return applied * push->chunk_bytes - before;
}

/* After a push: how many chunks of the input the stream holds. A failed push asks the daemon
 * unless a duplicate or sequence_gap reply said it already; if it cannot be asked, the chunks
 * acknowledged are a lower bound. Every chunk counts once, whatever the replies. */
static void push_account(tally_push_t *push)
{
    tally_run_result_t *res = &push->res;
    if (!res->input_chunks || res->input_chunks < push->next_send)
        res->input_chunks = push->next_send;
    if (!push->sequenced) {
        res->applied = push->next_merge;
        res->applied_known = true;
    } else if (res->status == TALLY_OK) {
        res->last_seq = res->seq_base + push->next_send;
        res->applied_known = true;
    } else if (!res->applied_known) {
        char error[sizeof res->error];
        memcpy(error, res->error, sizeof error); /* the query must not hide the first failure */
        res->applied_known =
            stream_last_seq(push->client, push->req.stream, &res->last_seq) == TALLY_OK;
        memcpy(push->client->error, error, sizeof error);
        if (!res->applied_known)
            res->last_seq = res->seq_base + push->next_merge;
    }
    if (push->sequenced) {
        uint64_t applied = res->last_seq > res->seq_base ? res->last_seq - res->seq_base : 0;
        res->applied = applied < push->next_send ? applied : push->next_send;
    }
    res->applied_bytes = applied_bytes(push, res->applied);
}

tally_status_t tally_push_flush(tally_push_t *push)
{
    if (!push || push->finished)
        return TALLY_E_ARG;
    tally_status_t status = push->res.status;
    while (status == TALLY_OK && push->next_merge < push->next_send)
        status = push_step(push);
    return status;
}

/* minmax: the smallest and largest element of the whole input, two values of its dtype. */
static tally_status_t emit_minmax(tally_push_t *push)
{
    uint8_t out[16];
    size_t len = tally_minmax_encode(push->req.dtype, push->min, push->max, out);
    push->res.count = 2;
    return emit(push, out, len);
}

tally_status_t tally_push_finish(tally_push_t *push)
{
    if (!push)
        return TALLY_E_ARG;
    if (push->finished)
        return push->res.status;
    tally_status_t status = push->res.status;
    while (status == TALLY_OK && push->next_merge < push->next_send)
        status = push_step(push);
    if (status == TALLY_OK && push->req.opcode == TALLY_OP_HIST)
        status = emit(push, push->hist, 8 * tally__hist_values(push->req.dtype));
    if (status == TALLY_OK && push->req.opcode == TALLY_OP_MINMAX && push->min <= push->max)
        status = emit_minmax(push);
    push->finished = true;
    push->res.status = status;
    if (status == TALLY_OK)
        push->res.error[0] = '\0';
    push_account(push);
    return status;
}

const tally_run_result_t *tally_push_result(const tally_push_t *push)
{
    return push ? &push->res : NULL;
}

void tally_push_destroy(tally_push_t **push_p)
{
    if (!push_p || !*push_p)
        return;
    tally_push_t *push = *push_p;
    if (push->slots) {
        for (unsigned i = 0; i < push->window; i++)
            tally_reply_clear(&push->slots[i].reply);
        free(push->slots);
    }
    tally_region_destroy(&push->region);
    tally_gpu_free(&push->gpu_mem);
    free(push->gpu_out);
    free(push->shorts.kept);
    free(push);
    *push_p = NULL;
}

/* tally_run's output: appended to its buffer. */
static tally_status_t append_output(void *arg, const void *data, size_t len)
{
    return tally_buf_append(arg, data, len);
}

/* Writes the whole input through `push`, one chunk at a time (one empty chunk for none). */
static tally_status_t run_chunks(tally_push_t *push, const uint8_t *input, size_t len)
{
    tally_status_t status = TALLY_OK;
    size_t at = 0;
    do {
        size_t n = len - at < push->chunk_bytes ? len - at : push->chunk_bytes;
        status = tally_push_write(push, n ? input + at : NULL, n);
        at += n;
    } while (status == TALLY_OK && at < len);
    return status;
}

tally_status_t tally_run(tally_client_t *self, const tally_req_t *req, const void *input,
                         size_t len, const tally_run_opts_t *opts, tally_buf_t *out,
                         tally_run_result_t *result)
{
    tally_run_result_t local;
    if (!result)
        result = &local;
    memset(result, 0, sizeof *result);
    if (!self || !req || !out || (len && !input))
        return result->status = TALLY_E_ARG;
    size_t esize = tally_dtype_size((tally_dtype_t)req->dtype);
    if (esize && len % esize) {
        snprintf(result->error, sizeof result->error,
                 "input of %zu bytes is not a whole number of %zu-byte %s", len, esize,
                 tally_dtype_name((tally_dtype_t)req->dtype));
        snprintf(self->error, sizeof self->error, "%s", result->error);
        return result->status = TALLY_E_ARG;
    }
    /* The output's size is known from the operation's row: reserve it once (filter keeps at
     * most the input, scan writes 4 or 8 bytes per element, hist one set of counts), so
     * appending never reallocates. */
    size_t need = (size_t)tally_op_reply_bytes(req, len);
    if (tally_buf_reserve(out, need ? need : 1) != TALLY_OK) {
        snprintf(result->error, sizeof result->error, "out of memory for the output");
        return result->status = TALLY_E_NOMEM;
    }
    tally_run_opts_t o = opts ? *opts : (tally_run_opts_t){0};
    o.total_bytes = len;
    tally_push_t *push = NULL;
    tally_status_t status = tally_push_new(self, req, &o, append_output, out, &push);
    if (status != TALLY_OK) {
        snprintf(result->error, sizeof result->error, "%s", self->error);
        return result->status = status;
    }
    status = run_chunks(push, input, len);
    tally_status_t finished = tally_push_finish(push);
    *result = push->res;
    if (status == TALLY_OK)
        status = finished;
    tally_push_destroy(&push);
    return result->status = status;
}

tally_status_t tally_minmax(tally_client_t *self, tally_dtype_t dtype, const void *input,
                            size_t len, int64_t *min, int64_t *max)
{
    if (!min || !max)
        return TALLY_E_ARG;
    *min = INT64_MAX;
    *max = INT64_MIN;
    tally_req_t req = {.opcode = TALLY_OP_MINMAX, .dtype = (uint8_t)dtype};
    tally_buf_t out = {0};
    tally_status_t status = tally_run(self, &req, input, len, NULL, &out, NULL);
    if (status == TALLY_OK && out.len == 2 * tally_dtype_size(dtype))
        tally_minmax_decode(req.dtype, out.data, min, max);
    tally_buf_free(&out);
    return status;
}
