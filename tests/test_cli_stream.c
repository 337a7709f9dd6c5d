/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_cli_stream.c — the `tally` CLI streams: bounded memory through a pipe, a live producer's
 * results before it exits, Ctrl-C reporting exactly what was applied and --resume finishing the
 * push, chunks on frame boundaries, --chunk capped to the daemon's max_batch, decimal text sent
 * without --text refused, the progress line, and the shared-memory path fed by a pipe.
 *
 * One tallyd (CPU backend, --max-batch 1M so the cap shows with small inputs, a shared-memory
 * socket in the test's folder) serves every test. $TALLY_BIN runs as a child with a pipe on
 * its stdin, so the test is the producer and can pause, stop, or measure it (wait4's
 * ru_maxrss: the peak resident memory of tally alone). TALLY_RSS_TEST_MB sets the size sent
 * through the pipe (default 256 MiB: 4 x the 64 MiB bound, a few seconds on a CI box).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "reference.h"
#include "tally.h"

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1 /* ASan's quarantine and shadow memory make RSS meaningless */
#else
#define UNDER_ASAN 0
#endif

static th_daemon_t daemon_;
static char tmpdir[64];

static int setup(void **state)
{
    (void)state;
    if (th_tmpdir(tmpdir, sizeof tmpdir, "tally-stream") != 0)
        return -1;
    static char shm[128];
    snprintf(shm, sizeof shm, "%s/shm.sock", tmpdir);
    const char *args[] = {"--backend", "cpu", "--max-batch", "1M", "--shm-socket", shm, NULL};
    return th_daemon_start(&daemon_, args);
}

static int teardown(void **state)
{
    (void)state;
    return th_daemon_teardown(&daemon_, 10000, tmpdir);
}

/* A running `tally -e ENDPOINT <args...>` with its stdin a pipe from us and its stdout and
 * stderr in files (tmpdir/out, tmpdir/err). */
typedef struct {
    pid_t pid;
    int in; /* write end of its stdin */
} child_t;

static child_t spawn(const char *const *args)
{
    int fds[2];
    /* Close-on-exec: a tallyd the test starts later must not hold the write end open. */
    assert_int_equal(pipe2(fds, O_CLOEXEC), 0);
    child_t c = {.pid = fork(), .in = fds[1]};
    assert_true(c.pid >= 0);
    if (c.pid == 0) {
        char path[128];
        snprintf(path, sizeof path, "%s/out", tmpdir);
        int out = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        snprintf(path, sizeof path, "%s/err", tmpdir);
        int err = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(fds[0], 0);
        dup2(out, 1);
        dup2(err, 2);
        close(fds[1]);
        const char *argv[32] = {th_tally_bin(), "-e", daemon_.endpoint};
        for (int i = 0; args[i] && i < 28; i++)
            argv[3 + i] = args[i];
        if (chdir(tmpdir) != 0)
            _exit(126);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fds[0]);
    return c;
}

/* Closes its stdin and waits: the exit status, and its peak RSS in KiB when rss != NULL. */
static int finish(child_t *c, long *rss_kib)
{
    if (c->in >= 0)
        close(c->in);
    c->in = -1;
    int status;
    struct rusage ru;
    while (wait4(c->pid, &status, 0, &ru) < 0 && errno == EINTR)
        ;
    if (rss_kib)
        *rss_kib = ru.ru_maxrss;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static void put(int fd, const void *data, size_t len)
{
    const uint8_t *p = data;
    while (len) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        assert_true(n > 0);
        p += n;
        len -= (size_t)n;
    }
}

/* A file of the test's folder, whole (NUL-terminated). */
static char *slurp(const char *name)
{
    char path[128];
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    char *text = th_slurp(path);
    assert_non_null(text);
    return text;
}

static void write_file(const char *name, const void *data, size_t len)
{
    assert_int_equal(th_write_file(tmpdir, name, data, len), 0);
}

static tally_stream_info_t query(const char *stream)
{
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(daemon_.endpoint, 10000, &c), TALLY_OK);
    tally_stream_info_t info;
    assert_int_equal(tally_query(c, stream, &info), TALLY_OK);
    tally_client_destroy(&c);
    return info;
}

