"""SIGKILL of a volume's qemu-storage-daemon under a podman container that
writes (issue 37, item 3), and containers that keep a volume busy.

- async mode, RAM tier in anonymous memory: a container writes files, each
  fsync'd (and its directory), and logs each one after its fsync returned;
  another writer in it churns a file without syncing.  The daemon is killed
  at a random moment; the container fails and goes; `hvvol mount` cleans
  up and mounts again: every logged file is intact; after umount, e2fsck -fn
  is clean.  Rounds on one volume (2; 6 with HYBRIDVM_LONG=1).
- async mode, RAM tier in a memory broker region (ram-file): a container
  overwrites 4 KiB records of a preallocated file with O_DIRECT and no
  fsync, and logs each write once dd returned (the daemon acknowledged it).
  After the kill and the mount, every slot holds its last acknowledged
  record (or the one that was in flight); e2fsck -fn clean.
- a running container with the volume bind-mounted: umount is refused
  naming the container; so is the recovery of a dead volume it still has.
"""

import os
import re
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vollib import VolumeTest, wait_for          # noqa: E402
from volume.errors import Busy                    # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..',
                                'broker', 'tests'))
import brokerlib as B                             # noqa: E402
from hvlib.podman import Podman, PodmanMissing    # noqa: E402

LONG = os.environ.get('HYBRIDVM_LONG') == '1'
ROUNDS = 6 if LONG else 2

# Files of 1-300 KiB, each fsync'd with its directory, then logged with its
# sum; a second writer rewrites 4 MiB without ever syncing.
FSYNC_WRITER = r'''
set -u
r=$1
( while dd if=/dev/urandom of=/data/churn-$r bs=1M count=4 status=none 2>/dev/null; do :; done ) &
i=0
while :; do
  d=/data/r$r/d$((i % 8)); f=$d/f$i
  mkdir -p $d || exit 1
  head -c $(( (i * 7919) % 300 + 1 ))K /dev/urandom > /log/tmp-$r || exit 1
  dd if=/log/tmp-$r of=$f bs=64k conv=fsync status=none || exit 1
  sync $d || exit 1
  echo "$(sha256sum < /log/tmp-$r | cut -d' ' -f1) r$r/d$((i % 8))/f$i" >> /log/synced
  i=$((i + 1))
done
'''

# 4 KiB records "seq=N slot=K" written with O_DIRECT over a file that was
# written whole and fsync'd first (so an overwrite changes no metadata that
# the record needs); each logged after dd returned.
SLOTS = 1024
ACK_WRITER = r'''
set -u
r=$1
if [ ! -f /data/rec ]; then
  dd if=/dev/zero of=/data/rec bs=1M count=4 conv=fsync status=none || exit 1
  sync /data || exit 1
fi
n=$((r * 1000000))
echo ready > /log/ready-$r
while :; do
  k=$(( (n * 7919 + r) % 1024 ))
  { printf 'seq=%010d slot=%04d\n' $n $k; head -c 4071 /dev/zero; } |
    dd of=/data/rec bs=4096 count=1 seek=$k oflag=direct conv=notrunc iflag=fullblock \
      status=none || exit 1
  echo "$k $n" >> /log/acked
  n=$((n + 1))
done
'''
RECORD_RE = re.compile(rb'seq=(\d{10}) slot=(\d{4})\n')


