#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# scripts/coverage.sh — line and branch coverage of the whole CTest suite, by folder, against
# the floors in tests/coverage-floors.txt (issue 37). Builds the CPU build with gcc --coverage
# (atomic counters: tallyd's threads update them at once) and the allocation-failure hooks;
# runs every test of CTest, then the allocation-failure sweep over every N (scripts/alloc-sweep.sh,
# instead of CTest's sample of it; the fleet's too, with NATS); prints the table by folder (gcovr, Debian's gcovr, through
# scripts/coverage-table.py) and fails when a test fails or a folder is under its floor.
#
#   scripts/coverage.sh [-B DIR] [--no-build] [--no-test] [--raise] [--html]
#
#   -B DIR      the build (default build-cov)
#   --no-build  use DIR as it is (built before)
#   --no-test   report what DIR's counters hold now (after a run of your own, say ctest -R x)
#   --raise     rewrite the floors: each raised to what was measured less half a point (the
#               threads' timing moves a few branches from run to run), never lowered; commit it
#   --html      also DIR/coverage/index.html, line by line
# The floors only go up: test_coverage_floors (CTest) fails when a change lowers one.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
B=build-cov BUILD=1 TEST=1 RAISE="" HTML=0
while [ $# -gt 0 ]; do
  case "$1" in
  -B) B=$2; shift ;;
  --no-build) BUILD=0 ;;
  --no-test) TEST=0 ;;
  --raise) RAISE=--raise ;;
  --html) HTML=1 ;;
  *) sed -n '2,/^set /p' "$0" | sed '$d'; exit 2 ;;
  esac
  shift
done
command -v gcovr >/dev/null || { echo "no gcovr: apt-get install gcovr (scripts/install-deps.sh)"; exit 2; }
jobs=$(nproc)
start=$(date +%s)
if [ "$BUILD" = 1 ]; then
  echo "== coverage build ($B)"
  # libgcov's own symbols stay out of libtally's exports (test_install checks them).
  cmake -S . -B "$B" -DTALLY_WERROR=ON -DTALLY_CUDA=OFF -DTALLY_ALLOC_FAULTS=ON \
    -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS="--coverage -fprofile-update=atomic" \
    -DCMAKE_EXE_LINKER_FLAGS=--coverage \
    "-DCMAKE_SHARED_LINKER_FLAGS=--coverage -Wl,--exclude-libs,libgcov.a" >/dev/null || exit 1
  cmake --build "$B" -j"$jobs" >"$B/build.log" 2>&1 || { tail -50 "$B/build.log"; exit 1; }
fi
[ -d "$B" ] || { echo "no build directory $B"; exit 2; }
tests_rc=0
if [ "$TEST" = 1 ]; then
  echo "== the CTest suite with coverage"
  find "$B" -name '*.gcda' -delete
  # The allocation sweep whole (every N: scripts/alloc-sweep.sh) rather than CTest's sample.
  (cd "$B" && ctest --output-on-failure -j"$jobs" -E '^test_alloc_sweep(_fleet)?$') || tests_rc=1
  echo "== the allocation-failure sweep, every allocation ($(($(date +%s) - start)) s so far)"
  scripts/alloc-sweep.sh -B "$B" --jobs "$jobs" >"$B/alloc-sweep.log" 2>&1 || {
    tail -40 "$B/alloc-sweep.log"; tests_rc=1; }
  tail -1 "$B/alloc-sweep.log"
  # The fleet's allocations (daemon/nats/) under a fleet worker, where NATS is built and a
  # nats-server is at hand (77: skipped).
  if [ -x "$B/tests/alloc_workload" ]; then
    echo "== the allocation-failure sweep of the fleet ($(($(date +%s) - start)) s so far)"
    scripts/alloc-sweep.sh -B "$B" --fleet --jobs "$jobs" >"$B/alloc-sweep-fleet.log" 2>&1
    rc=$?
    [ "$rc" = 0 ] || [ "$rc" = 77 ] || { tail -40 "$B/alloc-sweep-fleet.log"; tests_rc=1; }
    tail -1 "$B/alloc-sweep-fleet.log"
  fi
fi
echo "== coverage by folder ($(($(date +%s) - start)) s so far)"
# Counters written by processes killed mid-update can be off (gcov prints a negative count):
# such lines are skipped with a warning instead of stopping the report.
gcovr -r . --object-directory "$B" -e 'tests/' -e 'bench/' -e "$B/" \
  --gcov-ignore-parse-errors --json-summary "$B/coverage.json" 2>"$B/gcovr.log" || {
  cat "$B/gcovr.log"; exit 1; }
if [ "$HTML" = 1 ]; then
  mkdir -p "$B/coverage"
  gcovr -r . --object-directory "$B" -e 'tests/' -e 'bench/' -e "$B/" \
    --gcov-ignore-parse-errors --html-details "$B/coverage/index.html" 2>>"$B/gcovr.log"
  echo "line by line: $B/coverage/index.html"
fi
python3 scripts/coverage-table.py "$B/coverage.json" tests/coverage-floors.txt $RAISE
floors_rc=$?
echo "coverage: $(($(date +%s) - start)) s"
[ "$tests_rc" = 0 ] || echo "coverage: a test failed (above)"
[ "$tests_rc" = 0 ] && [ "$floors_rc" = 0 ]
