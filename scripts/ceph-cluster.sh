#!/usr/bin/env bash
# A single-node Ceph cluster for tests, benchmarks and the demo: one monitor,
# one OSD on file-backed BlueStore, pool `rbd` of size 1, cephx on, and a
# `client.qemu` key with `profile rbd` on that pool (what QEMU uses).
#
#   scripts/ceph-cluster.sh start DIR    start (or report the running cluster)
#   scripts/ceph-cluster.sh stop DIR     stop the daemons, keep the data
#   scripts/ceph-cluster.sh status DIR   exit 0 if it answers
#   scripts/ceph-cluster.sh purge DIR    stop and delete DIR
#
# DIR must be on a file system with O_DIRECT (ext4; not tmpfs: BlueStore
# needs it).  Prints the lines CEPH_CONF=... and QEMU_KEYRING=... on start.
# The monitor listens on $CEPH_ADDR:$CEPH_MON_PORT (default 127.0.0.1:3301,
# a port clear of a real cluster's 3300/6789); client operations give up after
# $CEPH_OP_TIMEOUT seconds (default 20) when a daemon is gone.  With
# CEPH_NETNS=NAME the daemons run in the network namespace /run/netns/NAME
# (CEPH_ADDR is then an address inside it, e.g. behind a shaped veth pair).
# Debian 12: ceph-mon, ceph-osd, ceph-common (scripts/setup-host.sh installs them).
set -euo pipefail

cmd=${1:-}
dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { sed -n '2,18p' "$0" >&2; exit 2; }
port=${CEPH_MON_PORT:-3301}
op_timeout=${CEPH_OP_TIMEOUT:-20}     # seconds before a dead daemon is an I/O error
addr=${CEPH_ADDR:-127.0.0.1}
netns=${CEPH_NETNS:-}
[[ $addr =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]] ||
    { echo "ceph-cluster: CEPH_ADDR $addr is not an IPv4 address" >&2; exit 2; }
if [ -n "$netns" ]; then
    [ -e "/run/netns/$netns" ] ||
        { echo "ceph-cluster: no network namespace /run/netns/$netns" >&2; exit 2; }
    # nsenter, not ip netns exec: that one also remounts /sys and hides cgroups
    inns() { nsenter --net="/run/netns/$netns" "$@"; }
else
    inns() { "$@"; }
fi
[[ $port =~ ^[0-9]+$ ]] && [ "$port" -ge 1024 ] && [ "$port" -le 65535 ] ||
    { echo "ceph-cluster: CEPH_MON_PORT $port is not a port in 1024-65535" >&2; exit 2; }
conf=$dir/ceph.conf
export CEPH_CONF=$conf

need() {
    for b in ceph-mon ceph-osd ceph ceph-authtool monmaptool uuidgen; do
        command -v "$b" >/dev/null ||
            { echo "ceph-cluster: $b is not installed (apt-get install ceph-mon ceph-osd ceph-common uuid-runtime)" >&2; exit 3; }
    done
}

# ceph commands with a bound: a dead monitor must not hang the caller
c() { timeout 30 ceph --connect-timeout 10 "$@"; }

