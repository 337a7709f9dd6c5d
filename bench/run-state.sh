#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/run-state.sh BUILD_DIR OUT_DIR [BASE_TALLYD] — stream state at scale (issue 26), for this
# build's tallyd ("new") and, when given, another binary ("base", e.g. built from main), in one
# session, on the CPU backend, each tallyd started afresh for each measurement:
#   - resident memory per stream (VmRSS after minus before, 2.5 s after the last reply, over N)
#     for N streams (NS, default "1000 10000 100000"; BASE_NS for the base, default NS) that
#     each got one 1 KiB batch of uniform u8 (bench/state_bench), with the default window ring
#     (60 x 1 s) and with windows off;
#   - the same for streams busy in every interval: one such batch per stream in each of the 60
#     intervals of the ring, the window clock stepped by a --test-clock file (BUSY_NS, default
#     "1000 10000"; BASE_BUSY_NS for the base);
#   - snapshots, SNAP_N streams (default 100000): the bytes of a whole state file (the final
#     snapshot of a tallyd that took no other), then, restarted on it, the bytes written per
#     interval (tallyd_state_written_bytes_total; a base tallyd from before issue 26 wrote its
#     whole file at every interval with a change) while 1 % of the streams get a batch per
#     interval, over SNAP_ROUNDS intervals (default 8) of --state-interval 1;
#     then the restart: from the start of a tallyd on the same directory (after SIGTERM's final
#     snapshot) to its first answered ping, and its resident memory;
#   - query p50 (state_bench query, 2000 sequential queries of one stream, ipc) and hist
#     throughput (loadgen, 4 KiB, 1 producer x 8, one named stream, 3 s), ROUNDS rounds (default
#     3) alternating the two binaries.
# PARTS (default "memory snapshots speed") picks the sections. Rows in OUT_DIR/state.md. Stream creation needs stream_create_rate 0 and limits raised: the
# script passes them.
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-env.sh
. "$(dirname "$0")/bench-env.sh"
BASE=${3:-}
SB="$B/bench/state_bench"
bench_setup state 3
LIMITS=(--backend cpu --log-level notice --max-streams 4000000 --max-streams-per-client 4000000
  --stream-create-rate 0)
# Only a tallyd that knows the setting gets it (a base from before issue 26 has no budget).
budget() {
  local help
  help=$("$1" --help 2>&1) # not a pipe into grep -q: under pipefail, tallyd's SIGPIPE fails it
  case "$help" in *max-state-bytes*) echo "--max-state-bytes 16G" ;; esac
}

rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# start BIN EXTRA...: starts BIN on $RUN/td.ipc; sets TPID; waits until it answers.
start() {
  local bin=$1
  shift
  # shellcheck disable=SC2046
  "$bin" --bind "ipc://$RUN/td.ipc" "${LIMITS[@]}" $(budget "$bin") "$@" \
    2>>"$OUT/state-tallyd.log" &
  TPID=$!
  pids+=("$TPID")
  for _ in $(seq 300); do
    "$TALLY" -e "ipc://$RUN/td.ipc" -t 200 ping >/dev/null 2>&1 && return 0
    sleep 0.05
  done
  echo "tallyd did not start" >&2
  return 1
}
stop() {
  kill "$TPID" 2>/dev/null
  wait "$TPID" 2>/dev/null
}
stat_of() { "$TALLY" -e "ipc://$RUN/td.ipc" stats | awk -v k="$1" '$1 == k {print $2}'; }

# per_stream LABEL BIN N KIND [EXTRA...]: KIND one (one batch each) or busy (every interval).
per_stream() {
  local label=$1 bin=$2 n=$3 kind=$4
  shift 4
  local clock="$RUN/clock" t0=1795000000000
  echo $t0 >"$clock"
  start "$bin" --test-clock "$clock" "$@" || return
  local before after k
  before=$(rss_kib "$TPID")
  if [ "$kind" = one ]; then
    "$SB" "ipc://$RUN/td.ipc" hist "$n" >>"$OUT/state-bench.log"
  else
    for k in $(seq 0 59); do
      echo $((t0 + k * 1000 + 500)) >"$clock.tmp" && mv "$clock.tmp" "$clock"
      "$SB" "ipc://$RUN/td.ipc" hist "$n" --seed "$k" >>"$OUT/state-bench.log"
    done
  fi
  sleep 2.5
  after=$(rss_kib "$TPID")
  printf '| %s | %s | %s | %d | %s | %.2f | %d |\n' "$label" "$kind" "$*" "$n" \
    "$((after / 1024))" "$(echo "($after - $before) / $n" | bc -l)" \
    "$(($(stat_of tallyd_state_bytes || echo 0) + 0))" >>"$MD"
  stop
}

