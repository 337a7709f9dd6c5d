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

/* Creates the backends, binds the sockets and sets up the loop; logs and returns an error
 * (nothing half-started is left behind) when any of that fails. cfg is copied. */
td_err_t td_server_new(const td_config_t *cfg, td_server_t **out);
/* Runs until SIGINT/SIGTERM and every in-flight request has been answered. Returns the
 * process exit code: 0 on a clean stop, 1 when the final state snapshot failed. */
int td_server_run(td_server_t *self);
void td_server_destroy(td_server_t **self_p);

#endif
