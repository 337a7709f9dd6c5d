/*
 * tally_proto.h — the tallyd wire protocol, version 1 (specified in proto/PROTOCOL.md).
 *
 * This is the one source of truth for opcodes, dtypes, predicates, flags, status codes and
 * protocol limits. Daemon, client library, kernels and tests all include it; nothing else
 * defines these numbers.
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

/* ---- Framing constants ------------------------------------------------------------------ */

#define TALLY_PROTO_VERSION 1
/* The four magic bytes "TLYD" at offset 0 of every header (0x44594C54 read as uint32 LE). */
#define TALLY_MAGIC 0x44594C54u
#define TALLY_REQ_HEADER_SIZE 128
#define TALLY_REP_HEADER_SIZE 64
/* Stream names: 1..TALLY_STREAM_NAME_MAX bytes of printable ASCII (0x21..0x7E). */
#define TALLY_STREAM_NAME_MAX 64
/* Error messages in reply payloads are at most this many bytes (UTF-8, no terminator). */
#define TALLY_ERROR_MESSAGE_MAX 255
/* Histogram bins of every hist operation, and the number of values in a hist reply. */
#define TALLY_HIST_BINS 256
/* The int32 histogram reply appends underflow and overflow counts after the 256 bins. */
#define TALLY_HIST_I32_VALUES (TALLY_HIST_BINS + 2)

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
} tally_op_t;
#define TALLY_OP_COUNT 10 /* one past the largest opcode */

/* Element types. TALLY_DTYPE_NONE is for operations without a typed payload. */
typedef enum {
    TALLY_DTYPE_NONE = 0,
    TALLY_DTYPE_I32 = 1,
    TALLY_DTYPE_U8 = 2,
    TALLY_DTYPE_I64 = 3,  /* replies only (scan output, counts) */
    TALLY_DTYPE_U64 = 4,  /* replies only (histogram counts) */
    TALLY_DTYPE_TEXT = 5, /* replies only (info, error messages) */
} tally_dtype_t;
#define TALLY_DTYPE_COUNT 6

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
    TALLY_STATUS_WIRE_COUNT = 24,

    /* Client-side only. */
    TALLY_E_TIMEOUT = 100,   /* no reply within the timeout */
    TALLY_E_TRANSPORT = 101, /* ZeroMQ failed (connect, send, recv) */
    TALLY_E_REPLY = 102,     /* the reply did not decode (wrong magic, size, request id) */
    TALLY_E_NOMEM = 103,     /* out of memory */
    TALLY_E_ARG = 104,       /* invalid argument to a library function */
    TALLY_E_IO = 105,        /* file or stream I/O failed */
} tally_status_t;

/* A stable, lower-case, one-word name for a status ("ok", "bad_header", ...) and a sentence. */
const char *tally_status_name(tally_status_t status);
const char *tally_status_text(tally_status_t status);
const char *tally_op_name(tally_op_t op);          /* "filter", ... or NULL when unknown */
const char *tally_dtype_name(tally_dtype_t dtype); /* "i32", "u8", ... or NULL */
const char *tally_pred_name(tally_pred_t pred);    /* "gt", ... or NULL */
/* Size in bytes of one element, 0 for NONE/TEXT or an unknown dtype. */
size_t tally_dtype_size(tally_dtype_t dtype);

/* ---- Request header --------------------------------------------------------------------- */

/* Decoded request header. Field offsets on the wire are in PROTOCOL.md and tally_proto.c. */
typedef struct {
    uint8_t version;
    uint8_t opcode;
    uint8_t dtype;
    uint8_t flags;
    uint64_t request_id;
    uint8_t pred;       /* filter: tally_pred_t */
    int64_t lo;         /* filter: threshold (or lower bound of BETWEEN); hist i32: range start */
    int64_t hi;         /* filter BETWEEN: upper bound (inclusive); hist i32: range end (excl.) */
    uint64_t seq;       /* per-stream sequence number; 0 = none (filter/scan/hist on a stream) */
    uint8_t stream_len; /* 0 = no stream */
    char stream[TALLY_STREAM_NAME_MAX + 1]; /* NUL-terminated copy of the name */
} tally_req_t;

/* Writes exactly TALLY_REQ_HEADER_SIZE bytes: the magic, TALLY_PROTO_VERSION (req->version is
 * not used), the fields, and zeros in every reserved byte and after the stream name. Does not
 * validate; call tally_req_validate. */
void tally_req_encode(const tally_req_t *req, uint8_t out[TALLY_REQ_HEADER_SIZE]);

/* Decodes and validates a header frame of `len` bytes. On any error *req still holds what could
 * be read (request_id and opcode when len >= 16), so the error reply can echo the request id.
 * `msg` (may be NULL) receives a human-readable explanation of size msg_cap. */
