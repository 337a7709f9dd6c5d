/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cli.h — what the `tally` command's parts share: the global settings, one way to report
 * errors (and the exit status each kind of failure gets), the option tables every command is
 * parsed from, and the number, size and endpoint parsers.
 *
 * A command is a cli_command_t, defined by CLI_COMMAND: its usage line, a paragraph, its
 * option groups, and either a run (which parses and does the rest) or, for a command without
 * options of its own, a request function that cli_run calls with a connected client.
 * cli_parse builds getopt_long's table from the groups, adds the common options (-e, -t,
 * --help), and prints --help from the same groups, so an option added to a table is parsed
 * and documented at once. Commands live one group to a file (cmd_data.c: filter, scan,
 * hist; cmd_stream.c: query, reset, delete, streams; cmd_watch.c: watch; cmd_daemon.c: ping,
 * info, stats, keygen) and are listed in main.c.
 *
 * Exit status, one meaning each so scripts can tell failures apart:
 *   0 success; 1 the daemon replied with an error; 2 usage or input error (bad option, bad
 *   number, unreadable file, input that is not what the options say); 3 no usable reply
 *   (timeout, nothing listening, transport failure, undecodable reply); 130 interrupted
 *   (Ctrl-C during a push, after saying what was applied). Every error prints one line on stderr,
 * "tally: ...".
 */
#ifndef TALLY_CLI_H
#define TALLY_CLI_H

#include <getopt.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "tally.h"

enum { EXIT_DAEMON = 1, EXIT_USAGE = 2, EXIT_TRANSPORT = 3, EXIT_INTERRUPTED = 130 };

/* cli_parse's answer after printing --help: the command exits 0 at once. */
#define CLI_HELP_SHOWN (-1)

/* Settings given before or after the command name. */
typedef struct {
    const char *endpoint;   /* -e, else $TALLY_ENDPOINT, else TALLY_DEFAULT_ENDPOINT */
    int timeout_ms;         /* -t */
    const char *server_key; /* --server-key: tallyd's CURVE public key or .pub file, or NULL */
    const char *client_key; /* --client-key: this client's key file, or NULL */
    /* A fleet instead of -e, at most one of nats and fleet set once cli_parse has chosen
     * (cli_parse: the command line's --nats or --fleet, never both, else $TALLY_FLEET, else
     * $TALLY_NATS; cli_fleet_name says which servers). */
    const char *nats;       /* --nats, else $TALLY_NATS: a fleet's NATS servers instead of -e */
    const char *nats_creds; /* --nats-creds, else $TALLY_NATS_CREDS: a NATS .creds file */
    const char *nats_user;  /* --nats-user, else $TALLY_NATS_USER: the fleet's name for us */
    const char *nats_tls_ca;   /* --nats-tls-ca, else $TALLY_NATS_TLS_CA: TLS, servers checked */
    const char *nats_tls_cert; /* --nats-tls-cert/-key, else $TALLY_NATS_TLS_CERT/_KEY */
    const char *nats_tls_key;
    const char *fleet; /* --fleet, else $TALLY_FLEET: a fleet in direct mode, by its NATS servers */
    const char *env_nats, *env_fleet; /* $TALLY_NATS and $TALLY_FLEET, for cli_parse to choose */
} cli_t;

/* One option: getopt_long's fields plus what --help prints for it. */
typedef struct {
    const char *name;     /* long name without "--"; NULL ends a table */
    int id;               /* what the handler receives: a letter (also the short option) or
                           * a value >= CLI_OPT_FIRST */
    const char *arg_name; /* the option takes an argument, shown in --help as this: "N", "FILE",
                           * "LO HI" (the handler takes the second); NULL: no argument */
    const char *help;     /* one line; '\n' continues on an indented line */
} cli_option_t;

/* An option that only sets a field of the command's context: cli_parse sets it by this row,
 * so such an option is a row in a table and no code in a handler. */
typedef struct {
    int id; /* the option's id; 0 ends a table */
    enum {
        CLI_STORE_TRUE = 1, /* the bool at offset becomes true */
        CLI_STORE_ARG,      /* the const char * at offset becomes the option's argument */
        CLI_STORE_INT,      /* the int at offset becomes value */
    } store;
    size_t offset; /* in the context (cli_t for the common options) */
    int value;
} cli_setter_t;

