/*
 * td_stream.c — the stream table: a chained hash table (FNV-1a, power-of-two buckets that
 * double when the load passes 1) plus a doubly-linked list in creation order, so `streams`
 * lists streams in a stable order and removal is O(1).
 */
#include <stdlib.h>
#include <string.h>

#include "td_hash.h"
#include "td_stream.h"

struct td_streams {
    td_stream_t **buckets;
    size_t bucket_count; /* a power of two */
    unsigned count;
    unsigned max_streams;
    unsigned window_intervals;
    uint32_t window_interval_ms;
    td_stream_t *list_head;
    td_stream_t *list_tail;
};

td_err_t td_streams_new(unsigned max_streams, td_streams_t **out)
{
    td_streams_t *self = calloc(1, sizeof *self);
    if (!self)
        return TD_ERR_NOMEM;
    self->bucket_count = 64;
    self->buckets = calloc(self->bucket_count, sizeof *self->buckets);
    if (!self->buckets) {
        free(self);
        return TD_ERR_NOMEM;
    }
    self->max_streams = max_streams;
    *out = self;
    return TD_OK;
}

void td_streams_destroy(td_streams_t **self_p)
{
    td_streams_t *self = *self_p;
    if (!self)
        return;
    td_stream_t *s = self->list_head;
    while (s) {
        td_stream_t *next = s->list_next;
        td_window_destroy(&s->window);
        free(s);
        s = next;
    }
    free(self->buckets);
    free(self);
    *self_p = NULL;
}

td_stream_t *td_streams_find(td_streams_t *self, const char *name, size_t len)
{
    size_t slot = td_fnv1a64(name, len) & (self->bucket_count - 1);
    for (td_stream_t *s = self->buckets[slot]; s; s = s->hash_next)
        if (s->name_len == len && memcmp(s->name, name, len) == 0)
            return s;
    return NULL;
}

/* Doubles the bucket array; on allocation failure the table simply stays denser. */
static void grow(td_streams_t *self)
{
    size_t count = self->bucket_count * 2;
    td_stream_t **buckets = calloc(count, sizeof *buckets);
    if (!buckets)
        return;
    for (td_stream_t *s = self->list_head; s; s = s->list_next) {
        size_t slot = td_fnv1a64(s->name, s->name_len) & (count - 1);
        s->hash_next = buckets[slot];
        buckets[slot] = s;
    }
    free(self->buckets);
    self->buckets = buckets;
    self->bucket_count = count;
}

tally_status_t td_streams_get(td_streams_t *self, const char *name, size_t len, td_stream_t **out)
{
    td_stream_t *s = td_streams_find(self, name, len);
    if (s) {
        *out = s;
        return TALLY_OK;
    }
    if (self->count >= self->max_streams || len == 0 || len > TALLY_STREAM_NAME_MAX)
        return len == 0 || len > TALLY_STREAM_NAME_MAX ? TALLY_E_STREAM_NAME : TALLY_E_LIMIT;
    s = calloc(1, sizeof *s);
    if (!s)
        return TALLY_E_INTERNAL;
    memcpy(s->name, name, len);
    s->name_len = len;
    if (self->count + 1 > self->bucket_count)
        grow(self);
    size_t slot = td_fnv1a64(name, len) & (self->bucket_count - 1);
    s->hash_next = self->buckets[slot];
    self->buckets[slot] = s;
    s->list_prev = self->list_tail;
    if (self->list_tail)
        self->list_tail->list_next = s;
    else
        self->list_head = s;
    self->list_tail = s;
    self->count++;
    *out = s;
    return TALLY_OK;
}

void td_streams_remove(td_streams_t *self, td_stream_t **stream_p)
{
    td_stream_t *s = *stream_p;
    size_t slot = td_fnv1a64(s->name, s->name_len) & (self->bucket_count - 1);
    td_stream_t **link = &self->buckets[slot];
    while (*link && *link != s)
        link = &(*link)->hash_next;
    if (*link)
        *link = s->hash_next;
    if (s->list_prev)
        s->list_prev->list_next = s->list_next;
    else
        self->list_head = s->list_next;
    if (s->list_next)
        s->list_next->list_prev = s->list_prev;
    else
        self->list_tail = s->list_prev;
    self->count--;
    td_window_destroy(&s->window);
    free(s);
    *stream_p = NULL;
}

unsigned td_streams_count(const td_streams_t *self)
{
    return self->count;
}

void td_streams_set_max(td_streams_t *self, unsigned max_streams)
{
    self->max_streams = max_streams;
}

td_stream_t *td_streams_first(td_streams_t *self)
{
    return self->list_head;
}

void td_streams_set_window(td_streams_t *self, unsigned intervals, uint32_t interval_ms)
{
    self->window_intervals = intervals;
    self->window_interval_ms = interval_ms;
}

unsigned td_streams_window_intervals(const td_streams_t *self)
{
    return self->window_intervals;
}

uint32_t td_streams_window_interval_ms(const td_streams_t *self)
{
    return self->window_interval_ms;
}

bool td_stream_window_add(td_streams_t *self, td_stream_t *stream, const uint64_t *bins,
                          uint64_t underflow, uint64_t overflow, uint64_t n, uint64_t now_ms)
{
    if (self->window_intervals == 0 || self->window_interval_ms == 0)
        return true;
    if (!stream->window) {
        stream->window = td_window_new(self->window_intervals, self->window_interval_ms,
                                       tally_hist_channels(stream->info.hist_dtype));
        if (!stream->window)
            return false;
    }
    td_window_add(stream->window, now_ms, bins, underflow, overflow, n);
    return true;
}

void td_stream_clear(td_stream_t *stream)
{
    memset(&stream->info, 0, sizeof stream->info);
    stream->seq_admitted = 0;
    td_window_destroy(&stream->window);
}

void td_stream_zero(td_stream_t *stream)
{
    tally_stream_info_t *info = &stream->info;
    uint8_t dtype = info->hist_dtype;
    int64_t lo = info->hist_lo, hi = info->hist_hi;
    uint64_t last_seq = info->last_seq;
    memset(info, 0, sizeof *info);
    info->hist_dtype = dtype;
    info->hist_lo = lo;
    info->hist_hi = hi;
    info->last_seq = last_seq;
    if (stream->window)
        td_window_clear(stream->window);
    stream->pub_dirty = true;
}