# snapshots LABEL BIN: whole file, bytes per interval at 1 %, restart.
snapshots() {
  local label=$1 bin=$2 n=${SNAP_N:-100000} dir="$RUN/state-$1"
  rm -rf "$dir"
  # Created with no snapshot before the final one, which writes every stream: the whole file.
  start "$bin" --state-dir "$dir" --state-interval 3600 || return
  "$SB" "ipc://$RUN/td.ipc" hist "$n" >>"$OUT/state-bench.log"
  stop
  local whole w0 w1 rounds=${SNAP_ROUNDS:-8} active=$((n / 100)) r
  whole=$(stat -c %s "$dir/streams.state")
  start "$bin" --state-dir "$dir" --state-interval 1 || return
  w0=$(stat_of tallyd_state_written_bytes_total)
  for r in $(seq "$rounds"); do
    "$SB" "ipc://$RUN/td.ipc" hist "$active" --from $((r * active)) --seed "$r" \
      >>"$OUT/state-bench.log"
    sleep 1.1
  done
  sleep 1.5
  w1=$(stat_of tallyd_state_written_bytes_total)
  local per
  if [ -n "$w0" ]; then per=$(((w1 - w0) / rounds)); else per=$(stat -c %s "$dir/streams.state"); fi
  stop
  local t_start t_up
  t_start=$(date +%s.%N)
  start "$bin" --state-dir "$dir" --state-interval 1 || return
  t_up=$(date +%s.%N)
  printf '| %s | %d | %d | %d | %.2f %% | %.2f | %d |\n' "$label" "$n" "$whole" "$per" \
    "$(echo "100 * $per / $whole" | bc -l)" "$(echo "$t_up - $t_start" | bc -l)" \
    "$(($(rss_kib "$TPID") / 1024))" >>"$MD"
  stop
  rm -rf "$dir"
}

# speed LABEL BIN: query p50 and hist throughput.
speed() {
  local label=$1 bin=$2
  start "$bin" || return
  "$SB" "ipc://$RUN/td.ipc" hist 1 >>"$OUT/state-bench.log"
  local q
  q=$("$SB" "ipc://$RUN/td.ipc" query s0000000 --count 2000)
  local p50=${q#*p50_us=} p99=${q#*p99_us=}
  echo "| $label | query | ${p50%% *} | ${p99%% *} |" >>"$MD"
  local c0 c1
  c0=$(cpu_ticks "$TPID")
  bench_row "$label hist" "$LG" --endpoint "ipc://$RUN/td.ipc" --op hist --size 4096 --producers 1 \
    --window 8 --seconds "$T" --stream
  c1=$(cpu_ticks "$TPID")
  # tallyd's CPU time per request over the run (warm-up included): less at the mercy of a busy
  # machine than the rate.
  local answered
  answered=$(tail -1 "$MD" | awk -F'|' '{split($11, a, "/"); print a[1]}')
  echo "| $label hist | tallyd CPU per request | $(echo "($c1 - $c0) * 1000000 / $(getconf CLK_TCK) / ($answered + 1)" | bc -l | xargs printf '%.1f') us | |" >>"$MD"
  stop
}

binaries=(new)
[ -n "$BASE" ] && binaries+=(base)
bin_of() { if [ "$1" = base ]; then echo "$BASE"; else echo "$TD"; fi; }
{
  echo "# tallyd stream state: $(uname -n), $(nproc) cores, $(date -u '+%F %H:%M') UTC"
  echo
  echo "| run | batches | tallyd args | streams | RSS MiB | RSS KiB per stream | tallyd_state_bytes |"
  echo "|---|---|---|---|---|---|---|"
} >"$MD"
part() { case " ${PARTS:-memory snapshots speed} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
for v in "${binaries[@]}"; do
  part memory || break
  ns=${NS:-1000 10000 100000}
  [ "$v" = base ] && ns=${BASE_NS:-$ns}
  for n in $ns; do
    per_stream "$v" "$(bin_of "$v")" "$n" one
    per_stream "$v" "$(bin_of "$v")" "$n" one --window-intervals 0
  done
  busy=${BUSY_NS:-1000 10000}
  [ "$v" = base ] && busy=${BASE_BUSY_NS:-$busy}
  for n in $busy; do per_stream "$v" "$(bin_of "$v")" "$n" busy; done
done
{
  echo
  echo "| run | streams | whole state file B | written per interval, 1 % active, B | of whole | restart s | RSS after restart MiB |"
  echo "|---|---|---|---|---|---|---|"
} >>"$MD"
part snapshots && for v in "${binaries[@]}"; do snapshots "$v" "$(bin_of "$v")"; done
{
  echo
  echo "| run | op | p50 us | p99 us |"
  echo "|---|---|---|---|"
  echo "(hist rows: loadgen's columns)"
} >>"$MD"
part speed && for round in $(seq "${ROUNDS:-3}"); do
  order=("${binaries[@]}")
  [ $((round % 2)) = 0 ] && [ ${#binaries[@]} = 2 ] && order=(base new)
  for v in "${order[@]}"; do speed "$v r$round" "$(bin_of "$v")"; done
done
cat "$MD"
