#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/run-shards.sh BUILD_DIR OUT_DIR — issue 31's tables: tallyd's shards against the plain
# ZeroMQ echo (loadgen --serve-echo) and Redis, small requests, in one run. Writes
# OUT_DIR/shards.md:
#   1. hist u8 64 B, 1 KiB, 4 KiB; 8 and 16 producers x 64 in flight; ipc and tcp; no stream and
#      256 named streams (loadgen --streams 256: spread over the shards); tallyd on SHARDS
#      (default: its default, the cores less the I/O threads and one) beside the echo server
#      with the same ZeroMQ I/O threads (IO_THREADS, default 4, both sides);
#   2. one producer, one in flight, 4 KiB: tallyd's p50 against the echo's;
#   3. scaling: 64 B, 16 producers x 64, ipc, 256 streams, tallyd at 1, 2, 4, 8 and 16 shards
#      (SCALE_SHARDS), with the requests per second each shard answered (loadgen's "per shard"
#      line: an imbalance shows);
#   4. the same load with more ZeroMQ I/O threads on both sides (IO_MORE, default 8) beside
#      `redis-benchmark -t incr,hset -P 64 -c 16` against Debian's redis-server on this host,
#      when both are installed.
# tallyd runs --backend auto (small batches on the CPU) with --max-inflight 4096, so that 16 x 64
# requests in flight stay under every connection's fair share (at the default 64 they would be
# answered `busy`). SECONDS_PER_RUN (default 1) sets each row's measured time.
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-env.sh
. "$(dirname "$0")/bench-env.sh"
bench_setup shards 1
IO=${IO_THREADS:-4}
IO_MORE=${IO_MORE:-8}
SCALE=${SCALE_SHARDS:-1 2 4 8 16}

# tallyd NAME SHARDS IO: a tallyd on ipc and tcp (port from NAME's hash); its pid in TD_PID.
tallyd_up() {
  local name=$1 shards=$2 io=$3 port=$((5800 + RANDOM % 100))
  local args=(--backend auto --shm off --log-level warning --max-inflight 4096 --io-threads "$io")
  [ "$shards" != default ] && args+=(--shards "$shards")
  "$TD" --bind "ipc://$RUN/$name.ipc" --bind "tcp://127.0.0.1:$port" "${args[@]}" \
    2>"$OUT/tallyd-$name.log" &
  TD_PID=$!
  pids+=("$TD_PID")
  TCP_EP=tcp://127.0.0.1:$port
  sleep 1.5
}
tallyd_down() {
  kill "$TD_PID" 2>/dev/null
  wait "$TD_PID" 2>/dev/null
}
echo_up() { # IO
  "$LG" --echo-io-threads "$1" --echo-reply 2048 --serve-echo "ipc://$RUN/echo.ipc" \
    tcp://127.0.0.1:5799 >/dev/null 2>&1 &
  ECHO_PID=$!
  pids+=("$ECHO_PID")
  sleep 1
}
echo_down() {
  kill "$ECHO_PID" 2>/dev/null
  wait "$ECHO_PID" 2>/dev/null
}
lg() { # label endpoint op size producers window extra...
  local label=$1 ep=$2 op=$3 size=$4 p=$5 w=$6
  shift 6
  timeout 60 "$LG" --endpoint "$ep" --op "$op" --size "$size" --producers "$p" --window "$w" \
    --seconds "$T" --label "$label" "$@" 2>>"$OUT/shards.err" || echo "| $label | FAILED |"
}

{
  echo "# Shards against the echo and Redis ($(nproc) cores, $(date -u +%F))"
  echo
  echo "## 1. hist u8, P producers x 64, tallyd (shards: ${SHARDS:-default}) and the echo," \
    "$IO I/O threads each"
  echo
  bench_table_header
  tallyd_up main "${SHARDS:-default}" "$IO"
  echo_up "$IO"
  for tr in ipc tcp; do
    td_ep=ipc://$RUN/main.ipc
    ec_ep=ipc://$RUN/echo.ipc
    [ $tr = tcp ] && td_ep=$TCP_EP && ec_ep=tcp://127.0.0.1:5799
    for size in 64 1024 4096; do
      for p in 8 16; do
        lg "$tr echo" "$ec_ep" echo $size $p 64 | grep '^| '
        lg "$tr tallyd" "$td_ep" hist $size $p 64 | grep '^| '
        lg "$tr tallyd 256 streams" "$td_ep" hist $size $p 64 --streams 256 | grep '^| '
      done
    done
  done
  echo
  echo "## 2. One producer, one in flight, 4 KiB, ipc (p50: tallyd - echo)"
  echo
  bench_table_header
  lg "ipc echo" "ipc://$RUN/echo.ipc" echo 4096 1 1
  lg "ipc tallyd" "ipc://$RUN/main.ipc" hist 4096 1 1
  echo_down
  tallyd_down
  echo
  echo "## 3. Scaling: hist u8 64 B, 16 producers x 64, ipc, 256 streams, $IO I/O threads"
  echo
  bench_table_header
  echo_up "$IO"
  lg "echo" "ipc://$RUN/echo.ipc" echo 64 16 64 | grep '^| '
  echo_down
  for n in $SCALE; do
    tallyd_up "s$n" "$n" "$IO"
    lg "$n shards" "ipc://$RUN/s$n.ipc" hist 64 16 64 --streams 256
    tallyd_down
  done
  echo
  echo "## 4. $IO_MORE I/O threads on both sides, 64 B, 16 producers x 64, ipc, and Redis"
  echo
  bench_table_header
  echo_up "$IO_MORE"
  lg "echo" "ipc://$RUN/echo.ipc" echo 64 16 64 | grep '^| '
  echo_down
  tallyd_up more "${SHARDS:-default}" "$IO_MORE"
  lg "tallyd" "ipc://$RUN/more.ipc" hist 64 16 64 --streams 256
  lg "tallyd, no stream" "ipc://$RUN/more.ipc" hist 64 16 64
  tallyd_down
  if command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null; then
    redis-server --port 6390 --save "" --appendonly no >"$OUT/redis.log" 2>&1 &
    pids+=($!)
    sleep 1
    echo
    echo "redis-benchmark -t incr,hset -P 64 -c 16 (one thread executes):"
    redis-benchmark -p 6390 -t incr,hset -P 64 -c 16 -n 4000000 -q 2>&1 | tr '\r' '\n' |
      grep -E "requests per second" | tail -2
  else
    echo
    echo "redis-server or redis-benchmark not installed: no Redis row"
  fi
} 2>&1 | tee "$MD"
