"""The quick starts of docs/hybrid.md and docs/broker.md run as written.

Each doc's ```sh blocks (but those marked `<!-- not run: REASON -->`) run
in document order as one `sh -eu` script (tests/hvlib/docblocks.py), in an
empty directory, with the build's programs on PATH as a reader has them:
QEMU's from build/bin (as block/tests/hybridlib.py finds them) and hvmem and
hvmemd from build/broker (as broker/tests/brokerlib.py does).  A block that
no longer matches the programs fails here, naming its line.

docs/hybrid.md's region block needs a broker (the doc says "with hvmemd
running"): the test starts one on a private pool and socket and gives the
script its HVMEM_SOCKET.  docs/broker.md starts the broker itself on the
default pool and socket (/dev/shm/hybridvm-broker, /run/hybridvm-broker.sock);
its script runs in a mount namespace of its own with a fresh tmpfs over
/dev/shm and /run, so it uses exactly those paths without meeting the
host's."""
import os
import shutil
import signal
import sys
import tempfile
import unittest

TOP = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for d in ('tests', 'block/tests', 'broker/tests'):
    sys.path.insert(0, os.path.join(TOP, d))
import brokerlib                    # noqa: E402
import hybridlib                    # noqa: E402
from hvlib import docblocks         # noqa: E402

HYBRID = os.path.join(TOP, 'docs', 'hybrid.md')
BROKER = os.path.join(TOP, 'docs', 'broker.md')


class DocsOnHost(unittest.TestCase):

    def setUp(self):
        progs = [os.path.join(hybridlib.BIN, n) for n in ('qemu-img', 'qemu-system-x86_64')]
        progs += [brokerlib.HVMEM, brokerlib.HVMEMD]
        missing = [p for p in progs if not os.access(p, os.X_OK)]
        if missing:
            self.skipTest(f'not built: {", ".join(missing)}')
        self.tmp = tempfile.mkdtemp(prefix='docs-host-')
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        # absolute: the scripts run in another directory (HYBRIDVM_BUILD
        # may be relative)
        self.env = dict(os.environ, PATH=os.pathsep.join(
            [os.path.abspath(hybridlib.BIN), os.path.abspath(os.path.dirname(brokerlib.HVMEM)),
             os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')]))
        self.env.pop('HVMEM_SOCKET', None)

    def qemu_img_info(self, name):
        return hybridlib.img_info(os.path.join(self.tmp, name))

    def test_hybrid_md(self):
        """Create, convert, inspect, check, bench, resize, amend and measure
        images, and a QEMU with its RAM tier in a broker region."""
        pool = tempfile.mkdtemp(prefix='docs-host-pool-', dir='/dev/shm')
        self.addCleanup(shutil.rmtree, pool, ignore_errors=True)
        broker = brokerlib.Broker(self.tmp, pool)
        broker.start()
        self.addCleanup(broker.stop, signal.SIGKILL)
        p = docblocks.run(HYBRID, env=dict(self.env, HVMEM_SOCKET=broker.sock),
                          cwd=self.tmp, timeout=300)
        self.assertIn('Images are identical.', p.stdout)
        self.assertIn('No errors were found on the image.', p.stdout)
        self.assertIn('"reused": false', p.stdout)        # query-hybrid's region
        self.assertIn('region token:', p.stdout)
        info = self.qemu_img_info('disk.hyb')
        self.assertEqual(info['virtual-size'], 384 << 20)
        spec = info['format-specific']['data']
        self.assertEqual((spec['mode'], spec['ram-size']), ('sync', 128 << 20))
        self.assertIn('region-token', self.qemu_img_info('vm1.hyb')['format-specific']['data'])

    def test_broker_md(self):
        """A broker on the default pool and socket, a region's life through
        hvmem, and the broker stopped by SIGTERM."""
        if os.geteuid() != 0:
            self.skipTest('the private mount namespace over /run and /dev/shm needs root')
        host_paths = ('/dev/shm/hybridvm-broker', '/run/hybridvm-broker.sock')
        before = [os.path.lexists(path) for path in host_paths]
        p = docblocks.run(BROKER, env=self.env, cwd=self.tmp, timeout=120,
                          tmpfs=['/dev/shm', '/run'])
        for line in ('name=vm1-ram id=1 size=1073741824 used=0 mode=0640',
                     'region=vm1-ram item=header offset=0 size=2097152',
                     'name=vm1-ram id=1 size=2147483648 used=2097152 mode=0600',
                     ', 2147483648 bytes\n'):
            self.assertIn(line, p.stdout)
        self.assertIn('ready: socket /run/hybridvm-broker.sock, pool /dev/shm/hybridvm-broker',
                      p.stderr)
        self.assertIn("region 'vm1-ram' (id 1) freed", p.stderr)
        # the script's pool and socket were not the host's
        self.assertEqual([os.path.lexists(path) for path in host_paths], before)


if __name__ == '__main__':
    unittest.main()
