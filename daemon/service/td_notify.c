/*
 * td_notify.c — see td_notify.h.
 *
 * Socket activation: systemd hands over listening sockets as fds 3..3+N-1. ZeroMQ can adopt an
 * existing listening socket through the ZMQ_USE_FD option, which applies to the next zmq_bind;
 * the endpoint given to that bind must describe the fd's own address (ZeroMQ uses it as the
 * endpoint's name and, for ipc, does not unlink the path), so it is rebuilt from getsockname().
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <systemd/sd-daemon.h>
#include <zmq.h>

#include "td_log.h"
#include "td_notify.h"

void td_notify_ready(const char *status)
{
    sd_notifyf(0, "READY=1\nSTATUS=%s", status);
}

void td_notify_status(const char *status)
{
    sd_notifyf(0, "STATUS=%s", status);
}

void td_notify_reloading(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    sd_notifyf(0, "RELOADING=1\nMONOTONIC_USEC=%llu\nSTATUS=reloading the configuration",
               (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000);
}

void td_notify_reloaded(void)
{
    sd_notify(0, "READY=1");
}

void td_notify_stopping(void)
{
    sd_notify(0, "STOPPING=1\nSTATUS=stopping: answering requests in flight");
}

void td_notify_watchdog(void)
{
    sd_notify(0, "WATCHDOG=1");
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

/* Writes the ZeroMQ endpoint naming fd's local address into buf. */
static tally_status_t fd_endpoint(int fd, char *buf, size_t cap, int *family)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    memset(&ss, 0, sizeof ss);
    if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0) {
        td_err("socket activation: fd %d: getsockname: %s", fd, strerror(errno));
        return TALLY_E_PARAM;
    }
    *family = ss.ss_family;
    char ip[INET6_ADDRSTRLEN];
    if (ss.ss_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)&ss;
        inet_ntop(AF_INET, &in->sin_addr, ip, sizeof ip);
        snprintf(buf, cap, "tcp://%s:%u", ip, (unsigned)ntohs(in->sin_port));
        return TALLY_OK;
    }
    if (ss.ss_family == AF_INET6) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)&ss;
        inet_ntop(AF_INET6, &in6->sin6_addr, ip, sizeof ip);
        snprintf(buf, cap, "tcp://[%s]:%u", ip, (unsigned)ntohs(in6->sin6_port));
        return TALLY_OK;
    }
    if (ss.ss_family == AF_UNIX) {
        const struct sockaddr_un *un = (const struct sockaddr_un *)&ss;
        size_t path_len = len > offsetof(struct sockaddr_un, sun_path)
                              ? len - offsetof(struct sockaddr_un, sun_path)
                              : 0;
        if (path_len == 0) {
            td_err("socket activation: fd %d is an unnamed unix socket", fd);
            return TALLY_E_PARAM;
        }
        if (un->sun_path[0] == '\0') /* abstract namespace: ZeroMQ spells it ipc://@name */
            snprintf(buf, cap, "ipc://@%.*s", (int)(path_len - 1), un->sun_path + 1);
        else
            snprintf(buf, cap, "ipc://%.*s", (int)strnlen(un->sun_path, path_len), un->sun_path);
        return TALLY_OK;
    }
    td_err("socket activation: fd %d has address family %d; tallyd takes inet, inet6 and unix", fd,
           (int)ss.ss_family);
    return TALLY_E_PARAM;
}

tally_status_t td_listen_fds_bind(void *zsock, const td_config_t *cfg)
{
    int n = td_listen_fds_count();
    tally_status_t st = TALLY_OK;
    for (int fd = SD_LISTEN_FDS_START; fd < SD_LISTEN_FDS_START + n; fd++) {
        if (sd_is_socket(fd, AF_UNSPEC, SOCK_STREAM, 1) <= 0) {
            td_err("socket activation: fd %d is not a listening stream socket "
                   "(use ListenStream= in the .socket unit)",
                   fd);
            st = TALLY_E_PARAM;
            break;
        }
        char endpoint[160];
        int family = 0;
        st = fd_endpoint(fd, endpoint, sizeof endpoint, &family);
        if (st != TALLY_OK)
            break;
        char why[1024];
        if (td_config_check_endpoint(cfg, endpoint, false, why, sizeof why) != TD_OK) {
            td_err("socket activation: fd %d: %s", fd, why);
            st = TALLY_E_PARAM;
            break;
        }
        if (family == AF_INET6) {
            int one = 1;
            zmq_setsockopt(zsock, ZMQ_IPV6, &one, sizeof one);
        }
        int use_fd = fd;
        zmq_setsockopt(zsock, ZMQ_USE_FD, &use_fd, sizeof use_fd);
        if (zmq_bind(zsock, endpoint) != 0) {
            td_err("socket activation: cannot adopt fd %d (%s): %s", fd, endpoint,
                   zmq_strerror(errno));
            st = TALLY_E_PARAM;
            break;
        }
        td_info("listening on %s (socket fd %d from systemd)", endpoint, fd);
    }
    int none = -1; /* later binds create their own sockets */
    zmq_setsockopt(zsock, ZMQ_USE_FD, &none, sizeof none);
    return st;
}
