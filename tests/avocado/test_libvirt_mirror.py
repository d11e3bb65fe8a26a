"""A guest through libvirt keeps its files when its host dies (issue 39):
its hybrid data disk is mirrored into memory on a second host, and the
domain is started again on that host through libvirt, whose hook finds the
mirror there.

Two hosts on one machine (hvlib.hosts: network, PID and mount namespaces;
killing a host kills every process of it at once, its RAM with them), each
with a private libvirtd (libvirt's defaults: QEMU as libvirt-qemu) running
inside it with our hook.  Host b runs its memory broker and exports the
region vm1-mirror over NBD with TLS (hvlib.mirror).  On host a the domain
vm1 has a hybrid data disk in async mode whose mirror is that export; its
persistent tier is a file both hosts see (the Network's shared directory:
the stand-in for the RBD image of a real deployment, whose fencing
block/tests/test_hybrid_mirror_hosts.py tests), under a throttle group
that keeps the write-back far behind the guest.  The guest writes files
on ext4 mounted with barriers off, so no flush ever reaches the disk: every
byte it wrote was only acknowledged, and held in a's RAM tier and b's
mirror.  Host a is killed.  On b, `virsh start vm1` is refused while the
mirror's export still holds the region; once the export is stopped (the
operator's step after fencing), it starts: the hook writes the region's
blocks into the image, the guest mounts the file system and every file
reads back with the checksum it had on a."""
import os
import re
import shutil
import subprocess
import sys

from hvtest import HybridVMTest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, 'broker', 'tests'))
import brokerlib as B   # noqa: E402

MiB = 1 << 20
RAM = 16 * MiB
SIZE = 64 * MiB
FILES = 4                       # of 512 KiB each


