/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_analyst.c — issue 12's daemon features against a real tallyd (CPU build; the GPU paths
 * of the new histograms are in test_differential and test_cuda_backend):
 *
 *   - windows: a test clock file (--test-clock) moves time; window queries of 1 ms .. 4 s over a
 *     4 x 1 s ring count exactly the batches of their intervals, with the window's start and end
 *     in aux0/aux1; longer windows get bad_window; the ring survives a restart (state file v3);
 *     reset empties it and keeps the stream's type; windows off answer bad_window;
 *   - u16, rgb8 and rgba8 histograms end to end, with their reply and record layouts;
 *   - subscriptions: a SUB socket decodes the PUB messages (topic, header, record) and compares
 *     them with `query`; prefix filtering, nothing for unchanged streams, reset and delete;
 *   - metrics and health: per-stream series with their cardinality bound and label escaping,
 *     tallyd_build_info, process_*, GET /healthz 200, 503 "draining" after SIGTERM while a
 *     request runs, 503 "gpu lost" once a (simulated) GPU is marked unusable.
 */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include <cmocka.h>

#include "harness.h"

#define T0 1795000000500ull /* the clock: half way into an interval */

static uint64_t next_id = 1;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void clock_write(const char *path, uint64_t ms)
{
    assert_int_equal(th_write_clock(path, ms), 0);
}

/* A hist on stream of dtype over [lo, hi) (ranged dtypes), expecting ok. */
static void hist(void *sock, const char *stream, uint8_t dtype, int64_t lo, int64_t hi,
                 const void *data, size_t len)
{
    tally_req_t q = th_req(TALLY_OP_HIST, dtype, next_id++);
    q.lo = lo;
    q.hi = hi;
    assert_int_equal(tally_req_set_stream(&q, stream), TALLY_OK);
    th_reply_t r;
    assert_int_equal(th_call(sock, &q, data, len, &r), 0);
    if (r.rep.status != TALLY_OK)
        fail_msg("hist on %s: %s", stream, (char *)r.payload);
    assert_int_equal(r.rep.count, tally_hist_values(dtype));
    assert_int_equal(r.len, 8 * tally_hist_values(dtype));
    th_reply_free(&r);
}

static void u8_batch(void *sock, const char *stream, uint8_t value, size_t n)
{
    uint8_t buf[256];
    assert_true(n <= sizeof buf);
    memset(buf, value, n);
    hist(sock, stream, TALLY_DTYPE_U8, 0, 0, buf, n);
}

/* A query (window_ms 0: all time); status returned, the record and aux0/aux1 filled on ok. */
static uint32_t query(void *sock, const char *stream, int64_t window_ms, tally_stream_info_t *info,
                      uint64_t *aux0, uint64_t *aux1)
{
    tally_req_t q = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, next_id++);
    if (window_ms) {
        q.flags = TALLY_FLAG_QUERY_WINDOW;
        q.lo = window_ms;
    }
    assert_int_equal(tally_req_set_stream(&q, stream), TALLY_OK);
    th_reply_t r;
    assert_int_equal(th_call(sock, &q, NULL, 0, &r), 0);
    uint32_t status = r.rep.status;
    if (status == TALLY_OK) {
        assert_int_equal(tally_stream_info_decode(r.payload, r.len, info), TALLY_OK);
        assert_int_equal(r.rep.count, 1);
        if (aux0)
            *aux0 = r.rep.aux0;
        if (aux1)
            *aux1 = r.rep.aux1;
    } else if (status == TALLY_E_WINDOW) {
        const char *why = (const char *)r.payload;
        assert_true(strstr(why, "keeps 4") || strstr(why, "windows are off"));
    }
    th_reply_free(&r);
    return status;
}

