/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_proto.c — encode and decode protocol v1 (specified in proto/PROTOCOL.md): the codec, the
 * top floor of proto/ (tally_validate.h draws the floors).
 *
 * How it works:
 * - Every field has a fixed byte offset (the HEAD_OFF_, REQ_OFF_, REP_OFF_ and INFO_OFF_
 *   constants below, the same tables as PROTOCOL.md). Encoders write every byte of their
 *   output, reserved bytes as zero; decoders read with the tally_get_* helpers, so the host's
 *   endianness never matters.
 * - Decoding is strict: a header decodes OK only when every byte has its one defined meaning
 *   (reserved bytes zero, name padding zero). Hence "decode OK" implies "re-encoding gives the
 *   same bytes", which the fuzz test in tests/test_proto.c checks on 200k inputs, and a v1
 *   daemon never silently ignores a field that a later client version might set.
 * - Request checks come in three layers, each a function: header framing (length, magic,
 *   version, opcode and dtype ranges, reserved bytes, name padding: here), field rules per
 *   opcode (tally__validate_fields) and payload rules (validate_payload), both in the validator,
 *   tally_validate.c, which reads the operation table. tally_req_decode runs the first two,
 *   because the daemon decodes the header before it looks at the payload frame;
 *   tally_req_validate runs the last two and is what both sides call on a complete request.
 * - Every rejection writes a sentence naming the offending value into the caller's buffer
 *   (tally__fail); the daemon sends it back as the error reply's payload, so it must make sense
 *   to a user.
 *
 * Pure C11: no allocation, no I/O.
 */
#include "tally_proto.h"
#include "tally_validate.h"

#include <stddef.h>
#include <string.h>

/* ---- Wire offsets ----------------------------------------------------------------------- */

/* Every header (request, reply, publication, side channel) starts with the magic at byte 0
 * and the version at byte 4; a request and its reply also share the next 12 bytes. */
enum {
    HEAD_OFF_MAGIC = 0,
    HEAD_OFF_VERSION = 4,
    HEAD_OFF_OPCODE = 5,
    HEAD_OFF_DTYPE = 6,
    HEAD_OFF_FLAGS = 7,
    HEAD_OFF_REQUEST_ID = 8,
};

enum {
    REQ_OFF_PRED = 16, /* after the 16 bytes it shares with the reply */
    REQ_OFF_STREAM_LEN = 17,
    REQ_OFF_RESERVED_A = 18, /* 18..23 */
    REQ_OFF_LO = 24,
    REQ_OFF_HI = 32,
    REQ_OFF_SEQ = 40,
    REQ_OFF_RESERVED_B = 48, /* 48..63 */
    REQ_OFF_STREAM = 64,     /* 64..127 */
    REQ_PREFIX_SIZE = 16,    /* enough to echo opcode and request id in an error reply */
};

enum {
    REP_OFF_STATUS = 16,     /* after the 16 bytes it shares with the request */
    REP_OFF_RESERVED_A = 20, /* 20..23 */
    REP_OFF_COUNT = 24,
    REP_OFF_AUX0 = 32,
    REP_OFF_AUX1 = 40,
    REP_OFF_RESERVED_B = 48, /* 48..63 */
};

enum {
    INFO_OFF_BATCHES = 0,
    INFO_OFF_ELEMENTS = 8,
    INFO_OFF_BYTES = 16,
    INFO_OFF_FILTER_SEEN = 24,
    INFO_OFF_FILTER_KEPT = 32,
    INFO_OFF_SCAN_CARRY = 40,
    INFO_OFF_SCAN_ELEMENTS = 48,
    INFO_OFF_HIST_DTYPE = 56,
    INFO_OFF_RESERVED_A = 57, /* 57..63 */
    INFO_OFF_HIST_LO = 64,
    INFO_OFF_HIST_HI = 72,
    INFO_OFF_HIST_UNDERFLOW = 80,
    INFO_OFF_HIST_OVERFLOW = 88,
    INFO_OFF_HIST_TOTAL = 96,
    INFO_OFF_LAST_SEQ = 104,
    INFO_OFF_RESERVED_B = 112, /* 112..127 */
    INFO_OFF_BINS = 128,
};

/* ---- Field tables ----------------------------------------------------------------------- */

