"""Containers given to the arbiter by podman name or id (arbiter/podmanlink.py).

With real podman containers (rootful podman, runc, the tests' own storage:
tests/hvlib/podman.py): a container is found by its name, its full id and
a short id, at the cgroups podman put it in; one that is created but not
started, or not there, is waited for; a restart is followed and a removal
reported; and the daemon, given `podman = NAME`, measures a fio container's
I/O on a loop device, reports the container gone when it is removed and
takes it up again when a new one of that name runs.

What podman and /proc say is hostile input: the parsers are fed what the
kernel and podman would never write, and a stand-in podman (a script at
an absolute path, the only way to make "podman" answer nonsense) answers
with too much, too late, the wrong shapes and out-of-range pids.
"""

import os
import subprocess
import shutil
import sys
import tempfile
import time
import types
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import arblib as A   # noqa: E402
from arbiter import podmanlink as P   # noqa: E402
from fakeqmp import FakeQMP   # noqa: E402

WHY = A.podman_unavailable()
ID = 'ab' * 32


class Recorder(list):
    def __call__(self, rec):
        self.append(rec)


class ParseTest(unittest.TestCase):
    """The parsers alone, on text the kernel would and would not write."""

    def test_proc_cgroup(self):
        text = ('12:blkio:/libpod_parent/libpod-%s\n1:cpu,cpuacct:/x\n'
                '0::/libpod_parent/libpod-%s\n' % (ID, ID))
        self.assertEqual(P.parse_proc_cgroup(text), (f'/libpod_parent/libpod-{ID}',
                                                     f'/libpod_parent/libpod-{ID}'))
        self.assertEqual(P.parse_proc_cgroup('3:net_cls,blkio:/machine.slice/'
                                             f'libpod-{ID}.scope\n'),
                         (f'/machine.slice/libpod-{ID}.scope', None))
        for bad in ('blkio:/x\n', 'x:blkio:/y\n', '12\n'):
            with self.assertRaisesRegex(P.PodmanError, 'malformed'):
                P.parse_proc_cgroup(bad)

    def test_cgroup_paths_with_dots_or_odd_characters_are_refused(self):
        for path in ('/a/../b', '/..', '/a/./b', 'a/b', '/a//b', '/a b', '/a\nb',
                     '/a/b\x00', '/' + 'x' * 256, '/a' * 33, '/\u00e9', '/a/*', ''):
            with self.assertRaises(P.PodmanError, msg=repr(path)):
                P.check_cgroup_path(path)
        self.assertEqual(P.check_cgroup_path(r'/system.slice/a\x2db@1:c+d.scope'),
                         ['system.slice', r'a\x2db@1:c+d.scope'])

    def test_mounts(self):
        mi = ('31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n'
              '38 31 0:35 / /sys/fs/cgroup/blkio rw,relatime - cgroup cgroup rw,blkio\n'
              '41 31 0:38 / /sys/fs/cgroup/uni\\040fied rw - cgroup2 cgroup2 rw\n'
              'garbage\n')
        self.assertEqual(P.cgroup_mounts(mi), {'blkio': ('/', '/sys/fs/cgroup/blkio'),
                                               'v2': ('/', '/sys/fs/cgroup/uni fied')})

    def test_locate_wants_the_containers_id_in_its_group(self):
        """A pid whose group does not name the container (it was reused
        after the container ended, or the container runs without a group
        of its own) is refused, not measured."""
        mi = '38 31 0:35 / /sys/fs/cgroup/blkio rw - cgroup cgroup rw,blkio\n'
        info = dict(id=ID, pid=42)
        self.assertEqual(P.locate(info, f'7:blkio:/libpod_parent/libpod-{ID}\n', mi),
                         (f'/sys/fs/cgroup/blkio/libpod_parent/libpod-{ID}', None))
        # crun with systemd: the container in a child of its scope
        self.assertEqual(P.locate(info, f'7:blkio:/machine.slice/libpod-{ID}.scope/container\n',
                                  mi),
                         (f'/sys/fs/cgroup/blkio/machine.slice/libpod-{ID}.scope/container', None))
        for text in ('7:blkio:/user.slice\n', '7:blkio:/\n', f'7:blkio:/libpod-{ID[:-1]}\n',
                     f'7:blkio:/libpod-{ID[:-1]}/{ID[-1]}\n'):
            with self.assertRaisesRegex(P.PodmanError, 'does not name container'):
                P.locate(info, text, mi)
        # the v2 group serves io.pressure only if it names the container too
        d = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, d)
        os.makedirs(f'{d}/libpod-{ID}')
        open(f'{d}/libpod-{ID}/io.pressure', 'w').close()
        v2 = f'0 0 0:38 / {d} rw - cgroup2 cgroup2 rw\n'
        self.assertEqual(P.locate(info, f'7:blkio:/libpod-{ID}\n0::/libpod-{ID}\n', mi + v2),
                         (f'/sys/fs/cgroup/blkio/libpod-{ID}', f'{d}/libpod-{ID}'))
        self.assertEqual(P.locate(info, f'7:blkio:/libpod-{ID}\n0::/\n', mi + v2),
                         (f'/sys/fs/cgroup/blkio/libpod-{ID}', None))
        # a host with cgroup v2 only: the unified group holds the counters
        self.assertEqual(P.locate(info, f'0::/libpod-{ID}\n', v2),
                         (f'{d}/libpod-{ID}', f'{d}/libpod-{ID}'))
        with self.assertRaisesRegex(P.PodmanError, 'does not name container'):
            P.locate(info, '0::/init.scope\n', v2)
        with self.assertRaisesRegex(P.PodmanError, 'outside the mount'):
            P.locate(info, f'7:blkio:/a/libpod-{ID}\n',
                     '38 31 0:35 /b /sys/fs/cgroup/blkio rw - cgroup cgroup rw,blkio\n')
        with self.assertRaisesRegex(P.PodmanError, 'no blkio'):
            P.locate(info, f'7:blkio:/libpod-{ID}\n', '')


