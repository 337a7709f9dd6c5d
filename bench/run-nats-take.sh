#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# run-nats-take.sh BUILD_DIR [CKPT_MS]: what a direct-mode `replicated` take-over spends
# replaying its changelog's tail (issue 33, bench/NOTES.md "Standbys"). A 3-node R3 cluster on
# loopback (contrib/nats/users.conf), 8 partitions: member `a` takes them all (3 s lease,
# checkpoints every CKPT_MS, default 1000), loadgen --fleet sends 1 KiB hist 2 x 64 for 6 s,
# a is killed (kill -9) after 3 s of it, and member `b`, started then, takes every partition
# over. Prints b's take lines and, per take, the tail it applied and the time since the take
# before it on the fleet thread (the first: since b's first line), a benchmark, not a test.
# STANDBYS=1 (issue 33's standbys, bench/NOTES.md "Standbys, built"): both members run with
# `standbys = 1` and b is up before the load (it takes its share from a, and keeps a copy of
# a's); after a's kill b takes a's partitions from its copies, and the tail after each copy is
# what it replays. STANDBYS=0 runs the same order without standbys (the baseline). With
# STANDBYS, b's copies' counters are printed right before a's kill: the copies (re)started from a
# checkpoint, and the new checkpoints they ran on across or restarted from (bench/NOTES.md
# "Standbys across checkpoints, built").
set -euo pipefail
build=${1:?usage: run-nats-take.sh BUILD_DIR [CKPT_MS]}
ckpt=${2:-1000}
here=$(cd "$(dirname "$0")" && pwd)
dir=$(mktemp -d)
trap 'kill -9 $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$dir"' EXIT
. "$here/nats-lib.sh"
export NATS_USERS=$here/../contrib/nats/users.conf
nats_start "$dir" 3
wurl=${nats_urls//nats:\/\//nats:\/\/worker:change-me-worker@}
purl=${nats_urls//nats:\/\//nats:\/\/producer-direct:change-me-producer-direct@}
metrics=$(free_port)
member() { # member ID: in the background, its log in $dir/ID.log; b's metrics on $metrics
  "$build/daemon/tallyd" --bind "tcp://127.0.0.1:$(free_port)" --shm off --max-inflight 4096 \
    ${STANDBYS:+$([ "$1" = b ] && echo --metrics 127.0.0.1:"$metrics")} \
    --nats-servers "$wurl" --nats-replicas 3 --nats-partitions 8 --nats-member-id "$1" \
    --nats-direct replicated --nats-lease-ttl-ms 3000 --nats-checkpoint-interval-ms "$ckpt" \
    ${STANDBYS:+--nats-standbys "$STANDBYS"} >"$dir/$1.log" 2>&1 &
}
member a
apid=$!
for _ in $(seq 150); do grep -q "took partition 7 " "$dir/a.log" && break; sleep 0.2; done
if [ -n "${STANDBYS:-}" ]; then # b up first: its share handed over, a's copied
  member b
  bpid=$!
  for _ in $(seq 150); do grep -q "gives up\|gave up\|took partition" "$dir/b.log" && break; sleep 0.2; done
  sleep 3
fi
"$build/bench/loadgen" --fleet "$purl" --streams 24 --op hist --size 1024 --producers 2 \
  --window 64 --seconds 6 --label take >"$dir/load.log" 2>&1 &
sleep 3
if [ -n "${STANDBYS:-}" ]; then
  curl -s "http://127.0.0.1:$metrics/metrics" | grep -E "^tallyd_nats_standby_(starts|checkpoints)" || true
fi
kill -9 "$apid"
[ -n "${STANDBYS:-}" ] || { member b; bpid=$!; }
for _ in $(seq 100); do [ "$(grep -c "took partition" "$dir/b.log")" -ge 8 ] && break; sleep 0.2; done
sleep 1
kill -TERM "$bpid"
wait "$bpid" 2>/dev/null || true
grep -E "changelog: applied|changelog: nothing|took partition|taken from" "$dir/b.log"
python3 - "$dir/b.log" <<'PY'
import re, sys
from datetime import datetime
lines = open(sys.argv[1]).read().splitlines()
t = lambda l: datetime.fromisoformat(l.split()[0])
prev = t(lines[0])
print("\n| partition's tail (messages) | ms since the take before | ms a message |\n|---|---|---|")
for l in lines:
    m = re.search(r"(?:applied |nothing to replay from )(\d+)(?:\.\.| on \(it ends at )(\d+)", l)
    if m:
        n, ms = int(m[2]) - int(m[1]) + 1, (t(l) - prev).total_seconds() * 1e3
        print(f"| {n} | {ms:.0f} | {ms / n if n else 0:.2f} |")
        prev = t(l)
PY
