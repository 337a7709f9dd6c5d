/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_path_port.c — a port (daemon/core/td_transport.h, td_path_port.c): the request path's
 * front for a transport's own thread, as the NATS fleet thread uses it (issue 32). The real path
 * runs on 4 shard threads with the CPU executor, in this process, with no socket: the test's
 * thread is the loop's, and a thread of its own is the port's.
 *
 * What it checks:
 *   - one port thread submits scans of ones on 64 streams, 40 each, interleaved, in batches, and
 *     sleeps by the port's rule (td_path_port_sleep, then its eventfd): every request gets
 *     exactly one reply, and each stream's requests apply in the order submitted (a scan's sums
 *     continue from the stream's running carry: the k-th reply's first sum is k * 8 + 1); no
 *     reply is lost to a missed wake-up (the wait would time out), and no reply bytes stay
 *     counted after the replies are taken;
 *   - max_inflight: a port takes no more than the path's limit (TD_ERR_BUSY, nothing taken), the
 *     loop thread counts the port's requests (td_path_inflight, td_path_may_read), and the port
 *     takes more once replies have come;
 *   - stopping: after the drain, and after td_path_close, the port answers every request
 *     `shutdown` itself, echoing its request id, a batch submitted before the close and flushed
 *     after it included (nothing is posted to a closed shard);
 *   - `streams` from a port (gathered by the front with the shards held) and a ping, on no
 *     stream, come back to the port;
 *   - out of memory: a port with no spare whose request cannot be allocated (malloc wrapped at
 *     link, failing on command on the port's thread) answers TD_ERR_NOMEM with nothing taken:
 *     the payload still the caller's, not freed, nothing counted in flight, no reply to come;
 *     the same message submitted again is taken and answered, first on its stream (the failed
 *     one applied nothing), its payload freed once; a port with a spare needs no memory;
 *   - with one shard there is no port (the transport goes through the loop thread).
 */
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cmocka.h>

#include "td_exec.h"
#include "td_path.h"
#include "td_settings.h"
#include "tk_backend.h"

/* ---- The wrapped allocator (-Wl,--wrap=malloc): each thread's mallocs fail on command ---- */

void *__real_malloc(size_t size);
void *__wrap_malloc(size_t size);

static _Thread_local unsigned mallocs_to_fail; /* this thread's next mallocs that fail */
static _Thread_local unsigned mallocs_failed;  /* this thread's, failed so far */

void *__wrap_malloc(size_t size)
{
    if (mallocs_to_fail) {
        mallocs_to_fail--;
        mallocs_failed++;
        return NULL;
    }
    return __real_malloc(size);
}

#define SHARDS 4
#define STREAMS 64
#define PER_STREAM 40
#define ONES 8 /* int32 ones in each scan */
#define TOTAL (STREAMS * PER_STREAM)

typedef struct {
    td_config_t cfg;
    td_metrics_t metrics;
    uv_loop_t loop;
    td_streams_t *streams;
    td_peers_t *peers;
    td_replies_t *replies;
    tk_backend_t *cpu;
    td_exec_t *exec;
    td_path_t *path;
    td_transport_t transport;
    td_path_port_t *port;
    int wake_fd;
    atomic_uint wakes;
    /* The port's thread's: what its replies said (checked on the test's thread). */
    unsigned seen[TOTAL + 1]; /* replies by request id */
    unsigned out_of_order, not_ok, shutdowns, taken;
    uint64_t last_id;
    atomic_bool done;
} rig_t;

static void exec_done(void *owner, td_request_t *r)
{
    rig_t *g = owner;
    td_path_finished(g->path, r);
}

static void answer_here(void *owner, td_request_t *r)
{
    (void)owner;
    td_request_succeed(r, TALLY_DTYPE_NONE, NULL, 0, 0);
}

static td_err_t machine_open(void *ctx, unsigned shard, uv_loop_t *loop, td_sched_machine_t *m)
{
    rig_t *g = ctx;
    if (td_exec_port_open(g->exec, shard, loop) != 0)
        return TD_ERR_LIBRARY;
    td_exec_port_machine(g->exec, shard, m);
    return TD_OK;
}

static void machine_close(void *ctx, unsigned shard)
{
    rig_t *g = ctx;
    td_exec_port_close(g->exec, shard);
}

static void no_reply(td_transport_t *t, td_reply_t *reply)
{
    (void)t;
    td_reply_end(reply, TD_REPLY_SENT); /* a port's replies never come this way */
    fail_msg("a port's reply came through send_reply");
}

static const td_transport_ops_t port_ops = {.name = "port", .send_reply = no_reply};

static void wake(void *ctx)
{
    rig_t *g = ctx;
    uint64_t one = 1;
    atomic_fetch_add(&g->wakes, 1);
    ssize_t n = write(g->wake_fd, &one, sizeof one);
    (void)n;
}

/* The path on `shards` shards (threads when more than one), its port opened when it has one. */
static rig_t *rig_new(unsigned shards, unsigned max_inflight)
{
    rig_t *g = calloc(1, sizeof *g);
    assert_non_null(g);
    td_config_init(&g->cfg);
    g->cfg.max_inflight = max_inflight;
    g->cfg.backend = TD_BACKEND_CPU;
    assert_int_equal(uv_loop_init(&g->loop), 0);
    assert_int_equal(td_streams_new_parts(shards, 1000, &g->streams), TD_OK);
    assert_int_equal(td_peers_new_shards(shards, &g->peers), TD_OK);
    assert_int_equal(td_replies_new(&g->cfg, &g->replies), TD_OK);
    assert_int_equal(tk_cpu_backend_new(&g->cpu), TALLY_OK);
    td_path_env_t env = {.cfg = &g->cfg,
                         .metrics = &g->metrics,
                         .streams = g->streams,
                         .peers = g->peers,
                         .replies = g->replies,
                         .loop = &g->loop,
                         .answer_here = answer_here,
                         .owner = g};
    assert_int_equal(td_path_new(&env, &g->path), TD_OK);
    td_exec_env_t xenv = {.loop = &g->loop,
                          .cfg = &g->cfg,
                          .metrics = &g->metrics,
                          .cpu = g->cpu,
                          .ports = td_path_port_count(g->path),
                          .done = exec_done,
                          .owner = g};
    assert_int_equal(td_exec_new(&xenv, &g->exec), TD_OK);
    td_path_machines_t machines = {.open = machine_open, .close = machine_close, .ctx = g};
    assert_int_equal(td_path_start(g->path, &machines), TD_OK);
    g->transport = (td_transport_t){.ops = &port_ops, .path = g->path, .owns_streams = true};
    g->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    assert_true(g->wake_fd >= 0);
    td_err_t err = td_path_port_open(g->path, &g->transport, wake, g, &g->port);
    assert_int_equal(err, shards > 1 ? TD_OK : TD_ERR_CONFIG);
    assert_int_equal(td_path_run(g->path), TD_OK);
    return g;
}

static void rig_destroy(rig_t **g_p)
{
    rig_t *g = *g_p;
    if (!td_path_stopping(g->path))
        td_path_stop(g->path);
    td_path_close(g->path); /* the shards' threads end (once) */
    td_path_port_close(&g->port);
    assert_null(g->port);
    td_exec_close(g->exec);
    uv_run(&g->loop, UV_RUN_DEFAULT); /* the close callbacks */
    td_reply_gauges_t gauges = {0};
    td_replies_gauges(g->replies, &gauges);
    assert_int_equal(gauges.held, 0);
    td_path_destroy(&g->path);
    td_exec_destroy(&g->exec);
    g->cpu->destroy(&g->cpu);
    td_peers_destroy(&g->peers);
    td_replies_destroy(&g->replies);
    td_streams_destroy(&g->streams);
    assert_int_equal(uv_loop_close(&g->loop), 0);
    close(g->wake_fd);
    td_config_clear(&g->cfg);
    free(g);
    *g_p = NULL;
}

/* A scan of ONES int32 ones on stream "port<s>" with request id `id`. */
static td_err_t submit_scan(rig_t *g, unsigned s, uint64_t id)
{
    tally_req_t req = {.opcode = TALLY_OP_SCAN, .dtype = TALLY_DTYPE_I32, .request_id = id};
    char name[16];
    snprintf(name, sizeof name, "port%02u", s);
    if (tally_req_set_stream(&req, name) != TALLY_OK)
        return TD_ERR_CONFIG;
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(&req, header);
    int32_t ones[ONES];
    for (unsigned i = 0; i < ONES; i++)
        ones[i] = 1;
    td_msg_t m = {.header = header,
                  .header_len = sizeof header,
                  .payload = {.data = ones, .len = sizeof ones},
                  .payload_borrowed = true,
                  .frames = 2};
    return td_path_port_submit(g->port, &m);
}

/* The port's thread, for each reply: once each, and the k-th of its stream after k others. */
static void on_reply(void *ctx, td_reply_t *reply)
{
    rig_t *g = ctx;
    uint64_t id = reply->rep.request_id;
    g->taken++;
    g->last_id = id;
    g->shutdowns += reply->rep.status == TALLY_E_SHUTDOWN;
    if (reply->rep.status != TALLY_OK || id == 0 || id > TOTAL ||
        reply->body.len != ONES * sizeof(int64_t)) {
        g->not_ok++;
        return;
    }
    g->seen[id]++;
    unsigned k = (unsigned)((id - 1) / STREAMS); /* id = k * STREAMS + s + 1 */
    int64_t first;
    memcpy(&first, reply->body.data, sizeof first);
    if (first != (int64_t)k * ONES + 1)
        g->out_of_order++;
}

/* The port's thread's sleep: the port's rule first, then its eventfd (up to 10 s). */
static void wait_for_replies(rig_t *g)
{
    if (td_path_port_sleep(g->port)) {
        struct pollfd p = {.fd = g->wake_fd, .events = POLLIN};
        if (poll(&p, 1, 10000) > 0) {
            uint64_t count;
            ssize_t n = read(g->wake_fd, &count, sizeof count);
            (void)n;
        }
    }
    td_path_port_take_replies(g->port, on_reply, g);
}

static void *port_thread(void *arg)
{
    rig_t *g = arg;
    unsigned sent = 0;
    for (unsigned k = 0; k < PER_STREAM; k++) {
        for (unsigned s = 0; s < STREAMS; s++) {
            uint64_t id = (uint64_t)k * STREAMS + s + 1;
            td_err_t err;
            while ((err = submit_scan(g, s, id)) == TD_ERR_BUSY) {
                td_path_port_flush(g->port);
                wait_for_replies(g);
            }
            if (err != TD_OK)
                goto out;
            if (++sent % 50 == 0) { /* a batch a turn, as the fleet thread's */
                td_path_port_flush(g->port);
                td_path_port_take_replies(g->port, on_reply, g);
            }
        }
    }
    td_path_port_flush(g->port);
    int64_t until = (int64_t)(uv_hrtime() / 1000000) + 30000;
    while (g->taken < sent && (int64_t)(uv_hrtime() / 1000000) < until)
        wait_for_replies(g);
out:
    atomic_store(&g->done, true);
    return NULL;
}

static void tick(uv_timer_t *timer)
{
    (void)timer;
}

/* The loop thread's part while the port works: gathers and the executor's own handles. The
 * path's handles do not keep a loop alive (the transports do): a timer does, here. */
static void run_loop_until_done(rig_t *g)
{
    uv_timer_t alive;
    uv_timer_init(&g->loop, &alive);
    uv_timer_start(&alive, tick, 1, 1);
    while (!atomic_load(&g->done))
        uv_run(&g->loop, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&alive, NULL);
    uv_run(&g->loop, UV_RUN_NOWAIT);
}

static void test_every_reply_once_in_each_streams_order(void **state)
{
    (void)state;
    rig_t *g = rig_new(SHARDS, 1024);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, port_thread, g), 0);
    run_loop_until_done(g);
    pthread_join(t, NULL);
    assert_int_equal(g->taken, TOTAL);
    assert_int_equal(g->not_ok, 0);
    assert_int_equal(g->out_of_order, 0);
    for (unsigned id = 1; id <= TOTAL; id++)
        if (g->seen[id] != 1)
            fail_msg("request %u: %u replies", id, g->seen[id]);
    assert_int_equal(td_path_port_inflight(g->port), 0);
    assert_int_equal(td_path_inflight(g->path), 0);
    assert_true(atomic_load(&g->wakes) > 0); /* it slept, and replies woke it */
    rig_destroy(&g);
}

