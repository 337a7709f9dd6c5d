/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_nats_conn.h — one way to connect to NATS, for libtally's producer and tallyd's worker
 * alike (compiled into both): the servers (a comma-separated list of URLs), the credentials
 * (a .creds file, an nkey and its seed file, or a user/password or token in a URL) and TLS (a CA
 * file, a client certificate), the rule of protected mode (PROTOCOL.md §13 "Security"): a
 * server that is not on the loopback needs credentials, and the user a connection acts as
 * (its subjects' last token, its inboxes under _INBOX.<user>.: libnats' custom inbox prefix, so
 * that the server's permissions can keep every user's replies to itself). Messages show the
 * servers with passwords and tokens masked (tally_fleet_redact).
 *
 * Private: the `tally__` prefix; not installed.
 */
#ifndef TALLY_NATS_CONN_H
#define TALLY_NATS_CONN_H

#include <stdbool.h>
#include <stddef.h>

#include <nats/nats.h>

#include "tally_proto.h"

#define TALLY_NATS_DEFAULT_URL "nats://127.0.0.1:4222"

typedef struct {
    const char *servers;     /* "nats://h1:4222,tls://h2:4222"; NULL or "": the default URL */
    const char *credentials; /* a .creds file (user JWT and nkey seed); NULL: none */
    const char *nkey;        /* a user nkey (public, "U..."), with nkey_seed */
    const char *nkey_seed;   /* the file holding that nkey's seed */
    const char *tls_ca;      /* a CA file (PEM): TLS on, the server's certificate checked */
    const char *tls_cert;    /* a client certificate and its key (PEM), both or neither */
    const char *tls_key;
    const char *user; /* the NATS user the fleet knows this connection as; NULL: the user of the
                       * first URL that has one ("nats://user:pw@host"), else "anon" */
    const char *name; /* the connection's name on the server; NULL: "tally" */
    int timeout_ms;   /* connect timeout; <= 0: 2000 */
    bool send_asap;   /* no flusher delay (tallyd's worker: replies go out at once) */
    /* Called on libnats's thread when the connection loses its server and when it has one
     * again (libnats also calls the first at the connection's close), with link_closure; NULL:
     * none. */
    natsConnectionHandler on_disconnected, on_reconnected;
    void *link_closure;
} tally_nats_conf_t;

/* Connects (trying every server). TALLY_E_ARG for a malformed configuration, TALLY_E_TRANSPORT
 * when no server accepts it; msg (cap bytes) says why. The connection reconnects forever. */
tally_status_t tally__nats_connect(const tally_nats_conf_t *conf, natsConnection **out, char *msg,
                                   size_t cap);
/* True when every server's host is the loopback (127.0.0.0/8, ::1, localhost). */
bool tally__nats_servers_local(const char *servers);
/* True when the configuration carries credentials: a .creds file, an nkey, or a user or token
 * in a URL. */
bool tally__nats_has_credentials(const tally_nats_conf_t *conf);
/* The user of the configuration into out (cap bytes, TALLY_NATS_MEMBER_ID_MAX + 1 enough):
 * TALLY_E_ARG with msg when it is not a valid name (1..64 of A-Z a-z 0-9 - _). */
tally_status_t tally__nats_user(const tally_nats_conf_t *conf, char *out, size_t cap, char *msg,
                                size_t msg_cap);
/* How long tally__nats_sub_close waits for its round trip. */
#define TALLY_NATS_SUB_CLOSE_MS 2000
/* Unsubscribes *sub, waits for one round trip of nc (its connection), then destroys it and sets
 * *sub to NULL. libnats before 3.6.1 (Debian 12 ships 3.4.1; issue 637 of the NATS C client)
 * delivers a message by finding its subscription under the connection's lock, letting go of
 * that lock, and only then locking the subscription: a natsSubscription_Destroy in between frees
 * what the read loop is about to lock and fill (a bare abort(), a crash, or a corrupt heap).
 * Once unsubscribed no message finds it any more, and the PONG of the flush is read by that
 * same read loop after any message it was delivering. Not needed after natsConnection_Close
 * (the read loop has ended). */
void tally__nats_sub_close(natsConnection *nc, natsSubscription **sub);

#endif
