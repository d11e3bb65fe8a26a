"""docs/deploy.md, "From a fresh host to running guests", as written
(issue 38, items 5 and 6).

The packages from `make deb` (scripts/build-debs.sh) and a clean Debian 12
root (pkgroot.Root); the section's first block (Install) runs there with
apt (chroot, the host's network), then the root boots with systemd as PID 1
and a network of its own, and every later block of the section runs in it,
in order, as root in a directory holding build/guest/ (the test guest, as
in the source tree), each block with `sh -eu`.  A failing block fails the
test with its line in the doc and its output.  Afterwards the test checks
what the blocks should have made: a Redis guest with the module on a hybrid
disk owned by libvirt-qemu while it runs (and by root again after),
app-assist's port open, a broker region held by QEMU as the second disk's
RAM tier, two clones booting through hvcache@gold (the cache filled), and
hvarbiter (under its unit) linked to both clones through libvirt and to the
podman container.

What this machine needs beyond the doc, each only because of the test
host (a real Debian 12 host has none of these problems):
- the host's SSD: a loop device over a file (direct I/O), formatted and
  mounted on /var/lib/hybridvm as /dev/nvme0n1;
- systemd-nspawn mounts the cgroup v1 controllers read-only: they are
  remounted read-write (libvirt and podman make their groups there);
- podman: runc, no default ulimits (crun refuses this host's mixed cgroup
  layout; the host's open-files limit is below podman's default), and the
  container image the doc names imported offline (no registry here) from
  the project's test image, which has redis-server;
- no KVM: the doc's own `test -e /dev/kvm ||` lines switch the domains to TCG.
"""

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pkgroot                                           # noqa: E402
from pkgroot import REPO, BUILD, Root, build_debs, skip_reason  # noqa: E402

sys.path.insert(0, os.path.join(REPO, 'tests'))
from hvlib import docblocks                              # noqa: E402
from hvlib import podman as hvpodman                     # noqa: E402

DEPLOY = os.path.join(REPO, 'docs', 'deploy.md')
SECTION = 'From a fresh host to running guests'
GUEST_FILES = ('vmlinuz', 'initrd.img', 'rootfs.ext4')
DOC_IMAGE = 'docker.io/library/redis:7'
CONTAINERS_CONF = '[containers]\ndefault_ulimits = []\n[engine]\nruntime = "runc"\n'


def section_blocks():
    """The runnable sh blocks of SECTION, in order."""
    with open(DEPLOY) as f:
        lines = f.read().split('\n')
    start = lines.index(f'## {SECTION}') + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith('## ')), len(lines))
    return docblocks.runnable(DEPLOY, only=lambda b: start < b.line <= end)


def why_not():
    reason = skip_reason()
    if reason:
        return reason
    for f in GUEST_FILES:
        if not os.path.exists(os.path.join(BUILD, 'guest', f)):
            return f'the test guest is not built (make guest): no {f}'
    return None


