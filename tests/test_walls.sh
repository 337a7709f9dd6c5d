#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_walls.sh SOURCE_DIR: the wall between the transports and the request path (issue 25,
# daemon/core/td_transport.h). ZeroMQ stays on its side of it:
#   1. zmq.h is included only by the ZeroMQ transport (daemon/net/td_zmq*), the ROUTER socket's
#      opening (td_router.c) and the two other ZeroMQ sockets (td_auth.c: CURVE's ZAP handler,
#      td_pub.c: the PUB socket), wherever the floor plan puts them; by no other file of daemon/.
#   2. No file of the request path — daemon/core/, daemon/gpu/, and the request path's files not
#      yet moved there (by name) — reaches zmq.h through its headers either: the "..." includes
#      are followed through daemon/ to any depth.
# Prints each offender and exits 1; 0 when the wall holds.
set -eu
src=$1
daemon="$src/daemon"
[ -d "$daemon" ] || { echo "no daemon/ under $src" >&2; exit 1; }

# The files allowed to include zmq.h (basenames; td_zmq* only inside net/).
allowed() {
    case "$1" in
    */net/td_zmq*) return 0 ;;
    */td_router.c | */td_auth.c | */td_pub.c) return 0 ;;
    # the allocation-failure hook's wrappers of ZeroMQ's allocating calls (TALLY_ALLOC_FAULTS)
    */net/td_alloc_fault_zmq.c) return 0 ;;
    esac
    return 1
}
includes_zmq() {
    grep -Eq '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]zmq\.h[>"]' "$1"
}

fail=0
files=$(find "$daemon" -type f \( -name '*.c' -o -name '*.h' \) | sort)
for f in $files; do
    if includes_zmq "$f" && ! allowed "$f"; then
        echo "FAIL: ${f#"$src"/} includes zmq.h; only the ZeroMQ transport may (td_transport.h)" >&2
        fail=1
    fi
done

# The request path: core/ and gpu/, and its files by name wherever they are now.
path_files=$(find "$daemon/core" "$daemon/gpu" -type f \( -name '*.c' -o -name '*.h' \) \
    2>/dev/null | sort)
for name in td_request td_reply td_sched td_exec td_admit td_ops td_stream td_window td_bins \
    td_peers td_path td_transport td_shm td_shm_side td_shm_regions td_shm_int td_err td_hash; do
    path_files="$path_files $(find "$daemon" -type f \( -name "$name.c" -o -name "$name.h" \))"
done

# The headers f includes with "...", found by name anywhere in daemon/.
quoted_includes() {
    sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$1" |
        while read -r h; do
            find "$daemon" -type f -name "$(basename "$h")"
        done
}

for f in $path_files; do
    seen=" $f "
    todo=$f
    while [ -n "$todo" ]; do
        next=""
        for g in $todo; do
            if includes_zmq "$g"; then
                echo "FAIL: ${f#"$src"/} reaches zmq.h through ${g#"$src"/}" >&2
                fail=1
            fi
            for h in $(quoted_includes "$g"); do
                case "$seen" in
                *" $h "*) ;;
                *)
                    seen="$seen$h "
                    next="$next $h"
                    ;;
                esac
            done
        done
        todo=$next
    done
done

[ "$fail" -eq 0 ] || exit 1
echo "zmq.h stays in the ZeroMQ transport: $(echo "$path_files" | wc -w) request-path files checked"
