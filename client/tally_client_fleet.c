/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_client_fleet.c — a tally_client_t that sends each request straight to the member of a
 * tallyd fleet that owns its stream (tally_client_new_fleet, the CLI's --fleet; PROTOCOL.md §13
 * "Direct mode"), over ZeroMQ, instead of through JetStream.
 *
 * It is a transport (tally_transport.h), like tally_client_nats.c: the core reaches it only
 * through the table at the end of this file, and every program written against tally_send and
 * tally_recv works unchanged. Where to send: the stream's partition (tally_partition, the
 * published hash), its lease holder in TALLY_LEASES, the holder's ZeroMQ endpoint in
 * TALLY_ENDPOINTS, looked up once per partition and kept until a member says otherwise; one
 * plain libtally client per member, made when first needed. A request without a stream (ping,
 * info, stats) goes to partition 0's owner. `streams` is gathered from every owner (a member
 * lists only the streams it holds): each name kept from the member the routing names as its
 * partition's owner, the partitions whose owner did not answer counted in the reply's aux1 as
 * tally_client_nats.c does (tally_streams_missing).
 *
 * Every request in flight is kept (header and a copy of its payload) until its reply, so that
 * it can be sent again (below). A large payload's copy is the one sent: each send hands ZeroMQ
 * a reference to it (tally__send_zc_until, by_reference), the copy freed once the request is
 * answered and the last send is out, so it is copied once, as a plain client copies it. Sent
 * again:
 *   - a `not_owner` answer (nothing was run) is followed: sent again to the owner the answer
 *     names ("... at ENDPOINT"), up to TALLY_FLEET_HOPS times; one that names none (a member
 *     taking the partition over answers so until it holds it, and one that has lost it) goes
 *     to the owner the buckets name at the next check of the owners (every 4 polls), again and
 *     again within the timeout, which then says what the last such answer was;
 *   - a `shutdown` answer (a member stopping: nothing was run) waits for the partition's next
 *     owner and is sent there; so does a numbered request answered `not_durable` (replicated
 *     durability: run, its changelog record not stored, the partition given up), which the
 *     next owner applies only if what it loaded lacks it (an unnumbered one is answered so);
 *   - a request that cannot be sent because its owner's connection does not come up within
 *     TALLY_FLEET_SUSPECT_MS (the owner exited or was killed) is not waited on for the whole
 *     timeout: the routing is read again and it goes to the owner it names, or waits, unsent,
 *     for one whose connection is up (a member found down is not waited for again);
 *   - a request without an answer after TALLY_FLEET_SUSPECT_MS whose partition has changed
 *     owner (the old one was killed or cut off) is sent to the new owner when it is numbered
 *     (`seq`: the new owner applies it only if its checkpoint does not have it; exactly once) or
 *     reads only; any other is answered TALLY_E_TRANSPORT, since it may or may not have been
 *     applied.
 * A reply from a member for a request since sent elsewhere is dropped. A stream's requests reach
 * each member in the order they were first sent: one is not sent to a member while an earlier
 * one of its stream is with another member or waiting to be sent again; and a numbered one
 * answered `sequence_gap` while an earlier seq of its stream is unanswered here is not the
 * caller's gap but one the resends opened (a member taking the partition over answered the
 * earlier one `not_owner`, and this one once it held the partition): it is sent again after
 * that earlier one.
 *
 * Shared memory (tally_region_create, tally_send_shm, tally_call_shm on this client). A region
 * is a memfd made here and kept open; it is registered with a member (tally__region_register,
 * over that member's client's side channel) the first time a request naming it goes there, and
 * each send, first or followed, puts the handles of the member it goes to in the reference. A
 * member takes a region only when its TALLY_ENDPOINTS record names this host (host=, the boot
 * id: PROTOCOL.md §13) and a side channel (shm=): any other is answered TALLY_E_ARG saying which
 * member and why, not sent the bytes instead (an output region could not be filled that way,
 * and a producer that chose shared memory should learn that its data now crosses a network).
 * tally_region_destroy releases the region on every member it was registered with. Not
 * thread-safe.
 */
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <nats/nats.h>
#include <zmq.h>

#include "tally_proto.h"

#include "tally_client_fleet_int.h"
#include "tally_client_int.h"
#include "tally_client_nats.h"
#include "tally_fleet.h"
#include "tally_keys.h"
#include "tally_transport.h"

#define TALLY_FLEET_HOPS 8

/* A region registered with member m: its handle there, until tally_region_destroy. */
struct registration {
    struct registration *next;
    const tally_region_t *region;
    int m;
    uint64_t handle;
};

