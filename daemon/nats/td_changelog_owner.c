/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_changelog_owner.c — a partition's changelog as its owner's fleet thread handles it
 * (td_fleet_changelog.h says what and why): taken (the records after the checkpoint replayed into
 * the stream table, td_changelog_apply, which a standby's copy shares, then the fence), asked what
 * it stored at a checkpoint, purged at a quiet point after one, closed when the partition goes.
 * The records' way in (the shards' holds, the committer, the PubAcks) is td_fleet_changelog.c;
 * the state both keep, under its one mutex, td_changelog_int.h.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_changelog_int.h"
#include "td_fleet_changelog.h"
#include "td_fleet_int.h"
#include "td_log.h"
#include "td_nats_js.h"
#include "td_path.h"
#include "td_state_record.h"

/* A take stores its fence against this many writers racing it before it gives up. */
#define CL_FENCE_TRIES 5
/* Replayed batches are applied on the loop this many bytes at a time (the shards held). */
#define CL_APPLY_BYTES (4u << 20)
/* A purge at a quiet point is sent only with this much of the owner's lease left by its own
 * clock, and its answer awaited no longer (td_changelog_compact says why). */
#define CL_PURGE_LEASE_MS 1000

/* ---- Taking a partition: the replay and the fence ---------------------------------------------
 */

typedef struct {
    td_streams_t *table; /* the stream table, or a standby's copy (td_fleet_standby.c) */
    const uint8_t *buf;
    size_t len;
    unsigned applied, refused;
} apply_job_t;

static void apply_on_loop(td_fleet_t *f, void *arg)
{
    (void)f;
    static td_state_record_t rec; /* loop thread only: a histogram's bins */
    apply_job_t *j = arg;
    uint64_t now = td_clock_ms();
    for (size_t at = 0; at < j->len;) {
        size_t size = td_state_record_check(j->buf + at, j->len - at);
        char why[160];
        unsigned dropped = 0;
        if (size == 0 || !td_state_record_parse(j->buf + at, size, &rec, why, sizeof why)) {
            j->refused++;
            return; /* a batch is written whole: the rest cannot be trusted either */
        }
        if (td_state_record_apply(j->table, &rec, now, &dropped, why, sizeof why) ==
            TD_STATE_APPLIED)
            j->applied++;
        else
            j->refused++;
        at += size;
    }
}

static uint64_t header_u64(natsMsg *m, const char *key)
{
    const char *v = NULL;
    return natsMsgHeader_Get(m, key, &v) == NATS_OK && v ? strtoull(v, NULL, 10) : 0;
}

/* Changelog messages from..to of partition k are gone before a checkpoint held them (aged out
 * past partition_max_age_s, or removed by hand): the writes they held are lost. The take goes
 * on from the checkpoint and the messages that remain, rather than leave every stream of the
 * partition without an owner for records that cannot come back; it says so at error level and
 * counts them (tallyd_nats_changelog_lost_total), and a numbered producer of a stream they
 * held meets sequence_gap at its next write (the stream's last_seq is behind). */
static void records_gone(td_fleet_t *f, uint32_t k, uint64_t from, uint64_t to)
{
    atomic_fetch_add_explicit(&f->st->changelog_lost, to - from + 1, memory_order_relaxed);
    td_err("fleet: partition %u: changelog messages %" PRIu64 "..%" PRIu64
           " are gone before a checkpoint held them (partition_max_age_s passed without an "
           "owner, or they were removed): the writes they held are lost, the partition is taken "
           "from its checkpoint and the messages after them",
           (unsigned)k, from, to);
}

