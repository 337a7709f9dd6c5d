/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_state_file.c — the state directory's files (td_state.h): atomic writes, appends to the
 * log, and the restore at start, which reads the base and the log, refuses a newer tallyd's
 * files, and keeps the evidence of damaged ones (set aside under names that never collide: the
 * time, the pid and a counter, and a rename or copy that refuses an existing name,
 * RENAME_NOREPLACE or O_EXCL, and tries the next).
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
#include "td_window.h"

/* A state file larger than this is not one of ours (64 GiB). */
#define STATE_FILE_MAX ((size_t)1 << 36)
/* How many set-aside names to try before giving up (each collision takes the next counter). */
#define ASIDE_TRIES 1000

/* ---- Writing ---------------------------------------------------------------------------- */

/* false with errno on error. */
static bool write_all(int fd, const uint8_t *buf, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return false;
        buf += n;
        len -= (size_t)n;
    }
    return true;
}

/* Writes, fsyncs and closes fd (closed in any case): NULL, or the step that failed (errno). */
static const char *write_sync_close(int fd, const uint8_t *buf, size_t len)
{
    const char *step = NULL;
    if (!write_all(fd, buf, len))
        step = "write";
    else if (fsync(fd) != 0)
        step = "fsync";
    int saved = errno;
    if (close(fd) != 0 && !step)
        return "close";
    errno = saved;
    return step;
}

/* A rename is durable only once the directory entry is on disk. -1 with errno on error. */
static int fsync_dir(const char *dir)
{
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0)
        return -1;
    int rc = fsync(dfd);
    int saved = errno;
    close(dfd);
    errno = saved;
    return rc;
}

td_err_t td_state_write_file(const char *dir, const char *name, const uint8_t *buf, size_t len,
                             char *msg, size_t msg_cap)
{
    char path[4096], tmp[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    snprintf(tmp, sizeof tmp, "%s/%s.tmp", dir, name);
    const char *step = "create";
    const char *target = tmp;
    bool made_tmp = false; /* a failure from here on removes the temporary file */
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        goto fail;
    made_tmp = true;
    step = write_sync_close(fd, buf, len);
    fd = -1;
    if (step)
        goto fail;
    step = "rename";
    if (rename(tmp, path) != 0)
        goto fail;
    made_tmp = false; /* renamed: it is the state file now */
    step = "fsync";
    target = dir;
    if (fsync_dir(dir) != 0)
        goto fail;
    return TD_OK;

fail:
    snprintf(msg, msg_cap, "%s %s: %s", step, target, strerror(errno));
    if (fd >= 0)
        close(fd);
    if (made_tmp)
        unlink(tmp);
    return TD_ERR_IO;
}

td_err_t td_state_append(const char *dir, size_t at, const uint8_t *buf, size_t len, char *msg,
                         size_t msg_cap)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, TD_STATE_LOG_FILE);
    const char *step = "open";
    int fd = open(path, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0)
        goto fail;
    step = "truncate"; /* what a failed append may have left after the last whole record */
    if (ftruncate(fd, (off_t)at) != 0 || lseek(fd, (off_t)at, SEEK_SET) < 0)
        goto fail;
    step = write_sync_close(fd, buf, len);
    fd = -1;
    if (!step)
        return TD_OK;
fail:
    snprintf(msg, msg_cap, "%s %s: %s", step, path, strerror(errno));
    if (fd >= 0)
        close(fd);
    return TD_ERR_IO;
}

/* ---- Restoring -------------------------------------------------------------------------- */

static const char *file_kind(mode_t mode)
{
    if (S_ISDIR(mode))
        return "a directory";
    if (S_ISLNK(mode))
        return "a symbolic link";
    if (S_ISFIFO(mode))
        return "a FIFO";
    if (S_ISSOCK(mode))
        return "a socket";
    return "a device or other non-regular file";
}

/* Every snapshot is written to the temporary name and renamed over the state file: something
 * other than a regular file at either name would make every snapshot fail (or, for a symbolic
 * link, be replaced by the first one). */
