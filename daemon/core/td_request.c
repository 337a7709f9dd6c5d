/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_request.c — see td_request.h. The compute results are produced directly in the wire
 * layout: tallyd runs on little-endian hosts only (checked at compile time below), so a
 * backend's int32/int64 output array already is the reply payload and is sent without a copy.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_request.h"

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
               "tallyd sends arrays in host order and the protocol is little-endian");

void td_request_queue_push(td_request_queue_t *q, td_request_t *r)
{
    r->next = NULL;
    if (q->tail)
        q->tail->next = r;
    else
        q->head = r;
    q->tail = r;
}

td_request_t *td_request_queue_pop(td_request_queue_t *q)
{
    td_request_t *r = q->head;
    if (!r)
        return NULL;
    q->head = r->next;
    if (!q->head)
        q->tail = NULL;
    r->next = NULL;
    return r;
}

td_request_t *td_request_queue_take_all(td_request_queue_t *q)
{
    td_request_t *first = q->head;
    q->head = q->tail = NULL;
    return first;
}

void td_request_reuse(td_request_t *self)
{
    memset(self, 0, offsetof(td_request_t, identity)); /* the buffers after it: see there */
    self->rep.version = TALLY_PROTO_VERSION;
}

td_request_t *td_request_new(void)
{
    td_request_t *self = malloc(sizeof *self);
    if (self)
        td_request_reuse(self);
    return self;
}

void td_request_release_input(td_request_t *self)
{
    td_bytes_free(&self->arrived);
    td_bytes_free(&self->payload_held);
    free(self->payload_copy);
    self->payload_copy = NULL;
    self->payload = NULL;
    self->out_ptr = NULL;
    td_shm_region_put(&self->shm_in);
    td_shm_region_put(&self->shm_out);
}

void td_request_dispose(td_request_t *self)
{
    td_request_release_input(self);
    td_request_drop_reply(self);
}

void td_request_destroy(td_request_t **self_p)
{
    td_request_t *self = *self_p;
    if (!self)
        return;
    td_request_dispose(self);
    free(self);
    *self_p = NULL;
}

tally_status_t td_request_take_payload(td_request_t *self, td_bytes_t *bytes)
{
    self->payload_held = *bytes;
    *bytes = (td_bytes_t){0};
    self->payload_len = self->payload_held.len;
    self->payload = self->payload_held.data;
    if (self->payload_len && !self->payload)
        return TALLY_E_INTERNAL;
    /* A transport may hand us bytes at any offset (ZeroMQ: inside its receive buffer); the
     * backends read whole elements, so realign (one copy, only when needed). */
    size_t align = tally_dtype_align((tally_dtype_t)self->req.dtype);
    if (self->payload_len && align > 1 && ((uintptr_t)self->payload % align) != 0) {
        self->payload_copy = malloc(self->payload_len);
        if (!self->payload_copy)
            return TALLY_E_INTERNAL;
        memcpy(self->payload_copy, self->payload, self->payload_len);
        self->payload = self->payload_copy;
    }
    return TALLY_OK;
}

void td_request_fail(td_request_t *self, tally_status_t status, const char *fmt, ...)
{
    char message[TALLY_ERROR_MESSAGE_MAX + 1];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    size_t len = n < 0 ? 0 : (size_t)n;
    if (len > TALLY_ERROR_MESSAGE_MAX)
        len = TALLY_ERROR_MESSAGE_MAX;
    td_request_drop_reply(self);
    char *copy = malloc(len ? len : 1);
    if (copy) {
        memcpy(copy, message, len);
        self->reply_data = copy;
        self->reply_len = len;
    }
    self->rep.status = (uint32_t)status;
    self->rep.dtype = TALLY_DTYPE_TEXT;
    self->rep.count = 0;
    self->rep.aux0 = 0;
    self->rep.aux1 = 0;
}

void td_request_drop_reply(td_request_t *self)
{
    if (self->reply_free && self->reply_data)
        self->reply_free(self->reply_data, self->reply_hint);
    else
        free(self->reply_data);
    self->reply_data = NULL;
    self->reply_len = 0;
    self->reply_free = NULL;
    self->reply_hint = NULL;
}

void td_request_lend_reply(td_request_t *self, void (*free_fn)(void *data, void *hint), void *hint)
{
    self->reply_free = free_fn;
    self->reply_hint = hint;
}

