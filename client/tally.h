/* SPDX-License-Identifier: Apache-2.0 */
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
 *      on none) can come back in any order; requests on one stream apply in order. Keep the
 *      window at most TALLY_MAX_WINDOW or so: tallyd drops the replies a connection has not read
 *      past `max_unread_replies` (info; 1024), and their requests then time out here.
 *   2. tally_call: one synchronous request; replies to other (older, timed-out) requests are
 *      discarded while it waits. Wrappers for the small operations sit on top of it.
 *   3. tally_run: one operation over an input of any size, cut into chunks that are pipelined
 *      with a window, whose output is what one whole message would have produced.
 *
 * Nothing blocks forever: every wait is bounded by the client's timeout and reports
 * TALLY_E_TIMEOUT. A request is never queued toward a daemon that is not connected: a send
 * waits (within the timeout) until the connection is up, so a request sent while tallyd is
 * down is not delivered later when it comes back. Until the client's first connection is up, a
 * send that finds nothing listening at the endpoint (a refused TCP port, no socket file) fails
 * at once with TALLY_E_TRANSPORT instead, tally_client_error saying so ("cannot connect to
 * tcp://127.0.0.1:5555: Connection refused (is tallyd running?)"): a daemon that is not there
 * is not worth a timeout. Once connected, a break (a restart) is waited for. Every reply that has
 * arrived stays readable after the connection breaks (tallyd stops or restarts): tally_recv returns
 * it. Requests still waiting in this client's queue when the connection breaks go out when it comes
 * back; on a stream, sequence numbers (PROTOCOL.md) make that harmless.
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

#include "tally_version.h"
#include "tally_wire.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TALLY_DEFAULT_TIMEOUT_MS 5000
#define TALLY_DEFAULT_CHUNK_BYTES (1u << 20)
#define TALLY_DEFAULT_WINDOW 8u
/* tally_run's largest window: well under the socket's high-water marks (1000 messages), so
 * requests in flight never back up into a blocked send while replies wait to be read. */
#define TALLY_MAX_WINDOW 256u

typedef struct tally_client tally_client_t;

/* The version of the loaded library ("0.1.0"); TALLY_VERSION is the header's. */
TALLY_API const char *tally_version(void);

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
 * `timeout_ms` (> 0) bounds every wait of every call on this client. TALLY_E_ARG for an
 * endpoint that is not tcp://HOST:PORT or ipc://PATH (tally_client_open says why). */
TALLY_API tally_status_t tally_client_new(const char *endpoint, int timeout_ms,
                                          tally_client_t **out);
/* Waits until the client's connection is up, within its timeout: TALLY_OK, TALLY_E_TIMEOUT, or
 * at once TALLY_E_TRANSPORT when nothing listens at the endpoint and the client was never
 * connected (tally_client_error says why, as for a send). Every request waits so by itself;
 * this is for a caller that wants to know before it starts (the CLI, before reading its input).
 * A client over NATS is connected from its start: TALLY_OK. */
TALLY_API tally_status_t tally_client_wait_connected(tally_client_t *self);
/* One connection attempt to endpoint (tcp://HOST:PORT, waiting at most timeout_ms, or
 * ipc://PATH), closed at once: 0 when something accepts it, else the errno (ECONNREFUSED,
 * ENOENT, ETIMEDOUT, EINVAL for an endpoint of another kind). What a client never connected asks
 * before it waits; for a program that wants the reason without a client. */
TALLY_API int tally_endpoint_probe(const char *endpoint, int timeout_ms);
/* Closes the socket without lingering and frees the client; sets *self_p to NULL. */
TALLY_API void tally_client_destroy(tally_client_t **self_p);
TALLY_API int tally_client_timeout(const tally_client_t *self);

/* Initialises an empty reply; tally_reply_clear frees what a reply holds and empties it. */
TALLY_API void tally_reply_init(tally_reply_t *reply);
TALLY_API void tally_reply_clear(tally_reply_t *reply);

/* Validates and sends one request (req->request_id is ignored: the client allocates one and
 * stores it in *request_id, which may be NULL). Waits at most the timeout for the socket to
 * accept the message. Returns TALLY_OK, a wire status for a request the daemon would reject
 * anyway (bad stream name, flags, payload size: nothing is sent), TALLY_E_TIMEOUT,
 * TALLY_E_TRANSPORT or TALLY_E_ARG. */
TALLY_API tally_status_t tally_send(tally_client_t *self, const tally_req_t *req,
                                    const void *payload, size_t len, uint64_t *request_id);

/* Releases a buffer given to tally_send_zc; called once, possibly from a ZeroMQ I/O thread. */
typedef void(tally_free_fn)(void *data, void *hint);

/* tally_send without copying the payload: ZeroMQ sends straight from `payload` (len > 0),
 * which must stay unchanged until free_fn(payload, hint) is called. That happens exactly
 * once on every path: when the frame has been sent, when the send fails, or at once for a
 * request rejected before sending. free_fn may do nothing, for a buffer that outlives the
 * client and is sent many times (a benchmark's). Saves tally_send's copy of the payload. */
TALLY_API tally_status_t tally_send_zc(tally_client_t *self, const tally_req_t *req, void *payload,
                                       size_t len, tally_free_fn *free_fn, void *hint,
                                       uint64_t *request_id);

/* Receives the next reply, in any order, waiting at most the timeout. *reply is cleared
 * first. Returns the reply's wire status (reply->rep.request_id says which request it
 * answers), or TALLY_E_TIMEOUT, TALLY_E_TRANSPORT, or TALLY_E_REPLY for a reply that does
 * not decode (wrong frame count, magic, version or payload size). */
TALLY_API tally_status_t tally_recv(tally_client_t *self, tally_reply_t *reply);

/* Sends one request and waits for its reply (the timeout covers both). Returns the wire
 * status or a client-side one; reply->error explains any failure. Replies to other requests
 * that arrive meanwhile are discarded, so do not mix it with tally_send requests still in
 * flight on the same client. */
TALLY_API tally_status_t tally_call(tally_client_t *self, const tally_req_t *req,
                                    const void *payload, size_t len, tally_reply_t *reply);

/* The message of the last failed call on this client ("" if none). */
TALLY_API const char *tally_client_error(const tally_client_t *self);

/* ---- Convenience wrappers around tally_call ---------------------------------------------- */

/* Round trip of an empty ping; *rtt_us (may be NULL) receives the round-trip time. */
TALLY_API tally_status_t tally_ping(tally_client_t *self, double *rtt_us);
/* Info (TALLY_OP_INFO) or Prometheus metrics (TALLY_OP_STATS) text, NUL-terminated, malloc'd:
 * free it with free(). */
TALLY_API tally_status_t tally_info(tally_client_t *self, tally_op_t op, char **text);

/* The daemon's info as keys and values (PROTOCOL.md §5 `info`): every `key=value` line, in the
 * daemon's order, keys this library does not know included (later daemons append keys; look
 * keys up by name, never by position). An opaque tally_info_t, freed with tally_info_destroy.
 *   tally_info_fetch: asks the daemon (an `info` request) and parses the reply.
 *   tally_info_parse: parses len bytes of info text (as tally_info returns it). TALLY_E_REPLY
 *     for text the protocol rules out, none of it kept: a line without `=`, a key empty or not
 *     of [a-z0-9_], a key twice, a NUL byte, or a last line without its `\n` (truncated).
 *     Empty text gives no keys. */
typedef struct tally_info tally_info_t;
TALLY_API tally_status_t tally_info_fetch(tally_client_t *self, tally_info_t **out);
TALLY_API tally_status_t tally_info_parse(const char *text, size_t len, tally_info_t **out);
/* Frees the info (NULL is fine) and sets *self_p to NULL. */
TALLY_API void tally_info_destroy(tally_info_t **self_p);
/* How many keys; the i-th key and its value (NULL for i >= count). Valid until destroyed. */
TALLY_API size_t tally_info_count(const tally_info_t *self);
TALLY_API const char *tally_info_key(const tally_info_t *self, size_t i);
TALLY_API const char *tally_info_value(const tally_info_t *self, size_t i);
/* The value of `key`, or NULL when the daemon did not send it (an older daemon). */
TALLY_API const char *tally_info_lookup(const tally_info_t *self, const char *key);
/* The value of `key` as a decimal integer (§5: no sign, no leading zeros, fits a u64) in
 * *value: TALLY_OK, TALLY_E_ARG when the key is absent, TALLY_E_REPLY when its value is not
 * such an integer (*value unchanged on failure). */
TALLY_API tally_status_t tally_info_u64(const tally_info_t *self, const char *key, uint64_t *value);
/* The stream's record (all time). info->bins holds channel c's bins at c x 256 for rgb8/rgba8. */
TALLY_API tally_status_t tally_query(tally_client_t *self, const char *stream,
                                     tally_stream_info_t *info);
/* The stream record of a successful `query` reply taken with tally_recv (queries pipelined with
 * tally_send, as `tally watch` does for many streams at once). TALLY_E_REPLY when the payload
 * is not a record. */
TALLY_API tally_status_t tally_reply_stream_info(const tally_reply_t *reply,
                                                 tally_stream_info_t *info);
/* The stream's record for the last window_ms milliseconds (PROTOCOL.md, "Windows"): the
 * histogram fields count only that window, which runs from *start_ms to *end_ms (ms since the
 * epoch; either may be NULL). TALLY_E_WINDOW when the daemon keeps less than that. */
TALLY_API tally_status_t tally_query_window(tally_client_t *self, const char *stream,
                                            uint64_t window_ms, tally_stream_info_t *info,
                                            uint64_t *start_ms, uint64_t *end_ms);
/* Zeroes the stream's counters, histogram and window and keeps the stream (its histogram's
 * type and range, and its last_seq). */
TALLY_API tally_status_t tally_reset(tally_client_t *self, const char *stream);
/* Removes the stream: the next request naming it starts a new one. */
TALLY_API tally_status_t tally_delete(tally_client_t *self, const char *stream);
/* The daemon's stream names: a malloc'd array of *count malloc'd strings, freed with
 * tally_strings_free. */
TALLY_API tally_status_t tally_streams(tally_client_t *self, char ***names, size_t *count);
/* tally_streams, and *missing: for a client of a fleet (tally_client_new_nats), the partitions
 * whose owner did not answer in time, so that their streams are not in the list (0: the list is
 * whole); always 0 from one tallyd. */
TALLY_API tally_status_t tally_streams_missing(tally_client_t *self, char ***names, size_t *count,
                                               uint32_t *missing);
TALLY_API void tally_strings_free(char **names, size_t count);

/* ---- Shared memory (producers on tallyd's host; PROTOCOL.md §10) ----------------------- */

/* A region of memory shared with tallyd: a sealed memfd mapped here and registered with the
 * daemon over its side channel (found through `info`). Requests then name a range of it instead
 * of carrying the data, and filter and scan may write their output into it. */
typedef struct tally_region tally_region_t;

/* Creates a region of `size` bytes (zero-filled) and registers it with the daemon the client
 * is connected to. Fails with the daemon's status (TALLY_E_QUOTA, ...; tally_client_error says
 * why), TALLY_E_ARG when the daemon offers no shared memory, TALLY_E_IO or TALLY_E_TRANSPORT
 * when the side channel cannot be reached. The client's regions share one side connection; when
 * tallyd has closed it (it registered nothing in time, or was refused), the next registration
 * opens a new one. Destroy regions before their client. On a fleet client
 * (tally_client_new_fleet) the region is made here and registered with each member when the
 * first request naming it goes there (tally_send_shm); over NATS (tally_client_new_nats)
 * TALLY_E_ARG. */
TALLY_API tally_status_t tally_region_create(tally_client_t *client, size_t size,
                                             tally_region_t **out);
/* The region's memory (page-aligned) and size. */
TALLY_API void *tally_region_data(const tally_region_t *region);
TALLY_API size_t tally_region_size(const tally_region_t *region);
/* Releases the region (the daemon unmaps it once the requests using it are answered; a fleet
 * client's: on every member it was registered with) and unmaps it here; sets *region_p to
 * NULL. */
TALLY_API void tally_region_destroy(tally_region_t **region_p);

/* tally_send with the input at [offset, offset + length) of `in` (whole elements; offset a
 * multiple of the element size) instead of a payload. With `out` (filter, scan; NULL for
 * none) the daemon writes the result at out_offset of `out` (aligned to the output element,
 * room for the worst case: filter `length`, scan `length` or 2 x `length` for int64) and the
 * reply carries only its header: count and aux0 as usual, an empty payload. The ranges must
 * stay unchanged (input) and unread (output) until the reply has arrived. On a fleet client
 * the request goes to its stream's owner, the regions registered there first if they are not
 * yet; an owner whose TALLY_ENDPOINTS record does not name this host (host=, the boot id) or a
 * side channel (shm=) cannot take them: TALLY_E_ARG, not sent, tally_client_error naming the
 * member and why (a not_owner follow-up to such a member is answered so). Regions of another
 * client: TALLY_E_ARG. */
TALLY_API tally_status_t tally_send_shm(tally_client_t *self, const tally_req_t *req,
                                        const tally_region_t *in, size_t offset, size_t length,
                                        const tally_region_t *out, size_t out_offset,
                                        uint64_t *request_id);
/* The same, waiting for the reply (as tally_call). A hist (without seq or out) of more than
 * the daemon's max_batch is sent as pieces of at most max_batch bytes (whole elements), up to
 * TALLY_DEFAULT_WINDOW in flight (a piece answered TALLY_E_BUSY is sent again), and `reply` is
 * one reply with their counts summed and aux0 the elements of all; on a stream each piece is one
 * batch. After the first piece that fails no more are sent: the status is that piece's and the
 * error says which piece failed and how many were applied. tally_send_shm always sends one
 * request (over max_batch: TALLY_E_TOO_LARGE). On a fleet client the pieces are of the stream's
 * owner's max_batch (learnt when the region is registered there), each sent to the owner. */
TALLY_API tally_status_t tally_call_shm(tally_client_t *self, const tally_req_t *req,
                                        const tally_region_t *in, size_t offset, size_t length,
                                        const tally_region_t *out, size_t out_offset,
                                        tally_reply_t *reply);

/* ---- Device memory (producers whose data is on a GPU; PROTOCOL.md §10 "Device memory") -- */

/* Registration flags: the region may be written (an output region: a filter's or scan's output
 * goes there when tally_send_shm names it as `out`, and the reply carries only its header), and
 * `ipc_event` is an IPC event handle tallyd waits on before it reads (or writes). */
#define TALLY_GPU_OUTPUT 0x2u
#define TALLY_GPU_EVENT 0x1u

/* Registers device memory exported as a descriptor (fd: cuMemExportToShareableHandle with
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; size its whole allocation) on the GPU with `uuid`
 * (16 bytes, cuDeviceGetUuid), optionally with `ipc_event` (64 bytes, cudaIpcGetEventHandle of an
 * event created with cudaEventInterprocess | cudaEventDisableTiming; flag TALLY_GPU_EVENT). The
 * descriptor stays the caller's (tallyd receives its own copy). tally_region_data is
 * `device_ptr` (never read by libtally). Requests name it with tally_send_shm / tally_call_shm
 * as any region; tally_region_destroy releases it. tallyd's refusals come back as TALLY_E_BAD_REF
 * with tally_client_error saying why (a GPU is needed, no GPU with that UUID, not an exported
 * allocation, a wrong size). */
TALLY_API tally_status_t tally_gpu_register_fd(tally_client_t *client, int fd, size_t size,
                                               const uint8_t uuid[16], unsigned flags,
                                               const void *ipc_event, void *device_ptr,
                                               tally_region_t **out);

/* Exportable device memory from libtally (tally_gpu.c): libcuda.so.1 is opened at run time
 * (dlopen), so libtally never depends on CUDA; without it these return TALLY_E_ARG and
 * tally_gpu_error says so. Tests only: with TALLY_TEST_SIM_GPU=1 in the environment an
 * allocation is a sealed memfd on simulated GPU `device`, for a tallyd with --test-sim-gpus. */
typedef struct tally_gpu_mem tally_gpu_mem_t;
/* Allocates at least `size` bytes on CUDA device `device` (rounded up to the allocation
 * granularity), exportable as a descriptor, mapped read-write for that device in this process;
 * its context is the device's primary context. */
TALLY_API tally_status_t tally_gpu_alloc(int device, size_t size, tally_gpu_mem_t **out);
/* The device address (a CUdeviceptr) and the size after rounding. */
TALLY_API void *tally_gpu_ptr(const tally_gpu_mem_t *mem);
TALLY_API size_t tally_gpu_size(const tally_gpu_mem_t *mem);
/* Registers it with the client's tallyd (tally_gpu_register_fd with its descriptor, size and
 * device UUID). */
TALLY_API tally_status_t tally_gpu_register(tally_client_t *client, const tally_gpu_mem_t *mem,
                                            unsigned flags, const void *ipc_event,
                                            tally_region_t **out);
/* Copies len bytes from host memory into the allocation at offset, or out of it
 * (cuMemcpyHtoD / DtoH, synchronous: done when they return). TALLY_E_ARG for a range outside
 * it; TALLY_E_BACKEND when the driver fails (tally_gpu_error says why). */
TALLY_API tally_status_t tally_gpu_copy_to(tally_gpu_mem_t *mem, size_t offset, const void *src,
                                           size_t len);
TALLY_API tally_status_t tally_gpu_copy_from(const tally_gpu_mem_t *mem, size_t offset, void *dst,
                                             size_t len);
/* Unmaps and frees it here (tallyd holds its own reference until it releases the region);
 * sets *mem_p to NULL. */
TALLY_API void tally_gpu_free(tally_gpu_mem_t **mem_p);
/* Why the last tally_gpu_alloc failed (this thread). */
TALLY_API const char *tally_gpu_error(void);

/* ---- Chunked, pipelined operations ------------------------------------------------------- */

/* A growable output buffer. Start from {0}; tally_buf_free releases it. */
typedef struct {
    uint8_t *data;
    size_t len;
    size_t cap;
} tally_buf_t;

TALLY_API void tally_buf_free(tally_buf_t *buf);
TALLY_API tally_status_t tally_buf_reserve(tally_buf_t *buf, size_t extra);
TALLY_API tally_status_t tally_buf_append(tally_buf_t *buf, const void *data, size_t len);
/* Appends printf-formatted text (without its terminating NUL, which is kept in the buffer just
 * past len, so buf->data is a C string after any printf). */
TALLY_API tally_status_t tally_buf_printf(tally_buf_t *buf, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

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

#define TALLY_RUN_SHM_HOST 1
#define TALLY_RUN_SHM_GPU 2

typedef struct {
    size_t chunk_bytes; /* 0: TALLY_DEFAULT_CHUNK_BYTES; rounded down to whole elements */
    unsigned window;    /* requests in flight; 0: TALLY_DEFAULT_WINDOW; at most TALLY_MAX_WINDOW */
    int shm; /* non-zero: send the chunks through a shared-memory region used as a ring of
              * `window` slices (tally_region_create), filter and scan output through a second
              * ring in the same region; same output as without. TALLY_RUN_SHM_GPU: the region
              * is device memory (tally_gpu_alloc on GPU 0, registered with TALLY_GPU_OUTPUT):
              * each chunk is copied to the GPU and sent by device reference, the output copied
              * back; for tests of the device path (tally --gpu-region) */
    tally_run_seq_t seq; /* with a stream only; TALLY_RUN_SEQ_OFF without one */
    uint64_t seq_base;   /* TALLY_RUN_SEQ_RESUME: the base the push started with */
    /* tally_push_new: the input's size in bytes when known in advance (a file), else 0. It
     * sizes the window for short inputs and gives result->input_chunks from the start. */
    uint64_t total_bytes;
} tally_run_opts_t;

/* What tally_run learnt besides the output. */
typedef struct {
    uint64_t chunks;     /* requests sent */
    uint64_t elements;   /* input elements */
    uint64_t count;      /* output elements (filter: kept; scan: elements; hist: values) */
    uint64_t seen;       /* filter: elements seen */
    int64_t carry;       /* scan: running total after the last element (stream or not) */
    uint64_t hist_total; /* hist: elements histogrammed */
    /* Without sequence numbers, `applied` is the chunks acknowledged, in order.
     * With sequence numbers: chunk k was sent as seq seq_base + 1 + k; `applied` chunks of the
     * input are in the stream (all of them on success; on failure the stream's last_seq minus
     * seq_base, as the daemon reported it in a duplicate or sequence_gap reply, or as the
     * replies show it (chunk k failed after every chunk before it was answered ok: k), or from
     * a query after the failure, or, when it could not be asked, the chunks acknowledged), of
     * which `skipped`
     * were applied before this call (TALLY_RUN_SEQ_RESUME) and not sent; last_seq is the
     * stream's last_seq as far as known (seq_base + applied). A chunk is never counted twice. */
    uint64_t input_chunks; /* chunks the input is cut into (set once sequence numbers are known) */
    uint64_t seq_base;
    uint64_t applied;
    uint64_t skipped;
    uint64_t last_seq;
    bool applied_known; /* false: the daemon could not be asked; applied is a lower bound */
    uint64_t bytes;     /* input bytes written (sent or skipped) */
    /* Input bytes of the `applied` chunks (the first `applied` of the input), from the same
     * count; UINT64_MAX when not known: the daemon holds fewer chunks than it acknowledged and
     * the lengths of those were let go (more than 4096 short chunks ago, a live input). */
    uint64_t applied_bytes;
    tally_status_t status;
    char error[TALLY_ERROR_MESSAGE_MAX + 1]; /* why it failed, "" on success */
} tally_run_result_t;

/* Runs a filter, scan, hist or minmax request `req` (its stream, predicate, flags, dtype, range)
 * over `input` (`len` bytes, a whole number of elements, any size, even 0), in chunks of
 * opts->chunk_bytes with at most opts->window requests in flight, and appends to `out`
 * exactly what one request with the whole input would have produced:
 *   filter: the kept elements (input dtype), in input order (chunk replies are put in chunk
 *           order, so stable mode stays stable);
 *   scan:   n int64 (or int32 with TALLY_FLAG_SCAN_OUT_I32) prefix sums. Without a stream,
 *           each chunk is scanned from 0 and the client adds the total of the chunks before
 *           it (wrapping), so chunks still pipeline; with a stream the daemon carries;
 *   hist:   tally_hist_values(dtype) uint64 counts (u8 256; i32, u16 258: bins, underflow,
 *           overflow; rgb8 768, rgba8 1024: 256 per channel) of this input,
 *           summed over chunks (with a stream, the stream's running histogram grows too);
 *   minmax: two elements of the input's dtype (i32, u8, u16), its smallest and its largest;
 *           nothing for an empty input.
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
TALLY_API tally_status_t tally_run(tally_client_t *self, const tally_req_t *req, const void *input,
                                   size_t len, const tally_run_opts_t *opts, tally_buf_t *out,
                                   tally_run_result_t *result);

/* The smallest and largest of `len` bytes of elements of dtype (i32, u8 or u16) at input, with
 * one `minmax` request per chunk (tally_run, default options). An empty input gives
 * *min = INT64_MAX and *max = INT64_MIN (min > max: no element). */
TALLY_API tally_status_t tally_minmax(tally_client_t *self, tally_dtype_t dtype, const void *input,
                                      size_t len, int64_t *min, int64_t *max);

/* ---- Streaming pushes ---------------------------------------------------------------- */

/* A push is tally_run for an input that is not in memory as a whole (a pipe, a live sensor, a
 * file larger than memory): the caller writes it chunk by chunk, the push keeps opts->window
 * chunks in flight, and each chunk's output goes to an output function, in input order, as
 * soon as the chunks before it have been answered. Memory stays bounded by the window: about
 * window x (chunk + its output), whatever the input's length (and at most 64 KiB for the lengths
 * of short chunks, which say how many bytes the applied chunks hold).
 *
 *   tally_push_t *push;
 *   tally_push_new(client, &req, &opts, write_out, file, &push);
 *   while ((n = read_chunk(buf, tally_push_chunk_bytes(push))) > 0)
 *       if (tally_push_write(push, buf, n) != TALLY_OK)
 *           break;
 *   tally_push_finish(push);   (waits for every reply; result says what was applied)
 *   tally_push_destroy(&push);
 *
 * The output function gets filter's kept elements and scan's sums chunk by chunk, and hist's
 * summed counts and minmax's two values once, from tally_push_finish. Its data is valid during the
 * call only. A status other than TALLY_OK from it stops the push with that status. */
typedef struct tally_push tally_push_t;
typedef tally_status_t(tally_output_fn)(void *arg, const void *data, size_t len);

/* Starts a push of `req` (filter, scan, hist or minmax) with `opts` as for tally_run (NULL for the
 * defaults); with opts->seq it asks the daemon for the stream's last_seq first. `output` may
 * be NULL (filter --count: only the result's counters). */
TALLY_API tally_status_t tally_push_new(tally_client_t *client, const tally_req_t *req,
                                        const tally_run_opts_t *opts, tally_output_fn *output,
                                        void *arg, tally_push_t **out);
/* The largest chunk tally_push_write takes: opts->chunk_bytes in whole elements. */
TALLY_API size_t tally_push_chunk_bytes(const tally_push_t *push);
/* Sends one chunk: `len` bytes, whole elements, at most tally_push_chunk_bytes (an empty
 * chunk is a request too). The data is copied: the buffer is free again on return. Waits
 * (merging replies) while the window is full. A chunk that breaks those rules is refused with
 * TALLY_E_ARG (tally_client_error says why) and the push goes on; after any other failure
 * every call returns it. */
TALLY_API tally_status_t tally_push_write(tally_push_t *push, const void *data, size_t len);
/* Waits until every chunk written so far is answered and its output handed over (a live
 * producer that pauses: its results go out now rather than with the next chunk). */
TALLY_API tally_status_t tally_push_flush(tally_push_t *push);
/* Waits for the replies still outstanding and hands hist's counts to the output function.
 * Returns the push's status; tally_push_result then says what was applied. Call it after a
 * failed write too, to learn how much the stream holds. */
TALLY_API tally_status_t tally_push_finish(tally_push_t *push);
/* The counters so far (complete after tally_push_finish); valid until destroy. */
TALLY_API const tally_run_result_t *tally_push_result(const tally_push_t *push);
TALLY_API void tally_push_destroy(tally_push_t **push_p);

/* ---- Subscriptions (tally_sub.c; PROTOCOL.md §11) ---------------------------------------- */

/* A SUB socket on tallyd's PUB endpoint (tallyd --pub): every publication interval, the record
 * of each stream that changed, and a message for each stream deleted. */
typedef struct tally_sub tally_sub_t;

/* One publication. */
typedef struct {
    tally_pub_t pub;                        /* kind, pub_seq (a gap = lost), time_ms, interval */
    char stream[TALLY_STREAM_NAME_MAX + 1]; /* the topic: the stream's name */
    tally_stream_info_t info;               /* TALLY_PUB_UPDATE: the record, as `query` gives it */
} tally_pub_msg_t;

/* Connects (asynchronously, reconnecting by itself) to a PUB endpoint; nothing arrives until
 * tally_sub_subscribe. A plain connection; tally_sub_new_curve (below, with the CURVE keys)
 * subscribes to a daemon with CURVE on. */
TALLY_API tally_status_t tally_sub_new(const char *endpoint, tally_sub_t **out);
TALLY_API void tally_sub_destroy(tally_sub_t **self_p);
/* Receives the streams whose names start with `prefix` ("" for all; a prefix also matches
 * longer names, so check msg->stream for an exact one). May be called several times. */
TALLY_API tally_status_t tally_sub_subscribe(tally_sub_t *self, const char *prefix);
/* The next publication, waiting up to timeout_ms (0: only what has arrived). TALLY_E_TIMEOUT
 * when none came, TALLY_E_REPLY for a message that does not decode (it is consumed). */
TALLY_API tally_status_t tally_sub_recv(tally_sub_t *self, int timeout_ms, tally_pub_msg_t *msg);
/* A descriptor to poll() for POLLIN beside others. It is edge-triggered (ZMQ_FD): once it
 * fires, call tally_sub_recv(self, 0, ...) until TALLY_E_TIMEOUT before polling again. */
TALLY_API int tally_sub_fd(const tally_sub_t *self);

/* ---- Histogram summaries (tally_hist.c) --------------------------------------------------- */

/* One 256-bin histogram as tallyd keeps it: a stream's running histogram, or one channel of an
 * rgb8/rgba8 stream's (tally_hist_from_info). Every histogram counts integers:
 *   u8 (and each colour channel): bin b holds the value b (lo = 0, hi = 256, no underflow or
 *        overflow);
 *   i32, u16: x in [lo, hi) goes to bin (x - lo) * 256 / (hi - lo) (tally_hist_bin_i32), so
 *        bin b holds the integers [edge(b), edge(b + 1)) with edge(b) = lo + ceil(b * (hi - lo)
 *        / 256) (tally_hist_edge); x < lo counts as underflow, x >= hi as overflow. When
 *        hi - lo < 256 some bins hold no integer at all (edge(b) == edge(b + 1)) and stay empty.
 * The underflow and overflow entries cover the rest of the type's domain: [INT32_MIN, lo) and
 * [hi, INT32_MAX + 1) for i32, [0, lo) and [hi, 65536) for u16. */
typedef struct {
    tally_dtype_t dtype; /* TALLY_DTYPE_U8, TALLY_DTYPE_I32 or TALLY_DTYPE_U16 */
    int64_t lo, hi;      /* the range [lo, hi); u8: 0 and 256 */
    uint64_t bins[TALLY_HIST_BINS];
    uint64_t underflow, overflow;
} tally_hist_t;

/* A quantile estimated from the bins (see tally_hist_quantile for the rule). */
typedef struct {
    int64_t value; /* the estimate; below range: lo, above range: hi */
    int side;      /* 0 in range; -1 the quantile is an underflow value (< lo), +1 an
                    * overflow value (>= hi): `value` is then only the nearest edge */
} tally_quantile_t;

/* What an analyst asks of a histogram first. */
typedef struct {
    uint64_t count;    /* all values: bins + underflow + overflow */
    uint64_t in_range; /* values in the 256 bins */
    uint64_t underflow, overflow;
    /* Mean of the in-range values, each taken as the centre of its bin's integers
     * ((edge(b) + edge(b + 1) - 1) / 2, so exact for u8); NaN when in_range is 0. */
    double mean;
    int min_bin, max_bin; /* the lowest and highest non-empty bin; -1 when in_range is 0 */
    tally_quantile_t p50, p90, p99; /* valid when count > 0 */
} tally_hist_summary_t;

/* Fills *hist with channel `channel` of a stream's record (a query reply or a publication):
 * channel 0 for u8, i32 and u16 streams; 0..2 (R, G, B) for rgb8, 0..3 for rgba8 (A last); see
 * tally_hist_channels. TALLY_E_ARG when the stream has no histogram yet (hist_dtype is
 * TALLY_DTYPE_NONE), for an unknown type or a channel it does not have. */
TALLY_API tally_status_t tally_hist_from_info(const tally_stream_info_t *info, unsigned channel,
                                              tally_hist_t *hist);

/* The lower edge of bin b (0 <= b <= 256; edge(256) = hi): the smallest integer in the bin. */
TALLY_API int64_t tally_hist_edge(const tally_hist_t *hist, unsigned b);

/* The q-quantile (0 <= q <= 1, taken to the nearest millionth) of the values counted, estimated
 * from the bins. The rule: of the N values (underflow and overflow included) take the one of
 * rank r = max(1, ceil(q * N)) in increasing order (the "nearest rank" definition, exact on the
 * raw data). If it is an underflow value the answer is lo with side -1, an overflow value hi
 * with side +1. Otherwise it is the j-th of the c values of bin b, whose w integers start at
 * edge(b), and the values of a bin are taken as spread evenly over its integers:
 *     estimate = edge(b) + floor((2j - 1) * w / (2c))
 * (the centre of the j-th of c equal slices of the bin, rounded down to an integer). The
 * estimate is always in the same bin as the true quantile; for u8 (w = 1) it is exact.
 * TALLY_E_ARG when q is outside [0, 1] or the histogram is empty. */
TALLY_API tally_status_t tally_hist_quantile(const tally_hist_t *hist, double q,
                                             tally_quantile_t *out);

/* Count, mean, min/max non-empty bin, p50/p90/p99, underflow and overflow. */
TALLY_API void tally_hist_summarize(const tally_hist_t *hist, tally_hist_summary_t *out);

/* The most quantiles one JSON or CSV rendering takes, and the room a quantile's name needs. */
#define TALLY_QUANTILES_MAX 64
#define TALLY_QUANTILE_NAME_MAX 16

/* The name of quantile q (0 <= q <= 1, taken to the nearest millionth) in summaries: "p" and
 * 100 q with at most four decimals and no trailing zeros: 0.5 "p50", 0.999 "p99.9", 0.000001
 * "p0.0001", 1 "p100". buf holds at least TALLY_QUANTILE_NAME_MAX bytes. TALLY_E_ARG for a q
 * outside [0, 1]. */
TALLY_API tally_status_t tally_quantile_name(double q, char *buf, size_t cap);
/* A quantile's side (tally_quantile_t.side) as the JSON and CSV give it: "underflow" (-1),
 * "in_range" (0), "overflow" (+1). */
TALLY_API const char *tally_quantile_side_name(int side);

/* Appends the histogram as the members of a JSON object (no braces, so a caller can add its own
 * members such as a stream or channel name around them):
 *   "count":N,"in_range":N,"underflow":N,"overflow":N,"mean":X|null,
 *   "min":{"bin":B,"lo":L,"hi":H}|null,"max":{...}|null,
 *   "quantiles":{"p50":{"q":0.5,"value":V,"side":S},"p90":{...},"p99":{...}}|null,
 *   "bins":[{"lo":L,"hi":H,"count":N},...]
 * `mean` is the mean of the in_range values only. `quantiles` is null when count is 0; each
 * member is named by tally_quantile_name, `q` is the quantile (to the nearest millionth),
 * `value` its estimate (tally_hist_quantile) and `side` "in_range", or "underflow" (the
 * quantile is an underflow value, `value` is lo) or "overflow" (an overflow value, `value` is
 * hi). `bins` lists the real integer edges, hi exclusive, in increasing order: for u8 the 256
 * byte values; for i32 and u16 an underflow entry, the 256 bins, then an overflow entry
 * (258). */
TALLY_API tally_status_t tally_hist_json(const tally_hist_t *hist, tally_buf_t *out);
/* The same with the quantiles qs[0..n) (each in [0, 1], n <= TALLY_QUANTILES_MAX), in that
 * order, instead of p50, p90 and p99 (tally_hist_json is this with 0.5, 0.9, 0.99). Give each
 * quantile once: two that round to the same millionth would share a name. TALLY_E_ARG for a
 * quantile outside [0, 1] or too many. */
TALLY_API tally_status_t tally_hist_json_quantiles(const tally_hist_t *hist, const double *qs,
                                                   size_t n, tally_buf_t *out);

/* Appends the bins as CSV rows "lo,hi,count,kind" (the same entries as the JSON `bins`; kind
 * is "underflow", "bin" or "overflow"), each preceded by "label," when label is not NULL; with
 * `header`, first the line "lo,hi,count,kind" (or "channel,lo,hi,count,kind" with a label). */
TALLY_API tally_status_t tally_hist_csv(const tally_hist_t *hist, const char *label, bool header,
                                        tally_buf_t *out);
/* Appends the quantiles qs[0..n) as CSV rows "quantile,q,value,side" (name, q, estimate and
 * side as in the JSON; value and side empty for an empty histogram), each preceded by "label,"
 * when label is not NULL; with `header`, first "quantile,q,value,side" (or
 * "channel,quantile,q,value,side"). TALLY_E_ARG as tally_hist_json_quantiles. */
TALLY_API tally_status_t tally_hist_csv_quantiles(const tally_hist_t *hist, const char *label,
                                                  bool header, const double *qs, size_t n,
                                                  tally_buf_t *out);

/* A stream's record as one JSON object (tally_json.c): what `tally query --json` prints and
 * tallyd's HTTP API serves (GET /api/v1/streams/NAME), one rendering for both. The schema is
 * web/schema/stream.json:
 *   {"stream":NAME,"type":"u8"|"i32"|"u16"|"rgb8"|"rgba8"|null,["lo":L,"hi":H,] (i32, u16)
 *    "batches":N,"elements":N,"bytes":N,"filter_seen":N,"filter_kept":N,"scan_carry":N,
 *    "scan_elements":N,"hist_total":N,"last_seq":N,["window":{"start_ms":T,"end_ms":T},]
 *    then the members of tally_hist_json_quantiles (one channel), or
 *    "channels":[{"channel":"r",...},...] (rgb8, rgba8), or for a stream without a histogram
 *    "count":0,"mean":null,"quantiles":null,"bins":[]}
 * with no line break. */
typedef struct {
    const char *name;
    const tally_stream_info_t *info;
    uint64_t window_start_ms, window_end_ms; /* a window query's interval; 0, 0 for all time */
    const double *quantiles;                 /* NULL (nquantiles 0): p50, p90, p99 */
    size_t nquantiles;
} tally_stream_view_t;

/* Appends the record; TALLY_E_ARG for an unknown histogram type or bad quantiles. */
TALLY_API tally_status_t tally_stream_json(const tally_stream_view_t *view, tally_buf_t *out);
/* Appends str as a JSON string: quoted, '"' and backslash escaped, control characters as \u00XX
 * (a stream name, printable ASCII, needs only the first two). */
TALLY_API tally_status_t tally_json_string(const char *str, tally_buf_t *out);

/* ---- CURVE: authentication and encryption (PROTOCOL.md §12) ------------------------------ */

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
TALLY_API tally_status_t tally_curve_keys_load(const char *server_key, const char *client_key,
                                               tally_curve_keys_t *keys, char *msg, size_t msg_cap);

/* The same for a fleet client (tally_client_new_fleet_curve), whose members publish their own
 * server keys (curve= in TALLY_ENDPOINTS, PROTOCOL.md §13): the client's key pair is loaded
 * whenever one is given (client_key, $TALLY_CLIENT_KEY, client_key in tally.conf), with or
 * without a server key; a server key given is kept in server_public (every member must then
 * publish that one). No client key anywhere: all three "" (plain connections) and TALLY_OK when
 * no server key is given either; a server key without a client key is TALLY_E_ARG (a pinned
 * key needs the pair to be used), as are a malformed key and a readable secret key file (msg
 * says which; TALLY_E_IO for a file that cannot be read). */
TALLY_API tally_status_t tally_curve_client_keys_load(const char *server_key,
                                                      const char *client_key,
                                                      tally_curve_keys_t *keys, char *msg,
                                                      size_t msg_cap);

/* Makes a new CURVE key pair and writes it as two key files (CZMQ's certificate format):
 * BASE.key holds both halves (mode 0600: the client's --client-key, or tallyd's
 * curve_secret_key) and BASE.pub the public half (for the other side: a client's goes into
 * tallyd's curve_clients_dir, the server's to its clients). Existing files are not overwritten,
 * and a directory that does not exist is not made (TALLY_E_IO, msg naming it and the mkdir).
 * public_key (may be NULL) receives the public key. */
TALLY_API tally_status_t tally_keygen(const char *base, char public_key[41], char *msg,
                                      size_t msg_cap);

/* tally_client_new for a daemon with CURVE on: keys from tally_curve_keys_load (NULL, or an
 * empty server_public: a plain connection, as tally_client_new). A daemon that does not accept
 * the keys (an unknown client key, a wrong server key) never answers: requests end in
 * TALLY_E_TIMEOUT, and the daemon logs and counts the refusal. TALLY_E_ARG for keys that are not
 * 40 characters of Z85. */
TALLY_API tally_status_t tally_client_new_curve(const char *endpoint, int timeout_ms,
                                                const tally_curve_keys_t *keys,
                                                tally_client_t **out);
/* tally_client_new_curve (keys may be NULL) that says why it failed in msg (msg_cap bytes; may
 * be NULL): TALLY_E_ARG "invalid endpoint '127.0.0.1:5555': unsupported transport (use
 * tcp://HOST:PORT or ipc://PATH)", a bad timeout or keys; TALLY_E_TRANSPORT, TALLY_E_NOMEM. The
 * CLI and the Python binding make their clients with it. */
TALLY_API tally_status_t tally_client_open(const char *endpoint, int timeout_ms,
                                           const tally_curve_keys_t *keys, tally_client_t **out,
                                           char *msg, size_t msg_cap);

/* tally_sub_new for a daemon with CURVE on: keys as for tally_client_new_curve (from
 * tally_curve_keys_load; NULL or an empty server_public: plain). tallyd's PUB socket admits the
 * clients its request endpoint admits (PROTOCOL.md §12); a subscriber it does not admit (no
 * keys, an unknown client key, a wrong server key) connects but receives nothing: tally_sub_recv
 * ends in TALLY_E_TIMEOUT, and the daemon logs and counts an unknown key's refusal. TALLY_E_ARG
 * for keys that are not 40 characters of Z85. */
TALLY_API tally_status_t tally_sub_new_curve(const char *endpoint, const tally_curve_keys_t *keys,
                                             tally_sub_t **out);

/* ---- NATS JetStream: producing to a tallyd fleet (tally_nats.c; PROTOCOL.md §13) --------- */

/* A producer for a fleet of tallyd workers on NATS JetStream: each request is published to its
 * stream's partition (tally_partition) with a dedupe id, and the results a request asks for come
 * back on the producer's own reply subject. Publishing is pipelined: tally_nats_send returns once
 * its messages are handed to NATS (waiting only while more than window_bytes await their
 * PubAck), tally_nats_flush waits until JetStream has acknowledged every one. A message whose
 * PubAck does not come (a timeout, a stream leader being elected, a full partition) is published
 * again with the same dedupe id, so JetStream stores it once. Not thread-safe: one per thread. */
typedef struct tally_nats tally_nats_t;

typedef struct {
    const char *servers;     /* comma-separated URLs ("nats://h1:4222,tls://h2:4222"); NULL:
                              * nats://127.0.0.1:4222. A user and password, or a token, may be
                              * in a URL ("nats://user:pw@host:4222") */
    const char *credentials; /* a .creds file (user JWT and nkey seed); NULL: none */
    const char *nkey;        /* a user nkey ("U..."), with nkey_seed: the file holding its seed */
    const char *nkey_seed;
    const char *tls_ca;   /* a CA file (PEM): TLS, with the server's certificate checked */
    const char *tls_cert; /* a client certificate and key (PEM), where the server asks */
    const char *tls_key;
    const char *producer_id; /* the dedupe ids' prefix after the user, 1..64 of A-Z a-z 0-9 - _;
                              * NULL: 16 random hex digits. Fixed, it is guessable: another user
                              * who publishes its ids first makes its messages vanish as
                              * duplicates (PROTOCOL.md §13 "Security"); two producers of one
                              * user with one id dedupe each other */
    int timeout_ms;          /* every wait: connecting, a PubAck (then a resend), a reply;
                              * 0: TALLY_DEFAULT_TIMEOUT_MS */
    uint32_t partitions;     /* 0: the fleet's (read from NATS, where a worker wrote it) */
    size_t window_bytes;     /* message bytes awaiting a PubAck before a send waits; 0: 32 MiB */
    const char *user;        /* the NATS user the fleet knows this producer as (its subjects end
                              * in it, its inboxes are _INBOX.<user>.…, its ids begin with it);
                              * NULL: the user in the first URL that has one, else "anon" */
} tally_nats_opts_t;

typedef struct {
    uint64_t sent;            /* messages published (chunks of a split batch count each) */
    uint64_t acked;           /* PubAcks received: stored, or duplicates */
    uint64_t duplicates;      /* PubAcks that said "duplicate": the stream had that id already */
    uint64_t resent;          /* publishes again after a failed or missing PubAck */
    uint64_t failed;          /* messages the stream refused for good (larger than it takes) */
    uint64_t pending;         /* messages still without a PubAck */
    uint64_t replies_dropped; /* replies not awaited: an answer again after a worker's take-over */
    uint64_t collisions; /* messages of a random producer id that another producer's message had
                          * taken the id of: published again under a fresh id */
} tally_nats_stats_t;

/* Connects and reads the fleet's partition count. TALLY_E_ARG (a malformed option, no fleet
 * yet), TALLY_E_TRANSPORT (no server accepts the connection); msg (may be NULL) says why. */
TALLY_API tally_status_t tally_nats_new(const tally_nats_opts_t *opts, tally_nats_t **out,
                                        char *msg, size_t msg_cap);
/* Closes the connection: messages still without a PubAck are not waited for (flush first). */
TALLY_API void tally_nats_destroy(tally_nats_t **self_p);
TALLY_API uint32_t tally_nats_partitions(const tally_nats_t *self);
/* The server's max_payload: the largest message, headers included. */
TALLY_API size_t tally_nats_max_payload(const tally_nats_t *self);
TALLY_API const char *tally_nats_producer_id(const tally_nats_t *self);
/* The message of the last failure ("" if none). */
TALLY_API const char *tally_nats_error(const tally_nats_t *self);
TALLY_API void tally_nats_stats(tally_nats_t *self, tally_nats_stats_t *out);

/* Publishes a filter, scan, hist, reset or delete request (checked as tally_send checks it) to
 * its partition. A payload larger than one message takes is cut into several requests of whole
 * elements on the same stream (chunk i carries req->seq + i when req->seq is set), each its own
 * message; with want_reply, small enough that the reply fits a message too. A scan without a
 * stream is refused when it would need cutting. The requests get request ids first_id,
 * first_id + 1, ... (*chunks of them; both may be NULL): with want_reply their replies come to
 * tally_nats_recv. Returns once every message is handed to NATS, or TALLY_E_TIMEOUT when the
 * window stayed full for the timeout (the messages before stay queued). */
TALLY_API tally_status_t tally_nats_send(tally_nats_t *self, const tally_req_t *req,
                                         const void *payload, size_t len, bool want_reply,
                                         uint64_t *first_id, uint64_t *chunks);
/* Waits until every message sent has its PubAck, publishing again those whose PubAck failed.
 * TALLY_E_TIMEOUT when some still have none after the timeout: they stay queued and the next
 * flush sends them again (JetStream dedupes an id for 2 minutes after its first publish). */
TALLY_API tally_status_t tally_nats_flush(tally_nats_t *self);
/* The next reply to a request sent with want_reply, each request's once, in any order (match
 * reply->rep.request_id), waiting up to timeout_ms (0: the producer's timeout). Returns the
 * reply's status, or TALLY_E_TIMEOUT, TALLY_E_TRANSPORT, TALLY_E_REPLY. */
TALLY_API tally_status_t tally_nats_recv(tally_nats_t *self, int timeout_ms, tally_reply_t *reply);

/* A query of a stream (its partition's owner answers), or ping, info, stats (one worker
 * answers), by NATS request-reply; the reply as tally_call gives it. While nobody answers (a
 * partition between two owners) it asks again until the timeout (TALLY_E_TIMEOUT). */
TALLY_API tally_status_t tally_nats_call(tally_nats_t *self, const tally_req_t *req,
                                         const void *payload, size_t len, tally_reply_t *reply);
/* The stream's record, as tally_query. */
TALLY_API tally_status_t tally_nats_query(tally_nats_t *self, const char *stream,
                                          tally_stream_info_t *info);
/* The same, answered by the owner or, where one holds a copy, a standby (issue 33; PROTOCOL.md
 * §13 "Answers by request-reply"): whichever answers first, also while the partition has no
 * owner. *stale: 0 when the owner answered, else the last changelog sequence of the partition the
 * standby's copy had applied (1 when that was 0): the record may lag the owner's by what was
 * written since. */
TALLY_API tally_status_t tally_nats_query_stale(tally_nats_t *self, const char *stream,
                                                tally_stream_info_t *info, uint64_t *stale);
/* The fleet's streams: every worker's, each name once; freed with tally_strings_free. Gathered
 * until the answers cover every partition (each says which partitions it lists: Tally-Owned),
 * or the timeout; a partition no answer covered is counted in tally_nats_streams_missing, and
 * its streams are not in the list. */
TALLY_API tally_status_t tally_nats_streams(tally_nats_t *self, char ***names, size_t *count);
/* The partitions the last tally_nats_streams heard no owner for (0: its list was whole). */
TALLY_API uint32_t tally_nats_streams_missing(const tally_nats_t *self);

/* A subscription to a fleet's histogram publications (PROTOCOL.md §13 "Histogram
 * publications"; the NATS user needs `tally.watch.>`), on nats's connection: destroy it before
 * nats. Each stream named subscribes its partition's tally.watch.<k> (once per partition), so
 * the other streams of those partitions come too: check msg->stream. What arrives is queued
 * (at most 64 MiB; beyond it the oldest are dropped, counted by tally_nats_sub_dropped). */
typedef struct tally_nats_sub tally_nats_sub_t;
TALLY_API tally_status_t tally_nats_sub_new(tally_nats_t *nats, tally_nats_sub_t **out);
TALLY_API tally_status_t tally_nats_sub_stream(tally_nats_sub_t *self, const char *stream);
/* The next publication, waiting up to timeout_ms (0: only what has arrived): as tally_sub_recv
 * (msg->pub.kind is TALLY_PUB_UPDATE; pub_seq counts per worker run). TALLY_E_TIMEOUT when none
 * came, TALLY_E_REPLY for a message that does not decode (it is consumed). */
TALLY_API tally_status_t tally_nats_sub_recv(tally_nats_sub_t *self, int timeout_ms,
                                             tally_pub_msg_t *msg);
/* A descriptor to poll() for POLLIN: readable while publications wait. */
TALLY_API int tally_nats_sub_fd(const tally_nats_sub_t *self);
TALLY_API uint64_t tally_nats_sub_dropped(const tally_nats_sub_t *self);
TALLY_API void tally_nats_sub_destroy(tally_nats_sub_t **self_p);

/* A client of a fleet instead of one tallyd (PROTOCOL.md §13 "A client over NATS"): the same
 * tally_send, tally_recv, tally_call, tally_run, pushes and wrappers, over NATS. filter, scan,
 * hist, reset and delete are published to their partition, each request one message with a
 * reply subject (a payload over one message is refused, TALLY_E_TOO_LARGE; pushes and tally_run
 * cut their chunks to fit); query, ping, info and stats go by request-reply; `streams` gathers
 * every worker's. Shared-memory and device regions are refused (TALLY_E_ARG). Errors as
 * tally_nats_new. */
TALLY_API tally_status_t tally_client_new_nats(const tally_nats_opts_t *opts, tally_client_t **out,
                                               char *msg, size_t msg_cap);

/* A client of a fleet in direct mode (PROTOCOL.md §13 "Direct mode"; tallyd's [nats] direct =
 * local or replicated): the same calls, each request sent over ZeroMQ straight to the member that
 * owns its stream's partition (tally_partition; the owner from TALLY_LEASES, its endpoint from
 * TALLY_ENDPOINTS, read through NATS at opts->servers). A `not_owner` answer is followed to the
 * owner it names (up to 8 hops); one that names none (a member still taking the partition over)
 * goes again to the owner the buckets name, every 200 ms within the timeout; a `shutdown` answer, a
 * numbered request's `not_durable` (its changelog record not stored: the owner gives the partition
 * up), or no answer from an owner that has since been replaced, is sent again to the partition's
 * next owner once it has taken over, when the request is numbered (`seq`: applied once) or only
 * reads; an unnumbered write that lost its owner is answered TALLY_E_TRANSPORT (it may or may not
 * have been applied). Whatever sends them again, a stream's requests reach each member in the order
 * they were first sent. An owner whose connection does not come up within 1 s (it exited) is not
 * waited on for the timeout: the routing is read again and the request, not yet sent, goes to the
 * owner it names. Requests without a stream go to partition 0's owner, except `streams`, gathered
 * from every owner (tally_streams_missing counts the partitions whose owner did not answer).
 * Shared-memory regions work with the members on this host (tally_send_shm); device regions are
 * refused (TALLY_E_ARG). A client connects to at most 64 members over its life (each member id,
 * endpoint and key met counts once; none is given back): a request whose partition's owner would
 * be one more fails TALLY_E_ARG at once, tally_client_error naming the member and the limit
 * (make a new client). A partition without an owner the buckets name (or whose lease or record
 * cannot be read) waits for one within the timeout, then fails TALLY_E_TIMEOUT with "partition K
 * has no owner in direct mode ... within N ms", followed by the last NATS failure when a read
 * failed (not found is no failure) or why the endpoint its owner publishes is not one. TALLY_E_ARG
 * (no fleet in direct mode on that NATS: TALLY_FLEET, TALLY_LEASES or TALLY_ENDPOINTS does not
 * exist; a malformed option), TALLY_E_TRANSPORT (NATS unreachable, or the buckets could not be
 * looked up: a timeout, the server's refusal of this user's permissions, named); msg (may be NULL)
 * says why. */
TALLY_API tally_status_t tally_client_new_fleet(const tally_nats_opts_t *opts, tally_client_t **out,
                                                char *msg, size_t msg_cap);
/* tally_client_new_fleet over CURVE (PROTOCOL.md §12): keys from tally_curve_client_keys_load.
 * Each member is connected to with this client's key pair and the server key the member
 * publishes (curve= in TALLY_ENDPOINTS), which must equal keys->server_public when that is not
 * "". Nothing goes in plain text: a member that publishes no key is not sent to, nor, without a
 * client key pair (keys NULL or client_secret ""), is one that publishes a key; a request for
 * its partitions fails TALLY_E_ARG, tally_client_error naming the member and why. The same
 * holds when a partition's owner changes to such a member (a member restarted with another key,
 * one that does not publish the pinned key): a request of that partition not yet answered, in
 * flight to the old owner for 1 s or waiting for the next one, is answered TALLY_E_ARG within
 * about 1 s with that message, and so is every later request of it until the buckets name an
 * owner this client takes; it is not left to wait out the timeout. keys with a server_public but
 * no client_secret is TALLY_E_ARG here (a pin without a pair). A member that does not allow the
 * client's key never answers (TALLY_E_TIMEOUT), as one tallyd. */
TALLY_API tally_status_t tally_client_new_fleet_curve(const tally_nats_opts_t *opts,
                                                      const tally_curve_keys_t *keys,
                                                      tally_client_t **out, char *msg,
                                                      size_t msg_cap);

#ifdef __cplusplus
}
#endif
#endif /* TALLY_H */
