/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_log.h — tallyd's logging: one line per event on stderr, prefixed with sd-daemon(3)'s
 * priority prefix (SD_ERR "<3>" ... SD_DEBUG "<7>") so journald assigns each line its priority
 * when tallyd runs as a systemd service. Every line tallyd writes to stderr carries one, the
 * command-line errors of main.c included.
 *
 * Where stderr is not the journal (a terminal, a file: JOURNAL_STREAM unset or naming another
 * stream), the journal cannot add the time, so each line starts with it, local time to the
 * millisecond as RFC 3339 has it, before the prefix:
 *   2026-12-02T10:15:03.042+01:00 <6>listening on tcp://127.0.0.1:5555
 */
#ifndef TD_LOG_H
#define TD_LOG_H

#include <stdarg.h>
#include <syslog.h>

/* syslog(3) priorities (the system's numbers); only these five are used. */
typedef enum {
    TD_LOG_ERR = LOG_ERR,
    TD_LOG_WARNING = LOG_WARNING,
    TD_LOG_NOTICE = LOG_NOTICE,
    TD_LOG_INFO = LOG_INFO,
    TD_LOG_DEBUG = LOG_DEBUG,
} td_log_level_t;

void td_log_set_level(td_log_level_t level);
/* Parses "err", "warning", "notice", "info", "debug" or a digit 3..7; -1 when invalid. */
int td_log_parse_level(const char *text);
const char *td_log_level_name(td_log_level_t level);

void td_log(td_log_level_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define td_err(...) td_log(TD_LOG_ERR, __VA_ARGS__)
#define td_warn(...) td_log(TD_LOG_WARNING, __VA_ARGS__)
#define td_notice(...) td_log(TD_LOG_NOTICE, __VA_ARGS__)
#define td_info(...) td_log(TD_LOG_INFO, __VA_ARGS__)
#define td_debug(...) td_log(TD_LOG_DEBUG, __VA_ARGS__)

#endif
