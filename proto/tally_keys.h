/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_keys.h — CURVE key files, shared by tallyd, libtally and the `tally` CLI (PROTOCOL.md
 * §12). Pure C on files and strings: no ZeroMQ inside.
 *
 * A key is ZeroMQ's Z85 text of a 32-byte CURVE key: 40 characters. A key file is CZMQ's
 * certificate format, which `tally keygen` writes and zcert/zauth tools read:
 *
 *     # comments
 *     metadata
 *     curve
 *         public-key = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
 *         secret-key = "JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6"
 *
 * (the secret-key line only in the secret file), or a file whose one non-comment line is the
 * key itself. Comment lines start with '#'.
 */
#ifndef TALLY_KEYS_H
#define TALLY_KEYS_H

#include <stdbool.h>
#include <stddef.h>

#include "tally_proto.h"

#define TALLY_KEY_LEN 40 /* Z85 characters of a CURVE key */

/* True when text[0..len) is a well-formed Z85 CURVE key: 40 characters of Z85's alphabet, each
 * 5 of them a number under 2^32 (what zmq_z85_decode decodes). */
bool tally_key_valid(const char *text, size_t len);

/* Parses a key file's text: the public key and the secret key it holds (either may be absent:
 * the output is then ""). A bare key line counts as public unless bare_is_secret. TALLY_E_PARAM
 * with msg for a malformed key or a file with no key at all. */
tally_status_t tally_key_parse(const char *text, bool bare_is_secret,
                               char public_key[TALLY_KEY_LEN + 1],
                               char secret_key[TALLY_KEY_LEN + 1], char *msg, size_t msg_cap);

/* Reads and parses a key file. With secret, the file must hold a secret key and must not be
 * accessible to group or others (TALLY_E_PARAM, with the chmod to run, otherwise), checked in
 * that order: a public file given as the secret one is named as such whatever its mode.
 * TALLY_E_IO when it cannot be read. msg names the file. */
tally_status_t tally_key_file_read(const char *path, bool secret,
                                   char public_key[TALLY_KEY_LEN + 1],
                                   char secret_key[TALLY_KEY_LEN + 1], char *msg, size_t msg_cap);

#endif
