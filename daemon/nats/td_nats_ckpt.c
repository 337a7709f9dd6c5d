/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_nats_ckpt.c — see td_nats_ckpt.h.
 *
 * libnats 3.4.1 does not say why a kvStore_Update failed (no jsErrCode), so a failed
 * compare-and-set is told from a failing server by reading the key again: a revision other
 * than ours means another writer (fenced); our own revision means NATS failed. Reads go to the
 * bucket stream's leader (leader_get), never to a replica that may lag behind a write.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "td_nats_ckpt.h"
#include "td_nats_js.h"

#define INLINE_MAX (TD_CKPT_CHUNK_BYTES - TD_CKPT_MANIFEST_SIZE_SINCE)

static uint32_t crc_of(const uint8_t *buf, size_t len)
{
    uLong crc = crc32(0L, Z_NULL, 0);
    while (len > 0) { /* crc32 takes a uInt length */
        uInt n = len > (1u << 30) ? (1u << 30) : (uInt)len;
        crc = crc32(crc, buf, n);
        buf += n;
        len -= n;
    }
    return (uint32_t)crc;
}

size_t td_ckpt_manifest_size(const td_ckpt_manifest_t *m)
{
    return m->cl_since_epoch ? TD_CKPT_MANIFEST_SIZE_SINCE
           : m->cl_seq       ? TD_CKPT_MANIFEST_SIZE_CL
                             : TD_CKPT_MANIFEST_SIZE;
}

bool td_ckpt_since_covers(const td_ckpt_manifest_t *m, uint64_t epoch, uint64_t generation)
{
    return m->cl_since_epoch && m->cl_since_epoch <= epoch &&
           m->cl_since_generation <= generation && generation <= m->generation;
}

void td_ckpt_manifest_encode(const td_ckpt_manifest_t *m, uint8_t *out)
{
    memset(out, 0, td_ckpt_manifest_size(m));
    memcpy(out, TD_CKPT_MAGIC, 4);
    out[4] = m->cl_since_epoch ? TD_CKPT_VERSION_SINCE
             : m->cl_seq       ? TD_CKPT_VERSION_CL
                               : TD_CKPT_VERSION;
    if (m->cl_seq || m->cl_since_epoch)
        tally_put_u64(out + TD_CKPT_MANIFEST_SIZE, m->cl_seq);
    if (m->cl_since_epoch) {
        tally_put_u64(out + TD_CKPT_MANIFEST_SIZE_CL, m->cl_since_epoch);
        tally_put_u64(out + TD_CKPT_MANIFEST_SIZE_CL + 8, m->cl_since_generation);
    }
    tally_put_u64(out + 8, m->applied_seq);
    tally_put_u64(out + 16, m->epoch);
    tally_put_u64(out + 24, m->generation);
    tally_put_u64(out + 32, m->state_len);
    tally_put_u32(out + 40, m->chunks);
    tally_put_u32(out + 44, m->crc);
    tally_put_u64(out + 48, m->chunk_epoch);
    memcpy(out + TD_CKPT_MEMBER_OFF, m->member, strnlen(m->member, TALLY_NATS_MEMBER_ID_MAX));
}

