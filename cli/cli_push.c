/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cli_push.c — the streamed push of the data commands (cli_push.h).
 *
 * Memory: one chunk buffer here, the push's window of chunks and replies in libtally and
 * ZeroMQ, and a 64 KiB text window: a few times window x chunk, whatever the input's length
 * (2 GB through a pipe stays within a few tens of MiB with the defaults).
 *
 * Chunks: --chunk (default 1 MiB), capped to the daemon's max_batch (from `info`), rounded
 * down to whole elements, or with --frames to whole frames, so a frame is never split across
 * two requests (and over NATS to what one message holds). A --chunk given and changed so is
 * said once, on stderr, with the size sent and why.
 *
 * Resuming: a push on a stream numbers its chunks from the stream's last_seq (the seq base).
 * It writes the base to a small record file (resume_path) and removes it once complete, so
 * that after Ctrl-C, a failure or a crash, `--resume` finds the base and the push continues
 * with the chunks the stream does not have yet.
 */
#include "cli_push.h"

#include "tally_ops.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Where the output goes, chunk by chunk. */
typedef struct {
    const data_args_t *a;
    FILE *f;          /* stdout or --out */
    bool flush;       /* a live input: each chunk's output goes out at once */
    tally_buf_t hist; /* hist: the counts, printed at the end */
} sink_t;

static tally_status_t sink_write(void *arg, const void *data, size_t len)
{
    sink_t *s = arg;
    const tally_req_t *req = &s->a->req;
    if (req->opcode == TALLY_OP_HIST)
        return tally_buf_append(&s->hist, data, len);
    if (s->a->out) {
        if (fwrite(data, 1, len, s->f) != len)
            return TALLY_E_IO;
        return TALLY_OK;
    }
    if (req->opcode == TALLY_OP_MINMAX) { /* once, at the end: 'min N' and 'max N' */
        int64_t min, max;
        tally_minmax_decode(req->dtype, data, &min, &max);
        fprintf(s->f, "min %" PRId64 "\nmax %" PRId64 "\n", min, max);
        return ferror(s->f) ? TALLY_E_IO : TALLY_OK;
    }
    size_t size = tally_op_reply_elem(req);
    print_values(s->f, data, len / size, size);
    if (s->flush)
        fflush(s->f);
    return ferror(s->f) ? TALLY_E_IO : TALLY_OK;
}

/* hist's counts: 'bin count' lines, then underflow and overflow for i32 and u16; for rgb8/rgba8
 * each channel's bins as 'CHANNEL bin count' (r, g, b, a); or binary. */
static void print_hist(sink_t *s)
{
    static const char *const channel_names[] = {"r ", "g ", "b ", "a "};
    const uint8_t *p = s->hist.data;
    uint8_t dtype = s->a->req.dtype;
    if (s->a->out) {
        fwrite(p, 1, s->hist.len, s->f);
        return;
    }
    unsigned channels = tally_hist_channels(dtype);
    for (unsigned c = 0; c < channels; c++)
        for (unsigned i = 0; i < TALLY_HIST_BINS; i++)
            fprintf(s->f, "%s%u %" PRIu64 "\n", channels > 1 ? channel_names[c] : "", i,
                    tally_get_u64(p + 8 * (c * TALLY_HIST_BINS + i)));
    if (tally_hist_ranged(dtype)) {
        fprintf(s->f, "underflow %" PRIu64 "\n", tally_get_u64(p + 8 * TALLY_HIST_BINS));
        fprintf(s->f, "overflow %" PRIu64 "\n", tally_get_u64(p + 8 * (TALLY_HIST_BINS + 1)));
    }
}

/* ---- Chunk size --------------------------------------------------------------------------- */

/* The daemon's max_batch into *max (0: it does not say), and whether it takes what --shm or
 * --gpu-region asks. 0, or the exit status of a daemon that does not answer (reported here: the
 * push would only wait for it a second time) or of one without shared memory (said with what to
 * do: the library's 'offers no shared memory' alone left the user to guess). */
