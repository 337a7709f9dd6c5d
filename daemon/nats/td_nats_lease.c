/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_nats_lease.c — see td_nats_lease.h.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tally_fleet.h"
#include "td_nats_js.h"
#include "td_monotonic.h"
#include "td_nats_lease.h"

int64_t td_nats_now_ms(void)
{
    return td_mono_ms();
}

void td_lease_key(char *key, size_t cap, uint32_t k)
{
    tally_fleet_name(key, cap, "p", k);
}

static td_err_t lease_read(kvStore *leases, uint32_t k, char *holder, size_t cap, uint64_t *rev,
                           char *msg, size_t msg_cap);

/* Writes member into partition k's lease key by compare-and-set on l->revision (0: create if
 * absent); on success l holds the new revision and is valid for ttl_ms from before the write. */
static natsStatus lease_write(kvStore *leases, uint32_t k, const char *member, int64_t ttl_ms,
                              td_lease_t *l)
{
    char key[16];
    td_lease_key(key, sizeof key, k);
    int64_t sent = td_nats_now_ms();
    uint64_t rev = 0;
    natsStatus s = l->revision ? kvStore_UpdateString(&rev, leases, key, member, l->revision)
                               : kvStore_CreateString(&rev, leases, key, member);
    if (s == NATS_OK) {
        l->revision = rev;
        l->valid_until_ms = sent + ttl_ms;
    }
    return s;
}

td_err_t td_lease_acquire(kvStore *leases, uint32_t k, const char *member, int64_t ttl_ms,
                          td_lease_t *l, bool *taken, char *msg, size_t cap)
{
    memset(l, 0, sizeof *l);
    *taken = lease_write(leases, k, member, ttl_ms, l) == NATS_OK;
    if (*taken)
        return TD_OK;
    /* A key that exists (held by another, or by an earlier run under the same id, which must
     * expire first) and a failing NATS look alike here: a key that can be read tells them
     * apart. If it expired in between, the next round takes it. */
    char holder[TALLY_NATS_MEMBER_ID_MAX + 1];
    return td_lease_holder(leases, k, holder, sizeof holder, msg, cap);
}

td_err_t td_lease_renew(kvStore *leases, uint32_t k, const char *member, int64_t ttl_ms,
                        td_lease_t *l, bool *lost, char *msg, size_t cap)
{
    *lost = false;
    natsStatus s = l->revision ? lease_write(leases, k, member, ttl_ms, l) : NATS_ERR;
    if (s == NATS_OK)
        return TD_OK;
    /* libnats 3.4.1 gives no jsErrCode for a KV update: a failed compare-and-set and a failing
     * server look alike. The key tells them apart: not ours (or gone) means lost. Ours at a
     * later revision: an earlier renewal that the server applied but answered after libnats
     * stopped waiting (a loaded server), which every renewal after it would fail on until the
     * lease ran out; its revision is taken, and the renewal made again on it (valid_until_ms
     * stays that of the last write known to be ours until one succeeds). */
    char holder[TALLY_NATS_MEMBER_ID_MAX + 1];
    uint64_t rev = 0;
    td_err_t err = lease_read(leases, k, holder, sizeof holder, &rev, msg, cap);
    if (err != TD_OK)
        return err; /* keep l: the lease may still be ours; valid_until_ms runs out anyway */
    if (strcmp(holder, member) != 0 || !l->revision) {
        *lost = true;
        memset(l, 0, sizeof *l);
        return TD_OK;
    }
    if (rev > l->revision) {
        l->revision = rev;
        if ((s = lease_write(leases, k, member, ttl_ms, l)) == NATS_OK)
            return TD_OK;
    }
    snprintf(msg, cap, "renewing lease p%u: %s", (unsigned)k, td_nats_last_error(s));
    return TD_ERR_LIBRARY;
}

