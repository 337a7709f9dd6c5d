/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_exec.h — the executor: runs compute requests where the scheduler placed them.
 *
 * The scheduler (td_sched.h) decides *when* a request may start and *where* it runs
 * (r->where); the executor is the machine that runs it there and hands it back:
 *   - the CPU path runs td_request_execute on libuv's worker pool (uv_queue_work), or right on
 *     the loop thread when the placement says so (a tiny batch, or a stream's rerun after a GPU
 *     failure);
 *   - the GPU path (td_gpu.h) queues it on the device lane the placement names, asynchronously.
 * Every request run comes back exactly once through the `done` callback, on the loop thread of
 * the shard that ran it, with its reply built, or with r->gpu_failed set (the scheduler then
 * reruns it on the CPU).
 *
 * Shards (issue 31): one executor, opened on the wiring's loop (the GPU pipeline, its devices and
 * their recovery, the CPU backend, which is stateless), and a port per shard on that shard's loop
 * (td_exec_port_open): the machine its scheduler places work on, its CPU jobs' completions and
 * its sink of GPU completions. The GPU lanes are shared by every port; each port's scheduler
 * hands out device scan carries from a range of its own.
 */
#ifndef TD_EXEC_H
#define TD_EXEC_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "td_config.h"
#include "td_err.h"
#include "td_counters.h"
#include "td_request.h"
#include "td_sched.h"
#include "td_shm.h"
#include "tk_backend.h"

typedef struct td_exec td_exec_t;

/* Loop thread: the request's result is ready (apply it, reply). */
typedef void (*td_exec_done_fn)(void *owner, td_request_t *r);

typedef struct {
    uv_loop_t *loop; /* the wiring's */
    const td_config_t *cfg;
    td_metrics_t *metrics; /* the GPU count (td_metrics_set_gpus) */
    tk_backend_t *cpu;     /* borrowed; outlives the executor */
    unsigned ports;        /* the shards (at least 1) */
    /* Each port's completions, on its loop thread: done(owner, r). */
    td_exec_done_fn done;
    void *owner;
} td_exec_env_t;

/* Creates the executor: the CPU path always, the GPU pipeline unless cfg->backend is cpu
 * (simulated devices with cfg->test_sim_gpus). TD_ERR_BACKEND when --backend cuda finds no
 * usable GPU. */
td_err_t td_exec_new(const td_exec_env_t *env, td_exec_t **out);
/* Closes the wiring's loop handles; call once nothing is in flight, before the loop's last run. */
void td_exec_close(td_exec_t *self);
void td_exec_destroy(td_exec_t **self_p);

/* Port `index` (< env.ports) on `loop`, the shard's, before it runs: its CPU jobs and GPU
 * completions come back there. A libuv error code, 0 when done. */
int td_exec_port_open(td_exec_t *self, unsigned index, uv_loop_t *loop);
/* On the port's loop thread, with nothing of it in flight: closes its handles. */
void td_exec_port_close(td_exec_t *self, unsigned index);
/* Fills the machine port `index`'s scheduler places work on (td_sched.h): the GPU pipeline's
 * shape (none on the CPU), its range of scan carries, and how a request runs. */
void td_exec_port_machine(td_exec_t *self, unsigned index, td_sched_machine_t *machine);

/* Fills the region callbacks of a td_shm_env_t: shared-memory regions are registered with the
 * GPU engine (once, at registration) when a GPU pipeline runs; left NULL on the CPU. */
void td_exec_shm_env(td_exec_t *self, td_shm_env_t *env);
/* The usable GPUs' UUIDs for `info` (gpu_uuids; empty without a GPU); their length. */
size_t td_exec_gpu_uuids(const td_exec_t *self, char *buf, size_t cap);

/* "cuda" while a GPU is usable, else "cpu". */
const char *td_exec_backend_name(const td_exec_t *self);
/* "cpu,cuda" or "cpu" */
const char *td_exec_backends(const td_exec_t *self);
void td_exec_describe(const td_exec_t *self, char *buf, size_t cap);
/* The same, current (a device may have become unusable), in a buffer of the executor's. */
const char *td_exec_devices(td_exec_t *self);
uint64_t td_exec_device_bytes(const td_exec_t *self);
/* GPUs that were usable at start and are not any more (0 without a GPU pipeline). */
unsigned td_exec_devices_lost(const td_exec_t *self);

#endif
