/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_bufpool.c — the buffers tally_send copies large payloads into, kept for the next send.
 *
 * tally_send must copy (the caller may reuse its buffer as soon as the call returns, and ZeroMQ
 * sends later). Copied into a fresh ZeroMQ message, every payload was a new malloc that glibc
 * had handed back to the kernel after the previous send: the producer page-faulted its own copy
 * in, about 49 minor faults per MiB sent (bench/NOTES.md, "The producers, not the receive
 * buffers"). A client's pool keeps up to TALLY_POOL_BUFFERS buffers (TALLY_POOL_BYTES in all)
 * that ZeroMQ gives back once it has sent them (tally__bufpool_give_back, its zmq_free_fn, on an
 * I/O thread), so a steady stream of sends reuses the same, already mapped memory.
 *
 * Each buffer carries a header with its capacity and its pool in front of the bytes ZeroMQ
 * sees. The pool outlives every buffer it lent: tally_client_destroy terminates the ZeroMQ
 * context (which gives back whatever was still queued) before it destroys the pool.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "tally_internal.h"

typedef struct {
    /* Stored (release) once the header and then the payload are written
     * (tally__bufpool_written), read first by whichever thread gives the buffer back (acquire):
     * ZeroMQ's I/O thread, after ZeroMQ's own hand-off, which a race detector cannot see
     * (scripts/tsan.sh). */
    _Atomic(tally_bufpool_t *) pool;
    size_t capacity;
    max_align_t align; /* the payload after the header stays aligned for any type */
} header_t;

struct tally_bufpool {
    pthread_mutex_t lock;
    header_t *free[TALLY_POOL_BUFFERS]; /* under lock */
    unsigned free_count;
    size_t free_bytes;
};

tally_bufpool_t *tally__bufpool_new(void)
{
    tally_bufpool_t *self = calloc(1, sizeof *self);
    if (self)
        self->lock = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    return self;
}

void tally__bufpool_destroy(tally_bufpool_t **self_p)
{
    tally_bufpool_t *self = self_p ? *self_p : NULL;
    if (!self)
        return;
    for (unsigned i = 0; i < self->free_count; i++)
        free(self->free[i]);
    pthread_mutex_destroy(&self->lock);
    free(self);
    *self_p = NULL;
}

/* The smallest kept buffer that holds len bytes without wasting more than as much again. */
static header_t *take_kept(tally_bufpool_t *self, size_t len)
{
    unsigned best = self->free_count;
    for (unsigned i = 0; i < self->free_count; i++) {
        size_t cap = self->free[i]->capacity;
        if (cap >= len && cap / 2 <= len &&
            (best == self->free_count || cap < self->free[best]->capacity))
            best = i;
    }
    if (best == self->free_count)
        return NULL;
    header_t *h = self->free[best];
    self->free[best] = self->free[--self->free_count];
    self->free_bytes -= h->capacity;
    return h;
}

void *tally__bufpool_take(tally_bufpool_t *self, size_t len)
{
    if (!self || len < TALLY_POOL_MIN_BYTES || len > TALLY_POOL_BYTES)
        return NULL;
    pthread_mutex_lock(&self->lock);
    header_t *h = take_kept(self, len);
    pthread_mutex_unlock(&self->lock);
    if (!h) {
        h = malloc(sizeof *h + len);
        if (!h)
            return NULL;
        h->capacity = len;
        atomic_store_explicit(&h->pool, self, memory_order_release);
    }
    return h + 1;
}

void tally__bufpool_written(void *data)
{
    header_t *h = (header_t *)data - 1;
    tally_bufpool_t *pool = atomic_load_explicit(&h->pool, memory_order_relaxed);
    atomic_store_explicit(&h->pool, pool, memory_order_release);
}

void tally__bufpool_give_back(void *data, void *hint)
{
    (void)hint; /* the header knows its pool */
    if (!data)
        return;
    header_t *h = (header_t *)data - 1;
    tally_bufpool_t *self = atomic_load_explicit(&h->pool, memory_order_acquire);
    pthread_mutex_lock(&self->lock);
    bool keep =
        self->free_count < TALLY_POOL_BUFFERS && self->free_bytes + h->capacity <= TALLY_POOL_BYTES;
    if (keep) {
        self->free[self->free_count++] = h;
        self->free_bytes += h->capacity;
    }
    pthread_mutex_unlock(&self->lock);
    if (!keep)
        free(h);
}

unsigned tally__bufpool_kept(tally_bufpool_t *self, size_t *bytes)
{
    pthread_mutex_lock(&self->lock);
    unsigned n = self->free_count;
    if (bytes)
        *bytes = self->free_bytes;
    pthread_mutex_unlock(&self->lock);
    return n;
}
