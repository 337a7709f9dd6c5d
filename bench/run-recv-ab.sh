#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/run-recv-ab.sh BUILD_DIR OUT_DIR — what separates tallyd's ZeroMQ path from the raw
# transport (issue 9 B; bench/NOTES.md, "The producers, not the receive buffers"). Under hist
# 1 MiB from 8 producers x 8 in flight over ipc, 4 ZeroMQ I/O threads on the receiving side,
# producers connecting STAGGER_MS apart (default 50: every I/O thread gets connections), ROUNDS
# rounds (default 2):
#   - the raw fan-in as in bench/run-path.sh (producer processes sending zero-copy), with
#     producers that copy each payload into a new message as libtally's tally_send does (--send
#     copy), and with the server holding the last 64 payloads open as tallyd holds its
#     requests' until they are staged (--hold 64);
#   - loadgen's producers (libtally) against loadgen's raw ROUTER answering 2 KiB
#     (--echo-reply 2048): the transport ceiling for the very producers that load tallyd, with
#     tally_send (a copy) and tally_send_zc (--send zc);
#   - the same raw ROUTER handing each payload to one of 4 threads that copy it out (--echo-touch
#     4), as tallyd's 4 lane threads copy payloads into pinned staging;
#   - tallyd with glibc keeping freed memory in its heap (GLIBC_TUNABLES, as run-malloc-ab.sh);
#   - tallyd with the same two producers; 8 x 8 from two loadgen processes of 4 x 8 at once;
#     --io-threads 8.
# Then per-thread CPU (bench/thread-cpu.sh) of tallyd, of the raw ROUTER and of the loadgen
# process under 8 x 8 zc. Markdown in OUT_DIR/recv-ab.md. GPU_ARGS (default --backend cuda),
# SECONDS_PER_RUN (default 2).
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-env.sh
. "$(dirname "$0")/bench-env.sh"
bench_setup recv-ab 2
ST=(--stagger-ms "${STAGGER_MS:-50}")
# glibc keeps freed memory in the heap (bench/run-malloc-ab.sh): no page faults on receive
KEEP_HEAP="glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=1073741824"
LOAD=(--size 1048576 --window 8 --seconds "$T")
start() { # name command...: starts a server on ipc://$RUN/name.ipc; its pid in $srv
  local name=$1
  shift
  "$@" 2>>"$OUT/$name.log" &
  srv=$!
  pids+=("$srv")
  sleep 1.5 # tallyd's pinned staging
}
stop() {
  kill $srv
  wait $srv 2>/dev/null
}
tallyd() { # name [tallyd options]
  local name=$1
  shift
  # shellcheck disable=SC2086
  start "$name" "$TD" ${GPU_ARGS:---backend cuda} --bind "ipc://$RUN/$name.ipc" --shm off \
    --log-level notice "$@"
}
echo_server() { # [--echo-touch N]
  start echo "$LG" --echo-io-threads 4 --echo-reply 2048 "$@" --serve-echo "ipc://$RUN/echo.ipc"
}
profile() { # title server-pid name op: the server's and loadgen's threads under 8 x 8 zc
  "$LG" --endpoint "ipc://$RUN/$3.ipc" --op "$4" --producers 8 --send zc --size 1048576 \
    --window 8 --seconds 5 "${ST[@]}" >"$RUN/lg.txt" 2>>"$OUT/recv-ab.err" &
  local lg=$!
  sleep 2.5
  bash "$(dirname "$0")/thread-cpu.sh" "$2" 2 >"$RUN/srv-threads.txt" &
  local a=$!
  bash "$(dirname "$0")/thread-cpu.sh" $lg 2 >"$RUN/lg-threads.txt"
  wait $a $lg
  {
    echo
    echo "$1 under 8 x 8 zc (% of one core over 2 s), then the loadgen process's busiest threads:"
    echo
    head -12 "$RUN/srv-threads.txt" | sed 's/^/    /'
    awk '{ s += $1 } END { printf "    all threads: %.0f %% of one core\n", s }' "$RUN/srv-threads.txt"
    echo
    head -6 "$RUN/lg-threads.txt" | sed 's/^/    /'
    awk '{ s += $1 } END { printf "    all threads: %.0f %% of one core\n", s }' "$RUN/lg-threads.txt"
    echo "    $(bench_last_row <"$RUN/lg.txt")"
  } >>"$MD"
}
{
  echo "# tallyd against the raw transport, same producers: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(date -u '+%F %H:%M') UTC"
  echo
  lscpu | grep -E '^(Model name|CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|L2|L3)' | sed 's/^/    /'
  echo
  echo "hist 1 MiB, ipc, 4 I/O threads receiving, stagger ${STAGGER_MS:-50} ms, $T s per run."
  echo
  bench_table_header
} >"$MD"
for round in $(seq "${ROUNDS:-2}"); do
  for variant in zc: copy:--send\ copy hold64:--hold\ 64; do
    # shellcheck disable=SC2086
    bench_row "fanin 8x8 ${variant%%:*} r$round" "$FI" --endpoint "ipc://$RUN/fanin.ipc" --producers 8 \
      --reply 2048 --io-threads 4 ${variant#*:} "${LOAD[@]}" "${ST[@]}"
  done
  echo_server
  for send in zc copy; do
    bench_row "raw ROUTER 8x8 $send r$round" "$LG" --endpoint "ipc://$RUN/echo.ipc" --op echo \
      --producers 8 --send $send "${LOAD[@]}" "${ST[@]}"
  done
  stop
  echo_server --echo-touch 4
  bench_row "raw ROUTER + 4 touch 8x8 zc r$round" "$LG" --endpoint "ipc://$RUN/echo.ipc" --op echo \
    --producers 8 --send zc "${LOAD[@]}" "${ST[@]}"
  stop
  GLIBC_TUNABLES=$KEEP_HEAP tallyd tdm --io-threads 4
  bench_row "tallyd heap kept 8x8 zc r$round" "$LG" --endpoint "ipc://$RUN/tdm.ipc" --op hist \
    --producers 8 --send zc "${LOAD[@]}" "${ST[@]}"
  stop
  tallyd td --io-threads 4
  for send in zc copy; do
    bench_row "tallyd 8x8 $send r$round" "$LG" --endpoint "ipc://$RUN/td.ipc" --op hist --producers 8 \
      --send $send "${LOAD[@]}" "${ST[@]}"
  done
  "$LG" --endpoint "ipc://$RUN/td.ipc" --op hist --producers 4 --send zc "${LOAD[@]}" "${ST[@]}" \
    >"$RUN/lg1.txt" 2>>"$OUT/recv-ab.err" &
  a=$!
  "$LG" --endpoint "ipc://$RUN/td.ipc" --op hist --producers 4 --send zc "${LOAD[@]}" "${ST[@]}" \
    >"$RUN/lg2.txt" 2>>"$OUT/recv-ab.err"
  wait $a
  gbs=$(grep -h '^| run ' "$RUN/lg1.txt" "$RUN/lg2.txt" | awk -F'|' '{gsub(/ /, "", $7); s += $7} END {printf "%.3f", s}')
  echo "| tallyd 2 loadgens x 4x8 zc r$round | hist (zc) | 1 MiB | 2 x (4 x 8) | - | $gbs | - | - | - | - | - | - |" >>"$MD"
  stop
  tallyd td8 --io-threads 8
  bench_row "tallyd io8 8x8 zc r$round" "$LG" --endpoint "ipc://$RUN/td8.ipc" --op hist --producers 8 \
    --send zc "${LOAD[@]}" "${ST[@]}"
  stop
done
tallyd td --io-threads 4
profile "tallyd (4 I/O threads)" $srv td hist
stop
echo_server
profile "the raw ROUTER (4 I/O threads, 2 KiB replies)" $srv echo echo
stop
echo_server --echo-touch 4
profile "the raw ROUTER with 4 touch threads" $srv echo echo
stop
cat "$MD"