void td_request_succeed(td_request_t *self, uint8_t dtype, void *data, size_t len, uint64_t count)
{
    td_request_drop_reply(self);
    self->reply_data = data;
    self->reply_len = len;
    self->rep.status = TALLY_OK;
    self->rep.dtype = dtype;
    self->rep.count = count;
}

/* A filter's or scan's output at data: in the output region the reply carries only the header. */
static void succeed_out(td_request_t *self, uint8_t dtype, void *data, size_t len, uint64_t count)
{
    if (data == self->out_ptr)
        td_request_succeed(self, dtype, NULL, 0, count);
    else
        td_request_succeed(self, dtype, data, len, count);
}

void td_request_filter_result(td_request_t *self, void *out, uint64_t kept)
{
    size_t size = tally_dtype_size((tally_dtype_t)self->req.dtype);
    self->kept = kept;
    succeed_out(self, self->req.dtype, out, kept * size, kept);
    self->rep.aux0 = td_request_elements(self);
}

void td_request_scan_result(td_request_t *self, void *out, int64_t carry)
{
    bool out32 = (self->req.flags & TALLY_FLAG_SCAN_OUT_I32) != 0;
    size_t n = td_request_elements(self);
    self->carry = carry;
    succeed_out(self, out32 ? TALLY_DTYPE_I32 : TALLY_DTYPE_I64, out,
                n * (out32 ? sizeof(int32_t) : sizeof(int64_t)), n);
    self->rep.aux0 = (uint64_t)carry;
}

bool td_op_is_compute(uint8_t opcode)
{
    const tally_op_info_t *row = tally_op_info(opcode);
    return row != NULL && row->batch;
}

size_t td_request_elements(const td_request_t *self)
{
    size_t size = tally_dtype_size((tally_dtype_t)self->req.dtype);
    return size ? self->payload_len / size : 0;
}

/* ---- prepare --------------------------------------------------------------------------- */

static void describe_hist(char *buf, size_t cap, uint8_t dtype, int64_t lo, int64_t hi)
{
    const char *name = tally_dtype_name((tally_dtype_t)dtype);
    if (tally_hist_ranged(dtype))
        snprintf(buf, cap, "%s over [%lld, %lld)", name, (long long)lo, (long long)hi);
    else
        snprintf(buf, cap, "%s", name ? name : "?");
}

/* A scan continues from its stream's carry. */
static bool prepare_scan(td_request_t *self, td_stream_t *stream)
{
    self->carry = stream->info.scan_carry;
    return true;
}

/* A stream keeps one histogram type and range, fixed by its first hist. */
static bool prepare_hist(td_request_t *self, td_stream_t *stream)
{
    const td_stream_info_t *info = &stream->info;
    if (info->hist_dtype == TALLY_DTYPE_NONE)
        return true;
    bool same = info->hist_dtype == self->req.dtype &&
                (!tally_hist_ranged(self->req.dtype) ||
                 (info->hist_lo == self->req.lo && info->hist_hi == self->req.hi));
    if (!same) {
        char have[64], want[64];
        describe_hist(have, sizeof have, info->hist_dtype, info->hist_lo, info->hist_hi);
        describe_hist(want, sizeof want, self->req.dtype, self->req.lo, self->req.hi);
        td_request_fail(self, TALLY_E_STREAM_STATE,
                        "stream '%s' keeps a %s histogram, this request is %s: delete the "
                        "stream first",
                        stream->name, have, want);
        return false;
    }
    return true;
}

bool td_request_prepare(td_request_t *self)
{
    td_stream_t *stream = self->stream;
    const td_op_exec_t *exec = td_op_exec(self->req.opcode);
    self->carry = 0;
    if (!stream || !exec || !exec->prepare)
        return true;
    return exec->prepare(self, stream);
}

/* ---- sequence numbers ------------------------------------------------------------------ */

/* Sequence numbers make a resent batch harmless: the stream applies seq n only right after
 * n - 1. The check happens when a request reaches the head of its stream's FIFO, in arrival
 * order, against seq_admitted; a request is judged a duplicate or a gap only once nothing of its
 * stream is in flight (td_request_seq_waits), so that the verdict and the aux0 it reports are
 * about applied state. Requests pipelined on the GPU are admitted before their predecessors are
 * applied, and a predecessor may still fail, so td_request_apply checks again. */

