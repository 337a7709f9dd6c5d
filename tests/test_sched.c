/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_sched.c — the scheduler (daemon/core/td_sched.c) on its own: no sockets, no loop, no backend.
 *
 * A fake machine records every request the scheduler starts, with its placement, and the test
 * finishes them in the order it chooses (as the CPU workers and GPU lanes would), OK or failed
 * on the GPU; a fake host records every reply in the order it leaves. What is checked: the order
 * on a stream (arrival order; pipelined GPU requests on one lane with one carry; query, reset
 * and delete wait for the stream to drain; a CPU batch waits), delete forgetting the name,
 * fairness across streams (a busy stream holds up no other; streams spread over lanes and
 * devices), backpressure (max_inflight), the rerun on the CPU after a GPU failure, shutdown
 * answering waiting requests in order (`shutdown`, even where a numbered one would otherwise get
 * sequence_gap), a stream created by a request that fails being removed, and issue 9's split
 * rule (a large shared-memory request is split only onto idle lanes, unless it fits the device
 * buffers only when split). Issue 21: the peers' queues take turns by bytes (deficit round
 * robin) on the CPU workers and the GPU lanes, and a request refused at admission while earlier
 * ones of its stream run is answered after them. Requests by device reference (fake device
 * regions): which GPU runs them (the owner, or a peer by load while the owner is busy), when a
 * stream's later ones may pipeline on a peer, what is refused, and failures answered internal.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "td_exec.h"
#include "td_gpu_engine.h"
#include "td_peers.h"
#include "td_sched.h"
#include "td_settings.h"
#include "td_shm_int.h"

#define MIB (1u << 20)
#define RUNNING_MAX 128
#define LOG_MAX 128

typedef struct {
    uint64_t id;
    uint32_t status;
} answer_t;

typedef struct {
    td_config_t cfg;
    td_metrics_t metrics;
    td_streams_t *streams;
    td_sched_t *sched;
    unsigned devices;
    bool dead[4];
    size_t buffer_bytes;
    td_request_t *running[RUNNING_MAX]; /* started, not finished, in start order */
    unsigned running_count;
    answer_t log[LOG_MAX]; /* replies, in the order they left */
    unsigned log_count;
    uint64_t started[LOG_MAX]; /* requests handed to the machine, in that order */
    unsigned started_count;
    td_peer_t *conn; /* the connection the next arrivals come from (NULL: none) */
    uint32_t peers;  /* the GPUs that reach a device region over peer access (FAKE_PEERS) */
} fake_t;

/* What a fake machine lacks or has beyond the usual (fake_new_machine). */
enum {
    FAKE_NO_SPLIT = 1,   /* no splittable: nothing is split over lanes */
    FAKE_PEERS = 2,      /* region_peers: f->peers */
    FAKE_WIDE = 4,       /* 32 lanes per GPU, not 4 */
    FAKE_ONE_LANE = 8,   /* 1 lane per GPU, with 128 scan carries */
    FAKE_ONE_CARRY = 16, /* 1 scan carry per lane, not 16 */
};

/* ---- the fake machine and host ------------------------------------------------------------ */

static bool fake_device_usable(void *ctx, unsigned device)
{
    fake_t *f = ctx;
    return device < f->devices && !f->dead[device];
}

static int fake_device_ordinal(void *ctx, unsigned device)
{
    (void)ctx;
    return (int)device;
}

/* A request flagged SHM_REF stands for one whose regions are registered with the devices. */
static bool fake_splittable(void *ctx, const td_request_t *r)
{
    (void)ctx;
    return (r->req.flags & TALLY_FLAG_SHM_REF) &&
           (r->req.opcode == TALLY_OP_HIST || r->req.opcode == TALLY_OP_SCAN);
}

/* Every device region reaches the GPUs of f->peers. */
static uint32_t fake_region_peers(void *ctx, const td_request_t *r)
{
    (void)r;
    return ((fake_t *)ctx)->peers;
}

/* A result: a hist's is its (empty) histogram, the reply its apply step reads back. */
static void succeed(td_request_t *r)
{
    static const tk_hist_t empty;
    if (r->req.opcode == TALLY_OP_HIST)
        td_request_hist_result(r, &empty);
    else
        td_request_succeed(r, TALLY_DTYPE_NONE, NULL, 0, 0);
}

/* An inline CPU run completes at once, as td_exec's does; anything else waits for the test. */
static void fake_run(void *ctx, td_request_t *r)
{
    fake_t *f = ctx;
    assert_true(f->started_count < LOG_MAX);
    f->started[f->started_count++] = r->req.request_id;
    if (!r->where.gpu && r->where.cpu_inline) {
        succeed(r);
        td_sched_finished(f->sched, r);
        return;
    }
    assert_true(f->running_count < RUNNING_MAX);
    f->running[f->running_count++] = r;
}

static void record(fake_t *f, td_request_t *r)
{
    assert_true(f->log_count < LOG_MAX);
    f->log[f->log_count++] = (answer_t){r->req.request_id, r->rep.status};
    r->shm_in = r->shm_out = NULL; /* the test's own regions (device_region) */
    td_request_destroy(&r);
    td_sched_answered(f->sched);
}

static bool fake_complete(void *owner, td_request_t *r)
{
    bool applied = td_request_apply(r);
    record(owner, r);
    return applied;
}

static void fake_control(void *owner, td_request_t *r, td_stream_t *stream)
{
    (void)owner;
    if (r->req.opcode == TALLY_OP_RESET)
        td_stream_zero(stream);
    if (r->req.opcode == TALLY_OP_DELETE)
        td_stream_clear(stream);
    succeed(r);
}

static void fake_answer(void *owner, td_request_t *r)
{
    record(owner, r);
}

static void fake_forget(void *owner, td_stream_t *stream)
{
    fake_t *f = owner;
    td_streams_remove(f->streams, &stream);
}

/* A scheduler over `devices` simulated GPUs of 4 lanes (0: CPU only) with buffers of `bytes`;
 * the machine takes any number of requests at once unless fake_new_limited says otherwise, and
 * has what `extras` (FAKE_*) says. */
static fake_t *fake_new_machine(unsigned devices, td_backend_choice_t backend,
                                unsigned max_inflight, size_t bytes, unsigned cpu_workers,
                                unsigned lane_depth, unsigned extras)
{
    fake_t *f = calloc(1, sizeof *f);
    assert_non_null(f);
    assert_true(devices <= sizeof f->dead / sizeof f->dead[0]);
    td_config_init(&f->cfg);
    f->cfg.backend = backend;
    f->cfg.max_inflight = max_inflight;
    f->devices = devices;
    f->buffer_bytes = bytes;
    assert_int_equal(td_streams_new(100, &f->streams), TD_OK);
    td_sched_machine_t m = {
        .ctx = f,
        .gpu_devices = devices,
        .gpu_lanes = extras & FAKE_WIDE ? 32 : 4,
        .gpu_carries = extras & FAKE_ONE_CARRY ? 2 : 17,
        .gpu_buffer_bytes = f->buffer_bytes,
        .cpu_workers = cpu_workers,
        .gpu_lane_depth = lane_depth,
        .device_usable = fake_device_usable,
        .device_ordinal = fake_device_ordinal,
        .splittable = extras & FAKE_NO_SPLIT ? NULL : fake_splittable,
        .region_peers = extras & FAKE_PEERS ? fake_region_peers : NULL,
        .run = fake_run,
    };
    if (extras & FAKE_ONE_LANE) {
        m.gpu_lanes = 1;
        m.gpu_carries = 129;
    }
    td_sched_host_t h = {f, fake_complete, fake_control, fake_answer, fake_forget, 0};
    assert_int_equal(td_sched_new(&f->cfg, &f->metrics, &m, &h, &f->sched), TD_OK);
    return f;
}

