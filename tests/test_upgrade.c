/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_upgrade.c — upgrades keep the data: the state file an earlier release wrote
 * (tests/data/state-v3/streams.state, by make_state_fixture against that release) is restored by
 * this tallyd, and every stream answers `query` (plain, and windows of 1, 10 and 60 s) byte for
 * byte as that release answered it (tests/data/state-v3/expected.bin), with the same window
 * bounds, and again after this tallyd rewrote it in its own format (version 4) at its first
 * snapshot; a state file or log of a newer format version is refused at start (exit status 1)
 * with a message saying so, and left where it is, byte for byte, nothing set aside.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"
#include "tally_proto.h"
#include "td_state_record.h" /* td_state_crc, to reseal a header */

#ifndef TALLY_TEST_DATA
#error "TALLY_TEST_DATA must name tests/data"
#endif

/* The whole file at path in *len bytes (malloc'ed). */
static uint8_t *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    assert_true(n >= 0);
    rewind(f);
    uint8_t *buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static void copy_file(const char *from, const char *dir, const char *name)
{
    size_t len = 0;
    uint8_t *buf = slurp(from, &len);
    assert_int_equal(th_write_file(dir, name, buf, len), 0);
    free(buf);
}

/* Queries stream (window_ms 0: plain) and checks the reply against the expected entry. */
static void check_entry(void *sock, const char *name, uint32_t window_ms, uint64_t aux0,
                        uint64_t aux1, const uint8_t *record, uint32_t len)
{
    static uint64_t id;
    tally_req_t q = th_req(TALLY_OP_QUERY, TALLY_DTYPE_NONE, ++id);
    q.stream_len = (uint8_t)strlen(name);
    memcpy(q.stream, name, q.stream_len);
    if (window_ms) {
        q.flags = TALLY_FLAG_QUERY_WINDOW;
        q.lo = window_ms;
    }
    th_reply_t r;
    int st = th_call_reply_status(sock, &q, NULL, 0, &r);
    if (st != TALLY_OK)
        fail_msg("stream %s window %u: status %d (%s)", name, window_ms, st,
                 r.payload ? (const char *)r.payload : "");
    assert_int_equal(r.len, len);
    if (memcmp(r.payload, record, len) != 0)
        fail_msg("stream %s window %u: the record differs", name, window_ms);
    assert_int_equal(r.rep.aux0, aux0);
    assert_int_equal(r.rep.aux1, aux1);
    th_reply_free(&r);
}

/* Starts tallyd on dir at the fixture's clock and checks every expected entry; stops it
 * (SIGTERM: its final snapshot). */
static void check_all(const char *dir)
{
    char clock[300];
    size_t len = 0;
    uint8_t *exp = slurp(TALLY_TEST_DATA "/state-v3/expected.bin", &len);
    assert_true(len >= 24);
    assert_memory_equal(exp, "TLYDEXPT", 8);
    assert_int_equal(tally_get_u32(exp + 8), 1);
    uint32_t entries = tally_get_u32(exp + 12);
    snprintf(clock, sizeof clock, "%s/clock", dir);
    assert_int_equal(th_write_clock(clock, tally_get_u64(exp + 16)), 0);
    th_daemon_t d;
    const char *args[] = {"--state-dir", dir, "--test-clock", clock, NULL};
    assert_int_equal(th_daemon_start(&d, args), 0);
    void *sock = th_connect(d.endpoint, 5000);
    size_t at = 24;
    unsigned streams = 0;
    for (uint32_t i = 0; i < entries; i++) {
        assert_true(at + 1 <= len);
        char name[TALLY_STREAM_NAME_MAX + 1] = "";
        uint8_t name_len = exp[at++];
        assert_true(at + name_len + 24 <= len);
        memcpy(name, exp + at, name_len);
        at += name_len;
        uint32_t window_ms = tally_get_u32(exp + at);
        uint64_t aux0 = tally_get_u64(exp + at + 4), aux1 = tally_get_u64(exp + at + 12);
        uint32_t rec_len = tally_get_u32(exp + at + 20);
        at += 24;
        assert_true(at + rec_len <= len);
        check_entry(sock, name, window_ms, aux0, aux1, exp + at, rec_len);
        at += rec_len;
        streams += window_ms == 0;
    }
    assert_int_equal(at, len);
    assert_int_equal(streams, 11);
    assert_int_equal(th_stat(sock, "tallyd_streams"), 11);
    free(exp);
    assert_int_equal(th_close_and_stop(sock, &d, 10000), 0);
}

