#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# scripts/mutants.sh — mutation testing (issue 37): each mutant of tests/mutants.txt (a one-line
# change to code that computes or enforces something, and the tests that must catch it) is put,
# one at a time, into a scratch copy of the checkout (never the checkout itself), rebuilt
# incrementally, and its tests run; a mutant the tests pass with has survived, and fails the run.
#
#   scripts/mutants.sh [--sample N [--seed S]] [--only NAME]... [--scratch DIR] [--keep]
#                      [--jobs J] [--no-baseline]
#
#   --sample N    N mutants picked by the seed (a rotating subset; default: every mutant)
#   --seed S      the seed (default: HEAD's commit, so each commit runs its own subset)
#   --only NAME   that mutant (repeatable)
#   --scratch DIR the scratch copy and its build (default: a new folder in $TMPDIR, removed at
#                 the end unless --keep); given again, only the files that changed are copied
#                 and the build is incremental
#   --jobs J      ctest -j (default: the number of cores)
#   --no-baseline skip the run of the chosen mutants' tests without any mutant
# First the list is checked: every `find` must still match exactly one line of its file (a
# mutant whose line was edited fails the run, loudly: edit the list with the code), and every
# `kill` regex must name a test. Then the chosen mutants' tests run once unmutated (they must
# pass, or a failure would count as a kill); then one line per mutant: killed, SURVIVED, or
# DID NOT BUILD (a broken entry: fails the run too). Exits 1 on any survivor or broken entry.
# How to add a mutant: docs/testing.md, "Adding a mutant".
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD LIST=$PWD/tests/mutants.txt SAMPLE=0 SEED="" ONLY=() SCRATCH="" KEEP=0 BASELINE=1
JOBS=$(nproc)
while [ $# -gt 0 ]; do
  case "$1" in
  --sample) SAMPLE=$2; shift ;;
  --seed) SEED=$2; shift ;;
  --only) ONLY+=("$2"); shift ;;
  --scratch) SCRATCH=$2; KEEP=1; shift ;;
  --keep) KEEP=1 ;;
  --jobs) JOBS=$2; shift ;;
  --no-baseline) BASELINE=0 ;;
  *) sed -n '2,/^set /p' "$0" | sed '$d'; exit 2 ;;
  esac
  shift
done
M="python3 $ROOT/scripts/mutants.py"
start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }

echo "== the list: every line found exactly once"
$M check "$LIST" "$ROOT" || { echo "mutants: the list does not match the code (above)"; exit 1; }

