/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_watch.c — `tally watch` in a real terminal: tmux.
 *
 * A tallyd (harness.c; also bound to an ipc:// path in a temporary directory, so a restarted
 * daemon comes back at the same endpoint, with --state-dir so its streams come back too)
 * holds two streams; `tally watch` runs in a detached tmux session of a fixed size on its own
 * tmux server (-L, so nobody's tmux is touched), and the test reads the screen with
 * capture-pane. It checks that the stream names, counts, quantiles and bars appear; that after
 * new data the count and a rate show up; that after resize-window every line fits the new
 * width and the axis spans it; that a daemon stopped says "unreachable" and, restarted,
 * "reconnected" with the stream's counts back; and that 'q' and Ctrl-C both end watch with
 * status 0 and the terminal restored (main screen, cursor shown, canonical mode and echo on).
 *
 * Every wait polls the screen until a generous deadline (CI is a loaded 2-core box). Without
 * tmux the test is skipped (77).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "tally.h"
#include "tally_proto.h"

#define DEADLINE_MS 60000

static char dir[64], ipc[128], pub[128], tmux_sock[64];
static th_daemon_t daemon_;
static const char *const daemon_args[] = {"--state-dir",       dir,   "--bind", ipc, "--pub", pub,
                                          "--pub-interval-ms", "200", NULL};

/* Runs a shell command; its stdout, malloc'ed (NULL-safe: "" when it printed nothing). */
static char *run(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *run(const char *fmt, ...)
{
    char cmd[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t cap = 1 << 16, len = 0;
    char *out = malloc(cap);
    assert_non_null(out);
    size_t n;
    while ((n = fread(out + len, 1, cap - len - 1, p)) > 0) {
        len += n;
        if (len + 1 == cap) {
            out = realloc(out, cap *= 2);
            assert_non_null(out);
        }
    }
    out[len] = '\0';
    pclose(p);
    return out;
}

static char *screen(const char *session)
{
    return run("tmux -L %s capture-pane -p -t %s 2>/dev/null", tmux_sock, session);
}

/* Waits until the screen contains every one of the (NULL-terminated) texts; fails with the
 * last screen otherwise. */
static void wait_screen(const char *session, const char *what, ...)
{
    int64_t deadline = th_now_ms() + DEADLINE_MS;
    for (;;) {
        char *s = screen(session);
        bool all = true;
        va_list ap;
        va_start(ap, what);
        for (const char *t = what; t; t = va_arg(ap, const char *))
            all = all && strstr(s, t);
        va_end(ap);
        if (all) {
            free(s);
            return;
        }
        if (th_now_ms() > deadline)
            fail_msg("screen never showed '%s' (and the rest); it shows:\n%s", what, s);
        free(s);
        th_sleep_ms(200);
    }
}

/* Starts `tally watch ARGS` in a new session of cols x rows, through a script that, when
 * watch exits, writes its status and `stty -a` to DIR/SESSION.status and DIR/SESSION.stty. */
static void start_watch(const char *session, int cols, int rows, const char *args)
{
    char script[160];
    snprintf(script, sizeof script, "%s/%s.sh", dir, session);
    FILE *f = fopen(script, "w");
    assert_non_null(f);
    /* The script survives the Ctrl-C it passes on (as an interactive shell would); the
     * handler is reset for watch by exec, so watch sees SIGINT as usual. */
    fprintf(f,
            "trap true INT\n"
            "'%s' -e '%s' watch %s\n"
            "echo $? > '%s/%s.status.tmp'\n"
            "stty -a > '%s/%s.stty'\n"
            "mv '%s/%s.status.tmp' '%s/%s.status'\n"
            "exec sleep 600\n",
            getenv("TALLY_BIN"), ipc, args, dir, session, dir, session, dir, session, dir, session);
    fclose(f);
    char *out = run("tmux -L %s -f /dev/null new-session -d -s %s -x %d -y %d 'sh %s' 2>&1; "
                    "echo rc=$?",
                    tmux_sock, session, cols, rows, script);
    if (!strstr(out, "rc=0"))
        fail_msg("tmux new-session failed: %s", out);
    free(out);
}

/* Waits for watch to exit; returns its exit status. */
static int wait_exit(const char *session)
{
    char path[160];
    snprintf(path, sizeof path, "%s/%s.status", dir, session);
    int64_t deadline = th_now_ms() + DEADLINE_MS;
    for (;;) {
        FILE *f = fopen(path, "r");
        int status = -1;
        if (f && fscanf(f, "%d", &status) == 1) {
            fclose(f);
            return status;
        }
        if (f)
            fclose(f);
        if (th_now_ms() > deadline) {
            char *s = screen(session);
            fail_msg("watch did not exit; the screen:\n%s", s);
        }
        th_sleep_ms(200);
    }
}

/* After watch exited: the terminal is back to the main screen with the cursor shown, and the
 * line discipline is canonical with echo again. */
static void expect_terminal_restored(const char *session)
{
    char *flags = run("tmux -L %s display-message -p -t %s '#{alternate_on}'", tmux_sock, session);
    assert_string_equal(flags, "0\n");
    free(flags);
    char *stty = run("cat %s/%s.stty", dir, session);
    assert_non_null(strstr(stty, " icanon"));
    assert_null(strstr(stty, "-icanon"));
    assert_non_null(strstr(stty, " echo "));
    free(stty);
}

/* Hist data on a stream through libtally: u8 values i % 100, or i32 values i % 1000 over
 * [0, 1000). */
static void push(const char *stream, tally_dtype_t dtype, size_t n)
{
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(ipc, 20000, &c), TALLY_OK);
    tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = (uint8_t)dtype};
    if (dtype == TALLY_DTYPE_I32)
        req.lo = 0, req.hi = 1000;
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    size_t size = tally_dtype_size(dtype);
    uint8_t *data = malloc(n * size);
    assert_non_null(data);
    for (size_t i = 0; i < n; i++) {
        if (size == 1)
            data[i] = (uint8_t)(i % 100);
        else
            tally_put_u32(data + 4 * i, (uint32_t)(i % 1000));
    }
    tally_buf_t out = {0};
    tally_run_opts_t opts = {.seq = TALLY_RUN_SEQ_OFF};
    assert_int_equal(tally_run(c, &req, data, n * size, &opts, &out, NULL), TALLY_OK);
    tally_buf_free(&out);
    free(data);
    tally_client_destroy(&c);
}

static int setup(void **state)
{
    (void)state;
    char *v = run("tmux -V 2>/dev/null");
    bool have_tmux = strncmp(v, "tmux ", 5) == 0;
    free(v);
    if (!have_tmux) {
        fprintf(stderr, "tmux is not installed: skipped\n");
        exit(77);
    }
    if (!getenv("TALLY_BIN"))
        return -1;
    snprintf(dir, sizeof dir, "/tmp/tally-watch-XXXXXX");
    if (!mkdtemp(dir))
        return -1;
    snprintf(ipc, sizeof ipc, "ipc://%s/sock", dir);
    snprintf(pub, sizeof pub, "ipc://%s/pub", dir);
    snprintf(tmux_sock, sizeof tmux_sock, "tally-test-%d", (int)getpid());
    return th_daemon_start(&daemon_, daemon_args);
}

static int teardown(void **state)
{
    (void)state;
    free(run("tmux -L %s kill-server 2>/dev/null", tmux_sock));
    int status = daemon_.pid > 0 ? th_daemon_stop(&daemon_, SIGTERM, 20000) : 0;
    free(run("rm -rf '%s'", dir));
    return status == 0 ? 0 : -1;
}

/* Every line of the screen at most `cols` wide, and cam0's axis line (its u8 range, "0" at the
 * left, "255" at the right) exactly `cols` wide: the bars were folded to the new width. */
static void expect_width(const char *session, int cols)
{
    int64_t deadline = th_now_ms() + DEADLINE_MS;
    for (;;) {
        char *s = screen(session);
        bool axis = false, fits = true;
        for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n")) {
            size_t len = strlen(line);
            fits = fits && len <= (size_t)cols;
            axis = axis || (len == (size_t)cols && line[0] == '0' && line[1] == ' ' &&
                            !strcmp(line + len - 4, " 255"));
        }
        free(s);
        if (axis && fits)
            return;
        if (th_now_ms() > deadline) {
            s = screen(session);
            fail_msg("the screen is not %d columns wide:\n%s", cols, s);
        }
        th_sleep_ms(200);
    }
}

