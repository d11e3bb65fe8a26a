"""A real single-node Ceph cluster for tests (scripts/ceph-cluster.sh).

    with CephCluster(tmpdir) as ceph:      # or ceph.start() / ceph.purge()
        ceph.rbd('create', '--size', '64M', 'rbd/img')
        ceph.blockdev('img')               # -blockdev options for QEMU's rbd driver

Missing Ceph packages or a QEMU without the rbd driver raise
unittest.SkipTest with the reason (a test that needs the store skips, never
passes silently)."""

import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, 'scripts', 'ceph-cluster.sh')


def unavailable(qemu_img):
    """Why a Ceph test cannot run here, or None."""
    for b in ('ceph-mon', 'ceph-osd', 'ceph', 'rbd', 'uuidgen'):
        if not shutil.which(b):
            return f'{b} is not installed (scripts/setup-host.sh installs Ceph)'
    r = subprocess.run([qemu_img, '--help'], capture_output=True, text=True)
    if ' rbd' not in r.stdout:
        return f'{qemu_img} has no rbd driver (configure --enable-rbd)'
    return None


class CephCluster:
    def __init__(self, path, port=3301, op_timeout=20, addr=None, netns=None):
        """addr/netns: the daemons' address, and the network namespace they
        run in (scripts/ceph-cluster.sh CEPH_ADDR, CEPH_NETNS)."""
        self.path = path
        self.env = dict(os.environ, CEPH_MON_PORT=str(port),
                        CEPH_OP_TIMEOUT=str(op_timeout))
        if addr:
            self.env['CEPH_ADDR'] = addr
        if netns:
            self.env['CEPH_NETNS'] = netns
        self.conf = os.path.join(path, 'ceph.conf')
        self.env['CEPH_CONF'] = self.conf
        self.keyring = os.path.join(path, 'client.qemu.keyring')

    def _script(self, verb):
        r = subprocess.run([SCRIPT, verb, self.path], capture_output=True,
                           text=True, env=self.env, timeout=300)
        if r.returncode != 0:
            logs = ''
            logdir = os.path.join(self.path, 'log')
            if os.path.isdir(logdir):
                for fn in sorted(os.listdir(logdir)):
                    with open(os.path.join(logdir, fn), errors='replace') as f:
                        logs += f'--- {fn}\n' + f.read()[-1500:]
            raise RuntimeError(f'ceph-cluster.sh {verb} failed ({r.returncode}): '
                               f'{r.stderr}{logs}')
        return r.stdout

    def start(self):
        self._script('start')
        return self

    def stop(self):
        self._script('stop')

    def purge(self):
        self._script('purge')

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.purge()

    def run(self, *args, check=True, timeout=120):
        """A Ceph CLI command as client.admin."""
        r = subprocess.run(list(args), capture_output=True, text=True,
                           env=self.env, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f'{" ".join(args)}: {r.stderr.strip()}')
        return r

    def rbd(self, *args, **kw):
        return self.run('rbd', *args, **kw)

    def ceph(self, *args, **kw):
        return self.run('ceph', *args, **kw)

    def pid(self, daemon):
        with open(os.path.join(self.path, 'run', f'{daemon}.pid')) as f:
            return int(f.read().strip())

    def blockdev(self, image, user='qemu', pool='rbd', prefix=''):
        """Dotted -blockdev/--image-opts options of QEMU's rbd driver."""
        return (f'{prefix}driver=rbd,{prefix}pool={pool},{prefix}image={image},'
                f'{prefix}conf={self.conf},{prefix}user={user}')

    def filename(self, image, user='qemu', pool='rbd'):
        """The rbd: pseudo-filename (qemu-img create/convert)."""
        return f'rbd:{pool}/{image}:id={user}:conf={self.conf}'


def start_for_class(cls, qemu_img, build_dir, port, **kw):
    """A test class's cluster, in cls.ceph (its files in cls.dir, under
    @build_dir: BlueStore needs O_DIRECT, which /tmp's tmpfs may not have);
    unittest.SkipTest with the reason where Ceph cannot run.  Pair with
    purge_for_class() in tearDownClass."""
    why = unavailable(qemu_img)
    if why:
        raise unittest.SkipTest(why)
    cls.dir = tempfile.mkdtemp(prefix='ceph-', dir=build_dir)
    cls.ceph = start_cluster(cls.dir, cls.dir, port, **kw)


def start_cluster(directory, owned, port, **kw):
    """A started CephCluster with its files in @directory; if it does not
    start, it is purged and @owned (the directory the caller made for it)
    removed before the error goes on."""
    ceph = CephCluster(directory, port=port, **kw)
    t0 = time.monotonic()
    try:
        ceph.start()
    except Exception:
        ceph.purge()
        shutil.rmtree(owned, ignore_errors=True)
        raise
    print(f'\nceph cluster up in {time.monotonic() - t0:.1f} s', file=sys.stderr)
    return ceph


def purge_for_class(cls):
    cls.ceph.purge()
    shutil.rmtree(cls.dir, ignore_errors=True)
