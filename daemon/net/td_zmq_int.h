/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_zmq_int.h — what the ZeroMQ transport's two files share: td_zmq.c (the socket, reading, the
 * loop handles) and td_zmq_send.c (replies, and the ones kept for connections that closed).
 * Private to daemon/net/.
 */
#ifndef TD_ZMQ_INT_H
#define TD_ZMQ_INT_H

#include <stdint.h>

#include "td_router.h"
#include "td_zmq.h"

/* td_sender_t.word: the message came with a REQ peer's empty delimiter frame, echoed back. */
#define TD_ZMQ_DELIMITER 1u

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
    bool idle_active;
    bool paused;           /* reading stopped at the in-flight limit */
    bool closed;           /* handles closed: read nothing more */
    td_zmq_lost_t *lost;   /* connections that closed with replies kept */
    uint64_t lost_total;   /* connections found closed with requests unanswered */
    uint64_t resent_total; /* kept replies sent once their connection came back */
};

/* td_transport_ops_t.send_reply. */
void td_zmq_send_reply(td_transport_t *transport, td_reply_t *reply);
/* Every kept reply is dropped (the socket is closing). */
void td_zmq_drop_kept(td_zmq_t *z);
/* Sends the reply now (its header encoded from reply->rep): 0, or the errno of the failed send
 * (EHOSTUNREACH: the peer has gone; EAGAIN: its send queue is full). */
int td_zmq_send_now(td_zmq_t *z, td_reply_t *reply);

#endif
