/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_proto.h — the tallyd wire protocol, version 1 (specified in proto/PROTOCOL.md).
 *
 * This is the one source of truth for opcodes, dtypes, predicates, flags, status codes and
 * protocol limits. Daemon, client library, kernels and tests all include it; nothing else
 * defines these numbers. The sections marked PUBLIC (the numbers, the request, reply and query
 * structs, the name functions) are what libtally's users need too: the build copies them into
 * tally_wire.h, which is installed with tally.h; this header, with the codec, is private.
 *
 * Everything here works on plain byte buffers: no ZeroMQ, no allocation, no I/O, so the
 * functions can be fuzzed and reused from any transport. All multi-byte fields on the wire are
 * little-endian; encode/decode convert explicitly, so the code is correct on any host.
 *
 * A request is a ZeroMQ message of two frames: a TALLY_REQ_HEADER_SIZE-byte header and a
 * payload frame (possibly empty). A reply is two frames: a TALLY_REP_HEADER_SIZE-byte header and
 * a payload frame (the result, or a UTF-8 error message).
 */
#ifndef TALLY_PROTO_H
#define TALLY_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifndef TALLY_WIRE_H /* PUBLIC: begin (copied into the installed tally_wire.h) */
/* ---- Framing constants ------------------------------------------------------------------ */

/* What libtally exports (it is built with hidden visibility): the documented API only. */
#ifndef TALLY_API
#define TALLY_API __attribute__((visibility("default")))
#endif

#define TALLY_PROTO_VERSION 1
/* Where tallyd listens and clients connect when nothing else is said (PROTOCOL.md §1). */
#define TALLY_DEFAULT_ENDPOINT "tcp://127.0.0.1:5555"
/* The four magic bytes "TLYD" at offset 0 of every header (0x44594C54 read as uint32 LE). */
#define TALLY_MAGIC 0x44594C54u
#define TALLY_REQ_HEADER_SIZE 128
#define TALLY_REP_HEADER_SIZE 64
/* Stream names: 1..TALLY_STREAM_NAME_MAX bytes of printable ASCII (0x21..0x7E). */
#define TALLY_STREAM_NAME_MAX 64
/* Error messages in reply payloads are at most this many bytes (UTF-8, no terminator). */
#define TALLY_ERROR_MESSAGE_MAX 255
/* The longest window a window query may ask for, in milliseconds (the daemon keeps less:
 * `window_intervals` x `window_interval_ms` in `info`). */
#define TALLY_WINDOW_MS_MAX 4294967295ll
/* Histogram bins of every hist operation, and the number of values in a hist reply. */
#define TALLY_HIST_BINS 256
/* The int32 and uint16 histogram replies append underflow and overflow after the 256 bins. */
#define TALLY_HIST_I32_VALUES (TALLY_HIST_BINS + 2)
/* Colour histograms keep one 256-bin histogram per channel: 3 (rgb8) or 4 (rgba8). */
#define TALLY_HIST_CHANNELS_MAX 4
/* The most u64 values a hist reply carries (rgba8: 4 x 256). */
#define TALLY_HIST_VALUES_MAX (TALLY_HIST_CHANNELS_MAX * TALLY_HIST_BINS)

/* ---- Operations ------------------------------------------------------------------------- */

typedef enum {
    TALLY_OP_PING = 1,
    TALLY_OP_INFO = 2,
    TALLY_OP_FILTER = 3,
    TALLY_OP_SCAN = 4,
    TALLY_OP_HIST = 5,
    TALLY_OP_QUERY = 6,
    TALLY_OP_RESET = 7,
    TALLY_OP_STREAMS = 8,
    TALLY_OP_STATS = 9,
    TALLY_OP_DELETE = 10, /* forget a stream (what `reset` did before it kept the stream) */
    /* 11 and 12 stay reserved (issue 12). */
    TALLY_OP_MINMAX = 13, /* the smallest and largest element of a batch of integers */
} tally_op_t;
#define TALLY_OP_COUNT 14 /* one past the largest opcode */

