#!/usr/bin/env bash
# Issue 9 on the GPU host in one call: CUDA build, CTest with the GPU present (test_shm_gpu
# included; the long kernel test and the differential test left to their own scripts), then
# bench/run-shm.sh. run (carry: [".deps"]): bash scripts/gpu-shm-check.sh
OUT=${OUT:-/tmp/gpu-shm}; mkdir -p "$OUT"
source scripts/device-env.sh; set -o pipefail; B=build-gpu; S=$OUT/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $S; date -u >> $S
t0=$SECONDS; cmake -S . -B $B -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_ARCHITECTURES=90 -DTALLY_CUDA=ON -DTALLY_WERROR=ON -DTALLY_FUZZ=OFF > $OUT/build.log 2>&1 && cmake --build $B -j16 >> $OUT/build.log 2>&1; echo "build rc=$? $((SECONDS-t0))s" >> $S
export LD_LIBRARY_PATH=$PWD/$B/client:$LD_LIBRARY_PATH TALLYD_BIN=$PWD/$B/daemon/tallyd TALLY_BIN=$PWD/$B/client/tally
t0=$SECONDS; (cd $B && timeout 300 ctest -j6 -E 'test_cuda_backend|test_differential' --output-on-failure > $OUT/ctest.log 2>&1); echo "ctest rc=$? $((SECONDS-t0))s" >> $S; grep -E "tests passed|Failed|\*\*\*" $OUT/ctest.log >> $S
t0=$SECONDS; SECONDS_PER_RUN=1.5 timeout 400 bench/run-shm.sh $B $OUT > /dev/null 2>&1; echo "bench rc=$? $((SECONDS-t0))s" >> $S
cat $S $OUT/shm.md
