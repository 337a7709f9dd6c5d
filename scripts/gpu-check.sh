#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# scripts/gpu-check.sh — everything the GPU host checks, in one device call: one CUDA build
# (sm_90, -Werror, tests on) of the whole tree, then the steps named in STEPS, each with its own
# time limit (a hang in one still leaves the others' logs). Logs go under $OUT (the device tool
# brings them back), the summary to $OUT/summary.txt, which is printed at the end.
#
#   run (carry: [".deps"], after scripts/fetch-device-deps.sh here):
#     bash scripts/gpu-check.sh                          # STEPS="ctest diff", about 4 minutes
#     STEPS="ctest diff kernels path" bash scripts/gpu-check.sh
#     STEPS="variants" VARIANTS="scan8:-DTK_SCAN_VECS=8" bash scripts/gpu-check.sh
#     BUILD_TARGETS="kernel_bench test_cuda_backend" STEPS="sweep kernel-test" bash ...  # fewer
#                 targets built: only what the steps run
#
# Steps:
#   ctest       every CTest test with the GPU present (the *_gpu twins run for real);
#               CTEST_INCLUDE / CTEST_EXCLUDE (regexes) narrow it; test_differential_gpu is
#               left to `diff` unless CTEST_EXCLUDE is set
#   suites      the integration suites again with tallyd --backend cuda (TALLY_TEST_BACKEND)
#   diff        the CPU-vs-GPU differential test (fixed and random seed, DIFF_SCALE, default 4;
#               rerun a seed with TALLY_TEST_SEED=N) and the snapshot tests, with the kernels'
#               tuning row this GPU selects; then once more per row of the tuning table
#               (kernels/cuda/tk_cuda_tuning.cu; DIFF_TUNINGS="name ..." to choose), forced with
#               the test switch TALLY_CUDA_TUNING, at DIFF_TUNING_SCALE (default 1)
#   kernel-test the long kernel test (test_cuda_backend, every size up to 2^28), every scan,
#               histogram and minmax result under every tuning row and the variants that reach
#               the kernels no row uses (the test's own loop)
#   memcheck, racecheck
#               the kernel test (quick) under compute-sanitizer
#   daemon-memcheck
#               test_pipeline_gpu, test_shm_gpu and test_gpu_region (without its bench) with
#               tallyd itself under compute-sanitizer
#               memcheck (the split over real CUDA streams included); reports in
#               $OUT/memcheck-PID.log. test_shm's test_sigterm_inflight_refs counts on requests
#               still running at SIGTERM; under the tool they may all have finished (seen on the
#               H100, 2026-11-23: its only failure there, with 0 memcheck errors in every run)
#   region      device regions (issue 23, PROTOCOL.md §10 "Device memory"): test_gpu_region, one
#               run of about a minute: every op and dtype by device reference against the same
#               bytes as payloads on a CPU-backend tallyd (replies and stream records identical),
#               a garbage fd, a wrong size, an unknown UUID, a producer killed with requests in
#               flight, every filter and scan written into a device output region (DEV_OUTPUT)
#               against the CPU's replies ("device output NAME: outputs identical"), and the
#               bench rows (hist u8 on 64 and 256 MiB device regions, 8 in flight; filter and
#               scan i32 32 MiB from a device region into a device output region; each against
#               the read or copy ceiling measured in the same run and the kernel at one in
#               flight on local memory; tallyd's cost a request with each thread's CPU time a
#               request: lines "bench:")
#   gpu-region-cli
#               `tally hist|filter|scan --gpu-region` (libtally's device ring: tally_gpu_alloc,
#               copies, requests by device reference, filter and scan output written into the
#               device region by tallyd) against the same commands without it, on a 16 MiB file
#               (lines "gpu-region-cli: CMD: identical"; "DIFFERS" is a failure), and the
#               device-region requests counted (tallyd_gpu_region_requests_total ... owner)
#   nats-fleet  bench/run-nats-fleet.sh (issues 22 and 32: a 3-node R3 cluster on loopback, 8
#               partitions, servers and workers pinned to disjoint cores (PIN=1); bare pull
#               consumers beside 1 then 3 workers of the CUDA build applying hist u8 of 1 KiB,
#               64 B and 1 MiB (NATS_FLEET_SIZES, "SIZE:COUNT ..."), failover pause after kill -9
#               of a worker (NATS_FLEET_FAILOVERS runs, default 3) against lease + 2 s, the apply
#               pause after kill -9 of the lease bucket's nats-server against the bare
#               consumers' longest gap): $OUT/nats-fleet.txt, its markdown rows in the summary
#               (240 s cap, 25 s more a failover past 3); NATS_FLEET_TALLYD_ARGS adds worker
#               options (e.g. "--nats-members-per-process 2"); NATS_FLEET_PIN=0 runs it unpinned,
#               THREADS=1 adds each worker's threads' share of a core in every round
#   nats-direct bench/run-nats-direct.sh (issue 33, direct mode: a 3-node R3 cluster on loopback
#               with contrib/nats/users.conf, 8 partitions; N = 1, 2 (3 with 14 cores) members in
#               `local` and `replicated` beside N standalone tallyds, each tallyd and its loadgen
#               process pinned to a slot of their own, hist u8 1 KiB and 1 MiB over ZeroMQ tcp:
#               req/s, GB/s, member / standalone; p50 / p99 of 1 MiB, 1 x 8, replicated vs local;
#               the changelog's stored bytes over the input's, 16 MiB batches; first one
#               standalone at NATS_DIRECT_SAT_SMALL / NATS_DIRECT_SAT_BIG producers x in flight;
#               NATS_DIRECT_TALLYD_ARGS adds tallyd options, the script's own variables pass):
#               $OUT/nats-direct.md, its tables in the summary (330 s cap). With STEPS=nats-direct
#               alone the build makes only tallyd, loadgen and nats_bench
#   gpu-region-py
#               the Python binding's GpuRegion on the GPU (bench/gpu_region_py.py): hist by
#               device reference on 64 and 256 MiB regions, 8 threads with a client each (8 in
#               flight), lines "gpu-region-py: hist u8 SIZE MiB, 8 in flight: G GB/s" (the
#               CuPy figure of docs/c-and-python.md; compare with STEPS=region's "bench:" kernel ceiling), the
#               regions filled through CuPy if installed, torch.as_tensor if PyTorch is; then
#               the GPU examples of docs/ (<!-- python: gpu -->) when CuPy is there. Needs
#               NumPy (Debian's, carried by fetch-device-deps.sh, when python3 lacks it)
#   recover     a lost context recreated on the real GPU (TALLYD_TEST_FAULT_STICKY=12: the 12th
#               launch never completes and the device fails after it, as after an illegal
#               address): every `tally hist` output stays identical, the log says "context
#               recreated after a failure", GPU requests and a --gpu-region run go on after it
#               (lines "recover: ...")
#   peer        work on a peer GPU (issue 23, PROTOCOL.md §10 "Which GPU runs it"), on a host with
#               two GPUs (kind nvidia-h100-x2 or nvidia-h200-x2): test_gpu_region's test_peer alone
#               (TALLY_REGION_ONLY), a tallyd with --test-gpu-peer-always running GPU 0's region on
#               GPU 1, without and with an IPC event, a scan written from GPU 1 into GPU 0's output
#               region, each against the CPU tallyd's replies and counted where="peer"; then the
#               bench row (hist u8 64 MiB run on GPU 1 via tallyd, 8 in flight, against the kernel
#               on GPU 1 reading GPU 0's memory and on GPU 0's own: lines "peer: ..."); the
#               simulated rule itself is CTest's test_shm_peer. One GPU: "skipped"
#   region-tune the region step's bench rows (test_bench alone) under other tallyd options and
#               in-flight counts (REGION_TUNE="name|options|in flight[|tallyd];...": spinning
#               lanes that poll the GPU, the loop spinning, gpu streams, 16 in flight; the
#               optional 4th field runs another tallyd binary, a baseline built in the same call)
#   lane-bench  bench/lane_bench: the GPU alone under tallyd's launch sequences (hist u8 64 and
#               256 MiB, filter and scan i32 32 MiB), all enqueued at once on 1, 4 and 8
#               streams, against the read and copy ceilings; then --explore (the histogram's
#               rate by size, blocks per SM, one buffer or 8 in turn)
#   kernels     bench/kernel_bench (kernels against copy bandwidth and CUB), with the tuning row
#               this GPU selects (KERNEL_TUNING=name forces one)
#   sweep       bench/kernel_bench --sweep: candidate tuning rows (scan shapes and prefetch
#               distances, colour layouts, grids) on the same inputs, lines "sweep | ..." in
#               $OUT/sweep.txt and the summary
#   variants    kernel_bench and the quick kernel test of builds with other tuning constants:
#               VARIANTS="name:-DFLAG=V,-DFLAG2=W ..."
#   profile     where tallyd's threads spend their time under the ZeroMQ 8 x 8 hist load
#               (bench/thread-cpu.sh; the host has no perf)
#   path        bench/run-path.sh (issue 9's whole data-path benchmark, about 2 minutes)
#   loadgen, curve, recv-ab, io-threads, malloc-ab
#               bench/run-<step>.sh
#   soak        bench/soak.sh (issue 21, item 7): tallyd (SOAK_BACKEND, default cuda) under the
#               soak mix for SOAK_SECONDS (default 420, so that one call holds it with the build),
#               its RSS by kind of mapping every second and the slopes of each half, in $OUT/soak/.
#               Longer than one call (the 20-minute soak: SOAK_SECONDS=1200): SOAK_DETACH=1 starts
#               it in a session of its own, which outlives the call, writing into build-gpu/soak;
#               then calls with STEPS=soak-collect each wait up to SOAK_WAIT s (default 540) for
#               it to end and bring what it wrote so far into $OUT/soak/
#   asan-stop   an ASan+UBSan build with CUDA (build-gpu-asan) and STOP_ROUNDS (default 24) stops
#               of tests/test_stop_clean.c with leak detection, its GPU rounds on the real GPUs
#               (issue 21, item 10: the leak at stop was seen under ASan, not on the dev box)
#   info        `tally info` of a tallyd on every GPU of the host (a multi-GPU kind shows
#               them all)
#   shards      issue 31, about 2 minutes: the CPU-vs-GPU differential test with every tallyd on 4
#               shards (TALLYD_TEST_SHARDS=4; its test_differential_shards compares 1 and 4
#               shards), then bench/run-shards.sh: hist u8 64 B - 4 KiB, 8 and 16 producers x
#               64, ipc and tcp, no stream and 256 streams, beside the ZeroMQ echo with the same
#               I/O threads; one producer's 4 KiB p50 against the echo's; tallyd at 1, 2, 4, 8
#               and 16 shards (req/s, per shard, busy seconds per shard); more I/O threads beside
#               redis-benchmark -t incr,hset -P 64 -c 16 (Debian's redis, carried by
#               fetch-device-deps.sh). The summary gets the computed tables in markdown
#               ($OUT/shards-summary.md: tallyd / echo, scaling / linear, p50 - echo p50,
#               tallyd / Redis INCR); the rows are in $OUT/shards.md. With STEPS=shards alone
#               the build makes only what it runs (tallyd, tally, loadgen, test_differential)
#               unless BUILD_TARGETS says otherwise. Any step runs on shards with
#               TALLYD_TEST_SHARDS=N set for the call (STEPS=ctest too)
#   systemd     the unit's systemd-analyze security score, and where systemd runs, tallyd on
#               the GPU under the unit's sandbox answering a hist
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/gpu-check}
STEPS=${STEPS:-ctest diff}
B=build-gpu
S=$OUT/summary.txt
mkdir -p "$OUT"
# shellcheck source=device-env.sh
source scripts/device-env.sh

