#!/usr/bin/env bash
# One call on the GPU host after a reshaping session (issue 13) that touched the GPU path: CUDA
# build, every CTest test with the GPU present (the GPU twins run for real), the CPU-vs-GPU
# differential test, the kernel benchmark (kernels split into steps must keep their speed), and
# where tallyd's threads spend their time under the ZeroMQ 8 x 8 hist load (bench/thread-cpu.sh;
# the host has no perf); with RUN_PATH=1 also bench/run-path.sh. Summary in $OUT/summary.txt,
# logs beside it.
#   run (carry: [".deps"], after scripts/fetch-device-deps.sh): bash scripts/gpu-session-check.sh
OUT=${OUT:-/tmp/gpu-session}
CTEST_EXCLUDE='test_differential'
source scripts/gpu-build-and-test.sh
source scripts/gpu-steps.sh
summary=$S
[ "${SKIP_DIFF:-0}" = 1 ] || gpu_differential "$B" "${DIFF_SCALE:-4}" 240 "$OUT/test_differential-cuda.log"
if [ "${SKIP_KERNELS:-0}" != 1 ]; then
  t0=$SECONDS
  timeout 150 "$B/bench/kernel_bench" --label session >"$OUT/kernel.txt" 2>&1
  note "kernel_bench rc=$? ($((SECONDS - t0)) s)"
  cat "$OUT/kernel.txt" >>"$summary"
fi
# Thread shares under load: tallyd (GPU) and, for comparison, the raw fan-in's server.
run=/tmp/tallyd-session-$$
mkdir -p $run
"$B/daemon/tallyd" --backend cuda --bind "ipc://$run/t.ipc" --shm off --log-level notice \
  >"$OUT/tallyd-profile.log" 2>&1 &
td=$!
sleep 2
for round in 1 2; do
  "$B/bench/loadgen" --endpoint "ipc://$run/t.ipc" --op hist --size 1048576 --producers 8 \
    --window 8 --seconds 4 >"$OUT/loadgen-profile-$round.txt" 2>&1 &
  lg=$!
  sleep 1
  note "threads of tallyd --backend cuda under hist 1 MiB 8 x 8 ipc (round $round, % of one core over 2 s):"
  bash bench/thread-cpu.sh $td 2 | head -24 | tee -a "$summary"
  wait $lg
  grep '^| ' "$OUT/loadgen-profile-$round.txt" | tail -1 | tee -a "$summary"
done
kill $td
wait $td 2>/dev/null
rm -rf $run
# RUN_PATH=1: then issue 9's whole benchmark (bench/run-path.sh, about 3 minutes).
if [ "${RUN_PATH:-0}" = 1 ]; then
  t0=$SECONDS
  SECONDS_PER_RUN=1.2 timeout 300 bench/run-path.sh "$B" "$OUT/bench" >/dev/null 2>&1
  note "run-path rc=$? ($((SECONDS - t0)) s)"
  cp "$OUT/bench/path.md" "$OUT/path.md" 2>/dev/null
fi
cat $S
