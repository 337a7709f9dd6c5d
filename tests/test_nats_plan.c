/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_plan.c — the fleet's arithmetic without NATS (PROTOCOL.md §13): the partition of a
 * stream is exactly the table of test vectors in PROTOCOL.md (read from the document, so the two
 * cannot drift apart); the names; and rendezvous hashing of partitions over members: every
 * partition has exactly one owner, shares are balanced, a member that joins takes only the
 * partitions it now scores highest for (nothing moves between the others) and a member that
 * leaves gives up only its own; the member next in a partition's order (its standby) is the one
 * that owns it once its owner leaves.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "harness.h"
#include "tally_fleet.h"
#include "td_fleet_plan.h"

/* Every row of the test-vector table: | name | hash | P=8 | P=16 | P=1000 |. */
static void test_partition_vectors_match_protocol_md(void **state)
{
    (void)state;
    char *doc = th_slurp(TALLY_PROTOCOL_MD);
    assert_non_null(doc);
    const char *table = strstr(doc, "| name | FNV-1a-64 | P = 8 | P = 16 | P = 1000 |");
    assert_non_null(table);
    const char *line = strchr(table, '\n') + 1;
    line = strchr(line, '\n') + 1; /* the |---| row */
    int rows = 0;
    while (line[0] == '|') {
        char name[80] = "", hex[32] = "";
        unsigned p8, p16, p1000;
        const char *cell = line + 2;
        if (strncmp(cell, "(empty)", 7) != 0)
            assert_int_equal(sscanf(cell, "`%79[^`]`", name), 1);
        const char *rest = strchr(cell, '|');
        assert_int_equal(sscanf(rest, "| `%31[0-9a-f]` | %u | %u | %u |", hex, &p8, &p16, &p1000),
                         4);
        uint64_t h = strtoull(hex, NULL, 16);
        assert_true(tally_fnv1a64(name, strlen(name)) == h);
        assert_int_equal(tally_partition(name, strlen(name), 8), p8);
        assert_int_equal(tally_partition(name, strlen(name), 16), p16);
        assert_int_equal(tally_partition(name, strlen(name), 1000), p1000);
        rows++;
        line = strchr(line, '\n') + 1;
    }
    assert_int_equal(rows, 6);
    free(doc);
    /* The published FNV-1a 64 (not the daemon's table hash, whose basis differs). */
    assert_true(tally_fnv1a64("a", 1) == 0xaf63dc4c8601ec8cull);
    assert_int_equal(tally_partition("cam0", 4, 1), 0);
    assert_int_equal(tally_partition("cam0", 4, 0), 0);
}

static void test_names(void **state)
{
    (void)state;
    char buf[32];
    assert_int_equal(tally_fleet_name(buf, sizeof buf, TALLY_NATS_SUBJ_IN, 7), 10);
    assert_string_equal(buf, "tally.in.7");
    assert_int_equal(tally_fleet_name(buf, sizeof buf, TALLY_NATS_STREAM_PREFIX, 1023), 11);
    assert_string_equal(buf, "TALLY_P1023");
    assert_int_equal(tally_fleet_name(buf, 10, TALLY_NATS_SUBJ_IN, 7), 0); /* no room for NUL */
    assert_true(tally_fleet_member_id_valid("host-1_a"));
    assert_false(tally_fleet_member_id_valid(""));
    assert_false(tally_fleet_member_id_valid("a.b"));
    assert_false(tally_fleet_member_id_valid("a b"));
    char long_id[66];
    memset(long_id, 'x', 65);
    long_id[65] = 0;
    assert_false(tally_fleet_member_id_valid(long_id));
    long_id[64] = 0;
    assert_true(tally_fleet_member_id_valid(long_id));
}

/* The names that carry a publisher (PROTOCOL.md §13 "Security"): subjects end in the user, the
 * worker replies only into that user's inboxes, dedupe ids live in its namespace. */
