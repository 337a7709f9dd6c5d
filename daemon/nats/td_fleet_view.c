/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_view.c — the whole fleet as the HTTP API shows it (td_fleet_status.h,
 * td_fleet_view_t; docs/web.md "A fleet"): the list of every member's streams, gathered on
 * tally.streams like `tally --nats streams`, and a stream's record asked of its owner on
 * tally.q.<k>, both as the worker's own NATS user (PROTOCOL.md §13 "Answers by request-reply").
 *
 * The loop thread must never wait for NATS, and the fleet thread must not stop applying while an
 * answer is gathered, so the questions have a thread of their own: the loop queues a question
 * (at most TD_VIEW_QUEUE wait; more are refused, and the API answers 503), this thread asks on
 * the fleet's connection (libnats' connections are shared between threads) and queues the answer
 * back, and the loop hands it to the asker from a uv_async handle. One question at a time: a
 * gather lasts until the answers cover every partition, a few milliseconds, and TD_VIEW_WAIT_MS
 * at the most when a member does not answer (or a partition is between owners); its answer then
 * says how many partitions the answers covered instead of passing the list off as whole. (The
 * live-member count an answer carries is not a stopping rule: a member's view of the membership
 * can lag a heartbeat behind, and a list cut at the first answer would be partial for nothing.)
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally_nats_conn.h"
#include "td_fleet_int.h"
#include "td_log.h"
#include "td_nats_js.h"

/* Questions waiting at once; how long a gather or a query waits for answers; the memory one
 * list may take (entries of name and member, 130 bytes: 64,527 streams; more, and the list says
 * it is partial). */
#define TD_VIEW_QUEUE 32
#define TD_VIEW_WAIT_MS 2000
#define TD_VIEW_LIST_BYTES (8u << 20)
/* A gather looks at `stop` this often while it waits for answers. */
#define TD_VIEW_RETRY_MS 100

typedef struct view_ask {
    struct view_ask *next;
    bool list; /* tally.streams, else tally.q.<k> */
    uint32_t k;
    uint8_t frame[TALLY_REQ_HEADER_SIZE];
    td_fleet_answer_fn done;
    void *arg;
    td_fleet_answer_t answer;
    natsMsg *reply; /* the query's answer: answer.reply points into it */
    size_t cap;     /* entries' room */
} view_ask_t;

typedef struct td_view {
    td_fleet_t *f;
    char user[TALLY_NATS_MEMBER_ID_MAX + 1];
    pthread_t thread;
    bool started;
    atomic_bool stop;
    pthread_mutex_t mu;
    pthread_cond_t cond;              /* a question queued, or stop */
    view_ask_t *todo, **todo_tail;    /* mu: for the thread */
    view_ask_t *answered, **ans_tail; /* mu: for the loop */
    unsigned waiting;                 /* mu: questions queued or being asked */
    uv_async_t async;
    bool async_open;
} td_view_t;

static void push(view_ask_t ***tail, view_ask_t *a)
{
    a->next = NULL;
    **tail = a;
    *tail = &a->next;
}

/* ---- The loop's side --------------------------------------------------------------------- */

static bool ask(td_view_t *v, view_ask_t *a)
{
    pthread_mutex_lock(&v->mu);
    bool room = v->waiting < TD_VIEW_QUEUE; /* no ask after close: the loop has ended */
    if (room) {
        v->waiting++;
        push(&v->todo_tail, a);
        pthread_cond_signal(&v->cond);
    }
    pthread_mutex_unlock(&v->mu);
    if (!room)
        free(a);
    return room;
}

static bool ask_streams(void *ctx, td_fleet_answer_fn done, void *arg)
{
    view_ask_t *a = calloc(1, sizeof *a);
    if (!a)
        return false;
    *a = (view_ask_t){.list = true, .done = done, .arg = arg};
    return ask(ctx, a);
}