/* Element types. TALLY_DTYPE_NONE is for operations without a typed payload. */
typedef enum {
    TALLY_DTYPE_NONE = 0,
    TALLY_DTYPE_I32 = 1,
    TALLY_DTYPE_U8 = 2,
    TALLY_DTYPE_I64 = 3,  /* replies only (scan output, counts) */
    TALLY_DTYPE_U64 = 4,  /* replies only (histogram counts) */
    TALLY_DTYPE_TEXT = 5, /* replies only (info, error messages) */
    TALLY_DTYPE_U16 = 6,  /* hist only: 12- and 16-bit sensors, 256 even bins over [lo, hi) */
    TALLY_DTYPE_RGB8 = 7, /* hist only: interleaved R,G,B bytes; one element = one pixel */
    TALLY_DTYPE_RGBA8 = 8 /* hist only: interleaved R,G,B,A bytes; one element = one pixel */
} tally_dtype_t;
#define TALLY_DTYPE_COUNT 9

/* Filter predicates: keep x when pred(x) holds; comparisons are exact, on mathematical
 * integers (a uint8 compared with 300 is simply less). BETWEEN keeps lo <= x <= hi. */
typedef enum {
    TALLY_PRED_GT = 1,
    TALLY_PRED_GE = 2,
    TALLY_PRED_LT = 3,
    TALLY_PRED_LE = 4,
    TALLY_PRED_EQ = 5,
    TALLY_PRED_NE = 6,
    TALLY_PRED_BETWEEN = 7,
} tally_pred_t;

/* Request flags (header byte 7). Bits not defined for the opcode must be zero. */
#define TALLY_FLAG_SCAN_EXCLUSIVE 0x01u /* scan: exclusive instead of inclusive */
#define TALLY_FLAG_SCAN_OUT_I32 0x02u   /* scan: int32 output wrapping modulo 2^32 */
#define TALLY_FLAG_FILTER_STABLE 0x04u  /* filter: keep input order */
/* query: answer for the last `lo` milliseconds (the stream's ring of recent intervals) instead
 * of all time (PROTOCOL.md, "Windows"). 0x10..0x40 stay reserved for issue 12. */
#define TALLY_FLAG_QUERY_WINDOW 0x08u
/* filter, scan, hist: the payload frame is a shared-memory reference (tally_shm_ref_t, 48
 * bytes) to data in a region registered over the side channel, not the data itself. */
#define TALLY_FLAG_SHM_REF 0x80u

/* ---- Status codes ----------------------------------------------------------------------- */

/* One error type for the whole project: functions in proto/, kernels/, daemon/ and client/
 * that can fail return a tally_status_t. Values 0..99 travel on the wire; 100 and above are
 * local to the client library and never sent. */
typedef enum {
    TALLY_OK = 0,
    TALLY_E_HEADER = 1,          /* header frame truncated or oversized */
    TALLY_E_MAGIC = 2,           /* magic bytes are not "TLYD" */
    TALLY_E_VERSION = 3,         /* unsupported protocol version */
    TALLY_E_OPCODE = 4,          /* unknown opcode */
    TALLY_E_DTYPE = 5,           /* unknown dtype, or one the operation does not take */
    TALLY_E_PAYLOAD = 6,         /* payload not a whole number of elements, or not empty */
    TALLY_E_TOO_LARGE = 7,       /* payload over the daemon's configured maximum batch */
    TALLY_E_STREAM_NAME = 8,     /* stream name empty, too long, or not printable ASCII */
    TALLY_E_UNKNOWN_STREAM = 9,  /* query/reset of a stream that does not exist */
    TALLY_E_FRAMES = 10,         /* message with missing or extra frames */
    TALLY_E_PARAM = 11,          /* bad predicate, flags, range or reserved field */
    TALLY_E_STREAM_STATE = 12,   /* request conflicts with the stream's state (e.g. hist type) */
    TALLY_E_LIMIT = 13,          /* a daemon resource limit was hit (e.g. too many streams) */
    TALLY_E_BACKEND = 14,        /* the compute backend failed; the request had no effect */
    TALLY_E_SHUTDOWN = 15,       /* daemon is shutting down */
    TALLY_E_INTERNAL = 16,       /* a bug or out of memory in the daemon */
    TALLY_E_DUPLICATE = 17,      /* seq already applied on the stream: not applied again */
    TALLY_E_SEQ_GAP = 18,        /* seq skips one the stream has not applied: not applied */
    TALLY_E_BAD_REF = 19,        /* a shared-memory reference names no region of this peer, or a
                                  * range outside it */
    TALLY_E_QUOTA = 20,          /* side channel: a shared-memory quota would be exceeded */
    TALLY_E_BUSY = 21,           /* the peer already has its share of in-flight requests */
    TALLY_E_CLIENT_STREAMS = 22, /* the client identity holds its maximum of streams */
    TALLY_E_RATE = 23,           /* the client identity creates streams faster than allowed */
    TALLY_E_WINDOW = 24, /* a window query longer than the daemon keeps, or windows are off */
    TALLY_E_NOT_PERMITTED = 25, /* the sender may not do this (a fleet's stream changed over
                                 * ZeroMQ; a fleet message replying or deduping outside its
                                 * publisher's own names) */
    TALLY_E_NOT_OWNER = 26,     /* direct mode (PROTOCOL.md §13 "Direct mode"): this fleet member
                                 * does not own the stream's partition; the message names the owner
                                 * and its endpoint when known */
    TALLY_E_NOT_DURABLE = 27,   /* direct mode, replicated: the request ran but the changelog
                                 * record holding its effect was not acknowledged by JetStream;
                                 * the member gives the partition up: send it again (with seq)
                                 * to the partition's next owner */
    TALLY_STATUS_WIRE_COUNT = 28,

    /* Client-side only. */
    TALLY_E_TIMEOUT = 100,   /* no reply within the timeout */
    TALLY_E_TRANSPORT = 101, /* ZeroMQ failed (connect, send, recv) */
    TALLY_E_REPLY = 102,     /* the reply did not decode (wrong magic, size, request id) */
    TALLY_E_NOMEM = 103,     /* out of memory */
    TALLY_E_ARG = 104,       /* invalid argument to a library function */
    TALLY_E_IO = 105,        /* file or stream I/O failed */
} tally_status_t;

