/*
 * cmd_daemon.c — the commands about the daemon itself: ping (a round trip), info (version,
 * backends, limits) and stats (its metrics in the Prometheus text format).
 */
#include "cli.h"

#include <stdlib.h>
#include <string.h>

static int run_ping(cli_t *cli, int argc, char **argv)
{
    tally_client_t *client = NULL;
    int rc = cli_begin(cli, &cli_cmd_ping, argc, argv, NULL, &client);
    if (rc)
        return rc == CLI_HELP_SHOWN ? 0 : rc;
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
static int text_command(cli_t *cli, const cli_command_t *cmd, tally_op_t op, int argc, char **argv)
{
    tally_client_t *client = NULL;
    int rc = cli_begin(cli, cmd, argc, argv, NULL, &client);
    if (rc)
        return rc == CLI_HELP_SHOWN ? 0 : rc;
    char *text = NULL;
    tally_status_t status = tally_info(client, op, &text);
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

static int run_info(cli_t *cli, int argc, char **argv)
{
    return text_command(cli, &cli_cmd_info, TALLY_OP_INFO, argc, argv);
}

static int run_stats(cli_t *cli, int argc, char **argv)
{
    return text_command(cli, &cli_cmd_stats, TALLY_OP_STATS, argc, argv);
}

const cli_command_t cli_cmd_info = {
    .name = "info",
    .summary = "daemon version, backends and limits",
    .usage = "info",
    .about = "Print the daemon's version, backends, devices and limits as 'key=value' lines.\n",
    .run = run_info,
};

const cli_command_t cli_cmd_stats = {
    .name = "stats",
    .summary = "daemon metrics (Prometheus text)",
    .usage = "stats",
    .about = "Print the daemon's metrics in the Prometheus text format.\n",
    .run = run_stats,
};
