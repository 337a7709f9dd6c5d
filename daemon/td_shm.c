/*
 * td_shm.c — the shared-memory side channel and region table (see td_shm.h, PROTOCOL.md §10).
 *
 * Design
 * ------
 * ZeroMQ cannot carry file descriptors, so a producer on the same host hands tallyd its memfd
 * over a Unix-domain SOCK_SEQPACKET socket (one record per message, so no framing of our own),
 * with SCM_RIGHTS. The socket is served on the loop thread like everything else: a uv_poll on
 * the listening fd (accept until EAGAIN) and one on each connection (recvmsg until EAGAIN).
 * libuv's pipe handles are not used: their handle passing only understands libuv's own stream
 * types, not an arbitrary memfd. Every call is non-blocking, and the messages are small and
 * bounded, so a slow or hostile peer cannot stall the loop: a peer that does not read its answers
 * (the send would block) is disconnected.
 *
 * Who may register: the connection's SO_PEERCRED (the kernel's record of the peer, not a claim
 * of the peer) must show tallyd's own uid, a uid of shm_allow_uids, or a primary or (through
 * SO_PEERGROUPS) supplementary gid of shm_allow_gids; the socket's mode (0660, group
 * --shm-socket-group when set) is the first gate, this is the second. It is checked at accept,
 * before the connection takes one of the TD_SHM_CONNECTIONS_MAX slots: a peer that may not
 * register gets one answer saying why and is closed at once, so no number of such connections
 * can keep an allowed producer out (issue 21). An allowed uid holds at most
 * shm_max_conns_per_uid connections, and a connection that has registered nothing within
 * shm_register_timeout_ms is closed (one timer for all of them), so idle connections cannot
 * hold the slots either.
 *
 * Closing: a connection refused at accept, or closed after a malformed message, first stops
 * reading (shutdown SHUT_RD: the peer's further sends fail with EPIPE) and drains what it had
 * queued, closing the descriptors in it; a Unix socket closed with unread messages would reset
 * the peer (ECONNRESET) before it could read the answer that says why.
 *
 * What may be registered: only a memfd sealed with F_SEAL_SHRINK | F_SEAL_GROW. The seals are
 * what make the mapping safe to read: a file that the producer could truncate would turn
 * tallyd's reads into SIGBUS. F_GET_SEALS fails for anything that is not a memfd (or another
 * shmem file), and an ordinary tmpfs file reports only F_SEAL_SEAL, so both are refused. The
 * region is mapped MAP_SHARED read-write (read-only when the memfd is write-sealed or opened
 * read-only: it can then only be an input), the descriptor is closed, and the region is
 * registered once with the GPU engine (cudaHostRegister: per-request registration measured
 * 10 GB/s against 53 for a region registered once, README).
 *
 * Handles are 64 random bits (getrandom), so they cannot be guessed, and each region is bound to
 * the ZeroMQ routing id its producer named when registering it: a request referencing it from
 * any other peer gets bad_ref. Quotas: regions per side connection and registered bytes in
 * total (pinned memory is a host resource) answer `quota`.
 *
 * Lifetime: a region holds one reference for its connection and one per request using it
 * (td_shm_resolve, released in td_request_destroy). Closing the connection or releasing the
 * region drops the first; the last one unregisters it from the GPU and unmaps it. So a producer
 * that dies with requests in flight cannot pull the pages from under the GPU: they stay mapped
 * until those requests have been answered.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "td_log.h"
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
    td_shm_region_t *regions; /* attached and detached-but-referenced */
    unsigned region_count;
    uint64_t region_bytes;
};

/* ---- regions ------------------------------------------------------------------------------ */

static void region_free(td_shm_t *shm, td_shm_region_t *region)
{
    for (td_shm_region_t **link = &shm->regions; *link; link = &(*link)->next) {
        if (*link == region) {
            *link = region->next;
            break;
        }
    }
    shm->region_count--;
    shm->region_bytes -= region->size;
    if (region->device_registered && shm->env.region_unregister)
        shm->env.region_unregister(shm->env.ctx, region->base);
    munmap(region->base, region->size);
    td_debug("shm: region %016" PRIx64 " unmapped (%zu bytes)", region->handle, region->size);
    free(region);
}

bool td_shm_region_direct(const td_shm_region_t *region)
{
    return region && region->device_registered;
}

void td_shm_region_put(td_shm_region_t **region_p)
{
    td_shm_region_t *region = *region_p;
    if (!region)
        return;
    *region_p = NULL;
    if (--region->refs == 0)
        region_free(region->shm, region);
}

/* The connection lets go of a region: new requests can no longer find it. */
static void region_detach(td_shm_region_t *region)
{
    if (region->conn)
        region->conn->regions--;
    region->conn = NULL;
    td_shm_region_put(&region);
}

