/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_part.c — one partition's life on this worker (PROTOCOL.md §13 "Exactly once across
 * crashes"): taking it (lease, fence, load the checkpoint into the stream table, the consumer at
 * checkpoint + 1), applying its messages through the request path (a message at or below the
 * last one taken is skipped; a failing one becomes a dead letter), checkpointing it, and giving
 * it up or losing it.
 *
 * The window (issue 32). Up to [nats] inflight messages of a partition (and inflight_bytes of
 * payload) are in the request path at once: it keeps each stream's order (its shard runs a
 * stream's requests in the order they were submitted), so messages of different streams of a
 * partition are applied side by side, on the shards their streams hash to, and those of one
 * stream in sequence order. Messages enter the window in sequence order and leave it from its
 * head once done: the watermark (applied_seq) is the highest sequence below which everything is
 * applied or judged. A checkpoint is taken at the watermark with nothing in the path: when one is
 * due the partition takes nothing new until its window is empty (draining: about one round trip
 * of the path), so its snapshot holds exactly the messages up to the watermark. A message
 * answered `busy` (no effect) is sent again, and nothing new enters the window meanwhile; if a
 * later message of its stream was applied meanwhile, the stream's order is broken and the
 * partition is dropped and taken again from its checkpoint (order_broken: rare, since the
 * transport holds the fleet's requests while tallyd is at max_inflight instead of refusing
 * them). A partition given up with messages applied above a refused one is not checkpointed
 * (its next owner applies from the last checkpoint), so a checkpoint never needs to name the
 * messages above its watermark that it holds.
 *
 * Where a partition's backlog waits shows in /metrics (issue 32; td_fleet_status.h): its
 * window's entries, those of them sent and not answered back yet (WIN_SENT: in_path, and their
 * bytes), and what its reader fetched that the window has not taken (fetched: the reader counts
 * what it queues, the step what it took, the message held for room in p->next not among them);
 * each a relaxed store where the number changes, read by the loop thread.
 *
 * Acknowledgements: the consumer is AckAll, so one acknowledgement of the watermark's message
 * after each checkpoint covers every message up to it (td_nats_consumer.h).
 *
 * Nothing is written to NATS for a partition once its lease has run out by this worker's own
 * clock (td_part_may_write, checked right before each write): not a reply, not a dead letter,
 * not a checkpoint, not a watch publication. A worker paused with messages in the path finds
 * their replies waiting when it wakes, and drops the partition instead of answering them
 * (test_nats_inflight). The checkpoint's compare-and-set is the fence for what was started just
 * before.
 *
 * Who published a message is the user its subject names (tally.in.<k>.<user>), which the
 * server's permissions let only that user publish to; never a header the producer writes. A
 * message whose Tally-Reply is not one of that user's inboxes, or whose dedupe id is not in its
 * namespace, is refused (not_permitted: a dead letter, no reply anywhere, counted and logged):
 * the worker's own rights never carry a reply onto a subject its publisher may not use
 * (PROTOCOL.md §13 "Security").
 *
 * A take-over that fails (the lease, then the checkpoint, the consumer) releases the lease key
 * at once, by compare-and-set on its revision, and so does dropping a partition whose lease is
 * still valid (its consumer could not be made again): a key left behind holds the partition
 * from every worker until it expires.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "td_fleet_changelog.h"
#include "td_fleet_int.h"
#include "td_fleet_route.h"
#include "td_log.h"
#include "td_monotonic.h"
#include "td_nats_consumer.h"
#include "td_nats_js.h"
#include "td_state.h"
#include "td_stream.h"
#include "td_window.h"

/* The local copy of a partition no longer this worker's goes, within the turn's deadline for
 * drops (f->drop_until_ms: a third of the TTL for every partition dropped in one turn); when it
 * cannot, the next take (restore) deletes it first or is not made. */
static void drop_local_copy(td_fleet_t *f, td_part_t *p)
{
    char msg[256];
    if (!f->drop_until_ms)
        f->drop_until_ms = td_nats_now_ms() + f->ttl_ms / 3;
    if (td_fleet_table_delete(f, p->k, f->drop_until_ms, msg, sizeof msg) != TD_OK)
        td_warn("fleet: partition %u: %s; they go before it is taken again", (unsigned)p->k, msg);
}

/* ---- Taking, losing, giving up ------------------------------------------------------------- */

static void resend(td_fleet_t *f, td_part_t *p);

static void release_lease(td_fleet_t *f, td_part_t *p)
{
    char msg[256];
    if (p->lease.revision && td_lease_release(f->kv_js, p->k, &p->lease, msg, sizeof msg) != TD_OK)
        td_warn("fleet: %s", msg);
    memset(&p->lease, 0, sizeof p->lease);
}

/* A message shared by its window entry and the request path (issue 32: no copy of the payload):
 * the last of them to let go destroys it, on whichever thread that is. */
typedef struct td_msg_ref {
    atomic_int refs;
    natsMsg *msg;
} td_msg_ref_t;

static void msg_ref_release(void *data, void *hint)
{
    (void)data;
    td_msg_ref_t *r = hint;
    if (atomic_fetch_sub_explicit(&r->refs, 1, memory_order_acq_rel) == 1) {
        natsMsg_Destroy(r->msg);
        free(r);
    }
}

/* A window entry's message goes (the path may still hold it). */
static void entry_release(td_win_entry_t *e)
{
    if (e->ref)
        msg_ref_release(NULL, e->ref);
    else
        natsMsg_Destroy(e->msg);
    memset(e, 0, sizeof *e);
}

/* The payload of e's message for the request path, sharing it (td_bytes_t: its free function lets
 * go); false without memory for the sharing. */
