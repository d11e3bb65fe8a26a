"""Our QEMU driven by libvirt: two private libvirtd instances, virsh migrate."""
import json
import os
import subprocess
import time

from hvtest import LibvirtTest


class VirshPostcopy(LibvirtTest):

    def postcopy(self):
        """Cancel the test where the destination's QEMU (libvirt-qemu) could
        not take a post-copy migration."""
        from hvlib.libvirt import postcopy_unavailable
        why = postcopy_unavailable()
        if why:
            self.cancel(why)

    def define_sides(self, pair, **xml_args):
        """Write src.xml and dst.xml for the same guest (each side with its own
        Redis port and a typed-into serial console), define it on pair.src.
        Returns ({side: redis port}, {side: hvlib.Console})."""
        import hvlib
        from hvlib.libvirt import domain_xml, serial_console
        ports, consoles = {}, {}
        for side in ('src', 'dst'):
            ports[side] = hvlib.free_port()
            consoles[side], console_args = serial_console(side, pair.root, self.logdir)
            with open(os.path.join(pair.root, f'{side}.xml'), 'w') as f:
                f.write(domain_xml('hvguest', self.paths, redis_port=ports[side],
                                   boot_dir=pair.root, **console_args, **xml_args))
        pair.src.virsh('define', os.path.join(pair.root, 'src.xml'))
        return ports, consoles

    def migrate_args(self, pair, dst_xml):
        import hvlib
        return ('migrate', '--live', '--postcopy', '--postcopy-after-precopy',
                '--xml', dst_xml, 'hvguest', pair.dst.uri,
                '--migrateuri', f'tcp://127.0.0.1:{hvlib.free_port()}',
                '--listen-address', '127.0.0.1')

    def test_hook_refuses_migration_that_cannot_fit(self):
        """The destination's hook refuses an incoming migration when guest RAM
        plus the configured reserve exceeds the host's memory: `virsh migrate`
        fails with the hook's reason and the guest keeps running on the source."""
        import hvlib
        from hvlib.libvirt import LibvirtPair, make_hooks_dir

        # The destination has the hook as `make install` lays it out.
        hooks = make_hooks_dir(self.root, '100T', layout='qemu.d')
        with LibvirtPair(log_dir=self.logdir, dst_hooks_dir=hooks) as pair:
            ports, _ = self.define_sides(pair)
            pair.src.virsh('start', 'hvguest')
            r = hvlib.redis_client(ports['src'], timeout=120, name='src')
            r.set('before', b'the refused migration')
            cp = pair.src.virsh(*self.migrate_args(pair, os.path.join(pair.root, 'dst.xml')),
                                check=False, timeout=600)
            self.assertNotEqual(cp.returncode, 0)
            self.assertIn('hybridvm: refusing hvguest on this host: not enough memory', cp.stderr)
            self.assertEqual(pair.src.virsh('domstate', 'hvguest').stdout.strip(), 'running')
            self.assertNotIn('hvguest', pair.dst.virsh('list', '--all', '--name').stdout)
            self.assertEqual(r.get('before'), b'the refused migration')

    def test_virsh_migrate_hybrid_root(self):
        """A guest booted from a hybrid root disk (async mode) on shared storage:
        both hooks admit it (the emulator has the format, the persistent tier is
        reachable, the RAM tier fits), `virsh migrate --live --postcopy
        --postcopy-after-precopy` moves it, the destination reads the file the
        guest flushed on the source, Redis values are intact, and after a clean
        shutdown `qemu-img check` finds the image consistent.  The destination
        reaches the shared storage under another directory: its hook (installed
        in the qemu.d layout) rewrites the image path, and QEMU there opens it.
        QEMU runs as libvirt-qemu on both sides: the hooks give it the image
        (libvirt does not know the format) and the last to let go of it, the
        destination's, gives it back to root."""
        import hvlib
        from hvlib.libvirt import LibvirtPair, make_hooks_dir, qemu_ids

        self.postcopy()
        qemu_img = self.paths.binary('qemu-img')
        # Where QEMU (libvirt-qemu) can reach it: not the test's workdir under /root.
        storage_src = os.path.join(self.root, 'storage-on-src')
        storage_dst = os.path.join(self.root, 'storage-on-dst')  # same storage, other path
        os.makedirs(storage_src)
        os.symlink(storage_src, storage_dst)
        image = os.path.join(storage_src, 'root.hybrid')
        subprocess.run([qemu_img, 'convert', '-O', 'hybrid', '-o', 'mode=async,ram-size=128M',
                        self.paths.guest_file('rootfs.ext4'), image], check=True)

        with LibvirtPair(log_dir=self.logdir, hooks_dir=make_hooks_dir(self.root, '64M'),
                         dst_hooks_dir=make_hooks_dir(self.root, '64M',
                                                      f'[paths]\n{storage_src} = {storage_dst}\n',
                                                      layout='qemu.d')) as pair:
            ports, consoles = self.define_sides(pair, hybrid_root=image)
            pair.src.virsh('start', 'hvguest')

            con = consoles['src']
            con.wait(r'HV-ONDISK /dev/vda', timeout=180)
            con.wait(r'HV-BOOTED', timeout=120)
            con.run('echo written-on-source-$((6 * 7)) >/root/marker && sync')
            r = hvlib.redis_client(ports['src'], timeout=60, name='src')
            values = {f'h{i}': f'value-{i}'.encode() * 8 for i in range(2000)}
            r.mset(values)
            r.close()

            pair.src.virsh(*self.migrate_args(pair, os.path.join(pair.root, 'dst.xml')), timeout=600)
            self.assertEqual(pair.dst.virsh('domstate', 'hvguest').stdout.strip(), 'running')
            self.assertNotEqual(pair.src.virsh('domstate', 'hvguest', check=False).stdout.strip(),
                                'running')
            job = pair.dst.virsh('domjobinfo', 'hvguest', '--completed').stdout
            self.log.info('destination job info:\n%s', job)
            self.assertIn('Incoming migration', job)

            con = consoles['dst']
            self.assertEqual(con.run('cat /root/marker', timeout=120).strip(), 'written-on-source-42')
            con.run('echo written-on-destination >/root/marker2 && sync')
            r = hvlib.redis_client(ports['dst'], timeout=60, name='dst')
            self.assertEqual(r.mget(list(values)), list(values.values()))
            stats = pair.dst.virsh('qemu-monitor-command', 'hvguest', '--pretty',
                                   '{"execute": "query-hybrid"}').stdout
            self.log.info('query-hybrid on the destination:\n%s', stats)
            self.assertIn('"mode": "async"', stats)
            st = os.stat(image)
            self.assertEqual((st.st_uid, st.st_gid), qemu_ids(), 'the image is QEMU\'s while it runs')
            con.run('sync; mount -o remount,ro /')
            pair.dst.virsh('destroy', 'hvguest')
        st = os.stat(image)
        self.assertEqual((st.st_uid, st.st_gid), (0, 0), 'the image is given back')
        self.assertEqual([x for x in os.listxattr(image) if 'hybridvm' in x], [])

        with open(os.path.join(self.logdir, 'libvirt-dst', 'hybridvm-hook.log')) as f:
            self.assertIn(f'hvguest: migrate: admitted (guest 512 MiB; hybrid {storage_dst}/root.hybrid '
                          f'ram-size 128 MiB); paths rewritten', f.read())
        with open(os.path.join(self.logdir, 'libvirt-dst', 'qemu', 'hvguest.log')) as f:
            self.assertIn(f'file.filename={storage_dst}/root.hybrid', f.read())
        cp = subprocess.run([qemu_img, 'check', '-f', 'hybrid', image], capture_output=True, text=True)
        self.assertEqual(cp.returncode, 0, cp.stdout + cp.stderr)

    def test_virsh_migrate_app_assisted(self):
        """The whole stack under libvirt: a guest booted from a hybrid disk, Redis
        with our module holding 70 % of its items cold, the app-assist port, and
        `-global migration.x-app-assist=on` as the only switch (virsh sets no
        such capability).  `virsh migrate --live --postcopy
        --postcopy-after-precopy` moves it; on the destination the hot items
        read back, the cold ones are misses (policy drop), the module was told
        to resume, query-migrate there reports the phase, the balloon is back to
        the guest's size and the disk's data is intact."""
        import hvlib
        from hvlib.libvirt import LibvirtPair, make_hooks_dir

        self.postcopy()
        qemu_img = self.paths.binary('qemu-img')
        image = os.path.join(self.root, 'root.hybrid')
        subprocess.run([qemu_img, 'convert', '-O', 'hybrid', '-o', 'mode=sync,ram-size=64M',
                        self.paths.guest_file('rootfs.ext4'), image], check=True)
        aa_args = ['-device', 'virtio-serial-pci,id=aaserial,bus=pci.0,addr=0x1d',
                   '-chardev', 'app-assist,id=aa0',
                   '-device', 'virtserialport,bus=aaserial.0,chardev=aa0,name=org.qemu.app-assist.0',
                   '-global', 'migration.x-app-assist=on']

        with LibvirtPair(log_dir=self.logdir, hooks_dir=make_hooks_dir(self.root, '64M')) as pair:
            ports, consoles = self.define_sides(pair, hybrid_root=image, append='hv.redis=1 hv.module=1',
                                                qemu_args=aa_args)
            pair.src.virsh('start', 'hvguest')
            con = consoles['src']
            con.wait(r'HV-ONDISK /dev/vda', timeout=180)
            con.wait(r'HV-READY redis', timeout=120)
            con.run('echo on-the-hybrid-disk >/root/marker && sync')

            # 20 000 items of 1 KiB; all demoted, then the first 30 % read back (hot).
            r = hvlib.redis_client(ports['src'], timeout=60, name='src')
            self.assertIn('appassist_state', r.info('appassist'), 'the guest has no Redis module')
            hot, cold = hvlib.load_hot_cold(r, hvlib.make_items(20000, 1024, seed=11), 0.3)
            r.close()

            pair.src.virsh(*self.migrate_args(pair, os.path.join(pair.root, 'dst.xml')), timeout=900)
            self.assertEqual(pair.dst.virsh('domstate', 'hvguest').stdout.strip(), 'running')

            def qmp(cmd):
                out = pair.dst.virsh('qemu-monitor-command', 'hvguest', json.dumps({'execute': cmd})).stdout
                return json.loads(out)['return']

            aa = qmp('query-migrate').get('app-assist', {})
            self.log.info('destination app-assist: %s', aa)
            self.assertEqual(aa.get('status'), 'resumed', aa)

            # The module's own record travelled with the guest's RAM: one PREPARE
            # on the source that dropped the cold set, one RESUME here.
            r = hvlib.redis_client(ports['dst'], timeout=60, name='dst')
            info = r.info('appassist')
            self.log.info('destination INFO appassist: %s', info)
            self.assertEqual((info['appassist_prepares'], info['appassist_resumes']), (1, 1))
            self.assertEqual(info['appassist_last_prepare_items'], len(cold))
            self.assertGreater(info['appassist_last_prepare_freed_bytes'], len(cold) * 1024)
            self.assertEqual(hvlib.count_wrong(r, hot, cold, cold_dropped=True), (0, 0))
            deadline = time.monotonic() + 60
            while qmp('query-balloon')['actual'] != 512 * 2**20:
                self.assertLess(time.monotonic(), deadline, 'the balloon did not deflate')
                time.sleep(0.5)
            self.assertEqual(consoles['dst'].run('cat /root/marker', timeout=120).strip(),
                             'on-the-hybrid-disk')


