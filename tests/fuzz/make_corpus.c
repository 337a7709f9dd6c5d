/* SPDX-License-Identifier: Apache-2.0 */
/*
 * make_corpus.c — writes the seed corpus of fuzz_proto.c into a directory: one valid message
 * per file for every operation, dtype, predicate and flag, the worked example of PROTOCOL.md §9,
 * replies of every kind and query records, plus a few payloads just past a limit (too large,
 * not a whole number of elements) so the fuzzer starts next to every verdict.
 *
 * The output is a pure function of this file: fixed ids, fixed data, no clock, no randomness.
 * tests/fuzz/corpus/ is this program's output, checked in; the CTest test
 * test_fuzz_corpus_fresh regenerates it and fails when the two differ, so after changing this
 * file run `build/tests/fuzz/make_corpus tests/fuzz/corpus` and commit the result.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tally_proto.h"

enum { MODE_REQUEST = 0, MODE_REPLY = 1, MODE_STREAM_INFO = 2 };

static const char *out_dir;
static int failures;

static void write_seed(const char *name, const uint8_t *data, size_t len)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", out_dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, len, f) != len) {
        fprintf(stderr, "make_corpus: %s: %s\n", path, strerror(errno));
        failures++;
    }
    if (f && fclose(f) != 0)
        failures++;
}

/* Mode byte, header length, header, payload: the request layout of fuzz_proto.c. */
static void request_seed(const char *name, const tally_req_t *req, const void *payload, size_t len)
{
    uint8_t *buf = malloc(2 + TALLY_REQ_HEADER_SIZE + len);
    if (!buf) {
        failures++;
        return;
    }
    buf[0] = MODE_REQUEST;
    buf[1] = TALLY_REQ_HEADER_SIZE;
    tally_req_encode(req, buf + 2);
    if (len)
        memcpy(buf + 2 + TALLY_REQ_HEADER_SIZE, payload, len);
    char msg[TALLY_ERROR_MESSAGE_MAX + 1];
    if (tally_req_decode(buf + 2, TALLY_REQ_HEADER_SIZE, &(tally_req_t){0}, msg, sizeof msg) !=
        TALLY_OK) {
        fprintf(stderr, "make_corpus: seed %s is not a valid header: %s\n", name, msg);
        failures++;
    }
    write_seed(name, buf, 2 + TALLY_REQ_HEADER_SIZE + len);
    free(buf);
}

static tally_req_t req_of(uint8_t opcode, uint8_t dtype, uint64_t id, const char *stream)
{
    tally_req_t req;
    memset(&req, 0, sizeof req);
    req.opcode = opcode;
    req.dtype = dtype;
    req.request_id = id;
    if (stream && tally_req_set_stream(&req, stream) != TALLY_OK)
        failures++;
    return req;
}

static void put_i32s(uint8_t *out, const int32_t *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        tally_put_u32(out + 4 * i, (uint32_t)v[i]);
}

static void control_seeds(void)
{
    static const struct {
        const char *name;
        uint8_t op;
        const char *stream;
    } ops[] = {
        {"req-ping", TALLY_OP_PING, NULL},
        {"req-info", TALLY_OP_INFO, NULL},
        {"req-streams", TALLY_OP_STREAMS, NULL},
        {"req-stats", TALLY_OP_STATS, NULL},
        {"req-query", TALLY_OP_QUERY, "cam0"},
        {"req-reset", TALLY_OP_RESET, "line3/pressure"},
        {"req-delete", TALLY_OP_DELETE, "line3/pressure"},
        {"req-query-longest-name", TALLY_OP_QUERY,
         "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcde!"},
    };
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        tally_req_t req = req_of(ops[i].op, TALLY_DTYPE_NONE, 100 + i, ops[i].stream);
        request_seed(ops[i].name, &req, NULL, 0);
    }
}

static void filter_seeds(void)
{
    /* The worked example of PROTOCOL.md §9. */
    static const int32_t example[10] = {3, -1, 0, 7, 2, -5, 9, 0, 1, 4};
    uint8_t payload[40];
    put_i32s(payload, example, 10);
    tally_req_t req = req_of(TALLY_OP_FILTER, TALLY_DTYPE_I32, 7, "cam0");
    req.pred = TALLY_PRED_GT;
    request_seed("req-filter-example", &req, payload, sizeof payload);

    static const char *const names[] = {NULL,
                                        "req-filter-i32-gt",
                                        "req-filter-i32-ge",
                                        "req-filter-i32-lt",
                                        "req-filter-i32-le",
                                        "req-filter-i32-eq",
                                        "req-filter-i32-ne",
                                        "req-filter-i32-between"};
    for (int p = TALLY_PRED_GT; p <= TALLY_PRED_BETWEEN; p++) {
        req = req_of(TALLY_OP_FILTER, TALLY_DTYPE_I32, 200 + (uint64_t)p, NULL);
        req.pred = (uint8_t)p;
        req.lo = p == TALLY_PRED_BETWEEN ? -2 : INT64_MIN + p;
        req.hi = p == TALLY_PRED_BETWEEN ? INT64_MAX : 0;
        req.flags = p % 2 ? TALLY_FLAG_FILTER_STABLE : 0;
        request_seed(names[p], &req, payload, 4 * (size_t)p);
    }
    static const uint8_t bytes[5] = {0, 1, 127, 128, 255};
    req = req_of(TALLY_OP_FILTER, TALLY_DTYPE_U8, 300, "pixels/cam1");
    req.pred = TALLY_PRED_BETWEEN;
    req.lo = 1;
    req.hi = 300;
    request_seed("req-filter-u8-between", &req, bytes, sizeof bytes);
    req.pred = TALLY_PRED_NE;
    req.lo = 128;
    req.hi = 0;
    req.flags = TALLY_FLAG_FILTER_STABLE;
    request_seed("req-filter-u8-ne-stable", &req, bytes, sizeof bytes);
}

