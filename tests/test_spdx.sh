#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_spdx.sh SOURCE_DIR: every source file git tracks (C, CUDA, headers and their templates,
# Python, shell, CMake, the web page's files) names its license, Apache-2.0 (LICENSE), with an
# SPDX line among its first three lines. Skipped (77) outside a git checkout (the GPU host's copy).
set -eu
src=$1
cd "$src"
git rev-parse --is-inside-work-tree >/dev/null 2>&1 || { echo "not a git checkout: skipped"; exit 77; }
missing=$(git ls-files |
    grep -E '\.(c|h|cu|cuh|py|sh|cmake|js|css|html|bash)$|\.h\.in$|CMakeLists\.txt$|^\.ci/run$' |
    grep -v '^tests/fuzz/corpus\|^tests/data/' |
    while read -r f; do
        [ -f "$f" ] || continue # listed by an index older than the tree (a copied checkout)
        head -n 3 "$f" | grep -q 'SPDX-License-Identifier: Apache-2.0' || echo "$f"
    done)
if [ -n "$missing" ]; then
    echo "FAIL: no 'SPDX-License-Identifier: Apache-2.0' in the first three lines of:" >&2
    echo "$missing" >&2
    exit 1
fi
echo "every tracked source file names Apache-2.0"
