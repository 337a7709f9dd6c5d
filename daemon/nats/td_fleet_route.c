/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_route.c — direct mode's publishing, owner table and per-shard check
 * (td_fleet_route.h says what and why).
 *
 * Threads: open, close, beat, owned, closed and committed run on the fleet thread (open and
 * close before and after it); admit and done on the shards' threads. What both read is atomic
 * (a partition's lease end, in-flight and uncommitted counts) or under `mu` (the owner table,
 * read only to word a not_owner answer). admit counts a request in flight before it reads the
 * lease end and closed clears the lease end before it waits for that count (both sequentially
 * consistent), so a request is either refused or waited for: none slips past a give-up.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "td_auth.h"
#include "td_fleet_changelog.h"
#include "td_fleet_int.h"
#include "td_fleet_route.h"
#include "td_log.h"
#include "td_nats_js.h"
#include "td_path.h"

typedef struct {
    char member[TALLY_NATS_MEMBER_ID_MAX + 1]; /* "": no owner */
    char endpoint[TALLY_NATS_ENDPOINT_MAX];    /* "": not known */
} owner_t;

struct td_fleet_route {
    td_fleet_t *f;
    kvStore *endpoints;
    char value[2 * TALLY_NATS_ENDPOINT_MAX + TALLY_FLEET_HOST_MAX + TALLY_KEY_LEN +
               32];                                         /* published */
    _Atomic int64_t valid_until[TALLY_NATS_MAX_PARTITIONS]; /* 0: not owned */
    _Atomic uint32_t inflight[TALLY_NATS_MAX_PARTITIONS];
    _Atomic uint64_t uncommitted[TALLY_NATS_MAX_PARTITIONS];
    pthread_mutex_t mu;
    owner_t owners[TALLY_NATS_MAX_PARTITIONS];
};

static bool replicated(const td_config_t *cfg)
{
    return cfg->nats_direct && strcmp(cfg->nats_direct, "replicated") == 0;
}

td_err_t td_fleet_route_check_config(const td_config_t *cfg, bool *direct, char *msg, size_t cap)
{
    const char *v = cfg->nats_direct;
    *direct = v && (strcmp(v, "local") == 0 || replicated(cfg));
    if (!v || *direct || strcmp(v, "off") == 0)
        return TD_OK;
    snprintf(msg, cap, "[nats] direct '%s': off, local or replicated", v);
    return TD_ERR_CONFIG;
}

/* The operations that change a stream (what a checkpoint must take). */
static const bool writes[TALLY_OP_COUNT] = {[TALLY_OP_FILTER] = true,
                                            [TALLY_OP_SCAN] = true,
                                            [TALLY_OP_HIST] = true,
                                            [TALLY_OP_RESET] = true,
                                            [TALLY_OP_DELETE] = true};

/* ---- The shards' side (td_route_t) ------------------------------------------------------- */

static tally_status_t route_admit(void *ctx, const tally_req_t *req, char *msg, size_t cap)
{
    td_fleet_route_t *r = ctx;
    td_fleet_t *f = r->f;
    uint32_t k = tally_partition(req->stream, req->stream_len, f->partitions);
    atomic_fetch_add(&r->inflight[k], 1);
    if (atomic_load(&r->valid_until[k]) > td_nats_now_ms())
        return TALLY_OK;
    atomic_fetch_sub(&r->inflight[k], 1);
    TD_FLEET_COUNT(f, not_owner);
    pthread_mutex_lock(&r->mu);
    const owner_t *o = &r->owners[k];
    if (!o->member[0] || strcmp(o->member, f->member) == 0) /* ours, but not (or no more) valid */
        snprintf(msg, cap, "partition %u has no owner now", (unsigned)k);
    else if (!o->endpoint[0])
        snprintf(msg, cap, "partition %u is owned by %s", (unsigned)k, o->member);
    else
        snprintf(msg, cap, "partition %u is owned by %s at %s", (unsigned)k, o->member,
                 o->endpoint);
    pthread_mutex_unlock(&r->mu);
    return TALLY_E_NOT_OWNER;
}

static bool route_hold(void *ctx, const tally_req_t *req, td_stream_t *stream, uint64_t *ticket)
{
    td_fleet_route_t *r = ctx;
    if (!writes[req->opcode])
        return false;
    uint32_t k = tally_partition(req->stream, req->stream_len, r->f->partitions);
    return td_changelog_hold(r->f, k, req, stream, ticket);
}

