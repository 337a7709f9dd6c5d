#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/soak.sh BUILD_DIR OUT_DIR — tallyd's memory over a long run (issue 21, item 7).
#
# Starts tallyd with SOAK_BACKEND (cpu; sim: two simulated GPUs, the GPU pipeline's own code on
# host memory; cuda: the GPUs), drives it for SOAK_SECONDS (default 60) over ipc with the mix of
# the lead's GPU soak probe (2026-11-26): four loadgens, hist 1 MiB 4 x 8, filter 256 KiB on
# named streams 2 x 8, scan 4 MiB 2 x 4, and hist 4 MiB by shared-memory reference 1 x 8
# (SOAK_WINDOW=N replaces every window, e.g. 2 on a small machine). Every second it samples
# tallyd's memory from /proc/PID/smaps into OUT_DIR/soak-rss.tsv:
#   t_s  rss_kb  main_heap_kb  arenas  arena_rss_kb  other_anon_kb  file_kb  threads
# where `arenas` are glibc's per-thread malloc heaps (anonymous mappings aligned to their 64 MiB
# reservation) and arena_rss_kb what of them is resident, main_heap_kb the [heap] (main arena),
# other_anon_kb the rest of the anonymous memory (pinned pools, big mmap'd blocks, stacks), and
# file_kb the file-backed part (libraries, the GPU driver's maps, shared memory regions).
# At the end it prints (and writes to OUT_DIR/soak-summary.txt) the requests answered and their
# errors, RSS at start, end and peak, and the least-squares slope of each column over the first
# and the second half of the run, in KB/s: a leak keeps the second half rising; warm-up (pools,
# arenas filling up to their working set) flattens out.
#
#   SOAK_SECONDS=1200 SOAK_BACKEND=cuda bench/soak.sh build-gpu /tmp/soak
#   SOAK_SECONDS=120 SOAK_BACKEND=sim SOAK_WINDOW=2 bench/soak.sh build /tmp/soak
# SOAK_TALLYD_ARGS adds options to tallyd. To compare with glibc's own arenas (one per thread),
# keep tallyd's thresholds and leave the arena count to glibc:
#   GLIBC_TUNABLES=glibc.malloc.trim_threshold=134217728:glibc.malloc.mmap_threshold=33554432
# (any glibc.malloc tunable makes tallyd leave malloc alone: docs/source-tree.md, "Memory").
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-env.sh
. "$(dirname "$0")/bench-env.sh"
bench_setup soak "${SOAK_SECONDS:-60}"
SECS=${SOAK_SECONDS:-60}
BACKEND=${SOAK_BACKEND:-cpu}
TSV="$OUT/soak-rss.tsv"
SUM="$OUT/soak-summary.txt"

case $BACKEND in
cpu) backend_args=(--backend cpu) ;;
sim) backend_args=(--backend cuda --test-sim-gpus 2) ;;
cuda) backend_args=(--backend cuda) ;;
*) echo "SOAK_BACKEND must be cpu, sim or cuda" >&2; exit 2 ;;
esac
EP="ipc://$RUN/t.ipc"
# shellcheck disable=SC2086
"$TD" --bind "$EP" --shm-socket "$RUN/shm.sock" --log-level notice "${backend_args[@]}" \
  ${SOAK_TALLYD_ARGS:-} 2>"$OUT/tallyd-soak.log" &
TPID=$!
pids+=("$TPID")
for _ in $(seq 50); do [ -S "$RUN/t.ipc" ] && break; sleep 0.1; done
sleep 1

