"""hvcache (clone-cache/hvcache, hvcache(8)): the configuration a root daemon
acts on is checked before anything runs, and `run` becomes the clone cache's
qemu-storage-daemon with the layout the libvirt hook expects, warm after a
restart.  The packaged unit is tested in tests/packaging/test_debs.py."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
HVCACHE = os.path.join(REPO, 'clone-cache', 'hvcache')
BUILD = os.environ.get('HYBRIDVM_BUILD', os.path.join(REPO, 'build'))
QSD = os.path.join(BUILD, 'bin', 'qemu-storage-daemon')
sys.path.insert(0, os.path.join(REPO, 'python'))
import hvqmp  # noqa: E402

GOOD = """[cache]
file = {d}/cc/gold.cache
size = 16M
[daemon]
socket = {d}/run/gold.sock
qmp = {d}/run/gold.qmp
hook-qmp =
qemu-storage-daemon = {qsd}
[base gold]
blockdev = {{"driver": "file", "filename": "{d}/base.img"}}
base-id = gold
generation = 7
"""

# A full copy of gold made by the storage, given before its origin
COPY = """[base desk1]
blockdev = {{"driver": "file", "filename": "{d}/desk1.img"}}
base-id = desk1
copy-of = gold
copy-of-generation = 0x2a
"""


class HvcacheCase(unittest.TestCase):

    def setUp(self):
        self.d = tempfile.mkdtemp(prefix='hvcache-')
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        shutil.rmtree(self.d, ignore_errors=True)

    def conf(self, text=None, name='gold.conf', mode=0o644):
        path = os.path.join(self.d, name)
        with open(path, 'w') as f:
            f.write(GOOD.format(d=self.d, qsd=QSD) if text is None else text)
        os.chmod(path, mode)
        return path

    def hvcache(self, *args):
        return subprocess.run([sys.executable, HVCACHE, *args], capture_output=True, text=True,
                              timeout=30)


class ConfigTest(HvcacheCase):

    def test_check_prints_the_daemon(self):
        """check: qemu-storage-daemon's arguments, JSON where QSD takes it; the
        base node NAME-base read-only, the clone-cache node NAME, the export
        NAME, a monitor (the empty hook-qmp: none)."""
        r = self.hvcache('check', self.conf())
        self.assertEqual(r.returncode, 0, r.stderr)
        argv = r.stdout.splitlines()
        self.assertEqual(argv[0], QSD)
        opts = dict(zip(argv[1::2], argv[2::2]))
        self.assertEqual(json.loads(opts['--object']),
                         {'qom-type': 'clone-cache', 'id': 'cc0', 'size': 16 << 20,
                          'filename': f'{self.d}/cc/gold.cache'})
        self.assertEqual(argv.count('--monitor'), 1)
        blockdevs = [json.loads(argv[i + 1]) for i, a in enumerate(argv) if a == '--blockdev']
        self.assertEqual(blockdevs, [
            {'driver': 'file', 'filename': f'{self.d}/base.img', 'node-name': 'gold-base',
             'read-only': True},
            {'driver': 'clone-cache', 'node-name': 'gold', 'store': 'cc0', 'file': 'gold-base',
             'read-only': True, 'base-id': 'gold', 'generation': 7}])
        self.assertEqual(json.loads(opts['--export']),
                         {'type': 'nbd', 'id': 'gold', 'node-name': 'gold', 'name': 'gold',
                          'writable': False})

    def test_a_copy_opens_after_its_origin(self):
        """copy-of names another [base] of the file: the node gets that
        base's base-id, and opens after it whatever the file's order."""
        good = GOOD.format(d=self.d, qsd=QSD)
        head, gold = good.split('[base gold]')
        r = self.hvcache('check', self.conf(head + COPY.format(d=self.d) + '[base gold]' + gold))
        self.assertEqual(r.returncode, 0, r.stderr)
        argv = r.stdout.splitlines()
        nodes = [json.loads(argv[i + 1]) for i, a in enumerate(argv)
                 if a == '--blockdev' and 'clone-cache' in argv[i + 1]]
        self.assertEqual([n['node-name'] for n in nodes], ['gold', 'desk1'])
        self.assertEqual((nodes[1]['copy-of'], nodes[1]['copy-of-generation']), ('gold', 42))

    def test_hostile_configurations_are_refused(self):
        """Each is refused with the section and key named, exit 1, before
        anything runs."""
        good = GOOD.format(d=self.d, qsd=QSD)
        cases = [
            (good.replace('size = 16M', 'size = lots'), '[cache] size: cannot read size "lots"'),
            (good.replace('size = 16M', 'size = 1K'), '[cache] size: 1024 is out of range'),
            (good + 'evil = 1\n', '[base gold] unknown key "evil"'),
            (good + '[shell]\ncmd = rm -rf /\n', 'unknown section [shell]'),
            (good.replace('/run/gold.sock', '/run/x,server=off.sock'),
             '[daemon] socket: '),
            (good.replace(f'socket = {self.d}/run/gold.sock', 'socket = run/gold.sock'),
             'must be an absolute path'),
            (good.replace('"driver": "file",', '"driver": "file", "node-name": "x",'),
             'must be a JSON object with a driver and no node-name'),
            (good.replace('blockdev = {', 'blockdev = ['), 'blockdev is not JSON'),
            (good.replace('[base gold]', '[base ../etc]'), 'the base name is not 1-64 of'),
            (good.replace('generation = 7', 'generation = -1'), 'generation: 0 to 2^64-1'),
            (good.replace('[cache]\n', '[cache]\nblock-size = 3000\n'),
             '[cache] block-size: 3000 is out of range'),
            (good.split('[base gold]')[0], 'no [base NAME] section'),
            (good + COPY.format(d=self.d).replace('copy-of = gold', 'copy-of = nosuch'),
             '[base desk1] copy-of: "nosuch" is not another [base NAME] of this file'),
            (good + COPY.format(d=self.d).replace('copy-of = gold', 'copy-of = desk1'),
             '[base desk1] copy-of: "desk1" is not another [base NAME] of this file'),
            (good.replace('base-id = gold\n', '') + COPY.format(d=self.d),
             '[base desk1] copy-of: [base gold] needs a base-id'),
            (good + COPY.format(d=self.d) + COPY.format(d=self.d).replace(
                'desk1', 'desk2').replace('copy-of = gold', 'copy-of = desk1'),
             '[base desk2] copy-of: [base desk1] is itself a copy; name its origin'),
            (good + COPY.format(d=self.d).replace('= 0x2a', '= x'),
             '[base desk1] copy-of-generation is not an integer'),
            (good + COPY.format(d=self.d).replace('copy-of = gold\n', ''),
             '[base desk1] copy-of-generation without copy-of'),
            ('not an ini file', 'File contains no section headers'),
        ]
        for text, want in cases:
            r = self.hvcache('check', self.conf(text))
            self.assertEqual(r.returncode, 1, (want, r.stdout))
            self.assertIn(want, r.stderr)
            self.assertEqual(r.stdout, '')

    def test_writable_or_linked_configuration_is_refused(self):
        """A file others could write (or a symbolic link someone could
        redirect) is no configuration for a root daemon."""
        r = self.hvcache('check', self.conf(mode=0o664))
        self.assertEqual(r.returncode, 1)
        self.assertIn('writable by group or others (mode 0664); refusing', r.stderr)
        link = os.path.join(self.d, 'link.conf')
        os.symlink(self.conf(), link)
        r = self.hvcache('check', link)
        self.assertEqual(r.returncode, 1)
        self.assertIn('Too many levels of symbolic links', r.stderr)
        r = self.hvcache('check', os.path.join(self.d, 'missing.conf'))
        self.assertIn('No such file or directory', r.stderr)
        r = self.hvcache('check', self.conf(name='bad name.conf'))
        self.assertIn('the instance name "bad name" is not 1-64', r.stderr)


@unittest.skipUnless(os.path.exists(QSD), 'qemu-storage-daemon is not built')
class RunTest(HvcacheCase):

    def start(self, conf):
        """hvcache run, and hvcache wait until it serves (as the unit does)."""
        p = subprocess.Popen([sys.executable, HVCACHE, 'run', conf], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
        self.procs.append(p)
        r = self.hvcache('wait', '--timeout', '20', conf)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIsNone(p.poll(), p.stdout.read().decode() if p.poll() is not None else '')
        return p

    def test_wait_without_a_daemon_times_out(self):
        """wait: a daemon that never serves is an error, after --timeout."""
        t0 = time.monotonic()
        r = self.hvcache('wait', '--timeout', '0.5', self.conf())
        self.assertEqual(r.returncode, 1)
        self.assertGreaterEqual(time.monotonic() - t0, 0.5)
        self.assertIn(f'gold: the daemon does not serve on {self.d}/run/gold.sock after 0.5 s',
                      r.stderr)

    def cache(self):
        q = hvqmp.QMP(f'{self.d}/run/gold.qmp', timeout=10).connect()
        try:
            [c] = q.cmd('query-clone-cache')
            return c
        finally:
            q.close()

    def filled(self):
        """Blocks were filled and no fill is in flight (`used` counts a slot
        as soon as a fill takes it, before its record is written)."""
        c = self.cache()
        return c['fill-pending'] == 0 and sum(b['fills'] for b in c['bases']) > 0

    def test_run_serves_and_stays_warm(self):
        """run: exec'd qemu-storage-daemon (same pid) exports the base over
        NBD through the cache; a stale socket of a dead daemon does not stop
        it; after SIGTERM and a new start the cache is warm."""
        with open(f'{self.d}/base.img', 'wb') as f:
            f.write(b'baseblock0' + bytes(4 << 20))
        os.makedirs(f'{self.d}/run')
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(f'{self.d}/run/gold.sock')
        stale.close()
        conf = self.conf()
        p = self.start(conf)
        with open(f'/proc/{p.pid}/comm') as f:
            self.assertEqual(f.read().strip(), 'qemu-storage-da')
        self.assertEqual(os.stat(f'{self.d}/run').st_mode & 0o777, 0o755)  # made by the test
        self.assertEqual(os.stat(f'{self.d}/cc').st_mode & 0o777, 0o700)
        qemu_io = os.path.join(BUILD, 'bin', 'qemu-io')
        r = subprocess.run([qemu_io, '-r', '-f', 'raw', '-c', 'read -P 0 16 64k',
                            '-c', 'read -v 0 10',
                            f'nbd+unix:///gold?socket={self.d}/run/gold.sock'],
                           capture_output=True, text=True, timeout=30)
        self.assertIn('baseblock0', r.stdout, r.stderr)
        deadline = time.monotonic() + 20
        while not self.filled():
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.1)
        p.terminate()
        self.assertEqual(p.wait(timeout=20), 0)
        self.start(conf)
        self.assertGreater(self.cache()['used'], 0)


if __name__ == '__main__':
    unittest.main()