static bool ask_query(void *ctx, const tally_req_t *req, td_fleet_answer_fn done, void *arg)
{
    td_view_t *v = ctx;
    view_ask_t *a = calloc(1, sizeof *a);
    if (!a)
        return false;
    *a = (view_ask_t){.done = done, .arg = arg};
    a->k = tally_partition(req->stream, req->stream_len, v->f->partitions);
    tally_req_t wire = *req;
    wire.version = TALLY_PROTO_VERSION;
    tally_req_encode(&wire, a->frame);
    return ask(ctx, a);
}

static void finish(view_ask_t *a)
{
    a->done(a->arg, &a->answer);
    free(a->answer.entries);
    natsMsg_Destroy(a->reply);
    free(a);
}

/* Hands the answers queued to their askers. */
static void deliver(td_view_t *v)
{
    pthread_mutex_lock(&v->mu);
    view_ask_t *a = v->answered;
    v->answered = NULL;
    v->ans_tail = &v->answered;
    pthread_mutex_unlock(&v->mu);
    while (a) {
        view_ask_t *next = a->next;
        finish(a);
        a = next;
    }
}

static void on_answers(uv_async_t *h)
{
    deliver(h->data);
}

static void closed(uv_handle_t *h)
{
    free(h->data);
}

/* ---- The thread's side ------------------------------------------------------------------- */

static void say(view_ask_t *a, tally_status_t st, const char *fmt, const char *what)
{
    a->answer.status = st;
    snprintf(a->answer.message, sizeof a->answer.message, fmt, what);
}

/* Adds one member's `streams` answer (m): its names with its member id, and the partitions its
 * Tally-Owned header covers. */
static void merge(td_view_t *v, view_ask_t *a, natsMsg *m, bool *covered)
{
    td_fleet_answer_t *ans = &a->answer;
    const uint8_t *data = (const uint8_t *)natsMsg_GetData(m);
    size_t len = (size_t)natsMsg_GetDataLength(m);
    tally_rep_t rep;
    const char *member = NULL, *owned = NULL, *members = NULL;
    if (len < TALLY_REP_HEADER_SIZE ||
        tally_rep_decode(data, TALLY_REP_HEADER_SIZE, &rep) != TALLY_OK || rep.status != TALLY_OK ||
        natsMsgHeader_Get(m, TALLY_NATS_HDR_MEMBER, &member) != NATS_OK ||
        natsMsgHeader_Get(m, TALLY_NATS_HDR_OWNED, &owned) != NATS_OK ||
        tally_fleet_owned_merge(owned, v->f->partitions, covered) < 0)
        return; /* not a member's answer of this layout: it covers nothing */
    ans->answered++;
    if (natsMsgHeader_Get(m, TALLY_NATS_HDR_MEMBERS, &members) == NATS_OK) { /* a received header: never NULL */
        size_t said = strtoul(members, NULL, 10);
        ans->members = said > ans->members && said <= 100000 ? said : ans->members;
    }
    for (size_t at = TALLY_REP_HEADER_SIZE;
         at < len && at + 1 + data[at] <= len && data[at] && data[at] <= TALLY_STREAM_NAME_MAX;
         at += 1 + data[at]) { /* a garbled entry ends the member's list */
        if (ans->count == a->cap) { /* doubled, the last step to the limit itself */
            size_t most = TD_VIEW_LIST_BYTES / sizeof *ans->entries;
            size_t cap = !a->cap ? 256 : 2 * a->cap < most ? 2 * a->cap : most;
            td_fleet_entry_t *grown =
                cap > a->cap ? realloc(ans->entries, cap * sizeof *grown) : NULL;
            if (!grown) {
                ans->truncated = true;
                return;
            }
            ans->entries = grown;
            a->cap = cap;
        }
        td_fleet_entry_t *e = &ans->entries[ans->count++];
        memcpy(e->name, data + at + 1, data[at]);
        e->name[data[at]] = '\0';
        snprintf(e->member, sizeof e->member, "%s", member);
    }
}

