/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_info.c — libtally's parser of the daemon's `info` text (tally_info_parse and its
 * accessors; PROTOCOL.md §5 `info`): keys kept in order, unknown ones included, values with
 * `=` and spaces, decimal integers as the protocol spells them, and every malformed text
 * (no `=`, bad or empty keys, duplicates, a NUL, a truncated last line) refused as a whole.
 * tally_info_fetch against a real tallyd is in test_client_daemon.c.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tally.h"

static tally_info_t *parse_ok(const char *text)
{
    tally_info_t *info = NULL;
    assert_int_equal(tally_info_parse(text, strlen(text), &info), TALLY_OK);
    assert_non_null(info);
    return info;
}

static void expect_refused(const char *text, size_t len)
{
    tally_info_t *info = (tally_info_t *)&info; /* must come back NULL */
    assert_int_equal(tally_info_parse(text, len, &info), TALLY_E_REPLY);
    assert_null(info);
}

static void test_keys_in_order(void **state)
{
    (void)state;
    tally_info_t *info = parse_ok("version=0.1.0\nprotocol=1\n"
                                  "devices=cuda: 0:GPU a=b (4 CUDA streams)\npub=\n");
    assert_int_equal(tally_info_count(info), 4);
    static const char *const keys[] = {"version", "protocol", "devices", "pub"};
    static const char *const values[] = {"0.1.0", "1", "cuda: 0:GPU a=b (4 CUDA streams)", ""};
    for (size_t i = 0; i < 4; i++) {
        assert_string_equal(tally_info_key(info, i), keys[i]);
        assert_string_equal(tally_info_value(info, i), values[i]);
        assert_string_equal(tally_info_lookup(info, keys[i]), values[i]);
    }
    assert_null(tally_info_key(info, 4));
    assert_null(tally_info_value(info, 4));
    assert_null(tally_info_lookup(info, "max_batch"));
    assert_null(tally_info_lookup(info, "vers")); /* a prefix is not the key */
    assert_null(tally_info_lookup(info, NULL));
    tally_info_destroy(&info);
    assert_null(info);
}

/* A newer daemon's keys, before and after known ones, are kept and change nothing else. */
static void test_unknown_keys_kept(void **state)
{
    (void)state;
    tally_info_t *info = parse_ok("version=9.0.0\nmax_batch=16777216\nfuture_x=a,b=c\n"
                                  "z9_=\nmax_inflight=64\n");
    assert_int_equal(tally_info_count(info), 5);
    assert_string_equal(tally_info_lookup(info, "future_x"), "a,b=c");
    assert_string_equal(tally_info_key(info, 3), "z9_");
    uint64_t v = 0;
    assert_int_equal(tally_info_u64(info, "max_batch", &v), TALLY_OK);
    assert_int_equal(v, 16777216);
    assert_int_equal(tally_info_u64(info, "max_inflight", &v), TALLY_OK);
    assert_int_equal(v, 64);
    tally_info_destroy(&info);
}

static void test_empty_and_args(void **state)
{
    (void)state;
    tally_info_t *info = NULL;
    assert_int_equal(tally_info_parse("", 0, &info), TALLY_OK);
    assert_int_equal(tally_info_count(info), 0);
    assert_null(tally_info_key(info, 0));
    assert_null(tally_info_lookup(info, "version"));
    tally_info_destroy(&info);
    assert_int_equal(tally_info_parse(NULL, 0, &info), TALLY_OK);
    tally_info_destroy(&info);
    assert_int_equal(tally_info_parse(NULL, 3, &info), TALLY_E_ARG);
    assert_int_equal(tally_info_parse("a=1\n", 4, NULL), TALLY_E_ARG);
    assert_int_equal(tally_info_count(NULL), 0);
    assert_null(tally_info_key(NULL, 0));
    assert_null(tally_info_value(NULL, 0));
    assert_null(tally_info_lookup(NULL, "a"));
    uint64_t v = 7;
    assert_int_equal(tally_info_u64(NULL, "a", &v), TALLY_E_ARG);
    tally_info_destroy(&info); /* NULL is fine */
    tally_info_destroy(NULL);
    assert_int_equal(v, 7);
}

