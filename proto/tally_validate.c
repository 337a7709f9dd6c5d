/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_validate.c — the validator: whether a request's fields agree with each other, with its
 * operation's row and with its payload (PROTOCOL.md §6, step 7), and the rules of a stream name
 * and of a shared-memory reference. It reads the operation table (tally_ops.c); the table never
 * calls it. The codec (tally_proto.c) calls it on every header it decodes; tallyd and libtally
 * call tally_req_validate on a complete request.
 *
 * Every rejection writes a sentence naming the offending value into the caller's buffer (through
 * tally__fail, which the codec's own refusals use too); the daemon sends it back as the error
 * reply's payload, so it must make sense to a user.
 *
 * Pure C11: no allocation, no I/O (snprintf only formats into the caller's buffer).
 */
#include "tally_validate.h"

#include "tally_ops.h"
#include "tally_proto.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

/* Element type names for messages meant for people ("int32 elements"). */
static const char *dtype_long_name(unsigned dtype)
{
    static const char *const names[TALLY_DTYPE_COUNT] = {
        "none", "int32", "uint8", "int64", "uint64", "text", "uint16", "rgb8 pixel", "rgba8 pixel"};
    return dtype < TALLY_DTYPE_COUNT ? names[dtype] : "none";
}

/* ---- Error messages --------------------------------------------------------------------- */

tally_status_t tally__fail(tally_status_t status, char *msg, size_t msg_cap, const char *fmt, ...)
{
    if (msg != NULL && msg_cap > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, msg_cap, fmt, ap);
        va_end(ap);
    }
    return status;
}

void tally__msg_clear(char *msg, size_t msg_cap)
{
    if (msg != NULL && msg_cap > 0)
        msg[0] = '\0';
}

/* ---- Stream names ----------------------------------------------------------------------- */

static bool name_byte_valid(uint8_t c)
{
    return c >= 0x21 && c <= 0x7E;
}

bool tally_stream_name_valid(const char *name, size_t len)
{
    if (name == NULL || len == 0 || len > TALLY_STREAM_NAME_MAX)
        return false;
    for (size_t i = 0; i < len; i++) {
        if (!name_byte_valid((uint8_t)name[i]))
            return false;
    }
    return true;
}

tally_status_t tally_req_set_stream(tally_req_t *req, const char *name)
{
    if (req == NULL)
        return TALLY_E_ARG;
    if (name == NULL) {
        req->stream_len = 0;
        memset(req->stream, 0, sizeof req->stream);
        return TALLY_OK;
    }
    size_t len = 0;
    while (len <= TALLY_STREAM_NAME_MAX && name[len] != '\0')
        len++;
    if (!tally_stream_name_valid(name, len))
        return TALLY_E_STREAM_NAME;
    memset(req->stream, 0, sizeof req->stream);
    memcpy(req->stream, name, len);
    req->stream_len = (uint8_t)len;
    return TALLY_OK;
}

/* Explains why the stream name of req is invalid; TALLY_OK when it is valid or absent. */
tally_status_t tally__check_stream_name(const tally_req_t *req, char *msg, size_t msg_cap)
{
    if (req->stream_len > TALLY_STREAM_NAME_MAX)
        return tally__fail(TALLY_E_STREAM_NAME, msg, msg_cap,
                           "stream name of %u bytes exceeds the maximum of %d", req->stream_len,
                           TALLY_STREAM_NAME_MAX);
    for (size_t i = 0; i < req->stream_len; i++) {
        uint8_t c = (uint8_t)req->stream[i];
        if (!name_byte_valid(c))
            return tally__fail(TALLY_E_STREAM_NAME, msg, msg_cap,
                               "stream name byte %zu is 0x%02x; names are printable ASCII "
                               "(0x21..0x7e) without spaces",
                               i, c);
    }
    return TALLY_OK;
}

/* ---- Request validation ----------------------------------------------------------------- */

