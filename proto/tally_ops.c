/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_ops.c — the operation table (see tally_ops.h): one row per operation, and the small
 * functions that answer questions from the rows. The table is indexed by opcode, so a lookup is
 * one bounds check; opcodes the protocol reserves (11, 12: issue 12) have no row.
 *
 * Pure C11, no allocation, no I/O, like the rest of proto/.
 */
#include "tally_ops.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#define BIT TALLY_DTYPE_BIT

/* Columns in tally_op_info_t's order: opcode, name, dtypes, flags, params, stream, batch, reply,
 * summary. PROTOCOL.md §4 and §5 say the same in words (tests/test_optable.c checks the rows
 * against them). */
/* clang-format off */
static const tally_op_info_t op_rows[TALLY_OP_COUNT] = {
    [TALLY_OP_PING] = {TALLY_OP_PING, "ping", BIT(TALLY_DTYPE_NONE), 0, TALLY_PARAMS_NONE,
                       TALLY_STREAM_NONE, false, TALLY_REPLY_EMPTY, "check that tallyd answers"},
    [TALLY_OP_INFO] = {TALLY_OP_INFO, "info", BIT(TALLY_DTYPE_NONE), 0, TALLY_PARAMS_NONE,
                       TALLY_STREAM_NONE, false, TALLY_REPLY_TEXT,
                       "daemon version, backends and limits"},
    [TALLY_OP_FILTER] = {TALLY_OP_FILTER, "filter", BIT(TALLY_DTYPE_I32) | BIT(TALLY_DTYPE_U8),
                         TALLY_FLAG_FILTER_STABLE | TALLY_FLAG_SHM_REF, TALLY_PARAMS_FILTER,
                         TALLY_STREAM_OPTIONAL, true, TALLY_REPLY_KEPT,
                         "keep the elements that satisfy a predicate"},
    [TALLY_OP_SCAN] = {TALLY_OP_SCAN, "scan", BIT(TALLY_DTYPE_I32),
                       TALLY_FLAG_SCAN_EXCLUSIVE | TALLY_FLAG_SCAN_OUT_I32 | TALLY_FLAG_SHM_REF,
                       TALLY_PARAMS_NONE, TALLY_STREAM_OPTIONAL, true, TALLY_REPLY_PREFIX,
                       "prefix sums of int32 input"},
    [TALLY_OP_HIST] = {TALLY_OP_HIST, "hist",
                       BIT(TALLY_DTYPE_U8) | BIT(TALLY_DTYPE_I32) | BIT(TALLY_DTYPE_U16) |
                           BIT(TALLY_DTYPE_RGB8) | BIT(TALLY_DTYPE_RGBA8),
                       TALLY_FLAG_SHM_REF, TALLY_PARAMS_HIST, TALLY_STREAM_OPTIONAL, true,
                       TALLY_REPLY_COUNTS, "256-bin histogram of u8, i32, u16 or rgb/rgba input"},
    [TALLY_OP_QUERY] = {TALLY_OP_QUERY, "query", BIT(TALLY_DTYPE_NONE), TALLY_FLAG_QUERY_WINDOW,
                        TALLY_PARAMS_WINDOW, TALLY_STREAM_REQUIRED, false, TALLY_REPLY_RECORD,
                        "a stream's histogram summary, counters and bins"},
    [TALLY_OP_RESET] = {TALLY_OP_RESET, "reset", BIT(TALLY_DTYPE_NONE), 0, TALLY_PARAMS_NONE,
                        TALLY_STREAM_REQUIRED, false, TALLY_REPLY_EMPTY,
                        "zero a stream's counts, keep the stream"},
    [TALLY_OP_STREAMS] = {TALLY_OP_STREAMS, "streams", BIT(TALLY_DTYPE_NONE), 0,
                          TALLY_PARAMS_NONE, TALLY_STREAM_NONE, false, TALLY_REPLY_TEXT,
                          "list streams"},
    [TALLY_OP_STATS] = {TALLY_OP_STATS, "stats", BIT(TALLY_DTYPE_NONE), 0, TALLY_PARAMS_NONE,
                        TALLY_STREAM_NONE, false, TALLY_REPLY_TEXT,
                        "daemon metrics (Prometheus text)"},
    [TALLY_OP_DELETE] = {TALLY_OP_DELETE, "delete", BIT(TALLY_DTYPE_NONE), 0, TALLY_PARAMS_NONE,
                         TALLY_STREAM_REQUIRED, false, TALLY_REPLY_EMPTY, "remove a stream"},
    [TALLY_OP_MINMAX] = {TALLY_OP_MINMAX, "minmax",
                         BIT(TALLY_DTYPE_I32) | BIT(TALLY_DTYPE_U8) | BIT(TALLY_DTYPE_U16), 0,
                         TALLY_PARAMS_NONE, TALLY_STREAM_NONE, true, TALLY_REPLY_PAIR,
                         "smallest and largest value of i32, u8 or u16 input"},
};
/* clang-format on */

const tally_op_info_t *tally_op_info(unsigned opcode)
{
    if (opcode >= TALLY_OP_COUNT || op_rows[opcode].name == NULL)
        return NULL;
    return &op_rows[opcode];
}