static fake_t *fake_new_limited(unsigned devices, td_backend_choice_t backend,
                                unsigned max_inflight, size_t bytes, unsigned cpu_workers,
                                unsigned lane_depth)
{
    return fake_new_machine(devices, backend, max_inflight, bytes, cpu_workers, lane_depth, 0);
}

static fake_t *fake_new_buffers(unsigned devices, td_backend_choice_t backend,
                                unsigned max_inflight, size_t bytes)
{
    return fake_new_limited(devices, backend, max_inflight, bytes, 0, 0);
}

static fake_t *fake_new(unsigned devices, td_backend_choice_t backend, unsigned max_inflight)
{
    return fake_new_buffers(devices, backend, max_inflight, 64 * MIB);
}

static void fake_destroy(fake_t **f_p)
{
    fake_t *f = *f_p;
    assert_int_equal(f->running_count, 0);
    assert_int_equal(td_sched_inflight(f->sched), 0);
    assert_int_equal(td_sched_queued(f->sched), 0);
    td_sched_destroy(&f->sched);
    td_streams_destroy(&f->streams);
    td_config_clear(&f->cfg);
    free(f);
    *f_p = NULL;
}

/* ---- driving it --------------------------------------------------------------------------- */

static const uint8_t payload[1];

/* Request `id`: `op` of `bytes` on `stream` (NULL: stateless), not handed over yet. */
static td_request_t *request_new(uint8_t op, uint8_t dtype, const char *stream, uint64_t id,
                                 size_t bytes, uint16_t flags)
{
    td_request_t *r = td_request_new();
    assert_non_null(r);
    r->req.opcode = op;
    r->req.dtype = dtype;
    r->req.request_id = id;
    r->req.flags = flags;
    r->rep.request_id = id;
    r->payload = payload;
    r->payload_len = bytes;
    if (stream) {
        r->req.stream_len = (uint8_t)strlen(stream);
        memcpy(r->req.stream, stream, r->req.stream_len);
    }
    return r;
}

/* r read and handed to the scheduler as td_server's dispatch does: a compute request creates
 * its stream when it does not exist (TD_STREAM_NEW until a request is applied to it). */
static void hand_over(fake_t *f, td_request_t *r)
{
    r->conn = f->conn;
    td_stream_t *st = NULL;
    if (r->req.stream_len) {
        st = td_streams_find(f->streams, r->req.stream, r->req.stream_len);
        if (!st && td_op_is_compute(r->req.opcode)) {
            assert_int_equal(td_streams_get(f->streams, r->req.stream, r->req.stream_len, &st),
                             TALLY_OK);
            st->life = TD_STREAM_NEW;
        }
        assert_non_null(st);
    }
    td_sched_received(f->sched);
    td_sched_arrived(f->sched, r, st);
}

static td_request_t *arrive_typed(fake_t *f, uint8_t op, uint8_t dtype, const char *stream,
                                  uint64_t id, size_t bytes, uint16_t flags)
{
    td_request_t *r = request_new(op, dtype, stream, id, bytes, flags);
    hand_over(f, r);
    return r;
}

static td_request_t *arrive_flags(fake_t *f, uint8_t op, const char *stream, uint64_t id,
                                  size_t bytes, uint16_t flags)
{
    uint8_t dtype = op == TALLY_OP_HIST ? TALLY_DTYPE_U8 : TALLY_DTYPE_I32;
    return arrive_typed(f, op, dtype, stream, id, bytes, flags);
}

static td_request_t *arrive(fake_t *f, uint8_t op, const char *stream, uint64_t id, size_t bytes)
{
    return arrive_flags(f, op, stream, id, bytes, 0);
}

/* A device region on GPU `gpu` (PROTOCOL.md §10 "Device memory"): all the scheduler reads of
 * one. The requests only point at it (record lets go of it before freeing them). */
static td_shm_region_t device_region(unsigned gpu)
{
    return (td_shm_region_t){.device = true, .gpu = gpu, .refs = 1};
}

/* A request by device reference: its input in `in`, its output (NULL: none) in `out`. */
static td_request_t *arrive_region(fake_t *f, uint8_t op, const char *stream, uint64_t id,
                                   size_t bytes, td_shm_region_t *in, td_shm_region_t *out)
{
    uint8_t dtype = op == TALLY_OP_HIST ? TALLY_DTYPE_U8 : TALLY_DTYPE_I32;
    td_request_t *r = request_new(op, dtype, stream, id, bytes, TALLY_FLAG_SHM_REF);
    r->shm_in = in;
    r->shm_out = out;
    hand_over(f, r);
    return r;
}

/* Read while stopping: the server fails it `shutdown`, then hands it over with its stream, if
 * that exists. */
static void arrive_stopping(fake_t *f, const char *stream, uint64_t id)
{
    td_request_t *r = td_request_new();
    assert_non_null(r);
    r->req.request_id = r->rep.request_id = id;
    td_request_fail(r, TALLY_E_SHUTDOWN, "tallyd is shutting down; not run");
    td_sched_received(f->sched);
    td_sched_arrived(f->sched, r,
                     stream ? td_streams_find(f->streams, stream, strlen(stream)) : NULL);
}

static int running_index(const fake_t *f, uint64_t id)
{
    for (unsigned i = 0; i < f->running_count; i++)
        if (f->running[i]->req.request_id == id)
            return (int)i;
    return -1;
}

static bool is_running(const fake_t *f, uint64_t id)
{
    return running_index(f, id) >= 0;
}

/* Request `id`, taken off the running list. */
static td_request_t *take_running(fake_t *f, uint64_t id)
{
    int i = running_index(f, id);
    assert_true(i >= 0);
    td_request_t *r = f->running[i];
    memmove(&f->running[i], &f->running[i + 1], (f->running_count - (unsigned)i - 1) * sizeof r);
    f->running_count--;
    return r;
}

/* The machine hands request `id` back: OK, or failed on the GPU. */
static void finish_as(fake_t *f, uint64_t id, bool gpu_failed)
{
    td_request_t *r = take_running(f, id);
    if (gpu_failed)
        r->gpu_failed = true;
    else
        succeed(r);
    td_sched_finished(f->sched, r);
}

static void finish(fake_t *f, uint64_t id)
{
    finish_as(f, id, false);
}

/* The machine hands request `id` back failed with `status` (a backend error, out of memory). */
static void finish_failed(fake_t *f, uint64_t id, tally_status_t status)
{
    td_request_t *r = take_running(f, id);
    td_request_fail(r, status, "failed by the test");
    td_sched_finished(f->sched, r);
}

/* The replies so far are exactly ids[0..n), in that order, with statuses[i] (NULL: all OK). */
static void assert_log(const fake_t *f, const uint64_t *ids, unsigned n, const uint32_t *statuses)
{
    assert_int_equal(f->log_count, n);
    for (unsigned i = 0; i < n; i++) {
        assert_int_equal(f->log[i].id, ids[i]);
        assert_int_equal(f->log[i].status, statuses ? statuses[i] : TALLY_OK);
    }
}

/* ---- order on a stream -------------------------------------------------------------------- */

/* On the CPU a stream's batches run one at a time in arrival order; a stateless one and another
 * stream's run beside them at once (a busy stream holds up no other). */
