#!/usr/bin/env bash
# The whole test suite: meson unit tests and the Python/avocado tests of every
# component (real QEMU guests, real redis-server processes), in two lanes.
# Prints one closing line "N passed, N failed" (plus skips) and exits non-zero
# on any failure.
#   --long   also run the opt-in long suite (HYBRIDVM_LONG=1)
set -uo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$top/build}
venv=$build/venv
[ "${1:-}" = --long ] && export HYBRIDVM_LONG=1

export HYBRIDVM_BUILD=$build
export PYTHONPATH=$build/qemu-src/python:$top/tests${PYTHONPATH:+:$PYTHONPATH}

passed=0 failed=0 skipped=0
results=$build/avocado-results
mkdir -p "$results"
# A hung test fails after 10 minutes (the longest takes ~1.5) instead of
# eating CI's 90; each lane is capped at 70 minutes.
printf '[task.timeout]\nrunning = 600\n' >"$results/avocado.conf"

# Two lanes run side by side, one test at a time each: the tests that boot
# guests (TCG keeps about one core busy) and the host-only ones (meson unit
# tests, qemu-img/qemu-io, redis-server, the hook), but for one long host
# test that evens them out (below).  The host lane's output
# is printed when both are done.
count_meson() {
    "$venv/bin/python3" - "$1" <<'PY'
import json, sys
p = f = s = 0
for line in open(sys.argv[1]):
    r = json.loads(line)['result']
    if r in ('OK', 'EXPECTEDFAIL'): p += 1
    elif r == 'SKIP': s += 1
    else: f += 1
print(p, f, s)
PY
}

count_avocado() {
    "$venv/bin/python3" - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d['pass'] + d.get('warn', 0),
      d['errors'] + d['failures'] + d.get('interrupt', 0),
      d['skip'] + d.get('cancel', 0))
PY
}

avocado_lane() {  # name test...
    local name=$1; shift
    rm -f "$results/$name.json"
    [ $# -gt 0 ] || return 0
    (cd "$top" && "$venv/bin/avocado" --config "$results/avocado.conf" run --max-parallel-tasks 1 \
        --job-timeout 70m --job-results-dir "$results/$name" --json "$results/$name.json" "$@")
}

# Redis's own suite (4 min, no guest) runs in the guest lane to even the
# lanes out: the host lane has the most tests (14 min against 8 without it).
mapfile -t guest_tests < <(cd "$top" && ls tests/avocado/test_*.py \
    block/tests/test_hybrid_boot.py block/tests/test_hybrid_guest_errors.py \
    block/tests/test_hybrid_backing.py block/tests/test_hybrid_multiqueue.py \
    arbiter/tests/test_guest_*.py redis-module/tests/test_redis_suite.py 2>/dev/null)
mapfile -t host_tests < <(cd "$top" && ls block/tests/test_*.py redis-module/tests/test_*.py \
    migration/app-assist/tests/test_*.py libvirt-hooks/tests/test_*.py broker/tests/test_*.py \
    arbiter/tests/test_*.py volume/tests/test_*.py clone-cache/tests/test_*.py \
    tests/packaging/test_*.py tests/hvlib/test_*.py tests/docs/test_*.py 2>/dev/null |
    grep -v -x -F -f <(printf '%s\n' "${guest_tests[@]}"))

# Whether any component registered meson unit tests.
meson_tests="$("$venv/bin/meson" introspect --tests "$build" 2>/dev/null | grep -o '"name"' | head -1)"

host_lane() {
    rm -f "$build/meson-logs/testlog.json"
    if [ -n "$meson_tests" ]; then
        "$venv/bin/meson" test -C "$build" --print-errorlogs
    fi
    avocado_lane host "${host_tests[@]}"
}
host_lane >"$results/host-lane.log" 2>&1 &
host_pid=$!
avocado_lane guest "${guest_tests[@]}"
wait "$host_pid"
echo
echo "=== host lane (meson unit tests, host-only suites) ==="
cat "$results/host-lane.log"

tally() {  # counter-output
    local p f s
    if [ -z "$1" ]; then failed=$((failed + 1)); return; fi
    read -r p f s <<<"$1"
    passed=$((passed + p)) failed=$((failed + f)) skipped=$((skipped + s))
}
if [ -n "$meson_tests" ]; then
    log=$build/meson-logs/testlog.json
    if [ -f "$log" ]; then tally "$(count_meson "$log")"; else tally ""; fi
fi
for lane in guest host; do
    json=$results/$lane.json
    if [ -f "$json" ]; then
        tally "$(count_avocado "$json")"
    else
        echo "check: the $lane lane wrote no results" >&2
        tally ""
    fi
done

echo
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