td_err_t td_ckpt_manifest_decode(const uint8_t *buf, size_t len, td_ckpt_manifest_t *m, char *msg,
                                 size_t cap)
{
    memset(m, 0, sizeof *m);
    bool since = len >= TD_CKPT_MANIFEST_SIZE_SINCE && buf[4] == TD_CKPT_VERSION_SINCE;
    bool cl = since || (len >= TD_CKPT_MANIFEST_SIZE_CL && buf[4] == TD_CKPT_VERSION_CL);
    if (len < TD_CKPT_MANIFEST_SIZE || memcmp(buf, TD_CKPT_MAGIC, 4) != 0 ||
        (buf[4] != TD_CKPT_VERSION && !cl) || buf[5] || buf[6] || buf[7]) {
        snprintf(msg, cap, "not a version-%u, %u or %u checkpoint manifest (%zu bytes)",
                 TD_CKPT_VERSION, TD_CKPT_VERSION_CL, TD_CKPT_VERSION_SINCE, len);
        return TD_ERR_CORRUPT;
    }
    if (cl)
        m->cl_seq = tally_get_u64(buf + TD_CKPT_MANIFEST_SIZE);
    if (since) {
        m->cl_since_epoch = tally_get_u64(buf + TD_CKPT_MANIFEST_SIZE_CL);
        m->cl_since_generation = tally_get_u64(buf + TD_CKPT_MANIFEST_SIZE_CL + 8);
    }
    m->applied_seq = tally_get_u64(buf + 8);
    m->epoch = tally_get_u64(buf + 16);
    m->generation = tally_get_u64(buf + 24);
    m->state_len = tally_get_u64(buf + 32);
    m->chunks = tally_get_u32(buf + 40);
    m->crc = tally_get_u32(buf + 44);
    m->chunk_epoch = tally_get_u64(buf + 48);
    memcpy(m->member, buf + TD_CKPT_MEMBER_OFF, TALLY_NATS_MEMBER_ID_MAX);
    m->member[TALLY_NATS_MEMBER_ID_MAX] = 0;
    size_t inline_len = len - td_ckpt_manifest_size(m);
    uint64_t want_chunks = (m->state_len + TD_CKPT_CHUNK_BYTES - 1) / TD_CKPT_CHUNK_BYTES;
    bool ok =
        (m->member[0] == 0 || tally_fleet_member_id_valid(m->member)) &&
        (m->chunks == 0 ? inline_len == m->state_len : inline_len == 0 && m->chunks == want_chunks);
    if (!ok) {
        snprintf(msg, cap,
                 "checkpoint manifest inconsistent: %" PRIu64 " bytes of state, %u chunks, %zu "
                 "inline",
                 m->state_len, (unsigned)m->chunks, inline_len);
        return TD_ERR_CORRUPT;
    }
    return TD_OK;
}

/* The latest value of a key, read from the bucket stream's leader (js_GetLastMsg): a KV get may
 * be served by a replica that lags (direct get), and a checkpoint read right after a write must
 * see the write. *out is NULL when the key has no value (none, deleted or purged). */
static natsStatus leader_get(jsCtx *js, const char *key, natsMsg **out)
{
    char subject[128];
    snprintf(subject, sizeof subject, "$KV.%s.%s", TALLY_NATS_BUCKET_CKPT, key);
    jsErrCode jerr = 0;
    *out = NULL;
    natsStatus s = js_GetLastMsg(out, js, "KV_" TALLY_NATS_BUCKET_CKPT, subject, NULL, &jerr);
    if (s == NATS_NOT_FOUND || jerr == JSNoMessageFoundErr) {
        *out = NULL;
        return NATS_OK;
    }
    const char *op = NULL;
    if (s == NATS_OK && natsMsgHeader_Get(*out, "KV-Operation", &op) == NATS_OK && op) {
        natsMsg_Destroy(*out); /* DEL or PURGE: no value */
        *out = NULL;
    }
    return s;
}

static void chunk_key(char *key, size_t cap, uint32_t k, uint64_t epoch, uint64_t generation,
                      uint32_t i)
{
    snprintf(key, cap, "p%u.%" PRIu64 ".%u.%u", (unsigned)k, epoch, (unsigned)(generation % 2),
             (unsigned)i);
}

static void manifest_key(char *key, size_t cap, uint32_t k)
{
    tally_fleet_name(key, cap, "p", k);
}

/* The manifest's value: the manifest, then the state when it is inline. */
static uint8_t *manifest_value(const td_ckpt_manifest_t *m, const uint8_t *state, size_t *len)
{
    size_t extra = m->chunks == 0 ? (size_t)m->state_len : 0, size = td_ckpt_manifest_size(m);
    uint8_t *v = malloc(TD_CKPT_MANIFEST_SIZE_SINCE + extra + 1);
    if (!v)
        return NULL;
    td_ckpt_manifest_encode(m, v);
    if (extra)
        memcpy(v + size, state, extra);
    *len = size + extra;
    return v;
}

