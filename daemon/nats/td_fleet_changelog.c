/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_changelog.c — direct mode's changelog per partition and its group commit
 * (td_fleet_changelog.h says what and why).
 *
 * A partition's tickets: each batch of records has a number (its ticket), counted up for the
 * member's life; a held reply waits for its batch's. Up to CL_DEPTH messages of a partition are
 * in flight at once (its flights, oldest first), the i-th expecting the chain's last sequence
 * plus i, so they are stored in order or not at all: a PubAck settles its flight and every one
 * before it; tickets up to ok_upto were stored; from fail_from (0: none) on every one failed,
 * until the partition is taken again; a take keeps what was not stored of the ownerships before
 * it (above ok_then, below open_from) failed.
 *
 * A publish that found no stream leader (an election) is sent again, and so is every flight
 * after it, which the server refused for the same reason or for its expected sequence (the one
 * before it was not stored): once all of them are answered, in order, from the chain's last
 * sequence. A later flight stored after all says the earlier ones were stored too (the server
 * stores a message only after the one its expected sequence names): it settles them.
 *
 * A message holds at most max_msg bytes of records (the server's max_payload less
 * TALLY_NATS_HEADROOM for the headers). Records that pile up while messages are in flight may
 * pass that: the batch then goes out as several messages, cut between records, in order.
 * Only the last one's PubAck settles the batch's ticket (a "part" settles nothing): the ticket
 * of a message that holds the whole rest of the buffer covers every record before it, whatever
 * ticket each was held under. A record larger than max_msg alone can never be stored: the
 * write that made it fails the partition at once, with the sizes in the log.
 *
 * When a batch goes (commit_ms, commit_bytes, at once when idle): td_fleet_changelog.h.
 *
 * Where a held write waits, stage by stage, is timed under mu (td_changelog_stages.h).
 *
 * What the fleet thread does to the stream (the replay and the fence at a take, the purge at a
 * quiet point): td_changelog_owner.c; the state both keep: td_changelog_int.h.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "td_changelog_int.h"
#include "td_changelog_stages.h"
#include "td_fleet_changelog.h"
#include "td_fleet_int.h"
#include "td_log.h"
#include "td_monotonic.h"
#include "td_nats_js.h"
#include "td_path.h"
#include "td_state_record.h"
#include "td_window.h"

/* A publish that found no stream leader (an election, a stream just made) is sent again after
 * this, until TD_FLEET_JS_WAIT_MS have passed since the first try: nothing stored it, and a
 * second try that finds the first one stored fails on its expected last sequence anyway. */
#define CL_RETRY_MS 50
/* A partition whose last whole batch held this many writes or more is busy: its next batch
 * groups for commit_ms even when nothing is in flight (commit_when_idle; the file's comment). */
#define CL_BUSY_WRITES 4
/* A record up to this size is encoded on the shard's stack before the changelog's lock is taken
 * (td_changelog_hold); a larger one under it. */
#define CL_RECORD_STACK 8192

/* ---- Settling ------------------------------------------------------------------------------ */

/* Under mu: forgets p's flights (failed, or of an ownership that ended). */
void td_cl_drop_flights(cl_part_t *p)
{
    for (unsigned i = 0; i < p->nflights; i++)
        natsMsg_Destroy(p->flights[i].resend);
    p->nflights = p->nresend = 0;
}

/* Under mu: the flight of that ticket, or -1. */
static int flight_of(const cl_part_t *p, uint64_t ticket)
{
    for (unsigned i = 0; ticket && i < p->nflights; i++)
        if (p->flights[i].ticket == ticket)
            return (int)i;
    return -1;
}

/* Under mu: flights 0..i were stored, the last at seq, their PubAck come at ack_ns: they leave,
 * their tickets settled. */
static void settle_upto(td_changelog_t *cl, cl_part_t *p, unsigned i, uint64_t seq, int64_t ack_ns)
{
    p->stored = seq;
    uint64_t was = p->ok_upto;
    for (unsigned j = 0; j <= i; j++) {
        if (!p->flights[j].part)
            p->ok_upto = p->flights[j].ticket;
        if (p->flights[j].resend) {
            natsMsg_Destroy(p->flights[j].resend);
            p->nresend--;
        }
        td_cl_stage(cl->f->st, TD_CL_STAGE_ACK, p->flights[j].sent_ns, ack_ns);
    }
    td_cl_times_settled(&p->times, p->ok_upto != was ? p->ok_upto : 0, ack_ns,
                        p->nflights == CL_DEPTH);
    p->nflights -= i + 1;
    memmove(p->flights, p->flights + i + 1, p->nflights * sizeof *p->flights);
}

