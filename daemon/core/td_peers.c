/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_peers.c — the per-peer table (see td_peers.h): a chained hash table (FNV-1a over the kind
 * and id bytes) of fixed width, since it holds one entry per live connection and client, and
 * every entry is looked up once per request.
 */
#include <pthread.h>
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
    _Atomic unsigned refs;       /* requests and streams pointing here */
    unsigned inflight;           /* connection: requests read and not yet answered */
    _Atomic unsigned streams;    /* client: streams it created that still exist */
    _Atomic size_t state_bytes;  /* client: the bytes of those streams (td_stream.h) */
    double tokens;               /* client, under the table's token lock: creations it may make */
    uint64_t tokens_ns;          /* when tokens was last brought up to date */
    uint64_t requests;           /* user: requests read */
    _Atomic uint64_t limited;    /* user: requests refused by a per-peer limit */
    _Atomic uint64_t reserved;   /* connection: reply bytes reserved for requests in flight */
    td_reply_meter_t *meter;     /* connection: reply bytes inside ZeroMQ (td_peers.h) */
    struct td_peer *hash_next;
    struct td_sched_flow *flows[]; /* connection: the shards' scheduler queues */
};

struct td_peers {
    td_peer_t *buckets[TD_PEERS_BUCKETS];
    unsigned count;
    unsigned shards;
    pthread_mutex_t token_lock; /* the entries' buckets and the rate */
    double rate;                /* stream creations per second; 0 = unlimited */
};

static void entry_free(td_peer_t *p)
{
    if (p->meter)
        td_reply_meter_release(p->meter);
    free(p);
}

td_err_t td_peers_new_shards(unsigned shards, td_peers_t **out)
{
    td_peers_t *self = calloc(1, sizeof *self);
    if (!self)
        return TD_ERR_NOMEM;
    self->shards = shards ? shards : 1;
    self->token_lock = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER; /* cannot fail, unlike _init */
    *out = self;
    return TD_OK;
}

td_err_t td_peers_new(td_peers_t **out)
{
    return td_peers_new_shards(1, out);
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
    pthread_mutex_destroy(&self->token_lock);
    free(self);
    *self_p = NULL;
}

/* One second's worth of creations, at least one. Token lock held. */
static double burst(const td_peers_t *self)
{
    return self->rate < 1 ? 1 : self->rate;
}

void td_peers_set_rate(td_peers_t *self, unsigned per_second)
{
    pthread_mutex_lock(&self->token_lock);
    self->rate = per_second;
    pthread_mutex_unlock(&self->token_lock);
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
        p = calloc(1, sizeof *p + (size_t)self->shards * TD_PEER_FLOWS * sizeof p->flows[0]);
        if (!p)
            return NULL;
        p->meter = calloc(1, sizeof *p->meter);
        if (p->meter)
            atomic_init(&p->meter->refs, 1);
        memcpy(p->key, key, key_len);
        p->key_len = key_len;
        set_name(p, kind, id, len);
        pthread_mutex_lock(&self->token_lock);
        p->tokens = burst(self);
        pthread_mutex_unlock(&self->token_lock);
        p->tokens_ns = now_ns;
        p->hash_next = self->buckets[b];
        self->buckets[b] = p;
        self->count++;
    }
    atomic_fetch_add_explicit(&p->refs, 1, memory_order_relaxed);
    return p;
}

/* Release order: the sweep that finds the entry unreferenced sees what its last holder did. */
void td_peers_release(td_peers_t *self, td_peer_t **peer_p)
{
    (void)self;
    td_peer_t *p = *peer_p;
    if (p)
        atomic_fetch_sub_explicit(&p->refs, 1, memory_order_release);
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
    bool taken = true;
    pthread_mutex_lock(&self->token_lock);
    if (self->rate > 0) {
        refill(self, client, now_ns);
        taken = client->tokens >= 1;
        if (taken)
            client->tokens -= 1;
    }
    pthread_mutex_unlock(&self->token_lock);
    return taken;
}

void td_peer_give_token(td_peers_t *self, td_peer_t *client)
{
    pthread_mutex_lock(&self->token_lock);
    if (self->rate > 0) {
        client->tokens += 1;
        if (client->tokens > burst(self))
            client->tokens = burst(self);
    }
    pthread_mutex_unlock(&self->token_lock);
}

