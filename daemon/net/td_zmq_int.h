/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_zmq_int.h — what the ZeroMQ transport's two files share: td_zmq.c (the socket, reading, the
 * loop handles) and td_zmq_send.c (replies, and the ones kept for connections that closed).
 * Private to daemon/net/.
 */
#ifndef TD_ZMQ_INT_H
#define TD_ZMQ_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <zmq.h>

#include "td_router.h"
#include "td_zmq.h"

/* td_sender_t.word: the message came with a REQ peer's empty delimiter frame, echoed back. */
#define TD_ZMQ_DELIMITER 1u

/* The connections tallyd has read from (td_zmq_conn.c): hash buckets by metadata key. */
#define TD_ZMQ_CONN_BUCKETS 512

typedef struct td_zmq_conn td_zmq_conn_t;

/* A descriptor as the socket monitor has seen it: connections accepted and closed on it, which
 * of them tallyd made a record of last (numbered by the closes before it: the first is 1), and
 * the record of the one tallyd reads from now. */
typedef struct {
    uint64_t accepted;
    uint64_t disconnected;
    uint64_t recorded;
    td_zmq_conn_t *conn;
} td_zmq_fd_t;

/* The replies kept for a connection that has closed (its routing id), in order, since when. */
typedef struct td_zmq_lost {
    td_reply_t *head;
    td_reply_t *tail;
    uint64_t since_ns;
    struct td_zmq_lost *next;
    size_t id_len;
    uint8_t id[]; /* the routing id */
} td_zmq_lost_t;

struct td_zmq {
    td_transport_t base; /* first: the request path answers through it */
    td_zmq_env_t env;
    td_router_t rt; /* the context, the ROUTER socket, CURVE */
    uv_poll_t poll;
    uv_check_t check;
    uv_idle_t idle;
    uv_timer_t retry_timer; /* replies kept for connections that closed */
    uv_poll_t monitor_poll; /* the socket monitor's events (td_zmq_conn.c) */
    bool idle_active;
    /* The pump's last look (ZMQ_EVENTS) found nothing to read, and nothing has used the socket
     * since (a send clears it): its descriptor signals whatever comes next, so the check after a
     * loop iteration need not look again (td_zmq.c). */
    bool settled;
    bool none_waiting;       /* input_waiting said no during this pump: no read to try again */
    bool paused;             /* reading stopped at the in-flight limit */
    bool closed;             /* handles closed: read nothing more */
    td_zmq_lost_t *lost;     /* connections that closed with replies kept */
    uint64_t lost_total;     /* connections found closed with requests unanswered */
    uint64_t resent_total;   /* kept replies sent once their connection came back */
    uint64_t rerouted_total; /* requests read after a hand-over, answered to the new connection */
    /* The connections (td_zmq_conn.c). */
    td_zmq_conn_t *conns[TD_ZMQ_CONN_BUCKETS];
    td_zmq_conn_t *closed_head, *closed_tail; /* closed ones kept a while, oldest first */
    unsigned closed_count;
    td_zmq_fd_t *fds; /* by descriptor */
    size_t fds_len;
};

/* The connection a message came from, as its metadata (meta: one of its frames after the routing
 * id) tells, found or recorded; *id and *id_len are the routing id its reply goes to: the
 * envelope's, or the one a hand-over had renamed. NULL when it cannot be told (no metadata, no
 * memory): the message goes on untracked. */
td_zmq_conn_t *td_zmq_conn_of(td_zmq_t *z, const zmq_msg_t *meta, const uint8_t **id,
                              size_t *id_len);
/* A request of c (NULL: untracked) goes to the request path; its reply will end it. */
void td_zmq_conn_read(td_zmq_t *z, td_zmq_conn_t *c);
/* The reply to a request of c (NULL: untracked) was handed on: to ZeroMQ, kept, or dropped. */
void td_zmq_conn_answered(td_zmq_conn_t *c);
/* A reply to c (or, untracked, to peer_name) found its connection gone: counted and logged,
 * once per connection. */
void td_zmq_conn_gone(td_zmq_t *z, td_zmq_conn_t *c, const char *peer_name);
/* Reads the socket monitor's events (connections accepted and closed) until none is left. */
void td_zmq_monitor_read(td_zmq_t *z);
/* The records are let go: each lives on until the replies of its requests have ended. */
void td_zmq_conns_free(td_zmq_t *z);

/* td_transport_ops_t.send_reply. */
void td_zmq_send_reply(td_transport_t *transport, td_reply_t *reply);
/* Every kept reply is dropped (the socket is closing). */
void td_zmq_drop_kept(td_zmq_t *z);
/* Sends the reply now (its header encoded from reply->rep): 0, or the errno of the failed send
 * (EHOSTUNREACH: the peer has gone; EAGAIN: its send queue is full). */
int td_zmq_send_now(td_zmq_t *z, td_reply_t *reply);

#endif
