/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_client.c — libtally without tallyd: argument checks, local rejection of bad requests,
 * the reassembly arithmetic of chunked runs, timeouts against a port nobody listens on, and
 * tally_run end to end against a fake daemon.
 *
 * The fake daemon is a ROUTER socket in a thread with plain reference implementations of
 * filter, scan (with per-stream carry) and hist. It drains every request that is waiting and
 * answers the batch in reverse order, so the client sees replies out of order, as it does
 * from a real daemon spreading work over CUDA streams. Special inputs make it misbehave
 * (error replies, stale replies, malformed replies) to test the failure paths.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <zmq.h>

#include "tally.h"
#include "tally_internal.h"
#include "harness.h"
#include "reference.h"

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* ---- Arguments and local validation ------------------------------------------------------ */

static void test_new_rejects_bad_arguments(void **state)
{
    (void)state;
    tally_client_t *c = (tally_client_t *)0x1;
    assert_int_equal(tally_client_new("tcp://127.0.0.1:1", 100, NULL), TALLY_E_ARG);
    assert_int_equal(tally_client_new("tcp://127.0.0.1:1", 0, &c), TALLY_E_ARG);
    assert_null(c);
    assert_int_equal(tally_client_new("tcp://127.0.0.1:1", -5, &c), TALLY_E_ARG);
    assert_int_equal(tally_client_new("", 100, &c), TALLY_E_ARG);
    assert_int_equal(tally_client_new("nonsense://x", 100, &c), TALLY_E_ARG);
    assert_null(c);

    assert_int_equal(tally_client_new(NULL, 100, &c), TALLY_OK); /* the default endpoint */
    assert_non_null(c);
    assert_int_equal(tally_client_timeout(c), 100);
    tally_client_destroy(&c);
    assert_null(c);
    tally_client_destroy(&c); /* twice is harmless */
    tally_client_destroy(NULL);
}

static void test_calls_reject_bad_arguments(void **state)
{
    (void)state;
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new("tcp://127.0.0.1:1", 100, &c), TALLY_OK);
    tally_req_t req = {.opcode = TALLY_OP_FILTER, .dtype = TALLY_DTYPE_I32, .pred = TALLY_PRED_GT};
    tally_reply_t reply;
    tally_reply_init(&reply);
    assert_int_equal(tally_send(NULL, &req, NULL, 0, NULL), TALLY_E_ARG);
    assert_int_equal(tally_send(c, NULL, NULL, 0, NULL), TALLY_E_ARG);
    assert_int_equal(tally_send(c, &req, NULL, 4, NULL), TALLY_E_ARG); /* len without data */
    assert_int_equal(tally_recv(NULL, &reply), TALLY_E_ARG);
    assert_int_equal(tally_recv(c, NULL), TALLY_E_ARG);
    assert_int_equal(tally_call(c, &req, NULL, 0, NULL), TALLY_E_ARG);
    assert_int_equal(tally_info(c, TALLY_OP_FILTER, &(char *){NULL}), TALLY_E_ARG);
    assert_int_equal(tally_query(c, NULL, &(tally_stream_info_t){0}), TALLY_E_ARG);

    tally_buf_t out = {0};
    tally_run_result_t res;
    /* tally_run takes data operations only, whole elements only. */
    tally_req_t ping = {.opcode = TALLY_OP_PING};
    assert_int_equal(tally_run(c, &ping, NULL, 0, NULL, &out, &res), TALLY_E_ARG);
    assert_string_not_equal(res.error, "");
    int32_t three[3] = {1, 2, 3};
    assert_int_equal(tally_run(c, &req, three, 7, NULL, &out, &res), TALLY_E_ARG);
    assert_non_null(strstr(res.error, "7 bytes"));
    assert_int_equal(tally_run(c, &req, NULL, 4, NULL, &out, &res), TALLY_E_ARG);
    assert_int_equal(tally_run(c, &req, three, 12, NULL, NULL, &res), TALLY_E_ARG);
    tally_buf_free(&out);
    tally_client_destroy(&c);
}

/* A request the daemon would reject is refused locally, and nothing is sent: here the endpoint
 * is unreachable, so anything that tried to send would end in a timeout or transport error
 * instead of the status each call is asserted to return. */
static void test_bad_requests_rejected_before_sending(void **state)
{
    (void)state;
    char endpoint[64];
    int held;
    snprintf(endpoint, sizeof endpoint, "tcp://127.0.0.1:%d", th_refusing_port(&held));
    assert_true(held >= 0);
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(endpoint, 2000, &c), TALLY_OK);

    tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    assert_int_equal(tally_req_set_stream(&req, "has space"), TALLY_E_STREAM_NAME);
    assert_int_equal(tally_req_set_stream(&req, ""), TALLY_E_STREAM_NAME);
    char long_name[TALLY_STREAM_NAME_MAX + 2];
    memset(long_name, 'x', sizeof long_name - 1);
    long_name[sizeof long_name - 1] = '\0';
    assert_int_equal(tally_req_set_stream(&req, long_name), TALLY_E_STREAM_NAME);
    long_name[TALLY_STREAM_NAME_MAX] = '\0'; /* exactly the maximum is fine */
    assert_int_equal(tally_req_set_stream(&req, long_name), TALLY_OK);

    /* A name smuggled in without tally_req_set_stream is caught by tally_send. */
    memcpy(req.stream, "a\tb", 4);
    req.stream_len = 3;
    uint8_t bytes[16] = {0};
    assert_int_equal(tally_send(c, &req, bytes, sizeof bytes, NULL), TALLY_E_STREAM_NAME);
    assert_string_not_equal(tally_client_error(c), "");
    tally_buf_t out = {0};
    tally_run_result_t res;
    assert_int_equal(tally_run(c, &req, bytes, sizeof bytes, NULL, &out, &res),
                     TALLY_E_STREAM_NAME);
    assert_int_equal(res.chunks, 0);

    assert_int_equal(tally_query(c, "bad name", &(tally_stream_info_t){0}), TALLY_E_STREAM_NAME);
    assert_int_equal(tally_reset(c, ""), TALLY_E_STREAM_NAME);

    /* Other fields too: an i32 payload that is not whole elements, an inverted range. */
    tally_req_t filter = {.opcode = TALLY_OP_FILTER, .dtype = TALLY_DTYPE_I32, .pred = 1};
    assert_int_equal(tally_send(c, &filter, bytes, 5, NULL), TALLY_E_PAYLOAD);
    tally_req_t hist = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_I32, .lo = 5, .hi = 5};
    assert_int_equal(tally_send(c, &hist, bytes, 16, NULL), TALLY_E_PARAM);

    tally_buf_free(&out);
    tally_client_destroy(&c);
    close(held);
}

/* ---- Reassembly arithmetic --------------------------------------------------------------- */

static void test_scan_offset_i64_wraps(void **state)
{
    (void)state;
    int64_t in[4] = {0, -7, INT64_MAX, INT64_MIN};
    uint8_t buf[32];
    for (int i = 0; i < 4; i++)
        tally_put_u64(buf + 8 * i, (uint64_t)in[i]);
    tally__scan_offset(buf, 4, false, 10);
    assert_int_equal((int64_t)tally_get_u64(buf + 0), 10);
    assert_int_equal((int64_t)tally_get_u64(buf + 8), 3);
    assert_true((int64_t)tally_get_u64(buf + 16) == INT64_MIN + 9); /* wraps modulo 2^64 */
    assert_true((int64_t)tally_get_u64(buf + 24) == INT64_MIN + 10);

    tally__scan_offset(buf, 4, false, (uint64_t)-10); /* a negative offset undoes it */
    for (int i = 0; i < 4; i++)
        assert_true((int64_t)tally_get_u64(buf + 8 * i) == in[i]);
    tally__scan_offset(buf, 0, false, 99); /* n = 0 touches nothing */
    assert_true((int64_t)tally_get_u64(buf) == 0);
}