static td_shm_region_t *find_region(td_shm_t *shm, uint64_t handle)
{
    for (td_shm_region_t *r = shm->regions; r; r = r->next)
        if (r->handle == handle && r->conn && !r->registering)
            return r;
    return NULL;
}

static uint64_t new_handle(td_shm_t *shm)
{
    for (;;) {
        uint64_t h = 0;
        if (getrandom(&h, sizeof h, 0) != (ssize_t)sizeof h)
            h = ((uint64_t)rand() << 32) ^ (uint64_t)rand() ^ (uint64_t)uv_hrtime();
        if (h != 0 && !find_region(shm, h))
            return h;
    }
}

tally_status_t td_shm_resolve(td_shm_t *shm, const uint8_t *id, size_t id_len, uint64_t handle,
                              uint64_t offset, uint64_t length, bool output,
                              td_shm_region_t **region, uint8_t **ptr, char *msg, size_t msg_cap)
{
    const char *what = output ? "output" : "input";
    *region = NULL;
    *ptr = NULL;
    if (!shm) {
        snprintf(msg, msg_cap, "shared memory is off in this tallyd");
        return TALLY_E_BAD_REF;
    }
    td_shm_region_t *r = find_region(shm, handle);
    if (!r || r->id_len != id_len || memcmp(r->id, id, id_len) != 0) {
        snprintf(msg, msg_cap, "%s handle %016" PRIx64 " is not a region registered by this peer",
                 what, handle);
        return TALLY_E_BAD_REF;
    }
    if (offset > r->size || length > r->size - offset) { /* no overflow: offset <= size first */
        snprintf(msg, msg_cap,
                 "%s range [%" PRIu64 ", +%" PRIu64 ") is outside the region of %zu bytes", what,
                 offset, length, r->size);
        return TALLY_E_BAD_REF;
    }
    if (output && !r->writable) {
        snprintf(msg, msg_cap, "output region %016" PRIx64 " is read-only (write-sealed memfd)",
                 handle);
        return TALLY_E_BAD_REF;
    }
    r->refs++;
    *region = r;
    *ptr = r->base + offset;
    return TALLY_OK;
}

void td_shm_gauges(const td_shm_t *shm, unsigned *regions, uint64_t *bytes)
{
    *regions = shm ? shm->region_count : 0;
    *bytes = shm ? shm->region_bytes : 0;
}

const char *td_shm_path(const td_shm_t *shm)
{
    return shm ? shm->path : NULL;
}

size_t td_shm_info(const td_config_t *cfg, char *buf, size_t cap)
{
    int n = snprintf(buf, cap,
                     "shm_max_regions_per_peer=%u\nshm_max_bytes=%zu\n"
                     "shm_max_connections_per_uid=%u\nshm_register_timeout_ms=%u\n",
                     cfg->shm_max_regions_per_peer, cfg->shm_max_bytes, cfg->shm_max_conns_per_uid,
                     cfg->shm_register_timeout_ms);
    return n < 0 || cap == 0 ? 0 : (size_t)n < cap ? (size_t)n : cap - 1;
}

/* ---- the side channel: answers ------------------------------------------------------------ */

/* Sends an answer on fd, with msg after it for an error. False when it could not be sent
 * whole: the peer does not read, or has gone. */
static bool send_answer(int fd, uint8_t op, tally_status_t status, uint64_t handle, uint64_t size,
                        const char *msg)
{
    uint8_t buf[TALLY_SHM_ANSWER_SIZE + TALLY_ERROR_MESSAGE_MAX];
    tally_shm_answer_t a = {.op = op, .status = (uint32_t)status, .handle = handle, .size = size};
    tally_shm_answer_encode(&a, buf);
    size_t len = TALLY_SHM_ANSWER_SIZE;
    if (status != TALLY_OK && msg) {
        size_t n = strnlen(msg, TALLY_ERROR_MESSAGE_MAX);
        memcpy(buf + len, msg, n);
        len += n;
    }
    return send(fd, buf, len, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)len;
}