static uint64_t window_total(void *sock, const char *stream, int64_t window_ms, uint64_t want_start,
                             uint64_t want_end)
{
    static tally_stream_info_t info;
    uint64_t start = 0, end = 0;
    assert_int_equal(query(sock, stream, window_ms, &info, &start, &end), TALLY_OK);
    if (start != want_start || end != want_end)
        fail_msg("window %lld ms: [%llu, %llu], want [%llu, %llu]", (long long)window_ms,
                 (unsigned long long)start, (unsigned long long)end, (unsigned long long)want_start,
                 (unsigned long long)want_end);
    uint64_t sum = info.hist_underflow + info.hist_overflow;
    for (int b = 0; b < TALLY_HIST_BINS; b++)
        sum += info.bins[b];
    assert_true(sum == info.hist_total); /* the window's bins and total agree */
    return info.hist_total;
}

static void control(void *sock, uint8_t opcode, const char *stream, uint32_t want)
{
    tally_req_t q = th_req(opcode, TALLY_DTYPE_NONE, next_id++);
    assert_int_equal(tally_req_set_stream(&q, stream), TALLY_OK);
    assert_int_equal(th_call_status(sock, &q, NULL, 0), want);
}

/* ---- windows ---------------------------------------------------------------------------- */

/* Three batches an interval apart on stream "w" (clock at T0), then windows of 1 ms to 4 s
 * over them, too long ones refused, all time; two seconds later the first two have left. */
static void check_windows_over_time(void *sock, const char *clock, uint64_t i0)
{
    u8_batch(sock, "w", 1, 10); /* interval i0 */
    clock_write(clock, T0 + 1000);
    u8_batch(sock, "w", 2, 20); /* i0 + 1 s */
    clock_write(clock, T0 + 2000);
    u8_batch(sock, "w", 3, 30); /* i0 + 2 s */

    assert_int_equal(window_total(sock, "w", 1, i0 + 2000, T0 + 2000), 30);
    assert_int_equal(window_total(sock, "w", 1000, i0 + 2000, T0 + 2000), 30);
    assert_int_equal(window_total(sock, "w", 1001, i0 + 1000, T0 + 2000), 50);
    assert_int_equal(window_total(sock, "w", 4000, i0 - 1000, T0 + 2000), 60);
    tally_stream_info_t info;
    assert_int_equal(query(sock, "w", 4001, &info, NULL, NULL), TALLY_E_WINDOW);
    assert_int_equal(query(sock, "w", 60000, &info, NULL, NULL), TALLY_E_WINDOW);
    assert_int_equal(query(sock, "nobody", 1000, &info, NULL, NULL), TALLY_E_UNKNOWN_STREAM);
    uint64_t a0 = 1, a1 = 1;
    assert_int_equal(query(sock, "w", 0, &info, &a0, &a1), TALLY_OK); /* all time */
    assert_true(info.hist_total == 60 && info.bins[1] == 10 && info.bins[2] == 20);
    assert_true(a0 == 0 && a1 == 0);
    assert_int_equal(query(sock, "w", 2000, &info, NULL, NULL), TALLY_OK);
    assert_true(info.bins[1] == 0 && info.bins[2] == 20 && info.bins[3] == 30);
    assert_true(info.batches == 3); /* the other fields are the stream's */

    /* Two seconds later the first two intervals have left a 4 s window... */
    clock_write(clock, T0 + 4000);
    assert_int_equal(window_total(sock, "w", 4000, i0 + 1000, T0 + 4000), 50);
    assert_int_equal(window_total(sock, "w", 1000, i0 + 4000, T0 + 4000), 0);
}

/* After the restart (clock at T0 + 4 s): the ring kept, a stream without a histogram has an
 * empty window, reset empties the ring and keeps the stream, delete removes it. */
