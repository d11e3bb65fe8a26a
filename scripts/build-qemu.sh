#!/usr/bin/env bash
# Fetch QEMU from Debian's source package, apply qemu-patches/series, overlay our
# sources, configure a minimal x86_64 build and build it with ninja + ccache.
#
# Incremental: the source is fetched once; the working tree is a git checkout of the
# pristine source, so a changed series resets only the files it touched (their mtimes
# move forward and ninja rebuilds exactly those); configure runs again only when the
# configure line changes (meson regenerates itself when a meson.build changes).
#
# Progress: each slow step says that it started and how long it took; ninja's
# "[N/M]" steps are shown as one line rewritten in place on a terminal, and as a
# line at each further 10 % (or after 30 s without one) otherwise, so that CI logs
# stay short.  The full outputs are in build/qemu-{configure,ninja}.log.
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

# begin/end bracket a slow step on one line: "build-qemu: configuring ... 31 s".
open_line=
die() {
    [ -z "$open_line" ] || echo
    echo "build-qemu: $*" >&2
    exit 1
}

# One build at a time per build directory (make, meson and a second shell may race).
mkdir -p "$build"
exec 9>"$build/.qemu-build.lock"
flock 9
log() { echo "build-qemu: $*"; }
now() { printf -v "$1" %s "${EPOCHREALTIME//[!0-9]/}"; }  # microseconds, into the variable named $1
dur() {  # time since $1 (from now) as people read it: "41 s", "2 min 50 s"
    local t s
    now t
    s=$(((t - $1 + 500000) / 1000000))
    if [ "$s" -ge 60 ]; then echo "$((s / 60)) min $((s % 60)) s"; else echo "$s s"; fi
}
begin() { printf 'build-qemu: %s ... ' "$*"; now open_line; }
end() { echo "$(dur "$open_line")"; open_line=; }

# 1. Fetch (once).
if [ ! -f "$pristine/VERSION" ]; then
    # No pipeline into grep -q: with pipefail, its early exit (SIGPIPE upstream)
    # would read as "not offered".
    offered=$(apt-cache showsrc qemu 2>/dev/null | sed -n 's/^Version: //p' | sort -u)
    if ! grep -qxF "$QEMU_DEB_VERSION" <<<"$offered"; then
        die "Debian no longer offers source package qemu=$QEMU_DEB_VERSION (offered: $(echo $offered)); our patches are written against it"
    fi
    mkdir -p "$build/src"
    begin "fetching QEMU: apt-get source qemu=$QEMU_DEB_VERSION (40 MB)"
    (cd "$build/src" && apt-get source -q "qemu=$QEMU_DEB_VERSION") >"$build/src/fetch.log" 2>&1 ||
        { echo; open_line=; cat "$build/src/fetch.log" >&2; die "apt-get source qemu=$QEMU_DEB_VERSION failed"; }
    end
fi
[ "$(cat "$pristine/VERSION")" = "10.0.13" ] || die "unexpected QEMU version $(cat "$pristine/VERSION") in $pristine"

# 2. Working tree: a git repository whose first commit is the pristine source.
git_q() { git -C "$tree" -c user.name=build -c user.email=build@localhost -c advice.detachedHead=false "$@"; }
if [ ! -d "$tree/.git" ]; then
    begin "creating the git working tree $tree"
    rm -rf "$tree"
    cp -a "$pristine" "$tree"
    git_q init -q -b work
    git_q add -A -f .
    git_q commit -q -m "Debian qemu $QEMU_DEB_VERSION"
    git_q tag pristine
    printf '%s\n' /block/hybrid /migration/app-assist /.series-hash >>"$tree/.git/info/exclude"
    end
fi

