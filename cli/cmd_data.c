/*
 * cmd_data.c — the data commands: filter, scan and hist. They share one path: the options
 * of data_options (where the input is, how it is cut and sent, where output goes), then
 * run_data, which sends the input in pipelined chunks through libtally; each command adds
 * its own options and prints its own output.
 */
#include "cli_io.h"

#include <inttypes.h>
#include <string.h>

/* What the data commands share: where the input is, how to send it, where output goes. */
typedef struct {
    const char *cmd;
    const char *in;
    const char *out;
    bool text;
    bool no_seq;
    bool count_only; /* filter --count */
    bool have_range; /* hist --range */
    tally_run_opts_t opts;
    tally_req_t req;
} data_args_t;

enum {
    OPT_STREAM = CLI_OPT_FIRST,
    OPT_IN,
    OPT_OUT,
    OPT_TEXT,
    OPT_CHUNK,
    OPT_WINDOW,
    OPT_SHM,
    OPT_SEQ_BASE,
    OPT_NO_SEQ,
    OPT_TYPE,
    OPT_GT, /* the predicates, in tally_pred_t order */
    OPT_GE,
    OPT_LT,
    OPT_LE,
    OPT_EQ,
    OPT_NE,
    OPT_BETWEEN,
    OPT_STABLE,
    OPT_COUNT,
    OPT_EXCLUSIVE,
    OPT_OUT32,
    OPT_RANGE,
};

static const cli_option_t data_options[] = {
    {"stream", required_argument, OPT_STREAM, "NAME",
     "apply to stream NAME (1-64 printable ASCII bytes, no spaces)"},
    {"in", required_argument, OPT_IN, "FILE", "read input from FILE (default: stdin)"},
    {"text", no_argument, OPT_TEXT, NULL,
     "input is whitespace-separated decimal integers (default:\n"
     "binary, little-endian elements)"},
    {"out", required_argument, OPT_OUT, "FILE",
     "write the result to FILE in binary, as described above\n(default: text on stdout)"},
    {"chunk", required_argument, OPT_CHUNK, "SIZE",
     "send the input in chunks of SIZE bytes (K, M, G suffixes;\ndefault 1M)"},
    {"window", required_argument, OPT_WINDOW, "N", "keep N chunks in flight (1-256, default 8)"},
    {"shm", no_argument, OPT_SHM, NULL,
     "pass the chunks through shared memory (tallyd on this host;\nthe same output)"},
    {"seq-base", required_argument, OPT_SEQ_BASE, "N",
     "with --stream: continue a push that stopped; N is the seq\n"
     "base it printed (chunks the stream already has are skipped)"},
    {"no-seq", no_argument, OPT_NO_SEQ, NULL,
     "with --stream: send chunks without sequence numbers (several\n"
     "producers on one stream); a resent chunk is then applied twice"},
    {0},
};

/* Handles an option every data command takes; 1 if `id` is not one of them. */
static int data_option(data_args_t *a, int id, const char *arg)
{
    int64_t v;
    int rc;
    switch (id) {
    case OPT_STREAM:
        if (tally_req_set_stream(&a->req, arg) != TALLY_OK)
            return cli_usage_error(
                a->cmd, "invalid stream name '%s': 1-64 printable ASCII bytes, no spaces", arg);
        return 0;
    case OPT_IN:
        a->in = arg;
        return 0;
    case OPT_OUT:
        a->out = arg;
        return 0;
    case OPT_TEXT:
        a->text = true;
        return 0;
    case OPT_CHUNK:
        return cli_option_size(a->cmd, "--chunk", arg, 1, &a->opts.chunk_bytes);
    case OPT_SHM:
        a->opts.shm = 1;
        return 0;
    case OPT_WINDOW:
        if ((rc = cli_option_i64(a->cmd, "--window", arg, 1, TALLY_MAX_WINDOW, &v)) == 0)
            a->opts.window = (unsigned)v;
        return rc;
    case OPT_SEQ_BASE:
        if ((rc = cli_option_i64(a->cmd, "--seq-base", arg, 0, INT64_MAX, &v)) == 0) {
            a->opts.seq = TALLY_RUN_SEQ_RESUME;
            a->opts.seq_base = (uint64_t)v;
        }
        return rc;
    case OPT_NO_SEQ:
        a->no_seq = true;
        return 0;
    default:
        return 1;
    }
}

/* A push on a stream numbers its chunks (PROTOCOL.md, "Sequence numbers"), so a chunk is never
 * applied twice, whatever happens to tallyd meanwhile; --no-seq turns that off. */
