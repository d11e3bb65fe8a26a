#!/usr/bin/env bash
# Build the test guest into build/guest/ without any network access from the guest side:
#   vmlinuz      Debian's cloud kernel (from its package)
#   initrd.img   busybox + virtio modules + redis-server (+ libraries) + our Redis module + tests/guest/init
#   rootfs.ext4  the same tree as an ext4 root disk (mkfs.ext4 -d), for booting from a disk image
# Deterministic and cached: rebuilt only when an input (kernel package, busybox, redis-server,
# the module, the init script, this script) changes.  Each step prints a line with
# its duration (about 6 s in all on the build machine, plus the kernel's download
# the first time).
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$top/build}
out=$build/guest
module=${HYBRIDMEM_SO:-$build/redis-module/hybridmem.so}
export SOURCE_DATE_EPOCH=1700000000

# begin/end bracket a step on one line: "build-guest: unpacking the kernel ... 1.8 s".
open_line=
die() {
    [ -z "$open_line" ] || echo
    echo "build-guest: $*" >&2
    exit 1
}
now() { printf -v "$1" %s "${EPOCHREALTIME//[!0-9]/}"; }  # microseconds, into the variable named $1
since() {  # time since $1 (from now): "1.8 s"
    local t
    now t
    t=$(((t - $1 + 50000) / 100000))
    echo "$((t / 10)).$((t % 10)) s"
}
begin() { printf 'build-guest: %s ... ' "$*"; now open_line; }
end() { since "$open_line"; open_line=; }

# The kernel: the version the cloud meta-package currently depends on.
# (sed quits at the first match: no `| head` whose early exit pipefail would see)
kpkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-[^ ]*-cloud-amd64\)$/\1/p;T;q')
[ -n "$kpkg" ] || die "cannot find the Debian cloud kernel package (apt-cache depends linux-image-cloud-amd64)"
kver_pkg=$(apt-cache policy "$kpkg" | sed -n 's/^ *Candidate: //p')

redis_bin=$(command -v redis-server) || die "redis-server is not installed (scripts/setup-host.sh installs it)"
busybox=/bin/busybox
[ -x "$busybox" ] || die "busybox-static is not installed"
inputs=$( { echo "$kpkg $kver_pkg"; sha256sum "$0" "$top/tests/guest/init" "$busybox" "$redis_bin" "$(command -v redis-cli)";
            if [ -f "$module" ]; then sha256sum "$module"; fi; } | sha256sum | cut -c1-16)
if [ "$(cat "$out/.inputs" 2>/dev/null)" = "$inputs" ] && [ -f "$out/initrd.img" ] && [ -f "$out/rootfs.ext4" ]; then
    exit 0
fi

now started
echo "build-guest: building guest ($kpkg $kver_pkg)"
work=$build/guest-work
rm -rf "$work"
mkdir -p "$work/deb" "$out" "$build/src"

# Kernel package: fetched once per version.
debs=("$build"/src/"$kpkg"_*.deb)
if [ ! -f "${debs[0]}" ]; then
    begin "downloading $kpkg"
    (cd "$build/src" && apt-get download -q "$kpkg") >/dev/null 2>&1 || die "apt-get download $kpkg failed"
    end
    debs=("$build"/src/"$kpkg"_*.deb)
fi
deb=${debs[0]}
begin "unpacking the kernel package"
dpkg-deb -x "$deb" "$work/deb"
kver=$(ls "$work/deb/lib/modules")
cp "$work/deb/boot/vmlinuz-$kver" "$out/vmlinuz"
end

begin "collecting busybox, the virtio modules, redis-server and the module"
root=$work/root
mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,etc,proc,sys,dev,tmp,run,var/lib/redis,opt/hybridvm,newroot,root}

# busybox and its applets.
cp "$busybox" "$root/bin/busybox"
for applet in $("$busybox" --list); do
    [ -e "$root/bin/$applet" ] || ln -s busybox "$root/bin/$applet"
done

# Kernel modules: the virtio drivers and everything they depend on.
kmods=$work/deb/lib/modules/$kver
depmod -b "$work/deb" "$kver"
want="virtio_pci virtio_blk virtio_net virtio_balloon virtio_console"
declare -A seen=()
add_mod() {
    local name=$1 path dep
    path=$(modinfo -b "$work/deb" -k "$kver" -n "$name") || die "kernel $kver has no module $name"
    case "$path" in /*) ;; *) path=$kmods/$path ;; esac
    [ -n "${seen[$path]:-}" ] && return
    seen[$path]=1
    mkdir -p "$root/lib/modules/$kver/$(dirname "${path#$kmods/}")"
    cp "$path" "$root/lib/modules/$kver/${path#$kmods/}"
    for dep in $(modinfo -b "$work/deb" -k "$kver" -F depends "$name" | tr ',' ' '); do
        add_mod "$dep"
    done
}
for m in $want; do add_mod "$m"; done
cp "$kmods"/modules.order "$kmods"/modules.builtin "$kmods"/modules.builtin.modinfo "$root/lib/modules/$kver/" 2>/dev/null || true
depmod -b "$root" "$kver"

# redis-server, redis-cli and their shared libraries.
copy_bin() {
    local bin=$1 lib
    install -D -m 0755 "$(readlink -f "$bin")" "$root/usr/bin/$(basename "$bin")"
    for lib in $(ldd "$bin" | awk '/=> \//{print $3} /^\t\/lib/{print $1}'); do
        [ -e "$root$lib" ] || install -D -m 0755 "$(readlink -f "$lib")" "$root$lib"
    done
}
copy_bin "$redis_bin"
copy_bin "$(command -v redis-cli)"
[ -e "$root/lib64/ld-linux-x86-64.so.2" ] || install -D -m 0755 /lib64/ld-linux-x86-64.so.2 "$root/lib64/ld-linux-x86-64.so.2"
if [ -f "$module" ]; then
    install -m 0755 "$module" "$root/opt/hybridvm/hybridmem.so"
    for lib in $(ldd "$module" | awk '/=> \//{print $3}'); do
        [ -e "$root$lib" ] || install -D -m 0755 "$(readlink -f "$lib")" "$root$lib"
    done
fi
echo "root:x:0:0:root:/root:/bin/sh" >"$root/etc/passwd"
echo "root:x:0:" >"$root/etc/group"
install -m 0755 "$top/tests/guest/init" "$root/init"
end

# Reproducible archives: fixed mtimes, sorted entries.
begin "writing initrd.img"
find "$root" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
(cd "$root" && find . -print0 | LC_ALL=C sort -z | cpio --null --reproducible -o -H newc --quiet) | gzip -n -1 >"$out/initrd.img.tmp"
mv "$out/initrd.img.tmp" "$out/initrd.img"
end
begin "writing rootfs.ext4"
rm -f "$out/rootfs.ext4"
# (its stdout only says "Creating regular file"; errors go to stderr)
E2FSPROGS_FAKE_TIME=$SOURCE_DATE_EPOCH mkfs.ext4 -q -F -L hvroot -U 6f1d3c58-3c9b-4a5e-9d3e-6a1f0b2c4d5e \
    -E root_owner=0:0,hash_seed=2b8c7a1e-5d4f-4e3a-9b2c-1d0e9f8a7b6c -d "$root" "$out/rootfs.ext4" 256M >/dev/null
end
echo "$kver" >"$out/kernel-version"
echo "$inputs" >"$out/.inputs"
rm -rf "$work"
echo "build-guest: guest ready in $out (kernel $kver) after $(since "$started")"
