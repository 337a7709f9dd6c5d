/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_gpu_engine.c — the GPU engines without a GPU: the simulated engine (td_gpu_sim.c) and the
 * fault engine (td_gpu_fault.c) over it.
 *
 * A split hist of every dtype must equal the CPU backend's histogram of the whole batch. Every
 * Nth launch must run, leave its device carry clobbered and report failure without calling
 * done; the launches between pass through exactly (done once, exact sums); a split job counts as
 * one launch; out of memory at lane_open after a given number of lanes (and what the pipeline
 * makes of it: the device skipped, or no GPU); slow completions come that much later; with
 * nothing asked for, the wrapper is invisible. A lost context (sticky_at) fails the device until
 * device_reset. The engines' outcomes (td_gpu_err_t) reach the wire through td_gpu_status alone.
 * Polling: a launch without done, lane_finished and lane_notify (issue 34).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "td_gpu.h"
#include "td_gpu_engine.h"

#define MAX_BATCH (1u << 20) /* a split job's 64 KiB-element pieces fit */
#define SLOTS 2u
#define CARRIES 4u

typedef struct {
    td_gpu_engine_t *e;
    void *lanes[2];
    td_gpu_staging_t staging[2][SLOTS];
} rig_t;

static void rig_open(rig_t *g, unsigned devices, const td_gpu_fault_opts_t *opts)
{
    td_gpu_engine_t *sim = NULL;
    memset(g, 0, sizeof *g);
    assert_int_equal(td_gpu_engine_sim_new(devices, &sim), TD_GPU_OK);
    assert_int_equal(td_gpu_engine_fault_new(sim, opts, &g->e), TD_GPU_OK);
    for (unsigned i = 0; i < 2; i++) {
        char why[128] = "";
        uint64_t bytes = 0;
        assert_int_equal(g->e->lane_open(g->e->ctx, 0, MAX_BATCH, SLOTS, CARRIES, &g->lanes[i],
                                         g->staging[i], &bytes, why, sizeof why),
                         TD_GPU_OK);
        assert_true(bytes >= 3 * MAX_BATCH);
        assert_int_equal(g->e->lane_bind(g->lanes[i]), TD_GPU_OK);
    }
}

static void rig_close(rig_t *g)
{
    for (unsigned i = 0; i < 2; i++)
        g->e->lane_close(g->lanes[i]);
    g->e->destroy(&g->e);
    assert_null(g->e);
}

static void count_done(void *arg)
{
    (*(unsigned *)arg)++;
}

/* A scan of 1, 2, .. n on lane 0, slot 0, carry 1; `upload`: from `carry_in`. Returns the
 * launch's status; *dones counts the done calls. */
static td_gpu_err_t scan_job(rig_t *g, size_t n, bool upload, int64_t carry_in, unsigned *dones)
{
    td_gpu_staging_t *s = &g->staging[0][0];
    int32_t *in = s->in;
    for (size_t i = 0; i < n; i++)
        in[i] = (int32_t)(i + 1);
    s->small->carry = carry_in;
    td_gpu_job_t job = {
        .opcode = TALLY_OP_SCAN,
        .dtype = TALLY_DTYPE_I32,
        .n = n,
        .carry_index = 1,
        .carry_upload = upload,
        .slot = 0,
    };
    return g->e->lane_launch(g->lanes[0], &job, count_done, dones);
}

/* Every 3rd launch fails after running and leaves garbage in its device carry; the others are
 * exact and chain from whatever the carry holds. */
static void test_every_third_launch_fails(void **state)
{
    (void)state;
    rig_t g;
    rig_open(&g, 1, &(td_gpu_fault_opts_t){.fail_every = 3});
    const int64_t *out = g.staging[0][0].out;
    unsigned dones = 0;
    assert_int_equal(scan_job(&g, 4, true, 0, &dones), TD_GPU_OK); /* 1: 1 3 6 10 */
    assert_int_equal(dones, 1);
    assert_int_equal(g.staging[0][0].small->carry, 10);
    assert_int_equal(scan_job(&g, 4, false, 0, &dones), TD_GPU_OK); /* 2: from 10 */
    assert_int_equal(dones, 2);
    assert_int_equal(out[0], 11);
    assert_int_equal(out[3], 20);
    assert_int_equal(g.staging[0][0].small->carry, 20);
    assert_int_equal(scan_job(&g, 4, false, 0, &dones), TD_GPU_E_DEVICE); /* 3: injected */
    assert_int_equal(dones, 2);
    assert_non_null(strstr(g.e->error_string(), "injected fault: 1 launch in 3 fails"));
    assert_int_equal(scan_job(&g, 4, false, 0, &dones), TD_GPU_OK); /* 4: chains from garbage */
    assert_int_equal(g.staging[0][0].small->carry, (int64_t)TD_GPU_GARBAGE_CARRY + 10);
    assert_int_equal(scan_job(&g, 4, true, 100, &dones), TD_GPU_OK); /* 5: uploaded again */
    assert_int_equal(out[3], 110);
    assert_int_equal(scan_job(&g, 1, true, 0, &dones), TD_GPU_E_DEVICE); /* 6 */
    assert_int_equal(dones, 4);
    rig_close(&g);
}

