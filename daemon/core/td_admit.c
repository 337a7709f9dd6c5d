/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_admit.c — who sent a request, and the per-connection limits it meets before it runs (see
 * td_admit.h).
 */
#include <inttypes.h>
#include <string.h>
#include <uv.h>

#include "td_admit.h"

/* r is refused by a per-peer limit: counted for tallyd_limited_total and for its client. */
void td_admit_count_limited(td_admit_t *a, const td_request_t *r, td_limit_t limit)
{
    a->metrics->limited[limit]++;
    if (r->client)
        td_peer_count_limited(r->client);
}

void td_admit_identify(td_admit_t *a, td_request_t *r, const char *user)
{
    uint64_t now = r->received_ns; /* as it arrived: the clock is read once a request */
    if (a->rate != a->cfg->stream_create_rate) { /* the live value: reloads apply */
        a->rate = a->cfg->stream_create_rate;
        td_peers_set_rate(a->peers, a->rate);
    }
    r->conn = td_peers_acquire(a->peers, TD_PEER_CONNECTION, r->identity, r->identity_len, now);
    if (r->conn && td_peer_inflight_begin(r->conn))
        a->active_conns++;
    if (r->conn) { /* the fair share, judged now that r counts (td_admit_over_share) */
        r->share = td_config_inflight_per_peer(a->cfg, a->active_conns);
        r->share_inflight = td_peer_inflight(r->conn);
    }
    if (user && user[0]) {
        r->client = td_peers_acquire(a->peers, TD_PEER_USER, user, strlen(user), now);
    } else if (r->conn) { /* the connection is the client: the same entry, a second reference */
        r->client = r->conn;
        td_peer_hold(r->client);
    }
    if (r->client && user && user[0])
        td_peer_count_request(r->client);
}

void td_admit_answered(td_admit_t *a, td_request_t *r)
{
    if (r->conn && td_peer_inflight_end(r->conn))
        a->active_conns--;
}

/* The connection's fair share of max_inflight: past it the request is answered `busy` at once,
 * so one peer that floods tallyd (or never reads) cannot keep every slot and stop tallyd reading
 * for everyone else. A peer alone may use every slot (at the limit tallyd stops reading, as
 * before); once others have requests in flight each is held to its share, and as the greedy
 * peer's slots turn over ZeroMQ's fair queueing hands the freed ones to the others. Returns true
 * when r was failed. */
bool td_admit_over_share(td_admit_t *a, td_request_t *r)
{
    if (!r->conn || r->share_inflight <= r->share) /* it counts r itself */
        return false;
    td_admit_count_limited(a, r, TD_LIMIT_INFLIGHT);
    td_request_fail(r, TALLY_E_BUSY,
                    "this connection already has %u requests in flight (max_inflight_per_peer "
                    "%u); send more once replies arrive",
                    r->share_inflight - 1, r->share);
    return true;
}

/* What r's connection's unread replies hold (td_reply.h): past its bound, or past the bound of
 * all connections together, r is answered `busy` before anything is computed, so a peer that
 * does not read its replies cannot make tallyd build more of them. Returns true when r was
 * failed. */
bool td_admit_over_reply_bound(td_admit_t *a, td_request_t *r)
{
    td_reply_admit_t verdict = td_replies_admit(a->replies, r);
    if (verdict == TD_REPLY_ADMITTED)
        return false;
    if (verdict == TD_REPLY_OVER_PEER) {
        td_admit_count_limited(a, r, TD_LIMIT_REPLY_PEER);
        td_request_fail(r, TALLY_E_BUSY,
                        "this connection's unread replies hold max_reply_bytes_per_peer (%" PRIu64
                        " bytes); read your replies, then send it again",
                        td_config_reply_bytes_per_peer(a->cfg));
    } else {
        td_admit_count_limited(a, r, TD_LIMIT_REPLY_TOTAL);
        td_request_fail(r, TALLY_E_BUSY,
                        "unread replies of all connections hold max_reply_bytes (%" PRIu64
                        " bytes); send it again later",
                        td_config_reply_bytes(a->cfg));
    }
    return true;
}
