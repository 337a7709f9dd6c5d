/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_push_applied.c — what a push that fails part-way reports as applied (libtally's
 * tally_push_*, client/tally_push.c: push_account, applied_bytes), against a real tallyd whose
 * max_batch refuses one chunk: the chunks before it are applied, it and those after are not,
 * and the result says exactly how many chunks and how many of the input's bytes the stream
 * holds, when chunks are short (the CLI prints it as "applied k of N chunks, B bytes"):
 *   - numbered (a stream, seq append): the chunk after the applied point is short, so the bytes
 *     are not k whole chunks (issue 37's third survivor counted that chunk's shortfall too);
 *   - a resumed push (the first chunks skipped) and a push without numbers count the same way;
 *   - more short chunks than the push keeps records of (4,096): still exact, from the newest.
 */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "harness.h"
#include "tally.h"

#define KIB 1024u
#define CHUNK (128 * KIB) /* the push's chunk size; tallyd takes batches of up to 64 KiB */

static th_daemon_t daemon_;
static uint8_t data[CHUNK];

static int start_daemon(void **state)
{
    (void)state;
    const char *args[] = {"--backend", "cpu", "--max-batch", "64K", NULL};
    return th_daemon_start(&daemon_, args);
}

static int stop_daemon(void **state)
{
    (void)state;
    return th_daemon_stop(&daemon_, SIGTERM, 10000) == 0 ? 0 : -1;
}

static tally_client_t *client(void)
{
    tally_client_t *c = NULL;
    assert_int_equal(tally_client_new(daemon_.endpoint, 10000, &c), TALLY_OK);
    return c;
}

/* A u8 hist push on `stream` (NULL: none) with `seq`, window 1, writing chunks of the sizes in
 * `lens` (0 ends); the push, finished, its status in *status. */
static tally_push_t *push_sizes(tally_client_t *c, const char *stream, tally_run_seq_t seq,
                                uint64_t seq_base, const size_t *lens, tally_status_t *status)
{
    tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    assert_int_equal(tally_req_set_stream(&req, stream), TALLY_OK);
    tally_run_opts_t opts = {.chunk_bytes = CHUNK, .window = 1, .seq = seq, .seq_base = seq_base};
    tally_push_t *push = NULL;
    assert_int_equal(tally_push_new(c, &req, &opts, NULL, NULL, &push), TALLY_OK);
    tally_status_t st = TALLY_OK;
    for (int i = 0; lens[i] && st == TALLY_OK; i++)
        st = tally_push_write(push, data, lens[i]);
    tally_status_t fin = tally_push_finish(push);
    *status = st != TALLY_OK ? st : fin;
    return push;
}

static uint64_t stream_last_seq(tally_client_t *c, const char *stream)
{
    tally_stream_info_t info;
    assert_int_equal(tally_query(c, stream, &info), TALLY_OK);
    return info.last_seq;
}

/* Numbered: 64 KiB, 40 KiB, then 100 KiB (over max_batch: too_large), then 64 KiB. Two chunks
 * applied, 104 KiB of input: 2 x 128 KiB less the shortfalls of chunks 0 and 1 only (chunk 2,
 * just after the applied point, is short too, by 28 KiB). */
static void test_numbered_push_counts_bytes_before_the_failed_chunk(void **state)
{
    (void)state;
    tally_client_t *c = client();
    const size_t lens[] = {64 * KIB, 40 * KIB, 100 * KIB, 64 * KIB, 0};
    tally_status_t st;
    tally_push_t *push = push_sizes(c, "applied/numbered", TALLY_RUN_SEQ_APPEND, 0, lens, &st);
    assert_int_equal(st, TALLY_E_TOO_LARGE);
    const tally_run_result_t *res = tally_push_result(push);
    assert_true(res->applied_known);
    assert_int_equal(res->applied, 2);
    assert_int_equal(res->applied_bytes, 104 * KIB);
    assert_int_equal(res->last_seq, res->seq_base + 2);
    assert_int_equal(stream_last_seq(c, "applied/numbered"), 2);
    tally_push_destroy(&push);

    /* The same input pushed again, resuming: the two applied chunks are skipped, the third is
     * refused again, and the count is the same two chunks, the same bytes. */
    push = push_sizes(c, "applied/numbered", TALLY_RUN_SEQ_RESUME, 0, lens, &st);
    assert_int_equal(st, TALLY_E_TOO_LARGE);
    res = tally_push_result(push);
    assert_int_equal(res->skipped, 2);
    assert_int_equal(res->applied, 2);
    assert_int_equal(res->applied_bytes, 104 * KIB);
    tally_push_destroy(&push);
    tally_client_destroy(&c);
}

/* Without numbers: 32 KiB, then 72 KiB (too large), then 16 KiB. One chunk applied, 32 KiB. */
static void test_unnumbered_push_counts_bytes_before_the_failed_chunk(void **state)
{
    (void)state;
    tally_client_t *c = client();
    const size_t lens[] = {32 * KIB, 72 * KIB, 16 * KIB, 0};
    tally_status_t st;
    tally_push_t *push = push_sizes(c, NULL, TALLY_RUN_SEQ_OFF, 0, lens, &st);
    assert_int_equal(st, TALLY_E_TOO_LARGE);
    const tally_run_result_t *res = tally_push_result(push);
    assert_true(res->applied_known);
    assert_int_equal(res->applied, 1);
    assert_int_equal(res->applied_bytes, 32 * KIB);
    tally_push_destroy(&push);
    tally_client_destroy(&c);
}

/* 5,000 short chunks (more than the 4,096 the push keeps records of), then one too large: all
 * 5,000 applied, and their bytes exact (the newest record holds the shortfall of all before). */
static void test_many_short_chunks(void **state)
{
    (void)state;
    tally_client_t *c = client();
    enum { SHORTS = 5000 };
    size_t *lens = calloc(SHORTS + 2, sizeof *lens);
    assert_non_null(lens);
    for (int i = 0; i < SHORTS; i++)
        lens[i] = 1 + (size_t)i % 7;
    lens[SHORTS] = 100 * KIB;
    uint64_t bytes = 0;
    for (int i = 0; i < SHORTS; i++)
        bytes += lens[i];
    tally_status_t st;
    tally_push_t *push = push_sizes(c, "applied/many", TALLY_RUN_SEQ_APPEND, 0, lens, &st);
    assert_int_equal(st, TALLY_E_TOO_LARGE);
    const tally_run_result_t *res = tally_push_result(push);
    assert_int_equal(res->applied, SHORTS);
    assert_int_equal(res->applied_bytes, bytes);
    tally_push_destroy(&push);
    free(lens);
    tally_client_destroy(&c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_numbered_push_counts_bytes_before_the_failed_chunk),
        cmocka_unit_test(test_unnumbered_push_counts_bytes_before_the_failed_chunk),
        cmocka_unit_test(test_many_short_chunks),
    };
    return cmocka_run_group_tests(tests, start_daemon, stop_daemon);
}
