"""The hook and the host's clone cache (issue 19, part 2): a real
qemu-storage-daemon holding a clone-cache object and an NBD server with no
export; the hook run as libvirt runs it.  prepare begin adds the export a
domain's backing store names (from [clone-cache base NAME]), leaves an
existing one alone, and refuses, saying why, an export neither served nor
configured, a daemon that does not answer, and hostile names and config."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, '..', '..', 'block', 'tests'))
import hybridlib as H   # noqa: E402
from test_hook import HookCase, make_install   # noqa: E402

MiB = 1 << 20


def domain(backings, overlay='/var/lib/hybridvm/vm1.qcow2'):
    disks = ''
    for i, (name, sock) in enumerate(backings):
        disks += (f"<disk type='file' device='disk'><driver name='qemu' type='qcow2'/>"
                  f"<source file='{overlay}{i}'/>"
                  "<backingStore type='network'><format type='raw'/>"
                  f"<source protocol='nbd' name='{name}'>"
                  f"<host transport='unix' socket='{sock}'/></source></backingStore>"
                  f"<target dev='vd{chr(97 + i)}' bus='virtio'/></disk>")
    return (f"<domain type='qemu'><name>g1</name><memory unit='MiB'>256</memory>"
            f"<devices>{disks}</devices></domain>")


@unittest.skipUnless(H.have_binaries(), 'QEMU tools not built')
class HookCloneCacheTest(HookCase):

    def setUp(self):
        super().setUp()
        self.tmp = H.TempDir()
        self.base = self.tmp('gold.img')
        with open(self.base, 'wb') as f:
            f.write(os.urandom(2 * MiB))
        self.nbd = self.tmp('cc.sock')
        self.qmp = self.tmp('hook.qmp')
        self.qsd = H.clone_cache_daemon(self.tmp, '16M')
        self.write_config()

    def tearDown(self):
        self.qsd.kill()
        self.tmp.cleanup()
        super().tearDown()

    def write_config(self, reserve='256M', paths='', bases=None):
        super().write_config(reserve, paths)
        if not hasattr(self, 'qsd'):
            return
        if bases is None:
            bases = {'gold': {'blockdev': json.dumps(
                {'driver': 'file', 'filename': self.base}),
                'base-id': 'gold-v1', 'generation': '7'}}
        with open(self.config, 'a') as f:
            f.write(f'[clone-cache]\nqmp = {self.qmp}\n'
                    f'socket = {self.nbd}\nstore = cc0\n')
            for name, opts in bases.items():
                f.write(f'[clone-cache base {name}]\n')
                for k, v in opts.items():
                    f.write(f'{k} = {v}\n')

    def exports(self):
        return sorted(e['node-name'] for e in self.qsd.cmd('query-block-exports'))

    def test_prepare_adds_the_export_once(self):
        r = self.hook('prepare', 'begin', domain([('gold', self.nbd)]))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(self.exports(), ['gold'])
        self.assertIn('clone-cache exports gold (added gold)', self.log())
        # the export serves the base, through the cache
        out = self.tmp('out')
        H.qemu_img('convert', '-f', 'raw', '-O', 'raw',
                   f'nbd+unix:///gold?socket={self.nbd}', out)
        self.assertEqual(open(out, 'rb').read(), open(self.base, 'rb').read())
        [c] = self.qsd.cmd('query-clone-cache')
        self.assertEqual([(b['base-id'], b['generation']) for b in c['bases']],
                         [('gold-v1', 7)])
        # a second domain on the same base: nothing added
        r = self.hook('prepare', 'begin', domain([('gold', self.nbd)]))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(self.exports(), ['gold'])
        # an NBD store that is not the clone cache is none of our business
        r = self.hook('prepare', 'begin', domain([('other', '/run/elsewhere.sock')]))
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_refusals_say_why(self):
        r = self.hook('prepare', 'begin', domain([('silver', self.nbd)]))
        self.assertEqual(r.returncode, 1)
        self.assertIn('does not export "silver" and [clone-cache base silver] is not '
                      'configured', r.stderr)
        r = self.hook('prepare', 'begin', domain([('../etc', self.nbd)]))
        self.assertEqual(r.returncode, 1)
        self.assertIn('is not 1-64 of', r.stderr)
        # a base the daemon cannot open: nothing is left half added
        self.write_config(bases={'gold': {'blockdev': json.dumps(
            {'driver': 'file', 'filename': self.tmp('missing.img')})}})
        r = self.hook('prepare', 'begin', domain([('gold', self.nbd)]))
        self.assertEqual(r.returncode, 1)
        self.assertIn('blockdev-add', r.stderr)
        self.assertEqual(self.exports(), [])
        self.assertNotIn('gold-base', [n['node-name'] for n in
                                       self.qsd.cmd('query-named-block-nodes')])
        self.write_config(bases={'gold': {'blockdev': '[1, 2'}})
        r = self.hook('prepare', 'begin', domain([('gold', self.nbd)]))
        self.assertEqual(r.returncode, 1)
        self.assertIn('blockdev is not JSON', r.stderr)
        self.write_config(bases={'gold': {'blockdev': '"file"'}})
        r = self.hook('prepare', 'begin', domain([('gold', self.nbd)]))
        self.assertIn('must be a JSON object with a driver', r.stderr)

    def test_installed_hook_asks_through_the_installed_library(self):
        """The hook as `make install` installs it (PREFIX in a temp dir)
        adds the export through its own copy of hvqmp, not the tree's."""
        prefix, hooks = self.tmp('prefix'), self.tmp('hooks')
        make_install(f'PREFIX={prefix}', f'HOOKS_DIR={hooks}')
        installed = os.path.join(hooks, 'qemu.d', '50-hybridvm')
        r = self.hook('prepare', 'begin', domain([('gold', self.nbd)]), hook=installed)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(self.exports(), ['gold'])
        # the same call again, then which hvqmp it imported
        which = ('import runpy, sys\n'
                 'sys.argv = sys.argv[1:]\n'
                 'try:\n'
                 '    runpy.run_path(sys.argv[0], run_name="__main__")\n'
                 'except SystemExit as e:\n'
                 '    print(e.code, sys.modules["hvqmp"].__file__)\n')
        r = subprocess.run([sys.executable, '-c', which, installed, 'g1', 'prepare', 'begin',
                            '-'], input=domain([('gold', self.nbd)]), capture_output=True,
                           text=True, env=dict(os.environ, HYBRIDVM_HOOK_CONFIG=self.config),
                           timeout=30)
        self.assertEqual(r.stdout.split(),
                         ['0', os.path.join(prefix, 'lib/hybridvm/python/hvqmp.py')], r.stderr)

    def test_daemon_down_refuses(self):
        self.qsd.kill()
        r = self.hook('prepare', 'begin', domain([('gold', self.nbd)]))
        self.assertEqual(r.returncode, 1)
        self.assertIn(f'clone-cache daemon at {self.qmp}', r.stderr)

    def test_daemon_that_never_answers_times_out(self):
        import socket
        import time
        path = self.tmp('mute.sock')
        mute = socket.socket(socket.AF_UNIX)
        mute.bind(path)
        mute.listen(1)
        with open(self.config) as f:
            text = f.read()
        with open(self.config, 'w') as f:
            f.write(text.replace(f'qmp = {self.qmp}', f'qmp = {path}'))
        t0 = time.monotonic()
        r = self.hook('prepare', 'begin', domain([('gold', self.nbd)]))
        self.assertEqual(r.returncode, 1)
        self.assertIn('timed out', r.stderr)
        self.assertLess(time.monotonic() - t0, 30)
        mute.close()


