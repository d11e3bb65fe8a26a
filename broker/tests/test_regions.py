"""The broker's catalogue operations: regions are created, looked up, listed,
stat'ed, resized and destroyed; items are 2 MiB-aligned first-fit extents;
names with '/', '..', NUL and friends are refused; the hvmem CLI drives the
same operations."""

import errno
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from brokerlib import ITEM_ALIGN, BrokerTestCase, wait_for  # noqa: E402

MiB = 1 << 20


class RegionTest(BrokerTestCase):

    def test_create_lookup_list_stat_destroy(self):
        """A region is a 0600 broker-owned file of the asked size (rounded to
        the page); lookup, list and stat see it; destroy removes name and file."""
        r = self.c.create('vm1', 10 * MiB + 1, 0o640)
        self.assertEqual(r['size'], 10 * MiB + 4096)
        self.assertEqual(r['mode'], 0o640)
        self.assertEqual(r['uid'], os.getuid())
        path = self.broker.region_file(r['id'])
        st = os.stat(path)
        self.assertEqual(st.st_size, r['size'])
        self.assertEqual(st.st_mode & 0o777, 0o600)
        self.assertEqual(self.c.lookup('vm1')['id'], r['id'])
        self.assertEqual([x['name'] for x in self.c.list()], ['vm1'])
        info, items = self.c.stat('vm1')
        self.assertEqual(info['nitems'], 0)
        self.assertEqual(items, [])
        self.assertBrokerError(errno.EEXIST, self.c.create, 'vm1', MiB)
        self.c.destroy('vm1')
        self.assertBrokerError(errno.ENOENT, self.c.lookup, 'vm1')
        self.assertFalse(os.path.exists(path))
        self.assertEqual(self.c.list(), [])
        self.assertEqual(self.c.pool()['used'], 0)
        self.assertHealthy()

    def test_items_are_2mib_aligned_first_fit(self):
        """Items get 2 MiB-aligned extents rounded up to 2 MiB, the first hole
        that fits is reused, a full region says so, free and lookup work."""
        self.c.create('r', 9 * MiB)
        a = self.c.alloc('r', 'a', 1)
        b = self.c.alloc('r', 'b', 3 * MiB)
        self.assertEqual((a['offset'], a['size']), (0, ITEM_ALIGN))
        self.assertEqual((b['offset'], b['size']), (2 * MiB, 4 * MiB))
        self.assertBrokerError(errno.EEXIST, self.c.alloc, 'r', 'a', 1)
        e = self.assertBrokerError(errno.ENOSPC, self.c.alloc, 'r', 'big', 4 * MiB)
        self.assertIn('2 MiB-aligned', e.msg)
        self.c.free('r', 'a')
        self.assertBrokerError(errno.ENOENT, self.c.item_lookup, 'r', 'a')
        self.assertBrokerError(errno.ENOENT, self.c.free, 'r', 'a')
        c = self.c.alloc('r', 'c', 2 * MiB)
        self.assertEqual(c['offset'], 0)
        self.assertEqual(self.c.item_lookup('r', 'b'), b)
        info, items = self.c.stat('r')
        self.assertEqual([i['name'] for i in items], ['c', 'b'])
        self.assertEqual(info['used'], 6 * MiB)
        for it in items:
            self.assertEqual(it['offset'] % ITEM_ALIGN, 0)
        self.assertHealthy()

    def test_resize(self):
        """Growing and shrinking change the file; a region cannot shrink below
        its last item, nor while a client has it mapped."""
        r = self.c.create('r', 8 * MiB)
        self.c.alloc('r', 'x', 4 * MiB)
        self.assertEqual(self.c.resize('r', 16 * MiB)['size'], 16 * MiB)
        self.assertEqual(os.stat(self.broker.region_file(r['id'])).st_size, 16 * MiB)
        self.assertBrokerError(errno.EBUSY, self.c.resize, 'r', 2 * MiB)
        self.assertEqual(self.c.resize('r', 4 * MiB)['size'], 4 * MiB)
        self.assertEqual(os.stat(self.broker.region_file(r['id'])).st_size, 4 * MiB)
        self.c.free('r', 'x')
        other = self.broker.client()
        _, fd = other.map('r')
        os.close(fd)
        self.assertBrokerError(errno.EBUSY, self.c.resize, 'r', MiB)
        other.close()
        # the broker sees the hang-up asynchronously
        wait_for(lambda: self.c.lookup('r')['attached'] == 0, what='detach')
        self.assertEqual(self.c.resize('r', MiB)['size'], MiB)
        self.assertHealthy()

    def test_bad_names(self):
        """Names with '/', '..', NUL, spaces, control or non-ASCII bytes, empty
        or longer than 255 bytes are refused with a reason; 255 is fine."""
        bad = ['a/b', '..', '../etc', 'a..b', '.', 'a\0b', 'a b', 'x\n',
               'caf\u00e9', '']
        for name in bad:
            with self.subTest(name=name):
                e = self.assertBrokerError(errno.EINVAL, self.c.call, 'create',
                                           name=name, size=MiB)
                self.assertIn('name', e.msg)
        self.assertBrokerError(errno.ENAMETOOLONG, self.c.call, 'create',
                               name='x' * 256, size=MiB)
        self.c.create('x' * 255, MiB)
        self.c.create('ok-name_1.2', MiB)
        self.assertBrokerError(errno.EINVAL, self.c.alloc, 'ok-name_1.2', 'i/j', 1)
        self.assertEqual(sorted(os.listdir(self.pool)), ['catalog', 'hvmemd.lock', 'r-1', 'r-2'])
        self.assertHealthy()

    def test_cli(self):
        """hvmem: each verb prints key=value lines; refusals exit 1 with the
        broker's message, usage errors exit 2."""
        out = self.hvmem('create', 'cli', '64M', '--mode', '0640').stdout
        self.assertIn('name=cli ', out)
        self.assertIn('size=67108864 ', out)
        self.assertIn('mode=0640 ', out)
        out = self.hvmem('alloc', 'cli', 'hdr', '1').stdout
        self.assertIn('offset=0 size=2097152', out)
        self.assertIn('item=hdr', self.hvmem('item-lookup', 'cli', 'hdr').stdout)
        self.assertIn('item=hdr', self.hvmem('stat', 'cli').stdout)
        self.assertIn('name=cli ', self.hvmem('list').stdout)
        self.assertIn('name=cli ', self.hvmem('lookup', 'cli').stdout)
        self.hvmem('chmod', 'cli', '0600')
        self.assertIn('mode=0600', self.hvmem('lookup', 'cli').stdout)
        self.assertIn('size=134217728', self.hvmem('resize', 'cli', '128M').stdout)
        self.assertIn('regions=1', self.hvmem('stat').stdout)
        self.hvmem('free', 'cli', 'hdr')
        p = self.hvmem('create', 'cli', '1M', check=False)
        self.assertEqual(p.returncode, 1)
        self.assertIn("region 'cli' exists", p.stderr)
        p = self.hvmem('create', 'a/b', '1M', check=False)
        self.assertEqual(p.returncode, 1)
        self.assertIn("'/'", p.stderr)
        self.assertEqual(self.hvmem('create', 'x', 'lots', check=False).returncode, 2)
        self.assertEqual(self.hvmem('frobnicate', check=False).returncode, 2)
        self.hvmem('destroy', 'cli')
        p = self.hvmem('lookup', 'cli', check=False)
        self.assertEqual(p.returncode, 1)
        self.assertIn("no region 'cli'", p.stderr)
        self.assertHealthy()


if __name__ == '__main__':
    unittest.main()
