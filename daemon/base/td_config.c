/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_config.c — what follows from a configuration's values (the limits that 0 means "derived"
 * for, the endpoint checks of protected mode), as pure functions of td_config_t. The settings,
 * their defaults and how each is read are the table in td_settings.c; a configuration is made
 * from it by td_settings_load.c. Nothing here includes the table: it sits above this file.
 */
#include <arpa/inet.h>
#include <sched.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally_args.h"
#include "td_config.h"
#include "td_log.h"

size_t td_config_max_frame(const td_config_t *cfg)
{
    return cfg->max_frame ? cfg->max_frame : TD_MAX_FRAME_FACTOR * cfg->max_batch;
}

unsigned td_config_inflight_per_peer(const td_config_t *cfg, unsigned active)
{
    if (cfg->max_inflight_per_peer)
        return cfg->max_inflight_per_peer;
    unsigned floor = cfg->max_inflight < TD_FAIR_SHARE_MIN ? cfg->max_inflight : TD_FAIR_SHARE_MIN;
    unsigned share = cfg->max_inflight / (active ? active : 1);
    return share > floor ? share : floor;
}

unsigned td_config_streams_per_client(const td_config_t *cfg)
{
    if (cfg->max_streams_per_client)
        return cfg->max_streams_per_client;
    return cfg->max_streams / 2 ? cfg->max_streams / 2 : 1;
}

uint64_t td_config_reply_bytes_per_peer(const td_config_t *cfg)
{
    if (cfg->max_reply_bytes_per_peer)
        return cfg->max_reply_bytes_per_peer;
    return (uint64_t)TD_FAIR_SHARE_MIN * 2 * cfg->max_batch;
}

uint64_t td_config_reply_bytes(const td_config_t *cfg)
{
    if (cfg->max_reply_bytes)
        return cfg->max_reply_bytes;
    return TD_REPLY_BYTES_TOTAL_FACTOR * td_config_reply_bytes_per_peer(cfg);
}

size_t td_config_state_bytes_per_client(const td_config_t *cfg)
{
    if (cfg->max_state_bytes_per_client)
        return cfg->max_state_bytes_per_client;
    return cfg->max_state_bytes / 2 ? cfg->max_state_bytes / 2 : 1;
}

unsigned td_config_cores(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        return (unsigned)CPU_COUNT(&set);
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    return online > 0 ? (unsigned)online : 1;
}

unsigned td_config_io_threads(const td_config_t *cfg)
{
    if (cfg->io_threads)
        return cfg->io_threads;
    long cores = td_config_cores();
    unsigned n = cores > 0 ? (unsigned)(cores / 4) : 1;
    if (n < TD_IO_THREADS_MIN)
        n = TD_IO_THREADS_MIN;
    return n > TD_IO_THREADS_MAX ? TD_IO_THREADS_MAX : n;
}

unsigned td_config_shards(const td_config_t *cfg)
{
    if (cfg->shards)
        return cfg->shards;
    /* Test only: the whole suite runs again with this many shards (scripts/test.sh), however
     * each test starts tallyd, unless the test sets --shards itself. */
    const char *test = getenv("TALLYD_TEST_SHARDS");
    unsigned long n = test ? strtoul(test, NULL, 10) : 0;
    if (n >= 1 && n <= TD_SHARDS_LIMIT)
        return (unsigned)n;
    unsigned members = td_config_fleet_ingest(cfg) ? cfg->nats_members_per_process : 0;
    return td_config_default_shards(td_config_cores(), td_config_io_threads(cfg), members);
}

unsigned td_config_default_shards(unsigned cores, unsigned io_threads, unsigned fleet_members)
{
    long left = (long)cores - (long)io_threads - 1;
    if (fleet_members) {
        /* A fleet worker fed by JetStream: its fleet threads hand requests straight to the
         * shards (a port of the request path, which needs two shards or more), the sockets'
         * thread and ZeroMQ's I/O threads idle. */
        left = (long)cores - (long)fleet_members;
        if (left < 2 && cores >= 3)
            left = 2;
    }
    if (left < 1)
        return 1;
    return left > (long)TD_SHARDS_DEFAULT_MAX ? TD_SHARDS_DEFAULT_MAX : (unsigned)left;
}

bool td_config_fleet_ingest(const td_config_t *cfg)
{
    const char *direct = cfg->nats_direct;
    return cfg->nats_servers && (!direct || strcmp(direct, "off") == 0);
}

void td_config_default_shm_socket(char *buf, size_t cap)
{
    const char *runtime = getenv("RUNTIME_DIRECTORY"); /* systemd's RuntimeDirectory= */
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    if (runtime && runtime[0])
        snprintf(buf, cap, "%.*s/%s", (int)strcspn(runtime, ":"), runtime, TD_SHM_SOCKET_NAME);
    else if (geteuid() == 0)
        snprintf(buf, cap, "/run/tallyd/%s", TD_SHM_SOCKET_NAME);
    else if (xdg && xdg[0])
        snprintf(buf, cap, "%s/%s", xdg, TD_SHM_SOCKET_NAME);
    else
        snprintf(buf, cap, "/tmp/tallyd-%u/%s", (unsigned)geteuid(), TD_SHM_SOCKET_NAME);
}

