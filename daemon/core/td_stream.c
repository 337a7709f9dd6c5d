/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_stream.c — the stream table: a chained hash table (FNV-1a, power-of-two buckets that
 * double when the load passes 1) plus a doubly-linked list in creation order, so `streams`
 * lists streams in a stable order and removal is O(1); and each stream's state with its byte
 * count (see td_stream.h).
 *
 * Accounting: a stream's bytes are counted from its parts (td_stream_bytes) after every change
 * (recount), and the difference goes to the table's total and to its owner's. A hist batch is
 * planned first in both histograms (td_bins_plan, td_window_plan): the bytes the stream would
 * hold after it are known before anything changes, so the budget can refuse the batch cleanly.
 */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_hash.h"
#include "td_peers.h"
#include "td_stream.h"

struct td_streams {
    td_stream_t **buckets;
    size_t bucket_count; /* a power of two */
    unsigned count;
    unsigned max_streams;
    unsigned window_intervals;
    uint32_t window_interval_ms;
    size_t bytes;                /* td_streams_bytes */
    size_t max_bytes;            /* 0 = no budget */
    size_t max_bytes_per_client; /* 0 = no budget */
    td_stream_t *list_head;
    td_stream_t *list_tail;
    td_stream_t *sweep_next; /* where td_streams_sweep goes on; NULL: from the head */
    bool track_removed;
    uint8_t *removed; /* [u8 length][name] per stream removed since the last take */
    size_t removed_len;
    size_t removed_cap;
    unsigned removed_count;
    bool removed_lost; /* a name could not be kept (out of memory) */
};

static size_t buckets_bytes(size_t count)
{
    return count * sizeof(td_stream_t *);
}

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
    self->bytes = buckets_bytes(self->bucket_count);
    self->max_streams = max_streams;
    *out = self;
    return TD_OK;
}

static void stream_free(td_stream_t *s)
{
    td_bins_clear(&s->bins);
    td_window_destroy(&s->window);
    free(s);
}

void td_streams_destroy(td_streams_t **self_p)
{
    td_streams_t *self = *self_p;
    if (!self)
        return;
    td_stream_t *s = self->list_head;
    while (s) {
        td_stream_t *next = s->list_next;
        stream_free(s);
        s = next;
    }
    free(self->buckets);
    free(self->removed);
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
    self->bytes += buckets_bytes(count) - buckets_bytes(self->bucket_count);
    self->buckets = buckets;
    self->bucket_count = count;
}

/* The bytes of a stream struct with a name of len bytes. */
static size_t stream_struct_bytes(size_t len)
{
    return offsetof(td_stream_t, name) + len + 1;
}

size_t td_stream_bytes(const td_stream_t *s)
{
    return stream_struct_bytes(s->name_len) + td_bins_bytes(&s->bins) +
           (s->window ? td_window_bytes(s->window) : 0);
}

/* Brings the table's and the owner's counts up to the stream's bytes now. */
void td_stream_recount(td_stream_t *s)
{
    size_t now = td_stream_bytes(s);
    s->table->bytes = s->table->bytes - s->bytes + now;
    if (s->owner)
        td_peer_state_bytes_change(s->owner, s->bytes, now);
    s->bytes = now;
}

/* Whether `growth` more bytes fit the budget of the table and of owner; else the status, with
 * a message in msg. */
static tally_status_t budget(const td_streams_t *self, const struct td_peer *owner, size_t growth,
                             char *msg, size_t cap)
{
    if (self->max_bytes && self->bytes + growth > self->max_bytes) {
        snprintf(msg, cap,
                 "tallyd's streams hold %zu bytes of state and this needs %zu more "
                 "(max_state_bytes %zu); delete streams that are no longer needed",
                 self->bytes, growth, self->max_bytes);
        return TALLY_E_LIMIT;
    }
    if (owner && self->max_bytes_per_client &&
        td_peer_state_bytes(owner) + growth > self->max_bytes_per_client) {
        snprintf(msg, cap,
                 "this client's streams hold %zu bytes of state and this needs %zu more "
                 "(max_state_bytes_per_client %zu); delete streams it no longer needs",
                 td_peer_state_bytes(owner), growth, self->max_bytes_per_client);
        return TALLY_E_CLIENT_STREAMS;
    }
    return TALLY_OK;
}

