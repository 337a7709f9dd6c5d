/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_changelog_int.h — what the two halves of a partition's changelog share, included by them
 * alone: its state (one td_changelog_t, a cl_part_t per partition, under one mutex) and the few
 * pieces both use. td_fleet_changelog.c is the records' way in (the shards' holds, the committer's
 * publishes, the PubAcks; its comment says what a partition's tickets and flights mean);
 * td_changelog_owner.c what the fleet thread does to the stream (the replay and the fence at a
 * take, the purge at a quiet point, the checkpoints' questions).
 */
#ifndef TD_CHANGELOG_INT_H
#define TD_CHANGELOG_INT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <nats/nats.h>

#include "td_changelog_stages.h"
#include "td_fleet_int.h"

/* JetStream's error code for a publish whose Nats-Expected-Last-Sequence is not the last. */
#define CL_WRONG_LAST_SEQUENCE 10071
/* A partition's messages in flight at once: its commit cycle is a PubAck's round trip, so one at
 * a time bounds a partition's replicated writes at what one message holds a round trip
 * (bench/NOTES.md, "What bounds `replicated` at 1 KiB"). */
#define CL_DEPTH 4

typedef enum { CL_CLOSED = 0, CL_OPEN, CL_FAILED } cl_state_t;

/* A message published and not settled. */
typedef struct {
    uint64_t ticket;
    bool part;       /* it holds the batch's first records only: it settles nothing */
    int64_t sent_ms; /* its first publish (a resend keeps it: TD_FLEET_JS_WAIT_MS in all) */
    int64_t sent_ns; /* that publish handed to libnats: its ack stage starts */
    natsMsg *resend; /* answered, to publish again (an election): kept until then */
} cl_flight_t;

typedef struct {
    cl_state_t state;
    uint64_t epoch;
    uint64_t stored; /* the last sequence of this owner's chain (its fence's, then its acks) */
    uint8_t *buf;    /* the batch: records waiting to be published */
    size_t len, cap;
    int64_t first_ms;              /* when the batch's first record came (monotonic) */
    unsigned writes, last_writes;  /* held in the batch filling; in the last whole one */
    td_cl_times_t times;           /* where its held writes wait */
    _Atomic uint64_t batch;        /* the ticket of the batch now filling (changed under mu) */
    cl_flight_t flights[CL_DEPTH]; /* published, not settled: oldest first */
    unsigned nflights;
    unsigned nresend; /* of them, answered and kept to publish again at retry_ms */
    int64_t retry_ms;
    bool purging;       /* the stream is being purged: nothing is published meanwhile */
    uint64_t ok_upto;   /* tickets up to it were stored */
    uint64_t fail_from; /* tickets from it on failed (0: none) */
    /* At the last take: the tickets of earlier ownerships above ok_then were not stored. */
    uint64_t open_from, ok_then;
} cl_part_t;

struct td_changelog {
    td_fleet_t *f;
    natsConnection *nc;
    jsCtx *js; /* publishes asynchronously; its PubAcks come to on_ack */
    pthread_mutex_t mu;
    pthread_cond_t cond;
    pthread_t thread;
    bool started, stop;
    int64_t commit_ms;
    bool commit_when_idle; /* a batch goes at once when its partition has nothing in flight */
    int replicas;          /* of TALLY_CL<k> */
    int64_t max_age_ms;    /* how long a record is kept ([nats] partition_max_age_s) */
    size_t max_msg;        /* the records one message may hold (max_payload less the headers') */
    size_t commit_bytes;   /* a batch this large goes at once (TD_NATS_COMMIT_BYTES, or max_msg) */
    cl_part_t *parts;
};

/* Partition k's changelog: its subject (tally.cl.<k>) and its stream (TALLY_CL<k>). */
static inline void td_cl_subject_of(char *out, size_t cap, uint32_t k)
{
    tally_fleet_name(out, cap, TALLY_NATS_SUBJ_CL, k);
}

static inline void td_cl_stream_of(char *out, size_t cap, uint32_t k)
{
    tally_fleet_name(out, cap, TALLY_NATS_CL_STREAM_PREFIX, k);
}

/* td_fleet_changelog.c: under mu, forgets p's flights (failed, or of an ownership that ended). */
void td_cl_drop_flights(cl_part_t *p);
/* Under mu: every ticket not settled fails (the batch in flight, those whose first records went
 * out as parts, the one filling), and every later one until a take. */
void td_cl_fail_locked(td_changelog_t *cl, uint32_t k, const char *why);
/* A changelog message's headers: the owner's epoch, the batch's ticket (0: a fence), the member. */
natsStatus td_cl_add_headers(natsMsg *m, const td_fleet_t *f, uint64_t epoch, uint64_t ticket);
/* The bytes at the front of buf (len > 0) to take as one piece of at most max: its whole
 * records that fit, the first always (td_fleet_changelog.c says more). */
size_t td_cl_records_within(const uint8_t *buf, size_t len, size_t max);

#endif