static td_err_t check_tmp(const char *tmp, char *msg, size_t cap)
{
    struct stat sb;
    if (lstat(tmp, &sb) == 0 && !S_ISREG(sb.st_mode)) {
        snprintf(msg, cap, "%s is %s, where tallyd writes every snapshot; remove it", tmp,
                 file_kind(sb.st_mode));
        return TD_ERR_IO;
    }
    return TD_OK;
}

/* Opens the state file for reading: absent (TD_OK, *fd_out -1), a regular file (TD_OK, *fd_out)
 * or unusable (TD_ERR_IO, msg). O_NONBLOCK so a FIFO cannot block the start; O_NOFOLLOW so a
 * link is refused, not replaced. */
static td_err_t open_state(const char *path, int *fd_out, struct stat *sb, char *msg, size_t cap)
{
    *fd_out = -1;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0 && errno == ENOENT)
        return TD_OK;
    if (fd < 0 && errno == ELOOP) {
        snprintf(msg, cap,
                 "%s is a symbolic link; tallyd replaces the file on every snapshot, "
                 "so point the state directory at the real one",
                 path);
        return TD_ERR_IO;
    }
    if (fd < 0) {
        snprintf(msg, cap, "cannot open %s: %s", path, strerror(errno));
        return TD_ERR_IO;
    }
    if (fstat(fd, sb) != 0 || !S_ISREG(sb->st_mode)) {
        snprintf(msg, cap,
                 "%s is %s, not a regular file; remove it or choose another state "
                 "directory",
                 path, file_kind(sb->st_mode));
        close(fd);
        return TD_ERR_IO;
    }
    *fd_out = fd;
    return TD_OK;
}

/* Reads the whole state file into *buf (NULL when there is none). TD_ERR_CORRUPT when it is too
 * large to be ours; TD_ERR_IO or TD_ERR_NOMEM when it cannot be read. */
static td_err_t read_state(const char *path, uint8_t **buf, size_t *len, char *msg, size_t cap)
{
    struct stat sb = {0};
    int fd = -1;
    *buf = NULL;
    td_err_t st = open_state(path, &fd, &sb, msg, cap);
    if (st != TD_OK || fd < 0)
        return st;
    uint8_t *data = NULL;
    size_t size = (size_t)sb.st_size, got = 0;
    if (sb.st_size < 0 || size > STATE_FILE_MAX) {
        snprintf(msg, cap, "%lld bytes is too large for a state file", (long long)sb.st_size);
        st = TD_ERR_CORRUPT;
        goto cleanup;
    }
    st = TD_ERR_NOMEM;
    data = malloc(size ? size : 1);
    if (!data) {
        snprintf(msg, cap, "out of memory for %zu bytes of %s", size, path);
        goto cleanup;
    }
    st = TD_ERR_IO;
    while (got < size) {
        ssize_t n = read(fd, data + got, size - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            snprintf(msg, cap, "cannot read %s: %s", path, strerror(errno));
            goto cleanup;
        }
        if (n == 0)
            break;
        got += (size_t)n;
    }
    *buf = data;
    *len = got;
    data = NULL;
    st = TD_OK;
cleanup:
    free(data);
    close(fd);
    return st;
}

/* DIR/FILE.corrupt-<UTC time>-<pid>-<n>: a new n for every try, in this process. */
static void aside_name(char *out, size_t cap, const char *dir, const char *file)
{
    static unsigned serial;
    char stamp[32];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &tm);
    snprintf(out, cap, "%s/%s.corrupt-%s-%ld-%u", dir, file, stamp, (long)getpid(), ++serial);
}

/* rename() that fails with EEXIST instead of replacing `to`. */
static int rename_noreplace(const char *from, const char *to)
{
    if (renameat2(AT_FDCWD, from, AT_FDCWD, to, RENAME_NOREPLACE) == 0)
        return 0;
    if (errno != EINVAL && errno != ENOSYS)
        return -1;
    /* A file system without RENAME_NOREPLACE: link() refuses an existing name too. */
    if (link(from, to) != 0)
        return -1;
    return unlink(from);
}