static void scan_hist_seeds(void)
{
    int32_t v[33];
    for (int i = 0; i < 33; i++)
        v[i] = i % 2 ? INT32_MIN + i : INT32_MAX - i;
    uint8_t payload[4 * 33];
    put_i32s(payload, v, 33);
    static const struct {
        const char *name;
        uint8_t flags;
        size_t n;
    } scans[] = {
        {"req-scan-empty", 0, 0},
        {"req-scan-one-exclusive", TALLY_FLAG_SCAN_EXCLUSIVE, 1},
        {"req-scan-33-out32", TALLY_FLAG_SCAN_OUT_I32, 33},
        {"req-scan-33-exclusive-out32", TALLY_FLAG_SCAN_EXCLUSIVE | TALLY_FLAG_SCAN_OUT_I32, 33},
    };
    for (size_t i = 0; i < sizeof scans / sizeof scans[0]; i++) {
        tally_req_t req = req_of(TALLY_OP_SCAN, TALLY_DTYPE_I32, 400 + i, i % 2 ? "big" : NULL);
        req.flags = scans[i].flags;
        request_seed(scans[i].name, &req, payload, 4 * scans[i].n);
    }

    tally_req_t req = req_of(TALLY_OP_HIST, TALLY_DTYPE_U8, 500, "cam0");
    request_seed("req-hist-u8", &req, payload, 17);
    req = req_of(TALLY_OP_HIST, TALLY_DTYPE_I32, 501, NULL);
    req.lo = INT32_MIN;
    req.hi = (int64_t)INT32_MAX + 1;
    request_seed("req-hist-i32-widest", &req, payload, 4 * 8);
    req = req_of(TALLY_OP_HIST, TALLY_DTYPE_I32, 502, "line3/pressure");
    req.lo = -1000;
    req.hi = -999;
    request_seed("req-hist-i32-narrowest", &req, payload, 4 * 3);

    /* Next to the payload verdicts: fuzz_proto.c's max_batch is 1024 bytes. */
    static uint8_t big[1025];
    req = req_of(TALLY_OP_HIST, TALLY_DTYPE_U8, 503, NULL);
    request_seed("req-hist-u8-max-batch", &req, big, 1024);
    request_seed("req-hist-u8-too-large", &req, big, 1025);
    req = req_of(TALLY_OP_SCAN, TALLY_DTYPE_I32, 504, NULL);
    request_seed("req-scan-not-whole-elements", &req, payload, 7);

    /* Issue 12: uint16 over 12 bits, RGB and RGBA pixels (half a pixel too), a window query. */
    req = req_of(TALLY_OP_HIST, TALLY_DTYPE_U16, 505, "sensor12");
    req.hi = 4096;
    request_seed("req-hist-u16-12bit", &req, payload, 2 * 9);
    req = req_of(TALLY_OP_HIST, TALLY_DTYPE_RGB8, 506, "cam/rgb");
    request_seed("req-hist-rgb8", &req, payload, 3 * 5);
    request_seed("req-hist-rgb8-half-pixel", &req, payload, 3 * 5 + 1);
    req = req_of(TALLY_OP_HIST, TALLY_DTYPE_RGBA8, 507, NULL);
    request_seed("req-hist-rgba8", &req, payload, 4 * 6);
    req = req_of(TALLY_OP_QUERY, TALLY_DTYPE_NONE, 508, "cam0");
    req.flags = TALLY_FLAG_QUERY_WINDOW;
    req.lo = 10000;
    request_seed("req-query-window-10s", &req, NULL, 0);

    /* Issue 25: minmax (opcode 13), a batch without a stream; a u16 batch and an odd byte. */
    req = req_of(TALLY_OP_MINMAX, TALLY_DTYPE_U16, 509, NULL);
    request_seed("req-minmax-u16", &req, payload, 2 * 7);
    request_seed("req-minmax-u16-odd-byte", &req, payload, 2 * 7 + 1);
}