/* Sends an answer to c (with a message for an error). False when the peer must be dropped. */
static bool answer(td_shm_conn_t *c, uint8_t op, tally_status_t status, uint64_t handle,
                   uint64_t size, const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static bool answer(td_shm_conn_t *c, uint8_t op, tally_status_t status, uint64_t handle,
                   uint64_t size, const char *fmt, ...)
{
    char msg[TALLY_ERROR_MESSAGE_MAX + 1] = "";
    if (status != TALLY_OK && fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        td_info("shm: peer pid %d uid %u: %s: %s", (int)c->cred.pid, (unsigned)c->cred.uid,
                tally_status_name(status), msg);
    }
    return send_answer(c->fd, op, status, handle, size, msg);
}

/* The descriptors of a received message: the first in *fd (-1 when none), the others closed.
 * Returns how many there were. */
static unsigned take_fds(struct msghdr *mh, int *fd)
{
    unsigned count = 0;
    *fd = -1;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(mh); cm; cm = CMSG_NXTHDR(mh, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
            continue;
        size_t n = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < n; i++, count++) {
            int each;
            memcpy(&each, CMSG_DATA(cm) + i * sizeof(int), sizeof each);
            if (*fd < 0)
                *fd = each;
            else
                close(each);
        }
    }
    return count;
}

/* One message from fd into buf (cap bytes), its descriptors taken as take_fds does: its length
 * (0 at the end of the connection, -1 with errno), *nfds and *truncated set. */
static ssize_t recv_message(int fd, uint8_t *buf, size_t cap, int *msg_fd, unsigned *nfds,
                            bool *truncated)
{
    union {
        struct cmsghdr align;
        char space[CMSG_SPACE(TD_SHM_FDS_MAX * sizeof(int))];
    } control;
    struct iovec iov = {.iov_base = buf, .iov_len = cap};
    struct msghdr mh = {.msg_iov = &iov,
                        .msg_iovlen = 1,
                        .msg_control = control.space,
                        .msg_controllen = sizeof control.space};
    ssize_t n = recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    *msg_fd = -1;
    *nfds = 0;
    *truncated = false;
    if (n < 0)
        return n;
    /* The kernel closes what did not fit in control (MSG_CTRUNC); the rest are ours. */
    *nfds = take_fds(&mh, msg_fd);
    *truncated = (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0;
    return n;
}

/* Stops reading fd and drops what the peer had queued (closing the descriptors in it), so
 * that closing fd does not reset the peer before it reads its last answer. */
static void stop_reading(int fd)
{
    (void)shutdown(fd, SHUT_RD); /* from here the peer's sends fail (EPIPE) */
    uint8_t buf[TALLY_SHM_MSG_HEADER + TALLY_SHM_ROUTING_ID_MAX + 1];
    int msg_fd;
    unsigned nfds;
    bool truncated;
    while (recv_message(fd, buf, sizeof buf, &msg_fd, &nfds, &truncated) > 0)
        if (msg_fd >= 0)
            close(msg_fd);
}

/* ---- the side channel: register and release ----------------------------------------------- */

static bool id_in(unsigned id, const unsigned *list, unsigned count)
{
    for (unsigned i = 0; i < count; i++)
        if (list[i] == id)
            return true;
    return false;
}

/* Whether the peer of fd (its credentials cred) may register regions. */
static bool peer_allowed(td_shm_t *shm, int fd, const struct ucred *cred)
{
    const td_config_t *cfg = shm->env.cfg;
    if (cred->uid == geteuid() && !cfg->test_shm_deny_own_uid)
        return true;
    if (id_in(cred->uid, cfg->shm_allow_uids, cfg->shm_allow_uid_count) ||
        id_in(cred->gid, cfg->shm_allow_gids, cfg->shm_allow_gid_count))
        return true;
#ifdef SO_PEERGROUPS
    gid_t groups[TD_SHM_PEER_GROUPS];
    socklen_t len = sizeof groups;
    if (cfg->shm_allow_gid_count && getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) == 0) {
        for (size_t i = 0; i < len / sizeof(gid_t); i++)
            if (id_in(groups[i], cfg->shm_allow_gids, cfg->shm_allow_gid_count))
                return true;
    }
#endif
    return false;
}

/* Checks the descriptor and maps it. TALLY_OK with *base, *size and *writable set. */
static tally_status_t map_memfd(int fd, uint8_t **base, size_t *size, bool *writable, char *why,
                                size_t cap)
{
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0) {
        snprintf(why, cap, "the descriptor is not a memfd (F_GET_SEALS: %s)", strerror(errno));
        return TALLY_E_PARAM;
    }
    if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
        snprintf(why, cap, "the memfd is not sealed with F_SEAL_SHRINK | F_SEAL_GROW (seals 0x%x)",
                 (unsigned)seals);
        return TALLY_E_PARAM;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0) {
        snprintf(why, cap, "the memfd is empty or not a regular file");
        return TALLY_E_PARAM;
    }
    *size = (size_t)st.st_size;
    *writable = true;
    void *p = mmap(NULL, *size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) { /* write-sealed, or opened read-only: an input region */
        *writable = false;
        p = mmap(NULL, *size, PROT_READ, MAP_SHARED, fd, 0);
    }
    if (p == MAP_FAILED) {
        snprintf(why, cap, "cannot map %zu bytes: %s", *size, strerror(errno));
        return TALLY_E_INTERNAL;
    }
    *base = p;
    return TALLY_OK;
}