class VirshDefaults(LibvirtTest):
    """libvirt's default security settings: QEMU as libvirt-qemu under the
    DAC driver (no AppArmor/SELinux on this kernel), not root."""

    def test_vnc_domain_boots_as_libvirt_qemu(self):
        """A domain with <graphics type='vnc' port='-1' listen='127.0.0.1'/>
        boots; `virsh domdisplay` names the display and it answers with the
        RFB banner.  Its QEMU runs as libvirt-qemu, the kernel and initrd it
        boots are QEMU's (libvirt's DAC labelling) while it runs and root's
        again after."""
        import socket
        import hvlib
        from hvlib.libvirt import domain_xml, qemu_ids, serial_console

        self.start_host('vnc')
        con, console_args = serial_console('hvvnc', self.root, self.logdir)
        self.host.define(domain_xml('hvvnc', self.paths, mem_mib=256, append='',
                                    redis_port=hvlib.free_port(), boot_dir=self.root,
                                    vnc=True, **console_args))
        self.host.virsh('start', 'hvvnc')
        con.wait(r'HV-BOOTED', timeout=240)

        [pid] = self.host.qemu_pids()
        with open(f'/proc/{pid}/status') as f:
            ids = dict(line.split(':', 1) for line in f if line.startswith(('Uid', 'Gid')))
        uid, gid = qemu_ids()
        self.assertEqual(ids['Uid'].split(), [str(uid)] * 4)
        self.assertEqual(ids['Gid'].split(), [str(gid)] * 4)
        kernel = os.path.join(self.root, 'vmlinuz')
        self.assertEqual((os.stat(kernel).st_uid, os.stat(kernel).st_gid), (uid, gid))

        display = self.host.virsh('domdisplay', 'hvvnc').stdout.strip()
        self.log.info('virsh domdisplay: %s', display)
        self.assertRegex(display, r'^vnc://127\.0\.0\.1:\d+$')
        port = 5900 + int(display.rsplit(':', 1)[1])
        with socket.create_connection(('127.0.0.1', port), timeout=30) as s:
            banner = b''
            while len(banner) < 12:
                chunk = s.recv(12 - len(banner))
                if not chunk:
                    break
                banner += chunk
        self.assertTrue(banner.startswith(b'RFB 003.00'), banner)

        self.host.virsh('destroy', 'hvvnc')
        self.assertEqual((os.stat(kernel).st_uid, os.stat(kernel).st_gid), (0, 0))
