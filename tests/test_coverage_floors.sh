#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_coverage_floors.sh SOURCE_DIR: the coverage floors (tests/coverage-floors.txt, checked by
# scripts/coverage.sh) only go up. The file as it is now (working tree) against its last
# committed version, or, when it is unchanged since, that version against the one before it
# (the commit that last changed it): no floor lowered, no folder dropped. Skipped (77) outside a
# git checkout.
set -eu
src=$1
cd "$src"
git rev-parse --is-inside-work-tree >/dev/null 2>&1 || { echo "not a git checkout: skipped"; exit 77; }
f=tests/coverage-floors.txt
dir=$(mktemp -d "${TMPDIR:-/tmp}/tally-floors.XXXXXX")
trap 'rm -rf "$dir"' EXIT
python3 scripts/coverage-table.py --check-history "$f" "$f" >/dev/null # the file parses
if ! git diff --quiet HEAD -- "$f" 2>/dev/null && git cat-file -e "HEAD:$f" 2>/dev/null; then
    git show "HEAD:$f" >"$dir/old"
    new=$f
    what="the working tree against HEAD"
else
    last=$(git log -1 --format=%H -- "$f")
    [ -n "$last" ] || { echo "$f is not committed yet: nothing to compare"; exit 0; }
    git cat-file -e "$last^:$f" 2>/dev/null || { echo "$f is new in $last: nothing to compare"; exit 0; }
    git show "$last^:$f" >"$dir/old"
    git show "$last:$f" >"$dir/new"
    new=$dir/new
    what="commit $(git rev-parse --short "$last") against its parent"
fi
if ! python3 scripts/coverage-table.py --check-history "$new" "$dir/old"; then
    echo "FAIL: $f, $what: the floors only go up (scripts/coverage.sh --raise raises them)" >&2
    exit 1
fi
echo "coverage floors, $what: none lowered"
