#!/usr/bin/env bash
# Debian packages of hybridvm from the built tree (make deb; docs/deploy.md
# "Packages"): debian/ is copied into build/debs.stage/src with a changelog of this
# version, debian/rules stages `make install PREFIX=/usr` there, and
# dpkg-buildpackage writes the .debs, which land in build/debs/ (or $1).
# Nothing is compiled: build first (make); make deb does.
#
# Version: QEMU's base, our project version, then git describe's count and
# commit: 10.0.13+hv0.1.0+git1234.gc92c760, Debian revision
# $HYBRIDVM_DEB_REVISION (default 1; the upgrade test builds 1 and 2).
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$top/build}
out=$(realpath -m "${1:-$build/debs}")
revision=${HYBRIDVM_DEB_REVISION:-1}
[[ $revision =~ ^[0-9][0-9a-z.+~]*$ ]] || { echo "build-debs: bad HYBRIDVM_DEB_REVISION $revision" >&2; exit 2; }

qemu=$(cat "$build/qemu-src/VERSION" 2>/dev/null) ||
    { echo "build-debs: $build/qemu-src/VERSION is missing: build first (make)" >&2; exit 1; }
project=$(sed -n "s/^ *version: '\(.*\)',/\1/p" "$top/meson.build" | head -1)
if desc=$(git -C "$top" describe --tags --long --match 'v[0-9]*' 2>/dev/null); then
    # v0.2.0-12-gabcdef0: the tag is the project version
    count=${desc%-g*}; count=${count##*-}; commit=${desc##*-}
else
    count=$(git -C "$top" rev-list --count HEAD); commit=g$(git -C "$top" rev-parse --short=7 HEAD)
fi
version=$qemu+hv$project+git$count.$commit-$revision

stage=$out.stage     # one per output directory: two builds at once do not meet
rm -rf "$stage"
mkdir -p "$stage/src"
cp -a "$top/debian" "$stage/src/debian"
cat >"$stage/src/debian/changelog" <<CL
hybridvm ($version) unstable; urgency=medium

  * Built from commit $(git -C "$top" rev-parse --short=12 HEAD)$(git -C "$top" diff --quiet HEAD -- 2>/dev/null || echo ', with uncommitted changes').

 -- hybridvm developers <dev@hybridvm.org>  $(date -R)
CL

start=$SECONDS
echo "build-debs: hybridvm $version"
(cd "$stage/src" && HYBRIDVM_TOP=$top dpkg-buildpackage --build=binary --no-sign) \
    >"$stage/build.log" 2>&1 || { tail -40 "$stage/build.log" >&2; echo "build-debs: failed (log: $stage/build.log)" >&2; exit 1; }
mkdir -p "$out"
rm -f "$out"/*.deb "$out"/*.changes "$out"/*.buildinfo
mv "$stage"/*.deb "$stage"/*.changes "$stage"/*.buildinfo "$out"/
rm -rf "$stage"
echo "build-debs: $(ls "$out"/*.deb | wc -l) packages in $out ($((SECONDS - start)) s)"
