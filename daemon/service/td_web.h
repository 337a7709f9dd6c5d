/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_web.h — the web page and the JSON API on tallyd's HTTP port (td_http.c serves /metrics
 * and /healthz and hands every other request here). docs/web.md
 * and PROTOCOL.md §12 are the contract:
 *
 *   GET  /  /app.js  /style.css  /favicon.svg     the live page (web/, embedded at build time)
 *   GET  /api/v1/streams                            the streams: name, type, values, rate, ...
 *   GET  /api/v1/streams/NAME[?last=&quantiles=]    the record of `tally query --json`
 *   POST /api/v1/streams/NAME/reset                 reset, with the bearer token
 *   DELETE /api/v1/streams/NAME                     delete, with the bearer token
 *   GET  /api/v1/streams/NAME/events[?last=&quantiles=]   Server-Sent Events: its record
 *   GET  /api/v1/events?stream=A&stream=B[&last=&quantiles=]  the list and those streams' records
 *
 * Threads: requests arrive on libmicrohttpd's thread; stream state is the loop thread's. A
 * request that needs the streams becomes a job: the handler queues it, suspends its connection
 * (libmicrohttpd's MHD_suspend_connection) and wakes the loop; the loop thread answers it
 * (renders, or hands a reset or delete to the scheduler and answers when the reply comes) and
 * resumes the connection, and the handler sends the answer. libmicrohttpd's one thread never
 * waits for the loop, so a slow answer holds up only its own connection.
 */
#ifndef TD_WEB_H
#define TD_WEB_H

#include <microhttpd.h>
#include <stdbool.h>

#include "td_config.h"
#include "td_err.h"
#include "td_http_guard.h"
#include "td_service.h"

typedef struct td_web td_web_t;

/* Reads the API token file (cfg->metrics_api_token_file, mode 0600; may be NULL). No libuv
 * handle yet. TD_ERR_IO (logged) when the file cannot be used, TD_ERR_NOMEM, TD_ERR_LIBRARY. */
td_err_t td_web_new(const td_service_host_t *host, td_http_guard_t *guard, td_web_t **out);
/* Reads the token file as td_web_new does, keeping nothing (`--check-config`, the start). */
td_err_t td_web_check(const td_config_t *cfg);
/* Loop thread: the wake-up handle and the event streams' timer; until then requests are
 * answered 503. TD_ERR_LIBRARY when libuv refuses. */
td_err_t td_web_open(td_web_t *self);
/* Whether url is the page's or the API's (anything else is td_http's to answer 404). */
bool td_web_serves(const char *url);
/* Whether url is the API's (its errors are JSON). */
bool td_web_is_api(const char *url);
/* An API error, {"error": code, "message": message}, with status. */
enum MHD_Result td_web_send_error(struct MHD_Connection *conn, unsigned status, const char *code,
                                  const char *message);
/* libmicrohttpd's thread: the access handler's calls for such a url once its headers and body
 * are in. basic_ok: the request passed td_http's basic auth (or none is configured). */
enum MHD_Result td_web_handle(td_web_t *self, struct MHD_Connection *conn, const char *url,
                              const char *method, void **con_cls, bool basic_ok);
/* libmicrohttpd's thread, when a request ends: frees what td_web_handle left in *con_cls;
 * false when it was not td_web's. */
bool td_web_request_done(td_web_t *self, void *con_cls);
/* Loop thread, before MHD_stop_daemon: answers every waiting job 503, ends every event stream
 * and resumes every suspended connection (libmicrohttpd must not stop with one suspended), then
 * waits up to 2 s for libmicrohttpd to have written those answers (MHD_stop_daemon closes the
 * connections whether it has or not). */
void td_web_close(td_web_t *self);
/* Loop thread, after MHD_stop_daemon: closes the handles; the memory goes in their callbacks
 * (or at once when td_web_open never ran). */
void td_web_destroy(td_web_t **self_p);

#endif
