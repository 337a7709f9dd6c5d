/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_part.c — one partition's life on this worker (PROTOCOL.md §13 "Exactly once across
 * crashes"): taking it (lease, fence, load the checkpoint into the stream table, the consumer at
 * checkpoint + 1), checkpointing it, and giving it up or losing it. Applying its messages through
 * the request path, its window, is td_fleet_window.c; what the two share, td_part_int.h.
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
#include "td_part_int.h"
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

static void release_lease(td_fleet_t *f, td_part_t *p)
{
    char msg[256];
    if (p->lease.revision && td_lease_release(f->kv_js, p->k, &p->lease, msg, sizeof msg) != TD_OK)
        td_warn("fleet: %s", msg);
    memset(&p->lease, 0, sizeof p->lease);
}

static void forget_work(td_fleet_t *f, td_part_t *p)
{
    td_part_forget_window(f, p);
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
        td_win_entry_release(&p->win[(p->win_first + i) % f->inflight]);
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
 * (td_part_take_step, or td_part_step after a gap). */
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
bool td_part_accept_gap(td_fleet_t *f, td_part_t *p, uint64_t seq)
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
bool td_part_take_step(td_fleet_t *f, td_part_t *p, bool *acted)
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

void td_part_give_up(td_fleet_t *f, td_part_t *p)
{
    td_fleet_route_closed(f, p->k); /* direct mode: what was answered goes into the checkpoint */
    td_part_quiesce(f, p);
    if (p->owned && td_part_applied_above_refused(f, p))
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
