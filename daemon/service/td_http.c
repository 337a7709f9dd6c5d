/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_http.c — see td_http.h.
 *
 * Design
 * ------
 * libmicrohttpd answers connections on its own thread, but the metrics and the stream table
 * belong to the loop thread and take no locks. So a scrape asks the loop thread for the text:
 * the MHD handler bumps a request generation under a mutex, wakes the loop with uv_async_send,
 * and waits on a condition variable (at most TD_METRICS_WAIT_MS); the async callback renders
 * on the loop thread, stores the text, marks that generation done and broadcasts. The handler
 * then takes a copy for its response.
 *
 * Why not have the loop render a snapshot every second? A scrape would then see numbers up to a
 * second old (a test or an operator who just sent a request would not see it counted), and the
 * loop would render text nobody reads. The cost of asking is one wake-up per scrape, and a loop
 * that is stuck shows as a 503 after the timeout rather than as stale numbers.
 *
 * /healthz asks the loop thread the same way (a generation of its own), so a loop that is stuck
 * is unhealthy too; the answer is one word, no rendering.
 *
 * Shutdown: MHD_stop_daemon joins MHD's thread, which may be waiting for the loop thread — the
 * very thread calling MHD_stop_daemon. So `closing` is set and broadcast first; a waiting
 * handler then answers 503 at once and the join cannot deadlock.
 *
 * The web page and the JSON API (td_web.h) share the port, the guard and the basic auth; their
 * requests that need the loop do not wait on this thread but suspend their connections
 * (MHD_ALLOW_SUSPEND_RESUME), and paths reach td_web.c with their %XX escapes kept
 * (keep_escapes), so that a stream name may hold an escaped '/'.
 *
 * Slow and many connections: td_http_guard.c gives every request a deadline and bounds the
 * connections per address and in total; this file hands it libmicrohttpd's callbacks. One MHD
 * thread (epoll) serves every connection: a slow one costs it nothing while it waits, and
 * MHD's messages about them are rate-limited (log_mhd) so that a flood cannot fill the journal.
 *
 * DNS rebinding (issue 30, item 3): a page on evil.example whose name the attacker then points
 * at 127.0.0.1 is, to the browser, still evil.example's, so it may read what tallyd answers.
 * Its requests carry `Host: evil.example`, so tallyd answers only requests whose Host names it:
 * an IP address (a browser sends one only when its address bar holds one, and then the page is
 * that address's own, not a rebound name's), localhost, the name in the listen address, or one
 * of allowed_hosts ("*": any). The port is not compared: a name's port does not change where
 * the name points, and a tunnel (ssh -L 8080:127.0.0.1:9464) changes it. A request without
 * Host (HTTP/1.0) is not a browser's and passes. /healthz is not checked: it says only "ok",
 * and probes send what their platform chooses. Everything else is answered 421.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "td_config.h"
#include "tally_args.h"
#include "td_http.h"
#include "td_http_guard.h"
#include "td_log.h"
#include "td_monotonic.h"
#include "td_web.h"

#define CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"
/* libmicrohttpd's memory per connection, for the request line and headers, their parsed
 * arguments and the response's headers. Its default, 32 KiB, held a request line of ~17 KiB
 * with 240 arguments (each argument takes a record from the same pool): short of the page's
 * events of 256 streams with 64-byte names (18.4 KiB, docs/web.md). 64 KiB holds that with
 * room: 16 MiB in the worst case at the default max_connections (256). */
#define CONNECTION_MEMORY (64u << 10)
/* libmicrohttpd's messages: at most this many per LOG_WINDOW_NS, then a count of the rest. */
#define LOG_BURST 5
#define LOG_WINDOW_NS (10ull * 1000000000ull)

struct td_http {
    struct MHD_Daemon *mhd;
    td_http_guard_t *guard;
    td_web_t *web; /* the page and the API (td_web.h) */
    uv_async_t async;
    td_http_render_fn render;
    td_http_health_fn health;
    void *ctx;
    unsigned port;
    /* The names a Host header may give (besides IP addresses), lowercase, comma-separated:
     * localhost, the listen address's name, allowed_hosts. Read-only after start. */
    char *host_names;

