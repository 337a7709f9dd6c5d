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
 *
 * Parts (td_stream.h): the budget every part shares is a record of atomics. Growth is charged to
 * it (and to the owner's share, td_peers.h) before the stream grows, by adding first and taking
 * the addition back when it passes the bound: of two shards that race for the last bytes one
 * wins and the other is refused, as if they had come one after the other. The recount after the
 * change then finds the charge already made (the stream's `bytes` was raised with it).
 */
#include <inttypes.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_config.h"
#include "td_hash.h"
#include "td_peers.h"
#include "td_stream.h"

/* What the parts of a whole share (a table of one part has one of its own). */
typedef struct {
    _Atomic unsigned count;
    _Atomic size_t bytes;                /* td_streams_bytes */
    _Atomic unsigned max_streams;        /* a reload may change the bounds */
    _Atomic size_t max_bytes;            /* 0 = no budget */
    _Atomic size_t max_bytes_per_client; /* 0 = no budget */
    _Atomic uint64_t created;            /* streams created so far: the order of creation */
    unsigned window_intervals;           /* set at start, before any shard runs */
    uint32_t window_interval_ms;
} budget_t;

struct td_streams {
    budget_t *budget; /* the whole's, or own_budget */
    budget_t own_budget;
    /* A whole of several parts: the parts, the walk's place in each (td_streams_next), and the
     * hook that stops the shards while another thread holds the whole. */
    td_streams_t **parts;
    unsigned part_count;
    td_stream_t **cursor;
    td_streams_hold_fn hold;
    void *hold_ctx;
    /* A part (or a table of one part): its own table. */
    td_stream_t **buckets;
    size_t bucket_count; /* a power of two */
    unsigned count;      /* streams in this part */
    size_t bytes;        /* bytes of this part's streams and buckets */
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

/* Adds a (wrapping) difference to an atomic size. */
static void charge_bytes(_Atomic size_t *total, size_t before, size_t after)
{
    if (after != before)
        atomic_fetch_add_explicit(total, after - before, memory_order_relaxed);
}

static td_streams_t *part_new(budget_t *budget)
{
    td_streams_t *self = calloc(1, sizeof *self);
    if (!self)
        return NULL;
    self->budget = budget ? budget : &self->own_budget;
    self->bucket_count = 64;
    self->buckets = calloc(self->bucket_count, sizeof *self->buckets);
    if (!self->buckets) {
        free(self);
        return NULL;
    }
    self->bytes = buckets_bytes(self->bucket_count);
    atomic_fetch_add(&self->budget->bytes, self->bytes);
    return self;
}

td_err_t td_streams_new(unsigned max_streams, td_streams_t **out)
{
    td_streams_t *self = part_new(NULL);
    if (!self)
        return TD_ERR_NOMEM;
    atomic_store(&self->budget->max_streams, max_streams);
    *out = self;
    return TD_OK;
}

td_err_t td_streams_new_parts(unsigned parts, unsigned max_streams, td_streams_t **out)
{
    if (parts <= 1)
        return td_streams_new(max_streams, out);
    td_streams_t *self = calloc(1, sizeof *self);
    if (!self)
        return TD_ERR_NOMEM;
    self->budget = &self->own_budget;
    atomic_store(&self->budget->max_streams, max_streams);
    self->parts = calloc(parts, sizeof *self->parts);
    self->cursor = calloc(parts, sizeof *self->cursor);
    if (!self->parts || !self->cursor) { /* td_streams_destroy would take it for one part */
        free(self->parts);
        free(self->cursor);
        free(self);
        return TD_ERR_NOMEM;
    }
    for (unsigned i = 0; i < parts; i++) {
        if (!(self->parts[i] = part_new(self->budget)))
            break;
        self->part_count++;
    }
    if (self->part_count < parts) {
        td_streams_destroy(&self);
        return TD_ERR_NOMEM;
    }
    *out = self;
    return TD_OK;
}

static void stream_free(td_stream_t *s)
{
    td_bins_clear(&s->bins);
    td_window_destroy(&s->window);
    free(s);
}

static void part_destroy(td_streams_t *self)
{
    td_stream_t *s = self->list_head;
    while (s) {
        td_stream_t *next = s->list_next;
        stream_free(s);
        s = next;
    }
    free(self->buckets);
    free(self->removed);
    free(self);
}

void td_streams_destroy(td_streams_t **self_p)
{
    td_streams_t *self = *self_p;
    if (!self)
        return;
    if (!self->parts) {
        part_destroy(self);
        *self_p = NULL;
        return;
    }
    for (unsigned i = 0; i < self->part_count; i++)
        part_destroy(self->parts[i]);
    free(self->parts);
    free(self->cursor);
    free(self);
    *self_p = NULL;
}

unsigned td_streams_parts(const td_streams_t *self)
{
    return self->parts ? self->part_count : 1;
}

td_streams_t *td_streams_part(td_streams_t *self, unsigned i)
{
    return self->parts ? self->parts[i] : self;
}

/* The part that holds (or would hold) the stream of that name. */
static td_streams_t *part_of(td_streams_t *self, const char *name, size_t len)
{
    return self->parts ? self->parts[td_stream_shard(name, len, self->part_count)] : self;
}

void td_streams_set_hold(td_streams_t *self, td_streams_hold_fn hold, void *ctx)
{
    self->hold = hold;
    self->hold_ctx = ctx;
}

void td_streams_hold(td_streams_t *self)
{
    if (self->hold)
        self->hold(self->hold_ctx, true);
}

void td_streams_release(td_streams_t *self)
{
    if (self->hold)
        self->hold(self->hold_ctx, false);
}

td_stream_t *td_streams_find(td_streams_t *self, const char *name, size_t len)
{
    self = part_of(self, name, len);
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
    size_t before = self->bytes;
    self->bytes += buckets_bytes(count) - buckets_bytes(self->bucket_count);
    charge_bytes(&self->budget->bytes, before, self->bytes);
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
    if (now == s->bytes)
        return;
    td_streams_t *t = s->table;
    t->bytes = t->bytes - s->bytes + now;
    charge_bytes(&t->budget->bytes, s->bytes, now);
    if (s->owner)
        td_peer_state_bytes_change(s->owner, s->bytes, now);
    s->bytes = now;
}

/* Charges `growth` more bytes to the budget of the table and of owner, or leaves both as they
 * were and says which bound it would pass, with a message in msg. */
static tally_status_t charge(td_streams_t *self, struct td_peer *owner, size_t growth, char *msg,
                             size_t cap)
{
    budget_t *b = self->budget;
    size_t max = atomic_load_explicit(&b->max_bytes, memory_order_relaxed);
    size_t held = atomic_fetch_add_explicit(&b->bytes, growth, memory_order_relaxed);
    if (max && held + growth > max) {
        atomic_fetch_sub_explicit(&b->bytes, growth, memory_order_relaxed);
        snprintf(msg, cap,
                 "tallyd's streams hold %zu bytes of state and this needs %zu more "
                 "(max_state_bytes %zu); delete streams that are no longer needed",
                 held, growth, max);
        return TALLY_E_LIMIT;
    }
    size_t per_client = atomic_load_explicit(&b->max_bytes_per_client, memory_order_relaxed);
    size_t mine = 0;
    if (owner && !td_peer_state_bytes_charge(owner, growth, per_client, &mine)) {
        atomic_fetch_sub_explicit(&b->bytes, growth, memory_order_relaxed);
        snprintf(msg, cap,
                 "this client's streams hold %zu bytes of state and this needs %zu more "
                 "(max_state_bytes_per_client %zu); delete streams it no longer needs",
                 mine, growth, per_client);
        return TALLY_E_CLIENT_STREAMS;
    }
    return TALLY_OK;
}

/* Gives back a charge that was not used (the change failed). */
static void uncharge(td_streams_t *self, struct td_peer *owner, size_t growth)
{
    atomic_fetch_sub_explicit(&self->budget->bytes, growth, memory_order_relaxed);
    if (owner)
        td_peer_state_bytes_change(owner, growth, 0);
}

/* Takes one of max_streams, or says so. */
static bool take_count(budget_t *b, unsigned *max)
{
    unsigned n = atomic_load_explicit(&b->count, memory_order_relaxed);
    do {
        *max = atomic_load_explicit(&b->max_streams, memory_order_relaxed);
        if (n >= *max)
            return false;
    } while (!atomic_compare_exchange_weak_explicit(&b->count, &n, n + 1, memory_order_relaxed,
                                                    memory_order_relaxed));
    return true;
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
    self = part_of(self, name, len);
    unsigned max;
    if (!take_count(self->budget, &max)) {
        snprintf(msg, msg_cap, "tallyd already holds its maximum of %u streams", max);
        return TALLY_E_LIMIT;
    }
    size_t bytes = stream_struct_bytes(len);
    tally_status_t st = charge(self, owner, bytes, msg, msg_cap);
    td_stream_t *s = st == TALLY_OK ? calloc(1, bytes) : NULL;
    if (st == TALLY_OK && !s) {
        uncharge(self, owner, bytes);
        snprintf(msg, msg_cap, "out of memory");
        st = TALLY_E_INTERNAL;
    }
    if (st != TALLY_OK) {
        atomic_fetch_sub_explicit(&self->budget->count, 1, memory_order_relaxed);
        return st;
    }
    memcpy(s->name, name, len);
    s->name_len = len;
    s->table = self;
    s->owner = owner;
    s->state_dirty = true;
    s->ring_epoch = 1; /* its first record has the whole ring: another of the name may be known */
    s->bytes = bytes; /* charged above */
    s->created = atomic_fetch_add_explicit(&self->budget->created, 1, memory_order_relaxed);
    self->bytes += bytes;
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
        /* Enough: a name adds at most 256 bytes, and the buffer is at least 1024. */
        size_t cap = self->removed_cap ? 2 * self->removed_cap : 1024;
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
    self = s->table; /* the whole's part that holds it */
    size_t slot = td_fnv1a64(s->name, s->name_len) & (self->bucket_count - 1);
    td_stream_t **link = &self->buckets[slot]; /* s is in its slot's chain (link_stream) */
    while (*link != s)
        link = &(*link)->hash_next;
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
    atomic_fetch_sub_explicit(&self->budget->count, 1, memory_order_relaxed);
    remember_removed(self, s);
    self->bytes -= s->bytes;
    charge_bytes(&self->budget->bytes, s->bytes, 0);
    if (s->owner)
        td_peer_state_bytes_change(s->owner, s->bytes, 0);
    stream_free(s);
    *stream_p = NULL;
}

unsigned td_streams_count(const td_streams_t *self)
{
    return atomic_load_explicit(&self->budget->count, memory_order_relaxed);
}

unsigned td_streams_part_count(const td_streams_t *part)
{
    return part->count;
}

size_t td_streams_part_bytes(const td_streams_t *part)
{
    return part->bytes;
}

void td_streams_set_max(td_streams_t *self, unsigned max_streams)
{
    atomic_store_explicit(&self->budget->max_streams, max_streams, memory_order_relaxed);
}

void td_streams_set_budget(td_streams_t *self, size_t max_bytes, size_t max_bytes_per_client)
{
    atomic_store_explicit(&self->budget->max_bytes, max_bytes, memory_order_relaxed);
    atomic_store_explicit(&self->budget->max_bytes_per_client, max_bytes_per_client,
                          memory_order_relaxed);
}

size_t td_streams_bytes(const td_streams_t *self)
{
    return atomic_load_explicit(&self->budget->bytes, memory_order_relaxed);
}

/* The part whose next stream in the walk was created first, or NULL when every part is done. */
static td_stream_t *walk_least(td_streams_t *self)
{
    td_stream_t *best = NULL;
    for (unsigned i = 0; i < self->part_count; i++)
        if (self->cursor[i] && (!best || self->cursor[i]->created < best->created))
            best = self->cursor[i];
    return best;
}

td_stream_t *td_streams_first(td_streams_t *self)
{
    if (!self->parts)
        return self->list_head;
    for (unsigned i = 0; i < self->part_count; i++)
        self->cursor[i] = self->parts[i]->list_head;
    return walk_least(self);
}

td_stream_t *td_streams_next(td_streams_t *self, const td_stream_t *stream)
{
    if (!self->parts)
        return stream->list_next;
    unsigned i = td_stream_shard(stream->name, stream->name_len, self->part_count);
    self->cursor[i] = stream->list_next;
    return walk_least(self);
}

void td_streams_set_window(td_streams_t *self, unsigned intervals, uint32_t interval_ms)
{
    self->budget->window_intervals = intervals;
    self->budget->window_interval_ms = interval_ms;
}

unsigned td_streams_window_intervals(const td_streams_t *self)
{
    return self->budget->window_intervals;
}

uint32_t td_streams_window_interval_ms(const td_streams_t *self)
{
    return self->budget->window_interval_ms;
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
    for (unsigned i = 0; i < td_streams_parts(self); i++)
        td_streams_part(self, i)->track_removed = on;
}

/* Appends a part's removed names to the first's (the whole's list is their concatenation). */
static void take_part_removed(td_streams_t *into, td_streams_t *part)
{
    if (part->removed_lost)
        into->removed_lost = true;
    if (!part->removed_len)
        return;
    size_t need = into->removed_len + part->removed_len;
    uint8_t *grown = need > into->removed_cap ? realloc(into->removed, need) : into->removed;
    if (!grown) {
        into->removed_lost = true;
    } else {
        into->removed = grown;
        into->removed_cap = need > into->removed_cap ? need : into->removed_cap;
        memcpy(into->removed + into->removed_len, part->removed, part->removed_len);
        into->removed_len = need;
        into->removed_count += part->removed_count;
    }
    free(part->removed);
    part->removed = NULL;
    part->removed_len = part->removed_cap = 0;
    part->removed_count = 0;
    part->removed_lost = false;
}

void td_streams_take_removed(td_streams_t *self, uint8_t **names, size_t *len, unsigned *count,
                             bool *lost)
{
    td_streams_t *first = td_streams_part(self, 0);
    for (unsigned i = 1; i < td_streams_parts(self); i++)
        take_part_removed(first, td_streams_part(self, i));
    *names = first->removed;
    *len = first->removed_len;
    *count = first->removed_count;
    *lost = first->removed_lost;
    first->removed_lost = false;
    first->removed = NULL;
    first->removed_len = first->removed_cap = 0;
    first->removed_count = 0;
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
    s->ring_epoch++;
    td_stream_recount(s);
    return true;
}

td_ring_mark_t td_stream_ring_mark(const td_stream_t *s)
{
    return (td_ring_mark_t){s->ring_epoch, s->window ? td_window_stamp(s->window) : 0};
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

/* Plans the batch (n elements: no bin counts more) in both histograms and the bytes the stream
 * holds after it (*after). */
static bool plan_hist(td_stream_t *s, size_t values, const uint64_t *bins, uint64_t n,
                      uint64_t now_ms, hist_plan_t *p, size_t *after)
{
    const budget_t *b = s->table->budget;
    memset(p, 0, sizeof *p);
    p->window = s->window;
    if (!p->window && b->window_intervals && b->window_interval_ms) {
        p->new_ring = td_window_new(b->window_intervals, b->window_interval_ms,
                                    (unsigned)(values / TALLY_HIST_BINS));
        if (!p->new_ring)
            return false;
        p->window = p->new_ring;
    }
    if (p->window)
        td_window_expire(p->window, now_ms); /* what the ring has left is gone anyway */
    td_stream_recount(s);
    td_bins_plan(&s->bins, values, bins, n, &p->bins);
    *after = stream_struct_bytes(s->name_len) + p->bins.bytes;
    if (p->window) {
        td_window_plan(p->window, now_ms, bins, n, &p->ring);
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
    if (!plan_hist(s, values, bins, n, now_ms, &p, &after)) {
        snprintf(msg, msg_cap, "out of memory for the stream's window ring");
        return TALLY_E_INTERNAL;
    }
    size_t growth = after > s->bytes ? after - s->bytes : 0;
    tally_status_t st = growth ? charge(s->table, s->owner, growth, msg, msg_cap) : TALLY_OK;
    if (st == TALLY_OK && !prepare_hist(&p)) {
        uncharge(s->table, s->owner, growth);
        snprintf(msg, msg_cap, "out of memory for the stream's histogram");
        st = TALLY_E_INTERNAL;
    }
    if (st != TALLY_OK) {
        td_window_destroy(&p.new_ring);
        return st;
    }
    s->bytes += growth; /* charged: the recount below finds it counted */
    s->table->bytes += growth;
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
    s->ring_epoch++;
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
    s->ring_epoch++;
    td_stream_changed(s);
    td_stream_recount(s);
}
