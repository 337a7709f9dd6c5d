/* SPDX-License-Identifier: Apache-2.0 */
/*
 * nats_cluster.h — a real NATS JetStream cluster for the tests: N nats-server processes on
 * loopback ports chosen at run time, each with its own store directory under one scratch
 * directory, no monitoring port, `max_payload 8MB`. Started and stopped by the test; a node can be
 * killed (kill -9) and restarted on the same ports and store. The servers die with the test
 * process (PR_SET_PDEATHSIG), so a crashed test leaves no nats-server behind.
 *
 * Ready means: every running node answers a JetStream account-info request, which it does only
 * once the cluster has elected its meta leader (before that: "JetStream system temporarily
 * unavailable").
 */
#ifndef TALLY_TEST_NATS_CLUSTER_H
#define TALLY_TEST_NATS_CLUSTER_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#define TN_MAX_NODES 5

typedef struct {
    pid_t pid; /* 0 when not running */
    int client_port;
    int cluster_port;
    char url[64]; /* nats://127.0.0.1:PORT */
    char conf_path[320];
    char log_path[320]; /* the server's log (-l) */
} tn_node_t;

typedef struct tn_cluster tn_cluster_t;

typedef struct {
    /* Lines added to every node's configuration (e.g. an authorization block); may be NULL. */
    const char *extra_conf;
    /* Instead of the generated configuration: writes node i's (its ports and paths are in
     * c->node[i] and c->dir; every node's before any starts); 0, or -1. NULL: generated. */
    int (*write_conf)(const tn_cluster_t *c, int i, FILE *f, void *ctx);
    void *ctx;
    /* How the harness connects (readiness, tn_connect): a user and password (its inboxes then
     * _INBOX.<user>), a CA file that turns TLS on, a client certificate and key; NULL: none. */
    const char *user, *password, *tls_ca, *tls_cert, *tls_key;
    /* Ready once a client connects (a server without JetStream); else once JetStream answers. */
    bool ready_on_connect;
} tn_options_t;

struct tn_cluster {
    int nodes;
    char dir[256];  /* the scratch directory: configs, logs, stores */
    char urls[384]; /* every node's URL, comma-separated (what a client is given) */
    tn_node_t node[TN_MAX_NODES];
    tn_options_t opts; /* as started (the strings are the caller's) */
};

/* The nats-server under test: $TALLY_NATS_SERVER, else nats-server on the PATH; NULL when none
 * is executable (tests then skip with 77). */
const char *tn_server_bin(void);
/* True, saying "nats-server not found: skipped" on stderr, when tn_server_bin finds none: a
 * test's main then returns 77, CTest's skip. */
bool tn_skip(void);

/* Starts a cluster of `nodes` (1..TN_MAX_NODES; 1 = a single JetStream server, no cluster
 * block) and waits until it is ready (at most timeout_ms). 0, or -1 (logged; nothing left
 * running). */
int tn_cluster_start(tn_cluster_t *c, int nodes, const tn_options_t *opts, int timeout_ms);
/* Waits until every running node is ready; 0, or -1 at timeout_ms. */
int tn_cluster_wait_ready(tn_cluster_t *c, int timeout_ms);
/* Sends sig to node i and, for SIGKILL/SIGTERM/SIGINT, reaps it; 0, or -1. */
int tn_node_kill(tn_cluster_t *c, int i, int sig);
/* Starts node i again (same ports, config and store) and waits until it is ready; 0, or -1. */
int tn_node_restart(tn_cluster_t *c, int i, int timeout_ms);
/* True when node i's log contains text. */
bool tn_node_log_contains(const tn_cluster_t *c, int i, const char *text);
/* A connection to every node (reconnecting forever, quickly), and a JetStream context on it
 * (API waits of 5 s): for tests that look at the cluster directly. 0, or -1. */
typedef struct __natsConnection natsConnection;
typedef struct __jsCtx jsCtx;
int tn_connect(const tn_cluster_t *c, natsConnection **nc, jsCtx **js);
/* A test program's one cluster and connection, for cmocka group setup and teardown:
 * tn_suite_setup starts `nodes` nodes and connects (0, or -1); tn_suite_teardown stops all. */
extern tn_cluster_t tn_suite;
extern natsConnection *tn_suite_nc;
extern jsCtx *tn_suite_js;
int tn_suite_setup(int nodes);
int tn_suite_teardown(void);
/* Waits until `count` of a fleet's `partitions` leases (keys p<k> of TALLY_LEASES) are held by
 * member (NULL: by anyone): the milliseconds it took, or -1 at timeout_ms (*held: how many were
 * at the last look). */
int64_t tn_wait_leases(jsCtx *js, uint32_t partitions, const char *member, int count,
                       int timeout_ms, int *held);
/* Publishes data (len bytes) to JetStream on subject with the headers Tally-Reply reply_to and
 * Nats-Msg-Id id (each NULL: left out), waiting for its PubAck: NATS_OK, or the failure. */
int tn_publish(jsCtx *js, const char *subject, const void *data, int len, const char *reply_to,
               const char *id);
/* Partition k's stream (TALLY_P<k>): its message count, first and last sequences into those of
 * msgs, first and last that are not NULL. 0, or -1 when the stream is missing or JetStream did
 * not answer for 10 s (asked again meanwhile: a stream electing a new leader after a kill). */
int tn_partition_seqs(jsCtx *js, uint32_t k, uint64_t *msgs, uint64_t *first, uint64_t *last);
/* No fleet on the cluster any more: the partitions' streams (0..partitions-1) and their
 * changelogs (TALLY_CL<k>), the dead letters
 * and every bucket a fleet makes (TALLY_FLEET, _MEMBERS, _LEASES, _CKPT, _ENDPOINTS) deleted, so
 * that a test's workers make their own (a lease TTL is the buckets'). */
void tn_fleet_delete(jsCtx *js, uint32_t partitions);
/* The index of the node named by server name `name` ("n<i>"), or -1. */
int tn_node_index(const tn_cluster_t *c, const char *name);
/* Kills every node (SIGKILL: no state is kept), reaps them and removes the scratch
 * directory. Safe to call twice. */
void tn_cluster_stop(tn_cluster_t *c);

#endif
