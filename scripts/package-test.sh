#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# package-test.sh: tallyd's Debian packages tested the way an admin and a user meet them, on
# this machine (CI's step "Debian packages" in scripts/test.sh; as root: it installs and purges
# system packages, so it is not a CTest test, which run in parallel with others).
#
#   1. Builds the packages of this tree (scripts/package.sh, lintian included) and those of the
#      previous version: commit $old_commit below, built with this tree's debian/ laid over it
#      (it predates the packaging; package.sh --rev). There are no release tags: that commit is
#      main as it was when the packaging began (2026-12-02); move it to the last release's commit
#      once there are releases, or when this packaging no longer builds it.
#   2. Upgrade: installs the previous version (apt-get install ./*.deb), runs its tallyd as the
#      system user tallyd with the state in /var/lib/tallyd, puts a stream in it, stops it
#      (SIGTERM: the final snapshot), edits /etc/tallyd/tallyd.conf as an admin would, installs
#      this tree's packages over it, and checks that the stream is there with the same counts
#      and that the edit survived (a conffile; dpkg keeps the admin's file: --force-confold).
#   3. Use: the installed tallyd (/usr/bin/tallyd, not a build's), run as tallyd on a free port
#      (no systemd runs here, so no unit starts it: tests/test_units.sh checks the installed
#      units instead), answers `tally ping` and a hist; the C example of docs/c-and-python.md
#      builds against libtally-dev with pkg-config, with find_package(tally) and
#      statically (libtally.a), and runs against it; /usr/bin/python3 imports the installed
#      binding, which loads /usr/lib/<triplet>/libtally.so.0, and uses the daemon. Every command
#      runs with the system's PATH and no PKG_CONFIG_PATH, CMAKE_PREFIX_PATH or PYTHONPATH, so
#      nothing of a build tree can stand in for the packages.
#   4. Remove keeps the state (/var/lib/tallyd/streams.state) and the conffile; purge removes
#      them and every file `dpkg -L` listed (a directory may stay only while another package
#      owns it). The system user tallyd stays after purge: Debian keeps system users (files it
#      owns may remain elsewhere; a reinstall finds the same user); this test deletes it at the
#      end when it made it, to leave the machine as it found it.
#
# It refuses to run where tallyd packages, /etc/tallyd, /var/lib/tallyd, /var/cache/tallyd or
# /run/tallyd (unless stale: no tallyd holds its lock) exist already (it would remove them), and is skipped (exit 77) when not root
# without passwordless sudo, or where systemd runs (the packages would start tallyd.service; run
# it in a container). Whatever happens, it stops its tallyd and purges what it installed (trap).
# About 95 s of CPU; 2.5 to 5 minutes on the shared 2-core dev box (each phase's time is printed
# at the end).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
old_commit=1f378860684bdf356eac8d381aa63dc91db7c739
packages=(tallyd libtally0 libtally-dev python3-tally)

if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then exec sudo -n "$0" "$@"; fi
  echo "package-test: skipped: it installs packages, and needs root or passwordless sudo"
  exit 77
fi
if [ -d /run/systemd/system ]; then
  echo "package-test: skipped: systemd runs here, so the packages would start tallyd.service;"
  echo "run it in a container or on a machine without systemd as PID 1"
  exit 77
fi
# /run/tallyd is also where any tallyd run as root without a package puts its side channel (a
# test, a developer's `tallyd`): a stale one (no tallyd holds its lock) is runtime litter, not
# an installation, and is removed; one a running tallyd holds is refused like the others.
runtime_lock=/run/tallyd/tallyd-shm.sock.lock
if [ -d /run/tallyd ] && { [ ! -e $runtime_lock ] || flock -n $runtime_lock true; }; then
  echo "package-test: removing a stale /run/tallyd (no tallyd holds $runtime_lock)"
  rm -rf /run/tallyd
fi
for d in /etc/tallyd /var/lib/tallyd /var/cache/tallyd /run/tallyd; do
  [ ! -e $d ] || { echo "package-test: $d exists already; this test would remove it"; exit 1; }
done
# The upgrade needs the previous version's commit, and package.sh's version number the whole
# history (git rev-list --count); a shallow clone has neither. Such a clone is deepened where its
# origin answers; else the upgrade phase is skipped, said loudly, and the rest still runs.
upgrade=1
if ! git -C "$here" cat-file -e "$old_commit^{commit}" 2>/dev/null; then
  git -C "$here" fetch -q --unshallow 2>/dev/null || true
  if ! git -C "$here" cat-file -e "$old_commit^{commit}" 2>/dev/null; then
    echo "package-test: UPGRADE PHASE SKIPPED: the previous version's commit $old_commit is not"
    echo "in this clone's history (a shallow clone whose origin cannot deepen it)"
    upgrade=0
  fi
