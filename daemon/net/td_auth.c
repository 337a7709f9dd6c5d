/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_auth.c — see td_auth.h.
 *
 * Threads: td_auth_new, td_auth_apply, td_auth_reload and td_auth_destroy run on the loop
 * thread, td_auth_event there and on the fronts' threads (td_zmq_front.c); the handler thread
 * owns the ZAP socket from td_auth_apply on (a ZeroMQ socket is used by one thread at a time;
 * pthread_create and pthread_join order the hand-over and the hand-back). The allowed keys and
 * the refusal log's rate limit are what they share, under the lock: reload builds a new set and
 * swaps it in, the handler looks a key up. Counters are atomics the loop thread reads for the
 * metrics.
 */
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <zmq.h>

#include "td_auth.h"
#include "td_log.h"

#define ZAP_ENDPOINT "inproc://zeromq.zap.01" /* fixed by RFC 27 */
#define ZAP_DOMAIN "tallyd"
#define ZAP_FRAMES_MAX 8 /* a CURVE request has 7 */
#define AUTH_POLL_MS 100 /* how soon the handler thread notices td_auth_destroy */
#define USER_ID_MAX 64   /* a key's name: the file name less .pub, or the list item's NAME */
#define ALLOWED_KEYS_MAX 65536
/* Refusals logged per second at most: a peer that reconnects in a loop with a bad key (ZeroMQ
 * retries every 100 ms by default, and a hostile one faster) must not flood the journal. The
 * counters still count every one. */
#define REFUSAL_LOGS_PER_S 10

typedef struct {
    uint8_t key[32]; /* binary, as ZAP hands it over */
    char user[USER_ID_MAX + 1];
} allowed_key_t;

typedef struct {
    allowed_key_t *keys;
    size_t count;
    size_t cap;
} key_set_t;

struct td_auth {
    void *zap; /* REP at ZAP_ENDPOINT */
    void *ctx;
    pthread_t thread;
    bool thread_started;
    atomic_bool stop;
    char public_key[TALLY_KEY_LEN + 1];
    char secret_key[TALLY_KEY_LEN + 1];
    pthread_mutex_t lock; /* guards allowed and the rate limit below */
    key_set_t allowed;
    _Atomic uint64_t allowed_count, unknown_key, no_curve, bad_handshake, zap_errors;
    /* The refusal log's rate limit (the handler thread's refusals, the loop thread's events). */
    time_t log_second;
    unsigned logged, suppressed;
};

/* Whether to log one more refusal now (REFUSAL_LOGS_PER_S a second); says how many were left
 * out once a new second starts. */
static bool refusal_log_ok(td_auth_t *self)
{
    pthread_mutex_lock(&self->lock);
    time_t now = time(NULL);
    if (now != self->log_second) {
        if (self->suppressed)
            td_warn("curve: %u more refusals not logged (tallyd_auth_total counts them)",
                    self->suppressed);
        self->log_second = now;
        self->logged = self->suppressed = 0;
    }
    bool ok = self->logged < REFUSAL_LOGS_PER_S;
    if (ok)
        self->logged++;
    else
        self->suppressed++;
    pthread_mutex_unlock(&self->lock);
    return ok;
}

/* ---- The allowed keys ------------------------------------------------------------------- */

/* z85 is a key tally_key_valid accepted (the settings' check of curve_clients, or
 * tally_key_file_read's of a file), so it decodes: TD_ERR_NOMEM (no memory, or ALLOWED_KEYS_MAX
 * reached) is the one failure. */
static td_err_t add_key(key_set_t *set, const char *z85, const char *user, size_t user_len)
{
    if (set->count == set->cap) {
        size_t cap = set->cap ? 2 * set->cap : 16;
        allowed_key_t *keys =
            cap <= ALLOWED_KEYS_MAX ? realloc(set->keys, cap * sizeof *keys) : NULL;
        if (!keys)
            return TD_ERR_NOMEM;
        set->keys = keys;
        set->cap = cap;
    }
    allowed_key_t *k = &set->keys[set->count];
    zmq_z85_decode(k->key, z85);
    if (user_len > USER_ID_MAX)
        user_len = USER_ID_MAX;
    memcpy(k->user, user, user_len);
    k->user[user_len] = '\0';
    set->count++;
    return TD_OK;
}

