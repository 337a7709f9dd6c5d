/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_state.c — the state file format on its own (td_state.c, td_state_record.c): round trips
 * of random stream tables; every truncation and every single-bit flip loses exactly what it
 * damaged (a flip in the header loses the file, a flip in a record loses that record's stream
 * only, the others restored byte for byte); each invariant violated, and each field made
 * invalid, under a correct record checksum refuses that stream only; a newer format version is
 * refused as such; version-1 and version-2 files still restore, and random flips in a real
 * version-3 file (tests/data/state-v3) lose at most the stream they hit; window rings
 * round-trip, with slots of another interval length or too old dropped; td_state_restore sets
 * aside unusable files (renamed) and files that lost records (copied), under names that never
 * collide; a state path that is not a regular file is refused; a write into a blocked path
 * fails cleanly. The log of incremental snapshots (td_state_log.c) is tested at the end.
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
#include "td_hash.h"
#include "td_state.h"
#include "td_state_record.h"
#include "td_stream.h"
#include "td_window.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;

/* The window clock the tests encode and decode at (ms since the epoch). */
#define NOW_MS 1795000000000ull

static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* Random state that holds every invariant td_request_apply maintains. */
static void random_info(tally_stream_info_t *in, unsigned i)
{
    memset(in, 0, sizeof *in);
    in->filter_seen = next_rand() >> 24;
    in->filter_kept = next_rand() % (in->filter_seen + 1);
    in->scan_elements = i % 4 == 3 ? 0 : next_rand() >> 24;
    in->scan_carry = in->scan_elements ? (int64_t)next_rand() : 0;
    in->hist_dtype = (uint8_t[]){TALLY_DTYPE_NONE, TALLY_DTYPE_U8,   TALLY_DTYPE_I32,
                                 TALLY_DTYPE_U16,  TALLY_DTYPE_RGB8, TALLY_DTYPE_RGBA8}[i % 6];
    if (in->hist_dtype != TALLY_DTYPE_NONE) {
        for (int b = 0; b < TALLY_HIST_BINS; b++)
            in->bins[b] = next_rand() >> 40;
        if (tally_hist_ranged(in->hist_dtype)) {
            bool u16 = in->hist_dtype == TALLY_DTYPE_U16;
            in->hist_lo =
                u16 ? (int64_t)(next_rand() % 1000) : -1000 - (int64_t)(next_rand() % 1000);
            in->hist_hi = u16 ? 4096 : 1000;
            in->hist_underflow = next_rand() >> 40;
            in->hist_overflow = next_rand() >> 40;
        }
        in->hist_total = in->hist_underflow + in->hist_overflow;
        for (int b = 0; b < TALLY_HIST_BINS; b++)
            in->hist_total += in->bins[b];
        /* Every colour channel counts the same pixels: channel c is channel 0 rotated by c. */
        for (unsigned c = 1; c < tally_hist_channels(in->hist_dtype); c++)
            for (int b = 0; b < TALLY_HIST_BINS; b++)
                in->bins[c * TALLY_HIST_BINS + b] = in->bins[(b + c) % TALLY_HIST_BINS];
    }
    in->elements = in->filter_seen + in->scan_elements + in->hist_total;
    in->batches = 1 + next_rand() % 100000;
    in->bytes = next_rand();
}

/* A table of n streams with random names and state. */
static td_streams_t *random_table(unsigned n)
{
    td_streams_t *t = NULL;
    assert_int_equal(td_streams_new(1000, &t), TD_OK);
    for (unsigned i = 0; i < n; i++) {
        char name[TALLY_STREAM_NAME_MAX + 1];
        size_t len = 6 + next_rand() % (TALLY_STREAM_NAME_MAX - 5); /* 6..64 bytes */
        snprintf(name, sizeof name, "s%05u", i);                    /* unique */
        for (size_t k = 6; k < len; k++)
            name[k] = (char)(0x21 + next_rand() % 94); /* printable, no space */
        td_stream_t *s = NULL;
        assert_int_equal(td_streams_get(t, name, len, &s), TALLY_OK);
        static tally_stream_info_t info;
        random_info(&info, i);
        char why[160];
        assert_true(td_state_check_info(&info, why, sizeof why));
        assert_true(td_stream_set_info(s, &info));
    }
    return t;
}

/* The stream's query payload: what a client sees (its length returned). */
static size_t payload_of(const td_stream_t *s, uint8_t out[TALLY_QUERY_PAYLOAD_MAX])
{
    static tally_stream_info_t info;
    td_stream_info(s, &info);
    return tally_stream_info_encode(&info, out);
}

/* The stream's window ring as the state file holds it (its length returned; 0 without one). */
static size_t ring_of(const td_stream_t *s, uint8_t *out, size_t cap)
{
    if (!s->window)
        return 0;
    size_t len = td_window_encode(s->window, NOW_MS, NULL);
    assert_true(len <= cap);
    td_window_encode(s->window, NOW_MS, out);
    return len;
}

/* b holds exactly a's streams, skipping a's stream number `skip` (-1: none), in order, with
 * byte-for-byte equal query payloads; with `present`, b holds stream `skip` too, in whatever
 * state. */
static void assert_tables_like(td_streams_t *a, td_streams_t *b, int skip, bool present)
{
    unsigned want = td_streams_count(a) - (skip >= 0 && !present ? 1 : 0);
    assert_int_equal(td_streams_count(b), want);
    td_stream_t *y = td_streams_first(b);
    int i = 0;
    for (td_stream_t *x = td_streams_first(a); x; x = td_streams_next(a, x), i++) {
        if (i == skip) {
            assert_true((td_streams_find(b, x->name, x->name_len) != NULL) == present);
            y = present ? td_streams_next(b, y) : y;
            continue;
        }
        assert_non_null(y);
        assert_int_equal(x->name_len, y->name_len);
        assert_memory_equal(x->name, y->name, x->name_len);
        static uint8_t px[TALLY_QUERY_PAYLOAD_MAX], py[TALLY_QUERY_PAYLOAD_MAX];
        size_t lx = payload_of(x, px);
        assert_int_equal(payload_of(y, py), lx);
        assert_memory_equal(px, py, lx);
        static uint8_t rx[1 << 20], ry[1 << 20];
        size_t nx = ring_of(x, rx, sizeof rx);
        assert_int_equal(ring_of(y, ry, sizeof ry), nx);
        assert_memory_equal(rx, ry, nx);
        y = td_streams_next(b, y);
    }
}

static void assert_tables_equal_but(td_streams_t *a, td_streams_t *b, int skip)
{
    assert_tables_like(a, b, skip, false);
}

static void assert_tables_equal(td_streams_t *a, td_streams_t *b)
{
    assert_tables_equal_but(a, b, -1);
}

/* Decodes buf into a fresh table (caller destroys it). */
static td_streams_t *decode_new(const uint8_t *buf, size_t len, td_err_t want,
                                td_state_report_t *report)
{
    td_streams_t *t = NULL;
    assert_int_equal(td_streams_new(1000, &t), TD_OK);
    char msg[256] = "";
    td_streams_set_window(t, 8, 1000);
    assert_int_equal(td_state_decode(buf, len, NOW_MS, t, report, msg, sizeof msg), want);
    if (want != TD_OK) {
        assert_true(msg[0] != '\0');
        assert_int_equal(td_streams_count(t), 0); /* an unusable file adds nothing */
    }
    return t;
}

/* Where record k of an image starts (records follow one another, each with its size). */
static size_t record_off(const uint8_t *buf, unsigned k)
{
    size_t off = TD_STATE_HEADER_SIZE;
    for (unsigned i = 0; i < k; i++)
        off += tally_get_u32(buf + off + 8);
    return off;
}

static void encode(td_streams_t *t, uint8_t **buf, size_t *len)
{
    assert_int_equal(td_state_encode(t, NOW_MS, 1, buf, len), TD_OK);
    assert_int_equal(*len, record_off(*buf, td_streams_count(t)));
}

/* t's file image (*buf, *len, owned by the caller) and a table decoded from it. */
static td_streams_t *encode_decode(td_streams_t *t, uint8_t **buf, size_t *len,
                                   td_state_report_t *report)
{
    encode(t, buf, len);
    return decode_new(*buf, *len, TD_OK, report);
}

/* A random table of n streams and its file image. */
static td_streams_t *random_image(unsigned n, uint8_t **buf, size_t *len)
{
    td_streams_t *t = random_table(n);
    encode(t, buf, len);
    return t;
}

static void test_round_trip(void **state)
{
    (void)state;
    for (unsigned n = 0; n < 40; n += 7) {
        td_streams_t *t = random_table(n);
        uint8_t *buf = NULL;
        size_t len = 0;
        td_state_report_t r;
        td_streams_t *back = encode_decode(t, &buf, &len, &r);
        assert_int_equal(r.version, 4);
        assert_int_equal(r.generation, 1);
        assert_int_equal(r.records, n);
        assert_int_equal(r.restored, n);
        assert_false(td_state_report_lossy(&r));
        assert_tables_equal(t, back);
        free(buf);
        td_streams_destroy(&t);
        td_streams_destroy(&back);
    }
}

