/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_zmq_conn.c — the ROUTER's connections as tallyd sees them (td_zmq.h says why it must): which
 * connection each message came from, whom its reply goes to after a hand-over, and the count and
 * log of the connections that closed while tallyd still owed them replies.
 *
 * libzmq gives the user of a ROUTER no handle on a connection, only each message's routing id.
 * Two things tell connections apart all the same:
 *   - every message carries its connection's metadata, one object per connection (libzmq's
 *     stream_engine_base_t::mechanism_ready compiles it: the ZMTP properties, Identity among
 *     them, Peer-Address, and "__fd", the descriptor ZMQ_SRCFD reads), alive while the connection
 *     or any message of it is. The address of its "__fd" value is the connection's key here;
 *   - the socket monitor (td_router.c) reports ZMQ_EVENT_ACCEPTED and ZMQ_EVENT_DISCONNECTED
 *     with the descriptor. Connections on one descriptor follow each other, and a connection's
 *     disconnection is reported before its descriptor is closed (stream_engine_base_t::error),
 *     so before the next connection on it is accepted: when tallyd reads a connection's first
 *     message, every earlier connection's close on its descriptor has been reported. Its accept
 *     need not have been: libzmq reports it (stream_listener_base_t::create_engine) after
 *     handing the connection to an I/O thread, which may read its messages, and even see it
 *     close, first (with 2 I/O threads on a loaded 2-core box, about one connection in 3,000).
 *     So a record, made when tallyd reads a connection's first message, after reading the
 *     monitor, is open unless its close has been reported (judged in open_now below), and the
 *     descriptor's next disconnection is its close.
 * An address is free for reuse once a connection's last message is freed, so a record found by
 * key is the message's only when the descriptors match and so do the routing ids (or the
 * message's is one a hand-over gave it, below); otherwise the record is stale and forgotten.
 *
 * A hand-over (ZMQ_ROUTER_HANDOVER; router.cpp, router_t::identify_peer, in libzmq 4.3.4): when a
 * connection arrives with the routing id of one whose pipe still holds messages, the old pipe is
 * given a temporary id (a zero byte and 4 bytes of a counter) and the new connection takes the
 * id. The old pipe's messages, still read (pipe_t keeps delivering until its delimiter), then
 * come under the temporary id with their connection's metadata: the record, made when tallyd read
 * that connection's earlier messages, gives the id back, so their replies go to the new
 * connection (counted: tallyd_requests_rerouted_total) and their shared-memory references
 * resolve as before. A connection handed over before tallyd read any of it has no record: its
 * requests keep the temporary id, and their replies are dropped after the reconnect grace
 * (logged). The Identity property alone cannot give the id back: libzmq returns it as a C
 * string, and an id with a zero byte in it would name another peer.
 *
 * Lost: a connection is counted (tallyd_connections_lost_total) and logged once, when tallyd
 * learns that it closed (the monitor says so, a reply finds it gone, or a request of it is read
 * after it closed) while requests of it are unanswered. Replies handed to ZeroMQ just before
 * cannot be counted: ZeroMQ drops, without a word, what it had not written to a connection that
 * closes (td_zmq.h), and a client that reads its reply and closes at once looks the same from
 * here.
 *
 * Loop thread only.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "td_log.h"
#include "td_zmq_int.h"

/* Closed connections remembered for the requests still to be read from them (a hand-over's). */
#define TD_ZMQ_CLOSED_KEPT 256
/* A routing id as the logs print it: hex, like the request path's peer names (td_peers.c). */
#define TD_ZMQ_NAME_MAX 80

struct td_zmq_conn {
    const char *key;     /* its metadata's "__fd" value: one per connection while it lives */
    int fd;              /* its descriptor, from that value */
    uint64_t read;       /* requests read from it */
    uint64_t answered;   /* of them, replies handed on (sent to ZeroMQ, kept or dropped) */
    unsigned refs;       /* 1 while open or in the closed list, plus its requests unanswered */
    bool in_table;       /* in the hash table */
    bool closed;         /* closed: the monitor said so, or its key or descriptor was taken */
    bool lost;           /* counted and logged */
    bool unroutable;     /* handed over before tallyd read it: its routing id is not known */
    td_zmq_conn_t *next; /* in its hash bucket */
    td_zmq_conn_t *closed_next; /* in the closed list, oldest first */
    char address[48];           /* its Peer-Address, for the log */
    size_t id_len;
    uint8_t id[]; /* the routing id its replies go to */
};

