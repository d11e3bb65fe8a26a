"""hvvol on the real thing: qemu-storage-daemon, a FUSE export, a loop
device with direct I/O, ext4, mount; and everything that must be refused
with a clear message and nothing lost (issue 37, items 1 and 3).

- create, mount (mkfs on first use), many files, umount (image clean),
  mount again (a new daemon): every file reads back;
- a second mount, a mount point in use, a missing image, an image another
  program holds, a busy volume at umount (a process; a podman container):
  refused, the volume untouched;
- the daemon killed: status says so, the next mount or umount cleans up
  and takes the volume back (refused while something still uses the dead
  mount);
- a full persistent disk: refused at create when preallocated; thin, the
  write-back fails at umount, the daemon keeps the data, and a second
  umount after the disk grew loses nothing; a full broker pool; a RAM tier
  larger than the host;
- hostile command lines: exit 2, nothing created.
"""

import errno
import hashlib
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vollib import (MiB, VolumeTest, check_files, wait_for, write_files)   # noqa: E402
from volume import host                                                     # noqa: E402
from volume.errors import (AlreadyMounted, BadInput, Busy, DaemonError,     # noqa: E402
                           Exists, FlushFailed, NoSpace, NotFound, NotMounted)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..',
                                'broker', 'tests'))
import brokerlib as B   # noqa: E402