/* A split job is one launch: with every launch failing it reports failure with its carry
 * clobbered; with every 2nd, the first split hist over both lanes is exact. */
static void test_split_launch(void **state)
{
    (void)state;
    for (unsigned every = 1; every <= 2; every++) {
        rig_t g;
        rig_open(&g, 1, &(td_gpu_fault_opts_t){.fail_every = every});
        size_t n = 3 * (64u << 10); /* three 64 KiB pieces over two lanes */
        uint8_t *src = malloc(n);
        assert_non_null(src);
        for (size_t i = 0; i < n; i++)
            src[i] = (uint8_t)(i % 7);
        td_gpu_job_t job = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8, .n = n, .src = src};
        unsigned dones = 0;
        td_gpu_err_t st =
            g.e->lane_launch_split(g.lanes[0], g.lanes, 2, 3, &job, count_done, &dones);
        if (every == 1) {
            assert_int_equal(st, TD_GPU_E_DEVICE);
            assert_int_equal(dones, 0);
        } else {
            assert_int_equal(st, TD_GPU_OK);
            assert_int_equal(dones, 1);
            const tk_hist_t *h = &g.staging[0][0].small->hist;
            uint64_t total = 0;
            for (unsigned b = 0; b < 256; b++)
                total += h->bins[b];
            assert_int_equal(total, n);
            assert_int_equal(h->bins[6], n / 7);
            assert_int_equal(h->bins[7], 0);
        }
        free(src);
        rig_close(&g);
    }
}

/* The clobbered carry of a failed split job, seen by the next (passing) launch. */
static void test_split_fault_clobbers_carry(void **state)
{
    (void)state;
    rig_t g;
    rig_open(&g, 1, &(td_gpu_fault_opts_t){.fail_every = 2});
    unsigned dones = 0;
    assert_int_equal(scan_job(&g, 4, true, 0, &dones), TD_GPU_OK); /* 1: carry 10 */
    size_t n = 2 * (64u << 10);
    int32_t *src = calloc(n, sizeof *src);
    int64_t *dst = calloc(n, sizeof *dst);
    assert_non_null(src);
    assert_non_null(dst);
    td_gpu_job_t job = {.opcode = TALLY_OP_SCAN,
                        .dtype = TALLY_DTYPE_I32,
                        .n = n,
                        .carry_index = 1,
                        .src = src,
                        .dst = dst};
    assert_int_equal(g.e->lane_launch_split(g.lanes[0], g.lanes, 2, 2, &job, count_done, &dones),
                     TD_GPU_E_DEVICE); /* 2 */
    assert_int_equal(dst[n - 1], 10);  /* it ran (zeros continue the carry 10) */
    assert_int_equal(scan_job(&g, 4, false, 0, &dones), TD_GPU_OK); /* 3 */
    assert_int_equal(g.staging[0][0].small->carry, (int64_t)TD_GPU_GARBAGE_CARRY + 10);
    assert_int_equal(dones, 2);
    free(src);
    free(dst);
    rig_close(&g);
}

static void ignore_complete(void *owner, td_request_t *r)
{
    (void)owner;
    (void)r;
}

/* Out of memory at open: lane_open fails after the lanes asked for, and the pipeline skips the
 * device that could not open (or finds no GPU at all). */