static int daemon_max_batch(const data_args_t *a, tally_client_t *client, bool fleet, size_t *max)
{
    tally_info_t *info = NULL;
    uint64_t value = 0;
    tally_status_t st = tally_info_fetch(client, &info);
    /* Over NATS the push goes to JetStream, not to whoever answers info (which a producer may
     * not even be allowed to ask): no answer there says nothing about the push. */
    if (!fleet && (st == TALLY_E_TIMEOUT || st == TALLY_E_TRANSPORT))
        return cli_report(st, a->cmd, tally_client_error(client));
    if (st == TALLY_OK && tally_info_u64(info, "max_batch", &value) != TALLY_OK)
        value = 0;
    const char *shm = st == TALLY_OK ? tally_info_lookup(info, "shm") : NULL;
    bool no_shm = a->opts.shm && shm && !strcmp(shm, "off");
    tally_info_destroy(&info);
    *max = (size_t)value;
    if (no_shm) {
        const char *opt = a->opts.shm == TALLY_RUN_SHM_GPU ? "--gpu-region" : "--shm";
        cli_error("%s: this tallyd offers no shared memory (info: shm=off): run without %s (the "
                  "chunks then go over its socket), or start tallyd with --shm on",
                  a->cmd, opt);
        return EXIT_USAGE;
    }
    return 0;
}

/* Why the chunk sent is not --chunk: what made it smaller, and the unit it was rounded to. */
typedef struct {
    const char *limit; /* "the daemon's max_batch", "one NATS message", or NULL */
    size_t unit;       /* rounded to whole elements or frames of this many bytes (0: not) */
} chunk_change_t;

/* The one line that says a --chunk given was not what is sent, and why. */
static void say_chunk_change(const data_args_t *a, size_t asked, size_t chunk,
                             const chunk_change_t *why)
{
    if (!a->chunk_arg || chunk == asked)
        return;
    char unit[96] = "";
    if (why->unit)
        snprintf(unit, sizeof unit, "%swhole %zu-byte %s%s", why->limit ? ", in " : "", why->unit,
                 a->frame ? "frames" : cli_dtype_name(a->req.dtype), a->frame ? "" : " elements");
    cli_error("%s: --chunk %s: sending chunks of %zu bytes (%s%s)", a->cmd, a->chunk_arg, chunk,
              why->limit ? why->limit : "", unit);
}

/* want capped to limit (0: none) and rounded down to whole units (at least one). */
static size_t fit_chunk(size_t want, size_t limit, size_t unit, const char *limit_name,
                        chunk_change_t *why)
{
    if (limit && want > limit) {
        want = limit; /* a bigger chunk would only be refused with too_large */
        why->limit = limit_name;
    }
    size_t chunk = want < unit ? unit : want - want % unit;
    if (chunk != want)
        why->unit = unit;
    return chunk;
}

/* --chunk capped to max_batch, in whole elements or --frames frames. 0 or an exit status. */
static int chunk_size(const data_args_t *a, tally_client_t *client, bool fleet, size_t *chunk,
                      chunk_change_t *why)
{
    size_t esize = tally_dtype_size((tally_dtype_t)a->req.dtype);
    size_t want = a->opts.chunk_bytes ? a->opts.chunk_bytes : TALLY_DEFAULT_CHUNK_BYTES;
    size_t max = 0;
    int rc = daemon_max_batch(a, client, fleet, &max);
    if (rc)
        return rc;
    size_t unit = a->frame ? a->frame : esize;
    if (a->frame && max && a->frame > max) {
        cli_error("%s: a frame of %zu bytes is larger than the daemon's max_batch (%zu bytes)",
                  a->cmd, a->frame, max);
        return EXIT_USAGE;
    }
    *chunk = fit_chunk(want, max, unit, "the daemon's max_batch", why);
    return 0;
}

/* ---- Resume records ----------------------------------------------------------------------- */

/* $XDG_STATE_HOME/tally/resume-<hash of target and stream> (else ~/.local/state/...): the
 * target is -e's endpoint, or with --nats or --fleet the fleet's NATS servers as given, password
 * left out (cli_target), so one record serves a stream of a fleet whichever way it is reached. */
