"""Memory: what APPASSIST.PREPARE with `drop` gives back, against what the
same cold items cost in stock Redis (stock RSS with all items minus stock RSS
with the hot items only, measured in this test), for design-shaped items
(1-8 byte keys, 100-byte values; 1M cold + 30 % hot) and for 1 KiB values.

Checked:
- the process RSS falls, from "all items loaded" (the same state as stock)
  to "after PREPARE", by at least 80 % of the stock cost of the cold items
  (measured: ~88 % for 100-byte values, ~94 % for 1 KiB values);
- across PREPARE itself RSS falls by at least 90 % of the reported
  `freed_bytes` (whole chunks really go back to the OS). That fall alone is
  ~79 % of the stock cost: the arena keeps an item in less memory than stock
  Redis does (~140 vs ~183 bytes for 100-byte values), the rest of the stock
  cost was already given back when the items were demoted.
HYBRIDVM_LONG=1: 5M cold 100-byte items, 300k 1 KiB items."""

import os
import random
import shutil
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hmlib import ServerTestCase, pipe  # noqa: E402

LONG = os.environ.get('HYBRIDVM_LONG') == '1'
ALPHA = '0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'


def short_key(i):
    """Distinct 1-8 byte keys (base 62)."""
    s = ''
    while True:
        s = ALPHA[i % 62] + s
        i //= 62
        if i == 0:
            return s


def load(srv, keys, vlen, seed):
    """SET every key to its own random value of `vlen` bytes."""
    rng = random.Random(seed)
    pipe(srv, ((b'SET', k.encode(), rng.randbytes(vlen)) for k in keys))


def touch(srv, keys):
    """Read every key once: STRLEN touches the key like GET (LRU/LFU) with a
    small reply."""
    pipe(srv, ((b'STRLEN', k.encode()) for k in keys))


def settle(srv):
    """MEMORY PURGE and let the allocator's background purge run: RSS is then
    what the data really holds."""
    srv.client().execute_command('MEMORY', 'PURGE')
    time.sleep(0.3)
    return srv.rss()


class MemoryTest(ServerTestCase):

    def setUp(self):
        super().setUp()
        if not shutil.which('redis-cli'):
            self.skipTest('redis-cli not installed (redis-tools)')

    def measure(self, vlen, nhot, ncold):
        keys = [short_key(i) for i in range(nhot + ncold)]
        rng = random.Random(vlen)
        rng.shuffle(keys)
        hot, cold = keys[:nhot], keys[nhot:]

        # Stock: what the cold items cost.
        stock = self.server('stock', module=False)
        load(stock, hot, vlen, 1)
        rss_hot = settle(stock)
        load(stock, cold, vlen, 2)
        rss_all = settle(stock)
        cost = rss_all - rss_hot
        stock.stop()

        # Module: same load; the hot ones read once, then the module's own
        # classification demotes the rest. It uses Redis's LFU counters (no
        # decay during the test): read keys have counter 6, unread ones 5,
        # and the hot budget is sized 10 % above the hot items' estimated
        # bytes, so exactly the unread keys are cold.
        avg_klen = sum(len(k) for k in keys) / len(keys)
        planned = int(nhot * (vlen + avg_klen + 48) * 1.1 / 0.3)
        mod = self.server('mod', configs={'demote': 'no', 'hot-percent': 30,
                                          'planned-memory': planned, 'min-idle-ms': 0},
                          extra=['--maxmemory-policy', 'allkeys-lfu', '--lfu-decay-time', '0'])
        mc = mod.client()
        load(mod, hot, vlen, 1)
        load(mod, cold, vlen, 2)
        rss_mod_all = settle(mod)
        touch(mod, hot)
        mc.config_set('appassist.demote', 'yes')
        demoted = 0
        deadline = time.monotonic() + 60
        while demoted < ncold and time.monotonic() < deadline:
            demoted += mc.execute_command('APPASSIST.DEMOTE', 5000)
        mc.config_set('appassist.demote', 'no')
        info = mc.info('appassist')
        self.assertEqual(info['appassist_cold_items'], ncold)
        rss_before = settle(mod)
        rep = mc.execute_command('APPASSIST.PREPARE')
        rep = dict(zip(rep[::2], rep[1::2]))
        rss_after = settle(mod)
        self.assertEqual(rep[b'items'], ncold)
        self.assertGreater(rep[b'freed_bytes'], 0)
        fall = rss_mod_all - rss_after
        prepare_fall = rss_before - rss_after
        print('\nvlen=%d hot=%d cold=%d: stock cold cost %.1f MiB (%.0f B/item); '
              'module RSS all %.1f, before PREPARE %.1f, after %.1f MiB; '
              'fall %.1f MiB = %.0f%% of cost (PREPARE alone %.1f MiB = %.0f%%); '
              'freed_bytes %.1f MiB, prepare %d us'
              % (vlen, nhot, ncold, cost / 2**20, cost / ncold, rss_mod_all / 2**20,
                 rss_before / 2**20, rss_after / 2**20, fall / 2**20, 100.0 * fall / cost,
                 prepare_fall / 2**20, 100.0 * prepare_fall / cost,
                 rep[b'freed_bytes'] / 2**20, rep[b'time_us']))
        # The hot items are all still there.
        for k in hot[:2000]:
            self.assertIsNotNone(mc.get(k))
        # Cold items are misses now (drop = cache semantics).
        for k in cold[:2000]:
            self.assertIsNone(mc.get(k))
        self.assertGreaterEqual(prepare_fall, 0.9 * rep[b'freed_bytes'])
        self.assertGreaterEqual(fall, self.target * cost)
        self.assertHealthy(mod)
        return fall, cost

    def test_drop_100_byte_values(self):
        """Design-shaped items: 30 % hot, 100-byte values, 1-8 byte keys."""
        n = 7000000 if LONG else 1430000      # 1M (5M) cold items
        self.target = 0.8
        self.measure(100, int(n * 0.3), n - int(n * 0.3))

    def test_drop_1k_values(self):
        n = 300000 if LONG else 40000
        self.target = 0.8
        self.measure(1024, int(n * 0.3), n - int(n * 0.3))


if __name__ == '__main__':
    unittest.main()
