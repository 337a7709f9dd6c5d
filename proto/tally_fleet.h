/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_fleet.h — the names of the NATS JetStream transport (PROTOCOL.md §13), defined once for
 * libtally's producer and the daemon's worker: subjects, JetStream streams, key-value buckets
 * and keys, message headers. Pure C: formatting names into caller buffers, no libnats.
 *
 * The partition function itself (tally_partition, tally_fnv1a64) is public, in tally_proto.h.
 */
#ifndef TALLY_FLEET_H
#define TALLY_FLEET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tally_proto.h"

/* Subjects: ingest (JetStream), dead letters (JetStream), queries to a partition's owner, a
 * stream's last_seq from its owner, control (one member), streams (every member), histogram
 * publications. The ones a client publishes to end in the publisher's NATS user name, which the
 * server's permissions let only that user use (PROTOCOL.md §13 "Security"): tally.in.<k>.<user>,
 * tally.q.<k>.<user>, tally.seq.<k>.<user>, tally.ctl.<user>, tally.streams.<user>. The
 * prefixes ending in a dot take the partition number next. */
#define TALLY_NATS_SUBJ_IN "tally.in."
#define TALLY_NATS_SUBJ_DEAD "tally.dead."
#define TALLY_NATS_SUBJ_QUERY "tally.q."
#define TALLY_NATS_SUBJ_SEQ "tally.seq."
#define TALLY_NATS_SUBJ_CTL "tally.ctl"
#define TALLY_NATS_SUBJ_STREAMS "tally.streams"
#define TALLY_NATS_SUBJ_WATCH "tally.watch."
#define TALLY_NATS_CTL_QUEUE "tally"
/* Every user's inboxes are under _INBOX.<user>. (libnats' custom inbox prefix): replies go only
 * there. The user of a connection that names none (no user in its URL, no [nats] user). */
#define TALLY_NATS_INBOX "_INBOX."
#define TALLY_NATS_USER_ANON "anon"

/* JetStream streams: TALLY_P<k> per partition; the dead letters of all partitions. */
#define TALLY_NATS_STREAM_PREFIX "TALLY_P"
#define TALLY_NATS_DEAD_STREAM "TALLY_DEAD"
/* Direct mode, replicated: partition k's changelog, the stream TALLY_CL<k> on tally.cl.<k>. */
#define TALLY_NATS_CL_STREAM_PREFIX "TALLY_CL"
#define TALLY_NATS_SUBJ_CL "tally.cl."
/* The durable pull consumer of partition k: tally-p<k>. */
#define TALLY_NATS_CONSUMER_PREFIX "tally-p"

/* Key-value buckets and their keys. */
#define TALLY_NATS_BUCKET_FLEET "TALLY_FLEET" /* key "partitions" */
#define TALLY_NATS_KEY_PARTITIONS "partitions"
#define TALLY_NATS_BUCKET_MEMBERS "TALLY_MEMBERS" /* key: the member id (TTL) */
#define TALLY_NATS_BUCKET_LEASES "TALLY_LEASES"   /* key p<k>: the owner (TTL) */
#define TALLY_NATS_BUCKET_CKPT "TALLY_CKPT"       /* key p<k>: manifest; p<k>.<gen>.<i>: chunks */
/* Direct mode (PROTOCOL.md §13 "Direct mode"): key = the member id (TTL = the lease TTL), value
 * "zmq=<endpoint>\n" and, with the side channel on, "shm=<path>\n". */
#define TALLY_NATS_BUCKET_ENDPOINTS "TALLY_ENDPOINTS"
#define TALLY_NATS_ENDPOINT_MAX 256

/* Message headers. */
#define TALLY_NATS_HDR_MSG_ID "Nats-Msg-Id"
#define TALLY_NATS_HDR_REPLY "Tally-Reply"
#define TALLY_NATS_HDR_REPLY_ID "Tally-Msg-Id"
#define TALLY_NATS_HDR_PARTITION "Tally-Partition"
#define TALLY_NATS_HDR_SEQ "Tally-Seq"
#define TALLY_NATS_HDR_STATUS "Tally-Status"
#define TALLY_NATS_HDR_REASON "Tally-Reason"
#define TALLY_NATS_HDR_STREAM "Tally-Stream"
#define TALLY_NATS_HDR_MEMBER "Tally-Member"
#define TALLY_NATS_HDR_EPOCH "Tally-Epoch" /* changelog: the writer's lease revision */
#define TALLY_NATS_HDR_BATCH "Tally-Batch" /* changelog: the writer's batch number (0: a fence) */
#define TALLY_NATS_HDR_MEMBERS "Tally-Members" /* `streams` answers: the live members */
/* `streams` answers: the partitions whose streams the answer lists (tally_fleet_owned_format) */
#define TALLY_NATS_HDR_OWNED "Tally-Owned"
/* A `query` on tally.q.<k>.<user> that a standby's copy may answer (any value); such an answer
 * carries Tally-Stale: the last changelog sequence the copy applied (PROTOCOL.md §13). */
