#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what is missing, builds tallyd (Release) and runs it in the foreground on
# tcp://127.0.0.1:5555. With no usable GPU it serves on the CPU backend. Extra arguments go
# to tallyd (e.g. --backend cpu, --bind ipc:///tmp/tallyd.sock). Stop it with Ctrl-C.
# With --nats (first): also a local NATS JetStream server on nats://127.0.0.1:4222 (its store in
# build/nats-store) and tallyd as the one worker of a fleet (docs/fleet.md); both stop
# together.
# It says what it is doing at each step; the full build output goes to build/build.log
# (inside the ignored build folder, so the checkout stays clean).
set -euo pipefail
cd "$(dirname "$0")/.."
nats=0
if [ "${1:-}" = "--nats" ]; then
  nats=1
  shift
fi
echo "== checking build dependencies (scripts/install-deps.sh)"
scripts/install-deps.sh
mkdir -p build
log=build/build.log
echo "== configuring (cmake; log: $log)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF >"$log" 2>&1 || {
  cat "$log"; exit 1; }
echo "== building with $(nproc) jobs (a minute or two on a small machine; the CUDA kernels take longest)"
# One line per finished target, so a long build is never silent.
set +e
cmake --build build -j"$(nproc)" 2>&1 | tee -a "$log" | grep --line-buffered 'Built target' |
  sed -u 's/^/   /'
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ] || [ ! -x build/daemon/tallyd ]; then
  echo "build failed; the end of $log:"
  tail -50 "$log"
  exit 1
fi
if [ "$nats" -eq 0 ]; then
  echo "== built build/daemon/tallyd and build/cli/tally; starting tallyd (Ctrl-C stops it)"
  exec build/daemon/tallyd "$@"
fi
echo "== starting a local NATS JetStream server on nats://127.0.0.1:4222 (log: build/nats.log)"
mkdir -p build/nats-store
printf 'listen: 127.0.0.1:4222\nmax_payload: 8MB\njetstream { store_dir: "%s" }\n' \
  "$PWD/build/nats-store" >build/nats-local.conf
nats-server -c build/nats-local.conf >build/nats.log 2>&1 &
nats_pid=$!
trap 'kill "$nats_pid" 2>/dev/null; wait "$nats_pid" 2>/dev/null' EXIT
for _ in $(seq 50); do
  grep -q "Server is ready" build/nats.log && break
  sleep 0.1
done
echo "== starting tallyd as the fleet's one worker (replicas 1; Ctrl-C stops both)"
build/daemon/tallyd --nats-servers nats://127.0.0.1:4222 --nats-replicas 1 "$@"
