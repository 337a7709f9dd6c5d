#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# run-nats-worker.sh BUILD... — one fleet worker's cost per message, for profiling and A/B on a
# small box (issue 32; bench/NOTES.md "The fleet worker's instructions per message"): one
# nats-server (R1), 8 partitions, hist u8 over 4 streams a partition. For each round (ROUNDS,
# default 3) and each BUILD in turn (builds interleaved, every other round in the reverse order,
# so that the box's load and the place in the round fall on each alike: the second worker of a
# round was the slower on the dev box, whichever build it was):
# the build's tallyd becomes the only worker (the previous one gave its partitions up with
# SIGTERM), is stopped (SIGSTOP), a fill of COUNT x SIZE (default 30000 x 1024) is published,
# and it goes on (SIGCONT): timed until its tallyd_nats_applied_total counts the fill (sampled
# every 50 ms), with the CPU time of all its threads (from /proc) per message.
# CALLGRIND=1 (COUNT 12000, ROUNDS 1 by default): each worker runs under callgrind with
# instrumentation off, switched on after its SIGCONT and dumped once the fill is applied;
# instructions per message = the dump's total / the replies the fleet thread took meanwhile
# (td_part_reply's calls), also without the /metrics pages the sampler asked for (every second
# here: not the messages' cost). THREADS=1: each thread's share of a core over one second of
# the apply (bench/thread-cpu.sh, from 0.2 s after SIGCONT; COUNT large enough that the apply
# lasts longer), printed after the round's line: a thread near 100 % is what holds the rate, none
# near it says the worker waits (threads libnats starts carry the name of the tallyd thread
# that started them: tdfleet, tdreader-K). PERF=1 (where perf runs: not the GPU host): the fleet
# thread's samples over one second of the apply, by function, printed after the round's line. The profiles (inclusive, self, callers) stay in the run's folder
# with KEEP=1 (its path is printed). FILLS=N: after the timed fill the same worker takes N-1
# more, running, and its RSS after each is printed (a fleet worker's memory over a long load;
# each fill names new streams, 32 of them). SYSCALLS=1 (where perf reads the raw_syscalls
# tracepoint: the dev box does): the worker's system calls, context switches and CPU time over the
# apply (perf stat --per-thread, attached before the SIGCONT), a message, in all and by thread
# name, printed after the round's line: the wake-ups callgrind does not count. Instructions do
# not move with the box's load; the rates and CPU times do (2x on the shared dev box). TALLYD_ARGS adds worker options.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 BUILD..." >&2; exit 2; }
rounds=${ROUNDS:-3}
size=${SIZE:-1024}
count=${COUNT:-30000}
[ "${CALLGRIND:-0}" = 1 ] && count=${COUNT:-12000} && rounds=${ROUNDS:-1}
dir=$(mktemp -d)
wpid=
trap '[ -n "$wpid" ] && kill -9 "$wpid" 2>/dev/null; kill $(jobs -p) 2>/dev/null || true
      wait 2>/dev/null || true; [ -n "${KEEP:-}" ] || rm -rf "$dir"' EXIT
. "$(dirname "$0")/nats-lib.sh"
nats_start "$dir" 1
url=$nats_urls
mport=$(free_port)
nb=$1/bench/nats_bench

metric() { # metric NAME: the worker's value (0 when none)
  python3 - "$mport" "$1" <<'PY' 2>/dev/null || echo 0
import sys, urllib.request
t = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).read().decode()
print(next((l.split()[-1] for l in t.splitlines() if l.startswith(sys.argv[2] + " ")), "0"))
PY
}
cpu_ticks() { awk '{print $14 + $15}' "/proc/$wpid/stat"; }

