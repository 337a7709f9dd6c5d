/*
 * td_config_file.c — the configuration file (INI, parsed by inih) and SIGHUP reload.
 *
 * Design
 * ------
 * Every file key maps 1:1 to a command-line option, through the one table below: a key's value
 * is handed to td_config_parse_args as if it had been typed as `--option value`, so the file and
 * the command line share one parser, one set of limits and one set of error rules. Adding a
 * setting is a case in td_config_parse_args plus one line here.
 *
 * Layers: defaults < file < command line. The command line is parsed twice: first on its own
 * (to find --config, --help, and whether it names endpoints), then over the file's values. Binds
 * are the one list: when the command line gives any --bind, the file's bind= lines are dropped
 * instead of added to.
 *
 * inih calls the handler without a line number (Debian builds it without INI_HANDLER_LINENO),
 * so the file is fed through ini_parse_stream with a reader that counts lines: inih handles
 * each line as soon as it has read it, so the count is the line of the key being handled.
 *
 * Reload (SIGHUP) rebuilds the whole configuration the same way, then copies only what can
 * change while running into the live configuration, logging each change; a bad file leaves the
 * live configuration untouched.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ini.h>

#include "td_config.h"
#include "td_log.h"

typedef struct {
    const char *section;
    const char *key;
    const char *option; /* the long command-line option it stands for */
} td_config_key_t;

/* The configuration file's keys: [section] key = value  means  --option value. */
static const td_config_key_t config_keys[] = {
    {"server", "bind", "--bind"}, /* repeatable */
    {"server", "backend", "--backend"},
    {"server", "max_batch", "--max-batch"},
    {"server", "max_inflight", "--max-inflight"},
    {"server", "max_streams", "--max-streams"},
    {"server", "max_frame", "--max-frame"},
    {"server", "max_inflight_per_peer", "--max-inflight-per-peer"},
    {"server", "max_streams_per_client", "--max-streams-per-client"},
    {"server", "stream_create_rate", "--stream-create-rate"},
    {"server", "drain_ms", "--drain-ms"},
    {"server", "workers", "--workers"},
    {"server", "log_level", "--log-level"},
    {"server", "io_threads", "--io-threads"},
    {"state", "dir", "--state-dir"},
    {"state", "interval", "--state-interval"},
    {"metrics", "listen", "--metrics"},
    {"metrics", "auth_file", "--metrics-auth-file"},
    {"security", "curve_secret_key", "--curve-secret-key"},
    {"security", "curve_clients_dir", "--curve-clients-dir"},
    {"security", "curve_clients", "--curve-clients"},
    {"security", "protected_mode", "--protected-mode"},
    {"gpu", "streams", "--gpu-streams"},
    {"gpu", "min_batch", "--gpu-min-batch"},
    {"shm", "enabled", "--shm"},
    {"shm", "socket", "--shm-socket"},
    {"shm", "socket_group", "--shm-socket-group"},
    {"shm", "allow_uids", "--shm-allow-uids"},
    {"shm", "allow_gids", "--shm-allow-gids"},
    {"shm", "max_regions_per_peer", "--shm-max-regions-per-peer"},
    {"shm", "max_bytes", "--shm-max-bytes"},
    {"windows", "intervals", "--window-intervals"},
    {"windows", "interval_ms", "--window-interval-ms"},
    {"pub", "endpoint", "--pub"},
    {"pub", "interval_ms", "--pub-interval-ms"},
    {"metrics", "streams", "--metrics-streams"},
};

typedef struct {
    td_config_t *cfg;
    const char *path;
    FILE *file;
    int line;  /* the line inih is handling */
    char *msg; /* the first error, "PATH:LINE: ..." */
    size_t msg_cap;
    bool failed;
} file_parse_t;

static char *count_lines(char *buf, int size, void *stream)
{
    file_parse_t *p = stream;
    char *got = fgets(buf, size, p->file);
    if (got)
        p->line++;
    return got;
}