class CommandTest(unittest.TestCase):
    """[arbiter] podman-command: podman and the global options that say
    where its containers are; nothing that runs something else or reaches
    another machine."""

    def test_good(self):
        self.assertEqual(P.parse_command('podman'), ['podman'])
        argv = ('podman --root /b/root --runroot=/b/run --runtime runc --cgroup-manager '
                'cgroupfs --events-backend file --storage-opt "overlay.mount_program=/usr/bin/'
                'fuse-overlayfs" --namespace ns1')
        self.assertEqual(P.parse_command(argv), [
            'podman', '--root', '/b/root', '--runroot', '/b/run', '--runtime', 'runc',
            '--cgroup-manager', 'cgroupfs', '--events-backend', 'file', '--storage-opt',
            'overlay.mount_program=/usr/bin/fuse-overlayfs', '--namespace', 'ns1'])
        self.assertEqual(P.parse_command('/opt/podman/bin/podman'), ['/opt/podman/bin/podman'])
        self.assertEqual(P.parse_command("podman --root '/my containers'"),
                         ['podman', '--root', '/my containers'])

    def test_hostile(self):
        for raw, why in (
                ('', 'is empty'),
                ('sh -c "podman $x"', 'the program is podman'),
                ('bin/podman', 'the program is podman'),
                ('/usr/bin/../../tmp/podman', 'the program is podman'),
                ('podman --remote', 'not one of the global options'),
                ('podman --url=ssh://root@elsewhere/run/podman.sock', 'not one of'),
                ('podman --connection prod', 'not one of'),
                ('podman --hooks-dir /tmp/h', 'not one of'),
                ('podman inspect x', 'not one of'),
                ('podman --root', 'needs a value'),
                ('podman --root relative/dir', 'must be an absolute path'),
                ('podman --root=--remote', 'not a value'),
                ('podman --root "/a\tb"', 'not a value'),
                ('podman --root "/a\nb"', 'not a value'),
                ('podman --root /a\x01b', 'not a value'),
                ('podman --runtime "../runc"', "runtime's name"),
                ('podman --cgroup-manager bogus', 'one of cgroupfs, systemd'),
                ('podman --events-backend "file;x"', 'one of file'),
                ('podman --namespace a/b', 'not a name'),
                ('podman --root "/a', 'cannot split'),
                ('podman' + ' --root /r' * 20, 'more than 32 words'),
                ('podman --root /' + 'x' * 9000, 'longer than')):
            with self.assertRaises(ValueError, msg=raw) as cm:
                P.parse_command(raw)
            self.assertIn(why, str(cm.exception), raw)


