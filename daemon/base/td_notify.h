/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_notify.h — tallyd's side of the systemd service protocol: readiness and status
 * notifications (sd_notify) and socket activation (sd_listen_fds).
 *
 * Every function is a no-op when tallyd does not run under systemd (NOTIFY_SOCKET or
 * LISTEN_FDS unset), so the daemon behaves the same from a terminal.
 *
 * A notification that cannot be sent returns TD_ERR_LIBRARY for the caller to count
 * (tallyd_notify_failures_total); the first failure is logged at warning, later ones at debug,
 * so a watchdog ping every few seconds to a broken socket cannot flood the journal.
 */
#ifndef TD_NOTIFY_H
#define TD_NOTIFY_H

#include <stddef.h>
#include <stdint.h>

#include "td_config.h"
#include "td_err.h"

/* READY=1 with a STATUS= line: sockets are bound, the backend is up, state is restored. */
td_err_t td_notify_ready(const char *status);
/* STATUS=<line>: the one-line summary `systemctl status` shows. */
td_err_t td_notify_status(const char *status);
/* Around a configuration reload (SIGHUP): RELOADING=1 with the monotonic time, then READY=1
 * (what Type=notify-reload waits for; older systemd takes them as status updates). */
td_err_t td_notify_reloading(void);
td_err_t td_notify_reloaded(void);
/* STOPPING=1: shutdown has begun (in-flight requests are being answered). */
td_err_t td_notify_stopping(void);
/* WATCHDOG=1: the loop thread is alive. */
td_err_t td_notify_watchdog(void);
/* The watchdog interval systemd expects pings within (WatchdogSec=), 0 when none. */
uint64_t td_notify_watchdog_usec(void);

/* Number of listening sockets systemd passed (LISTEN_FDS, for this pid), read once and cached;
 * the environment variables are then unset so child processes do not inherit them. */
int td_listen_fds_count(void);
/* The passed socket number index (0 .. td_listen_fds_count() - 1): its fd, and the endpoint its
 * address names (tcp://IP:PORT, tcp://[IP6]:PORT or ipc://PATH) with its address family, for the
 * ZeroMQ transport to adopt (td_router.c). Logs and returns TD_ERR_BIND for a socket that is not
 * a listening stream socket of a supported family, or one on a network address that protected
 * mode refuses (td_config_check_endpoint). */
td_err_t td_listen_fd_endpoint(int index, const td_config_t *cfg, int *fd, char *endpoint,
                               size_t cap, int *family);
/* The passed socket that already holds the address a bind to endpoint would take (a unix path,
 * or a TCP port on the same address or the wildcard), or -1: binding it would fail with "Address
 * already in use", or, for ipc, take the path from under systemd's socket. */
int td_listen_fd_holding(const char *endpoint);

#endif