static void check_windows_after_restart(void *sock, uint64_t i0)
{
    tally_stream_info_t info;
    assert_int_equal(window_total(sock, "w", 4000, i0 + 1000, T0 + 4000), 50);
    assert_int_equal(window_total(sock, "w", 2000, i0 + 3000, T0 + 4000), 0);
    assert_int_equal(query(sock, "w", 0, &info, NULL, NULL), TALLY_OK);
    assert_int_equal(info.hist_total, 60);

    /* A stream without a histogram yet: an empty window. */
    int32_t x[3] = {1, 2, 3};
    tally_req_t scan = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, next_id++);
    assert_int_equal(tally_req_set_stream(&scan, "scans"), TALLY_OK);
    th_reply_t r;
    assert_int_equal(th_call(sock, &scan, x, sizeof x, &r), 0);
    th_reply_free(&r);
    assert_int_equal(window_total(sock, "scans", 3000, i0 + 2000, T0 + 4000), 0);

    /* reset: zeroed, kept (its type too), the ring empty; delete: gone. */
    u8_batch(sock, "w", 9, 5);
    control(sock, TALLY_OP_RESET, "w", TALLY_OK);
    assert_int_equal(window_total(sock, "w", 4000, i0 + 1000, T0 + 4000), 0);
    assert_int_equal(query(sock, "w", 0, &info, NULL, NULL), TALLY_OK);
    assert_true(info.hist_total == 0 && info.batches == 0 && info.hist_dtype == TALLY_DTYPE_U8);
    u8_batch(sock, "w", 4, 7);
    assert_int_equal(window_total(sock, "w", 1000, i0 + 4000, T0 + 4000), 7);
    control(sock, TALLY_OP_DELETE, "w", TALLY_OK);
    assert_int_equal(query(sock, "w", 1000, &info, NULL, NULL), TALLY_E_UNKNOWN_STREAM);
    control(sock, TALLY_OP_DELETE, "w", TALLY_E_UNKNOWN_STREAM);
    control(sock, TALLY_OP_RESET, "w", TALLY_E_UNKNOWN_STREAM);
}

/* Windows off: a window query is refused, and info says so. */
static void check_windows_off(void)
{
    const char *off[] = {"--window-intervals", "0", NULL};
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, off), 0);
    void *sock = th_connect(d.endpoint, 10000);
    u8_batch(sock, "w", 1, 3);
    tally_stream_info_t info;
    assert_int_equal(query(sock, "w", 1000, &info, NULL, NULL), TALLY_E_WINDOW);
    tally_req_t inf = th_req(TALLY_OP_INFO, TALLY_DTYPE_NONE, next_id++);
    th_reply_t r;
    assert_int_equal(th_call(sock, &inf, NULL, 0, &r), 0);
    assert_non_null(strstr((char *)r.payload, "\nwindow_intervals=0\nwindow_interval_ms=1000\n"));
    assert_non_null(strstr((char *)r.payload, "\npub=\npub_interval_ms=1000\n"));
    th_reply_free(&r);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

static void test_window_queries(void **state)
{
    (void)state;
    char clock[128], dir[] = "/tmp/tallyd-analyst-XXXXXX";
    assert_non_null(mkdtemp(dir));
    snprintf(clock, sizeof clock, "%s/clock", dir);
    clock_write(clock, T0);
    const char *args[] = {"--test-clock",
                          clock,
                          "--window-intervals",
                          "4",
                          "--window-interval-ms",
                          "1000",
                          "--state-dir",
                          dir,
                          NULL};
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, args), 0);
    void *sock = th_connect(d.endpoint, 10000);
    const uint64_t i0 = T0 / 1000 * 1000; /* the start of T0's interval */
    check_windows_over_time(sock, clock, i0);

    /* ...and a restart keeps the ring (state file v3). */
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
    assert_int_equal(th_daemon_start(&d, args), 0);
    sock = th_connect(d.endpoint, 10000);
    check_windows_after_restart(sock, i0);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);

    check_windows_off();
    assert_int_equal(th_rmrf(dir), 0);
}

/* ---- 16-bit and colour ------------------------------------------------------------------ */

