#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# make-certs.sh DIR NAME=HOST[,HOST...]...: TLS certificates for a tallyd fleet's NATS cluster
# (contrib/nats/README.md). Makes the fleet's CA in DIR (ca.pem, and its key ca-key.pem) unless
# it is there, then for each NAME a certificate DIR/NAME.pem and its key DIR/NAME-key.pem,
# signed by that CA, for the hosts given (DNS names or IP addresses), usable to serve and to
# connect (routes present theirs both ways; a client certificate is the same kind). Keys are
# P-256, mode 0600; certificates last 825 days. Needs openssl.
#
#   contrib/nats/make-certs.sh /etc/nats/tls nats-1=nats-1.example.net \
#       nats-2=nats-2.example.net nats-3=nats-3.example.net
set -eu
[ $# -ge 2 ] || { echo "usage: $0 DIR NAME=HOST[,HOST...]..." >&2; exit 2; }
dir=$1
shift
command -v openssl >/dev/null || { echo "$0: openssl not found" >&2; exit 1; }
mkdir -p "$dir"
umask 077
if [ ! -f "$dir/ca.pem" ]; then
    openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
        -keyout "$dir/ca-key.pem" -out "$dir/ca.pem" -days 825 -subj "/CN=tallyd fleet CA" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi
for spec in "$@"; do
    name=${spec%%=*}
    hosts=${spec#*=}
    [ -n "$name" ] && [ "$name" != "$spec" ] && [ -n "$hosts" ] ||
        { echo "$0: '$spec' is not NAME=HOST[,HOST...]" >&2; exit 2; }
    san=""
    for h in $(echo "$hosts" | tr ',' ' '); do
        case $h in
        *:*) kind=IP ;;     # IPv6
        *[!0-9.]*) kind=DNS ;;
        *) kind=IP ;;       # IPv4
        esac
        san="${san:+$san,}$kind:$h"
    done
    ext="$dir/.$name.ext"
    printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyAgreement\n%s\n%s\n' \
        "extendedKeyUsage=serverAuth,clientAuth" "subjectAltName=$san" >"$ext"
    openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
        -keyout "$dir/$name-key.pem" -out "$dir/$name.csr" -subj "/CN=$name" 2>/dev/null
    openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca-key.pem" \
        -CAcreateserial -out "$dir/$name.pem" -days 825 -extfile "$ext" 2>/dev/null
    rm -f "$dir/$name.csr" "$ext"
    chmod 0644 "$dir/$name.pem"
done
chmod 0644 "$dir/ca.pem"