static bool entry_payload(td_win_entry_t *e, td_bytes_t *payload)
{
    if (!e->ref) {
        if (!(e->ref = malloc(sizeof *e->ref)))
            return false;
        atomic_init(&e->ref->refs, 1); /* the entry's */
        e->ref->msg = e->msg;
    }
    atomic_fetch_add_explicit(&e->ref->refs, 1, memory_order_relaxed);
    size_t len = (size_t)natsMsg_GetDataLength(e->msg) - TALLY_REQ_HEADER_SIZE;
    *payload = (td_bytes_t){.data = len ? (void *)(natsMsg_GetData(e->msg) + TALLY_REQ_HEADER_SIZE)
                                        : NULL,
                            .len = len,
                            .free_fn = msg_ref_release,
                            .hint = e->ref};
    return true;
}

/* Empties the window: what is in the request path is forgotten (its reply, when it comes,
 * finds no slot; the path lets its messages go when it is done with them). */
static void forget_window(td_fleet_t *f, td_part_t *p)
{
    for (size_t i = 0; i < p->win_len; i++) {
        td_win_entry_t *e = &p->win[(p->win_first + i) % f->inflight];
        if (e->state == WIN_SENT)
            memset(&f->pend[e->slot], 0, sizeof f->pend[e->slot]);
        entry_release(e);
    }
    p->win_first += p->win_len;
    p->win_len = p->win_bytes = p->retries = 0;
    p->in_path = p->in_path_bytes = 0;
    TD_FLEET_SET(f, window[p->k], 0);
    TD_FLEET_SET(f, in_path[p->k], 0);
    TD_FLEET_SET(f, in_path_bytes[p->k], 0);
    natsMsg_Destroy(p->next.msg);
    p->next = (td_fetched_t){0};
    p->draining = false;
}

static void forget_work(td_fleet_t *f, td_part_t *p)
{
    forget_window(f, p);
    td_reader_stop(&p->reader);
    p->ack[0] = 0; /* not ours to acknowledge any more */
    p->unacked = 0;
    p->owned = p->taking = false;
    TD_FLEET_SET(f, owned[p->k], false);
    td_changelog_closed(f, p->k);   /* replicated: what waits for a PubAck is not_durable */
    td_fleet_route_closed(f, p->k); /* direct mode: no more requests here */
    td_fleet_route_forget(f, p->k); /* its direct writes: checkpointed, or lost with it */
}

void td_part_free(td_fleet_t *f, td_part_t *p)
{
    td_reader_stop(&p->reader);
    natsMsg_Destroy(p->next.msg);
    for (size_t i = 0; p->win && i < p->win_len; i++)
        entry_release(&p->win[(p->win_first + i) % f->inflight]);
    free(p->win);
    jsCtx_Destroy(p->rjs);
    natsConnection_Destroy(p->rnc);
    memset(p, 0, sizeof *p);
}

bool td_part_may_write(const td_part_t *p)
{
    return p->owned && td_lease_valid(&p->lease, td_nats_now_ms());
}

/* The reader's own connection, made at the partition's first take and kept: a fetch waits on
 * the server, and readers on one connection would queue behind each other. */
static td_err_t reader_connection(td_fleet_t *f, td_part_t *p, char *msg, size_t cap)
{
    if (p->rjs)
        return TD_OK;
    char role[32];
    snprintf(role, sizeof role, "reader-%u", (unsigned)p->k);
    if (!p->rnc && td_fleet_connect(f, role, true, &p->rnc, msg, cap) != TD_OK)
        return TD_ERR_LIBRARY;
    if (natsConnection_JetStream(&p->rjs, p->rnc, NULL) != NATS_OK) {
        snprintf(msg, cap, "JetStream on the reader's connection: %s",
                 td_nats_last_error(NATS_ERR));
        return TD_ERR_LIBRARY;
    }
    return TD_OK;
}

/* The partition's reader, which makes its consumer from start_seq (the checkpoint's sequence +
 * 1) on its own thread (td_fleet_reader.c); a consumer it cannot make is seen at the next step
 * (take_step, or td_part_step after a gap). */
static td_err_t start_consumer(td_fleet_t *f, td_part_t *p, uint64_t start_seq, char *msg,
                               size_t cap)
{
    td_err_t err = reader_connection(f, p, msg, cap);
    if (err != TD_OK)
        return err;
    td_reader_make_t make = {.js = p->rjs,
                             .nc = p->rnc,
                             .epoch = p->lease.revision,
                             .start_seq = start_seq,
                             .restart = p->restarts++,
                             .ack_wait_ms = f->ckpt_ms * 4 > 30000 ? f->ckpt_ms * 4 : 30000,
                             .valid_until_ms = p->lease.valid_until_ms};
    snprintf(make.inbox, sizeof make.inbox, "%s%s.p%u.%" PRIu64 ".%u", f->inbox_prefix, f->member,
             (unsigned)p->k, p->lease.revision, make.restart);
    if ((err = td_reader_start(f, &p->reader, p->k, &make)) != TD_OK)
        snprintf(msg, cap, "cannot start its reader thread");
    return err;
}

/* A message past high_seq + 1: were the ones between removed from the stream (a purge: go
 * on), or not delivered (a consumer that moved on: read again from high_seq + 1)? True when
 * the message is to be applied. */
static bool accept_gap(td_fleet_t *f, td_part_t *p, uint64_t seq)
{
    uint64_t first = td_partition_first_seq(f->js, p->k);
    if (first > p->high_seq + 1) {
        TD_FLEET_COUNT(f, gaps);
        td_warn("fleet: partition %u: sequences %" PRIu64 "..%" PRIu64
                " were removed from its stream before they were applied",
                (unsigned)p->k, p->high_seq + 1, first - 1);
        return true;
    }
    char msg[256];
    td_warn("fleet: partition %u: sequence %" PRIu64 " came after %" PRIu64
            "; reading again from %" PRIu64,
            (unsigned)p->k, seq, p->high_seq, p->high_seq + 1);
    td_reader_stop(&p->reader);
    if (start_consumer(f, p, p->high_seq + 1, msg, sizeof msg) != TD_OK) {
        td_warn("fleet: partition %u: %s", (unsigned)p->k, msg);
        td_part_drop(f, p, "its consumer could not be made again");
    }
    return false;
}

