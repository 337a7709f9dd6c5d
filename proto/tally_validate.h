/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_validate.h — the validator's pieces that the codec (tally_proto.c) calls while it
 * decodes a header, and the one way proto/ writes a refusal's sentence. Private to proto/: not
 * installed, not copied into tally_wire.h; the `tally__` prefix marks them (they are hidden in
 * libtally, like the rest of proto/ but the TALLY_API functions).
 *
 * The floors of proto/, each calling only those below it (tests/test_walls.sh):
 *   tally_proto.c     the codec: headers and payloads to and from bytes
 *   tally_validate.c  the validator: a request against its row, names, shared-memory references
 *   tally_ops.c       the operation table
 *   tally_types.c     the numbers' names and sizes
 * The public validation functions (tally_req_validate, tally_shm_ref_validate,
 * tally_stream_name_valid, tally_req_set_stream) are declared in tally_proto.h.
 */
#ifndef TALLY_VALIDATE_H
#define TALLY_VALIDATE_H

#include "tally_proto.h"

#include <stddef.h>

/* Writes the sentence (printf's fmt and what follows) into msg when msg is not NULL and
 * msg_cap > 0, and returns status: `return tally__fail(TALLY_E_PARAM, msg, msg_cap, ...)`. */
#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
tally_status_t
tally__fail(tally_status_t status, char *msg, size_t msg_cap, const char *fmt, ...);
/* Empties msg (when there is one): a call that succeeds leaves no old sentence behind. */
void tally__msg_clear(char *msg, size_t msg_cap);

/* The opcode and dtype are ones this version knows: TALLY_E_OPCODE, TALLY_E_DTYPE or TALLY_OK. */
tally_status_t tally__check_ranges(const tally_req_t *req, char *msg, size_t msg_cap);
/* Why req's stream name is invalid: TALLY_E_STREAM_NAME, or TALLY_OK when it is valid or absent. */
tally_status_t tally__check_stream_name(const tally_req_t *req, char *msg, size_t msg_cap);
/* Every rule but the payload's: the ranges, the stream name, then the operation's row (the dtype,
 * the rule for flags, pred, lo and hi, the stream, then seq). tally_req_decode's last step. */
tally_status_t tally__validate_fields(const tally_req_t *req, char *msg, size_t msg_cap);

#endif /* TALLY_VALIDATE_H */
