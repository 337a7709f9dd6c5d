/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_alloc_fault_zmq.c — the allocation-failure hook (base/td_alloc_fault.h) for ZeroMQ's
 * allocating calls: zmq_msg_init_size and zmq_msg_init_data, counted with the daemon's other
 * allocations and failed the same way. Here, on the floor of the ZeroMQ transport, because it
 * needs zmq.h; built only with TALLY_ALLOC_FAULTS (compiled with TD_ALLOC_FAULT_IMPL, so it
 * calls the real functions).
 */
#include <errno.h>
#include <zmq.h>

#include "td_alloc_fault.h"

/* Declared by the renames of td_alloc_fault.h elsewhere; here, for the definitions. */
int td_af_zmq_msg_init_size(zmq_msg_t *msg, size_t size);
int td_af_zmq_msg_init_data(zmq_msg_t *msg, void *data, size_t size, zmq_free_fn *ffn, void *hint);

int td_af_zmq_msg_init_size(zmq_msg_t *msg, size_t size)
{
    if (td_af_must_fail("zmq_msg_init_size", NULL, 0)) {
        errno = ENOMEM;
        return -1;
    }
    return zmq_msg_init_size(msg, size);
}

/* libzmq allocates a reference count for a message of caller-owned data (and takes ownership
 * of the data only when it succeeds: the caller still frees it on -1); with no free function the
 * message is one of constant data, and nothing is allocated. */
int td_af_zmq_msg_init_data(zmq_msg_t *msg, void *data, size_t size, zmq_free_fn *ffn, void *hint)
{
    if (ffn && td_af_must_fail("zmq_msg_init_data", NULL, 0)) {
        errno = ENOMEM;
        return -1;
    }
    return zmq_msg_init_data(msg, data, size, ffn, hint);
}
