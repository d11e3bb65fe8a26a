"""A hybrid node's mirror on another host, over NBD with TLS (issue 39).

Two hosts on one machine (tests/hvlib/hosts.py: network, PID, mount
namespaces; killing a host kills every process of it at once and loses its
RAM).  Host b keeps the mirror in its RAM, a region of its own memory
broker (hvmemd), and exports it with qemu-storage-daemon over NBD, TLS with
a pre-shared key, run under `hvmem map --rw`: the broker decides who may
write the region and holds the read-write lease for the export; host a
runs the hybrid node (qemu-io) with that export as its mirror.  The
takeover on b maps the region the same way, so it cannot start while the
export still holds it.  The persistent tier
is a file in the network's shared directory, which both hosts see (a
stand-in for the Ceph RBD image of a real deployment: what is tested here
is the mirror, its transport and the failover).

- host a dies at random moments, many rounds, with writes one at a time
  or many in flight: on host b the image opened with the mirror as its
  ram-file holds every acknowledged write;
- the mirror host dies under a writer: writes stall until TCP gives up
  (the mirror's server.user-timeout, 3 s), then the node is degraded and every
  write completes in the persistent tier; so does a cut link;
- both hosts die: what the last completed flush made durable is there;
- on RBD: the writer cut off and fenced (ceph osd blocklist), the disk taken
  over on b, the old host's later write refused by Ceph;
- nothing reaches the mirror without the key: a wrong key and no TLS are
  refused.
HYBRIDVM_LONG=1 runs more rounds."""

import os
import random
import re
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, '..', '..', 'tests'))
import hybridlib as H           # noqa: E402
from hvlib import hosts         # noqa: E402
from hvlib.mirror import (MirrorHost, USER_TIMEOUT_MS, client_psk,   # noqa: E402
                          client_psk_object, write_key, write_psk)
sys.path.insert(0, os.path.join(HERE, '..', '..', 'broker', 'tests'))
import brokerlib as B           # noqa: E402

# absolute: a host's processes start in the host's own directory
HVMEMD, HVMEM = os.path.abspath(B.HVMEMD), os.path.abspath(B.HVMEM)

MiB = 1024 * 1024
SLOT = 4096
SIZE = 32 * MiB
RAM = 16 * MiB
MIRROR_SIZE = RAM + 2 * MiB
KEY = 'a4f1e09c3b5d7e2f8a6c4b1d9e0f7a3c'
# librbd's answer to a blocklisted client (-ESHUTDOWN), at the write or flush
FENCED_RE = re.compile(r'(write failed|rbd request failed).*Cannot send after transport '
                       r'endpoint shutdown')
REGION_ATTACH_RE = re.compile(r'hybrid_region_attach .*reused (\d) loaded (\d+) '
                              r'dirty (\d+)')


def why_not():
    if os.geteuid() != 0:
        return 'hosts need root (namespaces)'
    if not H.have_binaries():
        return f'QEMU tools not built in {H.BIN}'
    return None