FAKE = '''#!{python}
# a stand-in podman: records its arguments, then answers as the file "mode" says
import json, os, subprocess, sys, time
here = os.path.dirname(os.path.abspath(__file__))
if 'events' in sys.argv:
    with open(os.path.join(here, 'events-mode')) as f:
        mode = f.read()
    if mode == 'hostile':
        for line in ('not json', '[1]', '{{"Name": 5, "ID": "x"}}', '[' * 60000,
                     json.dumps(dict(Name='web', ID={ident!r}, Status='start'))):
            print(line, flush=True)
        time.sleep(0.5)
        print('x' * 70000, flush=True)
    elif mode == 'fails':
        print('Error: cannot read events with the "none" backend', file=sys.stderr)
        sys.exit(125)
    time.sleep(30)
    sys.exit(0)
with open(os.path.join(here, 'argv'), 'w') as f:
    f.write('\\n'.join(sys.argv[1:]))
with open(os.path.join(here, 'mode')) as f:
    mode = f.read()
ident = {ident!r}


def one(**state):
    st = dict(Status='running', Running=True, Pid={pid})
    st.update(state)
    print(json.dumps([dict(Id=ident, Name='web', State=st)]))


if mode == 'ok':
    one()
elif mode == 'absent':
    print('[]')
    print('Error: inspecting object: no such container web', file=sys.stderr)
    sys.exit(125)
elif mode == 'fails':
    sys.stderr.write('Error: \\x1b[31mdatabase is locked\\n' + 'x' * 100000)
    sys.exit(1)
elif mode == 'huge':
    sys.stdout.write('[' + ' ' * (3 << 20) + ']')
elif mode == 'slow':
    time.sleep(30)
elif mode == 'slowchild':
    subprocess.Popen(['sleep', '30'])
    time.sleep(30)
elif mode == 'notjson':
    print('{{"Id": ')
elif mode == 'deep':
    print('[' * 500000)
elif mode == 'two':
    print(json.dumps([{{}}, {{}}]))
elif mode == 'obj':
    print(json.dumps({{'Id': ident}}))
elif mode == 'badid':
    print(json.dumps([dict(Id='../../x', Name='web', State={{}})]))
elif mode == 'badname':
    print(json.dumps([dict(Id=ident, Name='a/b', State={{}})]))
elif mode == 'nostate':
    print(json.dumps([dict(Id=ident, Name='web', State=[])]))
elif mode.startswith('pid='):
    one(Pid=json.loads(mode[4:]))
elif mode == 'created':
    one(Status='created', Running=False, Pid=0)
elif mode == 'badstatus':
    one(Status='run ning\\n')
'''


