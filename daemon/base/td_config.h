/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_config.h — tallyd's settings: the one place where every limit and default lives.
 *
 * A td_config_t is filled in three layers, each overriding the last: the defaults below, the
 * configuration file (INI, see td_config_load_file), then the command line. SIGHUP re-reads the
 * file and applies what can change at run time (td_config_apply_runtime). Which option, key,
 * default, range and reload behaviour each field has is one row of the table in td_settings.c;
 * the limits and defaults it uses are here.
 */
#ifndef TD_CONFIG_H
#define TD_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_err.h"

#define TD_DEFAULT_ENDPOINT TALLY_DEFAULT_ENDPOINT /* proto/tally_proto.h */
/* As many streams as max_state_bytes holds of streams that got a batch of bytes (~850 bytes
 * each with the default window ring, 1 KiB with the allocator's overhead: bench/RESULTS.md,
 * issue 26); max_state_bytes is the limit that matters. */
#define TD_DEFAULT_MAX_STREAMS (unsigned)(TD_DEFAULT_MAX_STATE_BYTES / 1024u)
#define TD_MAX_STREAMS_LIMIT (1u << 24)
#define TD_WORKERS_LIMIT 1024u
/* Per-peer limits (td_peers.h), so that no peer can hurt another: a connection may hold at most
 * max_inflight_per_peer of the max_inflight slots. 0, the default, is a fair share: max_inflight
 * divided among the connections that have requests in flight, but never below
 * TD_FAIR_SHARE_MIN (libtally's default window), so that a peer alone keeps its whole pipeline
 * and 8 producers x 8 in flight (the benchmark) are never refused at the default 64. A client
 * identity may create at most max_streams_per_client streams (0: half of max_streams), and at
 * most stream_create_rate per second, in bursts of one second's worth (0: unlimited). */
#define TD_FAIR_SHARE_MIN 8u
#define TD_STREAM_CREATE_RATE_LIMIT 1000000u
#define TD_PEERS_SWEEP_MS 1000 /* how often idle per-peer entries are freed */
/* Memory for stream state (td_stream.h): every stream's counters, histogram and window ring,
 * at most max_state_bytes in all and max_state_bytes_per_client for the streams one client
 * created (0: half of max_state_bytes). */
#define TD_DEFAULT_MAX_STATE_BYTES (2ull << 30)
/* Streams whose expired window intervals are freed per sweep tick (TD_PEERS_SWEEP_MS): 100,000
 * streams are all visited every 25 s. */
#define TD_STREAMS_SWEEP_PER_TICK 4096u
/* A frame over max_frame makes ZeroMQ close the connection (ZMQ_MAXMSGSIZE) instead of tallyd
 * answering too_large. It is a memory guard, not the batch limit: ZeroMQ reads a whole frame
 * into memory before tallyd sees it, and queues up to RCVHWM messages per peer, so a peer can
 * make tallyd hold RCVHWM x max_frame. 4 x max_batch (64 MiB by default) keeps that within 4x of
 * what valid traffic at the limit already takes (RCVHWM x max_batch), while any plausible
 * mistake (a payload a little or a few times too large) is still answered too_large on a
 * connection that stays open. --max-frame sets it (at least max_batch + 64 KiB, so that every
 * too_large-sized payload a client may plausibly send is answered); 0 means 4 x max_batch. */
#define TD_MAX_FRAME_FACTOR 4u
#define TD_MAX_FRAME_HEADROOM (64u << 10)
#define TD_MAX_FRAME_LIMIT (16ull << 30)
/* Replies handed to ZeroMQ and not yet written out (a peer that does not read its replies) hold
 * memory that ZeroMQ's high-water mark bounds only in messages (1024 per connection, each up to
 * 2 x max_batch for an int64 scan): one peer pipelining 16 MiB scans without reading took
 * tallyd to 3.2 GiB in 8 s (issue 21). So tallyd counts reply bytes from when a request is read
 * (its largest possible reply is reserved) until ZeroMQ frees the reply, per connection and in
 * total, and answers `busy` to a request whose reply would go past either bound (td_reply.h).
 * Per connection, 0 (the default) means TD_FAIR_SHARE_MIN (libtally's window) of the largest
 * reply, 2 x max_batch: 256 MiB at the default max_batch, so a client that keeps 8 scans of the
 * largest batch in flight is never refused. In total, 0 means twice that: 512 MiB. A connection
 * (and tallyd) holding nothing may always have one request, whatever its reply. */
#define TD_REPLY_BYTES_TOTAL_FACTOR 2u
#define TD_MAX_REPLY_BYTES_LIMIT (1ull << 40)
/* A reply to a connection that has closed is kept this long for a connection with the same
 * routing id to come back (libtally's DEALER reconnects after ZeroMQ's 100 ms), and retried every
 * TD_REPLY_RETRY_MS meanwhile (td_reply.h). ZeroMQ closes a connection that sends a frame over
 * max_frame: the requests it sent before were accepted and are still answered. */