const tally_op_info_t *tally_op_table(size_t *count)
{
    *count = TALLY_OP_COUNT;
    return op_rows;
}

const tally_op_info_t *tally_op_find(const char *name)
{
    for (unsigned op = 0; name != NULL && op < TALLY_OP_COUNT; op++) {
        if (op_rows[op].name != NULL && strcmp(op_rows[op].name, name) == 0)
            return &op_rows[op];
    }
    return NULL;
}

/* The name column of op's row; the cast to unsigned makes a negative value (possible for an
 * enum argument) out of range. */
const char *tally_op_name(tally_op_t op)
{
    const tally_op_info_t *row = tally_op_info((unsigned)op);
    return row != NULL ? row->name : NULL;
}

bool tally_op_takes_dtype(unsigned opcode, unsigned dtype)
{
    const tally_op_info_t *row = tally_op_info(opcode);
    return row != NULL && dtype < 32 && (row->dtypes & BIT(dtype)) != 0;
}

static const char *wire_name(unsigned dtype)
{
    return tally_dtype_name((tally_dtype_t)dtype);
}

const char *tally_op_dtypes_text(unsigned opcode, char *buf, size_t cap)
{
    return tally_op_dtypes_named(opcode, wire_name, buf, cap);
}

const char *tally_op_dtypes_named(unsigned opcode, const char *(*name)(unsigned dtype), char *buf,
                                  size_t cap)
{
    const tally_op_info_t *row = tally_op_info(opcode);
    uint32_t left = row ? row->dtypes : 0;
    size_t at = 0;
    if (cap == 0)
        return buf;
    buf[0] = '\0';
    for (unsigned d = 0; d < TALLY_DTYPE_COUNT && left; d++) {
        if (!(left & BIT(d)))
            continue;
        left &= ~BIT(d);
        const char *sep = at == 0 ? "" : left ? ", " : " or ";
        int n = snprintf(buf + at, cap - at, "%s%s", sep, name(d));
        if (n < 0 || (size_t)n >= cap - at)
            break;
        at += (size_t)n;
    }
    return buf;
}

bool tally_op_has_output(unsigned opcode)
{
    const tally_op_info_t *row = tally_op_info(opcode);
    return row != NULL && (row->reply == TALLY_REPLY_KEPT || row->reply == TALLY_REPLY_PREFIX);
}

size_t tally_op_reply_elem(const tally_req_t *req)
{
    const tally_op_info_t *row = tally_op_info(req->opcode);
    switch (row ? row->reply : TALLY_REPLY_EMPTY) {
    case TALLY_REPLY_KEPT:
    case TALLY_REPLY_PAIR:
        return tally_dtype_size((tally_dtype_t)req->dtype);
    case TALLY_REPLY_PREFIX:
        return (req->flags & TALLY_FLAG_SCAN_OUT_I32) ? 4 : 8;
    case TALLY_REPLY_COUNTS:
        return 8;
    default:
        return 0;
    }
}

uint64_t tally_op_reply_bytes(const tally_req_t *req, uint64_t in_bytes)
{
    const tally_op_info_t *row = tally_op_info(req->opcode);
    size_t esize = tally_dtype_size((tally_dtype_t)req->dtype);
    if (row == NULL || !row->batch || esize == 0)
        return 0;
    switch (row->reply) {
    case TALLY_REPLY_KEPT:
        return in_bytes;
    case TALLY_REPLY_PREFIX:
        return in_bytes / esize * tally_op_reply_elem(req);
    case TALLY_REPLY_COUNTS:
        return 8 * (uint64_t)tally_hist_values(req->dtype);
    case TALLY_REPLY_PAIR:
        return 2 * (uint64_t)esize;
    default:
        return 0;
    }
}

tally_status_t tally_batch_check(uint64_t bytes, size_t max_batch, char *msg, size_t msg_cap)
{
    if (bytes <= max_batch)
        return TALLY_OK;
    if (msg != NULL && msg_cap > 0)
        snprintf(msg, msg_cap, "batch of %" PRIu64 " bytes exceeds the maximum of %zu", bytes,
                 max_batch);
    return TALLY_E_TOO_LARGE;
}

/* One element of dtype at p, sign-extended for i32. */
static int64_t elem_get(uint8_t dtype, const uint8_t *p)
{
    if (dtype == TALLY_DTYPE_I32)
        return (int32_t)tally_get_u32(p);
    return dtype == TALLY_DTYPE_U16 ? tally_get_u16(p) : *p;
}

size_t tally_minmax_encode(uint8_t dtype, int64_t min, int64_t max, uint8_t out[16])
{
    size_t esize = tally_dtype_size((tally_dtype_t)dtype);
    for (size_t b = 0; b < esize && esize <= 8; b++) { /* the low bytes: the value in its type */
        out[b] = (uint8_t)((uint64_t)min >> (8 * b));
        out[esize + b] = (uint8_t)((uint64_t)max >> (8 * b));
    }
    return 2 * esize;
}

void tally_minmax_decode(uint8_t dtype, const uint8_t *p, int64_t *min, int64_t *max)
{
    *min = elem_get(dtype, p);
    *max = elem_get(dtype, p + tally_dtype_size((tally_dtype_t)dtype));
}
