/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_transport.c — the transport interface (daemon/core/td_transport.h) from a transport that
 * is not a socket: a "broker" like issue 22's NATS consumer, which submits messages as bytes,
 * learns from send_reply that a request's effect is done (to acknowledge it), and holds reply
 * payloads as long as it likes. The real request path runs (td_path.c: decoding, admission, the
 * scheduler, exactly-once numbered requests, the CPU backend), with no ZeroMQ and no loop: the
 * machine runs inline requests at once and the others when the test drains it.
 *
 * What it checks:
 *   - every submitted message gets exactly one send_reply, numbered requests on a stream apply in
 *     order and once (a redelivered seq is answered `duplicate`, the stream unchanged), and every
 *     payload the transport handed over is freed exactly once;
 *   - a reply's payload counts toward the reply bytes (td_reply.h) until the transport frees it,
 *     even after td_reply_end, and not after;
 *   - a message without two request frames is answered `frames`, echoing the header's id;
 *   - a payload the transport only lends is copied: the path never frees it, and the transport
 *     may write over it once td_path_submit returns;
 *   - a payload in the transport's holder is moved into the request's room once and released
 *     there once; an ok reply keeps a copy of its header beside its payload (header_kept);
 *   - td_path_may_read says no at max_inflight, yes again once replies leave;
 *   - tallyd's own requests (no sender id) make no per-peer entry; a named sender does;
 *   - a stopping path answers `shutdown`.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "td_path.h"
#include "td_settings.h"
#include "tk_backend.h"

#define REPLIES_MAX 64
#define RUNNING_MAX 64

typedef struct {
    uint64_t id;
    uint32_t status;
    uint64_t aux0;
    bool header_kept; /* td_reply_t.header_kept set (and equal to the header) */
} seen_t;

/* The broker transport, the path and what the test watches. */
typedef struct {
    td_transport_t base; /* first */
    td_config_t cfg;
    td_metrics_t metrics;
    td_streams_t *streams;
    td_peers_t *peers;
    td_replies_t *replies;
    td_path_t *path;
    tk_backend_t *cpu;
    td_request_t *running[RUNNING_MAX]; /* handed to a worker, not finished */
    unsigned running_count;
    seen_t seen[REPLIES_MAX]; /* replies, in the order they came */
    unsigned seen_count;
    bool keep_bodies; /* take each reply's payload, freed by the test */
    td_bytes_t kept[REPLIES_MAX];
    unsigned kept_count;
    unsigned payloads_freed; /* the payloads the path gave back */
} broker_t;

static broker_t *the_broker; /* the payloads' free function counts here */

/* ---- the transport ----------------------------------------------------------------------------
 */

static void broker_send_reply(td_transport_t *t, td_reply_t *reply)
{
    broker_t *b = (broker_t *)t;
    assert_true(b->seen_count < REPLIES_MAX);
    if (reply->header_kept)
        assert_memory_equal(reply->header_kept, reply->header, sizeof reply->header);
    b->seen[b->seen_count++] = (seen_t){.id = reply->rep.request_id,
                                        .status = reply->rep.status,
                                        .aux0 = reply->rep.aux0,
                                        .header_kept = reply->header_kept != NULL};
    if (b->keep_bodies && reply->body.data) { /* held past td_reply_end: still counted */
        b->kept[b->kept_count++] = reply->body;
        td_bytes_taken(&reply->body);
    }
    td_reply_end(reply, TD_REPLY_SENT); /* the effect is done: a broker would ack now */
}

static const td_transport_ops_t broker_ops = {.name = "broker", .send_reply = broker_send_reply};

static void payload_free(void *data, void *hint)
{
    (void)hint;
    free(data);
    the_broker->payloads_freed++;
}

/* ---- the machine: the CPU backend, inline at once, else when drained ------------------------- */

static void machine_run(void *ctx, td_request_t *r)
{
    broker_t *b = ctx;
    if (r->where.cpu_inline) {
        td_request_execute(r, b->cpu);
        td_path_finished(b->path, r);
        return;
    }
    assert_true(b->running_count < RUNNING_MAX);
    b->running[b->running_count++] = r;
}

