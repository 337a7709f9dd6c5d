/* SPDX-License-Identifier: Apache-2.0 */
/*
 * td_alloc_fault.h — allocation-failure injection (issue 25), as SQLite's test allocator does:
 * make the Nth allocation fail, for every N, and check that nothing crashes, leaks or loses a
 * request (scripts/alloc-sweep.sh sweeps N; docs/testing.md).
 *
 * Built only with -DTALLY_ALLOC_FAULTS=ON, and then forced into every source file of daemon/
 * (and only daemon/: libzmq, libuv, libc and the other libraries keep their own allocator) with
 * `-include` (daemon/CMakeLists.txt). No daemon file names it, so there is nothing to forget
 * when a file is added, and the default build compiles none of it: zero cost when off.
 *
 * It counts, in one process-wide counter, every call the daemon's code makes to malloc, calloc,
 * realloc, strdup, strndup (each call site's file and line kept), zmq_msg_init_size and
 * zmq_msg_init_data (which allocates libzmq's reference count). The simulated GPUs' device and
 * pinned allocations (gpu/td_gpu_sim.c) and the pipeline's pinned reply buffers (core/td_gpu.c,
 * through the engine's host_alloc) are such calls. Environment (read once, at the first count):
 *   TALLYD_ALLOC_FAIL_AT=N       the Nth allocation fails (1 = the first); unset or 0: none fails
 *   TALLYD_ALLOC_FAIL_PERSIST=1  every allocation after the Nth fails too (default: the Nth only)
 *   TALLYD_ALLOC_FAIL_IN=TEXT    only the allocations of source files whose path contains TEXT
 *                                ("/nats/": the fleet's) are numbered, and so may fail; the others
 *                                (and ZeroMQ's, whose site is not known) are neither
 * tallyd writes to stderr, when an allocation is failed on purpose,
 *   tallyd: alloc-fault: failing allocation N (malloc at td_stream.c:123)
 * and at exit, when TALLYD_ALLOC_FAIL_AT is set (0 too: count only),
 *   tallyd: alloc-fault: counted C allocations, failed F
 * so that a sweep learns its range from one run with nothing failing.
 */
#ifndef TD_ALLOC_FAULT_H
#define TD_ALLOC_FAULT_H

/* The system's declarations first, so that the macros below rename only the daemon's calls. */
#include <stddef.h>
#include <malloc.h> /* main.c: mallopt; it declares malloc again */
#include <stdlib.h>
#include <string.h>

void *td_af_malloc(size_t size, const char *file, int line);
void *td_af_calloc(size_t count, size_t size, const char *file, int line);
void *td_af_realloc(void *p, size_t size, const char *file, int line);
char *td_af_strdup(const char *s, const char *file, int line);
char *td_af_strndup(const char *s, size_t n, const char *file, int line);
/* Counts one allocation (what, at file:line; file NULL: not known) and says whether it fails.
 * net/td_alloc_fault_zmq.c wraps ZeroMQ's allocating calls with it, on the floor that may
 * include zmq.h. */
_Bool td_af_must_fail(const char *what, const char *file, int line);

/* td_alloc_fault.c itself (compiled with TD_ALLOC_FAULT_IMPL) calls the real functions. */
#ifndef TD_ALLOC_FAULT_IMPL
#undef strdup
#undef strndup
#define malloc(size) td_af_malloc((size), __FILE__, __LINE__)
#define calloc(count, size) td_af_calloc((count), (size), __FILE__, __LINE__)
#define realloc(p, size) td_af_realloc((p), (size), __FILE__, __LINE__)
#define strdup(s) td_af_strdup((s), __FILE__, __LINE__)
#define strndup(s, n) td_af_strndup((s), (n), __FILE__, __LINE__)
/* Renamed, not wrapped in a call with the site: zmq.h is not included here (the request path
 * stays free of it), so its own declarations, renamed too, declare the wrappers. */
#define zmq_msg_init_size td_af_zmq_msg_init_size
#define zmq_msg_init_data td_af_zmq_msg_init_data
#endif

#endif
