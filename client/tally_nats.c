/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tally_nats.c — libtally's NATS JetStream producer (PROTOCOL.md §13): requests published to
 * their partition's subject, each with a dedupe id, the PubAcks awaited, and the results read
 * from this producer's reply inbox.
 *
 * Publishing is asynchronous (js_PublishMsgAsync): tally_nats_send queues messages while the
 * bytes awaiting a PubAck stay under the window, tally_nats_flush waits for every PubAck. Within
 * one stream it waits for the previous message's PubAck first: a message resent after a failed
 * PubAck (no stream leader for a moment) must not land after the next one, which the worker
 * would then refuse as a sequence gap or apply out of order. Streams pipeline side by side. The
 * acknowledgement handler runs on a libnats thread; it only books the outcome under the mutex:
 * a PubAck that says "stored" or "duplicate" frees the message; a failure that may be transient
 * (a PubAck timeout, no responders while a stream leader is elected, a full stream) puts the
 * message on the retry list, and the caller's thread publishes it again, unchanged: same data,
 * same Nats-Msg-Id, so JetStream stores it once whichever of the attempts arrived (a timeout
 * does not mean the first was not stored). Resending from the handler itself could block it in
 * libnats' stall wait while it holds the slot the wait waits for.
 *
 * Dedupe ids are "<producer id>.<n>", n = 1, 2, 3, ...; n is also the request id in the header,
 * so a reply names the request it answers twice over. Replies arrive on one inbox subscription;
 * a reply whose request is no longer awaited (an answer again after a worker's take-over) is
 * dropped, so each request's reply is returned once.
 */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include <nats/nats.h>
#include <zmq.h>

#include "tally.h"
#include "tally_client_nats.h"
#include "tally_fleet.h"
#include "tally_nats_conn.h"

#define DEFAULT_WINDOW_BYTES (32u << 20)
/* The pause before a failed message is published again: long enough not to spin on a failure
 * that repeats at once (no responders while a stream leader is elected), short beside an
 * election (a few seconds). */
#define RETRY_DELAY_MS 200
/* Per-stream order: a message on a stream is published only once every earlier message of this
 * producer on that stream has its PubAck. Streams are counted in ORDER_SLOTS slots by the hash of
 * their name; two streams in one slot wait for each other, which costs a little pipelining and
 * never the order. */
#define ORDER_SLOTS 4096u
#define NO_ORDER UINT32_MAX

struct tally_nats {
    natsConnection *nc;
    jsCtx *js;
    natsSubscription *replies; /* on inbox */
    char inbox[160];
    char user[TALLY_NATS_MEMBER_ID_MAX + 1]; /* the NATS user: subjects, inbox, id namespace */
    char producer_id[TALLY_NATS_MEMBER_ID_MAX + 1];
    uint32_t partitions;
    uint32_t streams_missing; /* the last gather's partitions without an answer */
    bool stale_ok;            /* the request under way asks Tally-Stale-Ok (tally__nats_ask) */
    size_t max_payload;
    int timeout_ms;
    size_t window_bytes;
    uint64_t next_n;
    uint32_t round_robin;
    uint8_t *scratch; /* one message's data, built before natsMsg_Create copies it */
    size_t scratch_cap;
    char error[TALLY_ERROR_MESSAGE_MAX + 1];
    uint64_t *awaited; /* n of the requests whose replies are awaited, increasing */
    size_t awaited_len, awaited_cap;

    /* Shared with the PubAck handler (a libnats thread). */
    pthread_mutex_t mu;
    pthread_cond_t cond;
    size_t pending_bytes; /* data of the messages without a PubAck yet, retries included */
    size_t pending_msgs;
    natsMsg **retry;
    size_t retry_len, retry_cap;
    natsMsg **resent; /* published more than once and without a PubAck yet */
    size_t resent_len, resent_cap;
    bool random_id;   /* producer_id is random: a `duplicate` on a first publish is a collision */
    int64_t retry_at; /* resend no earlier (ms, monotonic): a failure may repeat at once */
    uint32_t order[ORDER_SLOTS]; /* messages without a PubAck, per stream slot */
    tally_nats_stats_t stats;
    char ack_error[TALLY_ERROR_MESSAGE_MAX + 1]; /* the last PubAck failure */
};

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static tally_status_t fail(tally_nats_t *self, tally_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static tally_status_t fail(tally_nats_t *self, tally_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(self->error, sizeof self->error, fmt, ap);
    va_end(ap);
    return st;
}

static size_t msg_bytes(natsMsg *m)
{
    return (size_t)natsMsg_GetDataLength(m);
}

/* The order slot of a message's stream (its request header's name), or NO_ORDER without one. */
static uint32_t order_slot(natsMsg *m)
{
    const uint8_t *d = (const uint8_t *)natsMsg_GetData(m);
    if (msg_bytes(m) < TALLY_REQ_HEADER_SIZE || d[17] == 0 || d[17] > TALLY_STREAM_NAME_MAX)
        return NO_ORDER;
    return (uint32_t)(tally_fnv1a64(d + 64, d[17]) % ORDER_SLOTS);
}

/* A PubAck failure worth sending the message again for: everything but a message the stream
 * can never take. */
static bool retryable(const jsPubAckErr *pae)
{
    return pae->ErrCode != JSStreamMessageExceedsMaximumErr;
}

/* Puts msg on the retry list (mutex held); false when there is no memory for it. */
static bool retry_later(tally_nats_t *self, natsMsg *msg)
{
    if (self->retry_len == self->retry_cap) {
        size_t cap = self->retry_cap ? 2 * self->retry_cap : 16;
        natsMsg **grown = realloc(self->retry, cap * sizeof *grown);
        if (!grown)
            return false;
        self->retry = grown;
        self->retry_cap = cap;
    }
    self->retry[self->retry_len++] = msg;
    self->retry_at = now_ms() + RETRY_DELAY_MS;
    return true;
}

/* Whether msg was published more than once; forgets it (mutex held). */
static bool resent_take(tally_nats_t *self, natsMsg *msg)
{
    for (size_t i = 0; i < self->resent_len; i++)
        if (self->resent[i] == msg) {
            self->resent[i] = self->resent[--self->resent_len];
            return true;
        }
    return false;
}

/* A PubAck that says `duplicate` for a message published once under a random id: another
 * producer published that id first, which it can only do by knowing it (PROTOCOL.md §13
 * "Security"), and the stream kept the other message instead. The message takes a fresh id (16
 * more random hex digits after it) to be published again, so it is not lost; false when it
 * cannot (no randomness, no room left in an id). */
static bool rename_collided(natsMsg *msg)
{
    const char *id = NULL;
    uint8_t r[8];
    char fresh[TALLY_NATS_MSG_ID_MAX + 1];
    if (natsMsgHeader_Get(msg, TALLY_NATS_HDR_MSG_ID, &id) != NATS_OK || !id ||
        getrandom(r, sizeof r, 0) != (ssize_t)sizeof r)
        return false;
    size_t n = (size_t)snprintf(fresh, sizeof fresh, "%s.", id);
    if (n + 2 * sizeof r >= sizeof fresh)
        return false;
    for (size_t i = 0; i < sizeof r; i++)
        snprintf(fresh + n + 2 * i, 3, "%02x", r[i]);
    return natsMsgHeader_Set(msg, TALLY_NATS_HDR_MSG_ID, fresh) == NATS_OK;
}

static void on_pub_ack(jsCtx *js, natsMsg *msg, jsPubAck *pa, jsPubAckErr *pae, void *closure)
{
    (void)js;
    tally_nats_t *self = closure;
    bool keep = false;
    pthread_mutex_lock(&self->mu);
    bool resent = resent_take(self, msg);
    if (pa && pa->Duplicate && self->random_id && !resent) {
        self->stats.collisions++;
        keep = rename_collided(msg) && retry_later(self, msg);
        if (!keep) {
            snprintf(self->ack_error, sizeof self->ack_error,
                     "a message's id was taken by another producer and it could not be renamed");
            self->stats.failed++;
        }
    } else if (pa) {
        self->stats.acked++;
        self->stats.duplicates += pa->Duplicate;
    } else {
        snprintf(self->ack_error, sizeof self->ack_error, "%s",
                 pae->ErrText ? pae->ErrText : natsStatus_GetText(pae->Err));
        keep = retryable(pae) && retry_later(self, msg);
        if (!keep)
            self->stats.failed++;
    }
    if (!keep) {
        self->pending_bytes -= msg_bytes(msg);
        self->pending_msgs--;
        uint32_t slot = order_slot(msg);
        if (slot != NO_ORDER)
            self->order[slot]--;
    }
    pthread_cond_broadcast(&self->cond);
    pthread_mutex_unlock(&self->mu);
    if (!keep)
        natsMsg_Destroy(msg);
}

/* Publishes msg (owned by the caller until the library takes it: *msg becomes NULL). */
static natsStatus publish(tally_nats_t *self, natsMsg **msg)
{
    jsPubOptions po;
    jsPubOptions_Init(&po);
    po.MaxWait = self->timeout_ms;
    return js_PublishMsgAsync(self->js, msg, &po);
}

static bool resent_grow(tally_nats_t *self)
{
    size_t cap = self->resent_cap ? 2 * self->resent_cap : 16;
    natsMsg **grown = realloc(self->resent, cap * sizeof *grown);
    if (!grown)
        return false;
    self->resent = grown;
    self->resent_cap = cap;
    return true;
}

/* Publishes the messages on the retry list again (caller's thread). A message libnats does not
 * take now (disconnected, its reconnect buffer full) goes back on the list. */
static void resend_failed(tally_nats_t *self)
{
    pthread_mutex_lock(&self->mu);
    while (self->retry_len > 0 && now_ms() >= self->retry_at) {
        natsMsg *m = self->retry[--self->retry_len];
        /* Marked before it goes: its PubAck may come before this thread has the mutex again. A
         * message not marked (no memory) only loses its collision check. */
        bool marked = self->resent_len < self->resent_cap || resent_grow(self);
        if (marked)
            self->resent[self->resent_len++] = m;
        natsMsg *sent = m;
        pthread_mutex_unlock(&self->mu);
        natsStatus s = publish(self, &sent);
        pthread_mutex_lock(&self->mu);
        if (s == NATS_OK) {
            self->stats.resent++;
            continue;
        }
        if (marked)
            resent_take(self, m);
        self->retry[self->retry_len++] = m; /* room: it was just taken from there */
        self->retry_at = now_ms() + RETRY_DELAY_MS;
        snprintf(self->ack_error, sizeof self->ack_error, "publish: %s", natsStatus_GetText(s));
        break;
    }
    pthread_mutex_unlock(&self->mu);
}

/* Waits (resending what failed) until there is room for `room` bytes in the window and no
 * message of order slot `slot` awaits its PubAck (room 0: until every message has its PubAck),
 * or the deadline passes; called with the mutex not held. */
static tally_status_t wait_acks(tally_nats_t *self, size_t room, uint32_t slot, int64_t deadline)
{
    for (;;) {
        resend_failed(self);
        pthread_mutex_lock(&self->mu);
        bool done =
            room ? (self->pending_msgs == 0 || self->pending_bytes + room <= self->window_bytes) &&
                       (slot == NO_ORDER || self->order[slot] == 0)
                 : self->pending_msgs == 0;
        if (done) {
            pthread_mutex_unlock(&self->mu);
            return TALLY_OK;
        }
        int64_t left = deadline - now_ms();
        if (left <= 0) {
            char url[128] = "";
            natsConnection_GetConnectedUrl(self->nc, url, sizeof url);
            tally_status_t st =
                fail(self, TALLY_E_TIMEOUT,
                     "%zu messages without a PubAck after %d ms (last error: %s; connected to %s)",
                     self->pending_msgs, self->timeout_ms,
                     self->ack_error[0] ? self->ack_error : "none", url[0] ? url : "none");
            pthread_mutex_unlock(&self->mu);
            return st;
        }
        /* Wake at least every 100 ms: a failure put on the retry list is resent from here. */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        int64_t ns = ts.tv_nsec + (left < 100 ? left : 100) * 1000000;
        ts.tv_sec += ns / 1000000000;
        ts.tv_nsec = ns % 1000000000;
        pthread_cond_timedwait(&self->cond, &self->mu, &ts);
        pthread_mutex_unlock(&self->mu);
    }
}

/* ---- Connecting ---------------------------------------------------------------------------- */

static tally_status_t read_partitions(tally_nats_t *self)
{
    kvStore *kv = NULL;
    kvEntry *e = NULL;
    natsStatus s = js_KeyValue(&kv, self->js, TALLY_NATS_BUCKET_FLEET);
    if (s == NATS_OK)
        s = kvStore_Get(&e, kv, TALLY_NATS_KEY_PARTITIONS);
    tally_status_t st = TALLY_OK;
    if (s == NATS_OK) {
        char text[16];
        int len = kvEntry_ValueLen(e);
        snprintf(text, sizeof text, "%.*s", len > 0 && len < 15 ? len : 0,
                 (const char *)kvEntry_Value(e));
        unsigned long p = strtoul(text, NULL, 10);
        if (p >= 1 && p <= TALLY_NATS_MAX_PARTITIONS)
            self->partitions = (uint32_t)p;
        else
            st = fail(self, TALLY_E_REPLY, "the fleet's partition count '%s' is not valid", text);
    } else if (s == NATS_NOT_FOUND) {
        st = fail(self, TALLY_E_ARG,
                  "no tallyd fleet on this NATS (%s/%s not found): start a worker first",
                  TALLY_NATS_BUCKET_FLEET, TALLY_NATS_KEY_PARTITIONS);
    } else {
        st = fail(self, TALLY_E_TRANSPORT, "reading %s: %s", TALLY_NATS_BUCKET_FLEET,
                  natsStatus_GetText(s));
    }
    kvEntry_Destroy(e);
    kvStore_Destroy(kv);
    return st;
}

static tally_status_t set_producer_id(tally_nats_t *self, const char *id)
{
    if (id) {
        if (!tally_fleet_member_id_valid(id))
            return fail(self, TALLY_E_ARG, "producer id '%s': 1..64 characters of A-Z a-z 0-9 - _",
                        id);
        snprintf(self->producer_id, sizeof self->producer_id, "%s", id);
        return TALLY_OK;
    }
    self->random_id = true;
    uint8_t r[8];
    if (getrandom(r, sizeof r, 0) != (ssize_t)sizeof r)
        return fail(self, TALLY_E_IO, "getrandom: %s", strerror(errno));
    for (int i = 0; i < 8; i++)
        snprintf(self->producer_id + 2 * i, 3, "%02x", r[i]);
    return TALLY_OK;
}

/* A fresh inbox of this producer's user, _INBOX.<user>.<unique> (libnats' own inboxes are
 * _INBOX.<unique>, outside what the server lets the user read). */
static natsStatus new_inbox(const tally_nats_t *self, char *out, size_t cap)
{
    natsInbox *inbox = NULL;
    natsStatus s = natsInbox_Create(&inbox);
    if (s != NATS_OK)
        return s;
    const char *unique = strrchr((const char *)inbox, '.');
    snprintf(out, cap, "%s%s%s", TALLY_NATS_INBOX, self->user, unique ? unique : ".x");
    natsInbox_Destroy(inbox);
    return NATS_OK;
}

/* The JetStream context with our PubAck handler, the reply inbox, the fleet's numbers. */
static tally_status_t open_fleet(tally_nats_t *self, const tally_nats_opts_t *opts)
{
    jsOptions jo;
    jsOptions_Init(&jo);
    jo.Wait = self->timeout_ms;
    jo.PublishAsync.AckHandler = on_pub_ack;
    jo.PublishAsync.AckHandlerClosure = self;
    jo.PublishAsync.StallWait = self->timeout_ms;
    natsStatus s = natsConnection_JetStream(&self->js, self->nc, &jo);
    if (s == NATS_OK)
        s = new_inbox(self, self->inbox, sizeof self->inbox);
    if (s == NATS_OK)
        s = natsConnection_SubscribeSync(&self->replies, self->nc, self->inbox);
    /* Replies are read by the caller: hold up to 64 MiB of them rather than drop one. */
    if (s == NATS_OK)
        s = natsSubscription_SetPendingLimits(self->replies, -1, 64 << 20);
    if (s != NATS_OK)
        return fail(self, TALLY_E_TRANSPORT, "NATS: %s", natsStatus_GetText(s));
    self->max_payload = (size_t)natsConnection_GetMaxPayload(self->nc);
    if (self->max_payload <= TALLY_NATS_HEADROOM + TALLY_REQ_HEADER_SIZE + 64)
        return fail(self, TALLY_E_ARG, "the server's max_payload (%zu) is too small",
                    self->max_payload);
    if (opts->partitions) {
        if (opts->partitions > TALLY_NATS_MAX_PARTITIONS)
            return fail(self, TALLY_E_ARG, "partitions: 1..%u", TALLY_NATS_MAX_PARTITIONS);
        self->partitions = opts->partitions;
        return TALLY_OK;
    }
    return read_partitions(self);
}

jsCtx *tally__nats_js(tally_nats_t *self)
{
    return self->js;
}

tally_status_t tally_nats_new(const tally_nats_opts_t *opts, tally_nats_t **out, char *msg,
                              size_t msg_cap)
{
    if (!opts || !out)
        return TALLY_E_ARG;
    *out = NULL;
    tally_nats_t *self = calloc(1, sizeof *self);
    if (!self)
        return TALLY_E_NOMEM;
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->cond, NULL);
    self->timeout_ms = opts->timeout_ms > 0 ? opts->timeout_ms : TALLY_DEFAULT_TIMEOUT_MS;
    self->window_bytes = opts->window_bytes ? opts->window_bytes : DEFAULT_WINDOW_BYTES;
    self->next_n = 1;
    tally_status_t st = set_producer_id(self, opts->producer_id);
    if (st == TALLY_OK) {
        tally_nats_conf_t conf = {.servers = opts->servers,
                                  .credentials = opts->credentials,
                                  .nkey = opts->nkey,
                                  .nkey_seed = opts->nkey_seed,
                                  .tls_ca = opts->tls_ca,
                                  .tls_cert = opts->tls_cert,
                                  .tls_key = opts->tls_key,
                                  .user = opts->user,
                                  .name = "tally",
                                  .timeout_ms = self->timeout_ms};
        st =
            tally__nats_user(&conf, self->user, sizeof self->user, self->error, sizeof self->error);
        if (st == TALLY_OK)
            st = tally__nats_connect(&conf, &self->nc, self->error, sizeof self->error);
    }
    if (st == TALLY_OK)
        st = open_fleet(self, opts);
    if (st != TALLY_OK) {
        if (msg && msg_cap)
            snprintf(msg, msg_cap, "%s", self->error);
        tally_nats_destroy(&self);
        return st;
    }
    *out = self;
    return TALLY_OK;
}

void tally_nats_destroy(tally_nats_t **self_p)
{
    tally_nats_t *self = self_p ? *self_p : NULL;
    if (!self)
        return;
    /* jsCtx_Destroy waits for nothing: PubAcks that have not come are dropped with it. The
     * connection is closed before the replies' subscription goes: a reply coming meanwhile
     * would otherwise meet it half destroyed (tally_nats_conn.h, tally__nats_sub_close). */
    if (self->nc)
        natsConnection_Close(self->nc);
    natsSubscription_Destroy(self->replies);
    jsCtx_Destroy(self->js);
    natsConnection_Destroy(self->nc);
    for (size_t i = 0; i < self->retry_len; i++)
        natsMsg_Destroy(self->retry[i]);
    free(self->retry);
    free(self->resent);
    free(self->awaited);
    free(self->scratch);
    pthread_cond_destroy(&self->cond);
    pthread_mutex_destroy(&self->mu);
    free(self);
    *self_p = NULL;
}

natsConnection *tally__nats_conn(tally_nats_t *self)
{
    return self->nc;
}

uint32_t tally_nats_partitions(const tally_nats_t *self)
{
    return self ? self->partitions : 0;
}

size_t tally_nats_max_payload(const tally_nats_t *self)
{
    return self ? self->max_payload : 0;
}

const char *tally_nats_error(const tally_nats_t *self)
{
    return self ? self->error : "";
}

const char *tally_nats_producer_id(const tally_nats_t *self)
{
    return self ? self->producer_id : "";
}

void tally_nats_stats(tally_nats_t *self, tally_nats_stats_t *out)
{
    pthread_mutex_lock(&self->mu);
    *out = self->stats;
    out->pending = self->pending_msgs;
    pthread_mutex_unlock(&self->mu);
}

/* ---- Sending ------------------------------------------------------------------------------- */

/* The largest payload of one message for req: the request fits max_payload and, with a reply,
 * so does the reply (PROTOCOL.md §13 "Validation"); whole elements. 0 for a request whose
 * opcode cannot go to JetStream. */
size_t tally__nats_chunk_limit(const tally_nats_t *self, const tally_req_t *req, bool want_reply)
{
    size_t room = self->max_payload - TALLY_NATS_HEADROOM;
    size_t limit = room - TALLY_REQ_HEADER_SIZE;
    size_t reply_room = room - TALLY_REP_HEADER_SIZE;
    if (want_reply && req->opcode == TALLY_OP_FILTER && reply_room < limit)
        limit = reply_room;
    if (want_reply && req->opcode == TALLY_OP_SCAN) {
        size_t grow = req->flags & TALLY_FLAG_SCAN_OUT_I32 ? 1 : 2;
        if (reply_room / grow < limit)
            limit = reply_room / grow;
    }
    size_t elem = tally_dtype_size((tally_dtype_t)req->dtype);
    return elem ? limit / elem * elem : limit;
}

uint64_t tally__nats_next_id(const tally_nats_t *self)
{
    return self->next_n;
}

static bool awaited_add(tally_nats_t *self, uint64_t n)
{
    if (self->awaited_len == self->awaited_cap) {
        size_t cap = self->awaited_cap ? 2 * self->awaited_cap : 64;
        uint64_t *grown = realloc(self->awaited, cap * sizeof *grown);
        if (!grown)
            return false;
        self->awaited = grown;
        self->awaited_cap = cap;
    }
    self->awaited[self->awaited_len++] = n; /* n only grows: the array stays sorted */
    return true;
}

/* Removes n from the awaited replies; false when it was not awaited (a reply again). */
static bool awaited_take(tally_nats_t *self, uint64_t n)
{
    size_t lo = 0, hi = self->awaited_len;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (self->awaited[mid] < n)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == self->awaited_len || self->awaited[lo] != n)
        return false;
    memmove(self->awaited + lo, self->awaited + lo + 1,
            (self->awaited_len - lo - 1) * sizeof *self->awaited);
    self->awaited_len--;
    return true;
}