/* Under mu: every ticket not settled fails (the batch in flight, those whose first records went
 * out as parts, the one filling), and every later one until a take. */
void td_cl_fail_locked(td_changelog_t *cl, uint32_t k, const char *why)
{
    cl_part_t *p = &cl->parts[k];
    uint64_t from = p->ok_upto + 1;
    if (!p->fail_from || from < p->fail_from)
        p->fail_from = from;
    if (p->state == CL_OPEN)
        td_warn("fleet: partition %u's changelog: %s; the partition is dropped, its writes not "
                "stored are answered not_durable",
                (unsigned)k, why);
    if (p->state == CL_OPEN)
        p->state = CL_FAILED;
    td_cl_drop_flights(p);
    p->len = p->writes = p->last_writes = 0;
    p->batch++;
}

static void on_ack(jsCtx *js, natsMsg *m, jsPubAck *pa, jsPubAckErr *pae, void *closure)
{
    (void)js;
    td_changelog_t *cl = closure;
    const char *subject = natsMsg_GetSubject(m), *batch = NULL;
    unsigned long k = strtoul(subject + strlen(TALLY_NATS_SUBJ_CL), NULL, 10);
    natsMsgHeader_Get(m, TALLY_NATS_HDR_BATCH, &batch);
    uint64_t ticket = batch ? strtoull(batch, NULL, 10) : 0;
    td_fleet_test_gate("TALLYD_TEST_ACK_GATE", "a PubAck", (uint32_t)k);
    int64_t ack_ns = (int64_t)td_mono_ns();
    pthread_mutex_lock(&cl->mu);
    cl_part_t *p = k < cl->f->partitions ? &cl->parts[k] : NULL;
    int i = p ? flight_of(p, ticket) : -1; /* -1: settled already, or failed */
    cl_flight_t *fl = i >= 0 ? &p->flights[i] : NULL;
    /* Sent again later: no leader stored it, or (a later flight) the one before it was not. */
    bool again =
        fl && pae && !fl->resend && td_nats_now_ms() - fl->sent_ms < TD_FLEET_JS_WAIT_MS &&
        (pae->Err == NATS_NO_RESPONDERS || (i > 0 && pae->ErrCode == CL_WRONG_LAST_SEQUENCE));
    if (again) {
        fl->resend = m; /* the committer sends it again, once every flight is answered */
        m = NULL;
        if (p->nresend++ == 0)
            p->retry_ms = td_nats_now_ms() + CL_RETRY_MS;
        pthread_cond_signal(&cl->cond);
    } else if (fl && pa && !pae) {
        settle_upto(cl, p, (unsigned)i, pa->Sequence, ack_ns);
        TD_FLEET_COUNT(cl->f, changelog_commits);
        pthread_cond_signal(&cl->cond); /* a flight free; none left: what waits goes at once */
    } else if (fl) {
        char why[256];
        snprintf(why, sizeof why, "a publish failed: %s (%d)",
                 pae && pae->ErrText ? pae->ErrText : td_nats_last_error(pae ? pae->Err : NATS_ERR),
                 pae ? (int)pae->ErrCode : 0);
        td_cl_fail_locked(cl, (uint32_t)k, why);
        pthread_cond_signal(&cl->cond);
    }
    pthread_mutex_unlock(&cl->mu);
    natsMsg_Destroy(m);
    td_path_wake_held(cl->f->host.path);
}

/* ---- Publishing (the committer thread) ------------------------------------------------------ */

natsStatus td_cl_add_headers(natsMsg *m, const td_fleet_t *f, uint64_t epoch, uint64_t ticket)
{
    char num[24];
    snprintf(num, sizeof num, "%" PRIu64, epoch);
    natsStatus s = natsMsgHeader_Set(m, TALLY_NATS_HDR_EPOCH, num);
    snprintf(num, sizeof num, "%" PRIu64, ticket);
    if (s == NATS_OK)
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_BATCH, num);
    if (s == NATS_OK)
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_MEMBER, f->member);
    return s;
}

