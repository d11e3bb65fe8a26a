#!/usr/bin/env bash
# Run every benchmark under bench/ (each compares against its baseline in the same
# run and writes a markdown table and a PNG chart into docs/bench/).
#   make bench                 all of them
#   make bench BENCH=hybrid    only bench/hybrid*
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$top/build}
export HYBRIDVM_BUILD=$build
export PYTHONPATH=$build/qemu-src/python:$top/tests${PYTHONPATH:+:$PYTHONPATH}

mapfile -t benches < <(cd "$top" && ls bench/${BENCH:-}*.py bench/${BENCH:-}*.sh 2>/dev/null | sort)
if [ "${#benches[@]}" -eq 0 ]; then
    echo "bench: no benchmarks match bench/${BENCH:-}*" >&2
    exit 1
fi
status=0
for b in "${benches[@]}"; do
    echo "== $b"
    case "$b" in
        *.py) (cd "$top" && "$build/venv/bin/python3" "$b") || { echo "bench: $b failed" >&2; status=1; } ;;
        *.sh) (cd "$top" && bash "$b") || { echo "bench: $b failed" >&2; status=1; } ;;
    esac
done
exit $status
