/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cmd_data.c — the data commands: filter, scan, hist and minmax. They share one path: the
 * options of data_options (where the input is, how it is cut and sent, where output goes), then
 * cli_push (cli_push.c), which streams the input in pipelined chunks through libtally and
 * prints the output as it comes; each command adds its own options.
 */
#include "cli_push.h"
#include "tally_ops.h"

#include <inttypes.h>
#include <string.h>

enum {
    OPT_STREAM = CLI_OPT_FIRST,
    OPT_IN,
    OPT_OUT,
    OPT_TEXT,
    OPT_CHUNK,
    OPT_WINDOW,
    OPT_SHM,
    OPT_GPU_REGION,
    OPT_SEQ_BASE,
    OPT_NO_SEQ,
    OPT_RESUME,
    OPT_FRAMES,
    OPT_BINARY,
    OPT_PROGRESS,
    OPT_NO_PROGRESS,
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
    {"in", OPT_IN, "FILE", "read input from FILE (default: stdin)"},
    {"text", OPT_TEXT, NULL,
     "input is whitespace-separated decimal integers (default:\n"
     "binary, little-endian elements)"},
    {"binary", OPT_BINARY, NULL,
     "send binary input even when it looks like decimal text\n"
     "(which is refused without --text or --binary)"},
    {"frames", OPT_FRAMES, "SIZE",
     "the input is frames of SIZE bytes: every chunk holds whole\n"
     "frames (as many as fit in --chunk, at least one)"},
    {"out", OPT_OUT, "FILE",
     "write the result to FILE in binary, as described above\n(default: text on stdout)"},
    {"chunk", OPT_CHUNK, "SIZE",
     "send the input in chunks of SIZE bytes (K, M, G suffixes;\n"
     "default 1M; at most the daemon's max_batch, from info)"},
    {"window", OPT_WINDOW, "N", "keep N chunks in flight (1-256, default 8)"},
    {"progress", OPT_PROGRESS, NULL,
     "show a progress line on stderr (default: only when stdout\n"
     "and stderr are terminals)"},
    {"no-progress", OPT_NO_PROGRESS, NULL, "never show the progress line"},
    {0},
};

/* The operations that take a shared-memory reference (TALLY_FLAG_SHM_REF in their row). */
static const cli_option_t shm_options[] = {
    {"shm", OPT_SHM, NULL,
     "pass the chunks through shared memory (tallyd on this host;\nthe same output)"},
    {"gpu-region", OPT_GPU_REGION, NULL,
     "pass the chunks through GPU memory registered as a device\n"
     "region (GPU 0, CUDA_VISIBLE_DEVICES; tallyd on this host\n"
     "with that GPU): copied to the GPU, sent by reference, filter\n"
     "and scan output written there by tallyd; the same output"},
    {0},
};

/* The operations that take a stream (their row's stream rule is not TALLY_STREAM_NONE). */
static const cli_option_t stream_options[] = {
    {"stream", OPT_STREAM, "NAME", "apply to stream NAME (1-64 printable ASCII bytes, no spaces)"},
    {"resume", OPT_RESUME, NULL,
     "with --stream: continue this stream's push that stopped\n"
     "(Ctrl-C, a failure): the chunks the stream has are skipped"},
    {"seq-base", OPT_SEQ_BASE, "N",
     "with --stream: continue a push that stopped; N is the seq\n"
     "base it printed (chunks the stream already has are skipped)"},
    {"no-seq", OPT_NO_SEQ, NULL,
     "with --stream: send chunks without sequence numbers (several\n"
     "producers on one stream); a resent chunk is then applied twice"},
    {0},
};

/* The groups every data command ends with; its operation's row decides which are its own
 * (cli_group_applies): minmax, which takes neither a stream nor a reference, has only the
 * first. */
/* clang-format off */
#define DATA_GROUPS                                                                                \
    {"Input and output", data_options, 0},                                                         \
    {"Stream", stream_options, CLI_NEEDS_STREAM},                                                  \
    {"Shared memory", shm_options, CLI_NEEDS_SHM_REF}
/* clang-format on */

/* The options of the data commands that only set a field (--count is filter's). */
static const cli_setter_t data_setters[] = {
    CLI_SET_ARG(OPT_IN, data_args_t, in),
    CLI_SET_ARG(OPT_OUT, data_args_t, out),
    CLI_SET_TRUE(OPT_TEXT, data_args_t, text),
    CLI_SET_TRUE(OPT_BINARY, data_args_t, binary),
    CLI_SET_INT(OPT_SHM, data_args_t, opts.shm, TALLY_RUN_SHM_HOST),
    CLI_SET_INT(OPT_GPU_REGION, data_args_t, opts.shm, TALLY_RUN_SHM_GPU),
    CLI_SET_TRUE(OPT_NO_SEQ, data_args_t, no_seq),
    CLI_SET_TRUE(OPT_RESUME, data_args_t, resume),
    CLI_SET_INT(OPT_PROGRESS, data_args_t, progress, 1),
    CLI_SET_INT(OPT_NO_PROGRESS, data_args_t, progress, 0),
    CLI_SET_TRUE(OPT_COUNT, data_args_t, count_only),
    {0},
};