    pthread_mutex_t lock; /* guards the fields below */
    pthread_cond_t done;
    uint64_t requested; /* generation asked for by the HTTP thread */
    uint64_t rendered;  /* generation the loop thread has answered */
    char *text;
    size_t len;
    uint64_t health_requested; /* the same for /healthz */
    uint64_t health_rendered;
    bool healthy;
    const char *why;
    bool closing;
    bool ready; /* the async handle exists */

    /* HTTP basic auth (--metrics-auth-file): empty user = none. Read-only after start. */
    char user[128];
    char password[256];

    pthread_mutex_t log_lock; /* guards the rate limit of log_mhd */
    uint64_t log_window_ns;   /* the start of the current window */
    unsigned log_lines;       /* lines written in it */
    unsigned long long log_dropped;
};

/* Resolves "HOST:PORT" or "[IPv6]:PORT" (a name, an IPv4 or IPv6 address; port 0 picks one)
 * into ss with getaddrinfo, taking the first address it gives. */
static bool parse_listen(const char *listen, struct sockaddr_storage *ss)
{
    char host[256], port[16];
    if (!tally_hostport_split(listen, host, sizeof host, port, sizeof port) || !host[0] ||
        !port[0] || strspn(port, "0123456789") != strlen(port))
        return false;
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV | AI_PASSIVE | AI_ADDRCONFIG};
    struct addrinfo *res = NULL;
    if (getaddrinfo(host, port, &hints, &res) != 0 || !res)
        return false;
    memset(ss, 0, sizeof *ss);
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    return true;
}

/* Constant-time comparison, so a scrape cannot learn the password a byte at a time. */
bool td_http_secret_equal(const char *given, const char *expected)
{
    size_t n = strlen(expected), m = given ? strlen(given) : 0;
    unsigned char diff = (unsigned char)(n != m);
    for (size_t i = 0; i < n; i++)
        diff |= (unsigned char)(expected[i] ^ (i < m ? given[i] : 0));
    return diff == 0 && given;
}

td_err_t td_http_read_secret(const char *path, const char *what, char *line, size_t cap)
{
    FILE *f = fopen(path, "r");
    struct stat sb;
    td_err_t st = TD_ERR_IO;
    line[0] = '\0';
    if (!f) {
        td_err("metrics: cannot read %s %s: %s", what, path, strerror(errno));
        return st;
    }
    if (fstat(fileno(f), &sb) == 0 && (sb.st_mode & 077)) {
        td_err("metrics: %s %s has mode %04o: a secret file must not be accessible to group or "
               "others (chmod 600 %s)",
               what, path, (unsigned)(sb.st_mode & 07777), path);
        goto done;
    }
    if (!fgets(line, (int)cap, f))
        line[0] = '\0';
    line[strcspn(line, "\r\n")] = '\0';
    if (!line[0])
        td_err("metrics: %s %s is empty", what, path);
    else
        st = TD_OK;
done:
    if (st != TD_OK)
        explicit_bzero(line, cap);
    fclose(f);
    return st;
}

/* The auth file: USER:PASSWORD on its first line. */
static td_err_t read_auth_file(td_http_t *self, const char *path)
{
    char line[512];
    td_err_t st = td_http_read_secret(path, "auth_file", line, sizeof line);
    char *colon = st == TD_OK ? strchr(line, ':') : NULL;
    if (st == TD_OK && (!colon || colon == line || !colon[1] ||
                        (size_t)(colon - line) >= sizeof self->user ||
                        strlen(colon + 1) >= sizeof self->password)) {
        td_err("metrics: auth_file %s must hold USER:PASSWORD on its first line", path);
        st = TD_ERR_IO;
    }
    if (st == TD_OK) {
        *colon = '\0'; /* both lengths were checked above */
        memcpy(self->user, line, (size_t)(colon - line) + 1);
        memcpy(self->password, colon + 1, strlen(colon + 1) + 1);
    }
    explicit_bzero(line, sizeof line);
    return st;
}