static int by_name(const void *x, const void *y)
{
    return strcmp(((const td_fleet_entry_t *)x)->name, ((const td_fleet_entry_t *)y)->name);
}

/* Sorted by name, each name once (two members list a stream for a moment during a hand-over). */
static void sort_entries(td_fleet_answer_t *ans)
{
    if (ans->count)
        qsort(ans->entries, ans->count, sizeof *ans->entries, by_name);
    size_t w = 0;
    for (size_t i = 0; i < ans->count; i++)
        if (w == 0 || strcmp(ans->entries[w - 1].name, ans->entries[i].name) != 0)
            ans->entries[w++] = ans->entries[i];
    ans->count = w;
}

static void gather(td_view_t *v, view_ask_t *a)
{
    td_fleet_t *f = v->f;
    td_fleet_answer_t *ans = &a->answer;
    bool covered[TALLY_NATS_MAX_PARTITIONS] = {false};
    char inbox[96 + TALLY_NATS_MEMBER_ID_MAX], subject[32 + TALLY_NATS_MEMBER_ID_MAX];
    natsInbox *unique = NULL;
    natsSubscription *sub = NULL;
    tally_req_t req = {.version = TALLY_PROTO_VERSION, .opcode = TALLY_OP_STREAMS};
    tally_req_encode(&req, a->frame);
    natsStatus s = natsInbox_Create(&unique);
    if (s == NATS_OK) {
        const char *tail = strrchr((const char *)unique, '.');
        snprintf(inbox, sizeof inbox, "%s%s%s", TALLY_NATS_INBOX, v->user, tail ? tail : ".v");
        tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_STREAMS, -1, v->user);
        s = natsConnection_SubscribeSync(&sub, f->nc, inbox);
    }
    if (s == NATS_OK)
        s = natsConnection_PublishRequest(f->nc, subject, inbox, a->frame, sizeof a->frame);
    ans->partitions = f->partitions;
    int64_t deadline = td_nats_now_ms() + TD_VIEW_WAIT_MS;
    while (s == NATS_OK && ans->covered < f->partitions && !ans->truncated &&
           !atomic_load(&v->stop)) {
        int64_t left = deadline - td_nats_now_ms();
        natsMsg *m = NULL;
        if (left <= 0)
            break;
        if (natsSubscription_NextMsg(&m, sub, left < TD_VIEW_RETRY_MS ? left : TD_VIEW_RETRY_MS) !=
            NATS_OK)
            continue;
        merge(v, a, m, covered);
        natsMsg_Destroy(m);
        ans->covered = 0;
        for (uint32_t k = 0; k < f->partitions; k++)
            ans->covered += covered[k] ? 1 : 0;
    }
    tally__nats_sub_close(f->nc, &sub); /* late answers may be arriving (tally_nats_conn.h) */
    natsInbox_Destroy(unique);
    if (s != NATS_OK)
        say(a, TALLY_E_TRANSPORT, "the fleet's streams: %s", td_nats_last_error(s));
    else if (ans->answered == 0)
        say(a, TALLY_E_TIMEOUT, "no member answered on %s in time", subject);
    sort_entries(ans);
}

/* One request: the member asking is subscribed to tally.q.*.* itself (td_fleet_query_open runs
 * before td_fleet_view_open, and td_fleet_query_close after td_fleet_view_close), so NATS never
 * answers "no responders"; a partition between owners is a timeout, like one whose owner is
 * slow. */