class FakePodmanTest(unittest.TestCase):
    """What the arbiter makes of a podman that answers nonsense.  podman
    itself cannot be made to: the stand-in is a script given as the
    podman-command's program (an absolute path), and isolates the
    handling of its output."""

    def setUp(self):
        self.d = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.d, True)
        self.prog = os.path.join(self.d, 'podman')
        self.mode = os.path.join(self.d, 'mode')
        self.write_fake(ID, os.getpid())

    def write_fake(self, ident, pid):
        with open(self.prog, 'w') as f:
            f.write(FAKE.format(python=sys.executable, ident=ident, pid=pid))
        os.chmod(self.prog, 0o755)

    def ask(self, mode, timeout=10.0, ref='web'):
        with open(self.mode, 'w') as f:
            f.write(mode)
        return P.resolve([self.prog, '--root', '/nonexistent'], ref, timeout)

    def refused(self, mode, kind, *words, timeout=10.0):
        with self.assertRaises(P.PodmanError, msg=mode) as cm:
            self.ask(mode, timeout)
        self.assertEqual(cm.exception.kind, kind, (mode, str(cm.exception)))
        for w in words:
            self.assertIn(w, str(cm.exception), mode)
        return str(cm.exception)

    def test_arguments_after_double_dash_no_shell(self):
        """The name goes after '--' (never an option), as one argument."""
        self.refused('absent', 'absent', 'no such container web')
        with open(os.path.join(self.d, 'argv')) as f:
            self.assertEqual(f.read().split('\n'), ['--root', '/nonexistent', 'container',
                                                     'inspect', '--', 'web'])
        for ref in ('-x', '--remote', 'a b', '$(touch /tmp/p)', 'a;b', '../x', 'x' * 254, ''):
            with self.assertRaisesRegex(P.PodmanError, 'not a container name or id'):
                self.ask('ok', ref=ref)

    def test_a_pid_that_is_not_the_containers(self):
        """podman names a live pid (this test's) whose group does not
        name the container: refused."""
        self.refused('ok', 'error', 'does not name container')

    def test_stopped_and_missing_are_waited_for(self):
        self.refused('created', 'stopped', 'not running (status created)')
        self.refused('absent', 'absent')

    def test_bounded_output_and_time(self):
        self.refused('huge', 'error', f'more than {P.MAX_OUTPUT} bytes')
        for mode in ('slow', 'slowchild'):
            t0 = time.monotonic()
            self.refused(mode, 'error', 'no answer within 1 s', timeout=1.0)
            self.assertLess(time.monotonic() - t0, 5)
        msg = self.refused('fails', 'error', 'failed (1)')
        self.assertLess(len(msg), 500)
        self.assertNotIn('\x1b', msg)

    def test_events_stream_hostile_and_failing(self):
        """podman events' lines are bounded and checked: lines that are not
        an object with a string Name and ID are skipped, a line over 64 KiB
        ends the stream, which is started again, its reason logged; a
        podman that cannot give events (the "none" backend) is an error
        in the stream's state, retried with a back-off, not a crash."""
        with open(os.path.join(self.d, 'events-mode'), 'w') as f:
            f.write('hostile')
        seen, log = [], Recorder()
        ev = P.Events([self.prog], lambda n, i: seen.append((n, i)), log)
        ev.start()
        self.addCleanup(ev.stop)
        A.wait_for(ev.status, lambda s: s['restarts'] >= 1, 10, 'the stream ended')
        st = ev.status()
        self.assertEqual(seen[:1], [('web', ID)])
        self.assertEqual(st['skipped'], 4)
        self.assertEqual(st['state'], 'error')
        self.assertIn('a line of more than 65536 bytes', st['error'])
        with open(os.path.join(self.d, 'events-mode'), 'w') as f:
            f.write('fails')
        A.wait_for(ev.status, lambda s: 'none" backend' in (s['error'] or ''), 15,
                   'the failing stream')
        errs = [r['error'] for r in log if r.get('event') == 'podman-events' and r['error']]
        self.assertEqual(len(errs), len(set(errs)), 'one log line per change')
        self.assertIn('podman events exited (125): Error: cannot read events with the "none" '
                      'backend', errs)

    def test_malformed_answers(self):
        for mode, words in (('notjson', 'not JSON'), ('deep', 'not JSON'),
                            ('two', 'not a list of one'),
                            ('obj', 'not a list of one'), ('badid', 'Id is not 64 hex'),
                            ('badname', 'Name is not'), ('nostate', 'State is not an object'),
                            ('badstatus', 'State.Status'),
                            ('pid=true', 'State.Pid is not an integer'),
                            ('pid="1"', 'State.Pid is not an integer'),
                            ('pid=1.5', 'State.Pid is not an integer'),
                            ('pid=0', 'outside [1, 4194304]'),
                            ('pid=-1', 'outside [1, 4194304]'),
                            ('pid=1099511627776', 'outside [1, 4194304]')):
            self.refused(mode, 'error', words)