/* A partition's checkpoint (td_state_encode_some, daemon/nats/): only the streams the filter
 * keeps, each record byte for byte what td_state_record_encode writes (one encoder), and the
 * image decodes to exactly those streams. */
static bool keep_odd(const td_stream_t *s, void *arg)
{
    unsigned *asked = arg;
    (*asked)++;
    return (s->name[5] - '0') % 2 == 1; /* "s%05u": the last digit of the index */
}

/* Decodes buf into a fresh whole table of `parts` parts (caller destroys it); every stream lands
 * in the part its name's shard says. */
static td_streams_t *decode_parts(const uint8_t *buf, size_t len, unsigned parts)
{
    td_streams_t *t = NULL;
    assert_int_equal(td_streams_new_parts(parts, 1000, &t), TD_OK);
    td_streams_set_window(t, 8, 1000);
    td_state_report_t r;
    char msg[256] = "";
    assert_int_equal(td_state_decode(buf, len, NOW_MS, t, &r, msg, sizeof msg), TD_OK);
    assert_false(td_state_report_lossy(&r));
    unsigned in_parts = 0;
    for (unsigned i = 0; i < td_streams_parts(t); i++) {
        td_streams_t *part = td_streams_part(t, i);
        for (td_stream_t *s = td_streams_first(part); s; s = s->list_next, in_parts++)
            assert_int_equal(td_stream_shard(s->name, s->name_len, parts), i);
    }
    assert_int_equal(in_parts, td_streams_count(t));
    return t;
}

/* The streams of one NATS partition spread over a worker's shards (issue 32): a partition is
 * the published FNV-1a 64 modulo the partitions, and a shard the same hash, mixed, modulo the
 * shards. Unmixed, every stream of partition k of 8 was on shard k % 2 (or k % 4): a worker
 * owning partitions 1, 3 and 5 ran them all on one of its two shards. */
static void test_shards_spread_a_partition(void **state)
{
    (void)state;
    for (unsigned shards = 2; shards <= 4; shards++)
        for (uint32_t k = 0; k < 8; k++) {
            unsigned on[4] = {0}, names = 0;
            for (unsigned i = 0; names < 64; i++) {
                char name[32];
                int len = snprintf(name, sizeof name, "cam-%u", i);
                if (tally_partition(name, (size_t)len, 8) != k)
                    continue;
                on[td_stream_shard(name, (size_t)len, shards)]++;
                names++;
            }
            for (unsigned j = 0; j < shards; j++) /* 64 / shards expected: none empty or doubled */
                assert_in_range(on[j], 64 / shards / 2, 64 / shards * 2);
        }
}

/* Issue 31: a state file is the same whatever the shard count that writes or reads it: streams
 * written by one shard load into four parts (each in its shard's), and back into one and three,
 * every stream equal and in creation order. */
static void test_state_across_shard_counts(void **state)
{
    (void)state;
    td_streams_t *one = random_table(40);
    uint8_t *buf = NULL, *again = NULL, *third = NULL;
    size_t len = 0, again_len = 0, third_len = 0;
    encode(one, &buf, &len);
    td_streams_t *four = decode_parts(buf, len, 4);
    assert_tables_equal(one, four);
    encode(four, &again, &again_len);
    assert_int_equal(again_len, len); /* the same records, in the same order */
    assert_memory_equal(again + TD_STATE_HEADER_SIZE, buf + TD_STATE_HEADER_SIZE,
                        len - TD_STATE_HEADER_SIZE);
    td_streams_t *back = decode_parts(again, again_len, 1), *three = decode_parts(again, len, 3);
    assert_tables_equal(one, back);
    assert_tables_equal(one, three);
    encode(three, &third, &third_len);
    assert_int_equal(third_len, len);
    td_streams_destroy(&one);
    td_streams_destroy(&four);
    td_streams_destroy(&back);
    td_streams_destroy(&three);
    free(buf);
    free(again);
    free(third);
}

static void test_encode_some_keeps_only_filtered(void **state)
{
    (void)state;
    td_streams_t *t = random_table(21);
    unsigned asked = 0;
    uint8_t *buf = NULL;
    size_t len = 0;
    assert_int_equal(td_state_encode_some(t, NOW_MS, 7, keep_odd, &asked, &buf, &len), TD_OK);
    assert_int_equal(asked, 2 * 21); /* sized, then written */
    assert_int_equal(tally_get_u32(buf + 12), 10);
    assert_int_equal(len, record_off(buf, 10));
    unsigned k = 0;
    for (td_stream_t *s = td_streams_first(t); s; s = s->list_next) {
        if ((s->name[5] - '0') % 2 == 0)
            continue;
        size_t n = td_state_record_encode(s, NOW_MS, NULL);
        uint8_t *want = malloc(n);
        assert_non_null(want);
        assert_int_equal(td_state_record_encode(s, NOW_MS, want), n);
        assert_int_equal(tally_get_u32(buf + record_off(buf, k) + 8), n);
        assert_memory_equal(buf + record_off(buf, k), want, n);
        free(want);
        k++;
    }
    assert_int_equal(k, 10);
    td_state_report_t r;
    td_streams_t *back = decode_new(buf, len, TD_OK, &r);
    assert_int_equal(r.generation, 7);
    assert_int_equal(r.restored, 10);
    assert_false(td_state_report_lossy(&r));
    for (td_stream_t *s = td_streams_first(back); s; s = s->list_next)
        assert_int_equal((s->name[5] - '0') % 2, 1);
    free(buf);
    td_streams_destroy(&back);
    td_streams_destroy(&t);
}

/* A cut inside the header loses the file; a cut anywhere after it keeps every whole record. */
static void test_every_truncation(void **state)
{
    (void)state;
    uint8_t *buf = NULL;
    size_t len = 0;
    td_streams_t *t = random_image(3, &buf, &len);
    td_state_report_t r;
    for (size_t cut = 0; cut < len; cut++) {
        bool header = cut < TD_STATE_HEADER_SIZE;
        td_streams_t *back = decode_new(buf, cut, header ? TD_ERR_CORRUPT : TD_OK, &r);
        if (!header) {
            unsigned whole = 0;
            while (whole < 3 && record_off(buf, whole + 1) <= cut)
                whole++;
            assert_int_equal(r.restored, whole);
            assert_int_equal(r.missing, 3 - whole);
            assert_true(td_state_report_lossy(&r));
            td_stream_t *x = td_streams_first(t), *y = td_streams_first(back);
            for (unsigned i = 0; i < whole; i++, x = x->list_next, y = y->list_next) {
                static uint8_t px[TALLY_QUERY_PAYLOAD_MAX], py[TALLY_QUERY_PAYLOAD_MAX];
                size_t n = payload_of(x, px);
                assert_int_equal(payload_of(y, py), n);
                assert_memory_equal(px, py, n);
            }
        }
        td_streams_destroy(&back);
    }
    free(buf);
    td_streams_destroy(&t);
}

/* Any one bit flipped: in the header the whole file is refused; in record k exactly stream k
 * is lost and every other stream is restored byte for byte. */
static void test_every_bit_flip_loses_only_its_stream(void **state)
{
    (void)state;
    uint8_t *buf = NULL;
    size_t len = 0;
    td_streams_t *t = random_image(3, &buf, &len);
    td_state_report_t r;
    for (size_t i = 0; i < len; i++) {
        for (int bit = 0; bit < 8; bit += 3) {
            buf[i] ^= (uint8_t)(1u << bit);
            if (i < TD_STATE_HEADER_SIZE) { /* a version made higher reads as a newer one */
                bool newer = tally_get_u32(buf + 8) > TD_STATE_VERSION;
                td_streams_t *back =
                    decode_new(buf, len, newer ? TD_ERR_VERSION : TD_ERR_CORRUPT, &r);
                td_streams_destroy(&back);
            } else {
                /* A flip in the last record's size can make it look cut off: lost either way. */
                td_streams_t *back = decode_new(buf, len, TD_OK, &r);
                int k = 0;
                while (k < 2 && record_off(buf, (unsigned)k + 1) <= i)
                    k++;
                assert_int_equal(r.damaged + r.missing, 1);
                assert_true(r.damaged == 1 || k == 2);
                assert_int_equal(r.restored, 2);
                assert_tables_equal_but(t, back, k);
                td_streams_destroy(&back);
            }
            buf[i] ^= (uint8_t)(1u << bit);
        }
    }
    free(buf);
    td_streams_destroy(&t);
}

/* Re-seals a modified header or record with a correct checksum. */
static void reseal_header(uint8_t *buf)
{
    tally_put_u32(buf + TD_STATE_HEADER_CRC_OFF, td_state_crc(buf, TD_STATE_HEADER_CRC_OFF));
}

static uint8_t *record(uint8_t *buf, unsigned k)
{
    return buf + record_off(buf, k);
}

static void reseal_record(uint8_t *rec)
{
    uint32_t size = tally_get_u32(rec + 8);
    tally_put_u32(rec + 4, td_state_crc(rec + 8, size - 8));
}

