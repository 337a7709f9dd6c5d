#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/run-io-threads.sh BUILD_DIR OUT_DIR — the A/B that picks tallyd's default ZeroMQ I/O
# threads (TD_IO_THREADS_MAX in daemon/base/td_config.h): for N in IO_LIST (default
# "2 4 6 8"), the raw fan-in (bench/fanin: one ROUTER, one application thread, 2 KiB replies)
# and tallyd (GPU_ARGS, default --backend cuda) with --io-threads N, both under hist 1 MiB from
# 8 producers x 8 in flight over ipc (and tallyd over tcp), plus the per-thread CPU of each
# tallyd under that load (bench/thread-cpu.sh: which thread is the bottleneck). Markdown in
# OUT_DIR/io-threads.md. SECONDS_PER_RUN (default 2) each run's measured time; about 1 min.
# STAGGER_MS (default 0) has producer i connect i x STAGGER_MS after the first (--stagger-ms):
# connections that arrive together can share one ZeroMQ I/O thread. SEND (default copy) is
# loadgen's --send: zc sends as the fan-in's producers do (bench/run-recv-ab.sh says why).
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-env.sh
. "$(dirname "$0")/bench-env.sh"
bench_setup io-threads 2
ST=(--stagger-ms "${STAGGER_MS:-0}" --send "${SEND:-copy}")
FI_ST=(--stagger-ms "${STAGGER_MS:-0}")
{
  echo "# ZeroMQ I/O threads (stagger ${STAGGER_MS:-0} ms, loadgen --send ${SEND:-copy}): $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(nproc) cores, $(date -u '+%F %H:%M') UTC"
  echo
  bench_table_header
} >"$MD"
port=5870
for n in ${IO_LIST:-2 4 6 8}; do
  port=$((port + 1))
  # shellcheck disable=SC2086
  "$TD" ${GPU_ARGS:---backend cuda} --io-threads "$n" --bind "tcp://127.0.0.1:$port" \
    --bind "ipc://$RUN/td$n.ipc" --shm off --log-level notice 2>"$OUT/tallyd-io$n.log" &
  td=$!
  pids+=($td)
  sleep 1 # tallyd's pinned staging
  bench_row "fanin ipc io $n" "$FI" --endpoint "ipc://$RUN/fanin$n.ipc" --producers 8 --window 8 \
    --size 1048576 --reply 2048 --io-threads "$n" --seconds "$T" "${FI_ST[@]}"
  bench_row "tallyd tcp io $n" "$LG" --endpoint "tcp://127.0.0.1:$port" --op hist --size 1048576 \
    --producers 8 --window 8 --seconds "$T" "${ST[@]}"
  "$LG" --endpoint "ipc://$RUN/td$n.ipc" --op hist --size 1048576 --producers 8 --window 8 \
    --seconds "$((T + 2))" "${ST[@]}" >"$RUN/lg.txt" 2>>"$OUT/io-threads.err" &
  lg=$!
  sleep 1
  bash "$(dirname "$0")/thread-cpu.sh" $td "$T" | head -12 | sed 's/^/    /' >"$OUT/threads-io$n.txt"
  wait $lg
  bench_last_row <"$RUN/lg.txt" |
    sed "s/^| [^|]* |/| tallyd ipc io $n |/" >>"$MD"
  kill $td
  wait $td 2>/dev/null
done
{
  echo
  echo "tallyd's busiest threads under the ipc run (% of one core):"
  for n in ${IO_LIST:-2 4 6 8}; do
    echo
    echo "io $n:"
    cat "$OUT/threads-io$n.txt"
  done
} >>"$MD"
cat "$MD"