static int filter_predicate(data_args_t *a, int id, const char *arg, int argc, char **argv);
static int hist_range(data_args_t *a, const char *arg, int argc, char **argv);
static int type_option(data_args_t *a, const char *arg);

/* The option handler of every data command: getopt only returns the options of the command's
 * own groups, so one switch serves filter, scan and hist. */
static int data_option(void *ctx, int id, const char *arg, int argc, char **argv)
{
    data_args_t *a = ctx;
    int64_t v;
    int rc;
    switch (id) {
    case OPT_STREAM:
        if (tally_req_set_stream(&a->req, arg) != TALLY_OK)
            return cli_usage_error(
                a->cmd, "invalid stream name '%s': 1-64 printable ASCII bytes, no spaces", arg);
        return 0;
    case OPT_CHUNK:
        a->chunk_arg = arg;
        return cli_option_size(a->cmd, "--chunk", arg, 1, &a->opts.chunk_bytes);
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
    case OPT_FRAMES:
        return cli_option_size(a->cmd, "--frames", arg, 1, &a->frame);
    case OPT_TYPE:
        return type_option(a, arg);
    case OPT_STABLE:
        a->req.flags |= TALLY_FLAG_FILTER_STABLE;
        return 0;
    case OPT_EXCLUSIVE:
        a->req.flags |= TALLY_FLAG_SCAN_EXCLUSIVE;
        return 0;
    case OPT_OUT32:
        a->req.flags |= TALLY_FLAG_SCAN_OUT_I32;
        return 0;
    case OPT_RANGE:
        return hist_range(a, arg, argc, argv);
    default:
        return filter_predicate(a, id, arg, argc, argv);
    }
}

/* hist: i32 and u16 need --range (within the type), the byte types take none. */
static int hist_check_range(const data_args_t *a)
{
    const char *type = cli_dtype_name(a->req.dtype);
    bool ranged = tally_hist_ranged(a->req.dtype);
    if (ranged && !a->have_range)
        return cli_usage_error(a->cmd, "--type %s needs --range LO HI", type);
    if (!ranged && a->have_range)
        return cli_usage_error(a->cmd, "--range applies to --type i32 and u16 only");
    if (a->req.dtype == TALLY_DTYPE_U16 && (a->req.lo < 0 || a->req.hi > UINT16_MAX + 1))
        return cli_usage_error(a->cmd, "--range: a u16 range is within [0, 65536]");
    return 0;
}

/* Parses the command line, checks what the options say together, and runs the push. */
static int run_data(cli_t *cli, const cli_command_t *cmd, int argc, char **argv)
{
    data_args_t args = {.cmd = cmd->name, .progress = -1}, *a = &args;
    a->req.opcode = (uint8_t)cmd->op;
    a->req.dtype = (uint8_t)cmd->dtype;
    int rc = cli_parse(cli, cmd, a, argc, argv);
    if (rc)
        return rc;
    if (a->req.opcode == TALLY_OP_FILTER && !a->req.pred)
        return cli_usage_error(a->cmd, "a predicate is required (--gt N, ..., --between LO HI)");
    if (a->req.opcode == TALLY_OP_HIST && (rc = hist_check_range(a)) != 0)
        return rc;
    size_t esize = tally_dtype_size((tally_dtype_t)a->req.dtype);
    if (a->frame && a->frame % esize)
        return cli_usage_error(a->cmd, "--frames: %zu bytes is not a whole number of %zu-byte %s",
                               a->frame, esize, cli_dtype_name(a->req.dtype));
    if (a->frame && a->text)
        return cli_usage_error(a->cmd, "--frames applies to binary input, not --text");
    return cli_push(cli, a);
}

/* ---- filter ------------------------------------------------------------------------------- */

static const cli_option_t filter_predicates[] = {
    {"gt", OPT_GT, "N", "keep x > N"},
    {"ge", OPT_GE, "N", "keep x >= N"},
    {"lt", OPT_LT, "N", "keep x < N"},
    {"le", OPT_LE, "N", "keep x <= N"},
    {"eq", OPT_EQ, "N", "keep x == N"},
    {"ne", OPT_NE, "N", "keep x != N"},
    {"between", OPT_BETWEEN, "LO HI", "keep LO <= x <= HI"},
    {0},
};

static const cli_option_t filter_options[] = {
    {"stable", OPT_STABLE, NULL,
     "keep input order inside each chunk (default: unordered,\n"
     "faster; chunks are always put back in input order)"},
    {"type", OPT_TYPE, "T", "element type: i32 (default) or u8"},
    {"count", OPT_COUNT, NULL, "print only the number kept"},
    {0},
};

