/*
 * td_config.c — defaults and the command line (see td_config.h).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <grp.h>
#include <pwd.h>
#include <unistd.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally_args.h"
#include "tally_keys.h"
#include "td_config.h"
#include "td_log.h"

void td_config_init(td_config_t *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->backend = TD_BACKEND_AUTO;
    cfg->max_batch = TD_DEFAULT_MAX_BATCH;
    cfg->max_inflight = TD_DEFAULT_MAX_INFLIGHT;
    cfg->max_streams = TD_DEFAULT_MAX_STREAMS;
    cfg->max_inflight_per_peer = TD_DEFAULT_MAX_INFLIGHT_PER_PEER;
    cfg->max_streams_per_client = TD_DEFAULT_MAX_STREAMS_PER_CLIENT;
    cfg->stream_create_rate = TD_DEFAULT_STREAM_CREATE_RATE;
    cfg->log_level = TD_LOG_INFO;
    cfg->gpu_streams = TD_DEFAULT_GPU_STREAMS;
    cfg->gpu_spin_us = TD_DEFAULT_GPU_SPIN_US;
    cfg->gpu_min_batch = TD_DEFAULT_GPU_MIN_BATCH;
    cfg->state_interval = TD_DEFAULT_STATE_INTERVAL;
    cfg->drain_ms = TD_DEFAULT_DRAIN_MS;
    cfg->io_threads = TD_DEFAULT_IO_THREADS;
    cfg->shm = TD_DEFAULT_SHM;
    cfg->shm_max_regions_per_peer = TD_DEFAULT_SHM_MAX_REGIONS_PER_PEER;
    cfg->shm_max_bytes = TD_DEFAULT_SHM_MAX_BYTES;
    cfg->shm_socket_gid = -1;
    cfg->window_intervals = TD_DEFAULT_WINDOW_INTERVALS;
    cfg->window_interval_ms = TD_DEFAULT_WINDOW_INTERVAL_MS;
    cfg->pub_interval_ms = TD_DEFAULT_PUB_INTERVAL_MS;
    cfg->metrics_streams = TD_DEFAULT_METRICS_STREAMS;
    cfg->protected_mode = TD_DEFAULT_PROTECTED_MODE;
}

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

unsigned td_config_io_threads(const td_config_t *cfg)
{
    if (cfg->io_threads)
        return cfg->io_threads;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    unsigned n = cores > 0 ? (unsigned)(cores / 4) : 1;
    if (n < 1)
        n = 1;
    return n > TD_IO_THREADS_MAX ? TD_IO_THREADS_MAX : n;
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

void td_config_clear(td_config_t *cfg)
{
    for (int i = 0; i < cfg->bind_count; i++)
        free(cfg->binds[i]);
    free(cfg->config_file);
    free(cfg->state_dir);
    free(cfg->metrics_listen);
    free(cfg->shm_socket);
    free(cfg->pub_endpoint);
    free(cfg->test_clock);
    free(cfg->curve_secret_key);
    free(cfg->curve_clients_dir);
    free(cfg->curve_clients);
    free(cfg->metrics_auth_file);
    td_config_init(cfg);
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

static void protected_mode_message(const char *endpoint, bool metrics, char *msg, size_t cap)
{
    if (metrics) {
        snprintf(msg, cap,
                 "protected mode: refusing to serve metrics on %s, a network address, without "
                 "authentication. Put USER:PASSWORD in a file only tallyd can read and set "
                 "[metrics] auth_file = FILE (--metrics-auth-file), listen on 127.0.0.1, or set "
                 "[security] protected_mode = off if the network is trusted",
                 endpoint);
        return;
    }
    snprintf(msg, cap,
             "protected mode: refusing to listen on %s, a network address, without CURVE: anyone "
             "who reaches it could push into, reset or read any stream. Set up keys: `tally "
             "keygen /etc/tallyd/server` (writes server.key and server.pub), then in [security] "
             "curve_secret_key = /etc/tallyd/server.key and curve_clients_dir = a directory "
             "holding each client's NAME.pub (`tally keygen NAME` on the client); give clients "
             "server.pub (PROTOCOL.md §12). Or bind 127.0.0.1 or ipc://, or set [security] "
             "protected_mode = off if the network is trusted",
             endpoint);
}

tally_status_t td_config_check_endpoint(const td_config_t *cfg, const char *endpoint, bool metrics,
                                        char *msg, size_t cap)
{
    bool authenticated = metrics ? cfg->metrics_auth_file != NULL : cfg->curve_secret_key != NULL;
    /* A metrics address that is not HOST:PORT at all is td_http's to refuse, more helpfully. */
    bool malformed = metrics && !strchr(endpoint, ':');
    if (authenticated || malformed || td_endpoint_is_local(endpoint))
        return TALLY_OK;
    if (cfg->protected_mode) {
        protected_mode_message(endpoint, metrics, msg, cap);
        return TALLY_E_PARAM;
    }
    td_warn("protected_mode is off: %s%s is a network address without authentication; anyone "
            "who reaches it can %s",
            metrics ? "metrics endpoint " : "", endpoint,
            metrics ? "read tallyd's metrics" : "push into, reset or read any stream");
    return TALLY_OK;
}

