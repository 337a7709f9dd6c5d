/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_settings.c — the table of settings and what each kind of value does (see td_settings.h).
 *
 * The rows are in the order --help, docs/service.md and the example file list them: the file's
 * sections in turn, then the options of the command line alone, then the hidden ones.
 * td_settings_doc.c prints the documents from them.
 */
#include <errno.h>
#include <grp.h>
#include <pwd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally_args.h"
#include "tally_keys.h"
#include "td_log.h"
#include "td_settings.h"

#define FIELD(name) offsetof(td_config_t, name)

/* One setting a paragraph: it reads better than one field a line. */
/* clang-format off */
const td_setting_t td_settings[] = {
    /* [server] */
    {.option = "bind", .short_flag = 'b', .arg = "ENDPOINT", .section = "server", .key = "bind",
     .type = TD_SET_ENDPOINTS, .offset = FIELD(binds), .aux = FIELD(bind_count),
     .reload = TD_RELOAD_RESTART,
     .help = "ZeroMQ endpoint to bind, repeatable; leave it unset when tallyd.socket passes the "
             "sockets"},
    {.option = "front", .arg = "ENDPOINT", .section = "server", .key = "front",
     .type = TD_SET_ENDPOINTS, .offset = FIELD(fronts), .aux = FIELD(front_count),
     .reload = TD_RELOAD_RESTART,
     .help = "ZeroMQ endpoint served by a ROUTER socket and a thread of its own (a front: its "
             "requests go straight to the shards), repeatable; beside the binds, which stay on "
             "the loop thread; needs 2 shards or more (docs/performance.md)",
     .default_doc = "none", .example = "ipc:///run/tallyd/front1.sock"},
    {.option = "backend", .arg = "NAME", .section = "server", .key = "backend",
     .type = TD_SET_BACKEND, .offset = FIELD(backend), .def = TD_BACKEND_AUTO,
     .reload = TD_RELOAD_RESTART,
     .help = "which backend runs batches: auto (CUDA when a GPU is usable, else CPU), cpu or "
             "cuda"},
    {.option = "max-batch", .arg = "BYTES", .section = "server", .key = "max_batch",
     .type = TD_SET_SIZE, .offset = FIELD(max_batch), .def = (16u << 20), .min = 1,
     .max = TD_MAX_BATCH_LIMIT, .reload = TD_RELOAD_UP_TO_START,
     .reload_note = "it sized the buffers",
     .help = "largest request payload, K/M/G suffixes; it sizes the GPU staging buffers at start"},
    {.option = "max-inflight", .arg = "N", .section = "server", .key = "max_inflight",
     .type = TD_SET_UINT, .offset = FIELD(max_inflight), .def = 64u, .min = 1,
     .max = TD_MAX_INFLIGHT_LIMIT, .reload = TD_RELOAD_APPLIES,
     .help = "requests accepted and not yet answered before tallyd stops reading (backpressure)"},
    {.option = "max-streams", .arg = "N", .section = "server", .key = "max_streams",
     .type = TD_SET_UINT, .offset = FIELD(max_streams), .def = TD_DEFAULT_MAX_STREAMS, .min = 1,
     .max = TD_MAX_STREAMS_LIMIT, .reload = TD_RELOAD_APPLIES,
     .reload_note = "existing streams are kept", .help = "named streams kept at once"},
    {.option = "max-inflight-per-peer", .arg = "N", .section = "server",
     .key = "max_inflight_per_peer", .type = TD_SET_UINT, .offset = FIELD(max_inflight_per_peer),
     .def = 0u, .max = TD_MAX_INFLIGHT_LIMIT,
     .reload = TD_RELOAD_APPLIES,
     .help = "requests in flight per connection, beyond which it is answered `busy`",
     .default_doc = "a fair share, max_inflight / connections with requests in flight, at least "
                    "8"},
    {.option = "max-streams-per-client", .arg = "N", .section = "server",
     .key = "max_streams_per_client", .type = TD_SET_UINT, .offset = FIELD(max_streams_per_client),
     .def = 0u, .max = TD_MAX_STREAMS_LIMIT,
     .reload = TD_RELOAD_APPLIES,
     .help = "streams one client (its CURVE key, else its connection) may create, beyond which "
             "`client_streams`",
     .default_doc = "half of max_streams"},
    {.option = "stream-create-rate", .arg = "N", .section = "server", .key = "stream_create_rate",
     .type = TD_SET_UINT, .offset = FIELD(stream_create_rate), .def = 1000u,
     .max = TD_STREAM_CREATE_RATE_LIMIT, .reload = TD_RELOAD_APPLIES,
     .help = "streams one client may create per second (bursts of one second's worth), beyond "
             "which `rate_limited`; 0 = unlimited"},
    {.option = "max-state-bytes", .arg = "BYTES", .section = "server", .key = "max_state_bytes",
     .type = TD_SET_SIZE, .offset = FIELD(max_state_bytes), .def = TD_DEFAULT_MAX_STATE_BYTES,
     .min = 1, .max = SIZE_MAX, .reload = TD_RELOAD_APPLIES,
     .reload_note = "existing streams are kept",
     .help = "memory for stream state, K/M/G (every stream's counters, histogram and window "
             "ring): a new stream, or a hist that would grow one, beyond it is answered `limit`"},
    {.option = "max-state-bytes-per-client", .arg = "BYTES", .section = "server",
     .key = "max_state_bytes_per_client", .type = TD_SET_SIZE,
     .offset = FIELD(max_state_bytes_per_client), .def = 0u,
     .max = SIZE_MAX, .reload = TD_RELOAD_APPLIES,
     .help = "memory for the state of the streams one client created, K/M/G; beyond it "
             "`client_streams`",
     .default_doc = "half of max_state_bytes"},
    {.option = "max-frame", .arg = "BYTES", .section = "server", .key = "max_frame",
     .type = TD_SET_SIZE, .offset = FIELD(max_frame), .def = 0u,
     .max = TD_MAX_FRAME_LIMIT, .reload = TD_RELOAD_RESTART, .example = "64M",
     .help = "a hard memory guard, K/M/G: a frame over it makes ZeroMQ close its connection, with "
             "no reply; payloads over max_batch and up to it are answered `too_large`; at least "
             "max_batch + 64K",
     .default_doc = "4 x max_batch"},
    {.option = "max-reply-bytes-per-peer", .arg = "BYTES", .section = "server",
     .key = "max_reply_bytes_per_peer", .type = TD_SET_SIZE,
     .offset = FIELD(max_reply_bytes_per_peer), .def = 0u,
     .max = TD_MAX_REPLY_BYTES_LIMIT, .reload = TD_RELOAD_APPLIES, .example = "256M",
     .help = "reply bytes one connection may have unread (in ZeroMQ, or reserved for its "
             "requests in flight, at their largest reply), K/M/G; a request whose reply would go "
             "past it is answered `busy`",
     .default_doc = "8 x 2 x max_batch"},
    {.option = "max-reply-bytes", .arg = "BYTES", .section = "server", .key = "max_reply_bytes",
     .type = TD_SET_SIZE, .offset = FIELD(max_reply_bytes), .def = 0u,
     .max = TD_MAX_REPLY_BYTES_LIMIT, .reload = TD_RELOAD_APPLIES, .example = "512M",
     .help = "the same for all connections together; a filter or scan whose reply would go past "
             "it is answered `busy`",
     .default_doc = "2 x max_reply_bytes_per_peer"},
    {.option = "drain-ms", .arg = "MS", .section = "server", .key = "drain_ms", .type = TD_SET_UINT,
     .offset = FIELD(drain_ms), .def = 2000u, .max = TD_DRAIN_MS_LIMIT,
     .reload = TD_RELOAD_APPLIES,
     .help = "on stop (SIGTERM), answer what is still queued in the socket `shutdown` for up to "
             "MS milliseconds; requests running on a backend finish first"},
    {.option = "workers", .arg = "N", .section = "server", .key = "workers", .type = TD_SET_UINT,
     .offset = FIELD(workers), .min = 1, .max = TD_WORKERS_LIMIT, .reload = TD_RELOAD_RESTART,
     .example = "8", .help = "CPU worker threads", .default_doc = "the cores tallyd may run on (its CPU affinity)"},
    {.option = "log-level", .arg = "LEVEL", .section = "server", .key = "log_level",
     .type = TD_SET_LOG_LEVEL, .offset = FIELD(log_level), .def = TD_LOG_INFO,
     .reload = TD_RELOAD_APPLIES,
     .help = "log messages up to LEVEL: err, warning, notice, info or debug"},
    {.option = "io-threads", .arg = "N", .section = "server", .key = "io_threads",
     .type = TD_SET_UINT, .offset = FIELD(io_threads), .def = 0u, .min = 1,
     .max = TD_IO_THREADS_LIMIT, .reload = TD_RELOAD_RESTART, .example = "4",
     .help = "ZeroMQ I/O threads", .default_doc = "those cores / 4, from 2 to 4"},
    {.option = "shards", .arg = "N", .section = "server", .key = "shards", .type = TD_SET_UINT,
     .offset = FIELD(shards), .def = 0u, .min = 1, .max = TD_SHARDS_LIMIT,
     .reload = TD_RELOAD_RESTART, .example = "4",
     .help = "request-path shards, each a thread that owns the streams whose names hash to it "
             "(the published FNV-1a 64, mixed: PROTOCOL.md §5, `info`'s `shards`) and runs "
             "their requests; 1 runs them on the thread that owns the sockets; every limit "
             "stays the whole daemon's",
     .default_doc = "the cores less the I/O threads and one, from 1 to 4; a fleet worker fed "
                    "by JetStream: the cores less its members, from 2 (with 3 cores or more) to "
                    "4"},
    /* [state] */
    {.option = "state-dir", .arg = "DIR", .section = "state", .key = "dir", .type = TD_SET_STRING,
     .offset = FIELD(state_dir), .reload = TD_RELOAD_RESTART, .example = "/var/lib/tallyd",
     .help = "keep stream state (streams.state) in DIR; empty = no persistence",
     .default_doc = "$STATE_DIRECTORY, which systemd sets to /var/lib/tallyd; else none"},
    {.option = "state-interval", .arg = "S", .section = "state", .key = "interval",
     .type = TD_SET_UINT, .offset = FIELD(state_interval), .def = 30u,
     .min = 1, .max = TD_STATE_INTERVAL_LIMIT, .reload = TD_RELOAD_APPLIES,
     .help = "seconds between state snapshots: a kill -9 loses at most this much, a clean stop "
             "nothing"},
    /* [metrics] */
    {.option = "metrics", .arg = "ADDR:PORT", .section = "metrics", .key = "listen",
     .type = TD_SET_STRING, .offset = FIELD(metrics_listen), .reload = TD_RELOAD_RESTART,
     .example = "127.0.0.1:9464",
     .help = "serve Prometheus text over HTTP at http://ADDR:PORT/metrics, GET /healthz (200 "
             "serving, 503 draining or a GPU lost), the live web page at / and the JSON API at "
             "/api/v1/",
     .default_doc = "off"},
    {.option = "metrics-auth-file", .arg = "FILE", .section = "metrics", .key = "auth_file",
     .type = TD_SET_PATH, .offset = FIELD(metrics_auth_file), .reload = TD_RELOAD_RESTART,
     .example = "/etc/tallyd/metrics.auth",
     .help = "a file (mode 0600) whose first line is the USER:PASSWORD that GET /metrics, the "
             "web page and the API must present (HTTP basic auth; /healthz stays open); needed to "
             "listen on a network address in protected mode"},
    {.option = "metrics-streams", .arg = "N", .section = "metrics", .key = "streams",
     .type = TD_SET_UINT, .offset = FIELD(metrics_streams), .def = 100u,
     .max = TD_METRICS_STREAMS_LIMIT, .reload = TD_RELOAD_APPLIES,
     .help = "streams with their own `stream` label (the first ones created); the rest are summed "
             "as stream=\"" TD_METRICS_OTHER_STREAMS "\""},
    {.option = "metrics-histogram-buckets", .arg = "N", .section = "metrics",
     .key = "histogram_buckets", .type = TD_SET_UINT, .offset = FIELD(metrics_histogram_buckets),
     .def = 16u, .max = TALLY_HIST_BINS,
     .reload = TD_RELOAD_APPLIES,
     .help = "buckets of each labelled stream's Prometheus histogram (tallyd_stream_values_bucket), "
             "folded from its 256 bins; 0: no per-stream histograms"},
    {.option = "metrics-request-timeout-ms", .arg = "MS", .section = "metrics",
     .key = "request_timeout_ms", .type = TD_SET_UINT, .offset = FIELD(metrics_request_timeout_ms),
     .def = 5000u, .min = TD_METRICS_REQUEST_TIMEOUT_MS_MIN,
     .max = TD_METRICS_REQUEST_TIMEOUT_MS_LIMIT, .reload = TD_RELOAD_RESTART,
     .help = "deadline for each whole HTTP request, from the moment its connection is ready for "
             "it until its response is sent; then the connection is closed, however steadily it "
             "sends"},
    {.option = "metrics-max-connections", .arg = "N", .section = "metrics",
     .key = "max_connections", .type = TD_SET_UINT, .offset = FIELD(metrics_max_connections),
     .def = 256u, .min = 1, .max = TD_METRICS_MAX_CONNECTIONS_LIMIT,
     .reload = TD_RELOAD_RESTART,
     .help = "HTTP connections at once; a new one over the bound closes the oldest connection "
             "still waiting for a request, or is refused when all are inside one"},
    {.option = "metrics-max-connections-per-address", .arg = "N", .section = "metrics",
     .key = "max_connections_per_address", .type = TD_SET_UINT,
     .offset = FIELD(metrics_max_connections_per_address),
     .def = 16u, .min = 1,
     .max = TD_METRICS_MAX_CONNECTIONS_LIMIT, .reload = TD_RELOAD_RESTART,
     .help = "HTTP connections at once from one address (an IPv6 /64 counts as one), with the "
             "same rule"},
    {.option = "metrics-api-token-file", .arg = "FILE", .section = "metrics",
     .key = "api_token_file", .type = TD_SET_PATH, .offset = FIELD(metrics_api_token_file),
     .reload = TD_RELOAD_RESTART, .example = "/etc/tallyd/api.token",
     .help = "a file (mode 0600) whose first line is the bearer token that POST "
             "/api/v1/streams/NAME/reset and DELETE /api/v1/streams/NAME must present "
             "(Authorization: Bearer TOKEN); without it the HTTP API is read-only (403)",
     .default_doc = "none: read-only"},
    {.option = "metrics-max-sse-clients", .arg = "N", .section = "metrics",
     .key = "max_sse_clients", .type = TD_SET_UINT, .offset = FIELD(metrics_max_sse_clients),
     .def = 16u, .min = 1, .max = TD_METRICS_MAX_SSE_CLIENTS_LIMIT,
     .reload = TD_RELOAD_RESTART,
     .help = "event streams (the web page's live updates, GET .../events) open at once; beyond "
             "it a new one is answered 503. They are exempt from request_timeout_ms once "
             "streaming, and count apart from the connection bounds, so a probe and a scrape "
             "always get in"},
    {.option = "metrics-allowed-hosts", .arg = "LIST", .section = "metrics",
     .key = "allowed_hosts", .type = TD_SET_STRING, .offset = FIELD(metrics_allowed_hosts),
     .reload = TD_RELOAD_RESTART, .example = "tally.example.com,.lan",
     .help = "host names, comma-separated, that a request's Host header may give besides an IP "
             "address, localhost and the listen address's name (.lan: a domain and its "
             "subdomains; *: any); any other name is answered 421, against DNS rebinding",
     .default_doc = "none"},
    /* [security] */
    {.option = "curve-secret-key", .arg = "FILE", .section = "security", .key = "curve_secret_key",
     .type = TD_SET_PATH, .offset = FIELD(curve_secret_key), .reload = TD_RELOAD_RESTART,
     .example = "server.key",
     .help = "turn CURVE on with the server key pair in FILE, from `tally keygen` (mode 0600); a "
             "relative FILE is looked up in $CREDENTIALS_DIRECTORY (systemd's LoadCredential=)",
     .default_doc = "none: CURVE off"},
    {.option = "curve-clients-dir", .arg = "DIR", .section = "security", .key = "curve_clients_dir",
     .type = TD_SET_PATH, .offset = FIELD(curve_clients_dir), .reload = TD_RELOAD_REREAD,
     .example = "/etc/tallyd/clients",
     .help = "allowed client keys: DIR/NAME.pub each, client NAME"},
    {.option = "curve-clients", .arg = "LIST", .section = "security", .key = "curve_clients",
     .type = TD_SET_KEY_LIST, .offset = FIELD(curve_clients), .reload = TD_RELOAD_REREAD,
     .example = "cam1:rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7",
     .help = "allowed client keys: KEY or NAME:KEY, comma-separated"},
    {.option = "protected-mode", .arg = "on|off", .section = "security", .key = "protected_mode",
     .type = TD_SET_BOOL, .offset = FIELD(protected_mode), .def = true,
     .reload = TD_RELOAD_RESTART,
     .help = "refuse a network endpoint (tcp other than loopback) without CURVE, and metrics on "
             "one without auth_file; set it off only on a trusted network (a warning at every "
             "start)"},
    /* [gpu] */
    {.option = "gpu-streams", .arg = "K", .section = "gpu", .key = "streams", .type = TD_SET_UINT,
     .offset = FIELD(gpu_streams), .def = TD_DEFAULT_GPU_STREAMS, .min = 1,
     .max = TD_GPU_STREAMS_LIMIT, .reload = TD_RELOAD_RESTART,
     .help = "CUDA streams (lanes) per GPU"},
    {.option = "gpu-min-batch", .arg = "B", .section = "gpu", .key = "min_batch",
     .type = TD_SET_SIZE, .offset = FIELD(gpu_min_batch), .def = 0u,
     .max = SIZE_MAX, .reload = TD_RELOAD_RESTART,
     .help = "auto mode: smaller batches run on the CPU",
     .default_doc = "per operation, from the measured crossover: hist 64K, filter 4M, scan stays "
                    "on the CPU; shared-memory requests with input and output in registered "
                    "regions 64K"},
    {.option = "gpu-peer-queue", .arg = "N", .section = "gpu", .key = "peer_queue",
     .type = TD_SET_UINT, .offset = FIELD(gpu_peer_queue), .def = TD_DEFAULT_GPU_PEER_QUEUE,
     .max = TD_GPU_PEER_QUEUE_LIMIT, .reload = TD_RELOAD_APPLIES,
     .help = "a request by device reference runs on another GPU that reaches its region (peer "
             "access, NVLink) only while N requests or more are placed on the region's own GPU "
             "and the other has an idle lane; 0: always on the region's GPU (PROTOCOL.md §10)"},
    /* [shm] */
    {.option = "shm", .arg = "on|off", .section = "shm", .key = "enabled", .type = TD_SET_BOOL,
     .offset = FIELD(shm), .def = true, .reload = TD_RELOAD_RESTART,
     .help = "offer shared-memory input to producers on this host (PROTOCOL.md §10)"},
    {.option = "shm-socket", .arg = "PATH", .section = "shm", .key = "socket",
     .type = TD_SET_STRING, .offset = FIELD(shm_socket), .aux = FIELD(shm_socket_explicit),
     .reload = TD_RELOAD_RESTART, .example = "/run/tallyd/tallyd-shm.sock",
     .help = "the side channel, a Unix socket of mode 0660",
     .default_doc = TD_SHM_SOCKET_NAME " in $RUNTIME_DIRECTORY, which systemd sets to "
                                       "/run/tallyd; else in /run/tallyd as root, "
                                       "$XDG_RUNTIME_DIR, or /tmp/tallyd-UID"},
    {.option = "shm-socket-group", .arg = "G", .section = "shm", .key = "socket_group",
     .type = TD_SET_GROUP, .offset = FIELD(shm_socket_gid), .reload = TD_RELOAD_RESTART,
     .example = "camera",
     .help = "the socket's group (name or number), so that its members can connect; tallyd must "
             "be a member (under systemd: SupplementaryGroups=)",
     .default_doc = "tallyd's group"},
    {.option = "shm-allow-uids", .arg = "L", .section = "shm", .key = "allow_uids",
     .type = TD_SET_UIDS, .offset = FIELD(shm_allow_uids), .aux = FIELD(shm_allow_uid_count),
     .reload = TD_RELOAD_APPLIES, .example = "camera,1001",
     .help = "users (names or numbers, comma-separated) allowed besides tallyd's own; they also "
             "need access to the socket file (socket_group)",
     .default_doc = "none; tallyd's own user is always allowed"},
    {.option = "shm-allow-gids", .arg = "L", .section = "shm", .key = "allow_gids",
     .type = TD_SET_GIDS, .offset = FIELD(shm_allow_gids), .aux = FIELD(shm_allow_gid_count),
     .reload = TD_RELOAD_APPLIES, .example = "video",
     .help = "groups allowed (the peer's primary or supplementary), likewise"},
    {.option = "shm-max-regions-per-peer", .arg = "N", .section = "shm",
     .key = "max_regions_per_peer", .type = TD_SET_UINT, .offset = FIELD(shm_max_regions_per_peer),
     .def = 16u, .min = 1, .max = TD_SHM_MAX_REGIONS_LIMIT,
     .reload = TD_RELOAD_APPLIES, .help = "regions per side-channel connection"},
    {.option = "shm-max-bytes", .arg = "B", .section = "shm", .key = "max_bytes",
     .type = TD_SET_SIZE, .offset = FIELD(shm_max_bytes), .def = (2ull << 30), .min = 1,
     .max = SIZE_MAX, .reload = TD_RELOAD_APPLIES,
     .help = "registered (pinned) bytes in total, K/M/G"},
    {.option = "shm-max-connections-per-uid", .arg = "N", .section = "shm",
     .key = "max_connections_per_uid", .type = TD_SET_UINT, .offset = FIELD(shm_max_conns_per_uid),
     .def = 64u, .min = 1, .max = TD_SHM_CONNECTIONS_MAX,
     .reload = TD_RELOAD_APPLIES,
     .help = "side-channel connections one user (uid) may hold at once, of the 1024 tallyd "
             "serves; beyond it a connection is answered `quota` and closed"},
    {.option = "shm-register-timeout-ms", .arg = "MS", .section = "shm",
     .key = "register_timeout_ms", .type = TD_SET_UINT,
     .offset = FIELD(shm_register_timeout_ms), .def = 5000u,
     .min = TD_SHM_REGISTER_TIMEOUT_MS_MIN, .max = TD_SHM_REGISTER_TIMEOUT_MS_LIMIT,
     .reload = TD_RELOAD_APPLIES,
     .help = "a side-channel connection that has registered no region this long after it "
             "connected is closed"},
    /* [windows] */
    {.option = "window-intervals", .arg = "N", .section = "windows", .key = "intervals",
     .type = TD_SET_UINT, .offset = FIELD(window_intervals), .def = 60u,
     .max = TD_WINDOW_INTERVALS_LIMIT, .reload = TD_RELOAD_RESTART,
     .help = "intervals in each stream's window ring, 0 = off"},
    {.option = "window-interval-ms", .arg = "MS", .section = "windows", .key = "interval_ms",
     .type = TD_SET_UINT, .offset = FIELD(window_interval_ms), .def = 1000u,
     .min = TD_WINDOW_INTERVAL_MS_MIN, .max = TD_WINDOW_INTERVAL_MS_LIMIT,
     .reload = TD_RELOAD_RESTART, .help = "the length of one interval, in milliseconds"},
    /* [pub] */
    {.option = "pub", .arg = "ENDPOINT", .section = "pub", .key = "endpoint", .type = TD_SET_STRING,
     .offset = FIELD(pub_endpoint), .reload = TD_RELOAD_RESTART, .example = "tcp://127.0.0.1:5556",
     .help = "publish changed streams on a ZeroMQ PUB socket at ENDPOINT, topic = stream name "
             "(PROTOCOL.md §11)",
     .default_doc = "off"},
    {.option = "pub-interval-ms", .arg = "MS", .section = "pub", .key = "interval_ms",
     .type = TD_SET_UINT, .offset = FIELD(pub_interval_ms), .def = 1000u,
     .min = 0, .max = TD_PUB_INTERVAL_MS_LIMIT, .reload = TD_RELOAD_RESTART,
     .help = "how often to publish, in milliseconds (10 at least); 0 publishes nothing: no "
             "[pub] endpoint, a fleet worker nothing on tally.watch.<k> (tally watch --nats "
             "then queries), the web page's events every 1000 ms"},
    /* [nats] */
    {.option = "nats-servers", .arg = "URLS", .section = "nats", .key = "servers",
     .type = TD_SET_STRING, .offset = FIELD(nats_servers), .reload = TD_RELOAD_RESTART,
     .help = "join the fleet on these NATS JetStream servers (comma-separated URLs; a user and "
             "password or a token may be in a URL) and apply the partitions this worker owns "
             "(PROTOCOL.md §13), e.g. nats://10.0.0.1:4222,nats://10.0.0.2:4222",
     .default_doc = "off"},
    {.option = "nats-credentials", .arg = "FILE", .section = "nats", .key = "credentials",
     .type = TD_SET_PATH, .offset = FIELD(nats_credentials), .reload = TD_RELOAD_RESTART,
     .example = "/etc/tallyd/worker.creds",
     .help = "a NATS credentials file (user JWT and nkey seed)"},
    {.option = "nats-nkey", .arg = "KEY", .section = "nats", .key = "nkey", .type = TD_SET_STRING,
     .offset = FIELD(nats_nkey), .reload = TD_RELOAD_RESTART,
     .help = "a NATS user nkey (public, U...), with nkey_seed"},
    {.option = "nats-nkey-seed", .arg = "FILE", .section = "nats", .key = "nkey_seed",
     .type = TD_SET_PATH, .offset = FIELD(nats_nkey_seed), .reload = TD_RELOAD_RESTART,
     .help = "the file holding that nkey's seed"},
    {.option = "nats-tls-ca", .arg = "FILE", .section = "nats", .key = "tls_ca",
     .type = TD_SET_PATH, .offset = FIELD(nats_tls_ca), .reload = TD_RELOAD_RESTART,
     .help = "TLS to NATS, the servers' certificates checked against this CA file (PEM)"},
    {.option = "nats-tls-cert", .arg = "FILE", .section = "nats", .key = "tls_cert",
     .type = TD_SET_PATH, .offset = FIELD(nats_tls_cert), .reload = TD_RELOAD_RESTART,
     .help = "a TLS client certificate (PEM), for servers that verify clients"},
    {.option = "nats-tls-key", .arg = "FILE", .section = "nats", .key = "tls_key",
     .type = TD_SET_PATH, .offset = FIELD(nats_tls_key), .reload = TD_RELOAD_RESTART,
     .help = "its key (PEM)"},
    {.option = "nats-member-id", .arg = "ID", .section = "nats", .key = "member_id",
     .type = TD_SET_STRING, .offset = FIELD(nats_member_id), .reload = TD_RELOAD_RESTART,
     .help = "this worker's name in the fleet, 1..64 of A-Z a-z 0-9 - _",
     .default_doc = "the host name and the process id"},
    {.option = "nats-user", .arg = "NAME", .section = "nats", .key = "user", .type = TD_SET_STRING,
     .offset = FIELD(nats_user), .reload = TD_RELOAD_RESTART,
     .help = "the NATS user this worker connects as, for its inboxes (_INBOX.NAME.>, which its "
             "permissions must allow it to read); needed with credentials or an nkey",
     .default_doc = "the user in the servers' URLs, else anon"},
    {.option = "nats-local-writes", .arg = "on|off", .section = "nats", .key = "local_writes",
     .type = TD_SET_BOOL, .offset = FIELD(nats_local_writes), .def = false,
     .reload = TD_RELOAD_APPLIES,
     .help = "let ZeroMQ, shared-memory and HTTP clients of a worker change streams (hist, scan or "
             "filter on a stream, reset, delete); off, they get not_permitted and streams change "
             "only through their partitions (PROTOCOL.md §13 \"Security\")"},
    {.option = "nats-direct", .arg = "off|local|replicated", .section = "nats", .key = "direct",
     .type = TD_SET_STRING, .offset = FIELD(nats_direct), .reload = TD_RELOAD_RESTART,
     .help = "direct mode (PROTOCOL.md §13 \"Direct mode\"): producers send a stream's requests "
             "over ZeroMQ straight to the member owning its partition (tally --fleet), others "
             "answer not_owner; local: direct writes are durable at the partition's checkpoints "
             "only (a lost host loses those since); replicated: each write is answered once the "
             "partition's changelog record holding it is stored (TALLY_CL<k>)",
     .default_doc = "off"},
    {.option = "nats-commit-ms", .arg = "MS", .section = "nats", .key = "commit_ms",
     .type = TD_SET_UINT, .offset = FIELD(nats_commit_ms), .def = TD_DEFAULT_NATS_COMMIT_MS,
     .min = 0, .max = TD_NATS_COMMIT_MS_LIMIT, .reload = TD_RELOAD_RESTART,
     .help = "direct = replicated: a partition's changelog records are published together every "
             "this many ms (group commit; at once when 256 KiB wait; 0: at once), up to 4 "
             "messages of a partition in flight; with commit_when_idle, at once when none is"},
    {.option = "nats-commit-when-idle", .arg = "on|off", .section = "nats",
     .key = "commit_when_idle", .type = TD_SET_BOOL, .offset = FIELD(nats_commit_when_idle),
     .def = true, .reload = TD_RELOAD_RESTART,
     .help = "direct = replicated: a partition's waiting changelog records go at once when none of "
             "its messages is in flight and its last batch held fewer than 4 writes (a write at "
             "light load waits one PubAck, not commit_ms too), else every commit_ms; off: every "
             "commit_ms only (docs/fleet.md \"Replicated\")"},
    {.option = "nats-standbys", .arg = "N", .section = "nats", .key = "standbys",
     .type = TD_SET_UINT, .offset = FIELD(nats_standbys), .def = 0u, .min = 0,
     .max = TD_NATS_STANDBYS_LIMIT, .reload = TD_RELOAD_RESTART,
     .help = "direct = replicated: 1 keeps a warm copy of each partition on the next member of "
             "its rendezvous order (its checkpoint plus the changelog as it comes), which a "
             "take-over uses instead of the checkpoint and the whole tail when the checkpoint it "
             "fences is the one the copy started from or covers it (its `cl_since`: the copy "
             "runs on across checkpoints under direct writes); stale_ok queries may read it "
             "(docs/fleet.md \"Standbys\")"},
    {.option = "nats-advertise", .arg = "ENDPOINT", .section = "nats", .key = "advertise",
     .type = TD_SET_STRING, .offset = FIELD(nats_advertise), .reload = TD_RELOAD_RESTART,
     .example = "tcp://10.0.0.5:5555",
     .help = "the ZeroMQ endpoint other hosts reach this member at, published in TALLY_ENDPOINTS "
             "for direct mode",
     .default_doc = "the first bind endpoint"},
    {.option = "nats-partitions", .arg = "N", .section = "nats", .key = "partitions",
     .type = TD_SET_UINT, .offset = FIELD(nats_partitions), .def = TD_DEFAULT_NATS_PARTITIONS,
     .min = 1, .max = TALLY_NATS_MAX_PARTITIONS, .reload = TD_RELOAD_RESTART,
     .help = "partitions of a new fleet; a worker of an existing fleet must say the same"},
    {.option = "nats-replicas", .arg = "N", .section = "nats", .key = "replicas",
     .type = TD_SET_UINT, .offset = FIELD(nats_replicas), .def = TD_DEFAULT_NATS_REPLICAS,
     .min = 1, .max = TD_NATS_REPLICAS_LIMIT, .reload = TD_RELOAD_RESTART,
     .help = "replicas of the streams and buckets the worker creates (1 for a single server)"},
    {.option = "nats-lease-ttl-ms", .arg = "MS", .section = "nats", .key = "lease_ttl_ms",
     .type = TD_SET_UINT, .offset = FIELD(nats_lease_ttl_ms), .def = 0u,
     .min = TD_NATS_LEASE_TTL_MS_MIN, .max = TD_NATS_LEASE_TTL_MS_LIMIT,
     .reload = TD_RELOAD_RESTART,
     .help = "how long a partition's lease (and a member's heartbeat) lives without renewal; "
             "every worker of a fleet uses the same (unset: the fleet's)",
     .example = "15000", .default_doc = "the fleet's (its TALLY_LEASES bucket's TTL), else 15000"},
    {.option = "nats-checkpoint-interval-ms", .arg = "MS", .section = "nats",
     .key = "checkpoint_interval_ms", .type = TD_SET_UINT, .offset = FIELD(nats_checkpoint_ms),
     .def = TD_DEFAULT_NATS_CHECKPOINT_MS, .min = TD_NATS_CHECKPOINT_MS_MIN,
     .max = TD_NATS_CHECKPOINT_MS_LIMIT, .reload = TD_RELOAD_RESTART,
     .help = "a partition's state is checkpointed at least this often while messages arrive"},
    {.option = "nats-inflight", .arg = "N", .section = "nats", .key = "inflight",
     .type = TD_SET_UINT, .offset = FIELD(nats_inflight), .def = TD_DEFAULT_NATS_INFLIGHT,
     .min = 1, .max = TD_NATS_INFLIGHT_LIMIT, .reload = TD_RELOAD_RESTART,
     .help = "messages of one partition in the request path at once (different streams side by "
             "side, each stream in order)"},
    {.option = "nats-inflight-bytes", .arg = "B", .section = "nats", .key = "inflight_bytes",
     .type = TD_SET_SIZE, .offset = FIELD(nats_inflight_bytes),
     .def = TD_DEFAULT_NATS_INFLIGHT_BYTES, .min = 1 << 16, .max = SIZE_MAX,
     .reload = TD_RELOAD_RESTART,
     .help = "payload bytes of one partition's messages in the request path at once (one "
             "message always goes), K/M/G"},
    {.option = "nats-members-per-process", .arg = "K", .section = "nats",
     .key = "members_per_process", .type = TD_SET_UINT,
     .offset = FIELD(nats_members_per_process), .def = 1u, .min = 1,
     .max = TD_NATS_MEMBERS_PER_PROCESS_LIMIT, .reload = TD_RELOAD_RESTART,
     .help = "fleet members this tallyd runs, each on a thread of its own with its own "
             "connections, named MEMBER_ID-0 .. MEMBER_ID-(K-1) when K > 1: the partitions "
             "spread over them as over separate workers, so one process applies on K threads; "
             "not with direct mode"},
    {.option = "nats-partition-max-bytes", .arg = "B", .section = "nats",
     .key = "partition_max_bytes", .type = TD_SET_SIZE, .offset = FIELD(nats_partition_max_bytes),
     .def = TD_DEFAULT_NATS_PARTITION_MAX_BYTES, .min = 1 << 20, .max = SIZE_MAX,
     .reload = TD_RELOAD_RESTART,
     .help = "messages a partition's JetStream stream holds before producers are refused "
             "(set when the worker creates it), K/M/G"},
    {.option = "nats-partition-max-age-s", .arg = "S", .section = "nats",
     .key = "partition_max_age_s", .type = TD_SET_UINT, .offset = FIELD(nats_partition_max_age_s),
     .def = TD_DEFAULT_NATS_PARTITION_MAX_AGE_S, .min = TD_NATS_PARTITION_MAX_AGE_S_MIN,
     .max = TD_NATS_PARTITION_MAX_AGE_S_LIMIT, .reload = TD_RELOAD_RESTART,
     .help = "how long a partition's JetStream stream keeps a message, in seconds (set when the "
             "worker creates it): what no worker applied within it is lost"},
    /* The command line alone. */
    {.option = "config", .short_flag = 'c', .arg = "FILE", .type = TD_SET_CONFIG,
     .offset = FIELD(config_file), .aux = FIELD(config_file_explicit), .help = "configuration file",
     .default_doc = TD_DEFAULT_CONFIG_FILE " if present"},
    {.option = "check-config", .type = TD_SET_FLAG, .offset = FIELD(check_only),
     .help = "check the configuration file and options, and read the files they name as the "
             "start would (keys, the clients directory, auth and token files, NATS "
             "credentials), then exit"},
    {.option = "help", .short_flag = 'h', .type = TD_SET_ACTION, .action = TD_ACTION_HELP,
     .help = "this text"},
    {.option = "version", .short_flag = 'V', .type = TD_SET_ACTION, .action = TD_ACTION_VERSION,
     .help = "print the version"},
    /* Hidden: tuning (bench/NOTES.md), the tests' hooks, and the documents' generators. */
    {.option = "gpu-spin-us", .arg = "US", .type = TD_SET_UINT, .offset = FIELD(gpu_spin_us),
     .def = TD_GPU_SPIN_US_UNSET, .max = TD_GPU_SPIN_US_LIMIT, .hidden = true,
     .default_doc = "50 on a GPU, 0 (no polling) on the tests' simulated GPUs",
     .help = "lane threads poll the GPU this long for a completion before they sleep; launches "
             "then enqueue no host function"},
    {.option = "gpu-spin-loop", .type = TD_SET_FLAG, .offset = FIELD(gpu_spin_loop),
     .hidden = true, .help = "the loop thread polls instead of sleeping while requests are on the GPU"},
    {.option = "test-fault-every", .arg = "N", .type = TD_SET_UINT,
     .offset = FIELD(test_fault_every), .max = 1u << 30, .hidden = true,
     .help = "every Nth GPU request reports a failure"},
    {.option = "test-sim-gpus", .arg = "N", .type = TD_SET_UINT, .offset = FIELD(test_sim_gpus),
     .max = 16, .hidden = true, .help = "N simulated GPUs (host memory, CPU kernels)"},
    {.option = "test-gpu-peer-always", .type = TD_SET_FLAG,
     .offset = FIELD(test_gpu_peer_always), .hidden = true,
     .help = "requests by device reference run on a peer GPU whenever one reaches the region"},
    {.option = "test-shm-deny-own-uid", .type = TD_SET_FLAG, .offset = FIELD(test_shm_deny_own_uid),
     .hidden = true, .help = "refuse tallyd's own uid too, to test the refusal"},
    {.option = "test-clock", .arg = "FILE", .type = TD_SET_STRING, .offset = FIELD(test_clock),
     .hidden = true, .help = "the window clock, read from FILE"},
    {.option = "print-settings-md", .type = TD_SET_ACTION, .action = TD_ACTION_PRINT_MD,
     .hidden = true, .help = "print docs/service.md's configuration table"},
    {.option = "print-example-conf", .type = TD_SET_ACTION, .action = TD_ACTION_PRINT_CONF,
     .hidden = true, .help = "print systemd/tallyd.conf.example"},
    {.option = "print-options-scd", .type = TD_SET_ACTION, .action = TD_ACTION_PRINT_OPTIONS_SCD,
     .hidden = true, .help = "print tallyd(8)'s OPTIONS (scdoc)"},
    {.option = "print-settings-scd", .type = TD_SET_ACTION, .action = TD_ACTION_PRINT_CONF_SCD,
     .hidden = true, .help = "print tallyd.conf(5)'s settings (scdoc)"},
};
/* clang-format on */

