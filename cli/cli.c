/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cli.c — the parts every `tally` command uses: option parsing from cli_option_t tables
 * (getopt_long underneath, --help generated from the same tables), error reporting with one
 * exit status per kind of failure, number and size parsing, and connecting (cli.h).
 */
#include "cli.h"
#include "tally_fleet.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "tally_args.h"

/* ---- Reporting ---------------------------------------------------------------------------- */

void cli_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("tally: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

int cli_usage_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("tally: ", stderr);
    if (cmd)
        fprintf(stderr, "%s: ", cmd);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (see 'tally %s%s--help')\n", cmd ? cmd : "", cmd ? " " : "");
    va_end(ap);
    return EXIT_USAGE;
}

const char *cli_escape(const void *data, size_t len, size_t max, char *out, size_t cap)
{
    const uint8_t *p = data;
    size_t at = 0;
    if (!cap)
        return out;
    for (size_t i = 0; i < len && i < max; i++) {
        char piece[5];
        uint8_t c = p[i];
        if (c == '\n' || c == '\t' || c == '\r' || c == '\\')
            snprintf(piece, sizeof piece, "\\%c",
                     c == '\n'   ? 'n'
                     : c == '\t' ? 't'
                     : c == '\r' ? 'r'
                                 : '\\');
        else if (c >= 0x20 && c < 0x7f)
            snprintf(piece, sizeof piece, "%c", c);
        else
            snprintf(piece, sizeof piece, "\\x%02x", c);
        size_t n = strlen(piece);
        if (at + n + 4 > cap) /* room kept for "..." and the terminator */
            break;
        memcpy(out + at, piece, n);
        at += n;
    }
    if (len > max && at + 4 <= cap) {
        memcpy(out + at, "...", 3);
        at += 3;
    }
    out[at < cap ? at : cap - 1] = '\0';
    return out;
}

int cli_report(tally_status_t status, const char *what, const char *detail)
{
    if (!detail || !*detail)
        detail = tally_status_text(status);
    /* The detail may be the daemon's words: nothing in it reaches the terminal raw. */
    char shown[CLI_ESCAPED_SIZE(TALLY_ERROR_MESSAGE_MAX)];
    cli_escape(detail, strlen(detail), TALLY_ERROR_MESSAGE_MAX, shown, sizeof shown);
    cli_error("%s: %s: %s", what, tally_status_name(status), shown);
    if (status == TALLY_E_TIMEOUT || status == TALLY_E_TRANSPORT || status == TALLY_E_REPLY)
        return EXIT_TRANSPORT;
    if (status == TALLY_E_ARG || status == TALLY_E_IO)
        return EXIT_USAGE;
    return EXIT_DAEMON;
}

int cli_finish_stdout(void)
{
    if (fflush(stdout) != 0 || ferror(stdout)) {
        cli_error("cannot write to stdout: %s", strerror(errno));
        return EXIT_USAGE;
    }
    return 0;
}

/* ---- Numbers and sizes -------------------------------------------------------------------- */

bool cli_parse_i64(const char *s, int64_t min, int64_t max, int64_t *out)
{
    if (!s || !*s)
        return false;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || end == s || v < min || v > max)
        return false;
    *out = v;
    return true;
}

int cli_option_i64(const char *cmd, const char *option, const char *arg, int64_t min, int64_t max,
                   int64_t *out)
{
    if (cli_parse_i64(arg, min, max, out))
        return 0;
    return cli_usage_error(cmd, "invalid number '%s' for %s: expected %" PRId64 "..%" PRId64, arg,
                           option, min, max);
}

int cli_option_duration_ms(const char *cmd, const char *option, const char *arg, uint64_t min_ms,
                           uint64_t max_ms, uint64_t *out)
{
    if (tally_duration_parse(arg, min_ms, max_ms, out) == TALLY_OK)
        return 0;
    return cli_usage_error(cmd,
                           "invalid duration '%s' for %s: a number and ms, s, m or h, from %" PRIu64
                           " ms to %" PRIu64 " ms",
                           arg, option, min_ms, max_ms);
}

int cli_option_size(const char *cmd, const char *option, const char *arg, size_t min, size_t *out)
{
    char why[128];
    if (tally_size_parse(arg, out, why, sizeof why) != TALLY_OK)
        return cli_usage_error(cmd, "invalid size '%s' for %s: %s", arg, option, why);
    if (*out < min)
        return cli_usage_error(cmd, "invalid size '%s' for %s: at least %zu bytes", arg, option,
                               min);
    return 0;
}

