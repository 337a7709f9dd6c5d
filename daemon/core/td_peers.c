/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_peers.c — the per-peer table (see td_peers.h): a chained hash table (FNV-1a over the kind
 * and id bytes) of fixed width, since it holds one entry per live connection and client, and
 * every entry is looked up once per request.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_hash.h"
#include "td_peers.h"

#define TD_PEERS_BUCKETS 1024u /* a power of two */

struct td_peer {
    uint8_t key[1 + TD_PEER_KEY_MAX]; /* the kind, then the routing id or user id */
    size_t key_len;
    char name[TD_PEER_NAME_MAX]; /* the user id, or the routing id in hex */
    unsigned refs;               /* requests and streams pointing here */
    unsigned inflight;           /* connection: requests read and not yet answered */
    unsigned streams;            /* client: streams it created that still exist */
    size_t state_bytes;          /* client: the bytes of those streams (td_stream.h) */
    double tokens;               /* client: stream creations it may make now */
    uint64_t tokens_ns;          /* when tokens was last brought up to date */
    uint64_t requests;           /* user: requests read */
    uint64_t limited;            /* user: requests refused by a per-peer limit */
    uint64_t reserved;           /* connection: reply bytes reserved for requests in flight */
    td_reply_meter_t *meter;     /* connection: reply bytes inside ZeroMQ (td_peers.h) */
    struct td_sched_flow *flows[TD_PEER_FLOWS]; /* connection: the scheduler's queues */
    struct td_peer *hash_next;
};

struct td_peers {
    td_peer_t *buckets[TD_PEERS_BUCKETS];
    unsigned count;
    double rate; /* stream creations per second; 0 = unlimited */
};

static void entry_free(td_peer_t *p)
{
    if (p->meter)
        td_reply_meter_release(p->meter);
    free(p);
}

td_err_t td_peers_new(td_peers_t **out)
{
    td_peers_t *self = calloc(1, sizeof *self);
    if (!self)
        return TD_ERR_NOMEM;
    *out = self;
    return TD_OK;
}

void td_peers_destroy(td_peers_t **self_p)
{
    td_peers_t *self = *self_p;
    if (!self)
        return;
    for (unsigned b = 0; b < TD_PEERS_BUCKETS; b++) {
        td_peer_t *p = self->buckets[b];
        while (p) {
            td_peer_t *next = p->hash_next;
            entry_free(p);
            p = next;
        }
    }
    free(self);
    *self_p = NULL;
}

/* One second's worth of creations, at least one. */
static double burst(const td_peers_t *self)
{
    return self->rate < 1 ? 1 : self->rate;
}

void td_peers_set_rate(td_peers_t *self, unsigned per_second)
{
    self->rate = per_second;
}

/* The printable name: a user id as it is (it came from our own key list), a routing id in hex
 * (ZeroMQ's generated ids are binary). */
static void set_name(td_peer_t *p, td_peer_kind_t kind, const uint8_t *id, size_t len)
{
    if (kind == TD_PEER_USER) {
        snprintf(p->name, sizeof p->name, "%.*s", (int)len, (const char *)id);
        return;
    }
    size_t at = 0;
    for (size_t i = 0; i < len && at + 3 <= sizeof p->name; i++)
        at += (size_t)snprintf(p->name + at, sizeof p->name - at, "%02x", id[i]);
}

td_peer_t *td_peers_acquire(td_peers_t *self, td_peer_kind_t kind, const void *id, size_t len,
                            uint64_t now_ns)
{
    uint8_t key[1 + TD_PEER_KEY_MAX];
    if (len > TD_PEER_KEY_MAX)
        len = TD_PEER_KEY_MAX;
    key[0] = (uint8_t)kind;
    memcpy(key + 1, id, len);
    size_t key_len = len + 1;
    unsigned b = (unsigned)(td_fnv1a64(key, key_len) & (TD_PEERS_BUCKETS - 1));
    td_peer_t *p = self->buckets[b];
    while (p && (p->key_len != key_len || memcmp(p->key, key, key_len) != 0))
        p = p->hash_next;
    if (!p) {
        p = calloc(1, sizeof *p);
        if (!p)
            return NULL;
        p->meter = calloc(1, sizeof *p->meter);
        if (p->meter)
            atomic_init(&p->meter->refs, 1);
        memcpy(p->key, key, key_len);
        p->key_len = key_len;
        set_name(p, kind, id, len);
        p->tokens = burst(self);
        p->tokens_ns = now_ns;
        p->hash_next = self->buckets[b];
        self->buckets[b] = p;
        self->count++;
    }
    p->refs++;
    return p;
}

void td_peers_release(td_peers_t *self, td_peer_t **peer_p)
{
    (void)self;
    td_peer_t *p = *peer_p;
    if (p && p->refs > 0)
        p->refs--;
    *peer_p = NULL;
}

