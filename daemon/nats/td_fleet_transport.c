/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_transport.c — the fleet's two ways into the daemon:
 *
 *   - the request path, as a transport (core/td_transport.h). With shard threads (issue 32) the
 *     fleet thread is a port of the path (td_path_port_open): its own front, which hands each
 *     request (its request id replaced by a tag naming its pending slot; a partition's message
 *     not copied, as below) straight to its stream's shard in the port's batch for that shard,
 *     posted once a turn (td_fleet_path_flush, before it waits for anything), and takes the
 *     shards' replies from the port's mailbox as they were made (td_fleet_path_poll: the body
 *     read in place, no queue item, no copy). A reply posted while the fleet thread sleeps
 *     writes its eventfd (the port's wake-up; td_path_port_sleep, last before its poll, says
 *     whether it may sleep), one posted while it works writes nothing. The loop thread is out
 *     of the way of every message: it was a whole hop each way and the busiest thread of a
 *     worker (bench/NOTES.md, "A pinned worker's wake-ups"). At max_inflight the port takes
 *     nothing (TD_ERR_BUSY) and the requests wait in the fleet thread's queue, in order, for
 *     the next flush; once the path reads nothing more the port answers them `shutdown` itself.
 *     A request is sent through the port with no queue item at all when nothing waits before
 *     it (td_fleet_path_send_shared).
 *     With one shard (everything runs on the loop thread) the fleet thread queues a request
 *     frame (its request id replaced by a tag naming its pending slot; a partition's message is
 *     not copied: its payload shares the NATS message, which goes once both the window and the
 *     path let go of it, since the partition may be dropped while the request runs; a query's
 *     payload is copied into its queue item's allocation) and the loop submits it with
 *     td_path_submit as tallyd's own request (no sender id: the fleet's streams are held to the
 *     daemon's limits, not to one client's share), or, while the path takes nothing
 *     (td_path_may_read), holds it until replies free slots. Every reply comes back through
 *     send_reply on the loop thread: its payload bytes are kept, not copied (they stay counted
 *     in the reply bounds until the fleet thread frees them), and handed to the fleet thread;
 *   - through the loop (one shard), both directions in batches (issue 32), as the request path's
 *     mailboxes do (td_mailbox.h): the fleet thread collects what one turn of its loop sends and
 * posts it with one lock and one wake-up of the loop (td_fleet_path_flush, before it waits for
 * anything), and the loop collects the replies of one turn of its own and posts them with one lock
 * and one write of the eventfd the readers also write (its prepare and check handles: never across
 * a blocking poll). Per message, then, no system call and no lock on either side;
 *   - the loop thread, through the fleet's uv_async handle: td_fleet_on_loop posts a job and
 *     waits, for the work on the stream table that only the loop thread may do (restores,
 *     snapshots, deletes, with the shards held). It flushes the fleet thread's requests first,
 *     through the port or the loop's queue, so that the job comes after them, as before.
 *
 * Stopping (core/td_path_port.c says the path's side): the port's requests count in the path's
 * in-flight total, so the server closes the path only once none is in flight; what the fleet
 * sends after that (its give-ups as it leaves) the port answers `shutdown`, and
 * td_fleet_query_finish answers what is left. The port is closed with the rest here
 * (td_fleet_path_close), after the loop has ended and the shards' threads with it.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "td_fleet_int.h"
#include "td_log.h"
#include "td_path.h"

/* A request waiting for the loop, its payload in the same allocation (data): the path frees the
 * whole item through the payload's free function once it has submitted it. */
typedef struct td_fleet_sub {
    struct td_fleet_sub *next;
    uint8_t header[TALLY_REQ_HEADER_SIZE]; /* its request id is the tag */
    bool decoded;                          /* req is the header decoded (a partition's message) */
    bool body_unwanted;                    /* td_msg_t's: its message names no Tally-Reply */
    tally_req_t req;
    td_bytes_t payload; /* data, or empty */
    uint8_t data[];
} sub_item_t;

/* A reply waiting for the fleet thread. */
typedef struct td_fleet_rep {
    struct td_fleet_rep *next;
    uint8_t header[TALLY_REP_HEADER_SIZE];
    td_bytes_t body;
} rep_item_t;

static void free_bytes(void *data, void *hint)
{
    (void)hint;
    free(data);
}

/* A sub item's payload: the item goes with it. */
static void free_item(void *data, void *hint)
{
    (void)data;
    free(hint);
}

/* Frees a sub item not submitted (with its payload). */
static void sub_free(sub_item_t *s)
{
    bool in_payload = s->payload.free_fn == free_item;
    td_bytes_free(&s->payload); /* in_payload: the item too */
    if (!in_payload)
        free(s);
}

/* The message a sub item hands the path. */
static td_msg_t sub_msg(sub_item_t *s)
{
    return (td_msg_t){.header = s->header,
                      .header_len = sizeof s->header,
                      .req = s->decoded ? &s->req : NULL,
                      .body_unwanted = s->body_unwanted,
                      .payload = s->payload,
                      .frames = 2};
}

/* ---- Loop thread ---------------------------------------------------------------------------- */

static void wake_fleet(td_fleet_t *f)
{
    uint64_t one = 1;
    ssize_t n = write(f->wake_fd, &one, sizeof one);
    (void)n; /* the counter is at most saturated: the thread wakes anyway */
}

/* A shard's thread: replies posted to the fleet's port while the fleet thread sleeps. */
static void wake_port(void *ctx)
{
    wake_fleet(ctx);
}

/* A reply for the fleet thread, collected until the loop's turn ends (flush_replies). */
static void queue_reply(td_fleet_t *f, rep_item_t *item)
{
    item->next = NULL;
    if (f->rep_out_tail)
        f->rep_out_tail->next = item;
    else
        f->rep_out_head = item;
    f->rep_out_tail = item;
}

/* The replies of this turn of the loop to the fleet thread: one lock, one wake-up. */
static void flush_replies(td_fleet_t *f)
{
    if (!f->rep_out_head)
        return;
    pthread_mutex_lock(&f->q_mu);
    if (f->rep_tail)
        f->rep_tail->next = f->rep_out_head;
    else
        f->rep_head = f->rep_out_head;
    f->rep_tail = f->rep_out_tail;
    pthread_mutex_unlock(&f->q_mu);
    f->rep_out_head = f->rep_out_tail = NULL;
    wake_fleet(f);
}

static void send_reply(td_transport_t *transport, td_reply_t *reply)
{
    td_fleet_t *f = (td_fleet_t *)((char *)transport - offsetof(td_fleet_t, transport));
    rep_item_t *item = malloc(sizeof *item);
    if (!item) { /* the fleet thread drops what waits for it (td_part_reply_lost) */
        td_err("fleet: out of memory for a reply");
        td_reply_end(reply, TD_REPLY_BROKEN);
        atomic_fetch_add(&f->replies_lost, 1);
        wake_fleet(f);
        return;
    }
    memcpy(item->header, reply->header, sizeof item->header);
    item->body = reply->body; /* kept, and counted, until the fleet thread frees it */
    td_bytes_taken(&reply->body);
    td_reply_end(reply, TD_REPLY_SENT);
    queue_reply(f, item);
}

static const td_transport_ops_t fleet_ops = {.name = "nats", .send_reply = send_reply};

/* The answer to a request the path did not take: status st (NULL without memory: logged). */
static rep_item_t *refusal(const sub_item_t *s, tally_status_t st, const char *why)
{
    uint8_t frame[TALLY_REP_HEADER_SIZE + TALLY_ERROR_MESSAGE_MAX];
    size_t len = td_fleet_error_reply(s->header, sizeof s->header, st, why, frame);
    rep_item_t *item = calloc(1, sizeof *item);
    uint8_t *text = malloc(len - TALLY_REP_HEADER_SIZE + 1);
    if (!item || !text) {
        free(item);
        free(text);
        td_err("fleet: out of memory for a refusal");
        return NULL;
    }
    memcpy(item->header, frame, TALLY_REP_HEADER_SIZE);
    memcpy(text, frame + TALLY_REP_HEADER_SIZE, len - TALLY_REP_HEADER_SIZE);
    item->body =
        (td_bytes_t){.data = text, .len = len - TALLY_REP_HEADER_SIZE, .free_fn = free_bytes};
    return item;
}

/* Loop thread: a refusal queued like a reply. */
static void refuse(td_fleet_t *f, const sub_item_t *s, tally_status_t st, const char *why)
{
    rep_item_t *item = refusal(s, st, why);
    if (item)
        queue_reply(f, item);
}

void td_fleet_path_on_loop(td_fleet_t *f)
{
    pthread_mutex_lock(&f->q_mu);
    sub_item_t *s = f->sub_head;
    f->sub_head = f->sub_tail = NULL;
    pthread_mutex_unlock(&f->q_mu);
    while (s && (td_path_may_read(f->transport.path) || td_path_stopping(f->transport.path))) {
        sub_item_t *next = s->next;
        bool in_payload = s->payload.free_fn == free_item; /* the item goes with its payload */
        td_msg_t m = sub_msg(s);
        if (!td_path_may_read(f->transport.path)) {
            refuse(f, s, TALLY_E_SHUTDOWN, "tallyd reads nothing more (stopping)");
            sub_free(s);
        } else if (td_path_submit(f->transport.path, &f->transport, &m) != TD_OK) {
            refuse(f, s, TALLY_E_BUSY, "out of memory for the request");
            sub_free(s); /* still ours: nothing was taken */
        } else if (!in_payload) {
            free(s); /* the path copied the header and took the payload: the item is ours */
        } /* else the path frees the item with its payload (it may have already) */
        s = next;
    }
    if (!s)
        return;
    /* At max_inflight: what is left goes back in front of what was queued meanwhile, and the
     * check handle tries again after the loop's next turn (replies free slots). */
    pthread_mutex_lock(&f->q_mu);
    sub_item_t *last = s;
    while (last->next)
        last = last->next;
    last->next = f->sub_head;
    if (!f->sub_head)
        f->sub_tail = last;
    f->sub_head = s;
    pthread_mutex_unlock(&f->q_mu);
    atomic_store(&f->subs_waiting, true);
}

static void on_check(uv_check_t *h)
{
    td_fleet_t *f = h->data;
    if (atomic_exchange(&f->subs_waiting, false))
        td_fleet_path_on_loop(f);
    flush_replies(f);
}

/* Before the loop blocks: replies made after this turn's check (other handles' callbacks). */
static void on_prepare(uv_prepare_t *h)
{
    flush_replies(h->data);
}

/* ---- Fleet thread ---------------------------------------------------------------------------- */

td_err_t td_fleet_path_open(td_fleet_t *f)
{
    f->transport = (td_transport_t){.ops = &fleet_ops, .path = f->host.path, .owns_streams = true};
    /* None of these can fail: glibc's pthread_mutex_init with default attributes only fills in
     * the mutex, libuv's uv_check_init and uv_prepare_init only fill in the handle and return 0,
     * and their starts fail only without a callback. The eventfd can (descriptors run out). */
    pthread_mutex_init(&f->q_mu, NULL);
    uv_check_init(f->host.loop, &f->check);
    uv_check_start(&f->check, on_check);
    uv_prepare_init(f->host.loop, &f->prepare);
    uv_prepare_start(&f->prepare, on_prepare);
    f->check.data = f->prepare.data = f;
    uv_unref((uv_handle_t *)&f->check); /* they must not keep the loop alive */
    uv_unref((uv_handle_t *)&f->prepare);
    f->q_mu_ready = true;
    f->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (f->wake_fd < 0) {
        td_err("fleet: eventfd: %s", strerror(errno));
        return TD_ERR_LIBRARY;
    }
    /* With shard threads the fleet thread is a front of its own (one shard: everything runs on
     * the loop thread, and the requests go there as before). */
    td_err_t err = td_path_port_open(f->host.path, &f->transport, wake_port, f, &f->port);
    if (err == TD_ERR_NOMEM)
        return err;
    if (err != TD_OK)
        f->port = NULL;
    td_info("fleet: %s hands its requests to the request path %s", f->member,
            f->port ? "itself (a port)" : "through the loop thread");
    return TD_OK;
}

/* After the loop has ended (nothing submits or replies any more). */
void td_fleet_path_close(td_fleet_t *f)
{
    flush_replies(f);
    td_fleet_path_flush(f);
    td_path_port_close(&f->port); /* the shards have ended: what it still has is dropped */
    while (f->sub_head) {
        sub_item_t *s = f->sub_head;
        f->sub_head = s->next;
        sub_free(s);
    }
    while (f->rep_head) {
        rep_item_t *r = f->rep_head;
        f->rep_head = r->next;
        td_bytes_free(&r->body);
        free(r);
    }
    f->sub_tail = NULL;
    f->rep_tail = NULL;
    for (size_t i = 0; f->pend && i < f->pend_cap; i++) {
        free(f->pend[i].reply);
        natsMsg_Destroy(f->pend[i].msg); /* a query whose answer never came back (stopping) */
        f->pend[i].msg = NULL;
    }
    if (f->wake_fd >= 0)
        close(f->wake_fd);
    f->wake_fd = -1;
    if (f->q_mu_ready)
        pthread_mutex_destroy(&f->q_mu);
    f->q_mu_ready = false;
}

/* A free pending slot with a fresh tag, or -1 (looked for from where the last one was found:
 * slots are taken and freed roughly in turn). */
static int take_slot(td_fleet_t *f, td_pend_kind_t kind, const uint8_t *data)
{
    for (size_t n = 0; n < f->pend_cap; n++) {
        size_t i = (f->pend_hint + n) % f->pend_cap;
        td_pend_t *p = &f->pend[i];
        if (p->kind != PEND_FREE)
            continue;
        memset(p, 0, sizeof *p);
        p->kind = kind;
        p->tag = (++f->next_tag << TD_FLEET_SLOT_BITS) | (uint64_t)i;
        p->orig_id = tally_get_u64(data + 8);
        f->pend_hint = i + 1;
        return (int)i;
    }
    return -1;
}

/* Fleet thread: s waits for td_fleet_path_flush. */
static void queue_sub(td_fleet_t *f, sub_item_t *s)
{
    if (f->sub_out_tail)
        f->sub_out_tail->next = s;
    else
        f->sub_out_head = s;
    f->sub_out_tail = s;
}

int td_fleet_path_send(td_fleet_t *f, td_pend_kind_t kind, const uint8_t *data, size_t len)
{
    size_t plen = len - TALLY_REQ_HEADER_SIZE;
    sub_item_t *s = malloc(sizeof *s + plen);
    int slot = s ? take_slot(f, kind, data) : -1;
    if (slot < 0) {
        free(s);
        return -1;
    }
    s->next = NULL;
    s->decoded = false;
    s->body_unwanted = false;
    memcpy(s->header, data, sizeof s->header);
    tally_put_u64(s->header + 8, f->pend[slot].tag);
    memcpy(s->data, data + TALLY_REQ_HEADER_SIZE, plen);
    s->payload = plen ? (td_bytes_t){.data = s->data, .len = plen, .free_fn = free_item, .hint = s}
                      : (td_bytes_t){0};
    queue_sub(f, s);
    return slot;
}

/* With a port and nothing waiting before it: the request straight to the port, with no queue
 * item. The slot, -1 when none is free or there is no memory (the payload freed), or -2 when the
 * port takes nothing now (max_inflight: queue it). */
static int send_to_port(td_fleet_t *f, td_pend_kind_t kind, const uint8_t *header,
                        const tally_req_t *req, bool body_unwanted, td_bytes_t *payload)
{
    int slot = take_slot(f, kind, header);
    if (slot < 0) {
        td_bytes_free(payload);
        return -1;
    }
    uint8_t tagged[TALLY_REQ_HEADER_SIZE];
    memcpy(tagged, header, sizeof tagged);
    tally_put_u64(tagged + 8, f->pend[slot].tag);
    tally_req_t q = *req;
    q.request_id = f->pend[slot].tag;
    td_msg_t m = {.header = tagged,
                  .header_len = sizeof tagged,
                  .req = &q,
                  .body_unwanted = body_unwanted,
                  .payload = *payload,
                  .frames = 2};
    td_err_t err = td_path_port_submit(f->port, &m);
    if (err == TD_OK) {
        *payload = (td_bytes_t){0};
        return slot;
    }
    memset(&f->pend[slot], 0, sizeof f->pend[slot]); /* free again */
    if (err == TD_ERR_BUSY)
        return -2;
    td_bytes_free(payload);
    return -1;
}

int td_fleet_path_send_shared(td_fleet_t *f, td_pend_kind_t kind, const uint8_t *header,
                              const tally_req_t *req, bool body_unwanted, td_bytes_t *payload)
{
    if (f->port && !f->sub_out_head) {
        int slot = send_to_port(f, kind, header, req, body_unwanted, payload);
        if (slot != -2)
            return slot;
    }
    sub_item_t *s = malloc(sizeof *s);
    int slot = s ? take_slot(f, kind, header) : -1;
    if (slot < 0) {
        free(s);
        td_bytes_free(payload);
        return -1;
    }
    s->next = NULL;
    memcpy(s->header, header, sizeof s->header);
    tally_put_u64(s->header + 8, f->pend[slot].tag);
    s->decoded = true;
    s->body_unwanted = body_unwanted;
    s->req = *req;
    s->req.request_id = f->pend[slot].tag;
    s->payload = *payload;
    *payload = (td_bytes_t){0};
    queue_sub(f, s);
    return slot;
}

/* Fleet thread: refusals of its own (the port's submit failed), taken with the replies. */
static void refuse_here(td_fleet_t *f, const sub_item_t *s, tally_status_t st, const char *why)
{
    rep_item_t *item = refusal(s, st, why);
    if (!item)
        return;
    item->next = NULL;
    pthread_mutex_lock(&f->q_mu);
    if (f->rep_tail)
        f->rep_tail->next = item;
    else
        f->rep_head = item;
    f->rep_tail = item;
    pthread_mutex_unlock(&f->q_mu);
}

/* One request to the port (the queue item freed, or kept by its payload); TD_ERR_BUSY: at
 * max_inflight, nothing taken. */
static td_err_t port_submit(td_fleet_t *f, sub_item_t *s)
{
    bool in_payload = s->payload.free_fn == free_item; /* the item goes with its payload */
    td_msg_t m = sub_msg(s);
    td_err_t err = td_path_port_submit(f->port, &m);
    if (err == TD_ERR_BUSY)
        return err;
    if (err != TD_OK) {
        refuse_here(f, s, TALLY_E_BUSY, "out of memory for the request");
        sub_free(s);
    } else if (!in_payload) {
        free(s); /* the path copied the header and took the payload: the item is ours */
    }
    return TD_OK;
}

/* With a port: what this turn sent goes to the shards, in order, as far as max_inflight lets it
 * (the rest is sent at the next flush, after replies). */
static void flush_to_port(td_fleet_t *f)
{
    while (f->sub_out_head) {
        sub_item_t *s = f->sub_out_head, *next = s->next;
        if (port_submit(f, s) == TD_ERR_BUSY)
            break;
        f->sub_out_head = next;
    }
    if (!f->sub_out_head)
        f->sub_out_tail = NULL;
    td_path_port_flush(f->port);
}

void td_fleet_path_flush(td_fleet_t *f)
{
    if (f->port) {
        flush_to_port(f);
        return;
    }
    if (!f->sub_out_head)
        return;
    pthread_mutex_lock(&f->q_mu);
    if (f->sub_tail)
        f->sub_tail->next = f->sub_out_head;
    else
        f->sub_head = f->sub_out_head;
    f->sub_tail = f->sub_out_tail;
    pthread_mutex_unlock(&f->q_mu);
    f->sub_out_head = f->sub_out_tail = NULL;
    uv_async_send(&f->async);
}

uint8_t *td_fleet_frame(const uint8_t *header, const uint8_t *body, size_t body_len, uint8_t *buf,
                        size_t cap, size_t *len)
{
    *len = TALLY_REP_HEADER_SIZE + body_len;
    uint8_t *frame = *len <= cap ? buf : malloc(*len);
    if (!frame) {
        td_err("fleet: out of memory for a reply frame");
        return NULL;
    }
    memcpy(frame, header, TALLY_REP_HEADER_SIZE);
    if (body_len)
        memcpy(frame + TALLY_REP_HEADER_SIZE, body, body_len);
    return frame;
}

/* One reply to its pending slot: its header gets the original request id back. */
static void dispatch(td_fleet_t *f, uint8_t *header, const td_bytes_t *body)
{
    uint64_t tag = tally_get_u64(header + 8);
    size_t slot = (size_t)(tag & ((1u << TD_FLEET_SLOT_BITS) - 1));
    td_pend_t *p = slot < f->pend_cap ? &f->pend[slot] : NULL;
    if (!p || p->kind == PEND_FREE || p->tag != tag)
        return; /* a reply to a request given up (its partition was dropped) */
    tally_put_u64(header + 8, p->orig_id);
    if (p->kind == PEND_SYNC) { /* kept for td_fleet_path_call, malloc'ed whole */
        size_t len = 0;
        p->reply = td_fleet_frame(header, body->data, body->len, NULL, 0, &len);
        p->reply_len = len;
        p->done = p->reply != NULL; /* no memory: its wait times out */
        return;
    }
    td_fleet_on_reply(f, (int)slot, header, body->data, body->len);
}

/* A reply the port hands over (td_path_port_take_replies): read here, ended by the port. */
static void port_reply(void *ctx, td_reply_t *reply)
{
    dispatch(ctx, reply->header, &reply->body);
}

/* Takes the replies the loop has posted: header and payload as the path made them (no copy). */
static void take_replies(td_fleet_t *f)
{
    pthread_mutex_lock(&f->q_mu);
    rep_item_t *r = f->rep_head;
    f->rep_head = f->rep_tail = NULL;
    pthread_mutex_unlock(&f->q_mu);
    while (r) {
        rep_item_t *next = r->next;
        dispatch(f, r->header, &r->body);
        td_bytes_free(&r->body);
        free(r);
        r = next;
    }
    if (f->port)
        td_path_port_take_replies(f->port, port_reply, f);
    unsigned lost = atomic_load(&f->replies_lost);
    if (lost != f->replies_lost_seen) { /* a synchronous call's wait times out by itself */
        f->replies_lost_seen = lost;
        td_part_reply_lost(f);
    }
}

void td_fleet_path_poll(td_fleet_t *f, int timeout_ms)
{
    td_fleet_path_flush(f); /* what this turn sent, before waiting for anything */
    if (timeout_ms != 0 && f->port && !td_path_port_sleep(f->port))
        timeout_ms = 0; /* replies came meanwhile: no wake-up was written for them */
    struct pollfd p = {.fd = f->wake_fd, .events = POLLIN};
    if (poll(&p, 1, timeout_ms) > 0) { /* a reply, or a reader queued messages */
        uint64_t count;
        ssize_t n = read(f->wake_fd, &count, sizeof count);
        (void)n;
    }
    take_replies(f);
}

uint8_t *td_fleet_path_call(td_fleet_t *f, const uint8_t *data, size_t len, int timeout_ms,
                            size_t *reply_len)
{
    int slot = td_fleet_path_send(f, PEND_SYNC, data, len);
    if (slot < 0)
        return NULL;
    td_pend_t *p = &f->pend[slot];
    int64_t deadline = td_nats_now_ms() + timeout_ms;
    while (!p->done && td_nats_now_ms() < deadline)
        td_fleet_path_poll(f, 10);
    uint8_t *reply = p->reply;
    *reply_len = p->reply_len;
    if (!p->done) /* given up: its late reply is dropped (the tag no longer matches) */
        td_warn("fleet: no answer from the request path within %d ms", timeout_ms);
    memset(p, 0, sizeof *p);
    return reply;
}

/* ---- Loop calls ---------------------------------------------------------------------------- */

static void on_loop(td_fleet_t *f, void (*fn)(td_fleet_t *f, void *arg), void *arg, bool hold)
{
    td_fleet_job_t job = {.fn = fn, .arg = arg, .hold = hold};
    td_fleet_path_flush(f); /* requests sent before the job reach the loop before it */
    pthread_mutex_lock(&f->mu);
    f->job = &job;
    pthread_mutex_unlock(&f->mu);
    uv_async_send(&f->async);
    pthread_mutex_lock(&f->mu);
    while (!job.done)
        pthread_cond_wait(&f->cond, &f->mu);
    pthread_mutex_unlock(&f->mu);
}

void td_fleet_on_loop(td_fleet_t *f, void (*fn)(td_fleet_t *f, void *arg), void *arg)
{
    on_loop(f, fn, arg, true);
}

void td_fleet_on_loop_unheld(td_fleet_t *f, void (*fn)(td_fleet_t *f, void *arg), void *arg)
{
    on_loop(f, fn, arg, false);
}