const size_t td_settings_count = sizeof td_settings / sizeof td_settings[0];
_Static_assert(sizeof td_settings / sizeof td_settings[0] <= TD_SETTINGS_MAX,
               "raise TD_SETTINGS_MAX");

const td_setting_t *td_setting_by_option(const char *option)
{
    for (size_t i = 0; i < td_settings_count; i++)
        if (strcmp(td_settings[i].option, option) == 0)
            return &td_settings[i];
    return NULL;
}

const td_setting_t *td_setting_by_key(const char *section, const char *key)
{
    for (size_t i = 0; i < td_settings_count; i++) {
        const td_setting_t *s = &td_settings[i];
        if (s->section && strcmp(s->section, section) == 0 && strcmp(s->key, key) == 0)
            return s;
    }
    return NULL;
}

bool td_settings_has_section(const char *section)
{
    for (size_t i = 0; i < td_settings_count; i++)
        if (td_settings[i].section && strcmp(td_settings[i].section, section) == 0)
            return true;
    return false;
}

void td_setting_name(const td_setting_t *s, char *buf, size_t cap)
{
    if (!s->section)
        snprintf(buf, cap, "%s", s->option);
    else if (strcmp(s->section, "server") == 0)
        snprintf(buf, cap, "%s", s->key);
    else
        snprintf(buf, cap, "%s %s", s->section, s->key);
}

