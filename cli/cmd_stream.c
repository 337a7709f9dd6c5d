/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cmd_stream.c — the stream commands: query (a stream's histogram summary, or all of its
 * record as JSON, CSV or key-value lines), reset (zero a stream and keep it), delete (remove
 * it) and streams (list them).
 */
#include "cli.h"
#include "hist_view.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

/* The stream named by the command's one argument, checked before anything is sent. */
static int stream_arg(const char *cmd, char **args)
{
    const char *name = args[0];
    if (!tally_stream_name_valid(name, strlen(name)))
        return cli_usage_error(cmd,
                               "invalid stream name '%s': 1-64 printable ASCII bytes, no "
                               "spaces",
                               name);
    return 0;
}

/* ---- query -------------------------------------------------------------------------------- */

typedef enum { QUERY_TEXT, QUERY_JSON, QUERY_CSV, QUERY_RAW } query_format_t;

typedef struct {
    query_format_t format;
    int formats; /* how many of --json, --csv, --raw were given */
    uint64_t last_ms;
    double quantiles[TALLY_QUANTILES_MAX]; /* --quantile, in the order given, each once */
    size_t nquantiles;
    bool stale_ok;
} query_args_t;

enum { OPT_JSON = CLI_OPT_FIRST, OPT_CSV, OPT_RAW, OPT_LAST, OPT_QUANTILE, OPT_STALE_OK };

static const cli_option_t query_options[] = {
    {"json", OPT_JSON, NULL,
     "one JSON object: the counters, count, mean, min, max,\nquantiles {p50: {q, value, side}, "
     "...} and bins\n[{lo, hi, count}] (per channel under \"channels\" for\nrgb8/rgba8)"},
    {"csv", OPT_CSV, NULL,
     "the bins as CSV: lo,hi,count,kind (kind: underflow, bin,\noverflow; a channel column "
     "first for rgb8/rgba8); with\n--quantile the quantiles: quantile,q,value,side"},
    {"quantile", OPT_QUANTILE, "Q",
     "show the Q-quantile (0 <= Q <= 1: 0.999 is p99.9)\ninstead of p50, p90, p99; "
     "repeatable"},
    {"raw", OPT_RAW, NULL,
     "every field of the record as 'key value' lines, then\nthe bins as 'bin count' lines"},
    {"last", OPT_LAST, "DURATION",
     "only the last DURATION of the histogram (10s, 500ms,\n2m, 1h; tallyd keeps "
     "window_intervals x\nwindow_interval_ms, see 'tally info')"},
    {"stale-ok", OPT_STALE_OK, NULL,
     "with --nats or --fleet: a standby's copy of the stream's\npartition may answer (the "
     "owner's or the copy's,\nwhichever comes first; also while the partition has no\nowner); "
     "an answer from a copy says so on stderr"},
    {0},
};

static const cli_group_t query_groups[] = {{"Options", query_options, 0}, {0}};

/* --quantile Q: a decimal number in [0, 1], to the nearest millionth; given twice, shown once. */
static int quantile_option(query_args_t *q, const char *arg)
{
    char *end = NULL;
    double v = -1;
    if ((*arg >= '0' && *arg <= '9') || *arg == '.') { /* no sign, no "nan", no hex */
        errno = 0;
        v = strtod(arg, &end);
        if (errno || end == arg || *end)
            v = -1;
    }
    char name[TALLY_QUANTILE_NAME_MAX];
    if (tally_quantile_name(v, name, sizeof name) != TALLY_OK)
        return cli_usage_error("query",
                               "invalid quantile '%s' for --quantile: a number from 0 "
                               "to 1 (0.999 for p99.9)",
                               arg);
    for (size_t i = 0; i < q->nquantiles; i++) {
        char other[TALLY_QUANTILE_NAME_MAX];
        tally_quantile_name(q->quantiles[i], other, sizeof other);
        if (!strcmp(name, other))
            return 0;
    }
    if (q->nquantiles == TALLY_QUANTILES_MAX)
        return cli_usage_error("query", "at most %d --quantile", TALLY_QUANTILES_MAX);
    q->quantiles[q->nquantiles++] = v;
    return 0;
}

static int query_option(void *ctx, int id, const char *arg, int argc, char **argv)
{
    (void)argc;
    (void)argv;
    query_args_t *q = ctx;
    switch (id) {
    case OPT_JSON:
    case OPT_CSV:
    case OPT_RAW:
        q->format = id == OPT_JSON ? QUERY_JSON : id == OPT_CSV ? QUERY_CSV : QUERY_RAW;
        q->formats++;
        return 0;
    case OPT_LAST:
        return cli_option_duration_ms("query", "--last", arg, 1, TALLY_WINDOW_MS_MAX, &q->last_ms);
    case OPT_QUANTILE:
        return quantile_option(q, arg);
    case OPT_STALE_OK:
        q->stale_ok = true;
        return 0;
    default:
        return cli_usage_error("query", "unknown option");
    }
}

