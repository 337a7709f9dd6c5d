/*
 * td_window.c — see td_window.h. A slot is an array of u64 in host order: [0] the interval
 * tag + 1 (0 = never used), [1] underflow, [2] overflow, [3] total, [4..] channels x 256 bins.
 * The tag is stored plus one so that a zeroed slot is an empty one and interval 0 (the epoch's
 * first) is still representable.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "td_window.h"

enum { SLOT_TAG, SLOT_UNDER, SLOT_OVER, SLOT_TOTAL, SLOT_BINS };

struct td_window {
    unsigned intervals;
    uint32_t interval_ms;
    unsigned channels;
    size_t slot_words; /* u64 per slot */
    uint64_t slots[];  /* intervals x slot_words, allocated with the ring */
};

size_t td_window_slot_size(unsigned channels)
{
    return TD_WINDOW_SLOT_HEADER + 8u * TALLY_HIST_BINS * channels;
}

size_t td_window_bytes(unsigned intervals, unsigned channels)
{
    return (size_t)intervals * td_window_slot_size(channels);
}

td_window_t *td_window_new(unsigned intervals, uint32_t interval_ms, unsigned channels)
{
    if (intervals == 0 || interval_ms == 0 || channels == 0 || channels > TALLY_HIST_CHANNELS_MAX)
        return NULL;
    size_t slot_words = td_window_slot_size(channels) / 8;
    if (intervals > (SIZE_MAX - sizeof(td_window_t)) / (slot_words * 8))
        return NULL;
    td_window_t *w = calloc(1, sizeof *w + td_window_bytes(intervals, channels));
    if (!w)
        return NULL;
    w->intervals = intervals;
    w->interval_ms = interval_ms;
    w->channels = channels;
    w->slot_words = slot_words;
    return w;
}

void td_window_destroy(td_window_t **self_p)
{
    td_window_t *w = *self_p;
    if (!w)
        return;
    free(w);
    *self_p = NULL;
}

unsigned td_window_intervals(const td_window_t *w)
{
    return w->intervals;
}

uint32_t td_window_interval_ms(const td_window_t *w)
{
    return w->interval_ms;
}

/* Where interval's slot starts in w->slots. */
static size_t slot_of(const td_window_t *w, uint64_t interval)
{
    return (size_t)(interval % w->intervals) * w->slot_words;
}

void td_window_add(td_window_t *w, uint64_t now_ms, const uint64_t *bins, uint64_t underflow,
                   uint64_t overflow, uint64_t n)
{
    uint64_t interval = now_ms / w->interval_ms;
    uint64_t *slot = w->slots + slot_of(w, interval);
    if (slot[SLOT_TAG] != interval + 1) { /* stale: an interval the ring has left behind */
        memset(slot, 0, w->slot_words * 8);
        slot[SLOT_TAG] = interval + 1;
    }
    slot[SLOT_UNDER] += underflow;
    slot[SLOT_OVER] += overflow;
    slot[SLOT_TOTAL] += n;
    for (size_t b = 0; b < (size_t)w->channels * TALLY_HIST_BINS; b++)
        slot[SLOT_BINS + b] += bins[b];
}

void td_window_clear(td_window_t *w)
{
    memset(w->slots, 0, (size_t)w->intervals * w->slot_words * 8);
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
    for (unsigned i = 0; i < k; i++) {
        const uint64_t *slot = w->slots + slot_of(w, now - i);
        if (slot[SLOT_TAG] != now - i + 1)
            continue;
        info->hist_underflow += slot[SLOT_UNDER];
        info->hist_overflow += slot[SLOT_OVER];
        info->hist_total += slot[SLOT_TOTAL];
        for (size_t b = 0; b < (size_t)w->channels * TALLY_HIST_BINS; b++)
            info->bins[b] += slot[SLOT_BINS + b];
    }
    return (now + 1 - k) * w->interval_ms;
}

/* A slot the ring still reaches at interval `now`: used, not older than intervals - 1 back, and
 * not in the future (a clock that stepped back leaves those to be overwritten). */
static bool slot_live(const td_window_t *w, const uint64_t *slot, uint64_t now)
{
    if (slot[SLOT_TAG] == 0)
        return false;
    uint64_t interval = slot[SLOT_TAG] - 1;
    return interval <= now && now - interval < w->intervals;
}

size_t td_window_encode(const td_window_t *w, uint64_t now_ms, uint8_t *out, uint32_t *slots)
{
    uint64_t now = now_ms / w->interval_ms;
    size_t at = 0;
    *slots = 0;
    for (unsigned i = 0; i < w->intervals; i++) {
        const uint64_t *slot = w->slots + (size_t)i * w->slot_words;
        if (!slot_live(w, slot, now) || slot[SLOT_TOTAL] == 0)
            continue;
        if (out) {
            tally_put_u64(out + at, slot[SLOT_TAG] - 1);
            for (size_t j = 1; j < w->slot_words; j++)
                tally_put_u64(out + at + 8 * j, slot[j]);
        }
        at += w->slot_words * 8;
        (*slots)++;
    }
    return at;
}

/* total == bins of channel 0 + underflow + overflow (every channel counts each element once:
 * checked for each channel). Sums wrap like the counters. */
static bool slot_consistent(const uint8_t *p, unsigned channels)
{
    uint64_t total = tally_get_u64(p + 24);
    for (unsigned c = 0; c < channels; c++) {
        uint64_t sum = tally_get_u64(p + 8) + tally_get_u64(p + 16);
        for (size_t b = 0; b < TALLY_HIST_BINS; b++)
            sum += tally_get_u64(p + TD_WINDOW_SLOT_HEADER + 8 * (c * TALLY_HIST_BINS + b));
        if (sum != total)
            return false;
    }
    return true;
}

long td_window_decode(td_window_t *w, uint64_t now_ms, uint32_t saved_interval_ms,
                      const uint8_t *in, uint32_t slots)
{
    size_t size = w->slot_words * 8;
    for (uint32_t i = 0; i < slots; i++) {
        const uint8_t *p = in + (size_t)i * size;
        if (!slot_consistent(p, w->channels))
            return -1;
        for (uint32_t j = 0; j < i; j++)
            if (tally_get_u64(in + (size_t)j * size) == tally_get_u64(p))
                return -1;
    }
    if (saved_interval_ms != w->interval_ms)
        return (long)slots; /* the intervals mean other times: nothing carries over */
    uint64_t now = now_ms / w->interval_ms;
    long dropped = 0;
    for (uint32_t i = 0; i < slots; i++) {
        const uint8_t *p = in + (size_t)i * size;
        uint64_t interval = tally_get_u64(p);
        uint64_t tag[1] = {interval + 1};
        if (interval == UINT64_MAX || !slot_live(w, tag, now)) {
            dropped++;
            continue;
        }
        uint64_t *slot = w->slots + slot_of(w, interval);
        slot[SLOT_TAG] = interval + 1;
        for (size_t j = 1; j < w->slot_words; j++)
            slot[j] = tally_get_u64(p + 8 * j);
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
