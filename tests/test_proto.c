/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_proto.c — protocol v1: round trips, every rejection path, the worked example of
 * PROTOCOL.md, and a seeded robustness run over 200k random and mutated buffers.
 *
 * Design: every field-level rejection is checked twice, through the wire (encode, patch,
 * tally_req_decode) and through tally_req_validate on the struct, because the daemon uses the
 * first and the client library the second; both must agree on the status. Random inputs come
 * from a fixed-seed xorshift generator, so a failure reproduces exactly; the seed can be changed
 * with TALLY_TEST_SEED to explore further.
 */
#include <ctype.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tally_proto.h"

#define MAX_BATCH 16777216u

/* ---- Helpers ---------------------------------------------------------------------------- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t rng_next(void)
{
    /* xorshift64*: small, fast and good enough to pick bytes and lengths. */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

static uint64_t rng_below(uint64_t n)
{
    return rng_next() % n;
}

static void rng_seed(uint64_t seed)
{
    const char *env = getenv("TALLY_TEST_SEED");
    if (env != NULL)
        seed = strtoull(env, NULL, 0);
    rng_state = seed != 0 ? seed : 1;
}

static tally_req_t make_req(tally_op_t op)
{
    tally_req_t req;
    memset(&req, 0, sizeof req);
    req.opcode = (uint8_t)op;
    req.request_id = 42;
    switch (op) {
    case TALLY_OP_FILTER:
        req.dtype = TALLY_DTYPE_I32;
        req.pred = TALLY_PRED_GT;
        break;
    case TALLY_OP_SCAN:
    case TALLY_OP_MINMAX:
        req.dtype = TALLY_DTYPE_I32;
        break;
    case TALLY_OP_HIST:
        req.dtype = TALLY_DTYPE_U8;
        break;
    case TALLY_OP_QUERY:
    case TALLY_OP_RESET:
    case TALLY_OP_DELETE:
        assert_int_equal(tally_req_set_stream(&req, "cam0"), TALLY_OK);
        break;
    default:
        break;
    }
    return req;
}

/* Decodes a header buffer; checks that a rejection comes with a message. */
static tally_status_t decode_buf(const uint8_t *buf, size_t len, tally_req_t *out)
{
    char msg[256];
    memset(msg, 'x', sizeof msg);
    tally_status_t st = tally_req_decode(buf, len, out, msg, sizeof msg);
    if (st == TALLY_OK)
        assert_string_equal(msg, "");
    else
        assert_true(strlen(msg) > 0 && strlen(msg) < sizeof msg);
    return st;
}

/* Both paths, the wire and the struct, must reject req with `want`. */
static void expect_reject(const tally_req_t *req, tally_status_t want)
{
    uint8_t buf[TALLY_REQ_HEADER_SIZE];
    tally_req_t out;
    char msg[256];
    tally_req_encode(req, buf);
    assert_int_equal(decode_buf(buf, sizeof buf, &out), want);
    assert_int_equal(out.request_id, req->request_id);
    assert_int_equal(out.opcode, req->opcode);
    assert_int_equal(tally_req_validate(req, 0, MAX_BATCH, msg, sizeof msg), want);
    assert_true(strlen(msg) > 0);
}

static void expect_accept(const tally_req_t *req)
{
    uint8_t buf[TALLY_REQ_HEADER_SIZE];
    tally_req_t out;
    char msg[256];
    tally_req_encode(req, buf);
    assert_int_equal(decode_buf(buf, sizeof buf, &out), TALLY_OK);
    assert_int_equal(tally_req_validate(req, 0, MAX_BATCH, msg, sizeof msg), TALLY_OK);
}