static void test_header_errors_under_a_good_checksum(void **state)
{
    (void)state;
    uint8_t *buf = NULL;
    size_t len = 0;
    td_streams_t *t = random_image(2, &buf, &len);
    uint8_t *copy = malloc(len);
    td_state_report_t r;
    struct {
        size_t off;
        uint8_t value;
        td_err_t want;
    } cases[] = {{8, 99, TD_ERR_VERSION}, {8, 5, TD_ERR_VERSION}, {8, 3, TD_ERR_CORRUPT},
                 {8, 2, TD_ERR_CORRUPT},  {8, 0, TD_ERR_CORRUPT}, {16, 0, TD_ERR_CORRUPT},
                 {32, 1, TD_ERR_CORRUPT}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        memcpy(copy, buf, len);
        copy[cases[c].off] = cases[c].value;
        reseal_header(copy);
        td_streams_t *back = decode_new(copy, len, cases[c].want, &r);
        td_streams_destroy(&back);
    }
    /* A newer version is refused as newer, whatever its header's checksum says. */
    memcpy(copy, buf, len);
    copy[8] = 7;
    char msg[256] = "";
    td_streams_t *newer = NULL;
    assert_int_equal(td_streams_new(10, &newer), TD_OK);
    assert_int_equal(td_state_decode(copy, len, NOW_MS, newer, &r, msg, sizeof msg),
                     TD_ERR_VERSION);
    assert_non_null(strstr(msg, "written by a newer tallyd (format version 7"));
    assert_int_equal(td_streams_count(newer), 0);
    td_streams_destroy(&newer);
    memcpy(copy, buf, len); /* bad magic */
    copy[0] = 'X';
    td_streams_t *back = decode_new(copy, len, TD_ERR_CORRUPT, &r);
    td_streams_destroy(&back);

    memcpy(copy, buf, len); /* more records announced than present: the rest are missing */
    tally_put_u32(copy + 12, 5);
    reseal_header(copy);
    back = decode_new(copy, len, TD_OK, &r);
    assert_int_equal(r.restored, 2);
    assert_int_equal(r.missing, 3);
    assert_tables_equal(t, back);
    td_streams_destroy(&back);

    memcpy(copy, buf, len); /* fewer: the bytes after the last one are reported */
    tally_put_u32(copy + 12, 1);
    reseal_header(copy);
    back = decode_new(copy, len, TD_OK, &r);
    assert_int_equal(r.restored, 1);
    assert_int_equal(r.extra_bytes, len - record_off(buf, 1));
    assert_true(td_state_report_lossy(&r));
    td_streams_destroy(&back);
    free(copy);
    free(buf);
    td_streams_destroy(&t);
}

typedef void (*breaker_t)(tally_stream_info_t *in);
static void b_total(tally_stream_info_t *in)
{
    in->hist_total++, in->elements++;
}
static void b_bin(tally_stream_info_t *in)
{
    in->bins[200] += 5;
}
static void b_u8_under(tally_stream_info_t *in)
{
    in->hist_dtype = TALLY_DTYPE_U8, in->hist_lo = in->hist_hi = 0;
    in->hist_underflow += 1, in->hist_total += 1, in->elements += 1;
}
static void b_none_bins(tally_stream_info_t *in)
{
    in->hist_dtype = TALLY_DTYPE_NONE, in->hist_lo = in->hist_hi = 0;
}
static void b_range(tally_stream_info_t *in)
{
    in->hist_lo = in->hist_hi;
}
static void b_range_low(tally_stream_info_t *in)
{
    in->hist_lo = (int64_t)INT32_MIN - 1;
}
static void b_range_high(tally_stream_info_t *in)
{
    in->hist_hi = (int64_t)INT32_MAX + 2;
}
static void b_kept(tally_stream_info_t *in)
{
    in->filter_kept = in->filter_seen + 1;
}
static void b_scanned(tally_stream_info_t *in)
{
    in->scan_elements = in->elements + 1;
}
static void b_elements(tally_stream_info_t *in)
{
    in->elements += 7;
}
static void b_batches(tally_stream_info_t *in)
{
    in->batches = 0;
}
static void b_carry(tally_stream_info_t *in)
{
    in->elements -= in->scan_elements, in->scan_elements = 0, in->scan_carry = 5;
}

/* The image buf (of t's streams) with record k replaced by the record of a stream named
 * `name` holding `info` (no check on it: set_info takes anything); *len_out its length. */
static uint8_t *replace_record(const uint8_t *buf, size_t len, unsigned k, const char *name,
                               size_t name_len, const tally_stream_info_t *info, size_t *len_out)
{
    td_streams_t *one = NULL;
    td_stream_t *s = NULL;
    assert_int_equal(td_streams_new(2, &one), TD_OK);
    assert_int_equal(td_streams_get(one, name, name_len, &s), TALLY_OK);
    assert_true(td_stream_set_info(s, info));
    size_t rec_len = td_state_record_encode(s, NOW_MS, NULL);
    size_t from = record_off(buf, k), to = record_off(buf, k + 1);
    *len_out = len - (to - from) + rec_len;
    uint8_t *out = malloc(*len_out);
    memcpy(out, buf, from);
    td_state_record_encode(s, NOW_MS, out + from);
    memcpy(out + from + rec_len, buf + to, len - to);
    td_streams_destroy(&one);
    return out;
}

/* Each invariant, broken in stream 2 of 0..2 under a correct record checksum: stream 2 alone
 * is refused. Stream 2 has an i32 histogram and scanned elements (random_info). */
static void test_invariant_violations_refuse_only_that_stream(void **state)
{
    (void)state;
    static const breaker_t breakers[] = {b_total,   b_bin,       b_u8_under,   b_none_bins,
                                         b_range,   b_range_low, b_range_high, b_kept,
                                         b_scanned, b_elements,  b_batches,    b_carry};
    td_streams_t *t = random_table(3);
    td_stream_t *s1 = td_streams_first(t)->list_next->list_next;
    assert_int_equal(s1->info.hist_dtype, TALLY_DTYPE_I32);
    assert_true(s1->info.scan_elements > 0 && s1->info.filter_seen > 0);
    uint8_t *buf = NULL;
    size_t len = 0;
    encode(t, &buf, &len);
    td_state_report_t r;
    for (size_t c = 0; c < sizeof breakers / sizeof breakers[0]; c++) {
        static tally_stream_info_t bad;
        td_stream_info(s1, &bad);
        breakers[c](&bad);
        char why[160] = "";
        assert_false(td_state_check_info(&bad, why, sizeof why));
        assert_true(why[0] != '\0');
        size_t n = 0;
        uint8_t *copy = replace_record(buf, len, 2, s1->name, s1->name_len, &bad, &n);
        td_streams_t *back = decode_new(copy, n, TD_OK, &r);
        assert_int_equal(r.damaged, 1);
        assert_tables_equal_but(t, back, 2);
        td_streams_destroy(&back);
        free(copy);
    }
    /* Under a good checksum: a bad dtype (the head refuses it), an rgb8 dtype over one channel's
     * counts, a name with a space, a name of 65 bytes, an unknown kind, reserved bytes set, a
     * ring interval without a ring, a second record of stream 0's name. */
    for (int c = 0; c < 8; c++) {
        uint8_t *copy = malloc(len);
        size_t n = len;
        memcpy(copy, buf, len);
        uint8_t *rec = record(copy, 2), *head = rec + TD_STATE_RECORD_NAME_OFF + rec[13];
        if (c == 0)
            head[56] = 9;
        else if (c == 1)
            head[56] = TALLY_DTYPE_RGB8;
        else if (c == 2)
            rec[TD_STATE_RECORD_NAME_OFF + 2] = ' ';
        else if (c == 3)
            rec[13] = TALLY_STREAM_NAME_MAX + 1;
        else if (c == 4)
            rec[12] = 3;
        else if (c == 5)
            rec[14] = 1;
        else if (c == 6)
            tally_put_u32(head + 128, 1000);
        if (c == 7) {
            static tally_stream_info_t other;
            td_stream_info(s1, &other);
            free(copy);
            const td_stream_t *s0 = td_streams_first(t);
            copy = replace_record(buf, len, 2, s0->name, s0->name_len, &other, &n);
        } else {
            reseal_record(rec);
        }
        td_streams_t *back = decode_new(copy, n, TD_OK, &r);
        assert_int_equal(r.damaged, 1);
        assert_tables_equal_but(t, back, 2);
        td_streams_destroy(&back);
        free(copy);
    }
    free(buf);
    td_streams_destroy(&t);
}

/* A stream record holds the first 128 bytes of the stream's `query` record as they are, after
 * its name. */
static void test_record_carries_the_query_head(void **state)
{
    (void)state;
    uint8_t *buf = NULL;
    size_t len = 0;
    td_streams_t *t = random_image(2, &buf, &len);
    uint8_t want[TALLY_QUERY_PAYLOAD_MAX];
    const td_stream_t *s = td_streams_first(t)->list_next;
    payload_of(s, want);
    const uint8_t *rec = record(buf, 1);
    assert_memory_equal(rec, TD_STATE_RECORD_MAGIC, 4);
    assert_int_equal(rec[12], TD_STATE_RECORD_STREAM);
    assert_int_equal(rec[13], s->name_len);
    assert_memory_equal(rec + TD_STATE_RECORD_NAME_OFF, s->name, s->name_len);
    assert_memory_equal(rec + TD_STATE_RECORD_NAME_OFF + s->name_len, want,
                        TALLY_STREAM_INFO_HEAD_SIZE);
    free(buf);
    td_streams_destroy(&t);
}

