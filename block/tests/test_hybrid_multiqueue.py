"""A hybrid disk behind a multiqueue virtio-blk (iothread-vq-mapping): the
guest's requests arrive from two iothreads at once, while the hybrid
node's state is single-threaded by design (block/hybrid.h).  Requests from
the other iothread move to the node's AioContext for their duration
(trace event hybrid_foreign_request), so concurrent writers and readers
on both queues, in the RAM tier and beyond it, in async mode, lose and mix
nothing: the guest reads back what it wrote, and so does the host once
QEMU has quit.
"""
import hashlib
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hybridlib as H   # noqa: E402

BS = 65536
BLOCKS = 32              # per writer: writer 1 in the RAM tier, writer 2 beyond
ROUNDS = 3


def block(rnd, writer, i):
    """What `yes R<r>-C<c>-<i> | dd bs=65536 count=1 iflag=fullblock` writes."""
    line = f'R{rnd}-C{writer}-{i}\n'.encode()
    return (line * (BS // len(line) + 1))[:BS]


def writer_cmd(c):
    """Writer c on vCPU c-1: ROUNDS passes over its BLOCKS blocks."""
    first = (c - 1) * BLOCKS
    return (f"taskset {c} sh -c 'for r in $(seq 1 {ROUNDS}); do "
            f"for i in $(seq 0 {BLOCKS - 1}); do yes R$r-C{c}-$i | "
            f"dd of=/dev/vda bs={BS} count=1 seek=$(({first} + i)) "
            "oflag=direct iflag=fullblock 2>/dev/null || exit 9; done; done'")


def reader_cmd(c):
    """Reader on vCPU c-1: whole-disk direct reads while the writers run."""
    return (f"taskset {c} sh -c 'for r in $(seq 1 6); do dd if=/dev/vda "
            f"of=/dev/null bs={BS} count={2 * BLOCKS} iflag=direct "
            "2>/dev/null || exit 9; done'")


class HybridMultiqueue(H.GuestCase, unittest.TestCase):

    dir_prefix = 'hybrid-mq-'

    def test_two_queues_in_two_iothreads(self):
        image = os.path.join(self.dir, 'mq.hybrid')
        trace = os.path.join(self.dir, 'trace.log')
        subprocess.run([self.qemu_img, 'create', '-f', 'hybrid', '-o',
                        f'ram-size={BLOCKS * BS},mode=async', image,
                        str(2 * BLOCKS * BS)], check=True, capture_output=True)
        dev = ('{"driver":"virtio-blk-pci","drive":"hyb","num-queues":2,'
               '"iothread-vq-mapping":[{"iothread":"io0"},{"iothread":"io1"}]}')
        g = self.add_guest('mq', smp=2, redis=False, balloon=False, args=[
            '-object', 'iothread,id=io0',
            '-object', 'iothread,id=io1',
            '-blockdev', f'driver=file,node-name=tier,filename={image}',
            '-blockdev', 'driver=hybrid,node-name=hyb,file=tier',
            '-device', dev,
            '-trace', f'enable=hybrid_foreign_request,file={trace}'])
        g.boot()
        self.assertEqual(g.run('nproc').strip(), '2')
        g.run(f'({writer_cmd(1)}) & w1=$!; ({writer_cmd(2)}) & w2=$!; '
              f'({reader_cmd(1)}) & r1=$!; ({reader_cmd(2)}) & r2=$!; '
              'wait $w1 && wait $w2 && wait $r1 && wait $r2', timeout=400)

        want = b''.join(block(ROUNDS, c, i) for c in (1, 2) for i in range(BLOCKS))
        out = g.run(f'dd if=/dev/vda bs={BS} count={2 * BLOCKS} iflag=direct '
                    '2>/dev/null | md5sum', timeout=120)
        self.assertEqual(out.split()[0], hashlib.md5(want).hexdigest())
        g.shutdown()

        # every request from the second queue's iothread ran in the node's
        with open(trace) as f:
            foreign = f.read().count('hybrid_foreign_request')
        self.assertGreater(foreign, 0, 'no request came from the other iothread')

        raw = os.path.join(self.dir, 'out.raw')
        subprocess.run([self.qemu_img, 'convert', '-f', 'hybrid', '-O', 'raw', image, raw],
                       check=True, capture_output=True)
        with open(raw, 'rb') as f:
            self.assertEqual(f.read(), want)


if __name__ == '__main__':
    unittest.main()
