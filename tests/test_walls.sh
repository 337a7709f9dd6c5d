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
#   3. The files of the libraries named after SOURCE_DIR stand in floors (issue 35): for each
#      FOLDER OBJECTS pair (OBJECTS: the library's object files, colon-separated, as CMake's
#      $<TARGET_OBJECTS> gives them), no circle of calls between its objects and no circle of
#      #includes between its headers (scripts/check-floors.py). proto/: the codec (tally_proto.c)
#      calls the validator (tally_validate.c), which reads the operation table (tally_ops.c),
#      which stands on the numbers' names (tally_types.c); never the other way. client/
#      (libtally): the core (tally.c: the client, its connection) at the bottom with the pure
#      helpers, then request/reply (tally_call.c), the wrappers (tally_control.c), shared memory
#      (tally_shm.c), device memory (tally_gpu.c) and pushes (tally_push.c) on top; the NATS
#      client (tally_client_nats.c) stands above the core, which reaches it only through its
#      table of transports (tally_transport.h). The floors are drawn in client/tally.c's design
#      comment. The check is first shown to catch a circle, on two objects made here that call
#      each other.
# Prints each offender and exits 1; 0 when the walls hold.
# usage: test_walls.sh SOURCE_DIR [FOLDER OBJECTS]...
set -eu
src=$1
shift
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

# The headers f includes with "...", found by name anywhere in daemon/ (in a list made once: a
# find per include took most of this test's time on a loaded box).
headers=$(find "$daemon" -type f -name '*.h' | sort)
quoted_includes() {
    sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$1" |
        while read -r h; do
            for p in $headers; do
                case "$p" in */"${h##*/}") echo "$p" ;; esac
            done
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

[ $# -gt 0 ] || exit 0
floors="$src/scripts/check-floors.py"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf 'int below(void);\nint above(void) { return below(); }\n' >"$tmp/above.c"
printf 'int above(void);\nint below(void) { return above(); }\n' >"$tmp/below.c"
${CC:-cc} -c -o "$tmp/above.c.o" "$tmp/above.c" && ${CC:-cc} -c -o "$tmp/below.c.o" "$tmp/below.c"
if python3 "$floors" circle "$tmp" "$tmp/above.c.o" "$tmp/below.c.o" >"$tmp/out" 2>&1 ||
    ! grep -q 'circle of calls between above.c, below.c' "$tmp/out"; then
    cat "$tmp/out" >&2
    echo "FAIL: check-floors.py does not catch two files that call each other" >&2
    exit 1
fi
while [ $# -ge 2 ]; do
    folder=$1
    objects=$(echo "$2" | tr ':' ' ')
    shift 2
    # shellcheck disable=SC2086 # one object per word
    python3 "$floors" "$folder/" "$src/$folder" $objects || fail=1
done
exit "$fail"
