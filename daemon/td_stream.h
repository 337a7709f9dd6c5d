/*
 * td_stream.h — named streams: the state tallyd keeps between requests.
 *
 * A stream holds a tally_stream_info_t (its counters, scan carry and running histogram: the
 * same struct that `query` puts on the wire and the state file stores), plus a FIFO of the
 * requests waiting to run on it. The table is owned by the loop thread and is only ever touched
 * there: workers compute into their request and the loop thread applies the result, so reads
 * (query, metrics, state snapshots) never race with updates.
 */
#ifndef TD_STREAM_H
#define TD_STREAM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tally_proto.h"

struct td_request;

typedef struct td_stream {
    char name[TALLY_STREAM_NAME_MAX + 1];
    size_t name_len;
    tally_stream_info_t info;
    /* Requests on this stream run one at a time in arrival order: `running` is the one
     * executing (NULL when idle), `queue_head..queue_tail` wait behind it. */
    struct td_request *running;
    struct td_request *queue_head;
    struct td_request *queue_tail;
    unsigned queued;
    /* Sequence numbers (PROTOCOL.md, "Sequence numbers"): info.last_seq is the last one applied;
     * seq_admitted the last one started, which runs ahead of it while GPU-pipelined requests are
     * in flight (it equals info.last_seq whenever nothing is). */
    uint64_t seq_admitted;
    /* The client that created it (td_peers.h; a reference, counted in its `streams`), NULL for
     * a stream restored from the state file. */
    struct td_peer *owner;
    /* Executor bookkeeping (td_exec.c): requests started and not yet completed, whether they run
     * on the GPU pipeline and on which lane (a stream is pinned to one lane while it has requests
     * in flight), and the generation that a GPU failure bumps so that requests enqueued behind
     * the failed one are rerun on the CPU (their device carry cannot be trusted). */
    unsigned exec_submitted;
    bool exec_on_gpu;
    bool exec_resync; /* a GPU failure: start nothing new until the stream drains */
    uint32_t exec_gen;
    void *exec_lane;
    unsigned exec_carry_index;
    /* Table links: hash chain and the creation-ordered list used by `streams`. */
    struct td_stream *hash_next;
    struct td_stream *list_prev;
    struct td_stream *list_next;
} td_stream_t;

typedef struct td_streams td_streams_t;

tally_status_t td_streams_new(unsigned max_streams, td_streams_t **out);
void td_streams_destroy(td_streams_t **self_p);

/* NULL when no stream of that name exists. */
td_stream_t *td_streams_find(td_streams_t *self, const char *name, size_t len);
/* Finds or creates; TALLY_E_LIMIT when max_streams exist already. */
tally_status_t td_streams_get(td_streams_t *self, const char *name, size_t len, td_stream_t **out);
/* Removes and frees a stream that has no running or queued request. */
void td_streams_remove(td_streams_t *self, td_stream_t **stream_p);

unsigned td_streams_count(const td_streams_t *self);
void td_streams_set_max(td_streams_t *self, unsigned max_streams);
/* Iteration in creation order: for (s = td_streams_first(t); s; s = s->list_next). */
td_stream_t *td_streams_first(td_streams_t *self);

/* Clears counters, carry, histogram and sequence numbers (the stream itself stays). */
void td_stream_clear(td_stream_t *stream);

#endif
