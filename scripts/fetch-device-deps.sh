#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Downloads (does not install) the Debian packages the GPU machine lacks into .deps/debs, to be
# carried there by the device tool (carry: [".deps"]) and unpacked by scripts/device-env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps/debs
cd .deps/debs
apt-get download libzmq5 libzmq3-dev libuv1 libuv1-dev libcmocka0 libcmocka-dev libsodium23 \
  libpgm-5.3-0 libnorm1 libbsd0 libmd0 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 \
  libkeyutils1 libcom-err2 libinih1 libinih-dev libmicrohttpd12 libmicrohttpd-dev \
  libsystemd-dev libsystemd0 zlib1g zlib1g-dev \
  libnats3.4 libnats-dev libprotobuf-c1 nats-server  # NATS JetStream (libnats also needs libssl3)
# NumPy for the Python binding's GPU benchmark (gpu-check.sh STEPS=gpu-region-py), used when the
# GPU machine's python3 lacks it and is Debian's version.
apt-get download python3-numpy libblas3 liblapack3 libgfortran5
# Redis beside tallyd's shards (gpu-check.sh STEPS=shards, bench/run-shards.sh: issue 31's
# redis-benchmark -t incr -P 64 -c 16): redis-server is a link to redis-tools' redis-check-rdb.
apt-get download redis-server redis-tools libjemalloc2 liblzf1
# perf, for the benchmarks' profiles on the GPU host (bench/run-nats-fleet.sh PERF=1): Debian's
# linux-perf and the libraries it loads, kept apart (.deps/perf, unpacked into /opt/perf) so that
# they never shadow the GPU host's own libelf, libcap and the like for anything but perf.
mkdir -p ../perf
cd ../perf
apt-get download linux-perf libbabeltrace1 libdw1 libelf1 libnuma1 libopencsd1 libperl5.36 \
  libpython3.11 libslang2 libunwind8 libcap2 libglib2.0-0 libffi8 libpcre2-8-0 libmount1 \
  libblkid1 libselinux1 libbz2-1.0 libcrypt1 libexpat1 libuuid1
