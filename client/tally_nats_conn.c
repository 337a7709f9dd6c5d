/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_nats_conn.c — see tally_nats_conn.h.
 *
 * The server list is split here and given to natsOptions_SetServers: libnats 3.4.1 accepts a
 * comma-separated natsOptions_SetURL and then connects to none of the servers in it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally_fleet.h"
#include "tally_nats_conn.h"

#define MAX_SERVERS 32

/* Splits a copy of servers at commas (spaces around them dropped): *count URLs into urls[]. */
static char *split_servers(const char *servers, const char **urls, int *count)
{
    char *copy = strdup(servers && *servers ? servers : TALLY_NATS_DEFAULT_URL);
    *count = 0;
    if (!copy)
        return NULL;
    for (char *tok = strtok(copy, ","); tok && *count < MAX_SERVERS; tok = strtok(NULL, ",")) {
        while (*tok == ' ')
            tok++;
        char *end = tok + strlen(tok);
        while (end > tok && end[-1] == ' ')
            *--end = 0;
        if (*tok)
            urls[(*count)++] = tok;
    }
    return copy;
}

/* The host part of one URL ("nats://user:pw@host:4222" -> "host") into host; the userinfo's
 * presence in *userinfo. */
static void url_host(const char *url, char *host, size_t cap, bool *userinfo)
{
    const char *p = strstr(url, "://");
    p = p ? p + 3 : url;
    const char *at = strchr(p, '@');
    const char *slash = strchr(p, '/');
    *userinfo = at && (!slash || at < slash);
    if (*userinfo)
        p = at + 1;
    size_t len;
    if (*p == '[') { /* [::1]:4222 */
        const char *close = strchr(p, ']');
        p++;
        len = close ? (size_t)(close - p) : strlen(p);
    } else {
        len = strcspn(p, ":/");
    }
    snprintf(host, cap, "%.*s", (int)len, p);
}

static bool host_local(const char *host)
{
    return strcmp(host, "localhost") == 0 || strcmp(host, "::1") == 0 ||
           strncmp(host, "127.", 4) == 0;
}

bool tally__nats_servers_local(const char *servers)
{
    const char *urls[MAX_SERVERS];
    int n;
    char *copy = split_servers(servers, urls, &n);
    bool local = copy && n > 0;
    for (int i = 0; i < n && local; i++) {
        char host[256];
        bool userinfo;
        url_host(urls[i], host, sizeof host, &userinfo);
        local = host_local(host);
    }
    free(copy);
    return local;
}

bool tally__nats_has_credentials(const tally_nats_conf_t *conf)
{
    if ((conf->credentials && *conf->credentials) || (conf->nkey && *conf->nkey))
        return true;
    const char *urls[MAX_SERVERS];
    int n;
    char *copy = split_servers(conf->servers, urls, &n);
    bool any = false;
    for (int i = 0; i < n && !any; i++) {
        char host[256];
        url_host(urls[i], host, sizeof host, &any);
    }
    free(copy);
    return any;
}

/* The user of one URL's userinfo ("user:pw@"; a token alone names none) into out; false when
 * it has none. */
static bool url_user(const char *url, char *out, size_t cap)
{
    const char *p = strstr(url, "://");
    p = p ? p + 3 : url;
    size_t info = strcspn(p, "@/");
    if (p[info] != '@')
        return false;
    const char *colon = memchr(p, ':', info);
    if (!colon)
        return false; /* a token: secret, and no user */
    snprintf(out, cap, "%.*s", (int)(colon - p), p);
    return true;
}

tally_status_t tally__nats_user(const tally_nats_conf_t *conf, char *out, size_t cap, char *msg,
                                size_t msg_cap)
{
    snprintf(out, cap, "%s", TALLY_NATS_USER_ANON);
    if (conf->user && *conf->user) {
        snprintf(out, cap, "%s", conf->user);
    } else {
        const char *urls[MAX_SERVERS];
        int n;
        char *copy = split_servers(conf->servers, urls, &n);
        for (int i = 0; i < n && !url_user(urls[i], out, cap); i++)
            ;
        free(copy);
    }
    if (tally_fleet_member_id_valid(out))
        return TALLY_OK;
    snprintf(msg, msg_cap,
             "NATS user '%s' cannot name the fleet's subjects (1..64 characters of A-Z a-z 0-9 "
             "- _): give another user",
             out);
    return TALLY_E_ARG;
}