/* A version-1 image, as tallyd before format version 2 wrote it. */
static uint8_t *encode_v1(td_streams_t *t, size_t *len_out)
{
    size_t body = 0;
    uint32_t count = 0;
    for (td_stream_t *s = td_streams_first(t); s; s = s->list_next, count++)
        body += 1 + s->name_len + TALLY_QUERY_PAYLOAD_SIZE;
    size_t len = TD_STATE_V1_HEADER_SIZE + body + TD_STATE_V1_TRAILER_SIZE;
    uint8_t *out = calloc(1, len), *p = out + TD_STATE_V1_HEADER_SIZE;
    memcpy(out, TD_STATE_MAGIC, 8);
    tally_put_u32(out + 8, 1);
    tally_put_u32(out + 12, count);
    tally_put_u64(out + 16, body);
    tally_put_u64(out + 24, 1763900000);
    for (td_stream_t *s = td_streams_first(t); s; s = s->list_next) {
        *p++ = (uint8_t)s->name_len;
        memcpy(p, s->name, s->name_len);
        p += s->name_len;
        static tally_stream_info_t info;
        td_stream_info(s, &info);
        tally_stream_info_encode(&info, p);
        p += TALLY_QUERY_PAYLOAD_SIZE;
    }
    tally_put_u64(p, td_state_checksum(out, len - TD_STATE_V1_TRAILER_SIZE));
    *len_out = len;
    return out;
}

/* An old-format image restores every stream of t, byte for byte, and says its version. */
static void expect_whole(const uint8_t *buf, size_t len, unsigned version, td_streams_t *t)
{
    td_state_report_t r;
    td_streams_t *back = decode_new(buf, len, TD_OK, &r);
    assert_int_equal(r.version, version);
    assert_int_equal(r.restored, td_streams_count(t));
    assert_false(td_state_report_lossy(&r));
    assert_tables_equal(t, back);
    td_streams_destroy(&back);
}

/* Single-channel streams only: versions 1 and 2 knew no other. */
static td_streams_t *random_table_v2(unsigned n)
{
    td_streams_t *t = random_table(n);
    for (td_stream_t *s = td_streams_first(t); s; s = s->list_next) {
        if (tally_hist_channels(s->info.hist_dtype) > 1) {
            static tally_stream_info_t info;
            td_stream_info(s, &info);
            info.elements -= info.hist_total;
            memset(&info.bins, 0, sizeof info.bins);
            info.hist_dtype = TALLY_DTYPE_NONE;
            info.hist_total = 0;
            assert_true(td_stream_set_info(s, &info));
        }
    }
    return t;
}

/* A version-2 image, as tallyd before windows and colour histograms wrote it. */
static uint8_t *encode_v2(td_streams_t *t, size_t *len_out)
{
    size_t count = td_streams_count(t);
    size_t len = TD_STATE_HEADER_SIZE + count * TD_STATE_V2_RECORD_SIZE;
    uint8_t *out = calloc(1, len), *rec = out + TD_STATE_HEADER_SIZE;
    memcpy(out, TD_STATE_MAGIC, 8);
    tally_put_u32(out + 8, 2);
    tally_put_u32(out + 12, (uint32_t)count);
    tally_put_u32(out + 16, TD_STATE_V2_RECORD_SIZE);
    tally_put_u32(out + TD_STATE_HEADER_CRC_OFF, td_state_crc(out, TD_STATE_HEADER_CRC_OFF));
    for (td_stream_t *s = td_streams_first(t); s; s = s->list_next) {
        tally_put_u32(rec + 4, (uint32_t)s->name_len);
        memcpy(rec + TD_STATE_V2_RECORD_NAME_OFF, s->name, s->name_len);
        static tally_stream_info_t info;
        td_stream_info(s, &info);
        tally_stream_info_encode(&info, rec + TD_STATE_V2_RECORD_INFO_OFF);
        tally_put_u32(rec, td_state_crc(rec + 4, TD_STATE_V2_RECORD_SIZE - 4));
        rec += TD_STATE_V2_RECORD_SIZE;
    }
    *len_out = len;
    return out;
}

static void test_version_2_restores(void **state)
{
    (void)state;
    td_streams_t *t = random_table_v2(5);
    size_t len = 0;
    uint8_t *v2 = encode_v2(t, &len);
    expect_whole(v2, len, 2, t);
    td_state_report_t r;
    td_streams_t *back;
    /* A flip in record 3 loses stream 3 only; a cut loses the records it reaches. */
    v2[TD_STATE_HEADER_SIZE + 3 * TD_STATE_V2_RECORD_SIZE + 700] ^= 4;
    back = decode_new(v2, len, TD_OK, &r);
    assert_int_equal(r.damaged, 1);
    assert_tables_equal_but(t, back, 3);
    td_streams_destroy(&back);
    back = decode_new(v2, len - 1, TD_OK, &r);
    assert_int_equal(r.restored, 3);
    assert_int_equal(r.missing, 1);
    td_streams_destroy(&back);
    /* The next snapshot is written as version 4 and restores the same. */
    uint8_t *v3 = NULL;
    size_t len3 = 0;
    v2[TD_STATE_HEADER_SIZE + 3 * TD_STATE_V2_RECORD_SIZE + 700] ^= 4;
    back = decode_new(v2, len, TD_OK, &r);
    encode(back, &v3, &len3);
    td_streams_t *again = decode_new(v3, len3, TD_OK, &r);
    assert_int_equal(r.version, 4);
    assert_tables_equal(t, again);
    td_streams_destroy(&again);
    td_streams_destroy(&back);
    free(v3);
    free(v2);
    td_streams_destroy(&t);
}

/* Fills the ring of every stream with a histogram: 12 intervals up to NOW_MS (the oldest 4 age
 * out of an 8-slot ring). Returns how many streams have a ring. */
static unsigned fill_rings(td_streams_t *t)
{
    unsigned with_ring = 0;
    for (td_stream_t *s = td_streams_first(t); s; s = s->list_next) {
        if (s->info.hist_dtype == TALLY_DTYPE_NONE)
            continue;
        static uint64_t bins[TALLY_HIST_VALUES_MAX];
        for (int k = 11; k >= 0; k--) { /* in time order */
            unsigned channels = tally_hist_channels(s->info.hist_dtype);
            uint64_t n = 0, under = next_rand() % 3, over = next_rand() % 3;
            for (int b = 0; b < TALLY_HIST_BINS; b++)
                n += bins[b] = next_rand() % 4;
            for (unsigned c = 1; c < channels; c++)
                for (int b = 0; b < TALLY_HIST_BINS; b++)
                    bins[c * TALLY_HIST_BINS + b] = bins[(b + 7 * c) % TALLY_HIST_BINS];
            if (!tally_hist_ranged(s->info.hist_dtype))
                under = over = 0;
            if (!s->window)
                s->window = td_window_new(td_streams_window_intervals(t),
                                          td_streams_window_interval_ms(t), channels);
            assert_non_null(s->window);
            assert_true(td_window_add(s->window, NOW_MS - 1000ull * (uint64_t)k, bins, under, over,
                                      n + under + over));
            td_stream_recount(s);
        }
        with_ring++;
    }
    return with_ring;
}

/* Decodes buf at now_ms into a table with windows of `intervals` x interval_ms (0: windows
 * off), which must restore all 6 streams; returns the window slots dropped. */
static unsigned decode_windowed(const uint8_t *buf, size_t len, uint64_t now_ms, unsigned intervals,
                                uint32_t interval_ms)
{
    td_streams_t *later = NULL;
    assert_int_equal(td_streams_new(100, &later), TD_OK);
    if (intervals)
        td_streams_set_window(later, intervals, interval_ms);
    td_state_report_t r;
    char msg[256];
    assert_int_equal(td_state_decode(buf, len, now_ms, later, &r, msg, sizeof msg), TD_OK);
    assert_int_equal(r.restored, 6);
    for (td_stream_t *s = td_streams_first(later); s && !intervals; s = s->list_next)
        assert_null(s->window);
    td_streams_destroy(&later);
    return r.window_slots_dropped;
}

/* Stream 1 (u8): one slot's total off by one under a good checksum; and a bit flip in stream 2's
 * ring: each loses that stream only. */
static void check_damaged_rings(td_streams_t *t, const uint8_t *buf, size_t len)
{
    td_state_report_t r;
    uint8_t *copy = malloc(len);
    memcpy(copy, buf, len);
    uint8_t *rec = record(copy, 1);
    /* After the name: the query head (128), the interval and a reserved u32, the bins. */
    static uint64_t bins[TALLY_HIST_VALUES_MAX];
    size_t bins_at = TD_STATE_RECORD_NAME_OFF + rec[13] + 136;
    size_t ring = bins_at + td_bins_decode(rec + bins_at, tally_get_u32(rec + 8) - bins_at,
                                           TALLY_HIST_BINS, bins);
    assert_int_equal(tally_get_u32(rec + ring), 8); /* its slot count */
    size_t slot0 = ring + 4;
    tally_put_u64(rec + slot0 + 24, tally_get_u64(rec + slot0 + 24) + 1);
    reseal_record(rec);
    td_streams_t *back = decode_new(copy, len, TD_OK, &r);
    assert_int_equal(r.damaged, 1);
    assert_tables_equal_but(t, back, 1);
    td_streams_destroy(&back);
    memcpy(copy, buf, len);
    rec = record(copy, 2);
    rec[tally_get_u32(rec + 8) - 100] ^= 0x10;
    back = decode_new(copy, len, TD_OK, &r);
    assert_int_equal(r.damaged, 1);
    assert_tables_equal_but(t, back, 2);
    td_streams_destroy(&back);
    free(copy);
}

