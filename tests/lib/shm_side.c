/* SPDX-License-Identifier: Apache-2.0 */
/*
 * shm_side.c — see shm_side.h.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "shm_side.h"

#define FDS_MAX 16

int th_side_connect(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        int err = errno;
        close(fd);
        errno = err;
        return -1;
    }
    return fd;
}

int th_side_send_raw(int side, const void *buf, size_t len, const int *fds, int nfds)
{
    if (nfds < 0 || nfds > FDS_MAX)
        return -1;
    union {
        struct cmsghdr align;
        char space[CMSG_SPACE(FDS_MAX * sizeof(int))];
    } control;
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (nfds) {
        mh.msg_control = control.space;
        mh.msg_controllen = CMSG_SPACE((size_t)nfds * sizeof(int));
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN((size_t)nfds * sizeof(int));
        memcpy(CMSG_DATA(cm), fds, (size_t)nfds * sizeof(int));
    }
    return sendmsg(side, &mh, MSG_NOSIGNAL) == (ssize_t)len ? 0 : -1;
}

int th_side_send(int side, uint8_t op, const char *id, uint64_t handle, int fd)
{
    tally_shm_msg_t m = {.op = op, .handle = handle};
    if (id) {
        m.id_len = (uint8_t)strlen(id);
        memcpy(m.id, id, m.id_len);
    }
    uint8_t buf[TALLY_SHM_MSG_MAX];
    size_t len = tally_shm_msg_encode(&m, buf);
    return th_side_send_raw(side, buf, len, &fd, fd >= 0 ? 1 : 0);
}

int th_side_recv(int side, th_answer_t *ans, int timeout_ms)
{
    memset(ans, 0, sizeof *ans);
    struct pollfd p = {.fd = side, .events = POLLIN};
    if (poll(&p, 1, timeout_ms) <= 0)
        return -1;
    uint8_t buf[TALLY_SHM_ANSWER_SIZE + TALLY_ERROR_MESSAGE_MAX];
    ssize_t n = recv(side, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno == ECONNRESET))
        return 0;
    if (n < TALLY_SHM_ANSWER_SIZE || tally_shm_answer_decode(buf, (size_t)n, &ans->a) != TALLY_OK)
        return -1;
    snprintf(ans->msg, sizeof ans->msg, "%.*s", (int)(n - TALLY_SHM_ANSWER_SIZE),
             (char *)buf + TALLY_SHM_ANSWER_SIZE);
    return 1;
}

int th_side_call(int side, uint8_t op, const char *id, uint64_t handle, int fd, th_answer_t *ans)
{
    th_side_send(side, op, id, handle, fd); /* a refused peer may be closed: its answer waits */
    return th_side_recv(side, ans, 5000) == 1 ? (int)ans->a.status : -1;
}

bool th_side_closed(int side, int timeout_ms)
{
    for (int waited = 0; waited <= timeout_ms; waited += 10) {
        th_answer_t ans;
        int got = th_side_recv(side, &ans, 10);
        if (got == 0)
            return true;
    }
    return false;
}

bool th_side_answer_waiting(int side)
{
    uint8_t byte;
    return recv(side, &byte, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
}

void th_sim_uuid(unsigned gpu, uint8_t uuid[TALLY_GPU_UUID_SIZE])
{
    memset(uuid, 0, TALLY_GPU_UUID_SIZE);
    memcpy(uuid, "tallyd-sim-gpu", 14);
    uuid[15] = (uint8_t)gpu;
}

int th_memfd(size_t size, int seals)
{
    int fd = memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0 || (seals && fcntl(fd, F_ADD_SEALS, seals) != 0))
        abort();
    return fd;
}

int th_fd_count(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
    DIR *dir = opendir(path);
    if (!dir)
        return -1;
    int count = 0;
    for (struct dirent *e; (e = readdir(dir));)
        count += e->d_name[0] != '.';
    closedir(dir);
    return count;
}
