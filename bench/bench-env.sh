# SPDX-License-Identifier: Apache-2.0
# bench/bench-env.sh — sourced by the bench/run-*.sh scripts (after `set -uo pipefail`, with
# the script's arguments BUILD_DIR OUT_DIR): what they all set up.
#   B, OUT       the build and output folders (OUT is created)
#   LG, FI, TD, TALLY   loadgen, fanin, tallyd and the tally CLI of that build
#   LD_LIBRARY_PATH     finds the build's libtally
#   pids         the background processes started (append $! after each); bench_stop_all kills
#                them, and so does the exit of the script, which also removes $BENCH_TMP if set.
B=${1:?build dir}
OUT=${2:?out dir}
mkdir -p "$OUT"
LG="$B/bench/loadgen"
FI="$B/bench/fanin"
TD="$B/daemon/tallyd"
TALLY="$B/cli/tally"
export LD_LIBRARY_PATH="$B/client${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
BENCH_TMP=${BENCH_TMP:-}
pids=()
bench_stop_all() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  pids=()
}
bench_exit() {
  bench_stop_all
  if [ -n "$BENCH_TMP" ]; then rm -rf "$BENCH_TMP"; fi
}
trap bench_exit EXIT
# bench_setup NAME SECONDS: what a run-*.sh script that writes one markdown file needs: T (each
# run's measured seconds: $SECONDS_PER_RUN, default SECONDS), MD ($OUT/NAME.md), BENCH_NAME and RUN, a
# temporary folder (BENCH_TMP, removed at exit) for sockets and scratch files.
bench_setup() {
  BENCH_NAME=$1
  T=${SECONDS_PER_RUN:-$2}
  MD="$OUT/$1.md"
  BENCH_TMP=$(mktemp -d "/tmp/tally-$1.XXXXXX")
  RUN=$BENCH_TMP
}
# bench_last_row: the last markdown table row of a loadgen or fanin output on stdin.
bench_last_row() { grep '^| ' | grep -v -e '^| run | op |' -e '^|---' | tail -1; }
# bench_row LABEL command...: runs a loadgen or fanin command (40 s at most; its stderr goes to
# $OUT/$NAME.err, NAME from bench_setup) and appends its last row to $MD, relabelled LABEL, or
# "| LABEL | FAILED |".
bench_row() {
  local label=$1 out
  shift
  out=$(timeout 40 "$@" 2>>"$OUT/$BENCH_NAME.err" | bench_last_row)
  echo "${out:-| $label | FAILED |}" | sed "s/^| [^|]* |/| $label |/" >>"$MD"
}
# bench_table_header: the markdown header of the rows loadgen and fanin print.
bench_table_header() {
  echo "| run | op | size | producers x window | req/s | GB/s | p50 us | p99 us | p99.9 us | answered | errors | VmHWM MiB |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
}