const char *cli_dtype_name(unsigned dtype)
{
    if (dtype == TALLY_DTYPE_RGB8 || dtype == TALLY_DTYPE_RGBA8)
        return dtype == TALLY_DTYPE_RGB8 ? "rgb" : "rgba";
    return tally_dtype_name((tally_dtype_t)dtype);
}

bool cli_parse_dtype(const char *s, tally_dtype_t *out)
{
    if (!strcmp(s, "rgb") || !strcmp(s, "rgba")) /* the pixel types, as people say them */
        s = s[3] ? "rgba8" : "rgb8";
    for (unsigned d = 0; d < TALLY_DTYPE_COUNT; d++) {
        if (!strcmp(s, tally_dtype_name((tally_dtype_t)d))) {
            *out = (tally_dtype_t)d;
            return true;
        }
    }
    return false;
}

/* ---- Options ------------------------------------------------------------------------------ */

const cli_option_t cli_common_options[] = {
    {"endpoint", 'e', "E",
     "tallyd's endpoint: tcp://HOST:PORT or ipc://PATH (default:\n"
     "$TALLY_ENDPOINT, else " TALLY_DEFAULT_ENDPOINT ")"},
    {"timeout", 't', "MS", "give up after MS ms without a reply (default 5000)"},
    {"server-key", CLI_OPT_SERVER_KEY, "K",
     "tallyd's CURVE public key, or its .pub file (default:\n"
     "$TALLY_SERVER_KEY, else server_key in ~/.config/tally/tally.conf;\nnone: no CURVE; "
     "with --fleet, each member's own)"},
    {"client-key", CLI_OPT_CLIENT_KEY, "FILE",
     "this client's key file from `tally keygen` (default:\n"
     "$TALLY_CLIENT_KEY, else client_key in that file;\nwith --fleet, enough to turn CURVE on)"},
    {"nats", CLI_OPT_NATS, "URL",
     "a tallyd fleet's NATS servers (nats://HOST:PORT, comma-separated)\n"
     "instead of one tallyd at -e (default: $TALLY_NATS; PROTOCOL.md §13)"},
    {"nats-creds", CLI_OPT_NATS_CREDS, "FILE",
     "the NATS credentials file (.creds) for --nats (default:\n$TALLY_NATS_CREDS)"},
    {"nats-user", CLI_OPT_NATS_USER, "NAME",
     "the NATS user the fleet knows us as: its subjects and inboxes\n(default: $TALLY_NATS_USER, "
     "else the user in the --nats URL)"},
    {"nats-tls-ca", CLI_OPT_NATS_TLS_CA, "FILE",
     "TLS to NATS, the servers' certificates checked against this\nCA file (PEM; default: "
     "$TALLY_NATS_TLS_CA)"},
    {"nats-tls-cert", CLI_OPT_NATS_TLS_CERT, "FILE",
     "a TLS client certificate (PEM) for servers that verify\nclients (default: "
     "$TALLY_NATS_TLS_CERT)"},
    {"nats-tls-key", CLI_OPT_NATS_TLS_KEY, "FILE", "its key (PEM; default: $TALLY_NATS_TLS_KEY)"},
    {"fleet", CLI_OPT_FLEET, "URL",
     "a fleet in direct mode at these NATS servers: each request\ngoes over ZeroMQ straight to "
     "its stream's owner (default:\n$TALLY_FLEET; PROTOCOL.md §13 \"Direct mode\")"},
    {"help", 'h', NULL, "show this help"},
    {0},
};

static const cli_setter_t common_setters[] = {
    CLI_SET_ARG('e', cli_t, endpoint),
    CLI_SET_ARG(CLI_OPT_SERVER_KEY, cli_t, server_key),
    CLI_SET_ARG(CLI_OPT_CLIENT_KEY, cli_t, client_key),
    CLI_SET_ARG(CLI_OPT_NATS, cli_t, nats),
    CLI_SET_ARG(CLI_OPT_NATS_CREDS, cli_t, nats_creds),
    CLI_SET_ARG(CLI_OPT_NATS_USER, cli_t, nats_user),
    CLI_SET_ARG(CLI_OPT_NATS_TLS_CA, cli_t, nats_tls_ca),
    CLI_SET_ARG(CLI_OPT_NATS_TLS_CERT, cli_t, nats_tls_cert),
    CLI_SET_ARG(CLI_OPT_NATS_TLS_KEY, cli_t, nats_tls_key),
    CLI_SET_ARG(CLI_OPT_FLEET, cli_t, fleet),
    {0},
};

