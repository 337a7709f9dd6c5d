/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_local.h — the in-process transport: requests made inside tallyd, by the HTTP API (td_web.c:
 * a query, reset or delete of a stream, PROTOCOL.md's HTTP section), handed to the request path
 * like any transport's (td_transport.h), and their replies handed back to a function.
 *
 * A request goes in as the header bytes its fields encode (tally_req_encode) with an empty
 * payload, so it is decoded, validated, ordered behind its stream's queued requests and answered
 * `shutdown` while tallyd stops exactly as the opcode over ZeroMQ. Its sender is tallyd itself (no
 * id): the per-peer limits do not apply, the HTTP port has its own (td_http_guard.h). Loop thread.
 */
#ifndef TD_LOCAL_H
#define TD_LOCAL_H

#include "td_err.h"
#include "td_service.h"
#include "td_transport.h"

typedef struct td_local td_local_t;

td_err_t td_local_new(td_path_t *path, td_local_t **out);
void td_local_destroy(td_local_t **self_p);

/* Hands req to the path; done(arg, ...) is called exactly once, on the loop thread, with the
 * reply (at once with `internal` when there is no memory for the request). */
void td_local_submit(td_local_t *self, const tally_req_t *req, td_reply_fn done, void *arg);

#endif
