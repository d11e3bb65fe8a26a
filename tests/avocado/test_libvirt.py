"""Our QEMU driven by libvirt: two private libvirtd instances, virsh migrate."""
import os
import random

from hvtest import HybridVMTest


class VirshPostcopy(HybridVMTest):

    def setUp(self):
        super().setUp()
        from hvlib.libvirt import libvirt_available
        reason = libvirt_available()
        if reason:
            self.cancel(reason)

    def test_virsh_migrate_postcopy(self):
        """define + start the Redis guest on one libvirtd, `virsh migrate --live
        --postcopy --postcopy-after-precopy` to a second one: the domain runs
        there, the source no longer has it running, and every value reads back."""
        import hvlib
        from hvlib.libvirt import LibvirtPair, domain_xml

        with LibvirtPair(log_dir=self.logdir) as pair:
            src_port, dst_port = hvlib.free_port(), hvlib.free_port()
            src_xml = os.path.join(pair.root, 'src.xml')
            dst_xml = os.path.join(pair.root, 'dst.xml')
            with open(src_xml, 'w') as f:
                f.write(domain_xml('hvguest', self.paths, redis_port=src_port,
                                   console_log=os.path.join(self.logdir, 'src-console.log')))
            # Same guest, destination-host specifics (its own forwarded port).
            with open(dst_xml, 'w') as f:
                f.write(domain_xml('hvguest', self.paths, redis_port=dst_port,
                                   console_log=os.path.join(self.logdir, 'dst-console.log')))
            pair.src.virsh('define', src_xml)
            pair.src.virsh('start', 'hvguest')

            r = hvlib.redis_client(src_port, timeout=120, name='src')
            rng = random.Random(6)
            data = {f'k{i}': rng.randbytes(512) for i in range(5000)}
            pipe = r.pipeline(transaction=False)
            for k, v in data.items():
                pipe.set(k, v)
            pipe.execute()
            r.close()

            pair.src.virsh('migrate', '--live', '--postcopy', '--postcopy-after-precopy',
                           '--xml', dst_xml, 'hvguest', pair.dst.uri,
                           '--migrateuri', f'tcp://127.0.0.1:{hvlib.free_port()}',
                           '--listen-address', '127.0.0.1', timeout=600)

            self.assertEqual(pair.dst.virsh('domstate', 'hvguest').stdout.strip(), 'running')
            self.assertNotEqual(pair.src.virsh('domstate', 'hvguest', check=False).stdout.strip(),
                                'running')
            job = pair.dst.virsh('domjobinfo', 'hvguest', '--completed').stdout
            self.log.info('destination job info:\n%s', job)
            self.assertIn('Incoming migration', job)

            r = hvlib.redis_client(dst_port, timeout=60, name='dst')
            keys = list(data)
            for i in range(0, len(keys), 1000):
                chunk = keys[i:i + 1000]
                self.assertEqual(r.mget(chunk), [data[k] for k in chunk])
