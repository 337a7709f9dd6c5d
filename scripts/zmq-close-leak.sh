#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# scripts/zmq-close-leak.sh [RUNS] — the evidence behind tests/lsan/libzmq.supp: builds
# tests/lsan/zmq_close_leak.c (libzmq alone, no tallyd code) with AddressSanitizer against the
# system's libzmq and runs it RUNS times (default 10), each on a free port, counting the runs in
# which LeakSanitizer reports a leak (without the suppressions). On Debian 12's libzmq 4.3.4 it
# leaked in about 6 of 10 (2026-11-26, 2-core dev box).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
RUNS=${1:-10}
tmp=$(mktemp -d /tmp/zmq-close-leak.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
cc -fsanitize=address -g tests/lsan/zmq_close_leak.c -o "$tmp/leak" -lzmq -lpthread || exit 1
leaked=0
for i in $(seq "$RUNS"); do
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  ASAN_OPTIONS=detect_leaks=1 LSAN_OPTIONS= timeout 60 "$tmp/leak" "$port" $((500 + i * 37)) \
    >"$tmp/run.txt" 2>&1
  if grep -q "ERROR: LeakSanitizer" "$tmp/run.txt"; then
    leaked=$((leaked + 1))
    [ $leaked = 1 ] && sed -n '/Direct leak/,/^$/p' "$tmp/run.txt" | head -4
  fi
done
echo "libzmq $(pkg-config --modversion libzmq 2>/dev/null): $leaked of $RUNS runs leaked"
