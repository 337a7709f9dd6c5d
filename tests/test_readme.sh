#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_readme.sh SOURCE_DIR CC LIBTALLY INCLUDE_DIR...: compiles and links every C block of the
# README and of the pages of docs/ that follows a "<!-- compiled: NAME -->" marker against
# libtally, with only the public headers' folders on the include path (tally.h, tally_wire.h,
# tally_version.h: not proto/), so the examples cannot drift from the API or lean on private
# headers; and checks that no code block carries "$ " prompts. The pages' shell examples are
# run, and their output compared with the pages', by test_docs.c (it needs a tallyd: the
# harness's).
set -eu
readme="$1/README.md $1/docs/*.md"
cc=$2
lib=$3
shift 3
incs=""
for d in "$@"; do
    incs="$incs -I$d"
done
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
awk -v dir="$dir" '
    /<!-- compiled: / { name = $3; next }
    name != "" && /^```c/ { out = dir "/" name ".c"; inside = 1; next }
    inside && /^```/ { inside = 0; name = ""; next }
    inside { print > out }' $readme
# Command lines must paste as they are: no "$ " prompts inside code blocks.
prompts=$(awk '/^```/ { inside = !inside; next } inside && /^\$ / { print FILENAME ":" FNR ": " $0 }' \
    $readme)
if [ -n "$prompts" ]; then
    echo "prompts in the code blocks of the README or docs/ (they break copy and paste):" >&2
    echo "$prompts" >&2
    exit 1
fi
count=0
for src in "$dir"/*.c; do
    [ -e "$src" ] || break
    # shellcheck disable=SC2086
    "$cc" -std=c11 -Wall -Wextra -Werror $incs "$src" "$lib" -o "${src%.c}"
    echo "example $(basename "$src" .c) compiles and links ($(wc -l <"$src") lines)"
    count=$((count + 1))
done
if [ "$count" -lt 2 ]; then
    echo "expected at least 2 compiled C examples in $readme, found $count" >&2
    exit 1
fi