static void test_oom_at_open(void **state)
{
    (void)state;
    td_gpu_opts_t opts = {.max_batch = MAX_BATCH, .lanes = 2, .slots = SLOTS, .max_inflight = 4};
    for (unsigned before = 0; before <= 2; before += 2) {
        td_gpu_engine_t *sim = NULL, *e = NULL;
        assert_int_equal(td_gpu_engine_sim_new(2, &sim), TD_GPU_OK);
        td_gpu_fault_opts_t faults = {.oom_at_open = true, .lanes_before_oom = before};
        assert_int_equal(td_gpu_engine_fault_new(sim, &faults, &e), TD_GPU_OK);
        uv_loop_t loop;
        assert_int_equal(uv_loop_init(&loop), 0);
        td_gpu_t *gpu = NULL;
        char why[256] = "";
        td_err_t err = td_gpu_new(&loop, e, &opts, &gpu, why, sizeof why);
        if (err == TD_OK)
            assert_int_equal(td_gpu_sink_open(gpu, 0, &loop, ignore_complete, NULL), 0);
        if (before == 0) { /* no lane opens: no device */
            assert_int_equal(err, TD_ERR_BACKEND);
            assert_null(gpu);
        } else { /* device 0's two lanes open, device 1 is skipped */
            assert_int_equal(err, TD_OK);
            assert_int_equal(td_gpu_device_count(gpu), 1);
            assert_true(td_gpu_usable(gpu));
            td_gpu_sink_close(gpu, 0);
            td_gpu_close(gpu);
            uv_run(&loop, UV_RUN_DEFAULT);
            td_gpu_destroy(&gpu);
        }
        /* the last device's reason */
        assert_non_null(strstr(why, "device 1: out of memory (injected fault)"));
        assert_int_equal(uv_loop_close(&loop), 0);
    }
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Slow completions: done comes slow_us later (the sim completes inside the launch). */
static void test_slow_completions(void **state)
{
    (void)state;
    rig_t g;
    rig_open(&g, 1, &(td_gpu_fault_opts_t){.slow_us = 30000});
    unsigned dones = 0;
    double t0 = now_ms();
    assert_int_equal(scan_job(&g, 4, true, 5, &dones), TD_GPU_OK);
    assert_true(now_ms() - t0 >= 30.0);
    assert_int_equal(dones, 1);
    assert_int_equal(g.staging[0][0].small->carry, 15);
    rig_close(&g);
}

/* Nothing asked for: the inner engine's name, devices and results, every launch passing. */
static void test_pass_through(void **state)
{
    (void)state;
    rig_t g;
    rig_open(&g, 2, &(td_gpu_fault_opts_t){0});
    assert_string_equal(g.e->name, "sim");
    assert_int_equal(g.e->device_count(g.e->ctx), 2);
    char desc[64];
    g.e->describe(g.e->ctx, 1, desc, sizeof desc);
    assert_string_equal(desc, "simulated GPU 1");
    unsigned dones = 0;
    for (int i = 0; i < 10; i++)
        assert_int_equal(scan_job(&g, 4, i == 0, 0, &dones), TD_GPU_OK);
    assert_int_equal(dones, 10);
    assert_int_equal(g.staging[0][0].small->carry, 100);
    assert_int_equal(g.e->lane_check(g.lanes[0]), TD_GPU_OK);
    void *p = g.e->host_alloc(g.e->ctx, 0, 64);
    assert_non_null(p);
    g.e->host_free(g.e->ctx, p);
    rig_close(&g);
}

/* A hist split over two lanes, of every dtype, equals the CPU backend's of the whole batch. */
static void test_split_hist_every_dtype(void **state)
{
    (void)state;
    static const struct {
        uint8_t dtype;
        int64_t lo, hi;
    } cases[] = {{TALLY_DTYPE_U8, 0, 0},
                 {TALLY_DTYPE_I32, -1000, 1000},
                 {TALLY_DTYPE_U16, 100, 4096},
                 {TALLY_DTYPE_RGB8, 0, 0},
                 {TALLY_DTYPE_RGBA8, 0, 0}};
    rig_t g;
    rig_open(&g, 1, &(td_gpu_fault_opts_t){0});
    tk_backend_t *cpu = NULL;
    assert_int_equal(tk_cpu_backend_new(&cpu), TALLY_OK);
    size_t bytes = 3 * (64u << 10) * 4 + 12; /* three pieces or more, whatever the dtype */
    uint8_t *src = malloc(bytes);
    assert_non_null(src);
    for (size_t i = 0; i < bytes; i++)
        src[i] = (uint8_t)(i * 2654435761u >> 13);
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        size_t esize = tally_dtype_size((tally_dtype_t)cases[k].dtype);
        size_t n = bytes / esize;
        td_gpu_job_t job = {.opcode = TALLY_OP_HIST,
                            .dtype = cases[k].dtype,
                            .n = n,
                            .lo = cases[k].lo,
                            .hi = cases[k].hi,
                            .src = src};
        unsigned dones = 0;
        assert_int_equal(
            g.e->lane_launch_split(g.lanes[0], g.lanes, 2, 3, &job, count_done, &dones), TD_GPU_OK);
        assert_int_equal(dones, 1);
        tk_hist_t want;
        memset(&want, 0, sizeof want);
        assert_int_equal(
            tk_backend_hist(cpu, cases[k].dtype, src, n, cases[k].lo, cases[k].hi, &want),
            TD_GPU_OK);
        assert_memory_equal(&g.staging[0][0].small->hist, &want, sizeof want);
    }
    free(src);
    cpu->destroy(&cpu);
    rig_close(&g);
}