/* Basic auth, when configured: true when the request may proceed. */
static bool authorized(td_http_t *self, struct MHD_Connection *conn)
{
    if (!self->user[0])
        return true;
    char *password = NULL;
    char *user = MHD_basic_auth_get_username_password(conn, &password);
    bool ok = td_http_secret_equal(user, self->user) & td_http_secret_equal(password, self->password);
    if (password) {
        explicit_bzero(password, strlen(password));
        MHD_free(password);
    }
    if (user)
        MHD_free(user);
    return ok;
}

static bool is_loopback(const struct sockaddr_storage *ss)
{
    if (ss->ss_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)ss)->sin_addr.s_addr) >> 24) == 127;
    return IN6_IS_ADDR_LOOPBACK(&((const struct sockaddr_in6 *)ss)->sin6_addr);
}

/* Loop thread: a scrape is waiting. */
static void async_cb(uv_async_t *handle)
{
    td_http_t *self = handle->data;
    char *text = NULL;
    size_t len = 0;
    pthread_mutex_lock(&self->lock);
    bool metrics = self->rendered < self->requested;
    bool health = self->health_rendered < self->health_requested;
    pthread_mutex_unlock(&self->lock);
    if (metrics && self->render(self->ctx, &text, &len) != TD_OK) {
        text = NULL;
        len = 0;
    }
    const char *why = NULL;
    bool healthy = health && self->health(self->ctx, &why);
    pthread_mutex_lock(&self->lock);
    if (metrics) {
        free(self->text);
        self->text = text;
        self->len = len;
        self->rendered = self->requested;
    }
    if (health) {
        self->healthy = healthy;
        self->why = why;
        self->health_rendered = self->health_requested;
    }
    pthread_cond_broadcast(&self->done);
    pthread_mutex_unlock(&self->lock);
}

struct timespec td_http_deadline(unsigned ms)
{
    return td_deadline_after(CLOCK_REALTIME, ms);
}

/* HTTP thread, with the lock held: asks the loop thread for one more generation of *requested
 * and waits (at most TD_METRICS_WAIT_MS) for *answered to reach it; true when it did. */
static bool ask_loop(td_http_t *self, uint64_t *requested, const uint64_t *answered)
{
    struct timespec deadline = td_http_deadline(TD_METRICS_WAIT_MS);
    uint64_t mine = ++*requested;
    bool ask = self->ready && !self->closing;
    if (ask && uv_async_send(&self->async) != 0) {
        td_warn("metrics http: cannot wake the loop thread; answering 503");
        ask = false;
    }
    int rc = 0;
    while (ask && !self->closing && *answered < mine && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&self->done, &self->lock, &deadline);
    return !self->closing && *answered >= mine;
}

/* HTTP thread: gets a fresh copy of the text from the loop thread, or NULL. */
static char *fetch_text(td_http_t *self, size_t *len)
{
    char *copy = NULL;
    pthread_mutex_lock(&self->lock);
    if (ask_loop(self, &self->requested, &self->rendered) && self->text) {
        copy = malloc(self->len + 1);
        if (copy) {
            memcpy(copy, self->text, self->len + 1);
            *len = self->len;
        }
    }
    pthread_mutex_unlock(&self->lock);
    return copy;
}

/* HTTP thread: asks the loop thread for its health; false with *why when not serving (a loop
 * that does not answer in time, or a closing endpoint, included). */
static bool fetch_health(td_http_t *self, const char **why)
{
    pthread_mutex_lock(&self->lock);
    bool answered = ask_loop(self, &self->health_requested, &self->health_rendered);
    bool healthy = answered && self->healthy;
    *why = !answered ? "not answering" : self->why ? self->why : "unhealthy";
    pthread_mutex_unlock(&self->lock);
    return healthy;
}

