#!/usr/bin/env bash
# Fetch QEMU from Debian's source package, apply qemu-patches/series, overlay our
# sources, configure a minimal x86_64 build and build it with ninja + ccache.
#
# Incremental: the source is fetched once; the working tree is a git checkout of the
# pristine source, so a changed series resets only the files it touched (their mtimes
# move forward and ninja rebuilds exactly those); configure runs again only when the
# configure line changes (meson regenerates itself when a meson.build changes).
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$top/build}
QEMU_DEB_VERSION=1:10.0.13+ds-0+deb13u1
upstream=10.0.13+ds
pristine=$build/src/qemu-$upstream
tree=$build/qemu-src
objdir=$build/qemu-build
venv=$build/venv
stamp=
if [ "${1:-}" = --stamp ]; then stamp=$2; fi

die() { echo "build-qemu: $*" >&2; exit 1; }

# One build at a time per build directory (make, meson and a second shell may race).
mkdir -p "$build"
exec 9>"$build/.qemu-build.lock"
flock 9
log() { echo "build-qemu: $*"; }

# 1. Fetch (once).
if [ ! -f "$pristine/VERSION" ]; then
    # No pipeline into grep -q: with pipefail, its early exit (SIGPIPE upstream)
    # would read as "not offered".
    offered=$(apt-cache showsrc qemu 2>/dev/null | sed -n 's/^Version: //p' | sort -u)
    if ! grep -qxF "$QEMU_DEB_VERSION" <<<"$offered"; then
        die "Debian no longer offers source package qemu=$QEMU_DEB_VERSION (offered: $(echo $offered)); our patches are written against it"
    fi
    mkdir -p "$build/src"
    (cd "$build/src" && apt-get source -q "qemu=$QEMU_DEB_VERSION") >"$build/src/fetch.log" 2>&1 ||
        { cat "$build/src/fetch.log" >&2; die "apt-get source qemu=$QEMU_DEB_VERSION failed"; }
fi
[ "$(cat "$pristine/VERSION")" = "10.0.13" ] || die "unexpected QEMU version $(cat "$pristine/VERSION") in $pristine"

# 2. Working tree: a git repository whose first commit is the pristine source.
git_q() { git -C "$tree" -c user.name=build -c user.email=build@localhost -c advice.detachedHead=false "$@"; }
if [ ! -d "$tree/.git" ]; then
    log "creating working tree $tree"
    rm -rf "$tree"
    cp -a "$pristine" "$tree"
    git_q init -q -b work
    git_q add -A -f .
    git_q commit -q -m "Debian qemu $QEMU_DEB_VERSION"
    git_q tag pristine
    printf '%s\n' /block/hybrid /migration/app-assist /.series-hash >>"$tree/.git/info/exclude"
fi

# 3. Patches: re-apply only when the series (or any patch in it) changed.
mapfile -t patches < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$top/qemu-patches/series")
series_hash=$( (cat "$top/qemu-patches/series"; for p in "${patches[@]}"; do cat "$top/qemu-patches/$p"; done) | sha256sum | cut -c1-16)
if [ "$(cat "$tree/.series-hash" 2>/dev/null)" != "$series_hash" ]; then
    log "applying qemu-patches/series (${#patches[@]} patches)"
    git_q am --abort >/dev/null 2>&1 || true
    git_q reset -q --hard pristine
    for p in "${patches[@]}"; do
        [ -f "$top/qemu-patches/$p" ] || die "qemu-patches/series names $p, which does not exist"
        if ! git_q am -q --keep-cr "$top/qemu-patches/$p" >"$build/qemu-am.log" 2>&1; then
            git_q am --abort >/dev/null 2>&1 || true
            cat "$build/qemu-am.log" >&2
            die "patch qemu-patches/$p does not apply to QEMU $QEMU_DEB_VERSION"
        fi
    done
    echo "$series_hash" >"$tree/.series-hash"
fi

# 4. Overlay: our sources stay the single source of truth; the QEMU tree links to them.
overlay() {  # overlay <our dir> <dir inside QEMU tree>
    local src=$top/$1 dst=$tree/$2
    [ -d "$src" ] || return 0
    if [ "$(readlink "$dst" 2>/dev/null)" != "$src" ]; then
        rm -rf "$dst"
        ln -s "$src" "$dst"
    fi
}
overlay block block/hybrid
overlay migration/app-assist migration/app-assist

# 5. Configure (only when the configure line changed).
config=(--target-list=x86_64-softmmu --without-default-features --enable-tcg --enable-kvm
        --enable-tools --enable-linux-aio --enable-linux-io-uring --enable-slirp --enable-pixman
        --enable-fdt=system --disable-docs --disable-install-blobs --disable-download
        --firmwarepath=/usr/share/qemu:/usr/share/seabios:/usr/lib/ipxe/qemu
        --python="$venv/bin/python3" --cc="ccache gcc" --host-cc="ccache gcc")
config_hash=$(printf '%s\n' "${config[@]}" | sha256sum | cut -c1-16)
if [ ! -f "$objdir/build.ninja" ] || [ "$(cat "$objdir/.config-hash" 2>/dev/null)" != "$config_hash" ]; then
    log "configuring"
    rm -rf "$objdir"
    mkdir -p "$objdir"
    (cd "$objdir" && "$tree/configure" "${config[@]}") >"$build/qemu-configure.log" 2>&1 ||
        { tail -40 "$build/qemu-configure.log" >&2; die "configure failed (full log: $build/qemu-configure.log)"; }
    echo "$config_hash" >"$objdir/.config-hash"
fi

# 6. Build.
targets=(qemu-system-x86_64 qemu-img qemu-io qemu-nbd storage-daemon/qemu-storage-daemon)
# Paths relative to the build dir and no cwd in the hash: separate build dirs
# (one per engineer or CI job) share one cache.
export CCACHE_DIR=${CCACHE_DIR:-$build/ccache} CCACHE_BASEDIR=$build CCACHE_NOHASHDIR=1
if ! ninja -C "$objdir" "${targets[@]}" >"$build/qemu-ninja.log" 2>&1; then
    grep -v '^\[[0-9]*/[0-9]*\]' "$build/qemu-ninja.log" | tail -60 >&2
    die "ninja failed (full log: $build/qemu-ninja.log)"
fi

mkdir -p "$build/bin"
for t in "${targets[@]}"; do
    [ -x "$objdir/$t" ] || die "build produced no $t"
    ln -sfn "$objdir/$t" "$build/bin/$(basename "$t")"
done
[ -z "$stamp" ] || touch "$stamp"
log "QEMU ready in $build/bin"
