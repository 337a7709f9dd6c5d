/*
 * cli_io.c — input and output of the data commands: reading a file or stdin, turning --text
 * into elements, and printing results one value per line.
 */
#include "cli_io.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

void input_free(input_t *in)
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

int read_input(const char *path, input_t *in)
{
    bool use_stdin = !path || !strcmp(path, "-");
    const char *name = use_stdin ? "stdin" : path;
    int fd = use_stdin ? STDIN_FILENO : open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        cli_error("cannot open '%s': %s", path, strerror(errno));
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
        cli_error("out of memory reading '%s'", name);
        return EXIT_DAEMON;
    }
    if (status != TALLY_OK) {
        cli_error("cannot read '%s': %s", name, strerror(saved));
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

static void bad_token(const char *start, const char *p, size_t token, int bad, tally_dtype_t dtype,
                      int64_t min, int64_t max)
{
    int shown = p - start > 40 ? 40 : (int)(p - start);
    const char *more = p - start > 40 ? "..." : "";
    if (memchr(start, '\0', (size_t)(p - start)))
        cli_error("--text: token %zu contains a NUL byte (binary input? drop --text)", token);
    else if (bad == 1)
        cli_error("--text: token %zu '%.*s%s' is not an integer", token, shown, start, more);
    else
        cli_error("--text: token %zu '%.*s%s' is out of range for %s [%" PRId64 ", %" PRId64 "]",
                  token, shown, start, more, tally_dtype_name(dtype), min, max);
}

int parse_text(const input_t *text, tally_dtype_t dtype, tally_buf_t *out)
{
    int64_t min = dtype == TALLY_DTYPE_U8 ? 0 : INT32_MIN;
    int64_t max = dtype == TALLY_DTYPE_U8 ? UINT8_MAX : INT32_MAX;
    size_t esize = tally_dtype_size(dtype);
    /* Every token takes at least two bytes (digit and separator) except the last. */
    if (tally_buf_reserve(out, (text->len / 2 + 1) * esize) != TALLY_OK) {
        cli_error("out of memory parsing --text input");
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
            bad_token(start, p, token, bad, dtype, min, max);
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

void print_values(const uint8_t *p, size_t n, size_t size)
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

int write_binary(const char *path, const tally_buf_t *buf)
{
    bool use_stdout = !strcmp(path, "-");
    FILE *f = use_stdout ? stdout : fopen(path, "wb");
    if (!f) {
        cli_error("cannot open '%s' for writing: %s", path, strerror(errno));
        return EXIT_USAGE;
    }
    bool ok = fwrite(buf->data, 1, buf->len, f) == buf->len;
    ok = (use_stdout ? fflush(f) : fclose(f)) == 0 && ok;
    if (!ok) {
        cli_error("cannot write '%s': %s", path, strerror(errno));
        return EXIT_USAGE;
    }
    return 0;
}
