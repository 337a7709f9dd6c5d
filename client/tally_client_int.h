/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_client_int.h — a libtally client as the files of the library see it (private; not
 * installed): its struct, a region's, the small helpers they all use, and what one file lends
 * another.
 *
 * One struct, each part reading its own fields: the core (tally.c) makes the client and keeps
 * its connection, the request/reply layer (tally_call.c) sends and receives on its socket or its
 * transport, the shared-memory part (tally_shm.c) keeps the side channel. The helpers are static
 * inline, one definition under the short names every file uses; the functions a file lends
 * another carry the `tally__` prefix and, like every symbol tally.h does not declare, are hidden
 * in the shared library.
 */
#ifndef TALLY_CLIENT_INT_H
#define TALLY_CLIENT_INT_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "tally.h"
#include "tally_internal.h"
#include "tally_transport.h"

/* Bytes of the random ZeroMQ routing id (the daemon binds regions to it). */
#define TALLY_ROUTING_ID_BYTES 16

struct tally_client {
    void *ctx;
    void *sock;
    int timeout_ms;
    uint64_t next_id;
    char error[TALLY_ERROR_MESSAGE_MAX + 1];
    uint8_t routing_id[TALLY_ROUTING_ID_BYTES];
    int side_fd;           /* the shared-memory side channel, -1 until the first region */
    size_t max_batch;      /* the daemon's, from the info side_connect reads; 0 until then */
    tally_bufpool_t *pool; /* tally_send's copies of large payloads (tally_bufpool.c) */
    void *monitor;         /* PAIR receiving sock's connection events */
    bool connected;        /* the last event said: handshake done (not: disconnected) */
    bool reached;          /* ZeroMQ's connection was made once (then a break is waited for) */
    bool retried;          /* a connect attempt failed since the last probe */
    char *endpoint;        /* as connected to: the probe's and the messages' */
    int64_t checked_us;    /* when the monitor was last read */
    tally__transport_t *transport; /* tally__client_new_transport (tally_client_new_nats: a
                                    * fleet over NATS): no ZeroMQ socket, no monitor */
};

struct tally_region {
    tally_client_t *client;
    void *base;
    size_t size;
    uint64_t handle;
    bool device; /* a device region (tally_gpu_register_fd): base is a device address */
    int fd;      /* a routing transport's (the fleet's direct mode): the memfd, kept to register
                  * the region with each member it is used with; -1 otherwise */
};

/* ---- Small helpers ------------------------------------------------------------------------ */

static inline int64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static inline int64_t deadline_after(const tally_client_t *self)
{
    return now_us() + (int64_t)self->timeout_ms * 1000;
}

static inline void set_msg(char *dst, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static inline void set_msg(char *dst, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dst, TALLY_ERROR_MESSAGE_MAX + 1, fmt, ap);
    va_end(ap);
}

static inline tally_status_t fail(tally_client_t *self, tally_status_t status, const char *msg)
{
    snprintf(self->error, sizeof self->error, "%s", msg);
    return status;
}

/* Failures of this side (no answer, no connection, no memory), not the daemon's answers. */
static inline bool is_local_failure(tally_status_t status)
{
    return status == TALLY_E_TIMEOUT || status == TALLY_E_TRANSPORT || status == TALLY_E_NOMEM;
}

/* ---- tally.c: the connection ------------------------------------------------------------- */

/* Reads and discards the rest of a multipart message; returns how many frames it had. */
int tally__drain_frames(void *sock);
/* Waits until the connection is up or the deadline passes; on failure self->error says why. */
tally_status_t tally__wait_connected(tally_client_t *self, int64_t deadline);

/* ---- tally_call.c: requests and replies --------------------------------------------------- */

/* tally_send with the caller's deadline (tally_call_shm sends and waits under one); self is
 * not NULL (each caller has checked it: the deadline is computed from it). */
tally_status_t tally__send_until(tally_client_t *self, const tally_req_t *req, const void *payload,
                                 size_t len, uint64_t *request_id, int64_t deadline);
/* tally_send_zc with the caller's deadline: free_fn(payload, hint) is called once, whatever
 * happens (on failure before this returns). */
tally_status_t tally__send_zc_until(tally_client_t *self, const tally_req_t *req, void *payload,
                                    size_t len, tally_free_fn *free_fn, void *hint,
                                    uint64_t *request_id, int64_t deadline);
/* Receives until the reply to request `id` comes (replies to older requests are skipped). */
tally_status_t tally__wait_reply(tally_client_t *self, uint64_t id, int64_t deadline,
                                 tally_reply_t *reply);

/* ---- tally_shm.c: regions, for a transport that registers them itself ---------------------- */

/* Registers region (its fd) with the tallyd `member` is connected to, over member's side channel
 * (opened with the first); *handle receives that tallyd's handle for it. Fails as
 * tally_region_create, member->error saying why. */
tally_status_t tally__region_register(tally_client_t *member, const tally_region_t *region,
                                      uint64_t *handle);
/* Releases handle on member's tallyd (nothing when member's side channel is closed: tallyd has
 * released what it registered). */
void tally__region_release(tally_client_t *member, uint64_t handle);
/* Whether the regions member registered are gone: its side connection was never opened, or
 * tallyd has closed it (it exited: a restart at the same endpoint knows none of them), which
 * is then closed here too. */
bool tally__side_closed(tally_client_t *member);

/* tally.c lends tally_sub.c: makes sock a CURVE client with keys (NULL or an empty
 * server_public: nothing), before its connect; TALLY_E_ARG for keys that are not 40 characters
 * of Z85. */
tally_status_t tally__set_curve(void *sock, const tally_curve_keys_t *keys);

#endif /* TALLY_CLIENT_INT_H */