#define TD_REPLY_RECONNECT_GRACE_MS 2000u
#define TD_REPLY_RETRY_MS 20u
/* After SIGTERM/SIGINT tallyd keeps reading what is queued in its socket, answering each with
 * `shutdown`, for at most this long (--drain-ms); requests running on a backend finish first. */
/* ...and stops earlier once nothing is in flight and no message has arrived for this long. Not
 * at the first moment the socket looks empty: a message is visible only once ZeroMQ's I/O thread
 * has read all of it, so a large message still crossing TCP, or bytes the kernel holds for an
 * I/O thread that has not run yet (after SIGCONT the loop and the I/O thread wake together),
 * look like no input for a moment. */
#define TD_DRAIN_QUIET_MS 250u
#define TD_DRAIN_MS_LIMIT 600000u
#define TD_DEFAULT_RCVHWM 64 /* ZeroMQ messages queued per peer before TCP pushes back */
#define TD_DEFAULT_SNDHWM 1024
/* GPU pipeline (td_gpu.c). */
#define TD_DEFAULT_GPU_STREAMS 4u /* CUDA streams (lanes) per GPU, --gpu-streams */
#define TD_GPU_STREAMS_LIMIT 64u
#define TD_GPU_SLOTS_PER_LANE 2u /* pinned staging slots per lane: one filling, one on the GPU */
#define TD_GPU_DEAD_AFTER 3u     /* GPU errors in a row after which a device is unusable */
/* Requests by device reference go to a GPU that reaches their region over peer access only while
 * the region's own GPU has this many requests placed on it and not back (gpu_peer_queue; td_sched.c
 * region_device has the figures: a peer reads at ~0.17 x the owner's rate, so the request takes
 * ~6 x as long there): 4 lanes x TD_SCHED_LANE_DEPTH, every lane of the owner full. */
#define TD_DEFAULT_GPU_PEER_QUEUE 16u
#define TD_GPU_PEER_QUEUE_LIMIT (1u << 20)
/* An unusable device's context is recreated once it is idle, polled this often, at most this
 * many times per device (td_gpu_device.c): a GPU that keeps failing stays unusable. */
#define TD_GPU_RECOVER_POLL_MS 100u
#define TD_GPU_RECOVER_MAX 3u
/* Pinned reply buffers per device: a filter or scan reply of up to TD_GPU_REPLY_BUF_BYTES is
 * copied by the device straight into one, which is then sent as the reply (zmq_msg_init_data)
 * and given back when ZeroMQ has sent it, instead of being copied out of staging into a malloc'd
 * reply on the lane thread. Larger replies, or all buffers held by ZeroMQ (peers that read
 * slowly), take the copy. 16 x 4 MiB = 64 MiB pinned per device: 4 lanes x 2 slots in flight
 * with as many replies still on their way out. */
/* One large shared-memory request is split over the device's lanes (CUDA streams), so one
 * request alone keeps every copy engine busy: pinned H2D reaches ~49 GB/s from 4 MiB copies but
 * one stream serialises copy-in, kernel and copy-out of a batch. A hist, or a scan into a
 * registered output region (the carry chained from piece to piece on the device), from
 * TD_GPU_SPLIT_MIN_BYTES of registered input, in pieces of at least TD_GPU_SPLIT_PIECE_MIN_BYTES,
 * at most one per lane and TD_GPU_SPLIT_MAX_PIECES. Filters are not split: the pieces' compacted
 * outputs would have to be packed together after every piece's count is known. */
#define TD_GPU_SPLIT_MIN_BYTES (8u << 20)
/* Staging slots and device buffers hold at most this much of a batch, whatever max_batch is:
 * sized by max_batch alone, a --max-batch 256M made 6 GiB of pinned staging (4 lanes x 2 slots
 * x 768 MiB). A batch above it runs on the GPU only when it can be split into pieces that fit
 * (the shared-memory hist and scan above, up to TD_GPU_SPLIT_MAX_PIECES pieces: 1 GiB), else
 * on the CPU backend, even with --backend cuda. */
#define TD_GPU_BUFFER_MAX_BYTES (64u << 20)
#define TD_GPU_SPLIT_PIECE_MIN_BYTES (2u << 20)
#define TD_GPU_SPLIT_MAX_PIECES 16u
#define TD_GPU_REPLY_BUFS 16u
#define TD_GPU_REPLY_BUF_BYTES (4u << 20)
/* A lane thread with work on the device polls this long for its completion (or a new request)
 * before it sleeps, saving a wake-up per request when batches are short (--gpu-spin-us; see
 * bench/NOTES.md for the A/B that chose it). */
#define TD_GPU_SPIN_US_LIMIT 10000u
/* Unset, lanes poll TD_GPU_SPIN_US_DEFAULT on a real GPU and not at all on the tests' simulated
 * ones (whose behaviour on the 2-core CI box stays what it was). 50 us: on the H200 polling beat
 * host functions on every device-region row, one in flight and 8 (bench/NOTES.md, issue 34). */
