#!/usr/bin/env bash
# Issue 11 on the GPU host in one call: CUDA build and CTest (gpu-build-and-test.sh), the
# security, per-peer limit and lifecycle suites with tallyd --backend cuda, CURVE's cost beside
# the plain runs (bench/run-curve.sh: 8 producers x 8, hist 1 MiB and 64 KiB, tcp and ipc,
# tallyd on the GPU and the ZeroMQ echo), the unit's systemd-analyze security score, and, where
# systemd runs, tallyd on the GPU under the unit's sandbox (DynamicUser, SystemCallFilter,
# DevicePolicy, UMask...) answering a hist. run (carry: [".deps"]): bash scripts/gpu-issue11-check.sh
OUT=${OUT:-/tmp/gpu-issue11}
CTEST_EXCLUDE='test_cuda_backend|test_differential_gpu'
source scripts/gpu-build-and-test.sh
for t in test_security test_limits test_lifecycle; do
  t0=$SECONDS
  TALLY_TEST_BACKEND=cuda timeout 180 $B/tests/$t >$OUT/$t-cuda.log 2>&1
  echo "$t cuda rc=$? $((SECONDS - t0))s" >>$S
  grep -E "FAILED|ERROR|pings during|busy|rate_limited" $OUT/$t-cuda.log | head -5 >>$S
done
t0=$SECONDS
GPU_ARGS="--backend cuda" SECONDS_PER_RUN=3 timeout 400 bench/run-curve.sh $B $OUT >/dev/null 2>&1
echo "run-curve rc=$? $((SECONDS - t0))s" >>$S
grep "^| " $OUT/curve.md >>$S
systemd-analyze security --offline=true $B/systemd/tallyd.service 2>/dev/null | tail -1 >>$S
# The sandbox with the GPU: the unit's [Service] settings on a transient unit, if systemd runs.
if [ "$(systemctl is-system-running 2>/dev/null)" = running ] ||
  [ "$(systemctl is-system-running 2>/dev/null)" = degraded ]; then
  props=()
  while IFS= read -r line; do props+=(-p "$line"); done < <(
    sed -n '/^\[Service\]/,/^\[/p' $B/systemd/tallyd.service |
      grep -E '^[A-Za-z]+=' | grep -vE '^(Type|ExecStart|ExecReload|Restart|RestartSec|WatchdogSec|TimeoutStopSec|KillMode)=')
  systemd-run --unit tallyd-sandbox-check "${props[@]}" -p Type=notify \
    $PWD/$B/daemon/tallyd --backend cuda --bind tcp://127.0.0.1:5799 --shm off >>$S 2>&1
  sleep 5
  head -c 1048576 /dev/urandom >$OUT/frame.raw
  $B/cli/tally -e tcp://127.0.0.1:5799 hist --type u8 --in $OUT/frame.raw | head -2 >>$S
  echo "sandboxed hist rc=${PIPESTATUS[0]}" >>$S
  $B/cli/tally -e tcp://127.0.0.1:5799 info | grep -E "backend=" >>$S
  journalctl -u tallyd-sandbox-check --no-pager 2>/dev/null | grep -iE "backend|EPERM|denied|error" | head -10 >>$S
  systemctl stop tallyd-sandbox-check 2>/dev/null
else
  echo "systemd not running here: check the unit's sandbox with the GPU by hand (see the report)" >>$S
fi
cat $S