/* After a checkpoint: one acknowledgement of the watermark's message covers every message up
 * to it (an AckAll consumer), so the consumer does not deliver them again after its ack wait.
 * Buffered, not confirmed: a lost one only means they come again, and are skipped. */
static void ack_checkpointed(td_fleet_t *f, td_part_t *p)
{
    if (p->ack[0] && natsConnection_Publish(f->reply_nc, p->ack, "+ACK", 4) != NATS_OK)
        td_warn("fleet: partition %u: acknowledging: %s", (unsigned)p->k,
                td_nats_last_error(NATS_ERR));
    p->ack[0] = 0;
    p->unacked = 0;
}

/* A take that failed: its work is forgotten and its lease given back at once (a key left
 * behind would hold the partition from every worker until it expired); tried again after the
 * back-off. */
static void take_failed(td_fleet_t *f, td_part_t *p, const char *why)
{
    td_warn("fleet: partition %u not taken: %s", (unsigned)p->k, why);
    forget_work(f, p);
    release_lease(f, p);
    p->no_take_until_ms = td_nats_now_ms() + TD_FLEET_TAKE_BACKOFF_MS;
}

/* How long after the awaited lease ran out (the server's time of its last write plus the TTL,
 * read at the heartbeat before) this take began: "N ms after its lease ran out", or "". */
static void since_expiry(const td_part_t *p, int64_t began, char *out, size_t cap)
{
    out[0] = 0;
    if (p->lease_expiry_ms)
        snprintf(out, cap, ", %" PRId64 " ms after the previous lease ran out",
                 began - p->lease_expiry_ms);
}

void td_part_take(td_fleet_t *f, td_part_t *p)
{
    char msg[512];
    bool taken = false, fenced = false;
    if (!p->win && !(p->win = calloc(f->inflight, sizeof *p->win)))
        return; /* tried again at the next heartbeat */
    int64_t began = td_nats_now_ms();
    if (td_lease_acquire(f->leases, p->k, f->member, f->ttl_ms, &p->lease, &taken, msg,
                         sizeof msg) != TD_OK)
        td_warn("fleet: %s", msg);
    if (!taken)
        return;
    int64_t leased = td_nats_now_ms();
    if (f->test_take_ms > 0)
        usleep((useconds_t)(f->test_take_ms * 1000));
    uint8_t *state = NULL;
    size_t len = 0;
    td_err_t err = td_ckpt_take(&p->ckpt, f->js, f->ckpts, p->k, f->member, p->lease.revision,
                                &state, &len, &fenced, msg, sizeof msg);
    p->ckpt.cl_seq = p->ckpt.cur.cl_seq;
    p->take_loaded_ms = td_nats_now_ms();
    if (err == TD_OK && !fenced) /* a standby's copy or the checkpoint, the changelog after it */
        err = td_standby_load(f, p, state, len, msg, sizeof msg);
    free(state);
    p->applied_seq = p->high_seq = p->ckpt_seq = p->ckpt.cur.applied_seq;
    TD_FLEET_SET(f, last_seq[p->k], p->applied_seq); /* its reader raises it (the lag's top) */
    p->restarts = 0;
    if (err == TD_OK && !fenced)
        err = start_consumer(f, p, p->applied_seq + 1, msg, sizeof msg);
    if (err != TD_OK || fenced || !td_lease_valid(&p->lease, td_nats_now_ms())) {
        take_failed(f, p,
                    err != TD_OK ? msg
                    : fenced     ? "another worker wrote its checkpoint"
                                 : "the lease ran out while taking it");
        return;
    }
    p->owned = p->taking = true; /* stepped from now on; taken once its consumer is made */
    td_fleet_route_owned(f, p->k, p->lease.valid_until_ms); /* direct mode: requests run here */
    td_fleet_watch_taken(f, p->k); /* what it loaded is published at the next tick */
    p->take_began_ms = began;
    p->take_leased_ms = leased;
}

/* A take whose reader has made its consumer: counted, and said, with its steps' times. */
static void take_finished(td_fleet_t *f, td_part_t *p)
{
    p->taking = false;
    p->last_ckpt_ms = td_nats_now_ms();
    TD_FLEET_SET(f, applied_seq[p->k], p->applied_seq);
    TD_FLEET_SET(f, owned[p->k], true);
    TD_FLEET_COUNT(f, partitions_taken);
    int64_t began = p->take_began_ms;
    char after[96];
    since_expiry(p, began, after, sizeof after);
    td_notice("fleet: %s took partition %u at sequence %" PRIu64 " (%s) in %" PRId64
              " ms: lease %" PRId64 ", checkpoint %" PRId64 ", consumer %" PRId64 "%s",
              f->member, (unsigned)p->k, p->applied_seq + 1, p->take_loaded,
              p->reader.made_ms - began, p->take_leased_ms - began,
              p->take_loaded_ms - p->take_leased_ms, p->reader.made_ms - p->take_loaded_ms, after);
    p->lease_expiry_ms = 0;
}

/* A take under way (p->taking; its lease valid): finished once its reader made the consumer,
 * given up when it could not (a checkpoint first when direct writes came meanwhile, then the
 * lease released), and tried again after the back-off. True when the partition may go on with
 * its step. */
static bool take_step(td_fleet_t *f, td_part_t *p, bool *acted)
{
    char why[256];
    *acted = true;
    if (td_reader_failed(&p->reader, why, sizeof why)) {
        td_warn("fleet: partition %u not taken: %s", (unsigned)p->k, why);
        td_part_give_up(f, p);
        p->no_take_until_ms = td_nats_now_ms() + TD_FLEET_TAKE_BACKOFF_MS;
    } else if (td_reader_made(&p->reader))
        take_finished(f, p);
    else
        *acted = false;
    return p->owned && !p->taking;
}

