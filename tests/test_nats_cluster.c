/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_nats_cluster.c — the test cluster helper (tests/lib/nats_cluster.c) itself: a 3-node
 * JetStream cluster starts on ports chosen at run time and takes an R3 stream; a duplicate
 * publish (same Nats-Msg-Id) is deduplicated; after kill -9 of a node a publish with a retried
 * id still lands exactly once, and the node restarts and catches up; stop leaves no server
 * running and no scratch directory; a test process that crashes takes its servers with it.
 */
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <nats/nats.h>

#include "harness.h"
#include "nats_cluster.h"

/* False once pid has exited (a zombie not yet reaped by its new parent counts as exited). */
static bool process_running(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    char *stat = th_slurp(path);
    if (!stat)
        return false;
    const char *end = strrchr(stat, ')');
    bool running = end && end[1] == ' ' && end[2] != 'Z' && end[2] != 'X';
    free(stat);
    return running;
}

/* Publishes data with msg id `id` until a PubAck comes (a lost PubAck is retried with the same
 * id, as a producer must); *duplicate says whether the stream had it already. */
static int publish_once(jsCtx *js, const char *subject, const char *id, bool *duplicate)
{
    for (int attempt = 0; attempt < 100; attempt++) {
        jsPubOptions po;
        jsPubOptions_Init(&po);
        po.MsgId = id;
        po.MaxWait = 2000;
        jsPubAck *ack = NULL;
        jsErrCode jerr = 0;
        natsStatus s = js_Publish(&ack, js, subject, "x", 1, &po, &jerr);
        if (s == NATS_OK) {
            *duplicate = ack->Duplicate;
            jsPubAck_Destroy(ack);
            return 0;
        }
        th_sleep_ms(200);
    }
    return -1;
}

static void test_cluster_lifecycle(void **state)
{
    (void)state;
    tn_cluster_t c;
    int64_t t0 = th_now_ms();
    assert_int_equal(tn_cluster_start(&c, 3, NULL, 30000), 0);
    print_message("3-node cluster ready in %lld ms on %s\n", (long long)(th_now_ms() - t0), c.urls);

    natsConnection *nc = NULL;
    jsCtx *js = NULL;
    assert_int_equal(tn_connect(&c, &nc, &js), 0);
    jsStreamConfig sc;
    jsStreamConfig_Init(&sc);
    sc.Name = "SMOKE";
    sc.Subjects = (const char *[]){"smoke.>"};
    sc.SubjectsLen = 1;
    sc.Replicas = 3;
    jsStreamInfo *si = NULL;
    jsErrCode jerr = 0;
    natsStatus s = NATS_ERR;
    for (int i = 0; i < 50 && s != NATS_OK; i++) { /* the 3 peers may still be registering */
        s = js_AddStream(&si, js, &sc, NULL, &jerr);
        if (s != NATS_OK)
            th_sleep_ms(100);
    }
    assert_int_equal(s, NATS_OK);
    jsStreamInfo_Destroy(si);

    bool dup = true;
    assert_int_equal(publish_once(js, "smoke.a", "id-1", &dup), 0);
    assert_false(dup);
    assert_int_equal(publish_once(js, "smoke.a", "id-1", &dup), 0);
    assert_true(dup);

    /* kill -9 a node: the stream keeps a quorum of 2; the retried publish lands once. */
    pid_t killed = c.node[0].pid;
    assert_int_equal(tn_node_kill(&c, 0, SIGKILL), 0);
    assert_int_equal(kill(killed, 0), -1);
    assert_int_equal(publish_once(js, "smoke.a", "id-2", &dup), 0);
    assert_false(dup);
    assert_int_equal(tn_node_restart(&c, 0, 30000), 0);
    assert_int_equal(publish_once(js, "smoke.a", "id-2", &dup), 0);
    assert_true(dup);
    assert_int_equal(js_GetStreamInfo(&si, js, "SMOKE", NULL, &jerr), NATS_OK);
    assert_int_equal(si->State.Msgs, 2);
    jsStreamInfo_Destroy(si);

    jsCtx_Destroy(js);
    natsConnection_Destroy(nc);
    pid_t pids[3] = {c.node[0].pid, c.node[1].pid, c.node[2].pid};
    char dir[256];
    snprintf(dir, sizeof dir, "%s", c.dir);
    tn_cluster_stop(&c);
    for (int i = 0; i < 3; i++)
        assert_false(process_running(pids[i]));
    struct stat st;
    assert_int_equal(stat(dir, &st), -1);
    tn_cluster_stop(&c); /* twice is harmless */
}

/* A test process that crashes while its cluster runs: the servers go with it. */
static void test_no_orphans(void **state)
{
    (void)state;
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    pid_t child = fork();
    assert_true(child >= 0);
    if (child == 0) {
        close(fds[0]);
        tn_cluster_t c;
        if (tn_cluster_start(&c, 1, NULL, 30000) != 0)
            _exit(2);
        ssize_t w = write(fds[1], &c, sizeof c);
        (void)w;
        signal(SIGABRT, SIG_DFL);
        abort();
    }
    close(fds[1]);
    tn_cluster_t c;
    assert_int_equal(read(fds[0], &c, sizeof c), (ssize_t)sizeof c);
    close(fds[0]);
    pid_t server = c.node[0].pid;
    int status;
    assert_int_equal(waitpid(child, &status, 0), child);
    assert_true(WIFSIGNALED(status));
    /* The server was the crashed child's child: it is reparented and killed by PDEATHSIG. */
    bool gone = false;
    for (int i = 0; i < 500 && !gone; i++) {
        gone = !process_running(server);
        if (!gone)
            th_sleep_ms(10);
    }
    th_rmrf(c.dir);
    assert_true(gone);
}

int main(void)
{
    if (tn_skip())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cluster_lifecycle),
        cmocka_unit_test(test_no_orphans),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    nats_Close(); /* libnats' threads and globals: gone before the leak check */
    return failed;
}