static void test_watch_live(void **state)
{
    (void)state;
    push("cam0", TALLY_DTYPE_U8, 100000);
    push("temp", TALLY_DTYPE_I32, 5000);
    start_watch("w", 100, 30, "--interval 0.5 --ascii cam0 temp");
    /* Values i % 100: p50 is 49, p90 89, p99 98; the i32 stream 0..999: p50 499. */
    wait_screen("w", "cam0  u8  count 100k", "p50 49  p90 89  p99 98", "temp  i32  count 5.00k",
                "p50 499", "#", NULL);
    expect_width("w", 100);

    /* New data: the count follows, and a rate appears. */
    push("cam0", TALLY_DTYPE_U8, 100000);
    wait_screen("w", "cam0  u8  count 200k", NULL);
    char *s = screen("w");
    assert_non_null(strstr(s, "rate "));
    free(s);

    char *out = run("tmux -L %s resize-window -t w -x 60 -y 20 2>&1", tmux_sock);
    assert_string_equal(out, "");
    free(out);
    expect_width("w", 60);

    /* The daemon goes away, then comes back at the same endpoint with its state. The status
     * line says why it is unreachable (nothing accepts the connection), not "timed out". */
    assert_int_equal(th_daemon_stop(&daemon_, SIGTERM, 20000), 0);
    wait_screen("w", "unreachable", "(cannot connect: ", NULL);
    s = screen("w");
    assert_null(strstr(s, "timed out"));
    free(s);
    assert_int_equal(th_daemon_start(&daemon_, daemon_args), 0);
    wait_screen("w", "reconnected", "cam0  u8  count 200k", NULL);

    out = run("tmux -L %s send-keys -t w q", tmux_sock);
    free(out);
    assert_int_equal(wait_exit("w"), 0);
    expect_terminal_restored("w");
}

