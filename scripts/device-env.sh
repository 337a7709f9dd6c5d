# Source this at the start of a command on the lent GPU machine (which has no network and no
# libzmq/libuv/cmocka): it unpacks the Debian packages carried in .deps/debs (fetched on a
# developer machine with scripts/fetch-device-deps.sh) into /opt/deps and points the toolchain
# there. Never unpack into /.
mkdir -p /opt/deps
for f in .deps/debs/*.deb; do dpkg -x "$f" /opt/deps; done
export LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export CMAKE_PREFIX_PATH=/opt/deps/usr
export CPATH=/opt/deps/usr/include
export LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu
export PKG_CONFIG_PATH=/opt/deps/usr/lib/x86_64-linux-gnu/pkgconfig:/opt/deps/usr/share/pkgconfig
export PKG_CONFIG_SYSROOT_DIR=/opt/deps
