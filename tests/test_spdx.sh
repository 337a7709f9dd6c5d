#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_spdx.sh SOURCE_DIR: every source file git tracks (C, CUDA, headers and their templates,
# Python, shell, CMake, the web page's files) names its license, Apache-2.0 (LICENSE), with an
# SPDX line among its first three lines. Skipped (77) outside a git checkout (the GPU host's copy).
set -eu
src=$1
cd "$src"
git rev-parse --is-inside-work-tree >/dev/null 2>&1 || { echo "not a git checkout: skipped"; exit 77; }
# The first three lines of every file read by one awk (two processes per file took 25 s on a
# loaded 2-core box); an empty file, which awk never sees, has no SPDX line either.
list=$(mktemp)
trap 'rm -f "$list"' EXIT
missing=$(git ls-files |
    grep -E '\.(c|h|cu|cuh|py|sh|cmake|js|css|html|bash)$|\.h\.in$|CMakeLists\.txt$|^\.ci/run$' |
    grep -v '^tests/fuzz/corpus\|^tests/data/' |
    while read -r f; do
        [ -f "$f" ] || continue # listed by an index older than the tree (a copied checkout)
        if [ -s "$f" ]; then printf '%s\0' "$f" >>"$list"; else echo "$f"; fi
    done
    xargs -0 -r awk '
        FNR == 1 { if (NR > 1 && !found) print name; name = FILENAME; found = 0 }
        FNR <= 3 && /SPDX-License-Identifier: Apache-2\.0/ { found = 1 }
        END { if (NR > 0 && !found) print name }' <"$list")
if [ -n "$missing" ]; then
    echo "FAIL: no 'SPDX-License-Identifier: Apache-2.0' in the first three lines of:" >&2
    echo "$missing" >&2
    exit 1
fi
echo "every tracked source file names Apache-2.0"
