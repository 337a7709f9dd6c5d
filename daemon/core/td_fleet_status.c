/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_status.c — a fleet worker's `info` keys and metrics (td_fleet_status.h).
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_fleet_status.h"

#define LOAD(x) atomic_load_explicit(&(x), memory_order_relaxed)

void td_fleet_status_stage(td_fleet_status_t *st, td_cl_stage_t stage, uint64_t ns)
{
    unsigned b = 0;
    while (b < TD_LATENCY_BUCKETS && (double)ns > td_latency_bounds_us[b] * 1e3)
        b++;
    atomic_fetch_add_explicit(&st->cl_stage_buckets[stage][b], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&st->cl_stage_ns[stage], ns, memory_order_relaxed);
}

uint32_t td_fleet_status_owned(const td_fleet_status_t *st)
{
    uint32_t n = 0;
    for (uint32_t k = 0; st->on && k < st->partitions; k++)
        n += LOAD(st->owned[k]) ? 1 : 0;
    return n;
}

bool td_fleet_status_is_self(const td_fleet_status_t *st, const char *id)
{
    if (!st->on)
        return false;
    size_t len = strlen(st->member);
    if (st->members_per_process <= 1)
        return strcmp(id, st->member) == 0;
    if (strncmp(id, st->member, len) != 0 || id[len] != '-' || id[len + 1] < '0' ||
        id[len + 1] > '9')
        return false;
    char *end = NULL;
    unsigned long i = strtoul(id + len + 1, &end, 10);
    bool canonical = id[len + 1] != '0' || id[len + 2] == 0; /* no leading zero: "-0" alone */
    return *end == 0 && i < st->members_per_process && canonical;
}

/* A partition's lag: 0 when the worker has applied all it has seen. */
static uint64_t lag_of(const td_fleet_status_t *st, uint32_t k)
{
    uint64_t last = LOAD(st->last_seq[k]), applied = LOAD(st->applied_seq[k]);
    return last > applied ? last - applied : 0;
}

/* A partition's messages fetched and waiting for the fleet thread: its reader's count and the
 * fleet thread's are stored apart, so the one read first may be a message behind (never below
 * 0). */
static uint64_t fetched_of(const td_fleet_status_t *st, uint32_t k)
{
    uint64_t fetched = LOAD(st->fetched[k]), taken = LOAD(st->taken[k]);
    return fetched > taken ? fetched - taken : 0;
}

static uint64_t window_of(const td_fleet_status_t *st, uint32_t k)
{
    return LOAD(st->window[k]);
}

static uint64_t in_path_of(const td_fleet_status_t *st, uint32_t k)
{
    return LOAD(st->in_path[k]);
}

static uint64_t in_path_bytes_of(const td_fleet_status_t *st, uint32_t k)
{
    return LOAD(st->in_path_bytes[k]);
}

size_t td_fleet_status_info(const td_fleet_status_t *st, char *out, size_t cap)
{
    if (!st->on) {
        int n = snprintf(out, cap, "nats=off\n");
        return n > 0 ? (size_t)n : 0;
    }
    /* The largest reply a message naming Tally-Reply may ask for (§13 "Validation"). */
    uint64_t reply_max = st->max_payload > 4096 ? st->max_payload - 4096 : 0;
    int n = snprintf(
        out, cap,
        "nats=on\nnats_member_id=%s\nnats_partitions=%" PRIu32 "\nnats_partitions_owned=%" PRIu32
        "\nnats_lease_ttl_ms=%" PRIu64 "\nnats_checkpoint_interval_ms=%" PRIu64
        "\nnats_max_payload=%" PRIu64 "\nnats_max_reply=%" PRIu64
        "\nnats_direct=%s\nnats_direct_uncommitted=%" PRIu64 "\nnats_changelog_commits=%" PRIu64
        "\nnats_not_durable=%" PRIu64 "\nnats_changelog_purges=%" PRIu64 "\n",
        st->member, st->partitions, td_fleet_status_owned(st), st->lease_ttl_ms,
        st->checkpoint_interval_ms, st->max_payload, reply_max,
        st->replicated ? "replicated"
        : st->direct   ? "local"
                       : "off",
        LOAD(st->direct_uncommitted), LOAD(st->changelog_commits), LOAD(st->not_durable),
        LOAD(st->changelog_purges));
    if (n < 0)
        return 0;
    if (st->members_per_process > 1) { /* said only where it is not 1 */
        size_t at = (size_t)n < cap ? (size_t)n : cap;
        int m = snprintf(out + at, cap - at, "nats_members_per_process=%u\n",
                         st->members_per_process);
        n += m > 0 ? m : 0;
    }
    return (size_t)n;
}

