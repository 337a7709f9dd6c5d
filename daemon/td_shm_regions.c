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
    if (region->device_registered && shm->env.region_unregister)
        shm->env.region_unregister(shm->env.ctx, region->base);
    munmap(region->base, region->size);
    td_debug("shm: region %016" PRIx64 " unmapped (%zu bytes)", region->handle, region->size);
    free(region);
}

bool td_shm_region_direct(const td_shm_region_t *region)
{
    return region && region->device_registered;
}

void td_shm_region_put(td_shm_region_t **region_p)
{
    td_shm_region_t *region = *region_p;
    if (!region)
        return;
    *region_p = NULL;
    if (--region->refs == 0)
        td_shm_region_free(region->shm, region);
}

/* The connection lets go of a region: new requests can no longer find it. */
void td_shm_region_detach(td_shm_region_t *region)
{
    if (region->conn)
        region->conn->regions--;
    region->conn = NULL;
    td_shm_region_put(&region);
}

td_shm_region_t *td_shm_find_region(td_shm_t *shm, uint64_t handle)
{
    for (td_shm_region_t *r = shm->regions; r; r = r->next)
        if (r->handle == handle && r->conn && !r->registering)
            return r;
    return NULL;
}

uint64_t td_shm_new_handle(td_shm_t *shm)
{
    for (;;) {
        uint64_t h = 0;
        if (getrandom(&h, sizeof h, 0) != (ssize_t)sizeof h)
            h = ((uint64_t)rand() << 32) ^ (uint64_t)rand() ^ (uint64_t)uv_hrtime();
        if (h != 0 && !td_shm_find_region(shm, h))
            return h;
    }
}

tally_status_t td_shm_resolve(td_shm_t *shm, const uint8_t *id, size_t id_len, uint64_t handle,
                              uint64_t offset, uint64_t length, bool output,
                              td_shm_region_t **region, uint8_t **ptr, char *msg, size_t msg_cap)
{
    const char *what = output ? "output" : "input";
    *region = NULL;
    *ptr = NULL;
    if (!shm) {
        snprintf(msg, msg_cap, "shared memory is off in this tallyd");
        return TALLY_E_BAD_REF;
    }
    td_shm_region_t *r = td_shm_find_region(shm, handle);
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
        snprintf(msg, msg_cap, "output region %016" PRIx64 " is read-only (write-sealed memfd)",
                 handle);
        return TALLY_E_BAD_REF;
    }
    r->refs++;
    *region = r;
    *ptr = r->base + offset;
    return TALLY_OK;
}

void td_shm_gauges(const td_shm_t *shm, unsigned *regions, uint64_t *bytes)
{
    *regions = shm ? shm->region_count : 0;
    *bytes = shm ? shm->region_bytes : 0;
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
