#!/usr/bin/env bash
# Issue 4 on the lent GPU machine in one call: the GPU pipeline's tests on the real GPU, then
# the end-to-end benchmark (crossover, throughput beside the ZeroMQ echo, latency, 8
# producers; bench/run-loadgen.sh). Logs and results go under $OUT.
#
#   run (carry: [".deps", "build-carry"]):
#     source scripts/device-env.sh; scripts/gpu-pipeline-check.sh
#
# build-carry is a CUDA build made on the developer machine (same x86-64 Debian, same CUDA 13.0)
# of just the targets needed here, so no device time goes to compiling; when its tallyd does
# not run here the script builds them instead (build-dev).
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-/tmp/gpu-pipeline}
OUT=$FINAL/work # everything here goes back as one logs.tgz (the tool returns at most 8 files)
mkdir -p "$OUT"
# shellcheck source-path=SCRIPTDIR source=gpu-steps.sh
. scripts/gpu-steps.sh
gpu_summary "$OUT/summary.txt" name,driver_version,memory.total,clocks.sm,clocks.max.sm
TARGETS="tallyd loadgen test_pipeline test_daemon test_differential"

B=build-carry
export LD_LIBRARY_PATH="$PWD/$B/client${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ! "$B/daemon/tallyd" --version >/dev/null 2>&1 || ! "$B/bench/loadgen" 2>&1 | grep -q usage; then
  note "carried build does not run here: building"
  B=build-dev
  export LD_LIBRARY_PATH="$PWD/$B/client:$LD_LIBRARY_PATH"
  t0=$SECONDS
  cmake -S . -B $B -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DTALLY_CUDA=ON >"$OUT/build.log" 2>&1 &&
    cmake --build $B -j "$(nproc)" --target $TARGETS >>"$OUT/build.log" 2>&1
  note "build: rc=$? ($((SECONDS - t0)) s)"
fi
export TALLYD_BIN="$PWD/$B/daemon/tallyd" TALLY_BIN="$PWD/$B/cli/tally"

# ---- tests on the real GPU ----
t0=$SECONDS
TALLY_PIPELINE_ENGINE=cuda timeout 120 "$B/tests/test_pipeline" >"$OUT/test-pipeline-gpu.log" 2>&1
note "test_pipeline (cuda): rc=$? ($((SECONDS - t0)) s)"
grep -E "PASSED|FAILED|ERROR|LINE" "$OUT/test-pipeline-gpu.log" | head -12 | tee -a "$summary"
# The differential test (issue 10): the same random sequence on --backend cpu and on the GPU,
# every reply and restored state compared; a fixed seed and a random one (printed: rerun with
# TALLY_TEST_SEED=N to reproduce), then the SIGKILL snapshot-prefix test.
if [ -x "$B/tests/test_differential" ]; then
  gpu_differential $B "${DIFF_SCALE:-4}" 400 "$OUT/test-differential-gpu.log"
else
  note "test_differential: not in $B (add it to the carried build)"
fi
t0=$SECONDS
TALLY_TEST_BACKEND=cuda timeout 120 "$B/tests/test_daemon" >"$OUT/test-daemon-gpu.log" 2>&1
note "test_daemon (--backend cuda): rc=$? ($((SECONDS - t0)) s)"
grep -E "PASSED|FAILED|ERROR|LINE" "$OUT/test-daemon-gpu.log" | head -12 | tee -a "$summary"
# ---- the benchmark ----
# BENCH=spin-ab runs the --gpu-spin-us A/B (bench/run-spin-ab.sh) instead of the matrix.
t0=$SECONDS
bench/run-${BENCH:-loadgen}.sh "$B" "$OUT" >"$OUT/run-bench.log" 2>&1
note "run-${BENCH:-loadgen}: rc=$? ($((SECONDS - t0)) s)"

# The pipeline under compute-sanitizer memcheck: tallyd itself runs under the tool.
if [ "${MEMCHECK:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  # The tests stop tallyd with SIGTERM; the wrapper hands it to tallyd itself (the tool's
  # child) so that tallyd exits cleanly and the tool writes its summary.
  wrap="$OUT/tallyd-memcheck.sh"
  {
    echo '#!/bin/bash'
    echo "compute-sanitizer --tool memcheck --error-exitcode 9 --log-file $OUT/memcheck-%p.log $TALLYD_BIN \"\$@\" &"
    echo 'cs=$!'
    echo 'trap '"'"'kill -TERM $(pgrep -P $cs || ps -o pid= --ppid $cs) 2>/dev/null'"'"' TERM INT'
    echo 'rc=0; while kill -0 $cs 2>/dev/null; do wait $cs; rc=$?; done'
    echo 'exit $rc'
  } >"$wrap"
  chmod +x "$wrap"
  t0=$SECONDS
  TALLYD_BIN="$wrap" TALLY_PIPELINE_ENGINE=cuda timeout ${MEMCHECK_SECONDS:-150} "$B/tests/test_pipeline" \
    >"$OUT/test-pipeline-memcheck.log" 2>&1
  note "test_pipeline (cuda, tallyd under memcheck): rc=$? ($((SECONDS - t0)) s)"
  grep -h "ERROR SUMMARY" "$OUT"/memcheck-*.log 2>/dev/null | sort | uniq -c | tee -a "$summary"
fi

for f in "$OUT"/tallyd-*.log; do
  [ -f "$f" ] && { echo "== $f"; grep -vE "^<[67]>" "$f" | tail -5; } >>"$summary"
done
cp "$OUT"/*.md "$summary" "$FINAL/" 2>/dev/null
tar czf "$FINAL/logs.tgz" -C "$OUT" . && rm -rf "$OUT"
echo "==== results"
cat "$FINAL"/*.md
echo "==== summary"
cat "$FINAL/summary.txt"