/* The options of a partition's message that n others in flight precede. */
static void publish_options(jsPubOptions *po, const cl_part_t *p, unsigned n)
{
    jsPubOptions_Init(po);
    po->ExpectLastSeq = p->stored + n;
    po->MaxWait = TD_FLEET_JS_WAIT_MS;
}

/* Under mu: every flight again, in order, once each was answered to be sent again. */
static void resend_locked(td_changelog_t *cl, uint32_t k)
{
    cl_part_t *p = &cl->parts[k];
    td_info("fleet: partition %u's changelog: %u messages sent again (no stream leader took the "
            "first)",
            (unsigned)k, p->nflights);
    for (unsigned i = 0; i < p->nflights && p->state == CL_OPEN; i++) {
        jsPubOptions po;
        publish_options(&po, p, i);
        natsMsg *m = p->flights[i].resend;
        p->flights[i].resend = NULL;
        p->nresend--;
        natsStatus s = js_PublishMsgAsync(cl->js, &m, &po);
        natsMsg_Destroy(m); /* NULL when the library took it */
        if (s != NATS_OK) {
            char why[256];
            snprintf(why, sizeof why, "a publish failed: %s", td_nats_last_error(s));
            td_cl_fail_locked(cl, k, why);
        }
    }
}

/* The bytes at the front of buf (len > 0) to take as one piece of at most max: its whole
 * records that fit, the first always (a batch's never passes max_msg alone). A record whose
 * size does not fit what is left (a replayed message that is not well-formed) ends the piece,
 * or is the whole rest when it comes first: td_state_record_check refuses it there. */
size_t td_cl_records_within(const uint8_t *buf, size_t len, size_t max)
{
    size_t at = 0;
    while (len - at >= TD_STATE_RECORD_MIN) {
        size_t size = tally_get_u32(buf + at + 8); /* td_state_record.h: a record's size at 8 */
        if (size < TD_STATE_RECORD_MIN || size > len - at || (at > 0 && at + size > max))
            break;
        at += size;
    }
    return at ? at : len;
}

/* Under mu: publishes partition k's batch, or as much of it as one message holds, expecting
 * its chain's last sequence. */
static void publish_locked(td_changelog_t *cl, uint32_t k, int64_t now)
{
    cl_part_t *p = &cl->parts[k];
    int64_t start_ns = (int64_t)td_mono_ns();
    td_cl_times_publishing(&p->times, cl->f->st, cl->commit_ms, start_ns);
    char subject[32];
    td_cl_subject_of(subject, sizeof subject, k);
    natsMsg *m = NULL;
    jsPubOptions po;
    publish_options(&po, p, p->nflights);
    size_t n = p->len > cl->max_msg ? td_cl_records_within(p->buf, p->len, cl->max_msg) : p->len;
    natsStatus s = natsMsg_Create(&m, subject, NULL, (const char *)p->buf, (int)n);
    if (s == NATS_OK)
        s = td_cl_add_headers(m, cl->f, p->epoch, p->batch);
    if (s == NATS_OK)
        s = js_PublishMsgAsync(cl->js, &m, &po);
    natsMsg_Destroy(m); /* NULL when the library took it */
    if (s != NATS_OK) {
        char why[256];
        snprintf(why, sizeof why, "a publish failed: %s", td_nats_last_error(s));
        td_cl_fail_locked(cl, k, why);
        return;
    }
    int64_t sent_ns = (int64_t)td_mono_ns();
    p->flights[p->nflights++] =
        (cl_flight_t){.ticket = p->batch++, .part = n < p->len, .sent_ms = now, .sent_ns = sent_ns};
    td_cl_times_sent(&p->times, cl->f->st, start_ns, sent_ns, p->nflights == CL_DEPTH, n < p->len);
    memmove(p->buf, p->buf + n, p->len - n); /* the rest goes next, at once */
    p->len -= n;
    if (!p->len) { /* the whole batch: its writes settle with this message */
        p->last_writes = p->writes;
        p->writes = 0;
    }
}

