"""hvvol's checks without a daemon: names, sizes, paths and options as a
hostile caller sends them, the choice of transport, the run directory's
ownership rules and damaged state files.

The transport choice is tested here only: this host has no nbd, ublk_drv
or vduse module, so only FUSE + loop can run (test_hvvol.py)."""

import json
import os
import shutil
import stat
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from volume import transport                                       # noqa: E402
from volume.errors import BadInput, VolumeError                    # noqa: E402
from volume.hvvol import read_json, secure_dir, write_json, _typed, STATE_SPEC  # noqa: E402
from volume.validate import (check_mountpoint, check_name, check_image_path,   # noqa: E402
                             parse_create_options, parse_size, MiB, GiB, TiB)

ALL = {'ublk': (True, 'x'), 'vduse': (True, 'x'), 'nbd': (True, 'x'), 'fuse': (True, 'x')}
NONE = {k: (False, 'absent') for k in ALL}
EXPORTS = {'nbd', 'fuse', 'vduse-blk', 'vhost-user-blk'}


class NameTest(unittest.TestCase):

    def test_good_names(self):
        for name in ('a', 'web', 'db-1', 'x.y_z', '0', 'A' * 64):
            self.assertEqual(check_name(name), name)

    def test_hostile_names(self):
        """Traversal, separators, NUL, control characters, empty, too
        long, not a string: each refused with the rule."""
        for name in ('../x', '..', '.', '/', 'a/b', '/etc', 'x\0y', 'x\ny', '', ' a', '-a',
                     '.hidden', 'a b', 'é', 'A' * 65, 'A' * 100000, None, 7, b'web', ['a']):
            with self.assertRaises(BadInput, msg=repr(name)) as e:
                check_name(name)
            self.assertIn('volume name', str(e.exception))
            self.assertLess(len(str(e.exception)), 300, 'the message quotes a bounded value')

    def test_nul_shows_in_the_message(self):
        with self.assertRaises(BadInput) as e:
            check_name('a\0b')
        self.assertIn(r"'a\x00b'", str(e.exception))


class SizeTest(unittest.TestCase):

    def test_units(self):
        self.assertEqual(parse_size('4096', 's'), 4096)
        self.assertEqual(parse_size('64M', 's'), 64 * MiB)
        self.assertEqual(parse_size('64MiB', 's'), 64 * MiB)
        self.assertEqual(parse_size('1g', 's'), GiB)
        self.assertEqual(parse_size(5 * TiB, 's'), 5 * TiB)

    def test_absurd_sizes(self):
        """Negative, zero below the minimum, exabytes, 10^40, garbage,
        floats, booleans: refused, naming the value and the range."""
        for v in ('-1', '1E', '1.5G', 'abc', '', '1 G G', '9' * 41, '99999999999999999999P',
                  True, 1.5, None, ['1G'], -5, 'G'):
            with self.assertRaises(BadInput, msg=repr(v)):
                parse_size(v, 'size', 16 * MiB, 64 * TiB)
        with self.assertRaises(BadInput) as e:
            parse_size('1P', 'size', 16 * MiB, 64 * TiB)
        self.assertIn('out of range', str(e.exception))
        self.assertIn('64TiB', str(e.exception))
        with self.assertRaises(BadInput):
            parse_size('1M', 'size', 16 * MiB, 64 * TiB)


