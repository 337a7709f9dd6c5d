/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_shard.h — one shard of the request path (issue 31): what happens to a request on the
 * thread of the shard that owns its stream, from its checks to its reply.
 *
 * The front (td_path.c) reads nothing of a request but its envelope and its stream's name: it
 * identifies the sender, copies the header frame, picks the shard (a named stream's:
 * td_stream_shard; any other, the least loaded) and hands the request over. The shard does the
 * rest, as the one loop thread did before there were shards: the header decoded, the payload's
 * checks and the per-connection limits it meets before it runs (td_admit.h), a shared-memory
 * reference resolved, the stream found or created in the shard's part of the table, the scheduler
 * (td_sched.h) that orders it on its stream and runs it (td_exec.h: inline, on a CPU worker or a
 * GPU lane, whose completion comes back to this shard's loop), its result folded into the stream
 * (td_request.h: the sequence rule, exactly once), and the reply, which goes back to the front for
 * its transport. Each shard has its own scheduler, part of the stream table, counters and in-flight
 * count; what the limits need of all shards together (the per-peer entries, the reply bytes, the
 * stream budget) is shared, and exact (td_peers.h, td_reply.h, td_stream.h say how).
 *
 * `info`, `stats` and `streams` need the whole daemon: the shard hands them to the front
 * (env.gather), which answers them with every shard held still and gives them back
 * (td_shard_resume); ping is answered here.
 *
 * Everything here runs on the shard's thread (the front's loop thread when there is one shard).
 */
#ifndef TD_SHARD_H
#define TD_SHARD_H

#include <stdbool.h>
#include <stdint.h>

#include "td_config.h"
#include "td_counters.h"
#include "td_err.h"
#include "td_peers.h"
#include "td_reply.h"
#include "td_request.h"
#include "td_sched.h"
#include "td_shm.h"
#include "td_stream.h"
#include "td_transport.h"

typedef struct td_shard td_shard_t;

typedef struct {
    unsigned index;
    td_config_t *cfg;      /* live: reloads apply */
    td_metrics_t *metrics; /* the shard's own counters */
    td_streams_t *streams; /* the shard's part of the table (td_streams_part) */
    td_peers_t *peers;     /* shared: the entries' counters (td_peers.h) */
    td_replies_t *replies; /* shared */
    /* What the shard hands the front (td_path.c), each on the shard's thread with `front`: a
     * reply, to leave through its transport; an `info`, `stats` or `streams` to answer from the
     * whole daemon (it comes back through td_shard_resume); a deleted stream's name (NULL: no
     * subscriptions to tell). */
    void (*reply)(void *front, td_request_t *r);
    void (*gather)(void *front, td_request_t *r);
    void (*deleted)(void *front, const char *name, size_t name_len);
    void *front;
} td_shard_env_t;

td_err_t td_shard_new(const td_shard_env_t *env, td_shard_t **out);
/* The scheduler, on the machine the executor offers this shard (td_exec_port_machine). */
td_err_t td_shard_start(td_shard_t *self, const td_sched_machine_t *machine);
/* The shared-memory regions requests reference (NULL when off), and env.deleted (NULL: no
 * subscriptions to tell), once they are open. */
void td_shard_attach(td_shard_t *self, td_shm_t *shm,
                     void (*deleted)(void *front, const char *name, size_t name_len));
/* Direct mode (PROTOCOL.md §13 "Direct mode"): who decides whether a request on a stream may run
 * on this member. admit is asked on the shard's thread for every request that names a stream and
 * comes from a transport that does not own streams (ZeroMQ, shared memory, HTTP; not the fleet's
 * own): TALLY_OK, it runs here and done is told once it is answered (with its status); any other
 * status answers it
 * (msg says why: the owner and its endpoint). The core never names NATS: the fleet fills this
 * (daemon/nats/td_fleet_route.c) and td_path_attach_route hands it to every shard, before the
 * shards' threads run. Without one, a fleet worker refuses such writes (`not_permitted`). */
typedef struct {
    tally_status_t (*admit)(void *ctx, const tally_req_t *req, char *msg, size_t cap);
    void (*done)(void *ctx, const tally_req_t *req, tally_status_t status);
    /* Replicated durability (NULL: none). hold is asked of an admitted request that changed its
     * stream (status OK) before its reply, with the stream as it is now (NULL after a delete):
     * true when the reply waits until the route says the change is durable (*ticket: what for);
     * it may note in the stream what it recorded (td_stream_t.cl_mark).
     * Held replies are looked at again each time the route wakes the shards
     * (td_path_wake_held): settled answers TALLY_OK (durable: sent as it is), another status
     * (the reply becomes that error, with msg), or leaves *pending set (still waiting). */
    bool (*hold)(void *ctx, const tally_req_t *req, td_stream_t *stream, uint64_t *ticket);
    tally_status_t (*settled)(void *ctx, const tally_req_t *req, uint64_t ticket, bool *pending,
                              char *msg, size_t cap);
    /* A `duplicate` (the request's seq at or below its stream's last) says its first try was
     * applied, which a client takes for stored: last says whether the stream's last record (the
     * effect of every seq up to its last) still waits, *ticket what for (then held as hold's). */
    bool (*last)(void *ctx, const tally_req_t *req, const td_stream_t *stream, uint64_t *ticket);
    void *ctx;
} td_route_t;
void td_shard_attach_route(td_shard_t *self, const td_route_t *route);
/* The route has settled some held replies: each one settled leaves now (shard's thread). */
void td_shard_release_held(td_shard_t *self);
/* Destroys the scheduler too. */
void td_shard_destroy(td_shard_t **self_p);

/* A request the front identified (r->shard is this one): decoded, checked, run, answered. */
void td_shard_take(td_shard_t *self, td_request_t *r);
/* The executor hands a compute request back (td_exec_port's done). */
void td_shard_finished(td_shard_t *self, td_request_t *r);
/* An `info`, `stats` or `streams` handed to the front: its reply is filled; it leaves now. */
void td_shard_resume(td_shard_t *self, td_request_t *r);

/* A stop signal (td_path_stop): every request taken from now on is answered `shutdown`, and what
 * waits on a stream is answered so in its order (td_sched_stop). */
void td_shard_stop(td_shard_t *self);

td_sched_t *td_shard_sched(const td_shard_t *self);
td_metrics_t *td_shard_metrics(const td_shard_t *self);
td_streams_t *td_shard_streams(const td_shard_t *self);

#endif