/* Moves the state file aside (buf NULL) or writes a copy of buf beside it; the name it got is
 * in aside, or -1 with errno. */
static int set_aside(const char *dir, const char *file, const uint8_t *buf, size_t len,
                     char *aside, size_t cap)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    for (int i = 0; i < ASIDE_TRIES; i++) {
        aside_name(aside, cap, dir, file);
        if (!buf) {
            if (rename_noreplace(path, aside) == 0)
                return 0;
        } else {
            int fd = open(aside, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
            if (fd >= 0) {
                int rc = write_all(fd, buf, len) && fsync(fd) == 0 ? 0 : -1;
                int saved = errno;
                close(fd);
                errno = saved;
                return rc;
            }
        }
        if (errno != EEXIST)
            return -1;
    }
    return -1;
}

/* Logs what a restore found and keeps the evidence: an unusable base is moved aside, one that
 * lost records is copied aside (it stays in place until the next snapshot replaces it). */
static void report_base(const char *dir, const char *path, td_err_t st, const uint8_t *buf,
                        size_t len, const td_state_report_t *r, const char *why)
{
    char aside[4200];
    if (st != TD_OK) {
        if (set_aside(dir, TD_STATE_FILE, NULL, 0, aside, sizeof aside) == 0)
            td_warn("state: %s is unusable (%s); set aside as %s; starting with no streams", path,
                    why, aside);
        else
            td_warn("state: %s is unusable (%s) and cannot be set aside (%s); starting with no "
                    "streams",
                    path, why, strerror(errno));
        return;
    }
    if (r->nomem) /* the restore fails (td_state_restore): nothing to set aside */
        return;
    bool lossy = r->damaged || r->missing || r->over_limit || r->extra_bytes;
    if (!lossy) {
        td_notice("state: restored %u streams from %s (format version %u)", r->restored, path,
                  r->version);
        return;
    }
    if (set_aside(dir, TD_STATE_FILE, buf, len, aside, sizeof aside) == 0)
        td_warn("state: restored %u of the %u streams in %s (%u damaged, %u cut off, %u over "
                "max_streams or max_state_bytes); a copy of the file is set aside as %s",
                r->restored, r->records, path, r->damaged, r->missing, r->over_limit, aside);
    else
        td_warn("state: restored %u of the %u streams in %s (%u damaged, %u cut off, %u over "
                "max_streams or max_state_bytes); no copy could be set aside: %s",
                r->restored, r->records, path, r->damaged, r->missing, r->over_limit,
                strerror(errno));
}

/* The log after its base: applied (a copy set aside when records were damaged), ignored when
 * stale, renamed aside when unusable or without a base of version 4 to continue. */
static void restore_log(const char *dir, const uint8_t *buf, size_t len, bool base_ok,
                        td_streams_t *streams, uint64_t now_ms, td_state_report_t *r)
{
    char why[256] = "", aside[4200];
    td_err_t st = TD_ERR_CORRUPT;
    if (base_ok && r->version == TD_STATE_VERSION)
        st = td_state_log_decode(buf, len, now_ms, streams, r, why, sizeof why);
    else
        snprintf(why, sizeof why, "no state file of format version %u for it to continue",
                 TD_STATE_VERSION);
    if (r->nomem) /* the restore fails (td_state_restore): the log stays where it is */
        return;
    if (st != TD_OK) {
        r->log_unusable = true;
        if (set_aside(dir, TD_STATE_LOG_FILE, NULL, 0, aside, sizeof aside) == 0)
            td_warn("state: %s/%s is unusable (%s); set aside as %s", dir, TD_STATE_LOG_FILE, why,
                    aside);
        else
            td_warn("state: %s/%s is unusable (%s) and cannot be set aside: %s", dir,
                    TD_STATE_LOG_FILE, why, strerror(errno));
    } else if (r->log_stale) {
        td_notice("state: %s/%s continues an older state file (a compaction a crash interrupted); "
                  "ignored: its changes are in the state file",
                  dir, TD_STATE_LOG_FILE);
    } else if (r->log_damaged && set_aside(dir, TD_STATE_LOG_FILE, buf, len, aside,
                                           sizeof aside) == 0) {
        td_warn("state: %u of the %u records of the log were damaged; a copy of the log is set "
                "aside as %s",
                r->log_damaged, r->log_records + r->log_damaged, aside);
    } else {
        td_notice("state: applied %u changes from %s/%s", r->log_records, dir, TD_STATE_LOG_FILE);
    }
}

