#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/run-curve.sh BUILD_DIR OUT_DIR — what CURVE costs (issue 11): 8 producers x 8 in flight,
# hist of 1 MiB (and 64 KiB) u8 requests, each run with and without CURVE beside each other, for
# tallyd and for the plain ZeroMQ echo (the transport ceiling), over tcp and ipc. Markdown goes
# to OUT_DIR/curve.md. Keys come from `tally keygen` (a server pair, one client pair shared by
# the producers). GPU_ARGS (default "--backend cuda") are the tallyds' options ("--backend cpu"
# to try it without a GPU); SECONDS_PER_RUN (default 3) each run's measured time.
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-env.sh
. "$(dirname "$0")/bench-env.sh"
T=${SECONDS_PER_RUN:-3}
MD="$OUT/curve.md"
KEYS=$(mktemp -d /tmp/tally-curve-keys.XXXXXX)
BENCH_TMP=$KEYS

mkdir -p "$KEYS/clients"
"$TALLY" keygen "$KEYS/server" >/dev/null || exit 1
"$TALLY" keygen "$KEYS/clients/bench" >/dev/null || exit 1
CURVE=(--server-key "$KEYS/server.pub" --client-key "$KEYS/clients/bench.key")

start_tallyd() { # name port extra-args...
  local name=$1 port=$2
  shift 2
  # shellcheck disable=SC2086
  "$TD" --bind "tcp://127.0.0.1:$port" --bind "ipc:///tmp/tc-$name.ipc" --log-level notice \
    --shm off ${GPU_ARGS:---backend cuda} "$@" 2>"$OUT/tallyd-$name.log" &
  pids+=($!)
}
start_tallyd plain 5711
start_tallyd curve 5712 --curve-secret-key "$KEYS/server.key" --curve-clients-dir "$KEYS/clients"
"$LG" --serve-echo tcp://127.0.0.1:5713 ipc:///tmp/tc-echo.ipc &
pids+=($!)
"$LG" --echo-key "$KEYS/server.key" --serve-echo tcp://127.0.0.1:5714 ipc:///tmp/tc-echo-curve.ipc &
pids+=($!)
sleep 2
ep() { # name transport
  case $2 in
  tcp) case $1 in plain) echo tcp://127.0.0.1:5711 ;; curve) echo tcp://127.0.0.1:5712 ;;
       echo) echo tcp://127.0.0.1:5713 ;; echo-curve) echo tcp://127.0.0.1:5714 ;; esac ;;
  ipc) echo "ipc:///tmp/tc-$1.ipc" ;;
  esac
}
lg() { timeout 60 "$LG" "$@" || echo "| FAILED: loadgen $* (rc $?) |"; }

{
  echo "# CURVE's cost: 8 producers x 8 in flight, hist ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(date -u +%F), tallyd ${GPU_ARGS:---backend cuda})"
  echo
  first=--header
  for tr in tcp ipc; do
    for s in 1048576 65536; do
      common=(--op hist --size $s --producers 8 --window 8 --seconds "$T")
      lg --endpoint "$(ep echo $tr)" --op echo --size $s --producers 8 --window 8 \
        --seconds "$T" --label "$tr echo plain" $first
      first=
      lg --endpoint "$(ep echo-curve $tr)" --op echo --size $s --producers 8 --window 8 \
        --seconds "$T" --label "$tr echo CURVE" "${CURVE[@]}"
      lg --endpoint "$(ep plain $tr)" "${common[@]}" --label "$tr tallyd plain"
      lg --endpoint "$(ep curve $tr)" "${common[@]}" --label "$tr tallyd CURVE" "${CURVE[@]}"
    done
  done
  echo
  grep -h "auth\|curve" "$OUT/tallyd-curve.log" | head -3
} 2>&1 | tee "$MD"
