/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_call.c — request and reply: tally_send, tally_send_zc, tally_recv and tally_call, over
 * the client's ZeroMQ socket, or through its transport's table (tally_transport.h) for a client
 * that has one. The core (tally.c) says when the connection is up; the rest of the library sends
 * and receives through here.
 *
 * Pipelining. A send queues one request and returns with its id; replies are received in any
 * order and name their request, so a caller keeps as many requests in flight as it likes
 * (tally_push.c keeps a window of chunks). tally_call is a send and a wait for that reply, under
 * one deadline; replies to older requests that come first are skipped.
 *
 * Replies. A reply is exactly [64-byte header][payload]. The payload frame is kept as a
 * zmq_msg_t inside tally_reply_t (no copy); error payloads are copied into reply->error.
 */
#include "tally.h"
#include "tally_client_int.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

/* Waits until the socket is readable or writable (`events`) or the deadline passes. */
static tally_status_t wait_socket(tally_client_t *self, short events, int64_t deadline)
{
    for (;;) {
        int64_t left_us = deadline - now_us();
        if (left_us <= 0)
            return TALLY_E_TIMEOUT;
        zmq_pollitem_t item = {.socket = self->sock, .events = events};
        long wait_ms = (long)((left_us + 999) / 1000);
        int rc = zmq_poll(&item, 1, wait_ms);
        if (rc < 0 && errno == EINTR)
            continue;
        if (rc < 0)
            return TALLY_E_TRANSPORT;
        if (rc > 0 && (item.revents & events))
            return TALLY_OK;
    }
}

/* ---- Replies ------------------------------------------------------------------------------ */

void tally_reply_init(tally_reply_t *reply)
{
    memset(reply, 0, sizeof *reply);
}

void tally_reply_clear(tally_reply_t *reply)
{
    if (!reply)
        return;
    if (reply->msg_) {
        zmq_msg_close(reply->msg_);
        free(reply->msg_);
    }
    tally_reply_init(reply);
}

static void free_buffer(void *data, void *hint)
{
    (void)hint;
    free(data);
}

tally_status_t tally__reply_take(tally_reply_t *reply, uint8_t *buf, size_t len)
{
    zmq_msg_t *frame = malloc(sizeof *frame);
    if (!frame || zmq_msg_init_data(frame, buf, len, free_buffer, NULL) != 0) {
        free(frame);
        free(buf);
        return TALLY_E_NOMEM;
    }
    reply->msg_ = frame;
    reply->payload = len ? buf : NULL;
    reply->len = len;
    return TALLY_OK;
}

/* ---- Send and receive --------------------------------------------------------------------- */

/* Validates req and queues its header frame (with ZMQ_SNDMORE), waiting for the socket until
 * the deadline; *id receives the request id. The caller must then send the payload frame. */
