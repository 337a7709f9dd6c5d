#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/run-syscalls.sh BUILD_DIR OUT_DIR — system calls, context switches and CPU time per small
# request, by thread of tallyd, under load (perf stat --per-thread on the running daemon): what
# callgrind's instruction counts do not see, the wake-ups between the front and the shards
# (bench/NOTES.md, "The front's instructions and wake-ups").
#
# tallyd (--backend cpu, ipc, TALLYD_ARGS, default "--shards 4 --max-inflight 4096") answers
# `loadgen --op hist --size SIZE --window 64 --producers PRODUCERS --count COUNT/PRODUCERS
# LOADGEN_ARGS` (defaults 64, 2, 200000, "--streams 64") while perf counts its threads; then the
# counts are divided by COUNT. Needs perf with the raw_syscalls tracepoint.
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-env.sh
. "$(dirname "$0")/bench-env.sh"
bench_setup syscalls 0
SIZE=${SIZE:-64}
PRODUCERS=${PRODUCERS:-2}
COUNT=${COUNT:-200000}
EP="ipc://$RUN/sc.ipc"
# shellcheck disable=SC2086
"$TD" --bind "$EP" --backend cpu --shm off --log-level warning ${TALLYD_ARGS:---shards 4 --max-inflight 4096} &
td=$!
pids+=("$td")
for _ in $(seq 100); do
  timeout 5 "$LG" --endpoint "$EP" --op hist --size "$SIZE" --count 1 --window 1 >/dev/null 2>&1 && break
  sleep 0.1
done
perf stat --per-thread -x, -e raw_syscalls:sys_enter,context-switches,task-clock -p "$td" \
  -o "$RUN/perf.csv" &
perf=$!
sleep 0.3
# shellcheck disable=SC2086
timeout 300 "$LG" --endpoint "$EP" --op hist --size "$SIZE" --window 64 --producers "$PRODUCERS" \
  --count $((COUNT / PRODUCERS)) ${LOADGEN_ARGS:---streams 64} >"$RUN/lg.out" 2>&1
kill -INT "$perf"
wait "$perf" 2>/dev/null
{
  echo "# tallyd per request by thread ($SIZE B, $PRODUCERS x 64, $COUNT requests, tallyd args:" \
    "${TALLYD_ARGS:---shards 4 --max-inflight 4096}, $(date -u +%F))"
  echo
  grep '^| run' "$RUN/lg.out" | tail -1
  echo
  echo "| thread | syscalls / request | context switches / request | CPU us / request |"
  echo "|---|---|---|---|"
  # perf -x, --per-thread: thread-tid,value,unit,event,...
  awk -F, -v n="$COUNT" '
    $1 ~ /-[0-9]+$/ {
      t = $1; sub(/-[0-9]+$/, "", t); t = t " (" substr($1, length(t) + 2) ")"
      if (!(t in seen)) { seen[t] = 1; order[++k] = t }
      if ($4 ~ /sys_enter/) sc[t] = $2
      else if ($4 ~ /context-switches/) cs[t] = $2
      else if ($4 ~ /task-clock/) cpu[t] = $2
    }
    END {
      for (i = 1; i <= k; i++) {
        t = order[i]
        if (sc[t] + cs[t] == 0) continue
        printf "| %s | %.3f | %.3f | %.2f |\n", t, sc[t] / n, cs[t] / n, cpu[t] * 1000 / n
      }
    }' "$RUN/perf.csv"
} | tee "$MD"
