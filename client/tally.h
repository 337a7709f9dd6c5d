/*
 * tally.h — libtally, the C client library of tallyd.
 *
 * A tally_client_t is one ZeroMQ DEALER socket connected to one daemon. Three layers, each
 * built on the one below:
 *
 *   1. tally_send / tally_recv: pipelining. tally_send encodes a request (proto/tally_proto.h),
 *      gives it a fresh request id and queues it; tally_recv returns the next reply that
 *      arrives, whichever request it answers, so a caller can keep a window of requests in
 *      flight and match replies by request id. Replies to requests on different streams (or
 *      on none) can come back in any order; requests on one stream apply in order.
 *   2. tally_call: one synchronous request; replies to other (older, timed-out) requests are
 *      discarded while it waits. Wrappers for the small operations sit on top of it.
 *   3. tally_run: one operation over an input of any size, cut into chunks that are pipelined
 *      with a window, whose output is what one whole message would have produced.
 *
 * Nothing blocks forever: every wait is bounded by the client's timeout and reports
 * TALLY_E_TIMEOUT. The socket sets ZMQ_IMMEDIATE, so a request is never queued toward a
 * daemon that is not connected (a DEALER would otherwise hold it until one appears).
 *
 * Buffers holding elements (inputs, reply payloads, tally_run outputs) are little-endian
 * element arrays exactly as on the wire, that is plain C arrays on the little-endian hosts
 * tallyd runs on. Reply payloads are not guaranteed to be aligned; copy them out or read
 * them with tally_get_u32/tally_get_u64.
 *
 * A client is not thread-safe (ZeroMQ sockets are not): use one per thread.
 * Every function that can fail returns a tally_status_t (0 = TALLY_OK).
 */
#ifndef TALLY_H
#define TALLY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tally_proto.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TALLY_DEFAULT_ENDPOINT "tcp://127.0.0.1:5555"
#define TALLY_DEFAULT_TIMEOUT_MS 5000
#define TALLY_DEFAULT_CHUNK_BYTES (1u << 20)
#define TALLY_DEFAULT_WINDOW 8u
/* tally_run's largest window: well under the socket's high-water marks (1000 messages), so
 * requests in flight never back up into a blocked send while replies wait to be read. */
#define TALLY_MAX_WINDOW 256u

typedef struct tally_client tally_client_t;

/* One reply: the decoded header, the payload (owned by the reply until tally_reply_clear),
 * and for an error status the daemon's message (or a client-side explanation). */
typedef struct {
    tally_rep_t rep;
    const uint8_t *payload; /* NULL when empty or on error */
    size_t len;
    char error[TALLY_ERROR_MESSAGE_MAX + 1]; /* "" on success */
    void *msg_;                              /* private: the ZeroMQ frame holding payload */
} tally_reply_t;

/* Creates a client connected (asynchronously) to `endpoint` (NULL: TALLY_DEFAULT_ENDPOINT).
 * `timeout_ms` (> 0) bounds every wait of every call on this client. */
tally_status_t tally_client_new(const char *endpoint, int timeout_ms, tally_client_t **out);
/* Closes the socket without lingering and frees the client; sets *self_p to NULL. */
void tally_client_destroy(tally_client_t **self_p);
int tally_client_timeout(const tally_client_t *self);

/* Initialises an empty reply; tally_reply_clear frees what a reply holds and empties it. */
void tally_reply_init(tally_reply_t *reply);
void tally_reply_clear(tally_reply_t *reply);

/* Validates and sends one request (req->request_id is ignored: the client allocates one and
 * stores it in *request_id, which may be NULL). Waits at most the timeout for the socket to
 * accept the message. Returns TALLY_OK, a wire status for a request the daemon would reject
 * anyway (bad stream name, flags, payload size: nothing is sent), TALLY_E_TIMEOUT,
 * TALLY_E_TRANSPORT or TALLY_E_ARG. */
tally_status_t tally_send(tally_client_t *self, const tally_req_t *req, const void *payload,
                          size_t len, uint64_t *request_id);