fi

known() { # the packages of ours that dpkg knows: installed, or removed with config files left
  for p in "${packages[@]}"; do
    if dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null | grep -qv '^not-installed$'; then
      echo "$p"
    fi
  done
}
if [ -n "$(known)" ]; then
  echo "package-test: $(known | tr '\n' ' ')installed here already; purge them first"
  echo "(this test installs and purges its own)"
  exit 1
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/tallyd-package-test.XXXXXX")
chmod 755 "$work" # apt's _apt user reads the .debs from here
made_user=0
getent passwd tallyd >/dev/null || made_user=1
daemon_pid=""
cleanup() {
  set +e
  stop_daemon quietly
  local ours
  mapfile -t ours < <(known)
  if [ ${#ours[@]} -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq "${ours[@]}" >/dev/null 2>&1
  fi
  # What a failed purge may have left (neither existed before: checked at the start).
  rm -rf /etc/tallyd /var/lib/tallyd /var/cache/tallyd /run/tallyd
  if [ $made_user -eq 1 ] && getent passwd tallyd >/dev/null; then userdel tallyd; fi
  if [ $made_user -eq 1 ] && getent group tallyd >/dev/null; then groupdel tallyd; fi
  rm -rf "$work"
}
trap cleanup EXIT

phase_start=$SECONDS
timings=""
phase() { # NAME: ends the phase that ran until now, under NAME
  timings="$timings$(printf '%-44s %4d s' "$1" $((SECONDS - phase_start)))\n"
  phase_start=$SECONDS
}
fail() {
  echo "FAIL: $*"
  if [ -f "$work/tallyd.log" ]; then echo "-- tallyd's log:"; tail -n 20 "$work/tallyd.log"; fi
  exit 1
}
# A user's shell: the system's PATH, nothing pointing at a build tree.
as_user() {
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME="$work/home" LANG=C.UTF-8 \
    TALLY_ENDPOINT="$endpoint" "$@"
}
apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "$@" \
    >"$work/apt.log" 2>&1 || { cat "$work/apt.log"; fail "apt-get install $*"; }
}
version_of() { dpkg-query -W -f='${Version}' "$1"; }

# The installed tallyd as the system user, on a free port, with the state where the unit keeps
# it; waits until it answers.
port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
endpoint=tcp://127.0.0.1:$port
# (The shared-memory socket goes to this test's folder: /run/tallyd is systemd's to make.)
start_daemon() {
  install -d -o tallyd -g tallyd "$work/run"
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin setpriv --reuid=tallyd --regid=tallyd --init-groups \
    /usr/bin/tallyd --bind "$endpoint" --state-dir /var/lib/tallyd \
    --shm-socket "$work/run/tallyd-shm.sock" >>"$work/tallyd.log" 2>&1 &
  daemon_pid=$!
  for _ in $(seq 100); do
    as_user tally -t 500 ping >/dev/null 2>&1 && break
    kill -0 "$daemon_pid" 2>/dev/null || fail "the installed tallyd exited at start"
    sleep 0.2
  done
  as_user tally ping >/dev/null || fail "the installed tallyd does not answer on $endpoint"
  [ "$(ps -o user= -p "$daemon_pid")" = tallyd ] || fail "tallyd does not run as the user tallyd"
}
stop_daemon() { # [quietly]: SIGTERM, and (unless quietly) a clean exit
  [ -n "$daemon_pid" ] || return 0
  local rc=0
  kill -TERM "$daemon_pid" 2>/dev/null
  wait "$daemon_pid" || rc=$?
  daemon_pid=""
  [ -n "${1:-}" ] || [ $rc -eq 0 ] || fail "tallyd exited $rc on SIGTERM"
}
mkdir -p "$work/home"

echo "== build: this tree's packages (with lintian) and the previous version's ($old_commit)"
"$here/scripts/package.sh" -o "$work/new"
phase "build + lintian, this tree"
new_debs=("$work"/new/*.deb)
new_version=$(dpkg-deb -f "$work"/new/tallyd_*.deb Version)
chmod -R a+rX "$work/new"
if [ $upgrade = 1 ]; then
  "$here/scripts/package.sh" --rev "$old_commit" -o "$work/old" --no-lint
  phase "build, previous version"
  chmod -R a+rX "$work/old"
  old_debs=("$work"/old/*.deb)

  echo "== upgrade: the previous version with a stream in its state, then this tree's"
  apt_install "${old_debs[@]}"
  old_version=$(version_of tallyd)
  start_daemon
  seq 0 255 | as_user tally hist --text --stream pkg/upgrade >/dev/null
  seq 10 20 | as_user tally hist --text --stream pkg/upgrade >/dev/null
  as_user tally query pkg/upgrade >"$work/before.txt"
  stop_daemon
  [ -s /var/lib/tallyd/streams.state ] || fail "no /var/lib/tallyd/streams.state after a clean stop"
  echo "# an admin's edit (package-test)" >>/etc/tallyd/tallyd.conf
  phase "install previous version, make state"
  apt_install "${new_debs[@]}"
  for p in "${packages[@]}"; do
    [ "$(version_of "$p")" = "$new_version" ] || fail "$p is $(version_of "$p"), not $new_version"
  done
  grep -qx "# an admin's edit (package-test)" /etc/tallyd/tallyd.conf ||
    fail "the upgrade overwrote the edited /etc/tallyd/tallyd.conf"
  start_daemon
  as_user tally query pkg/upgrade >"$work/after.txt" || fail "stream pkg/upgrade lost in the upgrade"
  diff -u "$work/before.txt" "$work/after.txt" || fail "stream pkg/upgrade changed in the upgrade"
  echo "ok   $old_version -> $new_version: stream pkg/upgrade kept, the edited conffile kept"
  phase "upgrade to this tree, check state"
else
  apt_install "${new_debs[@]}"
  start_daemon
  phase "install this tree (no upgrade: shallow clone)"
fi

echo "== use: the installed tallyd, tally, libtally-dev and python3-tally"
for p in "${packages[@]}"; do dpkg -L "$p"; done | sort -u >"$work/files.txt"
[ "$(as_user sh -c 'command -v tally')" = /usr/bin/tally ] || fail "tally is not /usr/bin/tally"
as_user tallyd --version | grep -q "^tallyd 0" || fail "tallyd --version: $(tallyd --version)"
as_user tally ping
got=$(printf '5 3 0 12 7 1 7\n' | as_user tally hist --text --stream pkg/use | grep -E '^(5|7|12) ')
[ "$got" = "$(printf '5 1\n7 2\n12 1')" ] || fail "tally hist gave: $got"
as_user tally query pkg/use | grep -q 'elements 7' ||
  fail "tally query pkg/use: $(as_user tally query pkg/use)"
echo "ok   tally ping, hist and query against /usr/bin/tallyd $(as_user tallyd --version | head -1)"
# The system user, its state directory, the conffile and the units.
IFS=: read -r _ _ uid _ _ home shell < <(getent passwd tallyd)
if ! { [ "$uid" -lt 1000 ] && [ "$home" = /var/lib/tallyd ] &&
  [ "$shell" = /usr/sbin/nologin ]; }; then
  fail "the user tallyd: uid $uid, home $home, shell $shell"
fi
[ "$(stat -c %U:%G /var/lib/tallyd)" = tallyd:tallyd ] || fail "/var/lib/tallyd is not tallyd's"
dpkg-query -W -f='${Conffiles}\n' tallyd | grep -q '^ /etc/tallyd/tallyd.conf ' ||
  fail "/etc/tallyd/tallyd.conf is not a conffile"
sh "$here/tests/test_units.sh" /lib/systemd/system tallyd >"$work/units.log" 2>&1 ||
  { cat "$work/units.log"; fail "the installed units"; }
echo "ok   user tallyd (uid $uid), /var/lib/tallyd, conffile, units" \
  "($(tail -n 2 "$work/units.log" | head -1))"
as_user man -w tallyd.conf | grep -q '^/usr/share/man/man5/tallyd.conf.5' || fail "man tallyd.conf"
# shellcheck disable=SC2016
got=$(as_user bash -c '. /usr/share/bash-completion/completions/tally
  COMP_LINE="tally q" COMP_POINT=7; _tally; echo "${COMPREPLY[*]}"')
[ "$got" = query ] || fail "the installed completion of 'tally q' gave '$got'"

# The C example of docs/c-and-python.md, against the installed library: the daemon's endpoint
# is this test's.
app=$work/app
mkdir "$app"
awk '/<!-- compiled: filter -->/ { name = 1; next }
     name && /^```c/ { inside = 1; next }
     inside && /^```/ { exit }
     inside { print }' "$here/docs/c-and-python.md" |
  sed "s|tcp://127.0.0.1:5555|$endpoint|" >"$app/app.c"
grep -q "$endpoint" "$app/app.c" ||
  fail "the C example (<!-- compiled: filter -->) not found in docs/c-and-python.md"
cat >"$app/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.16)
project(app C)
find_package(tally 0.1 REQUIRED)
add_executable(app app.c)
target_link_libraries(app PRIVATE tally::tally)
CM
# shellcheck disable=SC2016
as_user sh -c 'cd "$1" && cc app.c -o app-pc $(pkg-config --cflags --libs tally) &&
  cc app.c -o app-static $(pkg-config --cflags tally) \
    $(pkg-config --libs --static tally | sed "s/-ltally\b/-l:libtally.a/") &&
  cmake -S . -B build >cmake.log && cmake --build build >>cmake.log' _ "$app" ||
  { cat "$app/cmake.log" 2>/dev/null; fail "docs/c-and-python.md's C example does not build"; }
lib=$(realpath "/usr/lib/$(dpkg-architecture -qDEB_HOST_MULTIARCH)/libtally.so.0")
for exe in app-pc build/app; do
  got=$(as_user ldd "$app/$exe" | awk '$1 == "libtally.so.0" { print $3 }')
  [ "$(realpath "${got:-/nonexistent}")" = "$lib" ] ||
    fail "$exe does not load the installed libtally.so.0 ($lib): '$got'"
done
if readelf -d "$app/app-static" | grep -q 'NEEDED.*libtally'; then
  fail "app-static loads libtally.so"
fi
for exe in app-pc app-static build/app; do
  [ "$(as_user "$app/$exe" | tr '\n' ' ')" = "5 12 7 " ] || fail "the C example's output ($exe)"
done
echo "ok   the C example of docs/: pkg-config, static libtally.a, find_package(tally): 5 12 7"

# The Python binding, as installed, through the SONAME.
# shellcheck disable=SC2016
as_user sh -c 'cd "$1" && /usr/bin/python3 -' _ "$work" <<PY || fail "python3-tally"
import os, numpy as np, tally, tally._lib
assert tally.__file__ == "/usr/lib/python3/dist-packages/tally/__init__.py", tally.__file__
assert tally._lib.library_path()[0] == "libtally.so.0", tally._lib.library_path()
maps = {l.split()[-1] for l in open("/proc/self/maps") if "libtally" in l}
assert maps == {"$lib"}, maps
with tally.Client() as c:
    x = np.array([5, -3, 0, 12, 7, -1], dtype=np.int32)
    assert c.filter(x, gt=0, stable=True).tolist() == [5, 12, 7]
    assert c.hist(np.frombuffer(b"hello", np.uint8), stream="pkg/python")[ord("l")] == 2
    assert c.query("pkg/python")["elements"] == 5
print("ok   /usr/bin/python3: tally from", os.path.dirname(tally.__file__), "over", *maps)
PY
stop_daemon
phase "use the installed packages"

echo "== remove, then purge"
DEBIAN_FRONTEND=noninteractive apt-get remove -y -qq "${packages[@]}" >"$work/apt.log" 2>&1 ||
  { cat "$work/apt.log"; fail "apt-get remove"; }
[ ! -e /usr/bin/tallyd ] || fail "/usr/bin/tallyd is still there after remove"
[ -s /var/lib/tallyd/streams.state ] || fail "remove deleted the state /var/lib/tallyd"
[ -e /etc/tallyd/tallyd.conf ] || fail "remove deleted the conffile /etc/tallyd/tallyd.conf"
echo "ok   remove: the state and the conffile stay"
# (libtally0, libtally-dev and python3-tally have no conffiles: remove forgot them already.)
mapfile -t rc < <(known)
[ "${rc[*]}" = tallyd ] ||
  fail "after remove, dpkg still knows ${rc[*]} (expected tallyd alone: its conffile)"
DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq "${rc[@]}" >"$work/apt.log" 2>&1 ||
  { cat "$work/apt.log"; fail "apt-get purge"; }
[ -z "$(known)" ] || fail "dpkg still knows $(known) after purge"
left=""
while read -r f; do
  [ "$f" != /. ] || continue
  if [ -e "$f" ] || [ -L "$f" ]; then
    # A directory another package still owns (/usr/bin, /lib/systemd/system) stays.
    [ -d "$f" ] && dpkg-query -S "$f" >/dev/null 2>&1 && continue
    left="$left $f"
  fi
done <"$work/files.txt"
for d in /etc/tallyd /var/lib/tallyd /var/cache/tallyd /run/tallyd \
  /usr/lib/python3/dist-packages/tally; do
  [ ! -e $d ] || left="$left $d"
done
[ -z "$left" ] || fail "left after purge:$left"
getent passwd tallyd >/dev/null ||
  fail "purge removed the system user tallyd (it is kept, by choice)"
echo "ok   purge: none of the $(wc -l <"$work/files.txt") paths of dpkg -L left, nor the state or"
echo "     /etc/tallyd; the user tallyd kept"
phase "remove, purge, check"

printf "== package test passed (%s, %d s in all):\n$timings" "$new_version" "$SECONDS"
