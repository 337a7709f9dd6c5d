/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_window.c — see td_window.h. The slots are kept sorted by interval, so the newest (where
 * nearly every batch lands) is found from the end, and the state record lists them oldest
 * first. A ring never holds more than `intervals` slots (one per ring position), so the array's
 * capacity stays at most the next power of two above that.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "td_window.h"

typedef struct {
    uint64_t interval;
    uint64_t underflow;
    uint64_t overflow;
    uint64_t total;
    uint64_t stamp; /* the ring's stamp when a batch last changed it (0: restored, not since) */
    td_bins_t bins;
} slot_t;

struct td_window {
    slot_t *slots;  /* sorted by interval; cap allocated, count in use */
    size_t bytes;   /* td_window_bytes, kept up to date */
    uint64_t stamp; /* batches committed to the ring since it was made */
    uint32_t interval_ms;
    unsigned intervals;
    unsigned count;
    unsigned cap;
    unsigned channels;
};

/* The encoded slot's fixed part (interval, underflow, overflow, total). */
#define SLOT_FIXED 32u

td_window_t *td_window_new(unsigned intervals, uint32_t interval_ms, unsigned channels)
{
    if (intervals == 0 || interval_ms == 0 || channels == 0 || channels > TALLY_HIST_CHANNELS_MAX)
        return NULL;
    td_window_t *w = malloc(sizeof *w);
    if (w) /* no slot yet: they come with the first batch */
        *w = (td_window_t){.intervals = intervals,
                           .interval_ms = interval_ms,
                           .channels = channels,
                           .bytes = sizeof *w};
    return w;
}

uint32_t td_window_interval_ms(const td_window_t *w)
{
    return w->interval_ms;
}

void td_window_clear(td_window_t *w)
{
    for (unsigned i = 0; i < w->count; i++)
        td_bins_clear(&w->slots[i].bins);
    free(w->slots);
    w->slots = NULL;
    w->count = w->cap = 0;
    w->bytes = sizeof *w;
}

size_t td_window_bytes(const td_window_t *w)
{
    return w->bytes;
}

void td_window_destroy(td_window_t **self_p)
{
    td_window_t *w = *self_p;
    if (!w)
        return;
    td_window_clear(w);
    free(w);
    *self_p = NULL;
}

static size_t values_of(const td_window_t *w)
{
    return (size_t)w->channels * TALLY_HIST_BINS;
}

/* The index of interval's slot, or -1. */
static long find(const td_window_t *w, uint64_t interval)
{
    for (unsigned i = w->count; i-- > 0;) {
        if (w->slots[i].interval == interval)
            return (long)i;
        if (w->slots[i].interval < interval)
            break;
    }
    return -1;
}

unsigned td_window_slots(const td_window_t *w)
{
    return w->count;
}

static bool expired(const td_window_t *w, uint64_t interval, uint64_t now)
{
    return interval <= now && now - interval >= w->intervals;
}

/* How many slots from the first the ring no longer reaches at interval now (a prefix: the
 * slots are sorted). */
static unsigned expired_prefix(const td_window_t *w, uint64_t now)
{
    unsigned from = 0;
    while (from < w->count && expired(w, w->slots[from].interval, now))
        from++;
    return from;
}

/* The slots that go when a batch of interval `now` is added: the expired prefix (its length
 * returned), and, only when the clock stepped back by a whole ring, a slot of the future on the
 * batch's ring position (*gone_late its index, else -1; such slots are at the end). So this
 * reads the one or two slots at each end, not the ring. */
static unsigned doomed(const td_window_t *w, uint64_t now, long *gone_late)
{
    unsigned from = expired_prefix(w, now);
    *gone_late = -1;
    for (unsigned i = w->count; i-- > from && w->slots[i].interval > now;)
        if (w->slots[i].interval % w->intervals == now % w->intervals)
            *gone_late = (long)i;
    return from;
}

