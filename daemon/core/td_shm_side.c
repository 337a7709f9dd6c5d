/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_shm_side.c — the side channel's connections and their messages (PROTOCOL.md §10): accept
 * and admit, register and release, answers, the register deadline. See td_shm.c for the design.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "td_log.h"
#include "td_shm_int.h"

/* ---- the side channel: answers ------------------------------------------------------------ */

/* Sends an answer on fd, with msg (a string, "" for none) after it for an error. False when it
 * could not be sent whole: the peer does not read, or has gone. */
static bool send_answer(int fd, uint8_t op, tally_status_t status, uint64_t handle, uint64_t size,
                        const char *msg)
{
    uint8_t buf[TALLY_SHM_ANSWER_SIZE + TALLY_ERROR_MESSAGE_MAX];
    tally_shm_answer_t a = {.op = op, .status = (uint32_t)status, .handle = handle, .size = size};
    tally_shm_answer_encode(&a, buf);
    size_t len = TALLY_SHM_ANSWER_SIZE;
    if (status != TALLY_OK) {
        size_t n = strnlen(msg, TALLY_ERROR_MESSAGE_MAX);
        memcpy(buf + len, msg, n);
        len += n;
    }
    return send(fd, buf, len, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)len;
}

/* Sends an answer to c, with the message fmt makes for an error (fmt is NULL only for TALLY_OK).
 * False when the peer must be dropped. */
