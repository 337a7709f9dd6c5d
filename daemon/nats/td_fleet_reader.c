/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_reader.c — a partition's reader: a thread that fetches from the partition's durable
 * consumer into a queue the fleet thread takes messages from (td_fleet_int.h, td_reader_t).
 *
 * A fetch blocks (a pull request waits on the server until messages come or it expires), so it
 * cannot run on the fleet thread, which serves every partition, the queries and the replies at
 * once. The queue is bounded in bytes (TD_FLEET_FETCH_BYTES: a fetch asks only for the room
 * left, and what the fleet thread has taken and not popped yet still counts), the fleet thread
 * takes everything queued under one lock (td_reader_pop), and the reader wakes the fleet thread
 * through an eventfd it polls beside the request path's socket, so a message waits for nobody's
 * timer. The messages it queued since it started and those the fleet thread popped are counted
 * apart, each by its own thread, for tallyd_nats_partition_fetched (td_fleet_window.c stores the
 * second).
 *
 * The reader also reads what the fleet thread will need of each message before it queues it:
 * its stream sequence (from its ack subject) and its headers (libnats parses a message's
 * headers into a table at the first look, kept with the message). The fleet thread, which every
 * message of a worker crosses, was at a full core with a worker's other threads below theirs
 * (issue 32); the readers, one a partition, had time to spare.
 *
 * A take-over's way to its first message (issue 32: failover within the lease TTL + 2 s): the
 * reader makes the partition's consumer itself (the cluster places it in a few hundred
 * milliseconds on a loaded host; made on the fleet thread, the partitions taken together waited
 * for each other's, and everything else for all of them), fetches at once with a short wait that
 * doubles while nothing comes, and only then deletes the previous owner's consumer. (The short
 * waits date from pulls without no_wait, when a new consumer's first pull could sit out its
 * whole expiry with messages pending: 250 ms of every take-over. A pull now returns what the
 * consumer holds at once, td_consumer_fetch; the short waits only bound how long one sent
 * before the consumer holds anything waits before the next.) A consumer it cannot make ends the
 * thread with the reason (td_reader_failed), and the fleet thread gives the partition up.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "td_fleet_int.h"
#include "td_log.h"
#include "td_nats_consumer.h"
#include "tally_fleet.h"

/* A fetch waits this long for messages before it asks again (and looks at `stop`); the first
 * ones after the consumer is made wait READER_FIRST_WAIT_MS, twice that, and so on up to it. */
#define READER_WAIT_MS 250
#define READER_FIRST_WAIT_MS 10

static void wake(td_fleet_t *f)
{
    uint64_t one = 1;
    ssize_t n = write(f->wake_fd, &one, sizeof one);
    (void)n; /* a full counter wakes the poll as well */
}

/* Raises the partition's last sequence seen, the lag gauge's top, to what the last message of a
 * fetch says (its sequence plus the consumer's pending count): as fetched, not as the fleet
 * thread takes them, which may be far behind. */
static void raise_last_seq(td_reader_t *r, uint64_t top)
{
    _Atomic uint64_t *seen = &r->fleet->st->last_seq[r->k];
    uint64_t cur = atomic_load_explicit(seen, memory_order_relaxed);
    while (top > cur && !atomic_compare_exchange_weak_explicit(
                            seen, &cur, top, memory_order_relaxed, memory_order_relaxed))
        ;
}

static const char *header(natsMsg *m, const char *key)
{
    const char *v = NULL;
    return natsMsgHeader_Get(m, key, &v) == NATS_OK ? v : NULL;
}

/* m's Tally-Reply and Nats-Msg-Id, each read once: a header asked for and missing costs libnats
 * an error text each time (issue 32: a third of the fleet thread's formatting, three times a
 * message); and the user its subject names. */