/* A request's payload, kept for its resends and sent by reference: one reference the pending
 * request's, one each send ZeroMQ has not finished (released on ZeroMQ's I/O thread). */
typedef struct {
    atomic_size_t refs; /* word-sized, first: its release store covers the word malloc wrote,
                         * as a race detector tracks it (tally_bufpool.c's header likewise) */
    _Alignas(max_align_t) uint8_t bytes[]; /* as malloc would align them */
} kept_payload_t;

static kept_payload_t *kept_of(uint8_t *bytes)
{
    return (kept_payload_t *)(void *)(bytes - offsetof(kept_payload_t, bytes));
}

static void kept_release(void *data, void *hint)
{
    (void)data;
    kept_payload_t *kp = hint;
    (void)atomic_load_explicit(&kp->refs, memory_order_acquire); /* td_reply.c's reply_freed */
    if (atomic_fetch_sub_explicit(&kp->refs, 1, memory_order_acq_rel) == 1)
        free(kp);
}

struct pending {
    struct pending *next;
    uint64_t id;       /* what the caller knows it by */
    int m;             /* the member it went to last; -1: waiting for an owner */
    uint64_t inner_id; /* that member's client's id for it */
    uint32_t k;
    int hops;
    bool waiting; /* answered `shutdown`, or its owner was lost: for the next owner */
    /* waiting, and sent again at the next check of the owners, not 1 s after its last send:
     * answered `not_owner` naming no owner (a member taking its partition over, or one that has
     * lost it), or `sequence_gap` with an earlier seq of its stream unanswered here */
    bool soon;
    int64_t sent_us;
    tally_req_t req;
    uint8_t *payload; /* a kept_payload_t's bytes, or NULL (len 0) */
    size_t len;
    const tally_region_t *in, *out; /* a shared-memory request's regions (in: NULL for none) */
    tally_shm_ref_t ref;            /* and its reference, handles 0: each send puts its member's */
    bool ready; /* answered here (`streams`, gathered): answer and status wait for tally_recv */
    tally_status_t status;
    tally_reply_t answer;
};

/* Whether p's payload goes by reference: one the size a plain client sends without zmq_send's
 * copy (TALLY_POOL_MIN_BYTES); a smaller one is copied as zmq_send copies it, and so is a
 * shared-memory reference, which each send rewrites with its member's handles. */
static bool by_reference(const pending_t *p)
{
    return p->len >= TALLY_POOL_MIN_BYTES && !p->in;
}

/* ---- Shared memory ------------------------------------------------------------------------ */

/* Whether member m may be handed a memfd from here: its TALLY_ENDPOINTS record names this host
 * and a side channel. TALLY_E_ARG, self->error saying which member and why, when not. */
static tally_status_t member_local(fleetc_t *self, int m)
{
    const member_t *o = &self->members[m];
    record_t r;
    tally__fleet_member_record(self, o->member, &r);
    const char *host = r.host, *shm = r.shm;
    char why[160];
    if (!host[0]) /* a tallyd older than host=, or one whose record has gone (it left) */
        snprintf(why, sizeof why, "publishes no host (host= in %s)", TALLY_NATS_BUCKET_ENDPOINTS);
    else if (strcmp(host, self->host) != 0)
        snprintf(why, sizeof why, "is on another host (host=%.40s; this one %.40s)", host,
                 self->host[0] ? self->host : "unknown");
    else if (!shm[0])
        snprintf(why, sizeof why, "offers no shared memory (its side channel is off)");
    else
        return TALLY_OK;
    set_msg(self->error,
            "shared memory through the fleet: member %s (%s) %s; send its streams' data as "
            "payloads (tally_send; tally without --shm)",
            o->member, o->endpoint, why);
    return TALLY_E_ARG;
}

/* Forgets every region registered with member m (its tallyd has gone with them). */
static void forget_member(fleetc_t *self, int m)
{
    for (registration_t **at = &self->regs; *at;) {
        registration_t *r = *at;
        if (r->m != m) {
            at = &r->next;
            continue;
        }
        *at = r->next;
        free(r);
    }
}

/* Member m's handle for region, registered there now when it is not yet, or no longer: a member
 * restarted at the same endpoint (its side connection closed) knows none of the old ones.
 * Member m's connection is waited for until deadline: TALLY_E_TIMEOUT when it is not up, as a
 * send's. */
