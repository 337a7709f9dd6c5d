/*
 * tally_cli.c — the `tally` command: tallyd from the shell, built on libtally.
 *
 *   tally [-e ENDPOINT] [-t TIMEOUT_MS] COMMAND [OPTIONS] [ARGS]
 *
 * Each command is a function with its own getopt_long table and --help text. The data
 * commands (filter, scan, hist) share one path: read the whole input (a file or stdin,
 * binary little-endian elements or --text integers), hand it to tally_run, which chunks and
 * pipelines it, then write the output as text (one value per line) or --out binary.
 *
 * Exit status, one meaning each so scripts can tell failures apart:
 *   0 success; 1 the daemon replied with an error; 2 usage or input error (bad option, bad
 *   number, unreadable file, a --text token out of range); 3 no usable reply (timeout,
 *   transport failure, undecodable reply). Every error prints one line on stderr, "tally: ...";
 *   a push with sequence numbers that stopped adds a second, naming what the stream holds.
 */
#include "tally.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

enum { EXIT_DAEMON = 1, EXIT_USAGE = 2, EXIT_TRANSPORT = 3 };
enum { OPT_SERVER_KEY = 1000, OPT_CLIENT_KEY }; /* long-only options before the command */

typedef struct {
    const char *endpoint;
    int timeout_ms;
    const char *server_key; /* --server-key: tallyd's CURVE public key or .pub file, or NULL */
    const char *client_key; /* --client-key: this client's key file, or NULL */
} cli_t;

static void errorf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void errorf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("tally: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* Reports a failed library call and maps its status to the exit code. */
static int report(tally_status_t status, const char *what, const char *detail)
{
    if (!detail || !*detail)
        detail = tally_status_text(status);
    errorf("%s: %s: %s", what, tally_status_name(status), detail);
    if (status == TALLY_E_TIMEOUT || status == TALLY_E_TRANSPORT || status == TALLY_E_REPLY)
        return EXIT_TRANSPORT;
    if (status == TALLY_E_ARG || status == TALLY_E_IO)
        return EXIT_USAGE;
    return EXIT_DAEMON;
}

static int usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int parse_timeout(const char *cmd, const char *arg, int *out);
static int usage_error(const char *cmd, const char *fmt, ...)
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

static int connect_client(const cli_t *cli, tally_client_t **client)
{
    /* CURVE keys: --server-key/--client-key, else TALLY_SERVER_KEY/TALLY_CLIENT_KEY, else
     * ~/.config/tally/tally.conf; none anywhere: a plain connection. */
    tally_curve_keys_t keys;
    char why[512];
    tally_status_t status =
        tally_curve_keys_load(cli->server_key, cli->client_key, &keys, why, sizeof why);
    if (status != TALLY_OK) {
        errorf("CURVE keys: %s", why);
        return EXIT_USAGE;
    }
    status = tally_client_new_curve(cli->endpoint, cli->timeout_ms, &keys, client);
    explicit_bzero(&keys, sizeof keys);
    if (status == TALLY_OK)
        return 0;
    if (status == TALLY_E_ARG) {
        errorf("invalid endpoint '%s'", cli->endpoint);
        return EXIT_USAGE;
    }
    return report(status, "connect", NULL);
}

/* ---- Number parsing ----------------------------------------------------------------------- */

/* A whole decimal integer in [min, max], nothing else (no trailing junk, no empty string). */
static bool parse_i64(const char *s, int64_t min, int64_t max, int64_t *out)
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

/* A byte count with an optional K, M or G suffix (powers of 1024). */
static bool parse_size(const char *s, size_t *out)
{
    char *end;
    errno = 0;
    if (!s || *s == '-')
        return false;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s)
        return false;
    unsigned shift = 0;
    if (*end == 'k' || *end == 'K')
        shift = 10;
    else if (*end == 'm' || *end == 'M')
        shift = 20;
    else if (*end == 'g' || *end == 'G')
        shift = 30;
    if (shift)
        end++;
    if (*end || v > (SIZE_MAX >> shift))
        return false;
    *out = (size_t)(v << shift);
    return true;
}

static bool parse_dtype(const char *s, tally_dtype_t *out)
{
    if (!strcmp(s, "i32"))
        *out = TALLY_DTYPE_I32;
    else if (!strcmp(s, "u8"))
        *out = TALLY_DTYPE_U8;
    else
        return false;
    return true;
}

/* Options every command takes: -e/-t (also accepted before the command) and getopt's
 * reports of unknown options and missing arguments (opterr is 0, so the messages are ours).
 * Returns 1 if `opt` was not one of them, 0 when handled, or an exit code. */
static int common_option(cli_t *cli, const char *cmd, int opt, char **argv)
{
    switch (opt) {
    case 'e':
        cli->endpoint = optarg;
        return 0;
    case 't':
        return parse_timeout(cmd, optarg, &cli->timeout_ms);
    case ':':
        return usage_error(cmd, "option '%s' needs an argument", argv[optind - 1]);
    case '?':
        if (optopt && optopt < 256)
            return usage_error(cmd, "unknown option '-%c'", optopt);
        return usage_error(cmd, "unknown option '%s'", argv[optind - 1]);
    default:
        return 1;
    }
}

static int parse_timeout(const char *cmd, const char *arg, int *out)
{
    int64_t v;
    if (!parse_i64(arg, 1, INT_MAX, &v))
        return usage_error(cmd, "--timeout: '%s' is not a positive number of ms", arg);
    *out = (int)v;
    return 0;
}

/* ---- Input and output --------------------------------------------------------------------- */

