/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_ops.h — the operation table: one row per operation of the protocol (PROTOCOL.md §4,
 * §5), the one place that says what an operation takes and gives.
 *
 * A row holds the facts every layer used to spell out in its own `switch`: the name, the dtypes
 * the request may carry, the flags it may set, what pred/lo/hi mean (a rule of the validator's,
 * named by the row), whether a stream is refused, optional or required, whether the payload is
 * a batch of elements (and so bounded by max_batch and able to carry a seq), how the reply's
 * payload is shaped, and one line of help. The readers:
 *   - the validator (tally_validate.c) checks a request against its row;
 *   - libtally sizes replies and merges a push's chunks by the reply shape;
 *   - the CLI's command list and tally(1) take their one-line summaries from `summary`;
 *   - tallyd dispatches by the row (answered on the loop, a stream control, or a batch) and
 *     keeps its own table of executors per opcode beside it (daemon/core/td_request.c);
 *   - client/python/gen_wire.c prints the table into the Python binding's _wire.py.
 * Adding an operation is a row here (its opcode in tally_proto.h), its kernels, its docs and its
 * tests: CONTRIBUTING.md "Adding an operation" lists the steps.
 *
 * The sections marked PUBLIC are copied into the installed tally_wire.h, after tally_proto.h's.
 */
#ifndef TALLY_OPS_H
#define TALLY_OPS_H

#include "tally_proto.h"

#ifdef __cplusplus
extern "C" {
#endif

#ifndef TALLY_OPS_PUBLIC_H /* PUBLIC: begin (copied into the installed tally_wire.h) */
#define TALLY_OPS_PUBLIC_H
/* ---- The operation table ---------------------------------------------------------------- */

/* How an operation's successful reply payload is shaped (PROTOCOL.md §5). */
typedef enum {
    TALLY_REPLY_EMPTY = 0, /* the header says it all (ping, reset, delete) */
    TALLY_REPLY_TEXT,      /* UTF-8 text (info, stats, streams) */
    TALLY_REPLY_RECORD,    /* one stream record (query) */
    TALLY_REPLY_KEPT,      /* the kept elements, of the batch's dtype: at most the batch (filter) */
    TALLY_REPLY_PREFIX,    /* one sum per element, i64 (i32 with SCAN_OUT_I32) (scan) */
    TALLY_REPLY_COUNTS,    /* tally_hist_values(dtype) u64 counts (hist) */
    TALLY_REPLY_PAIR,      /* two values of the batch's dtype; none for an empty batch (minmax) */
} tally_reply_shape_t;

/* Whether a request names a stream. */
typedef enum {
    TALLY_STREAM_NONE = 0, /* a stream name is refused (bad_stream_name) */
    TALLY_STREAM_OPTIONAL, /* with one, the batch is also applied to the stream's state */
    TALLY_STREAM_REQUIRED, /* without one: bad_stream_name */
} tally_stream_rule_t;

/* What pred, lo and hi mean for an operation: the validator's rule for them. */
typedef enum {
    TALLY_PARAMS_NONE = 0, /* all three are 0 */
    TALLY_PARAMS_FILTER,   /* a predicate and its bounds (PROTOCOL.md §4 "Predicates") */
    TALLY_PARAMS_HIST,     /* i32/u16: the range [lo, hi); the byte types: none */
    TALLY_PARAMS_WINDOW,   /* with QUERY_WINDOW: the window in ms in lo; else none */
} tally_params_t;

typedef struct {
    uint8_t opcode;
    const char *name;    /* as tally_op_name gives it */
    uint32_t dtypes;     /* bit d set: the request may carry dtype d (TALLY_DTYPE_BIT) */
    uint8_t flags;       /* the request flags it accepts; any other bit is bad_param */
    uint8_t params;      /* tally_params_t */
    uint8_t stream;      /* tally_stream_rule_t */
    bool batch;          /* the payload is a batch (bounded by max_batch; may carry a seq) */
    uint8_t reply;       /* tally_reply_shape_t */
    const char *summary; /* one line of help: `tally --help`, tally(1) */
} tally_op_info_t;

#define TALLY_DTYPE_BIT(d) (1u << (d))

/* The row of an opcode, NULL for one this version does not know. */
TALLY_API const tally_op_info_t *tally_op_info(unsigned opcode);
/* The row of a name ("filter"), NULL when none has it. */
TALLY_API const tally_op_info_t *tally_op_find(const char *name);
/* The rows in opcode order: *count receives their number. */
TALLY_API const tally_op_info_t *tally_op_table(size_t *count);
/* Whether opcode's requests may carry dtype. */
TALLY_API bool tally_op_takes_dtype(unsigned opcode, unsigned dtype);
/* "i32 or u8", "u8, i32, u16, rgb8 or rgba8", "none": the dtypes opcode takes, for messages.
 * Writes at most cap bytes with the NUL; returns buf. */
TALLY_API const char *tally_op_dtypes_text(unsigned opcode, char *buf, size_t cap);
/* The most payload bytes the reply to req can carry for a batch of in_bytes: the whole batch
 * (filter), n sums of 8 or 4 bytes (scan), the counts (hist), two elements (minmax); 0 for the
 * operations without a batch. */
TALLY_API uint64_t tally_op_reply_bytes(const tally_req_t *req, uint64_t in_bytes);
/* Whether opcode's reply is an array as long as its batch (filter, scan): only such an
 * operation can write into an output region (PROTOCOL.md §10), and only its output must fit a
 * GPU's buffers; the others' replies are a few values built on the host. */
TALLY_API bool tally_op_has_output(unsigned opcode);
/* The size of one element of the reply's array: the batch's element (filter, minmax), 8 or 4
 * (scan), 8 (hist); 0 without one. */
TALLY_API size_t tally_op_reply_elem(const tally_req_t *req);
#endif /* PUBLIC: end */

/* tally_op_dtypes_text with each dtype's name from name(dtype): the CLI says "rgb" where the
 * wire says "rgb8" (cli_dtype_name). */
const char *tally_op_dtypes_named(unsigned opcode, const char *(*name)(unsigned dtype), char *buf,
                                  size_t cap);

/* minmax's reply payload (PROTOCOL.md §5): the smallest then the largest element, each in the
 * batch's dtype (i32, u8, u16), little-endian. Encoding writes 2 x the element size bytes and
 * returns that length; decoding reads them (the length already checked). */
size_t tally_minmax_encode(uint8_t dtype, int64_t min, int64_t max, uint8_t out[16]);
void tally_minmax_decode(uint8_t dtype, const uint8_t *p, int64_t *min, int64_t *max);

/* The one check of a batch's size against max_batch, for a payload and a shared-memory
 * reference alike: TALLY_E_TOO_LARGE with msg when bytes > max_batch. */
tally_status_t tally_batch_check(uint64_t bytes, size_t max_batch, char *msg, size_t msg_cap);

#ifdef __cplusplus
}
#endif
#endif /* TALLY_OPS_H */