static tally_status_t region_handle(fleetc_t *self, const tally_region_t *region, int m,
                                    int64_t deadline, uint64_t *handle)
{
    member_t *o = &self->members[m];
    for (registration_t *r = self->regs; r; r = r->next)
        if (r->region == region && r->m == m) {
            if (tally__side_closed(o->c)) {
                forget_member(self, m);
                break;
            }
            *handle = r->handle;
            return TALLY_OK;
        }
    if (region->fd < 0) {
        snprintf(self->error, sizeof self->error,
                 "shared memory through the fleet: the region was not made by this client "
                 "(tally_region_create on the fleet client)");
        return TALLY_E_ARG;
    }
    tally_status_t st = tally__wait_connected(o->c, deadline);
    if (st == TALLY_OK)
        st = member_local(self, m);
    else
        snprintf(self->error, sizeof self->error, "%s", tally_client_error(o->c));
    if (st != TALLY_OK)
        return st;
    registration_t *r = calloc(1, sizeof *r);
    if (!r) {
        snprintf(self->error, sizeof self->error, "out of memory");
        return TALLY_E_NOMEM;
    }
    st = tally__region_register(o->c, region, &r->handle);
    if (st != TALLY_OK) {
        snprintf(self->error, sizeof self->error, "registering a region with member %s: %s",
                 o->member, tally_client_error(o->c));
        free(r);
        /* no answer on its side channel is a failure, not a member found down */
        return st == TALLY_E_TIMEOUT ? TALLY_E_TRANSPORT : st;
    }
    *r = (registration_t){.next = self->regs, .region = region, .m = m, .handle = r->handle};
    self->regs = r;
    *handle = r->handle;
    return TALLY_OK;
}

/* p's reference, with member m's handles for its regions, into p->payload. */
static tally_status_t shm_bind(fleetc_t *self, pending_t *p, int m, int64_t deadline)
{
    tally_shm_ref_t ref = p->ref;
    tally_status_t st = region_handle(self, p->in, m, deadline, &ref.in_handle);
    if (st == TALLY_OK && p->out)
        st = region_handle(self, p->out, m, deadline, &ref.out_handle);
    if (st == TALLY_OK)
        tally_shm_ref_encode(&ref, p->payload);
    return st;
}

static void fleetc_region_release(tally__transport_t *base, const tally_region_t *region)
{
    fleetc_t *self = (fleetc_t *)base;
    for (registration_t **at = &self->regs; *at;) {
        registration_t *r = *at;
        if (r->region != region) {
            at = &r->next;
            continue;
        }
        tally__region_release(self->members[r->m].c, r->handle);
        *at = r->next;
        free(r);
    }
}

/* ---- Sending ------------------------------------------------------------------------------ */

/* p answered here with st and self->error: sent again to a member that cannot take its region,
 * it is not sent at all. */
static void answer_here(fleetc_t *self, pending_t *p, tally_status_t st)
{
    p->ready = true;
    p->m = -1;
    p->status = st;
    p->answer.rep = (tally_rep_t){.version = TALLY_PROTO_VERSION,
                                  .opcode = p->req.opcode,
                                  .request_id = p->id,
                                  .status = (uint32_t)st};
    set_msg(p->answer.error, "%s", self->error);
}

/* Sends p to member m. Its connection is waited for TALLY_FLEET_SUSPECT_MS at most (an owner
 * that has exited never comes back: the routing is asked again instead), and not at all while it
 * is known down; then nothing was sent, and p waits (TALLY_E_TIMEOUT) for the routing to name
 * an owner whose connection is up (check_owners). */
static tally_status_t send_to(fleetc_t *self, pending_t *p, int m)
{
    member_t *to = &self->members[m];
    p->m = m;
    p->waiting = p->soon = false;
    p->sent_us = now_us();
    int64_t deadline = p->sent_us + (to->down ? 0 : (int64_t)tally__fleet_probe_ms(self) * 1000);
    tally_status_t st = p->in ? shm_bind(self, p, m, deadline) : TALLY_OK;
    if (st != TALLY_OK && st != TALLY_E_TIMEOUT) { /* its region cannot go there */
        answer_here(self, p, st);
        return st;
    }
    if (st == TALLY_OK && by_reference(p)) {
        kept_payload_t *kp = kept_of(p->payload);
        atomic_fetch_add_explicit(&kp->refs, 1, memory_order_release);
        st = tally__send_zc_until(to->c, &p->req, p->payload, p->len, kept_release, kp,
                                  &p->inner_id, deadline);
    } else if (st == TALLY_OK) {
        st = tally__send_until(to->c, &p->req, p->payload, p->len, &p->inner_id, deadline);
    }
    to->down = st == TALLY_E_TIMEOUT;
    if (st != TALLY_OK)
        snprintf(self->error, sizeof self->error, "%s", tally_client_error(to->c));
    if (st == TALLY_E_TIMEOUT) {
        p->m = -1;
        p->waiting = true;
    }
    return st;
}