#define TD_GPU_SPIN_US_DEFAULT 50u
#define TD_GPU_SPIN_US_UNSET 0xffffffffu
/* CPU batches up to this size run on the loop thread itself (a 16 KiB batch takes a few
 * microseconds there): through the worker pool, a 4 KiB request's p50 was 27-43 us over the
 * ZeroMQ echo on the H200 host (bench/NOTES.md), two thread wake-ups more than needed. */
#define TD_EXEC_INLINE_MAX (16u << 10)
/* Fair service between peers (td_sched.c): compute requests wait in a queue per connection and
 * class (CPU workers, GPU lanes), and the queues take turns by bytes (deficit round robin), so a
 * peer flooding 1 MiB batches holds up another's batch by about one of its own, not by its whole
 * backlog (issue 21: a light peer's p50 rose 10-35x while libuv's one FIFO held the flood). Each
 * turn adds TD_SCHED_QUANTUM bytes to a queue's allowance; a request costs its payload plus
 * TD_SCHED_REQUEST_COST. At most the workers plus TD_SCHED_CPU_AHEAD requests are handed to the
 * CPU pool at once (one queued in the pool, so that a worker that finishes starts the next at
 * once instead of waiting for the loop thread to hand it one), and per GPU lane
 * TD_SCHED_LANE_DEPTH (its TD_GPU_SLOTS_PER_LANE staging slots busy, as many waiting). */
#define TD_SCHED_QUANTUM (256u << 10)
#define TD_SCHED_REQUEST_COST (4u << 10)
#define TD_SCHED_CPU_AHEAD 1u
#define TD_SCHED_LANE_DEPTH (2u * TD_GPU_SLOTS_PER_LANE)
/* In auto mode a batch runs on the GPU from this size on, per operation: the end-to-end
 * crossover of one request in flight, CPU vs GPU backend, measured on the GPU host (an H200;
 * bench/NOTES.md "GPU crossover"). hist (a 2 KiB reply) gains from 64 KiB; filter and scan
 * reply with as much as (twice) their input, which the GPU path copies twice more on the host,
 * so the CPU was as fast or faster up to 4 MiB (filter ties there) and scan never crossed.
 * --gpu-min-batch B replaces all three with B; 0 (the default) means these. */
#define TD_GPU_MIN_BATCH_HIST (64u << 10)
#define TD_GPU_MIN_BATCH_FILTER (4u << 20)
#define TD_GPU_MIN_BATCH_SCAN SIZE_MAX
/* A shared-memory request whose input (and, for filter and scan, output) is a region registered
 * with the GPU skips both host copies that pushed filter's and scan's crossover to 4 MiB and
 * beyond; what is left is hist's case (fixed costs, a small reply), so it takes hist's 64 KiB.
 * Not measured on its own yet (bench/loadgen --shm-out on the GPU host). */
#define TD_GPU_MIN_BATCH_SHM (64u << 10)
/* ZeroMQ I/O threads (--io-threads; 0 = from the core count): min(4, cores / 4), at least 2.
 * ZeroMQ's guide budgets one I/O thread per ~1 GB/s; measured on the 16-core H100 host, 8
 * producers fanning 1 MiB requests into one ROUTER moved 4.8 GB/s with 1 I/O thread and 14.3 with
 * 4 (README), while every thread taken from the cores is one less CPU worker, so a quarter of the
 * cores, capped at the 4 measured. To be re-measured with tallyd on the GPU host. At least 2:
 * ZeroMQ serves a connection on one I/O thread (each new one on the least loaded), and a light
 * client that shares it with a peer sending 16 MiB frames waits behind that peer's reads: its
 * 4 KiB p50 was 27-32x idle with 1 I/O thread, 0.76-0.96x with 2 (issue 21, 2-core dev box,
 * bench/RESULTS.md). An idle I/O thread costs nothing. */
#define TD_IO_THREADS_MIN 2u
#define TD_IO_THREADS_MAX 4u
#define TD_IO_THREADS_LIMIT 64u
/* Shards (--shards; 0 = from the core count, issue 31): each a loop thread that owns the streams
 * td_stream_shard gives it and runs their requests. The default takes the cores that the ZeroMQ
 * I/O threads and the thread that owns the sockets leave, at least 1 (one shard runs on that
 * thread itself: the 2-core CI box), at most TD_SHARDS_DEFAULT_MAX. Measured on the 16-core H200
 * host (bench/RESULTS.md "Shards", 2026-12-02, 64 B hist, 16 producers x 64, 256 streams): 1 shard
 * 132 k requests/s, 2 shards 275 k (0.96 x the echo), 4 shards 259 k, 8 shards 174 k, 16 shards
 * 165 k: past the echo's ceiling more shards only add hand-offs and wake-ups, so the default stops
 * at 4. Looked at again after the front's changes (bench/RESULTS.md "The front", one call beside
 * main): 4 shards 166 k, 6 212 k, 8 203 k against main's 241 k at 4, 1-second rows that main's own
 * spread (154-241 k for one configuration) does not tell apart: kept at 4. At most TD_SHARDS_LIMIT
 * when set. A fleet worker fed by JetStream takes no ZeroMQ load and, with two shards or more,
 * its fleet thread hands each message to the shards itself (core/td_path_port.c), so its default
 * is the cores less the fleet's threads, at least 2 from 3 cores: on 3 pinned cores of the H100
 * host (bench/RESULTS.md, 2026-12-06 07:43 UTC, 300,000 x 1 KiB) one worker applied the fill in
 * 1.61-1.65 s at 2 shards, 1.85-1.93 s at 3 and 2.12-2.53 s at 1, the old default there. */