static bool answer_registered(td_shm_conn_t *c, td_shm_region_t *r)
{
    td_info("shm: pid %d uid %u registered region %016" PRIx64 " (%zu bytes%s%s)", (int)c->cred.pid,
            (unsigned)c->cred.uid, r->handle, r->size, r->writable ? "" : ", read-only",
            r->device_registered ? ", registered with the GPU" : "");
    return answer(c, TALLY_SHM_OP_REGISTER, TALLY_OK, r->handle, r->size, NULL);
}

static void conn_close(td_shm_t *shm, td_shm_conn_t *c);
static void conn_cb(uv_poll_t *handle, int status, int events);

/* Reads the connection's messages as they come; false (logged) when libuv cannot, and the
 * caller closes the connection: its producer sees it closed rather than waiting forever. */
static bool watch_conn(td_shm_conn_t *c)
{
    int rc = uv_poll_start(&c->poll, UV_READABLE | UV_DISCONNECT, conn_cb);
    if (rc != 0)
        td_warn("shm: side connection of pid %d closed: cannot watch it: %s", (int)c->cred.pid,
                uv_strerror(rc));
    return rc == 0;
}

/* A worker thread: cudaHostRegister pins every page of the region, which takes milliseconds per
 * hundred MiB (52-55 ms per GiB on the H100 host): never on the loop thread, where it would stall
 * every request of every peer. */
static void register_work(uv_work_t *work)
{
    td_shm_region_t *r = work->data;
    td_shm_t *shm = r->shm;
    r->device_registered = shm->env.region_register(shm->env.ctx, r->base, r->size, !r->writable);
}

/* Loop thread: the registration is done. The region becomes visible to requests and its producer
 * gets the answer, unless the side connection closed meanwhile: conn_close then already dropped
 * the connection's reference, and this drops the worker's (the last), unregistering it again. */
static void register_after(uv_work_t *work, int status)
{
    (void)status;
    td_shm_region_t *r = work->data;
    free(work);
    r->registering = false;
    td_shm_conn_t *c = r->conn;
    if (c) {
        c->registering = false;
        if (!answer_registered(c, r) || !watch_conn(c))
            conn_close(r->shm, c);
    }
    td_shm_region_put(&r);
}

/* Hands the GPU registration to a worker; false when it cannot be queued (then the caller
 * answers at once with the region unregistered: the GPU copies through staging). The region
 * holds one more reference until register_after. */
static bool start_device_register(td_shm_t *shm, td_shm_conn_t *c, td_shm_region_t *r)
{
    uv_work_t *work = calloc(1, sizeof *work);
    if (!work)
        return false;
    work->data = r;
    r->registering = true;
    r->refs++;
    if (uv_queue_work(shm->env.loop, work, register_work, register_after) != 0) {
        r->registering = false;
        r->refs--;
        free(work);
        return false;
    }
    c->registering = true;
    uv_poll_stop(&c->poll); /* one message at a time per connection: answers stay in order */
    return true;
}

/* Registers the memfd fd (closed here, before any answer: once a producer has its answer,
 * tallyd holds no descriptor of its message). */
static bool do_register(td_shm_t *shm, td_shm_conn_t *c, const tally_shm_msg_t *m, int fd)
{
    const td_config_t *cfg = shm->env.cfg;
    char why[TALLY_ERROR_MESSAGE_MAX + 1];
    if (c->regions >= cfg->shm_max_regions_per_peer) {
        close(fd);
        return answer(c, m->op, TALLY_E_QUOTA, 0, 0,
                      "this connection already holds its maximum of %u regions",
                      cfg->shm_max_regions_per_peer);
    }
    uint8_t *base = NULL;
    size_t size = 0;
    bool writable = false;
    tally_status_t st = map_memfd(fd, &base, &size, &writable, why, sizeof why);
    close(fd); /* the mapping keeps the memory */
    if (st != TALLY_OK)
        return answer(c, m->op, st, 0, 0, "%s", why);
    if (size > cfg->shm_max_bytes || shm->region_bytes > cfg->shm_max_bytes - size) {
        munmap(base, size);
        return answer(c, m->op, TALLY_E_QUOTA, 0, 0,
                      "a region of %zu bytes would exceed shm_max_bytes (%zu; %" PRIu64
                      " registered)",
                      size, cfg->shm_max_bytes, shm->region_bytes);
    }
    td_shm_region_t *r = calloc(1, sizeof *r);
    if (!r) {
        munmap(base, size);
        return answer(c, m->op, TALLY_E_INTERNAL, 0, 0, "out of memory");
    }
    *r = (td_shm_region_t){.handle = new_handle(shm),
                           .base = base,
                           .size = size,
                           .writable = writable,
                           .refs = 1,
                           .conn = c,
                           .shm = shm,
                           .id_len = m->id_len};
    memcpy(r->id, m->id, m->id_len);
    r->next = shm->regions;
    shm->regions = r;
    shm->region_count++;
    shm->region_bytes += size; /* counted from now on: the quota covers pending registrations */
    c->regions++;
    c->registered = true; /* the register timeout is over for c */
    if (shm->env.region_register) {
        if (start_device_register(shm, c, r))
            return true; /* answered by register_after once the worker is done */
        /* No worker to be had: pin it here rather than not at all. */
        r->device_registered = shm->env.region_register(shm->env.ctx, base, size, !writable);
    }
    return answer_registered(c, r);
}

