#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Socket activation through systemd's own tool: systemd-socket-activate listens on a loopback
# port and a unix socket, starts tallyd (same pid, LISTEN_FDS=2) on the first connection, and
# the tally CLI then gets answers on both. tallyd must stop cleanly (exit 0) on SIGTERM.
# Skipped (77) where systemd-socket-activate is absent.
# usage: test_socket_activate.sh TALLYD TALLY
set -u
tallyd=$1
tally=$2
if ! command -v systemd-socket-activate >/dev/null 2>&1; then
  echo "systemd-socket-activate not found: skipping"
  exit 77
fi
dir=$(mktemp -d "${TMPDIR:-/tmp}/tallyd-activate.XXXXXX")
pid=
cleanup() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; fi
  rm -rf "$dir"
}
trap cleanup EXIT
for attempt in 1 2 3 4 5; do
  port=$((20000 + $(od -An -N2 -tu2 /dev/urandom) % 40000))
  # The tool gives tallyd a clean environment: the sanitizers' and the shard count's are passed.
  # shellcheck disable=SC2046 # one -E per variable set
  systemd-socket-activate -l "127.0.0.1:$port" -l "$dir/tallyd.sock" \
    $(for v in TSAN_OPTIONS ASAN_OPTIONS LSAN_OPTIONS UBSAN_OPTIONS TALLYD_TEST_SHARDS; do
      eval "[ -n \"\${$v:-}\" ]" && printf -- '-E %s ' "$v"; done) \
    "$tallyd" --backend cpu --log-level debug --shm-socket "$dir/shm.sock" >"$dir/log" 2>&1 &
  pid=$!
  for i in $(seq 50); do
    grep -q "Listening on" "$dir/log" 2>/dev/null && [ -S "$dir/tallyd.sock" ] && break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then break; fi
  pid= # the port was taken: try another
done
[ -n "$pid" ] || { echo "FAIL: systemd-socket-activate did not start"; cat "$dir/log"; exit 1; }
"$tally" -t 10000 -e "tcp://127.0.0.1:$port" ping || { cat "$dir/log"; exit 1; }
"$tally" -t 10000 -e "ipc://$dir/tallyd.sock" ping || { cat "$dir/log"; exit 1; }
grep -q "listening on tcp://127.0.0.1:$port (socket fd 3 from systemd)" "$dir/log" || {
  echo "FAIL: tallyd did not adopt fd 3"; cat "$dir/log"; exit 1; }
grep -q "listening on ipc://$dir/tallyd.sock (socket fd 4 from systemd)" "$dir/log" || {
  echo "FAIL: tallyd did not adopt fd 4"; cat "$dir/log"; exit 1; }
kill -TERM "$pid"
wait "$pid"
rc=$?
pid=
cat "$dir/log"
[ $rc -eq 0 ] || { echo "FAIL: tallyd exited $rc"; exit 1; }
echo "socket activation ok"