# 3. Patches: re-apply only when the series (or any patch in it) changed.
mapfile -t patches < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$top/qemu-patches/series")
series_hash=$( (cat "$top/qemu-patches/series"; for p in "${patches[@]}"; do cat "$top/qemu-patches/$p"; done) | sha256sum | cut -c1-16)
if [ "$(cat "$tree/.series-hash" 2>/dev/null)" != "$series_hash" ]; then
    begin "applying qemu-patches/series (${#patches[@]} patches)"
    git_q am --abort >/dev/null 2>&1 || true
    git_q reset -q --hard pristine
    for p in "${patches[@]}"; do
        [ -f "$top/qemu-patches/$p" ] || die "qemu-patches/series names $p, which does not exist"
        if ! git_q am -q --keep-cr "$top/qemu-patches/$p" >"$build/qemu-am.log" 2>&1; then
            git_q am --abort >/dev/null 2>&1 || true
            echo; open_line=
            cat "$build/qemu-am.log" >&2
            die "patch qemu-patches/$p does not apply to QEMU $QEMU_DEB_VERSION"
        fi
    done
    echo "$series_hash" >"$tree/.series-hash"
    end
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
# What a server needs of Debian's qemu-system-x86 (issue 38): displays libvirt
# domains use (VNC, SPICE), seccomp (-sandbox), TLS for migration and NBD,
# libcap-ng, vhost, NUMA, the common image formats; and FUSE exports, the
# hybrid volume's way to a block device where the kernel has no nbd/ublk/VDUSE.
# The version string is stable (a changed configure line rebuilds everything).
# TLS: GnuTLS's NORMAL, with ChaCha20-Poly1305 moved behind the AES-GCM suites.
# A TLS 1.3 session keyed by a PSK (the hybrid mirror's NBD link, tls-creds-psk)
# is bound to SHA-256, which rules out TLS_AES_256_GCM_SHA384, and NORMAL's
# next suite is TLS_CHACHA20_POLY1305_SHA256, computed in software, where
# AES-128-GCM runs on AES-NI: mirrored 4 KiB writes at QD1 ran 1.19x faster on
# AES-128-GCM (docs/hybrid.md, "The mirror's link"; bench/hybrid-mirror.py).
# X.509 sessions still pick AES-256-GCM first; a tls-creds object's priority=
# overrides this default.
project_version=$(sed -n "s/^ *version: '\(.*\)',/\1/p" "$top/meson.build" | head -1)
config=(--target-list=x86_64-softmmu --without-default-features --enable-tcg --enable-kvm
        --enable-tools --enable-linux-aio --enable-linux-io-uring --enable-rbd --enable-slirp --enable-pixman
        --enable-fdt=system --disable-docs --disable-install-blobs --disable-download
        --enable-vnc --enable-vnc-jpeg --enable-png --enable-spice --enable-spice-protocol
        --enable-gnutls --enable-seccomp --enable-cap-ng --enable-attr --enable-numa --enable-zstd
        --enable-vhost-kernel --enable-vhost-net --enable-vhost-user --enable-vhost-user-blk-server
        --enable-fuse --enable-fuse-lseek --enable-malloc-trim
        --enable-qcow1 --enable-vdi --enable-vhdx --enable-vmdk --enable-vpc --enable-qed
        --enable-bochs --enable-cloop --enable-dmg --enable-parallels
        --tls-priority=NORMAL:-CHACHA20-POLY1305:+CHACHA20-POLY1305
        --with-pkgversion="hybridvm $project_version, Debian $QEMU_DEB_VERSION"
        --firmwarepath=/usr/share/qemu:/usr/share/seabios:/usr/lib/ipxe/qemu
        --python="$venv/bin/python3" --cc="ccache gcc" --host-cc="ccache gcc")
config_hash=$(printf '%s\n' "${config[@]}" | sha256sum | cut -c1-16)
if [ ! -f "$objdir/build.ninja" ] || [ "$(cat "$objdir/.config-hash" 2>/dev/null)" != "$config_hash" ]; then
    begin "configuring (log: $build/qemu-configure.log)"
    rm -rf "$objdir"
    mkdir -p "$objdir"
    (cd "$objdir" && "$tree/configure" "${config[@]}") >"$build/qemu-configure.log" 2>&1 ||
        { echo; open_line=; tail -40 "$build/qemu-configure.log" >&2
          die "configure failed (full log: $build/qemu-configure.log)"; }
    echo "$config_hash" >"$objdir/.config-hash"
    end
fi

# 6. Build.
# progress: reads ninja's output (a copy is in the log already) and shows its
# "[N/M] description" lines once there is work (qemu-version.h alone, which is
# regenerated on every run, is none): on a terminal ($cols wide) as one line
# rewritten in place, otherwise a line at each further 10 % of a large build or
# after 30 s without one.  Ends with a summary line.
progress() {
    local line n=0 m=0 pct decile=0 start t last=$SECONDS text seen=
    now start
    local width=$((cols - 1))
    while IFS= read -r line; do
        [[ $line =~ ^\[([0-9]+)/([0-9]+)\]\ (.*)$ ]] || continue
        n=${BASH_REMATCH[1]} m=${BASH_REMATCH[2]}
        [ "$m" -gt 0 ] || continue
        if [ -z "$seen" ]; then
            [[ ${BASH_REMATCH[3]} != "Generating qemu-version.h "* ]] || continue
            log "building with ninja (log: $build/qemu-ninja.log)"
            seen=1
        fi
        pct=$((n * 100 / m))
        if [ "$tty" = 1 ]; then
            now t
            printf -v text 'build-qemu: [%d/%d] %d %% %d:%02d %s' "$n" "$m" "$pct" \
                $(((t - start) / 60000000)) $(((t - start) / 1000000 % 60)) "${BASH_REMATCH[3]}"
            printf '\r%-*.*s' "$width" "$width" "$text"
        elif [ "$n" -lt "$m" ] && { [ "$m" -ge 100 ] && [ $((pct / 10)) -gt "$decile" ] ||
                                    [ $((SECONDS - last)) -ge 30 ]; }; then
            decile=$((pct / 10)) last=$SECONDS
            echo "build-qemu: [$n/$m] $pct % after $(dur "$start")"
        fi
    done
    [ "$tty" = 0 ] || printf '\r%-*s\r' "$width" ''
    if [ "$seen" ]; then
        echo "build-qemu: ninja ran $n of $m steps in $(dur "$start")"
    fi
}
tty=0 cols=80
if [ -t 1 ]; then
    tty=1
    # stty reads the terminal's size from its stdin: our stdout, not the substitution's pipe.
    { size=$(stty size <&3 2>/dev/null) || size=; } 3>&1
    [ "${size#* }" -ge 20 ] 2>/dev/null && cols=${size#* }
fi

targets=(qemu-system-x86_64 qemu-img qemu-io qemu-nbd storage-daemon/qemu-storage-daemon)
# Paths relative to the build dir and no cwd in the hash: separate build dirs
# (one per engineer or CI job) share one cache.
export CCACHE_DIR=${CCACHE_DIR:-$build/ccache} CCACHE_BASEDIR=$build CCACHE_NOHASHDIR=1
if ! NINJA_STATUS='[%f/%t] ' ninja -C "$objdir" "${targets[@]}" 2>&1 | tee "$build/qemu-ninja.log" | progress; then
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
