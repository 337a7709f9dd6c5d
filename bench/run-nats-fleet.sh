#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# run-nats-fleet.sh: issue 22's and issue 32's fleet figures, a benchmark (not a timed test). A
# 3-node JetStream cluster on loopback (R3 streams, scratch stores), 8 partitions, hist u8
# requests spread over 4 streams per partition (NATS_BENCH_STREAMS=N: N, up to 64; the request
# path keeps each stream's order, so fewer streams make longer chains of one stream's
# requests). For each SIZE:COUNT of SIZES (default "1024:100000 64:100000 1048576:256"; or the
# arguments COUNT SIZE for one):
#   1. worker 1 owns every partition and is stopped (SIGSTOP, within its lease); a fill is
#      published, and bare JetStream pull consumers, one per partition at once, read it on the
#      cores worker 1 runs on: the ceiling for one worker;
#   2. the worker goes on (SIGCONT) and applies it: timed until its tallyd_nats_applied_total
#      has counted every message;
#   3. the same with three workers (balanced first) and bare consumers on the three's cores:
#      GB/s and messages/s, 3 vs 1, each beside bare.
# Workers run with --max-inflight 4096: tallyd's bound of requests in its request path (64 by
# default) would otherwise hold a worker to 64 messages in flight over all its partitions.
# Then, with the three applying a steady stream (a third of their 1 KiB rate):
#   4. failover: kill -9 of a worker, FAILOVERS times (default 3; the worker started again and
#      the partitions settled between): the pause until every partition has gone past what it
#      showed at the kill, against lease TTL + 2 s;
#   5. a lost server: kill -9 of the nats-server leading the lease bucket: the workers' pause
#      (the same watchers) against the longest gap a bare durable consumer of each partition saw.
# PIN=1 pins servers, workers and the tools to disjoint cores (taskset), so that one host says
# what separate hosts would do: with C cores each nats-server gets C/8 (at least 1), each of the
# three workers (C - 3 C/8 - 1)/3, the producers and watchers the rest (16 cores: servers 0-1,
# 2-3, 4-5; workers 6-8, 9-11, 12-14; tools 15). Prints markdown rows for bench/RESULTS.md.
# SAMPLE_MS: how often the apply's sampler asks the workers' /metrics (default 50; it was 5).
# Each of its samples also sums the workers' tallyd_nats_partition_in_path, _window and _fetched
# over their partitions, and a round's line ends with their means over the apply against the
# windows' room in all (issue 32: "window mean X of Y (occupied W), fetched mean Z, lag mean
# L", X in the request path: X near Y, the request path binds; W near Y with X low, slow heads
# of windows; many fetched and W below Y, the fleet thread; X and Z low with L high, the fetch),
# then what the workers' counters grew by over the apply: requests resent (each stops its
# partition for 50 ms), checkpoints written, the seconds their fleet threads spent writing them
# and the seconds partitions spent draining for them (taking nothing new). Before those, "CPU a
# message": the workers' CPU time (user and system, /proc/PID/stat) from the SIGCONT to the
# sampler's end over the messages, beside the bare consumers' over their read (their start
# included: ~80 ms in all, 0.3 us a message at 300,000). It moves with a change of what a
# message costs where the seconds, which vary 10-20 % between rounds, may not; it does not say
# that the cores are full (one worker used 1.6-1.9 of its 3 over an apply, bench/NOTES.md).
# TIMELINE=1: each round also prints its apply's time line: the partitions each worker owns,
# then a line a sample: the messages applied a second over the interval before it, the summed
# gauges (in_path, window, fetched, lag) and each partition's lag in thousands: a steady rate
# says one bound holds throughout; a rate that falls while a few partitions keep their lag says
# those finish late.
# THREADS=1: each worker's threads' share of a core over THREADS_S seconds (default 0.5) of
# each round's apply, from 0.1 s after the SIGCONT (bench/thread-cpu.sh), and their sum: whether
# a worker's cores are full (the cost a message binds) or not (something waits); give a COUNT
# that lasts longer than that.
# PERF=1 (where perf runs; scripts/fetch-device-deps.sh carries Debian's to the GPU host): each
# worker's CPU time over PERF_S seconds (default 0.5) of each round's apply, from 0.1 s after the
# SIGCONT, sampled at 4 kHz (cpu-clock), by thread (tid:name), then by thread name and function:
# where a worker at its cores spends them (tdfleet, tdreader-K, the shards' tdshard-N, tallyd's
# loop; the connections a worker makes after its start name their libnats threads after their
# role, nats/reader-K; those made at start and the library's own, whose garbage collector frees
# messages, are "tallyd" like the loop thread, which is the one whose id is the process's).
# LOGS=DIR: the workers' and nats-servers' logs are copied into DIR at the end (the scratch
# directory, with the servers' stores, is removed in any case).
# BUILD (default build) holds tallyd and nats_bench; TALLYD_ARGS adds worker options; LEASE_MS
# the lease (default 8000: a fill while the workers are stopped must end well within it).
# ONLY=rates: steps 1-3 alone (their raw lines). ONLY=failover: only step 4, at STEADY 1 KiB messages a second (default 1000), with each run's
# breakdown from the survivors' logs (when each lease ran out, the take began and ended, the
# first message was applied, against the watchers' figure), all from the kill.
set -euo pipefail
build=${BUILD:-build}
lease=${LEASE_MS:-8000}
failovers=${FAILOVERS:-3}
sizes=${SIZES:-1024:100000 64:100000 1048576:256}
[ $# -ge 2 ] && sizes="$2:$1"
parts=8
dir=$(mktemp -d)
declare -A pid mport cores
# Workers first, with -9: one stopping gracefully after its cluster waits on NATS timeouts.
trap 'kill -9 "${pid[@]}" 2>/dev/null || true; kill $(jobs -p) 2>/dev/null || true
      wait 2>/dev/null || true
      [ -z "${LOGS:-}" ] || { mkdir -p "$LOGS" && find "$dir" -name "*.log" -exec cp {} "$LOGS" \;; }
      rm -rf "$dir"' EXIT
. "$(dirname "$0")/nats-lib.sh"
nb() { "$build/bench/nats_bench" "$@"; }

# The layout. PIN=1: with C cores, each nats-server gets S = C/8 cores (at least 1), each of
# the three workers W = (C - 3S - 1)/3, and the producers and watchers what is left.
ncpu=$(nproc)
# $(on CORES) CMD: CMD on CORES with PIN=1 (taskset execs it: $! of a job is still CMD's pid)
on() { if [ "${PIN:-0}" = 1 ]; then echo "taskset -c $1"; fi; }
if [ "${PIN:-0}" = 1 ]; then
  s=$((ncpu / 8 > 0 ? ncpu / 8 : 1))
  w=$(((ncpu - 3 * s - 1) / 3))
  ((w >= 1)) || { echo "PIN=1 needs at least 7 cores" >&2; exit 1; }
  NATS_PIN="0-$((s - 1)) $s-$((2 * s - 1)) $((2 * s))-$((3 * s - 1))"
  at=$((3 * s))
  for n in 1 3 6; do cores[$n]="$at-$((at + w - 1))"; at=$((at + w)); done
  tools="$at-$((ncpu - 1))"
  layout="pinned: servers on cores ${NATS_PIN// /, }; workers on ${cores[1]}, ${cores[3]}, ${cores[6]}; tools on $tools"
else
  NATS_PIN=
  for n in 1 3 6; do cores[$n]="0-$((ncpu - 1))"; done
  tools="0-$((ncpu - 1))"
  layout="not pinned"
fi
export NATS_PIN
nats_start "$dir" 3
url=$nats_urls
worker() { # worker N [options]: starts wN in the background, on its cores
  local n=$1 z
  shift
  z=$(free_port)
  mport[$n]=$(free_port)
  # shellcheck disable=SC2086
  $(on "${cores[$n]}") "$build/daemon/tallyd" --bind "tcp://127.0.0.1:$z" \
    --metrics "127.0.0.1:${mport[$n]}" --nats-servers "$url" --nats-replicas 3 \
    --nats-partitions $parts --nats-member-id "w$n" --window-intervals 0 --shm off \
    --nats-partition-max-bytes 4G --nats-lease-ttl-ms "$lease" --max-inflight 4096 \
    ${TALLYD_ARGS:-} "$@" \
    >>"$dir/w$n.log" 2>&1 &
  pid[$n]=$!
}
stop() { local n; for n in "$@"; do kill -TERM "${pid[$n]}"; wait "${pid[$n]}" || true; done; }
metric() { # metric N NAME: that worker's value (0 when it has none)
  python3 - "${mport[$1]}" "$2" <<'PY' 2>/dev/null || echo 0
import sys, urllib.request
t = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=2).read().decode()
print(next((l.split()[-1] for l in t.splitlines() if l.startswith(sys.argv[2] + " ")), "0"))
PY
}
owned() { # owned N...: partitions these workers own, in all
  local n s=0
  for n in "$@"; do s=$((s + $(metric "$n" tallyd_nats_partitions_owned))); done
  echo "$s"
}
balanced() { # balanced N...: waits (up to 600 tries) until they own all partitions, each some
  local n ok
  for _ in $(seq 600); do
    ok=1
    for n in "$@"; do (($(metric "$n" tallyd_nats_partitions_owned) > 0)) || ok=0; done
    ((ok && $(owned "$@") == parts)) && return 0
    sleep 0.1
  done
  echo "workers $* did not settle (logs in $dir)" >&2
  exit 1
}
elapsed() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.3f}')" "$@"; }
now() { date +%s.%N; }
bare() { # bare TAG CORES: bare consumers of every partition from the sequences in $dir/seqs
  local tag=$1 c=$2 k from t0 t1 b=()
  read -r -a from <"$dir/seqs"
  t0=$(now)
  ( # in a subshell, whose `times` are then its children's, the consumers': their CPU seconds
    for ((k = 0; k < parts; k++)); do
      $(on "$c") "$build/bench/nats_bench" bare-part "$url" $k $((from[k + 1] + 1)) >"$dir/bare-$tag-$k" &
      b+=($!)
    done
    wait "${b[@]}"
    times >"$dir/bare-$tag-times" # not in a pipe: its fork would have no children
    tail -1 "$dir/bare-$tag-times" | tr 'ms' '  ' |
      awk '{ printf "%.3f\n", 60 * $1 + $2 + 60 * $3 + $4 }' >"$dir/bare-$tag-cpu"
  )
  t1=$(now)
  elapsed "$t0" "$t1" >"$dir/bare-$tag-s"
}

