/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet.c — the fleet worker's life (td_fleet.h): the settings, connecting and making the
 * fleet's objects, the thread's loop, and the heartbeat that keeps membership, leases and the
 * plan (which partitions this worker should own) up to date.
 *
 * The thread's loop, every turn: the heartbeat when it is due (every third of the lease TTL, or
 * sooner when a key it waits for runs out: another member's heartbeat, a lease it should take;
 * or at once when a member joins or leaves or such a lease is released: td_fleet_keys.c;
 * membership, lease renewals, the plan: partitions to take and to give up, for at most a third
 * of the TTL, so that a cluster slow enough to make taking every partition last longer than a
 * lease never lets the first ones taken run out meanwhile; the rest wait for the next
 * heartbeat, which renews the leases first), the renewal of every lease a second old (tried
 * again shortly when the bucket does not answer: td_fleet_int.h), then one step of
 * each owned partition (td_fleet_window.c), the queries that arrived (td_fleet_query.c), and the
 * replies from the request path (waiting a few milliseconds there when nothing else happened).
 * Every partition waits for a turn, so one that took TD_FLEET_SLOW_TURN_MS or more is logged
 * (notice) part by part, and a heartbeat that long by its own parts: a cluster slow to answer, a
 * long take, a checkpoint, or the process stopped (SIGSTOP, a paused VM) shows where it went.
 * At a stop signal it gives every partition up (checkpointed, released), leaves the membership,
 * and closes its handles on the loop so that the server's loop can end.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tally_nats_conn.h"
#include "td_fleet_int.h"
#include "td_fleet_plan.h"
#include "td_fleet_route.h"
#include "td_log.h"
#include "td_nats_js.h"
#include "td_stream.h"

/* Servers lost by this process's NATS connections (link_down, below), for
 * tallyd_nats_disconnects_total: static, since libnats may call link_down after a fleet is gone. */
static _Atomic uint64_t links_dropped;

/* ---- Settings ---------------------------------------------------------------------------- */

static tally_nats_conf_t nats_conf(const td_config_t *cfg, const char *name)
{
    return (tally_nats_conf_t){.servers = cfg->nats_servers,
                               .credentials = cfg->nats_credentials,
                               .nkey = cfg->nats_nkey,
                               .nkey_seed = cfg->nats_nkey_seed,
                               .tls_ca = cfg->nats_tls_ca,
                               .tls_cert = cfg->nats_tls_cert,
                               .tls_key = cfg->nats_tls_key,
                               .user = cfg->nats_user,
                               .name = name,
                               .send_asap = true};
}

td_err_t td_fleet_check_config(const td_config_t *cfg, char *msg, size_t cap)
{
    if (!cfg->nats_servers)
        return TD_OK;
    if (cfg->nats_member_id && !tally_fleet_member_id_valid(cfg->nats_member_id)) {
        snprintf(msg, cap, "[nats] member_id '%s': 1..64 characters of A-Z a-z 0-9 - _",
                 cfg->nats_member_id);
        return TD_ERR_CONFIG;
    }
    if (cfg->nats_members_per_process > 1 && cfg->nats_member_id &&
        strlen(cfg->nats_member_id) > TD_FLEET_BASE_ID_MAX) {
        snprintf(msg, cap,
                 "[nats] member_id '%s': at most %d characters with members_per_process %u (the "
                 "members are named MEMBER_ID-0 .. MEMBER_ID-%u)",
                 cfg->nats_member_id, TD_FLEET_BASE_ID_MAX, cfg->nats_members_per_process,
                 cfg->nats_members_per_process - 1);
        return TD_ERR_CONFIG;
    }
    tally_nats_conf_t conf = nats_conf(cfg, NULL);
    char user[TALLY_NATS_MEMBER_ID_MAX + 1], shown[512];
    bool direct = false;
    if (tally__nats_user(&conf, user, sizeof user, msg, cap) != TALLY_OK ||
        td_fleet_route_check_config(cfg, &direct, msg, cap) != TD_OK)
        return TD_ERR_CONFIG;
    if (direct && cfg->nats_members_per_process > 1) { /* one route per request path */
        snprintf(msg, cap,
                 "[nats] members_per_process %u: direct mode runs one member a process (set "
                 "members_per_process = 1, or direct = off)",
                 cfg->nats_members_per_process);
        return TD_ERR_CONFIG;
    }
    if (tally__nats_servers_local(cfg->nats_servers) || tally__nats_has_credentials(&conf))
        return TD_OK;
    tally_fleet_redact(cfg->nats_servers, shown, sizeof shown);
    if (cfg->protected_mode) {
        snprintf(msg, cap,
                 "protected mode: [nats] servers '%s' are not on the loopback and no NATS "
                 "credentials are set (credentials, nkey, or a user in the URL); set them, or "
                 "protected_mode = off on a trusted network",
                 shown);
        return TD_ERR_CONFIG;
    }
    td_warn("protected_mode is off: NATS servers %s without credentials", shown);
    return TD_OK;
}