/* Under mu: publishes what is due; the time of the next thing to do (monotonic ms). */
static int64_t commit_due(td_changelog_t *cl)
{
    int64_t now = td_nats_now_ms(), next = now + 100;
    bool woke = false;
    for (uint32_t k = 0; k < cl->f->partitions; k++) {
        cl_part_t *p = &cl->parts[k];
        /* libnats reports a PubAck missing after MaxWait (TD_FLEET_JS_WAIT_MS); this is the
         * backstop should it not (a connection lost with the publish in it) */
        bool all_answered = p->nresend && p->nresend == p->nflights;
        if (p->nflights && now - p->flights[0].sent_ms >= TD_FLEET_JS_WAIT_MS + 1000) {
            td_cl_fail_locked(cl, k, "a publish was not acknowledged in time");
            woke = true;
        } else if (all_answered && now >= p->retry_ms) {
            resend_locked(cl, k);
            woke |= p->state != CL_OPEN;
        } else if (all_answered && p->retry_ms < next) {
            next = p->retry_ms;
        }
        /* A flight to send again holds back the new ones (behind it, they would be refused). */
        while (p->state == CL_OPEN && !p->nresend && p->nflights < CL_DEPTH && !p->purging &&
               p->len) { /* a purge under way: its end wakes the committer */
            bool idle = cl->commit_when_idle && !p->nflights && p->last_writes < CL_BUSY_WRITES;
            if (!idle && p->len < cl->commit_bytes && now - p->first_ms < cl->commit_ms) {
                if (p->first_ms + cl->commit_ms < next)
                    next = p->first_ms + cl->commit_ms;
                break;
            }
            publish_locked(cl, k, now);
            woke |= p->state != CL_OPEN;
        }
    }
    if (woke)
        td_path_wake_held(cl->f->host.path);
    return next;
}

static void *committer(void *arg)
{
    td_changelog_t *cl = arg;
    pthread_setname_np(pthread_self(), "tdchangelog");
    pthread_mutex_lock(&cl->mu);
    while (!cl->stop) {
        int64_t wait_ms = commit_due(cl) - td_nats_now_ms();
        if (wait_ms <= 0)
            continue;
        struct timespec ts = td_deadline_after(CLOCK_MONOTONIC, wait_ms);
        pthread_cond_timedwait(&cl->cond, &cl->mu, &ts);
    }
    pthread_mutex_unlock(&cl->mu);
    return NULL;
}

/* ---- The shards' side ------------------------------------------------------------------------ */

static bool grow(cl_part_t *p, size_t need)
{
    if (p->len + need <= p->cap)
        return true;
    size_t cap = p->cap ? p->cap : 64u << 10;
    while (cap < p->len + need)
        cap *= 2;
    uint8_t *buf = realloc(p->buf, cap);
    if (!buf)
        return false;
    p->buf = buf;
    p->cap = cap;
    return true;
}

/* Under mu: where the record of stream `name` still waiting in p's batch starts, if one is
 * (else p->len). A record is the stream's state after a write (or its removal), so the newer
 * one about to be added holds every effect of the older, which td_changelog_hold removes: a
 * stream written several times before its batch goes out costs one record (h-directbench,
 * 2026-12-03: 8 writes in flight to a stream put 8 records of up to 34 KiB each in a batch).
 * The older write's reply waits for a ticket no later than the newer's, and a ticket is settled
 * only by a message that holds the whole rest of the batch (the file's comment), so it is
 * answered once the newer record is stored. */
static size_t waiting_record(const cl_part_t *p, const char *name, size_t name_len)
{
    for (size_t at = 0; p->len - at >= TD_STATE_RECORD_MIN;) {
        const uint8_t *r = p->buf + at;
        size_t size = tally_get_u32(r + 8); /* td_state_record.h: the size at 8, name length at
                                             * 13, the name at TD_STATE_RECORD_NAME_OFF */
        if (size < TD_STATE_RECORD_MIN || size > p->len - at)
            break; /* not one of ours: encoded here, whole */
        if (r[13] == name_len && memcmp(r + TD_STATE_RECORD_NAME_OFF, name, name_len) == 0)
            return at; /* at most one: each hold removes the one before it */
        at += size;
    }
    return p->len;
}

/* Under mu: the record of the write just applied to stream (NULL: removed), sized (out NULL)
 * or written (td_state_record_encode_next). */
