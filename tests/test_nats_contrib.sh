#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_nats_contrib.sh TALLYD SOURCE_DIR: the files of contrib/nats are ones the programs take:
# each node's configuration passes `nats-server -t` (users.conf included), and the worker's
# [nats] section passes `tallyd --check-config` (protected mode included: its servers are off
# the loopback, with a user and password in the URLs). 77 (skipped) without nats-server.
set -eu
tallyd=$1
src=$2
command -v nats-server >/dev/null || { echo "nats-server not found: skipped"; exit 77; }
cd "$src/contrib/nats"
for i in 1 2 3; do
    nats-server -c "nats-$i.conf" -t
done
"$tallyd" --config tallyd-worker.conf --check-config
echo "contrib/nats: 3 node configurations and the worker's section are valid"