/* The whole input in memory: a regular file is mapped (no copy, however large), anything
 * else (a pipe, a terminal) is read into a buffer. */
typedef struct {
    const uint8_t *data;
    size_t len;
    void *map;
    tally_buf_t buf;
} input_t;

static void input_free(input_t *in)
{
    if (in->map)
        munmap(in->map, in->len);
    tally_buf_free(&in->buf);
    memset(in, 0, sizeof *in);
}

static tally_status_t read_fd(int fd, tally_buf_t *buf)
{
    for (;;) {
        if (tally_buf_reserve(buf, 1 << 16) != TALLY_OK)
            return TALLY_E_NOMEM;
        ssize_t n = read(fd, buf->data + buf->len, buf->cap - buf->len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return TALLY_E_IO;
        if (n == 0)
            return TALLY_OK;
        buf->len += (size_t)n;
    }
}

static int read_input(const char *path, input_t *in)
{
    bool use_stdin = !path || !strcmp(path, "-");
    const char *name = use_stdin ? "stdin" : path;
    int fd = use_stdin ? STDIN_FILENO : open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        errorf("cannot open '%s': %s", path, strerror(errno));
        return EXIT_USAGE;
    }
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
        void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map != MAP_FAILED) {
            in->map = map;
            in->data = map;
            in->len = (size_t)st.st_size;
            if (!use_stdin)
                close(fd);
            return 0;
        }
    }
    tally_status_t status = read_fd(fd, &in->buf);
    int saved = errno;
    if (!use_stdin)
        close(fd);
    if (status == TALLY_E_NOMEM) {
        errorf("out of memory reading '%s'", name);
        return EXIT_DAEMON;
    }
    if (status != TALLY_OK) {
        errorf("cannot read '%s': %s", name, strerror(saved));
        return EXIT_USAGE;
    }
    in->data = in->buf.data;
    in->len = in->buf.len;
    return 0;
}

static bool is_space(char c)
{
    return c == ' ' || (c >= '\t' && c <= '\r');
}

/* One --text token [s, end): 0 and *out when it is a decimal integer in [min, max], 1 when
 * it is not an integer, 2 when it is one out of range. */
static int parse_token(const char *s, const char *end, int64_t min, int64_t max, int64_t *out)
{
    bool neg = false;
    if (s < end && (*s == '+' || *s == '-'))
        neg = *s++ == '-';
    if (s == end)
        return 1;
    uint64_t mag = 0;
    bool huge = false;
    for (; s < end; s++) {
        if (*s < '0' || *s > '9')
            return 1;
        if (mag > UINT64_MAX / 10 - 1)
            huge = true;
        else
            mag = mag * 10 + (uint64_t)(*s - '0');
    }
    if (huge || (neg ? mag > (uint64_t)-min : mag > (uint64_t)max))
        return 2;
    *out = neg ? (int64_t)(0 - mag) : (int64_t)mag;
    return 0;
}

/* Turns whitespace-separated decimal integers into little-endian elements of `dtype`,
 * naming the first token that is not an integer of that type. */
static int parse_text(const input_t *text, tally_dtype_t dtype, tally_buf_t *out)
{
    int64_t min = dtype == TALLY_DTYPE_U8 ? 0 : INT32_MIN;
    int64_t max = dtype == TALLY_DTYPE_U8 ? UINT8_MAX : INT32_MAX;
    size_t esize = tally_dtype_size(dtype);
    /* Every token takes at least two bytes (digit and separator) except the last. */
    if (tally_buf_reserve(out, (text->len / 2 + 1) * esize) != TALLY_OK) {
        errorf("out of memory parsing --text input");
        return EXIT_DAEMON;
    }
    const char *p = (const char *)text->data, *end = p + text->len;
    size_t token = 0;
    for (;;) {
        while (p < end && is_space(*p))
            p++;
        if (p == end)
            return 0;
        const char *start = p;
        while (p < end && !is_space(*p))
            p++;
        token++;
        int64_t v;
        int bad = parse_token(start, p, min, max, &v);
        if (bad) {
            int shown = p - start > 40 ? 40 : (int)(p - start);
            const char *more = p - start > 40 ? "..." : "";
            if (memchr(start, '\0', (size_t)(p - start)))
                errorf("--text: token %zu contains a NUL byte (binary input? drop --text)", token);
            else if (bad == 1)
                errorf("--text: token %zu '%.*s%s' is not an integer", token, shown, start, more);
            else
                errorf("--text: token %zu '%.*s%s' is out of range for %s [%" PRId64 ", %" PRId64
                       "]",
                       token, shown, start, more, tally_dtype_name(dtype), min, max);
            return EXIT_USAGE;
        }
        if (esize == 1)
            out->data[out->len] = (uint8_t)v;
        else
            tally_put_u32(out->data + out->len, (uint32_t)v);
        out->len += esize;
    }
}

/* Formats v in decimal at dst (at most 20 bytes); returns the length. */
static size_t format_i64(char *dst, int64_t v)
{
    char digits[20];
    size_t n = 0, len = 0;
    uint64_t mag = v < 0 ? 0 - (uint64_t)v : (uint64_t)v;
    do {
        digits[n++] = (char)('0' + mag % 10);
        mag /= 10;
    } while (mag);
    if (v < 0)
        dst[len++] = '-';
    while (n)
        dst[len++] = digits[--n];
    return len;
}

/* Prints n little-endian integers, one per line: u8 (size 1), int32 (4) or int64 (8).
 * Formatting by hand into a block costs a fraction of printf per line, which matters for
 * outputs of hundreds of millions of values. */