/* Encodes a valid request, changes one byte, and returns the decode status. */
static tally_status_t decode_patched(tally_op_t op, size_t offset, uint8_t value, char *msg,
                                     size_t msg_cap)
{
    tally_req_t req = make_req(op), out;
    uint8_t buf[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(&req, buf);
    buf[offset] = value;
    return tally_req_decode(buf, sizeof buf, &out, msg, msg_cap);
}

static tally_status_t validate_payload(tally_op_t op, tally_dtype_t dtype, size_t len, char *msg)
{
    tally_req_t req = make_req(op);
    req.dtype = (uint8_t)dtype;
    return tally_req_validate(&req, len, MAX_BATCH, msg, 256);
}

/* ---- Names ------------------------------------------------------------------------------ */

static void test_status_names(void **state)
{
    (void)state;
    static const struct {
        tally_status_t status;
        const char *name;
    } names[] = {
        {TALLY_OK, "ok"},
        {TALLY_E_HEADER, "bad_header"},
        {TALLY_E_MAGIC, "bad_magic"},
        {TALLY_E_VERSION, "bad_version"},
        {TALLY_E_OPCODE, "bad_opcode"},
        {TALLY_E_DTYPE, "bad_dtype"},
        {TALLY_E_PAYLOAD, "bad_payload"},
        {TALLY_E_TOO_LARGE, "too_large"},
        {TALLY_E_STREAM_NAME, "bad_stream_name"},
        {TALLY_E_UNKNOWN_STREAM, "unknown_stream"},
        {TALLY_E_FRAMES, "bad_frames"},
        {TALLY_E_PARAM, "bad_param"},
        {TALLY_E_STREAM_STATE, "stream_state"},
        {TALLY_E_LIMIT, "limit"},
        {TALLY_E_BACKEND, "backend"},
        {TALLY_E_SHUTDOWN, "shutdown"},
        {TALLY_E_INTERNAL, "internal"},
        {TALLY_E_DUPLICATE, "duplicate"},
        {TALLY_E_SEQ_GAP, "sequence_gap"},
        {TALLY_E_BAD_REF, "bad_ref"},
        {TALLY_E_QUOTA, "quota"},
        {TALLY_E_BUSY, "busy"},
        {TALLY_E_CLIENT_STREAMS, "client_streams"},
        {TALLY_E_RATE, "rate_limited"},
        {TALLY_E_TIMEOUT, "timeout"},
        {TALLY_E_TRANSPORT, "transport"},
        {TALLY_E_REPLY, "bad_reply"},
        {TALLY_E_NOMEM, "nomem"},
        {TALLY_E_ARG, "bad_argument"},
        {TALLY_E_IO, "io"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        assert_string_equal(tally_status_name(names[i].status), names[i].name);
        const char *text = tally_status_text(names[i].status);
        assert_true(strlen(text) > 0 && strcmp(text, "unknown status") != 0);
    }
    assert_int_equal(TALLY_E_DUPLICATE, 17);
    assert_int_equal(TALLY_E_SEQ_GAP, 18);
    assert_int_equal(TALLY_E_BAD_REF, 19);
    assert_int_equal(TALLY_E_QUOTA, 20);
    assert_int_equal(TALLY_E_BUSY, 21);
    assert_int_equal(TALLY_E_CLIENT_STREAMS, 22);
    assert_int_equal(TALLY_E_RATE, 23);
    assert_int_equal(TALLY_E_WINDOW, 24);
    assert_string_equal(tally_status_name(TALLY_E_WINDOW), "bad_window");
    assert_int_equal(TALLY_E_NOT_PERMITTED, 25);
    assert_string_equal(tally_status_name(TALLY_E_NOT_PERMITTED), "not_permitted");
    assert_int_equal(TALLY_E_NOT_OWNER, 26);
    assert_string_equal(tally_status_name(TALLY_E_NOT_OWNER), "not_owner");
    assert_int_equal(TALLY_E_NOT_DURABLE, 27);
    assert_string_equal(tally_status_name(TALLY_E_NOT_DURABLE), "not_durable");
    assert_int_equal(TALLY_STATUS_WIRE_COUNT, 28);
    assert_string_equal(tally_status_name((tally_status_t)50), "unknown");
    assert_string_equal(tally_status_text((tally_status_t)50), "unknown status");
}

static void test_op_dtype_pred_names(void **state)
{
    (void)state;
    static const char *ops[] = {NULL,    "ping",    "info",  "filter", "scan", "hist", "query",
                                "reset", "streams", "stats", "delete", NULL,   NULL,   "minmax"};
    for (int op = 1; op < TALLY_OP_COUNT; op++) {
        if (ops[op] == NULL)
            assert_null(tally_op_name((tally_op_t)op)); /* 11, 12: reserved (issue 12) */
        else
            assert_string_equal(tally_op_name((tally_op_t)op), ops[op]);
    }
    assert_null(tally_op_name((tally_op_t)0));
    assert_null(tally_op_name((tally_op_t)TALLY_OP_COUNT));
    assert_null(tally_op_name((tally_op_t)-1));
    assert_null(tally_dtype_name((tally_dtype_t)-1));

    static const char *dtypes[] = {"none", "i32", "u8",   "i64",  "u64",
                                   "text", "u16", "rgb8", "rgba8"};
    static const size_t sizes[] = {0, 4, 1, 8, 8, 0, 2, 3, 4};
    static const size_t aligns[] = {0, 4, 1, 8, 8, 0, 2, 1, 1};
    static const unsigned channels[] = {0, 1, 1, 0, 0, 0, 1, 3, 4};
    static const size_t values[] = {0, 258, 256, 0, 0, 0, 258, 768, 1024};
    for (int d = 0; d < TALLY_DTYPE_COUNT; d++) {
        assert_int_equal(tally_dtype_align((tally_dtype_t)d), aligns[d]);
        assert_int_equal(tally_hist_channels((unsigned)d), channels[d]);
        assert_int_equal(tally_hist_values((unsigned)d), values[d]);
        assert_int_equal(tally_hist_ranged((unsigned)d),
                         d == TALLY_DTYPE_I32 || d == TALLY_DTYPE_U16);
    }
    for (int d = 0; d < TALLY_DTYPE_COUNT; d++) {
        assert_string_equal(tally_dtype_name((tally_dtype_t)d), dtypes[d]);
        assert_int_equal(tally_dtype_size((tally_dtype_t)d), sizes[d]);
    }
    assert_null(tally_dtype_name((tally_dtype_t)TALLY_DTYPE_COUNT));
    assert_int_equal(tally_dtype_size((tally_dtype_t)TALLY_DTYPE_COUNT), 0);

    static const char *preds[] = {NULL, "gt", "ge", "lt", "le", "eq", "ne", "between"};
    for (int p = 1; p <= TALLY_PRED_BETWEEN; p++)
        assert_string_equal(tally_pred_name((tally_pred_t)p), preds[p]);
    assert_null(tally_pred_name((tally_pred_t)0));
    assert_null(tally_pred_name((tally_pred_t)8));
}

/* ---- Round trips ------------------------------------------------------------------------ */

static void random_name(char *name, size_t *len)
{
    *len = 1 + rng_below(TALLY_STREAM_NAME_MAX);
    for (size_t i = 0; i < *len; i++)
        name[i] = (char)(0x21 + rng_below(0x7E - 0x21 + 1));
    name[*len] = '\0';
}

static tally_req_t random_valid_req(void)
{
    tally_op_t op;
    do /* a known opcode: 11 and 12 are reserved */
        op = (tally_op_t)(1 + rng_below(TALLY_OP_COUNT - 1));
    while (tally_op_name(op) == NULL);
    tally_req_t req = make_req(op);
    req.request_id = rng_next();
    char name[TALLY_STREAM_NAME_MAX + 1];
    size_t len;
    random_name(name, &len);
    switch (op) {
    case TALLY_OP_FILTER:
        req.dtype = rng_below(2) ? TALLY_DTYPE_I32 : TALLY_DTYPE_U8;
        req.pred = (uint8_t)(1 + rng_below(TALLY_PRED_BETWEEN));
        req.flags = (uint8_t)(rng_below(2) ? TALLY_FLAG_FILTER_STABLE : 0);
        req.lo = (int64_t)rng_next();
        /* hi is only the upper bound of between; the other predicates must send 0. */
        req.hi = req.pred == TALLY_PRED_BETWEEN ? (int64_t)rng_next() : 0;
        if (req.pred == TALLY_PRED_BETWEEN && req.lo > req.hi) {
            int64_t t = req.lo;
            req.lo = req.hi;
            req.hi = t;
        }
        break;
    case TALLY_OP_SCAN:
        req.flags = (uint8_t)rng_below(4);
        break;
    case TALLY_OP_HIST:
        switch (rng_below(5)) {
        case 0:
            req.dtype = TALLY_DTYPE_I32;
            req.lo = (int64_t)INT32_MIN + (int64_t)rng_below(1ull << 32);
            req.hi = req.lo + 1 + (int64_t)rng_below((uint64_t)((int64_t)INT32_MAX + 1 - req.lo));
            break;
        case 1:
            req.dtype = TALLY_DTYPE_U16;
            req.lo = (int64_t)rng_below(65536);
            req.hi = req.lo + 1 + (int64_t)rng_below((uint64_t)(65536 - req.lo));
            break;
        case 2:
            req.dtype = rng_below(2) ? TALLY_DTYPE_RGB8 : TALLY_DTYPE_RGBA8;
            break;
        default:
            break;
        }
        break;
    case TALLY_OP_QUERY:
        if (rng_below(2)) {
            req.flags = TALLY_FLAG_QUERY_WINDOW;
            req.lo = 1 + (int64_t)rng_below(TALLY_WINDOW_MS_MAX);
        }
        assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
        break;
    case TALLY_OP_RESET:
    case TALLY_OP_DELETE:
        assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
        break;
    case TALLY_OP_MINMAX: {
        static const uint8_t types[] = {TALLY_DTYPE_I32, TALLY_DTYPE_U8, TALLY_DTYPE_U16};
        req.dtype = types[rng_below(3)];
        break;
    }
    default:
        break;
    }
    bool data_op = op == TALLY_OP_FILTER || op == TALLY_OP_SCAN || op == TALLY_OP_HIST;
    if (data_op && rng_below(2)) {
        assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
        req.seq = rng_below(2) ? rng_next() : 0; /* only a batch on a stream may carry one */
    }
    return req;
}

static void test_req_round_trip(void **state)
{
    (void)state;
    rng_seed(1);
    for (int i = 0; i < 20000; i++) {
        tally_req_t req = random_valid_req(), out;
        uint8_t buf[TALLY_REQ_HEADER_SIZE], again[TALLY_REQ_HEADER_SIZE];
        tally_req_encode(&req, buf);
        assert_int_equal(decode_buf(buf, sizeof buf, &out), TALLY_OK);
        assert_int_equal(out.version, TALLY_PROTO_VERSION);
        assert_int_equal(out.opcode, req.opcode);
        assert_int_equal(out.dtype, req.dtype);
        assert_int_equal(out.flags, req.flags);
        assert_true(out.request_id == req.request_id);
        assert_int_equal(out.pred, req.pred);
        assert_true(out.lo == req.lo);
        assert_true(out.hi == req.hi);
        assert_true(out.seq == req.seq);
        assert_int_equal(out.stream_len, req.stream_len);
        assert_string_equal(out.stream, req.stream);
        assert_int_equal(tally_req_validate(&out, 0, MAX_BATCH, NULL, 0), TALLY_OK);
        tally_req_encode(&out, again);
        assert_memory_equal(buf, again, sizeof buf);
    }
}

static void test_rep_round_trip(void **state)
{
    (void)state;
    rng_seed(2);
    for (int i = 0; i < 20000; i++) {
        tally_rep_t rep, out;
        memset(&rep, 0, sizeof rep); /* zero the padding too: the structs are compared whole */
        rep.version = TALLY_PROTO_VERSION;
        rep.opcode = (uint8_t)rng_next();
        rep.dtype = (uint8_t)rng_next();
        rep.flags = (uint8_t)rng_next();
        rep.request_id = rng_next();
        rep.status = (uint32_t)rng_below(100);
        rep.count = rng_next();
        rep.aux0 = rng_next();
        rep.aux1 = rng_next();
        uint8_t buf[TALLY_REP_HEADER_SIZE];
        tally_rep_encode(&rep, buf);
        assert_int_equal(tally_rep_decode(buf, sizeof buf, &out), TALLY_OK);
        assert_memory_equal(&rep, &out, sizeof rep);
    }
}

static void test_stream_info_round_trip(void **state)
{
    (void)state;
    rng_seed(3);
    static const uint8_t hist_dtypes[] = {TALLY_DTYPE_NONE, TALLY_DTYPE_U8, TALLY_DTYPE_I32};
    for (int i = 0; i < 2000; i++) {
        tally_stream_info_t info, out;
        memset(&info, 0, sizeof info);
        info.batches = rng_next();
        info.elements = rng_next();
        info.bytes = rng_next();
        info.filter_seen = rng_next();
        info.filter_kept = rng_next();
        info.scan_carry = (int64_t)rng_next();
        info.scan_elements = rng_next();
        info.hist_dtype = hist_dtypes[rng_below(3)];
        info.hist_lo = (int64_t)rng_next();
        info.hist_hi = (int64_t)rng_next();
        info.hist_underflow = rng_next();
        info.hist_overflow = rng_next();
        info.hist_total = rng_next();
        info.last_seq = rng_next();
        for (int b = 0; b < TALLY_HIST_BINS; b++)
            info.bins[b] = rng_next();
        uint8_t buf[TALLY_QUERY_PAYLOAD_SIZE];
        tally_stream_info_encode(&info, buf);
        assert_int_equal(tally_stream_info_decode(buf, sizeof buf, &out), TALLY_OK);
        assert_memory_equal(&info, &out, sizeof info);
    }
}

/* Offsets of the query payload, straight from PROTOCOL.md. */
static void test_stream_info_layout(void **state)
{
    (void)state;
    tally_stream_info_t info;
    memset(&info, 0, sizeof info);
    info.batches = 1;
    info.elements = 2;
    info.bytes = 3;
    info.filter_seen = 4;
    info.filter_kept = 5;
    info.scan_carry = -6;
    info.scan_elements = 7;
    info.hist_dtype = TALLY_DTYPE_I32;
    info.hist_lo = -9;
    info.hist_hi = 10;
    info.hist_underflow = 11;
    info.hist_overflow = 12;
    info.hist_total = 13;
    info.last_seq = 16;
    info.bins[0] = 14;
    info.bins[255] = 15;
    uint8_t buf[TALLY_QUERY_PAYLOAD_SIZE];
    tally_stream_info_encode(&info, buf);
    assert_int_equal(TALLY_QUERY_PAYLOAD_SIZE, 2176);
    static const struct {
        size_t off;
        uint64_t value;
    } fields[] = {{0, 1},
                  {8, 2},
                  {16, 3},
                  {24, 4},
                  {32, 5},
                  {40, (uint64_t)-6},
                  {48, 7},
                  {64, (uint64_t)-9},
                  {72, 10},
                  {80, 11},
                  {88, 12},
                  {96, 13},
                  {104, 16},
                  {128, 14},
                  {128 + 8 * 255, 15}};
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        assert_true(tally_get_u64(buf + fields[i].off) == fields[i].value);
    assert_int_equal(buf[56], TALLY_DTYPE_I32);
    for (size_t i = 57; i < 64; i++)
        assert_int_equal(buf[i], 0);
    for (size_t i = 112; i < 128; i++)
        assert_int_equal(buf[i], 0);
}

/* ---- The worked example of PROTOCOL.md -------------------------------------------------- */

static const uint8_t example_request[TALLY_REQ_HEADER_SIZE] = {
    /* 0x00 */ 0x54, 0x4c, 0x59, 0x44, 0x01, 0x03, 0x01, 0x00,
    /* 0x08 */ 0x07, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    /* 0x10 */ 0x01, 0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    /* 0x18..0x3f: lo = 0, hi = 0, reserved */
    [0x40] = 0x63, [0x41] = 0x61, [0x42] = 0x6d, [0x43] = 0x30,
    /* 0x44..0x7f: name padding */
};

static const uint8_t example_reply[TALLY_REP_HEADER_SIZE] = {
    /* 0x00 */ 0x54, 0x4c, 0x59, 0x44, 0x01, 0x03, 0x01, 0x00,
    /* 0x08 */ 0x07, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    /* 0x10 */ 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    /* 0x18 */ 0x06, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    /* 0x20 */ 0x0a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    /* 0x28..0x3f: aux1 = 0, reserved */
};

static void test_example_request(void **state)
{
    (void)state;
    tally_req_t req;
    memset(&req, 0, sizeof req);
    req.opcode = TALLY_OP_FILTER;
    req.dtype = TALLY_DTYPE_I32;
    req.pred = TALLY_PRED_GT;
    req.lo = 0;
    req.request_id = 7;
    assert_int_equal(tally_req_set_stream(&req, "cam0"), TALLY_OK);
    uint8_t buf[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(&req, buf);
    assert_memory_equal(buf, example_request, sizeof buf);

    tally_req_t out;
    assert_int_equal(decode_buf(example_request, sizeof example_request, &out), TALLY_OK);
    assert_int_equal(out.opcode, TALLY_OP_FILTER);
    assert_int_equal(out.dtype, TALLY_DTYPE_I32);
    assert_int_equal(out.pred, TALLY_PRED_GT);
    assert_int_equal(out.request_id, 7);
    assert_int_equal(out.stream_len, 4);
    assert_string_equal(out.stream, "cam0");
    /* The example's payload: ten int32 values, 40 bytes. */
    assert_int_equal(tally_req_validate(&out, 40, MAX_BATCH, NULL, 0), TALLY_OK);
    assert_int_equal(tally_get_u32(example_request), TALLY_MAGIC);
}

static void test_example_reply(void **state)
{
    (void)state;
    tally_rep_t rep = {
        .opcode = TALLY_OP_FILTER,
        .dtype = TALLY_DTYPE_I32,
        .request_id = 7,
        .status = TALLY_OK,
        .count = 6,
        .aux0 = 10,
    };
    uint8_t buf[TALLY_REP_HEADER_SIZE];
    tally_rep_encode(&rep, buf);
    assert_memory_equal(buf, example_reply, sizeof buf);

    tally_rep_t out;
    assert_int_equal(tally_rep_decode(example_reply, sizeof example_reply, &out), TALLY_OK);
    assert_int_equal(out.version, 1);
    assert_int_equal(out.opcode, TALLY_OP_FILTER);
    assert_int_equal(out.dtype, TALLY_DTYPE_I32);
    assert_int_equal(out.request_id, 7);
    assert_int_equal(out.status, TALLY_OK);
    assert_int_equal(out.count, 6);
    assert_int_equal(out.aux0, 10);
    assert_int_equal(out.aux1, 0);
}

/* Reads the hex dump of the code block that follows `title` in PROTOCOL.md: per line, an optional
 * "0x.." offset and then 16 two-digit hex bytes and a comment, or just hex bytes. Returns the byte
 * count. */
static size_t read_doc_hex(const char *doc, const char *title, uint8_t *out, size_t cap)
{
    const char *at = strstr(doc, title);
    assert_non_null(at);
    at = strstr(at, "```");
    assert_non_null(at);
    at = strchr(at, '\n');
    assert_non_null(at);
    at++;
    size_t n = 0;
    while (strncmp(at, "```", 3) != 0) {
        const char *end = strchr(at, '\n');
        assert_non_null(end);
        const char *p = at;
        size_t limit = SIZE_MAX; /* dump lines with an offset hold 16 bytes and a comment */
        if (p[0] == '0' && p[1] == 'x') {
            p += strcspn(p, " \n");
            limit = 16;
        }
        for (size_t taken = 0; taken < limit;) {
            while (*p == ' ')
                p++;
            bool hex = p + 2 <= end && isxdigit((unsigned char)p[0]) &&
                       isxdigit((unsigned char)p[1]) && (p + 2 == end || p[2] == ' ');
            if (!hex)
                break;
            assert_true(n < cap);
            out[n++] = (uint8_t)strtoul((char[]){p[0], p[1], '\0'}, NULL, 16);
            p += 2;
            taken++;
        }
        at = end + 1;
    }
    return n;
}

static char *read_protocol_md(void)
{
#ifdef TALLY_PROTOCOL_MD
    FILE *f = fopen(TALLY_PROTOCOL_MD, "rb");
    assert_non_null(f);
    static char doc[256 * 1024]; /* PROTOCOL.md passed 128 KiB with §13 "Direct mode" */
    size_t len = fread(doc, 1, sizeof doc - 1, f);
    fclose(f);
    assert_true(len > 0 && len < sizeof doc - 1);
    doc[len] = '\0';
    return doc;
#else
    return NULL;
#endif
}

/* The dumps in PROTOCOL.md are the bytes tally_req_encode/tally_rep_encode produce. */
static void test_example_matches_protocol_md(void **state)
{
    (void)state;
    const char *doc = read_protocol_md();
    if (doc == NULL) {
        print_message("TALLY_PROTOCOL_MD not defined: cannot read the spec\n");
        skip();
    }
    uint8_t bytes[256];
    assert_int_equal(read_doc_hex(doc, "**Request header**", bytes, sizeof bytes),
                     TALLY_REQ_HEADER_SIZE);
    assert_memory_equal(bytes, example_request, TALLY_REQ_HEADER_SIZE);
    assert_int_equal(read_doc_hex(doc, "**Reply header**", bytes, sizeof bytes),
                     TALLY_REP_HEADER_SIZE);
    assert_memory_equal(bytes, example_reply, TALLY_REP_HEADER_SIZE);

    /* The payloads: the input, and the elements > 0 in input order (the stable result). */
    static const int32_t input[] = {3, -1, 0, 7, 2, -5, 9, 0, 1, 4};
    size_t n = read_doc_hex(doc, "**Request payload**", bytes, sizeof bytes);
    assert_int_equal(n, sizeof input);
    for (size_t i = 0; i < n / 4; i++)
        assert_int_equal((int32_t)tally_get_u32(bytes + 4 * i), input[i]);
    n = read_doc_hex(doc, "**Reply payload**", bytes, sizeof bytes);
    assert_int_equal(n, 4 * tally_get_u64(example_reply + 24));
    size_t kept = 0;
    for (size_t i = 0; i < sizeof input / sizeof input[0]; i++) {
        if (input[i] > 0)
            assert_int_equal((int32_t)tally_get_u32(bytes + 4 * kept++), input[i]);
    }
    assert_int_equal(kept * 4, n);
    assert_int_equal(tally_get_u64(example_reply + 32), sizeof input / sizeof input[0]);
}

/* ---- Header framing --------------------------------------------------------------------- */

static void test_reject_header_short(void **state)
{
    (void)state;
    uint8_t buf[TALLY_REQ_HEADER_SIZE];
    memcpy(buf, example_request, sizeof buf);
    tally_req_t out;
    char msg[256];
    assert_int_equal(tally_req_decode(buf, 127, &out, msg, sizeof msg), TALLY_E_HEADER);
    assert_string_equal(msg, "request header of 127 bytes, expected 128");
    /* Enough was there to echo the request id and opcode. */
    assert_int_equal(out.request_id, 7);
    assert_int_equal(out.opcode, TALLY_OP_FILTER);

    assert_int_equal(tally_req_decode(buf, 16, &out, msg, sizeof msg), TALLY_E_HEADER);
    assert_int_equal(out.request_id, 7);
    assert_int_equal(tally_req_decode(buf, 15, &out, msg, sizeof msg), TALLY_E_HEADER);
    assert_int_equal(out.request_id, 0);
    assert_int_equal(out.opcode, 0);
    assert_int_equal(tally_req_decode(buf, 0, &out, msg, sizeof msg), TALLY_E_HEADER);
    assert_int_equal(tally_req_decode(NULL, 0, &out, NULL, 0), TALLY_E_HEADER);
}

static void test_reject_header_long(void **state)
{
    (void)state;
    uint8_t buf[TALLY_REQ_HEADER_SIZE + 1] = {0};
    memcpy(buf, example_request, TALLY_REQ_HEADER_SIZE);
    tally_req_t out;
    char msg[256];
    assert_int_equal(tally_req_decode(buf, sizeof buf, &out, msg, sizeof msg), TALLY_E_HEADER);
    assert_string_equal(msg, "request header of 129 bytes, expected 128");
    assert_int_equal(out.request_id, 7);
}

static void test_reject_magic(void **state)
{
    (void)state;
    char msg[256];
    assert_int_equal(decode_patched(TALLY_OP_PING, 3, 'X', msg, sizeof msg), TALLY_E_MAGIC);
    assert_string_equal(msg, "header starts with bytes 54 4c 59 58, not the magic \"TLYD\"");
    assert_int_equal(decode_patched(TALLY_OP_PING, 0, 't', msg, sizeof msg), TALLY_E_MAGIC);
}

static void test_reject_version(void **state)
{
    (void)state;
    char msg[256];
    assert_int_equal(decode_patched(TALLY_OP_PING, 4, 2, msg, sizeof msg), TALLY_E_VERSION);
    assert_string_equal(msg, "protocol version 2 is not supported; this side speaks version 1");
    assert_int_equal(decode_patched(TALLY_OP_PING, 4, 0, msg, sizeof msg), TALLY_E_VERSION);
}

static void test_reject_opcode(void **state)
{
    (void)state;
    char msg[256];
    assert_int_equal(decode_patched(TALLY_OP_PING, 5, 0, msg, sizeof msg), TALLY_E_OPCODE);
    assert_int_equal(decode_patched(TALLY_OP_PING, 5, 11, msg, sizeof msg), TALLY_E_OPCODE);
    assert_string_equal(msg, "unknown opcode 11 (known: 1..10, 13)");
    assert_int_equal(decode_patched(TALLY_OP_PING, 5, TALLY_OP_COUNT, msg, sizeof msg),
                     TALLY_E_OPCODE);
    assert_string_equal(msg, "unknown opcode 14 (known: 1..10, 13)");
    assert_int_equal(decode_patched(TALLY_OP_PING, 5, 255, msg, sizeof msg), TALLY_E_OPCODE);
    tally_req_t req = make_req(TALLY_OP_PING);
    req.opcode = 0;
    expect_reject(&req, TALLY_E_OPCODE);
}

static void test_reject_dtype_unknown(void **state)
{
    (void)state;
    char msg[256];
    assert_int_equal(decode_patched(TALLY_OP_FILTER, 6, TALLY_DTYPE_COUNT, msg, sizeof msg),
                     TALLY_E_DTYPE);
    assert_string_equal(msg, "unknown dtype 9 (known: 0..8)");
    tally_req_t req = make_req(TALLY_OP_SCAN);
    req.dtype = 200;
    expect_reject(&req, TALLY_E_DTYPE);
}

static void test_reject_dtype_wrong_for_op(void **state)
{
    (void)state;
    static const struct {
        tally_op_t op;
        tally_dtype_t dtype;
    } bad[] = {
        {TALLY_OP_PING, TALLY_DTYPE_I32},    {TALLY_OP_INFO, TALLY_DTYPE_TEXT},
        {TALLY_OP_STREAMS, TALLY_DTYPE_U8},  {TALLY_OP_STATS, TALLY_DTYPE_U64},
        {TALLY_OP_QUERY, TALLY_DTYPE_U8},    {TALLY_OP_RESET, TALLY_DTYPE_I32},
        {TALLY_OP_FILTER, TALLY_DTYPE_NONE}, {TALLY_OP_FILTER, TALLY_DTYPE_I64},
        {TALLY_OP_FILTER, TALLY_DTYPE_TEXT}, {TALLY_OP_SCAN, TALLY_DTYPE_U8},
        {TALLY_OP_SCAN, TALLY_DTYPE_I64},    {TALLY_OP_SCAN, TALLY_DTYPE_NONE},
        {TALLY_OP_HIST, TALLY_DTYPE_NONE},   {TALLY_OP_HIST, TALLY_DTYPE_U64},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        tally_req_t req = make_req(bad[i].op);
        req.dtype = (uint8_t)bad[i].dtype;
        expect_reject(&req, TALLY_E_DTYPE);
    }
    char msg[256];
    tally_req_t req = make_req(TALLY_OP_SCAN);
    req.dtype = TALLY_DTYPE_U8;
    assert_int_equal(tally_req_validate(&req, 0, MAX_BATCH, msg, sizeof msg), TALLY_E_DTYPE);
    assert_string_equal(msg, "scan takes dtype i32 (got u8)");
}

/* ---- Reserved bytes and stream names ---------------------------------------------------- */

static void test_reject_reserved_bytes(void **state)
{
    (void)state;
    char msg[256];
    for (size_t off = 18; off < 24; off++)
        assert_int_equal(decode_patched(TALLY_OP_FILTER, off, 0x01, msg, sizeof msg),
                         TALLY_E_PARAM);
    for (size_t off = 48; off < 64; off++)
        assert_int_equal(decode_patched(TALLY_OP_FILTER, off, 0x80, msg, sizeof msg),
                         TALLY_E_PARAM);
    assert_string_equal(msg, "reserved header byte 63 is 0x80, not zero");
}

/* Bytes 40..47 are seq now, no longer reserved: a batch on a stream may carry any seq. */
static void test_seq_bytes(void **state)
{
    (void)state;
    tally_req_t req = make_req(TALLY_OP_SCAN), out;
    assert_int_equal(tally_req_set_stream(&req, "big"), TALLY_OK);
    uint8_t buf[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(&req, buf);
    for (size_t off = 40; off < 48; off++)
        assert_int_equal(buf[off], 0); /* seq 0: exactly a protocol-1 header */
    req.seq = 0x0102030405060708ull;
    tally_req_encode(&req, buf);
    static const uint8_t le[8] = {8, 7, 6, 5, 4, 3, 2, 1};
    assert_memory_equal(buf + 40, le, 8);
    assert_int_equal(decode_buf(buf, sizeof buf, &out), TALLY_OK);
    assert_true(out.seq == req.seq);
    for (size_t off = 40; off < 48; off++) {
        memset(buf + 40, 0, 8);
        buf[off] = 0x80;
        assert_int_equal(decode_buf(buf, sizeof buf, &out), TALLY_OK);
        assert_true(out.seq == (uint64_t)0x80 << (8 * (off - 40)));
    }
}

/* seq orders a stream's batches: on anything else it is bad_param. */
static void test_reject_misplaced_seq(void **state)
{
    (void)state;
    static const tally_op_t others[] = {TALLY_OP_PING,  TALLY_OP_INFO,    TALLY_OP_QUERY,
                                        TALLY_OP_RESET, TALLY_OP_STREAMS, TALLY_OP_STATS};
    for (size_t i = 0; i < sizeof others / sizeof others[0]; i++) {
        tally_req_t req = make_req(others[i]);
        req.seq = 1;
        expect_reject(&req, TALLY_E_PARAM);
    }
    static const tally_op_t batches[] = {TALLY_OP_FILTER, TALLY_OP_SCAN, TALLY_OP_HIST};
    for (size_t i = 0; i < 3; i++) {
        tally_req_t req = make_req(batches[i]);
        req.seq = 7;
        expect_reject(&req, TALLY_E_PARAM); /* no stream */
        assert_int_equal(tally_req_set_stream(&req, "s"), TALLY_OK);
        expect_accept(&req);
    }
    char msg[256];
    tally_req_t req = make_req(TALLY_OP_SCAN);
    req.seq = 3;
    assert_int_equal(tally_req_validate(&req, 0, MAX_BATCH, msg, sizeof msg), TALLY_E_PARAM);
    assert_string_equal(msg, "a sequence number (seq=3) needs a stream: scan without one has "
                             "nothing to order");
    req = make_req(TALLY_OP_QUERY);
    req.seq = 3;
    assert_int_equal(tally_req_validate(&req, 0, MAX_BATCH, msg, sizeof msg), TALLY_E_PARAM);
    assert_string_equal(msg, "query takes no sequence number (got seq=3)");
}

static void test_reject_stream_name_too_long(void **state)
{
    (void)state;
    char msg[256];
    assert_int_equal(decode_patched(TALLY_OP_QUERY, 17, 65, msg, sizeof msg), TALLY_E_STREAM_NAME);
    assert_string_equal(msg, "stream name of 65 bytes exceeds the maximum of 64");
    assert_int_equal(decode_patched(TALLY_OP_QUERY, 17, 255, msg, sizeof msg), TALLY_E_STREAM_NAME);

    tally_req_t req = make_req(TALLY_OP_FILTER);
    char name[TALLY_STREAM_NAME_MAX + 2];
    memset(name, 'a', sizeof name - 1);
    name[sizeof name - 1] = '\0';
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_E_STREAM_NAME);
    assert_int_equal(req.stream_len, 0); /* unchanged on failure */
    name[TALLY_STREAM_NAME_MAX] = '\0';
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    assert_int_equal(req.stream_len, TALLY_STREAM_NAME_MAX);
    expect_accept(&req);
    req.stream_len = TALLY_STREAM_NAME_MAX + 1; /* the struct path: validate catches it too */
    assert_int_equal(tally_req_validate(&req, 0, MAX_BATCH, msg, sizeof msg), TALLY_E_STREAM_NAME);
}

static void test_reject_stream_name_bytes(void **state)
{
    (void)state;
    static const uint8_t bad[] = {0x00, 0x09, 0x20, 0x7f, 0x80, 0xff};
    char msg[256];
    for (size_t i = 0; i < sizeof bad; i++) {
        /* "cam0" with its third byte replaced. */
        assert_int_equal(decode_patched(TALLY_OP_QUERY, 64 + 2, bad[i], msg, sizeof msg),
                         TALLY_E_STREAM_NAME);
    }
    assert_string_equal(msg, "stream name byte 2 is 0xff; names are printable ASCII (0x21..0x7e) "
                             "without spaces");
    assert_false(tally_stream_name_valid("a b", 3));
    assert_false(tally_stream_name_valid("", 0));
    assert_false(tally_stream_name_valid(NULL, 0));
    assert_true(tally_stream_name_valid("line3/pressure", 14));
    assert_true(tally_stream_name_valid("!~", 2));

    tally_req_t req = make_req(TALLY_OP_HIST);
    assert_int_equal(tally_req_set_stream(&req, "a b"), TALLY_E_STREAM_NAME);
    assert_int_equal(tally_req_set_stream(&req, ""), TALLY_E_STREAM_NAME);
    assert_int_equal(tally_req_set_stream(&req, "x"), TALLY_OK);
    assert_int_equal(tally_req_set_stream(&req, NULL), TALLY_OK);
    assert_int_equal(req.stream_len, 0);
    assert_string_equal(req.stream, "");
    assert_int_equal(tally_req_set_stream(NULL, "x"), TALLY_E_ARG);
}

static void test_reject_stream_name_padding(void **state)
{
    (void)state;
    char msg[256];
    /* "cam0" is 4 bytes: a byte right after it, or at the very end, is not padding. */
    assert_int_equal(decode_patched(TALLY_OP_QUERY, 64 + 4, 'x', msg, sizeof msg),
                     TALLY_E_STREAM_NAME);
    assert_string_equal(msg, "header byte 68 after the 4-byte stream name is 0x78, not zero");
    assert_int_equal(decode_patched(TALLY_OP_QUERY, 127, 1, msg, sizeof msg), TALLY_E_STREAM_NAME);
    assert_string_equal(msg, "header byte 127 after the 4-byte stream name is 0x01, not zero");
    /* In the middle of an eight-byte word that the check reads whole (tally_proto.c): the byte
     * itself is named. */
    assert_int_equal(decode_patched(TALLY_OP_QUERY, 101, 2, msg, sizeof msg), TALLY_E_STREAM_NAME);
    assert_string_equal(msg, "header byte 101 after the 4-byte stream name is 0x02, not zero");
    /* No stream at all: the whole name area is padding. */
    assert_int_equal(decode_patched(TALLY_OP_FILTER, 64, 'a', msg, sizeof msg),
                     TALLY_E_STREAM_NAME);
}

/* ---- Per-operation rules ---------------------------------------------------------------- */

static void test_reject_control_fields(void **state)
{
    (void)state;
    static const tally_op_t ops[] = {TALLY_OP_PING,  TALLY_OP_INFO,  TALLY_OP_STREAMS,
                                     TALLY_OP_STATS, TALLY_OP_QUERY, TALLY_OP_RESET};
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        tally_req_t req = make_req(ops[i]);
        expect_accept(&req);
        req.flags = 1;
        expect_reject(&req, TALLY_E_PARAM);
        req = make_req(ops[i]);
        req.pred = TALLY_PRED_GT;
        expect_reject(&req, TALLY_E_PARAM);
        req = make_req(ops[i]);
        req.lo = -1;
        expect_reject(&req, TALLY_E_PARAM);
        req = make_req(ops[i]);
        req.hi = 1;
        expect_reject(&req, TALLY_E_PARAM);
    }
}

static void test_reject_control_stream(void **state)
{
    (void)state;
    static const tally_op_t ops[] = {TALLY_OP_PING, TALLY_OP_INFO, TALLY_OP_STREAMS,
                                     TALLY_OP_STATS};
    char msg[256];
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        tally_req_t req = make_req(ops[i]);
        assert_int_equal(tally_req_set_stream(&req, "cam0"), TALLY_OK);
        expect_reject(&req, TALLY_E_STREAM_NAME);
    }
    tally_req_t req = make_req(TALLY_OP_PING);
    assert_int_equal(tally_req_set_stream(&req, "cam0"), TALLY_OK);
    assert_int_equal(tally_req_validate(&req, 0, MAX_BATCH, msg, sizeof msg), TALLY_E_STREAM_NAME);
    assert_string_equal(msg, "ping takes no stream name (got \"cam0\")");
}

static void test_reject_query_reset_without_stream(void **state)
{
    (void)state;
    char msg[256];
    tally_req_t req = make_req(TALLY_OP_QUERY);
    assert_int_equal(tally_req_set_stream(&req, NULL), TALLY_OK);
    expect_reject(&req, TALLY_E_STREAM_NAME);
    assert_int_equal(tally_req_validate(&req, 0, MAX_BATCH, msg, sizeof msg), TALLY_E_STREAM_NAME);
    assert_string_equal(msg, "query needs a stream name");

    req = make_req(TALLY_OP_RESET);
    assert_int_equal(tally_req_set_stream(&req, NULL), TALLY_OK);
    expect_reject(&req, TALLY_E_STREAM_NAME);
    assert_int_equal(tally_req_validate(&req, 0, MAX_BATCH, msg, sizeof msg), TALLY_E_STREAM_NAME);
    assert_string_equal(msg, "reset needs a stream name");
}

static void test_reject_control_payload(void **state)
{
    (void)state;
    char msg[256];
    for (int op = TALLY_OP_PING; op < TALLY_OP_COUNT; op++) {
        if (op == TALLY_OP_FILTER || op == TALLY_OP_SCAN || op == TALLY_OP_HIST ||
            op == TALLY_OP_MINMAX || tally_op_name((tally_op_t)op) == NULL)
            continue;
        assert_int_equal(validate_payload((tally_op_t)op, TALLY_DTYPE_NONE, 0, msg), TALLY_OK);
        assert_int_equal(validate_payload((tally_op_t)op, TALLY_DTYPE_NONE, 1, msg),
                         TALLY_E_PAYLOAD);
    }
    assert_string_equal(msg, "delete takes an empty payload (got 1 bytes)");
}

static void test_reject_filter_pred(void **state)
{
    (void)state;
    char msg[256];
    tally_req_t req = make_req(TALLY_OP_FILTER);
    for (int p = TALLY_PRED_GT; p <= TALLY_PRED_BETWEEN; p++) {
        req.pred = (uint8_t)p;
        expect_accept(&req);
    }
    req.pred = 0;
    expect_reject(&req, TALLY_E_PARAM);
    req.pred = TALLY_PRED_BETWEEN + 1;
    expect_reject(&req, TALLY_E_PARAM);
    assert_int_equal(tally_req_validate(&req, 0, MAX_BATCH, msg, sizeof msg), TALLY_E_PARAM);
    assert_string_equal(msg, "unknown filter predicate 8 (known: 1..7)");
}

static void test_reject_filter_between_range(void **state)
{
    (void)state;
    char msg[256];
    tally_req_t req = make_req(TALLY_OP_FILTER);
    req.dtype = TALLY_DTYPE_U8;
    req.pred = TALLY_PRED_BETWEEN;
    req.lo = 5;
    req.hi = 5;
    expect_accept(&req); /* a one-value range is fine */
    req.hi = 4;
    expect_reject(&req, TALLY_E_PARAM);
    assert_int_equal(tally_req_validate(&req, 0, MAX_BATCH, msg, sizeof msg), TALLY_E_PARAM);
    assert_string_equal(msg, "filter between needs lo <= hi (got lo=5, hi=4)");
    /* Thresholds are exact integers of any size: a u8 filter on 300 is legal. */
    req.pred = TALLY_PRED_LT;
    req.lo = 300;
    req.hi = 0;
    expect_accept(&req);
    req.lo = INT64_MIN;
    expect_accept(&req);
}

/* PROTOCOL.md §4: hi is unused by predicates 1..6 and must be 0, like every unused field. */
static void test_reject_filter_hi_single_threshold(void **state)
{
    (void)state;
    static const int64_t bad_hi[] = {1, -1, INT64_MIN, INT64_MAX};
    char msg[256];
    for (int p = TALLY_PRED_GT; p < TALLY_PRED_BETWEEN; p++) {
        for (int dt = 0; dt < 2; dt++) {
            tally_req_t req = make_req(TALLY_OP_FILTER);
            req.dtype = dt ? TALLY_DTYPE_U8 : TALLY_DTYPE_I32;
            req.pred = (uint8_t)p;
            req.lo = 5;
            expect_accept(&req);
            for (size_t i = 0; i < sizeof bad_hi / sizeof bad_hi[0]; i++) {
                req.hi = bad_hi[i];
                expect_reject(&req, TALLY_E_PARAM);
            }
        }
    }
    tally_req_t req = make_req(TALLY_OP_FILTER);
    req.pred = TALLY_PRED_EQ;
    req.hi = 7;
    assert_int_equal(tally_req_validate(&req, 0, MAX_BATCH, msg, sizeof msg), TALLY_E_PARAM);
    assert_string_equal(msg, "filter eq takes no hi; send it as 0 (got hi=7)");
    /* between keeps using hi, lo == hi included. */
    req.pred = TALLY_PRED_BETWEEN;
    req.lo = 7;
    expect_accept(&req);
}

static void test_reject_filter_flags(void **state)
{
    (void)state;
    tally_req_t req = make_req(TALLY_OP_FILTER);
    req.flags = TALLY_FLAG_FILTER_STABLE;
    expect_accept(&req);
    req.flags = TALLY_FLAG_SCAN_EXCLUSIVE;
    expect_reject(&req, TALLY_E_PARAM);
    req.flags = 0x40;
    expect_reject(&req, TALLY_E_PARAM);
}

/* Shared-memory references (PROTOCOL.md §10): the 48-byte layout and its rules. */
static void test_shm_ref(void **state)
{
    (void)state;
    char msg[256];
    tally_req_t req = make_req(TALLY_OP_SCAN);
    req.flags = TALLY_FLAG_SHM_REF;
    /* The payload frame is the reference: exactly 48 bytes, whatever max_batch is. */
    assert_int_equal(tally_req_validate(&req, TALLY_SHM_REF_SIZE, 16, msg, sizeof msg), TALLY_OK);
    assert_int_equal(tally_req_validate(&req, 40, MAX_BATCH, msg, sizeof msg), TALLY_E_PAYLOAD);
    tally_req_t ping = make_req(TALLY_OP_PING);
    ping.flags = TALLY_FLAG_SHM_REF;
    assert_int_equal(tally_req_validate(&ping, 0, MAX_BATCH, msg, sizeof msg), TALLY_E_PARAM);

    tally_shm_ref_t ref = {1, 2, 3, 4, 5, 6}, back;
    uint8_t bytes[TALLY_SHM_REF_SIZE];
    tally_shm_ref_encode(&ref, bytes);
    assert_int_equal(tally_get_u64(bytes + 16), 3); /* in_length at 16..23 */
    assert_int_equal(tally_get_u64(bytes + 40), 6); /* out_length at 40..47 */
    assert_int_equal(tally_shm_ref_decode(bytes, sizeof bytes, &back, msg, sizeof msg), TALLY_OK);
    assert_memory_equal(&ref, &back, sizeof ref);
    assert_int_equal(tally_shm_ref_decode(bytes, 47, &back, msg, sizeof msg), TALLY_E_PAYLOAD);

    req.flags = TALLY_FLAG_SHM_REF; /* int64 scan: the output needs 2 x in_length */
    tally_shm_ref_t r = {.in_handle = 9, .in_offset = 8, .in_length = 400};
    assert_int_equal(tally_shm_ref_validate(&req, &r, MAX_BATCH, msg, sizeof msg), TALLY_OK);
    r.in_length = 402;
    assert_int_equal(tally_shm_ref_validate(&req, &r, MAX_BATCH, msg, sizeof msg), TALLY_E_PAYLOAD);
    r.in_length = MAX_BATCH + 4;
    assert_int_equal(tally_shm_ref_validate(&req, &r, MAX_BATCH, msg, sizeof msg),
                     TALLY_E_TOO_LARGE);
    r.in_length = 400;
    r.in_offset = 6;
    assert_int_equal(tally_shm_ref_validate(&req, &r, MAX_BATCH, msg, sizeof msg), TALLY_E_BAD_REF);
    r.in_offset = 8;
    r.out_handle = 9;
    r.out_offset = 804;
    r.out_length = 800;
    assert_int_equal(tally_shm_ref_validate(&req, &r, MAX_BATCH, msg, sizeof msg), TALLY_E_BAD_REF);
    assert_non_null(strstr(msg, "multiple"));
    r.out_offset = 808;
    r.out_length = 799;
    assert_int_equal(tally_shm_ref_validate(&req, &r, MAX_BATCH, msg, sizeof msg), TALLY_E_BAD_REF);
    assert_string_equal(msg,
                        "output range of 799 bytes is smaller than the 800 bytes scan may write");
    r.out_length = 800;
    assert_int_equal(tally_shm_ref_validate(&req, &r, MAX_BATCH, msg, sizeof msg), TALLY_OK);
    req.flags |= TALLY_FLAG_SCAN_OUT_I32;
    r.out_offset = 804;
    r.out_length = 400;
    assert_int_equal(tally_shm_ref_validate(&req, &r, MAX_BATCH, msg, sizeof msg), TALLY_OK);
    tally_req_t hist = make_req(TALLY_OP_HIST);
    hist.dtype = TALLY_DTYPE_U8;
    assert_int_equal(tally_shm_ref_validate(&hist, &r, MAX_BATCH, msg, sizeof msg),
                     TALLY_E_BAD_REF);
    r.out_handle = 0;
    assert_int_equal(tally_shm_ref_validate(&hist, &r, MAX_BATCH, msg, sizeof msg),
                     TALLY_E_BAD_REF); /* out_offset without an output region */
    r.out_offset = r.out_length = 0;
    assert_int_equal(tally_shm_ref_validate(&hist, &r, MAX_BATCH, msg, sizeof msg), TALLY_OK);
}

/* Op 3 (PROTOCOL.md §10 "Device memory"): the 96-byte block after the routing id, at its offsets,
 * and every rule that makes it malformed. */
static void test_shm_device_message(void **state)
{
    (void)state;
    char msg[256];
    tally_shm_msg_t m = {.op = TALLY_SHM_OP_REGISTER_DEVICE,
                         .id_len = 2,
                         .id = {'p', 'q'},
                         .dev_size = 2u << 20,
                         .dev_flags = TALLY_SHM_DEV_EVENT | TALLY_SHM_DEV_OUTPUT},
                    back;
    for (int i = 0; i < TALLY_GPU_UUID_SIZE; i++)
        m.gpu_uuid[i] = (uint8_t)(0xA0 + i);
    for (int i = 0; i < TALLY_GPU_EVENT_SIZE; i++)
        m.event[i] = (uint8_t)(i + 1);
    uint8_t buf[TALLY_SHM_MSG_MAX];
    size_t len = tally_shm_msg_encode(&m, buf);
    assert_int_equal(len, 16 + 2 + 96);
    assert_int_equal(tally_get_u64(buf + 18), 2u << 20); /* size right after the routing id */
    assert_int_equal(buf[18 + 8], 0xA0);                 /* the UUID at 8 */
    assert_int_equal(tally_get_u32(buf + 18 + 24), 3);   /* flags at 24 */
    assert_int_equal(buf[18 + 32], 1);                   /* the event at 32 */
    assert_int_equal(tally_shm_msg_decode(buf, len, &back, msg, sizeof msg), TALLY_OK);
    assert_int_equal(back.dev_size, 2u << 20);
    assert_memory_equal(back.gpu_uuid, m.gpu_uuid, TALLY_GPU_UUID_SIZE);
    assert_memory_equal(back.event, m.event, TALLY_GPU_EVENT_SIZE);
    assert_int_equal(back.dev_flags, 3);
    /* the block is exactly 96 bytes */
    assert_int_equal(tally_shm_msg_decode(buf, len - 1, &back, msg, sizeof msg), TALLY_E_HEADER);
    assert_int_equal(tally_shm_msg_decode(buf, len - 96, &back, msg, sizeof msg), TALLY_E_HEADER);
    buf[18 + 28] = 1; /* reserved */
    assert_int_equal(tally_shm_msg_decode(buf, len, &back, msg, sizeof msg), TALLY_E_PARAM);
    buf[18 + 28] = 0;
    tally_put_u32(buf + 18 + 24, 4); /* unknown flag */
    assert_int_equal(tally_shm_msg_decode(buf, len, &back, msg, sizeof msg), TALLY_E_PARAM);
    tally_put_u32(buf + 18 + 24, TALLY_SHM_DEV_OUTPUT); /* an event without DEV_EVENT */
    assert_int_equal(tally_shm_msg_decode(buf, len, &back, msg, sizeof msg), TALLY_E_PARAM);
    memset(buf + 18 + 32, 0, TALLY_GPU_EVENT_SIZE);
    assert_int_equal(tally_shm_msg_decode(buf, len, &back, msg, sizeof msg), TALLY_OK);
    tally_put_u64(buf + 18, 0); /* size 0 */
    assert_int_equal(tally_shm_msg_decode(buf, len, &back, msg, sizeof msg), TALLY_E_PARAM);
    assert_int_equal(back.op, TALLY_SHM_OP_REGISTER_DEVICE);
    m.id_len = 0; /* op 3 needs a routing id, as op 1 does */
    len = tally_shm_msg_encode(&m, buf);
    assert_int_equal(tally_shm_msg_decode(buf, len, &back, msg, sizeof msg), TALLY_E_PARAM);
}

static void test_shm_side_messages(void **state)
{
    (void)state;
    char msg[256];
    tally_shm_msg_t m = {.op = TALLY_SHM_OP_REGISTER, .id_len = 3, .id = {'a', 'b', 'c'}}, back;
    uint8_t buf[TALLY_SHM_MSG_MAX];
    size_t len = tally_shm_msg_encode(&m, buf);
    assert_int_equal(len, 19);
    assert_int_equal(tally_shm_msg_decode(buf, len, &back, msg, sizeof msg), TALLY_OK);
    assert_int_equal(back.id_len, 3);
    assert_memory_equal(back.id, "abc", 3);
    assert_int_equal(tally_shm_msg_decode(buf, len - 1, &back, msg, sizeof msg), TALLY_E_HEADER);
    buf[7] = 1;
    assert_int_equal(tally_shm_msg_decode(buf, len, &back, msg, sizeof msg), TALLY_E_PARAM);
    buf[7] = 0;
    buf[5] = 9;
    assert_int_equal(tally_shm_msg_decode(buf, len, &back, msg, sizeof msg), TALLY_E_OPCODE);
    buf[0] = 'X';
    assert_int_equal(tally_shm_msg_decode(buf, len, &back, msg, sizeof msg), TALLY_E_MAGIC);
    tally_shm_msg_t rel = {.op = TALLY_SHM_OP_RELEASE, .handle = 77};
    len = tally_shm_msg_encode(&rel, buf);
    assert_int_equal(tally_shm_msg_decode(buf, len, &back, msg, sizeof msg), TALLY_OK);
    assert_int_equal(back.handle, 77);
    tally_shm_msg_t reg0 = {.op = TALLY_SHM_OP_REGISTER};
    len = tally_shm_msg_encode(&reg0, buf);
    assert_int_equal(tally_shm_msg_decode(buf, len, &back, msg, sizeof msg), TALLY_E_PARAM);

    tally_shm_answer_t a = {.op = 1, .status = TALLY_E_QUOTA, .handle = 5, .size = 4096}, b;
    uint8_t ans[TALLY_SHM_ANSWER_SIZE];
    tally_shm_answer_encode(&a, ans);
    assert_int_equal(tally_shm_answer_decode(ans, sizeof ans, &b), TALLY_OK);
    assert_int_equal(b.op, 1);
    assert_int_equal(b.status, TALLY_E_QUOTA);
    assert_int_equal(b.handle, 5);
    assert_int_equal(b.size, 4096);
    assert_int_equal(tally_shm_answer_decode(ans, 31, &b), TALLY_E_REPLY);
    ans[12] = 1;
    assert_int_equal(tally_shm_answer_decode(ans, sizeof ans, &b), TALLY_E_REPLY);
}

static void test_reject_scan_flags(void **state)
{
    (void)state;
    char msg[256];
    tally_req_t req = make_req(TALLY_OP_SCAN);
    req.flags = TALLY_FLAG_SCAN_EXCLUSIVE | TALLY_FLAG_SCAN_OUT_I32;
    expect_accept(&req);
    req.flags = TALLY_FLAG_FILTER_STABLE;
    expect_reject(&req, TALLY_E_PARAM);
    assert_int_equal(tally_req_validate(&req, 0, MAX_BATCH, msg, sizeof msg), TALLY_E_PARAM);
    assert_string_equal(msg, "flags 0x04 are not defined for scan");
}

static void test_reject_scan_params(void **state)
{
    (void)state;
    tally_req_t req = make_req(TALLY_OP_SCAN);
    req.pred = TALLY_PRED_GT;
    expect_reject(&req, TALLY_E_PARAM);
    req = make_req(TALLY_OP_SCAN);
    req.lo = 1;
    expect_reject(&req, TALLY_E_PARAM);
    req = make_req(TALLY_OP_SCAN);
    req.hi = -1;
    expect_reject(&req, TALLY_E_PARAM);
}

static void test_reject_hist_u8_params(void **state)
{
    (void)state;
    tally_req_t req = make_req(TALLY_OP_HIST);
    expect_accept(&req);
    req.lo = 1;
    expect_reject(&req, TALLY_E_PARAM);
    req = make_req(TALLY_OP_HIST);
    req.pred = 1;
    expect_reject(&req, TALLY_E_PARAM);
    req = make_req(TALLY_OP_HIST);
    req.flags = TALLY_FLAG_FILTER_STABLE;
    expect_reject(&req, TALLY_E_PARAM);
}

static void test_reject_hist_i32_range(void **state)
{
    (void)state;
    char msg[256];
    tally_req_t req = make_req(TALLY_OP_HIST);
    req.dtype = TALLY_DTYPE_I32;
    req.lo = INT32_MIN;
    req.hi = (int64_t)INT32_MAX + 1;
    expect_accept(&req); /* the widest range: every int32 lands in a bin */
    req.lo = 0;
    req.hi = 1;
    expect_accept(&req);
    req.hi = 0;
    expect_reject(&req, TALLY_E_PARAM); /* empty range */
    assert_int_equal(tally_req_validate(&req, 0, MAX_BATCH, msg, sizeof msg), TALLY_E_PARAM);
    assert_string_equal(msg, "hist i32 range [lo, hi) needs lo < hi (got lo=0, hi=0)");
    req.lo = 10;
    req.hi = -10;
    expect_reject(&req, TALLY_E_PARAM);
    req.lo = (int64_t)INT32_MIN - 1;
    req.hi = 0;
    expect_reject(&req, TALLY_E_PARAM);
    req.lo = 0;
    req.hi = (int64_t)INT32_MAX + 2;
    expect_reject(&req, TALLY_E_PARAM);
    assert_int_equal(tally_req_validate(&req, 0, MAX_BATCH, msg, sizeof msg), TALLY_E_PARAM);
    assert_string_equal(msg,
                        "hist i32 range [0, 2147483649) is not within [-2147483648, 2147483648]");
}

static void test_reject_hist_i32_params(void **state)
{
    (void)state;
    tally_req_t req = make_req(TALLY_OP_HIST);
    req.dtype = TALLY_DTYPE_I32;
    req.lo = 0;
    req.hi = 256;
    req.pred = TALLY_PRED_GT;
    expect_reject(&req, TALLY_E_PARAM);
    req.pred = 0;
    req.flags = TALLY_FLAG_SCAN_EXCLUSIVE;
    expect_reject(&req, TALLY_E_PARAM);
}

/* u16: a range within [0, 65536] like i32's within [-2^31, 2^31]; rgb8/rgba8: no parameters;
 * a batch of them is a whole number of pixels (3 or 4 bytes). */
static void test_hist_u16_rgb(void **state)
{
    (void)state;
    char msg[256];
    tally_req_t req = make_req(TALLY_OP_HIST);
    req.dtype = TALLY_DTYPE_U16;
    req.lo = 0;
    req.hi = 65536;
    expect_accept(&req);
    req.hi = 4096; /* a 12-bit sensor */
    expect_accept(&req);
    req.hi = 65537;
    expect_reject(&req, TALLY_E_PARAM);
    assert_int_equal(tally_req_validate(&req, 0, MAX_BATCH, msg, sizeof msg), TALLY_E_PARAM);
    assert_string_equal(msg, "hist u16 range [0, 65537) is not within [0, 65536]");
    req.lo = -1;
    req.hi = 10;
    expect_reject(&req, TALLY_E_PARAM);
    req.lo = 10;
    expect_reject(&req, TALLY_E_PARAM); /* empty */
    req.lo = 0;
    assert_int_equal(tally_req_validate(&req, 6, MAX_BATCH, msg, sizeof msg), TALLY_OK);
    assert_int_equal(tally_req_validate(&req, 7, MAX_BATCH, msg, sizeof msg), TALLY_E_PAYLOAD);
    assert_string_equal(msg, "payload of 7 bytes is not a whole number of uint16 elements");

    for (int d = TALLY_DTYPE_RGB8; d <= TALLY_DTYPE_RGBA8; d++) {
        req = make_req(TALLY_OP_HIST);
        req.dtype = (uint8_t)d;
        expect_accept(&req);
        size_t px = tally_dtype_size((tally_dtype_t)d);
        assert_int_equal(tally_req_validate(&req, 5 * px, MAX_BATCH, msg, sizeof msg), TALLY_OK);
        assert_int_equal(tally_req_validate(&req, 5 * px + 1, MAX_BATCH, msg, sizeof msg),
                         TALLY_E_PAYLOAD);
        req.hi = 1;
        expect_reject(&req, TALLY_E_PARAM);
    }
    /* The new dtypes are for hist only. */
    req = make_req(TALLY_OP_FILTER);
    req.dtype = TALLY_DTYPE_U16;
    expect_reject(&req, TALLY_E_DTYPE);
    req = make_req(TALLY_OP_SCAN);
    req.dtype = TALLY_DTYPE_RGB8;
    expect_reject(&req, TALLY_E_DTYPE);
    /* An rgb8 shared-memory input may start at any byte; u16 at an even one. */
    tally_shm_ref_t ref = {.in_handle = 1, .in_offset = 7, .in_length = 30};
    req = make_req(TALLY_OP_HIST);
    req.dtype = TALLY_DTYPE_RGB8;
    req.flags = TALLY_FLAG_SHM_REF;
    assert_int_equal(tally_shm_ref_validate(&req, &ref, MAX_BATCH, msg, sizeof msg), TALLY_OK);
    req.dtype = TALLY_DTYPE_U16;
    req.hi = 65536;
    assert_int_equal(tally_shm_ref_validate(&req, &ref, MAX_BATCH, msg, sizeof msg),
                     TALLY_E_BAD_REF);
}

/* QUERY_WINDOW: the window in lo, 1..TALLY_WINDOW_MS_MAX; the flag only on query. */
static void test_query_window(void **state)
{
    (void)state;
    char msg[256];
    tally_req_t req = make_req(TALLY_OP_QUERY);
    req.lo = 10000;
    expect_reject(&req, TALLY_E_PARAM); /* lo without the flag */
    req.flags = TALLY_FLAG_QUERY_WINDOW;
    expect_accept(&req);
    req.lo = TALLY_WINDOW_MS_MAX;
    expect_accept(&req);
    req.lo = TALLY_WINDOW_MS_MAX + 1;
    expect_reject(&req, TALLY_E_PARAM);
    req.lo = 0;
    expect_reject(&req, TALLY_E_PARAM);
    assert_int_equal(tally_req_validate(&req, 0, MAX_BATCH, msg, sizeof msg), TALLY_E_PARAM);
    assert_string_equal(msg, "a window query needs a window of 1..4294967295 ms in lo (got 0)");
    req.lo = 5;
    req.hi = 1;
    expect_reject(&req, TALLY_E_PARAM);
    req.hi = 0;
    req.flags |= TALLY_FLAG_SCAN_EXCLUSIVE;
    expect_reject(&req, TALLY_E_PARAM);
    req.flags = TALLY_FLAG_QUERY_WINDOW;
    req.dtype = TALLY_DTYPE_U8;
    expect_reject(&req, TALLY_E_DTYPE);
    req.dtype = TALLY_DTYPE_NONE;
    assert_int_equal(tally_req_set_stream(&req, NULL), TALLY_OK);
    expect_reject(&req, TALLY_E_STREAM_NAME);
    static const tally_op_t others[] = {TALLY_OP_RESET, TALLY_OP_DELETE, TALLY_OP_PING,
                                        TALLY_OP_HIST};
    for (size_t i = 0; i < sizeof others / sizeof others[0]; i++) {
        req = make_req(others[i]);
        req.flags = TALLY_FLAG_QUERY_WINDOW;
        expect_reject(&req, TALLY_E_PARAM);
    }
    req = make_req(TALLY_OP_DELETE);
    expect_accept(&req);
    assert_int_equal(tally_req_set_stream(&req, NULL), TALLY_OK);
    expect_reject(&req, TALLY_E_STREAM_NAME);
}

/* Multi-channel records: 128 + 2048 x channels bytes, channel c's bins after channel c-1's;
 * the length must match hist_dtype exactly. */
static void test_stream_info_channels(void **state)
{
    (void)state;
    static uint8_t buf[TALLY_QUERY_PAYLOAD_MAX + 1];
    static tally_stream_info_t info, out;
    static const struct {
        uint8_t dtype;
        size_t size;
    } cases[] = {{TALLY_DTYPE_NONE, 2176}, {TALLY_DTYPE_U8, 2176},   {TALLY_DTYPE_I32, 2176},
                 {TALLY_DTYPE_U16, 2176},  {TALLY_DTYPE_RGB8, 6272}, {TALLY_DTYPE_RGBA8, 8320}};
    rng_seed(31);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        memset(&info, 0, sizeof info);
        info.hist_dtype = cases[i].dtype;
        info.hist_total = 77;
        size_t values = (cases[i].size - 128) / 8;
        for (size_t v = 0; v < values; v++)
            info.bins[v] = rng_next();
        assert_int_equal(tally_stream_info_size(&info), cases[i].size);
        assert_int_equal(tally_stream_info_encode(&info, buf), cases[i].size);
        assert_int_equal(buf[56], cases[i].dtype);
        /* Channel c's bin b at 128 + 2048 c + 8 b. */
        assert_true(tally_get_u64(buf + 128 + 8 * (values - 1)) == info.bins[values - 1]);
        assert_int_equal(tally_stream_info_decode(buf, cases[i].size, &out), TALLY_OK);
        assert_memory_equal(&info, &out, sizeof info);
        assert_int_equal(tally_stream_info_decode(buf, cases[i].size + 1, &out), TALLY_E_REPLY);
        assert_int_equal(tally_stream_info_decode(buf, cases[i].size - 8, &out), TALLY_E_REPLY);
        if (cases[i].size != TALLY_QUERY_PAYLOAD_SIZE)
            assert_int_equal(tally_stream_info_decode(buf, TALLY_QUERY_PAYLOAD_SIZE, &out),
                             TALLY_E_REPLY);
    }
    buf[56] = 9; /* not a histogram dtype */
    assert_int_equal(tally_stream_info_decode(buf, TALLY_QUERY_PAYLOAD_SIZE, &out), TALLY_E_REPLY);
}

