"""The content fingerprint's implementations agree (block/content-fp.c).

The clone cache keeps fingerprints in its file and hybrid's dedup finds
chunks by them, so the vectorized fingerprint chosen at run time must
return the portable one's value bit for bit.  content-fp-test.c includes
content-fp.c and calls each implementation directly; this builds it with
the very flags QEMU compiled content-fp.c with (from the build's
compile_commands.json) and runs it."""

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hybridlib as H   # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
QEMU_BUILD = os.path.join(H.BUILD, 'qemu-build')


def qemu_cflags(name):
    """The compiler and flags QEMU's build used for the source file @name
    (a path ending), without its output, dependency and -c arguments, run
    from the build directory: None if the build has no such file."""
    try:
        with open(os.path.join(QEMU_BUILD, 'compile_commands.json')) as f:
            entries = json.load(f)
    except FileNotFoundError:
        return None
    for e in entries:
        if e['file'].endswith(name):
            args, out, skip = shlex.split(e['command']), [], False
            for a in args:
                if skip:
                    skip = False
                elif a in ('-MQ', '-MF', '-o', '-c'):
                    skip = True
                elif a not in ('ccache', '-MD'):
                    out.append(a)
            return out
    return None


def build_fp_test(out):
    """Build block/tests/content-fp-test.c into @out; raises with the
    compiler's output when it fails."""
    cflags = qemu_cflags('block/hybrid/content-fp.c')
    glib = subprocess.run(['pkg-config', '--libs', 'glib-2.0'], check=True,
                          capture_output=True, text=True).stdout.split()
    cmd = cflags + ['-o', out, os.path.join(HERE, 'content-fp-test.c'),
                    os.path.join(H.BUILD, 'qemu-src', 'util', 'cpuinfo-i386.c')] + glib
    r = subprocess.run(cmd, cwd=QEMU_BUILD, capture_output=True, text=True)
    if r.returncode:
        raise AssertionError(f'building content-fp-test failed:\n{r.stderr}')
    return out


def cpu_flags():
    with open('/proc/cpuinfo') as f:
        for line in f:
            if line.startswith('flags'):
                return set(line.split(':', 1)[1].split())
    return set()


@unittest.skipUnless(qemu_cflags('block/hybrid/content-fp.c'),
                     f'QEMU not configured in {QEMU_BUILD}')
class ContentFpTest(unittest.TestCase):

    def test_implementations_agree(self):
        """Every implementation this CPU can run gives the portable value
        (and the portable one the original code's), over lengths 0-64 KiB
        and 2 MiB, four kinds of content, every offset mod 32."""
        with tempfile.TemporaryDirectory() as d:
            exe = build_fp_test(os.path.join(d, 'content-fp-test'))
            r = subprocess.run([exe], capture_output=True, text=True, timeout=300)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        got = dict(re.findall(r'^(\w+): (.*)$', r.stdout, re.M))
        self.assertEqual(got['portable'], '5 original values')
        flags = cpu_flags()
        want = {'avx512': {'avx512f', 'avx512vl', 'avx512dq'}}
        for name, need in want.items():
            if need <= flags:
                # compared, not skipped, where the CPU has the instructions
                self.assertRegex(got[name], r'^[1-9]\d* equal$', name)
        self.assertRegex(got['dispatched'], r'^[1-9]\d* equal$')
        self.assertEqual(got['selected'],
                         'avx512' if want['avx512'] <= flags else 'portable')


if __name__ == '__main__':
    unittest.main()
