#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/run-callgrind.sh BUILD_DIR OUT_DIR — instructions tallyd executes per small request, by
# thread, under callgrind (valgrind): a figure that does not move with the machine's load, so a
# change to the request path can be compared on a shared 2-core box (bench/NOTES.md, "Where a
# small request's time goes").
#
# tallyd (--backend cpu, ipc) runs under callgrind twice, answering `loadgen --op OP --size SIZE
# --window 64 --count C` for C = $SMALL (default 2000) and $LARGE (default 12000) requests; the
# difference divided by LARGE - SMALL is each thread's instructions per request, start-up and
# shutdown cancelling out. OP (default hist), SIZE (default 64), PRODUCERS (default 1),
# LOADGEN_ARGS (e.g. "--stream": named streams) and TALLYD_ARGS set the load. Prints a table:
# thread, instructions per request, the share of the whole process; threads are named as callgrind
# numbers them (1: the loop thread; the ZeroMQ I/O threads and the others follow in the order
# they started). The echo server (loadgen --serve-echo) is
# measured the same way for the transport's own cost. KEEP=1 keeps the larger run's callgrind
# files in OUT_DIR (for callgrind_annotate: thread 1 is tallyd's loop thread, the front).
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-env.sh
. "$(dirname "$0")/bench-env.sh"
bench_setup callgrind 0
OP=${OP:-hist}
SIZE=${SIZE:-64}
SMALL=${SMALL:-2000}
LARGE=${LARGE:-12000}
PRODUCERS=${PRODUCERS:-1}
EP="ipc://$RUN/cg.ipc"

# run NAME COUNT command...: the command under callgrind (one file per thread), loadgen sending
# COUNT requests in all; then SIGTERM.
run() {
  local name=$1 count=$2
  shift 2
  valgrind --tool=callgrind --separate-threads=yes --dump-instr=no \
    --callgrind-out-file="$RUN/$name-$count.%p" "$@" 2>"$RUN/$name-$count.log" &
  local pid=$!
  for _ in $(seq 200); do # valgrind starts slowly: wait until the socket answers
    timeout 5 "$LG" --endpoint "$EP" --op "$OP" --size "$SIZE" --count 1 --window 1 \
      >/dev/null 2>&1 && break
    sleep 0.2
  done
  # shellcheck disable=SC2086
  timeout 600 "$LG" --endpoint "$EP" --op "$OP" --size "$SIZE" --window 64 \
    --producers "$PRODUCERS" --count $((count / PRODUCERS)) ${LOADGEN_ARGS:-} \
    >"$RUN/$name-$count.lg" 2>&1 || echo "loadgen failed: $(tail -2 "$RUN/$name-$count.lg")"
  kill -TERM "$pid"
  wait "$pid" 2>/dev/null
}

# thread_ir NAME COUNT: "thread instructions" per callgrind output file of that run.
thread_ir() {
  for f in "$RUN/$1-$2".*-[0-9]*; do
    local t=${f##*-}
    echo "$((10#$t)) $(grep -m1 '^summary:' "$f" | awk '{print $2}')"
  done | sort -n
}

# table NAME: instructions per request by thread, from the two runs.
table() {
  local name=$1
  join <(thread_ir "$name" "$SMALL") <(thread_ir "$name" "$LARGE") |
    awk -v n=$((LARGE - SMALL)) -v name="$name" '
      { per[$1] = ($3 - $2) / n; total += per[$1]; order[++k] = $1 }
      END {
        for (i = 1; i <= k; i++)
          printf "| %s | %d | %.0f | %.0f %% |\n", name, order[i], per[order[i]],
                 total ? 100 * per[order[i]] / total : 0
        printf "| %s | all | %.0f | 100 %% |\n", name, total
      }'
}

{
  echo "# Instructions per request under callgrind ($OP $SIZE B, $PRODUCERS producer(s) x 64," \
    "loadgen args: ${LOADGEN_ARGS:-none}, tallyd args: ${TALLYD_ARGS:-none}, $(date -u +%F))"
  echo
  echo "| server | thread | instructions / request | share |"
  echo "|---|---|---|---|"
  for c in "$SMALL" "$LARGE"; do
    # shellcheck disable=SC2086
    run tallyd "$c" "$TD" --bind "$EP" --backend cpu --shm off --log-level warning \
      ${TALLYD_ARGS:-}
  done
  table tallyd
  for c in "$SMALL" "$LARGE"; do
    run echo "$c" "$LG" --serve-echo "$EP"
  done
  table echo
} 2>&1 | tee "$MD"
if [ -n "${KEEP:-}" ]; then cp "$RUN"/*-"$LARGE".* "$OUT"/; fi
