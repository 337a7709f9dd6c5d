/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_buf.c — tally_buf_t, tally.h's growable output buffer: tally_run appends the chunks'
 * output to it, and the renderings (tally_hist.c, tally_json.c) print into it. Its capacity
 * doubles from 4 KiB, so appending n bytes copies O(n); a caller that knows the size reserves it
 * once (tally_run does, from the operation's row).
 */
#include "tally.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void tally_buf_free(tally_buf_t *buf)
{
    if (!buf)
        return;
    free(buf->data);
    memset(buf, 0, sizeof *buf);
}

tally_status_t tally_buf_reserve(tally_buf_t *buf, size_t extra)
{
    if (!buf || extra > SIZE_MAX - buf->len)
        return TALLY_E_ARG;
    size_t need = buf->len + extra;
    if (need <= buf->cap)
        return TALLY_OK;
    size_t cap = buf->cap ? buf->cap : 4096;
    while (cap < need)
        cap = cap > SIZE_MAX / 2 ? need : cap * 2;
    uint8_t *data = realloc(buf->data, cap);
    if (!data)
        return TALLY_E_NOMEM;
    buf->data = data;
    buf->cap = cap;
    return TALLY_OK;
}

tally_status_t tally_buf_append(tally_buf_t *buf, const void *data, size_t len)
{
    tally_status_t status = tally_buf_reserve(buf, len);
    if (status != TALLY_OK)
        return status;
    if (len)
        memcpy(buf->data + buf->len, data, len);
    buf->len += len;
    return TALLY_OK;
}

tally_status_t tally_buf_printf(tally_buf_t *buf, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (!buf || n < 0)
        return TALLY_E_ARG;
    /* Room for vsnprintf's terminator too; it stays after the text, not counted in len. */
    tally_status_t status = tally_buf_reserve(buf, (size_t)n + 1);
    if (status != TALLY_OK)
        return status;
    va_start(ap, fmt);
    vsnprintf((char *)buf->data + buf->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    buf->len += (size_t)n;
    return TALLY_OK;
}
