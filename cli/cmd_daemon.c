/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cmd_daemon.c — the commands about the daemon itself: ping (a round trip), info (version,
 * backends, limits) and stats (its metrics in the Prometheus text format); and keygen (a CURVE
 * key pair for tallyd or a client).
 */
#include "cli.h"

#include <stdlib.h>
#include <string.h>

static int send_ping(tally_client_t *client, const cli_command_t *cmd, char **args)
{
    (void)cmd, (void)args;
    double rtt_us = 0;
    tally_status_t status = tally_ping(client, &rtt_us);
    if (status != TALLY_OK)
        return cli_report(status, "ping", tally_client_error(client));
    printf("pong %.3f ms\n", rtt_us / 1000.0);
    return cli_finish_stdout();
}

CLI_COMMAND(ping, .usage = "ping", .op = TALLY_OP_PING,
            .about = "Check that tallyd answers; prints 'pong <round trip> ms'.\n",
            .request = send_ping);

/* info and stats: one request, its text printed as it came. */
static int print_text(tally_client_t *client, const cli_command_t *cmd, char **args)
{
    (void)args;
    char *text = NULL;
    int rc;
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
    return rc;
}

CLI_COMMAND(
    info, .usage = "info",
    .about = "Print the daemon's version, backends, devices and limits as 'key=value' lines.\n",
    .op = TALLY_OP_INFO, .request = print_text);

CLI_COMMAND(stats, .usage = "stats",
            .about = "Print the daemon's metrics in the Prometheus text format.\n",
            .op = TALLY_OP_STATS, .request = print_text);

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

CLI_COMMAND(
    keygen, .usage = "keygen NAME", .summary = "make a CURVE key pair (NAME.key, NAME.pub)",
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
    .nargs = 1, .run = run_keygen);