tally_status_t td_config_check_protected(const td_config_t *cfg, char *msg, size_t cap)
{
    for (int i = 0; i < cfg->bind_count; i++)
        if (td_config_check_endpoint(cfg, cfg->binds[i], false, msg, cap) != TALLY_OK)
            return TALLY_E_PARAM;
    if (cfg->metrics_listen)
        return td_config_check_endpoint(cfg, cfg->metrics_listen, true, msg, cap);
    return TALLY_OK;
}

tally_status_t td_config_add_bind(td_config_t *cfg, const char *endpoint)
{
    if (cfg->bind_count >= TD_MAX_BINDS ||
        tally_endpoint_check(endpoint, TALLY_ENDPOINT_BIND, NULL, 0) != TALLY_OK)
        return TALLY_E_PARAM;
    char *copy = strdup(endpoint);
    if (!copy)
        return TALLY_E_INTERNAL;
    cfg->binds[cfg->bind_count++] = copy;
    return TALLY_OK;
}

tally_status_t td_config_parse_size(const char *text, size_t *out)
{
    return tally_size_parse(text, out, NULL, 0);
}

const char *td_backend_choice_name(td_backend_choice_t choice)
{
    switch (choice) {
    case TD_BACKEND_CPU:
        return "cpu";
    case TD_BACKEND_CUDA:
        return "cuda";
    default:
        return "auto";
    }
}

static tally_status_t parse_unsigned(const char *text, unsigned min, unsigned max, unsigned *out)
{
    char *end = NULL;
    errno = 0;
    unsigned long value = strtoul(text, &end, 10);
    if (errno || end == text || *end != '\0' || text[0] == '-' || value < min || value > max)
        return TALLY_E_PARAM;
    *out = (unsigned)value;
    return TALLY_OK;
}

/* Sets an owned string option; an empty value means "none". */
static tally_status_t replace_string(char **field, const char *value)
{
    char *copy = value[0] ? strdup(value) : NULL;
    if (value[0] && !copy)
        return TALLY_E_INTERNAL;
    free(*field);
    *field = copy;
    return TALLY_OK;
}

/* curve_clients: comma-separated KEY or NAME:KEY items (td_auth.c reads them; checked here too,
 * so that a typo stops tallyd at start and --check-config reports it). */
static bool valid_key_list(const char *text)
{
    for (const char *p = text; *p;) {
        size_t len = strcspn(p, ",");
        bool bare = len == TALLY_KEY_LEN;
        bool named = len > TALLY_KEY_LEN + 1 && p[len - TALLY_KEY_LEN - 1] == ':';
        if ((!bare && !named) || !tally_key_valid(p + len - TALLY_KEY_LEN, TALLY_KEY_LEN))
            return false;
        p += len + (p[len] == ',');
    }
    return true;
}

/* replace_string for a file or directory: a relative path names a credential systemd passed
 * (LoadCredential=: $CREDENTIALS_DIRECTORY/PATH) when that is set, else it is taken as given. */
