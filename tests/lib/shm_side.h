/* SPDX-License-Identifier: Apache-2.0 */
/*
 * shm_side.h — the shared-memory side channel (PROTOCOL.md §10) spoken raw, for the tests that
 * drive tallyd's td_shm.c: connect to its socket, send a message with any bytes and any number
 * of descriptors, read one answer, see the connection end; make sealed memfds; count a
 * process's open descriptors.
 */
#ifndef TALLY_TEST_SHM_SIDE_H
#define TALLY_TEST_SHM_SIDE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "tally_proto.h"

typedef struct {
    tally_shm_answer_t a;
    char msg[TALLY_ERROR_MESSAGE_MAX + 1]; /* the error message, "" for none */
} th_answer_t;

/* A SOCK_SEQPACKET connection to the side channel at path: its fd, or -1 (errno set). */
int th_side_connect(const char *path);
/* Sends len bytes with nfds descriptors attached (SCM_RIGHTS); 0, or -1 (errno set). */
int th_side_send_raw(int side, const void *buf, size_t len, const int *fds, int nfds);
/* Sends a register (id, fd >= 0 attached) or release (handle) message; 0, or -1. */
int th_side_send(int side, uint8_t op, const char *id, uint64_t handle, int fd);
/* Waits up to timeout_ms for one answer: 1 (decoded into *ans), 0 at the end of the
 * connection, -1 on a timeout, an error or an answer that does not decode. */
int th_side_recv(int side, th_answer_t *ans, int timeout_ms);
/* th_side_send, then th_side_recv (5 s): the answer's status, or -1 without an answer. */
int th_side_call(int side, uint8_t op, const char *id, uint64_t handle, int fd, th_answer_t *ans);
/* True when the connection ends (EOF or reset) within timeout_ms; answers before the end are
 * read and dropped. */
bool th_side_closed(int side, int timeout_ms);
/* True when an answer has arrived and is not read yet (it stays to be read). */
bool th_side_answer_waiting(int side);
/* A memfd of size bytes with seals added (0 for none); aborts on failure. */
int th_memfd(size_t size, int seals);
/* Simulated GPU gpu's UUID (PROTOCOL.md §10, --test-sim-gpus): "tallyd-sim-gpu", 0, gpu. */
void th_sim_uuid(unsigned gpu, uint8_t uuid[TALLY_GPU_UUID_SIZE]);
/* Entries of /proc/PID/fd, or -1. */
int th_fd_count(pid_t pid);

#endif