static td_msg_headers_t read_headers(natsMsg *m)
{
    td_msg_headers_t h = {.user = tally_fleet_subject_user(natsMsg_GetSubject(m))};
    const char **keys = NULL;
    int n = 0;
    if (natsMsgHeader_Keys(m, &keys, &n) != NATS_OK)
        return h; /* no headers at all */
    for (int i = 0; i < n; i++) {
        if (!h.to && strcmp(keys[i], TALLY_NATS_HDR_REPLY) == 0)
            h.to = header(m, TALLY_NATS_HDR_REPLY);
        else if (!h.id && strcmp(keys[i], TALLY_NATS_HDR_MSG_ID) == 0)
            h.id = header(m, TALLY_NATS_HDR_MSG_ID);
    }
    free((void *)keys);
    return h;
}

/* Appends a fetched batch (taking the messages), each read first, outside the lock: the fetch
 * asked for no more than the room. */
static void push(td_reader_t *r, natsMsgList *list)
{
    td_fetched_t got[TD_FLEET_FETCH_BATCH]; /* a fetch brings at most its batch */
    uint64_t pending = 0;
    for (int i = 0; i < list->Count; i++) {
        natsMsg *m = list->Msgs[i];
        got[i] = (td_fetched_t){
            .msg = m, .seq = td_nats_msg_seq_pending(m, &pending), .h = read_headers(m)};
    }
    raise_last_seq(r, got[list->Count - 1].seq + pending);
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < list->Count; i++) {
        r->ring[(r->head + r->len) % TD_READER_RING] = got[i];
        r->bytes += (size_t)natsMsg_GetDataLength(list->Msgs[i]);
        r->len++;
        list->Msgs[i] = NULL;
    }
    r->pushed_count += (uint64_t)list->Count;
    TD_FLEET_SET(r->fleet, fetched[r->k], r->pushed_count); /* before the fleet can pop them */
    pthread_mutex_unlock(&r->mu);
}

/* Makes the consumer; on failure the reason goes into r->why and the phase says so. */
static bool make_consumer(td_reader_t *r)
{
    const td_reader_make_t *m = &r->make;
    if (td_consumer_start(m->js, m->nc, m->inbox, r->k, m->epoch, m->restart, m->start_seq,
                          m->ack_wait_ms, &r->pull, r->why, sizeof r->why) == TD_OK) {
        r->made_ms = td_nats_now_ms();
        atomic_store(&r->phase, READER_READING);
        return true;
    }
    atomic_store(&r->phase, READER_FAILED);
    wake(r->fleet);
    return false;
}

static void *reader_thread(void *arg)
{
    td_reader_t *r = arg;
    td_fleet_t *f = r->fleet;
    char name[16]; /* "tdreader-3": partition 3's (libnats's threads it starts inherit it) */
    snprintf(name, sizeof name, "tdreader-%u", r->k % 10000);
    pthread_setname_np(pthread_self(), name);
    if (!make_consumer(r))
        return NULL;
    int64_t wait_ms = READER_FIRST_WAIT_MS;
    bool tidied = false;
    while (!atomic_load(&r->stop)) {
        pthread_mutex_lock(&r->mu);
        /* Room for a whole fetch: at least one message of the largest size (a pull request
         * whose max bytes are below the next message fails instead of waiting). */
        while ((r->bytes + f->max_payload > TD_FLEET_FETCH_BYTES ||
                r->len + TD_FLEET_FETCH_BATCH > TD_READER_RING) &&
               !atomic_load(&r->stop))
            pthread_cond_wait(&r->cond, &r->mu);
        size_t used = r->bytes;
        pthread_mutex_unlock(&r->mu);
        if (atomic_load(&r->stop))
            break;
        natsMsgList list;
        char msg[256];
        if (td_consumer_fetch(r->pull, TD_FLEET_FETCH_BATCH, TD_FLEET_FETCH_BYTES - (int64_t)used,
                              wait_ms, &list, msg, sizeof msg) != TD_OK) {
            td_warn("fleet: partition %u: %s", (unsigned)r->k, msg);
            usleep(READER_WAIT_MS * 1000);
            continue;
        }
        if (list.Count > 0) {
            push(r, &list);
            wake(f);
        } else if (wait_ms < READER_WAIT_MS) {
            wait_ms = wait_ms * 2 < READER_WAIT_MS ? wait_ms * 2 : READER_WAIT_MS;
        }
        natsMsgList_Destroy(&list);
        if (!tidied && td_nats_now_ms() < r->make.valid_until_ms)
            td_consumer_delete_others(r->make.js, r->pull);
        tidied = true;
    }
    return NULL;
}

