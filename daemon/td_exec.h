/*
 * td_exec.h — the executor: where td_server.c hands compute requests and gets them back.
 *
 * The server decides *when* a request may start (a stream's order, td_exec_may_start) and
 * what to do with the result (apply it to the stream, reply); the executor decides *where* it
 * runs and makes sure the result is right:
 *   - the CPU path runs td_request_execute on libuv's worker pool (uv_queue_work), or right on
 *     the loop thread for a batch of at most TD_EXEC_INLINE_MAX bytes (microseconds of work,
 *     cheaper than the two thread wake-ups of the pool);
 *   - the GPU path (td_gpu.h) runs it on a device lane, asynchronously.
 * In auto mode a batch below its operation's threshold (TD_GPU_MIN_BATCH_*, or --gpu-min-batch)
 * takes the CPU path, being faster end to end there (bench/NOTES.md); with --backend cuda every
 * batch goes to the GPU while one is usable.
 *
 * Every request submitted comes back exactly once through the `done` callback, on the loop
 * thread, with its reply built. A request that failed on the GPU is rerun on the CPU first, so
 * `done` never sees a GPU failure: never a wrong answer, only a slower one.
 */
#ifndef TD_EXEC_H
#define TD_EXEC_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "td_config.h"
#include "td_metrics.h"
#include "td_request.h"
#include "td_shm.h"
#include "td_stream.h"
#include "tk_backend.h"

typedef struct td_exec td_exec_t;

/* Loop thread: the request's result is ready (apply it, reply). */
typedef void (*td_exec_done_fn)(void *owner, td_request_t *r);

typedef struct {
    uv_loop_t *loop;
    const td_config_t *cfg;
    td_metrics_t *metrics; /* backend_fallbacks */
    tk_backend_t *cpu;     /* borrowed; outlives the executor */
    td_exec_done_fn done;
    void *owner;
} td_exec_env_t;

/* Creates the executor: the CPU path always, the GPU pipeline unless cfg->backend is cpu
 * (simulated devices with cfg->test_sim_gpus). TALLY_E_BACKEND when --backend cuda finds no
 * usable GPU. */
tally_status_t td_exec_new(const td_exec_env_t *env, td_exec_t **out);
/* Closes the loop handles; call once nothing is in flight, before the loop's last run. */
void td_exec_close(td_exec_t *self);
void td_exec_destroy(td_exec_t **self_p);

/* May r (the next request waiting on its stream) start now, while the stream's earlier
 * requests are still in flight? Always when none is; otherwise only when both run on the GPU
 * (pipelined on the stream's lane, the carry chained on the device). query, reset, a histogram
 * whose type is not yet known, a CPU batch and anything after a GPU failure wait until the
 * stream drains. */
bool td_exec_may_start(const td_exec_t *self, const td_stream_t *stream, const td_request_t *r);
/* Runs a prepared compute request (td_request_prepare done). */
void td_exec_submit(td_exec_t *self, td_request_t *r);
/* Loop thread: a request of `stream` came back failed, or its result was discarded at apply
 * time, so it had no effect; the stream's requests still in flight behind it must not use what
 * it left on the device. */
void td_exec_stream_failed(td_exec_t *self, td_stream_t *stream);

/* Fills the region callbacks of a td_shm_env_t: shared-memory regions are registered with the
 * GPU engine (once, at registration) when a GPU pipeline runs; left NULL on the CPU. */
void td_exec_shm_env(td_exec_t *self, td_shm_env_t *env);

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
