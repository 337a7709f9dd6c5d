/* SPDX-License-Identifier: Apache-2.0 */
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
 * (td_shm_resolve, released in td_request_destroy, on the request's shard: the table is shared
 * by the shards under its lock, td_shm_int.h). Closing the connection or releasing the
 * region drops the first; the last one unregisters it from the GPU and unmaps it. So a producer
 * that dies with requests in flight cannot pull the pages from under the GPU: they stay mapped
 * until those requests have been answered.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "td_log.h"
#include "td_shm_int.h"

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
    return n > 0 ? (size_t)n : 0;
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
    uv_timer_init(shm->env.loop, &shm->register_timer); /* fills in the handle: returns 0 */
    shm->register_timer.data = shm;
    shm->timer_open = true; /* td_shm_close closes it from here on */
    if (!prepare_dir(shm->path, why, cap) || !bind_socket(shm, why, cap))
        return false;
    int rc = uv_poll_init(shm->env.loop, &shm->listen_poll, shm->listen_fd);
    if (rc != 0) {
        snprintf(why, cap, "cannot watch the side channel: %s", uv_strerror(rc));
        return false;
    }
    shm->listen_poll.data = shm;
    shm->listening = true; /* td_shm_close closes the handle from here on */
    rc = uv_poll_start(&shm->listen_poll, UV_READABLE, td_shm_accept_cb);
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
    /* With glibc none of these fails: they fill in memory, and the type is a valid one. */
    pthread_mutexattr_t recursive;
    pthread_mutexattr_init(&recursive);
    pthread_mutexattr_settype(&recursive, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&shm->lock, &recursive);
    pthread_mutexattr_destroy(&recursive);
    /* Always set: the settings fill in the default path (td_settings_load.c). */
    snprintf(shm->path, sizeof shm->path, "%s", cfg->shm_socket);
    char why[512];
    if (!start_listening(shm, why, sizeof why)) {
        bool in_use = shm->in_use;
        td_shm_close(shm); /* the timer at least is open: closed before shm goes */
        uv_run(env->loop, UV_RUN_NOWAIT);
        release_socket(shm);
        pthread_mutex_destroy(&shm->lock);
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
        td_shm_conn_close(shm, shm->conns);
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
        td_shm_region_free(shm, shm->regions);
    release_socket(shm);
    pthread_mutex_destroy(&shm->lock);
    free(shm);
    *self_p = NULL;
}