static void print_values(const uint8_t *p, size_t n, size_t size)
{
    char block[1 << 16];
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        int64_t v = size == 1   ? p[i]
                    : size == 4 ? (int32_t)tally_get_u32(p + 4 * i)
                                : (int64_t)tally_get_u64(p + 8 * i);
        if (at > sizeof block - 24) {
            fwrite(block, 1, at, stdout);
            at = 0;
        }
        at += format_i64(block + at, v);
        block[at++] = '\n';
    }
    fwrite(block, 1, at, stdout);
}

static int write_binary(const char *path, const tally_buf_t *buf)
{
    bool use_stdout = !strcmp(path, "-");
    FILE *f = use_stdout ? stdout : fopen(path, "wb");
    if (!f) {
        errorf("cannot open '%s' for writing: %s", path, strerror(errno));
        return EXIT_USAGE;
    }
    bool ok = fwrite(buf->data, 1, buf->len, f) == buf->len;
    ok = (use_stdout ? fflush(f) : fclose(f)) == 0 && ok;
    if (!ok) {
        errorf("cannot write '%s': %s", path, strerror(errno));
        return EXIT_USAGE;
    }
    return 0;
}

static int finish_stdout(void)
{
    if (fflush(stdout) != 0 || ferror(stdout)) {
        errorf("cannot write to stdout: %s", strerror(errno));
        return EXIT_USAGE;
    }
    return 0;
}

/* ---- Data commands: filter, scan, hist ---------------------------------------------------- */

/* What the data commands share: where the input is, how to send it, where output goes. */
typedef struct {
    const char *cmd;
    const char *in;
    const char *out;
    bool text;
    bool no_seq;
    tally_run_opts_t opts;
    tally_req_t req;
} data_args_t;

