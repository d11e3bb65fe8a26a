"""The catalogue survives the broker: a clean restart and a SIGKILL keep every
region, item, owner and mode (and the data in the pool files); files that
vanished are dropped with a message, stray files are removed, a damaged
catalogue stops the start instead of being overwritten; a commit whose last
step (the directory fsync) fails is still a commit; static provisioning
from a config file creates regions with their owner and mode."""

import errno
import os
import signal
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from brokerlib import BIN, NOBODY, BrokerTestCase  # noqa: E402

MiB = 1 << 20


class DurabilityTest(BrokerTestCase):

    def populate(self):
        self.c.create('a', 8 * MiB, 0o640)
        self.c.create('b', 4 * MiB, 0o604)
        self.c.alloc('a', 'hdr', 1)
        self.c.alloc('a', 'data', 5 * MiB)
        self.c.free('a', 'hdr')
        self.c.create('gone', MiB)
        self.c.destroy('gone')
        self.c.chmod('b', 0o600)
        _, fd = self.c.map('a', rw=True)
        os.pwrite(fd, b'survives', 3 * MiB)
        os.close(fd)
        return sorted((r['name'], r['size'], r['mode'], r['uid'], r['id'])
                      for r in self.c.list()), self.c.stat('a')[1]

    def restart(self, sig):
        self.c.close()
        self.broker.stop(sig)
        self.broker.start()
        self.c = self.broker.client()

    def check_same(self, before, items):
        after = sorted((r['name'], r['size'], r['mode'], r['uid'], r['id'])
                       for r in self.c.list())
        self.assertEqual(after, before)
        self.assertEqual(self.c.stat('a')[1], items)
        self.assertBrokerError(errno.ENOENT, self.c.lookup, 'gone')
        _, fd = self.c.map('a')
        self.assertEqual(os.pread(fd, 8, 3 * MiB), b'survives')
        os.close(fd)
        # ids are not reused after a restart
        self.assertGreater(self.c.create('new', MiB)['id'], max(r[4] for r in before))

    def test_restart_keeps_catalogue(self):
        """SIGTERM and start again: every region, item, mode and byte is back."""
        before, items = self.populate()
        self.restart(signal.SIGTERM)
        self.check_same(before, items)

    def test_sigkill_keeps_catalogue(self):
        """SIGKILL right after the last reply: every acknowledged change is
        in the catalogue (replies come after the rename is durable)."""
        before, items = self.populate()
        self.restart(signal.SIGKILL)
        self.check_same(before, items)

    def test_vanished_file_dropped_stray_file_removed(self):
        """A region whose file is gone (tmpfs after a host reboot) is dropped
        with a message naming it; a file no entry names is removed."""
        keep = self.c.create('keep', MiB)
        lost = self.c.create('lost', MiB)
        self.c.close()
        self.broker.stop()
        os.unlink(self.broker.region_file(lost['id']))
        with open(os.path.join(self.pool, 'r-999'), 'w') as f:
            f.write('stray')
        self.broker.start()
        self.c = self.broker.client()
        self.assertEqual([r['name'] for r in self.c.list()], ['keep'])
        log = self.broker.read_log()
        self.assertIn("region 'lost'", log)
        self.assertIn('dropped from the catalogue', log)
        self.assertFalse(os.path.exists(os.path.join(self.pool, 'r-999')))
        self.assertTrue(os.path.exists(self.broker.region_file(keep['id'])))
        # the drop itself was committed: a second restart is quiet about it
        self.restart(signal.SIGTERM)
        self.assertEqual(self.broker.read_log().count('dropped from the catalogue'), 1)

    def test_damaged_catalogue_stops_the_start(self):
        """A catalogue with a flipped byte is refused with a message and left
        as it was; the broker does not start over it."""
        self.c.create('a', MiB)
        self.c.close()
        self.broker.stop()
        path = os.path.join(self.pool, 'catalog')
        with open(path, 'r+b') as f:
            data = bytearray(f.read())
            data[-1] ^= 0xff
            f.seek(0)
            f.write(data)
        self.assertNotEqual(self.broker.start(expect_fail=True), 0)
        self.assertIn('checksum mismatch', self.broker.read_log())
        with open(path, 'rb') as f:
            self.assertEqual(f.read(), bytes(data))
        with open(path, 'r+b') as f:
            data[-1] ^= 0xff
            f.write(data)
        self.broker.start()
        self.c = self.broker.client()
        self.c.lookup('a')


FAULTINJECT = os.path.join(BIN, 'hvmem-faultinject.so')


