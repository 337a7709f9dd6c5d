/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_int.h — what the files of the fleet worker share (td_fleet.c: the thread, membership
 * and the plan; td_fleet_part.c: a partition's life; td_fleet_window.c: its messages applied;
 * td_fleet_transport.c: the way into the request path (a transport) and onto the loop;
 * td_fleet_query.c: request-reply). Private to daemon/nats/.
 *
 * Threads: everything here belongs to the fleet thread, except the loop-call slot (mu, cond,
 * job) and `stopping`, which the loop thread touches too.
 */
#ifndef TD_FLEET_INT_H
#define TD_FLEET_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include <nats/nats.h>
#include <uv.h>

#include "tally_fleet.h"
#include "td_fleet.h"
#include "td_fleet_status.h"
#include "td_nats_ckpt.h"
#include "td_nats_lease.h"
#include "td_transport.h"

/* Pending slots besides the partitions' windows ([nats] inflight each): queries and the fleet's
 * own calls. A request the path cannot take yet (max_inflight) waits on the loop's side of the
 * transport, in order, rather than being answered `busy` (td_fleet_transport.c). */
#define TD_FLEET_PENDING_EXTRA 64
/* A member id that members_per_process > 1 suffixes with -i (i < 16): its longest. */
#define TD_FLEET_BASE_ID_MAX (TALLY_NATS_MEMBER_ID_MAX - 3)
/* A slot's index is the tag's low bits (the rest is a counter). */
#define TD_FLEET_SLOT_BITS 24
/* A partition's reader queues at most this much (a fetch asks for the room left, at least one
 * message of max_payload: 8 MiB with contrib/nats). */
#define TD_FLEET_FETCH_BYTES (24ll << 20)
#define TD_FLEET_FETCH_BATCH 256
/* A partition's step takes at most this many messages from its reader (the others' turn). */
#define TD_FLEET_STEP_MESSAGES 256
/* How long the thread sleeps in the transport's poll when nothing was fetched. */
#define TD_FLEET_IDLE_MS 5
/* A turn of the fleet thread's loop this long or longer is logged, part by part (td_fleet.c):
 * every partition waits for it (issue 32: a worker that took nothing for 4.6 s). */
#define TD_FLEET_SLOW_TURN_MS 1000
/* Resend after `busy` or `rate_limited`. */
#define TD_FLEET_RETRY_MS 50
/* How long a leaving member waits for the answers of queries still in the request path. */
#define TD_FLEET_QUERY_FINISH_MS 1000
/* At start, making the fleet's streams and buckets is tried this often, this far apart. */
#define TD_FLEET_START_RETRIES 60
#define TD_FLEET_START_RETRY_MS 500
/* Through a lost nats-server (issue 32): the key-value buckets' calls wait this long (libnats'
 * default is 5 s), leases are renewed once they are this old and, when a renewal fails (the
 * bucket electing a leader), tried again after a short pause, and the fleet thread's other
 * JetStream calls wait at most TD_FLEET_JS_WAIT_MS. A renewal then never holds the partitions
 * still for longer than a couple of seconds, and a lease outlives an election shorter than its
 * TTL less about two seconds (docs/fleet.md). */
#define TD_FLEET_KV_WAIT_MS 1000
#define TD_FLEET_JS_WAIT_MS 2000
#define TD_FLEET_RENEW_AGE_MS 1000
#define TD_FLEET_RENEW_RETRY_MS 250
/* A heartbeat brought forward to a key's expiry (td_fleet.c, awaited_expiry) comes this long
 * after it (the server removes an expired message by a timer of its own), and no sooner than
 * this after the last one while the key is still there. */
#define TD_FLEET_EXPIRY_MARGIN_MS 100
#define TD_FLEET_EXPIRY_RETRY_MS 250
/* A partition whose take-over failed (a damaged checkpoint, NATS errors) is not tried again
 * before this. */
#define TD_FLEET_TAKE_BACKOFF_MS 5000

typedef enum { PEND_FREE = 0, PEND_PART, PEND_QUERY, PEND_SYNC } td_pend_kind_t;

/* One request in flight in the request path. Its tag replaces the request id on the way in; the
 * reply's request id finds it again (slot in the low TD_FLEET_SLOT_BITS bits). */