static void test_u16_rgb_streams(void **state)
{
    (void)state;
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, NULL), 0);
    void *sock = th_connect(d.endpoint, 10000);
    /* 12-bit values over [0, 4096): 16 values per bin; under/overflow with [16, 4096). */
    uint16_t v[6] = {0, 15, 16, 4095, 4096, 65535};
    tally_req_t q = th_req(TALLY_OP_HIST, TALLY_DTYPE_U16, next_id++);
    q.lo = 16;
    q.hi = 4096;
    assert_int_equal(tally_req_set_stream(&q, "sensor12"), TALLY_OK);
    th_reply_t r;
    assert_int_equal(th_call_reply_status(sock, &q, v, sizeof v, &r), TALLY_OK);
    assert_int_equal(r.rep.count, 258);
    assert_int_equal(r.rep.aux0, 6);
    assert_int_equal(tally_get_u64(r.payload + 8 * 0), 1);   /* 16 */
    assert_int_equal(tally_get_u64(r.payload + 8 * 255), 1); /* 4095 */
    assert_int_equal(tally_get_u64(r.payload + 8 * 256), 2); /* under: 0, 15 */
    assert_int_equal(tally_get_u64(r.payload + 8 * 257), 2); /* over: 4096, 65535 */
    th_reply_free(&r);
    q.hi = 65536; /* another range: the stream keeps its first */
    q.request_id = next_id++;
    assert_int_equal(th_call_status(sock, &q, v, sizeof v), TALLY_E_STREAM_STATE);
    q.request_id = next_id++;
    assert_int_equal(th_call(sock, &q, v, 5, &r), 0); /* half an element */
    assert_int_equal(r.rep.status, TALLY_E_PAYLOAD);
    th_reply_free(&r);
    static tally_stream_info_t info;
    assert_int_equal(query(sock, "sensor12", 0, &info, NULL, NULL), TALLY_OK);
    assert_true(info.hist_dtype == TALLY_DTYPE_U16 && info.hist_lo == 16 && info.hist_hi == 4096);
    assert_true(info.hist_underflow == 2 && info.hist_overflow == 2 && info.hist_total == 6);

    /* Colour: one histogram per channel, 3 or 4; records of 6272 and 8320 bytes. */
    for (int channels = 3; channels <= 4; channels++) {
        uint8_t px[4 * 5];
        for (int i = 0; i < 5; i++)
            for (int c = 0; c < channels; c++)
                px[channels * i + c] = (uint8_t)(10 * c + (i == 4)); /* pixel 4: +1 */
        const char *name = channels == 3 ? "cam/rgb" : "cam/rgba";
        uint8_t dt = channels == 3 ? TALLY_DTYPE_RGB8 : TALLY_DTYPE_RGBA8;
        tally_req_t c = th_req(TALLY_OP_HIST, dt, next_id++);
        assert_int_equal(tally_req_set_stream(&c, name), TALLY_OK);
        assert_int_equal(th_call_reply_status(sock, &c, px, 5 * (size_t)channels, &r), TALLY_OK);
        assert_int_equal(r.rep.count, 256 * channels);
        assert_int_equal(r.rep.aux0, 5);
        for (int ch = 0; ch < channels; ch++) {
            assert_int_equal(tally_get_u64(r.payload + 8 * (256 * ch + 10 * ch)), 4);
            assert_int_equal(tally_get_u64(r.payload + 8 * (256 * ch + 10 * ch + 1)), 1);
        }
        th_reply_free(&r);
        c.request_id = next_id++;
        assert_int_equal(th_call(sock, &c, px, 5 * (size_t)channels - 1, &r), 0);
        assert_int_equal(r.rep.status, TALLY_E_PAYLOAD); /* not whole pixels */
        th_reply_free(&r);
        tally_req_t qq = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, next_id++);
        assert_int_equal(tally_req_set_stream(&qq, name), TALLY_OK);
        assert_int_equal(th_call(sock, &qq, NULL, 0, &r), 0);
        assert_int_equal(r.len, 128 + 2048 * (size_t)channels);
        assert_int_equal(tally_stream_info_decode(r.payload, r.len, &info), TALLY_OK);
        assert_int_equal(info.hist_total, 5);
        assert_int_equal(info.bins[256 * (channels - 1) + 10 * (channels - 1)], 4);
        th_reply_free(&r);
    }
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