static tally_status_t route_settled(void *ctx, const tally_req_t *req, uint64_t ticket,
                                    bool *pending, char *msg, size_t cap)
{
    td_fleet_route_t *r = ctx;
    uint32_t k = tally_partition(req->stream, req->stream_len, r->f->partitions);
    return td_changelog_settled(r->f, k, ticket, pending, msg, cap);
}

static bool route_last(void *ctx, const tally_req_t *req, const td_stream_t *stream,
                       uint64_t *ticket)
{
    td_fleet_route_t *r = ctx;
    uint32_t k = tally_partition(req->stream, req->stream_len, r->f->partitions);
    return td_changelog_last(r->f, k, stream, ticket);
}

static void route_done(void *ctx, const tally_req_t *req, tally_status_t status)
{
    td_fleet_route_t *r = ctx;
    uint32_t k = tally_partition(req->stream, req->stream_len, r->f->partitions);
    if (status == TALLY_OK && writes[req->opcode]) { /* a decoded opcode: below the count */
        atomic_fetch_add(&r->uncommitted[k], 1);
        TD_FLEET_COUNT(r->f, direct_uncommitted);
    }
    atomic_fetch_sub(&r->inflight[k], 1);
}

/* ---- The fleet thread's side ------------------------------------------------------------- */

static void endpoint_value(td_fleet_route_t *r, const td_config_t *cfg)
{
    const char *zmq = cfg->nats_advertise   ? cfg->nats_advertise
                      : cfg->bind_count > 0 ? cfg->binds[0]
                                            : TD_DEFAULT_ENDPOINT;
    int n = snprintf(r->value, sizeof r->value, "zmq=%.*s\n", TALLY_NATS_ENDPOINT_MAX - 1, zmq);
    /* host=: which kernel we run on, for a fleet client deciding whether it may hand us a memfd
     * (PROTOCOL.md §13); TALLYD_TEST_HOST_ID (tests only) plays a member on another host. */
    char host[TALLY_FLEET_HOST_MAX];
    const char *test_host = getenv("TALLYD_TEST_HOST_ID");
    if (test_host)
        snprintf(host, sizeof host, "%s", test_host);
    if (test_host || tally_fleet_host_id(host, sizeof host))
        n += snprintf(r->value + n, sizeof r->value - (size_t)n, "host=%s\n", host);
    if (cfg->shm) {
        char path[TALLY_NATS_ENDPOINT_MAX];
        if (cfg->shm_socket)
            snprintf(path, sizeof path, "%s", cfg->shm_socket);
        else
            td_config_default_shm_socket(path, sizeof path);
        n += snprintf(r->value + n, sizeof r->value - (size_t)n, "shm=%s\n", path);
    }
    /* curve=: the server's public key, so that a fleet client with a key pair of its own may
     * connect (and one without learns that it needs one); td_auth_check read it at the start. */
    char key[TALLY_KEY_LEN + 1], msg[256];
    if (td_auth_public_key(cfg, key, msg, sizeof msg) != TD_OK)
        td_err("fleet: no curve= in %s: %s", TALLY_NATS_BUCKET_ENDPOINTS, msg);
    else if (key[0])
        snprintf(r->value + n, sizeof r->value - (size_t)n, "curve=%s\n", key);
}

td_err_t td_fleet_route_open(td_fleet_t *f, const td_config_t *cfg)
{
    char msg[256];
    bool direct = false;
    if (td_fleet_route_check_config(cfg, &direct, msg, sizeof msg) != TD_OK || !direct)
        return TD_OK; /* refused before the start (td_fleet_check_config) */
    td_fleet_route_t *r = calloc(1, sizeof *r);
    if (!r)
        return TD_ERR_NOMEM;
    r->f = f;
    pthread_mutex_init(&r->mu, NULL);
    endpoint_value(r, cfg);
    td_err_t err = td_nats_kv_open(f->js, TALLY_NATS_BUCKET_ENDPOINTS, f->ttl_ms,
                                   (int)cfg->nats_replicas, &r->endpoints, msg, sizeof msg);
    if (err != TD_OK) {
        td_err("fleet: %s", msg);
        pthread_mutex_destroy(&r->mu);
        free(r);
        return err;
    }
    f->route = r;
    f->st->direct = true;
    td_route_t route = {.admit = route_admit, .done = route_done, .ctx = r};
    if (replicated(cfg)) {
        if ((err = td_changelog_open(f, cfg)) != TD_OK)
            return err; /* the route is freed by td_fleet_route_close */
        f->st->replicated = true;
        route.hold = route_hold;
        route.settled = route_settled;
        route.last = route_last;
    }
    td_path_attach_route(f->host.path, &route);
    return TD_OK;
}