static const char *op_label(const tally_req_t *req)
{
    const char *name = tally_op_name((tally_op_t)req->opcode);
    return name != NULL ? name : "?";
}

static const char *dtype_label(unsigned dtype)
{
    const char *name = tally_dtype_name((tally_dtype_t)dtype);
    return name != NULL ? name : "?";
}

static tally_status_t check_flags(const tally_req_t *req, unsigned allowed, char *msg,
                                  size_t msg_cap)
{
    unsigned extra = req->flags & ~allowed;
    if (extra != 0)
        return tally__fail(TALLY_E_PARAM, msg, msg_cap, "flags 0x%02x are not defined for %s",
                           extra, op_label(req));
    return TALLY_OK;
}

/* Operations without a predicate or range must send pred, lo and hi as zero. */
static tally_status_t check_no_pred_range(const tally_req_t *req, char *msg, size_t msg_cap)
{
    if (req->pred != 0)
        return tally__fail(TALLY_E_PARAM, msg, msg_cap, "%s takes no predicate (got %u)",
                           op_label(req), req->pred);
    if (req->lo != 0 || req->hi != 0)
        return tally__fail(TALLY_E_PARAM, msg, msg_cap,
                           "%s %s takes no lo/hi parameters (got lo=%" PRId64 ", hi=%" PRId64 ")",
                           op_label(req), dtype_label(req->dtype), req->lo, req->hi);
    return TALLY_OK;
}

/* A dtype the operation's row does not list. */
static tally_status_t check_dtype(const tally_req_t *req, char *msg, size_t msg_cap)
{
    if (tally_op_takes_dtype(req->opcode, req->dtype))
        return TALLY_OK;
    char takes[64];
    return tally__fail(TALLY_E_DTYPE, msg, msg_cap, "%s takes dtype %s (got %s)", op_label(req),
                       tally_op_dtypes_text(req->opcode, takes, sizeof takes),
                       dtype_label(req->dtype));
}

/* TALLY_PARAMS_NONE: the row's flags, and no predicate or range. */
static tally_status_t params_none(const tally_req_t *req, unsigned flags, char *msg, size_t msg_cap)
{
    tally_status_t st = check_flags(req, flags, msg, msg_cap);
    if (st != TALLY_OK)
        return st;
    return check_no_pred_range(req, msg, msg_cap);
}

/* TALLY_PARAMS_FILTER: a known predicate and its bounds, then the flags. */
static tally_status_t params_filter(const tally_req_t *req, unsigned flags, char *msg,
                                    size_t msg_cap)
{
    if (req->pred < TALLY_PRED_GT || req->pred > TALLY_PRED_BETWEEN)
        return tally__fail(TALLY_E_PARAM, msg, msg_cap,
                           "unknown filter predicate %u (known: 1..%d)", req->pred,
                           TALLY_PRED_BETWEEN);
    /* A single-threshold predicate has no use for hi; rejecting a nonzero one (like every other
     * unused field) keeps the value free for a later protocol version and catches a client that
     * meant `between`. */
    if (req->pred != TALLY_PRED_BETWEEN && req->hi != 0)
        return tally__fail(TALLY_E_PARAM, msg, msg_cap,
                           "filter %s takes no hi; send it as 0 (got hi=%" PRId64 ")",
                           tally_pred_name((tally_pred_t)req->pred), req->hi);
    if (req->pred == TALLY_PRED_BETWEEN && req->lo > req->hi)
        return tally__fail(TALLY_E_PARAM, msg, msg_cap,
                           "filter between needs lo <= hi (got lo=%" PRId64 ", hi=%" PRId64 ")",
                           req->lo, req->hi);
    return check_flags(req, flags, msg, msg_cap);
}

/* The range [lo, hi) a ranged histogram of dtype admits: i32 [-2^31, 2^31], u16 [0, 2^16]. */
static void hist_range_limits(unsigned dtype, int64_t *min, int64_t *max)
{
    *min = dtype == TALLY_DTYPE_U16 ? 0 : INT32_MIN;
    *max = dtype == TALLY_DTYPE_U16 ? (int64_t)UINT16_MAX + 1 : (int64_t)INT32_MAX + 1;
}