static void test_scan_offset_i32_wraps(void **state)
{
    (void)state;
    int32_t in[3] = {INT32_MAX, -1, INT32_MIN};
    uint8_t buf[12];
    for (int i = 0; i < 3; i++)
        tally_put_u32(buf + 4 * i, (uint32_t)in[i]);
    /* Only the low 32 bits of the 64-bit running total matter for int32 output. */
    tally__scan_offset(buf, 3, true, 0x100000001ull);
    assert_int_equal((int32_t)tally_get_u32(buf + 0), INT32_MIN);
    assert_int_equal((int32_t)tally_get_u32(buf + 4), 0);
    assert_int_equal((int32_t)tally_get_u32(buf + 8), INT32_MIN + 1);
    /* A negative running total: -2 as int64 is 0xFFFF...FE. */
    tally__scan_offset(buf, 3, true, (uint64_t)(int64_t)-2);
    assert_int_equal((int32_t)tally_get_u32(buf + 0), INT32_MAX - 1); /* INT32_MIN - 2 wraps */
    assert_int_equal((int32_t)tally_get_u32(buf + 4), -2);
    assert_int_equal((int32_t)tally_get_u32(buf + 8), INT32_MAX); /* INT32_MIN + 1 - 2 wraps */
}

/* Chunked stateless scans reassembled with the offsets equal the whole scan, for int64 and
 * int32 output, inclusive and exclusive, on values that overflow int32 quickly. */
static void test_chunked_scan_arithmetic_equals_whole(void **state)
{
    (void)state;
    enum { N = 1000 };
    int32_t x[N];
    for (int i = 0; i < N; i++)
        x[i] = (i % 3) ? INT32_MAX - (int32_t)(rng() % 5) : INT32_MIN + (int32_t)(rng() % 5);
    for (int variant = 0; variant < 4; variant++) {
        bool out_i32 = variant & 1, exclusive = variant & 2;
        size_t osize = out_i32 ? 4 : 8;
        uint8_t whole[N * 8], chunked[N * 8];
        uint64_t run = 0;
        for (int i = 0; i < N; i++) {
            uint64_t incl = run + (uint64_t)(int64_t)x[i];
            uint64_t v = exclusive ? run : incl;
            run = incl;
            if (out_i32)
                tally_put_u32(whole + 4 * i, (uint32_t)v);
            else
                tally_put_u64(whole + 8 * i, v);
        }
        /* Chunks of 37 elements, each scanned from 0, then offset by the totals before. */
        uint64_t offset = 0;
        for (int start = 0; start < N; start += 37) {
            int n = N - start < 37 ? N - start : 37;
            uint64_t part = 0;
            for (int i = 0; i < n; i++) {
                uint64_t incl = part + (uint64_t)(int64_t)x[start + i];
                uint64_t v = exclusive ? part : incl;
                part = incl;
                if (out_i32)
                    tally_put_u32(chunked + 4 * (start + i), (uint32_t)v);
                else
                    tally_put_u64(chunked + 8 * (start + i), v);
            }
            tally__scan_offset(chunked + osize * start, (size_t)n, out_i32, offset);
            offset += part; /* what the daemon reports as aux0 with carry-in 0 */
        }
        assert_memory_equal(whole, chunked, N * osize);
        assert_true(offset == run);
    }
}

static void test_hist_add_sums(void **state)
{
    (void)state;
    uint8_t acc[8 * TALLY_HIST_I32_VALUES] = {0}, part[8 * TALLY_HIST_I32_VALUES];
    for (int round = 1; round <= 3; round++) {
        for (int i = 0; i < TALLY_HIST_I32_VALUES; i++)
            tally_put_u64(part + 8 * i, (uint64_t)(i * round));
        tally__hist_add(acc, part, TALLY_HIST_I32_VALUES);
    }
    for (int i = 0; i < TALLY_HIST_I32_VALUES; i++)
        assert_int_equal(tally_get_u64(acc + 8 * i), (uint64_t)(6 * i));
    assert_int_equal(tally__hist_values(TALLY_DTYPE_U8), 256);
    assert_int_equal(tally__hist_values(TALLY_DTYPE_I32), 258);
    assert_int_equal(tally__hist_values(TALLY_DTYPE_NONE), 0);
}

static void test_chunk_sizes(void **state)
{
    (void)state;
    assert_int_equal(tally__chunk_bytes(0, 4), TALLY_DEFAULT_CHUNK_BYTES);
    assert_int_equal(tally__chunk_bytes(0, 1), TALLY_DEFAULT_CHUNK_BYTES);
    assert_int_equal(tally__chunk_bytes(4099, 4), 4096); /* rounded down to whole elements */
    assert_int_equal(tally__chunk_bytes(3, 4), 4);       /* at least one element */
    assert_int_equal(tally__chunk_bytes(3, 1), 3);
    assert_int_equal(tally__chunk_count(0, 4), 1); /* an empty input is one request */
    assert_int_equal(tally__chunk_count(4, 4), 1);
    assert_int_equal(tally__chunk_count(12, 8), 2);
    assert_int_equal(tally__chunk_count(16, 8), 2);
}

static void test_buf_grows(void **state)
{
    (void)state;
    tally_buf_t b = {0};
    for (int i = 0; i < 10000; i++)
        assert_int_equal(tally_buf_append(&b, &i, sizeof i), TALLY_OK);
    assert_int_equal(b.len, 10000 * sizeof(int));
    assert_true(b.cap >= b.len);
    int v;
    memcpy(&v, b.data + 4 * 9999, 4);
    assert_int_equal(v, 9999);
    assert_int_equal(tally_buf_reserve(&b, SIZE_MAX), TALLY_E_ARG);
    tally_buf_free(&b);
    assert_null(b.data);
    assert_int_equal(b.len, 0);
}

/* ---- Timeouts ---------------------------------------------------------------------------- */

/* Nothing listening (a refused port, no socket file): a client never connected fails its
 * first request at once, TALLY_E_TRANSPORT, naming the endpoint and the reason in the CLI's
 * words, instead of waiting for the timeout (as it did: 20 s here); every call that sends. */
