/* SPDX-License-Identifier: Apache-2.0 */
/*
 * fuzz_proto.c — a libFuzzer target for the pure decoders of proto/: the request header decoder
 * and validator (what tallyd runs on every message it reads), the reply header decoder and the
 * `query` record decoder (what libtally runs on every reply).
 *
 * Input layout (every byte string is a valid input; the first byte picks the decoder):
 *   data[0] % 3 == 0  request: data[1] = header length L; then L header bytes (fewer if the
 *                     input ends first); the rest is the payload, whose length is validated
 *                     against FUZZ_MAX_BATCH (small, so that too_large is reachable)
 *   data[0] % 3 == 1  reply header: data[1..] is the frame
 *   data[0] % 3 == 2  query record: data[1..] is the payload
 * tests/fuzz/make_corpus.c writes seeds in this layout.
 *
 * Beyond "no crash, no sanitizer report", each input is checked against the properties
 * PROTOCOL.md promises, and a violation aborts (libFuzzer saves the input):
 * - a status is OK or a wire status; an error comes with a message, OK with none;
 * - a request reply can echo opcode, flags and request_id exactly when the frame has >= 16
 *   bytes (§3), and they are 0 otherwise;
 * - decode OK implies a 128-byte frame that re-encodes to the same bytes and a struct that
 *   tally_req_validate accepts; the payload verdict matches §5 (size first, then shape);
 * - replies and query records decode OK only at their exact size, and then re-encode to the
 *   same bytes.
 * Built with clang -fsanitize=fuzzer,address,undefined when clang can (tests/fuzz/CMakeLists.txt),
 * and always with replay_main.c as a plain program that runs the seed corpus in CTest.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally_proto.h"

#define FUZZ_MAX_BATCH 1024u

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "fuzz_proto: property violated at %s:%d: %s\n", __FILE__, __LINE__,    \
                    #cond);                                                                        \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

static void check_message(tally_status_t st, const char *msg, size_t cap)
{
    CHECK(memchr(msg, '\0', cap) != NULL); /* always terminated within the buffer */
    CHECK((st == TALLY_OK) == (msg[0] == '\0'));
}

static bool takes_payload(uint8_t opcode)
{
    return opcode == TALLY_OP_FILTER || opcode == TALLY_OP_SCAN || opcode == TALLY_OP_HIST ||
           opcode == TALLY_OP_MINMAX;
}

/* §5/§6 step 8, independently of tally_proto.c: the verdict on the payload of an accepted header.
 */
static tally_status_t expected_payload_status(const tally_req_t *req, size_t len)
{
    /* A shared-memory reference is exactly its descriptor, whatever max_batch says. */
    if (req->flags & TALLY_FLAG_SHM_REF)
        return len == TALLY_SHM_REF_SIZE ? TALLY_OK : TALLY_E_PAYLOAD;
    if (len > FUZZ_MAX_BATCH)
        return TALLY_E_TOO_LARGE;
    if (!takes_payload(req->opcode))
        return len == 0 ? TALLY_OK : TALLY_E_PAYLOAD;
    size_t elem = tally_dtype_size((tally_dtype_t)req->dtype);
    return elem != 0 && len % elem == 0 ? TALLY_OK : TALLY_E_PAYLOAD;
}

