/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_gpu.h — the GPU pipeline: one per host, one set of lanes per device.
 *
 * The scheduler (td_sched.c) decides which requests come here and where (r->where: device, lane,
 * carry, pieces) and handles what comes back; this module moves them through the devices: a
 * request submitted goes to its lane, waits there for a staging slot (bounded by max_inflight,
 * which counts it), is copied into pinned staging and launched by the lane's thread, and comes
 * back through its sink's `complete` on the loop thread that submitted it, in launch order per
 * lane, with either its reply built (OK) or r->gpu_failed set.
 *
 * Threads (issue 31): the lanes are shared by every shard. A shard submits on its own thread and
 * gets its completions on its own loop through its sink (td_gpu_sink_open, one per shard:
 * r->shard names it), or, with r->gpu_to_front, through the last sink, the front's (td_path.c runs
 * a request on the front and takes its completion there too, so that no shard's thread wakes for
 * it: issue 34, bench/NOTES.md); the devices' bookkeeping is under a lock of the pipeline's; the
 * recovery of a lost context runs from the wiring's loop (`loop` of td_gpu_new). Everything else is
 * called on the wiring's loop thread.
 */
#ifndef TD_GPU_H
#define TD_GPU_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "td_err.h"
#include "td_gpu_engine.h"
#include "td_request.h"

typedef struct td_gpu td_gpu_t;

typedef void (*td_gpu_complete_fn)(void *owner, td_request_t *r);

typedef struct {
    size_t max_batch;      /* bytes; staging and device buffers are this size */
    unsigned lanes;        /* per device */
    unsigned slots;        /* staging slots per lane */
    unsigned spin_us;      /* lane threads poll this long before sleeping */
    bool spin_loop;        /* the loop polls while requests are on the GPU (--gpu-spin-loop) */
    unsigned max_inflight; /* the most requests ever in flight: bounds the streams in flight at
                            * once, so the scan carries per lane (per sink) */
    unsigned sinks;        /* the shards that submit, and the front when it is a thread of its
                            * own (at least 1) */
} td_gpu_opts_t;

/* Opens every device of the engine (taking ownership of it, also on failure) with its lanes
 * and threads. A device that cannot be opened is skipped with a warning; TD_ERR_BACKEND (and
 * why) when none could, TD_ERR_NOMEM otherwise. Each shard's sink is opened with
 * td_gpu_sink_open before it submits. */
td_err_t td_gpu_new(uv_loop_t *loop, td_gpu_engine_t *engine, const td_gpu_opts_t *opts,
                    td_gpu_t **out, char *why, size_t why_cap);
/* Sink `index` (< opts.sinks): the completions of requests with r->shard == index (or, for the
 * last sink, of those with r->gpu_to_front) come back
 * through complete(owner, r) on `loop`, which must not run yet (or be the caller's). A libuv
 * error code, 0 when done. */
int td_gpu_sink_open(td_gpu_t *self, unsigned index, uv_loop_t *loop, td_gpu_complete_fn complete,
                     void *owner);
/* On the sink's loop thread, with nothing of it in flight: closes its wake-up. */
void td_gpu_sink_close(td_gpu_t *self, unsigned index);
/* Stops and joins the lane threads (after the loops stopped) and frees everything. */
void td_gpu_destroy(td_gpu_t **self_p);
/* Closes the wiring's loop handles (the recovery's); call with nothing in flight. */
void td_gpu_close(td_gpu_t *self);

/* True while at least one device is usable. */
bool td_gpu_usable(const td_gpu_t *self);
/* Devices marked unusable since start (the health endpoint reports them). */
unsigned td_gpu_devices_lost(const td_gpu_t *self);
/* Devices are numbered 0..td_gpu_device_count()-1 as opened (a device that could not be opened
 * is skipped); each has td_gpu_lanes() lanes with td_gpu_carries() device scan carries each. */
unsigned td_gpu_device_count(const td_gpu_t *self);
unsigned td_gpu_lanes(const td_gpu_t *self);
unsigned td_gpu_carries(const td_gpu_t *self);
bool td_gpu_device_usable(const td_gpu_t *self, unsigned device);
/* The CUDA ordinal of a device; -1 when there is no such device. */
int td_gpu_device_ordinal(const td_gpu_t *self, unsigned device);
/* Queues a prepared compute request on the lane r->where names (its shard's thread). */
void td_gpu_submit(td_gpu_t *self, td_request_t *r);
/* Can r be split over a device's lanes: its input (and a scan's output) in regions registered
 * with the devices, a hist or a scan, and an engine that splits? */
bool td_gpu_splittable(const td_gpu_t *self, const td_request_t *r);

/* Registers a shared-memory region with the engine (every device), so lanes copy straight from
 * and to it; false when the engine could not (the lanes then go through staging). Any thread
 * (td_shm.c calls it on a worker); unregister on the loop thread. */
bool td_gpu_region_register(td_gpu_t *self, void *base, size_t size, bool read_only);
void td_gpu_region_unregister(td_gpu_t *self, void *base);
/* Device regions (PROTOCOL.md §10 "Device memory", td_shm_env_t's dev_import and dev_release):
 * imports on the usable device with `uuid` (TALLY_E_BAD_REF "no GPU with UUID ..." when none
 * has it); *gpu is that device's number here. */
tally_status_t td_gpu_dev_import(td_gpu_t *self, const uint8_t *uuid, int fd, uint64_t size,
                                 bool writable, const uint8_t *event, unsigned *gpu, void **import,
                                 void **ptr, char *why, size_t why_cap);
void td_gpu_dev_release(td_gpu_t *self, unsigned gpu, void *import);
/* Why references to a device region imported as `import` on device `gpu` cannot run: NULL when
 * they can; "is unusable", or that the device was reset since (a recovery recreated its context:
 * the region must be registered again). */
const char *td_gpu_dev_unusable(const td_gpu_t *self, unsigned gpu, const void *import);
/* Peer access (td_gpu_device.c): the devices other than the one holding r's device regions
 * that can run r now (bit d: device d; mapped there at the import, serving, the owner serving
 * and none of them reset since): 0 when there are none or r has no device region. Any shard. */
uint32_t td_gpu_region_peers(const td_gpu_t *self, const td_request_t *r);
/* Whether r has a device region (input or output): *gpu the device holding it (the input's). */
bool td_gpu_region_holder(const td_request_t *r, unsigned *gpu);
/* The wire status of an engine outcome that reaches a client (the one mapping of td_gpu_err_t):
 * TD_GPU_E_CLIENT is `bad_ref`, any other failure `internal`. */
tally_status_t td_gpu_status(td_gpu_err_t err);
/* "GPU-" and the 16 bytes in hex, 8-4-4-4-12 (nvidia-smi -L's form), at buf (>= 41 bytes). */
void td_gpu_uuid_string(const uint8_t *uuid, char *buf, size_t cap);
/* The usable devices' UUIDs, comma-separated, at buf (`info` gpu_uuids); their length. */
size_t td_gpu_uuids(const td_gpu_t *self, char *buf, size_t cap);

/* One more than the highest ordinal opened (the per-GPU counters are indexed by ordinal). */
unsigned td_gpu_ordinals(const td_gpu_t *self);

uint64_t td_gpu_device_bytes(const td_gpu_t *self);
/* "cuda: 0:NVIDIA H100 80GB HBM3 (4 CUDA streams)" */
void td_gpu_describe(const td_gpu_t *self, char *buf, size_t cap);
const char *td_gpu_engine_name(const td_gpu_t *self);

#endif
