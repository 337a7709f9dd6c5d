/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_path_int.h — the request path's front and its shards' slots, shared by td_path.c (the front,
 * the mailboxes, the shards' threads), td_path_front.c (what the front runs itself with a shard
 * held) and td_path_port.c (the fronts of transports' own threads). Not for anything outside the
 * path.
 */
#ifndef TD_PATH_INT_H
#define TD_PATH_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "td_admit.h"
#include "td_mailbox.h"
#include "td_path.h"
#include "td_shard.h"

/* What a hop carries (td_mailbox.h): to a shard, then to the front. */
enum {
    HOP_TAKE = 1, /* a request to check and run */
    HOP_RESUME,   /* info, stats or streams answered by the front: send the reply */
    HOP_STOP,     /* a stop signal */
    HOP_CLOSE,    /* the last message: close the loop's handles */
    HOP_REPLY,    /* a reply, for its transport */
    HOP_GATHER,   /* info, stats or streams, to answer from the whole daemon */
    HOP_DELETED,  /* a stream was deleted (the PUB socket tells its subscribers) */
    HOP_FINISH,   /* a GPU completion the front took but could not finish: the shard ran */
};

typedef struct {
    td_path_t *path;
    unsigned index;
    td_shard_t *shard;
    td_metrics_t metrics; /* the shard's counters */
    uint64_t dispatched;  /* the front's: requests handed to the shard */
    uint64_t replied;     /* the front's: their replies back */
    uv_loop_t *loop;      /* the shard's: own_loop, or the front's with one shard */
    uv_timer_t sweep;     /* its part's window slots that left the ring */
    bool sweep_open;
    uv_async_t held_wake; /* the route settled held replies (td_path_wake_held) */
    bool held_wake_open;  /* closed under the path's wake_mu */
    bool machine_open;    /* the machines' open succeeded: close it */
    /* With threads (more than one shard): */
    uv_loop_t own_loop;
    bool loop_open;
    uv_thread_t thread;
    bool running;            /* its thread runs (started, not joined) */
    td_mailbox_t inbox;      /* the front's hops to it */
    td_hop_batch_t to_shard; /* the front's thread: not posted yet */
    td_hop_batch_t to_front; /* the shard's thread: not posted yet */
    td_hop_batch_t to_port[TD_PATH_PORTS_MAX]; /* the same, for each port's replies */
    uv_prepare_t flush_prepare;
    uv_check_t flush_check;
    bool flush_open;
    td_hop_t stop_hop;
    td_hop_t close_hop;
    unsigned parked_epoch; /* the shard's thread: the last hold it parked for */
    /* Who runs the shard now: its thread holds `own` while it runs its loop's callbacks and lets
     * go only to sleep, so the front may take it to run a request itself (run_on_front). */
    pthread_mutex_t own;
    int sleep_ms;               /* under own: the timeout the shard's thread sleeps with */
    _Atomic uint64_t asleep_ns; /* the shard's thread's time asleep (libuv's idle time is not) */
    bool front_has_it; /* under own: the front runs the shard (its replies leave at once) */
    uint64_t start_ns;
} slot_t;

struct td_path {
    td_path_env_t env;
    td_admit_t admit; /* identification and the fair share: the front's */
    unsigned count;
    slot_t *slots;
    bool threads; /* more than one shard: each on a thread of its own */
    td_path_machines_t machines;
    td_mailbox_t inbox; /* the shards' hops to the front */
    td_hop_t *spares;   /* the front's: retired requests, not in use */
    unsigned spare_count;
    uv_prepare_t flush_prepare;
    uv_check_t flush_check;
    bool front_open; /* inbox and flush handles initialised */
    bool front_port; /* the front's machine is open (its GPU sink: td_path_port_count) */
    pthread_t front_thread;
    uint64_t dispatched; /* over every shard */
    uint64_t replied;
    unsigned next_pick; /* where the search for the least loaded shard starts */
    bool stopping;      /* a stop signal arrived */
    bool drain_expired; /* drain_ms has passed since: transports read nothing more */
    bool closed;
    td_shm_t *shm;
    td_path_deleted_fn deleted; /* NULL when nobody listens (no subscriptions) */
    void *deleted_ctx;
    /* Holding the shards (td_streams_hold): a hold is an epoch; a shard parks once per epoch. */
    pthread_mutex_t lock;
    pthread_cond_t parked_cond;  /* a shard parked */
    pthread_cond_t release_cond; /* the hold is over */
    _Atomic unsigned want;       /* the epoch of the latest hold */
    unsigned released;           /* under lock: the epoch released last */
    unsigned parked;             /* under lock: shards parked in this epoch */
    unsigned hold_depth;         /* the loop thread's: nested holds */
    pthread_mutex_t wake_mu;     /* td_path_wake_held against the shards' closes */
    /* Ports (td_path_port.c): opened on the loop thread before the shards run, while the ports
     * opened before may already submit (atomics: an entry is stored before the count); a closed
     * one's entry is NULL. ports_refuse: the drain is over or the path closed. */
    _Atomic(td_path_port_t *) ports[TD_PATH_PORTS_MAX];
    _Atomic unsigned port_count;
    _Atomic bool ports_refuse;
    _Atomic unsigned front_inflight;     /* dispatched - replied, stored for the ports (with any) */
    _Atomic unsigned ports_max_inflight; /* cfg->max_inflight, stored as a hold ends (reloads) */
    _Atomic bool front_waits_room; /* the front's transport holds input at max_inflight: a port's
                                    * replies wake the loop (td_path_wait_for_room) */
};

/* A port (td_transport.h; td_path_port.c): the request path's front for a transport's own
 * thread. Everything is that thread's but where said. */
struct td_path_port {
    td_path_t *path;
    unsigned index; /* in path->ports, and the shards' to_port */
    td_transport_t *transport;
    td_hop_batch_t *to_shard; /* one per shard: submitted, not posted yet */
    td_mailbox_t replies;     /* the shards' hops of its replies (wake: the transport's) */
    td_hop_batch_t refused;   /* answered by the port itself, taken with the replies */
    td_hop_t *spares;         /* retired requests, not in use */
    unsigned spare_count;
    unsigned next_pick;        /* the next shard for a request on no stream */
    unsigned own_inflight;     /* submitted, their replies not taken yet */
    _Atomic unsigned inflight; /* the same, for the loop thread (td_path_inflight) */
    td_admit_t *admit;         /* a connection's share and reply bytes, or NULL (the fleet) */
    pthread_mutex_t mu;        /* a flush, against td_path_ports_shut on the loop thread */
    bool closed;               /* under mu: the shards close; nothing may be posted to them */
};

/* The front runs r itself with slot's shard held, when it may (td_path_front.c); false when r
 * must be handed over. */
bool td_path_run_on_front(td_path_t *p, slot_t *slot, td_request_t *r);

/* A shard's thread (or the front's, holding the shard): posts what the shard handed the front and
 * each port since its last post. */
void td_path_flush_slot(slot_t *slot);
/* Any thread: the message's header, its decoded form and its payload into r, as td_path_submit
 * takes them (the payload is r's from here on). */
void td_path_take_message(td_request_t *r, td_msg_t *m);
/* The shard that owns r's stream, or the shard count when r names none. */
unsigned td_path_named_shard(const td_path_t *p, const td_request_t *r);
/* A request: a spare (a retired one, taken from the thread's list), else a new one. */
td_request_t *td_path_new_request(td_hop_t **spares, unsigned *spare_count);
/* A retired request kept on the thread's list of spares (disposed: its input and reply let go),
 * or freed when `limit` are kept already. */
void td_path_keep_spare(td_hop_t **spares, unsigned *spare_count, unsigned limit, td_request_t *r);
/* A request from its mailbox hop. */
td_request_t *td_path_hop_request(td_hop_t *hop);

/* td_path_port.c, on the loop thread: the ports' requests in flight, over every port; whether one
 * is open; each port closed to posts (nothing reaches the shards from them after: td_path_close,
 * before the shards' last hop). */
unsigned td_path_ports_inflight(const td_path_t *p);
void td_path_ports_shut(td_path_t *p);
/* td_path_destroy: frees every port (each closed by its transport, or never used after a failed
 * start); a closed port stays in the table until then, since other ports' threads read it. */
void td_path_ports_free(td_path_t *p);

#endif
