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


@unittest.skipUnless(os.access(os.path.join(IOTESTS, 'check'), os.X_OK),
                     f'qemu-iotests not configured in {IOTESTS}')
class HybridIotests(unittest.TestCase):

    def test_check_hybrid(self):
        """./check -hybrid passes every generic test it runs."""
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
        self.assertEqual(p.returncode, 0, out[-3000:])


if __name__ == '__main__':
    unittest.main()