/* Sets the field that setters' row for `id` names in ctx; false when no row names id. */
static bool set_option(const cli_setter_t *setters, void *ctx, int id, const char *arg)
{
    for (const cli_setter_t *s = setters; s && s->id; s++) {
        if (s->id != id)
            continue;
        char *field = (char *)ctx + s->offset;
        if (s->store == CLI_STORE_TRUE)
            *(bool *)field = true;
        else if (s->store == CLI_STORE_ARG)
            *(const char **)field = arg;
        else
            *(int *)field = s->value;
        return true;
    }
    return false;
}

int cli_common_option(cli_t *cli, const char *cmd, int id, const char *arg)
{
    if (set_option(common_setters, cli, id, arg))
        return 0;
    if (id != 't') /* -t: the one common option with code (-h is the caller's) */
        return 1;
    int64_t v;
    int rc = cli_option_i64(cmd, "--timeout", arg, 1, INT_MAX, &v);
    if (rc == 0)
        cli->timeout_ms = (int)v;
    return rc;
}

bool cli_group_applies(const cli_command_t *cmd, const cli_group_t *g)
{
    const tally_op_info_t *op = cmd->op ? tally_op_info(cmd->op) : NULL;
    if ((g->needs & CLI_NEEDS_STREAM) && (!op || op->stream == TALLY_STREAM_NONE))
        return false;
    return !(g->needs & CLI_NEEDS_SHM_REF) || (op && (op->flags & TALLY_FLAG_SHM_REF));
}

/* The group of cmd's that holds the long option `name` (up to '=' or the end) but is not cmd's,
 * or NULL. */
static const cli_group_t *ruled_out_group(const cli_command_t *cmd, const char *name)
{
    size_t len = strcspn(name, "=");
    for (const cli_group_t *g = cmd->groups; g && g->title; g++) {
        if (cli_group_applies(cmd, g))
            continue;
        for (const cli_option_t *o = g->options; o->name; o++)
            if (strlen(o->name) == len && !strncmp(o->name, name, len))
                return g;
    }
    return NULL;
}

/* How many options the groups hold (common ones included). */
static size_t count_options(const cli_group_t *groups)
{
    size_t n = 0;
    for (const cli_group_t *g = groups; g && g->title; g++)
        for (const cli_option_t *o = g->options; o->name; o++)
            n++;
    for (const cli_option_t *o = cli_common_options; o->name; o++)
        n++;
    return n;
}

static void add_options(struct option *table, size_t *n, char *shorts, const cli_option_t *opts)
{
    for (const cli_option_t *o = opts; o->name; o++) {
        int has_arg = o->arg_name ? required_argument : no_argument;
        table[(*n)++] = (struct option){o->name, has_arg, NULL, o->id};
        if (o->id < CLI_OPT_FIRST) { /* a letter: also a short option */
            size_t at = strlen(shorts);
            shorts[at++] = (char)o->id;
            if (has_arg == required_argument)
                shorts[at++] = ':';
            shorts[at] = '\0';
        }
    }
}

/* getopt's complaint (opterr is 0, so the words are ours); returns an exit status. An option
 * of a group the command's operation rules out is named as such. */
static int getopt_complaint(const cli_command_t *cmd, int opt, char **argv)
{
    if (opt == ':')
        return cli_usage_error(cmd->name, "option '%s' needs an argument", argv[optind - 1]);
    if (optopt && optopt < 256)
        return cli_usage_error(cmd->name, "unknown option '-%c'", optopt);
    const char *arg = argv[optind - 1];
    if (!strncmp(arg, "--", 2) && ruled_out_group(cmd, arg + 2))
        return cli_usage_error(cmd->name, "%s takes no --%.*s", tally_op_name(cmd->op),
                               (int)strcspn(arg + 2, "="), arg + 2);
    return cli_usage_error(cmd->name, "unknown option '%s'", arg);
}

/* One option (its argument in optarg): a common one, one a row sets, or the handler's. */
static int parse_option(cli_t *cli, const cli_command_t *cmd, void *ctx, int opt, int argc,
                        char **argv)
{
    int rc = cli_common_option(cli, cmd->name, opt, optarg);
    if (rc != 1)
        return rc;
    if (set_option(cmd->setters, ctx, opt, optarg))
        return 0;
    return cmd->option ? cmd->option(ctx, opt, optarg, argc, argv)
                       : cli_usage_error(cmd->name, "unknown option");
}

