/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_auth.h — CURVE authentication: the server's key pair, the allowed client keys, and the ZAP
 * handler that checks each connection against them (PROTOCOL.md §12).
 *
 * libzmq runs the CURVE handshake itself and asks a ZAP handler (ZeroMQ RFC 27: a REP socket
 * bound at inproc://zeromq.zap.01 in the socket's context) whether the client's public key may
 * connect. td_auth runs that handler on a thread of its own: it answers 200 with the key's user
 * id (the name it was listed under) or 400. Every message of an allowed connection then carries
 * that id as its "User-Id" property, which the server uses as the client's identity for the
 * per-client limits and metrics (td_peers.h).
 *
 * The ROUTER's monitor (zmq_socket_monitor; a socket has one, which the ZeroMQ transport reads
 * on the loop thread: td_router.c, td_zmq_conn.c), and each front's (read on its thread:
 * td_zmq_front.c), hands td_auth_event the handshake failures that
 * never reach ZAP — a client without CURVE (mechanism mismatch) or one that encrypted to another
 * server key (the handshake does not decrypt) — so that every refusal is counted and logged.
 *
 * Keys are ZeroMQ's Z85 text (40 characters). A key file is CZMQ's certificate format (what
 * `tally keygen` writes: `public-key = "..."` and, in the secret file, `secret-key = "..."`), or
 * a single line holding the key. The secret key file must not be accessible to group or others.
 * The allowed keys (the files of curve_clients_dir, named by file name less .pub/.key, and the
 * NAME:KEY or KEY items of curve_clients) are read at start and again on SIGHUP.
 */
#ifndef TD_AUTH_H
#define TD_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_config.h"
#include "td_err.h"
#include "tally_keys.h"

/* Refusals and acceptances, for tallyd_auth_total{result}. */
typedef struct {
    uint64_t allowed;       /* handshakes completed with an allowed key */
    uint64_t unknown_key;   /* the ZAP handler refused the client's key */
    uint64_t no_curve;      /* the client did not use CURVE (no key) */
    uint64_t bad_handshake; /* CURVE failed: a wrong server key, or a broken client */
    uint64_t zap_errors;    /* ZAP answers ZeroMQ would not take (the handshake then stalls) */
} td_auth_counts_t;

typedef struct td_auth td_auth_t;

/* Reads the keys named by cfg (curve_secret_key, curve_clients_dir, curve_clients) and starts
 * the ZAP handler in zmq_ctx. Fails with msg: TD_ERR_IO for a missing, unreadable, badly formed
 * or group/other-accessible key file, TD_ERR_CONFIG for a bad curve_clients item, TD_ERR_NOMEM,
 * TD_ERR_LIBRARY when ZeroMQ cannot start the handler. Call before any socket binds. */
td_err_t td_auth_new(void *zmq_ctx, const td_config_t *cfg, td_auth_t **out, char *msg,
                     size_t msg_cap);
/* Reads the key files td_auth_new would read (none without curve_secret_key), and the
 * curve_clients items, and keeps nothing: what `tallyd --check-config` and the start check
 * before anything starts, failing as td_auth_new would, with its msg. */
td_err_t td_auth_check(const td_config_t *cfg, char *msg, size_t msg_cap);
/* The server's public key (Z85, 40 characters) from cfg->curve_secret_key, into out; TD_OK
 * with out "" when CURVE is off. What a fleet member publishes as curve= (PROTOCOL.md §13). */
td_err_t td_auth_public_key(const td_config_t *cfg, char out[TALLY_KEY_LEN + 1], char *msg,
                            size_t msg_cap);
/* Makes router a CURVE server with the secret key and watches its handshakes; TD_ERR_LIBRARY
 * (logged) when ZeroMQ or the handler thread cannot. */
td_err_t td_auth_apply(td_auth_t *self, void *router);
/* Makes sock (the PUB socket) a CURVE server with the same secret key and ZAP domain, so the
 * same handler admits the same clients; before its bind. The handler logs a refused key; no
 * monitor watches this socket, so its handshakes are not counted in td_auth_counts.
 * TD_ERR_LIBRARY (logged). */
td_err_t td_auth_secure(const td_auth_t *self, void *sock);
/* SIGHUP: re-reads the allowed keys (cfg holds the live curve_clients_dir and curve_clients).
 * On an error the current set stays and the error is logged. */
void td_auth_reload(td_auth_t *self, const td_config_t *cfg);
void td_auth_counts(td_auth_t *self, td_auth_counts_t *out);
/* One event of a request socket's monitor (ZMQ_EVENT_HANDSHAKE_*, with its value): counted, and
 * a refusal logged. The loop thread (the ROUTER's) and the fronts' threads (theirs). */
void td_auth_event(td_auth_t *self, unsigned event, uint32_t value);
/* Stops the handler thread and closes its sockets: before zmq_ctx_term. */
void td_auth_destroy(td_auth_t **self_p);

#endif