/* ---- Loop-thread side -------------------------------------------------------------------- */

static void on_async(uv_async_t *h)
{
    td_fleet_t *f = h->data;
    td_fleet_path_on_loop(f); /* requests the thread queued */
    pthread_mutex_lock(&f->mu);
    td_fleet_job_t *job = f->job;
    f->job = NULL;
    pthread_mutex_unlock(&f->mu);
    if (!job)
        return;
    if (job->hold) /* the job reads or changes the table: shards stopped */
        td_streams_hold(f->host.streams);
    job->fn(f, job->arg);
    if (job->hold)
        td_streams_release(f->host.streams);
    pthread_mutex_lock(&f->mu);
    job->done = true;
    pthread_cond_broadcast(&f->cond);
    pthread_mutex_unlock(&f->mu);
}

static void on_signal(uv_signal_t *h, int signum)
{
    (void)signum;
    td_fleet_t *f = h->data;
    atomic_store(&f->stopping, true);
}

/* The thread's last job: the loop may end once these handles are closed. */
static void close_loop_handles(td_fleet_t *f, void *arg)
{
    (void)arg;
    uv_close((uv_handle_t *)&f->sig_term, NULL);
    uv_close((uv_handle_t *)&f->sig_int, NULL);
    f->loop_closed = true;
}

/* ---- Heartbeat ----------------------------------------------------------------------------- */

/* Renews every lease TD_FLEET_RENEW_AGE_MS old or more (td_fleet_int.h). After a renewal
 * that failed (no answer within TD_FLEET_KV_WAIT_MS: the bucket electing a leader, a server
 * lost) the rest wait TD_FLEET_RENEW_RETRY_MS, so the partitions keep applying between tries;
 * each try is one more chance before the TTL runs out by this worker's own clock. */
static void renew_leases(td_fleet_t *f)
{
    char msg[256];
    int64_t now = td_nats_now_ms();
    if (now < f->next_renew_ms)
        return;
    for (uint32_t k = 0; k < f->partitions; k++) {
        td_part_t *p = &f->parts[k];
        if (!p->owned || now - (p->lease.valid_until_ms - f->ttl_ms) < TD_FLEET_RENEW_AGE_MS)
            continue;
        bool lost = false;
        if (td_lease_renew(f->leases, k, f->member, f->ttl_ms, &p->lease, &lost, msg, sizeof msg) !=
            TD_OK) {
            td_warn("fleet: %s; tried again in %d ms", msg, TD_FLEET_RENEW_RETRY_MS);
            f->next_renew_ms = td_nats_now_ms() + TD_FLEET_RENEW_RETRY_MS;
            return; /* it may still be ours: its own clock decides */
        }
        if (lost)
            td_part_drop(f, p, "its lease was lost");
        else /* direct mode: requests run here until the new end */
            td_fleet_route_owned(f, k, p->lease.valid_until_ms);
        now = td_nats_now_ms();
    }
}

/* The soonest of *soonest and when the key of kv runs out (an absent key, or one NATS will not
 * read: nothing); that time, or 0. */
static int64_t note_expiry(td_fleet_t *f, kvStore *kv, const char *key, int64_t *soonest)
{
    int64_t at = 0;
    if (td_kv_expiry(kv, key, f->ttl_ms, &at) != TD_OK)
        return 0;
    if (at && (!*soonest || at < *soonest))
        *soonest = at;
    return at;
}

/* When a key this worker waits for runs out (0: none): another member's heartbeat (the plan
 * changes when it goes) and the lease of each partition the plan gives this worker that another
 * still holds (issue 32: a worker killed without a word is taken over when its keys expire, not
 * at the heartbeat after). */