/* Adds the Content-Type header; a failure (out of memory) is logged: the body still goes. */
static void set_content_type(struct MHD_Response *resp, const char *type)
{
    if (MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type) != MHD_YES)
        td_warn("metrics http: cannot add the Content-Type header");
}

static enum MHD_Result send_text(struct MHD_Connection *conn, unsigned code, const char *text)
{
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(strlen(text), (void *)text, MHD_RESPMEM_MUST_COPY);
    if (!resp)
        return MHD_NO;
    set_content_type(resp, "text/plain; charset=utf-8");
    /* A 405 names the methods the resource takes (RFC 9110 15.5.6), as the API's do. */
    if (code == MHD_HTTP_METHOD_NOT_ALLOWED &&
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, "GET, HEAD") != MHD_YES) {
        MHD_destroy_response(resp);
        return MHD_NO;
    }
    enum MHD_Result rc = MHD_queue_response(conn, code, resp);
    MHD_destroy_response(resp);
    return rc;
}

/* ---- Host names (DNS rebinding) ----------------------------------------------------------- */

#define HOST_NAME_CHARS "abcdefghijklmnopqrstuvwxyz0123456789.-_"

/* The name in a Host value ("name", "name:port", "[IPv6]", "[IPv6]:port") into name (cap
 * bytes), lowercase and without a DNS root dot; *literal when it is an IP address. False when
 * the value is malformed. */
static bool host_name(const char *host, char *name, size_t cap, bool *literal)
{
    bool bracket = host[0] == '[';
    const char *start = host + bracket;
    const char *end = bracket ? strchr(start, ']') : start + strcspn(start, ":");
    const char *rest = end ? end + bracket : NULL;
    if (!rest || (*rest && (*rest != ':' || strspn(rest + 1, "0123456789") != strlen(rest + 1))))
        return false;
    size_t n = (size_t)(end - start);
    if (n == 0 || n >= cap)
        return false;
    for (size_t i = 0; i < n; i++)
        name[i] = (char)(start[i] >= 'A' && start[i] <= 'Z' ? start[i] - 'A' + 'a' : start[i]);
    name[n] = '\0';
    unsigned char addr[sizeof(struct in6_addr)];
    if (bracket)
        return *literal = inet_pton(AF_INET6, name, addr) == 1;
    if (n > 1 && name[n - 1] == '.')
        name[--n] = '\0';
    *literal = inet_pton(AF_INET, name, addr) == 1;
    return strspn(name, HOST_NAME_CHARS) == n;
}

/* Whether name is one of list (comma-separated): equal to an item, under an item ".domain"
 * (or the domain itself), or the list holds "*". */
static bool host_listed(const char *list, const char *name)
{
    size_t n = strlen(name);
    for (const char *at = list; *at;) {
        size_t len = strcspn(at, ",");
        const char *dom = at + 1;
        size_t dl = len - 1;
        if ((len == 1 && at[0] == '*') || (len == n && memcmp(at, name, n) == 0))
            return true;
        if (at[0] == '.' && n >= dl && memcmp(name + n - dl, dom, dl) == 0 &&
            (n == dl || name[n - dl - 1] == '.'))
            return true;
        at += len + (at[len] == ',');
    }
    return false;
}

/* Appends one item of allowed_hosts (len bytes at item, spaces around it trimmed) to list;
 * false (logged) when it is not "*", a host name or ".domain". */
static bool add_host_item(char *list, size_t cap, const char *item, size_t len)
{
    while (len && (*item == ' ' || *item == '\t'))
        item++, len--;
    while (len && (item[len - 1] == ' ' || item[len - 1] == '\t'))
        len--;
    char name[256] = "";
    bool literal = false, dot = len > 1 && item[0] == '.';
    bool ok = len == 1 && item[0] == '*';
    if (!ok && len > (size_t)dot && len - dot < sizeof name) {
        memcpy(name, item + dot, len - dot);
        name[len - dot] = '\0';
        ok = strchr(name, ':') == NULL && host_name(name, name, sizeof name, &literal) &&
             name[0] != '.';
    }
    if (!ok) {
        td_err("metrics: allowed_hosts: '%.*s' is not a host name (tally.example.com), a domain "
               "with its subdomains (.example.com) or * (any name)",
               (int)(len < 200 ? len : 200), item);
        return false;
    }
    snprintf(list + strlen(list), cap - strlen(list), "%s%s%s", list[0] ? "," : "", dot ? "." : "",
             len == 1 && item[0] == '*' ? "*" : name);
    return true;
}

