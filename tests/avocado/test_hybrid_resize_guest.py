"""A hybrid disk grows under a guest's I/O (issue 23): block_resize twice
while the guest writes and reads back patterns on it; the guest sees the new
size, every pattern it wrote reads back (page cache dropped), including past
the old end, and the image is consistent afterwards."""
import json
import os
import subprocess

from hvtest import HybridVMTest

MiB = 1 << 20


class HybridResizeUnderGuestIO(HybridVMTest):

    def qemu_img(self, *args):
        return subprocess.run([self.paths.binary('qemu-img'), *args],
                              capture_output=True, text=True, check=True, timeout=120)

    def test_grow_under_io(self):
        img = os.path.join(self.workdir, 'data.hyb')
        self.qemu_img('create', '-q', '-f', 'hybrid', '-o', 'mode=async', img, '32M')
        g = self.guest('resize', mem='256M', redis=False, args=[
            '-blockdev', f'driver=hybrid,node-name=d1,file.driver=file,file.filename={img}',
            '-device', 'virtio-blk-pci,drive=d1,id=vd1'])
        g.launch()
        g.wait_console(r'HV-BOOTED', timeout=120)
        self.assertEqual(g.run('cat /sys/block/vda/size').strip(), str(32 * MiB // 512))
        # 16 MiB of random data, written over and over in the background
        g.run('dd if=/dev/urandom of=/tmp/src bs=64k count=256 2>/dev/null')
        g.run('( (i=0; while [ $i -lt 6 ]; do '
              'dd if=/tmp/src of=/dev/vda bs=64k conv=fsync 2>/dev/null; '
              'i=$((i+1)); done; echo WRITER-DONE) > /tmp/writer.log 2>&1 & )')
        g.qmp('block_resize', **{'node-name': 'd1', 'size': 48 * MiB})
        g.qmp('block_resize', **{'node-name': 'd1', 'size': 64 * MiB})
        out = ''
        for _ in range(120):
            out = g.run('cat /tmp/writer.log')
            if 'WRITER-DONE' in out:
                break
            g.run('sleep 1')
        self.assertIn('WRITER-DONE', out)
        self.assertEqual(g.run('cat /sys/block/vda/size').strip(), str(64 * MiB // 512))
        # past the old end, then everything read back from the disk
        g.run('dd if=/tmp/src of=/dev/vda bs=64k seek=768 conv=fsync 2>/dev/null')
        g.run('echo 3 > /proc/sys/vm/drop_caches')
        self.assertEqual(g.run('dd if=/dev/vda bs=64k count=256 2>/dev/null | cmp - /tmp/src '
                               '&& echo SAME').strip(), 'SAME')
        self.assertEqual(g.run('dd if=/dev/vda bs=64k skip=768 count=256 2>/dev/null | '
                               'cmp - /tmp/src && echo SAME').strip(), 'SAME')
        self.assertEqual(g.run('dd if=/dev/vda bs=64k skip=256 count=512 2>/dev/null | '
                               'tr -d "\\000" | wc -c').strip(), '0')
        g.shutdown()
        info = json.loads(self.qemu_img('info', '--output=json', img).stdout)
        self.assertEqual(info['virtual-size'], 64 * MiB)
        self.qemu_img('check', '-f', 'hybrid', img)