/* The public key in the file dir/name, under the name less .pub. */
static td_err_t load_key_file(key_set_t *set, const char *dir, const char *name, size_t len,
                              char *msg, size_t cap)
{
    char path[4096], pub[TALLY_KEY_LEN + 1], sec[TALLY_KEY_LEN + 1];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    tally_status_t st = tally_key_file_read(path, false, pub, sec, msg, cap);
    explicit_bzero(sec, sizeof sec);
    if (st != TALLY_OK)
        return TD_ERR_IO;
    if (!pub[0]) {
        snprintf(msg, cap, "%s holds no public-key", path);
        return TD_ERR_IO;
    }
    if (add_key(set, pub, name, len - 4) != TD_OK) {
        snprintf(msg, cap, "%s: cannot hold its key (out of memory, or over %d keys)", path,
                 ALLOWED_KEYS_MAX);
        return TD_ERR_NOMEM;
    }
    return TD_OK;
}

/* Every NAME.pub file of dir: the key in it, under NAME. */
static td_err_t load_dir(key_set_t *set, const char *dir, char *msg, size_t cap)
{
    DIR *d = opendir(dir);
    if (!d) {
        snprintf(msg, cap, "curve_clients_dir %s: %s", dir, strerror(errno));
        return TD_ERR_IO;
    }
    td_err_t err = TD_OK;
    struct dirent *e;
    while (err == TD_OK && (e = readdir(d)) != NULL) {
        size_t len = strlen(e->d_name);
        if (e->d_name[0] == '.' || len <= 4 || strcmp(e->d_name + len - 4, ".pub") != 0)
            continue;
        err = load_key_file(set, dir, e->d_name, len, msg, cap);
    }
    closedir(d);
    return err;
}

/* curve_clients: comma-separated KEY or NAME:KEY items (a key is 40 characters, so the name is
 * what comes before the last 41). The settings refused any other list (valid_key_list in
 * td_settings.c, at start and at every reload, the only way a list gets here): every item is
 * KEY or NAME:KEY, and every key one tally_key_valid accepts. */
static td_err_t load_list(key_set_t *set, const char *list, char *msg, size_t cap)
{
    for (const char *p = list; *p;) {
        size_t len = strcspn(p, ",");
        const char *key = p + len - TALLY_KEY_LEN;
        bool named = len > TALLY_KEY_LEN;
        char z85[TALLY_KEY_LEN + 1];
        memcpy(z85, key, TALLY_KEY_LEN);
        z85[TALLY_KEY_LEN] = '\0';
        td_err_t err = named ? add_key(set, z85, p, len - TALLY_KEY_LEN - 1)
                             : add_key(set, z85, key, TALLY_KEY_LEN);
        if (err != TD_OK) {
            snprintf(msg, cap, "curve_clients: cannot hold '%.*s' (out of memory, or over %d keys)",
                     (int)len, p, ALLOWED_KEYS_MAX);
            return err;
        }
        p += len + (p[len] == ',');
    }
    return TD_OK;
}

static td_err_t load_allowed(const td_config_t *cfg, key_set_t *set, char *msg, size_t cap)
{
    memset(set, 0, sizeof *set);
    td_err_t st = TD_OK;
    if (cfg->curve_clients_dir)
        st = load_dir(set, cfg->curve_clients_dir, msg, cap);
    if (st == TD_OK && cfg->curve_clients)
        st = load_list(set, cfg->curve_clients, msg, cap);
    if (st != TD_OK) {
        free(set->keys);
        memset(set, 0, sizeof *set);
    }
    return st;
}

/* ---- The handler thread ----------------------------------------------------------------- */

/* The user id of an allowed key, copied into user; false when the key is not allowed. */
static bool lookup(td_auth_t *self, const uint8_t key[32], char *user, size_t cap)
{
    bool found = false;
    pthread_mutex_lock(&self->lock);
    for (size_t i = 0; i < self->allowed.count && !found; i++) {
        if (memcmp(self->allowed.keys[i].key, key, 32) == 0) {
            snprintf(user, cap, "%s", self->allowed.keys[i].user);
            found = true;
        }
    }
    pthread_mutex_unlock(&self->lock);
    return found;
}

/* The answer to one ZAP request. ZeroMQ refusing a frame (it cannot, on an inproc REP socket
 * with a request waiting, short of running out of memory) is logged and counted: that client's
 * handshake then waits for an answer that never comes. */
static void zap_reply(td_auth_t *self, const zmq_msg_t *request_id, const char *code,
                      const char *text, const char *user)
{
    zmq_msg_t *id = (zmq_msg_t *)request_id;
    const void *frames[] = {"1.0", zmq_msg_data(id), code, text, user, ""};
    size_t sizes[] = {3, zmq_msg_size(id), strlen(code), strlen(text), strlen(user), 0};
    size_t n = sizeof frames / sizeof frames[0]; /* the last: no metadata */
    for (size_t i = 0; i < n; i++) {
        if (zmq_send(self->zap, frames[i], sizes[i], i + 1 < n ? ZMQ_SNDMORE : 0) < 0) {
            atomic_fetch_add(&self->zap_errors, 1);
            td_warn("curve: cannot answer a ZAP request (%s): %s", code, zmq_strerror(errno));
            return;
        }
    }
}

