/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_monotonic.h — the daemon's one monotonic clock (CLOCK_MONOTONIC), what its timeouts,
 * spins, watchdogs, leases and stage timings measure with. Not the window clock (td_window.h's
 * td_clock_ms: the wall clock that windows are named in, which may step).
 */
#ifndef TD_MONOTONIC_H
#define TD_MONOTONIC_H

#include <stdint.h>
#include <time.h>

/* Nanoseconds since an arbitrary point (the host's boot). */
static inline uint64_t td_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Milliseconds, of the same clock. */
static inline int64_t td_mono_ms(void)
{
    return (int64_t)(td_mono_ns() / 1000000u);
}

/* The time ms from now by `clock` (this one, or CLOCK_REALTIME for a condition variable made
 * without a clock): what pthread_cond_timedwait waits until. */
static inline struct timespec td_deadline_after(clockid_t clock, int64_t ms)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

#endif