/* Builds and publishes one request: wire (its request id set), chunk of clen bytes. */
static tally_status_t publish_one(tally_nats_t *self, const tally_req_t *wire, const void *chunk,
                                  size_t clen, bool want_reply, int64_t deadline)
{
    size_t len = TALLY_REQ_HEADER_SIZE + clen;
    if (len > self->scratch_cap) {
        uint8_t *grown = realloc(self->scratch, len);
        if (!grown)
            return fail(self, TALLY_E_NOMEM, "out of memory");
        self->scratch = grown;
        self->scratch_cap = len;
    }
    tally_req_encode(wire, self->scratch);
    if (clen)
        memcpy(self->scratch + TALLY_REQ_HEADER_SIZE, chunk, clen);
    char subject[32 + TALLY_NATS_MEMBER_ID_MAX], id[TALLY_NATS_MSG_ID_MAX + 1];
    uint32_t k = wire->stream_len
                     ? tally_partition(wire->stream, wire->stream_len, self->partitions)
                     : self->round_robin++ % self->partitions;
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_IN, k, self->user);
    /* The dedupe id in this user's namespace (the worker refuses one outside it). */
    snprintf(id, sizeof id, "%s.%s.%llu", self->user, self->producer_id,
             (unsigned long long)wire->request_id);
    natsMsg *m = NULL;
    natsStatus s = natsMsg_Create(&m, subject, NULL, (const char *)self->scratch, (int)len);
    uint32_t slot = s == NATS_OK ? order_slot(m) : NO_ORDER;
    tally_status_t st = s == NATS_OK ? wait_acks(self, len, slot, deadline) : TALLY_OK;
    if (st != TALLY_OK) {
        natsMsg_Destroy(m);
        return st;
    }
    if (s == NATS_OK)
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_MSG_ID, id);
    if (s == NATS_OK && want_reply)
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_REPLY, self->inbox);
    if (s == NATS_OK && want_reply && !awaited_add(self, wire->request_id))
        s = NATS_NO_MEMORY;
    if (s != NATS_OK) {
        natsMsg_Destroy(m);
        return fail(self, TALLY_E_NOMEM, "message: %s", natsStatus_GetText(s));
    }
    pthread_mutex_lock(&self->mu);
    self->pending_bytes += len;
    self->pending_msgs++;
    if (slot != NO_ORDER)
        self->order[slot]++;
    self->stats.sent++;
    pthread_mutex_unlock(&self->mu);
    s = publish(self, &m);
    if (s != NATS_OK) { /* not taken: it waits on the retry list like a failed one */
        jsPubAckErr pae = {.Msg = m, .Err = s, .ErrText = natsStatus_GetText(s)};
        on_pub_ack(self->js, m, NULL, &pae, self);
    }
    return TALLY_OK;
}

