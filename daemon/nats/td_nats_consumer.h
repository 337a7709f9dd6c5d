/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_nats_consumer.h — a partition's durable pull consumer on TALLY_P<k> (PROTOCOL.md §13 "Leases
 * and fencing", step 3), and the acknowledgements an owner sends after a checkpoint (confirmed).
 *
 * The fleet removes nothing from a partition's stream: messages leave it by its limits (age,
 * then bytes). nats-server 2.9.10 loses acknowledged messages when a replica restarts after
 * removals: a purge below a sequence is replayed as a full purge (nats-server#4196), and with
 * interest retention the healthy replicas failed on "stream store EOF", reset, and the restarted
 * empty one became the leader. This project's fault test met both.
 *
 * The consumer is created with js_AddConsumer, and pulled from by hand (td_pull_t): a request
 * on $JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer> with a batch, a byte limit and an expiry,
 * answered on an inbox of the puller's own. libnats 3.4.1's natsSubscription_Fetch(Request)
 * writes past its list when messages of an earlier pull that expired arrive during a later one
 * (the C client's issue 749): a worker paused (SIGSTOP) with pulls outstanding corrupted its
 * heap when it woke (seen on the H200 and on the dev box, 2026-12-02). Each owner makes a
 * consumer of its own (named with its lease's revision) starting at its checkpoint's
 * sequence + 1, and deletes the previous owner's: so messages the previous owner fetched but did
 * not checkpoint come again at once, not after the ack wait, and a delete or create that timed
 * out (done or not on the server) can never leave this owner on a consumer that has moved on.
 */
#ifndef TD_NATS_CONSUMER_H
#define TD_NATS_CONSUMER_H

#include <stddef.h>
#include <stdint.h>

#include <nats/nats.h>

#include "td_err.h"

/* What an owner's consumer lets be delivered and not acknowledged: an owner acknowledges once per
 * checkpoint (AckAll), and drains for a checkpoint at half of it. Set explicitly and checked:
 * libnats 3.4.1 does not send MaxAckPending -1, and the server's default (1,000) held every
 * partition to 1,000 messages per checkpoint interval. */
#define TD_NATS_ACK_PENDING (1 << 20)

/* A fetch asks for at most this many bytes: libnats drops a subscription whose pending bytes
 * pass its 64 MiB limit (a slow consumer), so stay well under it. */
#define TD_NATS_FETCH_MAX_BYTES (32ll << 20)

/* A partition's puller: its consumer's next-message subject, and its inbox subscription. */
typedef struct td_pull td_pull_t;

/* Creates the owner's durable consumer tally-p<k>-<epoch>-<restart> of partition k (epoch: the
 * owner's lease revision; restart: how many it made before under that lease) delivering from
 * start_seq (<= 1: from the first message), AckAll (an acknowledgement covers every message
 * delivered before it), TD_NATS_ACK_PENDING, ack_wait_ms, and makes *pull (nc: js's
 * connection; inbox: where the pulled messages come, one of the worker's inboxes). A consumer of
 * that name that has delivered already is refused. */
td_err_t td_consumer_start(jsCtx *js, natsConnection *nc, const char *inbox, uint32_t k,
                           uint64_t epoch, unsigned restart, uint64_t start_seq,
                           int64_t ack_wait_ms, td_pull_t **pull, char *msg, size_t cap);
/* Deletes every other consumer of pull's partition (a previous owner's, or this owner's previous
 * one). The reader does it after its first fetch, while the lease is valid (td_fleet_reader.c):
 * it is tidying, not on a take-over's way (issue 32). A failure leaves one behind, which
 * delivers to nobody. */
void td_consumer_delete_others(jsCtx *js, const td_pull_t *pull);
void td_pull_destroy(td_pull_t **pull);
/* The first sequence partition k's stream still holds (0 when it cannot be asked). */
uint64_t td_partition_first_seq(jsCtx *js, uint32_t k);
/* Fetches up to batch messages and max_bytes (capped at TD_NATS_FETCH_MAX_BYTES): those the
 * consumer holds, at once; when it holds none, the first to come within wait_ms (> 0) and any
 * with them. None is TD_OK with an empty list. It blocks: a worker fetches on a thread of its
 * own (td_fleet_reader.c). */
td_err_t td_consumer_fetch(td_pull_t *pull, int batch, int64_t max_bytes, int64_t wait_ms,
                           natsMsgList *list, char *msg, size_t cap);
/* A delivered message's stream sequence (0 when it has no JetStream metadata). */
uint64_t td_nats_msg_seq(natsMsg *m);
/* The same, and the consumer's pending count when it was delivered (messages after it). */
uint64_t td_nats_msg_seq_pending(natsMsg *m, uint64_t *pending);
/* Acknowledges the message whose ack subject (its reply subject) this is, and waits for the
 * server's confirmation ("+ACK" as a request). */
td_err_t td_consumer_ack_sync(natsConnection *nc, const char *ack_subject, int64_t timeout_ms,
                              char *msg, size_t cap);

#endif
