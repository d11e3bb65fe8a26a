"""A host that keeps a hybrid node's mirror (issue 39; docs/hybrid.md, "A
mirror on another host"), for tests on hvlib.hosts hosts.

The mirror is a region of the host's own memory broker (hvmemd), exported
by qemu-storage-daemon over NBD with TLS (a pre-shared key), the daemon run
under `hvmem map --rw`: the broker decides who may write the region and
holds its read-write lease for as long as the export runs.  The writer on
another host names the export with mirror_opts().  A takeover on this host
maps the region the same way, so it cannot happen while the export still
holds it."""
import os
import socket
import time

PORT = 10809
EXPORT = 'm0'
PSK_USER = 'hybrid'
USER_TIMEOUT_MS = 3000


def write_psk(directory, key, user=PSK_USER):
    """A tls-creds-psk directory holding `user`'s key (hex)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, 'keys.psk'), 'w') as f:
        f.write(f'{user}:{key}\n')
    return directory


class MirrorHost:
    """`host` (hvlib.hosts.Host) keeping the region `region` of `size`
    bytes for a writer elsewhere; `psk_dir` is the server's tls-creds-psk
    directory (a path the host sees); hvmemd, hvmem and qsd are the
    programs' absolute paths."""

    POOL = '/dev/shm/hybridvm-broker'
    SOCKET = '/run/hybridvm-broker.sock'

    def __init__(self, host, region, size, psk_dir, hvmemd, hvmem, qsd, port=PORT):
        self.host, self.region, self.size = host, region, size
        self.psk_dir, self.hvmemd, self.hvmem, self.qsd = psk_dir, hvmemd, hvmem, qsd
        self.port = port
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
        """The host's broker, the region, the export; returns once the
        export takes connections."""
        self.broker = self.host.popen([self.hvmemd, '--pool', self.POOL, '--socket', self.SOCKET],
                                      stdout=open(os.devnull, 'w'), stderr=open(os.devnull, 'w'))
        self._wait(lambda: self.host.run([self.hvmem, 'stat'], check=False).returncode == 0,
                   self.broker, 'hvmemd')
        self.host.run([self.hvmem, 'create', self.region, str(self.size)])
        self.start_export()
        return self

    def start_export(self):
        """Export the region over NBD with TLS, holding its read-write lease."""
        qsd = (f'exec {self.qsd} '
               f'--object tls-creds-psk,id=tls0,endpoint=server,dir={self.psk_dir} '
               '--blockdev file,node-name=m0,filename=/proc/self/fd/$HVMEM_FD '
               f'--nbd-server addr.type=inet,addr.host={self.host.addr},addr.port={self.port},'
               f'tls-creds=tls0 --export nbd,id=e0,node-name=m0,writable=on')
        self.export = self.host.popen([self.hvmem, 'map', self.region, '--rw', '--',
                                       'sh', '-c', qsd])

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


def client_psk_object(directory, obj_id='tls0', user=PSK_USER):
    return f'tls-creds-psk,id={obj_id},endpoint=client,dir={directory},username={user}'
