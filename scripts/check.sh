#!/usr/bin/env bash
# The whole test suite: meson unit tests, then the Python/avocado tests of every
# component (real QEMU guests, real redis-server processes).  Prints one closing
# line "N passed, N failed" (plus skips) and exits non-zero on any failure.
#   --long   also run the opt-in long suite (HYBRIDVM_LONG=1)
set -uo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$top/build}
venv=$build/venv
[ "${1:-}" = --long ] && export HYBRIDVM_LONG=1

export HYBRIDVM_BUILD=$build
export PYTHONPATH=$build/qemu-src/python:$top/tests${PYTHONPATH:+:$PYTHONPATH}

passed=0 failed=0 skipped=0

# 1. meson unit tests (C), if any component registered some.
if [ -n "$("$venv/bin/meson" introspect --tests "$build" 2>/dev/null | grep -o '"name"' | head -1)" ]; then
    "$venv/bin/meson" test -C "$build" --print-errorlogs
    log=$build/meson-logs/testlog.json
    if [ -f "$log" ]; then
        read -r p f s < <("$venv/bin/python3" - "$log" <<'PY'
import json, sys
p = f = s = 0
for line in open(sys.argv[1]):
    r = json.loads(line)['result']
    if r in ('OK', 'EXPECTEDFAIL'): p += 1
    elif r == 'SKIP': s += 1
    else: f += 1
print(p, f, s)
PY
)
        passed=$((passed + p)) failed=$((failed + f)) skipped=$((skipped + s))
    else
        failed=$((failed + 1))
    fi
fi

# 2. Python tests: functional (tests/avocado) and per-component suites.
mapfile -t tests < <(cd "$top" && ls tests/avocado/test_*.py block/tests/test_*.py \
    redis-module/tests/test_*.py migration/app-assist/tests/test_*.py \
    libvirt-hooks/tests/test_*.py 2>/dev/null)
if [ "${#tests[@]}" -gt 0 ]; then
    results=$build/avocado-results
    json=$results/latest.json
    rm -f "$json"
    # A hung test fails after 10 minutes (the longest takes ~1.5) instead of
    # eating CI's 90; the whole run is capped at 70 minutes.
    mkdir -p "$results"
    printf '[task.timeout]\nrunning = 600\n' >"$results/avocado.conf"
    (cd "$top" && "$venv/bin/avocado" --config "$results/avocado.conf" run --max-parallel-tasks 1 \
        --job-timeout 70m --job-results-dir "$results" --json "$json" "${tests[@]}")
    if [ -f "$json" ]; then
        read -r p f s < <("$venv/bin/python3" - "$json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d['pass'] + d.get('warn', 0),
      d['errors'] + d['failures'] + d.get('interrupt', 0),
      d['skip'] + d.get('cancel', 0))
PY
)
        passed=$((passed + p)) failed=$((failed + f)) skipped=$((skipped + s))
    else
        echo "check: avocado wrote no results" >&2
        failed=$((failed + 1))
    fi
fi

echo
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
