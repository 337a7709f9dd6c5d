/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_web_sse.c — event streams (Server-Sent Events) of the web page and the API (td_web.h).
 *
 * Design
 * ------
 * An event stream is a response of unknown length whose bytes come from a buffer: the loop
 * thread writes events into it at every publication tick (pub_interval_ms), libmicrohttpd's
 * thread reads them out (sse_read) as the socket takes them. When the buffer is empty the
 * reader suspends the connection (libmicrohttpd would otherwise call it again at once, a busy
 * loop); the loop resumes it when it writes more. One mutex (td_web_t.lock) covers the buffer
 * and the flags, so a write and a suspension cannot cross.
 *
 * What a tick writes, per stream: the list (`event: streams`, for /api/v1/events), then
 * `event: stream` with the record of each named stream that changed since it was last sent
 * (its update time, batches, values or last_seq differ; a window view is sent every tick, since
 * time moves its window), or `event: deleted` once when one disappears; `: keepalive` when
 * nothing was written for TD_SSE_HEARTBEAT_MS. Each record is td_web_record_json's, the API's.
 *
 * Bounds: max_sse_clients streams at once (td_web.c counts them from the request on); a client
 * that leaves more than TD_SSE_BACKLOG_MAX bytes unread is ended (its browser reconnects and
 * starts from the present). A suspended connection is not watched by libmicrohttpd, so at every
 * tick the loop peeks at each suspended stream's socket (MSG_PEEK: nothing is consumed) and
 * ends a stream whose client has closed it; the socket is libmicrohttpd's, but while the
 * connection is suspended libmicrohttpd neither reads, closes nor reuses it.
 *
 * Lifetime: two references, the loop's list and the response; the response's goes when
 * libmicrohttpd frees it (sse_free: the connection ended), the list's at the next tick after
 * that, and the last one frees the stream and its place among max_sse_clients.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "td_log.h"
#include "td_web_int.h"

/* What a stream looked like when it was last sent: a change in any of these is news. */
typedef struct {
    bool present;
    uint64_t updated_ms, batches, last_seq, hist_total;
} seen_t;

struct td_sse {
    td_web_t *web;
    td_sse_t *next; /* loop: the list */
    /* Under web->lock. */
    struct MHD_Connection *conn; /* NULL until the response is made, and after it is freed */
    int fd;                      /* the connection's socket, for the peek; -1 when none */
    char *buf;
    size_t len, pos, cap; /* bytes written, bytes read out, room */
    bool suspended;       /* by the reader, waiting for bytes */
    bool ended;           /* no more events: the reader ends the response */
    bool gone;            /* the response was freed: the connection is over */
    unsigned refs;
    /* Loop thread. */
    td_web_params_t params;
    bool list;
    uint64_t written_ms; /* when it was last written to (monotonic ms) */
    seen_t seen[TD_WEB_STREAMS_MAX];
};

/* ---- Writing events (loop thread) -------------------------------------------------------- */

static tally_status_t event(tally_buf_t *out, const char *name, const tally_buf_t *data)
{
    tally_status_t st = tally_buf_printf(out, "event: %s\ndata: ", name);
    if (st == TALLY_OK)
        st = tally_buf_append(out, data->data, data->len);
    return st == TALLY_OK ? tally_buf_printf(out, "\n\n") : st;
}

/* The events of stream i of c that are news (all of them when `first`). */
static tally_status_t stream_events(td_web_t *web, td_sse_t *c, unsigned i, bool first,
                                    tally_buf_t *out)
{
    const char *name = c->params.streams[i];
    const td_stream_t *s = td_streams_find(web->host.streams, name, strlen(name));
    seen_t *seen = &c->seen[i];
    tally_buf_t data = {0};
    tally_status_t st = TALLY_OK;
    if (!s) {
        if (first || seen->present) {
            st = tally_buf_printf(&data, "{\"stream\":");
            if (st == TALLY_OK)
                st = tally_json_string(name, &data);
            if (st == TALLY_OK)
                st = tally_buf_printf(&data, "}");
            if (st == TALLY_OK)
                st = event(out, "deleted", &data);
        }
        seen->present = false;
        tally_buf_free(&data);
        return st;
    }
    seen_t now = {true, s->updated_ms, s->info.batches, s->info.last_seq, s->info.hist_total};
    if (!first && !c->params.last_ms && memcmp(&now, seen, sizeof now) == 0)
        return TALLY_OK;
    char msg[TALLY_ERROR_MESSAGE_MAX + 1];
    st = td_web_record_json(web, name, &c->params, &data, msg, sizeof msg);
    if (st == TALLY_OK)
        st = event(out, "stream", &data);
    else if (st != TALLY_E_NOMEM) /* cannot happen: the window was checked at the start */
        st = TALLY_OK;
    if (st == TALLY_OK)
        *seen = now;
    tally_buf_free(&data);
    return st;
}