static void seq_refuse_at(td_request_t *self, tally_status_t status, const char *why,
                          uint64_t last_seq)
{
    td_request_fail(self, status,
                    "seq %" PRIu64 " on stream '%s' %s (the stream is at seq %" PRIu64
                    "): not applied",
                    self->req.seq, self->req.stream, why, last_seq);
    self->rep.aux0 = last_seq; /* the one error reply whose aux0 is not 0 */
}

static void seq_refuse(td_request_t *self, tally_status_t status, const char *why)
{
    seq_refuse_at(self, status, why, self->stream->info.last_seq);
}

bool td_request_seq_opens(td_request_t *self)
{
    if (self->req.seq <= 1)
        return true;
    seq_refuse_at(self, TALLY_E_SEQ_GAP, "skips seq 1", 0);
    return false;
}

bool td_request_seq_waits(const td_request_t *self, bool stream_busy)
{
    return self->req.seq != 0 && stream_busy && self->req.seq != self->stream->seq_admitted + 1;
}

bool td_request_admit(td_request_t *self, bool stream_busy)
{
    td_stream_t *stream = self->stream;
    if (!stream_busy) /* nothing in flight: admitted is applied */
        stream->seq_admitted = stream->info.last_seq;
    uint64_t seq = self->req.seq;
    if (seq != 0 && seq <= stream->seq_admitted) {
        seq_refuse(self, TALLY_E_DUPLICATE, "was applied before");
        return false;
    }
    if (seq != 0 && seq != stream->seq_admitted + 1) {
        char why[64];
        snprintf(why, sizeof why, "skips seq %" PRIu64, stream->seq_admitted + 1);
        seq_refuse(self, TALLY_E_SEQ_GAP, why);
        return false;
    }
    if (!td_request_prepare(self))
        return false; /* a failed request does not use up its seq */
    if (seq != 0)
        stream->seq_admitted = seq;
    return true;
}

/* ---- execute --------------------------------------------------------------------------- */

/* Where a filter's or scan's output goes: the output region, or a malloc'd buffer that becomes
 * the reply payload. NULL (the request failed) when out of memory. */
static void *output_buffer(td_request_t *self, size_t n, size_t size, const char *op)
{
    void *out = self->out_ptr ? self->out_ptr : malloc(n ? n * size : 1);
    if (!out)
        td_request_fail(self, TALLY_E_INTERNAL, "out of memory for a %s of %zu elements", op, n);
    return out;
}

/* The backend returned st: false, with out freed (unless it is the output region) and the
 * request failed, when it is not TALLY_OK. */
static bool backend_ok(td_request_t *self, const tk_backend_t *backend, tally_status_t st,
                       void *out, const char *op)
{
    if (st == TALLY_OK)
        return true;
    if (out != self->out_ptr)
        free(out);
    td_request_fail(self, st, "%s backend failed the %s", backend->name, op);
    return false;
}

static void execute_filter(td_request_t *self, tk_backend_t *backend, size_t n)
{
    void *out = output_buffer(self, n, tally_dtype_size((tally_dtype_t)self->req.dtype), "filter");
    if (!out)
        return;
    tk_filter_spec_t spec = {
        .pred = (tally_pred_t)self->req.pred,
        .lo = self->req.lo,
        .hi = self->req.hi,
        .stable = (self->req.flags & TALLY_FLAG_FILTER_STABLE) != 0,
    };
    size_t kept = 0;
    tally_status_t st = backend->filter(backend->ctx, (tally_dtype_t)self->req.dtype, self->payload,
                                        n, &spec, out, &kept);
    if (backend_ok(self, backend, st, out, "filter"))
        td_request_filter_result(self, out, kept);
}

static void execute_scan(td_request_t *self, tk_backend_t *backend, size_t n)
{
    bool out32 = (self->req.flags & TALLY_FLAG_SCAN_OUT_I32) != 0;
    void *out = output_buffer(self, n, out32 ? sizeof(int32_t) : sizeof(int64_t), "scan");
    if (!out)
        return;
    int64_t carry = self->carry;
    tally_status_t st =
        backend->scan(backend->ctx, self->payload, n,
                      (self->req.flags & TALLY_FLAG_SCAN_EXCLUSIVE) != 0, out32, out, &carry);
    if (backend_ok(self, backend, st, out, "scan"))
        td_request_scan_result(self, out, carry);
}

