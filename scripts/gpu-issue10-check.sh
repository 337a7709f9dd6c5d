#!/usr/bin/env bash
# Issue 10 on the GPU host in one call: CUDA build, every CTest test but the long kernel test,
# the integration suites with tallyd --backend cuda, and the CPU-vs-GPU differential test
# (fixed and random seed). run (carry: [".deps"]): bash scripts/gpu-issue10-check.sh
OUT=${OUT:-/tmp/gpu-issue10}
CTEST_EXCLUDE='test_cuda_backend|test_differential_gpu'
source scripts/gpu-build-and-test.sh
for t in test_daemon test_client_daemon test_lifecycle test_seq; do t0=$SECONDS; TALLY_TEST_BACKEND=cuda timeout 120 $B/tests/$t > $OUT/$t-cuda.log 2>&1; echo "$t cuda rc=$? $((SECONDS-t0))s" >> $S; grep -E "FAILED|ERROR" $OUT/$t-cuda.log | head -5 >> $S; done
for seed in fixed random; do t0=$SECONDS; TALLY_PIPELINE_ENGINE=cuda TALLY_DIFF_SCALE=4 timeout 150 $B/tests/test_differential > $OUT/diff-$seed.log 2>&1; echo "differential cuda run $seed rc=$? $((SECONDS-t0))s" >> $S; grep -E "seed|FAILED|ERROR|PASSED" $OUT/diff-$seed.log | head -8 >> $S; done
cat $S