static bool resume_path(const cli_t *cli, const char *stream, char *path, size_t cap)
{
    const char *state = getenv("XDG_STATE_HOME"), *home = getenv("HOME");
    char dir[512];
    if (state && *state)
        snprintf(dir, sizeof dir, "%s/tally", state);
    else if (home && *home)
        snprintf(dir, sizeof dir, "%s/.local/state/tally", home);
    else
        return false;
    char target[512];
    cli_target(cli, target, sizeof target);
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (const char *s = target; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    h = (h ^ '|') * 1099511628211ull;
    for (const char *s = stream; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return snprintf(path, cap, "%s/resume-%016" PRIx64, dir, h) < (int)cap;
}

/* mkdir -p for the record's folder. */
static void make_dirs(char *path)
{
    for (char *p = path + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        mkdir(path, 0700);
        *p = '/';
    }
}

static void resume_save(const cli_t *cli, const data_args_t *a, uint64_t seq_base)
{
    char path[600];
    if (!resume_path(cli, a->req.stream, path, sizeof path))
        return;
    make_dirs(path);
    FILE *f = fopen(path, "w");
    if (!f)
        return; /* resuming then needs --seq-base, which the stop message prints */
    char target[512];
    cli_target(cli, target, sizeof target);
    fprintf(f, "seq_base %" PRIu64 "\nstream %s\nendpoint %s\n", seq_base, a->req.stream,
            target);
    fclose(f);
}

static void resume_clear(const cli_t *cli, const data_args_t *a)
{
    char path[600];
    if (resume_path(cli, a->req.stream, path, sizeof path))
        unlink(path);
}

/* --resume: the seq base of this stream's stopped push. 0 or an exit status. */
static int resume_load(const cli_t *cli, data_args_t *a)
{
    char path[600];
    unsigned long long base;
    FILE *f = resume_path(cli, a->req.stream, path, sizeof path) ? fopen(path, "r") : NULL;
    bool ok = f && fscanf(f, "seq_base %llu", &base) == 1;
    if (f)
        fclose(f);
    char target[512];
    cli_target(cli, target, sizeof target);
    if (!ok)
        return cli_usage_error(a->cmd,
                               "--resume: no stopped push to stream '%s' at %s is recorded "
                               "here; give --seq-base N (the stop message printed N)",
                               a->req.stream, target);
    a->opts.seq = TALLY_RUN_SEQ_RESUME;
    a->opts.seq_base = base;
    return 0;
}

/* A push on a stream numbers its chunks (PROTOCOL.md, "Sequence numbers"), so a chunk is never
 * applied twice, whatever happens to tallyd meanwhile; --no-seq turns that off. */
static int check_sequencing(const cli_t *cli, data_args_t *a)
{
    bool resuming = a->resume || a->opts.seq == TALLY_RUN_SEQ_RESUME;
    if (a->no_seq && resuming)
        return cli_usage_error(a->cmd, "--seq-base and --resume need sequence numbers, which "
                                       "--no-seq turns off");
    if (!a->req.stream_len && resuming)
        return cli_usage_error(a->cmd, "--seq-base and --resume need --stream");
    if (a->resume && a->opts.seq == TALLY_RUN_SEQ_RESUME)
        return cli_usage_error(a->cmd, "give --seq-base or --resume, not both");
    if (a->resume)
        return resume_load(cli, a);
    if (a->req.stream_len && !a->no_seq && a->opts.seq == TALLY_RUN_SEQ_OFF)
        a->opts.seq = TALLY_RUN_SEQ_APPEND;
    return 0;
}

/* ---- The push ----------------------------------------------------------------------------- */

/* Whether `--resume` can finish a push that stopped with `status`: after an interruption, a
 * lost connection or daemon, a refusal that passes (busy, limits, a GPU that failed), a lost
 * chunk (sequence_gap) or an output that could not be written, yes; after a refusal of the
 * input itself (stream_state, bad_payload, ...), a duplicate (someone else pushes to the
 * stream) or input that ends inside an element, no: the same input would fail the same way. */
static bool resume_can_help(tally_status_t status)
{
    switch (status) {
    case TALLY_E_TIMEOUT:
    case TALLY_E_TRANSPORT:
    case TALLY_E_SHUTDOWN:
    case TALLY_E_BUSY:
    case TALLY_E_RATE:
    case TALLY_E_LIMIT:
    case TALLY_E_CLIENT_STREAMS:
    case TALLY_E_BACKEND:
    case TALLY_E_INTERNAL:
    case TALLY_E_SEQ_GAP:
    case TALLY_E_NOMEM:
    case TALLY_E_IO:
        return true;
    default:
        return false;
    }
}

/* After a push that stopped: exactly what was applied (chunks, and the bytes of those same
 * chunks), out of what was read, and for a stream where it stands and, when resuming can
 * help, how to continue. */
static void report_stopped(const data_args_t *a, const tally_run_result_t *res, const reader_t *in,
                           const char *why, bool can_resume)
{
    if (!res->chunks && !res->skipped && !cli_interrupted)
        return; /* nothing was sent: the error said it all */
    char bytes[96], seq[400] = "";
    uint8_t dtype = a->req.dtype;
    if (res->applied_bytes == UINT64_MAX)
        snprintf(bytes, sizeof bytes, "(their bytes are not known)");
    else if (in->text) /* a --text token is one value: an i32, a u16 or a byte */
        snprintf(bytes, sizeof bytes, "%" PRIu64 " values",
                 res->applied_bytes / (dtype == TALLY_DTYPE_I32   ? 4u
                                       : dtype == TALLY_DTYPE_U16 ? 2u
                                                                  : 1u));
    else if (in->size)
        snprintf(bytes, sizeof bytes, "%" PRIu64 " of %" PRIu64 " bytes", res->applied_bytes,
                 in->size);
    else
        snprintf(bytes, sizeof bytes, "%" PRIu64 " of the %" PRIu64 " bytes read",
                 res->applied_bytes, in->bytes_read);
    if (a->opts.seq != TALLY_RUN_SEQ_OFF && res->input_chunks) {
        int n = snprintf(seq, sizeof seq,
                         " (stream '%s' is at seq %" PRIu64 ", this input's chunks are seq %" PRIu64
                         "..%" PRIu64 ")%s",
                         a->req.stream, res->last_seq, res->seq_base + 1,
                         res->seq_base + res->input_chunks,
                         res->applied_known ? "" : " (tallyd could not be asked)");
        if (can_resume && n > 0 && (size_t)n < sizeof seq)
            snprintf(seq + n, sizeof seq - (size_t)n,
                     "; re-run with --resume (or --seq-base %" PRIu64 ") to continue",
                     res->seq_base);
    }
    cli_error("%s: %s: applied %s%" PRIu64 " of %" PRIu64 " chunks, %s%s", a->cmd, why,
              res->applied_known ? "" : "at least ", res->applied, res->input_chunks, bytes, seq);
}

typedef struct {
    reader_t in;
    sink_t sink;
    tally_client_t *client;
    tally_push_t *push;
    uint8_t *chunk;
    progress_t progress;
} push_run_t;

/* Reads and writes chunks until the input ends, a chunk fails or Ctrl-C. 0 or the exit
 * status of an input error (the push's own failure shows in its result). */
static int pump(push_run_t *p, size_t chunk)
{
    uint64_t written = 0;
    while (!cli_interrupted) {
        size_t n = 0;
        int rc = reader_fill(&p->in, p->chunk, chunk, &n);
        if (rc)
            return rc;
        if (cli_interrupted)
            return 0; /* what was read of this chunk is not sent: the report is exact */
        /* An empty input is still one request, as with one message. */
        if (n > 0 || (written == 0 && reader_done(&p->in))) {
            if (tally_push_write(p->push, p->chunk, n) != TALLY_OK)
                return 0;
            written++;
            progress_update(&p->progress, p->in.bytes_read);
        }
        /* A live producer paused: show the results so far instead of holding them. */
        if (n < chunk && !reader_done(&p->in) && tally_push_flush(p->push) != TALLY_OK)
            return 0;
        if (reader_done(&p->in))
            return reader_tail_error(&p->in);
    }
    return 0;
}

/* Opens input, output and connection, and starts the push. 0 or an exit status. */
static int push_open(cli_t *cli, data_args_t *a, push_run_t *p, size_t *chunk)
{
    int rc = reader_open(&p->in, a->in, a->text, (tally_dtype_t)a->req.dtype, a->frame, a->binary);
    if (rc)
        return rc;
    p->sink.a = a;
    p->sink.f = stdout;
    p->sink.flush = p->in.live;
    if (a->out && !a->count_only && strcmp(a->out, "-") && !(p->sink.f = fopen(a->out, "wb"))) {
        cli_error("cannot open '%s' for writing: %s", a->out, strerror(errno));
        return EXIT_USAGE;
    }
    chunk_change_t why = {0};
    if ((rc = cli_connect(cli, &p->client)) != 0 ||
        (rc = chunk_size(a, p->client, cli->nats != NULL, chunk, &why)) != 0)
        return rc;
    size_t asked = a->opts.chunk_bytes;
    a->opts.chunk_bytes = *chunk;
    a->opts.total_bytes = p->in.size;
    tally_status_t status = tally_push_new(p->client, &a->req, &a->opts,
                                           a->count_only ? NULL : sink_write, &p->sink, &p->push);
    if (status != TALLY_OK)
        return cli_report(status, a->cmd, tally_client_error(p->client));
    size_t fits = tally_push_chunk_bytes(p->push); /* smaller over NATS: one message a chunk */
    size_t unit = a->frame ? a->frame : tally_dtype_size((tally_dtype_t)a->req.dtype);
    if (fits < unit) {
        cli_error("%s: a frame of %zu bytes does not fit one NATS message (%zu bytes)", a->cmd,
                  unit, fits);
        return EXIT_USAGE;
    }
    *chunk = fit_chunk(*chunk, fits, unit, "one NATS message", &why);
    say_chunk_change(a, asked, *chunk, &why);
    if (!(p->chunk = malloc(*chunk))) {
        cli_error("out of memory");
        return EXIT_USAGE;
    }
    const tally_run_result_t *res = tally_push_result(p->push);
    if (a->opts.seq == TALLY_RUN_SEQ_APPEND)
        resume_save(cli, a, res->seq_base);
    return 0;
}

/* The output once the push is complete: hist's counts, filter --count's number. */
static int finish_output(push_run_t *p, const data_args_t *a)
{
    if (a->req.opcode == TALLY_OP_HIST)
        print_hist(&p->sink);
    else if (a->count_only)
        fprintf(p->sink.f, "%" PRIu64 "\n", tally_push_result(p->push)->count);
    if (p->sink.f != stdout && fclose(p->sink.f) != 0) {
        p->sink.f = stdout;
        cli_error("cannot write '%s': %s", a->out, strerror(errno));
        return EXIT_USAGE;
    }
    p->sink.f = stdout;
    return cli_finish_stdout();
}

int cli_push(cli_t *cli, data_args_t *a)
{
    push_run_t p = {.in.fd = -1};
    size_t chunk = 0;
    int rc = check_sequencing(cli, a);
    if (rc || (rc = push_open(cli, a, &p, &chunk)) != 0)
        goto out;
    cli_catch_interrupts();
    bool tty = isatty(STDOUT_FILENO) && isatty(STDERR_FILENO);
    progress_start(&p.progress, a->progress < 0 ? tty : a->progress, p.in.size);
    int input_rc = pump(&p, chunk);
    tally_status_t status = tally_push_finish(p.push);
    progress_end(&p.progress);
    const tally_run_result_t *res = tally_push_result(p.push);
    if (status != TALLY_OK)
        rc = cli_report(status, a->cmd, res->error);
    else if (cli_interrupted)
        rc = EXIT_INTERRUPTED;
    else
        rc = input_rc;
    if (rc) {
        bool can_resume = cli_interrupted || (status != TALLY_OK && resume_can_help(status));
        report_stopped(a, res, &p.in, cli_interrupted ? "interrupted" : "stopped", can_resume);
        goto out;
    }
    if (a->opts.seq != TALLY_RUN_SEQ_OFF)
        resume_clear(cli, a);
    rc = finish_output(&p, a);
out:
    if (p.sink.f && p.sink.f != stdout)
        fclose(p.sink.f);
    tally_push_destroy(&p.push);
    tally_client_destroy(&p.client);
    reader_close(&p.in);
    tally_buf_free(&p.sink.hist);
    free(p.chunk);
    return rc;
}