/* A stable, lower-case, one-word name for a status ("ok", "bad_header", ...) and a sentence. */
TALLY_API const char *tally_status_name(tally_status_t status);
TALLY_API const char *tally_status_text(tally_status_t status);
TALLY_API const char *tally_op_name(tally_op_t op); /* "filter", ... or NULL when unknown */
TALLY_API const char *tally_dtype_name(tally_dtype_t dtype); /* "i32", "u8", ... or NULL */
TALLY_API const char *tally_pred_name(tally_pred_t pred);    /* "gt", ... or NULL */
/* Size in bytes of one element, 0 for NONE/TEXT or an unknown dtype (rgb8: 3, one pixel). */
TALLY_API size_t tally_dtype_size(tally_dtype_t dtype);
/* The alignment a payload of dtype needs to be read as its elements: 1 for the byte-channel
 * types (u8, rgb8, rgba8), else the element size. */
TALLY_API size_t tally_dtype_align(tally_dtype_t dtype);
/* Histogram shape of a dtype: channels (1; rgb8 3; rgba8 4; 0 when hist does not take it) and
 * the number of u64 values in a hist reply (u8 256; i32, u16 258: bins, underflow, overflow;
 * rgb8 768, rgba8 1024: channel c's 256 bins at c x 256; 0 when hist does not take it). */
TALLY_API unsigned tally_hist_channels(unsigned dtype);
TALLY_API size_t tally_hist_values(unsigned dtype);
/* True for the dtypes whose histogram has a range [lo, hi) and under/overflow: i32, u16. */
TALLY_API bool tally_hist_ranged(unsigned dtype);
#endif /* PUBLIC: end */

#ifndef TALLY_WIRE_H /* PUBLIC: begin (copied into the installed tally_wire.h) */
/* ---- Request header --------------------------------------------------------------------- */

/* Decoded request header. Field offsets on the wire are in PROTOCOL.md and tally_proto.c. */
typedef struct {
    uint8_t version;
    uint8_t opcode;
    uint8_t dtype;
    uint8_t flags;
    uint64_t request_id;
    uint8_t pred; /* filter: tally_pred_t */
    int64_t lo;   /* filter: threshold (or lower bound of BETWEEN); hist i32/u16: range start;
                   * query with TALLY_FLAG_QUERY_WINDOW: the window in milliseconds */
    int64_t hi;   /* filter BETWEEN: upper bound (inclusive); hist i32/u16: range end (excl.) */
    uint64_t seq; /* per-stream sequence number; 0 = none (filter/scan/hist on a stream) */
    uint8_t stream_len;                     /* 0 = no stream */
    char stream[TALLY_STREAM_NAME_MAX + 1]; /* NUL-terminated copy of the name */
} tally_req_t;
#endif /* PUBLIC: end */