static void drain(broker_t *b)
{
    while (b->running_count) {
        td_request_t *r = b->running[0];
        memmove(b->running, b->running + 1, --b->running_count * sizeof b->running[0]);
        td_request_execute(r, b->cpu);
        td_path_finished(b->path, r);
    }
}

static void answer_here(void *owner, td_request_t *r)
{
    (void)owner;
    td_request_succeed(r, TALLY_DTYPE_NONE, NULL, 0, 0);
}

/* The one shard's machine (td_path_machines_t). */
static td_err_t machine_open(void *ctx, unsigned shard, uv_loop_t *loop, td_sched_machine_t *m)
{
    (void)shard;
    (void)loop;
    *m = (td_sched_machine_t){.ctx = ctx, .cpu_workers = 2, .run = machine_run};
    return TD_OK;
}

static broker_t *broker_new(unsigned max_inflight)
{
    broker_t *b = calloc(1, sizeof *b);
    assert_non_null(b);
    the_broker = b;
    td_config_init(&b->cfg);
    b->cfg.max_inflight = max_inflight;
    b->cfg.backend = TD_BACKEND_CPU;
    assert_int_equal(td_streams_new(100, &b->streams), TD_OK);
    assert_int_equal(td_peers_new(&b->peers), TD_OK);
    assert_int_equal(td_replies_new(&b->cfg, &b->replies), TD_OK);
    assert_int_equal(tk_cpu_backend_new(&b->cpu), TALLY_OK);
    td_path_env_t env = {.cfg = &b->cfg,
                         .metrics = &b->metrics,
                         .streams = b->streams,
                         .peers = b->peers,
                         .replies = b->replies,
                         .answer_here = answer_here,
                         .owner = b};
    assert_int_equal(td_path_new(&env, &b->path), TD_OK);
    td_path_machines_t machines = {.open = machine_open, .ctx = b};
    assert_int_equal(td_path_start(b->path, &machines), TD_OK);
    b->base = (td_transport_t){.ops = &broker_ops, .path = b->path};
    return b;
}

static uint64_t reply_held(broker_t *b)
{
    td_reply_gauges_t g = {0};
    td_replies_gauges(b->replies, &g);
    return g.held;
}

static void broker_destroy(broker_t **b_p)
{
    broker_t *b = *b_p;
    drain(b);
    for (unsigned i = 0; i < b->kept_count; i++)
        td_bytes_free(&b->kept[i]);
    assert_int_equal(reply_held(b), 0);
    assert_int_equal(td_path_inflight(b->path), 0);
    td_path_destroy(&b->path);
    b->cpu->destroy(&b->cpu);
    td_peers_destroy(&b->peers);
    td_replies_destroy(&b->replies);
    td_streams_destroy(&b->streams);
    td_config_clear(&b->cfg);
    free(b);
    *b_p = NULL;
}

/* ---- submitting ------------------------------------------------------------------------------ */

typedef struct {
    uint8_t op, dtype;
    const char *stream;
    uint64_t id, seq;
    size_t bytes;       /* payload: bytes of 1, 2, 3, ... */
    const char *sender; /* NULL: tallyd's own */
    int frames;         /* 0: 2 */
} sub_t;

static td_err_t submit(broker_t *b, sub_t s)
{
    tally_req_t req = {.opcode = s.op, .dtype = s.dtype, .request_id = s.id, .seq = s.seq};
    if (s.stream)
        assert_int_equal(tally_req_set_stream(&req, s.stream), TALLY_OK);
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(&req, header);
    uint8_t *data = malloc(s.bytes ? s.bytes : 1);
    assert_non_null(data);
    for (size_t i = 0; i < s.bytes; i++)
        data[i] = (uint8_t)(i + 1);
    td_msg_t m = {
        .from = {.id = (const uint8_t *)s.sender, .id_len = s.sender ? strlen(s.sender) : 0},
        .header = header,
        .header_len = sizeof header,
        .payload = {.data = data, .len = s.bytes, .free_fn = payload_free},
        .frames = s.frames ? s.frames : 2,
    };
    return td_path_submit(b->path, &b->base, &m);
}

static td_stream_t *stream_of(broker_t *b, const char *name)
{
    return td_streams_find(b->streams, name, strlen(name));
}

