"""App-assisted post-copy with Redis and our module in the guest.

The same data set (70 % of it cold in the module's arena) is migrated with
post-copy: stock, with app-assist as it comes (the module leaves what it frees
as zero pages, nothing to balloon), and with app-assist over the balloon (the
module told to keep freed pages as they are).  Each assisted migration must
send fewer bytes than the stock one by at least 80 % of the cold bytes the
module reported (its arena's items: keys, values, headers); on the destination the hot items read back, the cold ones are
misses (policy drop), the balloon is back to its full size and the module was
resumed.  (The module runs in the stock migration's guest too: what jemalloc
gave back before the migration is zero pages there as well, so only the
arena's content is the assist's own saving.)
"""
import os
import random
import shutil
import subprocess
import time

from hvtest import HybridVMTest
from test_app_assist import LINK_PORTS, MiB, balloon_actual, port_args, wait_for

BANDWIDTH = 125_000_000     # 1 Gbit/s


class Dataset(list):
    """(key, value) pairs; a short repr keeps avocado's locals dump small."""

    def __repr__(self):
        return f'<{len(self)} items>'

    def __getitem__(self, index):
        item = super().__getitem__(index)
        return Dataset(item) if isinstance(index, slice) else item


def dataset(seed, count, size):
    rng = random.Random(seed)
    return Dataset((f'k{i}', rng.randbytes(size)) for i in range(count))


