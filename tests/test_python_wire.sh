#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_python_wire.sh GEN_WIRE SOURCE_DIR: client/python/tally/_wire.py, the Python binding's
# copy of the C headers' constants and struct layouts, is what gen_wire prints from the headers
# now (client/python/gen_wire.c), so a change on the C side cannot leave Python silently wrong.
# The file is committed because pip installs ./client/python without running CMake.
set -eu
gen=$1
src=$2
committed=$src/client/python/tally/_wire.py
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

"$gen" >"$dir/_wire.py"
if ! diff -u "$committed" "$dir/_wire.py" >&2; then
    echo "FAIL: $committed differs from what gen_wire prints (+ is the headers'); regenerate it:" >&2
    echo "  $gen > $committed" >&2
    exit 1
fi
echo "_wire.py: as generated ($(grep -c '^    "tally_[a-z_]*_t": (' "$committed") struct layouts)"
