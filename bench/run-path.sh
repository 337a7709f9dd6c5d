#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/run-path.sh BUILD_DIR OUT_DIR — issue 9's benchmark, everything in one run (one device
# call), so every ratio compares figures of the same machine and minute:
#   1. PCIe ceiling: pinned H2D, D2H and both at once, 64 MiB (bench/pcie_bench);
#   2. raw ZeroMQ fan-in (bench/fanin): 8 producer processes x 8 in flight, 1 MiB requests,
#      echo and 2 KiB replies, 1 and N I/O threads, ipc and tcp; and 1 producer;
#   3. tallyd over ZeroMQ: hist 1 MiB, 8 producers x 8 and 1 x 8, ipc and tcp, --backend cuda and
#      cpu; and --io-threads 1 against the default (the A/B that picks the default). The 8 x 8
#      producers send zero-copy (tally_send_zc), as the fan-in's do, so the ratio compares tallyd
#      with the transport for one producer code path; a row with tally_send's copy stands beside
#      it. Every 8-producer run connects its producers STAGGER_MS apart (default 50), because
#      connections that arrive together share ZeroMQ I/O threads and the figure would then
#      measure where they landed (bench/NOTES.md);
#   4. tallyd over shared memory: hist / filter / scan (output regions), GPU and CPU, 1 x 8 and
#      8 x 4, and single 256 MiB requests one in flight (split over the device's lanes);
#   4b. shared-memory requests one in flight, 16 KiB - 4 MiB, GPU against CPU p50 (the auto
#      threshold TD_GPU_MIN_BATCH_SHM);
#   4c. on a host with 2+ GPUs: shared-memory hist, 2 and 4 producers, one GPU against all;
#   5. 4 KiB requests, one in flight: ZeroMQ echo p50 against tallyd (auto) p50;
# then the ratios the issue's targets name. With perf installed, a profile of the GPU tallyd under
# the ZeroMQ 8 x 8 load goes to OUT_DIR/perf-hist8x8.txt; without, its threads' CPU shares go
# into OUT_DIR/path.md (bench/thread-cpu.sh). Markdown in OUT_DIR/path.md (rows, then ratios),
# `key GB/s p50` lines in OUT_DIR/results.txt, every tallyd's log and stderr in OUT_DIR.
# SECONDS_PER_RUN (default 1.2) sets each run's measured time; the whole run takes about 3 min.
# GPU_ARGS (default "--backend cuda") is the GPU tallyd's backend: "--backend cuda
# --test-sim-gpus 1" tries the script on a machine without a GPU (the PCIe step is then skipped).
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-env.sh
. "$(dirname "$0")/bench-env.sh"
T=${SECONDS_PER_RUN:-1.2}
GPU_ARGS=${GPU_ARGS:---backend cuda}
MD="$OUT/path.md"
RES="$OUT/results.txt"
ERR="$OUT/runs.err"
ST=(--stagger-ms "${STAGGER_MS:-50}")
IO=$(nproc | awk '{n = int($1 / 4); print n < 1 ? 1 : (n > 4 ? 4 : n)}') # tallyd's default
RUN=/tmp/tallyd-path-$$
mkdir -p "$RUN"
BENCH_TMP=$RUN
: >"$RES"
: >"$ERR"