/* TALLY_PARAMS_HIST: the flags, then the range of i32 and u16 (none for the byte types). */
static tally_status_t params_hist(const tally_req_t *req, unsigned flags, char *msg, size_t msg_cap)
{
    if (!tally_hist_ranged(req->dtype))
        return params_none(req, flags, msg, msg_cap);
    tally_status_t st = check_flags(req, flags, msg, msg_cap);
    if (st != TALLY_OK)
        return st;
    if (req->pred != 0)
        return tally__fail(TALLY_E_PARAM, msg, msg_cap, "hist takes no predicate (got %u)",
                           req->pred);
    const char *type = dtype_label(req->dtype);
    if (req->lo >= req->hi)
        return tally__fail(TALLY_E_PARAM, msg, msg_cap,
                           "hist %s range [lo, hi) needs lo < hi (got lo=%" PRId64 ", hi=%" PRId64
                           ")",
                           type, req->lo, req->hi);
    int64_t min, max;
    hist_range_limits(req->dtype, &min, &max);
    if (req->lo < min || req->hi > max)
        return tally__fail(TALLY_E_PARAM, msg, msg_cap,
                           "hist %s range [%" PRId64 ", %" PRId64 ") is not within [%" PRId64
                           ", %" PRId64 "]",
                           type, req->lo, req->hi, min, max);
    return TALLY_OK;
}

/* TALLY_PARAMS_WINDOW: with QUERY_WINDOW, the window (1 ms .. TALLY_WINDOW_MS_MAX) in lo. */
static tally_status_t params_window(const tally_req_t *req, unsigned flags, char *msg,
                                    size_t msg_cap)
{
    if (!(req->flags & TALLY_FLAG_QUERY_WINDOW))
        return params_none(req, flags, msg, msg_cap);
    tally_status_t st = check_flags(req, flags, msg, msg_cap);
    if (st != TALLY_OK)
        return st;
    if (req->pred != 0 || req->hi != 0)
        return tally__fail(TALLY_E_PARAM, msg, msg_cap,
                           "a window query takes no predicate or hi (got pred=%u, hi=%" PRId64 ")",
                           req->pred, req->hi);
    if (req->lo < 1 || req->lo > TALLY_WINDOW_MS_MAX)
        return tally__fail(TALLY_E_PARAM, msg, msg_cap,
                           "a window query needs a window of 1..%" PRId64 " ms in lo (got %" PRId64
                           ")",
                           (int64_t)TALLY_WINDOW_MS_MAX, req->lo);
    return TALLY_OK;
}

/* The rule for flags, pred, lo and hi that a row names (tally_params_t). */
static tally_status_t (*const params_rules[])(const tally_req_t *, unsigned, char *, size_t) = {
    [TALLY_PARAMS_NONE] = params_none,
    [TALLY_PARAMS_FILTER] = params_filter,
    [TALLY_PARAMS_HIST] = params_hist,
    [TALLY_PARAMS_WINDOW] = params_window,
};

/* A stream given or missing against the row's rule. */
static tally_status_t check_stream_rule(const tally_req_t *req, const tally_op_info_t *row,
                                        char *msg, size_t msg_cap)
{
    if (row->stream == TALLY_STREAM_REQUIRED && req->stream_len == 0)
        return tally__fail(TALLY_E_STREAM_NAME, msg, msg_cap, "%s needs a stream name", row->name);
    if (row->stream == TALLY_STREAM_NONE && req->stream_len != 0)
        return tally__fail(TALLY_E_STREAM_NAME, msg, msg_cap,
                           "%s takes no stream name (got \"%.*s\")", row->name,
                           (int)req->stream_len, req->stream);
    return TALLY_OK;
}

