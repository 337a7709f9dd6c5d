/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_http.h — the HTTP endpoint (libmicrohttpd): GET /metrics, exactly the text the `stats`
 * opcode returns (Prometheus), and GET /healthz, 200 "ok" while tallyd serves, 503 with the
 * reason when it drains after a stop signal or lost a GPU (or its loop does not answer within
 * TD_METRICS_WAIT_MS). Every other path of the page and the API (td_web_serves) goes to
 * td_web.c, with this file's basic auth already checked.
 */
#ifndef TD_HTTP_H
#define TD_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <time.h>
#include <uv.h>

#include "td_config.h"
#include "td_err.h"
#include "td_service.h"

/* Renders the metrics text on the loop thread: a malloc'ed, NUL-terminated string. */
typedef td_err_t (*td_http_render_fn)(void *ctx, char **text, size_t *len);
/* The health on the loop thread: true when serving; else *why (a static string) says why. */
typedef bool (*td_http_health_fn)(void *ctx, const char **why);

typedef struct td_http td_http_t;

/* Starts serving on cfg->metrics_listen ("IP:PORT", "[IPv6]:PORT"; port 0 picks a free one,
 * which is logged), with the request deadline and connection bounds of cfg (td_http_guard.h).
 * render runs on loop's thread whenever a scrape arrives. With cfg->metrics_auth_file
 * (USER:PASSWORD, mode 0600; may be NULL) every scrape must present those credentials (HTTP
 * basic auth, else 401). Fails, with the reason logged at err: TD_ERR_BIND when listen cannot be
 * resolved or bound, TD_ERR_IO when the auth file cannot be used, TD_ERR_NOMEM,
 * TD_ERR_LIBRARY. */
td_err_t td_http_new(const td_service_host_t *host, td_http_render_fn render,
                     td_http_health_fn health, void *ctx, td_http_t **out);
/* Reads the files td_http_new would read (with metrics on: auth_file, and the web's
 * api_token_file) and keeps nothing: `--check-config` and the start check them before anything
 * starts, with td_http_new's messages (logged). TD_OK, TD_ERR_IO, TD_ERR_NOMEM. */
td_err_t td_http_check(const td_config_t *cfg);
/* now + ms on CLOCK_REALTIME, for pthread_cond_timedwait. */
struct timespec td_http_deadline(unsigned ms);
/* The first line of a secret file (auth_file, api_token_file: `what`) into line, which holds
 * cap bytes; TD_ERR_IO (logged) when the file cannot be read, is empty, or group or others may
 * access it. */
td_err_t td_http_read_secret(const char *path, const char *what, char *line, size_t cap);
/* Whether given (may be NULL) equals expected, in a time that does not depend on where they
 * differ. */
bool td_http_secret_equal(const char *given, const char *expected);
/* The port actually bound. */
unsigned td_http_port(const td_http_t *self);
/* Loop thread: stops the HTTP thread (answering any waiting scrape with 503) and closes the
 * async handle; the memory is freed by the handle's close callback. */
void td_http_destroy(td_http_t **self_p);

#endif
