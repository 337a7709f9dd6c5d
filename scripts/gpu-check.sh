#!/usr/bin/env bash
# One call on the lent GPU machine does the whole CUDA check: configure and build (sm_90, tests
# on), the GPU test, the GPU test under compute-sanitizer memcheck and racecheck (quick mode,
# without the 2^28 size), the kernel benchmark, and optionally benchmark variants built with
# other tuning constants. Everything is logged under $OUT (the device tool brings it back).
#
#   source scripts/device-env.sh; scripts/gpu-check.sh
#   GPU_CHECK_STEPS="bench variants" GPU_CHECK_VARIANTS="scan8:-DTK_SCAN_VECS=8 hist3:-DTK_HIST_UNROLL=2" \
#     scripts/gpu-check.sh
#
# Each step has its own time limit, so a hang in one step still leaves the others' logs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
STEPS=${GPU_CHECK_STEPS:-"test memcheck racecheck bench variants"}
VARIANTS=${GPU_CHECK_VARIANTS:-}
B=build-dev
JOBS=$(nproc)
# shellcheck source-path=SCRIPTDIR source=gpu-steps.sh
. scripts/gpu-steps.sh
gpu_summary "$OUT/summary.txt" name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu
has() { [[ " $STEPS " == *" $1 "* ]]; }

configure() { # dir, extra CUDA flags
  cmake -S . -B "$1" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DTALLY_CUDA=ON -DBUILD_TESTING=ON -DCMAKE_CUDA_FLAGS="$2" >>"$OUT/build.log" 2>&1
}
t0=$SECONDS
if configure $B "" && cmake --build $B -j "$JOBS" --target test_cuda_backend kernel_bench \
  >>"$OUT/build.log" 2>&1; then
  note "build: ok ($((SECONDS - t0)) s)"
else
  note "build: FAILED (see build.log)"
  tail -30 "$OUT/build.log"
  exit 1
fi
T=$B/tests/test_cuda_backend
K=$B/bench/kernel_bench

if has test; then
  t0=$SECONDS
  timeout 300 $T >"$OUT/test.log" 2>&1
  note "test: rc=$? ($((SECONDS - t0)) s)"
  grep -E "PASSED|FAILED|\[  FAILED|ERROR|rror" "$OUT/test.log" | head -20 | tee -a "$summary"
fi
for tool in memcheck racecheck; do
  has $tool || continue
  t0=$SECONDS
  TALLY_TEST_QUICK=1 timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 \
    --print-limit 20 $T >"$OUT/$tool.log" 2>&1
  note "$tool: rc=$? ($((SECONDS - t0)) s)"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|FAILED|PASSED" "$OUT/$tool.log" | head -5 | tee -a "$summary"
done
if has bench; then
  timeout 150 $K --label base >"$OUT/bench.log" 2>&1
  note "bench: rc=$?"
fi
if has variants; then
  for v in $VARIANTS; do
    name=${v%%:*}
    flags=${v#*:}
    flags=${flags//,/ }
    d=build-var-$name
    if configure "$d" "$flags" && cmake --build "$d" -j "$JOBS" --target kernel_bench \
      test_cuda_backend >>"$OUT/build.log" 2>&1; then
      # The quick test first: a variant's figures count only if it computes the right thing.
      TALLY_TEST_QUICK=1 timeout 120 "$d/tests/test_cuda_backend" >"$OUT/variant-test.log" 2>&1
      rc=$?
      note "variant $name: quick test rc=$rc"
      [ $rc = 0 ] || grep -E "FAILED|rror|want" "$OUT/variant-test.log" | head -5 | tee -a "$summary"
      timeout 120 "$d/bench/kernel_bench" --label "$name ($flags)" >>"$OUT/variants.log" 2>&1
      note "variant $name: bench rc=$?"
    else
      note "variant $name: build FAILED"
    fi
  done
fi
echo "==== bench"
grep -E "^\|" "$OUT/bench.log" 2>/dev/null
echo "==== variants"
grep -E "kernel_bench|GB/s" "$OUT/variants.log" 2>/dev/null | cut -c1-90
echo "==== summary"
cat "$summary"