void td_part_drop(td_fleet_t *f, td_part_t *p, const char *why)
{
    td_warn("fleet: partition %u lost: %s; its local state is dropped", (unsigned)p->k, why);
    TD_FLEET_COUNT(f, leases_lost);
    forget_work(f, p);
    /* The copy goes first: once the lease is released, a member of this same process
     * (members_per_process) may take the partition into the table the copy is in. */
    drop_local_copy(f, p);
    if (td_lease_valid(&p->lease, td_nats_now_ms())) {
        /* still ours (its consumer could not be made again, a take-over of its own): the key
         * would otherwise hold the partition from everyone, this worker too, until it expires
         * (issue 30). A compare-and-set on its revision: a key that moved on is left alone. */
        release_lease(f, p);
        p->no_take_until_ms = td_nats_now_ms() + TD_FLEET_TAKE_BACKOFF_MS;
    }
    memset(&p->lease, 0, sizeof p->lease);
}

/* True when a message of the partition's window is in the request path. */
static bool awaits_reply(const td_fleet_t *f, const td_part_t *p)
{
    for (size_t i = 0; i < p->win_len; i++)
        if (p->win[(p->win_first + i) % f->inflight].state == WIN_SENT)
            return true;
    return false;
}

void td_part_reply_lost(td_fleet_t *f)
{
    for (uint32_t k = 0; k < f->partitions; k++)
        if (f->parts[k].owned && awaits_reply(f, &f->parts[k]))
            td_part_drop(f, &f->parts[k], "a reply of the request path's was lost (no memory)");
}

void td_part_quiesce(td_fleet_t *f, td_part_t *p)
{
    int64_t deadline = td_nats_now_ms() + f->ttl_ms / 3; /* leases renewed in time */
    while (p->owned && td_nats_now_ms() < deadline) {
        bool sent = awaits_reply(f, p);
        if (!sent && (p->retries == 0 || atomic_load(&f->stopping)))
            break; /* `shutdown` or `busy`: not applied, so not in the checkpoint either */
        if (p->retries && !sent)
            resend(f, p);
        td_fleet_path_poll(f, 10);
    }
}

/* Messages applied after one that was refused and waits in the window: a checkpoint now would
 * hold their effect at a watermark below them (applied twice by the next owner). */
static bool applied_above_refused(const td_fleet_t *f, const td_part_t *p)
{
    for (size_t i = 0; i < p->win_len; i++)
        if (p->win[(p->win_first + i) % f->inflight].state == WIN_DONE)
            return true; /* the head is never WIN_DONE: it would have been retired */
    return false;
}

void td_part_give_up(td_fleet_t *f, td_part_t *p)
{
    td_fleet_route_closed(f, p->k); /* direct mode: what was answered goes into the checkpoint */
    td_part_quiesce(f, p);
    if (p->owned && applied_above_refused(f, p))
        td_warn("fleet: partition %u given up without a checkpoint: messages after a refused one "
                "were applied; the next owner applies from sequence %" PRIu64
                " (and without this member's direct writes since its last checkpoint)",
                (unsigned)p->k, p->ckpt_seq + 1);
    else if ((p->applied_seq > p->ckpt_seq || td_fleet_route_uncommitted(f, p->k)) &&
             !td_part_checkpoint(f, p))
        return; /* dropped (fenced or expired), or the write failed: the next owner redoes it */
    if (!p->owned)
        return;                    /* lost while it waited for its messages */
    td_fleet_watch_flush(f, p->k); /* its streams' last changes, before they are not ours */
    forget_work(f, p);
    if (!atomic_load(&f->stopping)) /* tallyd goes on: its copy is no longer the truth */
        drop_local_copy(f, p);
    release_lease(f, p);
    td_notice("fleet: %s gave partition %u up at sequence %" PRIu64, f->member, (unsigned)p->k,
              p->applied_seq);
}

/* td_part_checkpoint, untimed. */
static bool write_checkpoint(td_fleet_t *f, td_part_t *p)
{
    char msg[512];
    if (!td_part_may_write(p)) {
        td_part_drop(f, p, "its lease ran out before a checkpoint");
        return false;
    }
    uint64_t direct = td_fleet_route_uncommitted(f, p->k); /* all in the snapshot, maybe more */
    uint64_t cl_seq = td_changelog_stored(f, p->k);        /* the same: every record up to it */
    /* At least the take's fence (td_changelog_take's *held); 0 without a changelog, which keeps
     * the manifest's. */
    if (cl_seq > p->ckpt.cl_seq)
        p->ckpt.cl_seq = cl_seq;
    bool claim = td_standby_claim(p); /* cl_since, with standbys */
    uint8_t *state = NULL;
    size_t len = 0;
    bool fenced = false;
    td_err_t err = td_fleet_table_snapshot(f, p->k, &state, &len);
    if (err == TD_OK && td_part_may_write(p))
        err = td_ckpt_write(&p->ckpt, p->applied_seq, state, len, &fenced, msg, sizeof msg);
    else if (err == TD_OK)
        fenced = true; /* ran out meanwhile: write nothing */
    free(state);
    p->last_ckpt_ms = td_nats_now_ms();
    if (fenced) {
        td_part_drop(f, p, "another worker holds its checkpoint");
        return false;
    }
    if (err != TD_OK) {
        td_warn("fleet: checkpoint of partition %u: %s", (unsigned)p->k, msg);
        TD_FLEET_COUNT(f, checkpoint_failures);
        return false;
    }
    if (msg[0]) /* committed, the predecessor's chunks left behind */
        td_warn("fleet: checkpoint of partition %u: %s", (unsigned)p->k, msg);
    p->ckpt_seq = p->applied_seq;
    if (!claim)
        td_standby_base(f, p);
    td_fleet_route_committed(f, p->k, direct);
    TD_FLEET_COUNT(f, checkpoints);
    ack_checkpointed(f, p);
    /* replicated: a checkpoint holding the whole changelog empties it (at a quiet point) */
    td_changelog_compact(f, p->k, p->ckpt.cur.cl_seq, p->lease.valid_until_ms);
    return true;
}