static void unlink_pending(fleetc_t *self, pending_t *p)
{
    for (pending_t **at = &self->head; *at; at = &(*at)->next)
        if (*at == p) {
            *at = p->next;
            if (self->tail == &p->next)
                self->tail = at;
            break;
        }
    if (p->payload)
        kept_release(NULL, kept_of(p->payload));
    free(p);
}

/* Whether q and p are requests of one stream. */
static bool same_stream(const pending_t *q, const pending_t *p)
{
    return q->k == p->k && q->req.stream_len == p->req.stream_len &&
           memcmp(q->req.stream, p->req.stream, p->req.stream_len) == 0;
}

/* Whether p, sent to member m now, could reach it ahead of an earlier request of its stream:
 * one still with another member, or waiting to be sent again (a stream's requests go to a
 * member in the order they were first sent; one ahead of an earlier seq would be refused
 * `sequence_gap`). */
static bool behind_earlier(const fleetc_t *self, const pending_t *p, int m)
{
    if (!p->req.stream_len)
        return false;
    for (const pending_t *q = self->head; q && q != p; q = q->next)
        if (!q->ready && (q->m != m || q->waiting) && same_stream(q, p))
            return true;
    return false;
}

/* Whether an earlier numbered request of p's stream is unanswered here: a `sequence_gap` for p
 * is then one this client's own resends opened (an owner that answered the earlier one
 * `not_owner` while taking the partition over, and p once it had), not the caller's. */
static bool gap_is_ours(const fleetc_t *self, const pending_t *p)
{
    for (const pending_t *q = self->head; q && q != p; q = q->next)
        if (!q->ready && q->req.seq && q->req.seq < p->req.seq && same_stream(q, p))
            return true;
    return false;
}

/* p sent to member m, or, when an earlier request of its stream is not there yet, kept for a
 * check of the owners within tally_recv (TALLY_OK). */
static tally_status_t send_in_order(fleetc_t *self, pending_t *p, int m)
{
    if (!behind_earlier(self, p, m))
        return send_to(self, p, m);
    p->m = -1;
    p->waiting = true;
    return TALLY_OK;
}

/* ---- `streams`, gathered ------------------------------------------------------------------ */

/* Member m's streams of the partitions owner[] says it owns, appended to out (tallyd's own
 * layout: a length byte, then the name) and counted in *count; false when m did not answer (its
 * connection not up within a probe, or no reply) or out could not grow. */
static bool gather_member(fleetc_t *self, int m, const int *owner, tally_buf_t *out,
                          uint64_t *count)
{
    member_t *o = &self->members[m];
    o->down = tally__wait_connected(o->c, tally__fleet_probe_deadline(self, o)) == TALLY_E_TIMEOUT;
    char **names = NULL;
    size_t n = 0;
    if (o->down || tally_streams(o->c, &names, &n) != TALLY_OK)
        return false;
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++) {
        size_t l = strlen(names[i]);
        if (owner[tally_partition(names[i], l, self->partitions)] != m)
            continue; /* held, not owned (a hand-over's leftover): its owner lists it */
        ok = tally_buf_reserve(out, 1 + l) == TALLY_OK; /* then neither append can fail */
        if (ok) {
            uint8_t l8 = (uint8_t)l;
            tally_buf_append(out, &l8, 1);
            tally_buf_append(out, names[i], l);
            ++*count;
        }
    }
    tally_strings_free(names, n);
    return ok;
}

/* p (a `streams`) answered here: every owner's streams into p->answer, as one tallyd's reply. */
static tally_status_t gather_streams(fleetc_t *self, pending_t *p)
{
    int owner[TALLY_NATS_MAX_PARTITIONS];
    bool asked[TALLY_FLEET_MEMBERS_MAX] = {false}, answered[TALLY_FLEET_MEMBERS_MAX] = {false};
    for (uint32_t k = 0; k < self->partitions; k++)
        owner[k] = tally__fleet_owner_now(self, k);
    tally_buf_t out = {0};
    uint64_t count = 0, missing = 0;
    for (uint32_t k = 0; k < self->partitions; k++) {
        int m = owner[k];
        if (m >= 0 && !asked[m]) {
            asked[m] = true;
            answered[m] = gather_member(self, m, owner, &out, &count);
        }
        missing += m < 0 || !answered[m];
    }
    tally_reply_t *r = &p->answer;
    if ((!out.data && !(out.data = malloc(1))) ||
        tally__reply_take(r, out.data, out.len) != TALLY_OK)
        return TALLY_E_NOMEM;
    r->rep = (tally_rep_t){.version = TALLY_PROTO_VERSION,
                           .opcode = TALLY_OP_STREAMS,
                           .request_id = p->id,
                           .aux0 = count,
                           .aux1 = missing};
    p->ready = true;
    p->m = -1; /* no member's reply is its */
    p->status = TALLY_OK;
    return TALLY_OK;
}