/* Checks what tally_nats_send is given; the chunk size in *chunk and the count in *chunks. */
static tally_status_t check_send(tally_nats_t *self, const tally_req_t *req, size_t len,
                                 bool want_reply, size_t *chunk, uint64_t *chunks)
{
    uint8_t op = req->opcode;
    if (op != TALLY_OP_FILTER && op != TALLY_OP_SCAN && op != TALLY_OP_HIST &&
        op != TALLY_OP_RESET && op != TALLY_OP_DELETE)
        return fail(self, TALLY_E_ARG,
                    "%s cannot be published to a partition: only filter, scan, hist, reset, "
                    "delete",
                    tally_op_name((tally_op_t)op) ? tally_op_name((tally_op_t)op) : "opcode");
    if (req->flags & TALLY_FLAG_SHM_REF)
        return fail(self, TALLY_E_ARG, "shared-memory references do not travel over NATS");
    *chunk = tally__nats_chunk_limit(self, req, want_reply);
    *chunks = len ? (len + *chunk - 1) / *chunk : 1;
    if (*chunks > 1 && op == TALLY_OP_SCAN && req->stream_len == 0)
        return fail(self, TALLY_E_ARG,
                    "a scan without a stream over %zu bytes cannot be split (each part would "
                    "start at 0): name a stream, or send smaller batches",
                    *chunk);
    if (req->seq && req->seq + *chunks - 1 < req->seq)
        return fail(self, TALLY_E_ARG, "seq overflows over %llu chunks",
                    (unsigned long long)*chunks);
    return TALLY_OK;
}

