#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# run-nats-direct.sh BUILD_DIR OUT_DIR: issue 33's direct-mode figures, a benchmark (not a timed
# test). A 3-node JetStream cluster on loopback with contrib/nats/users.conf (members connect as
# `worker`, producers as `producer-direct`), 8 partitions, hist u8. For N = 1 .. NMAX:
#   1. N standalone tallyds (no NATS), N loadgen processes, process i to tallyd i (--endpoint)
#      with K/N streams;
#   2. N members in direct mode `local`, the same N loadgen processes each with a fleet client
#      per producer (loadgen --fleet) over K streams, so each process reaches every member;
#      (at N = 1 also through plain clients, --endpoint to the member: the fleet client's share);
#   3. the same with `replicated` (every write answered once its changelog record is stored);
# each at SMALL_SIZE (1 KiB) with PW_SMALL producers x in flight per process and BIG_SIZE
# (1 MiB) with PW_BIG; then with each mode LAT_PW (1 x 8) at BIG_SIZE for the latency that
# `replicated` adds, and with `replicated` CL_SIZE (16 MiB) batches for the changelog's bytes
# (TALLY_CL<k>'s stored bytes before and after, from JetStream's stream info) over the input's.
# Last, the broker's own ceiling for that changelog (`nats_bench cl-ceiling`, on member 0's
# cores, once the members are gone): messages of the average size N = 1's SMALL_SIZE run stored,
# 4 in flight a partition (the committer's CL_DEPTH), each expecting the last sequence before
# it, for SECONDS_PER_RUN: what a `replicated` run's changelog rate is beside.
# The member ids are chosen so that the rendezvous plan splits the 8 partitions as evenly as it
# can (8 = 4 + 4, 3 + 3 + 2), and K (at least KMIN) so that each member owns exactly K/N of the
# streams: every member gets the same load, as each standalone does (bench/NOTES.md).
# PIN (default 1 with 8 cores or more) pins to disjoint cores: the three nats-servers share the
# first S cores (2 with 16 cores or more, else 1; in `local` they only keep leases, in
# `replicated` they store ~2 KiB records), then slot i of NMAX (3 with 14 cores or more, else
# 2) holds member i (or standalone i) on its first half and loadgen process i on the rest (16
# cores: servers 0-1; slots 2-5, 6-9, 10-13: tallyd on 2 cores, loadgen on 2; 14-15 the
# script). Every tallyd, standalone or member, gets the same options: --io-threads, --shards
# and --workers sized to its slot (TALLYD_ARGS adds more), --max-inflight 4096 (a replicated
# member's held replies keep their slots until the group commit is stored).
# Prints the tables (markdown) and writes them with every raw row to OUT_DIR/direct.md.
# THREADS=1: member 0's threads' shares of a core over 1 s of each N = 1 SMALL_SIZE run
# (bench/thread-cpu.sh), in OUT_DIR/threads-TAG.txt and OUT_DIR/direct.md.
# Each `replicated` SMALL_SIZE run: member 0's changelog families (tallyd_nats_changelog_*, the
# held writes' stages among them) and its hist requests' time from read to reply
# (tallyd_request_duration_seconds{op="hist"}) scraped before and after, in OUT_DIR/stages.txt,
# and in OUT_DIR/direct.md the run's share of each stage (count, mean, quantiles from the
# buckets) beside the whole request's mean and the producers' p50.
# SAT_SMALL / SAT_BIG ("4x64 8x64"): first, one standalone at each of these P x W (what it
# needs to saturate). Small counts for a 2-core box: SECONDS_PER_RUN=1 NMAX=2 PW_SMALL=2x16 PW_BIG=2x4.
set -euo pipefail
build=${1:?usage: run-nats-direct.sh BUILD_DIR OUT_DIR}
out=${2:?usage: run-nats-direct.sh BUILD_DIR OUT_DIR}
mkdir -p "$out"
secs=${SECONDS_PER_RUN:-2}
small=${SMALL_SIZE:-1024} big=${BIG_SIZE:-1048576} cl_size=${CL_SIZE:-16777216}
pw_small=${PW_SMALL:-8x64} pw_big=${PW_BIG:-8x8} pw_lat=${LAT_PW:-1x8} pw_cl=${PW_CL:-2x4}
kmin=${KMIN:-24}
here=$(cd "$(dirname "$0")" && pwd)
users=$here/../contrib/nats/users.conf
ncpu=$(nproc)
pin=${PIN:-$((ncpu >= 8 ? 1 : 0))}
if [ "$pin" = 1 ]; then nmax=${NMAX:-$((ncpu >= 14 ? 3 : 2))}; else nmax=${NMAX:-2}; fi
dir=$(mktemp -d)
rows=$out/rows.txt
: >"$rows"
declare -a tdpid=() tdport=() tdm=()
trap 'kill -9 "${tdpid[@]}" 2>/dev/null || true; kill $(jobs -p) 2>/dev/null || true
      wait 2>/dev/null || true; [ -n "${KEEP:-}" ] || rm -rf "$dir"' EXIT