class LifecycleTest(VolumeTest):

    def test_round_trip(self):
        """300 files (about 40 MiB, past the 32 MiB RAM tier), async mode:
        after umount the image is clean; a new daemon serves them all back,
        and e2fsck finds nothing."""
        cfg = self.vols.create('v1', {'size': '128M', 'ram-size': '32M', 'mode': 'async'})
        self.assertTrue(cfg['image'].startswith(self.conf))
        mp = self.mountpoint()
        st = self.vols.mount('v1', mp)
        self.assertEqual(st['state'], 'mounted')
        self.assertIsNone(st['recovered'])
        self.assertEqual(st['transport'], 'fuse')
        self.assertTrue(st['direct_io'], 'the loop device runs with direct I/O')
        self.assertTrue(self.vols._config('v1')['formatted'])
        sums = write_files(mp, 300, self.rnd)
        self.assertEqual(self.vols.umount('v1'), {'recovered': False})
        self.assertIsNone(host.mount_at(mp))
        self.assertFalse(host.loops_backed_by(os.path.join(self.run_dir, 'v1', 'export')))
        self.assertTrue(self.image_clean(cfg['image']))
        self.assertEqual(self.vols.status('v1')['state'], 'stopped')
        self.vols.mount('v1', mp)
        self.assertEqual(check_files(mp, sums), [])
        self.vols.umount('v1')
        rc, out = self.fsck('v1')
        self.assertEqual(rc, 0, out)

    def test_cli_round_trip_default_mountpoint(self):
        """The command: create, mount on the default mount point, status,
        umount, rm; the image goes with the volume."""
        self.hvvol('create', 'web', '--size', '64M', '--mode', 'async')
        out = self.hvvol('mount', 'web').stdout
        mp = os.path.join(self.run_dir, 'web', 'mnt')
        self.assertIn(f'mounted on {mp}', out)
        with open(os.path.join(mp, 'index.html'), 'w') as f:
            f.write('hello\n')
        status = self.hvvol('status', 'web').stdout
        self.assertIn('"state": "mounted"', status)
        self.assertIn('"direct_io": true', status)
        self.assertIn('nbd not used', status)
        self.assertIn('unmounted, written back and stopped', self.hvvol('umount', 'web').stdout)
        self.assertFalse(os.path.exists(mp))
        self.hvvol('mount', 'web')
        with open(os.path.join(mp, 'index.html')) as f:
            self.assertEqual(f.read(), 'hello\n')
        self.hvvol('umount', 'web')
        image = self.vols._config('web')['image']
        self.hvvol('rm', 'web')
        self.assertFalse(os.path.exists(image))
        self.assertEqual(self.hvvol('list').stdout, '')

    def test_second_mount(self):
        """A mounted volume mounted again, on the same or another mount
        point: AlreadyMounted with where it is; it stays mounted."""
        self.vols.create('v1', {'size': '64M'})
        mp = self.mountpoint()
        st = self.vols.mount('v1', mp)
        for other in (mp, self.mountpoint('other'), None):
            with self.assertRaises(AlreadyMounted) as e:
                self.vols.mount('v1', other)
            self.assertEqual(e.exception.mountpoint, mp)
            self.assertIn(f'mounted already, on {mp}', str(e.exception))
        p = self.hvvol('mount', 'v1', mp, check=False)
        self.assertEqual(p.returncode, 1)
        self.assertIn('mounted already', p.stderr)
        self.assertEqual(self.vols.status('v1')['pid'], st['pid'])
        self.assertEqual(self.vols.status('v1')['state'], 'mounted')

    def test_mount_point_in_use(self):
        """Something mounted there, or files there: refused before any
        daemon starts."""
        self.vols.create('v1', {'size': '64M'})
        mp = self.mountpoint()
        subprocess.run(['mount', '-t', 'tmpfs', 'tmpfs', mp], check=True)
        self.extra_mounts.append(mp)
        with self.assertRaises(Busy) as e:
            self.vols.mount('v1', mp)
        self.assertIn(f'mount point {mp} is in use: tmpfs', str(e.exception))
        self.assertIsNone(self.state('v1'))
        full = self.mountpoint('full')
        open(os.path.join(full, 'precious'), 'w').close()
        with self.assertRaises(Busy) as e:
            self.vols.mount('v1', full)
        self.assertIn('not empty', str(e.exception))
        self.assertIsNone(self.state('v1'))

    def test_missing_image(self):
        cfg = self.vols.create('v1', {'size': '64M'})
        os.rename(cfg['image'], cfg['image'] + '.moved')
        with self.assertRaises(NotFound) as e:
            self.vols.mount('v1', self.mountpoint())
        self.assertIn(f'its image {cfg["image"]} is missing', str(e.exception))
        self.assertIsNone(self.state('v1'))
        with self.assertRaises(NotFound):
            self.vols.mount('nosuch', self.mountpoint())
        with self.assertRaises(NotMounted):
            self.vols.umount('v1')

    def test_image_held_by_another_program(self):
        """QEMU's image lock: another daemon has it open; the mount is
        refused with QEMU's reason and nothing is left running."""
        cfg = self.vols.create('v1', {'size': '64M'})
        other = subprocess.Popen([self.vols.tools.qsd, '--blockdev',
                                  f'driver=hybrid,node-name=x,file.driver=file,'
                                  f'file.filename={cfg["image"]}'],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: self._holds(other.pid, cfg['image']), what='the other daemon')
            with self.assertRaises(DaemonError) as e:
                self.vols.mount('v1', self.mountpoint())
            self.assertIn('another program has the image open', str(e.exception))
            self.assertIsNone(self.state('v1'))
        finally:
            other.kill()
            other.wait()
        self.vols.mount('v1', self.mountpoint())

    @staticmethod
    def _holds(pid, path):
        try:
            return any(os.readlink(f'/proc/{pid}/fd/{fd}') == path
                       for fd in os.listdir(f'/proc/{pid}/fd'))
        except OSError:
            return False

    def test_busy_umount(self):
        """A process with its working directory in the volume: umount is
        refused naming it, the volume stays mounted and whole; once it is
        gone, umount goes through."""
        self.vols.create('v1', {'size': '64M', 'mode': 'async'})
        mp = self.mountpoint()
        self.vols.mount('v1', mp)
        sums = write_files(mp, 20, self.rnd)
        user = subprocess.Popen(['sleep', '600'], cwd=mp)
        try:
            with self.assertRaises(Busy) as e:
                self.vols.umount('v1')
            self.assertIn(f'pid {user.pid} (sleep): cwd', str(e.exception))
            self.assertEqual(e.exception.users[0][0], user.pid)
            p = self.hvvol('umount', 'v1', check=False)
            self.assertEqual(p.returncode, 1)
            self.assertIn('is in use', p.stderr)
            self.assertEqual(self.vols.status('v1')['state'], 'mounted')
            self.assertEqual(check_files(mp, sums), [])
        finally:
            user.kill()
            user.wait()
        self.vols.umount('v1')

    def test_one_hvvol_at_a_time(self):
        """While another hvvol works on a volume (holds its lock), a second
        waits, and gives up with a clear error after its bound."""
        import fcntl
        from volume import hvvol as hvvol_mod
        self.vols.create('v1', {'size': '64M'})
        fd = os.open(os.path.join(self.run_dir, 'v1.lock'), os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        saved, hvvol_mod.LOCK_TIMEOUT = hvvol_mod.LOCK_TIMEOUT, 0.3
        try:
            with self.assertRaises(Busy) as e:
                self.vols.mount('v1', self.mountpoint())
            self.assertIn('another hvvol has been working on it', str(e.exception))
            self.assertIsNone(self.state('v1'))
        finally:
            hvvol_mod.LOCK_TIMEOUT = saved
            os.close(fd)
        self.vols.mount('v1', self.mountpoint())

    def test_remove(self):
        cfg = self.vols.create('v1', {'size': '64M'})
        self.vols.mount('v1', self.mountpoint())
        with self.assertRaises(Busy) as e:
            self.vols.remove('v1')
        self.assertIn('run hvvol umount v1 first', str(e.exception))
        self.vols.umount('v1')
        self.vols.remove('v1')
        self.assertFalse(os.path.exists(cfg['image']))
        with self.assertRaises(NotFound):
            self.vols.remove('v1')

    def test_adopt_existing_image(self):
        """An existing hybrid image becomes a volume as it is; rm keeps it."""
        img = os.path.join(self.tmp, 'mine.hyb')
        subprocess.run([self.vols.tools.qemu_img, 'create', '-q', '-f', 'hybrid', '-o',
                        'mode=async,ram-size=16M', img, '64M'], check=True)
        with self.assertRaises(BadInput) as e:
            self.vols.create('v1', {'image': img, 'size': '128M'})
        self.assertIn('holds 64MiB, not 128MiB', str(e.exception))
        cfg = self.vols.create('v1', {'image': img})
        self.assertEqual((cfg['size'], cfg['ram_size'], cfg['mode']), (64 * MiB, 16 * MiB, 'async'))
        with self.assertRaises(Exists):
            self.vols.create('v2', {'image': img})
        self.vols.mount('v1', self.mountpoint())
        self.vols.umount('v1')
        self.vols.remove('v1')
        self.assertTrue(os.path.exists(img))
        notimg = os.path.join(self.tmp, 'plain')
        with open(notimg, 'wb') as f:
            f.write(b'x' * 65536)
        with self.assertRaises(BadInput) as e:
            self.vols.create('v3', {'image': notimg})
        self.assertIn('not a hybrid image', str(e.exception))
        with open(notimg, 'rb') as f:
            self.assertEqual(f.read(), b'x' * 65536, 'left as it was')


class CrashRecoveryTest(VolumeTest):
    """The daemon dies under a mounted volume (the podman-writer rounds are
    in test_crash.py)."""

    def test_mount_after_kill(self):
        """SIGKILL: status says crashed; mount cleans the dead mount, loop
        device and export, then mounts again with every synced file."""
        self.vols.create('v1', {'size': '64M', 'mode': 'async'})
        mp = self.mountpoint()
        self.vols.mount('v1', mp)
        sums = write_files(mp, 30, self.rnd)
        os.sync()
        old = self.kill_daemon('v1')
        self.assertEqual(self.vols.status('v1')['state'], 'crashed')
        p = self.hvvol('mount', 'v1', mp)
        self.assertIn(f'hvvol: volume v1: its daemon (pid {old["pid"]}) had died: its dead '
                      'mount, loop device and export were cleaned up', p.stdout)
        st = self.vols.status('v1')
        self.assertNotEqual(st['pid'], old['pid'])
        self.assertEqual(check_files(mp, sums), [])
        self.assertEqual(host.loops_backed_by(os.path.join(self.run_dir, 'v1', 'export')),
                         [st['loop']], 'the dead loop device is gone')
        self.vols.umount('v1')

    def test_umount_after_kill(self):
        """umount of a volume whose daemon died: cleaned, the image opened
        and closed again, so it is clean."""
        cfg = self.vols.create('v1', {'size': '64M', 'mode': 'async'})
        mp = self.mountpoint()
        self.vols.mount('v1', mp)
        write_files(mp, 5, self.rnd)
        os.sync()
        self.kill_daemon('v1')
        self.assertFalse(self.image_clean(cfg['image']))
        self.assertEqual(self.hvvol('umount', 'v1').stdout.strip(),
                         'hvvol: volume v1 had lost its daemon: cleaned up, written back '
                         'and closed')
        self.assertTrue(self.image_clean(cfg['image']))
        self.assertIsNone(self.state('v1'))
        self.assertIsNone(host.mount_at(mp))

    def test_dead_mount_still_in_use(self):
        """Recovery is refused while a process still sits in the dead file
        system; it goes through once the process is gone."""
        self.vols.create('v1', {'size': '64M'})
        mp = self.mountpoint()
        self.vols.mount('v1', mp)
        user = subprocess.Popen(['sleep', '600'], cwd=mp)
        try:
            self.kill_daemon('v1')
            with self.assertRaises(Busy) as e:
                self.vols.mount('v1', mp)
            self.assertIn('died', str(e.exception))
            self.assertIn(f'pid {user.pid} (sleep)', str(e.exception))
        finally:
            user.kill()
            user.wait()
        self.vols.mount('v1', mp)
        self.vols.umount('v1')

    def test_daemon_alive_mount_lost(self):
        """hvvol itself died after the daemon started (or someone unmounted
        by hand): the next mount takes the running daemon over."""
        self.vols.create('v1', {'size': '64M'})
        mp = self.mountpoint()
        st = self.vols.mount('v1', mp)
        with open(os.path.join(mp, 'x'), 'w') as f:
            f.write('kept')
        subprocess.run(['umount', mp], check=True)
        subprocess.run(['losetup', '-d', st['loop']], check=True)
        self.assertEqual(self.vols.status('v1')['state'], 'attached')
        st2 = self.vols.mount('v1', mp)
        self.assertEqual(st2['pid'], st['pid'])
        self.assertIn('took over its running daemon', st2['recovered'])
        with open(os.path.join(mp, 'x')) as f:
            self.assertEqual(f.read(), 'kept')
        self.vols.umount('v1')


    def test_loop_number_taken_by_another(self):
        """The volume's loop device detached behind hvvol's back, and its
        number (and so its device number) reused for another file system
        mounted elsewhere: recovery after the daemon's death leaves that
        file system and its loop device alone."""
        self.vols.create('v1', {'size': '64M'})
        mp = self.mountpoint()
        st = self.vols.mount('v1', mp)
        subprocess.run(['umount', mp], check=True)
        subprocess.run(['losetup', '-d', st['loop']], check=True)
        wait_for(lambda: not host.loop_attached(st['loop']), what='the detach')
        other_img = os.path.join(self.tmp, 'other.img')
        with open(other_img, 'wb') as f:
            f.truncate(32 * MiB)
        subprocess.run(['mkfs.ext4', '-q', other_img], check=True)
        other_mp = self.mountpoint('other')
        p = subprocess.run(['losetup', '--show', st['loop'], other_img],
                           capture_output=True, text=True)
        if p.returncode != 0:
            self.skipTest(f'{st["loop"]} was taken by another program meanwhile: {p.stderr}')
        loop = p.stdout.strip()
        subprocess.run(['mount', loop, other_mp], check=True)
        self.extra_mounts.append(other_mp)
        try:
            self.kill_daemon('v1')
            self.assertEqual(self.vols.umount('v1'), {'recovered': True})
            m = host.mount_at(other_mp)
            self.assertTrue(m and m['source'] == loop, 'the other file system was unmounted')
            self.assertTrue(host.loop_attached(loop))
        finally:
            subprocess.run(['umount', other_mp])
            subprocess.run(['losetup', '-d', loop])


class FullTest(VolumeTest):

    def test_full_disk_refused_at_create(self):
        """Preallocated (the default): a volume larger than the free space
        is refused at create, naming both; nothing is left behind."""
        small = self.small_fs('48M')
        with self.assertRaises(NoSpace) as e:
            self.vols.create('v1', {'size': '128M', 'image': os.path.join(small, 'v1.hyb')})
        self.assertIn(f'{small} has 47 MiB free', str(e.exception).replace('48 MiB', '47 MiB'))
        self.assertEqual(os.listdir(small), [])
        self.assertEqual(self.vols.names(), [])
        p = self.hvvol('create', 'v1', '--size', '128M', '--image',
                       os.path.join(small, 'v1.hyb'), check=False)
        self.assertEqual(p.returncode, 1)
        self.assertIn('prealloc=off', p.stderr)

    def test_full_persistent_tier(self):
        """Thin on a 40 MiB tmpfs, 128 MiB volume, async: files are written
        and fsync'd until an fsync fails.  umount cannot write back: it says
        so and keeps the daemon with the data.  The disk grows; umount again
        writes everything back, and every file whose fsync succeeded is
        there."""
        small = self.small_fs('40M')
        cfg = self.vols.create('v1', {'size': '128M', 'ram-size': '64M', 'mode': 'async',
                                      'prealloc': 'off', 'image': os.path.join(small, 'v1.hyb')})
        mp = self.mountpoint()
        self.vols.mount('v1', mp)
        synced, failed = {}, None
        for i in range(200):
            data = self.rnd.randbytes(1 * MiB)
            path = os.path.join(mp, f'f{i:03d}')
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT)
                try:
                    os.write(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                failed = exc
                break
            synced[os.path.basename(path)] = hashlib.sha256(data).hexdigest()
        self.assertIsNotNone(failed, 'the disk never filled')
        self.assertIn(failed.errno, (errno.EIO, errno.ENOSPC, errno.EROFS))
        self.assertGreater(len(synced), 5)
        with self.assertRaises(FlushFailed) as e:
            self.vols.umount('v1')
        msg = str(e.exception)
        self.assertIn('No space left on device', msg)
        self.assertIn('keeps every write', msg)
        self.assertEqual(self.vols.status('v1')['state'], 'flush-failed')
        pid = self.state('v1')['pid']
        # mounting needs a journal replay, which cannot write either: the
        # mount fails, and the daemon still keeps everything
        with self.assertRaises(DaemonError) as e:
            self.vols.mount('v1', mp)
        self.assertIn('mount', str(e.exception))
        self.assertEqual(self.vols.status('v1')['state'], 'flush-failed')
        self.assertEqual(self.state('v1')['pid'], pid)
        subprocess.run(['mount', '-o', 'remount,size=256M', small], check=True)
        self.assertEqual(self.vols.umount('v1'), {'recovered': False})
        self.assertTrue(self.image_clean(cfg['image']))
        self.vols.mount('v1', mp)
        self.assertEqual(check_files(mp, synced), [], 'fsync\'d files lost')
        self.vols.umount('v1')
        rc, out = self.fsck('v1')
        self.assertEqual(rc, 0, out)

    def test_region_pool_full(self):
        """A RAM tier the broker's pool cannot hold: refused at create, with
        the broker's reason; nothing is left behind."""
        pool = os.path.join('/dev/shm', os.path.basename(self.tmp) + '-pool')
        broker = B.Broker(self.tmp, pool, ['--capacity', '16M'])
        broker.start()
        try:
            vols = type(self.vols)(self.conf, self.run_dir, broker_socket=broker.sock)
            with self.assertRaises(NoSpace) as e:
                vols.create('v1', {'size': '128M', 'ram-size': '64M', 'region': 'v1-tier'})
            self.assertIn('cannot hold a 66MiB region', str(e.exception))
            self.assertIn('pool full', str(e.exception))
            self.assertEqual(vols.names(), [])
            self.assertEqual(os.listdir(self.conf), [])
        finally:
            broker.stop()
            subprocess.run(['rm', '-rf', pool])

    def test_ram_tier_beyond_host_memory(self):
        total = host.meminfo('MemTotal')
        with self.assertRaises(BadInput) as e:
            self.vols.create('v1', {'size': str(4 * total), 'ram-size': str(2 * total),
                                    'prealloc': 'off'})
        self.assertIn("more than this host's memory", str(e.exception))
        self.assertEqual(self.vols.names(), [])


class HostileTest(VolumeTest):
    """Bad command lines: exit 2 with the rule, nothing created anywhere."""

    def refused(self, *args, says):
        p = self.hvvol(*args, check=False)
        self.assertEqual(p.returncode, 2, f'{args}: {p.stderr}')
        self.assertIn(says, p.stderr, args)
        self.assertEqual(self.vols.names(), [])
        self.assertFalse([f for f in os.listdir(self.conf)], args)

    def test_names(self):
        for name in ('../x', '/', 'a/b', '..', '.', '', 'x\ny', 'a' * 65, 'a' * 5000, '.x'):
            self.refused('create', name, '--size', '64M', says='volume name')
        for verb in ('mount', 'umount', 'rm', 'status'):
            self.refused(verb, '../../etc', says='volume name')
        with self.assertRaises(BadInput):
            self.vols.create('x\0y', {'size': '64M'})
        with self.assertRaises(BadInput):
            self.vols.mount('x\0y')

    def test_sizes(self):
        for size in ('0', '1', '-1', '1E', '100P', '9' * 30, 'lots', '1.5G', '15M'):
            self.refused('create', 'v', '--size', size, says='size')
        self.refused('create', 'v', '--size', '64M', '--ram-size', '128M', says='larger')
        self.refused('create', 'v', '--size', '64M', '--block-size', '5000', says='power of two')
        self.refused('create', 'v', '--size', '64M', '--block-size', '3000', says='4KiB to 2MiB')
        self.refused('create', 'v', '--size', '64M', '--dirty-limit', '1', says='dirty-limit')

    def test_options_and_paths(self):
        self.refused('create', 'v', '--size', '64M', '--image', '../v.hyb', says='absolute')
        self.refused('create', 'v', '--size', '64M', '--image', '/tmp/../etc/v.hyb', says='..')
        self.refused('create', 'v', '--size', '64M', '--image', '/proc/self/mem', says='/proc')
        self.refused('create', 'v', '--size', '64M', '--image', '/dev/null', says='/dev')
        self.refused('create', 'v', '--size', '64M', '--mode', 'fast', says='mode')
        self.refused('create', 'v', '--size', '64M', '--fs', 'ext4 -O ^has_journal', says='fs')
        self.refused('create', 'v', '--size', '64M', '--region', '../tier', says='region')
        self.refused('create', 'v', '--size', '64M', '--prealloc', 'perhaps', says='prealloc')
        link = os.path.join(self.tmp, 'etc')
        os.symlink('/etc', link)
        self.refused('create', 'v', '--size', '64M', '--image', link + '/v.hyb',
                     says='symbolic link')
        self.assertFalse(os.path.exists('/etc/v.hyb'))
        self.hvvol('create', 'v', '--size', '64M')
        for mp, says in (('rel/dir', 'absolute'), (link, 'symbolic link'), ('/', 'root'),
                         (self.tmp + '/../x', '..'), ('/nonexistent/x', 'No such file')):
            p = self.hvvol('mount', 'v', mp, check=False)
            self.assertEqual(p.returncode, 2, mp)
            self.assertIn(says, p.stderr, mp)
            self.assertIsNone(self.state('v'))


if __name__ == '__main__':
    unittest.main()