/* One ZAP request (RFC 27): version, request id, domain, address, routing id, mechanism, then
 * for CURVE the client's 32-byte public key. */
static void handle_zap(td_auth_t *self)
{
    zmq_msg_t f[ZAP_FRAMES_MAX];
    int n = 0;
    for (bool more = true; more;) {
        zmq_msg_t frame;
        zmq_msg_init(&frame);
        if (zmq_msg_recv(&frame, self->zap, 0) == -1) {
            zmq_msg_close(&frame);
            break;
        }
        more = zmq_msg_more(&frame);
        if (n < ZAP_FRAMES_MAX) {
            zmq_msg_init(&f[n]);
            zmq_msg_move(&f[n++], &frame);
        }
        zmq_msg_close(&frame);
    }
    if (n < 2)
        goto done; /* nothing to answer to: REP would lose its envelope */
    char address[64] = "";
    if (n > 3)
        snprintf(address, sizeof address, "%.*s", (int)zmq_msg_size(&f[3]),
                 (const char *)zmq_msg_data(&f[3]));
    bool curve = n == 7 && zmq_msg_size(&f[5]) == 5 &&
                 memcmp(zmq_msg_data(&f[5]), "CURVE", 5) == 0 && zmq_msg_size(&f[6]) == 32;
    char user[USER_ID_MAX + 1];
    if (curve && lookup(self, zmq_msg_data(&f[6]), user, sizeof user)) {
        td_info("curve: client '%s' connected from %s", user, address[0] ? address : "?");
        zap_reply(self, &f[1], "200", "OK", user);
        goto done;
    }
    char z85[TALLY_KEY_LEN + 1] = "?";
    if (curve)
        zmq_z85_encode(z85, zmq_msg_data(&f[6]), 32);
    if (refusal_log_ok(self))
        td_warn("curve: refused a client from %s: key %s is not allowed (curve_clients_dir, "
                "curve_clients)",
                address[0] ? address : "?", z85);
    zap_reply(self, &f[1], "400", "key not allowed", "");
done:
    for (int i = 0; i < n; i++)
        zmq_msg_close(&f[i]);
}

void td_auth_event(td_auth_t *self, unsigned event, uint32_t value)
{
    switch (event) {
    case ZMQ_EVENT_HANDSHAKE_SUCCEEDED:
        atomic_fetch_add(&self->allowed_count, 1);
        break;
    case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH: /* the ZAP handler said 400, and logged it */
        atomic_fetch_add(&self->unknown_key, 1);
        break;
    case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if (value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) {
            atomic_fetch_add(&self->no_curve, 1);
            if (refusal_log_ok(self))
                td_warn("curve: refused a client that does not use CURVE (no key; set the "
                        "server's public key and a client key pair)");
            break;
        }
        atomic_fetch_add(&self->bad_handshake, 1);
        if (refusal_log_ok(self))
            td_warn("curve: refused a client whose handshake failed (error 0x%x: most likely it "
                    "uses another server public key)",
                    (unsigned)value);
        break;
    case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        atomic_fetch_add(&self->bad_handshake, 1);
        if (refusal_log_ok(self))
            td_warn("curve: a client's handshake failed (it hung up during the handshake: a "
                    "client without keys, or with another server key, may)");
        break;
    default:
        break;
    }
}

static void *auth_thread(void *arg)
{
    td_auth_t *self = arg;
    zmq_pollitem_t items[1] = {{self->zap, 0, ZMQ_POLLIN, 0}};
    while (!atomic_load(&self->stop)) {
        if (zmq_poll(items, 1, AUTH_POLL_MS) < 0) {
            if (errno == ETERM)
                break;
            continue;
        }
        if (items[0].revents & ZMQ_POLLIN)
            handle_zap(self);
    }
    return NULL;
}

/* ---- Life cycle ------------------------------------------------------------------------- */

/* The server's key pair, from curve_secret_key, into public_key and secret_key (41 bytes). */
static td_err_t load_secret(char *public_key, char *secret_key, const char *path, char *msg,
                            size_t msg_cap)
{
    if (tally_key_file_read(path, true, public_key, secret_key, msg, msg_cap) != TALLY_OK)
        return TD_ERR_IO;
    /* A bare secret key: derive its public half. */
    if (!public_key[0] && zmq_curve_public(public_key, secret_key) != 0) {
        snprintf(msg, msg_cap, "%s: cannot derive the public key", path);
        return TD_ERR_IO;
    }
    return TD_OK;
}

