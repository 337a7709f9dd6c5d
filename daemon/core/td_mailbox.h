/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_mailbox.h — how the threads of the request path hand each other work (issue 31): the
 * transports' thread hands a request to its shard, and the shard hands the reply back for its
 * transport to send (the transport's end of the reply stays on the transports' thread); a
 * transport's own thread with a port (td_path_port.c) does the same, with a mailbox of its own
 * for its replies, which it takes and ends itself.
 *
 * A mailbox is a lock-free stack of hops (a Treiber stack: one compare-and-swap to post, one
 * exchange to take everything) and a uv_async_t on the consumer's loop. A producer collects what
 * it has for one mailbox in a batch of its own while it works (no atomic at all), and posts the
 * batch at once: one compare-and-swap and one wake-up for a whole pump of requests, not a lock
 * per message. The consumer takes the whole stack when it wakes and reverses it: hops come out in
 * the order they were added, by one producer and across its batches, so a stream's requests,
 * which all go through the one thread that reads them, reach their shard in arrival order.
 *
 * Wake-ups: a post writes the consumer's wake-up (an eventfd write, and the consumer's return from
 * its poll and read: libuv's async, or the consumer's own function for one that runs no loop, the
 * fleet thread's eventfd) only when the consumer sleeps, or is about to. A consumer that is awake
 * takes what was posted before it sleeps again: td_mailbox_sleep, called last before it blocks,
 * says whether hops are waiting (then it takes them instead of sleeping) and from then on lets a
 * post wake it; td_mailbox_wake, once it is up, stops posts from writing the wake-up. A post
 * pushes, then reads the flag; the consumer sets the flag, then reads the stack; a sequentially
 * consistent fence in each makes one of them see the other (the store-buffer pattern), so no
 * post is left waiting for a consumer asleep. Under load both sides are mostly awake, and a
 * batch crosses with no system call at all (bench/NOTES.md, "The front's instructions and
 * wake-ups").
 *
 * A hop is embedded in what it carries (a request: td_request_t.hop) with a kind that says what
 * to do with it. Taking everything at once means no hop is ever popped alone, so the stack has
 * no ABA problem. Posting to a mailbox after td_mailbox_close is a bug: the owners close a
 * mailbox only once nothing can post to it any more (td_path.c says when).
 */
#ifndef TD_MAILBOX_H
#define TD_MAILBOX_H

#include <stdatomic.h>
#include <stdbool.h>
#include <uv.h>

typedef struct td_hop {
    struct td_hop *next;
    unsigned kind; /* the owner's */
} td_hop_t;

/* A producer's hops for one mailbox, not posted yet: newest first, as the stack wants them. */
typedef struct {
    td_hop_t *newest;
    td_hop_t *oldest;
} td_hop_batch_t;

/* The stack alone: posted to by any thread, taken whole by one. */
typedef struct {
    _Atomic(td_hop_t *) top; /* posted, newest first */
} td_hop_stack_t;

typedef struct {
    td_hop_stack_t stack;
    uv_async_t async;
    /* Or, for a consumer that runs no libuv loop (a transport's own thread: td_path_port_open),
     * what wakes it instead of the async (an eventfd write); NULL: the async. */
    void (*wake)(void *ctx);
    void *wake_ctx;
    _Atomic bool sleeping; /* the consumer sleeps or is about to: a post wakes it */
    bool open;
} td_mailbox_t;

/* On the consumer's loop, before it runs: cb drains the mailbox (td_mailbox_take); the async's
 * data is `data`. A libuv error code, 0 when done. */
int td_mailbox_init(td_mailbox_t *mb, uv_loop_t *loop, uv_async_cb cb, void *data);
/* For a consumer without a loop: wake(ctx), on the posting thread, wakes it (the same rule: only
 * when it sleeps or is about to). Cannot fail. */
void td_mailbox_init_wake(td_mailbox_t *mb, void (*wake)(void *ctx), void *ctx);
/* Consumer's thread: closes the wake-up (nothing may post from now on). */
void td_mailbox_close(td_mailbox_t *mb);

/* Adds hop (of `kind`) to the batch; nothing is posted yet. */
void td_hop_batch_add(td_hop_batch_t *batch, td_hop_t *hop, unsigned kind);
static inline bool td_hop_batch_empty(const td_hop_batch_t *batch)
{
    return batch->newest == NULL;
}
/* Any thread: posts the batch (emptied) and wakes the consumer; nothing when it is empty. */
void td_mailbox_post(td_mailbox_t *mb, td_hop_batch_t *batch);
/* Any thread: one hop at once (a control message). */
void td_mailbox_post_one(td_mailbox_t *mb, td_hop_t *hop, unsigned kind);
/* Consumer's thread, last before it blocks: false when hops are waiting (take them, do not
 * sleep: no post will wake it for them); true when it may sleep, and a post will wake it. */
bool td_mailbox_sleep(td_mailbox_t *mb);
/* Consumer's thread, up again: posts stop writing its wake-up (it calls td_mailbox_sleep before
 * it sleeps again). */
void td_mailbox_wake(td_mailbox_t *mb);
/* Consumer's thread: whether hops are waiting. */
static inline bool td_mailbox_waiting(td_mailbox_t *mb)
{
    return atomic_load_explicit(&mb->stack.top, memory_order_relaxed) != NULL;
}
/* Consumer's thread: everything posted so far, oldest first, linked by next (NULL: nothing). */
td_hop_t *td_mailbox_take(td_mailbox_t *mb);

#endif