/* --raw: the record as it came, one field a line (what `tally query` printed before it had a
 * summary); the bins as "bin count", or "channel bin count" for rgb8/rgba8. */
static tally_status_t print_raw(const hv_stream_t *s, tally_buf_t *out)
{
    const tally_stream_info_t *i = &s->info;
    const char *type = tally_dtype_name((tally_dtype_t)i->hist_dtype);
    tally_status_t st = tally_buf_printf(
        out,
        "batches %" PRIu64 "\nelements %" PRIu64 "\nbytes %" PRIu64 "\nfilter_seen %" PRIu64
        "\nfilter_kept %" PRIu64 "\nscan_carry %" PRId64 "\nscan_elements %" PRIu64
        "\nhist_type %s\nhist_lo %" PRId64 "\nhist_hi %" PRId64 "\nhist_underflow %" PRIu64
        "\nhist_overflow %" PRIu64 "\nhist_total %" PRIu64 "\nlast_seq %" PRIu64 "\n",
        i->batches, i->elements, i->bytes, i->filter_seen, i->filter_kept, i->scan_carry,
        i->scan_elements, type && i->hist_dtype ? type : "none", i->hist_lo, i->hist_hi,
        i->hist_underflow, i->hist_overflow, i->hist_total, i->last_seq);
    unsigned channels = s->channels ? s->channels : 1;
    for (unsigned c = 0; c < channels && st == TALLY_OK; c++) {
        const char *name = hv_channel_name(s, c);
        for (unsigned b = 0; b < TALLY_HIST_BINS && st == TALLY_OK; b++)
            st = tally_buf_printf(out, "%s%s%u %" PRIu64 "\n", name ? name : "", name ? " " : "", b,
                                  i->bins[c * TALLY_HIST_BINS + b]);
    }
    return st;
}

static int query_print(const query_args_t *q, const char *name, const tally_stream_info_t *info,
                       uint64_t start_ms, uint64_t end_ms)
{
    hv_stream_t s;
    if (hv_stream_init(&s, name, info) != TALLY_OK)
        return cli_report(TALLY_E_REPLY, "query", "the stream's histogram type is unknown here");
    s.window_start_ms = start_ms;
    s.window_end_ms = end_ms;
    s.quantiles = q->quantiles;
    s.nquantiles = q->nquantiles;
    tally_buf_t out = {0};
    tally_status_t st = q->format == QUERY_JSON  ? hv_json(&s, &out)
                        : q->format == QUERY_CSV ? hv_csv(&s, &out)
                        : q->format == QUERY_RAW ? print_raw(&s, &out)
                                                 : hv_summary_text(&s, &out);
    if (st == TALLY_OK)
        fwrite(out.data, 1, out.len, stdout);
    tally_buf_free(&out);
    if (st != TALLY_OK) {
        cli_error("out of memory");
        return EXIT_DAEMON;
    }
    return cli_finish_stdout();
}

/* query --stale-ok: asked of the fleet with Tally-Stale-Ok (tally_nats_query_stale); an answer
 * from a standby's copy said on stderr. */
static int run_query_stale(cli_t *cli, const query_args_t *q, const char *name)
{
    if (!cli->nats && !cli->fleet)
        return cli_usage_error("query", "--stale-ok asks a fleet: give --nats or --fleet");
    if (q->last_ms)
        return cli_usage_error("query", "a standby's copy answers no --last");
    tally_nats_opts_t o = cli_nats_opts(cli, cli->timeout_ms);
    tally_nats_t *n = NULL;
    char why[512] = "";
    tally_status_t status = tally_nats_new(&o, &n, why, sizeof why);
    if (status != TALLY_OK)
        return cli_report(status, "connect", why);
    static tally_stream_info_t info; /* 8 KiB of bins off the stack */
    uint64_t stale = 0;
    int rc;
    status = tally_nats_query_stale(n, name, &info, &stale);
    if (status != TALLY_OK) {
        rc = cli_report(status, "query", tally_nats_error(n));
    } else {
        if (stale)
            fprintf(stderr,
                    "tally: stale: answered from a standby's copy (its partition's changelog to "
                    "sequence %" PRIu64 ")\n",
                    stale);
        rc = query_print(q, name, &info, 0, 0);
    }
    tally_nats_destroy(&n);
    return rc;
}

