/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_changelog_stages.c — see td_changelog_stages.h.
 */

#include "td_changelog_stages.h"
#include "td_monotonic.h"

void td_cl_stage(td_fleet_status_t *st, td_cl_stage_t which, int64_t from_ns, int64_t to_ns)
{
    td_fleet_status_stage(st, which, to_ns > from_ns ? (uint64_t)(to_ns - from_ns) : 0);
}

void td_cl_times_held(td_cl_times_t *t, bool first, bool reached_bytes)
{
    if (first) {
        t->first_ns = (int64_t)td_mono_ns();
        t->bytes_ns = 0;
    }
    if (reached_bytes)
        t->bytes_ns = (int64_t)td_mono_ns();
}

void td_cl_times_publishing(td_cl_times_t *t, td_fleet_status_t *st, int64_t commit_ms,
                            int64_t start_ns)
{
    int64_t due_ns = t->first_ns + commit_ms * 1000000;
    if (t->bytes_ns && t->bytes_ns < due_ns)
        due_ns = t->bytes_ns;
    /* Only one PubAck can have freed a flight since it was due: the committer publishes the
     * batch at the first free one. */
    if (t->full_ns && t->full_ns <= due_ns && due_ns < t->freed_ns) {
        atomic_fetch_add_explicit(&st->cl_flights_full, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&st->cl_flight_wait_ns, (uint64_t)(t->freed_ns - due_ns),
                                  memory_order_relaxed);
    }
    td_cl_stage(st, TD_CL_STAGE_BATCH, t->first_ns, start_ns);
}

void td_cl_times_sent(td_cl_times_t *t, td_fleet_status_t *st, int64_t start_ns, int64_t sent_ns,
                      bool full, bool rest)
{
    td_cl_stage(st, TD_CL_STAGE_PUBLISH, start_ns, sent_ns);
    if (full)
        t->full_ns = sent_ns;
    if (rest)
        t->bytes_ns = sent_ns;
}

void td_cl_times_settled(td_cl_times_t *t, uint64_t ok_upto, int64_t ack_ns, bool was_full)
{
    if (ok_upto) {
        t->settles[t->nsettles % TD_CL_SETTLES].ticket = ok_upto;
        t->settles[t->nsettles % TD_CL_SETTLES].ns = ack_ns;
        t->nsettles++;
    }
    if (was_full)
        t->freed_ns = ack_ns;
}

void td_cl_times_released(const td_cl_times_t *t, td_fleet_status_t *st, uint64_t ticket)
{
    int64_t at = 0; /* the earliest remembered settlement that covers ticket */
    for (uint64_t n = t->nsettles; n > 0 && t->nsettles - n < TD_CL_SETTLES; n--) {
        if (t->settles[(n - 1) % TD_CL_SETTLES].ticket < ticket)
            break;
        at = t->settles[(n - 1) % TD_CL_SETTLES].ns;
    }
    if (at)
        td_cl_stage(st, TD_CL_STAGE_RELEASE, at, (int64_t)td_mono_ns());
}

void td_cl_times_taken(td_cl_times_t *t)
{
    t->full_ns = t->freed_ns = 0;
}