/* ---- subscriptions ---------------------------------------------------------------------- */

typedef struct {
    char topic[TALLY_STREAM_NAME_MAX + 1];
    tally_pub_t pub;
    uint8_t record[TALLY_QUERY_PAYLOAD_MAX];
    size_t record_len;
} pub_msg_t;

/* Receives one publication within timeout_ms; false when none came. */
static bool pub_recv(void *sub, int timeout_ms, pub_msg_t *m)
{
    zmq_pollitem_t item = {.socket = sub, .events = ZMQ_POLLIN};
    if (zmq_poll(&item, 1, timeout_ms) <= 0)
        return false;
    uint8_t header[TALLY_PUB_HEADER_SIZE + 1];
    int n = zmq_recv(sub, m->topic, TALLY_STREAM_NAME_MAX, 0);
    assert_true(n > 0);
    m->topic[n] = '\0';
    int more = 0;
    size_t more_len = sizeof more;
    zmq_getsockopt(sub, ZMQ_RCVMORE, &more, &more_len);
    assert_true(more);
    n = zmq_recv(sub, header, sizeof header, 0);
    assert_int_equal(n, TALLY_PUB_HEADER_SIZE);
    assert_int_equal(tally_pub_decode(header, (size_t)n, &m->pub), TALLY_OK);
    zmq_getsockopt(sub, ZMQ_RCVMORE, &more, &more_len);
    assert_true(more);
    n = zmq_recv(sub, m->record, sizeof m->record, 0);
    assert_true(n >= 0);
    m->record_len = (size_t)n;
    zmq_getsockopt(sub, ZMQ_RCVMORE, &more, &more_len);
    assert_false(more); /* exactly three frames */
    return true;
}

/* A stream's record (up to TALLY_QUERY_PAYLOAD_MAX bytes) into out: its length. */
static size_t raw_query(void *sock, const char *stream, uint8_t *out)
{
    long len = th_query_raw(sock, stream, next_id++, out, TALLY_QUERY_PAYLOAD_MAX);
    assert_true(len >= 0);
    return (size_t)len;
}

