#!/bin/sh
# Full clones of an RBD snapshot made by the OSDs: the data never passes
# through this host (docs/ceph.md, "Full clones"; measured in
# docs/bench/full-clones.md).
#
#   scripts/rbd-full-clone.sh [-j JOBS] POOL/IMAGE@SNAP POOL/NEW...
#
# Each NEW is created with the snapshot's size and object size, then every
# data object the snapshot has is copied into it by RADOS's copy-from
# operation (`rados cp`): the OSD that stores the new object reads the
# source object itself, so only a small request per object crosses this
# host's link.  JOBS objects are copied at a time over all the NEWs
# (default 8).  Last, the new images' object maps are rebuilt (they were
# written behind librbd's back).  Each NEW is then a plain image with no
# parent, complete and usable.
#
# copy-from copies an object's head, so the image must not have changed
# since SNAP (a golden image that nothing writes): the script checks that
# `rbd diff --from-snap SNAP` is empty and refuses otherwise.  Images with
# a separate data pool or fancy striping are refused too.  On a failure the
# NEWs made so far are removed.  Runs as a client with read access to
# POOL's objects and write access to the NEWs' pools (client.admin, or
# `profile rbd` on both pools).
set -eu

jobs=8
if [ "${1:-}" = -j ]; then
    jobs=${2:?-j needs a number}
    shift 2
fi
case $jobs in ''|*[!0-9]*|0) echo "rbd-full-clone: -j $jobs is not a positive number" >&2; exit 2 ;; esac
[ $# -ge 2 ] || { sed -n '2,23p' "$0" >&2; exit 2; }
src=$1
shift
case $src in
*/*@*) ;;
*) echo "rbd-full-clone: $src is not POOL/IMAGE@SNAP" >&2; exit 2 ;;
esac
pool=${src%%/*}
image=${src#*/}
snap=${image#*@}
image=${image%@*}

# one field of `rbd info --format json` (numbers and strings without commas)
field() {
    printf '%s\n' "$1" | tr ',{}' '\n\n\n' | sed -n "s/^\"$2\":\"\{0,1\}\([^\"]*\)\"\{0,1\}\$/\1/p"
}

info=$(rbd info --format json "$src")
size=$(field "$info" size)
osize=$(field "$info" object_size)
prefix=$(field "$info" block_name_prefix)
[ -n "$size" ] && [ -n "$osize" ] && [ -n "$prefix" ] ||
    { echo "rbd-full-clone: cannot read size, object size and prefix of $src" >&2; exit 1; }
if [ -n "$(field "$info" data_pool)" ]; then
    echo "rbd-full-clone: $src has a separate data pool: not supported" >&2; exit 1
fi
if [ -n "$(field "$info" stripe_count)" ] && [ "$(field "$info" stripe_count)" != 1 ]; then
    echo "rbd-full-clone: $src uses fancy striping: not supported" >&2; exit 1
fi
if [ -n "$(rbd diff --from-snap "$snap" "$pool/$image")" ]; then
    echo "rbd-full-clone: $pool/$image was written after @$snap; copy-from copies" \
         "the head, so the clones would not be the snapshot" >&2
    exit 1
fi

made=
cleanup() {
    for d in $made; do rbd rm --no-progress "$d" >/dev/null 2>&1 || true; done
}
trap 'cleanup; exit 1' INT TERM

# the numbers of the objects the snapshot has data in, from its extents
objects=$(rbd diff --format json "$src" | tr '{' '\n' |
    sed -n 's/.*"offset":\([0-9]*\),"length":\([0-9]*\).*/\1 \2/p' |
    awk -v os="$osize" '{ for (o = int($1 / os); o * os < $1 + $2; o++) print o }' |
    sort -nu)

list=
for dst in "$@"; do
    case $dst in
    */*) ;;
    *) echo "rbd-full-clone: $dst is not POOL/IMAGE" >&2; cleanup; exit 2 ;;
    esac
    rbd create --size "${size}B" --object-size "${osize}B" "$dst" || { cleanup; exit 1; }
    made="$made $dst"
    to=$(field "$(rbd info --format json "$dst")" block_name_prefix)
    for o in $objects; do
        n=$(printf '%016x' "$o")
        list="$list$prefix.$n ${dst%%/*} $to.$n
"
    done
done

# JOBS copies at a time; each is one copy-from request that the OSD serves
if ! printf '%s' "$list" |
        xargs -r -P "$jobs" -n 3 sh -c 'exec rados --admin-socket= -p "$0" cp --target-pool "$2" "$1" "$3"' "$pool"; then
    echo "rbd-full-clone: copying the objects of $src failed; removing$made" >&2
    cleanup
    exit 1
fi
# the object maps say which objects exist: rebuilt from the objects, at once
pids=
for dst in "$@"; do
    if rbd info "$dst" | grep -q '^[[:space:]]*features:.*object-map'; then
        rbd --admin-socket= object-map rebuild --no-progress "$dst" &
        pids="$pids $!"
    fi
done
for p in $pids; do
    wait "$p" || { echo "rbd-full-clone: rebuilding an object map failed; removing$made" >&2
                   cleanup; exit 1; }
done