static void test_unreachable_endpoint_fails_at_once(void **state)
{
    (void)state;
    char endpoint[64], said[160];
    int held;
    snprintf(endpoint, sizeof endpoint, "tcp://127.0.0.1:%d", th_refusing_port(&held));
    assert_true(held >= 0);
    snprintf(said, sizeof said, "cannot connect to %s: Connection refused (is tallyd running?)",
             endpoint);
    const int timeout = 20000;
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(endpoint, timeout, &c), TALLY_OK);
    assert_int_equal(tally_client_wait_connected(c), TALLY_E_TRANSPORT);
    assert_string_equal(tally_client_error(c), said);
    assert_int_equal(tally_ping(c, NULL), TALLY_E_TRANSPORT);
    assert_string_equal(tally_client_error(c), said);

    int32_t data[1000] = {0};
    tally_req_t req = {.opcode = TALLY_OP_SCAN, .dtype = TALLY_DTYPE_I32};
    tally_buf_t out = {0};
    tally_run_result_t res;
    tally_run_opts_t opts = {.chunk_bytes = 400, .window = 4};
    assert_int_equal(tally_run(c, &req, data, sizeof data, &opts, &out, &res), TALLY_E_TRANSPORT);
    assert_int_equal(res.status, TALLY_E_TRANSPORT);
    tally_buf_free(&out);
    char **names = NULL;
    size_t count = 0;
    assert_int_equal(tally_streams(c, &names, &count), TALLY_E_TRANSPORT);
    assert_null(names);
    tally_client_destroy(&c);
    assert_int_equal(tally_endpoint_probe(endpoint, 1000), ECONNREFUSED);
    close(held);

    /* An ipc path with no socket: the same, with the system's words for it. */
    snprintf(endpoint, sizeof endpoint, "ipc:///nonexistent/tally-%d.sock", (int)getpid());
    assert_int_equal(tally_client_new(endpoint, timeout, &c), TALLY_OK);
    assert_int_equal(tally_ping(c, NULL), TALLY_E_TRANSPORT);
    snprintf(said, sizeof said,
             "cannot connect to %s: No such file or directory (is tallyd running?)", endpoint);
    assert_string_equal(tally_client_error(c), said);
    tally_client_destroy(&c);
}

/* What cannot make a client is said (tally_client_open), in the words the CLI prints. */
static void test_open_says_why(void **state)
{
    (void)state;
    tally_client_t *c = (tally_client_t *)0x1;
    char msg[256];
    assert_int_equal(tally_client_open("127.0.0.1:15731", 100, NULL, &c, msg, sizeof msg),
                     TALLY_E_ARG);
    assert_null(c);
    assert_string_equal(msg, "invalid endpoint '127.0.0.1:15731': unsupported transport (use "
                             "tcp://HOST:PORT or ipc://PATH)");
    assert_int_equal(tally_client_open("tcp://127.0.0.1:5570x", 100, NULL, &c, msg, sizeof msg),
                     TALLY_E_ARG);
    assert_string_equal(msg, "invalid endpoint 'tcp://127.0.0.1:5570x': port '5570x' is not a "
                             "number from 1 to 65535");
    assert_int_equal(tally_client_open("tcp://127.0.0.1:1", 0, NULL, &c, msg, sizeof msg),
                     TALLY_E_ARG);
    assert_string_equal(msg, "timeout 0 ms: it must be above 0");
    assert_int_equal(tally_client_open("tcp://127.0.0.1:1", 100, NULL, &c, NULL, 0), TALLY_OK);
    tally_client_destroy(&c);
    assert_int_equal(tally_endpoint_probe("udp://127.0.0.1:1", 100), EINVAL);
}

/* A Unix stream socket bound to the len bytes of path (a file's path with its NUL, or a NUL and
 * a name in the abstract namespace), listening when `listening`: its descriptor. */
static int held_unix(const char *path, size_t len, bool listening)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    memcpy(a.sun_path, path, len);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    assert_int_equal(
        bind(fd, (struct sockaddr *)&a, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len)),
        0);
    if (listening)
        assert_int_equal(listen(fd, 4), 0);
    return fd;
}

/* tally_endpoint_probe says what it found, with sockets this test holds (no port or name another
 * process could take): something listening is 0; a TCP port bound but not listening and an
 * abstract name nobody listens on are ECONNREFUSED; a missing socket file is ENOENT; an
 * endpoint without a port, without an endpoint, or of another kind is EINVAL; a host that does
 * not resolve is EHOSTUNREACH. */
static void test_probe_says_why(void **state)
{
    (void)state;
    int tcp = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in in = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof in;
    assert_int_equal(bind(tcp, (struct sockaddr *)&in, sizeof in), 0);
    assert_int_equal(getsockname(tcp, (struct sockaddr *)&in, &len), 0);
    char endpoint[128];
    snprintf(endpoint, sizeof endpoint, "tcp://127.0.0.1:%d", ntohs(in.sin_port));
    assert_int_equal(tally_endpoint_probe(endpoint, 20000), ECONNREFUSED); /* bound, no listen */
    assert_int_equal(listen(tcp, 4), 0);
    assert_int_equal(tally_endpoint_probe(endpoint, 20000), 0);
    assert_int_equal(tally_endpoint_probe(endpoint, 0), 0); /* a timeout of 0 waits 1 ms at least */
    close(tcp);

    char name[64];
    int n = snprintf(name, sizeof name, "%ctally-probe-%d", '\0', (int)getpid());
    int abstract = held_unix(name, (size_t)n, false);
    snprintf(endpoint, sizeof endpoint, "ipc://@%s", name + 1);
    assert_int_equal(tally_endpoint_probe(endpoint, 20000), ECONNREFUSED);
    assert_int_equal(listen(abstract, 4), 0);
    assert_int_equal(tally_endpoint_probe(endpoint, 20000), 0);
    close(abstract);

    char dir[64], path[96];
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-probe"), 0);
    snprintf(path, sizeof path, "%s/tallyd.sock", dir);
    snprintf(endpoint, sizeof endpoint, "ipc://%s", path);
    assert_int_equal(tally_endpoint_probe(endpoint, 20000), ENOENT);
    int file = held_unix(path, strlen(path) + 1, true);
    assert_int_equal(tally_endpoint_probe(endpoint, 20000), 0);
    close(file);
    assert_int_equal(th_rmrf(dir), 0);

    assert_int_equal(tally_endpoint_probe(NULL, 100), EINVAL);
    assert_int_equal(tally_endpoint_probe("tcp://127.0.0.1", 100), EINVAL);
    assert_int_equal(tally_endpoint_probe("tcp://no-such-host.invalid:5570", 100), EHOSTUNREACH);
}

/* A daemon that accepts the connection but never answers: the send succeeds, the receive
 * times out, not before the client's timeout (how long after is the scheduler's), and
 * destroying the client does not wait for the queued request. */
static void test_silent_peer_times_out(void **state)
{
    (void)state;
    void *ctx = zmq_ctx_new();
    void *router = zmq_socket(ctx, ZMQ_ROUTER);
    assert_int_equal(zmq_bind(router, "tcp://127.0.0.1:*"), 0);
    char endpoint[64];
    size_t len = sizeof endpoint;
    assert_int_equal(zmq_getsockopt(router, ZMQ_LAST_ENDPOINT, endpoint, &len), 0);

    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(endpoint, 200, &c), TALLY_OK);
    int64_t start = now_ms();
    tally_reply_t reply;
    tally_reply_init(&reply);
    tally_req_t ping = {.opcode = TALLY_OP_PING};
    assert_int_equal(tally_call(c, &ping, NULL, 0, &reply), TALLY_E_TIMEOUT);
    assert_true(now_ms() - start >= 200);
    tally_client_destroy(&c);
    int linger = 0;
    zmq_setsockopt(router, ZMQ_LINGER, &linger, sizeof linger);
    zmq_close(router);
    zmq_ctx_term(ctx);
}

/* ---- A fake daemon ----------------------------------------------------------------------- */