. "$here/nats-lib.sh"

# ---- the layout -----------------------------------------------------------------------------
declare -a tdcores=() lgcores=()
thread_args=()
if [ "$pin" = 1 ]; then
  s=$((ncpu >= 16 ? 2 : 1))
  slot=$(((ncpu - s) / nmax))
  mc=$(((slot + 1) / 2))
  lc=$((slot - mc))
  ((lc >= 1)) || { echo "PIN=1 with NMAX=$nmax needs more than $ncpu cores" >&2; exit 1; }
  NATS_PIN="0-$((s - 1)) 0-$((s - 1)) 0-$((s - 1))"
  for ((i = 0; i < nmax; i++)); do
    at=$((s + i * slot))
    tdcores[i]="$at-$((at + mc - 1))"
    lgcores[i]="$((at + mc))-$((at + slot - 1))"
  done
  io=$((mc / 2 > 0 ? mc / 2 : 1))
  shards=$((mc - io > 0 ? mc - io : 1))
  thread_args=(--io-threads "$io" --shards "$shards" --workers "$mc")
  layout="pinned: nats-servers on 0-$((s - 1)); tallyd i on ${tdcores[*]}; loadgen i on ${lgcores[*]} ($io I/O threads, $shards shards, $mc workers each)"
else
  NATS_PIN=
  layout="not pinned ($ncpu cores)"
fi
export NATS_PIN NATS_USERS=$users
on() { if [ "$pin" = 1 ]; then echo "taskset -c $1"; fi; }