static tally_status_t replace_path(char **field, const char *value)
{
    const char *creds = getenv("CREDENTIALS_DIRECTORY");
    if (!value[0] || value[0] == '/' || !creds || !creds[0])
        return replace_string(field, value);
    char path[4096];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", creds, value) >= sizeof path)
        return TALLY_E_PARAM;
    return replace_string(field, path);
}

/* One user or group: a number, or a name looked up in the passwd or group database. */
static bool parse_id(const char *text, bool group, unsigned *out)
{
    char *end = NULL;
    errno = 0;
    unsigned long value = strtoul(text, &end, 10);
    if (!errno && end != text && *end == '\0' && text[0] != '-' && value < UINT32_MAX) {
        *out = (unsigned)value;
        return true;
    }
    if (group) {
        struct group *gr = getgrnam(text);
        if (gr)
            *out = (unsigned)gr->gr_gid;
        return gr != NULL;
    }
    struct passwd *pw = getpwnam(text);
    if (pw)
        *out = (unsigned)pw->pw_uid;
    return pw != NULL;
}

/* A comma-separated list of users or groups (empty: none). */
static tally_status_t parse_id_list(const char *text, bool group, unsigned *ids, unsigned *count)
{
    unsigned n = 0;
    char item[256];
    for (const char *p = text; *p;) {
        size_t len = strcspn(p, ",");
        if (len == 0 || len >= sizeof item || n >= TD_SHM_ALLOW_MAX)
            return TALLY_E_PARAM;
        memcpy(item, p, len);
        item[len] = '\0';
        if (!parse_id(item, group, &ids[n++]))
            return TALLY_E_PARAM;
        p += len + (p[len] == ',');
    }
    *count = n;
    return TALLY_OK;
}

static tally_status_t parse_on_off(const char *text, bool *out)
{
    if (strcmp(text, "on") == 0 || strcmp(text, "yes") == 0 || strcmp(text, "true") == 0)
        *out = true;
    else if (strcmp(text, "off") == 0 || strcmp(text, "no") == 0 || strcmp(text, "false") == 0)
        *out = false;
    else
        return TALLY_E_PARAM;
    return TALLY_OK;
}