pids() { cat "$dir"/run/*.pid 2>/dev/null || true; }

alive() {
    [ -f "$conf" ] && c -s >/dev/null 2>&1
}

stop() {
    local p left
    for p in $(pids); do kill "$p" 2>/dev/null || true; done
    for _ in $(seq 100); do
        left=
        for p in $(pids); do kill -0 "$p" 2>/dev/null && left=1; done
        [ -z "$left" ] && break
        sleep 0.1
    done
    for p in $(pids); do kill -9 "$p" 2>/dev/null || true; done
    rm -f "$dir"/run/*.pid
}

wait_osd_up() {
    for _ in $(seq 300); do
        if c osd dump 2>/dev/null | grep -q '^osd\.0 up'; then
            return 0
        fi
        sleep 0.1
    done
    echo "ceph-cluster: osd.0 did not come up (see $dir/log)" >&2
    return 1
}

start() {
    need
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    conf=$dir/ceph.conf
    export CEPH_CONF=$conf
    if [ "$(stat -f -c %T "$dir")" = tmpfs ]; then
        echo "ceph-cluster: $dir is on tmpfs; BlueStore needs O_DIRECT (use an ext4 directory)" >&2
        exit 2
    fi
    if alive; then
        # the monitor answers; bring back an OSD that was stopped or died
        if ! kill -0 "$(cat "$dir/run/osd.0.pid" 2>/dev/null || echo 0)" 2>/dev/null; then
            inns ceph-osd -i 0 --pid-file "$dir/run/osd.0.pid"
            wait_osd_up
        fi
        echo "CEPH_CONF=$conf"
        echo "QEMU_KEYRING=$dir/client.qemu.keyring"
        return 0
    fi
    if [ -f "$dir/mon/ceph-a/store.db/CURRENT" ]; then
        # restart an existing cluster
        stop
        inns ceph-mon -i a --pid-file "$dir/run/mon.a.pid"
        inns ceph-osd -i 0 --pid-file "$dir/run/osd.0.pid"
        wait_osd_up
        echo "CEPH_CONF=$conf"
        echo "QEMU_KEYRING=$dir/client.qemu.keyring"
        return 0
    fi
    rm -rf "$dir"/{run,log,mon,osd}
    mkdir -p "$dir"/{run,log,mon,osd/ceph-0}
    local fsid
    fsid=$(uuidgen)
    cat >"$conf" <<EOC
[global]
fsid = $fsid
mon host = v2:$addr:$port
public addr = $addr
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = $dir/\$name.keyring
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon warn on pool no redundancy = false
auth allow insecure global id reclaim = false
osd crush chooseleaf type = 0
run dir = $dir/run
log file = $dir/log/\$name.log
admin socket = $dir/run/\$name.asok
mon data = $dir/mon/\$cluster-\$id
osd data = $dir/osd/\$cluster-\$id
osd objectstore = bluestore
bluestore block create = true
bluestore block size = 4294967296
osd memory target = 1073741824
bluestore cache autotune = false
bluestore cache size = 268435456
mon data avail warn = 1
# a dead OSD or monitor turns into an I/O error after this long, not a hang
rados osd op timeout = $op_timeout
rados mon op timeout = $op_timeout
client mount timeout = $op_timeout

[osd]
# the clients' short deadline is not the OSD's: on a loaded host its first
# authentication with the monitor took longer than 5 s and it exited
client mount timeout = 60
EOC
    {
        ceph-authtool --create-keyring "$dir/mon.a.keyring" --gen-key -n mon. --cap mon 'allow *'
        ceph-authtool --create-keyring "$dir/client.admin.keyring" --gen-key -n client.admin \
            --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *'
        ceph-authtool "$dir/mon.a.keyring" --import-keyring "$dir/client.admin.keyring"
        monmaptool --create --clobber --fsid "$fsid" --addv a "[v2:$addr:$port]" "$dir/monmap"
    } >>"$dir/log/setup.log"
    ceph-mon --mkfs -i a --monmap "$dir/monmap" --keyring "$dir/mon.a.keyring" 2>>"$dir/log/setup.log"
    inns ceph-mon -i a --pid-file "$dir/run/mon.a.pid"
    local uuid id
    uuid=$(uuidgen)
    ceph-authtool --create-keyring "$dir/osd.0.keyring" --gen-key -n osd.0 >>"$dir/log/setup.log"
    id=$(c osd new "$uuid" -i <(echo "{\"cephx_secret\": \"$(ceph-authtool -p -n osd.0 "$dir/osd.0.keyring")\"}"))
    [ "$id" = 0 ] || { echo "ceph-cluster: expected osd id 0, got '$id'" >&2; exit 1; }
    cp "$dir/osd.0.keyring" "$dir/osd/ceph-0/keyring"
    ceph-osd -i 0 --mkfs --osd-uuid "$uuid" 2>>"$dir/log/setup.log" >/dev/null
    inns ceph-osd -i 0 --pid-file "$dir/run/osd.0.pid"
    wait_osd_up
    c osd pool create rbd 16 >/dev/null 2>&1
    timeout 60 rbd pool init rbd
    c auth get-or-create client.qemu mon 'profile rbd' osd 'profile rbd pool=rbd' \
        -o "$dir/client.qemu.keyring" 2>>"$dir/log/setup.log"
    echo "CEPH_CONF=$conf"
    echo "QEMU_KEYRING=$dir/client.qemu.keyring"
}

case $cmd in
start) start ;;
stop) stop ;;
status) alive ;;
purge) stop; rm -rf "$dir" ;;
*) sed -n '2,18p' "$0" >&2; exit 2 ;;
esac