/* A request, kept until its reply: with the regions in and out (NULL: a payload's) its payload
 * is their reference, which each send fills in with its member's handles. */
static tally_status_t send_new(fleetc_t *self, const tally_req_t *req, const void *payload,
                               size_t len, const tally_region_t *in, const tally_region_t *out,
                               uint64_t *request_id, char *error, size_t cap)
{
    pending_t *p = calloc(1, sizeof *p);
    kept_payload_t *kp = len ? malloc(sizeof *kp + len) : NULL;
    if (!p || (len && !kp)) {
        free(p);
        free(kp);
        snprintf(error, cap, "out of memory");
        return TALLY_E_NOMEM;
    }
    if (len) {
        atomic_store_explicit(&kp->refs, 1, memory_order_release);
        memcpy(kp->bytes, payload, len);
        /* Stored (release) after the bytes: ZeroMQ's I/O thread, which may release the last
         * reference, reads it (acquire) after a hand-off a race detector cannot see. */
        atomic_store_explicit(&kp->refs, 1, memory_order_release);
        p->payload = kp->bytes;
    }
    p->len = len;
    p->in = in;
    p->out = out;
    if (in) /* the core's encoding: it cannot fail */
        (void)tally_shm_ref_decode(payload, len, &p->ref, NULL, 0);
    p->req = *req;
    p->id = ++self->next_id;
    p->k = req->stream_len ? tally_partition(req->stream, req->stream_len, self->partitions) : 0;
    *self->tail = p;
    self->tail = &p->next;
    if (req->opcode == TALLY_OP_STREAMS) {
        tally_status_t st = gather_streams(self, p);
        if (st != TALLY_OK) {
            snprintf(error, cap, "out of memory");
            unlink_pending(self, p);
        } else if (request_id) {
            *request_id = p->id;
        }
        return st;
    }
    int m = self->owner[p->k];
    if (m < 0)
        m = self->owner[p->k] =
            tally__fleet_owner_until(self, p->k, now_us() + (int64_t)self->timeout_ms * 1000);
    tally_status_t st = m >= 0             ? send_in_order(self, p, m)
                        : self->refused[0] ? TALLY_E_ARG /* its keys: no wait mends them */
                                           : TALLY_E_TIMEOUT;
    if (st == TALLY_E_TIMEOUT && m >= 0) { /* its owner's connection is down: who owns it now */
        int now = tally__fleet_owner_now(self, p->k);
        if (now >= 0 && now != m)
            st = send_in_order(self, p, self->owner[p->k] = now);
        if (st == TALLY_E_TIMEOUT)
            st = TALLY_OK; /* not sent: waits for an owner that is up, within tally_recv */
    }
    if (st != TALLY_OK) {
        snprintf(error, cap, "%s", self->error);
        unlink_pending(self, p);
        return st;
    }
    if (request_id)
        *request_id = p->id;
    return TALLY_OK;
}

static tally_status_t fleetc_send(tally__transport_t *base, const tally_req_t *req,
                                  const void *payload, size_t len, uint64_t *request_id,
                                  char *error, size_t cap)
{
    return send_new((fleetc_t *)base, req, payload, len, NULL, NULL, request_id, error, cap);
}

static size_t fleetc_shm_max_batch(tally__transport_t *base, const tally_req_t *req,
                                   const tally_region_t *in)
{
    fleetc_t *self = (fleetc_t *)base;
    uint32_t k =
        req->stream_len ? tally_partition(req->stream, req->stream_len, self->partitions) : 0;
    int64_t deadline = now_us() + (int64_t)self->timeout_ms * 1000;
    int m = tally__fleet_owner_up(self, k, deadline);
    uint64_t handle = 0;
    if (m < 0 || region_handle(self, in, m, deadline, &handle) != TALLY_OK)
        return 0; /* the send that follows fails, or finds the owner, and says so */
    return self->members[m].c->max_batch;
}

static tally_status_t fleetc_send_shm(tally__transport_t *base, const tally_req_t *req,
                                      const uint8_t *ref, const tally_region_t *in,
                                      const tally_region_t *out, uint64_t *request_id, char *error,
                                      size_t cap)
{
    return send_new((fleetc_t *)base, req, ref, TALLY_SHM_REF_SIZE, in, out, request_id, error,
                    cap);
}

/* ---- Receiving ---------------------------------------------------------------------------- */