/* Removes slot i, freeing its bins. */
static void drop(td_window_t *w, unsigned i)
{
    w->bytes -= td_bins_bytes(&w->slots[i].bins);
    td_bins_clear(&w->slots[i].bins);
    memmove(w->slots + i, w->slots + i + 1, (w->count - i - 1) * sizeof(slot_t));
    w->count--;
}

/* Removes the first `from` slots, freeing their bins. */
static void drop_prefix(td_window_t *w, unsigned from)
{
    if (!from) /* slots may be NULL (none yet), which memmove may not be given */
        return;
    for (unsigned i = 0; i < from; i++) {
        w->bytes -= td_bins_bytes(&w->slots[i].bins);
        td_bins_clear(&w->slots[i].bins);
    }
    memmove(w->slots, w->slots + from, (w->count - from) * sizeof(slot_t));
    w->count -= from;
}

/* Removes what doomed() names: the late slot, then the prefix. */
static void sweep(td_window_t *w, uint64_t now)
{
    long late = -1;
    unsigned from = doomed(w, now, &late);
    if (late >= 0)
        drop(w, (unsigned)late);
    drop_prefix(w, from);
}

void td_window_expire(td_window_t *w, uint64_t now_ms)
{
    drop_prefix(w, expired_prefix(w, now_ms / w->interval_ms));
    if (w->count == 0 && w->slots) {
        free(w->slots);
        w->slots = NULL;
        w->bytes -= w->cap * sizeof(slot_t);
        w->cap = 0;
    }
}

void td_window_plan(const td_window_t *w, uint64_t now_ms, const uint64_t *bins, uint64_t add_max,
                    td_window_plan_t *plan)
{
    static const td_bins_t empty;
    uint64_t now = now_ms / w->interval_ms;
    size_t freed = 0;
    long late = -1;
    unsigned from = doomed(w, now, &late), kept = w->count - from - (late >= 0);
    for (unsigned i = 0; i < from; i++)
        freed += td_bins_bytes(&w->slots[i].bins);
    if (late >= 0)
        freed += td_bins_bytes(&w->slots[late].bins);
    plan->interval = now;
    plan->slot = find(w, now);
    plan->array = NULL;
    plan->cap = w->cap;
    plan->grow = false;
    const td_bins_t *target = plan->slot >= 0 ? &w->slots[plan->slot].bins : &empty;
    td_bins_plan(target, values_of(w), bins, add_max, &plan->bins);
    if (plan->slot < 0 && kept + 1 > w->cap) {
        unsigned cap = w->cap ? w->cap : 1;
        while (cap < kept + 1)
            cap *= 2;
        plan->cap = cap;
        plan->grow = true;
    }
    plan->bytes = w->bytes - freed + (plan->cap - w->cap) * sizeof(slot_t) + plan->bins.bytes -
                  td_bins_bytes(target);
}

bool td_window_prepare(td_window_plan_t *plan)
{
    if (!td_bins_prepare(&plan->bins))
        return false;
    if (plan->grow) {
        plan->array = malloc(plan->cap * sizeof(slot_t));
        if (!plan->array) {
            td_bins_abort(&plan->bins);
            return false;
        }
    }
    return true;
}

/* Inserts an empty slot for interval, keeping the order; the array has room. */
static slot_t *insert(td_window_t *w, uint64_t interval)
{
    unsigned at = w->count;
    while (at > 0 && w->slots[at - 1].interval > interval)
        at--;
    memmove(w->slots + at + 1, w->slots + at, (w->count - at) * sizeof(slot_t));
    w->count++;
    slot_t *s = &w->slots[at];
    memset(s, 0, sizeof *s);
    s->interval = interval;
    return s;
}

void td_window_commit(td_window_t *w, const uint64_t *bins, uint64_t underflow,
                      uint64_t overflow, uint64_t n, td_window_plan_t *plan)
{
    sweep(w, plan->interval);
    if (plan->array) {
        if (w->count) /* memcpy may not be given a NULL array, even for 0 bytes */
            memcpy(plan->array, w->slots, w->count * sizeof(slot_t));
        free(w->slots);
        w->slots = plan->array;
        w->bytes += (plan->cap - w->cap) * sizeof(slot_t);
        w->cap = plan->cap;
        plan->array = NULL;
    }
    slot_t *s = plan->slot >= 0 ? &w->slots[find(w, plan->interval)] : insert(w, plan->interval);
    w->bytes -= td_bins_bytes(&s->bins);
    td_bins_commit(&s->bins, values_of(w), bins, &plan->bins);
    w->bytes += td_bins_bytes(&s->bins);
    s->underflow += underflow;
    s->overflow += overflow;
    s->total += n;
    s->stamp = ++w->stamp;
}

