/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_sub.c — subscriptions: a ZeroMQ SUB socket on tallyd's PUB endpoint (PROTOCOL.md §11).
 *
 * tallyd publishes, every pub_interval_ms, the record of each stream that changed, as three
 * frames [topic = stream name][64-byte header][record]. ZeroMQ filters by topic prefix on the
 * publisher's side, so a subscriber names the prefixes it wants and still checks names itself
 * when it wants exact ones ("cam0" also matches "cam01").
 *
 * With CURVE on (tally_sub_new_curve) the SUB socket is a CURVE client with the request client's
 * keys: tallyd's PUB socket is a CURVE server with the request endpoint's key and allowed clients
 * (PROTOCOL.md §12), and a subscriber it does not admit simply receives nothing.
 *
 * tally_sub_fd is ZMQ_FD: edge-triggered, readable when *something* may have changed, so a
 * caller that polls it must then call tally_sub_recv with timeout 0 until TALLY_E_TIMEOUT,
 * or it may wait forever for an edge that already passed.
 */
#include "tally.h"
#include "tally_client_int.h"
#include "tally_internal.h"
#include "tally_proto.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

struct tally_sub {
    void *ctx;
    void *sock;
};

tally_status_t tally_sub_new(const char *endpoint, tally_sub_t **out)
{
    return tally_sub_new_curve(endpoint, NULL, out);
}

tally_status_t tally_sub_new_curve(const char *endpoint, const tally_curve_keys_t *keys,
                                   tally_sub_t **out)
{
    if (!out || !endpoint || !*endpoint)
        return TALLY_E_ARG;
    *out = NULL;
    tally_sub_t *self = calloc(1, sizeof *self);
    if (!self)
        return TALLY_E_NOMEM;
    tally_status_t status = TALLY_E_TRANSPORT;
    int zero = 0;
    self->ctx = zmq_ctx_new();
    if (!self->ctx)
        goto fail;
    self->sock = zmq_socket(self->ctx, ZMQ_SUB);
    if (!self->sock || zmq_setsockopt(self->sock, ZMQ_LINGER, &zero, sizeof zero) != 0)
        goto fail;
    if ((status = tally__set_curve(self->sock, keys)) != TALLY_OK ||
        (status = tally__connect(self->sock, endpoint)) != TALLY_OK)
        goto fail;
    *out = self;
    return TALLY_OK;
fail:
    tally_sub_destroy(&self);
    return status;
}

void tally_sub_destroy(tally_sub_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tally_sub_t *self = *self_p;
    if (self->sock)
        zmq_close(self->sock);
    if (self->ctx)
        zmq_ctx_term(self->ctx);
    free(self);
    *self_p = NULL;
}

tally_status_t tally_sub_subscribe(tally_sub_t *self, const char *prefix)
{
    if (!self || !prefix || strlen(prefix) > TALLY_STREAM_NAME_MAX)
        return TALLY_E_ARG;
    if (zmq_setsockopt(self->sock, ZMQ_SUBSCRIBE, prefix, strlen(prefix)) != 0)
        return TALLY_E_TRANSPORT;
    return TALLY_OK;
}

int tally_sub_fd(const tally_sub_t *self)
{
    int fd = -1;
    size_t len = sizeof fd;
    if (!self || zmq_getsockopt(self->sock, ZMQ_FD, &fd, &len) != 0)
        return -1;
    return fd;
}

/* The frames of one message: 0 or an error; the rest of a malformed message is drained. */
static tally_status_t recv_frames(void *sock, zmq_msg_t frames[3], int *count)
{
    *count = 0;
    for (;;) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, sock, *count ? 0 : ZMQ_DONTWAIT) < 0) {
            int e = errno;
            zmq_msg_close(&part);
            return e == EAGAIN ? TALLY_E_TIMEOUT : TALLY_E_TRANSPORT;
        }
        bool more = zmq_msg_more(&part);
        if (*count < 3)
            frames[(*count)++] = part;
        else {
            zmq_msg_close(&part);
            (*count)++;
        }
        if (!more)
            return TALLY_OK;
    }
}

static tally_status_t decode_message(zmq_msg_t frames[3], int count, tally_pub_msg_t *msg)
{
    if (count != 3)
        return TALLY_E_REPLY;
    size_t name_len = zmq_msg_size(&frames[0]);
    if (!tally_stream_name_valid(zmq_msg_data(&frames[0]), name_len))
        return TALLY_E_REPLY;
    memcpy(msg->stream, zmq_msg_data(&frames[0]), name_len);
    msg->stream[name_len] = '\0';
    if (tally_pub_decode(zmq_msg_data(&frames[1]), zmq_msg_size(&frames[1]), &msg->pub) != TALLY_OK)
        return TALLY_E_REPLY;
    if (msg->pub.kind == TALLY_PUB_DELETED)
        return zmq_msg_size(&frames[2]) == 0 ? TALLY_OK : TALLY_E_REPLY;
    return tally_stream_info_decode(zmq_msg_data(&frames[2]), zmq_msg_size(&frames[2]), &msg->info);
}

tally_status_t tally_sub_recv(tally_sub_t *self, int timeout_ms, tally_pub_msg_t *msg)
{
    if (!self || !msg)
        return TALLY_E_ARG;
    if (timeout_ms > 0) {
        zmq_pollitem_t item = {.socket = self->sock, .events = ZMQ_POLLIN};
        if (zmq_poll(&item, 1, timeout_ms) < 0)
            return errno == EINTR ? TALLY_E_TIMEOUT : TALLY_E_TRANSPORT;
    }
    zmq_msg_t frames[3];
    int count = 0;
    tally_status_t status = recv_frames(self->sock, frames, &count);
    if (status == TALLY_OK) {
        memset(msg, 0, sizeof *msg);
        status = decode_message(frames, count, msg);
        if (status != TALLY_OK)
            status = TALLY_E_REPLY;
    }
    for (int i = 0; i < count && i < 3; i++)
        zmq_msg_close(&frames[i]);
    return status;
}