typedef struct {
    td_pend_kind_t kind;
    uint64_t tag;
    uint64_t orig_id;    /* the request id the message carried, restored in its reply */
    uint32_t k;          /* PEND_PART: the partition */
    uint64_t pos;        /* PEND_PART: its place in the partition's window */
    natsMsg *msg;        /* PEND_QUERY: the NATS request */
    bool streams_filter; /* PEND_QUERY: a `streams` answer, cut to the partitions owned */
    bool seq_only;       /* PEND_QUERY: a tally.seq answer, cut to the stream's last_seq */
    bool done;           /* PEND_SYNC: the reply came (reply, reply_len: malloc'ed) */
    uint8_t *reply;
    size_t reply_len;
} td_pend_t;

/* A partition's reader thread and its queue (td_fleet_reader.c). */
#define TD_READER_RING (4 * TD_FLEET_FETCH_BATCH)
/* A message's Tally-Reply and Nats-Msg-Id headers (NULL: none) and the user its subject names
 * (NULL: none): pointers into the message. */
typedef struct {
    const char *to, *id, *user;
} td_msg_headers_t;
/* A fetched message with what its reader read of it on its own thread (issue 32: the fleet
 * thread, which every message of a worker crosses, was the one at a full core): its stream
 * sequence (0: none) and the headers its judging needs. msg NULL: none. */
typedef struct {
    natsMsg *msg;
    uint64_t seq;
    td_msg_headers_t h;
} td_fetched_t;
/* The consumer a reader makes before its first fetch (td_consumer_start's arguments): on its own
 * thread, so that a take-over does not wait for the cluster to place the consumer, and the
 * consumers of several partitions taken together are made at once (issue 32's failover). */
typedef struct {
    jsCtx *js; /* the reader's connection's */
    natsConnection *nc;
    char inbox[2 * TALLY_NATS_MEMBER_ID_MAX + 96];
    uint64_t epoch, start_seq;
    unsigned restart;
    int64_t ack_wait_ms;
    int64_t valid_until_ms; /* the lease's end when the reader started: after it the reader
                             * leaves other consumers alone (they may be a successor's) */
} td_reader_make_t;
typedef enum { READER_MAKING = 0, READER_READING, READER_FAILED } td_reader_phase_t;
typedef struct {
    struct td_fleet *fleet;
    uint32_t k;
    td_reader_make_t make;
    atomic_int phase;     /* td_reader_phase_t */
    char why[256];        /* READER_FAILED: what failed (written before the phase) */
    int64_t made_ms;      /* READER_READING: when its consumer was made (before the phase) */
    struct td_pull *pull; /* its pulls from the partition's durable consumer */
    pthread_t thread;
    bool started;
    atomic_bool stop;
    pthread_mutex_t mu;
    pthread_cond_t cond; /* room in the queue again, or stop */
    td_fetched_t ring[TD_READER_RING];
    size_t head, len;
    size_t bytes; /* the ring's and those taken but not popped yet */
    /* The fleet thread's: what it took from the ring at once (one lock for a batch, issue 32),
     * popped one by one; `popped`: bytes popped since, still counted in `bytes`. */
    td_fetched_t taken[TD_READER_RING];
    size_t took, taken_len;
    size_t popped;
    /* Messages queued since the reader started (its thread's) and popped (the fleet thread's):
     * stored in the status for tallyd_nats_partition_fetched. */
    uint64_t pushed_count, popped_count;
} td_reader_t;

/* One message of a partition's window (td_fleet_window.c): judged in sequence order, applied
 * side by side with the others, retired in order once done. */
typedef enum { WIN_SENT = 1, WIN_DONE, WIN_RETRY } td_win_state_t;
typedef struct {
    natsMsg *msg;
    struct td_msg_ref *ref; /* once sent: the message, shared with the request path */
    uint64_t seq;
    int slot; /* WIN_SENT: its pend slot */
    td_win_state_t state;
    td_msg_headers_t h; /* as its reader read them */
    const char *to;     /* judged: its Tally-Reply where its publisher may be answered, or NULL */
} td_win_entry_t;

/* The longest ack subject kept ($JS.ACK.<stream>.<consumer>.<9 numbers>). */
#define TD_FLEET_ACK_MAX 256