@unittest.skipIf(WHY, WHY)
class RealPodmanTest(unittest.TestCase):
    """Real containers: found by name and id at the groups podman made."""

    def setUp(self):
        self.pm = A.podman()
        self.image = self.pm.image()
        self.cmd = self.pm.argv()
        self.name = f'arbpm-{os.getpid()}-{self.id().rsplit(".", 1)[-1][5:20]}'
        self.addCleanup(self.pm.rm, self.name)

    def sleeper(self, *extra):
        self.pm.rm(self.name)
        self.pm.run('run', '-d', '--name', self.name, '--network', 'none', *extra,
                    self.image, 'sleep', '300')
        return self.pm.inspect(self.name)

    def test_found_by_name_and_by_id(self):
        """The name, the full id and a 12-digit id all lead to the
        container's own groups: the blkio group podman made for it
        (libpod_parent/libpod-ID, the cgroupfs manager's layout), holding
        its init pid, and its v2 group for io.pressure."""
        info = self.sleeper()
        cid, pid = info['Id'], info['State']['Pid']
        blkio = f'/sys/fs/cgroup/blkio/libpod_parent/libpod-{cid}'
        for ref in (self.name, cid, cid[:12]):
            f = P.resolve(self.cmd, ref, 30)
            self.assertEqual((f.id, f.name, f.pid, f.cgroup), (cid, self.name, pid, blkio), ref)
            with open(os.path.join(f.cgroup, 'cgroup.procs')) as fp:
                self.assertIn(str(pid), fp.read().split())
            if os.path.exists('/sys/fs/cgroup/unified/cgroup.controllers'):
                self.assertEqual(f.pressure,
                                 f'/sys/fs/cgroup/unified/libpod_parent/libpod-{cid}')
            self.assertTrue(P.still_there(f))

    def test_another_cgroup_parent(self):
        """--cgroup-parent: found where it is, not where it would be by
        default (the group is read from its pid, not guessed)."""
        parent = f'/hvarbiter-test-{os.getpid()}'
        self.addCleanup(A.remove_cgroup_tree, parent)
        self.addCleanup(self.pm.rm, self.name)      # before the groups go
        info = self.sleeper('--cgroup-parent', parent)
        f = P.resolve(self.cmd, self.name, 30)
        self.assertEqual(f.cgroup, f'/sys/fs/cgroup/blkio{parent}/libpod-{info["Id"]}')
        self.pm.rm(self.name)

    def test_not_running_and_missing(self):
        with self.assertRaises(P.PodmanError) as cm:
            P.resolve(self.cmd, self.name, 30)
        self.assertEqual(cm.exception.kind, 'absent')
        self.assertIn(f'no such container {self.name}', str(cm.exception))
        self.pm.run('create', '--name', self.name, '--network', 'none', self.image, 'true')
        with self.assertRaises(P.PodmanError) as cm:
            P.resolve(self.cmd, self.name, 30)
        self.assertEqual(cm.exception.kind, 'stopped')
        self.assertIn('not running (status created)', str(cm.exception))

    def test_watch_follows_a_restart_and_reports_a_removal(self):
        """The watch thread waits for a container that is not there yet,
        finds it when it runs, follows a restart (a new pid and group: a
        new generation) and reports a removal; each change logged once."""
        conf = types.SimpleNamespace(
            podman_command=self.cmd, podman_timeout=30.0,
            containers=[types.SimpleNamespace(name='db', podman=self.name)])
        log = Recorder()
        w = P.Watch(conf, log)
        w.start()
        self.addCleanup(w.stop)

        def state(pred, what, timeout=20):
            return A.wait_for(lambda: w.get('db'), lambda g: pred(*g), timeout, what)

        state(lambda f, gen, why: f is None and 'no such container' in why, 'waiting')
        info = self.sleeper()
        f1, gen1, _ = state(lambda f, gen, why: f is not None, 'found')
        self.assertEqual((f1.id, f1.pid), (info['Id'], info['State']['Pid']))
        self.pm.run('restart', '-t', '0', self.name)
        pid2 = self.pm.inspect(self.name)['State']['Pid']
        self.assertNotEqual(pid2, f1.pid)
        f2, gen2, _ = state(lambda f, gen, why: f is not None and f.pid == pid2, 'restart seen')
        self.assertGreater(gen2, gen1)
        self.assertEqual(f2.id, f1.id)
        self.pm.rm(self.name)
        state(lambda f, gen, why: f is None and 'no such container' in why, 'removal seen')
        st = w.status()['db']
        self.assertEqual((st['state'], st['podman']), ('waiting', self.name))
        states = [(r['state'], r.get('pid')) for r in log if r.get('event') == 'container']
        # (the restart may be seen half-way: stopped, waited for, then found)
        self.assertEqual(states[0], ('waiting', None), log)
        self.assertEqual([p for s, p in states if s == 'found'], [f1.pid, pid2], log)
        self.assertEqual(states[-1], ('waiting', None), log)


