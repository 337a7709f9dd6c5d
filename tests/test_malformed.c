/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_malformed.c — a corpus of malformed messages against a running tallyd, over raw DEALER
 * sockets, and the points of PROTOCOL.md that a client author would otherwise have to guess.
 *
 * Each malformed message is followed by a ping on the same connection, and the test reads until
 * the ping's reply: so it sees every reply the message caused, and asserts there is exactly one,
 * with the status of PROTOCOL.md §6/§7, the echo rules of §3 (opcode, flags, request id from a
 * first frame of at least 16 bytes, else 0), the error-reply shape (dtype text, count/aux 0, a
 * printable message of 1..255 bytes) and the empty-frame rule of §1 (an empty first frame comes
 * back in front of the reply, whichever socket sent it). The corpus: truncated and oversized
 * headers, lying headers (stream_len against the name, reserved bytes, bad magic, version,
 * opcode, dtype, predicate, flags, ranges), payloads over max_batch or not whole elements or
 * sent to operations without payload, NUL bytes in names, a 10 KB header frame, and 0, 1, 3 and
 * 50 frames. After it, tallyd must still answer pings and real requests correctly.
 *
 * Reserved bytes 40..47 and flag 0x80 are left alone: other protocol work allocates them.
 */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include <cmocka.h>

#include "harness.h"

#define MAX_BATCH 65536 /* small, so payloads over it stay far under the transport guard */
#define FRAMES_MAX 64
#define PING_ID_BASE 0x5050000000000000ull

static th_daemon_t daemon_m;
static void *sock_m; /* the connection of the running test (reconnect) */
static uint64_t next_ping = PING_ID_BASE;

static int group_setup(void **state)
{
    (void)state;
    const char *args[] = {"--max-batch", "65536", NULL};
    if (th_daemon_start(&daemon_m, args) != 0)
        return -1;
    sock_m = th_connect(daemon_m.endpoint, 5000);
    return 0;
}

/* A fresh connection per test, so that a failed test's unread replies cannot confuse the next. */
static int reconnect(void **state)
{
    (void)state;
    th_close(sock_m);
    sock_m = th_connect(daemon_m.endpoint, 5000);
    return sock_m ? 0 : -1;
}

static int group_teardown(void **state)
{
    (void)state;
    th_close(sock_m);
    return th_daemon_stop(&daemon_m, SIGTERM, 10000) == 0 ? 0 : -1;
}

/* ---- raw messages ------------------------------------------------------------------------ */

typedef struct {
    int frames;
    size_t len[FRAMES_MAX];
    uint8_t *data[FRAMES_MAX];
} msg_t;

static void msg_free(msg_t *m)
{
    for (int i = 0; i < m->frames && i < FRAMES_MAX; i++)
        free(m->data[i]);
    memset(m, 0, sizeof *m);
}

/* One whole multipart message; -1 on timeout. */
static int recv_msg(void *sock, msg_t *m)
{
    memset(m, 0, sizeof *m);
    for (;;) {
        zmq_msg_t f;
        zmq_msg_init(&f);
        if (zmq_msg_recv(&f, sock, 0) < 0) {
            zmq_msg_close(&f);
            msg_free(m);
            return -1;
        }
        if (m->frames < FRAMES_MAX) {
            m->len[m->frames] = zmq_msg_size(&f);
            m->data[m->frames] = malloc(m->len[m->frames] + 1);
            memcpy(m->data[m->frames], zmq_msg_data(&f), m->len[m->frames]);
        }
        m->frames++;
        int more = zmq_msg_more(&f);
        zmq_msg_close(&f);
        if (!more)
            return 0;
    }
}

/* What one reply must look like. */
typedef struct {
    const char *what;
    uint32_t status;
    uint64_t id;
    uint8_t opcode;
    uint8_t flags;
    bool delimiter; /* an empty frame in front (§1) */
} want_t;

