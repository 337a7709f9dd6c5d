/*
 * make_state_fixture.c — writes the state file that tests/test_upgrade.c loads: a release's
 * streams.state, and beside it the query records that release answered for every stream.
 *
 *   TALLYD_BIN=/path/to/old/tallyd make_state_fixture OUTDIR
 *
 * starts that tallyd with a state directory and a test clock, applies a fixed scenario (every
 * histogram dtype, ranged and not, filter and scan counters and carries, seq numbers, a reset,
 * a large count, window intervals at several times, a stream whose intervals have all left the
 * ring), queries every stream (plain, and windows of 1, 10 and 60 s) at the clock FIXTURE_NOW_MS,
 * stops it with SIGTERM (the final snapshot) and leaves OUTDIR/streams.state and
 * OUTDIR/expected.bin:
 *
 *   "TLYDEXPT" u32 1, u32 entries, u64 the clock (ms) the queries were answered at; then per
 *   entry: u8 name length, the name, u32 window ms (0: a plain query), u64 aux0, u64 aux1,
 *   u32 record length, the record (the `query` payload).
 *
 * The data is fixed (the harness's generator, seeded here), so running it again with the same release gives the
 * same files. tests/data/state-v3/ was written by the release of commit e28eb37 (format
 * version 3).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "harness.h"
#include "tally_proto.h"

#define FIXTURE_NOW_MS 1795000000500ull /* the clock at which the queries are answered */
#define FIXTURE_T0_MS 1795000000000ull

static void die(const char *what)
{
    fprintf(stderr, "make_state_fixture: %s\n", what);
    exit(1);
}

typedef struct {
    void *sock;
    char clock[512];
    uint64_t id;
} fixture_t;

static void at(fixture_t *f, uint64_t ms)
{
    if (th_write_clock(f->clock, ms) != 0)
        die("cannot write the clock file");
}

/* One compute request that must succeed. */
static void run(fixture_t *f, uint8_t opcode, uint8_t dtype, const char *stream, int64_t lo,
                int64_t hi, uint8_t pred, uint64_t seq, const void *data, size_t len)
{
    tally_req_t q = th_req(opcode, dtype, ++f->id);
    q.stream_len = (uint8_t)strlen(stream);
    memcpy(q.stream, stream, q.stream_len);
    q.lo = lo;
    q.hi = hi;
    q.pred = pred;
    q.seq = seq;
    th_reply_t r;
    int st = th_call_reply_status(f->sock, &q, data, len, &r);
    if (st != TALLY_OK) {
        fprintf(stderr, "make_state_fixture: op %u on %s: status %d: %s\n", opcode, stream, st,
                r.payload ? (const char *)r.payload : "");
        exit(1);
    }
    th_reply_free(&r);
}

/* n random bytes (a narrow spread when narrow: most bins stay empty). */
static uint8_t *bytes(size_t n, bool narrow)
{
    uint8_t *p = malloc(n ? n : 1);
    if (!p)
        die("out of memory");
    for (size_t i = 0; i < n; i++)
        p[i] = narrow ? (uint8_t)(100 + th_rand() % 5) : (uint8_t)th_rand();
    return p;
}

static int32_t *ints(size_t n, int64_t lo, int64_t hi)
{
    int32_t *p = malloc(4 * (n ? n : 1));
    if (!p)
        die("out of memory");
    for (size_t i = 0; i < n; i++)
        p[i] = (int32_t)(lo + (int64_t)(th_rand() % (uint64_t)(hi - lo + 1)));
    return p;
}

static void hist_u8(fixture_t *f, const char *s, size_t n, bool narrow, uint64_t seq)
{
    uint8_t *p = bytes(n, narrow);
    run(f, TALLY_OP_HIST, TALLY_DTYPE_U8, s, 0, 0, 0, seq, p, n);
    free(p);
}