/* On the test's thread alone: the k-th scans of stream 0 from k = first on, until the port says
 * busy; how many it took. */
static unsigned submit_until_busy(rig_t *g, unsigned first)
{
    unsigned n = 0;
    while (submit_scan(g, 0, (uint64_t)(first + n) * STREAMS + 1) == TD_OK)
        n++;
    return n;
}

static void test_max_inflight_counts_the_port(void **state)
{
    (void)state;
    rig_t *g = rig_new(SHARDS, 4);
    assert_int_equal(submit_until_busy(g, 0), 4);
    assert_int_equal(td_path_port_inflight(g->port), 4);
    assert_int_equal(td_path_inflight(g->path), 4); /* the loop thread sees them */
    assert_false(td_path_may_read(g->path));
    td_path_port_flush(g->port);
    while (g->taken < 4)
        wait_for_replies(g);
    assert_int_equal(g->not_ok, 0);
    assert_int_equal(g->out_of_order, 0);
    assert_true(td_path_may_read(g->path));
    assert_int_equal(submit_until_busy(g, 4), 4); /* room again */
    td_path_port_flush(g->port);
    while (g->taken < 8)
        wait_for_replies(g);
    assert_int_equal(g->out_of_order, 0);
    rig_destroy(&g);
}

static void test_stopped_path_answered_by_the_port(void **state)
{
    (void)state;
    rig_t *g = rig_new(SHARDS, 64);
    td_path_stop(g->path);
    td_path_drain_over(g->path);
    assert_int_equal(submit_scan(g, 1, 7), TD_OK); /* after the drain: the port answers */
    assert_int_equal(td_path_port_take_replies(g->port, on_reply, g), 1);
    assert_int_equal(g->shutdowns, 1);
    assert_int_equal(g->last_id, 7);
    rig_destroy(&g);
}