td_err_t td_auth_public_key(const td_config_t *cfg, char out[TALLY_KEY_LEN + 1], char *msg,
                            size_t msg_cap)
{
    out[0] = '\0';
    if (!cfg->curve_secret_key)
        return TD_OK;
    char secret_key[TALLY_KEY_LEN + 1];
    td_err_t err = load_secret(out, secret_key, cfg->curve_secret_key, msg, msg_cap);
    explicit_bzero(secret_key, sizeof secret_key);
    if (err != TD_OK)
        out[0] = '\0';
    return err;
}

td_err_t td_auth_check(const td_config_t *cfg, char *msg, size_t msg_cap)
{
    if (!cfg->curve_secret_key)
        return TD_OK;
    char public_key[TALLY_KEY_LEN + 1], secret_key[TALLY_KEY_LEN + 1];
    key_set_t allowed;
    td_err_t err = load_secret(public_key, secret_key, cfg->curve_secret_key, msg, msg_cap);
    explicit_bzero(secret_key, sizeof secret_key);
    if (err == TD_OK && (err = load_allowed(cfg, &allowed, msg, msg_cap)) == TD_OK)
        free(allowed.keys);
    return err;
}

td_err_t td_auth_new(void *zmq_ctx, const td_config_t *cfg, td_auth_t **out, char *msg,
                     size_t msg_cap)
{
    td_auth_t *self = calloc(1, sizeof *self);
    if (!self)
        return TD_ERR_NOMEM;
    self->ctx = zmq_ctx;
    pthread_mutex_init(&self->lock, NULL); /* fills in memory: never fails with glibc */
    td_err_t err =
        load_secret(self->public_key, self->secret_key, cfg->curve_secret_key, msg, msg_cap);
    if (err == TD_OK)
        err = load_allowed(cfg, &self->allowed, msg, msg_cap);
    if (err != TD_OK)
        goto fail;
    self->zap = zmq_socket(zmq_ctx, ZMQ_REP);
    if (!self->zap || zmq_bind(self->zap, ZAP_ENDPOINT) != 0) {
        snprintf(msg, msg_cap, "cannot start the ZAP handler: %s", zmq_strerror(errno));
        err = TD_ERR_LIBRARY;
        goto fail;
    }
    td_notice("curve: on, server public key %s, %zu client keys allowed", self->public_key,
              self->allowed.count);
    *out = self;
    return TD_OK;
fail:
    td_auth_destroy(&self);
    return err;
}

td_err_t td_auth_secure(const td_auth_t *self, void *sock)
{
    int one = 1;
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVER, &one, sizeof one) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, self->secret_key, TALLY_KEY_LEN) != 0 ||
        zmq_setsockopt(sock, ZMQ_ZAP_DOMAIN, ZAP_DOMAIN, strlen(ZAP_DOMAIN)) != 0) {
        td_err("cannot make the socket a CURVE server: %s", zmq_strerror(errno));
        return TD_ERR_LIBRARY;
    }
    return TD_OK;
}

td_err_t td_auth_apply(td_auth_t *self, void *router)
{
    if (td_auth_secure(self, router) != TD_OK)
        return TD_ERR_LIBRARY;
    if (pthread_create(&self->thread, NULL, auth_thread, self) != 0) {
        td_err("cannot start the ZAP handler thread");
        return TD_ERR_LIBRARY;
    }
    self->thread_started = true;
    return TD_OK;
}

void td_auth_reload(td_auth_t *self, const td_config_t *cfg)
{
    if (!self)
        return;
    key_set_t next, old;
    char msg[512];
    if (load_allowed(cfg, &next, msg, sizeof msg) != TD_OK) {
        td_err("reload: %s; keeping the %zu client keys allowed", msg, self->allowed.count);
        return;
    }
    pthread_mutex_lock(&self->lock);
    old = self->allowed;
    self->allowed = next;
    pthread_mutex_unlock(&self->lock);
    td_notice("reload: curve client keys: %zu -> %zu (connections already made stay)", old.count,
              next.count);
    free(old.keys);
}

void td_auth_counts(td_auth_t *self, td_auth_counts_t *out)
{
    *out = (td_auth_counts_t){
        .allowed = atomic_load(&self->allowed_count),
        .unknown_key = atomic_load(&self->unknown_key),
        .no_curve = atomic_load(&self->no_curve),
        .bad_handshake = atomic_load(&self->bad_handshake),
        .zap_errors = atomic_load(&self->zap_errors),
    };
}

void td_auth_destroy(td_auth_t **self_p)
{
    td_auth_t *self = *self_p;
    if (!self)
        return;
    if (self->thread_started) {
        atomic_store(&self->stop, true);
        pthread_join(self->thread, NULL);
    }
    if (self->zap)
        zmq_close(self->zap);
    explicit_bzero(self->secret_key, sizeof self->secret_key);
    free(self->allowed.keys);
    pthread_mutex_destroy(&self->lock);
    free(self);
    *self_p = NULL;
}
