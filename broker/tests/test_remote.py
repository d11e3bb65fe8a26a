"""Remote clients (docs/broker.md, "Remote clients"): the broker decides, per
remote client, who may attach to an export of a region.

A remote client is an identity with a secret key in the broker's config,
acting as a local user; the region's mode bits judge it as they judge that
user's processes.  The exporter (`hvmem map --psk-dir`) gets, for the region
it mapped, a key per admitted client derived from that client's secret for
that region alone, and keeps QEMU's tls-creds-psk file current while the
export runs.  The tests try to get in: a client the mode does not admit, one
the broker does not know, a key derived for another region, a revoked
client, an exporter without the lease, a config that would make a key worth
more than it should."""
import errno
import hashlib
import hmac
import os
import signal
import socket
import subprocess
import time
import unittest

from brokerlib import HVMEM, BUILD, NOBODY, BrokerTestCase, wait_for

MiB = 1 << 20
DAEMON = 1                      # Debian's "daemon" user: uid 1, gid 1
CONTEXT = b'hybridvm-broker-export-v1:'
QSD = os.path.join(BUILD, 'bin', 'qemu-storage-daemon')
QEMU_IMG = os.path.join(BUILD, 'bin', 'qemu-img')
QEMU_IO = os.path.join(BUILD, 'bin', 'qemu-io')


def derived(key_hex, region):
    """What an export of `region` accepts from the holder of `key_hex`."""
    return hmac.new(bytes.fromhex(key_hex), CONTEXT + region.encode(),
                    hashlib.sha256).hexdigest()


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class RemoteBase(BrokerTestCase):
    """hostA acts as nobody, hostB as daemon; hostC has a key the broker
    does not know."""

    def setUp(self):
        super().setUp()
        self.keys = {}
        for name in ('hostA', 'hostB', 'hostC'):
            self.keys[name] = self.write_key(name, os.urandom(32).hex())
        self.restart(self.config(hostA=NOBODY, hostB=DAEMON))

    def write_key(self, name, text, mode=0o600):
        path = os.path.join(self.workdir, f'{name}.key')
        with open(path, 'w') as f:
            f.write(text + '\n')
        os.chmod(path, mode)
        return text

    def config(self, **clients):
        path = os.path.join(self.workdir, 'broker.conf')
        with open(path, 'w') as f:
            for name, user in clients.items():
                f.write(f'[remote-client {name}]\nkey-file={self.workdir}/{name}.key\n'
                        f'user={user}\n\n')
        return path

    def restart(self, cfg):
        self.c.close()
        self.broker.stop()
        self.broker.args = ['--config', cfg]
        self.broker.start()
        self.c = self.broker.client()

    def lines(self, region, rw):
        _, fd = self.c.map(region, rw=rw)
        os.close(fd)
        return sorted(self.c.export_keys(region, rw=rw))

    def expect(self, region, *names):
        return sorted(f'{n}:{derived(self.keys[n], region)}' for n in names)


