/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_client_alloc.c — libtally when memory runs out (issue 37), as SQLite tests it: a
 * representative client session against a real tallyd (connect, ping, info, a numbered push
 * with short chunks, tally_run, a query and everything libtally renders from a record —
 * summary, quantiles, JSON, CSV, the stream's JSON —, the stream list, a shared-memory region
 * and a request through it, minmax, a subscriber, the client's end) runs once to count the
 * allocations libtally makes, then once for every N with the Nth of them failing. Each run must
 * end with every call answering TALLY_OK or TALLY_E_NOMEM (nothing else, no crash), nothing
 * libtally allocated in the run still held afterwards (no leak: the allocations are tracked
 * pointer by pointer), and, when the client was made, a ping through it still answered with
 * memory back (a failure leaves the client usable).
 *
 * The program is linked with -Wl,--wrap for malloc, calloc, realloc, strdup, strndup and free,
 * so every allocation of libtally's own code (linked in statically) goes through the wrappers
 * below; ZeroMQ's and libc's own do not.
 */
#include <pthread.h>
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

/* ---- the wrapped allocator -------------------------------------------------------------- */

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);
char *__real_strdup(const char *s);
char *__real_strndup(const char *s, size_t n);
void __real_free(void *p);

#define SLOTS (1u << 16) /* live allocations tracked at once, at most */
#define TOMB ((void *)1)

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static void *live[SLOTS];        /* open addressing; NULL empty, TOMB deleted */
static unsigned live_run[SLOTS]; /* the run that made each */
static unsigned run_id;          /* the run in progress (0: none); never reused */
static unsigned runs;
static long counted, fail_at; /* allocations in this run; the one to fail (0: none) */
static bool overflowed;

static unsigned slot_of(const void *p)
{
    uintptr_t h = (uintptr_t)p;
    h ^= h >> 17;
    h *= 0x9E3779B97F4A7C15ull;
    return (unsigned)(h >> 40) & (SLOTS - 1);
}

static void track(void *p)
{
    if (!p || !run_id)
        return;
    for (unsigned i = slot_of(p), n = 0; n < SLOTS; i = (i + 1) & (SLOTS - 1), n++)
        if (!live[i] || live[i] == TOMB) {
            live[i] = p;
            live_run[i] = run_id;
            return;
        }
    overflowed = true;
}

static void untrack(void *p)
{
    if (!p)
        return;
    for (unsigned i = slot_of(p), n = 0; n < SLOTS && live[i]; i = (i + 1) & (SLOTS - 1), n++)
        if (live[i] == p) {
            live[i] = TOMB;
            return;
        }
}

/* True when this allocation is the one to fail; counts it. */
static bool fail_this(void)
{
    return run_id && ++counted == fail_at;
}

#define ALLOC(call)                                                                                \
    pthread_mutex_lock(&lock);                                                                     \
    void *p = fail_this() ? NULL : (call);                                                         \
    track(p);                                                                                      \
    pthread_mutex_unlock(&lock);                                                                   \
    return p

void *__wrap_malloc(size_t n)
{
    ALLOC(__real_malloc(n));
}

void *__wrap_calloc(size_t n, size_t size)
{
    ALLOC(__real_calloc(n, size));
}

char *__wrap_strdup(const char *s)
{
    ALLOC(__real_strdup(s));
}

char *__wrap_strndup(const char *s, size_t n)
{
    ALLOC(__real_strndup(s, n));
}

void *__wrap_realloc(void *old, size_t n)
{
    pthread_mutex_lock(&lock);
    void *p = fail_this() ? NULL : __real_realloc(old, n);
    if (p) {
        untrack(old);
        track(p);
    }
    pthread_mutex_unlock(&lock);
    return p;
}

void __wrap_free(void *p)
{
    pthread_mutex_lock(&lock);
    untrack(p);
    pthread_mutex_unlock(&lock);
    __real_free(p);
}

static void arm(long at)
{
    pthread_mutex_lock(&lock);
    run_id = ++runs;
    counted = 0;
    fail_at = at;
    pthread_mutex_unlock(&lock);
}

