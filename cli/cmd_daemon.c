/*
 * cmd_daemon.c — the commands about the daemon itself: ping (a round trip), info (version,
 * backends, limits) and stats (its metrics in the Prometheus text format).
 */
#include "cli.h"

#include <stdlib.h>
#include <string.h>

static int run_ping(cli_t *cli, const cli_command_t *cmd, int argc, char **argv)
{
    tally_client_t *client = NULL;
    int rc = cli_begin(cli, cmd, argc, argv, NULL, &client);
    if (rc)
        return rc;
    double rtt_us = 0;
    tally_status_t status = tally_ping(client, &rtt_us);
    if (status != TALLY_OK) {
        rc = cli_report(status, "ping", tally_client_error(client));
    } else {
        printf("pong %.3f ms\n", rtt_us / 1000.0);
        rc = cli_finish_stdout();
    }
    tally_client_destroy(&client);
    return rc;
}

const cli_command_t cli_cmd_ping = {
    .name = "ping",
    .summary = "check that tallyd answers",
    .usage = "ping",
    .about = "Check that tallyd answers; prints 'pong <round trip> ms'.\n",
    .run = run_ping,
};

/* info and stats: one request, its text printed as it came. */
static int run_text(cli_t *cli, const cli_command_t *cmd, int argc, char **argv)
{
    tally_client_t *client = NULL;
    int rc = cli_begin(cli, cmd, argc, argv, NULL, &client);
    if (rc)
        return rc;
    char *text = NULL;
    tally_status_t status = tally_info(client, cmd->op, &text);
    if (status != TALLY_OK) {
        rc = cli_report(status, cmd->name, tally_client_error(client));
    } else {
        size_t len = strlen(text);
        fputs(text, stdout);
        if (len && text[len - 1] != '\n')
            fputc('\n', stdout);
        rc = cli_finish_stdout();
    }
    free(text);
    tally_client_destroy(&client);
    return rc;
}

const cli_command_t cli_cmd_info = {
    .name = "info",
    .summary = "daemon version, backends and limits",
    .usage = "info",
    .about = "Print the daemon's version, backends, devices and limits as 'key=value' lines.\n",
    .op = TALLY_OP_INFO,
    .run = run_text,
};

const cli_command_t cli_cmd_stats = {
    .name = "stats",
    .summary = "daemon metrics (Prometheus text)",
    .usage = "stats",
    .about = "Print the daemon's metrics in the Prometheus text format.\n",
    .op = TALLY_OP_STATS,
    .run = run_text,
};

static int run_keygen(cli_t *cli, const cli_command_t *cmd, int argc, char **argv)
{
    int rc = cli_parse(cli, cmd, NULL, argc, argv);
    if (rc)
        return rc;
    char pub[41], why[512] = "";
    tally_status_t st = tally_keygen(argv[optind], pub, why, sizeof why);
    if (st == TALLY_E_ARG)
        return cli_usage_error("keygen", "%s", why[0] ? why : "bad NAME");
    if (st != TALLY_OK) {
        cli_error("keygen: %s", why);
        return EXIT_USAGE;
    }
    printf("%s\n", pub);
    return cli_finish_stdout();
}

const cli_command_t cli_cmd_keygen = {
    .name = "keygen",
    .summary = "make a CURVE key pair (NAME.key, NAME.pub)",
    .usage = "keygen NAME",
    .about =
        "Make a CURVE key pair: NAME.key (both halves, mode 0600: this side's secret) and "
        "NAME.pub\n"
        "(the public half, for the other side). For tallyd: `tally keygen /etc/tallyd/server`, "
        "then\n"
        "curve_secret_key = /etc/tallyd/server.key, and server.pub to the clients. For a client:\n"
        "`tally keygen cam1`, cam1.pub into tallyd's curve_clients_dir, and connect with\n"
        "--server-key server.pub --client-key cam1.key (or TALLY_SERVER_KEY and TALLY_CLIENT_KEY,\n"
        "or server_key = and client_key = in ~/.config/tally/tally.conf). Prints the public key;\n"
        "never overwrites a file.\n",
    .nargs = 1,
    .run = run_keygen,
};