static void test_watch_ctrl_c_and_unknown(void **state)
{
    (void)state;
    start_watch("c", 80, 24, "--ascii never-made");
    wait_screen("c", "never-made  no such stream (yet)", NULL);
    char *out = run("tmux -L %s send-keys -t c C-c", tmux_sock);
    free(out);
    assert_int_equal(wait_exit("c"), 0);
    expect_terminal_restored("c");
}

/* More streams than the screen holds: the ones that fit are drawn, and a last line says how
 * many more there are and which, never silently fewer. A taller screen shows them all. */
static void test_watch_small_terminal(void **state)
{
    (void)state;
    push("small1", TALLY_DTYPE_U8, 100);
    push("small2", TALLY_DTYPE_U8, 100);
    push("small3", TALLY_DTYPE_U8, 100);
    /* 10 lines: title and status, then 3 a stream at least (header, a bar row, the axis) and
     * a line kept for "+N more": two streams fit (2 + 3 + 3 + 1), all three would take 11. */
    start_watch("m", 80, 10, "--interval 0.5 --ascii small1 small2 small3");
    wait_screen("m", "small1  u8  count 100", "small2  u8  count 100",
                "+1 more (make the terminal taller): small3", NULL);
    char *s = screen("m");
    assert_null(strstr(s, "small3  u8"));
    free(s);
    char *out = run("tmux -L %s resize-window -t m -x 80 -y 30 2>&1", tmux_sock);
    assert_string_equal(out, "");
    free(out);
    wait_screen("m", "small3  u8  count 100", NULL);
    s = screen("m");
    assert_null(strstr(s, "more (make"));
    free(s);
    free(run("tmux -L %s send-keys -t m q", tmux_sock));
    assert_int_equal(wait_exit("m"), 0);
}

/* --sub: with an interval of an hour, only tallyd's publications can bring new counts. */
static void test_watch_sub(void **state)
{
    (void)state;
    push("subbed", TALLY_DTYPE_U8, 1000);
    char args[256];
    snprintf(args, sizeof args, "--interval 1h --ascii --sub %s subbed", pub);
    start_watch("s", 100, 20, args);
    wait_screen("s", "subbed  u8  count 1.00k", NULL);
    /* The subscription may take a moment to connect: push until a publication shows. */
    int64_t deadline = th_now_ms() + DEADLINE_MS;
    char *s = NULL;
    for (;;) {
        push("subbed", TALLY_DTYPE_U8, 1000);
        th_sleep_ms(500);
        free(s);
        s = screen("s");
        if (!strstr(s, "count 1.00k") && strstr(s, "subbed  u8  count "))
            break;
        if (th_now_ms() > deadline)
            fail_msg("no publication reached watch --sub; the screen:\n%s", s);
    }
    assert_non_null(strstr(s, "rate "));
    assert_null(strstr(s, "rate -")); /* two publications apart: a rate */
    free(s);
    free(run("tmux -L %s send-keys -t s q", tmux_sock));
    assert_int_equal(wait_exit("s"), 0);
}