/* self->host_names: localhost, the listen address's host when it is a name, allowed_hosts. */
static td_err_t init_host_names(td_http_t *self, const char *listen, const char *allowed)
{
    size_t cap = 16 + strlen(listen) + 2 * (allowed ? strlen(allowed) : 0) + 16;
    self->host_names = calloc(1, cap);
    if (!self->host_names)
        return TD_ERR_NOMEM;
    char host[256], port[16], name[256];
    bool literal = true;
    strcpy(self->host_names, "localhost");
    if (tally_hostport_split(listen, host, sizeof host, port, sizeof port) &&
        host_name(host, name, sizeof name, &literal) && !literal)
        snprintf(self->host_names + strlen(self->host_names), cap - strlen(self->host_names), ",%s",
                 name);
    for (const char *at = allowed; at && *at;) {
        size_t len = strcspn(at, ",");
        if (len > 0 && !add_host_item(self->host_names, cap, at, len))
            return TD_ERR_CONFIG;
        at += len + (at[len] == ',');
    }
    return TD_OK;
}

/* Whether the request's Host names this server; otherwise its value, made printable, in shown. */
static bool host_allowed(const td_http_t *self, struct MHD_Connection *conn, char *shown,
                         size_t cap)
{
    const char *host = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_HOST);
    char name[256];
    bool literal = false;
    if (!host || !host[0] ||
        (host_name(host, name, sizeof name, &literal) &&
         (literal || host_listed(self->host_names, name))))
        return true;
    size_t n = 0;
    for (; host[n] && n + 1 < cap && n < 64; n++)
        shown[n] = host[n] > ' ' && host[n] < 127 ? host[n] : '?';
    shown[n] = '\0';
    return false;
}

/* 421 for a Host that does not name this server: JSON for the API, text for the rest. */
static enum MHD_Result misdirected(struct MHD_Connection *conn, const char *url, const char *host)
{
    char message[512];
    snprintf(message, sizeof message,
             "tallyd answers to its IP addresses, localhost, the name it listens on and [metrics] "
             "allowed_hosts (--metrics-allowed-hosts), not to '%s' (the request's Host): add the "
             "name to allowed_hosts to reach tallyd by it",
             host);
    if (td_web_is_api(url))
        return td_web_send_error(conn, MHD_HTTP_MISDIRECTED_REQUEST, "misdirected", message);
    strcat(message, "\n");
    return send_text(conn, MHD_HTTP_MISDIRECTED_REQUEST, message);
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_size, void **con_cls)
{
    (void)version;
    (void)upload;
    td_http_t *self = cls;
    if (*con_cls == NULL) { /* first call: headers only; answer on the next */
        *con_cls = self;
        td_http_guard_request(self->guard, conn);
        return MHD_YES;
    }
    if (*upload_size) { /* a body we do not want */
        *upload_size = 0;
        return MHD_YES;
    }
    bool healthz = strcmp(url, "/healthz") == 0;
    char host[80];
    if (!healthz && !host_allowed(self, conn, host, sizeof host))
        return misdirected(conn, url, host);
    if (td_web_serves(url))
        return td_web_handle(self->web, conn, url, method, con_cls, authorized(self, conn));
    bool get = strcmp(method, MHD_HTTP_METHOD_GET) == 0;
    bool head = strcmp(method, MHD_HTTP_METHOD_HEAD) == 0;
    if (!healthz && strcmp(url, "/metrics") != 0)
        return send_text(conn, MHD_HTTP_NOT_FOUND,
                         "not found: tallyd serves /metrics, /healthz, the web page at / and "
                         "the API at /api/v1/\n");
    if (!get && !head)
        return send_text(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "only GET and HEAD\n");
    /* With metrics_auth_file /metrics needs the credentials; /healthz never does: it says only
     * "ok", "draining" or "gpu lost", and the probes that ask it (load balancers, orchestrators,
     * monitoring) rarely carry a password. */
    if (!healthz && !authorized(self, conn)) {
        static const char denied[] = "tallyd metrics: authentication required\n";
        struct MHD_Response *resp = MHD_create_response_from_buffer(
            sizeof denied - 1, (void *)denied, MHD_RESPMEM_PERSISTENT);
        if (!resp)
            return MHD_NO;
        enum MHD_Result rc = MHD_queue_basic_auth_fail_response(conn, "tallyd", resp);
        MHD_destroy_response(resp);
        return rc;
    }
    if (healthz) {
        const char *why = NULL;
        if (fetch_health(self, &why))
            return send_text(conn, MHD_HTTP_OK, "ok\n");
        char line[64];
        snprintf(line, sizeof line, "%s\n", why);
        return send_text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, line);
    }
    size_t len = 0;
    char *text = fetch_text(self, &len);
    if (!text)
        return send_text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, "tallyd is busy or stopping\n");
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, text, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(text);
        return MHD_NO;
    }
    set_content_type(resp, CONTENT_TYPE);
    enum MHD_Result rc = MHD_queue_response(conn, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return rc;
}