/* A newer tallyd's file, base or log: checked before anything is restored from either. */
static td_err_t refuse_newer(const char *path, const uint8_t *buf, size_t len, const char *magic,
                             char *msg, size_t cap)
{
    if (!buf || len < 12 || memcmp(buf, magic, 8) != 0 ||
        tally_get_u32(buf + 8) <= TD_STATE_VERSION)
        return TD_OK;
    snprintf(msg, cap,
             "%s was written by a newer tallyd (format version %u; this tallyd reads versions 1 "
             "to %u): run that tallyd or a newer one, or move the file away to start without its "
             "streams",
             path, tally_get_u32(buf + 8), TD_STATE_VERSION);
    return TD_ERR_VERSION;
}

td_err_t td_state_restore(const char *dir, td_streams_t *streams, td_state_report_t *report,
                          char *msg, size_t msg_cap)
{
    static const char *const names[] = {TD_STATE_FILE, TD_STATE_LOG_FILE};
    char path[2][4096], tmp[4096], why[256] = "";
    uint8_t *buf[2] = {NULL, NULL};
    size_t len[2] = {0, 0};
    td_err_t st[2] = {TD_OK, TD_OK}, err = TD_OK;
    memset(report, 0, sizeof *report);
    for (int f = 0; f < 2 && err == TD_OK; f++) {
        snprintf(path[f], sizeof path[f], "%s/%s", dir, names[f]);
        snprintf(tmp, sizeof tmp, "%s/%s.tmp", dir, names[f]);
        err = check_tmp(tmp, msg, msg_cap);
        if (err == TD_OK)
            st[f] = read_state(path[f], &buf[f], &len[f], msg, msg_cap);
        if (st[f] != TD_OK && st[f] != TD_ERR_CORRUPT) /* unusable: every snapshot would fail */
            err = st[f];
    }
    if (err == TD_OK)
        err = refuse_newer(path[0], buf[0], len[0], TD_STATE_MAGIC, msg, msg_cap);
    if (err == TD_OK)
        err = refuse_newer(path[1], buf[1], len[1], TD_STATE_LOG_MAGIC, msg, msg_cap);
    if (err != TD_OK)
        goto done;
    uint64_t now_ms = td_clock_ms();
    if (buf[0]) {
        st[0] = td_state_decode(buf[0], len[0], now_ms, streams, report, why, sizeof why);
        report->base_bytes = st[0] == TD_OK ? len[0] : 0;
        report_base(dir, path[0], st[0], buf[0], len[0], report, why);
    } else if (st[0] == TD_ERR_CORRUPT) {
        report_base(dir, path[0], st[0], NULL, 0, report, msg);
    } else {
        td_info("state: no %s yet; starting with no streams", path[0]);
    }
    if (!report->nomem && (buf[1] || st[1] == TD_ERR_CORRUPT))
        restore_log(dir, buf[1], len[1], buf[0] && st[0] == TD_OK, streams, now_ms, report);
    /* Out of memory for a good record: starting without its stream would lose it at the next
     * snapshot, so tallyd does not start, and the files stay as they are (alloc sweep, issue 25:
     * such a stream was counted damaged or over the limits, and dropped). */
    if (report->nomem) {
        snprintf(msg, msg_cap,
                 "out of memory restoring %u streams from %s; the files are unchanged",
                 report->nomem, dir);
        err = TD_ERR_NOMEM;
    }
done:
    free(buf[0]);
    free(buf[1]);
    return err;
}
