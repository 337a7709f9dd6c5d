#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_source_tree.sh SOURCE_DIR DOC: every file git tracks is described in DOC's "The source
# tree" (scripts/check-source-tree.py; DOC is the one place that names the document), and the
# check finds what is missing: on a small repository of its own it must report exactly the
# planted files (a new file, a file only its folder names, one whose stem is named outside
# backquotes, one a pattern of another folder would match) and none of those named rightly (by
# file name, by stem in backquotes, by a pattern of the whole path).
set -eu
src=$1
doc=$2
check=$src/scripts/check-source-tree.py
if ! git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
    echo "SKIP: $src is not a git checkout"
    exit 77
fi
python3 "$check" "$src" "$doc"

t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
mkdir -p "$t/lib" "$t/runs" "$t/other/runs" "$t/docs"
for f in lib/td_a.c lib/td_a.h lib/td_b.c lib/new.c lib/td_c.c runs/one.md other/runs/two.md \
    lib/x.c.in README.md; do
    printf 'x\n' >"$t/$f"
done
cat >"$t/docs/tree.md" <<'MD'
# A page

## The source tree

`lib/` holds `td_a` (its source and header) and td_b.c; td_c stands here unquoted.
Runs: `runs/*`. The top: `README.md` and `docs/tree.md`; `x.c.in`.

## After it

new.c is named, but in another section.
MD
git -C "$t" init -q && git -C "$t" add -A
if python3 "$check" "$t" "$t/docs/tree.md" >"$t/out" 2>"$t/err"; then
    echo "FAIL: the check passed a tree with files it does not describe" >&2
    exit 1
fi
got=$(sed -n "s/^[^:]*: '\([^']*\)'.*/\1/p" "$t/out" | LC_ALL=C sort | tr '\n' ' ')
want="lib/new.c lib/td_c.c other/runs/two.md "
if [ "$got" != "$want" ]; then
    echo "FAIL: reported: $got" >&2
    echo "      expected: $want" >&2
    cat "$t/out" "$t/err" >&2
    exit 1
fi
echo "the check reports exactly the planted files"
