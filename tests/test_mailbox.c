/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_mailbox.c — the hand-off between the request path's threads (daemon/core/td_mailbox.h):
 * hops come out oldest first, and a post writes the consumer's wake-up only when it sleeps.
 *
 * What it checks:
 *   - hops posted in batches come out in the order they were added, across batches;
 *   - a consumer that has not slept yet, or sleeps (td_mailbox_sleep said true), is woken by a
 *     post (its async callback runs); one that is awake (td_mailbox_wake) is not, and
 *     td_mailbox_sleep then says hops are waiting instead of letting it sleep;
 *   - no wake-up is lost: a producer thread posts one hop at a time while the consumer runs the
 *     protocol (take, sleep if nothing waits, block in its loop, wake) until it has them all, in
 *     order; a lost wake-up would leave it blocked, and the watchdog timer fails the test;
 *   - a consumer with no loop (td_mailbox_init_wake: a port's thread) is woken through its own
 *     function by the same rule.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "td_mailbox.h"

typedef struct {
    td_hop_t hop;
    unsigned n;
} item_t;

typedef struct {
    uv_loop_t loop;
    td_mailbox_t mb;
    unsigned woken; /* async callbacks run */
} consumer_t;

static void woken_cb(uv_async_t *handle)
{
    consumer_t *c = handle->data;
    c->woken++;
}

static void consumer_open(consumer_t *c)
{
    assert_int_equal(uv_loop_init(&c->loop), 0);
    assert_int_equal(td_mailbox_init(&c->mb, &c->loop, woken_cb, c), 0);
}

static void consumer_close(consumer_t *c)
{
    td_mailbox_close(&c->mb);
    uv_run(&c->loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&c->loop), 0);
}

static unsigned take_count(td_mailbox_t *mb, unsigned *next)
{
    unsigned n = 0;
    for (td_hop_t *hop = td_mailbox_take(mb); hop; hop = hop->next, n++) {
        item_t *it = (item_t *)hop;
        assert_int_equal(it->n, *next);
        assert_int_equal(hop->kind, 7);
        (*next)++;
    }
    return n;
}

static void test_batches_come_out_in_order(void **state)
{
    (void)state;
    consumer_t c = {0};
    consumer_open(&c);
    item_t items[10];
    td_hop_batch_t batch = {0};
    for (unsigned i = 0; i < 10; i++) {
        items[i].n = i;
        td_hop_batch_add(&batch, &items[i].hop, 7);
        if (i == 3 || i == 9) /* two batches: 0-3, 4-9 */
            td_mailbox_post(&c.mb, &batch);
    }
    assert_true(td_hop_batch_empty(&batch));
    unsigned next = 0;
    assert_int_equal(take_count(&c.mb, &next), 10);
    assert_null(td_mailbox_take(&c.mb));
    consumer_close(&c);
}

static void test_post_wakes_only_a_sleeper(void **state)
{
    (void)state;
    consumer_t c = {0};
    consumer_open(&c);
    item_t items[3] = {{.n = 0}, {.n = 1}, {.n = 2}};
    unsigned next = 0;
    /* Not run yet: the first post wakes it. */
    td_mailbox_post_one(&c.mb, &items[0].hop, 7);
    uv_run(&c.loop, UV_RUN_NOWAIT);
    assert_int_equal(c.woken, 1);
    assert_int_equal(take_count(&c.mb, &next), 1);
    /* Awake: a post leaves the wake-up alone, and the consumer finds the hop before it sleeps. */
    td_mailbox_wake(&c.mb);
    td_mailbox_post_one(&c.mb, &items[1].hop, 7);
    uv_run(&c.loop, UV_RUN_NOWAIT);
    assert_int_equal(c.woken, 1);
    assert_true(td_mailbox_waiting(&c.mb));
    assert_false(td_mailbox_sleep(&c.mb));
    assert_int_equal(take_count(&c.mb, &next), 1);
    /* Asleep: the post wakes it. */
    assert_true(td_mailbox_sleep(&c.mb));
    td_mailbox_post_one(&c.mb, &items[2].hop, 7);
    uv_run(&c.loop, UV_RUN_NOWAIT);
    assert_int_equal(c.woken, 2);
    assert_int_equal(take_count(&c.mb, &next), 1);
    consumer_close(&c);
}