/* The PUB header: offsets from PROTOCOL.md §11, strict decoding. */
static void test_pub_header(void **state)
{
    (void)state;
    tally_pub_t pub = {.kind = TALLY_PUB_UPDATE,
                       .pub_seq = 0x0102030405060708ull,
                       .time_ms = 1795000000123ull,
                       .interval_ms = 1000},
                out;
    uint8_t buf[TALLY_PUB_HEADER_SIZE];
    tally_pub_encode(&pub, buf);
    assert_memory_equal(buf, "TLYD\x01\x01\x00\x00", 8);
    assert_true(tally_get_u64(buf + 8) == pub.pub_seq);
    assert_true(tally_get_u64(buf + 16) == pub.time_ms);
    assert_true(tally_get_u64(buf + 24) == 1000);
    for (size_t i = 32; i < TALLY_PUB_HEADER_SIZE; i++)
        assert_int_equal(buf[i], 0);
    assert_int_equal(tally_pub_decode(buf, sizeof buf, &out), TALLY_OK);
    assert_int_equal(out.kind, pub.kind);
    assert_true(out.pub_seq == pub.pub_seq && out.time_ms == pub.time_ms);
    assert_true(out.interval_ms == pub.interval_ms);
    assert_int_equal(tally_pub_decode(buf, sizeof buf - 1, &out), TALLY_E_REPLY);
    static const size_t bad[] = {0, 4, 5, 6, 7, 32, 63};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint8_t copy[TALLY_PUB_HEADER_SIZE];
        memcpy(copy, buf, sizeof copy);
        copy[bad[i]] ^= 0x40;
        assert_int_equal(tally_pub_decode(copy, sizeof copy, &out), TALLY_E_REPLY);
    }
    buf[5] = TALLY_PUB_DELETED;
    assert_int_equal(tally_pub_decode(buf, sizeof buf, &out), TALLY_OK);
    assert_int_equal(out.kind, TALLY_PUB_DELETED);
}

