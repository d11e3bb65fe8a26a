"""Podman containers on broker regions (issue 37, item 2): `hvmem podman-run`
asks a real hvmemd for the region with the caller's credentials and runs a
real podman container (rootful, runc: tests/hvlib/podman.py) with the
region bind-mounted at /run/hvmem/NAME, read-only unless --rw, holding the
region (and the read-write lease) for exactly the container's life.

The guest side (a VM and containers on one region) is
tests/avocado/test_broker_guest.py."""
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, '..', '..', 'tests'))
import brokerlib as B   # noqa: E402
from hvlib.podman import Podman, PodmanMissing   # noqa: E402

MiB = 1 << 20

# Run in the read-only container: what its root can and cannot do to the
# region and the pool.  $1: how many bytes to read, $2: the pool's name.
ATTACKS = r'''
p=$HVMEM_REGION_PATH
echo "size=$HVMEM_SIZE"
echo "read=$(head -c "$1" "$p")"
(printf x >"$p") 2>/dev/null && echo write-ok || echo write-refused
printf x | dd of="$p" conv=notrunc status=none 2>/dev/null && echo dd-ok || echo dd-refused
mount -o remount,rw "$p" 2>/dev/null && echo remount-ok || echo remount-refused
mount -o remount,bind,rw "$p" 2>/dev/null && echo bind-remount-ok || echo bind-remount-refused
(printf x >"$p") 2>/dev/null && echo write-after-remount-ok || echo write-after-remount-refused
echo "options=$(grep " $p " /proc/self/mountinfo | cut -d' ' -f6)"
echo "shm=[$(ls -A /dev/shm)]"
ls -d "/dev/shm/$2" >/dev/null 2>&1 && echo pool-visible || echo pool-hidden
echo "pool-mounts=$(grep -c "/$2" /proc/self/mountinfo)"
echo "pid=$$"
'''