bool td_part_checkpoint(td_fleet_t *f, td_part_t *p)
{
    uint64_t began = td_mono_ns();
    bool ok = write_checkpoint(f, p);
    atomic_fetch_add_explicit(&f->st->checkpoint_ns, td_mono_ns() - began, memory_order_relaxed);
    return ok;
}

/* ---- Applying ------------------------------------------------------------------------------ */

/* ---- The window ---------------------------------------------------------------------------- */

static td_win_entry_t *entry_at(const td_fleet_t *f, const td_part_t *p, uint64_t pos)
{
    return &p->win[pos % f->inflight];
}

/* The window's entries in the request path (WIN_SENT) and their bytes, for the metrics: e sent
 * (true) or its reply taken (false); a relaxed store each, read by /metrics on the loop. */
static void count_in_path(td_fleet_t *f, td_part_t *p, const td_win_entry_t *e, bool sent)
{
    size_t len = (size_t)natsMsg_GetDataLength(e->msg);
    p->in_path = sent ? p->in_path + 1 : p->in_path - 1;
    p->in_path_bytes = sent ? p->in_path_bytes + len : p->in_path_bytes - len;
    TD_FLEET_SET(f, in_path[p->k], p->in_path);
    TD_FLEET_SET(f, in_path_bytes[p->k], p->in_path_bytes);
}

/* Room for one more message, sequence seq of len bytes (one message always fits alone). */
static bool window_has_room(const td_fleet_t *f, const td_part_t *p, uint64_t seq, size_t len)
{
    if (p->win_len > 0 && seq <= p->one_at_a_time_to)
        return false;
    return p->win_len < f->inflight && (p->win_len == 0 || p->win_bytes + len <= f->inflight_bytes);
}

/* The window broke a stream's order: the partition is dropped, and taken again (here or by
 * another member) from its checkpoint; here, what the window held then goes one at a time. */
static void drop_order_broken(td_fleet_t *f, td_part_t *p, const char *why)
{
    p->one_at_a_time_to = p->high_seq;
    td_part_drop(f, p, why);
}

/* Retires the done messages at the window's head: the watermark moves past them, and the last
 * one's ack subject is what the next checkpoint acknowledges. */
static void retire(td_fleet_t *f, td_part_t *p)
{
    while (p->win_len) {
        td_win_entry_t *e = entry_at(f, p, p->win_first);
        if (e->state != WIN_DONE)
            break;
        const char *ack = natsMsg_GetReply(e->msg);
        size_t ack_len = ack ? strlen(ack) : sizeof p->ack;
        if (ack_len < sizeof p->ack)
            memcpy(p->ack, ack, ack_len + 1);
        p->applied_seq = e->seq;
        if (p->applied_seq >= p->one_at_a_time_to)
            p->one_at_a_time_to = 0;
        p->win_bytes -= (size_t)natsMsg_GetDataLength(e->msg);
        entry_release(e);
        p->win_first++;
        p->win_len--;
        p->unacked++;
        if (p->take_began_ms) { /* a take-over's last step (issue 32's failover) */
            td_notice("fleet: partition %u: first message applied %" PRId64
                      " ms after its take began (its consumer made at %" PRId64 " ms)",
                      (unsigned)p->k, td_nats_now_ms() - p->take_began_ms,
                      p->reader.made_ms - p->take_began_ms);
            p->take_began_ms = 0;
        }
    }
    TD_FLEET_SET(f, applied_seq[p->k], p->applied_seq);
    TD_FLEET_SET(f, window[p->k], p->win_len);
}

static void mark_done(td_fleet_t *f, td_part_t *p, td_win_entry_t *e)
{
    e->state = WIN_DONE;
    TD_FLEET_COUNT(f, applied);
    retire(f, p);
}

/* Refused for now (`busy`, no free slot, NATS would not take its dead letter): sent again
 * after ms; nothing new is taken into the window meanwhile. */
static void mark_retry(td_part_t *p, td_win_entry_t *e, int64_t ms)
{
    e->state = WIN_RETRY;
    e->slot = -1;
    p->retries++;
    p->retry_at = td_nats_now_ms() + ms;
}

/* The stream m's header names (tally_req_stream_of reads a header alone: given the whole
 * message, with its payload, it found none, and order_broken never saw a stream's order broken). */
static bool stream_of(natsMsg *m, const char **name, size_t *len)
{
    return natsMsg_GetDataLength(m) >= TALLY_REQ_HEADER_SIZE &&
           tally_req_stream_of((const uint8_t *)natsMsg_GetData(m), TALLY_REQ_HEADER_SIZE, name,
                               len);
}

static bool same_stream(natsMsg *a, natsMsg *b)
{
    const char *na, *nb;
    size_t la, lb;
    return stream_of(a, &na, &la) && stream_of(b, &nb, &lb) && la == lb && memcmp(na, nb, la) == 0;
}

/* The request path keeps a stream's order, but a message refused (`busy`) and sent again goes
 * behind those of its stream that were in the path with it: true when the message at pos was
 * applied after a refused one of its stream before it (applied: true), or was refused after one
 * of its stream after it was applied (applied: false). The partition is then taken again from
 * its checkpoint. The fleet's requests are refused only by max_reply_bytes or for memory (the
 * transport holds them while tallyd is at max_inflight), so this is rare. */
static bool order_broken(const td_fleet_t *f, const td_part_t *p, uint64_t pos, bool applied)
{
    natsMsg *m = entry_at(f, p, pos)->msg;
    uint64_t from = applied ? p->win_first : pos + 1,
             to = applied ? pos : p->win_first + p->win_len;
    for (uint64_t i = from; i < to; i++) {
        const td_win_entry_t *o = entry_at(f, p, i);
        if (o->state == (applied ? WIN_RETRY : WIN_DONE) && same_stream(o->msg, m))
            return true;
    }
    return false;
}

/* Publishes e's message to the dead letters with why; false when NATS would not take it (try
 * again). */
