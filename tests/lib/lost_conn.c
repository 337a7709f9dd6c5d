/* SPDX-License-Identifier: Apache-2.0 */
/*
 * lost_conn.c — issue 30's lost-connection case (lost_conn.h): the client, and the checks of
 * what PROTOCOL.md §1 promises around a connection ZeroMQ closed in the middle of a pipeline.
 */
#include "lost_conn.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#define LC_FIRST_ID 100    /* scan k has request id LC_FIRST_ID + k */
#define LC_RESEND_ID 500   /* its resend, LC_RESEND_ID + k */
#define LC_READ_MS 200     /* one wait for a reply */
#define LC_ANSWER_MS 60000 /* bound on tallyd answering every scan (never reached when correct) */
#define LC_REPLY_MS 60000  /* bound on one resent scan's reply (never reached when correct) */
#define LC_RESEND_POLL_MS 500 /* one receive of it: the wait goes on until LC_REPLY_MS */

static tally_req_t scan_req(const char *stream, uint64_t id, uint64_t seq)
{
    tally_req_t req = th_req(TALLY_OP_SCAN, TALLY_DTYPE_I32, id);
    tally_req_set_stream(&req, stream);
    req.seq = seq;
    return req;
}

/* Scan k's batch: 2^k, then zeros; v holds LC_ELEMS. */
static void fill_batch(int32_t *v, int k)
{
    memset(v, 0, LC_ELEMS * sizeof *v);
    v[0] = (int32_t)(1u << k);
}

/* Takes what replies are waiting (each wait up to LC_READ_MS) into run; 0 when none came. */
static int take_replies(void *sock, lc_run_t *run, int *twice)
{
    int got = 0;
    th_reply_t r;
    while (th_recv_reply(sock, &r) == 0) {
        uint64_t k = r.rep.request_id - LC_FIRST_ID;
        if (k < (uint64_t)run->n) {
            if (run->status[k] >= 0)
                (*twice)++;
            run->status[k] = (int)r.rep.status;
            run->aux0[k] = r.rep.aux0;
            run->replies++;
            got++;
        }
        th_reply_free(&r);
    }
    return got;
}

static void read_counters(void *probe, lc_run_t *run)
{
    run->ok = th_stat(probe, "tallyd_requests_total{op=\"scan\",status=\"ok\"}");
    run->busy = th_stat(probe, "tallyd_requests_total{op=\"scan\",status=\"busy\"}");
    run->gap = th_stat(probe, "tallyd_requests_total{op=\"scan\",status=\"sequence_gap\"}");
    run->ok = run->ok < 0 ? 0 : run->ok;
    run->busy = run->busy < 0 ? 0 : run->busy;
    run->gap = run->gap < 0 ? 0 : run->gap;
}

long lc_record(const th_daemon_t *d, const char *stream, uint8_t *out, size_t cap)
{
    void *probe = th_connect(d->endpoint, 10000);
    long len = th_query_raw(probe, stream, 7, out, cap);
    th_close(probe);
    return len;
}

static int read_stream(const th_daemon_t *d, const char *stream, lc_run_t *run)
{
    uint8_t rec[2176];
    if (lc_record(d, stream, rec, sizeof rec) < 128)
        return -1;
    memcpy(&run->batches, rec + 0, 8);
    memcpy(&run->carry, rec + 40, 8);
    memcpy(&run->last_seq, rec + 104, 8);
    return 0;
}

/* Sends the scans and the frame over max_frame. */
static int send_case(void *sock, const char *stream, bool numbered, int n)
{
    int32_t *v = calloc(LC_MAX_FRAME / sizeof(int32_t) + 1, sizeof *v);
    int rc = v ? 0 : -1;
    for (int k = 0; k < n && rc == 0; k++) {
        fill_batch(v, k);
        tally_req_t req = scan_req(stream, LC_FIRST_ID + (uint64_t)k, numbered ? k + 1u : 0);
        rc = th_send_request(sock, &req, v, LC_ELEMS * sizeof *v);
    }
    tally_req_t big = scan_req(stream, LC_FIRST_ID + LC_MAX, numbered ? n + 1u : 0);
    if (rc == 0)
        rc = th_send_request(sock, &big, v, LC_MAX_FRAME + 1);
    free(v);
    return rc;
}

int lc_run(const th_daemon_t *d, const char *stream, const char *id, bool numbered, int n,
           int wait_ms, void **sock, lc_run_t *run)
{
    *run = (lc_run_t){.n = n, .numbered = numbered};
    for (int k = 0; k < LC_MAX; k++)
        run->status[k] = -1;
    void *s = th_dealer(LC_READ_MS);
    zmq_setsockopt(s, ZMQ_ROUTING_ID, id, strlen(id));
    if (n > LC_MAX || zmq_connect(s, d->endpoint) != 0 || send_case(s, stream, numbered, n) != 0) {
        fprintf(stderr, "lost_conn: cannot send the case\n");
        th_close(s);
        return -1;
    }
    *sock = s;
    int twice = 0;
    void *probe = th_connect(d->endpoint, 10000);
    /* tallyd answers every scan (its counters), whatever comes back here */
    int64_t until = th_now_ms() + LC_ANSWER_MS;
    do {
        take_replies(s, run, &twice);
        read_counters(probe, run);
    } while (run->ok + run->busy + run->gap < n && th_now_ms() < until);
    /* then the replies that will come: kept ones once the DEALER is back, rerouted ones */
    until = th_now_ms() + wait_ms;
    while (run->replies < n && th_now_ms() < until)
        take_replies(s, run, &twice);
    th_close(probe);
    run->replies += twice * 1000; /* more replies than scans: lc_check says so */
    if (read_stream(d, stream, run) != 0) {
        fprintf(stderr, "lost_conn: no query record of %s\n", stream);
        return -1;
    }
    return 0;
}

