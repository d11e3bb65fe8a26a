"""The arbiter's configuration: a valid one parses; every absurd value is
refused with the section, key and range named."""

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from arbiter.config import Config, ConfigError   # noqa: E402

HVARBITER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'hvarbiter')

GOOD = """
[arbiter]
period-ms = 200
state-dir = /run/hvarbiter-test

[device]
path = /dev/loop0
target-latency-ms = 2.5

[container db]
cgroup = /sys/fs/cgroup/blkio/db
pressure = /sys/fs/cgroup/unified/db

[vm web1]
qmp = /run/vm/web1.qmp
throttle-group = tg0
default-iops = 0
floor-bps = 4M
slo-p99-ms = 50
"""


class ConfigTest(unittest.TestCase):
    def load(self, text):
        with tempfile.NamedTemporaryFile('w', suffix='.conf', delete=False) as f:
            f.write(text)
        self.addCleanup(os.unlink, f.name)
        return Config(f.name)

    def refused(self, text, *words):
        with self.assertRaises(ConfigError) as cm:
            self.load(text)
        for w in words:
            self.assertIn(w, str(cm.exception))
        return str(cm.exception)

    def test_good(self):
        c = self.load(GOOD)
        self.assertEqual(c.period_ms, 200)
        self.assertEqual(c.target_ms, 2.5)
        self.assertEqual(c.target_pct, 90)
        self.assertEqual([v.name for v in c.vms], ['web1'])
        self.assertEqual(c.vms[0].floor_bps, 4 << 20)
        self.assertEqual(c.vms[0].default_limits(), {'iops-total': 0, 'bps-total': 0})
        self.assertEqual(c.containers[0].pressure, '/sys/fs/cgroup/unified/db')
        self.assertEqual(c.socket, '/run/hvarbiter-test/arbiter.sock')

    def test_absurd_targets(self):
        for v in ('0', '-1', '1e9', 'nan', 'inf', 'fast'):
            self.refused(GOOD.replace('target-latency-ms = 2.5', f'target-latency-ms = {v}'),
                         '[device] target-latency-ms')
        self.refused(GOOD.replace('period-ms = 200', 'period-ms = 1'), 'period-ms', '[50, 10000]')
        self.refused(GOOD.replace('slo-p99-ms = 50', 'slo-p99-ms = 0'), '[vm web1] slo-p99-ms')
        self.refused(GOOD.replace('target-latency-ms = 2.5', 'target-latency-ms = auto'), 'needs model')
        for v in ('100', '10', '99.99', 'p99'):
            self.refused(GOOD.replace('target-latency-ms = 2.5',
                                      f'target-latency-ms = 2.5\ntarget-percentile = {v}'),
                         '[device] target-percentile')
        c = self.load(GOOD.replace('target-latency-ms = 2.5',
                                   'target-latency-ms = 2.5\ntarget-percentile = 99'))
        self.assertEqual(c.target_pct, 99)

    def test_floor_below_the_safe_minimum(self):
        self.refused(GOOD.replace('floor-bps = 4M', 'floor-bps = 1M'), 'floor-bps', '[2000000')
        self.refused(GOOD.replace('default-iops = 0', 'default-iops = 5'),
                     'default-iops 5 is below floor-iops 10')

    def test_typos_and_missing(self):
        self.refused(GOOD.replace('slo-p99-ms', 'slo-p99'), "[vm web1] unknown key: slo-p99")
        self.refused(GOOD + '\n[vms web2]\n', 'unknown section [vms web2]')
        self.refused(GOOD + '\n[vm a/b]\nqmp=/x\nthrottle-group=t\n', 'unknown section')
        self.refused(GOOD.replace('qmp = /run/vm/web1.qmp', ''),
                     '[vm web1] qmp (a QMP socket) or libvirt (a URI) is required')
        self.refused(GOOD.replace('qmp = /run/vm/web1.qmp', 'qmp = web1\0.qmp'),
                     '[vm web1] qmp', 'is not a path')
        self.refused(GOOD.replace('throttle-group = tg0', 'throttle-group = ../../x'),
                     'not a valid name')
        self.refused(GOOD + '\n[vm web1]\nqmp=/y\n', 'web1')        # duplicate section
        self.refused('[device]\npath=/dev/x\n', 'no [arbiter] section')

    def test_libvirt_vm(self):
        """A VM libvirt manages: a URI, the domain and its disk; a QMP
        socket beside them, or QMP-only keys missing, are errors."""
        lv = GOOD.replace('qmp = /run/vm/web1.qmp\nthrottle-group = tg0',
                          'libvirt = qemu:///system\ndomain = web 1 (prod)\ndevice = vda')
        v = self.load(lv).vms[0]
        self.assertEqual((v.libvirt, v.domain, v.device, v.group, v.qmp),
                         ('qemu:///system', 'web 1 (prod)', 'vda', None, None))
        v = self.load(lv.replace('device = vda', 'device = vda\nthrottle-group = shared')).vms[0]
        self.assertEqual(v.group, 'shared')
        self.refused(lv.replace('device = vda', 'device = vda\nqmp = /x.qmp'),
                     '[vm web1] qmp and libvirt: give one of them')
        self.refused(lv.replace('domain = web 1 (prod)\n', ''), '[vm web1] domain: is required')
        self.refused(lv.replace('device = vda', ''), '[vm web1] device: is required')
        for uri in ('qemu:///system now', 'file', '://x', 'qemu:///sys\x01'):
            self.refused(lv.replace('qemu:///system', uri), '[vm web1] libvirt')
        v = self.load(lv.replace('qemu:///system', 'qemu+unix:///system?socket=/run/x/sock')).vms[0]
        self.assertEqual(v.libvirt, 'qemu+unix:///system?socket=/run/x/sock')
        for dom in ('a/b', 'x' * 201):
            self.refused(lv.replace('web 1 (prod)', dom), '[vm web1] domain')

    def test_libvirt_uri_stays_on_this_host(self):
        """The daemon runs as root and connects where the URI says: a URI
        that would run a program (qemu+ext's command=, ssh's), reach
        another machine, or open another driver or an in-process QEMU is
        refused before anything connects."""
        lv = GOOD.replace('qmp = /run/vm/web1.qmp\nthrottle-group = tg0',
                          'libvirt = URI\ndomain = web1\ndevice = vda')
        for uri, why in (
                ('qemu+ext:///system?command=/tmp/evil', 'not a local QEMU URI'),
                ('qemu+ssh://root@elsewhere/system', 'not a local QEMU URI'),
                ('qemu+tcp://10.0.0.1/system', 'not a local QEMU URI'),
                ('qemu://elsewhere/system', 'names a host'),
                ('qemu+unix://elsewhere/system?socket=/s', 'names a host'),
                ('lxc:///system', 'not a local QEMU URI'),
                ('test:///default', 'not a local QEMU URI'),
                ('qemu:///embed?root=/tmp/x', 'the path must be /system or /session'),
                ('qemu+unix:///system?command=/tmp/evil', 'takes no parameter but one socket='),
                ('qemu+unix:///system?socket=/a&socket=/b', 'takes no parameter but one socket='),
                ('qemu+unix:///system?socket=run/sock', 'socket= must be an absolute path'),
                ('qemu+unix:///system?socket', 'malformed parameters')):
            self.refused(lv.replace('URI', uri), '[vm web1] libvirt', why)

    def test_libvirt_without_bindings_refused_at_start(self):
        """A libvirt VM under a python3 without the bindings: check and run
        refuse at once, naming the package, rather than leave the VM
        absent for good."""
        import subprocess
        r = subprocess.run([sys.executable, '-c', 'import libvirt'], capture_output=True)
        if r.returncode == 0:
            self.skipTest(f'{sys.executable} has the libvirt bindings')
        lv = GOOD.replace('qmp = /run/vm/web1.qmp\nthrottle-group = tg0',
                          'libvirt = qemu:///system\ndomain = web1\ndevice = vda')
        with tempfile.NamedTemporaryFile('w', suffix='.conf', delete=False) as f:
            f.write(lv)
        self.addCleanup(os.unlink, f.name)
        os.chmod(f.name, 0o644)
        hv = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'hvarbiter')
        for cmd in ('check', 'run'):
            r = subprocess.run([sys.executable, hv, cmd, f.name], capture_output=True, text=True,
                               timeout=60)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn('[vm web1] libvirt: the libvirt Python bindings are not installed',
                          r.stderr)
            self.assertIn('python3-libvirt', r.stderr)

    def test_podman_container(self):
        """[container NAME] takes a podman container's name or id instead of
        a cgroup (exactly one of the two); [arbiter] podman-command gives
        podman's global options, split as a shell would, never run by one."""
        pm = GOOD.replace('cgroup = /sys/fs/cgroup/blkio/db\npressure = /sys/fs/cgroup/unified/db',
                          'podman = web-db_1.prod')
        c = self.load(pm)
        self.assertEqual((c.containers[0].podman, c.containers[0].cgroup,
                          c.containers[0].pressure), ('web-db_1.prod', None, None))
        self.assertEqual(c.podman_command, ['podman'])
        self.assertEqual(c.podman_timeout, 10.0)
        self.assertIsNone(self.load(GOOD).containers[0].podman)
        cid = '5c5f3da95e72' * 5 + '1fee'
        self.assertEqual(self.load(pm.replace('web-db_1.prod', cid)).containers[0].podman, cid)
        c = self.load(pm.replace('[arbiter]', '[arbiter]\npodman-command = podman --root '
                                 '"/var/lib/my containers" --runroot=/run/c --runtime runc '
                                 '--cgroup-manager cgroupfs --events-backend file\n'
                                 'podman-timeout-ms = 500'))
        self.assertEqual(c.podman_command, ['podman', '--root', '/var/lib/my containers',
                                            '--runroot', '/run/c', '--runtime', 'runc',
                                            '--cgroup-manager', 'cgroupfs',
                                            '--events-backend', 'file'])
        self.assertEqual(c.podman_timeout, 0.5)

    def test_the_example_parses(self):
        """arbiter.conf.example, as shipped, is a valid configuration."""
        with open(os.path.join(os.path.dirname(HVARBITER), 'arbiter.conf.example')) as f:
            c = self.load(f.read())
        self.assertEqual([(x.name, x.podman) for x in c.containers], [('db', 'db')])
        self.assertEqual([v.name for v in c.vms], ['web1'])

    def test_podman_hostile_values(self):
        """Names that are not podman's (an option, a path, shell syntax,
        control characters, too long), both or neither of cgroup and
        podman, a pressure group beside podman, the same container twice,
        a podman-command that is not podman or passes an option the
        arbiter does not, an absurd timeout: each refused, named."""
        pm = GOOD.replace('cgroup = /sys/fs/cgroup/blkio/db\npressure = /sys/fs/cgroup/unified/db',
                          'podman = db')
        for ref in ('-db', '--remote', '../db', 'a/b', 'db;id', '$(id)', '`id`', 'a b', '.db',
                    '_db', 'x' * 254, 'd\u00e9', 'db\x01', '*'):
            self.refused(pm.replace('podman = db', f'podman = {ref}'),
                         '[container db] podman', 'is not a valid name')
        self.assertEqual(self.load(pm.replace('podman = db', 'podman = ' + 'x' * 253))
                         .containers[0].podman, 'x' * 253)
        self.refused(pm.replace('podman = db', 'podman = db\ncgroup = /sys/fs/cgroup/blkio/x'),
                     '[container db] give one of cgroup', 'and podman')
        self.refused(pm.replace('podman = db', 'weight = 2'), '[container db] give one of')
        self.refused(pm.replace('podman = db', 'podman = db\npressure = /x'),
                     '[container db] pressure: not with podman')
        self.refused(pm + '\n[container db2]\npodman = db\n',
                     '[container db2] podman: db is [container db] already')
        self.refused(pm.replace('podman = db', 'podman ='), '[container db] podman: is required')
        for cmd, why in (('sh -c "podman $x"', 'the program is podman'),
                         ('podman --remote', 'not one of the global options'),
                         ('podman --url tcp://10.0.0.1:8080', 'not one of the global options'),
                         ('podman --root relative', 'must be an absolute path'),
                         ('podman --root "/a', 'cannot split'),
                         ('', 'is empty')):
            self.refused(pm.replace('[arbiter]', f'[arbiter]\npodman-command = {cmd}'),
                         '[arbiter] podman-command: ', why)
        for t in ('0', '99', '120001', 'soon'):
            self.refused(pm.replace('[arbiter]', f'[arbiter]\npodman-timeout-ms = {t}'),
                         '[arbiter] podman-timeout-ms')

    @unittest.skipIf(os.geteuid() != 0, 'needs root (a block device node)')
    def test_check_and_run_name_a_missing_podman(self):
        """check and run refuse a podman-command whose program is not
        there, at once, rather than wait for a container for good."""
        d = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, d)
        os.mknod(os.path.join(d, 'disk'), 0o600 | stat.S_IFBLK, os.makedev(7, 250))
        pm = GOOD.replace('cgroup = /sys/fs/cgroup/blkio/db\npressure = /sys/fs/cgroup/unified/db',
                          'podman = db').replace('/dev/loop0', os.path.join(d, 'disk'))
        conf = self.write(pm.replace('[arbiter]', '[arbiter]\n'
                                     'podman-command = /nonexistent/podman --root /x'))
        for cmd in ('check', 'run'):
            r = self.hvarbiter(cmd, conf)
            self.assertEqual(r.returncode, 1, r.stdout)
            self.assertIn('hvarbiter: [container db] podman: /nonexistent/podman is not '
                          'installed', r.stderr)

    def test_relative_paths_are_the_config_files_dirs(self):
        """Every path the configuration names may be relative: it is
        resolved against the directory of the configuration file (its real
        path), never against the directory the daemon is started from;
        the configuration's own path is made absolute too (the watchdog,
        started elsewhere, reads it again)."""
        d = os.path.realpath(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, d)
        os.mkdir(os.path.join(d, 'etc'))
        text = GOOD.replace('state-dir = /run/hvarbiter-test', 'state-dir = state\n'
                            'metrics-file = ../prom/arb.prom\nlog = logs/decisions.jsonl')
        text = text.replace('path = /dev/loop0', 'path = /dev/loop0\nmodel = model.json')
        text = text.replace('qmp = /run/vm/web1.qmp', 'qmp = vm/web1.qmp')
        text = text.replace('cgroup = /sys/fs/cgroup/blkio/db', 'cgroup = cg/db')
        with open(os.path.join(d, 'etc', 'arb.conf'), 'w') as f:
            f.write(text)
        os.symlink('etc', os.path.join(d, 'link'))
        cwd = os.getcwd()
        self.addCleanup(os.chdir, cwd)
        os.chdir(tempfile.gettempdir())
        for given in (os.path.join(os.path.relpath(d), 'etc', 'arb.conf'),
                      os.path.join(d, 'link', 'arb.conf')):
            c = Config(given)
            etc = os.path.join(d, 'etc')
            self.assertEqual(c.path, os.path.join(etc, 'arb.conf'))
            self.assertEqual(c.state_dir, os.path.join(etc, 'state'))
            self.assertEqual(c.socket, os.path.join(etc, 'state', 'arbiter.sock'))
            self.assertEqual(c.log, os.path.join(etc, 'logs', 'decisions.jsonl'))
            self.assertEqual(os.path.normpath(c.metrics_file), os.path.join(d, 'prom', 'arb.prom'))
            self.assertEqual(c.model, os.path.join(etc, 'model.json'))
            self.assertEqual(c.device, '/dev/loop0')
            self.assertEqual(c.vms[0].qmp, os.path.join(etc, 'vm', 'web1.qmp'))
            self.assertEqual(c.containers[0].cgroup, os.path.join(etc, 'cg', 'db'))
            self.assertEqual(c.containers[0].pressure, '/sys/fs/cgroup/unified/db')

    def write(self, text):
        with tempfile.NamedTemporaryFile('w', suffix='.conf', delete=False) as f:
            f.write(text)
        self.addCleanup(os.unlink, f.name)
        os.chmod(f.name, 0o644)
        return f.name

    def hvarbiter(self, *args, cwd=None):
        return subprocess.run([sys.executable, HVARBITER, *args], capture_output=True, text=True,
                              timeout=60, cwd=cwd)

    def test_check_refuses_a_missing_device(self):
        """check verifies that the device the configuration names is
        there and is a block device, and names it when it is not."""
        for dev, why in (('/dev/arbiter-test-no-such-device', 'No such file or directory'),
                         ('/dev/null', 'not a block device')):
            r = self.hvarbiter('check', self.write(GOOD.replace('/dev/loop0', dev)))
            self.assertEqual(r.returncode, 1, r.stdout)
            self.assertIn(f'[device] path: {dev}: {why}', r.stderr)

    @unittest.skipIf(os.geteuid() != 0, 'needs root (a block device node)')
    def test_check_accepts_a_block_device_from_another_cwd(self):
        """A configuration whose device is a block device passes check,
        run from another directory with a relative configuration path and
        a relative device path."""
        d = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, d)
        os.mkdir(os.path.join(d, 'etc'))
        os.mknod(os.path.join(d, 'etc', 'disk'), 0o600 | stat.S_IFBLK, os.makedev(7, 250))
        conf = os.path.join(d, 'etc', 'arb.conf')
        with open(conf, 'w') as f:
            f.write(GOOD.replace('/dev/loop0', 'disk'))
        os.chmod(conf, 0o644)
        r = self.hvarbiter('check', 'etc/arb.conf', cwd=d)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(f'device {os.path.realpath(d)}/etc/disk', r.stdout)

    def test_not_a_file(self):
        with self.assertRaises(ConfigError):
            Config('/nonexistent/arbiter.conf')
        with self.assertRaises(ConfigError) as cm:
            Config('/dev')
        self.assertIn('not a regular file', str(cm.exception))

    def test_writable_by_others_refused(self):
        """The daemon runs as root and writes where its configuration says
        (state-dir, log, metrics-file): one anybody may edit is refused."""
        with tempfile.NamedTemporaryFile('w', suffix='.conf', delete=False) as f:
            f.write(GOOD)
        self.addCleanup(os.unlink, f.name)
        for mode in (0o666, 0o620):
            os.chmod(f.name, mode)
            with self.assertRaises(ConfigError) as cm:
                Config(f.name)
            self.assertIn('writable by group or others', str(cm.exception))
        os.chmod(f.name, 0o644)
        self.assertEqual(Config(f.name).target_ms, 2.5)

    def test_fifo_refused_without_hanging(self):
        d = tempfile.mkdtemp()
        self.addCleanup(os.rmdir, d)
        fifo = os.path.join(d, 'arbiter.conf')
        os.mkfifo(fifo)
        self.addCleanup(os.unlink, fifo)
        with self.assertRaises(ConfigError) as cm:
            Config(fifo)
        self.assertIn('not a regular file', str(cm.exception))


if __name__ == '__main__':
    unittest.main()