static void query(td_view_t *v, view_ask_t *a)
{
    char subject[48 + TALLY_NATS_MEMBER_ID_MAX];
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_QUERY, a->k, v->user);
    natsStatus s = natsConnection_Request(&a->reply, v->f->nc, subject, a->frame,
                                          sizeof a->frame, TD_VIEW_WAIT_MS);
    const char *owner = NULL;
    if (s == NATS_OK && natsMsg_GetDataLength(a->reply) >= TALLY_REP_HEADER_SIZE) {
        a->answer.reply = (const uint8_t *)natsMsg_GetData(a->reply);
        a->answer.reply_len = (size_t)natsMsg_GetDataLength(a->reply);
        if (natsMsgHeader_Get(a->reply, TALLY_NATS_HDR_MEMBER, &owner) == NATS_OK)
            snprintf(a->answer.owner, sizeof a->answer.owner, "%s", owner);
    } else if (s == NATS_OK) {
        say(a, TALLY_E_REPLY, "the owner's answer on %s is not a reply", subject);
    } else if (s == NATS_TIMEOUT) {
        say(a, TALLY_E_TIMEOUT, "no member answered on %s in time (no owner?)", subject);
    } else {
        say(a, TALLY_E_TRANSPORT, "a query of the fleet: %s", td_nats_last_error(s));
    }
}

static void *view_thread(void *arg)
{
    td_view_t *v = arg;
    pthread_setname_np(pthread_self(), "tdfleetview");
    pthread_mutex_lock(&v->mu);
    while (!atomic_load(&v->stop)) {
        view_ask_t *a = v->todo;
        if (!a) {
            pthread_cond_wait(&v->cond, &v->mu);
            continue;
        }
        v->todo = a->next;
        if (!v->todo)
            v->todo_tail = &v->todo;
        pthread_mutex_unlock(&v->mu);
        if (a->list)
            gather(v, a);
        else
            query(v, a);
        pthread_mutex_lock(&v->mu);
        v->waiting--;
        push(&v->ans_tail, a);
        uv_async_send(&v->async);
    }
    pthread_mutex_unlock(&v->mu);
    return NULL;
}

/* ---- Life -------------------------------------------------------------------------------- */

td_err_t td_fleet_view_open(td_fleet_t *f)
{
    td_view_t *v = calloc(1, sizeof *v);
    if (!v)
        return TD_ERR_NOMEM;
    v->f = f;
    v->todo_tail = &v->todo;
    v->ans_tail = &v->answered;
    pthread_mutex_init(&v->mu, NULL);
    pthread_cond_init(&v->cond, NULL);
    f->view = v;
    char msg[256];
    tally_nats_conf_t conf = {.servers = f->host.cfg->nats_servers, .user = f->host.cfg->nats_user};
    if (tally__nats_user(&conf, v->user, sizeof v->user, msg, sizeof msg) != TALLY_OK) {
        td_err("fleet: %s", msg); /* cannot happen: td_fleet_check_config has passed */
        return TD_ERR_CONFIG;
    }
    if (uv_async_init(f->host.loop, &v->async, on_answers) != 0)
        return TD_ERR_LIBRARY;
    v->async.data = v;
    v->async_open = true;
    uv_unref((uv_handle_t *)&v->async); /* it must not keep the loop alive */
    if (pthread_create(&v->thread, NULL, view_thread, v) != 0)
        return TD_ERR_LIBRARY;
    v->started = true;
    f->st->view = (td_fleet_view_t){.streams = ask_streams, .query = ask_query, .ctx = v};
    return TD_OK;
}

void td_fleet_view_close(td_fleet_t *f)
{
    td_view_t *v = f->view;
    if (!v)
        return;
    f->st->view = (td_fleet_view_t){0};
    pthread_mutex_lock(&v->mu);
    atomic_store(&v->stop, true);
    pthread_cond_broadcast(&v->cond);
    pthread_mutex_unlock(&v->mu);
    if (v->started)
        pthread_join(v->thread, NULL);
    deliver(v); /* answered while the loop was ending */
    for (view_ask_t *a = v->todo, *next; a; a = next) {
        next = a->next;
        say(a, TALLY_E_SHUTDOWN, "%s", "tallyd is shutting down");
        finish(a);
    }
    pthread_cond_destroy(&v->cond);
    pthread_mutex_destroy(&v->mu);
    f->view = NULL;
    if (v->async_open)
        uv_close((uv_handle_t *)&v->async, closed); /* frees v */
    else
        free(v);
}
