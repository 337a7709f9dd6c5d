#!/usr/bin/env bash
# The whole test suite on the lent GPU machine, in one call: a CUDA build of everything, every
# CTest test (the GPU tests run for real here instead of skipping), then the integration suites
# again with tallyd on the CUDA backend. Logs under $OUT.
#
#   run (carry: [".deps"]): source scripts/device-env.sh; scripts/gpu-final-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-final}
mkdir -p "$OUT"
# shellcheck source-path=SCRIPTDIR source=gpu-steps.sh
. scripts/gpu-steps.sh
gpu_summary "$OUT/summary.txt"

B=build-final
t0=$SECONDS
cmake -S . -B $B -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_ARCHITECTURES=90 -DTALLY_CUDA=ON \
  -DTALLY_WERROR=ON >"$OUT/build.log" 2>&1 && cmake --build $B -j"$(nproc)" >>"$OUT/build.log" 2>&1
note "build: rc=$? ($((SECONDS - t0)) s)"
export LD_LIBRARY_PATH="$PWD/$B/client:$LD_LIBRARY_PATH"

t0=$SECONDS
(cd $B && timeout 420 ctest --output-on-failure -j4 >"$OUT/ctest.log" 2>&1)
note "ctest (every test, GPU present): rc=$? ($((SECONDS - t0)) s)"
grep -E "Test +#|tests passed" "$OUT/ctest.log" | tee -a "$summary"

export TALLYD_BIN="$PWD/$B/daemon/tallyd" TALLY_BIN="$PWD/$B/cli/tally"
for t in test_daemon test_client_daemon; do
  t0=$SECONDS
  TALLY_TEST_BACKEND=cuda timeout 120 "$B/tests/$t" >"$OUT/$t-cuda.log" 2>&1
  note "$t with tallyd --backend cuda: rc=$? ($((SECONDS - t0)) s)"
  grep -E "PASSED|FAILED" "$OUT/$t-cuda.log" | tee -a "$summary"
done

# The differential test (issue 10) once more at a larger scale, with its seeds in the summary: a
# fixed one and a random one (rerun with TALLY_TEST_SEED=N to reproduce).
gpu_differential $B "${DIFF_SCALE:-8}" 500 "$OUT/test_differential-cuda.log"