static void execute_hist(td_request_t *self, tk_backend_t *backend, size_t n)
{
    /* The thread's own scratch (8 KiB: not on the stack of a worker); only the bins the dtype
     * uses are zeroed (a u8 batch: 2 KiB of the 8): backends add into them. */
    static _Thread_local tk_hist_t hist;
    memset(hist.bins, 0,
           (size_t)tally_hist_channels(self->req.dtype) * TALLY_HIST_BINS * sizeof(uint64_t));
    hist.underflow = hist.overflow = 0;
    tally_status_t st = tk_backend_hist(backend, self->req.dtype, self->payload, n, self->req.lo,
                                        self->req.hi, &hist);
    if (backend_ok(self, backend, st, NULL, "histogram"))
        td_request_hist_result(self, &hist);
}

void td_request_hist_result(td_request_t *self, const tk_hist_t *hist)
{
    bool ranged = tally_hist_ranged(self->req.dtype);
    size_t values = tally_hist_values(self->req.dtype);
    size_t bins = (size_t)tally_hist_channels(self->req.dtype) * TALLY_HIST_BINS;
    uint8_t *out = malloc(values * sizeof(uint64_t));
    if (!out) {
        td_request_fail(self, TALLY_E_INTERNAL, "out of memory for a histogram reply");
        return;
    }
    tally_put_u64s(out, hist->bins, bins);
    if (ranged) {
        tally_put_u64(out + 8 * TALLY_HIST_BINS, hist->underflow);
        tally_put_u64(out + 8 * (TALLY_HIST_BINS + 1), hist->overflow);
    }
    td_request_succeed(self, TALLY_DTYPE_U64, out, values * sizeof(uint64_t), values);
    self->rep.aux0 = td_request_elements(self);
}

void td_request_minmax_result(td_request_t *self, int64_t min, int64_t max)
{
    size_t n = td_request_elements(self), esize = tally_dtype_size((tally_dtype_t)self->req.dtype);
    if (n == 0) { /* no element: no smallest or largest, a reply of count 0 */
        td_request_succeed(self, self->req.dtype, NULL, 0, 0);
        self->rep.aux0 = 0;
        return;
    }
    uint8_t *out = malloc(2 * esize);
    if (!out) {
        td_request_fail(self, TALLY_E_INTERNAL, "out of memory for a minmax reply");
        return;
    }
    td_request_succeed(self, self->req.dtype, out,
                       tally_minmax_encode(self->req.dtype, min, max, out), 2);
    self->rep.aux0 = n;
}

static void execute_minmax(td_request_t *self, tk_backend_t *backend, size_t n)
{
    int64_t min = TK_MINMAX_EMPTY_MIN, max = TK_MINMAX_EMPTY_MAX;
    tally_status_t st =
        backend->minmax(backend->ctx, (tally_dtype_t)self->req.dtype, self->payload, n, &min, &max);
    if (backend_ok(self, backend, st, NULL, "minmax"))
        td_request_minmax_result(self, min, max);
}

void td_request_execute(td_request_t *self, tk_backend_t *backend)
{
    const td_op_exec_t *exec = td_op_exec(self->req.opcode);
    if (!exec) {
        td_request_fail(self, TALLY_E_INTERNAL, "opcode %u is not a compute operation",
                        self->req.opcode);
        return;
    }
    exec->execute(self, backend, td_request_elements(self));
}

/* ---- apply ----------------------------------------------------------------------------- */

/* A hist batch into the stream's histograms (all-time and window, at the window clock now):
 * false, with the request failed, when the budget or memory refuses it (nothing changed). */
static bool apply_hist(td_request_t *self, td_stream_t *stream, size_t n)
{
    /* The batch's counts, read back from its reply (td_request_hist_result's layout). */
    static _Thread_local tk_hist_t hist;
    const uint8_t *reply = self->reply_data;
    size_t bins = (size_t)tally_hist_channels(self->req.dtype) * TALLY_HIST_BINS;
    tally_get_u64s(hist.bins, reply, bins);
    bool ranged = tally_hist_ranged(self->req.dtype);
    hist.underflow = ranged ? tally_get_u64(reply + 8 * TALLY_HIST_BINS) : 0;
    hist.overflow = ranged ? tally_get_u64(reply + 8 * (TALLY_HIST_BINS + 1)) : 0;
    char msg[TALLY_ERROR_MESSAGE_MAX];
    tally_status_t st =
        td_stream_add_hist(stream, self->req.dtype, self->req.lo, self->req.hi, hist.bins,
                           hist.underflow, hist.overflow, n, td_clock_ms(), msg, sizeof msg);
    if (st != TALLY_OK)
        td_request_fail(self, st, "stream '%s': %s; the batch was not applied", stream->name, msg);
    return st == TALLY_OK;
}

