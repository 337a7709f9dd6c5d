/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_args.c — sizes and endpoints as people type them (contracts in tally_args.h).
 *
 * Host names go through getaddrinfo (numeric service only, so no /etc/services surprises), so
 * IPv4, IPv6 and names all work and a typo fails here with the resolver's reason, not later as
 * a connection that never comes up.
 */
#include "tally_args.h"

#include <errno.h>
#include <limits.h>
#include <net/if.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>

static tally_status_t refuse(char *why, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static tally_status_t refuse(char *why, size_t cap, const char *fmt, ...)
{
    if (why && cap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, cap, fmt, ap);
        va_end(ap);
    }
    return TALLY_E_PARAM;
}

tally_status_t tally_size_parse(const char *text, size_t *out, char *why, size_t why_cap)
{
    if (!text || !*text)
        return refuse(why, why_cap, "empty");
    if (text[0] < '0' || text[0] > '9')
        return refuse(why, why_cap, "not a number of bytes (digits, then K, M or G)");
    char *end = NULL;
    errno = 0;
    unsigned long long value = strtoull(text, &end, 10);
    if (errno == ERANGE)
        return refuse(why, why_cap, "too large");
    unsigned shift = 0;
    switch (*end) {
    case 'k':
    case 'K':
        shift = 10;
        break;
    case 'm':
    case 'M':
        shift = 20;
        break;
    case 'g':
    case 'G':
        shift = 30;
        break;
    case '\0':
        break;
    default: {
        return refuse(why, why_cap, "unknown suffix '%.8s' (use K, M or G)", end);
    }
    }
    if (shift) {
        end++;
        if (end[0] == 'i' && end[1] == 'B')
            end += 2;
        else if (end[0] == 'i' || end[0] == 'B')
            end++;
    }
    if (*end)
        return refuse(why, why_cap, "unexpected '%s' after the size", end);
    if (value > (SIZE_MAX >> shift))
        return refuse(why, why_cap, "too large");
    *out = (size_t)(value << shift);
    return TALLY_OK;
}

bool tally_hostport_split(const char *text, char *host, size_t host_cap, char *port,
                          size_t port_cap)
{
    const char *colon;
    const char *h = text;
    size_t hlen;
    if (text[0] == '[') {
        const char *close = strchr(text, ']');
        if (!close || close[1] != ':')
            return false;
        h = text + 1;
        hlen = (size_t)(close - h);
        colon = close + 1;
    } else {
        colon = strrchr(text, ':');
        if (!colon)
            return false;
        hlen = (size_t)(colon - text);
    }
    if (hlen >= host_cap || strlen(colon + 1) >= port_cap)
        return false;
    memcpy(host, h, hlen);
    host[hlen] = '\0';
    strcpy(port, colon + 1);
    return true;
}

bool tally_endpoint_ipv6(const char *endpoint)
{
    return strncmp(endpoint, "tcp://[", 7) == 0;
}

/* A decimal TCP port 1..65535, nothing else. */
static bool port_valid(const char *port)
{
    if (!*port || strlen(port) > 5)
        return false;
    for (const char *p = port; *p; p++)
        if (*p < '0' || *p > '9')
            return false;
    long v = strtol(port, NULL, 10);
    return v >= 1 && v <= 65535;
}

static tally_status_t check_tcp(const char *addr, tally_endpoint_use_t use, char *why, size_t cap)
{
    char host[256], port[16];
    if (!tally_hostport_split(addr, host, sizeof host, port, sizeof port))
        return refuse(why, cap, "'%s' is not HOST:PORT", addr);
    bool any_port = use == TALLY_ENDPOINT_BIND && !strcmp(port, "*"); /* ZeroMQ picks one */
    if (!any_port && !port_valid(port))
        return refuse(why, cap, "port '%s' is not a number from 1 to 65535%s", port,
                      use == TALLY_ENDPOINT_BIND ? " or *" : "");
    if (!host[0])
        return refuse(why, cap, "no host before the port");
    if (use == TALLY_ENDPOINT_BIND && (!strcmp(host, "*") || if_nametoindex(host) != 0))
        return TALLY_OK;
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    int rc = getaddrinfo(host, any_port ? NULL : port, &hints, &res);
    if (res)
        freeaddrinfo(res);
    if (rc != 0) {
        return refuse(why, cap, "cannot resolve host '%s': %s", host, gai_strerror(rc));
    }
    return TALLY_OK;
}

tally_status_t tally_endpoint_check(const char *endpoint, tally_endpoint_use_t use, char *why,
                                    size_t why_cap)
{
    if (!endpoint || !*endpoint)
        return refuse(why, why_cap, "empty endpoint");
    if (!strncmp(endpoint, "tcp://", 6))
        return check_tcp(endpoint + 6, use, why, why_cap);
    if (!strncmp(endpoint, "ipc://", 6)) {
        const char *path = endpoint + 6;
        if (!*path)
            return refuse(why, why_cap, "ipc:// needs a path");
        if (strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path))
            return refuse(why, why_cap, "ipc path longer than a Unix socket address allows");
        return TALLY_OK;
    }
    return refuse(why, why_cap, "unsupported transport (use tcp://HOST:PORT or ipc://PATH)");
}

tally_status_t tally_duration_parse(const char *text, uint64_t min_ms, uint64_t max_ms,
                                    uint64_t *out_ms)
{
    static const struct {
        const char *unit;
        double ms;
    } units[] = {{"ms", 1}, {"s", 1000}, {"", 1000}, {"m", 60000}, {"h", 3600000}};
    char *end = NULL;
    double v = -1;
    if (text && ((*text >= '0' && *text <= '9') || *text == '.')) { /* no sign, inf or hex */
        errno = 0;
        v = strtod(text, &end);
        if (errno || end == text)
            v = -1;
    }
    for (size_t i = 0; v >= 0 && i < sizeof units / sizeof units[0]; i++) {
        if (strcmp(end, units[i].unit))
            continue;
        double ms = v * units[i].ms + 0.5;
        if (ms >= (double)min_ms && ms < (double)max_ms + 1) {
            *out_ms = (uint64_t)ms;
            return TALLY_OK;
        }
        break;
    }
    return TALLY_E_PARAM;
}
