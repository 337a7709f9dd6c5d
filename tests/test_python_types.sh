#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_python_types.sh SOURCE_DIR: the Python binding's type hints hold (mypy --strict over the
# package, and over tests/test_python.py, which uses the binding as a caller would), so the
# py.typed marker promises nothing false. Skipped (77) without mypy (Debian: python3-mypy).
set -eu
src=$1
py=""
for cand in "${PYTHON:-}" python3 /usr/bin/python3; do
    [ -n "$cand" ] || continue
    if "$cand" -c 'import mypy, numpy, pytest' >/dev/null 2>&1; then py=$cand; break; fi
done
if [ -z "$py" ]; then
    echo "no python3 with mypy, numpy and pytest (apt-get install python3-mypy): skipping"
    exit 77
fi
dir=$(mktemp -d "${TMPDIR:-/tmp}/tally-mypy.XXXXXX")
trap 'rm -rf "$dir"' EXIT
cd "$src"
MYPYPATH="$src/client/python" "$py" -m mypy --strict --cache-dir "$dir" \
    client/python/tally tests/test_python.py
