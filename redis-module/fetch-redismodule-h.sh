#!/bin/sh
# Fetch redismodule.h from Debian bookworm's redis source package into OUTDIR.
# Usage: fetch-redismodule-h.sh OUTDIR
# Cached: once OUTDIR/redismodule.h exists nothing is downloaded again.
# The header is never committed (see docs/redis-module.md); it must match the
# redis-server the module runs in (bookworm ships 7.0.15).
set -eu
out=$1
version=${REDIS_SRC_VERSION:-5:7.0.15-1~deb12u7}
if [ -s "$out/redismodule.h" ]; then
    echo "$out/redismodule.h"
    exit 0
fi
mkdir -p "$out/src"
cd "$out/src"
if ! ls redis_*.dsc >/dev/null 2>&1; then
    if ! apt-get source --download-only "redis=$version" >apt.log 2>&1; then
        echo "fetch-redismodule-h: 'apt-get source redis=$version' failed (see $out/src/apt.log);" >&2
        echo "offered versions: $(apt-cache showsrc redis 2>/dev/null | sed -n 's/^Version: //p' | tr '\n' ' ')" >&2
        echo "(setup-host.sh configures the bookworm deb-src entry)" >&2
        exit 1
    fi
fi
dsc=$(ls redis_*.dsc | head -n1)
rm -rf tree
dpkg-source --no-check -x "$dsc" tree >dpkg-source.log 2>&1
cp tree/src/redismodule.h "$out/redismodule.h.tmp"
mv "$out/redismodule.h.tmp" "$out/redismodule.h"
rm -rf tree
echo "$out/redismodule.h"