class AppAssistRedis(HybridVMTest):

    MEM = '1G'
    COUNT = int(os.environ.get('HYBRIDVM_AA_ITEMS', 60000))
    SIZE = 1024
    HOT = 0.3

    def redis_guest(self, name, incoming=None, append=''):
        return self.guest(name, mem=self.MEM, module=True, incoming=incoming,
                          args=port_args(1), append=append)

    def load(self, src, data, zero_freed=None):
        """Load `data`, make everything cold, then read the hot 30 % back
        (an access promotes an item).  Returns (hot, cold) lists."""
        src.wait_console(r'HV-READY redis', timeout=120)
        src.run(LINK_PORTS)
        r = src.redis()
        if 'appassist_state' not in r.info('appassist'):
            self.cancel('the guest image has no Redis module (build redis-module, '
                        'then scripts/build-guest.sh)')
        if zero_freed:
            r.config_set('appassist.zero-freed', zero_freed)
        for i in range(0, len(data), 2000):
            pipe = r.pipeline(transaction=False)
            for k, v in data[i:i + 2000]:
                pipe.set(k, v)
            pipe.execute()
        for k, v in {'hot-percent': 0, 'min-idle-ms': 0, 'interval-ms': 1,
                     'slice-us': 1000}.items():
            r.config_set(f'appassist.{k}', v)
        deadline = time.monotonic() + 120
        while r.info('appassist')['appassist_cold_items'] < len(data):
            r.execute_command('APPASSIST.DEMOTE', 1000)
            self.assertLess(time.monotonic(), deadline, 'demotion did not finish')
        r.config_set('appassist.demote', 'no')
        nhot = int(len(data) * self.HOT)
        hot, cold = data[:nhot], data[nhot:]
        for i in range(0, nhot, 1000):
            chunk = hot[i:i + 1000]
            self.assertTrue(r.mget([k for k, _ in chunk]) == [v for _, v in chunk],
                            'hot items differ')
        info = r.info('appassist')
        self.assertEqual(info['appassist_cold_items'], len(cold))
        wait_for(lambda: r.info('appassist')['appassist_port_connected'] == 1, 30,
                 'the module to open its port')
        self.log.info('%s: loaded %d items, %d cold (%d bytes in arena)', src.name, len(data),
                      len(cold), info['appassist_cold_bytes'])
        r.close()
        return hot, cold

    def migrate(self, src, dst, assisted, parameters=None):
        import hvlib
        caps = ['app-assist'] if assisted else []
        return hvlib.migrate_postcopy(src, dst, precopy_seconds=1.0, bandwidth=BANDWIDTH,
                                      capabilities=caps, timeout=600, parameters=parameters)

    def test_stock_vs_assisted(self):
        """Stock vs app-assisted post-copy of the same Redis data set, with
        zero pages (the default) and with the balloon."""
        data = dataset(5, self.COUNT, self.SIZE)

        # 1. Stock post-copy.
        src = self.redis_guest('stock-src').launch()
        self.load(src, data)
        dst = self.redis_guest('stock-dst', incoming='defer').launch()
        stock = self.migrate(src, dst, assisted=False)
        self.log.info('stock: %s', stock.row())
        self.assertEqual(stock.status, 'completed')
        r = dst.redis()
        self.assertEqual(r.dbsize(), len(data))     # DBSIZE counts cold items too
        sample = data[-1000:]
        self.assertTrue(r.mget([k for k, _ in sample]) == [v for _, v in sample],
                        'items differ on the destination')
        r.close()
        src.shutdown()
        dst.shutdown()

        # 2. App-assisted post-copy: the module left what it freed as zero
        #    pages (appassist.zero-freed auto), so QEMU does not balloon.
        info = self.assisted(data, stock, 'aa')
        self.assertEqual(info['zeroed-bytes'], info['freed-bytes'])
        self.assertEqual(info['ports'][0]['zeroed-bytes'], info['freed-bytes'])
        self.assertEqual(info['balloon-target'], 0)
        self.assertEqual(info['balloon-time'], 0)
        # ... and it gave QEMU the arena's pages, which went as zero pages
        # unread (the saving asserted in assisted() depends on it: the arena
        # was neither cleared nor unmapped in the guest during the migration).
        self.assertGreater(info['dropped-pages'] * 4096, 0.9 * self.COUNT * (1 - self.HOT) * self.SIZE)
        self.assertEqual(info['ports'][0]['dropped-pages'], info['dropped-pages'])
        self.assertEqual(info['rejected-pages'], 0)
        self.assertEqual(self.dst_module['appassist_last_prepare_release'], 'unmapped at RESUME')
        self.assertEqual(self.dst_module['appassist_last_prepare_clear_us'], 0)
        self.assertEqual(self.dst_module['appassist_last_prepare_page_frames'],
                         info['dropped-pages'])

        # 3. The balloon path: the module keeps freed pages as they are.
        info = self.assisted(data, stock, 'aa-balloon', zero_freed='no')
        self.assertEqual(info['zeroed-bytes'], 0)
        self.assertGreater(info['balloon-target'], 0)
        self.assertLess(info['balloon-target'], info['balloon-initial'])
        self.assertLessEqual(info['balloon-reached'], info['balloon-target'])

    def assisted(self, data, stock, tag, zero_freed=None):
        """One app-assisted post-copy of `data`, compared with `stock`;
        checks the destination.  Returns query-migrate's app-assist part."""
        src = self.redis_guest(f'{tag}-src').launch()
        hot, cold = self.load(src, data, zero_freed)
        full = balloon_actual(src)
        r = src.redis()
        cold_bytes = r.info('appassist')['appassist_cold_bytes']
        r.close()
        dst = self.redis_guest(f'{tag}-dst', incoming='defer').launch()
        aa = self.migrate(src, dst, assisted=True)
        info = aa.info['app-assist']
        self.log.info('%s: %s', tag, aa.row())
        self.log.info('%s: app-assist: %s', tag, info)
        self.assertEqual(aa.status, 'completed')
        self.assertEqual(info['status'], 'completed')
        self.assertEqual(info['apps-answered'], 1)
        port = info['ports'][0]
        self.assertEqual(port['items'], len(cold))
        freed = info['freed-bytes']
        self.assertGreater(cold_bytes, len(cold) * self.SIZE)
        self.assertGreaterEqual(freed, cold_bytes)
        saved = stock.transferred_bytes - aa.transferred_bytes
        self.log.info('%s: transferred: stock %d, assisted %d, saved %d = %.0f %% of the '
                      '%d cold bytes (%d freed reported, %d zero pages); setup %d ms (prepare '
                      '%d, balloon %d)', tag, stock.transferred_bytes, aa.transferred_bytes,
                      saved, 100 * saved / cold_bytes, cold_bytes, freed, info['zeroed-bytes'],
                      aa.setup_time_ms, info['prepare-time'], info['balloon-time'])
        self.assertGreaterEqual(saved, 0.8 * cold_bytes)
        self.assertGreaterEqual(aa.setup_time_ms, info['prepare-time'] + info['balloon-time'])

        # Destination: hot items intact, cold ones dropped, module resumed,
        # balloon back to its full size.
        wait_for(lambda: balloon_actual(dst) == full, 60, 'the balloon to deflate')
        r = dst.redis()
        for i in range(0, len(hot), 1000):
            chunk = hot[i:i + 1000]
            self.assertTrue(r.mget([k for k, _ in chunk]) == [v for _, v in chunk],
                            'hot items differ on the destination')
        for i in range(0, len(cold), 1000):
            chunk = cold[i:i + 1000]
            self.assertEqual(r.mget([k for k, _ in chunk]), [None] * len(chunk))
        self.assertEqual(r.dbsize(), len(hot))
        wait_for(lambda: r.info('appassist')['appassist_resumes'] == 1, 30, 'RESUME')
        self.assertEqual(r.info('appassist')['appassist_state'], 'normal')
        wait_for(lambda: r.info('appassist')['appassist_last_prepare_release'] != 'parked', 30,
                 'the arena handed back')
        self.dst_module = r.info('appassist')
        self.assertEqual(dst.qmp('query-migrate')['app-assist']['status'], 'resumed')
        self.assertTrue(r.set('after-migration', b'1'))
        r.close()
        src.shutdown()
        dst.shutdown()
        return info

    def test_init_on_free_guest(self):
        """A guest booted with init_on_free=1 zeroes every page it frees:
        with ballooning off, what the module gave back goes as zero pages.
        The module sees the kernel argument and drops lazily (a thread
        unmaps the arena after the reply); the assisted migration still
        sends fewer bytes than stock post-copy of the same guest by >= 80 %
        of the arena PREPARE dropped (what the module gave back earlier is
        zero in both runs), and the hot items read back."""
        data = dataset(6, self.COUNT, self.SIZE)
        sent = {}
        for assisted in (False, True):
            tag = 'aa' if assisted else 'stock'
            src = self.redis_guest(f'iof-{tag}-src', append='init_on_free=1').launch()
            hot, cold = self.load(src, data)
            full = balloon_actual(src)
            r = src.redis()
            arena = r.info('appassist')['appassist_arena_mapped_bytes']
            r.close()
            dst = self.redis_guest(f'iof-{tag}-dst', incoming='defer',
                                   append='init_on_free=1').launch()
            res = self.migrate(src, dst, assisted,
                               parameters={'app-assist-balloon': False} if assisted else None)
            self.log.info('init_on_free, %s: %s', tag, res.row())
            self.assertEqual(res.status, 'completed')
            sent[tag] = res.transferred_bytes
            r = dst.redis()
            sample = hot[:2000]
            self.assertTrue(r.mget([k for k, _ in sample]) == [v for _, v in sample],
                            'hot items differ on the destination')
            if assisted:
                info = res.info['app-assist']
                self.assertEqual(info['apps-answered'], 1)
                self.assertEqual(balloon_actual(dst), full)   # never inflated
                self.assertEqual(r.info('appassist')['appassist_last_prepare_lazy'], 1)
                saved = sent['stock'] - sent['aa']
                self.log.info('init_on_free: saved %d = %.0f %% of the %d-byte arena '
                              '(%d freed reported); prepare %d ms', saved, 100 * saved / arena,
                              arena, info['freed-bytes'], info['prepare-time'])
                self.assertGreaterEqual(info['freed-bytes'], arena)
                self.assertGreaterEqual(saved, 0.8 * arena)
            r.close()
            src.shutdown()
            dst.shutdown()

    def test_spill_policy(self):
        """Policy spill: PREPARE writes the cold arena to a file on the guest's
        disk (shared by both QEMUs, as for any migration without storage
        copy); after the assisted migration every item, hot and cold, reads
        back on the destination and the balloon is back to full size."""
        img = os.path.join(self.workdir, 'spill.img')
        with open(img, 'wb') as f:
            f.truncate(256 * MiB)
        if not shutil.which('mkfs.ext4'):
            self.cancel('mkfs.ext4 (e2fsprogs) is not installed')
        # The guest image has no mkfs: format on the host.
        subprocess.run(['mkfs.ext4', '-q', '-F', img], check=True, timeout=60)
        disk = ['-drive', f'file={img},if=none,id=d0,format=raw',
                '-device', 'virtio-blk-pci,drive=d0']
        # spill-path is protected (no CONFIG SET): given at start-up
        kw = dict(mem=self.MEM, module=True,
                  append='hv.mount=/dev/vda:/spill hv.redisarg=--appassist.spill-path,/spill/appassist.spill',
                  args=port_args(1) + disk)
        data = dataset(9, self.COUNT // 3, self.SIZE)
        src = self.guest('spill-src', **kw).launch()
        src.wait_console(r'HV-MOUNT /dev/vda /spill', timeout=120)
        r = src.redis()
        r.config_set('appassist.on-prepare', 'spill')
        r.close()
        hot, cold = self.load(src, data)
        full = balloon_actual(src)
        dst = self.guest('spill-dst', incoming='defer', **kw).launch()
        res = self.migrate(src, dst, assisted=True)
        info = res.info['app-assist']
        self.log.info('spill: %s; app-assist: %s', res.row(), info)
        self.assertEqual(res.status, 'completed')
        self.assertEqual(info['apps-answered'], 1)
        self.assertEqual(info['ports'][0]['items'], len(cold))
        self.assertGreater(info['freed-bytes'], 0)
        wait_for(lambda: balloon_actual(dst) == full, 60, 'the balloon to deflate')
        r = dst.redis()
        wait_for(lambda: r.info('appassist')['appassist_resumes'] == 1, 30, 'RESUME')
        self.assertEqual(r.dbsize(), len(data))
        for i in range(0, len(data), 1000):
            chunk = data[i:i + 1000]
            self.assertTrue(r.mget([k for k, _ in chunk]) == [v for _, v in chunk],
                            'items differ on the destination')
        r.close()

    def test_cancel_and_failure(self):
        """Redis with the module, balloon path (zero-freed no): a migration
        cancelled while the balloon inflates, then one whose destination dies
        during pre-copy.  Each time the source deflates to the full size, the
        module gets ABORT (back to its normal state) and Redis keeps serving
        the hot items and new writes."""
        import hvlib
        data = dataset(7, self.COUNT, self.SIZE)
        src = self.redis_guest('undo-src').launch()
        hot, cold = self.load(src, data, zero_freed='no')
        full = balloon_actual(src)
        caps = [{'capability': 'postcopy-ram', 'state': True},
                {'capability': 'app-assist', 'state': True}]
        src.qmp('migrate-set-capabilities', capabilities=caps)
        src.qmp('migrate-set-parameters', **{'max-bandwidth': BANDWIDTH})

        def serving(aborts):
            r = src.redis()
            wait_for(lambda: r.info('appassist')['appassist_aborts'] == aborts, 30, 'ABORT')
            self.assertEqual(r.info('appassist')['appassist_state'], 'normal')
            for i in range(0, len(hot), 1000):
                chunk = hot[i:i + 1000]
                self.assertTrue(r.mget([k for k, _ in chunk]) == [v for _, v in chunk],
                                'hot items differ after ABORT')
            self.assertTrue(r.set(f'after-abort-{aborts}', b'1'))
            self.assertEqual(r.get(f'after-abort-{aborts}'), b'1')
            r.close()

        def start(tag):
            dst = self.redis_guest(tag, incoming='defer').launch()
            uri = f'tcp:127.0.0.1:{hvlib.free_port()}'
            dst.qmp('migrate-set-capabilities', capabilities=caps)
            dst.qmp('migrate-incoming', uri=uri)
            src.qmp('migrate', uri=uri)
            return dst

        # 1. Cancelled while the balloon inflates.
        dst = start('undo-dst1')
        wait_for(lambda: src.qmp('query-migrate').get('app-assist', {}).get('status') ==
                 'ballooning', 60, 'the ballooning phase', interval=0.01)
        src.qmp('migrate_cancel')
        wait_for(lambda: src.qmp('query-migrate')['status'] == 'cancelled', 30, 'cancelled')
        aa = src.qmp('query-migrate')['app-assist']
        self.log.info('cancelled: %s', aa)
        self.assertEqual(aa['status'], 'cancelled')
        self.assertEqual(aa['apps-answered'], 1)
        self.assertGreater(aa['balloon-target'], 0)
        wait_for(lambda: balloon_actual(src) == full, 60, 'the balloon to deflate')
        serving(1)
        dst.shutdown()

        # 2. The destination dies during pre-copy (the assist had completed).
        src.qmp('migrate-set-parameters', **{'max-bandwidth': 20_000_000})
        dst = start('undo-dst2')
        wait_for(lambda: src.qmp('query-migrate')['status'] == 'active', 120,
                 'pre-copy to start')
        self.assertEqual(src.qmp('query-migrate')['app-assist']['status'], 'completed')
        self.assertLess(balloon_actual(src), full)
        dst.kill()
        wait_for(lambda: src.qmp('query-migrate')['status'] == 'failed', 60, 'failed')
        wait_for(lambda: balloon_actual(src) == full, 60, 'the balloon to deflate')
        serving(2)
        self.assertEqual(src.qmp('query-status')['status'], 'running')
        src.shutdown()

    def test_page_list_and_reuse(self):
        """The module lists its dropped arena's guest-physical pages and QEMU
        marks them to go as zero pages unread.  Then, while the first pass is
        still under way at 4 MB/s, the source hands the arena back to the
        guest kernel (APPASSIST.ABORT from a client: cleared, then unmapped)
        and Redis writes 40 MB of new items into the memory that frees.  Every
        new item must reach the destination: a listed page written after the
        list loses its mark at the next dirty-bitmap sync.  (Run against a
        QEMU built without that, every item of the first batch checked
        differed on the destination.)"""
        import hvlib
        data = dataset(11, self.COUNT, self.SIZE)
        src = self.redis_guest('list-src').launch()
        hot, cold = self.load(src, data)
        dst = self.redis_guest('list-dst', incoming='defer').launch()
        caps = [{'capability': c, 'state': True} for c in ('postcopy-ram', 'app-assist')]
        for g in (src, dst):
            g.qmp('migrate-set-capabilities', capabilities=caps)
        src.qmp('migrate-set-parameters', **{'max-bandwidth': 4_000_000,
                                             'max-postcopy-bandwidth': BANDWIDTH})
        uri = f'tcp:127.0.0.1:{hvlib.free_port()}'
        dst.qmp('migrate-incoming', uri=uri)
        src.qmp('migrate', uri=uri)
        wait_for(lambda: 'pages-time' in src.qmp('query-migrate').get('app-assist', {}), 60,
                 'the page list taken', interval=0.05)
        aa = src.qmp('query-migrate')['app-assist']
        r = src.redis()
        mod = r.info('appassist')
        self.log.info('list: %s; module: runs %d frames %d unlisted %d in %d us, '
                      '%d slices, the longest %d us', aa,
                      mod['appassist_last_prepare_page_runs'],
                      mod['appassist_last_prepare_page_frames'],
                      mod['appassist_last_prepare_page_unlisted'],
                      mod['appassist_last_prepare_page_list_us'],
                      mod['appassist_last_prepare_page_slices'],
                      mod['appassist_last_prepare_page_slice_max_us'])
        self.assertEqual(mod['appassist_last_prepare_release'], 'parked')
        self.assertEqual(aa['dropped-pages'], mod['appassist_last_prepare_page_frames'])
        self.assertEqual(aa['rejected-pages'], 0)
        self.assertGreater(aa['dropped-pages'] * 4096, len(cold) * self.SIZE)

        # Hand the arena back on the source and write into what it frees.
        r.execute_command('APPASSIST.ABORT')
        wait_for(lambda: r.info('appassist')['appassist_last_prepare_unmap_us'] > 0, 60,
                 'the arena cleared and unmapped')
        self.assertEqual(r.info('appassist')['appassist_last_prepare_release'],
                         'cleared at ABORT')
        fresh = dataset(12, 40000, self.SIZE)
        for i in range(0, len(fresh), 2000):
            pipe = r.pipeline(transaction=False)
            for k, v in fresh[i:i + 2000]:
                pipe.set(f'new-{k}', v)
            pipe.execute()
        r.close()
        mig = src.qmp('query-migrate')
        self.log.info('after the writes: %s, %d bytes remaining', mig['status'],
                      mig['ram']['remaining'])
        self.assertEqual(mig['status'], 'active', 'the first pass ended before the writes: '
                         'this run proves nothing')
        src.qmp('migrate-start-postcopy')
        wait_for(lambda: src.qmp('query-migrate')['status'] == 'completed', 300,
                 'the migration to complete')
        wait_for(lambda: dst.qmp('query-status')['status'] == 'running', 60, 'destination')
        r = dst.redis()
        for i in range(0, len(fresh), 1000):
            chunk = fresh[i:i + 1000]
            got = r.mget([f'new-{k}' for k, _ in chunk])
            bad = sum(g != v for (_, v), g in zip(chunk, got))
            self.assertEqual(bad, 0, f'{bad} of {len(chunk)} new items differ on the destination')
        for i in range(0, len(hot), 1000):
            chunk = hot[i:i + 1000]
            self.assertTrue(r.mget([k for k, _ in chunk]) == [v for _, v in chunk],
                            'hot items differ on the destination')
        r.close()
        src.shutdown()
        dst.shutdown()
