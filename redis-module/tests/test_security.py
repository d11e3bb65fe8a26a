"""What a client must not be able to do through the module (issue 18): make
the server write through a path it does not own, change the paths the module
opens, run the test helpers, or drop data where it may not run @dangerous
commands."""

import os
import sys
import unittest

import redis

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hmlib import MODULE, ServerTestCase, aggressive  # noqa: E402


class SpillPathTest(ServerTestCase):

    def spilling_server(self, n=200):
        s = self.server(configs=dict(aggressive(), **{'on-prepare': 'spill'}))
        c = s.client()
        for i in range(n):
            c.set('k%d' % i, 'v%d' % i)
        self.demote_all(c, n)
        return s, c

    def assertNothingLost(self, c, n=200):
        self.assertEqual(c.info('appassist')['appassist_state'], 'normal')
        self.assertEqual(c.dbsize(), n)
        self.assertEqual(c.get('k7'), b'v7')

    def test_symlink_at_the_spill_path(self):
        """A symbolic link at the spill path: PREPARE fails, the file it
        points to is left as it was, nothing is lost."""
        s, c = self.spilling_server()
        victim = os.path.join(self.workdir, 'victim')
        with open(victim, 'w') as f:
            f.write('precious')
        os.symlink(victim, os.path.join(s.dir, 'spill'))
        with self.assertRaisesRegex(redis.ResponseError, 'spill file'):
            c.execute_command('APPASSIST.PREPARE')
        with open(victim) as f:
            self.assertEqual(f.read(), 'precious')
        self.assertNothingLost(c)
        self.assertHealthy(s)

    def test_dangling_symlink_at_the_spill_path(self):
        """A link to a file that does not exist: not created through it."""
        s, c = self.spilling_server()
        target = os.path.join(self.workdir, 'created')
        os.symlink(target, os.path.join(s.dir, 'spill'))
        with self.assertRaisesRegex(redis.ResponseError, 'spill file'):
            c.execute_command('APPASSIST.PREPARE')
        self.assertFalse(os.path.exists(target))
        self.assertNothingLost(c)
        self.assertHealthy(s)

    def test_other_file_at_the_spill_path(self):
        """A regular file that is not a spill file: not truncated, not
        written, PREPARE fails."""
        s, c = self.spilling_server()
        spill = os.path.join(s.dir, 'spill')
        with open(spill, 'w') as f:
            f.write('precious')
        with self.assertRaisesRegex(redis.ResponseError, 'spill file'):
            c.execute_command('APPASSIST.PREPARE')
        with open(spill) as f:
            self.assertEqual(f.read(), 'precious')
        self.assertNothingLost(c)
        self.assertHealthy(s)

    def test_stale_spill_file_is_replaced(self):
        """A spill file left behind by a server that was killed while
        spilled is replaced by the next one, which spills and reads back."""
        s, c = self.spilling_server()
        c.execute_command('APPASSIST.PREPARE')
        spill = os.path.join(s.dir, 'spill')
        self.assertTrue(os.path.exists(spill))
        s.stop()                                    # SIGKILL: the file stays
        self.assertTrue(os.path.exists(spill))
        s.start()
        c = s.client()
        for i in range(200):
            c.set('k%d' % i, 'v%d' % i)
        self.demote_all(c, 200)
        c.execute_command('APPASSIST.PREPARE')
        self.assertEqual(c.info('appassist')['appassist_state'], 'prepared')
        self.assertEqual(c.get('k7'), b'v7')
        c.execute_command('APPASSIST.RESUME')
        self.wait_for(lambda: c.info('appassist')['appassist_state'] == 'normal',
                      what='unspill')
        self.assertFalse(os.path.exists(spill))
        self.assertHealthy(s)


class ProtectedConfigTest(ServerTestCase):

    def stock_error(self, c, name):
        """Stock's error for a protected config (dir), for config 'name'."""
        with self.assertRaises(redis.ResponseError) as cm:
            c.config_set('dir', self.workdir)
        return str(cm.exception).replace("'dir'", "'%s'" % name)

    def test_paths_are_protected(self):
        """CONFIG SET of spill-path or port-path fails like CONFIG SET dir,
        with stock's error text; the value stays."""
        s = self.server()
        c = s.client()
        for name, value in (('appassist.spill-path', '/tmp/x'),
                            ('appassist.port-path', '/dev/sda')):
            before = c.config_get(name)[name]
            want = self.stock_error(c, name)
            self.assertIn("can't set protected config", want)
            with self.assertRaises(redis.ResponseError) as cm:
                c.config_set(name, value)
            self.assertEqual(str(cm.exception), want)
            self.assertEqual(c.config_get(name)[name], before)
        self.assertHealthy(s)

    def test_paths_settable_where_protected_configs_are(self):
        """With --enable-protected-configs yes both paths can be set."""
        s = self.server(extra=['--enable-protected-configs', 'yes'])
        c = s.client()
        spill = os.path.join(self.workdir, 'x')
        c.config_set('appassist.spill-path', spill)
        self.assertEqual(c.config_get('appassist.spill-path')['appassist.spill-path'], spill)
        c.config_set('appassist.port-path', '')
        self.assertEqual(c.config_get('appassist.port-path')['appassist.port-path'], '')
        self.assertHealthy(s)

    def test_paths_at_load_time(self):
        """The paths are still given at load time: on the command line and
        with MODULE LOADEX ... CONFIG."""
        spill = os.path.join(self.workdir, 'at-start')
        s = self.server(configs={'spill-path': spill})
        c = s.client()
        self.assertEqual(c.config_get('appassist.spill-path')['appassist.spill-path'], spill)
        s2 = self.server(name='loadex', module=False)
        c2 = s2.client()
        spill2 = os.path.join(self.workdir, 'loadex')
        c2.execute_command('MODULE', 'LOADEX', MODULE, 'CONFIG', 'appassist.spill-path', spill2,
                           'CONFIG', 'appassist.port-path', '')
        self.assertEqual(c2.config_get('appassist.spill-path')['appassist.spill-path'], spill2)
        self.assertHealthy(s2)


