/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_fleet.c — the worker's coordination (daemon/nats/) against a real 3-node JetStream
 * cluster (PROTOCOL.md §13):
 *   - leases: one holder at a time; renewal by compare-and-set; expiry on TTL, and the holder's
 *     own clock says "expired" before the server lets another worker take it; a stale release
 *     cannot delete the successor's lease; when a key runs out, as a waiting worker reads it;
 *   - checkpoints: a new owner's take fences the old one (its next write fails, nothing of it
 *     committed); round trips inline and chunked (5 MiB); the first write of an owner removes
 *     its predecessor's chunks; a damaged chunk is caught by the CRC;
 *   - the durable consumer: recreated at a checkpoint's sequence + 1 it delivers from there at
 *     once; acknowledgement confirmed, nothing removed; a bound subscription that goes
 *     away leaves the consumer in place.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <nats/nats.h>
#include <pthread.h>
#include <unistd.h>

#include "harness.h"
#include "nats_cluster.h"
#include "tally_fleet.h"
#include "td_nats_ckpt.h"
#include "td_nats_consumer.h"
#include "td_nats_js.h"
#include "td_nats_lease.h"

#define PARTITIONS 4
#define TTL_MS 2000

#define cluster tn_suite
#define nc tn_suite_nc
#define js tn_suite_js
static kvStore *leases, *ckpts;
static char msg[512];

/* Two users: `all`, the test's, and `nolist`, who may not make consumers, so it cannot list a
 * bucket's keys (test_ckpt_purge_failure_is_not_a_failed_write). */
static const char users[] =
    "authorization { users = [\n"
    "  { user: all, password: all }\n"
    "  { user: nolist, password: nolist,\n"
    "    permissions: { publish: { allow: \">\", deny: \"$JS.API.CONSUMER.>\" } } }\n"
    "] }";

static int setup(void **state)
{
    (void)state;
    tn_options_t o = {.extra_conf = users, .user = "all", .password = "all"};
    if (tn_cluster_start(&cluster, 3, &o, 30000) != 0 || tn_connect(&cluster, &nc, &js) != 0)
        return -1;
    td_nats_layout_t l = {.partitions = PARTITIONS,
                          .replicas = 3,
                          .partition_max_bytes = 64ll << 20,
                          .partition_max_age_ms = 3600 * 1000,
                          .lease_ttl_ms = TTL_MS,
                          .max_msg_size = (int32_t)natsConnection_GetMaxPayload(nc)};
    td_err_t err = TD_ERR_LIBRARY;
    for (int i = 0; i < 50 && err != TD_OK; i++) /* R3 needs the 3 peers known: retry a bit */
        if ((err = td_nats_fleet_ensure(js, &l, msg, sizeof msg)) != TD_OK)
            th_sleep_ms(200);
    if (err != TD_OK) {
        fprintf(stderr, "fleet: %s\n", msg);
        return -1;
    }
    if (td_nats_kv_open(js, TALLY_NATS_BUCKET_LEASES, TTL_MS, 3, &leases, msg, sizeof msg) ||
        td_nats_kv_open(js, TALLY_NATS_BUCKET_CKPT, 0, 3, &ckpts, msg, sizeof msg))
        return -1;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    kvStore_Destroy(leases);
    kvStore_Destroy(ckpts);
    return tn_suite_teardown();
}

/* The lease's holder is `who`. A KV read may be a direct get that a replica answers before it
 * has applied the last write, so a different answer is read again for up to 30 s before it
 * fails: seen under ASan on the 2-core box, B's release applied and a read still answering "B".
 * The product decides by compare-and-set, never by such a read. */
static void holder_is(uint32_t k, const char *who)
{
    char holder[80];
    for (int waited = 0;; waited += 50) {
        assert_int_equal(td_lease_holder(leases, k, holder, sizeof holder, msg, sizeof msg), TD_OK);
        if (strcmp(holder, who) == 0 || waited >= 30000)
            break;
        th_sleep_ms(50);
    }
    assert_string_equal(holder, who);
}