class RealEventsTest(unittest.TestCase):
    """The watch, told by podman's events, finds a container when it
    starts rather than at its next retry."""

    def setUp(self):
        self.pm = A.podman()
        self.image = self.pm.image()
        self.name = f'arbpe-{os.getpid()}'
        self.addCleanup(self.pm.rm, self.name)
        self.log = Recorder()
        conf = types.SimpleNamespace(
            podman_command=self.pm.argv(), podman_timeout=30.0,
            containers=[types.SimpleNamespace(name='db', podman=self.name)])
        self.w = P.Watch(conf, self.log)
        self.w.start()
        self.addCleanup(self.w.stop)

    def test_found_on_its_start_event(self):
        """With the events running, the retries of a container that is not
        there back off (0.5, 1, 2, 4, 8 s ...): one started 9 s in is found
        by its start event within 2 s, long before the next retry (15.5 s
        in), and the log says so (via: event)."""
        t0 = time.monotonic()
        A.wait_for(self.w.events.status, lambda s: s['state'] == 'running', 20, 'events')
        time.sleep(max(0.0, t0 + 9 - time.monotonic()))
        self.pm.run('run', '-d', '--name', self.name, '--network', 'none', self.image,
                    'sleep', '300')
        t1 = time.monotonic()
        A.wait_for(lambda: self.w.get('db')[0], lambda f: f is not None, 5, 'found')
        self.assertLess(time.monotonic() - t1, 2.0)
        found = [r for r in self.log if r.get('event') == 'container' and r['state'] == 'found']
        self.assertEqual([r['via'] for r in found], ['event'], self.log)

    def test_a_killed_event_stream_is_started_again(self):
        """The events' podman killed: logged, started again, running."""
        A.wait_for(self.w.events.status, lambda s: s['state'] == 'running', 20, 'events')
        pid = self.w.events.proc.pid
        os.killpg(pid, 9)
        st = A.wait_for(self.w.events.status, lambda s: s['restarts'] == 1 and
                        s['state'] == 'running', 20, 'events again')
        self.assertIsNone(st['error'])
        self.assertNotEqual(self.w.events.proc.pid, pid)
        died = [r for r in self.log if r.get('event') == 'podman-events' and r['error']]
        self.assertEqual(len(died), 1, self.log)
        self.assertIn('podman events exited (-9)', died[0]['error'])


def loop_unavailable():
    if WHY:
        return WHY
    if not shutil.which('losetup'):
        return 'losetup is not installed'
    return None