static void test_malformed_refused(void **state)
{
    (void)state;
    static const char *const bad[] = {
        "version\n",             /* no '=' */
        "=1\n",                  /* empty key */
        "Version=1\n",           /* upper case */
        "max batch=1\n",         /* a space in the key */
        "max-batch=1\n",         /* '-' */
        "a=1\n\nb=2\n",          /* a blank line */
        "\n",                    /* only a blank line */
        "a=1\nb=2\na=3\n",       /* a key twice */
        "a=1\na=1\n",            /* twice, same value */
        "k\xc3\xa9y=1\n",        /* not ASCII */
        "a=1\r\nb\r=2\r\n",      /* CR is not part of a key */
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        expect_refused(bad[i], strlen(bad[i]));
    expect_refused("a=1\0\nb=2\n", 9); /* a NUL byte */
}

/* Every prefix of a good text that does not end at a line's end is refused (truncated);
 * every one that does gives exactly the lines before it. */
static void test_truncated(void **state)
{
    (void)state;
    const char *text = "version=0.1.0\nprotocol=1\nbackend=cpu\n";
    size_t len = strlen(text);
    size_t lines = 0;
    for (size_t cut = 0; cut <= len; cut++) {
        if (cut == 0 || text[cut - 1] == '\n') {
            tally_info_t *info = NULL;
            assert_int_equal(tally_info_parse(text, cut, &info), TALLY_OK);
            assert_int_equal(tally_info_count(info), lines);
            tally_info_destroy(&info);
            lines++;
        } else {
            expect_refused(text, cut);
        }
    }
    assert_int_equal(lines, 4);
}

static void test_u64(void **state)
{
    (void)state;
    tally_info_t *info = parse_ok("zero=0\nmax=18446744073709551615\nover=18446744073709551616\n"
                                  "lead=007\nneg=-1\nplus=+1\nempty=\nspace=1 \nhex=0x10\n"
                                  "sep=1,000\n");
    uint64_t v = 5;
    assert_int_equal(tally_info_u64(info, "zero", &v), TALLY_OK);
    assert_int_equal(v, 0);
    assert_int_equal(tally_info_u64(info, "max", &v), TALLY_OK);
    assert_true(v == UINT64_MAX);
    static const char *const bad[] = {"over", "lead", "neg", "plus", "empty", "space", "hex", "sep"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        v = 5;
        assert_int_equal(tally_info_u64(info, bad[i], &v), TALLY_E_REPLY);
        assert_int_equal(v, 5);
    }
    assert_int_equal(tally_info_u64(info, "absent", &v), TALLY_E_ARG);
    assert_int_equal(tally_info_u64(info, "zero", NULL), TALLY_E_ARG);
    assert_int_equal(v, 5);
    tally_info_destroy(&info);
}

/* Many keys: all kept; one repeated far from its twin is still found. */
static void test_many_keys(void **state)
{
    (void)state;
    enum { KEYS = 20000 };
    size_t cap = (size_t)KEYS * 24 + 32;
    char *text = malloc(cap);
    assert_non_null(text);
    size_t len = 0;
    for (int i = 0; i < KEYS; i++)
        len += (size_t)snprintf(text + len, cap - len, "key_%d=%d\n", i, i);
    tally_info_t *info = NULL;
    assert_int_equal(tally_info_parse(text, len, &info), TALLY_OK);
    assert_int_equal(tally_info_count(info), KEYS);
    assert_string_equal(tally_info_key(info, KEYS - 1), "key_19999");
    assert_string_equal(tally_info_lookup(info, "key_12345"), "12345");
    tally_info_destroy(&info);
    len += (size_t)snprintf(text + len, cap - len, "key_7=again\n");
    expect_refused(text, len);
    free(text);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_keys_in_order),  cmocka_unit_test(test_unknown_keys_kept),
        cmocka_unit_test(test_empty_and_args), cmocka_unit_test(test_malformed_refused),
        cmocka_unit_test(test_truncated),      cmocka_unit_test(test_u64),
        cmocka_unit_test(test_many_keys),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
