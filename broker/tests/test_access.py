"""Who may do what with a region, across real processes: data written through
one process's read-write mapping is read through another's read-only one; a
read-only descriptor cannot be mapped writable; one read-write owner at a
time, its lease gone with its process; mode bits refuse other uids;
only the owner changes permissions or destroys; destroy waits for the last
attached client before the file goes; a new read-write owner waits until no
process can still write through an old descriptor."""

import errno
import os
import signal
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from brokerlib import HVMEM, LEASED, NOBODY, BrokerTestCase, wait_for  # noqa: E402

MiB = 1 << 20


class AccessTest(BrokerTestCase):

    def test_data_crosses_processes(self):
        """A writer's stores through its RW mapping are visible to a reader's
        RO mapping in another process, and vice versa the reader sees updates."""
        self.c.create('shared', 4 * MiB, 0o644)
        w, r = self.agent(), self.agent()
        self.assertEqual(w.ok(op='map', name='shared', rw=True)['accmode'], os.O_RDWR)
        self.assertEqual(r.ok(op='map', name='shared')['accmode'], os.O_RDONLY)
        w.ok(op='write', name='shared', offset=3 * MiB + 5, hex='deadbeef')
        self.assertEqual(r.ok(op='read', name='shared', offset=3 * MiB + 5,
                              len=4)['result'], 'deadbeef')
        w.ok(op='write', name='shared', offset=3 * MiB + 5, hex='01020304')
        self.assertEqual(r.ok(op='read', name='shared', offset=3 * MiB + 5,
                              len=4)['result'], '01020304')
        self.assertEqual(self.c.lookup('shared')['attached'], 2)

    def test_second_rw_owner_refused_lease_freed_on_kill(self):
        """While one process holds the read-write lease a second RW map is
        refused (EBUSY, naming the holder's pid) but RO maps work; SIGKILL of
        the holder releases the lease and the second process gets it."""
        self.c.create('r', 2 * MiB, 0o666)
        a, b = self.agent(), self.agent()
        a.ok(op='map', name='r', rw=True)
        info = self.c.lookup('r')
        self.assertEqual(info['flags'] & LEASED, LEASED)
        self.assertEqual(info['lease_pid'], a.pid)
        res = b.do(op='map', name='r', rw=True)
        self.assertEqual(res['errno'], errno.EBUSY)
        self.assertIn(f'pid {a.pid}', res['msg'])
        b.ok(op='map', name='r')
        a.kill()
        wait_for(lambda: not self.c.lookup('r')['flags'] & LEASED, what='lease release')
        self.assertEqual(b.ok(op='map', name='r', rw=True)['result']['lease_pid'], b.pid)
        self.assertHealthy()

    def test_release_hands_the_lease_on(self):
        """An explicit release lets another process become the RW owner; a
        connection without the lease cannot release it."""
        self.c.create('r', 2 * MiB)
        other = self.broker.client()
        _, fd = self.c.map('r', rw=True)
        os.close(fd)
        self.assertBrokerError(errno.EBUSY, other.map, 'r', True)
        self.assertBrokerError(errno.ENOLCK, other.release, 'r')
        self.c.release('r')
        _, fd = other.map('r', rw=True)
        os.close(fd)
        other.close()

    def test_readonly_descriptor_cannot_write(self):
        """A read-only client's descriptor is O_RDONLY: mmap(PROT_WRITE,
        MAP_SHARED) fails with EACCES and, as another uid, reopening it
        read-write through /proc fails too; the API refuses its writes."""
        self.c.create('ro', 2 * MiB, 0o644)
        r = self.agent(NOBODY)
        self.assertEqual(r.ok(op='map', name='ro')['accmode'], os.O_RDONLY)
        self.assertEqual(r.do(op='mmap_write', name='ro')['errno'], errno.EACCES)
        self.assertEqual(r.do(op='reopen_rw', name='ro')['errno'], errno.EACCES)
        self.assertEqual(r.do(op='map', name='ro', rw=True)['errno'], errno.EACCES)
        self.assertEqual(r.do(op='call', method='alloc', region='ro', item='i',
                              size=1)['errno'], errno.EACCES)
        self.assertEqual(r.do(op='call', method='resize', name='ro',
                              size=4 * MiB)['errno'], errno.EPERM)
        self.assertEqual(self.c.stat('ro')[0]['nitems'], 0)
        self.assertHealthy()

    def test_other_uid_refused_by_mode_bits(self):
        """Mode 0600 hides a region from another uid (lookup, map, stat
        refused, list omits it); 0604 lets it read but not write."""
        self.c.create('private', 2 * MiB, 0o600)
        n = self.agent(NOBODY)
        for method in ('lookup', 'stat'):
            res = n.do(op='call', method=method, name='private')
            self.assertEqual(res['errno'], errno.EACCES, res)
            self.assertIn('no read permission', res['msg'])
        self.assertEqual(n.do(op='map', name='private')['errno'], errno.EACCES)
        self.assertEqual(n.ok(op='call', method='list')['result'], [])
        self.c.chmod('private', 0o604)
        self.assertEqual(n.ok(op='call', method='lookup', name='private')['result']['mode'],
                         0o604)
        self.assertEqual(n.do(op='map', name='private', rw=True)['errno'], errno.EACCES)
        n.ok(op='map', name='private')
        self.assertHealthy()

    def test_group_class_by_supplementary_group(self):
        """The group bits apply to a client whose supplementary groups hold
        the region's gid (SO_PEERGROUPS), not only to its primary gid."""
        info = self.c.create('grp', 2 * MiB, 0o640)
        self.assertEqual(info['gid'], os.getgid())
        outsider = self.agent(NOBODY)
        member = self.agent(NOBODY, groups=[os.getgid()])
        self.assertEqual(outsider.do(op='call', method='lookup', name='grp')['errno'],
                         errno.EACCES)
        member.ok(op='map', name='grp')
        self.assertEqual(member.do(op='map', name='grp', rw=True)['errno'], errno.EACCES)
        self.assertHealthy()

    def test_owner_only_chmod_destroy(self):
        """Only the owner (or root) changes mode bits or destroys, even when
        the mode gives everyone write permission; an unprivileged owner does."""
        self.c.create('rootsr', 2 * MiB, 0o666)
        n = self.agent(NOBODY)
        for method, kw in (('chmod', dict(mode=0o666)), ('destroy', {})):
            res = n.do(op='call', method=method, name='rootsr', **kw)
            self.assertEqual(res['errno'], errno.EPERM, res)
            self.assertIn('not its owner', res['msg'])
        self.assertEqual(self.c.lookup('rootsr')['mode'], 0o666)
        mine = n.ok(op='call', method='create', name='mine', size=MiB)['result']
        self.assertEqual(mine['uid'], NOBODY)
        self.assertEqual(mine['mode'], 0o600)
        n.ok(op='call', method='chmod', name='mine', mode=0o640)
        n2 = self.agent(NOBODY - 1)
        self.assertEqual(n2.do(op='call', method='lookup', name='mine')['errno'],
                         errno.EACCES)
        self.assertEqual(n2.do(op='call', method='destroy', name='mine')['errno'],
                         errno.EPERM)
        n.ok(op='call', method='destroy', name='mine')
        self.assertHealthy()

    def test_destroy_waits_for_attached_clients(self):
        """Destroy removes the name at once; the file stays while a client that
        mapped it is connected (its data still readable) and goes when that
        client dies; the pool counts it until then."""
        info = self.c.create('victim', 2 * MiB, 0o644)
        path = self.broker.region_file(info['id'])
        a = self.agent()
        a.ok(op='map', name='victim', rw=True)
        a.ok(op='write', name='victim', offset=100, hex='cafe')
        self.c.destroy('victim')
        self.assertBrokerError(errno.ENOENT, self.c.lookup, 'victim')
        self.assertTrue(os.path.exists(path))
        self.assertEqual(self.c.pool()['used'], 2 * MiB)
        self.assertEqual(a.ok(op='read', name='victim', offset=100, len=2)['result'], 'cafe')
        # the name is free for a new region at once
        self.assertNotEqual(self.c.create('victim', MiB)['id'], info['id'])
        a.kill()
        wait_for(lambda: not os.path.exists(path), what='delayed free')
        self.assertEqual(self.c.pool()['used'], MiB)
        self.assertHealthy()

    def test_cli_map_runs_a_command_with_the_descriptor(self):
        """hvmem map NAME [--rw] -- CMD: CMD gets the descriptor in $HVMEM_FD
        (writable only with --rw) and the size in $HVMEM_SIZE; hvmem holds the
        lease while CMD runs, and its death releases it."""
        self.c.create('m', 2 * MiB, 0o644)
        self.hvmem('map', 'm', '--rw', '--', 'sh', '-c', 'printf hello >&$HVMEM_FD')
        _, fd = self.c.map('m')
        self.assertEqual(os.pread(fd, 5, 0), b'hello')
        os.close(fd)
        p = self.hvmem('map', 'm', '--', 'sh', '-c', 'printf x >&$HVMEM_FD', check=False)
        self.assertNotEqual(p.returncode, 0)
        self.hvmem('map', 'm', '--', 'sh', '-c', 'test "$HVMEM_SIZE" = %d' % (2 * MiB))
        # the first hvmem's hang-up reaches the broker asynchronously
        wait_for(lambda: not self.c.lookup('m')['flags'] & LEASED, what='lease release')
        holder = subprocess.Popen([HVMEM, '-s', self.broker.sock, 'map', 'm', '--rw',
                                   '--', 'sleep', '60'], start_new_session=True)
        try:
            wait_for(lambda: self.c.lookup('m')['lease_pid'] == holder.pid,
                     what='lease to the hvmem process')
            p = self.hvmem('map', 'm', '--rw', '--', 'true', check=False)
            self.assertEqual(p.returncode, 1)
            self.assertIn('already has a read-write owner', p.stderr)
            holder.kill()
            wait_for(lambda: not self.c.lookup('m')['flags'] & LEASED, what='lease release')
        finally:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
        # the killed group's sleep held the descriptor: gone, the lease is free
        wait_for(lambda: self.hvmem('map', 'm', '--rw', '--', 'true',
                                    check=False).returncode == 0, what='read-write map')
        self.assertHealthy()

    def test_no_new_writer_while_an_old_one_can_write(self):
        """After a release, another process's read-write map is refused with
        EBUSY (naming the last holder) while that holder still has the region
        open for writing, and granted once it lets go; the connection that
        released may take the lease back; read-only maps work throughout."""
        self.c.create('r', 2 * MiB, 0o666)
        a, b = self.agent(), self.agent(NOBODY)
        a.ok(op='map', name='r', rw=True)
        a.ok(op='call', method='release', name='r')
        res = b.do(op='map', name='r', rw=True)
        self.assertEqual(res.get('errno'), errno.EBUSY, res)
        self.assertIn('still open for writing', res['msg'])
        self.assertIn(f'pid {a.pid}', res['msg'])
        self.assertEqual(self.c.lookup('r')['flags'] & LEASED, 0)
        b.ok(op='map', name='r')
        a.ok(op='write', name='r', offset=0, hex='0a')     # what the refusal is for
        self.assertEqual(b.ok(op='read', name='r', offset=0, len=1)['result'], '0a')
        a.ok(op='map', name='r', rw=True)                  # its own lease back
        a.ok(op='call', method='release', name='r')
        a.ok(op='unmap', name='r')
        self.assertEqual(b.ok(op='map', name='r', rw=True)['result']['lease_pid'], b.pid)
        self.assertHealthy()

    def test_cli_command_keeps_the_region_writable(self):
        """hvmem map --rw killed while its COMMAND still holds the descriptor:
        the lease goes with hvmem, but no new read-write owner is admitted
        until COMMAND exits too."""
        self.c.create('m', 2 * MiB)
        holder = subprocess.Popen([HVMEM, '-s', self.broker.sock, 'map', 'm', '--rw',
                                   '--', 'sleep', '60'], start_new_session=True)
        try:
            wait_for(lambda: self.c.lookup('m')['lease_pid'] == holder.pid,
                     what='lease to the hvmem process')
            holder.kill()
            holder.wait()
            wait_for(lambda: not self.c.lookup('m')['flags'] & LEASED, what='lease release')
            p = self.hvmem('map', 'm', '--rw', '--', 'true', check=False)
            self.assertEqual(p.returncode, 1, p.stderr)
            self.assertIn('still open for writing', p.stderr)
        finally:
            os.killpg(holder.pid, signal.SIGKILL)
        wait_for(lambda: self.hvmem('map', 'm', '--rw', '--', 'true',
                                    check=False).returncode == 0, what='read-write map')
        self.assertHealthy()


if __name__ == '__main__':
    unittest.main()
