"""docs/containers.md runs as written.

Every ```sh block of the document is a command a reader may type; they
run here in order as one script (sh -eu), unless the line before the block
is an HTML comment `<!-- not run: REASON -->`.  The script runs in a private
mount namespace with /srv on a tmpfs (the document's paths), with the
document's environment variables pointing at this test's directories and
broker, hvvol and the build's qemu-img on PATH.  Afterwards no volume is
left and no daemon runs."""

import os
import re
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vollib import TOP, VolumeTest          # noqa: E402
from volume import host                     # noqa: E402

sys.path.insert(0, os.path.join(TOP, 'broker', 'tests'))
import brokerlib as B                       # noqa: E402

DOC = os.path.join(TOP, 'docs', 'containers.md')
FENCE_RE = re.compile(r'^```(\w*)\n(.*?)^```$', re.MULTILINE | re.DOTALL)
NOT_RUN_RE = re.compile(r'<!-- not run: (.+?) -->\s*\Z', re.DOTALL)


def blocks(text):
    """[(language, body, reason it is not run or None)] in document order."""
    out = []
    for m in FENCE_RE.finditer(text):
        before = text[:m.start()].rstrip('\n').rsplit('\n', 1)[-1]
        skip = NOT_RUN_RE.search(before)
        out.append((m.group(1), m.group(2), skip.group(1).strip() if skip else None))
    return out


class DocTest(VolumeTest):

    def test_blocks_are_marked(self):
        """Each sh block runs, or says why not; there are blocks to run."""
        with open(DOC) as f:
            found = blocks(f.read())
        sh = [b for b in found if b[0] == 'sh']
        self.assertGreaterEqual(len([b for b in sh if b[2] is None]), 5)
        for lang, body, reason in found:
            self.assertIn(lang, ('sh', 'text'), f'a block in {lang!r}: {body[:60]!r}')
            if reason is not None:
                self.assertGreater(len(reason), 20, 'a reason, not a word')

    def test_commands_run_as_written(self):
        with open(DOC) as f:
            script = '\n'.join(body for lang, body, reason in blocks(f.read())
                               if lang == 'sh' and reason is None)
        pool = os.path.join('/dev/shm', os.path.basename(self.tmp) + '-pool')
        broker = B.Broker(self.tmp, pool)
        broker.start()
        try:
            env = dict(os.environ, HVVOL_DIR=self.conf, HVVOL_RUN_DIR=self.run_dir,
                       HVMEM_SOCKET=broker.sock,
                       PATH=os.pathsep.join([os.path.join(TOP, 'volume'),
                                             os.path.dirname(self.vols.tools.qemu_img),
                                             os.environ.get('PATH', '/usr/bin:/bin')]))
            path = os.path.join(self.tmp, 'doc.sh')
            with open(path, 'w') as f:
                f.write(script)
            p = subprocess.run(['unshare', '-m', '--propagation', 'private', 'sh', '-c',
                                'mount -t tmpfs -o size=2G tmpfs /srv && exec sh -eux "$0"',
                                path], env=env, capture_output=True, text=True, timeout=600)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn('<h1>hello</h1>', p.stdout)
            self.assertIn(f'"mountpoint": "{self.run_dir}/www/mnt"', p.stdout)
            self.assertIn('"reused": false', p.stdout)     # a new region, bound at mount
            self.assertEqual(self.vols.names(), [])
            for name in ('www', 'db', 'old'):
                self.assertIsNone(self.vols._state(name))
            self.assertFalse([m for m in host.mountinfo() if m['target'].startswith(self.tmp)])
        finally:
            broker.stop()
            subprocess.run(['rm', '-rf', pool])


if __name__ == '__main__':
    unittest.main()
