/* SPDX-License-Identifier: Apache-2.0 */
/*
 * main.c — the `tally` command: tallyd from the shell, built on libtally.
 *
 *   tally [-e ENDPOINT] [-t TIMEOUT_MS] COMMAND [OPTIONS] [ARGS]
 *
 * This file holds the list of commands and parses the options given before the command
 * name; each command parses its own options in its file (cli.h says how).
 */
#include "cli.h"
#include "cli_doc.h"
#include "tally_revision.h"

#include <stdlib.h>
#include <string.h>

static const cli_command_t *const commands[] = {
    &cli_cmd_filter, &cli_cmd_scan,  &cli_cmd_hist,   &cli_cmd_minmax,  &cli_cmd_query,
    &cli_cmd_watch,  &cli_cmd_reset, &cli_cmd_delete, &cli_cmd_streams, &cli_cmd_ping,
    &cli_cmd_info,   &cli_cmd_stats, &cli_cmd_keygen,
};

static const cli_option_t top_options[] = {
    {"version", 'V', NULL, "print the version"},
    {0},
};

static void print_usage(FILE *f)
{
    fprintf(f, "usage: tally [-e ENDPOINT] [-t TIMEOUT_MS] COMMAND [OPTIONS]\n"
               "\n"
               "Send work to tallyd, the GPU stream-processing daemon.\n"
               "\n"
               "Options:\n");
    cli_print_options(cli_common_options, f);
    cli_print_options(top_options, f);
    fprintf(f, "\nCommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-8s %s\n", commands[i]->name, cli_command_summary(commands[i]));
    fprintf(f, "\n'tally COMMAND --help' describes a command.\n"
               "\n"
               "Environment: TALLY_ENDPOINT, the endpoint when -e is not given;\n"
               "TALLY_SERVER_KEY and TALLY_CLIENT_KEY, the CURVE keys when --server-key and\n"
               "--client-key are not given; TALLY_NATS, TALLY_NATS_CREDS, TALLY_NATS_USER,\n"
               "TALLY_NATS_TLS_CA, TALLY_NATS_TLS_CERT and TALLY_NATS_TLS_KEY, the --nats\n"
               "options of those names; TALLY_FLEET, --fleet. --nats or --fleet on the\n"
               "command line (not both) wins over both variables, TALLY_FLEET over TALLY_NATS,\n"
               "and a fleet over -e.\n"
               "Exit status: 0 ok, 1 error reported by tallyd, 2 usage or input error,\n"
               "3 no reply (nothing listening, timeout or transport failure), 130 interrupted.\n");
}

/* Hidden: the tables printed for the bash completion and the man page (cli_doc.h). */
enum { OPT_COMPLETE = CLI_OPT_FIRST, OPT_PRINT_SCD };

/* The options before the command: 0 to go on, CLI_HELP_SHOWN, or an exit status. */
static int top_level(cli_t *cli, int argc, char **argv)
{
    static const struct option opts[] = {
        {"complete", no_argument, NULL, OPT_COMPLETE},
        {"print-commands-scd", no_argument, NULL, OPT_PRINT_SCD},
        {"endpoint", required_argument, NULL, 'e'},
        {"timeout", required_argument, NULL, 't'},
        {"server-key", required_argument, NULL, CLI_OPT_SERVER_KEY},
        {"client-key", required_argument, NULL, CLI_OPT_CLIENT_KEY},
        {"nats", required_argument, NULL, CLI_OPT_NATS},
        {"nats-creds", required_argument, NULL, CLI_OPT_NATS_CREDS},
        {"nats-user", required_argument, NULL, CLI_OPT_NATS_USER},
        {"nats-tls-ca", required_argument, NULL, CLI_OPT_NATS_TLS_CA},
        {"nats-tls-cert", required_argument, NULL, CLI_OPT_NATS_TLS_CERT},
        {"nats-tls-key", required_argument, NULL, CLI_OPT_NATS_TLS_KEY},
        {"fleet", required_argument, NULL, CLI_OPT_FLEET},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {0},
    };
    int opt, rc;
    opterr = 0;
    /* "+": stop at the command name; its options are parsed by the command. */
    while ((opt = getopt_long(argc, argv, "+:e:t:hV", opts, NULL)) != -1) {
        switch (opt) {
        case 'h':
            print_usage(stdout);
            return CLI_HELP_SHOWN;
        case OPT_COMPLETE:
        case OPT_PRINT_SCD:
            (opt == OPT_COMPLETE ? cli_doc_complete : cli_doc_scd)(
                commands, sizeof commands / sizeof commands[0], top_options, stdout);
            return CLI_HELP_SHOWN;
        case 'V':
            printf("tally %s (libtally %s, revision %s)\n", TALLY_VERSION, tally_version(),
                   tally_build_revision);
            return CLI_HELP_SHOWN;
        case ':':
            return cli_usage_error(NULL, "option '%s' needs an argument", argv[optind - 1]);
        case '?':
            return cli_usage_error(NULL, "unknown option '%s'", argv[optind - 1]);
        default:
            if ((rc = cli_common_option(cli, NULL, opt, optarg)) != 0)
                return rc;
        }
    }
    return 0;
}

/* An environment variable that is set and not empty, else NULL. */
static const char *env(const char *name)
{
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

int main(int argc, char **argv)
{
    cli_t cli = {.endpoint = getenv("TALLY_ENDPOINT"), .timeout_ms = TALLY_DEFAULT_TIMEOUT_MS};
    if (!cli.endpoint || !*cli.endpoint)
        cli.endpoint = TALLY_DEFAULT_ENDPOINT;
    cli.env_nats = env("TALLY_NATS"); /* cli_parse chooses between them and the options */
    cli.nats_creds = env("TALLY_NATS_CREDS");
    cli.nats_user = env("TALLY_NATS_USER");
    cli.nats_tls_ca = env("TALLY_NATS_TLS_CA");
    cli.nats_tls_cert = env("TALLY_NATS_TLS_CERT");
    cli.nats_tls_key = env("TALLY_NATS_TLS_KEY");
    cli.env_fleet = env("TALLY_FLEET");
    int rc = top_level(&cli, argc, argv);
    if (rc)
        return rc == CLI_HELP_SHOWN ? 0 : rc;
    if (optind >= argc) {
        print_usage(stderr);
        return EXIT_USAGE;
    }
    const char *name = argv[optind];
    if (!strcmp(name, "help")) {
        print_usage(stdout);
        return 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        if (strcmp(name, commands[i]->name))
            continue;
        int sub_argc = argc - optind;
        char **sub_argv = argv + optind;
        optind = 0; /* glibc: restart getopt on the command's own arguments */
        setvbuf(stdout, NULL, _IOFBF, 1 << 16);
        rc = cli_run(&cli, commands[i], sub_argc, sub_argv);
        return rc == CLI_HELP_SHOWN ? 0 : rc;
    }
    return cli_usage_error(NULL, "unknown command '%s'", name);
}