/* Ends the run: the allocations it made and never freed. */
static unsigned disarm(void)
{
    pthread_mutex_lock(&lock);
    unsigned leaked = 0;
    for (unsigned i = 0; i < SLOTS; i++)
        leaked += live[i] && live[i] != TOMB && live_run[i] == run_id;
    run_id = 0;
    pthread_mutex_unlock(&lock);
    return leaked;
}

/* ---- the session ------------------------------------------------------------------------- */

static th_daemon_t daemon_;
static int32_t input[3000];

typedef struct {
    tally_status_t status; /* the first call that did not answer TALLY_OK */
    const char *step;
    tally_client_t *client; /* kept for the check after the run */
} outcome_t;

#define STEP(o, name, call)                                                                        \
    do {                                                                                           \
        tally_status_t st_ = (call);                                                               \
        if (st_ != TALLY_OK && (o)->status == TALLY_OK) {                                          \
            (o)->status = st_;                                                                     \
            (o)->step = (name);                                                                    \
        }                                                                                          \
    } while (0)

static void renderings(outcome_t *o, const tally_stream_info_t *info)
{
    tally_hist_t hist;
    STEP(o, "hist_from_info", tally_hist_from_info(info, 0, &hist));
    if (o->status != TALLY_OK)
        return;
    tally_hist_summary_t sum;
    tally_hist_summarize(&hist, &sum);
    double qs[] = {0.5, 0.9, 0.999};
    tally_stream_view_t view = {.name = "alloc/s", .info = info};
    /* Each into a buffer of its own, so that each meets an allocation of its own. */
    tally_buf_t buf[6] = {{0}};
    STEP(o, "hist_json", tally_hist_json(&hist, &buf[0]));
    STEP(o, "hist_json_quantiles", tally_hist_json_quantiles(&hist, qs, 3, &buf[1]));
    STEP(o, "hist_csv", tally_hist_csv(&hist, "c0", true, &buf[2]));
    STEP(o, "hist_csv_quantiles", tally_hist_csv_quantiles(&hist, "c0", true, qs, 3, &buf[3]));
    STEP(o, "stream_json", tally_stream_json(&view, &buf[4]));
    STEP(o, "json_string", tally_json_string("a \"quoted\"\tname", &buf[5]));
    for (int i = 0; i < 6; i++)
        tally_buf_free(&buf[i]);
}

static void data_calls(outcome_t *o, tally_client_t *c)
{
    /* A numbered push of short chunks on the stream. */
    tally_req_t scan = {.opcode = TALLY_OP_SCAN, .dtype = TALLY_DTYPE_I32};
    tally_req_set_stream(&scan, "alloc/s");
    tally_run_opts_t opts = {.chunk_bytes = 4000, .window = 2, .seq = TALLY_RUN_SEQ_APPEND};
    tally_push_t *push = NULL;
    STEP(o, "push_new", tally_push_new(c, &scan, &opts, NULL, NULL, &push));
    for (int i = 0; push && i < 5 && o->status == TALLY_OK; i++)
        STEP(o, "push_write", tally_push_write(push, input + 300 * i, 1200));
    if (push)
        STEP(o, "push_finish", tally_push_finish(push));
    tally_push_destroy(&push);
    /* tally_run: a filter in three chunks, a hist. */
    tally_req_t filter = {.opcode = TALLY_OP_FILTER,
                          .dtype = TALLY_DTYPE_I32,
                          .pred = TALLY_PRED_GT,
                          .flags = TALLY_FLAG_FILTER_STABLE};
    tally_run_opts_t three = {.chunk_bytes = 4000, .window = 3};
    tally_buf_t out = {0};
    tally_run_result_t res;
    STEP(o, "run_filter", tally_run(c, &filter, input, sizeof input, &three, &out, &res));
    tally_req_t hist = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
    tally_req_set_stream(&hist, "alloc/s");
    STEP(o, "run_hist", tally_run(c, &hist, input, 4096, NULL, &out, &res));
    tally_buf_free(&out);
    int64_t lo = 0, hi = 0;
    STEP(o, "minmax", tally_minmax(c, TALLY_DTYPE_I32, input, sizeof input, &lo, &hi));
}

