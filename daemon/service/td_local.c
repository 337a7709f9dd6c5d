/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_local.c — the in-process transport (see td_local.h). Each request carries its reply's
 * function and argument in a small record (the sender's ctx), freed when the reply is handed on.
 */
#include <stdlib.h>

#include "td_local.h"

struct td_local {
    td_transport_t base; /* first: the request path answers through it */
};

typedef struct {
    td_reply_fn done;
    void *arg;
} local_ticket_t;

static void send_reply(td_transport_t *transport, td_reply_t *reply)
{
    (void)transport;
    local_ticket_t *t = reply->to.ctx;
    t->done(t->arg, &reply->rep, reply->body.data, reply->body.len);
    free(t);
    td_reply_end(reply, TD_REPLY_SENT);
}

static const td_transport_ops_t local_ops = {.name = "http", .send_reply = send_reply};

td_err_t td_local_new(td_path_t *path, td_local_t **out)
{
    td_local_t *self = calloc(1, sizeof *self);
    if (!self)
        return TD_ERR_NOMEM;
    self->base = (td_transport_t){.ops = &local_ops, .path = path};
    *out = self;
    return TD_OK;
}

void td_local_destroy(td_local_t **self_p)
{
    free(*self_p);
    *self_p = NULL;
}

void td_local_submit(td_local_t *self, const tally_req_t *req, td_reply_fn done, void *arg)
{
    uint8_t header[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(req, header);
    local_ticket_t *t = malloc(sizeof *t);
    td_msg_t m = {.from = {.ctx = t}, .header = header, .header_len = sizeof header, .frames = 2};
    if (t) {
        *t = (local_ticket_t){.done = done, .arg = arg};
        if (td_path_submit(self->base.path, &self->base, &m) == TD_OK)
            return;
        free(t);
    }
    tally_rep_t rep = {.opcode = req->opcode, .status = TALLY_E_INTERNAL};
    done(arg, &rep, "out of memory", 13);
}