/* ---- The table -------------------------------------------------------------------------- */

static size_t bucket_of(const char *key)
{
    uintptr_t k = (uintptr_t)key;
    k ^= k >> 17;
    k *= UINT64_C(0x9E3779B97F4A7C15);
    return (size_t)(k >> 32) % TD_ZMQ_CONN_BUCKETS;
}

static td_zmq_conn_t *find(const td_zmq_t *z, const char *key)
{
    td_zmq_conn_t *c = z->conns[bucket_of(key)];
    while (c && c->key != key)
        c = c->next;
    return c;
}

static void release(td_zmq_conn_t *c)
{
    if (--c->refs == 0)
        free(c);
}

/* Out of the hash table (not out of the closed list: see evict). */
static void unlink_key(td_zmq_t *z, td_zmq_conn_t *c)
{
    td_zmq_conn_t **link = &z->conns[bucket_of(c->key)];
    while (*link != c)
        link = &(*link)->next;
    *link = c->next;
    c->next = NULL;
}

/* The descriptor's slot, grown as needed; NULL for a descriptor out of range or no memory (the
 * connection is then tracked without the monitor's word on it). */
static td_zmq_fd_t *fd_slot(td_zmq_t *z, int fd)
{
    if (fd < 0 || fd > (1 << 24))
        return NULL;
    if ((size_t)fd >= z->fds_len) {
        size_t len = (size_t)fd + 64;
        td_zmq_fd_t *grown = realloc(z->fds, len * sizeof *grown);
        if (!grown)
            return NULL;
        memset(grown + z->fds_len, 0, (len - z->fds_len) * sizeof *grown);
        z->fds = grown;
        z->fds_len = len;
    }
    return &z->fds[fd];
}

static void name_of(const td_zmq_conn_t *c, char name[TD_ZMQ_NAME_MAX])
{
    size_t at = 0;
    name[0] = '\0';
    for (size_t i = 0; i < c->id_len && at + 3 <= TD_ZMQ_NAME_MAX; i++)
        at += (size_t)snprintf(name + at, TD_ZMQ_NAME_MAX - at, "%02x", c->id[i]);
}

/* ---- Lost connections ------------------------------------------------------------------- */

static void mark_lost(td_zmq_t *z, td_zmq_conn_t *c)
{
    if (c->lost)
        return;
    c->lost = true;
    z->lost_total++;
    char name[TD_ZMQ_NAME_MAX];
    name_of(c, name);
    td_notice("connection %s (%s) closed with requests unanswered: %" PRIu64 " of the %" PRIu64
              " read from it so far (the client closed it, or ZeroMQ did after a frame over "
              "max_frame); their replies are kept %u ms for a connection with its routing id; "
              "replies handed to ZeroMQ just before the close may be lost with it",
              name, c->address, /* a routing id has a byte at least */ c->read - c->answered, c->read,
              TD_REPLY_RECONNECT_GRACE_MS);
}

/* The table's reference, once c is neither in the hash table nor in the closed list. */
static void drop_from_table(td_zmq_t *z, td_zmq_conn_t *c)
{
    if (c->in_table) {
        c->in_table = false;
        unlink_key(z, c);
    }
    release(c);
}

/* c has closed: counted if tallyd still owes it, then remembered a while among the closed ones
 * (for a hand-over's requests still to read); the oldest beyond TD_ZMQ_CLOSED_KEPT is
 * forgotten. */
