#!/usr/bin/env bash
# Issue 9 on the GPU host in one call: CUDA build, CTest with the GPU present (test_shm_gpu
# included; the long kernel test and the differential test left to their own scripts), then
# bench/run-shm.sh. run (carry: [".deps"]): bash scripts/gpu-shm-check.sh
OUT=${OUT:-/tmp/gpu-shm}
CTEST_EXCLUDE='test_cuda_backend|test_differential'
source scripts/gpu-build-and-test.sh
t0=$SECONDS; SECONDS_PER_RUN=1.5 timeout 400 bench/run-shm.sh $B $OUT > /dev/null 2>&1; echo "bench rc=$? $((SECONDS-t0))s" >> $S
cat $S $OUT/shm.md
