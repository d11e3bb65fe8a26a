"""The hook and the memory broker (issue 20, user 4): a real hvmemd; the hook
run as libvirt runs it.  prepare begin checks the pool has room for the
regions the domain names and creates the missing ones; release end destroys
those with lifetime="domain"; refusals say why."""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, '..', '..', 'broker', 'tests'))
sys.path.insert(0, os.path.join(HERE, '..', '..', 'tests'))
import brokerlib as B   # noqa: E402
from hvlib.libvirt import with_broker_regions   # noqa: E402
from test_hook import HookCase, domain   # noqa: E402

MiB = 1 << 20


class BrokerHookCase(HookCase):
    """HookCase with a real hvmemd of `capacity` in the hook's [broker]."""

    capacity = '256M'

    def setUp(self):
        super().setUp()
        self.pool = tempfile.mkdtemp(prefix='hook-broker-pool-', dir='/dev/shm')
        os.rmdir(self.pool)
        self.sockdir = tempfile.mkdtemp(prefix='hv-hook-')
        self.broker = B.Broker(self.sockdir, self.pool, ['--capacity', self.capacity])
        self.broker.start()
        self.c = self.broker.client()
        self.write_config()

    def tearDown(self):
        self.c.close()
        self.broker.stop()
        shutil.rmtree(self.pool, ignore_errors=True)
        shutil.rmtree(self.sockdir, ignore_errors=True)
        super().tearDown()

    def write_config(self, reserve='256M', paths='', broker=True):
        super().write_config(reserve, paths)
        if broker and hasattr(self, 'broker'):
            with open(self.config, 'a') as f:
                f.write(f'[broker]\nsocket = {self.broker.sock}\nhvmem = {B.HVMEM}\n')


@unittest.skipUnless(os.path.exists(B.HVMEMD), f'{B.HVMEMD} not built')
class HookBrokerTest(BrokerHookCase):

    def names(self):
        return sorted(r['name'] for r in self.c.list())

    def test_prepare_creates_and_release_destroys(self):
        xml = with_broker_regions(domain(), [
            dict(name='g1-ram', size='64M', mode='0640', lifetime='domain'),
            dict(name='g1-tier', size='34M')])
        r = self.hook('prepare', 'begin', xml)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(self.names(), ['g1-ram', 'g1-tier'])
        self.assertEqual(self.c.lookup('g1-ram')['mode'], 0o640)
        self.assertIn('2 created', self.log())
        # a second start finds them: nothing more is created
        r = self.hook('prepare', 'begin', xml)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn('0 created', self.log())
        r = self.hook('release', 'end', xml)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(self.names(), ['g1-tier'])   # persistent stays
        self.assertIn('broker region g1-ram destroyed', self.log())

    def test_refused_when_the_pool_is_full(self):
        self.c.create('someone-else', 200 * MiB)
        xml = with_broker_regions(domain(), [dict(name='g1-ram', size='64M')])
        r = self.hook('prepare', 'begin', xml)
        self.assertEqual(r.returncode, 1)
        self.assertIn('cannot hold the domain', r.stderr)
        self.assertIn('56 MiB free', r.stderr)
        self.assertEqual(self.names(), ['someone-else'])   # nothing half-made

    def test_refused_when_an_existing_region_is_too_small(self):
        self.c.create('g1-ram', 8 * MiB)
        r = self.hook('prepare', 'begin',
                      with_broker_regions(domain(), [dict(name='g1-ram', size='64M')]))
        self.assertEqual(r.returncode, 1)
        self.assertIn('exists with 8 MiB', r.stderr)

    def test_bad_metadata_refused(self):
        for reg, text in ((dict(name='../etc', size='1M'), 'without "/"'),
                          (dict(name='a/b', size='1M'), 'without "/"'),
                          (dict(name='x', size='lots'), 'cannot read size'),
                          (dict(name='x', size='2048T'), '1 PiB'),
                          (dict(name='x', size='1M', mode='0777'), 'within 0666'),
                          (dict(name='x', size='1M', lifetime='forever'), 'lifetime')):
            r = self.hook('prepare', 'begin', with_broker_regions(domain(), [reg]))
            self.assertEqual(r.returncode, 1, reg)
            self.assertIn(text, r.stderr, reg)
        self.assertEqual(self.names(), [])

    def test_no_broker_configured_or_reachable(self):
        xml = with_broker_regions(domain(), [dict(name='g1-ram', size='1M')])
        self.write_config(broker=False)
        r = self.hook('prepare', 'begin', xml)
        self.assertEqual(r.returncode, 1)
        self.assertIn('no [broker] socket is configured', r.stderr)
        self.write_config()
        self.c.close()
        self.broker.stop()
        r = self.hook('prepare', 'begin', xml)
        self.assertEqual(r.returncode, 1)
        self.assertIn('memory broker at', r.stderr)
        # a domain without regions does not need the broker
        r = self.hook('prepare', 'begin', domain())
        self.assertEqual(r.returncode, 0, r.stderr)
        self.broker.start()
        self.c = self.broker.client()


if __name__ == '__main__':
    unittest.main()
