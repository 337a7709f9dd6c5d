/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_path.h — the request path: what happens to a request between its transport and its reply,
 * whatever the transport (td_transport.h: the calls a transport makes). This is the side the
 * server's wiring (td_server.c) sees: creating the path and its shards, their schedulers and the
 * executor's completions, gathering from them, and stopping.
 *
 * The path is a front and its shards (issue 31; td_shard.h). The front runs on the transports'
 * loop thread: it identifies each submitted message's sender and holds it to the per-connection
 * share of the in-flight slots (td_admit.h), reads the stream's name from the header (proto/'s
 * tally_req_stream_of: the shard decodes the rest), and hands the request to the shard that owns
 * its stream (td_stream_shard: the published FNV-1a 64 of the name), or, with
 * no stream, to the least loaded shard. The shard checks and runs it and hands the reply back;
 * the front gives it to its transport, and the transport's end of it (td_reply_end) goes back to
 * the shard. `info`, `stats` and `streams` are answered by the front from the whole daemon, with
 * every shard held still (td_streams_hold).
 *
 * With one shard it runs on the transports' own loop thread and nothing changes hands: the path
 * is what it was before there were shards. With more, each shard is a thread with a loop of its
 * own, and requests, replies and ends of replies travel in batches through mailboxes
 * (td_mailbox.h). A transport with a thread of its own may have a front of its own there, a port
 * (td_transport.h, td_path_port.c), whose requests and replies skip the loop thread. Loop thread
 * (the transports'), except td_path_finished (a shard's).
 */
#ifndef TD_PATH_H
#define TD_PATH_H

#include <stdbool.h>
#include <uv.h>

#include "td_config.h"
#include "td_counters.h"
#include "td_err.h"
#include "td_peers.h"
#include "td_reply.h"
#include "td_request.h"
#include "td_sched.h"
#include "td_shard.h"
#include "td_shm.h"
#include "td_stream.h"
#include "td_transport.h"

typedef struct {
    td_config_t *cfg;      /* live: reloads apply */
    td_metrics_t *metrics; /* the transports' thread's own counters (the shards have theirs) */
    /* The whole table, of one part per shard (td_streams_new_parts): its parts make the count. */
    td_streams_t *streams;
    td_peers_t *peers; /* td_peers_new_shards with the same count */
    td_replies_t *replies;
    uv_loop_t *loop; /* the transports' loop: the one shard's too, when there is one */
    /* info and stats: fills r's reply (td_request_succeed or _fail) from the whole daemon, on the
     * loop thread, with every shard held still. */
    void (*answer_here)(void *owner, td_request_t *r);
    void *owner;
} td_path_env_t;

/* What each shard runs its requests on: open fills shard's machine (td_sched.h) for its loop
 * (the executor's port, td_exec_port_open), before that loop runs; close, on the shard's thread
 * once nothing of it is in flight, closes it (NULL: nothing to close). With shards on threads of
 * their own, one more (`shard` == the shard count) on the transports' loop: the front's, whose
 * only use is its GPU sink (td_gpu.h, r->gpu_to_front), closed by td_path_close. */
typedef struct {
    td_err_t (*open)(void *ctx, unsigned shard, uv_loop_t *loop, td_sched_machine_t *machine);
    void (*close)(void *ctx, unsigned shard);
    void *ctx;
} td_path_machines_t;

td_err_t td_path_new(const td_path_env_t *env, td_path_t **out);
/* The shards' schedulers, each on the machine `machines` opens for it. */
td_err_t td_path_start(td_path_t *self, const td_path_machines_t *machines);
/* The shards' threads start (with more than one shard): from here on the whole table is read
 * only while held. */
td_err_t td_path_run(td_path_t *self);
/* Told when a stream is deleted (its subscribers hear of it: td_pub_deleted), on the loop
 * thread; ctx is passed back. */
typedef void (*td_path_deleted_fn)(void *ctx, const char *name, size_t name_len);
/* What serves beside the path, once open: the shared-memory regions requests reference and the
 * PUB socket told of deleted streams (either NULL when off). */
void td_path_attach(td_path_t *self, td_shm_t *shm, td_path_deleted_fn deleted, void *ctx);
/* Direct mode's route (td_shard.h, td_route_t), handed to every shard; before td_path_run. */
void td_path_attach_route(td_path_t *self, const td_route_t *route);
/* The route settled some held replies (td_route_t.settled): every shard looks at its own. Any
 * thread. */
void td_path_wake_held(td_path_t *self);
/* Reading has ended and nothing is in flight: the shards close what they hold on their loops
 * (the machines' close) and their threads end; the loop thread owns everything after. Then the
 * transports' loop handles of the path close. From then on the path is stopping and takes
 * nothing (td_path_may_read): a transport still open (the fleet's, giving its partitions up)
 * answers what it has `shutdown`, since no shard would ever answer it. */
void td_path_close(td_path_t *self);
/* After td_path_close (or a failed start): destroys the shards and their schedulers. */
void td_path_destroy(td_path_t **self_p);

/* The executor hands a compute request back (td_exec_env_t.done), on its shard's thread, or on
 * the front's (a GPU completion of r->gpu_to_front), which finishes it with the shard held when
 * the shard's thread sleeps and hands it over otherwise. */
void td_path_finished(td_path_t *self, td_request_t *r);

/* A stop signal: every message submitted from now on is answered `shutdown`, and what waits on
 * a stream is answered so in its order (td_sched_stop, on each shard). */
void td_path_stop(td_path_t *self);
/* The drain deadline has passed: transports read nothing more (td_path_may_read is false from
 * now on). */
void td_path_drain_over(td_path_t *self);
bool td_path_stopping(const td_path_t *self);

/* Requests read and not answered yet, over every shard (max_inflight counts them). */
unsigned td_path_inflight(const td_path_t *self);
unsigned td_path_shard_count(const td_path_t *self);
/* The executor's ports the machines open: a shard's each, and the front's with threads. */
unsigned td_path_port_count(const td_path_t *self);

/* What the metrics show of each shard, so an imbalance shows: while the whole table is held. */
typedef struct td_shard_gauges {
    uint64_t requests; /* answered */
    unsigned inflight; /* handed to it and not answered yet */
    unsigned queued;   /* waiting behind another request on their stream */
    unsigned streams;  /* in its part of the table */
    double busy_s;     /* its loop thread's time not waiting for work, since start */
} td_shard_gauges_t;
void td_path_shard_gauges(td_path_t *self, unsigned shard, td_shard_gauges_t *out);
/* Every counter: the loop thread's and every shard's, summed into out; while held. */
void td_path_sum_metrics(td_path_t *self, td_metrics_t *out);
/* Requests waiting behind another one on their stream, on every shard; while held. */
unsigned td_path_queued(td_path_t *self);

#endif