class OptionTest(unittest.TestCase):

    def test_good(self):
        o = parse_create_options({'size': '1G', 'ram-size': '256M', 'mode': 'async',
                                  'block-size': '64K', 'dirty-limit': '64M', 'region': 'r1',
                                  'prealloc': 'off', 'fs': 'ext4'})
        self.assertEqual(o['size'], GiB)
        self.assertEqual(o['ram-size'], 256 * MiB)
        self.assertFalse(o['prealloc'])

    def test_refused(self):
        bad = [
            {'sizee': '1G'},                               # unknown key
            {'size': '1G', 'ram-size': '2G'},              # tier beyond the disk
            {'size': '1G', 'block-size': '3000'},          # not a power of two
            {'size': '1G', 'block-size': '4M'},
            {'size': '1G', 'mode': 'writeback'},
            {'size': '1G', 'mode': ['async']},
            {'size': '1G', 'fs': 'xfs;rm -rf /'},
            {'size': '1G', 'prealloc': 'maybe'},
            {'size': '1G', 'dirty-limit': '1K'},
            {'size': '1G', 'image': 'relative.hyb'},
            {'size': '1G', 'image': '/tmp/../etc/shadow'},
            {'size': '1G', 'image': '/proc/self/mem'},
            {'size': '1G', 'image': '/dev/sda'},
            {'size': '1G', 'image': '/run/hybridvm/volumes/x/state.json'},
            {'size': '1G', 'image': '/tmp/a\0b'},
            {'size': '1G', 'image': '/tmp/' + 'a' * 2000},
            {'size': '1G', 'region': '../r'},
            {'size': '1G', 'region': 'r/1'},
            {'size': '1G', 'region': 'r' * 200},
            {str(i): i for i in range(100)},               # a flood of keys
            'size=1G',                                      # not a mapping
        ]
        for opts in bad:
            with self.assertRaises(BadInput, msg=repr(opts)[:80]):
                parse_create_options(opts)

    def test_image_that_is_not_a_file(self):
        with self.assertRaises(BadInput) as e:
            check_image_path('/tmp')
        self.assertIn('not a regular file', str(e.exception))

    def test_paths_through_links(self):
        d = tempfile.mkdtemp()
        try:
            os.symlink('/etc', os.path.join(d, 'etc'))
            with self.assertRaises(BadInput) as e:
                check_image_path(os.path.join(d, 'etc', 'x.hyb'))
            self.assertIn('symbolic link', str(e.exception))
            with self.assertRaises(BadInput) as e:
                check_mountpoint(os.path.join(d, 'etc'))
            self.assertIn('symbolic link', str(e.exception))
            open(os.path.join(d, 'file'), 'w').close()
            for mp, why in ((os.path.join(d, 'file'), 'not a directory'),
                            (os.path.join(d, 'nope'), 'No such file'), ('/', 'root'),
                            ('rel', 'absolute'), (d + '/../x', '..')):
                with self.assertRaises(BadInput, msg=mp) as e:
                    check_mountpoint(mp)
                self.assertIn(why, str(e.exception))
            self.assertEqual(check_mountpoint(d + '//'), d)
        finally:
            shutil.rmtree(d)


class ChoiceTest(unittest.TestCase):
    """transport.choose(): the best transport that the host, the daemon and
    hvvol all have, and why each better one was passed over."""

    def test_best_of_all(self):
        impl = {'ublk', 'vduse', 'nbd', 'fuse'}
        self.assertEqual(transport.choose(ALL, EXPORTS | {'ublk'}, impl), ('ublk', []))
        self.assertEqual(transport.choose(ALL, EXPORTS, impl)[0], 'vduse')

    def test_host_decides(self):
        impl = {'nbd', 'fuse'}
        caps = dict(NONE, nbd=(True, 'present'), fuse=(True, 'present'))
        kind, passed = transport.choose(caps, EXPORTS, impl)
        self.assertEqual(kind, 'nbd')
        self.assertEqual([p[0] for p in passed], ['ublk', 'vduse'])
        self.assertIn('absent', passed[0][1])

    def test_daemon_decides(self):
        kind, passed = transport.choose(ALL, {'fuse', 'nbd'}, {'vduse', 'fuse'})
        self.assertEqual(kind, 'fuse')
        self.assertEqual(dict(passed)['vduse'], 'qemu-storage-daemon has no vduse-blk export')
        self.assertEqual(dict(passed)['ublk'], 'qemu-storage-daemon has no ublk export')
        self.assertEqual(dict(passed)['nbd'], 'hvvol does not implement it yet')

    def test_this_build(self):
        """What hvvol implements today: FUSE + loop, even where nbd is there."""
        kind, passed = transport.choose(ALL, EXPORTS, transport.IMPLEMENTED)
        self.assertEqual(kind, 'fuse')
        self.assertEqual(dict(passed)['nbd'], 'hvvol does not implement it yet')

    def test_nothing(self):
        kind, passed = transport.choose(NONE, EXPORTS, transport.IMPLEMENTED)
        self.assertIsNone(kind)
        self.assertEqual(len(passed), 4)
        kind, _ = transport.choose(ALL, set(), transport.IMPLEMENTED)
        self.assertIsNone(kind)

    def test_probe_shape(self):
        caps = transport.probe()
        self.assertEqual(set(caps), set(transport.PREFERENCE))
        for ok, why in caps.values():
            self.assertIsInstance(ok, bool)
            self.assertTrue(why)