static bool do_release(td_shm_t *shm, td_shm_conn_t *c, const tally_shm_msg_t *m)
{
    td_shm_region_t *r = find_region(shm, m->handle);
    if (!r || r->conn != c)
        return answer(c, m->op, TALLY_E_BAD_REF, m->handle, 0,
                      "handle %016" PRIx64 " is not a region of this connection", m->handle);
    uint64_t size = r->size;
    region_detach(r);
    return answer(c, m->op, TALLY_OK, m->handle, size, NULL);
}

/* ---- the side channel: connections -------------------------------------------------------- */

static void conn_closed_cb(uv_handle_t *handle)
{
    td_shm_conn_t *c = handle->data;
    close(c->fd);
    free(c);
}

static void conn_close(td_shm_t *shm, td_shm_conn_t *c)
{
    for (td_shm_conn_t **link = &shm->conns; *link; link = &(*link)->next) {
        if (*link == c) {
            *link = c->next;
            break;
        }
    }
    shm->conn_count--;
    for (td_shm_region_t *r = shm->regions, *next; r; r = next) {
        next = r->next; /* region_detach may free r */
        if (r->conn == c)
            region_detach(r);
    }
    td_debug("shm: side connection of pid %d closed", (int)c->cred.pid);
    stop_reading(c->fd);
    uv_poll_stop(&c->poll);
    uv_close((uv_handle_t *)&c->poll, conn_closed_cb);
}

/* Handles one message with its nfds descriptors (the first is fd, closed before the answer);
 * false when the connection must close. A message that is malformed (it does not decode, or carries
 * the wrong number of descriptors: register one, release none) is answered and closes the
 * connection; a well-formed one that is refused (a descriptor that is not a sealed memfd, a quota,
 * an unknown handle) is answered and the connection stays (PROTOCOL.md §10). */
static bool handle_message(td_shm_t *shm, td_shm_conn_t *c, const uint8_t *buf, size_t len, int fd,
                           unsigned nfds)
{
    char why[TALLY_ERROR_MESSAGE_MAX + 1];
    tally_shm_msg_t m;
    tally_status_t st = tally_shm_msg_decode(buf, len, &m, why, sizeof why);
    bool reg = m.op == TALLY_SHM_OP_REGISTER;
    if (st == TALLY_OK && nfds != (reg ? 1u : 0u)) {
        st = TALLY_E_PARAM;
        snprintf(why, sizeof why, "%s carries %s descriptor (this one carried %u)",
                 reg ? "register" : "release", reg ? "exactly one" : "no", nfds);
    }
    if (st != TALLY_OK || !reg) {
        if (fd >= 0) /* before the answer, as do_register does */
            close(fd);
        if (st == TALLY_OK)
            return do_release(shm, c, &m);
        answer(c, m.op, st, 0, 0, "%s", why);
        return false;
    }
    return do_register(shm, c, &m, fd);
}

static void conn_cb(uv_poll_t *handle, int status, int events)
{
    (void)events;
    td_shm_conn_t *c = handle->data;
    td_shm_t *shm = c->shm;
    for (;;) {
        uint8_t buf[TALLY_SHM_MSG_HEADER + TALLY_SHM_ROUTING_ID_MAX + 1];
        int fd = -1;
        unsigned nfds = 0;
        bool truncated = false;
        ssize_t n = status < 0 ? -1 : recv_message(c->fd, buf, sizeof buf, &fd, &nfds, &truncated);
        if (n < 0 && (errno == EAGAIN || errno == EINTR) && status >= 0)
            return;
        if (n <= 0 || truncated) {
            if (fd >= 0)
                close(fd);
            /* A message too long, or with too many descriptors: malformed. */
            if (n > 0) {
                tally_shm_msg_t m; /* decoded for its op alone */
                char why[TALLY_ERROR_MESSAGE_MAX + 1];
                (void)tally_shm_msg_decode(buf, (size_t)n, &m, why, sizeof why);
                answer(c, m.op, TALLY_E_HEADER, 0, 0, "message or descriptors truncated");
            }
            conn_close(shm, c);
            return;
        }
        if (!handle_message(shm, c, buf, (size_t)n, fd, nfds)) {
            conn_close(shm, c);
            return;
        }
        if (c->registering) /* the rest waits for register_after */
            return;
    }
}

