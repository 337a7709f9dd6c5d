#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/run-loadgen.sh BUILD_DIR OUT_DIR — tallyd end to end beside its transport ceiling.
#
# Starts, on tcp and ipc each: tallyd with the GPU backend (--backend cuda: every batch on the
# GPU), tallyd with the CPU backend, tallyd in auto mode (the default threshold), and the plain
# ZeroMQ echo server (loadgen --serve-echo). Then runs, writing markdown to OUT_DIR/loadgen.md:
#   1. crossover: one request in flight, 1 KiB .. 4 MiB, each op, GPU vs CPU (tcp);
#   2. throughput: 1 producer x 8 in flight, 4 KiB / 64 KiB / 1 MiB / 8 MiB, tcp and ipc, echo,
#      GPU and CPU backends, each op (scan also with int32 output, same size as its request);
#   3. latency: 4 KiB, one in flight, echo vs tallyd (auto, and GPU forced);
#   4. 8 producers x 8 in flight on named streams against a fresh tallyd (auto): every request
#      answered (loadgen exits 1 otherwise) and tallyd's peak RSS (VmHWM).
# SECONDS_PER_RUN (default 1.5) sets each run's measured time; GPU_ARGS (default
# "--backend cuda") the GPU tallyd's options (e.g. "--backend cuda --test-sim-gpus 1" to try the
# script without a GPU).
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-env.sh
. "$(dirname "$0")/bench-env.sh"
T=${SECONDS_PER_RUN:-1.5}
MD="$OUT/loadgen.md"

start_tallyd() { # name port extra-args...
  local name=$1 port=$2
  shift 2
  "$TD" --bind "tcp://127.0.0.1:$port" --bind "ipc:///tmp/tl-$name.ipc" --log-level notice \
    --shm off "$@" 2>"$OUT/tallyd-$name.log" & # off: several at once, one default side channel
  pids+=($!)
  eval "PID_$name=$!"
}
# shellcheck disable=SC2086
start_tallyd gpu 5701 ${GPU_ARGS:---backend cuda}
start_tallyd cpu 5702 --backend cpu
start_tallyd auto 5704 --backend auto
"$LG" --serve-echo tcp://127.0.0.1:5703 ipc:///tmp/tl-echo.ipc &
pids+=($!)
sleep 2
ep() { # name transport
  case $2 in
  tcp) case $1 in gpu) echo tcp://127.0.0.1:5701 ;; cpu) echo tcp://127.0.0.1:5702 ;;
       echo) echo tcp://127.0.0.1:5703 ;; auto) echo tcp://127.0.0.1:5704 ;; esac ;;
  ipc) echo "ipc:///tmp/tl-$1.ipc" ;;
  esac
}
lg() { timeout 60 "$LG" "$@" || echo "| FAILED: loadgen $* (rc $?) |"; }

{
  echo "# tallyd end to end ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(date -u +%F))"
  echo
  echo "## 1. Crossover: one request in flight, tcp, GPU vs CPU backend"
  echo
  first=--header
  for op in hist filter scan; do
    for s in 1024 4096 16384 65536 262144 1048576 4194304; do
      for be in cpu gpu; do
        lg --endpoint "$(ep $be tcp)" --op $op --size $s --window 1 --seconds 0.6 \
          --label "xover $be" $first
        first=
      done
    done
  done
  echo
  echo "## 2. Throughput: 1 producer x 8 in flight"
  echo
  first=--header
  for tr in tcp ipc; do
    for s in 4096 65536 1048576 8388608; do
      lg --endpoint "$(ep echo $tr)" --op echo --size $s --seconds "$T" --label "$tr echo" $first
      first=
      for be in gpu cpu; do
        for op in filter scan hist; do
          lg --endpoint "$(ep $be $tr)" --op $op --size $s --seconds "$T" --label "$tr $be"
        done
        lg --endpoint "$(ep $be $tr)" --op scan --scan-i32 --size $s --seconds "$T" \
          --label "$tr $be"
      done
    done
  done
  echo
  echo "## 3. Latency: 4 KiB, one in flight"
  echo
  first=--header
  for tr in tcp ipc; do
    lg --endpoint "$(ep echo $tr)" --op echo --size 4096 --window 1 --seconds 2 \
      --label "$tr echo" $first
    first=
    for op in hist filter scan; do
      lg --endpoint "$(ep auto $tr)" --op $op --size 4096 --window 1 --seconds 2 \
        --label "$tr auto"
      lg --endpoint "$(ep gpu $tr)" --op $op --size 4096 --window 1 --seconds 2 \
        --label "$tr gpu"
    done
  done
  echo
  echo "## 4. Eight producers x 8 in flight on named streams, fresh tallyd (auto), tcp"
  echo
  bench_stop_all
  start_tallyd p8 5705 --backend auto
  sleep 2
  first=--header
  for op in hist scan filter; do
    for s in 65536 1048576; do
      lg --endpoint tcp://127.0.0.1:5705 --op $op --size $s --producers 8 --window 8 --stream \
        --seconds 3 --pid "$PID_p8" --label "8 producers" $first
      first=
    done
  done
  echo
  echo "tallyd (p8) peak: $(grep -E 'VmHWM|VmRSS' /proc/$PID_p8/status | tr -s ' \n' ' ')"
  grep -E "GPU pipeline|backend" "$OUT/tallyd-p8.log" | head -3
  kill "$PID_p8"
} 2>&1 | tee "$MD"