td_err_t td_changelog_apply(td_fleet_t *f, uint32_t k, uint64_t seq, natsMsg *m,
                            td_streams_t *table, uint64_t *max_epoch, char *msg, size_t cap)
{
    uint64_t epoch = header_u64(m, TALLY_NATS_HDR_EPOCH);
    if (epoch < *max_epoch) {
        td_warn("fleet: partition %u: changelog record %" PRIu64 " of epoch %" PRIu64
                " after epoch %" PRIu64 ": a stale owner's, skipped",
                (unsigned)k, seq, epoch, *max_epoch);
        return TD_OK;
    }
    *max_epoch = epoch;
    const uint8_t *data = (const uint8_t *)natsMsg_GetData(m);
    size_t len = (size_t)natsMsg_GetDataLength(m);
    apply_job_t j = {.table = table};
    for (size_t at = 0; at < len && !j.refused; at += j.len) { /* CL_APPLY_BYTES at a time */
        j.buf = data + at;
        j.len = td_cl_records_within(j.buf, len - at, CL_APPLY_BYTES);
        if (table == f->host.streams)
            td_fleet_on_loop(f, apply_on_loop, &j);
        else /* a standby's copy: the shards go on */
            td_fleet_on_loop_unheld(f, apply_on_loop, &j);
    }
    if (j.refused)
        snprintf(msg, cap, "changelog record %" PRIu64 ": %u of its streams refused", seq,
                 j.refused);
    return j.refused ? TD_ERR_CORRUPT : TD_OK;
}

/* Applies the messages after..last of TALLY_CL<k>; *max_epoch: the highest epoch applied. */
static td_err_t replay(td_fleet_t *f, uint32_t k, uint64_t after, uint64_t last,
                       uint64_t *max_epoch, char *msg, size_t cap)
{
    char stream[32];
    td_cl_stream_of(stream, sizeof stream, k);
    for (uint64_t seq = after + 1; seq <= last; seq++) {
        natsMsg *m = NULL;
        jsErrCode jerr = 0;
        natsStatus s = js_GetMsg(&m, f->js, stream, seq, NULL, &jerr);
        if (s == NATS_NOT_FOUND || jerr == JSNoMessageFoundErr) {
            records_gone(f, k, seq, seq);
            continue;
        }
        if (s != NATS_OK) {
            snprintf(msg, cap, "reading changelog record %" PRIu64 ": %s", seq,
                     td_nats_last_error(s));
            return TD_ERR_LIBRARY;
        }
        td_err_t err = td_changelog_apply(f, k, seq, m, f->host.streams, max_epoch, msg, cap);
        natsMsg_Destroy(m);
        if (err != TD_OK)
            return err;
        TD_FLEET_COUNT(f, changelog_replayed);
    }
    return TD_OK;
}

/* Partition k's changelog: its first and last sequences. missing (NULL: an error) says whether
 * the stream is missing (never made: no owner was replicated). */
static td_err_t last_seq(td_fleet_t *f, uint32_t k, uint64_t *first, uint64_t *last, bool *missing,
                         char *msg, size_t cap)
{
    char stream[32];
    td_cl_stream_of(stream, sizeof stream, k);
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    natsStatus s = js_GetStreamInfo(&si, f->js, stream, NULL, &jerr);
    if (missing)
        *missing = s == NATS_NOT_FOUND || jerr == JSStreamNotFoundErr;
    if (s != NATS_OK && !(missing && *missing)) {
        snprintf(msg, cap, "%s: %s", stream, td_nats_last_error(s));
        return TD_ERR_LIBRARY;
    }
    *first = si ? si->State.FirstSeq : 0;
    *last = si ? si->State.LastSeq : 0;
    jsStreamInfo_Destroy(si);
    return TD_OK;
}

/* Stores a message without records expecting `expect` as the last sequence (0: none, for the
 * stream's first message, deduplicated by its id so that racing members store one). *seq: where
 * it was stored; *lost: another writer came first. */
