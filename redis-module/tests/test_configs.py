"""Module skeleton: loads into stock redis-server 7.0, appassist.* configs,
INFO appassist, APPASSIST.STATUS, MODULE UNLOAD refused cleanly."""

import os
import sys
import unittest

import redis

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hmlib import MODULE, ServerTestCase  # noqa: E402


class ConfigTest(ServerTestCase):

    def test_load_with_module_load(self):
        """MODULE LOAD into a running stock server works; the module lists."""
        s = self.server(module=False)
        c = s.client()
        self.assertEqual(c.execute_command('MODULE', 'LOAD', MODULE), b'OK')
        names = [m[b'name'] for m in c.module_list()]
        self.assertIn(b'appassist', names)
        self.assertHealthy(s)

    def test_module_args_refused(self):
        """Module arguments are refused (configs are the interface)."""
        s = self.server(module=False)
        c = s.client()
        with self.assertRaises(redis.ResponseError):
            c.execute_command('MODULE', 'LOAD', MODULE, 'hot-percent', '10')
        self.assertHealthy(s)

    def test_config_defaults_and_set(self):
        """Defaults as documented; CONFIG SET validates ranges and enums."""
        s = self.server(configs={}, extra=['--enable-protected-configs', 'yes'])
        c = s.client()
        cfg = c.config_get('appassist.*')
        self.assertEqual(cfg['appassist.hot-percent'], '30')
        self.assertEqual(cfg['appassist.on-prepare'], 'drop')
        self.assertEqual(cfg['appassist.planned-memory'], '0')
        self.assertEqual(cfg['appassist.slice-us'], '250')
        self.assertEqual(cfg['appassist.interval-ms'], '3')
        self.assertEqual(cfg['appassist.page-list-slice-us'], '2000')
        self.assertEqual(cfg['appassist.demote'], 'yes')
        self.assertTrue(cfg['appassist.spill-path'].endswith('spill'))
        c.config_set('appassist.hot-percent', 10)
        self.assertEqual(c.config_get('appassist.hot-percent')['appassist.hot-percent'], '10')
        c.config_set('appassist.on-prepare', 'spill')
        self.assertEqual(c.config_get('appassist.on-prepare')['appassist.on-prepare'], 'spill')
        c.config_set('appassist.planned-memory', '1gb')
        self.assertEqual(c.config_get('appassist.planned-memory')['appassist.planned-memory'],
                         str(1 << 30))
        with self.assertRaises(redis.ResponseError):
            c.config_set('appassist.hot-percent', 101)
        with self.assertRaises(redis.ResponseError):
            c.config_set('appassist.on-prepare', 'explode')
        with self.assertRaises(redis.ResponseError):
            c.config_set('appassist.slice-us', 0)
        for bad in (-1, 1000001):
            with self.assertRaises(redis.ResponseError):
                c.config_set('appassist.page-list-slice-us', bad)
        with self.assertRaises(redis.ResponseError):
            c.config_set('appassist.spill-path', '')
        self.assertEqual(c.config_get('appassist.on-prepare')['appassist.on-prepare'], 'spill')
        self.assertHealthy(s)

    def test_configs_on_command_line(self):
        """appassist.* can be given at startup like any config."""
        s = self.server(configs={'hot-percent': 5, 'on-prepare': 'none'})
        cfg = s.client().config_get('appassist.*')
        self.assertEqual(cfg['appassist.hot-percent'], '5')
        self.assertEqual(cfg['appassist.on-prepare'], 'none')

    def test_info_section(self):
        """INFO appassist has the documented fields."""
        s = self.server()
        info = s.client().info('appassist')
        for f in ('appassist_state', 'appassist_hot_items', 'appassist_hot_bytes',
                  'appassist_cold_items', 'appassist_cold_bytes', 'appassist_arena_chunks',
                  'appassist_promotions', 'appassist_demotions', 'appassist_prepares',
                  'appassist_last_prepare_freed_bytes', 'appassist_last_prepare_time_us'):
            self.assertIn(f, info)
        self.assertEqual(info['appassist_state'], 'normal')

    def test_status_resp2_and_resp3(self):
        """STATUS is a map: a flat array for RESP2, a map for RESP3."""
        s = self.server()
        r2 = s.client().execute_command('APPASSIST.STATUS')
        self.assertIsInstance(r2, list)
        d = dict(zip(r2[::2], r2[1::2]))
        self.assertEqual(d[b'state'], b'normal')
        self.assertIn(b'cold_items', d)
        r3 = s.client(protocol=3).execute_command('APPASSIST.STATUS')
        self.assertIsInstance(r3, dict)
        self.assertEqual(r3[b'state'], b'normal')
        with self.assertRaises(redis.ResponseError):
            s.client().execute_command('APPASSIST.STATUS', 'extra')
        self.assertHealthy(s)

    def test_unload_refused_cleanly(self):
        """MODULE UNLOAD is refused (the module owns data Redis cannot see);
        cold items stay readable and the server stays healthy."""
        s = self.server(configs={'hot-percent': 0, 'min-idle-ms': 0})
        c = s.client()
        c.set('a', 'x' * 100)
        c.execute_command('APPASSIST.DEMOTE')
        self.assertEqual(c.execute_command('APPASSIST.ISCOLD', 'a'), 1)
        with self.assertRaises(redis.ResponseError) as cm:
            c.execute_command('MODULE', 'UNLOAD', 'appassist')
        self.assertIn('unload', str(cm.exception).lower())
        self.assertEqual(c.get('a'), b'x' * 100)
        self.assertHealthy(s)

    def test_commands_documented(self):
        """COMMAND INFO knows the APPASSIST commands with a summary."""
        s = self.server()
        conn = s.client().connection_pool.get_connection('COMMAND')
        conn.send_command('COMMAND', 'DOCS', 'appassist.prepare')
        docs = conn.read_response()
        self.assertEqual(docs[0], b'appassist.prepare')
        self.assertIn(b'summary', docs[1])

    def test_prepare_bad_deadline(self):
        s = self.server()
        c = s.client()
        for bad in ('-1', 'abc', '99999999999'):
            with self.assertRaises(redis.ResponseError):
                c.execute_command('APPASSIST.PREPARE', bad)
        with self.assertRaises(redis.ResponseError):
            c.execute_command('APPASSIST.PREPARE', '1', '2')
        self.assertEqual(c.info('appassist')['appassist_state'], 'normal')
        self.assertHealthy(s)


if __name__ == '__main__':
    unittest.main()
