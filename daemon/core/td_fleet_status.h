/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_status.h — what a fleet worker (td_fleet.h) shows of itself through the daemon:
 * the `info` keys of PROTOCOL.md §13 "What a worker reports" and the tallyd_nats_* metrics.
 *
 * The server owns one (zeroed: "not in a fleet") and hands it to the fleet, which fills the
 * settings once before the loop runs and then updates the counters from its own thread; the
 * loop thread renders them for `info` and /metrics. So the settings are plain fields, the rest
 * relaxed atomics (each value is reported on its own; no two need to agree). No libnats here:
 * this part is compiled into the daemon's core whether NATS is built in or not.
 */
#ifndef TD_FLEET_STATUS_H
#define TD_FLEET_STATUS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tally_fleet.h"
#include "tally_proto.h"
#include "td_counters.h"

/* ---- What the HTTP API asks of the whole fleet (td_fleet_view.c answers; td_web.c asks) ---- */

/* One stream of the fleet's list and the member whose answer listed it (its owner). */
typedef struct {
    char name[TALLY_STREAM_NAME_MAX + 1];
    char member[TALLY_NATS_MEMBER_ID_MAX + 1];
} td_fleet_entry_t;

/* An answer, handed to the asker's callback; everything in it is the fleet's, freed after the
 * callback returns. */
typedef struct {
    tally_status_t status; /* TALLY_OK, or why nothing came: timeout, transport, shutdown, busy */
    char message[256];     /* with an error status: what happened */
    /* streams: every name the members' answers listed, each once */
    td_fleet_entry_t *entries;
    size_t count;
    uint32_t partitions, covered; /* covered < partitions: some member did not answer in time */
    size_t answered, members;     /* members that answered; the live members they said there are */
    bool truncated;               /* more streams than the list's memory bound: some left out */
    /* query: the owner's reply frame (64-byte header, then the record), and who answered */
    const uint8_t *reply;
    size_t reply_len;
    char owner[TALLY_NATS_MEMBER_ID_MAX + 1];
} td_fleet_answer_t;

/* Called exactly once per question, on the loop thread (or, after the loop has ended, from
 * td_fleet_destroy with status TALLY_E_SHUTDOWN). */
typedef void (*td_fleet_answer_fn)(void *arg, const td_fleet_answer_t *answer);

/* The fleet fills this before the server's loop runs; NULL functions: not in a fleet. Both are
 * called on the loop thread, queue the question for the fleet's NATS thread and return at once;
 * false (done not called) when too many questions wait already. */
typedef struct {
    /* Gathers every member's `streams` answer (tally.streams), as `tally --nats streams`. */
    bool (*streams)(void *ctx, td_fleet_answer_fn done, void *arg);
    /* Asks the owner of req's stream (tally.q.<k>) the `query` req (no payload). */
    bool (*query)(void *ctx, const tally_req_t *req, td_fleet_answer_fn done, void *arg);
    void *ctx;
} td_fleet_view_t;

/* direct = replicated: where a held write's time goes, stage by stage, from its record held in
 * its partition's batch to its reply handed on by its shard (tallyd_nats_changelog_stage_seconds;
 * td_fleet_changelog.c measures them). The first three are per changelog message, the last per
 * write; for a message's first record they add up to its write's whole wait. */
typedef enum {
    TD_CL_STAGE_BATCH = 0, /* the batch's first record held -> its publish began */
    TD_CL_STAGE_PUBLISH =
        1,               /* the message built and handed to libnats (the changelog's lock held) */
    TD_CL_STAGE_ACK = 2, /* -> its PubAck's callback ran */
    TD_CL_STAGE_RELEASE = 3, /* that callback -> a held write's reply handed on by its shard */
    TD_CL_STAGES = 4,
} td_cl_stage_t;

