"""Unit tests of libvirt-hooks/qemu: run as libvirt runs it (argv + XML on stdin),
with its configuration, ledger, log and meminfo redirected to a temp dir."""
import json
import os
import struct
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

HOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'qemu')
REPO = os.path.dirname(os.path.dirname(HOOK))
GiB = 1 << 30


def domain(memory_mib=512, qemu_args=(), emulator=None, disks=()):
    args = ''.join(f"<qemu:arg value='{a}'/>" for a in qemu_args)
    emu = f'<emulator>{emulator}</emulator>' if emulator else ''
    dsk = ''.join(f"<disk type='file' device='disk'><source file='{d}'/>"
                  f"<target dev='vda' bus='virtio'/></disk>" for d in disks)
    return (f"<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>"
            f"<name>g1</name><memory unit='MiB'>{memory_mib}</memory>"
            f"<devices>{emu}{dsk}</devices><qemu:commandline>{args}</qemu:commandline></domain>")


class HookCase(unittest.TestCase):
    """Set-up and helpers: the hook with its files in a temp dir."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix='hook-test-')
        self.meminfo = os.path.join(self.dir, 'meminfo')
        self.set_memory(total=16 * GiB, available=8 * GiB)
        self.config = os.path.join(self.dir, 'hybridvm.conf')
        self.write_config()
        self.image = os.path.join(self.dir, 'disk.hybrid')
        open(self.image, 'wb').close()
        # A stand-in emulator that answers the two help queries like ours does.
        self.emulator = os.path.join(self.dir, 'qemu-system-x86_64')
        with open(self.emulator, 'w') as f:
            f.write(textwrap.dedent('''\
                #!/bin/sh
                case "$*" in
                  "-drive format=help") echo "Supported formats: file hybrid qcow2 raw";;
                  "-chardev help") echo "Available chardev backend types:"; echo "  app-assist"; echo "  socket";;
                esac
            '''))
        os.chmod(self.emulator, 0o755)
        self.plain_emulator = os.path.join(self.dir, 'stock-qemu')
        with open(self.plain_emulator, 'w') as f:
            f.write('#!/bin/sh\necho "Supported formats: file qcow2 raw"\n')
        os.chmod(self.plain_emulator, 0o755)

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def set_memory(self, total, available):
        with open(self.meminfo, 'w') as f:
            f.write(f'MemTotal:       {total // 1024} kB\nMemFree:        1 kB\n'
                    f'MemAvailable:   {available // 1024} kB\n')

    def write_config(self, reserve='256M', paths=''):
        with open(self.config, 'w') as f:
            f.write(f'[memory]\nreserve = {reserve}\nmeminfo = {self.meminfo}\n'
                    f'[state]\ndir = {self.dir}/ledger\nlog = {self.dir}/hook.log\n'
                    f'[paths]\n{paths}\n')

    def hook(self, op, subop, xml='', hook=HOOK):
        env = dict(os.environ, HYBRIDVM_HOOK_CONFIG=self.config)
        return subprocess.run([sys.executable, hook, 'g1', op, subop, '-'], input=xml,
                              capture_output=True, text=True, env=env, timeout=30)

    def log(self):
        with open(os.path.join(self.dir, 'hook.log')) as f:
            return f.read()

    def hybrid_args(self, ram='1G', path=None):
        return ['-blockdev', f'driver=hybrid,node-name=hd0,file.driver=file,'
                             f'file.filename={path or self.image},ram-size={ram}',
                '-device', 'virtio-blk-pci,drive=hd0']

    # -- admission --

class HookTest(HookCase):

    def test_plain_domain_admitted(self):
        """A domain without hybrid disks or app-assist only needs the memory."""
        cp = self.hook('prepare', 'begin', domain())
        self.assertEqual(cp.returncode, 0, cp.stderr)
        self.assertEqual(cp.stdout, '')
        self.assertIn('g1: prepare: admitted (guest 512 MiB)', self.log())

    def test_hybrid_domain_admitted_and_recorded(self):
        cp = self.hook('migrate', 'begin', domain(qemu_args=self.hybrid_args(), emulator=self.emulator))
        self.assertEqual(cp.returncode, 0, cp.stderr)
        self.assertEqual(cp.stdout, '', 'nothing rewritten, so no XML on stdout')
        with open(os.path.join(self.dir, 'ledger', 'g1.json')) as f:
            self.assertEqual(json.load(f)['bytes'], 512 * 2**20 + GiB)
        self.assertIn('ram-size 1024 MiB', self.log())

    def test_json_blockdev_understood(self):
        spec = json.dumps({'driver': 'hybrid', 'node-name': 'hd0', 'ram-size': 2 * GiB,
                           'file': {'driver': 'file', 'filename': self.image}})
        cp = self.hook('prepare', 'begin', domain(qemu_args=['-blockdev', spec], emulator=self.emulator))
        self.assertEqual(cp.returncode, 0, cp.stderr)
        self.assertIn('ram-size 2048 MiB', self.log())

    def test_refuse_emulator_without_hybrid(self):
        cp = self.hook('migrate', 'begin', domain(qemu_args=self.hybrid_args(), emulator=self.plain_emulator))
        self.assertEqual(cp.returncode, 1)
        self.assertIn('has no hybrid block format', cp.stderr)
        self.assertEqual(cp.stdout, '')

    def test_refuse_emulator_without_app_assist(self):
        args = ['-global', 'migration.x-app-assist=on']
        cp = self.hook('prepare', 'begin', domain(qemu_args=args, emulator=self.plain_emulator))
        self.assertEqual(cp.returncode, 1)
        self.assertIn('has no app-assist chardev', cp.stderr)
        cp = self.hook('prepare', 'begin', domain(qemu_args=args, emulator=self.emulator))
        self.assertEqual(cp.returncode, 0, cp.stderr)

    def test_refuse_missing_persistent_tier(self):
        cp = self.hook('migrate', 'begin',
                       domain(qemu_args=self.hybrid_args(path='/nonexistent/x.hybrid'), emulator=self.emulator))
        self.assertEqual(cp.returncode, 1)
        self.assertIn('/nonexistent/x.hybrid does not exist on this host', cp.stderr)
        self.assertIn('refused', self.log())

    def test_tier_under_a_filter(self):
        """A persistent tier under a throttle filter (a throttle group on the
        write-back) is found and checked as the file it is."""
        def args(path):
            return ['-blockdev', 'driver=hybrid,node-name=hd0,file.driver=throttle,'
                                 'file.throttle-group=tg0,file.file.driver=file,'
                                 f'file.file.filename={path},ram-size=64M']
        cp = self.hook('prepare', 'begin', domain(qemu_args=args('/nonexistent/y.hybrid'),
                                                  emulator=self.emulator))
        self.assertEqual(cp.returncode, 1)
        self.assertIn('/nonexistent/y.hybrid does not exist on this host', cp.stderr)
        cp = self.hook('prepare', 'begin', domain(qemu_args=args(self.image),
                                                  emulator=self.emulator))
        self.assertEqual(cp.returncode, 0, cp.stderr)
        self.assertIn(f'hybrid {self.image} ram-size 64 MiB', self.log())

    def test_no_broker_no_header_read_of_a_tier_that_is_not_a_file(self):
        """Whether a hybrid disk's newest writes are in a RAM region (to take
        a mirror over) is read from a file tier directly, from any other
        through qemu-img beside the emulator (an RBD connection): not at
        every start of a host without a broker, which could not take the
        region over anyway (QEMU's open names it).  A stand-in qemu-img
        records whether it ran."""
        calls = os.path.join(self.dir, 'qemu-img.calls')
        with open(os.path.join(self.dir, 'qemu-img'), 'w') as f:
            f.write(f'#!/bin/sh\necho "$1" >> {calls}\necho "{{}}"\n')
        os.chmod(os.path.join(self.dir, 'qemu-img'), 0o755)
        sock = os.path.join(self.dir, 'nbd.sock')
        open(sock, 'w').close()
        args = ['-blockdev', 'driver=hybrid,node-name=hd0,file.driver=nbd,file.server.type=unix,'
                             f'file.server.path={sock},file.export=hd0,ram-size=64M']
        cp = self.hook('prepare', 'begin', domain(qemu_args=args, emulator=self.emulator))
        self.assertEqual(cp.returncode, 0, cp.stderr)
        self.assertFalse(os.path.exists(calls), 'qemu-img ran without a broker')
        # with a broker configured it is read (nothing held: started as usual)
        with open(self.config, 'a') as f:
            f.write(f'[broker]\nsocket = {self.dir}/broker.sock\n')
        cp = self.hook('prepare', 'begin', domain(qemu_args=args, emulator=self.emulator))
        self.assertEqual(cp.returncode, 0, cp.stderr)
        with open(calls) as f:
            self.assertEqual(f.read().split(), ['info'])

    def test_refuse_unreachable_nbd_tier(self):
        args = ['-blockdev', 'driver=hybrid,node-name=hd0,file.driver=nbd,file.server.type=inet,'
                             'file.server.host=127.0.0.1,file.server.port=1,ram-size=64M']
        cp = self.hook('prepare', 'begin', domain(qemu_args=args, emulator=self.emulator))
        self.assertEqual(cp.returncode, 1)
        self.assertIn('NBD server 127.0.0.1:1 unreachable', cp.stderr)

    def test_refuse_memory_reserve(self):
        """Guest + tiers + reserve must fit what the host has available."""
        self.write_config(reserve='8G')
        cp = self.hook('prepare', 'begin', domain(qemu_args=self.hybrid_args(), emulator=self.emulator))
        self.assertEqual(cp.returncode, 1)
        self.assertIn('not enough memory: needs 1536 MiB (guest 512 MiB + hybrid RAM tiers 1024 MiB) '
                      'plus reserve 8192 MiB, host has 8192 MiB available', cp.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.dir, 'ledger', 'g1.json')))

    def test_ledger_counts_admitted_guests(self):
        """Guests admitted but not yet resident count against the next one; release frees."""
        self.set_memory(total=4 * GiB, available=4 * GiB)
        os.makedirs(os.path.join(self.dir, 'ledger'))
        with open(os.path.join(self.dir, 'ledger', 'other.json'), 'w') as f:
            json.dump({'domain': 'other', 'bytes': 3 * GiB}, f)
        cp = self.hook('prepare', 'begin', domain(memory_mib=1024))
        self.assertEqual(cp.returncode, 1)
        self.assertIn('3072 MiB is already reserved', cp.stderr)
        os.rename(os.path.join(self.dir, 'ledger', 'other.json'), os.path.join(self.dir, 'ledger', 'g1.json'))
        cp = self.hook('release', 'end', domain())
        self.assertEqual(cp.returncode, 0)
        self.assertIn('release: memory reservation removed', self.log())
        self.assertEqual(os.listdir(os.path.join(self.dir, 'ledger')), [])
        cp = self.hook('prepare', 'begin', domain(memory_mib=1024))
        self.assertEqual(cp.returncode, 0, cp.stderr)

    def write_hybrid_header(self, ram_size, virtual_size=GiB, magic=b'QHYBRID\0', version=1):
        hdr = bytearray(72)
        hdr[0:8] = magic
        struct.pack_into('<IIQQQQQI', hdr, 8, version, 72, 0, 0, virtual_size, 65536, ram_size, 65536)
        with open(self.image, 'wb') as f:
            f.write(bytes(hdr))

    def test_ram_size_from_image_header(self):
        """Without ram-size=, the RAM tier is the header's default, capped at the
        virtual size."""
        self.write_hybrid_header(ram_size=256 << 20)
        args = ['-blockdev', f'driver=hybrid,node-name=hd0,file.driver=file,file.filename={self.image}']
        cp = self.hook('prepare', 'begin', domain(qemu_args=args, emulator=self.emulator))
        self.assertEqual(cp.returncode, 0, cp.stderr)
        self.assertIn('ram-size 256 MiB', self.log())
        self.write_hybrid_header(ram_size=8 * GiB, virtual_size=GiB)
        cp = self.hook('prepare', 'begin', domain(qemu_args=args, emulator=self.emulator))
        self.assertIn('ram-size 1024 MiB', self.log())

    def test_header_not_hybrid(self):
        args = ['-blockdev', f'driver=hybrid,node-name=hd0,file.driver=file,file.filename={self.image}']
        self.write_hybrid_header(ram_size=GiB, magic=b'QFI\xfb\0\0\0\0')
        cp = self.hook('prepare', 'begin', domain(qemu_args=args, emulator=self.emulator))
        self.assertEqual(cp.returncode, 1)
        self.assertIn('is not a hybrid image', cp.stderr)
        self.write_hybrid_header(ram_size=GiB, version=7)
        cp = self.hook('prepare', 'begin', domain(qemu_args=args, emulator=self.emulator))
        self.assertIn('format version 7 is not supported', cp.stderr)

    def test_nbd_tier_needs_explicit_ram_size(self):
        sock = os.path.join(self.dir, 'nbd.sock')
        open(sock, 'w').close()
        args = ['-blockdev', f'driver=hybrid,node-name=hd0,file.driver=nbd,'
                             f'file.server.type=unix,file.server.path={sock}']
        cp = self.hook('prepare', 'begin', domain(qemu_args=args, emulator=self.emulator))
        self.assertEqual(cp.returncode, 1)
        self.assertIn('give ram-size= in its -blockdev options', cp.stderr)
        cp = self.hook('prepare', 'begin', domain(qemu_args=[args[0], args[1] + ',ram-size=64M'],
                                                  emulator=self.emulator))
        self.assertEqual(cp.returncode, 0, cp.stderr)
        self.assertIn(f'hybrid nbd+unix://{sock} ram-size 64 MiB', self.log())

    # -- path rewriting --
    def test_paths_rewritten_on_migrate(self):
        """[paths] maps the source host's image directory onto this host's; the
        complete XML comes back on stdout, everything else untouched."""
        self.write_config(paths=f'/srv/src-images = {self.dir}')
        xml = domain(qemu_args=self.hybrid_args(path='/srv/src-images/disk.hybrid'),
                     emulator=self.emulator, disks=['/srv/src-images/root.raw'])
        cp = self.hook('migrate', 'begin', xml)
        self.assertEqual(cp.returncode, 0, cp.stderr)
        self.assertIn(f'file.filename={self.dir}/disk.hybrid,ram-size=1G', cp.stdout)
        self.assertIn(f"file=\"{self.dir}/root.raw\"", cp.stdout)
        self.assertIn('xmlns:qemu="http://libvirt.org/schemas/domain/qemu/1.0"', cp.stdout)
        self.assertIn('<name>g1</name>', cp.stdout)
        self.assertIn('paths rewritten', self.log())
        # prepare never rewrites (its stdout is not used by libvirt)
        cp = self.hook('prepare', 'begin', domain(qemu_args=self.hybrid_args(), emulator=self.emulator))
        self.assertEqual(cp.stdout, '')

    def test_prefix_is_whole_components(self):
        self.write_config(paths=f'/srv/img = {self.dir}')
        cp = self.hook('migrate', 'begin', domain(disks=['/srv/images2/x.raw']))
        self.assertEqual(cp.returncode, 0, cp.stderr)
        self.assertEqual(cp.stdout, '', '/srv/img must not match /srv/images2')

    # -- bad input --
    def test_malformed_xml(self):
        cp = self.hook('migrate', 'begin', '<domain><name>g1</name')
        self.assertEqual(cp.returncode, 1)
        self.assertIn('domain XML does not parse', cp.stderr)
        self.assertEqual(cp.stdout, '')

    def test_missing_memory_element(self):
        cp = self.hook('prepare', 'begin', "<domain><name>g1</name></domain>")
        self.assertEqual(cp.returncode, 1)
        self.assertIn('no <memory> element', cp.stderr)

    def test_not_a_domain(self):
        cp = self.hook('prepare', 'begin', "<network><name>n</name></network>")
        self.assertEqual(cp.returncode, 1)
        self.assertIn('expected a <domain> document', cp.stderr)

    def test_bad_ram_size_and_config(self):
        cp = self.hook('prepare', 'begin', domain(qemu_args=self.hybrid_args(ram='lots'), emulator=self.emulator))
        self.assertEqual(cp.returncode, 1)
        self.assertIn('cannot read size "lots"', cp.stderr)
        self.write_config(reserve='a bit')
        cp = self.hook('prepare', 'begin', domain())
        self.assertEqual(cp.returncode, 1)
        self.assertIn('reserve: cannot read size "a bit"', cp.stderr)
        # release never fails, whatever the configuration says
        self.assertEqual(self.hook('release', 'end', '').returncode, 0)

    def test_other_operations_ignored(self):
        for op, sub in (('start', 'begin'), ('started', 'begin'), ('stopped', 'end'), ('migrate', 'end')):
            cp = self.hook(op, sub, 'not even xml')
            self.assertEqual((cp.returncode, cp.stdout), (0, ''), (op, sub))


def make_install(*args, umask=0o022):
    """`make install-hook` (the hook and its library: the part of `make
    install` these tests are about) with these variables."""
    r = subprocess.run(['make', '-s', '-C', REPO, 'install-hook', *args], capture_output=True,
                       text=True, timeout=60, preexec_fn=lambda: os.umask(umask))
    if r.returncode != 0:
        raise AssertionError(f'make install-hook failed: {r.stdout}{r.stderr}')


class InstallTest(unittest.TestCase):
    """`make install-hook` stages the hook and its QMP client
    (python/hvqmp.py) under DESTDIR; the installed hook names the library's
    directory as it will be once installed.  (`make install` installs these
    and the rest: tests/packaging/test_install.py.)"""

    def setUp(self):
        self.root = tempfile.mkdtemp(prefix='hook-install-')

    def tearDown(self):
        shutil.rmtree(self.root, ignore_errors=True)

    def test_destdir_stages_the_hook_and_its_library(self):
        """Everything lands under DESTDIR, nothing the root-run hook reads
        is writable by others whatever the umask, and the installed hook
        differs from the tree's in its LIB_DIR line only."""
        make_install(f'DESTDIR={self.root}', umask=0)
        installed = os.path.join(self.root, 'etc/libvirt/hooks/qemu.d/50-hybridvm')
        lib = os.path.join(self.root, 'usr/local/lib/hybridvm/python/hvqmp.py')
        files = sorted(os.path.relpath(os.path.join(d, f), self.root)
                       for d, _, fs in os.walk(self.root) for f in fs)
        self.assertEqual(files, ['etc/hybridvm/libvirt-hook.conf',
                                 'etc/libvirt/hooks/qemu.d/50-hybridvm',
                                 'usr/local/lib/hybridvm/python/hvqmp.py',
                                 'usr/local/share/hybridvm/examples/hybridvm-clone.xml',
                                 'usr/local/share/hybridvm/examples/hybridvm-redis.xml'])
        for d, _, fs in os.walk(self.root):
            for name in ([d] if d != self.root else []) + [os.path.join(d, f) for f in fs]:
                self.assertFalse(os.stat(name).st_mode & 0o022, f'{name} is writable by others')
        self.assertTrue(os.access(installed, os.X_OK))
        with open(lib) as f, open(os.path.join(REPO, 'python', 'hvqmp.py')) as g:
            self.assertEqual(f.read(), g.read())
        with open(installed) as f, open(HOOK) as g:
            ours, tree = f.read().splitlines(), g.read().splitlines()
        self.assertEqual(len(ours), len(tree))
        self.assertEqual([(a, b) for a, b in zip(ours, tree) if a != b], [(
            "LIB_DIR = '/usr/local/lib/hybridvm/python'  # make install",
            "LIB_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + '/python'"
            "  # make install")])


if __name__ == '__main__':
    unittest.main()