note() { echo "$*" | tee -a "$S"; }
# timed NAME LIMIT command...: runs the command (at most LIMIT seconds), notes its exit status
# and time.
timed() {
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  timeout "$limit" "$@"
  note "$name: rc=$? ($((SECONDS - t0)) s)"
}

build() {
  local t0=$SECONDS
  cmake -S . -B $B -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DTALLY_CUDA=ON -DTALLY_WERROR=ON -DTALLY_FUZZ=OFF >"$OUT/build.log" 2>&1 &&
    cmake --build $B -j"$(nproc)" ${BUILD_TARGETS:+--target $BUILD_TARGETS} >>"$OUT/build.log" 2>&1
  local rc=$?
  note "build: rc=$rc ($((SECONDS - t0)) s)"
  [ $rc = 0 ] || { tail -30 "$OUT/build.log"; exit 1; }
  export LD_LIBRARY_PATH="$PWD/$B/client${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export TALLYD_BIN="$PWD/$B/daemon/tallyd" TALLY_BIN="$PWD/$B/cli/tally"
}

step_ctest() {
  local exclude=${CTEST_EXCLUDE:-test_differential_gpu}
  (cd $B && timed ctest 420 ctest -j6 ${CTEST_INCLUDE:+-R "$CTEST_INCLUDE"} -E "$exclude" \
    --output-on-failure >"$OUT/ctest.log" 2>&1)
  grep -E "tests passed|\*\*\*|Failed" "$OUT/ctest.log" | tee -a "$S"
}