/* Rows of a cli_setter_t table. */
/* clang-format off */
#define CLI_SET_TRUE(id, type, field) {(id), CLI_STORE_TRUE, offsetof(type, field), 0}
#define CLI_SET_ARG(id, type, field) {(id), CLI_STORE_ARG, offsetof(type, field), 0}
#define CLI_SET_INT(id, type, field, v) {(id), CLI_STORE_INT, offsetof(type, field), (v)}
/* clang-format on */

/* cli_command_t.nargs of a command that takes a list (watch STREAM...). */
#define CLI_ARGS_ONE_OR_MORE (-1)

/* Ids of long-only options start here (above every letter). */
#define CLI_OPT_FIRST 256
/* Ids of the long-only common options (above every command's own). */
enum {
    CLI_OPT_SERVER_KEY = 4096,
    CLI_OPT_CLIENT_KEY,
    CLI_OPT_NATS,
    CLI_OPT_NATS_CREDS,
    CLI_OPT_NATS_USER,
    CLI_OPT_NATS_TLS_CA,
    CLI_OPT_NATS_TLS_CERT,
    CLI_OPT_NATS_TLS_KEY,
    CLI_OPT_FLEET,
};

/* What a group of options needs of its command's operation (the row of tally_ops.h) to be the
 * command's at all: a data command whose operation takes no stream has no --stream, --resume,
 * --seq-base or --no-seq, one that takes no shared-memory reference no --shm or --gpu-region.
 * Parsing, --help, the completion and tally(1) all skip a group its command's row rules out. */
enum {
    CLI_NEEDS_STREAM = 1u << 0, /* the row's stream rule is not TALLY_STREAM_NONE */
    CLI_NEEDS_SHM_REF = 1u << 1 /* the row's flags take TALLY_FLAG_SHM_REF */
};

typedef struct {
    const char *title; /* "Options", "Predicate (exactly one)"; NULL ends the list */
    const cli_option_t *options;
    unsigned needs; /* CLI_NEEDS_*: 0 for a group every command that lists it has */
} cli_group_t;

typedef struct cli_command cli_command_t;
struct cli_command {
    const char *name;
    const char *summary; /* one line, in 'tally --help'; NULL: the op's (tally_ops.h) */
    const char *usage;   /* after "usage: tally " */
    const char *about;   /* the paragraph(s) of --help before the options */
    const cli_group_t *groups;
    tally_op_t op;       /* what a shared run sends: info or stats, filter, scan or hist, ... */
    tally_dtype_t dtype; /* data commands: the element type without --type */
    int nargs;           /* positional arguments required; CLI_ARGS_ONE_OR_MORE: at least one */
    /* The options that only set a field of ctx (may be NULL); the handler gets the others. */
    const cli_setter_t *setters;
    /* Handles one option of the command's groups: 0, or an exit status for a usage error. */
    int (*option)(void *ctx, int id, const char *arg, int argc, char **argv);
    /* The command's run, called with the command itself (commands that share a run tell
     * themselves apart by op): 0, CLI_HELP_SHOWN (exit 0) or an exit status. */
    int (*run)(cli_t *cli, const cli_command_t *cmd, int argc, char **argv);
    /* Instead of run, for a command without options of its own that sends its requests on one
     * connection: cli_run parses, checks the positional arguments `args` with check (may be
     * NULL), connects, and calls request with the client (closed after). 0 or an exit status. */
    int (*check)(const char *cmd, char **args);
    int (*request)(tally_client_t *client, const cli_command_t *cmd, char **args);
};

/* Defines cli_cmd_NAME, the command `tally NAME`, from the other fields of cli_command_t:
 *   CLI_COMMAND(ping, .usage = "ping", .summary = "...", .about = "...", .request = ping); */
#define CLI_COMMAND(name_, ...) const cli_command_t cli_cmd_##name_ = {.name = #name_, __VA_ARGS__}

/* Whether group g (one of cmd->groups) is cmd's: its operation's row has what g needs. */
bool cli_group_applies(const cli_command_t *cmd, const cli_group_t *g);
/* Parses argv (argv[0] is the command name) into ctx through cmd->option. Returns 0 (the
 * positional arguments are argv[optind..argc)), CLI_HELP_SHOWN, or an exit status. */
int cli_parse(cli_t *cli, const cli_command_t *cmd, void *ctx, int argc, char **argv);
void cli_print_help(const cli_command_t *cmd, FILE *f);
/* The command's line in 'tally --help': its own summary, or its operation's row's. */
const char *cli_command_summary(const cli_command_t *cmd);
void cli_print_options(const cli_option_t *options, FILE *f);
/* The common options (-e, -t, --server-key, --client-key, -h): shared by every command and the top
 * level. */