/* Everything c has to say now: the list (already rendered, or NULL), its streams' news, or a
 * keepalive when it has said nothing for a while. */
static tally_status_t render(td_web_t *web, td_sse_t *c, const tally_buf_t *list, bool first,
                             uint64_t now_ms, tally_buf_t *out)
{
    tally_status_t st = TALLY_OK;
    if (first)
        st = tally_buf_printf(out, "retry: 2000\n\n");
    if (st == TALLY_OK && c->list && list)
        st = event(out, "streams", list);
    for (unsigned i = 0; i < c->params.nstreams && st == TALLY_OK; i++)
        st = stream_events(web, c, i, first, out);
    if (st == TALLY_OK && !out->len && now_ms - c->written_ms >= TD_SSE_HEARTBEAT_MS)
        st = tally_buf_printf(out, ": keepalive\n\n");
    if (out->len)
        c->written_ms = now_ms;
    return st;
}

/* Appends out to c's buffer (or ends c when its client lags too far); returns the connection
 * to resume, or NULL. */
static struct MHD_Connection *push(td_web_t *web, td_sse_t *c, const tally_buf_t *out)
{
    struct MHD_Connection *resume = NULL;
    pthread_mutex_lock(&web->lock);
    if (c->pos) { /* what was read out makes room */
        memmove(c->buf, c->buf + c->pos, c->len - c->pos);
        c->len -= c->pos;
        c->pos = 0;
    }
    if (!c->ended && !c->gone && out->len) {
        if (c->len + out->len > TD_SSE_BACKLOG_MAX) {
            c->ended = true;
            td_info("web: an event stream's client left %zu bytes unread; ending it", c->len);
        } else if (c->len + out->len > c->cap) {
            size_t cap = (c->len + out->len) * 2;
            char *buf = realloc(c->buf, cap);
            if (buf) {
                c->buf = buf;
                c->cap = cap;
            } else {
                c->ended = true; /* its browser reconnects */
            }
        }
        if (!c->ended) {
            memcpy(c->buf + c->len, out->data, out->len);
            c->len += out->len;
        }
    }
    if (c->suspended && (c->len > c->pos || c->ended)) {
        c->suspended = false;
        resume = c->conn;
    }
    pthread_mutex_unlock(&web->lock);
    return resume;
}

/* Writes c's news; resumes its connection when it waits. */
static void update(td_web_t *web, td_sse_t *c, const tally_buf_t *list, bool first,
                   uint64_t now_ms)
{
    tally_buf_t out = {0};
    if (render(web, c, list, first, now_ms, &out) != TALLY_OK) {
        tally_buf_free(&out);
        pthread_mutex_lock(&web->lock);
        c->ended = true; /* out of memory: its browser reconnects */
        pthread_mutex_unlock(&web->lock);
    }
    struct MHD_Connection *resume = push(web, c, &out);
    tally_buf_free(&out);
    if (resume)
        MHD_resume_connection(resume);
}

td_sse_t *td_sse_open(td_web_t *self, const td_web_params_t *p, bool list)
{
    td_sse_t *c = calloc(1, sizeof *c);
    tally_buf_t first = {0};
    if (!c || (list && td_web_list_json(self, &first) != TALLY_OK)) {
        tally_buf_free(&first);
        free(c);
        return NULL;
    }
    c->web = self;
    c->fd = -1;
    c->refs = 2; /* the list's and the response's */
    c->params = *p;
    c->list = list;
    update(self, c, &first, true, uv_hrtime() / 1000000u);
    tally_buf_free(&first);
    c->next = self->sse;
    self->sse = c;
    return c;
}

/* ---- Reading them out (libmicrohttpd's thread) ------------------------------------------- */

static ssize_t sse_read(void *cls, uint64_t pos, char *out, size_t max)
{
    (void)pos;
    td_sse_t *c = cls;
    td_web_t *web = c->web;
    pthread_mutex_lock(&web->lock);
    if (c->len > c->pos) {
        size_t n = c->len - c->pos < max ? c->len - c->pos : max;
        memcpy(out, c->buf + c->pos, n);
        c->pos += n;
        pthread_mutex_unlock(&web->lock);
        return (ssize_t)n;
    }
    if (c->ended || web->closing) {
        pthread_mutex_unlock(&web->lock);
        return MHD_CONTENT_READER_END_OF_STREAM;
    }
    c->suspended = true;
    MHD_suspend_connection(c->conn);
    pthread_mutex_unlock(&web->lock);
    return 0;
}