class ContainerTest(VolumeTest):

    def setUp(self):
        super().setUp()
        try:
            self.podman = Podman()
            self.image = self.podman.image()
        except PodmanMissing as exc:
            self.skipTest(str(exc))
        self.containers = []
        self.log = os.path.join(self.tmp, 'log')
        os.makedirs(self.log)

    def tearDown(self):
        if self.containers:
            self.podman.rm(*self.containers)
        super().tearDown()

    def container(self, mp, script, *args, detach=True):
        name = f'hvvol-test-{os.getpid()}-{len(self.containers)}'
        self.containers.append(name)
        argv = ['run', '--rm', '--name', name, '--network', 'none',
                '-v', f'{mp}:/data', '-v', f'{self.log}:/log', self.image,
                'sh', '-c', script, 'writer'] + [str(a) for a in args]
        proc = self.podman.popen(*argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wait_for(lambda: self._running(name) or proc.poll() is not None, 60,
                 'the container to start')
        self.assertIsNone(proc.poll(), proc.stdout.read() if proc.poll() is not None else '')
        return name, proc

    def _running(self, name):
        p = self.podman.run('inspect', '--type', 'container', '--format', '{{.State.Pid}}',
                            name, check=False)
        return p.returncode == 0 and p.stdout.strip() not in ('', '0')

    def end(self, name, proc):
        """The container is gone (it fails on its own once the daemon is
        dead; removed if not within 60 s)."""
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            self.podman.rm(name)
            proc.wait(60)
        proc.stdout.close()
        wait_for(lambda: not self._running(name), 60, 'the container to go')

    def lines(self, name):
        try:
            with open(os.path.join(self.log, name)) as f:
                return [ln.split() for ln in f.read().splitlines() if ln.strip()]
        except FileNotFoundError:
            return []

    # -- tests --

    def test_busy_with_a_container(self):
        """A container with the volume bind-mounted: umount is refused and
        names the container; so is the recovery of the dead volume while the
        container still has it.  Once it is gone, both go through."""
        self.vols.create('v1', {'size': '64M'})
        mp = self.mountpoint()
        self.vols.mount('v1', mp)
        name, proc = self.container(mp, 'echo kept > /data/x && sync /data/x && exec sleep 600')
        cid = self.podman.inspect(name)['Id'][:12]
        with self.assertRaises(Busy) as e:
            self.vols.umount('v1')
        self.assertIn(f'container {cid}', str(e.exception))
        self.assertIn('mount namespace', str(e.exception))
        self.assertEqual(self.vols.status('v1')['state'], 'mounted')
        self.kill_daemon('v1')
        with self.assertRaises(Busy) as e:
            self.vols.mount('v1', mp)
        self.assertIn('died', str(e.exception))
        self.assertIn(f'container {cid}', str(e.exception))
        self.podman.rm(name)
        self.end(name, proc)
        self.vols.mount('v1', mp)
        with open(os.path.join(mp, 'x')) as f:
            self.assertEqual(f.read(), 'kept\n')
        self.vols.umount('v1')

    def test_sigkill_fsynced_files_intact(self):
        """Async mode, no region: every file the container fsync'd is
        intact after the kill and the next mount, and e2fsck is clean."""
        self.vols.create('v1', {'size': '256M', 'ram-size': '64M', 'mode': 'async'})
        mp = self.mountpoint()
        self.vols.mount('v1', mp)
        total = 0
        for r in range(ROUNDS):
            name, proc = self.container(mp, FSYNC_WRITER, r)
            want = total + self.rnd.randint(10, 60)
            wait_for(lambda: len(self.lines('synced')) >= want or proc.poll() is not None, 120,
                     f'{want} synced files')
            self.assertIsNone(proc.poll(), 'the writer failed before the kill')
            time.sleep(self.rnd.random() * 0.3)
            self.kill_daemon('v1')
            self.end(name, proc)
            self.assertEqual(self.vols.status('v1')['state'], 'crashed')
            self.vols.mount('v1', mp)
            synced = self.lines('synced')
            total = len(synced)
            bad = [rel for digest, rel in synced if self._sum(mp, rel) != digest]
            self.assertEqual(bad, [], f'round {r}: fsync\'d files lost or changed')
        self.vols.umount('v1')
        rc, out = self.fsck('v1')
        self.assertEqual(rc, 0, out)

    @staticmethod
    def _sum(mp, rel):
        p = subprocess.run(['sha256sum', os.path.join(mp, rel)], capture_output=True, text=True)
        return p.stdout.split()[0] if p.returncode == 0 else p.stderr.strip()

    def test_sigkill_region_acknowledged_writes_intact(self):
        """Async mode, RAM tier in a broker region, no fsync at all: every
        O_DIRECT write the daemon acknowledged is there after the kill and
        the next mount (the region keeps it; the mount writes it back)."""
        pool = os.path.join('/dev/shm', os.path.basename(self.tmp) + '-pool')
        broker = B.Broker(self.tmp, pool)
        broker.start()
        try:
            vols = type(self.vols)(self.conf, self.run_dir, broker_socket=broker.sock)
            self.vols = vols
            vols.create('v1', {'size': '128M', 'ram-size': '64M', 'mode': 'async',
                               'region': 'v1-tier'})
            mp = self.mountpoint()
            vols.mount('v1', mp)
            self.assertTrue(vols.status('v1')['hybrid']['region'])
            for r in range(ROUNDS):
                name, proc = self.container(mp, ACK_WRITER, r)
                want = len(self.lines('acked')) + self.rnd.randint(50, 400)
                wait_for(lambda: len(self.lines('acked')) >= want or proc.poll() is not None,
                         120, f'{want} acknowledged writes')
                self.assertIsNone(proc.poll(), 'the writer failed before the kill')
                self.kill_daemon('v1')
                self.end(name, proc)
                st = vols.mount('v1', mp)
                self.assertTrue(st['hybrid']['region']['reused'],
                                'the new daemon took the region as it was')
                self.check_records(mp, r)
            vols.umount('v1')
            rc, out = self.fsck('v1')
            self.assertEqual(rc, 0, out)
        finally:
            for n in self.vols.names():
                self.force_down(n)
            broker.stop()
            subprocess.run(['rm', '-rf', pool])

    def check_records(self, mp, r):
        acked = [(int(k), int(n)) for k, n in self.lines('acked')]
        last = {}
        for k, n in acked:
            last[k] = n
        nxt = acked[-1][1] + 1                    # the write that may have been in flight
        nxt_slot = (nxt * 7919 + r) % SLOTS
        with open(os.path.join(mp, 'rec'), 'rb') as f:
            data = f.read()
        lost = []
        for k in range(SLOTS):
            rec = data[k * 4096:(k + 1) * 4096]
            m = RECORD_RE.match(rec)
            seq = int(m.group(1)) if m else None
            if m and int(m.group(2)) != k:
                lost.append(f'slot {k} holds the record of slot {m.group(2)}')
                continue
            ok = {last.get(k)}
            if k == nxt_slot:
                ok.add(nxt)
            if seq not in ok:
                lost.append(f'slot {k}: seq {seq}, acknowledged {last.get(k)}')
        self.assertEqual(lost, [], f'round {r}: acknowledged writes lost '
                                   f'({len(acked)} acknowledged in all)')


if __name__ == '__main__':
    unittest.main()