/* Inputs whose first element is one of these make the fake daemon misbehave. */
#define FAKE_ERROR_MAGIC 0x7E570001        /* reply TALLY_E_BACKEND with a message */
#define FAKE_STALE_MAGIC 0x7E570002        /* send a reply to an unknown request id first */
#define FAKE_BADSIZE_MAGIC 0x7E570003      /* reply with a payload of the wrong size */
#define FAKE_SILENT_ERROR_MAGIC 0x7E570004 /* reply TALLY_E_BACKEND with no message */
#define FAKE_RAGGED_MAGIC 0x7E570005       /* reply int64s in a payload of 4 bytes too many */

typedef struct {
    void *ctx;
    void *sock;
    char endpoint[64];
    pthread_t thread;
    atomic_bool stop;
    char streams[8][TALLY_STREAM_NAME_MAX + 1];
    uint64_t carries[8];
    int nstreams;
    atomic_uint max_batch_seen; /* the largest number of requests answered at once */
    atomic_uint reordered;      /* batches of more than one, answered out of order */
    _Atomic(const char *) info; /* the `info` text it answers; NULL: "version=fake" */
} fake_t;

typedef struct {
    zmq_msg_t id;
    tally_rep_t rep;
    uint8_t *payload;
    size_t len;
    int shape; /* 0: a good reply; else one of the malformed shapes below */
} fake_reply_t;

enum { SHAPE_ONE_FRAME = 1, SHAPE_THREE_FRAMES, SHAPE_BAD_MAGIC };

static uint64_t *fake_carry(fake_t *f, const tally_req_t *req)
{
    for (int i = 0; i < f->nstreams; i++)
        if (!strcmp(f->streams[i], req->stream))
            return &f->carries[i];
    assert_true(f->nstreams < 8);
    snprintf(f->streams[f->nstreams], sizeof f->streams[0], "%s", req->stream);
    f->carries[f->nstreams] = 0;
    return &f->carries[f->nstreams++];
}

static void swap_elems(uint8_t *a, uint8_t *b, size_t esize)
{
    uint8_t t[8];
    memcpy(t, a, esize);
    memcpy(a, b, esize);
    memcpy(b, t, esize);
}

/* Computes the reply to one well-formed data request (reference implementations). */
static void fake_compute(fake_t *f, const tally_req_t *req, const uint8_t *p, size_t len,
                         fake_reply_t *r)
{
    size_t esize = tally_dtype_size((tally_dtype_t)req->dtype), n = len / esize;
    r->rep.dtype = req->dtype;
    if (req->opcode == TALLY_OP_FILTER) {
        r->payload = malloc(len + 1);
        size_t kept = tr_filter(req->dtype, p, n, req->pred, req->lo, req->hi, r->payload);
        if (!(req->flags & TALLY_FLAG_FILTER_STABLE)) /* unordered mode: emulate by reversing */
            for (size_t i = 0; i < kept / 2; i++)
                swap_elems(r->payload + esize * i, r->payload + esize * (kept - 1 - i), esize);
        r->len = kept * esize;
        r->rep.count = kept;
        r->rep.aux0 = n;
    } else if (req->opcode == TALLY_OP_SCAN) {
        bool out_i32 = req->flags & TALLY_FLAG_SCAN_OUT_I32;
        bool exclusive = req->flags & TALLY_FLAG_SCAN_EXCLUSIVE;
        uint64_t *carry = req->stream_len ? fake_carry(f, req) : &(uint64_t){0};
        r->len = n * (out_i32 ? 4 : 8);
        r->payload = malloc(r->len + 1);
        r->rep.dtype = out_i32 ? TALLY_DTYPE_I32 : TALLY_DTYPE_I64;
        *carry = tr_scan(p, n, exclusive, out_i32, *carry, r->payload);
        r->rep.count = n;
        r->rep.aux0 = *carry;
    } else {
        size_t values = tally__hist_values(req->dtype);
        uint64_t bins[TALLY_HIST_I32_VALUES] = {0};
        tr_hist(req->dtype, p, n, req->lo, req->hi, bins);
        r->len = values * 8;
        r->payload = malloc(r->len);
        for (size_t i = 0; i < values; i++)
            tally_put_u64(r->payload + 8 * i, bins[i]);
        r->rep.dtype = TALLY_DTYPE_U64;
        r->rep.count = values;
        r->rep.aux0 = n;
    }
}

static void fake_send(fake_t *f, fake_reply_t *r)
{
    uint8_t header[TALLY_REP_HEADER_SIZE];
    tally_rep_encode(&r->rep, header);
    if (r->shape == SHAPE_BAD_MAGIC)
        header[0] ^= 0xFF;
    zmq_msg_send(&r->id, f->sock, ZMQ_SNDMORE);
    zmq_send(f->sock, header, sizeof header, r->shape == SHAPE_ONE_FRAME ? 0 : ZMQ_SNDMORE);
    if (r->shape == SHAPE_THREE_FRAMES)
        zmq_send(f->sock, "extra", 5, ZMQ_SNDMORE);
    if (r->shape != SHAPE_ONE_FRAME)
        zmq_send(f->sock, r->payload ? (void *)r->payload : "", r->len, 0);
    free(r->payload);
}

static void fake_error(fake_reply_t *r, tally_status_t status, const char *msg)
{
    r->rep.status = status;
    r->rep.dtype = TALLY_DTYPE_TEXT;
    r->len = strlen(msg);
    r->payload = (uint8_t *)strdup(msg);
}

/* Receives one request [id][header][payload] and prepares its reply. */
static bool fake_handle(fake_t *f, fake_reply_t *r, fake_reply_t *stale)
{
    zmq_msg_t header, payload;
    zmq_msg_init(&r->id);
    zmq_msg_init(&header);
    zmq_msg_init(&payload);
    if (zmq_msg_recv(&r->id, f->sock, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&r->id);
        return false;
    }
    zmq_msg_recv(&header, f->sock, 0);
    zmq_msg_recv(&payload, f->sock, 0);
    tally_req_t req;
    tally_status_t st =
        tally_req_decode(zmq_msg_data(&header), zmq_msg_size(&header), &req, NULL, 0);
    memset(&r->rep, 0, sizeof r->rep);
    r->payload = NULL;
    r->len = 0;
    r->shape = 0;
    r->rep.version = TALLY_PROTO_VERSION;
    r->rep.opcode = req.opcode;
    r->rep.flags = req.flags;
    r->rep.request_id = req.request_id;
    const uint8_t *p = zmq_msg_data(&payload);
    size_t len = zmq_msg_size(&payload);
    uint32_t first = len >= 4 ? tally_get_u32(p) : 0;
    if (st == TALLY_OK)
        st = tally_req_validate(&req, len, 1u << 24, NULL, 0);
    if (st != TALLY_OK) {
        fake_error(r, st, "fake daemon: invalid request");
    } else if (req.opcode == TALLY_OP_PING) {
        /* empty OK reply */
    } else if (req.opcode == TALLY_OP_INFO) {
        const char *info = atomic_load(&f->info);
        fake_error(r, TALLY_OK, info ? info : "version=fake");
        r->rep.dtype = TALLY_DTYPE_TEXT;
    } else if (req.opcode == TALLY_OP_STATS) {
        r->shape = SHAPE_THREE_FRAMES;
    } else if (req.opcode == TALLY_OP_RESET) {
        r->shape = SHAPE_ONE_FRAME;
    } else if (req.opcode == TALLY_OP_QUERY) {
        r->shape = SHAPE_BAD_MAGIC;
    } else if (req.opcode == TALLY_OP_STREAMS) {
        /* A malformed list: a name length running past the end. */
        fake_error(r, TALLY_OK,
                   "\x05"
                   "ab");
    } else if (first == FAKE_ERROR_MAGIC && req.dtype == TALLY_DTYPE_I32) {
        fake_error(r, TALLY_E_BACKEND, "fake daemon: backend exploded");
    } else if (first == FAKE_SILENT_ERROR_MAGIC && req.dtype == TALLY_DTYPE_I32) {
        r->rep.status = TALLY_E_BACKEND;
        r->rep.dtype = TALLY_DTYPE_TEXT;
    } else if (first == FAKE_RAGGED_MAGIC && req.dtype == TALLY_DTYPE_I32) {
        r->rep.dtype = TALLY_DTYPE_I64;
        r->len = 12;
        r->payload = calloc(1, r->len);
    } else {
        fake_compute(f, &req, p, len, r);
        if (first == FAKE_BADSIZE_MAGIC && req.dtype == TALLY_DTYPE_I32)
            r->len = r->len ? r->len - (r->len % 8 ? 4 : 8) : 0;
        if (first == FAKE_STALE_MAGIC && req.dtype == TALLY_DTYPE_I32 && stale) {
            zmq_msg_init(&stale->id);
            zmq_msg_copy(&stale->id, &r->id);
            stale->rep = r->rep;
            stale->rep.request_id = req.request_id + 1000000;
            stale->len = r->len;
            stale->payload = malloc(r->len + 1);
            memcpy(stale->payload, r->payload, r->len);
        }
    }
    zmq_msg_close(&header);
    zmq_msg_close(&payload);
    return true;
}

