"""The Debian packages (make deb, docs/deploy.md "Packages") in a clean
Debian 12 root (issue 38, item 2).

One run, in order: build the packages twice (Debian revisions 1 and 2, the
"previous" and the current version) with scripts/build-debs.sh, the script
`make deb` runs; lintian on them; a minbase bookworm root from mmdebstrap
(cached in build/pkgtest, a day at most) into which apt installs revision 1
with --no-install-recommends (so whatever the programs need must be a declared
dependency: nothing comes from the build host).

Then, in the root (chroot): every daemon's man page against its --help,
systemd-analyze verify of the units, `qemu-img create -f hybrid`,
redis-server loading the installed module, `hvarbiter check` on the installed
configuration, the installed libvirt hook admitting a domain, and hvarbiter
(on a loop device as its device) and hvmemd started from their units'
ExecStart= with the unit's directories, umask, capability bounding set,
no_new_privs, read-only system and private /tmp applied as systemd would; the
commands docs/deploy.md shows for a host.

Then the root boots with systemd as PID 1 (systemd-nspawn): hvmemd runs
under its real unit, enabled by the package (create, map, list; its log in
the journal), hvcache@gold is started with systemctl and serves the shipped
gold.conf's base; apt upgrades to revision 2 there, and the maintainer
scripts restart both: a changed conffile, a broker region with its data and
the warm cache are kept; apt remove stops them; purge removes configuration
and state.

Beyond our packages' Depends the root gets only what the checks use and our
packages recommend or serve: redis-server (the module's host), podman (the
installed arbiter configuration names a podman container), systemd (the units'
init).
"""

import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pkgroot                                                   # noqa: E402
from pkgroot import REPO, Root, build_debs, parse_unit, skip_reason  # noqa: E402

EXTRAS = ['redis-server', 'podman', 'systemd']
UNITS = ['hvmemd.service', 'hvarbiter.service', 'hvcache@gold.service', 'hvvol-plugin.service']
# Units whose daemon mounts for the host: no mount namespace of their own
# (packaging/hvvol-plugin.service.in says why).
HOST_MOUNTS = {'hvvol-plugin.service'}
MOUNT_NAMESPACE_KEYS = ('ProtectSystem', 'ProtectHome', 'PrivateTmp', 'PrivateDevices',
                        'ProtectKernelModules', 'ProtectKernelLogs', 'ProtectClock',
                        'ReadWritePaths', 'ReadOnlyPaths', 'InaccessiblePaths', 'TemporaryFileSystem')
DEPLOY = os.path.join(REPO, 'docs', 'deploy.md')


def deploy_commands(section):
    """The shell lines of the ```sh blocks under `## section` in docs/deploy.md
    (comments and blank lines dropped, continuations joined)."""
    with open(DEPLOY) as f:
        text = f.read()
    m = re.search(rf'^## {re.escape(section)}\n(.*?)(?=^## |\Z)', text, re.S | re.M)
    assert m, f'docs/deploy.md has no section "{section}"'
    lines = []
    for block in re.findall(r'```sh\n(.*?)```', m.group(1), re.S):
        for line in block.replace('\\\n', ' ').splitlines():
            line = line.split('  # ')[0].strip()
            if line and not line.startswith('#'):
                lines.append(line)
    return lines


