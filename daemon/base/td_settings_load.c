/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_settings_load.c — a configuration made from the table of settings (td_settings.c): its
 * defaults, the command line (getopt_long's options are made from the rows), the configuration
 * file (INI, parsed by inih) and SIGHUP reload.
 *
 * Design
 * ------
 * Every file key maps 1:1 to a command-line option: both are one row of the table of settings
 * (td_settings.c), and a key's value is parsed by that row exactly as `--option value` is, so
 * the file and the command line share one parser, one set of limits and one set of error rules.
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
 * change while running (the table's reload column) into the live configuration, logging each
 * change; a bad file leaves the live configuration untouched.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ini.h>

#include "tally_args.h"
#include "tally_revision.h"
#include "td_config.h"
#include "td_log.h"
#include "td_settings.h"

/* ---- Defaults ------------------------------------------------------------------------------ */

void td_config_init(td_config_t *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    for (size_t i = 0; i < td_settings_count; i++)
        td_setting_init(&td_settings[i], cfg);
}

void td_config_clear(td_config_t *cfg)
{
    for (size_t i = 0; i < td_settings_count; i++)
        td_setting_free(&td_settings[i], cfg);
    td_config_init(cfg);
}

/* ---- The command line ---------------------------------------------------------------------- */

/* getopt_long's view of the table: a long option's val is its row + OPTION_BASE, a short one's
 * its letter (also in shorts, getopt's option string). */
#define OPTION_BASE 256

static void table_options(struct option *options, char *shorts, size_t shorts_cap)
{
    size_t n = 0;
    shorts[n++] = ':'; /* a missing value is ':', not '?' */
    for (size_t i = 0; i < td_settings_count; i++) {
        const td_setting_t *s = &td_settings[i];
        options[i] = (struct option){s->option, s->arg ? required_argument : no_argument, NULL,
                                     s->short_flag ? s->short_flag : (int)(OPTION_BASE + i)};
        if (s->short_flag && n + 3 < shorts_cap) {
            shorts[n++] = s->short_flag;
            if (s->arg)
                shorts[n++] = ':';
        }
    }
    options[td_settings_count] = (struct option){NULL, 0, NULL, 0};
    shorts[n] = '\0';
}

static const td_setting_t *option_setting(int opt)
{
    if (opt >= OPTION_BASE && (size_t)(opt - OPTION_BASE) < td_settings_count)
        return &td_settings[opt - OPTION_BASE];
    for (size_t i = 0; i < td_settings_count; i++)
        if (td_settings[i].short_flag && td_settings[i].short_flag == opt)
            return &td_settings[i];
    return NULL;
}

static void run_action(td_action_t action, const char *argv0)
{
    switch (action) {
    case TD_ACTION_HELP:
        td_settings_print_help(stdout, argv0);
        break;
    case TD_ACTION_VERSION:
        printf("tallyd %s (protocol %d, revision %s)\n", TALLY_VERSION, TALLY_PROTO_VERSION,
               tally_build_revision);
        break;
    case TD_ACTION_PRINT_MD:
        td_settings_print_md(stdout);
        break;
    case TD_ACTION_PRINT_CONF:
        td_settings_print_conf(stdout);
        break;
    case TD_ACTION_PRINT_OPTIONS_SCD:
        td_settings_print_options_scd(stdout);
        break;
    case TD_ACTION_PRINT_CONF_SCD:
        td_settings_print_conf_scd(stdout);
        break;
    case TD_ACTION_NONE:
        break;
    }
}

/* One option from the command line: its value parsed into cfg, or its action run. */
static td_err_t apply_option(const td_setting_t *s, td_config_t *cfg, const char *value,
                             char **argv, bool *exit_now, char *msg, size_t msg_cap)
{
    if (s->type == TD_SET_ACTION) {
        run_action(s->action, argv[0]);
        *exit_now = true;
        return TD_OK;
    }
    char why[256];
    td_err_t err = td_setting_parse(s, cfg, value ? value : "", why, sizeof why);
    if (err == TD_OK)
        return TD_OK;
    if (why[0])
        snprintf(msg, msg_cap, "%s", why);
    else if (err == TD_ERR_NOMEM)
        snprintf(msg, msg_cap, "out of memory");
    else
        snprintf(msg, msg_cap, "invalid value '%s' for --%s (try --help)", value, s->option);
    return err;
}

td_err_t td_config_parse_args(td_config_t *cfg, int argc, char **argv, bool *exit_now, char *msg,
                              size_t msg_cap)
{
    struct option options[TD_SETTINGS_MAX + 1];
    char shorts[2 * TD_SETTINGS_MAX + 2];
    table_options(options, shorts, sizeof shorts);
    *exit_now = false;
    optind = 1;
    opterr = 0;
    int opt;
    while ((opt = getopt_long(argc, argv, shorts, options, NULL)) != -1) {
        const td_setting_t *s = option_setting(opt);
        if (opt == ':') {
            snprintf(msg, msg_cap, "option %s needs a value", argv[optind - 1]);
            return TD_ERR_CONFIG;
        }
        if (!s) {
            snprintf(msg, msg_cap, "unknown option %s (try --help)", argv[optind - 1]);
            return TD_ERR_CONFIG;
        }
        td_err_t err = apply_option(s, cfg, optarg, argv, exit_now, msg, msg_cap);
        if (err != TD_OK || *exit_now)
            return err;
    }
    if (optind < argc) {
        snprintf(msg, msg_cap, "unexpected argument '%s' (try --help)", argv[optind]);
        return TD_ERR_CONFIG;
    }
    return TD_OK;
}

/* ---- The file ------------------------------------------------------------------------------ */

typedef struct {
    td_config_t *cfg;
    const char *path;
    FILE *file;
    int line;  /* the line inih is handling */
    char *msg; /* the first error, "PATH:LINE: ..." */
    size_t msg_cap;
    bool failed;
    bool mid_line; /* the last piece read did not end the line (inih reads long lines in pieces) */
    bool key_seen; /* a key since the last [section]: an indented line continues its value */
    td_err_t err;  /* the first error's */
} file_parse_t;

/* A [section] line names a section of the table: inih calls handle_key for keys only, so an
 * unknown section without keys would pass unseen (tallyd.conf(5): it stops tallyd). An indented
 * line after a key is, to inih, more of that key's value (INI_ALLOW_MULTILINE), not a section. */
static void check_section_line(file_parse_t *p, const char *line)
{
    size_t indent = strspn(line, " \t");
    line += indent;
    const char *end = line[0] == '[' ? strchr(line, ']') : NULL;
    if (!end || p->failed || (indent && p->key_seen))
        return;
    p->key_seen = false;
    char name[64];
    size_t len = (size_t)(end - line - 1);
    snprintf(name, sizeof name, "%.*s", (int)(len < sizeof name ? len : sizeof name - 1), line + 1);
    if (len < sizeof name && td_settings_has_section(name))
        return;
    snprintf(p->msg, p->msg_cap, "%s:%d: unknown section [%s]", p->path, p->line, name);
    p->err = TD_ERR_CONFIG;
    p->failed = true;
}

static char *count_lines(char *buf, int size, void *stream)
{
    file_parse_t *p = stream;
    char *got = fgets(buf, size, p->file);
    if (!got)
        return NULL;
    if (!p->mid_line) {
        p->line++;
        check_section_line(p, got);
    }
    p->mid_line = !strchr(got, '\n');
    /* inih would take the rest of a longer line for a line of its own (a syntax error, or a
     * [section] in the middle of a value): refuse it here, in words, at its line. */
    if (p->mid_line && strlen(got) + 1 == (size_t)size && !p->failed) {
        snprintf(p->msg, p->msg_cap, "%s:%d: line longer than %d characters", p->path, p->line,
                 size - 2);
        p->err = TD_ERR_CONFIG;
        p->failed = true;
    }
    return got;
}

static int handle_key(void *user, const char *section, const char *key, const char *value)
{
    file_parse_t *p = user;
    p->key_seen = true;
    if (p->failed)
        return 1; /* report the first error only */
    const td_setting_t *k = td_setting_by_key(section, key);
    if (!k) {
        if (!section[0])
            snprintf(p->msg, p->msg_cap, "%s:%d: key '%s' outside any [section]", p->path, p->line,
                     key);
        else if (!td_settings_has_section(section))
            snprintf(p->msg, p->msg_cap, "%s:%d: unknown section [%s]", p->path, p->line, section);
        else
            snprintf(p->msg, p->msg_cap, "%s:%d: unknown key '%s' in [%s]", p->path, p->line, key,
                     section);
        p->err = TD_ERR_CONFIG;
        p->failed = true;
        return 0;
    }
    char why[256];
    p->err = td_setting_parse(k, p->cfg, value, why, sizeof why);
    if (p->err != TD_OK) {
        snprintf(p->msg, p->msg_cap,
                 "%s:%d: invalid value '%s' for %s in [%s] (see --%s in --help)", p->path, p->line,
                 value, key, section, k->option);
        p->failed = true;
        return 0;
    }
    return 1;
}

td_err_t td_config_load_file(td_config_t *cfg, const char *path, char *msg, size_t msg_cap)
{
    file_parse_t p = {.cfg = cfg, .path = path, .msg = msg, .msg_cap = msg_cap};
    p.file = fopen(path, "r");
    if (!p.file) {
        snprintf(msg, msg_cap, "cannot read %s: %s", path, strerror(errno));
        return TD_ERR_IO;
    }
    int rc = ini_parse_stream(count_lines, &p, handle_key, &p);
    fclose(p.file);
    if (rc == 0 && !p.failed)
        return TD_OK;
    if (p.failed)
        return p.err;
    /* inih's own complaint: a line that is neither [section] nor key = value */
    snprintf(msg, msg_cap, "%s:%d: syntax error (expected [section] or key = value)", path,
             rc > 0 ? rc : p.line);
    return TD_ERR_CONFIG;
}

static void drop_list(td_config_t *cfg, const char *option)
{
    td_setting_free(td_setting_by_option(option), cfg);
}

/* The file over the defaults in cfg: --config FILE (which must exist), else the default file
 * when it exists. */
static td_err_t load_file_layer(td_config_t *cfg, const td_config_t *cli, char *msg, size_t msg_cap)
{
    const char *path = cli->config_file ? cli->config_file : TD_DEFAULT_CONFIG_FILE;
    td_err_t err = td_config_load_file(cfg, path, msg, msg_cap);
    if (err == TD_ERR_IO && !cli->config_file_explicit) {
        msg[0] = '\0';
        return TD_OK; /* the default file is optional */
    }
    return err == TD_ERR_IO ? TD_ERR_CONFIG : err;
}

/* Checks on the whole configuration (the file and the command line may each set one part), and
 * the defaults that come from the environment. */
static td_err_t finish_config(td_config_t *cfg, char *msg, size_t msg_cap)
{
    if (cfg->max_frame && cfg->max_frame < cfg->max_batch + TD_MAX_FRAME_HEADROOM) {
        snprintf(msg, msg_cap,
                 "max_frame %zu must be at least max_batch %zu + %u, so that an oversize "
                 "payload is answered too_large",
                 cfg->max_frame, cfg->max_batch, TD_MAX_FRAME_HEADROOM);
        return TD_ERR_CONFIG;
    }
    if (cfg->pub_interval_ms && cfg->pub_interval_ms < TD_PUB_INTERVAL_MS_MIN) {
        snprintf(msg, msg_cap, "[pub] interval_ms %u: 0 (publish nothing) or %u to %u",
                 cfg->pub_interval_ms, TD_PUB_INTERVAL_MS_MIN, TD_PUB_INTERVAL_MS_LIMIT);
        return TD_ERR_CONFIG;
    }
    if (!cfg->pub_interval_ms && cfg->pub_endpoint) {
        snprintf(msg, msg_cap,
                 "[pub] endpoint %s with interval_ms = 0 would publish nothing: set an interval "
                 "or leave the endpoint out",
                 cfg->pub_endpoint);
        return TD_ERR_CONFIG;
    }
    if (cfg->front_count && td_config_shards(cfg) < 2) {
        snprintf(msg, msg_cap,
                 "front %s needs 2 shards or more (a front hands its requests to the shards' "
                 "threads; with one shard everything runs on the loop thread): set shards, or "
                 "bind the endpoint instead",
                 cfg->fronts[0]);
        return TD_ERR_CONFIG;
    }
    /* Under systemd, StateDirectory= names the state directory (the first of a list). */
    const char *env = getenv("STATE_DIRECTORY");
    if (!cfg->state_dir && env && env[0] && !(cfg->state_dir = strndup(env, strcspn(env, ":"))))
        goto nomem;
    if (!cfg->shm_socket) {
        char socket_path[256];
        td_config_default_shm_socket(socket_path, sizeof socket_path);
        if (!(cfg->shm_socket = strdup(socket_path)))
            goto nomem;
    }
    return TD_OK;
nomem:
    snprintf(msg, msg_cap, "out of memory");
    return TD_ERR_NOMEM;
}

td_err_t td_config_load(td_config_t *cfg, int argc, char **argv, bool *exit_now, char *msg,
                        size_t msg_cap)
{
    td_config_t cli;
    td_config_init(&cli);
    td_config_clear(cfg);
    /* Pass 1: the command line alone (--config, --help, --version, and its binds). */
    td_err_t err = td_config_parse_args(&cli, argc, argv, exit_now, msg, msg_cap);
    if (err != TD_OK || *exit_now)
        goto cleanup;
    err = load_file_layer(cfg, &cli, msg, msg_cap);
    if (err != TD_OK)
        goto cleanup;
    /* Pass 2: the command line over the file. Binds and fronts are lists: any --bind (--front)
     * replaces the file's bind (front) lines instead of adding to them. */
    if (cli.bind_count > 0)
        drop_list(cfg, "bind");
    if (cli.front_count > 0)
        drop_list(cfg, "front");
    err = td_config_parse_args(cfg, argc, argv, exit_now, msg, msg_cap);
    if (err != TD_OK)
        goto cleanup;
    err = finish_config(cfg, msg, msg_cap);
    if (err == TD_OK) {
        cfg->argc = argc;
        cfg->argv = argv;
    }
cleanup:
    td_config_clear(&cli);
    return err;
}

/* ---- The files the settings name ------------------------------------------------------- */

/* Whether tallyd reads the files of a section's settings: [metrics] with the HTTP port on,
 * [nats] as a fleet worker, the rest always. */
static bool section_on(const td_config_t *cfg, const char *section)
{
    if (!strcmp(section, "metrics"))
        return cfg->metrics_listen != NULL;
    if (!strcmp(section, "nats"))
        return cfg->nats_servers != NULL;
    return true;
}

/* Where a relative path was looked for, when that is why it was not found. */
static void path_hint(const char *value, char *hint, size_t cap)
{
    const char *creds = getenv("CREDENTIALS_DIRECTORY");
    size_t creds_len = creds ? strlen(creds) : 0;
    char cwd[1024];
    hint[0] = '\0';
    if (creds_len && !strncmp(value, creds, creds_len) && value[creds_len] == '/')
        snprintf(hint, cap,
                 " (looked up in $CREDENTIALS_DIRECTORY: does the unit have "
                 "LoadCredential=%s:PATH?)",
                 value + creds_len + 1);
    else if (value[0] != '/')
        snprintf(hint, cap,
                 " (a relative path is looked up in $CREDENTIALS_DIRECTORY, which systemd's "
                 "LoadCredential= sets; it is not set, so it was looked up in %s: give the "
                 "whole path)",
                 getcwd(cwd, sizeof cwd) ? cwd : "the working directory");
}

td_err_t td_config_check_files(const td_config_t *cfg, char *msg, size_t msg_cap)
{
    for (size_t i = 0; i < td_settings_count; i++) {
        const td_setting_t *s = &td_settings[i];
        if (s->type != TD_SET_PATH) /* only then is the field a string */
            continue;
        const char *path = *(char *const *)((const char *)cfg + s->offset);
        if (!path || !section_on(cfg, s->section))
            continue;
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            close(fd);
            continue;
        }
        char hint[1280] = "";
        int err = errno;
        if (err == ENOENT)
            path_hint(path, hint, sizeof hint);
        snprintf(msg, msg_cap, "[%s] %s (--%s): cannot read %s: %s%s", s->section, s->key,
                 s->option, path, strerror(err), hint);
        return TD_ERR_IO;
    }
    return TD_OK;
}

td_err_t td_config_reload(const td_config_t *live, td_config_t *next, char *msg, size_t msg_cap)
{
    bool exit_now = false;
    td_config_init(next);
    td_err_t err = td_config_load(next, live->argc, live->argv, &exit_now, msg, msg_cap);
    if (err != TD_OK)
        td_config_clear(next);
    return err;
}

/* One setting at reload: applied (and logged), logged as needing a restart, or the same. Returns
 * true when it applied a change. */
static bool apply_setting(const td_setting_t *s, td_config_t *live, const td_config_t *next)
{
    if (s->reload == TD_RELOAD_NONE || td_setting_same(s, live, next))
        return false;
    char name[64], before[512], after[512];
    td_setting_name(s, name, sizeof name);
    if (s->reload == TD_RELOAD_RESTART) {
        td_warn("reload: %s changed; ignored until tallyd restarts", name);
        return false;
    }
    td_setting_format(s, live, false, before, sizeof before);
    td_setting_format(s, next, false, after, sizeof after);
    if (td_setting_copy(s, live, next) != TD_OK) {
        td_err("reload: %s: out of memory; kept", name);
        return false;
    }
    td_notice("reload: %s: %s -> %s", name, before, after);
    if (s->type == TD_SET_LOG_LEVEL)
        td_log_set_level((td_log_level_t)live->log_level);
    return true;
}

bool td_config_apply_runtime(td_config_t *live, const td_config_t *next)
{
    bool changed = false;
    for (size_t i = 0; i < td_settings_count; i++)
        changed |= apply_setting(&td_settings[i], live, next);
    if (!changed)
        td_notice("reload: no run-time setting changed");
    return changed;
}