/* ---- A producer thread against a sleeping consumer ------------------------------------------ */

#define HOPS 20000u

typedef struct {
    td_mailbox_t *mb;
    item_t *items;
} producer_t;

static void produce(void *arg)
{
    producer_t *p = arg;
    for (unsigned i = 0; i < HOPS; i++) {
        td_mailbox_post_one(p->mb, &p->items[i].hop, 7);
        if (i % 64 == 0)
            uv_sleep(0); /* let the consumer catch up and sleep now and then */
    }
}

static void watchdog_cb(uv_timer_t *timer)
{
    (void)timer;
    fail_msg("the consumer slept with hops waiting: a wake-up was lost");
}

static void test_no_wakeup_is_lost(void **state)
{
    (void)state;
    consumer_t c = {0};
    consumer_open(&c);
    uv_timer_t watchdog; /* generous: the whole run takes milliseconds */
    uv_timer_init(&c.loop, &watchdog);
    uv_timer_start(&watchdog, watchdog_cb, 60000, 0);
    item_t *items = calloc(HOPS, sizeof *items);
    assert_non_null(items);
    for (unsigned i = 0; i < HOPS; i++)
        items[i].n = i;
    producer_t p = {.mb = &c.mb, .items = items};
    uv_thread_t thread;
    assert_int_equal(uv_thread_create(&thread, produce, &p), 0);
    unsigned next = 0;
    unsigned asked = 0; /* td_mailbox_sleep calls: each lets a post wake it once at most */
    while (next < HOPS) {
        take_count(&c.mb, &next);
        if (next == HOPS)
            break;
        asked++;
        if (!td_mailbox_sleep(&c.mb))
            continue;
        uv_run(&c.loop, UV_RUN_ONCE); /* blocks until a post wakes it (or the watchdog) */
        td_mailbox_wake(&c.mb);
    }
    uv_thread_join(&thread);
    assert_int_equal(next, HOPS);
    assert_true(c.woken <= asked + 1); /* only a sleeper (or the one not started) was woken */
    uv_close((uv_handle_t *)&watchdog, NULL);
    consumer_close(&c);
    free(items);
}

static void count_wake(void *ctx)
{
    (*(unsigned *)ctx)++;
}

/* A consumer with no loop (a port's: td_path_port.c): the same rule through its own function. */
static void test_wake_function_only_for_a_sleeper(void **state)
{
    (void)state;
    td_mailbox_t mb;
    unsigned wakes = 0;
    td_mailbox_init_wake(&mb, count_wake, &wakes);
    item_t items[4];
    for (unsigned i = 0; i < 4; i++)
        items[i].n = i;
    td_mailbox_post_one(&mb, &items[0].hop, 1); /* not awake yet: woken */
    td_mailbox_post_one(&mb, &items[1].hop, 1); /* woken once already: not again */
    assert_int_equal(wakes, 1);
    td_mailbox_wake(&mb);
    td_hop_t *hop = td_mailbox_take(&mb);
    assert_ptr_equal(hop, &items[0].hop);
    assert_ptr_equal(hop->next, &items[1].hop);
    td_mailbox_post_one(&mb, &items[2].hop, 1); /* awake: no wake-up */
    assert_int_equal(wakes, 1);
    assert_false(td_mailbox_sleep(&mb)); /* it waits: take it instead of sleeping */
    assert_ptr_equal(td_mailbox_take(&mb), &items[2].hop);
    assert_true(td_mailbox_sleep(&mb));
    td_mailbox_post_one(&mb, &items[3].hop, 1); /* asleep: woken */
    assert_int_equal(wakes, 2);
    td_mailbox_close(&mb);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batches_come_out_in_order),
        cmocka_unit_test(test_post_wakes_only_a_sleeper),
        cmocka_unit_test(test_no_wakeup_is_lost),
        cmocka_unit_test(test_wake_function_only_for_a_sleeper),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