nats_start "$dir" 3
wurl=${nats_urls//nats:\/\//nats:\/\/worker:change-me-worker@}
purl=${nats_urls//nats:\/\//nats:\/\/producer-direct:change-me-producer-direct@}

# ---- the plan: member ids and K -------------------------------------------------------------
# plan N: "IDS K COUNTS": ids (comma-separated) whose rendezvous plan (td_fleet_plan.c: the
# FNV-1a 64 of "<id>/<k>" through SplitMix64's finaliser, the highest score owns k) splits the 8
# partitions as evenly as 8 / N allows, and the least K >= KMIN (a multiple of N) for which every
# member owns K/N of the streams loadgen/s0 .. s<K-1> (tally_partition: FNV-1a 64 mod 8).
plan() {
  python3 - "$1" "$kmin" <<'PY'
import sys
n, kmin = int(sys.argv[1]), int(sys.argv[2])
M = (1 << 64) - 1
def fnv(data, h=0xcbf29ce484222325):
    for c in data:
        h = ((h ^ c) * 0x100000001b3) & M
    return h
def mix(z):
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & M
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & M
    return z ^ (z >> 31)
def owner(ids, k):
    return max(range(len(ids)), key=lambda i: (mix(fnv(f"/{k}".encode(), fnv(ids[i].encode()))), ids[i]))
parts = 8
# candidate id sets whose plans split the partitions as evenly as 8 / n allows
cands = []
for j in range(300):
    ids = [f"direct{n}-{i}-{j}" for i in range(n)]
    own = [owner(ids, k) for k in range(parts)]
    counts = [own.count(i) for i in range(n)]
    if max(counts) - min(counts) <= (1 if parts % n else 0):
        cands.append((ids, own, counts))
part_of = [fnv(f"loadgen/s{s}".encode()) % parts for s in range(4096)]
for k in range(max(kmin, n) // n * n, 4097, n):
    for ids, own, counts in cands:
        per = [0] * n
        for s in range(k):
            per[own[part_of[s]]] += 1
        if len(set(per)) == 1:
            print(",".join(ids), k, ",".join(map(str, counts)))
            sys.exit(0)
sys.exit("no member ids and K split the streams evenly")
PY
}

# ---- tallyds --------------------------------------------------------------------------------
# metric PORT NAME: a tallyd's value ("down" when it does not answer)
metric() {
  python3 - "$1" "$2" <<'PY' 2>/dev/null || echo down
import sys, urllib.request
t = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=2).read().decode()
print(next((l.split()[-1] for l in t.splitlines() if l.startswith(sys.argv[2] + " ")), "0"))
PY
}
# start_td I [options]: tallyd I on slot I's cores (tdpid, tdport, tdm), waits for its /metrics
start_td() {
  local i=$1
  shift
  tdport[i]=$(free_port)
  tdm[i]=$(free_port)
  # shellcheck disable=SC2086 # TALLYD_ARGS and on are words
  $(on "${tdcores[i]:-}") "$build/daemon/tallyd" --bind "tcp://127.0.0.1:${tdport[i]}" \
    --metrics "127.0.0.1:${tdm[i]}" --shm off --max-inflight 4096 "${thread_args[@]}" \
    ${TALLYD_ARGS:-} "$@" >>"$dir/td$i.log" 2>&1 &
  tdpid[i]=$!
  for _ in $(seq 100); do
    [ "$(metric "${tdm[i]}" tallyd_up)" != down ] && return 0
    sleep 0.1
  done
  echo "tallyd $i did not start: $(tail -3 "$dir/td$i.log")" >&2
  exit 1
}
stop_tds() {
  local i
  for i in "${!tdpid[@]}"; do kill -TERM "${tdpid[i]}" 2>/dev/null || true; done
  for i in "${!tdpid[@]}"; do wait "${tdpid[i]}" 2>/dev/null || true; done
  tdpid=()
}
# members N MODE IDS COUNTS: N members in direct mode MODE, waited for until each owns the
# partitions the plan gives it
members() {
  local n=$1 mode=$2 i ok c
  local -a ids counts
  IFS=, read -r -a ids <<<"$3"
  IFS=, read -r -a counts <<<"$4"
  for ((i = 0; i < n; i++)); do
    # No checkpoint within a run (an hour apart; each stop checkpoints): a checkpoint that holds
    # every record purges the changelog (compaction at a quiet point), which would take its
    # bytes out of the stored-bytes figure below.
    start_td "$i" --nats-servers "$wurl" --nats-replicas 3 --nats-partitions 8 \
      --nats-member-id "${ids[i]}" --nats-direct "$mode" ${COMMIT_MS:+--nats-commit-ms "$COMMIT_MS"} \
      --nats-checkpoint-interval-ms 3600000
  done
  for _ in $(seq 300); do
    ok=1
    for ((i = 0; i < n; i++)); do
      c=$(metric "${tdm[i]}" tallyd_nats_partitions_owned)
      [ "${c%.*}" = "${counts[i]}" ] || ok=0
    done
    ((ok)) && return 0
    sleep 0.1
  done
  echo "members ($mode) did not take the plan's partitions (logs in $dir)" >&2
  exit 1
}

# ---- loads ----------------------------------------------------------------------------------
# load TAG N SIZE PxW K standalone|fleet: N loadgen processes at once (process i on slot i's
# cores), each P producers x W in flight, hist u8 of SIZE; a standalone's process i sends to
# tallyd i on K/N streams, a fleet's every process on K streams through the members. Each
# process's row goes to $rows as "TAG i ROW".
load() {
  local tag=$1 n=$2 size=$3 pw=$4 k=$5 how=$6 i
  local -a lp=()
  for ((i = 0; i < n; i++)); do
    if [ "$how" = fleet ]; then
      set -- --fleet "$purl" --streams "$k"
    else
      set -- --endpoint "tcp://127.0.0.1:${tdport[i]}" --streams $((k / n))
    fi
    # shellcheck disable=SC2046 # on is words
    $(on "${lgcores[i]:-}") "$build/bench/loadgen" "$@" --op hist --size "$size" \
      --producers "${pw%x*}" --window "${pw#*x}" --seconds "$secs" --label "$tag" \
      >"$dir/load-$tag-$i" 2>&1 &
    lp+=($!)
  done
  for ((i = 0; i < n; i++)); do
    wait "${lp[i]}" || echo "loadgen $tag $i: exit $? ($(grep -v '^|' "$dir/load-$tag-$i" | head -2 | tr '\n' ' '))" >&2
    grep '^| ' "$dir/load-$tag-$i" | sed "s/^/$tag $i /" >>"$rows" || true
  done
  grep -h "^per " "$dir"/load-"$tag"-* | head -1 | sed "s/^/$tag: /" >>"$out/per-partition.txt" || true
}
# stages TAG: member 0's changelog families now, under "== TAG" in OUT_DIR/stages.txt
stages() {
  { echo "== $1"
    python3 - "${tdm[0]}" <<'PY' 2>/dev/null || echo "down"
import sys, urllib.request
t = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=2).read().decode()
print("\n".join(l for l in t.splitlines() if l.startswith("tallyd_nats_changelog_") or
                l.startswith(("tallyd_request_duration_seconds_sum{op=\"hist\"}",
                              "tallyd_request_duration_seconds_count{op=\"hist\"}"))))
PY
  } >>"$out/stages.txt"
}
# stored TAG: the changelogs' bytes and records now, as "TAG stored BYTES RECORDS"
stored() {
  echo "$1 $("$build/bench/nats_bench" stored "${wurl%%,*}" TALLY_CL 8)" >>"$rows"
}

echo "run-nats-direct: $layout; $secs s a run" | tee "$out/layout.txt"
# which cores are SMT siblings (CPU CORE pairs): a slot's neighbours matter (bench/NOTES.md)
echo "cpus (CPU:CORE): $(lscpu -p=CPU,CORE 2>/dev/null | grep -v '^#' | tr ',\n' ': ')" >>"$out/layout.txt"
# What one standalone needs to saturate: SAT_SMALL and SAT_BIG (P x W lists) on tallyd 0 alone.
if [ -n "${SAT_SMALL:-}${SAT_BIG:-}" ]; then
  start_td 0
  for pw in ${SAT_SMALL:-}; do load "sat-$small-$pw" 1 "$small" "$pw" "$kmin" standalone; done
  for pw in ${SAT_BIG:-}; do load "sat-$big-$pw" 1 "$big" "$pw" "$kmin" standalone; done
  stop_tds
fi
for ((n = 1; n <= nmax; n++)); do
  read -r ids k counts <<<"$(plan "$n")"
  echo "N=$n: members $ids own $counts partitions; K=$k streams ($((k / n)) per member)" |
    tee -a "$out/layout.txt"
  for ((i = 0; i < n; i++)); do start_td "$i"; done
  load "standalone-$n-$small" "$n" "$small" "$pw_small" "$k" standalone
  load "standalone-$n-$big" "$n" "$big" "$pw_big" "$k" standalone
  stop_tds
  for mode in local replicated; do
    members "$n" "$mode" "$ids" "$counts"
    for run in "$small:$pw_small" "$big:$pw_big" "$big:$pw_lat:lat" "$cl_size:$pw_cl:cl"; do
      IFS=: read -r size pw what <<<"$run"
      if [ "$what" = lat ] && ((n > 1)); then continue; fi # the latency row: one member
      if [ "$what" = cl ] && [ "$mode" = local ]; then continue; fi # no changelog in local
      tag="$mode-$n-$size${what:+-$what}"
      procs=$n
      if [ "$what" = lat ]; then procs=1; fi
      if [ "$mode" = replicated ]; then stored "$tag-before"; fi
      if [ "$mode" = replicated ] && [ "$size" = "$small" ] && [ -z "$what" ]; then stages "$tag-before"; fi
      if [ "${THREADS:-0}" = 1 ] && ((n == 1)) && [ "$size" = "$small" ] && [ -z "$what" ]; then
        (sleep 0.7 && "$here/thread-cpu.sh" "${tdpid[0]}" 1 >"$out/threads-$tag.txt" 2>&1) &
      fi
      load "$tag" "$procs" "$size" "$pw" "$k" fleet
      if [ "$mode" = replicated ]; then stored "$tag-after"; fi
      if [ "$mode" = replicated ] && [ "$size" = "$small" ] && [ -z "$what" ]; then stages "$tag-after"; fi
    done
    if [ "$mode" = local ] && ((n == 1)); then # the member through plain clients (--endpoint)
      load "local-1-$small-plain" 1 "$small" "$pw_small" "$k" standalone
      load "local-1-$big-plain" 1 "$big" "$pw_big" "$k" standalone
    fi
    for ((i = 0; i < n; i++)); do
      echo "$mode-$n member $i: commits $(metric "${tdm[i]}" tallyd_nats_changelog_commits_total)" \
        "not_durable $(metric "${tdm[i]}" tallyd_nats_not_durable_total)" >>"$out/members.txt"
    done
    stop_tds
  done
done

# The broker's ceiling for the changelog: N = 1's SMALL_SIZE messages, as a bare publisher.
read -r _ _ b0 r0 <<<"$(grep "^replicated-1-$small-before stored" "$rows" || echo "- - 0 0")"
read -r _ _ b1 r1 <<<"$(grep "^replicated-1-$small-after stored" "$rows" || echo "- - 0 0")"
if ((r1 > r0)); then
  # shellcheck disable=SC2046 # on is words
  echo "cl-ceiling $((b1 > b0 ? (b1 - b0) / (r1 - r0) : 1)) $($(on "${tdcores[0]:-}") \
    "$build/bench/nats_bench" cl-ceiling "${wurl%%,*}" 8 $(((b1 - b0) / (r1 - r0))) 4 "$secs")" \
    >>"$rows" || echo "cl-ceiling: failed" >&2
fi

# ---- the tables -----------------------------------------------------------------------------
python3 - "$rows" "$nmax" "$small" "$big" "$cl_size" "$pw_small" "$pw_big" "$pw_lat" "$pw_cl" \
  "$layout" "$(machine_name)" "$out/stages.txt" <<'PY' | tee "$out/direct.md"
import math, os, re, sys, time
rows_path, nmax, small, big, cl_size, pw_small, pw_big, pw_lat, pw_cl, layout, machine, stages_path = sys.argv[1:]
nmax, small, big, cl_size = int(nmax), int(small), int(big), int(cl_size)
runs, stored = {}, {}
for line in open(rows_path):
    w = line.split()
    if len(w) >= 4 and w[1] == "stored":
        stored[w[0]] = (int(w[2]), int(w[3]))
    if "|" not in line:
        continue
    tag, cells = w[0], [c.strip() for c in line.split("|")[1:-1]]
    a, s = cells[9].split("/")
    runs.setdefault(tag, []).append(dict(rps=float(cells[4]), gbs=float(cells[5]),
        p50=float(cells[6]), p99=float(cells[7]), answered=int(a), errors=int(cells[10])))
def total(tag, key):
    r = runs.get(tag)
    return sum(x[key] for x in r) if r else math.nan
def worst(tag, key):
    r = runs.get(tag)
    return max(x[key] for x in r) if r else math.nan
def rate(tag):
    return f"{total(tag, 'rps'):,.0f} ({total(tag, 'gbs'):.3f})"
def ratio(a, b):
    return f"{a / b:.2f} x" if b and not math.isnan(a) and not math.isnan(b) else "–"
print(f"\n{machine}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
      f"hist u8 over ZeroMQ tcp loopback, 8 partitions, 3-node R3 cluster on loopback; {layout}\n")
print("req/s (GB/s) summed over the N loadgen processes; P x W is per process (each process "
      "reaches every member)\n")
print("| N | size | P x W | N standalone | local | local / N standalone | local / (N x 1 standalone) "
      "| replicated | replicated / local | replicated / N standalone |")
print("|---|---|---|---|---|---|---|---|---|---|")
for n in range(1, nmax + 1):
    for size, pw in ((small, pw_small), (big, pw_big)):
        sa, lo, re_ = f"standalone-{n}-{size}", f"local-{n}-{size}", f"replicated-{n}-{size}"
        one = total(f"standalone-1-{size}", "gbs")
        print(f"| {n} | {size} B | {pw} | {rate(sa)} | {rate(lo)} | "
              f"{ratio(total(lo, 'gbs'), total(sa, 'gbs'))} | {ratio(total(lo, 'gbs'), n * one)} | "
              f"{rate(re_)} | {ratio(total(re_, 'gbs'), total(lo, 'gbs'))} | "
              f"{ratio(total(re_, 'gbs'), total(sa, 'gbs'))} |")
sat = [t for t in runs if t.startswith("sat-")]
if sat:
    print("\nOne standalone tallyd (slot 0) by producers x in flight: req/s (GB/s), p50 / p99 us\n")
    print("| size | P x W | req/s (GB/s) | p50 / p99 us |")
    print("|---|---|---|---|")
    for t in sat:
        _, size, pw = t.split("-")
        print(f"| {size} B | {pw} | {rate(t)} | {worst(t, 'p50'):.0f} / {worst(t, 'p99'):.0f} |")
plain = [t for t in runs if t.endswith("-plain")]
if plain:
    print("\nN = 1, `local`: the member through loadgen's plain clients (--endpoint, as the "
          "standalone) and through fleet clients (--fleet): the producer's share of the gap\n")
    print("| size | P x W | standalone | member, plain clients | member, fleet clients | plain / standalone | fleet / plain |")
    print("|---|---|---|---|---|---|---|")
    for t in plain:
        size = int(t.split("-")[2])
        pw, sa, fl = (pw_small if size == small else pw_big), f"standalone-1-{size}", f"local-1-{size}"
        print(f"| {size} B | {pw} | {rate(sa)} | {rate(t)} | {rate(fl)} | "
              f"{ratio(total(t, 'gbs'), total(sa, 'gbs'))} | {ratio(total(fl, 'gbs'), total(t, 'gbs'))} |")
print(f"\nLatency of hist {big} B (p50 / p99 us; several processes: the worst process's)\n")
print("| N | P x W | local p50 / p99 | replicated p50 / p99 | added p50 / p99 (ms) | req/s local / replicated |")
print("|---|---|---|---|---|---|")
for n in range(1, nmax + 1):
    for suffix, pw in (("-lat", pw_lat), ("", pw_big)):
        lo, re_ = f"local-{n}-{big}{suffix}", f"replicated-{n}-{big}{suffix}"
        if lo not in runs and re_ not in runs:
            continue
        print(f"| {n} | {pw}{' (1 process)' if suffix else ''} | {worst(lo, 'p50'):.0f} / {worst(lo, 'p99'):.0f} "
              f"| {worst(re_, 'p50'):.0f} / {worst(re_, 'p99'):.0f} "
              f"| {(worst(re_, 'p50') - worst(lo, 'p50')) / 1e3:.2f} / {(worst(re_, 'p99') - worst(lo, 'p99')) / 1e3:.2f} "
              f"| {total(lo, 'rps'):,.0f} / {total(re_, 'rps'):,.0f} |")
print("\nChangelog: TALLY_CL0..7's stored bytes (JetStream stream info) gained during a replicated "
      "run, over the input bytes of every write answered in it (warm-up included)\n")
print("| N | hist | P x W | input (writes) | changelog (messages) | bytes a write | changelog / input |")
print("|---|---|---|---|---|---|---|")
for tag in runs:
    if not tag.startswith("replicated-") or f"{tag}-before" not in stored:
        continue
    n, size = int(tag.split("-")[1]), int(tag.split("-")[2])
    pw = pw_cl if tag.endswith("-cl") else pw_lat if tag.endswith("-lat") else pw_small if size == small else pw_big
    writes = total(tag, "answered")
    inb = writes * size
    b0, r0 = stored[f"{tag}-before"]
    b1, r1 = stored.get(f"{tag}-after", (math.nan, math.nan))
    print(f"| {n} | {size} B | {pw} | {inb / 1e9:.3f} GB ({writes}) | {(b1 - b0) / 1e6:.3f} MB "
          f"({r1 - r0}) | {(b1 - b0) / writes:,.0f} | {100 * (b1 - b0) / inb:.4f} % |")
ceiling = [l.split() for l in open(rows_path) if l.startswith("cl-ceiling ")]
if ceiling and len(ceiling[-1]) == 7:
    _, avg, _, csecs, cbytes, _, cmsgs = ceiling[-1]
    cmps, cbps = int(cmsgs) / float(csecs), float(cbytes) / float(csecs)
    print(f"\nThe changelog beside the broker's ceiling: `nats_bench cl-ceiling` on member 0's cores "
          f"published {int(avg):,}-byte messages (N = 1's {small} B run's average) to TALLY_CL0..7, "
          f"4 in flight a partition: {cmps:,.0f} messages/s ({cbps / 1e6:.1f} MB/s). A `replicated` "
          f"run's changelog rate: its messages (bytes) a write x its req/s\n")
    print("| N | hist | P x W | req/s | messages a write | changelog messages/s | MB/s | / ceiling (messages) | / ceiling (bytes) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in range(1, nmax + 1):
        tag = f"replicated-{n}-{small}"
        if f"{tag}-after" not in stored or not total(tag, "answered"):
            continue
        (b0, r0), (b1, r1) = stored[f"{tag}-before"], stored[f"{tag}-after"]
        writes, rps = total(tag, "answered"), total(tag, "rps")
        mps, bps = (r1 - r0) / writes * rps, (b1 - b0) / writes * rps
        print(f"| {n} | {small} B | {pw_small} | {rps:,.0f} | {(r1 - r0) / writes:.3f} | {mps:,.0f} | "
              f"{bps / 1e6:.1f} | {mps / cmps:.2f} x | {bps / cbps:.2f} x |")
# member 0's stages over each replicated SMALL_SIZE run: the scrape after less the one before
scrapes, at = {}, None
for line in open(stages_path) if os.path.exists(stages_path) else []:
    if line.startswith("== "):
        at = scrapes.setdefault(line[3:].strip(), {})
    elif at is not None and " " in line:
        name, v = line.rsplit(" ", 1)
        at[name] = float(v)
def quantile(buckets, q):  # as PromQL's histogram_quantile: linear within the bucket
    total_n = buckets[-1][1]
    if not total_n:
        return math.nan
    lo, below = 0.0, 0.0
    for le, n in buckets:
        if n >= q * total_n:
            if math.isinf(le):
                return lo
            return lo + (le - lo) * ((q * total_n - below) / (n - below) if n > below else 0)
        lo, below = le, n
    return lo
shown = False
for tag in sorted(t[:-len("-after")] for t in scrapes if t.endswith("-after")):
    a, b = scrapes[f"{tag}-after"], scrapes.get(f"{tag}-before", {})
    d = {k: a[k] - b.get(k, 0.0) for k in a}
    if not shown:
        print(f"\nWhere member 0's held writes waited during each replicated {small} B run "
              f"(tallyd_nats_changelog_stage_seconds, the run's share: after less before, "
              f"warm-up included; quantiles from the buckets); per message: batch, publish, ack; "
              f"per write: release\n")
        print("| run | P x W | stage | count | mean ms | p50 ms | p90 ms | p99 ms |")
        print("|---|---|---|---|---|---|---|---|")
        shown = True
    for st in ("batch", "publish", "ack", "release"):
        cnt = d.get(f'tallyd_nats_changelog_stage_seconds_count{{stage="{st}"}}', 0)
        tot = d.get(f'tallyd_nats_changelog_stage_seconds_sum{{stage="{st}"}}', 0)
        bk = sorted((float(m.group(1)), v) for k, v in d.items()
                    for m in [re.match(rf'tallyd_nats_changelog_stage_seconds_bucket{{stage="{st}",le="([^"]+)"}}', k)] if m)
        print(f"| {tag} | {pw_small} | {st} | {cnt:,.0f} | {1e3 * tot / cnt if cnt else math.nan:.3f} | "
              f"{1e3 * quantile(bk, 0.5):.3f} | {1e3 * quantile(bk, 0.9):.3f} | {1e3 * quantile(bk, 0.99):.3f} |")
    rc = d.get('tallyd_request_duration_seconds_count{op="hist"}', 0)
    rs = d.get('tallyd_request_duration_seconds_sum{op="hist"}', 0)
    print(f"| {tag} | {pw_small} | the whole request, read to reply (p50: the producers') | {rc:,.0f} | "
          f"{1e3 * rs / rc if rc else math.nan:.3f} | {worst(tag, 'p50') / 1e3:.3f} | | |")
    full, wait = d.get("tallyd_nats_changelog_flights_full_total", 0), d.get("tallyd_nats_changelog_flight_wait_seconds_total", 0)
    print(f"| {tag} | {pw_small} | batches due with every flight out | {full:,.0f} | "
          f"{1e3 * wait / full if full else math.nan:.3f} (their wait) | | | |")
errs = {t: total(t, "errors") for t in runs if total(t, "errors")}
if errs:
    print(f"\nerrors: {errs}")
PY
cat "$out/layout.txt" "$out/members.txt" "$out/per-partition.txt" 2>/dev/null >>"$out/direct.md"
for f in "$out"/threads-*.txt; do # THREADS=1: member 0's threads, N = 1, SMALL_SIZE
  [ -e "$f" ] && { echo; echo "${f##*/} (share of a core, 1 s of the run):"; cat "$f"; } >>"$out/direct.md"
done
{ echo; echo "raw rows:"; cat "$rows"; } >>"$out/direct.md"