/* ---- Where a setting lives in td_config_t ------------------------------------------------ */

static void *field(const td_setting_t *s, const td_config_t *cfg)
{
    return (char *)cfg + s->offset;
}

static void *aux_field(const td_setting_t *s, const td_config_t *cfg)
{
    return (char *)cfg + s->aux;
}

static bool is_string(const td_setting_t *s)
{
    return s->type == TD_SET_STRING || s->type == TD_SET_PATH || s->type == TD_SET_KEY_LIST ||
           s->type == TD_SET_CONFIG;
}

static bool is_id_list(const td_setting_t *s)
{
    return s->type == TD_SET_UIDS || s->type == TD_SET_GIDS;
}

void td_setting_init(const td_setting_t *s, td_config_t *cfg)
{
    void *p = field(s, cfg);
    switch (s->type) {
    case TD_SET_UINT:
        *(unsigned *)p = (unsigned)s->def;
        break;
    case TD_SET_SIZE:
        *(size_t *)p = (size_t)s->def;
        break;
    case TD_SET_BOOL:
    case TD_SET_FLAG:
        *(bool *)p = s->def != 0;
        break;
    case TD_SET_BACKEND:
        *(td_backend_choice_t *)p = (td_backend_choice_t)s->def;
        break;
    case TD_SET_LOG_LEVEL:
        *(int *)p = (int)s->def;
        break;
    case TD_SET_GROUP:
        *(int *)p = -1;
        break;
    default: /* strings and lists start empty: td_config_init zeroed them */
        break;
    }
}

