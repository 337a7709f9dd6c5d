/* SPDX-License-Identifier: Apache-2.0 */
/*
 * zmq_close_leak.c — libzmq on its own losing a received message at a socket's close (the
 * evidence behind tests/lsan/libzmq.supp; bench/NOTES.md, "Stops under ASan").
 *
 * A ROUTER bound on 127.0.0.1:PORT reads messages from four DEALER threads that send
 * [128-byte frame][1 MiB frame] as fast as they can and never read, answers each with 2 KiB,
 * closes every message it received, and after READS messages closes the socket (linger LINGER
 * ms) and terminates its context while the producers are still sending. Built with
 * -fsanitize=address, LeakSanitizer reports at exit, in most runs, the 18,160-byte receive buffer
 * of a libzmq I/O thread (allocated in the decoder, never freed): a message libzmq received and
 * dropped without closing. Nothing here allocates or holds a message that it does not close.
 *
 *   cc -fsanitize=address -g zmq_close_leak.c -o zmq_close_leak -lzmq -lpthread
 *   ./zmq_close_leak PORT [READS] [LINGER]      (scripts/zmq-close-leak.sh runs it 10 times)
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#define PRODUCERS 4

static char endpoint[64];
static atomic_bool stop;

static void *producer(void *arg)
{
    (void)arg;
    static char header[128], body[1 << 20];
    void *ctx = zmq_ctx_new();
    void *dealer = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0, timeout = 100;
    zmq_setsockopt(dealer, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(dealer, ZMQ_SNDTIMEO, &timeout, sizeof timeout);
    zmq_connect(dealer, endpoint);
    while (!atomic_load(&stop))
        if (zmq_send(dealer, header, sizeof header, ZMQ_SNDMORE) >= 0)
            zmq_send(dealer, body, sizeof body, 0);
    zmq_close(dealer);
    zmq_ctx_term(ctx);
    return NULL;
}

/* One message: its routing id (kept for the reply), its frames read and closed. */
static void answer_one(void *router)
{
    static char reply[2048];
    zmq_msg_t id, frame;
    zmq_msg_init(&id);
    zmq_msg_init(&frame);
    if (zmq_msg_recv(&id, router, 0) < 0)
        goto done;
    for (int more = zmq_msg_more(&id); more; more = zmq_msg_more(&frame))
        if (zmq_msg_recv(&frame, router, 0) < 0)
            goto done;
    if (zmq_msg_send(&id, router, ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0)
        zmq_send(router, reply, sizeof reply, ZMQ_DONTWAIT);
done:
    zmq_msg_close(&frame);
    zmq_msg_close(&id);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s PORT [READS] [LINGER_MS]\n", argv[0]);
        return 2;
    }
    int reads = argc > 2 ? atoi(argv[2]) : 700, linger = argc > 3 ? atoi(argv[3]) : 1000;
    snprintf(endpoint, sizeof endpoint, "tcp://127.0.0.1:%s", argv[1]);
    void *ctx = zmq_ctx_new();
    zmq_ctx_set(ctx, ZMQ_IO_THREADS, 2);
    void *router = zmq_socket(ctx, ZMQ_ROUTER);
    int hwm = 64, one = 1; /* as tallyd's ROUTER */
    zmq_setsockopt(router, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(router, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    if (zmq_bind(router, endpoint) != 0) {
        perror("bind");
        return 2;
    }
    pthread_t threads[PRODUCERS];
    for (int i = 0; i < PRODUCERS; i++)
        pthread_create(&threads[i], NULL, producer, NULL);
    for (int i = 0; i < reads; i++)
        answer_one(router);
    zmq_setsockopt(router, ZMQ_LINGER, &linger, sizeof linger);
    zmq_close(router);
    zmq_ctx_term(ctx);
    atomic_store(&stop, true);
    for (int i = 0; i < PRODUCERS; i++)
        pthread_join(threads[i], NULL);
    return 0;
}
