# SPDX-License-Identifier: Apache-2.0
# Source this at the start of a command on the lent GPU machine (which has no network and no
# libzmq/libuv/cmocka): it unpacks the Debian packages carried in .deps/debs (fetched on a
# developer machine with scripts/fetch-device-deps.sh) into /opt/deps and points the toolchain
# there. Never unpack into /.
mkdir -p /opt/deps
for f in .deps/debs/*.deb; do dpkg -x "$f" /opt/deps; done
# perf (fetch-device-deps.sh), behind a wrapper that alone sees its libraries
if ls .deps/perf/*.deb >/dev/null 2>&1; then
  mkdir -p /opt/perf/bin
  for f in .deps/perf/*.deb; do dpkg -x "$f" /opt/perf; done
  printf '#!/bin/sh\nLD_LIBRARY_PATH=/opt/perf/usr/lib/x86_64-linux-gnu:/opt/perf/lib/x86_64-linux-gnu exec /opt/perf/usr/bin/perf "$@"\n' \
    >/opt/perf/bin/perf
  chmod +x /opt/perf/bin/perf
  export PATH=$PATH:/opt/perf/bin
fi
export LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=$PATH:/opt/deps/usr/sbin:/opt/deps/usr/bin # nats-server (NATS tests), redis (shards)
export CMAKE_PREFIX_PATH=/opt/deps/usr
export CPATH=/opt/deps/usr/include
export LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu
export PKG_CONFIG_PATH=/opt/deps/usr/lib/x86_64-linux-gnu/pkgconfig:/opt/deps/usr/share/pkgconfig
export PKG_CONFIG_SYSROOT_DIR=/opt/deps
# The carried -dev packages' .pc files name Requires(.private) modules whose -dev packages are
# not carried (libzmq: libsodium, norm...; libmicrohttpd: gnutls); pkg-config insists they exist
# even for shared linking. Empty stand-ins for every missing one satisfy it.
tally_pc_stubs=$(mktemp -d)
export PKG_CONFIG_PATH=$PKG_CONFIG_PATH:$tally_pc_stubs
for pc in /opt/deps/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc /opt/deps/usr/share/pkgconfig/*.pc; do
  [ -f "$pc" ] || continue
  sed -n 's/^Requires\(\.private\)\?:\(.*\)/\2/p' "$pc" | tr ', ' '\n\n'
done | grep -E '^[A-Za-z]' | sort -u | while read -r m; do
  [ -n "$m" ] && ! pkg-config --exists "$m" 2>/dev/null &&
    printf 'Name: %s\nDescription: stand-in\nVersion: 99\n' "$m" >"$tally_pc_stubs/$m.pc"
done