typedef struct {
    uint32_t k;
    bool owned;
    td_lease_t lease;
    td_ckpt_t ckpt;
    td_reader_t reader;  /* fetches from the bound durable consumer */
    natsConnection *rnc; /* the reader's own connection (made at the first take, kept) */
    jsCtx *rjs;
    unsigned restarts;    /* consumers made under the current lease */
    uint64_t applied_seq; /* the watermark: every message up to it is applied (or judged) */
    uint64_t high_seq;    /* the last message taken into the window */
    uint64_t ckpt_seq;    /* applied_seq of the last checkpoint */
    uint64_t since_applied; /* applied_seq at the cl_since base (ckpt.since_*), if any */
    int64_t last_ckpt_ms;
    /* The window: a ring of f->inflight entries from absolute position win_first; win_bytes:
     * their payloads (at most f->inflight_bytes, or one message). */
    td_win_entry_t *win;
    uint64_t win_first;
    size_t win_len, win_bytes, retries;
    size_t in_path, in_path_bytes; /* its WIN_SENT entries, and their bytes (the metrics') */
    int64_t retry_at; /* when the WIN_RETRY entries are sent again */
    td_fetched_t next; /* taken from the reader, waiting for room in the window (msg: NULL) */
    /* After the window broke a stream's order (a message refused `busy` overtaken by a later one
     * of its stream): the messages up to this sequence go one at a time when the partition is
     * taken again, so that the refusals that broke it cannot break it again at every take (0:
     * none). Kept across takes; cleared once the watermark has passed it. */
    uint64_t one_at_a_time_to;
    bool draining;    /* a checkpoint is due: nothing new until the window is empty */
    uint64_t drain_began_ns; /* when (td_mono_ns), for tallyd_nats_checkpoint_drain_seconds */
    /* AckAll: the ack subject of the watermark's message, sent after the next checkpoint. */
    char ack[TD_FLEET_ACK_MAX];
    uint64_t unacked; /* messages retired since the last acknowledgement */
    int64_t no_take_until_ms;
    /* When the lease this worker waits for runs out (td_fleet.c, awaited_expiry; monotonic, 0:
     * not awaited), and when the last take began (0 once its first message was applied): what a
     * take-over's log lines measure (issue 32's failover). */
    int64_t lease_expiry_ms;
    int64_t take_began_ms;
    bool planned; /* the plan of the last heartbeat gives it this worker (td_fleet_keys.c) */
    /* A take whose reader is making its consumer (td_fleet_part.c, take_finished): owned (its
     * lease renewed, its partition stepped), not counted as taken yet; when the take's steps
     * ended (monotonic) and what it loaded (td_standby_load: the checkpoint's state or a
     * standby's copy, its size and sequence), for its log line. */
    bool taking;
    int64_t take_leased_ms, take_loaded_ms;
    char take_loaded[96];
    /* Since when messages have waited for it while its window took none (high_seq unchanged),
     * and whether that stall was logged (td_fleet_window.c, say_if_stalled). */
    uint64_t stall_high_seq;
    int64_t stall_since_ms;
    bool stall_waiting, stall_said;
} td_part_t;

typedef struct td_changelog td_changelog_t;

typedef struct td_fleet_job {
    void (*fn)(td_fleet_t *f, void *arg);
    void *arg;
    bool hold; /* the shards stopped around it: it reads or changes the stream table */
    bool done;
} td_fleet_job_t;