/* Window rings: saved with their non-empty slots inside the ring, restored byte for byte at
 * the same clock; a later clock drops what the ring no longer reaches; another interval length
 * drops every slot; windows off restores no ring; a slot whose total is not its bins refuses
 * that stream only. */
static void test_window_rings(void **state)
{
    (void)state;
    td_streams_t *t = random_table(6);
    td_streams_set_window(t, 8, 1000);
    unsigned with_ring = fill_rings(t);
    uint8_t *buf = NULL;
    size_t len = 0;
    td_state_report_t r;
    td_streams_t *back = encode_decode(t, &buf, &len, &r);
    assert_int_equal(r.restored, 6);
    assert_int_equal(r.window_slots_dropped, 0);
    assert_tables_equal(t, back);
    /* The window query's view agrees: the last 3 intervals of each. */
    for (td_stream_t *x = td_streams_first(t), *y = td_streams_first(back); x;
         x = x->list_next, y = y->list_next) {
        if (!x->window)
            continue;
        static tally_stream_info_t wx, wy;
        assert_true(td_window_sum(x->window, NOW_MS, 3, &wx) == NOW_MS - 2000);
        assert_true(td_window_sum(y->window, NOW_MS, 3, &wy) == NOW_MS - 2000);
        assert_true(wx.hist_total > 0 && wx.hist_total == wy.hist_total);
        assert_memory_equal(wx.bins, wy.bins, sizeof wx.bins);
    }
    td_streams_destroy(&back);

    /* Restored 5 s later: the ring reaches back to NOW - 2 s, so 5 of the 8 saved slots drop. */
    assert_int_equal(decode_windowed(buf, len, NOW_MS + 5000, 8, 1000), 5 * with_ring);
    /* Another interval length: every slot dropped, the streams restored. */
    assert_int_equal(decode_windowed(buf, len, NOW_MS, 8, 500), 8 * with_ring);
    /* Windows off: no ring. */
    decode_windowed(buf, len, NOW_MS, 0, 0);

    check_damaged_rings(t, buf, len);
    free(buf);
    td_streams_destroy(&t);
}

static void test_version_1_restores(void **state)
{
    (void)state;
    td_streams_t *t = random_table_v2(4);
    size_t len = 0;
    uint8_t *v1 = encode_v1(t, &len);
    expect_whole(v1, len, 1, t);
    td_state_report_t r;
    td_streams_t *back;

    /* Its one checksum covers everything: any flip loses the file. */
    v1[len / 2] ^= 1;
    back = decode_new(v1, len, TD_ERR_CORRUPT, &r);
    td_streams_destroy(&back);
    v1[len / 2] ^= 1;
    back = decode_new(v1, len - 1, TD_ERR_CORRUPT, &r);
    td_streams_destroy(&back);

    /* A consistent checksum over a broken invariant: that stream only. */
    size_t off = TD_STATE_V1_HEADER_SIZE;
    off += 1 + td_streams_first(t)->name_len + TALLY_QUERY_PAYLOAD_SIZE; /* record 1 */
    off += 1 + td_streams_first(t)->list_next->name_len + 96;            /* its hist_total */
    v1[off] ^= 1;
    tally_put_u64(v1 + len - 8, td_state_checksum(v1, len - TD_STATE_V1_TRAILER_SIZE));
    back = decode_new(v1, len, TD_OK, &r);
    assert_int_equal(r.damaged, 1);
    assert_tables_equal_but(t, back, 1);
    td_streams_destroy(&back);
    free(v1);
    td_streams_destroy(&t);
}

/* The whole file at path (malloc'ed), its length in *len. */
static uint8_t *read_whole(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    rewind(f);
    uint8_t *buf = malloc((size_t)n);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return buf;
}

/* A real version-3 file (an earlier release's, tests/data/state-v3): read whole at its clock,
 * then with one byte flipped, 600 times at random places: a flip in a record loses that stream
 * at most, every other stream restored byte for byte (record and ring), a flip in the header
 * loses the file. */
static void test_version_3_file_flips(void **state)
{
    (void)state;
    const uint64_t when = 1795000000500ull; /* the fixture's clock (make_state_fixture.c) */
    size_t len = 0;
    uint8_t *buf = read_whole(TALLY_TEST_DATA "/state-v3/streams.state", &len);
    td_streams_t *whole = NULL;
    td_state_report_t r;
    char msg[256];
    assert_int_equal(td_streams_new(100, &whole), TD_OK);
    td_streams_set_window(whole, 60, 1000);
    assert_int_equal(td_state_decode(buf, len, when, whole, &r, msg, sizeof msg), TD_OK);
    assert_int_equal(r.version, 3);
    assert_int_equal(r.restored, 11);
    assert_false(td_state_report_lossy(&r));
    for (int k = 0; k < 600; k++) {
        size_t at = next_rand() % len;
        uint8_t was = buf[at];
        buf[at] ^= (uint8_t)(1u << (next_rand() % 8));
        td_streams_t *back = NULL;
        assert_int_equal(td_streams_new(100, &back), TD_OK);
        td_streams_set_window(back, 60, 1000);
        td_err_t st = td_state_decode(buf, len, when, back, &r, msg, sizeof msg);
        if (at < TD_STATE_HEADER_SIZE) {
            assert_true(st == TD_ERR_CORRUPT || st == TD_ERR_VERSION);
        } else {
            assert_int_equal(st, TD_OK);
            assert_true(r.restored >= 10 && r.damaged + r.missing <= 1);
            for (td_stream_t *y = td_streams_first(back); y; y = y->list_next) {
                td_stream_t *x = td_streams_find(whole, y->name, y->name_len);
                static uint8_t px[TALLY_QUERY_PAYLOAD_MAX], py[TALLY_QUERY_PAYLOAD_MAX];
                static uint8_t rx[1 << 17], ry[1 << 17];
                assert_non_null(x);
                size_t n = payload_of(x, px);
                assert_int_equal(payload_of(y, py), n);
                assert_memory_equal(px, py, n);
                n = x->window ? td_window_encode(x->window, when, rx) : 0;
                assert_int_equal(y->window ? td_window_encode(y->window, when, ry) : 0, n);
                assert_memory_equal(rx, ry, n);
            }
        }
        td_streams_destroy(&back);
        buf[at] = was;
    }
    td_streams_destroy(&whole);
    free(buf);
}

static void test_max_streams_respected(void **state)
{
    (void)state;
    uint8_t *buf = NULL;
    size_t len = 0;
    td_streams_t *t = random_image(10, &buf, &len);
    td_streams_t *small = NULL;
    assert_int_equal(td_streams_new(4, &small), TD_OK);
    char msg[256];
    td_state_report_t r;
    assert_int_equal(td_state_decode(buf, len, NOW_MS, small, &r, msg, sizeof msg), TD_OK);
    assert_int_equal(td_streams_count(small), 4);
    assert_int_equal(r.restored, 4);
    assert_int_equal(r.over_limit, 6);
    assert_true(td_state_report_lossy(&r));
    free(buf);
    td_streams_destroy(&t);
    td_streams_destroy(&small);
}

/* ---- files ------------------------------------------------------------------------------ */

static void write_bytes(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, len, f), len);
    fclose(f);
}

/* The set-aside files in dir (up to 8 paths, malloc'ed contents in data[], sizes in lens[]). */
static int list_aside(const char *dir, uint8_t **data, size_t *lens)
{
    DIR *dp = opendir(dir);
    struct dirent *e;
    int n = 0;
    while ((e = readdir(dp))) {
        if (strncmp(e->d_name, "streams.state.corrupt-", 22) != 0)
            continue;
        assert_true(n < 8);
        char p[600];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        FILE *f = fopen(p, "rb");
        assert_non_null(f);
        data[n] = malloc(1 << 16);
        lens[n] = fread(data[n], 1, 1 << 16, f);
        fclose(f);
        n++;
    }
    closedir(dp);
    return n;
}

static void clear_dir(const char *dir)
{
    DIR *dp = opendir(dir);
    struct dirent *e;
    while ((e = readdir(dp))) {
        if (e->d_name[0] == '.')
            continue;
        char p[600];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        if (remove(p) != 0)
            rmdir(p);
    }
    closedir(dp);
}

static unsigned restore_into_new(const char *dir, td_streams_t **out, td_state_report_t *r)
{
    char msg[512] = "";
    assert_int_equal(td_streams_new(1000, out), TD_OK);
    assert_int_equal(td_state_restore(dir, *out, r, msg, sizeof msg), TD_OK);
    return td_streams_count(*out);
}