static void stream_calls(outcome_t *o, tally_client_t *c)
{
    tally_stream_info_t info;
    tally_status_t st = tally_query(c, "alloc/s", &info);
    STEP(o, "query", st);
    if (st == TALLY_OK)
        renderings(o, &info);
    char **names = NULL;
    size_t count = 0;
    st = tally_streams(c, &names, &count);
    STEP(o, "streams", st);
    if (st == TALLY_OK)
        tally_strings_free(names, count);
    tally_region_t *region = NULL;
    st = tally_region_create(c, 1 << 16, &region);
    STEP(o, "region_create", st);
    if (st == TALLY_OK) {
        memcpy(tally_region_data(region), input, 8192);
        tally_req_t hist = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8};
        tally_reply_t reply;
        tally_reply_init(&reply);
        STEP(o, "call_shm", tally_call_shm(c, &hist, region, 0, 8192, NULL, 0, &reply));
        tally_reply_clear(&reply);
        tally_region_destroy(&region);
    }
}

/* The session; the client is left in o->client (NULL when it could not be made). */
static void session(outcome_t *o)
{
    *o = (outcome_t){.status = TALLY_OK};
    tally_client_t *c = NULL;
    STEP(o, "client_new", tally_client_new(daemon_.endpoint, 20000, &c));
    if (!c)
        return;
    o->client = c;
    STEP(o, "ping", tally_ping(c, NULL));
    char *text = NULL;
    STEP(o, "info", tally_info(c, TALLY_OP_INFO, &text));
    free(text);
    tally_info_t *info = NULL;
    STEP(o, "info_fetch", tally_info_fetch(c, &info));
    uint64_t max_batch = 0;
    if (info)
        STEP(o, "info_u64", tally_info_u64(info, "max_batch", &max_batch));
    tally_info_destroy(&info);
    data_calls(o, c);
    stream_calls(o, c);
    tally_sub_t *sub = NULL;
    STEP(o, "sub_new", tally_sub_new("tcp://127.0.0.1:1", &sub));
    if (sub)
        STEP(o, "sub_subscribe", tally_sub_subscribe(sub, "alloc/"));
    tally_sub_destroy(&sub);
}

static int setup(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof input / sizeof input[0]; i++)
        input[i] = (int32_t)(th_rand() % 2001) - 1000;
    const char *args[] = {"--backend", "cpu", NULL};
    return th_daemon_start(&daemon_, args);
}

static int teardown(void **state)
{
    (void)state;
    return th_daemon_stop(&daemon_, SIGTERM, 10000) == 0 ? 0 : -1;
}

/* No allocation fails from now on (the run is still tracked); the count so far. */
static long stop_failing(void)
{
    pthread_mutex_lock(&lock);
    long made = counted;
    fail_at = 0;
    pthread_mutex_unlock(&lock);
    return made;
}

/* One run with allocation `at` failing (0: none): the outcome checked, then, with memory back,
 * a ping through the session's client, and the client ended. */
static long run_once(long at, int *nomem)
{
    arm(at);
    outcome_t o;
    session(&o);
    long made = stop_failing();
    tally_status_t ping = o.client ? tally_ping(o.client, NULL) : TALLY_OK;
    tally_client_destroy(&o.client);
    unsigned leaked = disarm();
    if (ping != TALLY_OK)
        fail_msg("allocation %ld failing (in %s): the client's next ping answered %s", at,
                 o.step ? o.step : "no step", tally_status_name(ping));
    if (o.status != TALLY_OK && o.status != TALLY_E_NOMEM)
        fail_msg("allocation %ld failing: %s answered %s", at, o.step, tally_status_name(o.status));
    if (at == 0 && o.status != TALLY_OK)
        fail_msg("nothing failing: %s answered %s", o.step, tally_status_name(o.status));
    if (leaked)
        fail_msg("allocation %ld failing (in %s): %u allocations of the run still held", at,
                 o.step ? o.step : "no step", leaked);
    *nomem += o.status == TALLY_E_NOMEM;
    return made;
}

static void test_every_allocation_fails_once(void **state)
{
    (void)state;
    int nomem = 0;
    long count = run_once(0, &nomem);
    print_message("the session makes %ld allocations in libtally\n", count);
    assert_true(count > 20);
    for (long at = 1; at <= count; at++)
        run_once(at, &nomem);
    print_message("%d of %ld runs ended in TALLY_E_NOMEM\n", nomem, count);
    assert_true(nomem > 0);
    assert_false(overflowed);
}

int main(void)
{
    th_seed();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_allocation_fails_once),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