static void fuzz_request(const uint8_t *data, size_t size)
{
    size_t hlen = size > 0 ? data[0] : 0;
    const uint8_t *header = size > 0 ? data + 1 : data;
    size_t avail = size > 0 ? size - 1 : 0;
    if (hlen > avail)
        hlen = avail;
    size_t payload_len = avail - hlen;

    tally_req_t req;
    char msg[TALLY_ERROR_MESSAGE_MAX + 1];
    memset(msg, 'x', sizeof msg);
    tally_status_t st = tally_req_decode(header, hlen, &req, msg, sizeof msg);
    CHECK(st == TALLY_OK || (st >= TALLY_E_HEADER && st < TALLY_STATUS_WIRE_COUNT));
    /* The stream tallyd routes by (issue 31): a valid request's, read without decoding. */
    const char *name = NULL;
    size_t name_len = 0;
    bool named = tally_req_stream_of(header, hlen, &name, &name_len);
    CHECK(!named || (name_len >= 1 && name_len <= TALLY_STREAM_NAME_MAX));
    if (st == TALLY_OK)
        CHECK(named == (req.stream_len > 0) &&
              (!named || (name_len == req.stream_len && !memcmp(name, req.stream, name_len))));
    CHECK(st != TALLY_E_FRAMES && st != TALLY_E_TOO_LARGE && st != TALLY_E_PAYLOAD);
    check_message(st, msg, sizeof msg);

    /* What every reply echoes (PROTOCOL.md §3). */
    if (hlen >= 16) {
        CHECK(req.opcode == header[5] && req.flags == header[7]);
        CHECK(req.request_id == tally_get_u64(header + 8));
    } else {
        CHECK(req.opcode == 0 && req.flags == 0 && req.request_id == 0);
        CHECK(st == TALLY_E_HEADER);
    }
    if (hlen != TALLY_REQ_HEADER_SIZE)
        CHECK(st == TALLY_E_HEADER);
    /* A short message buffer truncates but never changes the verdict. */
    char small[8];
    tally_req_t again_req;
    CHECK(tally_req_decode(header, hlen, &again_req, small, sizeof small) == st);
    CHECK(memchr(small, '\0', sizeof small) != NULL);
    CHECK(tally_req_decode(header, hlen, &again_req, NULL, 0) == st);
    if (st != TALLY_OK)
        return;

    uint8_t again[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(&req, again);
    CHECK(memcmp(again, header, TALLY_REQ_HEADER_SIZE) == 0);
    CHECK(req.stream_len <= TALLY_STREAM_NAME_MAX);
    CHECK(strlen(req.stream) == req.stream_len);
    CHECK(req.stream_len == 0 || tally_stream_name_valid(req.stream, req.stream_len));
    /* Any other decoded request may have an empty payload. */
    size_t least = (req.flags & TALLY_FLAG_SHM_REF) ? TALLY_SHM_REF_SIZE : 0;
    CHECK(tally_req_validate(&req, least, SIZE_MAX, NULL, 0) == TALLY_OK);

    st = tally_req_validate(&req, payload_len, FUZZ_MAX_BATCH, msg, sizeof msg);
    check_message(st, msg, sizeof msg);
    CHECK(st == expected_payload_status(&req, payload_len));
}

static void fuzz_reply(const uint8_t *data, size_t size)
{
    tally_rep_t rep;
    tally_status_t st = tally_rep_decode(data, size, &rep);
    CHECK(st == TALLY_OK || st == TALLY_E_REPLY);
    if (size != TALLY_REP_HEADER_SIZE)
        CHECK(st == TALLY_E_REPLY);
    if (st != TALLY_OK)
        return;
    CHECK(rep.version == TALLY_PROTO_VERSION && rep.status < 100);
    CHECK(tally_status_name((tally_status_t)rep.status) != NULL);
    uint8_t again[TALLY_REP_HEADER_SIZE];
    tally_rep_encode(&rep, again);
    CHECK(memcmp(again, data, TALLY_REP_HEADER_SIZE) == 0);
}

static void fuzz_stream_info(const uint8_t *data, size_t size)
{
    /* Static: the record is 2 KiB, and libFuzzer runs one input at a time. */
    static tally_stream_info_t info;
    static uint8_t again[TALLY_QUERY_PAYLOAD_MAX];
    tally_status_t st = tally_stream_info_decode(data, size, &info);
    CHECK(st == TALLY_OK || st == TALLY_E_REPLY);
    if (st != TALLY_OK)
        return;
    /* A record's length is the one its histogram's channels give (1, 3, 4 x 2048 + 128). */
    CHECK(info.hist_dtype == TALLY_DTYPE_NONE || tally_hist_channels(info.hist_dtype) != 0);
    CHECK(size == tally_stream_info_size(&info));
    CHECK(tally_stream_info_encode(&info, again) == size);
    CHECK(memcmp(again, data, size) == 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    switch (data[0] % 3) {
    case 0:
        fuzz_request(data + 1, size - 1);
        break;
    case 1:
        fuzz_reply(data + 1, size - 1);
        break;
    default:
        fuzz_stream_info(data + 1, size - 1);
        break;
    }
    return 0;
}