/* Which fleet, if any, the commands go to: --nats or --fleet from the command line (both is a
 * usage error: they are two ways to a fleet), else $TALLY_FLEET, else $TALLY_NATS; a fleet wins
 * over -e. Afterwards at most one of cli->nats and cli->fleet is set. */
static int choose_fleet(cli_t *cli, const cli_command_t *cmd)
{
    if (cli->nats && cli->fleet)
        return cli_usage_error(cmd->name, "--nats and --fleet are two ways to a fleet (through "
                                          "JetStream, or direct mode): give one");
    if (!cli->nats && !cli->fleet) {
        cli->fleet = cli->env_fleet;
        cli->nats = cli->fleet ? NULL : cli->env_nats;
    }
    return 0;
}

void cli_target(const cli_t *cli, char *out, size_t cap)
{
    const char *servers = cli->fleet ? cli->fleet : cli->nats;
    if (servers)
        tally_fleet_redact(servers, out, cap);
    else
        snprintf(out, cap, "%s", cli->endpoint);
}

int cli_parse(cli_t *cli, const cli_command_t *cmd, void *ctx, int argc, char **argv)
{
    size_t total = count_options(cmd->groups), n = 0;
    struct option *table = calloc(total + 1, sizeof *table);
    char shorts[2 * 26 + 4] = ":";
    if (!table) {
        cli_error("out of memory");
        return EXIT_USAGE;
    }
    for (const cli_group_t *g = cmd->groups; g && g->title; g++)
        if (cli_group_applies(cmd, g))
            add_options(table, &n, shorts, g->options);
    add_options(table, &n, shorts, cli_common_options);
    int opt, rc = 0;
    while (rc == 0 && (opt = getopt_long(argc, argv, shorts, table, NULL)) != -1) {
        if (opt == ':' || opt == '?')
            rc = getopt_complaint(cmd, opt, argv);
        else if (opt == 'h') {
            cli_print_help(cmd, stdout);
            rc = CLI_HELP_SHOWN;
        } else
            rc = parse_option(cli, cmd, ctx, opt, argc, argv);
    }
    free(table);
    if (rc == 0)
        rc = choose_fleet(cli, cmd);
    if (rc == 0 && cmd->nargs == CLI_ARGS_ONE_OR_MORE)
        return argc > optind ? 0 : cli_usage_error(cmd->name, "expected at least one argument");
    if (rc == 0 && argc - optind != cmd->nargs) {
        if (cmd->nargs == 0)
            return cli_usage_error(cmd->name, "unexpected argument '%s'", argv[optind]);
        return cli_usage_error(cmd->name, "expected %d argument%s", cmd->nargs,
                               cmd->nargs == 1 ? "" : "s");
    }
    return rc;
}

/* "  -e, --endpoint E   help", continuation lines indented to the help column. */
static void print_option(const cli_option_t *o, FILE *f)
{
    enum { HELP_COLUMN = 22 };
    char left[64];
    int len;
    if (o->id < CLI_OPT_FIRST)
        len = snprintf(left, sizeof left, "  -%c, --%s", o->id, o->name);
    else
        len = snprintf(left, sizeof left, "  --%s", o->name);
    if (o->arg_name)
        len += snprintf(left + len, sizeof left - (size_t)len, " %s", o->arg_name);
    if (len < HELP_COLUMN - 1)
        fprintf(f, "%-*s", HELP_COLUMN, left);
    else
        fprintf(f, "%s\n%*s", left, HELP_COLUMN, "");
    for (const char *p = o->help; *p; p++) {
        fputc(*p, f);
        if (*p == '\n')
            fprintf(f, "%*s", HELP_COLUMN, "");
    }
    fputc('\n', f);
}

void cli_print_options(const cli_option_t *options, FILE *f)
{
    for (const cli_option_t *o = options; o->name; o++)
        print_option(o, f);
}

const char *cli_command_summary(const cli_command_t *cmd)
{
    const tally_op_info_t *op = cmd->op ? tally_op_info(cmd->op) : NULL;
    if (cmd->summary || !op)
        return cmd->summary ? cmd->summary : "";
    return op->summary;
}

void cli_print_help(const cli_command_t *cmd, FILE *f)
{
    fprintf(f, "usage: tally %s\n\n%s", cmd->usage, cmd->about);
    for (const cli_group_t *g = cmd->groups; g && g->title; g++) {
        if (!cli_group_applies(cmd, g))
            continue;
        fprintf(f, "\n%s:\n", g->title);
        cli_print_options(g->options, f);
    }
    fprintf(f, "\nCommon options (also accepted before the command):\n");
    cli_print_options(cli_common_options, f);
}

