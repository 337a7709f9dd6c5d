/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_client_fleet_owners.c — who owns what, for the fleet client (tally_client_fleet.c;
 * PROTOCOL.md §13 "Direct mode"): each partition's owner from its lease in TALLY_LEASES, the
 * owner's record (zmq=, curve=, host=, shm=) in TALLY_ENDPOINTS, and one plain libtally client
 * per member met, made when first needed and never given back (at most
 * TALLY_FLEET_MEMBERS_MAX). A member whose keys do not fit this client's (CURVE one way, plain
 * the other, another server key than the one pinned) is refused, self->refused saying why; a
 * failed read of a bucket is kept in self->lookup for the "no owner" message. Not thread-safe.
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "tally_client_fleet_int.h"
#include "tally_client_int.h"
#include "tally_client_nats.h"

/* Whether this client may connect to a member that publishes key (curve=, "" none): nothing in
 * plain text, to a member with CURVE nothing without a key pair, and a pinned server key must be
 * the member's. False with self->refused saying why. */
static bool keys_fit(fleetc_t *self, const char *member, const char *endpoint, const char *key)
{
    const char *why = NULL;
    if (key[0] && !self->keys.client_secret[0])
        why = "takes CURVE connections only: give this client a key pair the member allows "
              "(tally keygen; --client-key, $TALLY_CLIENT_KEY or client_key in tally.conf)";
    else if (!key[0] && self->keys.client_secret[0])
        why = "takes plain connections, and this client, which has a CURVE key pair, sends "
              "nothing in plain text";
    else if (key[0] && self->keys.server_public[0] && strcmp(key, self->keys.server_public) != 0)
        why = "has another server key than the one given (--server-key, $TALLY_SERVER_KEY)";
    if (why)
        set_msg(self->refused, "member %s (%s, curve=%s in %s) %s", member, endpoint,
                key[0] ? key : "", TALLY_NATS_BUCKET_ENDPOINTS, why);
    return !why;
}

static int member_index(fleetc_t *self, const char *member, const char *endpoint, const char *key)
{
    self->refused[0] = '\0';
    for (int i = 0; i < self->count; i++)
        if (strcmp(self->members[i].member, member) == 0 &&
            strcmp(self->members[i].endpoint, endpoint) == 0 &&
            strcmp(self->members[i].key, key) == 0)
            return i;
    if (self->count == TALLY_FLEET_MEMBERS_MAX) { /* slots are never given back: refused */
        set_msg(self->refused,
                "member %s (%s) is past the %d members a fleet client connects to (each member, "
                "endpoint and key met since it was made counts): make a new client",
                member, endpoint, TALLY_FLEET_MEMBERS_MAX);
        return -1;
    }
    if (!keys_fit(self, member, endpoint, key))
        return -1;
    member_t *m = &self->members[self->count];
    tally_curve_keys_t keys = self->keys;
    snprintf(keys.server_public, sizeof keys.server_public, "%s", key);
    tally_status_t st = tally_client_open(endpoint, self->timeout_ms, &keys, &m->c, self->error,
                                          sizeof self->error);
    explicit_bzero(&keys, sizeof keys);
    if (st != TALLY_OK) { /* what the "no owner" message adds: the endpoint it publishes */
        set_msg(self->lookup, "member %s's endpoint in %s: %s", member, TALLY_NATS_BUCKET_ENDPOINTS,
                self->error);
        return -1;
    }
    snprintf(m->member, sizeof m->member, "%s", member);
    snprintf(m->endpoint, sizeof m->endpoint, "%s", endpoint);
    snprintf(m->key, sizeof m->key, "%s", key);
    return self->count++;
}

/* A read of bucket's key that failed with s: kept in self->lookup (a missing key is no failure:
 * a member left, a partition has no owner yet), the NATS server's refusal named when its last
 * error is a permissions violation on that bucket. */
static void lookup_failed(fleetc_t *self, natsStatus s, const char *bucket, const char *key)
{
    if (s == NATS_NOT_FOUND)
        return;
    const char *text = NULL;
    natsConnection *nc = tally__nats_conn(self->nats);
    if (natsConnection_GetLastError(nc, &text) == NATS_NOT_PERMITTED && text &&
        strstr(text, bucket))
        set_msg(self->lookup, "reading %s key %s: the NATS server refused it (%s)", bucket, key,
                text);
    else
        set_msg(self->lookup, "reading %s key %s: %s", bucket, key, natsStatus_GetText(s));
}

/* Member's record into r; false when it has none (it left, or NATS did not answer). */
bool tally__fleet_member_record(fleetc_t *self, const char *member, record_t *r)
{
    memset(r, 0, sizeof *r);
    kvEntry *e = NULL;
    if (!member[0])
        return false;
    natsStatus s = kvStore_Get(&e, self->endpoints, member);
    if (s != NATS_OK) {
        lookup_failed(self, s, TALLY_NATS_BUCKET_ENDPOINTS, member);
        return false;
    }
    const char *v = kvEntry_Value(e);
    size_t n = (size_t)kvEntry_ValueLen(e);
    tally_fleet_endpoint_get(v, n, "zmq", r->zmq, sizeof r->zmq);
    tally_fleet_endpoint_get(v, n, "curve", r->curve, sizeof r->curve);
    tally_fleet_endpoint_get(v, n, "host", r->host, sizeof r->host);
    tally_fleet_endpoint_get(v, n, "shm", r->shm, sizeof r->shm);
    kvEntry_Destroy(e);
    return true;
}