static int64_t awaited_expiry(td_fleet_t *f, char *const *ids, size_t n, const bool *mine)
{
    int64_t soonest = 0;
    char key[16];
    for (size_t i = 0; i < n; i++)
        if (strcmp(ids[i], f->member) != 0)
            note_expiry(f, f->members, ids[i], &soonest);
    for (uint32_t k = 0; k < f->partitions; k++) {
        f->parts[k].lease_expiry_ms = 0;
        if (!mine[k] || f->parts[k].owned)
            continue;
        td_lease_key(key, sizeof key, k);
        /* the take's log says how long after this it came */
        f->parts[k].lease_expiry_ms = note_expiry(f, f->leases, key, &soonest);
    }
    return soonest;
}

/* Takes what the plan gives this worker and is free; gives up what belongs to another member;
 * until `until` (monotonic ms; one at least), then the rest at the next heartbeat. The next
 * heartbeat is brought forward to when a key it waits for runs out (awaited_expiry). */
static void follow_plan(td_fleet_t *f, int64_t until)
{
    char msg[256];
    char **ids = NULL;
    size_t n = 0;
    if (td_member_list(f->members, &ids, &n, msg, sizeof msg) != TD_OK) {
        td_warn("fleet: %s; the plan is followed again in %d ms", msg, TD_FLEET_RENEW_RETRY_MS);
        f->expiry_beat_ms = td_nats_now_ms() + TD_FLEET_RENEW_RETRY_MS; /* not a third of the TTL */
        return;
    }
    bool *mine = calloc(f->partitions, sizeof *mine);
    if (!mine) {
        td_member_list_free(ids, n);
        return;
    }
    td_fleet_plan((const char *const *)ids, n, f->member, f->partitions, mine);
    if (f->standbys) { /* the copies, before the takes that may use them */
        bool *next = calloc(f->partitions, sizeof *next);
        if (next) {
            td_fleet_plan_next((const char *const *)ids, n, f->member, f->partitions, next);
            td_standby_plan(f, next, mine);
        }
        free(next);
    }
    f->live_members = n; /* what `streams` answers say, so that analysts need no KV rights */
    int64_t now = td_nats_now_ms();
    bool acted = false; /* one take or give-up at least, however long the renewals took */
    for (uint32_t k = 0; k < f->partitions; k++)
        f->parts[k].planned = mine[k];
    for (uint32_t k = 0; k < f->partitions && !atomic_load(&f->stopping); k++) {
        td_part_t *p = &f->parts[k];
        bool take = mine[k] && !p->owned && now >= p->no_take_until_ms;
        bool give_up = !mine[k] && p->owned;
        if ((take || give_up) && acted && now >= until)
            break;
        if (take)
            td_part_take(f, p);
        else if (give_up)
            td_part_give_up(f, p);
        acted |= take || give_up;
        now = td_nats_now_ms();
    }
    int64_t expiry = atomic_load(&f->stopping) ? 0 : awaited_expiry(f, ids, n, mine);
    if (expiry) { /* a key's expiry is its stream's, a little after its time: looked for again */
        int64_t at = expiry + TD_FLEET_EXPIRY_MARGIN_MS, soonest = now + TD_FLEET_EXPIRY_RETRY_MS;
        f->expiry_beat_ms = at > soonest ? at : soonest;
    }
    free(mine);
    td_fleet_keys_known(f, ids, n);
}

/* The time since *at (ms), and *at moved to now: one part of a turn timed. */
static int64_t lap(int64_t *at)
{
    int64_t now = td_nats_now_ms(), took = now - *at;
    *at = now;
    return took;
}

/* A heartbeat; its own parts said when it held the fleet thread TD_FLEET_SLOW_TURN_MS or more. */
static void heartbeat(td_fleet_t *f)
{
    char msg[256], info[128];
    int64_t began = td_nats_now_ms(), at = began, beat, renewals, route, plan;
    snprintf(info, sizeof info, "pid=%d", (int)getpid());
    if (td_member_beat(f->members, f->member, info, msg, sizeof msg) != TD_OK)
        td_warn("fleet: %s", msg);
    beat = lap(&at);
    renew_leases(f);
    renewals = lap(&at);
    td_fleet_route_beat(f); /* direct mode: endpoints, lease ends, owners */
    route = lap(&at);
    f->expiry_beat_ms = 0;
    follow_plan(f, began + f->ttl_ms / 3);
    plan = lap(&at);
    f->next_beat_ms = began + f->ttl_ms / 3; /* a heartbeat that ran long: the next one now */
    if (f->expiry_beat_ms && f->expiry_beat_ms < f->next_beat_ms)
        f->next_beat_ms = f->expiry_beat_ms;
    if (at - began >= TD_FLEET_SLOW_TURN_MS)
        td_notice("fleet: a heartbeat took %" PRId64 " ms: membership %" PRId64
                  " ms, lease renewals %" PRId64 " ms, endpoints %" PRId64
                  " ms, the plan (takes and give-ups) %" PRId64 " ms",
                  at - began, beat, renewals, route, plan);
}