/* Releases a buffer given to tally_send_zc; called once, possibly from a ZeroMQ I/O thread. */
typedef void(tally_free_fn)(void *data, void *hint);

/* tally_send without copying the payload: ZeroMQ sends straight from `payload` (len > 0),
 * which must stay unchanged until free_fn(payload, hint) is called. That happens exactly
 * once on every path: when the frame has been sent, when the send fails, or at once for a
 * request rejected before sending. free_fn may do nothing, for a buffer that outlives the
 * client and is sent many times (a benchmark's). Saves tally_send's copy of the payload. */
tally_status_t tally_send_zc(tally_client_t *self, const tally_req_t *req, void *payload,
                             size_t len, tally_free_fn *free_fn, void *hint, uint64_t *request_id);

/* Receives the next reply, in any order, waiting at most the timeout. *reply is cleared
 * first. Returns the reply's wire status (reply->rep.request_id says which request it
 * answers), or TALLY_E_TIMEOUT, TALLY_E_TRANSPORT, or TALLY_E_REPLY for a reply that does
 * not decode (wrong frame count, magic, version or payload size). */
tally_status_t tally_recv(tally_client_t *self, tally_reply_t *reply);

/* Sends one request and waits for its reply (the timeout covers both). Returns the wire
 * status or a client-side one; reply->error explains any failure. Replies to other requests
 * that arrive meanwhile are discarded, so do not mix it with tally_send requests still in
 * flight on the same client. */
tally_status_t tally_call(tally_client_t *self, const tally_req_t *req, const void *payload,
                          size_t len, tally_reply_t *reply);

/* The message of the last failed call on this client ("" if none). */
const char *tally_client_error(const tally_client_t *self);

/* ---- Convenience wrappers around tally_call ---------------------------------------------- */

/* Round trip of an empty ping; *rtt_us (may be NULL) receives the round-trip time. */
tally_status_t tally_ping(tally_client_t *self, double *rtt_us);
/* Info (TALLY_OP_INFO) or Prometheus metrics (TALLY_OP_STATS) text, NUL-terminated, malloc'd:
 * free it with free(). */
tally_status_t tally_info(tally_client_t *self, tally_op_t op, char **text);
tally_status_t tally_query(tally_client_t *self, const char *stream, tally_stream_info_t *info);
tally_status_t tally_reset(tally_client_t *self, const char *stream);
/* The daemon's stream names: a malloc'd array of *count malloc'd strings, freed with
 * tally_strings_free. */
tally_status_t tally_streams(tally_client_t *self, char ***names, size_t *count);
void tally_strings_free(char **names, size_t count);

/* ---- Shared memory (producers on tallyd's host; PROTOCOL.md §10) ----------------------- */

/* A region of memory shared with tallyd: a sealed memfd mapped here and registered with the
 * daemon over its side channel (found through `info`). Requests then name a range of it instead
 * of carrying the data, and filter and scan may write their output into it. */
typedef struct tally_region tally_region_t;

/* Creates a region of `size` bytes (zero-filled) and registers it with the daemon the client
 * is connected to. Fails with the daemon's status (TALLY_E_QUOTA, ...; tally_client_error says
 * why), TALLY_E_ARG when the daemon offers no shared memory, TALLY_E_IO or TALLY_E_TRANSPORT
 * when the side channel cannot be reached. Destroy regions before their client. */
tally_status_t tally_region_create(tally_client_t *client, size_t size, tally_region_t **out);
/* The region's memory (page-aligned) and size. */
void *tally_region_data(const tally_region_t *region);
size_t tally_region_size(const tally_region_t *region);
/* Releases the region (the daemon unmaps it once the requests using it are answered) and
 * unmaps it here; sets *region_p to NULL. */
void tally_region_destroy(tally_region_t **region_p);

/* tally_send with the input at [offset, offset + length) of `in` (whole elements; offset a
 * multiple of the element size) instead of a payload. With `out` (filter, scan; NULL for
 * none) the daemon writes the result at out_offset of `out` (aligned to the output element,
 * room for the worst case: filter `length`, scan `length` or 2 x `length` for int64) and the
 * reply carries only its header: count and aux0 as usual, an empty payload. The ranges must
 * stay unchanged (input) and unread (output) until the reply has arrived. */