/* Brings the bucket up to now: tokens accrue at `rate` per second up to the burst. */
static void refill(const td_peers_t *self, td_peer_t *p, uint64_t now_ns)
{
    double cap = burst(self);
    if (now_ns > p->tokens_ns)
        p->tokens += self->rate * (double)(now_ns - p->tokens_ns) / 1e9;
    p->tokens_ns = now_ns;
    if (p->tokens > cap)
        p->tokens = cap;
}

bool td_peer_take_token(td_peers_t *self, td_peer_t *client, uint64_t now_ns)
{
    if (self->rate <= 0)
        return true;
    refill(self, client, now_ns);
    if (client->tokens < 1)
        return false;
    client->tokens -= 1;
    return true;
}

void td_peer_give_token(td_peers_t *self, td_peer_t *client)
{
    if (self->rate <= 0)
        return;
    client->tokens += 1;
    if (client->tokens > burst(self))
        client->tokens = burst(self);
}

void td_peers_sweep(td_peers_t *self, uint64_t now_ns)
{
    for (unsigned b = 0; b < TD_PEERS_BUCKETS; b++) {
        td_peer_t **link = &self->buckets[b];
        while (*link) {
            td_peer_t *p = *link;
            refill(self, p, now_ns);
            /* A connection whose replies still sit in ZeroMQ keeps its entry, or its next
             * request would find a fresh meter and the bound on its unread replies would not
             * hold. */
            bool idle = p->refs == 0 && p->key[0] != TD_PEER_USER &&
                        (!p->meter || atomic_load(&p->meter->held) == 0);
            if (idle && (self->rate <= 0 || p->tokens >= burst(self))) {
                *link = p->hash_next;
                entry_free(p);
                self->count--;
                continue;
            }
            link = &p->hash_next;
        }
    }
}

unsigned td_peers_count(const td_peers_t *self)
{
    return self->count;
}

void td_peers_each_user(const td_peers_t *self, td_peer_visit_fn visit, void *ctx)
{
    for (unsigned b = 0; b < TD_PEERS_BUCKETS; b++)
        for (const td_peer_t *p = self->buckets[b]; p; p = p->hash_next)
            if (p->key[0] == TD_PEER_USER)
                visit(ctx, p);
}

const char *td_peer_name(const td_peer_t *peer)
{
    return peer->name;
}

unsigned td_peer_refs(const td_peer_t *peer)
{
    return peer->refs;
}

bool td_peer_inflight_begin(td_peer_t *conn)
{
    return conn->inflight++ == 0;
}

bool td_peer_inflight_end(td_peer_t *conn)
{
    return --conn->inflight == 0;
}

unsigned td_peer_inflight(const td_peer_t *conn)
{
    return conn->inflight;
}

unsigned td_peer_streams(const td_peer_t *client)
{
    return client->streams;
}

size_t td_peer_state_bytes(const td_peer_t *client)
{
    return client->state_bytes;
}

void td_peer_state_bytes_change(td_peer_t *client, size_t before, size_t after)
{
    client->state_bytes = client->state_bytes - before + after;
}

void td_peer_stream_added(td_peer_t *client)
{
    client->refs++; /* the stream's reference */
    client->streams++;
}

void td_peer_stream_removed(td_peer_t *client)
{
    client->streams--;
}

void td_peer_count_request(td_peer_t *user)
{
    user->requests++;
}

void td_peer_count_limited(td_peer_t *user)
{
    user->limited++;
}

uint64_t td_peer_requests(const td_peer_t *user)
{
    return user->requests;
}

uint64_t td_peer_limited(const td_peer_t *user)
{
    return user->limited;
}

td_reply_meter_t *td_peer_meter(td_peer_t *conn)
{
    return conn->meter;
}

void td_reply_meter_hold(td_reply_meter_t *meter)
{
    atomic_fetch_add_explicit(&meter->refs, 1, memory_order_relaxed);
}

void td_reply_meter_release(td_reply_meter_t *meter)
{
    /* acq_rel: the thread that frees it sees every other thread's last update */
    if (atomic_fetch_sub_explicit(&meter->refs, 1, memory_order_acq_rel) == 1)
        free(meter);
}

uint64_t td_peer_reserved(const td_peer_t *conn)
{
    return conn->reserved;
}

void td_peer_reserve(td_peer_t *conn, uint64_t bytes)
{
    conn->reserved += bytes;
}

void td_peer_unreserve(td_peer_t *conn, uint64_t bytes)
{
    conn->reserved -= bytes;
}

struct td_sched_flow *td_peer_flow(const td_peer_t *conn, unsigned cls)
{
    return conn->flows[cls];
}

void td_peer_set_flow(td_peer_t *conn, unsigned cls, struct td_sched_flow *flow)
{
    conn->flows[cls] = flow;
}
