"""Containers on broker regions (issue 20, user 3): broker/hvmem-container
runs a command in its own mount and pid namespaces with the region
bind-mounted at /run/hvmem/NAME, read-only unless the broker granted the
read-write lease.  Real hvmemd, real namespaces and mounts; loads and stores
are made through mmap inside the containers."""
import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import brokerlib as B   # noqa: E402

CONTAINER = os.path.join(B.REPO, 'broker', 'hvmem-container')
MiB = 1 << 20
PY = B.SYSTEM_PYTHON

STORE = ("import mmap, os, sys; f = open(os.environ['HVMEM_REGION_PATH'], 'r+b'); "
         "m = mmap.mmap(f.fileno(), 0); m[0:len(sys.argv[1])] = sys.argv[1].encode(); "
         "print('stored')")
LOAD = ("import mmap, os, sys; f = open(os.environ['HVMEM_REGION_PATH'], 'rb'); "
        "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); print(m[0:int(sys.argv[1])].decode())")
ATTACKS = r'''
import errno, mmap, os, subprocess
p = os.environ['HVMEM_REGION_PATH']
def tryit(name, fn):
    try:
        fn(); print(name, 'ok')
    except OSError as e:
        print(name, errno.errorcode[e.errno])
tryit('open-rw', lambda: open(p, 'r+b'))
f = open(p, 'rb')
tryit('mmap-write', lambda: mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ | mmap.PROT_WRITE))
r = subprocess.run(['mount', '-o', 'remount,bind,rw', p], capture_output=True)
print('remount', 'ok' if r.returncode == 0 else 'refused')
print('shm', sorted(os.listdir('/dev/shm')))
print('pid', os.getpid())
'''


def host_mounts():
    with open('/proc/self/mountinfo') as f:
        return [l for l in f if '/run/hvmem' in l]


@unittest.skipUnless(os.path.exists(B.HVMEMD), f'{B.HVMEMD} not built')
@unittest.skipUnless(os.geteuid() == 0, 'mount namespaces need root')
class ContainerTest(unittest.TestCase):

    def setUp(self):
        self.pool = tempfile.mkdtemp(prefix='container-pool-', dir='/dev/shm')
        os.rmdir(self.pool)
        self.dir = tempfile.mkdtemp(prefix='hv-ctr-')
        self.broker = B.Broker(self.dir, self.pool)
        self.broker.start()
        self.c = self.broker.client()
        self.env = dict(os.environ, HVMEM=B.HVMEM)
        self.before = host_mounts()

    def tearDown(self):
        self.c.close()
        self.broker.stop()
        shutil.rmtree(self.pool, ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def run_in(self, region, *cmd, rw=False, prefix=(), check=True):
        args = list(prefix) + [CONTAINER, '-s', self.broker.sock] + \
            (['--rw'] if rw else []) + [region, '--'] + list(cmd)
        r = subprocess.run(args, capture_output=True, text=True, env=self.env,
                           timeout=60)
        if check:
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return r

    def test_stores_cross_both_ways(self):
        self.c.create('shared', 4 * MiB)
        self.assertIn('stored', self.run_in('shared', PY, '-c', STORE, 'from-A',
                                            rw=True).stdout)
        self.assertEqual(self.run_in('shared', PY, '-c', LOAD, '6').stdout.strip(),
                         'from-A')
        self.assertIn('stored', self.run_in('shared', PY, '-c', STORE, 'from-B!',
                                            rw=True).stdout)
        self.assertEqual(self.run_in('shared', PY, '-c', LOAD, '7').stdout.strip(),
                         'from-B!')
        # and a process outside containers, through the broker, sees it too
        _, fd = self.c.map('shared')
        self.assertEqual(os.pread(fd, 7, 0), b'from-B!')
        os.close(fd)
        self.assertEqual(host_mounts(), self.before, 'a mount leaked to the host')

    def test_read_only_container_cannot_write_or_escape(self):
        self.c.create('ro', 4 * MiB, 0o644)
        out = self.run_in('ro', PY, '-c', ATTACKS).stdout
        self.assertIn('open-rw EROFS', out)
        self.assertIn('mmap-write EACCES', out)
        self.assertIn('remount refused', out)
        self.assertIn("shm []", out)            # the pool is not reachable
        self.assertIn('pid 1', out)             # its own pid namespace
        _, fd = self.c.map('ro')
        self.assertEqual(os.pread(fd, 16, 0), bytes(16))
        os.close(fd)

    def test_lease_held_while_running_and_released_at_death(self):
        """The runner holds the lease while the container runs; killing the
        runner alone releases it, but the container lives on and can still
        write, so no other read-write owner is admitted until it is gone."""
        self.c.create('leased', 4 * MiB)
        p = subprocess.Popen([CONTAINER, '-s', self.broker.sock, '--rw', 'leased', '--',
                              'sleep', '60'], env=self.env, start_new_session=True)
        try:
            B.wait_for(lambda: self.c.lookup('leased')['flags'] & B.LEASED,
                       what='the lease')
            other = self.broker.client()
            with self.assertRaises(B.BrokerError) as e:
                other.map('leased', rw=True)
            self.assertEqual(e.exception.errno, errno.EBUSY)
            r = self.run_in('leased', PY, '-c', STORE, 'x', rw=True, check=False)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn('read-write owner', r.stderr)
            p.kill()                     # the runner (hvmem) only
            p.wait(30)
            B.wait_for(lambda: not self.c.lookup('leased')['flags'] & B.LEASED,
                       what='the lease to go')
            with self.assertRaises(B.BrokerError) as e:
                other.map('leased', rw=True)
            self.assertEqual(e.exception.errno, errno.EBUSY)
            self.assertIn('still open for writing', e.exception.msg)
            os.killpg(p.pid, signal.SIGKILL)     # the container too

            def mapped():
                try:
                    os.close(other.map('leased', rw=True)[1])
                    return True
                except B.BrokerError:
                    return False
            B.wait_for(mapped, what='a read-write map once the container is gone')
            other.close()
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        B.wait_for(lambda: host_mounts() == self.before, what='no mount left')

    def test_another_uid_refused(self):
        self.c.create('private', 4 * MiB, 0o600)
        nobody = ['setpriv', f'--reuid={B.NOBODY}', f'--regid={B.NOBODY}', '--clear-groups']
        r = self.run_in('private', 'true', prefix=nobody, check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn('denied', r.stderr.lower())

    def test_bad_usage(self):
        for args in (['../x', '--', 'true'], ['a/b', '--', 'true'], ['x', 'true'],
                     ['--hide', 'rel', 'x', '--', 'true']):
            r = subprocess.run([CONTAINER, '-s', self.broker.sock] + args,
                               capture_output=True, text=True, env=self.env, timeout=30)
            self.assertEqual(r.returncode, 2, args)
        r = self.run_in('missing', 'true', check=False)
        self.assertEqual(r.returncode, 1)
        self.assertIn("no region 'missing'", r.stderr)


if __name__ == '__main__':
    unittest.main()