static bool dead_letter(td_fleet_t *f, td_part_t *p, const td_win_entry_t *e, tally_status_t st,
                        const char *why)
{
    natsMsg *m = e->msg;
    uint64_t seq = e->seq;
    if (!td_part_may_write(p))
        return false; /* its lease ran out: the next step drops the partition */
    char subject[32], num[24], seqs[24];
    tally_fleet_name(subject, sizeof subject, TALLY_NATS_SUBJ_DEAD, p->k);
    snprintf(num, sizeof num, "%u", (unsigned)p->k);
    snprintf(seqs, sizeof seqs, "%" PRIu64, seq);
    const char *id = e->h.id;
    natsMsg *d = NULL;
    natsStatus s = natsMsg_Create(&d, subject, NULL, natsMsg_GetData(m), natsMsg_GetDataLength(m));
    if (s == NATS_OK)
        s = natsMsgHeader_Set(d, TALLY_NATS_HDR_STATUS, tally_status_name(st));
    if (s == NATS_OK)
        s = natsMsgHeader_Set(d, TALLY_NATS_HDR_REASON, why);
    if (s == NATS_OK)
        s = natsMsgHeader_Set(d, TALLY_NATS_HDR_PARTITION, num);
    if (s == NATS_OK)
        s = natsMsgHeader_Set(d, TALLY_NATS_HDR_SEQ, seqs);
    if (s == NATS_OK && id)
        s = natsMsgHeader_Set(d, TALLY_NATS_HDR_REPLY_ID, id);
    jsErrCode jerr = 0;
    if (s == NATS_OK)
        s = js_PublishMsg(NULL, f->js, d, NULL, &jerr);
    natsMsg_Destroy(d);
    if (s != NATS_OK) {
        td_warn("fleet: dead letter of partition %u sequence %" PRIu64 ": %s", (unsigned)p->k, seq,
                td_nats_last_error(s));
        return false;
    }
    td_info("fleet: partition %u sequence %" PRIu64 " is a dead letter: %s: %s", (unsigned)p->k,
            seq, tally_status_name(st), why);
    TD_FLEET_COUNT(f, dead_letters);
    return true;
}

/* The Tally-Reply when the publisher may be answered there (one of the inboxes of the user its
 * message's subject names), else NULL. */
static const char *reply_allowed(const td_msg_headers_t *h)
{
    return tally_fleet_reply_allowed(h->to, h->user) ? h->to : NULL;
}

/* What a message's publisher may not ask for (PROTOCOL.md §13 "Security"): TALLY_E_NOT_PERMITTED
 * with why (counted), or TALLY_OK. */
static tally_status_t check_publisher(td_fleet_t *f, const td_msg_headers_t *h, char *why,
                                      size_t cap)
{
    const char *user = h->user, *to = h->to, *id = h->id;
    if (to && !tally_fleet_reply_allowed(to, user)) {
        TD_FLEET_COUNT(f, refused_reply);
        snprintf(why, cap, "Tally-Reply %.80s is not an inbox of user %s (%s%s.>)", to,
                 user ? user : "(none)", TALLY_NATS_INBOX, user ? user : "<user>");
        return TALLY_E_NOT_PERMITTED;
    }
    if (id && !tally_fleet_id_allowed(id, user)) {
        TD_FLEET_COUNT(f, refused_id);
        snprintf(why, cap, "Nats-Msg-Id %.80s is outside the ids of user %s (%s.*)", id,
                 user ? user : "(none)", user ? user : "<user>");
        return TALLY_E_NOT_PERMITTED;
    }
    return TALLY_OK;
}

/* The checks PROTOCOL.md §13 adds after §6's (which the request path repeats, but for the
 * header's decoding: req, handed to it): the status and why, or TALLY_OK. */
static tally_status_t check_message(td_fleet_t *f, td_part_t *p, natsMsg *m,
                                    const td_msg_headers_t *h, tally_req_t *req, char *why,
                                    size_t cap)
{
    const uint8_t *data = (const uint8_t *)natsMsg_GetData(m);
    size_t len = (size_t)natsMsg_GetDataLength(m);
    tally_status_t refused = check_publisher(f, h, why, cap);
    if (refused != TALLY_OK)
        return refused;
    if (len < TALLY_REQ_HEADER_SIZE) {
        snprintf(why, cap, "message of %zu bytes: shorter than a request header", len);
        return TALLY_E_HEADER;
    }
    tally_status_t st = tally_req_decode(data, TALLY_REQ_HEADER_SIZE, req, why, cap);
    if (st == TALLY_OK)
        st = tally_req_validate(req, len - TALLY_REQ_HEADER_SIZE, f->host.cfg->max_batch, why, cap);
    if (st != TALLY_OK)
        return st;
    uint8_t op = req->opcode;
    if (op != TALLY_OP_FILTER && op != TALLY_OP_SCAN && op != TALLY_OP_HIST &&
        op != TALLY_OP_RESET && op != TALLY_OP_DELETE) {
        snprintf(why, cap, "%s is not taken from a partition (request-reply only)",
                 tally_op_name((tally_op_t)op));
        return TALLY_E_OPCODE;
    }
    if (req->flags & TALLY_FLAG_SHM_REF) {
        snprintf(why, cap, "shared-memory references do not travel over NATS");
        return TALLY_E_BAD_REF;
    }
    if (req->stream_len && tally_partition(req->stream, req->stream_len, f->partitions) != p->k) {
        snprintf(why, cap, "stream %.*s belongs to partition %u, not %u", (int)req->stream_len,
                 req->stream,
                 (unsigned)tally_partition(req->stream, req->stream_len, f->partitions),
                 (unsigned)p->k);
        return TALLY_E_STREAM_NAME;
    }
    size_t payload = len - TALLY_REQ_HEADER_SIZE;
    size_t reply = op == TALLY_OP_FILTER ? payload
                   : op == TALLY_OP_SCAN ? (req->flags & TALLY_FLAG_SCAN_OUT_I32 ? 1 : 2) * payload
                                         : 0;
    if (h->to &&
        reply + TALLY_REP_HEADER_SIZE > f->max_payload - TALLY_NATS_HEADROOM) {
        snprintf(why, cap, "its reply (up to %zu bytes) would not fit NATS's max_payload %zu",
                 reply, f->max_payload);
        return TALLY_E_TOO_LARGE;
    }
    return TALLY_OK;
}

