/* SPDX-License-Identifier: Apache-2.0 */
/* fleet_helpers.c — see fleet_helpers.h. */
#include "fleet_helpers.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <nats/nats.h>

#include "nats_cluster.h"
#include "reference.h"
#include "stream_check.h"
#include "tally_fleet.h"
#include "td_fleet_plan.h"

int tf_worker_start(th_daemon_t *d, const char *id, uint32_t partitions, const char *const *extra)
{
    char count[16];
    snprintf(count, sizeof count, "%u", (unsigned)partitions);
    const char *args[] = {"--nats-servers",
                          tn_suite.urls,
                          "--nats-replicas",
                          "3",
                          "--nats-partitions",
                          count,
                          "--nats-member-id",
                          id,
                          "--window-intervals",
                          "0",
                          NULL};
    return th_daemon_start_with(d, args, extra);
}

void tf_fresh(const tf_fleet_t *f)
{
    tn_fleet_delete(tn_suite_js, f->partitions);
    memset(f->bins, 0, (size_t)f->streams * sizeof f->bins[0]);
    memset(f->seqs, 0, (size_t)f->streams * sizeof f->seqs[0]);
}

void tf_stream_name(const tf_fleet_t *f, int s, char *out, size_t cap)
{
    snprintf(out, cap, "%s/%d", f->prefix, s);
}

uint32_t tf_partition_of(const tf_fleet_t *f, int s)
{
    char name[32];
    tf_stream_name(f, s, name, sizeof name);
    return tally_partition(name, strlen(name), f->partitions);
}

size_t tf_batch(int s, int r, uint8_t *out)
{
    size_t n = 200 + (size_t)(s * 7 + r * 13) % 300;
    for (size_t j = 0; j < n; j++)
        out[j] = (uint8_t)(s * 31 + r * 7 + j * 13 + (j >> 3));
    return n;
}

void tf_send_hist(const tf_fleet_t *f, tally_client_t *c, int s, int r)
{
    uint8_t data[TF_BATCH_MAX];
    size_t n = tf_batch(s, r, data);
    char name[32];
    tf_stream_name(f, s, name, sizeof name);
    tally_req_t req = th_req(TALLY_OP_HIST, TALLY_DTYPE_U8, 0);
    assert_int_equal(tally_req_set_stream(&req, name), TALLY_OK);
    req.seq = ++f->seqs[s];
    tally_status_t st = tally_send(c, &req, data, n, NULL);
    if (st != TALLY_OK)
        fail_msg("send to %s: %s: %s", name, tally_status_name(st), tally_client_error(c));
    tr_hist_parts(TALLY_DTYPE_U8, data, n, 0, 0, f->bins[s], NULL, NULL);
}

void tf_recv_applied(tally_client_t *c)
{
    tally_reply_t r;
    tally_reply_init(&r);
    tally_status_t st = tally_recv(c, &r);
    if (st != TALLY_OK && st != TALLY_E_DUPLICATE)
        fail_msg("reply: %s: %s", tally_status_name(st), r.error);
    tally_reply_clear(&r);
}

void tf_check_stream(const tf_fleet_t *f, tally_client_t *c, int s)
{
    char name[32], why[160];
    tf_stream_name(f, s, name, sizeof name);
    if (th_stream_differs(c, name, f->seqs[s], f->bins[s], why, sizeof why)) {
        tf_dump_logs(f);
        fail_msg("%s", why);
    }
}

void tf_check_model(const tf_fleet_t *f, tally_client_t *c)
{
    for (int s = 0; s < f->streams; s++)
        tf_check_stream(f, c, s);
}

tally_client_t *tf_fleet_client(const char *servers, int timeout_ms)
{
    tally_nats_opts_t o = {.servers = servers, .timeout_ms = timeout_ms};
    tally_client_t *c = NULL;
    char why[512];
    tally_status_t st = tally_client_new_fleet(&o, &c, why, sizeof why);
    if (st != TALLY_OK)
        fail_msg("tally_client_new_fleet: %s: %s", tally_status_name(st), why);
    return c;
}

void tf_members_end(const tf_fleet_t *f)
{
    for (int i = 0; i < f->members; i++)
        th_daemon_end(&f->member[i]);
}

void tf_dump_logs(const tf_fleet_t *f)
{
    for (int i = 0; i < f->members; i++) {
        if (!f->member[i].log_path[0])
            continue;
        if (th_sh("echo '--- %s' >&2; grep -v '<7>' %s | tail -40 >&2", f->ids[i],
                  f->member[i].log_path) != 0) /* a report only: nothing to do but say so */
            fprintf(stderr, "(could not show %s)\n", f->member[i].log_path);
    }
}

int tf_planned(const tf_fleet_t *f, int i)
{
    int n = 0;
    for (uint32_t k = 0; k < f->partitions; k++)
        n += td_fleet_owner(f->ids, (size_t)f->members, k) == i;
    return n;
}

void tf_wait_held(const tf_fleet_t *f, const char *id, int count, int timeout_ms)
{
    int held = 0;
    if (tn_wait_leases(tn_suite_js, f->partitions, id, count, timeout_ms, &held) >= 0)
        return;
    tf_dump_logs(f);
    fail_msg("%s holds %d partitions, not %d", id, held, count);
}

uint64_t tf_changelog_last(jsCtx *js, uint32_t k)
{
    char cl[32];
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    tally_fleet_name(cl, sizeof cl, TALLY_NATS_CL_STREAM_PREFIX, k);
    assert_int_equal(js_GetStreamInfo(&si, js, cl, NULL, &jerr), NATS_OK);
    uint64_t last = si->State.LastSeq;
    jsStreamInfo_Destroy(si);
    return last;
}

td_ckpt_manifest_t tf_manifest(uint32_t k)
{
    td_ckpt_manifest_t m;
    uint8_t *st = NULL;
    size_t len = 0;
    char why[512];
    if (td_ckpt_read(tn_suite_js, k, &m, &st, &len, why, sizeof why) != TD_OK)
        fail_msg("partition %u's checkpoint: %s", (unsigned)k, why);
    free(st);
    return m;
}