/* Every message and payload starts its fixed-width fields from one table: a row per field with
 * its byte offset on the wire, its width and where it lives in the struct. The encoder and the
 * decoder of a layout walk the same table, so they cannot disagree about it. A signed 64-bit
 * field travels as its two's-complement bits (memcpy keeps them). */
typedef struct {
    uint16_t wire;   /* byte offset in the buffer */
    uint16_t member; /* offsetof the field in its struct */
    uint8_t width;   /* 1, 4 or 8 bytes, the same in the struct and on the wire */
} wire_field_t;

/* clang-format off */
#define FIELD(off, type, member) \
    {(off), (uint16_t)offsetof(type, member), (uint8_t)sizeof(((type *)0)->member)}
/* clang-format on */
#define COUNT_OF(a) (sizeof(a) / sizeof((a)[0]))

static void put_fields(uint8_t *out, const void *src, const wire_field_t *fields, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const uint8_t *from = (const uint8_t *)src + fields[i].member;
        uint8_t *to = out + fields[i].wire;
        uint32_t v32;
        uint64_t v64;
        if (fields[i].width == 1) {
            *to = *from;
        } else if (fields[i].width == 4) {
            memcpy(&v32, from, 4);
            tally_put_u32(to, v32);
        } else {
            memcpy(&v64, from, 8);
            tally_put_u64(to, v64);
        }
    }
}

static void get_fields(const uint8_t *buf, void *dst, const wire_field_t *fields, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const uint8_t *from = buf + fields[i].wire;
        uint8_t *to = (uint8_t *)dst + fields[i].member;
        uint32_t v32;
        uint64_t v64;
        if (fields[i].width == 1) {
            *to = *from;
        } else if (fields[i].width == 4) {
            v32 = tally_get_u32(from);
            memcpy(to, &v32, 4);
        } else {
            v64 = tally_get_u64(from);
            memcpy(to, &v64, 8);
        }
    }
}

/* The encoders stamp the magic and version over whatever the struct's version says. */
static void head_stamp(uint8_t *out)
{
    tally_put_u32(out + HEAD_OFF_MAGIC, TALLY_MAGIC);
    out[HEAD_OFF_VERSION] = TALLY_PROTO_VERSION;
}

static bool head_is_v1(const uint8_t *buf)
{
    return tally_get_u32(buf + HEAD_OFF_MAGIC) == TALLY_MAGIC &&
           buf[HEAD_OFF_VERSION] == TALLY_PROTO_VERSION;
}

static bool all_zero(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (p[i] != 0)
            return false;
    }
    return true;
}

/* A fixed-size layout: its fields, whether it starts with the magic and version, what a
 * decoded value must satisfy beyond its bytes (NULL: nothing), and up to two spans of reserved
 * bytes [from, to) that must be zero. */
typedef struct {
    size_t size;
    bool head;
    const wire_field_t *fields;
    size_t nfields;
    bool (*valid)(const void *decoded);
    struct {
        uint16_t from, to;
    } reserved[2];
} wire_layout_t;

/* clang-format off */
#define LAYOUT(size, head, fields, valid, ...) \
    {(size), (head), (fields), COUNT_OF(fields), (valid), {__VA_ARGS__}}
/* clang-format on */

/* Writes l->size bytes: the fields, zeros elsewhere, the magic and version when l->head. */
static void layout_encode(const wire_layout_t *l, const void *src, uint8_t *out)
{
    memset(out, 0, l->size);
    put_fields(out, src, l->fields, l->nfields);
    if (l->head)
        head_stamp(out);
}

/* Reads every field of the l->size bytes at buf into dst, whatever they hold; true when the
 * magic, version and reserved bytes are right. */
static bool layout_decode(const wire_layout_t *l, const uint8_t *buf, void *dst)
{
    get_fields(buf, dst, l->fields, l->nfields);
    if (l->head && !head_is_v1(buf))
        return false;
    for (size_t i = 0; i < COUNT_OF(l->reserved); i++) {
        if (!all_zero(buf + l->reserved[i].from, l->reserved[i].to - l->reserved[i].from))
            return false;
    }
    return true;
}