static td_err_t store_fence(td_fleet_t *f, uint32_t k, uint64_t epoch, uint64_t expect,
                            uint64_t *seq, bool *lost, char *msg, size_t cap)
{
    char subject[32];
    td_cl_subject_of(subject, sizeof subject, k);
    natsMsg *m = NULL;
    jsPubOptions po;
    jsPubOptions_Init(&po);
    po.ExpectLastSeq = expect;
    if (!expect)
        po.MsgId = "tally-changelog-start";
    jsPubAck *pa = NULL;
    jsErrCode jerr = 0;
    *lost = false;
    natsStatus s = natsMsg_Create(&m, subject, NULL, NULL, 0);
    if (s == NATS_OK)
        s = td_cl_add_headers(m, f, epoch, 0);
    if (s == NATS_OK)
        s = js_PublishMsg(&pa, f->js, m, &po, &jerr);
    natsMsg_Destroy(m);
    if (s == NATS_OK) {
        *seq = pa->Sequence;
        jsPubAck_Destroy(pa);
        return TD_OK;
    }
    if (jerr == CL_WRONG_LAST_SEQUENCE) {
        *lost = true;
        return TD_OK;
    }
    snprintf(msg, cap, "storing the changelog's fence: %s", td_nats_last_error(s));
    return TD_ERR_LIBRARY;
}

/* Partition k's records go to its changelog from now on, under epoch, chained after the fence. */
static void open_part(td_changelog_t *cl, uint32_t k, uint64_t epoch, uint64_t fence)
{
    pthread_mutex_lock(&cl->mu);
    cl_part_t *p = &cl->parts[k];
    p->state = CL_OPEN;
    p->epoch = epoch;
    p->stored = fence;
    p->fail_from = 0;
    td_cl_drop_flights(p);
    td_cl_times_taken(&p->times);
    p->len = p->writes = p->last_writes = 0;
    p->ok_then = p->ok_upto;
    p->open_from = p->batch;
    pthread_mutex_unlock(&cl->mu);
}

td_err_t td_changelog_take(td_fleet_t *f, uint32_t k, uint64_t cl_seq, uint64_t max_epoch,
                           uint64_t epoch, uint64_t *held, char *msg, size_t cap)
{
    td_changelog_t *cl = f->cl;
    *held = cl_seq;
    uint64_t first = 0, last = 0, applied = cl_seq, fence = 0;
    char stream[32], subject[32];
    td_cl_stream_of(stream, sizeof stream, k);
    td_cl_subject_of(subject, sizeof subject, k);
    /* Without `replicated` too: a changelog an earlier owner wrote holds writes it answered
     * (and its records after the checkpoint would otherwise be applied, stale, by a later
     * replicated owner over this one's checkpoints); only one never written is left alone. */
    bool missing = false;
    td_err_t err = cl ? td_nats_stream_ensure(f->js, stream, subject, cl->replicas, cl->max_age_ms,
                                              (int32_t)f->max_payload, msg, cap)
                      : last_seq(f, k, &first, &last, &missing, msg, cap);
    if (err != TD_OK || missing)
        return err;
    err = last_seq(f, k, &first, &last, NULL, msg, cap);
    if (err == TD_OK && last == 0) { /* nothing to expect yet: a first message, then the fence */
        bool lost = false;
        err = store_fence(f, k, epoch, 0, &fence, &lost, msg, cap);
        if (err == TD_OK)
            err = last_seq(f, k, &first, &last, NULL, msg, cap);
    }
    /* A stream's sequences only grow, so one that ends before the checkpoint's was removed and
     * made again after that checkpoint was taken: every message in it came later (a missing
     * one among them is lost, as below). Its records are whole states, so all of them go on top
     * of the checkpoint; the caller's cl_seq restarts from the fence (*held), or a checkpoint
     * naming the old, larger one would hide this stream's records from the next owner. */
    if (err == TD_OK && last < applied) {
        td_warn("fleet: partition %u: its changelog ends at %" PRIu64
                ", before its checkpoint's %" PRIu64 ": the stream was removed and made again; "
                "all of it is applied, and the checkpoints count from its fence",
                (unsigned)k, last, applied);
        applied = 0;
    }
    uint64_t from = applied + 1;
    if (err == TD_OK && first > applied + 1 && last > applied) { /* asked once, not per record */
        uint64_t gone = first - 1 < last ? first - 1 : last; /* an empty stream: first = last + 1 */
        records_gone(f, k, applied + 1, gone);
        applied = gone;
    }
    for (int i = 0; err == TD_OK && i < CL_FENCE_TRIES; i++) {
        bool lost = false;
        err = replay(f, k, applied, last, &max_epoch, msg, cap);
        if (err == TD_OK)
            applied = last;
        if (err == TD_OK && i == 0)
            td_fleet_test_gate("TALLYD_TEST_FENCE_GATE", "its fence", k);
        if (err == TD_OK)
            err = store_fence(f, k, epoch, last, &fence, &lost, msg, cap);
        if (err != TD_OK || !lost)
            break;
        err = last_seq(f, k, &first, &last, NULL, msg, cap); /* another writer: its records too */
        if (err == TD_OK)
            td_info("fleet: partition %u: its changelog's fence lost to a message stored after "
                    "%" PRIu64 " (a previous owner's late batch?): applying up to %" PRIu64
                    " and fencing again",
                    (unsigned)k, applied, last);
        fence = 0;
    }
    if (err == TD_OK && !fence) {
        snprintf(msg, cap, "its changelog's fence lost to other writers %d times", CL_FENCE_TRIES);
        err = TD_ERR_LIBRARY;
    }
    if (err != TD_OK)
        return err;
    *held = fence;
    td_info(last < from ? "fleet: partition %u's changelog: nothing to replay from %" PRIu64
                          " on (it ends at %" PRIu64 "), fence at %" PRIu64
                        : "fleet: partition %u's changelog: applied %" PRIu64 "..%" PRIu64
                          ", fence at %" PRIu64,
            (unsigned)k, from, last, fence);
    if (cl) /* not replicated: this owner writes no records, the fence stops earlier ones' */
        open_part(cl, k, epoch, fence);
    return TD_OK;
}