/* ---- The thread ---------------------------------------------------------------------------- */

static void leave(td_fleet_t *f)
{
    f->drop_until_ms = 0; /* the give-ups' own third of the TTL */
    for (uint32_t k = 0; k < f->partitions; k++)
        if (f->parts[k].owned)
            td_part_give_up(f, &f->parts[k]);
    td_fleet_query_finish(f, TD_FLEET_QUERY_FINISH_MS);
    natsConnection_FlushTimeout(f->reply_nc, 2000); /* the last replies and acknowledgements */
    char msg[256];
    if (td_member_leave(f->members, f->member, msg, sizeof msg) != TD_OK)
        td_warn("fleet: %s", msg);
    td_notice("fleet: %s left (%" PRIu64 " messages applied, %" PRIu64 " dead letters, %" PRIu64
              " checkpoints, %" PRIu64 " gaps)",
              f->member, atomic_load(&f->st->applied), atomic_load(&f->st->dead_letters),
              atomic_load(&f->st->checkpoints), atomic_load(&f->st->gaps));
}

/* After leave: a partition given up once its quiesce ran out may still have messages in the
 * request path (a long GPU launch). With a port, only this thread takes their replies and so
 * lowers the port's count, which the server's stop waits for (td_path_inflight): it takes them
 * (dropped: their partitions are gone) until none is left, as the stop waits for ZeroMQ's. */
static void await_port(td_fleet_t *f)
{
    if (!f->port || !td_path_port_inflight(f->port))
        return;
    td_notice("fleet: waiting for %u of its messages still in the request path",
              td_path_port_inflight(f->port));
    while (td_path_port_inflight(f->port))
        td_fleet_path_poll(f, 10);
}

/* One turn of the loop; said, part by part, when it held the fleet thread (and so every
 * partition) TD_FLEET_SLOW_TURN_MS or more. */
static void turn(td_fleet_t *f)
{
    int64_t began = td_nats_now_ms(), at = began, parts = 0, slowest = 0;
    uint32_t slowest_k = 0;
    f->drop_until_ms = 0;
    TD_FLEET_SET(f, disconnects, atomic_load_explicit(&links_dropped, memory_order_relaxed));
    bool busy = td_fleet_keys_step(f);
    int64_t keys = lap(&at);
    if (at >= f->next_beat_ms)
        heartbeat(f);
    int64_t beat = lap(&at);
    renew_leases(f);
    int64_t renewals = lap(&at);
    for (uint32_t k = 0; k < f->partitions; k++)
        if (f->parts[k].owned) {
            busy |= td_part_step(f, &f->parts[k]);
            int64_t step = lap(&at);
            parts += step;
            if (step > slowest) {
                slowest = step;
                slowest_k = k;
            }
        }
    busy |= td_standby_step(f);
    busy |= td_fleet_query_step(f);
    busy |= td_fleet_watch_step(f);
    int64_t queries = lap(&at);
    int wait_ms = busy ? 0 : TD_FLEET_IDLE_MS;
    td_fleet_path_poll(f, wait_ms);
    int64_t poll = lap(&at);
    if (at - began < TD_FLEET_SLOW_TURN_MS)
        return;
    char stopped[128] = ""; /* a poll far past its wait: the whole process stood still */
    if (poll >= TD_FLEET_SLOW_TURN_MS / 2 + wait_ms)
        snprintf(stopped, sizeof stopped,
                 " (a wait of at most %d ms: this process was stopped, by SIGSTOP or a paused "
                 "VM, or starved of CPU)",
                 wait_ms);
    td_notice("fleet: a turn of the fleet thread took %" PRId64 " ms, every partition "
              "waiting: keys %" PRId64 " ms, heartbeat %" PRId64 " ms, renewals %" PRId64
              " ms, partitions' steps %" PRId64 " ms (the slowest, partition %u's, %" PRId64
              " ms), queries and watch %" PRId64 " ms, the request path's replies %" PRId64 " ms%s",
              at - began, keys, beat, renewals, parts, (unsigned)slowest_k, slowest, queries, poll,
              stopped);
}

