/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_bins.c — see td_bins.h. Counts are read and written through memcpy of their width, so a
 * sparse allocation needs no padding between its bins and its counts, and the compiler turns
 * each into one load or store. Every change goes through a dense u64 image of the histogram
 * (at most 1024 counts, 8 KiB on the stack): decoded, summed and encoded again in the planned
 * form. That is a few passes over the bins per batch, the cost the dense u64 arrays had anyway,
 * and it keeps one obviously correct path for every transition.
 */
#include <stdlib.h>
#include <string.h>

#include "tally_proto.h"
#include "td_bins.h"

#define VALUES_MAX TALLY_HIST_VALUES_MAX
/* The smallest sparse allocation, in pairs: one batch of a narrow signal fits without a
 * reallocation per batch. */
#define SPARSE_MIN_CAP 4u
/* The busy case's passes over dense counts (a hist batch into a stream and its window interval:
 * two a batch) built twice on x86-64, for AVX2 and for the baseline, the one the CPU runs chosen
 * once at load (GCC's target_clones): AVX2's 256-bit vectors take 4 u64 addends an instruction
 * where SSE2 takes 2; a shard's instructions for a 64 B hist 7,320 -> 6,550 (callgrind,
 * bench/NOTES.md, "A shard's instructions for a 64 B hist"). Elsewhere, one build. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

static uint64_t get_count(const uint8_t *p, uint8_t width)
{
    switch (width) {
    case 1:
        return *p;
    case 2: {
        uint16_t v;
        memcpy(&v, p, 2);
        return v;
    }
    case 4: {
        uint32_t v;
        memcpy(&v, p, 4);
        return v;
    }
    default: {
        uint64_t v;
        memcpy(&v, p, 8);
        return v;
    }
    }
}

static void put_count(uint8_t *p, uint8_t width, uint64_t v)
{
    switch (width) {
    case 1:
        *p = (uint8_t)v;
        break;
    case 2: {
        uint16_t x = (uint16_t)v;
        memcpy(p, &x, 2);
        break;
    }
    case 4: {
        uint32_t x = (uint32_t)v;
        memcpy(p, &x, 4);
        break;
    }
    default:
        memcpy(p, &v, 8);
    }
}

static uint8_t width_for(uint64_t v)
{
    return v <= UINT8_MAX ? 1 : v <= UINT16_MAX ? 2 : v <= UINT32_MAX ? 4 : 8;
}

/* The most pairs a sparse histogram of `width` may hold: half the bytes of dense. */
static size_t sparse_max(size_t values, uint8_t width)
{
    return values * width / 2 / (2u + width);
}

static size_t alloc_bytes(bool sparse, size_t values, uint8_t width, size_t cap)
{
    return sparse ? cap * (2u + width) : values * width;
}

size_t td_bins_bytes(const td_bins_t *b)
{
    return b->width ? alloc_bytes(b->sparse, b->cap, b->width, b->cap) : 0;
}

void td_bins_get(const td_bins_t *b, size_t values, uint64_t *out)
{
    memset(out, 0, values * sizeof *out);
    td_bins_accumulate(b, values, out);
}

void td_bins_accumulate(const td_bins_t *b, size_t values, uint64_t *acc)
{
    if (!b->width)
        return;
    if (b->sparse) {
        const uint8_t *counts = b->data + 2u * b->cap;
        for (size_t j = 0; j < b->used; j++) {
            uint16_t bin;
            memcpy(&bin, b->data + 2 * j, 2);
            acc[bin] += get_count(counts + j * b->width, b->width);
        }
        return;
    }
    for (size_t i = 0; i < values; i++)
        acc[i] += get_count(b->data + i * b->width, b->width);
}

/* The form that holds the counts sum[0..values) (n of them non-zero, the largest max), given
 * b's current form. */
static void choose(const td_bins_t *b, size_t values, size_t n, uint64_t max, td_bins_plan_t *p)
{
    uint8_t need = max ? width_for(max) : 0;
    p->width = need > b->width ? need : b->width;
    p->sparse = false;
    p->used = 0;
    p->cap = (uint16_t)values; /* dense: cap is the number of counts */
    p->data = NULL;
    if (!p->width) { /* still empty */
        p->cap = 0;
        p->bytes = 0;
        p->fresh = false;
        return;
    }
    if ((!b->width || b->sparse) && n <= sparse_max(values, p->width)) {
        size_t cap = b->sparse && b->width == p->width ? b->cap : SPARSE_MIN_CAP;
        while (cap < n)
            cap *= 2;
        if (cap > sparse_max(values, p->width))
            cap = sparse_max(values, p->width);
        p->sparse = true;
        p->used = (uint16_t)n;
        p->cap = (uint16_t)cap;
    }
    p->bytes = alloc_bytes(p->sparse, values, p->width, p->cap);
    p->fresh = !(b->width == p->width && b->sparse == p->sparse && b->cap == p->cap);
}