void td_setting_free(const td_setting_t *s, td_config_t *cfg)
{
    if (is_string(s)) {
        char **str = field(s, cfg);
        free(*str);
        *str = NULL;
    } else if (s->type == TD_SET_ENDPOINTS) {
        char **binds = field(s, cfg);
        int *count = aux_field(s, cfg);
        for (int i = 0; i < *count; i++) {
            free(binds[i]);
            binds[i] = NULL;
        }
        *count = 0;
    }
}

/* ---- Parsing ------------------------------------------------------------------------------ */

static td_err_t parse_number(const td_setting_t *s, const char *text, unsigned long long *out)
{
    char *end = NULL;
    errno = 0;
    unsigned long long value = strtoull(text, &end, 10);
    if (errno || end == text || *end != '\0' || text[0] == '-')
        return TD_ERR_CONFIG;
    *out = value;
    return value < s->min || value > s->max ? TD_ERR_CONFIG : TD_OK;
}

static td_err_t parse_size(const td_setting_t *s, const char *text, size_t *out)
{
    size_t value = 0;
    if (tally_size_parse(text, &value, NULL, 0) != TALLY_OK || value < s->min || value > s->max)
        return TD_ERR_CONFIG;
    *out = value;
    return TD_OK;
}

static td_err_t parse_on_off(const char *text, bool *out)
{
    if (strcmp(text, "on") == 0 || strcmp(text, "yes") == 0 || strcmp(text, "true") == 0)
        *out = true;
    else if (strcmp(text, "off") == 0 || strcmp(text, "no") == 0 || strcmp(text, "false") == 0)
        *out = false;
    else
        return TD_ERR_CONFIG;
    return TD_OK;
}

