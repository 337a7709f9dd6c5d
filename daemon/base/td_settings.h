/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_settings.h — the table of tallyd's settings: each one written once.
 *
 * A setting is one row of td_settings[] (td_settings.c): its command-line option, its key in the
 * configuration file, its type and field in td_config_t, its default and range, what a reload
 * does with it, and its help text. Everything else is generated from that row: getopt_long's
 * option array and the parsing (td_config_parse_args), the file's keys (td_config_load_file),
 * the defaults (td_config_init), the reload (td_config_apply_runtime), `tallyd --help`, and the
 * configuration table of docs/service.md and systemd/tallyd.conf.example (the hidden options
 * --print-settings-md and --print-example-conf; tests/test_config_docs.sh fails when the
 * committed files differ from what they print), and the options of tallyd(8) and the keys of
 * tallyd.conf(5) (--print-options-scd, --print-settings-scd: the build puts them into the man
 * pages, man/).
 *
 * Adding a setting: a field in td_config_t, its limits in td_config.h, one row here. A new kind
 * of value (not a number, size, switch, string, list...) is a td_setting_type_t and its
 * functions in td_settings.c.
 */
#ifndef TD_SETTINGS_H
#define TD_SETTINGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "td_config.h"
#include "td_err.h"

typedef enum {
    TD_SET_UINT,      /* unsigned, decimal, in [min, max] */
    TD_SET_SIZE,      /* size_t, K/M/G suffixes (powers of two), in [min, max] */
    TD_SET_BOOL,      /* on|off (yes|no, true|false) */
    TD_SET_FLAG,      /* an option without a value that sets a bool; not in the file */
    TD_SET_STRING,    /* an owned string; empty = none; aux: a bool set when one is given */
    TD_SET_PATH,      /* TD_SET_STRING, a relative path taken in $CREDENTIALS_DIRECTORY */
    TD_SET_KEY_LIST,  /* TD_SET_STRING holding CURVE keys: KEY or NAME:KEY, comma-separated */
    TD_SET_BACKEND,   /* td_backend_choice_t by name */
    TD_SET_LOG_LEVEL, /* td_log_level_t by name (or 3-7) */
    TD_SET_ENDPOINTS, /* ZeroMQ bind endpoints, repeatable; aux: the count */
    TD_SET_GROUP,     /* a gid by name or number; empty = -1 (tallyd's) */
    TD_SET_UIDS,      /* users by name or number, comma-separated; aux: the count */
    TD_SET_GIDS,      /* groups, likewise */
    TD_SET_CONFIG,    /* --config FILE: the file, given explicitly */
    TD_SET_ACTION,    /* --help, --version, --print-*: print and exit */
} td_setting_type_t;

/* What SIGHUP does with a changed value (td_config_apply_runtime). */
typedef enum {
    TD_RELOAD_NONE,        /* command line only: a reload cannot change it */
    TD_RELOAD_APPLIES,     /* the new value applies at once */
    TD_RELOAD_UP_TO_START, /* applies, capped at the value tallyd started with (td_service.c) */
    TD_RELOAD_REREAD,      /* applies, and what it names is read again on every reload */
    TD_RELOAD_RESTART,     /* logged as ignored until tallyd restarts */
} td_reload_t;

typedef enum {
    TD_ACTION_NONE = 0,
    TD_ACTION_HELP,
    TD_ACTION_VERSION,
    TD_ACTION_PRINT_MD,          /* docs/service.md's configuration table */
    TD_ACTION_PRINT_CONF,        /* systemd/tallyd.conf.example */
    TD_ACTION_PRINT_OPTIONS_SCD, /* tallyd(8)'s OPTIONS, scdoc (man/tallyd.8.scd) */
    TD_ACTION_PRINT_CONF_SCD,    /* tallyd.conf(5)'s settings, scdoc (man/tallyd.conf.5.scd) */
} td_action_t;

typedef struct {
    const char *option;  /* the long option, without "--" */
    char short_flag;     /* its one-letter form, or 0 */
    const char *arg;     /* the value's name in --help ("BYTES"); NULL for no value */
    const char *section; /* [section] key = value in the file; NULL: command line only */
    const char *key;
    td_setting_type_t type;
    size_t offset;          /* of the field in td_config_t */
    size_t aux;             /* of a companion field (see the types), 0 = none */
    long long def;          /* the default of a number, size, switch or choice */
    unsigned long long min; /* the range of a number or size */
    unsigned long long max;
    td_reload_t reload;
    const char *reload_note; /* more on reload, for docs/service.md and the example file */
    const char *help;        /* what it does, for --help, docs/service.md and the example file */
    const char *default_doc; /* the default in words, where the value alone does not say it */
    const char *example;     /* the example file's value where there is no default value */
    bool hidden;             /* tests and tuning: out of --help and the documents */
    td_action_t action;      /* TD_SET_ACTION only */
} td_setting_t;

#define TD_SETTINGS_MAX 96 /* rows, at most: sizes getopt_long's option array */

