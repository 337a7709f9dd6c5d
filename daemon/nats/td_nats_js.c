/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_nats_js.c — see td_nats_js.h.
 *
 * Creation is idempotent and racy by design: several workers start at once, each looks the
 * object up and creates it when missing; JetStream accepts the second creation of an identical
 * stream and the key `partitions` is created only once (create-if-absent), so every worker
 * then reads the same count.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally_fleet.h"
#include "td_nats_js.h"

const char *td_nats_last_error(natsStatus s)
{
    const char *text = nats_GetLastError(NULL);
    return text && *text ? text : natsStatus_GetText(s);
}

bool td_nats_next_queued(natsSubscription *sub, natsMsg **m)
{
    uint64_t queued = 0;
    *m = NULL;
    return natsSubscription_QueuedMsgs(sub, &queued) == NATS_OK && queued > 0 &&
           natsSubscription_NextMsg(m, sub, 0) == NATS_OK;
}

td_err_t td_nats_kv_keys(kvStore *kv, const char *filter, char ***keys, size_t *n, char *msg,
                         size_t cap)
{
    *keys = NULL;
    *n = 0;
    kvWatchOptions wo;
    kvWatchOptions_Init(&wo);
    wo.IgnoreDeletes = true;
    wo.MetaOnly = true;
    kvWatcher *w = NULL;
    int64_t deadline = nats_Now() + TD_NATS_KEYS_WAIT_MS;
    natsStatus s = kvStore_Watch(&w, kv, filter, &wo);
    size_t room = 0;
    td_err_t err = TD_OK;
    while (s == NATS_OK) {
        int64_t left = deadline - nats_Now();
        kvEntry *e = NULL;
        s = left > 0 ? kvWatcher_Next(&e, w, left) : NATS_TIMEOUT;
        if (s != NATS_OK || !e) /* no entry: the watcher's marker, every key is in */
            break;
        if (*n == room) {
            size_t more = room ? 2 * room : 16;
            char **grown = realloc(*keys, more * sizeof *grown);
            if (grown) {
                *keys = grown;
                room = more;
            }
        }
        char *key = *n < room ? strdup(kvEntry_Key(e)) : NULL;
        kvEntry_Destroy(e);
        if (!key) {
            err = TD_ERR_NOMEM;
            break;
        }
        (*keys)[(*n)++] = key;
    }
    kvWatcher_Destroy(w);
    if (err == TD_OK && s == NATS_OK)
        return TD_OK;
    td_nats_kv_keys_free(*keys, *n);
    *keys = NULL;
    *n = 0;
    snprintf(msg, cap, "listing the keys of %s: %s", kvStore_Bucket(kv),
             err == TD_ERR_NOMEM ? "out of memory" : td_nats_last_error(s));
    return err == TD_ERR_NOMEM ? err : TD_ERR_LIBRARY;
}

void td_nats_kv_keys_free(char **keys, size_t n)
{
    for (size_t i = 0; keys && i < n; i++)
        free(keys[i]);
    free(keys);
}

static td_err_t ensure_stream(jsCtx *js, const char *name, const char *subject, int replicas,
                              int64_t max_bytes, int64_t max_age_ms, jsRetentionPolicy retention,
                              jsDiscardPolicy discard, int32_t max_msg_size, bool *created,
                              char *msg, size_t cap)
{
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    natsStatus s = js_GetStreamInfo(&si, js, name, NULL, &jerr);
    /* An existing stream must capture what this worker reads: a partition made by a tallyd
     * before subjects named their publisher captures tally.in.<k> alone. */
    bool same = s == NATS_OK && si && si->Config && si->Config->SubjectsLen == 1 &&
                strcmp(si->Config->Subjects[0], subject) == 0;
    jsStreamInfo_Destroy(si);
    *created = false;
    if (s == NATS_OK && !same) {
        snprintf(msg, cap,
                 "stream %s exists and does not capture exactly %s (made by an earlier "
                 "tallyd?): set its subjects to %s (nats stream edit %s --subjects '%s'), "
                 "PROTOCOL.md §13",
                 name, subject, subject, name, subject);
        return TD_ERR_CONFIG;
    }
    if (s == NATS_OK)
        return TD_OK;
    if (s != NATS_NOT_FOUND && jerr != JSStreamNotFoundErr) {
        snprintf(msg, cap, "stream %s: %s", name, td_nats_last_error(s));
        return TD_ERR_LIBRARY;
    }
    jsStreamConfig sc;
    jsStreamConfig_Init(&sc);
    sc.Name = name;
    sc.Subjects = &subject;
    sc.SubjectsLen = 1;
    sc.Storage = js_FileStorage;
    sc.Retention = retention;
    sc.Replicas = replicas;
    sc.MaxBytes = max_bytes;
    sc.MaxAge = max_age_ms * 1000000;
    sc.Discard = discard;
    sc.MaxMsgSize = max_msg_size;
    s = js_AddStream(&si, js, &sc, NULL, &jerr);
    jsStreamInfo_Destroy(si);
    if (s != NATS_OK && jerr != JSStreamNameExistErr) {
        snprintf(msg, cap, "cannot create stream %s (%d replicas): %s", name, replicas,
                 td_nats_last_error(s));
        return TD_ERR_LIBRARY;
    }
    *created = s == NATS_OK;
    return TD_OK;
}

