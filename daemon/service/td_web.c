/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_web.c — see td_web.h: routing, parameters, credentials, the page's files, and the jobs
 * that carry requests to the loop thread and their answers back.
 *
 * Design
 * ------
 * libmicrohttpd hands over each path as it arrived (td_http.c turns its unescaping off), so a
 * stream name may hold '/', '?', '#' or '%' escaped as %2F, %3F, %23, %25: the path is split on
 * '/' first and each part decoded after, and query values are decoded here too.
 *
 * Errors that need no stream state (a bad path, parameter or credential, the event-stream
 * bound) are answered at once on libmicrohttpd's thread. Everything else becomes a job
 * (td_web_int.h): queued under the lock, the connection suspended, the loop woken with
 * uv_async_send. The loop thread renders the answer (td_web_json.c), or opens an event stream
 * (td_web_sse.c), or hands a reset or delete to the request path (td_service_host_t.submit: the
 * scheduler orders it after the stream's queued requests, exactly like the opcode) and answers
 * when its reply comes; then it resumes the connection, and the handler, called again with the
 * job in con_cls, sends what the job holds. A job is freed when libmicrohttpd says its request
 * ended (td_web_request_done), whatever happened to the connection meanwhile.
 *
 * Credentials: basic auth (td_http.c, auth_file) guards every read when configured; a valid
 * bearer token (api_token_file) also lets a request read. Resets and deletes need the token:
 * 403 when tallyd has none (the API is read-only), 401 when it is missing or wrong.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally_args.h"
#include "td_http.h"
#include "td_log.h"
#include "td_web_assets.h"
#include "td_web_int.h"

#define API_PREFIX "/api/v1"
/* How long a stop waits for the answers queued to be written (docs/web.md). */
#define TD_WEB_CLOSE_WAIT_MS 2000
#define JSON_TYPE "application/json"
/* No script, style, image or connection from anywhere but tallyd itself, and no inline
 * script or style: the page's own files do everything. */
#define CSP                                                                                      \
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "                \
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "             \
    "frame-ancestors 'none'"

const char td_web_job_tag = 0;

/* ---- Responses --------------------------------------------------------------------------- */

static void add_header(struct MHD_Response *resp, const char *name, const char *value)
{
    if (MHD_add_response_header(resp, name, value) != MHD_YES)
        td_warn("web: cannot add the %s header", name);
}

/* The headers of every page and API response. */
static void add_common_headers(struct MHD_Response *resp, const char *type)
{
    if (type)
        add_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    add_header(resp, "Content-Security-Policy", CSP);
    add_header(resp, "X-Content-Type-Options", "nosniff");
    add_header(resp, "Referrer-Policy", "no-referrer");
    add_header(resp, "X-Frame-Options", "DENY");
}

/* Sends json (malloc'ed, owned from here; NULL: out of memory) with status; header_name and
 * header_value add one more header when not NULL. */
static enum MHD_Result send_json(struct MHD_Connection *conn, unsigned status, char *json,
                                 size_t len, const char *header_name, const char *header_value)
{
    /* No memory for the document: a 500 all the same, from a constant, rather than a closed
     * connection (alloc sweep, issue 25). */
    static const char nomem[] = "{\"error\":\"internal\",\"message\":\"out of memory\"}";
    struct MHD_Response *resp =
        json ? MHD_create_response_from_buffer(len, json, MHD_RESPMEM_MUST_FREE)
             : MHD_create_response_from_buffer(sizeof nomem - 1, (void *)nomem,
                                               MHD_RESPMEM_PERSISTENT);
    if (!json) {
        status = MHD_HTTP_INTERNAL_SERVER_ERROR;
        header_name = NULL;
    }
    if (!resp) {
        free(json);
        return MHD_NO;
    }
    add_common_headers(resp, JSON_TYPE);
    add_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    if (header_name)
        add_header(resp, header_name, header_value);
    enum MHD_Result rc = MHD_queue_response(conn, status, resp);
    MHD_destroy_response(resp);
    return rc;
}

#define send_error(conn, status, code, ...)                                                      \
    send_error_with(conn, status, NULL, NULL, code, __VA_ARGS__)

static enum MHD_Result send_error_with(struct MHD_Connection *conn, unsigned status,
                                       const char *header_name, const char *header_value,
                                       const char *code, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
static enum MHD_Result send_error_with(struct MHD_Connection *conn, unsigned status,
                                       const char *header_name, const char *header_value,
                                       const char *code, const char *fmt, ...)
{
    char message[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    size_t len = 0;
    char *json = td_web_error_json(&len, code, "%s", message);
    return send_json(conn, status, json, len, header_name, header_value);
}

/* ---- The page's files -------------------------------------------------------------------- */

static const td_web_asset_t *find_asset(const char *url)
{
    for (unsigned i = 0; i < td_web_asset_count; i++)
        if (strcmp(td_web_assets[i].url, url) == 0)
            return &td_web_assets[i];
    return NULL;
}

/* A file from memory; 304 when the browser's copy has the same ETag. Browsers revalidate
 * every time (no-cache), so a new tallyd's page is never shown from an old cache. */
static enum MHD_Result send_asset(struct MHD_Connection *conn, const td_web_asset_t *a)
{
    const char *known = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "If-None-Match");
    bool same = known && strcmp(known, a->etag) == 0;
    struct MHD_Response *resp = MHD_create_response_from_buffer(
        same ? 0 : a->len, same ? NULL : (void *)a->data, MHD_RESPMEM_PERSISTENT);
    if (!resp)
        return MHD_NO;
    add_common_headers(resp, same ? NULL : a->content_type);
    add_header(resp, MHD_HTTP_HEADER_ETAG, a->etag);
    add_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    enum MHD_Result rc = MHD_queue_response(conn, same ? MHD_HTTP_NOT_MODIFIED : MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return rc;
}

bool td_web_is_api(const char *url)
{
    return strcmp(url, API_PREFIX) == 0 ||
           strncmp(url, API_PREFIX "/", strlen(API_PREFIX "/")) == 0;
}

bool td_web_serves(const char *url)
{
    return find_asset(url) || td_web_is_api(url);
}

enum MHD_Result td_web_send_error(struct MHD_Connection *conn, unsigned status, const char *code,
                                  const char *message)
{
    return send_error(conn, status, code, "%s", message);
}

/* ---- Paths and parameters ---------------------------------------------------------------- */

static int hex_digit(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Decodes the %XX escapes of src[0..len) into dst (cap bytes with its NUL). False for a
 * malformed escape, an escaped NUL, or a result that does not fit. */
static bool percent_decode(const char *src, size_t len, char *dst, size_t cap)
{
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        char c = src[i];
        if (c == '%') {
            int hi = i + 2 < len ? hex_digit(src[i + 1]) : -1;
            int lo = i + 2 < len ? hex_digit(src[i + 2]) : -1;
            if (hi < 0 || lo < 0 || (hi == 0 && lo == 0))
                return false;
            c = (char)(hi * 16 + lo);
            i += 2;
        }
        if (n + 1 >= cap)
            return false;
        dst[n++] = c;
    }
    dst[n] = '\0';
    return true;
}

typedef struct {
    td_web_kind_t kind;
    td_web_params_t *p;
    char error[256]; /* the first bad parameter, "" when all are good */
} args_t;

/* "0.5,0.99,0.999": decimals in [0, 1], each once (to the nearest millionth). */
static bool parse_quantiles(const char *text, td_web_params_t *p, char *why, size_t cap)
{
    const char *at = text;
    p->nquantiles = 0;
    for (;;) {
        size_t n = strcspn(at, ",");
        char item[32];
        char *end = NULL;
        double q = -1;
        if (n > 0 && n < sizeof item && strspn(at, "0123456789.") >= n) {
            memcpy(item, at, n);
            item[n] = '\0';
            q = strtod(item, &end);
            if (*end)
                q = -1;
        }
        if (!(q >= 0.0 && q <= 1.0)) {
            snprintf(why, cap, "quantiles: '%.*s' is not a number from 0 to 1", (int)(n < 32 ? n : 32),
                     at);
            return false;
        }
        bool seen = false;
        for (size_t i = 0; i < p->nquantiles; i++)
            seen |= (int64_t)(p->quantiles[i] * 1e6 + 0.5) == (int64_t)(q * 1e6 + 0.5);
        if (!seen && p->nquantiles == TALLY_QUANTILES_MAX) {
            snprintf(why, cap, "quantiles: at most %d", TALLY_QUANTILES_MAX);
            return false;
        }
        if (!seen)
            p->quantiles[p->nquantiles++] = q;
        if (!at[n])
            return true;
        at += n + 1;
    }
}

/* One query parameter of what kind allows. */
static bool parse_arg(args_t *a, const char *key, const char *value)
{
    char text[1024];
    bool events = a->kind == TD_WEB_EVENTS, one = a->kind == TD_WEB_STREAM ||
                                                   a->kind == TD_WEB_STREAM_EVENTS;
    if (!value || !percent_decode(value, strlen(value), text, sizeof text)) {
        snprintf(a->error, sizeof a->error, "parameter '%s': a value is needed (%%XX escapes)",
                 key);
        return false;
    }
    if ((one || events) && strcmp(key, "last") == 0) {
        if (tally_duration_parse(text, 1, TALLY_WINDOW_MS_MAX, &a->p->last_ms) == TALLY_OK)
            return true;
        snprintf(a->error, sizeof a->error,
                 "last: '%.64s' is not a duration (10s, 500ms, 2m, 1h) from 1 ms to %lld ms", text,
                 (long long)TALLY_WINDOW_MS_MAX);
        return false;
    }
    if ((one || events) && strcmp(key, "quantiles") == 0)
        return parse_quantiles(text, a->p, a->error, sizeof a->error);
    if (events && strcmp(key, "stream") == 0) {
        if (!tally_stream_name_valid(text, strlen(text))) {
            snprintf(a->error, sizeof a->error,
                     "stream: '%.64s' is not a stream name (1-64 printable ASCII bytes)", text);
            return false;
        }
        if (a->p->nstreams == TD_WEB_STREAMS_MAX) {
            snprintf(a->error, sizeof a->error, "stream: at most %d", TD_WEB_STREAMS_MAX);
            return false;
        }
        memcpy(a->p->streams[a->p->nstreams++], text, strlen(text) + 1);
        return true;
    }
    snprintf(a->error, sizeof a->error, "unknown parameter '%.64s'", key);
    return false;
}

static enum MHD_Result arg_cb(void *cls, enum MHD_ValueKind kind, const char *key,
                              const char *value)
{
    (void)kind;
    args_t *a = cls;
    return !a->error[0] && parse_arg(a, key, value) ? MHD_YES : MHD_NO;
}

/* The route of an API path: its kind and the stream it names (decoded into p->streams[0]).
 * Returns 0, or the HTTP status of the error written to why; *allow: the methods the path
 * takes (for 405). */
static unsigned route(const char *url, const char *method, td_web_kind_t *kind,
                      td_web_params_t *p, const char **allow, char *why, size_t cap)
{
    const char *rest = url + strlen(API_PREFIX);
    bool get = strcmp(method, MHD_HTTP_METHOD_GET) == 0 ||
               strcmp(method, MHD_HTTP_METHOD_HEAD) == 0;
    *allow = "GET, HEAD";
    if (strcmp(rest, "/streams") == 0 || strcmp(rest, "/events") == 0) {
        *kind = rest[1] == 's' ? TD_WEB_LIST : TD_WEB_EVENTS;
        return get ? 0 : MHD_HTTP_METHOD_NOT_ALLOWED;
    }
    if (strncmp(rest, "/streams/", 9) != 0) {
        snprintf(why, cap, "no such API path: %.128s", url);
        return MHD_HTTP_NOT_FOUND;
    }
    const char *seg = rest + 9, *slash = strchr(seg, '/');
    size_t len = slash ? (size_t)(slash - seg) : strlen(seg);
    const char *tail = slash ? slash : "";
    if (strcmp(tail, "") && strcmp(tail, "/reset") && strcmp(tail, "/events")) {
        snprintf(why, cap, "no such API path: %.128s", url);
        return MHD_HTTP_NOT_FOUND;
    }
    if (!percent_decode(seg, len, p->streams[0], sizeof p->streams[0]) ||
        !tally_stream_name_valid(p->streams[0], strlen(p->streams[0]))) {
        snprintf(why, cap, "'%.*s' is not a stream name: 1-64 printable ASCII bytes, escaped "
                 "as %%XX where a URL needs it", (int)(len < 200 ? len : 200), seg);
        return MHD_HTTP_BAD_REQUEST;
    }
    p->nstreams = 1;
    bool post = strcmp(method, MHD_HTTP_METHOD_POST) == 0;
    bool del = strcmp(method, MHD_HTTP_METHOD_DELETE) == 0;
    if (!strcmp(tail, "/reset")) {
        *allow = "POST";
        *kind = TD_WEB_RESET;
        return post ? 0 : MHD_HTTP_METHOD_NOT_ALLOWED;
    }
    if (!strcmp(tail, "/events")) {
        *kind = TD_WEB_STREAM_EVENTS;
        return get ? 0 : MHD_HTTP_METHOD_NOT_ALLOWED;
    }
    *allow = "GET, HEAD, DELETE";
    *kind = del ? TD_WEB_DELETE : TD_WEB_STREAM;
    return get || del ? 0 : MHD_HTTP_METHOD_NOT_ALLOWED;
}

/* ---- Credentials ------------------------------------------------------------------------- */

/* Whether the request carries "Authorization: Bearer TOKEN" with tallyd's token. */
static bool bearer_ok(const td_web_t *self, struct MHD_Connection *conn)
{
    const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
    if (!self->token[0] || !h || strncasecmp(h, "Bearer ", 7) != 0)
        return false;
    h += 7;
    while (*h == ' ')
        h++;
    return td_http_secret_equal(h, self->token);
}

/* Answers a request without the credentials it needs; MHD_YES with *refused false when it
 * may proceed. */
static enum MHD_Result check_credentials(const td_web_t *self, struct MHD_Connection *conn,
                                         td_web_kind_t kind, bool basic_ok, bool *refused)
{
    bool token = bearer_ok(self, conn);
    *refused = true;
    if (kind == TD_WEB_RESET || kind == TD_WEB_DELETE) {
        if (!self->token[0])
            return send_error(conn, MHD_HTTP_FORBIDDEN, "forbidden",
                              "this tallyd has no [metrics] api_token_file: its HTTP API is "
                              "read-only");
        if (!token)
            return send_error_with(conn, MHD_HTTP_UNAUTHORIZED, MHD_HTTP_HEADER_WWW_AUTHENTICATE,
                                   "Bearer realm=\"tallyd\"", "unauthorized",
                                   "resets and deletes need Authorization: Bearer with the "
                                   "token of [metrics] api_token_file");
    } else if (!basic_ok && !token) {
        return send_error_with(conn, MHD_HTTP_UNAUTHORIZED, MHD_HTTP_HEADER_WWW_AUTHENTICATE,
                               "Basic realm=\"tallyd\"", "unauthorized",
                               "this tallyd needs the credentials of [metrics] auth_file");
    }
    *refused = false;
    return MHD_YES;
}

/* ---- Jobs: libmicrohttpd's side ---------------------------------------------------------- */

static bool is_events(td_web_kind_t kind)
{
    return kind == TD_WEB_EVENTS || kind == TD_WEB_STREAM_EVENTS;
}

/* Queues the job for the loop thread and suspends its connection; the answer comes when the
 * loop resumes it. */
static enum MHD_Result queue_job(td_web_t *self, struct MHD_Connection *conn, void **con_cls,
                                 td_web_kind_t kind, const td_web_params_t *p)
{
    td_web_job_t *job = calloc(1, sizeof *job);
    if (!job)
        return send_error(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "internal", "out of memory");
    *job = (td_web_job_t){.tag = &td_web_job_tag, .web = self, .conn = conn, .kind = kind,
                          .params = *p};
    pthread_mutex_lock(&self->lock);
    bool closed = !self->ready || self->closing;
    bool full = !closed && is_events(kind) && self->sse_open >= self->max_sse;
    if (closed || full) {
        pthread_mutex_unlock(&self->lock);
        free(job);
        if (closed)
            return send_error(conn, MHD_HTTP_SERVICE_UNAVAILABLE, "shutdown",
                              "tallyd is shutting down");
        return send_error_with(conn, MHD_HTTP_SERVICE_UNAVAILABLE, "Retry-After", "5",
                               "too_many_event_streams",
                               "%u event streams are open ([metrics] max_sse_clients)",
                               self->max_sse);
    }
    if (is_events(kind)) {
        self->sse_open++;
        job->sse_reserved = true;
    }
    if (self->tail)
        self->tail->next = job;
    else
        self->head = job;
    self->tail = job;
    *con_cls = job;
    MHD_suspend_connection(conn);
    pthread_mutex_unlock(&self->lock);
    if (uv_async_send(&self->async) != 0)
        td_warn("web: cannot wake the loop thread"); /* the next job or tick takes it */
    return MHD_YES;
}

/* The connection was resumed: sends the job's answer. */
static enum MHD_Result send_answer(td_web_t *self, td_web_job_t *job)
{
    pthread_mutex_lock(&self->lock);
    bool answered = job->answered;
    td_sse_t *sse = job->sse;
    job->sse_handed = sse != NULL;
    char *body = job->body;
    job->body = NULL;
    pthread_mutex_unlock(&self->lock);
    if (!answered) /* cannot happen: only an answer resumes a job's connection */
        return MHD_NO;
    if (sse)
        return td_sse_respond(self, sse, job->conn);
    return send_json(job->conn, job->status, body, job->len, NULL, NULL);
}

static enum MHD_Result api(td_web_t *self, struct MHD_Connection *conn, const char *url,
                           const char *method, void **con_cls, bool basic_ok)
{
    td_web_params_t *p = calloc(1, sizeof *p);
    if (!p)
        return send_error(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "internal", "out of memory");
    td_web_kind_t kind = TD_WEB_LIST;
    const char *allow = NULL;
    char why[320] = "";
    enum MHD_Result rc = MHD_YES;
    bool refused = false;
    unsigned status = route(url, method, &kind, p, &allow, why, sizeof why);
    if (status == MHD_HTTP_METHOD_NOT_ALLOWED)
        rc = send_error_with(conn, status, MHD_HTTP_HEADER_ALLOW, allow, "method_not_allowed",
                             "%s takes %s", url, allow);
    else if (status)
        rc = send_error(conn, status, status == MHD_HTTP_NOT_FOUND ? "not_found" : "stream_name",
                        "%s", why);
    if (!status)
        rc = check_credentials(self, conn, kind, basic_ok, &refused);
    if (!status && !refused) {
        args_t a = {.kind = kind, .p = p};
        MHD_get_connection_values(conn, MHD_GET_ARGUMENT_KIND, arg_cb, &a);
        rc = a.error[0] ? send_error(conn, MHD_HTTP_BAD_REQUEST, "bad_parameter", "%s", a.error)
                        : queue_job(self, conn, con_cls, kind, p);
    }
    free(p);
    return rc;
}

enum MHD_Result td_web_handle(td_web_t *self, struct MHD_Connection *conn, const char *url,
                              const char *method, void **con_cls, bool basic_ok)
{
    td_web_job_t *job = *con_cls;
    if (job && job->tag == &td_web_job_tag)
        return send_answer(self, job);
    const td_web_asset_t *asset = find_asset(url);
    if (!asset)
        return api(self, conn, url, method, con_cls, basic_ok);
    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
        return send_error_with(conn, MHD_HTTP_METHOD_NOT_ALLOWED, MHD_HTTP_HEADER_ALLOW,
                               "GET, HEAD", "method_not_allowed", "%s takes GET, HEAD", url);
    if (!basic_ok) {
        bool refused = false;
        enum MHD_Result rc = check_credentials(self, conn, TD_WEB_LIST, false, &refused);
        if (refused)
            return rc;
    }
    return send_asset(conn, asset);
}

bool td_web_request_done(td_web_t *self, void *con_cls)
{
    td_web_job_t *job = con_cls;
    if (!job || job->tag != &td_web_job_tag)
        return false;
    if (job->sse && !job->sse_handed) /* the stream's response was never made */
        td_sse_release(self, job->sse);
    pthread_mutex_lock(&self->lock);
    if (job->sse_reserved)
        self->sse_open--;
    if (job->answered && !job->sse && --self->unwritten == 0)
        pthread_cond_broadcast(&self->written);
    pthread_mutex_unlock(&self->lock);
    free(job->body);
    free(job);
    return true;
}

/* ---- Jobs: the loop thread's side -------------------------------------------------------- */

void td_web_answer(td_web_t *self, td_web_job_t *job, unsigned status, char *body, size_t len)
{
    pthread_mutex_lock(&self->lock);
    if (!job->sse)
        self->unwritten++; /* until libmicrohttpd completes the request (td_web_request_done) */
    job->answered = true;
    job->status = status;
    job->body = body;
    job->len = len;
    pthread_mutex_unlock(&self->lock);
    MHD_resume_connection(job->conn);
}

void td_web_answer_error(td_web_t *self, td_web_job_t *job, unsigned status, const char *code,
                         const char *message)
{
    size_t len = 0;
    char *body = td_web_error_json(&len, code, "%s", message);
    td_web_answer(self, job, body ? status : MHD_HTTP_INTERNAL_SERVER_ERROR, body, len);
}

void td_web_answer_buf(td_web_t *self, td_web_job_t *job, tally_status_t st, tally_buf_t *out,
                       const char *msg)
{
    if (st == TALLY_OK) {
        td_web_answer(self, job, MHD_HTTP_OK, (char *)out->data, out->len);
        return;
    }
    tally_buf_free(out);
    td_web_answer_error(self, job, td_web_http_status(st), tally_status_name(st), msg);
}

/* A reset's or delete's reply from the request path. */
static void control_done(void *arg, const tally_rep_t *rep, const void *payload, size_t len)
{
    td_web_job_t *job = arg;
    tally_status_t st = (tally_status_t)rep->status;
    tally_buf_t out = {0};
    char msg[TALLY_ERROR_MESSAGE_MAX + 1];
    snprintf(msg, sizeof msg, "%.*s", payload ? (int)len : 0, payload ? (const char *)payload : "");
    if (st == TALLY_OK) {
        st = tally_buf_printf(&out, "{\"stream\":");
        if (st == TALLY_OK)
            st = tally_json_string(job->params.streams[0], &out);
        if (st == TALLY_OK)
            st = tally_buf_printf(&out, ",\"%s\":true}",
                                  job->kind == TD_WEB_RESET ? "reset" : "deleted");
        if (st != TALLY_OK)
            snprintf(msg, sizeof msg, "out of memory");
    }
    td_web_answer_buf(job->web, job, st, &out, msg);
}

/* A query's reply from the request path: the record rendered as `tally query --json`. */
static void query_done(void *arg, const tally_rep_t *rep, const void *payload, size_t len)
{
    td_web_job_t *job = arg;
    tally_buf_t out = {0};
    char msg[TALLY_ERROR_MESSAGE_MAX + 1];
    tally_status_t st = td_web_reply_json(job->params.streams[0], &job->params, rep, payload,
                                          len, &out, msg, sizeof msg);
    td_web_answer_buf(job->web, job, st, &out, msg);
}

/* A query, reset or delete of the job's stream, handed to the request path like the opcode:
 * ordered after the stream's queued requests, answered when it is done. */
static void submit(td_web_t *self, td_web_job_t *job)
{
    static const uint8_t opcodes[] = {[TD_WEB_STREAM] = TALLY_OP_QUERY,
                                      [TD_WEB_RESET] = TALLY_OP_RESET,
                                      [TD_WEB_DELETE] = TALLY_OP_DELETE};
    tally_req_t req = {.opcode = opcodes[job->kind]};
    if (job->kind == TD_WEB_STREAM && job->params.last_ms) {
        req.flags = TALLY_FLAG_QUERY_WINDOW;
        req.lo = (int64_t)job->params.last_ms;
    }
    if (tally_req_set_stream(&req, job->params.streams[0]) != TALLY_OK) { /* checked before */
        td_web_answer_error(self, job, MHD_HTTP_BAD_REQUEST, "stream_name", "not a stream name");
        return;
    }
    self->host.submit(self->host.ctx, &req, job->kind == TD_WEB_STREAM ? query_done : control_done,
                      job);
}

/* An event stream: the window checked, the stream found (for one stream's events), its first
 * events rendered; the response then streams it. */
static void open_events(td_web_t *self, td_web_job_t *job)
{
    char msg[TALLY_ERROR_MESSAGE_MAX + 1];
    const td_web_params_t *p = &job->params;
    tally_status_t st = self->host.view(self->host.ctx, NULL, p->last_ms, NULL, &(uint64_t){0},
                                        &(uint64_t){0}, msg, sizeof msg);
    if (st == TALLY_OK && job->kind == TD_WEB_STREAM_EVENTS &&
        !td_streams_find(self->host.streams, p->streams[0], strlen(p->streams[0]))) {
        snprintf(msg, sizeof msg, "no stream named '%s'", p->streams[0]);
        st = TALLY_E_UNKNOWN_STREAM;
    }
    if (st != TALLY_OK) {
        td_web_answer_error(self, job, td_web_http_status(st), tally_status_name(st), msg);
        return;
    }
    td_sse_t *sse = td_sse_open(self, p, job->kind == TD_WEB_EVENTS);
    if (!sse) {
        td_web_answer_error(self, job, MHD_HTTP_INTERNAL_SERVER_ERROR, "internal", "out of memory");
        return;
    }
    pthread_mutex_lock(&self->lock);
    job->sse = sse;
    job->sse_reserved = false; /* the stream holds the place now */
    pthread_mutex_unlock(&self->lock);
    td_web_answer(self, job, MHD_HTTP_OK, NULL, 0);
}

static void run_job(td_web_t *self, td_web_job_t *job)
{
    td_gauges_t g;
    self->host.gauges(self->host.ctx, &g);
    /* Like the opcodes while tallyd drains: every request answered `shutdown` (a query,
     * reset or delete gets it from the request path itself). */
    bool path = job->kind == TD_WEB_STREAM || job->kind == TD_WEB_RESET ||
                job->kind == TD_WEB_DELETE;
    if (g.stopping && !path) {
        td_web_answer_error(self, job, MHD_HTTP_SERVICE_UNAVAILABLE, "shutdown",
                     "tallyd is shutting down");
        return;
    }
    tally_buf_t out = {0};
    char msg[TALLY_ERROR_MESSAGE_MAX + 1] = "out of memory";
    if (td_web_fleet_asks(self, job))
        return; /* the whole fleet's list, or a stream another member owns */
    switch (job->kind) {
    case TD_WEB_LIST:
        td_web_answer_buf(self, job, td_web_list_json(self, &out), &out, msg);
        return;
    case TD_WEB_STREAM:
    case TD_WEB_RESET:
    case TD_WEB_DELETE:
        submit(self, job);
        return;
    default:
        open_events(self, job);
        return;
    }
}

static void async_cb(uv_async_t *handle)
{
    td_web_t *self = handle->data;
    pthread_mutex_lock(&self->lock);
    td_web_job_t *job = self->head;
    self->head = self->tail = NULL;
    pthread_mutex_unlock(&self->lock);
    td_streams_hold(self->host.streams); /* the shards stopped while the jobs read the table */
    while (job) {
        td_web_job_t *next = job->next; /* the answer may free job (once resumed) */
        run_job(self, job);
        job = next;
    }
    td_streams_release(self->host.streams);
}

static void tick_cb(uv_timer_t *timer)
{
    td_web_t *self = timer->data;
    td_streams_hold(self->host.streams);
    td_sse_tick(self);
    td_streams_release(self->host.streams);
}

/* ---- Life cycle -------------------------------------------------------------------------- */

/* The API token of cfg's api_token_file (none: "") into token (TD_WEB_TOKEN_MAX bytes). */
static td_err_t read_token(const td_config_t *cfg, char *token)
{
    const char *path = cfg->metrics_api_token_file;
    td_err_t err =
        path ? td_http_read_secret(path, "api_token_file", token, TD_WEB_TOKEN_MAX) : TD_OK;
    if (err == TD_OK && path && strlen(token) < 16) {
        td_err("web: the token in %s is too short: 16 characters at least (openssl rand -hex "
               "32)",
               path);
        err = TD_ERR_IO;
    }
    return err;
}

td_err_t td_web_check(const td_config_t *cfg)
{
    char token[TD_WEB_TOKEN_MAX];
    td_err_t err = read_token(cfg, token);
    explicit_bzero(token, sizeof token);
    return err;
}

td_err_t td_web_new(const td_service_host_t *host, td_http_guard_t *guard, td_web_t **out)
{
    td_web_t *self = calloc(1, sizeof *self);
    if (!self)
        return TD_ERR_NOMEM;
    self->host = *host;
    self->guard = guard;
    self->max_sse = host->cfg->metrics_max_sse_clients;
    td_err_t err = read_token(host->cfg, self->token);
    int rc = err == TD_OK ? pthread_mutex_init(&self->lock, NULL) : 0;
    if (err == TD_OK && rc == 0 && (rc = pthread_cond_init(&self->written, NULL)) != 0)
        pthread_mutex_destroy(&self->lock);
    if (rc != 0) {
        td_err("web: cannot create a lock: %s", strerror(rc));
        err = TD_ERR_LIBRARY;
    }
    if (err != TD_OK) {
        explicit_bzero(self->token, sizeof self->token);
        free(self);
        return err;
    }
    *out = self;
    return TD_OK;
}

td_err_t td_web_open(td_web_t *self)
{
    int rc = uv_async_init(self->host.loop, &self->async, async_cb);
    if (rc == 0) {
        self->async.data = self;
        self->handles_open = 1;
        rc = uv_timer_init(self->host.loop, &self->tick);
    }
    if (rc == 0) {
        self->tick.data = self;
        self->handles_open = 2;
        uint64_t every = td_web_tick_ms(self->host.cfg);
        rc = uv_timer_start(&self->tick, tick_cb, every, every);
    }
    if (rc != 0) {
        td_err("web: cannot create the loop's handles: %s", uv_strerror(rc));
        return TD_ERR_LIBRARY;
    }
    pthread_mutex_lock(&self->lock);
    self->ready = true;
    pthread_mutex_unlock(&self->lock);
    return TD_OK;
}

/* Waits (at most TD_WEB_CLOSE_WAIT_MS) until libmicrohttpd has written every answer given, the
 * 503s td_web_close just queued among them: MHD_stop_daemon, which comes next, closes each
 * connection whether its response went out or not. */
static void wait_written(td_web_t *self)
{
    struct timespec deadline = td_http_deadline(TD_WEB_CLOSE_WAIT_MS);
    int rc = 0;
    pthread_mutex_lock(&self->lock);
    while (self->unwritten > 0 && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&self->written, &self->lock, &deadline);
    unsigned left = self->unwritten;
    pthread_mutex_unlock(&self->lock);
    if (left)
        td_warn("web: %u answers not written after %d ms; their connections close without them",
                left, TD_WEB_CLOSE_WAIT_MS);
}

void td_web_close(td_web_t *self)
{
    pthread_mutex_lock(&self->lock);
    self->closing = true;
    td_web_job_t *job = self->head;
    self->head = self->tail = NULL;
    pthread_mutex_unlock(&self->lock);
    td_web_fleet_close(self);
    while (job) {
        td_web_job_t *next = job->next;
        td_web_answer_error(self, job, MHD_HTTP_SERVICE_UNAVAILABLE, "shutdown",
                     "tallyd is shutting down");
        job = next;
    }
    td_sse_close_all(self);
    wait_written(self);
}

static void free_web(td_web_t *self)
{
    pthread_cond_destroy(&self->written);
    pthread_mutex_destroy(&self->lock);
    explicit_bzero(self->token, sizeof self->token);
    free(self);
}

static void handle_closed(uv_handle_t *handle)
{
    td_web_t *self = handle->data;
    if (++self->handles_closing == self->handles_open)
        free_web(self);
}

void td_web_destroy(td_web_t **self_p)
{
    td_web_t *self = *self_p;
    if (!self)
        return;
    *self_p = NULL;
    td_sse_drop_all(self);
    if (self->handles_open == 0) {
        free_web(self);
        return;
    }
    uv_close((uv_handle_t *)&self->async, handle_closed);
    if (self->handles_open == 2)
        uv_close((uv_handle_t *)&self->tick, handle_closed);
}