@unittest.skipUnless(os.geteuid() == 0, 'needs root (chown)')
class DirTest(unittest.TestCase):
    """The run and config directories: root's, not writable by others."""

    def setUp(self):
        self.d = tempfile.mkdtemp()

    def tearDown(self):
        shutil.rmtree(self.d)

    def test_created_0700(self):
        p = secure_dir(os.path.join(self.d, 'a', 'b'), 'run directory')
        self.assertEqual(stat.S_IMODE(os.stat(p).st_mode), 0o700)
        self.assertEqual(secure_dir(p, 'run directory'), p)

    def test_parents_0755_whatever_the_umask(self):
        """hvvol-plugin.service runs with UMask=0077: the directories on the
        way (/run/hybridvm, shared with the clone cache's sockets) stay
        passable for others."""
        old = os.umask(0o077)
        try:
            p = secure_dir(os.path.join(self.d, 'shared', 'volumes'), 'run directory')
        finally:
            os.umask(old)
        self.assertEqual(stat.S_IMODE(os.stat(os.path.dirname(p)).st_mode), 0o755)
        self.assertEqual(stat.S_IMODE(os.stat(p).st_mode), 0o700)

    def test_refusals(self):
        other = os.path.join(self.d, 'other')
        os.mkdir(other, 0o700)
        os.chown(other, 65534, 65534)
        with self.assertRaises(BadInput) as e:
            secure_dir(os.path.join(other, 'run'), 'run directory')
        self.assertIn('owned by uid 65534', str(e.exception))
        wide = os.path.join(self.d, 'wide')
        os.mkdir(wide)
        os.chmod(wide, 0o777)
        with self.assertRaises(BadInput) as e:
            secure_dir(os.path.join(wide, 'run'), 'run directory')
        self.assertIn('writable by others', str(e.exception))
        os.chmod(wide, 0o1777)          # sticky, as /tmp: fine
        secure_dir(os.path.join(wide, 'run'), 'run directory')
        loose = os.path.join(self.d, 'loose')
        os.mkdir(loose, 0o755)
        with self.assertRaises(BadInput) as e:
            secure_dir(loose, 'run directory')
        self.assertIn('must be 0700', str(e.exception))
        link = os.path.join(self.d, 'link')
        os.symlink(self.d, link)
        os.lchown(link, 65534, 65534)
        with self.assertRaises(BadInput) as e:
            secure_dir(os.path.join(link, 'run'), 'run directory')
        self.assertIn('symbolic link owned by uid 65534', str(e.exception))


class StateFileTest(unittest.TestCase):

    def setUp(self):
        self.d = tempfile.mkdtemp()
        self.p = os.path.join(self.d, 'state.json')

    def tearDown(self):
        shutil.rmtree(self.d)

    def test_round_trip_and_damage(self):
        write_json(self.p, {'name': 'v', 'phase': 'mounted', 'pid': 5})
        self.assertEqual(stat.S_IMODE(os.stat(self.p).st_mode), 0o600)
        st = _typed(read_json(self.p, 'state file'), 'state file', self.p, STATE_SPEC)
        self.assertEqual(st['pid'], 5)
        self.assertIsNone(st['loop'])
        self.assertEqual(os.listdir(self.d), ['state.json'], 'no temporary file left')
        for text in ('{"name": "v", "phase": "x", "pid": "5"}',      # wrong type
                     '{"name": "v", "phase": "x", "pid": true}',     # bool is not an int
                     '{"phase": "x"}',                               # no name
                     '[1, 2]', 'garbage', '{' * 100000):
            with open(self.p, 'w') as f:
                f.write(text)
            with self.assertRaises(VolumeError, msg=text[:40]) as e:
                _typed(read_json(self.p, 'state file'), 'state file', self.p, STATE_SPEC)
            self.assertIn('damaged', str(e.exception))

    def test_link_refused(self):
        os.symlink('/etc/passwd', self.p)
        with self.assertRaises(VolumeError):
            read_json(self.p, 'state file')
        write_json(self.p, {'a': 1})        # replaces the link, never follows it
        self.assertFalse(os.path.islink(self.p))
        with open('/etc/passwd') as f:
            self.assertNotIn('"a"', f.read())
        with open(self.p) as f:
            self.assertEqual(json.load(f), {'a': 1})


if __name__ == '__main__':
    unittest.main()
