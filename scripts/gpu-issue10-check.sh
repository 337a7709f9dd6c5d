#!/usr/bin/env bash
# Issue 10 on the GPU host in one call: CUDA build, every CTest test but the long kernel test,
# the integration suites with tallyd --backend cuda, and the CPU-vs-GPU differential test
# (fixed and random seed). run (carry: [".deps"]): bash scripts/gpu-issue10-check.sh
OUT=${OUT:-/tmp/gpu-issue10}; mkdir -p "$OUT"
source scripts/device-env.sh; set -o pipefail; B=build-gpu; S=$OUT/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv > $S; date -u >> $S
t0=$SECONDS; cmake -S . -B $B -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_ARCHITECTURES=90 -DTALLY_CUDA=ON -DTALLY_WERROR=ON -DTALLY_FUZZ=OFF > $OUT/build.log 2>&1 && cmake --build $B -j16 >> $OUT/build.log 2>&1; echo "build rc=$? $((SECONDS-t0))s" >> $S
export LD_LIBRARY_PATH=$PWD/$B/client:$LD_LIBRARY_PATH TALLYD_BIN=$PWD/$B/daemon/tallyd TALLY_BIN=$PWD/$B/client/tally
t0=$SECONDS; (cd $B && timeout 300 ctest -j6 -E 'test_cuda_backend|test_differential_gpu' --output-on-failure > $OUT/ctest.log 2>&1); echo "ctest rc=$? $((SECONDS-t0))s" >> $S; grep -E "tests passed|Failed|\*\*\*" $OUT/ctest.log >> $S
for t in test_daemon test_client_daemon test_lifecycle test_seq; do t0=$SECONDS; TALLY_TEST_BACKEND=cuda timeout 120 $B/tests/$t > $OUT/$t-cuda.log 2>&1; echo "$t cuda rc=$? $((SECONDS-t0))s" >> $S; grep -E "FAILED|ERROR" $OUT/$t-cuda.log | head -5 >> $S; done
for seed in fixed random; do t0=$SECONDS; TALLY_PIPELINE_ENGINE=cuda TALLY_DIFF_SCALE=4 timeout 150 $B/tests/test_differential > $OUT/diff-$seed.log 2>&1; echo "differential cuda run $seed rc=$? $((SECONDS-t0))s" >> $S; grep -E "seed|FAILED|ERROR|PASSED" $OUT/diff-$seed.log | head -8 >> $S; done
cat $S
