/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_log.c — see td_log.h. The level is an atomic so SIGHUP handling on the loop thread and
 * logging from worker threads need no lock; each line is formatted into one buffer and written
 * with a single write(2) so lines from different threads never interleave.
 *
 * Whether a line starts with the time is decided once, at the first line: systemd sets
 * JOURNAL_STREAM to the device and inode of the stream it connected to stderr (systemd.exec(5)),
 * so stderr is the journal exactly when they are stderr's own. A descriptor redirected since (a
 * test's log file, `tallyd 2>x` in a unit's shell) is not, and gets the time like a terminal.
 */
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

#include "td_log.h"

static _Atomic int log_level = TD_LOG_INFO;
/* -1 until the first line decides: 1 when lines start with the time, 0 when stderr is the
 * journal (two threads deciding at once decide the same). */
static _Atomic int log_time = -1;

static const char *const level_names[] = {
    [TD_LOG_ERR] = "err",   [TD_LOG_WARNING] = "warning", [TD_LOG_NOTICE] = "notice",
    [TD_LOG_INFO] = "info", [TD_LOG_DEBUG] = "debug",
};

void td_log_set_level(td_log_level_t level)
{
    atomic_store(&log_level, (int)level);
}

int td_log_parse_level(const char *text)
{
    if (text[0] >= '3' && text[0] <= '7' && text[1] == '\0')
        return text[0] - '0';
    for (int level = TD_LOG_ERR; level <= TD_LOG_DEBUG; level++)
        if (strcasecmp(text, level_names[level]) == 0)
            return level;
    if (strcasecmp(text, "error") == 0)
        return TD_LOG_ERR;
    if (strcasecmp(text, "warn") == 0)
        return TD_LOG_WARNING;
    return -1;
}

const char *td_log_level_name(td_log_level_t level)
{
    return (level >= TD_LOG_ERR && level <= TD_LOG_DEBUG) ? level_names[level] : "?";
}

/* Whether stderr is the journal: JOURNAL_STREAM names stderr's device and inode. */
static bool stderr_is_journal(void)
{
    const char *stream = getenv("JOURNAL_STREAM");
    unsigned long long dev, ino;
    char end;
    struct stat st;
    return stream && sscanf(stream, "%llu:%llu%c", &dev, &ino, &end) == 2 &&
           fstat(STDERR_FILENO, &st) == 0 && (unsigned long long)st.st_dev == dev &&
           (unsigned long long)st.st_ino == ino;
}

/* "2026-12-02T10:15:03.042+01:00 " (with the space), the time now, into buf: its length, or 0
 * when the clock cannot be read. */
static size_t time_text(char *buf, size_t cap)
{
    struct timeval tv;
    struct tm tm;
    char zone[8];
    gettimeofday(&tv, NULL);
    if (!localtime_r(&tv.tv_sec, &tm) || strftime(zone, sizeof zone, "%z", &tm) != 5) /* +hhmm */
        return 0;
    size_t len = strftime(buf, cap, "%Y-%m-%dT%H:%M:%S", &tm);
    int more =
        snprintf(buf + len, cap - len, ".%03d%.3s:%s ", (int)(tv.tv_usec / 1000), zone, zone + 3);
    return len && more > 0 ? len + (size_t)more : 0;
}

void td_log(td_log_level_t level, const char *fmt, ...)
{
    if ((int)level > atomic_load(&log_level))
        return;
    char line[1024];
    static const char *const prefix[] = {[TD_LOG_ERR] = SD_ERR,
                                         [TD_LOG_WARNING] = SD_WARNING,
                                         [TD_LOG_NOTICE] = SD_NOTICE,
                                         [TD_LOG_INFO] = SD_INFO,
                                         [TD_LOG_DEBUG] = SD_DEBUG};
    int with_time = atomic_load(&log_time);
    if (with_time < 0) {
        with_time = !stderr_is_journal();
        atomic_store(&log_time, with_time);
    }
    size_t at = with_time ? time_text(line, sizeof line) : 0;
    int len = (int)at + snprintf(line + at, sizeof line - at, "%s", prefix[level]);
    va_list ap;
    va_start(ap, fmt);
    int body = vsnprintf(line + len, sizeof line - (size_t)len - 1, fmt, ap);
    va_end(ap);
    if (body < 0)
        return;
    len += body;
    if ((size_t)len > sizeof line - 2)
        len = (int)sizeof line - 2;
    line[len++] = '\n';
    ssize_t ignored = write(STDERR_FILENO, line, (size_t)len);
    (void)ignored;
}
