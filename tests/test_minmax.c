/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_minmax.c — the `minmax` operation (PROTOCOL.md §5, opcode 13), the proof that an
 * operation is added through the table (CONTRIBUTING.md): its CPU kernel against a plain loop,
 * then tallyd's answers on the CPU backend and on the GPU path (`--backend cuda
 * --test-sim-gpus 1`, the simulated engine; tests/test_differential.c runs it on real GPUs),
 * through raw requests (the reply header, the payload bytes, every refusal PROTOCOL.md lists),
 * libtally (tally_minmax, several chunks) and the CLI (`tally minmax`).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "harness.h"
#include "reference.h"
#include "tally.h"
#include "tk_backend.h"

/* ---- the CPU kernel ----------------------------------------------------------------------- */

static void test_cpu_kernel(void **state)
{
    (void)state;
    tk_backend_t *cpu = NULL;
    assert_int_equal(tk_cpu_backend_new(&cpu), TALLY_OK);
    int32_t *v = th_random_i32(100003, INT32_MIN, INT32_MAX);
    v[777] = INT32_MIN;
    v[100002] = INT32_MAX;
    int64_t min = TK_MINMAX_EMPTY_MIN, max = TK_MINMAX_EMPTY_MAX, rmin, rmax;
    /* lengths around the vector widths, and all of it */
    static const size_t lengths[] = {1,  2,  7,  8,  9,  15, 16,   17,
                                     31, 32, 33, 63, 64, 65, 1000, 100003};
    for (size_t i = 0; i < sizeof lengths / sizeof lengths[0]; i++) {
        size_t n = lengths[i];
        min = TK_MINMAX_EMPTY_MIN, max = TK_MINMAX_EMPTY_MAX;
        assert_int_equal(cpu->minmax(cpu->ctx, TALLY_DTYPE_I32, v, n, &min, &max), TALLY_OK);
        tr_minmax(TALLY_DTYPE_I32, v, n, &rmin, &rmax);
        assert_int_equal(min, rmin);
        assert_int_equal(max, rmax);
    }
    assert_int_equal(min, INT32_MIN);
    assert_int_equal(max, INT32_MAX);
    uint8_t bytes[] = {9, 200, 3, 17, 255, 4};
    uint16_t words[] = {60000, 7, 65535, 12, 0x8000};
    min = TK_MINMAX_EMPTY_MIN, max = TK_MINMAX_EMPTY_MAX;
    assert_int_equal(cpu->minmax(cpu->ctx, TALLY_DTYPE_U8, bytes, 6, &min, &max), TALLY_OK);
    assert_int_equal(min, 3);
    assert_int_equal(max, 255);
    /* folding: a second batch only widens the pair */
    assert_int_equal(cpu->minmax(cpu->ctx, TALLY_DTYPE_U16, words, 5, &min, &max), TALLY_OK);
    assert_int_equal(min, 3);
    assert_int_equal(max, 65535);
    min = TK_MINMAX_EMPTY_MIN, max = TK_MINMAX_EMPTY_MAX;
    assert_int_equal(cpu->minmax(cpu->ctx, TALLY_DTYPE_U16, words, 5, &min, &max), TALLY_OK);
    assert_int_equal(min, 7);
    /* an empty batch leaves the pair; a type minmax does not take is refused */
    assert_int_equal(cpu->minmax(cpu->ctx, TALLY_DTYPE_I32, NULL, 0, &min, &max), TALLY_OK);
    assert_int_equal(min, 7);
    assert_int_equal(max, 65535);
    assert_int_equal(cpu->minmax(cpu->ctx, TALLY_DTYPE_U64, words, 1, &min, &max), TALLY_E_PARAM);
    assert_int_equal(cpu->minmax(cpu->ctx, TALLY_DTYPE_RGB8, bytes, 2, &min, &max), TALLY_E_PARAM);
    free(v);
    cpu->destroy(&cpu);
}

/* ---- tallyd ------------------------------------------------------------------------------ */

static th_daemon_t daemon_;
static void *sock;

static int start(const char *const *args)
{
    if (th_daemon_start(&daemon_, args) != 0)
        return -1;
    sock = th_connect(daemon_.endpoint, 10000);
    return sock ? 0 : -1;
}

static int setup_cpu(void **state)
{
    (void)state;
    static const char *const args[] = {"--backend", "cpu", "--max-batch", "1M", NULL};
    return start(args);
}

static int setup_gpu(void **state)
{
    (void)state;
    static const char *const args[] = {"--backend", "cuda", "--test-sim-gpus", "1", "--max-batch",
                                       "1M",        NULL};
    return start(args);
}

static int teardown(void **state)
{
    (void)state;
    return th_close_and_stop(sock, &daemon_, 10000) == 0 ? 0 : -1;
}

/* A minmax of n elements of dtype: the reply PROTOCOL.md §5 describes, against the reference. */
static void expect_minmax(uint8_t dtype, const void *payload, size_t n)
{
    tally_req_t req = th_req(TALLY_OP_MINMAX, dtype, 5);
    size_t esize = tally_dtype_size((tally_dtype_t)dtype);
    th_reply_t r;
    assert_int_equal(th_call(sock, &req, payload, n * esize, &r), 0);
    assert_int_equal(r.rep.status, TALLY_OK);
    assert_int_equal(r.rep.opcode, TALLY_OP_MINMAX);
    assert_int_equal(r.rep.dtype, dtype);
    assert_int_equal(r.rep.aux0, n);
    assert_int_equal(r.rep.count, n ? 2 : 0);
    assert_int_equal(r.len, n ? 2 * esize : 0);
    if (n) { /* min then max, each esize bytes little-endian */
        int64_t min, max;
        tr_minmax(dtype, payload, n, &min, &max);
        uint8_t want[16];
        for (size_t b = 0; b < esize; b++) {
            want[b] = (uint8_t)((uint64_t)min >> (8 * b));
            want[esize + b] = (uint8_t)((uint64_t)max >> (8 * b));
        }
        assert_memory_equal(r.payload, want, 2 * esize);
    }
    th_reply_free(&r);
}

static void test_daemon_answers(void **state)
{
    (void)state;
    int32_t *v = th_random_i32(200000, -1000000, 1000000);
    v[4] = INT32_MIN;
    v[199999] = INT32_MAX;
    expect_minmax(TALLY_DTYPE_I32, v, 200000);
    expect_minmax(TALLY_DTYPE_I32, v + 5, 3);
    expect_minmax(TALLY_DTYPE_I32, v, 1);
    expect_minmax(TALLY_DTYPE_I32, v, 0); /* empty: count 0, no payload */
    uint8_t bytes[] = {9, 200, 3, 17, 255, 4, 3};
    expect_minmax(TALLY_DTYPE_U8, bytes, sizeof bytes);
    expect_minmax(TALLY_DTYPE_U8, bytes, 0);
    uint16_t words[] = {60000, 7, 65535, 12, 0x8000};
    expect_minmax(TALLY_DTYPE_U16, words, 5);
    free(v);
}

/* Every refusal PROTOCOL.md lists for minmax, each answered once with its status. */
static void test_daemon_refusals(void **state)
{
    (void)state;
    int32_t x[4] = {1, 2, 3, 4};
    tally_req_t req = th_req(TALLY_OP_MINMAX, TALLY_DTYPE_U64, 6);
    assert_int_equal(th_call_status(sock, &req, x, 16), TALLY_E_DTYPE);
    req.dtype = TALLY_DTYPE_RGB8;
    assert_int_equal(th_call_status(sock, &req, x, 6), TALLY_E_DTYPE);
    req.dtype = TALLY_DTYPE_NONE;
    assert_int_equal(th_call_status(sock, &req, NULL, 0), TALLY_E_DTYPE);
    req = th_req(TALLY_OP_MINMAX, TALLY_DTYPE_I32, 7);
    assert_int_equal(th_call_status(sock, &req, x, 15), TALLY_E_PAYLOAD);
    req.flags = TALLY_FLAG_SHM_REF;
    assert_int_equal(th_call_status(sock, &req, x, 16), TALLY_E_PARAM);
    req.flags = 0;
    req.lo = 1;
    assert_int_equal(th_call_status(sock, &req, x, 16), TALLY_E_PARAM);
    req.lo = 0;
    assert_int_equal(tally_req_set_stream(&req, "cam0"), TALLY_OK);
    assert_int_equal(th_call_status(sock, &req, x, 16), TALLY_E_STREAM_NAME);
    assert_int_equal(tally_req_set_stream(&req, NULL), TALLY_OK);
    req.seq = 1;
    assert_int_equal(th_call_status(sock, &req, x, 16), TALLY_E_PARAM);
    req.seq = 0;
    uint8_t *big = calloc(1, (1u << 20) + 4);
    assert_non_null(big);
    assert_int_equal(th_call_status(sock, &req, big, (1u << 20) + 4), TALLY_E_TOO_LARGE);
    free(big);
    /* and it left no stream behind */
    tally_req_t streams = th_req(TALLY_OP_STREAMS, TALLY_DTYPE_NONE, 8);
    th_reply_t r;
    assert_int_equal(th_call(sock, &streams, NULL, 0, &r), 0);
    assert_int_equal(r.len, 0);
    th_reply_free(&r);
}

/* libtally: tally_minmax over several chunks (one request each), and the CLI. */
static void test_client_and_cli(void **state)
{
    (void)state;
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(daemon_.endpoint, 10000, &c), TALLY_OK);
    size_t n = 3 * (1u << 20) / 4 + 11; /* more than max_batch: four chunks */
    int32_t *v = th_random_i32(n, -50, 50);
    v[n - 1] = -51;
    v[n / 2] = 4000;
    int64_t min = 0, max = 0;
    assert_int_equal(tally_minmax(c, TALLY_DTYPE_I32, v, n * 4, &min, &max), TALLY_OK);
    assert_int_equal(min, -51);
    assert_int_equal(max, 4000);
    assert_int_equal(tally_minmax(c, TALLY_DTYPE_U16, v, 0, &min, &max), TALLY_OK);
    assert_true(min == INT64_MAX && max == INT64_MIN); /* empty: min > max */
    assert_int_equal(tally_minmax(c, TALLY_DTYPE_U64, v, 8, &min, &max), TALLY_E_ARG);
    tally_client_destroy(&c);
    free(v);

    char dir[128];
    assert_int_equal(th_tmpdir(dir, sizeof dir, "tally-minmax"), 0);
    assert_int_equal(th_write_file(dir, "i32.txt", "5 -3 12 0\n", 10), 0);
    assert_int_equal(th_write_file(dir, "u16.txt", "65535 2 300\n", 12), 0);
    th_cli_t r = th_cli(dir, daemon_.endpoint, "minmax --text < i32.txt");
    assert_int_equal(r.status, 0);
    assert_string_equal(r.out, "min -3\nmax 12\n");
    th_cli_free(&r);
    r = th_cli(dir, daemon_.endpoint, "minmax --type u16 --text < u16.txt");
    assert_int_equal(r.status, 0);
    assert_string_equal(r.out, "min 2\nmax 65535\n");
    th_cli_free(&r);
    r = th_cli(dir, daemon_.endpoint, "minmax --type rgb --text </dev/null");
    assert_int_equal(r.status, 2);
    assert_non_null(strstr(r.err, "--type: 'rgb' is not i32, u8 or u16"));
    th_cli_free(&r);
    r = th_cli(dir, daemon_.endpoint, "minmax --stream cam0 --text </dev/null");
    assert_int_equal(r.status, 2);
    assert_non_null(strstr(r.err, "minmax takes no --stream"));
    th_cli_free(&r);
    r = th_cli(dir, daemon_.endpoint, "minmax --text </dev/null");
    assert_int_equal(r.status, 0);
    assert_string_equal(r.out, ""); /* no element: nothing to print */
    th_cli_free(&r);
    assert_int_equal(th_rmrf(dir), 0);
}

/* Each data command's options come from its operation's row (tally_ops.h): minmax takes no
 * stream and no shared-memory reference, so its --help, its completion and its parser have
 * none of their options (they listed --stream, --shm, --gpu-region, --resume, --seq-base and
 * --no-seq, which it then refused); scan, which takes both, keeps every one. */
static void test_cli_options_follow_the_row(void **state)
{
    (void)state;
    static const char *const ruled_out[] = {"--stream", "--shm",      "--gpu-region",
                                            "--resume", "--seq-base", "--no-seq"};
    th_cli_t mm = th_cli(".", daemon_.endpoint, "minmax --help");
    th_cli_t scan = th_cli(".", daemon_.endpoint, "scan --help");
    th_cli_t table = th_cli(".", daemon_.endpoint, "--complete");
    assert_int_equal(mm.status, 0);
    assert_int_equal(scan.status, 0);
    assert_int_equal(table.status, 0);
    char *line = strstr(table.out, "\nminmax ");
    assert_non_null(line);
    line[strcspn(line + 1, "\n") + 1] = '\0'; /* minmax's line of the completion table */
    for (size_t i = 0; i < sizeof ruled_out / sizeof ruled_out[0]; i++) {
        char word[32], with_arg[32], refused[48]; /* the table writes --seq-base= */
        snprintf(word, sizeof word, " %s ", ruled_out[i]);
        snprintf(with_arg, sizeof with_arg, " %s=", ruled_out[i]);
        snprintf(refused, sizeof refused, "minmax takes no %s", ruled_out[i]);
        if (strstr(mm.out, word) || strstr(line, word) || strstr(line, with_arg))
            fail_msg("minmax lists %s", ruled_out[i]);
        if (!strstr(scan.out, word))
            fail_msg("scan lacks %s", ruled_out[i]);
        th_cli_t r = th_cli(".", daemon_.endpoint, "minmax %s </dev/null", ruled_out[i]);
        assert_int_equal(r.status, 2);
        assert_non_null(strstr(r.err, refused));
        th_cli_free(&r);
    }
    assert_non_null(strstr(mm.out, " --chunk SIZE "));
    th_cli_free(&mm);
    th_cli_free(&scan);
    th_cli_free(&table);
}

int main(void)
{
    const struct CMUnitTest cpu[] = {
        cmocka_unit_test(test_cpu_kernel),
        cmocka_unit_test(test_daemon_answers),
        cmocka_unit_test(test_daemon_refusals),
        cmocka_unit_test(test_client_and_cli),
        cmocka_unit_test(test_cli_options_follow_the_row),
    };
    const struct CMUnitTest gpu[] = {
        cmocka_unit_test(test_daemon_answers),
        cmocka_unit_test(test_daemon_refusals),
    };
    int failed = cmocka_run_group_tests_name("cpu backend", cpu, setup_cpu, teardown);
    return failed + cmocka_run_group_tests_name("simulated GPU", gpu, setup_gpu, teardown);
}
