#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_revision.sh TALLYD TALLY SOURCE_DIR: the git revision the binaries were built from.
#   - `tallyd --version`, `tally --version` and the metric tallyd_build_info{revision=...} (read
#     with `tally stats` from a tallyd on an ipc socket in a scratch folder) name the same
#     revision, and it is this checkout's (`git describe --always --dirty`: a tag or a hash,
#     HEAD's or, after a commit not yet built, one before it), or "unknown" when the source
#     tree is not a git checkout;
#   - cmake/revision.cmake, which writes it at every build, on scratch repositories: "unknown"
#     outside git and in a folder that is only part of another repository, the short hash after
#     a commit, a new one after the next commit (no re-configure: the build runs the script),
#     "-dirty" with a changed file, and the file left untouched while nothing changed.
set -eu
tallyd=$1
tally=$2
src=$3
dir=$(mktemp -d "${TMPDIR:-/tmp}/tally-revision.XXXXXX")
pid=""
cleanup() {
    [ -z "$pid" ] || kill "$pid" 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT
fail() {
    echo "FAIL: $*" >&2
    exit 1
}

# ---- The binaries ------------------------------------------------------------------------
rev=$("$tallyd" --version | sed -n 's/^tallyd [0-9.]* (protocol [0-9]*, revision \(.*\))$/\1/p')
[ -n "$rev" ] || fail "tallyd --version has no revision: $("$tallyd" --version)"
"$tally" --version | grep -qx "tally [0-9.]* (libtally [0-9.]*, revision $rev)" ||
    fail "tally --version does not name revision $rev: $("$tally" --version)"
if command -v git >/dev/null && [ "$(git -C "$src" rev-parse --show-toplevel 2>/dev/null)" = \
    "$(cd "$src" && pwd -P)" ]; then
    # A tag, or a hash: a commit of this checkout that HEAD is, or descends from (a commit made
    # after the build shows at the next build).
    clean=${rev%-dirty}
    commit=$(git -C "$src" rev-parse -q --verify "${clean##*-g}^{commit}") ||
        fail "revision $rev names no commit of $src"
    git -C "$src" merge-base --is-ancestor "$commit" HEAD ||
        fail "revision $rev ($commit) is not HEAD nor before it (rebuild after changing HEAD)"
    echo "ok   --version: revision $rev, commit $commit of this checkout"
else
    [ "$rev" = unknown ] || fail "not a git checkout, yet revision $rev"
    echo "ok   --version: revision unknown outside a git checkout"
fi

"$tallyd" --bind "ipc://$dir/tallyd.sock" --backend cpu --shm off >"$dir/tallyd.log" 2>&1 &
pid=$!
for _ in $(seq 100); do
    "$tally" -e "ipc://$dir/tallyd.sock" -t 500 ping >/dev/null 2>&1 && break
    sleep 0.1
done
"$tally" -e "ipc://$dir/tallyd.sock" stats >"$dir/stats" || fail "tally stats failed"
grep -q "^tallyd_build_info{version=\"[0-9.]*\",protocol=\"1\",cuda=\"\(yes\|no\)\",revision=\"$rev\"} 1\$" \
    "$dir/stats" || fail "no tallyd_build_info with revision=\"$rev\": $(grep build_info "$dir/stats")"
echo "ok   tallyd_build_info{...,revision=\"$rev\"}"
kill "$pid"
pid=""

# ---- cmake/revision.cmake ------------------------------------------------------------------
command -v git >/dev/null || { echo "no git: the script's own checks skipped"; exit 0; }
script=$src/cmake/revision.cmake
out=$dir/revision.c
revision_of() { # the revision the script writes for source tree $1
    cmake -DSOURCE_DIR="$1" -DOUTPUT="$out" -P "$script" || fail "revision.cmake failed on $1"
    sed -n 's/^const char tally_build_revision\[\] = "\(.*\)";$/\1/p' "$out"
}
g() { git -C "$dir/repo" -c user.name=test -c user.email=test@example.com "$@"; }
mkdir "$dir/repo"
[ "$(revision_of "$dir/repo")" = unknown ] || fail "not a repository, yet not unknown"
g init -q
echo one >"$dir/repo/file"
g add file
g commit -q -m one
[ "$(revision_of "$dir/repo")" = "$(g rev-parse --short HEAD)" ] ||
    fail "after a commit: $(cat "$out"), HEAD $(g rev-parse --short HEAD)"
before=$(ls --full-time "$out")
sleep 1.1 # a rewrite would show in the modification time
revision_of "$dir/repo" >/dev/null
[ "$(ls --full-time "$out")" = "$before" ] || fail "rewritten though the revision did not change"
first=$(g rev-parse --short HEAD)
echo two >"$dir/repo/file"
[ "$(revision_of "$dir/repo")" = "$first-dirty" ] || fail "a changed file: $(cat "$out")"
g commit -q -am two
second=$(revision_of "$dir/repo")
[ "$second" = "$(g rev-parse --short HEAD)" ] && [ "$second" != "$first" ] ||
    fail "after the next commit: $second (first $first)"
g tag -a -m release v9.8.7 # annotated: what describe names
[ "$(revision_of "$dir/repo")" = v9.8.7 ] || fail "at a tag: $(cat "$out")"
mkdir "$dir/repo/sub"
[ "$(revision_of "$dir/repo/sub")" = unknown ] ||
    fail "a folder inside another repository is not unknown: $(cat "$out")"
echo "ok   revision.cmake: unknown, hash, unchanged file, -dirty, next commit, tag, foreign repo"
