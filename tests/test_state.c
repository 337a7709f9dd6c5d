/*
 * test_state.c — the state file format on its own (td_state.c): round trips of random stream
 * tables, and every way a file can be damaged — truncated at every length, any single bit
 * flipped, another version, trailing bytes, a bad record under a correct checksum — is
 * rejected without adding a single stream; td_state_restore sets a bad file aside; writing
 * into a directory that does not exist fails cleanly.
 */
#include <dirent.h>
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "td_config.h"
#include "td_state.h"
#include "td_stream.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* A table of n streams with random names and state. */
static td_streams_t *random_table(unsigned n)
{
    td_streams_t *t = NULL;
    assert_int_equal(td_streams_new(1000, &t), TALLY_OK);
    for (unsigned i = 0; i < n; i++) {
        char name[TALLY_STREAM_NAME_MAX + 1];
        size_t len = 6 + next_rand() % (TALLY_STREAM_NAME_MAX - 5); /* 6..64 bytes */
        snprintf(name, sizeof name, "s%05u", i);                    /* unique */
        for (size_t k = 6; k < len; k++)
            name[k] = (char)(0x21 + next_rand() % 94); /* printable, no space */
        td_stream_t *s = NULL;
        assert_int_equal(td_streams_get(t, name, len, &s), TALLY_OK);
        s->info.batches = next_rand();
        s->info.elements = next_rand();
        s->info.bytes = next_rand();
        s->info.filter_seen = next_rand();
        s->info.filter_kept = next_rand();
        s->info.scan_carry = (int64_t)next_rand();
        s->info.scan_elements = next_rand();
        s->info.hist_dtype = (uint8_t[]){TALLY_DTYPE_NONE, TALLY_DTYPE_U8, TALLY_DTYPE_I32}[i % 3];
        if (s->info.hist_dtype == TALLY_DTYPE_I32) {
            s->info.hist_lo = -1000;
            s->info.hist_hi = 1000;
        }
        s->info.hist_underflow = next_rand();
        s->info.hist_overflow = next_rand();
        s->info.hist_total = next_rand();
        for (int b = 0; b < TALLY_HIST_BINS; b++)
            s->info.bins[b] = next_rand();
    }
    return t;
}

static void assert_tables_equal(td_streams_t *a, td_streams_t *b)
{
    assert_int_equal(td_streams_count(a), td_streams_count(b));
    td_stream_t *y = td_streams_first(b);
    for (td_stream_t *x = td_streams_first(a); x; x = x->list_next, y = y->list_next) {
        assert_non_null(y);
        assert_int_equal(x->name_len, y->name_len);
        assert_memory_equal(x->name, y->name, x->name_len);
        assert_memory_equal(&x->info, &y->info, sizeof x->info);
    }
}

static void test_round_trip(void **state)
{
    (void)state;
    for (unsigned n = 0; n < 40; n += 7) {
        td_streams_t *t = random_table(n);
        uint8_t *buf = NULL;
        size_t len = 0;
        assert_int_equal(td_state_encode(t, &buf, &len), TALLY_OK);
        td_streams_t *back = NULL;
        assert_int_equal(td_streams_new(1000, &back), TALLY_OK);
        char msg[256];
        assert_int_equal(td_state_decode(buf, len, back, msg, sizeof msg), TALLY_OK);
        assert_tables_equal(t, back);
        free(buf);
        td_streams_destroy(&t);
        td_streams_destroy(&back);
    }
}

/* Decoding buf must fail and add nothing. */
static void assert_rejected(const uint8_t *buf, size_t len)
{
    td_streams_t *t = NULL;
    assert_int_equal(td_streams_new(1000, &t), TALLY_OK);
    char msg[256] = "";
    assert_int_equal(td_state_decode(buf, len, t, msg, sizeof msg), TALLY_E_PARAM);
    assert_true(msg[0] != '\0');
    assert_int_equal(td_streams_count(t), 0);
    td_streams_destroy(&t);
}

static void test_every_truncation_and_bit_flip_rejected(void **state)
{
    (void)state;
    td_streams_t *t = random_table(3);
    uint8_t *buf = NULL;
    size_t len = 0;
    assert_int_equal(td_state_encode(t, &buf, &len), TALLY_OK);
    for (size_t cut = 0; cut < len; cut++)
        assert_rejected(buf, cut);
    /* Bytes 24..31 hold the time written, outside any check but the checksum. */
    for (size_t i = 0; i < len; i++) {
        for (int bit = 0; bit < 8; bit += 3) {
            buf[i] ^= (uint8_t)(1u << bit);
            assert_rejected(buf, len);
            buf[i] ^= (uint8_t)(1u << bit);
        }
    }
    free(buf);
    td_streams_destroy(&t);
}