static size_t encode_record(const tally_req_t *req, const td_stream_t *stream, bool replaces,
                            uint64_t now, uint8_t *out)
{
    if (!stream)
        return td_state_record_encode_removed(req->stream, req->stream_len, out);
    return td_state_record_encode_next(stream, now, replaces, out);
}

/* The record of a write to stream is encoded before the lock, on the shard's thread that owns
 * the stream (the bins and the CRC took most of the lock's hold: bench/NOTES.md, "Where a held
 * write waits"). Its form depends on whether it replaces a record of the stream still waiting in
 * the batch, which only the lock can tell: guessed from the batch that took the stream's last
 * record still filling, and encoded again under the lock when the guess was wrong (a batch
 * published meanwhile, or a rest of a batch cut in parts). */
bool td_changelog_hold(td_fleet_t *f, uint32_t k, const tally_req_t *req, td_stream_t *stream,
                       uint64_t *ticket)
{
    td_changelog_t *cl = f->cl;
    uint64_t now = td_clock_ms();
    cl_part_t *p = &cl->parts[k];
    uint8_t early[CL_RECORD_STACK];
    bool guess = stream && stream->cl_ticket ==
                               (uint32_t)atomic_load_explicit(&p->batch, memory_order_relaxed);
    size_t early_size = stream ? encode_record(req, stream, guess, now, NULL) : 0;
    bool encoded = early_size && early_size <= sizeof early;
    if (encoded)
        encode_record(req, stream, guess, now, early);
    pthread_mutex_lock(&cl->mu);
    *ticket = p->batch;
    size_t waiting = waiting_record(p, req->stream, req->stream_len);
    bool replaces = waiting < p->len;
    encoded &= replaces == guess;
    size_t size = encoded ? early_size : encode_record(req, stream, replaces, now, NULL);
    if (p->state == CL_OPEN && size > cl->max_msg) {
        char why[160];
        snprintf(why, sizeof why,
                 "a record of %zu bytes does not fit a message (max_payload %zu less %u for "
                 "headers)",
                 size, f->max_payload, TALLY_NATS_HEADROOM);
        td_cl_fail_locked(cl, k, why);
    }
    if (p->state == CL_OPEN && !grow(p, size))
        td_cl_fail_locked(cl, k, "out of memory for a record");
    if (p->state == CL_OPEN) {
        bool first = p->len == 0; /* due at once (an idle partition) or at its commit_ms */
        if (replaces) {
            size_t old = tally_get_u32(p->buf + waiting + 8);
            memmove(p->buf + waiting, p->buf + waiting + old, p->len - waiting - old);
            p->len -= old;
        }
        if (encoded)
            memcpy(p->buf + p->len, early, size);
        else
            encode_record(req, stream, replaces, now, p->buf + p->len);
        if (stream) {
            td_state_record_written(stream, replaces);
            stream->cl_ticket = (uint32_t)*ticket;
        }
        if (first)
            p->first_ms = td_nats_now_ms();
        td_cl_times_held(&p->times, first,
                         p->len < cl->commit_bytes && p->len + size >= cl->commit_bytes);
        p->len += size;
        p->writes++;
        if (first || p->len >= cl->commit_bytes)
            pthread_cond_signal(&cl->cond);
    }
    pthread_mutex_unlock(&cl->mu);
    return true; /* closed or failed: *ticket fails (fail_from is at most the batch filling) */
}

/* Under mu: whether partition p's ticket failed, and if not whether it waits (*pending). */
static bool failed_locked(const cl_part_t *p, uint64_t ticket, bool *pending)
{
    bool failed =
        (p->fail_from && ticket >= p->fail_from) || (ticket < p->open_from && ticket > p->ok_then);
    *pending = !failed && ticket > p->ok_upto;
    return failed;
}

/* The ticket from the low 32 bits the stream keeps: the batch filling is at most 2^32 past it
 * (0, stored, for a stream of no record of this member's). */
bool td_changelog_last(td_fleet_t *f, uint32_t k, const td_stream_t *stream, uint64_t *ticket)
{
    cl_part_t *p = &f->cl->parts[k];
    bool pending = false;
    pthread_mutex_lock(&f->cl->mu);
    *ticket = p->batch - (uint32_t)((uint32_t)p->batch - stream->cl_ticket);
    bool waits = failed_locked(p, *ticket, &pending) || pending;
    pthread_mutex_unlock(&f->cl->mu);
    return waits;
}