# ---- The scratch copy: the checkout's tracked files as they are now (edits included) ---------
[ -n "$SCRATCH" ] || SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/tally-mutants.XXXXXX")
mkdir -p "$SCRATCH/src"
SCRATCH=$(cd "$SCRATCH" && pwd)
SRC=$SCRATCH/src BLD=$SCRATCH/build
cleanup() {
  # A mutated file goes back even when the run is interrupted.
  [ -z "${saved:-}" ] || cp "$saved" "$SRC/$mfile"
  [ "$KEEP" = 1 ] || rm -rf "$SCRATCH"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  files() { git ls-files -z --cached --others --exclude-standard; }
else
  files() { find . -path ./build\* -prune -o -type f -print0; }
fi
copied=0
while IFS= read -r -d '' f; do
  [ -f "$f" ] || continue
  if ! cmp -s "$f" "$SRC/$f"; then
    # a new mtime, so the build sees the change whatever the checkout's mtime says
    mkdir -p "$SRC/$(dirname "$f")" && cp "$f" "$SRC/$f" && copied=$((copied + 1))
  fi
done < <(files)
echo "== scratch copy $SCRATCH ($copied files copied)"
[ -n "$SEED" ] || SEED=$(git rev-parse HEAD 2>/dev/null || echo none)

echo "== build (incremental after the first)"
# Debug (-O0): a mutant's file and the relinks build in seconds, and the tests that kill are
# small. No libFuzzer target: clang would rebuild it for every proto/ mutant (and its custom
# target and output share a name, which Ninja refuses). The allocation-failure hooks are in
# (inert unless a test sets TALLYD_ALLOC_FAIL_AT), so that a mutant of an out-of-memory branch
# is killed by the test that fails that allocation (test_nats_worker's
# test_no_memory_answers_busy).
cmake -S "$SRC" -B "$BLD" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DTALLY_CUDA=OFF -DTALLY_FUZZ=OFF \
  -DTALLY_ALLOC_FAULTS=ON \
  >"$SCRATCH/configure.log" 2>&1 || { cat "$SCRATCH/configure.log"; exit 1; }
cmake --build "$BLD" -j"$JOBS" >"$SCRATCH/build.log" 2>&1 || { tail -40 "$SCRATCH/build.log"; exit 1; }
$M check "$LIST" "$SRC" "$BLD" >"$SCRATCH/check.log" || { cat "$SCRATCH/check.log"; exit 1; }

if [ ${#ONLY[@]} -gt 0 ]; then
  names=("${ONLY[@]}")
else
  mapfile -t names < <($M select "$LIST" "$SEED" "$SAMPLE")
fi
total=$($M select "$LIST" x 0 | wc -l)
echo "== ${#names[@]} of $total mutants (seed $SEED), built in $(elapsed) s"

if [ "$BASELINE" = 1 ]; then
  # The tests by name, in one group: CMake's regular expressions take at most nine groups (a
  # union of the kill regexes found no test, and so passed, once ten mutants were chosen).
  tests=$(for n in "${names[@]}"; do (cd "$BLD" && ctest -N -R "$($M show "$LIST" "$n" kill)"); done |
    sed -n 's/^ *Test *#[0-9]*: *//p' | sort -u | paste -sd'|')
  echo "== their tests without a mutant: $tests"
  (cd "$BLD" && ctest -R "^($tests)\$" --no-tests=error -j"$JOBS" --output-on-failure) \
    >"$SCRATCH/baseline.log" 2>&1 || {
    grep -E "Failed|\*\*\*" "$SCRATCH/baseline.log" | head -20
    echo "mutants: the tests fail without any mutant ($SCRATCH/baseline.log): fix that first"
    KEEP=1
    exit 1
  }
fi

survived=() broken=()
for n in "${names[@]}"; do
  t0=$(date +%s)
  mfile=$($M show "$LIST" "$n" file)
  kill_re=$($M show "$LIST" "$n" kill)
  saved=$SCRATCH/saved.orig
  cp -p "$SRC/$mfile" "$saved"
  line=$($M apply "$LIST" "$n" "$SRC")
  if ! cmake --build "$BLD" -j"$JOBS" >"$SCRATCH/$n.build.log" 2>&1; then
    result="DID NOT BUILD ($SCRATCH/$n.build.log)"
    broken+=("$n")
    KEEP=1
  elif (cd "$BLD" && ctest -R "$kill_re" -j"$JOBS" --stop-on-failure) >"$SCRATCH/$n.log" 2>&1; then
    result="SURVIVED ($kill_re passed; $SCRATCH/$n.log)"
    survived+=("$n")
    KEEP=1
  else
    by=$(sed -n 's/^.*Test *#[0-9]*: \([^ ]*\) .*\(Failed\|Timeout\|Exception\|Subprocess aborted\|SEGFAULT\|Child aborted\).*$/\1/p' "$SCRATCH/$n.log" | head -1)
    result="killed${by:+ by $by}"
  fi
  cp "$saved" "$SRC/$mfile" # a new mtime: rebuilt with the next mutant
  saved=""
  printf '%-28s %4d s  %s\n      %s\n' "$n" $(($(date +%s) - t0)) "$result" "$line"
done

echo "== ${#names[@]} mutants in $(elapsed) s: $((${#names[@]} - ${#survived[@]} - ${#broken[@]})) killed," \
  "${#survived[@]} survived, ${#broken[@]} did not build"
[ ${#survived[@]} -eq 0 ] || echo "survivors: ${survived[*]} (a test should fail with each: add it)"
[ ${#broken[@]} -eq 0 ] || echo "broken entries: ${broken[*]} (tests/mutants.txt)"
[ ${#survived[@]} -eq 0 ] && [ ${#broken[@]} -eq 0 ]
