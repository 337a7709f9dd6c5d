/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_alloc_fault.c — the counting allocators behind td_alloc_fault.h (built only with
 * -DTALLY_ALLOC_FAULTS=ON; the header says what they do and which environment drives them).
 *
 * One atomic counter numbers every allocation of the daemon's code, from any thread, in the
 * order they happen; the one whose number is TALLYD_ALLOC_FAIL_AT (and with
 * TALLYD_ALLOC_FAIL_PERSIST every later one) returns NULL, or -1 with errno ENOMEM for the
 * ZeroMQ messages, as the real allocator out of memory would, without calling it. The numbering
 * is exact on the loop thread; where worker threads allocate at once, which of them gets a given
 * number can vary from run to run, which a sweep over every N covers anyway. Messages go to
 * stderr with write(2) on a stack buffer, since the allocator it would use may be the one failing.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#include "td_alloc_fault.h"

static atomic_uint_least64_t counted; /* allocations numbered so far */
static atomic_uint_least64_t failed;  /* of which failed on purpose */
static uint64_t fail_at;              /* TALLYD_ALLOC_FAIL_AT; 0: none */
static bool persist;                  /* TALLYD_ALLOC_FAIL_PERSIST */
static bool armed;                    /* TALLYD_ALLOC_FAIL_AT is set (0 too): report at exit */
static const char *only;              /* TALLYD_ALLOC_FAIL_IN; NULL: every allocation */
static pthread_once_t env_once = PTHREAD_ONCE_INIT;

static void read_env(void)
{
    const char *at = getenv("TALLYD_ALLOC_FAIL_AT");
    const char *keep = getenv("TALLYD_ALLOC_FAIL_PERSIST");
    armed = at != NULL;
    fail_at = at ? strtoull(at, NULL, 10) : 0;
    persist = keep && keep[0] && strcmp(keep, "0") != 0;
    only = getenv("TALLYD_ALLOC_FAIL_IN");
    if (only && !only[0])
        only = NULL;
}

static const char *base_name(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

/* Numbers one allocation: true when it must fail (and says so on stderr). */
bool td_af_must_fail(const char *what, const char *file, int line)
{
    pthread_once(&env_once, read_env);
    if (only && (!file || !strstr(file, only)))
        return false; /* not numbered: outside the part swept */
    uint64_t n = atomic_fetch_add_explicit(&counted, 1, memory_order_relaxed) + 1;
    if (!fail_at || n < fail_at || (n > fail_at && !persist))
        return false;
    atomic_fetch_add_explicit(&failed, 1, memory_order_relaxed);
    if (n == fail_at || !persist) {
        char msg[256];
        int len = snprintf(msg, sizeof msg,
                           "tallyd: alloc-fault: failing allocation %llu (%s at %s:%d)%s\n",
                           (unsigned long long)n, what, file ? base_name(file) : "?", line,
                           persist ? " and every one after it" : "");
        if (len > 0 && write(STDERR_FILENO, msg, (size_t)len) < 0)
            return true; /* nowhere to say it; the failure stands */
    }
    return true;
}

void *td_af_malloc(size_t size, const char *file, int line)
{
    return td_af_must_fail("malloc", file, line) ? NULL : malloc(size);
}

void *td_af_calloc(size_t count, size_t size, const char *file, int line)
{
    return td_af_must_fail("calloc", file, line) ? NULL : calloc(count, size);
}

void *td_af_realloc(void *p, size_t size, const char *file, int line)
{
    return td_af_must_fail("realloc", file, line) ? NULL : realloc(p, size);
}

char *td_af_strdup(const char *s, const char *file, int line)
{
    return td_af_must_fail("strdup", file, line) ? NULL : strdup(s);
}

char *td_af_strndup(const char *s, size_t n, const char *file, int line)
{
    return td_af_must_fail("strndup", file, line) ? NULL : strndup(s, n);
}

/* The count at exit, for the sweep's range (a destructor: every way out of main passes here),
 * when TALLYD_ALLOC_FAIL_AT is set: the other tests of such a build see tallyd's usual output. */
__attribute__((destructor)) static void report(void)
{
    pthread_once(&env_once, read_env);
    if (!armed)
        return;
    char msg[160];
    int len = snprintf(
        msg, sizeof msg, "tallyd: alloc-fault: counted %llu allocations, failed %llu\n",
        (unsigned long long)atomic_load(&counted), (unsigned long long)atomic_load(&failed));
    if (len > 0 && write(STDERR_FILENO, msg, (size_t)len) < 0)
        return;
}
