"""`make install` (issue 38, item 3): the tree the Debian packages hold, for
hosts that are not Debian; PREFIX for programs and libraries, one place for
configuration; DESTDIR stages it (docs/deploy.md, "make install")."""

import os
import shutil
import subprocess
import tempfile
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get('HYBRIDVM_BUILD', os.path.join(REPO, 'build'))

EXPECTED = {
    'etc/hybridvm/arbiter.conf', 'etc/hybridvm/broker.conf', 'etc/hybridvm/clone-cache/gold.conf',
    'etc/hybridvm/libvirt-hook.conf', 'etc/libvirt/hooks/qemu.d/50-hybridvm',
    'P/share/hybridvm/examples/hybridvm-clone.xml', 'P/share/hybridvm/examples/hybridvm-redis.xml',
    'P/bin/hvarbiter', 'P/bin/hvcache', 'P/bin/hvmem', 'P/bin/hvmemd',
    'P/bin/qemu-img', 'P/bin/qemu-io', 'P/bin/qemu-nbd', 'P/bin/qemu-storage-daemon',
    'P/bin/qemu-system-x86_64',
    'etc/apparmor.d/abstractions/hybridvm-qemu',
    'P/lib/hybridvm/python/hvqmp.py', 'P/lib/hybridvm/python/hvfiles.py',
    'P/lib/hybridvm/python/arbiter/hvarbiter',
    'P/lib/redis/modules/hybridmem.so',
    'P/lib/systemd/system/hvarbiter.service', 'P/lib/systemd/system/hvcache@.service',
    'P/lib/systemd/system/hvmemd.service', 'P/lib/systemd/system/hvvol-plugin.service',
    'P/bin/hvvol', 'P/lib/hybridvm/python/volume/hvvol',
    'etc/containers/containers.conf.d/50-hybridvm-volume.conf', 'P/share/man/man8/hvvol.8.gz',
    'P/share/man/man1/hvmem.1.gz', 'P/share/man/man8/hvarbiter.8.gz',
    'P/share/man/man8/hvcache.8.gz', 'P/share/man/man8/hvmemd.8.gz',
}


def built():
    for f in ('bin/qemu-img', 'broker/hvmemd', 'redis-module/hybridmem.so'):
        if not os.path.exists(os.path.join(BUILD, f)):
            return f'{f} is not built'
    if not shutil.which('rst2man'):
        return 'rst2man is not installed (python3-docutils)'
    return None


@unittest.skipIf(built(), built())
class MakeInstallTest(unittest.TestCase):

    def setUp(self):
        self.root = tempfile.mkdtemp(prefix='make-install-')

    def tearDown(self):
        shutil.rmtree(self.root, ignore_errors=True)

    def install(self, *args, umask=0o022, destdir=True):
        dest = [f'DESTDIR={self.root}'] if destdir else []
        r = subprocess.run(['make', '-s', '-C', REPO, 'install', *dest, *args],
                           capture_output=True, text=True, timeout=120,
                           preexec_fn=lambda: os.umask(umask))
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def files(self):
        return {os.path.relpath(os.path.join(d, f), self.root)
                for d, _, fs in os.walk(self.root) for f in fs}

    def test_default_prefix_tree(self):
        """Under PREFIX=/usr/local: every program, library, unit, man page and
        configuration; the arbiter's modules beside hvqmp; the units start
        the programs from PREFIX/bin and configuration from /etc/hybridvm;
        nothing writable by others whatever the umask; the Redis module
        executable (redis-server 7 wants that)."""
        self.install(umask=0)
        files = self.files()
        expected = {f.replace('P/', 'usr/local/') for f in EXPECTED}
        self.assertLessEqual(expected, files)
        extra = {f for f in files - expected
                 if not f.startswith(('usr/local/lib/hybridvm/python/arbiter/',
                                      'usr/local/lib/hybridvm/python/volume/'))}
        self.assertEqual(extra, set())
        self.assertEqual(os.readlink(os.path.join(self.root, 'usr/local/bin/hvarbiter')),
                         '/usr/local/lib/hybridvm/python/arbiter/hvarbiter')
        self.assertEqual(os.readlink(os.path.join(self.root, 'usr/local/bin/hvvol')),
                         '/usr/local/lib/hybridvm/python/volume/hvvol')
        for d, dirs, fs in os.walk(self.root):
            for name in [os.path.join(d, x) for x in dirs + fs]:
                if not os.path.islink(name):
                    self.assertFalse(os.stat(name).st_mode & 0o022, f'{name} is writable by others')
        self.assertTrue(os.stat(os.path.join(
            self.root, 'usr/local/lib/redis/modules/hybridmem.so')).st_mode & 0o111)
        with open(os.path.join(self.root, 'usr/local/lib/systemd/system/hvmemd.service')) as f:
            unit = f.read()
        self.assertIn('ExecStart=/usr/local/bin/hvmemd ', unit)
        self.assertIn('--config /etc/hybridvm/broker.conf', unit)
        self.assertNotIn('@', unit.replace('hybridvm-broker', ''))
        with open(os.path.join(self.root, 'etc/libvirt/hooks/qemu.d/50-hybridvm')) as f:
            self.assertIn("LIB_DIR = '/usr/local/lib/hybridvm/python'  # make install", f.read())

    def test_package_prefix_and_kept_configuration(self):
        """PREFIX=/usr, as make deb stages it; a second install leaves an
        edited configuration file alone and replaces the programs."""
        self.install('PREFIX=/usr')
        self.assertLessEqual({f.replace('P/', 'usr/') for f in EXPECTED}, self.files())
        conf = os.path.join(self.root, 'etc/hybridvm/arbiter.conf')
        with open(conf, 'a') as f:
            f.write('# edited\n')
        prog = os.path.join(self.root, 'usr/bin/hvcache')
        os.truncate(prog, 0)
        self.install('PREFIX=/usr')
        with open(conf) as f:
            self.assertTrue(f.read().endswith('# edited\n'))
        self.assertGreater(os.path.getsize(prog), 0)

    def test_installed_programs_run(self):
        """The staged hvarbiter and hvvol find their modules and hvqmp
        through their symbolic links; hvcache checks the installed example."""
        self.install(f'PREFIX={self.root}/p', f'SYSCONFDIR={self.root}/etc', destdir=False)
        r = subprocess.run([os.path.join(self.root, 'p/bin/hvarbiter'), 'model', '/nonexistent'],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 1)
        self.assertIn('/nonexistent', r.stderr)
        self.assertNotIn('Traceback', r.stderr)
        r = subprocess.run([os.path.join(self.root, 'p/bin/hvvol'), 'create', '../x',
                            '--size', '1M'], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("volume name '../x' is not a name", r.stderr)
        self.assertNotIn('Traceback', r.stderr)
        conf = os.path.join(self.root, 'etc/hybridvm/clone-cache/gold.conf')
        r = subprocess.run([os.path.join(self.root, 'p/bin/hvcache'), 'check', conf],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn('{"driver": "clone-cache", "node-name": "gold", "store": "cc0", '
                      '"file": "gold-base", "read-only": true, "base-id": "gold"}', r.stdout)


if __name__ == '__main__':
    unittest.main()
