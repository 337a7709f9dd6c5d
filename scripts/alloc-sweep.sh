#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# scripts/alloc-sweep.sh — the allocation-failure sweep (issue 25), as SQLite's: tallyd runs a
# representative load (tests/alloc_workload.c says which, and what passes) with its Nth
# allocation failing, for N over the whole range that a run with none failing counts, in an
# ASan+UBSan build with -DTALLY_ALLOC_FAULTS=ON (daemon/base/td_alloc_fault.h), leak detection on.
#
#   scripts/alloc-sweep.sh [-B DIR] [--build] [--runs R | --stride S] [--from N] [--to N]
#                          [--jobs J] [--time-limit SEC] [--persist] [--fleet]
#
#   -B DIR          the build (default build-alloc; --build configures and builds it there)
#   --runs R        about R runs spread evenly over the range (stride = range / R)
#   --stride S      every Sth N (default 1: every N, the full sweep)
#   --from/--to N   a part of the range (default 1 to the count plus a tenth: the count varies
#                   a little from run to run with the threads' timing)
#   --jobs J        runs at once (default 1)
#   --time-limit S  start no run after S seconds (the CTest form); 0: none
#   --persist       every allocation from N on fails (TALLYD_ALLOC_FAIL_PERSIST)
#   --fleet         a fleet worker against a nats-server of each run's own, only the fleet's
#                   allocations (daemon/nats/) numbered (77, skipped: a build without NATS, or
#                   no nats-server: $TALLY_NATS_SERVER or nats-server on the PATH)
# Prints a line per run, then the sites that failed and a summary; exits 1 when a run failed
# (its line is followed by tallyd's log; the run's directory in /tmp is kept).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
B=build-alloc BUILD=0 RUNS=0 STRIDE=1 FROM=1 TO=0 JOBS=1 LIMIT=0 PERSIST="" FLEET=""
while [ $# -gt 0 ]; do
  case "$1" in
  -B) B=$2; shift ;;
  --build) BUILD=1 ;;
  --runs) RUNS=$2; shift ;;
  --stride) STRIDE=$2; shift ;;
  --from) FROM=$2; shift ;;
  --to) TO=$2; shift ;;
  --jobs) JOBS=$2; shift ;;
  --time-limit) LIMIT=$2; shift ;;
  --persist) PERSIST=persist ;;
  --fleet) FLEET=--fleet ;;
  *) sed -n '2,/^set /p' "$0" | sed '$d'; exit 2 ;;
  esac
  shift
done
if [ "$BUILD" = 1 ]; then
  cmake -S . -B "$B" -DTALLY_WERROR=ON -DTALLY_SANITIZE=ON -DTALLY_ALLOC_FAULTS=ON -DTALLY_CUDA=OFF \
    -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER_LAUNCHER=ccache >/dev/null &&
    cmake --build "$B" -j2 --target tallyd alloc_workload >/dev/null || exit 1
fi
B=$(cd "$B" 2>/dev/null && pwd) || { echo "no build directory"; exit 2; }
DRIVER=$B/tests/alloc_workload
[ -x "$DRIVER" ] || { echo "no $DRIVER: configure $B with -DTALLY_ALLOC_FAULTS=ON (or pass --build)"; exit 2; }
if [ -n "$FLEET" ] && ! command -v "${TALLY_NATS_SERVER:-nats-server}" >/dev/null; then
  echo "nats-server not found: skipped"
  exit 77
fi
export TALLYD_BIN=$B/daemon/tallyd TALLY_STATE_FIXTURE=$PWD/tests/data/state-v3/streams.state
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export LSAN_OPTIONS=suppressions=$PWD/tests/lsan/libzmq.supp

# The range: one run with nothing failing counts the allocations (and checks the load).
first=$("$DRIVER" $FLEET 0)
case $? in
0) ;;
77) echo "$first"; exit 77 ;; # --fleet in a build without NATS
*) echo "$first"; echo "the run with no allocation failing failed"; exit 1 ;;
esac
echo "$first"
count=$(sed -n 's/.*counted \([0-9]*\).*/\1/p' <<<"$first" | head -1)
[ "${count:-0}" -gt 0 ] || { echo "no count in: $first"; exit 1; }
[ "$TO" -gt 0 ] || TO=$((count + count / 10))
[ "$RUNS" -gt 0 ] && STRIDE=$(((TO - FROM + RUNS) / RUNS))
echo "range $FROM..$TO of $count counted, stride $STRIDE, $JOBS at once${LIMIT:+, time limit $LIMIT s}"

out=$(mktemp /tmp/alloc-sweep.XXXXXX)
deadline=0
[ "$LIMIT" -gt 0 ] && deadline=$(($(date +%s) + LIMIT))
export DRIVER PERSIST FLEET deadline
seq "$FROM" "$STRIDE" "$TO" | xargs -P "$JOBS" -I{} bash -c \
  '[ "$deadline" = 0 ] || [ "$(date +%s)" -lt "$deadline" ] || exit 0; "$DRIVER" $FLEET {} $PERSIST' |
  tee "$out" | grep -E '^(alloc|FAIL)'
runs=$(grep -c '^alloc ' "$out")
failed=$(grep -c '^FAIL' "$out")
echo "== sites failed on purpose (runs, site):"
grep -o 'failing allocation [0-9]* ([a-z_]* at [^)]*)' "$out" | sed 's/.*(\(.*\))/\1/' | sort | uniq -c |
  sort -rn | head -40
echo "== $runs runs: $(grep -c ': served' "$out") served, $(grep -c ': start-up refused' "$out")" \
  "refused at start-up, $failed failed (range $FROM..$TO, stride $STRIDE)"
if [ "$failed" -gt 0 ]; then
  grep -B1 '^FAIL' "$out" | grep '^alloc'
  echo "(whole output: $out)"
  exit 1
fi
rm -f "$out"