static void test_subscriptions(void **state)
{
    (void)state;
    char endpoint[128];
    snprintf(endpoint, sizeof endpoint, "ipc:///tmp/tallyd-pub-%d.sock", (int)getpid());
    const char *args[] = {"--pub", endpoint, "--pub-interval-ms", "50", NULL};
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, args), 0);
    void *sock = th_connect(d.endpoint, 10000);
    tally_req_t inf = th_req(TALLY_OP_INFO, TALLY_DTYPE_NONE, next_id++);
    th_reply_t r;
    assert_int_equal(th_call(sock, &inf, NULL, 0, &r), 0);
    char want[200];
    snprintf(want, sizeof want, "\npub=%s\npub_interval_ms=50\n", endpoint);
    assert_non_null(strstr((char *)r.payload, want));
    th_reply_free(&r);

    void *ctx = zmq_ctx_new();
    void *sub = zmq_socket(ctx, ZMQ_SUB);
    assert_int_equal(zmq_connect(sub, endpoint), 0);
    assert_int_equal(zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "cam", 3), 0);

    /* The subscription takes a moment to reach the publisher: feed cam0 until a message
     * comes, then let the rest arrive. */
    static pub_msg_t m, last;
    bool got = false;
    for (double start = now_s(); !got && now_s() - start < 20;) {
        u8_batch(sock, "cam0", 7, 10);
        u8_batch(sock, "other", 1, 10); /* not subscribed: never delivered */
        got = pub_recv(sub, 200, &m);
    }
    assert_true(got);
    uint64_t seq = 0;
    do {
        if (strcmp(m.topic, "cam0") != 0)
            fail_msg("a message on topic '%s'", m.topic);
        assert_int_equal(m.pub.kind, TALLY_PUB_UPDATE);
        assert_true(m.pub.pub_seq > seq);
        assert_int_equal(m.pub.interval_ms, 50);
        assert_true(m.pub.time_ms > 1700000000000ull); /* the wall clock */
        seq = m.pub.pub_seq;
        last = m;
    } while (pub_recv(sub, 500, &m));
    /* The last publication is the stream as `query` sees it now. */
    static uint8_t rec[TALLY_QUERY_PAYLOAD_MAX];
    size_t len = raw_query(sock, "cam0", rec);
    assert_int_equal(last.record_len, len);
    assert_memory_equal(last.record, rec, len);
    /* Nothing changed: nothing published. */
    assert_false(pub_recv(sub, 400, &m));

    /* An rgb stream: its record is three channels long. */
    uint8_t px[6] = {1, 2, 3, 4, 5, 6};
    hist(sock, "cam/rgb", TALLY_DTYPE_RGB8, 0, 0, px, sizeof px);
    assert_true(pub_recv(sub, 5000, &m));
    assert_string_equal(m.topic, "cam/rgb");
    assert_int_equal(m.record_len, 6272);
    assert_true(m.pub.pub_seq > seq);
    len = raw_query(sock, "cam/rgb", rec);
    assert_memory_equal(m.record, rec, len);

    /* reset publishes the zeroed stream; delete a `deleted` message with an empty record. */
    control(sock, TALLY_OP_RESET, "cam0", TALLY_OK);
    assert_true(pub_recv(sub, 5000, &m));
    assert_string_equal(m.topic, "cam0");
    tally_stream_info_t info;
    assert_int_equal(tally_stream_info_decode(m.record, m.record_len, &info), TALLY_OK);
    assert_true(info.batches == 0 && info.hist_dtype == TALLY_DTYPE_U8);
    control(sock, TALLY_OP_DELETE, "cam0", TALLY_OK);
    assert_true(pub_recv(sub, 5000, &m));
    assert_string_equal(m.topic, "cam0");
    assert_int_equal(m.pub.kind, TALLY_PUB_DELETED);
    assert_int_equal(m.record_len, 0);
    assert_false(pub_recv(sub, 300, &m));

    zmq_close(sub);
    zmq_ctx_term(ctx);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

/* ---- metrics and health ----------------------------------------------------------------- */

static char *body_of(char *resp)
{
    char *body = strstr(resp, "\r\n\r\n");
    assert_non_null(body);
    return body + 4;
}

/* The value of the sample line that starts with `series ` in text, or -1. */
static double sample(const char *text, const char *series)
{
    size_t n = strlen(series);
    for (const char *line = text; line && *line;
         line = strchr(line, '\n'), line = line ? line + 1 : NULL)
        if (strncmp(line, series, n) == 0 && line[n] == ' ')
            return strtod(line + n + 1, NULL);
    return -1;
}