step_suites() {
  for t in test_daemon test_client_daemon test_lifecycle test_seq test_security test_limits; do
    TALLY_TEST_BACKEND=cuda timed "$t (--backend cuda)" 180 "$B/tests/$t" >"$OUT/$t-cuda.log" 2>&1
    grep -E "FAILED|ERROR" "$OUT/$t-cuda.log" | head -5 | tee -a "$S"
  done
}

step_diff() {
  TALLY_PIPELINE_ENGINE=cuda TALLY_DIFF_SCALE=${DIFF_SCALE:-4} \
    timed "test_differential (cuda, scale ${DIFF_SCALE:-4})" 300 "$B/tests/test_differential" \
    >"$OUT/test_differential-cuda.log" 2>&1
  grep -E "seed|every reply|snapshot:|PASSED|FAILED|ERROR|LINE" "$OUT/test_differential-cuda.log" |
    head -16 | tee -a "$S"
  local row rows=${DIFF_TUNINGS:-$("$B/bench/kernel_bench" --list-tunings)}
  for row in $rows; do
    TALLY_CUDA_TUNING=$row TALLY_PIPELINE_ENGINE=cuda TALLY_DIFF_SCALE=${DIFF_TUNING_SCALE:-1} \
      timed "test_differential (cuda, tuning $row, scale ${DIFF_TUNING_SCALE:-1})" 300 \
      "$B/tests/test_differential" >"$OUT/test_differential-$row.log" 2>&1
    grep -E "every reply|PASSED|FAILED|ERROR|LINE" "$OUT/test_differential-$row.log" | head -8 |
      sed "s/^/  $row: /" | tee -a "$S"
  done
}