/* sum = b + add; *n the non-zero counts, the largest returned. */
static uint64_t sum_into(const td_bins_t *b, size_t values, const uint64_t *add, uint64_t *sum,
                         size_t *n)
{
    td_bins_get(b, values, sum);
    uint64_t max = 0;
    *n = 0;
    for (size_t i = 0; i < values; i++) {
        sum[i] += add ? add[i] : 0;
        *n += sum[i] != 0;
        max = sum[i] > max ? sum[i] : max;
    }
    return max;
}

/* Whether dense counts of `width` bytes (not 8) plus add all still fit that width: the busy
 * case, one pass. A count is below 2^32 and an addend below 2^62 (else: no, and the general
 * path works it out, wrapping included), so their sum cannot wrap and its bits above the width
 * say whether it fits. */
#define FITS_LOOP(type, bits)                                                                      \
    do {                                                                                           \
        const type *c = (const type *)data;                                                        \
        for (size_t i = 0; i < values; i++)                                                        \
            over |= ((c[i] + add[i]) >> (bits)) | (add[i] >> 62);                                  \
    } while (0)

VECTOR_CLONES static bool dense_fits(const uint8_t *data, uint8_t width, size_t values,
                                     const uint64_t *add)
{
    uint64_t over = 0;
    if (width == 1)
        FITS_LOOP(uint8_t, 8);
    else if (width == 2)
        FITS_LOOP(uint16_t, 16);
    else
        FITS_LOOP(uint32_t, 32);
    return over == 0;
}

static uint8_t bit_length(uint64_t v)
{
    return v ? (uint8_t)(64 - __builtin_clzll(v)) : 0;
}

/* Whether dense counts plus add fit their width, mostly without reading them: the largest count
 * has maxbits bits and the largest addend a bits, so every sum has at most max(maxbits, a) + 1.
 * The addends' bits are add_max's when the caller knows a bound (a batch's element count: no
 * 256-count pass, two of them a hist batch, bench/NOTES.md "A shard's instructions for a 64 B
 * hist"), else those of their OR (the same highest bit as their maximum, and a reduction SSE2
 * vectorises, which a 64-bit maximum is not). */
static bool dense_stays(const td_bins_t *b, size_t values, const uint64_t *add, uint64_t add_max)
{
    if (b->width == 8)
        return true; /* u64 counts wrap as they would anyway */
    uint64_t any = add_max;
    if (add_max == UINT64_MAX) {
        any = 0;
        for (size_t i = 0; i < values; i++)
            any |= add[i];
    }
    uint8_t a = bit_length(any), bits = a > b->maxbits ? a : b->maxbits;
    if (bits + 1 <= 8 * b->width)
        return true;
    return dense_fits(b->data, b->width, values, add);
}

void td_bins_plan(const td_bins_t *b, size_t values, const uint64_t *add, uint64_t add_max,
                  td_bins_plan_t *plan)
{
    if (b->width && !b->sparse && dense_stays(b, values, add, add_max)) {
        *plan = (td_bins_plan_t){.width = b->width, .cap = b->cap, .bytes = td_bins_bytes(b)};
        return; /* dense stays dense in its width; u64 counts wrap as they would anyway */
    }
    uint64_t sum[VALUES_MAX];
    size_t n = 0;
    uint64_t max = sum_into(b, values, add, sum, &n);
    choose(b, values, n, max, plan);
}

bool td_bins_prepare(td_bins_plan_t *plan)
{
    if (!plan->fresh)
        return true;
    plan->data = malloc(plan->bytes);
    return plan->data != NULL;
}

void td_bins_abort(td_bins_plan_t *plan)
{
    free(plan->data);
    plan->data = NULL;
}

/* Writes sum[0..values) into data in the plan's form. */
static void encode_form(const td_bins_plan_t *p, size_t values, const uint64_t *sum, uint8_t *data)
{
    if (!p->sparse) {
        for (size_t i = 0; i < values; i++)
            put_count(data + i * p->width, p->width, sum[i]);
        return;
    }
    uint8_t *counts = data + 2u * p->cap;
    size_t j = 0;
    for (size_t i = 0; i < values; i++) {
        if (!sum[i])
            continue;
        uint16_t bin = (uint16_t)i;
        memcpy(data + 2 * j, &bin, 2);
        put_count(counts + j * p->width, p->width, sum[i]);
        j++;
    }
}

/* Installs sum (laid out as p says, its largest count max) into b. */
static void install(td_bins_t *b, size_t values, const uint64_t *sum, uint64_t max,
                    td_bins_plan_t *p)
{
    if (!p->width)
        return;
    b->maxbits = bit_length(max);
    uint8_t *data = p->fresh ? p->data : b->data;
    encode_form(p, values, sum, data);
    if (p->fresh) {
        free(b->data);
        b->data = data;
        p->data = NULL;
    }
    b->width = p->width;
    b->sparse = p->sparse;
    b->used = p->used;
    b->cap = p->cap;
}

#define ADD_LOOP(type)                                                                             \
    do {                                                                                           \
        type *c = (type *)data, m = 0;                                                             \
        for (size_t i = 0; i < values; i++) {                                                      \
            type v = (type)(c[i] + add[i]);                                                        \
            c[i] = v;                                                                              \
            m |= v;                                                                                \
        }                                                                                          \
        max = m;                                                                                   \
    } while (0)

