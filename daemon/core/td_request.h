/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_request.h — one request's life inside tallyd, and the operations on it.
 *
 * A td_request_t is created on the loop thread when a transport submits a message (td_path.c),
 * owns everything the request needs (the sender's id, the payload, the reply being built), and is
 * freed once its transport has ended its reply (td_transport.h: sent, or dropped because the peer
 * left or does not read). Between those points it counts against max_inflight, which is what
 * bounds tallyd's memory.
 *
 * The work on a request is split by thread:
 *   td_request_admit    loop thread   the sequence rule (seq), then td_request_prepare
 *   td_request_prepare  loop thread   read stream state the computation needs (carry-in, ...)
 *   td_request_execute  any thread    run the backend on the payload; touches only the request
 *   td_request_apply    loop thread   fold the result into the stream's state (re-checking seq)
 * so stream state is only ever read and written on the loop thread.
 */
#ifndef TD_REQUEST_H
#define TD_REQUEST_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "td_mailbox.h"
#include "td_shm.h"
#include "td_stream.h"
#include "tally_ops.h"
#include "td_transport.h"
#include "tally_proto.h"
#include "td_config.h"
#include "td_counters.h"
#include "tk_backend.h"

#define TD_IDENTITY_MAX 256

/* Where a compute request runs: chosen by the scheduler (td_sched.h), read by the executor
 * (td_exec.c) and the GPU pipeline (td_gpu.c). */
typedef struct {
    bool gpu;             /* else the CPU backend */
    bool cpu_inline;      /* CPU: on the loop thread (a tiny batch, or a stream's rerun) */
    unsigned device;      /* GPU: index of the device in the pipeline */
    unsigned lane;        /* GPU: the device's lane it is queued on */
    unsigned pieces;      /* GPU: 1, or split over that many pieces on lanes lane, lane+1, ... */
    unsigned carry_index; /* GPU: the lane's device carry it chains through (0: stateless) */
    bool carry_upload;    /* GPU: first of its stream in flight: upload r->carry first */
    uint32_t generation;  /* the stream's generation it started in (a GPU failure bumps it) */
} td_placement_t;

typedef struct td_request {
    /* Envelope: where the reply goes (td_transport.h): the transport, the sender's id (empty:
     * tallyd's own request) and the transport's words. */
    td_transport_t *transport;
    size_t identity_len; /* of identity, at the end */
    /* Issue 31: the shard that runs it, and how it travels between threads (td_mailbox.h). The
     * front (td_path.c) identifies it on the transports' thread and copies its header frame (at
     * the end; header_len is the frame's length, has_header whether there was one), its request
     * frames, its payload until the shard takes it (td_request_take_payload), its connection's
     * share of the in-flight slots and what the connection had in flight with it (td_admit.h);
     * its shard decodes the header (decoded: it did, or the transport had); the transport's end
     * of its reply. port: the transport's own thread that submitted it (td_path_port.c), whose
     * mailbox its reply goes to, or NULL: the front's. */
    unsigned shard;
    struct td_path_port *port;
    td_hop_t hop;
    bool has_header;
    size_t header_len;
    bool decoded;
    bool body_unwanted; /* td_msg_t's: a successful reply's payload is dropped (td_shard.c) */
    bool routed; /* direct mode: admitted by its shard's route, told at its reply (td_shard.h) */
    bool held;   /* replicated: its reply waits for the route (held_ticket; td_shard.c) */
    uint64_t held_ticket;
    int frames;
    td_bytes_t arrived;
    unsigned share;
    unsigned share_inflight;
    td_reply_outcome_t outcome;
    uint64_t transport_word;
    void *transport_ctx;
    /* Who sent it (td_peers.h): its connection, held to a share of max_inflight, and its client
     * identity (the ZAP user id under CURVE, else the same entry), held to stream limits. Each
     * holds a reference until the reply; NULL when the table had no memory. */
    struct td_peer *conn;
    struct td_peer *client;

    /* The request. payload points into payload_held (the transport's bytes, or payload_inline),
     * or into
     * payload_copy when they were not aligned for its element type, or into a shared-memory
     * region (shm_in). */
    tally_req_t req;
    td_bytes_t payload_held;
    void *payload_copy;
    const void *payload;
    size_t payload_len;
    td_stream_t *stream; /* named stream, or NULL */
    /* Shared memory (TALLY_FLAG_SHM_REF): payload points into shm_in's mapping; with an output
     * region the result is written at out_ptr and the reply carries only the header. Each
     * region is referenced until the request is destroyed. With several shards the front
     * resolves them as it reads the request (td_path.c, pin_regions), so that a region its
     * connection lets go afterwards stays for it; shm_in_ptr and shm_out_ptr are then where they
     * start, for the shard. */
    td_shm_region_t *shm_in;
    td_shm_region_t *shm_out;
    void *out_ptr;
    void *shm_in_ptr, *shm_out_ptr;
    uint64_t received_ns;
    /* GPU requests: when each stage ended (uv_hrtime; td_counters.h, td_gpu_stage_t), 0 until. */
    uint64_t gpu_stamp[TD_GPU_STAGES];
    /* The link of the one queue that holds the request at a time: its stream's FIFO
     * (td_sched.c), then a GPU lane's wait list and the pipeline's completion queue (td_gpu.c). */
    struct td_request *next;

    /* Execution. */
    int64_t carry;        /* scan: carry-in, then carry-out */
    uint64_t kept;        /* filter: elements kept */
    td_placement_t where; /* set by td_sched before the machine runs it */
    /* Its GPU completion goes to the front's sink, not its shard's (td_path.c: the front ran it,
     * and finishes it too when it can take the shard). */
    bool gpu_to_front;
    bool gpu_failed;      /* the GPU failed it: td_sched reruns it on the CPU */
    uv_work_t cpu_job;    /* td_exec.c's: the CPU path's job on libuv's worker pool */

    /* Result: the reply header and payload (owned; handed to the transport without a copy).
     * reply_data is malloc'd, unless reply_free is set: then it is a buffer lent by its owner
     * (the GPU pipeline's pinned reply buffers, written by the device in place), given back
     * through reply_free(reply_data, reply_hint) by whoever frees it last (the transport, once
     * it has sent it). reply_len stays once the payload has gone to the transport (metrics). */
    tally_rep_t rep;
    void *reply_data;
    size_t reply_len;
    void (*reply_free)(void *data, void *hint);
    void *reply_hint;
    uint64_t reply_reserved; /* bytes reserved for the reply until it is sent (td_reply.h) */
    /* The reply as its transport sees it, from send_reply until td_reply_end (td_path.c). */
    td_reply_t out;

    /* Last, and not zeroed by td_request_new (issue 31: a small request's memsets were a third
     * of its instructions on the loop thread, bench/NOTES.md): the sender's id, of which
     * identity_len bytes are set. A hist's histogram is not kept here: it is the reply's payload
     * (td_request_hist_result), which apply reads back. */
    uint8_t identity[TD_IDENTITY_MAX];
    uint8_t header[TALLY_REQ_HEADER_SIZE]; /* of header_len bytes, at most this many copied */
    /* A payload its transport lent (td_msg_t.payload_borrowed), copied: `arrived` points here. */
    _Alignas(16) uint8_t payload_inline[TD_PAYLOAD_BORROW_MAX];
    /* A larger payload's holder, moved in by its transport (td_msg_t.hold): `arrived` (then
     * payload_held) is freed through it before the request is reused or freed. */
    _Alignas(16) uint8_t payload_holder[TD_PAYLOAD_HOLDER_MAX];
} td_request_t;

/* A FIFO of requests linked through their `next`: a stream's FIFO (td_sched.c), a GPU lane's
 * wait list and the pipeline's completion queue (td_gpu.c). Zeroed is empty. */
typedef struct {
    td_request_t *head;
    td_request_t *tail;
} td_request_queue_t;

void td_request_queue_push(td_request_queue_t *q, td_request_t *r);
/* The first request, unlinked; NULL when the queue is empty. */
td_request_t *td_request_queue_pop(td_request_queue_t *q);
/* Every request, still linked in order through next (the last one's is NULL); the queue is
 * empty after. */
td_request_t *td_request_queue_take_all(td_request_queue_t *q);

/* Allocates an empty request (its reply header's version set). NULL when out of memory. */
td_request_t *td_request_new(void);
void td_request_destroy(td_request_t **self_p);
/* What destroy does but the free: the input and the reply let go (the request, emptied of what it
 * held, goes back to a pool: td_path.c); td_request_reuse makes it new again. */
void td_request_dispose(td_request_t *self);
void td_request_reuse(td_request_t *self);
/* Frees the payload and gives back the shared-memory regions (payload_len stays): for a request
 * that is done but whose reply waits (td_reply.c). */
void td_request_release_input(td_request_t *self);

/* Takes the payload's bytes (moved from *bytes, empty after) and makes payload aligned for its
 * dtype. Bytes with data NULL and len > 0 (the transport had no memory to hold them) fail like an
 * aligning copy that found no memory: TALLY_E_INTERNAL. */
tally_status_t td_request_take_payload(td_request_t *self, td_bytes_t *bytes);

/* Turns the request into an error reply with a formatted message (replaces any result). */
void td_request_fail(td_request_t *self, tally_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Sets an OK reply with the given payload (ownership moves to the request). */
void td_request_succeed(td_request_t *self, uint8_t dtype, void *data, size_t len, uint64_t count);

/* Marks the reply payload (just set by td_request_succeed*) as lent: it is given back with
 * free_fn(data, hint) instead of free(). */
void td_request_lend_reply(td_request_t *self, void (*free_fn)(void *data, void *hint), void *hint);
/* Frees (or gives back) the reply payload; reply_data is NULL after. */
void td_request_drop_reply(td_request_t *self);

/* The results of a compute request, turned into its reply: the one place each operation's reply
 * is built, for the CPU backend and the GPU pipeline alike (any thread). A filter kept `kept`
 * elements at out, a scan wrote its sums at out and ends with `carry`: when out is the output
 * region (out_ptr) the reply carries only the header, else out is malloc'd or a lent buffer
 * (td_request_lend_reply after) and becomes the reply payload. A hist's are the counts in hist. */
void td_request_filter_result(td_request_t *self, void *out, uint64_t kept);
void td_request_scan_result(td_request_t *self, void *out, int64_t carry);
void td_request_hist_result(td_request_t *self, const tk_hist_t *hist);
/* A minmax batch's min and max (TK_MINMAX_EMPTY_* for an empty batch: a reply without values). */
void td_request_minmax_result(td_request_t *self, int64_t min, int64_t max);

/* Loop thread, before execute: reads the stream's state. Fails the request (returns false)
 * when it conflicts with the stream (a histogram of another type or range). */
bool td_request_prepare(td_request_t *self);
/* Loop thread: true while a request at the head of its stream's FIFO must wait before
 * td_request_admit: its seq is not the next one, and the stream has requests in flight
 * (stream_busy, td_sched.c knows) whose outcome decides whether it is a duplicate, a gap or
 * (after a failure) the next one. */
bool td_request_seq_waits(const td_request_t *self, bool stream_busy);
/* Loop thread, for a batch on a stream that does not exist: a seq past 1 can only be a gap (a
 * new stream is at seq 0), refused here before the stream and its client's limits are taken, so
 * that the refusal uses none of them even while other shards create streams (PROTOCOL.md §8).
 * Returns false when the request failed. */
bool td_request_seq_opens(td_request_t *self);
/* Loop thread, for a request at the head of its stream's FIFO: the sequence rule (refuses a
 * duplicate or a gap, with the stream's last applied seq in aux0), then td_request_prepare;
 * the seq counts as admitted only when both pass. stream_busy: the stream has requests in
 * flight (else what was admitted is what was applied). Returns false when the request failed. */
bool td_request_admit(td_request_t *self, bool stream_busy);
/* Any thread: computes the reply with the CPU backend. */
void td_request_execute(td_request_t *self, tk_backend_t *backend);
/* Loop thread, after execute: applies a successful result to the stream's state. A request
 * whose seq no longer follows the stream's last applied one (a request admitted before it
 * failed) is turned into a sequence_gap reply instead, its result discarded. Returns true when
 * the request succeeded (applied to its stream, if it has one), false when it failed. */
bool td_request_apply(td_request_t *self);

/* Compute operations (proto/'s rows with a batch) run on a backend; the rest are answered on
 * the loop thread. */
bool td_op_is_compute(uint8_t opcode);

/* The daemon's row for an operation with a batch, beside proto/'s (tally_ops.h): how the CPU
 * runs it and how its result meets its stream. One row per opcode in td_request.c. */
typedef struct {
    /* Loop thread, with a stream: reads the state the computation needs (a scan's carry);
     * false, the request failed, when the request conflicts with it. NULL: reads nothing. */
    bool (*prepare)(td_request_t *self, td_stream_t *stream);
    /* Any thread: runs the batch of n elements on a CPU backend and builds the reply. */
    void (*execute)(td_request_t *self, tk_backend_t *backend, size_t n);
    /* Loop thread, with a stream, after success: the op's own part of the stream's state;
     * false, the request failed and nothing changed, when the stream refuses it. NULL: only
     * the counters every batch adds (batches, elements, bytes, seq). */
    bool (*apply)(td_request_t *self, td_stream_t *stream, size_t n);
    /* Auto mode: the smallest batch worth a GPU (td_config.h has the measurements). */
    size_t gpu_min_batch;
} td_op_exec_t;

/* The row of opcode, NULL for an operation without a batch. */
const td_op_exec_t *td_op_exec(uint8_t opcode);
/* Number of elements in the payload. */
size_t td_request_elements(const td_request_t *self);

#endif
