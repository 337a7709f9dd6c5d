/*
 * td_state.c — see td_state.h for the file format and the guarantees.
 *
 * Decoding is two passes over the image: the first checks everything (header, checksum, every
 * record's name and info) without touching the stream table, the second inserts. So a bad
 * file never leaves half of its streams behind.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "td_config.h"
#include "td_log.h"
#include "td_state.h"

#define RECORD_MAX (1 + TALLY_STREAM_NAME_MAX + TALLY_QUERY_PAYLOAD_SIZE)
/* A state file larger than this is not one of ours (16M streams of the largest record). */
#define STATE_FILE_MAX ((size_t)RECORD_MAX << 24)

static void put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static uint64_t get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

uint64_t td_state_checksum(const uint8_t *buf, size_t len)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a 64 */
    for (size_t i = 0; i < len; i++) {
        h ^= buf[i];
        h *= 1099511628211ull;
    }
    return h;
}

tally_status_t td_state_encode(td_streams_t *streams, uint8_t **buf, size_t *len)
{
    size_t body = 0;
    uint32_t count = 0;
    for (td_stream_t *s = td_streams_first(streams); s; s = s->list_next) {
        body += 1 + s->name_len + TALLY_QUERY_PAYLOAD_SIZE;
        count++;
    }
    size_t total = TD_STATE_HEADER_SIZE + body + TD_STATE_TRAILER_SIZE;
    uint8_t *out = malloc(total);
    if (!out)
        return TALLY_E_INTERNAL;
    memcpy(out, TD_STATE_MAGIC, 8);
    put_u32(out + 8, TD_STATE_VERSION);
    put_u32(out + 12, count);
    put_u64(out + 16, body);
    put_u64(out + 24, (uint64_t)time(NULL));
    uint8_t *p = out + TD_STATE_HEADER_SIZE;
    for (td_stream_t *s = td_streams_first(streams); s; s = s->list_next) {
        *p++ = (uint8_t)s->name_len;
        memcpy(p, s->name, s->name_len);
        p += s->name_len;
        tally_stream_info_encode(&s->info, p);
        p += TALLY_QUERY_PAYLOAD_SIZE;
    }
    put_u64(p, td_state_checksum(out, total - TD_STATE_TRAILER_SIZE));
    *buf = out;
    *len = total;
    return TALLY_OK;
}

static bool valid_name(const uint8_t *name, size_t len)
{
    if (len == 0 || len > TALLY_STREAM_NAME_MAX)
        return false;
    for (size_t i = 0; i < len; i++)
        if (name[i] < 0x21 || name[i] > 0x7e)
            return false;
    return true;
}

/* Pass 1: checks the header, the checksum and every record. */
static tally_status_t check_image(const uint8_t *buf, size_t len, uint32_t *count, char *msg,
                                  size_t msg_cap)
{
    if (len < TD_STATE_HEADER_SIZE + TD_STATE_TRAILER_SIZE) {
        snprintf(msg, msg_cap, "truncated: %zu bytes is shorter than the header", len);
        return TALLY_E_PARAM;
    }
    if (memcmp(buf, TD_STATE_MAGIC, 8) != 0) {
        snprintf(msg, msg_cap, "not a tallyd state file (bad magic)");
        return TALLY_E_PARAM;
    }
    uint32_t version = get_u32(buf + 8);
    if (version != TD_STATE_VERSION) {
        snprintf(msg, msg_cap, "format version %u, this tallyd reads version %u", version,
                 TD_STATE_VERSION);
        return TALLY_E_PARAM;
    }
    uint64_t body = get_u64(buf + 16);
    if (body != len - TD_STATE_HEADER_SIZE - TD_STATE_TRAILER_SIZE) {
        snprintf(msg, msg_cap,
                 "truncated or extended: header says %llu bytes of records, file has %zu",
                 (unsigned long long)body, len - TD_STATE_HEADER_SIZE - TD_STATE_TRAILER_SIZE);
        return TALLY_E_PARAM;
    }
    uint64_t want = get_u64(buf + len - TD_STATE_TRAILER_SIZE);
    if (td_state_checksum(buf, len - TD_STATE_TRAILER_SIZE) != want) {
        snprintf(msg, msg_cap, "checksum mismatch");
        return TALLY_E_PARAM;
    }
    *count = get_u32(buf + 12);
    const uint8_t *p = buf + TD_STATE_HEADER_SIZE;
    const uint8_t *end = p + body;
    for (uint32_t i = 0; i < *count; i++) {
        size_t name_len = p < end ? *p : 0;
        if (p >= end || (size_t)(end - p) < 1 + name_len + TALLY_QUERY_PAYLOAD_SIZE ||
            !valid_name(p + 1, name_len)) {
            snprintf(msg, msg_cap, "record %u of %u is malformed", i + 1, *count);
            return TALLY_E_PARAM;
        }
        tally_stream_info_t info;
        if (tally_stream_info_decode(p + 1 + name_len, TALLY_QUERY_PAYLOAD_SIZE, &info) !=
            TALLY_OK) {
            snprintf(msg, msg_cap, "record %u of %u has an invalid stream state", i + 1, *count);
            return TALLY_E_PARAM;
        }
        p += 1 + name_len + TALLY_QUERY_PAYLOAD_SIZE;
    }
    if (p != end) {
        snprintf(msg, msg_cap, "%zu bytes after the last record", (size_t)(end - p));
        return TALLY_E_PARAM;
    }
    return TALLY_OK;
}

