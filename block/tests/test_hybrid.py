"""Functional tests of the hybrid block format with qemu-img, qemu-io and
qemu-storage-daemon (no guest).  Binaries come from $HYBRIDVM_BUILD/bin."""

import functools
import json
import os
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hybridlib as H   # noqa: E402

MiB = 1024 * 1024


@unittest.skipUnless(H.have_binaries(), f'QEMU tools not built in {H.BIN}')
class HybridTest(unittest.TestCase):

    def setUp(self):
        self.tmp = H.TempDir()

    def tearDown(self):
        self.tmp.cleanup()

    def create(self, name='t.hyb', size='16M', **opts):
        path = self.tmp(name)
        o = ','.join(f'{k.replace("_", "-")}={v}' for k, v in opts.items())
        args = ['create', '-q', '-f', 'hybrid'] + (['-o', o] if o else [])
        H.qemu_img(*args, path, size)
        return path

    def opts(self, path, **kw):
        o = f'driver=hybrid,file.driver=file,file.filename={path}'
        for k, v in kw.items():
            o += f',{k.replace("_", "-")}={v}'
        return o

    def hmp_daemon(self, path, opts=''):
        """qemu-system-x86_64 -M none (it has HMP) with the hybrid node h0
        (@opts appended) over the file node f0 of @path."""
        return H.StorageDaemon(self.tmp, '--blockdev',
                               f'driver=file,node-name=f0,filename={path}',
                               '--blockdev',
                               f'driver=hybrid,node-name=h0,file=f0{opts}',
                               system=True)

    def hmp_io(self, qsd, cmd):
        """qemu-io @cmd on h0 of an hmp_daemon() through HMP."""
        out = qsd.cmd('human-monitor-command', **{
            'command-line': f'qemu-io h0 "{cmd}"'})
        self.assertNotIn('failed', out)

    # ---- create / info / map / check / convert ----

    def test_create_info(self):
        """qemu-img info shows the header in the format-specific section."""
        p = self.create(ram_size='4M', block_size='128k', mode='async',
                        dedup='on')
        info = H.img_info(p)
        self.assertEqual(info['format'], 'hybrid')
        self.assertEqual(info['virtual-size'], 16 * MiB)
        self.assertEqual(info['cluster-size'], 128 * 1024)
        d = info['format-specific']['data']
        self.assertEqual(info['format-specific']['type'], 'hybrid')
        self.assertEqual(d['block-size'], 128 * 1024)
        self.assertEqual(d['ram-size'], 4 * MiB)
        self.assertEqual(d['mode'], 'async')
        self.assertTrue(d['dedup'])
        self.assertFalse(d['dirty'])
        self.assertEqual(d['version'], 1)

    def check_patterns(self, opts):
        """Write patterns below, across and above the RAM boundary (4 MiB),
        read them back in the same process and in a new one."""
        writes = [('0xa1', 0, '1M'), ('0xa2', 3 * MiB + 512 * 1024, '1M'),
                  ('0xa3', 9 * MiB, '64k'), ('0xa4', 12345 * 512, '4k')]
        cmds = []
        for pat, off, ln in writes:
            cmds += ['-c', f'write -P {pat} {off} {ln}']
        cmds += ['-c', 'write -z 1536k 64k', '-c', 'flush']
        reads = []
        for pat, off, ln in writes:
            reads += ['-c', f'read -P {pat} {off} {ln}']
        reads += ['-c', 'read -P 0 1536k 64k', '-c', 'read -P 0 2M 512k']
        out = H.qemu_io('-t', 'writeback', '--image-opts', opts, *cmds,
                        *reads).stdout
        self.assertNotIn('Pattern verification failed', out)
        self.assertNotIn('failed', out)
        out = H.qemu_io('--image-opts', opts, *reads).stdout
        self.assertNotIn('Pattern verification failed', out)
        self.assertNotIn('failed', out)

    def test_rw_sync(self):
        """Sync mode keeps data across the RAM boundary and reopen."""
        p = self.create(ram_size='4M')
        self.check_patterns(self.opts(p))
        self.assertEqual(H.qemu_img('check', p).returncode, 0)

    def test_rw_async(self):
        """Async mode with a tiny dirty limit (writers wait) keeps data."""
        p = self.create(ram_size='4M')
        self.check_patterns(self.opts(p, mode='async', dirty_limit='128k'))
        self.assertFalse(H.img_info(p)['format-specific']['data']['dirty'])

    def test_rw_dedup(self):
        """Dedup mode (async) keeps data; in-place and shared chunks."""
        p = self.create(ram_size='8M', dedup='on', mode='async')
        self.check_patterns(self.opts(p))
        # identical blocks then diverging writes to one of them
        o = self.opts(p)
        H.qemu_io('--image-opts', o, '-c', 'write -P 7 0 256k',
                  '-c', 'write -P 7 256k 256k', '-c', 'write -P 8 300k 4k')
        out = H.qemu_io('--image-opts', o, '-c', 'read -P 7 0 256k',
                        '-c', 'read -P 7 256k 44k', '-c', 'read -P 8 300k 4k',
                        '-c', 'read -P 7 304k 208k').stdout
        self.assertNotIn('failed', out)

    def test_tiny_and_zero_ram(self):
        """ram-size 0 (everything beyond the boundary) and a RAM tier smaller
        than one restore request both open, serve and close."""
        for ram in ('0', '64k', '1M'):
            p = self.create(name=f'r{ram}.hyb', size='4M', ram_size=ram)
            out = H.qemu_io('-f', 'hybrid', '-c', 'write -P 3 0 2M',
                            '-c', 'read -P 3 0 2M', p, timeout=30).stdout
            self.assertNotIn('failed', out)
            out = H.qemu_io('-f', 'hybrid', '-c', 'read -P 3 0 2M', p,
                            timeout=30).stdout
            self.assertNotIn('failed', out)

    def test_convert_roundtrip(self):
        """raw -> hybrid -> raw is identical; map lists the data."""
        raw = self.tmp('in.raw')
        H.qemu_img('create', '-q', '-f', 'raw', raw, '8M')
        H.qemu_io('-f', 'raw', '-c', 'write -P 0x5a 1M 1M',
                  '-c', 'write -P 0x11 7M 4k', raw)
        hyb = self.tmp('c.hyb')
        H.qemu_img('convert', '-O', 'hybrid', '-o', 'ram-size=2M', raw, hyb)
        H.qemu_img('compare', '-f', 'raw', '-F', 'hybrid', raw, hyb)
        back = self.tmp('back.raw')
        H.qemu_img('convert', '-f', 'hybrid', '-O', 'raw', hyb, back)
        H.qemu_img('compare', '-f', 'raw', '-F', 'raw', raw, back)
        m = json.loads(H.qemu_img('map', '--output=json', '-f', 'hybrid',
                                  hyb).stdout)
        data = [e for e in m if e['data']]
        self.assertEqual(sum(e['length'] for e in data), MiB + 4096)
        self.assertEqual(data[0]['start'], MiB)
        self.assertEqual(data[0]['offset'], 65536 + MiB)

    def test_raw_on_existing_image(self):
        """raw=on puts a RAM tier on an existing raw image without a header."""
        raw = self.tmp('plain.raw')
        H.qemu_img('create', '-q', '-f', 'raw', raw, '4M')
        H.qemu_io('-f', 'raw', '-c', 'write -P 0x33 0 1M', raw)
        o = self.opts(raw, raw='on', ram_size='2M', block_size='4k')
        out = H.qemu_io('--image-opts', o, '-c', 'read -P 0x33 0 1M',
                        '-c', 'write -P 0x44 3M 4k').stdout
        self.assertNotIn('failed', out)
        out = H.qemu_io('-f', 'raw', '-c', 'read -P 0x44 3M 4k',
                        '-c', 'read -P 0x33 0 1M', raw).stdout
        self.assertNotIn('failed', out)

    def test_check_short_tier(self):
        """A persistent tier shorter than the layout is reported; -r fixes."""
        p = self.create(size='8M')
        os.truncate(p, 65536 + 4 * MiB)
        r = H.qemu_img('check', p, check=False)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn('persistent tier is', r.stderr)
        H.qemu_img('check', '-r', 'all', p)
        self.assertEqual(H.qemu_img('check', p).returncode, 0)
        self.assertEqual(os.path.getsize(p), 65536 + 8 * MiB)

    # ---- bad input ----

    def assert_clean_error(self, r, text):
        self.assertNotEqual(r.returncode, 0, r.stdout)
        self.assertGreater(r.returncode, 0)   # not a signal
        self.assertIn(text, r.stdout + r.stderr)

    def test_bad_headers(self):
        """Corrupt, truncated and foreign headers give clear errors."""
        p = self.create(size='4M')
        with open(p, 'rb') as f:
            good = f.read(72)

        def patched(off, data):
            with open(p, 'r+b') as f:
                f.seek(0)
                f.write(good)
                f.seek(off)
                f.write(data)

        patched(0, b'XHYBRID\0')
        self.assert_clean_error(H.qemu_img('info', '-f', 'hybrid', p,
                                           check=False), 'bad magic')
        patched(8, b'\x02\0\0\0')
        self.assert_clean_error(H.qemu_img('info', '-f', 'hybrid', p,
                                           check=False), 'version 2')
        patched(40, b'\x01')      # data_offset changed, crc stale
        self.assert_clean_error(H.qemu_img('info', '-f', 'hybrid', p,
                                           check=False), 'checksum')
        patched(0, b'')
        with open(p, 'r+b') as f:
            f.truncate(40)
        self.assert_clean_error(H.qemu_img('info', '-f', 'hybrid', p,
                                           check=False), 'checksum')
        with open(p, 'r+b') as f:
            f.truncate(0)
        self.assert_clean_error(H.qemu_img('info', '-f', 'hybrid', p,
                                           check=False), 'header needs')

    def test_bad_options(self):
        """Wrong options and sizes that do not fit are refused clearly."""
        p = self.tmp('x.hyb')
        self.assert_clean_error(H.qemu_img('create', '-f', 'hybrid', '-o',
                                           'block-size=3000', p, '1M',
                                           check=False), 'block-size 3000')
        self.assert_clean_error(H.qemu_img('create', '-f', 'hybrid', '-o',
                                           'mode=fast', p, '1M', check=False),
                                "'fast'")
        self.assert_clean_error(H.qemu_img('create', '-f', 'hybrid', '-o',
                                           'block-size=4k,ram-size=64T', p,
                                           '1M', check=False), 'too large')
        self.assert_clean_error(H.qemu_img('create', '-f', 'hybrid', p, '4P',
                                           check=False), 'up to')
        p = self.create(size='4M')
        r = H.qemu_io('--image-opts', self.opts(p, dirty_limit='1k'),
                      '-c', 'read 0 4k', check=False)
        self.assert_clean_error(r, 'dirty-limit 1024')
        r = H.qemu_io('--image-opts', self.opts(p, bogus='1'),
                      '-c', 'read 0 4k', check=False)
        self.assert_clean_error(r, 'bogus')
        r = H.qemu_io('--image-opts', self.opts(p, block_size='4k'),
                      '-c', 'read 0 4k', check=False)
        self.assert_clean_error(r, 'raw=on')

    def test_ram_size_larger_than_the_disk_is_refused(self):
        """A ram-size the user gives that exceeds the disk would promise RAM
        the image never uses: refused at create, open and amend, naming
        the limit; one stored by a disk that later shrank means the whole
        disk."""
        msg = 'ram-size 8388608 is larger than the disk (4194304 bytes)'
        p = self.tmp('big.hyb')
        self.assert_clean_error(H.qemu_img('create', '-f', 'hybrid', '-o',
                                           'ram-size=8M', p, '4M',
                                           check=False), msg)
        p = self.create(size='4M', ram_size='4M')
        r = H.qemu_io('--image-opts', self.opts(p, ram_size='8M'),
                      '-c', 'read 0 4k', check=False)
        self.assert_clean_error(r, msg)
        self.assert_clean_error(H.qemu_img('amend', '-f', 'hybrid', '-o',
                                           'ram-size=8M', p, check=False),
                                msg)
        self.assertEqual(H.img_info(p)['format-specific']['data']['ram-size'],
                         4 * MiB)
        # shrunk below its stored ram-size: the RAM tier is the whole disk
        H.qemu_img('resize', '-f', 'hybrid', '--shrink', p, '2M')
        out = H.qemu_io('-f', 'hybrid', '-c', 'write -P 9 0 2M',
                        '-c', 'read -P 9 0 2M', p).stdout
        self.assertNotIn('failed', out)

    def test_fuzz_open(self):
        """Random header mutations never crash qemu-img (bounded time)."""
        import random
        p = self.create(size='1M')
        with open(p, 'rb') as f:
            good = bytearray(f.read(72))
        rnd = random.Random(1234)
        rounds = 400 if H.LONG else 60
        for i in range(rounds):
            h = bytearray(good)
            for _ in range(rnd.randint(1, 4)):
                h[rnd.randrange(72)] = rnd.randrange(256)
            if rnd.random() < 0.5:
                # keep the checksum valid so the field checks are reached
                h[68:72] = crc32c(bytes(h[:68]) + b'\0' * 4).to_bytes(4, 'little')
            with open(p, 'r+b') as f:
                f.write(h)
            r = H.qemu_io('-f', 'hybrid', '-c', 'read 0 64k', '-c',
                          'write 0 4k', p, check=False, timeout=60)
            self.assertGreaterEqual(r.returncode, 0)

    # ---- storage daemon: QMP, events, dedup accounting, nbd child ----

    def test_qmp_restore_and_stats(self):
        """Restore fills RAM, emits HYBRID_RESTORE_COMPLETED; query-hybrid
        reports hits, dedup ratio and metadata; hybrid-set-mode works."""
        p = self.create(size='32M', ram_size='16M', dedup='on')
        # A cloned pattern: 8 MiB made of the same 1 MiB repeated
        cmds = []
        for i in range(8):
            cmds += ['-c', f'write -P 0x6{i % 2} {i}M 1M']
        H.qemu_io('-f', 'hybrid', *cmds, p)
        qsd = H.StorageDaemon(self.tmp, '--blockdev',
                              f'driver=file,node-name=f0,filename={p}')
        try:
            qsd.cmd('blockdev-add', driver='hybrid', **{'node-name': 'h0'},
                    file='f0')
            ev = qsd.wait_event('HYBRID_RESTORE_COMPLETED')
            self.assertEqual(ev['data']['node-name'], 'h0')
            self.assertEqual(ev['data']['bytes'], 16 * MiB)
            self.assertNotIn('error', ev['data'])
            info = qsd.cmd('query-hybrid', **{'node-name': 'h0'})[0]
            self.assertTrue(info['restore-done'])
            self.assertEqual(info['ram-loaded'], 16 * MiB)
            # two distinct 64k blocks (0x60 and 0x61 patterns), rest zero
            self.assertEqual(info['ram-used'], 2 * 65536)
            self.assertGreater(info['dedup-ratio'], 100)
            self.assertLess(info['metadata-per-block'], 64)
            qsd.cmd('hybrid-set-mode', **{'node-name': 'h0', 'mode': 'async'})
            self.assertEqual(qsd.cmd('query-hybrid')[0]['mode'], 'async')
            r = qsd.qmp('hybrid-set-mode', **{'node-name': 'f0',
                                              'mode': 'sync'})
            self.assertIn('not a hybrid node', r['error']['desc'])
            r = qsd.qmp('query-hybrid', **{'node-name': 'nope'})
            self.assertIn('Cannot find node', r['error']['desc'])
            self.assertEqual(len(qsd.cmd('query-hybrid')), 1)   # healthy
        finally:
            qsd.stop()

    def test_restore_reads_no_holes(self):
        """A sparse persistent tier: the restore reads the data (2 MiB) and
        restores the holes without reading them.  Reads are throttled to
        1 MiB/s, so reading the 64 MiB tier would take a minute; the
        restore is done within seconds, every byte as the image holds it."""
        p = self.create(size='64M', ram_size='64M')
        H.qemu_io('-f', 'hybrid', '-c', 'write -P 0x5c 3M 1M', '-c', 'write -P 0x5d 40M 1M', p)
        qsd = H.StorageDaemon(
            self.tmp, '--object', 'throttle-group,id=tg0,x-bps-read=1048576',
            '--blockdev', f'driver=file,node-name=f0,filename={p}',
            '--blockdev', 'driver=throttle,node-name=t0,throttle-group=tg0,file=f0',
            system=True)
        try:
            t0 = time.monotonic()
            qsd.cmd('blockdev-add', driver='hybrid', **{'node-name': 'h0'}, file='t0')
            ev = qsd.wait_event('HYBRID_RESTORE_COMPLETED', timeout=30)
            took = time.monotonic() - t0
            self.assertEqual(ev['data']['bytes'], 64 * MiB)
            self.assertLess(took, 20, 'the restore read the holes')
            info = qsd.cmd('query-hybrid', **{'node-name': 'h0'})[0]
            self.assertEqual(info['ram-loaded'], 64 * MiB)
            self.assertEqual(info['ram-used'], 2 * MiB)
            for cmd in ('read -P 0 0 3M', 'read -P 0x5c 3M 1M', 'read -P 0 4M 36M',
                        'read -P 0x5d 40M 1M', 'read -P 0 41M 23M'):
                self.hmp_io(qsd, cmd)
        finally:
            qsd.stop()

    def test_dedup_fingerprint_after_rewrite(self):
        """A whole-block write is fingerprinted as it is written; a later
        partial write to the same block, before write-back, must not leave
        that fingerprint on the chunk.  Block 0 is written whole (content X)
        then 4k of it changed (content Y); block 1 is written whole as Y.
        After the flush they share one chunk, which a stale fingerprint
        (X's) on block 0 would prevent; and a block rewritten whole to what
        another holds is shared too."""
        p = self.create(size='4M', ram_size='4M', dedup='on', mode='async')
        y = self.tmp('y.bin')
        with open(y, 'wb') as f:
            f.write(b'\x08' * 4096 + b'\x07' * (60 * 1024))
        qsd = self.hmp_daemon(p)
        try:
            io = functools.partial(self.hmp_io, qsd)
            self.assertTrue(qsd.wait_restored()[0]['restore-done'])
            io('write -P 7 0 64k')
            io('write -P 8 0 4k')
            io(f'write -s {y} 64k 64k')
            io('flush')
            i = qsd.cmd('query-hybrid')[0]
            self.assertEqual(i['ram-used'], 65536)
            # whole rewrites: block 2 written as X then as Y before its
            # write-back; block 3 as X
            io('write -P 7 128k 64k')
            io(f'write -s {y} 128k 64k')
            io('write -P 7 192k 64k')
            io('flush')
            i = qsd.cmd('query-hybrid')[0]
            self.assertEqual(i['ram-used'], 2 * 65536)
            io('read -P 8 0 4k')
            io('read -P 7 4k 60k')
            io('read -P 8 128k 4k')
            io('read -P 7 132k 60k')
            io('read -P 7 192k 64k')
        finally:
            qsd.stop()

    def test_promotion(self):
        """Hot blocks beyond the boundary are promoted, the least recently
        used one demoted when promote-size is full; writes keep the promoted
        copy equal to the persistent tier."""
        p = self.create(ram_size='1M')
        H.qemu_io('-f', 'hybrid', '-c', 'write -P 9 8M 64k',
                  '-c', 'write -P 10 12M 64k', p)
        qsd = self.hmp_daemon(p, ',promote-size=64k')
        try:
            io = functools.partial(self.hmp_io, qsd)
            io('read -P 9 8M 64k')
            io('read -P 9 8M 64k')          # second read: promoted
            i = qsd.cmd('query-hybrid')[0]
            self.assertEqual((i['promotions'], i['promoted-bytes']),
                             (1, 65536))
            hits = i['read-hits']
            io('read -P 9 8M 64k')          # served from RAM
            self.assertEqual(qsd.cmd('query-hybrid')[0]['read-hits'],
                             hits + 1)
            io('write -P 11 8M 4k')         # write-through updates the copy
            io('read -P 11 8M 4k')
            io('read -P 10 12M 64k')
            io('read -P 10 12M 64k')        # promotes 12M, demotes 8M
            i = qsd.cmd('query-hybrid')[0]
            self.assertEqual((i['promotions'], i['demotions']), (2, 1))
            io('read -P 11 8M 4k')
            io('read -P 9 8196k 60k')
        finally:
            qsd.stop()

    def test_hmp_info_hybrid(self):
        """HMP 'info hybrid' in the system emulator prints the node's state;
        an unknown node gives an error and the monitor keeps working."""
        qemu = os.path.join(H.BIN, 'qemu-system-x86_64')
        if not os.access(qemu, os.X_OK):
            self.skipTest('qemu-system-x86_64 not built')
        p = self.create(ram_size='4M')
        cmds = [{'execute': 'qmp_capabilities'},
                {'execute': 'human-monitor-command',
                 'arguments': {'command-line': 'info hybrid'}},
                {'execute': 'human-monitor-command',
                 'arguments': {'command-line': 'info hybrid nope'}},
                {'execute': 'query-hybrid'},
                {'execute': 'quit'}]
        r = H.subprocess.run(
            [qemu, '-M', 'none', '-nodefaults', '-display', 'none',
             '-qmp', 'stdio', '-blockdev',
             f'driver=file,node-name=f,filename={p}',
             '-blockdev', 'driver=hybrid,node-name=h,file=f'],
            input=''.join(json.dumps(c) + '\n' for c in cmds),
            capture_output=True, text=True, timeout=60)
        replies = [json.loads(ln) for ln in r.stdout.splitlines()
                   if ln.startswith('{') and 'return' in ln]
        self.assertIn('h: mode sync, dedup off', replies[1]['return'])
        self.assertIn('RAM tier:', replies[1]['return'])
        self.assertIn("Cannot find node 'nope'", replies[2]['return'])
        self.assertEqual(replies[3]['return'][0]['node-name'], 'h')

    def test_nbd_persistent_tier(self):
        """The persistent tier can be an NBD export."""
        raw = self.tmp('exp.raw')
        H.qemu_img('create', '-q', '-f', 'raw', raw, f'{8 * MiB + 65536}')
        sock = self.tmp('nbd.sock')
        qsd = H.StorageDaemon(self.tmp, '--blockdev',
                              f'driver=file,node-name=f0,filename={raw}',
                              '--nbd-server',
                              f'addr.type=unix,addr.path={sock}',
                              '--export', 'type=nbd,id=e0,node-name=f0,'
                              'name=exp,writable=on')
        try:
            url = f'nbd+unix:///exp?socket={sock}'
            H.qemu_img('create', '-q', '-f', 'hybrid', '-o', 'ram-size=4M',
                       url, '8M')
            o = (f'driver=hybrid,mode=async,file.driver=nbd,'
                 f'file.server.type=unix,file.server.path={sock},'
                 f'file.export=exp')
            H.qemu_io('--image-opts', o, '-c', 'write -P 0x77 3M 2M')
            out = H.qemu_io('--image-opts', o, '-c', 'read -P 0x77 3M 2M').stdout
            self.assertNotIn('failed', out)
        finally:
            qsd.stop()
        out = H.qemu_io('-f', 'raw', '-c', f'read -P 0x77 {65536 + 3 * MiB} 2M',
                        raw).stdout
        self.assertNotIn('failed', out)


_CRC_TABLE = []


def crc32c(data):
    """CRC-32C as QEMU's crc32c(0xffffffff, ...) (no final xor)."""
    if not _CRC_TABLE:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
            _CRC_TABLE.append(c)
    crc = 0xffffffff
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xff] ^ (crc >> 8)
    return crc


if __name__ == '__main__':
    unittest.main()
