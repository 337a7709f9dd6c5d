/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_types.c — the protocol's numbers in words and sizes (tally_proto.h): the name and the
 * sentence of each status, the names of dtypes and predicates, a dtype's element size and
 * alignment, and the shape of its histogram.
 *
 * The lowest floor of proto/: it reads nothing but tally_proto.h's enums, and the operation table
 * (tally_ops.c), the validator (tally_validate.c) and the codec (tally_proto.c) stand on it, each
 * calling only the floors below its own (tally_validate.h draws them; tests/test_walls.sh checks
 * them). An operation's name is a column of its row, so tally_op_name is in tally_ops.c.
 *
 * Pure C11, no allocation, no I/O, like the rest of proto/.
 */
#include "tally_proto.h"

#include <stddef.h>

#define COUNT_OF(a) (sizeof(a) / sizeof((a)[0]))

/* One row per status: the stable name tools and logs print, and the sentence for people. */
static const struct {
    tally_status_t status;
    const char *name;
    const char *text;
} status_table[] = {
    {TALLY_OK, "ok", "success"},
    {TALLY_E_HEADER, "bad_header", "the request header is truncated or oversized"},
    {TALLY_E_MAGIC, "bad_magic", "the header does not start with the magic bytes \"TLYD\""},
    {TALLY_E_VERSION, "bad_version", "the protocol version is not supported"},
    {TALLY_E_OPCODE, "bad_opcode", "the opcode is unknown"},
    {TALLY_E_DTYPE, "bad_dtype", "the dtype is unknown or not accepted by the operation"},
    {TALLY_E_PAYLOAD, "bad_payload", "the payload is not a whole number of elements, or not empty"},
    {TALLY_E_TOO_LARGE, "too_large", "the payload exceeds the maximum batch size"},
    {TALLY_E_STREAM_NAME, "bad_stream_name",
     "the stream name is missing, too long or not printable ASCII"},
    {TALLY_E_UNKNOWN_STREAM, "unknown_stream", "the stream does not exist"},
    {TALLY_E_FRAMES, "bad_frames", "the message has missing or extra frames"},
    {TALLY_E_PARAM, "bad_param", "a predicate, flag, range or reserved field is invalid"},
    {TALLY_E_STREAM_STATE, "stream_state", "the request conflicts with the stream's state"},
    {TALLY_E_LIMIT, "limit", "a daemon resource limit was reached"},
    {TALLY_E_BACKEND, "backend", "the compute backend failed"},
    {TALLY_E_SHUTDOWN, "shutdown", "the daemon is shutting down"},
    {TALLY_E_INTERNAL, "internal", "internal error in the daemon"},
    {TALLY_E_DUPLICATE, "duplicate",
     "the request's sequence number was already applied on the stream; not applied again"},
    {TALLY_E_SEQ_GAP, "sequence_gap",
     "the request's sequence number skips one the stream has not applied; not applied"},
    {TALLY_E_BAD_REF, "bad_ref",
     "a shared-memory reference names no region of this peer, or a range outside it"},
    {TALLY_E_QUOTA, "quota", "a shared-memory quota would be exceeded"},
    {TALLY_E_BUSY, "busy",
     "this connection already has its share of requests in flight; retry after a reply"},
    {TALLY_E_CLIENT_STREAMS, "client_streams", "this client already holds its maximum of streams"},
    {TALLY_E_RATE, "rate_limited", "this client creates streams faster than allowed"},
    {TALLY_E_WINDOW, "bad_window",
     "the window is longer than the daemon keeps of a stream, or windows are off"},
    {TALLY_E_NOT_PERMITTED, "not_permitted",
     "the sender may not do this (on a fleet worker, streams change only through their "
     "partition)"},
    {TALLY_E_NOT_OWNER, "not_owner",
     "this fleet member does not own the stream's partition; send it to the owner"},
    {TALLY_E_NOT_DURABLE, "not_durable",
     "the request ran, but its effect was not made durable in the partition's changelog; send it "
     "again with its seq to the partition's next owner"},
    {TALLY_E_TIMEOUT, "timeout", "no reply from the daemon within the timeout"},
    {TALLY_E_TRANSPORT, "transport", "the ZeroMQ transport failed"},
    {TALLY_E_REPLY, "bad_reply", "the reply from the daemon is malformed"},
    {TALLY_E_NOMEM, "nomem", "out of memory"},
    {TALLY_E_ARG, "bad_argument", "invalid argument"},
    {TALLY_E_IO, "io", "input/output error"},
};