/* Text appended to out[0..cap) like snprintf: len counts what is needed, even past cap. */
typedef struct {
    char *out;
    size_t cap, len;
} text_t;

static void put(text_t *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(text_t *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    size_t room = t->len < t->cap ? t->cap - t->len : 0;
    int n = vsnprintf(room ? t->out + t->len : NULL, room, fmt, ap);
    va_end(ap);
    if (n > 0)
        t->len += (size_t)n;
}

static void counter(text_t *t, const char *name, const char *help, uint64_t value)
{
    put(t, "# HELP %s %s\n# TYPE %s counter\n%s %" PRIu64 "\n", name, help, name, name, value);
}

/* A counter of seconds kept in nanoseconds. */
static void seconds_counter(text_t *t, const char *name, const char *help, uint64_t ns)
{
    put(t, "# HELP %s %s\n# TYPE %s counter\n%s %.9f\n", name, help, name, name, (double)ns / 1e9);
}

static void gauge(text_t *t, const char *name, const char *help, uint64_t value)
{
    put(t, "# HELP %s %s\n# TYPE %s gauge\n%s %" PRIu64 "\n", name, help, name, name, value);
}

/* A gauge family with a sample per owned partition (none for the others). */
static void partition_gauge(text_t *t, const td_fleet_status_t *st, const char *name,
                            const char *help,
                            uint64_t (*value)(const td_fleet_status_t *st, uint32_t k))
{
    put(t, "# HELP %s %s\n# TYPE %s gauge\n", name, help, name);
    for (uint32_t k = 0; k < st->partitions; k++)
        if (LOAD(st->owned[k]))
            put(t, "%s{partition=\"%" PRIu32 "\"} %" PRIu64 "\n", name, k, value(st, k));
}

/* Where an owned partition's messages not yet applied wait (issue 32): the request path, the
 * fleet thread, or (neither, with lag) the fetch; and the window they are held to. */
static void render_backlog(text_t *t, const td_fleet_status_t *st)
{
    partition_gauge(t, st, "tallyd_nats_partition_lag",
                    "Messages of an owned partition not yet applied (its last sequence seen "
                    "minus the last applied).",
                    lag_of);
    partition_gauge(t, st, "tallyd_nats_partition_window",
                    "Messages in an owned partition's window: in the request path (in_path), "
                    "answered and waiting for an earlier one to retire, or refused busy and "
                    "waiting to be sent again. Near tallyd_nats_inflight_limit with in_path "
                    "well below it: a slow message at its head holds the others.",
                    window_of);
    partition_gauge(t, st, "tallyd_nats_partition_in_path",
                    "Messages of an owned partition's window in the request path now: sent by "
                    "the fleet thread and their replies not taken back by it yet (those still "
                    "queued for the loop thread or held there at max_inflight, and replies "
                    "queued back, count); not those answered that wait for an earlier one to "
                    "retire, nor those refused busy that wait to be sent again. Near "
                    "tallyd_nats_inflight_limit: the request path is the bound.",
                    in_path_of);
    partition_gauge(t, st, "tallyd_nats_partition_in_path_bytes",
                    "Bytes of those messages (request header and payload), held to "
                    "tallyd_nats_inflight_limit_bytes.",
                    in_path_bytes_of);
    partition_gauge(t, st, "tallyd_nats_partition_fetched",
                    "Messages of an owned partition its reader has fetched that wait for the "
                    "fleet thread: in the reader's queue, or taken from it and not yet into the "
                    "window (one waits there while the window is full). High with the window "
                    "not full: the fleet thread is the bound; both low with lag high: the fetch.",
                    fetched_of);
    gauge(t, "tallyd_nats_inflight_limit",
          "[nats] inflight: the most messages of a partition's window (in the request path, or "
          "answered and waiting for an earlier one).",
          st->inflight);
    gauge(t, "tallyd_nats_inflight_limit_bytes",
          "[nats] inflight_bytes: the most bytes of a partition's window's messages (a larger "
          "one goes alone).",
          st->inflight_bytes);
}

/* Standbys ([nats] standbys, docs/fleet.md "Standbys"): where take-overs loaded from, and the
 * copies this member keeps (a sample per partition it holds a copy of). */
static void render_standbys(text_t *t, const td_fleet_status_t *st)
{
    put(t,
        "# HELP tallyd_nats_takes_total Take-overs of a partition by where its state came from: "
        "this member's standby copy plus the changelog after it (standby), or the checkpoint "
        "plus the changelog after it (checkpoint).\n# TYPE tallyd_nats_takes_total counter\n"
        "tallyd_nats_takes_total{from=\"standby\"} %" PRIu64
        "\ntallyd_nats_takes_total{from=\"checkpoint\"} %" PRIu64 "\n",
        LOAD(st->takes_from_standby), LOAD(st->takes_from_checkpoint));
    counter(t, "tallyd_nats_standby_applied_total",
            "Changelog messages applied to this member's standby copies as they came.",
            LOAD(st->standby_applied));
    counter(t, "tallyd_nats_standby_starts_total",
            "Standby copies (re)started from a partition's checkpoint: one per checkpoint seen.",
            LOAD(st->standby_starts));
    put(t,
        "# HELP tallyd_nats_standby_checkpoints_total New checkpoints a standby copy here saw: "
        "the copy kept (the manifest's cl_since covers it: it runs on, no reload) or restarted "
        "from the new checkpoint.\n# TYPE tallyd_nats_standby_checkpoints_total counter\n"
        "tallyd_nats_standby_checkpoints_total{copy=\"kept\"} %" PRIu64
        "\ntallyd_nats_standby_checkpoints_total{copy=\"restarted\"} %" PRIu64 "\n",
        LOAD(st->standby_kept), LOAD(st->standby_restarts));
    gauge(t, "tallyd_nats_standby_bytes",
          "Bytes of stream state in this member's standby copies (under max_state_bytes, apart "
          "from its own streams').",
          LOAD(st->standby_bytes));
    put(t, "# HELP tallyd_nats_standby_changelog_seq The last changelog sequence a standby copy "
           "here applied (TALLY_CL<k>), per partition it holds a copy of.\n"
           "# TYPE tallyd_nats_standby_changelog_seq gauge\n");
    for (uint32_t k = 0; k < st->partitions; k++)
        if (LOAD(st->standby_cl_seq[k]))
            put(t, "tallyd_nats_standby_changelog_seq{partition=\"%" PRIu32 "\"} %" PRIu64 "\n", k,
                LOAD(st->standby_cl_seq[k]));
}

/* The changelog's stages (td_cl_stage_t), one histogram family labelled by stage. */
static void render_stages(text_t *t, const td_fleet_status_t *st)
{
    static const char *const names[TD_CL_STAGES] = {"batch", "publish", "ack", "release"};
    put(t, "# HELP tallyd_nats_changelog_stage_seconds Where held writes wait (direct = "
           "replicated), per changelog message: its first record held until its publish began "
           "(batch), the publish (publish), until its PubAck came (ack); per write: until its "
           "shard handed its reply on (release).\n"
           "# TYPE tallyd_nats_changelog_stage_seconds histogram\n");
    for (unsigned s = 0; s < TD_CL_STAGES; s++) {
        uint64_t cumulative = 0;
        for (unsigned b = 0; b <= TD_LATENCY_BUCKETS; b++) {
            cumulative += LOAD(st->cl_stage_buckets[s][b]);
            if (b < TD_LATENCY_BUCKETS)
                put(t,
                    "tallyd_nats_changelog_stage_seconds_bucket{stage=\"%s\",le=\"%g\"} %" PRIu64
                    "\n",
                    names[s], td_latency_bounds_us[b] / 1e6, cumulative);
        }
        put(t,
            "tallyd_nats_changelog_stage_seconds_bucket{stage=\"%s\",le=\"+Inf\"} %" PRIu64 "\n"
            "tallyd_nats_changelog_stage_seconds_sum{stage=\"%s\"} %.9f\n"
            "tallyd_nats_changelog_stage_seconds_count{stage=\"%s\"} %" PRIu64 "\n",
            names[s], cumulative, names[s], (double)LOAD(st->cl_stage_ns[s]) / 1e9, names[s],
            cumulative);
    }
    counter(t, "tallyd_nats_changelog_flights_full_total",
            "Changelog batches that were due while all of their partition's messages in flight "
            "awaited their PubAcks (direct = replicated).",
            LOAD(st->cl_flights_full));
    seconds_counter(t, "tallyd_nats_changelog_flight_wait_seconds_total",
                    "Time those batches waited for a PubAck to free a message's place.",
                    LOAD(st->cl_flight_wait_ns));
}

size_t td_fleet_status_render(const td_fleet_status_t *st, char *out, size_t cap)
{
    text_t t = {.out = out, .cap = cap};
    if (cap)
        out[0] = '\0';
    if (!st || !st->on)
        return 0;
    put(&t,
        "# HELP tallyd_nats_partitions_owned Fleet partitions this worker owns now.\n"
        "# TYPE tallyd_nats_partitions_owned gauge\ntallyd_nats_partitions_owned %" PRIu32 "\n",
        td_fleet_status_owned(st));
    render_backlog(&t, st);
    counter(&t, "tallyd_nats_applied_total", "Fleet messages applied (dead letters included).",
            LOAD(st->applied));
    counter(&t, "tallyd_nats_dead_letters_total",
            "Fleet messages published to the dead letters (tally.dead.<k>).",
            LOAD(st->dead_letters));
    counter(&t, "tallyd_nats_checkpoints_total", "Partition checkpoints written.",
            LOAD(st->checkpoints));
    counter(&t, "tallyd_nats_checkpoint_failures_total",
            "Partition checkpoint writes that failed (NATS errors; the partition goes on).",
            LOAD(st->checkpoint_failures));
    seconds_counter(&t, "tallyd_nats_checkpoint_seconds_total",
                    "Time the fleet thread spent writing checkpoints (the partitions' snapshots "
                    "and writes; it serves no partition meanwhile).",
                    LOAD(st->checkpoint_ns));
    seconds_counter(&t, "tallyd_nats_checkpoint_drain_seconds_total",
                    "Time partitions spent draining for a checkpoint (taking nothing new until "
                    "their window was empty), summed over them.",
                    LOAD(st->checkpoint_drain_ns));
    counter(&t, "tallyd_nats_partitions_taken_total", "Partitions taken over under a lease.",
            LOAD(st->partitions_taken));
    counter(&t, "tallyd_nats_leases_lost_total",
            "Partitions dropped without a checkpoint (lease lost or fenced, consumer or "
            "changelog failed, order broken, a reply lost).",
            LOAD(st->leases_lost));
    counter(&t, "tallyd_nats_resent_total",
            "Fleet requests sent to the request path again after it had no room (busy).",
            LOAD(st->resent));
    counter(&t, "tallyd_nats_disconnects_total",
            "Times a NATS connection of this process lost its server (libnats reconnects it).",
            LOAD(st->disconnects));
    counter(&t, "tallyd_nats_gaps_total",
            "Sequence gaps met: messages gone from a partition before they were applied.",
            LOAD(st->gaps));
    put(&t,
        "# HELP tallyd_nats_refused_total Fleet messages and requests refused for naming what "
        "their publisher may not: a reply subject outside its inbox (reply), a dedupe id outside "
        "its namespace (id).\n# TYPE tallyd_nats_refused_total counter\n"
        "tallyd_nats_refused_total{reason=\"reply\"} %" PRIu64
        "\ntallyd_nats_refused_total{reason=\"id\"} %" PRIu64 "\n",
        LOAD(st->refused_reply), LOAD(st->refused_id));
    gauge(&t, "tallyd_nats_direct_uncommitted",
          "Direct writes answered since their partition's last checkpoint (under local, what "
          "losing this host loses).",
          LOAD(st->direct_uncommitted));
    counter(&t, "tallyd_nats_not_owner_total",
            "Direct requests answered not_owner: their stream's partition is another member's.",
            LOAD(st->not_owner));
    counter(&t, "tallyd_nats_changelog_commits_total",
            "Changelog messages stored (direct = replicated): each a partition's group commit.",
            LOAD(st->changelog_commits));
    counter(&t, "tallyd_nats_changelog_replayed_total",
            "Changelog messages applied at take-overs (any member, when the changelog exists).",
            LOAD(st->changelog_replayed));
    counter(&t, "tallyd_nats_not_durable_total",
            "Direct writes answered not_durable: their changelog record was not stored.",
            LOAD(st->not_durable));
    counter(&t, "tallyd_nats_changelog_lost_total",
            "Changelog messages gone at a take-over before a checkpoint held them (aged out or "
            "removed): the direct writes they held are lost (any member, at a take-over).",
            LOAD(st->changelog_lost));
    counter(&t, "tallyd_nats_changelog_purges_total",
            "Changelogs purged whole after a checkpoint that holds all of them, at a quiet point "
            "(direct = replicated).",
            LOAD(st->changelog_purges));
    render_standbys(&t, st);
    render_stages(&t, st);
    return t.len;
}