static void test_metrics_and_health(void **state)
{
    (void)state;
    const char *args[] = {"--metrics", "127.0.0.1:0", "--metrics-streams", "2", NULL};
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, args), 0);
    int port = th_metrics_port(&d);
    assert_true(port > 0);
    void *sock = th_connect(d.endpoint, 10000);
    u8_batch(sock, "q\"\\", 1, 10); /* a name that needs escaping */
    u8_batch(sock, "s1", 1, 20);
    u8_batch(sock, "s2", 1, 30);
    u8_batch(sock, "s3", 1, 40);
    static tally_stream_info_t info;
    assert_int_equal(query(sock, "q\"\\", 0, &info, NULL, NULL), TALLY_OK);

    char *resp = th_http_get(port, "GET", "/metrics", NULL);
    assert_non_null(resp);
    const char *m = body_of(resp);
    assert_true(sample(m, "tallyd_stream_values_total{stream=\"q\\\"\\\\\"}") == 10);
    assert_true(sample(m, "tallyd_stream_requests_total{stream=\"q\\\"\\\\\"}") == 2);
    assert_true(sample(m, "tallyd_stream_bytes_total{stream=\"s1\"}") == 20);
    /* The bound: 2 streams by name, the rest summed. */
    assert_true(sample(m, "tallyd_stream_values_total{stream=\"(other streams)\"}") == 70);
    assert_true(sample(m, "tallyd_stream_requests_total{stream=\"(other streams)\"}") == 2);
    assert_null(strstr(m, "stream=\"s2\""));
    assert_null(strstr(m, "stream=\"s3\""));
    char build[160];
    snprintf(build, sizeof build, "tallyd_build_info{version=\"%s\",protocol=\"1\",cuda=\"",
             TALLY_VERSION);
    assert_non_null(strstr(m, build));
    assert_true(sample(m, "process_open_fds") >= 3);
    assert_true(sample(m, "process_max_fds") >= sample(m, "process_open_fds"));
    assert_true(sample(m, "process_resident_memory_bytes") > 1e6);
    assert_true(sample(m, "process_virtual_memory_bytes") >
                sample(m, "process_resident_memory_bytes"));
    assert_true(sample(m, "process_cpu_seconds_total") >= 0);
    assert_true(sample(m, "process_start_time_seconds") > 1.7e9);
    assert_true(sample(m, "tallyd_gpus_lost") == 0 && sample(m, "tallyd_draining") == 0);
    free(resp);

    resp = th_http_get(port, "GET", "/healthz", NULL);
    assert_non_null(resp);
    assert_non_null(strstr(resp, " 200 "));
    assert_string_equal(body_of(resp), "ok\n");
    free(resp);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

/* The `stats` text (the same as GET /metrics), malloc'ed. */
static char *stats_text(void *sock)
{
    tally_req_t q = th_req(TALLY_OP_STATS, TALLY_DTYPE_NONE, next_id++);
    th_reply_t r;
    assert_int_equal(th_call_reply_status(sock, &q, NULL, 0, &r), TALLY_OK);
    return (char *)r.payload; /* NUL-terminated by the harness */
}

/* Lines of text that start with prefix. */
static int count_lines(const char *text, const char *prefix)
{
    int n = 0;
    for (const char *line = text; line && *line;
         line = strchr(line, '\n'), line = line ? line + 1 : NULL)
        n += strncmp(line, prefix, strlen(prefix)) == 0;
    return n;
}

/* [metrics] streams and histogram_buckets change at reload (SIGHUP): the bound and the buckets
 * follow at the next scrape. */
static void test_metrics_streams_reload(void **state)
{
    (void)state;
    char path[] = "/tmp/tallyd-analyst-conf-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    FILE *f = fopen(path, "w");
    fprintf(f, "[metrics]\nstreams = 1\nhistogram_buckets = 4\n");
    fclose(f);
    const char *args[] = {"--config", path, NULL};
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, args), 0);
    void *sock = th_connect(d.endpoint, 10000);
    u8_batch(sock, "a", 1, 1);
    u8_batch(sock, "b", 1, 2);
    u8_batch(sock, "c", 1, 3);
    char *m = stats_text(sock);
    assert_true(sample(m, "tallyd_stream_values_total{stream=\"a\"}") == 1);
    assert_true(sample(m, "tallyd_stream_values_total{stream=\"(other streams)\"}") == 5);
    assert_true(sample(m, "tallyd_stream_values_total{stream=\"b\"}") == -1);
    /* Four buckets of 64 bytes, +Inf, and only the labelled stream's. */
    assert_int_equal(count_lines(m, "tallyd_stream_values_bucket{"), 5);
    assert_true(sample(m, "tallyd_stream_values_bucket{stream=\"a\",le=\"63\"}") == 1);
    assert_true(sample(m, "tallyd_stream_values_bucket{stream=\"a\",le=\"255\"}") == 1);
    assert_true(sample(m, "tallyd_stream_values_sum{stream=\"a\"}") == 1);
    free(m);
    f = fopen(path, "w");
    fprintf(f, "[metrics]\nstreams = 3\nhistogram_buckets = 0\n");
    fclose(f);
    assert_int_equal(kill(d.pid, SIGHUP), 0);
    bool applied = false;
    for (double start = now_s(); !applied && now_s() - start < 10; usleep(20000)) {
        m = stats_text(sock);
        applied = sample(m, "tallyd_stream_values_total{stream=\"c\"}") == 3;
        if (applied) {
            assert_null(strstr(m, "{stream=\"(other streams)\"}"));
            assert_int_equal(count_lines(m, "tallyd_stream_values_bucket{"), 0);
        }
        free(m);
    }
    assert_true(applied);
    assert_true(th_daemon_log_contains(&d, "reload: metrics streams: 1 -> 3"));
    assert_true(th_daemon_log_contains(&d, "reload: metrics histogram_buckets: 4 -> 0"));
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
    unlink(path);
}

