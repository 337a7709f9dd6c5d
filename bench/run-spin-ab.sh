#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/run-spin-ab.sh BUILD_DIR OUT_DIR — A/B of --gpu-spin-us on one machine, interleaved so
# that both variants see the same machine state: tallyd --backend cuda with spinning off (A)
# and on (B, $SPIN_US, default 50), 1 producer x 8 in flight at 64 KiB and 1 MiB (tcp, ipc),
# and 4 KiB with one in flight; then the echo for reference. Writes OUT_DIR/spin-ab.md.
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-env.sh
. "$(dirname "$0")/bench-env.sh"
SPIN=${SPIN_US:-50}
"$TD" --bind tcp://127.0.0.1:5711 --bind ipc:///tmp/tl-a.ipc --backend cuda --gpu-spin-us 0 \
  --shm off --log-level notice 2>"$OUT/tallyd-a.log" &
pids+=($!)
"$TD" --bind tcp://127.0.0.1:5712 --bind ipc:///tmp/tl-b.ipc --backend cuda --gpu-spin-us "$SPIN" \
  --shm off --log-level notice 2>"$OUT/tallyd-b.log" &
pids+=($!)
"$LG" --serve-echo tcp://127.0.0.1:5713 ipc:///tmp/tl-e.ipc &
pids+=($!)
sleep 2
ep() { case $1-$2 in a-tcp) echo tcp://127.0.0.1:5711 ;; b-tcp) echo tcp://127.0.0.1:5712 ;;
  e-tcp) echo tcp://127.0.0.1:5713 ;; *) echo "ipc:///tmp/tl-$1.ipc" ;; esac; }
lg() { timeout 60 "$LG" "$@" || echo "| FAILED: loadgen $* |"; }
{
  echo "# --gpu-spin-us A/B: A = 0, B = $SPIN ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F))"
  echo
  first=--header
  for rep in 1 2; do
    for tr in tcp ipc; do
      for s in 65536 1048576; do
        lg --endpoint "$(ep e $tr)" --op echo --size $s --seconds 1 --label "$tr echo r$rep" $first
        first=
        for op in hist filter; do
          for v in a b; do
            lg --endpoint "$(ep $v $tr)" --op $op --size $s --seconds 1 --label "$tr $v r$rep"
          done
        done
      done
      for op in hist scan; do
        for v in a b; do
          lg --endpoint "$(ep $v $tr)" --op $op --size 4096 --window 1 --seconds 1 \
            --label "$tr $v lat r$rep"
        done
      done
    done
  done
} 2>&1 | tee "$OUT/spin-ab.md"
