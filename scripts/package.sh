#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# package.sh: builds tallyd's Debian packages (tallyd, libtally0, libtally-dev, python3-tally)
# from this tree with debhelper (debian/), and checks them with lintian.
#
#   scripts/package.sh [-o OUTDIR] [--rev COMMIT] [--no-lint]
#
# Why debhelper and not CPack's DEB generator: a daemon's package is mostly maintainer-script
# work that debhelper does the way Debian admins expect and CPack leaves to hand-written scripts:
# the system user through sysusers.d and the state directory through tmpfiles.d (run at
# configure), the units enabled, started and restarted after an upgrade (dh_installsystemd,
# which does nothing where systemd is not running), /etc files as conffiles that an upgrade does
# not overwrite, shlibs and the ldconfig trigger of libtally0, -dbgsym packages, and dh_python3
# (byte-compiling at install, removing the .pyc on removal, python3:Depends from the binding's
# requirements). CPack would also need its own version of each package's dependencies, which
# dpkg-shlibdeps computes.
#
# What is built: the tree as git sees it (HEAD, its uncommitted changes, and the untracked files
# that .gitignore does not ignore), in a scratch clone (git clone --shared: the clone has the
# tree's history, so cmake/revision.cmake names the revision as in a normal build; nothing is
# written in this tree but OUTDIR).
# --rev COMMIT builds that commit instead, with this tree's debian/ laid over it: how the
# upgrade test (scripts/package-test.sh) builds the previous version from a commit that predates
# the packaging.
#
# The version: CMakeLists.txt's project VERSION, then +git<N>.<hash>, N the number of commits
# in the history (git rev-list --count: it grows with every commit on a branch, merges included,
# so a later commit's packages upgrade an earlier one's), e.g. 0.1.0+git540.1f37886; a tree with
# uncommitted changes or untracked files adds .dirty (after the clean one). A native package: the
# packaging lives in the tree.
#
# The packages go to OUTDIR (default: build-deb/ in this tree), with the .changes and .buildinfo;
# without -dbgsym packages (DEB_BUILD_OPTIONS noautodbgsym; set DEB_BUILD_OPTIONS yourself to
# change what is passed) and without running the tests (nocheck: CI runs them on the same tree
# before). lintian runs on the packages (skip with --no-lint): an error or a warning fails, and
# each warning left is overridden in debian/*.lintian-overrides with its reason.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=$here/build-deb
rev=""
lint=1
while [ $# -gt 0 ]; do
  case $1 in
  -o) out=$2; shift 2 ;;
  --rev) rev=$2; shift 2 ;;
  --no-lint) lint=0; shift ;;
  -h | --help) sed -n '3,5p' "$0"; exit 0 ;;
  *) echo "package.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
for tool in git dpkg-buildpackage dh pybuild; do
  command -v "$tool" >/dev/null ||
    { echo "package.sh: $tool not found (scripts/install-deps.sh installs it)" >&2; exit 1; }
done
[ $lint -eq 0 ] || command -v lintian >/dev/null ||
  { echo "package.sh: lintian not found (scripts/install-deps.sh installs it)" >&2; exit 1; }

scratch=$(mktemp -d "${TMPDIR:-/tmp}/tallyd-package.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
src=$scratch/src
git clone --quiet --shared --no-checkout "$here" "$src"
if [ -n "$rev" ]; then
  commit=$(git -C "$here" rev-parse --verify "$rev^{commit}")
  git -C "$src" checkout --quiet --detach "$commit"
  # This tree's packaging over that commit's (it may have none).
  rm -rf "$src/debian"
  cp -r "$here/debian" "$src/debian"
else
  git -C "$src" checkout --quiet --detach "$(git -C "$here" rev-parse HEAD)"
  git -C "$here" diff --binary HEAD | git -C "$src" apply --allow-empty
  (cd "$here" && git ls-files -z --others --exclude-standard | tar -c --null -T -) |
    tar -x -C "$src"
fi

# The version, and debian/changelog, which the packaging does not keep in the tree.
base=$(sed -n 's/^project(tallyd VERSION \([0-9.]*\).*/\1/p' "$src/CMakeLists.txt")
[ -n "$base" ] || { echo "package.sh: no project VERSION in CMakeLists.txt" >&2; exit 1; }
count=$(git -C "$src" rev-list --count HEAD)
hash=$(git -C "$src" rev-parse --short=7 HEAD)
version=$base+git$count.$hash
# (With --rev, debian/ is this tree's and not the commit's: no change to the software.)
if [ -n "$(git -C "$src" status --porcelain -- . ${rev:+':!debian'})" ]; then
  version=$version.dirty
fi
{
  echo "tallyd ($version) unstable; urgency=medium"
  echo
  echo "  * Built from $(git -C "$src" describe --always --dirty) by scripts/package.sh."
  echo
  maintainer=$(sed -n 's/^Maintainer: //p' "$src/debian/control")
  echo " -- $maintainer  $(git -C "$src" log -1 --format=%aD)"
} >"$src/debian/changelog"

echo "== building tallyd $version ($src)"
log=$scratch/build.log
# The system's PATH, as on a Debian build daemon: a Python or compiler of the user's own
# (pyenv, ~/.local) is not what the packages will run with.
if ! (cd "$src" && PATH=/usr/sbin:/usr/bin:/sbin:/bin \
  DEB_BUILD_OPTIONS=${DEB_BUILD_OPTIONS:-"nocheck noautodbgsym parallel=$(nproc)"} \
    dpkg-buildpackage -b -uc -us) >"$log" 2>&1; then
  tail -n 60 "$log"
  echo "package.sh: dpkg-buildpackage failed (the lines above are the end of its log)" >&2
  exit 1
fi
mkdir -p "$out"
cp "$scratch"/*.deb "$scratch"/*.changes "$scratch"/*.buildinfo "$out"/
ls -1 "$out"/*_"$version"_*.deb

if [ $lint -eq 1 ]; then
  echo "== lintian"
  lintian --fail-on error,warning --display-info --show-overrides --tag-display-limit 0 \
    "$out/tallyd_${version}_$(dpkg-architecture -qDEB_HOST_ARCH).changes"
  echo "lintian: no errors, no warnings left unexplained"
fi
echo "tallyd $version: packages in $out"