class VirshMirrorFailover(HybridVMTest):

    timeout = 900

    def setUp(self):
        super().setUp()
        from hvlib import hosts
        from hvlib.libvirt import libvirt_available
        reason = libvirt_available() or (None if os.path.exists(B.HVMEMD) else
                                         f'{B.HVMEMD} not built')
        if reason:
            self.cancel(reason)
        self.net = hosts.Network('lvmir')
        self.lv = []

    def tearDown(self):
        for lv in self.lv:
            lv.stop()
        self.net.close()
        super().tearDown()

    def libvirt_on(self, host, hook_conf=''):
        from hvlib.libvirt import LibvirtHost, make_hooks_dir, qemu_dir
        root = qemu_dir(prefix='lv-', parent=host.files)
        lv = LibvirtHost(host.name, os.path.join(root, 'lv'), host=host,
                         hooks_dir=make_hooks_dir(root, '64M', hook_conf))
        self.lv.append(lv)
        return lv.start(), root

    def domain(self, root, disk_args, console):
        from hvlib.libvirt import domain_xml
        import hvlib
        return domain_xml('vm1', self.paths, mem_mib=256, redis_port=hvlib.free_port(),
                          append='', boot_dir=self.boot_dir, qemu_args=disk_args, **console)

    def test_guest_restarts_on_the_mirror_host(self):
        from hvlib.libvirt import qemu_dir, qemu_ids, serial_console
        from hvlib.mirror import MirrorHost, client_psk, client_psk_object, write_key
        a, b = self.net.host('a'), self.net.host('b')
        shared = self.net.shared
        os.chmod(shared, 0o755)
        self.boot_dir = qemu_dir(prefix='boot-', parent=shared)
        uid, gid = qemu_ids()

        # the data disk: an ext4 file system in a hybrid image (async)
        raw, img = os.path.join(shared, 'data.raw'), os.path.join(shared, 'data.hybrid')
        with open(raw, 'wb') as f:
            f.truncate(SIZE)
        subprocess.run(['mkfs.ext4', '-q', '-F', '-L', 'hvdata', raw], check=True)
        subprocess.run([self.paths.binary('qemu-img'), 'convert', '-f', 'raw', '-O', 'hybrid',
                        '-o', f'mode=async,ram-size={RAM}', raw, img], check=True)
        os.unlink(raw)

        # b keeps the mirror; a is a remote client of b's broker, and a's
        # QEMU (libvirt-qemu) reads a's key for the region
        key = write_key(os.path.join(shared, 'a.key'))
        mirror = MirrorHost(b, 'vm1-mirror', RAM + 2 * MiB, key,
                            os.path.abspath(B.HVMEMD), os.path.abspath(B.HVMEM),
                            self.paths.binary('qemu-storage-daemon')).start()
        psk = client_psk(os.path.abspath(B.HVMEM), 'vm1-mirror', key,
                         os.path.join(qemu_dir(prefix='psk-', parent=a.files), 'psk'))
        os.chown(psk, 0, gid)
        os.chmod(psk, 0o710)
        os.chown(os.path.join(psk, 'keys.psk'), 0, gid)
        os.chmod(os.path.join(psk, 'keys.psk'), 0o640)

        # -- host a: the domain with its mirrored disk --
        lv_a, root_a = self.libvirt_on(a)
        con, console = serial_console('vm1', root_a, self.logdir)
        lv_a.define(self.domain(root_a, [
            '-object', client_psk_object(psk),
            # the write-back at 16 KiB/s: it stays far behind the guest
            '-object', 'throttle-group,id=tg0,x-bps-write=16384',
            '-blockdev', f'driver=hybrid,node-name=data0,mode=async,ram-size={RAM},'
                         'file.driver=throttle,file.throttle-group=tg0,'
                         f'file.file.driver=file,file.file.filename={img},'
                         + mirror.mirror_opts(),
            '-device', 'virtio-blk-pci,drive=data0,bus=pci.0,addr=0x1e'], console))
        lv_a.virsh('start', 'vm1')
        con.wait(r'HV-BOOTED', timeout=300)
        con.run('mkdir -p /mnt/d && mount -t ext4 -o nobarrier /dev/vda /mnt/d')
        con.run(f'for i in $(seq {FILES}); do dd if=/dev/urandom of=/mnt/d/f$i bs=64k count=8 '
                '2>/dev/null; done; sync', timeout=120)
        sums = con.run('cd /mnt/d && md5sum f*')
        self.assertEqual(len(re.findall(r'^[0-9a-f]{32}  f\d$', sums, re.M)), FILES, sums)
        info = lv_a.virsh('qemu-monitor-command', 'vm1',
                          '{"execute": "query-hybrid"}').stdout
        self.log.info('on a before the kill: %s', info)
        counted = int(re.search(r'"counted-blocks":\s*(\d+)', info).group(1))
        self.assertGreater(counted, 0, 'nothing left in the mirror: the test tests nothing')
        self.assertRegex(info, r'"degraded":\s*false')

        a.kill()                        # every process of a, at once
        con.close()

        # -- host b: the domain started there through libvirt --
        lv_b, root_b = self.libvirt_on(
            b, f'[broker]\nsocket = {MirrorHost.SOCKET}\nhvmem = {os.path.abspath(B.HVMEM)}\n')
        con, console = serial_console('vm1', root_b, self.logdir)
        lv_b.define(self.domain(root_b, [
            '-blockdev', f'driver=hybrid,node-name=data0,mode=async,ram-size={RAM},'
                         f'file.driver=file,file.filename={img}',
            '-device', 'virtio-blk-pci,drive=data0,bus=pci.0,addr=0x1e'], console))
        # the export still holds the region: not yet
        r = lv_b.virsh('start', 'vm1', check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertRegex(r.stderr, r'region vm1-mirror is held read-write by pid \d+')
        mirror.stop_export()
        lv_b.virsh('start', 'vm1')
        with open(os.path.join(root_b, 'lv', 'log', 'hybridvm-hook.log')) as f:
            hook_log = f.read()
        self.log.info('hook on b: %s', hook_log)
        self.assertIn('mirror region vm1-mirror taken over', hook_log)
        con.wait(r'HV-BOOTED', timeout=300)
        con.run('mkdir -p /mnt/d && mount -t ext4 /dev/vda /mnt/d')
        self.assertEqual(con.run('cd /mnt/d && md5sum f*'), sums)
        st = os.stat(img)
        self.assertEqual((st.st_uid, st.st_gid), (uid, gid), 'QEMU on b does not hold the image')
        lv_b.virsh('destroy', 'vm1')
        shutil.rmtree(self.boot_dir, ignore_errors=True)