/* ---- tests ----------------------------------------------------------------------------------- */

static void test_numbered_requests_apply_once_in_order(void **state)
{
    (void)state;
    broker_t *b = broker_new(64);
    /* Large enough for a worker (TD_EXEC_INLINE_MAX), so requests of one stream overlap. */
    size_t big = 64u << 10;
    for (uint64_t seq = 1; seq <= 4; seq++)
        assert_int_equal(submit(b, (sub_t){TALLY_OP_HIST, TALLY_DTYPE_U8, "p0", 100 + seq, seq, big,
                                           "producer-1", 0}),
                         TD_OK);
    /* The broker redelivers seq 2 (its ack was lost): not applied twice. */
    assert_int_equal(
        submit(b, (sub_t){TALLY_OP_HIST, TALLY_DTYPE_U8, "p0", 200, 2, big, "producer-1", 0}),
        TD_OK);
    drain(b);
    assert_int_equal(b->seen_count, 5);
    for (unsigned i = 0; i < 4; i++) {
        assert_int_equal(b->seen[i].id, 101 + i);
        assert_int_equal(b->seen[i].status, TALLY_OK);
    }
    assert_int_equal(b->seen[4].id, 200);
    assert_int_equal(b->seen[4].status, TALLY_E_DUPLICATE);
    assert_int_equal(b->seen[4].aux0, 4); /* the stream's last applied seq */
    td_stream_t *st = stream_of(b, "p0");
    assert_non_null(st);
    assert_int_equal(st->info.batches, 4);
    assert_int_equal(st->info.hist_total, 4 * big);
    assert_int_equal(st->info.last_seq, 4);
    assert_int_equal(b->payloads_freed, 5); /* each payload handed over, freed once */
    broker_destroy(&b);
}

static void test_reply_bytes_count_until_the_transport_frees_them(void **state)
{
    (void)state;
    broker_t *b = broker_new(64);
    b->keep_bodies = true;
    /* A stateless int32 scan of 1024 elements: int64 sums, 8 KiB of reply. */
    assert_int_equal(
        submit(b, (sub_t){TALLY_OP_SCAN, TALLY_DTYPE_I32, NULL, 7, 0, 4096, "analyst", 0}), TD_OK);
    drain(b);
    assert_int_equal(b->seen_count, 1);
    assert_int_equal(b->seen[0].status, TALLY_OK);
    assert_int_equal(b->kept_count, 1);
    assert_int_equal(b->kept[0].len, 8192);
    assert_int_equal(reply_held(b), 8192); /* td_reply_end has run; the bytes are still held */
    td_bytes_free(&b->kept[0]);
    assert_int_equal(reply_held(b), 0);
    b->kept_count = 0;
    broker_destroy(&b);
}

static void test_frames_answered_with_the_header_id(void **state)
{
    (void)state;
    broker_t *b = broker_new(64);
    assert_int_equal(submit(b, (sub_t){TALLY_OP_PING, 0, NULL, 42, 0, 0, "peer", 3}), TD_OK);
    td_msg_t none = {.from = {.id = (const uint8_t *)"peer", .id_len = 4}, .frames = 0};
    assert_int_equal(td_path_submit(b->path, &b->base, &none), TD_OK);
    assert_int_equal(b->seen_count, 2);
    assert_int_equal(b->seen[0].id, 42);
    assert_int_equal(b->seen[0].status, TALLY_E_FRAMES);
    assert_int_equal(b->seen[1].id, 0);
    assert_int_equal(b->seen[1].status, TALLY_E_FRAMES);
    assert_int_equal(b->payloads_freed, 1); /* the refused message's payload too */
    broker_destroy(&b);
}

static void lent_free(void *data, void *hint)
{
    (void)data;
    (void)hint;
    fail_msg("the path freed a payload its transport only lent");
}

/* Request 1, a 64 KiB hist on stream p0 from "producer", left running on a worker; header: the
 * encoded header of request 2, a hist on p0, which will wait behind it. */
