/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_http_guard.c — see td_http_guard.h.
 *
 * Design
 * ------
 * Every connection libmicrohttpd accepts gets a slot from a pool sized at start (its hard
 * connection limit), so the callbacks never allocate. Live slots sit in one list ordered by
 * the time each became ready for a request: a new connection is appended with "now", and a
 * connection whose response was sent moves to the tail with "now". Every connection has the
 * same deadline after that time, so the list is also in deadline order, and the deadline thread
 * needs to look only at its head: it shuts down every head whose deadline has passed, then
 * sleeps until the new head's (or a whole deadline when the list is empty: anything appended
 * later ends later). No timer per connection, no scan.
 *
 * A slot leaves the live list when it is shut down (deadline or room made) or closed; it goes
 * back to the pool only when libmicrohttpd says the connection is closed, before it closes the
 * descriptor, so a descriptor is never shut down after it was closed and reused.
 *
 * The accept policy counts the live connections from the new one's address by walking the
 * list (a few hundred entries at most, once per accepted connection: microseconds). Event
 * streams sit in a list of their own, which neither bound counts (td_http_guard.h).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "td_http_guard.h"
#include "td_log.h"
#include "td_monotonic.h"

/* How often, at most, the guard logs what it closed and refused (a summary line). */
#define LOG_EVERY_NS (10ull * 1000000000ull)
#define ADDR_KEY 9 /* the family, then 4 bytes of IPv4 or the 8 of an IPv6 /64 */

typedef struct conn {
    struct conn *prev, *next; /* the live list, or (next) the pool of free slots */
    uint8_t addr[ADDR_KEY];
    int fd;            /* -1 when libmicrohttpd did not say */
    uint64_t ready_ns; /* ready for a request since: accepted, or its last response sent */
    uint64_t served;   /* responses sent on it */
    bool busy;         /* a request's headers are in and its response is not yet sent */
    bool live;         /* in the live list, or with `streaming` in the streaming list */
    bool streaming;    /* an event stream: no deadline while it streams */
} conn_t;

struct td_http_guard {
    td_http_limits_t limits;
    pthread_mutex_t lock; /* guards everything below */
    pthread_cond_t wake;  /* the deadline thread's sleep; signalled to stop it */
    pthread_t thread;
    bool stopping;
    conn_t *slots;
    unsigned slot_count;
    conn_t *pool;
    conn_t *head, *tail;       /* the live list, in deadline order */
    conn_t *s_head, *s_tail;   /* the streaming list: in no bound, never closed by the guard */
    unsigned live;             /* connections in the live list (the bounds count these) */
    td_http_guard_counts_t counts; /* since start */
    td_http_guard_counts_t logged; /* at the last summary line */
    uint64_t logged_ns;
};

/* The per-address key: an IPv4 address (an IPv4-mapped IPv6 one too), or an IPv6 /64, which
 * one host usually has whole. */
static void address_key(const struct sockaddr *sa, uint8_t key[ADDR_KEY])
{
    memset(key, 0, ADDR_KEY);
    if (!sa)
        return;
    if (sa->sa_family == AF_INET) {
        key[0] = 4;
        memcpy(key + 1, &((const struct sockaddr_in *)sa)->sin_addr, 4);
    } else { /* AF_INET6: the listener is an IPv4 or an IPv6 TCP socket */
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        bool mapped = IN6_IS_ADDR_V4MAPPED(a);
        key[0] = mapped ? 4 : 6;
        memcpy(key + 1, a->s6_addr + (mapped ? 12 : 0), mapped ? 4 : 8);
    }
}

/* Unlinks c from its list (the live one, or the streaming one). */
static void unlink_live(td_http_guard_t *self, conn_t *c)
{
    conn_t **head = c->streaming ? &self->s_head : &self->head;
    conn_t **tail = c->streaming ? &self->s_tail : &self->tail;
    if (c->prev)
        c->prev->next = c->next;
    else
        *head = c->next;
    if (c->next)
        c->next->prev = c->prev;
    else
        *tail = c->prev;
    c->prev = c->next = NULL;
    c->live = false;
    self->live -= !c->streaming;
}

/* Appends c to the live list, or with `streaming` to the streaming list. */
static void append_to(td_http_guard_t *self, conn_t *c, bool streaming)
{
    conn_t **head = streaming ? &self->s_head : &self->head;
    conn_t **tail = streaming ? &self->s_tail : &self->tail;
    c->prev = *tail;
    c->next = NULL;
    if (*tail)
        (*tail)->next = c;
    else
        *head = c;
    *tail = c;
    c->live = true;
    c->streaming = streaming;
    self->live += !streaming;
}