tally_status_t tally_send_shm(tally_client_t *self, const tally_req_t *req,
                              const tally_region_t *in, size_t offset, size_t length,
                              const tally_region_t *out, size_t out_offset, uint64_t *request_id);
/* The same, waiting for the reply (as tally_call). */
tally_status_t tally_call_shm(tally_client_t *self, const tally_req_t *req,
                              const tally_region_t *in, size_t offset, size_t length,
                              const tally_region_t *out, size_t out_offset, tally_reply_t *reply);

/* ---- Chunked, pipelined operations ------------------------------------------------------- */

/* A growable output buffer. Start from {0}; tally_buf_free releases it. */
typedef struct {
    uint8_t *data;
    size_t len;
    size_t cap;
} tally_buf_t;

void tally_buf_free(tally_buf_t *buf);
tally_status_t tally_buf_reserve(tally_buf_t *buf, size_t extra);
tally_status_t tally_buf_append(tally_buf_t *buf, const void *data, size_t len);

/* How tally_run numbers the chunks it sends on a stream (PROTOCOL.md, "Sequence numbers"). */
typedef enum {
    TALLY_RUN_SEQ_OFF = 0, /* no sequence numbers: a chunk resent by anyone is applied again */
    /* A new push: query the stream's last_seq L (0 for a stream that does not exist yet) and
     * send chunk k as seq L + 1 + k. */
    TALLY_RUN_SEQ_APPEND,
    /* Continue a push that started at seq_base: chunk k is seq seq_base + 1 + k; the chunks
     * the stream has applied already (seq <= its last_seq) are skipped, not sent again. */
    TALLY_RUN_SEQ_RESUME,
} tally_run_seq_t;

typedef struct {
    size_t chunk_bytes; /* 0: TALLY_DEFAULT_CHUNK_BYTES; rounded down to whole elements */
    unsigned window;    /* requests in flight; 0: TALLY_DEFAULT_WINDOW; at most TALLY_MAX_WINDOW */
    int shm; /* non-zero: send the chunks through a shared-memory region used as a ring of
              * `window` slices (tally_region_create), filter and scan output through a second
              * ring in the same region; same output as without */
    tally_run_seq_t seq; /* with a stream only; TALLY_RUN_SEQ_OFF without one */
    uint64_t seq_base;   /* TALLY_RUN_SEQ_RESUME: the base the push started with */
} tally_run_opts_t;

/* What tally_run learnt besides the output. */
typedef struct {
    uint64_t chunks;     /* requests sent */
    uint64_t elements;   /* input elements */
    uint64_t count;      /* output elements (filter: kept; scan: elements; hist: values) */
    uint64_t seen;       /* filter: elements seen */
    int64_t carry;       /* scan: running total after the last element (stream or not) */
    uint64_t hist_total; /* hist: elements histogrammed */
    /* With sequence numbers: chunk k was sent as seq seq_base + 1 + k; `applied` chunks of the
     * input are in the stream (all of them on success; on failure the stream's last_seq minus
     * seq_base, as the daemon reported it in a duplicate or sequence_gap reply or a query after
     * the failure, or, when it could not be asked, the chunks acknowledged), of which `skipped`
     * were applied before this call (TALLY_RUN_SEQ_RESUME) and not sent; last_seq is the
     * stream's last_seq as far as known (seq_base + applied). A chunk is never counted twice. */
    uint64_t input_chunks; /* chunks the input is cut into (set once sequence numbers are known) */
    uint64_t seq_base;
    uint64_t applied;
    uint64_t skipped;
    uint64_t last_seq;
    bool applied_known; /* false: the daemon could not be asked; applied is a lower bound */
    tally_status_t status;
    char error[TALLY_ERROR_MESSAGE_MAX + 1]; /* why it failed, "" on success */
} tally_run_result_t;