tally_status_t td_state_decode(const uint8_t *buf, size_t len, td_streams_t *streams, char *msg,
                               size_t msg_cap)
{
    uint32_t count = 0;
    tally_status_t st = check_image(buf, len, &count, msg, msg_cap);
    if (st != TALLY_OK)
        return st;
    const uint8_t *p = buf + TD_STATE_HEADER_SIZE;
    unsigned skipped = 0;
    for (uint32_t i = 0; i < count; i++) {
        size_t name_len = *p;
        const char *name = (const char *)p + 1;
        const uint8_t *info = p + 1 + name_len;
        p += 1 + name_len + TALLY_QUERY_PAYLOAD_SIZE;
        td_stream_t *stream = NULL;
        if (td_streams_find(streams, name, name_len) ||
            td_streams_get(streams, name, name_len, &stream) != TALLY_OK) {
            skipped++; /* a duplicate, or over max_streams */
            continue;
        }
        tally_stream_info_decode(info, TALLY_QUERY_PAYLOAD_SIZE, &stream->info);
    }
    if (skipped)
        td_warn("state: %u of %u streams not restored (duplicates or over max_streams)", skipped,
                count);
    return TALLY_OK;
}

static tally_status_t write_all(int fd, const uint8_t *buf, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return TALLY_E_IO;
        buf += n;
        len -= (size_t)n;
    }
    return TALLY_OK;
}

tally_status_t td_state_write(const char *dir, const uint8_t *buf, size_t len, char *msg,
                              size_t msg_cap)
{
    char path[4096], tmp[4096];
    snprintf(path, sizeof path, "%s/%s", dir, TD_STATE_FILE);
    snprintf(tmp, sizeof tmp, "%s/%s.tmp", dir, TD_STATE_FILE);
    const char *step = "create";
    const char *target = tmp;
    int dfd = -1;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        goto fail;
    step = "write";
    if (write_all(fd, buf, len) != TALLY_OK)
        goto fail_unlink;
    step = "fsync";
    if (fsync(fd) != 0)
        goto fail_unlink;
    step = "close";
    int rc = close(fd);
    fd = -1;
    if (rc != 0)
        goto fail_unlink;
    step = "rename";
    if (rename(tmp, path) != 0)
        goto fail_unlink;
    /* The rename is durable only once the directory entry is on disk. */
    step = "fsync";
    target = dir;
    dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || fsync(dfd) != 0)
        goto fail;
    close(dfd);
    return TALLY_OK;

fail_unlink:
    snprintf(msg, msg_cap, "%s %s: %s", step, target, strerror(errno));
    if (fd >= 0)
        close(fd);
    unlink(tmp);
    return TALLY_E_IO;
fail:
    snprintf(msg, msg_cap, "%s %s: %s", step, target, strerror(errno));
    if (dfd >= 0)
        close(dfd);
    return TALLY_E_IO;
}

/* Reads a whole file; TALLY_E_UNKNOWN_STREAM (reused as "absent") when it does not exist. */
static tally_status_t read_file(const char *path, uint8_t **buf, size_t *len, char *msg,
                                size_t msg_cap)
{
    tally_status_t st = TALLY_E_IO;
    uint8_t *data = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT)
            return TALLY_E_UNKNOWN_STREAM;
        snprintf(msg, msg_cap, "open: %s", strerror(errno));
        return TALLY_E_IO;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || sb.st_size < 0 || (size_t)sb.st_size > STATE_FILE_MAX) {
        snprintf(msg, msg_cap, "unreadable or too large");
        st = TALLY_E_PARAM;
        goto cleanup;
    }
    size_t size = (size_t)sb.st_size;
    data = malloc(size ? size : 1);
    if (!data) {
        snprintf(msg, msg_cap, "out of memory for %zu bytes", size);
        goto cleanup;
    }
    size_t got = 0;
    while (got < size) {
        ssize_t n = read(fd, data + got, size - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            snprintf(msg, msg_cap, "read: %s", strerror(errno));
            goto cleanup;
        }
        if (n == 0)
            break;
        got += (size_t)n;
    }
    *buf = data;
    *len = got;
    data = NULL;
    st = TALLY_OK;
cleanup:
    free(data);
    close(fd);
    return st;
}

/* Renames a bad state file to streams.state.corrupt-<UTC time> so it can be inspected. */
static void set_aside(const char *dir, const char *path, const char *why)
{
    char stamp[32], aside[4096];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &tm);
    snprintf(aside, sizeof aside, "%s/%s.corrupt-%s", dir, TD_STATE_FILE, stamp);
    if (rename(path, aside) == 0)
        td_warn("state: %s is unusable (%s); set aside as %s; starting with no streams", path, why,
                aside);
    else
        td_warn("state: %s is unusable (%s) and cannot be set aside (%s); starting with no "
                "streams",
                path, why, strerror(errno));
}

unsigned td_state_restore(const char *dir, td_streams_t *streams)
{
    char path[4096], msg[256] = "";
    snprintf(path, sizeof path, "%s/%s", dir, TD_STATE_FILE);
    uint8_t *buf = NULL;
    size_t len = 0;
    tally_status_t st = read_file(path, &buf, &len, msg, sizeof msg);
    if (st == TALLY_E_UNKNOWN_STREAM) {
        td_info("state: no %s yet; starting with no streams", path);
        return 0;
    }
    if (st == TALLY_E_IO) {
        td_warn("state: cannot read %s (%s); starting with no streams", path, msg);
        return 0;
    }
    if (st == TALLY_OK)
        st = td_state_decode(buf, len, streams, msg, sizeof msg);
    free(buf);
    if (st != TALLY_OK) {
        set_aside(dir, path, msg);
        return 0;
    }
    unsigned count = td_streams_count(streams);
    td_notice("state: restored %u streams from %s", count, path);
    return count;
}