/* --sub with CURVE: watch subscribes with the keys it queries with (--server-key, --client-key),
 * and tallyd's PUB socket, a CURVE server then, serves it. */
static void test_watch_sub_curve(void **state)
{
    (void)state;
    char cdir[128], server_key[192], clients[192], client_key[192], cipc[192], cpub[192];
    char server_pub[41], server_sec[41], alice_pub[41], alice_sec[41];
    snprintf(cdir, sizeof cdir, "%s/curve", dir);
    assert_int_equal(mkdir(cdir, 0700), 0);
    assert_int_equal(th_curve_dir(cdir, "alice", server_pub, server_sec, alice_pub, alice_sec,
                                  server_key, clients, sizeof server_key),
                     0);
    snprintf(client_key, sizeof client_key, "%s/alice.key", cdir);
    assert_int_equal(th_write_key_file(client_key, alice_pub, alice_sec, 0600), 0);
    char server_pub_file[192]; /* Z85 has shell characters: the key goes by its file */
    snprintf(server_pub_file, sizeof server_pub_file, "%s/server.pub", cdir);
    assert_int_equal(th_write_key_file(server_pub_file, server_pub, NULL, 0644), 0);
    snprintf(cipc, sizeof cipc, "ipc://%s/sock", cdir);
    snprintf(cpub, sizeof cpub, "ipc://%s/pub", cdir);
    const char *args[] = {"--bind",
                          cipc,
                          "--pub",
                          cpub,
                          "--pub-interval-ms",
                          "200",
                          "--curve-secret-key",
                          server_key,
                          "--curve-clients-dir",
                          clients,
                          NULL};
    th_daemon_t curved;
    th_use_curve(server_pub, alice_pub, alice_sec);
    assert_int_equal(th_daemon_start(&curved, args), 0);
    tally_curve_keys_t keys = {0};
    memcpy(keys.server_public, server_pub, 41);
    memcpy(keys.client_public, alice_pub, 41);
    memcpy(keys.client_secret, alice_sec, 41);
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new_curve(cipc, 20000, &keys, &c), TALLY_OK);
    uint8_t data[1000] = {0};
    tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    assert_int_equal(tally_req_set_stream(&req, "secret"), TALLY_OK);
    tally_reply_t reply;
    tally_reply_init(&reply);
    assert_int_equal(tally_call(c, &req, data, sizeof data, &reply), TALLY_OK);
    char wargs[1024];
    snprintf(wargs, sizeof wargs,
             "-e %s --server-key %s --client-key %s --interval 1h --ascii --sub %s secret", cipc,
             server_pub_file, client_key, cpub);
    start_watch("k", 100, 20, wargs);
    wait_screen("k", "secret  u8  count 1.00k", NULL);
    int64_t deadline = th_now_ms() + DEADLINE_MS;
    char *s = NULL;
    for (;;) { /* only a publication brings a new count within the hour */
        tally_reply_clear(&reply);
        assert_int_equal(tally_call(c, &req, data, sizeof data, &reply), TALLY_OK);
        th_sleep_ms(500);
        free(s);
        s = screen("k");
        if (!strstr(s, "count 1.00k") && strstr(s, "secret  u8  count "))
            break;
        if (th_now_ms() > deadline)
            fail_msg("no publication reached watch --sub with CURVE; the screen:\n%s", s);
    }
    free(s);
    tally_reply_clear(&reply);
    tally_client_destroy(&c);
    free(run("tmux -L %s send-keys -t k q", tmux_sock));
    assert_int_equal(wait_exit("k"), 0);
    assert_int_equal(th_daemon_stop(&curved, SIGTERM, 20000), 0);
    th_use_curve(NULL, NULL, NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_watch_live),
        cmocka_unit_test(test_watch_ctrl_c_and_unknown),
        cmocka_unit_test(test_watch_small_terminal),
        cmocka_unit_test(test_watch_sub),
        cmocka_unit_test(test_watch_sub_curve),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
