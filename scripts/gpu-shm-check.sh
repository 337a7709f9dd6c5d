#!/usr/bin/env bash
# Issue 9 on the GPU host in one call (well under the device tool's 10 minutes): CUDA build, the
# shared-memory and pipeline tests with the GPU present (test_shm_gpu, test_pipeline_gpu and
# their CPU twins), then bench/run-path.sh (about 3 minutes: PCIe ceiling, raw ZeroMQ fan-in,
# tallyd over ZeroMQ and shared memory, 4 KiB latency, and the ratios of the targets).
# Results: $OUT/summary.txt, $OUT/path.md, logs beside them.
# run (carry: [".deps"], after scripts/fetch-device-deps.sh): bash scripts/gpu-shm-check.sh
OUT=${OUT:-/tmp/gpu-shm}
CTEST_INCLUDE='test_shm|test_pipeline'
CTEST_EXCLUDE='test_cuda_backend|test_differential'
source scripts/gpu-build-and-test.sh
t0=$SECONDS
SECONDS_PER_RUN=1.2 timeout 420 bench/run-path.sh $B $OUT/bench >/dev/null 2>&1
echo "bench rc=$? $((SECONDS - t0))s" >>$S
cp $OUT/bench/path.md $OUT/path.md 2>/dev/null
cat $S $OUT/path.md