static void test_closed_path_answered_by_the_port(void **state)
{
    (void)state;
    rig_t *g = rig_new(SHARDS, 64);
    for (unsigned s = 0; s < 8; s++) /* submitted before the close, flushed after it */
        assert_int_equal(submit_scan(g, s, 100 + s), TD_OK);
    td_path_stop(g->path);
    td_path_close(g->path);
    td_path_port_flush(g->port); /* nothing posted to the closed shards */
    assert_int_equal(submit_scan(g, 9, 200), TD_OK);
    td_path_port_flush(g->port);
    assert_int_equal(td_path_port_take_replies(g->port, on_reply, g), 9);
    assert_int_equal(g->shutdowns, 9);
    assert_int_equal(g->last_id, 200); /* in the order submitted */
    assert_int_equal(td_path_port_inflight(g->port), 0);
    rig_destroy(&g); /* td_path_close again does nothing */
}

/* The port's thread: a `streams` and a ping, on no stream, each answered ok (the `streams` one
 * gathered by the front from every shard, then back to its shard and to the port). */
static void on_any_reply(void *ctx, td_reply_t *reply)
{
    rig_t *g = ctx;
    g->taken++;
    g->not_ok += reply->rep.status != TALLY_OK;
    g->last_id = reply->rep.request_id;
}