static void append_live(td_http_guard_t *self, conn_t *c)
{
    append_to(self, c, false);
}

/* Ends the connection: libmicrohttpd reads the end of the stream and closes it. */
static void shut(td_http_guard_t *self, conn_t *c)
{
    unlink_live(self, c);
    if (c->fd >= 0)
        shutdown(c->fd, SHUT_RDWR);
}

/* The oldest live connection waiting for a request, from key's address (NULL: any). */
static conn_t *oldest_idle(td_http_guard_t *self, const uint8_t *key)
{
    for (conn_t *c = self->head; c; c = c->next)
        if (!c->busy && (!key || memcmp(c->addr, key, ADDR_KEY) == 0))
            return c;
    return NULL;
}

/* With the lock held: makes room under a bound by closing the oldest idle connection
 * matching key (NULL: any); false when every one is busy. */
static bool make_room(td_http_guard_t *self, const uint8_t *key)
{
    conn_t *victim = oldest_idle(self, key);
    if (!victim)
        return false;
    shut(self, victim);
    self->counts.evicted++;
    return true;
}

enum MHD_Result td_http_guard_accept(void *cls, const struct sockaddr *addr, socklen_t addrlen)
{
    td_http_guard_t *self = cls;
    uint8_t key[ADDR_KEY];
    address_key(addrlen ? addr : NULL, key);
    pthread_mutex_lock(&self->lock);
    unsigned same = 0; /* event streams, in their own list, count in neither bound */
    for (conn_t *c = self->head; c; c = c->next)
        same += memcmp(c->addr, key, ADDR_KEY) == 0;
    bool ok = same < self->limits.max_per_address || make_room(self, key);
    if (ok && self->live >= self->limits.max_connections)
        ok = make_room(self, NULL);
    if (!ok)
        self->counts.refused++;
    pthread_mutex_unlock(&self->lock);
    return ok ? MHD_YES : MHD_NO;
}

/* With the lock held: a slot for a new connection, live from now; NULL when the pool is empty
 * (it is as large as libmicrohttpd's own limit, so only if libmicrohttpd let more in). */
static conn_t *track(td_http_guard_t *self, struct MHD_Connection *conn)
{
    conn_t *c = self->pool;
    if (!c)
        return NULL;
    self->pool = c->next;
    const union MHD_ConnectionInfo *fd =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    const union MHD_ConnectionInfo *addr =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    *c = (conn_t){.fd = fd ? fd->connect_fd : -1, .ready_ns = td_mono_ns()};
    address_key(addr ? addr->client_addr : NULL, c->addr);
    append_live(self, c);
    return c;
}

void td_http_guard_notify(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode code)
{
    td_http_guard_t *self = cls;
    pthread_mutex_lock(&self->lock);
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        *socket_context = track(self, conn);
    } else if (*socket_context) {
        conn_t *c = *socket_context;
        if (c->live)
            unlink_live(self, c);
        c->next = self->pool;
        self->pool = c;
        *socket_context = NULL;
    }
    pthread_mutex_unlock(&self->lock);
}

static conn_t *slot_of(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *info =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return info ? info->socket_context : NULL;
}

void td_http_guard_streaming(td_http_guard_t *self, struct MHD_Connection *conn)
{
    conn_t *c = slot_of(conn);
    if (!c)
        return;
    pthread_mutex_lock(&self->lock);
    if (c->live && !c->streaming) {
        unlink_live(self, c);
        c->busy = true;
        append_to(self, c, true);
    }
    pthread_mutex_unlock(&self->lock);
}

void td_http_guard_request(td_http_guard_t *self, struct MHD_Connection *conn)
{
    conn_t *c = slot_of(conn);
    if (!c)
        return;
    pthread_mutex_lock(&self->lock);
    c->busy = true;
    pthread_mutex_unlock(&self->lock);
}

/* The response is sent (or the request failed): the connection waits for its next request,
 * with a new deadline, so it moves to the tail. */
void td_http_guard_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                             enum MHD_RequestTerminationCode toe)
{
    (void)con_cls;
    (void)toe;
    td_http_guard_t *self = cls;
    conn_t *c = slot_of(conn);
    if (!c)
        return;
    pthread_mutex_lock(&self->lock);
    if (c->live) {
        unlink_live(self, c);
        c->busy = false;
        c->served++;
        c->ready_ns = td_mono_ns();
        append_live(self, c);
    }
    pthread_mutex_unlock(&self->lock);
}

