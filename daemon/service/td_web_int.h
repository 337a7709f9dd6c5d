/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_web_int.h — what td_web.c (requests, jobs), td_web_json.c (the API's JSON) and
 * td_web_sse.c (event streams) share. Private to those three files.
 *
 * Locking: one mutex (td_web_t.lock) guards the job queue, `ready` and `closing`, the count of
 * event streams, and each event stream's buffer and flags; everything marked "loop" is the
 * loop thread's alone. libmicrohttpd is never called with the mutex held, except
 * MHD_suspend_connection (from libmicrohttpd's own thread, where the documentation allows it);
 * MHD_resume_connection is called after the mutex is released, by whoever cleared the
 * `suspended` flag under it, so each suspension is resumed exactly once.
 */
#ifndef TD_WEB_INT_H
#define TD_WEB_INT_H

#include <pthread.h>
#include <stdint.h>

#include "tally.h"
#include "td_fleet_status.h"
#include "td_web.h"

/* Streams one event stream may name (stream=...), and the token's room. */
#define TD_WEB_STREAMS_MAX 256
#define TD_WEB_TOKEN_MAX 256

/* What a request asks, parsed from its path and query string. */
typedef struct {
    uint64_t last_ms; /* last=: a window query; 0 for all time */
    double quantiles[TALLY_QUANTILES_MAX];
    size_t nquantiles; /* 0: p50, p90, p99 */
    unsigned nstreams;
    char streams[TD_WEB_STREAMS_MAX][TALLY_STREAM_NAME_MAX + 1];
} td_web_params_t;

typedef enum {
    TD_WEB_LIST,          /* GET /api/v1/streams */
    TD_WEB_STREAM,        /* GET /api/v1/streams/NAME */
    TD_WEB_RESET,         /* POST /api/v1/streams/NAME/reset */
    TD_WEB_DELETE,        /* DELETE /api/v1/streams/NAME */
    TD_WEB_STREAM_EVENTS, /* GET /api/v1/streams/NAME/events */
    TD_WEB_EVENTS,        /* GET /api/v1/events */
} td_web_kind_t;

typedef struct td_sse td_sse_t;

/* A request waiting for the loop thread (its connection suspended), then its answer. */
typedef struct td_web_job {
    const void *tag; /* &td_web_job_tag: tells a job from td_http's marker in con_cls */
    struct td_web_job *next;
    td_web_t *web;
    struct MHD_Connection *conn;
    td_web_kind_t kind;
    td_web_params_t params;
    bool sse_reserved; /* holds one of max_sse_clients until it becomes sse or fails */
    /* The answer, set by the loop thread before it resumes the connection. */
    bool answered;
    unsigned status;
    char *body; /* JSON, malloc'ed */
    size_t len;
    td_sse_t *sse;   /* an event stream opened: the response streams it */
    bool sse_handed; /* its response holds it */
} td_web_job_t;

extern const char td_web_job_tag;

struct td_web {
    td_service_host_t host;
    td_http_guard_t *guard;
    uv_async_t async;
    uv_timer_t tick;
    unsigned handles_open; /* loop */
    unsigned handles_closing;
    pthread_mutex_t lock;
    bool ready;   /* lock: the handles exist */
    bool closing; /* lock */
    td_web_job_t *head, *tail; /* lock: the jobs for the loop thread */
    unsigned unwritten;        /* lock: jobs answered (not event streams) not yet completed */
    pthread_cond_t written;    /* lock: signalled when `unwritten` goes down */
    unsigned sse_open;         /* lock: event streams open or being opened */
    unsigned max_sse;
    td_sse_t *sse;                     /* loop: the event streams registered */
    struct td_web_ask *asks;           /* loop: jobs waiting for the fleet (td_web_fleet.c) */
    char token[TD_WEB_TOKEN_MAX];      /* "" = none; read-only after start */
};

/* How often the event streams tick: pub_interval_ms, or TD_WEB_TICK_MS where nothing is
 * published (0). */
static inline unsigned td_web_tick_ms(const td_config_t *cfg)
{
    return cfg->pub_interval_ms ? cfg->pub_interval_ms : TD_WEB_TICK_MS;
}

/* ---- td_web.c: answers (loop thread) ------------------------------------------------------ */

/* Stores the answer and resumes the connection (body: malloc'ed JSON, owned by the job). */
void td_web_answer(td_web_t *self, td_web_job_t *job, unsigned status, char *body, size_t len);
/* An error document with status. */
void td_web_answer_error(td_web_t *self, td_web_job_t *job, unsigned status, const char *code,
                         const char *message);
/* out's document with 200 when st is TALLY_OK, else the error of st with msg (out freed). */
void td_web_answer_buf(td_web_t *self, td_web_job_t *job, tally_status_t st, tally_buf_t *out,
                       const char *msg);

/* ---- td_web_fleet.c: a fleet worker's API shows the whole fleet (loop thread) ------------- */

/* Takes the job when it is the fleet's to answer: the list of a fleet worker (every member's
 * streams), or a stream of a partition this worker does not own (asked of its owner). False:
 * not in a fleet, or a question this worker answers itself. */
bool td_web_fleet_asks(td_web_t *self, td_web_job_t *job);
/* Closing: answers every job still waiting for the fleet 503; their answers, when they come,
 * are dropped. */
void td_web_fleet_close(td_web_t *self);

/* ---- td_web_json.c: the API's documents (loop thread, but errors anywhere) --------------- */

/* {"error":CODE,"message":TEXT} (TEXT printf-formatted, JSON-escaped), malloc'ed; NULL when
 * out of memory. */
char *td_web_error_json(size_t *len, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The list of streams (GET /api/v1/streams): this tallyd's; a fleet worker's carries its
 * member id ("fleet"). */
tally_status_t td_web_list_json(td_web_t *self, tally_buf_t *out);
/* A fleet worker's list of the whole fleet from the members' answers (a): the entries of the
 * streams this worker owns in full, the others' with their name and owner; "fleet" says how
 * much of the fleet answered. */
tally_status_t td_web_fleet_list_json(td_web_t *self, const td_fleet_answer_t *a,
                                      tally_buf_t *out);
/* The record of stream `name` with p's window and quantiles: TALLY_E_UNKNOWN_STREAM,
 * TALLY_E_WINDOW (with msg) or TALLY_E_NOMEM otherwise. */
tally_status_t td_web_record_json(td_web_t *self, const char *name, const td_web_params_t *p,
                                  tally_buf_t *out, char *msg, size_t cap);
/* The JSON of a `query` reply (rep, payload: the record) for stream `name` with p's
 * quantiles, or the reply's error: its status and message in msg. */
tally_status_t td_web_reply_json(const char *name, const td_web_params_t *p,
                                 const tally_rep_t *rep, const void *payload, size_t len,
                                 tally_buf_t *out, char *msg, size_t cap);
/* The HTTP status and error code of a wire status. */
unsigned td_web_http_status(tally_status_t st);

/* ---- td_web_sse.c: event streams --------------------------------------------------------- */

/* Loop: a new event stream for p (with the list when `list`), its first events rendered and
 * registered for every tick; NULL when out of memory. */
td_sse_t *td_sse_open(td_web_t *self, const td_web_params_t *p, bool list);
/* libmicrohttpd's thread: the streaming response for sse on conn (it holds one reference). */
enum MHD_Result td_sse_respond(td_web_t *self, td_sse_t *sse, struct MHD_Connection *conn);
/* Drops one reference (the loop's list, or a response never made); the last frees it and its
 * place among max_sse_clients. */
void td_sse_release(td_web_t *self, td_sse_t *sse);
/* Loop: the publication tick: new events for every event stream, heartbeats, clients gone. */
void td_sse_tick(td_web_t *self);
/* Loop, closing: ends every event stream and resumes the suspended ones. */
void td_sse_close_all(td_web_t *self);
/* Loop, after MHD_stop_daemon (every response freed): drops the list's references. */
void td_sse_drop_all(td_web_t *self);

#endif