static void close_conn(td_zmq_t *z, td_zmq_conn_t *c)
{
    if (c->closed)
        return;
    c->closed = true;
    td_zmq_fd_t *slot = c->fd >= 0 && (size_t)c->fd < z->fds_len ? &z->fds[c->fd] : NULL;
    if (slot && slot->conn == c)
        slot->conn = NULL;
    if (c->read > c->answered)
        mark_lost(z, c);
    if (z->closed_tail)
        z->closed_tail->closed_next = c;
    else
        z->closed_head = c;
    z->closed_tail = c;
    if (++z->closed_count <= TD_ZMQ_CLOSED_KEPT)
        return;
    td_zmq_conn_t *old = z->closed_head; /* the list holds c after it: it does not run empty */
    z->closed_head = old->closed_next;
    z->closed_count--;
    drop_from_table(z, old);
}

/* A record whose key a new connection now has: closed (it stays in the closed list, where its
 * reference is, until its turn comes), and out of the hash table. */
static void forget(td_zmq_t *z, td_zmq_conn_t *c)
{
    close_conn(z, c);
    if (c->in_table) {
        c->in_table = false;
        unlink_key(z, c);
    }
}

/* ---- The monitor ------------------------------------------------------------------------ */

static void monitor_event(td_zmq_t *z, uint16_t event, int fd)
{
    td_zmq_fd_t *slot = fd_slot(z, fd);
    if (!slot)
        return;
    if (event == ZMQ_EVENT_ACCEPTED) {
        slot->accepted++;
        return;
    }
    slot->disconnected++;
    if (slot->conn) /* open when tallyd read its first message, after the closes before it */
        close_conn(z, slot->conn);
}

void td_zmq_monitor_read(td_zmq_t *z)
{
    uint16_t event;
    uint32_t value;
    while (z->rt.monitor && td_router_monitor_next(z->rt.monitor, &event, &value)) {
        if (event == ZMQ_EVENT_ACCEPTED || event == ZMQ_EVENT_DISCONNECTED)
            monitor_event(z, event, (int)value);
        else if (z->rt.auth) /* the handshakes CURVE counts */
            td_auth_event(z->rt.auth, event, value);
    }
}

/* ---- Which connection a message came from ----------------------------------------------- */

/* The Identity a renamed message still carries names the record's id: the same bytes up to the
 * first zero byte, where the C string ends. */
static bool names(const td_zmq_conn_t *c, const char *identity)
{
    size_t n = strlen(identity);
    return n <= c->id_len && memcmp(c->id, identity, n) == 0 && (n == c->id_len || !c->id[n]);
}

static bool same_id(const td_zmq_conn_t *c, const uint8_t *id, size_t id_len)
{
    return c->id_len == id_len && memcmp(c->id, id, id_len) == 0;
}

/* Whether the connection on slot's descriptor whose first message tallyd reads now is still open
 * as far as the monitor has said, the closes before it all reported (see the top of the file);
 * its number then is disconnected + 1, and disconnected if it has closed. */
static bool open_now(const td_zmq_fd_t *slot)
{
    if (slot->accepted != slot->disconnected)
        return slot->accepted > slot->disconnected; /* fewer: its close reported before its accept */
    /* Every accept reported is closed: this one's accept is still to come when the last one
     * closed has a record; without one, it is the last one closed (before tallyd read it),
     * which cannot be told from a connection that closed without a message (a TCP probe) just
     * before this one came: taken as closed. */
    return slot->recorded >= slot->disconnected;
}

/* A new record for the connection with metadata key on fd, whose first message tallyd reads
 * now; NULL when out of memory. */