/* The client's side of a whole message of one layout: dst zeroed, then every field read;
 * anything but exactly l->size well-formed bytes that l->valid accepts is TALLY_E_REPLY. */
static tally_status_t layout_decode_reply(const wire_layout_t *l, const uint8_t *buf, size_t len,
                                          void *dst, size_t dst_size)
{
    memset(dst, 0, dst_size);
    if (buf == NULL || len != l->size || !layout_decode(l, buf, dst))
        return TALLY_E_REPLY;
    return l->valid == NULL || l->valid(dst) ? TALLY_OK : TALLY_E_REPLY;
}

/* The public encoder and decoder of a message that is one layout and nothing else:
 *   void NAME_encode(const TYPE *v, uint8_t out[SIZE]) writes the layout's SIZE bytes;
 *   tally_status_t NAME_decode(const uint8_t *buf, size_t len, TYPE *v) is layout_decode_reply. */
/* clang-format off */
#define LAYOUT_CODEC(name, type, layout, size)                                                  \
    void name##_encode(const type *v, uint8_t out[size]) { layout_encode(&(layout), v, out); } \
    tally_status_t name##_decode(const uint8_t *buf, size_t len, type *v)                       \
    {                                                                                           \
        return layout_decode_reply(&(layout), buf, len, v, sizeof *v);                          \
    }
/* clang-format on */

/* ---- Request header --------------------------------------------------------------------- */

/* The first REQ_PREFIX_SIZE bytes (what an error reply echoes), then the rest of the fields;
 * stream_len and the name are written apart, the length clamped to the name's room. */
static const wire_field_t req_prefix_fields[] = {
    FIELD(HEAD_OFF_VERSION, tally_req_t, version), FIELD(HEAD_OFF_OPCODE, tally_req_t, opcode),
    FIELD(HEAD_OFF_DTYPE, tally_req_t, dtype), FIELD(HEAD_OFF_FLAGS, tally_req_t, flags),
    FIELD(HEAD_OFF_REQUEST_ID, tally_req_t, request_id)};
static const wire_field_t req_rest_fields[] = {
    FIELD(REQ_OFF_PRED, tally_req_t, pred), FIELD(REQ_OFF_LO, tally_req_t, lo),
    FIELD(REQ_OFF_HI, tally_req_t, hi), FIELD(REQ_OFF_SEQ, tally_req_t, seq)};

void tally_req_encode(const tally_req_t *req, uint8_t out[TALLY_REQ_HEADER_SIZE])
{
    size_t name_len = req->stream_len;
    if (name_len > TALLY_STREAM_NAME_MAX)
        name_len = TALLY_STREAM_NAME_MAX;

    memset(out, 0, TALLY_REQ_HEADER_SIZE);
    put_fields(out, req, req_prefix_fields, COUNT_OF(req_prefix_fields));
    put_fields(out, req, req_rest_fields, COUNT_OF(req_rest_fields));
    head_stamp(out);
    out[REQ_OFF_STREAM_LEN] = (uint8_t)name_len;
    memcpy(out + REQ_OFF_STREAM, req->stream, name_len);
}

/* The first non-zero byte offset in buf[from..to), or `to` when there is none. Eight bytes a
 * load while they are all zero (a short name leaves up to 63 bytes of padding: a byte at a time
 * was 390 instructions of a shard's request, bench/NOTES.md "A shard's instructions for a 64 B
 * hist"), then byte by byte to the one that is not. */
static size_t first_nonzero(const uint8_t *buf, size_t from, size_t to)
{
    for (uint64_t word; from + 8 <= to; from += 8) {
        memcpy(&word, buf + from, 8);
        if (word)
            break;
    }
    while (from < to && buf[from] == 0)
        from++;
    return from;
}

/* Reads every field of a complete 128-byte header into req, without judging it. */
static void read_req_fields(const uint8_t *buf, tally_req_t *req)
{
    get_fields(buf, req, req_rest_fields, COUNT_OF(req_rest_fields));
    req->stream_len = buf[REQ_OFF_STREAM_LEN];
    size_t copy = req->stream_len;
    if (copy > TALLY_STREAM_NAME_MAX)
        copy = TALLY_STREAM_NAME_MAX;
    memcpy(req->stream, buf + REQ_OFF_STREAM, copy);
    req->stream[copy] = '\0';
}