static const td_config_key_t *find_key(const char *section, const char *key)
{
    for (size_t i = 0; i < sizeof config_keys / sizeof config_keys[0]; i++)
        if (strcmp(config_keys[i].section, section) == 0 && strcmp(config_keys[i].key, key) == 0)
            return &config_keys[i];
    return NULL;
}

static bool section_exists(const char *section)
{
    for (size_t i = 0; i < sizeof config_keys / sizeof config_keys[0]; i++)
        if (strcmp(config_keys[i].section, section) == 0)
            return true;
    return false;
}

static int handle_key(void *user, const char *section, const char *key, const char *value)
{
    file_parse_t *p = user;
    if (p->failed)
        return 1; /* report the first error only */
    const td_config_key_t *k = find_key(section, key);
    if (!k) {
        if (!section[0])
            snprintf(p->msg, p->msg_cap, "%s:%d: key '%s' outside any [section]", p->path, p->line,
                     key);
        else if (!section_exists(section))
            snprintf(p->msg, p->msg_cap, "%s:%d: unknown section [%s]", p->path, p->line, section);
        else
            snprintf(p->msg, p->msg_cap, "%s:%d: unknown key '%s' in [%s]", p->path, p->line, key,
                     section);
        p->failed = true;
        return 0;
    }
    char *argv[] = {"tallyd", (char *)k->option, (char *)value, NULL};
    bool exit_now = false;
    char why[256];
    if (td_config_parse_args(p->cfg, 3, argv, &exit_now, why, sizeof why) != TALLY_OK) {
        snprintf(p->msg, p->msg_cap, "%s:%d: invalid value '%s' for %s in [%s] (see %s in --help)",
                 p->path, p->line, value, key, section, k->option);
        p->failed = true;
        return 0;
    }
    return 1;
}

tally_status_t td_config_load_file(td_config_t *cfg, const char *path, char *msg, size_t msg_cap)
{
    file_parse_t p = {.cfg = cfg, .path = path, .msg = msg, .msg_cap = msg_cap};
    p.file = fopen(path, "r");
    if (!p.file) {
        snprintf(msg, msg_cap, "cannot read %s: %s", path, strerror(errno));
        return TALLY_E_IO;
    }
    int rc = ini_parse_stream(count_lines, &p, handle_key, &p);
    fclose(p.file);
    if (rc == 0 && !p.failed)
        return TALLY_OK;
    if (!p.failed) /* inih's own complaint: a line that is neither [section] nor key = value */
        snprintf(msg, msg_cap, "%s:%d: syntax error (expected [section] or key = value)", path,
                 rc > 0 ? rc : p.line);
    return TALLY_E_PARAM;
}

static void drop_binds(td_config_t *cfg)
{
    for (int i = 0; i < cfg->bind_count; i++) {
        free(cfg->binds[i]);
        cfg->binds[i] = NULL;
    }
    cfg->bind_count = 0;
}

