"""Stock post-copy migration of the Redis guest between two QEMU processes."""
import random

from hvtest import HybridVMTest


def dataset(seed, count, size):
    rng = random.Random(seed)
    return {f'key:{i}': rng.randbytes(size) for i in range(count)}


class PostcopyMigration(HybridVMTest):

    def test_stock_postcopy(self):
        """postcopy-ram + migrate-start-postcopy: the migration completes, the
        destination runs, and Redis there returns every value written before."""
        import hvlib
        args = dict(mem='512M')
        src = self.guest('src', **args).launch()
        src.wait_console(r'HV-READY redis', timeout=120)
        dst = self.guest('dst', incoming='defer', **args).launch()

        data = dataset(seed=2, count=20000, size=1024)
        r = src.redis()
        pipe = r.pipeline(transaction=False)
        for k, v in data.items():
            pipe.set(k, v)
        pipe.execute()
        self.assertEqual(r.dbsize(), len(data))
        r.close()

        # A 1 Gbit/s cap keeps pre-copy running long enough to switch to post-copy.
        res = hvlib.migrate_postcopy(src, dst, precopy_seconds=0.5, bandwidth=125_000_000)
        self.log.info('migration: %s', res.row())
        self.assertEqual(res.status, 'completed')
        self.assertTrue(res.switched_to_postcopy, 'migration finished before post-copy started')
        self.assertEqual(src.qmp('query-status')['status'], 'postmigrate')

        r = dst.redis()
        self.assertEqual(r.dbsize(), len(data))
        keys = list(data)
        for i in range(0, len(keys), 1000):
            chunk = keys[i:i + 1000]
            self.assertEqual(r.mget(chunk), [data[k] for k in chunk])
        self.assertTrue(r.set('after-migration', b'1'))