static void *fleet_thread(void *arg)
{
    td_fleet_t *f = arg;
    pthread_setname_np(pthread_self(), "tdfleet"); /* for top -H and bench/thread-cpu.sh */
    while (!atomic_load(&f->stopping))
        turn(f);
    leave(f);
    await_port(f);
    td_fleet_on_loop(f, close_loop_handles, NULL);
    atomic_store(&f->thread_done, true);
    return NULL;
}

/* ---- A connection's server lost and found ------------------------------------------------- */

/* libnats calls these on its own thread, even after the fleet is gone (a connection's close
 * posts one): what they touch is static. The roles' names (the closure: "fleet" for the fleet
 * thread's connection, "replies", "changelog", "reader-K") are made once; the count of servers
 * lost (links_dropped, above) goes to the fleet's status at each turn. */
static char link_roles[3 + TALLY_NATS_MAX_PARTITIONS][16];
static pthread_once_t link_roles_once = PTHREAD_ONCE_INIT;

static void name_link_roles(void)
{
    snprintf(link_roles[0], sizeof link_roles[0], "fleet");
    snprintf(link_roles[1], sizeof link_roles[1], "replies");
    snprintf(link_roles[2], sizeof link_roles[2], "changelog");
    for (unsigned k = 0; k < TALLY_NATS_MAX_PARTITIONS; k++)
        snprintf(link_roles[3 + k], sizeof link_roles[3 + k], "reader-%u", k);
}

/* The static name of role (td_fleet_connect's). */
static const char *link_role(const char *role)
{
    pthread_once(&link_roles_once, name_link_roles);
    unsigned k;
    if (role && sscanf(role, "reader-%u", &k) == 1 && k < TALLY_NATS_MAX_PARTITIONS)
        return link_roles[3 + k];
    for (int i = 1; role && i < 3; i++)
        if (strcmp(role, link_roles[i]) == 0)
            return link_roles[i];
    return link_roles[0];
}

static void link_down(natsConnection *nc, void *role)
{
    if (natsConnection_IsClosed(nc))
        return; /* its close, not a server gone */
    atomic_fetch_add_explicit(&links_dropped, 1, memory_order_relaxed);
    uint64_t cid = 0;
    natsConnection_GetClientID(nc, &cid);
    td_warn("fleet: NATS connection '%s' (the server's cid %" PRIu64 ") disconnected; libnats "
            "reconnects it (a call in flight on it waits out its bound)",
            (const char *)role, cid);
}

static void link_up(natsConnection *nc, void *role)
{
    char url[256] = "?";
    uint64_t cid = 0;
    natsConnection_GetConnectedUrl(nc, url, sizeof url);
    natsConnection_GetClientID(nc, &cid);
    td_notice("fleet: NATS connection '%s' reconnected to %s (cid %" PRIu64 ")", (const char *)role,
              url, cid);
}

/* ---- Life ---------------------------------------------------------------------------------- */

td_err_t td_fleet_connect(td_fleet_t *f, const char *role, bool asap, natsConnection **nc,
                          char *msg, size_t cap)
{
    char name[TALLY_NATS_MEMBER_ID_MAX + 40];
    snprintf(name, sizeof name, "%s%s%s", f->member, role ? "/" : "", role ? role : "");
    tally_nats_conf_t conf = nats_conf(f->host.cfg, name);
    conf.send_asap = asap;
    conf.on_disconnected = link_down;
    conf.on_reconnected = link_up;
    conf.link_closure = (void *)link_role(role);
    /* libnats starts a connection's threads (its read loop, its flusher) without naming them, so
     * they take the name of the thread that connects: the connection's role instead, for a
     * while, so that top -H and profiles tell them from the thread that made them ("nats/reader-3"
     * beside "tdfleet"; bench/run-nats-fleet.sh PERF=1). Not on the main thread, whose name is
     * the process's (ps, pgrep) for as long as a connect may wait: the connections made at start
     * and the library's own threads (its garbage collector, which frees messages, and its
     * timers) keep "tallyd"; the loop thread is the one whose id is the process's. */
    char was[16] = "", as[16];
    snprintf(as, sizeof as, "nats/%s", role ? role : "fleet");
    bool renamed = gettid() != getpid() &&
                   pthread_getname_np(pthread_self(), was, sizeof was) == 0 &&
                   pthread_setname_np(pthread_self(), as) == 0;
    td_err_t err = tally__nats_connect(&conf, nc, msg, cap) == TALLY_OK ? TD_OK : TD_ERR_LIBRARY;
    if (renamed)
        pthread_setname_np(pthread_self(), was);
    return err;
}