static tally_status_t send_header_until(tally_client_t *self, const tally_req_t *req, size_t len,
                                        uint64_t *id, int64_t deadline)
{
    tally_req_t wire = *req;
    wire.version = TALLY_PROTO_VERSION;
    wire.request_id = self->next_id;
    char msg[TALLY_ERROR_MESSAGE_MAX + 1] = "";
    tally_status_t status = tally_req_validate(&wire, len, SIZE_MAX, msg, sizeof msg);
    if (status != TALLY_OK)
        return fail(self, status, msg[0] ? msg : tally_status_text(status));

    uint8_t header[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(&wire, header);
    status = tally__wait_connected(self, deadline);
    if (status != TALLY_OK)
        return status; /* self->error says why */
    for (;;) {
        status = wait_socket(self, ZMQ_POLLOUT, deadline);
        if (status == TALLY_E_TIMEOUT)
            return fail(self, status, "timed out waiting to send (is tallyd running?)");
        if (status != TALLY_OK)
            return fail(self, status, zmq_strerror(zmq_errno()));
        if (zmq_send(self->sock, header, sizeof header, ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0)
            break;
        if (zmq_errno() != EAGAIN && zmq_errno() != EINTR)
            return fail(self, TALLY_E_TRANSPORT, zmq_strerror(zmq_errno()));
    }
    *id = self->next_id++;
    return TALLY_OK;
}

/* Queues the payload frame, a copy of payload: into a pooled buffer for a large one (sent
 * without a second copy, given back to the pool once sent), else through zmq_send. */
static int send_payload_copy(tally_client_t *self, const void *payload, size_t len)
{
    void *buf = tally__bufpool_take(self->pool, len);
    if (!buf)
        return zmq_send(self->sock, len ? payload : "", len, 0) < 0 ? -1 : 0;
    memcpy(buf, payload, len);
    tally__bufpool_written(buf);
    zmq_msg_t frame;
    if (zmq_msg_init_data(&frame, buf, len, tally__bufpool_give_back, NULL) != 0) {
        tally__bufpool_give_back(buf, NULL); /* out of memory for ZeroMQ's bookkeeping */
        return zmq_send(self->sock, payload, len, 0) < 0 ? -1 : 0;
    }
    if (zmq_msg_send(&frame, self->sock, 0) >= 0)
        return 0;
    int err = zmq_errno();
    zmq_msg_close(&frame); /* gives buf back */
    errno = err;
    return -1;
}

tally_status_t tally__send_until(tally_client_t *self, const tally_req_t *req, const void *payload,
                                 size_t len, uint64_t *request_id, int64_t deadline)
{
    if (!req || (len && !payload))
        return TALLY_E_ARG;
    if (self->transport) /* a fleet over NATS (tally_transport.h) */
        return self->transport->ops->send(self->transport, req, payload, len, request_id,
                                          self->error, sizeof self->error);
    uint64_t id;
    tally_status_t status = send_header_until(self, req, len, &id, deadline);
    if (status != TALLY_OK)
        return status;
    /* Multipart messages are atomic: once the first frame is queued the last one is too. */
    if (send_payload_copy(self, payload, len) != 0)
        return fail(self, TALLY_E_TRANSPORT, zmq_strerror(zmq_errno()));
    if (request_id)
        *request_id = id;
    return TALLY_OK;
}

tally_status_t tally_send(tally_client_t *self, const tally_req_t *req, const void *payload,
                          size_t len, uint64_t *request_id)
{
    if (!self)
        return TALLY_E_ARG;
    return tally__send_until(self, req, payload, len, request_id, deadline_after(self));
}

tally_status_t tally__send_zc_until(tally_client_t *self, const tally_req_t *req, void *payload,
                                    size_t len, tally_free_fn *free_fn, void *hint,
                                    uint64_t *request_id, int64_t deadline)
{
    tally_status_t status = TALLY_E_ARG;
    if (!self || !req || !payload || !len || !free_fn)
        goto release;
    if (self->transport) { /* NATS copies the payload into its message */
        status = tally__send_until(self, req, payload, len, request_id, deadline);
        goto release;
    }
    uint64_t id;
    status = send_header_until(self, req, len, &id, deadline);
    if (status != TALLY_OK)
        goto release;
    /* From here ZeroMQ owns the buffer: it calls free_fn once it is sent, or on close. */
    zmq_msg_t frame;
    if (zmq_msg_init_data(&frame, payload, len, free_fn, hint) != 0) {
        /* Cannot happen with a valid buffer, but the header is queued: end the message. */
        zmq_send(self->sock, "", 0, 0);
        status = fail(self, TALLY_E_NOMEM, "out of memory");
        goto release;
    }
    if (zmq_msg_send(&frame, self->sock, 0) < 0) {
        status = fail(self, TALLY_E_TRANSPORT, zmq_strerror(zmq_errno()));
        zmq_msg_close(&frame); /* calls free_fn */
        return status;
    }
    if (request_id)
        *request_id = id;
    return TALLY_OK;

release:
    if (free_fn && payload)
        free_fn(payload, hint);
    return status;
}

tally_status_t tally_send_zc(tally_client_t *self, const tally_req_t *req, void *payload,
                             size_t len, tally_free_fn *free_fn, void *hint, uint64_t *request_id)
{
    if (!self) {
        if (free_fn && payload)
            free_fn(payload, hint);
        return TALLY_E_ARG;
    }
    return tally__send_zc_until(self, req, payload, len, free_fn, hint, request_id,
                                deadline_after(self));
}

/* Fills reply from a header frame and payload frame already received. Takes `payload`. */
static tally_status_t decode_reply(tally_client_t *self, zmq_msg_t *header, zmq_msg_t *payload,
                                   tally_reply_t *reply)
{
    if (tally_rep_decode(zmq_msg_data(header), zmq_msg_size(header), &reply->rep) != TALLY_OK) {
        set_msg(reply->error, "undecodable reply header (%zu bytes)", zmq_msg_size(header));
        goto bad_reply;
    }
    size_t len = zmq_msg_size(payload);
    if (reply->rep.status != TALLY_OK) {
        size_t n = len < TALLY_ERROR_MESSAGE_MAX ? len : TALLY_ERROR_MESSAGE_MAX;
        memcpy(reply->error, zmq_msg_data(payload), n);
        reply->error[n] = '\0';
        if (!n)
            set_msg(reply->error, "%s", tally_status_text((tally_status_t)reply->rep.status));
        zmq_msg_close(payload);
        free(payload);
        fail(self, (tally_status_t)reply->rep.status, reply->error);
        return (tally_status_t)reply->rep.status;
    }
    size_t esize = tally_dtype_size((tally_dtype_t)reply->rep.dtype);
    if (esize && len % esize) {
        set_msg(reply->error, "reply payload of %zu bytes is not a whole number of %s", len,
                tally_dtype_name((tally_dtype_t)reply->rep.dtype));
        goto bad_reply;
    }
    if (len) {
        reply->msg_ = payload;
        reply->payload = zmq_msg_data(payload);
        reply->len = len;
    } else {
        zmq_msg_close(payload);
        free(payload);
    }
    return TALLY_OK;

bad_reply:
    zmq_msg_close(payload);
    free(payload);
    return fail(self, TALLY_E_REPLY, reply->error);
}

static tally_status_t recv_until(tally_client_t *self, tally_reply_t *reply, int64_t deadline)
{
    if (self->transport) {
        int64_t left_ms = (deadline - now_us()) / 1000;
        tally_status_t st =
            self->transport->ops->recv(self->transport, left_ms > 0 ? (int)left_ms : 1, reply);
        if (st != TALLY_OK)
            set_msg(self->error, "%s", reply->error);
        return st;
    }
    tally_reply_clear(reply);
    zmq_msg_t header;
    zmq_msg_init(&header);
    for (;;) {
        tally_status_t status = wait_socket(self, ZMQ_POLLIN, deadline);
        if (status == TALLY_E_TIMEOUT) {
            zmq_msg_close(&header);
            set_msg(reply->error, "no reply within %d ms (is tallyd running?)", self->timeout_ms);
            return fail(self, status, reply->error);
        }
        if (status != TALLY_OK) {
            zmq_msg_close(&header);
            goto transport;
        }
        if (zmq_msg_recv(&header, self->sock, ZMQ_DONTWAIT) >= 0)
            break;
        if (zmq_errno() != EAGAIN && zmq_errno() != EINTR) { /* else: a spurious wake-up */
            zmq_msg_close(&header);
            goto transport;
        }
    }
    /* Decoded first, so even a malformed reply names the request it answers (if it can). */
    (void)tally_rep_decode(zmq_msg_data(&header), zmq_msg_size(&header), &reply->rep);
    if (!zmq_msg_more(&header)) {
        zmq_msg_close(&header);
        set_msg(reply->error, "reply has 1 frame, expected 2");
        return fail(self, TALLY_E_REPLY, reply->error);
    }
    zmq_msg_t *payload = malloc(sizeof *payload);
    if (!payload) {
        zmq_msg_close(&header);
        tally__drain_frames(self->sock);
        return fail(self, TALLY_E_NOMEM, "out of memory");
    }
    zmq_msg_init(payload);
    if (zmq_msg_recv(payload, self->sock, 0) < 0) {
        zmq_msg_close(&header);
        zmq_msg_close(payload);
        free(payload);
        goto transport;
    }
    if (zmq_msg_more(payload)) {
        int extra = tally__drain_frames(self->sock);
        zmq_msg_close(&header);
        zmq_msg_close(payload);
        free(payload);
        set_msg(reply->error, "reply has %d frames, expected 2", 2 + extra);
        return fail(self, TALLY_E_REPLY, reply->error);
    }
    tally_status_t status = decode_reply(self, &header, payload, reply);
    zmq_msg_close(&header);
    return status;

transport:
    set_msg(reply->error, "receive failed: %s", zmq_strerror(zmq_errno()));
    return fail(self, TALLY_E_TRANSPORT, reply->error);
}

tally_status_t tally_recv(tally_client_t *self, tally_reply_t *reply)
{
    if (!self || !reply)
        return TALLY_E_ARG;
    return recv_until(self, reply, deadline_after(self));
}

tally_status_t tally_call(tally_client_t *self, const tally_req_t *req, const void *payload,
                          size_t len, tally_reply_t *reply)
{
    if (!self || !req || !reply)
        return TALLY_E_ARG;
    tally_reply_clear(reply);
    int64_t deadline = deadline_after(self);
    uint64_t id = 0;
    tally_status_t status = tally__send_until(self, req, payload, len, &id, deadline);
    if (status != TALLY_OK) {
        snprintf(reply->error, sizeof reply->error, "%s", self->error);
        return status;
    }
    return tally__wait_reply(self, id, deadline, reply);
}

/* Replies to older requests (ones that timed out, or a tally_run that failed) may still
 * arrive: skip them until the one for `id` comes. */
tally_status_t tally__wait_reply(tally_client_t *self, uint64_t id, int64_t deadline,
                                 tally_reply_t *reply)
{
    tally_status_t status;
    for (;;) {
        status = recv_until(self, reply, deadline);
        if (is_local_failure(status))
            return status;
        if (reply->rep.request_id == id)
            return status;
        if (status == TALLY_E_REPLY && reply->rep.request_id == 0)
            return status; /* the header did not decode: cannot tell whose it is */
    }
}