bool td_window_add(td_window_t *w, uint64_t now_ms, const uint64_t *bins, uint64_t underflow,
                   uint64_t overflow, uint64_t n)
{
    td_window_plan_t plan;
    td_window_plan(w, now_ms, bins, UINT64_MAX, &plan);
    if (!td_window_prepare(&plan))
        return false;
    td_window_commit(w, bins, underflow, overflow, n, &plan);
    return true;
}

uint64_t td_window_sum(const td_window_t *w, uint64_t now_ms, unsigned k, tally_stream_info_t *info)
{
    uint64_t now = now_ms / w->interval_ms;
    if (k > w->intervals)
        k = w->intervals;
    if (k > now + 1)
        k = (unsigned)(now + 1);
    info->hist_underflow = info->hist_overflow = info->hist_total = 0;
    memset(info->bins, 0, sizeof info->bins);
    for (unsigned i = 0; i < w->count; i++) {
        const slot_t *s = &w->slots[i];
        if (s->interval > now || now - s->interval >= k)
            continue;
        info->hist_underflow += s->underflow;
        info->hist_overflow += s->overflow;
        info->hist_total += s->total;
        td_bins_accumulate(&s->bins, values_of(w), info->bins);
    }
    return (now + 1 - k) * w->interval_ms;
}

/* ---- the state record's form ------------------------------------------------------------ */

/* A slot the ring still reaches at interval `now` and that counted something (a total that
 * wrapped to 0 still has its bins): what a state record keeps (a slot in the future of a clock
 * that stepped back is not). */
static bool slot_saved(const td_window_t *w, const slot_t *s, uint64_t now)
{
    bool counted = s->total || s->underflow || s->overflow || s->bins.width;
    return s->interval <= now && now - s->interval < w->intervals && counted;
}

/* A slot's interval, underflow, overflow and total (SLOT_FIXED bytes). */
static void put_fixed(uint8_t *out, const slot_t *s)
{
    tally_put_u64(out, s->interval);
    tally_put_u64(out + 8, s->underflow);
    tally_put_u64(out + 16, s->overflow);
    tally_put_u64(out + 24, s->total);
}

uint64_t td_window_stamp(const td_window_t *w)
{
    return w->stamp;
}

/* The state record's form of the saved slots, all of them or those changed after `since`. */
static size_t encode_slots(const td_window_t *w, uint64_t now_ms, bool all, uint64_t since,
                           uint8_t *out)
{
    uint64_t now = now_ms / w->interval_ms;
    size_t at = 4;
    uint32_t slots = 0;
    for (unsigned i = 0; i < w->count; i++) {
        const slot_t *s = &w->slots[i];
        if (!slot_saved(w, s, now) || (!all && s->stamp <= since))
            continue;
        if (out)
            put_fixed(out + at, s);
        at += SLOT_FIXED;
        at += td_bins_encode(&s->bins, values_of(w), out ? out + at : NULL);
        slots++;
    }
    if (out)
        tally_put_u32(out, slots);
    return at;
}

size_t td_window_encode(const td_window_t *w, uint64_t now_ms, uint8_t *out)
{
    return encode_slots(w, now_ms, true, 0, out);
}

size_t td_window_encode_since(const td_window_t *w, uint64_t now_ms, uint64_t since, uint8_t *out)
{
    return encode_slots(w, now_ms, false, since, out);
}

/* total == bins of each channel + underflow + overflow (every channel counts each element
 * once). Sums wrap like the counters. */