static td_zmq_conn_t *record(td_zmq_t *z, const char *key, int fd, const uint8_t *id, size_t id_len,
                             bool renamed, const zmq_msg_t *meta)
{
    td_zmq_monitor_read(z); /* what closed before it (its accept may come later) */
    td_zmq_conn_t *c = calloc(1, sizeof *c + id_len);
    if (!c)
        return NULL;
    *c = (td_zmq_conn_t){.key = key, .fd = fd, .refs = 1, .in_table = true, .id_len = id_len};
    memcpy(c->id, id, id_len);
    const char *address = zmq_msg_gets(meta, "Peer-Address");
    snprintf(c->address, sizeof c->address, "%s", address ? address : "?");
    size_t b = bucket_of(key);
    c->next = z->conns[b];
    z->conns[b] = c;
    /* A connection a hand-over renamed is taken as closed: a newer one has its routing id. */
    td_zmq_fd_t *slot = renamed ? NULL : fd_slot(z, fd);
    bool open = !renamed && (!slot || open_now(slot));
    if (slot)
        slot->recorded = slot->disconnected + open;
    if (slot && open) {
        if (slot->conn) /* its descriptor is this connection's now */
            close_conn(z, slot->conn);
        slot->conn = c;
    }
    if (!open)
        close_conn(z, c);
    if (renamed) {
        c->unroutable = true;
        td_warn("a connection (%s) was taken over by a reconnect before tallyd read any of it: "
                "the replies to its requests cannot reach the client (its routing id is not "
                "known here) and are dropped after %u ms",
                c->address, TD_REPLY_RECONNECT_GRACE_MS);
    }
    return c;
}

/* The descriptor "__fd" names: its decimal digits (libzmq writes a non-negative int), read here
 * rather than by atoi, whose strtol was a tenth of this function's cost a message. */
static int fd_of(const char *key)
{
    int fd = 0;
    for (; *key >= '0' && *key <= '9' && fd < (1 << 27); key++)
        fd = fd * 10 + (*key - '0');
    return fd;
}

td_zmq_conn_t *td_zmq_conn_of(td_zmq_t *z, const zmq_msg_t *meta, const uint8_t **id,
                              size_t *id_len)
{
    const char *key = zmq_msg_gets(meta, "__fd");
    if (!key)
        return NULL;
    int fd = fd_of(key);
    /* Only a hand-over's temporary id (a zero byte and 4 more) needs the Identity: one lookup
     * less for every other message. */
    const char *identity = *id_len == 5 && !(*id)[0] ? zmq_msg_gets(meta, "Identity") : NULL;
    bool renamed = identity && identity[0];
    td_zmq_conn_t *c = find(z, key);
    if (c && !(c->fd == fd && (same_id(c, *id, *id_len) || (renamed && names(c, identity))))) {
        forget(z, c);
        c = NULL;
    }
    if (!c && !(c = record(z, key, fd, *id, *id_len, renamed, meta)))
        return NULL;
    if (renamed && !c->unroutable) {
        *id = c->id;
        *id_len = c->id_len;
        z->rerouted_total++;
    }
    return c;
}

void td_zmq_conn_read(td_zmq_t *z, td_zmq_conn_t *c)
{
    if (!c)
        return;
    c->read++;
    c->refs++;
    if (c->closed)
        mark_lost(z, c); /* read after it closed: its reply goes to a connection that came back */
}

void td_zmq_conn_answered(td_zmq_conn_t *c)
{
    if (!c)
        return;
    c->answered++;
    release(c);
}

void td_zmq_conn_gone(td_zmq_t *z, td_zmq_conn_t *c, const char *peer_name)
{
    if (c) {
        mark_lost(z, c);
        return;
    }
    z->lost_total++;
    td_notice("connection %s closed with requests unanswered (the client closed it, or ZeroMQ "
              "did after a frame over max_frame); its replies are kept %u ms for it to reconnect",
              peer_name, TD_REPLY_RECONNECT_GRACE_MS);
}

void td_zmq_conns_free(td_zmq_t *z)
{
    td_zmq_conn_t *c;
    while ((c = z->closed_head)) {
        z->closed_head = c->closed_next;
        drop_from_table(z, c);
    }
    for (size_t b = 0; b < TD_ZMQ_CONN_BUCKETS; b++)
        while ((c = z->conns[b]))  /* open ones (closed ones are in the list above) */
            drop_from_table(z, c); /* those with requests unanswered live until their replies */
    z->closed_tail = NULL;
    z->closed_count = 0;
    free(z->fds);
    z->fds = NULL;
    z->fds_len = 0;
}