class RemoteClientsTest(RemoteBase):

    def test_the_mode_bits_decide_who_may_attach(self):
        """Each remote client is judged as its user: other rw admits both to
        a read-write export, other r only to a read-only one, 0600 none;
        a region of nobody's admits hostA (its owner) alone; chmod changes
        the answer at once."""
        self.c.create('m0', 18 * MiB, 0o606)
        self.assertEqual(self.lines('m0', rw=True), self.expect('m0', 'hostA', 'hostB'))
        self.c.chmod('m0', 0o604)
        self.assertEqual(self.c.export_keys('m0', rw=True), [])
        self.assertEqual(self.c.export_keys('m0', rw=False), self.expect('m0', 'hostA', 'hostB'))
        self.c.chmod('m0', 0o600)
        self.assertEqual(self.c.export_keys('m0', rw=False), [])
        self.assertIn("region 'm0': read-only export keys to pid", self.broker.read_log())
        self.assertIn("no remote client (the region's mode admits none)", self.broker.read_log())
        # a region of nobody's, 0600: its owner's client alone
        n = self.agent(NOBODY)
        n.ok(op='call', method='create', name='own', size=4 * MiB, mode=0o600)
        self.assertEqual(self.lines('own', rw=True), self.expect('own', 'hostA'))
        # the secret itself never leaves the broker
        for line in self.c.export_keys('own', rw=True):
            self.assertNotIn(self.keys['hostA'], line)

    def test_only_the_exporter_gets_keys(self):
        """Keys only for the connection that mapped the region: read-write
        keys only while it holds the lease; a local user who may only read
        gets no read-write keys; nobody without a mapping gets any."""
        self.c.create('m0', 18 * MiB, 0o604)
        e = self.assertBrokerError(errno.ENOLCK, self.c.export_keys, 'm0', rw=False)
        self.assertIn('has not mapped it', e.msg)
        _, fd = self.c.map('m0')
        os.close(fd)
        e = self.assertBrokerError(errno.ENOLCK, self.c.export_keys, 'm0', rw=True)
        self.assertIn('holds no read-write lease', e.msg)
        n = self.agent(NOBODY)
        res = n.do(op='call', method='export_keys', name='m0', rw=True)
        self.assertEqual(res['errno'], errno.EACCES, res)
        n.ok(op='map', name='m0')
        self.assertEqual(sorted(n.ok(op='call', method='export_keys', name='m0')['result']),
                         self.expect('m0', 'hostA', 'hostB'))
        self.assertBrokerError(errno.ENOENT, self.c.export_keys, 'nope')

    def test_psk_verb_refuses_what_could_leak(self):
        """`hvmem psk` on a client's host: it writes the derived key, never
        from a key file others may read or that is a link, never into a
        directory others could swap files in, never for a bad identity."""
        d = self.workdir
        ok = os.path.join(d, 'psk-ok')
        self.hvmem('psk', 'm0', '--identity', 'hostA', '--key-file', f'{d}/hostA.key',
                   '--dir', ok)
        with open(os.path.join(ok, 'keys.psk')) as f:
            self.assertEqual(f.read(), f'hostA:{derived(self.keys["hostA"], "m0")}\n')
        self.assertEqual(os.stat(ok).st_mode & 0o777, 0o700)
        self.assertEqual(os.stat(os.path.join(ok, 'keys.psk')).st_mode & 0o777, 0o600)
        self.write_key('loose', os.urandom(32).hex(), mode=0o640)
        os.symlink(f'{d}/hostA.key', f'{d}/link.key')
        loose_dir = os.path.join(d, 'loose-dir')
        os.makedirs(loose_dir)
        os.chmod(loose_dir, 0o755)
        for args, rc, words in (
                (['--key-file', f'{d}/loose.key', '--dir', f'{d}/p1'], 1, 'group or others'),
                (['--key-file', f'{d}/link.key', '--dir', f'{d}/p2'], 1, 'symbolic link'),
                (['--key-file', f'{d}/hostA.key', '--dir', loose_dir], 1,
                 'closed to group and others'),
        ):
            with self.subTest(args=args):
                p = self.hvmem('psk', 'm0', '--identity', 'hostA', *args, check=False)
                self.assertEqual(p.returncode, rc, p.stderr)
                self.assertIn(words, p.stderr)
        self.assertEqual(os.listdir(loose_dir), [])
        p = self.hvmem('psk', 'm0', '--identity', 'a:b', '--key-file', f'{d}/hostA.key',
                       '--dir', f'{d}/p3', check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn('only letters', p.stderr)

    def test_bad_remote_config_refused(self):
        """A remote client whose key would be worth more than it should, or
        a config that cannot be meant, stops the start with the reason: a
        key file others may read, a symbolic link, a short or non-hex key,
        acting as root, a name that cannot be a PSK identity, an unknown
        setting or a missing one."""
        self.write_key('loose', os.urandom(32).hex(), mode=0o644)
        self.write_key('short', os.urandom(8).hex())
        self.write_key('nothex', 'zz' * 32)
        os.symlink(f'{self.workdir}/hostA.key', f'{self.workdir}/link.key')
        d = self.workdir
        cases = {
            f'[remote-client a]\nkey-file={d}/loose.key\nuser=nobody\n': 'group or others',
            f'[remote-client a]\nkey-file={d}/link.key\nuser=nobody\n': 'symbolic link',
            f'[remote-client a]\nkey-file={d}/short.key\nuser=nobody\n': 'shorter than 16 bytes',
            f'[remote-client a]\nkey-file={d}/nothex.key\nuser=nobody\n': 'not hex digits',
            f'[remote-client a]\nkey-file={d}/hostA.key\nuser=root\n': 'cannot act as root',
            f'[remote-client a]\nkey-file={d}/hostA.key\nuser=0\n': 'cannot act as root',
            f'[remote-client a:b]\nkey-file={d}/hostA.key\nuser=nobody\n': "only letters",
            f'[remote-client a]\nkey-file={d}/hostA.key\nuser=nobody\nmode=0600\n': 'unknown key mode=',
            '[remote-client a]\nuser=nobody\n': 'key-file= and user= are required',
            f'[remote-client a]\nkey-file={d}/hostA.key\nuser=no-such-user-hvmem\n':
                'unknown user',
            f'[remote-client a]\nkey-file={d}/missing.key\nuser=nobody\n': 'No such file',
        }
        self.c.close()
        self.broker.stop()
        cfg = os.path.join(d, 'bad.conf')
        for text, words in cases.items():
            with self.subTest(config=text):
                with open(cfg, 'w') as f:
                    f.write(text)
                rc = self.broker.start(args=['--config', cfg], expect_fail=True)
                self.assertNotEqual(rc, 0)
                self.assertIn(words, self.broker.read_log())
        self.broker.start()
        self.c = self.broker.client()


@unittest.skipUnless(all(os.access(p, os.X_OK) for p in (QSD, QEMU_IMG, QEMU_IO)),
                     f'{QSD} and qemu-img/qemu-io not built')
class RemoteExportTest(RemoteBase):
    """A real export: qemu-storage-daemon under `hvmem map --rw --psk-dir`,
    NBD with TLS-PSK; clients are qemu-img/qemu-io with keys from `hvmem psk`."""

    def setUp(self):
        super().setUp()
        self.port = free_port()
        self.export = None

    def tearDown(self):
        if self.export:
            if self.export.poll() is None:
                self.export.kill()
                self.export.wait()
            self.export.stderr.close()
        subprocess.run(['pkill', '-KILL', '-f', f'^{QSD} .*addr.port={self.port},'],
                       check=False)
        super().tearDown()

    def start_export(self, region, psk_dir=None):
        psk_dir = psk_dir or os.path.join(self.workdir, 'export')
        qsd = (f'exec {QSD} --object tls-creds-psk,id=tls0,endpoint=server,dir={psk_dir} '
               '--blockdev file,node-name=m0,filename=/proc/self/fd/$HVMEM_FD '
               f'--nbd-server addr.type=inet,addr.host=127.0.0.1,addr.port={self.port},'
               'tls-creds=tls0 --export nbd,id=e0,node-name=m0,writable=on')
        self.export = subprocess.Popen(
            [HVMEM, '-s', self.broker.sock, 'map', region, '--rw', '--psk-dir', psk_dir,
             '--', 'sh', '-c', qsd], stderr=subprocess.PIPE, text=True)

        def listening():
            if self.export.poll() is not None:
                raise AssertionError(f'export exited: {self.export.stderr.read()}')
            try:
                socket.create_connection(('127.0.0.1', self.port), 1).close()
                return True
            except OSError:
                return False
        wait_for(listening, 30, 'the export')
        return psk_dir

    def client_dir(self, identity, region, key=None):
        d = os.path.join(self.workdir, f'client-{identity}-{region}')
        self.hvmem('psk', region, '--identity', identity, '--key-file',
                   key or f'{self.workdir}/{identity}.key', '--dir', d)
        return d

    def attach(self, psk_dir, identity, cmd='read 0 4k'):
        """qemu-io through the export as `identity`: (ok, output)."""
        p = subprocess.run(
            [QEMU_IO, '--object', f'tls-creds-psk,id=tls0,endpoint=client,dir={psk_dir},'
             f'username={identity}', '--image-opts', '-c', cmd,
             f'driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={self.port},'
             'export=m0,tls-creds=tls0'], capture_output=True, text=True, timeout=60)
        return p.returncode == 0 and 'failed' not in p.stdout, p.stdout + p.stderr

    def assertAttaches(self, psk_dir, identity, cmd='read 0 4k'):
        ok, out = self.attach(psk_dir, identity, cmd)
        self.assertTrue(ok, out)
        return out

    def assertRefused(self, psk_dir, identity):
        ok, out = self.attach(psk_dir, identity)
        self.assertFalse(ok, out)
        self.assertRegex(out, r'TLS handshake failed')

    def test_admitted_clients_attach_and_others_do_not(self):
        """hostA (admitted) writes and reads the region over the network;
        hostC (not known to the broker, a key of its own) is refused, so is
        hostA with its key for another region, and a client without TLS."""
        self.c.create('m0', 18 * MiB, 0o606)
        self.start_export('m0')
        a = self.client_dir('hostA', 'm0')
        self.assertAttaches(a, 'hostA', 'write -P 0x5a 0 64k')
        out = self.assertAttaches(a, 'hostA', 'read -P 0x5a 0 64k')
        self.assertIn('read 65536/65536', out)
        self.assertAttaches(self.client_dir('hostB', 'm0'), 'hostB')
        self.assertRefused(self.client_dir('hostC', 'm0'), 'hostC')
        self.assertRefused(self.client_dir('hostA', 'other'), 'hostA')
        # hostB's key under hostA's name
        with open(os.path.join(self.client_dir('hostB', 'm0'), 'keys.psk')) as f:
            forged = os.path.join(self.workdir, 'forged')
            os.makedirs(forged, 0o700)
            with open(os.path.join(forged, 'keys.psk'), 'w') as g:
                g.write('hostA:' + f.read().split(':', 1)[1])
        self.assertRefused(forged, 'hostA')
        p = subprocess.run([QEMU_IMG, 'info', f'nbd://127.0.0.1:{self.port}/m0'],
                           capture_output=True, text=True, timeout=60)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn('TLS', p.stderr)
        # what the writes did is in the region, through the broker
        _, fd = self.c.map('m0')
        self.assertEqual(os.pread(fd, 4, 0), b'\x5a' * 4)
        os.close(fd)

    def test_revoked_client_cannot_attach_again(self):
        """chmod on the broker revokes: within the exporter's refresh (1 s)
        a client the mode no longer admits cannot attach; a chmod back
        admits it again; the export ran throughout."""
        self.c.create('m0', 18 * MiB, 0o606)
        d = self.start_export('m0')
        a = self.client_dir('hostA', 'm0')
        self.assertAttaches(a, 'hostA')
        self.c.chmod('m0', 0o600)
        t0 = time.monotonic()
        wait_for(lambda: os.path.getsize(os.path.join(d, 'keys.psk')) == 0, 10,
                 'the keys file to empty')
        self.assertLess(time.monotonic() - t0, 3)
        self.assertRefused(a, 'hostA')
        self.c.chmod('m0', 0o660)
        # 0660: root's group; neither nobody nor daemon is in it
        time.sleep(1.5)
        self.assertRefused(a, 'hostA')
        self.c.chmod('m0', 0o606)
        wait_for(lambda: os.path.getsize(os.path.join(d, 'keys.psk')) > 0, 10,
                 'the keys file to fill')
        self.assertAttaches(a, 'hostA')
        self.assertIsNone(self.export.poll())

    def test_exporter_goes_keys_go(self):
        """hvmem asked to terminate removes the keys (nobody new attaches)
        and its directory; a key directory others could write is refused."""
        self.c.create('m0', 18 * MiB, 0o606)
        d = self.start_export('m0')
        self.assertAttaches(self.client_dir('hostA', 'm0'), 'hostA')
        self.export.send_signal(signal.SIGTERM)
        self.assertEqual(self.export.wait(10), -signal.SIGTERM)
        self.assertFalse(os.path.exists(d))
        self.assertRefused(self.client_dir('hostA', 'm0'), 'hostA')
        subprocess.run(['pkill', '-KILL', '-f', f'^{QSD} .*addr.port={self.port},'])
        # a key directory another user could swap files in
        loose = os.path.join(self.workdir, 'loose')
        os.makedirs(loose)
        os.chmod(loose, 0o777)
        # (read-only: the killed export's descriptor may not be closed yet, and
        # a read-write map would wait for it, EBUSY, before the directory)
        p = self.hvmem('map', 'm0', '--psk-dir', loose, '--', 'true', check=False)
        self.assertEqual(p.returncode, 1)
        self.assertIn('closed to group and others', p.stderr)
        self.assertEqual(os.listdir(loose), [])


if __name__ == '__main__':
    unittest.main()