static void *gather_thread(void *arg)
{
    rig_t *g = arg;
    const uint8_t ops[] = {TALLY_OP_STREAMS, TALLY_OP_PING};
    for (unsigned i = 0; i < 2; i++) {
        tally_req_t req = {.opcode = ops[i], .request_id = 900 + i};
        uint8_t header[TALLY_REQ_HEADER_SIZE];
        tally_req_encode(&req, header);
        td_msg_t m = {.header = header, .header_len = sizeof header, .frames = 2};
        if (td_path_port_submit(g->port, &m) != TD_OK)
            g->not_ok++;
    }
    td_path_port_flush(g->port);
    int64_t until = (int64_t)(uv_hrtime() / 1000000) + 10000;
    while (g->taken < 2 && (int64_t)(uv_hrtime() / 1000000) < until) {
        if (td_path_port_sleep(g->port)) {
            struct pollfd p = {.fd = g->wake_fd, .events = POLLIN};
            if (poll(&p, 1, 1000) > 0) {
                uint64_t count;
                ssize_t n = read(g->wake_fd, &count, sizeof count);
                (void)n;
            }
        }
        td_path_port_take_replies(g->port, on_any_reply, g);
    }
    atomic_store(&g->done, true);
    return NULL;
}

static void test_gathered_answers_reach_the_port(void **state)
{
    (void)state;
    rig_t *g = rig_new(SHARDS, 64);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, gather_thread, g), 0);
    run_loop_until_done(g);
    pthread_join(t, NULL);
    assert_int_equal(g->taken, 2);
    assert_int_equal(g->not_ok, 0);
    assert_int_equal(td_path_port_inflight(g->port), 0);
    rig_destroy(&g);
}