td_err_t td_reader_start(td_fleet_t *f, td_reader_t *r, uint32_t k, const td_reader_make_t *make)
{
    memset(r, 0, sizeof *r);
    r->fleet = f;
    r->k = k;
    r->make = *make;
    TD_FLEET_SET(f, fetched[k], 0); /* the thread's counts start anew */
    TD_FLEET_SET(f, taken[k], 0);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cond, NULL);
    if (pthread_create(&r->thread, NULL, reader_thread, r) != 0) {
        pthread_cond_destroy(&r->cond);
        pthread_mutex_destroy(&r->mu);
        return TD_ERR_LIBRARY;
    }
    r->started = true;
    return TD_OK;
}

bool td_reader_failed(td_reader_t *r, char *why, size_t cap)
{
    if (atomic_load(&r->phase) != READER_FAILED) /* a stopped reader is all zeros: MAKING */
        return false;
    snprintf(why, cap, "%s", r->why);
    return true;
}

bool td_reader_made(td_reader_t *r)
{
    return atomic_load(&r->phase) == READER_READING;
}

/* Under the lock, the fleet thread gives back the room of what it popped (the reader waits for
 * it) and, when it has popped everything it took, takes the whole ring. */
static void take_batch(td_reader_t *r)
{
    pthread_mutex_lock(&r->mu);
    r->bytes -= r->popped;
    r->popped = 0;
    if (r->took == r->taken_len) {
        r->took = r->taken_len = 0;
        for (; r->len > 0; r->len--) {
            r->taken[r->taken_len++] = r->ring[r->head];
            r->head = (r->head + 1) % TD_READER_RING;
        }
    }
    pthread_cond_signal(&r->cond);
    pthread_mutex_unlock(&r->mu);
}

td_fetched_t td_reader_pop(td_reader_t *r)
{
    if (!r->started)
        return (td_fetched_t){0};
    /* Room is given back a quarter of the queue's bytes at a time, so that large messages are
     * fetched again before everything taken has gone. */
    if (r->took == r->taken_len || r->popped >= TD_FLEET_FETCH_BYTES / 4)
        take_batch(r);
    if (r->took == r->taken_len)
        return (td_fetched_t){0};
    td_fetched_t m = r->taken[r->took++];
    r->popped += (size_t)natsMsg_GetDataLength(m.msg);
    r->popped_count++;
    return m;
}

void td_reader_stop(td_reader_t *r)
{
    if (!r->started)
        return;
    atomic_store(&r->stop, true);
    pthread_mutex_lock(&r->mu);
    pthread_cond_signal(&r->cond);
    pthread_mutex_unlock(&r->mu);
    pthread_join(r->thread, NULL); /* at most one fetch's wait */
    for (size_t i = 0; i < r->len; i++)
        natsMsg_Destroy(r->ring[(r->head + i) % TD_READER_RING].msg);
    for (size_t i = r->took; i < r->taken_len; i++)
        natsMsg_Destroy(r->taken[i].msg);
    td_pull_destroy(&r->pull); /* the durable consumer stays for the next owner */
    pthread_cond_destroy(&r->cond);
    pthread_mutex_destroy(&r->mu);
    memset(r, 0, sizeof *r);
}