td_err_t td_nats_stream_ensure(jsCtx *js, const char *name, const char *subject, int replicas,
                               int64_t max_age_ms, int32_t max_msg_size, char *msg, size_t cap)
{
    bool created = false;
    return ensure_stream(js, name, subject, replicas, -1, max_age_ms, js_LimitsPolicy,
                         js_DiscardOld, max_msg_size, &created, msg, cap);
}

td_err_t td_nats_kv_open(jsCtx *js, const char *name, int64_t ttl_ms, int replicas, kvStore **out,
                         char *msg, size_t cap)
{
    *out = NULL;
    natsStatus s = js_KeyValue(out, js, name);
    if (s == NATS_NOT_FOUND) {
        kvConfig kc;
        kvConfig_Init(&kc);
        kc.Bucket = name;
        kc.History = 1;
        kc.TTL = ttl_ms * 1000000;
        kc.Replicas = replicas;
        kc.StorageType = js_FileStorage;
        s = js_CreateKeyValue(out, js, &kc);
        /* Two workers starting at once both found none: the other made it. Else the creation's
         * error is the one said (the lookup's would be Not Found). */
        if (s != NATS_OK)
            snprintf(msg, cap, "key-value bucket %s: %s", name, td_nats_last_error(s));
        if (s != NATS_OK && js_KeyValue(out, js, name) != NATS_OK) {
            *out = NULL;
            return TD_ERR_LIBRARY;
        }
        s = NATS_OK;
    }
    if (s != NATS_OK) {
        snprintf(msg, cap, "key-value bucket %s: %s", name, td_nats_last_error(s));
        *out = NULL;
        return TD_ERR_LIBRARY;
    }
    kvStatus *st = NULL;
    if (kvStore_Status(&st, *out) == NATS_OK) {
        int64_t have = kvStatus_TTL(st) / 1000000;
        kvStatus_Destroy(st);
        if (have != ttl_ms) {
            snprintf(msg, cap,
                     "key-value bucket %s has a TTL of %" PRId64 " ms, not %" PRId64
                     " (every worker of a fleet needs the same lease_ttl_ms)",
                     name, have, ttl_ms);
            kvStore_Destroy(*out);
            *out = NULL;
            return TD_ERR_CONFIG;
        }
    }
    return TD_OK;
}

td_err_t td_nats_bucket_ttl(jsCtx *js, const char *name, int64_t *ttl_ms)
{
    kvStore *kv = NULL;
    kvStatus *st = NULL;
    *ttl_ms = 0;
    natsStatus s = js_KeyValue(&kv, js, name);
    if (s == NATS_OK && (s = kvStore_Status(&st, kv)) == NATS_OK)
        *ttl_ms = kvStatus_TTL(st) / 1000000;
    kvStatus_Destroy(st);
    kvStore_Destroy(kv);
    return s == NATS_OK ? TD_OK : s == NATS_NOT_FOUND ? TD_ERR_CONFIG : TD_ERR_LIBRARY;
}

static td_err_t parse_partitions(kvEntry *e, uint32_t *partitions, char *msg, size_t cap)
{
    char text[16];
    int len = kvEntry_ValueLen(e);
    snprintf(text, sizeof text, "%.*s", len > 0 && len < 15 ? len : 0,
             (const char *)kvEntry_Value(e));
    char *end;
    unsigned long p = strtoul(text, &end, 10);
    if (!*text || *end || p < 1 || p > TALLY_NATS_MAX_PARTITIONS) {
        snprintf(msg, cap, "%s/%s holds '%s', not a partition count", TALLY_NATS_BUCKET_FLEET,
                 TALLY_NATS_KEY_PARTITIONS, text);
        return TD_ERR_CONFIG;
    }
    *partitions = (uint32_t)p;
    return TD_OK;
}