@unittest.skipIf(loop_unavailable(), loop_unavailable())
class DaemonPodmanTest(A.LoopTestCase):
    """The daemon given `podman = NAME`: a fio container on the loop
    device.  Its VM is a FakeQMP peer (no guest: test_guest_arbiter*.py
    have one); what is checked is the containers' side."""

    def setUp(self):
        self.name = f'arbpd-{os.getpid()}'
        self.peer = FakeQMP(self.tmp(f'{self.id().rsplit(".", 1)[-1]}-vm0.qmp'))
        self.addCleanup(self.peer.close)
        self.ctrs = []
        self.addCleanup(lambda: [c.stop() for c in self.ctrs])

    def fio(self, seconds):
        c = A.container(self.tmp, self.name, self.loop.dev, seconds, qd=1)
        self.ctrs.append(c)
        return c

    def test_container_by_name_measured_lost_and_found_again(self):
        conf = A.config(self.tmp, self.loop.dev, [('vm0', self.peer.path)], [self.name],
                        target_ms=1000)
        r = subprocess.run([sys.executable, A.HVARBITER, 'check', conf], capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(f'[container {self.name}] podman {self.name}: waiting: podman: no such '
                      f'container {self.name}', r.stdout)
        d = A.Daemon(conf, self.tmp)
        self.addCleanup(d.close)
        st = d.wait(lambda s: s.get('periods', 0) > 3, what='periods')
        self.assertIn('no such container', st['container_errors'][self.name])
        self.assertEqual(st['podman'][self.name]['state'], 'waiting')

        def measured(cid):
            st = d.wait(lambda s: s['podman'][self.name].get('id') == cid and
                        s['container']['iops'] > 50 and self.name not in s['container_errors'],
                        what=f'container {cid[:12]} measured')
            p = st['podman'][self.name]
            self.assertEqual(p['cgroup'], f'/sys/fs/cgroup/blkio/libpod_parent/libpod-{cid}')
            self.assertIn(f'hvarbiter_container_up{{container="{self.name}"}} 1', d.ask('metrics'))
            return st

        c1 = self.fio(60)
        measured(c1.id)
        c1.stop()                   # podman rm -f: gone
        st = d.wait(lambda s: self.name in s['container_errors'], what='container gone')
        self.assertIsNone(d.proc.poll())
        self.assertIn(f'hvarbiter_container_up{{container="{self.name}"}} 0', d.ask('metrics'))
        c2 = self.fio(60)           # a new container of that name
        self.assertNotEqual(c2.id, c1.id)
        measured(c2.id)
        events = d.status()['podman_events']
        self.assertEqual(events['state'], 'running', events)
        self.assertEqual(d.terminate(), 0)
        self.assertFalse(os.path.exists(f'/proc/{events["pid"]}'), 'podman events outlived it')
        ev = [(r['state'], r.get('id')) for r in d.records() if r.get('event') == 'container']
        self.assertEqual(ev[0], ('waiting', None))
        self.assertIn(('found', c1.id), ev)
        self.assertEqual(ev[-1], ('found', c2.id))
        self.assertLess(ev.index(('found', c1.id)), ev.index(('found', c2.id)))
        self.assertIn('waiting', [s for s, _ in ev[ev.index(('found', c1.id)):]])


    def test_killed_daemon_takes_its_podman_events_along(self):
        """The daemon SIGKILLed: its podman events process dies with it
        (it would otherwise wait for the next container event to notice)."""
        conf = A.config(self.tmp, self.loop.dev, [('vm0', self.peer.path)], [self.name],
                        target_ms=1000, state='killed')
        d = A.Daemon(conf, self.tmp, state='killed')
        self.addCleanup(d.close)
        pid = d.wait(lambda s: s['podman_events']['state'] == 'running',
                     what='podman events')['podman_events']['pid']
        self.assertTrue(os.path.exists(f'/proc/{pid}'))
        d.proc.kill()
        d.proc.wait()
        A.wait_for(lambda: os.path.exists(f'/proc/{pid}'), lambda x: not x, 5,
                   'podman events gone')

if __name__ == '__main__':
    unittest.main()
