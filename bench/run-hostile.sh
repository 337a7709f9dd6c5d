#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/run-hostile.sh BUILD_DIR OUT_DIR [TALLYD_ARGS...] — issue 21's hostile-peer rows: a light
# client's p50 alone and beside (1) a peer that pipelines 4 MiB and 16 MiB scans and never reads
# its replies, (2) a peer flooding 1 MiB hists, each against a fresh tallyd (CPU backend, plus
# TALLYD_ARGS), with tallyd's peak RSS. Idle and attacked windows alternate (bench/hostile.c), so
# both p50s come from the same minutes of a shared machine. Writes OUT_DIR/hostile.md.
# SECONDS_PER_RUN (default 30) sets each attack's measured time; LIGHT_SIZES (default "4096
# 65536") the light client's hist sizes for the flood rows; TALLYD another tallyd binary (an
# older build, for a before/after: the bench program stays this build's); LABEL the rows' label;
# NONREADER_SECONDS the never-reading row's time (default SECONDS_PER_RUN: a build without the
# reply bound grows by gigabytes a second there, so keep it short for one).
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-env.sh
. "$(dirname "$0")/bench-env.sh"
shift 2
bench_setup hostile 30
HO="$B/bench/hostile"
TD=${TALLYD:-$TD}
LABEL=${LABEL:-$(git -C "$(dirname "$0")" rev-parse --short HEAD 2>/dev/null || echo tallyd)}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# row ATTACK hostile-args...: a fresh tallyd, one hostile run, the row appended to $MD.
row() {
  local port pid out
  port=$(free_port)
  "$TD" --bind "tcp://127.0.0.1:$port" --backend cpu --log-level notice "$@" \
    2>>"$OUT/hostile-tallyd.log" &
  pid=$!
  pids+=("$pid")
  sleep 1
  out=$(timeout $((2 * ${T%.*} + 60)) "$HO" --endpoint "tcp://127.0.0.1:$port" --pid "$pid" \
    --seconds "$T" --label "$LABEL" "${ARGS[@]}" 2>>"$OUT/hostile.err" | grep '^| ' | tail -1)
  echo "${out:-| $LABEL | FAILED: ${ARGS[*]} |}" >>"$MD"
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
}

{
  echo "# hostile peers ($(nproc) cores, $(date -u +%F)), tallyd $* --backend cpu"
  echo
  echo "| run | attack | light | idle p50 us | attacked p50 us | ratio | attacked p99 us | light requests | attacker replies ok / busy / sent | tallyd peak VmRSS MiB | VmHWM MiB |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|"
} >"$MD"
ARGS=(--attack nonreader --attackers 1 --seconds "${NONREADER_SECONDS:-$T}")
row "$@"
for ls in ${LIGHT_SIZES:-4096 65536}; do
  ARGS=(--attack flood --attackers 1 --light-size "$ls")
  row "$@"
done
cat "$MD"