/* Re-seals a modified image with a correct checksum. */
static void reseal(uint8_t *buf, size_t len)
{
    uint64_t sum = td_state_checksum(buf, len - TD_STATE_TRAILER_SIZE);
    for (int i = 0; i < 8; i++)
        buf[len - 8 + i] = (uint8_t)(sum >> (8 * i));
}

static void test_structural_errors_under_a_good_checksum(void **state)
{
    (void)state;
    td_streams_t *t = random_table(2);
    uint8_t *buf = NULL;
    size_t len = 0;
    assert_int_equal(td_state_encode(t, &buf, &len), TALLY_OK);
    uint8_t *copy = malloc(len + 16);

    memcpy(copy, buf, len); /* another version */
    copy[8] = 2;
    reseal(copy, len);
    assert_rejected(copy, len);

    memcpy(copy, buf, len); /* more streams announced than present */
    copy[12] = 3;
    reseal(copy, len);
    assert_rejected(copy, len);

    memcpy(copy, buf, len); /* fewer: bytes left after the last record */
    copy[12] = 1;
    reseal(copy, len);
    assert_rejected(copy, len);

    memcpy(copy, buf, len); /* a name with a space */
    copy[TD_STATE_HEADER_SIZE + 1] = ' ';
    reseal(copy, len);
    assert_rejected(copy, len);

    memcpy(copy, buf, len); /* an empty name */
    copy[TD_STATE_HEADER_SIZE] = 0;
    reseal(copy, len);
    assert_rejected(copy, len);

    free(copy);
    free(buf);
    td_streams_destroy(&t);
}

static void test_max_streams_respected(void **state)
{
    (void)state;
    td_streams_t *t = random_table(10);
    uint8_t *buf = NULL;
    size_t len = 0;
    assert_int_equal(td_state_encode(t, &buf, &len), TALLY_OK);
    td_streams_t *small = NULL;
    assert_int_equal(td_streams_new(4, &small), TALLY_OK);
    char msg[256];
    assert_int_equal(td_state_decode(buf, len, small, msg, sizeof msg), TALLY_OK);
    assert_int_equal(td_streams_count(small), 4);
    free(buf);
    td_streams_destroy(&t);
    td_streams_destroy(&small);
}

static void test_write_restore_and_set_aside(void **state)
{
    (void)state;
    char dir[] = "/tmp/tallyd-state-XXXXXX";
    assert_non_null(mkdtemp(dir));
    td_streams_t *t = random_table(5);
    uint8_t *buf = NULL;
    size_t len = 0;
    assert_int_equal(td_state_encode(t, &buf, &len), TALLY_OK);
    char msg[512];
    assert_int_equal(td_state_write(dir, buf, len, msg, sizeof msg), TALLY_OK);
    td_streams_t *back = NULL;
    assert_int_equal(td_streams_new(1000, &back), TALLY_OK);
    assert_int_equal(td_state_restore(dir, back), 5);
    assert_tables_equal(t, back);
    td_streams_destroy(&back);

    /* No temporary file is left behind. */
    char path[600];
    snprintf(path, sizeof path, "%s/%s.tmp", dir, TD_STATE_FILE);
    assert_int_equal(access(path, F_OK), -1);

    /* Truncate: restore sets it aside and starts empty. */
    snprintf(path, sizeof path, "%s/%s", dir, TD_STATE_FILE);
    assert_int_equal(truncate(path, (off_t)len - 1), 0);
    assert_int_equal(td_streams_new(1000, &back), TALLY_OK);
    assert_int_equal(td_state_restore(dir, back), 0);
    assert_int_equal(td_streams_count(back), 0);
    assert_int_equal(access(path, F_OK), -1);
    td_streams_destroy(&back);
    DIR *dp = opendir(dir);
    struct dirent *e;
    int aside = 0;
    while ((e = readdir(dp))) {
        if (strncmp(e->d_name, "streams.state.corrupt-", 22) == 0) {
            aside++;
            char p[600];
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            unlink(p);
        }
    }
    closedir(dp);
    assert_int_equal(aside, 1);

    /* No file at all: empty, nothing set aside. */
    assert_int_equal(td_streams_new(1000, &back), TALLY_OK);
    assert_int_equal(td_state_restore(dir, back), 0);
    td_streams_destroy(&back);

    /* A directory that does not exist: an I/O error with a message, nothing created. */
    char missing[600];
    snprintf(missing, sizeof missing, "%s/missing", dir);
    msg[0] = '\0';
    assert_int_equal(td_state_write(missing, buf, len, msg, sizeof msg), TALLY_E_IO);
    assert_non_null(strstr(msg, "No such file or directory"));

    free(buf);
    td_streams_destroy(&t);
    rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_every_truncation_and_bit_flip_rejected),
        cmocka_unit_test(test_structural_errors_under_a_good_checksum),
        cmocka_unit_test(test_max_streams_respected),
        cmocka_unit_test(test_write_restore_and_set_aside),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