/* Every stream of the earlier release's file answers as it did there; and again once this
 * tallyd has written them in its own format. */
static void test_earlier_release_restores_byte_for_byte(void **state)
{
    (void)state;
    char dir[256], path[300];
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-upgrade"), 0);
    copy_file(TALLY_TEST_DATA "/state-v3/streams.state", dir, "streams.state");
    check_all(dir);
    size_t len = 0;
    snprintf(path, sizeof path, "%s/streams.state", dir);
    uint8_t *now = slurp(path, &len);
    assert_int_equal(tally_get_u32(now + 8), 4); /* rewritten in this tallyd's format */
    free(now);
    check_all(dir);
    assert_int_equal(th_rmrf(dir), 0);
}

/* tallyd on dir: its exit status (it must exit within 10 s), its stderr in log (cap bytes).
 * Its request endpoint is an ipc:// path in dir, not a TCP port that another test's process
 * could take before tallyd binds it (the refusal asserted is about the state files). */
static int run_to_exit(const char *dir, char *log, size_t cap)
{
    char endpoint[300], log_path[300];
    snprintf(endpoint, sizeof endpoint, "ipc://%s/tallyd.sock", dir);
    snprintf(log_path, sizeof log_path, "%s/tallyd.log", dir);
    const char *args[] = {"--bind", endpoint, "--backend", "cpu", "--state-dir",
                          dir,      "--shm",  "off",       NULL};
    int status = th_daemon_run_to_exit(args, log_path, 10000);
    char *text = th_slurp(log_path);
    snprintf(log, cap, "%s", text ? text : "");
    free(text);
    remove(log_path);
    return status;
}

/* The file named `file` in dir, its version made `version` (its header resealed): tallyd
 * refuses to start, says why, and leaves every file as it was. */
static void expect_refused(const char *dir, const char *file, uint32_t version)
{
    char path[300], log[8192];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    size_t len = 0;
    uint8_t *buf = slurp(path, &len);
    tally_put_u32(buf + 8, version);
    tally_put_u32(buf + 36, td_state_crc(buf, 36));
    assert_int_equal(th_write_file(dir, file, buf, len), 0);
    assert_int_equal(run_to_exit(dir, log, sizeof log), 1);
    char want[128];
    snprintf(want, sizeof want, "was written by a newer tallyd (format version %u;", version);
    if (!strstr(log, want) || !strstr(log, path))
        fail_msg("no refusal naming %s in the log:\n%s", path, log);
    size_t after_len = 0;
    uint8_t *after = slurp(path, &after_len);
    assert_int_equal(after_len, len);
    assert_memory_equal(after, buf, len);
    free(after);
    tally_put_u32(buf + 8, 4); /* as it was */
    tally_put_u32(buf + 36, td_state_crc(buf, 36));
    assert_int_equal(th_write_file(dir, file, buf, len), 0);
    free(buf);
}

static void test_newer_format_refused(void **state)
{
    (void)state;
    char dir[256];
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-newer"), 0);
    copy_file(TALLY_TEST_DATA "/state-v3/streams.state", dir, "streams.state");
    check_all(dir); /* now a version-4 state file and log */
    expect_refused(dir, "streams.state", 5);
    expect_refused(dir, "streams.log", 5);
    expect_refused(dir, "streams.state", 0x01000000);
    check_all(dir); /* restored as they were: every stream still there */
    char cmd[400];
    snprintf(cmd, sizeof cmd, "ls %s | grep -c corrupt >/dev/null", dir);
    assert_int_not_equal(system(cmd), 0); /* nothing was set aside */
    assert_int_equal(th_rmrf(dir), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_earlier_release_restores_byte_for_byte),
        cmocka_unit_test(test_newer_format_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