/* Closes every connection that has registered nothing within register_timeout_ms, then waits
 * for the next one's deadline. */
static void register_timer_cb(uv_timer_t *timer)
{
    td_shm_t *shm = timer->data;
    uint64_t now = uv_now(shm->env.loop);
    uint64_t timeout = shm->env.cfg->shm_register_timeout_ms;
    uint64_t next = 0; /* ms to the earliest deadline still ahead; 0 = none */
    for (td_shm_conn_t *c = shm->conns, *later; c; c = later) {
        later = c->next; /* conn_close unlinks c */
        if (c->registered)
            continue;
        uint64_t age = now - c->accepted_ms;
        if (age >= timeout) {
            td_info("shm: side connection of pid %d uid %u closed: no region registered within "
                    "%" PRIu64 " ms (register_timeout_ms)",
                    (int)c->cred.pid, (unsigned)c->cred.uid, timeout);
            conn_close(shm, c);
        } else if (next == 0 || timeout - age < next) {
            next = timeout - age;
        }
    }
    if (next)
        uv_timer_start(timer, register_timer_cb, next, 0);
}

/* Whether a new connection from cred may take a slot: TALLY_OK, or the status that refuses it
 * with why. Checked before the connection costs anything but its descriptor. */
static tally_status_t admit(td_shm_t *shm, int fd, const struct ucred *cred, char *why, size_t cap)
{
    const td_config_t *cfg = shm->env.cfg;
    if (!peer_allowed(shm, fd, cred)) {
        snprintf(why, cap,
                 "uid %u gid %u may not register shared memory (shm_allow_uids, shm_allow_gids)",
                 (unsigned)cred->uid, (unsigned)cred->gid);
        return TALLY_E_PARAM;
    }
    unsigned same_uid = 0;
    for (const td_shm_conn_t *c = shm->conns; c; c = c->next)
        same_uid += c->cred.uid == cred->uid;
    if (same_uid >= cfg->shm_max_conns_per_uid) {
        snprintf(why, cap,
                 "uid %u already holds %u side-channel connections (shm max_connections_per_uid)",
                 (unsigned)cred->uid, same_uid);
        return TALLY_E_QUOTA;
    }
    if (shm->conn_count >= TD_SHM_CONNECTIONS_MAX) {
        snprintf(why, cap, "tallyd already serves its maximum of %d side-channel connections",
                 TD_SHM_CONNECTIONS_MAX);
        return TALLY_E_QUOTA;
    }
    return TALLY_OK;
}

/* Refuses a connection before it takes a slot: one answer (op 0) saying why, then closed.
 * Logged once a second at most, so a flood of refused connections cannot flood the log. */
static void refuse(td_shm_t *shm, int fd, const struct ucred *cred, tally_status_t status,
                   const char *why)
{
    stop_reading(fd);
    uint64_t now = uv_now(shm->env.loop);
    if (!shm->refused_any || now - shm->refused_logged_ms >= 1000) {
        if (shm->refused_unlogged)
            td_info("shm: %u more side connections refused, not logged", shm->refused_unlogged);
        td_info("shm: side connection of pid %d uid %u refused: %s", (int)cred->pid,
                (unsigned)cred->uid, why);
        shm->refused_any = true;
        shm->refused_logged_ms = now;
        shm->refused_unlogged = 0;
    } else {
        shm->refused_unlogged++;
    }
    (void)send_answer(fd, 0, status, 0, 0, why);
    close(fd);
}