static int check_sequencing(data_args_t *a)
{
    if (a->no_seq && a->opts.seq == TALLY_RUN_SEQ_RESUME)
        return cli_usage_error(a->cmd, "--seq-base and --no-seq exclude each other");
    if (!a->req.stream_len && a->opts.seq == TALLY_RUN_SEQ_RESUME)
        return cli_usage_error(a->cmd, "--seq-base needs --stream");
    if (a->req.stream_len && !a->no_seq && a->opts.seq == TALLY_RUN_SEQ_OFF)
        a->opts.seq = TALLY_RUN_SEQ_APPEND;
    return 0;
}

/* After a sequenced push stopped: which chunks the stream holds, and how to continue. */
static void report_stopped(const data_args_t *a, const tally_run_result_t *res)
{
    if (a->opts.seq == TALLY_RUN_SEQ_OFF || res->input_chunks == 0)
        return; /* not sequenced, or it stopped before sending anything */
    cli_error("%s: stopped: %s%" PRIu64 " of %" PRIu64
              " chunks applied (stream '%s' is at seq %" PRIu64
              ", this input's chunks are seq %" PRIu64 "..%" PRIu64
              ")%s; re-run with --seq-base %" PRIu64 " to continue",
              a->cmd, res->applied_known ? "" : "at least ", res->applied, res->input_chunks,
              a->req.stream, res->last_seq, res->seq_base + 1, res->seq_base + res->input_chunks,
              res->applied_known ? "" : " (tallyd could not be asked)", res->seq_base);
}

/* Turns the raw input into elements: --text parsed into `parsed`, binary checked for whole
 * elements. 0 or an exit status. */
static int input_elements(data_args_t *a, input_t *raw, tally_buf_t *parsed, input_t *input)
{
    *input = *raw;
    if (a->text) {
        int rc = parse_text(raw, (tally_dtype_t)a->req.dtype, parsed);
        if (rc)
            return rc;
        input->data = parsed->data;
        input->len = parsed->len;
    }
    size_t esize = tally_dtype_size((tally_dtype_t)a->req.dtype);
    if (input->len % esize) {
        cli_error("%s: input is %zu bytes, not a whole number of %zu-byte %s elements", a->cmd,
                  input->len, esize, tally_dtype_name((tally_dtype_t)a->req.dtype));
        return EXIT_USAGE;
    }
    return 0;
}

/* Reads the input, runs the request over it in chunks, and leaves the result in `out`. */
static int run_data(cli_t *cli, data_args_t *a, tally_buf_t *out, tally_run_result_t *res)
{
    input_t raw = {0}, input;
    tally_buf_t parsed = {0};
    tally_client_t *client = NULL;
    int rc = check_sequencing(a);
    if (rc || (rc = read_input(a->in, &raw)) != 0)
        goto out;
    if ((rc = input_elements(a, &raw, &parsed, &input)) != 0)
        goto out;
    if ((rc = cli_connect(cli, &client)) != 0)
        goto out;
    tally_status_t status = tally_run(client, &a->req, input.data, input.len, &a->opts, out, res);
    if (status != TALLY_OK) {
        rc = cli_report(status, a->cmd, res->error);
        report_stopped(a, res);
    }
out:
    tally_client_destroy(&client);
    input_free(&raw);
    tally_buf_free(&parsed);
    return rc;
}

/* Parses the command line, runs the input, and hands the output to `print` (text on stdout)
 * or writes it to --out. */
static int data_command(cli_t *cli, const cli_command_t *cmd, data_args_t *a, int argc, char **argv,
                        void (*print)(const data_args_t *, const tally_buf_t *,
                                      const tally_run_result_t *))
{
    int rc = cli_parse(cli, cmd, a, argc, argv);
    if (rc)
        return rc == CLI_HELP_SHOWN ? 0 : rc;
    if (a->req.opcode == TALLY_OP_FILTER && !a->req.pred)
        return cli_usage_error(a->cmd, "a predicate is required (--gt N, ..., --between LO HI)");
    if (a->req.opcode == TALLY_OP_HIST && a->req.dtype == TALLY_DTYPE_I32 && !a->have_range)
        return cli_usage_error(a->cmd, "--type i32 needs --range LO HI");
    if (a->req.opcode == TALLY_OP_HIST && a->req.dtype == TALLY_DTYPE_U8 && a->have_range)
        return cli_usage_error(a->cmd, "--range applies to --type i32 only");
    tally_buf_t out = {0};
    tally_run_result_t res;
    rc = run_data(cli, a, &out, &res);
    if (!rc && a->out && !a->count_only) {
        rc = write_binary(a->out, &out);
    } else if (!rc) {
        print(a, &out, &res);
        rc = cli_finish_stdout();
    }
    tally_buf_free(&out);
    return rc;
}

/* ---- filter ------------------------------------------------------------------------------- */