/* A sequence number orders the batches applied to one stream, so only a batch that names a
 * stream may carry one; on anything else it would be silently meaningless. */
static tally_status_t check_seq(const tally_req_t *req, const tally_op_info_t *row, char *msg,
                                size_t msg_cap)
{
    if (req->seq == 0)
        return TALLY_OK;
    if (!row->batch || row->stream == TALLY_STREAM_NONE)
        return tally__fail(TALLY_E_PARAM, msg, msg_cap,
                           "%s takes no sequence number (got seq=%" PRIu64 ")", op_label(req),
                           req->seq);
    if (req->stream_len == 0)
        return tally__fail(TALLY_E_PARAM, msg, msg_cap,
                           "a sequence number (seq=%" PRIu64 ") needs a stream: %s without one has "
                           "nothing to order",
                           req->seq, op_label(req));
    return TALLY_OK;
}

/* "1..10, 13": the opcodes the table has, for the message about one it has not. */
static void known_opcodes(char *buf, size_t cap)
{
    size_t at = 0;
    buf[0] = '\0';
    for (unsigned op = 1; op < TALLY_OP_COUNT && at < cap; op++) {
        if (!tally_op_info(op) || (tally_op_info(op - 1) && op > 1))
            continue;
        unsigned last = op;
        while (tally_op_info(last + 1))
            last++;
        int n = last == op ? snprintf(buf + at, cap - at, "%s%u", at ? ", " : "", op)
                           : snprintf(buf + at, cap - at, "%s%u..%u", at ? ", " : "", op, last);
        at += n > 0 ? (size_t)n : 0;
    }
}

/* The opcode and dtype are ones this version knows. */
tally_status_t tally__check_ranges(const tally_req_t *req, char *msg, size_t msg_cap)
{
    if (tally_op_info(req->opcode) == NULL) {
        char known[64];
        known_opcodes(known, sizeof known);
        return tally__fail(TALLY_E_OPCODE, msg, msg_cap, "unknown opcode %u (known: %s)",
                           req->opcode, known);
    }
    if (req->dtype >= TALLY_DTYPE_COUNT)
        return tally__fail(TALLY_E_DTYPE, msg, msg_cap, "unknown dtype %u (known: 0..%d)",
                           req->dtype, TALLY_DTYPE_COUNT - 1);
    return TALLY_OK;
}

/* Opcode and dtype ranges, the stream name, then the operation's row: the dtype, its rule for
 * flags, pred, lo and hi, the stream, then seq (PROTOCOL.md §6, step 7). */
tally_status_t tally__validate_fields(const tally_req_t *req, char *msg, size_t msg_cap)
{
    tally_status_t st = tally__check_ranges(req, msg, msg_cap);
    if (st == TALLY_OK)
        st = tally__check_stream_name(req, msg, msg_cap);
    if (st != TALLY_OK)
        return st;
    const tally_op_info_t *row = tally_op_info(req->opcode);
    if ((st = check_dtype(req, msg, msg_cap)) != TALLY_OK ||
        (st = params_rules[row->params](req, row->flags, msg, msg_cap)) != TALLY_OK ||
        (st = check_stream_rule(req, row, msg, msg_cap)) != TALLY_OK)
        return st;
    return check_seq(req, row, msg, msg_cap);
}

