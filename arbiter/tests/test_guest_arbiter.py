"""The design's observation reproduced and answered, with a real guest: a
TCG guest streaming 1 MiB direct reads from its virtio-blk disk and a
podman container running fio, 4 KiB random reads on the same loop device,
which the arbiter finds by its podman name.  Without the
arbiter the container's IOPS drop and its p99 rises; with it the
container's p99 (fio's own figure) is back within the target, and the total
weighted work is not far below that of the best static throttle among
those that also meet the target (one run cannot rank them: the pooled
comparison is bench/arbiter.py's).  The arbiter's own target is in its
probe's terms: TARGET_X x the probe's p90 with the container alone (the
least of two such phases: Scenario.probe_baseline says why)."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import arblib as A   # noqa: E402
from arblib import H   # noqa: E402

WHY = A.unavailable()
TARGET_X = 1.5
MB = 1000 * 1000


def fmt(r):
    c, v = r['container'], r['vm']
    out = r['phase'] + ':'
    if c:
        out += f' container {c["iops"]:.0f} IOPS p99 {c["p99_ms"]:.2f} ms;'
    if v:
        out += f' VM {v["bps"] / MB:.1f} MB/s'
        if v['p99_ms'] is not None:
            out += f' p99 {v["p99_ms"]:.1f} ms'
    return out


@unittest.skipIf(WHY, WHY)
@unittest.skipUnless(H.LONG, 'opt-in (make check-long): one run of it on a shared 2-core '
                     'machine lands within the target seven runs in eight (2026-11-26)')
class GuestContentionTest(unittest.TestCase):
    def test_arbiter_keeps_the_container_fast(self):
        import scenario as S
        tmp = H.TempDir()
        self.addCleanup(tmp.cleanup)
        sc = S.Scenario(tmp, secs=4)
        self.addCleanup(sc.close)
        solo = sc.solo_with_probe()
        vsolo = sc.phase('VM solo', container=False)
        cont = sc.phase('contended')
        solo2 = sc.solo_with_probe('container solo again')
        for r in (solo, vsolo, cont, solo2):
            print(fmt(r) + (f' probe p90 {r["probe_ms"]:.2f} ms' if r.get('probe_ms') else ''))
        probe_ms = sc.probe_baseline(solo, solo2)
        # the design's observation
        self.assertLess(cont['container']['iops'], 0.8 * solo['container']['iops'], fmt(cont))
        self.assertGreater(cont['container']['p99_ms'], solo['container']['p99_ms'], fmt(cont))
        # the container's p99 (fio's) must come back under twice its solo
        # figure; the arbiter is told TARGET_X x the probe's solo p90
        target = max(0.5, 2 * solo['container']['p99_ms'])
        self.assertIsNotNone(probe_ms, 'the probe measured nothing')
        gap = 1.0
        d = sc.start_arbiter(TARGET_X * probe_ms, gap=gap)
        arb = sc.phase('arbitrated', settle=3)
        st = d.status()
        rc = sc.stop_arbiter()
        print(fmt(arb), f'(target {target:.2f} ms; arbiter target p90 '
              f'{TARGET_X * probe_ms:.2f} ms, limit {st.get("vms", {}).get("vm0", {}).get("limit")})')
        self.assertEqual(rc, 0)
        lim = sc.vm.g.qmp('qom-get', path='/objects/tg0', property='limits')
        self.assertEqual((lim['iops-total'], lim['bps-total']), (0, 0))   # defaults back
        # one phase on these shared machines moves by +-10 %
        self.assertLessEqual(arb['container']['p99_ms'], 1.1 * target, fmt(arb))
        self.assertGreater(arb['container']['iops'], cont['container']['iops'], fmt(arb))
        self.assertGreater(arb['vm']['bps'], 2 * MB, 'the VM kept above its floor')
        statics = []
        for mbs in (8, 32, 64, 128):
            sc.vm.set_limits(bps_total=mbs * MB)
            r = sc.phase(f'static {mbs} MB/s')
            print(fmt(r))
            statics.append(r)
        sc.vm.set_limits()
        ok = [r for r in statics if r['container']['p99_ms'] <= target]
        if ok:
            best = max(ok, key=lambda r: S.work(r, gap))
            print(f'work: arbitrated {S.work(arb, gap):.0f}, best static ({best["phase"]}) '
                  f'{S.work(best, gap):.0f}')
            # One phase against another moves by up to 30 % here, so one
            # run cannot rank the arbiter against the statics: this bound
            # only catches an arbiter that costs the container its work
            # too; the comparison itself, interleaved and pooled with a
            # confidence interval, is bench/arbiter.py's
            self.assertGreaterEqual(S.work(arb, gap), 0.6 * S.work(best, gap))


if __name__ == '__main__':
    unittest.main()