static void hist_behind_a_running_one(broker_t *b, uint8_t header[TALLY_REQ_HEADER_SIZE])
{
    assert_int_equal(
        submit(b, (sub_t){TALLY_OP_HIST, TALLY_DTYPE_U8, "p0", 1, 0, 64u << 10, "producer", 0}),
        TD_OK);
    assert_int_equal(b->running_count, 1); /* on a worker: the next of p0 waits for it */
    tally_req_t req = {.opcode = TALLY_OP_HIST, .dtype = TALLY_DTYPE_U8, .request_id = 2};
    assert_int_equal(tally_req_set_stream(&req, "p0"), TALLY_OK);
    tally_req_encode(&req, header);
}

/* A payload the transport lends (td_msg_t.payload_borrowed) is its own again once td_path_submit
 * returns: the path copies it. The lent hist waits behind a running one on its stream, the
 * transport overwrites its buffer, and the stream still counts the bytes it lent. */
static void test_lent_payload_is_copied(void **state)
{
    (void)state;
    broker_t *b = broker_new(64);
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    hist_behind_a_running_one(b, header);
    uint8_t lent[TD_PAYLOAD_BORROW_MAX];
    memset(lent, 200, sizeof lent);
    td_msg_t m = {
        .from = {.id = (const uint8_t *)"producer", .id_len = 8},
        .header = header,
        .header_len = sizeof header,
        .payload = {.data = lent, .len = sizeof lent, .free_fn = lent_free},
        .payload_borrowed = true,
        .frames = 2,
    };
    assert_int_equal(td_path_submit(b->path, &b->base, &m), TD_OK);
    assert_int_equal(b->seen_count, 0);
    memset(lent, 201, sizeof lent); /* the transport's buffer again */
    drain(b);
    assert_int_equal(b->seen_count, 2);
    assert_int_equal(b->seen[1].id, 2);
    assert_int_equal(b->seen[1].status, TALLY_OK);
    td_stream_t *st = stream_of(b, "p0");
    assert_non_null(st);
    uint64_t bins[256];
    td_bins_get(&st->bins, 256, bins);
    /* the first batch (bytes 1, 2, 3, ...) put 256 in every bin; the lent one 256 more in 200 */
    assert_int_equal(bins[200], 256 + sizeof lent);
    assert_int_equal(bins[201], 256);
    assert_int_equal(b->payloads_freed, 1); /* the first one's; the lent one is not freed */
    broker_destroy(&b);
}

/* A transport's holder of a payload (td_msg_t.hold; ZeroMQ's frame), as it lies in the request's
 * room. */
typedef struct {
    uint8_t *data;
    size_t len;
    void *where; /* the room it was moved into */
} holder_t;

_Static_assert(sizeof(holder_t) <= TD_PAYLOAD_HOLDER_MAX, "a holder fits the room");

static unsigned holds_made;

static void holder_release(void *data, void *hint)
{
    holder_t *h = hint;
    assert_ptr_equal(h->where, hint); /* released where it was moved to */
    assert_ptr_equal(h->data, data);
    free(h->data);
    h->data = NULL;
    the_broker->payloads_freed++;
}

static td_bytes_t holder_move(void *room, void *ctx)
{
    holder_t *from = ctx, *h = room;
    *h = *from;
    h->where = room;
    from->data = NULL; /* moved: the transport's is empty */
    holds_made++;
    return (td_bytes_t){.data = h->data, .len = h->len, .free_fn = holder_release, .hint = h};
}

/* A payload in the transport's holder (td_msg_t.hold) is moved into its request once, read from
 * there (the hist waits behind a running one on its stream meanwhile), and released there once.
 * An ok reply with a payload keeps a copy of its header beside it (td_reply_t.header_kept, equal
 * to the header: the broker checks every reply); an error reply has none. */