static void test_user_names(void **state)
{
    (void)state;
    char buf[48];
    assert_int_equal(tally_fleet_subject(buf, sizeof buf, TALLY_NATS_SUBJ_IN, 3, "cam-1"), 16);
    assert_string_equal(buf, "tally.in.3.cam-1");
    assert_int_equal(tally_fleet_subject(buf, sizeof buf, TALLY_NATS_SUBJ_CTL, -1, "ana"), 13);
    assert_string_equal(buf, "tally.ctl.ana");
    assert_int_equal(tally_fleet_subject(buf, 16, TALLY_NATS_SUBJ_IN, 3, "cam-1"), 0);
    assert_string_equal(tally_fleet_subject_user("tally.in.3.cam-1"), "cam-1");
    assert_string_equal(tally_fleet_subject_user("tally.streams.a_b"), "a_b");
    assert_null(tally_fleet_subject_user("tally.in.3."));
    assert_null(tally_fleet_subject_user("tally.in.3.*"));
    assert_null(tally_fleet_subject_user("nodot"));
    const char *ok[] = {"_INBOX.cam1.x", "_INBOX.cam1.AbC.7"};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        assert_true(tally_fleet_reply_allowed(ok[i], "cam1"));
    const char *refused[] = {"_INBOX.cam2.x",       "_INBOX.cam1",
                             "_INBOX.cam1.",        "_INBOX.cam10.x",
                             "_INBOX.cam1.>",       "_INBOX.cam1.a.*",
                             "_INBOX.cam1.a b",     "_INBOX.cam1.a..b",
                             "_INBOX.cam1.a.",      "tally.watch.3",
                             "$KV.TALLY_LEASES.p3", "_INBOX.>",
                             "_inbox.cam1.x",       ""};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++)
        if (tally_fleet_reply_allowed(refused[i], "cam1"))
            fail_msg("reply subject '%s' allowed for cam1", refused[i]);
    assert_false(tally_fleet_reply_allowed(NULL, "cam1"));
    assert_false(tally_fleet_reply_allowed("_INBOX..x", ""));
    assert_true(tally_fleet_id_allowed("cam1.0a1b.7", "cam1"));
    assert_false(tally_fleet_id_allowed("cam2.0a1b.7", "cam1"));
    assert_false(tally_fleet_id_allowed("cam10.7", "cam1"));
    assert_false(tally_fleet_id_allowed("cam1.", "cam1"));
    assert_false(tally_fleet_id_allowed("cam1", "cam1"));
    assert_false(tally_fleet_id_allowed(NULL, "cam1"));
}

/* Tally-Owned (PROTOCOL.md §13 "Answers by request-reply"): the examples of PROTOCOL.md, a
 * round trip at every partition count's edge, and what a merge refuses without marking. */
static void test_owned_bitmap(void **state)
{
    (void)state;
    bool owned[9] = {true, true, true, true}, covered[9] = {false};
    char text[8];
    assert_int_equal(tally_fleet_owned_format(owned, 8, text, sizeof text), 2);
    assert_string_equal(text, "f0"); /* partitions 0-3: digit 0 */
    bool odd[4] = {false, true, false, true};
    assert_int_equal(tally_fleet_owned_format(odd, 4, text, sizeof text), 1);
    assert_string_equal(text, "a");
    owned[8] = true; /* 9 partitions: 3 digits, the last holding partition 8 alone */
    assert_int_equal(tally_fleet_owned_format(owned, 9, text, sizeof text), 3);
    assert_string_equal(text, "f01");
    assert_int_equal(tally_fleet_owned_format(owned, 9, text, 3), 0); /* no room for the NUL */
    assert_int_equal(tally_fleet_owned_merge("0f1", 9, covered), 5);
    assert_int_equal(tally_fleet_owned_merge("0f1", 9, covered), 0); /* each counted once */
    assert_int_equal(tally_fleet_owned_merge("f00", 9, covered), 4);
    for (int k = 0; k < 9; k++)
        assert_true(covered[k]);
    bool none[9] = {false};
    const char *refused[] = {"", "0f10", "0F1", "0g1", "0f2", "0f8", "0x"};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++)
        if (tally_fleet_owned_merge(refused[i], 9, none) != -1)
            fail_msg("Tally-Owned '%s' taken for 9 partitions", refused[i]);
    assert_int_equal(tally_fleet_owned_merge(NULL, 9, none), -1);
    for (int k = 0; k < 9; k++)
        assert_false(none[k]); /* nothing marked by a value refused */
    assert_int_equal(tally_fleet_owned_merge("1", 1, none), 1);
    assert_int_equal(tally_fleet_owned_merge("2", 1, none), -1); /* partition 1 of 1 */
}

#define P 64
#define MAXM 8

static void owners(const char *const *members, size_t n, int *owner_of)
{
    for (uint32_t k = 0; k < P; k++)
        owner_of[k] = td_fleet_owner(members, n, k);
}