static void *fake_main(void *arg)
{
    fake_t *f = arg;
    enum { MAX_BATCH = 64 };
    fake_reply_t replies[MAX_BATCH], stale;
    while (!atomic_load(&f->stop)) {
        zmq_pollitem_t item = {.socket = f->sock, .events = ZMQ_POLLIN};
        if (zmq_poll(&item, 1, 20) <= 0)
            continue;
        usleep(300); /* let more requests arrive, so batches (and reordering) happen */
        int n = 0;
        while (n < MAX_BATCH) {
            stale.payload = NULL;
            stale.rep.request_id = 0;
            stale.shape = 0;
            if (!fake_handle(f, &replies[n], &stale))
                break;
            if (stale.rep.request_id)
                fake_send(f, &stale), zmq_msg_close(&stale.id);
            n++;
        }
        if ((unsigned)n > f->max_batch_seen)
            f->max_batch_seen = (unsigned)n;
        f->reordered += n > 1;
        for (int i = n - 1; i >= 0; i--) { /* newest first: out of order */
            fake_send(f, &replies[i]);
            zmq_msg_close(&replies[i].id);
        }
    }
    return NULL;
}

static int fake_setup(void **state)
{
    fake_t *f = calloc(1, sizeof *f);
    f->ctx = zmq_ctx_new();
    f->sock = zmq_socket(f->ctx, ZMQ_ROUTER);
    int linger = 0;
    zmq_setsockopt(f->sock, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_bind(f->sock, "tcp://127.0.0.1:*") != 0)
        return -1;
    size_t len = sizeof f->endpoint;
    zmq_getsockopt(f->sock, ZMQ_LAST_ENDPOINT, f->endpoint, &len);
    pthread_create(&f->thread, NULL, fake_main, f);
    *state = f;
    return 0;
}

static int fake_teardown(void **state)
{
    fake_t *f = *state;
    atomic_store(&f->stop, true);
    pthread_join(f->thread, NULL);
    zmq_close(f->sock);
    zmq_ctx_term(f->ctx);
    free(f);
    return 0;
}

/* ---- tally_run against the fake daemon --------------------------------------------------- */

static tally_client_t *fake_client(void **state)
{
    fake_t *f = *state;
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(f->endpoint, 5000, &c), TALLY_OK);
    return c;
}

static const size_t sizes[] = {0, 1, 31, 32, 33, 1000, 4099, 20000};
static const size_t chunks[] = {1, 4, 12, 100, 4096, 0};
static const unsigned windows[] = {1, 3, 8};

/* The chunk size for a run over n int32: chunks[ci], but never more than ~200 chunks, so the
 * whole matrix runs in seconds. */
static tally_run_opts_t run_opts(size_t n, size_t ci)
{
    size_t chunk = chunks[ci], floor = 4 * n / 200;
    tally_run_opts_t opts = {.chunk_bytes = chunk && chunk < floor ? floor : chunk,
                             .window = windows[ci % 3]};
    return opts;
}

static void test_run_filter(void **state)
{
    tally_client_t *c = fake_client(state);
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        size_t n = sizes[si];
        int32_t *x = malloc(4 * n + 4);
        for (size_t i = 0; i < n; i++)
            x[i] = (int32_t)(rng() % 2001) - 1000;
        for (size_t ci = 0; ci < sizeof chunks / sizeof *chunks; ci++) {
            tally_req_t req = {.opcode = TALLY_OP_FILTER,
                               .dtype = TALLY_DTYPE_I32,
                               .pred = TALLY_PRED_BETWEEN,
                               .lo = -100,
                               .hi = 500,
                               .flags = TALLY_FLAG_FILTER_STABLE};
            tally_run_opts_t opts = run_opts(n, ci);
            tally_buf_t out = {0};
            tally_run_result_t res;
            assert_int_equal(tally_run(c, &req, x, 4 * n, &opts, &out, &res), TALLY_OK);
            size_t kept = 0;
            for (size_t i = 0; i < n; i++) {
                if (x[i] < -100 || x[i] > 500)
                    continue;
                assert_true(kept < out.len / 4);
                assert_int_equal((int32_t)tally_get_u32(out.data + 4 * kept), x[i]);
                kept++;
            }
            assert_int_equal(out.len, 4 * kept);
            assert_int_equal(res.count, kept);
            assert_int_equal(res.seen, n);
            assert_int_equal(res.elements, n);
            tally_buf_free(&out);
        }
        free(x);
    }
    tally_client_destroy(&c);
}

static int cmp_u8(const void *a, const void *b)
{
    return *(const uint8_t *)a - *(const uint8_t *)b;
}

/* Unordered u8 filter: the right multiset, chunks appended after what `out` held. */
static void test_run_filter_u8_unordered_appends(void **state)
{
    tally_client_t *c = fake_client(state);
    enum { N = 5000 };
    uint8_t x[N], expect[N];
    size_t kept = 0;
    for (int i = 0; i < N; i++) {
        x[i] = (uint8_t)rng();
        if (x[i] != 7)
            expect[kept++] = x[i];
    }
    tally_req_t req = {
        .opcode = TALLY_OP_FILTER, .dtype = TALLY_DTYPE_U8, .pred = TALLY_PRED_NE, .lo = 7};
    tally_buf_t out = {0};
    assert_int_equal(tally_buf_append(&out, "HDR", 3), TALLY_OK);
    tally_run_opts_t opts = {.chunk_bytes = 333, .window = 5};
    assert_int_equal(tally_run(c, &req, x, N, &opts, &out, NULL), TALLY_OK);
    assert_int_equal(out.len, 3 + kept);
    assert_memory_equal(out.data, "HDR", 3);
    qsort(out.data + 3, kept, 1, cmp_u8);
    qsort(expect, kept, 1, cmp_u8);
    assert_memory_equal(out.data + 3, expect, kept);
    tally_buf_free(&out);
    tally_client_destroy(&c);
}