@unittest.skipUnless(os.path.exists(B.HVMEMD), f'{B.HVMEMD} not built')
@unittest.skipUnless(os.geteuid() == 0, 'rootful podman needs root')
class PodmanRegionTest(unittest.TestCase):

    def setUp(self):
        try:
            self.pm = Podman()
            self.image = self.pm.image()
        except PodmanMissing as e:
            self.skipTest(str(e))
        self.names = []
        self.procs = []
        self.dir = tempfile.mkdtemp(prefix='hv-ctr-')
        os.chmod(self.dir, 0o755)            # a client under another uid connects
        self.pool = tempfile.mkdtemp(prefix='ctr-pool-', dir='/dev/shm')
        os.rmdir(self.pool)                 # hvmemd makes it
        self.broker = B.Broker(self.dir, self.pool)
        self.broker.start()
        self.c = self.broker.client()

    def tearDown(self):
        B.stop_podman_runs(self.procs, self.pm, self.names)
        self.c.close()
        self.broker.stop()
        shutil.rmtree(self.pool, ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def name(self):
        """A unique container name, removed in tearDown."""
        n = f'hvmem-test-{uuid.uuid4().hex[:12]}'
        self.names.append(n)
        return n

    def argv(self, region, name, *run_args, rw=False, hvmem_args=(), prefix=()):
        return list(prefix) + B.podman_run_argv(
            self.broker.sock, region,
            self.pm.argv('run', '--name', name, '--network', 'none', *run_args),
            rw=rw, hvmem_args=hvmem_args)

    def run_in(self, region, *cmd, rw=False, name=None, run_opts=(), prefix=(),
               check=True, input=None):
        """hvmem podman-run REGION -- podman ... run IMAGE CMD, to its end."""
        r = subprocess.run(self.argv(region, name or self.name(), *run_opts, self.image,
                                     *cmd, rw=rw, prefix=prefix),
                           capture_output=True, text=True, env=self.pm.env(),
                           timeout=120, input=input)
        if check:
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return r

    def start(self, region, name, *cmd, rw=False):
        """hvmem podman-run in the background; returns once the container runs."""
        p = subprocess.Popen(self.argv(region, name, self.image, *cmd, rw=rw),
                             env=self.pm.env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        self.procs.append(p)
        B.wait_container_running(self.pm, name, p)
        return p

    def exists(self, name):
        return self.pm.run('container', 'exists', name, check=False).returncode == 0

    def leased(self, region):
        return bool(self.c.lookup(region)['flags'] & B.LEASED)

    def mount_source(self, name):
        """The region's mount's source: a link to the pool file in hvmem's
        private directory, which goes with hvmem (and its guard)."""
        mounts = [m for m in self.pm.inspect(name)['Mounts']
                  if m['Destination'].startswith('/run/hvmem/')]
        self.assertEqual(len(mounts), 1, mounts)
        src = mounts[0]['Source']
        self.assertRegex(src, r'^/run/hvmem-podman-\w{6}/')
        self.assertTrue(os.path.realpath(src).startswith(self.pool + '/r-'), src)
        return src

    def exec_in(self, name, *cmd):
        return self.pm.run('exec', name, *cmd, timeout=60).stdout

    def region_bytes(self, region, n):
        _, fd = self.c.map(region)
        try:
            return os.pread(fd, n, 0)
        finally:
            os.close(fd)

    def test_writer_and_reader_share_a_region(self):
        """A read-write container's stores are seen, as they happen, by a
        read-only container running beside it (and by the host); the
        read-only container's root can neither write the region (EROFS),
        nor remount it read-write, nor reach the pool."""
        self.c.create('shared', 4 * MiB, 0o644)
        w, r = self.name(), self.name()
        self.start('shared', w, 'sleep', '600', rw=True)
        self.start('shared', r, 'sleep', '600')
        store = 'printf %s "$1" | dd of="$HVMEM_REGION_PATH" conv=notrunc status=none'
        load = 'head -c "$1" "$HVMEM_REGION_PATH"'
        for marker in ('first-store', 'second-store!'):
            self.exec_in(w, 'sh', '-c', store, 'sh', marker)
            self.assertEqual(self.exec_in(r, 'sh', '-c', load, 'sh', str(len(marker))),
                             marker)
        self.assertEqual(self.region_bytes('shared', 13), b'second-store!')

        out = self.exec_in(r, 'sh', '-c', ATTACKS, 'sh', '13',
                           os.path.basename(self.pool))
        for line in ('size=4194304', 'read=second-store!', 'write-refused', 'dd-refused',
                     'remount-refused', 'bind-remount-refused',
                     'write-after-remount-refused', 'shm=[]', 'pool-hidden',
                     'pool-mounts=1'):
            self.assertIn(line + '\n', out)
        self.assertRegex(out, r'options=ro[,\n]')
        self.assertEqual(self.region_bytes('shared', 14), b'second-store!\0')
        # its first process is pid 1 of its own namespace
        self.assertEqual(self.exec_in(r, 'cat', '/proc/1/comm').strip(), 'sleep')

    def test_read_only_container_attacks_as_its_main_process(self):
        """The same attacks from the container's own first process, and its
        exit status is hvmem's."""
        self.c.create('ro', 4 * MiB, 0o644)
        _, fd = self.c.map('ro', rw=True)
        os.pwrite(fd, b'host', 0)
        os.close(fd)
        self.c.release('ro')
        r = self.run_in('ro', 'sh', '-c', ATTACKS + 'exit 7', 'sh', '4',
                        os.path.basename(self.pool), check=False)
        self.assertEqual(r.returncode, 7, r.stderr)
        for line in ('read=host', 'write-refused', 'remount-refused',
                     'bind-remount-refused', 'write-after-remount-refused',
                     'shm=[]', 'pool-hidden', 'pool-mounts=1', 'pid=1'):
            self.assertIn(line + '\n', r.stdout)
        self.assertEqual(self.region_bytes('ro', 5), b'host\0')

    def test_lease_held_while_the_container_runs(self):
        """--rw holds the region's single lease while the container runs: a
        second --rw is refused (no container made), a read-only one is not;
        it goes when the container exits by itself and when it is killed."""
        self.c.create('leased', 4 * MiB)
        first = self.name()
        p = self.start('leased', first, 'sleep', '600', rw=True)
        src = self.mount_source(first)
        info = self.c.lookup('leased')
        self.assertTrue(info['flags'] & B.LEASED)
        self.assertEqual(info['lease_pid'], p.pid)
        second = self.name()
        r = subprocess.run(self.argv('leased', second, self.image, 'true', rw=True),
                           capture_output=True, text=True, env=self.pm.env(), timeout=60)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn('already has a read-write owner', r.stderr)
        self.assertFalse(self.exists(second))
        self.assertIn('ro-ok', self.run_in('leased', 'echo', 'ro-ok').stdout)

        self.pm.run('kill', first)
        self.assertEqual(p.wait(60), 137)
        self.assertFalse(self.exists(first))
        self.assertFalse(os.path.exists(os.path.dirname(src)))
        B.wait_for(lambda: not self.leased('leased'), timeout=5, what='the lease to go')

        # exits by itself: its status is hvmem's, the lease is gone with it
        r = self.run_in('leased', 'sh', '-c', 'exit 3', rw=True, check=False)
        self.assertEqual(r.returncode, 3, r.stderr)
        B.wait_for(lambda: not self.leased('leased'), timeout=5, what='the lease to go')
        os.close(self.c.map('leased', rw=True)[1])
        self.c.release('leased')

    def test_holder_killed_takes_the_container_with_it(self):
        """SIGKILL to hvmem: its guard removes the container (and the link
        its mount came from), and the lease goes only once the container is
        gone (never a moment with the lease free and the container still
        there)."""
        self.c.create('held', 4 * MiB)
        name = self.name()
        p = self.start('held', name, 'sleep', '600', rw=True)
        src = self.mount_source(name)
        t0 = time.monotonic()
        p.kill()
        p.wait(30)
        while self.leased('held'):
            self.assertLess(time.monotonic() - t0, 60, 'the lease stayed')
            time.sleep(0.02)
        self.assertFalse(self.exists(name), 'lease released, container still there')
        self.assertFalse(os.path.exists(os.path.dirname(src)))
        _, fd = self.c.map('held', rw=True)     # and nobody writes it any more
        os.close(fd)
        self.assertIn('removing container', p.stderr.read())

    def test_podman_failing_releases_the_region(self):
        """When podman cannot create or start the container, hvmem exits
        with podman's status, nothing is left, and the lease is free."""
        self.c.create('fail', 4 * MiB)
        name = self.name()
        r = subprocess.run(self.argv('fail', name, '--pull=never', 'localhost/no-such-image',
                                     'true', rw=True),
                           capture_output=True, text=True, env=self.pm.env(), timeout=60)
        self.assertEqual(r.returncode, 125, r.stderr)
        B.wait_for(lambda: not self.leased('fail'), timeout=5, what='the lease to go')
        self.assertFalse(self.exists(name))
        name = self.name()
        r = self.run_in('fail', '/no/such/command', rw=True, name=name, check=False)
        self.assertEqual(r.returncode, 125, r.stderr)
        self.assertIn('/no/such/command', r.stderr)
        B.wait_for(lambda: not self.leased('fail'), timeout=5, what='the lease to go')
        self.assertFalse(self.exists(name))

    def test_another_uid_refused(self):
        """The broker judges the caller's credentials: a uid the region's
        mode does not let read gets nothing, and podman never runs; nor does
        it for a uid that may read the region but is not root."""
        self.c.create('private', 4 * MiB, 0o600)
        name = self.name()
        nobody = ['setpriv', f'--reuid={B.NOBODY}', f'--regid={B.NOBODY}',
                  '--clear-groups']
        r = subprocess.run(self.argv('private', name, self.image, 'true', prefix=nobody),
                           capture_output=True, text=True, env=self.pm.env(), timeout=60)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn(f'uid {B.NOBODY} gid {B.NOBODY} no read permission', r.stderr)
        self.assertFalse(self.exists(name))
        # readable by all: the broker grants the descriptor, but the pool's
        # file is root's, so this caller (no rootful podman either) stops there
        self.c.create('public', 4 * MiB, 0o644)
        r = subprocess.run(self.argv('public', name, self.image, 'true', prefix=nobody),
                           capture_output=True, text=True, env=self.pm.env(), timeout=60)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("cannot reach the region's file", r.stderr)
        self.assertFalse(self.exists(name))

    def test_interactive_container_gets_stdin(self):
        """podman run -i: the container reads hvmem's standard input."""
        self.c.create('stdin', 4 * MiB)
        r = self.run_in('stdin', 'cat', run_opts=('-i',), input='typed in\n')
        self.assertEqual(r.stdout, 'typed in\n')

    def test_hostile_names_and_options_refused(self):
        """Names that would not be a plain file name in podman's --mount,
        unknown options, podman options that run elsewhere, and containers
        that would get past read-only or reach the pool are refused before
        anything runs; no container is left and no lease held."""
        self.c.create('target', 4 * MiB, 0o644)
        pool_file = f'{self.pool}/r-{self.c.lookup("target")["id"]}'
        self.assertTrue(os.path.exists(pool_file))

        def refused(region, run_opts, expect, rw=False, hvmem_args=(), podman=None):
            name = self.name()
            argv = self.argv(region, name, *run_opts, self.image, 'true', rw=rw,
                             hvmem_args=hvmem_args)
            if podman is not None:
                argv = argv[:argv.index('--') + 1] + podman
            r = subprocess.run(argv, capture_output=True, text=True, env=self.pm.env(),
                               timeout=60)
            self.assertEqual(r.returncode, 2, (region, run_opts, r.stdout, r.stderr))
            self.assertIn(expect, r.stderr, (region, run_opts))
            self.assertFalse(self.exists(name), (region, run_opts))
            B.wait_for(lambda: not self.leased('target'), timeout=5, what='the lease to go')

        for bad in ('../target', 'a/b', 'target,rw', 'x,src=/etc', 'a"b', "a'b",
                    'a b', '..', '.', '', 'x' * 256):
            refused(bad, (), 'bad region name')
        refused('target', (), 'usage', hvmem_args=('--rx',))
        podman = self.pm.argv('run', self.image, 'true')
        run = podman.index('run')
        for opts, expect in ((['--remote'], 'option --remote is not supported'),
                             (['-r'], 'option -r is not supported'),
                             (['--url=unix:/x'], 'option --url is not supported'),
                             (['--noout'], 'option --noout is not supported')):
            refused('target', (), expect, podman=podman[:run] + opts + podman[run:])
        for argv, expect in ((self.pm.argv('ps'), "'ps' is not podman's run command"),
                             (['podman', '--root'], 'option --root needs a value'),
                             (['podman', '--root', 'run'], 'no run command'),
                             (['podman', '--syslog=x', 'run'], 'takes no value')):
            refused('target', (), expect, podman=argv)

        for rw, opts, expect in (
                (False, ['--privileged'], 'privileged'),
                (True, ['--privileged'], 'privileged'),
                (False, ['--cap-add=SYS_ADMIN'], 'CAP_SYS_ADMIN'),
                (False, ['--cap-add', 'all'], 'CAP_SYS_ADMIN'),
                (False, ['--pid=host'], "host's pid namespace"),
                (True, ['--ipc=host'], 'mount at /dev/shm leads to'),
                (False, ['-v', '/dev/shm:/x'], 'mount at /x leads to'),
                (True, ['-v', f'{self.pool}/..//:/x:ro'], 'mount at /x leads to'),
                (False, ['--mount', f'type=bind,src={pool_file},dst=/other'],
                 'mount at /other leads to'),
                (False, ['-v', f'{self.pool}:/y'], 'mount at /y leads to')):
            refused('target', opts, expect, rw=rw)
        # the region's own mount point taken by something else: podman says no
        name = self.name()
        r = subprocess.run(self.argv('target', name, '-v', '/tmp:/run/hvmem/target',
                                     self.image, 'true'),
                           capture_output=True, text=True, env=self.pm.env(), timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertFalse(self.exists(name))
        # the broker is as it was, and a plain container still runs
        self.assertIn('fine', self.run_in('target', 'echo', 'fine').stdout)


if __name__ == '__main__':
    unittest.main()