#define TD_SHARDS_DEFAULT_MAX 4u
#define TD_SHARDS_LIMIT 64u
/* glibc's malloc, set once at start (main.c). ZeroMQ's I/O threads malloc every received frame
 * (1 MiB each under a hist load) and tallyd frees it once the request is done. With glibc's
 * defaults the trim threshold follows the last large block freed (about 2 MiB here), so the heap
 * top is handed back to the kernel again and again and the next frame page-faults it in anew:
 * 9.6-35 minor faults per MiB received, in the kernel's receive copy on the I/O threads, which
 * are what limits tallyd's ZeroMQ path. Keeping up to TD_MALLOC_TRIM_THRESHOLD free at the top of
 * each heap ends that (0.3 faults per MiB), and bounds what stays with tallyd after a burst;
 * blocks from TD_MALLOC_MMAP_THRESHOLD up (glibc's own ceiling for its moving threshold) are still
 * mapped and unmapped on their own. GLIBC_TUNABLES naming any glibc.malloc.* setting replaces
 * these. Measured: bench/NOTES.md, "The producers, not the receive buffers". */
#define TD_MALLOC_MMAP_THRESHOLD (32u << 20)
#define TD_MALLOC_TRIM_THRESHOLD (128u << 20)
/* And at most this many malloc arenas (M_ARENA_MAX; issue 21, item 7). glibc gives every thread
 * that mallocs an arena of its own, up to 8 per core, and with the trim threshold above the size of
 * its 64 MiB heaps, an arena never hands back what it freed: each keeps the peak of its thread's
 * replies and received frames, and that peak creeps up (bench/soak.sh, sim GPUs on the 2-core dev
 * box, 2026-11-26, 60 s: 9 arenas, RSS 448 MB and still rising in steps of one 8 MiB scan reply;
 * 4 arenas: 367 MB; 2: 305 MB; every request answered, the same rate within the box's noise).
 * The threads that allocate on the hot path (up to 4 ZeroMQ I/O threads, the lanes, the
 * workers) then share 4 arenas: a large block holds an arena's lock for one malloc, small ones
 * mostly come from the thread's own cache (tcache) without it. What a burst leaves is kept by 4
 * arenas, not by one per thread (up to 256 on 32 cores). GLIBC_TUNABLES replaces this too. */
#define TD_MALLOC_ARENA_MAX 4
/* A fleet worker's ~30-47 threads (readers and their connections' libnats threads, the fleet
 * thread, the shards) each malloc and free every message they pass on; sharing 4 arenas, they
 * contend for their locks. With 32, in 10 pairs of 300,000 x 1 KiB rounds on an H100 host
 * (2026-12-07): one worker 5.4 us of CPU a message instead of 6.8, three 6.1 instead of 7.3, the
 * same peak RSS (583-611 MB a worker), and an RSS as flat as with 4 over 40 fills of 30,000
 * messages on the dev box (bench/NOTES.md, "A fleet worker's malloc arenas"). */
#define TD_MALLOC_ARENA_MAX_FLEET 32
/* Shared-memory input (td_shm.c, PROTOCOL.md §10). */
#define TD_SHM_SOCKET_NAME "tallyd-shm.sock" /* in the runtime directory */
#define TD_SHM_SOCKET_MODE 0660
#define TD_IPC_SOCKET_MODE 0660 /* the ZeroMQ ipc sockets tallyd binds itself */
#define TD_SHM_ALLOW_MAX 32     /* entries in each of shm_allow_uids, shm_allow_gids */
#define TD_SHM_MAX_REGIONS_LIMIT 4096u
/* Registered (pinned, for the GPU) bytes in total: pinned memory is a host resource, and 2 GiB
 * is 128 regions of the default 16 MiB batch. */
#define TD_SHM_CONNECTIONS_MAX 1024 /* side-channel connections at once */
/* Side connections per uid: one uid (allowed, or in socket_group) cannot take every slot. A
 * producer process needs one (libtally opens one per client); 64 leaves room for 16 busy uids
 * in the 1024 slots. */
/* A side connection that has registered no region this long after it connected is closed, so
 * idle connections cannot hold slots: libtally registers right after connecting. */
