/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_zmq_front.h — fronts: ZeroMQ endpoints each served by a ROUTER socket and a thread of its own
 * (`front` in tallyd.conf, --front; issue 31's small requests: one socket and its one thread
 * were the bound, bench/NOTES.md "Several fronts").
 *
 * The binds stay on the loop thread's socket (td_zmq.h) exactly as before; each front is one more
 * ROUTER socket, in the same ZeroMQ context (its I/O threads, CURVE's ZAP handler), read and
 * written by its own thread only, which is a port of the request path (td_transport.h,
 * core/td_path_port.c): its requests go straight to their shards' mailboxes in its own batches,
 * its replies come back to its own mailbox, and its thread sends them. What differs from the
 * loop thread's socket, and why: td_zmq_front.c's design comment.
 *
 * Loop thread, except where said.
 */
#ifndef TD_ZMQ_FRONT_H
#define TD_ZMQ_FRONT_H

#include <stdint.h>
#include <uv.h>

#include "td_auth.h"
#include "td_config.h"
#include "td_err.h"
#include "td_reply.h"
#include "td_transport.h"

typedef struct td_fronts td_fronts_t;

typedef struct {
    uv_loop_t *loop;
    const td_config_t *cfg; /* its fronts; copied for the fronts' admission (td_zmq_front.c) */
    td_path_t *path;
    void *zmq_ctx;         /* the loop thread's ROUTER's context (td_zmq_context) */
    td_auth_t *auth;       /* its CURVE (its counters: a front's handshakes), or NULL */
    td_replies_t *replies;
    unsigned shards;
    /* While stopping, on the loop thread: a front has read (read_any) or answered requests; the
     * wiring looks again whether tallyd may close (its requests count in td_path_inflight). */
    void (*pumped)(void *owner, bool read_any);
    void *owner;
} td_fronts_env_t;

/* What one front has done (td_fronts_counts; atomics its thread stores). */
typedef struct {
    uint64_t requests;     /* messages read and handed to the path */
    uint64_t replies;      /* replies sent */
    uint64_t dropped_gone; /* replies dropped: the connection had gone */
    uint64_t dropped_slow; /* replies dropped: the connection does not read */
    uint64_t busy_waits;   /* times its thread stopped reading at max_inflight */
} td_front_counts_t;

/* Before td_path_run: a socket bound and a port opened for each of cfg->fronts (none: an empty
 * set). TD_ERR_BIND, TD_ERR_CONFIG (TD_PATH_PORTS_MAX), TD_ERR_NOMEM, TD_ERR_LIBRARY: *out is
 * NULL and nothing is left open. */
td_err_t td_fronts_new(const td_fronts_env_t *env, td_fronts_t **out);
/* After td_path_run: each front's thread starts reading. */
td_err_t td_fronts_run(td_fronts_t *self);
/* The stop signal came: the threads tell the loop (env.pumped) when they read or answer. */
void td_fronts_stopping(td_fronts_t *self);
/* After td_path_close: each thread sends its last replies (what came after the close is answered
 * `shutdown` by its port) and ends, joined here; the sockets close (a short linger for those
 * replies), the ports too. Before the context's end (td_zmq_destroy). */
void td_fronts_stop(td_fronts_t *self);
/* After td_fronts_stop (or a failed start) and the path's close. */
void td_fronts_destroy(td_fronts_t **self_p);

unsigned td_fronts_count(const td_fronts_t *self);
const char *td_fronts_endpoint(const td_fronts_t *self, unsigned i);
/* Any thread. */
void td_fronts_counts(const td_fronts_t *self, unsigned i, td_front_counts_t *out);

#endif