/* Dense counts += add, in place (the plan says they fit); returns the OR of the counts (the
 * bits of the largest). */
VECTOR_CLONES static uint64_t add_dense(uint8_t *data, uint8_t width, size_t values,
                                        const uint64_t *add)
{
    uint64_t max = 0;
    if (width == 1)
        ADD_LOOP(uint8_t);
    else if (width == 2)
        ADD_LOOP(uint16_t);
    else if (width == 4)
        ADD_LOOP(uint32_t);
    else
        ADD_LOOP(uint64_t);
    return max;
}

void td_bins_commit(td_bins_t *b, size_t values, const uint64_t *add, td_bins_plan_t *plan)
{
    if (b->width && !b->sparse && !plan->fresh) { /* the busy case: dense, no wider count */
        b->maxbits = bit_length(add_dense(b->data, b->width, values, add));
        return;
    }
    uint64_t sum[VALUES_MAX];
    size_t n = 0;
    uint64_t max = sum_into(b, values, add, sum, &n);
    install(b, values, sum, max, plan);
}

bool td_bins_add(td_bins_t *b, size_t values, const uint64_t *add)
{
    td_bins_plan_t plan;
    td_bins_plan(b, values, add, UINT64_MAX, &plan);
    if (!td_bins_prepare(&plan))
        return false;
    td_bins_commit(b, values, add, &plan);
    return true;
}

void td_bins_clear(td_bins_t *b)
{
    free(b->data);
    memset(b, 0, sizeof *b);
}

bool td_bins_set(td_bins_t *b, size_t values, const uint64_t *v)
{
    td_bins_t fresh = {0};
    if (!td_bins_add(&fresh, values, v))
        return false;
    td_bins_clear(b);
    *b = fresh;
    return true;
}

/* ---- the encoded form ------------------------------------------------------------------ */

/* A count of `width` bytes, little-endian. */
static void le_put(uint8_t *p, uint8_t width, uint64_t v)
{
    for (uint8_t i = 0; i < width; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t le_get(const uint8_t *p, uint8_t width)
{
    uint64_t v = 0;
    for (int i = width - 1; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

size_t td_bins_encode(const td_bins_t *b, size_t values, uint8_t *out)
{
    if (!b->width || (b->sparse && !b->used)) { /* every count 0 (or wrapped to 0) */
        if (out)
            out[0] = 0;
        return 1;
    }
    size_t pairs = b->sparse ? b->used : 0;
    size_t size = 4 + (b->sparse ? pairs * (2u + b->width) : values * b->width);
    if (!out)
        return size;
    out[0] = b->width;
    out[1] = b->sparse;
    tally_put_u16(out + 2, (uint16_t)pairs);
    uint8_t *p = out + 4;
    if (b->sparse) {
        const uint8_t *counts = b->data + 2u * b->cap;
        for (size_t j = 0; j < pairs; j++) {
            uint16_t bin;
            memcpy(&bin, b->data + 2 * j, 2);
            tally_put_u16(p + 2 * j, bin);
        }
        p += 2 * pairs;
        for (size_t j = 0; j < pairs; j++)
            le_put(p + j * b->width, b->width, get_count(counts + j * b->width, b->width));
        return size;
    }
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* The encoded form is the in-memory one in little-endian: a copy here. A count at a time
     * took ~2.5 us for 256 four-byte counts on the 2-core dev box, 11 % of a replicated member's
     * cycles under the changelog's lock (bench/NOTES.md, "Where a held write waits"). */
    memcpy(p, b->data, values * b->width);
#else
    for (size_t i = 0; i < values; i++)
        le_put(p + i * b->width, b->width, get_count(b->data + i * b->width, b->width));
#endif
    return size;
}

static size_t decode_sparse(const uint8_t *p, size_t room, size_t values, uint8_t width,
                            size_t pairs, uint64_t *out)
{
    if (pairs == 0 || pairs > values || room < pairs * (2u + width))
        return 0;
    const uint8_t *counts = p + 2 * pairs;
    for (size_t j = 0; j < pairs; j++) {
        size_t bin = tally_get_u16(p + 2 * j);
        uint64_t v = le_get(counts + j * width, width);
        if (bin >= values || (j && bin <= tally_get_u16(p + 2 * (j - 1))) || v == 0)
            return 0;
        out[bin] = v;
    }
    return pairs * (2u + width);
}

size_t td_bins_decode(const uint8_t *in, size_t len, size_t values, uint64_t *out)
{
    memset(out, 0, values * sizeof *out);
    if (len < 1)
        return 0;
    uint8_t width = in[0];
    if (width == 0)
        return 1;
    if ((width != 1 && width != 2 && width != 4 && width != 8) || len < 4 || in[1] > 1)
        return 0;
    size_t pairs = tally_get_u16(in + 2);
    if (in[1]) {
        size_t got = decode_sparse(in + 4, len - 4, values, width, pairs, out);
        return got ? 4 + got : 0;
    }
    if (pairs != 0 || len - 4 < values * width)
        return 0;
    for (size_t i = 0; i < values; i++)
        out[i] = le_get(in + 4 + i * width, width);
    return 4 + values * width;
}
