/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet.h — tallyd as a worker of a NATS JetStream fleet (PROTOCOL.md §13): it joins the
 * membership, takes the partitions rendezvous hashing gives it under leases, applies their
 * messages in order through the daemon's request path, checkpoints them, answers queries for
 * them, and gives them up (checkpointed) when another member should have them or tallyd stops.
 *
 * The fleet runs on a thread of its own (libnats' calls block). Its requests reach the request
 * path as a transport (core/td_transport.h; td_fleet_transport.c): queued to the loop thread,
 * submitted there with td_path_submit, answered through the transport's send_reply: the same
 * validation, per-stream order, CPU and GPU execution and replies as any client's. Loop-thread
 * work (restoring a checkpoint into the stream table, taking a partition's snapshot) runs
 * through a uv_async handle on the server's loop.
 *
 * [nats] members_per_process = K > 1 (issue 32): the process runs K fleets, each a whole member
 * (id MEMBER_ID-i, its thread, connections, partitions' windows and loop handles), all feeding
 * the one request path and stream table. The rendezvous plan spreads partitions over them as
 * over separate workers, so the per-message work of one fleet thread, the bound of one worker
 * (bench/NOTES.md, "Where one worker's threads spend their time"), runs on K threads; leases,
 * fences, checkpoints and hand-overs are a member's as ever. They share the server's
 * td_fleet_status_t (the counters add up; each partition is owned by one of them at a time) and
 * the first one answers the HTTP API's questions about the whole fleet. A sibling may take a
 * partition another gives up: a member drops its copy of a partition's streams from the shared
 * table before it releases the lease (td_fleet_part.c), never after.
 */
#ifndef TD_FLEET_H
#define TD_FLEET_H

#include <stddef.h>

#include "td_config.h"
#include "td_err.h"

struct uv_loop_s;
struct td_streams;
struct td_path;

typedef struct td_fleet td_fleet_t;

typedef struct {
    struct uv_loop_s *loop;     /* the server's loop, not running yet */
    struct td_streams *streams; /* the server's stream table (loop thread only) */
    struct td_path *path;       /* the server's request path (loop thread only) */
    const td_config_t *cfg;     /* read at td_fleet_new; the NATS settings are copied */
    struct td_fleet_status *status; /* the server's, filled for info and /metrics; NULL: the
                                     * fleet keeps its own */
    unsigned instance; /* which of the process's [nats] members_per_process this one is */
} td_fleet_host_t;

/* The [nats] settings alone, before anything starts (tallyd --check-config too): a member id
 * that is not valid (or too long for its -i suffixes), protected mode (a server off the
 * loopback without credentials), members_per_process > 1 with direct mode, a build without
 * libnats. */
td_err_t td_fleet_check_config(const td_config_t *cfg, char *msg, size_t cap);
/* Connects, makes the fleet's streams and buckets where missing, and starts the worker thread
 * of member host->instance. Logs and returns an error (nothing left running) when NATS cannot
 * be reached or refuses. */
td_err_t td_fleet_new(const td_fleet_host_t *host, td_fleet_t **out);
/* After td_server_run has returned (the fleet stopped with the loop's SIGTERM/SIGINT: partitions
 * checkpointed and released): joins the thread and frees everything. */
void td_fleet_destroy(td_fleet_t **self_p);

#endif