/* Writes exactly TALLY_REQ_HEADER_SIZE bytes: the magic, TALLY_PROTO_VERSION (req->version is
 * not used), the fields, and zeros in every reserved byte and after the stream name. Does not
 * validate; call tally_req_validate. */
void tally_req_encode(const tally_req_t *req, uint8_t out[TALLY_REQ_HEADER_SIZE]);

/* Decodes and validates a header frame of `len` bytes. On any error *req still holds what could
 * be read (request_id and opcode when len >= 16), so the error reply can echo the request id.
 * `msg` (may be NULL) receives a human-readable explanation of size msg_cap. */
tally_status_t tally_req_decode(const uint8_t *buf, size_t len, tally_req_t *req, char *msg,
                                size_t msg_cap);

/* The stream a header frame names, read without decoding the rest (tallyd routes a request to
 * the shard that owns its stream before the shard decodes it): true with *name (pointing into
 * buf, not NUL-terminated) and *name_len when buf is a header of TALLY_REQ_HEADER_SIZE bytes with
 * the magic that names a stream of at most TALLY_STREAM_NAME_MAX bytes; false otherwise (no
 * stream, or a header that tally_req_decode will refuse). */
bool tally_req_stream_of(const uint8_t *buf, size_t len, const char **name, size_t *name_len);

/* Checks the request's fields against each other and the payload size (in bytes), given the
 * daemon's maximum batch in bytes. tally_req_decode already calls this with payload checks
 * skipped; the daemon calls it again once it knows the payload size. */
tally_status_t tally_req_validate(const tally_req_t *req, size_t payload_len, size_t max_batch,
                                  char *msg, size_t msg_cap);

#ifndef TALLY_WIRE_H /* PUBLIC: begin (copied into the installed tally_wire.h) */
/* Sets a stream name on a request (NULL clears it); TALLY_E_STREAM_NAME if it is not a valid
 * name, and then the request is left unchanged. */
TALLY_API tally_status_t tally_req_set_stream(tally_req_t *req, const char *name);
TALLY_API bool tally_stream_name_valid(const char *name, size_t len);
#endif /* PUBLIC: end */

#ifndef TALLY_WIRE_H /* PUBLIC: begin (copied into the installed tally_wire.h) */
/* ---- Reply header ----------------------------------------------------------------------- */

typedef struct {
    uint8_t version;
    uint8_t opcode;      /* the request's opcode, echoed (0 if it could not be read) */
    uint8_t dtype;       /* dtype of the reply payload */
    uint8_t flags;       /* the request's flags, echoed */
    uint64_t request_id; /* the request's id, echoed (0 if it could not be read) */
    uint32_t status;     /* tally_status_t */
    uint64_t count;      /* number of elements in the payload (filter: elements kept) */
    uint64_t aux0;       /* filter, hist: elements in the batch; scan: carry-out (i64);
                          * duplicate, sequence_gap: the stream's last applied seq */
    uint64_t aux1;       /* query with TALLY_FLAG_QUERY_WINDOW: the window's end (aux0 its
                          * start), ms since the epoch; zero otherwise */
} tally_rep_t;
#endif /* PUBLIC: end */

/* Writes exactly TALLY_REP_HEADER_SIZE bytes (magic, TALLY_PROTO_VERSION, fields, zeros). */
void tally_rep_encode(const tally_rep_t *rep, uint8_t out[TALLY_REP_HEADER_SIZE]);
/* The client's check: TALLY_E_REPLY unless buf is a v1 reply header of exactly
 * TALLY_REP_HEADER_SIZE bytes with zero reserved bytes and a wire status (< 100). */
tally_status_t tally_rep_decode(const uint8_t *buf, size_t len, tally_rep_t *rep);

#ifndef TALLY_WIRE_H /* PUBLIC: begin (copied into the installed tally_wire.h) */
/* ---- Payloads with a fixed layout ------------------------------------------------------- */

/* The `query` reply payload: one stream record, a stream's counters and histogram (layout in
 * PROTOCOL.md). A single-channel stream's record is TALLY_QUERY_PAYLOAD_SIZE bytes (protocol 1
 * as first published); an rgb8/rgba8 stream's appends the bins of channels 1.. after those of
 * channel 0, so the record is 128 + 2048 x channels bytes, at most TALLY_QUERY_PAYLOAD_MAX. */