tally_status_t td_changelog_settled(td_fleet_t *f, uint32_t k, uint64_t ticket, bool *pending,
                                    char *msg, size_t cap)
{
    td_changelog_t *cl = f->cl;
    pthread_mutex_lock(&cl->mu);
    const cl_part_t *p = &cl->parts[k];
    bool failed = failed_locked(p, ticket, pending);
    if (!failed && !*pending)
        td_cl_times_released(&p->times, f->st, ticket);
    pthread_mutex_unlock(&cl->mu);
    if (!failed)
        return TALLY_OK;
    TD_FLEET_COUNT(f, not_durable);
    snprintf(msg, cap,
             "partition %u: the changelog record of this write was not stored (it may or may not "
             "survive this member); the partition is dropped: send it again with its seq",
             (unsigned)k);
    return TALLY_E_NOT_DURABLE;
}

/* ---- Life ------------------------------------------------------------------------------------ */

td_err_t td_changelog_open(td_fleet_t *f, const td_config_t *cfg)
{
    char msg[512];
    td_changelog_t *cl = calloc(1, sizeof *cl);
    if (!cl || !(cl->parts = calloc(f->partitions, sizeof *cl->parts))) {
        free(cl);
        return TD_ERR_NOMEM;
    }
    cl->f = f;
    cl->commit_ms = cfg->nats_commit_ms;
    cl->commit_when_idle = cfg->nats_commit_when_idle;
    cl->replicas = (int)cfg->nats_replicas;
    cl->max_age_ms = (int64_t)cfg->nats_partition_max_age_s * 1000;
    cl->max_msg = f->max_payload > 2 * TALLY_NATS_HEADROOM ? f->max_payload - TALLY_NATS_HEADROOM
                                                           : TALLY_NATS_HEADROOM;
    cl->commit_bytes = cl->max_msg < TD_NATS_COMMIT_BYTES ? cl->max_msg : TD_NATS_COMMIT_BYTES;
    for (uint32_t k = 0; k < f->partitions; k++)
        cl->parts[k].batch = 1;
    pthread_mutex_init(&cl->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&cl->cond, &ca);
    pthread_condattr_destroy(&ca);
    f->cl = cl;
    td_err_t err = TD_OK;
    jsOptions jo;
    jsOptions_Init(&jo);
    jo.Wait = TD_FLEET_JS_WAIT_MS;
    jo.PublishAsync.AckHandler = on_ack;
    jo.PublishAsync.AckHandlerClosure = cl;
    jo.PublishAsync.MaxPending = (int64_t)f->partitions * CL_DEPTH + 16;
    if (err == TD_OK &&
        (err = td_fleet_connect(f, "changelog", true, &cl->nc, msg, sizeof msg)) == TD_OK &&
        natsConnection_JetStream(&cl->js, cl->nc, &jo) != NATS_OK) {
        snprintf(msg, sizeof msg, "JetStream on the changelog's connection: %s",
                 td_nats_last_error(NATS_ERR));
        err = TD_ERR_LIBRARY;
    }
    if (err == TD_OK && pthread_create(&cl->thread, NULL, committer, cl) != 0) {
        snprintf(msg, sizeof msg, "cannot start the changelog's thread");
        err = TD_ERR_LIBRARY;
    }
    cl->started = err == TD_OK;
    if (err != TD_OK)
        td_err("fleet: %s", msg);
    return err;
}

void td_changelog_close(td_fleet_t *f)
{
    td_changelog_t *cl = f->cl;
    if (!cl)
        return;
    if (cl->started) {
        pthread_mutex_lock(&cl->mu);
        cl->stop = true;
        pthread_cond_signal(&cl->cond);
        pthread_mutex_unlock(&cl->mu);
        pthread_join(cl->thread, NULL);
    }
    jsCtx_Destroy(cl->js); /* no PubAck comes after this */
    natsConnection_Destroy(cl->nc);
    for (uint32_t k = 0; k < f->partitions; k++) {
        free(cl->parts[k].buf);
        td_cl_drop_flights(&cl->parts[k]);
    }
    free(cl->parts);
    pthread_cond_destroy(&cl->cond);
    pthread_mutex_destroy(&cl->mu);
    free(cl);
    f->cl = NULL;
}