static td_err_t parse_backend(const char *text, td_backend_choice_t *out)
{
    static const td_backend_choice_t choices[] = {TD_BACKEND_AUTO, TD_BACKEND_CPU, TD_BACKEND_CUDA};
    for (size_t i = 0; i < sizeof choices / sizeof choices[0]; i++)
        if (strcmp(text, td_backend_choice_name(choices[i])) == 0) {
            *out = choices[i];
            return TD_OK;
        }
    return TD_ERR_CONFIG;
}

static td_err_t parse_log_level(const char *text, int *out)
{
    int level = td_log_parse_level(text);
    if (level < 0)
        return TD_ERR_CONFIG;
    *out = level;
    return TD_OK;
}

/* Sets an owned string; an empty value means "none". */
static td_err_t replace_string(char **field_p, const char *value)
{
    char *copy = value[0] ? strdup(value) : NULL;
    if (value[0] && !copy)
        return TD_ERR_NOMEM;
    free(*field_p);
    *field_p = copy;
    return TD_OK;
}

/* replace_string for a file or directory: a relative path names a credential systemd passed
 * (LoadCredential=: $CREDENTIALS_DIRECTORY/PATH) when that is set, else it is taken as given. */
static td_err_t replace_path(char **field_p, const char *value)
{
    const char *creds = getenv("CREDENTIALS_DIRECTORY");
    if (!value[0] || value[0] == '/' || !creds || !creds[0])
        return replace_string(field_p, value);
    char path[4096];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", creds, value) >= sizeof path)
        return TD_ERR_CONFIG;
    return replace_string(field_p, path);
}