void td_config_usage(const char *argv0)
{
    printf("usage: %s [options]\n"
           "\n"
           "tallyd serves filter, scan and histogram requests over ZeroMQ on the GPU or CPU.\n"
           "\n"
           "  -b, --bind ENDPOINT     ZeroMQ endpoint to bind (repeatable; default %s)\n"
           "      --backend NAME      auto (CUDA when a GPU is usable, else CPU), cpu or cuda\n"
           "      --max-batch BYTES   largest request payload, K/M/G suffixes (default %u)\n"
           "      --max-inflight N    requests in flight before tallyd stops reading (default %u)\n"
           "      --max-streams N     named streams kept at once (default %u)\n"
           "      --max-inflight-per-peer N  requests in flight per connection, beyond which\n"
           "                          it is answered `busy` (default 0: a fair share,\n"
           "                          max-inflight / connections with requests in flight,\n"
           "                          at least 8)\n"
           "      --max-streams-per-client N  streams one client may create (its CURVE key, or\n"
           "                          its connection), beyond which `client_streams` (default\n"
           "                          0: half of max-streams)\n"
           "      --stream-create-rate N  streams one client may create per second, beyond\n"
           "                          which `rate_limited` (default %u; 0 = unlimited)\n"
           "      --max-frame BYTES   a frame over this closes its connection without a reply;\n"
           "                          payloads over max-batch are answered too_large (default\n"
           "                          %u x max-batch)\n"
           "      --drain-ms MS       on SIGTERM, answer queued requests `shutdown` for up to\n"
           "                          MS before exiting (default %u)\n"
           "      --workers N         CPU worker threads (default: number of cores)\n"
           "      --io-threads N      ZeroMQ I/O threads (default: cores / 4, 1 to 4)\n"
           "      --gpu-streams K     CUDA streams per GPU (default 4)\n"
           "      --gpu-min-batch B   auto backend: smaller batches run on the CPU (default 0:\n"
           "                          per operation, from the measured crossover: hist 64K,\n"
           "                          filter 4M, scan stays on the CPU; shared memory 64K)\n"
           "      --log-level LEVEL   err, warning, notice, info or debug (default info)\n"
           "  -c, --config FILE       configuration file (default %s if present)\n"
           "      --state-dir DIR     keep stream state in DIR (default $STATE_DIRECTORY; none)\n"
           "      --state-interval S  seconds between state snapshots (default %u)\n"
           "      --metrics ADDR:PORT serve Prometheus metrics over HTTP (e.g. 127.0.0.1:9464)\n"
           "      --shm on|off        offer shared-memory input to local producers (default on)\n"
           "      --shm-socket PATH   its side channel (default: the runtime directory's\n"
           "                          %s: $RUNTIME_DIRECTORY, /run/tallyd as root,\n"
           "                          $XDG_RUNTIME_DIR, else /tmp/tallyd-UID)\n"
           "      --shm-socket-group G  the socket's group (name or number; tallyd must be in\n"
           "                          it), so its members can connect (default tallyd's)\n"
           "      --shm-allow-uids L  users (names or numbers, comma-separated) allowed besides\n"
           "                          tallyd's own\n"
           "      --shm-allow-gids L  groups allowed (the peer's primary or supplementary)\n"
           "      --shm-max-regions-per-peer N  regions per side connection (default %u)\n"
           "      --shm-max-bytes B   registered bytes in total, K/M/G (default %llu)\n"
           "      --window-intervals N  intervals in each stream's window ring, 0 = off\n"
           "                          (default %u)\n"
           "      --window-interval-ms MS  length of one interval (default %u)\n"
           "      --pub ENDPOINT      publish changed streams on a ZeroMQ PUB socket there\n"
           "      --pub-interval-ms MS  how often (default %u)\n"
           "      --metrics-streams N  streams with their own metrics label; the rest are\n"
           "                          summed as stream=\"_other\" (default %u)\n"
           "      --curve-secret-key FILE  turn CURVE on with the server key pair in FILE (from\n"
           "                          `tally keygen`; mode 0600; a relative FILE is looked up\n"
           "                          in $CREDENTIALS_DIRECTORY when systemd set it)\n"
           "      --curve-clients-dir DIR  allowed client keys: DIR/NAME.pub, client NAME\n"
           "      --curve-clients LIST  allowed client keys: KEY or NAME:KEY, comma-separated\n"
           "      --protected-mode on|off  refuse network endpoints (tcp other than loopback)\n"
           "                          without CURVE, and metrics on one without basic auth\n"
           "                          (default on)\n"
           "      --metrics-auth-file FILE  USER:PASSWORD that /metrics and /healthz must present\n"
           "                          (HTTP basic auth)\n"
           "      --check-config      check the configuration file and options, then exit\n"
           "  -h, --help              this text\n"
           "  -V, --version           print the version\n",
           argv0, TD_DEFAULT_ENDPOINT, TD_DEFAULT_MAX_BATCH, TD_DEFAULT_MAX_INFLIGHT,
           TD_DEFAULT_MAX_STREAMS, TD_DEFAULT_STREAM_CREATE_RATE, TD_MAX_FRAME_FACTOR,
           TD_DEFAULT_DRAIN_MS, TD_DEFAULT_CONFIG_FILE, TD_DEFAULT_STATE_INTERVAL,
           TD_SHM_SOCKET_NAME, TD_DEFAULT_SHM_MAX_REGIONS_PER_PEER,
           (unsigned long long)TD_DEFAULT_SHM_MAX_BYTES, TD_DEFAULT_WINDOW_INTERVALS,
           TD_DEFAULT_WINDOW_INTERVAL_MS, TD_DEFAULT_PUB_INTERVAL_MS, TD_DEFAULT_METRICS_STREAMS);
}

