#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_nats_contrib.sh TALLYD SOURCE_DIR: the files of contrib/nats are ones the programs take:
# make-certs.sh makes a CA and the nodes' certificates; each node's configuration, with its
# certificate paths pointed at those, passes `nats-server -t` (users.conf included as shipped);
# the worker's [nats] section passes `tallyd --check-config` (protected mode included: its
# servers are off the loopback, with a user and password in the URLs). test_nats_security runs
# a cluster of them. 77 (skipped) without nats-server or openssl.
set -eu
tallyd=$1
src=$2
command -v nats-server >/dev/null || { echo "nats-server not found: skipped"; exit 77; }
command -v openssl >/dev/null || { echo "openssl not found: skipped"; exit 77; }
dir=$(mktemp -d /tmp/tally-natscontrib-XXXXXX)
trap 'rm -rf "$dir"' EXIT
sh "$src/contrib/nats/make-certs.sh" "$dir/tls" nats-1=nats-1.example.net \
    nats-2=nats-2.example.net nats-3=nats-3.example.net
for f in ca.pem nats-1.pem nats-1-key.pem nats-2.pem nats-3-key.pem; do
    [ -s "$dir/tls/$f" ] || { echo "FAIL: make-certs.sh made no $f"; exit 1; }
done
[ "$(stat -c %a "$dir/tls/nats-1-key.pem")" = 600 ] || { echo "FAIL: a key is not 0600"; exit 1; }
openssl verify -CAfile "$dir/tls/ca.pem" "$dir/tls/nats-2.pem" >/dev/null
cp "$src/contrib/nats/users.conf" "$dir/"
for i in 1 2 3; do
    sed "s|/etc/nats/tls/|$dir/tls/|" "$src/contrib/nats/nats-$i.conf" >"$dir/nats-$i.conf"
    nats-server -c "$dir/nats-$i.conf" -t
done
sed "s|/etc/tallyd/nats-ca.pem|$dir/tls/ca.pem|" "$src/contrib/nats/tallyd-worker.conf" \
    >"$dir/worker.conf"
"$tallyd" --config "$dir/worker.conf" --check-config
echo "contrib/nats: certificates, 3 node configurations and the worker's section are valid"