/* A split whose rounded pieces would not fit the lanes' buffers is refused, not run past them:
 * 3 MiB of rgb8 pixels in 3 pieces over 1 MiB buffers (each piece 64 KiB too long); in 4 it
 * runs, and equals the CPU's histogram. */
static void test_split_too_large_refused(void **state)
{
    (void)state;
    rig_t g;
    rig_open(&g, 1, &(td_gpu_fault_opts_t){0});
    size_t bytes = 3 * MAX_BATCH;
    uint8_t *src = malloc(bytes);
    assert_non_null(src);
    for (size_t i = 0; i < bytes; i++)
        src[i] = (uint8_t)(i * 40503u >> 7);
    td_gpu_job_t job = {
        .opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_RGB8, .n = bytes / 3, .src = src};
    unsigned dones = 0;
    assert_int_equal(g.e->lane_launch_split(g.lanes[0], g.lanes, 2, 3, &job, count_done, &dones),
                     TD_GPU_E_UNFIT);
    assert_int_equal(g.e->lane_launch_split(g.lanes[0], g.lanes, 2, 4, &job, count_done, &dones),
                     TD_GPU_OK);
    assert_int_equal(dones, 1);
    tk_backend_t *cpu = NULL;
    assert_int_equal(tk_cpu_backend_new(&cpu), TALLY_OK);
    tk_hist_t want;
    memset(&want, 0, sizeof want);
    assert_int_equal(tk_backend_hist(cpu, TALLY_DTYPE_RGB8, src, bytes / 3, 0, 0, &want), TALLY_OK);
    assert_memory_equal(&g.staging[0][0].small->hist, &want, sizeof want);
    cpu->destroy(&cpu);
    free(src);
    rig_close(&g);
}

/* The engines' outcomes are their own (td_gpu_err_t), and reach the wire through one mapping:
 * a client's descriptor, size or event is bad_ref, anything else internal. An import of a
 * descriptor that is not an exported allocation, or of the wrong size, is the client's. */
static void test_outcomes_to_wire(void **state)
{
    (void)state;
    assert_int_equal(td_gpu_status(TD_GPU_OK), TALLY_OK);
    assert_int_equal(td_gpu_status(TD_GPU_E_CLIENT), TALLY_E_BAD_REF);
    assert_int_equal(td_gpu_status(TD_GPU_E_DEVICE), TALLY_E_INTERNAL);
    assert_int_equal(td_gpu_status(TD_GPU_E_NOMEM), TALLY_E_INTERNAL);
    assert_int_equal(td_gpu_status(TD_GPU_E_UNFIT), TALLY_E_INTERNAL);
    assert_int_equal(td_gpu_err_from_tk(TALLY_OK), TD_GPU_OK);
    assert_int_equal(td_gpu_err_from_tk(TALLY_E_PARAM), TD_GPU_E_UNFIT);
    assert_int_equal(td_gpu_err_from_tk(TALLY_E_BACKEND), TD_GPU_E_DEVICE);
    rig_t g;
    rig_open(&g, 1, &(td_gpu_fault_opts_t){0});
    int pipefd[2];
    assert_int_equal(pipe(pipefd), 0);
    void *import = NULL, *ptr = NULL;
    char why[128] = "";
    td_gpu_import_args_t args = {.device = 0, .fd = pipefd[0], .size = 4096};
    uint32_t peers = 0;
    assert_int_equal(g.e->dev_import(g.e->ctx, &args, &peers, &import, &ptr, why, sizeof why),
                     TD_GPU_E_CLIENT);
    assert_non_null(strstr(why, "not an exportable GPU allocation"));
    close(pipefd[0]);
    close(pipefd[1]);
    rig_close(&g);
}