static bool slot_consistent(uint64_t underflow, uint64_t overflow, uint64_t total,
                            const uint64_t *bins, unsigned channels)
{
    for (unsigned c = 0; c < channels; c++) {
        uint64_t sum = underflow + overflow;
        for (size_t b = 0; b < TALLY_HIST_BINS; b++)
            sum += bins[c * TALLY_HIST_BINS + b];
        if (sum != total)
            return false;
    }
    return true;
}

/* Adds one decoded slot to a ring being restored (its intervals distinct and all reachable, so
 * none replaces another); false when out of memory. */
static bool place(td_window_t *w, uint64_t interval, uint64_t underflow, uint64_t overflow,
                  uint64_t total, const uint64_t *bins)
{
    td_bins_t counts = {0};
    if (!td_bins_set(&counts, values_of(w), bins))
        return false;
    if (w->count == w->cap) {
        unsigned cap = w->cap ? 2 * w->cap : 1;
        slot_t *grown = realloc(w->slots, cap * sizeof(slot_t));
        if (!grown) {
            td_bins_clear(&counts);
            return false;
        }
        w->bytes += (cap - w->cap) * sizeof(slot_t);
        w->slots = grown;
        w->cap = cap;
    }
    slot_t *s = insert(w, interval);
    s->underflow = underflow;
    s->overflow = overflow;
    s->total = total;
    s->bins = counts;
    w->bytes += td_bins_bytes(&counts);
    return true;
}

/* Whether a saved slot of interval is placed: the same interval length, and reachable now. */
static bool slot_wanted(const td_window_t *w, uint32_t saved_interval_ms, uint64_t interval,
                        uint64_t now)
{
    return saved_interval_ms == w->interval_ms && interval <= now && now - interval < w->intervals;
}

size_t td_window_decode(td_window_t *w, uint64_t now_ms, uint32_t saved_interval_ms,
                        const uint8_t *in, size_t len, unsigned *dropped, bool *nomem)
{
    static uint64_t bins[TALLY_HIST_VALUES_MAX]; /* loop thread only */
    uint64_t now = now_ms / w->interval_ms;
    *dropped = 0;
    *nomem = false;
    if (len < 4 || w->count)
        return 0;
    uint32_t slots = tally_get_u32(in);
    size_t at = 4;
    uint64_t prev = 0;
    for (uint32_t i = 0; i < slots; i++) {
        if (len - at < SLOT_FIXED)
            goto invalid;
        uint64_t interval = tally_get_u64(in + at), under = tally_get_u64(in + at + 8),
                 over = tally_get_u64(in + at + 16), total = tally_get_u64(in + at + 24);
        size_t got = td_bins_decode(in + at + SLOT_FIXED, len - at - SLOT_FIXED, values_of(w), bins);
        /* Slots are written oldest first, so an interval twice is out of order. */
        if (!got || !slot_consistent(under, over, total, bins, w->channels) ||
            (i > 0 && interval <= prev))
            goto invalid;
        prev = interval;
        at += SLOT_FIXED + got;
        if (!slot_wanted(w, saved_interval_ms, interval, now)) {
            (*dropped)++;
            continue;
        }
        if (!place(w, interval, under, over, total, bins)) {
            *nomem = true;
            goto invalid;
        }
    }
    return at;
invalid:
    td_window_clear(w);
    return 0;
}

/* Whether w holds a slot on interval's ring position (that interval, or one a whole ring away). */
static bool position_taken(const td_window_t *w, uint64_t interval)
{
    for (unsigned i = 0; i < w->count; i++)
        if (w->slots[i].interval % w->intervals == interval % w->intervals)
            return true;
    return false;
}

/* Whether older's slot s goes to w: the ring reaches it at interval now, and w has nothing on
 * its position. Moving slots into w leaves the answer for the others the same (older holds one
 * slot per position). */
static bool slot_kept(const td_window_t *w, const slot_t *s, uint64_t now)
{
    return s->interval <= now && now - s->interval < w->intervals && !position_taken(w, s->interval);
}

