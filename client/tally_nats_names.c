/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_nats_names.c — the names of the members' `streams` answers, merged for
 * tally_nats_streams (PROTOCOL.md §13 "Answers by request-reply"). On the bottom floor: it calls
 * nothing of libtally's, so tally_nats.c may call it without a circle.
 */
#include <stdlib.h>
#include <string.h>

#include <nats/nats.h>

#include "tally.h"
#include "tally_client_nats.h"

tally_status_t tally__nats_merge_names(natsMsg *m, char ***names, size_t *count, size_t *cap)
{
    const uint8_t *p = (const uint8_t *)natsMsg_GetData(m) + TALLY_REP_HEADER_SIZE;
    size_t len = (size_t)natsMsg_GetDataLength(m) - TALLY_REP_HEADER_SIZE;
    for (size_t at = 0; at < len; at += 1 + p[at]) {
        if (p[at] == 0 || at + 1 + p[at] > len)
            return TALLY_E_REPLY;
        bool seen = false;
        for (size_t i = 0; i < *count && !seen; i++)
            seen = strlen((*names)[i]) == p[at] && memcmp((*names)[i], p + at + 1, p[at]) == 0;
        if (seen) /* two members during a hand-over */
            continue;
        if (*count == *cap) {
            size_t grown_cap = *cap ? 2 * *cap : 64;
            char **grown = realloc(*names, grown_cap * sizeof *grown);
            if (!grown)
                return TALLY_E_NOMEM;
            *names = grown;
            *cap = grown_cap;
        }
        if (!((*names)[*count] = strndup((const char *)p + at + 1, p[at])))
            return TALLY_E_NOMEM;
        (*count)++;
    }
    return TALLY_OK;
}
