/*
 * td_nats_consumer.h — a partition's durable pull consumer tally-p<k> on TALLY_P<k> (PROTOCOL.md
 * §13 "Leases and fencing", step 3), and what an owner does to the partition's JetStream stream
 * around a checkpoint: acknowledge (confirmed) and purge what the checkpoint holds.
 *
 * The consumer is created with js_AddConsumer and then bound by name: js_PullSubscribe's own
 * creation marks it as the subscription's, and unsubscribing would then delete it. A new owner
 * deletes and recreates it to start at its checkpoint's sequence + 1, so messages the previous
 * owner fetched but did not checkpoint come again at once, not after the ack wait.
 */
#ifndef TD_NATS_CONSUMER_H
#define TD_NATS_CONSUMER_H

#include <stddef.h>
#include <stdint.h>

#include <nats/nats.h>

#include "td_err.h"

/* A fetch asks for at most this many bytes: libnats drops a subscription whose pending bytes
 * pass its 64 MiB limit (a slow consumer), so stay well under it. */
#define TD_NATS_FETCH_MAX_BYTES (32ll << 20)

/* (Re)creates partition k's durable consumer delivering from start_seq (<= 1: from the first
 * message), AckAll, ack_wait_ms, and binds *sub to it. */
td_err_t td_consumer_start(jsCtx *js, uint32_t k, uint64_t start_seq, int64_t ack_wait_ms,
                           natsSubscription **sub, char *msg, size_t cap);
/* Fetches up to batch messages and max_bytes (capped at TD_NATS_FETCH_MAX_BYTES), waiting up
 * to wait_ms (> 0) for them; none is TD_OK with an empty list. It blocks: a worker fetches on a
 * thread of its own (td_fleet_reader.c). */
td_err_t td_consumer_fetch(natsSubscription *sub, int batch, int64_t max_bytes, int64_t wait_ms,
                           natsMsgList *list, char *msg, size_t cap);
/* A delivered message's stream sequence (0 when it has no JetStream metadata). */
uint64_t td_nats_msg_seq(natsMsg *m);
/* Acknowledges everything up to the message whose ack subject (its reply subject) this is, and
 * waits for the server's confirmation (AckAll, "+ACK" as a request). */
td_err_t td_consumer_ack_sync(natsConnection *nc, const char *ack_subject, int64_t timeout_ms,
                              char *msg, size_t cap);
/* Removes partition k's messages below seq from its stream. */
td_err_t td_partition_purge_below(jsCtx *js, uint32_t k, uint64_t seq, char *msg, size_t cap);

#endif
