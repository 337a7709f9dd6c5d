#!/usr/bin/env bash
# On a machine with several GPUs: the pipeline and daemon suites with tallyd on every GPU
# (stateless batches spread over the devices, streams pinned to one), in one short call.
#   run (kind: nvidia-h200-x2, carry: [".deps"]): source scripts/device-env.sh; scripts/gpu-multi-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-multi}
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/summary.txt"
B=build-multi
cmake -S . -B $B -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_ARCHITECTURES=90 -DTALLY_CUDA=ON \
  >"$OUT/build.log" 2>&1 &&
  cmake --build $B -j"$(nproc)" --target tallyd tally test_pipeline test_daemon test_client_daemon \
    >>"$OUT/build.log" 2>&1
echo "build: rc=$?" | tee -a "$OUT/summary.txt"
export LD_LIBRARY_PATH="$PWD/$B/client:$LD_LIBRARY_PATH"
export TALLYD_BIN="$PWD/$B/daemon/tallyd" TALLY_BIN="$PWD/$B/cli/tally"
"$TALLYD_BIN" --backend cuda --bind tcp://127.0.0.1:5701 2>"$OUT/tallyd-info.log" &
pid=$!
sleep 3
"$TALLY_BIN" -e tcp://127.0.0.1:5701 info | tee -a "$OUT/summary.txt"
kill -TERM $pid; wait $pid; echo "tallyd exit: $?" | tee -a "$OUT/summary.txt"
TALLY_PIPELINE_ENGINE=cuda timeout 120 $B/tests/test_pipeline >"$OUT/test_pipeline.log" 2>&1
echo "test_pipeline (cuda, all GPUs): rc=$?" | tee -a "$OUT/summary.txt"
for t in test_daemon test_client_daemon; do
  TALLY_TEST_BACKEND=cuda timeout 120 $B/tests/$t >"$OUT/$t.log" 2>&1
  echo "$t (--backend cuda, all GPUs): rc=$?" | tee -a "$OUT/summary.txt"
done
grep -hE "PASSED|FAILED" "$OUT"/test_*.log | tee -a "$OUT/summary.txt"