static const cli_option_t filter_predicates[] = {
    {"gt", required_argument, OPT_GT, "N", "keep x > N"},
    {"ge", required_argument, OPT_GE, "N", "keep x >= N"},
    {"lt", required_argument, OPT_LT, "N", "keep x < N"},
    {"le", required_argument, OPT_LE, "N", "keep x <= N"},
    {"eq", required_argument, OPT_EQ, "N", "keep x == N"},
    {"ne", required_argument, OPT_NE, "N", "keep x != N"},
    {"between", required_argument, OPT_BETWEEN, "LO HI", "keep LO <= x <= HI"},
    {0},
};

static const cli_option_t filter_options[] = {
    {"stable", no_argument, OPT_STABLE, NULL,
     "keep input order inside each chunk (default: unordered,\n"
     "faster; chunks are always put back in input order)"},
    {"type", required_argument, OPT_TYPE, "T", "element type: i32 (default) or u8"},
    {"count", no_argument, OPT_COUNT, NULL, "print only the number kept"},
    {0},
};

static const cli_group_t filter_groups[] = {
    {"Predicate (exactly one)", filter_predicates},
    {"Options", filter_options},
    {"Input and output", data_options},
    {0},
};

static int filter_predicate(data_args_t *a, int id, const char *arg, int argc, char **argv)
{
    if (a->req.pred)
        return cli_usage_error(a->cmd, "give exactly one predicate");
    if (!cli_parse_i64(arg, INT64_MIN, INT64_MAX, &a->req.lo))
        return cli_usage_error(a->cmd, "'%s' is not an integer", arg);
    a->req.pred = (uint8_t)(TALLY_PRED_GT + (id - OPT_GT));
    if (id != OPT_BETWEEN)
        return 0;
    if (optind >= argc || !cli_parse_i64(argv[optind], INT64_MIN, INT64_MAX, &a->req.hi))
        return cli_usage_error(a->cmd, "--between needs two integers LO HI");
    optind++;
    if (a->req.lo > a->req.hi)
        return cli_usage_error(a->cmd, "--between: LO must be <= HI");
    return 0;
}

static int filter_option(void *ctx, int id, const char *arg, int argc, char **argv)
{
    data_args_t *a = ctx;
    tally_dtype_t dtype;
    int rc = data_option(a, id, arg);
    if (rc != 1)
        return rc;
    switch (id) {
    case OPT_STABLE:
        a->req.flags |= TALLY_FLAG_FILTER_STABLE;
        return 0;
    case OPT_TYPE:
        if (!cli_parse_dtype(arg, &dtype))
            return cli_usage_error(a->cmd, "--type: '%s' is not i32 or u8", arg);
        a->req.dtype = (uint8_t)dtype;
        return 0;
    case OPT_COUNT:
        a->count_only = true;
        return 0;
    default:
        return filter_predicate(a, id, arg, argc, argv);
    }
}

static void filter_print(const data_args_t *a, const tally_buf_t *out,
                         const tally_run_result_t *res)
{
    size_t esize = tally_dtype_size((tally_dtype_t)a->req.dtype);
    if (a->count_only)
        printf("%" PRIu64 "\n", res->count);
    else
        print_values(out->data, out->len / esize, esize);
}

static int run_filter(cli_t *cli, int argc, char **argv)
{
    data_args_t a = {.cmd = "filter"};
    a.req.opcode = TALLY_OP_FILTER;
    a.req.dtype = TALLY_DTYPE_I32;
    return data_command(cli, &cli_cmd_filter, &a, argc, argv, filter_print);
}

const cli_command_t cli_cmd_filter = {
    .name = "filter",
    .summary = "keep the elements that satisfy a predicate",
    .usage = "filter PREDICATE [--stable] [--type i32|u8] [--count] [OPTIONS]",
    .about = "Keep the elements that satisfy PREDICATE and print them, one per line. --out\n"
             "writes them as binary elements of the input type.\n",
    .groups = filter_groups,
    .option = filter_option,
    .run = run_filter,
};

/* ---- scan --------------------------------------------------------------------------------- */

static const cli_option_t scan_options[] = {
    {"exclusive", no_argument, OPT_EXCLUSIVE, NULL,
     "exclusive sums (element i excluded; the first sum is the\ncarry-in)"},
    {"out32", no_argument, OPT_OUT32, NULL, "int32 sums wrapping modulo 2^32 (default: int64)"},
    {0},
};

static const cli_group_t scan_groups[] = {
    {"Options", scan_options},
    {"Input and output", data_options},
    {0},
};

static int scan_option(void *ctx, int id, const char *arg, int argc, char **argv)
{
    (void)argc, (void)argv;
    data_args_t *a = ctx;
    int rc = data_option(a, id, arg);
    if (rc != 1)
        return rc;
    a->req.flags |= id == OPT_EXCLUSIVE ? TALLY_FLAG_SCAN_EXCLUSIVE : TALLY_FLAG_SCAN_OUT_I32;
    return 0;
}