# Issue 31: the GPU path against the CPU reference on four shards (and, inside the test, one
# against four), then the tables.
step_shards() {
  TALLYD_TEST_SHARDS=4 TALLY_PIPELINE_ENGINE=cuda TALLY_DIFF_SCALE=${DIFF_SCALE:-1} \
    timed "test_differential (cuda, 4 shards)" 150 "$B/tests/test_differential" \
    >"$OUT/test_differential-shards4.log" 2>&1
  grep -E "every reply|PASSED|FAILED|ERROR|LINE" "$OUT/test_differential-shards4.log" |
    head -8 | sed "s/^/shards 4: /" | tee -a "$S"
  SECONDS_PER_RUN=${SECONDS_PER_RUN:-1} timed run-shards 400 bench/run-shards.sh "$B" \
    "$OUT/shards" >"$OUT/run-shards.log" 2>&1
  cp "$OUT/shards/shards.md" "$OUT/shards/shards-summary.md" "$OUT/" 2>/dev/null
  if [ -s "$OUT/shards-summary.md" ]; then
    tee -a "$S" <"$OUT/shards-summary.md"
  else
    note "run-shards: no summary (tail of $OUT/run-shards.log:)"
    tail -20 "$OUT/run-shards.log" | tee -a "$S"
  fi
}

step_kernel_test() {
  timed "test_cuda_backend" 300 "$B/tests/test_cuda_backend" >"$OUT/kernel-test.log" 2>&1
  grep -E "PASSED|FAILED|ERROR" "$OUT/kernel-test.log" | head -10 | tee -a "$S"
}

step_sanitizer() { # memcheck | racecheck
  TALLY_TEST_QUICK=1 timed "$1 (kernel test, quick)" 240 compute-sanitizer --tool "$1" \
    --error-exitcode 9 --print-limit 20 "$B/tests/test_cuda_backend" >"$OUT/$1.log" 2>&1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|FAILED|PASSED" "$OUT/$1.log" | head -5 | tee -a "$S"
}

# tallyd itself under compute-sanitizer: a wrapper the tests start as TALLYD_BIN. The tests stop
# tallyd with SIGTERM; the wrapper hands it on to tallyd (the tool's child), so that tallyd exits
# cleanly and the tool writes its summary. The tool cannot tell the exit status of a child that
# a signal made exit ("couldn't find exit code"): then the wrapper exits 0 if the tool found no
# error (or tallyd made no CUDA call), else with the tool's status (9 on an error).
step_daemon_memcheck() {
  local wrap="$OUT/tallyd-memcheck.sh"
  cat >"$wrap" <<EOF
#!/bin/bash
log=$OUT/memcheck-\$\$.log
compute-sanitizer --tool memcheck --error-exitcode 9 --log-file \$log $TALLYD_BIN "\$@" &
cs=\$!
trap 'kill -TERM \$(pgrep -P \$cs) 2>/dev/null' TERM INT
rc=0; while kill -0 \$cs 2>/dev/null; do wait \$cs; rc=\$?; done
# No summary when tallyd made no CUDA call (--backend cpu, simulated GPUs): nothing to check.
if grep -q "find exit code" \$log &&
  grep -qE "ERROR SUMMARY: 0 errors|before first instrumented API call" \$log; then rc=0; fi
exit \$rc
EOF
  chmod +x "$wrap"
  TALLYD_BIN="$wrap" TALLY_PIPELINE_ENGINE=cuda timed "test_pipeline (tallyd under memcheck)" \
    240 "$B/tests/test_pipeline_gpu" >"$OUT/test_pipeline-memcheck.log" 2>&1
  TALLYD_BIN="$wrap" TALLY_SHM_ENGINE=cuda timed "test_shm (tallyd under memcheck)" 240 \
    "$B/tests/test_shm_gpu" >"$OUT/test_shm-memcheck.log" 2>&1
  TALLYD_BIN="$wrap" TALLY_REGION_QUICK=1 timed "test_gpu_region (tallyd under memcheck)" 300 \
    "$B/tests/test_gpu_region" >"$OUT/test_gpu_region-memcheck.log" 2>&1
  grep -hE "\[  FAILED  \]|did not start|LINE|timed out" "$OUT"/test_*-memcheck.log | sort | uniq -c |
    head -20 | tee -a "$S"
  note "memcheck summaries: $(grep -h 'ERROR SUMMARY' "$OUT"/memcheck-*.log 2>/dev/null | sort | uniq -c | tr '\n' ';')"
}

step_peer() {
  TALLY_REGION_ONLY=test_peer timed "test_gpu_region test_peer" 300 "$B/tests/test_gpu_region" \
    >"$OUT/peer.log" 2>&1
  grep -E "peer:|bench:|PASSED|FAILED|ERROR|LINE|SKIPPED|skipped" "$OUT/peer.log" | head -20 |
    sed 's/^\(peer: \)\{0,1\}/peer: /' | tee -a "$S"
}

step_region() {
  timed test_gpu_region 300 "$B/tests/test_gpu_region" >"$OUT/test_gpu_region.log" 2>&1
  grep -E "differential|device output|libtally|wrong size|producer killed|bench:|PASSED|FAILED|ERROR|LINE|skipped" \
    "$OUT/test_gpu_region.log" | head -40 | tee -a "$S"
}

