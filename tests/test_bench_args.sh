#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_bench_args.sh LOADGEN FANIN: the benchmark programs read --size with the parser tally and
# tallyd use (tally_size_parse): 1M is 1 MiB (strtoull read it as 1 byte) and 1Q is refused,
# naming the suffix (strtoull read 1). The 1 MiB is seen end to end: loadgen sends four 1 MiB
# requests to its own echo server and its row says "1 MiB" and 4 of 4 answered.
set -u
loadgen=$1
fanin=$2
dir=$(mktemp -d "${TMPDIR:-/tmp}/tally-bench-args.XXXXXX")
echo_pid=
cleanup() {
    [ -n "$echo_pid" ] && kill "$echo_pid" 2>/dev/null && wait "$echo_pid" 2>/dev/null
    rm -rf "$dir"
}
trap cleanup EXIT
fail() {
    echo "FAIL: $*" >&2
    exit 1
}

for prog in "$loadgen" "$fanin"; do
    name=$(basename "$prog")
    "$prog" --endpoint "ipc://$dir/none.sock" --size 1Q >"$dir/out" 2>"$dir/err"
    rc=$?
    [ $rc -eq 2 ] || fail "$name --size 1Q exited $rc, not 2"
    grep -qF "$name: invalid size '1Q' for --size: unknown suffix 'Q' (use K, M or G)" "$dir/err" ||
        { cat "$dir/err" >&2; fail "$name --size 1Q does not say why"; }
done
echo "--size 1Q refused by both"

"$loadgen" --serve-echo "ipc://$dir/echo.sock" >"$dir/echo.log" 2>&1 &
echo_pid=$!
i=0
while [ ! -S "$dir/echo.sock" ]; do # the echo server binds its socket: then it serves
    i=$((i + 1))
    [ $i -le 200 ] || fail "the echo server did not bind in 20 s"
    sleep 0.1
done
"$loadgen" --endpoint "ipc://$dir/echo.sock" --op echo --size 1M --count 4 --window 1 \
    >"$dir/row" 2>"$dir/err" || { cat "$dir/err" >&2; fail "loadgen --size 1M failed"; }
grep -q '^| run | echo | 1 MiB | 1 x 1 |.*| 4/4 |' "$dir/row" ||
    { cat "$dir/row" >&2; fail "loadgen --size 1M did not send 1 MiB requests"; }
echo "--size 1M: $(cat "$dir/row")"