@unittest.skipUnless(os.path.exists(FAULTINJECT), f'{FAULTINJECT} not built')
class CommitTest(BrokerTestCase):

    def test_directory_fsync_failure_after_rename_is_a_commit(self):
        """Once rename() has put the new catalogue in place the change is made:
        a failing directory fsync (injected: EIO) is a warning, the request
        succeeds, and memory, disk and the next start agree.  (It used to be
        rolled back in memory only: the next start then dropped a created
        region, or deleted the file of a destroyed one that was still in use.)"""
        flag = os.path.join(self.workdir, 'fail-dirsync')
        self.c.close()
        self.broker.stop()
        self.broker.env = dict(os.environ, LD_PRELOAD=FAULTINJECT,
                               HVMEM_FAULT_DIRSYNC=flag)
        self.broker.start()
        self.c = self.broker.client()
        self.c.create('kept', 4 * MiB)
        self.c.create('gone', MiB)
        self.c.create('tagged', MiB)
        _, fd = self.c.map('kept', rw=True)
        os.pwrite(fd, b'live data', 0)
        os.close(fd)
        self.c.release('kept')
        open(flag, 'w').close()             # every directory fsync fails now
        self.c.create('new', 2 * MiB)
        self.c.destroy('gone')
        self.c.chmod('tagged', 0o640)
        self.c.alloc('kept', 'hdr', 1)
        self.assertIn('cannot sync directory', self.broker.read_log())
        before = sorted((r['name'], r['size'], r['mode'], r['id']) for r in self.c.list())
        self.assertEqual([r[0] for r in before], ['kept', 'new', 'tagged'])
        self.c.close()
        self.broker.stop(signal.SIGKILL)
        os.unlink(flag)
        self.broker.start()
        self.c = self.broker.client()
        after = sorted((r['name'], r['size'], r['mode'], r['id']) for r in self.c.list())
        self.assertEqual(after, before)
        self.assertEqual([i['name'] for i in self.c.stat('kept')[1]], ['hdr'])
        _, fd = self.c.map('kept')
        self.assertEqual(os.pread(fd, 9, 0), b'live data')
        os.close(fd)
        self.assertNotIn('dropped from the catalogue', self.broker.read_log())


class ProvisioningTest(BrokerTestCase):

    def write_config(self, text):
        path = os.path.join(self.workdir, 'regions.ini')
        with open(path, 'w') as f:
            f.write(text)
        return path

    def test_static_provisioning(self):
        """[region NAME] size= mode= owner= creates regions at start with that
        owner and mode; a restart with the same file keeps their data; a
        larger size grows a region, never shrinks it; [quota] applies."""
        cfg = self.write_config('[region guest-ram]\nsize=64M\nmode=0640\n'
                                f'owner={NOBODY}\n\n[region tier]\nsize=6M\n\n'
                                f'[quota]\n{NOBODY}=80M\n')
        self.c.close()
        self.broker.stop()
        self.broker.args = ['--config', cfg]
        self.broker.start()
        self.c = self.broker.client()
        ram = self.c.lookup('guest-ram')
        self.assertEqual((ram['size'], ram['mode'], ram['uid']), (64 * MiB, 0o640, NOBODY))
        self.assertEqual(self.c.lookup('tier')['mode'], 0o600)
        _, fd = self.c.map('guest-ram', rw=True)
        os.pwrite(fd, b'provisioned', 0)
        os.close(fd)
        self.c.close()
        self.broker.stop()
        self.write_config('[region guest-ram]\nsize=96M\nmode=0644\n'
                          f'owner={NOBODY}\n\n[region tier]\nsize=2M\n')
        self.broker.start()
        self.c = self.broker.client()
        ram = self.c.lookup('guest-ram')
        self.assertEqual((ram['size'], ram['mode']), (96 * MiB, 0o644))
        self.assertEqual(self.c.lookup('tier')['size'], 6 * MiB)
        _, fd = self.c.map('guest-ram')
        self.assertEqual(os.pread(fd, 11, 0), b'provisioned')
        os.close(fd)
        if os.geteuid() == 0:
            # without [quota] (nor --quota): the default, a quarter of the pool
            n = self.agent(NOBODY)
            pool = n.ok(op='call', method='pool')['result']
            self.assertEqual(pool['quota'], pool['capacity'] // 4)

    def test_quota_from_config(self):
        """[quota] USER=SIZE caps that uid, with the region counted."""
        cfg = self.write_config(f'[region r]\nsize=60M\nowner={NOBODY}\n\n'
                                f'[quota]\n{NOBODY}=64M\n')
        self.c.close()
        self.broker.stop()
        self.broker.args = ['--config', cfg]
        self.broker.start()
        self.c = self.broker.client()
        n = self.agent(NOBODY)
        pool = n.ok(op='call', method='pool')['result']
        self.assertEqual((pool['quota'], pool['caller_used']), (64 * MiB, 60 * MiB))
        res = n.do(op='call', method='create', name='more', size=8 * MiB)
        self.assertEqual(res['errno'], errno.EDQUOT, res)
        n.ok(op='call', method='create', name='more', size=4 * MiB)

    def test_bad_config_refused(self):
        """A config with a bad name, size, mode, owner or group stops the
        start with a message naming the problem."""
        cases = {
            '[region a/b]\nsize=1M\n': "'/'",
            '[region a]\nsize=lots\n': 'size=',
            '[region a]\nsize=1M\nmode=0755\n': 'mode=0755',
            '[region a]\nsize=1M\nowner=no-such-user-hvmem\n': 'unknown owner',
            '[regions]\n': 'unknown group',
        }
        self.c.close()
        self.broker.stop()
        for text, words in cases.items():
            with self.subTest(config=text):
                cfg = self.write_config(text)
                rc = self.broker.start(args=['--config', cfg], expect_fail=True)
                self.assertNotEqual(rc, 0)
                self.assertIn(words, self.broker.read_log())
        self.broker.start()
        self.c = self.broker.client()
        self.assertEqual(self.c.list(), [])


if __name__ == '__main__':
    unittest.main()