/* Partition k's owner now, as the buckets say: its member index, or -1 (none with direct mode
 * yet, or NATS did not answer). */
int tally__fleet_owner_now(fleetc_t *self, uint32_t k)
{
    char key[16], member[TALLY_NATS_MEMBER_ID_MAX + 1];
    self->refused[0] = self->lookup[0] = '\0';
    tally_fleet_name(key, sizeof key, "p", k);
    kvEntry *e = NULL;
    natsStatus s = kvStore_Get(&e, self->leases, key);
    if (s != NATS_OK) {
        lookup_failed(self, s, TALLY_NATS_BUCKET_LEASES, key);
        return -1;
    }
    snprintf(member, sizeof member, "%.*s", kvEntry_ValueLen(e), kvEntry_ValueString(e));
    kvEntry_Destroy(e);
    record_t r;
    return tally__fleet_member_record(self, member, &r) && r.zmq[0]
               ? member_index(self, member, r.zmq, r.curve)
               : -1;
}

/* Partition k has no owner this client can reach, into self->error: with the last NATS failure
 * when a read failed (not only found nothing). */
static void say_no_owner(fleetc_t *self, uint32_t k)
{
    set_msg(self->error,
            "partition %u has no owner in direct mode (TALLY_LEASES, TALLY_ENDPOINTS) within %d "
            "ms%s%s",
            (unsigned)k, self->timeout_ms, self->lookup[0] ? "; " : "", self->lookup);
}

/* Waits for partition k's owner until deadline (us). */
int tally__fleet_owner_until(fleetc_t *self, uint32_t k, int64_t deadline)
{
    int m;
    while ((m = tally__fleet_owner_now(self, k)) < 0 && !self->refused[0] && now_us() < deadline)
        usleep(TALLY_FLEET_POLL_MS * 1000);
    if (m < 0 && self->refused[0])
        snprintf(self->error, sizeof self->error, "%s", self->refused);
    else if (m < 0)
        say_no_owner(self, k);
    return m;
}

/* At most TALLY_FLEET_SUSPECT_MS (and the timeout) for a member's connection to come up. */
int tally__fleet_probe_ms(const fleetc_t *self)
{
    return self->timeout_ms < TALLY_FLEET_SUSPECT_MS ? self->timeout_ms : TALLY_FLEET_SUSPECT_MS;
}

/* When a wait for member o's connection gives up: a probe from now, or now when it is known
 * down. */
int64_t tally__fleet_probe_deadline(const fleetc_t *self, const member_t *o)
{
    return now_us() + (o->down ? 0 : (int64_t)tally__fleet_probe_ms(self) * 1000);
}

/* Partition k's owner for a call made now: the one known, unless its connection does not come
 * up within a probe (it exited): then the one the routing names next, waited for until
 * deadline (us); -1 when none is up by then (self->error says why). */
int tally__fleet_owner_up(fleetc_t *self, uint32_t k, int64_t deadline)
{
    for (;;) {
        int m = self->owner[k] >= 0 ? self->owner[k] : tally__fleet_owner_now(self, k);
        if (m >= 0) {
            member_t *o = &self->members[m];
            int64_t probe = tally__fleet_probe_deadline(self, o);
            tally_status_t st = tally__wait_connected(o->c, probe < deadline ? probe : deadline);
            o->down = st == TALLY_E_TIMEOUT;
            if (!o->down) /* up, or refused: the call says so */
                return self->owner[k] = m;
            self->owner[k] = -1;
            snprintf(self->error, sizeof self->error, "%s", tally_client_error(o->c));
        } else if (self->refused[0]) {
            snprintf(self->error, sizeof self->error, "%s", self->refused);
            return -1;
        } else {
            say_no_owner(self, k);
        }
        if (now_us() >= deadline)
            return -1;
        usleep(TALLY_FLEET_POLL_MS * 1000);
    }
}

/* A not_owner answer's "partition K is owned by M at ENDPOINT": M's member index, or -1. */
int tally__fleet_named_owner(fleetc_t *self, const char *why)
{
    const char *by = strstr(why, " owned by "), *at = strstr(why, " at ");
    if (!by || !at || at < by)
        return -1;
    char member[TALLY_NATS_MEMBER_ID_MAX + 1];
    by += strlen(" owned by ");
    snprintf(member, sizeof member, "%.*s", (int)(at - by), by);
    record_t r;
    tally__fleet_member_record(self, member,
                               &r); /* none (it left): refused with keys, plain without */
    return member_index(self, member, at + strlen(" at "), r.curve);
}
