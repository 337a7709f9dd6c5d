/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_client_nats.h — what a client made by tally_client_new_nats (tally_client_nats.c, a
 * transport: tally_transport.h) asks of the NATS producer (tally_nats.c, or its stub) beyond
 * tally.h's tally_nats_* (private to libtally). The `tally__` prefix marks it private; not
 * installed.
 */
#ifndef TALLY_CLIENT_NATS_H
#define TALLY_CLIENT_NATS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tally.h"

/* tally_nats.c (and its stub): the request id (message number) the next request gets; the
 * largest payload of one message for req (PROTOCOL.md §13 "Validation"). */
uint64_t tally__nats_next_id(const tally_nats_t *self);
size_t tally__nats_chunk_limit(const tally_nats_t *self, const tally_req_t *req, bool want_reply);
/* A `query` of stream by request-reply on its partition's subject under prefix
 * (TALLY_NATS_SUBJ_QUERY or TALLY_NATS_SUBJ_SEQ), with the header Tally-Stale-Ok when stale_ok,
 * asked again while nobody answers until the timeout: the answer in reply (as tally_nats_call
 * gives it), *stale its Tally-Stale (0: none, the owner's). For tally_nats_query.c. */
tally_status_t tally__nats_ask(tally_nats_t *self, const char *prefix, const char *stream,
                               bool stale_ok, tally_reply_t *reply, uint64_t *stale);

/* tally_nats_query.c (and the stub): a stream's last_seq from its owner (tally.seq.<k>.<user>:
 * what a producer may ask; 0 for a stream that does not exist yet), for a push that numbers its
 * chunks. */
tally_status_t tally__nats_last_seq(tally_nats_t *self, const char *stream, uint64_t *last);

/* tally_nats.c's connection, for tally_nats_watch.c; tally_nats_names.c: adds the names of one
 * member's `streams` answer m (entries [u8 length][name]) to *names (*count of *cap), each name
 * once. Only with libnats (not the stub). */
typedef struct __natsConnection natsConnection;
typedef struct __natsMsg natsMsg;
natsConnection *tally__nats_conn(tally_nats_t *self);
tally_status_t tally__nats_merge_names(natsMsg *m, char ***names, size_t *count, size_t *cap);

/* tally_nats.c: the producer's JetStream context (libnats' jsCtx), for the fleet client
 * (tally_client_fleet.c), which reads the buckets of direct mode through the producer's
 * connection. */
struct __jsCtx;
struct __jsCtx *tally__nats_js(tally_nats_t *self);

#endif