struct td_fleet {
    td_fleet_host_t host;
    /* Settings (copied). */
    char member[TALLY_NATS_MEMBER_ID_MAX + 1];
    char base_member[TALLY_NATS_MEMBER_ID_MAX + 1]; /* the id this process's members share: member
                                                     * less its -i (members_per_process > 1) */
    char inbox_prefix[2 * TALLY_NATS_MEMBER_ID_MAX + 16]; /* _INBOX.<user>. */
    uint32_t partitions;
    int64_t ttl_ms, ckpt_ms;
    size_t max_payload;
    size_t inflight, inflight_bytes; /* a partition's window ([nats] inflight, inflight_bytes) */
    int64_t test_take_ms; /* test only: each take lasts this much longer (TALLYD_TEST_TAKE_MS) */
    /* NATS. */
    natsConnection *nc;
    natsConnection *reply_nc; /* replies, watch publications and acks: buffered, no flush each */
    jsCtx *js;                /* the fleet thread's JetStream calls (TD_FLEET_JS_WAIT_MS) */
    jsCtx *kv_js;             /* its buckets' (TD_FLEET_KV_WAIT_MS) */
    kvStore *members, *leases, *ckpts;
    natsSubscription *q_sub, *seq_sub, *ctl_sub, *streams_sub;
    /* The membership and lease keys as they change (td_fleet_keys.c), and the members the last
     * heartbeat read. */
    natsSubscription *members_sub, *leases_sub;
    char **known_members;
    size_t known_count;
    /* Partitions. */
    td_part_t *parts;
    int64_t next_beat_ms;
    /* Until when the partitions dropped in this turn of the loop wait for their local copies'
     * deletes (0: none dropped yet this turn): a third of the TTL for all of them together, so
     * that dropping many never holds the renewals of the rest past their leases. */
    int64_t drop_until_ms;
    int64_t expiry_beat_ms;  /* follow_plan's: when an awaited key runs out (0: none) */
    int64_t next_renew_ms;   /* after a failed renewal: the next try */
    size_t live_members;     /* TALLY_MEMBERS' keys: at the last heartbeat or `streams` question */
    int64_t members_read_ms; /* when a `streams` question last read live_members (monotonic) */
    /* The transport (td_fleet_transport.c): requests queued for the loop, replies queued for the
     * fleet thread (under q_mu; with a port, only the fleet thread's own refusals); wake_fd: an
     * eventfd written when a reply is queued or posted to the port while the fleet thread
     * sleeps, and by the readers when they queue messages. */
    td_transport_t transport;
    pthread_mutex_t q_mu;
    bool q_mu_ready;
    struct td_fleet_sub *sub_head, *sub_tail;
    struct td_fleet_rep *rep_head, *rep_tail;
    /* Not posted yet (issue 32: a batch per turn, td_fleet_transport.c): the fleet thread's
     * requests, the loop thread's replies. */
    struct td_fleet_sub *sub_out_head, *sub_out_tail;
    struct td_fleet_rep *rep_out_head, *rep_out_tail;
    uv_prepare_t prepare;
    /* With shard threads: the fleet thread's own front of the request path (td_path_port_open),
     * which takes its requests to the shards and their replies back without the loop thread;
     * NULL: through the loop (one shard). */
    td_path_port_t *port;
    int wake_fd;
    td_pend_t *pend; /* pend_cap slots: the windows', then TD_FLEET_PENDING_EXTRA */
    size_t pend_cap, pend_hint;
    uint64_t next_tag;
    atomic_bool subs_waiting; /* requests the path could not take yet (the loop's check) */
    /* Replies the loop could not hand over (no memory), and how many the fleet thread has seen:
     * the partitions waiting for one are dropped and taken anew (td_part_reply_lost). */
    atomic_uint replies_lost;
    unsigned replies_lost_seen;
    uv_check_t check;
    /* The thread, and the loop calls. */
    pthread_t thread;
    bool thread_started;
    atomic_bool stopping;    /* set by the loop's signal watchers */
    atomic_bool thread_done; /* the thread has nothing more to ask of the loop */
    uv_async_t async;
    uv_signal_t sig_term, sig_int;
    pthread_mutex_t mu;
    pthread_cond_t cond;
    td_fleet_job_t *job;
    bool loop_closed;
    /* Histogram publications (td_fleet_watch.c): every watch_ms (pub_interval_ms); pub_seq. */
    int64_t watch_ms, next_watch_ms;
    uint64_t watch_seq;
    struct td_view *view; /* the HTTP API's questions to the fleet (td_fleet_view.c) */
    /* Direct mode (td_fleet_route.c); NULL when off. Its changelog (td_fleet_changelog.c); NULL
     * unless direct = replicated. */
    struct td_fleet_route *route;
    struct td_changelog *cl;
    /* [nats] standbys (td_fleet_standby.c): a slot a partition, NULL when none; the manifest
     * keys' writes as they are stored ($KV.TALLY_CKPT.*). */
    struct td_standby *standbys;
    natsSubscription *manifests_sub;
    /* Counters and what info and /metrics show (the server's, or own_status). */
    td_fleet_status_t *st;
    td_fleet_status_t own_status;
};