/* The response is freed: the connection is over (or never was). */
static void sse_free(void *cls)
{
    td_sse_t *c = cls;
    td_web_t *web = c->web;
    pthread_mutex_lock(&web->lock);
    c->gone = true;
    c->conn = NULL;
    c->fd = -1;
    pthread_mutex_unlock(&web->lock);
    td_sse_release(web, c);
}

enum MHD_Result td_sse_respond(td_web_t *self, td_sse_t *sse, struct MHD_Connection *conn)
{
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, sse_read, sse, sse_free);
    if (!resp) {
        td_sse_release(self, sse);
        return MHD_NO;
    }
    const union MHD_ConnectionInfo *fd =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    pthread_mutex_lock(&self->lock);
    sse->conn = conn;
    sse->fd = fd ? fd->connect_fd : -1;
    pthread_mutex_unlock(&self->lock);
    bool ok = MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream") ==
                  MHD_YES &&
              MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store") == MHD_YES &&
              MHD_add_response_header(resp, "X-Accel-Buffering", "no") == MHD_YES &&
              MHD_add_response_header(resp, "X-Content-Type-Options", "nosniff") == MHD_YES;
    if (!ok)
        td_warn("web: cannot add an event stream's headers");
    /* Long-lived by nature: no idle timeout and no request deadline from here on (the guard
     * still counts it); it ends at shutdown, when its client goes, or when it lags. */
    MHD_set_connection_option(conn, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    td_http_guard_streaming(self->guard, conn);
    enum MHD_Result rc = MHD_queue_response(conn, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return rc;
}

void td_sse_release(td_web_t *self, td_sse_t *sse)
{
    pthread_mutex_lock(&self->lock);
    bool last = --sse->refs == 0;
    if (last)
        self->sse_open--;
    pthread_mutex_unlock(&self->lock);
    if (!last)
        return;
    free(sse->buf);
    free(sse);
}

/* ---- The tick (loop thread) -------------------------------------------------------------- */

/* With the lock held: a suspended stream whose client has closed its end (or whose socket
 * failed) ends; returns its connection to resume, or NULL. */
static struct MHD_Connection *peek_gone(td_sse_t *c)
{
    if (!c->suspended || c->fd < 0)
        return NULL;
    char b;
    ssize_t n = recv(c->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0 || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)))
        return NULL;
    c->ended = true;
    c->suspended = false;
    return c->conn;
}

/* Drops the streams whose connections are over; returns whether any stream wants the list. */
static bool sweep(td_web_t *self)
{
    bool list = false;
    for (td_sse_t **link = &self->sse; *link;) {
        td_sse_t *c = *link;
        pthread_mutex_lock(&self->lock);
        bool gone = c->gone;
        struct MHD_Connection *resume = gone ? NULL : peek_gone(c);
        pthread_mutex_unlock(&self->lock);
        if (resume)
            MHD_resume_connection(resume);
        if (gone) {
            *link = c->next;
            td_sse_release(self, c);
            continue;
        }
        list |= c->list;
        link = &c->next;
    }
    return list;
}

void td_sse_tick(td_web_t *self)
{
    pthread_mutex_lock(&self->lock);
    bool closing = self->closing;
    pthread_mutex_unlock(&self->lock);
    if (closing)
        return;
    bool want_list = sweep(self);
    if (!self->sse)
        return;
    tally_buf_t list = {0};
    bool have_list = want_list && td_web_list_json(self, &list) == TALLY_OK;
    uint64_t now = uv_hrtime() / 1000000u;
    for (td_sse_t *c = self->sse; c; c = c->next)
        update(self, c, have_list ? &list : NULL, false, now);
    tally_buf_free(&list);
}

void td_sse_close_all(td_web_t *self)
{
    for (td_sse_t *c = self->sse; c; c = c->next) {
        pthread_mutex_lock(&self->lock);
        struct MHD_Connection *resume = c->suspended ? c->conn : NULL;
        c->ended = true;
        c->suspended = false;
        pthread_mutex_unlock(&self->lock);
        if (resume)
            MHD_resume_connection(resume);
    }
}

void td_sse_drop_all(td_web_t *self)
{
    while (self->sse) {
        td_sse_t *c = self->sse;
        self->sse = c->next;
        td_sse_release(self, c);
    }
}