/* Whether the last write to partition k's lease key, as the bucket stream's leader has it
 * (js_GetLastMsg, which only the leader answers), was a delete: a release, which leaves a marker,
 * as an expiry does not. */
static bool released_on_leader(uint32_t k)
{
    char subject[64];
    snprintf(subject, sizeof subject, "$KV.%s.p%u", TALLY_NATS_BUCKET_LEASES, (unsigned)k);
    natsMsg *m = NULL;
    jsErrCode jerr = 0;
    const char *op = NULL;
    natsStatus s = js_GetLastMsg(&m, js, "KV_" TALLY_NATS_BUCKET_LEASES, subject, NULL, &jerr);
    bool deleted = s == NATS_OK && natsMsgHeader_Get(m, "KV-Operation", &op) == NATS_OK && op &&
                   strcmp(op, "DEL") == 0;
    natsMsg_Destroy(m);
    return deleted;
}

/* member takes partition 0's lease, trying as a worker does until its create succeeds: the
 * stream's leader decides a create, but a read (a direct get, which any replica answers, and
 * which libnats's create makes too over a delete marker) may lag the leader. Fails after 30 s. */
static void take_when_free(const char *member, td_lease_t *l)
{
    bool taken = false;
    for (int64_t t0 = td_nats_now_ms(); !taken; th_sleep_ms(20)) {
        assert_true(td_nats_now_ms() - t0 < 30000);
        assert_int_equal(td_lease_acquire(leases, 0, member, TTL_MS, l, &taken, msg, sizeof msg),
                         TD_OK);
    }
}

static void test_lease_exclusive_and_expiry(void **state)
{
    (void)state;
    td_lease_t a = {0}, b = {0};
    bool taken = false, lost = false;
    assert_int_equal(td_lease_acquire(leases, 0, "A", TTL_MS, &a, &taken, msg, sizeof msg), TD_OK);
    assert_true(taken);
    assert_true(td_lease_valid(&a, td_nats_now_ms()));
    assert_int_equal(td_lease_acquire(leases, 0, "B", TTL_MS, &b, &taken, msg, sizeof msg), TD_OK);
    assert_false(taken);
    holder_is(0, "A");
    /* When the key runs out, on this clock (what a worker waiting for it looks again at): TTL
     * after the server's time of A's write, which is after A sent it and before it heard back
     * (the same host's clocks; a second either way for a loaded box). */
    int64_t expiry = 0;
    assert_int_equal(td_kv_expiry(leases, "p0", TTL_MS, &expiry), TD_OK);
    assert_true(expiry >= a.valid_until_ms - 1000);
    assert_true(expiry <= td_nats_now_ms() + TTL_MS + 1000);
    uint64_t first = a.revision;
    assert_int_equal(td_lease_renew(leases, 0, "A", TTL_MS, &a, &lost, msg, sizeof msg), TD_OK);
    assert_false(lost);
    assert_true(a.revision > first);
    /* B pretending to hold A's old revision: the compare-and-set fails, B learns it lost. */
    b.revision = first;
    assert_int_equal(td_lease_renew(leases, 0, "B", TTL_MS, &b, &lost, msg, sizeof msg), TD_OK);
    assert_true(lost);
    holder_is(0, "A");

    /* A stops renewing: the key expires and B's create succeeds; A's own clock said so first.
     * B tries as a worker does, by the create the stream's leader decides: a read may be served
     * by a replica that had not applied A's renewal when A's create expired there, and say the
     * key is free while the leader still holds it (seen once under ASan on the 2-core box). */
    take_when_free("B", &b);
    assert_false(td_lease_valid(&a, td_nats_now_ms()));
    print_message("lease taken %lld ms after its last renewal\n",
                  (long long)(td_nats_now_ms() - (a.valid_until_ms - TTL_MS)));
    holder_is(0, "B");
    assert_int_equal(td_lease_renew(leases, 0, "A", TTL_MS, &a, &lost, msg, sizeof msg), TD_OK);
    assert_true(lost);
    assert_false(td_lease_valid(&a, td_nats_now_ms()));

    /* B releases (a delete, not the TTL); A takes it; B's stale release (its old revision)
     * deletes nothing: the leader's last write to the key is still A's. */
    td_lease_t stale_b = b;
    assert_int_equal(td_lease_release(js, 0, &b, msg, sizeof msg), TD_OK);
    assert_true(released_on_leader(0));
    take_when_free("A", &a);
    assert_int_equal(td_lease_release(js, 0, &stale_b, msg, sizeof msg), TD_OK);
    assert_false(released_on_leader(0));
    holder_is(0, "A");
    assert_int_equal(td_lease_release(js, 0, &a, msg, sizeof msg), TD_OK);
    /* Released: no key, nothing to wait for (read from the leader's view: a replica may lag). */
    for (int64_t t0 = td_nats_now_ms(); expiry != 0; th_sleep_ms(20)) {
        assert_true(td_nats_now_ms() - t0 < 30000);
        assert_int_equal(td_kv_expiry(leases, "p0", TTL_MS, &expiry), TD_OK);
    }
}