void td_changelog_closed(td_fleet_t *f, uint32_t k)
{
    td_changelog_t *cl = f->cl;
    if (!cl)
        return;
    pthread_mutex_lock(&cl->mu);
    cl_part_t *p = &cl->parts[k];
    if (p->state != CL_CLOSED) {
        p->state = CL_CLOSED;
        td_cl_fail_locked(cl, k, "closed");
    }
    pthread_mutex_unlock(&cl->mu);
    td_path_wake_held(f->host.path);
}

/* ---- Compaction at a quiet point --------------------------------------------------------------
 *
 * A checkpoint that holds every record of the changelog makes the changelog useless to a next
 * owner, so it is emptied: a purge of the whole stream (no sequence, no filter), the one form
 * that nats-server before 2.9.18 replays without loss on a replica restarted before its raft
 * snapshot (a purge below a sequence is replayed as a purge of everything: test 7 of
 * tests/test_nats_changelog.c). It is made only at a quiet point, all of which is checked under
 * mu: the partition's changelog open (no publish failed), the checkpoint's cl_seq the last
 * sequence this owner stored (nothing stored after the snapshot's reading), no record waiting
 * in the batch and no publish awaiting its PubAck (a retry is a publish in flight), and the
 * lease held for at least CL_PURGE_LEASE_MS more by this member's own clock.
 *
 * Why the check and the purge cannot race with a new record. Records reach the stream only
 * through the committer thread's publishes (publish_locked and resend_locked, under mu); the
 * shards' threads only append to the batch (hold, under mu) and libnats' thread only settles a
 * publish (on_ack). The check sets `purging` under the same lock hold that found the partition
 * quiet, and the committer publishes nothing of a purging partition, so from the check until
 * the purge's answer the stream holds exactly the messages up to `stored`, all of which the
 * stored checkpoint holds; records written meanwhile wait in the batch and are published after
 * the purge, behind it (its answer comes once the server applied it). The fence is unchanged:
 * a purged stream keeps its last sequence, so this owner's next publish expects `stored` as
 * before and a stale owner's (expecting an earlier one) is still refused.
 *
 * The purge is not a compare-and-set: only the lease keeps a next owner's records from it. A
 * next owner takes the partition after the server removes this member's lease key, later than
 * the lease's end by this member's clock; the purge's answer is awaited no longer than that end
 * (CL_PURGE_LEASE_MS, sent with at least that much left), so a purge answered was applied before
 * any next owner's fence. One not answered (or refused) may still be applied later, behind
 * anything: it fails the partition as a failed publish does, nothing more published by this
 * member, whose next owner starts from the checkpoint, which holds all of the stream. Age
 * removal (partition_max_age_s) stays the backstop for a changelog never quiet at a checkpoint. */

