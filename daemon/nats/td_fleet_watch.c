/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_watch.c — a fleet worker's histogram publications (PROTOCOL.md §13 "Histogram
 * publications"): every pub_interval_ms, each stream of an owned partition that changed since
 * the last tick is published on tally.watch.<k> as the §11 header and the stream's `query`
 * record, so a watcher anywhere on the NATS cluster sees it without asking each owner.
 *
 * The records are taken on the loop thread (the stream table is the loop's; td_fleet_on_loop)
 * and published from the fleet thread. A tick takes at most TD_FLEET_WATCH_BYTES of records: the
 * streams left over stay marked and go out at the next tick, so memory stays bounded however
 * many streams changed. Publications are plain NATS (not JetStream): a watcher that is not
 * subscribed misses them, and pub_seq (counting per worker run) shows a gap.
 *
 * A hand-over (a member joins or comes back, a worker stops) must not leave a stream's last
 * publication behind its state (issue 30): the old owner publishes a partition's changed streams
 * before it gives the partition up (td_fleet_watch_flush, after its last checkpoint, under its
 * lease), and the new owner marks every stream it loaded from the checkpoint changed
 * (td_fleet_watch_taken), so its next tick publishes them, even those the old owner could not
 * (it crashed, or its lease ran out first).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_fleet_int.h"
#include "td_log.h"
#include "td_stream.h"
#include "td_window.h"

/* Record bytes one tick takes at most. */
#define TD_FLEET_WATCH_BYTES (4u << 20)

typedef struct watch_msg {
    struct watch_msg *next;
    uint32_t k;
    char name[TALLY_STREAM_NAME_MAX + 1];
    size_t len; /* header and record */
    uint8_t data[];
} watch_msg_t;

typedef struct {
    watch_msg_t *head, **tail;
    uint64_t interval_ms;
    int64_t only; /* the one partition to take (a flush), or -1: every owned one */
} watch_job_t;

/* Loop thread (the fleet thread waits meanwhile, so its partitions' `owned` hold still). */
static void collect_on_loop(td_fleet_t *f, void *arg)
{
    static uint8_t record[TALLY_QUERY_PAYLOAD_MAX];
    static tally_stream_info_t info;
    watch_job_t *j = arg;
    size_t taken = 0;
    uint64_t now = td_clock_ms();
    for (td_stream_t *s = td_streams_first(f->host.streams); s;
         s = td_streams_next(f->host.streams, s)) {
        if (!s->fleet_dirty)
            continue;
        uint32_t k = tally_partition(s->name, s->name_len, f->partitions);
        if (j->only >= 0 && k != (uint32_t)j->only)
            continue;
        if (!f->parts[k].owned) {
            s->fleet_dirty = false; /* not ours to tell of (a copy being dropped) */
            continue;
        }
        if (taken >= TD_FLEET_WATCH_BYTES)
            return; /* the rest at the next tick */
        td_stream_info(s, &info);
        size_t rlen = tally_stream_info_encode(&info, record);
        watch_msg_t *m = malloc(sizeof *m + TALLY_PUB_HEADER_SIZE + rlen);
        if (!m)
            return;
        s->fleet_dirty = false;
        tally_pub_t pub = {.kind = TALLY_PUB_UPDATE,
                           .pub_seq = ++f->watch_seq,
                           .time_ms = now,
                           .interval_ms = j->interval_ms};
        tally_pub_encode(&pub, m->data);
        memcpy(m->data + TALLY_PUB_HEADER_SIZE, record, rlen);
        m->len = TALLY_PUB_HEADER_SIZE + rlen;
        m->k = k;
        m->next = NULL;
        memcpy(m->name, s->name, s->name_len);
        m->name[s->name_len] = '\0';
        *j->tail = m;
        j->tail = &m->next;
        taken += rlen;
    }
}

static void publish(td_fleet_t *f, const watch_msg_t *w)
{
    char subject[48];
    tally_fleet_name(subject, sizeof subject, TALLY_NATS_SUBJ_WATCH, w->k);
    natsMsg *m = NULL;
    natsStatus s = natsMsg_Create(&m, subject, NULL, (const char *)w->data, (int)w->len);
    if (s == NATS_OK)
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_STREAM, w->name);
    if (s == NATS_OK)
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_MEMBER, f->member);
    if (s == NATS_OK)
        s = natsConnection_PublishMsg(f->reply_nc, m);
    if (s != NATS_OK)
        td_debug("fleet: publishing stream '%s' on %s: %s", w->name, subject, natsStatus_GetText(s));
    natsMsg_Destroy(m);
}

/* Takes the changed streams (of partition `only`, or of every owned one: -1) on the loop and
 * publishes them, each under a lease still valid; true when any was taken. */
static bool collect_and_publish(td_fleet_t *f, int64_t only)
{
    watch_job_t j = {.interval_ms = (uint64_t)f->watch_ms, .only = only};
    j.tail = &j.head;
    td_fleet_on_loop(f, collect_on_loop, &j);
    bool any = j.head != NULL;
    while (j.head) {
        watch_msg_t *m = j.head;
        j.head = m->next;
        if (td_part_may_write(&f->parts[m->k])) /* nothing said past its lease */
            publish(f, m);
        free(m);
    }
    return any;
}

bool td_fleet_watch_step(td_fleet_t *f)
{
    int64_t now = td_nats_now_ms();
    if (!f->watch_ms || now < f->next_watch_ms)
        return false;
    f->next_watch_ms = now + f->watch_ms;
    return collect_and_publish(f, -1);
}

void td_fleet_watch_flush(td_fleet_t *f, uint32_t k)
{
    if (!f->watch_ms)
        return;
    while (collect_and_publish(f, k)) /* a tick's bytes at a time, until none is left */
        continue;
    natsConnection_FlushTimeout(f->reply_nc, 5000); /* out before the lease is released */
}

static void mark_on_loop(td_fleet_t *f, void *arg)
{
    uint32_t k = *(const uint32_t *)arg;
    for (td_stream_t *s = td_streams_first(f->host.streams); s;
         s = td_streams_next(f->host.streams, s))
        if (tally_partition(s->name, s->name_len, f->partitions) == k)
            s->fleet_dirty = true;
}

void td_fleet_watch_taken(td_fleet_t *f, uint32_t k)
{
    if (f->watch_ms)
        td_fleet_on_loop(f, mark_on_loop, &k);
}
