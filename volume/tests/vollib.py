"""Helpers for the volume tests: a private volumes directory and run
directory, the real hvvol library and command on them, and a tear-down that
leaves no daemon, loop device or mount behind whatever a test did (it
kills, unmounts lazily and detaches, which hvvol itself never does).  Not a
test file itself (no test_ prefix)."""

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, TOP)
sys.path.insert(0, os.path.join(TOP, 'tests'))
sys.path.insert(0, os.path.join(TOP, 'broker', 'tests'))

from brokerlib import wait_for                           # noqa: E402
from volume import host                                  # noqa: E402
from volume import hvvol as hvvol_mod                    # noqa: E402
from volume.hvvol import Tools, Volumes                  # noqa: E402

HVVOL = os.path.join(TOP, 'volume', 'hvvol')
MiB = 1 << 20


def missing_tools():
    """Why the real-system tests cannot run here, or None."""
    if os.geteuid() != 0:
        return 'needs root (loop devices, mounts)'
    t = Tools()
    for path in (t.qsd, t.qemu_img):
        if not os.access(path, os.X_OK):
            return f'{path} is not built'
    for tool in ('losetup', 'mkfs.ext4', 'blkid', 'e2fsck', 'mount', 'umount'):
        if not shutil.which(tool):
            return f'{tool} is not installed'
    if not os.path.exists('/dev/fuse'):
        return 'no /dev/fuse'
    p = subprocess.run([t.qsd, '--export', 'type=fuse,id=x,node-name=x,mountpoint=/'],
                       capture_output=True, text=True)
    if "does not accept value 'fuse'" in p.stderr:
        return 'qemu-storage-daemon was built without FUSE exports (--enable-fuse)'
    return None


def write_files(root, n, rnd, max_size=256 * 1024):
    """n files of random sizes and contents under root (in a few
    directories); returns {relative path: sha256}."""
    sums = {}
    for i in range(n):
        rel = os.path.join(f'd{i % 7}', f'f{i:04d}')
        os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        data = rnd.randbytes(rnd.randint(0, max_size))
        with open(os.path.join(root, rel), 'wb') as f:
            f.write(data)
        sums[rel] = hashlib.sha256(data).hexdigest()
    return sums


def check_files(root, sums):
    """The relative paths whose content is not what sums says."""
    bad = []
    for rel, digest in sums.items():
        try:
            with open(os.path.join(root, rel), 'rb') as f:
                if hashlib.sha256(f.read()).hexdigest() != digest:
                    bad.append(rel)
        except OSError as exc:
            bad.append(f'{rel}: {exc.strerror}')
    return bad


class VolumeTest(unittest.TestCase):
    """A private config and run directory under /tmp, removed afterwards
    with everything a volume left there."""

    def setUp(self):
        why = missing_tools()
        if why:
            self.skipTest(why)
        self.tmp = tempfile.mkdtemp(prefix='hvvol-test-')
        self.conf = os.path.join(self.tmp, 'vols')
        self.run_dir = os.path.join(self.tmp, 'run')
        self.vols = Volumes(self.conf, self.run_dir)
        self.rnd = random.Random(os.environ.get('HVVOL_SEED', self.id()))
        self.extra_mounts = []      # file systems a test mounted itself (tmpfs...)

    def tearDown(self):
        for name in self.vols.names():
            self.force_down(name)
        for m in reversed(self.extra_mounts):
            subprocess.run(['umount', '-l', m], capture_output=True)
        # never rmtree through a mount
        for m in host.mountinfo():
            if m['target'].startswith(self.tmp + '/'):
                subprocess.run(['umount', '-l', m['target']], capture_output=True)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def force_down(self, name):
        """Whatever state the volume is in, nothing of it keeps running."""
        st = self.vols._state(name)
        if st is None:
            return
        try:
            self.vols.umount(name)
            return
        except Exception:           # noqa: BLE001 (tear-down: then by force)
            pass
        st = self.vols._state(name) or st
        for pid in (st.get('pid'), st.get('wrapper_pid')):
            if pid and host.start_time(pid) is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if st.get('mountpoint'):
            subprocess.run(['umount', '-l', st['mountpoint']], capture_output=True)
        export = os.path.join(self.run_dir, name, 'export')
        for loop in host.loops_backed_by(export):
            subprocess.run(['losetup', '-d', loop], capture_output=True)
        subprocess.run(['umount', '-l', export], capture_output=True)
        for pid, child in list(hvvol_mod._CHILDREN.items()):
            if child.poll() is not None:
                hvvol_mod._CHILDREN.pop(pid, None)

    # -- helpers --
    def mountpoint(self, name='mnt'):
        path = os.path.join(self.tmp, name)
        os.makedirs(path, exist_ok=True)
        return path

    def hvvol(self, *args, check=True, env=None):
        """The command as a user runs it; CompletedProcess."""
        p = subprocess.run([HVVOL, '--dir', self.conf, '--run-dir', self.run_dir] +
                           [str(a) for a in args], capture_output=True, text=True,
                           timeout=300, env=env)
        if check and p.returncode != 0:
            raise AssertionError(f'hvvol {args} failed ({p.returncode}): {p.stderr}')
        return p

    def state(self, name):
        return self.vols._state(name)

    def kill_daemon(self, name):
        st = self.state(name)
        os.kill(st['pid'], signal.SIGKILL)
        wait_for(lambda: not host.alive(st['pid'], st['start']), what='the daemon to die')
        hvvol_mod._reap(st['pid'])
        return st

    def small_fs(self, size='64M', fstype='tmpfs'):
        """A small file system of its own (for a full disk)."""
        d = os.path.join(self.tmp, f'small{len(self.extra_mounts)}')
        os.makedirs(d)
        subprocess.run(['mount', '-t', fstype, '-o', f'size={size},mode=0700', fstype, d],
                       check=True)
        self.extra_mounts.append(d)
        return d

    def image_clean(self, image):
        info = self.vols._image_info(image)['format-specific']['data']
        return not info['dirty'] and not info.get('region-held')

    def fsck(self, name):
        """e2fsck -fn on the volume's image, converted to raw (the volume
        is stopped): (exit status, output)."""
        cfg = self.vols._config(name)
        raw = os.path.join(self.tmp, f'{name}.raw')
        subprocess.run([self.vols.tools.qemu_img, 'convert', '-f', 'hybrid', '-O', 'raw',
                        cfg['image'], raw], check=True, capture_output=True)
        p = subprocess.run(['e2fsck', '-fn', raw], capture_output=True, text=True)
        os.unlink(raw)
        return p.returncode, p.stdout + p.stderr
