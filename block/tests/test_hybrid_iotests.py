"""QEMU's own qemu-iotests with the hybrid format: ./check -hybrid -g auto
from $HYBRIDVM_BUILD/qemu-build/tests/qemu-iotests (HYBRIDVM_LONG=1: every
test, not only the auto group).  Tests a format cannot run skip themselves
("not run"); a failure fails this test with the list of failing tests."""

import os
import re
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hybridlib as H   # noqa: E402

OBJ = os.path.join(H.BUILD, 'qemu-build')

IOTESTS = os.path.join(OBJ, 'tests', 'qemu-iotests')

def firmware_links():
    """qemu-system run from the build tree looks for firmware under
    qemu-build/qemu-bundle/<configured firmwarepath>; with
    --disable-install-blobs nothing is there, so link Debian's."""
    for d in ('usr/share/qemu', 'usr/share/seabios', 'usr/lib/ipxe/qemu'):
        link = os.path.join(OBJ, 'qemu-bundle', d)
        if os.path.isdir('/' + d) and not os.path.lexists(link):
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink('/' + d, link)


# What ./check -raw -g auto runs on the build machine (32 tests, measured
# 2026-11-26): hybrid must run each of them too, short of a reason that has
# nothing to do with the format (a missing library skips it for raw too).
RAW_AUTO = set('''001 002 003 004 005 008 009 010 011 012 021 025 032 033 048 052 063 086
104 120 140 143 150 159 170 181 184 192 226 251 iothreads-resize
regression-vhdx-log'''.split())
FORMAT_REASONS = ('not suitable for this image format', 'No qualified output')


@unittest.skipUnless(os.access(os.path.join(IOTESTS, 'check'), os.X_OK),
                     f'qemu-iotests not configured in {IOTESTS}')
class HybridIotests(unittest.TestCase):

    def test_check_hybrid(self):
        """./check -hybrid passes every generic test it runs, and runs every
        one that -raw runs."""
        firmware_links()
        args = ['./check', '-hybrid']
        if not H.LONG:
            args += ['-g', 'auto']
        p = subprocess.run(args, cwd=IOTESTS, capture_output=True, text=True,
                           timeout=3600 if H.LONG else 900)
        out = p.stdout + p.stderr
        m = re.search(r'^Failures: (.*)$', out, re.M)
        self.assertIsNone(m, f'failing iotests: {m and m.group(1)}'
                          f'\n{out[-3000:]}')
        self.assertRegex(out, r'Passed all \d+ iotests')
        if not H.LONG:
            left_out = sorted(m.group(1) for m in re.finditer(r'(\S+)\s+not run\b.*$', out, re.M)
                              if m.group(1) in RAW_AUTO
                              and any(r in m.group(0) for r in FORMAT_REASONS))
            self.assertEqual(left_out, [], 'tests -raw runs that hybrid does not')
        self.assertEqual(p.returncode, 0, out[-3000:])


if __name__ == '__main__':
    unittest.main()
