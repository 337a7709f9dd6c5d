/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_shm_int.h — what the three files of the shared-memory side channel share (td_shm.c the life
 * cycle, td_shm_side.c the connections and their messages, td_shm_regions.c the region table);
 * nothing outside them includes it. The design is described at the top of td_shm.c.
 */
#ifndef TD_SHM_INT_H
#define TD_SHM_INT_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "td_shm.h"

#define TD_SHM_FDS_MAX 4      /* descriptors accepted in one message (extras are closed) */
#define TD_SHM_PEER_GROUPS 64 /* supplementary groups looked at */

struct td_shm_region {
    uint64_t handle;
    uint8_t *base; /* the mapping: size bytes */
    size_t size;
    bool writable;          /* mapped PROT_WRITE: may be an output region */
    bool device_registered; /* registered with the GPU engine: the GPU copies it directly */
    bool registering;       /* the GPU registration runs on a worker: not yet usable */
    bool device;            /* a device region: base is a device address on GPU gpu */
    unsigned gpu;
    void *import; /* the engine's import of a device region (holds its descriptor) */
    unsigned refs;
    struct td_shm_conn *conn; /* the side connection that registered it; NULL once detached */
    struct td_shm_region *next;
    td_shm_t *shm;
    uint8_t id_len; /* the ZeroMQ routing id allowed to reference it */
    uint8_t id[TALLY_SHM_ROUTING_ID_MAX];
};

typedef struct td_shm_conn {
    td_shm_t *shm;
    int fd;
    uv_poll_t poll;
    struct ucred cred;
    bool registering; /* a registration runs on a worker: reading paused, answers stay in order */
    bool registered;  /* has registered a region: the register timeout no longer applies */
    uint64_t accepted_ms; /* uv_now at accept */
    unsigned regions;     /* attached to this connection */
    struct td_shm_conn *next;
} td_shm_conn_t;

struct td_shm {
    td_shm_env_t env;
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    int listen_fd;
    int lock_fd; /* flock on PATH.lock: one tallyd per path */
    bool in_use; /* start-up: another tallyd serves the path */
    uv_poll_t listen_poll;
    bool listening;
    uv_timer_t register_timer;  /* closes connections that registered nothing in time */
    bool timer_open;            /* register_timer initialised: td_shm_close closes it */
    bool refused_any;           /* refusals at accept: one was logged */
    uint64_t refused_logged_ms; /* when the last one was */
    unsigned refused_unlogged;  /* refusals since, not logged */
    td_shm_conn_t *conns;
    unsigned conn_count;
    /* The region table is shared by the shards (issue 31): they resolve references and drop
     * them on their threads. Under this lock (recursive: a detach inside a walk of the table):
     * the list, the counts below, every region's refs, registering and conn. A region's other
     * fields are set before it is findable (registering keeps it out of reach until then). */
    pthread_mutex_t lock;
    td_shm_region_t *regions; /* attached and detached-but-referenced */
    unsigned region_count;
    uint64_t region_bytes;
    unsigned device_count; /* of them device regions, and their bytes */
    uint64_t device_bytes;
};

/* ---- td_shm_regions.c --------------------------------------------------------------------- */

/* Frees a region whose last reference is gone (unregisters it from the GPU, unmaps it); lock
 * held. */
void td_shm_region_free(td_shm_t *shm, td_shm_region_t *region);
/* The connection lets go of a region: new requests can no longer find it. */
void td_shm_region_detach(td_shm_region_t *region);
/* An attached, usable region by handle, or NULL; lock held. */
td_shm_region_t *td_shm_find_region(td_shm_t *shm, uint64_t handle);
/* Adds a region registered by c for the routing id of m (one reference, c's; two while
 * `registering`, the worker's too), counted in the quotas from now on; NULL when out of memory.
 * A device region's handle has TALLY_SHM_DEVICE_HANDLE_BIT set, a host region's never. */
td_shm_region_t *td_shm_region_add(td_shm_t *shm, td_shm_conn_t *c, const tally_shm_msg_t *m,
                                   uint8_t *base, size_t size, bool writable, bool device,
                                   bool registering);
/* A registration on a worker is over: the region can be found (failed: import NULL first). */
void td_shm_region_ready(td_shm_region_t *region, bool failed);
void td_shm_lock(td_shm_t *shm);
void td_shm_unlock(td_shm_t *shm);
/* Checks the descriptor and maps it. TALLY_OK with *base, *size and *writable set. */
tally_status_t td_shm_map_memfd(int fd, uint8_t **base, size_t *size, bool *writable, char *why,
                                size_t cap);

/* ---- td_shm_side.c ------------------------------------------------------------------------ */

/* The listening socket is readable: accepts (and admits or refuses) until EAGAIN. */
void td_shm_accept_cb(uv_poll_t *handle, int status, int events);
/* Closes a side connection and releases its regions. */
void td_shm_conn_close(td_shm_t *shm, td_shm_conn_t *c);

#endif