/* Byte-level checks that the decoded struct cannot express: reserved bytes and name padding. */
static tally_status_t check_req_layout(const uint8_t *buf, const tally_req_t *req, char *msg,
                                       size_t msg_cap)
{
    size_t at = first_nonzero(buf, REQ_OFF_RESERVED_A, REQ_OFF_LO);
    if (at == REQ_OFF_LO) {
        at = first_nonzero(buf, REQ_OFF_RESERVED_B, REQ_OFF_STREAM);
        if (at == REQ_OFF_STREAM)
            at = 0;
    }
    if (at != 0)
        return tally__fail(TALLY_E_PARAM, msg, msg_cap,
                           "reserved header byte %zu is 0x%02x, not zero", at, buf[at]);
    if (req->stream_len > TALLY_STREAM_NAME_MAX)
        return tally__check_stream_name(req, msg, msg_cap);
    at = first_nonzero(buf, REQ_OFF_STREAM + req->stream_len, TALLY_REQ_HEADER_SIZE);
    if (at != TALLY_REQ_HEADER_SIZE)
        return tally__fail(TALLY_E_STREAM_NAME, msg, msg_cap,
                           "header byte %zu after the %u-byte stream name is 0x%02x, not zero", at,
                           req->stream_len, buf[at]);
    return TALLY_OK;
}

tally_status_t tally_req_decode(const uint8_t *buf, size_t len, tally_req_t *req, char *msg,
                                size_t msg_cap)
{
    memset(req, 0, sizeof *req);
    tally__msg_clear(msg, msg_cap);
    if (buf == NULL)
        len = 0;

    /* Step 1: read what is there, so that even a rejected request's reply echoes its id. */
    if (len >= REQ_PREFIX_SIZE)
        get_fields(buf, req, req_prefix_fields, COUNT_OF(req_prefix_fields));
    if (len == TALLY_REQ_HEADER_SIZE)
        read_req_fields(buf, req);

    /* Step 2: framing. */
    if (len != TALLY_REQ_HEADER_SIZE)
        return tally__fail(TALLY_E_HEADER, msg, msg_cap, "request header of %zu bytes, expected %d",
                           len, TALLY_REQ_HEADER_SIZE);
    uint32_t magic = tally_get_u32(buf + HEAD_OFF_MAGIC);
    if (magic != TALLY_MAGIC)
        return tally__fail(TALLY_E_MAGIC, msg, msg_cap,
                           "header starts with bytes %02x %02x %02x %02x, not the magic \"TLYD\"",
                           buf[0], buf[1], buf[2], buf[3]);
    if (req->version != TALLY_PROTO_VERSION)
        return tally__fail(TALLY_E_VERSION, msg, msg_cap,
                           "protocol version %u is not supported; this side speaks version %d",
                           req->version, TALLY_PROTO_VERSION);

    /* Step 3: ranges before layout, so that an unknown opcode is reported as such. */
    tally_status_t st = tally__check_ranges(req, msg, msg_cap);
    if (st == TALLY_OK)
        st = check_req_layout(buf, req, msg, msg_cap);
    if (st != TALLY_OK)
        return st;

    /* Step 4: the per-opcode field rules; the payload is checked once it has arrived. */
    return tally__validate_fields(req, msg, msg_cap);
}

bool tally_req_stream_of(const uint8_t *buf, size_t len, const char **name, size_t *name_len)
{
    if (!buf || len != TALLY_REQ_HEADER_SIZE || tally_get_u32(buf + HEAD_OFF_MAGIC) != TALLY_MAGIC)
        return false;
    size_t n = buf[REQ_OFF_STREAM_LEN];
    if (n == 0 || n > TALLY_STREAM_NAME_MAX)
        return false;
    *name = (const char *)buf + REQ_OFF_STREAM;
    *name_len = n;
    return true;
}

/* ---- Reply header ----------------------------------------------------------------------- */