static void test_write_restore_and_set_aside(void **state)
{
    (void)state;
    char dir[] = "/tmp/tallyd-state-XXXXXX";
    assert_non_null(mkdtemp(dir));
    uint8_t *buf = NULL;
    size_t len = 0;
    td_streams_t *t = random_image(5, &buf, &len);
    char msg[512];
    assert_int_equal(td_state_write_file(dir, TD_STATE_FILE, buf, len, msg, sizeof msg), TD_OK);
    td_streams_t *back = NULL;
    td_state_report_t r;
    assert_int_equal(restore_into_new(dir, &back, &r), 5);
    assert_tables_equal(t, back);
    td_streams_destroy(&back);

    /* No temporary file is left behind. */
    char path[600];
    snprintf(path, sizeof path, "%s/%s.tmp", dir, TD_STATE_FILE);
    assert_int_equal(access(path, F_OK), -1);

    /* One record damaged: the other four restored, the file kept, a copy set aside. */
    snprintf(path, sizeof path, "%s/%s", dir, TD_STATE_FILE);
    buf[record_off(buf, 3) + 100] ^= 0x40;
    write_bytes(path, buf, len);
    assert_int_equal(restore_into_new(dir, &back, &r), 4);
    assert_int_equal(r.damaged, 1);
    assert_tables_equal_but(t, back, 3);
    assert_int_equal(access(path, F_OK), 0);
    uint8_t *aside[8];
    size_t aside_len[8];
    assert_int_equal(list_aside(dir, aside, aside_len), 1);
    assert_int_equal(aside_len[0], len);
    assert_memory_equal(aside[0], buf, len);
    free(aside[0]);
    td_streams_destroy(&back);
    clear_dir(dir);

    /* A damaged header: the file moved aside, nothing restored. */
    buf[25] ^= 1; /* the time written, under the header checksum */
    write_bytes(path, buf, len);
    assert_int_equal(restore_into_new(dir, &back, &r), 0);
    assert_int_equal(access(path, F_OK), -1);
    assert_int_equal(list_aside(dir, aside, aside_len), 1);
    assert_memory_equal(aside[0], buf, len);
    free(aside[0]);
    td_streams_destroy(&back);
    clear_dir(dir);

    /* No file at all: empty, nothing set aside. */
    assert_int_equal(restore_into_new(dir, &back, &r), 0);
    assert_int_equal(list_aside(dir, aside, aside_len), 0);
    td_streams_destroy(&back);

    free(buf);
    td_streams_destroy(&t);
    rmdir(dir);
}

/* Set-asides within one second never overwrite each other: three unusable files and two
 * damaged ones in a row leave five distinct copies, each with its own bytes. */
static void test_set_aside_names_are_unique(void **state)
{
    (void)state;
    char dir[] = "/tmp/tallyd-aside-XXXXXX", path[600];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/%s", dir, TD_STATE_FILE);
    td_streams_t *t = random_table(2), *back = NULL;
    uint8_t *buf = NULL;
    size_t len = 0;
    encode(t, &buf, &len);
    td_state_report_t r;
    for (int i = 0; i < 5; i++) {
        char text[64];
        if (i < 3) {
            snprintf(text, sizeof text, "not a state file, number %d", i);
            write_bytes(path, text, strlen(text));
        } else {
            buf[TD_STATE_HEADER_SIZE + 100 + (size_t)i] ^= 0xff; /* record 0, a new byte */
            write_bytes(path, buf, len);
        }
        restore_into_new(dir, &back, &r);
        td_streams_destroy(&back);
    }
    uint8_t *aside[8];
    size_t aside_len[8];
    assert_int_equal(list_aside(dir, aside, aside_len), 5);
    for (int a = 0; a < 5; a++) {
        for (int b = a + 1; b < 5; b++)
            assert_true(aside_len[a] != aside_len[b] ||
                        memcmp(aside[a], aside[b], aside_len[a]) != 0);
    }
    for (int a = 0; a < 5; a++)
        free(aside[a]);
    free(buf);
    td_streams_destroy(&t);
    clear_dir(dir);
    rmdir(dir);
}

/* streams.state or streams.state.tmp that is not a regular file: the restore refuses (tallyd
 * does not start) with a message that says what is wrong, and nothing is set aside. */
static void test_unusable_state_path_refused(void **state)
{
    (void)state;
    char dir[] = "/tmp/tallyd-path-XXXXXX", path[600], tmp[600], log[600], log_tmp[600];
    char msg[512];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/%s", dir, TD_STATE_FILE);
    snprintf(tmp, sizeof tmp, "%s/%s.tmp", dir, TD_STATE_FILE);
    snprintf(log, sizeof log, "%s/%s", dir, TD_STATE_LOG_FILE);
    snprintf(log_tmp, sizeof log_tmp, "%s/%s.tmp", dir, TD_STATE_LOG_FILE);
    td_streams_t *t = NULL;
    assert_int_equal(td_streams_new(10, &t), TD_OK);
    td_state_report_t r;
    struct {
        const char *where;
        int kind; /* 0 directory, 1 FIFO, 2 symbolic link */
        const char *says;
    } cases[] = {{path, 0, "is a directory, not a regular file"},
                 {path, 1, "is a FIFO, not a regular file"},
                 {path, 2, "is a symbolic link"},
                 {tmp, 0, "is a directory, where tallyd writes every snapshot"},
                 {log, 1, "is a FIFO, not a regular file"},
                 {log_tmp, 0, "is a directory, where tallyd writes every snapshot"}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        if (cases[c].kind == 0)
            assert_int_equal(mkdir(cases[c].where, 0700), 0);
        else if (cases[c].kind == 1)
            assert_int_equal(mkfifo(cases[c].where, 0600), 0);
        else
            assert_int_equal(symlink("/dev/null", cases[c].where), 0);
        msg[0] = '\0';
        assert_int_equal(td_state_restore(dir, t, &r, msg, sizeof msg), TD_ERR_IO);
        assert_non_null(strstr(msg, cases[c].says));
        assert_non_null(strstr(msg, cases[c].where));
        assert_int_equal(td_streams_count(t), 0);
        uint8_t *aside[8];
        size_t aside_len[8];
        assert_int_equal(list_aside(dir, aside, aside_len), 0);
        clear_dir(dir);
    }
    td_streams_destroy(&t);
    rmdir(dir);
}

/* Writes that cannot land fail with the step and the reason, even as root (a directory in the
 * way is not a permission). */
static void test_write_failures_reported(void **state)
{
    (void)state;
    char dir[] = "/tmp/tallyd-write-XXXXXX", tmp[600], missing[600], msg[512];
    assert_non_null(mkdtemp(dir));
    uint8_t *buf = NULL;
    size_t len = 0;
    td_streams_t *t = random_image(1, &buf, &len);

    snprintf(tmp, sizeof tmp, "%s/%s.tmp", dir, TD_STATE_FILE);
    assert_int_equal(mkdir(tmp, 0700), 0);
    msg[0] = '\0';
    assert_int_equal(td_state_write_file(dir, TD_STATE_FILE, buf, len, msg, sizeof msg), TD_ERR_IO);
    assert_non_null(strstr(msg, "create"));
    assert_non_null(strstr(msg, "Is a directory"));
    rmdir(tmp);

    snprintf(missing, sizeof missing, "%s/missing", dir);
    msg[0] = '\0';
    assert_int_equal(td_state_write_file(missing, TD_STATE_FILE, buf, len, msg, sizeof msg),
                     TD_ERR_IO);
    assert_non_null(strstr(msg, "No such file or directory"));

    free(buf);
    td_streams_destroy(&t);
    rmdir(dir);
}

/* ---- the log: incremental snapshots (td_state_log.c) ------------------------------------- */

/* A scratch directory whose clock file says NOW_MS (the window clock restores read). */
static void log_dir(char *dir, size_t cap)
{
    snprintf(dir, cap, "/tmp/tallyd-log-XXXXXX");
    assert_non_null(mkdtemp(dir));
    char clock[600];
    snprintf(clock, sizeof clock, "%s/clock", dir);
    FILE *f = fopen(clock, "w");
    assert_non_null(f);
    fprintf(f, "%llu\n", (unsigned long long)NOW_MS);
    fclose(f);
    td_clock_set_test_file(clock);
}

static void log_dir_done(const char *dir)
{
    td_clock_set_test_file(NULL);
    clear_dir(dir);
    rmdir(dir);
}

/* A table of n random streams with rings (8 intervals of 1 s). */
static td_streams_t *windowed_table(unsigned n)
{
    td_streams_t *t = random_table(n);
    td_streams_set_window(t, 8, 1000);
    fill_rings(t);
    return t;
}

/* What dir restores into a fresh table with the same windows (the report in *r). */
static td_streams_t *restored(const char *dir, td_state_report_t *r)
{
    td_streams_t *t = NULL;
    char msg[512] = "";
    assert_int_equal(td_streams_new(1000, &t), TD_OK);
    td_streams_set_window(t, 8, 1000);
    assert_int_equal(td_state_restore(dir, t, r, msg, sizeof msg), TD_OK);
    return t;
}

/* One snapshot of t through the store, written: its bytes (0 when nothing changed). */
static size_t snapshot(td_state_store_t *store, td_streams_t *t, bool *full)
{
    td_state_job_t *job = NULL;
    assert_int_equal(td_state_store_begin(store, t, NOW_MS, &job), TD_OK);
    if (!job)
        return 0;
    td_state_job_write(job);
    char msg[512];
    size_t written = 0;
    unsigned streams = 0;
    bool was_full = false;
    assert_int_equal(
        td_state_store_end(store, &job, msg, sizeof msg, &written, &streams, &was_full), TD_OK);
    assert_null(job);
    if (full)
        *full = was_full;
    return written;
}

