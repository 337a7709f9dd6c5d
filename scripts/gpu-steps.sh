# Sourced by the GPU-host check scripts (scripts/gpu-*-check.sh): the summary they keep and the
# steps several of them run, written once.
#
# gpu_summary FILE [QUERY]: starts the summary FILE with the device (nvidia-smi's QUERY fields,
# default name,driver_version,memory.total) and the date; note TEXT... prints TEXT and appends it.
gpu_summary() {
  summary=$1
  : >"$summary"
  nvidia-smi --query-gpu="${2:-name,driver_version,memory.total}" --format=csv >>"$summary" 2>&1
  date -u >>"$summary"
}
note() { echo "$*" | tee -a "$summary"; }

# gpu_differential BUILD SCALE SECONDS LOG: the CPU-vs-GPU differential test (issue 10) at SCALE,
# at most SECONDS; its seeds (rerun with TALLY_TEST_SEED=N) and verdict go into the summary.
gpu_differential() {
  local b=$1 scale=$2 limit=$3 log=$4 t0=$SECONDS
  TALLY_PIPELINE_ENGINE=cuda TALLY_DIFF_SCALE=$scale timeout "$limit" "$b/tests/test_differential" \
    >"$log" 2>&1
  note "test_differential (cuda, scale $scale): rc=$? ($((SECONDS - t0)) s)"
  grep -E "seed|every reply|snapshot:|PASSED|FAILED|ERROR|LINE" "$log" | head -16 |
    tee -a "$summary"
}