/* Takes one accepted connection: refused, or served (a slot, reading, the register timer). */
static void accept_one(td_shm_t *shm, int fd)
{
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
        td_warn("shm: side connection refused: no credentials (%s)", strerror(errno));
        close(fd);
        return;
    }
    char why[TALLY_ERROR_MESSAGE_MAX + 1];
    tally_status_t st = admit(shm, fd, &cred, why, sizeof why);
    if (st != TALLY_OK) {
        refuse(shm, fd, &cred, st, why);
        return;
    }
    td_shm_conn_t *c = calloc(1, sizeof *c);
    if (!c || uv_poll_init(shm->env.loop, &c->poll, fd) != 0) {
        td_warn("shm: side connection refused: out of memory");
        free(c);
        close(fd);
        return;
    }
    c->shm = shm;
    c->fd = fd;
    c->cred = cred;
    c->accepted_ms = uv_now(shm->env.loop);
    c->poll.data = c;
    c->next = shm->conns;
    shm->conns = c;
    shm->conn_count++;
    if (!watch_conn(c)) {
        conn_close(shm, c);
        return;
    }
    if (!uv_is_active((uv_handle_t *)&shm->register_timer))
        uv_timer_start(&shm->register_timer, register_timer_cb,
                       shm->env.cfg->shm_register_timeout_ms, 0);
    td_debug("shm: side connection from pid %d uid %u gid %u", (int)cred.pid, (unsigned)cred.uid,
             (unsigned)cred.gid);
}

static void accept_cb(uv_poll_t *handle, int status, int events)
{
    (void)status;
    (void)events;
    td_shm_t *shm = handle->data;
    for (;;) {
        int fd = accept4(shm->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            return; /* EAGAIN, or a transient error (EMFILE...): the next wake-up retries */
        accept_one(shm, fd);
    }
}

/* ---- life cycle --------------------------------------------------------------------------- */

/* Creates the socket's directory when missing (0711: others may reach a socket whose own mode
 * lets them in); an existing one must be ours or root's, and not writable by others. */
static bool prepare_dir(const char *path, char *why, size_t cap)
{
    char dir[sizeof((td_shm_t *)0)->path];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir)
        return true;
    *slash = '\0';
    if (mkdir(dir, 0711) != 0 && errno != EEXIST) {
        snprintf(why, cap, "cannot create %s: %s", dir, strerror(errno));
        return false;
    }
    struct stat st;
    if (lstat(dir, &st) != 0 || !S_ISDIR(st.st_mode) ||
        (st.st_uid != geteuid() && st.st_uid != 0) ||
        ((st.st_mode & S_IWOTH) && !(st.st_mode & S_ISVTX))) {
        snprintf(why, cap, "%s is not a directory owned by tallyd's user or root", dir);
        return false;
    }
    return true;
}

/* Whether something serves the socket at path: connects to it (without waiting) and hangs up.
 * 1: it answers (a full backlog, EAGAIN, counts as answering); 0: nothing there, or a stale
 * socket file left by a tallyd that died (ECONNREFUSED); -1 with errno: cannot tell. */
static int socket_live(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
    int rc = connect(fd, (struct sockaddr *)&addr, sizeof addr);
    int err = errno;
    close(fd);
    if (rc == 0 || err == EAGAIN)
        return 1;
    if (err == ECONNREFUSED || err == ENOENT)
        return 0;
    errno = err;
    return -1;
}

/* Takes PATH.lock and makes sure no other tallyd serves PATH (shm->in_use and false when one
 * does); false with why. The lock settles two tallyds starting at once; the connection tells a
 * live socket from a stale one even when the lock file was removed under a running tallyd. */
static bool claim_path(td_shm_t *shm, char *why, size_t cap)
{
    char lock[sizeof shm->path + 8];
    snprintf(lock, sizeof lock, "%s.lock", shm->path);
    shm->lock_fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (shm->lock_fd < 0) {
        snprintf(why, cap, "cannot open %s: %s", lock, strerror(errno));
        return false;
    }
    if (flock(shm->lock_fd, LOCK_EX | LOCK_NB) != 0) {
        shm->in_use = errno == EWOULDBLOCK;
        snprintf(why, cap, "%s: it holds the lock %s (%s)", shm->path, lock, strerror(errno));
        return false;
    }
    int live = socket_live(shm->path);
    if (live != 0) {
        shm->in_use = true;
        snprintf(why, cap, "%s: %s%s", shm->path,
                 live > 0 ? "it accepts connections" : "cannot tell, a connection fails: ",
                 live > 0 ? "" : strerror(errno));
        return false;
    }
    unlink(shm->path); /* a stale socket of a tallyd that died: we hold the lock */
    return true;
}

/* Claims the path, binds and listens; false with why. */
static bool bind_socket(td_shm_t *shm, char *why, size_t cap)
{
    if (!claim_path(shm, why, cap))
        return false;
    shm->listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", shm->path);
    if (shm->listen_fd < 0 || bind(shm->listen_fd, (struct sockaddr *)&addr, sizeof addr) != 0 ||
        chmod(shm->path, TD_SHM_SOCKET_MODE) != 0 || listen(shm->listen_fd, 64) != 0) {
        snprintf(why, cap, "cannot listen on %s: %s", shm->path, strerror(errno));
        return false;
    }
    int gid = shm->env.cfg->shm_socket_gid;
    if (gid >= 0 && chown(shm->path, (uid_t)-1, (gid_t)gid) != 0) {
        snprintf(why, cap, "cannot give %s to group %d (is tallyd a member?): %s", shm->path, gid,
                 strerror(errno));
        return false;
    }
    return true;
}