static td_state_store_t *open_store(const char *dir, td_streams_t *t)
{
    td_state_store_t *store = NULL;
    char msg[512];
    assert_int_equal(td_state_store_open(dir, t, &store, msg, sizeof msg), TD_OK);
    return store;
}

/* A hist batch on stream k of t at NOW_MS (a few bins; its histogram's dtype). */
static void touch(td_streams_t *t, unsigned k)
{
    static uint64_t bins[TALLY_HIST_VALUES_MAX];
    td_stream_t *s = td_streams_first(t);
    for (unsigned i = 0; i < k; i++)
        s = s->list_next;
    char msg[256];
    if (s->info.hist_dtype == TALLY_DTYPE_NONE) {
        s->info.filter_seen += 10, s->info.elements += 10, s->info.batches++;
        td_stream_changed(s);
        return;
    }
    memset(bins, 0, sizeof bins);
    for (unsigned c = 0; c < tally_hist_channels(s->info.hist_dtype); c++)
        bins[c * TALLY_HIST_BINS + 5] = 3;
    assert_int_equal(td_stream_add_hist(s, s->info.hist_dtype, s->info.hist_lo, s->info.hist_hi,
                                        bins, 0, 0, 3, NOW_MS, msg, sizeof msg),
                     TALLY_OK);
    s->info.elements += 3, s->info.batches++;
    td_stream_changed(s);
}

/* The first snapshot writes everything; then each writes only the streams that changed (1 of
 * 60: a few per cent of the whole), removals included; a restore reads base and log back to the
 * table as it is, byte for byte. */
static void test_log_appends_what_changed(void **state)
{
    (void)state;
    char dir[64];
    log_dir(dir, sizeof dir);
    td_streams_t *t = windowed_table(60);
    td_state_store_t *store = open_store(dir, t); /* nothing there: empty */
    assert_int_equal(td_streams_count(t), 60);
    bool full = false;
    size_t whole = snapshot(store, t, &full);
    assert_true(full && whole > 60 * 200);
    assert_int_equal(snapshot(store, t, &full), 0); /* nothing changed: nothing written */
    for (int round = 0; round < 5; round++) {
        touch(t, (unsigned)(7 + 11 * round));
        size_t bytes = snapshot(store, t, &full);
        assert_false(full);
        assert_true(bytes > 0 && bytes * 20 < whole);
    }
    /* A removal, and a stream removed and made again: both as they are now. */
    td_stream_t *gone = td_streams_first(t)->list_next, *again = NULL;
    char name[TALLY_STREAM_NAME_MAX + 1];
    snprintf(name, sizeof name, "%.*s", (int)gone->name_len, gone->name);
    td_streams_remove(t, &gone);
    td_stream_t *twice = td_streams_first(t)->list_next->list_next;
    snprintf(name, sizeof name, "%.*s", (int)twice->name_len, twice->name);
    td_streams_remove(t, &twice);
    assert_int_equal(td_streams_get(t, name, strlen(name), &again), TALLY_OK);
    touch(t, td_streams_count(t) - 1);
    assert_true(snapshot(store, t, &full) > 0);
    assert_false(full);
    td_state_report_t r;
    td_streams_t *back = restored(dir, &r);
    assert_int_equal(r.version, 4);
    assert_true(r.log_used);
    assert_int_equal(r.log_records, 5 + 2 + 1);
    assert_false(td_state_report_lossy(&r));
    assert_int_equal(r.log_torn, 0);
    assert_tables_equal(t, back);
    td_streams_destroy(&back);
    td_state_store_close(&store);
    td_streams_destroy(&t);
    log_dir_done(dir);
}

/* A 4-part table (a 4-shard tallyd) from which more names are removed between two snapshots
 * than the first 1 KiB of tombstones holds, in every part (about 225 names of 6 characters
 * each): the next snapshot is a log record, not a whole one, and the restore has none of them
 * and every other stream as it is. */
static void test_log_removals_from_every_part(void **state)
{
    (void)state;
    char dir[64];
    log_dir(dir, sizeof dir);
    uint8_t *buf = NULL;
    size_t len = 0;
    td_streams_t *one = random_image(1000, &buf, &len);
    td_streams_t *t = decode_parts(buf, len, 4);
    free(buf);
    td_streams_destroy(&one);
    td_state_store_t *store = open_store(dir, t);
    bool full = false;
    assert_true(snapshot(store, t, &full) > 0);
    assert_true(full);
    unsigned removed = 0, kept = 0;
    for (unsigned i = 0; i < td_streams_parts(t); i++) {
        td_streams_t *part = td_streams_part(t, i);
        unsigned removed_here = 0;
        for (td_stream_t *s = td_streams_first(part); s; s = s->list_next, kept++) {
            for (unsigned k = 0; k < 9 && s->list_next; k++, removed_here++) {
                td_stream_t *gone = s->list_next;
                td_streams_remove(part, &gone);
                assert_null(gone);
            }
        }
        assert_true(removed_here * 7 > 1024); /* name and its length byte, past the first 1 KiB */
        removed += removed_here;
    }
    assert_int_equal(removed + kept, 1000);
    assert_int_equal(td_streams_count(t), kept);
    assert_true(snapshot(store, t, &full) > 0);
    assert_false(full);
    td_state_report_t r;
    td_streams_t *back = restored(dir, &r);
    assert_true(r.log_used);
    assert_false(td_state_report_lossy(&r));
    assert_int_equal(td_streams_count(back), kept);
    assert_tables_equal(t, back);
    td_streams_destroy(&back);
    td_state_store_close(&store);
    td_streams_destroy(&t);
    log_dir_done(dir);
}

/* A log larger than its base (and TD_STATE_LOG_MIN) is compacted: the next snapshot is whole,
 * of the next generation, with an empty log; the restore is the same. */
static void test_log_compacts(void **state)
{
    (void)state;
    char dir[64];
    log_dir(dir, sizeof dir);
    td_streams_t *t = windowed_table(24);
    td_state_store_t *store = open_store(dir, t);
    bool full = false;
    size_t base = snapshot(store, t, &full), log = TD_STATE_HEADER_SIZE;
    assert_true(full);
    int appends = 0;
    for (; appends < 1000; appends++) {
        for (unsigned k = 0; k < 24; k++)
            touch(t, k);
        size_t bytes = snapshot(store, t, &full);
        if (full)
            break;
        log += bytes;
    }
    assert_true(full);
    assert_true(log > base && log > TD_STATE_LOG_MIN);
    td_state_report_t r;
    td_streams_t *back = restored(dir, &r);
    assert_int_equal(r.generation, 2);
    assert_true(r.log_used);
    assert_int_equal(r.log_records, 0);
    assert_tables_equal(t, back);
    td_streams_destroy(&back);
    td_state_store_close(&store);
    td_streams_destroy(&t);
    log_dir_done(dir);
}

/* The log's bytes in *len (malloc'ed). */
static uint8_t *read_log(const char *dir, size_t *len)
{
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, TD_STATE_LOG_FILE);
    return read_whole(path, len);
}

static void write_log(const char *dir, const uint8_t *buf, size_t len)
{
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, TD_STATE_LOG_FILE);
    write_bytes(path, buf, len);
}

/* A crash in the middle of an append leaves its last record cut off: the restore applies every
 * whole record and ignores the rest (not a loss: it was never written whole), and the next
 * append writes over it; a record damaged in the middle of the log is skipped, its stream keeps
 * the state of an earlier snapshot, every later record applies, and the log is copied aside
 * and compacted at the next snapshot. */
