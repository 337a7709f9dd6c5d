#!/bin/sh
# `cmake --install` into a scratch prefix installs everything the service needs: tallyd,
# tally, libtally with its header and pkg-config file, the units (with ExecStart pointing at
# the installed tallyd) and the example configuration; and the installed tally runs.
# usage: test_install.sh BUILD_DIR
set -eu
build=$1
prefix=$(mktemp -d "${TMPDIR:-/tmp}/tallyd-install.XXXXXX")
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" >"$prefix.log" 2>&1 || { cat "$prefix.log"; exit 1; }
rm -f "$prefix.log"
fail=0
check() {
  if [ -e "$prefix/$1" ]; then echo "ok   $1"; else echo "MISSING $1"; fail=1; fi
}
check bin/tallyd
check bin/tally
check include/tally.h
check include/tally_proto.h
check lib/systemd/system/tallyd.service
check lib/systemd/system/tallyd.socket
check share/doc/tallyd/tallyd.conf.example
libdir=$(ls -d "$prefix"/lib*/pkgconfig 2>/dev/null | head -1)
if [ -z "$libdir" ] || [ ! -e "$libdir/tally.pc" ]; then echo "MISSING tally.pc"; fail=1; fi
if ! ls "$prefix"/lib*/libtally.so* >/dev/null 2>&1; then echo "MISSING libtally.so"; fail=1; fi
[ $fail -eq 0 ] || exit 1
# The installed unit starts the installed daemon, which was configured for the default prefix
# at build time; here the prefix differs, so only the form is checked.
grep -q '^ExecStart=/.*/bin/tallyd$' "$prefix/lib/systemd/system/tallyd.service"
# The installed binaries run from the prefix (libtally found through RPATH).
"$prefix/bin/tallyd" --version
"$prefix/bin/tally" --help >/dev/null
# The example configuration is one tallyd accepts.
"$prefix/bin/tallyd" --config "$prefix/share/doc/tallyd/tallyd.conf.example" --check-config
echo "install ok"
