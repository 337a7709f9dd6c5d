/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_transport.c — the fleet's two ways into the daemon:
 *
 *   - the request path, as a transport (core/td_transport.h): the fleet thread queues a request
 *     frame (its request id replaced by a tag naming its pending slot, its payload copied, since
 *     the NATS message may be dropped with its partition while the request runs) and wakes the
 *     loop; the loop submits it with td_path_submit as tallyd's own request (no sender id: the
 *     fleet's streams are held to the daemon's limits, not to one client's share), or, while the
 *     path takes nothing (td_path_may_read), answers it `busy` at once, which the fleet sends
 *     again later. Every reply comes back through send_reply on the loop thread: its payload
 *     bytes are kept (they stay counted in the reply bounds until the fleet thread frees them),
 *     queued for the fleet thread, and the eventfd the readers also write wakes it;
 *   - the loop thread, through the fleet's uv_async handle: td_fleet_on_loop posts a job and
 *     waits, for the work on the stream table that only the loop thread may do.
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

/* A request waiting for the loop. */
typedef struct td_fleet_sub {
    struct td_fleet_sub *next;
    uint8_t header[TALLY_REQ_HEADER_SIZE]; /* its request id is the tag */
    td_bytes_t payload;
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

/* ---- Loop thread ---------------------------------------------------------------------------- */

static void wake_fleet(td_fleet_t *f)
{
    uint64_t one = 1;
    ssize_t n = write(f->wake_fd, &one, sizeof one);
    (void)n; /* the counter is at most saturated: the thread wakes anyway */
}

static void queue_reply(td_fleet_t *f, rep_item_t *item)
{
    pthread_mutex_lock(&f->q_mu);
    if (f->rep_tail)
        f->rep_tail->next = item;
    else
        f->rep_head = item;
    f->rep_tail = item;
    pthread_mutex_unlock(&f->q_mu);
    wake_fleet(f);
}

static void send_reply(td_transport_t *transport, td_reply_t *reply)
{
    td_fleet_t *f = (td_fleet_t *)((char *)transport - offsetof(td_fleet_t, transport));
    rep_item_t *item = calloc(1, sizeof *item);
    if (!item) { /* the fleet thread's wait for it times out and the partition is taken anew */
        td_err("fleet: out of memory for a reply");
        td_reply_end(reply, TD_REPLY_BROKEN);
        return;
    }
    memcpy(item->header, reply->header, sizeof item->header);
    item->body = reply->body; /* kept, and counted, until the fleet thread frees it */
    td_bytes_taken(&reply->body);
    td_reply_end(reply, TD_REPLY_SENT);
    queue_reply(f, item);
}

static const td_transport_ops_t fleet_ops = {.name = "nats", .send_reply = send_reply};

/* The answer to a request the path did not take: status st, queued like a reply. */
static void refuse(td_fleet_t *f, const sub_item_t *s, tally_status_t st, const char *why)
{
    uint8_t frame[TALLY_REP_HEADER_SIZE + TALLY_ERROR_MESSAGE_MAX];
    size_t len = td_fleet_error_reply(s->header, sizeof s->header, st, why, frame);
    rep_item_t *item = calloc(1, sizeof *item);
    uint8_t *text = malloc(len - TALLY_REP_HEADER_SIZE + 1);
    if (!item || !text) {
        free(item);
        free(text);
        td_err("fleet: out of memory for a refusal");
        return;
    }
    memcpy(item->header, frame, TALLY_REP_HEADER_SIZE);
    memcpy(text, frame + TALLY_REP_HEADER_SIZE, len - TALLY_REP_HEADER_SIZE);
    item->body =
        (td_bytes_t){.data = text, .len = len - TALLY_REP_HEADER_SIZE, .free_fn = free_bytes};
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
        td_msg_t m = {.header = s->header,
                      .header_len = sizeof s->header,
                      .payload = s->payload,
                      .frames = 2};
        if (!td_path_may_read(f->transport.path)) {
            td_bytes_free(&s->payload);
            refuse(f, s, TALLY_E_SHUTDOWN, "tallyd reads nothing more (stopping)");
        } else if (td_path_submit(f->transport.path, &f->transport, &m) != TD_OK) {
            td_bytes_free(&s->payload); /* still ours: nothing was taken */
            refuse(f, s, TALLY_E_BUSY, "out of memory for the request");
        }
        free(s);
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
}

/* ---- Fleet thread ---------------------------------------------------------------------------- */

td_err_t td_fleet_path_open(td_fleet_t *f)
{
    f->transport = (td_transport_t){.ops = &fleet_ops, .path = f->host.path, .owns_streams = true};
    if (pthread_mutex_init(&f->q_mu, NULL) != 0)
        return TD_ERR_LIBRARY;
    if (uv_check_init(f->host.loop, &f->check) != 0 || uv_check_start(&f->check, on_check) != 0) {
        pthread_mutex_destroy(&f->q_mu);
        return TD_ERR_LIBRARY;
    }
    f->check.data = f;
    uv_unref((uv_handle_t *)&f->check); /* it must not keep the loop alive */
    f->q_mu_ready = true;
    f->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    return f->wake_fd < 0 ? TD_ERR_LIBRARY : TD_OK;
}

/* After the loop has ended (nothing submits or replies any more). */
void td_fleet_path_close(td_fleet_t *f)
{
    while (f->sub_head) {
        sub_item_t *s = f->sub_head;
        f->sub_head = s->next;
        td_bytes_free(&s->payload);
        free(s);
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

int td_fleet_path_send(td_fleet_t *f, td_pend_kind_t kind, const uint8_t *data, size_t len)
{
    sub_item_t *s = calloc(1, sizeof *s);
    size_t plen = len - TALLY_REQ_HEADER_SIZE;
    uint8_t *payload = plen ? malloc(plen) : NULL;
    int slot = s && (payload || !plen) ? take_slot(f, kind, data) : -1;
    if (slot < 0) {
        free(s);
        free(payload);
        return -1;
    }
    memcpy(s->header, data, sizeof s->header);
    tally_put_u64(s->header + 8, f->pend[slot].tag);
    if (plen)
        memcpy(payload, data + TALLY_REQ_HEADER_SIZE, plen);
    s->payload = (td_bytes_t){.data = payload, .len = plen, .free_fn = plen ? free_bytes : NULL};
    pthread_mutex_lock(&f->q_mu);
    if (f->sub_tail)
        f->sub_tail->next = s;
    else
        f->sub_head = s;
    f->sub_tail = s;
    pthread_mutex_unlock(&f->q_mu);
    uv_async_send(&f->async);
    return slot;
}

static void dispatch(td_fleet_t *f, uint8_t *reply, size_t len)
{
    uint64_t tag = tally_get_u64(reply + 8);
    size_t slot = (size_t)(tag & ((1u << TD_FLEET_SLOT_BITS) - 1));
    td_pend_t *p = slot < f->pend_cap ? &f->pend[slot] : NULL;
    if (!p || p->kind == PEND_FREE || p->tag != tag) {
        free(reply); /* a reply to a request given up (its partition was dropped) */
        return;
    }
    tally_put_u64(reply + 8, p->orig_id);
    if (p->kind == PEND_SYNC) {
        p->done = true;
        p->reply = reply;
        p->reply_len = len;
        return;
    }
    td_fleet_on_reply(f, (int)slot, reply, len);
    free(reply);
}

/* Takes the replies the loop has queued, each as one frame (header, then payload). */
static void take_replies(td_fleet_t *f)
{
    pthread_mutex_lock(&f->q_mu);
    rep_item_t *r = f->rep_head;
    f->rep_head = f->rep_tail = NULL;
    pthread_mutex_unlock(&f->q_mu);
    while (r) {
        rep_item_t *next = r->next;
        size_t len = TALLY_REP_HEADER_SIZE + r->body.len;
        uint8_t *frame = malloc(len);
        if (frame) {
            memcpy(frame, r->header, TALLY_REP_HEADER_SIZE);
            if (r->body.len)
                memcpy(frame + TALLY_REP_HEADER_SIZE, r->body.data, r->body.len);
        } else {
            td_err("fleet: out of memory for a reply"); /* its wait times out */
        }
        td_bytes_free(&r->body);
        free(r);
        if (frame)
            dispatch(f, frame, len);
        r = next;
    }
}

void td_fleet_path_poll(td_fleet_t *f, int timeout_ms)
{
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

void td_fleet_on_loop(td_fleet_t *f, void (*fn)(td_fleet_t *f, void *arg), void *arg)
{
    td_fleet_job_t job = {.fn = fn, .arg = arg};
    pthread_mutex_lock(&f->mu);
    f->job = &job;
    pthread_mutex_unlock(&f->mu);
    uv_async_send(&f->async);
    pthread_mutex_lock(&f->mu);
    while (!job.done)
        pthread_cond_wait(&f->cond, &f->mu);
    pthread_mutex_unlock(&f->mu);
}