static void check_scan(tally_client_t *c, const int32_t *x, size_t n, uint8_t flags,
                       const char *stream, uint64_t carry_in, const tally_run_opts_t *opts)
{
    tally_req_t req = {.opcode = TALLY_OP_SCAN, .dtype = TALLY_DTYPE_I32, .flags = flags};
    if (stream)
        assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    tally_buf_t out = {0};
    tally_run_result_t res;
    assert_int_equal(tally_run(c, &req, x, 4 * n, opts, &out, &res), TALLY_OK);
    bool out_i32 = flags & TALLY_FLAG_SCAN_OUT_I32;
    assert_int_equal(out.len, n * (out_i32 ? 4 : 8));
    uint8_t *want = malloc(out.len + 1);
    assert_non_null(want);
    uint64_t run = tr_scan(x, n, flags & TALLY_FLAG_SCAN_EXCLUSIVE, out_i32, carry_in, want);
    assert_memory_equal(out.data, want, out.len);
    free(want);
    assert_true((uint64_t)res.carry == run);
    assert_int_equal(res.count, n);
    tally_buf_free(&out);
}

static void test_run_scan_stateless(void **state)
{
    tally_client_t *c = fake_client(state);
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        size_t n = sizes[si];
        int32_t *x = malloc(4 * n + 4);
        for (size_t i = 0; i < n; i++) /* big values: int32 sums wrap within a chunk */
            x[i] = (i & 1) ? INT32_MAX - (int32_t)(rng() % 1000) : (int32_t)(rng() % 1000);
        for (size_t ci = 0; ci < sizeof chunks / sizeof *chunks; ci++) {
            tally_run_opts_t opts = run_opts(n, ci);
            for (uint8_t flags = 0; flags < 4; flags++)
                check_scan(c, x, n, flags, NULL, 0, &opts);
        }
        free(x);
    }
    /* The matrix above did see replies out of order (so reassembly was really tested). */
    fake_t *f = *state;
    assert_true(f->reordered > 0);
    tally_client_destroy(&c);
}

static void test_run_scan_stream_carries(void **state)
{
    tally_client_t *c = fake_client(state);
    enum { N = 3001 };
    int32_t x[N];
    for (int i = 0; i < N; i++)
        x[i] = (int32_t)rng();
    tally_run_opts_t opts = {.chunk_bytes = 256, .window = 8};
    /* Two runs on one stream: the second continues from the first's carry. */
    check_scan(c, x, N, 0, "fake/s1", 0, &opts);
    check_scan(c, x, N, TALLY_FLAG_SCAN_EXCLUSIVE, "fake/s1", tr_sum(x, N, 0), &opts);
    tally_client_destroy(&c);
}

static void test_run_hist_sums_chunks(void **state)
{
    tally_client_t *c = fake_client(state);
    enum { N = 10007 };
    int32_t x[N];
    uint8_t bytes[N];
    uint64_t expect_u8[256] = {0}, expect_i32[TALLY_HIST_I32_VALUES] = {0};
    for (int i = 0; i < N; i++) {
        x[i] = (int32_t)(rng() % 3000) - 1000;
        bytes[i] = (uint8_t)rng();
    }
    tr_hist(TALLY_DTYPE_U8, bytes, N, 0, 0, expect_u8);
    tr_hist(TALLY_DTYPE_I32, x, N, -500, 1500, expect_i32);
    for (int with_stream = 0; with_stream < 2; with_stream++) {
        tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
        if (with_stream)
            tally_req_set_stream(&req, "cam0");
        tally_run_opts_t opts = {.chunk_bytes = 1000, .window = 4};
        tally_buf_t out = {0};
        tally_run_result_t res;
        assert_int_equal(tally_run(c, &req, bytes, N, &opts, &out, &res), TALLY_OK);
        assert_true(th_u64s_equal(out.data, out.len, expect_u8, 256));
        assert_int_equal(res.hist_total, N);
        assert_int_equal(res.chunks, 11);
        tally_buf_free(&out);

        tally_req_t ireq = {
            .opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_I32, .lo = -500, .hi = 1500};
        if (with_stream)
            tally_req_set_stream(&ireq, "line3/pressure");
        assert_int_equal(tally_run(c, &ireq, x, sizeof x, &opts, &out, &res), TALLY_OK);
        assert_true(th_u64s_equal(out.data, out.len, expect_i32, TALLY_HIST_I32_VALUES));
        tally_buf_free(&out);
    }
    /* An empty input is still one request, and gives an all-zero histogram. */
    tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    tally_buf_t out = {0};
    tally_run_result_t res;
    assert_int_equal(tally_run(c, &req, NULL, 0, NULL, &out, &res), TALLY_OK);
    assert_int_equal(res.chunks, 1);
    static const uint64_t zeros[256];
    assert_true(th_u64s_equal(out.data, out.len, zeros, 256));
    tally_buf_free(&out);
    tally_client_destroy(&c);
}

/* The window bounds what is in flight: with W = 3 the fake never sees more than 3 at once. */
static void test_run_respects_window(void **state)
{
    fake_t *f = *state;
    tally_client_t *c = fake_client(state);
    int32_t x[4000] = {0};
    tally_req_t req = {.opcode = TALLY_OP_SCAN, .dtype = TALLY_DTYPE_I32};
    tally_run_opts_t opts = {.chunk_bytes = 64, .window = 3};
    tally_buf_t out = {0};
    f->max_batch_seen = 0;
    assert_int_equal(tally_run(c, &req, x, sizeof x, &opts, &out, NULL), TALLY_OK);
    assert_true(f->max_batch_seen >= 1 && f->max_batch_seen <= 3);
    tally_buf_free(&out);

    /* A window over TALLY_MAX_WINDOW is clamped, not an error. */
    opts.window = 100000;
    opts.chunk_bytes = 4;
    f->max_batch_seen = 0;
    assert_int_equal(tally_run(c, &req, x, sizeof x, &opts, &out, NULL), TALLY_OK);
    assert_int_equal(out.len, 8 * 4000);
    assert_true(f->max_batch_seen <= TALLY_MAX_WINDOW);
    tally_buf_free(&out);
    tally_client_destroy(&c);
}

static void test_run_failures(void **state)
{
    tally_client_t *c = fake_client(state);
    int32_t x[1000];
    for (int i = 0; i < 1000; i++)
        x[i] = i;
    tally_req_t req = {.opcode = TALLY_OP_SCAN, .dtype = TALLY_DTYPE_I32};
    tally_run_opts_t opts = {.chunk_bytes = 400, .window = 4};
    tally_buf_t out = {0};
    tally_run_result_t res;

    /* A daemon error on one chunk fails the run with the daemon's message. */
    x[500] = FAKE_ERROR_MAGIC; /* the first element of chunk 5 */
    assert_int_equal(tally_run(c, &req, x, sizeof x, &opts, &out, &res), TALLY_E_BACKEND);
    assert_string_equal(res.error, "fake daemon: backend exploded");
    assert_int_equal(res.status, TALLY_E_BACKEND);
    tally_buf_free(&out);

    /* Stale replies (unknown request ids, as left by the failed run above) are ignored. */
    x[500] = FAKE_STALE_MAGIC;
    check_scan(c, x, 1000, 0, NULL, 0, &opts);

    /* A reply whose payload does not match the chunk is TALLY_E_REPLY. */
    x[500] = FAKE_BADSIZE_MAGIC;
    assert_int_equal(tally_run(c, &req, x, sizeof x, &opts, &out, &res), TALLY_E_REPLY);
    assert_string_not_equal(res.error, "");
    tally_buf_free(&out);

    /* A daemon error without a message is named by its status's text. */
    x[500] = FAKE_SILENT_ERROR_MAGIC;
    assert_int_equal(tally_run(c, &req, x, sizeof x, &opts, &out, &res), TALLY_E_BACKEND);
    assert_string_equal(res.error, tally_status_text(TALLY_E_BACKEND));
    tally_buf_free(&out);

    /* A reply of 12 bytes said to hold int64s is not one: TALLY_E_REPLY, saying so. */
    x[500] = FAKE_RAGGED_MAGIC;
    assert_int_equal(tally_run(c, &req, x, sizeof x, &opts, &out, &res), TALLY_E_REPLY);
    assert_string_equal(res.error, "reply payload of 12 bytes is not a whole number of i64");
    tally_buf_free(&out);

    /* The client still works afterwards. */
    assert_int_equal(tally_ping(c, NULL), TALLY_OK);
    tally_client_destroy(&c);
}