port=5810
start_tallyd() { # name args...: tcp on the next port, ipc in $RUN, its own side channel
  local name=$1
  shift
  port=$((port + 1))
  "$TD" --bind "tcp://127.0.0.1:$port" --bind "ipc://$RUN/$name.ipc" --shm-socket "$RUN/$name.sock" \
    --log-level notice "$@" >"$OUT/tallyd-$name.log" 2>&1 &
  pids+=($!)
  eval "PID_$name=$!"
  eval "TCP_$name=tcp://127.0.0.1:$port"
}
ep() { # name transport
  if [ "$2" = tcp ]; then eval "echo \$TCP_$1"; else echo "ipc://$RUN/$1.ipc"; fi
}
# row KEY command...: runs a loadgen or fanin command (30 s at most), appends its markdown row
# and records "KEY GB/s p50" (columns 6 and 7 of the row).
row() {
  local key=$1 out
  shift
  out=$(timeout 30 "$@" 2>>"$ERR" | grep '^| ' | grep -v -e '^| run | op |' -e '^|---' | tail -1)
  if [ -z "$out" ]; then
    echo "| $key | FAILED: $* |" >>"$MD"
    echo "$key nan nan" >>"$RES"
    return
  fi
  echo "$out" | sed "s/^| [^|]* |/| $key |/" >>"$MD"
  echo "$out" | awk -F'|' -v k="$key" '{gsub(/ /, "", $7); gsub(/ /, "", $8); print k, $7, $8}' >>"$RES"
}
table() {
  printf '\n## %s\n\n| run | op | size | producers x window | req/s | GB/s | p50 us | p99 us | p99.9 us | answered | errors | VmHWM MiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n' "$1" >>"$MD"
}

echo "# issue 9 path benchmark: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(nproc) cores, $(date -u '+%F %H:%M') UTC" >"$MD"
t0=$SECONDS

# ---- 1. PCIe ceiling ------------------------------------------------------------------------
if [ -x "$B/bench/pcie_bench" ]; then
  timeout 60 "$B/bench/pcie_bench" --mib 64 --reps 20 >"$OUT/pcie.txt" 2>>"$ERR"
  while read -r k v; do echo "pcie_$k $v nan" >>"$RES"; done <"$OUT/pcie.txt"
  printf '\n## PCIe ceiling, 64 MiB pinned (cudaMallocHost), GB/s\n\n' >>"$MD"
  sed 's/^/    /' "$OUT/pcie.txt" >>"$MD"
fi

# ---- tallyds --------------------------------------------------------------------------------
# shellcheck disable=SC2086
start_tallyd gpu $GPU_ARGS
start_tallyd cpu --backend cpu --max-batch 256M
start_tallyd auto --backend auto
# shellcheck disable=SC2086
start_tallyd gpuio1 $GPU_ARGS --io-threads 1
# shellcheck disable=SC2086
start_tallyd gpubig $GPU_ARGS --max-batch 256M --shm-max-bytes 4G
"$LG" --serve-echo "tcp://127.0.0.1:5809" "ipc://$RUN/echo.ipc" >"$OUT/echo.log" 2>&1 &
pids+=($!)
TCP_echo=tcp://127.0.0.1:5809

# ---- 2. raw ZeroMQ fan-in (runs while the tallyds start) ------------------------------------
table "raw ZeroMQ fan-in: one ROUTER, one application thread, producer processes (GB/s = request bytes)"
for tr in ipc tcp; do
  for io in 1 "$IO"; do
    for reply in echo 2048; do
      if [ $tr = tcp ]; then e=tcp://127.0.0.1:0; else e="ipc://$RUN/fanin.ipc"; fi
      row "fanin_${tr}_io${io}_${reply}_8x8" "$FI" --endpoint "$e" --producers 8 --window 8 \
        --size 1048576 --reply $reply --io-threads "$io" --seconds "$T" "${ST[@]}"
    done
  done
  row "fanin_${tr}_io${IO}_2048_1x8" "$FI" --endpoint "$e" --producers 1 --window 8 \
    --size 1048576 --reply 2048 --io-threads "$IO" --seconds "$T"
done