/* Loads the state a manifest (value v of vlen bytes) names. */
static td_err_t load_state(jsCtx *js, uint32_t k, const td_ckpt_manifest_t *m, const uint8_t *v,
                           size_t vlen, uint8_t **state, size_t *len, char *msg, size_t cap)
{
    *state = NULL;
    *len = 0;
    if (m->state_len == 0)
        return TD_OK;
    uint8_t *buf = malloc((size_t)m->state_len);
    if (!buf) {
        snprintf(msg, cap, "out of memory for a %" PRIu64 "-byte checkpoint", m->state_len);
        return TD_ERR_NOMEM;
    }
    size_t at = 0;
    if (m->chunks == 0) {
        size_t size = td_ckpt_manifest_size(m);
        memcpy(buf, v + size, vlen - size);
        at = vlen - size;
    }
    for (uint32_t i = 0; i < m->chunks; i++) {
        char key[96];
        chunk_key(key, sizeof key, k, m->chunk_epoch, m->generation, i);
        natsMsg *e = NULL;
        natsStatus s = leader_get(js, key, &e);
        size_t n = e ? (size_t)natsMsg_GetDataLength(e) : 0;
        if (!e || at + n > m->state_len) {
            snprintf(msg, cap, "checkpoint chunk %s: %s", key,
                     s != NATS_OK ? td_nats_last_error(s)
                     : e          ? "longer than the manifest says"
                                  : "missing");
            natsMsg_Destroy(e);
            free(buf);
            return s == NATS_OK ? TD_ERR_CORRUPT : TD_ERR_LIBRARY;
        }
        memcpy(buf + at, natsMsg_GetData(e), n);
        at += n;
        natsMsg_Destroy(e);
    }
    if (at != m->state_len || crc_of(buf, at) != m->crc) {
        snprintf(msg, cap, "checkpoint of partition %u: %s", (unsigned)k,
                 at != m->state_len ? "chunks shorter than the manifest says" : "CRC mismatch");
        free(buf);
        return TD_ERR_CORRUPT;
    }
    *state = buf;
    *len = at;
    return TD_OK;
}

/* The manifest of partition k, from the leader: *e (NULL when there is none). */
static td_err_t get_manifest(jsCtx *js, uint32_t k, natsMsg **e, char *msg, size_t cap)
{
    char key[16];
    manifest_key(key, sizeof key, k);
    natsStatus s = leader_get(js, key, e);
    if (s != NATS_OK) {
        snprintf(msg, cap, "reading checkpoint %s: %s", key, td_nats_last_error(s));
        return TD_ERR_LIBRARY;
    }
    return TD_OK;
}

/* After a failed compare-and-set of value (len bytes) on the manifest, which c knew at
 * revision expected: fenced (another owner's manifest there), a NATS failure, our own write
 * after all, or an earlier write of ours. Our own write: the server applied it but its answer
 * was lost (a loaded server; a reconnect, after a pause past the server's write deadline), and
 * the manifest there is, byte for byte, the one written (its generation and epoch are this
 * owner's alone): *written is then its revision, and the write is committed. An earlier write of
 * ours: a previous write whose answer was lost and whose read-back failed too landed after all
 * (the manifest there has this owner's epoch and member, which no other owner writes: a take
 * fences with its own epoch), so nobody else wrote since: *mine is its revision, to try again
 * on. */
static td_err_t after_failed_cas(td_ckpt_t *c, uint64_t expected, const uint8_t *value, size_t len,
                                 natsStatus s, uint64_t *written, uint64_t *mine, bool *fenced,
                                 char *msg, size_t cap)
{
    natsMsg *e = NULL;
    td_err_t err = get_manifest(c->js, c->k, &e, msg, cap);
    if (err != TD_OK)
        return err;
    uint64_t now = e ? natsMsg_GetSequence(e) : 0;
    bool same = e && now != expected && (size_t)natsMsg_GetDataLength(e) == len &&
                memcmp(natsMsg_GetData(e), value, len) == 0;
    td_ckpt_manifest_t there;
    char why[128];
    bool earlier = e && !same && now != expected &&
                   td_ckpt_manifest_decode((const uint8_t *)natsMsg_GetData(e),
                                           (size_t)natsMsg_GetDataLength(e), &there, why,
                                           sizeof why) == TD_OK &&
                   there.epoch == c->epoch && strcmp(there.member, c->member) == 0;
    natsMsg_Destroy(e);
    if (same) {
        *written = now;
        return TD_OK;
    }
    if (earlier) {
        *mine = now;
        return TD_OK;
    }
    if (now != expected) {
        *fenced = true;
        snprintf(msg, cap,
                 "checkpoint of partition %u was written by another worker (revision %" PRIu64
                 ", this one knew %" PRIu64 ")",
                 (unsigned)c->k, now, expected);
        return TD_OK;
    }
    snprintf(msg, cap, "writing checkpoint of partition %u: %s", (unsigned)c->k,
             td_nats_last_error(s));
    return TD_ERR_LIBRARY;
}

/* kvStore_Update on expected, or kvStore_Create at 0: the new revision in *rev. */
static natsStatus put_manifest(kvStore *kv, const char *key, uint64_t expected,
                               const uint8_t *value, size_t len, uint64_t *rev)
{
    return expected ? kvStore_Update(rev, kv, key, value, (int)len, expected)
                    : kvStore_Create(rev, kv, key, value, (int)len);
}