/* The push's bytes: a pattern the test can count without storing it. */
static uint8_t pattern(uint64_t i)
{
    return (uint8_t)((i * 7 + (i >> 12)) % 251);
}

/* A large input through a pipe: tally's peak RSS stays under 64 MiB, and the histogram is
 * exactly that of the bytes sent. */
static void test_rss_bounded_through_pipe(void **state)
{
    (void)state;
    const char *mb_env = getenv("TALLY_RSS_TEST_MB");
    uint64_t mb = mb_env && *mb_env ? strtoull(mb_env, NULL, 10) : (UNDER_ASAN ? 32 : 256);
    uint64_t total = mb << 20, expect[256] = {0};
    const char *args[] = {"hist", "--type", "u8", NULL};
    child_t c = spawn(args);
    static uint8_t block[1 << 20];
    for (uint64_t at = 0; at < total; at += sizeof block) {
        for (size_t i = 0; i < sizeof block; i++)
            block[i] = pattern(at + i);
        tr_hist(TALLY_DTYPE_U8, block, sizeof block, 0, 0, expect);
        put(c.in, block, sizeof block);
    }
    long rss_kib = 0;
    assert_int_equal(finish(&c, &rss_kib), 0);
    print_message("%" PRIu64 " MiB through a pipe: tally's peak RSS %ld KiB\n", mb, rss_kib);
    if (!UNDER_ASAN)
        assert_true(rss_kib < 64 * 1024);
    char *out = slurp("out"), *line = out;
    for (int b = 0; b < 256; b++) {
        unsigned bin;
        uint64_t count;
        assert_int_equal(sscanf(line, "%u %" SCNu64, &bin, &count), 2);
        assert_int_equal(bin, b);
        assert_int_equal(count, expect[b]);
        line = strchr(line, '\n') + 1;
    }
    assert_string_equal(line, "");
    free(out);
}

/* Reads `name` until it contains `text` or deadline_ms passes. */
static bool wait_for_text(const char *name, const char *text, int deadline_ms)
{
    for (int waited = 0; waited < deadline_ms; waited += 20) {
        char *got = slurp(name);
        bool found = strstr(got, text) != NULL;
        free(got);
        if (found)
            return true;
        usleep(20000);
    }
    return false;
}

/* A live producer's results come out while it is still running, not when it exits. */
static void test_live_pipe_output_before_eof(void **state)
{
    (void)state;
    const char *args[] = {"filter", "--gt", "0", "--text", "--stable", NULL};
    child_t c = spawn(args);
    put(c.in, "5 -3 12 1", 9); /* "1" may be the start of a longer number */
    assert_true(wait_for_text("out", "5\n12\n", 20000)); /* the pipe is still open */
    usleep(300000); /* longer than tally's pause rule: "1" must still wait for its end */
    put(c.in, "7 -2\n", 5);
    assert_int_equal(finish(&c, NULL), 0);
    char *out = slurp("out");
    assert_string_equal(out, "5\n12\n17\n");
    free(out);
}

/* Waits until the stream has applied `bytes` bytes (in however many requests). */
static void wait_bytes(const char *stream, uint64_t bytes)
{
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(daemon_.endpoint, 10000, &c), TALLY_OK);
    for (int i = 0; i < 2000; i++) {
        tally_stream_info_t info;
        if (tally_query(c, stream, &info) == TALLY_OK && info.bytes >= bytes)
            break;
        usleep(10000);
    }
    tally_client_destroy(&c);
}

/* Ctrl-C in the middle of a push: exit 130 and a line with exactly what the stream holds;
 * --resume then sends the rest of the same input, and the stream ends exactly as one push. */