/* Links a new stream into the hash chain and the creation list. */
static void link_stream(td_streams_t *self, td_stream_t *s)
{
    if (self->count + 1 > self->bucket_count)
        grow(self);
    size_t slot = td_fnv1a64(s->name, s->name_len) & (self->bucket_count - 1);
    s->hash_next = self->buckets[slot];
    self->buckets[slot] = s;
    s->list_prev = self->list_tail;
    if (self->list_tail)
        self->list_tail->list_next = s;
    else
        self->list_head = s;
    self->list_tail = s;
    self->count++;
}

tally_status_t td_streams_create(td_streams_t *self, const char *name, size_t len,
                                 struct td_peer *owner, char *msg, size_t msg_cap,
                                 td_stream_t **out)
{
    if (len == 0 || len > TALLY_STREAM_NAME_MAX) {
        snprintf(msg, msg_cap, "a stream name is 1 to %d bytes", TALLY_STREAM_NAME_MAX);
        return TALLY_E_STREAM_NAME;
    }
    if (self->count >= self->max_streams) {
        snprintf(msg, msg_cap, "tallyd already holds its maximum of %u streams",
                 self->max_streams);
        return TALLY_E_LIMIT;
    }
    tally_status_t st = budget(self, owner, stream_struct_bytes(len), msg, msg_cap);
    if (st != TALLY_OK)
        return st;
    td_stream_t *s = calloc(1, stream_struct_bytes(len));
    if (!s) {
        snprintf(msg, msg_cap, "out of memory");
        return TALLY_E_INTERNAL;
    }
    memcpy(s->name, name, len);
    s->name_len = len;
    s->table = self;
    s->owner = owner;
    s->state_dirty = true;
    link_stream(self, s);
    td_stream_recount(s);
    *out = s;
    return TALLY_OK;
}

tally_status_t td_streams_get(td_streams_t *self, const char *name, size_t len, td_stream_t **out)
{
    char msg[256];
    td_stream_t *s = td_streams_find(self, name, len);
    if (s) {
        *out = s;
        return TALLY_OK;
    }
    return td_streams_create(self, name, len, NULL, msg, sizeof msg, out);
}

/* Keeps the removed stream's name for the next snapshot (a tombstone); a name that cannot be
 * kept (out of memory) makes the next snapshot a full one instead (td_state.h). */