#define TD_SHM_REGISTER_TIMEOUT_MS_MIN 10u
#define TD_SHM_REGISTER_TIMEOUT_MS_LIMIT 3600000u
/* Security (td_auth.h, PROTOCOL.md §12). Protected mode, on by default like Redis's: tallyd
 * refuses to listen on a network address (tcp other than loopback) without CURVE, and to serve
 * metrics on one without HTTP basic auth, unless protected_mode is off. */
#define TD_DEFAULT_CONFIG_FILE "/etc/tallyd/tallyd.conf"
#define TD_MAX_BINDS 16
#define TD_MAX_BATCH_LIMIT (1024ull << 20) /* --max-batch may not exceed 1 GiB */
#define TD_MAX_INFLIGHT_LIMIT 65536u
#define TD_STATE_INTERVAL_LIMIT 86400u
#define TD_STATE_FILE "streams.state" /* in the state directory */
#define TD_STATE_LOG_FILE "streams.log"  /* beside it: the changes since (td_state.h) */
#define TD_STATUS_INTERVAL_MS 5000    /* systemd STATUS= line refresh */
#define TD_METRICS_WAIT_MS 2000       /* an HTTP scrape waits this long for the loop */
/* Windows (PROTOCOL.md "Windows", td_window.h): each stream's ring of recent intervals, one
 * minute in seconds by default. A ring keeps only the intervals that counted something, each
 * 48 bytes plus its counts (at most 8 x 256 x channels bytes), so the limits keep one stream's
 * ring under 17 MiB (rgba8 with u64 counts in all 2048 intervals); max_state_bytes bounds them
 * all. */
#define TD_WINDOW_INTERVALS_LIMIT 2048u
#define TD_WINDOW_INTERVAL_MS_MIN 10u
#define TD_WINDOW_INTERVAL_MS_LIMIT 3600000u
/* Subscriptions (PROTOCOL.md §11, td_pub.h): how often changed streams are published; 0 is
 * none (no [pub] endpoint then; a fleet's watchers query), else TD_PUB_INTERVAL_MS_MIN at least.
 * The web page's event streams tick every pub_interval_ms, or TD_WEB_TICK_MS when it is 0. */
#define TD_PUB_INTERVAL_MS_MIN 10u
#define TD_WEB_TICK_MS 1000u
#define TD_PUB_INTERVAL_MS_LIMIT 3600000u
#define TD_PUB_SNDHWM 1000 /* messages queued per subscriber before ZeroMQ drops them */
/* Per-stream Prometheus series (td_metrics.c): the first this many streams, in creation order,
 * get their own `stream` label; the rest are summed under stream="(other streams)", so a scrape has
 * at most (metrics_streams + 1) x 3 per-stream counters however many streams exist (and the
 * labelled streams' histograms, below). */
#define TD_METRICS_STREAMS_LIMIT 10000u
/* The `stream` label of the streams beyond metrics_streams: a space and parentheses, which no
 * stream name holds (names are printable ASCII without spaces), so it never collides. */
#define TD_METRICS_OTHER_STREAMS "(other streams)"
/* Per-stream Prometheus histograms (tallyd_stream_values): each stream's 256 bins folded into
 * this many buckets, so a histogram is at most buckets + 4 series (an underflow bucket, +Inf,
 * _sum, _count) per channel: 20 with the default, 80 for an rgba8 stream. */
/* The HTTP port's guard (td_http_guard.h): a deadline for each whole request, and connections
 * per address and in total. 5 s is well above a scrape's time (a render is milliseconds; a
 * scrape waits at most TD_METRICS_WAIT_MS for a busy loop) and short enough that slow
 * connections come and go. Each connection holds a descriptor: 256 and the slack fit the usual
 * soft limit of 1024 beside ZeroMQ's. */
#define TD_METRICS_REQUEST_TIMEOUT_MS_MIN 100u
#define TD_METRICS_REQUEST_TIMEOUT_MS_LIMIT 600000u
#define TD_METRICS_MAX_CONNECTIONS_LIMIT 4096u
/* The web page's and the API's event streams (td_web_sse.c). Each holds a connection for as
 * long as its browser tab is open and costs the loop a render of its streams at every
 * publication interval, so they have a bound of their own (max_sse_clients), within the
 * connection bounds above. A stream that has not sent anything for TD_SSE_HEARTBEAT_MS sends a
 * comment line, so a proxy keeps it open; one whose client has not taken TD_SSE_BACKLOG_MAX
 * bytes is closed (its browser reconnects and starts afresh). */
#define TD_METRICS_MAX_SSE_CLIENTS_LIMIT 1024u
#define TD_SSE_HEARTBEAT_MS 15000u
#define TD_SSE_BACKLOG_MAX (4u << 20)
/* The list's `rate`: values histogrammed per second over the last this many milliseconds of
 * the window ring (or the whole ring when it is shorter). */
#define TD_WEB_RATE_WINDOW_MS 10000u