/* ---- Validation order (PROTOCOL.md §6) -------------------------------------------------- */

/* Headers with two or more problems, each a valid request of `op` with bytes patched: the status
 * is the one of the earliest step in §6, and the reply would still echo the opcode and id. */
enum { PATCH_END = -1 };
typedef struct {
    const char *what;
    tally_op_t op;
    size_t len;
    int patch[5][2]; /* offset, value; offset PATCH_END ends the list */
    tally_status_t want;
} order_case_t;

static const order_case_t header_order_cases[] = {
    {"127 bytes, bad magic", TALLY_OP_PING, 127, {{0, 'X'}, {PATCH_END, 0}}, TALLY_E_HEADER},
    {"129 bytes, bad version", TALLY_OP_PING, 129, {{4, 9}, {PATCH_END, 0}}, TALLY_E_HEADER},
    {"bad magic, version, opcode",
     TALLY_OP_PING,
     128,
     {{0, 'X'}, {4, 2}, {5, 0}, {PATCH_END, 0}},
     TALLY_E_MAGIC},
    {"bad version, opcode", TALLY_OP_PING, 128, {{4, 2}, {5, 0}, {PATCH_END, 0}}, TALLY_E_VERSION},
    {"opcode 0, dtype 200", TALLY_OP_PING, 128, {{5, 0}, {6, 200}, {PATCH_END, 0}}, TALLY_E_OPCODE},
    {"opcode 0, reserved", TALLY_OP_PING, 128, {{5, 0}, {20, 1}, {PATCH_END, 0}}, TALLY_E_OPCODE},
    {"dtype 200, reserved", TALLY_OP_SCAN, 128, {{6, 200}, {20, 1}, {PATCH_END, 0}}, TALLY_E_DTYPE},
    {"dtype 200, stream_len 65",
     TALLY_OP_SCAN,
     128,
     {{6, 200}, {17, 65}, {PATCH_END, 0}},
     TALLY_E_DTYPE},
    {"scan u8 (known dtype), reserved",
     TALLY_OP_SCAN,
     128,
     {{6, TALLY_DTYPE_U8}, {60, 1}, {PATCH_END, 0}},
     TALLY_E_PARAM},
    {"reserved, stream_len 65",
     TALLY_OP_FILTER,
     128,
     {{20, 1}, {17, 65}, {PATCH_END, 0}},
     TALLY_E_PARAM},
    {"stream_len 65, scan u8",
     TALLY_OP_SCAN,
     128,
     {{17, 65}, {6, TALLY_DTYPE_U8}, {PATCH_END, 0}},
     TALLY_E_STREAM_NAME},
    {"name \"a b\", scan u8",
     TALLY_OP_SCAN,
     128,
     {{17, 3}, {64, 'a'}, {65, ' '}, {66, 'b'}, {6, TALLY_DTYPE_U8}},
     TALLY_E_STREAM_NAME},
    {"name with a NUL byte, filter pred 0",
     TALLY_OP_FILTER,
     128,
     {{17, 3}, {64, 'a'}, {66, 'b'}, {16, 0}, {PATCH_END, 0}},
     TALLY_E_STREAM_NAME},
    {"scan u8, flags 0x40",
     TALLY_OP_SCAN,
     128,
     {{6, TALLY_DTYPE_U8}, {7, 0x40}, {PATCH_END, 0}},
     TALLY_E_DTYPE},
    {"filter dtype none, pred 0",
     TALLY_OP_FILTER,
     128,
     {{6, TALLY_DTYPE_NONE}, {16, 0}, {PATCH_END, 0}},
     TALLY_E_DTYPE},
    {"ping flags 0x01 and a stream",
     TALLY_OP_PING,
     128,
     {{7, 1}, {17, 1}, {64, 'a'}, {PATCH_END, 0}},
     TALLY_E_PARAM},
    {"query without a stream, pred 1",
     TALLY_OP_QUERY,
     128,
     {{17, 0}, {64, 0}, {65, 0}, {66, 0}, {67, 0}},
     TALLY_E_STREAM_NAME /* patched again below: pred 1 */},
    {"filter gt, hi 1, flags 0x40",
     TALLY_OP_FILTER,
     128,
     {{32, 1}, {7, 0x40}, {PATCH_END, 0}},
     TALLY_E_PARAM},
};

