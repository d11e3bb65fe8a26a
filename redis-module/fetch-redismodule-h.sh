#!/bin/sh
# Fetch redismodule.h from Debian bookworm's redis source package into OUTDIR.
# Usage: fetch-redismodule-h.sh OUTDIR            -> prints OUTDIR/redismodule.h
#        fetch-redismodule-h.sh OUTDIR --tests    -> prints OUTDIR/suite
# --tests unpacks Redis's own test suite (runtest, tests/) of the same package
# into OUTDIR/suite instead, for redis-module/tests/test_redis_suite.py.
# Cached: once the file or directory exists nothing is downloaded again.
# Neither is ever committed (see docs/redis-module.md); they must match the
# redis-server the module runs in (bookworm ships 7.0.15).
set -eu
mkdir -p "$1"
out=$(cd "$1" && pwd)
what=${2:-header}
version=${REDIS_SRC_VERSION:-5:7.0.15-1~deb12u7}
if [ "$what" = --tests ]; then
    done_mark="$out/suite/.version"
    if [ -f "$done_mark" ] && [ "$(cat "$done_mark")" = "$version" ]; then
        echo "$out/suite"
        exit 0
    fi
elif [ -s "$out/redismodule.h" ]; then
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
if [ "$what" = --tests ]; then
    rm -rf "$out/suite"
    mkdir -p "$out/suite.tmp"
    cp -a tree/runtest tree/tests "$out/suite.tmp/"
    # The suite names the binaries by their place in a source tree; in
    # external mode it starts none, but a few helpers still look there.
    mkdir -p "$out/suite.tmp/src"
    for b in redis-server redis-cli redis-benchmark redis-check-aof redis-check-rdb; do
        ln -s "/usr/bin/$b" "$out/suite.tmp/src/$b"
    done
    echo "$version" >"$out/suite.tmp/.version"
    mv "$out/suite.tmp" "$out/suite"
    rm -rf tree
    echo "$out/suite"
    exit 0
fi
cp tree/src/redismodule.h "$out/redismodule.h.tmp"
mv "$out/redismodule.h.tmp" "$out/redismodule.h"
rm -rf tree
echo "$out/redismodule.h"
