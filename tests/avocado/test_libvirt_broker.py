"""virsh and the memory broker (issue 20, user 4): a private libvirtd with our
hook configured for a real hvmemd.  `virsh start` provisions the broker
regions the domain names in its metadata; a domain whose regions do not fit
in the pool is refused with the hook's reason; `virsh destroy` (release end)
destroys the regions the domain named with lifetime="domain"."""
import os
import shutil
import sys
import tempfile

from hvtest import HybridVMTest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOOK = os.path.join(REPO, 'libvirt-hooks', 'qemu')
sys.path.insert(0, os.path.join(REPO, 'broker', 'tests'))
import brokerlib as B   # noqa: E402

MiB = 1 << 20


def with_regions(xml, regions):
    meta = ''.join(f'<hv:region name="{n}" size="{s}" lifetime="{lt}"/>'
                   for n, s, lt in regions)
    return xml.replace('<devices>', '<metadata><hv:broker xmlns:hv='
                       f'"https://hybridvm.org/xmlns/broker/1">{meta}</hv:broker>'
                       '</metadata>\n  <devices>', 1)


class VirshBroker(HybridVMTest):

    def setUp(self):
        super().setUp()
        from hvlib.libvirt import libvirt_available
        reason = libvirt_available()
        if reason:
            self.cancel(reason)
        if not os.path.exists(B.HVMEMD):
            self.cancel(f'{B.HVMEMD} not built')
        self.root = tempfile.mkdtemp(prefix='hv-lvb-')
        self.pool = tempfile.mkdtemp(prefix='lv-broker-pool-', dir='/dev/shm')
        os.rmdir(self.pool)
        self.broker = B.Broker(self.root, self.pool, ['--capacity', '128M'])
        self.broker.start()
        self.host = None

    def tearDown(self):
        if self.host:
            self.host.stop()
        self.broker.stop()
        shutil.rmtree(self.pool, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)
        super().tearDown()

    def test_virsh_start_provisions_and_destroy_releases(self):
        from hvlib.libvirt import LibvirtHost, domain_xml
        import hvlib
        hooks = os.path.join(self.root, 'hooks')
        os.makedirs(hooks)
        shutil.copy(HOOK, os.path.join(hooks, 'qemu'))
        with open(os.path.join(hooks, 'hybridvm.conf'), 'w') as f:
            f.write(f'[memory]\nreserve = 64M\n[broker]\nsocket = {self.broker.sock}\n'
                    f'hvmem = {B.HVMEM}\n')
        self.host = LibvirtHost('broker', os.path.join(self.root, 'lv'),
                                (49300, 49309), hooks_dir=hooks).start()
        c = self.broker.client()
        xml = with_regions(domain_xml('hvb1', self.paths, mem_mib=256,
                                      redis_port=hvlib.free_port(), append=''),
                           [('hvb1-scratch', '32M', 'domain'),
                            ('hvb1-tier', '16M', 'persistent')])
        path = os.path.join(self.root, 'hvb1.xml')
        with open(path, 'w') as f:
            f.write(xml)
        self.host.virsh('define', path)
        self.host.virsh('start', 'hvb1')
        self.assertEqual(sorted(r['name'] for r in c.list()),
                         ['hvb1-scratch', 'hvb1-tier'])
        # a second domain asking for more than the pool has left is refused
        big = with_regions(domain_xml('hvb2', self.paths, mem_mib=256,
                                      redis_port=hvlib.free_port(), append=''),
                           [('hvb2-ram', '96M', 'domain')])
        path2 = os.path.join(self.root, 'hvb2.xml')
        with open(path2, 'w') as f:
            f.write(big)
        self.host.virsh('define', path2)
        r = self.host.virsh('start', 'hvb2', check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn('cannot hold the domain', r.stderr)
        self.host.virsh('destroy', 'hvb1')
        B.wait_for(lambda: sorted(x['name'] for x in c.list()) == ['hvb1-tier'],
                   what='release end to destroy hvb1-scratch')
        c.close()