# sample: one line of the table above from /proc/$TPID/smaps.
sample() {
  awk -v t="$1" -v threads="$(find /proc/"$TPID"/task -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)" '
    function flush() {
      if (!have) return
      rss += m_rss
      if (name == "[heap]") heap += m_rss
      else if (name == "" && perms ~ /^rw/ && aligned) { arenas++; arena += m_rss }
      else if (name == "" || name ~ /^\[(stack|anon)/) anon += m_rss
      else file += m_rss
    }
    /^[0-9a-f]+-[0-9a-f]+ / {
      flush()
      split($1, a, "-"); perms = $2; name = $6
      # glibc aligns every per-thread heap to its 64 MiB reservation (HEAP_MAX_SIZE)
      lo = substr(a[1], length(a[1]) - 6)
      aligned = (substr(lo, 1, 1) ~ /[048c]/ && substr(lo, 2) == "000000")
      have = 1; m_rss = 0; next
    }
    /^Rss:/ { m_rss = $2 }
    END { flush(); printf "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\n", t, rss, heap, arenas, arena, anon, file, threads }
  ' "/proc/$TPID/smaps" 2>/dev/null
}

W=${SOAK_WINDOW:-}
lg() { # label args...
  local label=$1
  shift
  "$LG" --endpoint "$EP" --seconds "$SECS" --label "$label" "$@" >"$OUT/loadgen-$label.txt" \
    2>&1 &
  pids+=($!)
}
echo -e "t_s\trss_kb\tmain_heap_kb\tarenas\tarena_rss_kb\tother_anon_kb\tfile_kb\tthreads" >"$TSV"
sample 0 >>"$TSV"
lg hist --op hist --size 1048576 --producers 4 --window "${W:-8}"
lg filter --op filter --size 262144 --producers 2 --window "${W:-8}" --stream
lg scan --op scan --size 4194304 --producers 2 --window "${W:-4}"
lg shm --op hist --size 4194304 --producers 1 --window "${W:-8}" --shm
t0=$(date +%s.%N)
for ((i = 1; i <= SECS; i++)); do
  # sleep to the next whole second since t0, so the samples stay 1 s apart
  sleep "$(awk -v t0="$t0" -v i="$i" -v now="$(date +%s.%N)" 'BEGIN { d = t0 + i - now; printf "%.3f\n", (d > 0 ? d : 0) }')"
  kill -0 "$TPID" 2>/dev/null || { echo "tallyd died at ${i} s" | tee -a "$SUM"; break; }
  sample "$i" >>"$TSV"
done
for p in "${pids[@]:1}"; do wait "$p" 2>/dev/null; done
sample end >>"$TSV"

{
  echo "soak: tallyd ${backend_args[*]} ${SOAK_TALLYD_ARGS:-}, $SECS s, $(date -u +%F), $(nproc) cores"
  for f in "$OUT"/loadgen-*.txt; do
    grep '^| ' "$f" | grep -v -e '^| run |' -e '^|---' | tail -1 |
      awk -F'|' -v n="$(basename "$f" .txt)" '{ gsub(/ /, "", $11); gsub(/ /, "", $12); printf "  %-16s answered %s, errors %s\n", n, $11, $12 }'
  done
  awk -F'\t' -v secs="$SECS" '
    NR == 1 { for (c = 2; c <= NF; c++) name[c] = $c; next }
    $1 == "end" { next }
    {
      t = $1; n++; T[n] = t
      for (c = 2; c <= 8; c++) V[c, n] = $c
      if ($2 > peak) peak = $2
    }
    function slope(c, from, to,   i, k, st, sv, stt, stv, tt, v) {
      k = 0; st = sv = stt = stv = 0
      for (i = from; i <= to; i++) { tt = T[i]; v = V[c, i]; k++; st += tt; sv += v; stt += tt * tt; stv += tt * v }
      if (k < 2 || k * stt == st * st) return 0
      return (k * stv - st * sv) / (k * stt - st * st)
    }
    END {
      h = int(n / 2)
      printf "  RSS: %.0f MB at start, %.0f MB at the end, %.0f MB peak; arenas %d -> %d\n",
        V[2, 1] / 1024, V[2, n] / 1024, peak / 1024, V[4, 1], V[4, n]
      printf "  %-14s %14s %14s %12s\n", "KB/s", "first half", "second half", "at the end"
      for (c = 2; c <= 8; c++)
        if (c != 4)
          printf "  %-14s %14.1f %14.1f %12d\n", name[c], slope(c, 1, h), slope(c, h + 1, n), V[c, n]
    }
  ' "$TSV"
} | tee "$SUM"
# What each malloc arena holds and has in use at the end (glibc's malloc_stats, on tallyd's
# stderr), where gdb may attach: allocator retention shows as system bytes far above in use.
if [ "${SOAK_MALLOC_STATS:-1}" = 1 ] && command -v gdb >/dev/null; then
  gdb -p "$TPID" -batch -ex 'call (void)malloc_stats()' >/dev/null 2>&1
  sleep 0.5
  awk '/^Arena|system bytes|in use bytes|Total/' "$OUT/tallyd-soak.log" >"$OUT/soak-malloc-stats.txt"
  awk '/^Total \(incl. mmap\)/ { total = 1 } total && /system bytes/ { s = $4 } total && /in use bytes/ { u = $5 }
       END { if (s) printf "  malloc at the end: %.0f MB from the system, %.0f MB in use\n", s / 1048576, u / 1048576 }' \
    "$OUT/soak-malloc-stats.txt" | tee -a "$SUM"
fi
kill -TERM "$TPID" 2>/dev/null
wait "$TPID"
echo "tallyd exit: $?" | tee -a "$SUM"