class Peer(threading.Thread):
    """A QMP peer that greets, takes the hook's first command and answers
    it with `chunks`, each (bytes, seconds to wait after sending it)."""

    def __init__(self, path, chunks):
        super().__init__(daemon=True)
        self.chunks = chunks
        self.srv = socket.socket(socket.AF_UNIX)
        self.srv.bind(path)
        self.srv.listen(1)
        self.start()

    def run(self):
        conn, _ = self.srv.accept()
        with conn:
            try:
                conn.sendall(b'{"QMP": {"version": {}, "capabilities": []}}\n')
                conn.recv(65536)
                for data, wait in self.chunks:
                    conn.sendall(data)
                    time.sleep(wait)
            except OSError:
                pass                    # the hook hung up

    def close(self):
        self.srv.close()


class HookHostileDaemonTest(HookCase):
    """The hook's QMP client (python/hvqmp.py) keeps its bounds against a
    peer that is not a well-behaved QEMU: no more than 1000 events before a
    reply, a line of at most 4 MiB, one 10 s deadline for each command
    however slowly the peer trickles bytes.  Each refuses the domain."""

    def refused(self, chunks, why, within):
        path = os.path.join(self.dir, 'peer.sock')
        peer = Peer(path, chunks)
        with open(self.config, 'a') as f:
            f.write(f'[clone-cache]\nqmp = {path}\nsocket = {self.dir}/cc.sock\n')
        t0 = time.monotonic()
        r = self.hook('prepare', 'begin', domain([('gold', f'{self.dir}/cc.sock')]))
        took = time.monotonic() - t0
        peer.close()
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn(f'refusing g1 on this host: clone-cache daemon at {path}: ', r.stderr)
        self.assertIn(why, r.stderr)
        self.assertLess(took, within)

    def test_event_flood(self):
        event = b'{"event": "X", "data": {}, "timestamp": {"seconds": 0, "microseconds": 0}}\n'
        self.refused([(event * 1001, 5)], 'more than 1000 events before the reply', 5)

    def test_huge_line(self):
        self.refused([(b'x' * (5 << 20), 5)], 'longer than 4194304 bytes', 5)

    def test_trickle(self):
        self.refused([(b' ', 0.5)] * 40, 'timed out', 15)


if __name__ == '__main__':
    unittest.main()