/* Polls /healthz until it answers `code` with `body`, for at most seconds. */
static bool health_becomes(int port, const char *code, const char *body, double seconds)
{
    for (double start = now_s(); now_s() - start < seconds; usleep(20000)) {
        char *resp = th_http_get(port, "GET", "/healthz", NULL);
        bool match = resp && strstr(resp, code) && strcmp(body_of(resp), body) == 0;
        free(resp);
        if (match)
            return true;
    }
    return false;
}

/* 503 "draining" after SIGTERM while a request still runs (a simulated GPU that takes 3 s). */
static void test_health_draining(void **state)
{
    (void)state;
    const char *args[] = {"--metrics",       "127.0.0.1:0", "--backend", "cuda",
                          "--test-sim-gpus", "1",           NULL};
    setenv("TALLYD_TEST_SIM_LATENCY_US", "3000000", 1);
    th_daemon_t d;
    int started = th_daemon_start(&d, args);
    unsetenv("TALLYD_TEST_SIM_LATENCY_US");
    assert_int_equal(started, 0);
    int port = th_metrics_port(&d);
    assert_true(port > 0);
    assert_true(health_becomes(port, " 200 ", "ok\n", 10));
    void *sock = th_connect(d.endpoint, 20000);
    uint8_t bytes[64] = {0};
    tally_req_t q = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, next_id++);
    assert_int_equal(th_send_request(sock, &q, bytes, sizeof bytes), 0);
    usleep(300000); /* on the simulated device */
    assert_int_equal(kill(d.pid, SIGTERM), 0);
    assert_true(health_becomes(port, " 503 ", "draining\n", 2.5));
    th_reply_t r;
    assert_int_equal(th_recv_reply(sock, &r), 0); /* the running request still finishes */
    assert_int_equal(r.rep.status, TALLY_OK);
    th_reply_free(&r);
    th_close(sock);
    assert_int_equal(th_daemon_wait(&d, 20000), 0);
}

/* 503 "gpu lost" once the (simulated) GPU failed three requests in a row; they were rerun on
 * the CPU and answered right. */
static void test_health_gpu_lost(void **state)
{
    (void)state;
    const char *args[] = {"--metrics", "127.0.0.1:0",        "--backend", "cuda", "--test-sim-gpus",
                          "1",         "--test-fault-every", "1",         NULL};
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, args), 0);
    int port = th_metrics_port(&d);
    assert_true(port > 0);
    void *sock = th_connect(d.endpoint, 20000);
    for (int i = 0; i < 4; i++)
        u8_batch(sock, "g", 5, 100);
    assert_int_equal(query(sock, "g", 0, &(tally_stream_info_t){0}, NULL, NULL), TALLY_OK);
    assert_true(health_becomes(port, " 503 ", "gpu lost\n", 10));
    char *resp = th_http_get(port, "GET", "/metrics", NULL);
    assert_non_null(resp);
    assert_true(sample(body_of(resp), "tallyd_gpus_lost") == 1);
    free(resp);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_window_queries),         cmocka_unit_test(test_u16_rgb_streams),
        cmocka_unit_test(test_subscriptions),          cmocka_unit_test(test_metrics_and_health),
        cmocka_unit_test(test_health_draining),        cmocka_unit_test(test_health_gpu_lost),
        cmocka_unit_test(test_metrics_streams_reload),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