const char *tally_status_name(tally_status_t status)
{
    for (size_t i = 0; i < COUNT_OF(status_table); i++) {
        if (status_table[i].status == status)
            return status_table[i].name;
    }
    return "unknown";
}

const char *tally_status_text(tally_status_t status)
{
    for (size_t i = 0; i < COUNT_OF(status_table); i++) {
        if (status_table[i].status == status)
            return status_table[i].text;
    }
    return "unknown status";
}

/* Indexed by the wire code; the dtypes are dense from 0 (the operations are rows of
 * tally_ops.c). */
static const char *const dtype_names[TALLY_DTYPE_COUNT] = {
    [TALLY_DTYPE_NONE] = "none", [TALLY_DTYPE_I32] = "i32",   [TALLY_DTYPE_U8] = "u8",
    [TALLY_DTYPE_I64] = "i64",   [TALLY_DTYPE_U64] = "u64",   [TALLY_DTYPE_TEXT] = "text",
    [TALLY_DTYPE_U16] = "u16",   [TALLY_DTYPE_RGB8] = "rgb8", [TALLY_DTYPE_RGBA8] = "rgba8",
};
static const size_t dtype_sizes[TALLY_DTYPE_COUNT] = {
    [TALLY_DTYPE_I32] = 4, [TALLY_DTYPE_U8] = 1,   [TALLY_DTYPE_I64] = 8,   [TALLY_DTYPE_U64] = 8,
    [TALLY_DTYPE_U16] = 2, [TALLY_DTYPE_RGB8] = 3, [TALLY_DTYPE_RGBA8] = 4,
};
static const char *const pred_names[TALLY_PRED_BETWEEN + 1] = {
    [TALLY_PRED_GT] = "gt",           [TALLY_PRED_GE] = "ge", [TALLY_PRED_LT] = "lt",
    [TALLY_PRED_LE] = "le",           [TALLY_PRED_EQ] = "eq", [TALLY_PRED_NE] = "ne",
    [TALLY_PRED_BETWEEN] = "between",
};

/* The casts to unsigned make negative values (possible for an enum argument) out of range. */
const char *tally_dtype_name(tally_dtype_t dtype)
{
    return (unsigned)dtype < TALLY_DTYPE_COUNT ? dtype_names[dtype] : NULL;
}

const char *tally_pred_name(tally_pred_t pred)
{
    return (unsigned)pred <= TALLY_PRED_BETWEEN ? pred_names[pred] : NULL;
}

size_t tally_dtype_size(tally_dtype_t dtype)
{
    return (unsigned)dtype < TALLY_DTYPE_COUNT ? dtype_sizes[dtype] : 0;
}

size_t tally_dtype_align(tally_dtype_t dtype)
{
    if (dtype == TALLY_DTYPE_RGB8 || dtype == TALLY_DTYPE_RGBA8)
        return 1; /* read channel by channel: a pixel is bytes, not a word */
    return tally_dtype_size(dtype);
}

unsigned tally_hist_channels(unsigned dtype)
{
    switch (dtype) {
    case TALLY_DTYPE_U8:
    case TALLY_DTYPE_I32:
    case TALLY_DTYPE_U16:
        return 1;
    case TALLY_DTYPE_RGB8:
        return 3;
    case TALLY_DTYPE_RGBA8:
        return 4;
    default:
        return 0;
    }
}

bool tally_hist_ranged(unsigned dtype)
{
    return dtype == TALLY_DTYPE_I32 || dtype == TALLY_DTYPE_U16;
}

size_t tally_hist_values(unsigned dtype)
{
    if (tally_hist_ranged(dtype))
        return TALLY_HIST_I32_VALUES;
    return (size_t)tally_hist_channels(dtype) * TALLY_HIST_BINS;
}