enum {
    OPT_BACKEND = 256,
    OPT_MAX_BATCH,
    OPT_MAX_INFLIGHT,
    OPT_MAX_STREAMS,
    OPT_MAX_FRAME,
    OPT_DRAIN_MS,
    OPT_WORKERS,
    OPT_GPU_STREAMS,
    OPT_GPU_MIN_BATCH,
    OPT_TEST_FAULT_EVERY,
    OPT_TEST_SIM_GPUS,
    OPT_GPU_SPIN_US,
    OPT_LOG_LEVEL,
    OPT_STATE_DIR,
    OPT_STATE_INTERVAL,
    OPT_METRICS,
    OPT_CHECK_CONFIG,
    OPT_IO_THREADS,
    OPT_SHM,
    OPT_SHM_SOCKET,
    OPT_SHM_SOCKET_GROUP,
    OPT_SHM_ALLOW_UIDS,
    OPT_SHM_ALLOW_GIDS,
    OPT_SHM_MAX_REGIONS,
    OPT_SHM_MAX_BYTES,
    OPT_TEST_SHM_DENY_OWN_UID,
    OPT_WINDOW_INTERVALS,
    OPT_WINDOW_INTERVAL_MS,
    OPT_PUB,
    OPT_PUB_INTERVAL_MS,
    OPT_METRICS_STREAMS,
    OPT_TEST_CLOCK,
    OPT_MAX_INFLIGHT_PER_PEER,
    OPT_MAX_STREAMS_PER_CLIENT,
    OPT_STREAM_CREATE_RATE,
    OPT_CURVE_SECRET_KEY,
    OPT_CURVE_CLIENTS_DIR,
    OPT_CURVE_CLIENTS,
    OPT_PROTECTED_MODE,
    OPT_METRICS_AUTH_FILE,
};

