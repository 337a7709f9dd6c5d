/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_notify.c — see td_notify.h.
 *
 * Socket activation: systemd hands over listening sockets as fds 3..3+N-1. ZeroMQ can adopt an
 * existing listening socket through the ZMQ_USE_FD option, which applies to the next zmq_bind
 * (td_router.c); the endpoint given to that bind must describe the fd's own address (ZeroMQ uses
 * it as the endpoint's name and, for ipc, does not unlink the path), so it is rebuilt here from
 * getsockname().
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>

#include "tally_args.h"
#include "td_log.h"
#include "td_monotonic.h"
#include "td_notify.h"

/* sd_notify's result (negative: an errno): a failure is logged and returned to be counted. */
static td_err_t notified(int rc, const char *what)
{
    static bool warned; /* loop thread only */
    if (rc >= 0)
        return TD_OK;
    if (!warned)
        td_warn("systemd: cannot send %s: %s (later failures are logged at debug and counted in "
                "tallyd_notify_failures_total)",
                what, strerror(-rc));
    else
        td_debug("systemd: cannot send %s: %s", what, strerror(-rc));
    warned = true;
    return TD_ERR_LIBRARY;
}

td_err_t td_notify_ready(const char *status)
{
    return notified(sd_notifyf(0, "READY=1\nSTATUS=%s", status), "READY=1");
}

td_err_t td_notify_status(const char *status)
{
    return notified(sd_notifyf(0, "STATUS=%s", status), "STATUS=");
}

td_err_t td_notify_reloading(void)
{
    int rc = sd_notifyf(0, "RELOADING=1\nMONOTONIC_USEC=%llu\nSTATUS=reloading the configuration",
                        (unsigned long long)(td_mono_ns() / 1000u));
    return notified(rc, "RELOADING=1");
}

td_err_t td_notify_reloaded(void)
{
    return notified(sd_notify(0, "READY=1"), "READY=1");
}

td_err_t td_notify_stopping(void)
{
    return notified(sd_notify(0, "STOPPING=1\nSTATUS=stopping: answering requests in flight"),
                    "STOPPING=1");
}

td_err_t td_notify_watchdog(void)
{
    return notified(sd_notify(0, "WATCHDOG=1"), "WATCHDOG=1");
}

uint64_t td_notify_watchdog_usec(void)
{
    uint64_t usec = 0;
    return sd_watchdog_enabled(0, &usec) > 0 ? usec : 0;
}

int td_listen_fds_count(void)
{
    static bool read_once;
    static int count;
    if (!read_once) {
        read_once = true;
        int n = sd_listen_fds(1);
        if (n < 0)
            td_warn("LISTEN_FDS is set but unusable: %s", strerror(-n));
        count = n > 0 ? n : 0;
    }
    return count;
}

/* Writes the ZeroMQ endpoint naming fd's local address into buf; else says why into why. */
static td_err_t fd_endpoint(int fd, char *buf, size_t cap, int *family, char *why, size_t why_cap)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    memset(&ss, 0, sizeof ss);
    if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0) {
        snprintf(why, why_cap, "fd %d: getsockname: %s", fd, strerror(errno));
        return TD_ERR_BIND;
    }
    *family = ss.ss_family;
    char ip[INET6_ADDRSTRLEN];
    if (ss.ss_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)&ss;
        inet_ntop(AF_INET, &in->sin_addr, ip, sizeof ip);
        snprintf(buf, cap, "tcp://%s:%u", ip, (unsigned)ntohs(in->sin_port));
        return TD_OK;
    }
    if (ss.ss_family == AF_INET6) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)&ss;
        inet_ntop(AF_INET6, &in6->sin6_addr, ip, sizeof ip);
        snprintf(buf, cap, "tcp://[%s]:%u", ip, (unsigned)ntohs(in6->sin6_port));
        return TD_OK;
    }
    if (ss.ss_family == AF_UNIX) {
        const struct sockaddr_un *un = (const struct sockaddr_un *)&ss;
        size_t path_len = len > offsetof(struct sockaddr_un, sun_path)
                              ? len - offsetof(struct sockaddr_un, sun_path)
                              : 0;
        if (path_len == 0) {
            snprintf(why, why_cap, "fd %d is an unnamed unix socket", fd);
            return TD_ERR_BIND;
        }
        if (un->sun_path[0] == '\0') /* abstract namespace: ZeroMQ spells it ipc://@name */
            snprintf(buf, cap, "ipc://@%.*s", (int)(path_len - 1), un->sun_path + 1);
        else
            snprintf(buf, cap, "ipc://%.*s", (int)strnlen(un->sun_path, path_len), un->sun_path);
        return TD_OK;
    }
    snprintf(why, why_cap, "fd %d has address family %d; tallyd takes inet, inet6 and unix", fd,
             (int)ss.ss_family);
    return TD_ERR_BIND;
}