/* libmicrohttpd's messages (one per connection that a peer or the guard cut short, one per
 * connection refused): LOG_BURST per window, and how many were left out. */
static void log_mhd(void *cls, const char *fmt, va_list ap)
{
    td_http_t *self = cls;
    uint64_t now = td_mono_ns();
    unsigned long long dropped = 0;
    pthread_mutex_lock(&self->log_lock);
    if (now - self->log_window_ns >= LOG_WINDOW_NS) {
        dropped = self->log_dropped;
        self->log_dropped = 0;
        self->log_lines = 0;
        self->log_window_ns = now;
    }
    bool write = self->log_lines < LOG_BURST;
    self->log_lines += write;
    self->log_dropped += !write;
    pthread_mutex_unlock(&self->log_lock);
    if (dropped)
        td_warn("metrics http: %llu more messages from libmicrohttpd left out", dropped);
    if (!write)
        return;
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    line[strcspn(line, "\n")] = '\0';
    td_warn("metrics http: %s", line);
}

/* A request ended: the guard's bookkeeping, and the web's job freed. */
static void completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                      enum MHD_RequestTerminationCode toe)
{
    td_http_t *self = cls;
    td_http_guard_completed(self->guard, conn, con_cls, toe);
    if (*con_cls && *con_cls != self)
        td_web_request_done(self->web, *con_cls);
    *con_cls = NULL;
}

/* Paths and query values arrive as sent: a stream name in a path may hold an escaped '/'
 * (%2F), so td_web.c splits the path before it decodes each part. */
static size_t keep_escapes(void *cls, struct MHD_Connection *conn, char *s)
{
    (void)cls;
    (void)conn;
    return strlen(s);
}

/* The locks and the condition variable the HTTP thread and the loop thread share. */
static td_err_t init_sync(td_http_t *self)
{
    int rc = pthread_mutex_init(&self->lock, NULL);
    if (rc == 0) {
        rc = pthread_cond_init(&self->done, NULL);
        if (rc != 0)
            pthread_mutex_destroy(&self->lock);
    }
    if (rc == 0) {
        rc = pthread_mutex_init(&self->log_lock, NULL);
        if (rc != 0) {
            pthread_cond_destroy(&self->done);
            pthread_mutex_destroy(&self->lock);
        }
    }
    if (rc != 0) {
        td_err("metrics: cannot create a lock: %s", strerror(rc));
        return TD_ERR_LIBRARY;
    }
    return TD_OK;
}

static void destroy_sync(td_http_t *self)
{
    pthread_mutex_destroy(&self->log_lock);
    pthread_cond_destroy(&self->done);
    pthread_mutex_destroy(&self->lock);
}