bool td_endpoint_is_local(const char *endpoint)
{
    if (strncmp(endpoint, "ipc://", 6) == 0 || strncmp(endpoint, "inproc://", 9) == 0)
        return true;
    const char *host = endpoint;
    if (strstr(endpoint, "://")) {
        if (strncmp(endpoint, "tcp://", 6) != 0)
            return false;
        host = endpoint + 6;
    }
    char addr[INET6_ADDRSTRLEN + 2];
    const char *colon = strrchr(host, ':');
    size_t len = colon ? (size_t)(colon - host) : strlen(host);
    if (len >= 2 && host[0] == '[' && host[len - 1] == ']') {
        host++;
        len -= 2;
    }
    if (len == 0 || len >= sizeof addr)
        return false;
    memcpy(addr, host, len);
    addr[len] = '\0';
    if (strcmp(addr, "localhost") == 0 || strcmp(addr, "lo") == 0)
        return true;
    struct in_addr v4;
    struct in6_addr v6;
    if (inet_pton(AF_INET, addr, &v4) == 1)
        return (ntohl(v4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, addr, &v6) == 1)
        return IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
    return false; /* a wildcard, an interface or a host name */
}

static void protected_mode_message(const char *endpoint, td_endpoint_kind_t kind, char *msg,
                                   size_t cap)
{
    if (kind == TD_ENDPOINT_METRICS) {
        snprintf(msg, cap,
                 "protected mode: refusing to serve metrics on %s, a network address, without "
                 "authentication. Put USER:PASSWORD in a file only tallyd can read and set "
                 "[metrics] auth_file = FILE (--metrics-auth-file), listen on 127.0.0.1, or set "
                 "[security] protected_mode = off if the network is trusted",
                 endpoint);
        return;
    }
    bool pub = kind == TD_ENDPOINT_PUB;
    snprintf(msg, cap,
             "protected mode: refusing to %s on %s, a network address, without CURVE: anyone "
             "who reaches it could %s. Set up keys: `tally "
             "keygen /etc/tallyd/server` (writes server.key and server.pub), then in [security] "
             "curve_secret_key = /etc/tallyd/server.key and curve_clients_dir = a directory "
             "holding each client's NAME.pub (`tally keygen NAME` on the client); give clients "
             "server.pub (PROTOCOL.md §12). Or bind 127.0.0.1 or ipc://, or set [security] "
             "protected_mode = off if the network is trusted",
             pub ? "publish (--pub)" : "listen", endpoint,
             pub ? "read every stream's histogram" : "push into, reset or read any stream");
}

td_err_t td_config_check_endpoint(const td_config_t *cfg, const char *endpoint,
                                  td_endpoint_kind_t kind, char *msg, size_t cap)
{
    bool metrics = kind == TD_ENDPOINT_METRICS;
    bool authenticated = metrics ? cfg->metrics_auth_file != NULL : cfg->curve_secret_key != NULL;
    /* A metrics address that is not HOST:PORT at all is td_http's to refuse, more helpfully. */
    bool malformed = metrics && !strchr(endpoint, ':');
    if (authenticated || malformed || td_endpoint_is_local(endpoint))
        return TD_OK;
    if (cfg->protected_mode) {
        protected_mode_message(endpoint, kind, msg, cap);
        return TD_ERR_CONFIG;
    }
    static const char *const what[] = {[TD_ENDPOINT_REQUEST] = "",
                                       [TD_ENDPOINT_METRICS] = "metrics endpoint ",
                                       [TD_ENDPOINT_PUB] = "PUB endpoint "};
    static const char *const can[] = {[TD_ENDPOINT_REQUEST] = "push into, reset or read any stream",
                                      [TD_ENDPOINT_METRICS] = "read tallyd's metrics",
                                      [TD_ENDPOINT_PUB] = "read every stream's histogram"};
    td_warn("protected_mode is off: %s%s is a network address without authentication; anyone "
            "who reaches it can %s",
            what[kind], endpoint, can[kind]);
    return TD_OK;
}

td_err_t td_config_check_protected(const td_config_t *cfg, char *msg, size_t cap)
{
    for (int i = 0; i < cfg->bind_count; i++)
        if (td_config_check_endpoint(cfg, cfg->binds[i], TD_ENDPOINT_REQUEST, msg, cap) != TD_OK)
            return TD_ERR_CONFIG;
    for (int i = 0; i < cfg->front_count; i++) /* a front is a CURVE server as the binds are */
        if (td_config_check_endpoint(cfg, cfg->fronts[i], TD_ENDPOINT_REQUEST, msg, cap) != TD_OK)
            return TD_ERR_CONFIG;
    /* The PUB socket is a CURVE server exactly when the request endpoint is (td_pub_new). */
    if (cfg->pub_endpoint &&
        td_config_check_endpoint(cfg, cfg->pub_endpoint, TD_ENDPOINT_PUB, msg, cap) != TD_OK)
        return TD_ERR_CONFIG;
    if (cfg->metrics_listen)
        return td_config_check_endpoint(cfg, cfg->metrics_listen, TD_ENDPOINT_METRICS, msg, cap);
    return TD_OK;
}

td_err_t td_config_add_endpoint(char **list, int *count, const char *endpoint)
{
    if (*count >= TD_MAX_BINDS ||
        tally_endpoint_check(endpoint, TALLY_ENDPOINT_BIND, NULL, 0) != TALLY_OK)
        return TD_ERR_CONFIG;
    char *copy = strdup(endpoint);
    if (!copy)
        return TD_ERR_NOMEM;
    list[(*count)++] = copy;
    return TD_OK;
}

td_err_t td_config_add_bind(td_config_t *cfg, const char *endpoint)
{
    return td_config_add_endpoint(cfg->binds, &cfg->bind_count, endpoint);
}

const char *td_backend_choice_name(td_backend_choice_t choice)
{
    static const char *const names[] = {
        [TD_BACKEND_AUTO] = "auto", [TD_BACKEND_CPU] = "cpu", [TD_BACKEND_CUDA] = "cuda"};
    return (unsigned)choice < sizeof names / sizeof names[0] ? names[choice] : "auto";
}