/* A message that fails its checks: the dead letters, its error reply, then it counts as
 * applied. */
static void fail_message(td_fleet_t *f, td_part_t *p, td_win_entry_t *e, tally_status_t st,
                         const char *why)
{
    natsMsg *m = e->msg;
    if (!dead_letter(f, p, e, st, why)) {
        mark_retry(p, e, TD_FLEET_RETRY_MS * 10);
        return;
    }
    if (st == TALLY_E_NOT_PERMITTED)
        td_warn("fleet: partition %u sequence %" PRIu64 " from %s refused: %s", (unsigned)p->k,
                e->seq, natsMsg_GetSubject(m), why);
    const char *to = e->to;
    if (to) {
        uint8_t frame[TALLY_REP_HEADER_SIZE + TALLY_ERROR_MESSAGE_MAX];
        size_t len = td_fleet_error_reply((const uint8_t *)natsMsg_GetData(m),
                                          (size_t)natsMsg_GetDataLength(m), st, why, frame);
        td_fleet_publish_reply(f, to, m, p->k, e->seq, frame, len);
    }
    mark_done(f, p, e);
}

/* Checks the message at pos and sends it to the request path, or judges it at once. */
static void judge(td_fleet_t *f, td_part_t *p, uint64_t pos)
{
    td_win_entry_t *e = entry_at(f, p, pos);
    char why[TALLY_ERROR_MESSAGE_MAX + 1] = "";
    e->to = reply_allowed(&e->h);
    tally_req_t req;
    tally_status_t st = check_message(f, p, e->msg, &e->h, &req, why, sizeof why);
    if (st != TALLY_OK) {
        fail_message(f, p, e, st, why);
        return;
    }
    td_bytes_t payload;
    int slot =
        entry_payload(e, &payload)
            ? td_fleet_path_send_shared(f, PEND_PART, (const uint8_t *)natsMsg_GetData(e->msg),
                                        &req, !e->to, &payload)
            : -1;
    if (slot < 0) {
        mark_retry(p, e, TD_FLEET_RETRY_MS);
        return;
    }
    f->pend[slot].k = p->k;
    f->pend[slot].pos = pos;
    e->slot = slot;
    e->state = WIN_SENT;
    count_in_path(f, p, e, true);
}

/* Sends the refused messages of the window again, in sequence order. */
static void resend(td_fleet_t *f, td_part_t *p)
{
    uint64_t end = p->win_first + p->win_len;
    for (uint64_t pos = p->win_first; pos < end && p->owned; pos++) {
        if (pos < p->win_first || entry_at(f, p, pos)->state != WIN_RETRY)
            continue;
        p->retries--;
        judge(f, p, pos);
    }
}

/* Takes a message from the reader into the window: skipped (applied before), judged at once,
 * or sent to the request path. */
static void process(td_fleet_t *f, td_part_t *p, td_fetched_t fetched)
{
    natsMsg *m = fetched.msg;
    uint64_t seq = fetched.seq;
    if (seq == 0 || seq <= p->high_seq) {
        td_debug("fleet: partition %u sequence %" PRIu64 ": skipped (taken up to %" PRIu64 ")",
                 (unsigned)p->k, seq, p->high_seq);
        natsMsg_Destroy(m); /* a redelivery, or the previous owner's: acknowledged with the
                             * watermark's message */
        return;
    }
    if (seq > p->high_seq + 1 && !accept_gap(f, p, seq)) {
        natsMsg_Destroy(m);
        return;
    }
    size_t len = (size_t)natsMsg_GetDataLength(m);
    if (!window_has_room(f, p, seq, len)) {
        p->next = fetched;
        return;
    }
    uint64_t pos = p->win_first + p->win_len++;
    *entry_at(f, p, pos) = (td_win_entry_t){.msg = m, .seq = seq, .slot = -1, .h = fetched.h};
    p->win_bytes += len;
    TD_FLEET_SET(f, window[p->k], p->win_len);
    p->high_seq = seq;
    judge(f, p, pos);
}

void td_part_reply(td_fleet_t *f, td_part_t *p, td_pend_t *pend, const uint8_t *header,
                   const uint8_t *body, size_t body_len)
{
    uint64_t pos = pend->pos;
    if (!p->owned || pos < p->win_first || pos >= p->win_first + p->win_len ||
        entry_at(f, p, pos)->state != WIN_SENT)
        return; /* forgotten with its window */
    td_win_entry_t *e = entry_at(f, p, pos);
    count_in_path(f, p, e, false); /* out of the path, whatever comes of it */
    tally_rep_t rep;
    tally_rep_decode(header, TALLY_REP_HEADER_SIZE, &rep);
    tally_status_t st = (tally_status_t)rep.status;
    if (st == TALLY_E_BUSY || st == TALLY_E_RATE || st == TALLY_E_SHUTDOWN) {
        TD_FLEET_COUNT(f, resent);
        mark_retry(p, e, TD_FLEET_RETRY_MS); /* no effect: the same message again (at
                                              * shutdown: the next owner's) */
        if (order_broken(f, p, pos, false))
            drop_order_broken(f, p,
                              "a message was refused after a later one of its stream applied");
        return;
    }
    if (!td_part_may_write(p)) { /* the fence: nothing of it goes out */
        td_part_drop(f, p, "its lease ran out");
        return;
    }
    if (p->retries && order_broken(f, p, pos, true)) { /* only a refused one can be overtaken */
        drop_order_broken(f, p, "a message was applied before a refused one of its stream");
        return;
    }
    if (st != TALLY_OK && st != TALLY_E_DUPLICATE) {
        char why[TALLY_ERROR_MESSAGE_MAX + 1];
        snprintf(why, sizeof why, "%.*s",
                 (int)(body_len < TALLY_ERROR_MESSAGE_MAX ? body_len : TALLY_ERROR_MESSAGE_MAX),
                 (const char *)body);
        if (!dead_letter(f, p, e, st, why)) {
            mark_retry(p, e, TD_FLEET_RETRY_MS * 10); /* a failed request had no effect */
            return;
        }
    }
    const char *to = e->to;
    uint8_t buf[TALLY_REP_HEADER_SIZE + 4096];
    size_t len = 0;
    uint8_t *frame = to ? td_fleet_frame(header, body, body_len, buf, sizeof buf, &len) : NULL;
    if (frame) /* without memory for it: no reply (the publisher's wait ends unanswered) */
        td_fleet_publish_reply(f, to, e->msg, p->k, e->seq, frame, len);
    if (frame != buf)
        free(frame);
    td_debug("fleet: partition %u sequence %" PRIu64 ": %s (request seq %" PRIu64 ")",
             (unsigned)p->k, e->seq, tally_status_name(st),
             tally_get_u64((const uint8_t *)natsMsg_GetData(e->msg) + 40));
    mark_done(f, p, e);
}