/* MHD's own thread, listening at ss, with the guard's callbacks and limits. */
static td_err_t start_mhd(td_http_t *self, const char *listen, const struct sockaddr_storage *ss,
                          unsigned deadline_ms)
{
    /* AUTO: epoll or poll rather than select, which fails on fds above 1023. */
    /* Suspend and resume: the web's requests wait for the loop without holding this thread. */
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO | MHD_USE_ERROR_LOG |
                     MHD_ALLOW_SUSPEND_RESUME;
    /* IPv6: dual stack, so [::] takes IPv4 clients too (as IPv4-mapped addresses, each its
     * own address in the guard's bounds); libmicrohttpd's MHD_USE_IPv6 alone sets V6ONLY. */
    if (ss->ss_family == AF_INET6)
        flags |= MHD_USE_DUAL_STACK;
    /* MHD's idle timeout is only a backstop: the guard's deadline comes first. */
    unsigned idle_s = deadline_ms / 1000 + 1;
    td_http_guard_t *g = self->guard;
    /* The address is ss; the port argument is only what libmicrohttpd's own messages name. */
    uint16_t port = ntohs(ss->ss_family == AF_INET6 ? ((const struct sockaddr_in6 *)ss)->sin6_port
                                                    : ((const struct sockaddr_in *)ss)->sin_port);
    self->mhd = MHD_start_daemon(
        flags, port, td_http_guard_accept, g, handle, self, MHD_OPTION_EXTERNAL_LOGGER, log_mhd,
        self, MHD_OPTION_SOCK_ADDR, (const struct sockaddr *)ss, MHD_OPTION_CONNECTION_LIMIT,
        td_http_guard_mhd_limit(g), MHD_OPTION_PER_IP_CONNECTION_LIMIT,
        td_http_guard_mhd_per_ip_limit(g), MHD_OPTION_CONNECTION_TIMEOUT, idle_s,
        MHD_OPTION_NOTIFY_CONNECTION, td_http_guard_notify, g, MHD_OPTION_NOTIFY_COMPLETED,
        completed, self, MHD_OPTION_UNESCAPE_CALLBACK, keep_escapes, NULL,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)CONNECTION_MEMORY, MHD_OPTION_END);
    if (!self->mhd) {
        int err = errno;
        td_err("metrics: cannot listen on %s: %s%s", listen, strerror(err),
               err == EADDRINUSE ? "; another process holds the port (ss -ltnp shows which): "
                                   "stop it or choose another [metrics] listen"
                                 : "");
        return TD_ERR_BIND;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(self->mhd, MHD_DAEMON_INFO_BIND_PORT);
    self->port = info ? info->port : 0;
    return TD_OK;
}

/* The guard, the web, then MHD's thread. */
static td_err_t start_serving(td_http_t *self, const td_service_host_t *host,
                              const struct sockaddr_storage *ss)
{
    const td_config_t *cfg = host->cfg;
    td_http_limits_t limits = {
        .max_connections = cfg->metrics_max_connections,
        .max_per_address = cfg->metrics_max_connections_per_address,
        .max_streaming = cfg->metrics_max_sse_clients,
        .deadline_ms = cfg->metrics_request_timeout_ms,
    };
    td_err_t err = td_http_guard_new(&limits, &self->guard);
    if (err == TD_OK)
        err = td_web_new(host, self->guard, &self->web);
    if (err == TD_OK)
        err = start_mhd(self, cfg->metrics_listen, ss, limits.deadline_ms);
    if (err != TD_OK) {
        td_web_destroy(&self->web);
        td_http_guard_destroy(&self->guard);
    }
    return err;
}

td_err_t td_http_check(const td_config_t *cfg)
{
    if (!cfg->metrics_listen)
        return TD_OK;
    td_err_t err = TD_OK;
    if (cfg->metrics_auth_file) {
        td_http_t *probe = calloc(1, sizeof *probe);
        if (!probe)
            return TD_ERR_NOMEM;
        err = read_auth_file(probe, cfg->metrics_auth_file);
        explicit_bzero(probe, sizeof *probe);
        free(probe);
    }
    return err == TD_OK ? td_web_check(cfg) : err;
}

