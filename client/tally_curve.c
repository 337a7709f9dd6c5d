/*
 * tally_curve.c — where a client's CURVE keys come from (tally_curve_keys_load, tally.h):
 * arguments, then the environment, then the user's configuration file. Pure file and string
 * work over tally_keys.h; tally_client_set_curve (tally.c) applies the keys to the socket.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tally.h"
#include "tally_keys.h"

#define CONF_LINE_MAX 1024

/* The user's configuration file: $XDG_CONFIG_HOME/tally/tally.conf, else ~/.config/... */
static bool conf_path(char *buf, size_t cap)
{
    const char *xdg = getenv("XDG_CONFIG_HOME");
    const char *home = getenv("HOME");
    if (xdg && xdg[0])
        return (size_t)snprintf(buf, cap, "%s/tally/tally.conf", xdg) < cap;
    if (home && home[0])
        return (size_t)snprintf(buf, cap, "%s/.config/tally/tally.conf", home) < cap;
    return false;
}

/* `name = value` from the configuration file, into out ("" when absent or no file). */
static void conf_value(const char *name, char *out, size_t cap)
{
    char path[1024], line[CONF_LINE_MAX];
    out[0] = '\0';
    FILE *f = conf_path(path, sizeof path) ? fopen(path, "r") : NULL;
    if (!f)
        return;
    size_t n = strlen(name);
    while (fgets(line, sizeof line, f)) {
        char *p = line + strspn(line, " \t");
        if (strncmp(p, name, n) != 0)
            continue;
        p += n;
        p += strspn(p, " \t");
        if (*p != '=')
            continue;
        p++;
        p += strspn(p, " \t");
        p[strcspn(p, "\r\n")] = '\0';
        size_t len = strlen(p);
        while (len && (p[len - 1] == ' ' || p[len - 1] == '\t'))
            p[--len] = '\0';
        snprintf(out, cap, "%s", p);
    }
    fclose(f);
}

/* The first of: the argument, the environment variable, the configuration file's key. */
static const char *pick(const char *arg, const char *env, const char *conf_key, char *buf,
                        size_t cap)
{
    if (arg && arg[0])
        return arg;
    const char *e = getenv(env);
    if (e && e[0])
        return e;
    conf_value(conf_key, buf, cap);
    return buf[0] ? buf : NULL;
}

static tally_status_t status_of(tally_status_t st)
{
    return st == TALLY_E_IO ? TALLY_E_IO : TALLY_E_ARG;
}

tally_status_t tally_curve_keys_load(const char *server_key, const char *client_key,
                                     tally_curve_keys_t *keys, char *msg, size_t msg_cap)
{
    char server_buf[CONF_LINE_MAX], client_buf[CONF_LINE_MAX], unused[TALLY_KEY_LEN + 1];
    if (!keys)
        return TALLY_E_ARG;
    memset(keys, 0, sizeof *keys);
    const char *server =
        pick(server_key, "TALLY_SERVER_KEY", "server_key", server_buf, sizeof server_buf);
    if (!server)
        return TALLY_OK; /* CURVE off */
    tally_status_t st = TALLY_OK;
    if (access(server, F_OK) != 0 && tally_key_valid(server, strlen(server)))
        snprintf(keys->server_public, sizeof keys->server_public, "%s", server);
    else
        st = tally_key_file_read(server, false, keys->server_public, unused, msg, msg_cap);
    if (st == TALLY_OK && !keys->server_public[0]) {
        snprintf(msg, msg_cap, "%s holds no public-key (the server's public key)", server);
        st = TALLY_E_PARAM;
    }
    if (st != TALLY_OK)
        goto fail;
    const char *client =
        pick(client_key, "TALLY_CLIENT_KEY", "client_key", client_buf, sizeof client_buf);
    if (!client) {
        snprintf(msg, msg_cap,
                 "a server key is set but no client key: make one with `tally keygen NAME`, give "
                 "the server NAME.pub, and pass NAME.key (--client-key, TALLY_CLIENT_KEY or "
                 "client_key in ~/.config/tally/tally.conf)");
        st = TALLY_E_ARG;
        goto fail;
    }
    st = tally_key_file_read(client, true, keys->client_public, keys->client_secret, msg, msg_cap);
    if (st == TALLY_OK && !keys->client_public[0]) {
        snprintf(msg, msg_cap, "%s: no public-key beside the secret key (use `tally keygen`)",
                 client);
        st = TALLY_E_PARAM;
    }
    if (st == TALLY_OK)
        return TALLY_OK;
fail:
    memset(keys, 0, sizeof *keys);
    return status_of(st);
}