static void test_cpu_stream_in_order(void **state)
{
    (void)state;
    fake_t *f = fake_new(0, TD_BACKEND_CPU, 64);
    for (uint64_t id = 1; id <= 3; id++)
        arrive(f, TALLY_OP_SCAN, "a", id, MIB);
    arrive(f, TALLY_OP_HIST, NULL, 4, MIB);
    arrive(f, TALLY_OP_HIST, "b", 5, MIB);
    assert_true(is_running(f, 1) && !is_running(f, 2) && !is_running(f, 3));
    assert_true(is_running(f, 4) && is_running(f, 5));
    assert_int_equal(td_sched_queued(f->sched), 2);
    assert_false(f->running[0]->where.gpu);
    assert_false(f->running[0]->where.cpu_inline); /* 1 MiB: on a worker */
    finish(f, 5);
    finish(f, 1);
    assert_true(is_running(f, 2) && !is_running(f, 3));
    finish(f, 2);
    finish(f, 3);
    finish(f, 4);
    uint64_t want[] = {5, 1, 2, 3, 4};
    assert_log(f, want, 5, NULL);
    /* A tiny batch runs inline: answered before arrive returns. */
    arrive(f, TALLY_OP_HIST, "a", 6, 4096);
    assert_int_equal(f->log_count, 6);
    assert_int_equal(td_streams_find(f->streams, "a", 1)->info.batches, 4);
    fake_destroy(&f);
}

/* On the GPU a stream's batches pipeline on one lane: the first uploads the host carry into the
 * stream's carry, the rest chain from it. A query waits until they are all done. */
static void test_gpu_pipelined_query_waits(void **state)
{
    (void)state;
    fake_t *f = fake_new(1, TD_BACKEND_CUDA, 64);
    td_stream_t *a = NULL;
    assert_int_equal(td_streams_get(f->streams, "a", 1, &a), TALLY_OK);
    a->info.scan_carry = 42;
    for (uint64_t id = 1; id <= 3; id++)
        arrive(f, TALLY_OP_SCAN, "a", id, MIB);
    arrive(f, TALLY_OP_QUERY, "a", 4, 0);
    assert_int_equal(f->running_count, 3);
    const td_placement_t *w0 = &f->running[0]->where;
    assert_true(w0->gpu && w0->carry_upload && w0->carry_index != 0 && w0->pieces == 1);
    assert_int_equal(f->running[0]->carry, 42);
    for (unsigned i = 1; i < 3; i++) {
        const td_placement_t *w = &f->running[i]->where;
        assert_true(w->gpu && !w->carry_upload);
        assert_int_equal(w->lane, w0->lane);
        assert_int_equal(w->carry_index, w0->carry_index);
    }
    finish(f, 1);
    finish(f, 2);
    assert_int_equal(f->log_count, 2); /* the query still waits */
    finish(f, 3);
    uint64_t want[] = {1, 2, 3, 4};
    assert_log(f, want, 4, NULL);
    assert_int_equal(f->metrics.gpu_requests[0], 3);
    fake_destroy(&f);
}

/* A CPU batch (auto mode: below hist's 64 KiB threshold) behind a GPU batch waits for it; and a
 * histogram whose type the stream does not know yet waits too. */
static void test_cpu_batch_waits_for_gpu(void **state)
{
    (void)state;
    fake_t *f = fake_new(1, TD_BACKEND_AUTO, 64);
    arrive(f, TALLY_OP_HIST, "a", 1, MIB);   /* GPU */
    arrive(f, TALLY_OP_HIST, "a", 2, 32768); /* CPU (worker: above the inline size) */
    assert_true(is_running(f, 1) && !is_running(f, 2));
    finish(f, 1);
    assert_true(is_running(f, 2));
    assert_false(f->running[running_index(f, 2)]->where.gpu);
    finish(f, 2);
    /* A fresh stream: its first hist sets the type, so the second waits even on the GPU. */
    arrive(f, TALLY_OP_HIST, "b", 3, MIB);
    arrive(f, TALLY_OP_HIST, "b", 4, MIB);
    assert_true(is_running(f, 3) && !is_running(f, 4));
    finish(f, 3);
    arrive(f, TALLY_OP_HIST, "b", 5, MIB); /* the type is known now: pipelined behind 4 */
    assert_true(is_running(f, 4) && is_running(f, 5));
    finish(f, 4);
    finish(f, 5);
    uint64_t want[] = {1, 2, 3, 4, 5};
    assert_log(f, want, 5, NULL);
    fake_destroy(&f);
}

/* reset and delete wait for the stream to drain; after a delete a query queued behind it gets
 * unknown_stream, a compute request starts the stream anew, and a stream deleted with nothing
 * behind it is forgotten. */
static void test_reset_delete_sequencing(void **state)
{
    (void)state;
    fake_t *f = fake_new(1, TD_BACKEND_CUDA, 64);
    arrive(f, TALLY_OP_SCAN, "a", 1, MIB);
    arrive(f, TALLY_OP_RESET, "a", 2, 0);
    arrive(f, TALLY_OP_SCAN, "a", 3, MIB);
    arrive(f, TALLY_OP_DELETE, "a", 4, 0);
    arrive(f, TALLY_OP_QUERY, "a", 5, 0);
    arrive(f, TALLY_OP_HIST, "a", 6, MIB);
    assert_int_equal(f->running_count, 1); /* the reset waits for 1, and everything behind it */
    finish(f, 1);
    assert_int_equal(f->log_count, 2); /* 1, then the reset ran; 3 started */
    assert_true(is_running(f, 3) && !is_running(f, 6));
    finish(f, 3);
    assert_true(is_running(f, 6)); /* the delete ran, the query was refused, 6 started anew */
    finish(f, 6);
    uint64_t ids[] = {1, 2, 3, 4, 5, 6};
    uint32_t want[] = {TALLY_OK, TALLY_OK, TALLY_OK, TALLY_OK, TALLY_E_UNKNOWN_STREAM, TALLY_OK};
    assert_log(f, ids, 6, want);
    td_stream_t *a = td_streams_find(f->streams, "a", 1);
    assert_non_null(a);
    assert_int_equal(a->info.batches, 1); /* only 6, after the delete */
    arrive(f, TALLY_OP_DELETE, "a", 7, 0);
    assert_null(td_streams_find(f->streams, "a", 1));
    fake_destroy(&f);
}

/* ---- placement ---------------------------------------------------------------------------- */

/* Streams spread over the lanes, stateless requests over the devices, by load; a device that is
 * unusable gets nothing. */
static void test_spread_over_lanes_and_devices(void **state)
{
    (void)state;
    fake_t *f = fake_new(2, TD_BACKEND_CUDA, 64);
    const char *names[] = {"s0", "s1", "s2", "s3"};
    for (uint64_t i = 0; i < 4; i++)
        arrive(f, TALLY_OP_SCAN, names[i], i + 1, MIB);
    unsigned per_device[2] = {0, 0};
    for (unsigned i = 0; i < 4; i++)
        per_device[f->running[i]->where.device]++;
    assert_int_equal(per_device[0], 2);
    assert_int_equal(per_device[1], 2);
    assert_true(f->running[0]->where.device != f->running[1]->where.device);
    for (uint64_t id = 1; id <= 4; id++)
        finish(f, id);
    f->dead[0] = true;
    for (uint64_t id = 5; id <= 8; id++)
        arrive(f, TALLY_OP_HIST, NULL, id, MIB);
    for (unsigned i = 0; i < 4; i++) {
        assert_int_equal(f->running[i]->where.device, 1);
        assert_int_equal(f->running[i]->where.lane, i); /* one per lane */
        assert_int_equal(f->running[i]->where.carry_index, 0);
    }
    for (uint64_t id = 5; id <= 8; id++)
        finish(f, id);
    fake_destroy(&f);
}

