/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_shm_regions.c — the table of registered regions (PROTOCOL.md §10): handles, lookups for
 * requests, reference counts, mapping a producer's memfd. See td_shm.c for the design.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "td_log.h"
#include "td_shm_int.h"

/* ---- regions ------------------------------------------------------------------------------ */

void td_shm_region_free(td_shm_t *shm, td_shm_region_t *region)
{
    for (td_shm_region_t **link = &shm->regions; *link; link = &(*link)->next) {
        if (*link == region) {
            *link = region->next;
            break;
        }
    }
    shm->region_count--;
    shm->region_bytes -= region->size;
    if (region->device) { /* unmapped on its GPU, and its descriptor closed, only now */
        shm->device_count--;
        shm->device_bytes -= region->size;
        if (region->import) /* NULL: its import was refused */
            shm->env.dev_release(shm->env.ctx, region->gpu, region->import);
        td_debug("shm: device region %016" PRIx64 " released (%zu bytes)", region->handle,
                 region->size);
        free(region);
        return;
    }
    if (region->device_registered) /* only region_register sets it: region_unregister is set */
        shm->env.region_unregister(shm->env.ctx, region->base);
    munmap(region->base, region->size);
    td_debug("shm: region %016" PRIx64 " unmapped (%zu bytes)", region->handle, region->size);
    free(region);
}

bool td_shm_region_direct(const td_shm_region_t *region)
{
    return region && region->device_registered;
}

void td_shm_lock(td_shm_t *shm)
{
    pthread_mutex_lock(&shm->lock);
}

void td_shm_unlock(td_shm_t *shm)
{
    pthread_mutex_unlock(&shm->lock);
}

/* Any thread (a request's shard, the loop thread): the last reference frees the region there.
 * The GPU engine's unregister and release are thread-safe (CUDA's calls are; the simulated and
 * fault engines keep no shared state for them). */
void td_shm_region_put(td_shm_region_t **region_p)
{
    td_shm_region_t *region = *region_p;
    if (!region)
        return;
    *region_p = NULL;
    td_shm_t *shm = region->shm;
    td_shm_lock(shm);
    if (--region->refs == 0)
        td_shm_region_free(shm, region);
    td_shm_unlock(shm);
}

/* The connection lets go of a region: new requests can no longer find it. */
void td_shm_region_detach(td_shm_region_t *region)
{
    td_shm_t *shm = region->shm;
    td_shm_lock(shm);
    if (region->conn)
        region->conn->regions--;
    region->conn = NULL;
    td_shm_region_put(&region);
    td_shm_unlock(shm);
}

void td_shm_region_ready(td_shm_region_t *region, bool failed)
{
    td_shm_lock(region->shm);
    if (failed)
        region->import = NULL; /* nothing to release */
    region->registering = false;
    td_shm_unlock(region->shm);
}

td_shm_region_t *td_shm_find_region(td_shm_t *shm, uint64_t handle)
{
    for (td_shm_region_t *r = shm->regions; r; r = r->next)
        if (r->handle == handle && r->conn && !r->registering)
            return r;
    return NULL;
}

/* 63 random bits, and bit 63 saying which memory the handle names (PROTOCOL.md §10). */
static uint64_t new_handle(td_shm_t *shm, bool device)
{
    for (;;) {
        uint64_t h = 0;
        if (getrandom(&h, sizeof h, 0) != (ssize_t)sizeof h)
            h = ((uint64_t)rand() << 32) ^ (uint64_t)rand() ^ (uint64_t)uv_hrtime();
        h = device ? h | TALLY_SHM_DEVICE_HANDLE_BIT : h & ~TALLY_SHM_DEVICE_HANDLE_BIT;
        if (h != 0 && !td_shm_find_region(shm, h))
            return h;
    }
}

td_shm_region_t *td_shm_region_add(td_shm_t *shm, td_shm_conn_t *c, const tally_shm_msg_t *m,
                                   uint8_t *base, size_t size, bool writable, bool device,
                                   bool registering)
{
    td_shm_region_t *r = calloc(1, sizeof *r);
    if (!r)
        return NULL;
    td_shm_lock(shm);
    *r = (td_shm_region_t){.handle = new_handle(shm, device),
                           .base = base,
                           .size = size,
                           .writable = writable,
                           .device = device,
                           .registering = registering,
                           .refs = registering ? 2 : 1,
                           .conn = c,
                           .shm = shm,
                           .id_len = m->id_len};
    memcpy(r->id, m->id, m->id_len);
    r->next = shm->regions;
    shm->regions = r;
    shm->region_count++;
    shm->region_bytes += size; /* counted from now on: the quota covers pending registrations */
    shm->device_count += device;
    shm->device_bytes += device ? size : 0;
    c->regions++;
    c->registered = true; /* the register timeout is over for c */
    td_shm_unlock(shm);
    return r;
}

