/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_changelog.h — direct mode's replicated durability (`[nats] direct = replicated`;
 * PROTOCOL.md §13 "Direct mode", "Changelog"): each owner appends its partitions' changes to a
 * JetStream stream per partition, TALLY_CL<k> on the subject tally.cl.<k>, and a direct write is
 * answered once the record holding its effect is stored.
 *
 * Records. A changed stream's whole record in td_state_record's encoding (a histogram's is about
 * 2 KiB; a removal after a delete), taken on the stream's shard right after the write, so that
 * it holds the write's effect and every earlier one. A partition's records wait in its batch,
 * published every `[nats] commit_ms`, or at once at TD_NATS_COMMIT_BYTES or what one message
 * holds, the smaller (group commit; a batch over a message goes as several, cut between
 * records); up to four messages per partition are in flight at once (each expecting the one
 * before it), and each held reply is released by the PubAck of its batch's last message (Kafka's
 * AckAll, per partition).
 *
 * At once when idle (`[nats] commit_when_idle`, on by default): a partition's batch goes at
 * once when none of its messages is in flight (none awaiting a PubAck, none to send again, no
 * purge under way) and its last whole batch held fewer than 4 writes (CL_BUSY_WRITES), and the
 * PubAck that leaves none wakes the committer, which sends what waited meanwhile; otherwise
 * records group as above. This is the adaptive group commit of databases: at light load a write
 * waits one PubAck's round trip, not commit_ms before it too (H100, 1 MiB at one writer: 1.76-1.83
 * ms added p50 at commit_ms 2 without it, 0.00 with it). The bound on the last batch is what keeps
 * the heavy load's batches: where PubAcks come back faster than commit_ms under load, "no
 * message in flight" alone sent one a round trip (2.8 x the messages, 1 KiB writes 9-13 % slower
 * on the H100; bench/NOTES.md, "Group commit at once when idle, measured"), while a batch of many
 * writes says the partition is busy and the next one waits commit_ms again. Off, batches go every
 * commit_ms or at their bytes only.
 *
 * Fencing is JetStream's compare-and-set: every message of an owner carries
 * Nats-Expected-Last-Sequence, the sequence its previous message was stored at. A new owner
 * reads the tail, applies it, and stores a fence (a message without records) expecting the last
 * sequence it read; from then on a previous owner's publish fails (wrong last sequence), and
 * it answers not_durable instead of success, so no acknowledged write of a stale owner can
 * land after a fence. Every message carries its owner's epoch (the lease revision) too: a
 * replay skips, and logs, a message whose epoch is below one already applied.
 *
 * A publish that fails or is not acknowledged within TD_FLEET_JS_WAIT_MS fails the partition:
 * its held replies and its batch are answered not_durable (the change may or may not be
 * stored), and the fleet thread drops the partition (td_part_step), so that its next owner
 * starts from what JetStream holds, and the fleet client sends numbered requests there.
 *
 * Compaction (td_changelog_compact): after a checkpoint that holds the changelog's last record,
 * with nothing waiting or in flight, the stream is purged whole (its last sequence, the fence,
 * stays); records are otherwise removed by the stream's max age.
 *
 * Threads: hold on the shards' threads; the PubAcks on libnats' thread; the committer thread
 * publishes the batches; take, closed, compact and the checkpoints' calls on the fleet thread.
 * All under one mutex (a purge's round trip outside it, the committer held off that partition
 * by a flag set under it: td_changelog_owner.c, "Compaction at a quiet point").
 */
#ifndef TD_FLEET_CHANGELOG_H
#define TD_FLEET_CHANGELOG_H

#include <stdbool.h>
#include <stdint.h>

#include <nats/nats.h>

#include "td_config.h"
#include "td_err.h"
#include "td_stream.h"

struct td_fleet;

/* The streams TALLY_CL<k> (made when missing), the committer's connection and thread; f->cl.
 * Fleet thread not started yet. */
td_err_t td_changelog_open(struct td_fleet *f, const td_config_t *cfg);
/* Stops the committer (after the partitions were given up) and frees it all. */
void td_changelog_close(struct td_fleet *f);

/* Taking partition k under epoch, its checkpoint (or a standby's copy) loaded: applies the records
 * after cl_seq (the checkpoint's, or the last the copy applied, with the highest epoch it applied:
 * max_epoch; 0 from a checkpoint); all of them when the stream ends before it: removed and made
 * again) to the stream table, then stores the fence; records may be written from then on
 * (replicated). A member that is not replicated does the same when the changelog exists (an earlier
 * owner's), and leaves it alone otherwise. *held: the changelog's sequence the stream table now
 * holds, the fence's (cl_seq without a changelog), which the partition's next checkpoint names at
 * least. TD_ERR_LIBRARY (msg) when NATS failed or the fence kept losing to another writer. */
td_err_t td_changelog_take(struct td_fleet *f, uint32_t k, uint64_t cl_seq, uint64_t max_epoch,
                           uint64_t epoch, uint64_t *held, char *msg, size_t cap);
/* Applies changelog message m (sequence seq of TALLY_CL<k>) to table, the stream table or a
 * standby's copy, on the loop thread (its parser's scratch is the loop thread's), with the
 * replay's epoch rule: a message of an epoch below *max_epoch (the highest applied so far,
 * raised here) is a stale owner's, skipped. A take's replay and a standby's copy share it.
 * TD_ERR_CORRUPT (msg) when a record does not parse or its table refuses it. */
td_err_t td_changelog_apply(struct td_fleet *f, uint32_t k, uint64_t seq, natsMsg *m,
                            td_streams_t *table, uint64_t *max_epoch, char *msg, size_t cap);
/* Partition k is lost or given up: what waits for a PubAck is answered not_durable. */
void td_changelog_closed(struct td_fleet *f, uint32_t k);
/* The last sequence of TALLY_CL<k> whose records the stream table holds (read before a
 * checkpoint's snapshot: the manifest's cl_seq). */
uint64_t td_changelog_stored(struct td_fleet *f, uint32_t k);
/* After partition k's checkpoint holding its changelog up to cl_seq was stored, its lease valid
 * until lease_until_ms (monotonic): at a quiet point (cl_seq the last record stored, none
 * waiting or in flight, the lease not ending within 1 s) the changelog is purged whole and the
 * purge counted; a purge that fails fails the partition (td_changelog_failed). Fleet thread. */
void td_changelog_compact(struct td_fleet *f, uint32_t k, uint64_t cl_seq, int64_t lease_until_ms);
/* A publish of partition k failed: the fleet thread drops it. */
bool td_changelog_failed(struct td_fleet *f, uint32_t k);

/* The shards' side (td_route_t.hold and .settled through td_fleet_route.c). hold writes the
 * stream's record (its ring's changes since its last record: td_state_record.h, kind 3) and
 * moves the stream's changelog marks; on the thread that owns the stream. */
bool td_changelog_hold(struct td_fleet *f, uint32_t k, const tally_req_t *req, td_stream_t *stream,
                       uint64_t *ticket);
tally_status_t td_changelog_settled(struct td_fleet *f, uint32_t k, uint64_t ticket, bool *pending,
                                    char *msg, size_t cap);
/* A `duplicate` (td_route_t.last): the ticket of the batch that took stream's last record, which
 * holds the effect of every seq up to the stream's last; true while it is not stored (waiting,
 * or failed: td_changelog_settled says which). */
bool td_changelog_last(struct td_fleet *f, uint32_t k, const td_stream_t *stream, uint64_t *ticket);

#endif