static void test_plan_one_owner_each(void **state)
{
    (void)state;
    const char *m[MAXM] = {"w0", "w1", "w2", "w3", "w4"};
    int owner_of[P];
    owners(m, 5, owner_of);
    int count[MAXM] = {0};
    for (uint32_t k = 0; k < P; k++) {
        assert_true(owner_of[k] >= 0 && owner_of[k] < 5);
        count[owner_of[k]]++;
    }
    /* Each member's own plan agrees with the global owner, partition by partition. */
    for (int i = 0; i < 5; i++) {
        bool mine[P];
        assert_int_equal(td_fleet_plan(m, 5, m[i], P, mine), (uint32_t)count[i]);
        for (uint32_t k = 0; k < P; k++)
            assert_int_equal(mine[k], owner_of[k] == i);
        /* Balanced enough: 64 / 5 = 12.8 each; no member gets nothing or a double share. */
        assert_true(count[i] >= 5 && count[i] <= 25);
    }
    /* A member alone owns everything; an empty list has no owner. */
    bool mine[P];
    assert_int_equal(td_fleet_plan(NULL, 0, "solo", P, mine), P);
    assert_int_equal(td_fleet_owner(m, 0, 3), -1);
    /* The plan is the same whatever the order of the list. */
    const char *rev[5] = {"w4", "w3", "w2", "w1", "w0"};
    for (uint32_t k = 0; k < P; k++)
        assert_string_equal(rev[td_fleet_owner(rev, 5, k)], m[owner_of[k]]);
}

/* A standby's member (td_fleet_plan_next): for each partition exactly one member is next, never
 * its owner, and it is the one that owns the partition once the owner leaves. */
static void test_plan_next_takes_over(void **state)
{
    (void)state;
    const char *m[MAXM] = {"w0", "w1", "w2", "w3", "w4"};
    bool next[MAXM][P];
    for (int i = 0; i < 5; i++)
        td_fleet_plan_next(m, 5, m[i], P, next[i]);
    for (uint32_t k = 0; k < P; k++) {
        int owner = td_fleet_owner(m, 5, k), standby = -1, count = 0;
        for (int i = 0; i < 5; i++)
            if (next[i][k]) {
                standby = i;
                count++;
            }
        assert_int_equal(count, 1);
        assert_true(standby != owner);
        const char *left[4];
        int n = 0;
        for (int i = 0; i < 5; i++)
            if (i != owner)
                left[n++] = m[i];
        assert_string_equal(left[td_fleet_owner(left, 4, k)], m[standby]);
    }
    /* Alone, a member is next for nothing. */
    bool solo[P];
    td_fleet_plan_next(NULL, 0, "solo", P, solo);
    for (uint32_t k = 0; k < P; k++)
        assert_false(solo[k]);
}

static void test_plan_join_and_leave_move_only_their_share(void **state)
{
    (void)state;
    const char *m[MAXM] = {"alpha", "bravo", "charlie", "delta"};
    int before[P], after[P];
    owners(m, 3, before);
    m[3] = "delta";
    owners(m, 4, after); /* delta joins */
    int moved = 0;
    for (uint32_t k = 0; k < P; k++)
        if (after[k] != before[k]) {
            assert_int_equal(after[k], 3); /* only to the newcomer */
            moved++;
        }
    assert_true(moved > 0 && moved < P / 2); /* about P / 4 */
    /* bravo leaves: only its partitions move, to the others. */
    const char *left[3] = {"alpha", "charlie", "delta"};
    int gone[P];
    owners(left, 3, gone);
    for (uint32_t k = 0; k < P; k++) {
        const char *was = m[after[k]];
        if (strcmp(was, "bravo") != 0)
            assert_string_equal(left[gone[k]], was);
    }
}

/* Fixed values, so that another implementation of PROTOCOL.md can check itself. */
static void test_score_vectors(void **state)
{
    (void)state;
    /* The vectors of PROTOCOL.md §13 "Membership". */
    assert_true(td_fleet_score("w1", 0) == 0xea157f2a4f9fe9efull);
    assert_true(td_fleet_score("w2", 0) == 0x7a03a079b6a677afull);
    assert_true(td_fleet_score("w1", 7) == 0xa84fcc4291ead9baull);
    const char *pair[2] = {"w2", "w1"};
    assert_int_equal(td_fleet_owner(pair, 2, 0), 1);
    /* FNV-1a-64("w1/0") through mix64. */
    uint64_t h = tally_fnv1a64("w1/0", 4);
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    h ^= h >> 31;
    assert_true(td_fleet_score("w1", 0) == h);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_partition_vectors_match_protocol_md),
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_user_names),
        cmocka_unit_test(test_owned_bitmap),
        cmocka_unit_test(test_plan_one_owner_each),
        cmocka_unit_test(test_plan_next_takes_over),
        cmocka_unit_test(test_plan_join_and_leave_move_only_their_share),
        cmocka_unit_test(test_score_vectors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