tally_status_t tally_nats_send(tally_nats_t *self, const tally_req_t *req, const void *payload,
                               size_t len, bool want_reply, uint64_t *first_id, uint64_t *chunks)
{
    if (!self || !req || (len && !payload))
        return TALLY_E_ARG;
    size_t chunk = 0;
    uint64_t count = 0;
    tally_status_t st = check_send(self, req, len, want_reply, &chunk, &count);
    if (st != TALLY_OK)
        return st;
    /* Every chunk is checked before any is sent, so a bad request sends nothing. */
    tally_req_t wire = *req;
    wire.version = TALLY_PROTO_VERSION;
    for (uint64_t i = 0; i < count; i++) {
        size_t clen = len - i * chunk < chunk ? len - i * chunk : chunk;
        st = tally_req_validate(&wire, clen, SIZE_MAX, self->error, sizeof self->error);
        if (st != TALLY_OK)
            return st;
    }
    if (first_id)
        *first_id = self->next_n;
    if (chunks)
        *chunks = count;
    int64_t deadline = now_ms() + self->timeout_ms;
    for (uint64_t i = 0; i < count; i++) {
        size_t off = i * chunk, clen = len - off < chunk ? len - off : chunk;
        wire.request_id = self->next_n; /* used up only by a message that goes out */
        wire.seq = req->seq ? req->seq + i : 0;
        st = publish_one(self, &wire, (const uint8_t *)payload + off, clen, want_reply, deadline);
        if (st != TALLY_OK)
            return st;
        self->next_n++;
    }
    return TALLY_OK;
}