tally_status_t tally_req_decode(const uint8_t *buf, size_t len, tally_req_t *req, char *msg,
                                size_t msg_cap);

/* Checks the request's fields against each other and the payload size (in bytes), given the
 * daemon's maximum batch in bytes. tally_req_decode already calls this with payload checks
 * skipped; the daemon calls it again once it knows the payload size. */
tally_status_t tally_req_validate(const tally_req_t *req, size_t payload_len, size_t max_batch,
                                  char *msg, size_t msg_cap);

/* Sets a stream name on a request (NULL clears it); TALLY_E_STREAM_NAME if it is not a valid
 * name, and then the request is left unchanged. */
tally_status_t tally_req_set_stream(tally_req_t *req, const char *name);
bool tally_stream_name_valid(const char *name, size_t len);

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
    uint64_t aux1;       /* reserved for the operation (see PROTOCOL.md); zero otherwise */
} tally_rep_t;

/* Writes exactly TALLY_REP_HEADER_SIZE bytes (magic, TALLY_PROTO_VERSION, fields, zeros). */
void tally_rep_encode(const tally_rep_t *rep, uint8_t out[TALLY_REP_HEADER_SIZE]);
/* The client's check: TALLY_E_REPLY unless buf is a v1 reply header of exactly
 * TALLY_REP_HEADER_SIZE bytes with zero reserved bytes and a wire status (< 100). */
tally_status_t tally_rep_decode(const uint8_t *buf, size_t len, tally_rep_t *rep);

/* ---- Payloads with a fixed layout ------------------------------------------------------- */

/* The `query` reply payload: a stream's counters and histogram (layout in PROTOCOL.md). */
#define TALLY_QUERY_PAYLOAD_SIZE (128 + 8 * TALLY_HIST_BINS)
typedef struct {
    uint64_t batches;       /* requests applied to the stream */
    uint64_t elements;      /* elements in them */
    uint64_t bytes;         /* payload bytes in them */
    uint64_t filter_seen;   /* elements filtered */
    uint64_t filter_kept;   /* elements kept by filters */
    int64_t scan_carry;     /* running total of scanned elements (wraps modulo 2^64) */
    uint64_t scan_elements; /* elements scanned */
    uint8_t hist_dtype;     /* TALLY_DTYPE_NONE until the first hist, then U8 or I32 */
    int64_t hist_lo;        /* i32 histograms: the range, fixed by the first hist */
    int64_t hist_hi;
    uint64_t hist_underflow;
    uint64_t hist_overflow;
    uint64_t hist_total; /* elements histogrammed, in range or not */
    uint64_t last_seq;   /* seq of the last applied request that carried one; 0 = none yet */
    uint64_t bins[TALLY_HIST_BINS];
} tally_stream_info_t;

void tally_stream_info_encode(const tally_stream_info_t *info,
                              uint8_t out[TALLY_QUERY_PAYLOAD_SIZE]);
/* TALLY_E_REPLY unless len is TALLY_QUERY_PAYLOAD_SIZE, the reserved bytes are zero and
 * hist_dtype is NONE, I32 or U8. */
tally_status_t tally_stream_info_decode(const uint8_t *buf, size_t len, tally_stream_info_t *info);

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

typedef struct {
    uint8_t op;      /* TALLY_SHM_OP_* */
    uint64_t handle; /* release: the region; register: 0 */
    uint8_t id_len;  /* register: the routing id's length, 1..255 */
    uint8_t id[TALLY_SHM_ROUTING_ID_MAX];
} tally_shm_msg_t;

typedef struct {
    uint8_t op;
    uint32_t status; /* tally_status_t; an error message follows the answer's 32 bytes */
    uint64_t handle; /* register: the new region's handle */
    uint64_t size;   /* register: the region's size in bytes */
} tally_shm_answer_t;

/* Writes a side-channel request; returns its length (16 + id_len). */
size_t tally_shm_msg_encode(const tally_shm_msg_t *m,
                            uint8_t out[TALLY_SHM_MSG_HEADER + TALLY_SHM_ROUTING_ID_MAX]);
/* TALLY_E_HEADER, E_MAGIC, E_VERSION, E_OPCODE or E_PARAM (with msg) for a malformed request. */
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

/* Little-endian helpers, exposed for the daemon's and client's payload code. */
static inline void tally_put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static inline void tally_put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline void tally_put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t tally_get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}
static inline uint32_t tally_get_u32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}
static inline uint64_t tally_get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

#ifdef __cplusplus
}
#endif
#endif /* TALLY_PROTO_H */