# The device-region bench rows (test_gpu_region's test_bench alone: the ceilings, tallyd's cost a
# request, the rows) under other tallyd settings and in-flight counts:
# REGION_TUNE="name|tallyd options|in flight;..." (issue 34: spinning lanes that poll the GPU,
# the loop spinning while requests are on the GPU, streams, 16 in flight).
step_region_tune() {
  local v name args inflight bin i=0
  local variants=${REGION_TUNE:-"default||8;poll 50 us|--gpu-spin-us 50|8;poll 200 us|--gpu-spin-us 200|8;poll 50 us and loop spin|--gpu-spin-us 50 --gpu-spin-loop|8;poll 50 us 8 streams|--gpu-streams 8 --gpu-spin-us 50|8;default b||8;poll 50 us b|--gpu-spin-us 50|8"}
  IFS=';' read -ra list <<<"$variants"
  for v in "${list[@]}"; do
    IFS='|' read -r name args inflight bin <<<"$v"
    i=$((i + 1))
    TALLYD_BIN=${bin:-$TALLYD_BIN} TALLY_REGION_ONLY=test_bench TALLY_REGION_GPU_ARGS="$args" \
      TALLY_REGION_INFLIGHT="$inflight" \
      timed "region-tune $name" 120 "$B/tests/test_gpu_region" >"$OUT/region-tune-$i.log" 2>&1
    grep -E "bench:" "$OUT/region-tune-$i.log" | sed "s/^/region-tune $name ($inflight in flight): /" |
      tee -a "$S"
  done
}

# Issue 34: the GPU alone under tallyd's launch sequences (bench/lane_bench.cu), 1, 4 and 8
# streams, against the ceilings of the same run.
step_lane_bench() {
  timed lane_bench 120 "$B/bench/lane_bench" >"$OUT/lane-bench.txt" 2>&1
  timed "lane_bench --explore" 120 "$B/bench/lane_bench" --explore >>"$OUT/lane-bench.txt" 2>&1
  grep -E "^lane_bench" "$OUT/lane-bench.txt" | tee -a "$S"
}

step_kernels() {
  timed kernel_bench 200 "$B/bench/kernel_bench" --label gpu-check \
    ${KERNEL_TUNING:+--tuning "$KERNEL_TUNING"} >"$OUT/kernel.txt" 2>&1
  grep -E "^kernel_bench|^\|" "$OUT/kernel.txt" | tee -a "$S"
}

step_sweep() {
  timed kernel_sweep 300 "$B/bench/kernel_bench" --label sweep --sweep >"$OUT/sweep.txt" 2>&1
  grep -E "^kernel_bench|^sweep" "$OUT/sweep.txt" | tee -a "$S"
}

