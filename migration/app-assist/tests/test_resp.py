"""The reply parser's C unit tests and its fuzz target (bounded in time),
built with gcc + ASan/UBSan from migration/app-assist/ and run.

The same programs are registered as meson tests by tests/meson.build when the
top-level build includes that directory; this wrapper runs them from
`make check` either way.  HYBRIDVM_AA_FUZZ_SECONDS sets the fuzz budget
(default 20 s; HYBRIDVM_LONG=1 makes it 300 s)."""
import os
import shutil
import subprocess
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(HERE)
SAN = ['-fsanitize=address,undefined', '-fno-sanitize-recover=all']


class RespParser(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        if not shutil.which('gcc'):
            raise unittest.SkipTest('gcc is not installed')
        if not os.path.exists('/usr/include/hiredis/hiredis.h'):
            raise unittest.SkipTest('libhiredis-dev is not installed')
        cls.tmp = tempfile.mkdtemp(prefix='aa-resp-')

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def build(self, name, source):
        exe = os.path.join(self.tmp, name)
        subprocess.run(['gcc', '-g', '-O1', '-Wall', '-Wextra', '-Werror', *SAN,
                        os.path.join(HERE, source), os.path.join(SRC, 'resp.c'),
                        '-lhiredis', '-o', exe], check=True, timeout=120)
        return exe

    def test_unit(self):
        """Valid module replies, aliases, refusals, strict types, limits,
        sticky errors: all as documented in docs/app-assist.md."""
        exe = self.build('test-resp', 'test-resp.c')
        out = subprocess.run([exe], capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)

    def test_fuzz(self):
        """Random, RESP-shaped, oversized and mutated replies in random-sized
        pieces for a bounded time: no sanitizer report, no broken invariant."""
        secs = os.environ.get('HYBRIDVM_AA_FUZZ_SECONDS',
                              '300' if os.environ.get('HYBRIDVM_LONG') else '20')
        exe = self.build('fuzz-resp', 'fuzz-resp.c')
        out = subprocess.run([exe, '--seconds', secs], capture_output=True, text=True,
                             timeout=float(secs) + 60)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn('no failure', out.stdout)


if __name__ == '__main__':
    unittest.main()
