/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_client_nats.h — the NATS side of a client made by tally_client_new_nats (private to
 * libtally): tally.c sends and receives through it; tally_client_nats.c says how each operation
 * travels. The `tally__` prefix marks it private; not installed.
 */
#ifndef TALLY_CLIENT_NATS_H
#define TALLY_CLIENT_NATS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tally.h"

typedef struct tally__natsc tally__natsc_t;

tally_status_t tally__natsc_new(const tally_nats_opts_t *opts, tally__natsc_t **out, char *msg,
                                size_t cap);
/* Waits for the PubAcks of what was published (up to the timeout), then closes. */
void tally__natsc_destroy(tally__natsc_t **self_p);
/* The largest payload one request may carry (one message; its reply fits one message too). */
size_t tally__natsc_chunk_limit(const tally__natsc_t *self, const tally_req_t *req);
/* Sends req; error (cap bytes) says why it failed. */
tally_status_t tally__natsc_send(tally__natsc_t *self, const tally_req_t *req, const void *payload,
                                 size_t len, uint64_t *request_id, char *error, size_t cap);
/* The next reply, waiting up to timeout_ms. */
tally_status_t tally__natsc_recv(tally__natsc_t *self, int timeout_ms, tally_reply_t *reply);

/* tally_nats.c (and its stub): the request id (message number) the next request gets; the
 * largest payload of one message for req (PROTOCOL.md §13 "Validation"). */
uint64_t tally__nats_next_id(const tally_nats_t *self);
size_t tally__nats_chunk_limit(const tally_nats_t *self, const tally_req_t *req, bool want_reply);
/* A stream's last_seq from its owner (tally.seq.<k>.<user>: what a producer may ask; 0 for a
 * stream that does not exist yet), for a push that numbers its chunks. */
tally_status_t tally__nats_last_seq(tally_nats_t *self, const char *stream, uint64_t *last);
/* tally_client_nats.c: the same for a client made by tally_client_new_nats; error (cap bytes)
 * says why it failed. */
tally_status_t tally__natsc_last_seq(tally__natsc_t *self, const char *stream, uint64_t *last,
                                     char *error, size_t cap);

#endif
