#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# `cmake --install --prefix P` into a scratch prefix installs what a host and a developer need,
# and nothing private:
#   - tallyd, tally, libtally (libtally.so and libtally.a), tally.h with tally_wire.h and
#     tally_version.h (not tally_proto.h, tally_internal.h or tally_args.h), tally.pc, the CMake
#     package, the units (ExecStart is P/bin/tallyd) and the example configuration;
#   - libtally exports exactly the functions the installed headers declare with TALLY_API;
#   - a tiny consumer builds against P with pkg-config (shared, and static with --static) and
#     with find_package(tally), runs, and sees the library version its header names;
#   - the installed binaries run from P (libtally found through RPATH) and name their git
#     revision;
#   - what a package ships besides: the LICENSE, the bash completion of tally (sourced, it
#     completes `tally q` with P's tally), and with MAN=man the man pages tally(1), tallyd(8)
#     and tallyd.conf(5) under share/man, which `man -l` renders.
# usage: test_install.sh BUILD_DIR CC [CFLAGS] [MAN] (CFLAGS: the sanitizer flags of an ASan
# build, whose libtally needs its runtime loaded first; MAN: "man" when the build made the man
# pages, empty when it did not, without scdoc). TALLY_INSTALL_APP_FLAGS: more flags for the app
# (--coverage in a coverage build, whose libtally.a needs libgcov).
set -eu
build=$1
cc=$2
cflags="${3:-} ${TALLY_INSTALL_APP_FLAGS:-}"
man=${4:-}
prefix=$(mktemp -d "${TMPDIR:-/tmp}/tallyd-install.XXXXXX")
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" >"$prefix/install.log" 2>&1 ||
  { cat "$prefix/install.log"; exit 1; }
fail=0
check() {
  if [ -e "$prefix/$1" ]; then echo "ok   $1"; else echo "MISSING $1"; fail=1; fi
}
absent() {
  if [ -e "$prefix/$1" ]; then echo "PRIVATE, INSTALLED $1"; fail=1; else echo "ok   no $1"; fi
}
check bin/tallyd
check bin/tally
check include/tally.h
check include/tally_wire.h
check include/tally_version.h
absent include/tally_proto.h
absent include/tally_internal.h
absent include/tally_args.h
check lib/systemd/system/tallyd.service
check lib/systemd/system/tallyd.socket
check share/doc/tallyd/tallyd.conf.example
check share/doc/tallyd/LICENSE
check share/bash-completion/completions/tally
if [ "$man" = man ]; then
  check share/man/man1/tally.1
  check share/man/man8/tallyd.8
  check share/man/man5/tallyd.conf.5
fi
libdir=$(dirname "$(ls -d "$prefix"/lib*/libtally.so 2>/dev/null | head -1)")
[ -e "$libdir/libtally.so" ] || { echo "MISSING libtally.so"; fail=1; }
[ -e "$libdir/pkgconfig/tally.pc" ] || { echo "MISSING tally.pc"; fail=1; }
[ -e "$libdir/cmake/tally/tallyConfig.cmake" ] || { echo "MISSING tallyConfig.cmake"; fail=1; }
[ $fail -eq 0 ] || exit 1

# The unit starts the tallyd of this prefix.
grep -qx "ExecStart=$prefix/bin/tallyd" "$prefix/lib/systemd/system/tallyd.service" ||
  { echo "FAIL: ExecStart is not $prefix/bin/tallyd:"; grep ExecStart "$prefix"/lib/systemd/system/tallyd.service; exit 1; }

# Exported symbols = the TALLY_API declarations of the installed headers.
nm -D --defined-only "$libdir/libtally.so" | awk '$2 == "T" { print $3 }' | sort >"$prefix/exported"
sed -n 's/^TALLY_API [^(]*[ *]\(tally_[a-z0-9_]*\)(.*/\1/p' "$prefix"/include/tally*.h |
  sort -u >"$prefix/declared"
if ! cmp -s "$prefix/exported" "$prefix/declared"; then
  echo "FAIL: libtally exports something other than its documented API:"
  diff "$prefix/declared" "$prefix/exported" || true
  exit 1
fi
echo "ok   libtally exports exactly the $(wc -l <"$prefix/declared") documented functions"

# A consumer that uses the API, built both ways against the prefix.
mkdir "$prefix/app"
cat >"$prefix/app/app.c" <<'C'
#include <stdio.h>
#include <string.h>
#include <tally.h>