#define TALLY_QUERY_PAYLOAD_SIZE (128 + 8 * TALLY_HIST_BINS)
#define TALLY_QUERY_PAYLOAD_MAX (128 + 8 * TALLY_HIST_VALUES_MAX)
typedef struct {
    uint64_t batches;       /* requests applied to the stream */
    uint64_t elements;      /* elements in them */
    uint64_t bytes;         /* payload bytes in them */
    uint64_t filter_seen;   /* elements filtered */
    uint64_t filter_kept;   /* elements kept by filters */
    int64_t scan_carry;     /* running total of scanned elements (wraps modulo 2^64) */
    uint64_t scan_elements; /* elements scanned */
    uint8_t hist_dtype;     /* TALLY_DTYPE_NONE until the first hist, then its dtype */
    int64_t hist_lo;        /* i32/u16 histograms: the range, fixed by the first hist */
    int64_t hist_hi;
    uint64_t hist_underflow;
    uint64_t hist_overflow;
    uint64_t hist_total; /* elements (pixels) histogrammed, in range or not */
    uint64_t last_seq;   /* seq of the last applied request that carried one; 0 = none yet */
    /* Channel c's bin b at bins[c * TALLY_HIST_BINS + b]; only channel 0 for one channel, so
     * bins[0..255] is the histogram of every single-channel stream. */
    uint64_t bins[TALLY_HIST_VALUES_MAX];
} tally_stream_info_t;
#endif /* PUBLIC: end */

/* The record's length on the wire: 128 + 2048 x tally_hist_channels(hist_dtype) (one channel
 * for a stream without a histogram). */
size_t tally_stream_info_size(const tally_stream_info_t *info);
/* Writes tally_stream_info_size(info) bytes to out (room for TALLY_QUERY_PAYLOAD_MAX is always
 * enough; TALLY_QUERY_PAYLOAD_SIZE for single-channel streams) and returns that length. */
size_t tally_stream_info_encode(const tally_stream_info_t *info, uint8_t *out);
/* TALLY_E_REPLY unless hist_dtype is NONE, I32, U8, U16, RGB8 or RGBA8, len is the record
 * size that dtype implies, and the reserved bytes are zero. */
tally_status_t tally_stream_info_decode(const uint8_t *buf, size_t len, tally_stream_info_t *info);
/* The record's fixed part: its first TALLY_STREAM_INFO_HEAD_SIZE bytes, every field but the
 * bins (the daemon's state records keep the bins in a compact form of their own). Decoding
 * sets those fields only: TALLY_E_REPLY unless hist_dtype is one the record allows and the
 * reserved bytes are zero. */
#define TALLY_STREAM_INFO_HEAD_SIZE 128
void tally_stream_info_encode_head(const tally_stream_info_t *info, uint8_t *out);
tally_status_t tally_stream_info_decode_head(const uint8_t *buf, tally_stream_info_t *info);

#ifndef TALLY_WIRE_H /* PUBLIC: begin (copied into the installed tally_wire.h) */
/* ---- Subscriptions (PROTOCOL.md §11) ---------------------------------------------------- */

/* A message on tallyd's PUB socket is three frames: [topic = the stream name][a
 * TALLY_PUB_HEADER_SIZE-byte header][the stream record (a `query` payload), empty for
 * TALLY_PUB_DELETED]. */
#define TALLY_PUB_HEADER_SIZE 64
#define TALLY_PUB_UPDATE 1  /* the stream changed since the last publication: its record */
#define TALLY_PUB_DELETED 2 /* the stream was deleted (`delete`): no record */
typedef struct {
    uint8_t kind;         /* TALLY_PUB_UPDATE or TALLY_PUB_DELETED */
    uint64_t pub_seq;     /* 1, 2, 3, ... per daemon run over all streams: a gap = lost messages */
    uint64_t time_ms;     /* when the record was taken: the window clock, ms since the epoch */
    uint64_t interval_ms; /* the publication interval */
} tally_pub_t;
#endif /* PUBLIC: end */

void tally_pub_encode(const tally_pub_t *pub, uint8_t out[TALLY_PUB_HEADER_SIZE]);
/* TALLY_E_REPLY unless buf is a v1 publication header of TALLY_PUB_HEADER_SIZE bytes. */
tally_status_t tally_pub_decode(const uint8_t *buf, size_t len, tally_pub_t *pub);

