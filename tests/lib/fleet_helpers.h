/* SPDX-License-Identifier: Apache-2.0 */
/*
 * fleet_helpers.h — what the fleet tests share beyond the cluster (nats_cluster.h): a fleet
 * worker started on the suite's cluster (test_nats_election.c, test_nats_pause.c,
 * test_nats_faults.c), and for the tests of direct mode (test_nats_route.c,
 * test_nats_changelog.c, test_nats_standby.c) a model of numbered u8 hist writes to streams
 * "<prefix>/<s>", sent and checked through a fleet client, and the members that answer them.
 * Functions that check something fail the cmocka test that calls them.
 */
#ifndef TALLY_TEST_FLEET_HELPERS_H
#define TALLY_TEST_FLEET_HELPERS_H

#include <stddef.h>
#include <stdint.h>

#include "harness.h"
#include "tally.h"
#include "td_nats_ckpt.h"

typedef struct __jsCtx jsCtx;

/* Starts d as a fleet worker on the suite's cluster (tn_suite): 3 replicas, `partitions`
 * partitions, member id `id`, window rings off, then the options in extra (NULL-terminated;
 * NULL: none). What th_daemon_start returns. */
int tf_worker_start(th_daemon_t *d, const char *id, uint32_t partitions, const char *const *extra);

/* A direct-mode test's streams, their model and its members: stream s (s < streams) is
 * "<prefix>/<s>", bins[s] its u8 histogram and seqs[s] the last seq sent to it (the test's own
 * arrays); member[i] the tallyd of member ids[i] (i < members) in a fleet of `partitions`. */
typedef struct {
    const char *prefix;
    int streams;
    uint64_t (*bins)[256];
    uint64_t *seqs;
    uint32_t partitions;
    th_daemon_t *member;
    const char *const *ids;
    int members;
} tf_fleet_t;

/* The largest batch tf_batch writes. */
#define TF_BATCH_MAX 600

/* No fleet on the suite's cluster (tn_fleet_delete), and the model empty. */
void tf_fresh(const tf_fleet_t *f);
/* Stream s's name into out (cap bytes). */
void tf_stream_name(const tf_fleet_t *f, int s, char *out, size_t cap);
/* The partition of stream s. */
uint32_t tf_partition_of(const tf_fleet_t *f, int s);
/* Stream s's batch of round r into out (TF_BATCH_MAX bytes): its length, 200 to 499. */
size_t tf_batch(int s, int r, uint8_t *out);
/* Stream s's batch of round r sent as a u8 hist with the stream's next seq (not waiting for the
 * reply), and put into the model. */
void tf_send_hist(const tf_fleet_t *f, tally_client_t *c, int s, int r);
/* One reply: OK, or `duplicate` (a resend whose first try was stored). */
void tf_recv_applied(tally_client_t *c);
/* Stream s, queried through c, equals its model (bins and last_seq); else the members' logs and
 * what differs. */
void tf_check_stream(const tf_fleet_t *f, tally_client_t *c, int s);
/* Every stream equals its model (tf_check_stream). */
void tf_check_model(const tf_fleet_t *f, tally_client_t *c);
/* A fleet client (tally_client_new_fleet) of the fleet on servers. */
tally_client_t *tf_fleet_client(const char *servers, int timeout_ms);
/* The members that run, each stopped as an operator would (th_daemon_end). */
void tf_members_end(const tf_fleet_t *f);
/* The end of each member's log, debug lines left out, on stderr: for a failure's report. */
void tf_dump_logs(const tf_fleet_t *f);
/* How many partitions the plan gives member i of all the members (rendezvous hashing: not
 * always an even share). */
int tf_planned(const tf_fleet_t *f, int i);
/* Waits until member id holds `count` partitions' leases; the members' logs when it does not
 * within timeout_ms. */
void tf_wait_held(const tf_fleet_t *f, const char *id, int count, int timeout_ms);
/* The last sequence of partition k's changelog (TALLY_CL<k>) on js (the suite's, or a test's
 * own server). */
uint64_t tf_changelog_last(jsCtx *js, uint32_t k);
/* Partition k's checkpoint manifest on the suite's cluster. */
td_ckpt_manifest_t tf_manifest(uint32_t k);

#endif
