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
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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
/* JetStream's error code for a publish whose Nats-Expected-Last-Sequence is not the last. */
#define CL_WRONG_LAST_SEQUENCE 10071
/* A partition's messages in flight at once: its commit cycle is a PubAck's round trip, so one at
 * a time bounds a partition's replicated writes at what one message holds a round trip
 * (bench/NOTES.md, "What bounds `replicated` at 1 KiB"). */
#define CL_DEPTH 4
/* A partition whose last whole batch held this many writes or more is busy: its next batch
 * groups for commit_ms even when nothing is in flight (commit_when_idle; the file's comment). */
#define CL_BUSY_WRITES 4
/* A record up to this size is encoded on the shard's stack before the changelog's lock is taken
 * (td_changelog_hold); a larger one under it. */
#define CL_RECORD_STACK 8192
/* A take stores its fence against this many writers racing it before it gives up. */
#define CL_FENCE_TRIES 5
/* Replayed batches are applied on the loop this many bytes at a time (the shards held). */
#define CL_APPLY_BYTES (4u << 20)
/* A purge at a quiet point is sent only with this much of the owner's lease left by its own
 * clock, and its answer awaited no longer (td_changelog_compact says why). */
#define CL_PURGE_LEASE_MS 1000

typedef enum { CL_CLOSED = 0, CL_OPEN, CL_FAILED } cl_state_t;

/* A message published and not settled. */
typedef struct {
    uint64_t ticket;
    bool part;       /* it holds the batch's first records only: it settles nothing */
    int64_t sent_ms; /* its first publish (a resend keeps it: TD_FLEET_JS_WAIT_MS in all) */
    int64_t sent_ns; /* that publish handed to libnats: its ack stage starts */
    natsMsg *resend; /* answered, to publish again (an election): kept until then */
} cl_flight_t;

typedef struct {
    cl_state_t state;
    uint64_t epoch;
    uint64_t stored; /* the last sequence of this owner's chain (its fence's, then its acks) */
    uint8_t *buf;    /* the batch: records waiting to be published */
    size_t len, cap;
    int64_t first_ms;              /* when the batch's first record came (monotonic) */
    unsigned writes, last_writes;  /* held in the batch filling; in the last whole one */
    td_cl_times_t times;           /* where its held writes wait */
    _Atomic uint64_t batch;        /* the ticket of the batch now filling (changed under mu) */
    cl_flight_t flights[CL_DEPTH]; /* published, not settled: oldest first */
    unsigned nflights;
    unsigned nresend; /* of them, answered and kept to publish again at retry_ms */
    int64_t retry_ms;
    bool purging;       /* the stream is being purged: nothing is published meanwhile */
    uint64_t ok_upto;   /* tickets up to it were stored */
    uint64_t fail_from; /* tickets from it on failed (0: none) */
    /* At the last take: the tickets of earlier ownerships above ok_then were not stored. */
    uint64_t open_from, ok_then;
} cl_part_t;

struct td_changelog {
    td_fleet_t *f;
    natsConnection *nc;
    jsCtx *js; /* publishes asynchronously; its PubAcks come to on_ack */
    pthread_mutex_t mu;
    pthread_cond_t cond;
    pthread_t thread;
    bool started, stop;
    int64_t commit_ms;
    bool commit_when_idle; /* a batch goes at once when its partition has nothing in flight */
    int replicas;        /* of TALLY_CL<k> */
    int64_t max_age_ms;  /* how long a record is kept ([nats] partition_max_age_s) */
    size_t max_msg;      /* the records one message may hold (max_payload less the headers') */
    size_t commit_bytes; /* a batch this large goes at once (TD_NATS_COMMIT_BYTES, or max_msg) */
    cl_part_t *parts;
};

static void subject_of(char *out, size_t cap, uint32_t k)
{
    tally_fleet_name(out, cap, TALLY_NATS_SUBJ_CL, k);
}

static void stream_of(char *out, size_t cap, uint32_t k)
{
    tally_fleet_name(out, cap, TALLY_NATS_CL_STREAM_PREFIX, k);
}

/* ---- Settling ------------------------------------------------------------------------------ */

/* Under mu: forgets p's flights (failed, or of an ownership that ended). */
static void drop_flights(cl_part_t *p)
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
static void fail_locked(td_changelog_t *cl, uint32_t k, const char *why)
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
    drop_flights(p);
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
        fail_locked(cl, (uint32_t)k, why);
        pthread_cond_signal(&cl->cond);
    }
    pthread_mutex_unlock(&cl->mu);
    natsMsg_Destroy(m);
    td_path_wake_held(cl->f->host.path);
}

/* ---- Publishing (the committer thread) ------------------------------------------------------ */

static natsStatus add_headers(natsMsg *m, const td_fleet_t *f, uint64_t epoch, uint64_t ticket)
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
            fail_locked(cl, k, why);
        }
    }
}

/* The bytes at the front of buf (len > 0) to take as one piece of at most max: its whole
 * records that fit, the first always (a batch's never passes max_msg alone). A record whose
 * size does not fit what is left (a replayed message that is not well-formed) ends the piece,
 * or is the whole rest when it comes first: td_state_record_check refuses it there. */
static size_t records_within(const uint8_t *buf, size_t len, size_t max)
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
    subject_of(subject, sizeof subject, k);
    natsMsg *m = NULL;
    jsPubOptions po;
    publish_options(&po, p, p->nflights);
    size_t n = p->len > cl->max_msg ? records_within(p->buf, p->len, cl->max_msg) : p->len;
    natsStatus s = natsMsg_Create(&m, subject, NULL, (const char *)p->buf, (int)n);
    if (s == NATS_OK)
        s = add_headers(m, cl->f, p->epoch, p->batch);
    if (s == NATS_OK)
        s = js_PublishMsgAsync(cl->js, &m, &po);
    natsMsg_Destroy(m); /* NULL when the library took it */
    if (s != NATS_OK) {
        char why[256];
        snprintf(why, sizeof why, "a publish failed: %s", td_nats_last_error(s));
        fail_locked(cl, k, why);
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
            fail_locked(cl, k, "a publish was not acknowledged in time");
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
        fail_locked(cl, k, why);
    }
    if (p->state == CL_OPEN && !grow(p, size))
        fail_locked(cl, k, "out of memory for a record");
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
        j.len = records_within(j.buf, len - at, CL_APPLY_BYTES);
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
    stream_of(stream, sizeof stream, k);
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
    stream_of(stream, sizeof stream, k);
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
    subject_of(subject, sizeof subject, k);
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
        s = add_headers(m, f, epoch, 0);
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
    drop_flights(p);
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
    stream_of(stream, sizeof stream, k);
    subject_of(subject, sizeof subject, k);
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
        fail_locked(cl, k, "closed");
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
 * through the committer thread's publishes (publish_locked and retry_locked, under mu); the
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
    stream_of(stream, sizeof stream, k);
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
        fail_locked(cl, k, why);
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
        drop_flights(&cl->parts[k]);
    }
    free(cl->parts);
    pthread_cond_destroy(&cl->cond);
    pthread_mutex_destroy(&cl->mu);
    free(cl);
    f->cl = NULL;
}