/* Case i of header_order_cases: its request (id ...00 + i) patched, decoded, the status and
 * the echoed prefix checked. */
static void check_header_order_case(size_t i)
{
    const order_case_t *c = &header_order_cases[i];
    tally_req_t req = make_req(c->op);
    req.request_id = 0x1122334455667700ull + i;
    uint8_t buf[TALLY_REQ_HEADER_SIZE + 1] = {0};
    tally_req_encode(&req, buf);
    for (size_t k = 0; k < 5 && c->patch[k][0] != PATCH_END; k++)
        buf[c->patch[k][0]] = (uint8_t)c->patch[k][1];
    tally_status_t want = c->want;
    if (c->op == TALLY_OP_QUERY) {
        /* Without the predicate the missing name is the only problem; with it, bad_param
         * comes first (step 7 checks pred before the stream rule). */
        tally_req_t out;
        assert_int_equal(decode_buf(buf, c->len, &out), TALLY_E_STREAM_NAME);
        buf[16] = 1;
        want = TALLY_E_PARAM;
    }
    tally_req_t out;
    tally_status_t got = decode_buf(buf, c->len, &out);
    if (got != want)
        fail_msg("%s: got %s, want %s", c->what, tally_status_name(got), tally_status_name(want));
    /* §3: the first 16 bytes are echoed whatever else is wrong. */
    assert_int_equal(out.request_id, req.request_id);
    assert_int_equal(out.opcode, buf[5]);
    assert_int_equal(out.flags, buf[7]);
}