static void test_call_and_wrappers(void **state)
{
    tally_client_t *c = fake_client(state);
    double rtt = -1;
    assert_int_equal(tally_ping(c, &rtt), TALLY_OK);
    assert_true(rtt >= 0);
    char *text = NULL;
    assert_int_equal(tally_info(c, TALLY_OP_INFO, &text), TALLY_OK);
    assert_string_equal(text, "version=fake");
    free(text);
    /* ... which is not info as §5 spells it (no '\n' after the last line): refused whole. */
    tally_info_t *parsed = (tally_info_t *)&parsed;
    assert_int_equal(tally_info_fetch(c, &parsed), TALLY_E_REPLY);
    assert_null(parsed);
    assert_non_null(strstr(tally_client_error(c), "key=value"));
    char **names = NULL;
    size_t count = 0;
    assert_int_equal(tally_streams(c, &names, &count), TALLY_E_REPLY); /* malformed list */
    assert_null(names);

    /* Malformed replies are TALLY_E_REPLY with an explanation, and the socket stays usable
     * (a reply's extra frames are drained, not left to be read as the next reply). */
    assert_int_equal(tally_info(c, TALLY_OP_STATS, &text), TALLY_E_REPLY);
    assert_null(text);
    assert_non_null(strstr(tally_client_error(c), "3 frames"));
    assert_int_equal(tally_ping(c, NULL), TALLY_OK);
    assert_int_equal(tally_reset(c, "s"), TALLY_E_REPLY);
    assert_non_null(strstr(tally_client_error(c), "1 frame"));
    assert_int_equal(tally_ping(c, NULL), TALLY_OK);
    tally_stream_info_t info;
    assert_int_equal(tally_query(c, "s", &info), TALLY_E_REPLY);
    assert_non_null(strstr(tally_client_error(c), "header"));
    assert_int_equal(tally_ping(c, NULL), TALLY_OK);

    /* Pipelining by hand: three pings, replies matched by id in any order. */
    tally_req_t ping = {.opcode = TALLY_OP_PING};
    uint64_t ids[3];
    for (int i = 0; i < 3; i++)
        assert_int_equal(tally_send(c, &ping, NULL, 0, &ids[i]), TALLY_OK);
    assert_true(ids[0] != ids[1] && ids[1] != ids[2]);
    int seen = 0;
    tally_reply_t reply;
    tally_reply_init(&reply);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(tally_recv(c, &reply), TALLY_OK);
        for (int j = 0; j < 3; j++)
            if (reply.rep.request_id == ids[j])
                seen |= 1 << j;
        assert_int_equal(reply.rep.opcode, TALLY_OP_PING);
    }
    assert_int_equal(seen, 7);
    tally_reply_clear(&reply);
    tally_client_destroy(&c);
}

static atomic_int zc_freed;
static atomic_int zc_bad_hint;

static void zc_free(void *data, void *hint)
{
    if (hint != &zc_freed)
        atomic_fetch_add(&zc_bad_hint, 1);
    free(data);
    atomic_fetch_add(&zc_freed, 1);
}

/* tally_send_zc hands the buffer to ZeroMQ and frees it exactly once, on every path. */
/* A daemon whose `info` names a shared-memory side channel the client cannot use: the region is
 * refused, saying why. */
static void test_side_channel_unusable(void **state)
{
    fake_t *f = *state;
    /* Static: the fake daemon's thread reads the `info` given to it, and a test after this one
     * must not reuse its bytes on the stack (ZeroMQ's ordering is out of TSan's sight). */
    static char xs[121], long_path[160], missing[96], said[192];
    memset(xs, 'x', sizeof xs - 1);
    xs[sizeof xs - 1] = '\0';
    snprintf(long_path, sizeof long_path, "shm=on\nshm_socket=/%s\n", xs);
    snprintf(missing, sizeof missing, "/nonexistent/tally-side-%d.sock", (int)getpid());
    static char missing_info[128];
    snprintf(missing_info, sizeof missing_info, "shm=on\nshm_socket=%s\n", missing);
    snprintf(said, sizeof said,
             "cannot connect to the shared-memory side channel %s: No such file or directory",
             missing);
    struct {
        const char *info;
        tally_status_t status;
        const char *error;
    } cases[] = {
        {"shm=on\n", TALLY_E_ARG, "the daemon offers no shared memory (info: shm=off)"},
        {"shm=on\nshm_socket=\n", TALLY_E_ARG,
         "the daemon offers no shared memory (info: shm=off)"},
        {"shm=auto\nshm_socket=/x\n", TALLY_E_ARG,
         "the daemon offers no shared memory (info: shm=off)"},
        {long_path, TALLY_E_REPLY, "the daemon's shm_socket path is too long for a socket"},
        {missing_info, TALLY_E_IO, said},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        atomic_store(&f->info, cases[i].info);
        tally_client_t *c = fake_client(state);
        tally_region_t *region = (tally_region_t *)&region;
        assert_int_equal(tally_region_create(c, 4096, &region), cases[i].status);
        assert_null(region);
        assert_string_equal(tally_client_error(c), cases[i].error);
        tally_client_destroy(&c);
    }
    atomic_store(&f->info, NULL);
}

static void test_send_zero_copy(void **state)
{
    tally_client_t *c = fake_client(state);
    enum { N = 100000 };
    int32_t *x = malloc(4 * N);
    size_t kept = 0;
    for (int i = 0; i < N; i++)
        kept += (x[i] = (int32_t)(rng() % 100) - 50) > 10;
    tally_req_t req = {
        .opcode = TALLY_OP_FILTER, .dtype = TALLY_DTYPE_I32, .pred = TALLY_PRED_GT, .lo = 10};
    atomic_store(&zc_freed, 0);
    uint64_t id = 0;
    assert_int_equal(tally_send_zc(c, &req, x, 4 * N, zc_free, &zc_freed, &id), TALLY_OK);
    tally_reply_t reply;
    tally_reply_init(&reply);
    assert_int_equal(tally_recv(c, &reply), TALLY_OK);
    assert_true(reply.rep.request_id == id);
    assert_int_equal(reply.rep.count, kept);
    assert_int_equal(reply.rep.aux0, N);
    tally_reply_clear(&reply);
    for (int i = 0; i < 100 && atomic_load(&zc_freed) == 0; i++)
        usleep(10000);
    assert_int_equal(atomic_load(&zc_freed), 1);

    /* Rejected before sending: freed before tally_send_zc returns. */
    void *buf = malloc(16);
    memcpy(req.stream, "a b", 4);
    req.stream_len = 3;
    assert_int_equal(tally_send_zc(c, &req, buf, 16, zc_free, &zc_freed, NULL),
                     TALLY_E_STREAM_NAME);
    assert_int_equal(atomic_load(&zc_freed), 2);
    req.stream_len = 0;
    buf = malloc(4);
    assert_int_equal(tally_send_zc(c, &req, buf, 0, zc_free, &zc_freed, NULL), TALLY_E_ARG);
    assert_int_equal(atomic_load(&zc_freed), 3);
    assert_int_equal(atomic_load(&zc_bad_hint), 0);
    tally_client_destroy(&c);
}