static void test_held_payload_stays_in_its_request(void **state)
{
    (void)state;
    broker_t *b = broker_new(64);
    holds_made = 0;
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    hist_behind_a_running_one(b, header);
    holder_t frame = {.data = malloc(4096), .len = 4096};
    assert_non_null(frame.data);
    memset(frame.data, 200, frame.len);
    td_msg_t m = {
        .from = {.id = (const uint8_t *)"producer", .id_len = 8},
        .header = header,
        .header_len = sizeof header,
        .hold = holder_move,
        .hold_ctx = &frame,
        .frames = 2,
    };
    assert_int_equal(td_path_submit(b->path, &b->base, &m), TD_OK);
    assert_int_equal(holds_made, 1);
    assert_null(frame.data); /* moved into the request */
    assert_int_equal(b->seen_count, 0);
    assert_int_equal(b->payloads_freed, 0);
    drain(b);
    assert_int_equal(b->seen_count, 2);
    assert_int_equal(b->seen[1].id, 2);
    assert_int_equal(b->seen[1].status, TALLY_OK);
    assert_true(b->seen[1].header_kept);
    td_stream_t *st = stream_of(b, "p0");
    assert_non_null(st);
    uint64_t bins[256];
    td_bins_get(&st->bins, 256, bins);
    assert_int_equal(bins[200], 256 + 4096);
    assert_int_equal(b->payloads_freed, 2); /* the first one, and the held one in its room */
    assert_int_equal(
        submit(b, (sub_t){TALLY_OP_HIST, TALLY_DTYPE_U8, NULL, 3, 0, 16, "producer", 3}),
        TD_OK); /* three frames: answered `frames`, an error without a kept header */
    assert_int_equal(b->seen_count, 3);
    assert_int_equal(b->seen[2].status, TALLY_E_FRAMES);
    assert_false(b->seen[2].header_kept);
    broker_destroy(&b);
}

static void test_may_read_follows_the_inflight_limit(void **state)
{
    (void)state;
    broker_t *b = broker_new(2);
    assert_true(td_path_may_read(b->path));
    for (uint64_t id = 1; id <= 2; id++)
        assert_int_equal(submit(b, (sub_t){TALLY_OP_HIST, TALLY_DTYPE_U8, NULL, id, 0, 64u << 10,
                                           "producer", 0}),
                         TD_OK);
    assert_false(td_path_may_read(b->path)); /* two running on the workers */
    drain(b);
    assert_int_equal(b->seen_count, 2);
    assert_true(td_path_may_read(b->path));
    broker_destroy(&b);
}

static void test_own_requests_skip_the_peer_table(void **state)
{
    (void)state;
    broker_t *b = broker_new(64);
    assert_int_equal(submit(b, (sub_t){TALLY_OP_PING, 0, NULL, 1, 0, 0, NULL, 0}), TD_OK);
    assert_int_equal(td_peers_count(b->peers), 0);
    assert_int_equal(submit(b, (sub_t){TALLY_OP_PING, 0, NULL, 2, 0, 0, "someone", 0}), TD_OK);
    assert_int_equal(b->seen_count, 2);
    assert_int_equal(b->seen[1].status, TALLY_OK);
    assert_true(td_peers_count(b->peers) > 0); /* a sender with an id is known (until swept) */
    broker_destroy(&b);
}

static void test_stopping_answers_shutdown(void **state)
{
    (void)state;
    broker_t *b = broker_new(64);
    td_path_stop(b->path);
    assert_true(td_path_may_read(b->path)); /* still read, to be answered, until the drain ends */
    assert_int_equal(submit(b, (sub_t){TALLY_OP_HIST, TALLY_DTYPE_U8, "p1", 9, 1, 100, "x", 0}),
                     TD_OK);
    assert_int_equal(b->seen_count, 1);
    assert_int_equal(b->seen[0].id, 9);
    assert_int_equal(b->seen[0].status, TALLY_E_SHUTDOWN);
    assert_null(stream_of(b, "p1"));
    td_path_drain_over(b->path);
    assert_false(td_path_may_read(b->path));
    broker_destroy(&b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_numbered_requests_apply_once_in_order),
        cmocka_unit_test(test_reply_bytes_count_until_the_transport_frees_them),
        cmocka_unit_test(test_frames_answered_with_the_header_id),
        cmocka_unit_test(test_lent_payload_is_copied),
        cmocka_unit_test(test_held_payload_stays_in_its_request),
        cmocka_unit_test(test_may_read_follows_the_inflight_limit),
        cmocka_unit_test(test_own_requests_skip_the_peer_table),
        cmocka_unit_test(test_stopping_answers_shutdown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