static const cli_group_t filter_groups[] = {
    {"Predicate (exactly one)", filter_predicates, 0},
    {"Options", filter_options, 0},
    DATA_GROUPS,
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

CLI_COMMAND(filter, .usage = "filter PREDICATE [--stable] [--type i32|u8] [--count] [OPTIONS]",
            .about =
                "Keep the elements that satisfy PREDICATE and print them, one per line. --out\n"
                "writes them as binary elements of the input type.\n",
            .op = TALLY_OP_FILTER, .dtype = TALLY_DTYPE_I32, .groups = filter_groups,
            .setters = data_setters, .option = data_option, .run = run_data);

/* ---- scan --------------------------------------------------------------------------------- */

static const cli_option_t scan_options[] = {
    {"exclusive", OPT_EXCLUSIVE, NULL,
     "exclusive sums (element i excluded; the first sum is the\ncarry-in)"},
    {"out32", OPT_OUT32, NULL, "int32 sums wrapping modulo 2^32 (default: int64)"},
    {0},
};

static const cli_group_t scan_groups[] = {
    {"Options", scan_options, 0},
    DATA_GROUPS,
    {0},
};

CLI_COMMAND(scan, .usage = "scan [--exclusive] [--out32] [OPTIONS]",
            .about =
                "Prefix sums of int32 input, printed one per line (--out: binary int64, or int32\n"
                "with --out32). With --stream the sums continue from the stream's running total,\n"
                "so an array sent in pieces gets the sums it would get whole.\n",
            .op = TALLY_OP_SCAN, .dtype = TALLY_DTYPE_I32, .groups = scan_groups,
            .setters = data_setters, .option = data_option, .run = run_data);

/* ---- hist --------------------------------------------------------------------------------- */

static const cli_option_t hist_options[] = {
    {"type", OPT_TYPE, "T",
     "element type: u8 (default), i32, u16 (12- and 16-bit\nsensors), rgb or rgba "
     "(interleaved 8-bit pixels,\none histogram per channel)"},
    {"range", OPT_RANGE, "LO HI",
     "the range [LO, HI) of i32 and u16 histograms (required\nfor them; u16 within [0, 65536])"},
    {0},
};

static const cli_group_t hist_groups[] = {
    {"Options", hist_options, 0},
    DATA_GROUPS,
    {0},
};

/* --type: a dtype (cli_parse_dtype) that the operation's row lists. */
static int type_option(data_args_t *a, const char *arg)
{
    tally_dtype_t dtype;
    if (!cli_parse_dtype(arg, &dtype) || !tally_op_takes_dtype(a->req.opcode, dtype)) {
        char takes[64];
        return cli_usage_error(
            a->cmd, "--type: '%s' is not %s", arg,
            tally_op_dtypes_named(a->req.opcode, cli_dtype_name, takes, sizeof takes));
    }
    a->req.dtype = (uint8_t)dtype;
    return 0;
}

/* --range LO HI (hist). */
static int hist_range(data_args_t *a, const char *arg, int argc, char **argv)
{
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

CLI_COMMAND(hist, .usage = "hist [--type u8|i32|u16|rgb|rgba] [--range LO HI] [OPTIONS]",
            .about =
                "Histogram of this input in 256 bins, printed as 'bin count' lines (bins 0..255).\n"
                "u8: one bin per byte value. i32 and u16: 256 even bins over [LO, HI) plus\n"
                "'underflow N' and 'overflow N' lines; x in [LO, HI) goes to bin\n"
                "(x - LO) * 256 / (HI - LO). rgb and rgba: interleaved 8-bit pixels (R,G,B or\n"
                "R,G,B,A; --text: one byte a token), one byte histogram per channel, printed as\n"
                "'CHANNEL bin count' lines (r, g, b, then a). With --stream the counts are also\n"
                "added to the stream's running histogram (see 'tally query'). --out writes the\n"
                "counts as binary uint64: 256 for u8, 258 for i32 and u16 (the bins, then\n"
                "underflow and overflow), 768 for rgb and 1024 for rgba (256 per channel).\n",
            .op = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8, .groups = hist_groups,
            .setters = data_setters, .option = data_option, .run = run_data);

/* ---- minmax ------------------------------------------------------------------------------- */

static const cli_option_t minmax_options[] = {
    {"type", OPT_TYPE, "T", "element type: i32 (default), u8 or u16"},
    {0},
};

static const cli_group_t minmax_groups[] = {
    {"Options", minmax_options, 0},
    DATA_GROUPS,
    {0},
};

CLI_COMMAND(minmax, .usage = "minmax [--type i32|u8|u16] [OPTIONS]",
            .about = "The smallest and the largest value of the input, printed as 'min N' and\n"
                     "'max N' lines (nothing for an empty input). --out writes the two values as\n"
                     "binary elements of the input type. It keeps no stream state and takes no\n"
                     "shared memory: the options of those are not its own.\n",
            .op = TALLY_OP_MINMAX, .dtype = TALLY_DTYPE_I32, .groups = minmax_groups,
            .setters = data_setters, .option = data_option, .run = run_data);
