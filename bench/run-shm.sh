#!/usr/bin/env bash
# bench/run-shm.sh BUILD_DIR OUT_DIR — the shared-memory path (PROTOCOL.md §10) beside its ceiling,
# in one run: pinned H2D, D2H and both at once (PyTorch, 64 MiB, cudaMallocHost-backed pinned
# tensors), then tallyd over ipc with the GPU and the CPU backend, payload path and shm path,
# hist / filter / scan at 1..64 MiB, 1 and 8 producers. Markdown in OUT_DIR/shm.md.
set -uo pipefail
B=${1:?build dir}
OUT=${2:?out dir}
T=${SECONDS_PER_RUN:-1.5}
mkdir -p "$OUT"
MD="$OUT/shm.md"
LG="$B/bench/loadgen"
TD="$B/daemon/tallyd"
export LD_LIBRARY_PATH="$B/client${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT

{
  echo "# shared-memory path, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F)"
  echo
  echo '## PCIe ceiling (64 MiB pinned, PyTorch)'
  echo
  python3 - <<'PY'
import torch, time
n = 64 << 20
h = torch.empty(n, dtype=torch.uint8).pin_memory(); h2 = torch.empty(n, dtype=torch.uint8).pin_memory()
d = torch.empty(n, dtype=torch.uint8, device='cuda'); d2 = torch.empty(n, dtype=torch.uint8, device='cuda')
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
def bw(f, reps=20):
    f(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(reps): f()
    torch.cuda.synchronize(); return reps / (time.perf_counter() - t)
h2d = bw(lambda: d.copy_(h, non_blocking=True)) * n / 1e9
d2h = bw(lambda: h.copy_(d, non_blocking=True)) * n / 1e9
def both():
    with torch.cuda.stream(s1): d.copy_(h, non_blocking=True)
    with torch.cuda.stream(s2): h2.copy_(d2, non_blocking=True)
bi = bw(both) * 2 * n / 1e9
print(f"| pinned H2D | {h2d:.1f} GB/s |\n| pinned D2H | {d2h:.1f} GB/s |\n| both at once (sum) | {bi:.1f} GB/s |")
PY
  echo
} >"$MD"

"$TD" --bind ipc:///tmp/shm-gpu.ipc --backend cuda --shm-socket /tmp/shm-gpu.sock \
  --log-level notice 2>"$OUT/tallyd-gpu.log" &
pids+=($!)
"$TD" --bind ipc:///tmp/shm-cpu.ipc --backend cpu --shm-socket /tmp/shm-cpu.sock \
  --log-level notice 2>"$OUT/tallyd-cpu.log" &
pids+=($!)
sleep 2
{
  echo '## tallyd over ipc (GB/s = request payload bytes per second)'
  echo
  hdr=--header
  for be in gpu cpu; do
    for op in hist filter scan; do
      for size in 1048576 4194304 16777216; do
        for mode in "" "--shm" "--shm-out"; do
          [ "$op" = hist ] && [ "$mode" = "--shm-out" ] && continue
          timeout 60 "$LG" --endpoint ipc:///tmp/shm-$be.ipc --op $op --size $size --producers 1 \
            --window 8 --seconds "$T" $mode $hdr --label "$be $op ${mode:-payload} 1x8"
          hdr=""
        done
      done
    done
    for mode in "" "--shm"; do
      timeout 60 "$LG" --endpoint ipc:///tmp/shm-$be.ipc --op hist --size 16777216 --producers 8 \
        --window 4 --seconds "$T" $mode --label "$be hist ${mode:-payload} 8x4"
      timeout 60 "$LG" --endpoint ipc:///tmp/shm-$be.ipc --op hist --size 1048576 --producers 8 \
        --window 8 --seconds "$T" $mode --label "$be hist ${mode:-payload} 8x8"
    done
  done
} >>"$MD" 2>"$OUT/loadgen.err"
cat "$MD"