@unittest.skipIf(why_not(), why_not())
class MirrorHostsTest(unittest.TestCase):

    def setUp(self):
        self.net = hosts.Network('mir')
        self.addCleanup(self.net.close)
        self.a, self.b = self.net.host('a'), self.net.host('b')
        # a's secret, which b's broker knows too (docs/broker.md, "Remote clients")
        self.key = write_key(os.path.join(self.net.shared, 'a.key'))
        self.psk = client_psk(HVMEM, 'vm1-mirror', self.key, os.path.join(self.net.shared, 'psk'))
        self.bad_psk = write_psk(os.path.join(self.net.shared, 'bad-psk'), KEY)
        self.other_psk = client_psk(HVMEM, 'other-region', self.key,
                                    os.path.join(self.net.shared, 'psk-other'))
        self.img = os.path.join(self.net.shared, 'd.hyb')
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o', f'mode=async,ram-size={RAM}',
                   self.img, str(SIZE))
        self.ios = []

    def tearDown(self):
        for io in self.ios:
            io.kill()

    # -- the hosts --

    def start_mirror_host(self):
        """On b: its broker, the region vm1-mirror, and qemu-storage-daemon
        exporting it over NBD with TLS (PSK) under `hvmem map --rw`
        (hvlib.mirror); returns once it takes connections."""
        self.mirror = MirrorHost(self.b, 'vm1-mirror', MIRROR_SIZE, self.key, HVMEMD, HVMEM,
                                 H.binary('qemu-storage-daemon')).start()

    def start_export(self):
        self.mirror.start_export()

    def stop_export(self):
        self.mirror.stop_export()

    def writer(self, psk=None, tls=True, throttled=True, tier=None):
        """qemu-io on host a: the image (or the node `tier` names), mirrored
        on b."""
        tier = tier or ('file.driver=throttle,file.throttle-group=tg0,file.file.driver=file,'
                        f'file.file.filename={self.img}' if throttled else
                        f'file.driver=file,file.filename={self.img}')
        opts = (f'driver=hybrid,mode=async,dirty-limit=512k,{tier},' +
                self.mirror.mirror_opts(tls='tls0' if tls else None))
        extra = ['--object', 'throttle-group,id=tg0,x-iops-write=200',
                 '--object', client_psk_object(psk or self.psk),
                 '--trace', 'hybrid_mirror_failed']
        io = H.QemuIo(opts, extra, popen=self.a.popen)
        self.ios.append(io)
        return io

    def failover(self, tier=None):
        """On b: the image opened with the mirror as its RAM region (the
        blocks written back), closed.  (reused, dirty blocks found)."""
        tier = tier or f'file.driver=file,file.filename={self.img}'
        io = H.QemuIo(f'driver=hybrid,{tier},ram-file=/proc/self/fd/3',
                      ['--trace', 'hybrid_region_attach'],
                      popen=lambda argv, **kw: self.b.popen(self.mirror.map_argv(argv), **kw))
        m = REGION_ATTACH_RE.search(io.banner)
        self.assertTrue(m, io.banner)
        self.assertEqual(io.quit(), 0)
        return bool(int(m.group(1))), int(m.group(3))

    def image_bytes(self, img=None):
        return H.image_bytes(img or self.img, os.path.join(self.net.shared, 'verify.raw'))

    # -- the tests --

    def writer_host_dies(self, depth=None):
        """Rounds of writes from a, each ended by host a dying (all its
        processes at once, its RAM gone) at a random moment: on b the
        image taken over with the mirror holds every acknowledged write.
        depth: that many asynchronous writes kept in flight, the kill coming
        under them (WriteModel.run_aio), else one at a time, a few more sent
        unacknowledged.  Returns the dirty blocks each failover found and,
        with depth, each round's run_aio counts."""
        self.start_mirror_host()
        rnd = random.Random(int(os.environ.get('HYBRID_SEED', '3940')))
        model = H.WriteModel(SIZE // SLOT, rnd, durable='ack')
        rounds = 10 if H.LONG else 3
        found, aio = [], []
        for n in range(rounds):
            io = self.writer()
            stats = model.round(io, 0.05 if n % 2 else 0.0, depth, ops=(40, 120))
            if stats:
                aio.append(stats)
            self.a.kill()
            io.kill()           # (dead with its host: reaped, pipes closed)
            self.ios.remove(io)
            # the region's lease keeps the takeover out until the export stops
            with self.assertRaisesRegex(EOFError, 'already has a read-write owner'):
                self.failover()
            self.stop_export()
            reused, dirty = self.failover()
            self.assertTrue(reused, 'the mirror was not taken over')
            found.append(dirty)
            model.check(self.image_bytes(), f'round {n}: ')
            self.a.restart()
            self.start_export()
        self.assertTrue(all(found[0::2]), f'nothing in the mirror at a kill ({found})')
        return found, aio

    def test_writer_host_dies(self):
        """Host a dies at random moments, its writes one at a time: on b
        the image taken over with the mirror holds every acknowledged
        write."""
        found, _ = self.writer_host_dies()
        print(f'{len(found)} host kills; dirty blocks each failover found: {found}',
              file=sys.stderr)

    def test_writer_host_dies_many_in_flight(self):
        """As test_writer_host_dies, with up to 32 writes in flight and the
        kill coming while they are."""
        found, aio = self.writer_host_dies(depth=32)
        # the rounds without flushes fill the window (the dirty limit
        # holds writes back) and are killed with writes in flight
        self.assertTrue(H.loaded_kills(aio),
                        f'a round without flushes had fewer than 16 in flight, or none '
                        f'at the kill, or none had 32: {aio}')
        print(f'{len(found)} host kills; dirty blocks each failover found: {found}; '
              f'writes, max/mean in flight, in flight at the kill: '
              f'{[(a["writes"], a["max_in_flight"], a["mean_in_flight"], a["left"]) for a in aio]}',
              file=sys.stderr)

    def degraded_after(self, fault):
        """Writes from a while `fault()` takes the mirror away: they stall
        until the connection's user timeout (3 s of data unacknowledged:
        hvlib.mirror.USER_TIMEOUT_MS; without it the kernel retransmits for
        ~15 min and the first write times out here), then complete in the
        persistent tier."""
        self.start_mirror_host()
        rnd = random.Random(7)
        model = H.WriteModel(SIZE // SLOT, rnd, durable='ack')
        io = self.writer(throttled=False)
        model.run(io, 30)
        fault()
        t0 = time.monotonic()
        model.run(io, 30)
        stalled = time.monotonic() - t0
        self.assertLess(stalled, USER_TIMEOUT_MS / 1000 + 10, 'the writes stalled too long')
        # a degraded node's flush succeeds (the dead mirror left the graph)
        self.assertNotRegex(io.cmd('flush'), H.FAILED_RE)
        self.assertIn('hybrid_mirror_failed', io.output, 'the node did not degrade')
        self.assertEqual(io.quit(), 0)
        self.ios.remove(io)
        model.check(self.image_bytes(), 'after the mirror went: ')
        return stalled

    def test_mirror_host_dies(self):
        stalled = self.degraded_after(self.b.kill)
        print(f'writes stalled {stalled:.1f} s, then completed degraded', file=sys.stderr)

    def test_link_cut(self):
        stalled = self.degraded_after(lambda: self.net.cut('b'))
        print(f'writes stalled {stalled:.1f} s, then completed degraded', file=sys.stderr)

    def test_both_hosts_die(self):
        """Writer and mirror host die together: what the last completed
        flush made durable is in the image, which a third party opens with
        an empty region (the image says its newest writes were in one),
        being told what was lost."""
        self.start_mirror_host()
        rnd = random.Random(13)
        model = H.WriteModel(SIZE // SLOT, rnd, durable='flush')
        io = self.writer()
        model.run(io, 80, flush_p=0.1)
        model.send_unacked(io, 3)
        self.a.kill()
        self.b.kill()
        self.ios.remove(io)
        empty = os.path.join(self.net.shared, 'empty-region')
        with open(empty, 'wb') as f:
            f.truncate(MIRROR_SIZE)
        r = subprocess.run([H.binary('qemu-io'), '--image-opts',
                            f'driver=hybrid,file.driver=file,file.filename={self.img},'
                            f'ram-file={empty}', '-c', 'quit'],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn('writes acknowledged after the last flush were held in RAM region',
                      r.stdout + r.stderr)
        model.check(self.image_bytes(), 'both hosts gone: ')

    def test_no_key_no_mirror(self):
        """A client with another key, with its own key for another region of
        b's broker, or without TLS, never gets the export."""
        self.start_mirror_host()
        for kw, msg in ((dict(psk=self.bad_psk), r'TLS|handshake|decrypt|Error in the pull'),
                        (dict(psk=self.other_psk), r'TLS|handshake|decrypt|Error in the pull'),
                        (dict(tls=False), r'TLS')):
            with self.assertRaises(EOFError) as cm:
                self.writer(**kw)
            self.assertRegex(str(cm.exception), msg)
        # the mirror was never bound: its header is still all zero
        r = self.b.run([HVMEM, 'map', 'vm1-mirror', '--', 'sh', '-c',
                        'cmp -n 4096 /proc/self/fd/$HVMEM_FD /dev/zero'], check=False)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)


    def test_failover_on_rbd_fences_the_old_host(self):
        """The persistent tier on RBD (Ceph in a namespace of its own).  Host
        a is cut off, not dead; b fences it (ceph osd blocklist), stops
        exporting the mirror and takes the disk over with it: every write a
        acknowledged is there.  When a's link comes back, its next write
        finds the mirror gone and goes to RBD, which refuses it (at once, or
        at the flush when librbd's write-back cache took it, as QEMU's
        cache=writeback lets it): it never reaches the image."""
        ceph = self.net.ceph()
        H.qemu_img('create', '-q', '-f', 'hybrid', '-o', f'mode=async,ram-size={RAM}',
                   ceph.filename('hyb'), str(SIZE))
        tier = ceph.blockdev('hyb', prefix='file.')
        self.start_mirror_host()
        rnd = random.Random(11)
        model = H.WriteModel(SIZE // SLOT, rnd, durable='ack')
        io = self.writer(tier=tier)
        model.run(io, 60)

        self.net.cut('a')
        ceph.ceph('osd', 'blocklist', 'add', f'{self.a.addr}:0/0')
        self.stop_export()
        reused, dirty = self.failover(tier)
        self.assertTrue(reused)
        self.assertGreater(dirty, 0, 'nothing was left to take over')
        model.check(self.image_bytes(ceph.filename('hyb')), 'after the takeover: ')

        self.net.restore('a')
        late = next(s for s in range(SIZE // SLOT) if s not in model.accepted)
        out = io.cmd(f'write -P 7 {late * SLOT} {SLOT}', timeout=180)
        out += io.cmd('flush', timeout=180)     # (qemu-io prints no flush error)
        self.assertRegex(out, FENCED_RE, 'Ceph did not refuse the fenced host')
        data = self.image_bytes(ceph.filename('hyb'))
        self.assertEqual(data[late * SLOT:(late + 1) * SLOT], bytes(SLOT),
                         "the fenced host's write reached the image")
        model.check(data, 'after the fenced write: ')
        print(f'takeover found {dirty} dirty blocks; the fenced host: '
              f'{FENCED_RE.search(out).group(0)}', file=sys.stderr)


if __name__ == '__main__':
    unittest.main()