static void test_interrupt_reports_and_resume_finishes(void **state)
{
    (void)state;
    enum { CHUNK = 65536, N = 10 * CHUNK + 1000 };
    uint8_t *data = malloc(N);
    for (size_t i = 0; i < N; i++)
        data[i] = pattern(i);
    write_file("push.bin", data, N);
    const char *args[] = {"hist", "--stream", "ctrlc", "--chunk", "64K", NULL};
    child_t c = spawn(args);
    put(c.in, data, 3 * CHUNK);
    wait_bytes("ctrlc", 3 * CHUNK);
    kill(c.pid, SIGINT);
    assert_int_equal(finish(&c, NULL), 130);
    char *err = slurp("err");
    unsigned long long applied, chunks, bytes, read;
    assert_int_equal(sscanf(err,
                            "tally: hist: interrupted: applied %llu of %llu chunks, %llu of the "
                            "%llu bytes read",
                            &applied, &chunks, &bytes, &read),
                     4);
    assert_int_equal(read, 3 * CHUNK);
    assert_non_null(strstr(err, "re-run with --resume (or --seq-base 0) to continue\n"));
    free(err);
    /* Exactly what the stream holds: every byte written, no more (chunks are 64 KiB unless a
     * pause on a loaded machine made tally send a shorter one). */
    tally_stream_info_t info = query("ctrlc");
    assert_int_equal(bytes, 3 * CHUNK);
    assert_int_equal(applied, chunks);
    assert_int_equal(info.batches, applied);
    assert_int_equal(info.bytes, bytes);
    if (applied != 3) {
        print_message("the pipe paused: chunking differs from the file's, not resuming\n");
        free(data);
        return;
    }
    const char *resume[] = {"hist", "--stream", "ctrlc",    "--chunk", "64K",
                            "--in", "push.bin", "--resume", NULL};
    c = spawn(resume);
    assert_int_equal(finish(&c, NULL), 0);
    info = query("ctrlc");
    assert_int_equal(info.batches, 11); /* 3 + the 8 chunks it did not have */
    assert_int_equal(info.hist_total, N);
    assert_int_equal(info.last_seq, 11);
    uint64_t bins[256] = {0};
    tr_hist(TALLY_DTYPE_U8, data, N, 0, 0, bins);
    assert_memory_equal(info.bins, bins, sizeof bins);
    /* Complete: nothing is left to resume. */
    c = spawn(resume);
    assert_int_equal(finish(&c, NULL), 2);
    err = slurp("err");
    assert_non_null(strstr(err, "--resume: no stopped push to stream 'ctrlc'"));
    free(err);
    free(data);
}

/* A pipe that ends inside an element: the whole elements before it are applied, the partial
 * one is not sent, and the message says both exactly; resuming would not help, so it is not
 * suggested. */
static void test_pipe_ends_inside_element(void **state)
{
    (void)state;
    enum { N = (5 << 19) + 1 }; /* 2.5 MiB and a byte */
    uint8_t *data = calloc(1, N);
    const char *args[] = {"scan", "--stream", "partial",   "--chunk",
                          "1M",   "--out",    "/dev/null", NULL};
    child_t c = spawn(args);
    put(c.in, data, N);
    assert_int_equal(finish(&c, NULL), 2);
    char *err = slurp("err");
    assert_string_equal(err, "tally: stdin is 2621441 bytes, not a whole number of 4-byte i32 "
                             "elements: its last 1 byte was not sent\n"
                             "tally: scan: stopped: applied 3 of 3 chunks, 2621440 of the 2621441 "
                             "bytes read (stream 'partial' is at seq 3, this input's chunks are "
                             "seq 1..3)\n");
    free(err);
    tally_stream_info_t info = query("partial");
    assert_int_equal(info.last_seq, 3);
    assert_int_equal(info.bytes, 2621440);
    free(data);
}

/* A refusal of the input itself (stream_state: the stream histograms bytes, this push i32)
 * stops the push with what was applied and no --resume hint: the same input would be refused
 * again. */