static void read_back(uint32_t k, uint64_t seq, const char *member, const void *state, size_t len)
{
    td_ckpt_manifest_t m;
    uint8_t *got = NULL;
    size_t got_len = 0;
    assert_int_equal(td_ckpt_read(js, k, &m, &got, &got_len, msg, sizeof msg), TD_OK);
    assert_int_equal(m.applied_seq, seq);
    assert_string_equal(m.member, member);
    assert_int_equal(got_len, len);
    if (len)
        assert_memory_equal(got, state, len);
    free(got);
}

static void test_ckpt_fencing(void **state)
{
    (void)state;
    td_ckpt_t a, b;
    uint8_t *st = NULL;
    size_t len = 0;
    bool fenced = true;
    assert_int_equal(td_ckpt_take(&a, js, ckpts, 1, "A", 100, &st, &len, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_false(fenced);
    assert_null(st);
    assert_int_equal(td_ckpt_write(&a, 5, (const uint8_t *)"hello", 5, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_false(fenced);
    read_back(1, 5, "A", "hello", 5);

    /* B takes over (A paused past its lease): B loads A's state and fences A. */
    assert_int_equal(td_ckpt_take(&b, js, ckpts, 1, "B", 200, &st, &len, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_false(fenced);
    assert_int_equal(len, 5);
    assert_memory_equal(st, "hello", 5);
    assert_int_equal(b.cur.applied_seq, 5);
    free(st);
    read_back(1, 5, "B", "hello", 5); /* the fence: same state, the new owner's name */

    /* A wakes and writes: refused, nothing of it committed. */
    assert_int_equal(td_ckpt_write(&a, 6, (const uint8_t *)"stale", 5, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_true(fenced);
    read_back(1, 5, "B", "hello", 5);
    assert_int_equal(td_ckpt_write(&b, 7, (const uint8_t *)"world", 5, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_false(fenced);
    read_back(1, 7, "B", "world", 5);
    /* A's late take, knowing nothing newer, still loads B's checkpoint (it fences B in turn). */
}

static size_t count_keys(const char *prefix)
{
    kvKeysList list = {0};
    if (kvStore_Keys(&list, ckpts, NULL) != NATS_OK)
        return 0;
    size_t n = 0;
    for (int i = 0; i < list.Count; i++)
        n += strncmp(list.Keys[i], prefix, strlen(prefix)) == 0;
    kvKeysList_Destroy(&list);
    return n;
}

/* count_keys(prefix) once it equals want, within 10 s (else its last value): a purge whose
 * PubAck timed out on a loaded box may still land a moment later. */
static size_t count_keys_settled(const char *prefix, size_t want)
{
    size_t n = count_keys(prefix);
    for (int64_t t0 = th_now_ms(); n != want && th_now_ms() - t0 < 10000; n = count_keys(prefix))
        th_sleep_ms(100);
    return n;
}

/* member takes partition k's checkpoint under epoch, then writes len bytes of state as of seq,
 * which must take `chunks` chunk keys. */
static void write_chunked(td_ckpt_t *c, uint32_t k, const char *member, uint64_t epoch,
                          uint64_t seq, const uint8_t *state, size_t len, uint32_t chunks)
{
    uint8_t *st = NULL;
    size_t got = 0;
    bool fenced = true;
    assert_int_equal(
        td_ckpt_take(c, js, ckpts, k, member, epoch, &st, &got, &fenced, msg, sizeof msg), TD_OK);
    assert_false(fenced);
    free(st);
    assert_int_equal(td_ckpt_write(c, seq, state, len, &fenced, msg, sizeof msg), TD_OK);
    assert_false(fenced);
    assert_int_equal(c->cur.chunks, chunks);
}

static void test_ckpt_large_chunked(void **state)
{
    (void)state;
    size_t big_len = (5u << 20) + 123;
    uint8_t *big = malloc(big_len);
    assert_non_null(big);
    for (size_t i = 0; i < big_len; i++)
        big[i] = (uint8_t)(th_rand() >> 24);
    td_ckpt_t b, c;
    uint8_t *st = NULL;
    size_t len = 0;
    bool fenced = true;
    write_chunked(&b, 2, "B", 300, 40, big, big_len, 6); /* 5 MiB + 123 in 1 MiB - 4 KiB */
    read_back(2, 40, "B", big, big_len);
    assert_int_equal(count_keys_settled("p2.300.", 6), 6);

    /* A new owner loads it whole, and its first write removes B's chunks. */
    assert_int_equal(td_ckpt_take(&c, js, ckpts, 2, "C", 400, &st, &len, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_int_equal(len, big_len);
    assert_memory_equal(st, big, big_len);
    free(st);
    assert_int_equal(td_ckpt_write(&c, 41, big, 1000, &fenced, msg, sizeof msg), TD_OK);
    assert_int_equal(c.cur.chunks, 0); /* inline */
    read_back(2, 41, "C", big, 1000);
    assert_int_equal(count_keys_settled("p2.300.", 0), 0);
    /* Chunked again, twice: the second write goes to the other slot, the first stays intact
     * until the manifest names the second. */
    assert_int_equal(td_ckpt_write(&c, 42, big, big_len, &fenced, msg, sizeof msg), TD_OK);
    big[7] ^= 1;
    assert_int_equal(td_ckpt_write(&c, 43, big, big_len, &fenced, msg, sizeof msg), TD_OK);
    read_back(2, 43, "C", big, big_len);
    assert_int_equal(count_keys_settled("p2.400.", 12), 12);

    /* A damaged chunk: the CRC catches it. */
    char key[64];
    snprintf(key, sizeof key, "p2.400.%u.3", (unsigned)(c.cur.generation % 2));
    uint64_t rev = 0;
    assert_int_equal(kvStore_Put(&rev, ckpts, key, big, (int)TD_CKPT_CHUNK_BYTES), NATS_OK);
    td_ckpt_manifest_t m;
    assert_int_equal(td_ckpt_read(js, 2, &m, &st, &len, msg, sizeof msg), TD_ERR_CORRUPT);
    assert_non_null(strstr(msg, "CRC"));
    assert_null(st);
    free(big);
}

/* kv of bucket TALLY_CKPT on a connection of its own as `nolist` (natsConnection_Destroy
 * *c after kvStore_Destroy). */
static kvStore *ckpts_as_nolist(natsConnection **c, jsCtx **j)
{
    char url[96];
    const char *hostport = strstr(cluster.node[0].url, "//") + 2;
    snprintf(url, sizeof url, "nats://nolist:nolist@%s", hostport);
    kvStore *kv = NULL;
    assert_int_equal(natsConnection_ConnectTo(c, url), NATS_OK);
    assert_int_equal(natsConnection_JetStream(j, *c, NULL), NATS_OK);
    assert_int_equal(js_KeyValue(&kv, *j, TALLY_NATS_BUCKET_CKPT), NATS_OK);
    return kv;
}

/* An owner's first write removes its predecessor's chunks, which needs the bucket's keys listed
 * (a consumer made on the stream, the slowest call of a write: it timed out on the loaded box).
 * When that fails the checkpoint is written all the same (TD_OK, not fenced, read back; msg says
 * why), the chunks stay, and the next owner's first write removes them. Here the second owner's
 * connection may not make consumers at all. */
static void test_ckpt_purge_failure_is_not_a_failed_write(void **state)
{
    (void)state;
    size_t big_len = (2u << 20) + 5;
    uint8_t *big = calloc(1, big_len);
    assert_non_null(big);
    td_ckpt_t a, b, c;
    write_chunked(&a, 3, "A", 500, 10, big, big_len, 3);
    assert_int_equal(count_keys_settled("p3.500.", 3), 3);
    uint8_t *st = NULL;
    size_t len = 0;
    bool fenced = true;

    natsConnection *conn = NULL;
    jsCtx *j = NULL;
    kvStore *kv = ckpts_as_nolist(&conn, &j);
    assert_int_equal(td_ckpt_take(&b, j, kv, 3, "B", 600, &st, &len, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_false(fenced);
    assert_int_equal(len, big_len);
    free(st);
    assert_int_equal(td_ckpt_write(&b, 11, (const uint8_t *)"small", 5, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_false(fenced);
    print_message("the removal failed: %s\n", msg);
    assert_non_null(strstr(msg, "listing the keys of " TALLY_NATS_BUCKET_CKPT));
    read_back(3, 11, "B", "small", 5);
    assert_int_equal(count_keys("p3.500."), 3);
    assert_int_equal(td_ckpt_write(&b, 12, (const uint8_t *)"again", 5, &fenced, msg, sizeof msg),
                     TD_OK);
    assert_string_equal(msg, ""); /* not tried again */
    read_back(3, 12, "B", "again", 5);
    kvStore_Destroy(kv);
    jsCtx_Destroy(j);
    natsConnection_Destroy(conn);

    /* The next owner's first write removes them. */
    write_chunked(&c, 3, "C", 700, 13, big, big_len, 3);
    assert_string_equal(msg, "");
    assert_int_equal(count_keys_settled("p3.500.", 0), 0);
    read_back(3, 13, "C", big, big_len);
    free(big);
}

/* m (3 bytes of state inline) encoded as a manifest of size bytes and version, decoded again;
 * one byte less of state, or of the manifest, is refused. */
static td_ckpt_manifest_t encoded_again(const td_ckpt_manifest_t *m, size_t size, unsigned version)
{
    uint8_t v[TD_CKPT_MANIFEST_SIZE_SINCE + 3];
    td_ckpt_manifest_t out;
    assert_int_equal(td_ckpt_manifest_size(m), size);
    td_ckpt_manifest_encode(m, v);
    assert_int_equal(v[4], version);
    assert_int_equal(td_ckpt_manifest_decode(v, size + 3, &out, msg, sizeof msg), TD_OK);
    td_ckpt_manifest_t shorter;
    assert_int_equal(td_ckpt_manifest_decode(v, size + 2, &shorter, msg, sizeof msg),
                     TD_ERR_CORRUPT); /* inline length differs */
    assert_int_equal(td_ckpt_manifest_decode(v, size - 1, &shorter, msg, sizeof msg),
                     TD_ERR_CORRUPT); /* too short for its version */
    return out;
}

static void test_manifest_decode_rejects(void **state)
{
    (void)state;
    td_ckpt_manifest_t m = {
        .applied_seq = 9, .epoch = 1, .generation = 2, .state_len = 3, .crc = 4, .member = "w1"};
    uint8_t v[TD_CKPT_MANIFEST_SIZE + 3];
    td_ckpt_manifest_encode(&m, v);
    td_ckpt_manifest_t out;
    assert_int_equal(td_ckpt_manifest_decode(v, sizeof v, &out, msg, sizeof msg), TD_OK);
    assert_int_equal(out.applied_seq, 9);
    assert_string_equal(out.member, "w1");
    assert_int_equal(td_ckpt_manifest_decode(v, sizeof v - 1, &out, msg, sizeof msg),
                     TD_ERR_CORRUPT); /* inline length differs */
    v[5] = 1;
    assert_int_equal(td_ckpt_manifest_decode(v, sizeof v, &out, msg, sizeof msg), TD_ERR_CORRUPT);
    v[5] = 0;
    v[0] = 'X';
    assert_int_equal(td_ckpt_manifest_decode(v, sizeof v, &out, msg, sizeof msg), TD_ERR_CORRUPT);
    v[0] = TD_CKPT_MAGIC[0];
    /* A header of another version, a reserved byte set, one byte short of a header: not one. */
    char not_one[64];
    snprintf(not_one, sizeof not_one, "not a version-%u, %u or %u checkpoint manifest (%zu bytes)",
             TD_CKPT_VERSION, TD_CKPT_VERSION_CL, TD_CKPT_VERSION_SINCE, sizeof v);
    for (int i = 4; i < 8; i++) {
        uint8_t was = v[i];
        v[i] = (uint8_t)(i == 4 ? TD_CKPT_VERSION + 1 : 1);
        assert_int_equal(td_ckpt_manifest_decode(v, sizeof v, &out, msg, sizeof msg),
                         TD_ERR_CORRUPT);
        assert_string_equal(msg, not_one);
        v[i] = was;
    }
    assert_int_equal(td_ckpt_manifest_decode(v, TD_CKPT_MANIFEST_SIZE - 1, &out, msg, sizeof msg),
                     TD_ERR_CORRUPT);
    /* A writer's id that no member could have; none at all is an older writer's, allowed. */
    m.member[0] = '.';
    td_ckpt_manifest_encode(&m, v);
    assert_int_equal(td_ckpt_manifest_decode(v, sizeof v, &out, msg, sizeof msg), TD_ERR_CORRUPT);
    m.member[0] = 0;
    td_ckpt_manifest_encode(&m, v);
    assert_int_equal(td_ckpt_manifest_decode(v, sizeof v, &out, msg, sizeof msg), TD_OK);
    assert_string_equal(out.member, "");
    /* Chunked: the count of chunks its state needs, and no inline state beside them. */
    uint8_t h[TD_CKPT_MANIFEST_SIZE];
    m.state_len = TD_CKPT_CHUNK_BYTES + 1;
    m.chunks = 2;
    td_ckpt_manifest_encode(&m, h);
    assert_int_equal(td_ckpt_manifest_decode(h, sizeof h, &out, msg, sizeof msg), TD_OK);
    assert_int_equal(out.chunks, 2);
    assert_int_equal(out.state_len, TD_CKPT_CHUNK_BYTES + 1);
    td_ckpt_manifest_encode(&m, v); /* and 3 bytes inline */
    assert_int_equal(td_ckpt_manifest_decode(v, sizeof v, &out, msg, sizeof msg), TD_ERR_CORRUPT);
    assert_string_equal(msg, "checkpoint manifest inconsistent: 1044481 bytes of state, 2 chunks, "
                             "3 inline");
    m.chunks = 1;
    td_ckpt_manifest_encode(&m, h);
    assert_int_equal(td_ckpt_manifest_decode(h, sizeof h, &out, msg, sizeof msg), TD_ERR_CORRUPT);
    /* Version 2 (direct = replicated): cl_seq after the 120 bytes, the inline state after it;
     * version 3 (a cl_since): its epoch and generation after cl_seq, the inline state after. */
    m = (td_ckpt_manifest_t){.applied_seq = 9,
                             .epoch = 1,
                             .generation = 2,
                             .state_len = 3,
                             .member = "w1",
                             .cl_seq = 77};
    out = encoded_again(&m, TD_CKPT_MANIFEST_SIZE_CL, TD_CKPT_VERSION_CL);
    assert_int_equal(out.cl_seq, 77);
    assert_int_equal(out.applied_seq, 9);
    assert_int_equal(out.cl_since_epoch, 0);
    m.cl_since_epoch = 5;
    m.cl_since_generation = 1;
    out = encoded_again(&m, TD_CKPT_MANIFEST_SIZE_SINCE, TD_CKPT_VERSION_SINCE);
    assert_int_equal(out.cl_seq, 77);
    assert_int_equal(out.cl_since_epoch, 5);
    assert_int_equal(out.cl_since_generation, 1);
    /* What it covers: a copy started from its base (generation 1, epoch 5) up to itself
     * (generation 2), under the base's epoch or a later one; not one before its base, one of an
     * earlier epoch (a manifest deleted and made again), one past it, nor anything without one. */
    assert_true(td_ckpt_since_covers(&m, 5, 1));
    assert_true(td_ckpt_since_covers(&m, 9, 2));
    assert_false(td_ckpt_since_covers(&m, 5, 0));
    assert_false(td_ckpt_since_covers(&m, 4, 1));
    assert_false(td_ckpt_since_covers(&m, 5, 3));
    m.cl_since_epoch = 0;
    assert_false(td_ckpt_since_covers(&m, 5, 1));
}

static void publish_n(uint32_t k, int n)
{
    char subject[48];
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, k, "anon");
    for (int i = 0; i < n; i++) {
        char data[16];
        int len = snprintf(data, sizeof data, "m%d", i);
        jsErrCode jerr = 0;
        assert_int_equal(js_Publish(NULL, js, subject, data, len, NULL, &jerr), NATS_OK);
    }
}

static uint64_t fetch_all(td_pull_t *sub, int expect, char (*acks)[256])
{
    natsMsgList list;
    uint64_t first = 0;
    int got = 0;
    for (int round = 0; round < 20 && got < expect; round++) {
        assert_int_equal(td_consumer_fetch(sub, 100, 0, 500, &list, msg, sizeof msg), TD_OK);
        for (int i = 0; i < list.Count; i++) {
            uint64_t seq = td_nats_msg_seq(list.Msgs[i]);
            if (!first)
                first = seq;
            assert_int_equal(seq, first + (uint64_t)got); /* in order, no gap */
            if (acks && seq <= 10)
                snprintf(acks[seq], 256, "%s", natsMsg_GetReply(list.Msgs[i]));
            got++;
        }
        natsMsgList_Destroy(&list);
    }
    assert_int_equal(got, expect);
    return first;
}

static void test_consumer_resume(void **state)
{
    (void)state;
    publish_n(3, 10);
    td_pull_t *sub = NULL;
    assert_int_equal(
        td_consumer_start(js, nc, "_INBOX.test.p3.100", 3, 100, 0, 1, 30000, &sub, msg, sizeof msg),
        TD_OK);
    static char acks[11][256];
    assert_int_equal(fetch_all(sub, 10, acks), 1);
    /* A checkpoint holding 1..6: each acknowledged, the last one confirmed. */
    for (int i = 1; i < 6; i++)
        assert_int_equal(natsConnection_PublishString(nc, acks[i], "+ACK"), NATS_OK);
    assert_int_equal(td_consumer_ack_sync(nc, acks[6], 5000, msg, sizeof msg), TD_OK);
    jsConsumerInfo *ci = NULL;
    jsErrCode jerr = 0;
    assert_int_equal(js_GetConsumerInfo(&ci, js, "TALLY_P3", "tally-p3-100-0", NULL, &jerr),
                     NATS_OK);
    assert_int_equal(ci->AckFloor.Stream, 6);
    jsConsumerInfo_Destroy(ci);
    /* The puller goes: the consumer stays. */
    td_pull_destroy(&sub);
    assert_int_equal(js_GetConsumerInfo(&ci, js, "TALLY_P3", "tally-p3-100-0", NULL, &jerr),
                     NATS_OK);
    jsConsumerInfo_Destroy(ci);

    /* A new owner whose checkpoint holds 1..6: from 7 at once (7..10 were delivered, not acked,
     * and would otherwise wait for the 30 s ack wait). */
    int64_t t0 = td_nats_now_ms();
    assert_int_equal(
        td_consumer_start(js, nc, "_INBOX.test.p3.200", 3, 200, 0, 7, 30000, &sub, msg, sizeof msg),
        TD_OK);
    assert_int_equal(fetch_all(sub, 4, NULL), 7);
    td_consumer_delete_others(js, sub); /* what the reader does after its first fetch */
    /* The previous owner's consumer is gone; the same name again, having delivered, is refused
     * (a create that timed out but happened must not be taken for a fresh one). */
    assert_int_equal(js_GetConsumerInfo(&ci, js, "TALLY_P3", "tally-p3-100-0", NULL, &jerr),
                     NATS_NOT_FOUND);
    td_pull_t *again = NULL;
    assert_int_equal(td_consumer_start(js, nc, "_INBOX.test.p3.200b", 3, 200, 0, 7, 30000, &again,
                                       msg, sizeof msg),
                     TD_ERR_LIBRARY);
    assert_null(again);
    assert_true(td_nats_now_ms() - t0 < 15000);
    /* Nothing more: a fetch comes back empty after its wait (not NATS's default 5 s). */
    natsMsgList list;
    t0 = td_nats_now_ms();
    assert_int_equal(td_consumer_fetch(sub, 100, 0, 200, &list, msg, sizeof msg), TD_OK);
    assert_int_equal(list.Count, 0);
    assert_true(td_nats_now_ms() - t0 < 4000);
    td_pull_destroy(&sub);
    /* Nothing was removed from the stream (the fleet never removes: td_nats_consumer.h). */
    jsStreamInfo *si = NULL;
    assert_int_equal(js_GetStreamInfo(&si, js, "TALLY_P3", NULL, &jerr), NATS_OK);
    assert_int_equal(si->State.Msgs, 10);
    jsStreamInfo_Destroy(si);
}

static void *publish_later(void *arg)
{
    (void)arg;
    usleep(300 * 1000);
    publish_n(2, 1);
    return NULL;
}

/* A fetch is not held for its whole batch (issue 32): what the consumer holds comes at once,
 * and when it holds nothing, the first message to come ends the wait. A pull held for its batch
 * waited out its expiry: the last messages of every backlog, and every message of a stream
 * slower than a batch a wait, came up to that late. */
static void test_fetch_takes_what_is_there(void **state)
{
    (void)state;
    publish_n(2, 3);
    td_pull_t *sub = NULL;
    assert_int_equal(
        td_consumer_start(js, nc, "_INBOX.test.p2.300", 2, 300, 0, 1, 30000, &sub, msg, sizeof msg),
        TD_OK);
    natsMsgList list;
    int64_t t0 = td_nats_now_ms();
    int got = 0;
    for (int pull = 0; pull < 3 && got < 3; pull++) { /* one pull, or a few */
        assert_int_equal(td_consumer_fetch(sub, 100, 0, 8000, &list, msg, sizeof msg), TD_OK);
        got += list.Count;
        natsMsgList_Destroy(&list);
    }
    assert_int_equal(got, 3);
    assert_true(td_nats_now_ms() - t0 < 4000); /* a pull's wait is 8 s */

    pthread_t later;
    assert_int_equal(pthread_create(&later, NULL, publish_later, NULL), 0);
    t0 = td_nats_now_ms();
    assert_int_equal(td_consumer_fetch(sub, 100, 0, 8000, &list, msg, sizeof msg), TD_OK);
    int64_t took = td_nats_now_ms() - t0;
    pthread_join(later, NULL);
    assert_int_equal(list.Count, 1);
    assert_int_equal(td_nats_msg_seq(list.Msgs[0]), 4);
    assert_true(took < 4000);
    natsMsgList_Destroy(&list);
    td_pull_destroy(&sub);
}

int main(void)
{
    if (tn_skip())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lease_exclusive_and_expiry),
        cmocka_unit_test(test_ckpt_fencing),
        cmocka_unit_test(test_ckpt_large_chunked),
        cmocka_unit_test(test_ckpt_purge_failure_is_not_a_failed_write),
        cmocka_unit_test(test_manifest_decode_rejects),
        cmocka_unit_test(test_consumer_resume),
        cmocka_unit_test(test_fetch_takes_what_is_there),
    };
    int failed = cmocka_run_group_tests(tests, setup, teardown);
    nats_Close(); /* libnats' threads and globals: gone before the leak check */
    return failed;
}