/* curve_clients: comma-separated KEY or NAME:KEY items, each key one tally_key_valid accepts.
 * The one check of the list, at start, --check-config and every reload: td_auth.c's load_list
 * reads what passed it as it is. */
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
static td_err_t parse_id_list(const char *text, bool group, unsigned *ids, unsigned *count)
{
    unsigned n = 0;
    char item[256];
    for (const char *p = text; *p;) {
        size_t len = strcspn(p, ",");
        if (len == 0 || len >= sizeof item || n >= TD_SHM_ALLOW_MAX)
            return TD_ERR_CONFIG;
        memcpy(item, p, len);
        item[len] = '\0';
        if (!parse_id(item, group, &ids[n++]))
            return TD_ERR_CONFIG;
        p += len + (p[len] == ',');
    }
    *count = n;
    return TD_OK;
}

static td_err_t parse_group(const char *text, int *gid)
{
    unsigned id = 0;
    if (text[0] && !parse_id(text, true, &id))
        return TD_ERR_CONFIG;
    *gid = text[0] ? (int)id : -1;
    return TD_OK;
}

static td_err_t add_endpoint(const td_setting_t *s, td_config_t *cfg, const char *endpoint,
                             char *why, size_t why_cap)
{
    char reason[160];
    if (tally_endpoint_check(endpoint, TALLY_ENDPOINT_BIND, reason, sizeof reason) != TALLY_OK) {
        snprintf(why, why_cap, "invalid endpoint '%s' for --%s: %s", endpoint, s->option, reason);
        return TD_ERR_CONFIG;
    }
    return td_config_add_endpoint(field(s, cfg), aux_field(s, cfg), endpoint);
}

