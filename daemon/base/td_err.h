/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_err.h — the daemon's own error type.
 *
 * Wire statuses (tally_status_t, proto/tally_proto.h) say what went wrong with a *request*, for
 * the client that sent it. What goes wrong inside tallyd — a configuration file that does not
 * parse, an endpoint that cannot be bound, a state file that cannot be written, a library
 * initialiser that fails — is not a request's fault and has no wire status: a missing file is
 * not "unknown stream", a bind failure is not "bad parameter". Internal functions return a
 * td_err_t (with a message buffer where the caller shows one to a person); where such an error
 * stops a request, the code that answers it says what happened in its own words (out of memory,
 * a backend that failed) with the status that fits; start-up maps to an exit status with
 * td_err_exit_code().
 */
#ifndef TD_ERR_H
#define TD_ERR_H

#include "tally_proto.h"

typedef enum {
    TD_OK = 0,
    TD_ERR_CONFIG,  /* a setting, option or configuration file is invalid */
    TD_ERR_IO,      /* a file, directory or socket path could not be read, written or made */
    TD_ERR_BIND,    /* an endpoint could not be bound or adopted */
    TD_ERR_BACKEND, /* no usable compute backend (or device) */
    TD_ERR_NOMEM,   /* out of memory */
    TD_ERR_CORRUPT, /* stored data (state file, record) failed its checks */
    TD_ERR_LIBRARY, /* a library call (ZeroMQ, libuv, libmicrohttpd, CUDA) failed */
    TD_ERR_VERSION, /* stored data written by a newer tallyd, in a format this one cannot read */
    TD_ERR_BUSY,    /* nothing taken now (a limit is reached): try again later */
} td_err_t;

/* "config", "io", ...: for logs and tests. */
const char *td_err_name(td_err_t err);

/* tallyd's exit status when start-up fails with err: 2 for a configuration error (as for a
 * bad command line), 1 otherwise. */
int td_err_exit_code(td_err_t err);

#endif
