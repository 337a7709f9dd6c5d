/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_keys.c — the membership and lease keys as they change (PROTOCOL.md §13 "Membership and
 * who owns what"): a hand-over at the next turn of the fleet thread, not at the next heartbeat.
 *
 * A key-value write is a message on $KV.<bucket>.<key>, which a plain NATS subscription receives
 * as the server stores it (a delete or purge carries the header KV-Operation). The worker
 * subscribes to TALLY_MEMBERS' and TALLY_LEASES' subjects and brings its heartbeat forward to now
 * when what it reads can change what it owns:
 *   - a member it did not know writes its key (a member joins: the partitions that now belong to
 *     it are given up at once, not up to a third of the TTL later);
 *   - a member it knew deletes its key (a member leaves at SIGTERM: its partitions are taken as
 *     soon as it has released them);
 *   - the lease of a partition the plan gives this worker, held by another, is deleted (its
 *     holder released it: taken at once).
 * Heartbeats of known members, its own writes and lease writes change nothing and are skipped.
 * A key that runs out by its TTL is no message: awaited_expiry (td_fleet.c) covers that. A user
 * not allowed to subscribe there (a users.conf from before 2026-12-03) gets the heartbeat's
 * timing, as before; the server logs the refusal.
 *
 * Fleet thread only (a synchronous subscription, read where the thread reads its queries).
 */
#include <stdlib.h>
#include <string.h>

#include "tally_nats_conn.h"
#include "td_fleet_int.h"
#include "td_log.h"
#include "td_nats_js.h"

#define MEMBERS_PREFIX "$KV." TALLY_NATS_BUCKET_MEMBERS "."
#define LEASES_PREFIX "$KV." TALLY_NATS_BUCKET_LEASES "."

td_err_t td_fleet_keys_open(td_fleet_t *f)
{
    natsStatus s = natsConnection_SubscribeSync(&f->members_sub, f->nc, MEMBERS_PREFIX ">");
    if (s == NATS_OK)
        s = natsConnection_SubscribeSync(&f->leases_sub, f->nc, LEASES_PREFIX ">");
    if (s != NATS_OK) {
        td_err("fleet: subscribing to the membership and lease keys: %s", td_nats_last_error(s));
        return TD_ERR_LIBRARY;
    }
    return TD_OK;
}

void td_fleet_keys_close(td_fleet_t *f)
{
    tally__nats_sub_close(f->nc, &f->members_sub);
    tally__nats_sub_close(f->nc, &f->leases_sub);
    td_member_list_free(f->known_members, f->known_count);
    f->known_members = NULL;
    f->known_count = 0;
}

void td_fleet_keys_known(td_fleet_t *f, char **ids, size_t n)
{
    td_member_list_free(f->known_members, f->known_count);
    f->known_members = ids;
    f->known_count = n;
}

static bool removed(natsMsg *m)
{
    const char *op = NULL;
    return natsMsgHeader_Get(m, "KV-Operation", &op) == NATS_OK && op != NULL;
}

static bool known(const td_fleet_t *f, const char *id)
{
    for (size_t i = 0; i < f->known_count; i++)
        if (strcmp(f->known_members[i], id) == 0)
            return true;
    return false;
}

/* Whether m, a write of a member's key, changes the plan. */
static bool member_changed(const td_fleet_t *f, natsMsg *m)
{
    const char *id = natsMsg_GetSubject(m) + strlen(MEMBERS_PREFIX);
    if (strcmp(id, f->member) == 0)
        return false;
    return removed(m) ? known(f, id) : !known(f, id);
}

/* Whether m, a write of a lease, frees a partition the plan gives this worker. */
static bool lease_freed(const td_fleet_t *f, natsMsg *m)
{
    const char *key = natsMsg_GetSubject(m) + strlen(LEASES_PREFIX);
    char *end = NULL;
    if (key[0] != 'p' || !removed(m))
        return false;
    unsigned long k = strtoul(key + 1, &end, 10);
    return end != key + 1 && *end == '\0' && k < f->partitions && f->parts[k].planned &&
           !f->parts[k].owned;
}

/* Reads what has arrived on sub; true when any of it passes `changes`. */
static bool drain(td_fleet_t *f, natsSubscription *sub,
                  bool (*changes)(const td_fleet_t *f, natsMsg *m))
{
    bool any = false;
    natsMsg *m = NULL;
    while (td_nats_next_queued(sub, &m)) {
        any |= changes(f, m);
        natsMsg_Destroy(m);
    }
    return any;
}

bool td_fleet_keys_step(td_fleet_t *f)
{
    bool members = drain(f, f->members_sub, member_changed);
    bool leases = drain(f, f->leases_sub, lease_freed);
    if (!members && !leases)
        return false;
    td_debug("fleet: %s changed: heartbeat now",
             members ? "the membership" : "a lease this worker waits for");
    f->next_beat_ms = td_nats_now_ms();
    return true;
}