static void test_validation_order_header(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof header_order_cases / sizeof header_order_cases[0]; i++)
        check_header_order_case(i);
}

/* The payload comes after the field rules, and its size before its shape. */
static void test_validation_order_payload(void **state)
{
    (void)state;
    char msg[256];
    tally_req_t req = make_req(TALLY_OP_FILTER);
    req.hi = 1; /* gt takes no hi */
    assert_int_equal(tally_req_validate(&req, 7, MAX_BATCH, msg, sizeof msg), TALLY_E_PARAM);
    req = make_req(TALLY_OP_SCAN);
    req.dtype = TALLY_DTYPE_U8;
    assert_int_equal(tally_req_validate(&req, MAX_BATCH + 3, MAX_BATCH, msg, sizeof msg),
                     TALLY_E_DTYPE);
    req = make_req(TALLY_OP_PING);
    assert_int_equal(tally_req_set_stream(&req, "cam0"), TALLY_OK);
    assert_int_equal(tally_req_validate(&req, 1, MAX_BATCH, msg, sizeof msg), TALLY_E_STREAM_NAME);
    req = make_req(TALLY_OP_SCAN);
    assert_int_equal(tally_req_validate(&req, MAX_BATCH + 1, MAX_BATCH, msg, sizeof msg),
                     TALLY_E_TOO_LARGE);
    req = make_req(TALLY_OP_QUERY);
    assert_int_equal(tally_req_validate(&req, 1, MAX_BATCH, msg, sizeof msg), TALLY_E_PAYLOAD);
}