/* A payload the test owns: counted when the path gives it back. */
static void count_free(void *data, void *hint)
{
    (void)data;
    atomic_fetch_add((atomic_uint *)hint, 1);
}

static void test_no_memory_for_a_request(void **state)
{
    (void)state;
    rig_t *g = rig_new(SHARDS, 4);
    static int32_t ones[ONES]; /* the payload, not borrowed: the path's once taken */
    for (unsigned i = 0; i < ONES; i++)
        ones[i] = 1;
    atomic_uint freed = 0;
    tally_req_t req = {.opcode = TALLY_OP_SCAN, .dtype = TALLY_DTYPE_I32, .request_id = 1};
    assert_int_equal(tally_req_set_stream(&req, "port00"), TALLY_OK);
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(&req, header);
    td_bytes_t payload = {.data = ones, .len = sizeof ones, .free_fn = count_free, .hint = &freed};
    td_msg_t m = {.header = header, .header_len = sizeof header, .payload = payload, .frames = 2};

    /* No spare yet: the request is allocated, and that allocation fails. */
    mallocs_to_fail = 1;
    assert_int_equal(td_path_port_submit(g->port, &m), TD_ERR_NOMEM);
    assert_int_equal(mallocs_to_fail, 0);
    assert_int_equal(mallocs_failed, 1);
    assert_ptr_equal(m.payload.data, ones); /* nothing taken: still the caller's */
    assert_int_equal(m.payload.len, sizeof ones);
    assert_int_equal(atomic_load(&freed), 0);
    assert_int_equal(td_path_port_inflight(g->port), 0);
    assert_int_equal(td_path_inflight(g->path), 0);
    td_path_port_flush(g->port);
    assert_true(td_path_port_sleep(g->port)); /* no reply waits, none will come */
    assert_int_equal(td_path_port_take_replies(g->port, on_reply, g), 0);

    /* With memory back, the same message: taken, answered, the first scan of its stream. */
    assert_int_equal(td_path_port_submit(g->port, &m), TD_OK);
    assert_null(m.payload.data);
    assert_int_equal(td_path_port_inflight(g->port), 1);
    td_path_port_flush(g->port);
    int64_t until = (int64_t)(uv_hrtime() / 1000000) + 10000;
    while (g->taken < 1 && (int64_t)(uv_hrtime() / 1000000) < until)
        wait_for_replies(g);
    assert_int_equal(g->taken, 1);
    assert_int_equal(g->not_ok, 0);
    assert_int_equal(g->seen[1], 1);
    assert_int_equal(g->out_of_order, 0); /* its sums start at 1: the failed one applied nothing */
    assert_int_equal(atomic_load(&freed), 1);
    assert_int_equal(td_path_port_inflight(g->port), 0);

    /* Its request is the port's spare now: the next one needs no memory. */
    req.request_id = STREAMS + 1; /* the stream's second scan */
    tally_req_encode(&req, header);
    m.payload = payload;
    mallocs_to_fail = 1;
    assert_int_equal(td_path_port_submit(g->port, &m), TD_OK);
    assert_int_equal(mallocs_to_fail, 1);
    mallocs_to_fail = 0;
    td_path_port_flush(g->port);
    until = (int64_t)(uv_hrtime() / 1000000) + 10000;
    while (g->taken < 2 && (int64_t)(uv_hrtime() / 1000000) < until)
        wait_for_replies(g);
    assert_int_equal(g->taken, 2);
    assert_int_equal(g->not_ok, 0);
    assert_int_equal(g->out_of_order, 0);
    assert_int_equal(atomic_load(&freed), 2);
    assert_int_equal(mallocs_failed, 1);
    rig_destroy(&g);
}

static void test_one_shard_has_no_port(void **state)
{
    (void)state;
    rig_t *g = rig_new(1, 64);
    assert_null(g->port);
    rig_destroy(&g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_reply_once_in_each_streams_order),
        cmocka_unit_test(test_max_inflight_counts_the_port),
        cmocka_unit_test(test_stopped_path_answered_by_the_port),
        cmocka_unit_test(test_closed_path_answered_by_the_port),
        cmocka_unit_test(test_gathered_answers_reach_the_port),
        cmocka_unit_test(test_no_memory_for_a_request),
        cmocka_unit_test(test_one_shard_has_no_port),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
