"""The suite a PSK-keyed NBD link over TLS settles on (scripts/build-qemu.sh).

The hybrid mirror's link is NBD over TLS keyed by a pre-shared key
(tls-creds-psk).  A TLS 1.3 session keyed by an external PSK is bound to the
key's hash, SHA-256 in GnuTLS, so GnuTLS's NORMAL cannot use its first suite,
TLS_AES_256_GCM_SHA384, and takes its next one, TLS_CHACHA20_POLY1305_SHA256:
ChaCha20 in software, about 30 us more per 4 KiB write on this hardware than
AES-128-GCM on AES-NI.  Our QEMU is configured with a default priority that
puts ChaCha20 behind the AES-GCM suites.  These tests read the suite the
real qemu-nbd and qemu-io agree on, through an LD_PRELOAD shim that logs
each completed GnuTLS handshake (tls-session-shim.c): AES-128-GCM by
default, and ChaCha20 when both sides name GnuTLS's plain NORMAL (QEMU adds
the PSK key exchanges to a priority it is given), which shows that the test
sees the difference."""

import os
import socket
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hybridlib as H   # noqa: E402
from hvlib import free_port   # noqa: E402

PSK_ID = 'hosta'
PSK_KEY = '6f' * 32


@unittest.skipUnless(H.have_binaries(), 'needs the built QEMU tools')
class TlsCipherTest(H.ToolTest):

    def setUp(self):
        super().setUp()
        self.shim = self.tmp('shim.so')
        H.build_tls_shim(self.shim)
        self.psk_dir = self.tmp('psk')
        os.mkdir(self.psk_dir, 0o700)
        with open(os.path.join(self.psk_dir, 'keys.psk'), 'w') as f:
            f.write(f'{PSK_ID}:{PSK_KEY}\n')
        os.chmod(os.path.join(self.psk_dir, 'keys.psk'), 0o600)
        self.image = self.tmp('disk.raw')
        with open(self.image, 'wb') as f:
            f.truncate(1024 * 1024)

    def env(self, log):
        return dict(os.environ, LD_PRELOAD=self.shim, HYBRIDVM_TLS_LOG=log)

    def session(self, priority=None):
        """Write 4 KiB through qemu-io's NBD client over TLS to qemu-nbd,
        both keyed by the PSK, @priority (a GnuTLS priority string) on both
        tls-creds objects or our build's default; return the descriptions
        the server and the client logged."""
        prio = f',priority={priority}' if priority else ''
        port = free_port()
        server_log, client_log = self.tmp('server.log'), self.tmp('client.log')
        for log in (server_log, client_log):
            if os.path.exists(log):
                os.unlink(log)
        server = subprocess.Popen(
            [H.binary('qemu-nbd'), '-f', 'raw', '-x', 'e', '-b', '127.0.0.1', '-p', str(port),
             '--object', f'tls-creds-psk,id=tls0,endpoint=server,dir={self.psk_dir}{prio}',
             '--tls-creds', 'tls0', '--persistent', self.image],
            env=self.env(server_log), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True)
        self.procs.append(server)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(('127.0.0.1', port), 1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f'qemu-nbd did not listen: {server.stderr.read()}')
                time.sleep(0.05)
        r = subprocess.run(
            [H.binary('qemu-io'),
             '--object', f'tls-creds-psk,id=tls0,endpoint=client,dir={self.psk_dir},'
                         f'username={PSK_ID}{prio}',
             '--image-opts', f'driver=nbd,server.type=inet,server.host=127.0.0.1,'
                             f'server.port={port},export=e,tls-creds=tls0',
             '-c', 'write -P 0x5a 0 4k'],
            env=self.env(client_log), capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn('wrote 4096/4096 bytes', r.stdout)
        server.kill()
        server.wait()
        self.procs.remove(server)
        with open(self.image, 'rb') as f:
            self.assertEqual(f.read(4096), b'\x5a' * 4096)
        with open(server_log) as s, open(client_log) as c:
            return s.read().split(), c.read().split()

    def test_psk_link_uses_aes_gcm(self):
        """By our build's default priority, a PSK-keyed NBD link settles on
        TLS 1.3 with AES-128-GCM on both sides."""
        server, client = self.session()
        self.assertEqual(len(server), 1, server)
        self.assertEqual(server, client)
        self.assertTrue(server[0].startswith('(TLS1.3)'), server[0])
        self.assertTrue(server[0].endswith('-(AES-128-GCM)'), server[0])

    def test_gnutls_normal_takes_chacha20(self):
        """With GnuTLS's plain NORMAL named on both tls-creds objects (the
        default of a QEMU configured without --tls-priority), the same link
        settles on ChaCha20-Poly1305: the suite the build's default avoids."""
        server, client = self.session('NORMAL')
        self.assertEqual(server, client)
        self.assertTrue(server[0].endswith('-(CHACHA20-POLY1305)'), server[0])


if __name__ == '__main__':
    unittest.main()
