/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_standby.c — standby copies (`[nats] standbys = 1`, issue 33; docs/fleet.md
 * "Standbys"): for each partition this member comes next for in the rendezvous order (the one
 * the plan gives it to when its owner goes), a warm copy of its streams, which a take-over
 * uses instead of the checkpoint and the whole changelog tail after it.
 *
 * A copy is a checkpoint plus the changelog records after its cl_seq, applied in order with the
 * replay's own code (td_changelog_apply: its epoch rule too). It is what a take would load only
 * while every change since that checkpoint is in the changelog, which JetStream ingest and a
 * `local` owner break (bench/NOTES.md, "Standbys: what one would buy"). A manifest says so when
 * its cl_since covers the checkpoint the copy started from (td_ckpt_since_covers: its owner
 * claims it only while that holds, td_standby_claim, called at each checkpoint by td_fleet_part.c).
 * So the rule: at every new checkpoint it sees (the manifest key's revision, read when a write of
 * the key comes on $KV.TALLY_CKPT.<key>, and every TD_STANDBY_CHECK_MS besides) the copy runs on
 * when the new manifest's cl_since covers its start, and starts again from it otherwise (one decode
 * of the partition's state); a take uses the copy when the manifest it fences is the very
 * checkpoint the copy started from (same epoch and generation), or covers its start and the copy
 * has applied the changelog to that checkpoint's cl_seq at least. Anything else (a record that does
 * not apply, a gap in the sequences, a subscription that failed) drops the copy until the next
 * check starts it again; a take meanwhile loads as without standbys.
 *
 * Threads. The fleet thread reads the manifest and the checkpoint (td_ckpt_read, as a take
 * does), and drains the changelog's messages from an ordered push consumer (JetStream sends
 * them as they are stored: no round trip a record, unlike a take's replay); the records are
 * applied on the loop thread through td_fleet_on_loop, like the replay's, because the record
 * parser and the window decoder keep their scratch in `static` buffers of the loop thread
 * (td_state.c, td_window.c); but with the shards left running (td_fleet_on_loop_unheld: a
 * copy's apply costs the member's own streams nothing but the loop thread's time). The copy's
 * table is its own (td_streams_new), never the stream table, and only the loop thread touches
 * it while it lives; the fleet thread creates it, sets its budget and frees it between loop
 * calls.
 *
 * Memory. Each copy's table has a budget: max_state_bytes less what the member's other copies
 * hold, set before each apply, so all the copies together stay under one max_state_bytes apart
 * from the member's own streams (a member with standbys holds up to twice its state); a record
 * the budget refuses drops the copy (the take then loads the checkpoint).
 *
 * Queries with Tally-Stale-Ok (PROTOCOL.md §13 "Answers by request-reply") are answered from
 * the copy (td_standby_answer), marked stale by the caller with the sequence it holds.
 *
 * At the take (td_standby_load): the copy is encoded and loaded into the stream table as a
 * checkpoint's state would be (a local copy, no read from NATS), and the changelog is replayed
 * only after the copy's last record; then the copy goes, used or not.
 */
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tally_nats_conn.h"
#include "td_fleet_changelog.h"
#include "td_fleet_int.h"
#include "td_nats_js.h"
#include "td_log.h"
#include "td_state.h"
#include "td_stream.h"

/* How often a copy looks at its partition's manifest for a new checkpoint when no write of the
 * key told it sooner (the manifest keys' writes come as they are stored, $KV.TALLY_CKPT.*, but a
 * plain subscription may miss one, or not be allowed): a take uses a copy only when the
 * checkpoint it fences is the copy's, so a copy that saw a checkpoint late is useless until
 * then. */
#define TD_STANDBY_CHECK_MS 1000
#define MANIFESTS_SUBJECT "$KV." TALLY_NATS_BUCKET_CKPT ".*"
/* A copy's turn drains at most this many changelog messages (the other partitions' turn). */
#define TD_STANDBY_STEP_MESSAGES 256

typedef struct td_standby {
    bool wanted;                /* the plan puts this member next for the partition */
    td_streams_t *table;        /* the copy (NULL: none now) */
    natsSubscription *sub;      /* its changelog, from cl_seq + 1 */
    uint64_t revision;          /* the manifest key's revision it started from (0: no manifest) */
    uint64_t epoch, generation; /* that checkpoint's */
    uint64_t cl_seq;    /* the last changelog sequence applied (the checkpoint's at first) */
    uint64_t max_epoch; /* the highest record epoch applied (the replay's rule) */
    size_t bytes;       /* its table's, at its last apply */
    int64_t next_check_ms;
} td_standby_t;

static td_standby_t *standby_of(td_fleet_t *f, uint32_t k)
{
    return f->standbys ? &f->standbys[k] : NULL;
}

typedef struct {
    td_streams_t *table;
    const uint8_t *buf;
    size_t len;
    td_err_t err;
    char msg[256];
    uint8_t *out; /* encode: the copy's state */
    size_t out_len;
} copy_job_t;

static void free_on_loop(td_fleet_t *f, void *arg)
{
    (void)f;
    td_streams_destroy(arg);
}

static void decode_on_loop(td_fleet_t *f, void *arg)
{
    (void)f;
    copy_job_t *j = arg;
    td_state_report_t report;
    j->err =
        td_state_decode(j->buf, j->len, td_clock_ms(), j->table, &report, j->msg, sizeof j->msg);
    if (j->err == TD_OK && td_state_report_lossy(&report)) {
        snprintf(j->msg, sizeof j->msg, "%u of %u streams loaded", report.restored, report.records);
        j->err = TD_ERR_CORRUPT;
    }
}

static bool every_stream(const td_stream_t *s, void *arg)
{
    (void)s;
    (void)arg;
    return true;
}

/* A checkpoint's state is a base image alone: generation 1 (td_fleet_table.c). */
static void encode_on_loop(td_fleet_t *f, void *arg)
{
    (void)f;
    copy_job_t *j = arg;
    j->err =
        td_state_encode_some(j->table, td_clock_ms(), 1, every_stream, NULL, &j->out, &j->out_len);
}

static void size_on_loop(td_fleet_t *f, void *arg)
{
    (void)f;
    copy_job_t *j = arg;
    j->out_len = td_streams_bytes(j->table);
}

/* The budget of partition k's copy: max_state_bytes less the other copies' bytes. */
static void set_budget(td_fleet_t *f, uint32_t k)
{
    size_t max = f->host.cfg->max_state_bytes, others = 0;
    for (uint32_t i = 0; i < f->partitions; i++)
        if (i != k)
            others += f->standbys[i].bytes;
    td_streams_set_budget(f->standbys[k].table, others < max ? max - others : 1, 0);
}

static void count_bytes(td_fleet_t *f)
{
    size_t all = 0;
    for (uint32_t i = 0; i < f->partitions; i++)
        all += f->standbys[i].bytes;
    TD_FLEET_SET(f, standby_bytes, all);
}

/* The copy goes (its table freed on the loop, its subscription closed); it starts again at the
 * next check while it is wanted. */
static void stop_copy(td_fleet_t *f, uint32_t k)
{
    td_standby_t *s = &f->standbys[k];
    if (s->sub) {
        natsSubscription_Unsubscribe(s->sub);
        natsSubscription_Destroy(s->sub);
    }
    if (s->table)
        td_fleet_on_loop_unheld(f, free_on_loop, &s->table);
    s->sub = NULL;
    s->table = NULL;
    s->revision = s->epoch = s->generation = s->cl_seq = s->max_epoch = 0;
    s->bytes = 0;
    s->next_check_ms = 0;
    TD_FLEET_SET(f, standby_cl_seq[k], 0);
    count_bytes(f);
}

static void drop_copy(td_fleet_t *f, uint32_t k, const char *why)
{
    td_warn("fleet: partition %u's standby copy dropped: %s; it starts again from the next "
            "checkpoint",
            (unsigned)k, why);
    stop_copy(f, k);
}

/* Follows TALLY_CL<k> from `from` (an ordered consumer: JetStream pushes each message once, in
 * order, and libnats makes it again after a gap in its own delivery). */
static td_err_t subscribe(td_fleet_t *f, uint32_t k, uint64_t from, natsSubscription **sub,
                          char *msg, size_t cap)
{
    char stream[32], subject[32];
    snprintf(stream, sizeof stream, "TALLY_CL%u", (unsigned)k);
    snprintf(subject, sizeof subject, "tally.cl.%u", (unsigned)k);
    jsSubOptions so;
    jsSubOptions_Init(&so);
    so.Stream = stream;
    so.Ordered = true;
    so.Config.DeliverPolicy = js_DeliverByStartSequence;
    so.Config.OptStartSeq = from;
    jsErrCode jerr = 0;
    natsStatus st = js_SubscribeSync(sub, f->js, subject, NULL, &so, &jerr);
    if (st == NATS_OK)
        return TD_OK;
    snprintf(msg, cap, "following %s: %s", stream, td_nats_last_error(st));
    return TD_ERR_LIBRARY;
}

/* Test only (TALLYD_TEST_STANDBY_HOLD; when it names a file, /..., once that file exists): a
 * copy, once started, neither starts again from a newer checkpoint nor runs on across one, so
 * that a take meets a checkpoint its copy did not start from. */
static bool held_for_test(const td_standby_t *s)
{
    const char *hold = s->table ? getenv("TALLYD_TEST_STANDBY_HOLD") : NULL;
    return hold && (hold[0] != '/' || access(hold, F_OK) == 0);
}

/* True when the manifest in e (*m) says every change since the checkpoint s started from is in
 * the changelog (its cl_since covers it): the copy is that checkpoint plus the changelog, as the
 * new one plus the changelog after it would be, so it runs on. */
static bool covered(kvEntry *e, const td_standby_t *s, td_ckpt_manifest_t *m)
{
    char why[160];
    const void *v = kvEntry_Value(e);
    int len = kvEntry_ValueLen(e);
    return v && len > 0 && td_ckpt_manifest_decode(v, (size_t)len, m, why, sizeof why) == TD_OK &&
           td_ckpt_since_covers(m, s->epoch, s->generation);
}

/* Starts partition k's copy (again) from its current checkpoint when the manifest moved and does
 * not cover it. */
static void check(td_fleet_t *f, uint32_t k)
{
    td_standby_t *s = &f->standbys[k];
    char key[32], msg[256];
    snprintf(key, sizeof key, "p%u", (unsigned)k);
    kvEntry *e = NULL;
    natsStatus st = kvStore_Get(&e, f->ckpts, key);
    uint64_t revision = st == NATS_OK ? kvEntry_Revision(e) : 0;
    td_ckpt_manifest_t m = {0};
    bool moved = s->table && revision != s->revision;
    bool runs_on = st == NATS_OK && moved && !held_for_test(s) && covered(e, s, &m);
    kvEntry_Destroy(e);
    if ((st != NATS_OK && st != NATS_NOT_FOUND) || (s->table && !moved) || held_for_test(s))
        return;
    if (runs_on) {
        s->revision = revision;
        TD_FLEET_COUNT(f, standby_kept);
        td_debug("fleet: partition %u's standby copy runs on across checkpoint generation %" PRIu64
                 " (its changes since generation %" PRIu64 " are in the changelog)",
                 (unsigned)k, m.generation, m.cl_since_generation);
        return;
    }
    if (s->table)
        TD_FLEET_COUNT(f, standby_restarts);
    stop_copy(f, k);
    memset(&m, 0, sizeof m);
    uint8_t *state = NULL;
    size_t len = 0;
    td_err_t err = revision ? td_ckpt_read(f->js, k, &m, &state, &len, msg, sizeof msg) : TD_OK;
    if (err == TD_OK)
        err = td_streams_new(f->host.cfg->max_streams, &s->table);
    if (err == TD_OK) {
        td_streams_set_window(s->table, td_streams_window_intervals(f->host.streams),
                              td_streams_window_interval_ms(f->host.streams));
        set_budget(f, k);
        copy_job_t j = {.table = s->table, .buf = state, .len = len};
        if (len)
            td_fleet_on_loop_unheld(f, decode_on_loop, &j);
        if ((err = j.err) != TD_OK)
            snprintf(msg, sizeof msg, "its checkpoint: %.200s", j.msg);
    }
    free(state);
    if (err == TD_OK)
        err = subscribe(f, k, m.cl_seq + 1, &s->sub, msg, sizeof msg);
    if (err != TD_OK) { /* no changelog yet, NATS: tried again at the next check */
        td_debug("fleet: partition %u's standby copy not started: %s", (unsigned)k, msg);
        stop_copy(f, k);
        return;
    }
    s->revision = revision;
    s->epoch = m.epoch;
    s->generation = m.generation;
    s->cl_seq = m.cl_seq;
    TD_FLEET_SET(f, standby_cl_seq[k], s->cl_seq);
    TD_FLEET_COUNT(f, standby_starts);
    td_debug("fleet: partition %u's standby copy starts from its checkpoint (epoch %" PRIu64
             ", generation %" PRIu64 ", changelog %" PRIu64 ")",
             (unsigned)k, m.epoch, m.generation, m.cl_seq);
}

/* Applies the changelog messages that arrived for partition k's copy; true when any did. */
static bool follow(td_fleet_t *f, uint32_t k)
{
    td_standby_t *s = &f->standbys[k];
    bool did = false;
    for (int i = 0; i < TD_STANDBY_STEP_MESSAGES && s->sub; i++) {
        natsMsg *m = NULL;
        jsMsgMetaData *meta = NULL;
        if (natsSubscription_NextMsg(&m, s->sub, 0) != NATS_OK)
            break;
        char msg[256] = "";
        td_err_t err = natsMsg_GetMetaData(&meta, m) == NATS_OK ? TD_OK : TD_ERR_CORRUPT;
        uint64_t seq = meta ? meta->Sequence.Stream : 0;
        jsMsgMetaData_Destroy(meta);
        if (err == TD_OK && seq > s->cl_seq + 1)
            snprintf(msg, sizeof msg, "changelog messages %" PRIu64 "..%" PRIu64 " never came",
                     s->cl_seq + 1, seq - 1);
        else if (err == TD_OK && seq == s->cl_seq + 1) {
            set_budget(f, k);
            err = td_changelog_apply(f, k, seq, m, s->table, &s->max_epoch, msg, sizeof msg);
        }
        natsMsg_Destroy(m);
        if (err != TD_OK || msg[0]) {
            drop_copy(f, k, msg[0] ? msg : "a changelog message without its metadata");
            return true;
        }
        if (seq == s->cl_seq + 1) {
            s->cl_seq = seq;
            TD_FLEET_COUNT(f, standby_applied);
        }
        did = true;
    }
    if (did) {
        copy_job_t j = {.table = s->table};
        td_fleet_on_loop_unheld(f, size_on_loop, &j);
        s->bytes = j.out_len;
        count_bytes(f);
        TD_FLEET_SET(f, standby_cl_seq[k], s->cl_seq);
    }
    return did;
}

/* The manifest keys written since the last turn: their copies look at them now. Chunk keys
 * (p<k>.<epoch>.<slot>.<i>) are more than one token: not on the subject. */
static void manifests_written(td_fleet_t *f)
{
    natsMsg *m = NULL;
    size_t prefix = strlen(MANIFESTS_SUBJECT) - 1;
    while (f->manifests_sub && td_nats_next_queued(f->manifests_sub, &m)) {
        const char *key = natsMsg_GetSubject(m) + prefix;
        char *end = NULL;
        unsigned long k = key[0] == 'p' ? strtoul(key + 1, &end, 10) : ULONG_MAX;
        if (end && !*end && k < f->partitions)
            f->standbys[k].next_check_ms = 0;
        natsMsg_Destroy(m);
    }
}

td_err_t td_standby_open(td_fleet_t *f, const td_config_t *cfg)
{
    if (!cfg->nats_standbys)
        return TD_OK;
    if (!f->cl) { /* no changelog to follow: a copy would be its checkpoints only */
        td_warn("fleet: [nats] standbys = %u needs direct = replicated: no standby copies",
                cfg->nats_standbys);
        return TD_OK;
    }
    f->standbys = calloc(f->partitions, sizeof *f->standbys);
    if (!f->standbys)
        return TD_ERR_NOMEM;
    natsStatus st = natsConnection_SubscribeSync(&f->manifests_sub, f->nc, MANIFESTS_SUBJECT);
    if (st != NATS_OK) /* the copies then see new checkpoints within TD_STANDBY_CHECK_MS */
        td_warn("fleet: subscribing to the checkpoint manifests' writes: %s",
                td_nats_last_error(st));
    return TD_OK;
}

void td_standby_close(td_fleet_t *f)
{
    if (f->manifests_sub)
        tally__nats_sub_close(f->nc, &f->manifests_sub);
    for (uint32_t k = 0; f->standbys && k < f->partitions; k++) {
        td_standby_t *s = &f->standbys[k];
        if (s->sub)
            natsSubscription_Destroy(s->sub);
        td_streams_destroy(&s->table); /* the loop has ended */
    }
    free(f->standbys);
    f->standbys = NULL;
}

void td_standby_plan(td_fleet_t *f, const bool *next, const bool *mine)
{
    for (uint32_t k = 0; f->standbys && k < f->partitions; k++) {
        td_standby_t *s = &f->standbys[k];
        /* one it is about to take (its owner gone, its lease not yet run out) is kept */
        s->wanted = !f->parts[k].owned && (next[k] || (mine[k] && s->table));
        if (!s->wanted && s->table)
            stop_copy(f, k);
    }
}

bool td_standby_step(td_fleet_t *f)
{
    bool did = false;
    int64_t now = td_nats_now_ms();
    if (f->standbys)
        manifests_written(f);
    for (uint32_t k = 0; f->standbys && k < f->partitions; k++) {
        td_standby_t *s = &f->standbys[k];
        if (!s->wanted || f->parts[k].owned)
            continue;
        if (now >= s->next_check_ms) {
            check(f, k);
            s->next_check_ms = now + TD_STANDBY_CHECK_MS;
        }
        did |= follow(f, k);
    }
    return did;
}

/* ---- The owner's side: cl_since ------------------------------------------------------------
 *
 * A `replicated` owner with standbys claims cl_since in its checkpoints (PROTOCOL.md §13
 * "Standbys"): every change of its partition's state since a base checkpoint is in the
 * changelog, so a copy started from that base or later runs on across them. The base is this
 * owner's own checkpoint, never the one its take loaded (that state may hold changes no record
 * has: writes of a dead owner whose records were never stored, JetStream ingest the take applies
 * again, records lost to the changelog's max age); and the last one after which it applied
 * JetStream ingest (in no record): a checkpoint with ingest applied since its base claims nothing
 * and becomes the base. Every other change is a direct write, reset or delete, each a record
 * before it is answered; a `local` or `off` owner writes none, has no f->standbys, and claims
 * nothing. td_ckpt_take clears p->ckpt's base at each take. */

bool td_standby_claim(td_part_t *p)
{
    bool claim = p->ckpt.since_epoch && p->applied_seq == p->since_applied;
    if (!claim)
        p->ckpt.since_epoch = p->ckpt.since_generation = 0;
    return claim;
}

void td_standby_base(td_fleet_t *f, td_part_t *p)
{
    if (!f->standbys)
        return;
    p->ckpt.since_epoch = p->ckpt.cur.epoch;
    p->ckpt.since_generation = p->ckpt.cur.generation;
    p->since_applied = p->applied_seq;
}

/* ---- Stale answers ------------------------------------------------------------------------- */

typedef struct {
    td_streams_t *table;
    const tally_req_t *req;
    uint8_t *frame; /* the reply: header and stream record (TD_STANDBY_ANSWER_MAX bytes) */
    size_t len;
} answer_job_t;

/* A plain `query` answered from a copy as the request path answers it (td_op_query): the
 * stream's record, or unknown_stream. */
static void answer_on_loop(td_fleet_t *f, void *arg)
{
    (void)f;
    static tally_stream_info_t info; /* loop thread only: 8 KiB off the stack */
    answer_job_t *j = arg;
    td_stream_t *st = td_streams_find(j->table, j->req->stream, j->req->stream_len);
    tally_rep_t rep = {.version = TALLY_PROTO_VERSION,
                       .opcode = j->req->opcode,
                       .flags = j->req->flags,
                       .request_id = j->req->request_id,
                       .dtype = st ? TALLY_DTYPE_NONE : TALLY_DTYPE_TEXT,
                       .status = st ? TALLY_OK : TALLY_E_UNKNOWN_STREAM,
                       .count = st ? 1 : 0};
    tally_rep_encode(&rep, j->frame);
    j->len = TALLY_REP_HEADER_SIZE;
    if (!st) {
        static const char why[] = "no such stream in the standby's copy";
        memcpy(j->frame + j->len, why, sizeof why - 1);
        j->len += sizeof why - 1;
        return;
    }
    td_stream_info(st, &info);
    j->len += tally_stream_info_encode(&info, j->frame + TALLY_REP_HEADER_SIZE);
}

size_t td_standby_answer(td_fleet_t *f, uint32_t k, const tally_req_t *req, uint8_t *frame,
                         uint64_t *cl_seq)
{
    td_standby_t *s = standby_of(f, k);
    if (!s || !s->table || !s->wanted || f->parts[k].owned)
        return 0;
    while (follow(f, k)) /* what has come: as fresh as the copy can be */
        ;
    if (!s->table)
        return 0; /* dropped just now */
    answer_job_t j = {.table = s->table, .req = req, .frame = frame};
    td_fleet_on_loop_unheld(f, answer_on_loop, &j);
    *cl_seq = s->cl_seq;
    return j.len;
}

/* Loads partition k's copy into the stream table; *len: its bytes of state. */
static td_err_t adopt(td_fleet_t *f, td_part_t *p, size_t *len, char *msg, size_t cap)
{
    td_standby_t *s = &f->standbys[p->k];
    while (follow(f, p->k)) /* what arrived before the take */
        ;
    if (!s->table)
        return TD_ERR_CORRUPT; /* dropped just now */
    copy_job_t j = {.table = s->table};
    td_fleet_on_loop_unheld(f, encode_on_loop, &j);
    td_err_t err = j.err;
    if (err == TD_OK)
        err = td_fleet_table_restore(f, p->k, j.out, j.out_len, msg, cap);
    *len = j.out_len;
    free(j.out);
    return err;
}

/* The copy of partition k a take fencing cur may use: the copy started from cur itself, or cur's
 * cl_since covers the checkpoint it started from and it has applied the changelog at least to
 * cur's cl_seq (what the take replays after it is the changelog after the copy's last record;
 * a copy behind the checkpoint could need records a purge removed). *why: when none, why not. */
static bool usable_copy(td_fleet_t *f, uint32_t k, const td_ckpt_manifest_t *cur, bool *ran_on,
                        char *why, size_t cap)
{
    td_standby_t *s = &f->standbys[k];
    *ran_on = false;
    snprintf(why, cap, "no copy here");
    if (!s->table)
        return false;
    if (s->epoch == cur->epoch && s->generation == cur->generation)
        return true;
    if (!td_ckpt_since_covers(cur, s->epoch, s->generation)) {
        snprintf(why, cap,
                 "its copy started from epoch %" PRIu64 " generation %" PRIu64
                 ", not the checkpoint fenced nor one its cl_since covers",
                 s->epoch, s->generation);
        return false;
    }
    while (follow(f, k)) /* what has come */
        ;
    if (s->table && s->cl_seq >= cur->cl_seq)
        return *ran_on = true;
    snprintf(why, cap,
             "its copy applied the changelog to %" PRIu64 ", before the checkpoint's %" PRIu64,
             s->cl_seq, cur->cl_seq);
    return false;
}

td_err_t td_standby_load(td_fleet_t *f, td_part_t *p, uint8_t *state, size_t len, char *msg,
                         size_t cap)
{
    td_standby_t *s = standby_of(f, p->k);
    const td_ckpt_manifest_t *cur = &p->ckpt.cur;
    uint64_t from = cur->cl_seq, max_epoch = 0, started = s ? s->generation : 0;
    char why[192];
    bool ran_on = false;
    bool usable = s && usable_copy(f, p->k, cur, &ran_on, why, sizeof why);
    td_err_t err = TD_ERR_CORRUPT;
    size_t copy_len = 0;
    if (usable && (err = adopt(f, p, &copy_len, msg, cap)) == TD_OK) {
        from = s->cl_seq;
        max_epoch = s->max_epoch;
        TD_FLEET_COUNT(f, takes_from_standby);
        snprintf(p->take_loaded, sizeof p->take_loaded,
                 "its standby copy: %zu bytes of state, changelog applied to %" PRIu64, copy_len,
                 from);
        if (ran_on)
            td_notice("fleet: partition %u: taken from its standby copy (started from generation "
                      "%" PRIu64 ", run on across checkpoints to generation %" PRIu64
                      " (its cl_since %" PRIu64 "), changelog applied to %" PRIu64
                      "): only the tail after it is replayed",
                      (unsigned)p->k, started, cur->generation, cur->cl_since_generation, from);
        else
            td_notice("fleet: partition %u: taken from its standby copy (checkpoint epoch %" PRIu64
                      " generation %" PRIu64 ", changelog applied to %" PRIu64
                      "): only the tail after it is replayed",
                      (unsigned)p->k, cur->epoch, cur->generation, from);
    } else if (s) {
        if (usable)
            snprintf(why, sizeof why, "its copy could not be loaded: %.100s", msg);
        td_notice("fleet: partition %u: taken from its checkpoint (epoch %" PRIu64
                  " generation %" PRIu64 "; %s)",
                  (unsigned)p->k, cur->epoch, cur->generation, why);
    }
    if (!usable || err != TD_OK) {
        TD_FLEET_COUNT(f, takes_from_checkpoint);
        snprintf(p->take_loaded, sizeof p->take_loaded, "%zu bytes of state", len);
        err = td_fleet_table_restore(f, p->k, state, len, msg, cap);
    }
    if (s)
        stop_copy(f, p->k); /* used, or of no use any more */
    p->take_loaded_ms = td_nats_now_ms();
    if (err == TD_OK) /* replicated: the changelog after what was loaded, and a fence */
        err = td_changelog_take(f, p->k, from, max_epoch, p->lease.revision, &p->ckpt.cl_seq, msg,
                                cap);
    return err;
}