static bool apply_filter(td_request_t *self, td_stream_t *stream, size_t n)
{
    stream->info.filter_seen += n;
    stream->info.filter_kept += self->kept;
    return true;
}

static bool apply_scan(td_request_t *self, td_stream_t *stream, size_t n)
{
    stream->info.scan_carry = self->carry;
    stream->info.scan_elements += n;
    return true;
}

/* ---- the daemon's table ------------------------------------------------------------------ */

/* What tallyd adds to proto/'s row of each operation that takes a batch (tally_ops.c): its
 * executors. The GPU engines' kernels are per-op code in daemon/gpu/ (td_gpu_sim.c,
 * td_gpu_cuda.c), behind td_gpu_job_t. */
static const td_op_exec_t op_exec[TALLY_OP_COUNT] = {
    [TALLY_OP_FILTER] = {NULL, execute_filter, apply_filter, TD_GPU_MIN_BATCH_FILTER},
    [TALLY_OP_SCAN] = {prepare_scan, execute_scan, apply_scan, TD_GPU_MIN_BATCH_SCAN},
    [TALLY_OP_HIST] = {prepare_hist, execute_hist, apply_hist, TD_GPU_MIN_BATCH_HIST},
    /* minmax takes no stream: nothing to prepare or apply; its reply is two values, like a
     * hist's counts built on the host, so its threshold is the hist's. */
    [TALLY_OP_MINMAX] = {NULL, execute_minmax, NULL, TD_GPU_MIN_BATCH_HIST},
};

const td_op_exec_t *td_op_exec(uint8_t opcode)
{
    return opcode < TALLY_OP_COUNT && op_exec[opcode].execute ? &op_exec[opcode] : NULL;
}

bool td_request_apply(td_request_t *self)
{
    td_stream_t *stream = self->stream;
    if (!stream || self->rep.status != TALLY_OK)
        return self->rep.status == TALLY_OK;
    td_stream_info_t *info = &stream->info;
    uint64_t seq = self->req.seq;
    if (seq != 0 && seq != info->last_seq + 1) { /* a request admitted before it failed */
        char why[96];
        snprintf(why, sizeof why, "cannot follow: seq %" PRIu64 " failed after it was admitted",
                 info->last_seq + 1);
        seq_refuse(self, TALLY_E_SEQ_GAP, why);
        return false;
    }
    size_t n = td_request_elements(self);
    const td_op_exec_t *exec = td_op_exec(self->req.opcode);
    /* The op's own step first: the one that can refuse (a hist the budget refuses) does so
     * before anything changes. */
    if (exec && exec->apply && !exec->apply(self, stream, n))
        return false;
    if (seq != 0)
        info->last_seq = seq;
    td_stream_changed(stream);
    info->batches++;
    info->elements += n;
    info->bytes += self->payload_len;
    return true;
}

void td_bytes_free(td_bytes_t *b)
{
    if (b->free_fn) /* even for no data: the hint may be what holds it (a ZeroMQ message) */
        b->free_fn(b->data, b->hint);
    *b = (td_bytes_t){0};
}

void td_bytes_taken(td_bytes_t *b)
{
    *b = (td_bytes_t){0};
}

void td_reply_no_memory(const td_msg_t *m, td_reply_t *out)
{
    static const char text[] = "out of memory; not run";
    tally_req_t req = {0};
    char why[TALLY_ERROR_MESSAGE_MAX + 1];
    if (m->header)
        tally_req_decode(m->header, m->header_len, &req, why, sizeof why);
    *out = (td_reply_t){.to = m->from,
                        .rep = {.version = TALLY_PROTO_VERSION,
                                .opcode = req.opcode,
                                .flags = req.flags,
                                .request_id = req.request_id,
                                .status = TALLY_E_INTERNAL,
                                .dtype = TALLY_DTYPE_TEXT},
                        .body = {.data = (void *)text, .len = sizeof text - 1}};
    tally_rep_encode(&out->rep, out->header);
}
