/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_nats_ckpt.h — a partition's checkpoint in TALLY_CKPT (PROTOCOL.md §13 "Checkpoints"): its
 * state (bytes the caller encodes: a state file image of the partition's streams) with the last
 * JetStream sequence applied, committed by one compare-and-set write of the manifest key p<k>.
 *
 * Fencing. A worker that takes a partition first writes the manifest back with its own epoch
 * (the revision of its lease), by compare-and-set: from then on the previous owner's writes,
 * compare-and-set on the revision it knew, fail. A state over TD_CKPT_CHUNK_BYTES goes into chunk
 * keys p<k>.<epoch>.<slot>.<i> written before the manifest; slot is the generation's parity, so
 * an owner never rewrites the chunks the current manifest names, and the epoch in the name keeps
 * a stale owner's chunks apart from its successor's (the manifest names the epoch its chunks were
 * written under, which a fence leaves as it is). An owner's first write removes the chunk keys
 * of every other epoch (a predecessor's, now unreferenced).
 */
#ifndef TD_NATS_CKPT_H
#define TD_NATS_CKPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <nats/nats.h>

#include "tally_fleet.h"
#include "td_err.h"

#define TD_CKPT_MAGIC "TLYC"
#define TD_CKPT_VERSION 1u
#define TD_CKPT_MANIFEST_SIZE 120u
/* Version 2 (written when cl_seq is not 0: direct = replicated) adds cl_seq at 120..127. */
#define TD_CKPT_VERSION_CL 2u
#define TD_CKPT_MANIFEST_SIZE_CL 128u
/* Version 3 (written with a cl_since: a `replicated` owner with standbys, PROTOCOL.md §13
 * "Standbys") adds cl_since_epoch at 128..135 and cl_since_generation at 136..143. */
#define TD_CKPT_VERSION_SINCE 3u
#define TD_CKPT_MANIFEST_SIZE_SINCE 144u
#define TD_CKPT_MEMBER_OFF 56u
/* A state up to this size is stored after the manifest in the same value; larger ones in chunks
 * of this size (well under a message's 8 MiB with max_payload 8MB, or 1 MiB by default less
 * the headers: 1 MiB fits neither, so chunks are a bit smaller than 1 MiB). */
#define TD_CKPT_CHUNK_BYTES ((1u << 20) - 4096u)

typedef struct {
    uint64_t applied_seq;
    uint64_t epoch;
    uint64_t generation;
    uint64_t state_len;
    uint32_t chunks;      /* 0: inline */
    uint32_t crc;         /* zlib crc32 of the state */
    uint64_t chunk_epoch; /* the epoch in the chunks' keys: that of the owner that wrote them */
    char member[TALLY_NATS_MEMBER_ID_MAX + 1];
    uint64_t cl_seq; /* the partition's changelog (TALLY_CL<k>) is in the state up to it */
    /* cl_since: every change of the partition's state since the checkpoint of this epoch and
     * generation (its base) is in the changelog after that checkpoint's cl_seq, so that base plus
     * the changelog is this state (docs/fleet.md "Standbys across checkpoints"). Epoch 0: no
     * such claim (versions 1 and 2 make none). */
    uint64_t cl_since_epoch, cl_since_generation;
} td_ckpt_manifest_t;

/* True when m's cl_since covers a copy started from the checkpoint of epoch and generation: the
 * copy's base is m's base or a later checkpoint of the same line (a manifest deleted by hand
 * starts its generations again, under a later epoch), up to m itself. */
bool td_ckpt_since_covers(const td_ckpt_manifest_t *m, uint64_t epoch, uint64_t generation);

/* The manifest's size: TD_CKPT_MANIFEST_SIZE, TD_CKPT_MANIFEST_SIZE_CL with a cl_seq, or
 * TD_CKPT_MANIFEST_SIZE_SINCE with a cl_since (what td_ckpt_manifest_encode writes to out). */
size_t td_ckpt_manifest_size(const td_ckpt_manifest_t *m);
void td_ckpt_manifest_encode(const td_ckpt_manifest_t *m, uint8_t *out);
/* TD_ERR_CORRUPT with msg for a value that is not a manifest (magic, version, reserved bytes,
 * member id, inline length, chunk count against the length). */
td_err_t td_ckpt_manifest_decode(const uint8_t *buf, size_t len, td_ckpt_manifest_t *m, char *msg,
                                 size_t cap);

/* One owner's view of one partition's checkpoint. */
typedef struct {
    jsCtx *js;   /* reads (from the leader) */
    kvStore *kv; /* writes */
    uint32_t k;
    char member[TALLY_NATS_MEMBER_ID_MAX + 1];
    uint64_t epoch;
    uint64_t revision;      /* of the manifest key, as this owner last wrote it */
    uint64_t cl_seq;        /* the changelog's sequence the next write's state covers */
    /* the cl_since the next write claims (epoch 0: none): the owner's to set */
    uint64_t since_epoch, since_generation;
    td_ckpt_manifest_t cur; /* the manifest at that revision */
    bool cleaned;           /* other epochs' chunks removed (or that tried and failed) */
} td_ckpt_t;

/* Takes partition k's checkpoint for member under epoch: fences the previous owner, then loads
 * the state (*state malloc'ed, NULL when empty; *len bytes) and the manifest into c->cur.
 * *fenced: another writer moved the manifest meanwhile (this worker does not own the partition
 * after all). TD_ERR_CORRUPT when the stored checkpoint does not check out (crc, length). */
td_err_t td_ckpt_take(td_ckpt_t *c, jsCtx *js, kvStore *kv, uint32_t k, const char *member,
                      uint64_t epoch, uint8_t **state, size_t *len, bool *fenced, char *msg,
                      size_t cap);
/* Writes a checkpoint: state (len bytes) as of applied_seq. *fenced: the manifest moved since
 * this owner's last write (a new owner took the partition): nothing of it is committed. TD_OK
 * once the manifest is committed; msg is then empty, or says why the removal of other epochs'
 * chunks that follows an owner's first write failed (not tried again: the chunks stay until the
 * next owner's first write). */
td_err_t td_ckpt_write(td_ckpt_t *c, uint64_t applied_seq, const uint8_t *state, size_t len,
                       bool *fenced, char *msg, size_t cap);
/* Reads partition k's committed checkpoint without taking it (tests, tools): manifest and state
 * as td_ckpt_take loads them; TD_ERR_CONFIG when there is none. */
td_err_t td_ckpt_read(jsCtx *js, uint32_t k, td_ckpt_manifest_t *m, uint8_t **state, size_t *len,
                      char *msg, size_t cap);

#endif