/* Backpressure: reading stops at max_inflight until a reply leaves; stopping reads on. */
static void test_backpressure(void **state)
{
    (void)state;
    fake_t *f = fake_new(0, TD_BACKEND_CPU, 3);
    arrive(f, TALLY_OP_SCAN, "a", 1, MIB);
    arrive(f, TALLY_OP_SCAN, "a", 2, MIB);
    assert_true(td_sched_may_read(f->sched));
    arrive(f, TALLY_OP_SCAN, "a", 3, MIB);
    assert_int_equal(td_sched_inflight(f->sched), 3);
    assert_false(td_sched_may_read(f->sched));
    finish(f, 1);
    assert_true(td_sched_may_read(f->sched));
    f->cfg.max_inflight = 1; /* a reload lowers the limit */
    assert_false(td_sched_may_read(f->sched));
    finish(f, 2);
    finish(f, 3);
    assert_true(td_sched_may_read(f->sched));
    fake_destroy(&f);
}

/* A GPU failure: the failed request reruns on the CPU (inline), the ones pipelined behind it
 * rerun too as they come back, nothing new starts until the stream drains, then it starts on
 * the GPU again with the host carry uploaded. */
static void test_gpu_failure_reruns_on_cpu(void **state)
{
    (void)state;
    fake_t *f = fake_new(1, TD_BACKEND_CUDA, 64);
    for (uint64_t id = 1; id <= 3; id++)
        arrive(f, TALLY_OP_SCAN, "a", id, MIB);
    finish_as(f, 1, true);
    assert_int_equal(f->log_count, 1); /* rerun inline, answered */
    arrive(f, TALLY_OP_SCAN, "a", 4, MIB);
    assert_false(is_running(f, 4)); /* resync: waits for the stream to drain */
    finish(f, 2);
    finish(f, 3);
    assert_int_equal(f->metrics.backend_fallbacks, 3);
    assert_int_equal(f->metrics.gpu_requests[0], 0);
    assert_true(is_running(f, 4));
    assert_true(f->running[0]->where.gpu && f->running[0]->where.carry_upload);
    finish(f, 4);
    uint64_t want[] = {1, 2, 3, 4};
    assert_log(f, want, 4, NULL);
    assert_int_equal(f->metrics.gpu_requests[0], 1);
    fake_destroy(&f);
}

/* ---- shutdown ----------------------------------------------------------------------------- */

/* Stopping: a stream's running request finishes and is answered, then what waited behind it is
 * answered `shutdown` in order; a stream with nothing running is answered at once, and so is a
 * request read while stopping, unless its stream still has requests (then it queues behind). */
static void test_shutdown_in_order(void **state)
{
    (void)state;
    fake_t *f = fake_new(0, TD_BACKEND_CPU, 64);
    td_stream_t *b = NULL;
    assert_int_equal(td_streams_get(f->streams, "b", 1, &b), TALLY_OK);
    arrive(f, TALLY_OP_SCAN, "a", 1, MIB);
    arrive(f, TALLY_OP_SCAN, "a", 2, MIB);
    arrive(f, TALLY_OP_QUERY, "a", 3, 0);
    td_sched_stop(f->sched);
    assert_int_equal(f->log_count, 0);
    assert_true(td_sched_may_read(f->sched));
    arrive_stopping(f, "a", 4);
    arrive_stopping(f, NULL, 5);
    arrive_stopping(f, "b", 6); /* exists, nothing of it waits or runs */
    assert_int_equal(f->log_count, 2);
    finish(f, 1);
    uint64_t ids[] = {5, 6, 1, 2, 3, 4};
    uint32_t want[] = {TALLY_E_SHUTDOWN, TALLY_E_SHUTDOWN, TALLY_OK,
                       TALLY_E_SHUTDOWN, TALLY_E_SHUTDOWN, TALLY_E_SHUTDOWN};
    assert_log(f, ids, 6, want);
    fake_destroy(&f);
}

/* ---- issue 21: a failed request leaves no stream behind ---------------------------------- */

static bool exists(fake_t *f, const char *name)
{
    return td_streams_find(f->streams, name, strlen(name)) != NULL;
}

/* A stream created by a request that fails is removed once nothing of it waits or runs: at
 * once, or after the requests queued behind (a query among them gets unknown_stream), unless one
 * of those is applied; the same after a delete, whatever refused the request (here a backend
 * failure). */
static void test_failed_request_leaves_no_stream(void **state)
{
    (void)state;
    fake_t *f = fake_new(0, TD_BACKEND_CPU, 64);
    arrive(f, TALLY_OP_SCAN, "n", 1, MIB);
    arrive(f, TALLY_OP_QUERY, "n", 2, 0); /* finds the stream its predecessor created */
    finish_failed(f, 1, TALLY_E_BACKEND);
    assert_false(exists(f, "n"));
    arrive(f, TALLY_OP_SCAN, "m", 3, MIB);
    arrive(f, TALLY_OP_SCAN, "m", 4, MIB);
    finish_failed(f, 3, TALLY_E_INTERNAL);
    assert_true(exists(f, "m")); /* 4 is about to use it */
    finish(f, 4);
    assert_true(exists(f, "m"));
    assert_int_equal(td_streams_find(f->streams, "m", 1)->life, TD_STREAM_LIVE);
    /* Deleted while a request is queued behind the delete, which then fails. */
    arrive(f, TALLY_OP_SCAN, "m", 5, MIB);
    arrive(f, TALLY_OP_DELETE, "m", 6, 0);
    arrive(f, TALLY_OP_SCAN, "m", 7, MIB);
    arrive(f, TALLY_OP_QUERY, "m", 8, 0);
    finish(f, 5);
    assert_true(is_running(f, 7));
    finish_failed(f, 7, TALLY_E_BACKEND);
    assert_false(exists(f, "m"));
    uint64_t ids[] = {1, 2, 3, 4, 5, 6, 7, 8};
    uint32_t want[] = {
        TALLY_E_BACKEND, TALLY_E_UNKNOWN_STREAM, TALLY_E_INTERNAL,      TALLY_OK, TALLY_OK,
        TALLY_OK,        TALLY_E_BACKEND,        TALLY_E_UNKNOWN_STREAM};
    assert_log(f, ids, 8, want);
    assert_int_equal(td_streams_count(f->streams), 0);
    fake_destroy(&f);
}

/* Stopping: a new stream whose running request fails and whose waiting ones get `shutdown` is
 * removed; one whose running request was applied stays. */
static void test_shutdown_leaves_no_new_stream(void **state)
{
    (void)state;
    fake_t *f = fake_new(0, TD_BACKEND_CPU, 64);
    arrive(f, TALLY_OP_SCAN, "k", 1, MIB);
    arrive(f, TALLY_OP_SCAN, "k", 2, MIB);
    arrive(f, TALLY_OP_SCAN, "j", 3, MIB);
    arrive(f, TALLY_OP_SCAN, "j", 4, MIB);
    td_sched_stop(f->sched);
    finish_failed(f, 1, TALLY_E_BACKEND);
    finish(f, 3);
    assert_false(exists(f, "k"));
    assert_true(exists(f, "j"));
    uint64_t ids[] = {1, 2, 3, 4};
    uint32_t want[] = {TALLY_E_BACKEND, TALLY_E_SHUTDOWN, TALLY_OK, TALLY_E_SHUTDOWN};
    assert_log(f, ids, 4, want);
    fake_destroy(&f);
}

/* Numbered requests waiting when tallyd stops get `shutdown`, never sequence_gap (PROTOCOL.md
 * §1, §5): even one whose seq skips, and those behind one answered `shutdown`. Without the stop
 * the same requests get sequence_gap, then ok. */
