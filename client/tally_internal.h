/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_internal.h — libtally's private helpers, shared by its files and the unit tests.
 *
 * Most are the pure pieces of tally_run's reassembly (no sockets: tally_chunk.c), split out so
 * that the arithmetic that makes chunked output equal whole-message output can be tested directly.
 * The `tally__` prefix marks them private: they are exported from the shared library only so
 * tests can link them, and are not installed or part of the API.
 */
#ifndef TALLY_INTERNAL_H
#define TALLY_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tally_ops.h"
#include "tally_proto.h"

/* ---- tally_chunk.c: the arithmetic of chunks ---------------------------------------------- */

/* Adds `offset` to each of the `n` little-endian prefix sums at `vals`, wrapping: modulo 2^64
 * for int64 output, modulo 2^32 (the low 32 bits of offset) for int32 output. This turns a
 * chunk scanned from carry-in 0 into the chunk scanned from carry-in `offset`. */
void tally__scan_offset(uint8_t *vals, size_t n, bool out_i32, uint64_t offset);

/* acc[i] += vals[i] for `n` little-endian uint64 counts (histogram summing across chunks). */
void tally__hist_add(uint8_t *acc, const uint8_t *vals, size_t n);

/* Number of uint64 values in a hist reply for the request's input dtype (0 if none). */
size_t tally__hist_values(uint8_t dtype);

/* The chunk size tally_run uses: `requested` (0 = default) rounded down to a whole number of
 * `elem_size`-byte elements, at least one element. */
size_t tally__chunk_bytes(size_t requested, size_t elem_size);

/* Chunks for an input of `len` bytes: at least 1 (an empty input is still one request). */
uint64_t tally__chunk_count(size_t len, size_t chunk_bytes);

/* ---- tally.c and tally_shm.c: the sockets --------------------------------------------------- */

/* zmq_connect as a status: TALLY_OK; TALLY_E_ARG for an endpoint ZeroMQ does not take;
 * TALLY_E_TRANSPORT for anything else. */
tally_status_t tally__connect(void *sock, const char *endpoint);

/* Sends one shared-memory side-channel message on `sock`, with descriptor `fd` attached
 * (SCM_RIGHTS) when fd >= 0; errors show in the answer that does not come. */
void tally__side_send(int sock, const tally_shm_msg_t *m, int fd);

/* ---- tally_bufpool.c: the buffers tally_send copies large payloads into -------------------- */

/* Payloads from this size on go through the pool (smaller ones: a plain ZeroMQ copy, which glibc
 * serves from memory it keeps anyway); the pool keeps at most this many buffers and bytes. */
#define TALLY_POOL_MIN_BYTES (64u << 10)
#define TALLY_POOL_BUFFERS 16u
#define TALLY_POOL_BYTES (64u << 20)

typedef struct tally_bufpool tally_bufpool_t;

/* NULL when out of memory. */
tally_bufpool_t *tally__bufpool_new(void);
/* Frees the kept buffers; every buffer taken must have been given back. */
void tally__bufpool_destroy(tally_bufpool_t **self_p);
/* A buffer of at least len bytes (a kept one, or a new one), or NULL: len outside
 * [TALLY_POOL_MIN_BYTES, TALLY_POOL_BYTES], or out of memory. */
void *tally__bufpool_take(tally_bufpool_t *self, size_t len);
/* The taken buffer is written: published (a release) for whichever thread gives it back
 * (ZeroMQ's I/O thread, after a hand-off of ZeroMQ's that a race detector cannot see). */
void tally__bufpool_written(void *data);
/* Gives a taken buffer back (a zmq_free_fn: any thread; hint unused): kept while the pool has
 * room, else freed. */
void tally__bufpool_give_back(void *data, void *hint);
/* How many buffers (and, in *bytes if not NULL, how many bytes) the pool keeps now. */
unsigned tally__bufpool_kept(tally_bufpool_t *self, size_t *bytes);

#endif /* TALLY_INTERNAL_H */
