/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tk_predicate.h — what a filter predicate means for one element type: the one reduction the
 * CPU backend (cpu_backend.c) and the CUDA filter (cuda/tk_cuda_filter.cu) both use.
 *
 * A predicate of the protocol (gt, ge, lt, le, eq, ne, between) has arbitrary int64 thresholds;
 * over the integers [tmin, tmax] of an element type it means one of: keep nothing, keep
 * everything, keep an inclusive range [a, b] of the type (gt t -> [t+1, MAX], le t -> [MIN, t],
 * ...) or keep x != a. So u8 `gt 300` keeps nothing and `gt -5` everything, without a comparison
 * per element. The reduction is exact: no step can overflow.
 *
 * The CPU backend picks a loop per kind; the CUDA kernels make one test on every element,
 * keep x iff (lo <= x <= hi) != invert (tk_keep_range below: ne is an inverted point, nothing an
 * empty range), so one kernel per type serves every predicate.
 *
 * Plain C, usable from C and CUDA: under nvcc the functions are host and device functions.
 */
#ifndef TK_PREDICATE_H
#define TK_PREDICATE_H

#include <stdbool.h>
#include <stdint.h>

#include "tk_backend.h"

/* Static inline functions, for the host and (under nvcc) the device. */
#ifdef __CUDACC__
#define TK_INLINE static __host__ __device__ __forceinline__
#else
#define TK_INLINE static inline
#endif

typedef enum { TK_KEEP_NONE, TK_KEEP_ALL, TK_KEEP_RANGE, TK_KEEP_NE } tk_keep_kind_t;

typedef struct {
    tk_keep_kind_t kind;
    int64_t a; /* TK_KEEP_RANGE: a <= x <= b, both inside the type; TK_KEEP_NE: x != a */
    int64_t b;
} tk_keep_rule_t;

/* Reduces spec to a rule over the integers [tmin, tmax] of the element type; TALLY_E_PARAM for
 * an unknown predicate. */
TK_INLINE tally_status_t tk_keep_rule_make(const tk_filter_spec_t *spec, int64_t tmin, int64_t tmax,
                                           tk_keep_rule_t *rule)
{
    int64_t a = tmin, b = tmax, t = spec->lo;

    switch (spec->pred) {
    case TALLY_PRED_GT:
        if (t >= tmax)
            goto none;
        a = t + 1;
        break;
    case TALLY_PRED_GE:
        a = t;
        break;
    case TALLY_PRED_LT:
        if (t <= tmin)
            goto none;
        b = t - 1;
        break;
    case TALLY_PRED_LE:
        b = t;
        break;
    case TALLY_PRED_EQ:
        a = b = t;
        break;
    case TALLY_PRED_BETWEEN:
        a = spec->lo;
        b = spec->hi;
        break;
    case TALLY_PRED_NE:
        /* A threshold outside the type differs from every element. */
        rule->kind = (t < tmin || t > tmax) ? TK_KEEP_ALL : TK_KEEP_NE;
        rule->a = rule->b = t;
        return TALLY_OK;
    default:
        return TALLY_E_PARAM;
    }
    if (a < tmin)
        a = tmin;
    if (b > tmax)
        b = tmax;
    if (a > b)
        goto none;
    rule->kind = (a == tmin && b == tmax) ? TK_KEEP_ALL : TK_KEEP_RANGE;
    rule->a = a;
    rule->b = b;
    return TALLY_OK;
none:
    rule->kind = TK_KEEP_NONE;
    rule->a = rule->b = 0;
    return TALLY_OK;
}

/* A rule of a type of at most 32 bits as the kernels' one test: keep x iff
 * (lo <= x <= hi) != invert. */
typedef struct {
    int lo, hi, invert;
} tk_keep_range_t;

TK_INLINE tk_keep_range_t tk_keep_range(const tk_keep_rule_t *rule)
{
    tk_keep_range_t r = {(int)rule->a, (int)rule->b, 0}; /* the rule's bounds fit the type */
    switch (rule->kind) {
    case TK_KEEP_NONE: /* an empty range */
        r.lo = 1;
        r.hi = 0;
        break;
    case TK_KEEP_ALL: /* an empty range, inverted */
        r.lo = 1;
        r.hi = 0;
        r.invert = 1;
        break;
    case TK_KEEP_NE: /* the point, inverted */
        r.invert = 1;
        break;
    case TK_KEEP_RANGE:
        break;
    }
    return r;
}

TK_INLINE bool tk_keep_in_range(int x, int lo, int hi, int invert)
{
    return ((x >= lo) & (x <= hi)) != (invert != 0);
}

#endif
