"""Ceph RBD as the distributed store (issue 19, part 1), against a real
single-node cluster (scripts/ceph-cluster.sh: one monitor, one OSD on
file-backed BlueStore, cephx on), started once for the class.

- QEMU's rbd driver with our build, as client.qemu (profile rbd);
- cephx enforced: an unknown key, and a key whose caps are for another
  pool, are refused;
- the hybrid format over RBD: an RBD image as the persistent tier
  (file.driver=rbd, created by qemu-img), and raw=on over an existing RBD
  image; restore from RBD; async crash consistency with RBD as the tier
  (SIGKILL, flushed writes survive);
- the store going away: the OSD stopped under a running QEMU turns into an
  I/O error after the configured timeout (not a hang), and the data is
  there when it comes back.
Skips, with the reason, where Ceph or QEMU's rbd driver is missing."""

import json
import os
import random
import signal
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, '..', '..', 'tests'))
import hybridlib as H   # noqa: E402
from hvlib.ceph import purge_for_class, start_for_class   # noqa: E402

MiB = 1024 * 1024
OP_TIMEOUT = 5


class RbdTest(H.ToolTest):

    @classmethod
    def setUpClass(cls):
        if not H.have_binaries():
            raise unittest.SkipTest(f'QEMU tools not built in {H.BIN}')
        start_for_class(cls, H.binary('qemu-img'), H.BUILD,
                        3301 + os.getpid() % 500, op_timeout=OP_TIMEOUT)

    @classmethod
    def tearDownClass(cls):
        purge_for_class(cls)

    def qemu_io(self, opts, *cmds, check=True, env=None):
        args = [H.binary('qemu-io'), '--image-opts', opts]
        for c in cmds:
            args += ['-c', c]
        r = subprocess.run(args, capture_output=True, text=True, timeout=180,
                           env=env or self.ceph.env)
        out = r.stdout + r.stderr
        if check:
            self.assertEqual(r.returncode, 0, out)
            self.assertNotIn('failed', out)
        return out

    def image(self, name, size='64M'):
        self.ceph.rbd('create', '--size', size, f'rbd/{name}')
        return name

    def nbd_read_all(self, sock, export):
        """Every byte of an NBD export on a unix socket."""
        out = self.tmp('out')
        H.qemu_img('convert', '-f', 'raw', '-O', 'raw',
                   f'nbd+unix:///{export}?socket={sock}', out)
        with open(out, 'rb') as f:
            return f.read()

    def cache_base(self, d, base_id=None):
        """query-clone-cache's base @base_id (else its only one) of daemon
        @d, once the fills queued so far are written."""
        deadline = time.monotonic() + 30
        while d.cmd('query-clone-cache')[0]['fill-pending']:
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.05)
        time.sleep(0.1)     # the last batch is published after it is written
        bases = d.cmd('query-clone-cache')[0]['bases']
        [b] = [b for b in bases if base_id is None or b['base-id'] == base_id]
        return b

    # -- the rbd driver and cephx --

    def test_rbd_blockdev_as_qemu_user(self):
        img = self.image('plain')
        self.qemu_io(self.ceph.blockdev(img), f'write -P 0x5c 0 {4 * MiB}',
                     f'read -P 0x5c 0 {4 * MiB}', f'read -P 0 {4 * MiB} {MiB}')
        # the admin sees what QEMU wrote
        r = subprocess.run(['rbd', 'export', f'rbd/{img}', self.tmp('exp')],
                           env=self.ceph.env, capture_output=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(self.tmp('exp'), 'rb') as f:
            self.assertEqual(f.read(4 * MiB), b'\x5c' * 4 * MiB)

    def test_cephx_refuses_unknown_and_unauthorized_clients(self):
        img = self.image('guarded')
        # a key the monitors never saw
        evil = self.tmp('client.evil.keyring')
        subprocess.run(['ceph-authtool', '--create-keyring', evil,
                        '--gen-key', '-n', 'client.evil'], check=True,
                       capture_output=True)
        env = dict(self.ceph.env)
        conf = self.tmp('evil.conf')
        with open(self.ceph.conf) as src, open(conf, 'w') as dst:
            dst.write(src.read().replace(
                f'keyring = {self.ceph.path}/$name.keyring', f'keyring = {evil}'))
        out = self.qemu_io(f'driver=rbd,pool=rbd,image={img},conf={conf},'
                           'user=evil', 'read 0 4k', check=False, env=env)
        self.assertRegex(out, r'(?i)permission denied|operation not permitted|'
                         r'error connecting|could not')
        # a real key, but its caps are for another pool
        self.ceph.ceph('auth', 'get-or-create', 'client.other', 'mon',
                       'profile rbd', 'osd', 'profile rbd pool=other', '-o',
                       os.path.join(self.ceph.path, 'client.other.keyring'))
        out = self.qemu_io(self.ceph.blockdev(img, user='other'),
                           'write -P 1 0 4k', check=False)
        self.assertRegex(out, r'(?i)permission denied|operation not permitted')
        self.assertNotIn('wrote 4096', out)

    # -- hybrid over RBD --

    def hybrid_opts(self, img, extra=''):
        return (f'driver=hybrid,{self.ceph.blockdev(img, prefix="file.")}'
                f'{extra}')

    def test_hybrid_on_rbd_created_by_qemu_img(self):
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o', 'mode=async',
                   self.ceph.filename('hyb1'), '64M')
        info = self.ceph.rbd('info', 'rbd/hyb1').stdout
        self.assertIn('size 64 MiB', info)
        self.qemu_io(self.hybrid_opts('hyb1'), f'write -P 0x21 0 {8 * MiB}',
                     f'write -P 0x22 {60 * MiB} {4 * MiB}', 'flush')
        # restore from RBD at the next open, then the data
        q = H.StorageDaemon(self.tmp, '--blockdev',
                            self.hybrid_opts('hyb1', ',node-name=hy'))
        self.procs.append(q)
        self.assertTrue(q.wait_restored(timeout=120)[0]['restore-done'],
                        'restore from RBD hung')
        info = q.cmd('query-hybrid')[0]
        q.stop()
        self.procs.remove(q)
        self.assertEqual(info['restore-bytes'], 64 * MiB)
        self.assertNotIn('error', info)
        self.qemu_io(self.hybrid_opts('hyb1'), f'read -P 0x21 0 {8 * MiB}',
                     f'read -P 0 {8 * MiB} {MiB}',
                     f'read -P 0x22 {60 * MiB} {4 * MiB}')
        r = H.qemu_img('check', '--image-opts', self.hybrid_opts('hyb1'),
                       check=False)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_hybrid_raw_over_existing_rbd_image(self):
        src = self.tmp('src.raw')
        with open(src, 'wb') as f:
            f.write(b'\x7a' * (4 * MiB) + bytes(28 * MiB))
        self.ceph.rbd('import', src, 'rbd/existing')
        self.qemu_io(self.hybrid_opts('existing', ',raw=on,mode=sync'),
                     f'read -P 0x7a 0 {4 * MiB}', f'write -P 0x7b {4 * MiB} {MiB}')
        self.ceph.rbd('export', 'rbd/existing', self.tmp('out.raw'))
        with open(self.tmp('out.raw'), 'rb') as f:
            data = f.read()
        self.assertEqual(len(data), 32 * MiB)
        self.assertEqual(data[:4 * MiB], b'\x7a' * (4 * MiB))
        self.assertEqual(data[4 * MiB:5 * MiB], b'\x7b' * MiB)

    def test_hybrid_async_sigkill_on_rbd(self):
        """Async mode over RBD: what a completed flush covered survives a
        SIGKILL of QEMU, round after round."""
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o', 'mode=async,ram-size=8M',
                   self.ceph.filename('crash'), '16M')
        rnd = random.Random(19)
        model = H.WriteModel(16 * MiB // H.WriteModel.SLOT, rnd, durable='flush')
        for rnd_no in range(3 if not H.LONG else 10):
            io = H.QemuIo(self.hybrid_opts('crash', ',dirty-limit=256k'))
            self.procs.append(io)
            model.run(io, rnd.randint(20, 60), flush_p=0.15)
            io.kill()
            self.procs.remove(io)
            raw = self.tmp('state.raw')
            H.qemu_img('convert', '--image-opts', self.hybrid_opts('crash'), '-O',
                       'raw', raw)
            with open(raw, 'rb') as f:
                model.check(f.read(), f'round {rnd_no}: ')

    def test_store_unreachable_then_back(self):
        """The OSD stops under a running QEMU: I/O fails within the op
        timeout instead of hanging; with the OSD back the data is there."""
        img = self.image('flaky')
        io = H.QemuIo(self.ceph.blockdev(img))
        self.procs.append(io)
        self.assertNotIn('failed', io.cmd(f'write -P 0x31 0 {MiB}'))
        self.assertNotIn('failed', io.cmd('flush'))
        os.kill(self.ceph.pid('osd.0'), signal.SIGKILL)
        try:
            t0 = time.monotonic()
            # librbd's write-back cache may take the write: the flush cannot
            out = io.cmd(f'write -P 0x32 {MiB} 64k', timeout=OP_TIMEOUT * 6)
            if 'failed' not in out:
                out += io.cmd('flush', timeout=OP_TIMEOUT * 6)
            waited = time.monotonic() - t0
            self.assertIn('failed', out)
            self.assertLess(waited, OP_TIMEOUT * 4)
            print(f'write with the OSD down failed after {waited:.1f} s: '
                  f'{out.strip()[:120]}', file=sys.stderr)
        finally:
            io.kill()
            self.procs.remove(io)
            self.ceph.start()          # restarts the stopped daemon
        # the monitor notices the new OSD within a few seconds
        deadline = time.monotonic() + 90
        while True:
            out = self.qemu_io(self.ceph.blockdev(img), f'read -P 0x31 0 {MiB}',
                               check=False)
            if 'read 1048576/1048576' in out and 'failed' not in out:
                break
            self.assertLess(time.monotonic(), deadline, out)
            time.sleep(1)

    # -- the clone cache over an RBD snapshot (part 2) --

    def test_clone_cache_over_rbd_snapshot(self):
        """A qemu-storage-daemon caches a protected RBD snapshot for the
        host: bytes equal `rbd export`'s, the second reader and a restarted
        daemon read nothing from the cluster, and the default generation
        (cluster, pool, image id, snapshot id: qemu-img info shows them)
        drops the entries when the snapshot is recreated under its name."""
        img = self.image('gold', size='16M')
        data = os.urandom(8 * MiB)
        src = self.tmp('src')
        with open(src, 'wb') as f:
            f.write(data)
        self.qemu_io(self.ceph.blockdev(img), f'write -s {src} 0 {8 * MiB}')
        self.ceph.rbd('snap', 'create', f'rbd/{img}@s1')
        self.ceph.rbd('snap', 'protect', f'rbd/{img}@s1')
        snaps = json.loads(self.ceph.rbd('snap', 'ls', '--format', 'json',
                                         f'rbd/{img}').stdout)
        snap_id = [x['id'] for x in snaps if x['name'] == 's1'][0]
        want = data + bytes(8 * MiB)
        sock = self.tmp('nbd.sock')

        def start():
            d = H.StorageDaemon(
                self.tmp, '--object', 'clone-cache,id=cc0,'
                f'filename={self.tmp("cc")},size=32M',
                '--blockdev', self.ceph.blockdev(img) +
                ',node-name=rbd0,snapshot=s1,read-only=on',
                '--blockdev', 'clone-cache,node-name=gold,store=cc0,'
                f'file=rbd0,read-only=on,base-id=rbd/{img}@s1',
                '--nbd-server', f'addr.type=unix,addr.path={sock}',
                '--export', 'nbd,id=e0,node-name=gold')
            self.procs.append(d)
            return d

        def read_all():
            return self.nbd_read_all(sock, 'gold')

        def stats(d):
            return self.cache_base(d)

        info = json.loads(H.qemu_img(
            'info', '--output=json', '--image-opts',
            self.ceph.blockdev(img) + ',snapshot=s1'
        ).stdout)['format-specific']['data']
        self.assertEqual(info['snapshot-id'], snap_id)
        self.assertTrue(info['image-id'] and info['cluster-fsid'])
        d = start()
        gen = d.cmd('query-clone-cache')[0]['bases'][0]['generation']
        self.assertNotEqual(gen, 0)
        self.assertEqual(read_all(), want)
        cold = stats(d)
        # the unwritten half is a hole in RBD: block status skips it
        self.assertGreaterEqual(cold['base-read-bytes'], 8 * MiB)
        self.assertEqual(cold['base-read-bytes'], cold['misses'] * 64 * 1024)
        self.assertEqual(read_all(), want)
        self.assertEqual(stats(d)['base-read-bytes'], cold['base-read-bytes'])
        d.stop()
        self.procs.remove(d)
        d = start()
        self.assertEqual(read_all(), want)
        warm = stats(d)
        self.assertEqual(warm['generation'], gen)
        self.assertEqual((warm['base-read-bytes'], warm['misses']), (0, 0))
        d.stop()
        self.procs.remove(d)
        # the snapshot is recreated with other data: a new id, a cold cache
        self.qemu_io(self.ceph.blockdev(img), f'write -P 0x77 0 {MiB}')
        self.ceph.rbd('snap', 'unprotect', f'rbd/{img}@s1')
        self.ceph.rbd('snap', 'rm', f'rbd/{img}@s1')
        self.ceph.rbd('snap', 'create', f'rbd/{img}@s1')
        snaps = json.loads(self.ceph.rbd('snap', 'ls', '--format', 'json',
                                         f'rbd/{img}').stdout)
        new_id = [x['id'] for x in snaps if x['name'] == 's1'][0]
        self.assertNotEqual(new_id, snap_id)
        d = start()
        base = d.cmd('query-clone-cache')[0]['bases'][0]
        self.assertEqual(base['entries'], 0)
        self.assertNotEqual(base['generation'], gen)
        got = read_all()
        self.assertEqual(got[:MiB], b'\x77' * MiB)
        self.assertEqual(got[MiB:], want[MiB:])

    def test_full_copy_served_from_the_origin_cache(self):
        """A full copy made by the storage (rbd deep cp of the origin's
        snapshot, no byte through this host) and given to the cache with
        copy-of: once the origin's readers have warmed the cache, reading
        the whole copy reads nothing from the cluster, and returns the
        copy's bytes (issue 40, target 7)."""
        img = self.image('origin', size='8M')
        data = os.urandom(8 * MiB)
        src = self.tmp('src')
        with open(src, 'wb') as f:
            f.write(data)
        self.qemu_io(self.ceph.blockdev(img), f'write -s {src} 0 {8 * MiB}')
        self.ceph.rbd('snap', 'create', f'rbd/{img}@s1')
        # the copy gets the snapshot too (deep cp copies snapshots)
        self.ceph.rbd('deep', 'cp', f'rbd/{img}@s1', 'rbd/copy')
        sock = self.tmp('nbd.sock')
        d = H.StorageDaemon(
            self.tmp, '--object', 'clone-cache,id=cc0,'
            f'filename={self.tmp("cc")},size=32M',
            '--blockdev', self.ceph.blockdev(img) +
            ',node-name=rbd0,snapshot=s1,read-only=on',
            '--blockdev', 'clone-cache,node-name=origin,store=cc0,'
            f'file=rbd0,read-only=on,base-id=rbd/{img}@s1',
            '--blockdev', self.ceph.blockdev('copy') +
            ',node-name=rbd1,snapshot=s1,read-only=on',
            '--blockdev', 'clone-cache,node-name=copy,store=cc0,'
            f'file=rbd1,read-only=on,base-id=rbd/copy@s1,'
            f'copy-of=rbd/{img}@s1',
            '--nbd-server', f'addr.type=unix,addr.path={sock}',
            '--export', 'nbd,id=e0,node-name=origin',
            '--export', 'nbd,id=e1,node-name=copy')
        self.procs.append(d)

        self.assertEqual(self.nbd_read_all(sock, 'origin'), data)
        self.assertEqual(self.cache_base(d, f'rbd/{img}@s1')['base-read-bytes'],
                         8 * MiB)
        self.assertEqual(self.nbd_read_all(sock, 'copy'), data)
        copy = self.cache_base(d, 'rbd/copy@s1')
        self.assertEqual((copy['base-read-bytes'], copy['misses']), (0, 0))
        self.assertEqual(copy['hits'], 8 * MiB // (64 * 1024))


if __name__ == '__main__':
    unittest.main()