/* Size first (so a huge batch is reported as too large, whatever its alignment), then shape. */
static tally_status_t validate_payload(const tally_req_t *req, size_t payload_len, size_t max_batch,
                                       char *msg, size_t msg_cap)
{
    /* Only rows that list the flag accept it (validate_fields): their data is elsewhere,
     * checked by tally_shm_ref_validate once the reference is decoded. */
    if (req->flags & TALLY_FLAG_SHM_REF) {
        if (payload_len != TALLY_SHM_REF_SIZE)
            return tally__fail(TALLY_E_PAYLOAD, msg, msg_cap,
                               "a shared-memory reference is %d bytes (got %zu)",
                               TALLY_SHM_REF_SIZE, payload_len);
        return TALLY_OK;
    }
    tally_status_t st = tally_batch_check(payload_len, max_batch, msg, msg_cap);
    if (st != TALLY_OK)
        return st;
    if (!tally_op_info(req->opcode)->batch) {
        if (payload_len != 0)
            return tally__fail(TALLY_E_PAYLOAD, msg, msg_cap,
                               "%s takes an empty payload (got %zu bytes)", op_label(req),
                               payload_len);
        return TALLY_OK;
    }
    size_t elem = tally_dtype_size((tally_dtype_t)req->dtype);
    if (elem != 0 && payload_len % elem != 0)
        return tally__fail(TALLY_E_PAYLOAD, msg, msg_cap,
                           "payload of %zu bytes is not a whole number of %s elements", payload_len,
                           dtype_long_name(req->dtype));
    return TALLY_OK;
}

tally_status_t tally_req_validate(const tally_req_t *req, size_t payload_len, size_t max_batch,
                                  char *msg, size_t msg_cap)
{
    tally__msg_clear(msg, msg_cap);
    if (req == NULL)
        return tally__fail(TALLY_E_ARG, msg, msg_cap, "no request to validate");
    tally_status_t st = tally__validate_fields(req, msg, msg_cap);
    if (st != TALLY_OK)
        return st;
    return validate_payload(req, payload_len, max_batch, msg, msg_cap);
}

/* ---- Shared-memory references --------------------------------------------------------- */

uint64_t tally_shm_out_worst(const tally_req_t *req, uint64_t in_length)
{
    return tally_op_has_output(req->opcode) ? tally_op_reply_bytes(req, in_length) : 0;
}

tally_status_t tally_shm_ref_validate(const tally_req_t *req, const tally_shm_ref_t *ref,
                                      size_t max_batch, char *msg, size_t msg_cap)
{
    tally__msg_clear(msg, msg_cap);
    tally_status_t st = tally_batch_check(ref->in_length, max_batch, msg, msg_cap);
    if (st != TALLY_OK)
        return st;
    size_t elem = tally_dtype_size((tally_dtype_t)req->dtype);
    if (elem == 0 || ref->in_length % elem != 0)
        return tally__fail(TALLY_E_PAYLOAD, msg, msg_cap,
                           "input of %" PRIu64 " bytes is not a whole number of %s elements",
                           ref->in_length, dtype_long_name(req->dtype));
    size_t align = tally_dtype_align((tally_dtype_t)req->dtype);
    if (ref->in_offset % align != 0)
        return tally__fail(TALLY_E_BAD_REF, msg, msg_cap,
                           "input offset %" PRIu64 " is not a multiple of the %zu-byte element",
                           ref->in_offset, align);
    if (ref->out_handle == 0) {
        if (ref->out_offset != 0 || ref->out_length != 0)
            return tally__fail(TALLY_E_BAD_REF, msg, msg_cap,
                               "out_offset and out_length must be 0 without an output region");
        return TALLY_OK;
    }
    if (!tally_op_has_output(req->opcode))
        return tally__fail(TALLY_E_BAD_REF, msg, msg_cap, "%s takes no output region",
                           op_label(req));
    size_t out_elem = tally_op_reply_elem(req);
    if (ref->out_offset % out_elem != 0)
        return tally__fail(TALLY_E_BAD_REF, msg, msg_cap,
                           "output offset %" PRIu64
                           " is not a multiple of the %zu-byte output element",
                           ref->out_offset, out_elem);
    uint64_t worst = tally_shm_out_worst(req, ref->in_length);
    if (ref->out_length < worst)
        return tally__fail(TALLY_E_BAD_REF, msg, msg_cap,
                           "output range of %" PRIu64 " bytes is smaller than the %" PRIu64
                           " bytes %s may write",
                           ref->out_length, worst, op_label(req));
    return TALLY_OK;
}
