/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_transport.h — the wall between a transport (how requests arrive and replies leave) and the
 * request path (admission, per-stream order, exactly-once numbered requests, execution, reply).
 *
 * Design
 * ------
 * The request path (td_path.h) knows a request as bytes with a sender and a transport to answer
 * through, and nothing of sockets: no zmq.h here, in daemon/core/ or in daemon/gpu/
 * (tests/test_walls.sh checks). A transport is a td_transport_t whose ops the path calls; the
 * transport calls the path. Like libuv's uv_stream_t or nginx's event actions: the path never
 * names ZeroMQ, HTTP or NATS, and a new way in is one more transport, not edits across the path.
 *
 *   transport ── td_path_submit(path, transport, msg) ──▶ request path (loop thread)
 *   transport ◀── ops->send_reply(transport, reply) ──── request path (loop thread)
 *   transport ── td_reply_end(reply, outcome) ─────────▶ request path (now, or later)
 *
 * In: td_path_submit hands one message: the sender (an opaque id, stable per connection, that the
 * per-connection limits and the shared-memory regions are keyed on; the authenticated user when
 * the transport knows one, which per-client limits use; two words of the transport's own, given
 * back with the reply), the request header's bytes, the payload as td_bytes_t (ownership moves
 * to the path, which frees it through its free function once the request no longer needs it: no
 * copy on the way in), and how many request frames the message had (2: header and payload; a
 * transport without frames says 2). Everything else — decoding, validation, limits, `busy`,
 * ordering, the sequence rule, the backends — is the path's, the same for every transport.
 *
 * Out: every submitted request gets exactly one send_reply, on the loop thread, with the reply
 * header encoded and the payload as td_bytes_t. Ownership: from send_reply on, the td_reply_t
 * is the transport's until it calls td_reply_end(reply, outcome) exactly once (at once, or later
 * for a reply it keeps: ZeroMQ keeps replies for a connection that closed until it reconnects).
 * The payload bytes are the transport's to give back with td_bytes_free exactly once, on any
 * thread, whenever it is done with them (ZeroMQ frees them on its I/O thread once written out);
 * what it has not taken when it calls td_reply_end, td_reply_end frees. The bytes of a reply's
 * payload count toward max_reply_bytes_per_peer and max_reply_bytes (td_reply.h) from
 * send_reply until they are freed, so a reply a transport holds — unread, queued in a socket,
 * kept for a reconnect, waiting on a broker's acknowledgement — stays counted exactly: a
 * transport must not copy the payload and free the original early to escape that.
 *
 * A transport that is not a socket fits the same calls. A consumer of a broker (issue 22's NATS
 * JetStream worker: a thread of its own that fetches messages and must acknowledge each once its
 * effect is durable) works so:
 *   - it runs td_path_submit on the loop thread: its thread posts what it fetched to the loop (a
 *     uv_async_t and a queue; td_web.c does the same for HTTP), and the loop submits each
 *     message with its payload's free function releasing the broker's message (natsMsg_Destroy:
 *     no copy either), the partition in the sender's id, the broker's sequence in a word;
 *   - send_reply is its completion: it is called once the request has been applied to its
 *     stream's state (or refused: rep.status says which, with the stream's last applied `seq` in
 *     aux0 for a duplicate), in the stream's order; the transport publishes the reply (or not),
 *     hands the sequence to its thread to acknowledge after its next checkpoint, and calls
 *     td_reply_end. A transport that must hold the payload past td_reply_end (publishing from
 *     another thread) keeps the bytes: they are its own to free;
 *   - backpressure: td_path_may_read says whether the path takes more now (under max_inflight);
 *     a transport that must wait stops fetching, and looks again after each loop iteration (a
 *     uv_check_t, as the ZeroMQ transport does), since replies free in-flight slots;
 *   - a request the path cannot even allocate is refused by td_path_submit (TD_ERR_NOMEM, the
 *     payload still the transport's, no reply will come): redeliver it later.
 * The shared-memory side channel is not a transport of requests: it registers regions (td_shm.h);
 * a request that references one comes through any transport, and is resolved against the regions
 * of the sender id it came with.
 *
 * A transport with a thread of its own may also skip the loop thread (issue 32: the fleet's
 * hop through the loop was a whole core's busiest part of a message): a port (td_path_port_open)
 * is the request path's front for that one thread. It hands its requests straight to the shards'
 * mailboxes, in batches of its own, and the shards hand its replies straight back to a mailbox of
 * its own, whose wake-up is the transport's function (an eventfd write), written only when the
 * thread sleeps (td_mailbox.h). Its requests are tallyd's own (no sender id: no per-peer share),
 * each named stream's go to the stream's shard in the order the port submitted them, the others
 * to the next shard in turn; no reply comes through send_reply: the thread takes them
 * (td_path_port_take_replies), reads them, and the port ends them. A port needs shard threads:
 * with one shard, td_path_port_open says so and the transport goes through the loop as above.
 *
 * Threads: everything here is loop-thread only, except td_bytes_free and a port's calls (its
 * thread's; td_path_port_open and _close, see there).
 */
#ifndef TD_TRANSPORT_H
#define TD_TRANSPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tally_proto.h"
#include "td_err.h"

typedef struct td_path td_path_t;
typedef struct td_transport td_transport_t;
typedef struct td_reply td_reply_t;

/* The largest payload a transport may lend for td_path_submit's duration (td_msg_t). */
#define TD_PAYLOAD_BORROW_MAX 256
/* The room a request gives a transport's holder of a larger payload (td_msg_t.hold): a
 * zmq_msg_t's 64 bytes. */
#define TD_PAYLOAD_HOLDER_MAX 64

/* Bytes and how to give them back: free_fn(data, hint) once, on any thread (the signature of
 * ZeroMQ's zmq_free_fn, so a payload goes into a message as it is). free_fn NULL: nothing to
 * free (borrowed, or none). */
typedef struct {
    void *data;
    size_t len;
    void (*free_fn)(void *data, void *hint);
    void *hint;
} td_bytes_t;

/* Gives the bytes back; b is empty after (a second call does nothing). */
void td_bytes_free(td_bytes_t *b);
/* The transport has handed the bytes on (to ZeroMQ, which frees them): b is empty after, nothing
 * is freed here. */
void td_bytes_taken(td_bytes_t *b);

/* Who sent a request, as its transport names it. */
typedef struct {
    /* Opaque, stable per connection (ZeroMQ: the routing id; at most TD_IDENTITY_MAX bytes are
     * kept). NULL: tallyd's own request (the HTTP API's), held to no per-peer limit. */
    const uint8_t *id;
    size_t id_len;
    /* The authenticated user (CURVE's User-Id, a broker's credential), or NULL: then the
     * connection is also the client that per-client limits count. */
    const char *user;
    /* The transport's own, given back in the reply (ZeroMQ: whether to echo a REQ delimiter). */
    uint64_t word;
    void *ctx;
} td_sender_t;

/* One message, as a transport hands it to the path. */
typedef struct {
    td_sender_t from;
    /* The first request frame (the header), or NULL when the message had none; read during
     * td_path_submit only. */
    const void *header;
    size_t header_len;
    /* That header already decoded (tally_req_decode, its request id as in the frame) by a
     * transport that has read it anyway, or NULL: its shard decodes it. The fleet's reads every
     * message's to judge it (issue 32: a second decode was ~900 instructions a message). Read
     * during td_path_submit only. */
    const tally_req_t *req;
    /* The transport reads only the header of a successful reply (the fleet's messages that name
     * no Tally-Reply): its shard drops the payload once the request is applied, so a hist's 2
     * KiB of counts is neither handed over, freed on the transport's thread, nor counted as
     * sent (issue 32). An error reply keeps its message. */
    bool body_unwanted;
    /* The second request frame; moved to the path (its free function is the path's to call),
     * or, with payload_borrowed, the transport's until td_path_submit returns: the path copies
     * it into the request (at most TD_PAYLOAD_BORROW_MAX bytes). A small payload then costs the
     * transport no holder to allocate and the shard none to free (bench/NOTES.md, "The front's
     * instructions and wake-ups"). */
    td_bytes_t payload;
    bool payload_borrowed;
    /* Or, hold not NULL (payload then unused), the payload stays in a holder of the
     * transport's that the request gives room for: hold(room, hold_ctx) moves the holder into
     * `room` (TD_PAYLOAD_HOLDER_MAX bytes, aligned for any type, not moved until the bytes are
     * freed) and returns the bytes, whose free function releases the holder in place. A payload
     * of any size then costs no allocation and no copy (ZeroMQ: its frame, moved into the
     * request; bench/NOTES.md, "Payloads and reply headers without an allocation"). Called at
     * most once, only once the path has the request (not on TD_ERR_NOMEM). */
    td_bytes_t (*hold)(void *room, void *hold_ctx);
    void *hold_ctx;
    /* Request frames after the transport's envelope: a request is 2 (header, payload); any
     * other count is answered `frames` (PROTOCOL.md §1). */
    int frames;
} td_msg_t;

/* What became of a reply (td_reply_end counts the dropped ones). */
typedef enum {
    TD_REPLY_SENT = 0,
    TD_REPLY_GONE,   /* dropped: the peer has gone (and did not come back in time) */
    TD_REPLY_SLOW,   /* dropped: the peer does not read its replies (its queue is full) */
    TD_REPLY_BROKEN, /* dropped: the transport failed (it logged why) */
} td_reply_outcome_t;

/* A reply, from send_reply until td_reply_end. */
struct td_reply {
    td_sender_t to; /* as submitted; to.id points into the request (valid until td_reply_end) */
    const char *peer_name; /* what the logs call the sender (td_peers.h), or "" */
    tally_rep_t rep;       /* the reply header, decoded (in-process transports read it) */
    uint8_t header[TALLY_REP_HEADER_SIZE]; /* and encoded */
    td_bytes_t body;                       /* the reply payload; rep.status != OK: a message */
    /* The same encoded header, kept with the body's bytes (freed by body.free_fn, not before),
     * or NULL: a transport that hands the body on without a copy may send this ahead of it
     * without a copy either (ZeroMQ: no allocation for the header frame). */
    const uint8_t *header_kept;
    td_reply_t *next; /* the transport's own link while it keeps the reply */
};

typedef struct {
    const char *name; /* "zeromq", "http": for the logs */
    /* A reply to one of this transport's requests (see the design above): send it, keep it or
     * drop it, and end it with td_reply_end. */
    void (*send_reply)(td_transport_t *self, td_reply_t *reply);
    /* Whether more requests wait to be read now (asked only when the one just submitted is the
     * only one in flight: the path then runs it on the loop thread if nothing else waits,
     * td_path.c). NULL: the path assumes more wait. */
    bool (*input_waiting)(td_transport_t *self);
} td_transport_ops_t;

/* A transport: embedded first in the transport's own struct. */
struct td_transport {
    const td_transport_ops_t *ops;
    td_path_t *path;
    /* A fleet worker's partitions (the NATS transport): on a worker, the only way streams
     * change unless [nats] local_writes is on (PROTOCOL.md §13 "Security"). */
    bool owns_streams;
};

/* Loop thread: hands msg to the path; msg->payload belongs to the path from here on, unless
 * TD_ERR_NOMEM (no memory for the request: nothing was taken, no reply will come; logged). */
td_err_t td_path_submit(td_path_t *path, td_transport_t *transport, td_msg_t *msg);
/* Loop thread: hands the transports the replies the shards have sent back since it last did
 * (send_reply, on this thread). A transport calls it as it services its socket, before it looks
 * for more to read: while the loop thread is busy, replies come this way, without a wake-up
 * (td_mailbox.h); when it sleeps, they wake it. Nothing with one shard. */
void td_path_take_replies(td_path_t *path);
/* Loop thread: whether the path takes requests now (under the in-flight limit; while stopping,
 * messages are still taken, to be answered `shutdown`, until the drain deadline or the path's
 * close: after td_path_close no shard would ever answer them). */
bool td_path_may_read(const td_path_t *path);
/* Loop thread: the transport holds input because td_path_may_read said no: a port's replies that
 * free slots wake the loop from now on (the slots may all be ports', whose replies would not wake
 * it otherwise). Then td_path_may_read once more: true when slots came free meanwhile. */
bool td_path_wait_for_room(td_path_t *path);
/* Loop thread: the transport is done with reply (frees what it left of the body, counts a
 * dropped one, frees the request). */
void td_reply_end(td_reply_t *reply, td_reply_outcome_t outcome);
/* Any thread: no memory to take m's request (td_path_submit or td_path_port_submit returned
 * TD_ERR_NOMEM): *out is its reply all the same, `internal` "out of memory; not run" echoing what
 * m's header gives, built without an allocation (the message is static), so that the request
 * still gets its one reply (found by the allocation sweep, issue 25: it was dropped, and its sender
 * waited forever). The transport sends it as it is and never calls td_reply_end for it. */
void td_reply_no_memory(const td_msg_t *m, td_reply_t *out);

/* ---- A port: the request path for a transport's own thread (above) ------------------------- */

typedef struct td_path_port td_path_port_t;
/* The most ports a path has (one per fleet member: [nats] members_per_process). */
#define TD_PATH_PORTS_MAX 16

/* Loop thread, before td_path_run: a port for transport t's own thread; wake(ctx), on a shard's
 * thread, wakes that thread when a reply comes while it sleeps (td_path_port_sleep).
 * TD_ERR_CONFIG with one shard (everything runs on the loop thread: submit through it), or when
 * TD_PATH_PORTS_MAX are open or the shards run already; TD_ERR_NOMEM. */
td_err_t td_path_port_open(td_path_t *path, td_transport_t *t, void (*wake)(void *ctx), void *ctx,
                           td_path_port_t **out);
/* The port's thread: as td_path_submit, the request added to its shard's batch (posted by
 * td_path_port_flush); msg->from is read only by a port given an admission of its own
 * (td_path_port_admit), else its requests are tallyd's own (no sender). TD_ERR_NOMEM: nothing
 * taken, no reply will come. TD_ERR_BUSY: max_inflight of this port's requests are in flight;
 * nothing taken: submit it again once replies have come. Once the path reads nothing more (its
 * drain is over, or it is closed) every request is answered `shutdown` by the port itself, through
 * the same replies. */
td_err_t td_path_port_submit(td_path_port_t *port, td_msg_t *msg);
/* Before the port's thread submits: its requests that name a sender (msg->from.id) are
 * identified on its thread in admit (its own peers' table, td_admit.h), held to their
 * connection's share of the in-flight slots and to its reply bytes as the loop thread's are. */
typedef struct td_admit td_admit_t;
void td_path_port_admit(td_path_port_t *port, td_admit_t *admit);
/* The port's thread: posts what was submitted since the last flush, a batch per shard. */
void td_path_port_flush(td_path_port_t *port);
/* The port's thread, last before it blocks: false when replies wait (take them instead); true
 * when it may sleep, and a reply posted from now on calls wake. */
bool td_path_port_sleep(td_path_port_t *port);
/* The port's thread: every reply posted so far, each handed to fn(ctx, reply) (rep, header and
 * body as send_reply gives them: the body's bytes may be taken, td_bytes_taken, and freed later
 * on any thread; what is left is freed after fn) and then ended; how many. */
unsigned td_path_port_take_replies(td_path_port_t *port, void (*fn)(void *ctx, td_reply_t *reply),
                                   void *ctx);
/* Its requests in flight (submitted, their replies not taken yet). Any thread. */
unsigned td_path_port_inflight(td_path_port_t *port);
/* Once the port's thread is done with it and the path is closed (td_path_close: the shards'
 * threads have ended), or never ran: replies not taken are dropped, its requests let go; the
 * path frees what is left of it (td_path_destroy). *port_p is NULL after. */
void td_path_port_close(td_path_port_t **port_p);

#endif
