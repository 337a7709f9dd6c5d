/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_server.h — tallyd's loop and its wiring: the request path (td_path.h), its transports
 * (the ZeroMQ ROUTER socket, td_zmq.h; the HTTP API's requests, td_local.h), the backends and the
 * service around them, made, run and stopped in order.
 */
#ifndef TD_SERVER_H
#define TD_SERVER_H

#include "td_config.h"
#include "td_err.h"

typedef struct td_server td_server_t;

/* Reads every file td_server_new and a fleet worker would read (the path settings' files,
 * td_config_check_files; the CURVE keys, td_auth_check; the HTTP port's auth and token files,
 * td_http_check) and keeps nothing, logging what is wrong as the start would: `tallyd
 * --check-config` and the start run it before anything starts. TD_OK, TD_ERR_IO, TD_ERR_CONFIG
 * (a bad curve_clients item), TD_ERR_NOMEM (not logged). */
td_err_t td_server_check_files(const td_config_t *cfg);
/* Creates the backends, binds the sockets and sets up the loop; logs and returns an error
 * (nothing half-started is left behind) when any of that fails. cfg is copied. */
td_err_t td_server_new(const td_config_t *cfg, td_server_t **out);
/* The signals tallyd acts on (SIGTERM, SIGINT: stop; SIGHUP: reload), blocked in the calling
 * thread and so in every thread it starts from now on (main, before td_server_new): only the
 * loop thread takes them, once td_server_run unblocks them there. A signal handled on another
 * thread interrupts what that thread waits in (a library's poll, ZeroMQ's, libnats') and, under
 * ThreadSanitizer, waits for that thread's next intercepted call, which may never come: a
 * SIGTERM sent to a stopped member was never acted on (test_nats_route 2, 2026-12-05). */
void td_server_block_signals(void);
/* Runs until SIGINT/SIGTERM and every in-flight request has been answered: the signals of
 * td_server_block_signals are unblocked on this thread once every thread the server starts is
 * up (one that came meanwhile is taken then). Returns the process exit code: 0 on a clean stop,
 * 1 when the final state snapshot failed. */
int td_server_run(td_server_t *self);
void td_server_destroy(td_server_t **self_p);

/* What a transport outside the server needs: the NATS fleet worker (daemon/nats/td_fleet.h)
 * runs loop-thread work through a handle of its own on this loop (and must close it for
 * td_server_run to return), submits its requests to this path (core/td_transport.h), and
 * checkpoints and restores its partitions' streams in this table (loop thread only). */
struct uv_loop_s;
struct td_streams;
struct td_path;
struct uv_loop_s *td_server_loop(td_server_t *self);
struct td_streams *td_server_streams(td_server_t *self);
/* What the fleet worker reports through info and /metrics (zero: not in a fleet). */
struct td_fleet_status *td_server_fleet_status(td_server_t *self);
/* The request path, for a transport outside the server (the fleet worker's, td_fleet.h). */
struct td_path *td_server_path(td_server_t *self);

#endif