step_variants() {
  for v in ${VARIANTS:-}; do
    local name=${v%%:*} flags=${v#*:} d
    flags=${flags//,/ }
    d=build-var-$name
    if cmake -S . -B "$d" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DTALLY_CUDA=ON -DCMAKE_CUDA_FLAGS="$flags" >>"$OUT/build.log" 2>&1 &&
      cmake --build "$d" -j"$(nproc)" --target kernel_bench test_cuda_backend >>"$OUT/build.log" 2>&1; then
      # A variant's figures count only if it computes the right thing.
      TALLY_TEST_QUICK=1 timed "variant $name: quick test" 120 "$d/tests/test_cuda_backend" \
        >"$OUT/variant-$name-test.log" 2>&1
      timed "variant $name: bench" 150 "$d/bench/kernel_bench" --label "$name ($flags)" \
        >>"$OUT/variants.txt" 2>&1
    else
      note "variant $name: build FAILED"
    fi
  done
}

step_profile() {
  local run=/tmp/tallyd-profile-$$ td lg
  mkdir -p $run
  "$TALLYD_BIN" --backend cuda --bind "ipc://$run/t.ipc" --shm off --log-level notice \
    >"$OUT/tallyd-profile.log" 2>&1 &
  td=$!
  sleep 2
  "$B/bench/loadgen" --endpoint "ipc://$run/t.ipc" --op hist --size 1048576 --producers 8 \
    --window 8 --seconds 4 --send zc --stagger-ms 50 >"$OUT/loadgen-profile.txt" 2>&1 &
  lg=$!
  sleep 1.5
  note "threads of tallyd --backend cuda under hist 1 MiB 8 x 8 ipc (% of one core over 2 s):"
  bash bench/thread-cpu.sh $td 2 | head -16 | tee -a "$S"
  wait $lg
  grep '^| ' "$OUT/loadgen-profile.txt" | tail -1 | tee -a "$S"
  kill $td
  wait $td 2>/dev/null
  rm -rf $run
}

step_bench() { # NAME: bench/run-NAME.sh into $OUT/NAME
  SECONDS_PER_RUN=${SECONDS_PER_RUN:-1.2} timed "run-$1" 420 "bench/run-$1.sh" "$B" "$OUT/$1" \
    >"$OUT/run-$1.log" 2>&1
  cp "$OUT/$1"/*.md "$OUT/" 2>/dev/null
}

step_nats_fleet() { # issue 22's fleet figures: bench/run-nats-fleet.sh on the CUDA build
  command -v nats-server >/dev/null || { note "nats-fleet: no nats-server (fetch-device-deps.sh)"; return; }
  local failovers=${NATS_FLEET_FAILOVERS:-3} # each one past 3 adds ~25 s (a kill, a lease)
  BUILD=$B TALLYD_ARGS="--backend auto ${NATS_FLEET_TALLYD_ARGS:-}" PIN=${NATS_FLEET_PIN:-1} FAILOVERS=$failovers \
    SIZES=${NATS_FLEET_SIZES:-1024:100000 64:100000 1048576:256} \
    timed nats-fleet $((240 + 25 * (failovers > 3 ? failovers - 3 : 0))) \
    bench/run-nats-fleet.sh >"$OUT/nats-fleet.txt" 2>&1
  grep -A5 "^| \(messages\|failover\)" "$OUT/nats-fleet.txt" | tee -a "$S"
}

step_nats_direct() { # issue 33's direct-mode figures: bench/run-nats-direct.sh
  command -v nats-server >/dev/null || { note "nats-direct: no nats-server (fetch-device-deps.sh)"; return; }
  TALLYD_ARGS="--backend auto ${NATS_DIRECT_TALLYD_ARGS:-}" \
    SAT_SMALL=${NATS_DIRECT_SAT_SMALL-4x64 8x64 16x64} \
    SAT_BIG=${NATS_DIRECT_SAT_BIG-2x8 4x8 8x8} \
    timed nats-direct 330 bench/run-nats-direct.sh "$B" "$OUT/nats-direct" >"$OUT/nats-direct.txt" 2>&1
  cp "$OUT/nats-direct/direct.md" "$OUT/nats-direct.md" 2>/dev/null
  grep -E "^(\||run-nats-direct|N=|One|Latency|Changelog|The changelog|req/s|errors)" "$OUT/nats-direct.txt" |
    tee -a "$S"
}

step_soak() {
  local secs=${SOAK_SECONDS:-420}
  export SOAK_SECONDS=$secs SOAK_BACKEND=${SOAK_BACKEND:-cuda}
  if [ "${SOAK_DETACH:-0}" = 1 ]; then
    rm -rf "$B/soak"
    mkdir -p "$B/soak"
    setsid nohup bash bench/soak.sh "$B" "$PWD/$B/soak" >"$B/soak/soak.log" 2>&1 </dev/null &
    note "soak: started in its own session for $secs s (pid $!); collect with STEPS=soak-collect"
    return
  fi
  timed soak $((secs + 90)) bash bench/soak.sh "$B" "$OUT/soak" >"$OUT/soak.log" 2>&1
  tee -a "$S" <"$OUT/soak/soak-summary.txt"
}

step_soak_collect() {
  local waited=0 sum=$B/soak/soak-summary.txt
  until grep -q "tallyd exit" "$sum" 2>/dev/null || [ $waited -ge "${SOAK_WAIT:-540}" ]; do
    sleep 10
    waited=$((waited + 10))
  done
  mkdir -p "$OUT/soak"
  cp -r "$B/soak/." "$OUT/soak/"
  if grep -q "tallyd exit" "$sum" 2>/dev/null; then
    tee -a "$S" <"$sum"
  else
    note "soak: still running; its last samples (t_s rss_kb main_heap_kb arenas arena_rss_kb ...):"
    tail -3 "$B/soak/soak-rss.tsv" | tee -a "$S"
  fi
}

step_asan_stop() {
  local d=build-gpu-asan t0=$SECONDS
  if ! { cmake -S . -B $d -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CUDA_ARCHITECTURES=90 -DTALLY_CUDA=ON \
    -DTALLY_SANITIZE=ON -DTALLY_FUZZ=OFF >"$OUT/build-asan.log" 2>&1 &&
    cmake --build $d -j"$(nproc)" --target tallyd test_stop_clean >>"$OUT/build-asan.log" 2>&1; }; then
    note "asan-stop: build FAILED ($((SECONDS - t0)) s)"
    tail -20 "$OUT/build-asan.log"
    return
  fi
  # protect_shadow_gap=0: CUDA maps memory where ASan's shadow gap would be
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:protect_shadow_gap=0 \
    LSAN_OPTIONS=suppressions=$PWD/tests/lsan/libzmq.supp \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 TALLY_STOP_ENGINE=cuda \
    TALLY_STOP_ROUNDS=${STOP_ROUNDS:-24} TALLYD_BIN="$PWD/$d/daemon/tallyd" \
    timed "asan-stop (${STOP_ROUNDS:-24} stops)" 420 "$d/tests/test_stop_clean" >"$OUT/asan-stop.log" 2>&1
  grep -E "^round|clean|ERROR|LINE|tallyd's log" "$OUT/asan-stop.log" | tail -8 | tee -a "$S"
  grep -o "/tmp/tallyd-test-[0-9-]*.log" "$OUT/asan-stop.log" | sort -u |
    while read -r log; do cp "$log" "$OUT/"; done
}

step_info() {
  "$TALLYD_BIN" --backend cuda --bind tcp://127.0.0.1:5701 --shm off 2>"$OUT/tallyd-info.log" &
  local pid=$!
  sleep 3
  "$TALLY_BIN" -e tcp://127.0.0.1:5701 info | tee -a "$S"
  kill -TERM $pid
  wait $pid
  note "tallyd exit: $?"
}

# A tallyd on the GPU for the steps below, on its own port and side channel under $1; its pid in
# TALLYD_PID. Extra environment comes through the caller's.
start_gpu_tallyd() {
  local dir=$1 port=$2
  "$TALLYD_BIN" --backend cuda --bind "tcp://127.0.0.1:$port" --shm-socket "$dir/shm.sock" \
    2>"$dir/tallyd.log" &
  TALLYD_PID=$!
  for _ in $(seq 50); do
    "$TALLY_BIN" -e "tcp://127.0.0.1:$port" ping >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  note "tallyd did not start: $(tail -3 "$dir/tallyd.log")"
  return 1
}

stop_gpu_tallyd() {
  kill -TERM "$TALLYD_PID" 2>/dev/null
  wait "$TALLYD_PID"
  note "$1: tallyd exit: $?"
}

# Each data command with --gpu-region against the same without it (binary output files).
step_gpu_region_cli() {
  local dir=$OUT/gpu-region-cli ep=tcp://127.0.0.1:5702 cmd i=0
  mkdir -p "$dir"
  # 12 MiB: a whole number of rgb8 pixels (3 bytes) and of i32 elements (4)
  head -c 12M /dev/urandom >"$dir/in.bin"
  start_gpu_tallyd "$dir" 5702 || return
  for cmd in "hist --in in.bin" "hist --type i32 --range -1000000000 1000000000 --in in.bin" \
    "hist --type rgb --in in.bin" "filter --gt 0 --stable --in in.bin" \
    "filter --type u8 --lt 100 --stable --in in.bin --chunk 3M" "scan --in in.bin" \
    "scan --out32 --exclusive --in in.bin --chunk 256K"; do
    i=$((i + 1))
    # shellcheck disable=SC2086 # cmd is words
    (cd "$dir" && "$TALLY_BIN" -e $ep $cmd --out plain$i.bin 2>plain$i.err &&
      "$TALLY_BIN" -e $ep $cmd --gpu-region --out dev$i.bin 2>dev$i.err)
    if cmp -s "$dir/plain$i.bin" "$dir/dev$i.bin"; then
      note "gpu-region-cli: $cmd: identical"
    else
      note "gpu-region-cli: $cmd: DIFFERS ($(head -c 300 "$dir/dev$i.err"))"
    fi
  done
  "$TALLY_BIN" -e $ep stats | grep -E "tallyd_gpu_region" | tee -a "$S"
  stop_gpu_tallyd gpu-region-cli
}

# The Python binding's GpuRegion on the GPU: the benchmark, then the GPU examples of docs/.
step_gpu_region_py() {
  local dir=$OUT/gpu-region-py py=python3
  mkdir -p "$dir"
  export TALLY_LIBRARY=$PWD/$B/client/libtally.so
  # The host's own NumPy (and CuPy) first; Debian's, unpacked by device-env.sh, only without one
  # (it shadows the host's when both are on the path).
  export PYTHONPATH=$PWD/client/python
  if ! $py -c 'import numpy' 2>"$dir/numpy.err"; then
    export PYTHONPATH=$PYTHONPATH:/opt/deps/usr/lib/python3/dist-packages
    if ! $py -c 'import numpy' 2>>"$dir/numpy.err"; then
      note "gpu-region-py: no NumPy for $py ($($py --version 2>&1); $(grep -v '^$' "$dir/numpy.err" | tail -1)): skipped"
      return
    fi
  fi
  start_gpu_tallyd "$dir" 5704 || return
  timed gpu_region_py 240 $py bench/gpu_region_py.py tcp://127.0.0.1:5704 8 5 >"$dir/bench.log" 2>&1
  grep -E "gpu-region-py|Error|error" "$dir/bench.log" | head -12 | tee -a "$S"
  if $py -c 'import cupy' 2>/dev/null; then
    TALLY_ENDPOINT=tcp://127.0.0.1:5704 timed "docs GPU examples" 120 $py -c '
import pathlib, sys
for page in sorted(pathlib.Path("docs").glob("*.md")):
    lines = page.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "<!-- python: gpu -->" and lines[i + 1] == "```python":
            end = lines.index("```", i + 2)
            exec(compile("\n".join(lines[i + 2:end]), str(page), "exec"), {})
' >"$dir/readme.log" 2>&1
    tail -5 "$dir/readme.log" | tee -a "$S"
  else
    note "gpu-region-py: CuPy not installed: the CuPy examples of docs/ not run"
  fi
  stop_gpu_tallyd gpu-region-py
}

# A lost context, injected on the real GPU, is recreated and the GPU serves again.
step_recover() {
  local dir=$OUT/recover ep=tcp://127.0.0.1:5703 ref i before after
  mkdir -p "$dir"
  head -c 8M /dev/urandom >"$dir/in.bin"
  TALLYD_TEST_FAULT_STICKY=12 start_gpu_tallyd "$dir" 5703 || return
  (cd "$dir" && "$TALLY_BIN" -e $ep hist --in in.bin --chunk 1M --out ref.bin)
  for i in 1 2 3 4; do
    (cd "$dir" && "$TALLY_BIN" -e $ep hist --in in.bin --chunk 1M --out run$i.bin)
    cmp -s "$dir/ref.bin" "$dir/run$i.bin" && ref=identical || ref=DIFFERS
    note "recover: hist run $i: $ref"
  done
  sleep 2
  grep -E "unusable|context recreated|cannot recreate" "$dir/tallyd.log" | head -5 | tee -a "$S"
  before=$("$TALLY_BIN" -e $ep stats | grep -F 'tallyd_gpu_requests_total{device="0"}')
  (cd "$dir" && "$TALLY_BIN" -e $ep hist --in in.bin --chunk 1M --out after.bin &&
    "$TALLY_BIN" -e $ep hist --in in.bin --chunk 1M --gpu-region --out region.bin)
  after=$("$TALLY_BIN" -e $ep stats | grep -F 'tallyd_gpu_requests_total{device="0"}')
  cmp -s "$dir/ref.bin" "$dir/after.bin" && ref=identical || ref=DIFFERS
  note "recover: after the recreation: hist $ref; --gpu-region $(cmp -s "$dir/ref.bin" \
    "$dir/region.bin" && echo identical || echo DIFFERS); GPU 0 requests: $before -> $after"
  stop_gpu_tallyd recover
}

# The unit's [Service] settings on a transient unit, where systemd runs.
step_systemd() {
  systemd-analyze security --offline=true $B/systemd/tallyd.service 2>/dev/null | tail -1 | tee -a "$S"
  local state
  state=$(systemctl is-system-running 2>/dev/null)
  if [ "$state" != running ] && [ "$state" != degraded ]; then
    note "systemd is not running here: the unit's sandbox with the GPU cannot be checked"
    return
  fi
  local props=()
  while IFS= read -r line; do props+=(-p "$line"); done < <(
    sed -n '/^\[Service\]/,/^\[/p' $B/systemd/tallyd.service | grep -E '^[A-Za-z]+=' |
      grep -vE '^(Type|ExecStart|ExecReload|Restart|RestartSec|WatchdogSec|TimeoutStopSec|KillMode)=')
  systemd-run --unit tallyd-sandbox-check "${props[@]}" -p Type=notify "$TALLYD_BIN" \
    --backend cuda --bind tcp://127.0.0.1:5799 --shm off >>"$S" 2>&1
  sleep 5
  head -c 1048576 /dev/urandom >"$OUT/frame.raw"
  "$TALLY_BIN" -e tcp://127.0.0.1:5799 hist --type u8 --in "$OUT/frame.raw" | head -2 | tee -a "$S"
  "$TALLY_BIN" -e tcp://127.0.0.1:5799 info | grep -E "backend=" | tee -a "$S"
  journalctl -u tallyd-sandbox-check --no-pager 2>/dev/null |
    grep -iE "backend|EPERM|denied|error" | head -10 | tee -a "$S"
  systemctl stop tallyd-sandbox-check 2>/dev/null
}

: >"$S"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv \
  >>"$S" 2>&1
date -u >>"$S"
# STEPS=shards alone needs four targets, not the whole tree (a minute less of the call's ten).
if [ "${STEPS// /}" = shards ] && [ -z "${BUILD_TARGETS:-}" ]; then
  BUILD_TARGETS="tallyd tally loadgen test_differential"
fi
if [ "${STEPS// /}" = nats-direct ] && [ -z "${BUILD_TARGETS:-}" ]; then
  BUILD_TARGETS="tallyd loadgen nats_bench"
fi
build
for step in $STEPS; do
  case $step in
  ctest | suites | diff | region | kernels | sweep | variants | profile | info | systemd | soak | shards)
    "step_$step" ;;
  soak-collect) step_soak_collect ;;
  asan-stop) step_asan_stop ;;
  kernel-test) step_kernel_test ;;
  gpu-region-cli) step_gpu_region_cli ;;
  gpu-region-py) step_gpu_region_py ;;
  recover) step_recover ;;
  region-tune) step_region_tune ;;
  lane-bench) step_lane_bench ;;
  peer) step_peer ;;
  daemon-memcheck) step_daemon_memcheck ;;
  nats-fleet) step_nats_fleet ;;
  nats-direct) step_nats_direct ;;
  memcheck | racecheck) step_sanitizer "$step" ;;
  path | loadgen | curve | recv-ab | io-threads | malloc-ab) step_bench "$step" ;;
  *) note "unknown step: $step" ;;
  esac
done
echo "==== summary"
cat "$S"
