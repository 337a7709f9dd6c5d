#!/usr/bin/env bash
# Issue 9 on the GPU host in one call (well under the device tool's 10 minutes): CUDA build, the
# shared-memory and pipeline tests with the GPU present (test_shm_gpu, test_pipeline_gpu and
# their CPU twins), then bench/run-path.sh (about 3 minutes: PCIe ceiling, raw ZeroMQ fan-in,
# tallyd over ZeroMQ and shared memory, 4 KiB latency, and the ratios of the targets).
# Results: $OUT/summary.txt, $OUT/path.md, logs beside them. SANITIZE=1 first runs test_shm_gpu
# (the split on real CUDA streams included) with tallyd under compute-sanitizer memcheck (about
# 2 more minutes; reports in $OUT/sanitizer-PID.log); SKIP_BENCH=1 leaves the benchmark out.
# run (carry: [".deps"], after scripts/fetch-device-deps.sh): bash scripts/gpu-shm-check.sh
OUT=${OUT:-/tmp/gpu-shm}
CTEST_INCLUDE='test_shm|test_pipeline'
CTEST_EXCLUDE='test_cuda_backend|test_differential'
source scripts/gpu-build-and-test.sh
if [ "${SANITIZE:-0}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  t0=$SECONDS
  # CTest would put its own TALLYD_BIN back: run the test binary itself.
  printf '#!/bin/sh\nexec compute-sanitizer --tool memcheck --error-exitcode 3 --log-file %s/sanitizer-%%p.log %s "$@"\n' \
    "$OUT" "$PWD/$B/daemon/tallyd" >$OUT/tallyd-sanitized
  chmod +x $OUT/tallyd-sanitized
  TALLY_SHM_ENGINE=cuda TALLYD_BIN=$OUT/tallyd-sanitized timeout 240 $B/tests/test_shm_gpu \
    >$OUT/test-sanitizer.log 2>&1
  echo "compute-sanitizer test_shm_gpu rc=$? $((SECONDS - t0))s; tallyds with errors: $(grep -l 'ERROR SUMMARY: [1-9]' $OUT/sanitizer-*.log 2>/dev/null | wc -l)" >>$S
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  t0=$SECONDS
  SECONDS_PER_RUN=1.2 timeout 420 bench/run-path.sh $B $OUT/bench >/dev/null 2>&1
  echo "bench rc=$? $((SECONDS - t0))s" >>$S
fi
cp $OUT/bench/path.md $OUT/path.md 2>/dev/null
cat $S $OUT/path.md
