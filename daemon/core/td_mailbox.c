/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_mailbox.c — a lock-free stack of hops and a wake-up (see td_mailbox.h).
 *
 * Memory order: a post publishes what the hops carry with release, the take acquires it, so the
 * consumer sees everything the producer wrote into a request before posting it. The wake-up's
 * flag and the stack meet through a sequentially consistent fence on each side (td_mailbox.h).
 */
#include "td_mailbox.h"

int td_mailbox_init(td_mailbox_t *mb, uv_loop_t *loop, uv_async_cb cb, void *data)
{
    atomic_init(&mb->stack.top, NULL);
    atomic_init(&mb->sleeping, true); /* not running yet: the first post wakes it */
    mb->wake = NULL;
    int rc = uv_async_init(loop, &mb->async, cb);
    if (rc != 0)
        return rc;
    mb->async.data = data;
    mb->open = true;
    return 0;
}

void td_mailbox_init_wake(td_mailbox_t *mb, void (*wake)(void *ctx), void *ctx)
{
    atomic_init(&mb->stack.top, NULL);
    atomic_init(&mb->sleeping, true);
    mb->wake = wake;
    mb->wake_ctx = ctx;
    mb->open = true;
}

void td_mailbox_close(td_mailbox_t *mb)
{
    if (!mb->open)
        return;
    mb->open = false;
    if (!mb->wake)
        uv_close((uv_handle_t *)&mb->async, NULL);
}

void td_hop_batch_add(td_hop_batch_t *batch, td_hop_t *hop, unsigned kind)
{
    hop->kind = kind;
    hop->next = batch->newest;
    batch->newest = hop;
    if (!batch->oldest)
        batch->oldest = hop;
}

static void stack_push(td_hop_stack_t *stack, td_hop_batch_t *batch)
{
    if (!batch->newest)
        return;
    td_hop_t *top = atomic_load_explicit(&stack->top, memory_order_relaxed);
    do {
        batch->oldest->next = top;
    } while (!atomic_compare_exchange_weak_explicit(&stack->top, &top, batch->newest,
                                                    memory_order_release, memory_order_relaxed));
    batch->newest = batch->oldest = NULL;
}

static td_hop_t *stack_take(td_hop_stack_t *stack)
{
    return atomic_exchange_explicit(&stack->top, NULL, memory_order_acquire);
}

void td_mailbox_post(td_mailbox_t *mb, td_hop_batch_t *batch)
{
    if (!batch->newest)
        return;
    stack_push(&mb->stack, batch);
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&mb->sleeping, memory_order_relaxed) &&
        atomic_exchange_explicit(&mb->sleeping, false, memory_order_relaxed)) {
        if (mb->wake) /* one poster wakes it; the others find it awake */
            mb->wake(mb->wake_ctx);
        else
            uv_async_send(&mb->async);
    }
}

bool td_mailbox_sleep(td_mailbox_t *mb)
{
    atomic_store_explicit(&mb->sleeping, true, memory_order_relaxed);
    atomic_thread_fence(memory_order_seq_cst);
    if (!td_mailbox_waiting(mb))
        return true;
    atomic_store_explicit(&mb->sleeping, false, memory_order_relaxed);
    return false;
}

void td_mailbox_wake(td_mailbox_t *mb)
{
    atomic_store_explicit(&mb->sleeping, false, memory_order_relaxed);
}

void td_mailbox_post_one(td_mailbox_t *mb, td_hop_t *hop, unsigned kind)
{
    td_hop_batch_t one = {0};
    td_hop_batch_add(&one, hop, kind);
    td_mailbox_post(mb, &one);
}

td_hop_t *td_mailbox_take(td_mailbox_t *mb)
{
    td_hop_t *hop = stack_take(&mb->stack);
    td_hop_t *oldest_first = NULL;
    while (hop) { /* newest first on the stack: reversed */
        td_hop_t *next = hop->next;
        hop->next = oldest_first;
        oldest_first = hop;
        hop = next;
    }
    return oldest_first;
}