static bool answer(td_shm_conn_t *c, uint8_t op, tally_status_t status, uint64_t handle,
                   uint64_t size, const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static bool answer(td_shm_conn_t *c, uint8_t op, tally_status_t status, uint64_t handle,
                   uint64_t size, const char *fmt, ...)
{
    char msg[TALLY_ERROR_MESSAGE_MAX + 1] = "";
    if (status != TALLY_OK) {
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
    uint8_t buf[TALLY_SHM_MSG_MAX + 1];
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

static bool answer_registered(td_shm_conn_t *c, td_shm_region_t *r)
{
    td_info("shm: pid %d uid %u registered region %016" PRIx64 " (%zu bytes%s%s)", (int)c->cred.pid,
            (unsigned)c->cred.uid, r->handle, r->size, r->writable ? "" : ", read-only",
            r->device_registered ? ", registered with the GPU" : "");
    return answer(c, TALLY_SHM_OP_REGISTER, TALLY_OK, r->handle, r->size, NULL);
}

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
    td_shm_region_ready(r, false);
    td_shm_conn_t *c = r->conn; /* the loop thread's: only it detaches */
    if (c) {
        c->registering = false;
        if (!answer_registered(c, r) || !watch_conn(c))
            td_shm_conn_close(r->shm, c);
    }
    td_shm_region_put(&r);
}

/* Hands the GPU registration to a worker; false when out of memory (then the caller registers it
 * here). The region (added registering, with the worker's reference) holds that reference until
 * register_after. */
static bool start_device_register(td_shm_t *shm, td_shm_conn_t *c, td_shm_region_t *r)
{
    uv_work_t *work = calloc(1, sizeof *work);
    if (!work)
        return false;
    work->data = r;
    /* Fails only without a work callback (libuv's uv_queue_work: UV_EINVAL). */
    (void)uv_queue_work(shm->env.loop, work, register_work, register_after);
    c->registering = true;
    uv_poll_stop(&c->poll); /* one message at a time per connection: answers stay in order */
    return true;
}

/* The quotas of a new region of size bytes on c: false when answered `quota` (fd then closed). */
static bool quota_refused(td_shm_t *shm, td_shm_conn_t *c, uint8_t op, uint64_t size, bool *ok)
{
    const td_config_t *cfg = shm->env.cfg;
    if (c->regions >= cfg->shm_max_regions_per_peer) {
        *ok = answer(c, op, TALLY_E_QUOTA, 0, 0,
                     "this connection already holds its maximum of %u regions",
                     cfg->shm_max_regions_per_peer);
        return true;
    }
    td_shm_lock(shm);
    uint64_t registered = shm->region_bytes;
    td_shm_unlock(shm);
    if (size > cfg->shm_max_bytes || registered > cfg->shm_max_bytes - size) {
        *ok = answer(c, op, TALLY_E_QUOTA, 0, 0,
                     "a region of %" PRIu64 " bytes would exceed shm_max_bytes (%zu; %" PRIu64
                     " registered)",
                     size, cfg->shm_max_bytes, registered);
        return true;
    }
    return false;
}

/* Registers the memfd fd (closed here, before any answer: once a producer has its answer,
 * tallyd holds no descriptor of its message). */
static bool do_register(td_shm_t *shm, td_shm_conn_t *c, const tally_shm_msg_t *m, int fd)
{
    char why[TALLY_ERROR_MESSAGE_MAX + 1];
    bool ok = true;
    if (quota_refused(shm, c, m->op, 0, &ok)) { /* the region count, before mapping */
        close(fd);
        return ok;
    }
    uint8_t *base = NULL;
    size_t size = 0;
    bool writable = false;
    tally_status_t st = td_shm_map_memfd(fd, &base, &size, &writable, why, sizeof why);
    close(fd); /* the mapping keeps the memory */
    if (st != TALLY_OK)
        return answer(c, m->op, st, 0, 0, "%s", why);
    if (quota_refused(shm, c, m->op, size, &ok)) {
        munmap(base, size);
        return ok;
    }
    bool pin = shm->env.region_register != NULL;
    td_shm_region_t *r = td_shm_region_add(shm, c, m, base, size, writable, false, pin);
    if (!r) {
        munmap(base, size);
        return answer(c, m->op, TALLY_E_INTERNAL, 0, 0, "out of memory");
    }
    if (pin) {
        if (start_device_register(shm, c, r))
            return true; /* answered by register_after once the worker is done */
        /* No memory for the worker's request: pin it here rather than not at all. */
        r->device_registered = shm->env.region_register(shm->env.ctx, base, size, !writable);
        td_shm_region_ready(r, false);
        td_shm_region_t *worker = r; /* the worker's reference, that no worker holds */
        td_shm_region_put(&worker);
    }
    return answer_registered(c, r);
}

/* A device region's import on a worker (PROTOCOL.md §10 "Device memory"): what the worker
 * needs from the message, and what it gives back. */
typedef struct {
    uv_work_t work;
    td_shm_region_t *region; /* counted in the quotas, not findable (registering) until done */
    int fd;
    uint8_t uuid[TALLY_GPU_UUID_SIZE];
    const uint8_t *event; /* NULL, or event_bytes */
    uint8_t event_bytes[TALLY_GPU_EVENT_SIZE];
    tally_status_t status;
    char why[TALLY_ERROR_MESSAGE_MAX + 1];
} dev_import_work_t;

/* A worker thread: the import takes about a millisecond on an H200 (issue 23's probe), more on a
 * busy driver, and a driver call may block on the device: never on the loop thread, where it
 * would hold every request of every peer. */
static void dev_import_work(uv_work_t *work)
{
    dev_import_work_t *w = work->data;
    td_shm_region_t *r = w->region;
    td_shm_t *shm = r->shm;
    void *ptr = NULL;
    w->status = shm->env.dev_import(shm->env.ctx, w->uuid, w->fd, r->size, r->writable, w->event,
                                    &r->gpu, &r->import, &ptr, w->why, sizeof w->why);
    if (w->status == TALLY_OK)
        r->base = ptr;
}

/* Loop thread: the import is done. Imported, the region becomes visible and the descriptor
 * belongs to the import (closed at release); refused, the descriptor is closed before the
 * answer and the region leaves the quotas. A connection that closed meanwhile already dropped
 * its reference: this drops the worker's, which releases the import again. */
static void dev_import_after(uv_work_t *work, int status)
{
    (void)status;
    dev_import_work_t *w = work->data;
    td_shm_region_t *r = w->region;
    td_shm_conn_t *c = r->conn; /* the loop thread's: only it detaches */
    td_shm_region_ready(r, w->status != TALLY_OK);
    if (w->status != TALLY_OK) {
        close(w->fd);
        if (c)
            td_shm_region_detach(r); /* the connection's reference; the worker's follows */
    } else if (c) {
        td_info("shm: pid %d uid %u registered device region %016" PRIx64
                " (%zu bytes on GPU %u%s%s)",
                (int)c->cred.pid, (unsigned)c->cred.uid, r->handle, r->size, r->gpu,
                r->writable ? ", read-write" : "", w->event ? ", with an IPC event" : "");
    }
    if (c) {
        c->registering = false;
        bool ok = w->status == TALLY_OK
                      ? answer(c, TALLY_SHM_OP_REGISTER_DEVICE, TALLY_OK, r->handle, r->size, NULL)
                      : answer(c, TALLY_SHM_OP_REGISTER_DEVICE, w->status, 0, 0, "%s", w->why);
        if (!ok || !watch_conn(c))
            td_shm_conn_close(r->shm, c);
    }
    td_shm_region_put(&r);
    free(w);
}

/* Registers a device region (PROTOCOL.md §10 "Device memory"): fd is imported on the GPU with
 * the message's UUID, on a worker (dev_import_work), and then belongs to the import, which
 * closes it at the region's release (the memory lives while tallyd holds it); refused, fd is
 * closed before the answer. The region counts in the quotas from here, so registrations running
 * at once cannot pass them together. */
static bool do_register_device(td_shm_t *shm, td_shm_conn_t *c, const tally_shm_msg_t *m, int fd)
{
    bool ok = true;
    if (!shm->env.dev_import) {
        close(fd);
        return answer(c, m->op, TALLY_E_BAD_REF, 0, 0,
                      "a GPU is needed for device regions (this tallyd runs the CPU backend)");
    }
    if (quota_refused(shm, c, m->op, m->dev_size, &ok)) {
        close(fd);
        return ok;
    }
    dev_import_work_t *w = calloc(1, sizeof *w);
    bool writable = (m->dev_flags & TALLY_SHM_DEV_OUTPUT) != 0;
    td_shm_region_t *r =
        w ? td_shm_region_add(shm, c, m, NULL, (size_t)m->dev_size, writable, true, true) : NULL;
    if (!r) {
        free(w);
        close(fd);
        return answer(c, m->op, TALLY_E_INTERNAL, 0, 0, "out of memory");
    }
    w->work.data = w;
    w->region = r;
    w->fd = fd;
    memcpy(w->uuid, m->gpu_uuid, sizeof w->uuid);
    if (m->dev_flags & TALLY_SHM_DEV_EVENT) {
        memcpy(w->event_bytes, m->event, sizeof w->event_bytes);
        w->event = w->event_bytes;
    }
    /* registering, with the worker's reference until dev_import_after; uv_queue_work fails only
     * without a work callback (UV_EINVAL) */
    (void)uv_queue_work(shm->env.loop, &w->work, dev_import_work, dev_import_after);
    c->registering = true;
    uv_poll_stop(&c->poll); /* one message at a time per connection: answers stay in order */
    return true;
}

static bool do_release(td_shm_t *shm, td_shm_conn_t *c, const tally_shm_msg_t *m)
{
    td_shm_lock(shm);
    td_shm_region_t *r = td_shm_find_region(shm, m->handle);
    bool mine = r && r->conn == c;
    uint64_t size = mine ? r->size : 0;
    if (mine)
        td_shm_region_detach(r);
    td_shm_unlock(shm);
    if (!mine)
        return answer(c, m->op, TALLY_E_BAD_REF, m->handle, 0,
                      "handle %016" PRIx64 " is not a region of this connection", m->handle);
    return answer(c, m->op, TALLY_OK, m->handle, size, NULL);
}

/* ---- the side channel: connections -------------------------------------------------------- */

static void conn_closed_cb(uv_handle_t *handle)
{
    td_shm_conn_t *c = handle->data;
    close(c->fd);
    free(c);
}

void td_shm_conn_close(td_shm_t *shm, td_shm_conn_t *c)
{
    for (td_shm_conn_t **link = &shm->conns; *link; link = &(*link)->next) {
        if (*link == c) {
            *link = c->next;
            break;
        }
    }
    shm->conn_count--;
    td_shm_lock(shm); /* no shard frees a region of the walk meanwhile */
    for (td_shm_region_t *r = shm->regions, *next; r; r = next) {
        next = r->next; /* region_detach may free r */
        if (r->conn == c)
            td_shm_region_detach(r);
    }
    td_shm_unlock(shm);
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
    bool reg = m.op == TALLY_SHM_OP_REGISTER || m.op == TALLY_SHM_OP_REGISTER_DEVICE;
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
    if (m.op == TALLY_SHM_OP_REGISTER_DEVICE)
        return do_register_device(shm, c, &m, fd);
    return do_register(shm, c, &m, fd);
}

static void conn_cb(uv_poll_t *handle, int status, int events)
{
    (void)events;
    td_shm_conn_t *c = handle->data;
    td_shm_t *shm = c->shm;
    for (;;) {
        uint8_t buf[TALLY_SHM_MSG_MAX + 1];
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
            td_shm_conn_close(shm, c);
            return;
        }
        if (!handle_message(shm, c, buf, (size_t)n, fd, nfds)) {
            td_shm_conn_close(shm, c);
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
            td_shm_conn_close(shm, c);
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
        td_shm_conn_close(shm, c);
        return;
    }
    if (!uv_is_active((uv_handle_t *)&shm->register_timer))
        uv_timer_start(&shm->register_timer, register_timer_cb,
                       shm->env.cfg->shm_register_timeout_ms, 0);
    td_debug("shm: side connection from pid %d uid %u gid %u", (int)cred.pid, (unsigned)cred.uid,
             (unsigned)cred.gid);
}

void td_shm_accept_cb(uv_poll_t *handle, int status, int events)
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
