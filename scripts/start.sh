#!/usr/bin/env bash
# Installs what is missing, builds tallyd (Release) and runs it in the foreground on
# tcp://127.0.0.1:5555. With no usable GPU it serves on the CPU backend. Extra arguments go
# to tallyd (e.g. --backend cpu, --bind ipc:///tmp/tallyd.sock). Stop it with Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF > build.log 2>&1 || {
  cat build.log; exit 1; }
cmake --build build -j"$(nproc)" >> build.log 2>&1 || { tail -50 build.log; exit 1; }
echo "built: build/daemon/tallyd and build/cli/tally (log: build.log)"
exec build/daemon/tallyd "$@"
