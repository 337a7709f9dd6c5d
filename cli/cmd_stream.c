/*
 * cmd_stream.c — the stream commands: query (a stream's counters and running histogram),
 * reset (clear one) and streams (list them).
 */
#include "cli.h"

#include <inttypes.h>
#include <string.h>

/* The stream named by the command's one argument, checked before anything is sent. */
static int stream_arg(const char *cmd, int argc, char **argv)
{
    (void)argc;
    const char *name = argv[optind];
    if (!tally_stream_name_valid(name, strlen(name)))
        return cli_usage_error(cmd,
                               "invalid stream name '%s': 1-64 printable ASCII bytes, no "
                               "spaces",
                               name);
    return 0;
}

static void print_info(const tally_stream_info_t *info)
{
    const char *type = tally_dtype_name((tally_dtype_t)info->hist_dtype);
    printf("batches %" PRIu64 "\nelements %" PRIu64 "\nbytes %" PRIu64 "\n", info->batches,
           info->elements, info->bytes);
    printf("filter_seen %" PRIu64 "\nfilter_kept %" PRIu64 "\n", info->filter_seen,
           info->filter_kept);
    printf("scan_carry %" PRId64 "\nscan_elements %" PRIu64 "\n", info->scan_carry,
           info->scan_elements);
    printf("hist_type %s\nhist_lo %" PRId64 "\nhist_hi %" PRId64 "\n", type ? type : "none",
           info->hist_lo, info->hist_hi);
    printf("hist_underflow %" PRIu64 "\nhist_overflow %" PRIu64 "\nhist_total %" PRIu64 "\n",
           info->hist_underflow, info->hist_overflow, info->hist_total);
    printf("last_seq %" PRIu64 "\n", info->last_seq);
    for (unsigned i = 0; i < TALLY_HIST_BINS; i++)
        printf("%u %" PRIu64 "\n", i, info->bins[i]);
}

static int run_query(cli_t *cli, int argc, char **argv)
{
    tally_client_t *client = NULL;
    int rc = cli_begin(cli, &cli_cmd_query, argc, argv, stream_arg, &client);
    if (rc)
        return rc == CLI_HELP_SHOWN ? 0 : rc;
    const char *name = argv[optind];
    tally_stream_info_t info;
    tally_status_t status = tally_query(client, name, &info);
    if (status != TALLY_OK) {
        rc = cli_report(status, "query", tally_client_error(client));
    } else {
        print_info(&info);
        rc = cli_finish_stdout();
    }
    tally_client_destroy(&client);
    return rc;
}

const cli_command_t cli_cmd_query = {
    .name = "query",
    .summary = "a stream's counters and running histogram",
    .usage = "query STREAM",
    .about = "Print a stream's counters as 'key value' lines (batches, elements, bytes,\n"
             "filter_seen, filter_kept, scan_carry, scan_elements, hist_type, hist_lo, hist_hi,\n"
             "hist_underflow, hist_overflow, hist_total, last_seq), then its running histogram\n"
             "as 256 'bin count' lines (all bins, zeros included, so the output always has the\n"
             "same shape).\n",
    .nargs = 1,
    .run = run_query,
};

static int run_reset(cli_t *cli, int argc, char **argv)
{
    tally_client_t *client = NULL;
    int rc = cli_begin(cli, &cli_cmd_reset, argc, argv, stream_arg, &client);
    if (rc)
        return rc == CLI_HELP_SHOWN ? 0 : rc;
    tally_status_t status = tally_reset(client, argv[optind]);
    if (status != TALLY_OK)
        rc = cli_report(status, "reset", tally_client_error(client));
    tally_client_destroy(&client);
    return rc;
}

const cli_command_t cli_cmd_reset = {
    .name = "reset",
    .summary = "clear a stream",
    .usage = "reset STREAM",
    .about = "Clear a stream's histogram, scan carry and counters.\n",
    .nargs = 1,
    .run = run_reset,
};

static int run_streams(cli_t *cli, int argc, char **argv)
{
    tally_client_t *client = NULL;
    int rc = cli_begin(cli, &cli_cmd_streams, argc, argv, NULL, &client);
    if (rc)
        return rc == CLI_HELP_SHOWN ? 0 : rc;
    char **names = NULL;
    size_t count = 0;
    tally_status_t status = tally_streams(client, &names, &count);
    if (status != TALLY_OK) {
        rc = cli_report(status, "streams", tally_client_error(client));
    } else {
        for (size_t i = 0; i < count; i++)
            printf("%s\n", names[i]);
        rc = cli_finish_stdout();
    }
    tally_strings_free(names, count);
    tally_client_destroy(&client);
    return rc;
}

const cli_command_t cli_cmd_streams = {
    .name = "streams",
    .summary = "list streams",
    .usage = "streams",
    .about = "List the daemon's streams, one name per line.\n",
    .run = run_streams,
};