static void test_permanent_error_no_resume_hint(void **state)
{
    (void)state;
    write_file("perm.txt", "1 2 3\n", 6);
    const char *u8[] = {"hist", "--stream", "perm", "--text", "--in", "perm.txt", NULL};
    child_t c = spawn(u8);
    assert_int_equal(finish(&c, NULL), 0);
    static int32_t x[3 << 16];
    write_file("perm.i32", x, sizeof x);
    const char *i32[] = {"hist", "--type",  "i32",  "--range", "0",        "10", "--stream",
                         "perm", "--chunk", "256K", "--in",    "perm.i32", NULL};
    c = spawn(i32);
    assert_int_equal(finish(&c, NULL), 1);
    char *err = slurp("err");
    assert_non_null(strstr(err, "tally: hist: stream_state: "));
    assert_non_null(strstr(err, "tally: hist: stopped: applied 0 of 3 chunks, 0 of 786432 bytes "
                                "(stream 'perm' is at seq 1, this input's chunks are seq 2..4)\n"));
    assert_null(strstr(err, "--resume"));
    free(err);
}

/* tallyd killed (-9) and restarted without the chunks it had acknowledged (its last snapshot
 * is older): the push learns where the stream really is, and reports the chunks and bytes of
 * that same count (it said "applied 0 of 4 chunks, 3145728 bytes" before). */
static void test_restart_lost_chunks_counts_agree(void **state)
{
    (void)state;
    enum { MIB = 1 << 20 };
    char dir[64], ipc[128], state_dir[128];
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-lost"), 0);
    snprintf(ipc, sizeof ipc, "ipc://%s/sock", dir);
    snprintf(state_dir, sizeof state_dir, "%s", dir);
    const char *dargs[] = {"--backend", "cpu",    "--state-dir", state_dir, "--state-interval",
                           "3600",      "--bind", ipc,           NULL};
    th_daemon_t d;
    assert_int_equal(th_daemon_start(&d, dargs), 0);
    const char *args[] = {"-e",      ipc,  "scan",  "--stream",  "lost",
                          "--chunk", "1M", "--out", "/dev/null", NULL};
    child_t c = spawn(args);
    uint8_t *mib = calloc(1, MIB);
    for (int i = 0; i < 3; i++)
        put(c.in, mib, MIB);
    tally_client_t *q = NULL;
    assert_int_equal(tally_client_new(ipc, 10000, &q), TALLY_OK);
    tally_stream_info_t info = {0};
    for (int64_t end = th_now_ms() + 30000; info.last_seq < 3 && th_now_ms() < end;)
        if (tally_query(q, "lost", &info) != TALLY_OK || info.last_seq < 3)
            th_sleep_ms(10);
    assert_int_equal(info.last_seq, 3);
    tally_client_destroy(&q);
    assert_int_equal(th_daemon_stop(&d, SIGKILL, 20000), 128 + SIGKILL);
    assert_int_equal(th_daemon_start(&d, dargs), 0); /* no snapshot had the stream */
    put(c.in, mib, MIB);
    assert_int_equal(finish(&c, NULL), 1);
    char *err = slurp("err");
    print_message("%s", err);
    assert_non_null(strstr(err, "tally: scan: sequence_gap: "));
    assert_non_null(strstr(err,
                           "tally: scan: stopped: applied 0 of 4 chunks, 0 of the 4194304 "
                           "bytes read (stream 'lost' is at seq 0, this input's chunks are seq "
                           "1..4); re-run with --resume (or --seq-base 0) to continue\n"));
    free(err);
    free(mib);
    assert_int_equal(th_daemon_stop(&d, SIGTERM, 20000), 0);
    assert_int_equal(th_rmrf(dir), 0);
}