/* The NATS JetStream fleet (PROTOCOL.md §13, daemon/nats/). Off until [nats] servers is set. A
 * lease lives lease_ttl_ms and is renewed once it is a second old (daemon/nats/td_fleet_int.h);
 * a checkpoint is written at least every checkpoint_interval_ms while messages are applied; a
 * partition's JetStream stream holds at most partition_max_bytes not yet checkpointed (then
 * producers are refused: backpressure). */
#define TD_DEFAULT_NATS_PARTITIONS 8u
#define TD_DEFAULT_NATS_REPLICAS 3u
#define TD_NATS_REPLICAS_LIMIT 5u
/* 15 s: JetStream elects a new leader for a replicated bucket within a few seconds (2-5 s seen
 * on loopback after kill -9 of the leader), and a lease must outlive that with the renewal's
 * retries (docs/fleet.md); a worker's failover costs about TTL + 2 s. A worker with no
 * lease_ttl_ms takes an existing fleet's. */
#define TD_DEFAULT_NATS_LEASE_TTL_MS 15000u
#define TD_NATS_LEASE_TTL_MS_MIN 1000u
#define TD_NATS_LEASE_TTL_MS_LIMIT 600000u
#define TD_DEFAULT_NATS_CHECKPOINT_MS 1000u
#define TD_NATS_CHECKPOINT_MS_MIN 10u
#define TD_NATS_CHECKPOINT_MS_LIMIT 3600000u
/* Direct mode, replicated: a partition's changelog records are published every commit_ms (group
 * commit), or at once when TD_NATS_COMMIT_BYTES are waiting, or (commit_when_idle, on by
 * default) at once when none of the partition's messages is in flight and its last batch held
 * few writes (docs/fleet.md "Replicated"). */
#define TD_DEFAULT_NATS_COMMIT_MS 2u
#define TD_NATS_COMMIT_MS_LIMIT 1000u
#define TD_NATS_COMMIT_BYTES (256u << 10)
/* Standbys (docs/fleet.md "Standbys"): a warm copy of a partition on the next member of its
 * rendezvous order; at most one (the next), as issue 33 asks. */
#define TD_NATS_STANDBYS_LIMIT 1u
#define TD_DEFAULT_NATS_PARTITION_MAX_BYTES (1ull << 30)
/* A partition's window (issue 32): messages in the request path at once, and their payload
 * bytes (one message always goes, however large). 256 keeps a 1 KiB-message partition's round
 * trip off the critical path; the bytes bound keeps a worker's memory per partition bounded. */
#define TD_DEFAULT_NATS_INFLIGHT 256u
#define TD_NATS_INFLIGHT_LIMIT 4096u
/* [nats] members_per_process: fleet members one tallyd runs, each a thread (td_fleet.h). */
#define TD_NATS_MEMBERS_PER_PROCESS_LIMIT 16u
#define TD_DEFAULT_NATS_INFLIGHT_BYTES (16ull << 20)
/* A partition's stream keeps a message this long (a worker outage longer than this loses what
 * was not applied; the fleet removes nothing itself: daemon/nats/td_nats_consumer.h). */
#define TD_DEFAULT_NATS_PARTITION_MAX_AGE_S 86400u
#define TD_NATS_PARTITION_MAX_AGE_S_MIN 60u
#define TD_NATS_PARTITION_MAX_AGE_S_LIMIT (365u * 86400u)

typedef enum {
    TD_BACKEND_AUTO = 0,
    TD_BACKEND_CPU = 1,
    TD_BACKEND_CUDA = 2,
} td_backend_choice_t;

