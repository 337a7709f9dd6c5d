#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# run-nats-fleet-ab.sh prepare REV | run — a fleet worker's cost a message, commit REV against this
# tree, in one run on one host (issue 32: two calls on two H100 hosts differed x 1.5 in the bare
# consumers alone; bench/NOTES.md "A worker's cost a message, 373726e against main").
#   prepare REV (where git is: the dev box): REV's tree into build-ab/base-src (ignored, as the
#     builds are); carry build-ab and .deps (scripts/fetch-device-deps.sh) to the GPU host;
#   run: builds both trees CPU-only (tallyd and nats_bench, -j of the cores; the scripts' own
#     cmake steps; scripts/device-env.sh first where .deps is and libzmq is not), then bench/run-nats-fleet.sh of
#     each tree with its own build (ONLY=rates LEASE_MS=30000 SIZES=1024:COUNT TALLYD_ARGS="--backend
#     cpu"; COUNT default 300000, PIN default 1) in turn, A B B A, PAIRS pairs (default 4), each
#     round cut at ROUND_S seconds (default 150). Everything goes to AB_OUT (default
#     build-ab/ab.txt), the host's CPU map first; compare the rounds' "CPU a message" (and bare).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
case "${1:-}" in
prepare)
  [ $# -eq 2 ] || { echo "usage: $0 prepare REV" >&2; exit 2; }
  rm -rf build-ab/base-src && mkdir -p build-ab/base-src &&
    git archive "$2" | tar -x -C build-ab/base-src && git rev-parse "$2" >build-ab/base-rev
  exit $?
  ;;
run) ;;
*) echo "usage: $0 prepare REV | run" >&2; exit 2 ;;
esac
[ -d build-ab/base-src ] || { echo "$0: no build-ab/base-src (run prepare first)" >&2; exit 2; }
if [ -d .deps/debs ] && ! pkg-config --exists libzmq; then # the GPU host: its libraries carried
  # shellcheck source=../scripts/device-env.sh
  . scripts/device-env.sh
fi
o=${AB_OUT:-build-ab/ab.txt}
{
  echo "# base $(cat build-ab/base-rev 2>/dev/null || echo '?') against this tree; $(nproc) cores;" \
    "$(date -u '+%F %T UTC')"
  nvidia-smi -L 2>/dev/null
  lscpu | grep -E '^(Model name|Thread|Core|Socket|NUMA node\()'
  lscpu -e=CPU,CORE,SOCKET,NODE
} >"$o" 2>&1
build() { # build SRC DIR
  (cd "$1" && cmake -S . -B "$2" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTALLY_CUDA=OFF >/dev/null &&
    cmake --build "$2" -j"$(nproc)" --target tallyd nats_bench >/dev/null)
}
build . build-ab/new >"$o.build-new.log" 2>&1 &
build build-ab/base-src build >"$o.build-base.log" 2>&1 &
wait
if [ ! -x build-ab/new/daemon/tallyd ] || [ ! -x build-ab/base-src/build/daemon/tallyd ]; then
  echo "# a build failed (see $o.build-*.log)" >>"$o"
  exit 1
fi
echo "# built $(date -u +%T)" >>"$o"
one() { # one base|new ROUND
  local src=. b=build-ab/new
  [ "$1" = base ] && src=build-ab/base-src && b=build
  echo "== round $2 $1 $(date -u +%T)" >>"$o"
  (cd "$src" && BUILD=$b TALLYD_ARGS="--backend cpu" PIN=${PIN:-1} ONLY=rates LEASE_MS=30000 \
    SIZES=1024:${COUNT:-300000} timeout "${ROUND_S:-150}" bench/run-nats-fleet.sh) >>"$o" 2>&1
}
for ((r = 1; r <= ${PAIRS:-4}; r++)); do
  if ((r % 2)); then one base "$r"; one new "$r"; else one new "$r"; one base "$r"; fi
done
echo "# end $(date -u +%T)" >>"$o"