@unittest.skipIf(skip_reason(), skip_reason())
class DebianPackagesTest(unittest.TestCase):

    def setUp(self):
        os.makedirs(pkgroot.CACHE, exist_ok=True)
        self.work = tempfile.mkdtemp(prefix='debs-', dir=pkgroot.CACHE)
        self.box = Root(self.work)
        self.root = self.box.path
        self.sh = self.box.sh
        self.daemons = {}
        self.t0 = time.monotonic()

    def tearDown(self):
        for name in list(self.daemons):
            self.stop(name)
        self.box.poweroff()
        shutil.rmtree(self.work, ignore_errors=True)

    def log(self, what):
        print(f'[{time.monotonic() - self.t0:6.1f} s] {what}', flush=True)

    def unit(self, name):
        base, _, inst = name.partition('@')
        inst = inst[:-len('.service')] if inst else None
        path = os.path.join(self.root, 'lib/systemd/system',
                            f'{base}@.service' if inst is not None else name)
        return parse_unit(path, inst)

    def start(self, name, ready, timeout=30):
        """Start `name` from its unit's ExecStart= (unit's sandbox applied);
        wait until the file `ready` (in the root) exists."""
        u = self.unit(name)
        [cmd] = u['ExecStart']
        with open(os.path.join(self.work, f'{name}.log'), 'ab') as log:
            proc = subprocess.Popen(self.box.script(cmd, unit=u), stdout=log, stderr=log,
                                    env=dict(os.environ, LC_ALL='C',
                                             PATH='/usr/sbin:/usr/bin:/sbin:/bin'))
        deadline = time.monotonic() + timeout
        path = self.root + ready
        pid = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self.fail(f'{name} exited {proc.returncode}: {self.daemon_log(name)}')
            if pid is None:
                pid = self.pid_of(proc)
            if pid and os.path.exists(path):
                self.daemons[name] = (proc, pid)
                return
            time.sleep(0.1)
        proc.kill()
        self.fail(f'{name}: no {ready} after {timeout} s: {self.daemon_log(name)}')

    def pid_of(self, proc):
        """The daemon's pid: the unshare's child, once it has exec'd."""
        try:
            with open(f'/proc/{proc.pid}/task/{proc.pid}/children') as f:
                kids = f.read().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None

    def daemon_log(self, name):
        with open(os.path.join(self.work, f'{name}.log'), errors='replace') as f:
            return f.read()[-3000:]

    def stop(self, name):
        """SIGTERM, as systemctl stop; wait for it."""
        proc, pid = self.daemons.pop(name)
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            self.fail(f'{name} did not stop on SIGTERM')

    def qmp(self, path, command):
        """A QMP command in the root, through the installed hvqmp."""
        code = ('import json, sys; sys.path.insert(0, "/usr/lib/hybridvm/python"); import hvqmp\n'
                f'q = hvqmp.QMP({path!r}, timeout=10).connect()\n'
                f'print(json.dumps(q.cmd({command!r})))')
        return json.loads(self.sh(f'python3 -c {shlex.quote(code)}').stdout)

    # -- the packages --------------------------------------------------------
    def build(self, revision):
        out = os.path.join(self.work, f'debs-{revision}')
        return (out,) + build_debs(out, revision)

    def lintian(self, out):
        """No errors; each warning's tag is one docs/deploy.md justifies."""
        [changes] = glob.glob(os.path.join(out, '*.changes'))
        r = subprocess.run(['lintian', '--tag-display-limit', '0', changes],
                           capture_output=True, text=True, timeout=300)
        tags = re.findall(r'^([EWX]): \S+: (\S+)', r.stdout, re.M)
        errors = [t for k, t in tags if k in 'EX']
        self.assertEqual(errors, [], r.stdout)
        with open(DEPLOY) as f:
            justified = set(re.findall(r'^\| `([a-z0-9-]+)` \|', f.read(), re.M))
        self.assertEqual({t for k, t in tags if k == 'W'} - justified, set(),
                         f'lintian warnings docs/deploy.md does not justify:\n{r.stdout}')

    def versions(self):
        """{package: version} of the installed hybridvm-* packages."""
        out = self.sh("dpkg-query -W -f '${Package} ${Status} ${Version}\\n' 'hybridvm-*'",
                      check=False).stdout
        return {p[0]: p[-1] for p in map(str.split, out.splitlines())
                if len(p) == 5 and p[3] == 'installed'}

    # -- checks inside the root ------------------------------------------------
    def check_man_pages_match_help(self):
        """Each daemon's man page names every option and command its --help
        (and each command's --help) names, and no option they do not."""
        def opts(text):
            return set(re.findall(r'(?<![\w-])(--[a-z][a-z-]+)', text.replace('\\-', '-')))

        def man(page):
            return self.sh(f'zcat /usr/share/man/man{page[-1]}/{page}.gz').stdout

        self.assertEqual(opts(man('hvmemd.8')), opts(self.sh('hvmemd --help').stdout))
        for prog, page in (('hvarbiter', 'hvarbiter.8'), ('hvcache', 'hvcache.8'),
                           ('hvvol', 'hvvol.8')):
            text = man(page)
            help_ = self.sh(f'{prog} --help').stdout
            cmds = re.search(r'\{([a-z,]+)\}', help_).group(1).split(',')
            named = opts(help_)
            for c in cmds:
                self.assertTrue(re.search(rf'(^\.B |{prog} ){c}\b', text, re.M),
                                f'{page} lacks the command {c}')
                named |= opts(self.sh(f'{prog} {c} --help').stdout)
            self.assertEqual(opts(text), named, page)

    def check_units(self):
        r = self.sh('systemd-analyze verify --man=no ' + ' '.join(UNITS), check=False)
        self.assertEqual((r.returncode, r.stdout + r.stderr), (0, ''))
        for u in UNITS:
            keys = self.unit(u)
            self.assertEqual(keys.get('NoNewPrivileges'), ['yes'], u)
            if u in HOST_MOUNTS:
                self.assertEqual([k for k in MOUNT_NAMESPACE_KEYS if k in keys], [], u)
            else:
                for k, v in (('ProtectSystem', 'strict'), ('ProtectHome', 'yes'),
                             ('PrivateTmp', 'yes')):
                    self.assertEqual(keys.get(k), [v], f'{u}: {k}')
            self.assertIn('CapabilityBoundingSet', keys, u)
            self.assertNotIn('StandardOutput', keys, f'{u}: logs go to the journal')
            self.assertTrue(keys['ExecStart'][0].startswith('/usr/bin/'), u)

    def check_tools(self):
        out = self.sh('cd /tmp && qemu-img create -f hybrid -o ram-size=16M,mode=async d.hyb 64M'
                      ' && qemu-img info d.hyb && command -v qemu-img').stdout
        self.assertIn('file format: hybrid', out)
        self.assertIn('/usr/bin/qemu-img', out)
        # redis-server loads the installed module by its path, as redis.conf would
        self.sh('cd /tmp && (redis-server --port 0 --unixsocket /tmp/r.sock --save "" '
                '--loadmodule /usr/lib/redis/modules/hybridmem.so >r.log 2>&1 &) && '
                'for i in $(seq 100); do [ -S /tmp/r.sock ] && break; sleep 0.1; done && '
                'redis-cli -s /tmp/r.sock MODULE LIST >m.txt && redis-cli -s /tmp/r.sock '
                'SHUTDOWN NOSAVE || true; cat m.txt; grep -qx appassist m.txt || '
                '{ cat r.log; exit 1; }')
        # the installed configuration, on a device of that name
        self.sh('mknod /dev/nvme0n1 b 259 0 2>/dev/null || true')
        r = self.sh('hvarbiter check /etc/hybridvm/arbiter.conf')
        self.assertIn('device /dev/nvme0n1', r.stdout)
        self.assertIn('[container db] podman db: waiting: podman: no such container db',
                      r.stdout)

    def check_hook(self):
        """The installed hook admits a plain domain (its library from
        hybridvm-common, its configuration from the package) and forgets it."""
        xml = ("<domain type='qemu'><name>g1</name><memory unit='MiB'>64</memory><devices>"
               "<emulator>/usr/bin/qemu-system-x86_64</emulator></devices></domain>")
        hook = '/etc/libvirt/hooks/qemu.d/50-hybridvm'
        self.sh(f'echo "{xml}" | {hook} g1 prepare begin - && test -f /run/libvirt/hybridvm/g1.json'
                f' && echo "{xml}" | {hook} g1 release end - && ! test -e '
                '/run/libvirt/hybridvm/g1.json')

    def check_arbiter(self):
        """hvarbiter from its unit, on the installed configuration, with a
        loop device as its /dev/nvme0n1: the probe measures, the watchdog
        runs, the VM it names is absent (no QEMU), status answers."""
        img = os.path.join(self.work, 'nvme0n1.img')
        with open(img, 'wb') as f:
            f.truncate(64 << 20)
        loop = subprocess.run(['losetup', '--find', '--show', '--direct-io=on', img],
                              capture_output=True, text=True, check=True).stdout.strip()
        self.addCleanup(subprocess.run, ['losetup', '-d', loop])
        rdev = os.stat(loop).st_rdev
        self.sh(f'rm -f /dev/nvme0n1 && mknod /dev/nvme0n1 b {os.major(rdev)} {os.minor(rdev)}')
        self.start('hvarbiter.service', '/run/hvarbiter/arbiter.sock')
        deadline = time.monotonic() + 30
        while True:
            s = json.loads(self.sh('hvarbiter status /etc/hybridvm/arbiter.conf').stdout)
            if s.get('container', {}).get('probe_samples') and \
                    s['watchdog']['state'] == 'running':
                break
            self.assertLess(time.monotonic(), deadline, s)
            time.sleep(0.5)
        self.assertEqual(s['vm_state']['web1']['state'], 'absent')
        self.assertEqual(os.stat(self.root + '/run/hvarbiter').st_mode & 0o777, 0o700)
        self.stop('hvarbiter.service')

    def write_region(self, name, data):
        self.sh(f'hvmem map {name} --rw -- sh -c \'printf {data} | dd of=/proc/self/fd/$HVMEM_FD '
                'conv=notrunc status=none\'')

    def read_region(self, name, n):
        return self.sh(f'hvmem map {name} -- sh -c \'head -c {n} /proc/self/fd/$HVMEM_FD\'').stdout

    def cache(self):
        [c] = self.qmp('/run/hybridvm/clone-cache/gold.qmp', 'query-clone-cache')
        return c

    def read_through_cache(self):
        out = self.sh("cd /tmp && rm -f vm1.qcow2 && qemu-img create -f qcow2 -F raw -b "
                      "'nbd+unix:///gold?socket=/run/hybridvm/clone-cache/gold.sock' vm1.qcow2 "
                      ">/dev/null && qemu-io -r -c 'read -v 0 16' vm1.qcow2").stdout
        self.assertIn('goldbasedata', out)

    def check_volume_plugin(self):
        """The package enabled hvvol-plugin and told podman of it: a volume
        is created and removed through podman (making one only writes its
        image; mounting needs FUSE and loop devices, which the root booted
        here has not: volume/tests mount through podman on the host)."""
        self.assertEqual(self.sh('systemctl is-active hvvol-plugin').stdout.strip(), 'active')
        self.assertEqual(self.sh('stat -c %a /run/hybridvm/volume-plugin').stdout.strip(), '700')
        self.sh('podman volume create --driver hybridvm -o size=64M -o ram-size=16M '
                '-o mode=async web')
        self.assertEqual(self.sh('hvvol list').stdout.split(), ['web'])
        self.assertIn('hybridvm', self.sh('podman volume inspect web --format '
                                          '"{{.Driver}}"').stdout)
        r = self.sh('podman volume create --driver hybridvm -o size=1E big', check=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("size '1E' is not a size", r.stderr)
        self.sh('podman volume rm web')
        self.assertEqual(self.sh('hvvol list').stdout.split(), [])

    # -- the test ---------------------------------------------------------------
    def test_install_upgrade_purge(self):
        prev_dir, prev, v1 = self.build(1)
        cur_dir, cur, v2 = self.build(2)
        self.log(f'built {v1} and {v2}: {", ".join(os.path.basename(d) for d in cur)}')
        self.assertEqual(len(cur), 8)
        self.lintian(cur_dir)
        self.log('lintian: no errors, warnings as docs/deploy.md says')

        self.box.unpack()
        self.box.install(prev, EXTRAS)
        self.assertEqual(set(self.versions().values()), {v1})
        self.log(f'installed {v1} into a clean root')

        self.check_man_pages_match_help()
        self.check_units()
        self.check_tools()
        self.check_hook()
        self.check_arbiter()
        self.log('man pages, units, qemu-img, redis-server, hook, hvarbiter (from its unit)')

        # the broker from its unit's ExecStart=, sandboxed as the unit says,
        # for the commands docs/deploy.md shows for an installed host
        self.start('hvmemd.service', '/run/hybridvm-broker.sock')
        for line in deploy_commands('Checking an installed host'):
            self.sh(line)
        self.stop('hvmemd.service')
        self.log('docs/deploy.md commands, with hvmemd from its unit')

        # the root, booted: the package enabled hvmemd, systemd started it
        self.box.boot()
        self.assertEqual(self.sh('systemctl is-active hvmemd').stdout.strip(), 'active')
        self.assertIn('ready: socket /run/hybridvm-broker.sock',
                      self.sh('journalctl -u hvmemd -o cat --no-pager').stdout)
        self.assertEqual(self.sh('stat -c %a /run/hybridvm-broker.sock /dev/shm/hybridvm-broker')
                         .stdout.split(), ['600', '700'])
        self.sh('hvmem create kept 4M --mode 0600')
        self.write_region('kept', 'persisted')
        self.assertIn('name=kept ', self.sh('hvmem list').stdout)
        # the admin's change to a conffile: a provisioned region
        with open(self.root + '/etc/hybridvm/broker.conf', 'a') as f:
            f.write('\n[region provisioned]\nsize=2M\n')
        # a clone cache: the shipped gold.conf, its base made here
        self.sh('mkdir -p /var/lib/hybridvm/bases && '
                'qemu-img create -f raw /var/lib/hybridvm/bases/gold.img 16M >/dev/null && '
                'printf goldbasedata | dd of=/var/lib/hybridvm/bases/gold.img conv=notrunc '
                'status=none && systemctl start hvcache@gold && '
                'for i in $(seq 100); do [ -S /run/hybridvm/clone-cache/gold.qmp ] && break; '
                'sleep 0.1; done')
        self.read_through_cache()
        deadline = time.monotonic() + 20
        while True:     # filled, and no fill in flight (`used` counts those too)
            c = self.cache()
            if c['fill-pending'] == 0 and sum(b['fills'] for b in c['bases']) > 0:
                break
            self.assertLess(time.monotonic(), deadline, 'the cache was never filled')
            time.sleep(0.2)
        self.assertIn('exporting gold on /run/hybridvm/clone-cache/gold.sock',
                      self.sh('journalctl -u hvcache@gold -o cat --no-pager').stdout)
        self.check_volume_plugin()
        self.log('booted: hvmemd (create, map, list), hvcache@gold filled, podman volume '
                 'through hvvol-plugin, under systemd')

        # the upgrade, by apt in the booted system: the maintainer scripts
        # restart both daemons
        pids = {u: self.box.main_pid(u) for u in ('hvmemd', 'hvcache@gold')}
        self.box.install(cur)
        self.assertEqual(set(self.versions().values()), {v2})
        for u, pid in pids.items():
            self.assertEqual(self.sh(f'systemctl is-active {u}').stdout.strip(), 'active', u)
            self.assertNotEqual(self.box.main_pid(u), pid, f'{u} was not restarted')
        with open(self.root + '/etc/hybridvm/broker.conf') as f:
            self.assertIn('[region provisioned]', f.read())
        self.assertEqual(glob.glob(self.root + '/etc/hybridvm/**/*.dpkg-*', recursive=True), [])
        listing = self.sh('hvmem list').stdout
        self.assertIn('name=kept ', listing)
        self.assertIn('name=provisioned ', listing)
        self.assertEqual(self.read_region('kept', 9), 'persisted')
        self.sh('for i in $(seq 100); do [ -S /run/hybridvm/clone-cache/gold.qmp ] && break; '
                'sleep 0.1; done')
        self.assertGreater(self.cache()['used'], 0, 'the cache is cold after the upgrade')
        self.read_through_cache()
        self.log(f'upgraded to {v2} under systemd: daemons restarted; conffile, region and '
                 'its data, warm cache kept')

        # removal stops them; purge removes configuration and state
        self.sh('apt-get remove -y -q ' + ' '.join(self.versions()))
        for u in ('hvmemd', 'hvcache@gold', 'hvvol-plugin'):
            self.assertEqual(self.sh(f'systemctl is-active {u}', check=False).stdout.strip(),
                             'inactive', u)
        self.assertTrue(os.path.exists(self.root + '/etc/hybridvm/broker.conf'))
        self.assertEqual(self.sh('ls /dev/shm/hybridvm-broker /var/lib/hybridvm/clone-cache',
                                 check=False).returncode, 0)
        self.sh('apt-get purge -y -q ' + ' '.join(
            p for p in self.sh("dpkg-query -W -f '${Package}\\n' 'hybridvm-*'").stdout.split()))
        self.assertEqual(self.versions(), {})
        for p in ('/etc/hybridvm', '/var/lib/hybridvm/clone-cache', '/run/hybridvm/clone-cache',
                  '/etc/libvirt/hooks/qemu.d/50-hybridvm', '/usr/lib/hybridvm',
                  '/dev/shm/hybridvm-broker',
                  '/etc/containers/containers.conf.d/50-hybridvm-volume.conf'):
            self.assertEqual(self.sh(f'test -e {p} || test -L {p}', check=False).returncode, 1, p)
        self.log('removed: daemons stopped, state kept; purged: configuration and state gone')


if __name__ == '__main__':
    unittest.main()
