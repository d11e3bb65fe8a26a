"""Post-copy migration between two Guests on 127.0.0.1."""
import dataclasses
import time

from .vm import GuestError, free_port


@dataclasses.dataclass
class MigrationResult:
    status: str
    total_time_ms: int
    setup_time_ms: int
    downtime_ms: int
    transferred_bytes: int
    postcopy_requests: int
    precopy_seconds: float
    switched_to_postcopy: bool
    info: dict

    def row(self):
        return {
            'status': self.status,
            'setup time (ms)': self.setup_time_ms,
            'downtime (ms)': self.downtime_ms,
            'total time (ms)': self.total_time_ms,
            'transferred (MiB)': round(self.transferred_bytes / 2**20, 1),
            'post-copy page requests': self.postcopy_requests,
        }


def _wait_status(guest, want, timeout, bad=('failed', 'cancelled')):
    deadline = time.monotonic() + timeout
    while True:
        info = guest.qmp('query-migrate')
        status = info.get('status')
        if status in want:
            return info
        if status in bad:
            raise GuestError(f'{guest.name}: migration {status}: '
                             f'{info.get("error-desc", "no error description")}')
        if time.monotonic() > deadline:
            raise GuestError(f'{guest.name}: migration still "{status}" after {timeout}s')
        time.sleep(0.05)


def migrate_postcopy(src, dst, precopy_seconds=0.5, bandwidth=None, timeout=300,
                     capabilities=(), parameters=None, on_switch=None):
    """Migrate src to dst (launched with -incoming defer) with post-copy.

    Pre-copy runs for `precopy_seconds` (or until it finishes by itself), then
    migrate-start-postcopy switches.  `bandwidth` (bytes/s) caps both phases,
    e.g. 125_000_000 to model a 1 Gbit/s link.  `on_switch()` is called once
    the guest runs on the destination (during post-copy, or after a
    pre-copy).  Returns the source's figures.
    """
    caps = [{'capability': 'postcopy-ram', 'state': True}]
    caps += [{'capability': c, 'state': True} for c in capabilities]
    for g in (src, dst):
        g.qmp('migrate-set-capabilities', capabilities=caps)
    params = dict(parameters or {})
    if bandwidth:
        params.update({'max-bandwidth': bandwidth, 'max-postcopy-bandwidth': bandwidth})
    if params:
        src.qmp('migrate-set-parameters', **params)

    uri = f'tcp:127.0.0.1:{free_port()}'
    dst.qmp('migrate-incoming', uri=uri)
    src.qmp('migrate', uri=uri)
    _wait_status(src, ('active', 'postcopy-active', 'completed'), timeout=60)
    t_active = time.monotonic()
    while time.monotonic() - t_active < precopy_seconds:
        if src.qmp('query-migrate').get('status') != 'active':
            break
        time.sleep(0.05)
    precopy = time.monotonic() - t_active
    switched = src.qmp('query-migrate').get('status') == 'active'
    if switched:
        src.qmp('migrate-start-postcopy')
        while on_switch and src.qmp('query-migrate').get('status') == 'postcopy-active':
            if dst.qmp('query-status').get('status') == 'running':
                on_switch()
                on_switch = None
            time.sleep(0.02)
    info = _wait_status(src, ('completed',), timeout=timeout)

    deadline = time.monotonic() + 60
    while dst.qmp('query-status').get('status') != 'running':
        if time.monotonic() > deadline:
            raise GuestError(f'{dst.name}: not running 60 s after migration completed')
        time.sleep(0.05)
    if on_switch:
        on_switch()

    ram = info.get('ram', {})
    return MigrationResult(status=info['status'],
                           total_time_ms=info.get('total-time', 0),
                           setup_time_ms=info.get('setup-time', 0),
                           downtime_ms=info.get('downtime', 0),
                           transferred_bytes=ram.get('transferred', 0),
                           postcopy_requests=ram.get('postcopy-requests', 0),
                           precopy_seconds=round(precopy, 2),
                           switched_to_postcopy=switched,
                           info=info)