static void reply_seed(const char *name, const tally_rep_t *rep)
{
    uint8_t buf[1 + TALLY_REP_HEADER_SIZE];
    buf[0] = MODE_REPLY;
    tally_rep_encode(rep, buf + 1);
    write_seed(name, buf, sizeof buf);
}

static void reply_seeds(void)
{
    reply_seed("rep-ping", &(tally_rep_t){.opcode = TALLY_OP_PING, .request_id = 1});
    reply_seed("rep-filter-example", &(tally_rep_t){.opcode = TALLY_OP_FILTER,
                                                    .dtype = TALLY_DTYPE_I32,
                                                    .request_id = 7,
                                                    .count = 6,
                                                    .aux0 = 10});
    reply_seed("rep-scan-carry", &(tally_rep_t){.opcode = TALLY_OP_SCAN,
                                                .dtype = TALLY_DTYPE_I64,
                                                .flags = TALLY_FLAG_SCAN_EXCLUSIVE,
                                                .request_id = UINT64_MAX,
                                                .count = 33,
                                                .aux0 = (uint64_t)INT64_MIN});
    reply_seed("rep-hist-i32", &(tally_rep_t){.opcode = TALLY_OP_HIST,
                                              .dtype = TALLY_DTYPE_U64,
                                              .request_id = 501,
                                              .count = TALLY_HIST_I32_VALUES,
                                              .aux0 = 8});
    reply_seed("rep-query",
               &(tally_rep_t){.opcode = TALLY_OP_QUERY, .request_id = 104, .count = 1});
    reply_seed("rep-error-bad-stream-name", &(tally_rep_t){.opcode = TALLY_OP_QUERY,
                                                           .dtype = TALLY_DTYPE_TEXT,
                                                           .request_id = 8,
                                                           .status = TALLY_E_STREAM_NAME});
    reply_seed("rep-error-internal",
               &(tally_rep_t){.dtype = TALLY_DTYPE_TEXT, .status = TALLY_E_INTERNAL});
}

static void stream_info_seed(const char *name, const tally_stream_info_t *info)
{
    static uint8_t buf[1 + TALLY_QUERY_PAYLOAD_MAX];
    buf[0] = MODE_STREAM_INFO;
    size_t len = tally_stream_info_encode(info, buf + 1);
    write_seed(name, buf, 1 + len);
}

static void stream_info_seeds(void)
{
    static tally_stream_info_t info;
    memset(&info, 0, sizeof info);
    stream_info_seed("info-new-stream", &info);

    info.batches = 3;
    info.elements = 1000;
    info.bytes = 1000;
    info.hist_dtype = TALLY_DTYPE_U8;
    info.hist_total = 1000;
    for (int i = 0; i < TALLY_HIST_BINS; i++)
        info.bins[i] = i < 232 ? 4 : 9;
    stream_info_seed("info-hist-u8", &info);

    /* A stream that saw a filter, a scan and a full-range i32 hist. */
    info = (tally_stream_info_t){.batches = 2,
                                 .elements = 20,
                                 .bytes = 80,
                                 .filter_seen = 10,
                                 .filter_kept = 6,
                                 .scan_carry = -12505,
                                 .scan_elements = 5,
                                 .hist_dtype = TALLY_DTYPE_I32,
                                 .hist_lo = INT32_MIN,
                                 .hist_hi = (int64_t)INT32_MAX + 1,
                                 .hist_total = 5};
    info.bins[0] = 2;
    info.bins[255] = 3;
    stream_info_seed("info-hist-i32-scan-filter", &info);

    /* Issue 12: a 12-bit u16 stream, and colour streams with a record per channel. */
    info = (tally_stream_info_t){.batches = 1,
                                 .elements = 4,
                                 .bytes = 8,
                                 .hist_dtype = TALLY_DTYPE_U16,
                                 .hist_lo = 0,
                                 .hist_hi = 4096,
                                 .hist_overflow = 1,
                                 .hist_total = 4,
                                 .last_seq = 9};
    info.bins[17] = 3;
    stream_info_seed("info-hist-u16-12bit", &info);
    for (unsigned channels = 3; channels <= 4; channels++) {
        info = (tally_stream_info_t){.batches = 1,
                                     .elements = 2,
                                     .bytes = 2 * channels,
                                     .hist_dtype =
                                         channels == 3 ? TALLY_DTYPE_RGB8 : TALLY_DTYPE_RGBA8,
                                     .hist_total = 2};
        for (unsigned c = 0; c < channels; c++)
            info.bins[c * TALLY_HIST_BINS + 40 * c] = 2;
        stream_info_seed(channels == 3 ? "info-hist-rgb8" : "info-hist-rgba8", &info);
    }
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: make_corpus DIR\n");
        return 2;
    }
    out_dir = argv[1];
    if (mkdir(out_dir, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "make_corpus: %s: %s\n", out_dir, strerror(errno));
        return 1;
    }
    control_seeds();
    filter_seeds();
    scan_hist_seeds();
    reply_seeds();
    stream_info_seeds();
    return failures ? 1 : 0;
}
