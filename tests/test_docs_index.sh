#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_docs_index.sh SOURCE_DIR PAGE...: every page of docs/ and the README is run by a docs test
# (PAGE...: the pages tests/CMakeLists.txt gives tally_docs_test), the README links every page,
# and every relative link of the documents finds its file and heading (scripts/check-docs.py).
# First on a small tree of its own, which must fail with exactly its planted faults.
set -eu
src=$1
shift
check=$src/scripts/check-docs.py
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
mkdir -p "$t/docs" "$t/proto"
printf '# T\n\n[a](docs/a.md), [b](docs/b.md#no-such-heading)\n' >"$t/README.md"
printf '# A\n\n## Two words\n\n[back](../README.md), [here](#two-words), [gone](../nope.md)\n' \
    >"$t/docs/a.md"
printf '# B\n' >"$t/docs/b.md"
printf '# C\n\n```sh\n[not a link](nowhere.md)\n```\n' >"$t/docs/c.md"
printf '# P\n' >"$t/proto/PROTOCOL.md"
printf '# C\n' >"$t/CONTRIBUTING.md"
if python3 "$check" "$t" README.md docs/a.md docs/c.md >"$t/out" 2>&1; then
    echo "FAIL: check-docs.py passed a tree with faults" >&2
    exit 1
fi
want="README.md:1: no link to docs/c.md
README.md:3: link to docs/b.md#no-such-heading: no heading with that anchor
docs/a.md:5: link to ../nope.md: no such file
docs/b.md:1: run by no docs test"
got=$(sed 's/: add it.*//' "$t/out" | LC_ALL=C sort)
if [ "$got" != "$want" ]; then
    printf 'FAIL: check-docs.py reported\n%s\ninstead of\n%s\n' "$got" "$want" >&2
    exit 1
fi
echo "check-docs.py reports exactly the planted faults"
python3 "$check" "$src" "$@"