/* One more of a td_fleet_status_t counter; a td_fleet_status_t field set (the loop reads them). */
#define TD_FLEET_COUNT(f, field) atomic_fetch_add_explicit(&(f)->st->field, 1, memory_order_relaxed)
#define TD_FLEET_SET(f, field, v) atomic_store_explicit(&(f)->st->field, (v), memory_order_relaxed)

/* td_fleet_transport.c: the request path, and the loop. */
td_err_t td_fleet_path_open(td_fleet_t *f);
/* After the loop has ended: frees what is still queued. */
void td_fleet_path_close(td_fleet_t *f);
/* Loop thread (the fleet's async handle): submits the requests queued. */
void td_fleet_path_on_loop(td_fleet_t *f);
/* Queues one request frame (data: header then payload, copied; len at least
 * TALLY_REQ_HEADER_SIZE, which every caller has checked) for the request path with a fresh tag
 * in a free slot, of the given kind; the slot, or -1 when none is free. It reaches the loop at
 * the next td_fleet_path_flush (td_fleet_path_poll and td_fleet_on_loop flush first). */
int td_fleet_path_send(td_fleet_t *f, td_pend_kind_t kind, const uint8_t *data, size_t len);
/* The same with the payload given (moved: the path frees it; on failure it is freed here) instead
 * of copied: header is the request header's TALLY_REQ_HEADER_SIZE bytes, req that header as
 * tally_req_decode read it (the path does not decode it again). body_unwanted: only the reply's
 * header is read when it succeeds (td_msg_t's: a message that names no Tally-Reply). */
int td_fleet_path_send_shared(td_fleet_t *f, td_pend_kind_t kind, const uint8_t *header,
                              const tally_req_t *req, bool body_unwanted, td_bytes_t *payload);
/* Posts the requests queued since the last flush to the loop: one lock, one wake-up. */
void td_fleet_path_flush(td_fleet_t *f);
/* A reply frame (header, then body_len bytes of body) into buf when it fits in cap, else
 * malloc'ed (free it when it is not buf); NULL without memory (logged). */
uint8_t *td_fleet_frame(const uint8_t *header, const uint8_t *body, size_t body_len, uint8_t *buf,
                        size_t cap, size_t *len);
/* Waits up to timeout_ms for replies and hands each to td_fleet_on_reply (PEND_SYNC ones are
 * kept in their slot). */
void td_fleet_path_poll(td_fleet_t *f, int timeout_ms);
/* One request through the request path, waiting for its reply (other replies are handled
 * meanwhile): the reply frame (64-byte header then payload, malloc'ed) or NULL after timeout_ms. */
uint8_t *td_fleet_path_call(td_fleet_t *f, const uint8_t *data, size_t len, int timeout_ms,
                            size_t *reply_len);
/* Runs fn(f, arg) on the server's loop thread and waits for it, the shards stopped meanwhile
 * (td_streams_hold). */
void td_fleet_on_loop(td_fleet_t *f, void (*fn)(td_fleet_t *f, void *arg), void *arg);
/* The same with the shards left running: for a job that touches no table of theirs, only the
 * loop thread's scratch (a standby's copy: td_fleet_standby.c). */
void td_fleet_on_loop_unheld(td_fleet_t *f, void (*fn)(td_fleet_t *f, void *arg), void *arg);
/* A reply for slot: its header (TALLY_REP_HEADER_SIZE bytes, already with the original request
 * id) and body. */
void td_fleet_on_reply(td_fleet_t *f, int slot, const uint8_t *header, const uint8_t *body,
                       size_t body_len);

/* td_fleet.c: a connection of the fleet's (its settings, named after the member and role; asap:
 * every publication flushed at once). */
td_err_t td_fleet_connect(td_fleet_t *f, const char *role, bool asap, natsConnection **nc,
                          char *msg, size_t cap);
/* Test only: waits, up to 30 s, for the file the environment's `env` names (its comment says
 * which). */
void td_fleet_test_gate(const char *env, const char *what, uint32_t k);

/* td_fleet_part.c */
void td_part_take(td_fleet_t *f, td_part_t *p);
void td_part_give_up(td_fleet_t *f, td_part_t *p);
/* Loses the partition at once, writing nothing (its lease expired, or it was fenced). */
void td_part_drop(td_fleet_t *f, td_part_t *p, const char *why);
/* Frees what a partition keeps past its ownership (at the fleet's end). */
void td_part_free(td_fleet_t *f, td_part_t *p);
/* True while the partition's lease is valid by this worker's clock: checked right before every
 * write of the partition's (a checkpoint, a reply, a dead letter, a watch publication). */