/* A string setting with its flag that says it was given (aux). */
static td_err_t parse_string(const td_setting_t *s, td_config_t *cfg, const char *value)
{
    char **str = field(s, cfg);
    td_err_t err = s->type == TD_SET_PATH ? replace_path(str, value) : replace_string(str, value);
    if (err == TD_OK && s->aux)
        *(bool *)aux_field(s, cfg) = *str != NULL;
    return err;
}

/* --config FILE: kept as given, even empty (a file that cannot be read is then an error). */
static td_err_t parse_config(const td_setting_t *s, td_config_t *cfg, const char *value)
{
    char *copy = strdup(value);
    if (!copy)
        return TD_ERR_NOMEM;
    char **str = field(s, cfg);
    free(*str);
    *str = copy;
    *(bool *)aux_field(s, cfg) = true;
    return TD_OK;
}

td_err_t td_setting_parse(const td_setting_t *s, td_config_t *cfg, const char *value, char *why,
                          size_t why_cap)
{
    void *p = field(s, cfg);
    unsigned long long number = 0;
    td_err_t err;
    why[0] = '\0';
    switch (s->type) {
    case TD_SET_UINT:
        if ((err = parse_number(s, value, &number)) == TD_OK)
            *(unsigned *)p = (unsigned)number;
        return err;
    case TD_SET_SIZE:
        return parse_size(s, value, p);
    case TD_SET_BOOL:
        return parse_on_off(value, p);
    case TD_SET_KEY_LIST:
        return valid_key_list(value) ? parse_string(s, cfg, value) : TD_ERR_CONFIG;
    case TD_SET_STRING:
    case TD_SET_PATH:
        return parse_string(s, cfg, value);
    case TD_SET_CONFIG:
        return parse_config(s, cfg, value);
    case TD_SET_BACKEND:
        return parse_backend(value, p);
    case TD_SET_LOG_LEVEL:
        return parse_log_level(value, p);
    case TD_SET_ENDPOINTS:
        return add_endpoint(s, cfg, value, why, why_cap);
    case TD_SET_GROUP:
        return parse_group(value, p);
    case TD_SET_UIDS:
    case TD_SET_GIDS:
        return parse_id_list(value, s->type == TD_SET_GIDS, p, aux_field(s, cfg));
    case TD_SET_FLAG:
        *(bool *)p = true;
        return TD_OK;
    case TD_SET_ACTION:
        break;
    }
    return TD_ERR_CONFIG; /* an action has no value */
}

