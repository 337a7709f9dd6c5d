#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The Python binding (client/python) against real tallyds: installs it with pip into a scratch
# virtual environment (offline, --no-build-isolation: what `pip install ./client/python` does
# on a host without network), then runs tests/test_python.py with pytest, which starts its
# tallyd ($TALLYD) on ipc:// sockets, compares with the CLI ($TALLY_CLI) and runs the Python
# examples of docs/c-and-python.md ($TALLY_README). Uses the first of
# $PYTHON, python3 and /usr/bin/python3 that has NumPy, pytest and venv; skipped (77) when none
# has (scripts/install-deps.sh installs them).
# usage: test_python.sh TALLYD TALLY_CLI LIBTALLY SOURCE_DIR
set -eu
tallyd=$1
cli=$2
libtally=$3
src=$4
if [ -n "${TALLY_PYTHON_SKIP:-}" ]; then
    echo "skipping: $TALLY_PYTHON_SKIP build"
    exit 77
fi
py=""
for cand in "${PYTHON:-}" python3 /usr/bin/python3; do
    [ -n "$cand" ] || continue
    if "$cand" -c 'import numpy, pytest, venv' >/dev/null 2>&1; then py=$cand; break; fi
done
if [ -z "$py" ]; then
    echo "no python3 with numpy, pytest and venv (apt-get install python3-numpy python3-pytest"
    echo "python3-venv): skipping"
    exit 77
fi
dir=$(mktemp -d "${TMPDIR:-/tmp}/tally-python.XXXXXX")
trap 'rm -rf "$dir"' EXIT
# The venv sees the system's numpy, pytest and setuptools. Installed from a copy, so that the
# build's leftovers (build/, *.egg-info) stay out of the source tree.
"$py" -m venv --system-site-packages "$dir/venv"
if ! "$dir/venv/bin/python" -c 'import numpy, pytest' >/dev/null 2>&1; then
    echo "$py's numpy or pytest is not visible inside a venv (a user or non-system site): skipping"
    exit 77
fi
cp -r "$src/client/python" "$dir/package"
"$dir/venv/bin/python" -m pip install -q --no-build-isolation --no-index --no-deps "$dir/package" \
    >"$dir/pip.log" 2>&1 || { cat "$dir/pip.log"; exit 1; }
cd "$dir" # not the source tree: the installed package is the one imported
# Keys and settings of the user running the tests stay out (the binding reads them as the CLI
# does: $TALLY_SERVER_KEY, ~/.config/tally/tally.conf).
mkdir "$dir/config"
env -u TALLY_SERVER_KEY -u TALLY_CLIENT_KEY -u TALLY_ENDPOINT XDG_CONFIG_HOME="$dir/config" \
    TMPDIR="$dir" TALLYD="$tallyd" TALLY_CLI="$cli" TALLY_LIBRARY="$libtally" \
    TALLY_README="$src/docs/c-and-python.md" \
    "$dir/venv/bin/python" -m pytest -v -p no:cacheprovider --rootdir "$dir" \
    "$src/tests/test_python.py"
