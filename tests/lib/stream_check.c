/* SPDX-License-Identifier: Apache-2.0 */
/* stream_check.c — see stream_check.h. */
#include "stream_check.h"

#include <inttypes.h>
#include <stdio.h>

const char *th_stream_differs(tally_client_t *c, const char *name, uint64_t last_seq,
                              const uint64_t bins[256], char *why, size_t cap)
{
    tally_stream_info_t info;
    tally_status_t st = tally_query(c, name, &info);
    if (st != TALLY_OK) {
        snprintf(why, cap, "query %s: %s: %s", name, tally_status_name(st), tally_client_error(c));
        return why;
    }
    if (info.last_seq != last_seq) {
        snprintf(why, cap, "%s: last_seq %" PRIu64 ", not %" PRIu64, name, info.last_seq, last_seq);
        return why;
    }
    for (int b = 0; b < 256; b++)
        if (info.bins[b] != bins[b]) {
            snprintf(why, cap, "%s: bin %d holds %" PRIu64 ", not %" PRIu64, name, b, info.bins[b],
                     bins[b]);
            return why;
        }
    return NULL;
}