int main(void)
{
    tally_client_t *client = NULL;
    if (strcmp(tally_version(), TALLY_VERSION) != 0 || TALLY_VERSION_NUMBER < 100)
        return 1;
    if (tally_client_new("tcp://127.0.0.1:5570x", 100, &client) != TALLY_E_ARG)
        return 2; /* the endpoint check runs inside the library */
    printf("libtally %s: %s\n", tally_version(), tally_status_name(TALLY_E_SEQ_GAP));
    return 0;
}
C
# Both libraries are installed: libtally.so, which names libzmq (and libnats) itself (DT_NEEDED),
# so `pkg-config --libs tally` is -ltally alone, and libtally.a, one archive with proto/'s
# objects in it, whose own dependencies are tally.pc's Libs.private (not Requires.private:
# pkg-config would then insist on libzmq's .pc even for shared linking, and the GPU host unpacks
# its -dev packages outside the system paths). A static link takes -l:libtally.a for -ltally.
check lib/libtally.a
[ $fail -eq 0 ] || exit 1
if command -v pkg-config >/dev/null; then
  # An empty sysroot: the prefix under test is a real path (the GPU host sets
  # PKG_CONFIG_SYSROOT_DIR for its unpacked packages, and it would be prepended to ours). A
  # tally.pc that names its prefix (-DTALLY_PC_RELOCATABLE=OFF, as the Debian package is built:
  # prefix=/usr) is pointed at P, where it was installed now.
  define=""
  grep -q '^prefix=/' "$libdir/pkgconfig/tally.pc" && define="--define-variable=prefix=$prefix"
  pc() {
    # shellcheck disable=SC2086
    PKG_CONFIG_SYSROOT_DIR= PKG_CONFIG_PATH="$libdir/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}" \
      pkg-config $define "$@"
  }
  pc --cflags --libs tally >"$prefix/flags"
  pc --cflags --libs --static tally | sed 's/-ltally\b/-l:libtally.a/' >"$prefix/flags-static" ||
    { echo "FAIL: pkg-config --libs --static tally fails"; exit 1; }
  grep -q -- '-lzmq' "$prefix/flags-static" ||
    { echo "FAIL: tally.pc's Libs.private lacks libzmq: $(cat "$prefix/flags-static")"; exit 1; }
  for flags in flags flags-static; do
    # shellcheck disable=SC2046
    # shellcheck disable=SC2086
    "$cc" -std=c11 -Wall -Wextra -Werror $cflags "$prefix/app/app.c" -o "$prefix/app/app-$flags" \
      $(cat "$prefix/$flags") -Wl,-rpath,"$libdir"
    "$prefix/app/app-$flags"
  done
  readelf -d "$prefix/app/app-flags" | grep -q 'NEEDED.*\[libtally\.so\.0\]' ||
    { echo "FAIL: the app linked with --libs does not load libtally.so.0"; exit 1; }
  if readelf -d "$prefix/app/app-flags-static" | grep -q 'NEEDED.*libtally'; then
    echo "FAIL: the app linked with libtally.a still loads libtally.so"; exit 1
  fi
  echo "ok   pkg-config --libs tally: $(cat "$prefix/flags")"
  echo "ok   libtally.a with pkg-config --libs --static tally: $(cat "$prefix/flags-static")"
else
  echo "skip pkg-config consumer: no pkg-config"
fi
cat >"$prefix/app/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.16)
project(app C)
find_package(tally 0.1 REQUIRED)
add_executable(app app.c)
target_link_libraries(app PRIVATE tally::tally)
CM
cmake -S "$prefix/app" -B "$prefix/app/build" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_C_FLAGS="$cflags" -DCMAKE_BUILD_RPATH="$libdir" \
  >"$prefix/app.log" 2>&1 &&
  cmake --build "$prefix/app/build" >>"$prefix/app.log" 2>&1 ||
  { cat "$prefix/app.log"; exit 1; }
"$prefix/app/build/app"

# The installed binaries run from the prefix (libtally found through RPATH).
"$prefix/bin/tallyd" --version | grep -q ', revision [^)]' ||
  { echo "FAIL: the installed tallyd names no revision: $("$prefix/bin/tallyd" --version)"; exit 1; }
"$prefix/bin/tally" --version | grep -q ', revision [^)]' ||
  { echo "FAIL: the installed tally names no revision: $("$prefix/bin/tally" --version)"; exit 1; }
"$prefix/bin/tallyd" --version
# The completion, as bash-completion loads it, with the installed tally.
if command -v bash >/dev/null; then
  got=$(PATH="$prefix/bin:$PATH" bash -c ". '$prefix/share/bash-completion/completions/tally'
    COMP_LINE='tally q' COMP_POINT=7; _tally; echo \"\${COMPREPLY[*]}\"")
  [ "$got" = query ] || { echo "FAIL: the installed completion of 'tally q' gave '$got'"; exit 1; }
  echo "ok   the installed completion: tally q -> query"
fi
if [ "$man" = man ] && command -v man >/dev/null; then
  for page in man1/tally.1 man8/tallyd.8 man5/tallyd.conf.5; do
    man -l -P cat "$prefix/share/man/$page" | grep -q '^NAME' ||
      { echo "FAIL: man -l cannot render the installed $page"; exit 1; }
  done
  echo "ok   the installed man pages render"
fi
# The GPU minimum batch default reads the same in --help and the example configuration.
"$prefix/bin/tallyd" --help | grep -q 'run on the CPU (default 0:' ||
  { echo "FAIL: tallyd --help does not give --gpu-min-batch's default as 0"; exit 1; }
grep -qx '#min_batch = 0' "$prefix/share/doc/tallyd/tallyd.conf.example" ||
  { echo "FAIL: the example configuration's min_batch is not the default 0"; exit 1; }
# The example configuration is one tallyd accepts.
"$prefix/bin/tallyd" --config "$prefix/share/doc/tallyd/tallyd.conf.example" --check-config
echo "install ok"