/* Whether the rings are of one shape: only then does a slot of one belong in the other. */
static bool same_shape(const td_window_t *a, const td_window_t *b)
{
    return a->intervals == b->intervals && a->interval_ms == b->interval_ms &&
           a->channels == b->channels;
}

bool td_window_room_for_older(td_window_t *w, const td_window_t *older, uint64_t now_ms)
{
    uint64_t now = now_ms / w->interval_ms;
    unsigned moving = 0;
    for (unsigned i = 0; same_shape(w, older) && i < older->count; i++)
        moving += slot_kept(w, &older->slots[i], now);
    if (w->count + moving <= w->cap)
        return true;
    unsigned cap = w->cap ? w->cap : 1;
    while (cap < w->count + moving)
        cap *= 2;
    slot_t *grown = realloc(w->slots, cap * sizeof(slot_t));
    if (!grown)
        return false;
    w->bytes += (cap - w->cap) * sizeof(slot_t);
    w->slots = grown;
    w->cap = cap;
    return true;
}

void td_window_keep_older(td_window_t *w, td_window_t *older, uint64_t now_ms)
{
    if (!same_shape(w, older))
        return; /* another ring's shape: nothing of it is reachable in this one */
    uint64_t now = now_ms / w->interval_ms;
    unsigned left = 0;
    for (unsigned i = 0; i < older->count; i++) {
        slot_t s = older->slots[i];
        if (!slot_kept(w, &s, now)) {
            older->slots[left++] = s;
            continue;
        }
        s.stamp = 0; /* as restored */
        *insert(w, s.interval) = s; /* td_window_room_for_older made the room */
        w->bytes += td_bins_bytes(&s.bins);
        older->bytes -= td_bins_bytes(&s.bins);
    }
    older->count = left;
}

/* ---- version 3's form (old state files) ------------------------------------------------- */

size_t td_window_slot_size_v3(unsigned channels)
{
    return TD_WINDOW_SLOT_HEADER + 8u * TALLY_HIST_BINS * channels;
}

long td_window_decode_v3(td_window_t *w, uint64_t now_ms, uint32_t saved_interval_ms,
                         const uint8_t *in, uint32_t slots)
{
    static uint64_t bins[TALLY_HIST_VALUES_MAX]; /* loop thread only */
    size_t size = td_window_slot_size_v3(w->channels);
    for (uint32_t i = 0; i < slots; i++) {
        const uint8_t *p = in + (size_t)i * size;
        tally_get_u64s(bins, p + TD_WINDOW_SLOT_HEADER, values_of(w));
        if (!slot_consistent(tally_get_u64(p + 8), tally_get_u64(p + 16), tally_get_u64(p + 24),
                             bins, w->channels))
            return -1;
        for (uint32_t j = 0; j < i; j++)
            if (tally_get_u64(in + (size_t)j * size) == tally_get_u64(p))
                return -1;
    }
    uint64_t now = now_ms / w->interval_ms;
    long dropped = 0;
    for (uint32_t i = 0; i < slots; i++) {
        const uint8_t *p = in + (size_t)i * size;
        uint64_t interval = tally_get_u64(p);
        if (!slot_wanted(w, saved_interval_ms, interval, now)) {
            dropped++;
            continue;
        }
        tally_get_u64s(bins, p + TD_WINDOW_SLOT_HEADER, values_of(w));
        if (!place(w, interval, tally_get_u64(p + 8), tally_get_u64(p + 16),
                   tally_get_u64(p + 24), bins)) {
            td_window_clear(w);
            return -2;
        }
    }
    return dropped;
}

/* ---- the window clock ------------------------------------------------------------------ */

static char *test_clock_path;

void td_clock_set_test_file(const char *path)
{
    free(test_clock_path);
    test_clock_path = path ? strdup(path) : NULL;
}

static uint64_t test_clock_read(const char *path)
{
    char buf[32];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n;
    do
        n = read(fd, buf, sizeof buf - 1);
    while (n < 0 && errno == EINTR);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    return strtoull(buf, NULL, 10);
}

uint64_t td_clock_ms(void)
{
    if (test_clock_path)
        return test_clock_read(test_clock_path);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}