static void test_shutdown_wins_over_sequence_gap(void **state)
{
    (void)state;
    for (int stopping = 0; stopping <= 1; stopping++) {
        fake_t *f = fake_new(0, TD_BACKEND_CPU, 64);
        uint64_t seqs[] = {1, 3, 2, 3};
        for (uint64_t i = 0; i < 4; i++) {
            td_request_t *r = request_new(TALLY_OP_SCAN, TALLY_DTYPE_I32, "q", i + 1, MIB, 0);
            r->req.seq = seqs[i];
            hand_over(f, r);
        }
        assert_int_equal(f->running_count, 1);
        if (stopping)
            td_sched_stop(f->sched);
        finish(f, 1);
        while (f->running_count)
            finish(f, f->running[0]->req.request_id);
        uint64_t ids[] = {1, 2, 3, 4};
        uint32_t run[] = {TALLY_OK, TALLY_E_SEQ_GAP, TALLY_OK, TALLY_OK};
        uint32_t stop[] = {TALLY_OK, TALLY_E_SHUTDOWN, TALLY_E_SHUTDOWN, TALLY_E_SHUTDOWN};
        assert_log(f, ids, 4, stopping ? stop : run);
        assert_int_equal(td_streams_find(f->streams, "q", 1)->info.last_seq, stopping ? 1 : 3);
        fake_destroy(&f);
    }
}

/* ---- issue 9: splitting only onto idle lanes ---------------------------------------------- */

/* A 16 MiB shared-memory scan alone is split over the 4 lanes; while it runs another is run
 * whole (its lanes are busy), and a third after they are done splits again. A request that
 * fits the buffers only split is split whatever the load. */
static void test_split_only_onto_idle_lanes(void **state)
{
    (void)state;
    fake_t *f = fake_new(1, TD_BACKEND_CUDA, 64);
    arrive_flags(f, TALLY_OP_SCAN, NULL, 1, 16 * MIB, TALLY_FLAG_SHM_REF);
    assert_int_equal(f->running[0]->where.pieces, 4);
    arrive_flags(f, TALLY_OP_SCAN, NULL, 2, 16 * MIB, TALLY_FLAG_SHM_REF);
    assert_int_equal(f->running[1]->where.pieces, 1);
    arrive_flags(f, TALLY_OP_HIST, "a", 3, 16 * MIB, TALLY_FLAG_SHM_REF);
    assert_int_equal(f->running[2]->where.pieces, 1);
    arrive(f, TALLY_OP_HIST, NULL, 4, 16 * MIB); /* by payload: never split */
    assert_int_equal(f->running[3]->where.pieces, 1);
    for (uint64_t id = 1; id <= 4; id++)
        finish(f, id);
    arrive_flags(f, TALLY_OP_SCAN, "a", 5, 16 * MIB, TALLY_FLAG_SHM_REF);
    assert_int_equal(f->running[0]->where.pieces, 4);
    /* Pipelined behind it on its stream: its lane is busy, so whole. */
    arrive_flags(f, TALLY_OP_SCAN, "a", 6, 16 * MIB, TALLY_FLAG_SHM_REF);
    assert_int_equal(f->running[1]->where.pieces, 1);
    finish(f, 5);
    finish(f, 6);
    fake_destroy(&f);

    f = fake_new_buffers(1, TD_BACKEND_CUDA, 64, 4 * MIB); /* 12 MiB fits in 3 pieces or more */
    arrive(f, TALLY_OP_HIST, NULL, 7, MIB);
    arrive_flags(f, TALLY_OP_SCAN, NULL, 8, 12 * MIB, TALLY_FLAG_SHM_REF);
    assert_int_equal(f->running[1]->where.pieces, 4); /* lanes busy, split all the same */
    arrive(f, TALLY_OP_SCAN, NULL, 9, 12 * MIB);      /* by payload, above the buffers: the CPU */
    assert_false(f->running[2]->where.gpu);
    for (uint64_t id = 7; id <= 9; id++)
        finish(f, id);
    /* 16 MiB - 1 of rgb8 pixels (5592405) over 4 MiB buffers: 4 pieces by bytes, but the
     * engines round a piece to whole 64 KiB multiples of 3-byte pixels, which makes 4 pieces of
     * 4259775 bytes, over the buffers: 5 pieces. */
    arrive(f, TALLY_OP_HIST, NULL, 10, MIB);
    arrive_typed(f, TALLY_OP_HIST, TALLY_DTYPE_RGB8, NULL, 11, 16 * MIB - 1, TALLY_FLAG_SHM_REF);
    assert_int_equal(f->running[1]->where.pieces, 5);
    size_t piece = td_gpu_piece_elems((16 * MIB - 1) / 3, f->running[1]->where.pieces, 3) * 3;
    assert_true(piece <= 4 * MIB);
    finish(f, 10);
    finish(f, 11);
    fake_destroy(&f);
}

/* ---- issue 21: fair service between peers, and replies in turn after a refusal ------------ */

/* The started requests so far are exactly ids[0..n), in that order. */
static void assert_started(const fake_t *f, const uint64_t *ids, unsigned n)
{
    assert_int_equal(f->started_count, n);
    for (unsigned i = 0; i < n; i++)
        assert_int_equal(f->started[i], ids[i]);
}

/* Finishes the oldest running request. */
static void finish_oldest(fake_t *f)
{
    assert_true(f->running_count > 0);
    finish(f, f->running[0]->req.request_id);
}

/* Two connections of a fresh per-peer table. */
static td_peers_t *two_peers(td_peer_t **heavy, td_peer_t **light)
{
    td_peers_t *peers = NULL;
    assert_int_equal(td_peers_new(&peers), TD_OK);
    *heavy = td_peers_acquire(peers, TD_PEER_CONNECTION, "heavy", 5, 0);
    *light = td_peers_acquire(peers, TD_PEER_CONNECTION, "light", 5, 0);
    return peers;
}

/* Two peers on one CPU worker (2 requests on the machine at once: the worker's and one queued,
 * TD_SCHED_CPU_AHEAD): a peer that queued six 1 MiB batches holds up another's three 64 KiB
 * batches by one of its own, not six; the light peer's all start before the heavy peer's third,
 * as their bytes allow (deficit round robin), where one FIFO would start them last. */
static void test_drr_between_peers(void **state)
{
    (void)state;
    td_peer_t *heavy, *light;
    td_peers_t *peers = two_peers(&heavy, &light);
    fake_t *f = fake_new_limited(0, TD_BACKEND_CPU, 64, 64 * MIB, 1, 0);
    f->conn = heavy;
    for (uint64_t id = 1; id <= 6; id++)
        arrive(f, TALLY_OP_HIST, NULL, id, MIB);
    f->conn = light;
    for (uint64_t id = 11; id <= 13; id++)
        arrive(f, TALLY_OP_HIST, NULL, id, 64 * 1024);
    uint64_t first[] = {1, 2};
    assert_started(f, first, 2); /* the machine is full: the rest wait in their queues */
    assert_non_null(td_peer_flow(heavy, 0));
    while (f->running_count)
        finish_oldest(f);
    uint64_t want[] = {1, 2, 11, 12, 13, 3, 4, 5, 6};
    assert_started(f, want, 9);
    assert_null(td_peer_flow(heavy, 0)); /* an empty queue leaves the turns */
    assert_null(td_peer_flow(light, 0));
    fake_destroy(&f);

    /* Byte fairness between two heavy peers: 1 MiB batches against 256 KiB ones, turn by turn,
     * start in the ratio of their sizes (4 of the smaller for one of the larger). */
    f = fake_new_limited(0, TD_BACKEND_CPU, 64, 64 * MIB, 1, 0);
    f->conn = heavy;
    for (uint64_t id = 1; id <= 3; id++)
        arrive(f, TALLY_OP_HIST, NULL, id, MIB);
    f->conn = light;
    for (uint64_t id = 11; id <= 19; id++)
        arrive(f, TALLY_OP_HIST, NULL, id, 256 * 1024 - TD_SCHED_REQUEST_COST);
    while (f->running_count)
        finish_oldest(f);
    uint64_t fair[] = {1, 2, 11, 12, 13, 14, 3, 15, 16, 17, 18, 19};
    assert_started(f, fair, 12);
    fake_destroy(&f);
    td_peers_destroy(&peers);
}