class DebugCommandsTest(ServerTestCase):

    def test_absent_by_default(self):
        """Loaded without enable-debug-commands, APPASSIST.DEMOTE and
        APPASSIST.COMPACT do not exist, and the option cannot be turned on
        at run time."""
        s = self.server(module=False)
        c = s.client()
        c.execute_command('MODULE', 'LOADEX', MODULE, 'CONFIG', 'appassist.port-path', '')
        self.assertEqual(c.config_get('appassist.enable-debug-commands'),
                         {'appassist.enable-debug-commands': 'no'})
        for cmd in ('APPASSIST.DEMOTE', 'APPASSIST.COMPACT'):
            with self.assertRaisesRegex(redis.ResponseError, "^unknown command '%s'" % cmd):
                c.execute_command(cmd, 10)
        c.set_response_callback('COMMAND', lambda r, **kw: r)     # raw reply
        names = c.execute_command('COMMAND', 'LIST', 'FILTERBY', 'MODULE', 'appassist')
        self.assertIn(b'appassist.prepare', names)
        self.assertNotIn(b'appassist.demote', names)
        self.assertNotIn(b'appassist.compact', names)
        with self.assertRaisesRegex(redis.ResponseError, "can't set immutable config"):
            c.config_set('appassist.enable-debug-commands', 'yes')
        self.assertEqual(c.execute_command('APPASSIST.ISCOLD', 'k'), 0)  # the rest is there
        self.assertHealthy(s)

    def test_present_when_asked_for(self):
        """With appassist.enable-debug-commands yes at load time they run."""
        s = self.server(configs=dict(aggressive(), **{'enable-debug-commands': 'yes'}))
        c = s.client()
        c.set('k', 'v')
        self.assertGreaterEqual(c.execute_command('APPASSIST.DEMOTE', 10), 0)
        self.assertGreaterEqual(c.execute_command('APPASSIST.COMPACT', 10), 0)
        self.assertHealthy(s)


class PrepareAclTest(ServerTestCase):

    def test_prepare_denied_without_dangerous(self):
        """A user with +@all -@dangerous gets stock's NOPERM for
        APPASSIST.PREPARE (as for FLUSHALL), logged in ACL LOG; nothing is
        dropped. The default user still prepares."""
        s = self.server(configs=aggressive())
        c = s.client()
        for i in range(100):
            c.set('k%d' % i, 'v%d' % i)
        self.demote_all(c, 100)
        c.execute_command('ACL', 'SETUSER', 'limited', 'on', '>pw', '~*', '&*', '+@all', '-@dangerous')
        lc = s.client(username='limited', password='pw')
        # (redis-py takes the NOPERM prefix off into the exception's type)
        with self.assertRaises(redis.exceptions.NoPermissionError) as cm:
            lc.flushall()
        stock = str(cm.exception)
        self.assertEqual(stock, "this user has no permissions to run the 'flushall' command")
        with self.assertRaises(redis.exceptions.NoPermissionError) as cm:
            lc.execute_command('APPASSIST.PREPARE')
        self.assertEqual(str(cm.exception), stock.replace("'flushall'", "'appassist.prepare'"))
        self.assertEqual(c.info('appassist')['appassist_state'], 'normal')
        self.assertEqual(c.info('appassist')['appassist_cold_items'], 100)
        log = c.execute_command('ACL', 'LOG')
        self.assertIn(b'appassist.prepare', [dict(zip(e[::2], e[1::2]))[b'object'] for e in log])
        self.assertEqual(lc.get('k5'), b'v5')       # the user still works
        c.execute_command('APPASSIST.PREPARE')
        self.assertEqual(c.info('appassist')['appassist_state'], 'prepared')
        self.assertHealthy(s)


class ConfigAclTest(ServerTestCase):

    def test_page_list_slice_denied_without_dangerous(self):
        """appassist.page-list-slice-us decides how long the host's page list
        may hold the event loop: a user with +@all -@dangerous cannot change
        it (CONFIG SET is @dangerous), nor set it out of range with rights."""
        s = self.server(configs=aggressive())
        c = s.client()
        c.execute_command('ACL', 'SETUSER', 'limited', 'on', '>pw', '~*', '&*', '+@all', '-@dangerous')
        lc = s.client(username='limited', password='pw')
        for value in (0, 1000000):
            with self.assertRaises(redis.exceptions.NoPermissionError):
                lc.config_set('appassist.page-list-slice-us', value)
        self.assertEqual(c.config_get('appassist.page-list-slice-us'),
                         {'appassist.page-list-slice-us': '2000'})
        for bad in (-1, 1000001, 'x'):
            with self.assertRaises(redis.ResponseError):
                c.config_set('appassist.page-list-slice-us', bad)
        c.config_set('appassist.page-list-slice-us', 0)
        self.assertEqual(c.config_get('appassist.page-list-slice-us'),
                         {'appassist.page-list-slice-us': '0'})
        self.assertHealthy(s)


if __name__ == '__main__':
    unittest.main()
