/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_cuda_tuning.c — the CUDA kernels' tuning table (kernels/cuda/tk_cuda_tuning.cu, issue
 * 34): every row is one the kernels accept, the selection by compute capability and peak memory
 * bandwidth picks the row each GPU was measured with, and the test switch TALLY_CUDA_TUNING
 * selects a row by name or, naming none, fails the GPU's start-up with a reason. None of this
 * needs a GPU (the switch is read before the device is); the kernels under every row are
 * checked on the GPU by test_cuda_backend.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tk_cuda.h"

static void test_rows(void **state)
{
    (void)state;
    unsigned n = tk_cuda_tuning_rows();
    assert_true(n >= 2);
    assert_null(tk_cuda_tuning_row(n));
    for (unsigned i = 0; i < n; i++) {
        const tk_cuda_tuning_t *r = tk_cuda_tuning_row(i);
        assert_non_null(r);
        assert_true(strlen(r->name) > 0);
        assert_ptr_equal(tk_cuda_tuning_find(r->name), r); /* names are unique */
        assert_int_equal(tk_cuda_tuning_use(r), TALLY_OK);
    }
    /* The last row suits every device. */
    assert_int_equal(tk_cuda_tuning_row(n - 1)->sm_major, 0);
    assert_int_equal(tk_cuda_tuning_row(n - 1)->min_peak_gbps, 0);
    assert_int_equal(tk_cuda_tuning_use(NULL), TALLY_OK);
    assert_null(tk_cuda_tuning_find("no-such-row"));
    assert_null(tk_cuda_tuning_find(NULL));
}

/* The devices the rows were measured on, by their properties. */
static void test_suited(void **state)
{
    (void)state;
    /* H200: 3201 MHz x 6144 bits; H100 SXM: 2619 MHz x 5120 bits; H100 PCIe: 1593 x 5120. */
    assert_string_equal(tk_cuda_tuning_suited(9, 4917)->name, "sm90-hbm3e");
    assert_string_equal(tk_cuda_tuning_suited(9, 3352)->name, "sm90-hbm3");
    assert_string_equal(tk_cuda_tuning_suited(9, 2039)->name, "sm90-hbm3");
    assert_string_equal(tk_cuda_tuning_suited(9, 0)->name, "sm90-hbm3");
    assert_string_equal(tk_cuda_tuning_suited(8, 2039)->name, "default");
    assert_string_equal(tk_cuda_tuning_suited(10, 8000)->name, "default");
}

static void test_switch(void **state)
{
    (void)state;
    const tk_cuda_tuning_t *row = NULL;
    setenv("TALLY_CUDA_TUNING", "sm90-hbm3", 1);
    assert_int_equal(tk_cuda_tuning_select(0, &row), TALLY_OK);
    assert_ptr_equal(row, tk_cuda_tuning_find("sm90-hbm3"));
    setenv("TALLY_CUDA_TUNING", "default", 1);
    assert_int_equal(tk_cuda_tuning_select(0, &row), TALLY_OK);
    assert_ptr_equal(row, tk_cuda_tuning_find("default"));

    /* A name that is no row: the selection fails, and so does opening a device (tallyd's
     * start-up on the GPU), saying why. */
    setenv("TALLY_CUDA_TUNING", "sm90-hbm4", 1);
    assert_int_equal(tk_cuda_tuning_select(0, &row), TALLY_E_PARAM);
    assert_null(row);
    tk_cuda_buffers_t b;
    char why[200] = "";
    assert_int_equal(tk_cuda_buffers_open(&b, 0, 4096, 64, why, sizeof why), TALLY_E_BACKEND);
    assert_non_null(strstr(why, "TALLY_CUDA_TUNING=sm90-hbm4 names no tuning row"));
    unsetenv("TALLY_CUDA_TUNING");
}

/* tk_cuda_tuning_use refuses shapes the kernels were not built for. */
static void test_use_checks(void **state)
{
    (void)state;
    const tk_cuda_tuning_t *r0 = tk_cuda_tuning_row(0);
    tk_cuda_tuning_t t = *r0;
    t.rgb_layout = 8;
    assert_int_equal(tk_cuda_tuning_use(&t), TALLY_E_PARAM);
    t = *r0;
    t.scan_shape = TK_SCAN_SHAPES;
    assert_int_equal(tk_cuda_tuning_use(&t), TALLY_E_PARAM);
    t = *r0;
    t.scan_shape_i32 = TK_SCAN_SHAPES;
    assert_int_equal(tk_cuda_tuning_use(&t), TALLY_E_PARAM);
    t = *r0;
    t.minmax_unroll = 2;
    assert_int_equal(tk_cuda_tuning_use(&t), TALLY_E_PARAM);
    t = *r0;
    t.hist_blocks_per_sm = 0;
    assert_int_equal(tk_cuda_tuning_use(&t), TALLY_E_PARAM);
    t = *r0;
    t.hist_blocks_per_sm = 5; /* the kernel's launch bound allows 4 */
    assert_int_equal(tk_cuda_tuning_use(&t), TALLY_E_PARAM);
    t = *r0;
    t.scan_prefetch_tiles = 100;
    assert_int_equal(tk_cuda_tuning_use(&t), TALLY_OK);
    assert_int_equal(tk_cuda_tuning_use(NULL), TALLY_OK);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rows),
        cmocka_unit_test(test_suited),
        cmocka_unit_test(test_switch),
        cmocka_unit_test(test_use_checks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