cpu_s() { # cpu_s PID...: their CPU seconds (user and system) so far, in all
  local p t=0
  for p in "$@"; do t=$((t + $(awk '{ print $14 + $15 }' "/proc/$p/stat"))); done
  awk -v t="$t" -v hz="$(getconf CLK_TCK)" 'BEGIN { printf "%.3f\n", t / hz }'
}

applied() { # applied N...: the messages these workers have applied, in all
  local n s=0
  for n in "$@"; do s=$((s + $(metric "$n" tallyd_nats_applied_total))); done
  echo "$s"
}
# round TAG SIZE COUNT CORES N...: the workers N (running, balanced) are stopped (SIGSTOP, well
# within their lease), a fill of COUNT x SIZE is published and bare consumers read it on CORES;
# then the workers go on (SIGCONT) and their applied counters are sampled until they have
# applied it all: "applied-TAG SECONDS MESSAGES" from the SIGCONT, the fill's time beside.
round() {
  local tag=$1 size=$2 count=$3 c=$4 n base t0
  shift 4
  base=$(applied "$@")
  for n in "$@"; do kill -STOP "${pid[$n]}"; done
  t0=$(now)
  $(on "$tools") "$build/bench/nats_bench" part-seqs "$url" >"$dir/seqs"
  $(on "$tools") "$build/bench/nats_bench" fleet-fill "$url" "$tag" "$count" "$size" \
    >"$dir/fill-$tag"
  bare "$tag" "$c"
  echo "paused $(elapsed "$t0" "$(now)") s" >>"$dir/fill-$tag"
  ports=()
  for n in "$@"; do ports+=("${mport[$n]}"); done
  local pids=() cpu0
  for n in "$@"; do pids+=("${pid[$n]}"); done
  cpu0=$(cpu_s "${pids[@]}")
  t0=$(now) # before the SIGCONT: the sampler's own start is not lost
  for n in "$@"; do kill -CONT "${pid[$n]}"; done
  local tp=()
  if [ "${THREADS:-0}" = 1 ]; then
    for n in "$@"; do
      (sleep 0.1 && $(on "$tools") "$(dirname "$0")/thread-cpu.sh" "${pid[$n]}" "${THREADS_S:-0.5}" \
        >"$dir/threads-$tag-w$n" 2>&1) &
      tp+=($!)
    done
  fi
  if [ "${PERF:-0}" = 1 ]; then
    for n in "$@"; do
      (sleep 0.1 && $(on "$tools") perf record -q -e cpu-clock -F 4000 -p "${pid[$n]}" \
        -o "$dir/perf-$tag-w$n.data" -- sleep "${PERF_S:-0.5}" &&
        { perf report -q -i "$dir/perf-$tag-w$n.data" --sort pid &&
          perf report -q -i "$dir/perf-$tag-w$n.data" --percent-limit 0.5 --sort comm,symbol; } \
          >"$dir/perf-$tag-w$n" 2>&1) >/dev/null 2>&1 &
      tp+=($!)
    done
  fi
  WINDOW_OUT="$dir/window-$tag" TIMELINE_OUT="$dir/timeline-$tag" MSG_BYTES=$((size + 128)) \
    python3 - "$t0" "$base" "$((base + count))" "${ports[@]}" >"$dir/applied-$tag" <<'PY'
# Every SAMPLE_MS (default 50) each worker's /metrics, and the moment the sum reached `want`
# interpolated between the two samples around it. A render of /metrics holds the worker's shards
# and formats ~900 lines (~550 k instructions, bench/NOTES.md): asked every 5 ms, as this did
# before, it took from the apply it timed. The workers drain a backlog, so their rate is steady
# over one interval, and the crossing is within a small part of it (bench/NOTES.md).
# Each sample also sums in_path, window, fetched and lag over the workers' partitions, and the
# windows' room (owned partitions x [nats] inflight, or the messages of MSG_BYTES that
# inflight_bytes holds): their means over the samples taken before the fill was applied go to
# WINDOW_OUT; every sample, with the rate since the one before and each partition's lag, to
# TIMELINE_OUT.
import os, re, sys, time, urllib.request
t0, base, want, ports = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
every = int(os.environ.get("SAMPLE_MS", "50")) / 1000
msg_bytes = int(os.environ["MSG_BYTES"])
# Counters whose growth over the apply (first sample to last) the round reports, summed.
counters = ("resent", "checkpoints", "checkpoint_seconds", "checkpoint_drain_seconds")
def sample():
    s = {"applied": 0, "in_path": 0, "occupied": 0, "fetched": 0, "lag": 0, "window": 0}
    s.update({c: 0 for c in counters})
    s["lags"] = {}  # partition -> its lag (a partition is owned by one worker)
    s["owner"] = {}  # partition -> the worker (its place in ports) that reported it
    for p in ports:
        try:
            t = urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=2).read().decode()
        except OSError:
            continue
        v = {}
        for l in t.splitlines():
            if l.startswith("tallyd_nats_"):
                name, value = l.rsplit(" ", 1)
                k = re.match(r'tallyd_nats_partition_lag\{partition="(\d+)"\}', name)
                if k:
                    s["lags"][int(k[1])] = float(value)
                    s["owner"][int(k[1])] = ports.index(p)
                v[name.split("{")[0]] = v.get(name.split("{")[0], 0) + float(value)
        s["applied"] += int(v.get("tallyd_nats_applied_total", 0))
        s["in_path"] += v.get("tallyd_nats_partition_in_path", 0)
        s["occupied"] += v.get("tallyd_nats_partition_window", 0)
        s["fetched"] += v.get("tallyd_nats_partition_fetched", 0)
        s["lag"] += v.get("tallyd_nats_partition_lag", 0)
        per = min(v.get("tallyd_nats_inflight_limit", 0),
                  max(1, v.get("tallyd_nats_inflight_limit_bytes", 0) // msg_bytes))
        s["window"] += v.get("tallyd_nats_partitions_owned", 0) * per
        for c in counters:
            s[c] += v.get(f"tallyd_nats_{c}_total", 0)
    return s
prev_t, prev_a, samples = t0, base, 0  # at the SIGCONT, the workers had applied `base`
first = None  # the first sample: the counters' growth is from it
during = []  # the samples taken while the fill was being applied
timeline = []  # every sample
while True:
    asked = time.time()
    s = sample()
    if first is None:
        first = s
    a = s["applied"]
    t = (asked + time.time()) / 2
    samples += 1
    s["t"], s["rate"] = t - t0, (a - prev_a) / max(t - prev_t, 1e-9)
    timeline.append(s)
    if a >= want or t - t0 > 120:
        break
    during.append(s)
    prev_t, prev_a = t, a
    time.sleep(every)
if a >= want and a > prev_a:
    t = prev_t + (t - prev_t) * (want - prev_a) / (a - prev_a)
print(f"applied {t - t0:.3f} {a >= want} {samples}")
mean = lambda k: sum(x[k] for x in during) / len(during) if during else float("nan")
grew = {c: s[c] - first[c] for c in counters}
with open(os.environ["WINDOW_OUT"], "w") as f:
    print(f"window mean {mean('in_path'):.0f} of {mean('window'):.0f} "
          f"(occupied {mean('occupied'):.0f}), fetched mean {mean('fetched'):.0f}, "
          f"lag mean {mean('lag'):.0f} ({len(during)} samples); over the apply: "
          f"{grew['resent']:.0f} resent, {grew['checkpoints']:.0f} checkpoints taking "
          f"{grew['checkpoint_seconds']:.3f} s of the fleet threads, "
          f"{grew['checkpoint_drain_seconds']:.3f} s of partitions draining for them", file=f)
with open(os.environ["TIMELINE_OUT"], "w") as f:
    owners = timeline[0]["owner"] if timeline else {}
    print("  partitions by worker: " + "; ".join(
        " ".join(str(k) for k in sorted(owners) if owners[k] == w) for w in range(len(ports))),
        file=f)
    for x in timeline:
        lags = " ".join(f"{x['lags'][k] / 1000:.0f}" for k in sorted(x["lags"]))
        print(f"  {x['t'] * 1000:5.0f} ms {x['rate'] / 1000:5.0f} k/s in_path {x['in_path']:5.0f} "
              f"window {x['occupied']:5.0f} fetched {x['fetched']:6.0f} lag {x['lag']:6.0f} "
              f"(k: {lags})", file=f)
PY
  # CPU a message: the workers' from the SIGCONT to the sampler's end (idle after the apply but
  # for the sampling), the bare consumers' over their whole read of the same messages
  awk -v w0="$cpu0" -v w1="$(cpu_s "${pids[@]}")" -v b="$(cat "$dir/bare-$tag-cpu")" -v n="$count" \
    'BEGIN { printf "CPU a message %.1f us (bare %.1f us)\n", (w1 - w0) * 1e6 / n, b * 1e6 / n }' \
    >"$dir/cpu-$tag"
  if [ "${TIMELINE:-0}" = 1 ]; then
    echo "time line of round $tag (from the SIGCONT):"
    cat "$dir/timeline-$tag"
  fi
  ((${#tp[@]} == 0)) || wait "${tp[@]}"
  for n in "$@"; do
    [ -s "$dir/threads-$tag-w$n" ] || continue
    echo "threads of w$n in round $tag (cores ${cores[$n]}; share of a core over ${THREADS_S:-0.5} s):"
    awk '{ s += $1 } $1 > 0 { print "  " $0 } END { printf "  %6.1f %%  in all\n", s }' "$dir/threads-$tag-w$n"
  done
  for n in "$@"; do
    [ -s "$dir/perf-$tag-w$n" ] || continue
    echo "CPU of w$n in round $tag by thread, then by thread and function (perf, ${PERF_S:-0.5} s):"
    grep -v '^#' "$dir/perf-$tag-w$n" | grep -v '^$' | head -80 | sed 's/^/  /'
  done
}

# The fleet (streams, buckets) once, then for each size: one worker, then three.
worker 1
balanced 1
[ "${ONLY:-}" = failover ] && sizes=
for sc in $sizes; do
  size=${sc%%:*} count=${sc##*:}
  round "1-$size" "$size" "$count" "${cores[1]}" 1
  worker 3
  worker 6
  balanced 1 3 6
  round "3-$size" "$size" "$count" "${cores[1]},${cores[3]},${cores[6]}" 1 3 6
  stop 3 6
  balanced 1
  echo "$size $count" >>"$dir/sizes"
  # the raw figures as they come (a run cut short by its time limit still shows them)
  echo "$size B x $count: bare(1) $(cat "$dir/bare-1-$size-s") s, bare(3) $(cat "$dir/bare-3-$size-s") s;" \
    "applied(1) $(cat "$dir/applied-1-$size"), applied(3) $(cat "$dir/applied-3-$size");" \
    "$(grep -h paused "$dir/fill-1-$size") / $(grep -h paused "$dir/fill-3-$size");" \
    "1 worker: $(cat "$dir/cpu-1-$size"), $(cat "$dir/window-1-$size");" \
    "3 workers: $(cat "$dir/cpu-3-$size"), $(cat "$dir/window-3-$size")"
done

[ "${ONLY:-}" = rates ] && exit 0 # the raw lines above are the figures
# A steady stream at a third of the three's 1 KiB rate (or the first size's), for the faults.
worker 3
worker 6
balanced 1 3 6
if [ "${ONLY:-}" = failover ]; then
  size=1024 steady=${STEADY:-1000}
else
  size=$(awk 'NR==1{print $1}' "$dir/sizes")
  count=$(awk 'NR==1{print $2}' "$dir/sizes")
  grep -q '^1024 ' "$dir/sizes" && size=1024 && count=$(awk '$1==1024{print $2}' "$dir/sizes")
  secs3=$(awk '{print $2}' "$dir/applied-3-$size")
  steady=$(python3 -c "import sys; print(min(20000.0, max(1.0, int(sys.argv[1]) / float(sys.argv[2]) / 3)))" "$count" "$secs3")
fi
secs=$((lease / 1000 + 12))
# breakdown I: run I's take-over as the survivors logged it (td_fleet_part.c), from the kill.
breakdown() {
  python3 - "$dir/failover$1" "$dir/w1.log" "$dir/w3.log" <<'PY'
import datetime, re, sys
fo, logs = sys.argv[1], sys.argv[2:]
out = open(fo).read()
kill = float(re.search(r"^killed-at (\S+)", out, re.M).group(1))
back = {int(k): float(v) for k, v in re.findall(r"^partition (\d+): (\S+) s", out, re.M)}
took, first, made = {}, {}, {}
for name in logs:
    for line in open(name, errors="replace"):
        t = line.split(" ", 1)[0]
        try:
            at = datetime.datetime.fromisoformat(t).timestamp() - kill
        except ValueError:
            continue
        if at < 0 or at > 60:
            continue
        m = re.search(r"took partition (\d+) .* in (\d+) ms: .*?(?:, (-?\d+) ms after the previous lease ran out)?$", line)
        if m:
            k, total = int(m.group(1)), int(m.group(2)) / 1000
            expiry = at - total - int(m.group(3)) / 1000 if m.group(3) else float("nan")
            took.setdefault(k, (expiry, at - total, at))
        m = re.search(r"partition (\d+): first message applied (\d+) ms after its take began "
                      r"\(its consumer made at (-?\d+) ms\)", line)
        if m:
            k = int(m.group(1))
            first.setdefault(k, at)
            made.setdefault(k, at - (int(m.group(2)) - int(m.group(3))) / 1000)
rows = sorted(took)
f = lambda x: f"{x:.2f}"
nan = float("nan")
print("  partition: lease ran out (when awaited) / take began / taken / consumer made / first "
      "applied / watcher (s after the kill)")
for k in rows:
    e, b, d = took[k]
    print(f"  {k}: {f(e)} / {f(b)} / {f(d)} / {f(made.get(k, nan))} / {f(first.get(k, nan))} "
          f"/ {f(back.get(k, nan))}")
PY
}
: >"$dir/failovers"
for ((i = 0; i < failovers; i++)); do
  $(on "$tools") "$build/bench/nats_bench" fleet-fill "$url" "fo$i" \
    "$(python3 -c "print(int($steady * $secs))")" "$size" "$steady" >"$dir/fill-fo$i" 2>&1 &
  prod=$!
  $(on "$tools") "$build/bench/nats_bench" failover "$url" "fo$i" "${pid[6]}" $(((secs - 2) * 1000)) \
    >"$dir/failover$i" || true
  wait "${pid[6]}" 2>/dev/null || true
  kill "$prod" 2>/dev/null || true
  wait "$prod" 2>/dev/null || true
  awk '/^failover /{print $2}' "$dir/failover$i" >>"$dir/failovers"
  echo "failover $i: $(tail -1 "$dir/failovers")"
  breakdown "$i" || true
  worker 6
  balanced 1 3 6
done

[ "${ONLY:-}" = failover ] && { echo "failovers (s): $(tr '\n' ' ' <"$dir/failovers")"; exit 0; }
# A lost nats-server: the one leading the lease bucket (its election is the workers' alone).
lead=$($(on "$tools") "$build/bench/nats_bench" leader "$url" KV_TALLY_LEASES)
li=${lead#n}
$(on "$tools") "$build/bench/nats_bench" fleet-fill "$url" sk \
  "$(python3 -c "print(int($steady * $((secs + 4))))")" "$size" "$steady" >"$dir/fill-sk" 2>&1 &
prod=$!
follow=()
for ((k = 0; k < parts; k++)); do
  $(on "$tools") "$build/bench/nats_bench" bare-follow "$url" $k $(((secs + 2) * 1000)) \
    >"$dir/follow$k" 2>&1 &
  follow+=($!)
done
$(on "$tools") "$build/bench/nats_bench" failover "$url" sk "${nats_pids[$li]}" \
  $(((secs - 2) * 1000)) >"$dir/server-kill" || true
wait "${follow[@]}" || true
kill "$prod" 2>/dev/null || true
wait "$prod" 2>/dev/null || true

python3 - "$dir" "$lease" "$steady" "$size" "$layout" "$lead" "$(machine_name)" <<'PY'
import os, re, sys, time
d, lease, steady, fsize, layout, lead, machine = sys.argv[1:]
lease = int(lease)
def field(name, what, i):
    try:
        with open(f"{d}/{name}") as f:
            for l in f:
                if l.split() and l.split()[0] == what:
                    return float(l.split()[i])
    except OSError:
        pass
    return float("nan")
def bare(tag):
    s = float(open(f"{d}/bare-{tag}-s").read())
    return sum(field(f"bare-{tag}-{k}", "bare-consumer", 2) for k in range(8)) / s / 1e9
def applied(tag, size, count):
    return count * (size + 128) / field(f"applied-{tag}", "applied", 1) / 1e9
when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
print(f"\n{machine}, {os.cpu_count()} cores, {when}; hist u8 over 8 partitions (4 streams each), "
      f"3-node R3 cluster on loopback, lease {lease} ms; {layout}\n")
print("GB/s count what a message holds (its 128-byte request header and the payload); the workers "
      "apply a fill published while they were stopped (SIGSTOP, within the lease), timed from "
      "their SIGCONT to the last message applied (their tallyd_nats_applied_total)\n")
print("| messages | bare (1 worker's cores) | 1 worker | 1 / bare | bare (3 workers' cores) "
      "| 3 workers | 3 / bare | 3 / 1 |")
print("|---|---|---|---|---|---|---|---|")
for line in open(f"{d}/sizes"):
    size, count = map(int, line.split())
    b1, b3 = bare(f"1-{size}"), bare(f"3-{size}")
    one, three = applied(f"1-{size}", size, count), applied(f"3-{size}", size, count)
    rate = lambda g: f"{g:.3f} GB/s ({g * 1e9 / (size + 128) / 1e3:.0f} k msg/s)"
    print(f"| {count} x {size} B | {rate(b1)} | {rate(one)} | {one / b1:.2f} x | {rate(b3)} "
          f"| {rate(three)} | {three / b3:.2f} x | {three / one:.2f} x |")
fo = [float(x) for x in open(f"{d}/failovers").read().split()]
worst_bare = max((field(f"follow{k}", "bare-gap", 2) for k in range(8)), default=float("nan"))
sk = field("server-kill", "failover", 1)
print(f"\n| failover after kill -9 of a worker ({len(fo)} runs) | lease TTL + 2 s | steady load "
      f"| apply pause after kill -9 of nats-server {lead} (the lease bucket's leader) "
      f"| bare consumers' longest gap |")
print("|---|---|---|---|---|")
print(f"| {', '.join(f'{x:.2f}' for x in fo)} s (max {max(fo) if fo else float('nan'):.2f}) "
      f"| {lease / 1000 + 2:.1f} s | {float(steady):.0f} x {fsize} B/s | {sk:.2f} s "
      f"| {worst_bare:.2f} s |")
PY
