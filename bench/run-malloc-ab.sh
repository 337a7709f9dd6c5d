#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/run-malloc-ab.sh BUILD_DIR OUT_DIR — does glibc's malloc cost tallyd's ZeroMQ I/O threads
# page faults? ZeroMQ mallocs every received 1 MiB message on an I/O thread; tallyd frees it when
# the request is done, with up to max_inflight (64) alive. A/B: tallyd as is (it sets malloc's
# mmap and trim thresholds at start: TD_MALLOC_* in daemon/base/td_config.h) against glibc's
# defaults (a glibc.malloc tunable that changes nothing, tcache_count=7, makes tallyd leave malloc
# alone), under hist 1 MiB from 8 producers x 8 in flight over ipc (zero-copy producers connecting
# 50 ms apart, as bench/run-recv-ab.sh), alternating, with tallyd's minor page faults per MiB
# received. Markdown in OUT_DIR/malloc.md. GPU_ARGS (default --backend cuda), SECONDS_PER_RUN
# (default 3), ROUNDS (3).
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-env.sh
. "$(dirname "$0")/bench-env.sh"
bench_setup malloc 3
GLIBC_DEFAULTS="glibc.malloc.tcache_count=7"
minflt() { awk '{print $10}' "/proc/$1/stat"; }
{
  echo "| tallyd malloc | round | GB/s | p50 us | minor faults per MiB |"
  echo "|---|---|---|---|---|"
} >"$MD"
for round in $(seq "${ROUNDS:-3}"); do
  for variant in tallyd glibc; do
    tun=""
    [ $variant = glibc ] && tun=$GLIBC_DEFAULTS
    # shellcheck disable=SC2086
    GLIBC_TUNABLES=$tun "$TD" ${GPU_ARGS:---backend cuda} --bind "ipc://$RUN/$variant.ipc" \
      --shm off --log-level notice 2>>"$OUT/tallyd-malloc.log" &
    td=$!
    pids+=($td)
    sleep 1.5
    f0=$(minflt $td)
    out=$("$LG" --endpoint "ipc://$RUN/$variant.ipc" --op hist --size 1048576 --producers 8 \
      --window 8 --seconds "$T" --send zc --stagger-ms 50 2>>"$OUT/malloc.err" | grep '^| ' | grep -v '^| run | op |' | tail -1)
    f1=$(minflt $td)
    gbs=$(echo "$out" | awk -F'|' '{gsub(/ /, "", $7); print $7}')
    p50=$(echo "$out" | awk -F'|' '{gsub(/ /, "", $8); print $8}')
    answered=$(echo "$out" | awk -F'|' '{split($11, a, "/"); gsub(/ /, "", a[1]); print a[1]}')
    per=$(awk -v f=$((f1 - f0)) -v n="${answered:-0}" 'BEGIN { printf "%.1f", (n > 0 ? f / n : 0) }')
    echo "| $variant | $round | $gbs | $p50 | $per |" >>"$MD"
    kill $td
    wait $td 2>/dev/null
  done
done
cat "$MD"
