/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_path_front.c — what the front runs itself with a shard held (td_path_int.h): the only
 * request in flight, a request by device reference on no stream, and the GPU completions of those
 * that come back to the front's own sink (issue 34). td_path.c's design comment says how the
 * front and the shards share the work; here, how the front borrows a shard.
 */
#include <pthread.h>
#include <stdatomic.h>

#include "td_path_int.h"
#include "td_shm.h"

static void front_let_go(slot_t *slot);

/* A request by device reference on no stream (issue 34): nothing orders it after another, and
 * its shard's part is a few microseconds beside a hand-off and two wake-ups each way (bench/
 * NOTES.md, "The shard hand-off on the GPU path"), so the front runs it whenever it can take
 * the shard, under load too, and finishes it (td_path_finished). */
static bool named(const td_request_t *r)
{
    const char *name;
    size_t len;
    return r->has_header && tally_req_stream_of(r->header, r->header_len, &name, &len);
}

static bool device_ref_unnamed(const td_request_t *r)
{
    unsigned gpu;
    void *import;
    return r->shm_in && td_shm_region_device(r->shm_in, &gpu, &import) && !named(r);
}

/* The only request in flight and nothing waiting, or a device reference on no stream. */
static bool front_may_run(const td_path_t *p, const slot_t *slot, const td_request_t *r)
{
    const td_transport_ops_t *ops = r->transport->ops;
    if (device_ref_unnamed(r))
        return true;
    return p->dispatched - p->replied == 1 && td_hop_batch_empty(&slot->to_shard) &&
           !atomic_load_explicit(&slot->inbox.stack.top, memory_order_relaxed) &&
           ops->input_waiting && !ops->input_waiting(r->transport);
}

/* The only request in flight, with nothing else waiting to be read: run here, on the front's
 * thread, instead of a hand-off and two wake-ups (the shard's, then the front's for the reply: most
 * of a small request's time when one is in flight, bench/NOTES.md "The front"). The shard's thread
 * holds `own` whenever it runs a callback (shard_main), so with `own` taken here the shard is
 * asleep and stays so, and everything handed to it before has been taken (the front is its
 * mailbox's only producer): its state is the front's for the moment, and the request still
 * comes after every earlier one of its stream. A reply made now leaves at once (shard_reply);
 * what the request started (work on the CPU pool or a GPU lane) completes on the shard's loop
 * as before, and anything the run left the shard's loop to do sooner than it sleeps for (a timer
 * started, an idle handle) wakes it. Under load this never takes work from the shards: another
 * request is then in flight, or waits to be read (without that second condition a front that
 * keeps up would run every request itself, one after the other: callgrind showed it). False
 * when the request must be handed over. */
bool td_path_run_on_front(td_path_t *p, slot_t *slot, td_request_t *r)
{
    if (p->stopping || !slot->running || !front_may_run(p, slot, r) ||
        pthread_mutex_trylock(&slot->own) != 0)
        return false;
    /* Its GPU completion comes to the front too (the front's sink), unless it names a stream:
     * a stream's completions all take its shard's sink, the one queue that keeps them in the
     * order its lane retired them (a first request run here and the next ones on the shard,
     * completed through two queues, were applied out of order: test_seq_gpu, H200). Not with
     * --gpu-spin-loop either, whose polling handle is a shard loop's. */
    r->gpu_to_front = !p->env.cfg->gpu_spin_loop && !named(r);
    slot->front_has_it = true;
    td_shard_take(slot->shard, r);
    slot->front_has_it = false;
    front_let_go(slot);
    return true;
}

/* The front is done running the shard (it holds `own`): what the run handed the front goes (a
 * gather, a deleted name), and anything the run left the shard's loop to do sooner than it
 * sleeps for (a timer started, an idle handle) wakes it. */
static void front_let_go(slot_t *slot)
{
    td_path_flush_slot(slot); /* what the run handed the front and the ports */
    int due = uv_backend_timeout(slot->loop);
    bool wake = due >= 0 && (slot->sleep_ms < 0 || due < slot->sleep_ms);
    pthread_mutex_unlock(&slot->own);
    if (wake)
        uv_async_send(&slot->inbox.async);
}

/* A GPU completion on the front (its sink: r->gpu_to_front): finished here with the shard held,
 * as run_on_front runs a request, when the shard's thread sleeps; else its thread finishes it,
 * behind what the front handed it before. */
static void finish_on_front(slot_t *slot, td_request_t *r)
{
    if (!slot->running) { /* its thread has ended: this thread owns the shard */
        td_shard_finished(slot->shard, r);
        return;
    }
    if (pthread_mutex_trylock(&slot->own) != 0) {
        td_hop_batch_add(&slot->to_shard, &r->hop, HOP_FINISH);
        return;
    }
    slot->front_has_it = true;
    td_shard_finished(slot->shard, r);
    slot->front_has_it = false;
    front_let_go(slot);
}

void td_path_finished(td_path_t *self, td_request_t *r)
{
    slot_t *slot = &self->slots[r->shard];
    if (!self->threads || !pthread_equal(pthread_self(), self->front_thread) ||
        slot->front_has_it) /* its shard's thread, or the front already running the shard */
        td_shard_finished(slot->shard, r);
    else
        finish_on_front(slot, r);
}