/* ---- Shared memory (PROTOCOL.md §10) -------------------------------------------------- */

/* The payload frame of a request with TALLY_FLAG_SHM_REF: where its input is, and optionally
 * where its output goes (out_handle 0: the reply carries the output as usual). */
#define TALLY_SHM_REF_SIZE 48
typedef struct {
    uint64_t in_handle;  /* a region registered by the sender */
    uint64_t in_offset;  /* bytes from the region's start; a multiple of the element size */
    uint64_t in_length;  /* bytes of input: a whole number of elements, at most max_batch */
    uint64_t out_handle; /* 0 = no output region (always 0 for hist) */
    uint64_t out_offset; /* a multiple of the output element size */
    uint64_t out_length; /* bytes available: at least the worst case of the operation */
} tally_shm_ref_t;

void tally_shm_ref_encode(const tally_shm_ref_t *ref, uint8_t out[TALLY_SHM_REF_SIZE]);
/* TALLY_E_PAYLOAD unless len is TALLY_SHM_REF_SIZE. */
tally_status_t tally_shm_ref_decode(const uint8_t *buf, size_t len, tally_shm_ref_t *ref, char *msg,
                                    size_t msg_cap);
/* The reference's own rules, given the request (already validated with the reference as its
 * payload): in_length as a payload (too_large, then bad_payload), the offsets' alignment, the
 * output range against the worst case of the operation (bad_ref), no output for hist
 * (bad_ref). Bounds within the regions are the daemon's to check. */
tally_status_t tally_shm_ref_validate(const tally_req_t *req, const tally_shm_ref_t *ref,
                                      size_t max_batch, char *msg, size_t msg_cap);
/* The most output bytes the operation can write for in_length bytes of input: filter
 * in_length, scan in_length (int32 output) or 2 x in_length (int64), hist 0. */
uint64_t tally_shm_out_worst(const tally_req_t *req, uint64_t in_length);

/* The side channel (a Unix-domain SOCK_SEQPACKET socket): one register message per region,
 * with the region's memfd attached (SCM_RIGHTS), and one release message per region. */
#define TALLY_SHM_OP_REGISTER 1
#define TALLY_SHM_OP_RELEASE 2
#define TALLY_SHM_MSG_HEADER 16      /* request: magic, version, op, id_len, handle */
#define TALLY_SHM_ROUTING_ID_MAX 255 /* ZeroMQ routing ids are 1..255 bytes */
#define TALLY_SHM_ANSWER_SIZE 32     /* answer: magic, version, op, status, handle, size */
/* Op 3 registers a device region (PROTOCOL.md §10 "Device memory"): the routing id is followed
 * by TALLY_SHM_DEV_SIZE bytes (size, GPU UUID, flags, reserved, IPC event handle). */
#define TALLY_SHM_OP_REGISTER_DEVICE 3
#define TALLY_SHM_DEV_SIZE 96
/* DEV_EVENT: `event` holds an IPC event handle, tallyd's stream waits on it; DEV_OUTPUT: the
 * region may be written (an output region). */
#define TALLY_SHM_DEV_EVENT 0x1u
#define TALLY_SHM_DEV_OUTPUT 0x2u
#define TALLY_GPU_UUID_SIZE 16
#define TALLY_GPU_EVENT_SIZE 64 /* cudaIpcEventHandle_t */
/* A device region's handle has this bit set; a host region's never does. */
#define TALLY_SHM_DEVICE_HANDLE_BIT (UINT64_C(1) << 63)

typedef struct {
    uint8_t op;      /* TALLY_SHM_OP_* */
    uint64_t handle; /* release: the region; register: 0 */
    uint8_t id_len;  /* register: the routing id's length, 1..255 */
    uint8_t id[TALLY_SHM_ROUTING_ID_MAX];
    /* op 3 (register a device region) only: */
    uint64_t dev_size;                     /* the whole allocation's size, not 0 */
    uint8_t gpu_uuid[TALLY_GPU_UUID_SIZE]; /* the GPU that holds it */
    uint32_t dev_flags;                    /* TALLY_SHM_DEV_* */
    uint8_t event[TALLY_GPU_EVENT_SIZE];   /* with TALLY_SHM_DEV_EVENT; else zero */
} tally_shm_msg_t;

typedef struct {
    uint8_t op;
    uint32_t status; /* tally_status_t; an error message follows the answer's 32 bytes */
    uint64_t handle; /* register: the new region's handle */
    uint64_t size;   /* register: the region's size in bytes */
} tally_shm_answer_t;

