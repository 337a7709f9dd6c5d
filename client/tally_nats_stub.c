/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_nats_stub.c — the NATS producer's API in a libtally built without libnats
 * (TALLY_NATS=OFF, or libnats-dev not installed): every call fails with TALLY_E_ARG and says so,
 * so the library exports the same functions either way.
 */
#include <stdio.h>

#include "tally.h"
#include "tally_client_nats.h"

static const char *const why = "libtally was built without NATS (install libnats-dev, rebuild)";

tally_status_t tally_nats_new(const tally_nats_opts_t *opts, tally_nats_t **out, char *msg,
                              size_t msg_cap)
{
    (void)opts;
    if (out)
        *out = NULL;
    if (msg && msg_cap)
        snprintf(msg, msg_cap, "%s", why);
    return TALLY_E_ARG;
}

void tally_nats_destroy(tally_nats_t **self_p)
{
    if (self_p)
        *self_p = NULL;
}

uint32_t tally_nats_partitions(const tally_nats_t *self)
{
    (void)self;
    return 0;
}

size_t tally_nats_max_payload(const tally_nats_t *self)
{
    (void)self;
    return 0;
}

const char *tally_nats_producer_id(const tally_nats_t *self)
{
    (void)self;
    return "";
}

const char *tally_nats_error(const tally_nats_t *self)
{
    (void)self;
    return why;
}

void tally_nats_stats(tally_nats_t *self, tally_nats_stats_t *out)
{
    (void)self;
    *out = (tally_nats_stats_t){0};
}

tally_status_t tally_nats_send(tally_nats_t *self, const tally_req_t *req, const void *payload,
                               size_t len, bool want_reply, uint64_t *first_id, uint64_t *chunks)
{
    (void)self, (void)req, (void)payload, (void)len, (void)want_reply, (void)first_id, (void)chunks;
    return TALLY_E_ARG;
}

tally_status_t tally_nats_flush(tally_nats_t *self)
{
    (void)self;
    return TALLY_E_ARG;
}

tally_status_t tally_nats_recv(tally_nats_t *self, int timeout_ms, tally_reply_t *reply)
{
    (void)self, (void)timeout_ms, (void)reply;
    return TALLY_E_ARG;
}

tally_status_t tally_nats_call(tally_nats_t *self, const tally_req_t *req, const void *payload,
                               size_t len, tally_reply_t *reply)
{
    (void)self, (void)req, (void)payload, (void)len, (void)reply;
    return TALLY_E_ARG;
}

tally_status_t tally_nats_query(tally_nats_t *self, const char *stream, tally_stream_info_t *info)
{
    (void)self, (void)stream, (void)info;
    return TALLY_E_ARG;
}

tally_status_t tally_nats_query_stale(tally_nats_t *self, const char *stream,
                                      tally_stream_info_t *info, uint64_t *stale)
{
    (void)self, (void)stream, (void)info, (void)stale;
    return TALLY_E_ARG;
}

tally_status_t tally_nats_streams(tally_nats_t *self, char ***names, size_t *count)
{
    (void)self, (void)names, (void)count;
    return TALLY_E_ARG;
}

uint32_t tally_nats_streams_missing(const tally_nats_t *self)
{
    (void)self;
    return 0;
}

uint64_t tally__nats_next_id(const tally_nats_t *self)
{
    (void)self;
    return 0;
}

tally_status_t tally__nats_last_seq(tally_nats_t *self, const char *stream, uint64_t *last)
{
    (void)self, (void)stream;
    *last = 0;
    return TALLY_E_ARG;
}

size_t tally__nats_chunk_limit(const tally_nats_t *self, const tally_req_t *req, bool want_reply)
{
    (void)self;
    (void)req;
    (void)want_reply;
    return 0;
}

tally_status_t tally_nats_sub_new(tally_nats_t *nats, tally_nats_sub_t **out)
{
    (void)nats;
    if (out)
        *out = NULL;
    return TALLY_E_ARG;
}

tally_status_t tally_nats_sub_stream(tally_nats_sub_t *self, const char *stream)
{
    (void)self, (void)stream;
    return TALLY_E_ARG;
}

tally_status_t tally_nats_sub_recv(tally_nats_sub_t *self, int timeout_ms, tally_pub_msg_t *msg)
{
    (void)self, (void)timeout_ms, (void)msg;
    return TALLY_E_ARG;
}

int tally_nats_sub_fd(const tally_nats_sub_t *self)
{
    (void)self;
    return -1;
}

uint64_t tally_nats_sub_dropped(const tally_nats_sub_t *self)
{
    (void)self;
    return 0;
}

void tally_nats_sub_destroy(tally_nats_sub_t **self_p)
{
    (void)self_p;
}

tally_status_t tally_client_new_fleet(const tally_nats_opts_t *opts, tally_client_t **out,
                                      char *msg, size_t msg_cap)
{
    return tally_client_new_nats(opts, out, msg, msg_cap);
}

tally_status_t tally_client_new_fleet_curve(const tally_nats_opts_t *opts,
                                            const tally_curve_keys_t *keys, tally_client_t **out,
                                            char *msg, size_t msg_cap)
{
    (void)keys;
    return tally_client_new_nats(opts, out, msg, msg_cap);
}