/* The lease TTL: [nats] lease_ttl_ms; unset, an existing fleet's (its TALLY_LEASES bucket's
 * TTL, logged: a worker need not repeat it), or TD_DEFAULT_NATS_LEASE_TTL_MS for a new fleet. */
static void choose_ttl(td_fleet_t *f)
{
    int64_t have = 0;
    if (f->ttl_ms > 0)
        return;
    if (td_nats_bucket_ttl(f->kv_js, TALLY_NATS_BUCKET_LEASES, &have) == TD_OK && have > 0) {
        f->ttl_ms = have;
        td_notice("fleet: lease TTL %" PRId64 " ms, the fleet's (bucket %s; [nats] lease_ttl_ms "
                  "is not set)",
                  have, TALLY_NATS_BUCKET_LEASES);
        return;
    }
    f->ttl_ms = TD_DEFAULT_NATS_LEASE_TTL_MS;
}

static td_err_t connect_fleet(td_fleet_t *f, const td_config_t *cfg)
{
    char msg[512];
    /* The fleet thread's calls (every one answered before the next): flushed at once. Replies,
     * watch publications and acknowledgements go on a connection of their own, buffered: a
     * window's replies leave in few writes, and never wait behind a slow JetStream call. */
    if (td_fleet_connect(f, NULL, true, &f->nc, msg, sizeof msg) != TD_OK ||
        td_fleet_connect(f, "replies", false, &f->reply_nc, msg, sizeof msg) != TD_OK) {
        td_err("fleet: %s", msg);
        return TD_ERR_LIBRARY;
    }
    char user[TALLY_NATS_MEMBER_ID_MAX + 1];
    tally_nats_conf_t conf = nats_conf(cfg, f->member);
    if (tally__nats_user(&conf, user, sizeof user, msg, sizeof msg) != TALLY_OK) {
        td_err("fleet: %s", msg);
        return TD_ERR_CONFIG;
    }
    snprintf(f->inbox_prefix, sizeof f->inbox_prefix, "%s%s.", TALLY_NATS_INBOX, user);
    f->max_payload = (size_t)natsConnection_GetMaxPayload(f->nc);
    jsOptions jo, ko;
    jsOptions_Init(&jo);
    jsOptions_Init(&ko);
    jo.Wait = TD_FLEET_JS_WAIT_MS;
    ko.Wait = TD_FLEET_KV_WAIT_MS;
    if (natsConnection_JetStream(&f->js, f->nc, &jo) != NATS_OK ||
        natsConnection_JetStream(&f->kv_js, f->nc, &ko) != NATS_OK) {
        td_err("fleet: JetStream: %s", td_nats_last_error(NATS_ERR));
        return TD_ERR_LIBRARY;
    }
    choose_ttl(f);
    td_nats_layout_t l = {.partitions = f->partitions,
                          .replicas = (int)cfg->nats_replicas,
                          .partition_max_bytes = (int64_t)cfg->nats_partition_max_bytes,
                          .partition_max_age_ms = (int64_t)cfg->nats_partition_max_age_s * 1000,
                          .lease_ttl_ms = f->ttl_ms,
                          .max_msg_size = (int32_t)f->max_payload};
    /* A cluster that has just started may not place replicated streams yet ("no suitable
     * peers"): NATS failures are retried for a while, configuration conflicts are not. */
    td_err_t err = td_nats_fleet_ensure(f->js, &l, msg, sizeof msg);
    for (int i = 0; err == TD_ERR_LIBRARY && i < TD_FLEET_START_RETRIES; i++) {
        if (i == 0)
            td_warn("fleet: %s; trying again for up to %d s", msg,
                    TD_FLEET_START_RETRIES * TD_FLEET_START_RETRY_MS / 1000);
        usleep(TD_FLEET_START_RETRY_MS * 1000);
        err = td_nats_fleet_ensure(f->js, &l, msg, sizeof msg);
    }
    if (err == TD_OK)
        err = td_nats_kv_open(f->kv_js, TALLY_NATS_BUCKET_MEMBERS, f->ttl_ms, l.replicas,
                              &f->members, msg, sizeof msg);
    if (err == TD_OK)
        err = td_nats_kv_open(f->kv_js, TALLY_NATS_BUCKET_LEASES, f->ttl_ms, l.replicas, &f->leases,
                              msg, sizeof msg);
    if (err == TD_OK)
        err = td_nats_kv_open(f->kv_js, TALLY_NATS_BUCKET_CKPT, 0, l.replicas, &f->ckpts, msg,
                              sizeof msg);
    if (err != TD_OK)
        td_err("fleet: %s", msg);
    return err;
}