/* The longest side-channel request: a device registration with a 255-byte routing id. */
#define TALLY_SHM_MSG_MAX (TALLY_SHM_MSG_HEADER + TALLY_SHM_ROUTING_ID_MAX + TALLY_SHM_DEV_SIZE)
/* Writes a side-channel request; returns its length (16 + id_len, + 96 for op 3). */
size_t tally_shm_msg_encode(const tally_shm_msg_t *m, uint8_t out[TALLY_SHM_MSG_MAX]);
/* TALLY_E_HEADER, E_MAGIC, E_VERSION, E_OPCODE or E_PARAM (with msg) for a malformed request.
 * m->op is byte 5 whenever len >= TALLY_SHM_MSG_HEADER, even then (an answer echoes it). */
tally_status_t tally_shm_msg_decode(const uint8_t *buf, size_t len, tally_shm_msg_t *m, char *msg,
                                    size_t msg_cap);
void tally_shm_answer_encode(const tally_shm_answer_t *a, uint8_t out[TALLY_SHM_ANSWER_SIZE]);
/* TALLY_E_REPLY unless buf starts with a well-formed answer. */
tally_status_t tally_shm_answer_decode(const uint8_t *buf, size_t len, tally_shm_answer_t *a);

/* The int32 histogram's bin for x over [lo, hi): the single definition shared by every
 * backend. Callers guarantee lo < hi and lo <= x < hi. Exact for every range the protocol
 * admits (INT32_MIN <= lo < hi <= INT32_MAX + 1, so hi - lo <= 2^32 and the product below
 * stays under 2^40); not defined for ranges wider than 2^56. */
static inline unsigned tally_hist_bin_i32(int32_t x, int64_t lo, int64_t hi)
{
    return (unsigned)(((uint64_t)((int64_t)x - lo) * TALLY_HIST_BINS) / (uint64_t)(hi - lo));
}

/* Its inverse: the lower edge of bin b (0 <= b <= 256; edge(256) = hi), the smallest integer
 * of the bin, lo + ceil(b (hi - lo) / 256); bin b holds the integers [edge(b), edge(b + 1)).
 * One definition for libtally's summaries and the daemon's Prometheus buckets. */
static inline int64_t tally_hist_edge_at(int64_t lo, int64_t hi, unsigned b)
{
    uint64_t width = (uint64_t)(hi - lo); /* at most 2^32: the product fits */
    return lo + (int64_t)((b * width + TALLY_HIST_BINS - 1) / TALLY_HIST_BINS);
}

/* The uint16 histogram's bin without a division, shared by every backend: for d = x - lo in
 * [0, R) with R = hi - lo <= 2^16, bin = floor(256 d / R) = (256 d * mul) >> shift, exactly,
 * where shift = 24 + ceil(log2 R) and mul = ceil(2^shift / R). Why it is exact: with
 * mul * R = 2^shift + e, 0 <= e < R, the product divided by 2^shift is 256 d / R + delta with
 * delta = 256 d e / (R 2^shift) < 2^24 / 2^shift = 2^-ceil(log2 R) <= 1/R, and the fraction of
 * 256 d / R is at most (R - 1) / R, so the floor does not change. The product stays under 2^50. */
static inline void tally_hist_u16_recip(int64_t lo, int64_t hi, uint64_t *mul, unsigned *shift)
{
    uint64_t r = (uint64_t)(hi - lo);
    unsigned l = 0;
    while ((1ull << l) < r)
        l++;
    *shift = 24 + l;
    *mul = ((1ull << *shift) + r - 1) / r;
}

#ifdef __CUDACC__
#define TALLY_HOST_DEVICE __host__ __device__ /* the CUDA kernels use the same expression */
#else
#define TALLY_HOST_DEVICE
#endif
static inline TALLY_HOST_DEVICE unsigned tally_hist_bin_u16(uint32_t d, uint64_t mul,
                                                            unsigned shift)
{
    return (unsigned)(((uint64_t)d * TALLY_HIST_BINS * mul) >> shift);
}

#ifndef TALLY_WIRE_H /* PUBLIC: begin (copied into the installed tally_wire.h) */
/* Little-endian helpers, exposed for the daemon's and client's payload code. On a
 * little-endian host each is one unaligned load or store (TALLY_LE_COPY); the byte loops, kept
 * for any other host, did not compile to one with GCC 12 -O2, and encoding a 2 KiB histogram
 * reply took about 14,000 instructions in them (callgrind, 2026-11-23). */