@unittest.skipIf(why_not(), why_not())
class DeployWalkthroughTest(unittest.TestCase):

    def setUp(self):
        os.makedirs(pkgroot.CACHE, exist_ok=True)
        self.work = tempfile.mkdtemp(prefix='deploy-', dir=pkgroot.CACHE)
        self.box = Root(self.work, private_network=True)
        self.loop = None
        self.t0 = time.monotonic()

    def tearDown(self):
        self.box.poweroff()
        if self.loop:
            subprocess.run(['losetup', '-d', self.loop], capture_output=True)
        shutil.rmtree(self.work, ignore_errors=True)

    def log(self, what):
        print(f'[{time.monotonic() - self.t0:6.1f} s] {what}', flush=True)

    def block(self, b):
        """Run one doc block in the root, in /root, as `sh -eu`; its stdout."""
        r = self.box.sh(f'cd /root && exec sh -euc {shlex.quote(b.body)}', check=False,
                        timeout=600)
        if r.returncode != 0:
            raise docblocks.BlockFailed(
                f'exit status {r.returncode} in the block at {DEPLOY}:{b.line}:\n{b.body}'
                f'--- stdout:\n{r.stdout[-4000:]}--- stderr:\n{r.stderr[-4000:]}')
        return r.stdout

    def ssd(self):
        """The host's SSD (see the docstring): a loop device, ext4."""
        img = os.path.join(self.work, 'nvme0n1.img')
        with open(img, 'wb') as f:
            f.truncate(4 << 30)
        self.loop = subprocess.run(['losetup', '--find', '--show', '--direct-io=on', img],
                                   capture_output=True, text=True, check=True).stdout.strip()
        subprocess.run(['mkfs.ext4', '-q', self.loop], check=True)
        return os.stat(self.loop).st_rdev

    def test_walkthrough(self):
        blocks = section_blocks()
        self.assertGreaterEqual(len(blocks), 6, 'the walkthrough lost its blocks')
        install, rest = blocks[0], blocks[1:]
        self.assertIn('apt-get install', install.body)

        debs, version = build_debs(os.path.join(self.work, 'debs'), 1)
        self.box.unpack()
        root = self.box.path
        os.makedirs(root + '/root/build/debs')
        for d in debs:
            shutil.copy(d, root + '/root/build/debs')
        os.makedirs(root + '/root/build/guest')
        for f in GUEST_FILES:
            shutil.copy(os.path.join(BUILD, 'guest', f), root + '/root/build/guest')
        image_tar = hvpodman.build_image_tar()
        shutil.copy(image_tar, root + '/root/image.tar')
        self.log(f'built {version}; a clean root with the guest files')

        self.block(install)
        self.box.sh('apt-get install -y -q --no-install-recommends runc', timeout=600)
        os.makedirs(root + '/etc/containers', exist_ok=True)
        with open(root + '/etc/containers/containers.conf', 'w') as f:
            f.write(CONTAINERS_CONF)
        self.log(f'the Install block ({DEPLOY}:{install.line}) ran')

        rdev = self.ssd()
        self.box.boot()
        self.box.sh('for c in /sys/fs/cgroup/*/; do mount -o remount,bind,rw "$c"; done; '
                    f'mknod /dev/nvme0n1 b {os.major(rdev)} {os.minor(rdev)} && '
                    'mkdir -p /var/lib/hybridvm && mount /dev/nvme0n1 /var/lib/hybridvm && '
                    f'podman import --change CMD=/bin/sh /root/image.tar {DOC_IMAGE} >/dev/null '
                    '&& rm /root/image.tar')
        self.log('booted (systemd, libvirtd, hvmemd); the SSD mounted, the image imported')

        out = {}
        for b in rest:
            out[b.line] = self.block(b)
            self.log(f'{DEPLOY}:{b.line} ran')
        text = ''.join(out.values())
        self.check_redis_guest(text)
        self.check_region(text)
        self.check_clones()
        self.check_arbiter()
        self.check_release()

    # -- what the blocks made -------------------------------------------------
    def sh(self, cmd):
        return self.box.sh(cmd).stdout

    def qmp(self, dom, command):
        return json.loads(self.sh(f"virsh qemu-monitor-command {dom} "
                                  f"'{json.dumps({'execute': command})}'"))['return']

    def check_redis_guest(self, text):
        self.assertIn('libvirt-qemu /var/lib/hybridvm/images/redis1.hybrid', text)
        self.assertIn('appassist', text)     # MODULE LIST
        self.assertEqual(self.sh('redis-cli -p 6379 GET greeting').strip(), 'hello')
        aa = [c for c in self.qmp('redis1', 'query-chardev') if c['label'] == 'aa0']
        self.assertEqual([c['frontend-open'] for c in aa], [True],
                         "the guest's module has not opened the app-assist port")

    def check_region(self, text):
        nodes = {n['node-name']: n for n in self.qmp('redis1', 'query-hybrid')}
        self.assertEqual(set(nodes), {'hroot', 'data0'}, nodes)
        self.assertIn('redis1-data', text)
        # QEMU holds the region read-write: the broker grants no second writer
        r = self.box.sh('hvmem map redis1-data --rw -- true', check=False)
        self.assertNotEqual(r.returncode, 0, 'a second writer was let in')
        self.assertIn('busy', (r.stdout + r.stderr).lower())

    def check_clones(self):
        """Both clones run and the cache filled from the base."""
        for vm in ('desk1', 'desk2'):
            self.assertEqual(self.sh(f'virsh domstate {vm}').strip(), 'running', vm)
        code = ('import json, sys; sys.path.insert(0, "/usr/lib/hybridvm/python"); import hvqmp\n'
                'q = hvqmp.QMP("/run/hybridvm/clone-cache/gold.qmp", timeout=10).connect()\n'
                'print(json.dumps(q.cmd("query-clone-cache")))')
        deadline = time.monotonic() + 300
        while True:
            [c] = json.loads(self.sh(f'python3 -c {shlex.quote(code)}'))
            reads = sum(b['hits'] + b['misses'] for b in c['bases'])
            if reads > 100 and sum(b['fills'] for b in c['bases']) > 0:
                break
            self.assertLess(time.monotonic(), deadline, f'the clones read little: {c}')
            time.sleep(2)
        self.log(f'clone cache: {reads} reads, {c["used"]} blocks used')

    def check_arbiter(self):
        self.assertEqual(self.sh('systemctl is-active hvarbiter').strip(), 'active')
        deadline = time.monotonic() + 120
        while True:
            s = json.loads(self.sh('hvarbiter status /etc/hybridvm/arbiter.conf'))
            states = {vm: st['state'] for vm, st in s.get('vm_state', {}).items()}
            if states == {'desk1': 'ok', 'desk2': 'ok'} and \
                    s.get('container', {}).get('probe_samples') and \
                    s.get('podman', {}).get('db', {}).get('state') == 'found':
                break
            self.assertLess(time.monotonic(), deadline, json.dumps(s, indent=1))
            time.sleep(1)

    def check_release(self):
        """Stopped, the image is root's again (the hook's DAC release)."""
        self.sh('virsh destroy redis1')
        self.assertEqual(self.sh('stat -c %U /var/lib/hybridvm/images/redis1.hybrid').strip(),
                         'root')


if __name__ == '__main__':
    unittest.main()