static void remember_removed(td_streams_t *self, const td_stream_t *s)
{
    if (!self->track_removed)
        return;
    size_t need = self->removed_len + 1 + s->name_len;
    if (need > self->removed_cap) {
        size_t cap = self->removed_cap ? 2 * self->removed_cap : 1024;
        while (cap < need)
            cap *= 2;
        uint8_t *grown = realloc(self->removed, cap);
        if (!grown) {
            self->removed_lost = true;
            return;
        }
        self->removed = grown;
        self->removed_cap = cap;
    }
    self->removed[self->removed_len] = (uint8_t)s->name_len;
    memcpy(self->removed + self->removed_len + 1, s->name, s->name_len);
    self->removed_len = need;
    self->removed_count++;
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
    if (self->sweep_next == s)
        self->sweep_next = s->list_next;
    self->count--;
    remember_removed(self, s);
    self->bytes -= s->bytes;
    if (s->owner)
        td_peer_state_bytes_change(s->owner, s->bytes, 0);
    stream_free(s);
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

void td_streams_set_budget(td_streams_t *self, size_t max_bytes, size_t max_bytes_per_client)
{
    self->max_bytes = max_bytes;
    self->max_bytes_per_client = max_bytes_per_client;
}

size_t td_streams_bytes(const td_streams_t *self)
{
    return self->bytes;
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

void td_streams_sweep(td_streams_t *self, uint64_t now_ms, unsigned max)
{
    td_stream_t *s = self->sweep_next ? self->sweep_next : self->list_head;
    for (unsigned i = 0; s && i < max; i++, s = s->list_next) {
        if (!s->window)
            continue;
        td_window_expire(s->window, now_ms);
        td_stream_recount(s);
    }
    self->sweep_next = s;
}

void td_streams_track_removed(td_streams_t *self, bool on)
{
    self->track_removed = on;
}

void td_streams_take_removed(td_streams_t *self, uint8_t **names, size_t *len, unsigned *count,
                             bool *lost)
{
    *names = self->removed;
    *len = self->removed_len;
    *count = self->removed_count;
    *lost = self->removed_lost;
    self->removed_lost = false;
    self->removed = NULL;
    self->removed_len = self->removed_cap = 0;
    self->removed_count = 0;
}

/* ---- One stream ------------------------------------------------------------------------- */

size_t td_stream_values(uint8_t dtype)
{
    unsigned channels = tally_hist_channels(dtype);
    return (size_t)(channels ? channels : 1) * TALLY_HIST_BINS;
}

void td_stream_info_head(const td_stream_t *s, tally_stream_info_t *out)
{
    const td_stream_info_t *in = &s->info;
    out->batches = in->batches;
    out->elements = in->elements;
    out->bytes = in->bytes;
    out->filter_seen = in->filter_seen;
    out->filter_kept = in->filter_kept;
    out->scan_carry = in->scan_carry;
    out->scan_elements = in->scan_elements;
    out->hist_dtype = in->hist_dtype;
    out->hist_lo = in->hist_lo;
    out->hist_hi = in->hist_hi;
    out->hist_underflow = in->hist_underflow;
    out->hist_overflow = in->hist_overflow;
    out->hist_total = in->hist_total;
    out->last_seq = in->last_seq;
}

void td_stream_info(const td_stream_t *s, tally_stream_info_t *out)
{
    memset(out, 0, sizeof *out);
    td_stream_info_head(s, out);
    td_bins_get(&s->bins, td_stream_values(s->info.hist_dtype), out->bins);
}

uint64_t td_stream_window_info(const td_stream_t *s, uint64_t now_ms, unsigned k,
                               uint32_t interval_ms, tally_stream_info_t *out)
{
    memset(out, 0, sizeof *out);
    td_stream_info_head(s, out);
    if (s->window)
        return td_window_sum(s->window, now_ms, k, out);
    /* No hist yet: nothing counted in any interval. */
    out->hist_underflow = out->hist_overflow = out->hist_total = 0;
    uint64_t current = now_ms / interval_ms;
    return (current + 1 - (k < current + 1 ? k : current + 1)) * interval_ms;
}

bool td_stream_set_info(td_stream_t *s, const tally_stream_info_t *in)
{
    if (!td_bins_set(&s->bins, td_stream_values(in->hist_dtype), in->bins))
        return false;
    s->info = (td_stream_info_t){
        .batches = in->batches,
        .elements = in->elements,
        .bytes = in->bytes,
        .filter_seen = in->filter_seen,
        .filter_kept = in->filter_kept,
        .scan_carry = in->scan_carry,
        .scan_elements = in->scan_elements,
        .hist_dtype = in->hist_dtype,
        .hist_lo = in->hist_lo,
        .hist_hi = in->hist_hi,
        .hist_underflow = in->hist_underflow,
        .hist_overflow = in->hist_overflow,
        .hist_total = in->hist_total,
        .last_seq = in->last_seq,
    };
    td_window_destroy(&s->window);
    td_stream_recount(s);
    return true;
}

void td_stream_changed(td_stream_t *s)
{
    s->pub_dirty = true;
    s->fleet_dirty = true;
    s->state_dirty = true;
}

/* A hist batch's plans: the all-time histogram, and the ring (created for the stream's first
 * hist when windows are on). */
typedef struct {
    td_bins_plan_t bins;
    td_window_plan_t ring;
    td_window_t *new_ring; /* made for this batch: destroyed if the batch is refused */
    td_window_t *window;   /* the ring the batch goes to, or NULL */
} hist_plan_t;

/* Plans the batch in both histograms and the bytes the stream holds after it (*after). */
static bool plan_hist(td_stream_t *s, size_t values, const uint64_t *bins, uint64_t now_ms,
                      hist_plan_t *p, size_t *after)
{
    const td_streams_t *t = s->table;
    memset(p, 0, sizeof *p);
    p->window = s->window;
    if (!p->window && t->window_intervals && t->window_interval_ms) {
        p->new_ring = td_window_new(t->window_intervals, t->window_interval_ms,
                                    (unsigned)(values / TALLY_HIST_BINS));
        if (!p->new_ring)
            return false;
        p->window = p->new_ring;
    }
    if (p->window)
        td_window_expire(p->window, now_ms); /* what the ring has left is gone anyway */
    td_stream_recount(s);
    td_bins_plan(&s->bins, values, bins, &p->bins);
    *after = stream_struct_bytes(s->name_len) + p->bins.bytes;
    if (p->window) {
        td_window_plan(p->window, now_ms, bins, &p->ring);
        *after += p->ring.bytes;
    }
    return true;
}

static bool prepare_hist(hist_plan_t *p)
{
    if (!td_bins_prepare(&p->bins))
        return false;
    if (p->window && !td_window_prepare(&p->ring)) {
        td_bins_abort(&p->bins);
        return false;
    }
    return true;
}

tally_status_t td_stream_add_hist(td_stream_t *s, uint8_t dtype, int64_t lo, int64_t hi,
                                  const uint64_t *bins, uint64_t underflow, uint64_t overflow,
                                  uint64_t n, uint64_t now_ms, char *msg, size_t msg_cap)
{
    td_stream_info_t *info = &s->info;
    uint8_t have = info->hist_dtype != TALLY_DTYPE_NONE ? info->hist_dtype : dtype;
    size_t values = td_stream_values(have), after = 0;
    hist_plan_t p;
    if (!plan_hist(s, values, bins, now_ms, &p, &after)) {
        snprintf(msg, msg_cap, "out of memory for the stream's window ring");
        return TALLY_E_INTERNAL;
    }
    tally_status_t st = after > s->bytes
                            ? budget(s->table, s->owner, after - s->bytes, msg, msg_cap)
                            : TALLY_OK;
    if (st == TALLY_OK && !prepare_hist(&p)) {
        snprintf(msg, msg_cap, "out of memory for the stream's histogram");
        st = TALLY_E_INTERNAL;
    }
    if (st != TALLY_OK) {
        td_window_destroy(&p.new_ring);
        return st;
    }
    if (info->hist_dtype == TALLY_DTYPE_NONE) {
        bool ranged = tally_hist_ranged(dtype);
        info->hist_dtype = dtype;
        info->hist_lo = ranged ? lo : 0;
        info->hist_hi = ranged ? hi : 0;
    }
    td_bins_commit(&s->bins, values, bins, &p.bins);
    if (p.window)
        td_window_commit(p.window, bins, underflow, overflow, n, &p.ring);
    if (p.new_ring)
        s->window = p.new_ring;
    info->hist_underflow += underflow;
    info->hist_overflow += overflow;
    info->hist_total += n;
    td_stream_recount(s);
    return TALLY_OK;
}

void td_stream_clear(td_stream_t *s)
{
    memset(&s->info, 0, sizeof s->info);
    s->seq_admitted = 0;
    td_bins_clear(&s->bins);
    td_window_destroy(&s->window);
    s->state_dirty = true;
    td_stream_recount(s);
}

void td_stream_zero(td_stream_t *s)
{
    td_stream_info_t *info = &s->info;
    uint8_t dtype = info->hist_dtype;
    int64_t lo = info->hist_lo, hi = info->hist_hi;
    uint64_t last_seq = info->last_seq;
    memset(info, 0, sizeof *info);
    info->hist_dtype = dtype;
    info->hist_lo = lo;
    info->hist_hi = hi;
    info->last_seq = last_seq;
    td_bins_clear(&s->bins);
    if (s->window)
        td_window_clear(s->window);
    td_stream_changed(s);
    td_stream_recount(s);
}
