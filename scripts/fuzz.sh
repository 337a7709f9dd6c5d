#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fuzzes proto/'s decoders with libFuzzer (the target is tests/fuzz/fuzz_proto.c).
#
#   scripts/fuzz.sh [-t SECONDS] [-B BUILD_DIR] [-j JOBS]
#
# -t  how long to fuzz (default 600 s; scripts/test.sh runs 20 s)
# -B  the build directory holding tests/fuzz/fuzz_proto (default build-fuzz, configured and built
#     here when the binary is missing, by the target fuzz_proto_libfuzzer; needs clang and
#     libFuzzer: scripts/install-deps.sh)
# -j  fuzzing processes (libFuzzer -fork=JOBS; default 1)
#
# The checked-in seeds (tests/fuzz/corpus) are read, never written: what the fuzzer learns goes
# to BUILD_DIR/fuzz-corpus and survives between runs. A crash or a violated property stops the
# run with a non-zero exit and leaves the input in BUILD_DIR/fuzz-artifacts/; replay it with
#   BUILD_DIR/tests/fuzz/fuzz_proto FILE       (or fuzz_proto_replay FILE, under gdb)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=600
build=build-fuzz
jobs=1
while getopts "t:B:j:h" opt; do
  case $opt in
    t) seconds=$OPTARG ;;
    B) build=$OPTARG ;;
    j) jobs=$OPTARG ;;
    *) sed -n '2,16p' "$0"; exit 2 ;;
  esac
done

fuzzer=$build/tests/fuzz/fuzz_proto
if [ ! -x "$fuzzer" ]; then
  cmake -S . -B "$build" -DTALLY_FUZZ=ON -DTALLY_CUDA=OFF -DTALLY_WERROR=ON >/dev/null
  cmake --build "$build" --target fuzz_proto_libfuzzer
fi
# Rebuild if the sources changed since (a no-op otherwise).
cmake --build "$build" --target fuzz_proto_libfuzzer >/dev/null

mkdir -p "$build/fuzz-corpus" "$build/fuzz-artifacts"
args=(-max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048
      -print_final_stats=1 -artifact_prefix="$build/fuzz-artifacts/")
if [ "$jobs" -gt 1 ]; then args+=(-fork="$jobs"); fi
echo "fuzzing proto/ for ${seconds} s ($fuzzer)"
if ! "$fuzzer" "${args[@]}" "$build/fuzz-corpus" tests/fuzz/corpus >"$build/fuzz.log" 2>&1; then
  tail -n 60 "$build/fuzz.log"
  echo "fuzz_proto FAILED: the input is in $build/fuzz-artifacts/ (full log: $build/fuzz.log)" >&2
  exit 1
fi
grep -E "^(Done|stat::number_of_executed_units|stat::peak_rss_mb)" "$build/fuzz.log" || true
grep -E "cov: [0-9]+" "$build/fuzz.log" | tail -n 1 || true
