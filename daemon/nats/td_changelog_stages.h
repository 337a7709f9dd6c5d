/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_changelog_stages.h — where direct mode's held writes wait
 * (tallyd_nats_changelog_stage_seconds, td_fleet_status.h's stages): the times a partition's
 * changelog (td_fleet_changelog.c) keeps of its batch, its messages and its PubAcks, always under
 * that changelog's lock, and the histograms they are counted in.
 *
 * Per message: its batch, from the batch's first record to its publish; the publish; its PubAck's
 * round trip. Per write: its release, from the PubAck that settled its ticket to its shard asking
 * whether it is settled (and handing the reply on), timed from the last TD_CL_SETTLES
 * settlements (ticket, time) the partition remembers. A batch that came due (its commit_ms, or
 * commit_bytes reached) while all of the partition's flights were out waited for a PubAck:
 * counted, with the wait from then to the PubAck that freed a flight. What it costs: a clock read
 * per message stage and one per write released, under the lock already held.
 */
#ifndef TD_CHANGELOG_STAGES_H
#define TD_CHANGELOG_STAGES_H

#include <stdbool.h>
#include <stdint.h>

#include "td_fleet_status.h"

/* The settlements a partition remembers: more than pass between two wake-ups of a shard. */
#define TD_CL_SETTLES 32

typedef struct {
    int64_t first_ns; /* the batch's first record held */
    int64_t bytes_ns; /* it reached commit_bytes, or a rest is due at once (0: not yet) */
    int64_t full_ns;  /* all flights out since, */
    int64_t freed_ns; /* until this PubAck */
    struct {
        uint64_t ticket; /* a PubAck settled tickets up to it, */
        int64_t ns;      /* then */
    } settles[TD_CL_SETTLES];
    uint64_t nsettles; /* ever: the next is settles[nsettles % TD_CL_SETTLES] */
} td_cl_times_t;

/* Counts to_ns - from_ns (0 if negative) in stage `which`. */
void td_cl_stage(td_fleet_status_t *st, td_cl_stage_t which, int64_t from_ns, int64_t to_ns);
/* A record was held: the batch's first, or the one that took it to commit_bytes. */
void td_cl_times_held(td_cl_times_t *t, bool first, bool reached_bytes);
/* A message's publish starts at start_ns: its batch's stage, and its wait for a flight if it
 * was due (commit_ms after its first record, or its bytes) while all were out. */
void td_cl_times_publishing(td_cl_times_t *t, td_fleet_status_t *st, int64_t commit_ms,
                            int64_t start_ns);
/* It was handed to libnats at sent_ns: the publish's stage; full: no flight is left now; rest:
 * records stay in the batch, due at once. */
void td_cl_times_sent(td_cl_times_t *t, td_fleet_status_t *st, int64_t start_ns, int64_t sent_ns,
                      bool full, bool rest);
/* A PubAck at ack_ns settled tickets up to ok_upto (0: none, parts only); was_full: every flight
 * was out before it. */
void td_cl_times_settled(td_cl_times_t *t, uint64_t ok_upto, int64_t ack_ns, bool was_full);
/* A write of that ticket, settled, is released now: its stage, when its settlement is still
 * remembered. */
void td_cl_times_released(const td_cl_times_t *t, td_fleet_status_t *st, uint64_t ticket);
/* A take: the flights of an earlier ownership are gone. */
void td_cl_times_taken(td_cl_times_t *t);

#endif