int cli_run(cli_t *cli, const cli_command_t *cmd, int argc, char **argv)
{
    if (!cmd->request)
        return cmd->run(cli, cmd, argc, argv);
    tally_client_t *client = NULL;
    int rc = cli_parse(cli, cmd, NULL, argc, argv);
    if (rc == 0 && cmd->check)
        rc = cmd->check(cmd->name, argv + optind);
    if (rc == 0)
        rc = cli_connect(cli, &client);
    if (rc == 0)
        rc = cmd->request(client, cmd, argv + optind);
    tally_client_destroy(&client);
    return rc;
}

/* ---- Connecting --------------------------------------------------------------------------- */

/* The client alone: CURVE keys as the common options say, timeout_ms for every wait. */
static int client_new(const cli_t *cli, int timeout_ms, tally_client_t **client)
{
    /* CURVE keys: --server-key/--client-key, else $TALLY_SERVER_KEY/$TALLY_CLIENT_KEY, else
     * ~/.config/tally/tally.conf; none anywhere: a plain connection. */
    tally_curve_keys_t keys;
    char kwhy[512];
    tally_status_t status =
        tally_curve_keys_load(cli->server_key, cli->client_key, &keys, kwhy, sizeof kwhy);
    if (status != TALLY_OK) {
        cli_error("CURVE keys: %s", kwhy);
        return EXIT_USAGE;
    }
    char why[512];
    status = tally_client_open(cli->endpoint, timeout_ms, &keys, client, why, sizeof why);
    explicit_bzero(&keys, sizeof keys);
    if (status == TALLY_E_ARG) {
        cli_error("%s", why); /* "invalid endpoint 'X': unsupported transport (...)" */
        return EXIT_USAGE;
    }
    if (status != TALLY_OK)
        return cli_report(status, "connect", why);
    return 0;
}

tally_nats_opts_t cli_nats_opts(const cli_t *cli, int timeout_ms)
{
    return (tally_nats_opts_t){.servers = cli->fleet ? cli->fleet : cli->nats,
                               .credentials = cli->nats_creds,
                               .user = cli->nats_user,
                               .tls_ca = cli->nats_tls_ca,
                               .tls_cert = cli->nats_tls_cert,
                               .tls_key = cli->nats_tls_key,
                               .timeout_ms = timeout_ms};
}

int cli_nats_client(const cli_t *cli, int timeout_ms, tally_client_t **client)
{
    tally_nats_opts_t o = cli_nats_opts(cli, timeout_ms);
    char why[512] = "", shown[512];
    tally_fleet_redact(o.servers, shown, sizeof shown); /* no password on the terminal */
    tally_status_t status;
    if (cli->fleet) { /* its members' server keys are their own (curve=): the client's pair here */
        tally_curve_keys_t keys;
        status =
            tally_curve_client_keys_load(cli->server_key, cli->client_key, &keys, why, sizeof why);
        if (status != TALLY_OK) {
            cli_error("CURVE keys: %s", why);
            return EXIT_USAGE;
        }
        status = tally_client_new_fleet_curve(&o, &keys, client, why, sizeof why);
        explicit_bzero(&keys, sizeof keys);
    } else {
        status = tally_client_new_nats(&o, client, why, sizeof why);
    }
    if (status == TALLY_E_TRANSPORT) {
        cli_error("cannot connect to NATS at %s: %s", shown, why);
        return EXIT_TRANSPORT;
    }
    if (status != TALLY_OK) {
        cli_error("NATS %s: %s", shown, why[0] ? why : tally_status_name(status));
        return EXIT_USAGE;
    }
    return 0;
}

int cli_connect(const cli_t *cli, tally_client_t **client)
{
    if (cli->nats || cli->fleet) /* a fleet (PROTOCOL.md §13): NATS says when nothing answers */
        return cli_nats_client(cli, cli->timeout_ms, client);
    int rc = client_new(cli, cli->timeout_ms, client);
    if (rc)
        return rc;
    /* The connection, before anything is read or sent: nothing listening is an immediate,
     * named failure (libtally's words), a daemon that does not answer one timeout. */
    if (tally_client_wait_connected(*client) != TALLY_OK) {
        cli_error("%s", tally_client_error(*client));
        tally_client_destroy(client);
        return EXIT_TRANSPORT;
    }
    return 0;
}