/* On the GPU lanes too: a peer's pipelined stream fills the lanes' places, and another peer's
 * smaller batch starts at the next free place, ahead of the first peer's backlog. A stream keeps
 * its order: its next request waits for the one in the queue before it. */
static void test_drr_gpu_lanes(void **state)
{
    (void)state;
    td_peer_t *heavy, *light;
    td_peers_t *peers = two_peers(&heavy, &light);
    /* 1 device x 4 lanes x depth 1: 4 GPU requests at once */
    fake_t *f = fake_new_limited(1, TD_BACKEND_CUDA, 64, 64 * MIB, 0, 1);
    f->conn = heavy;
    for (uint64_t id = 1; id <= 8; id++)
        arrive(f, TALLY_OP_SCAN, "a", id, MIB);
    assert_int_equal(f->running_count, 4);
    for (unsigned i = 1; i < 4; i++) /* pipelined on the stream's lane, in order */
        assert_int_equal(f->running[i]->where.lane, f->running[0]->where.lane);
    f->conn = light;
    arrive(f, TALLY_OP_HIST, NULL, 21, 64 * 1024);
    assert_false(is_running(f, 21));
    finish(f, 1);
    assert_true(is_running(f, 21) && !is_running(f, 5));
    assert_int_not_equal(f->running[running_index(f, 21)]->where.lane, f->running[0]->where.lane);
    while (f->running_count)
        finish_oldest(f);
    uint64_t want[] = {1, 2, 3, 4, 21, 5, 6, 7, 8};
    assert_started(f, want, 9);
    uint64_t replies[] = {1, 2, 3, 4, 21, 5, 6, 7, 8};
    assert_log(f, replies, 9, NULL);
    fake_destroy(&f);
    td_peers_destroy(&peers);
}

/* A request refused at admission (a hist of another type: stream_state) while the stream's
 * earlier requests are on the GPU is answered after them, and what follows it waits its turn:
 * the replies leave in the order the requests arrived (issue 21: 0, 2, 1, 3 before). */
static void test_refused_answered_in_turn(void **state)
{
    (void)state;
    fake_t *f = fake_new(1, TD_BACKEND_CUDA, 64);
    arrive(f, TALLY_OP_HIST, "a", 1, MIB); /* sets the stream's type: u8 */
    finish(f, 1);
    arrive(f, TALLY_OP_HIST, "a", 2, MIB);
    arrive(f, TALLY_OP_HIST, "a", 3, MIB);
    arrive_typed(f, TALLY_OP_HIST, TALLY_DTYPE_I32, "a", 4, MIB, 0);
    arrive(f, TALLY_OP_HIST, "a", 5, MIB);
    assert_true(is_running(f, 2) && is_running(f, 3) && !is_running(f, 5));
    assert_int_equal(f->log_count, 1); /* 4 is not answered before 2 and 3 */
    finish(f, 2);
    assert_int_equal(f->log_count, 2);
    finish(f, 3); /* the stream drained: 4 is answered, 5 starts */
    assert_true(is_running(f, 5));
    finish(f, 5);
    uint64_t ids[] = {1, 2, 3, 4, 5};
    uint32_t want[] = {TALLY_OK, TALLY_OK, TALLY_OK, TALLY_E_STREAM_STATE, TALLY_OK};
    assert_log(f, ids, 5, want);
    fake_destroy(&f);
}

/* A scan admitted while its stream's earlier scans run on the GPU, and waiting in its peer's
 * queue (the lanes are full) when one of them fails there: it chose to chain the device carry
 * when it was admitted, so when it runs it must be rerun from the host copy like the others
 * behind the failure (seen on an H200, 2026-11-26: test_seq_gpu's faults run ended with a wrong
 * scan carry, 6 runs in 6). */
static void test_queued_behind_gpu_failure_reruns(void **state)
{
    (void)state;
    /* 1 device x 4 lanes x depth 1: 4 GPU requests at once */
    fake_t *f = fake_new_limited(1, TD_BACKEND_CUDA, 64, 64 * MIB, 0, 1);
    for (uint64_t id = 1; id <= 5; id++)
        arrive(f, TALLY_OP_SCAN, "a", id, MIB);
    assert_int_equal(f->running_count, 4);
    assert_false(is_running(f, 5)); /* admitted, waiting for a place */
    finish_as(f, 1, true);           /* fails on the GPU: rerun inline, answered */
    assert_true(is_running(f, 5));   /* started in the place 1 left */
    while (f->running_count)
        finish_oldest(f);
    assert_int_equal(f->metrics.backend_fallbacks, 5); /* 1, and 2..5 behind it */
    assert_int_equal(f->metrics.gpu_requests[0], 0);
    uint64_t want[] = {1, 2, 3, 4, 5};
    assert_log(f, want, 5, NULL);
    fake_destroy(&f);
}

/* The split's edges (issue 9): a batch under TD_GPU_SPLIT_MIN_BYTES that fits the buffers only
 * in pieces gets as many as it needs even with fewer lanes' worth of bytes; an empty one runs
 * whole; one that even TD_GPU_SPLIT_MAX_PIECES pieces cannot fit, or that the machine cannot
 * split at all, runs on the CPU however the backend asks for the GPU. */
static void test_split_edges(void **state)
{
    (void)state;
    fake_t *f = fake_new_buffers(1, TD_BACKEND_CUDA, 64, MIB);
    arrive_flags(f, TALLY_OP_SCAN, NULL, 1, 3 * MIB, TALLY_FLAG_SHM_REF);
    assert_true(f->running[0]->where.gpu);
    assert_int_equal(f->running[0]->where.pieces, 3); /* 3 MiB / 2 MiB is 1, but 3 fit */
    arrive_flags(f, TALLY_OP_HIST, NULL, 2, 0, TALLY_FLAG_SHM_REF);
    assert_true(f->running[1]->where.gpu);
    assert_int_equal(f->running[1]->where.pieces, 1);
    arrive_flags(f, TALLY_OP_SCAN, NULL, 3, (TD_GPU_SPLIT_MAX_PIECES + 1) * MIB,
                 TALLY_FLAG_SHM_REF);
    assert_false(f->running[2]->where.gpu);
    for (uint64_t id = 1; id <= 3; id++)
        finish(f, id);
    fake_destroy(&f);

    f = fake_new_machine(1, TD_BACKEND_CUDA, 64, 4 * MIB, 0, 0, FAKE_NO_SPLIT);
    arrive_flags(f, TALLY_OP_SCAN, NULL, 4, 12 * MIB, TALLY_FLAG_SHM_REF);
    assert_false(f->running[0]->where.gpu);
    arrive_flags(f, TALLY_OP_SCAN, NULL, 5, 4 * MIB, TALLY_FLAG_SHM_REF);
    assert_true(f->running[1]->where.gpu);
    assert_int_equal(f->running[1]->where.pieces, 1);
    finish(f, 4);
    finish(f, 5);
    fake_destroy(&f);
}

/* The GPU a stream is pinned to becomes unusable while a request of it runs there: the next one
 * is not pipelined onto it; it waits for the stream to drain and starts on a usable GPU. */