enum {
    OPT_HELP = 'h',
    OPT_STREAM = 256,
    OPT_IN,
    OPT_OUT,
    OPT_TEXT,
    OPT_CHUNK,
    OPT_WINDOW,
    OPT_SHM,
    OPT_SEQ_BASE,
    OPT_NO_SEQ,
    OPT_TYPE,
    OPT_GT,
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

#define DATA_LONG_OPTIONS                                                                          \
    {"stream", required_argument, NULL, OPT_STREAM}, {"in", required_argument, NULL, OPT_IN},      \
        {"out", required_argument, NULL, OPT_OUT}, {"text", no_argument, NULL, OPT_TEXT},          \
        {"chunk", required_argument, NULL, OPT_CHUNK},                                             \
        {"window", required_argument, NULL, OPT_WINDOW}, {"help", no_argument, NULL, OPT_HELP},    \
        {"shm", no_argument, NULL, OPT_SHM}, {"seq-base", required_argument, NULL, OPT_SEQ_BASE},  \
        {"no-seq", no_argument, NULL, OPT_NO_SEQ}, {"endpoint", required_argument, NULL, 'e'},     \
    {                                                                                              \
        "timeout", required_argument, NULL, 't'                                                    \
    }

#define DATA_HELP                                                                                  \
    "  --stream NAME   apply to stream NAME (1-64 printable ASCII bytes, no spaces)\n"             \
    "  --in FILE       read input from FILE (default: stdin)\n"                                    \
    "  --text          input is whitespace-separated decimal integers (default: binary,\n"         \
    "                  little-endian elements)\n"                                                  \
    "  --out FILE      write the result to FILE as binary little-endian values\n"                  \
    "                  (default: text on stdout, one value per line)\n"                            \
    "  --chunk BYTES   send the input in chunks of BYTES (K/M/G suffixes; default 1M)\n"           \
    "  --window N      keep N chunks in flight (1-256, default 8)\n"                               \
    "  --shm           pass the chunks through shared memory (tallyd on this host; the same\n"     \
    "                  output)\n"                                                                  \
    "  --seq-base N    with --stream: continue a push that stopped; N is the seq base it\n"        \
    "                  printed (chunks the stream already has are skipped, not sent again)\n"      \
    "  --no-seq        with --stream: send chunks without sequence numbers (several\n"             \
    "                  producers on one stream); a resent chunk is then applied twice\n"           \
    "  -e, --endpoint E, -t, --timeout MS   as before the command\n"                               \
    "  -h, --help      show this help\n"

/* Handles an option every data command takes; returns 1 if `opt` was not one of them,
 * 0 when handled, or an exit code (> 1) on a usage error. */
static int data_option(data_args_t *a, int opt, const char *arg)
{
    int64_t v;
    switch (opt) {
    case OPT_STREAM:
        if (tally_req_set_stream(&a->req, arg) != TALLY_OK)
            return usage_error(
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
        if (!parse_size(arg, &a->opts.chunk_bytes) || a->opts.chunk_bytes == 0)
            return usage_error(a->cmd, "--chunk: '%s' is not a positive byte count", arg);
        return 0;
    case OPT_SHM:
        a->opts.shm = 1;
        return 0;
    case OPT_WINDOW:
        if (!parse_i64(arg, 1, TALLY_MAX_WINDOW, &v))
            return usage_error(a->cmd, "--window: '%s' is not a number in 1..%u", arg,
                               TALLY_MAX_WINDOW);
        a->opts.window = (unsigned)v;
        return 0;
    case OPT_SEQ_BASE:
        if (!parse_i64(arg, 0, INT64_MAX, &v))
            return usage_error(a->cmd, "--seq-base: '%s' is not a number >= 0", arg);
        a->opts.seq = TALLY_RUN_SEQ_RESUME;
        a->opts.seq_base = (uint64_t)v;
        return 0;
    case OPT_NO_SEQ:
        a->no_seq = true;
        return 0;
    default:
        return 1;
    }
}

/* A push on a stream numbers its chunks (PROTOCOL.md, "Sequence numbers"), so a chunk is never
 * applied twice, whatever happens to tallyd meanwhile; --no-seq turns that off. */
static int connect_sequenced(cli_t *cli, data_args_t *a, tally_client_t **client)
{
    if (a->no_seq && a->opts.seq == TALLY_RUN_SEQ_RESUME)
        return usage_error(a->cmd, "--seq-base and --no-seq exclude each other");
    if (!a->req.stream_len && a->opts.seq == TALLY_RUN_SEQ_RESUME)
        return usage_error(a->cmd, "--seq-base needs --stream");
    if (a->req.stream_len && !a->no_seq && a->opts.seq == TALLY_RUN_SEQ_OFF)
        a->opts.seq = TALLY_RUN_SEQ_APPEND;
    return connect_client(cli, client);
}

/* After a sequenced push stopped: which chunks the stream holds, and how to continue. */
static void report_stopped(const data_args_t *a, const tally_run_result_t *res)
{
    if (a->opts.seq == TALLY_RUN_SEQ_OFF || res->input_chunks == 0)
        return; /* not sequenced, or it stopped before sending anything */
    errorf("%s: stopped: %s%" PRIu64 " of %" PRIu64
           " chunks applied (stream '%s' is at seq %" PRIu64
           ", this input's chunks are seq %" PRIu64 "..%" PRIu64
           ")%s; re-run with --seq-base %" PRIu64 " to continue",
           a->cmd, res->applied_known ? "" : "at least ", res->applied, res->input_chunks,
           a->req.stream, res->last_seq, res->seq_base + 1, res->seq_base + res->input_chunks,
           res->applied_known ? "" : " (tallyd could not be asked)", res->seq_base);
}

/* Reads the input, runs the request over it in chunks, and leaves the result in `out`. */
static int run_data(cli_t *cli, data_args_t *a, tally_buf_t *out, tally_run_result_t *res)
{
    input_t raw = {0};
    tally_buf_t parsed = {0};
    tally_client_t *client = NULL;
    int rc = read_input(a->in, &raw);
    if (rc)
        goto out;
    input_t *input = &raw, text_input = {0};
    if (a->text) {
        rc = parse_text(&raw, (tally_dtype_t)a->req.dtype, &parsed);
        if (rc)
            goto out;
        text_input.data = parsed.data;
        text_input.len = parsed.len;
        input = &text_input;
    }
    size_t esize = tally_dtype_size((tally_dtype_t)a->req.dtype);
    if (input->len % esize) {
        errorf("%s: input is %zu bytes, not a whole number of %zu-byte %s elements", a->cmd,
               input->len, esize, tally_dtype_name((tally_dtype_t)a->req.dtype));
        rc = EXIT_USAGE;
        goto out;
    }
    rc = connect_sequenced(cli, a, &client);
    if (rc)
        goto out;
    tally_status_t status = tally_run(client, &a->req, input->data, input->len, &a->opts, out, res);
    if (status != TALLY_OK) {
        rc = report(status, a->cmd, res->error);
        report_stopped(a, res);
    }
out:
    tally_client_destroy(&client);
    input_free(&raw);
    tally_buf_free(&parsed);
    return rc;
}

static const char FILTER_HELP[] =
    "usage: tally filter PREDICATE [--stable] [--type i32|u8] [--count] [OPTIONS]\n"
    "\n"
    "Keep the elements that satisfy PREDICATE and print them, one per line.\n"
    "\n"
    "Predicate (exactly one):\n"
    "  --gt N, --ge N, --lt N, --le N, --eq N, --ne N   compare with N\n"
    "  --between LO HI                                 keep LO <= x <= HI\n"
    "Options:\n"
    "  --stable        keep input order inside each chunk (default: unordered, faster;\n"
    "                  chunks are always put back in input order)\n"
    "  --type T        element type: i32 (default) or u8\n"
    "  --count         print only the number kept\n" DATA_HELP;

static int cmd_filter(cli_t *cli, int argc, char **argv)
{
    static const struct option opts[] = {
        DATA_LONG_OPTIONS,
        {"gt", required_argument, NULL, OPT_GT},
        {"ge", required_argument, NULL, OPT_GE},
        {"lt", required_argument, NULL, OPT_LT},
        {"le", required_argument, NULL, OPT_LE},
        {"eq", required_argument, NULL, OPT_EQ},
        {"ne", required_argument, NULL, OPT_NE},
        {"between", required_argument, NULL, OPT_BETWEEN},
        {"stable", no_argument, NULL, OPT_STABLE},
        {"type", required_argument, NULL, OPT_TYPE},
        {"count", no_argument, NULL, OPT_COUNT},
        {0},
    };
    static const tally_pred_t preds[] = {
        [OPT_GT - OPT_GT] = TALLY_PRED_GT, [OPT_GE - OPT_GT] = TALLY_PRED_GE,
        [OPT_LT - OPT_GT] = TALLY_PRED_LT, [OPT_LE - OPT_GT] = TALLY_PRED_LE,
        [OPT_EQ - OPT_GT] = TALLY_PRED_EQ, [OPT_NE - OPT_GT] = TALLY_PRED_NE,
    };
    data_args_t a = {.cmd = "filter"};
    a.req.opcode = TALLY_OP_FILTER;
    a.req.dtype = TALLY_DTYPE_I32;
    bool count_only = false;
    int opt, rc;
    tally_dtype_t dtype;
    while ((opt = getopt_long(argc, argv, ":he:t:", opts, NULL)) != -1) {
        if ((rc = common_option(cli, a.cmd, opt, argv)) != 1 ||
            (rc = data_option(&a, opt, optarg)) != 1) {
            if (rc)
                return rc;
            continue;
        }
        switch (opt) {
        case OPT_HELP:
            fputs(FILTER_HELP, stdout);
            return 0;
        case OPT_GT:
        case OPT_GE:
        case OPT_LT:
        case OPT_LE:
        case OPT_EQ:
        case OPT_NE:
        case OPT_BETWEEN:
            if (a.req.pred)
                return usage_error("filter", "give exactly one predicate");
            if (!parse_i64(optarg, INT64_MIN, INT64_MAX, &a.req.lo))
                return usage_error("filter", "'%s' is not an integer", optarg);
            if (opt == OPT_BETWEEN) {
                if (optind >= argc || !parse_i64(argv[optind], INT64_MIN, INT64_MAX, &a.req.hi))
                    return usage_error("filter", "--between needs two integers LO HI");
                optind++;
                if (a.req.lo > a.req.hi)
                    return usage_error("filter", "--between: LO must be <= HI");
                a.req.pred = TALLY_PRED_BETWEEN;
            } else {
                a.req.pred = (uint8_t)preds[opt - OPT_GT];
            }
            break;
        case OPT_STABLE:
            a.req.flags |= TALLY_FLAG_FILTER_STABLE;
            break;
        case OPT_TYPE:
            if (!parse_dtype(optarg, &dtype))
                return usage_error("filter", "--type: '%s' is not i32 or u8", optarg);
            a.req.dtype = (uint8_t)dtype;
            break;
        case OPT_COUNT:
            count_only = true;
            break;
        default:
            return usage_error("filter", "unknown option");
        }
    }
    if (optind < argc)
        return usage_error("filter", "unexpected argument '%s'", argv[optind]);
    if (!a.req.pred)
        return usage_error("filter", "a predicate is required (--gt N, ..., --between LO HI)");

    tally_buf_t out = {0};
    tally_run_result_t res;
    rc = run_data(cli, &a, &out, &res);
    if (rc)
        goto done;
    if (count_only) {
        printf("%" PRIu64 "\n", res.count);
    } else if (a.out) {
        rc = write_binary(a.out, &out);
        goto done;
    } else {
        size_t esize = tally_dtype_size((tally_dtype_t)a.req.dtype);
        print_values(out.data, out.len / esize, esize);
    }
    rc = finish_stdout();
done:
    tally_buf_free(&out);
    return rc;
}

static const char SCAN_HELP[] =
    "usage: tally scan [--exclusive] [--out32] [OPTIONS]\n"
    "\n"
    "Prefix sums of int32 input, printed one per line. With --stream the sums continue from\n"
    "the stream's running total, so an array sent in pieces gets the sums it would get whole.\n"
    "\n"
    "Options:\n"
    "  --exclusive     exclusive sums (element i excluded; the first sum is the carry-in)\n"
    "  --out32         int32 sums wrapping modulo 2^32 (default: int64)\n" DATA_HELP;

static int cmd_scan(cli_t *cli, int argc, char **argv)
{
    static const struct option opts[] = {
        DATA_LONG_OPTIONS,
        {"exclusive", no_argument, NULL, OPT_EXCLUSIVE},
        {"out32", no_argument, NULL, OPT_OUT32},
        {0},
    };
    data_args_t a = {.cmd = "scan"};
    a.req.opcode = TALLY_OP_SCAN;
    a.req.dtype = TALLY_DTYPE_I32;
    int opt, rc;
    while ((opt = getopt_long(argc, argv, ":he:t:", opts, NULL)) != -1) {
        if ((rc = common_option(cli, a.cmd, opt, argv)) != 1 ||
            (rc = data_option(&a, opt, optarg)) != 1) {
            if (rc)
                return rc;
            continue;
        }
        switch (opt) {
        case OPT_HELP:
            fputs(SCAN_HELP, stdout);
            return 0;
        case OPT_EXCLUSIVE:
            a.req.flags |= TALLY_FLAG_SCAN_EXCLUSIVE;
            break;
        case OPT_OUT32:
            a.req.flags |= TALLY_FLAG_SCAN_OUT_I32;
            break;
        default:
            return usage_error("scan", "unknown option");
        }
    }
    if (optind < argc)
        return usage_error("scan", "unexpected argument '%s'", argv[optind]);

    tally_buf_t out = {0};
    tally_run_result_t res;
    rc = run_data(cli, &a, &out, &res);
    if (rc)
        goto done;
    if (a.out) {
        rc = write_binary(a.out, &out);
        goto done;
    }
    size_t out_size = (a.req.flags & TALLY_FLAG_SCAN_OUT_I32) ? 4 : 8;
    print_values(out.data, out.len / out_size, out_size);
    rc = finish_stdout();
done:
    tally_buf_free(&out);
    return rc;
}

static const char HIST_HELP[] =
    "usage: tally hist [--type u8|i32] [--range LO HI] [OPTIONS]\n"
    "\n"
    "Histogram of this input in 256 bins, printed as 'bin count' lines (bins 0..255). u8:\n"
    "one bin per byte value. i32: 256 even bins over [LO, HI) plus 'underflow N' and\n"
    "'overflow N' lines; x in [LO, HI) goes to bin (x - LO) * 256 / (HI - LO). With\n"
    "--stream the counts are also added to the stream's running histogram (see 'tally\n"
    "query'). --out writes 256 (u8) or 258 (i32: bins, underflow, overflow) uint64 counts.\n"
    "\n"
    "Options:\n"
    "  --type T        element type: u8 (default) or i32\n"
    "  --range LO HI   the i32 histogram's range [LO, HI) (required for i32)\n" DATA_HELP;

static int cmd_hist(cli_t *cli, int argc, char **argv)
{
    static const struct option opts[] = {
        DATA_LONG_OPTIONS,
        {"type", required_argument, NULL, OPT_TYPE},
        {"range", required_argument, NULL, OPT_RANGE},
        {0},
    };
    data_args_t a = {.cmd = "hist"};
    a.req.opcode = TALLY_OP_HIST;
    a.req.dtype = TALLY_DTYPE_U8;
    bool have_range = false;
    int opt, rc;
    tally_dtype_t dtype;
    while ((opt = getopt_long(argc, argv, ":he:t:", opts, NULL)) != -1) {
        if ((rc = common_option(cli, a.cmd, opt, argv)) != 1 ||
            (rc = data_option(&a, opt, optarg)) != 1) {
            if (rc)
                return rc;
            continue;
        }
        switch (opt) {
        case OPT_HELP:
            fputs(HIST_HELP, stdout);
            return 0;
        case OPT_TYPE:
            if (!parse_dtype(optarg, &dtype))
                return usage_error("hist", "--type: '%s' is not u8 or i32", optarg);
            a.req.dtype = (uint8_t)dtype;
            break;
        case OPT_RANGE:
            if (!parse_i64(optarg, INT32_MIN, (int64_t)INT32_MAX + 1, &a.req.lo) ||
                optind >= argc ||
                !parse_i64(argv[optind], INT32_MIN, (int64_t)INT32_MAX + 1, &a.req.hi))
                return usage_error("hist",
                                   "--range needs two integers LO HI in [%" PRId32 ", %" PRId64 "]",
                                   INT32_MIN, (int64_t)INT32_MAX + 1);
            optind++;
            if (a.req.lo >= a.req.hi)
                return usage_error("hist", "--range: LO must be < HI");
            have_range = true;
            break;
        default:
            return usage_error("hist", "unknown option");
        }
    }
    if (optind < argc)
        return usage_error("hist", "unexpected argument '%s'", argv[optind]);
    if (a.req.dtype == TALLY_DTYPE_I32 && !have_range)
        return usage_error("hist", "--type i32 needs --range LO HI");
    if (a.req.dtype == TALLY_DTYPE_U8 && have_range)
        return usage_error("hist", "--range applies to --type i32 only");

    tally_buf_t out = {0};
    tally_run_result_t res;
    rc = run_data(cli, &a, &out, &res);
    if (rc)
        goto done;
    if (a.out) {
        rc = write_binary(a.out, &out);
        goto done;
    }
    for (unsigned i = 0; i < TALLY_HIST_BINS; i++)
        printf("%u %" PRIu64 "\n", i, tally_get_u64(out.data + 8 * i));
    if (a.req.dtype == TALLY_DTYPE_I32) {
        printf("underflow %" PRIu64 "\n", tally_get_u64(out.data + 8 * TALLY_HIST_BINS));
        printf("overflow %" PRIu64 "\n", tally_get_u64(out.data + 8 * (TALLY_HIST_BINS + 1)));
    }
    rc = finish_stdout();
done:
    tally_buf_free(&out);
    return rc;
}

/* ---- Control commands --------------------------------------------------------------------- */

/* Parses a command that takes only --help and `nargs` positional arguments. */
static int simple_args(cli_t *cli, const char *cmd, const char *help, int argc, char **argv,
                       int nargs)
{
    static const struct option opts[] = {
        {"help", no_argument, NULL, 'h'},
        {"endpoint", required_argument, NULL, 'e'},
        {"timeout", required_argument, NULL, 't'},
        {0},
    };
    int opt, rc;
    while ((opt = getopt_long(argc, argv, ":he:t:", opts, NULL)) != -1) {
        if (opt == 'h') {
            fputs(help, stdout);
            return -1;
        }
        if ((rc = common_option(cli, cmd, opt, argv)) != 0)
            return rc == 1 ? usage_error(cmd, "unknown option") : rc;
    }
    if (argc - optind != nargs)
        return usage_error(cmd, "expected %d argument%s", nargs, nargs == 1 ? "" : "s");
    return 0;
}

static int check_stream_arg(const char *cmd, const char *name)
{
    if (!tally_stream_name_valid(name, strlen(name)))
        return usage_error(cmd, "invalid stream name '%s': 1-64 printable ASCII bytes, no spaces",
                           name);
    return 0;
}

static const char QUERY_HELP[] =
    "usage: tally query STREAM\n"
    "\n"
    "Print a stream's counters as 'key value' lines (batches, elements, bytes, filter_seen,\n"
    "filter_kept, scan_carry, scan_elements, hist_type, hist_lo, hist_hi, hist_underflow,\n"
    "hist_overflow, hist_total, last_seq), then its running histogram as 256 'bin count' lines\n"
    "(all bins, zeros included, so the output always has the same shape).\n";

static int cmd_query(cli_t *cli, int argc, char **argv)
{
    int rc = simple_args(cli, "query", QUERY_HELP, argc, argv, 1);
    if (rc)
        return rc < 0 ? 0 : rc;
    const char *name = argv[optind];
    if ((rc = check_stream_arg("query", name)) != 0)
        return rc;
    tally_client_t *client = NULL;
    if ((rc = connect_client(cli, &client)) != 0)
        return rc;
    tally_stream_info_t info;
    tally_status_t status = tally_query(client, name, &info);
    if (status != TALLY_OK) {
        rc = report(status, "query", tally_client_error(client));
        goto out;
    }
    const char *type = tally_dtype_name((tally_dtype_t)info.hist_dtype);
    printf("batches %" PRIu64 "\nelements %" PRIu64 "\nbytes %" PRIu64 "\n", info.batches,
           info.elements, info.bytes);
    printf("filter_seen %" PRIu64 "\nfilter_kept %" PRIu64 "\n", info.filter_seen,
           info.filter_kept);
    printf("scan_carry %" PRId64 "\nscan_elements %" PRIu64 "\n", info.scan_carry,
           info.scan_elements);
    printf("hist_type %s\nhist_lo %" PRId64 "\nhist_hi %" PRId64 "\n", type ? type : "none",
           info.hist_lo, info.hist_hi);
    printf("hist_underflow %" PRIu64 "\nhist_overflow %" PRIu64 "\nhist_total %" PRIu64 "\n",
           info.hist_underflow, info.hist_overflow, info.hist_total);
    printf("last_seq %" PRIu64 "\n", info.last_seq);
    for (unsigned i = 0; i < TALLY_HIST_BINS; i++)
        printf("%u %" PRIu64 "\n", i, info.bins[i]);
    rc = finish_stdout();
out:
    tally_client_destroy(&client);
    return rc;
}

static const char RESET_HELP[] = "usage: tally reset STREAM\n"
                                 "\n"
                                 "Clear a stream's histogram, scan carry and counters.\n";

static int cmd_reset(cli_t *cli, int argc, char **argv)
{
    int rc = simple_args(cli, "reset", RESET_HELP, argc, argv, 1);
    if (rc)
        return rc < 0 ? 0 : rc;
    const char *name = argv[optind];
    if ((rc = check_stream_arg("reset", name)) != 0)
        return rc;
    tally_client_t *client = NULL;
    if ((rc = connect_client(cli, &client)) != 0)
        return rc;
    tally_status_t status = tally_reset(client, name);
    if (status != TALLY_OK)
        rc = report(status, "reset", tally_client_error(client));
    tally_client_destroy(&client);
    return rc;
}

static const char STREAMS_HELP[] = "usage: tally streams\n"
                                   "\n"
                                   "List the daemon's streams, one name per line.\n";

static int cmd_streams(cli_t *cli, int argc, char **argv)
{
    int rc = simple_args(cli, "streams", STREAMS_HELP, argc, argv, 0);
    if (rc)
        return rc < 0 ? 0 : rc;
    tally_client_t *client = NULL;
    if ((rc = connect_client(cli, &client)) != 0)
        return rc;
    char **names = NULL;
    size_t count = 0;
    tally_status_t status = tally_streams(client, &names, &count);
    if (status != TALLY_OK) {
        rc = report(status, "streams", tally_client_error(client));
    } else {
        for (size_t i = 0; i < count; i++)
            printf("%s\n", names[i]);
        rc = finish_stdout();
    }
    tally_strings_free(names, count);
    tally_client_destroy(&client);
    return rc;
}

static const char PING_HELP[] = "usage: tally ping\n"
                                "\n"
                                "Check that tallyd answers; prints 'pong <round trip> ms'.\n";

static int cmd_ping(cli_t *cli, int argc, char **argv)
{
    int rc = simple_args(cli, "ping", PING_HELP, argc, argv, 0);
    if (rc)
        return rc < 0 ? 0 : rc;
    tally_client_t *client = NULL;
    if ((rc = connect_client(cli, &client)) != 0)
        return rc;
    double rtt_us = 0;
    tally_status_t status = tally_ping(client, &rtt_us);
    if (status != TALLY_OK) {
        rc = report(status, "ping", tally_client_error(client));
    } else {
        printf("pong %.3f ms\n", rtt_us / 1000.0);
        rc = finish_stdout();
    }
    tally_client_destroy(&client);
    return rc;
}

static const char INFO_HELP[] = "usage: tally info\n"
                                "\n"
                                "Print the daemon's version, backends, devices and limits as\n"
                                "'key=value' lines.\n";
static const char STATS_HELP[] = "usage: tally stats\n"
                                 "\n"
                                 "Print the daemon's metrics in the Prometheus text format.\n";

static int text_command(cli_t *cli, int argc, char **argv, tally_op_t op)
{
    const char *cmd = op == TALLY_OP_INFO ? "info" : "stats";
    int rc = simple_args(cli, cmd, op == TALLY_OP_INFO ? INFO_HELP : STATS_HELP, argc, argv, 0);
    if (rc)
        return rc < 0 ? 0 : rc;
    tally_client_t *client = NULL;
    if ((rc = connect_client(cli, &client)) != 0)
        return rc;
    char *text = NULL;
    tally_status_t status = tally_info(client, op, &text);
    if (status != TALLY_OK) {
        rc = report(status, cmd, tally_client_error(client));
    } else {
        size_t len = strlen(text);
        fputs(text, stdout);
        if (len && text[len - 1] != '\n')
            fputc('\n', stdout);
        rc = finish_stdout();
    }
    free(text);
    tally_client_destroy(&client);
    return rc;
}

static const char KEYGEN_HELP[] =
    "usage: tally keygen NAME\n"
    "Make a CURVE key pair: NAME.key (both halves, mode 0600: this side's secret) and NAME.pub\n"
    "(the public half, for the other side). For tallyd: `tally keygen /etc/tallyd/server`, then\n"
    "curve_secret_key = /etc/tallyd/server.key, and server.pub to the clients. For a client:\n"
    "`tally keygen cam1`, cam1.pub into tallyd's curve_clients_dir, and connect with\n"
    "--server-key server.pub --client-key cam1.key (or TALLY_SERVER_KEY and TALLY_CLIENT_KEY,\n"
    "or server_key = and client_key = in ~/.config/tally/tally.conf). Prints the public key;\n"
    "never overwrites a file.\n";

static int cmd_keygen(cli_t *cli, int argc, char **argv)
{
    int rc = simple_args(cli, "keygen", KEYGEN_HELP, argc, argv, 1);
    if (rc)
        return rc < 0 ? 0 : rc;
    char pub[41], why[512] = "";
    tally_status_t st = tally_keygen(argv[optind], pub, why, sizeof why);
    if (st == TALLY_E_ARG)
        return usage_error("keygen", "%s", why[0] ? why : "bad NAME");
    if (st != TALLY_OK) {
        errorf("keygen: %s", why);
        return EXIT_USAGE;
    }
    printf("%s\n", pub);
    return finish_stdout();
}

static int cmd_info(cli_t *cli, int argc, char **argv)
{
    return text_command(cli, argc, argv, TALLY_OP_INFO);
}

static int cmd_stats(cli_t *cli, int argc, char **argv)
{
    return text_command(cli, argc, argv, TALLY_OP_STATS);
}

/* ---- Top level ---------------------------------------------------------------------------- */

static const struct {
    const char *name;
    int (*run)(cli_t *cli, int argc, char **argv);
    const char *summary;
} commands[] = {
    {"filter", cmd_filter, "keep the elements that satisfy a predicate"},
    {"scan", cmd_scan, "prefix sums of int32 input"},
    {"hist", cmd_hist, "256-bin histogram of u8 or i32 input"},
    {"query", cmd_query, "a stream's counters and running histogram"},
    {"reset", cmd_reset, "clear a stream"},
    {"streams", cmd_streams, "list streams"},
    {"ping", cmd_ping, "check that tallyd answers"},
    {"info", cmd_info, "daemon version, backends and limits"},
    {"stats", cmd_stats, "daemon metrics (Prometheus text)"},
    {"keygen", cmd_keygen, "make a CURVE key pair (NAME.key, NAME.pub)"},
};

static void print_usage(FILE *f)
{
    fprintf(f,
            "usage: tally [-e ENDPOINT] [-t TIMEOUT_MS] COMMAND [OPTIONS]\n"
            "\n"
            "Send work to tallyd, the GPU stream-processing daemon.\n"
            "\n"
            "Options:\n"
            "  -e, --endpoint E   daemon endpoint (default: $TALLY_ENDPOINT or %s)\n"
            "  -t, --timeout MS   give up after MS milliseconds without a reply "
            "(default %d)\n"
            "      --server-key K tallyd's CURVE public key, or its .pub file (default:\n"
            "                     $TALLY_SERVER_KEY, or server_key in ~/.config/tally/tally.conf;\n"
            "                     none: no CURVE)\n"
            "      --client-key F this client's key file from `tally keygen` (default:\n"
            "                     $TALLY_CLIENT_KEY, or client_key in that file)\n"
            "  -h, --help         show this help; 'tally COMMAND --help' for a command\n"
            "  -V, --version      print the version\n"
            "\n"
            "Commands:\n",
            TALLY_DEFAULT_ENDPOINT, TALLY_DEFAULT_TIMEOUT_MS);
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-8s %s\n", commands[i].name, commands[i].summary);
    fprintf(f, "\nExit status: 0 ok, 1 error reported by tallyd, 2 usage or input error,\n"
               "3 no reply (timeout or transport failure).\n");
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {
        {"endpoint", required_argument, NULL, 'e'},
        {"timeout", required_argument, NULL, 't'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {"server-key", required_argument, NULL, OPT_SERVER_KEY},
        {"client-key", required_argument, NULL, OPT_CLIENT_KEY},
        {0},
    };
    cli_t cli = {.endpoint = getenv("TALLY_ENDPOINT"), .timeout_ms = TALLY_DEFAULT_TIMEOUT_MS};
    if (!cli.endpoint || !*cli.endpoint)
        cli.endpoint = TALLY_DEFAULT_ENDPOINT;
    int opt, rc;
    opterr = 0;
    /* "+": stop at the command name; its options are parsed by the command. */
    while ((opt = getopt_long(argc, argv, "+:e:t:hV", opts, NULL)) != -1) {
        switch (opt) {
        case 'e':
            cli.endpoint = optarg;
            break;
        case 't':
            if ((rc = parse_timeout(NULL, optarg, &cli.timeout_ms)) != 0)
                return rc;
            break;
        case 'h':
            print_usage(stdout);
            return 0;
        case 'V':
            printf("tally %s\n", TALLY_VERSION);
            return 0;
        case OPT_SERVER_KEY:
            cli.server_key = optarg;
            break;
        case OPT_CLIENT_KEY:
            cli.client_key = optarg;
            break;
        default:
            return common_option(&cli, NULL, opt, argv);
        }
    }
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
        if (strcmp(name, commands[i].name))
            continue;
        int sub_argc = argc - optind;
        char **sub_argv = argv + optind;
        optind = 0; /* glibc: restart getopt on the command's own arguments */
        setvbuf(stdout, NULL, _IOFBF, 1 << 16);
        return commands[i].run(&cli, sub_argc, sub_argv);
    }
    return usage_error(NULL, "unknown command '%s'", name);
}
