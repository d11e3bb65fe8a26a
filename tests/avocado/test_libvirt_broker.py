"""virsh and the memory broker (issue 20, user 4): a private libvirtd with our
hook configured for a real hvmemd.  `virsh start` provisions the broker
regions the domain names in its metadata; a domain whose regions do not fit
in the pool is refused with the hook's reason; `virsh destroy` (release end)
destroys the regions the domain named with lifetime="domain"."""
import os
import shutil
import sys
import tempfile

from hvtest import LibvirtTest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, 'broker', 'tests'))
import brokerlib as B   # noqa: E402

MiB = 1 << 20


class VirshBroker(LibvirtTest):

    def setUp(self):
        super().setUp()
        if not os.path.exists(B.HVMEMD):
            self.cancel(f'{B.HVMEMD} not built')
        self.pool = tempfile.mkdtemp(prefix='lv-broker-pool-', dir='/dev/shm')
        os.rmdir(self.pool)
        self.broker = B.Broker(self.root, self.pool, ['--capacity', '128M'])
        self.broker.start()

    def tearDown(self):
        self.stop_host()        # first: its hook talks to the broker
        self.broker.stop()
        shutil.rmtree(self.pool, ignore_errors=True)
        super().tearDown()

    def test_virsh_start_provisions_and_destroy_releases(self):
        from hvlib.libvirt import domain_xml, make_hooks_dir, with_broker_regions
        import hvlib
        self.start_host('broker', make_hooks_dir(
            self.root, '64M', f'[broker]\nsocket = {self.broker.sock}\nhvmem = {B.HVMEM}\n'))
        c = self.broker.client()
        self.host.define(with_broker_regions(
            domain_xml('hvb1', self.paths, mem_mib=256, redis_port=hvlib.free_port(), append='',
                       boot_dir=self.root),
            [dict(name='hvb1-scratch', size='32M', lifetime='domain'),
             dict(name='hvb1-tier', size='16M', lifetime='persistent')]))
        self.host.virsh('start', 'hvb1')
        self.assertEqual(sorted(r['name'] for r in c.list()),
                         ['hvb1-scratch', 'hvb1-tier'])
        # a second domain asking for more than the pool has left is refused
        self.host.define(with_broker_regions(
            domain_xml('hvb2', self.paths, mem_mib=256, redis_port=hvlib.free_port(), append='',
                       boot_dir=self.root),
            [dict(name='hvb2-ram', size='96M', lifetime='domain')]))
        r = self.host.virsh('start', 'hvb2', check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn('cannot hold the domain', r.stderr)
        self.host.virsh('destroy', 'hvb1')
        B.wait_for(lambda: sorted(x['name'] for x in c.list()) == ['hvb1-tier'],
                   what='release end to destroy hvb1-scratch')
        c.close()