/* The operations that only read: asked again of a new owner whatever they carry. */
static const bool reads_only[TALLY_OP_COUNT] = {[TALLY_OP_QUERY] = true,
                                                [TALLY_OP_PING] = true,
                                                [TALLY_OP_INFO] = true,
                                                [TALLY_OP_STATS] = true,
                                                [TALLY_OP_STREAMS] = true,
                                                [TALLY_OP_MINMAX] = true};

/* Whether req changes no state: a reading operation, or a batch without a stream (a filter, a
 * scan or a hist of the batch alone; PROTOCOL.md §13, "an unnumbered write"). */
static bool changes_nothing(const tally_req_t *req)
{
    return reads_only[req->opcode] || req->stream_len == 0;
}

/* p answered st here with why into reply (true), and forgotten. */
static bool answer_now(fleetc_t *self, pending_t *p, tally_status_t st, const char *why,
                       tally_reply_t *reply, tally_status_t *status)
{
    reply->rep.request_id = p->id;
    reply->rep.opcode = p->req.opcode;
    set_msg(reply->error, "%s", why);
    unlink_pending(self, p);
    *status = st;
    return true;
}

/* Requests whose owner may have changed: sent to the new one (or failed, when they may have
 * been applied and carry no seq), oldest first: a stream's numbered requests reach the new owner
 * in their order (one sent ahead of an earlier seq would be refused `sequence_gap`). A request
 * whose partition's owner is now a member this client refuses (its keys, or past
 * TALLY_FLEET_MEMBERS_MAX) is answered TALLY_E_ARG, as a send to that owner is: no wait mends
 * it. A request that cannot be sent is answered with its failure into reply (true). */
static bool check_owners(fleetc_t *self, tally_reply_t *reply, tally_status_t *status)
{
    int64_t now = now_us();
    if (now - self->checked_us < TALLY_FLEET_POLL_MS * 4 * 1000)
        return false;
    self->checked_us = now;
    int seen[TALLY_NATS_MAX_PARTITIONS]; /* each partition's owner, read once a check: -2 not yet */
    for (uint32_t k = 0; k < self->partitions; k++)
        seen[k] = -2;
    for (pending_t *p = self->head; p; p = p->next) {
        if (p->ready || (!p->waiting && now - p->sent_us < TALLY_FLEET_SUSPECT_MS * 1000))
            continue;
        if (seen[p->k] == -2) {
            seen[p->k] = tally__fleet_owner_now(self, p->k);
            if (seen[p->k] < 0 && self->refused[0]) { /* the next send asks the buckets too */
                self->owner[p->k] = -1;
                return answer_now(self, p, TALLY_E_ARG, self->refused, reply, status);
            }
        }
        int m = seen[p->k];
        bool moved = m != p->m, late = now - p->sent_us >= TALLY_FLEET_SUSPECT_MS * 1000;
        if (m < 0 || (!moved && (!p->waiting || !(late || p->soon))))
            continue; /* no owner yet, or the same one: slow, not gone (a waiting one: later) */
        if (!p->waiting && !p->req.seq && !changes_nothing(&p->req)) { /* sent: a known op */
            char why[TALLY_ERROR_MESSAGE_MAX + 1];
            set_msg(why,
                    "partition %u changed owner (%s) before answering; this request has no seq, "
                    "so it is not sent again: it may or may not have been applied",
                    (unsigned)p->k, self->members[m].member);
            return answer_now(self, p, TALLY_E_TRANSPORT, why, reply, status);
        }
        if (behind_earlier(self, p, m))
            continue; /* once the earlier ones of its stream are there */
        self->owner[p->k] = m;
        if (send_to(self, p, m) != TALLY_OK && !p->ready)
            p->waiting = true; /* tried again at the next check (a member down: at no cost) */
    }
    return false;
}

/* The reply r from member m: handed to the caller (true), or followed and dropped. */
static bool take_reply(fleetc_t *self, int m, tally_status_t st, tally_reply_t *r)
{
    pending_t *p = self->head;
    while (p && !(p->m == m && p->inner_id == r->rep.request_id))
        p = p->next;
    if (!p)
        return false; /* a request since sent elsewhere */
    if (st == TALLY_E_NOT_OWNER && p->hops < TALLY_FLEET_HOPS) {
        int to = self->owner[p->k] = tally__fleet_named_owner(self, r->error);
        if (to < 0) { /* no hop: the buckets say where at the next check, within the timeout */
            set_msg(self->unowned, "%s", r->error);
            p->waiting = p->soon = true;
            return false;
        }
        p->hops++;
        if (send_in_order(self, p, to) != TALLY_OK && !p->ready)
            p->waiting = true; /* the buckets say where, at the next check */
        return false;
    }
    if (st == TALLY_E_SEQ_GAP && p->req.seq && gap_is_ours(self, p)) {
        p->waiting = p->soon = true; /* not run: sent again after the earlier seq */
        return false;
    }
    if (st == TALLY_E_SHUTDOWN || (st == TALLY_E_NOT_DURABLE && p->req.seq)) {
        /* not run, or run and not stored (the member gives the partition up): for the
         * partition's next owner, which applies a numbered one only if it lacks it */
        p->waiting = true;
        return false;
    }
    r->rep.request_id = p->id;
    unlink_pending(self, p);
    self->unowned[0] = '\0';
    return true;
}

