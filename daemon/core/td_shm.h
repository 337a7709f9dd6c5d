/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_shm.h — shared-memory input: the side channel where producers register memfd regions,
 * and the table of regions that requests reference (PROTOCOL.md §10).
 *
 * Loop thread only. A region is mapped once when registered (and registered once with the GPU
 * engine, through the env callbacks, on a libuv worker: pinning a large region takes
 * milliseconds; the producer's answer waits for it, tallyd's other work does not), found by handle
 * for each request that references it, and held by a reference count: the side connection that
 * registered it holds one reference until it releases the region or closes, and every request that
 * uses it holds one until its reply has left. The last reference unmaps it.
 */
#ifndef TD_SHM_H
#define TD_SHM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "td_config.h"
#include "td_err.h"
#include "tally_proto.h"

typedef struct td_shm td_shm_t;

/* One registered region: its fields are td_shm.c's. Requests hold references
 * (td_shm_resolve, td_shm_region_put) and ask td_shm_region_direct how the GPU reaches it. */
typedef struct td_shm_region td_shm_region_t;

/* How regions reach the GPU: register once at registration (on a libuv worker thread),
 * unregister at the last release (loop thread). Both are set, or both NULL (no GPU).
 * region_register returns false when the region stays unregistered (the GPU then copies through
 * staging, which is correct, only slower). */
typedef struct {
    uv_loop_t *loop;
    const td_config_t *cfg; /* live: the allow lists and quotas apply at each registration */
    bool (*region_register)(void *ctx, void *base, size_t size, bool read_only);
    void (*region_unregister)(void *ctx, void *base);
    /* Device regions (PROTOCOL.md §10 "Device memory"): the three are set together, or all NULL
     * without a GPU (op 3 is then refused, "a GPU is needed"). dev_import imports fd (an exported
     * allocation of `size` bytes) on the usable GPU with `uuid`: TALLY_OK with *gpu (the pipeline's
     * device number), *import and *ptr (the device address), the import owning fd; else a status
     * and why, fd the caller's. dev_release undoes it and closes fd; dev_unusable says why
     * references to the region cannot run on *gpu any more (NULL when they can): "is unusable", or
     * that the GPU was reset since the import (td_gpu_dev_unusable). */
    tally_status_t (*dev_import)(void *ctx, const uint8_t *uuid, int fd, uint64_t size,
                                 bool writable, const uint8_t *event, unsigned *gpu, void **import,
                                 void **ptr, char *why, size_t why_cap);
    void (*dev_release)(void *ctx, unsigned gpu, void *import);
    const char *(*dev_unusable)(void *ctx, unsigned gpu, const void *import);
    void *ctx;
} td_shm_env_t;

/* Binds the side channel at cfg->shm_socket. With shm off, *out is NULL and TD_OK. A path that
 * another tallyd serves (it holds PATH.lock, or the socket accepts a connection) is TD_ERR_BIND
 * (logged), the default path too; a stale socket file is replaced. Another path that cannot be
 * bound (no such directory) is TD_ERR_BIND when it was configured explicitly; for the default
 * path it is logged and shm is off (*out NULL). TD_ERR_NOMEM when out of memory. */
td_err_t td_shm_new(const td_shm_env_t *env, td_shm_t **out);
/* Stops listening and closes every side connection (their regions stay mapped while requests
 * hold them). Closes the loop handles. */
void td_shm_close(td_shm_t *self);
/* Frees everything; every region must have been released by its requests. */
void td_shm_destroy(td_shm_t **self_p);

/* The side channel's path (for `info`), or NULL when self is NULL. */
const char *td_shm_path(const td_shm_t *self);
/* Appends the side channel's limits to `info` at buf (cap bytes) like snprintf: the lines
 * shm_max_regions_per_peer, shm_max_bytes, shm_max_connections_per_uid and
 * shm_register_timeout_ms (PROTOCOL.md §5 info). Returns the length they need. */
size_t td_shm_info(const td_config_t *cfg, char *buf, size_t cap);

/* Resolves [offset, offset + length) of region `handle` for a request from routing id `id`:
 * the handle must be known and registered for that id, the range inside the region (overflow
 * checked), and, for output, the region writable. On success *region holds a new reference
 * (td_shm_region_put releases it) and *ptr points at offset. TALLY_E_BAD_REF with a message
 * otherwise (also when self is NULL: shared memory is off). */
tally_status_t td_shm_resolve(td_shm_t *self, const uint8_t *id, size_t id_len, uint64_t handle,
                              uint64_t offset, uint64_t length, bool output,
                              td_shm_region_t **region, uint8_t **ptr, char *msg, size_t msg_cap);
/* Whether the GPU reads or writes region directly (it is registered with the GPU engine);
 * false for NULL (no region) and for an unregistered one (the GPU copies through staging). */
bool td_shm_region_direct(const td_shm_region_t *region);
/* Whether region is a device region (PROTOCOL.md §10 "Device memory"): then *gpu is the
 * pipeline's device that imported it and *import the engine's import (td_gpu_job_t.dev_import),
 * and td_shm_resolve's pointer is a device address, never to be read on the host. False for
 * NULL. */
bool td_shm_region_device(const td_shm_region_t *region, unsigned *gpu, void **import);
/* Device regions mapped and their bytes (a part of td_shm_gauges'). */
void td_shm_device_gauges(const td_shm_t *self, unsigned *regions, uint64_t *bytes);
/* Releases a reference (loop thread); sets *region_p to NULL. */
void td_shm_region_put(td_shm_region_t **region_p);

/* Regions mapped (registered, or released but still used by requests) and their bytes. */
void td_shm_gauges(const td_shm_t *self, unsigned *regions, uint64_t *bytes);

#endif
