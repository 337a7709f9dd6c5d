/* SPDX-License-Identifier: Apache-2.0 */
/*
 * lost_conn.h — issue 30's case, shared by test_lost_conn.c and test_differential.c: a client
 * pipelines scans on one stream, then sends a frame over max_frame, so ZeroMQ closes its
 * connection in the middle of the pipeline, and its DEALER (with a fixed routing id, as
 * libtally's) reconnects. What PROTOCOL.md §1 says a client can rely on then is checked here:
 *   - tallyd read and answered every scan sent before the frame (its counters say so);
 *   - the stream applied a subset of them in the order sent, each once: scan k's batch sums to
 *     2^k, so the stream's carry is the set applied, and every ok reply that came back carries
 *     the sum of the applied batches up to its own, every refusal's batch is not in the set;
 *   - numbered (seq k + 1): the set is a prefix 0..last_seq-1, nothing after a gap applied; and
 *     the client's resend of every batch after the reconnect applies each missing one exactly
 *     once (the others are `duplicate`), leaving all n in order.
 * Functions return NULL when the outcome holds, else what failed (a static string).
 */
#ifndef TALLY_TEST_LOST_CONN_H
#define TALLY_TEST_LOST_CONN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "harness.h"

#define LC_MAX 30           /* scans at most (2^k must fit an int32 element) */
#define LC_ELEMS 16384      /* int32 elements a scan: 64 KiB, max_batch under --max-batch 64K */
#define LC_MAX_FRAME 262144 /* max_frame under --max-batch 64K (4 x max_batch) */

typedef struct {
    int n;         /* scans pipelined before the frame */
    bool numbered; /* scan k carries seq k + 1 */
    /* What came back on the client's socket (old connection or new): */
    int status[LC_MAX]; /* -1: no reply */
    uint64_t aux0[LC_MAX];
    int replies;
    /* tallyd's counters after (scans answered ok, busy, sequence_gap), and the stream: */
    long long ok, busy, gap;
    uint64_t batches, carry, last_seq;
} lc_run_t;

/* The case against the tallyd at d (started with --max-batch 64K): scans on `stream` from a
 * DEALER with routing id `id`, then the oversize frame; replies are read until every scan was
 * answered by tallyd and then until all n came back or wait_ms passed. The DEALER is left in
 * *sock (reconnected), for lc_resend. 0, or -1 with a message on stderr. */
int lc_run(const th_daemon_t *d, const char *stream, const char *id, bool numbered, int n,
           int wait_ms, void **sock, lc_run_t *run);
/* The outcome against PROTOCOL.md §1 (above). */
const char *lc_check(const lc_run_t *run);
/* A numbered client's resend after the reconnect, one scan at a time, seq 1..n, on sock: the
 * applied ones are `duplicate`, the rest ok, and the stream then holds all n in order; and a seq
 * that skips one is refused `sequence_gap`. */
const char *lc_resend(const th_daemon_t *d, void *sock, const char *stream, lc_run_t *run);
/* The stream's query record on a fresh connection to d (cap bytes): its length, or -1. */
long lc_record(const th_daemon_t *d, const char *stream, uint8_t *out, size_t cap);

#endif