static const wire_field_t rep_fields[] = {FIELD(HEAD_OFF_VERSION, tally_rep_t, version),
                                          FIELD(HEAD_OFF_OPCODE, tally_rep_t, opcode),
                                          FIELD(HEAD_OFF_DTYPE, tally_rep_t, dtype),
                                          FIELD(HEAD_OFF_FLAGS, tally_rep_t, flags),
                                          FIELD(HEAD_OFF_REQUEST_ID, tally_rep_t, request_id),
                                          FIELD(REP_OFF_STATUS, tally_rep_t, status),
                                          FIELD(REP_OFF_COUNT, tally_rep_t, count),
                                          FIELD(REP_OFF_AUX0, tally_rep_t, aux0),
                                          FIELD(REP_OFF_AUX1, tally_rep_t, aux1)};
/* A status in the client-local range (>= 100) is one a daemon never sends. */
static bool rep_status_from_daemon(const void *rep)
{
    return ((const tally_rep_t *)rep)->status < 100;
}
static const wire_layout_t rep_layout =
    LAYOUT(TALLY_REP_HEADER_SIZE, true, rep_fields, rep_status_from_daemon,
           {REP_OFF_RESERVED_A, REP_OFF_COUNT}, {REP_OFF_RESERVED_B, TALLY_REP_HEADER_SIZE});

/* tally_rep_encode, tally_rep_decode (the client's side: anything but a well-formed v1 reply
 * header is TALLY_E_REPLY). */
LAYOUT_CODEC(tally_rep, tally_rep_t, rep_layout, TALLY_REP_HEADER_SIZE)

/* ---- Query payload ---------------------------------------------------------------------- */

size_t tally_stream_info_size(const tally_stream_info_t *info)
{
    unsigned channels = tally_hist_channels(info->hist_dtype);
    return INFO_OFF_BINS + 8 * TALLY_HIST_BINS * (size_t)(channels ? channels : 1);
}

#define INFO_FIELD(off, member) FIELD(INFO_OFF_##off, tally_stream_info_t, member)
static const wire_field_t info_fields[] = {INFO_FIELD(BATCHES, batches),
                                           INFO_FIELD(ELEMENTS, elements),
                                           INFO_FIELD(BYTES, bytes),
                                           INFO_FIELD(FILTER_SEEN, filter_seen),
                                           INFO_FIELD(FILTER_KEPT, filter_kept),
                                           INFO_FIELD(SCAN_CARRY, scan_carry),
                                           INFO_FIELD(SCAN_ELEMENTS, scan_elements),
                                           INFO_FIELD(HIST_DTYPE, hist_dtype),
                                           INFO_FIELD(HIST_LO, hist_lo),
                                           INFO_FIELD(HIST_HI, hist_hi),
                                           INFO_FIELD(HIST_UNDERFLOW, hist_underflow),
                                           INFO_FIELD(HIST_OVERFLOW, hist_overflow),
                                           INFO_FIELD(HIST_TOTAL, hist_total),
                                           INFO_FIELD(LAST_SEQ, last_seq)};
/* The fixed part before the bins. */
static const wire_layout_t info_layout =
    LAYOUT(INFO_OFF_BINS, false, info_fields, NULL, {INFO_OFF_RESERVED_A, INFO_OFF_HIST_LO},
           {INFO_OFF_RESERVED_B, INFO_OFF_BINS});

void tally_stream_info_encode_head(const tally_stream_info_t *info, uint8_t *out)
{
    layout_encode(&info_layout, info, out);
}

size_t tally_stream_info_encode(const tally_stream_info_t *info, uint8_t *out)
{
    size_t size = tally_stream_info_size(info);
    layout_encode(&info_layout, info, out);
    tally_put_u64s(out + INFO_OFF_BINS, info->bins, (size - INFO_OFF_BINS) / 8);
    return size;
}

static bool hist_dtype_known(uint8_t dtype)
{
    return dtype == TALLY_DTYPE_NONE || tally_hist_channels(dtype) != 0;
}

/* Client side, like tally_rep_decode: a histogram dtype that hist does not take, a length
 * other than the record size that dtype implies, or non-zero padding is TALLY_E_REPLY. */
