/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_log.c — see td_log.h. The level is an atomic so SIGHUP handling on the loop thread and
 * logging from worker threads need no lock; each line is formatted into one buffer and written
 * with a single write(2) so lines from different threads never interleave.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

#include "td_log.h"

static _Atomic int log_level = TD_LOG_INFO;

static const char *const level_names[] = {
    [TD_LOG_ERR] = "err",   [TD_LOG_WARNING] = "warning", [TD_LOG_NOTICE] = "notice",
    [TD_LOG_INFO] = "info", [TD_LOG_DEBUG] = "debug",
};

void td_log_set_level(td_log_level_t level)
{
    atomic_store(&log_level, (int)level);
}

td_log_level_t td_log_get_level(void)
{
    return (td_log_level_t)atomic_load(&log_level);
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
    int len = snprintf(line, sizeof line, "%s", prefix[level]);
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
