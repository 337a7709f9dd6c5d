#!/bin/sh
# test_readme.sh README CC INCLUDE_DIRS... -- LIBTALLY: compiles and links the README's C
# shared-memory producer (the ```c block after the "shm-producer" marker) against libtally, so
# the example cannot drift from the API.
set -eu
readme=$1
cc=$2
shift 2
incs=""
while [ "$1" != "--" ]; do
    incs="$incs -I$1"
    shift
done
lib=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
awk '/shm-producer/ {found = 1; next} found && /^```c/ {inside = 1; next}
     inside && /^```/ {exit} inside {print}' "$readme" > "$dir/producer.c"
if [ ! -s "$dir/producer.c" ]; then
    echo "no shm-producer C block in $readme" >&2
    exit 1
fi
# shellcheck disable=SC2086
"$cc" -std=c11 -Wall -Wextra -Werror $incs "$dir/producer.c" "$lib" -o "$dir/producer"
echo "README producer snippet compiles and links ($(wc -l < "$dir/producer.c") lines)"