/* With the lock held: a summary of what was closed and refused since the last one, at most
 * every LOG_EVERY_NS (the lock is dropped while the line is written). */
static void log_summary(td_http_guard_t *self, uint64_t now)
{
    td_http_guard_counts_t c = self->counts, l = self->logged;
    if (now - self->logged_ns < LOG_EVERY_NS || (c.deadline_closed == l.deadline_closed &&
                                                 c.evicted == l.evicted && c.refused == l.refused))
        return;
    self->logged = c;
    self->logged_ns = now;
    pthread_mutex_unlock(&self->lock);
    td_warn("metrics http: %llu connections closed at the request deadline (%u ms), %llu idle "
            "connections closed to make room for new ones, %llu connections refused (all busy) "
            "since the last report",
            (unsigned long long)(c.deadline_closed - l.deadline_closed), self->limits.deadline_ms,
            (unsigned long long)(c.evicted - l.evicted),
            (unsigned long long)(c.refused - l.refused));
    pthread_mutex_lock(&self->lock);
}

static void *deadline_main(void *arg)
{
    td_http_guard_t *self = arg;
    uint64_t limit = (uint64_t)self->limits.deadline_ms * 1000000ull;
    pthread_mutex_lock(&self->lock);
    while (!self->stopping) {
        uint64_t now = td_mono_ns();
        while (self->head && now - self->head->ready_ns >= limit) {
            conn_t *c = self->head;
            /* A kept-alive connection that sent nothing more is an ordinary end, not news. */
            if (c->busy || c->served == 0)
                self->counts.deadline_closed++;
            shut(self, c);
        }
        log_summary(self, now);
        uint64_t until = (self->head ? self->head->ready_ns : now) + limit;
        struct timespec ts = {.tv_sec = (time_t)(until / 1000000000ull),
                              .tv_nsec = (long)(until % 1000000000ull)};
        int rc = 0;
        while (!self->stopping && rc == 0 && td_mono_ns() < until)
            rc = pthread_cond_timedwait(&self->wake, &self->lock, &ts);
    }
    pthread_mutex_unlock(&self->lock);
    return NULL;
}

/* The lock, and the condition variable on the monotonic clock (the deadlines' clock). None of
 * these fails with glibc: they fill in memory (pthread_condattr_setclock refuses only a clock
 * that is not one, or a CPU-time clock). */
static void init_sync(td_http_guard_t *self)
{
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&self->wake, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutex_init(&self->lock, NULL);
}

td_err_t td_http_guard_new(const td_http_limits_t *limits, td_http_guard_t **out)
{
    td_http_guard_t *self = calloc(1, sizeof *self);
    if (!self)
        return TD_ERR_NOMEM;
    self->limits = *limits;
    self->slot_count = limits->max_connections + limits->max_streaming + TD_HTTP_CLOSING_SLACK;
    self->slots = calloc(self->slot_count, sizeof *self->slots);
    td_err_t err = TD_ERR_NOMEM;
    if (!self->slots)
        goto fail;
    init_sync(self);
    for (unsigned i = self->slot_count; i-- > 0;) {
        self->slots[i].next = self->pool;
        self->pool = &self->slots[i];
    }
    int rc = pthread_create(&self->thread, NULL, deadline_main, self);
    if (rc != 0) {
        td_err("metrics http: cannot start the deadline thread: %s", strerror(rc));
        pthread_cond_destroy(&self->wake);
        pthread_mutex_destroy(&self->lock);
        err = TD_ERR_LIBRARY;
        goto fail;
    }
    *out = self;
    return TD_OK;
fail:
    free(self->slots);
    free(self);
    return err;
}

void td_http_guard_destroy(td_http_guard_t **self_p)
{
    td_http_guard_t *self = *self_p;
    if (!self)
        return;
    pthread_mutex_lock(&self->lock);
    self->stopping = true;
    pthread_cond_signal(&self->wake);
    pthread_mutex_unlock(&self->lock);
    pthread_join(self->thread, NULL);
    pthread_cond_destroy(&self->wake);
    pthread_mutex_destroy(&self->lock);
    free(self->slots);
    free(self);
    *self_p = NULL;
}

unsigned td_http_guard_mhd_limit(const td_http_guard_t *self)
{
    return self->slot_count;
}

unsigned td_http_guard_mhd_per_ip_limit(const td_http_guard_t *self)
{
    return self->limits.max_per_address + self->limits.max_streaming + TD_HTTP_CLOSING_SLACK;
}
