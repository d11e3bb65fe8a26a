"""A host that keeps a hybrid node's mirror (issue 39; docs/hybrid.md, "A
mirror on another host"), for tests on hvlib.hosts hosts.

The mirror is a region of the host's own memory broker (hvmemd), exported
by qemu-storage-daemon over NBD with TLS (a pre-shared key), the daemon run
under `hvmem map --rw --psk-dir` (docs/broker.md, "Remote clients"): the
broker holds the region's read-write lease for as long as the export runs,
and decides which remote client may attach -- the writer is a remote client
of this host's broker (PSK identity PSK_USER, a secret key of its own),
acting as REMOTE_USER, whose group may write the region.  The region is
root's: the libvirt hook takes over only root's regions (a region another
user owns holds what that user wrote), and root grants the writer its
group's access.  The writer on another host
makes its key for the region with client_psk() and names the export with
mirror_opts().  A takeover on this host maps the region the same way, so it
cannot happen while the export still holds it."""
import os
import socket
import subprocess
import time

PORT = 10809
EXPORT = 'm0'
PSK_USER = 'hybrid'
REMOTE_USER = 'nobody'           # acts in its primary group, nogroup
REMOTE_GROUP = 'nogroup'
USER_TIMEOUT_MS = 3000


def write_psk(directory, key, user=PSK_USER):
    """A tls-creds-psk directory holding `user`'s key (hex) as given: for a
    client whose key is wrong."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, 'keys.psk'), 'w') as f:
        f.write(f'{user}:{key}\n')
    return directory


def write_key(path):
    """A remote client's secret key: 32 random bytes in hex, mode 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, 'w') as f:
        f.write(os.urandom(32).hex() + '\n')
    return path


class MirrorHost:
    """`host` (hvlib.hosts.Host) keeping the region `region` of `size`
    bytes for a writer elsewhere, the remote client PSK_USER whose secret
    key is `key_file` (a path the host sees; write_key() makes one);
    hvmemd, hvmem and qsd are the programs' absolute paths."""

    POOL = '/dev/shm/hybridvm-broker'
    SOCKET = '/run/hybridvm-broker.sock'

    def __init__(self, host, region, size, key_file, hvmemd, hvmem, qsd, port=PORT):
        self.host, self.region, self.size = host, region, size
        self.key_file, self.hvmemd, self.hvmem, self.qsd = key_file, hvmemd, hvmem, qsd
        self.port = port
        self.psk_dir = '/run/hybridvm-export-' + region
        self.broker = self.export = None

    def _wait(self, ready, proc, what, timeout=30):
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None:
                raise RuntimeError(f'host {self.host.name}: {what} exited ({proc.returncode})')
            if time.monotonic() > deadline:
                raise RuntimeError(f'host {self.host.name}: {what} not ready in {timeout} s')
            time.sleep(0.1)

    def start(self):
        """The host's broker (the region, root's, writable by REMOTE_GROUP,
        and the remote client in its config), the export; returns once the
        export takes connections."""
        config = os.path.join(self.host.files, 'hvmemd.conf')
        with open(config, 'w') as f:
            f.write(f'[region {self.region}]\nsize={self.size}\ngroup={REMOTE_GROUP}\n'
                    'mode=0660\n\n'
                    f'[remote-client {PSK_USER}]\nkey-file={self.key_file}\n'
                    f'user={REMOTE_USER}\n')
        self.log = os.path.join(self.host.files, 'hvmemd.log')
        with open(self.log, 'a') as log:
            self.broker = self.host.popen([self.hvmemd, '--pool', self.POOL, '--socket',
                                           self.SOCKET, '--config', config],
                                          stdout=log, stderr=log)
        self._wait(lambda: self.host.run([self.hvmem, 'stat'], check=False).returncode == 0,
                   self.broker, 'hvmemd')
        self.start_export()
        return self

    def start_export(self):
        """Export the region over NBD with TLS, holding its read-write lease,
        to the remote clients the broker admits."""
        qsd = (f'exec {self.qsd} '
               f'--object tls-creds-psk,id=tls0,endpoint=server,dir={self.psk_dir} '
               '--blockdev file,node-name=m0,filename=/proc/self/fd/$HVMEM_FD '
               f'--nbd-server addr.type=inet,addr.host={self.host.addr},addr.port={self.port},'
               f'tls-creds=tls0 --export nbd,id=e0,node-name=m0,writable=on')
        self.export = self.host.popen([self.hvmem, 'map', self.region, '--rw',
                                       '--psk-dir', self.psk_dir, '--', 'sh', '-c', qsd])

        def listening():
            try:
                socket.create_connection((self.host.addr, self.port), 1).close()
                return True
            except OSError:
                return False
        # the machine has a port on the hosts' fabric: connect from here
        self._wait(listening, self.export, 'the mirror export')

    def stop_export(self):
        """Stop exporting; the lease goes with the export."""
        self.host.run(['pkill', '-KILL', '-f', '^' + self.qsd])
        self.export.wait(30)

    def mirror_opts(self, prefix='mirror.', tls='tls0', user_timeout=USER_TIMEOUT_MS):
        """The writer's hybrid options naming the export (`tls`: the id of
        its tls-creds-psk object with endpoint=client, or None).  With
        `user_timeout` (ms) the connection fails once data sent has gone
        unacknowledged that long (a dead or cut-off mirror host), not after
        the kernel's ~15 minutes of retransmissions."""
        opts = (f'{prefix}driver=nbd,{prefix}server.type=inet,{prefix}server.host={self.host.addr},'
                f'{prefix}server.port={self.port},{prefix}export={EXPORT}')
        if user_timeout:
            opts += f',{prefix}server.user-timeout={user_timeout}'
        return opts + (f',{prefix}tls-creds={tls}' if tls else '')

    def map_argv(self, argv):
        """`argv` under `hvmem map REGION --rw`, the region on its fd 3."""
        return [self.hvmem, 'map', self.region, '--rw', '--', 'sh', '-c',
                'exec "$@" 3<&"$HVMEM_FD"', 'sh'] + list(argv)


def client_psk(hvmem, region, key_file, directory, identity=PSK_USER):
    """On the writer's host: `directory` (a tls-creds-psk directory, made
    0700) with its key for exports of `region` (`hvmem psk`)."""
    subprocess.run([hvmem, 'psk', region, '--identity', identity, '--key-file', key_file,
                    '--dir', directory], check=True, capture_output=True)
    return directory


def client_psk_object(directory, obj_id='tls0', user=PSK_USER):
    return f'tls-creds-psk,id={obj_id},endpoint=client,dir={directory},username={user}'
