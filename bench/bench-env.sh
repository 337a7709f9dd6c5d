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
# run's measured seconds: $SECONDS_PER_RUN, default SECONDS), MD ($OUT/NAME.md) and RUN, a
# temporary folder (BENCH_TMP, removed at exit) for sockets and scratch files.
bench_setup() {
  T=${SECONDS_PER_RUN:-$2}
  MD="$OUT/$1.md"
  BENCH_TMP=$(mktemp -d "/tmp/tally-$1.XXXXXX")
  RUN=$BENCH_TMP
}
