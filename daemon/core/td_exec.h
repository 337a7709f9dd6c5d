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
 * Every request run comes back exactly once through the `done` callback, on the loop thread,
 * with its reply built, or with r->gpu_failed set (the scheduler then reruns it on the CPU).
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
    uv_loop_t *loop;
    const td_config_t *cfg;
    td_metrics_t *metrics; /* the GPU count (td_metrics_set_gpus) */
    tk_backend_t *cpu;     /* borrowed; outlives the executor */
    td_exec_done_fn done;
    void *owner;
} td_exec_env_t;

/* Creates the executor: the CPU path always, the GPU pipeline unless cfg->backend is cpu
 * (simulated devices with cfg->test_sim_gpus). TD_ERR_BACKEND when --backend cuda finds no
 * usable GPU. */
td_err_t td_exec_new(const td_exec_env_t *env, td_exec_t **out);
/* Closes the loop handles; call once nothing is in flight, before the loop's last run. */
void td_exec_close(td_exec_t *self);
void td_exec_destroy(td_exec_t **self_p);

/* Fills the machine the scheduler places work on (td_sched.h): the GPU pipeline's shape (none
 * on the CPU) and how a request runs. */
void td_exec_machine(td_exec_t *self, td_sched_machine_t *machine);

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