typedef struct {
    char *binds[TD_MAX_BINDS]; /* owned strings */
    int bind_count;
    char *fronts[TD_MAX_BINDS]; /* owned; each a ROUTER socket with a thread of its own */
    int front_count;
    td_backend_choice_t backend;
    size_t max_batch;      /* bytes */
    unsigned max_inflight; /* requests */
    unsigned max_streams;
    unsigned max_inflight_per_peer;  /* per connection; 0 = a fair share */
    unsigned max_streams_per_client; /* per client identity; 0 = max_streams / 2 */
    unsigned stream_create_rate;     /* per client identity and second; 0 = unlimited */
    size_t max_state_bytes;            /* bytes of stream state in all */
    size_t max_state_bytes_per_client; /* per client identity; 0 = max_state_bytes / 2 */
    size_t max_frame;  /* bytes; ZeroMQ's hard frame limit; 0 = TD_MAX_FRAME_FACTOR x max_batch */
    size_t max_reply_bytes_per_peer; /* unread reply bytes per connection; 0 = computed */
    size_t max_reply_bytes;          /* unread reply bytes in total; 0 = computed */
    unsigned drain_ms; /* reading after a stop signal */
    unsigned workers;  /* CPU threads for batch work; 0 = number of cores */
    int log_level;     /* td_log_level_t */
    char *config_file; /* owned; NULL = none */
    bool config_file_explicit; /* given with --config: a missing file is then an error */
    unsigned gpu_streams;      /* lanes per GPU */
    size_t gpu_min_batch;      /* auto mode: smaller batches run on the CPU */
    unsigned gpu_peer_queue;   /* device references go to a peer GPU from this owner load; 0 = off */
    bool test_gpu_peer_always; /* test only: device references go to a peer GPU whenever one can */
    unsigned test_fault_every; /* test only: every Nth GPU request reports a failure; 0 = off */
    unsigned test_sim_gpus;    /* test only: N simulated GPUs (host memory, CPU kernels) */
    unsigned gpu_spin_us;      /* lane threads poll the GPU this long before sleeping */
    bool gpu_spin_loop;        /* the loop polls while requests are on the GPU */
    char *state_dir;           /* owned; NULL = no persistence ($STATE_DIRECTORY by default) */
    unsigned state_interval;   /* seconds between state snapshots */
    char *metrics_listen;      /* owned; ADDR:PORT of the HTTP metrics endpoint, NULL = off */
    unsigned io_threads;       /* ZeroMQ I/O threads; 0 = from the core count */
    unsigned shards;           /* request-path shards; 0 = from the core count */
    bool shm;                  /* offer shared-memory input (td_shm.c) */
    char *shm_socket;          /* owned; the side channel's path; NULL = the default */
    bool shm_socket_explicit;  /* set by the file or command line: failing to bind is fatal */
    int shm_socket_gid;        /* the socket's group (tallyd must be a member); -1 = tallyd's */
    unsigned shm_allow_uids[TD_SHM_ALLOW_MAX]; /* besides tallyd's own uid */
    unsigned shm_allow_uid_count;
    unsigned shm_allow_gids[TD_SHM_ALLOW_MAX];
    unsigned shm_allow_gid_count;
    unsigned shm_max_regions_per_peer; /* per side-channel connection */
    size_t shm_max_bytes;              /* registered in total */
    unsigned shm_max_conns_per_uid;    /* side connections per peer uid */
    unsigned shm_register_timeout_ms;  /* a side connection's time to register its first region */
    bool test_shm_deny_own_uid;        /* test only: tallyd's own uid is not allowed either */
    bool check_only;                   /* --check-config: load the configuration, report, exit */
    unsigned window_intervals;         /* per-stream window ring; 0 = windows off */
    unsigned window_interval_ms;       /* one interval of the ring */
    char *pub_endpoint;                /* owned; the PUB socket's endpoint; NULL = off */
    unsigned pub_interval_ms;          /* publication interval */
    unsigned metrics_streams;          /* streams with their own metrics label */
    char *test_clock;                  /* owned; test only: the window clock read from a file */
    char *curve_secret_key;            /* owned; the server's key file; NULL = CURVE off */
    char *curve_clients_dir;           /* owned; a directory of allowed NAME.pub files, or NULL */
    char *curve_clients;     /* owned; allowed KEY or NAME:KEY items, comma-separated, or NULL */
    bool protected_mode;     /* refuse network endpoints without authentication */
    char *metrics_auth_file; /* owned; USER:PASSWORD for the metrics endpoint's basic auth */
    char *nats_servers;      /* owned; the fleet's NATS URLs, comma-separated; NULL = no fleet */
    char *nats_credentials;  /* owned; a .creds file, or NULL */
    char *nats_nkey;         /* owned; a user nkey (public), with nats_nkey_seed */
    char *nats_nkey_seed;    /* owned; the file holding its seed */
    char *nats_tls_ca;       /* owned; a CA file: TLS on */
    char *nats_tls_cert;     /* owned; a client certificate and key */
    char *nats_tls_key;
    char *nats_member_id;    /* owned; NULL = host name and process id */
    char *nats_user;         /* owned; the NATS user (inbox prefix); NULL = the URLs' */
    bool nats_local_writes;  /* other transports may change streams on a worker */
    char *nats_direct;       /* owned; direct mode: NULL or "off", "local", "replicated" */
    char *nats_advertise;    /* owned; the endpoint published for direct mode; NULL = the bind */
    unsigned nats_partitions;
    unsigned nats_replicas;
    unsigned nats_lease_ttl_ms;
    unsigned nats_checkpoint_ms;
    unsigned nats_commit_ms; /* direct = replicated: the group commit's interval */
    bool nats_commit_when_idle; /* and a batch goes at once with nothing in flight */
    unsigned nats_standbys;     /* 1: a warm copy of each partition on its next member */
    unsigned nats_inflight;
    size_t nats_inflight_bytes;
    unsigned nats_members_per_process; /* fleet members in this process, each a thread */
    size_t nats_partition_max_bytes;
    unsigned nats_partition_max_age_s;
    int argc;                /* the command line, kept so SIGHUP can re-apply it (borrowed) */
    char **argv;
    /* The HTTP port's guard (td_http_guard.h): the deadline for each whole request, and the
     * connections at once in total and from one address (an IPv6 /64 counts as one). */
    unsigned metrics_request_timeout_ms;
    unsigned metrics_max_connections;
    unsigned metrics_max_connections_per_address;
    unsigned metrics_histogram_buckets; /* per-stream Prometheus histogram buckets; 0 = none */
    char *metrics_api_token_file; /* owned; the HTTP API's bearer token (td_web.c), or NULL */
    unsigned metrics_max_sse_clients; /* event streams (SSE) open at once */
    char *metrics_allowed_hosts;      /* owned; names a request's Host may give besides the listen
                                       * address, localhost and IP addresses (td_http.c), or NULL */
} td_config_t;