td_err_t td_listen_fd_endpoint(int index, const td_config_t *cfg, int *fd, char *endpoint,
                               size_t cap, int *family)
{
    *fd = SD_LISTEN_FDS_START + index;
    if (sd_is_socket(*fd, AF_UNSPEC, SOCK_STREAM, 1) <= 0) {
        td_err("socket activation: fd %d is not a listening stream socket "
               "(use ListenStream= in the .socket unit)",
               *fd);
        return TD_ERR_BIND;
    }
    char why[1024];
    td_err_t err = fd_endpoint(*fd, endpoint, cap, family, why, sizeof why);
    if (err != TD_OK) {
        td_err("socket activation: %s", why);
        return err;
    }
    if (td_config_check_endpoint(cfg, endpoint, TD_ENDPOINT_REQUEST, why, sizeof why) != TD_OK) {
        td_err("socket activation: fd %d: %s", *fd, why);
        return TD_ERR_BIND;
    }
    return TD_OK;
}

/* Whether a socket bound to `held` and a bind to `want` (same family or not) are the one
 * address to the kernel: the same port, and the same address or either the wildcard. */
static bool same_tcp_address(const struct sockaddr *held, const struct sockaddr *want)
{
    const struct sockaddr_in *h4 = (const void *)held, *w4 = (const void *)want;
    const struct sockaddr_in6 *h6 = (const void *)held, *w6 = (const void *)want;
    bool h_any = held->sa_family == AF_INET ? h4->sin_addr.s_addr == htonl(INADDR_ANY)
                                            : IN6_IS_ADDR_UNSPECIFIED(&h6->sin6_addr);
    bool w_any = want->sa_family == AF_INET ? w4->sin_addr.s_addr == htonl(INADDR_ANY)
                                            : IN6_IS_ADDR_UNSPECIFIED(&w6->sin6_addr);
    in_port_t h_port = held->sa_family == AF_INET ? h4->sin_port : h6->sin6_port;
    in_port_t w_port = want->sa_family == AF_INET ? w4->sin_port : w6->sin6_port;
    if (h_port != w_port)
        return false;
    if (h_any || w_any)
        return true;
    if (held->sa_family != want->sa_family)
        return false;
    return held->sa_family == AF_INET
               ? h4->sin_addr.s_addr == w4->sin_addr.s_addr
               : memcmp(&h6->sin6_addr, &w6->sin6_addr, sizeof h6->sin6_addr) == 0;
}

/* Whether fd, a passed socket, holds an address of tcp://HOST:PORT (hostport). */
static bool fd_holds_tcp(int fd, const char *hostport)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    char host[256], port[16];
    if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0 ||
        (ss.ss_family != AF_INET && ss.ss_family != AF_INET6) ||
        !tally_hostport_split(hostport, host, sizeof host, port, sizeof port))
        return false;
    bool any = !strcmp(host, "*");
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV | (any ? AI_PASSIVE : 0)};
    struct addrinfo *res = NULL;
    if (getaddrinfo(any ? NULL : host, port, &hints, &res) != 0)
        return false;
    bool held = false;
    for (const struct addrinfo *ai = res; ai && !held; ai = ai->ai_next)
        held = (ai->ai_family == AF_INET || ai->ai_family == AF_INET6) &&
               same_tcp_address((const struct sockaddr *)&ss, ai->ai_addr);
    freeaddrinfo(res);
    return held;
}

int td_listen_fd_holding(const char *endpoint)
{
    for (int i = 0; i < td_listen_fds_count(); i++) {
        int fd = SD_LISTEN_FDS_START + i;
        if (!strncmp(endpoint, "tcp://", 6) && fd_holds_tcp(fd, endpoint + 6))
            return fd;
        char held[sizeof((struct sockaddr_un *)0)->sun_path + 16], why[160];
        int family = 0;
        if (!strncmp(endpoint, "ipc://", 6) &&
            fd_endpoint(fd, held, sizeof held, &family, why, sizeof why) == TD_OK &&
            family == AF_UNIX && !strcmp(held, endpoint))
            return fd;
    }
    return -1;
}
