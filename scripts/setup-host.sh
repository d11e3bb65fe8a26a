#!/usr/bin/env bash
# Install everything the build, the guest image and the tests need on a Debian 12 host.
# Idempotent: a stamp keyed on this file's contents skips the work on re-runs.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$top/build}
stamp=$build/.stamps/setup-host.$(sha256sum "$0" "$top/scripts/requirements.txt" | sha256sum | cut -c1-16)

if [ -e "$stamp" ]; then
    exit 0
fi

SUDO=
[ "$(id -u)" -eq 0 ] || SUDO=sudo

# deb-src entries: QEMU from trixie (pinned version), Redis from bookworm (redismodule.h).
$SUDO tee /etc/apt/sources.list.d/hybridvm-src.sources >/dev/null <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends \
    build-essential dpkg-dev pkg-config ccache ninja-build flex bison \
    python3 python3-venv python3-dev \
    libglib2.0-dev libpixman-1-dev libslirp-dev liburing-dev libaio-dev libfdt-dev \
    libfuse3-dev fuse3 libgnutls28-dev libseccomp-dev libcap-ng-dev libnuma-dev libspice-server-dev \
    libpng-dev libjpeg-dev libzstd-dev libattr1-dev \
    seabios qemu-system-data ipxe-qemu \
    busybox-static cpio e2fsprogs kmod xz-utils zstd \
    redis-server redis-tools libhiredis-dev tcl \
    fio podman runc uidmap fuse-overlayfs mmdebstrap \
    debhelper dh-python lintian python3-docutils systemd-container \
    ceph-mon ceph-osd ceph-common librbd-dev uuid-runtime \
    libvirt-daemon-system libvirt-clients libvirt-daemon-driver-qemu python3-libvirt apparmor

# Post-copy migration with QEMU as libvirt-qemu (libvirt's default) needs
# userfaultfd for unprivileged processes: libvirt's own sysctl file, which
# upstream installs and Debian 12 ships only as an example.
$SUDO install -m 0644 /usr/share/doc/libvirt-daemon-system/examples/qemu-postcopy-migration.sysctl \
    /etc/sysctl.d/60-qemu-postcopy-migration.conf
$SUDO sysctl -q -p /etc/sysctl.d/60-qemu-postcopy-migration.conf

# Python venv with pinned packages: meson for QEMU's configure, avocado for the functional tests.
venv=$build/venv
if [ ! -x "$venv/bin/python3" ]; then
    /usr/bin/python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check -r "$top/scripts/requirements.txt"

mkdir -p "$(dirname "$stamp")"
touch "$stamp"
