/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_start_failures.c — an endpoint tallyd cannot have at start (issue 37: the start-failure
 * cleanup of each), against the real tallyd: the metrics port, the PUB endpoint and the request
 * endpoint held by another socket, an ipc:// endpoint in a directory that does not exist, and
 * --backend cuda with no GPU to be had.
 * Each time tallyd exits 1 (start-up failed, tallyd(8)) saying which endpoint and why, after
 * taking down what it had made before (the ASan build's leak check runs at that exit), and never
 * says it is ready.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "harness.h"

static char dir[64];

static int make_dir(void **state)
{
    (void)state;
    return th_tmpdir(dir, sizeof dir, "tally-start-failures");
}

static int remove_dir(void **state)
{
    (void)state;
    return th_rmrf(dir);
}

/* A listening TCP socket on a loopback port of its own: the descriptor; its port in *port. */
static int hold_port(int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(fd, 1), 0);
    socklen_t len = sizeof a;
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    *port = ntohs(a.sin_port);
    return fd;
}

/* tallyd with `option value` must exit 1 saying `want`. Unless option is --bind, the request
 * endpoint is an ipc:// path in this test's own directory (th_run_refused). */
static void refused(const char *option, const char *value, const char *want)
{
    char log[128];
    const char *args[] = {option, value, NULL};
    int status = th_run_refused(dir, args, log, sizeof log, 20000);
    assert_true(th_file_contains(log, want));
    assert_int_equal(status, 1);
    th_daemon_t d = {0};
    snprintf(d.log_path, sizeof d.log_path, "%s", log);
    assert_false(th_daemon_log_contains(&d, "ready:"));
}

/* tallyd with `option` on a loopback port another socket listens on (a tcp:// endpoint, or
 * IP:PORT unless tcp) must exit 1 saying `said` and that address. */
static void refused_on_taken_port(const char *option, bool tcp, const char *said)
{
    int port, holder = hold_port(&port);
    char at[64], want[160];
    snprintf(at, sizeof at, "%s127.0.0.1:%d", tcp ? "tcp://" : "", port);
    snprintf(want, sizeof want, "%s%s", said, at);
    refused(option, at, want);
    close(holder);
}

static void test_metrics_port_taken(void **state)
{
    (void)state;
    refused_on_taken_port("--metrics", false, "metrics: cannot listen on ");
}

static void test_pub_endpoint_taken(void **state)
{
    (void)state;
    refused_on_taken_port("--pub", true, "cannot bind the PUB socket to ");
}

static void test_request_endpoint_taken(void **state)
{
    (void)state;
    refused_on_taken_port("--bind", true, "cannot bind ");
    char at[128], want[160];
    /* An ipc:// endpoint whose directory does not exist. */
    snprintf(at, sizeof at, "ipc://%s/none/tallyd.sock", dir);
    snprintf(want, sizeof want, "cannot bind %s", at);
    refused("--bind", at, want);
}

/* --backend cuda where no GPU can be used (none visible to CUDA, or a build without CUDA): no
 * usable backend, so tallyd exits 1 saying why (tallyd(8) EXIT STATUS) instead of serving on
 * the CPU as --backend auto would. */
static void test_backend_cuda_without_gpu(void **state)
{
    (void)state;
    const char *was = getenv("CUDA_VISIBLE_DEVICES");
    char *saved = was ? strdup(was) : NULL;
    setenv("CUDA_VISIBLE_DEVICES", "", 1);
    refused("--backend", "cuda", "--backend cuda: no usable GPU: ");
    if (saved)
        setenv("CUDA_VISIBLE_DEVICES", saved, 1);
    else
        unsetenv("CUDA_VISIBLE_DEVICES");
    free(saved);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_metrics_port_taken),
        cmocka_unit_test(test_pub_endpoint_taken),
        cmocka_unit_test(test_request_endpoint_taken),
        cmocka_unit_test(test_backend_cuda_without_gpu),
    };
    return cmocka_run_group_tests(tests, make_dir, remove_dir);
}