#define TALLY_NATS_HDR_STALE_OK "Tally-Stale-Ok"
#define TALLY_NATS_HDR_STALE "Tally-Stale"

/* A dedupe id is 1..192 bytes (libtally's: user, producer id, number and, renamed after a
 * collision, 16 hex digits); a member id 1..64 of A-Z a-z 0-9 - _. */
#define TALLY_NATS_MSG_ID_MAX 192
#define TALLY_NATS_MEMBER_ID_MAX 64
/* Room kept for NATS headers below max_payload when a reply's size is judged (PROTOCOL.md §13
 * "Validation"), and by producers when they cut batches. */
#define TALLY_NATS_HEADROOM 4096u

/* Writes prefix followed by k in decimal into buf (cap bytes); the length, or 0 when it does not
 * fit. */
size_t tally_fleet_name(char *buf, size_t cap, const char *prefix, uint32_t k);
/* True when id is a valid member id (PROTOCOL.md §13 "Membership"); a NATS user name the fleet
 * takes (a subject's last token) follows the same rule. */
bool tally_fleet_member_id_valid(const char *id);
/* Writes prefix, k in decimal, a dot and user ("tally.in.3.cam1"); k < 0: prefix, a dot and user
 * ("tally.ctl.cam1"). The length, or 0 when it does not fit. */
size_t tally_fleet_subject(char *buf, size_t cap, const char *prefix, int64_t k, const char *user);
/* The user a client subject names: its last token (a pointer into subject), or NULL when it is
 * not a valid user name. */
const char *tally_fleet_subject_user(const char *subject);
/* True when a worker may publish a reply to `reply` for `user`: a subject under _INBOX.<user>.
 * without wildcards or spaces. */
bool tally_fleet_reply_allowed(const char *reply, const char *user);
/* True when a dedupe id is in user's namespace: "<user>." and at least one byte more. */
bool tally_fleet_id_allowed(const char *id, const char *user);
/* The partitions marked in owned[0..partitions) as a Tally-Owned value: a hex bitmap, character i
 * holding partitions 4i..4i+3 (partition 4i+j in bit j), so ceil(partitions / 4) characters,
 * all '0' when none is marked. Writes out (cap bytes with its NUL); the length, 0 when it does
 * not fit. */
size_t tally_fleet_owned_format(const bool *owned, uint32_t partitions, char *out, size_t cap);
/* Marks in covered[0..partitions) the partitions a Tally-Owned value names; the number newly
 * marked, or -1 when text is not such a value (not hex, longer than partitions need, or a bit
 * at or past partitions set), leaving covered as it was. */
int tally_fleet_owned_merge(const char *text, uint32_t partitions, bool *covered);
/* A list of NATS URLs as logs and messages may show it: each URL's password ("user:***@") or
 * token ("***@") masked. Writes out (cap bytes, cut at a URL's end when short) and returns it. */
const char *tally_fleet_redact(const char *servers, char *out, size_t cap);
/* The value of `key` ("zmq", "shm") in a TALLY_ENDPOINTS value (len bytes, lines of key=value)
 * into out (cap bytes, NUL-terminated): true when it is there, not empty, and fits. */
bool tally_fleet_endpoint_get(const char *value, size_t len, const char *key, char *out,
                              size_t cap);

/* Bytes of a host identity with its NUL: a boot id is 36 characters. */
#define TALLY_FLEET_HOST_MAX 64
/* This host's identity as TALLY_ENDPOINTS' `host=` says it (PROTOCOL.md §13 "Direct mode"): the
 * kernel's boot id, /proc/sys/kernel/random/boot_id, into out (cap bytes, NUL-terminated); true
 * when it could be read. Two processes see the same one exactly when they run on one kernel,
 * which is what passing a memfd over a Unix socket needs; /etc/machine-id is not that (copied
 * with a VM image, different in containers that share a kernel). Here, though it reads a file:
 * the daemon publishes it and libtally compares it, one fact in one place. */
bool tally_fleet_host_id(char *out, size_t cap);

#endif