static void hist_ranged(fixture_t *f, const char *s, uint8_t dtype, int64_t lo, int64_t hi,
                        size_t n, uint64_t seq)
{
    if (dtype == TALLY_DTYPE_I32) {
        int32_t *p = ints(n, lo - 300, hi + 300); /* some under- and overflow */
        run(f, TALLY_OP_HIST, dtype, s, lo, hi, 0, seq, p, 4 * n);
        free(p);
        return;
    }
    uint16_t *p = malloc(2 * (n ? n : 1));
    if (!p)
        die("out of memory");
    for (size_t i = 0; i < n; i++)
        p[i] = (uint16_t)(th_rand() % 8192); /* above hi = 4096 overflows */
    run(f, TALLY_OP_HIST, dtype, s, lo, hi, 0, seq, p, 2 * n);
    free(p);
}

static void hist_pixels(fixture_t *f, const char *s, uint8_t dtype, size_t pixels)
{
    size_t n = pixels * (dtype == TALLY_DTYPE_RGB8 ? 3 : 4);
    uint8_t *p = bytes(n, false);
    run(f, TALLY_OP_HIST, dtype, s, 0, 0, 0, 0, p, n);
    free(p);
}

static void scan(fixture_t *f, const char *s, size_t n, uint64_t seq)
{
    int32_t *p = ints(n, -1000000, 1000000);
    run(f, TALLY_OP_SCAN, TALLY_DTYPE_I32, s, 0, 0, 0, seq, p, 4 * n);
    free(p);
}

static void filter(fixture_t *f, const char *s, size_t n)
{
    int32_t *p = ints(n, -100, 100);
    run(f, TALLY_OP_FILTER, TALLY_DTYPE_I32, s, 0, 0, TALLY_PRED_GT, 0, p, 4 * n);
    free(p);
}

/* The scenario: every second of the minute before FIXTURE_NOW_MS that matters. */
static void scenario(fixture_t *f)
{
    at(f, FIXTURE_T0_MS - 600000); /* ten minutes before: out of every window by now */
    hist_u8(f, "old/u8", 4096, false, 0);
    for (int k = 0; k < 60; k += 7) { /* intervals across the whole ring */
        at(f, FIXTURE_T0_MS - 59000 + (uint64_t)k * 1000 + 250);
        hist_u8(f, "u8/cam0", 1024 + (size_t)k, false, (uint64_t)k / 7 + 1);
        hist_u8(f, "u8/narrow", 200, true, 0);
        hist_ranged(f, "i32/temp", TALLY_DTYPE_I32, -1000, 1000, 700, 0);
        hist_ranged(f, "u16/press", TALLY_DTYPE_U16, 0, 4096, 900, 0);
        scan(f, "scan/only", 333, (uint64_t)k / 7 + 1);
        filter(f, "i32/temp", 50); /* a stream with every kind of counter */
        scan(f, "i32/temp", 20, 0);
    }
    at(f, FIXTURE_T0_MS - 30000);
    hist_pixels(f, "rgb8/img", TALLY_DTYPE_RGB8, 1500);
    hist_pixels(f, "rgba8/img", TALLY_DTYPE_RGBA8, 1500);
    filter(f, "filter/only", 4000);
    hist_u8(f, "reset/u8", 3000, false, 1);
    hist_u8(f, "reset/u8", 3000, false, 2);
    at(f, FIXTURE_T0_MS - 2000);
    tally_req_t q = th_req(TALLY_OP_RESET, TALLY_DTYPE_NONE, ++f->id);
    q.stream_len = 8;
    memcpy(q.stream, "reset/u8", 8);
    if (th_call_status(f->sock, &q, NULL, 0) != TALLY_OK)
        die("reset failed");
    hist_u8(f, "reset/u8", 500, true, 3);
    /* One bin past 2^16 in a single interval (and all-time). */
    at(f, FIXTURE_T0_MS - 1000);
    uint8_t *big = malloc(200000);
    if (!big)
        die("out of memory");
    memset(big, 7, 200000);
    run(f, TALLY_OP_HIST, TALLY_DTYPE_U8, "big/u8", 0, 0, 0, 0, big, 200000);
    at(f, FIXTURE_T0_MS + 100);
    run(f, TALLY_OP_HIST, TALLY_DTYPE_U8, "big/u8", 0, 0, 0, 0, big, 200000);
    free(big);
    hist_pixels(f, "rgb8/img", TALLY_DTYPE_RGB8, 10);
    hist_u8(f, "u8/cam0", 64, true, 10);
}