extern const cli_option_t cli_common_options[];
/* Handles common option `id` on cli: 0, an exit status, or 1 when id is not a common option. */
int cli_common_option(cli_t *cli, const char *cmd, int id, const char *arg);

/* ---- Reporting ------------------------------------------------------------------------ */

void cli_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* "tally: CMD: message (see 'tally CMD --help')"; returns EXIT_USAGE. */
int cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Where the commands go, as messages and resume records name it: -e's endpoint, or with --nats
 * or --fleet their NATS servers with any password left out (tally_fleet_redact), into out. */
void cli_target(const cli_t *cli, char *out, size_t cap);
/* "tally: WHAT: status_name: detail" for a failed library call; returns the exit status. */
int cli_report(tally_status_t status, const char *what, const char *detail);
/* Flushes stdout: 0, or EXIT_USAGE after reporting a write error. */
int cli_finish_stdout(void);
/* Bytes from input or argv, fit for a message on a terminal: printable ASCII stays, the rest
 * becomes \n, \t, \r, \\ or \xNN (so no control sequence reaches the terminal), and only the
 * first `max` bytes are shown, then "...". Writes into out (cap bytes, at least 4 x max + 4 for
 * all of it to fit) and returns out. */
const char *cli_escape(const void *data, size_t len, size_t max, char *out, size_t cap);
/* The size cli_escape needs for `max` bytes. */
#define CLI_ESCAPED_SIZE(max) (4 * (max) + 4)

/* ---- Parsing ---------------------------------------------------------------------------- */

/* A whole decimal integer in [min, max], nothing else. */
bool cli_parse_i64(const char *s, int64_t min, int64_t max, int64_t *out);
/* An option's integer in [min, max]: 0, or a usage error naming the option and the range. */
int cli_option_i64(const char *cmd, const char *option, const char *arg, int64_t min, int64_t max,
                   int64_t *out);
/* An option's byte size (tally_size_parse): 0, or "invalid size '1T' for --chunk: ...". */
int cli_option_size(const char *cmd, const char *option, const char *arg, size_t min, size_t *out);
/* A dtype by its name (tally_dtype_name; also rgb, rgba): false when none has it. */
bool cli_parse_dtype(const char *s, tally_dtype_t *out);
/* The name tally uses for a dtype, in --help and its messages alike: tally_dtype_name's, but rgb
 * and rgba for the pixel types (rgb8 and rgba8 on the wire; --type takes both). */
const char *cli_dtype_name(unsigned dtype);
/* An option's duration: a decimal number (a fraction allowed) and a unit, ms, s, m or h (none:
 * seconds), as whole milliseconds in [min_ms, max_ms]: 0, or a usage error naming the option. */
int cli_option_duration_ms(const char *cmd, const char *option, const char *arg, uint64_t min_ms,
                           uint64_t max_ms, uint64_t *out);

/* ---- Connecting ------------------------------------------------------------------------- */

/* Creates the client (tally_client_open: a bad endpoint is named) and waits for its connection
 * (tally_client_wait_connected: a daemon that is not there fails at once, naming the endpoint
 * and the reason, in libtally's words). 0 or an exit status (after reporting). */
int cli_connect(const cli_t *cli, tally_client_t **client);
/* With --fleet: tally_client_new_fleet (direct mode), the --nats options for its NATS; else with
 * --nats: a client of the fleet (tally_client_new_nats), timeout_ms for every wait. 0 or an
 * exit status (after reporting). */
int cli_nats_client(const cli_t *cli, int timeout_ms, tally_client_t **client);
/* The NATS options of cli's --nats* settings. */
tally_nats_opts_t cli_nats_opts(const cli_t *cli, int timeout_ms);

/* Runs a command on argv (argv[0] is its name): cmd->run, or cmd->request on a connection.
 * 0, CLI_HELP_SHOWN or an exit status. */
int cli_run(cli_t *cli, const cli_command_t *cmd, int argc, char **argv);

/* ---- The commands (main.c lists them) --------------------------------------------------- */

extern const cli_command_t cli_cmd_filter, cli_cmd_scan, cli_cmd_hist, cli_cmd_minmax;
extern const cli_command_t cli_cmd_query, cli_cmd_reset, cli_cmd_delete, cli_cmd_streams;
extern const cli_command_t cli_cmd_watch;
extern const cli_command_t cli_cmd_ping, cli_cmd_info, cli_cmd_stats, cli_cmd_keygen;

#endif /* TALLY_CLI_H */
