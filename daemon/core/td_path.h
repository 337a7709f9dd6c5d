/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_path.h — the request path: what happens to a request between its transport and its reply,
 * whatever the transport (td_transport.h: the calls a transport makes). This is the side the
 * server's wiring (td_server.c) sees: creating the path, its scheduler and the executor's
 * completions, and stopping.
 *
 * A submitted message is decoded and validated (proto/), its sender identified and held to the
 * per-connection limits (td_admit.h), its payload taken (a shared-memory reference resolved), and
 * then either answered on the loop thread (ping, streams; info and stats through the wiring's
 * answer_here, which knows the whole daemon) or handed to the scheduler (td_sched.h), which orders
 * it on its stream and runs it (td_exec.h); its result is folded into the stream (td_request.h:
 * the sequence rule, exactly once) and the reply goes to its transport. Loop thread.
 */
#ifndef TD_PATH_H
#define TD_PATH_H

#include <stdbool.h>

#include "td_config.h"
#include "td_err.h"
#include "td_counters.h"
#include "td_peers.h"
#include "td_reply.h"
#include "td_request.h"
#include "td_sched.h"
#include "td_shm.h"
#include "td_stream.h"
#include "td_transport.h"

typedef struct {
    td_config_t *cfg; /* live: reloads apply */
    td_metrics_t *metrics;
    td_streams_t *streams;
    td_peers_t *peers;
    td_replies_t *replies;
    /* info and stats: fills r's reply (td_request_succeed or _fail) from the whole daemon. */
    void (*answer_here)(void *owner, td_request_t *r);
    void *owner;
} td_path_env_t;

td_err_t td_path_new(const td_path_env_t *env, td_path_t **out);
/* The scheduler, on the machine the executor offers (td_exec_machine). */
td_err_t td_path_start(td_path_t *self, const td_sched_machine_t *machine);
/* What serves beside the path, once open: the shared-memory regions requests reference and the
 * PUB socket told of deleted streams (either NULL when off). */
/* Told when a stream is deleted (its subscribers hear of it: td_pub_deleted); ctx is passed back. */
typedef void (*td_path_deleted_fn)(void *ctx, const char *name, size_t name_len);
void td_path_attach(td_path_t *self, td_shm_t *shm, td_path_deleted_fn deleted, void *ctx);
/* Destroys the scheduler too. */
void td_path_destroy(td_path_t **self_p);

td_sched_t *td_path_sched(const td_path_t *self);
/* The executor hands a compute request back (td_exec_env_t.done). */
void td_path_finished(td_path_t *self, td_request_t *r);

/* A stop signal: every message submitted from now on is answered `shutdown`, and what waits on
 * a stream is answered so in its order (td_sched_stop). */
void td_path_stop(td_path_t *self);
/* The drain deadline has passed: transports read nothing more (td_path_may_read is false from
 * now on). */
void td_path_drain_over(td_path_t *self);
bool td_path_stopping(const td_path_t *self);

#endif