/* A lost context (sticky_at): the launch is accepted and never completes, the lane then reports
 * the failure and every launch on the device fails, until device_reset recreates it; with
 * reset_fails it cannot. */
static void test_lost_context(void **state)
{
    (void)state;
    for (int fails = 0; fails < 2; fails++) {
        rig_t g;
        rig_open(&g, 1, &(td_gpu_fault_opts_t){.sticky_at = 2, .reset_fails = fails});
        unsigned dones = 0;
        assert_int_equal(scan_job(&g, 4, true, 0, &dones), TD_GPU_OK); /* 1 */
        assert_int_equal(dones, 1);
        assert_int_equal(g.e->lane_check(g.lanes[0]), TD_GPU_OK);
        assert_int_equal(scan_job(&g, 4, true, 0, &dones), TD_GPU_OK); /* 2: lost */
        assert_int_equal(dones, 1);                                      /* never completes */
        assert_int_equal(g.e->lane_check(g.lanes[0]), TD_GPU_E_DEVICE);
        assert_int_equal(g.e->lane_check(g.lanes[1]), TD_GPU_E_DEVICE); /* the whole device */
        assert_int_equal(scan_job(&g, 4, true, 0, &dones), TD_GPU_E_DEVICE);
        char why[128] = "";
        assert_int_equal(g.e->device_reset(g.e->ctx, 0, why, sizeof why),
                         fails ? TD_GPU_E_DEVICE : TD_GPU_OK);
        assert_int_equal(g.e->lane_check(g.lanes[0]), fails ? TD_GPU_E_DEVICE : TD_GPU_OK);
        assert_int_equal(scan_job(&g, 4, true, 0, &dones), fails ? TD_GPU_E_DEVICE : TD_GPU_OK);
        assert_int_equal(dones, fails ? 1 : 2);
        rig_close(&g);
    }
}

/* Polling (--gpu-spin-us, issue 34): a launch without done runs and says so through
 * lane_finished, and lane_notify calls its done once the lane's work is finished; slow
 * completions delay only done (the work has finished); a lost context finishes nothing and
 * withholds the wake-up, for the watchdog to find. */
static void test_polling(void **state)
{
    (void)state;
    rig_t g;
    rig_open(&g, 1, &(td_gpu_fault_opts_t){.slow_us = 30000, .sticky_at = 3});
    td_gpu_staging_t *s = &g.staging[0][0];
    int32_t *in = s->in;
    for (int i = 0; i < 4; i++)
        in[i] = i + 1;
    s->small->carry = 5;
    td_gpu_job_t job = {.opcode = TALLY_OP_SCAN,
                        .dtype = TALLY_DTYPE_I32,
                        .n = 4,
                        .carry_index = 1,
                        .carry_upload = true,
                        .slot = 0};
    assert_int_equal(g.e->lane_launch(g.lanes[0], &job, NULL, NULL), TD_GPU_OK); /* 1 */
    assert_true(g.e->lane_finished(g.lanes[0], 0));
    assert_int_equal(s->small->carry, 15);
    unsigned dones = 0;
    assert_int_equal(g.e->lane_notify(g.lanes[0], count_done, &dones), TD_GPU_OK);
    assert_int_equal(dones, 1);
    job.carry_upload = false;
    assert_int_equal(g.e->lane_launch(g.lanes[0], &job, NULL, NULL), TD_GPU_OK); /* 2 */
    assert_int_equal(s->small->carry, 25);
    assert_int_equal(g.e->lane_launch(g.lanes[0], &job, NULL, NULL), TD_GPU_OK); /* 3: lost */
    assert_false(g.e->lane_finished(g.lanes[0], 0));
    assert_int_equal(g.e->lane_notify(g.lanes[0], count_done, &dones), TD_GPU_OK);
    assert_int_equal(dones, 1); /* withheld */
    assert_int_equal(g.e->lane_check(g.lanes[0]), TD_GPU_E_DEVICE);
    rig_close(&g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_third_launch_fails),
        cmocka_unit_test(test_split_launch),
        cmocka_unit_test(test_split_fault_clobbers_carry),
        cmocka_unit_test(test_oom_at_open),
        cmocka_unit_test(test_slow_completions),
        cmocka_unit_test(test_pass_through),
        cmocka_unit_test(test_split_hist_every_dtype),
        cmocka_unit_test(test_split_too_large_refused),
        cmocka_unit_test(test_outcomes_to_wire),
        cmocka_unit_test(test_lost_context),
        cmocka_unit_test(test_polling),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