tally_status_t tally_stream_info_decode(const uint8_t *buf, size_t len, tally_stream_info_t *info)
{
    memset(info, 0, sizeof *info);
    if (buf == NULL || len < TALLY_QUERY_PAYLOAD_SIZE)
        return TALLY_E_REPLY;
    info->hist_dtype = buf[INFO_OFF_HIST_DTYPE];
    if (!hist_dtype_known(info->hist_dtype) || len != tally_stream_info_size(info)) {
        info->hist_dtype = 0;
        return TALLY_E_REPLY;
    }
    bool layout_ok = layout_decode(&info_layout, buf, info);
    tally_get_u64s(info->bins, buf + INFO_OFF_BINS, (len - INFO_OFF_BINS) / 8);
    return layout_ok ? TALLY_OK : TALLY_E_REPLY;
}

_Static_assert(TALLY_STREAM_INFO_HEAD_SIZE == INFO_OFF_BINS, "the head is what precedes the bins");

tally_status_t tally_stream_info_decode_head(const uint8_t *buf, tally_stream_info_t *info)
{
    info->hist_dtype = buf[INFO_OFF_HIST_DTYPE];
    if (!hist_dtype_known(info->hist_dtype))
        return TALLY_E_REPLY;
    return layout_decode(&info_layout, buf, info) ? TALLY_OK : TALLY_E_REPLY;
}

/* ---- Publications ----------------------------------------------------------------------- */

enum {
    PUB_OFF_KIND = 5,       /* after the magic and version */
    PUB_OFF_RESERVED_A = 6, /* 6..7 */
    PUB_OFF_SEQ = 8,
    PUB_OFF_TIME = 16,
    PUB_OFF_INTERVAL = 24,
    PUB_OFF_RESERVED_B = 32, /* 32..63 */
};

static const wire_field_t pub_fields[] = {
    FIELD(PUB_OFF_KIND, tally_pub_t, kind), FIELD(PUB_OFF_SEQ, tally_pub_t, pub_seq),
    FIELD(PUB_OFF_TIME, tally_pub_t, time_ms), FIELD(PUB_OFF_INTERVAL, tally_pub_t, interval_ms)};
static bool pub_kind_known(const void *pub)
{
    uint8_t kind = ((const tally_pub_t *)pub)->kind;
    return kind == TALLY_PUB_UPDATE || kind == TALLY_PUB_DELETED;
}
static const wire_layout_t pub_layout =
    LAYOUT(TALLY_PUB_HEADER_SIZE, true, pub_fields, pub_kind_known,
           {PUB_OFF_RESERVED_A, PUB_OFF_SEQ}, {PUB_OFF_RESERVED_B, TALLY_PUB_HEADER_SIZE});

/* tally_pub_encode, tally_pub_decode. */
LAYOUT_CODEC(tally_pub, tally_pub_t, pub_layout, TALLY_PUB_HEADER_SIZE)

/* ---- Shared memory ---------------------------------------------------------------------- */

enum {
    REF_OFF_IN_HANDLE = 0,
    REF_OFF_IN_OFFSET = 8,
    REF_OFF_IN_LENGTH = 16,
    REF_OFF_OUT_HANDLE = 24,
    REF_OFF_OUT_OFFSET = 32,
    REF_OFF_OUT_LENGTH = 40,
};

enum {
    SHM_OFF_OP = 5,     /* after the magic and version */
    SHM_OFF_ID_LEN = 6, /* request; reserved (zero) in the answer */
    SHM_OFF_RESERVED = 7,
    SHM_OFF_HANDLE = 8, /* request */
    SHM_OFF_ID = 16,    /* request */
    ANS_OFF_STATUS = 8,
    ANS_OFF_RESERVED = 12, /* 12..15 */
    ANS_OFF_HANDLE = 16,
    ANS_OFF_SIZE = 24,
};

#define REF_FIELD(off, member) FIELD(REF_OFF_##off, tally_shm_ref_t, member)
static const wire_field_t ref_fields[] = {
    REF_FIELD(IN_HANDLE, in_handle),   REF_FIELD(IN_OFFSET, in_offset),
    REF_FIELD(IN_LENGTH, in_length),   REF_FIELD(OUT_HANDLE, out_handle),
    REF_FIELD(OUT_OFFSET, out_offset), REF_FIELD(OUT_LENGTH, out_length)};

void tally_shm_ref_encode(const tally_shm_ref_t *ref, uint8_t out[TALLY_SHM_REF_SIZE])
{
    put_fields(out, ref, ref_fields, COUNT_OF(ref_fields));
}