/* --frames: a chunk holds whole frames, so 100 frames are 100 requests (or 34 of three). */
static void test_frames_never_split(void **state)
{
    (void)state;
    enum { FRAME = 3000, FRAMES = 100 };
    uint8_t *data = malloc(FRAME * FRAMES);
    for (size_t i = 0; i < FRAME * FRAMES; i++)
        data[i] = pattern(i);
    write_file("frames.raw", data, FRAME * FRAMES);
    const char *one[] = {"hist",     "--stream", "f1",      "--in", "frames.raw",
                         "--frames", "3000",     "--chunk", "4K",   NULL};
    child_t c = spawn(one);
    assert_int_equal(finish(&c, NULL), 0);
    assert_int_equal(query("f1").batches, 100);
    const char *three[] = {"hist", "--stream", "f3", "--frames", "3000", "--chunk", "10000", NULL};
    c = spawn(three); /* through the pipe, in pieces that cut frames */
    for (size_t at = 0; at < FRAME * FRAMES; at += 1777)
        put(c.in, data + at, FRAME * FRAMES - at < 1777 ? FRAME * FRAMES - at : 1777);
    assert_int_equal(finish(&c, NULL), 0);
    tally_stream_info_t info = query("f3");
    assert_int_equal(info.hist_total, FRAME * FRAMES);
    assert_true(info.batches >= 34); /* whole frames each: never a frame in two requests */
    assert_int_equal(info.bytes % FRAME, 0);

    write_file("cut.raw", data, FRAME * 2 + 5);
    const char *cut[] = {"hist", "--in", "cut.raw", "--frames", "3000", NULL};
    c = spawn(cut);
    assert_int_equal(finish(&c, NULL), 2);
    char *err = slurp("err");
    assert_string_equal(err, "tally: cut.raw is 6005 bytes, not a whole number of 3000-byte "
                             "frames: nothing was sent\n");
    free(err);
    const char *big[] = {"hist", "--frames", "2M", NULL}; /* a pipe: nothing to check first */
    c = spawn(big);
    assert_int_equal(finish(&c, NULL), 2);
    err = slurp("err");
    assert_non_null(strstr(err, "larger than the daemon's max_batch (1048576 bytes)"));
    free(err);
    free(data);
}

/* Runs tally with args to its end: exit 0, and its whole stderr is `err`. */
static void expect_stderr(const char *const *args, const char *err)
{
    child_t c = spawn(args);
    assert_int_equal(finish(&c, NULL), 0);
    char *got = slurp("err");
    assert_string_equal(got, err);
    free(got);
}

/* --chunk over the daemon's max_batch is capped to it instead of failing with too_large, and a
 * --chunk that is not whole elements (or frames) is rounded down to them; either is said once
 * on stderr (it was silent), a --chunk that is sent as given not at all. */
static void test_chunk_capped_to_max_batch(void **state)
{
    (void)state;
    size_t n = (3u << 20) + 4;
    uint8_t *data = calloc(1, n);
    write_file("three.bin", data, n);
    const char *args[] = {"scan",    "--stream", "cap",   "--in",     "three.bin",
                          "--chunk", "17M",      "--out", "sums.bin", NULL};
    expect_stderr(args, "tally: scan: --chunk 17M: sending chunks of 1048576 bytes (the "
                        "daemon's max_batch)\n");
    assert_int_equal(query("cap").batches, 4); /* 1M + 1M + 1M + 4 bytes */
    free(data);

    write_file("ten.txt", "1 2 3 4 5 6 7 8 9 10\n", 21);
    const char *six[] = {"scan",    "--stream", "six",   "--text",   "--in", "ten.txt",
                         "--chunk", "6",        "--out", "sums.bin", NULL};
    expect_stderr(
        six, "tally: scan: --chunk 6: sending chunks of 4 bytes (whole 4-byte i32 elements)\n");
    assert_int_equal(query("six").batches, 10);
    const char *both[] = {"hist",    "--in", "frames.bin", "--frames", "3000",
                          "--chunk", "2M",   "--out",      "h.bin",    NULL};
    data = calloc(1, 3000 * 400);
    write_file("frames.bin", data, 3000 * 400);
    free(data);
    expect_stderr(both, "tally: hist: --chunk 2M: sending chunks of 1047000 bytes (the daemon's "
                        "max_batch, in whole 3000-byte frames)\n");
    const char *given[] = {"scan", "--text", "--in", "ten.txt", "--chunk", "8", NULL};
    expect_stderr(given, "");
}