extern const td_setting_t td_settings[];
extern const size_t td_settings_count;

/* The row of a long option, or of [section] key; NULL when none. */
const td_setting_t *td_setting_by_option(const char *option);
const td_setting_t *td_setting_by_key(const char *section, const char *key);
bool td_settings_has_section(const char *section);

/* Sets a setting in cfg from its text. TD_ERR_CONFIG for a bad value (with a whole message in
 * why when the type can say more than "invalid value", else why is left empty), TD_ERR_NOMEM. */
td_err_t td_setting_parse(const td_setting_t *s, td_config_t *cfg, const char *value, char *why,
                          size_t why_cap);
/* Writes the setting's default (defaults: the row's def) into cfg. */
void td_setting_init(const td_setting_t *s, td_config_t *cfg);
/* Frees what the setting owns in cfg (leaves the field NULL or empty). */
void td_setting_free(const td_setting_t *s, td_config_t *cfg);
/* The setting's value in cfg as text: as the file would take it ("16M", "on") when docs is
 * true, else as logs show it (sizes in bytes, "(none)" for no string). */
void td_setting_format(const td_setting_t *s, const td_config_t *cfg, bool docs, char *buf,
                       size_t cap);
/* Whether live and next hold the same value for reload's purposes (an empty bind list in
 * next means "the default endpoint or the sockets systemd passed": the same). */
bool td_setting_same(const td_setting_t *s, const td_config_t *live, const td_config_t *next);
/* Copies next's value into live. TD_ERR_NOMEM leaves live as it was. */
td_err_t td_setting_copy(const td_setting_t *s, td_config_t *live, const td_config_t *next);
/* The name reload logs use: the key in [server], else "section key". */
void td_setting_name(const td_setting_t *s, char *buf, size_t cap);

/* `tallyd --help`, docs/service.md's configuration table, the example configuration file, and the
 * generated parts of the man pages tallyd(8) (the options) and tallyd.conf(5) (the keys). */
void td_settings_print_help(FILE *out, const char *argv0);
void td_settings_print_md(FILE *out);
void td_settings_print_conf(FILE *out);
void td_settings_print_options_scd(FILE *out);
void td_settings_print_conf_scd(FILE *out);

/* ---- td_settings_load.c: a configuration made from the table --------------------------- */

/* Fills *cfg with the defaults. */
void td_config_init(td_config_t *cfg);
/* Frees owned strings and resets *cfg to the defaults. */
void td_config_clear(td_config_t *cfg);

/* Parses argv into cfg (over whatever it holds). Returns TD_OK, or TD_ERR_CONFIG (TD_ERR_NOMEM)
 * with a message in msg. *exit_now is set (and TD_OK returned) for --help, --version and the
 * hidden --print-settings-md and --print-example-conf, which print to stdout. */
td_err_t td_config_parse_args(td_config_t *cfg, int argc, char **argv, bool *exit_now, char *msg,
                              size_t msg_cap);

/* Fills cfg in layers: defaults, then the configuration file (--config FILE, or
 * TD_DEFAULT_CONFIG_FILE when it exists), then the command line; then $STATE_DIRECTORY as the
 * state directory when none was set. Returns TD_OK, or TD_ERR_CONFIG with a message
 * ("FILE:LINE: ..." for the file; a --config FILE that cannot be read is TD_ERR_CONFIG too), or
 * TD_ERR_NOMEM. argv is kept (borrowed) in cfg for td_config_reload. */
td_err_t td_config_load(td_config_t *cfg, int argc, char **argv, bool *exit_now, char *msg,
                        size_t msg_cap);
/* Every file or directory a path setting names (TD_SET_PATH: key files, the clients directory,
 * auth and token files, NATS credentials) can be opened for reading, those of [metrics] with the
 * HTTP port on and of [nats] as a fleet worker: else TD_ERR_IO with msg ("[security]
 * curve_secret_key (--curve-secret-key): cannot read server.key: No such file or directory",
 * and where a relative path was looked up). What the files hold is their readers' to check
 * (td_server_check_files). */
td_err_t td_config_check_files(const td_config_t *cfg, char *msg, size_t msg_cap);
/* Applies an INI file over cfg. TD_ERR_IO when it cannot be opened, TD_ERR_CONFIG (with
 * "FILE:LINE: ..." in msg) for an unknown section or key or a bad value. */
td_err_t td_config_load_file(td_config_t *cfg, const char *path, char *msg, size_t msg_cap);
/* SIGHUP: builds the configuration afresh (defaults < file < command line) into *next. On
 * failure *next is cleared, msg says why and the caller keeps running with live. */
td_err_t td_config_reload(const td_config_t *live, td_config_t *next, char *msg, size_t msg_cap);
/* Copies the settings that can change at run time from next into live, logging each change
 * ("reload: log_level: info -> debug") and each change that needs a restart as ignored (the
 * table's reload column). Returns true when anything run-time changed. */
bool td_config_apply_runtime(td_config_t *live, const td_config_t *next);

#endif