static void test_pinned_gpu_lost(void **state)
{
    (void)state;
    fake_t *f = fake_new(2, TD_BACKEND_CUDA, 64);
    arrive(f, TALLY_OP_SCAN, "a", 1, MIB);
    assert_int_equal(f->running[0]->where.device, 0);
    f->dead[0] = true;
    arrive(f, TALLY_OP_SCAN, "a", 2, MIB);
    assert_false(is_running(f, 2));
    finish(f, 1);
    assert_true(is_running(f, 2));
    assert_true(f->running[0]->where.gpu);
    assert_int_equal(f->running[0]->where.device, 1);
    assert_true(f->running[0]->where.carry_upload);
    finish(f, 2);
    uint64_t want[] = {1, 2};
    assert_log(f, want, 2, NULL);
    fake_destroy(&f);
}

/* A GPU request that fails with a status (not applied) while later ones of its stream are
 * pipelined behind it: those chained their scan carry from a device carry the host copy never
 * took, so they rerun on the CPU from the host copy as they come back. */
static void test_failed_gpu_request_reruns_successors(void **state)
{
    (void)state;
    fake_t *f = fake_new(1, TD_BACKEND_CUDA, 64);
    arrive(f, TALLY_OP_SCAN, "a", 1, MIB);
    arrive(f, TALLY_OP_SCAN, "a", 2, MIB);
    assert_true(is_running(f, 1) && is_running(f, 2));
    finish_failed(f, 1, TALLY_E_INTERNAL);
    assert_int_equal(f->metrics.backend_fallbacks, 0);
    finish(f, 2); /* rerun inline on the CPU, answered */
    assert_int_equal(f->metrics.backend_fallbacks, 1);
    assert_int_equal(f->metrics.gpu_requests[0], 1); /* 1 ran there (and failed) */
    uint64_t ids[] = {1, 2};
    uint32_t want[] = {TALLY_E_INTERNAL, TALLY_OK};
    assert_log(f, ids, 2, want);
    fake_destroy(&f);
}

/* Requests by device reference (PROTOCOL.md §10 "Which GPU runs it"): on the region's GPU while
 * it is not busy; with the owner busy (the test switch) on the least loaded GPU that reaches the
 * region over peer access, and a stream's later ones pipelined there only while that rule still
 * holds (else they wait for the stream to drain and go to the owner); with no region_peers
 * (a machine without peer access), always the owner. */
static void test_device_region_placement(void **state)
{
    (void)state;
    fake_t *f = fake_new_machine(3, TD_BACKEND_CUDA, 64, 64 * MIB, 0, 0, FAKE_PEERS);
    td_shm_region_t r0 = device_region(0);
    f->cfg.gpu_peer_queue = 0; /* the owner is never busy */
    f->peers = 1u << 1 | 1u << 2;
    arrive_region(f, TALLY_OP_HIST, NULL, 1, MIB, &r0, NULL);
    assert_int_equal(f->running[0]->where.device, 0);
    arrive(f, TALLY_OP_HIST, NULL, 2, MIB); /* by payload: the least loaded, GPU 1 */
    assert_int_equal(f->running[1]->where.device, 1);
    f->cfg.test_gpu_peer_always = true;
    arrive_region(f, TALLY_OP_HIST, NULL, 3, MIB, &r0, NULL); /* GPU 2: less loaded than 1 */
    assert_int_equal(f->running[2]->where.device, 2);
    arrive_region(f, TALLY_OP_HIST, NULL, 4, MIB, &r0, NULL); /* 1 and 2 tie: the first */
    assert_int_equal(f->running[3]->where.device, 1);
    for (uint64_t id = 1; id <= 4; id++)
        finish(f, id);
    assert_int_equal(f->metrics.gpu_requests[2], 1);

    /* A stream on a peer: pipelined there while the peer reaches the region and the owner is
     * busy, not once either stops. */
    f->peers = 1u << 2;
    arrive_region(f, TALLY_OP_SCAN, "a", 5, MIB, &r0, NULL);
    assert_int_equal(f->running[0]->where.device, 2);
    arrive_region(f, TALLY_OP_SCAN, "a", 6, MIB, &r0, NULL);
    assert_true(is_running(f, 6));
    assert_int_equal(f->running[1]->where.device, 2);
    f->peers = 0;
    arrive_region(f, TALLY_OP_SCAN, "a", 7, MIB, &r0, NULL);
    assert_false(is_running(f, 7));
    finish(f, 5);
    finish(f, 6); /* drained: placed anew, on the owner (no peer reaches the region) */
    assert_true(is_running(f, 7));
    assert_int_equal(f->running[0]->where.device, 0);
    finish(f, 7);
    f->peers = 1u << 1;
    arrive_region(f, TALLY_OP_SCAN, "b", 8, MIB, &r0, NULL);
    assert_int_equal(f->running[0]->where.device, 1);
    f->cfg.test_gpu_peer_always = false; /* the owner is not busy any more */
    arrive_region(f, TALLY_OP_SCAN, "b", 9, MIB, &r0, NULL);
    assert_false(is_running(f, 9));
    finish(f, 8);
    assert_int_equal(f->running[0]->where.device, 0);
    finish(f, 9);
    uint64_t ids[] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    assert_log(f, ids, 9, NULL);
    fake_destroy(&f);

    f = fake_new(2, TD_BACKEND_CUDA, 64); /* no region_peers */
    f->cfg.test_gpu_peer_always = true;
    td_shm_region_t r1 = device_region(1);
    arrive_region(f, TALLY_OP_HIST, NULL, 10, MIB, &r1, NULL);
    assert_int_equal(f->running[0]->where.device, 1);
    finish(f, 10);
    assert_int_equal(f->metrics.gpu_requests[1], 1);
    fake_destroy(&f);
}

/* What a GPU cannot run by device reference is refused, and in its stream's turn: input and
 * output regions on two GPUs (bad_ref), a scan above the buffers (too_large); a failure on the
 * GPU is answered internal (the CPU cannot reach device memory), for the failed request and for
 * the one pipelined behind it alike. */
static void test_device_region_refusals(void **state)
{
    (void)state;
    fake_t *f = fake_new_buffers(2, TD_BACKEND_CUDA, 64, 4 * MIB);
    td_shm_region_t r0 = device_region(0), r1 = device_region(1);
    arrive(f, TALLY_OP_SCAN, "a", 1, MIB);
    assert_int_equal(f->running[0]->where.device, 0);
    arrive_region(f, TALLY_OP_SCAN, "a", 2, MIB, &r0, &r1);
    arrive_region(f, TALLY_OP_SCAN, "a", 3, 8 * MIB, &r0, NULL);
    arrive_region(f, TALLY_OP_SCAN, NULL, 4, MIB, &r1, &r0); /* stateless: answered at once */
    assert_int_equal(f->running_count, 1);
    uint64_t ids1[] = {4};
    uint32_t want1[] = {TALLY_E_BAD_REF};
    assert_log(f, ids1, 1, want1);
    finish(f, 1);
    uint64_t ids2[] = {4, 1, 2, 3};
    uint32_t want2[] = {TALLY_E_BAD_REF, TALLY_OK, TALLY_E_BAD_REF, TALLY_E_TOO_LARGE};
    assert_log(f, ids2, 4, want2);

    arrive_region(f, TALLY_OP_SCAN, "b", 5, MIB, &r1, &r1);
    arrive_region(f, TALLY_OP_SCAN, "b", 6, MIB, &r1, NULL);
    assert_true(is_running(f, 5) && is_running(f, 6));
    finish_as(f, 5, true);
    finish(f, 6); /* queued behind the failure on the device: not trusted either */
    assert_int_equal(f->metrics.backend_fallbacks, 2);
    uint64_t ids3[] = {4, 1, 2, 3, 5, 6};
    uint32_t want3[] = {TALLY_E_BAD_REF,   TALLY_OK,          TALLY_E_BAD_REF,
                        TALLY_E_TOO_LARGE, TALLY_E_INTERNAL, TALLY_E_INTERNAL};
    assert_log(f, ids3, 6, want3);
    fake_destroy(&f);
}