#define EXPECT(cond)                                                                               \
    do {                                                                                           \
        if (!(cond))                                                                               \
            fail_msg("%s: expected %s", w->what, #cond);                                           \
    } while (0)

/* The reply header of m, decoded, after the optional delimiter; checks the frame layout. */
static tally_rep_t reply_header(const msg_t *m, const want_t *w)
{
    int at = w->delimiter ? 1 : 0;
    EXPECT(m->frames == at + 2);
    if (w->delimiter)
        EXPECT(m->len[0] == 0);
    tally_rep_t rep = {0};
    EXPECT(tally_rep_decode(m->data[at], m->len[at], &rep) == TALLY_OK);
    return rep;
}

static void check_reply(const msg_t *m, const want_t *w)
{
    tally_rep_t rep = reply_header(m, w);
    if (rep.status != w->status)
        fail_msg("%s: status %s, expected %s", w->what, tally_status_name(rep.status),
                 tally_status_name(w->status));
    EXPECT(rep.request_id == w->id);
    EXPECT(rep.opcode == w->opcode);
    EXPECT(rep.flags == w->flags);
    if (w->status == TALLY_OK)
        return;
    /* §3: error replies. */
    size_t len = m->len[m->frames - 1];
    const uint8_t *text = m->data[m->frames - 1];
    EXPECT(rep.dtype == TALLY_DTYPE_TEXT);
    EXPECT(rep.count == 0 && rep.aux0 == 0 && rep.aux1 == 0);
    EXPECT(len >= 1 && len <= TALLY_ERROR_MESSAGE_MAX);
    for (size_t i = 0; i < len; i++)
        EXPECT(text[i] >= 0x20 && text[i] < 0x7f);
}

static void send_frames(void *sock, int count, const void *const *data, const size_t *lens)
{
    for (int i = 0; i < count; i++)
        assert_int_equal(zmq_send(sock, data[i], lens[i], i + 1 < count ? ZMQ_SNDMORE : 0),
                         (int)lens[i]);
}

/* Sends a ping; reads replies until its own, counting (and checking as w says) the others. */
static int others_until_ping(const want_t *w)
{
    uint64_t ping_id = next_ping++;
    tally_req_t ping = th_req(TALLY_OP_PING, TALLY_DTYPE_NONE, ping_id);
    assert_int_equal(th_send_request(sock_m, &ping, NULL, 0), 0);
    int others = 0;
    for (;;) {
        msg_t m;
        if (recv_msg(sock_m, &m) != 0)
            fail_msg("%s: no reply within 5 s (%d before the ping's)", w->what, others);
        tally_rep_t rep;
        bool is_ping = m.frames == 2 && tally_rep_decode(m.data[0], m.len[0], &rep) == TALLY_OK &&
                       rep.request_id == ping_id && rep.opcode == TALLY_OP_PING;
        if (is_ping) {
            EXPECT(rep.status == TALLY_OK);
            msg_free(&m);
            return others;
        }
        others++;
        check_reply(&m, w);
        msg_free(&m);
    }
}

/* Sends the frames, then pings until the one reply has come, for up to 5 s (it may come after the
 * first ping's with shards: a request without a stream goes to the least loaded shard, and replies
 * of two shards may overtake each other, PROTOCOL.md §1), then asserts that exactly one other reply
 * came, shaped as w says (one more ping's round trip gives a second reply the time to show). */
static void exchange(int count, const void *const *data, const size_t *lens, const want_t *w)
{
    if (count > 0)
        send_frames(sock_m, count, data, lens);
    int others = 0;
    for (int64_t until = th_now_ms() + 5000; others == 0 && th_now_ms() < until;)
        others += others_until_ping(w);
    others += others_until_ping(w);
    if (others != 1)
        fail_msg("%s: %d replies, expected exactly one", w->what, others);
}

/* A two-frame request: header bytes (any length) and payload. */
static void exchange2(const void *header, size_t hlen, const void *payload, size_t plen,
                      const want_t *w)
{
    const void *data[2] = {header, payload ? payload : ""};
    size_t lens[2] = {hlen, plen};
    exchange(2, data, lens, w);
}

static void encode(const tally_req_t *req, uint8_t out[TALLY_REQ_HEADER_SIZE])
{
    tally_req_encode(req, out);
}

/* The reply a rejected, well-framed 128-byte header gets: its own fields echoed. */
static want_t rejected(const char *what, const tally_req_t *req, tally_status_t status)
{
    return (want_t){.what = what,
                    .status = status,
                    .id = req->request_id,
                    .opcode = req->opcode,
                    .flags = req->flags};
}

static uint64_t case_id = 0x1000;

static tally_req_t req_of(uint8_t opcode, uint8_t dtype)
{
    return th_req(opcode, dtype, case_id++);
}

static tally_req_t filter_gt(void)
{
    tally_req_t req = req_of(TALLY_OP_FILTER, TALLY_DTYPE_I32);
    req.pred = TALLY_PRED_GT;
    req.flags = TALLY_FLAG_FILTER_STABLE;
    return req;
}

/* ---- the corpus -------------------------------------------------------------------------- */

/* Header frames of 0..127 bytes and longer than 128, each followed by a payload frame. */
static void test_truncated_and_oversized_headers(void **state)
{
    (void)state;
    static uint8_t big[10240];
    tally_req_t req = filter_gt();
    encode(&req, big);
    memset(big + TALLY_REQ_HEADER_SIZE, 'x', sizeof big - TALLY_REQ_HEADER_SIZE);
    static const size_t longer[] = {129, 200, 4096, sizeof big};
    char what[64];
    for (size_t len = 0; len < TALLY_REQ_HEADER_SIZE + sizeof longer / sizeof longer[0]; len++) {
        size_t hlen = len < TALLY_REQ_HEADER_SIZE ? len : longer[len - TALLY_REQ_HEADER_SIZE];
        snprintf(what, sizeof what, "a %zu-byte header", hlen);
        want_t w = {.what = what, .status = TALLY_E_HEADER};
        if (hlen == 0) {
            /* §1: an empty first frame is a delimiter; the payload frame alone is 1 frame. */
            w.status = TALLY_E_FRAMES;
            w.delimiter = true;
        } else if (hlen >= 16) {
            w.id = req.request_id;
            w.opcode = req.opcode;
            w.flags = req.flags;
        }
        exchange2(big, hlen, "\x01\x00\x00\x00", 4, &w);
    }
}

/* Headers with a bad magic, version, opcode or dtype, or a reserved byte set. */
static void check_lying_codes(void)
{
    uint8_t h[TALLY_REQ_HEADER_SIZE];
    char what[96];
    for (int byte = 0; byte < 4; byte++) {
        tally_req_t req = filter_gt();
        encode(&req, h);
        h[byte] ^= 0x20;
        want_t w = rejected("bad magic", &req, TALLY_E_MAGIC);
        exchange2(h, sizeof h, NULL, 0, &w);
    }
    static const uint8_t versions[] = {0, 2, 255};
    for (size_t i = 0; i < sizeof versions; i++) {
        tally_req_t req = filter_gt();
        encode(&req, h);
        h[4] = versions[i];
        want_t w = rejected("bad version", &req, TALLY_E_VERSION);
        exchange2(h, sizeof h, NULL, 0, &w);
    }
    static const uint8_t opcodes[] = {0, 128, 255};
    for (size_t i = 0; i < sizeof opcodes; i++) {
        tally_req_t req = req_of(opcodes[i], TALLY_DTYPE_NONE);
        encode(&req, h);
        want_t w = rejected("unknown opcode", &req, TALLY_E_OPCODE);
        exchange2(h, sizeof h, NULL, 0, &w);
    }
    static const uint8_t dtypes[] = {TALLY_DTYPE_COUNT, 255};
    for (size_t i = 0; i < sizeof dtypes; i++) {
        tally_req_t req = filter_gt();
        req.dtype = dtypes[i];
        encode(&req, h);
        want_t w = rejected("unknown dtype", &req, TALLY_E_DTYPE);
        exchange2(h, sizeof h, NULL, 0, &w);
    }
    /* Reserved bytes 18..23 and 48..63, one at a time. */
    for (int byte = 18; byte < 64; byte++) {
        if (byte == 24)
            byte = 48;
        tally_req_t req = req_of(TALLY_OP_PING, TALLY_DTYPE_NONE);
        encode(&req, h);
        h[byte] = 0x01;
        snprintf(what, sizeof what, "reserved byte %d set", byte);
        want_t w = rejected(what, &req, TALLY_E_PARAM);
        exchange2(h, sizeof h, NULL, 0, &w);
    }
}

/* 128-byte headers whose fields lie or carry unknown codes. */
static void test_lying_headers(void **state)
{
    (void)state;
    uint8_t h[TALLY_REQ_HEADER_SIZE];
    check_lying_codes();
    /* stream_len against the name bytes. */
    static const struct {
        const char *what;
        uint8_t stream_len;
        const char *name; /* written at byte 64 */
        size_t name_len;
    } names[] = {
        {"stream_len 10, 4-byte name", 10, "cam0", 4},
        {"stream_len 64, 4-byte name", 64, "cam0", 4},
        {"stream_len 65", 65, "cam0", 4},
        {"stream_len 255", 255, "cam0", 4},
        {"stream_len 0, a name", 0, "cam0", 4},
        {"stream_len 4, 5-byte name", 4, "cam0X", 5},
        {"a name of NUL bytes", 4, "\0\0\0\0", 4},
        {"a NUL inside the name", 4, "ca\0m", 4},
        {"a space in the name", 4, "ca m", 4},
        {"a 0xff byte in the name", 4, "ca\xffm", 4},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        tally_req_t req = req_of(TALLY_OP_QUERY, TALLY_DTYPE_NONE);
        encode(&req, h);
        h[17] = names[i].stream_len;
        memcpy(h + 64, names[i].name, names[i].name_len);
        want_t w = rejected(names[i].what, &req, TALLY_E_STREAM_NAME);
        exchange2(h, sizeof h, NULL, 0, &w);
    }
    /* stream_len 255 with all 64 name bytes printable: still too long. */
    {
        tally_req_t req = req_of(TALLY_OP_HIST, TALLY_DTYPE_U8);
        encode(&req, h);
        h[17] = 255;
        memset(h + 64, 'n', 64);
        want_t w = rejected("stream_len 255, 64 name bytes", &req, TALLY_E_STREAM_NAME);
        exchange2(h, sizeof h, "abc", 3, &w);
    }
}

/* Valid framing, fields against the operation's rules (§5). */
static const struct {
    const char *what;
    uint8_t opcode, dtype, pred, flags;
    int64_t lo, hi;
    tally_status_t status;
} bad_field_cases[] = {
    {"filter pred 0", TALLY_OP_FILTER, TALLY_DTYPE_I32, 0, 0, 0, 0, TALLY_E_PARAM},
    {"filter pred 8", TALLY_OP_FILTER, TALLY_DTYPE_I32, 8, 0, 0, 0, TALLY_E_PARAM},
    {"filter pred 255", TALLY_OP_FILTER, TALLY_DTYPE_U8, 255, 0, 0, 0, TALLY_E_PARAM},
    {"filter gt with hi", TALLY_OP_FILTER, TALLY_DTYPE_I32, TALLY_PRED_GT, 0, 0, 1, TALLY_E_PARAM},
    {"filter ne with hi", TALLY_OP_FILTER, TALLY_DTYPE_U8, TALLY_PRED_NE, 0, 5, -1, TALLY_E_PARAM},
    {"filter between lo > hi", TALLY_OP_FILTER, TALLY_DTYPE_I32, TALLY_PRED_BETWEEN, 0, 2, 1,
     TALLY_E_PARAM},
    {"filter flags 0x01", TALLY_OP_FILTER, TALLY_DTYPE_I32, TALLY_PRED_GT, 0x01, 0, 0,
     TALLY_E_PARAM},
    {"filter flags 0x40", TALLY_OP_FILTER, TALLY_DTYPE_I32, TALLY_PRED_GT, 0x40, 0, 0,
     TALLY_E_PARAM},
    {"filter dtype i64", TALLY_OP_FILTER, TALLY_DTYPE_I64, TALLY_PRED_GT, 0, 0, 0, TALLY_E_DTYPE},
    {"scan u8", TALLY_OP_SCAN, TALLY_DTYPE_U8, 0, 0, 0, 0, TALLY_E_DTYPE},
    {"scan pred 1", TALLY_OP_SCAN, TALLY_DTYPE_I32, 1, 0, 0, 0, TALLY_E_PARAM},
    {"scan flags 0x04", TALLY_OP_SCAN, TALLY_DTYPE_I32, 0, 0x04, 0, 0, TALLY_E_PARAM},
    {"scan lo 1", TALLY_OP_SCAN, TALLY_DTYPE_I32, 0, 0, 1, 0, TALLY_E_PARAM},
    {"hist u8 hi 1", TALLY_OP_HIST, TALLY_DTYPE_U8, 0, 0, 0, 1, TALLY_E_PARAM},
    {"hist i32 lo == hi", TALLY_OP_HIST, TALLY_DTYPE_I32, 0, 0, 5, 5, TALLY_E_PARAM},
    {"hist i32 hi 2^31 + 1", TALLY_OP_HIST, TALLY_DTYPE_I32, 0, 0, 0, 2147483649LL, TALLY_E_PARAM},
    {"hist i32 lo INT64_MIN", TALLY_OP_HIST, TALLY_DTYPE_I32, 0, 0, INT64_MIN, 0, TALLY_E_PARAM},
    {"hist text", TALLY_OP_HIST, TALLY_DTYPE_TEXT, 0, 0, 0, 0, TALLY_E_DTYPE},
    {"ping dtype i32", TALLY_OP_PING, TALLY_DTYPE_I32, 0, 0, 0, 0, TALLY_E_DTYPE},
    {"ping flags 0x01", TALLY_OP_PING, TALLY_DTYPE_NONE, 0, 0x01, 0, 0, TALLY_E_PARAM},
    {"info lo -1", TALLY_OP_INFO, TALLY_DTYPE_NONE, 0, 0, -1, 0, TALLY_E_PARAM},
    {"query without a stream", TALLY_OP_QUERY, TALLY_DTYPE_NONE, 0, 0, 0, 0, TALLY_E_STREAM_NAME},
    {"reset without a stream", TALLY_OP_RESET, TALLY_DTYPE_NONE, 0, 0, 0, 0, TALLY_E_STREAM_NAME},
    /* issue 12: delete, u16 ranges, colour parameters, window queries, reserved flags */
    {"delete without a stream", TALLY_OP_DELETE, TALLY_DTYPE_NONE, 0, 0, 0, 0, TALLY_E_STREAM_NAME},
    {"delete dtype u16", TALLY_OP_DELETE, TALLY_DTYPE_U16, 0, 0, 0, 0, TALLY_E_DTYPE},
    {"hist u16 hi 65537", TALLY_OP_HIST, TALLY_DTYPE_U16, 0, 0, 0, 65537, TALLY_E_PARAM},
    {"hist u16 lo -1", TALLY_OP_HIST, TALLY_DTYPE_U16, 0, 0, -1, 100, TALLY_E_PARAM},
    {"hist rgb8 hi 1", TALLY_OP_HIST, TALLY_DTYPE_RGB8, 0, 0, 0, 1, TALLY_E_PARAM},
    {"hist rgba8 pred 1", TALLY_OP_HIST, TALLY_DTYPE_RGBA8, 1, 0, 0, 0, TALLY_E_PARAM},
    {"filter u16", TALLY_OP_FILTER, TALLY_DTYPE_U16, TALLY_PRED_GT, 0, 0, 0, TALLY_E_DTYPE},
    {"scan rgb8", TALLY_OP_SCAN, TALLY_DTYPE_RGB8, 0, 0, 0, 0, TALLY_E_DTYPE},
    {"query lo without the window flag", TALLY_OP_QUERY, TALLY_DTYPE_NONE, 0, 0, 1000, 0,
     TALLY_E_PARAM},
    {"query window of 0 ms", TALLY_OP_QUERY, TALLY_DTYPE_NONE, 0, TALLY_FLAG_QUERY_WINDOW, 0, 0,
     TALLY_E_PARAM},
    {"query window over 2^32 ms", TALLY_OP_QUERY, TALLY_DTYPE_NONE, 0, TALLY_FLAG_QUERY_WINDOW,
     1LL << 32, 0, TALLY_E_PARAM},
    {"reset with the window flag", TALLY_OP_RESET, TALLY_DTYPE_NONE, 0, TALLY_FLAG_QUERY_WINDOW, 0,
     0, TALLY_E_PARAM},
    {"hist u8 flags 0x10 (reserved)", TALLY_OP_HIST, TALLY_DTYPE_U8, 0, 0x10, 0, 0, TALLY_E_PARAM},
};

static void test_bad_fields(void **state)
{
    (void)state;
    uint8_t h[TALLY_REQ_HEADER_SIZE];
    for (size_t i = 0; i < sizeof bad_field_cases / sizeof bad_field_cases[0]; i++) {
        tally_req_t req = req_of(bad_field_cases[i].opcode, bad_field_cases[i].dtype);
        req.pred = bad_field_cases[i].pred;
        req.flags = bad_field_cases[i].flags;
        req.lo = bad_field_cases[i].lo;
        req.hi = bad_field_cases[i].hi;
        encode(&req, h);
        want_t w = rejected(bad_field_cases[i].what, &req, bad_field_cases[i].status);
        exchange2(h, sizeof h, NULL, 0, &w);
    }
    /* A stream given to an operation without streams. */
    tally_req_t req = req_of(TALLY_OP_STATS, TALLY_DTYPE_NONE);
    assert_int_equal(tally_req_set_stream(&req, "cam0"), TALLY_OK);
    encode(&req, h);
    want_t w = rejected("stats with a stream", &req, TALLY_E_STREAM_NAME);
    exchange2(h, sizeof h, NULL, 0, &w);
}

/* Payloads over max_batch, not whole elements, or sent to operations without payload. */
static void test_bad_payloads(void **state)
{
    (void)state;
    uint8_t h[TALLY_REQ_HEADER_SIZE];
    uint8_t *big = calloc(1, MAX_BATCH + 8);
    assert_non_null(big);
    char what[96];

    static const size_t over[] = {MAX_BATCH + 1, MAX_BATCH + 3, MAX_BATCH + 4};
    for (size_t i = 0; i < sizeof over / sizeof over[0]; i++) {
        tally_req_t req = req_of(TALLY_OP_SCAN, TALLY_DTYPE_I32);
        encode(&req, h);
        snprintf(what, sizeof what, "scan of %zu bytes", over[i]);
        want_t w = rejected(what, &req, TALLY_E_TOO_LARGE);
        exchange2(h, sizeof h, big, over[i], &w);
    }
    {
        tally_req_t req = req_of(TALLY_OP_PING, TALLY_DTYPE_NONE);
        encode(&req, h);
        want_t w = rejected("ping with a payload over max_batch", &req, TALLY_E_TOO_LARGE);
        exchange2(h, sizeof h, big, MAX_BATCH + 1, &w);
    }
    static const size_t ragged[] = {1, 2, 3, 5, 7, 4099};
    for (size_t i = 0; i < sizeof ragged / sizeof ragged[0]; i++) {
        tally_req_t req = i % 2 ? filter_gt() : req_of(TALLY_OP_SCAN, TALLY_DTYPE_I32);
        encode(&req, h);
        snprintf(what, sizeof what, "i32 payload of %zu bytes", ragged[i]);
        want_t w = rejected(what, &req, TALLY_E_PAYLOAD);
        exchange2(h, sizeof h, big, ragged[i], &w);
    }
    static const uint8_t no_payload[] = {TALLY_OP_PING,  TALLY_OP_INFO,  TALLY_OP_STREAMS,
                                         TALLY_OP_STATS, TALLY_OP_QUERY, TALLY_OP_RESET};
    static const size_t sizes[] = {1, 10240};
    for (size_t i = 0; i < sizeof no_payload; i++) {
        for (size_t k = 0; k < 2; k++) {
            tally_req_t req = req_of(no_payload[i], TALLY_DTYPE_NONE);
            if (no_payload[i] == TALLY_OP_QUERY || no_payload[i] == TALLY_OP_RESET)
                assert_int_equal(tally_req_set_stream(&req, "never-created"), TALLY_OK);
            encode(&req, h);
            snprintf(what, sizeof what, "%s with %zu payload bytes",
                     tally_op_name((tally_op_t)no_payload[i]), sizes[k]);
            /* query/reset of a stream that does not exist: the payload is judged first. */
            want_t w = rejected(what, &req, TALLY_E_PAYLOAD);
            exchange2(h, sizeof h, big, sizes[k], &w);
        }
    }
    free(big);
}

/* 0, 1, 3 and 50 request frames, and the empty-frame rule, from a DEALER. */
static void test_frame_counts(void **state)
{
    (void)state;
    tally_req_t req = filter_gt();
    uint8_t h[TALLY_REQ_HEADER_SIZE];
    encode(&req, h);
    const void *data[50];
    size_t lens[50];
    for (int i = 0; i < 50; i++) {
        data[i] = i == 0 ? (const void *)h : "frame";
        lens[i] = i == 0 ? sizeof h : 5;
    }
    want_t echo = rejected("", &req, TALLY_E_FRAMES);

    echo.what = "1 frame (the header)";
    exchange(1, data, lens, &echo);
    echo.what = "3 frames";
    exchange(3, data, lens, &echo);
    echo.what = "50 frames";
    exchange(50, data, lens, &echo);
    /* A first frame shorter than 16 bytes echoes nothing. */
    want_t none = {.what = "1 frame of 10 bytes", .status = TALLY_E_FRAMES};
    size_t ten = 10;
    exchange(1, (const void *[]){h}, &ten, &none);
    /* Wrong frame count wins over a wrong magic (§6), and the echo does not need the magic. */
    uint8_t bad_magic[TALLY_REQ_HEADER_SIZE];
    memcpy(bad_magic, h, sizeof h);
    bad_magic[0] = 'X';
    const void *three[3] = {bad_magic, "", "extra"};
    size_t three_lens[3] = {sizeof bad_magic, 0, 5};
    echo.what = "3 frames, bad magic";
    exchange(3, three, three_lens, &echo);

    /* §1: an empty first frame is a delimiter, from a DEALER too. */
    const void *empty_only[1] = {""};
    size_t zero = 0;
    want_t w = {.what = "[empty]: 0 request frames", .status = TALLY_E_FRAMES, .delimiter = true};
    exchange(1, empty_only, &zero, &w);
    const void *empties[50];
    size_t empty_lens[50] = {0};
    for (int i = 0; i < 50; i++)
        empties[i] = "";
    w.what = "50 empty frames";
    exchange(50, empties, empty_lens, &w);
    w.what = "[empty][empty][payload]: a 0-byte header";
    w.status = TALLY_E_HEADER;
    exchange(3, empties, empty_lens, &w);

    tally_req_t ping = req_of(TALLY_OP_PING, TALLY_DTYPE_NONE);
    uint8_t ph[TALLY_REQ_HEADER_SIZE];
    encode(&ping, ph);
    const void *req_style[3] = {"", ph, ""};
    size_t req_lens[3] = {0, sizeof ph, 0};
    w = rejected("[empty][header][payload] ping", &ping, TALLY_OK);
    w.delimiter = true;
    exchange(3, req_style, req_lens, &w);
    const void *req_style_bad[4] = {"", ph, "", "x"};
    size_t req_bad_lens[4] = {0, sizeof ph, 0, 1};
    w = rejected("[empty][header][payload][x]", &ping, TALLY_E_FRAMES);
    w.delimiter = true;
    exchange(4, req_style_bad, req_bad_lens, &w);
}

/* The examples of §6 that need a daemon: frames, payload against stream state. */
static void test_validation_order_daemon(void **state)
{
    (void)state;
    uint8_t h[TALLY_REQ_HEADER_SIZE];
    uint8_t *big = calloc(1, MAX_BATCH + 8);
    assert_non_null(big);

    tally_req_t req = req_of(TALLY_OP_QUERY, TALLY_DTYPE_NONE);
    assert_int_equal(tally_req_set_stream(&req, "no-such-stream"), TALLY_OK);
    encode(&req, h);
    want_t w = rejected("query unknown stream, 1-byte payload", &req, TALLY_E_PAYLOAD);
    exchange2(h, sizeof h, "x", 1, &w);
    w = rejected("query unknown stream", &req, TALLY_E_UNKNOWN_STREAM);
    exchange2(h, sizeof h, NULL, 0, &w);

    req = req_of(TALLY_OP_PING, TALLY_DTYPE_NONE);
    assert_int_equal(tally_req_set_stream(&req, "cam0"), TALLY_OK);
    encode(&req, h);
    w = rejected("ping with a stream and a payload", &req, TALLY_E_STREAM_NAME);
    exchange2(h, sizeof h, "x", 1, &w);

    req = req_of(TALLY_OP_SCAN, TALLY_DTYPE_U8);
    encode(&req, h);
    w = rejected("scan u8, payload over max_batch", &req, TALLY_E_DTYPE);
    exchange2(h, sizeof h, big, MAX_BATCH + 1, &w);

    req = filter_gt();
    req.hi = 1;
    encode(&req, h);
    w = rejected("filter gt with hi, 7-byte payload", &req, TALLY_E_PARAM);
    exchange2(h, sizeof h, big, 7, &w);

    req = req_of(TALLY_OP_SCAN, TALLY_DTYPE_I32);
    encode(&req, h);
    w = rejected("scan over max_batch, not whole i32", &req, TALLY_E_TOO_LARGE);
    exchange2(h, sizeof h, big, MAX_BATCH + 3, &w);

    /* A short header with a bad magic and the wrong frame count: frames first. */
    size_t ten = 10;
    w = (want_t){.what = "1 frame, 10-byte header", .status = TALLY_E_FRAMES};
    exchange(1, (const void *[]){"XXXXXXXXXX"}, &ten, &w);
    /* A 127-byte header with a bad magic: length first. */
    req = filter_gt();
    encode(&req, h);
    h[0] = 'X';
    w = rejected("127 bytes, bad magic", &req, TALLY_E_HEADER);
    exchange2(h, 127, NULL, 0, &w);
    free(big);
}

/* ---- still serving, and the reply shapes a client relies on ----------------------------- */

static void call_ok(void *sock, const tally_req_t *req, const void *payload, size_t len,
                    th_reply_t *reply)
{
    assert_int_equal(th_call(sock, req, payload, len, reply), 0);
    assert_int_equal(reply->rep.status, TALLY_OK);
    assert_int_equal(reply->rep.request_id, req->request_id);
}

/* After the corpus (cmocka runs the tests in order), real requests still get right answers,
 * on the connection that sent it and on a fresh one; `count` as §3 defines it. */
static void test_serving_after_corpus(void **state)
{
    (void)state;
    void *fresh = th_connect(daemon_m.endpoint, 5000);
    void *socks[2] = {sock_m, fresh};
    static const int32_t in[10] = {3, -1, 0, 7, 2, -5, 9, 0, 1, 4};
    static const int32_t kept[6] = {3, 7, 2, 9, 1, 4};
    for (int s = 0; s < 2; s++) {
        th_reply_t r;
        tally_req_t ping = req_of(TALLY_OP_PING, TALLY_DTYPE_NONE);
        call_ok(socks[s], &ping, NULL, 0, &r);
        assert_int_equal(r.rep.count, 0);
        assert_int_equal(r.len, 0);
        th_reply_free(&r);

        tally_req_t f = filter_gt();
        call_ok(socks[s], &f, in, sizeof in, &r);
        assert_int_equal(r.rep.count, 6);
        assert_int_equal(r.rep.aux0, 10);
        assert_int_equal(r.len, sizeof kept);
        assert_memory_equal(r.payload, kept, sizeof kept);
        th_reply_free(&r);

        tally_req_t scan = req_of(TALLY_OP_SCAN, TALLY_DTYPE_I32);
        assert_int_equal(tally_req_set_stream(&scan, "after-corpus"), TALLY_OK);
        call_ok(socks[s], &scan, in, sizeof in, &r);
        assert_int_equal(r.rep.count, 10);
        assert_int_equal(r.rep.dtype, TALLY_DTYPE_I64);
        assert_int_equal(r.len, 10 * 8);
        assert_int_equal((int64_t)r.rep.aux0, s == 0 ? 20 : 40); /* the carry goes on */
        th_reply_free(&r);

        tally_req_t hist = req_of(TALLY_OP_HIST, TALLY_DTYPE_I32);
        hist.lo = -4;
        hist.hi = 4;
        call_ok(socks[s], &hist, in, sizeof in, &r);
        assert_int_equal(r.rep.count, TALLY_HIST_I32_VALUES);
        assert_int_equal(r.len, 8 * TALLY_HIST_I32_VALUES);
        assert_int_equal(r.rep.aux0, 10);
        th_reply_free(&r);

        /* query: count 1 is one record of 2176 bytes. */
        tally_req_t query = req_of(TALLY_OP_QUERY, TALLY_DTYPE_NONE);
        assert_int_equal(tally_req_set_stream(&query, "after-corpus"), TALLY_OK);
        call_ok(socks[s], &query, NULL, 0, &r);
        assert_int_equal(r.rep.count, 1);
        assert_int_equal(r.rep.aux0, 0);
        assert_int_equal(r.len, TALLY_QUERY_PAYLOAD_SIZE);
        tally_stream_info_t info;
        assert_int_equal(tally_stream_info_decode(r.payload, r.len, &info), TALLY_OK);
        assert_int_equal(info.batches, (uint64_t)s + 1);
        assert_int_equal(info.scan_carry, s == 0 ? 20 : 40);
        th_reply_free(&r);

        tally_req_t streams = req_of(TALLY_OP_STREAMS, TALLY_DTYPE_NONE);
        call_ok(socks[s], &streams, NULL, 0, &r);
        assert_int_equal(r.rep.count, 1); /* the corpus created no stream */
        assert_int_equal(r.len, 1 + strlen("after-corpus"));
        th_reply_free(&r);

        tally_req_t stats = req_of(TALLY_OP_STATS, TALLY_DTYPE_NONE);
        call_ok(socks[s], &stats, NULL, 0, &r);
        assert_int_equal(r.rep.count, r.len);
        th_reply_free(&r);
    }
    th_close(fresh);
}

static bool is_decimal(const char *v, size_t len)
{
    if (len == 0 || len > 20 || (len > 1 && v[0] == '0'))
        return false;
    for (size_t i = 0; i < len; i++)
        if (v[i] < '0' || v[i] > '9')
            return false;
    return true;
}

/* §5 info: key=value lines, the eight keys first in a fixed order, the value formats. */
static void test_info_keys_and_formats(void **state)
{
    (void)state;
    static const char *const keys[] = {"version", "protocol",  "backend",      "backends",
                                       "devices", "max_batch", "max_inflight", "max_streams"};
    th_reply_t r;
    tally_req_t req = req_of(TALLY_OP_INFO, TALLY_DTYPE_NONE);
    call_ok(sock_m, &req, NULL, 0, &r);
    assert_int_equal(r.rep.dtype, TALLY_DTYPE_TEXT);
    assert_int_equal(r.rep.count, r.len);
    assert_true(r.len > 0 && r.payload[r.len - 1] == '\n');
    const char *p = (const char *)r.payload;
    const char *end = p + r.len;
    size_t line = 0;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        assert_non_null(nl);
        const char *eq = memchr(p, '=', (size_t)(nl - p));
        assert_non_null(eq); /* no blank lines, every line key=value */
        size_t klen = (size_t)(eq - p);
        assert_true(klen > 0);
        for (size_t i = 0; i < klen; i++)
            assert_true((p[i] >= 'a' && p[i] <= 'z') || (p[i] >= '0' && p[i] <= '9') ||
                        p[i] == '_');
        const char *v = eq + 1;
        size_t vlen = (size_t)(nl - v);
        if (line < sizeof keys / sizeof keys[0]) {
            if (klen != strlen(keys[line]) || memcmp(p, keys[line], klen) != 0)
                fail_msg("info line %zu is '%.*s', expected key %s", line, (int)klen, p,
                         keys[line]);
        }
        switch (line) {
        case 0: { /* MAJOR.MINOR.PATCH */
            unsigned a, b, c;
            char tail;
            char buf[64];
            assert_true(vlen < sizeof buf);
            memcpy(buf, v, vlen);
            buf[vlen] = '\0';
            assert_int_equal(sscanf(buf, "%u.%u.%u%c", &a, &b, &c, &tail), 3);
            break;
        }
        case 1:
            assert_true(vlen == 1 && v[0] == '1');
            break;
        case 2:
            assert_true((vlen == 3 && memcmp(v, "cpu", 3) == 0) ||
                        (vlen == 4 && memcmp(v, "cuda", 4) == 0) ||
                        (vlen == 3 && memcmp(v, "sim", 3) == 0));
            break;
        case 3:
            assert_true(vlen >= 3 && memcmp(v, "cpu", 3) == 0 && !memchr(v, ' ', vlen));
            break;
        case 4:
            assert_true(vlen > 0);
            break;
        case 5:
            assert_true(vlen == 5 && memcmp(v, "65536", 5) == 0);
            break;
        case 6:
        case 7:
            assert_true(is_decimal(v, vlen));
            break;
        default:
            break; /* later keys: only the line shape is fixed */
        }
        line++;
        p = nl + 1;
    }
    assert_true(line >= sizeof keys / sizeof keys[0]);
    th_reply_free(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_truncated_and_oversized_headers, reconnect),
        cmocka_unit_test_setup(test_lying_headers, reconnect),
        cmocka_unit_test_setup(test_bad_fields, reconnect),
        cmocka_unit_test_setup(test_bad_payloads, reconnect),
        cmocka_unit_test_setup(test_frame_counts, reconnect),
        cmocka_unit_test_setup(test_validation_order_daemon, reconnect),
        cmocka_unit_test_setup(test_serving_after_corpus, reconnect),
        cmocka_unit_test_setup(test_info_keys_and_formats, reconnect),
    };
    return cmocka_run_group_tests_name("malformed", tests, group_setup, group_teardown);
}