static void put(FILE *out, const void *p, size_t n)
{
    if (fwrite(p, 1, n, out) != n)
        die("cannot write expected.bin");
}

static void put_u32(FILE *out, uint32_t v)
{
    uint8_t b[4];
    tally_put_u32(b, v);
    put(out, b, 4);
}

static void put_u64(FILE *out, uint64_t v)
{
    uint8_t b[8];
    tally_put_u64(b, v);
    put(out, b, 8);
}

/* Queries one stream (window_ms 0: plain) and appends the entry; 1 entry written. */
static void expect(fixture_t *f, FILE *out, const char *stream, uint32_t window_ms)
{
    tally_req_t q = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, ++f->id);
    q.stream_len = (uint8_t)strlen(stream);
    memcpy(q.stream, stream, q.stream_len);
    if (window_ms) {
        q.flags = TALLY_FLAG_QUERY_WINDOW;
        q.lo = window_ms;
    }
    th_reply_t r;
    if (th_call_reply_status(f->sock, &q, NULL, 0, &r) != TALLY_OK)
        die("a query failed");
    uint8_t len = q.stream_len;
    put(out, &len, 1);
    put(out, stream, len);
    put_u32(out, window_ms);
    put_u64(out, r.rep.aux0);
    put_u64(out, r.rep.aux1);
    put_u32(out, (uint32_t)r.len);
    put(out, r.payload, r.len);
    th_reply_free(&r);
}

static const char *const streams[] = {"old/u8",   "u8/cam0",   "u8/narrow",   "i32/temp",
                                      "u16/press", "scan/only", "rgb8/img",   "rgba8/img",
                                      "filter/only", "reset/u8", "big/u8"};
static const uint32_t windows[] = {0, 1000, 10000, 60000};
#define N_STREAMS (sizeof streams / sizeof streams[0])
#define N_WINDOWS (sizeof windows / sizeof windows[0])

static void write_expected(fixture_t *f, const char *dir)
{
    char path[600];
    snprintf(path, sizeof path, "%s/expected.bin", dir);
    FILE *out = fopen(path, "wb");
    if (!out)
        die("cannot create expected.bin");
    put(out, "TLYDEXPT", 8);
    put_u32(out, 1);
    put_u32(out, (uint32_t)(N_STREAMS * N_WINDOWS));
    put_u64(out, FIXTURE_NOW_MS);
    at(f, FIXTURE_NOW_MS);
    for (size_t s = 0; s < N_STREAMS; s++)
        for (size_t w = 0; w < N_WINDOWS; w++)
            expect(f, out, streams[s], windows[w]);
    if (fclose(out) != 0)
        die("cannot write expected.bin");
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: TALLYD_BIN=tallyd make_state_fixture OUTDIR\n");
        return 2;
    }
    const char *dir = argv[1];
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        die("cannot create OUTDIR");
    setenv("TALLY_TEST_SEED", "0x2545f4914f6cdd1d", 1); /* the same data every run */
    th_seed();
    fixture_t f = {0};
    snprintf(f.clock, sizeof f.clock, "%s/clock", dir);
    at(&f, FIXTURE_T0_MS);
    th_daemon_t d;
    const char *args[] = {"--state-dir", dir, "--test-clock", f.clock, NULL};
    if (th_daemon_start(&d, args) != 0)
        die("cannot start tallyd");
    f.sock = th_connect(d.endpoint, 10000);
    scenario(&f);
    write_expected(&f, dir);
    if (th_close_and_stop(f.sock, &d, 10000) != 0)
        die("tallyd did not stop cleanly");
    remove(f.clock);
    printf("wrote %s/streams.state and %s/expected.bin\n", dir, dir);
    return 0;
}