/* An entry nothing refers to whose bucket is full: the sweep may free it. */
static bool sweepable(td_peers_t *self, td_peer_t *p, uint64_t now_ns)
{
    /* A connection whose replies still sit in ZeroMQ keeps its entry, or its next request would
     * find a fresh meter and the bound on its unread replies would not hold. */
    bool idle = atomic_load_explicit(&p->refs, memory_order_acquire) == 0 &&
                p->key[0] != TD_PEER_USER && (!p->meter || atomic_load(&p->meter->held) == 0);
    pthread_mutex_lock(&self->token_lock);
    refill(self, p, now_ns);
    bool full = self->rate <= 0 || p->tokens >= burst(self);
    pthread_mutex_unlock(&self->token_lock);
    return idle && full;
}

void td_peers_sweep(td_peers_t *self, uint64_t now_ns)
{
    for (unsigned b = 0; b < TD_PEERS_BUCKETS; b++) {
        td_peer_t **link = &self->buckets[b];
        while (*link) {
            td_peer_t *p = *link;
            if (sweepable(self, p, now_ns)) {
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
    return atomic_load_explicit(&((td_peer_t *)peer)->refs, memory_order_relaxed);
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
    return atomic_load_explicit(&((td_peer_t *)client)->streams, memory_order_relaxed);
}

bool td_peer_take_stream(td_peer_t *client, unsigned max, unsigned *held)
{
    unsigned n = atomic_load_explicit(&client->streams, memory_order_relaxed);
    do {
        *held = n;
        if (n >= max)
            return false;
    } while (!atomic_compare_exchange_weak_explicit(&client->streams, &n, n + 1,
                                                    memory_order_relaxed, memory_order_relaxed));
    return true;
}

void td_peer_give_stream(td_peer_t *client)
{
    atomic_fetch_sub_explicit(&client->streams, 1, memory_order_relaxed);
}

void td_peer_hold(td_peer_t *peer)
{
    atomic_fetch_add_explicit(&peer->refs, 1, memory_order_relaxed);
}

size_t td_peer_state_bytes(const td_peer_t *client)
{
    return atomic_load_explicit(&((td_peer_t *)client)->state_bytes, memory_order_relaxed);
}

bool td_peer_state_bytes_charge(td_peer_t *client, size_t growth, size_t max, size_t *held)
{
    *held = atomic_fetch_add_explicit(&client->state_bytes, growth, memory_order_relaxed);
    if (!max || *held + growth <= max)
        return true;
    atomic_fetch_sub_explicit(&client->state_bytes, growth, memory_order_relaxed);
    return false;
}

void td_peer_state_bytes_change(td_peer_t *client, size_t before, size_t after)
{
    if (after != before) /* a wrapping difference: the atomic's arithmetic is modular */
        atomic_fetch_add_explicit(&client->state_bytes, after - before, memory_order_relaxed);
}

void td_peer_count_request(td_peer_t *user)
{
    user->requests++;
}

void td_peer_count_limited(td_peer_t *user)
{
    atomic_fetch_add_explicit(&user->limited, 1, memory_order_relaxed);
}

uint64_t td_peer_requests(const td_peer_t *user)
{
    return user->requests;
}

uint64_t td_peer_limited(const td_peer_t *user)
{
    return atomic_load_explicit(&((td_peer_t *)user)->limited, memory_order_relaxed);
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
    return atomic_load_explicit(&((td_peer_t *)conn)->reserved, memory_order_relaxed);
}

uint64_t td_peer_reserve(td_peer_t *conn, uint64_t bytes)
{
    return atomic_fetch_add_explicit(&conn->reserved, bytes, memory_order_relaxed);
}

void td_peer_unreserve(td_peer_t *conn, uint64_t bytes)
{
    atomic_fetch_sub_explicit(&conn->reserved, bytes, memory_order_relaxed);
}

struct td_sched_flow *td_peer_flow(const td_peer_t *conn, unsigned slot)
{
    return conn->flows[slot];
}

void td_peer_set_flow(td_peer_t *conn, unsigned slot, struct td_sched_flow *flow)
{
    conn->flows[slot] = flow;
}