static int run_query(cli_t *cli, const cli_command_t *cmd, int argc, char **argv)
{
    query_args_t q = {.format = QUERY_TEXT};
    int rc = cli_parse(cli, cmd, &q, argc, argv);
    if (rc)
        return rc;
    if (q.formats > 1)
        return cli_usage_error("query", "--json, --csv and --raw exclude each other");
    if (q.nquantiles && q.format == QUERY_RAW)
        return cli_usage_error("query", "--raw prints the record as it is: no --quantile");
    const char *name = argv[optind];
    tally_client_t *client = NULL;
    if ((rc = stream_arg("query", argv + optind)) != 0)
        return rc;
    if (q.stale_ok)
        return run_query_stale(cli, &q, name);
    if ((rc = cli_connect(cli, &client)) != 0)
        return rc;
    tally_stream_info_t info;
    uint64_t start_ms = 0, end_ms = 0;
    tally_status_t status =
        q.last_ms ? tally_query_window(client, name, q.last_ms, &info, &start_ms, &end_ms)
                  : tally_query(client, name, &info);
    if (status != TALLY_OK)
        rc = cli_report(status, "query", tally_client_error(client));
    else
        rc = query_print(&q, name, &info, start_ms, end_ms);
    tally_client_destroy(&client);
    return rc;
}

CLI_COMMAND(
    query,
    .usage = "query [--json|--csv|--raw] [--last DURATION] [--quantile Q]... [--stale-ok] STREAM",
    .op = TALLY_OP_QUERY,
    .about =
        "Summarise a stream's running histogram: the count of values, the mean (of the values\n"
        "in range, each at the centre of its bin: '(in range)' for i32/u16, whose underflow\n"
        "and overflow it leaves out), the lowest and highest non-empty bin, the quantiles p50,\n"
        "p90 and p99 (or those of --quantile) estimated from the bins, and for i32/u16\n"
        "histograms the underflow and overflow; then the stream's counters. rgb8/rgba8\n"
        "streams show one column per channel.\n"
        "\n"
        "Quantiles: of the N values, the one of rank ceil(q x N) (nearest rank; exact for u8\n"
        "and colour channels). In a bin of w integers holding c values, the j-th is taken as\n"
        "edge + floor((2j - 1) x w / 2c), the values spread evenly over the bin. A quantile\n"
        "that is an underflow or overflow value shows as '< LO' or '>= HI' (in JSON and CSV:\n"
        "value LO or HI with side \"underflow\" or \"overflow\").\n",
    .groups = query_groups, .nargs = 1, .option = query_option, .run = run_query);

/* ---- reset, delete ------------------------------------------------------------------------ */

/* reset and delete: one stream name, an empty reply. */
static int stream_control(tally_client_t *client, const cli_command_t *cmd, char **args)
{
    tally_status_t status =
        cmd->op == TALLY_OP_RESET ? tally_reset(client, args[0]) : tally_delete(client, args[0]);
    return status == TALLY_OK ? 0 : cli_report(status, cmd->name, tally_client_error(client));
}

CLI_COMMAND(reset, .usage = "reset STREAM",
            .about =
                "Zero a stream and keep it: its counters, histogram (all time and the recent\n"
                "windows) and scan carry become 0. It stays in 'tally streams' with its name, its\n"
                "histogram's type and range, and its last_seq (a numbered push continues).\n"
                "To remove a stream, use 'tally delete'.\n",
            .nargs = 1, .op = TALLY_OP_RESET, .check = stream_arg, .request = stream_control);

CLI_COMMAND(
    delete, .usage = "delete STREAM",
    .about = "Remove a stream: its state and its name are forgotten, it leaves 'tally streams',\n"
             "and the next request that names it starts a new stream (any histogram type and\n"
             "range, sequence numbers from 1). To zero a stream and keep it, use 'tally reset'.\n",
    .nargs = 1, .op = TALLY_OP_DELETE, .check = stream_arg, .request = stream_control);

static int list_streams(tally_client_t *client, const cli_command_t *cmd, char **args)
{
    (void)cmd, (void)args;
    int rc;
    char **names = NULL;
    size_t count = 0;
    uint32_t missing = 0;
    tally_status_t status = tally_streams_missing(client, &names, &count, &missing);
    if (status != TALLY_OK) {
        rc = cli_report(status, "streams", tally_client_error(client));
    } else {
        for (size_t i = 0; i < count; i++)
            printf("%s\n", names[i]);
        rc = cli_finish_stdout();
    }
    if (status == TALLY_OK && missing) { /* a fleet's worker did not answer: not passed off */
        fprintf(stderr,
                "tally: streams: a partial list: no worker answered in time for %" PRIu32
                " partition(s); their streams are missing\n",
                missing);
        rc = rc ? rc : 1;
    }
    tally_strings_free(names, count);
    return rc;
}

CLI_COMMAND(streams, .usage = "streams", .op = TALLY_OP_STREAMS,
            .about = "List the daemon's streams, one name per line.\n", .request = list_streams);
