/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tk_u16_slot.h — the CUDA histogram's form of the uint16 bin (tally_hist_bin_u16), in four
 * 32-bit operations and no branch, with underflow and overflow folded in; plain C so that
 * tests/test_cpu_backend.c checks it on every range without a GPU.
 *
 * Why: the 64-bit multiply and variable shift of tally_hist_bin_u16, plus two compares and
 * branches for the range, made the uint16 histogram kernel about 141 instructions per 16-byte
 * vector, and at the H200's bandwidth it was bound by instruction issue (0.64 x read, 2026-11-26).
 *
 * The slot of x is 0 for x < lo, 1 + tally_hist_bin_u16(x - lo, ...) for lo <= x < hi and 257
 * for x >= hi:
 *     d = x * scale + bias                 (= (x - lo) * 2^s1, exact in int32: |d| < 2^27)
 *     d = min(max(d, -1), top)             (top = R * 2^s1, R = hi - lo)
 *     slot = floor(d * mul / 2^32) + 1     (mul = m * 2^s2, the signed high product)
 * with l = ceil(log2 R), tally_hist_u16_recip's m = ceil(2^(24 + l) / R) (< 2^25), s2 = min(6,
 * 16 - l) and s1 = 16 - l - s2 (>= 0). In range, d * mul / 2^32 = (x - lo) * m / 2^(16 + l),
 * whose floor is tally_hist_bin_u16's ((x - lo) * 256 * m) >> (24 + l): the same integer, not an
 * approximation of it. For x >= hi the clamp gives R * m / 2^(16 + l) = (2^(24 + l) + e) /
 * 2^(16 + l) with 0 <= e < R <= 2^l, whose floor is 256 (slot 257). For x < lo, d = -1 and
 * mul < 2^31 give floor(-mul / 2^32) = -1 (slot 0). mul = m * 2^s2 < 2^25 * 2^6 = 2^31 is a
 * positive int32. The product is monotone in x, so checking both sides of every bin edge checks
 * every x (the test does that for every R).
 */
#ifndef TK_U16_SLOT_H
#define TK_U16_SLOT_H

#include <stdint.h>

#include "tally_proto.h"

typedef struct {
    int scale; /* 2^s1 */
    int bias;  /* -lo * 2^s1 */
    int top;   /* R * 2^s1 */
    int mul;   /* m * 2^s2 */
} tk_u16_slot_t;

/* The constants for the range [lo, hi), 0 <= lo < hi <= 65536. */
static inline void tk_u16_slot_init(int64_t lo, int64_t hi, tk_u16_slot_t *p)
{
    uint64_t m;
    unsigned shift;
    tally_hist_u16_recip(lo, hi, &m, &shift);
    unsigned l = shift - 24, s2 = 16 - l < 6 ? 16 - l : 6, s1 = 16 - l - s2;
    p->scale = 1 << s1;
    p->bias = -(int)(lo << s1);
    p->top = (int)((hi - lo) << s1);
    p->mul = (int)(m << s2);
}

static inline TALLY_HOST_DEVICE int tk_u16_slot(unsigned x, const tk_u16_slot_t *p)
{
    int d = (int)x * p->scale + p->bias;
#ifdef __CUDA_ARCH__
    return __mulhi(min(max(d, -1), p->top), p->mul) + 1; /* two IMNMX, not compares and selects */
#else
    d = d < -1 ? -1 : d > p->top ? p->top : d;
    /* floor(d * mul / 2^32) for negative d too (an arithmetic shift would be
     * implementation-defined): 2^32 * 2^31 keeps the sum positive. */
    return (int)((((int64_t)d * p->mul) + ((int64_t)1 << 62)) >> 32) - (1 << 30) + 1;
#endif
}

#endif /* TK_U16_SLOT_H */