/* Decimal text sent as binary is refused (it would be summed as ASCII codes); --binary
 * sends it anyway. */
static void test_text_without_text_refused(void **state)
{
    (void)state;
    write_file("sixteen.txt", "1 2 3 4 5 6 7 8\n", 16);
    const char *args[] = {"scan", "--in", "sixteen.txt", NULL};
    child_t c = spawn(args);
    assert_int_equal(finish(&c, NULL), 2);
    char *err = slurp("err"), *out = slurp("out");
    assert_string_equal(err, "tally: sixteen.txt looks like decimal text ('1 2 3 4 5 6 7 8'), "
                             "not binary i32 elements: add --text to parse it, or --binary to "
                             "send its bytes as they are\n");
    assert_string_equal(out, "");
    free(err);
    free(out);
    const char *binary[] = {"scan", "--in", "sixteen.txt", "--binary", NULL};
    c = spawn(binary);
    assert_int_equal(finish(&c, NULL), 0);
    out = slurp("out");
    assert_string_equal(out, "540155953\n1080442980\n1620861081\n1792311504\n");
    free(out);
}

/* The progress line: on request (or on a terminal) it shows bytes, size and ETA; otherwise
 * stderr stays empty. */
static void test_progress_line(void **state)
{
    (void)state;
    uint8_t *data = calloc(1, 4u << 20);
    write_file("four.bin", data, 4u << 20);
    const char *args[] = {"hist", "--in", "four.bin", "--chunk", "64K", "--progress", NULL};
    child_t c = spawn(args);
    assert_int_equal(finish(&c, NULL), 0);
    char *err = slurp("err");
    assert_non_null(strstr(err, "\r\033[K"));
    assert_non_null(strstr(err, " of 4.0 MiB ("));
    assert_non_null(strstr(err, "/s"));
    free(err);
    const char *quiet[] = {"hist", "--in", "four.bin", "--chunk", "64K", NULL};
    c = spawn(quiet); /* stdout and stderr are files: no progress */
    assert_int_equal(finish(&c, NULL), 0);
    err = slurp("err");
    assert_string_equal(err, "");
    free(err);
    free(data);
}

/* --shm fed from a pipe: the same output as the ZeroMQ path, through a ring of slices. */
static void test_shm_from_pipe(void **state)
{
    (void)state;
    enum { N = 300000 };
    int32_t *x = malloc(4 * N);
    for (size_t i = 0; i < N; i++)
        x[i] = (int32_t)(pattern(i) - 125);
    const char *args[] = {"scan", "--shm", "--chunk", "100K", "--out", "shm.bin", NULL};
    child_t c = spawn(args);
    put(c.in, x, 4 * N);
    assert_int_equal(finish(&c, NULL), 0);
    char path[128];
    snprintf(path, sizeof path, "%s/shm.bin", tmpdir);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    int64_t *sums = malloc(8 * N + 8), *want = malloc(8 * N);
    assert_int_equal(fread(sums, 8, N + 1, f), N);
    fclose(f);
    tr_scan(x, N, false, false, 0, want);
    assert_memory_equal(sums, want, 8 * N);
    free(sums);
    free(want);
    free(x);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rss_bounded_through_pipe),
        cmocka_unit_test(test_live_pipe_output_before_eof),
        cmocka_unit_test(test_interrupt_reports_and_resume_finishes),
        cmocka_unit_test(test_frames_never_split),
        cmocka_unit_test(test_pipe_ends_inside_element),
        cmocka_unit_test(test_permanent_error_no_resume_hint),
        cmocka_unit_test(test_restart_lost_chunks_counts_agree),
        cmocka_unit_test(test_chunk_capped_to_max_batch),
        cmocka_unit_test(test_text_without_text_refused),
        cmocka_unit_test(test_progress_line),
        cmocka_unit_test(test_shm_from_pipe),
    };
    th_seed();
    return cmocka_run_group_tests_name("cli_stream", tests, setup, teardown);
}
