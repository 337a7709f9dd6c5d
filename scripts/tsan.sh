#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# scripts/tsan.sh [CTEST_ARGS...] — tallyd and its tests under ThreadSanitizer (issue 31: the
# shards' threads, their mailboxes and the state they share), with every integration test's
# tallyd on 4 shards (TALLYD_TEST_SHARDS=4).
#
# Builds build-tsan with clang (-DTALLY_TSAN=ON: -fsanitize=thread; CUDA off, NATS as found; the
# warnings are the gcc build's business, not -Werror here),
# runs CTest there (CTEST_ARGS, e.g. -R 'test_daemon|test_shm'; default: every test), and fails
# when any process reported a race, a lock-order inversion or another TSan finding, whether or not
# its test noticed: each process writes its reports to build-tsan/tsan/report.PID (TSAN_OPTIONS
# log_path), and any such file is a failure, printed. tests/tsan/tsan.supp lists what is
# suppressed and why (libraries built without TSan); report_signal_unsafe=0 because cmocka's test
# driver allocates in its signal handlers (tallyd does no work in one: libuv forwards signals);
# die_after_fork=0 because some tests fork a child that starts threads before it execs.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
cmake -S . -B build-tsan -DCMAKE_C_COMPILER=clang -DTALLY_TSAN=ON -DTALLY_WERROR=OFF \
  -DTALLY_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-tsan -j"$jobs"
reports="$PWD/build-tsan/tsan"
rm -rf "$reports"
mkdir -p "$reports"
rc=0
(cd build-tsan && TALLYD_TEST_SHARDS=4 \
  TSAN_OPTIONS="log_path=$reports/report second_deadlock_stack=1 history_size=4 report_signal_unsafe=0 die_after_fork=0 suppressions=$PWD/../tests/tsan/tsan.supp" \
  ctest --output-on-failure -j"$jobs" "$@") || rc=$?
found=$(find "$reports" -type f | wc -l)
if [ "$found" -gt 0 ]; then
  for f in "$reports"/*; do
    echo "== $f"
    cat "$f"
  done
  echo "tsan: $found process(es) reported findings (above)"
  exit 1
fi
echo "tsan: no findings (ctest status $rc)"
exit "$rc"