static int popcount64(uint64_t v)
{
    int c = 0;
    for (; v; v &= v - 1)
        c++;
    return c;
}

/* Every reply that came back agrees with the set the stream applied, in order. */
static const char *check_replies(const lc_run_t *run)
{
    for (int k = 0; k < run->n; k++) {
        uint64_t bit = 1ull << k;
        switch (run->status[k]) {
        case -1: /* lost with the connection: allowed (PROTOCOL.md §1) */
            break;
        case TALLY_OK:
            if (!(run->carry & bit))
                return "a scan answered ok is not in the stream";
            if (run->aux0[k] != (run->carry & ((bit << 1) - 1)))
                return "an ok reply's carry is not the sum of the batches applied before it: the "
                       "stream applied them out of order";
            break;
        case TALLY_E_BUSY:
        case TALLY_E_SEQ_GAP:
            if (run->carry & bit)
                return "a refused scan's batch is in the stream";
            break;
        default:
            return "a scan got an unexpected status";
        }
    }
    return NULL;
}

const char *lc_check(const lc_run_t *run)
{
    if (run->ok + run->busy + run->gap != run->n)
        return "tallyd did not read and answer every scan sent before the frame";
    if (run->replies > run->n)
        return "a scan got more than one reply";
    if (run->carry >> run->n)
        return "the stream holds a batch it was never sent (or one applied twice)";
    if ((uint64_t)popcount64(run->carry) != run->batches || (long long)run->batches != run->ok)
        return "the stream's batches are not the scans answered ok, each once";
    const char *bad = check_replies(run);
    if (bad)
        return bad;
    if (!run->numbered)
        return run->last_seq == 0 ? NULL : "an unnumbered stream has a last_seq";
    if (run->last_seq != run->batches || run->carry != (1ull << run->last_seq) - 1)
        return "numbered scans left a gap: the stream is not an exact prefix";
    return NULL;
}

/* One numbered scan k (seq k + 1, request id LC_RESEND_ID + k) and its reply, skipping late
 * replies of the first round; sent again while `busy` (its reply bytes bound). Its status, or -1
 * without a reply. */
static int send_one(void *sock, const char *stream, int k, uint64_t seq, uint64_t *aux0)
{
    int32_t *v = calloc(LC_ELEMS, sizeof *v);
    if (!v)
        return -1;
    fill_batch(v, k);
    int status = -1;
    for (int tries = 0; tries < 100; tries++) {
        tally_req_t req = scan_req(stream, LC_RESEND_ID + (uint64_t)k, seq);
        if (th_send_request(sock, &req, v, LC_ELEMS * sizeof *v) != 0)
            break;
        /* Waits for the reply up to LC_REPLY_MS, one LC_RESEND_POLL_MS receive at a time: a
         * receive that times out is no lost reply (a loaded box under TSan may take seconds). */
        int64_t until = th_now_ms() + LC_REPLY_MS;
        status = -1;
        while (status < 0 && th_now_ms() < until) {
            th_reply_t r;
            if (th_recv_reply(sock, &r) == 0 && r.rep.request_id == req.request_id) {
                status = (int)r.rep.status;
                *aux0 = r.rep.aux0;
            }
            th_reply_free(&r);
        }
        if (status != TALLY_E_BUSY)
            break;
    }
    free(v);
    return status;
}

const char *lc_resend(const th_daemon_t *d, void *sock, const char *stream, lc_run_t *run)
{
    uint64_t applied = run->last_seq;
    int timeout = LC_RESEND_POLL_MS;
    zmq_setsockopt(sock, ZMQ_RCVTIMEO, &timeout, sizeof timeout);
    for (int k = 0; k < run->n; k++) {
        uint64_t aux0 = 0;
        int status = send_one(sock, stream, k, k + 1u, &aux0);
        if ((uint64_t)k < applied && (status != TALLY_E_DUPLICATE || aux0 != applied))
            return "a resent batch that was applied is not refused `duplicate` with last_seq";
        if ((uint64_t)k >= applied && (status != TALLY_OK || aux0 != (2ull << k) - 1))
            return "a resent batch that was not applied is not applied, in order";
    }
    uint64_t aux0 = 0;
    if (send_one(sock, stream, run->n + 1, run->n + 2u, &aux0) != TALLY_E_SEQ_GAP ||
        aux0 != (uint64_t)run->n)
        return "a seq that skips one is not refused `sequence_gap` with last_seq";
    if (read_stream(d, stream, run) != 0)
        return "no query record after the resend";
    if (run->batches != (uint64_t)run->n || run->last_seq != (uint64_t)run->n ||
        run->carry != (1ull << run->n) - 1)
        return "after the resend the stream does not hold every batch exactly once, in order";
    return NULL;
}
