#!/bin/sh
# The Python binding (client/python) against a real tallyd: installs it with pip into a
# scratch virtual environment, then runs tests/test_python.py. Uses the first of $PYTHON,
# python3 and /usr/bin/python3 that has NumPy; skipped (77) when none has.
# usage: test_python.sh TALLYD LIBTALLY SOURCE_DIR
set -eu
tallyd=$1
libtally=$2
src=$3
if [ -n "${TALLY_PYTHON_SKIP:-}" ]; then
    echo "skipping: $TALLY_PYTHON_SKIP build"
    exit 77
fi
py=""
for cand in "${PYTHON:-}" python3 /usr/bin/python3; do
    [ -n "$cand" ] || continue
    if "$cand" -c 'import numpy, venv' >/dev/null 2>&1; then py=$cand; break; fi
done
if [ -z "$py" ]; then
    echo "no python3 with numpy and venv (apt-get install python3-numpy python3-venv): skipping"
    exit 77
fi
dir=$(mktemp -d "${TMPDIR:-/tmp}/tally-python.XXXXXX")
pid=""
cleanup() {
    [ -z "$pid" ] || kill "$pid" 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT
# `pip install ./client/python`, offline: the venv sees the system's numpy and setuptools. From
# a copy, so that the build's leftovers (build/, *.egg-info) stay out of the source tree.
"$py" -m venv --system-site-packages "$dir/venv"
if ! "$dir/venv/bin/python" -c 'import numpy' >/dev/null 2>&1; then
    echo "$py's numpy is not visible inside a venv (a user or non-system site): skipping"
    exit 77
fi
cp -r "$src/client/python" "$dir/package"
"$dir/venv/bin/python" -m pip install -q --no-build-isolation --no-index --no-deps "$dir/package" \
    >"$dir/pip.log" 2>&1 || { cat "$dir/pip.log"; exit 1; }
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$tallyd" --bind "tcp://127.0.0.1:$port" --backend cpu --shm-socket "$dir/shm.sock" \
    >"$dir/tallyd.log" 2>&1 &
pid=$!
cd "$dir" # not the source tree: the installed package is the one imported
TALLY_LIBRARY=$libtally TALLY_ENDPOINT="tcp://127.0.0.1:$port" \
    "$dir/venv/bin/python" "$src/tests/test_python.py" -v