/* ---- Payload rules ---------------------------------------------------------------------- */

static void test_reject_payload_too_large(void **state)
{
    (void)state;
    char msg[256];
    assert_int_equal(validate_payload(TALLY_OP_FILTER, TALLY_DTYPE_I32, 20000000, msg),
                     TALLY_E_TOO_LARGE);
    assert_string_equal(msg, "batch of 20000000 bytes exceeds the maximum of 16777216");
    /* Size is judged before alignment. */
    assert_int_equal(validate_payload(TALLY_OP_SCAN, TALLY_DTYPE_I32, MAX_BATCH + 1, msg),
                     TALLY_E_TOO_LARGE);
    assert_int_equal(validate_payload(TALLY_OP_HIST, TALLY_DTYPE_U8, MAX_BATCH + 1, msg),
                     TALLY_E_TOO_LARGE);
    assert_int_equal(validate_payload(TALLY_OP_PING, TALLY_DTYPE_NONE, MAX_BATCH + 1, msg),
                     TALLY_E_TOO_LARGE);
    assert_int_equal(validate_payload(TALLY_OP_FILTER, TALLY_DTYPE_I32, MAX_BATCH, msg), TALLY_OK);
    assert_int_equal(validate_payload(TALLY_OP_FILTER, TALLY_DTYPE_U8, SIZE_MAX, msg),
                     TALLY_E_TOO_LARGE);
}

static void test_reject_payload_misaligned(void **state)
{
    (void)state;
    char msg[256];
    assert_int_equal(validate_payload(TALLY_OP_FILTER, TALLY_DTYPE_I32, 7, msg), TALLY_E_PAYLOAD);
    assert_string_equal(msg, "payload of 7 bytes is not a whole number of int32 elements");
    for (size_t len = 1; len < 4; len++) {
        assert_int_equal(validate_payload(TALLY_OP_SCAN, TALLY_DTYPE_I32, len, msg),
                         TALLY_E_PAYLOAD);
        assert_int_equal(validate_payload(TALLY_OP_SCAN, TALLY_DTYPE_I32, 4 + len, msg),
                         TALLY_E_PAYLOAD);
    }
    tally_req_t req = make_req(TALLY_OP_HIST);
    req.dtype = TALLY_DTYPE_I32;
    req.hi = 100;
    assert_int_equal(tally_req_validate(&req, 6, MAX_BATCH, msg, sizeof msg), TALLY_E_PAYLOAD);
}

static void test_accept_payload_sizes(void **state)
{
    (void)state;
    char msg[256];
    static const size_t sizes[] = {0, 1, 31, 32, 33, 1000};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t n = sizes[i];
        assert_int_equal(validate_payload(TALLY_OP_FILTER, TALLY_DTYPE_U8, n, msg), TALLY_OK);
        assert_int_equal(validate_payload(TALLY_OP_HIST, TALLY_DTYPE_U8, n, msg), TALLY_OK);
        assert_int_equal(validate_payload(TALLY_OP_FILTER, TALLY_DTYPE_I32, 4 * n, msg), TALLY_OK);
        assert_int_equal(validate_payload(TALLY_OP_SCAN, TALLY_DTYPE_I32, 4 * n, msg), TALLY_OK);
        assert_string_equal(msg, "");
    }
    assert_int_equal(tally_req_validate(NULL, 0, MAX_BATCH, msg, sizeof msg), TALLY_E_ARG);
}

/* Messages are cut to the caller's buffer, always terminated. */
static void test_message_truncation(void **state)
{
    (void)state;
    char msg[8];
    memset(msg, 'x', sizeof msg);
    tally_req_t req = make_req(TALLY_OP_FILTER);
    assert_int_equal(tally_req_validate(&req, 7, MAX_BATCH, msg, sizeof msg), TALLY_E_PAYLOAD);
    assert_string_equal(msg, "payload");
    req.pred = 0;
    assert_int_equal(tally_req_validate(&req, 0, MAX_BATCH, NULL, 0), TALLY_E_PARAM);
    assert_int_equal(tally_req_validate(&req, 0, MAX_BATCH, msg, 1), TALLY_E_PARAM);
    assert_int_equal(msg[0], '\0');
}

/* ---- Reply and query payload rejections ------------------------------------------------- */

static void test_reject_reply(void **state)
{
    (void)state;
    uint8_t buf[TALLY_REP_HEADER_SIZE + 1];
    tally_rep_t out;
    memcpy(buf, example_reply, TALLY_REP_HEADER_SIZE);
    buf[TALLY_REP_HEADER_SIZE] = 0;
    assert_int_equal(tally_rep_decode(buf, TALLY_REP_HEADER_SIZE - 1, &out), TALLY_E_REPLY);
    assert_int_equal(tally_rep_decode(buf, TALLY_REP_HEADER_SIZE + 1, &out), TALLY_E_REPLY);
    assert_int_equal(tally_rep_decode(NULL, 0, &out), TALLY_E_REPLY);

    buf[1] = 'l'; /* magic */
    assert_int_equal(tally_rep_decode(buf, TALLY_REP_HEADER_SIZE, &out), TALLY_E_REPLY);
    buf[1] = 'L';
    buf[4] = 2; /* version */
    assert_int_equal(tally_rep_decode(buf, TALLY_REP_HEADER_SIZE, &out), TALLY_E_REPLY);
    buf[4] = 1;
    for (size_t off = 20; off < 24; off++) {
        buf[off] = 1;
        assert_int_equal(tally_rep_decode(buf, TALLY_REP_HEADER_SIZE, &out), TALLY_E_REPLY);
        buf[off] = 0;
    }
    for (size_t off = 48; off < 64; off++) {
        buf[off] = 1;
        assert_int_equal(tally_rep_decode(buf, TALLY_REP_HEADER_SIZE, &out), TALLY_E_REPLY);
        buf[off] = 0;
    }
    tally_put_u32(buf + 16, TALLY_E_TIMEOUT); /* client-local statuses never travel */
    assert_int_equal(tally_rep_decode(buf, TALLY_REP_HEADER_SIZE, &out), TALLY_E_REPLY);
    tally_put_u32(buf + 16, TALLY_E_UNKNOWN_STREAM);
    assert_int_equal(tally_rep_decode(buf, TALLY_REP_HEADER_SIZE, &out), TALLY_OK);
    assert_int_equal(out.status, TALLY_E_UNKNOWN_STREAM);
}

