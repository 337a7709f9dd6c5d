#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# run-nats.sh [COUNT] [SIZE]: one tallyd fleet worker applying COUNT hist u8 requests of SIZE
# bytes (default 512 x 1 MiB) from JetStream, beside a bare JetStream pull consumer reading the
# same messages, in the same run (issue 22's figure: worker >= 0.8 x bare). One local
# nats-server (R1, a scratch store), one worker with one partition, windows off. Run from the
# repository root after a build (build/). Prints a markdown row for bench/RESULTS.md.
#   1. the worker starts (creating the fleet) and stops, releasing its partition;
#   2. the producer publishes COUNT requests (nothing applies them yet);
#   3. a bare pull consumer reads them all (the engine's reading ceiling);
#   4. the worker starts again; its applying rate, from the first query that shows values to
#      the one that shows them all (and the rate from its start, take-over included).
set -euo pipefail
count=${1:-512}
size=${2:-1048576}
build=${BUILD:-build}
dir=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$dir"' EXIT
. "$(dirname "$0")/nats-lib.sh"
zport=$(free_port)
nats_start "$dir" 1
url=$nats_urls
worker() { # starts it in the background: its pid in $pid
  "$build/daemon/tallyd" --bind "tcp://127.0.0.1:$zport" --nats-servers "$url" \
    --nats-replicas 1 --nats-partitions 1 --nats-member-id bench --window-intervals 0 \
    --nats-partition-max-bytes 16G "$@" >>"$dir/worker.log" 2>&1 &
  pid=$!
}
wait_took() {
  for _ in $(seq 200); do grep -q "took partition 0" "$dir/worker.log" && return 0; sleep 0.05; done
  echo "the worker did not take its partition (log: $dir/worker.log)" >&2; exit 1
}
worker
wait_took
kill -TERM "$pid"; wait "$pid" || true
: >"$dir/worker.log"
"$build/bench/nats_bench" fill "$url" bench "$count" "$size" | tee "$dir/fill"
"$build/bench/nats_bench" bare "$url" bench "$count" | tee "$dir/bare"
start=$(date +%s.%N)
worker
"$build/bench/nats_bench" applied "$url" bench $((count * size)) 600000 | tee "$dir/applied"
end=$(date +%s.%N)
took=$(grep -m1 "took partition 0" "$dir/worker.log" || true)
kill -TERM "$pid"; wait "$pid" || true
python3 - "$dir" "$start" "$end" "$count" "$size" <<'PY'
import sys
d, start, end, count, size = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def rate(name):
    with open(f"{d}/{name}") as f:
        return float(f.read().split()[3])
bare = rate("bare")
worker = rate("applied")
whole = count * size / (end - start) / 1e9
print(f"| {count} x {size} B hist u8 | publish {rate('fill'):.3f} | bare pull consumer {bare:.3f} "
      f"| worker applying {worker:.3f} ({whole:.3f} from its start) | {worker / bare:.2f} x |")
PY