# ---- 3. tallyd over ZeroMQ ------------------------------------------------------------------
sleep 1 # the pinned staging of the GPU tallyds (gpubig: 256 MiB slots) takes a moment
table "tallyd hist over ZeroMQ, 1 MiB (payload path)"
for tr in ipc tcp; do
  for be in gpu cpu; do
    row "td_${tr}_${be}_hist_8x8" "$LG" --endpoint "$(ep $be $tr)" --op hist --size 1048576 \
      --producers 8 --window 8 --seconds "$T" --send zc "${ST[@]}"
    row "td_${tr}_${be}_hist_1x8" "$LG" --endpoint "$(ep $be $tr)" --op hist --size 1048576 \
      --producers 1 --window 8 --seconds "$T"
  done
  row "td_${tr}_gpu_hist_8x8_copy" "$LG" --endpoint "$(ep gpu $tr)" --op hist --size 1048576 \
    --producers 8 --window 8 --seconds "$T" --send copy "${ST[@]}"
  row "td_${tr}_gpuio1_hist_8x8" "$LG" --endpoint "$(ep gpuio1 $tr)" --op hist --size 1048576 \
    --producers 8 --window 8 --seconds "$T" --send zc "${ST[@]}"
done

# Where tallyd's time goes on the ZeroMQ path (issue 9 B): a perf profile of the GPU tallyd
# under the 8 x 8 hist load over ipc, when perf is installed (perf-hist8x8.txt).
if command -v perf >/dev/null 2>&1; then
  "$LG" --endpoint "$(ep gpu ipc)" --op hist --size 1048576 --producers 8 --window 8 \
    --seconds 3 --send zc "${ST[@]}" >/dev/null 2>>"$ERR" &
  lgpid=$!
  sleep 1
  # shellcheck disable=SC2154
  timeout 20 perf record -g -o "$OUT/perf.data" -p "$PID_gpu" -- sleep 2 >/dev/null 2>>"$ERR"
  wait $lgpid
  { # by thread first (tallyd = the loop thread and libuv's workers, tdlane-D.L the GPU lanes,
    # ZMQbg/IO/N ZeroMQ's I/O threads), then by function
    timeout 60 perf report -i "$OUT/perf.data" --stdio --no-children --sort comm
    timeout 60 perf report -i "$OUT/perf.data" --stdio --no-children --percent-limit 1
  } >"$OUT/perf-hist8x8.txt" 2>>"$ERR"
  rm -f "$OUT/perf.data"
  echo "(perf profile of the GPU tallyd under hist 1 MiB 8 x 8, ipc: perf-hist8x8.txt)" >>"$MD"
else # no perf (the GPU host): each thread's share of a core, from /proc (bench/thread-cpu.sh)
  "$LG" --endpoint "$(ep gpu ipc)" --op hist --size 1048576 --producers 8 --window 8 \
    --seconds 3 --send zc "${ST[@]}" >/dev/null 2>>"$ERR" &
  lgpid=$!
  sleep 1
  { echo; echo "Threads of the GPU tallyd under hist 1 MiB 8 x 8, ipc (% of one core over 2 s):"; echo
    bash "$(dirname "$0")/thread-cpu.sh" "$PID_gpu" 2 | head -14 | sed 's/^/    /'; } >>"$MD"
  wait $lgpid
fi

# ---- 4. tallyd over shared memory -------------------------------------------------------------
table "tallyd over shared memory (ipc for the references; GB/s = input bytes)"
for be in gpu cpu; do
  for size in 1048576 4194304 16777216; do
    row "shm_${be}_hist_${size}_1x8" "$LG" --endpoint "$(ep $be ipc)" --op hist --size $size \
      --producers 1 --window 8 --seconds "$T" --shm
  done
  row "shm_${be}_hist_16777216_8x4" "$LG" --endpoint "$(ep $be ipc)" --op hist --size 16777216 \
    --producers 8 --window 4 --seconds "$T" --shm
  for op in filter scan; do
    row "shm_${be}_${op}_16777216_1x8" "$LG" --endpoint "$(ep $be ipc)" --op $op \
      --size 16777216 --producers 1 --window 8 --seconds "$T" --shm-out
  done
done
# One 256 MiB request at a time: only splitting it over the lanes can use the whole link.
for be in gpubig cpu; do
  row "shm_${be}_hist_256M_1x1" "$LG" --endpoint "$(ep $be ipc)" --op hist --size 268435456 \
    --producers 1 --window 1 --seconds 2 --shm
  row "shm_${be}_scan_256M_1x1" "$LG" --endpoint "$(ep $be ipc)" --op scan --size 268435456 \
    --producers 1 --window 1 --seconds 2 --shm-out
