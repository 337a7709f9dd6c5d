/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_state_log.c — the snapshots' store (td_state.h): what each snapshot writes, so that the
 * bytes follow what changed.
 *
 * The store remembers what is on disk: the base's generation and size, and the log's length up
 * to its last whole record. A snapshot is taken on the loop thread (td_state_store_begin): the
 * records of the streams marked changed since the last one (td_stream_t.state_dirty) and a
 * removal for each stream removed (td_streams_take_removed), or, for a compaction, every
 * stream; the streams are marked clean as their records are taken, so the table may change
 * again while the job is written on a worker (td_state_job_write). If the write fails, the
 * records it held are not on disk and their streams are no longer marked: the next snapshot is a
 * whole one (a compaction), which writes every stream whatever its mark.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_config.h"
#include "td_log.h"
#include "td_state.h"

struct td_state_store {
    char *dir;
    uint64_t generation;      /* of the base on disk; 0 when there is none of version 4 */
    uint64_t next_generation; /* the next compaction's: never reused, even after a failure */
    size_t base_bytes;        /* the base's size */
    size_t log_bytes;         /* the log's length up to its last whole record */
    bool compact;             /* the next snapshot writes a whole base */
};

struct td_state_job {
    char *dir;
    bool full;           /* a compaction: buf is a base image */
    uint64_t generation; /* full: the base's */
    uint8_t *buf;        /* the base image, or the records to append */
    size_t len;
    size_t at; /* append: where, in the log */
    unsigned streams;
    td_err_t status;
    char msg[512];
};

td_err_t td_state_store_open(const char *dir, td_streams_t *streams, td_state_store_t **out,
                             char *msg, size_t msg_cap)
{
    td_state_report_t r;
    td_err_t err = td_state_restore(dir, streams, &r, msg, msg_cap);
    if (err != TD_OK)
        return err;
    td_state_store_t *self = calloc(1, sizeof *self);
    if (!self || !(self->dir = strdup(dir))) {
        free(self);
        snprintf(msg, msg_cap, "out of memory");
        return TD_ERR_NOMEM;
    }
    bool v4 = r.version == TD_STATE_VERSION && r.generation != 0;
    self->generation = v4 ? r.generation : 0;
    self->next_generation = self->generation + 1;
    self->base_bytes = r.base_bytes;
    self->log_bytes = r.log_used ? r.log_good : 0;
    /* Appending goes on only after a whole version-4 pair was read: anything else (no base, an
     * earlier format, a missing, stale or unusable log, lost records) is rewritten whole. */
    self->compact = !v4 || !r.log_used || td_state_report_lossy(&r);
    td_streams_track_removed(streams, true);
    *out = self;
    return TD_OK;
}

void td_state_store_close(td_state_store_t **self_p)
{
    td_state_store_t *self = *self_p;
    if (!self)
        return;
    free(self->dir);
    free(self);
    *self_p = NULL;
}

/* A compaction's job: every stream, in a base of the next generation. */
static td_err_t begin_full(td_state_store_t *self, td_streams_t *streams, uint64_t now_ms,
                           td_state_job_t *job)
{
    job->full = true;
    job->generation = self->next_generation++;
    td_err_t err = td_state_encode(streams, now_ms, job->generation, &job->buf, &job->len);
    if (err != TD_OK)
        return err;
    for (td_stream_t *s = td_streams_first(streams); s; s = td_streams_next(streams, s))
        s->state_dirty = false;
    job->streams = td_streams_count(streams);
    return TD_OK;
}

/* The removals, then the records of the streams changed since the last snapshot (a stream
 * removed and made again comes after its removal). */