td_err_t td_lease_release(jsCtx *js, uint32_t k, td_lease_t *l, char *msg, size_t cap)
{
    char subject[64];
    snprintf(subject, sizeof subject, "$KV.%s.p%u", TALLY_NATS_BUCKET_LEASES, (unsigned)k);
    natsMsg *m = NULL;
    natsStatus s = natsMsg_Create(&m, subject, NULL, NULL, 0);
    if (s == NATS_OK)
        s = natsMsgHeader_Set(m, "KV-Operation", "DEL");
    jsPubOptions po;
    jsPubOptions_Init(&po);
    po.ExpectLastSubjectSeq = l->revision;
    jsErrCode jerr = 0;
    if (s == NATS_OK)
        s = js_PublishMsg(NULL, js, m, &po, &jerr);
    natsMsg_Destroy(m);
    memset(l, 0, sizeof *l);
    /* A compare-and-set that lost (the lease moved on) deleted nothing: that is fine. */
    if (s != NATS_OK && jerr != JSStreamWrongLastSequenceErr) {
        snprintf(msg, cap, "releasing lease p%u: %s", (unsigned)k, td_nats_last_error(s));
        return TD_ERR_LIBRARY;
    }
    return TD_OK;
}

bool td_lease_valid(const td_lease_t *l, int64_t now_ms)
{
    return l->revision != 0 && now_ms < l->valid_until_ms;
}

td_err_t td_lease_holder(kvStore *leases, uint32_t k, char *holder, size_t cap, char *msg,
                         size_t msg_cap)
{
    uint64_t rev;
    return lease_read(leases, k, holder, cap, &rev, msg, msg_cap);
}

/* td_lease_holder, and the key's revision (0 when absent). */
static td_err_t lease_read(kvStore *leases, uint32_t k, char *holder, size_t cap, uint64_t *rev,
                           char *msg, size_t msg_cap)
{
    char key[16];
    td_lease_key(key, sizeof key, k);
    kvEntry *e = NULL;
    holder[0] = 0;
    *rev = 0;
    natsStatus s = kvStore_Get(&e, leases, key);
    if (s == NATS_NOT_FOUND)
        return TD_OK;
    if (s != NATS_OK) {
        snprintf(msg, msg_cap, "reading lease p%u: %s", (unsigned)k, td_nats_last_error(s));
        return TD_ERR_LIBRARY;
    }
    int len = kvEntry_ValueLen(e);
    snprintf(holder, cap, "%.*s", len > 0 ? len : 0, (const char *)kvEntry_Value(e));
    *rev = kvEntry_Revision(e);
    kvEntry_Destroy(e);
    return TD_OK;
}

td_err_t td_kv_expiry(kvStore *kv, const char *key, int64_t ttl_ms, int64_t *at_ms)
{
    kvEntry *e = NULL;
    *at_ms = 0;
    natsStatus s = kvStore_Get(&e, kv, key);
    if (s == NATS_NOT_FOUND)
        return TD_OK;
    if (s != NATS_OK)
        return TD_ERR_LIBRARY;
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    int64_t wall_ms = (int64_t)wall.tv_sec * 1000 + wall.tv_nsec / 1000000;
    int64_t written_ms = kvEntry_Created(e) / 1000000;
    kvEntry_Destroy(e);
    *at_ms = td_nats_now_ms() + (written_ms + ttl_ms - wall_ms);
    return TD_OK;
}

td_err_t td_member_beat(kvStore *members, const char *member, const char *info, char *msg,
                        size_t cap)
{
    uint64_t rev = 0;
    natsStatus s = kvStore_PutString(&rev, members, member, info ? info : "");
    if (s != NATS_OK) {
        snprintf(msg, cap, "heartbeat: %s", td_nats_last_error(s));
        return TD_ERR_LIBRARY;
    }
    return TD_OK;
}

td_err_t td_member_leave(kvStore *members, const char *member, char *msg, size_t cap)
{
    natsStatus s = kvStore_Delete(members, member);
    if (s != NATS_OK && s != NATS_NOT_FOUND) {
        snprintf(msg, cap, "leaving: %s", td_nats_last_error(s));
        return TD_ERR_LIBRARY;
    }
    return TD_OK;
}

td_err_t td_member_list(kvStore *members, char ***ids, size_t *n, char *msg, size_t cap)
{
    return td_nats_kv_keys(members, ">", ids, n, msg, cap);
}

void td_member_list_free(char **ids, size_t n)
{
    td_nats_kv_keys_free(ids, n);
}