done

# ---- 4b. auto threshold for shared-memory requests (TD_GPU_MIN_BATCH_SHM) --------------------
# One request in flight by reference (filter and scan into an output region), GPU forced against
# the CPU backend: the smallest size from which the GPU's p50 is never worse is the threshold.
table "shared memory, one in flight: GPU (--backend cuda) against CPU p50, for the auto threshold"
for op in hist filter scan; do
  mode=--shm-out
  [ $op = hist ] && mode=--shm
  for size in 16384 65536 262144 1048576 4194304; do
    for be in gpu cpu; do
      row "xshm_${be}_${op}_$size" "$LG" --endpoint "$(ep $be ipc)" --op $op --size $size \
        --producers 1 --window 1 --seconds 0.6 $mode
    done
  done
done

# ---- 4c. one GPU against all (only on a host with two or more) ---------------------------------
NGPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -c .)
if [ "${NGPU:-0}" -ge 2 ]; then
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=0 start_tallyd one $GPU_ARGS
  sleep 2
  table "shared-memory hist 16 MiB: one GPU (CUDA_VISIBLE_DEVICES=0) against all $NGPU"
  for p in 2 4; do
    for be in one gpu; do
      row "multi_${be}_hist_${p}x8" "$LG" --endpoint "$(ep $be ipc)" --op hist --size 16777216 \
        --producers $p --window 8 --seconds "$T" --shm
    done
  done
fi

# ---- 5. 4 KiB latency ------------------------------------------------------------------------
table "4 KiB, one in flight: echo against tallyd (auto)"
for tr in tcp ipc; do
  row "lat_${tr}_echo" "$LG" --endpoint "$(ep echo $tr)" --op echo --size 4096 --window 1 \
    --seconds 1.5
  for op in hist filter scan; do
    row "lat_${tr}_auto_$op" "$LG" --endpoint "$(ep auto $tr)" --op $op --size 4096 --window 1 \
      --seconds 1.5
  done
done