/* A request answered here (`streams`, or one whose region its new owner cannot take) into
 * reply: true, its status in *status. */
static bool take_ready(fleetc_t *self, tally_reply_t *reply, tally_status_t *status)
{
    for (pending_t *p = self->head; p; p = p->next)
        if (p->ready) {
            *reply = p->answer;
            tally_reply_init(&p->answer);
            *status = p->status;
            unlink_pending(self, p);
            return true;
        }
    return false;
}

static tally_status_t fleetc_recv(tally__transport_t *base, int timeout_ms, tally_reply_t *reply)
{
    fleetc_t *self = (fleetc_t *)base;
    tally_reply_clear(reply);
    int64_t deadline = now_us() + (int64_t)timeout_ms * 1000;
    zmq_pollitem_t items[TALLY_FLEET_MEMBERS_MAX];
    tally_status_t st = TALLY_OK;
    while (self->head) {
        if (take_ready(self, reply, &st))
            return st;
        for (int i = 0; i < self->count; i++)
            items[i] = (zmq_pollitem_t){.socket = self->members[i].c->sock, .events = ZMQ_POLLIN};
        zmq_poll(items, self->count, TALLY_FLEET_POLL_MS);
        for (int i = 0; i < self->count; i++) {
            if (!(items[i].revents & ZMQ_POLLIN))
                continue;
            st = tally_recv(self->members[i].c, reply);
            if (take_reply(self, i, st, reply))
                return st;
            tally_reply_clear(reply);
        }
        if (check_owners(self, reply, &st))
            return st;
        if (now_us() >= deadline) {
            set_msg(reply->error, "no reply from the fleet within %d ms%s%s%s", timeout_ms,
                    self->unowned[0] ? " (the last answer: not_owner, " : "", self->unowned,
                    self->unowned[0] ? ")" : "");
            return TALLY_E_TIMEOUT;
        }
    }
    set_msg(reply->error, "no request in flight");
    return TALLY_E_TIMEOUT;
}

static size_t fleetc_chunk_limit(const tally__transport_t *base, const tally_req_t *req)
{
    (void)base;
    (void)req;
    return SIZE_MAX; /* ZeroMQ: the caller's chunks, as a plain client's */
}

static tally_status_t fleetc_last_seq(tally__transport_t *base, const char *stream, uint64_t *last,
                                      char *error, size_t cap)
{
    fleetc_t *self = (fleetc_t *)base;
    uint32_t k = tally_partition(stream, strlen(stream), self->partitions);
    tally_stream_info_t info;
    tally_status_t st = TALLY_E_NOT_OWNER;
    const char *why = "";
    for (int hop = 0; st == TALLY_E_NOT_OWNER && hop <= TALLY_FLEET_HOPS; hop++) {
        int m = tally__fleet_owner_up(self, k, now_us() + (int64_t)self->timeout_ms * 1000);
        if (m < 0) {
            snprintf(error, cap, "%s", self->error);
            return self->refused[0] ? TALLY_E_ARG : TALLY_E_TIMEOUT;
        }
        st = tally_query(self->members[m].c, stream, &info);
        why = tally_client_error(self->members[m].c);
        if (st == TALLY_E_NOT_OWNER) /* the owner it names, else the buckets' at the next turn */
            self->owner[k] = tally__fleet_named_owner(self, why);
    }
    *last = st == TALLY_OK ? info.last_seq : 0;
    if (st == TALLY_E_UNKNOWN_STREAM) /* a stream's first push */
        return TALLY_OK;
    if (st != TALLY_OK)
        snprintf(error, cap, "%s", why);
    return st;
}

static void fleetc_destroy(tally__transport_t **self_p)
{
    fleetc_t *self = (fleetc_t *)*self_p;
    while (self->head) {
        tally_reply_clear(&self->head->answer);
        unlink_pending(self, self->head);
    }
    for (int i = 0; i < self->count; i++)
        tally_client_destroy(&self->members[i].c);
    kvStore_Destroy(self->leases);
    kvStore_Destroy(self->endpoints);
    tally_nats_destroy(&self->nats);
    explicit_bzero(&self->keys, sizeof self->keys);
    free(self);
    *self_p = NULL;
}

