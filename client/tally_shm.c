/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_shm.c — shared memory (PROTOCOL.md §10): the side channel to tallyd, regions of host
 * memory, device regions (tally_gpu_register_fd; tally_gpu.c allocates exportable GPU memory and
 * registers it through here), and the requests that reference them (tally_send_shm,
 * tally_call_shm, whose hist over the daemon's max_batch goes in pieces).
 *
 * Shared memory. A region is a memfd sealed against shrinking and growing (the daemon refuses
 * anything else, so it can never be truncated under the daemon's reads), mapped here and passed
 * to the daemon with SCM_RIGHTS over its side channel, one SOCK_SEQPACKET connection per client
 * opened with the first region. The daemon binds each region to the ZeroMQ routing id of the
 * client that registered it, so every client sets a random routing id on its DEALER socket.
 */
#include "tally.h"
#include "tally_client_int.h"

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

/* ---- Shared memory ------------------------------------------------------------------------ */

/* Opens the side channel named by the daemon's `info` (once per client). */
static tally_status_t side_connect(tally_client_t *self)
{
    if (self->transport) { /* NATS: tallyd is on another host */
        set_msg(self->error, "shared memory is not available over %s", self->transport->ops->name);
        return TALLY_E_ARG;
    }
    if (self->side_fd >= 0)
        return TALLY_OK;
    tally_info_t *info = NULL;
    tally_status_t status = tally_info_fetch(self, &info);
    if (status != TALLY_OK)
        return status;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    const char *on = tally_info_lookup(info, "shm");
    const char *path = tally_info_lookup(info, "shm_socket");
    uint64_t max_batch = 0;
    (void)tally_info_u64(info, "max_batch", &max_batch); /* 0: the daemon did not say */
    self->max_batch = (size_t)max_batch;
    bool offered = on && strcmp(on, "on") == 0 && path && path[0];
    bool fits = offered && strlen(path) < sizeof addr.sun_path;
    if (fits)
        memcpy(addr.sun_path, path, strlen(path) + 1);
    tally_info_destroy(&info);
    if (!offered)
        return fail(self, TALLY_E_ARG, "the daemon offers no shared memory (info: shm=off)");
    if (!fits)
        return fail(self, TALLY_E_REPLY, "the daemon's shm_socket path is too long for a socket");
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        char msg[TALLY_ERROR_MESSAGE_MAX + 1];
        set_msg(msg, "cannot connect to the shared-memory side channel %s: %s", addr.sun_path,
                strerror(errno));
        if (fd >= 0)
            close(fd);
        return fail(self, TALLY_E_IO, msg);
    }
    self->side_fd = fd;
    return TALLY_OK;
}

void tally__side_send(int sock, const tally_shm_msg_t *m, int fd)
{
    uint8_t buf[TALLY_SHM_MSG_MAX];
    struct iovec iov = {.iov_base = buf, .iov_len = tally_shm_msg_encode(m, buf)};
    union {
        struct cmsghdr align;
        char space[CMSG_SPACE(sizeof(int))];
    } control;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (fd >= 0) {
        mh.msg_control = control.space;
        mh.msg_controllen = sizeof control.space;
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof fd);
    }
    /* A refused peer may be disconnected before its send: its answer is still readable. */
    (void)sendmsg(sock, &mh, MSG_NOSIGNAL);
}

/* One message on the side connection and its answer (n bytes in buf): 1, 0 when the connection
 * had been closed by tallyd (no answer), -1 on a timeout, -2 on another error. */
static int side_exchange(tally_client_t *self, const tally_shm_msg_t *m, int fd, uint8_t *buf,
                         size_t cap, ssize_t *n)
{
    tally__side_send(self->side_fd, m, fd);
    struct pollfd p = {.fd = self->side_fd, .events = POLLIN};
    int rc = poll(&p, 1, self->timeout_ms);
    *n = rc > 0 ? recv(self->side_fd, buf, cap, MSG_DONTWAIT) : -1;
    if (*n == 0 || (*n < 0 && rc > 0 && (errno == ECONNRESET || errno == EPIPE)))
        return 0;
    return *n > 0 ? 1 : rc == 0 ? -1 : -2;
}

static void side_disconnect(tally_client_t *self)
{
    if (self->side_fd >= 0)
        close(self->side_fd);
    self->side_fd = -1;
}

