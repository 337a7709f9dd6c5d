#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# scripts/asan-stop-loop.sh [ROUNDS] — tallyd stopped with SIGTERM under load ROUNDS times in a
# row (default 50) in the ASan+UBSan build, leak detection on (issue 21, item 10): each round
# of tests/test_stop_clean.c starts tallyd (CPU backend, simulated GPUs with 2 I/O threads, or
# CURVE, in turn), leaves pipelined requests, a peer that never reads, shared-memory references,
# a half-received 16 MiB frame, a PUB subscriber and a metrics scrape in flight, sends SIGTERM,
# and fails on any exit status but 0 or any sanitizer report in tallyd's log. Prints one line
# per round and the count of clean stops. The leak libzmq 4.3.4 itself has at such a stop is
# suppressed (tests/lsan/libzmq.supp, as in CTest); NO_SUPPRESSIONS=1 runs without, to see it.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROUNDS=${1:-50}
SUPP=$PWD/tests/lsan/libzmq.supp
[ "${NO_SUPPRESSIONS:-0}" = 1 ] && SUPP=/dev/null
B=build-asan
cmake -S . -B $B -DTALLY_WERROR=ON -DTALLY_SANITIZE=ON -DTALLY_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_C_COMPILER_LAUNCHER=ccache >/dev/null &&
  cmake --build $B -j2 --target tallyd test_stop_clean >/dev/null || exit 1
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  LSAN_OPTIONS=suppressions=$SUPP TALLYD_BIN="$PWD/$B/daemon/tallyd" TALLY_STOP_ROUNDS=$ROUNDS "$B/tests/test_stop_clean" 2>&1 |
  grep -E "^round|clean|ERROR|LINE|tallyd's log|FAILED"
exit "${PIPESTATUS[0]}"
