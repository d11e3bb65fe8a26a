"""A VM that libvirt manages, as the arbiter drives it.  libvirt owns
QEMU's monitor, so the arbiter goes through libvirt's API (the Python
bindings, python3-libvirt): the limits are the disk's live <iotune>
(virDomainSetBlockIoTune with VIR_DOMAIN_AFFECT_LIVE, what `virsh
blkdeviotune DOMAIN DISK --live --total-iops-sec N --total-bytes-sec B`
does; the domain's persistent definition is left alone), the figures
virDomainBlockStatsFlags' (`virsh domblkstat`).  libvirt gives no latency
histogram, only the total time of the disk's requests: such a VM's latency
is its mean over a period, and its SLO is checked against that.

A domain that is not defined or not running (stopped, migrated away) is
"cannot connect": the link is made again later, with the same back-off as
a QMP socket that is gone, and re-attaches when the domain runs again.  The
connection has libvirt's keepalive on, so a libvirtd that stops answering
drops it within a few timeouts rather than hanging the VM's thread for
good.
"""

import threading

from .qmp import LinkCommandError, LinkError

try:
    import libvirt
except ImportError:         # checked when a link is made: only libvirt VMs need it
    libvirt = None

_loop_lock = threading.Lock()
_loop_started = False


def _event_loop():
    """libvirt's default event loop in a thread of its own: keepalive
    needs one.  Started once, before the first connection."""
    global _loop_started
    with _loop_lock:
        if _loop_started:
            return
        libvirt.virEventRegisterDefaultImpl()
        # libvirt prints every error to stderr by default; ours are logged
        libvirt.registerErrorHandler(lambda ctx, err: None, None)

        def run():
            while True:
                libvirt.virEventRunDefaultImpl()
        threading.Thread(target=run, name='libvirt-events', daemon=True).start()
        _loop_started = True


# Errors that mean the domain or the connection is gone, not that the
# request was wrong: the link is dropped and made again.
_GONE = frozenset(getattr(libvirt, n) for n in (
    'VIR_ERR_NO_DOMAIN', 'VIR_ERR_OPERATION_INVALID', 'VIR_ERR_NO_CONNECT',
    'VIR_ERR_SYSTEM_ERROR', 'VIR_ERR_RPC', 'VIR_ERR_AUTH_FAILED',
    'VIR_ERR_OPERATION_TIMEOUT')) if libvirt else frozenset()


class LibvirtLink:
    def __init__(self, conf, timeout):
        self.conf = conf
        self.timeout = timeout
        self.conn = None
        self.dom = None
        self.where = f'{conf.libvirt} domain {conf.domain!r}'

    @property
    def connected(self):
        return self.dom is not None

    def connect(self):
        if libvirt is None:
            raise LinkError(f'{self.where}: cannot connect: the libvirt Python bindings '
                            'are not installed (python3-libvirt)')
        _event_loop()
        try:
            self.conn = libvirt.open(self.conf.libvirt)
        except libvirt.libvirtError as e:
            raise LinkError(f'{self.conf.libvirt}: cannot connect: '
                            f'{e.get_error_message()}') from None
        try:
            self.conn.setKeepAlive(max(1, round(self.timeout)), 3)
            dom = self.conn.lookupByName(self.conf.domain)
            if not dom.isActive():
                raise LinkError(f'{self.where}: cannot connect: the domain is not running')
        except libvirt.libvirtError as e:
            self.close()
            raise LinkError(f'{self.where}: cannot connect: {e.get_error_message()}') from None
        except LinkError:
            self.close()
            raise
        self.dom = dom

    def close(self):
        self.dom = None
        conn, self.conn = self.conn, None
        if conn is not None:
            try:
                conn.close()
            except libvirt.libvirtError:
                pass

    def _call(self, what, fn, *args):
        if self.dom is None:
            raise LinkError(f'{self.where}: not connected')
        try:
            return fn(*args)
        except libvirt.libvirtError as e:
            msg = f'{self.where}: {what}: {e.get_error_message()}'
            alive = False
            try:
                alive = self.conn.isAlive() == 1
            except libvirt.libvirtError:
                pass
            if e.get_error_code() in _GONE or not alive:
                raise LinkError(msg) from None
            raise LinkCommandError(msg) from None

    def attach(self, log):
        """Read the disk's live limits (a disk the domain lacks is refused
        here).  Returns (disk, its current limits in QEMU's terms, False:
        no histogram)."""
        disk = self.conf.device
        tune = self._call('blkdeviotune', self.dom.blockIoTune, disk,
                          libvirt.VIR_DOMAIN_AFFECT_LIVE)
        if not isinstance(tune, dict):
            raise LinkCommandError(f'{self.where}: blkdeviotune {disk}: not a parameter list')
        cur = {'iops-total': _count(tune.get('total_iops_sec')),
               'bps-total': _count(tune.get('total_bytes_sec'))}
        return disk, cur, False

    def sample(self, disk):
        """(operations, bytes, None, total latency in ns) of the disk so far."""
        s = self._call('domblkstat', self.dom.blockStatsFlags, disk, 0)
        if not isinstance(s, dict):
            raise LinkCommandError(f'{self.where}: domblkstat {disk}: not a parameter list')
        ops = _count(s.get('rd_operations')) + _count(s.get('wr_operations'))
        nbytes = _count(s.get('rd_bytes')) + _count(s.get('wr_bytes'))
        lat = None
        if 'rd_total_times' in s or 'wr_total_times' in s:
            lat = _count(s.get('rd_total_times')) + _count(s.get('wr_total_times'))
        return ops, nbytes, None, lat

    def set_limits(self, limits):
        """The disk's live total IOPS and bytes limits (0: none; libvirt
        keeps the other fields and resets the read/write split of a kind
        whose total is given), in the configured group, if any."""
        params = {libvirt.VIR_DOMAIN_BLOCK_IOTUNE_TOTAL_IOPS_SEC: int(limits.get('iops-total', 0)),
                  libvirt.VIR_DOMAIN_BLOCK_IOTUNE_TOTAL_BYTES_SEC: int(limits.get('bps-total', 0))}
        # libvirt refuses a group whose limits are all zero; without a name
        # the zeros take the disk out of its group and unthrottle it
        if self.conf.group and any(params.values()):
            params[libvirt.VIR_DOMAIN_BLOCK_IOTUNE_GROUP_NAME] = self.conf.group
        self._call('blkdeviotune', self.dom.setBlockIoTune, self.conf.device, params,
                   libvirt.VIR_DOMAIN_AFFECT_LIVE)


def _count(v):
    """A libvirt counter: a non-negative int, anything else 0 (a counter a
    driver does not report comes back -1 or absent)."""
    return v if isinstance(v, int) and v > 0 else 0