tally_status_t td_config_parse_args(td_config_t *cfg, int argc, char **argv, bool *exit_now,
                                    char *msg, size_t msg_cap)
{
    static const struct option options[] = {
        {"bind", required_argument, NULL, 'b'},
        {"backend", required_argument, NULL, OPT_BACKEND},
        {"max-batch", required_argument, NULL, OPT_MAX_BATCH},
        {"max-inflight", required_argument, NULL, OPT_MAX_INFLIGHT},
        {"max-streams", required_argument, NULL, OPT_MAX_STREAMS},
        {"max-frame", required_argument, NULL, OPT_MAX_FRAME},
        {"max-inflight-per-peer", required_argument, NULL, OPT_MAX_INFLIGHT_PER_PEER},
        {"max-streams-per-client", required_argument, NULL, OPT_MAX_STREAMS_PER_CLIENT},
        {"stream-create-rate", required_argument, NULL, OPT_STREAM_CREATE_RATE},
        {"curve-secret-key", required_argument, NULL, OPT_CURVE_SECRET_KEY},
        {"curve-clients-dir", required_argument, NULL, OPT_CURVE_CLIENTS_DIR},
        {"curve-clients", required_argument, NULL, OPT_CURVE_CLIENTS},
        {"protected-mode", required_argument, NULL, OPT_PROTECTED_MODE},
        {"metrics-auth-file", required_argument, NULL, OPT_METRICS_AUTH_FILE},
        {"drain-ms", required_argument, NULL, OPT_DRAIN_MS},
        {"workers", required_argument, NULL, OPT_WORKERS},
        {"gpu-streams", required_argument, NULL, OPT_GPU_STREAMS},
        {"gpu-min-batch", required_argument, NULL, OPT_GPU_MIN_BATCH},
        /* Test only, not in --help: force the GPU error path; simulate GPUs on the CPU. */
        {"test-fault-every", required_argument, NULL, OPT_TEST_FAULT_EVERY},
        {"test-sim-gpus", required_argument, NULL, OPT_TEST_SIM_GPUS},
        {"gpu-spin-us", required_argument, NULL, OPT_GPU_SPIN_US}, /* tuning, not in --help */
        {"log-level", required_argument, NULL, OPT_LOG_LEVEL},
        {"config", required_argument, NULL, 'c'},
        /* Each option settable in the configuration file also has a line in
         * td_config_file.c's key table. */
        {"state-dir", required_argument, NULL, OPT_STATE_DIR},
        {"state-interval", required_argument, NULL, OPT_STATE_INTERVAL},
        {"metrics", required_argument, NULL, OPT_METRICS},
        {"check-config", no_argument, NULL, OPT_CHECK_CONFIG},
        {"io-threads", required_argument, NULL, OPT_IO_THREADS},
        {"shm", required_argument, NULL, OPT_SHM},
        {"shm-socket", required_argument, NULL, OPT_SHM_SOCKET},
        {"shm-socket-group", required_argument, NULL, OPT_SHM_SOCKET_GROUP},
        {"shm-allow-uids", required_argument, NULL, OPT_SHM_ALLOW_UIDS},
        {"shm-allow-gids", required_argument, NULL, OPT_SHM_ALLOW_GIDS},
        {"shm-max-regions-per-peer", required_argument, NULL, OPT_SHM_MAX_REGIONS},
        {"shm-max-bytes", required_argument, NULL, OPT_SHM_MAX_BYTES},
        /* Test only, not in --help: refuse tallyd's own uid, to test the refusal. */
        {"test-shm-deny-own-uid", no_argument, NULL, OPT_TEST_SHM_DENY_OWN_UID},
        {"window-intervals", required_argument, NULL, OPT_WINDOW_INTERVALS},
        {"window-interval-ms", required_argument, NULL, OPT_WINDOW_INTERVAL_MS},
        {"pub", required_argument, NULL, OPT_PUB},
        {"pub-interval-ms", required_argument, NULL, OPT_PUB_INTERVAL_MS},
        {"metrics-streams", required_argument, NULL, OPT_METRICS_STREAMS},
        /* test only, not in --help: the window clock read from this file */
        {"test-clock", required_argument, NULL, OPT_TEST_CLOCK},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    *exit_now = false;
    optind = 1;
    opterr = 0;
    int opt;
    size_t size;
    char why[160];
    while ((opt = getopt_long(argc, argv, ":b:c:hV", options, NULL)) != -1) {
        switch (opt) {
        case 'b':
            if (tally_endpoint_check(optarg, TALLY_ENDPOINT_BIND, why, sizeof why) != TALLY_OK) {
                snprintf(msg, msg_cap, "invalid endpoint '%s' for --bind: %s", optarg, why);
                return TALLY_E_PARAM;
            }
            if (td_config_add_bind(cfg, optarg) != TALLY_OK)
                goto bad;
            break;
        case 'c':
            free(cfg->config_file);
            cfg->config_file = strdup(optarg);
            cfg->config_file_explicit = true;
            break;
        case OPT_BACKEND:
            if (strcmp(optarg, "auto") == 0)
                cfg->backend = TD_BACKEND_AUTO;
            else if (strcmp(optarg, "cpu") == 0)
                cfg->backend = TD_BACKEND_CPU;
            else if (strcmp(optarg, "cuda") == 0)
                cfg->backend = TD_BACKEND_CUDA;
            else
                goto bad;
            break;
        case OPT_MAX_BATCH:
            if (td_config_parse_size(optarg, &size) != TALLY_OK || size == 0 ||
                size > TD_MAX_BATCH_LIMIT)
                goto bad;
            cfg->max_batch = size;
            break;
        case OPT_MAX_INFLIGHT:
            if (parse_unsigned(optarg, 1, TD_MAX_INFLIGHT_LIMIT, &cfg->max_inflight) != TALLY_OK)
                goto bad;
            break;
        case OPT_MAX_STREAMS:
            if (parse_unsigned(optarg, 1, 1u << 24, &cfg->max_streams) != TALLY_OK)
                goto bad;
            break;
        case OPT_MAX_INFLIGHT_PER_PEER:
            if (parse_unsigned(optarg, 0, TD_MAX_INFLIGHT_LIMIT, &cfg->max_inflight_per_peer) !=
                TALLY_OK)
                goto bad;
            break;
        case OPT_MAX_STREAMS_PER_CLIENT:
            if (parse_unsigned(optarg, 0, 1u << 24, &cfg->max_streams_per_client) != TALLY_OK)
                goto bad;
            break;
        case OPT_STREAM_CREATE_RATE:
            if (parse_unsigned(optarg, 0, TD_STREAM_CREATE_RATE_LIMIT, &cfg->stream_create_rate) !=
                TALLY_OK)
                goto bad;
            break;
        case OPT_CURVE_SECRET_KEY:
            if (replace_path(&cfg->curve_secret_key, optarg) != TALLY_OK)
                goto bad;
            break;
        case OPT_CURVE_CLIENTS_DIR:
            if (replace_path(&cfg->curve_clients_dir, optarg) != TALLY_OK)
                goto bad;
            break;
        case OPT_CURVE_CLIENTS:
            if (!valid_key_list(optarg) || replace_string(&cfg->curve_clients, optarg) != TALLY_OK)
                goto bad;
            break;
        case OPT_PROTECTED_MODE:
            if (parse_on_off(optarg, &cfg->protected_mode) != TALLY_OK)
                goto bad;
            break;
        case OPT_METRICS_AUTH_FILE:
            if (replace_path(&cfg->metrics_auth_file, optarg) != TALLY_OK)
                goto bad;
            break;
        case OPT_MAX_FRAME:
            if (td_config_parse_size(optarg, &size) != TALLY_OK || size > TD_MAX_FRAME_LIMIT)
                goto bad;
            cfg->max_frame = size;
            break;
        case OPT_DRAIN_MS:
            if (parse_unsigned(optarg, 0, TD_DRAIN_MS_LIMIT, &cfg->drain_ms) != TALLY_OK)
                goto bad;
            break;
        case OPT_WORKERS:
            if (parse_unsigned(optarg, 1, 1024, &cfg->workers) != TALLY_OK)
                goto bad;
            break;
        case OPT_GPU_STREAMS:
            if (parse_unsigned(optarg, 1, TD_GPU_STREAMS_LIMIT, &cfg->gpu_streams) != TALLY_OK)
                goto bad;
            break;
        case OPT_GPU_MIN_BATCH:
            if (td_config_parse_size(optarg, &cfg->gpu_min_batch) != TALLY_OK)
                goto bad;
            break;
        case OPT_TEST_FAULT_EVERY:
            if (parse_unsigned(optarg, 0, 1u << 30, &cfg->test_fault_every) != TALLY_OK)
                goto bad;
            break;
        case OPT_TEST_SIM_GPUS:
            if (parse_unsigned(optarg, 0, 16, &cfg->test_sim_gpus) != TALLY_OK)
                goto bad;
            break;
        case OPT_GPU_SPIN_US:
            if (parse_unsigned(optarg, 0, 10000, &cfg->gpu_spin_us) != TALLY_OK)
                goto bad;
            break;
        case OPT_LOG_LEVEL: {
            int level = td_log_parse_level(optarg);
            if (level < 0)
                goto bad;
            cfg->log_level = level;
            break;
        }
        case OPT_STATE_DIR:
            if (replace_string(&cfg->state_dir, optarg) != TALLY_OK)
                goto bad;
            break;
        case OPT_STATE_INTERVAL:
            if (parse_unsigned(optarg, 1, TD_STATE_INTERVAL_LIMIT, &cfg->state_interval) !=
                TALLY_OK)
                goto bad;
            break;
        case OPT_METRICS:
            if (replace_string(&cfg->metrics_listen, optarg) != TALLY_OK)
                goto bad;
            break;
        case OPT_CHECK_CONFIG:
            cfg->check_only = true;
            break;
        case OPT_IO_THREADS:
            if (parse_unsigned(optarg, 1, TD_IO_THREADS_LIMIT, &cfg->io_threads) != TALLY_OK)
                goto bad;
            break;
        case OPT_SHM:
            if (parse_on_off(optarg, &cfg->shm) != TALLY_OK)
                goto bad;
            break;
        case OPT_SHM_SOCKET:
            if (replace_string(&cfg->shm_socket, optarg) != TALLY_OK)
                goto bad;
            cfg->shm_socket_explicit = cfg->shm_socket != NULL;
            break;
        case OPT_SHM_SOCKET_GROUP: {
            unsigned gid = 0;
            if (optarg[0] && !parse_id(optarg, true, &gid))
                goto bad;
            cfg->shm_socket_gid = optarg[0] ? (int)gid : -1;
            break;
        }
        case OPT_SHM_ALLOW_UIDS:
            if (parse_id_list(optarg, false, cfg->shm_allow_uids, &cfg->shm_allow_uid_count) !=
                TALLY_OK)
                goto bad;
            break;
        case OPT_SHM_ALLOW_GIDS:
            if (parse_id_list(optarg, true, cfg->shm_allow_gids, &cfg->shm_allow_gid_count) !=
                TALLY_OK)
                goto bad;
            break;
        case OPT_SHM_MAX_REGIONS:
            if (parse_unsigned(optarg, 1, TD_SHM_MAX_REGIONS_LIMIT,
                               &cfg->shm_max_regions_per_peer) != TALLY_OK)
                goto bad;
            break;
        case OPT_SHM_MAX_BYTES:
            if (td_config_parse_size(optarg, &cfg->shm_max_bytes) != TALLY_OK ||
                cfg->shm_max_bytes == 0)
                goto bad;
            break;
        case OPT_TEST_SHM_DENY_OWN_UID:
            cfg->test_shm_deny_own_uid = true;
            break;
        case OPT_WINDOW_INTERVALS:
            if (parse_unsigned(optarg, 0, TD_WINDOW_INTERVALS_LIMIT, &cfg->window_intervals) !=
                TALLY_OK)
                goto bad;
            break;
        case OPT_WINDOW_INTERVAL_MS:
            if (parse_unsigned(optarg, TD_WINDOW_INTERVAL_MS_MIN, TD_WINDOW_INTERVAL_MS_LIMIT,
                               &cfg->window_interval_ms) != TALLY_OK)
                goto bad;
            break;
        case OPT_PUB:
            if (replace_string(&cfg->pub_endpoint, optarg) != TALLY_OK)
                goto bad;
            break;
        case OPT_PUB_INTERVAL_MS:
            if (parse_unsigned(optarg, TD_PUB_INTERVAL_MS_MIN, TD_PUB_INTERVAL_MS_LIMIT,
                               &cfg->pub_interval_ms) != TALLY_OK)
                goto bad;
            break;
        case OPT_METRICS_STREAMS:
            if (parse_unsigned(optarg, 0, TD_METRICS_STREAMS_LIMIT, &cfg->metrics_streams) !=
                TALLY_OK)
                goto bad;
            break;
        case OPT_TEST_CLOCK:
            if (replace_string(&cfg->test_clock, optarg) != TALLY_OK)
                goto bad;
            break;
        case 'h':
            td_config_usage(argv[0]);
            *exit_now = true;
            return TALLY_OK;
        case 'V':
            printf("tallyd %s (protocol %d)\n", TALLY_VERSION, TALLY_PROTO_VERSION);
            *exit_now = true;
            return TALLY_OK;
        case ':':
            snprintf(msg, msg_cap, "option %s needs a value", argv[optind - 1]);
            return TALLY_E_PARAM;
        default:
            snprintf(msg, msg_cap, "unknown option %s (try --help)", argv[optind - 1]);
            return TALLY_E_PARAM;
        }
    }
    if (optind < argc) {
        snprintf(msg, msg_cap, "unexpected argument '%s' (try --help)", argv[optind]);
        return TALLY_E_PARAM;
    }
    return TALLY_OK;
bad:
    /* The option's own name: argv[optind - 1] is its value when given as "--opt VALUE". */
    for (const struct option *o = options; o->name; o++)
        if (o->val == opt) {
            snprintf(msg, msg_cap, "invalid value '%s' for --%s (try --help)", optarg, o->name);
            return TALLY_E_PARAM;
        }
    snprintf(msg, msg_cap, "invalid value '%s' (try --help)", optarg);
    return TALLY_E_PARAM;
}