bool td_shm_region_device(const td_shm_region_t *region, unsigned *gpu, void **import)
{
    if (!region || !region->device)
        return false;
    *gpu = region->gpu;
    *import = region->import;
    return true;
}

void td_shm_device_gauges(const td_shm_t *shm, unsigned *regions, uint64_t *bytes)
{
    *regions = 0;
    *bytes = 0;
    if (!shm)
        return;
    td_shm_lock((td_shm_t *)shm);
    *regions = shm->device_count;
    *bytes = shm->device_bytes;
    td_shm_unlock((td_shm_t *)shm);
}

static tally_status_t resolve_locked(td_shm_t *shm, const uint8_t *id, size_t id_len,
                                     uint64_t handle, uint64_t offset, uint64_t length, bool output,
                                     td_shm_region_t **region, uint8_t **ptr, char *msg,
                                     size_t msg_cap)
{
    const char *what = output ? "output" : "input";
    td_shm_region_t *r = td_shm_find_region(shm, handle);
    if (!r && (handle & TALLY_SHM_DEVICE_HANDLE_BIT) && !shm->env.dev_import) {
        snprintf(msg, msg_cap,
                 "%s handle %016" PRIx64 " names a device region: a GPU is needed for device "
                 "regions (this tallyd runs the CPU backend)",
                 what, handle);
        return TALLY_E_BAD_REF;
    }
    if (!r || r->id_len != id_len || memcmp(r->id, id, id_len) != 0) {
        snprintf(msg, msg_cap, "%s handle %016" PRIx64 " is not a region registered by this peer",
                 what, handle);
        return TALLY_E_BAD_REF;
    }
    if (offset > r->size || length > r->size - offset) { /* no overflow: offset <= size first */
        snprintf(msg, msg_cap,
                 "%s range [%" PRIu64 ", +%" PRIu64 ") is outside the region of %zu bytes", what,
                 offset, length, r->size);
        return TALLY_E_BAD_REF;
    }
    if (output && !r->writable) {
        snprintf(msg, msg_cap, "output region %016" PRIx64 " is read-only (%s)", handle,
                 r->device ? "registered without DEV_OUTPUT" : "write-sealed memfd");
        return TALLY_E_BAD_REF;
    }
    const char *unusable = /* a device region was imported: dev_unusable is set */
        r->device ? shm->env.dev_unusable(shm->env.ctx, r->gpu, r->import) : NULL;
    if (unusable) {
        snprintf(msg, msg_cap, "the GPU holding region %016" PRIx64 " %s", handle, unusable);
        return TALLY_E_BAD_REF;
    }
    r->refs++;
    *region = r;
    *ptr = r->base + offset;
    return TALLY_OK;
}

tally_status_t td_shm_resolve(td_shm_t *shm, const uint8_t *id, size_t id_len, uint64_t handle,
                              uint64_t offset, uint64_t length, bool output,
                              td_shm_region_t **region, uint8_t **ptr, char *msg, size_t msg_cap)
{
    *region = NULL;
    *ptr = NULL;
    if (!shm) {
        snprintf(msg, msg_cap, "shared memory is off in this tallyd");
        return TALLY_E_BAD_REF;
    }
    td_shm_lock(shm);
    tally_status_t st =
        resolve_locked(shm, id, id_len, handle, offset, length, output, region, ptr, msg, msg_cap);
    td_shm_unlock(shm);
    return st;
}

void td_shm_gauges(const td_shm_t *shm, unsigned *regions, uint64_t *bytes)
{
    *regions = 0;
    *bytes = 0;
    if (!shm)
        return;
    td_shm_lock((td_shm_t *)shm);
    *regions = shm->region_count;
    *bytes = shm->region_bytes;
    td_shm_unlock((td_shm_t *)shm);
}

/* Checks the descriptor (a sealed, non-empty memfd) and maps it. */
tally_status_t td_shm_map_memfd(int fd, uint8_t **base, size_t *size, bool *writable, char *why,
                                size_t cap)
{
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0) {
        snprintf(why, cap, "the descriptor is not a memfd (F_GET_SEALS: %s)", strerror(errno));
        return TALLY_E_PARAM;
    }
    if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
        snprintf(why, cap, "the memfd is not sealed with F_SEAL_SHRINK | F_SEAL_GROW (seals 0x%x)",
                 (unsigned)seals);
        return TALLY_E_PARAM;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0) {
        snprintf(why, cap, "the memfd is empty or not a regular file");
        return TALLY_E_PARAM;
    }
    *size = (size_t)st.st_size;
    *writable = true;
    void *p = mmap(NULL, *size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) { /* write-sealed, or opened read-only: an input region */
        *writable = false;
        p = mmap(NULL, *size, PROT_READ, MAP_SHARED, fd, 0);
    }
    if (p == MAP_FAILED) {
        snprintf(why, cap, "cannot map %zu bytes: %s", *size, strerror(errno));
        return TALLY_E_INTERNAL;
    }
    *base = p;
    return TALLY_OK;
}