tally_status_t tally_shm_ref_decode(const uint8_t *buf, size_t len, tally_shm_ref_t *ref, char *msg,
                                    size_t msg_cap)
{
    tally__msg_clear(msg, msg_cap);
    memset(ref, 0, sizeof *ref);
    if (len != TALLY_SHM_REF_SIZE)
        return tally__fail(TALLY_E_PAYLOAD, msg, msg_cap,
                           "a shared-memory reference is %d bytes (got %zu)", TALLY_SHM_REF_SIZE,
                           len);
    get_fields(buf, ref, ref_fields, COUNT_OF(ref_fields));
    return TALLY_OK;
}

/* The side channel's request and answer share the magic, version and op (PROTOCOL.md §10). */
static const wire_field_t shm_msg_fields[] = {FIELD(SHM_OFF_OP, tally_shm_msg_t, op),
                                              FIELD(SHM_OFF_ID_LEN, tally_shm_msg_t, id_len),
                                              FIELD(SHM_OFF_HANDLE, tally_shm_msg_t, handle)};
static const wire_field_t shm_answer_fields[] = {FIELD(SHM_OFF_OP, tally_shm_answer_t, op),
                                                 FIELD(ANS_OFF_STATUS, tally_shm_answer_t, status),
                                                 FIELD(ANS_OFF_HANDLE, tally_shm_answer_t, handle),
                                                 FIELD(ANS_OFF_SIZE, tally_shm_answer_t, size)};
static const wire_layout_t shm_msg_layout =
    LAYOUT(TALLY_SHM_MSG_HEADER, true, shm_msg_fields, NULL, {0, 0});
/* Byte 6 (the request's id_len) and 7, then 12..15, are zero in an answer. */
static const wire_layout_t shm_answer_layout =
    LAYOUT(TALLY_SHM_ANSWER_SIZE, true, shm_answer_fields, NULL, {SHM_OFF_ID_LEN, SHM_OFF_HANDLE},
           {ANS_OFF_RESERVED, ANS_OFF_HANDLE});

/* Op 3's block after the routing id (PROTOCOL.md §10 "Device memory"). */
enum {
    DEV_OFF_SIZE = 0,
    DEV_OFF_UUID = 8,
    DEV_OFF_FLAGS = 24,
    DEV_OFF_RESERVED = 28,
    DEV_OFF_EVENT = 32
};

size_t tally_shm_msg_encode(const tally_shm_msg_t *m, uint8_t out[TALLY_SHM_MSG_MAX])
{
    layout_encode(&shm_msg_layout, m, out);
    memcpy(out + SHM_OFF_ID, m->id, m->id_len);
    size_t len = TALLY_SHM_MSG_HEADER + m->id_len;
    if (m->op != TALLY_SHM_OP_REGISTER_DEVICE)
        return len;
    uint8_t *dev = out + len;
    memset(dev, 0, TALLY_SHM_DEV_SIZE);
    tally_put_u64(dev + DEV_OFF_SIZE, m->dev_size);
    memcpy(dev + DEV_OFF_UUID, m->gpu_uuid, TALLY_GPU_UUID_SIZE);
    tally_put_u32(dev + DEV_OFF_FLAGS, m->dev_flags);
    memcpy(dev + DEV_OFF_EVENT, m->event, TALLY_GPU_EVENT_SIZE);
    return len + TALLY_SHM_DEV_SIZE;
}

/* Op 3's block at dev (its length already checked). */
static tally_status_t dev_decode(const uint8_t *dev, tally_shm_msg_t *m, char *msg, size_t msg_cap)
{
    m->dev_size = tally_get_u64(dev + DEV_OFF_SIZE);
    memcpy(m->gpu_uuid, dev + DEV_OFF_UUID, TALLY_GPU_UUID_SIZE);
    m->dev_flags = tally_get_u32(dev + DEV_OFF_FLAGS);
    memcpy(m->event, dev + DEV_OFF_EVENT, TALLY_GPU_EVENT_SIZE);
    if (m->dev_size == 0)
        return tally__fail(TALLY_E_PARAM, msg, msg_cap, "device region of size 0");
    if (m->dev_flags & ~(TALLY_SHM_DEV_EVENT | TALLY_SHM_DEV_OUTPUT))
        return tally__fail(TALLY_E_PARAM, msg, msg_cap, "unknown device-region flags 0x%x",
                           (unsigned)m->dev_flags);
    if (!all_zero(dev + DEV_OFF_RESERVED, 4))
        return tally__fail(TALLY_E_PARAM, msg, msg_cap,
                           "reserved device-region bytes are not zero");
    if (!(m->dev_flags & TALLY_SHM_DEV_EVENT) && !all_zero(m->event, TALLY_GPU_EVENT_SIZE))
        return tally__fail(TALLY_E_PARAM, msg, msg_cap, "an event handle without DEV_EVENT");
    return TALLY_OK;
}

