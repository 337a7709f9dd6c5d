/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_probe.c — one connection attempt to an endpoint, closed at once (tally_endpoint_probe,
 * tally.h).
 *
 * ZeroMQ connects in the background and retries forever, so a client whose daemon is not there
 * learns nothing from it but a timeout. The system says why at once: a refused TCP connect, a
 * Unix socket path that does not exist. A client asks it before its first connection is up
 * (tally.c, tally__wait_connected), and `tally watch` asks it for its status line.
 */
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "tally.h"
#include "tally_args.h"

/* A Unix socket at path (ZeroMQ's "@name": the abstract namespace) that accepts a
 * connection: 0, or errno. */
static int probe_ipc(const char *path)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    socklen_t len = sizeof addr;
    if (path[0] == '@') {
        size_t n = strnlen(path + 1, sizeof addr.sun_path - 1);
        memcpy(addr.sun_path + 1, path + 1, n);
        len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
    } else {
        snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return errno;
    int err = connect(fd, (struct sockaddr *)&addr, len) == 0 ? 0 : errno;
    close(fd);
    return err;
}

/* One TCP connect to ai, waiting at most timeout_ms: 0, ETIMEDOUT or the connect error. */
static int probe_tcp_addr(const struct addrinfo *ai, int timeout_ms)
{
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return errno;
    int err = connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        int rc;
        while ((rc = poll(&p, 1, timeout_ms)) < 0 && errno == EINTR)
            ;
        socklen_t len = sizeof err;
        if (rc == 0)
            err = ETIMEDOUT;
        else if (rc < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0)
            err = errno;
    }
    close(fd);
    return err;
}

/* Something accepts connections at a tcp://HOST:PORT: 0, or the last address's error. */
static int probe_tcp(const char *hostport, int timeout_ms)
{
    char host[256], port[16];
    if (!tally_hostport_split(hostport, host, sizeof host, port, sizeof port))
        return EINVAL;
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    if (getaddrinfo(host, port, &hints, &res) != 0)
        return EHOSTUNREACH;
    int err = EHOSTUNREACH;
    for (const struct addrinfo *ai = res; ai; ai = ai->ai_next)
        if ((err = probe_tcp_addr(ai, timeout_ms)) == 0)
            break;
    freeaddrinfo(res);
    return err;
}

int tally_endpoint_probe(const char *endpoint, int timeout_ms)
{
    if (!endpoint)
        return EINVAL;
    if (!strncmp(endpoint, "ipc://", 6))
        return probe_ipc(endpoint + 6);
    if (!strncmp(endpoint, "tcp://", 6))
        return probe_tcp(endpoint + 6, timeout_ms > 0 ? timeout_ms : 1);
    return EINVAL;
}
