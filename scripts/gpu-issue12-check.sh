#!/usr/bin/env bash
# Issue 12 (daemon side) on the GPU host in one call: CUDA build and every CTest test but the
# long kernel test (test_differential_gpu compares u16/rgb/rgba hist, reset/delete and window
# queries CPU vs the real GPUs), the differential at scale 4 with a random seed, then the kernel
# benchmark (1 GiB, the new histograms beside the read-only ceiling; target >= 0.90 x read,
# rgb/rgba measured with 32 and 16 sub-histogram copies).
# run (carry: [".deps"]): bash scripts/gpu-issue12-check.sh
# The kernel test (test_cuda_backend: test_hist_u16, test_hist_rgb against the CPU backend and
# the defining formulas) in a second call: GPU_CHECK_STEPS="test" bash scripts/gpu-check.sh
OUT=${OUT:-/tmp/gpu-issue12}
CTEST_EXCLUDE='test_cuda_backend'
source scripts/gpu-build-and-test.sh
t0=$SECONDS
TALLY_PIPELINE_ENGINE=cuda TALLY_DIFF_SCALE=4 timeout 200 $B/tests/test_differential >$OUT/diff-random.log 2>&1
echo "differential cuda scale 4 rc=$? $((SECONDS - t0))s" >>$S
grep -E "seed|FAILED|ERROR|PASSED|requests" $OUT/diff-random.log | head -8 >>$S
t0=$SECONDS
timeout 240 $B/bench/kernel_bench --label issue12 >$OUT/kernel-bench.txt 2>&1
echo "kernel_bench rc=$? $((SECONDS - t0))s" >>$S
grep -E "^\| (read-only|hist)" $OUT/kernel-bench.txt >>$S
cat $S