/* Writes value at the manifest key by compare-and-set on expected (0: create); once more on the
 * revision of an earlier write of ours found there (after_failed_cas). */
static td_err_t cas_manifest(td_ckpt_t *c, uint64_t expected, const uint8_t *value, size_t len,
                             bool *fenced, char *msg, size_t cap)
{
    char key[16];
    manifest_key(key, sizeof key, c->k);
    uint64_t rev = 0, mine = 0;
    natsStatus s = put_manifest(c->kv, key, expected, value, len, &rev);
    td_err_t err =
        s == NATS_OK ? TD_OK
                     : after_failed_cas(c, expected, value, len, s, &rev, &mine, fenced, msg, cap);
    if (err == TD_OK && mine) {
        expected = mine;
        s = put_manifest(c->kv, key, expected, value, len, &rev);
        mine = 0;
        err = s == NATS_OK
                  ? TD_OK
                  : after_failed_cas(c, expected, value, len, s, &rev, &mine, fenced, msg, cap);
        if (err == TD_OK && mine) { /* moved again under us: not an outcome to loop on */
            snprintf(msg, cap, "writing checkpoint of partition %u: the manifest moved twice",
                     (unsigned)c->k);
            err = TD_ERR_LIBRARY;
        }
    }
    if (err == TD_OK && !*fenced)
        c->revision = rev;
    return err;
}

td_err_t td_ckpt_take(td_ckpt_t *c, jsCtx *js, kvStore *kv, uint32_t k, const char *member,
                      uint64_t epoch, uint8_t **state, size_t *len, bool *fenced, char *msg,
                      size_t cap)
{
    memset(c, 0, sizeof *c);
    c->js = js;
    c->kv = kv;
    c->k = k;
    c->epoch = epoch;
    snprintf(c->member, sizeof c->member, "%s", member);
    *state = NULL;
    *len = 0;
    *fenced = false;
    natsMsg *e = NULL;
    td_err_t err = get_manifest(js, k, &e, msg, cap);
    if (err != TD_OK)
        return err;
    const uint8_t *v = e ? (const uint8_t *)natsMsg_GetData(e) : NULL;
    size_t vlen = e ? (size_t)natsMsg_GetDataLength(e) : 0;
    uint64_t expected = e ? natsMsg_GetSequence(e) : 0;
    td_ckpt_manifest_t m = {.crc = crc_of(NULL, 0)};
    if (e && (err = td_ckpt_manifest_decode(v, vlen, &m, msg, cap)) != TD_OK)
        goto out;
    /* Load first (the chunks are the previous owner's, under its epoch), then fence: if the
     * fence fails nothing is used, and if it succeeds nobody can have moved the manifest. */
    if ((err = load_state(js, k, &m, v, vlen, state, len, msg, cap)) != TD_OK)
        goto out;
    td_ckpt_manifest_t fenced_m = m;
    fenced_m.epoch = epoch;
    /* A take ends a cl_since: its state may hold changes in no record (a dead owner's writes
     * whose records were never stored), which this owner may answer (`duplicate`) with no record,
     * so no copy started before it may run on across it (PROTOCOL.md §13 "Standbys"). */
    fenced_m.cl_since_epoch = fenced_m.cl_since_generation = 0;
    snprintf(fenced_m.member, sizeof fenced_m.member, "%s", member);
    size_t flen = 0;
    uint8_t *fv = fenced_m.chunks ? manifest_value(&fenced_m, NULL, &flen)
                                  : manifest_value(&fenced_m, *state, &flen);
    if (!fv) {
        err = TD_ERR_NOMEM;
        goto out;
    }
    err = cas_manifest(c, expected, fv, flen, fenced, msg, cap);
    free(fv);
    c->cur = m;
out:
    natsMsg_Destroy(e);
    if (err != TD_OK || *fenced) {
        free(*state);
        *state = NULL;
        *len = 0;
    }
    return err;
}

/* Removes partition k's chunk keys of every epoch but keep_epoch (a predecessor's, which no
 * manifest names any more). Failures only leave garbage: not a failed write (td_ckpt_write). */