/* ---- the machine td_exec describes to a shard's scheduler ---------------------------------- */

static unsigned exec_cpu_workers(td_exec_t *x, const char *pool_size)
{
    if (pool_size)
        setenv("UV_THREADPOOL_SIZE", pool_size, 1);
    else
        unsetenv("UV_THREADPOOL_SIZE");
    td_sched_machine_t m;
    td_exec_port_machine(x, 0, &m);
    return m.cpu_workers;
}

/* The CPU workers the scheduler counts on are the threads libuv's pool runs: UV_THREADPOOL_SIZE
 * as libuv reads it (4 unset, 1 for 0 or what is not a number, at most 1024); a CPU-only
 * executor has one port at least and no GPU. */
static void test_exec_machine(void **state)
{
    (void)state;
    td_config_t cfg;
    td_config_init(&cfg);
    cfg.backend = TD_BACKEND_CPU;
    td_metrics_t metrics = {0};
    td_exec_env_t env = {.cfg = &cfg, .metrics = &metrics, .ports = 0};
    td_exec_t *x = NULL;
    assert_int_equal(td_exec_new(&env, &x), TD_OK);
    const char *saved = getenv("UV_THREADPOOL_SIZE");
    char *keep = saved ? strdup(saved) : NULL;
    assert_int_equal(exec_cpu_workers(x, NULL), 4);
    assert_int_equal(exec_cpu_workers(x, "0"), 1);
    assert_int_equal(exec_cpu_workers(x, "many"), 1);
    assert_int_equal(exec_cpu_workers(x, "12"), 12);
    assert_int_equal(exec_cpu_workers(x, "5000"), 1024);
    exec_cpu_workers(x, keep);
    free(keep);
    td_sched_machine_t m;
    td_exec_port_machine(x, 0, &m); /* port 0 exists: ports 0 means one */
    assert_int_equal(m.gpu_devices, 0);
    assert_null(m.region_peers);
    assert_string_equal(td_exec_backends(x), "cpu");
    assert_string_equal(td_exec_backend_name(x), "cpu");
    char uuids[8] = "x";
    assert_int_equal(td_exec_gpu_uuids(x, uuids, sizeof uuids), 0);
    assert_string_equal(uuids, "");
    assert_int_equal(td_exec_gpu_uuids(x, NULL, 0), 0); /* no room: nothing written */
    td_exec_port_close(x, 0); /* never opened: nothing to close */
    td_exec_close(x);
    td_exec_destroy(&x);
    assert_null(x);
    td_config_clear(&cfg);
}

/* A lane's scan carries: every stream pinned to the lane holds its own; those given back (more
 * than the free list's first 64) are handed out again, the last one given back first. With more
 * lanes than TD_GPU_SPLIT_MAX_PIECES, a split still stops at that many pieces. */
static void test_lane_carries_and_wide_split(void **state)
{
    (void)state;
    enum { STREAMS = 70 };
    fake_t *f = fake_new_machine(1, TD_BACKEND_CUDA, 128, 64 * MIB, 0, 0, FAKE_ONE_LANE);
    char name[8];
    for (unsigned i = 0; i < STREAMS; i++) {
        snprintf(name, sizeof name, "c%u", i);
        arrive(f, TALLY_OP_SCAN, name, i + 1, MIB);
        assert_true(f->running[i]->where.gpu && f->running[i]->where.carry_upload);
        assert_int_equal(f->running[i]->where.carry_index, i + 1);
    }
    for (unsigned i = 0; i < STREAMS; i++)
        finish_oldest(f);
    arrive(f, TALLY_OP_SCAN, "again", STREAMS + 1, MIB);
    assert_int_equal(f->running[0]->where.carry_index, STREAMS);
    arrive(f, TALLY_OP_SCAN, "again2", STREAMS + 2, MIB);
    assert_int_equal(f->running[1]->where.carry_index, STREAMS - 1);
    finish_oldest(f);
    finish_oldest(f);
    assert_int_equal(f->log_count, STREAMS + 2);
    fake_destroy(&f);

    f = fake_new_machine(1, TD_BACKEND_CUDA, 64, 64 * MIB, 0, 0, FAKE_WIDE);
    arrive_flags(f, TALLY_OP_SCAN, NULL, 1, 64 * MIB, TALLY_FLAG_SHM_REF); /* 32 lanes' worth */
    assert_int_equal(f->running[0]->where.pieces, TD_GPU_SPLIT_MAX_PIECES);
    finish(f, 1);
    fake_destroy(&f);
}

/* A lane out of scan carries (a machine with fewer than its streams need; tallyd's have one per
 * request in flight): the stream runs on the GPU unpinned, uploading its host carry, and its next
 * request waits for it instead of chaining a device carry it does not hold. */
static void test_lane_out_of_carries(void **state)
{
    (void)state;
    fake_t *f = fake_new_machine(1, TD_BACKEND_CUDA, 64, 64 * MIB, 0, 0, FAKE_ONE_CARRY);
    const char *names[] = {"l0", "l1", "l2", "l3", "l4"};
    for (uint64_t i = 0; i < 5; i++)
        arrive(f, TALLY_OP_SCAN, names[i], i + 1, MIB); /* one carry per lane: 4 pinned */
    assert_true(f->running[4]->where.gpu && f->running[4]->where.carry_upload);
    arrive(f, TALLY_OP_SCAN, "l4", 6, MIB);
    assert_false(is_running(f, 6));
    finish(f, 5);
    assert_true(is_running(f, 6)); /* the stream drained: it starts anew */
    while (f->running_count)
        finish_oldest(f);
    uint64_t want[] = {5, 1, 2, 3, 4, 6};
    assert_log(f, want, 6, NULL);
    fake_destroy(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu_stream_in_order),
        cmocka_unit_test(test_gpu_pipelined_query_waits),
        cmocka_unit_test(test_cpu_batch_waits_for_gpu),
        cmocka_unit_test(test_reset_delete_sequencing),
        cmocka_unit_test(test_spread_over_lanes_and_devices),
        cmocka_unit_test(test_backpressure),
        cmocka_unit_test(test_gpu_failure_reruns_on_cpu),
        cmocka_unit_test(test_shutdown_in_order),
        cmocka_unit_test(test_split_only_onto_idle_lanes),
        cmocka_unit_test(test_drr_between_peers),
        cmocka_unit_test(test_drr_gpu_lanes),
        cmocka_unit_test(test_refused_answered_in_turn),
        cmocka_unit_test(test_failed_request_leaves_no_stream),
        cmocka_unit_test(test_shutdown_leaves_no_new_stream),
        cmocka_unit_test(test_shutdown_wins_over_sequence_gap),
        cmocka_unit_test(test_queued_behind_gpu_failure_reruns),
        cmocka_unit_test(test_split_edges),
        cmocka_unit_test(test_pinned_gpu_lost),
        cmocka_unit_test(test_failed_gpu_request_reruns_successors),
        cmocka_unit_test(test_device_region_placement),
        cmocka_unit_test(test_device_region_refusals),
        cmocka_unit_test(test_lane_carries_and_wide_split),
        cmocka_unit_test(test_lane_out_of_carries),
        cmocka_unit_test(test_exec_machine),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