static void test_log_torn_and_damaged(void **state)
{
    (void)state;
    char dir[64];
    log_dir(dir, sizeof dir);
    td_streams_t *t = windowed_table(12);
    td_state_store_t *store = open_store(dir, t);
    bool full = false;
    snapshot(store, t, &full);
    td_streams_t *at_base = restored(dir, &(td_state_report_t){0});
    touch(t, 3);
    snapshot(store, t, NULL);
    touch(t, 4);
    touch(t, 5);
    snapshot(store, t, NULL);
    size_t len = 0;
    uint8_t *log = read_log(dir, &len);
    /* The last append (streams 4 and 5) cut inside its second record. */
    size_t off = TD_STATE_HEADER_SIZE, ends[8];
    unsigned n = 0;
    while (off < len && n < 8) {
        off += tally_get_u32(log + off + 8);
        ends[n++] = off;
    }
    assert_int_equal(n, 3);
    write_log(dir, log, ends[2] - 7);
    td_state_report_t r;
    td_streams_t *back = restored(dir, &r);
    assert_int_equal(r.log_records, 2);
    assert_int_equal(r.log_torn, ends[2] - 7 - ends[1]);
    assert_false(td_state_report_lossy(&r));
    assert_tables_like(t, back, 5, true); /* 5 is as the base had it */
    static uint8_t px[TALLY_QUERY_PAYLOAD_MAX], py[TALLY_QUERY_PAYLOAD_MAX];
    const td_stream_t *b5 = td_streams_first(back), *o5 = td_streams_first(at_base);
    for (int i = 0; i < 5; i++)
        b5 = b5->list_next, o5 = o5->list_next;
    size_t pl = payload_of(b5, px);
    assert_int_equal(payload_of(o5, py), pl);
    assert_memory_equal(px, py, pl);
    td_streams_destroy(&back);
    /* A store opened on it appends after the whole records: stream 5 again, and 6. */
    td_state_store_close(&store);
    td_streams_t *t2 = NULL;
    assert_int_equal(td_streams_new(1000, &t2), TD_OK);
    td_streams_set_window(t2, 8, 1000);
    store = open_store(dir, t2);
    touch(t2, 5);
    touch(t2, 6);
    assert_true(snapshot(store, t2, &full) > 0);
    assert_false(full);
    back = restored(dir, &r);
    assert_int_equal(r.log_torn, 0);
    assert_int_equal(r.log_records, 4);
    assert_tables_equal(t2, back);
    td_streams_destroy(&back);

    /* Now the middle record (stream 4's, the second) damaged: 4 keeps its base state, 5 and 6
     * (after it) apply, the log is copied aside, the next snapshot compacts. */
    free(log);
    log = read_log(dir, &len);
    log[ends[1] - 30] ^= 0x20;
    write_log(dir, log, len);
    td_state_store_close(&store);
    td_streams_t *t3 = NULL;
    assert_int_equal(td_streams_new(1000, &t3), TD_OK);
    td_streams_set_window(t3, 8, 1000);
    store = open_store(dir, t3);
    back = restored(dir, &r);
    assert_int_equal(r.log_damaged, 1);
    assert_int_equal(r.log_records, 3); /* the whole ones */
    assert_true(td_state_report_lossy(&r));
    assert_tables_equal(t3, back);
    td_stream_t *x4 = td_streams_first(t3);
    const td_stream_t *a4 = td_streams_first(at_base);
    for (int i = 0; i < 4; i++)
        x4 = x4->list_next, a4 = a4->list_next;
    pl = payload_of(x4, px);
    assert_int_equal(payload_of(a4, py), pl);
    assert_memory_equal(px, py, pl);
    bool aside = false;
    DIR *dp = opendir(dir);
    for (struct dirent *e; (e = readdir(dp));)
        aside |= strncmp(e->d_name, "streams.log.corrupt-", 20) == 0;
    closedir(dp);
    assert_true(aside);
    assert_true(snapshot(store, t3, &full) > 0);
    assert_true(full);
    td_streams_destroy(&back);
    back = restored(dir, &r);
    assert_false(td_state_report_lossy(&r));
    assert_tables_equal(t3, back);
    td_streams_destroy(&back);
    free(log);
    td_state_store_close(&store);
    td_streams_destroy(&t3);
    td_streams_destroy(&t2);
    td_streams_destroy(&at_base);
    td_streams_destroy(&t);
    log_dir_done(dir);
}

/* The compaction's crash windows (td_state.h): before its base is renamed, the old base and
 * log are the state; after, the new base alone is (the old log, of the generation before, is
 * ignored: applying it would bring back an older state of stream 2); after the log is renamed
 * too, the new pair. A store opened on the middle window compacts again, to a generation never
 * used before. */
static void test_log_compaction_crash_windows(void **state)
{
    (void)state;
    char dir[64], base_path[600], tmp_path[600], log_tmp[600];
    log_dir(dir, sizeof dir);
    snprintf(base_path, sizeof base_path, "%s/%s", dir, TD_STATE_FILE);
    snprintf(tmp_path, sizeof tmp_path, "%s/%s.tmp", dir, TD_STATE_FILE);
    snprintf(log_tmp, sizeof log_tmp, "%s/%s.tmp", dir, TD_STATE_LOG_FILE);
    td_streams_t *t = windowed_table(10);
    td_state_store_t *store = open_store(dir, t);
    snapshot(store, t, NULL); /* generation 1 */
    touch(t, 2);
    snapshot(store, t, NULL); /* the log holds stream 2 as it is now */
    td_state_report_t r;
    td_streams_t *before = restored(dir, &r);
    size_t base2_len = 0;
    touch(t, 2);
    touch(t, 3);
    uint8_t *base2 = NULL, log2[TD_STATE_HEADER_SIZE];
    assert_int_equal(td_state_encode(t, NOW_MS, 2, &base2, &base2_len), TD_OK);
    td_state_log_header(2, log2);

    write_bytes(tmp_path, base2, base2_len / 2); /* 1: the new base half written */
    td_streams_t *back = restored(dir, &r);
    assert_true(r.log_used && !td_state_report_lossy(&r));
    assert_tables_equal(before, back);
    td_streams_destroy(&back);

    write_bytes(base_path, base2, base2_len); /* 2: renamed; the log is the old one's */
    write_bytes(log_tmp, log2, sizeof log2);
    back = restored(dir, &r);
    assert_true(r.log_stale && !r.log_used);
    assert_tables_equal(t, back);
    td_streams_destroy(&back);
    td_streams_t *t2 = NULL;
    assert_int_equal(td_streams_new(1000, &t2), TD_OK);
    td_streams_set_window(t2, 8, 1000);
    td_state_store_t *store2 = open_store(dir, t2);
    bool full = false;
    assert_true(snapshot(store2, t2, &full) > 0);
    assert_true(full);
    size_t len = 0;
    uint8_t *now_base = read_whole(base_path, &len), *now_log = read_log(dir, &len);
    assert_int_equal(tally_get_u64(now_base + 16), 3);
    assert_int_equal(tally_get_u64(now_log + 16), 3);
    free(now_base);
    free(now_log);
    td_state_store_close(&store2);
    td_streams_destroy(&t2);

    write_bytes(base_path, base2, base2_len); /* 3: both renamed */
    write_log(dir, log2, sizeof log2);
    back = restored(dir, &r);
    assert_true(r.log_used && r.log_records == 0 && !td_state_report_lossy(&r));
    assert_int_equal(r.generation, 2);
    assert_tables_equal(t, back);
    td_streams_destroy(&back);

    free(base2);
    td_streams_destroy(&before);
    td_state_store_close(&store);
    td_streams_destroy(&t);
    log_dir_done(dir);
}

/* An append that fails (the log's path blocked) says why, and the next snapshot writes every
 * stream: nothing the failed one held is lost. */
static void test_log_failed_append_compacts(void **state)
{
    (void)state;
    char dir[64], log_path[600];
    log_dir(dir, sizeof dir);
    snprintf(log_path, sizeof log_path, "%s/%s", dir, TD_STATE_LOG_FILE);
    td_streams_t *t = windowed_table(6);
    td_state_store_t *store = open_store(dir, t);
    snapshot(store, t, NULL);
    assert_int_equal(remove(log_path), 0);
    assert_int_equal(mkdir(log_path, 0700), 0);
    touch(t, 1);
    td_state_job_t *job = NULL;
    assert_int_equal(td_state_store_begin(store, t, NOW_MS, &job), TD_OK);
    assert_non_null(job);
    td_state_job_write(job);
    char msg[512] = "";
    size_t written = 0;
    unsigned streams = 0;
    bool full = true;
    assert_int_equal(td_state_store_end(store, &job, msg, sizeof msg, &written, &streams, &full),
                     TD_ERR_IO);
    assert_false(full);
    assert_non_null(strstr(msg, log_path));
    assert_int_equal(rmdir(log_path), 0);
    assert_true(snapshot(store, t, &full) > 0); /* nothing changed since, but written whole */
    assert_true(full);
    td_state_report_t r;
    td_streams_t *back = restored(dir, &r);
    assert_false(td_state_report_lossy(&r));
    assert_tables_equal(t, back);
    td_streams_destroy(&back);
    td_state_store_close(&store);
    td_streams_destroy(&t);
    log_dir_done(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_shards_spread_a_partition),
        cmocka_unit_test(test_every_truncation),
        cmocka_unit_test(test_every_bit_flip_loses_only_its_stream),
        cmocka_unit_test(test_header_errors_under_a_good_checksum),
        cmocka_unit_test(test_invariant_violations_refuse_only_that_stream),
        cmocka_unit_test(test_record_carries_the_query_head),
        cmocka_unit_test(test_version_1_restores),
        cmocka_unit_test(test_version_2_restores),
        cmocka_unit_test(test_window_rings),
        cmocka_unit_test(test_version_3_file_flips),
        cmocka_unit_test(test_max_streams_respected),
        cmocka_unit_test(test_write_restore_and_set_aside),
        cmocka_unit_test(test_set_aside_names_are_unique),
        cmocka_unit_test(test_unusable_state_path_refused),
        cmocka_unit_test(test_write_failures_reported),
        cmocka_unit_test(test_log_appends_what_changed),
        cmocka_unit_test(test_log_removals_from_every_part),
        cmocka_unit_test(test_log_compacts),
        cmocka_unit_test(test_log_torn_and_damaged),
        cmocka_unit_test(test_log_compaction_crash_windows),
        cmocka_unit_test(test_log_failed_append_compacts),
        cmocka_unit_test(test_encode_some_keeps_only_filtered),
        cmocka_unit_test(test_state_across_shard_counts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