bool td_part_may_write(const td_part_t *p);
/* Writes the checkpoint now (nothing in flight), its time counted in
 * tallyd_nats_checkpoint_seconds_total. False when fenced or it failed. */
bool td_part_checkpoint(td_fleet_t *f, td_part_t *p);

/* td_fleet_window.c */
/* One step: resend, fetch, submit, checkpoint when due. True when it did something. */
bool td_part_step(td_fleet_t *f, td_part_t *p);
void td_part_reply(td_fleet_t *f, td_part_t *p, td_pend_t *pend, const uint8_t *header,
                   const uint8_t *body, size_t body_len);
/* A reply of the request path's was lost (no memory for it): every partition with a message
 * waiting for its reply is dropped, since that one would wait for ever; taken anew, its
 * messages are delivered again from its checkpoint. */
void td_part_reply_lost(td_fleet_t *f);
/* Waits (polling for replies) until the partition has nothing in the request path. */
void td_part_quiesce(td_fleet_t *f, td_part_t *p);

/* td_fleet_table.c: partition k's streams in the stream table (run on the loop thread). */
/* Its streams encoded as a checkpoint's state (*state malloc'd, the caller's to free). */
td_err_t td_fleet_table_snapshot(td_fleet_t *f, uint32_t k, uint8_t **state, size_t *len);
/* Deletes this worker's local copy of partition k's streams, through the request path (after
 * anything of theirs still in flight): what a new owner restores must not meet an old copy, and
 * one that stays would have the messages after its checkpoint applied to it a second time.
 * Each stream's delete waits for its answer (sent again while `busy`) until deadline (ms,
 * td_nats_now_ms); a stream reached after it is not tried. TD_OK only when every stream is
 * known gone; msg says why not. */
td_err_t td_fleet_table_delete(td_fleet_t *f, uint32_t k, int64_t deadline, char *msg, size_t cap);
/* Loads a checkpoint's state into the stream table, after deleting any old local copy; a state
 * this member cannot hold whole (its limits refuse a stream) is an error (TD_ERR_CORRUPT). */
td_err_t td_fleet_table_restore(td_fleet_t *f, uint32_t k, uint8_t *state, size_t len, char *msg,
                                size_t cap);

/* td_fleet_view.c: the thread that answers the HTTP API's questions about the whole fleet
 * (td_fleet_status_t.view, filled here); closed after the loop has ended. */
td_err_t td_fleet_view_open(td_fleet_t *f);
void td_fleet_view_close(td_fleet_t *f);

/* td_fleet_watch.c: publishes the owned streams that changed when a tick is due; true when it
 * published any. */
bool td_fleet_watch_step(td_fleet_t *f);
/* Publishes partition k's changed streams now (it is still owned; before it is given up). */
void td_fleet_watch_flush(td_fleet_t *f, uint32_t k);
/* Partition k was taken: every stream of it (loaded from its checkpoint) counts as changed. */
void td_fleet_watch_taken(td_fleet_t *f, uint32_t k);

/* td_fleet_reader.c: the reader makes the consumer `make` describes, then fetches from it (and
 * destroys its puller at stop). */
td_err_t td_reader_start(td_fleet_t *f, td_reader_t *r, uint32_t k, const td_reader_make_t *make);
/* True (why filled) when the reader could not make its consumer: the thread has ended. */
bool td_reader_failed(td_reader_t *r, char *why, size_t cap);
/* True once the reader has made its consumer (r->made_ms says when). */
bool td_reader_made(td_reader_t *r);
/* The next message the reader fetched, with what it read of it (its msg NULL: none now). */
td_fetched_t td_reader_pop(td_reader_t *r);
void td_reader_stop(td_reader_t *r);

/* td_fleet_keys.c: subscribes to the membership and lease keys; closes (and forgets the known
 * members). */
td_err_t td_fleet_keys_open(td_fleet_t *f);
void td_fleet_keys_close(td_fleet_t *f);
/* The members the last heartbeat read (ids and n as td_member_list gives them: kept, freed
 * here). */
