/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_web_fleet.c — a fleet worker's API shows the whole fleet (docs/web.md "A fleet"): GET
 * /api/v1/streams lists every member's streams, and GET /api/v1/streams/NAME of a stream whose
 * partition this worker does not own is asked of its owner. Both go through the fleet's hooks
 * (td_fleet_status_t.view, filled by daemon/nats/td_fleet_view.c: this floor does not reach
 * NATS itself), which answer later on the loop thread; the job's connection stays suspended
 * meanwhile, as for a query handed to the request path.
 *
 * A job waiting for the fleet is held through an ask (below), which the fleet's callback gets:
 * when tallyd closes the web first (td_web_fleet_close answers the job 503 and lets it go), the
 * ask stays behind, job-less, until the fleet's answer comes and frees it, so the callback never
 * touches a job or a td_web_t that is gone.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_web_int.h"

typedef struct td_web_ask {
    struct td_web_ask *next, **prev; /* in td_web_t.asks while the job waits */
    td_web_job_t *job;               /* NULL once the web has closed */
} td_web_ask_t;

/* Takes a (its job answered or abandoned) out of the web's list. */
static td_web_job_t *detach(td_web_ask_t *a)
{
    td_web_job_t *job = a->job;
    if (!job)
        return NULL;
    *a->prev = a->next;
    if (a->next)
        a->next->prev = a->prev;
    a->job = NULL;
    return job;
}

/* The fleet's callback's arg: the job still waiting for the answer, or NULL (the web closed);
 * the ask is freed either way. */
static td_web_job_t *answered(void *arg)
{
    td_web_ask_t *a = arg;
    td_web_job_t *job = detach(a);
    free(a);
    return job;
}

/* The status and error code an unanswered question gets: no owner in time 504, an owner's
 * answer that is not a reply 502 (as one that does not decode). */
static void answer_failed(td_web_t *self, td_web_job_t *job, const td_fleet_answer_t *ans)
{
    unsigned code = ans->status == TALLY_E_TIMEOUT ? MHD_HTTP_GATEWAY_TIMEOUT
                    : ans->status == TALLY_E_REPLY ? MHD_HTTP_BAD_GATEWAY
                                                   : td_web_http_status(ans->status);
    td_web_answer_error(self, job, code, tally_status_name(ans->status), ans->message);
}

static void list_answered(void *arg, const td_fleet_answer_t *ans)
{
    td_web_job_t *job = answered(arg);
    if (!job)
        return;
    if (ans->status != TALLY_OK) {
        answer_failed(job->web, job, ans);
        return;
    }
    tally_buf_t out = {0};
    td_streams_hold(job->web->host.streams); /* this worker's own entries are read in full */
    tally_status_t st = td_web_fleet_list_json(job->web, ans, &out);
    td_streams_release(job->web->host.streams);
    td_web_answer_buf(job->web, job, st, &out, "out of memory");
}

static void query_answered(void *arg, const td_fleet_answer_t *ans)
{
    td_web_job_t *job = answered(arg);
    if (!job)
        return;
    tally_rep_t rep;
    if (ans->status == TALLY_OK &&
        tally_rep_decode(ans->reply, TALLY_REP_HEADER_SIZE, &rep) != TALLY_OK) {
        td_web_answer_error(job->web, job, MHD_HTTP_BAD_GATEWAY, "bad_reply",
                            "the owner's reply does not decode");
        return;
    }
    if (ans->status != TALLY_OK) {
        answer_failed(job->web, job, ans);
        return;
    }
    tally_buf_t out = {0};
    char msg[TALLY_ERROR_MESSAGE_MAX + 1];
    tally_status_t st = td_web_reply_json(
        job->params.streams[0], &job->params, &rep, ans->reply + TALLY_REP_HEADER_SIZE,
        ans->reply_len - TALLY_REP_HEADER_SIZE, &out, msg, sizeof msg);
    td_web_answer_buf(job->web, job, st, &out, msg);
}

/* Whether job is the fleet's to answer, and how: the fleet's list, or the query req of a stream
 * of a partition this worker does not own now. */
static td_fleet_answer_fn judge(td_web_t *self, td_web_job_t *job, tally_req_t *req)
{
    const td_fleet_status_t *st = self->host.fleet;
    if (!st || !st->on || !st->view.streams)
        return NULL;
    if (job->kind == TD_WEB_LIST)
        return list_answered;
    if (job->kind != TD_WEB_STREAM)
        return NULL;
    memset(req, 0, sizeof *req);
    req->opcode = TALLY_OP_QUERY;
    if (job->params.last_ms) {
        req->flags = TALLY_FLAG_QUERY_WINDOW;
        req->lo = (int64_t)job->params.last_ms;
    }
    if (tally_req_set_stream(req, job->params.streams[0]) != TALLY_OK) /* checked before */
        return NULL;
    uint32_t k = tally_partition(req->stream, req->stream_len, st->partitions);
    bool mine = atomic_load_explicit(&st->owned[k], memory_order_relaxed);
    return mine ? NULL : query_answered;
}

bool td_web_fleet_asks(td_web_t *self, td_web_job_t *job)
{
    tally_req_t req;
    td_fleet_answer_fn done = judge(self, job, &req);
    if (!done)
        return false;
    td_web_ask_t *a = calloc(1, sizeof *a);
    if (!a) {
        td_web_answer_error(self, job, MHD_HTTP_INTERNAL_SERVER_ERROR, "internal", "out of memory");
        return true;
    }
    *a = (td_web_ask_t){.next = self->asks, .prev = &self->asks, .job = job};
    if (self->asks)
        self->asks->prev = &a->next;
    self->asks = a;
    const td_fleet_view_t *view = &self->host.fleet->view;
    bool queued = done == list_answered ? view->streams(view->ctx, done, a)
                                        : view->query(view->ctx, &req, done, a);
    if (!queued) {
        detach(a);
        free(a);
        td_web_answer_error(self, job, MHD_HTTP_SERVICE_UNAVAILABLE, "busy",
                            "too many questions to the fleet wait already");
    }
    return true;
}

void td_web_fleet_close(td_web_t *self)
{
    while (self->asks) {
        td_web_job_t *job = detach(self->asks);
        td_web_answer_error(self, job, MHD_HTTP_SERVICE_UNAVAILABLE, "shutdown",
                            "tallyd is shutting down");
    }
}
