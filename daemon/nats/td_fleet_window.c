/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_window.c — a partition's messages applied through the request path on this worker
 * (PROTOCOL.md §13 "Exactly once across crashes"), its window: each taken from its reader in
 * sequence order (one at or below the last one taken is skipped), checked (a failing one becomes
 * a dead letter), sent to the request path and retired once its reply came; and the partition's
 * step (td_part_step), which starts a checkpoint when one is due. Taking, checkpointing and giving
 * up the partition are td_fleet_part.c's; what the two share, td_part_int.h.
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
 * Who published a message is the user its subject names (tally.in.<k>.<user>), which the
 * server's permissions let only that user publish to; never a header the producer writes. A
 * message whose Tally-Reply is not one of that user's inboxes, or whose dedupe id is not in its
 * namespace, is refused (not_permitted: a dead letter, no reply anywhere, counted and logged):
 * the worker's own rights never carry a reply onto a subject its publisher may not use
 * (PROTOCOL.md §13 "Security").
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_fleet_changelog.h"
#include "td_fleet_int.h"
#include "td_fleet_route.h"
#include "td_log.h"
#include "td_monotonic.h"
#include "td_nats_consumer.h"
#include "td_nats_js.h"
#include "td_part_int.h"

static void resend(td_fleet_t *f, td_part_t *p);

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
void td_win_entry_release(td_win_entry_t *e)
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
    *payload =
        (td_bytes_t){.data = len ? (void *)(natsMsg_GetData(e->msg) + TALLY_REQ_HEADER_SIZE) : NULL,
                     .len = len,
                     .free_fn = msg_ref_release,
                     .hint = e->ref};
    return true;
}

/* Empties the window: what is in the request path is forgotten (its reply, when it comes,
 * finds no slot; the path lets its messages go when it is done with them). */
void td_part_forget_window(td_fleet_t *f, td_part_t *p)
{
    for (size_t i = 0; i < p->win_len; i++) {
        td_win_entry_t *e = &p->win[(p->win_first + i) % f->inflight];
        if (e->state == WIN_SENT)
            memset(&f->pend[e->slot], 0, sizeof f->pend[e->slot]);
        td_win_entry_release(e);
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
bool td_part_applied_above_refused(const td_fleet_t *f, const td_part_t *p)
{
    for (size_t i = 0; i < p->win_len; i++)
        if (p->win[(p->win_first + i) % f->inflight].state == WIN_DONE)
            return true; /* the head is never WIN_DONE: it would have been retired */
    return false;
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
        td_win_entry_release(e);
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
    if (h->to && reply + TALLY_REP_HEADER_SIZE > f->max_payload - TALLY_NATS_HEADROOM) {
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
    if (seq > p->high_seq + 1 && !td_part_accept_gap(f, p, seq)) {
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
    if (p->taking && !td_part_take_step(f, p, &acted))
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