#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define TALLY_LE_COPY(dst, src, n) __builtin_memcpy((dst), (src), (n))
#endif
static inline void tally_put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static inline void tally_put_u32(uint8_t *p, uint32_t v)
{
#ifdef TALLY_LE_COPY
    TALLY_LE_COPY(p, &v, sizeof v);
#else
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
#endif
}
static inline void tally_put_u64(uint8_t *p, uint64_t v)
{
#ifdef TALLY_LE_COPY
    TALLY_LE_COPY(p, &v, sizeof v);
#else
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
#endif
}
static inline uint16_t tally_get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}
static inline uint32_t tally_get_u32(const uint8_t *p)
{
    uint32_t v = 0;
#ifdef TALLY_LE_COPY
    TALLY_LE_COPY(&v, p, sizeof v);
#else
    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
#endif
    return v;
}
static inline uint64_t tally_get_u64(const uint8_t *p)
{
    uint64_t v = 0;
#ifdef TALLY_LE_COPY
    TALLY_LE_COPY(&v, p, sizeof v);
#else
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
#endif
    return v;
}
#endif /* PUBLIC: end */

/* n little-endian u64 values from v into p, and back: one copy on a little-endian host. Value by
 * value, GCC 12 made a loop of ~5 instructions each: ~1,600 of the ~22,000 instructions a 1 KiB
 * fleet message cost a worker, a histogram reply's counts encoded and decoded again to apply them
 * (callgrind, bench/NOTES.md "A histogram's counts copied"). */
static inline void tally_put_u64s(uint8_t *p, const uint64_t *v, size_t n)
{
#ifdef TALLY_LE_COPY
    TALLY_LE_COPY(p, v, n * sizeof *v);
#else
    for (size_t i = 0; i < n; i++)
        tally_put_u64(p + 8 * i, v[i]);
#endif
}
static inline void tally_get_u64s(uint64_t *v, const uint8_t *p, size_t n)
{
#ifdef TALLY_LE_COPY
    TALLY_LE_COPY(v, p, n * sizeof *v);
#else
    for (size_t i = 0; i < n; i++)
        v[i] = tally_get_u64(p + 8 * i);
#endif
}

#ifndef TALLY_WIRE_H /* PUBLIC: begin (copied into the installed tally_wire.h) */
/* ---- NATS JetStream: the partition of a stream (PROTOCOL.md §13) ------------------------- */

/* FNV-1a 64 as published (offset basis 14695981039346656037, prime 1099511628211) of len bytes. */
#define TALLY_FNV1A64_BASIS 0xcbf29ce484222325ull
#define TALLY_FNV1A64_PRIME 0x100000001b3ull
TALLY_API uint64_t tally_fnv1a64(const void *data, size_t len);
/* The partition (0 .. partitions - 1) every message naming this stream goes to:
 * tally_fnv1a64(name) mod partitions (1 .. TALLY_NATS_MAX_PARTITIONS; 0 yields 0). */
#define TALLY_NATS_MAX_PARTITIONS 1024u
TALLY_API uint32_t tally_partition(const char *stream, size_t len, uint32_t partitions);
#endif /* PUBLIC: end */

/* FNV-1a 64 from another offset basis: the one loop behind tally_fnv1a64 and the daemon's own
 * table hash (daemon/base/td_hash.h, whose basis its version-1 state files were summed with). */
static inline uint64_t tally_fnv1a64_from(uint64_t basis, const void *data, size_t len)
{
    const uint8_t *p = (const uint8_t *)data;
    uint64_t h = basis;
    for (size_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= TALLY_FNV1A64_PRIME;
    }
    return h;
}

/* SplitMix64's finaliser, PROTOCOL.md §13's mix64: a member's rendezvous score is its FNV-1a 64
 * mixed (daemon/nats/td_fleet_plan.c), and so is a stream's shard (daemon/base/td_hash.h). */
static inline uint64_t tally_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

#ifdef __cplusplus
}
#endif
/* The public sections above are also tally_wire.h: whichever comes first defines them. */
#ifndef TALLY_WIRE_H
#define TALLY_WIRE_H
#endif
#endif /* TALLY_PROTO_H */
