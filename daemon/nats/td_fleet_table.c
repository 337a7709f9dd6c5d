/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_fleet_table.c — a partition's streams in this worker's stream table, for td_fleet_part.c:
 * the snapshot a checkpoint stores, the checkpoint's state loaded at a take, and the local copy
 * deleted when the partition goes (PROTOCOL.md §13 "Exactly once across crashes"). The table
 * belongs to the loop thread: snapshots, loads and listings run there (td_fleet_on_loop), and
 * deletes go through the request path, after anything of the stream's still in flight.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_fleet_int.h"
#include "td_log.h"
#include "td_state.h"
#include "td_stream.h"

typedef struct {
    uint32_t k, partitions;
    uint8_t *buf;
    size_t len;
    td_err_t err;
    char msg[256];
    /* list: the names of the partition's streams */
    char (*names)[TALLY_STREAM_NAME_MAX + 1];
    size_t count;
} table_job_t;

static bool in_partition(const td_stream_t *s, void *arg)
{
    const table_job_t *j = arg;
    return tally_partition(s->name, s->name_len, j->partitions) == j->k;
}

/* A checkpoint's state is a base image alone (no append log goes with it), so its generation
 * only has to be one a base may carry (1 and up; version 4 refuses 0). */
#define TD_FLEET_STATE_GENERATION 1

static void snapshot_on_loop(td_fleet_t *f, void *arg)
{
    table_job_t *j = arg;
    j->err = td_state_encode_some(f->host.streams, td_clock_ms(), TD_FLEET_STATE_GENERATION,
                                  in_partition, j, &j->buf, &j->len);
}

static void restore_on_loop(td_fleet_t *f, void *arg)
{
    table_job_t *j = arg;
    td_state_report_t report;
    j->err = td_state_decode(j->buf, j->len, td_clock_ms(), f->host.streams, &report, j->msg,
                             sizeof j->msg);
    if (j->err == TD_OK && td_state_report_lossy(&report)) {
        snprintf(j->msg, sizeof j->msg, "%u of %u streams restored", report.restored,
                 report.records);
        j->err = TD_ERR_CORRUPT;
    }
}

static void list_on_loop(td_fleet_t *f, void *arg)
{
    table_job_t *j = arg;
    size_t n = 0;
    for (td_stream_t *s = td_streams_first(f->host.streams); s;
         s = td_streams_next(f->host.streams, s))
        n += in_partition(s, j);
    j->names = calloc(n + 1, sizeof *j->names);
    if (!j->names)
        return;
    for (td_stream_t *s = td_streams_first(f->host.streams); s;
         s = td_streams_next(f->host.streams, s))
        if (in_partition(s, j))
            memcpy(j->names[j->count++], s->name, s->name_len);
}

/* Deletes one stream of the local copy through the request path: sent again while the path
 * answers `busy` (at max_inflight, or out of memory) until deadline. Gone (deleted, or unknown
 * already): TD_OK; not tried, the deadline gone: TD_ERR_BUSY (the caller counts it). */
static td_err_t delete_local_stream(td_fleet_t *f, const char *name, int64_t deadline)
{
    tally_req_t del = {.version = TALLY_PROTO_VERSION, .opcode = TALLY_OP_DELETE};
    uint8_t frame[TALLY_REQ_HEADER_SIZE];
    if (tally_req_set_stream(&del, name) != TALLY_OK)
        return TD_ERR_CORRUPT;
    tally_req_encode(&del, frame);
    tally_status_t st = TALLY_E_BUSY;
    bool tried = false;
    int64_t left;
    while (st == TALLY_E_BUSY && (left = deadline - td_nats_now_ms()) > 0) {
        tried = true;
        size_t len = 0;
        uint8_t *reply = td_fleet_path_call(f, frame, sizeof frame, (int)left, &len);
        tally_rep_t rep;
        if (reply && len >= TALLY_REP_HEADER_SIZE &&
            tally_rep_decode(reply, TALLY_REP_HEADER_SIZE, &rep) == TALLY_OK)
            st = (tally_status_t)rep.status;
        free(reply); /* none: no free pending slot (send again), or no answer by the deadline */
        for (int64_t again = td_nats_now_ms() + TD_FLEET_RETRY_MS, now;
             st == TALLY_E_BUSY && (now = td_nats_now_ms()) < again;)
            td_fleet_path_poll(f, (int)(again - now)); /* other replies meanwhile */
    }
    if (st == TALLY_OK || st == TALLY_E_UNKNOWN_STREAM)
        return TD_OK;
    if (!tried)
        return TD_ERR_BUSY;
    td_warn("fleet: stream '%s' of a local copy not deleted: %s", name, tally_status_name(st));
    return TD_ERR_LIBRARY;
}

/* Every stream of partition k's local copy, one by one (td_fleet_int.h says why). */
td_err_t td_fleet_table_delete(td_fleet_t *f, uint32_t k, int64_t deadline, char *msg, size_t cap)
{
    table_job_t j = {.k = k, .partitions = f->partitions};
    td_fleet_on_loop(f, list_on_loop, &j);
    if (!j.names) {
        snprintf(msg, cap, "out of memory listing its local streams");
        return TD_ERR_NOMEM;
    }
    size_t kept = 0, untried = 0;
    for (size_t i = 0; i < j.count; i++) {
        td_err_t err = delete_local_stream(f, j.names[i], deadline);
        kept += err != TD_OK;
        untried += err == TD_ERR_BUSY;
    }
    free(j.names);
    if (kept)
        snprintf(msg, cap,
                 "%zu of its %zu local streams could not be deleted (%zu not tried: no "
                 "time left)",
                 kept, j.count, untried);
    return kept ? TD_ERR_LIBRARY : TD_OK;
}

td_err_t td_fleet_table_snapshot(td_fleet_t *f, uint32_t k, uint8_t **state, size_t *len)
{
    table_job_t j = {.k = k, .partitions = f->partitions};
    td_fleet_on_loop(f, snapshot_on_loop, &j);
    *state = j.buf;
    *len = j.len;
    return j.err;
}

td_err_t td_fleet_table_restore(td_fleet_t *f, uint32_t k, uint8_t *state, size_t len, char *msg,
                                size_t cap)
{
    /* a heartbeat at most: leases renewed in time */
    td_err_t err = td_fleet_table_delete(f, k, td_nats_now_ms() + f->ttl_ms / 3, msg, cap);
    if (err != TD_OK) /* restored over an old copy, its streams would count twice */
        return err;
    if (len == 0)
        return TD_OK;
    table_job_t j = {.k = k, .partitions = f->partitions, .buf = state, .len = len};
    td_fleet_on_loop(f, restore_on_loop, &j);
    if (j.err != TD_OK) {
        td_err("fleet: partition %u's checkpoint: %s", (unsigned)k, j.msg);
        snprintf(msg, cap, "its checkpoint: %s", j.msg);
    }
    return j.err;
}
