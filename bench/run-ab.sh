#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/run-ab.sh BUILD_DIR OUT_DIR BASE_TALLYD — did a change move tallyd's latency or its
# one-producer throughput? This build's tallyd ("new") against another binary ("base", e.g. built
# from the previous commit), ROUNDS rounds (default 4; the order of the two flips every round),
# each tallyd started afresh:
#   - 4 KiB hist, filter and scan, one in flight, --backend auto, ipc, with the raw ZeroMQ echo
#     (loadgen --serve-echo) measured in the same round (issue 9: p50 <= echo p50 + 10 us);
#   - hist 1 MiB from 1 producer x 8 (tally_send), ipc, GPU_ARGS (default --backend cuda).
# Markdown rows in OUT_DIR/ab.md. SECONDS_PER_RUN (default 2).
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-env.sh
. "$(dirname "$0")/bench-env.sh"
BASE=${3:?base tallyd binary}
bench_setup ab 2
{
  echo "# tallyd A/B: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(date -u '+%F %H:%M') UTC"
  echo
  bench_table_header
} >"$MD"
for round in $(seq "${ROUNDS:-4}"); do
  "$LG" --serve-echo "ipc://$RUN/echo.ipc" 2>>"$OUT/ab.err" &
  echo_pid=$!
  pids+=("$echo_pid")
  sleep 0.3
  bench_row "echo r$round" "$LG" --endpoint "ipc://$RUN/echo.ipc" --op echo --size 4096 --window 1 \
    --seconds "$T"
  kill "$echo_pid"
  wait "$echo_pid" 2>/dev/null
  order="new base"
  [ $((round % 2)) = 0 ] && order="base new" # neither always runs first
  for v in $order; do
    bin=$TD
    [ $v = base ] && bin=$BASE
    "$bin" --backend auto --bind "ipc://$RUN/auto.ipc" --shm off --log-level notice \
      2>>"$OUT/tallyd-$v.log" &
    auto=$!
    # shellcheck disable=SC2086
    "$bin" ${GPU_ARGS:---backend cuda} --bind "ipc://$RUN/gpu.ipc" --shm off --log-level notice \
      2>>"$OUT/tallyd-$v.log" &
    gpu=$!
    pids+=("$auto" "$gpu")
    sleep 1.5
    for op in hist filter scan; do
      bench_row "$v $op 4 KiB r$round" "$LG" --endpoint "ipc://$RUN/auto.ipc" --op $op --size 4096 \
        --window 1 --seconds "$T"
    done
    bench_row "$v hist 1 MiB 1x8 r$round" "$LG" --endpoint "ipc://$RUN/gpu.ipc" --op hist \
      --size 1048576 --producers 1 --window 8 --seconds "$T"
    kill "$auto" "$gpu"
    wait "$auto" "$gpu" 2>/dev/null
  done
done
cat "$MD"