/* Why a partition with messages waiting takes none, in td_part_step's order. */
static void stall_reason(const td_fleet_t *f, const td_part_t *p, int64_t now, char *out,
                         size_t cap)
{
    if (p->taking)
        snprintf(out, cap, "its take waits for its consumer");
    else if (p->retries)
        snprintf(out, cap, "%zu refused messages wait to be sent again (in %" PRId64 " ms)",
                 p->retries, p->retry_at - now);
    else if (p->draining)
        snprintf(out, cap, "it drains for a checkpoint (%zu messages in its window)", p->win_len);
    else if (p->next.msg)
        snprintf(out, cap,
                 "its window is full (%zu of %zu messages, %zu bytes, %zu in the request path)",
                 p->win_len, f->inflight, p->win_bytes, p->in_path);
    else
        snprintf(out, cap, "none of its own waits (its window %zu, %zu in the request path)",
                 p->win_len, p->in_path);
}

/* Says once, and why, when messages have waited TD_FLEET_SLOW_TURN_MS for p's window to take
 * one (issue 32: three partitions of a worker took none for 4.6 s after a SIGCONT), timed from
 * the step that first saw them waiting; a fleet thread held elsewhere is turn()'s to say. */
static void say_if_stalled(td_fleet_t *f, td_part_t *p, int64_t now)
{
    uint64_t fetched = atomic_load_explicit(&f->st->fetched[p->k], memory_order_relaxed);
    bool waiting = fetched > p->reader.popped_count || p->next.msg;
    if (!waiting || !p->stall_waiting || p->high_seq != p->stall_high_seq) {
        p->stall_waiting = waiting; /* from the step that first saw them: a stop is not counted */
        p->stall_high_seq = p->high_seq;
        p->stall_since_ms = now;
        p->stall_said = false;
        return;
    }
    if (p->stall_said || now - p->stall_since_ms < TD_FLEET_SLOW_TURN_MS)
        return;
    char why[256];
    stall_reason(f, p, now, why, sizeof why);
    td_notice("fleet: partition %u has taken no message for %" PRId64 " ms with %" PRIu64
              " fetched and waiting: %s",
              (unsigned)p->k, now - p->stall_since_ms,
              fetched - p->reader.popped_count + (p->next.msg ? 1 : 0), why);
    p->stall_said = true;
}

bool td_part_step(td_fleet_t *f, td_part_t *p)
{
    int64_t now = td_nats_now_ms();
    say_if_stalled(f, p, now);
    if (!td_lease_valid(&p->lease, now)) {
        td_part_drop(f, p, "its lease ran out (this worker was paused or cut off)");
        return true;
    }
    bool acted = false;
    if (p->taking && !take_step(f, p, &acted))
        return acted;
    if (td_changelog_failed(f, p->k)) { /* its next owner starts from what JetStream holds */
        td_part_drop(f, p, "its changelog could not be written");
        return true;
    }
    char why[256];
    if (td_reader_failed(&p->reader, why, sizeof why)) { /* made again after a gap */
        td_warn("fleet: partition %u: %s", (unsigned)p->k, why);
        td_part_drop(f, p, "its consumer could not be made again");
        return true;
    }
    if (p->retries) {
        if (now < p->retry_at)
            return false;
        resend(f, p);
        return true;
    }
    if (p->draining) { /* a checkpoint is taken at the watermark with nothing in the path */
        if (p->win_len)
            return false;
        p->draining = false;
        atomic_fetch_add_explicit(&f->st->checkpoint_drain_ns, td_mono_ns() - p->drain_began_ns,
                                  memory_order_relaxed);
        td_part_checkpoint(f, p);
        return true;
    }
    if ((p->high_seq > p->ckpt_seq || td_fleet_route_uncommitted(f, p->k)) &&
        (now - p->last_ckpt_ms >= f->ckpt_ms || p->unacked >= TD_NATS_ACK_PENDING / 2)) {
        p->draining = true;
        p->drain_began_ns = td_mono_ns();
        return true;
    }
    bool did = false;
    for (int i = 0; i < TD_FLEET_STEP_MESSAGES && p->owned && !p->retries; i++) {
        td_fetched_t m = p->next.msg ? p->next : td_reader_pop(&p->reader);
        if (!m.msg)
            break;
        p->next = (td_fetched_t){0};
        process(f, p, m);
        if (p->next.msg == m.msg)
            break; /* the window is full: not work (the fleet thread may sleep until a reply
                    * makes room; reported as work, its loop turned at a core while it waited) */
        did = true;
    }
    /* what waits for the window (p->next) counts as fetched, not taken */
    TD_FLEET_SET(f, taken[p->k], p->reader.popped_count - (p->next.msg ? 1 : 0));
    return did;
}