/* Sends one side-channel message (with `fd` attached when >= 0) and waits for its answer. A
 * register on a connection tallyd has closed (one that registered nothing within its
 * register_timeout_ms) was not applied: it is sent again once on a new connection. After an
 * answer with op 0 (a refusal of the connection itself) tallyd has closed it: the next message
 * opens a new one (PROTOCOL.md §10). */
static tally_status_t side_call(tally_client_t *self, const tally_shm_msg_t *m, int fd,
                                tally_shm_answer_t *answer)
{
    uint8_t buf[TALLY_SHM_ANSWER_SIZE + TALLY_ERROR_MESSAGE_MAX];
    ssize_t n = -1;
    int got = side_exchange(self, m, fd, buf, sizeof buf, &n);
    if (got == 0 && m->op != TALLY_SHM_OP_RELEASE) { /* op 1 or 3 */
        side_disconnect(self);
        tally_status_t status = side_connect(self);
        if (status != TALLY_OK)
            return status;
        got = side_exchange(self, m, fd, buf, sizeof buf, &n);
    }
    if (got != 1 || tally_shm_answer_decode(buf, (size_t)n, answer) != TALLY_OK) {
        side_disconnect(self);
        return fail(self, got == -1 ? TALLY_E_TIMEOUT : TALLY_E_TRANSPORT,
                    "no answer from the shared-memory side channel");
    }
    if (answer->op == 0)
        side_disconnect(self);
    if (answer->status != TALLY_OK) {
        char msg[TALLY_ERROR_MESSAGE_MAX + 1];
        size_t mlen = (size_t)n - TALLY_SHM_ANSWER_SIZE;
        set_msg(msg, "%.*s", (int)(mlen > TALLY_ERROR_MESSAGE_MAX ? TALLY_ERROR_MESSAGE_MAX : mlen),
                (char *)buf + TALLY_SHM_ANSWER_SIZE);
        return fail(self, (tally_status_t)answer->status, msg);
    }
    return TALLY_OK;
}