td_err_t td_nats_read_partitions(jsCtx *js, uint32_t *partitions, char *msg, size_t cap)
{
    kvStore *kv = NULL;
    kvEntry *e = NULL;
    td_err_t err = TD_ERR_CONFIG;
    natsStatus s = js_KeyValue(&kv, js, TALLY_NATS_BUCKET_FLEET);
    if (s == NATS_OK)
        s = kvStore_Get(&e, kv, TALLY_NATS_KEY_PARTITIONS);
    if (s == NATS_OK)
        err = parse_partitions(e, partitions, msg, cap);
    else if (s == NATS_NOT_FOUND)
        snprintf(msg, cap, "no tallyd fleet on this NATS (no %s/%s): start a worker first",
                 TALLY_NATS_BUCKET_FLEET, TALLY_NATS_KEY_PARTITIONS);
    else {
        snprintf(msg, cap, "%s: %s", TALLY_NATS_BUCKET_FLEET, td_nats_last_error(s));
        err = TD_ERR_LIBRARY;
    }
    kvEntry_Destroy(e);
    kvStore_Destroy(kv);
    return err;
}

/* TALLY_FLEET/partitions: created with the layout's count, or checked against it. */
static td_err_t ensure_partitions(jsCtx *js, const td_nats_layout_t *l, char *msg, size_t cap)
{
    kvStore *kv = NULL;
    td_err_t err = td_nats_kv_open(js, TALLY_NATS_BUCKET_FLEET, 0, l->replicas, &kv, msg, cap);
    if (err != TD_OK)
        return err;
    char text[16];
    snprintf(text, sizeof text, "%u", (unsigned)l->partitions);
    uint64_t rev = 0;
    kvEntry *e = NULL;
    natsStatus made = kvStore_CreateString(&rev, kv, TALLY_NATS_KEY_PARTITIONS, text);
    /* The first one wins. Neither written nor there: a bucket just made whose stream has no
     * leader yet (a worker starting with its cluster): a NATS failure, tried again. */
    natsStatus there = made == NATS_OK ? NATS_OK : kvStore_Get(&e, kv, TALLY_NATS_KEY_PARTITIONS);
    kvEntry_Destroy(e);
    kvStore_Destroy(kv);
    if (there == NATS_NOT_FOUND) {
        snprintf(msg, cap, "%s/%s not written: %s", TALLY_NATS_BUCKET_FLEET,
                 TALLY_NATS_KEY_PARTITIONS, natsStatus_GetText(made));
        return TD_ERR_LIBRARY;
    }
    uint32_t have = 0;
    err = td_nats_read_partitions(js, &have, msg, cap);
    if (err == TD_OK && have != l->partitions) {
        snprintf(msg, cap, "the fleet has %u partitions, this worker is configured for %u",
                 (unsigned)have, (unsigned)l->partitions);
        err = TD_ERR_CONFIG;
    }
    return err;
}

td_err_t td_nats_fleet_ensure(jsCtx *js, const td_nats_layout_t *l, char *msg, size_t cap)
{
    td_err_t err = ensure_partitions(js, l, msg, cap);
    /* Limits retention: a message leaves its partition by age alone (and the stream refuses
     * new ones while it is full); the fleet removes nothing (td_nats_consumer.h says why). */
    for (uint32_t k = 0; err == TD_OK && k < l->partitions; k++) {
        char name[32], subject[32];
        bool created = false;
        tally_fleet_name(name, sizeof name, TALLY_NATS_STREAM_PREFIX, k);
        tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, k, "*");
        err = ensure_stream(js, name, subject, l->replicas, l->partition_max_bytes,
                            l->partition_max_age_ms, js_LimitsPolicy, js_DiscardNew,
                            l->max_msg_size, &created, msg, cap);
    }
    /* Dead letters: a week, 256 MiB, the oldest dropped first (they are for people to read). */
    bool created = false;
    if (err == TD_OK)
        err = ensure_stream(js, TALLY_NATS_DEAD_STREAM, TALLY_NATS_SUBJ_DEAD ">", l->replicas,
                            256ll << 20, 7ll * 24 * 3600 * 1000, js_LimitsPolicy, js_DiscardOld,
                            l->max_msg_size, &created, msg, cap);
    const char *buckets[3] = {TALLY_NATS_BUCKET_MEMBERS, TALLY_NATS_BUCKET_LEASES,
                              TALLY_NATS_BUCKET_CKPT};
    for (int i = 0; err == TD_OK && i < 3; i++) {
        kvStore *kv = NULL;
        err = td_nats_kv_open(js, buckets[i], i < 2 ? l->lease_ttl_ms : 0, l->replicas, &kv, msg,
                              cap);
        kvStore_Destroy(kv);
    }
    return err;
}