static const tally__transport_ops_t fleetc_ops = {
    .name = "the fleet's direct mode",
    .send = fleetc_send,
    .recv = fleetc_recv,
    .chunk_limit = fleetc_chunk_limit,
    .last_seq = fleetc_last_seq,
    .send_shm = fleetc_send_shm,
    .region_release = fleetc_region_release,
    .shm_max_batch = fleetc_shm_max_batch,
    .destroy = fleetc_destroy,
};

/* NATS (tally_nats_new: the connection and the partition count) and the two buckets. */
static tally_status_t fleetc_connect(fleetc_t *self, const tally_nats_opts_t *opts, char *msg,
                                     size_t cap)
{
    tally_nats_opts_t o = *opts;
    o.timeout_ms = self->timeout_ms;
    tally_status_t st = tally_nats_new(&o, &self->nats, msg, cap);
    if (st != TALLY_OK)
        return st;
    self->partitions = tally_nats_partitions(self->nats);
    /* no boot id: host stays "" and no member is known to share this host */
    (void)tally_fleet_host_id(self->host, sizeof self->host);
    jsCtx *js = tally__nats_js(self->nats);
    natsStatus s = js_KeyValue(&self->leases, js, TALLY_NATS_BUCKET_LEASES);
    if (s == NATS_OK)
        s = js_KeyValue(&self->endpoints, js, TALLY_NATS_BUCKET_ENDPOINTS);
    if (s == NATS_NOT_FOUND) {
        snprintf(msg, cap,
                 "no tallyd fleet in direct mode on this NATS (%s, %s: %s): start a worker "
                 "with [nats] direct = local first",
                 TALLY_NATS_BUCKET_LEASES, TALLY_NATS_BUCKET_ENDPOINTS, natsStatus_GetText(s));
        return TALLY_E_ARG;
    }
    if (s != NATS_OK) { /* the buckets may be there: say what failed, not that they are not */
        const char *text = NULL;
        natsConnection *nc = tally__nats_conn(self->nats);
        bool denied = natsConnection_GetLastError(nc, &text) == NATS_NOT_PERMITTED && text;
        snprintf(msg, cap, "looking up %s and %s: %s%s%s", TALLY_NATS_BUCKET_LEASES,
                 TALLY_NATS_BUCKET_ENDPOINTS, natsStatus_GetText(s),
                 denied ? ": the NATS server refused it: " : "", denied ? text : "");
        return TALLY_E_TRANSPORT;
    }
    return TALLY_OK;
}

tally_status_t tally_client_new_fleet(const tally_nats_opts_t *opts, tally_client_t **out,
                                      char *msg, size_t msg_cap)
{
    return tally_client_new_fleet_curve(opts, NULL, out, msg, msg_cap);
}

tally_status_t tally_client_new_fleet_curve(const tally_nats_opts_t *opts,
                                            const tally_curve_keys_t *keys, tally_client_t **out,
                                            char *msg, size_t msg_cap)
{
    if (!out || !opts)
        return TALLY_E_ARG;
    *out = NULL;
    if (keys && keys->server_public[0] && !keys->client_secret[0]) { /* as the loader says */
        if (msg && msg_cap)
            snprintf(msg, msg_cap, "a server key is set but no client key: a fleet member's "
                                   "key is used with the client's key pair");
        return TALLY_E_ARG;
    }
    fleetc_t *self = calloc(1, sizeof *self);
    if (!self)
        return TALLY_E_NOMEM;
    self->base.ops = &fleetc_ops;
    self->tail = &self->head;
    for (uint32_t k = 0; k < TALLY_NATS_MAX_PARTITIONS; k++)
        self->owner[k] = -1;
    self->timeout_ms = opts->timeout_ms > 0 ? opts->timeout_ms : TALLY_DEFAULT_TIMEOUT_MS;
    if (keys && keys->client_secret[0])
        self->keys = *keys;
    char why[512] = "";
    tally__transport_t *transport = &self->base;
    tally_status_t st = fleetc_connect(self, opts, why, sizeof why);
    if (st == TALLY_OK)
        st = tally__client_new_transport(transport, self->timeout_ms, out);
    if (st != TALLY_OK) {
        if (msg && msg_cap)
            snprintf(msg, msg_cap, "%s", why[0] ? why : "out of memory");
        fleetc_destroy(&transport);
    }
    return st;
}