/* The authentication and TLS options; TALLY_E_ARG with msg when one is refused. */
static tally_status_t set_security(natsOptions *o, const tally_nats_conf_t *conf, char *msg,
                                   size_t cap)
{
    bool nkey = conf->nkey && *conf->nkey, seed = conf->nkey_seed && *conf->nkey_seed;
    if (nkey != seed) {
        snprintf(msg, cap, "an nkey needs its seed file, and a seed file its nkey");
        return TALLY_E_ARG;
    }
    if (conf->credentials && *conf->credentials &&
        natsOptions_SetUserCredentialsFromFiles(o, conf->credentials, NULL) != NATS_OK) {
        snprintf(msg, cap, "credentials %s: %s", conf->credentials, nats_GetLastError(NULL));
        return TALLY_E_ARG;
    }
    if (nkey && natsOptions_SetNKeyFromSeed(o, conf->nkey, conf->nkey_seed) != NATS_OK) {
        snprintf(msg, cap, "nkey seed %s: %s", conf->nkey_seed, nats_GetLastError(NULL));
        return TALLY_E_ARG;
    }
    if (conf->tls_ca && *conf->tls_ca &&
        (natsOptions_SetSecure(o, true) != NATS_OK ||
         natsOptions_LoadCATrustedCertificates(o, conf->tls_ca) != NATS_OK)) {
        snprintf(msg, cap, "TLS CA file %s: %s", conf->tls_ca, nats_GetLastError(NULL));
        return TALLY_E_ARG;
    }
    bool cert = conf->tls_cert && *conf->tls_cert, key = conf->tls_key && *conf->tls_key;
    if (cert != key) {
        snprintf(msg, cap, "a TLS client certificate needs its key, and a key its certificate");
        return TALLY_E_ARG;
    }
    if (cert && natsOptions_LoadCertificatesChain(o, conf->tls_cert, conf->tls_key) != NATS_OK) {
        snprintf(msg, cap, "TLS certificate %s: %s", conf->tls_cert, nats_GetLastError(NULL));
        return TALLY_E_ARG;
    }
    return TALLY_OK;
}

tally_status_t tally__nats_connect(const tally_nats_conf_t *conf, natsConnection **out, char *msg,
                                   size_t cap)
{
    const char *urls[MAX_SERVERS];
    int n = 0;
    natsOptions *o = NULL;
    tally_status_t st = TALLY_E_NOMEM;
    *out = NULL;
    char *copy = split_servers(conf->servers, urls, &n);
    if (!copy || natsOptions_Create(&o) != NATS_OK) {
        snprintf(msg, cap, "out of memory");
        goto out;
    }
    st = TALLY_E_ARG;
    if (n == 0 || natsOptions_SetServers(o, urls, n) != NATS_OK) {
        char shown[512];
        snprintf(msg, cap, "servers '%s': %s",
                 tally_fleet_redact(conf->servers, shown, sizeof shown),
                 n ? nats_GetLastError(NULL) : "no URL");
        goto out;
    }
    if ((st = set_security(o, conf, msg, cap)) != TALLY_OK)
        goto out;
    /* Every inbox of this connection (replies, PubAcks, JetStream API answers) under
     * _INBOX.<user>: the server lets only this user subscribe there. */
    char user[TALLY_NATS_MEMBER_ID_MAX + 1], prefix[sizeof user + 8];
    if ((st = tally__nats_user(conf, user, sizeof user, msg, cap)) != TALLY_OK)
        goto out;
    snprintf(prefix, sizeof prefix, "%s%s", TALLY_NATS_INBOX, user);
    if (natsOptions_SetCustomInboxPrefix(o, prefix) != NATS_OK) {
        snprintf(msg, cap, "NATS inbox prefix %s: %s", prefix, nats_GetLastError(NULL));
        st = TALLY_E_ARG;
        goto out;
    }
    /* Reconnect forever, quickly: a cluster node restarts or a leader moves within seconds. */
    if (natsOptions_SetName(o, conf->name ? conf->name : "tally") != NATS_OK ||
        natsOptions_SetTimeout(o, conf->timeout_ms > 0 ? conf->timeout_ms : 2000) != NATS_OK ||
        natsOptions_SetMaxReconnect(o, -1) != NATS_OK ||
        natsOptions_SetReconnectWait(o, 250) != NATS_OK ||
        natsOptions_SetSendAsap(o, conf->send_asap) != NATS_OK ||
        (conf->on_disconnected &&
         natsOptions_SetDisconnectedCB(o, conf->on_disconnected, conf->link_closure) != NATS_OK) ||
        (conf->on_reconnected &&
         natsOptions_SetReconnectedCB(o, conf->on_reconnected, conf->link_closure) != NATS_OK)) {
        snprintf(msg, cap, "NATS options: %s", nats_GetLastError(NULL));
        goto out;
    }
    st = TALLY_E_TRANSPORT;
    natsStatus s = natsConnection_Connect(out, o);
    if (s != NATS_OK) {
        char shown[512];
        snprintf(msg, cap, "cannot connect to %s: %s",
                 tally_fleet_redact(conf->servers ? conf->servers : urls[0], shown, sizeof shown),
                 natsStatus_GetText(s));
        *out = NULL;
        goto out;
    }
    st = TALLY_OK;
out:
    natsOptions_Destroy(o);
    free(copy);
    return st;
}

void tally__nats_sub_close(natsConnection *nc, natsSubscription **sub)
{
    if (!*sub)
        return;
    /* Only a connected connection has a read loop delivering (one that lost its socket is
     * joined before the reconnect: a stop while NATS is away waits for nothing here). A flush that
     * fails ends the wait too: a server slower than TALLY_NATS_SUB_CLOSE_MS, by which time a
     * message being delivered at the unsubscribe is long delivered. */
    if (natsSubscription_Unsubscribe(*sub) == NATS_OK &&
        natsConnection_Status(nc) == NATS_CONN_STATUS_CONNECTED)
        natsConnection_FlushTimeout(nc, TALLY_NATS_SUB_CLOSE_MS);
    natsSubscription_Destroy(*sub);
    *sub = NULL;
}