tally_status_t tally_nats_flush(tally_nats_t *self)
{
    if (!self)
        return TALLY_E_ARG;
    return wait_acks(self, 0, NO_ORDER, now_ms() + self->timeout_ms);
}

/* ---- Replies -------------------------------------------------------------------------------- */

static void free_nats_msg(void *data, void *hint)
{
    (void)data;
    natsMsg_Destroy(hint);
}

/* The request number n of a reply's Tally-Msg-Id when it is one of ours, else 0. */
static uint64_t reply_number(const tally_nats_t *self, natsMsg *m)
{
    const char *id = NULL;
    if (natsMsgHeader_Get(m, TALLY_NATS_HDR_REPLY_ID, &id) != NATS_OK || !id)
        return 0;
    size_t ulen = strlen(self->user), plen = strlen(self->producer_id);
    if (strncmp(id, self->user, ulen) != 0 || id[ulen] != '.' ||
        strncmp(id + ulen + 1, self->producer_id, plen) != 0 || id[ulen + 1 + plen] != '.')
        return 0;
    return strtoull(id + ulen + 1 + plen + 1, NULL, 10); /* n: a renamed id's tail follows */
}

/* Fills reply from a reply message (taking it). */
static tally_status_t decode_nats_reply(tally_nats_t *self, natsMsg *m, tally_reply_t *reply)
{
    const uint8_t *data = (const uint8_t *)natsMsg_GetData(m);
    size_t len = msg_bytes(m);
    if (len < TALLY_REP_HEADER_SIZE ||
        tally_rep_decode(data, TALLY_REP_HEADER_SIZE, &reply->rep) != TALLY_OK) {
        natsMsg_Destroy(m);
        snprintf(reply->error, sizeof reply->error, "undecodable reply (%zu bytes)", len);
        return fail(self, TALLY_E_REPLY, "%s", reply->error);
    }
    const uint8_t *payload = data + TALLY_REP_HEADER_SIZE;
    size_t plen = len - TALLY_REP_HEADER_SIZE;
    if (reply->rep.status != TALLY_OK) {
        size_t n = plen < TALLY_ERROR_MESSAGE_MAX ? plen : TALLY_ERROR_MESSAGE_MAX;
        memcpy(reply->error, payload, n);
        reply->error[n] = 0;
        natsMsg_Destroy(m);
        return fail(self, (tally_status_t)reply->rep.status, "%s", reply->error);
    }
    zmq_msg_t *frame = plen ? malloc(sizeof *frame) : NULL;
    if (plen && (!frame || zmq_msg_init_data(frame, (void *)payload, plen, free_nats_msg, m))) {
        free(frame);
        natsMsg_Destroy(m);
        return fail(self, TALLY_E_NOMEM, "out of memory");
    }
    if (!plen)
        natsMsg_Destroy(m);
    reply->msg_ = frame; /* tally_reply_clear closes it, which destroys the NATS message */
    reply->payload = plen ? payload : NULL;
    reply->len = plen;
    return TALLY_OK;
}