# ---- ratios ---------------------------------------------------------------------------------
{
  printf '\n## Ratios (targets from issue 9)\n\n| what | value | target |\n|---|---|---|\n'
  awk -v io="$IO" '
    { gb[$1] = $2; p50[$1] = $3 }
    function r(a, b) { return (a == "" || b == "" || a == "nan" || b == "nan" || b + 0 == 0) ? "n/a" : sprintf("%.2f", a / b) }
    function min3(a, b, c) { m = a; if (b < m) m = b; if (c < m) m = c; return m }
    END {
      h2d = gb["pcie_h2d"]; d2h = gb["pcie_d2h"]; both = gb["pcie_both"]
      printf "| shm hist 1x8 4 MiB / pinned H2D | %s | >= 0.8 |\n", r(gb["shm_gpu_hist_4194304_1x8"], h2d)
      printf "| shm hist 1x8 16 MiB / pinned H2D | %s | >= 0.8 |\n", r(gb["shm_gpu_hist_16777216_1x8"], h2d)
      fb = h2d == "" ? "" : min3(h2d, d2h, both / 2)
      sb = h2d == "" ? "" : min3(h2d, d2h / 2, both / 3)
      printf "| shm filter 16 MiB, output region / in+out bound (%s) | %s | >= 0.8 |\n", fb, r(gb["shm_gpu_filter_16777216_1x8"], fb)
      printf "| shm scan 16 MiB, int64 output region / bound (%s) | %s | >= 0.8 |\n", sb, r(gb["shm_gpu_scan_16777216_1x8"], sb)
      printf "| shm hist GPU / CPU, 4 MiB 1x8 | %s | >= 3 |\n", r(gb["shm_gpu_hist_4194304_1x8"], gb["shm_cpu_hist_4194304_1x8"])
      printf "| shm hist GPU / CPU, 16 MiB 8x4 | %s | >= 3 |\n", r(gb["shm_gpu_hist_16777216_8x4"], gb["shm_cpu_hist_16777216_8x4"])
      printf "| shm hist one 256 MiB request (split) / pinned H2D | %s | whole copy bandwidth |\n", r(gb["shm_gpubig_hist_256M_1x1"], h2d)
      printf "| shm scan one 256 MiB request (split) / bound | %s | |\n", r(gb["shm_gpubig_scan_256M_1x1"], sb)
      for (t = 0; t < 2; t++) {
        tr = t ? "tcp" : "ipc"
        printf "| %s: tallyd cuda hist 1 MiB 8x8 / raw fan-in (2 KiB replies, %d io) | %s | >= 0.8 |\n", tr, io, r(gb["td_" tr "_gpu_hist_8x8"], gb["fanin_" tr "_io" io "_2048_8x8"])
        printf "| %s: the same, producers copying (tally_send) / raw fan-in | %s | (reference) |\n", tr, r(gb["td_" tr "_gpu_hist_8x8_copy"], gb["fanin_" tr "_io" io "_2048_8x8"])
        printf "| %s: tallyd cpu hist 1 MiB 8x8 / raw fan-in (2 KiB replies, %d io) | %s | >= 0.8 |\n", tr, io, r(gb["td_" tr "_cpu_hist_8x8"], gb["fanin_" tr "_io" io "_2048_8x8"])
        printf "| %s: tallyd cuda hist 8x8, --io-threads 1 / default %d | %s | (A/B) |\n", tr, io, r(gb["td_" tr "_gpuio1_hist_8x8"], gb["td_" tr "_gpu_hist_8x8"])
        printf "| %s: tallyd cuda hist 1 MiB 1x8 (GB/s) / raw fan-in 1x8 | %s / %s | no slower than 3.5 (issue 9: today, ipc) |\n", tr, gb["td_" tr "_gpu_hist_1x8"], r(gb["td_" tr "_gpu_hist_1x8"], gb["fanin_" tr "_io" io "_2048_1x8"])
      }
      if ("multi_one_hist_2x8" in gb)
        for (p = 2; p <= 4; p += 2)
          printf "| shm hist 16 MiB %dx8: all GPUs / one | %s | >= 1.7 |\n", p, r(gb["multi_gpu_hist_" p "x8"], gb["multi_one_hist_" p "x8"])
      split("hist filter scan", xo, " ")
      for (i = 1; i <= 3; i++) {
        cross = "none up to 4 MiB"; row = ""
        nsz = split("16384 65536 262144 1048576 4194304", sz, " ")
        for (j = nsz; j >= 1; j--) {
          g = p50["xshm_gpu_" xo[i] "_" sz[j]]; c = p50["xshm_cpu_" xo[i] "_" sz[j]]
          row = sprintf("%s %s: %s/%s;", row, sz[j] / 1024 " KiB", g, c)
          if (g == "" || c == "" || g == "nan" || c == "nan" || g + 0 > c + 0) break
          cross = sz[j] / 1024 " KiB"
        }
        printf "| shm %s one in flight: GPU p50 never worse than CPU from | %s (gpu/cpu p50 us:%s) | TD_GPU_MIN_BATCH_SHM is 64 KiB |\n", xo[i], cross, row
      }
      for (t = 0; t < 2; t++) {
        tr = t ? "ipc" : "tcp"
        split("hist filter scan", ops, " ")
        for (i = 1; i <= 3; i++)
          printf "| %s 4 KiB %s p50 - echo p50 (us) | %.1f (%s - %s) | <= 10 |\n", tr, ops[i], p50["lat_" tr "_auto_" ops[i]] - p50["lat_" tr "_echo"], p50["lat_" tr "_auto_" ops[i]], p50["lat_" tr "_echo"]
      }
    }' "$RES"
  echo
  echo "whole run: $((SECONDS - t0)) s; errors from the runs: $(grep -c . "$ERR") lines (runs.err)"
} >>"$MD"
bench_stop_all
cat "$MD"
