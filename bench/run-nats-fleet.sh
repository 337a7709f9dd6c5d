#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# run-nats-fleet.sh [COUNT] [SIZE]: issue 22's fleet figures, a benchmark (not a timed test). A
# 3-node JetStream cluster on loopback (R3 streams, scratch stores), 8 partitions, COUNT hist u8
# requests of SIZE bytes (default 512 x 1 MiB) spread over 4 streams per partition:
#   1. bare JetStream pull consumers, one per partition at once, read them: the ceiling;
#   2. one worker applies them (from its restart: the first query showing values to all);
#   3. three workers apply a fresh fill (prefix r3) the same way: GB/s, ratio 3 vs 1 beside bare;
#   4. failover: the three apply a steady stream (a third of their rate); kill -9 of one; the
#      pause until every partition has gone past what it showed at the kill, against TTL + 2 s;
#   5. checkpoints during step 3 per partition (the workers' /metrics) and their state bytes
#      (the take-over log lines).
# Prints markdown rows for bench/RESULTS.md. BUILD (default build) holds tallyd and nats_bench;
# TALLYD_ARGS adds worker options (--backend cuda); LEASE_MS the lease (default 4000).
set -euo pipefail
count=${1:-512}
size=${2:-1048576}
build=${BUILD:-build}
lease=${LEASE_MS:-4000}
parts=8
dir=$(mktemp -d)
declare -A pid mport
# Workers first, with -9: one stopping gracefully after its cluster waits on NATS timeouts.
trap 'kill -9 "${pid[@]}" 2>/dev/null || true; kill $(jobs -p) 2>/dev/null || true
      wait 2>/dev/null || true; [ -n "${KEEP:-}" ] || rm -rf "$dir"' EXIT
. "$(dirname "$0")/nats-lib.sh"
nb() { "$build/bench/nats_bench" "$@"; }
nats_start "$dir" 3
url=$nats_urls
worker() { # worker N [options]: starts wN in the background
  local n=$1 z
  shift
  z=$(free_port)
  mport[$n]=$(free_port)
  # shellcheck disable=SC2086
  "$build/daemon/tallyd" --bind "tcp://127.0.0.1:$z" --metrics "127.0.0.1:${mport[$n]}" \
    --nats-servers "$url" --nats-replicas 3 --nats-partitions $parts --nats-member-id "w$n" \
    --window-intervals 0 --shm off --nats-partition-max-bytes 4G --nats-lease-ttl-ms "$lease" \
    ${TALLYD_ARGS:-} "$@" >>"$dir/w$n.log" 2>&1 &
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
    for n in "$@"; do (($(metric "$n" tallyd_nats_partitions_owned) > 0)) || ok=0; done # each has some (ids chosen so)
    ((ok && $(owned "$@") == parts)) && return 0
    sleep 0.1
  done
  echo "workers $* did not settle (logs in $dir)" >&2
  exit 1
}
elapsed() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.3f}')" "$@"; }
now() { date +%s.%N; }

# The fleet (streams, buckets) once, then the fill with no worker running.
worker 1
balanced 1
stop 1
nb fleet-fill "$url" r1 "$count" "$size" | tee "$dir/fill1"
t0=$(now)
bare=()
for ((k = 0; k < parts; k++)); do nb bare-part "$url" $k >"$dir/bare$k" & bare+=($!); done
wait "${bare[@]}"
t1=$(now)
bare_s=$(elapsed "$t0" "$t1")

# One worker applies them.
worker 1
nb fleet-applied "$url" r1 $((count * size)) 600000 | tee "$dir/applied1"

# Three: they settle, stop, a fresh fill, then all three start at once.
worker 3
worker 6
balanced 1 3 6
stop 1 3 6
nb fleet-fill "$url" r3 "$count" "$size" | tee "$dir/fill3"
for n in 1 3 6; do : >"$dir/w$n.log"; worker $n; done
nb fleet-applied "$url" r3 $((count * size)) 600000 | tee "$dir/applied3"
balanced 1 3 6
ckpts=0
for n in 1 3 6; do ckpts=$((ckpts + $(metric $n tallyd_nats_checkpoints_total))); done
own2=$(metric 6 tallyd_nats_partitions_owned)

# Failover: a steady stream at a third of the three's rate, kill -9 of w6 (member ids w1 w3 w6: 3, 2 and 3 partitions by PROTOCOL.md §13's rendezvous hashing; w1 w2 w3 would leave w2 none).
rate3=$(awk '/^fleet-applied /{print $4}' "$dir/applied3")
steady=$(python3 -c "import sys; print(max(1.0, float(sys.argv[1]) * 1e9 / int(sys.argv[2]) / 3))" "$rate3" "$size")
secs=$((lease / 1000 + 20))
nb fleet-fill "$url" fo "$(python3 -c "print(int($steady * $secs))")" "$size" "$steady" >"$dir/fill-fo" 2>&1 &
prod=$!
nb failover "$url" fo "${pid[6]}" $(((secs - 2) * 1000)) | tee "$dir/failover" || true
wait "${pid[6]}" 2>/dev/null || true
kill "$prod" 2>/dev/null || true
wait "$prod" 2>/dev/null || true

python3 - "$dir" "$count" "$size" "$bare_s" "$lease" "$ckpts" "$own2" "$steady" <<'PY'
import glob, os, re, socket, subprocess, sys, time
d, count, size, bare_s, lease, ckpts, own2, steady = sys.argv[1:]
count, size, bare_s, lease, ckpts = int(count), int(size), float(bare_s), int(lease), int(ckpts)
def field(name, what, i):
    with open(f"{d}/{name}") as f:
        for l in f:
            if l.split()[0] == what:
                return float(l.split()[i])
    return float("nan")
bare_bytes = sum(field(f"bare{k}", "bare-consumer", 2) for k in range(8))
bare = bare_bytes / bare_s / 1e9
one, three = field("applied1", "fleet-applied", 3), field("applied3", "fleet-applied", 3)
one_s, three_s = field("applied1", "fleet-applied-from-start", 3), field("applied3", "fleet-applied-from-start", 3)
pause = field("failover", "failover", 1)
state = []
for n in (1, 3, 6):
    with open(f"{d}/w{n}.log") as f:
        state += [int(m) for m in re.findall(r"took partition \d+ at sequence \d+ \((\d+) bytes", f.read())]
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
    machine = f"{gpu[0]} x{len(gpu)}" if gpu else socket.gethostname()
except (OSError, subprocess.SubprocessError):
    machine = socket.gethostname()
when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
print(f"\n{machine}, {os.cpu_count()} cores, {when}; {count} x {size} B hist u8 over 8 partitions, "
      f"3-node R3 cluster on loopback, lease {lease} ms\n")
print("| bare pull consumers (8 at once) | 1 worker | 3 workers | 3 / 1 | 3 workers / bare |")
print("|---|---|---|---|---|")
print(f"| {bare:.3f} | {one:.3f} ({one_s:.3f}) | {three:.3f} ({three_s:.3f}) | {three / one:.2f} x "
      f"| {three / bare:.2f} x |")
print("\n| failover pause (kill -9) | lease TTL + 2 s | partitions of the killed worker "
      "| steady load | checkpoints / partition (3-worker fill) | checkpoint state bytes |")
print("|---|---|---|---|---|---|")
print(f"| {pause:.2f} s | {lease / 1000 + 2:.1f} s | {own2} of 8 | {float(steady):.1f} req/s "
      f"| {ckpts / 8:.1f} | {max(state) if state else 0} |")
PY
