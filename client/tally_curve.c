/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_curve.c — where a client's CURVE keys come from (tally_curve_keys_load, tally.h):
 * arguments, then the environment, then the user's configuration file. Pure file and string
 * work over tally_keys.h; tally_client_new_curve (tally.c) applies the keys to the socket.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <zmq.h>

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

/* The keys to connect with (tally_curve_keys_load); for_fleet: the client's pair whenever one is
 * given, the server key optional (tally_curve_client_keys_load). */
static tally_status_t keys_load(const char *server_key, const char *client_key, bool for_fleet,
                                tally_curve_keys_t *keys, char *msg, size_t msg_cap)
{
    char server_buf[CONF_LINE_MAX], client_buf[CONF_LINE_MAX], unused[TALLY_KEY_LEN + 1];
    if (!keys)
        return TALLY_E_ARG;
    memset(keys, 0, sizeof *keys);
    const char *server =
        pick(server_key, "TALLY_SERVER_KEY", "server_key", server_buf, sizeof server_buf);
    const char *client =
        pick(client_key, "TALLY_CLIENT_KEY", "client_key", client_buf, sizeof client_buf);
    if (!server && (!for_fleet || !client))
        return TALLY_OK; /* CURVE off */
    tally_status_t st = TALLY_OK;
    if (server && access(server, F_OK) != 0 && tally_key_valid(server, strlen(server)))
        snprintf(keys->server_public, sizeof keys->server_public, "%s", server);
    else if (server)
        st = tally_key_file_read(server, false, keys->server_public, unused, msg, msg_cap);
    if (st == TALLY_OK && server && !keys->server_public[0]) {
        snprintf(msg, msg_cap, "%s holds no public-key (the server's public key)", server);
        st = TALLY_E_PARAM;
    }
    if (st != TALLY_OK)
        goto fail;
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

tally_status_t tally_curve_keys_load(const char *server_key, const char *client_key,
                                     tally_curve_keys_t *keys, char *msg, size_t msg_cap)
{
    return keys_load(server_key, client_key, false, keys, msg, msg_cap);
}

tally_status_t tally_curve_client_keys_load(const char *server_key, const char *client_key,
                                            tally_curve_keys_t *keys, char *msg, size_t msg_cap)
{
    return keys_load(server_key, client_key, true, keys, msg, msg_cap);
}

/* One key file, created (never replaced) with mode `mode`. */
static tally_status_t write_key_file(const char *path, mode_t mode, const char *pub,
                                     const char *sec, char *msg, size_t msg_cap)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (fd < 0) {
        int err = errno;
        char dir[4096];
        snprintf(dir, sizeof dir, "%s", path);
        char *slash = strrchr(dir, '/');
        struct stat sb;
        if (slash)
            *(slash == dir ? slash + 1 : slash) = '\0';
        if (err == ENOENT && slash && stat(dir, &sb) != 0 && errno == ENOENT)
            snprintf(msg, msg_cap,
                     "cannot create %s: the directory %s does not exist (make it first: mkdir -p "
                     "%s)",
                     path, dir, dir);
        else
            snprintf(msg, msg_cap, "cannot create %s: %s", path, strerror(err));
        return TALLY_E_IO;
    }
    char text[512];
    int n = snprintf(text, sizeof text,
                     "#   ZeroMQ CURVE %s certificate, made by tally keygen\n"
                     "#   %s\n"
                     "metadata\n"
                     "curve\n"
                     "    public-key = \"%s\"\n",
                     sec ? "**secret**" : "public",
                     sec ? "keep it private (mode 0600); give the .pub file to the other side"
                         : "the public half: give it to the other side",
                     pub);
    if (sec)
        n += snprintf(text + n, sizeof text - (size_t)n, "    secret-key = \"%s\"\n", sec);
    bool ok = fchmod(fd, mode) == 0 && write(fd, text, (size_t)n) == n;
    explicit_bzero(text, sizeof text);
    ok &= close(fd) == 0;
    if (!ok) {
        snprintf(msg, msg_cap, "cannot write %s: %s", path, strerror(errno));
        unlink(path);
        return TALLY_E_IO;
    }
    return TALLY_OK;
}

tally_status_t tally_keygen(const char *base, char public_key[41], char *msg, size_t msg_cap)
{
    char pub[TALLY_KEY_LEN + 1], sec[TALLY_KEY_LEN + 1], path[4096];
    if (!base || !base[0] || strlen(base) + 5 > sizeof path)
        return TALLY_E_ARG;
    if (zmq_curve_keypair(pub, sec) != 0) {
        snprintf(msg, msg_cap, "cannot make a key pair: %s", zmq_strerror(errno));
        return TALLY_E_ARG;
    }
    snprintf(path, sizeof path, "%s.key", base);
    tally_status_t st = write_key_file(path, 0600, pub, sec, msg, msg_cap);
    explicit_bzero(sec, sizeof sec);
    if (st != TALLY_OK)
        return st;
    snprintf(path, sizeof path, "%s.pub", base);
    st = write_key_file(path, 0644, pub, NULL, msg, msg_cap);
    if (st != TALLY_OK) { /* no half a pair */
        snprintf(path, sizeof path, "%s.key", base);
        unlink(path);
        return st;
    }
    if (public_key)
        snprintf(public_key, TALLY_KEY_LEN + 1, "%s", pub);
    return TALLY_OK;
}