void td_fleet_keys_known(td_fleet_t *f, char **ids, size_t n);
/* Reads the key writes that arrived; true (and the heartbeat brought forward to now) when one
 * can change what this worker owns. */
bool td_fleet_keys_step(td_fleet_t *f);

/* td_fleet_standby.c: standby copies of partitions ([nats] standbys = 1; docs/fleet.md
 * "Standbys"). f->standbys, one slot a partition, when cfg asks for standbys and the member is
 * replicated (f->cl: after td_fleet_route_open; NULL otherwise, with a warning). */
td_err_t td_standby_open(td_fleet_t *f, const td_config_t *cfg);
/* After the loop has ended: frees the copies. */
void td_standby_close(td_fleet_t *f);
/* The heartbeat's plan, before its takes: next[k], this member comes right after partition k's
 * owner; mine[k], it is the owner now (the copy of one not taken yet is kept for its take).
 * Copies no longer wanted go. */
void td_standby_plan(td_fleet_t *f, const bool *next, const bool *mine);
/* Starts the copies wanted (again, from each new checkpoint) and applies the changelog messages
 * that arrived; true when it did something. */
bool td_standby_step(td_fleet_t *f);
/* The largest answer from a copy: a reply header and a stream's record. */
#define TD_STANDBY_ANSWER_MAX (TALLY_REP_HEADER_SIZE + TALLY_QUERY_PAYLOAD_MAX)
/* The cl_since partition p's next checkpoint claims (p->ckpt.since_*, cleared when none): its
 * base, while no JetStream ingest was applied since (td_fleet_standby.c says why). */
bool td_standby_claim(td_part_t *p);
/* After a committed checkpoint that claimed no cl_since: it is the base of the next ones (a
 * `replicated` owner with standbys; nothing otherwise). */
void td_standby_base(td_fleet_t *f, td_part_t *p);
/* A `query` (no window) of a stream of partition k answered from this member's standby copy
 * into frame (TD_STANDBY_ANSWER_MAX bytes), with the last changelog sequence the copy applied
 * in *cl_seq: the frame's length, or 0 when there is no copy here (or k is this member's). */
size_t td_standby_answer(td_fleet_t *f, uint32_t k, const tally_req_t *req, uint8_t *frame,
                         uint64_t *cl_seq);
/* A take's load, its checkpoint fenced (p->ckpt.cur; state, len: its state): the copy when it
 * started from that very checkpoint (epoch and generation), else the checkpoint's state; then
 * the changelog after what was loaded (td_changelog_take, which sets p->ckpt.cl_seq). Says
 * which in one line (with standbys on), counts it (tallyd_nats_takes_total{from}), sets
 * p->take_loaded_ms and p->take_loaded; the copy goes either way. */
td_err_t td_standby_load(td_fleet_t *f, td_part_t *p, uint8_t *state, size_t len, char *msg,
                         size_t cap);

/* td_fleet_query.c */
td_err_t td_fleet_query_open(td_fleet_t *f);
void td_fleet_query_close(td_fleet_t *f);
/* Takes the queries that have arrived; true when there were any. */
bool td_fleet_query_step(td_fleet_t *f);
/* As the member leaves: waits up to wait_ms for the answers of the queries still in the request
 * path (the loop answers `shutdown` those it never submitted), then answers `shutdown` each one
 * left, so that every query gets one answer. Fleet thread. */
void td_fleet_query_finish(td_fleet_t *f, int wait_ms);
void td_fleet_query_reply(td_fleet_t *f, td_pend_t *pend, const uint8_t *reply, size_t len);

/* An error reply frame to the request frame req (len bytes; what it echoes per PROTOCOL.md §3)
 * with the message why, into out (TALLY_REP_HEADER_SIZE + TALLY_ERROR_MESSAGE_MAX bytes); its
 * length. */
size_t td_fleet_error_reply(const uint8_t *req, size_t len, tally_status_t st, const char *why,
                            uint8_t *out);
/* Publishes a reply frame to a NATS subject with the reply headers of PROTOCOL.md §13. */
void td_fleet_publish_reply(td_fleet_t *f, const char *subject, natsMsg *request, uint32_t k,
                            uint64_t seq, const uint8_t *reply, size_t len);

#endif