tally_status_t tally_nats_recv(tally_nats_t *self, int timeout_ms, tally_reply_t *reply)
{
    if (!self || !reply)
        return TALLY_E_ARG;
    tally_reply_clear(reply);
    int64_t deadline = now_ms() + (timeout_ms > 0 ? timeout_ms : self->timeout_ms);
    for (;;) {
        int64_t left = deadline - now_ms();
        natsMsg *m = NULL;
        natsStatus s = left > 0 ? natsSubscription_NextMsg(&m, self->replies, left) : NATS_TIMEOUT;
        if (s == NATS_TIMEOUT) {
            snprintf(reply->error, sizeof reply->error, "no reply within %d ms",
                     timeout_ms > 0 ? timeout_ms : self->timeout_ms);
            return fail(self, TALLY_E_TIMEOUT, "%s", reply->error);
        }
        if (s != NATS_OK) {
            snprintf(reply->error, sizeof reply->error, "receive: %s", natsStatus_GetText(s));
            return fail(self, TALLY_E_TRANSPORT, "%s", reply->error);
        }
        uint64_t n = reply_number(self, m);
        if (n && awaited_take(self, n))
            return decode_nats_reply(self, m, reply);
        pthread_mutex_lock(&self->mu);
        self->stats.replies_dropped++; /* answered before, or not ours */
        pthread_mutex_unlock(&self->mu);
        natsMsg_Destroy(m);
    }
}

