#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what is missing, then builds and runs every test twice: a normal build with
# warnings as errors (CUDA backend included when nvcc is present; GPU tests report "skipped"
# without a GPU), then 20 s of libFuzzer on proto/'s decoders (when clang can build it), and a
# build with AddressSanitizer + UndefinedBehaviorSanitizer. That build also has the allocation-
# failure hooks (-DTALLY_ALLOC_FAULTS=ON: inert unless TALLYD_ALLOC_FAIL_AT is set), so its CTest
# run includes test_alloc_sweep, the bounded allocation-failure sweep (about 200 runs over the
# whole range, none started after 200 s; scripts/alloc-sweep.sh runs every N). The first run's
# tallyd has one shard (TALLYD_TEST_SHARDS=1), the sanitizer run's four (TALLYD_TEST_SHARDS=4,
# issue 31: every integration test passes on both, the sweep runs a 4-shard daemon); a test that
# sets --shards itself keeps its own. Last, the Debian packages are built, installed, upgraded,
# used and purged (scripts/package-test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
jobs=$(nproc)

echo "== build and test (warnings as errors)"
cmake -S . -B build-test -DTALLY_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build-test -j"$jobs"
(cd build-test && TALLYD_TEST_SHARDS=1 ctest --output-on-failure -j"$jobs")

# The libFuzzer target is built when clang can link it (install-deps.sh installs clang); a
# crash or a violated property in these 20 s fails the run.
if [ -x build-test/tests/fuzz/fuzz_proto ]; then
  echo "== fuzz proto/ decoders (20 s; scripts/fuzz.sh runs longer)"
  scripts/fuzz.sh -t 20 -B build-test
else
  echo "== fuzz: skipped (no clang with libFuzzer; see scripts/install-deps.sh)"
fi

echo "== build and test with AddressSanitizer and UndefinedBehaviorSanitizer"
cmake -S . -B build-asan -DTALLY_WERROR=ON -DTALLY_SANITIZE=ON -DTALLY_ALLOC_FAULTS=ON \
  -DTALLY_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug
cmake --build build-asan -j"$jobs"
(cd build-asan && TALLYD_TEST_SHARDS=4 ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ctest --output-on-failure -j"$jobs")

# Coverage and mutants (docs/testing.md, "Coverage and mutants"): a gcc --coverage build runs
# the suite and the whole allocation sweep and fails under the floors of
# tests/coverage-floors.txt; TALLY_MUTANTS (10) mutants of tests/mutants.txt, another subset for
# each commit, must all be killed (the whole list: .ci/weekly). About 11 minutes on CI's machine.
echo "== coverage: the suite in a gcc --coverage build, against tests/coverage-floors.txt"
scripts/coverage.sh -B build-cov
echo "== mutants: ${TALLY_MUTANTS:-10} of tests/mutants.txt, chosen by the commit"
scripts/mutants.sh --sample "${TALLY_MUTANTS:-10}" --scratch build-mutants

# The Debian packages (issue 35): built, linted, installed over the previous version's, used,
# removed and purged on this machine (scripts/package-test.sh; about 3 minutes). Last, on its
# own: it installs system packages, which nothing else here may be running beside. Skipped
# (77) without root, or where systemd runs.
echo "== Debian packages: build, lintian, upgrade, use, purge"
rc=0
scripts/package-test.sh || rc=$?
[ $rc -eq 0 ] || [ $rc -eq 77 ] || exit $rc