# one BUILD TAG: a round of BUILD's worker; prints "TAG seconds msg/s us-cpu/msg [instr/msg]"
one() {
  local build=$1 tag=$2 z vg=() t0 c0 c1 a0 a1 base secs
  z=$(free_port)
  [ "${CALLGRIND:-0}" = 1 ] && vg=(valgrind --tool=callgrind --instr-atstart=no
    --callgrind-out-file="$dir/cg-$tag.out")
  # shellcheck disable=SC2086
  "${vg[@]}" "$build/daemon/tallyd" --bind "tcp://127.0.0.1:$z" --metrics "127.0.0.1:$mport" \
    --nats-servers "$url" --nats-replicas 1 --nats-partitions 8 --nats-member-id w1 \
    --window-intervals 0 --shm off --nats-partition-max-bytes 4G --nats-lease-ttl-ms 60000 \
    --max-inflight 4096 ${TALLYD_ARGS:-} >>"$dir/w-$tag.log" 2>&1 &
  wpid=$!
  for _ in $(seq 1200); do (($(metric tallyd_nats_partitions_owned) == 8)) && break; sleep 0.1; done
  (($(metric tallyd_nats_partitions_owned) == 8)) || { echo "$tag: worker not ready ($dir)" >&2; exit 1; }
  base=$(metric tallyd_nats_applied_total)
  a0=$base
  kill -STOP "$wpid"
  "$nb" fleet-fill "$url" "$tag" "$count" "$size" >"$dir/fill-$tag"
  local spid=
  if [ "${SYSCALLS:-0}" = 1 ]; then # every thread of the worker, from before its SIGCONT
    perf stat --per-thread -x, -e raw_syscalls:sys_enter,context-switches,task-clock -p "$wpid" \
      -o "$dir/stat-$tag.csv" &
    spid=$!
    sleep 0.3
  fi
  c0=$(cpu_ticks)
  t0=$(date +%s.%N)
  kill -CONT "$wpid"
  local tpid=
  if [ "${THREADS:-0}" = 1 ]; then
    (sleep 0.2 && "$(dirname "$0")/thread-cpu.sh" "$wpid" 1 >"$dir/threads-$tag" 2>&1) &
    tpid=$!
  fi
  local ppid=
  if [ "${PERF:-0}" = 1 ]; then # the fleet thread's cycles over 1 s of the apply, with callers
    local ftid
    ftid=$(grep -l '^tdfleet$' /proc/"$wpid"/task/*/comm | head -1 | cut -d/ -f5)
    (sleep 0.2 && perf record -q -e cpu-clock --call-graph dwarf,16384 -t "$ftid" -o "$dir/perf-$tag.data" -- sleep 1 &&
      perf report -q -i "$dir/perf-$tag.data" --no-children --percent-limit 0.7 -g none \
        --sort symbol >"$dir/perf-$tag.txt" 2>/dev/null) >/dev/null 2>&1 &
    ppid=$!
  fi
  if [ "${CALLGRIND:-0}" = 1 ]; then
    callgrind_control -i on "$wpid" >/dev/null
    a0=$(metric tallyd_nats_applied_total)
  fi
  secs=$(python3 - "$t0" "$((base + count))" "$mport" "${CALLGRIND:-0}" <<'PY'
import sys, time, urllib.request
t0, want, port, cg = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
def applied():
    try:
        t = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return int(float(next((l.split()[-1] for l in t.splitlines()
                               if l.startswith("tallyd_nats_applied_total ")), "0")))
    except OSError:
        return 0
while applied() < want and time.time() - t0 < 600:
    time.sleep(1.0 if cg else 0.05)
print(f"{time.time() - t0:.3f}")
PY
)
  c1=$(cpu_ticks)
  a1=$(metric tallyd_nats_applied_total)
  [ -z "$spid" ] || { kill -INT "$spid" && wait "$spid" || true; }
  local ir=""
  if [ "${CALLGRIND:-0}" = 1 ]; then
    callgrind_control -d "$wpid" >/dev/null
    callgrind_control -i off "$wpid" >/dev/null
    local f total
    f=$(ls -t "$dir"/cg-"$tag".out* | head -1)
    callgrind_annotate --inclusive=yes "$f" 2>/dev/null | head -150 >"$dir/annotate-$tag.txt" || true
    callgrind_annotate "$f" 2>/dev/null | head -100 >"$dir/self-$tag.txt" || true
    callgrind_annotate --tree=caller "$f" 2>/dev/null >"$dir/callers-$tag.txt" || true
    # messages: the replies the fleet thread took while instrumented (td_part_reply's calls), the
    # /metrics pages' share apart (the sampler's, not the messages')
    python3 - "$dir/callers-$tag.txt" "$dir/annotate-$tag.txt" >"$dir/ir-$tag" <<'PY'
import re, sys
calls = total = metrics = 0
for l in open(sys.argv[1]):  # the most calls td_part_reply made of any one function
    m = re.search(r"<\s+\S*td_fleet_part.c:td_part_reply \((\d[\d,]*)x\)", l)
    calls = max(calls, int(m.group(1).replace(",", ""))) if m else calls
for l in open(sys.argv[2]):
    v = l.split()
    if "PROGRAM TOTALS" in l:
        total = int(v[0].replace(",", ""))
    if re.search(r":td_metrics_render( \[|$)", l.rstrip()) and not metrics:  # [object] or not
        metrics = int(v[0].replace(",", ""))
print(f" {total // max(calls, 1)} {(total - metrics) // max(calls, 1)} {calls}")
PY
    ir=$(cat "$dir/ir-$tag")
  fi
  [ -z "$tpid" ] || wait "$tpid" || true # its second sample, before the worker goes
  [ -z "$ppid" ] || wait "$ppid" || true
  local i rss=""
  for ((i = 2; i <= ${FILLS:-1}; i++)); do # the same worker, fill after fill, running
    "$nb" fleet-fill "$url" "$tag-$i" "$count" "$size" >/dev/null
    for _ in $(seq 6000); do (($(metric tallyd_nats_applied_total) >= base + i * count)) && break; sleep 0.1; done
    rss+=" $(awk '/VmRSS/ {print int($2 / 1024)}' "/proc/$wpid/status")"
  done
  [ -z "$rss" ] || echo "$tag RSS MiB after each further fill:$rss"
  kill -TERM "$wpid"
  wait "$wpid" || true
  wpid=
  python3 -c "import sys; c, s, t, hz = map(float, sys.argv[1:5]); \
print(f'{sys.argv[5]} {s:.3f} {c / s:.0f} {t / hz / c * 1e6:.1f}{sys.argv[6]}')" \
    "$count" "$secs" "$((c1 - c0))" "$(getconf CLK_TCK)" "$tag" "$ir"
  [ -z "$tpid" ] || head -12 "$dir/threads-$tag" | sed "s/^/  $tag threads: /"
  [ -z "$ppid" ] || head -40 "$dir/perf-$tag.txt" | sed "s/^/  $tag tdfleet: /"
  [ -z "$spid" ] || python3 - "$dir/stat-$tag.csv" "$count" "$tag" <<'PY'
import collections, re, sys
# perf stat -x, --per-thread lines: comm-tid,value,unit,event,...
per = collections.defaultdict(lambda: collections.Counter())
for l in open(sys.argv[1]):
    f = l.strip().split(",")
    if len(f) < 4 or not f[1].replace(".", "").isdigit():
        continue
    name = re.sub(r"-\d+$", "", f[0])
    name = re.sub(r"\d+$", "N", name)  # tdreader-3, tdshard-1: one row for each kind
    per[name][f[3]] += float(f[1])
    per["all"][f[3]] += float(f[1])
n = int(sys.argv[2])
ev = ("raw_syscalls:sys_enter", "context-switches", "task-clock")
for name in ["all"] + sorted(k for k in per if k != "all"):
    c = per[name]
    if name == "all" or c[ev[2]] * 1e3 / n >= 0.05:  # the threads that did something
        print(f"  {sys.argv[3]} {name}: syscalls {c[ev[0]] / n:.2f}, context switches "
              f"{c[ev[1]] / n:.2f}, task-clock {c[ev[2]] * 1e3 / n:.2f} us a message")
PY
}

echo "# $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg), $(date -u '+%Y-%m-%d %H:%M UTC');" \
  "$count x $size B; columns: build-round seconds msg/s cpu-us/msg [instr/msg, without /metrics, messages counted]"
builds=("$@")
for ((r = 1; r <= rounds; r++)); do # in turn, every other round backwards: ABBA...
  for ((j = 0; j < ${#builds[@]}; j++)); do
    i=$((r % 2 ? j : ${#builds[@]} - 1 - j))
    one "${builds[i]}" "b$((i + 1))-r$r-$size"
  done
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
[ -n "${KEEP:-}" ] && echo "# kept: $dir"
exit 0