/* ---- Request-reply: queries, control, streams (PROTOCOL.md §13 "Answers by request-reply") -- */

/* True when the server's last error on the connection was a permissions violation for
 * publishing to subject (it drops such a message and says so only as an asynchronous error);
 * the producer's error then says so. */
static bool refused_publish(tally_nats_t *self, const char *subject)
{
    const char *text = NULL;
    if (natsConnection_GetLastError(self->nc, &text) != NATS_NOT_PERMITTED || !text)
        return false;
    const char *at = strstr(text, subject);
    if (!at || !strstr(text, "Publish") || (at[strlen(subject)] != '"' && at[strlen(subject)]))
        return false;
    fail(self, TALLY_E_TRANSPORT,
         "the NATS server refused to let user %s publish to %s (its permissions: PROTOCOL.md "
         "§13 \"Security\")",
         self->user, subject);
    return true;
}

/* The request in scratch (total bytes) with the header Tally-Stale-Ok: a standby's copy may
 * answer it (PROTOCOL.md §13 "Answers by request-reply"). */
static natsStatus request_stale_ok(tally_nats_t *self, const char *subject, size_t total,
                                   int64_t wait_ms, natsMsg **out)
{
    natsMsg *m = NULL;
    natsStatus s = natsMsg_Create(&m, subject, NULL, (const char *)self->scratch, (int)total);
    if (s == NATS_OK)
        s = natsMsgHeader_Set(m, TALLY_NATS_HDR_STALE_OK, "1");
    if (s == NATS_OK)
        s = natsConnection_RequestMsg(out, self->nc, m, wait_ms);
    natsMsg_Destroy(m);
    return s;
}

/* Sends the frame of req (and payload) to subject and waits for the answer, asking again while
 * nobody answers (a partition between two owners) until the timeout. The raw answer in *out. */
static tally_status_t request(tally_nats_t *self, const char *subject, const tally_req_t *req,
                              const void *payload, size_t len, natsMsg **out)
{
    size_t total = TALLY_REQ_HEADER_SIZE + len;
    if (total > self->scratch_cap) {
        uint8_t *grown = realloc(self->scratch, total);
        if (!grown)
            return fail(self, TALLY_E_NOMEM, "out of memory");
        self->scratch = grown;
        self->scratch_cap = total;
    }
    tally_req_t wire = *req;
    wire.version = TALLY_PROTO_VERSION;
    wire.request_id = self->next_n++;
    tally_req_encode(&wire, self->scratch);
    if (len)
        memcpy(self->scratch + TALLY_REQ_HEADER_SIZE, payload, len);
    int64_t deadline = now_ms() + self->timeout_ms;
    for (;;) {
        int64_t left = deadline - now_ms();
        natsStatus s = left <= 0        ? NATS_TIMEOUT
                       : self->stale_ok ? request_stale_ok(self, subject, total, left, out)
                                        : natsConnection_Request(out, self->nc, subject,
                                                                 self->scratch, (int)total, left);
        if (s == NATS_OK)
            return TALLY_OK;
        if (s == NATS_NO_RESPONDERS && left > 100) {
            nats_Sleep(100); /* no owner right now: a take-over is under way */
            continue;
        }
        if (s == NATS_TIMEOUT && refused_publish(self, subject))
            return TALLY_E_TRANSPORT;
        if (s == NATS_TIMEOUT || s == NATS_NO_RESPONDERS)
            return fail(self, TALLY_E_TIMEOUT, "no answer on %s within %d ms (no worker owns it?)",
                        subject, self->timeout_ms);
        return fail(self, TALLY_E_TRANSPORT, "request on %s: %s", subject, natsStatus_GetText(s));
    }
}

tally_status_t tally_nats_call(tally_nats_t *self, const tally_req_t *req, const void *payload,
                               size_t len, tally_reply_t *reply)
{
    if (!self || !req || !reply || (len && !payload))
        return TALLY_E_ARG;
    tally_reply_clear(reply);
    char subject[48 + TALLY_NATS_MEMBER_ID_MAX];
    if (req->opcode == TALLY_OP_QUERY && req->stream_len)
        tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_QUERY,
                            tally_partition(req->stream, req->stream_len, self->partitions),
                            self->user);
    else if (req->opcode == TALLY_OP_PING || req->opcode == TALLY_OP_INFO ||
             req->opcode == TALLY_OP_STATS)
        tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_CTL, -1, self->user);
    else
        return fail(self, TALLY_E_ARG,
                    "only query (with a stream), ping, info and stats are answered this way");
    natsMsg *m = NULL;
    tally_status_t st = request(self, subject, req, payload, len, &m);
    if (st != TALLY_OK) {
        snprintf(reply->error, sizeof reply->error, "%s", self->error);
        return st;
    }
    return decode_nats_reply(self, m, reply);
}

