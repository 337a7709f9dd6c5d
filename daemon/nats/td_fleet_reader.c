/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_reader.c — a partition's reader: a thread that fetches from the partition's durable
 * consumer into a queue the fleet thread takes messages from (td_fleet_int.h, td_reader_t).
 *
 * A fetch blocks (a pull request waits on the server until messages come or it expires), so it
 * cannot run on the fleet thread, which serves every partition, the queries and the replies at
 * once. The queue is bounded in bytes (TD_FLEET_FETCH_BYTES: a fetch asks only for the room
 * left, and what the fleet thread has taken and not popped yet still counts), the fleet thread
 * takes everything queued under one lock (td_reader_pop), and the reader wakes the fleet thread through an eventfd it polls beside the request
 * path's socket, so a message waits for nobody's timer.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "td_fleet_int.h"
#include "td_log.h"
#include "td_nats_consumer.h"

/* A fetch waits this long for messages before it asks again (and looks at `stop`). */
#define READER_WAIT_MS 250

static void wake(td_fleet_t *f)
{
    uint64_t one = 1;
    ssize_t n = write(f->wake_fd, &one, sizeof one);
    (void)n; /* a full counter wakes the poll as well */
}

/* Appends a fetched batch (taking the messages): the fetch asked for no more than the room. */
static void push(td_reader_t *r, natsMsgList *list)
{
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < list->Count; i++) {
        r->ring[(r->head + r->len) % TD_READER_RING] = list->Msgs[i];
        r->bytes += (size_t)natsMsg_GetDataLength(list->Msgs[i]);
        r->len++;
        list->Msgs[i] = NULL;
    }
    pthread_mutex_unlock(&r->mu);
}

static void *reader_thread(void *arg)
{
    td_reader_t *r = arg;
    td_fleet_t *f = r->fleet;
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
                              READER_WAIT_MS, &list, msg, sizeof msg) != TD_OK) {
            td_warn("fleet: partition %u: %s", (unsigned)r->k, msg);
            usleep(READER_WAIT_MS * 1000);
            continue;
        }
        if (list.Count > 0) {
            push(r, &list);
            wake(f);
        }
        natsMsgList_Destroy(&list);
    }
    return NULL;
}

td_err_t td_reader_start(td_fleet_t *f, td_reader_t *r, uint32_t k, struct td_pull *pull)
{
    memset(r, 0, sizeof *r);
    r->fleet = f;
    r->k = k;
    r->pull = pull;
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

natsMsg *td_reader_pop(td_reader_t *r)
{
    if (!r->started)
        return NULL;
    /* Room is given back a quarter of the queue's bytes at a time, so that large messages are
     * fetched again before everything taken has gone. */
    if (r->took == r->taken_len || r->popped >= TD_FLEET_FETCH_BYTES / 4)
        take_batch(r);
    if (r->took == r->taken_len)
        return NULL;
    natsMsg *m = r->taken[r->took++];
    r->popped += (size_t)natsMsg_GetDataLength(m);
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
        natsMsg_Destroy(r->ring[(r->head + i) % TD_READER_RING]);
    for (size_t i = r->took; i < r->taken_len; i++)
        natsMsg_Destroy(r->taken[i]);
    td_pull_destroy(&r->pull); /* the durable consumer stays for the next owner */
    pthread_cond_destroy(&r->cond);
    pthread_mutex_destroy(&r->mu);
    memset(r, 0, sizeof *r);
}