/* Under mu: why partition k's changelog is kept after a checkpoint holding its records up to
 * cl_seq, with wait_ms of the lease left; NULL at a quiet point. */
static const char *kept_because(const cl_part_t *p, uint64_t cl_seq, int64_t wait_ms)
{
    if (p->state != CL_OPEN || wait_ms < CL_PURGE_LEASE_MS)
        return "its changelog failed, or its lease ends soon";
    if (p->stored != cl_seq)
        return "records were stored after the checkpoint's";
    if (p->len || p->nflights)
        return "records wait to be stored";
    return NULL;
}

void td_changelog_compact(td_fleet_t *f, uint32_t k, uint64_t cl_seq, int64_t lease_until_ms)
{
    td_changelog_t *cl = f->cl;
    if (!cl)
        return;
    td_fleet_test_gate("TALLYD_TEST_PURGE_GATE", "its purge", k);
    pthread_mutex_lock(&cl->mu);
    cl_part_t *p = &cl->parts[k];
    const char *kept = kept_because(p, cl_seq, lease_until_ms - td_nats_now_ms());
    p->purging = !kept; /* from here to the answer the committer publishes nothing of k */
    pthread_mutex_unlock(&cl->mu);
    if (kept) {
        td_debug("fleet: partition %u's changelog kept after the checkpoint at %" PRIu64 ": %s",
                 (unsigned)k, cl_seq, kept);
        return;
    }
    char stream[32], why[256];
    td_cl_stream_of(stream, sizeof stream, k);
    jsOptions o;
    jsOptions_Init(&o);
    o.Wait = CL_PURGE_LEASE_MS;
    jsErrCode jerr = 0;
    natsStatus s = js_PurgeStream(f->js, stream, &o, &jerr);
    pthread_mutex_lock(&cl->mu);
    p->purging = false;
    if (s == NATS_OK) {
        TD_FLEET_COUNT(f, changelog_purges);
        td_debug("fleet: partition %u's changelog purged: its checkpoint holds it up to %" PRIu64,
                 (unsigned)k, cl_seq);
    } else {
        snprintf(why, sizeof why, "a purge at a quiet point failed: %s (%d)", td_nats_last_error(s),
                 (int)jerr);
        td_cl_fail_locked(cl, k, why);
    }
    pthread_cond_signal(&cl->cond); /* what came meanwhile goes now */
    pthread_mutex_unlock(&cl->mu);
    td_path_wake_held(f->host.path);
}

uint64_t td_changelog_stored(td_fleet_t *f, uint32_t k)
{
    td_changelog_t *cl = f->cl;
    if (!cl)
        return 0;
    pthread_mutex_lock(&cl->mu);
    uint64_t seq = cl->parts[k].stored;
    pthread_mutex_unlock(&cl->mu);
    return seq;
}

bool td_changelog_failed(td_fleet_t *f, uint32_t k)
{
    td_changelog_t *cl = f->cl;
    if (!cl)
        return false;
    pthread_mutex_lock(&cl->mu);
    bool failed = cl->parts[k].state == CL_FAILED;
    pthread_mutex_unlock(&cl->mu);
    return failed;
}
