# Sourced by the GPU-host check scripts (scripts/gpu-*-check.sh): unpacks the carried packages,
# builds everything with CUDA (sm_90) into $B, records the device in $S, and runs CTest with the
# GPU present, leaving out the tests matching $CTEST_EXCLUDE (those get their own steps); with
# $CTEST_INCLUDE set, only the tests matching it.
# Expects OUT to be set; sets B, S and the variables the integration tests read.
mkdir -p "$OUT"
source scripts/device-env.sh
set -o pipefail
B=build-gpu
S=$OUT/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv >$S
date -u >>$S
t0=$SECONDS
cmake -S . -B $B -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_ARCHITECTURES=90 -DTALLY_CUDA=ON \
  -DTALLY_WERROR=ON -DTALLY_FUZZ=OFF >$OUT/build.log 2>&1 && cmake --build $B -j16 >>$OUT/build.log 2>&1
echo "build rc=$? $((SECONDS - t0))s" >>$S
export LD_LIBRARY_PATH=$PWD/$B/client:$LD_LIBRARY_PATH TALLYD_BIN=$PWD/$B/daemon/tallyd
export TALLY_BIN=$PWD/$B/cli/tally
t0=$SECONDS
(cd $B && timeout 300 ctest -j6 ${CTEST_INCLUDE:+-R "$CTEST_INCLUDE"} -E "$CTEST_EXCLUDE" --output-on-failure >$OUT/ctest.log 2>&1)
echo "ctest rc=$? $((SECONDS - t0))s" >>$S
grep -E "tests passed|Failed|\*\*\*" $OUT/ctest.log >>$S