static td_err_t open_loop_handles(td_fleet_t *f)
{
    if (uv_async_init(f->host.loop, &f->async, on_async) != 0 ||
        uv_signal_init(f->host.loop, &f->sig_term) != 0 ||
        uv_signal_init(f->host.loop, &f->sig_int) != 0)
        return TD_ERR_LIBRARY;
    f->async.data = f->sig_term.data = f->sig_int.data = f;
    if (uv_signal_start(&f->sig_term, on_signal, SIGTERM) != 0 ||
        uv_signal_start(&f->sig_int, on_signal, SIGINT) != 0)
        return TD_ERR_LIBRARY;
    /* The async handle is closed last, from destroy: it must not keep the loop alive. */
    uv_unref((uv_handle_t *)&f->async);
    return TD_OK;
}

static void settings(td_fleet_t *f, const td_config_t *cfg)
{
    char host[64] = "tallyd";
    gethostname(host, sizeof host - 1);
    for (char *c = host; *c; c++) /* a host name's dots are not member id characters */
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9')))
            *c = '-';
    char base[TALLY_NATS_MEMBER_ID_MAX + 1];
    if (cfg->nats_member_id)
        snprintf(base, sizeof base, "%s", cfg->nats_member_id);
    else
        snprintf(base, sizeof base, "%.40s-%d", host, (int)getpid());
    snprintf(f->base_member, sizeof f->base_member, "%s", base);
    if (cfg->nats_members_per_process > 1) /* the base is short enough: td_fleet_check_config */
        snprintf(f->member, sizeof f->member, "%.*s-%u", TD_FLEET_BASE_ID_MAX, base,
                 f->host.instance);
    else
        snprintf(f->member, sizeof f->member, "%s", base);
    f->partitions = cfg->nats_partitions;
    f->ttl_ms = cfg->nats_lease_ttl_ms;
    f->ckpt_ms = cfg->nats_checkpoint_ms;
    f->inflight = cfg->nats_inflight; /* never 0: the settings' minimum, their default */
    f->inflight_bytes = cfg->nats_inflight_bytes;
    f->watch_ms = cfg->pub_interval_ms;
    const char *take_ms = getenv("TALLYD_TEST_TAKE_MS"); /* test only: a slow cluster's takes */
    f->test_take_ms = take_ms ? atoll(take_ms) : 0;
}

/* What info shows of the settings: before the loop runs, so the loop reads them unlocked. With
 * members_per_process > 1 every member writes the same: the id they share. */
static void publish_settings(td_fleet_t *f)
{
    td_fleet_status_t *st = f->st;
    snprintf(st->member, sizeof st->member, "%s", f->base_member);
    st->members_per_process = f->host.cfg->nats_members_per_process;
    st->partitions = f->partitions;
    st->lease_ttl_ms = (uint64_t)f->ttl_ms;
    st->checkpoint_interval_ms = (uint64_t)f->ckpt_ms;
    st->max_payload = f->max_payload;
    st->inflight = f->inflight;
    st->inflight_bytes = f->inflight_bytes;
    st->on = true;
}