/* A zero-filled memfd of `size` bytes, sealed so that it can neither shrink nor grow. */
static int sealed_memfd(size_t size)
{
    int fd = memfd_create("tally-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return -1;
    if (ftruncate(fd, (off_t)size) != 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

tally_status_t tally__region_register(tally_client_t *member, const tally_region_t *region,
                                      uint64_t *handle)
{
    tally_status_t status = side_connect(member);
    if (status != TALLY_OK)
        return status;
    tally_shm_msg_t m = {.op = TALLY_SHM_OP_REGISTER, .id_len = TALLY_ROUTING_ID_BYTES};
    memcpy(m.id, member->routing_id, TALLY_ROUTING_ID_BYTES);
    tally_shm_answer_t answer;
    status = side_call(member, &m, region->fd, &answer);
    if (status == TALLY_OK)
        *handle = answer.handle;
    return status;
}

bool tally__side_closed(tally_client_t *member)
{
    struct pollfd p = {.fd = member->side_fd, .events = POLLIN};
    if (member->side_fd >= 0 && poll(&p, 1, 0) == 0)
        return false; /* tallyd answers, never speaks first: anything to read is its end */
    side_disconnect(member);
    return true;
}

void tally__region_release(tally_client_t *member, uint64_t handle)
{
    if (tally__side_closed(member))
        return;
    tally_shm_msg_t m = {.op = TALLY_SHM_OP_RELEASE, .handle = handle};
    tally_shm_answer_t answer;
    (void)side_call(member, &m, -1, &answer);
}

/* A transport that sends shared-memory requests itself (the fleet's direct mode), or NULL. */
static const tally__transport_ops_t *shm_transport(const tally_client_t *client)
{
    return client->transport && client->transport->ops->send_shm ? client->transport->ops : NULL;
}

tally_status_t tally_region_create(tally_client_t *client, size_t size, tally_region_t **out)
{
    if (!client || !out || size == 0)
        return TALLY_E_ARG;
    *out = NULL;
    /* Through a transport that routes, the region is registered with each tallyd it is used
     * with, when first used: the memfd stays open for that. */
    bool lazy = shm_transport(client) != NULL;
    tally_status_t status = lazy ? TALLY_OK : side_connect(client);
    if (status != TALLY_OK)
        return status;
    tally_region_t *region = calloc(1, sizeof *region);
    int fd = sealed_memfd(size);
    void *base = fd >= 0 ? mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (!region || base == MAP_FAILED) {
        status = fail(client, region ? TALLY_E_IO : TALLY_E_NOMEM, "cannot create a memfd region");
        goto fail;
    }
    *region = (tally_region_t){.client = client, .base = base, .size = size, .fd = fd};
    if (!lazy) {
        status = tally__region_register(client, region, &region->handle);
        if (status != TALLY_OK)
            goto fail;
        close(fd);
        region->fd = -1;
    }
    *out = region;
    return TALLY_OK;
fail:
    if (base != MAP_FAILED)
        munmap(base, size);
    if (fd >= 0)
        close(fd);
    free(region);
    return status;
}

void *tally_region_data(const tally_region_t *region)
{
    return region ? region->base : NULL;
}

size_t tally_region_size(const tally_region_t *region)
{
    return region ? region->size : 0;
}

void tally_region_destroy(tally_region_t **region_p)
{
    if (!region_p || !*region_p)
        return;
    tally_region_t *region = *region_p;
    tally_client_t *client = region->client;
    const tally__transport_ops_t *routed = shm_transport(client);
    if (routed)
        routed->region_release(client->transport, region);
    else
        tally__region_release(client, region->handle);
    if (region->fd >= 0)
        close(region->fd);
    if (!region->device) /* device memory is its allocator's (tally_gpu_free) */
        munmap(region->base, region->size);
    free(region);
    *region_p = NULL;
}

tally_status_t tally_gpu_register_fd(tally_client_t *client, int fd, size_t size,
                                     const uint8_t uuid[16], unsigned flags, const void *ipc_event,
                                     void *device_ptr, tally_region_t **out)
{
    if (!client || !out || fd < 0 || size == 0 || !uuid ||
        (flags & ~(unsigned)(TALLY_GPU_OUTPUT | TALLY_GPU_EVENT)) ||
        (!ipc_event != !(flags & TALLY_GPU_EVENT)))
        return TALLY_E_ARG;
    *out = NULL;
    tally_status_t status = side_connect(client);
    if (status != TALLY_OK)
        return status;
    tally_region_t *region = calloc(1, sizeof *region);
    if (!region)
        return fail(client, TALLY_E_NOMEM, "out of memory");
    tally_shm_msg_t m = {.op = TALLY_SHM_OP_REGISTER_DEVICE,
                         .id_len = TALLY_ROUTING_ID_BYTES,
                         .dev_size = size,
                         .dev_flags = flags};
    memcpy(m.id, client->routing_id, TALLY_ROUTING_ID_BYTES);
    memcpy(m.gpu_uuid, uuid, TALLY_GPU_UUID_SIZE);
    if (ipc_event)
        memcpy(m.event, ipc_event, TALLY_GPU_EVENT_SIZE);
    tally_shm_answer_t answer;
    status = side_call(client, &m, fd, &answer);
    if (status != TALLY_OK) {
        free(region);
        return status;
    }
    *region = (tally_region_t){.client = client,
                               .base = device_ptr,
                               .size = size,
                               .handle = answer.handle,
                               .device = true,
                               .fd = -1};
    *out = region;
    return TALLY_OK;
}

/* Encodes the reference of a shared-memory request into ref_bytes. */
static tally_status_t shm_ref(tally_client_t *self, const tally_req_t *req,
                              const tally_region_t *in, size_t offset, size_t length,
                              const tally_region_t *out, size_t out_offset,
                              uint8_t ref_bytes[TALLY_SHM_REF_SIZE])
{
    if (!self)
        return TALLY_E_ARG;
    if (!req || !in || offset > in->size || length > in->size - offset ||
        (out && out_offset > out->size))
        return fail(self, TALLY_E_ARG, "the range is not inside the region");
    tally_shm_ref_t ref = {.in_handle = in->handle, .in_offset = offset, .in_length = length};
    if (out) {
        ref.out_handle = out->handle;
        ref.out_offset = out_offset;
        ref.out_length = out->size - out_offset;
    }
    tally_shm_ref_encode(&ref, ref_bytes);
    return TALLY_OK;
}

/* Sends the request naming ref (its regions in, out) under deadline: over the client's socket,
 * or through its transport when that registers regions itself (refused over any other). */
static tally_status_t send_ref(tally_client_t *self, const tally_req_t *req,
                               const uint8_t ref[TALLY_SHM_REF_SIZE], const tally_region_t *in,
                               const tally_region_t *out, uint64_t *request_id, int64_t deadline)
{
    tally_req_t wire = *req;
    wire.flags |= TALLY_FLAG_SHM_REF;
    if (!self->transport)
        return tally__send_until(self, &wire, ref, TALLY_SHM_REF_SIZE, request_id, deadline);
    const tally__transport_ops_t *routed = shm_transport(self);
    if (!routed) {
        set_msg(self->error, "shared memory is not available over %s", self->transport->ops->name);
        return TALLY_E_ARG;
    }
    return routed->send_shm(self->transport, &wire, ref, in, out, request_id, self->error,
                            sizeof self->error);
}

tally_status_t tally_send_shm(tally_client_t *self, const tally_req_t *req,
                              const tally_region_t *in, size_t offset, size_t length,
                              const tally_region_t *out, size_t out_offset, uint64_t *request_id)
{
    uint8_t ref[TALLY_SHM_REF_SIZE];
    tally_status_t status = shm_ref(self, req, in, offset, length, out, out_offset, ref);
    if (status != TALLY_OK)
        return status;
    return send_ref(self, req, ref, in, out, request_id, deadline_after(self));
}

/* ---- A shared-memory hist over max_batch, in pieces ---------------------------------------- */

#define SHM_PIECES_WINDOW TALLY_DEFAULT_WINDOW

/* One hist of [offset, offset + length) of `in`, sent as `count` pieces of piece_bytes (the
 * last one shorter), at most SHM_PIECES_WINDOW in flight, their counts summed into `sum`. */
typedef struct {
    tally_client_t *client;
    const tally_req_t *req;
    const tally_region_t *in;
    size_t offset, length, piece_bytes, count;
    size_t next;                        /* the next piece never sent */
    size_t retry[SHM_PIECES_WINDOW];    /* pieces answered `busy`, to send again */
    size_t retries;                     /* in retry[] */
    uint64_t ids[SHM_PIECES_WINDOW];    /* the request in flight in each slot; 0: free */
    size_t piece_of[SHM_PIECES_WINDOW]; /* and its piece */
    size_t inflight, applied;           /* pieces in flight, and answered ok */
    bool was_busy;                      /* the last reply was `busy` */
    tally_reply_t *sum;                 /* the first ok reply, the others added into it */
    tally_status_t failed;              /* the first failure; TALLY_OK while none */
    size_t failed_piece;
    char error[TALLY_ERROR_MESSAGE_MAX + 1];
} shm_pieces_t;

static tally_status_t piece_send(shm_pieces_t *p)
{
    size_t k = p->retries ? p->retry[--p->retries] : p->next++;
    size_t at = k * p->piece_bytes;
    size_t len = p->length - at < p->piece_bytes ? p->length - at : p->piece_bytes;
    size_t slot = 0;
    while (p->ids[slot])
        slot++;
    tally_status_t st =
        tally_send_shm(p->client, p->req, p->in, p->offset + at, len, NULL, 0, &p->ids[slot]);
    p->piece_of[slot] = k;
    p->inflight += st == TALLY_OK;
    return st;
}

/* Adds an ok reply into the sum (the first one becomes it). */
static tally_status_t piece_add(shm_pieces_t *p, tally_reply_t *r)
{
    size_t values = tally__hist_values(p->req->dtype);
    if (r->len != values * 8)
        return fail(p->client, TALLY_E_REPLY, "a hist reply of the wrong length");
    if (!p->sum->payload) {
        *p->sum = *r; /* takes over the payload */
        tally_reply_init(r);
    } else { /* the frame's data is ours until the reply is cleared */
        tally__hist_add((uint8_t *)p->sum->payload, r->payload, values);
        p->sum->rep.aux0 += r->rep.aux0;
    }
    p->applied++;
    return TALLY_OK;
}

/* One reply of a piece: summed, its piece queued again (`busy`: it had no effect, and a hist's
 * pieces add up in any order), or the first failure kept. A local failure is returned. */
static tally_status_t piece_receive(shm_pieces_t *p)
{
    tally_reply_t r;
    tally_reply_init(&r);
    tally_status_t st = tally_recv(p->client, &r);
    size_t slot = 0;
    while (slot < SHM_PIECES_WINDOW && (!p->ids[slot] || p->ids[slot] != r.rep.request_id))
        slot++;
    if (is_local_failure(st) || slot == SHM_PIECES_WINDOW) { /* or a reply to an earlier call */
        tally_reply_clear(&r);
        return is_local_failure(st) ? st : TALLY_OK;
    }
    p->ids[slot] = 0;
    p->inflight--;
    p->was_busy = st == TALLY_E_BUSY;
    if (st == TALLY_OK)
        st = piece_add(p, &r);
    if (st == TALLY_E_BUSY) {
        p->retry[p->retries++] = p->piece_of[slot];
    } else if (st != TALLY_OK && p->failed == TALLY_OK) {
        p->failed = st;
        p->failed_piece = p->piece_of[slot];
        snprintf(p->error, sizeof p->error, "%s", r.error[0] ? r.error : p->client->error);
    }
    tally_reply_clear(&r);
    return TALLY_OK;
}

/* tally_call_shm's hist over the daemon's max_batch (PROTOCOL.md §10): pieces of at most
 * max_batch bytes in whole elements, one reply with their counts summed and aux0 the elements
 * of all. After the first failure no more pieces are sent; those in flight are waited for, and
 * the error says how many pieces were applied. */
static tally_status_t call_shm_pieces(tally_client_t *self, const tally_req_t *req,
                                      const tally_region_t *in, size_t offset, size_t length,
                                      size_t max_batch, tally_reply_t *reply)
{
    size_t esize = tally_dtype_size((tally_dtype_t)req->dtype);
    shm_pieces_t p = {.client = self,
                      .req = req,
                      .in = in,
                      .offset = offset,
                      .length = length,
                      .piece_bytes = max_batch - max_batch % esize,
                      .sum = reply};
    p.count = (length + p.piece_bytes - 1) / p.piece_bytes;
    tally_status_t st = TALLY_OK;
    while (st == TALLY_OK && (p.inflight || (p.failed == TALLY_OK && p.applied < p.count))) {
        while (st == TALLY_OK && p.failed == TALLY_OK && p.inflight < SHM_PIECES_WINDOW &&
               (p.retries || p.next < p.count)) {
            if (p.was_busy && !p.inflight)
                usleep(1000); /* busy with nothing of ours in flight: others hold the slots */
            st = piece_send(&p);
        }
        if (st == TALLY_OK && p.inflight)
            st = piece_receive(&p);
    }
    if (st == TALLY_OK && p.failed != TALLY_OK) {
        st = p.failed;
        set_msg(self->error, "hist piece %zu of %zu failed: %s (%zu of the %zu pieces applied)",
                p.failed_piece + 1, p.count, p.error, p.applied, p.count);
    }
    if (st != TALLY_OK) {
        tally_reply_clear(reply);
        reply->rep.status = (uint32_t)st;
        snprintf(reply->error, sizeof reply->error, "%s", self->error);
    }
    return st;
}

tally_status_t tally_call_shm(tally_client_t *self, const tally_req_t *req,
                              const tally_region_t *in, size_t offset, size_t length,
                              const tally_region_t *out, size_t out_offset, tally_reply_t *reply)
{
    if (!self || !reply)
        return TALLY_E_ARG;
    tally_reply_clear(reply);
    bool pieces = req && req->opcode == TALLY_OP_HIST && !req->seq && !out && in &&
                  offset <= in->size && length <= in->size - offset;
    size_t max_batch = self->max_batch;
    if (pieces && self->transport) /* a fleet: the max_batch of the stream's owner */
        max_batch = self->transport->ops->shm_max_batch
                        ? self->transport->ops->shm_max_batch(self->transport, req, in)
                        : 0;
    if (pieces && max_batch && length > max_batch &&
        tally_dtype_size((tally_dtype_t)req->dtype) <= max_batch)
        return call_shm_pieces(self, req, in, offset, length, max_batch, reply);
    int64_t deadline = deadline_after(self);
    uint8_t ref[TALLY_SHM_REF_SIZE];
    uint64_t id = 0;
    tally_status_t status = shm_ref(self, req, in, offset, length, out, out_offset, ref);
    if (status == TALLY_OK)
        status = send_ref(self, req, ref, in, out, &id, deadline);
    if (status != TALLY_OK) {
        snprintf(reply->error, sizeof reply->error, "%s", self->error);
        return status;
    }
    return tally__wait_reply(self, id, deadline, reply);
}