static void scan_print(const data_args_t *a, const tally_buf_t *out, const tally_run_result_t *res)
{
    (void)res;
    size_t size = (a->req.flags & TALLY_FLAG_SCAN_OUT_I32) ? 4 : 8;
    print_values(out->data, out->len / size, size);
}

static int run_scan(cli_t *cli, int argc, char **argv)
{
    data_args_t a = {.cmd = "scan"};
    a.req.opcode = TALLY_OP_SCAN;
    a.req.dtype = TALLY_DTYPE_I32;
    return data_command(cli, &cli_cmd_scan, &a, argc, argv, scan_print);
}

const cli_command_t cli_cmd_scan = {
    .name = "scan",
    .summary = "prefix sums of int32 input",
    .usage = "scan [--exclusive] [--out32] [OPTIONS]",
    .about = "Prefix sums of int32 input, printed one per line (--out: binary int64, or int32\n"
             "with --out32). With --stream the sums continue from the stream's running total,\n"
             "so an array sent in pieces gets the sums it would get whole.\n",
    .groups = scan_groups,
    .option = scan_option,
    .run = run_scan,
};

/* ---- hist --------------------------------------------------------------------------------- */

static const cli_option_t hist_options[] = {
    {"type", required_argument, OPT_TYPE, "T", "element type: u8 (default) or i32"},
    {"range", required_argument, OPT_RANGE, "LO HI",
     "the i32 histogram's range [LO, HI) (required for i32)"},
    {0},
};

static const cli_group_t hist_groups[] = {
    {"Options", hist_options},
    {"Input and output", data_options},
    {0},
};

static int hist_option(void *ctx, int id, const char *arg, int argc, char **argv)
{
    data_args_t *a = ctx;
    tally_dtype_t dtype;
    int rc = data_option(a, id, arg);
    if (rc != 1)
        return rc;
    if (id == OPT_TYPE) {
        if (!cli_parse_dtype(arg, &dtype))
            return cli_usage_error(a->cmd, "--type: '%s' is not u8 or i32", arg);
        a->req.dtype = (uint8_t)dtype;
        return 0;
    }
    const int64_t min = INT32_MIN, max = (int64_t)INT32_MAX + 1;
    if (!cli_parse_i64(arg, min, max, &a->req.lo) || optind >= argc ||
        !cli_parse_i64(argv[optind], min, max, &a->req.hi))
        return cli_usage_error(
            a->cmd, "--range needs two integers LO HI in [%" PRId64 ", %" PRId64 "]", min, max);
    optind++;
    if (a->req.lo >= a->req.hi)
        return cli_usage_error(a->cmd, "--range: LO must be < HI");
    a->have_range = true;
    return 0;
}

static void hist_print(const data_args_t *a, const tally_buf_t *out, const tally_run_result_t *res)
{
    (void)res;
    for (unsigned i = 0; i < TALLY_HIST_BINS; i++)
        printf("%u %" PRIu64 "\n", i, tally_get_u64(out->data + 8 * i));
    if (a->req.dtype == TALLY_DTYPE_I32) {
        printf("underflow %" PRIu64 "\n", tally_get_u64(out->data + 8 * TALLY_HIST_BINS));
        printf("overflow %" PRIu64 "\n", tally_get_u64(out->data + 8 * (TALLY_HIST_BINS + 1)));
    }
}

static int run_hist(cli_t *cli, int argc, char **argv)
{
    data_args_t a = {.cmd = "hist"};
    a.req.opcode = TALLY_OP_HIST;
    a.req.dtype = TALLY_DTYPE_U8;
    return data_command(cli, &cli_cmd_hist, &a, argc, argv, hist_print);
}

const cli_command_t cli_cmd_hist = {
    .name = "hist",
    .summary = "256-bin histogram of u8 or i32 input",
    .usage = "hist [--type u8|i32] [--range LO HI] [OPTIONS]",
    .about = "Histogram of this input in 256 bins, printed as 'bin count' lines (bins 0..255).\n"
             "u8: one bin per byte value. i32: 256 even bins over [LO, HI) plus 'underflow N'\n"
             "and 'overflow N' lines; x in [LO, HI) goes to bin (x - LO) * 256 / (HI - LO).\n"
             "With --stream the counts are also added to the stream's running histogram (see\n"
             "'tally query'). --out writes the counts as binary uint64: 256 for u8, 258 for\n"
             "i32 (the bins, then underflow and overflow).\n",
    .groups = hist_groups,
    .option = hist_option,
    .run = run_hist,
};