static void release_socket(td_shm_t *shm)
{
    if (shm->listen_fd >= 0) {
        close(shm->listen_fd);
        shm->listen_fd = -1;
        unlink(shm->path);
    }
    if (shm->lock_fd >= 0) {
        close(shm->lock_fd); /* the lock file stays: unlinking it would race a starting tallyd */
        shm->lock_fd = -1;
    }
}

/* The register timer, the listening socket and its uv_poll, started; false with why. */
static bool start_listening(td_shm_t *shm, char *why, size_t cap)
{
    int rc = uv_timer_init(shm->env.loop, &shm->register_timer);
    if (rc != 0) {
        snprintf(why, cap, "cannot create a timer: %s", uv_strerror(rc));
        return false;
    }
    shm->register_timer.data = shm;
    shm->timer_open = true; /* td_shm_close closes it from here on */
    if (!prepare_dir(shm->path, why, cap) || !bind_socket(shm, why, cap))
        return false;
    rc = uv_poll_init(shm->env.loop, &shm->listen_poll, shm->listen_fd);
    if (rc != 0) {
        snprintf(why, cap, "cannot watch the side channel: %s", uv_strerror(rc));
        return false;
    }
    shm->listen_poll.data = shm;
    shm->listening = true; /* td_shm_close closes the handle from here on */
    rc = uv_poll_start(&shm->listen_poll, UV_READABLE, accept_cb);
    if (rc != 0) {
        snprintf(why, cap, "cannot watch the side channel: %s", uv_strerror(rc));
        return false;
    }
    return true;
}

td_err_t td_shm_new(const td_shm_env_t *env, td_shm_t **out)
{
    const td_config_t *cfg = env->cfg;
    *out = NULL;
    if (!cfg->shm)
        return TD_OK;
    td_shm_t *shm = calloc(1, sizeof *shm);
    if (!shm)
        return TD_ERR_NOMEM;
    shm->env = *env;
    shm->listen_fd = shm->lock_fd = -1;
    if (cfg->shm_socket)
        snprintf(shm->path, sizeof shm->path, "%s", cfg->shm_socket);
    else
        td_config_default_shm_socket(shm->path, sizeof shm->path);
    char why[512];
    if (!start_listening(shm, why, sizeof why)) {
        bool in_use = shm->in_use;
        if (shm->listening || shm->timer_open) { /* handles must be closed before shm goes */
            td_shm_close(shm);
            uv_run(env->loop, UV_RUN_NOWAIT);
        }
        release_socket(shm);
        free(shm);
        /* Another tallyd's side channel is never taken over, nor silently done without: the
         * operator asked for two daemons on one path. Other failures of the default path
         * (no runtime directory to be had) leave shared memory off. */
        if (in_use) {
            td_err("shm: another tallyd serves the side channel %s; stop it, or give this "
                   "tallyd another path ([shm] socket, --shm-socket) or turn shared memory off "
                   "(--shm off)",
                   why);
            return TD_ERR_BIND;
        }
        if (cfg->shm_socket_explicit) {
            td_err("shm: %s", why);
            return TD_ERR_BIND;
        }
        td_warn("shm: %s; shared memory is off (set [shm] socket to another path)", why);
        return TD_OK;
    }
    td_info("shm: side channel on %s (regions up to %zu bytes in total, %u per peer)", shm->path,
            cfg->shm_max_bytes, cfg->shm_max_regions_per_peer);
    *out = shm;
    return TD_OK;
}

void td_shm_close(td_shm_t *shm)
{
    if (!shm)
        return;
    while (shm->conns)
        conn_close(shm, shm->conns);
    if (shm->timer_open) {
        uv_timer_stop(&shm->register_timer);
        uv_close((uv_handle_t *)&shm->register_timer, NULL);
        shm->timer_open = false;
    }
    if (shm->listening) {
        uv_poll_stop(&shm->listen_poll);
        uv_close((uv_handle_t *)&shm->listen_poll, NULL);
        shm->listening = false;
    }
    release_socket(shm);
}

void td_shm_destroy(td_shm_t **self_p)
{
    td_shm_t *shm = *self_p;
    if (!shm)
        return;
    if (shm->regions)
        td_warn("shm: %u regions still referenced at exit", shm->region_count);
    while (shm->regions)
        region_free(shm, shm->regions);
    release_socket(shm);
    free(shm);
    *self_p = NULL;
}
