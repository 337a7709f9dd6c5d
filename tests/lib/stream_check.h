/* SPDX-License-Identifier: Apache-2.0 */
/*
 * stream_check.h — whether a stream, as a client's `query` reports it, equals a test's model of
 * it: its last_seq and its 256 u8 histogram bins (the fleet tests' models: test_nats_route.c,
 * test_nats_changelog.c).
 */
#ifndef TALLY_TEST_STREAM_CHECK_H
#define TALLY_TEST_STREAM_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include "tally.h"

/* NULL when `name` answers the query with last_seq and bins; otherwise what differs, written
 * into why (cap bytes) and returned. */
const char *th_stream_differs(tally_client_t *c, const char *name, uint64_t last_seq,
                              const uint64_t bins[256], char *why, size_t cap);

#endif