void td_fleet_route_close(td_fleet_t *f)
{
    td_changelog_close(f);
    td_fleet_route_t *r = f->route;
    if (!r)
        return;
    (void)kvStore_Delete(r->endpoints, f->member); /* else they expire with the lease TTL */
    kvStore_Destroy(r->endpoints);
    pthread_mutex_destroy(&r->mu);
    free(r);
    f->route = NULL;
}

/* The holder of partition k and its endpoint, as NATS says now. */
static void read_owner(td_fleet_t *f, uint32_t k, owner_t *o)
{
    char msg[256];
    memset(o, 0, sizeof *o);
    if (td_lease_holder(f->leases, k, o->member, sizeof o->member, msg, sizeof msg) != TD_OK ||
        !o->member[0])
        return;
    kvEntry *e = NULL;
    if (kvStore_Get(&e, f->route->endpoints, o->member) != NATS_OK)
        return; /* a member without direct mode, or gone */
    tally_fleet_endpoint_get(kvEntry_Value(e), (size_t)kvEntry_ValueLen(e), "zmq", o->endpoint,
                             sizeof o->endpoint);
    kvEntry_Destroy(e);
}

void td_fleet_route_beat(td_fleet_t *f)
{
    td_fleet_route_t *r = f->route;
    if (!r)
        return;
    uint64_t rev = 0;
    if (kvStore_PutString(&rev, r->endpoints, f->member, r->value) != NATS_OK)
        td_warn("fleet: publishing its endpoints: %s", td_nats_last_error(NATS_ERR));
    for (uint32_t k = 0; k < f->partitions; k++) {
        td_part_t *p = &f->parts[k];
        owner_t o;
        if (p->owned) { /* renewed: valid until TTL after the renewal was sent */
            atomic_store(&r->valid_until[k], p->lease.valid_until_ms);
            memset(&o, 0, sizeof o);
            snprintf(o.member, sizeof o.member, "%s", f->member);
        } else {
            read_owner(f, k, &o);
        }
        pthread_mutex_lock(&r->mu);
        r->owners[k] = o;
        pthread_mutex_unlock(&r->mu);
    }
}

void td_fleet_route_owned(td_fleet_t *f, uint32_t k, int64_t valid_until_ms)
{
    if (f->route)
        atomic_store(&f->route->valid_until[k], valid_until_ms);
}

void td_fleet_route_closed(td_fleet_t *f, uint32_t k)
{
    td_fleet_route_t *r = f->route;
    if (!r)
        return;
    atomic_store(&r->valid_until[k], 0);
    int64_t deadline = td_nats_now_ms() + f->ttl_ms / 3;
    while (atomic_load(&r->inflight[k]) > 0 && td_nats_now_ms() < deadline)
        usleep(1000);
    if (atomic_load(&r->inflight[k]) > 0)
        td_warn("fleet: partition %u given up with %u direct requests still running", (unsigned)k,
                (unsigned)atomic_load(&r->inflight[k]));
}

uint64_t td_fleet_route_uncommitted(td_fleet_t *f, uint32_t k)
{
    return f->route ? atomic_load(&f->route->uncommitted[k]) : 0;
}

void td_fleet_route_committed(td_fleet_t *f, uint32_t k, uint64_t count)
{
    if (!f->route || !count)
        return;
    atomic_fetch_sub(&f->route->uncommitted[k], count);
    atomic_fetch_sub_explicit(&f->st->direct_uncommitted, count, memory_order_relaxed);
}

void td_fleet_route_forget(td_fleet_t *f, uint32_t k)
{
    if (f->route)
        td_fleet_route_committed(f, k, atomic_load(&f->route->uncommitted[k]));
}