td_err_t td_fleet_new(const td_fleet_host_t *host, td_fleet_t **out)
{
    *out = NULL;
    td_fleet_t *f = calloc(1, sizeof *f);
    if (!f) {
        td_err("fleet: out of memory while starting");
        return TD_ERR_NOMEM;
    }
    f->host = *host;
    f->st = host->status ? host->status : &f->own_status;
    f->wake_fd = -1;
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cond, NULL);
    settings(f, host->cfg);
    td_err_t err = TD_ERR_NOMEM;
    f->parts = calloc(f->partitions, sizeof *f->parts);
    if (!f->parts)
        goto fail;
    for (uint32_t k = 0; k < f->partitions; k++)
        f->parts[k].k = k;
    f->pend_cap = (size_t)f->partitions * f->inflight + TD_FLEET_PENDING_EXTRA;
    if (!(f->pend = calloc(f->pend_cap, sizeof *f->pend)))
        goto fail;
    if ((err = connect_fleet(f, host->cfg)) != TD_OK || (err = td_fleet_path_open(f)) != TD_OK ||
        (err = td_fleet_query_open(f)) != TD_OK || (err = td_fleet_keys_open(f)) != TD_OK ||
        (err = td_fleet_route_open(f, host->cfg)) != TD_OK ||
        (err = td_standby_open(f, host->cfg)) != TD_OK || (err = open_loop_handles(f)) != TD_OK ||
        (host->instance == 0 && (err = td_fleet_view_open(f)) != TD_OK))
        goto fail;
    publish_settings(f);
    if (pthread_create(&f->thread, NULL, fleet_thread, f) != 0) {
        err = TD_ERR_LIBRARY;
        goto fail;
    }
    f->thread_started = true;
    char shown[512]; /* a password or token in a URL is not for the log */
    td_notice("fleet: %s joins on %s: %u partitions, lease %" PRId64 " ms", f->member,
              tally_fleet_redact(host->cfg->nats_servers, shown, sizeof shown),
              (unsigned)f->partitions, f->ttl_ms);
    *out = f;
    return TD_OK;
fail:
    if (err == TD_ERR_NOMEM) /* the other failures have said what they were */
        td_err("fleet: out of memory while starting");
    td_fleet_destroy(&f);
    return err;
}

void td_fleet_destroy(td_fleet_t **self_p)
{
    td_fleet_t *f = *self_p;
    if (!f)
        return;
    if (f->thread_started) {
        /* Normally the thread is done (it stopped with the loop's signal). Otherwise (tallyd
         * stops for another reason) it still needs the loop for its last checkpoints: run it. */
        atomic_store(&f->stopping, true);
        while (!atomic_load(&f->thread_done)) {
            uv_run(f->host.loop, UV_RUN_NOWAIT);
            usleep(1000);
        }
        pthread_join(f->thread, NULL);
    }
    if (f->async.loop && !uv_is_closing((uv_handle_t *)&f->async))
        uv_close((uv_handle_t *)&f->async, NULL);
    if (f->check.loop && !uv_is_closing((uv_handle_t *)&f->check))
        uv_close((uv_handle_t *)&f->check, NULL);
    if (f->prepare.loop && !uv_is_closing((uv_handle_t *)&f->prepare))
        uv_close((uv_handle_t *)&f->prepare, NULL);
    if (f->sig_term.loop && !f->loop_closed) {
        uv_close((uv_handle_t *)&f->sig_term, NULL);
        uv_close((uv_handle_t *)&f->sig_int, NULL);
    }
    td_fleet_view_close(f);
    if (f->host.loop)
        uv_run(f->host.loop, UV_RUN_NOWAIT); /* the close callbacks */
    td_fleet_query_close(f);
    td_fleet_keys_close(f);
    td_fleet_path_close(f);
    for (uint32_t k = 0; f->parts && k < f->partitions; k++)
        td_part_free(f, &f->parts[k]);
    free(f->parts);
    td_fleet_route_close(f);
    td_standby_close(f);
    free(f->pend);
    kvStore_Destroy(f->members);
    kvStore_Destroy(f->leases);
    kvStore_Destroy(f->ckpts);
    jsCtx_Destroy(f->js);
    jsCtx_Destroy(f->kv_js);
    natsConnection_Destroy(f->nc);
    natsConnection_Destroy(f->reply_nc);
    pthread_cond_destroy(&f->cond);
    pthread_mutex_destroy(&f->mu);
    free(f);
    *self_p = NULL;
}

/* Test only (td_fleet_changelog.c): the fleet thread waits, up to 30 s, for the file the
 * environment's `env` names to exist, so that a test can act in between. TALLYD_TEST_FENCE_GATE
 * holds a take between reading its changelog's end and storing its fence (another writer's message
 * lands there: the race CL_FENCE_TRIES answers); TALLYD_TEST_PURGE_GATE holds a compaction between
 * its checkpoint's store and its quiet check (a record stored there must keep the stream from the
 * purge); TALLYD_TEST_ACK_GATE holds the PubAcks (libnats' thread, in on_ack: the messages in
 * flight stay in flight). */
void td_fleet_test_gate(const char *env, const char *what, uint32_t k)
{
    const char *gate = getenv(env);
    if (!gate)
        return;
    td_info("fleet: partition %u: test: %s waits for %s", (unsigned)k, what, gate);
    for (int i = 0; i < 3000 && access(gate, F_OK) != 0; i++)
        usleep(10000);
}