/* Runs a filter, scan or hist request `req` (its stream, predicate, flags, dtype, range) over
 * `input` (`len` bytes, a whole number of elements, any size, even 0), in chunks of
 * opts->chunk_bytes with at most opts->window requests in flight, and appends to `out`
 * exactly what one request with the whole input would have produced:
 *   filter: the kept elements (input dtype), in input order (chunk replies are put in chunk
 *           order, so stable mode stays stable);
 *   scan:   n int64 (or int32 with TALLY_FLAG_SCAN_OUT_I32) prefix sums. Without a stream,
 *           each chunk is scanned from 0 and the client adds the total of the chunks before
 *           it (wrapping), so chunks still pipeline; with a stream the daemon carries;
 *   hist:   256 (u8) or 258 (i32: bins, underflow, overflow) uint64 counts of this input,
 *           summed over chunks (with a stream, the stream's running histogram grows too).
 * `opts` and `result` may be NULL. On failure, `out` holds what was produced so far and
 * result->error says why; replies still in flight are ignored by later calls.
 *
 * With opts->seq on a stream, every chunk carries a sequence number, so no chunk is ever
 * applied twice, even across a daemon restart: the call ends with every chunk applied once,
 * or with an error (sequence_gap when a chunk before it was lost, shutdown, timeout, ...) and
 * result->applied saying how many were; TALLY_RUN_SEQ_RESUME with result->seq_base continues
 * from there. A duplicate reply is counted once, as applied, and stops the call (someone else
 * pushes to the stream). With skipped chunks, `out` holds only the output of the chunks sent
 * (a scan's sums continue from the stream's carry, so it is the rest of the whole output). */
tally_status_t tally_run(tally_client_t *self, const tally_req_t *req, const void *input,
                         size_t len, const tally_run_opts_t *opts, tally_buf_t *out,
                         tally_run_result_t *result);

/* ---- CURVE: authentication and encryption (PROTOCOL.md §11) ------------------------------ */

/* The keys of one CURVE connection, Z85 text (40 characters). An empty server_public means
 * CURVE is off. */
typedef struct {
    char server_public[41];
    char client_public[41];
    char client_secret[41];
} tally_curve_keys_t;

/* Finds the keys to connect with. server_key is the server's public key (40 characters of Z85)
 * or a file holding it (the server's NAME.pub); client_key is the client's secret key file
 * (from `tally keygen`: both halves, mode 0600). Each that is NULL is taken from
 * $TALLY_SERVER_KEY and $TALLY_CLIENT_KEY, then from `server_key = ...` and `client_key = ...`
 * lines in $XDG_CONFIG_HOME/tally/tally.conf (default ~/.config/tally/tally.conf). With no
 * server key anywhere, keys->server_public is "" (CURVE off) and the result TALLY_OK.
 * TALLY_E_ARG (TALLY_E_IO for a file that cannot be read) with msg: a malformed key, a secret
 * key file that group or others can read, or a server key without a client key. */
tally_status_t tally_curve_keys_load(const char *server_key, const char *client_key,
                                     tally_curve_keys_t *keys, char *msg, size_t msg_cap);

/* Makes a new CURVE key pair and writes it as two key files (CZMQ's certificate format):
 * BASE.key holds both halves (mode 0600: the client's --client-key, or tallyd's
 * curve_secret_key) and BASE.pub the public half (for the other side: a client's goes into
 * tallyd's curve_clients_dir, the server's to its clients). Existing files are not overwritten
 * (TALLY_E_IO, with msg). public_key (may be NULL) receives the public key. */
tally_status_t tally_keygen(const char *base, char public_key[41], char *msg, size_t msg_cap);

/* tally_client_new for a daemon with CURVE on: keys from tally_curve_keys_load (NULL, or an
 * empty server_public: a plain connection, as tally_client_new). A daemon that does not accept
 * the keys (an unknown client key, a wrong server key) never answers: requests end in
 * TALLY_E_TIMEOUT, and the daemon logs and counts the refusal. TALLY_E_ARG for keys that are not
 * 40 characters of Z85. */
tally_status_t tally_client_new_curve(const char *endpoint, int timeout_ms,
                                      const tally_curve_keys_t *keys, tally_client_t **out);

#ifdef __cplusplus
}
#endif
#endif /* TALLY_H */
