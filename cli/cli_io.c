/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cli_io.c — streamed input and output of the data commands (cli_io.h).
 *
 * Binary input is read straight into the caller's chunk buffer. --text input goes through a
 * 64 KiB window of raw text: tokens are parsed out of it into the chunk, and a token cut by
 * the window's end is moved to its front before the next read, so a number is never split.
 */
#include "cli_io.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define TEXT_WINDOW (1 << 16)
/* A --text token longer than this is not an integer of any type we take. */
#define TOKEN_MAX 64
/* A live input (pipe, terminal) that pauses this long has its whole elements sent. */
#define LIVE_IDLE_MS 200

volatile sig_atomic_t cli_interrupted;

static void on_interrupt(int sig)
{
    (void)sig;
    cli_interrupted = 1;
}

void cli_catch_interrupts(void)
{
    /* No SA_RESTART: a read blocked on a quiet pipe returns EINTR, and the push stops. A
     * second Ctrl-C is the default action: it ends tally at once. */
    struct sigaction sa = {.sa_handler = on_interrupt, .sa_flags = SA_RESETHAND};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

static int check_not_text(reader_t *r, const uint8_t *p, size_t len);

/* A whole number of units: "nothing was sent" for a file checked before sending. */
static void not_whole(const reader_t *r, uint64_t bytes, const char *tail)
{
    size_t esize = tally_dtype_size(r->dtype);
    if (r->unit == esize)
        cli_error("%s is %" PRIu64 " bytes, not a whole number of %zu-byte %s elements%s", r->name,
                  bytes, esize, cli_dtype_name(r->dtype), tail);
    else
        cli_error("%s is %" PRIu64 " bytes, not a whole number of %zu-byte frames%s", r->name,
                  bytes, r->unit, tail);
}

/* Binary input from a regular file: what it holds (from the read offset on, for `< file` after
 * something read part of it) is checked before anything is sent. 0 or an exit status. */
static int check_file(reader_t *r, const struct stat *st)
{
    off_t at = lseek(r->fd, 0, SEEK_CUR);
    if (at < 0 || at > st->st_size)
        at = 0;
    r->size = (uint64_t)(st->st_size - at);
    uint8_t sample[4096];
    ssize_t n = pread(r->fd, sample, sizeof sample, at);
    int rc = n > 0 ? check_not_text(r, sample, (size_t)n) : 0;
    if (rc)
        return rc;
    r->checked = false; /* the first fill checks again: a file may change */
    if (r->size % r->unit) {
        not_whole(r, r->size, ": nothing was sent");
        return EXIT_USAGE;
    }
    return 0;
}

int reader_open(reader_t *r, const char *path, bool text, tally_dtype_t dtype, size_t frame,
                bool force_binary)
{
    bool use_stdin = !path || !strcmp(path, "-");
    *r = (reader_t){.fd = use_stdin ? STDIN_FILENO : open(path, O_RDONLY | O_CLOEXEC),
                    .name = use_stdin ? "stdin" : path,
                    .text = text,
                    .force_binary = force_binary,
                    .dtype = dtype,
                    .unit = frame ? frame : tally_dtype_size(dtype),
                    .line = 1};
    if (r->fd < 0) {
        cli_error("cannot open '%s': %s", path, strerror(errno));
        return EXIT_USAGE;
    }
    if ((text && !(r->raw = malloc(TEXT_WINDOW))) || !(r->pending = malloc(r->unit))) {
        cli_error("out of memory");
        return EXIT_USAGE;
    }
    r->cap = TEXT_WINDOW;
    struct stat st;
    bool known = fstat(r->fd, &st) == 0;
    r->live = known && !S_ISREG(st.st_mode);
    if (!text && known && S_ISREG(st.st_mode))
        return check_file(r, &st);
    return 0;
}

void reader_close(reader_t *r)
{
    if (r->fd > STDIN_FILENO)
        close(r->fd);
    free(r->raw);
    free(r->pending);
    r->raw = NULL;
    r->pending = NULL;
    r->fd = -1;
}

/* read() until buf holds cap bytes or the input ends; stops early when interrupted, and on a
 * pipe or terminal once it holds `min` bytes and nothing more came for LIVE_IDLE_MS (a live
 * producer's data goes out without waiting for a full chunk). */
static int read_full(reader_t *r, uint8_t *buf, size_t cap, size_t min, size_t *len)
{
    *len = 0;
    while (*len < cap && !cli_interrupted) {
        if (r->live && *len >= min) {
            struct pollfd p = {.fd = r->fd, .events = POLLIN};
            int rc = poll(&p, 1, LIVE_IDLE_MS);
            if (rc == 0)
                break;
            if (rc < 0 && errno == EINTR)
                continue;
        }
        ssize_t n = read(r->fd, buf + *len, cap - *len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            cli_error("cannot read '%s': %s", r->name, strerror(errno));
            return EXIT_USAGE;
        }
        if (n == 0) {
            r->eof = true;
            break;
        }
        *len += (size_t)n;
        r->bytes_read += (uint64_t)n;
    }
    return 0;
}

bool reader_done(const reader_t *r)
{
    return r->eof && r->pending_len == 0 && r->pos == r->len;
}

int reader_tail_error(const reader_t *r)
{
    if (!r->trailing)
        return 0;
    if (r->text)
        cli_error("%s: %" PRIu64 " values are not a whole number of %zu-value %s pixels: the last "
                  "%zu were not sent",
                  r->name, r->token, r->unit, cli_dtype_name(r->dtype), r->trailing);
    else {
        char tail[64];
        snprintf(tail, sizeof tail, ": its last %zu byte%s not sent", r->trailing,
                 r->trailing == 1 ? " was" : "s were");
        not_whole(r, r->bytes_read, tail);
    }
    return EXIT_USAGE;
}

/* Binary input that is text is refused, rather than sent as elements made of its characters:
 * decimal numbers for every type, and for i32 and u16 any printable text (JSON, CSV: real
 * multi-byte elements are next to never all printable). Bytes (u8, rgb) may well be text, whose
 * byte histogram is a fair question, so for them only decimal numbers are refused. */
static int check_not_text(reader_t *r, const uint8_t *p, size_t len)
{
    size_t n = len < 4096 ? len : 4096, digits = 0, spaces = 0, other = 0;
    r->checked = true;
    if (r->force_binary || n == 0)
        return 0;
    for (size_t i = 0; i < n; i++) {
        if (p[i] >= '0' && p[i] <= '9')
            digits++;
        else if (p[i] == ' ' || p[i] == '\n' || p[i] == '\t' || p[i] == '\r')
            spaces++;
        else if (p[i] >= 0x20 && p[i] < 0x7f)
            other += p[i] != '-' && p[i] != '+';
        else
            return 0; /* a byte no text holds */
    }
    bool decimal = digits && spaces && !other;
    if (!decimal && (tally_dtype_size(r->dtype) == 1 || n < 4))
        return 0;
    size_t line = 0;
    while (line < n && p[line] != '\n')
        line++;
    char shown[CLI_ESCAPED_SIZE(24)];
    cli_escape(p, line, 24, shown, sizeof shown);
    if (decimal)
        cli_error("%s looks like decimal text ('%s'), not binary %s elements: add --text to "
                  "parse it, or --binary to send its bytes as they are",
                  r->name, shown, cli_dtype_name(r->dtype));
    else
        cli_error("%s looks like text ('%s'), not binary %s elements: --text takes whitespace-"
                  "separated decimal integers, --binary sends its bytes as they are",
                  r->name, shown, cli_dtype_name(r->dtype));
    return EXIT_USAGE;
}

static int fill_binary(reader_t *r, uint8_t *buf, size_t cap, size_t *len)
{
    size_t have = r->pending_len, got;
    memcpy(buf, r->pending, have); /* the part of a unit the last fill could not send */
    r->pending_len = 0;
    int rc = read_full(r, buf + have, cap - have, have < r->unit ? r->unit - have : 0, &got);
    if (rc)
        return rc;
    *len = have + got;
    if (!r->checked && (rc = check_not_text(r, buf, *len)) != 0)
        return rc;
    size_t rest = *len % r->unit;
    *len -= rest;
    if (rest && r->eof && !cli_interrupted) {
        r->trailing = rest; /* the whole units before it go; reader_tail_error says the rest */
        return 0;
    }
    memcpy(r->pending, buf + *len, rest); /* a unit cut by a pause (or Ctrl-C) waits */
    r->pending_len = rest;
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

/* A --text token that is not a value: where it is (line and column, counted in bytes from 1)
 * and what it is, escaped and cut short. */
static int bad_token(const reader_t *r, const char *start, size_t len, int bad, int64_t min,
                     int64_t max)
{
    uint64_t column = r->raw_offset + (uint64_t)(start - r->raw) - r->line_start + 1;
    char shown[CLI_ESCAPED_SIZE(32)];
    cli_escape(start, len, 32, shown, sizeof shown);
    bool binary = false;
    for (size_t i = 0; i < len; i++)
        binary = binary || (uint8_t)start[i] < 0x20 || (uint8_t)start[i] >= 0x7f;
    if (binary)
        cli_error("%s: line %" PRIu64 ", column %" PRIu64 ": '%s' is binary, not text: --text "
                  "takes whitespace-separated decimal integers (drop --text for binary input)",
                  r->name, r->line, column, shown);
    else if (bad == 1)
        cli_error("%s: line %" PRIu64 ", column %" PRIu64 ": '%s' is not an integer (--text takes "
                  "whitespace-separated decimal integers)",
                  r->name, r->line, column, shown);
    else
        cli_error("%s: line %" PRIu64 ", column %" PRIu64 ": '%s' is out of range for %s [%" PRId64
                  ", %" PRId64 "]",
                  r->name, r->line, column, shown, cli_dtype_name(r->dtype), min, max);
    return EXIT_USAGE;
}

/* Skips whitespace at pos and makes sure a whole token follows it in the window: *ready is
 * true when one does (it ends before the window does, the input ended after it, or it fills
 * the whole window, so it is too long and will be refused), false at the end of the input, on
 * Ctrl-C, or when a live producer paused inside a token (which then waits for the next fill,
 * so a number is never cut in two). Reads more as needed, moving the unparsed rest to the
 * window's front first. */
static int text_refill(reader_t *r, bool may_idle, bool *ready)
{
    *ready = false;
    for (;;) {
        while (r->pos < r->len && is_space(r->raw[r->pos])) {
            if (r->raw[r->pos++] == '\n') {
                r->line++;
                r->line_start = r->raw_offset + r->pos;
            }
        }
        const char *p = r->raw + r->pos, *end = r->raw + r->len;
        while (p < end && !is_space(*p))
            p++;
        if (p < end || r->eof || (r->pos == 0 && r->len == r->cap)) {
            *ready = r->pos < r->len;
            return 0;
        }
        if (cli_interrupted)
            return 0;
        memmove(r->raw, r->raw + r->pos, r->len - r->pos);
        r->raw_offset += r->pos;
        r->len -= r->pos;
        r->pos = 0;
        size_t got;
        size_t min = may_idle ? 0 : 1; /* a pause ends the fill when elements wait to go */
        int rc = read_full(r, (uint8_t *)r->raw + r->len, r->cap - r->len, min, &got);
        if (rc)
            return rc;
        r->len += got;
        if (!got && !r->eof)
            return 0; /* interrupted, or a live producer paused */
    }
}

/* One --text token is one value: an int32, a uint16, or a byte (u8, and each channel of an
 * rgb8/rgba8 pixel, so a pixel is 3 or 4 tokens). */
static size_t text_value_size(tally_dtype_t dtype)
{
    return dtype == TALLY_DTYPE_I32 ? 4 : dtype == TALLY_DTYPE_U16 ? 2 : 1;
}

static int fill_text(reader_t *r, uint8_t *buf, size_t cap, size_t *len)
{
    size_t esize = text_value_size(r->dtype);
    int64_t min = esize == 4 ? INT32_MIN : 0;
    int64_t max = esize == 4 ? INT32_MAX : esize == 2 ? UINT16_MAX : UINT8_MAX;
    *len = r->pending_len; /* the values of a pixel the last fill could not send */
    memcpy(buf, r->pending, r->pending_len);
    r->pending_len = 0;
    int rc = 0;
    while (*len + esize <= cap) {
        bool ready;
        if ((rc = text_refill(r, *len > 0, &ready)) != 0 || !ready)
            break; /* an error, the end of the input, Ctrl-C, or a pause */
        const char *start = r->raw + r->pos, *p = start;
        while (p < r->raw + r->len && !is_space(*p))
            p++;
        r->token++;
        r->pos = (size_t)(p - r->raw);
        int64_t v = 0;
        int bad = (size_t)(p - start) > TOKEN_MAX ? 1 : parse_token(start, p, min, max, &v);
        if (bad)
            return bad_token(r, start, (size_t)(p - start), bad, min, max);
        if (esize == 1)
            buf[*len] = (uint8_t)v;
        else if (esize == 2)
            tally_put_u16(buf + *len, (uint16_t)v);
        else
            tally_put_u32(buf + *len, (uint32_t)v);
        *len += esize;
    }
    size_t rest = *len % r->unit;
    if (rc || !rest)
        return rc;
    *len -= rest;
    if (r->eof && r->pos == r->len && !cli_interrupted) {
        r->trailing = rest; /* the whole pixels before them go; reader_tail_error says it */
        return 0;
    }
    memcpy(r->pending, buf + *len, rest); /* a pixel cut by a pause waits for its other values */
    r->pending_len = rest;
    return 0;
}

int reader_fill(reader_t *r, uint8_t *buf, size_t cap, size_t *len)
{
    return r->text ? fill_text(r, buf, cap, len) : fill_binary(r, buf, cap, len);
}

/* ---- Output ------------------------------------------------------------------------------- */

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

/* Formatting by hand into a block costs a fraction of printf per line, which matters for
 * outputs of hundreds of millions of values. */
void print_values(FILE *f, const uint8_t *p, size_t n, size_t size)
{
    char block[1 << 16];
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        int64_t v = size == 1   ? p[i]
                    : size == 2 ? tally_get_u16(p + 2 * i)
                    : size == 4 ? (int32_t)tally_get_u32(p + 4 * i)
                                : (int64_t)tally_get_u64(p + 8 * i);
        if (at > sizeof block - 24) {
            fwrite(block, 1, at, f);
            at = 0;
        }
        at += format_i64(block + at, v);
        block[at++] = '\n';
    }
    fwrite(block, 1, at, f);
}

/* ---- Progress ----------------------------------------------------------------------------- */

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void progress_start(progress_t *p, bool on, uint64_t total)
{
    *p = (progress_t){.on = on, .total = total, .start_ms = now_ms()};
}

/* "1.2 GiB" style, one decimal. */
static void human(char *buf, size_t cap, double v)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    unsigned u = 0;
    while (v >= 1024 && u < 4)
        v /= 1024, u++;
    snprintf(buf, cap, u ? "%.1f %s" : "%.0f %s", v, units[u]);
}

void progress_update(progress_t *p, uint64_t bytes)
{
    int64_t now = now_ms();
    if (!p->on || now - p->last_ms < 200)
        return;
    p->last_ms = now;
    double secs = (double)(now - p->start_ms) / 1000.0, rate = secs > 0 ? bytes / secs : 0;
    char done[32], total[32], speed[32], eta[32] = "";
    human(done, sizeof done, (double)bytes);
    human(speed, sizeof speed, rate);
    if (p->total) {
        human(total, sizeof total, (double)p->total);
        if (rate > 0 && p->total > bytes)
            snprintf(eta, sizeof eta, ", ETA %.0f s", (double)(p->total - bytes) / rate);
        fprintf(stderr, "\r\033[K%s of %s (%.0f%%), %s/s%s", done, total,
                100.0 * (double)bytes / (double)p->total, speed, eta);
    } else {
        fprintf(stderr, "\r\033[K%s, %s/s", done, speed);
    }
    fflush(stderr);
}

void progress_end(progress_t *p)
{
    if (p->on && p->last_ms)
        fputs("\r\033[K", stderr); /* the line goes away; the result (or error) follows */
}