tally_status_t td_config_load(td_config_t *cfg, int argc, char **argv, bool *exit_now, char *msg,
                              size_t msg_cap)
{
    td_config_t cli;
    td_config_init(&cli);
    td_config_clear(cfg);
    /* Pass 1: the command line alone (--config, --help, --version, and its binds). */
    tally_status_t st = td_config_parse_args(&cli, argc, argv, exit_now, msg, msg_cap);
    if (st != TALLY_OK || *exit_now)
        goto cleanup;

    /* The file, over the defaults. */
    const char *path = cli.config_file ? cli.config_file : TD_DEFAULT_CONFIG_FILE;
    st = td_config_load_file(cfg, path, msg, msg_cap);
    if (st == TALLY_E_IO && !cli.config_file_explicit) {
        st = TALLY_OK; /* the default file is optional */
        msg[0] = '\0';
    } else if (st == TALLY_E_IO) {
        st = TALLY_E_PARAM;
    }
    if (st != TALLY_OK)
        goto cleanup;

    /* Pass 2: the command line over the file. */
    if (cli.bind_count > 0)
        drop_binds(cfg);
    st = td_config_parse_args(cfg, argc, argv, exit_now, msg, msg_cap);
    if (st != TALLY_OK)
        goto cleanup;
    /* Checked on the whole configuration: the file and the command line may each set one. */
    if (cfg->max_frame && cfg->max_frame < cfg->max_batch + TD_MAX_FRAME_HEADROOM) {
        snprintf(msg, msg_cap,
                 "max_frame %zu must be at least max_batch %zu + %u, so that an oversize "
                 "payload is answered too_large",
                 cfg->max_frame, cfg->max_batch, TD_MAX_FRAME_HEADROOM);
        st = TALLY_E_PARAM;
        goto cleanup;
    }

    /* Under systemd, StateDirectory= names the state directory (the first of a list). */
    const char *env = getenv("STATE_DIRECTORY");
    if (!cfg->state_dir && env && env[0]) {
        size_t len = strcspn(env, ":");
        cfg->state_dir = strndup(env, len);
        if (!cfg->state_dir) {
            snprintf(msg, msg_cap, "out of memory");
            st = TALLY_E_INTERNAL;
            goto cleanup;
        }
    }
    if (!cfg->shm_socket) {
        char socket_path[256];
        td_config_default_shm_socket(socket_path, sizeof socket_path);
        cfg->shm_socket = strdup(socket_path);
        if (!cfg->shm_socket) {
            snprintf(msg, msg_cap, "out of memory");
            st = TALLY_E_INTERNAL;
            goto cleanup;
        }
    }
    cfg->argc = argc;
    cfg->argv = argv;
cleanup:
    td_config_clear(&cli);
    return st;
}

tally_status_t td_config_reload(const td_config_t *live, td_config_t *next, char *msg,
                                size_t msg_cap)
{
    bool exit_now = false;
    td_config_init(next);
    tally_status_t st = td_config_load(next, live->argc, live->argv, &exit_now, msg, msg_cap);
    if (st != TALLY_OK)
        td_config_clear(next);
    return st;
}

static bool same_string(const char *a, const char *b)
{
    return (!a && !b) || (a && b && strcmp(a, b) == 0);
}

static bool same_binds(const td_config_t *a, const td_config_t *b)
{
    if (a->bind_count != b->bind_count)
        return false;
    for (int i = 0; i < a->bind_count; i++)
        if (strcmp(a->binds[i], b->binds[i]) != 0)
            return false;
    return true;
}

/* A reloadable string setting: next's value replaces live's (kept when out of memory). */
static void take_string(const char *key, char **live, const char *next)
{
    if (same_string(*live, next))
        return;
    char *copy = next ? strdup(next) : NULL;
    if (next && !copy) {
        td_err("reload: %s: out of memory; kept", key);
        return;
    }
    td_notice("reload: %s: %s -> %s", key, *live ? *live : "(none)", next ? next : "(none)");
    free(*live);
    *live = copy;
}

static void log_ignored(const char *key)
{
    td_warn("reload: %s changed; ignored until tallyd restarts", key);
}

