/*
 * td_stream.h — named streams: the state tallyd keeps between requests.
 *
 * A stream holds a tally_stream_info_t (its counters, scan carry and running histogram: the
 * same struct that `query` puts on the wire and the state file stores); the requests waiting or
 * running on it are the scheduler's (td_sched.h). The table is owned by the loop thread and is only
 * ever touched there: workers compute into their request and the loop thread applies the result, so
 * reads (query, metrics, state snapshots) never race with updates.
 */
#ifndef TD_STREAM_H
#define TD_STREAM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tally_proto.h"
#include "td_err.h"
#include "td_window.h"

struct td_sched_stream;

typedef struct td_stream {
    char name[TALLY_STREAM_NAME_MAX + 1];
    size_t name_len;
    tally_stream_info_t info;
    /* The ring of recent intervals (td_window.h): NULL until the first hist is applied, or
     * when windows are off. */
    td_window_t *window;
    /* Changed since it was last published on the PUB socket (td_pub.h). */
    bool pub_dirty;
    /* Requests that named the stream (for per-stream metrics). */
    uint64_t requests;
    /* When a request last changed it (applied, reset): the window clock (td_clock_ms); 0 when
     * nothing has since tallyd started. The web page's "last update". */
    uint64_t updated_ms;
    /* Sequence numbers (PROTOCOL.md, "Sequence numbers"): info.last_seq is the last one applied;
     * seq_admitted the last one started, which runs ahead of it while GPU-pipelined requests are
     * in flight (it equals info.last_seq whenever nothing is). */
    uint64_t seq_admitted;
    /* The client that created it (td_peers.h; a reference, counted in its `streams`), NULL for
     * a stream restored from the state file. */
    struct td_peer *owner;
    /* The scheduler's record of the stream (td_sched.c: its FIFO, requests in flight, GPU lane
     * and carry); NULL while nothing of the stream waits or runs. */
    struct td_sched_stream *sched;
    /* Table links: hash chain and the creation-ordered list used by `streams`. */
    struct td_stream *hash_next;
    struct td_stream *list_prev;
    struct td_stream *list_next;
} td_stream_t;

typedef struct td_streams td_streams_t;

/* TD_ERR_NOMEM when out of memory. */
td_err_t td_streams_new(unsigned max_streams, td_streams_t **out);
void td_streams_destroy(td_streams_t **self_p);

/* NULL when no stream of that name exists. */
td_stream_t *td_streams_find(td_streams_t *self, const char *name, size_t len);
/* Finds or creates; TALLY_E_LIMIT when max_streams exist already. */
tally_status_t td_streams_get(td_streams_t *self, const char *name, size_t len, td_stream_t **out);
/* The window ring every stream gets at its first hist: `intervals` (0 = windows off) of
 * interval_ms. Set at start, before streams exist. */
void td_streams_set_window(td_streams_t *self, unsigned intervals, uint32_t interval_ms);
unsigned td_streams_window_intervals(const td_streams_t *self);
uint32_t td_streams_window_interval_ms(const td_streams_t *self);
/* Adds a hist batch to the stream's window ring at now_ms (the ring is allocated at the first
 * one, with the channels of the stream's histogram). False when windows are on and the ring
 * cannot be allocated. */
bool td_stream_window_add(td_streams_t *self, td_stream_t *stream, const uint64_t *bins,
                          uint64_t underflow, uint64_t overflow, uint64_t n, uint64_t now_ms);
/* Removes and frees a stream that has no running or queued request (stream->sched NULL). */
void td_streams_remove(td_streams_t *self, td_stream_t **stream_p);

unsigned td_streams_count(const td_streams_t *self);
void td_streams_set_max(td_streams_t *self, unsigned max_streams);
/* Iteration in creation order: for (s = td_streams_first(t); s; s = s->list_next). */
td_stream_t *td_streams_first(td_streams_t *self);

/* `delete` (PROTOCOL.md): clears counters, carry, histogram, window and sequence numbers, as
 * for a new stream (the object stays while requests queued behind the delete hold it). */
void td_stream_clear(td_stream_t *stream);
/* `reset` (PROTOCOL.md): zeroes counters, carry and histogram; keeps the histogram's dtype and
 * range and last_seq. Runs on a drained stream only, so seq_admitted equals last_seq. */
void td_stream_zero(td_stream_t *stream);

#endif