static void test_reject_stream_info(void **state)
{
    (void)state;
    static uint8_t buf[TALLY_QUERY_PAYLOAD_SIZE + 1];
    tally_stream_info_t info, out;
    memset(&info, 0, sizeof info);
    tally_stream_info_encode(&info, buf);
    assert_int_equal(tally_stream_info_decode(buf, TALLY_QUERY_PAYLOAD_SIZE, &out), TALLY_OK);
    assert_int_equal(tally_stream_info_decode(buf, TALLY_QUERY_PAYLOAD_SIZE - 1, &out),
                     TALLY_E_REPLY);
    assert_int_equal(tally_stream_info_decode(buf, TALLY_QUERY_PAYLOAD_SIZE + 1, &out),
                     TALLY_E_REPLY);
    assert_int_equal(tally_stream_info_decode(NULL, 0, &out), TALLY_E_REPLY);
    buf[57] = 1;
    assert_int_equal(tally_stream_info_decode(buf, TALLY_QUERY_PAYLOAD_SIZE, &out), TALLY_E_REPLY);
    buf[57] = 0;
    buf[127] = 1;
    assert_int_equal(tally_stream_info_decode(buf, TALLY_QUERY_PAYLOAD_SIZE, &out), TALLY_E_REPLY);
    buf[127] = 0;
    buf[56] = TALLY_DTYPE_I64;
    assert_int_equal(tally_stream_info_decode(buf, TALLY_QUERY_PAYLOAD_SIZE, &out), TALLY_E_REPLY);
}

/* ---- Histogram bins --------------------------------------------------------------------- */

static void test_hist_bin_i32(void **state)
{
    (void)state;
    assert_int_equal(tally_hist_bin_i32(0, 0, 256), 0);
    assert_int_equal(tally_hist_bin_i32(255, 0, 256), 255);
    assert_int_equal(tally_hist_bin_i32(-10, -10, 10), 0);
    assert_int_equal(tally_hist_bin_i32(9, -10, 10), 243); /* floor(19 * 256 / 20) */
    assert_int_equal(tally_hist_bin_i32(0, -10, 10), 128);
    int64_t lo = INT32_MIN, hi = (int64_t)INT32_MAX + 1;
    assert_int_equal(tally_hist_bin_i32(INT32_MIN, lo, hi), 0);
    assert_int_equal(tally_hist_bin_i32(INT32_MAX, lo, hi), 255);
    assert_int_equal(tally_hist_bin_i32(-1, lo, hi), 127);
    assert_int_equal(tally_hist_bin_i32(0, lo, hi), 128);
    assert_int_equal(tally_hist_bin_i32(7, 7, 8), 0);   /* one value wide */
    assert_int_equal(tally_hist_bin_i32(2, 0, 3), 170); /* floor(2 * 256 / 3) */
}

/* ---- Robustness ------------------------------------------------------------------------- */

/* Lengths near the interesting sizes, and anything up to a little past the query payload. */
static size_t random_length(void)
{
    static const size_t sizes[] = {0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 2175, 2176, 2177};
    if (rng_below(4) != 0)
        return sizes[rng_below(sizeof sizes / sizeof sizes[0])];
    return rng_below(TALLY_QUERY_PAYLOAD_SIZE + 64);
}

/* A buffer of random length holding a valid encoding of some kind (or noise) with a few bytes
 * damaged. Half the time the length is the model's own, so the accepting paths are reached. */
static uint8_t *random_buffer(size_t *len_out)
{
    static uint8_t model[TALLY_QUERY_PAYLOAD_SIZE];
    static tally_stream_info_t info;
    size_t model_len = 0;
    switch (rng_below(4)) {
    case 0: {
        tally_req_t req = random_valid_req();
        tally_req_encode(&req, model);
        model_len = TALLY_REQ_HEADER_SIZE;
        break;
    }
    case 1: {
        tally_rep_t rep = {.opcode = (uint8_t)rng_next(),
                           .dtype = (uint8_t)rng_next(),
                           .request_id = rng_next(),
                           .status = (uint32_t)rng_below(120),
                           .count = rng_next(),
                           .aux0 = rng_next()};
        tally_rep_encode(&rep, model);
        model_len = TALLY_REP_HEADER_SIZE;
        break;
    }
    case 2:
        info.hist_dtype = (uint8_t)rng_below(4);
        info.scan_carry = (int64_t)rng_next();
        info.bins[rng_below(TALLY_HIST_BINS)] = rng_next();
        tally_stream_info_encode(&info, model);
        model_len = TALLY_QUERY_PAYLOAD_SIZE;
        break;
    default:
        break;
    }
    size_t len = model_len > 0 && rng_below(2) ? model_len : random_length();
    /* Exactly len bytes, so AddressSanitizer sees any read past the end. */
    uint8_t *buf = malloc(len > 0 ? len : 1);
    assert_non_null(buf);
    for (size_t i = 0; i < len; i++)
        buf[i] = i < model_len ? model[i] : (uint8_t)rng_next();
    uint64_t flips = len > 0 ? rng_below(4) : 0;
    for (uint64_t f = 0; f < flips; f++) {
        size_t at = rng_below(len);
        buf[at] = rng_below(2) ? (uint8_t)rng_next() : (uint8_t)(buf[at] ^ (1u << rng_below(8)));
    }
    *len_out = len;
    return buf;
}

static void test_robustness(void **state)
{
    (void)state;
    rng_seed(20261121);
    size_t ok_req = 0, ok_rep = 0, ok_info = 0;
    for (int i = 0; i < 200000; i++) {
        size_t len;
        uint8_t *buf = random_buffer(&len);

        tally_req_t req;
        char msg[64];
        size_t cap = (size_t)rng_below(sizeof msg + 1);
        tally_status_t st = tally_req_decode(buf, len, &req, cap > 0 ? msg : NULL, cap);
        if (cap > 0)
            assert_true(strlen(msg) < cap);
        assert_true(st == TALLY_OK || (st >= TALLY_E_HEADER && st < TALLY_STATUS_WIRE_COUNT));
        if (st == TALLY_OK) {
            uint8_t again[TALLY_REQ_HEADER_SIZE];
            assert_int_equal(len, TALLY_REQ_HEADER_SIZE);
            tally_req_encode(&req, again);
            assert_memory_equal(buf, again, TALLY_REQ_HEADER_SIZE);
            /* A reference's payload is exactly its 48 bytes; any other request's may be empty. */
            size_t payload = (req.flags & TALLY_FLAG_SHM_REF) ? TALLY_SHM_REF_SIZE : 0;
            assert_int_equal(tally_req_validate(&req, payload, SIZE_MAX, NULL, 0), TALLY_OK);
            ok_req++;
        }

        tally_rep_t rep;
        if (tally_rep_decode(buf, len, &rep) == TALLY_OK) {
            uint8_t again[TALLY_REP_HEADER_SIZE];
            tally_rep_encode(&rep, again);
            assert_memory_equal(buf, again, TALLY_REP_HEADER_SIZE);
            ok_rep++;
        }

        static tally_stream_info_t info;
        if (tally_stream_info_decode(buf, len, &info) == TALLY_OK) {
            static uint8_t again[TALLY_QUERY_PAYLOAD_SIZE];
            tally_stream_info_encode(&info, again);
            assert_memory_equal(buf, again, TALLY_QUERY_PAYLOAD_SIZE);
            ok_info++;
        }
        free(buf);
    }
    print_message("accepted: %zu requests, %zu replies, %zu query payloads\n", ok_req, ok_rep,
                  ok_info);
    /* The mutations must reach the accepting paths too, or the test proves little. */
    assert_true(ok_req > 1000);
    assert_true(ok_rep > 1000);
    assert_true(ok_info > 500);
}

/* The byte helpers write and read little-endian whatever the host (one load or store where
 * the host is little-endian, a byte loop elsewhere), at any alignment. */
static void test_le_helpers(void **state)
{
    (void)state;
    uint8_t buf[17] = {0};
    const uint8_t want64[8] = {0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01};
    const uint8_t want32[4] = {0xd4, 0xc3, 0xb2, 0xa1};
    tally_put_u64(buf + 1, 0x0102030405060708ull); /* odd address: unaligned */
    assert_memory_equal(buf + 1, want64, 8);
    assert_true(tally_get_u64(buf + 1) == 0x0102030405060708ull);
    tally_put_u32(buf + 9, 0xa1b2c3d4u);
    assert_memory_equal(buf + 9, want32, 4);
    assert_true(tally_get_u32(buf + 9) == 0xa1b2c3d4u);
    tally_put_u16(buf + 13, 0xbeefu);
    assert_int_equal(buf[13], 0xef);
    assert_int_equal(buf[14], 0xbe);
    assert_int_equal(tally_get_u16(buf + 13), 0xbeef);
    assert_int_equal(buf[0], 0); /* nothing written outside */
    assert_int_equal(buf[15], 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_le_helpers),
        cmocka_unit_test(test_status_names),
        cmocka_unit_test(test_op_dtype_pred_names),
        cmocka_unit_test(test_req_round_trip),
        cmocka_unit_test(test_rep_round_trip),
        cmocka_unit_test(test_stream_info_round_trip),
        cmocka_unit_test(test_stream_info_layout),
        cmocka_unit_test(test_example_request),
        cmocka_unit_test(test_example_reply),
        cmocka_unit_test(test_example_matches_protocol_md),
        cmocka_unit_test(test_reject_header_short),
        cmocka_unit_test(test_reject_header_long),
        cmocka_unit_test(test_reject_magic),
        cmocka_unit_test(test_reject_version),
        cmocka_unit_test(test_reject_opcode),
        cmocka_unit_test(test_reject_dtype_unknown),
        cmocka_unit_test(test_reject_dtype_wrong_for_op),
        cmocka_unit_test(test_reject_reserved_bytes),
        cmocka_unit_test(test_seq_bytes),
        cmocka_unit_test(test_reject_misplaced_seq),
        cmocka_unit_test(test_reject_stream_name_too_long),
        cmocka_unit_test(test_reject_stream_name_bytes),
        cmocka_unit_test(test_reject_stream_name_padding),
        cmocka_unit_test(test_reject_control_fields),
        cmocka_unit_test(test_reject_control_stream),
        cmocka_unit_test(test_reject_query_reset_without_stream),
        cmocka_unit_test(test_reject_control_payload),
        cmocka_unit_test(test_reject_filter_pred),
        cmocka_unit_test(test_reject_filter_between_range),
        cmocka_unit_test(test_reject_filter_hi_single_threshold),
        cmocka_unit_test(test_reject_filter_flags),
        cmocka_unit_test(test_shm_ref),
        cmocka_unit_test(test_shm_side_messages),
        cmocka_unit_test(test_shm_device_message),
        cmocka_unit_test(test_reject_scan_flags),
        cmocka_unit_test(test_reject_scan_params),
        cmocka_unit_test(test_reject_hist_u8_params),
        cmocka_unit_test(test_reject_hist_i32_range),
        cmocka_unit_test(test_reject_hist_i32_params),
        cmocka_unit_test(test_validation_order_header),
        cmocka_unit_test(test_validation_order_payload),
        cmocka_unit_test(test_reject_payload_too_large),
        cmocka_unit_test(test_reject_payload_misaligned),
        cmocka_unit_test(test_accept_payload_sizes),
        cmocka_unit_test(test_message_truncation),
        cmocka_unit_test(test_reject_reply),
        cmocka_unit_test(test_reject_stream_info),
        cmocka_unit_test(test_hist_u16_rgb),
        cmocka_unit_test(test_query_window),
        cmocka_unit_test(test_stream_info_channels),
        cmocka_unit_test(test_pub_header),
        cmocka_unit_test(test_hist_bin_i32),
        cmocka_unit_test(test_robustness),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
