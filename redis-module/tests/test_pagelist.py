"""Page lists on the host port: after PREPARE dropped the arena, the module
keeps it mapped and tells QEMU (APPASSIST.PAGES) which guest-physical frames
held it, read from /proc/self/pagemap, so that the migration sends them as
zero pages unread; the arena goes back to the kernel at RESUME (unmapped, not
cleared) or ABORT (cleared), or cleared when the host does not take the list.
Here a unix socket stands in for the virtio-serial port and the "guest" is
this host: the frames are this machine's, checked against the server's own
pagemap."""

import os
import re
import struct
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hmlib import ServerTestCase, aggressive, asmap  # noqa: E402
from test_port import PortTest  # noqa: E402

ITEMS = 3000


def varint(buf, pos):
    v = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        v |= (b & 0x7f) << shift
        shift += 7
        if not b & 0x80:
            return v, pos


def decode(data):
    """The runs of one PAGES chunk: [(first frame, count)]."""
    runs, pos, prev_end = [], 0, 0
    while pos < len(data):
        zz, pos = varint(data, pos)
        n1, pos = varint(data, pos)
        first = prev_end + ((zz >> 1) ^ -(zz & 1))
        runs.append((first, n1 + 1))
        prev_end = first + n1 + 1
    return runs


def take_list(ep, chunks=None):
    """The whole list, taken as QEMU does: cursor += the chunk's runs until
    a chunk says none remain. 'chunks' gets each chunk's run count."""
    runs, cursor = [], 0
    while True:
        remaining, data = ep.call('APPASSIST.PAGES', cursor)
        chunk = decode(data)
        if remaining:
            assert chunk, 'a chunk without runs before the end'
        if chunks is not None:
            chunks.append(len(chunk))
        runs += chunk
        cursor += len(chunk)
        if not remaining:
            return runs


