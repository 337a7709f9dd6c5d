/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_client_gpu.c — libtally's exportable device memory (tally.h's tally_gpu_*) without a
 * tallyd: what it refuses and what it keeps.
 *   - Without a usable GPU (libcuda.so.1 not loadable, or cuInit failing: a CPU host with or
 *     without the driver installed), tally_gpu_alloc answers TALLY_E_ARG and tally_gpu_error
 *     says which; on a host with a GPU that check is skipped (gpu-check.sh's).
 *   - Malformed arguments (no out, size 0, a negative device): TALLY_E_ARG.
 *   - With TALLY_TEST_SIM_GPU=1 (the simulated GPU of tally_gpu.c): the size rounded up to
 *     64 KiB, a copy in and out at an offset gives the bytes back, a zero-length copy is a no-op,
 *     a copy reaching past the end (or starting past it) is refused with the range in
 *     tally_gpu_error and changes nothing; NULL allocations have no address and no size;
 *     tally_gpu_free clears the caller's pointer and takes NULL.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <dlfcn.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "tally.h"

static void test_no_driver(void **state)
{
    (void)state;
    assert_int_equal(unsetenv("TALLY_TEST_SIM_GPU"), 0);
    /* What this host has: no driver, a driver and no GPU it can use, or a GPU. */
    const char *want = "no CUDA driver (libcuda.so.1)";
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib) {
        int (*cu_init)(unsigned) = (int (*)(unsigned))dlsym(lib, "cuInit");
        bool gpu = cu_init && cu_init(0) == 0;
        dlclose(lib);
        if (gpu) /* a GPU host: tally_gpu_alloc is gpu-check.sh's to test */
            skip();
        want = cu_init ? "cuInit failed (no usable GPU)" : "the CUDA driver lacks cuInit";
    }
    tally_gpu_mem_t *m = (tally_gpu_mem_t *)&m;
    assert_int_equal(tally_gpu_alloc(0, 4096, &m), TALLY_E_ARG);
    assert_null(m);
    assert_int_equal(strncmp(tally_gpu_error(), want, strlen(want)), 0); /* then dlerror() */
    /* The driver is looked for once: the same answer again. */
    assert_int_equal(tally_gpu_alloc(0, 4096, &m), TALLY_E_ARG);
    assert_int_equal(strncmp(tally_gpu_error(), want, strlen(want)), 0);
}

static void test_arguments(void **state)
{
    (void)state;
    tally_gpu_mem_t *m = NULL;
    assert_int_equal(tally_gpu_alloc(0, 4096, NULL), TALLY_E_ARG);
    assert_int_equal(tally_gpu_alloc(0, 0, &m), TALLY_E_ARG);
    assert_int_equal(tally_gpu_alloc(-1, 4096, &m), TALLY_E_ARG);
    assert_null(m);
    assert_null(tally_gpu_ptr(NULL));
    assert_int_equal(tally_gpu_size(NULL), 0);
    tally_region_t *r = NULL;
    assert_int_equal(tally_gpu_register(NULL, NULL, 0, NULL, &r), TALLY_E_ARG);
    assert_null(r);
    uint8_t b[4] = {0};
    assert_int_equal(tally_gpu_copy_to(NULL, 0, b, 4), TALLY_E_ARG);
    assert_int_equal(tally_gpu_copy_from(NULL, 0, b, 4), TALLY_E_ARG);
    tally_gpu_free(NULL);
    tally_gpu_free(&m);
    assert_null(m);
}

static void test_simulated(void **state)
{
    (void)state;
    assert_int_equal(setenv("TALLY_TEST_SIM_GPU", "1", 1), 0);
    tally_gpu_mem_t *m = NULL;
    assert_int_equal(tally_gpu_alloc(1, 100000, &m), TALLY_OK);
    assert_non_null(m);
    assert_int_equal(tally_gpu_size(m), 2 * 65536); /* rounded up to 64 KiB */
    assert_non_null(tally_gpu_ptr(m));

    const char in[] = "device bytes";
    char out[sizeof in] = "";
    size_t at = tally_gpu_size(m) - sizeof in; /* the last bytes: in range */
    assert_int_equal(tally_gpu_copy_to(m, at, in, sizeof in), TALLY_OK);
    assert_int_equal(tally_gpu_copy_from(m, at, out, sizeof out), TALLY_OK);
    assert_string_equal(out, in);
    assert_int_equal(tally_gpu_copy_to(m, at, NULL, 0), TALLY_OK);
    assert_int_equal(tally_gpu_copy_from(m, tally_gpu_size(m), NULL, 0), TALLY_OK);

    /* One byte past the end, and a start past it: refused, the allocation unchanged. */
    assert_int_equal(tally_gpu_copy_to(m, at + 1, "xxxxxxxxxxxxx", sizeof in), TALLY_E_ARG);
    assert_string_equal(tally_gpu_error(), "copy of 13 bytes at 131060 outside the allocation");
    assert_int_equal(tally_gpu_copy_from(m, tally_gpu_size(m) + 1, out, 1), TALLY_E_ARG);
    assert_string_equal(tally_gpu_error(), "copy of 1 bytes at 131073 outside the allocation");
    memset(out, 0, sizeof out);
    assert_int_equal(tally_gpu_copy_from(m, at, out, sizeof out), TALLY_OK);
    assert_string_equal(out, in);

    tally_gpu_free(&m);
    assert_null(m);
    assert_int_equal(unsetenv("TALLY_TEST_SIM_GPU"), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_driver),
        cmocka_unit_test(test_arguments),
        cmocka_unit_test(test_simulated),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