tally_status_t tally__nats_ask(tally_nats_t *self, const char *prefix, const char *stream,
                               bool stale_ok, tally_reply_t *reply, uint64_t *stale)
{
    tally_req_t req;
    memset(&req, 0, sizeof req);
    req.opcode = TALLY_OP_QUERY;
    if (tally_req_set_stream(&req, stream) != TALLY_OK)
        return fail(self, TALLY_E_STREAM_NAME, "invalid stream name '%s'", stream);
    char subject[48 + TALLY_NATS_MEMBER_ID_MAX];
    tally_fleet_subject(subject, sizeof subject, prefix,
                        tally_partition(req.stream, req.stream_len, self->partitions), self->user);
    natsMsg *m = NULL;
    self->stale_ok = stale_ok;
    tally_status_t st = request(self, subject, &req, NULL, 0, &m);
    self->stale_ok = false;
    if (st != TALLY_OK)
        return st;
    const char *v = NULL; /* a copy's answer is stale however little it holds: 1 at least */
    if (natsMsgHeader_Get(m, TALLY_NATS_HDR_STALE, &v) != NATS_OK)
        v = NULL;
    *stale = v ? (strtoull(v, NULL, 10) ? strtoull(v, NULL, 10) : 1) : 0;
    return decode_nats_reply(self, m, reply);
}

/* Publishes a `streams` request and gathers answers until they cover every partition, or the
 * timeout; from workers whose answers say nothing of their partitions (older ones), until as
 * many members have answered as the answers say are live (the most any says). */
static tally_status_t gather_streams(tally_nats_t *self, natsSubscription *sub, const char *inbox,
                                     char ***names, size_t *count)
{
    tally_req_t req;
    memset(&req, 0, sizeof req);
    req.version = TALLY_PROTO_VERSION;
    req.opcode = TALLY_OP_STREAMS;
    req.request_id = self->next_n++;
    uint8_t frame[TALLY_REQ_HEADER_SIZE];
    tally_req_encode(&req, frame);
    size_t members = 0, answered = 0, cap = 0;
    bool covered[TALLY_NATS_MAX_PARTITIONS] = {false}; /* by the answers' Tally-Owned */
    int ncovered = 0;
    char subject[32 + TALLY_NATS_MEMBER_ID_MAX];
    tally_fleet_subject(subject, sizeof subject, TALLY_NATS_SUBJ_STREAMS, -1, self->user);
    natsStatus s =
        natsConnection_PublishRequest(self->nc, subject, inbox, frame, (int)sizeof frame);
    if (s != NATS_OK)
        return fail(self, TALLY_E_TRANSPORT, "streams: %s", natsStatus_GetText(s));
    int64_t deadline = now_ms() + self->timeout_ms;
    tally_status_t st = TALLY_OK;
    while (st == TALLY_OK && ncovered < (int)self->partitions &&
           (ncovered > 0 || members == 0 || answered < members)) {
        int64_t left = deadline - now_ms();
        natsMsg *m = NULL;
        if (left <= 0 || natsSubscription_NextMsg(&m, sub, left) != NATS_OK)
            break; /* those that answered are what there is */
        tally_rep_t rep;
        if (natsMsg_GetDataLength(m) >= TALLY_REP_HEADER_SIZE &&
            tally_rep_decode((const uint8_t *)natsMsg_GetData(m), TALLY_REP_HEADER_SIZE, &rep) ==
                TALLY_OK &&
            rep.status == TALLY_OK) {
            st = tally__nats_merge_names(m, names, count, &cap);
            const char *owned = NULL; /* an older worker's answer covers none: not known whole */
            natsMsgHeader_Get(m, TALLY_NATS_HDR_OWNED, &owned);
            int fresh = tally_fleet_owned_merge(owned, self->partitions, covered);
            ncovered += fresh > 0 ? fresh : 0;
            answered++;
            const char *v = NULL; /* the live members (Tally-Members): no KV rights needed */
            size_t said = natsMsgHeader_Get(m, TALLY_NATS_HDR_MEMBERS, &v) == NATS_OK && v
                              ? strtoul(v, NULL, 10)
                              : 0;
            members = said > members && said < 100000 ? said : members;
        }
        natsMsg_Destroy(m);
    }
    self->streams_missing = self->partitions - (uint32_t)ncovered;
    if (st == TALLY_OK && answered == 0 && refused_publish(self, subject))
        st = TALLY_E_TRANSPORT;
    if (st == TALLY_OK && answered == 0)
        st = fail(self, TALLY_E_TIMEOUT, "no worker answered within %d ms", self->timeout_ms);
    return st;
}

uint32_t tally_nats_streams_missing(const tally_nats_t *self)
{
    return self ? self->streams_missing : 0;
}

tally_status_t tally_nats_streams(tally_nats_t *self, char ***names, size_t *count)
{
    if (!self || !names || !count)
        return TALLY_E_ARG;
    *names = NULL;
    *count = 0;
    char inbox[160];
    natsSubscription *sub = NULL;
    natsStatus s = new_inbox(self, inbox, sizeof inbox);
    if (s == NATS_OK)
        s = natsConnection_SubscribeSync(&sub, self->nc, inbox);
    tally_status_t st = s == NATS_OK
                            ? gather_streams(self, sub, inbox, names, count)
                            : fail(self, TALLY_E_TRANSPORT, "streams: %s", natsStatus_GetText(s));
    tally__nats_sub_close(self->nc, &sub); /* more answers may be coming */
    if (st != TALLY_OK) {
        tally_strings_free(*names, *count);
        *names = NULL;
        *count = 0;
    }
    return st;
}