def arena_frames(pid):
    """The frames of the server's anonymous mappings, as its pagemap has
    them (read as root): the listed frames must be among them."""
    frames = set()
    with open(f'/proc/{pid}/maps') as maps, open(f'/proc/{pid}/pagemap', 'rb') as pm:
        for line in maps:
            m = re.match(r'([0-9a-f]+)-([0-9a-f]+) rw.p \S+ \S+ 0\s*$', line)
            if not m:
                continue
            lo, hi = int(m.group(1), 16), int(m.group(2), 16)
            pm.seek(lo // 4096 * 8)
            data = pm.read((hi - lo) // 4096 * 8)
            for (e,) in struct.iter_unpack('<Q', data):
                if e >> 63 and e & ((1 << 55) - 1):
                    frames.add(e & ((1 << 55) - 1))
    return frames


class PageListTest(ServerTestCase):

    def setUp(self):
        super().setUp()
        if os.geteuid() != 0:
            self.skipTest('reading frames from /proc/self/pagemap needs CAP_SYS_ADMIN (run as root)')

    # The host end of the port, as in test_port.py.
    listen = PortTest.listen
    accept = PortTest.accept

    def start(self, wrap=None, **configs):
        path, ls = self.listen()
        s = self.server(start=False, configs=dict(aggressive(), **{'port-path': path}, **configs))
        if wrap:
            argv = s.argv
            s.argv = lambda: wrap + argv()
        s.start()
        _, ep = self.accept(ls)
        c = s.client()
        for i in range(ITEMS):
            c.set(f'k{i}', os.urandom(1000))
        self.wait_for(lambda: c.info('appassist')['appassist_cold_items'] == ITEMS,
                      what='demotion')
        c.config_set('appassist.demote', 'no')
        return s, c, ep

    def release(self, c):
        return c.info('appassist')['appassist_last_prepare_release']

    def test_list_then_resume(self):
        """PREPARE offers the list; PAGES 0 gives frames the server really
        maps; the arena stays mapped until RESUME, which unmaps it without
        clearing it."""
        s, c, ep = self.start()
        rep = asmap(ep.call('APPASSIST.PREPARE', 3000))
        self.assertEqual(rep[b'page_list'], 1)
        self.assertEqual(rep[b'items'], ITEMS)
        self.assertEqual(self.release(c), 'parked')
        mapped = arena_frames(s.proc.pid)
        runs = take_list(ep)
        info = c.info('appassist')
        self.assertEqual(len(runs), info['appassist_last_prepare_page_runs'])
        self.assertGreaterEqual(info['appassist_last_prepare_page_slices'], 1)
        self.assertLessEqual(info['appassist_last_prepare_page_slice_max_us'],
                             info['appassist_last_prepare_page_list_us'])
        frames = [f + i for f, n in runs for i in range(n)]
        self.assertEqual(len(frames), info['appassist_last_prepare_page_frames'])
        self.assertEqual(len(set(frames)), len(frames), 'a frame listed twice')
        # ITEMS values of 1000 bytes live in the arena: at least that much.
        self.assertGreaterEqual(len(frames) * 4096, ITEMS * 1000)
        self.assertEqual(info['appassist_last_prepare_page_unlisted'], 0)
        self.assertFalse(set(frames) - mapped, 'listed frames the server does not map')
        # Cursors: the end gives nothing more; past it, or a non-number, is refused.
        self.assertEqual(ep.call('APPASSIST.PAGES', len(runs)), [0, b''])
        for bad in (len(runs) + 1, -1, 'x', '1' * 30, ''):
            self.assertIsInstance(ep.call('APPASSIST.PAGES', bad), Exception, bad)
        ep.send(b'*2\r\n$15\r\nAPPASSIST.PAGES\r\n$3\r\nEND\r\n')    # no reply
        self.assertEqual(ep.call('PING'), 'PONG')
        self.assertEqual(self.release(c), 'parked', 'END after the whole list released it')
        rss = s.rss()
        self.assertEqual(asmap(ep.call('APPASSIST.RESUME'))[b'state'], b'normal')
        self.wait_for(lambda: c.info('appassist')['appassist_last_prepare_unmap_us'] > 0,
                      what='the arena unmapped')
        info = c.info('appassist')
        self.assertEqual(info['appassist_last_prepare_release'], 'unmapped at RESUME')
        self.assertEqual(info['appassist_last_prepare_clear_us'], 0)
        self.assertLess(s.rss(), rss - ITEMS * 1000 // 2)
        self.assertHealthy(s)

    def test_list_in_slices(self):
        """With appassist.page-list-slice-us 1 each chunk reads one batch of
        pagemap (1024 pages) and goes with what is ready: the list comes in
        many chunks, each with runs until the last, every frame one the
        server maps, once; a cursor asked again gives the same runs from
        there (the host may retry), as many as fit now."""
        s, c, ep = self.start(**{'page-list-slice-us': 1})
        for i in range(ITEMS, 4 * ITEMS):
            c.set(f'k{i}', os.urandom(1000))
        c.config_set('appassist.demote', 'yes')
        self.wait_for(lambda: c.info('appassist')['appassist_cold_items'] == 4 * ITEMS,
                      what='demotion')
        c.config_set('appassist.demote', 'no')
        self.assertEqual(asmap(ep.call('APPASSIST.PREPARE', 3000))[b'page_list'], 1)
        mapped = arena_frames(s.proc.pid)
        # A host cursor must start at 0, and may not run ahead of what was
        # read so far: refused, nothing read for it.
        self.assertIsInstance(ep.call('APPASSIST.PAGES', 5), Exception)
        remaining, data = ep.call('APPASSIST.PAGES', 0)
        self.assertGreater(remaining, 0)
        read = c.info('appassist')['appassist_last_prepare_page_runs']
        self.assertIsInstance(ep.call('APPASSIST.PAGES', read + 1), Exception)
        self.assertEqual(c.info('appassist')['appassist_last_prepare_page_slices'], 1)
        chunks = []
        runs = take_list(ep, chunks)
        self.assertEqual(decode(data), runs[:len(decode(data))])
        again = decode(ep.call('APPASSIST.PAGES', 0)[1])
        self.assertGreaterEqual(len(again), chunks[0])
        self.assertEqual(again, runs[:len(again)])
        info = c.info('appassist')
        frames = [f + i for f, n in runs for i in range(n)]
        self.assertEqual(len(runs), info['appassist_last_prepare_page_runs'])
        self.assertEqual(len(frames), info['appassist_last_prepare_page_frames'])
        self.assertEqual(len(set(frames)), len(frames), 'a frame listed twice')
        self.assertFalse(set(frames) - mapped, 'listed frames the server does not map')
        self.assertGreaterEqual(len(frames) * 4096, 4 * ITEMS * 1000)
        self.assertGreater(len(chunks), len(frames) // 1024 // 2, chunks)
        self.assertGreaterEqual(info['appassist_last_prepare_page_slices'], len(frames) // 1024)
        ep.call('APPASSIST.ABORT')
        self.assertEqual(self.release(c), 'cleared at ABORT')
        self.assertHealthy(s)

    def test_not_taken_is_cleared(self):
        """A host that never asks (a QEMU without page lists) gets the old
        behaviour after PREPARE's deadline: cleared, then unmapped; so does
        ABORT after the list, and a list ended early."""
        s, c, ep = self.start()
        self.assertEqual(asmap(ep.call('APPASSIST.PREPARE', 200))[b'page_list'], 1)
        self.wait_for(lambda: c.info('appassist')['appassist_last_prepare_unmap_us'] > 0,
                      what='the arena released')
        info = c.info('appassist')
        self.assertEqual(info['appassist_last_prepare_release'],
                         'cleared: the host did not take the page list')
        self.assertGreater(info['appassist_last_prepare_clear_us'], 0)
        self.assertEqual(ep.call('APPASSIST.PAGES', 0), [0, b''])    # nothing kept
        ep.call('APPASSIST.RESUME')                                 # demotion again
        self.assertEqual(self.release(c), 'cleared: the host did not take the page list')
        for i in range(ITEMS):
            c.set(f'k{i}', os.urandom(1000))
        c.config_set('appassist.demote', 'yes')
        self.wait_for(lambda: c.info('appassist')['appassist_cold_items'] == ITEMS,
                      what='demotion')
        c.config_set('appassist.demote', 'no')
        self.assertEqual(asmap(ep.call('APPASSIST.PREPARE', 3000))[b'page_list'], 1)
        take_list(ep)
        ep.call('APPASSIST.ABORT')
        self.assertEqual(self.release(c), 'cleared at ABORT')
        self.assertHealthy(s)

    def test_without_cap_sys_admin(self):
        """Without CAP_SYS_ADMIN pagemap shows no frames: no list is offered
        and the arena is cleared and unmapped at once, as before lists."""
        s, c, ep = self.start(wrap=['setpriv', '--bounding-set=-sys_admin',
                                    '--inh-caps=-sys_admin'])
        rep = asmap(ep.call('APPASSIST.PREPARE', 3000))
        self.assertEqual(rep[b'page_list'], 0)
        self.assertEqual(self.release(c), 'cleared')
        self.assertHealthy(s)

    def test_config_off_and_clients(self):
        """appassist.page-list no turns lists off; clients can neither ask
        for frames (physical addresses stay between the module and the host)
        nor get a list offered by their PREPARE."""
        s, c, ep = self.start(**{'page-list': 'no'})
        self.assertEqual(asmap(ep.call('APPASSIST.PREPARE', 3000))[b'page_list'], 0)
        self.assertEqual(self.release(c), 'cleared')
        with self.assertRaisesRegex(Exception, 'unknown command'):
            c.execute_command('APPASSIST.PAGES', 0)
        c.config_set('appassist.page-list', 'auto')
        rep = asmap(c.execute_command('APPASSIST.PREPARE', 3000))
        self.assertEqual(rep[b'page_list'], 0)
        self.assertHealthy(s)


if __name__ == '__main__':
    unittest.main()