/* tally_send's pool (tally_bufpool.c): sizes it takes, reuse, best fit, and its bounds. */
static void test_bufpool_reuses_and_bounds(void **state)
{
    (void)state;
    tally_bufpool_t *pool = tally__bufpool_new();
    assert_non_null(pool);
    assert_null(tally__bufpool_take(pool, TALLY_POOL_MIN_BYTES - 1)); /* small: zmq_send's */
    assert_null(tally__bufpool_take(pool, (size_t)TALLY_POOL_BYTES + 1));
    uint8_t *mib = tally__bufpool_take(pool, 1u << 20);
    assert_non_null(mib);
    memset(mib, 7, 1u << 20); /* all of it is ours (ASan checks) */
    tally__bufpool_give_back(mib, NULL);
    size_t bytes = 0;
    assert_int_equal(tally__bufpool_kept(pool, &bytes), 1);
    assert_int_equal(bytes, 1u << 20);
    assert_ptr_equal(tally__bufpool_take(pool, 1u << 20), mib); /* the same memory again */
    assert_int_equal(tally__bufpool_kept(pool, NULL), 0);

    /* Best fit, and never a buffer more than twice what is asked for. */
    uint8_t *four = tally__bufpool_take(pool, 4u << 20);
    tally__bufpool_give_back(mib, NULL);
    tally__bufpool_give_back(four, NULL);
    assert_ptr_equal(tally__bufpool_take(pool, 3u << 20), four);
    tally__bufpool_give_back(four, NULL);
    uint8_t *small = tally__bufpool_take(pool, 300u << 10); /* neither fits: a new one */
    assert_ptr_not_equal(small, mib);
    assert_ptr_not_equal(small, four);
    tally__bufpool_give_back(small, NULL);
    assert_int_equal(tally__bufpool_kept(pool, NULL), 3);

    /* At most TALLY_POOL_BUFFERS buffers and TALLY_POOL_BYTES bytes are kept. */
    void *held[TALLY_POOL_BUFFERS + 4];
    for (unsigned i = 0; i < TALLY_POOL_BUFFERS + 4; i++)
        held[i] = tally__bufpool_take(pool, 8u << 20);
    for (unsigned i = 0; i < TALLY_POOL_BUFFERS + 4; i++)
        tally__bufpool_give_back(held[i], NULL);
    unsigned kept = tally__bufpool_kept(pool, &bytes);
    assert_true(kept <= TALLY_POOL_BUFFERS);
    assert_true(bytes <= TALLY_POOL_BYTES);
    assert_true(bytes >= TALLY_POOL_BYTES - (8u << 20)); /* filled up to what fits */
    for (unsigned i = 0; i < TALLY_POOL_BUFFERS + 4; i++)
        held[i] = tally__bufpool_take(pool, TALLY_POOL_MIN_BYTES);
    for (unsigned i = 0; i < TALLY_POOL_BUFFERS + 4; i++)
        tally__bufpool_give_back(held[i], NULL);
    assert_int_equal(tally__bufpool_kept(pool, NULL), TALLY_POOL_BUFFERS);
    tally__bufpool_destroy(&pool);
    assert_null(pool);
}

/* tally_send copies: the caller may overwrite its buffer as soon as the call returns, and a
 * pipelined run of large sends (pooled buffers, reused) still gets every answer right. */
static void test_send_copies_large_payloads(void **state)
{
    tally_client_t *c = fake_client(state);
    enum { N = 256 << 10, ROUNDS = 40, WINDOW = 4 };
    int32_t *x = malloc(4 * N);
    tally_req_t req = {
        .opcode = TALLY_OP_FILTER, .dtype = TALLY_DTYPE_I32, .pred = TALLY_PRED_GT, .lo = 0};
    uint64_t expect[ROUNDS + 1] = {0};
    int sent = 0, got = 0;
    while (got < ROUNDS) {
        while (sent < ROUNDS && sent - got < WINDOW) {
            size_t kept = 0;
            for (int i = 0; i < N; i++) /* round k keeps about k/ROUNDS of them */
                kept += (x[i] = (int32_t)(rng() % ROUNDS) - sent) > 0;
            uint64_t id = 0;
            assert_int_equal(tally_send(c, &req, x, 4 * N, &id), TALLY_OK);
            assert_true(id <= ROUNDS);
            expect[id] = kept;
            memset(x, 0x55, 4 * N); /* the copy went, whatever the buffer holds now */
            sent++;
        }
        tally_reply_t reply;
        tally_reply_init(&reply);
        assert_int_equal(tally_recv(c, &reply), TALLY_OK);
        assert_int_equal(reply.rep.count, expect[reply.rep.request_id]);
        tally_reply_clear(&reply);
        got++;
    }
    free(x);
    tally_client_destroy(&c);
}

int main(void)
{
    const struct CMUnitTest unit[] = {
        cmocka_unit_test(test_new_rejects_bad_arguments),
        cmocka_unit_test(test_calls_reject_bad_arguments),
        cmocka_unit_test(test_bad_requests_rejected_before_sending),
        cmocka_unit_test(test_scan_offset_i64_wraps),
        cmocka_unit_test(test_scan_offset_i32_wraps),
        cmocka_unit_test(test_chunked_scan_arithmetic_equals_whole),
        cmocka_unit_test(test_hist_add_sums),
        cmocka_unit_test(test_chunk_sizes),
        cmocka_unit_test(test_buf_grows),
        cmocka_unit_test(test_bufpool_reuses_and_bounds),
        cmocka_unit_test(test_unreachable_endpoint_fails_at_once),
        cmocka_unit_test(test_open_says_why),
        cmocka_unit_test(test_probe_says_why),
        cmocka_unit_test(test_silent_peer_times_out),
    };
    const struct CMUnitTest fake[] = {
        cmocka_unit_test(test_call_and_wrappers),
        cmocka_unit_test(test_run_filter),
        cmocka_unit_test(test_run_filter_u8_unordered_appends),
        cmocka_unit_test(test_run_scan_stateless),
        cmocka_unit_test(test_run_scan_stream_carries),
        cmocka_unit_test(test_run_hist_sums_chunks),
        cmocka_unit_test(test_run_respects_window),
        cmocka_unit_test(test_run_failures),
        cmocka_unit_test(test_side_channel_unusable),
        cmocka_unit_test(test_send_zero_copy),
        cmocka_unit_test(test_send_copies_large_payloads),
    };
    int failed = cmocka_run_group_tests_name("client", unit, NULL, NULL);
    failed += cmocka_run_group_tests_name("client_fake_daemon", fake, fake_setup, fake_teardown);
    return failed;
}