tally_status_t tally_shm_msg_decode(const uint8_t *buf, size_t len, tally_shm_msg_t *m, char *msg,
                                    size_t msg_cap)
{
    tally__msg_clear(msg, msg_cap);
    memset(m, 0, sizeof *m);
    if (len < TALLY_SHM_MSG_HEADER)
        return tally__fail(TALLY_E_HEADER, msg, msg_cap,
                           "side-channel message of %zu bytes is short", len);
    /* Read first, so that the answer to a message refused for its magic or version echoes its
     * op too (PROTOCOL.md §10), as a reply echoes a request's opcode (§3). */
    get_fields(buf, m, shm_msg_fields, COUNT_OF(shm_msg_fields));
    if (tally_get_u32(buf + HEAD_OFF_MAGIC) != TALLY_MAGIC)
        return tally__fail(TALLY_E_MAGIC, msg, msg_cap, "side-channel message without the magic");
    if (buf[HEAD_OFF_VERSION] != TALLY_PROTO_VERSION)
        return tally__fail(TALLY_E_VERSION, msg, msg_cap,
                           "side-channel version %u is not supported", buf[HEAD_OFF_VERSION]);
    if (m->op != TALLY_SHM_OP_REGISTER && m->op != TALLY_SHM_OP_RELEASE &&
        m->op != TALLY_SHM_OP_REGISTER_DEVICE)
        return tally__fail(TALLY_E_OPCODE, msg, msg_cap, "unknown side-channel operation %u",
                           m->op);
    if (buf[SHM_OFF_RESERVED] != 0)
        return tally__fail(TALLY_E_PARAM, msg, msg_cap, "reserved byte 7 is not zero");
    bool reg = m->op != TALLY_SHM_OP_RELEASE;
    bool dev = m->op == TALLY_SHM_OP_REGISTER_DEVICE;
    if (reg && (m->id_len == 0 || m->handle != 0))
        return tally__fail(TALLY_E_PARAM, msg, msg_cap, "register needs a routing id and handle 0");
    if (!reg && m->id_len != 0)
        return tally__fail(TALLY_E_PARAM, msg, msg_cap, "release takes no routing id");
    size_t want = TALLY_SHM_MSG_HEADER + (size_t)m->id_len + (dev ? TALLY_SHM_DEV_SIZE : 0);
    if (len != want)
        return tally__fail(TALLY_E_HEADER, msg, msg_cap,
                           "side-channel message of %zu bytes, expected %d + %u%s", len,
                           TALLY_SHM_MSG_HEADER, m->id_len, dev ? " + 96" : "");
    memcpy(m->id, buf + SHM_OFF_ID, m->id_len);
    return dev ? dev_decode(buf + SHM_OFF_ID + m->id_len, m, msg, msg_cap) : TALLY_OK;
}

void tally_shm_answer_encode(const tally_shm_answer_t *a, uint8_t out[TALLY_SHM_ANSWER_SIZE])
{
    layout_encode(&shm_answer_layout, a, out);
}

tally_status_t tally_shm_answer_decode(const uint8_t *buf, size_t len, tally_shm_answer_t *a)
{
    memset(a, 0, sizeof *a);
    if (len < TALLY_SHM_ANSWER_SIZE)
        return TALLY_E_REPLY;
    if (!layout_decode(&shm_answer_layout, buf, a)) {
        memset(a, 0, sizeof *a); /* a malformed answer leaves nothing behind */
        return TALLY_E_REPLY;
    }
    return a->status < 100 ? TALLY_OK : TALLY_E_REPLY;
}