static td_err_t begin_append(td_state_store_t *self, td_streams_t *streams, uint64_t now_ms,
                             const uint8_t *removed, unsigned removed_count, td_state_job_t *job)
{
    size_t len = 0;
    const uint8_t *p = removed;
    for (unsigned i = 0; i < removed_count; i++, p += 1 + *p)
        len += td_state_record_encode_removed((const char *)p + 1, *p, NULL);
    for (td_stream_t *s = td_streams_first(streams); s; s = td_streams_next(streams, s))
        if (s->state_dirty)
            len += td_state_record_encode(s, now_ms, NULL);
    if (len == 0)
        return TD_OK;
    job->buf = malloc(len);
    if (!job->buf)
        return TD_ERR_NOMEM;
    uint8_t *out = job->buf;
    p = removed;
    for (unsigned i = 0; i < removed_count; i++, p += 1 + *p)
        out += td_state_record_encode_removed((const char *)p + 1, *p, out);
    for (td_stream_t *s = td_streams_first(streams); s; s = td_streams_next(streams, s)) {
        if (!s->state_dirty)
            continue;
        out += td_state_record_encode(s, now_ms, out);
        s->state_dirty = false;
        job->streams++;
    }
    job->len = len;
    job->at = self->log_bytes;
    return TD_OK;
}

td_err_t td_state_store_begin(td_state_store_t *self, td_streams_t *streams, uint64_t now_ms,
                              td_state_job_t **out)
{
    *out = NULL;
    uint8_t *removed = NULL;
    size_t removed_len = 0;
    unsigned removed_count = 0;
    bool lost = false;
    td_streams_take_removed(streams, &removed, &removed_len, &removed_count, &lost);
    bool full = self->compact || lost ||
                (self->log_bytes > self->base_bytes && self->log_bytes > TD_STATE_LOG_MIN);
    td_state_job_t *job = calloc(1, sizeof *job);
    td_err_t err = job ? TD_OK : TD_ERR_NOMEM;
    if (err == TD_OK)
        err = full ? begin_full(self, streams, now_ms, job)
                   : begin_append(self, streams, now_ms, removed, removed_count, job);
    free(removed);
    if (err != TD_OK || !job->buf) { /* failed, or nothing changed */
        if (err != TD_OK)
            self->compact = true; /* what was taken is not on disk: write everything next */
        free(job);
        return err;
    }
    job->dir = self->dir;
    job->status = TD_ERR_IO; /* until td_state_job_write says otherwise */
    snprintf(job->msg, sizeof job->msg, "the write never ran");
    *out = job;
    return TD_OK;
}

void td_state_job_write(td_state_job_t *job)
{
    if (!job->full) {
        job->status = td_state_append(job->dir, job->at, job->buf, job->len, job->msg,
                                      sizeof job->msg);
        return;
    }
    uint8_t header[TD_STATE_HEADER_SIZE];
    td_state_log_header(job->generation, header);
    job->status =
        td_state_write_file(job->dir, TD_STATE_FILE, job->buf, job->len, job->msg, sizeof job->msg);
    if (job->status == TD_OK) /* only once the base is durable: see the crash windows */
        job->status = td_state_write_file(job->dir, TD_STATE_LOG_FILE, header, sizeof header,
                                          job->msg, sizeof job->msg);
}

td_err_t td_state_store_end(td_state_store_t *self, td_state_job_t **job_p, char *msg,
                            size_t msg_cap, size_t *written, unsigned *streams, bool *full)
{
    td_state_job_t *job = *job_p;
    td_err_t status = job->status;
    *written = job->full ? job->len + TD_STATE_HEADER_SIZE : job->len;
    *streams = job->streams;
    *full = job->full;
    if (status != TD_OK) {
        snprintf(msg, msg_cap, "%s", job->msg);
        self->compact = true;
    } else if (job->full) {
        self->generation = job->generation;
        self->base_bytes = job->len;
        self->log_bytes = TD_STATE_HEADER_SIZE;
        self->compact = false;
    } else {
        self->log_bytes += job->len;
    }
    free(job->buf);
    free(job);
    *job_p = NULL;
    return status;
}