static td_err_t purge_other_epochs(kvStore *kv, uint32_t k, uint64_t keep_epoch, char *msg,
                                   size_t cap)
{
    char filter[16], mine[48], **keys = NULL;
    size_t n = 0;
    snprintf(filter, sizeof filter, "p%u.>", (unsigned)k);
    td_err_t err = td_nats_kv_keys(kv, filter, &keys, &n, msg, cap);
    if (err != TD_OK)
        return err;
    natsStatus s = NATS_OK;
    snprintf(mine, sizeof mine, "p%u.%" PRIu64 ".", (unsigned)k, keep_epoch);
    for (size_t i = 0; i < n && s == NATS_OK; i++)
        if (strncmp(keys[i], mine, strlen(mine)) != 0)
            s = kvStore_Purge(kv, keys[i], NULL);
    td_nats_kv_keys_free(keys, n);
    if (s != NATS_OK) {
        snprintf(msg, cap, "removing old checkpoint chunks: %s", td_nats_last_error(s));
        return TD_ERR_LIBRARY;
    }
    return TD_OK;
}

/* Writes the chunks of m (its chunk_epoch and generation) from state. */
static td_err_t put_chunks(td_ckpt_t *c, const td_ckpt_manifest_t *m, const uint8_t *state,
                           char *msg, size_t cap)
{
    for (uint32_t i = 0; i < m->chunks; i++) {
        size_t off = (size_t)i * TD_CKPT_CHUNK_BYTES;
        size_t n = m->state_len - off < TD_CKPT_CHUNK_BYTES ? (size_t)m->state_len - off
                                                            : TD_CKPT_CHUNK_BYTES;
        char key[96];
        chunk_key(key, sizeof key, c->k, m->chunk_epoch, m->generation, i);
        uint64_t rev = 0;
        natsStatus s = kvStore_Put(&rev, c->kv, key, state + off, (int)n);
        if (s != NATS_OK) {
            snprintf(msg, cap, "writing checkpoint chunk %s: %s", key, td_nats_last_error(s));
            return TD_ERR_LIBRARY;
        }
    }
    return TD_OK;
}

td_err_t td_ckpt_write(td_ckpt_t *c, uint64_t applied_seq, const uint8_t *state, size_t len,
                       bool *fenced, char *msg, size_t cap)
{
    *fenced = false;
    td_ckpt_manifest_t m = {
        .applied_seq = applied_seq,
        .epoch = c->epoch,
        .generation = c->cur.generation + 1,
        .state_len = len,
        .chunks = len <= INLINE_MAX
                      ? 0
                      : (uint32_t)((len + TD_CKPT_CHUNK_BYTES - 1) / TD_CKPT_CHUNK_BYTES),
        .crc = crc_of(state, len),
        .chunk_epoch = c->epoch,
        .cl_seq = c->cl_seq,
        .cl_since_epoch = c->since_epoch,
        .cl_since_generation = c->since_generation};
    snprintf(m.member, sizeof m.member, "%s", c->member);
    td_err_t err = put_chunks(c, &m, state, msg, cap);
    if (err != TD_OK)
        return err;
    size_t vlen = 0;
    uint8_t *v = manifest_value(&m, state, &vlen);
    if (!v) {
        snprintf(msg, cap, "out of memory");
        return TD_ERR_NOMEM;
    }
    err = cas_manifest(c, c->revision, v, vlen, fenced, msg, cap);
    free(v);
    if (err != TD_OK || *fenced)
        return err;
    c->cur = m;
    /* Committed. The listing this needs is the slowest call here (a consumer made on the
     * stream): on a loaded cluster it can time out, which must not pass for a failed write. It
     * is not tried again: each try can hold the fleet thread for the listing's timeout, and the
     * next owner's first write removes what is left. */
    if (!c->cleaned) {
        c->cleaned = true;
        if (purge_other_epochs(c->kv, c->k, c->epoch, msg, cap) != TD_OK)
            return TD_OK; /* msg says why */
    }
    if (cap)
        msg[0] = '\0';
    return TD_OK;
}

td_err_t td_ckpt_read(jsCtx *js, uint32_t k, td_ckpt_manifest_t *m, uint8_t **state, size_t *len,
                      char *msg, size_t cap)
{
    natsMsg *e = NULL;
    *state = NULL;
    *len = 0;
    td_err_t err = get_manifest(js, k, &e, msg, cap);
    if (err != TD_OK)
        return err;
    if (!e) {
        snprintf(msg, cap, "partition %u has no checkpoint", (unsigned)k);
        return TD_ERR_CONFIG;
    }
    const uint8_t *v = (const uint8_t *)natsMsg_GetData(e);
    size_t vlen = (size_t)natsMsg_GetDataLength(e);
    err = td_ckpt_manifest_decode(v, vlen, m, msg, cap);
    if (err == TD_OK)
        err = load_state(js, k, m, v, vlen, state, len, msg, cap);
    natsMsg_Destroy(e);
    return err;
}