typedef struct td_fleet_status {
    /* Settings: written before the server's loop runs, read-only after. */
    bool on;                         /* this tallyd is a fleet worker */
    char member[64 + 1];             /* its member id (with members_per_process > 1: less -i) */
    unsigned members_per_process;    /* [nats] members_per_process: member-0 .. member-(K-1) */
    uint32_t partitions;             /* the fleet's partition count */
    uint64_t lease_ttl_ms;           /* [nats] lease_ttl_ms */
    uint64_t checkpoint_interval_ms; /* [nats] checkpoint_interval_ms */
    uint64_t max_payload;            /* the NATS server's max_payload */
    td_fleet_view_t view;            /* the whole fleet's streams, for the HTTP API */
    uint64_t inflight;               /* [nats] inflight: a partition's window, in messages */
    uint64_t inflight_bytes;         /* [nats] inflight_bytes: its payload bytes */
    bool direct;                     /* [nats] direct = local or replicated (§13 "Direct mode") */
    bool replicated;                 /* [nats] direct = replicated */
    /* Counters since start (fleet thread). */
    _Atomic uint64_t applied;             /* messages applied (dead letters included) */
    _Atomic uint64_t dead_letters;        /* messages published to tally.dead.<k> */
    _Atomic uint64_t checkpoints;         /* checkpoints written */
    _Atomic uint64_t checkpoint_failures; /* checkpoint writes that failed (NATS errors) */
    /* Nanoseconds: the fleet thread writing checkpoints (snapshot and write: it serves none of
     * its partitions meanwhile), and partitions draining for one (taking nothing new until their
     * window is empty), summed over the partitions. */
    _Atomic uint64_t checkpoint_ns, checkpoint_drain_ns;
    _Atomic uint64_t partitions_taken;    /* take-overs that succeeded */
    _Atomic uint64_t leases_lost;         /* partitions lost without giving them up */
    _Atomic uint64_t gaps;                /* sequence gaps met (messages aged out) */
    _Atomic uint64_t resent;              /* requests sent again: the path had no room (busy) */
    _Atomic uint64_t disconnects;         /* this process's NATS connections' servers lost */
    /* Refused for naming what their publisher may not (PROTOCOL.md §13 "Security"): a reply
     * subject outside its inbox, a dedupe id outside its namespace. */
    _Atomic uint64_t refused_reply, refused_id;
    /* Direct mode: writes applied since their partition's last checkpoint (what a host lost
     * loses), and requests answered not_owner. */
    _Atomic uint64_t direct_uncommitted;
    _Atomic uint64_t not_owner;
    /* direct = replicated: changelog messages stored (PubAcks), messages replayed at take-overs,
     * direct writes answered not_durable, changelog messages gone at a take-over before a
     * checkpoint held them (aged out or removed: the writes they held are lost), and changelogs
     * purged whole at a quiet point after a checkpoint holding them. */
    _Atomic uint64_t changelog_commits, changelog_replayed, not_durable, changelog_lost;
    /* Standbys (td_fleet_standby.c): take-overs from a standby's copy and from the checkpoint;
     * changelog messages applied to copies; copies (re)started from a checkpoint; the bytes
     * the copies hold now; new checkpoints a copy saw, the copy kept (their cl_since covers it)
     * or restarted from it. */
    _Atomic uint64_t takes_from_standby, takes_from_checkpoint;
    _Atomic uint64_t standby_applied, standby_starts, standby_bytes;
    _Atomic uint64_t standby_kept, standby_restarts;
    _Atomic uint64_t changelog_purges;
    /* direct = replicated: the stages' histograms (td_latency_bounds_us, then +Inf) and their
     * sums in ns; batches found ready with all of their partition's messages in flight, and the
     * ns they waited for one to be answered. */
    _Atomic uint64_t cl_stage_buckets[TD_CL_STAGES][TD_LATENCY_BUCKETS + 1];
    _Atomic uint64_t cl_stage_ns[TD_CL_STAGES];
    _Atomic uint64_t cl_flights_full, cl_flight_wait_ns;
    /* Per partition: owned now; the last sequence applied; the partition's last sequence as the
     * worker last saw it (its reader's last fetched message's sequence plus the consumer's
     * pending count: td_fleet_reader.c, the lag's top). */
    _Atomic bool owned[TALLY_NATS_MAX_PARTITIONS];
    _Atomic uint64_t applied_seq[TALLY_NATS_MAX_PARTITIONS];
    _Atomic uint64_t last_seq[TALLY_NATS_MAX_PARTITIONS];
    /* Per partition, where what is not applied yet waits (issue 32): its window's entries, and
     * those of them sent to the request path whose reply the fleet thread has not taken yet,
     * with their bytes (the fleet thread's); the messages its reader has fetched since it
     * started (the reader thread's), and those of them the fleet thread has taken into the
     * window or skipped (the fleet thread's): fetched - taken wait for the fleet thread. Each
     * has one writer, so no lock; the two halves of a difference may be read a message apart. */
    _Atomic uint64_t window[TALLY_NATS_MAX_PARTITIONS];
    _Atomic uint64_t in_path[TALLY_NATS_MAX_PARTITIONS];
    _Atomic uint64_t in_path_bytes[TALLY_NATS_MAX_PARTITIONS];
    _Atomic uint64_t fetched[TALLY_NATS_MAX_PARTITIONS];
    _Atomic uint64_t taken[TALLY_NATS_MAX_PARTITIONS];
    /* A partition's standby copy here: the last changelog sequence it applied (0: no copy). */
    _Atomic uint64_t standby_cl_seq[TALLY_NATS_MAX_PARTITIONS];
} td_fleet_status_t;

/* Counts ns in stage's histogram (any thread). */
void td_fleet_status_stage(td_fleet_status_t *st, td_cl_stage_t stage, uint64_t ns);
/* Partitions owned now. */
uint32_t td_fleet_status_owned(const td_fleet_status_t *st);
/* Whether member id `id` is this process's: its member id, or one of its members_per_process. */
bool td_fleet_status_is_self(const td_fleet_status_t *st, const char *id);
/* The `info` keys (PROTOCOL.md §13), appended to out like snprintf: the length they need. */
size_t td_fleet_status_info(const td_fleet_status_t *st, char *out, size_t cap);
/* The tallyd_nats_* metric families (Prometheus text), like snprintf; nothing when not in a
 * fleet. */
size_t td_fleet_status_render(const td_fleet_status_t *st, char *out, size_t cap);

#endif