td_err_t td_http_new(const td_service_host_t *host, td_http_render_fn render,
                     td_http_health_fn health, void *ctx, td_http_t **out)
{
    const td_config_t *cfg = host->cfg;
    const char *listen = cfg->metrics_listen;
    struct sockaddr_storage ss;
    if (!parse_listen(listen, &ss)) {
        td_err("metrics: '%s' is not IP:PORT or HOST:PORT (e.g. 127.0.0.1:9464, [::1]:9464, "
               "localhost:9464)",
               listen);
        return TD_ERR_BIND;
    }
    td_http_t *self = calloc(1, sizeof *self);
    if (!self)
        return TD_ERR_NOMEM;
    bool synced = false;
    const char *auth_file = cfg->metrics_auth_file;
    td_err_t err = auth_file ? read_auth_file(self, auth_file) : TD_OK;
    if (err == TD_OK)
        err = init_host_names(self, listen, cfg->metrics_allowed_hosts);
    if (err == TD_OK)
        err = init_sync(self);
    if (err != TD_OK)
        goto fail;
    synced = true;
    /* Protected mode (td_config_check_protected) has refused this unless it was turned off. */
    if (!is_loopback(&ss) && !self->user[0])
        td_warn("metrics: %s is not a loopback address; the endpoint has no authentication",
                listen);
    self->render = render;
    self->health = health;
    self->ctx = ctx;
    err = start_serving(self, host, &ss);
    if (err != TD_OK)
        goto fail;
    /* Last, so that a failure above leaves no libuv handle to close. Until `ready` is set a
     * scrape is answered 503 without touching the handle (the web's requests likewise until
     * td_web_open). */
    int rc = uv_async_init(host->loop, &self->async, async_cb);
    if (rc == 0 && td_web_open(self->web) != TD_OK) {
        uv_close((uv_handle_t *)&self->async, NULL);
        uv_run(host->loop, UV_RUN_NOWAIT); /* the close callback, before self goes */
        rc = UV_EINVAL;
    }
    if (rc != 0) {
        td_err("metrics: cannot create the loop's wake-up handle: %s", uv_strerror(rc));
        td_web_close(self->web);
        MHD_stop_daemon(self->mhd);
        td_web_destroy(&self->web);
        td_http_guard_destroy(&self->guard);
        err = TD_ERR_LIBRARY;
        goto fail;
    }
    self->async.data = self;
    pthread_mutex_lock(&self->lock);
    self->ready = true;
    pthread_mutex_unlock(&self->lock);
    td_info("metrics: serving http://%.*s:%u/metrics, the web page at / and the API at /api/v1/",
            (int)(strrchr(listen, ':') - listen), listen, self->port);
    *out = self;
    return TD_OK;

fail:
    explicit_bzero(self->password, sizeof self->password);
    if (synced)
        destroy_sync(self);
    free(self->host_names);
    free(self);
    return err;
}

unsigned td_http_port(const td_http_t *self)
{
    return self->port;
}

static void free_after_close(uv_handle_t *handle)
{
    td_http_t *self = handle->data;
    destroy_sync(self);
    free(self->text);
    free(self->host_names);
    free(self);
}

void td_http_destroy(td_http_t **self_p)
{
    td_http_t *self = *self_p;
    if (!self)
        return;
    pthread_mutex_lock(&self->lock);
    self->closing = true;
    pthread_cond_broadcast(&self->done);
    pthread_mutex_unlock(&self->lock);
    td_web_close(self->web); /* no connection may stay suspended past this point */
    MHD_stop_daemon(self->mhd); /* closes every connection: the guard has nothing left */
    td_web_destroy(&self->web);
    td_http_guard_destroy(&self->guard);
    uv_close((uv_handle_t *)&self->async, free_after_close);
    *self_p = NULL;
}