/* Adds an endpoint to cfg->binds: TD_ERR_CONFIG for an invalid one or one too many. */
td_err_t td_config_add_bind(td_config_t *cfg, const char *endpoint);
/* The same for any list of endpoints (the binds, the fronts) of *count entries. */
td_err_t td_config_add_endpoint(char **list, int *count, const char *endpoint);

/* The cores this process may run on: its CPU affinity (taskset, systemd's CPUAffinity=, a
 * cgroup's cpuset), else the cores online. What every default sized by the cores counts. */
unsigned td_config_cores(void);
/* The ZeroMQ I/O threads to use: cfg->io_threads, or the default from the core count. */
unsigned td_config_io_threads(const td_config_t *cfg);
/* The shards to run: cfg->shards, or (tests) $TALLYD_TEST_SHARDS, or the cores less the I/O
 * threads and the socket's thread, from 1 to TD_SHARDS_DEFAULT_MAX; a worker fed by JetStream
 * (td_config_fleet_ingest) counts its fleet members' threads instead, and takes 2 from 3 cores. */
unsigned td_config_shards(const td_config_t *cfg);
/* That default for `cores`, `io_threads` and a JetStream worker's `fleet_members` (0: none). */
unsigned td_config_default_shards(unsigned cores, unsigned io_threads, unsigned fleet_members);
/* A fleet worker fed by JetStream ingest alone: [nats] servers set, direct mode off. */
bool td_config_fleet_ingest(const td_config_t *cfg);
/* The default side-channel path: $RUNTIME_DIRECTORY (systemd), /run/tallyd as root,
 * $XDG_RUNTIME_DIR, else /tmp/tallyd-UID; then TD_SHM_SOCKET_NAME. */
void td_config_default_shm_socket(char *buf, size_t cap);
/* The frame limit in force: cfg->max_frame, or its default from max_batch. */
size_t td_config_max_frame(const td_config_t *cfg);
/* The per-peer limits in force. In flight: the setting, else max_inflight / active (the
 * connections with requests in flight), at least min(TD_FAIR_SHARE_MIN, max_inflight). Streams:
 * the setting, else half of max_streams (at least 1). */
unsigned td_config_inflight_per_peer(const td_config_t *cfg, unsigned active);
unsigned td_config_streams_per_client(const td_config_t *cfg);
/* The bounds on unread reply bytes in force: the settings, else TD_FAIR_SHARE_MIN x 2 x
 * max_batch per connection and TD_REPLY_BYTES_TOTAL_FACTOR x that in total. */
uint64_t td_config_reply_bytes_per_peer(const td_config_t *cfg);
uint64_t td_config_reply_bytes(const td_config_t *cfg);

/* The state bytes one client's streams may hold: the setting, else half of max_state_bytes. */
size_t td_config_state_bytes_per_client(const td_config_t *cfg);

/* True for an endpoint that only this host can reach: ipc, inproc, or tcp on a loopback
 * address (127.0.0.0/8, ::1, localhost, lo). A wildcard, an interface name or any other address
 * (and any other transport) is a network endpoint. Also takes HOST:PORT (the metrics listen). */
bool td_endpoint_is_local(const char *endpoint);
/* What an endpoint serves, for protected mode's check and message. */
typedef enum {
    TD_ENDPOINT_REQUEST, /* a ROUTER bind: requests (CURVE) */
    TD_ENDPOINT_METRICS, /* the HTTP metrics listen address (basic auth) */
    TD_ENDPOINT_PUB,     /* the PUB socket: publications (CURVE, the request endpoint's keys) */
} td_endpoint_kind_t;
/* Protected mode for one endpoint: TD_ERR_CONFIG, with a message that says how to set up keys,
 * for a network endpoint without authentication (CURVE; basic auth for metrics) while
 * protected_mode is on; with it off, a warning is logged (at every start) and TD_OK returned. */
td_err_t td_config_check_endpoint(const td_config_t *cfg, const char *endpoint,
                                  td_endpoint_kind_t kind, char *msg, size_t cap);
/* td_config_check_endpoint for every bind, the PUB endpoint and the metrics endpoint. */
td_err_t td_config_check_protected(const td_config_t *cfg, char *msg, size_t cap);

const char *td_backend_choice_name(td_backend_choice_t choice);

#endif