bool td_config_apply_runtime(td_config_t *live, const td_config_t *next)
{
    bool changed = false;
    if (live->log_level != next->log_level) {
        td_notice("reload: log_level: %s -> %s", td_log_level_name(live->log_level),
                  td_log_level_name(next->log_level));
        live->log_level = next->log_level;
        td_log_set_level((td_log_level_t)next->log_level);
        changed = true;
    }
#define APPLY_NUMBER(field, fmt)                                                                   \
    if (live->field != next->field) {                                                              \
        td_notice("reload: " #field ": " fmt " -> " fmt, live->field, next->field);                \
        live->field = next->field;                                                                 \
        changed = true;                                                                            \
    }
    APPLY_NUMBER(max_inflight, "%u")
    APPLY_NUMBER(max_streams, "%u")
    APPLY_NUMBER(max_inflight_per_peer, "%u")
    APPLY_NUMBER(max_streams_per_client, "%u")
    APPLY_NUMBER(stream_create_rate, "%u")
    APPLY_NUMBER(max_batch, "%zu")
    APPLY_NUMBER(state_interval, "%u")
    APPLY_NUMBER(drain_ms, "%u")
    APPLY_NUMBER(shm_max_regions_per_peer, "%u")
    APPLY_NUMBER(shm_max_bytes, "%zu")
#undef APPLY_NUMBER
    /* Checked at each registration, so a new list applies to the next one. */
    if (live->shm_allow_uid_count != next->shm_allow_uid_count ||
        live->shm_allow_gid_count != next->shm_allow_gid_count ||
        memcmp(live->shm_allow_uids, next->shm_allow_uids, sizeof live->shm_allow_uids) != 0 ||
        memcmp(live->shm_allow_gids, next->shm_allow_gids, sizeof live->shm_allow_gids) != 0) {
        td_notice("reload: shm allow lists: %u uids, %u gids -> %u uids, %u gids",
                  live->shm_allow_uid_count, live->shm_allow_gid_count, next->shm_allow_uid_count,
                  next->shm_allow_gid_count);
        memcpy(live->shm_allow_uids, next->shm_allow_uids, sizeof live->shm_allow_uids);
        memcpy(live->shm_allow_gids, next->shm_allow_gids, sizeof live->shm_allow_gids);
        live->shm_allow_uid_count = next->shm_allow_uid_count;
        live->shm_allow_gid_count = next->shm_allow_gid_count;
        changed = true;
    }
    /* An empty binds list means "the default endpoint or the sockets systemd passed". */
    if (next->bind_count > 0 && !same_binds(live, next))
        log_ignored("bind");
    if (live->backend != next->backend)
        log_ignored("backend");
    if (live->max_frame != next->max_frame)
        log_ignored("max_frame");
    if (live->workers != next->workers)
        log_ignored("workers");
    if (!same_string(live->state_dir, next->state_dir))
        log_ignored("state dir");
    if (!same_string(live->metrics_listen, next->metrics_listen))
        log_ignored("metrics listen");
    if (!same_string(live->metrics_auth_file, next->metrics_auth_file))
        log_ignored("metrics auth_file");
    if (!same_string(live->curve_secret_key, next->curve_secret_key))
        log_ignored("security curve_secret_key");
    if (live->protected_mode != next->protected_mode)
        log_ignored("security protected_mode");
    /* The allowed client keys are read again on every reload (td_auth_reload), from these. */
    take_string("security curve_clients_dir", &live->curve_clients_dir, next->curve_clients_dir);
    take_string("security curve_clients", &live->curve_clients, next->curve_clients);
    if (live->gpu_streams != next->gpu_streams)
        log_ignored("gpu streams");
    if (live->gpu_min_batch != next->gpu_min_batch)
        log_ignored("gpu min_batch");
    if (live->io_threads != next->io_threads)
        log_ignored("io_threads");
    if (live->shm != next->shm)
        log_ignored("shm enabled");
    if (!same_string(live->shm_socket, next->shm_socket))
        log_ignored("shm socket");
    if (live->shm_socket_gid != next->shm_socket_gid)
        log_ignored("shm socket_group");
    /* Read at each scrape. */
    if (live->metrics_streams != next->metrics_streams) {
        td_notice("reload: metrics streams: %u -> %u", live->metrics_streams,
                  next->metrics_streams);
        live->metrics_streams = next->metrics_streams;
        changed = true;
    }
    /* The rings are allocated at that size, and the PUB socket bound, at start. */
    if (live->window_intervals != next->window_intervals ||
        live->window_interval_ms != next->window_interval_ms)
        log_ignored("windows");
    if (!same_string(live->pub_endpoint, next->pub_endpoint) ||
        live->pub_interval_ms != next->pub_interval_ms)
        log_ignored("pub");
    if (!changed)
        td_notice("reload: no run-time setting changed");
    return changed;
}