/* ---- Showing, comparing and copying values ------------------------------------------------ */

/* A size as the file takes it: the largest of G, M, K that divides it, else bytes. */
static void format_size(size_t value, char *buf, size_t cap)
{
    static const char suffixes[] = "GMK";
    for (int i = 0; i < 3; i++) {
        size_t unit = (size_t)1 << (10 * (3 - i));
        if (value && value % unit == 0) {
            snprintf(buf, cap, "%zu%c", value / unit, suffixes[i]);
            return;
        }
    }
    snprintf(buf, cap, "%zu", value);
}

/* Items joined with commas: strings (ids NULL) or numbers. */
static void format_list(char *const *strs, const unsigned *ids, int count, char *buf, size_t cap)
{
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; i < count && used < cap; i++) {
        int n = ids ? snprintf(buf + used, cap - used, "%s%u", i ? "," : "", ids[i])
                    : snprintf(buf + used, cap - used, "%s%s", i ? "," : "", strs[i]);
        used += n > 0 ? (size_t)n : 0;
    }
}

static void format_lists(const td_setting_t *s, const td_config_t *cfg, bool docs, char *buf,
                         size_t cap)
{
    if (s->type == TD_SET_ENDPOINTS)
        format_list(field(s, cfg), NULL, *(int *)aux_field(s, cfg), buf, cap);
    else
        format_list(NULL, field(s, cfg), (int)*(unsigned *)aux_field(s, cfg), buf, cap);
    if (!buf[0] && s->type == TD_SET_ENDPOINTS && docs && s->offset == FIELD(binds))
        snprintf(buf, cap, "%s", TD_DEFAULT_ENDPOINT); /* the fronts have none */
    else if (!buf[0] && !docs)
        snprintf(buf, cap, "(none)");
}

void td_setting_format(const td_setting_t *s, const td_config_t *cfg, bool docs, char *buf,
                       size_t cap)
{
    const void *p = field(s, cfg);
    buf[0] = '\0';
    if (is_string(s)) {
        const char *str = *(char *const *)p;
        snprintf(buf, cap, "%s", str ? str : docs ? "" : "(none)");
    } else if (s->type == TD_SET_ENDPOINTS || is_id_list(s)) {
        format_lists(s, cfg, docs, buf, cap);
    } else if (s->type == TD_SET_UINT) {
        snprintf(buf, cap, "%u", *(const unsigned *)p);
    } else if (s->type == TD_SET_SIZE && docs) {
        format_size(*(const size_t *)p, buf, cap);
    } else if (s->type == TD_SET_SIZE) {
        snprintf(buf, cap, "%zu", *(const size_t *)p);
    } else if (s->type == TD_SET_BOOL || s->type == TD_SET_FLAG) {
        snprintf(buf, cap, "%s", *(const bool *)p ? "on" : "off");
    } else if (s->type == TD_SET_BACKEND) {
        snprintf(buf, cap, "%s", td_backend_choice_name(*(const td_backend_choice_t *)p));
    } else if (s->type == TD_SET_LOG_LEVEL) {
        snprintf(buf, cap, "%s", td_log_level_name((td_log_level_t) * (const int *)p));
    } else if (s->type == TD_SET_GROUP && (*(const int *)p >= 0 || !docs)) {
        snprintf(buf, cap, "%d", *(const int *)p);
    }
}

static bool same_string(const char *a, const char *b)
{
    return (!a && !b) || (a && b && strcmp(a, b) == 0);
}

static bool same_binds(const td_setting_t *s, const td_config_t *live, const td_config_t *next)
{
    int count = *(int *)aux_field(s, next);
    char *const *a = field(s, live);
    char *const *b = field(s, next);
    if (count == 0) /* the default endpoint, or the sockets systemd passed */
        return true;
    if (count != *(int *)aux_field(s, live))
        return false;
    for (int i = 0; i < count; i++)
        if (strcmp(a[i], b[i]) != 0)
            return false;
    return true;
}

/* The bytes of a setting's value, for the kinds compared byte for byte. */
static size_t value_bytes(const td_setting_t *s)
{
    switch (s->type) {
    case TD_SET_UINT:
        return sizeof(unsigned);
    case TD_SET_SIZE:
        return sizeof(size_t);
    case TD_SET_BOOL:
    case TD_SET_FLAG:
        return sizeof(bool);
    case TD_SET_BACKEND:
        return sizeof(td_backend_choice_t);
    case TD_SET_UIDS:
    case TD_SET_GIDS:
        return TD_SHM_ALLOW_MAX * sizeof(unsigned);
    default: /* log level, group */
        return sizeof(int);
    }
}

bool td_setting_same(const td_setting_t *s, const td_config_t *live, const td_config_t *next)
{
    if (is_string(s))
        return same_string(*(char **)field(s, live), *(char **)field(s, next));
    if (s->type == TD_SET_ENDPOINTS)
        return same_binds(s, live, next);
    if (s->type == TD_SET_ACTION)
        return true;
    if (is_id_list(s) && *(unsigned *)aux_field(s, live) != *(unsigned *)aux_field(s, next))
        return false;
    return memcmp(field(s, live), field(s, next), value_bytes(s)) == 0;
}

static td_err_t copy_binds(const td_setting_t *s, td_config_t *live, const td_config_t *next)
{
    char *copies[TD_MAX_BINDS] = {NULL};
    int count = *(int *)aux_field(s, next);
    char *const *from = field(s, next);
    for (int i = 0; i < count; i++)
        if (!(copies[i] = strdup(from[i]))) {
            while (i-- > 0)
                free(copies[i]);
            return TD_ERR_NOMEM;
        }
    td_setting_free(s, live);
    memcpy(field(s, live), copies, sizeof copies);
    *(int *)aux_field(s, live) = count;
    return TD_OK;
}

td_err_t td_setting_copy(const td_setting_t *s, td_config_t *live, const td_config_t *next)
{
    if (is_string(s)) {
        const char *from = *(char **)field(s, next);
        char *copy = from ? strdup(from) : NULL;
        if (from && !copy)
            return TD_ERR_NOMEM;
        td_setting_free(s, live);
        *(char **)field(s, live) = copy;
        return TD_OK;
    }
    if (s->type == TD_SET_ENDPOINTS)
        return copy_binds(s, live, next);
    if (is_id_list(s))
        *(unsigned *)aux_field(s, live) = *(unsigned *)aux_field(s, next);
    if (s->type != TD_SET_ACTION)
        memcpy(field(s, live), field(s, next), value_bytes(s));
    return TD_OK;
}
