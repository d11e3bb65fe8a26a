"""App-assisted migration (migration/app-assist/) with real guests.

The guest applications here are busybox shell scripts on the ports: a
well-behaved one that answers PREPARE like the Redis module would, and hostile
or absent ones.  The Redis module itself is exercised in
test_app_assist_redis.py.
"""
import base64
import os
import time

from hvtest import HybridVMTest

MiB = 1 << 20
PORT = 'org.qemu.app-assist.{}'

# Make /dev/virtio-ports/<name> links (the test guest has no udev).
LINK_PORTS = ('mkdir -p /dev/virtio-ports; for p in /sys/class/virtio-ports/vport*; do '
              'ln -sf /dev/${p##*/} /dev/virtio-ports/$(cat $p/name); done')


def answers(*then):
    """A guest application that reads the request and logs it, runs the
    shell lines @then, and keeps the port open."""
    return '\n'.join(('exec 3<>"$1"', 'read -r l <&3; echo "$l" >"$2"') + then +
                     ('sleep 100000',))


# Guest applications.  $1 = port path, $2 = log file; each logs what it read.
APPS = {
    # Answers PREPARE with freed-bytes=$3, logs every line it gets afterwards.
    'good': r'''exec 3<>"$1"
while read -r l <&3; do
  echo "$l" >>"$2"
  case "$l" in APPASSIST.PREPARE*)
    printf '*6\r\n$11\r\nfreed-bytes\r\n:%s\r\n$5\r\nitems\r\n:7\r\n$7\r\ntime_us\r\n$3\r\n120\r\n' "$3" >&3;;
  esac
done''',
    # Keeps the port open and never answers.
    'sleeper': r'''exec 3<>"$1"
echo open >"$2"
sleep 100000''',
    # Answers garbage that is not RESP.
    'garbage': answers(r"printf 'HTTP/1.1 200 OK\r\n\r\n' >&3"),
    # Well-formed RESP, wrong type for freed-bytes.
    'wrongtype': answers(r"printf '*2\r\n$11\r\nfreed-bytes\r\n$5\r\n-1e99\r\n' >&3"),
    # A multi-bulk count of two billion.
    'bigarray': answers(r"printf '*2000000000\r\n$11\r\nfreed-bytes\r\n' >&3"),
    # Floods: announces a 1 GB bulk string and sends 2 MB of it, then zeros.
    'flood': answers(r"printf '$1000000000\r\n' >&3", 'head -c 2000000 /dev/zero >&3'),
    # Refuses.
    'refuse': answers(r"printf -- '-ERR busy\r\n' >&3"),
    # Floods the port with zeros for as long as it lives.
    'firehose': r'''exec 3<>"$1"
echo open >"$2"
cat /dev/zero >&3''',
    # Closes the port.
    'disconnect': answers('exec 3<&-'),
}


def port_args(n):
    args = ['-device', 'virtio-serial-pci,id=vser0']
    for i in range(n):
        args += ['-chardev', f'app-assist,id=aa{i}',
                 '-device', f'virtserialport,bus=vser0.0,chardev=aa{i},name={PORT.format(i)}']
    return args


def plain_port_args(n):
    """The same virtio-serial ports as port_args(n), on null chardevs: the
    guest sees the same devices, QEMU has no app-assist port."""
    args = ['-device', 'virtio-serial-pci,id=vser0']
    for i in range(n):
        args += ['-chardev', f'null,id=aa{i}',
                 '-device', f'virtserialport,bus=vser0.0,chardev=aa{i},name={PORT.format(i)}']
    return args


def start_app(guest, kind, port_index, *extra):
    """Start guest application `kind` on port `port_index` in the background."""
    script = APPS[kind].encode()
    b64 = base64.b64encode(script).decode()
    path = f'/tmp/app-{port_index}.sh'
    guest.run(f'echo {b64} | base64 -d >{path}')
    args = ' '.join(str(a) for a in extra)
    guest.run(f'(sh {path} /dev/virtio-ports/{PORT.format(port_index)} '
              f'/tmp/app-{port_index}.log {args} </dev/null >/dev/null 2>&1 &)')


def wait_for(predicate, timeout, what, interval=0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f'timed out after {timeout}s waiting for {what}')
        time.sleep(interval)


def balloon_actual(guest):
    return guest.qmp('query-balloon')['actual']


def start_assisted(src, dst, **params):
    """Post-copy and app-assist on both sides, `params` on the source, and
    the migration started (not switched to post-copy)."""
    import hvlib
    caps = [{'capability': 'postcopy-ram', 'state': True},
            {'capability': 'app-assist', 'state': True}]
    for g in (src, dst):
        g.qmp('migrate-set-capabilities', capabilities=caps)
    src.qmp('migrate-set-parameters', **params)
    uri = f'tcp:127.0.0.1:{hvlib.free_port()}'
    dst.qmp('migrate-incoming', uri=uri)
    src.qmp('migrate', uri=uri)


def ram_vma_flags(pid, size):
    """The VmFlags of the process's mappings of at least `size` bytes (guest
    RAM), from /proc/PID/smaps."""
    flags, big = [], False
    with open(f'/proc/{pid}/smaps') as f:
        for line in f:
            if line.startswith('Size:'):
                big = int(line.split()[1]) * 1024 >= size
            elif line.startswith('VmFlags:') and big:
                flags.append(line.split()[1:])
    return flags


def minor_faults(pid, tid=None):
    """Minor page faults of thread `tid` (default: the main thread) of
    process `pid`, from /proc/PID/task/TID/stat."""
    with open(f'/proc/{pid}/task/{tid or pid}/stat') as f:
        return int(f.read().rsplit(')', 1)[1].split()[7])


class AppAssist(HybridVMTest):

    MEM = '512M'

    def boot_pair(self, nports, src_args=(), redis=False):
        src = self.guest('src', mem=self.MEM, redis=redis,
                         args=port_args(nports) + list(src_args)).boot()
        dst = self.guest('dst', mem=self.MEM, redis=redis, incoming='defer',
                         args=port_args(nports) + list(src_args)).launch()
        src.run(LINK_PORTS)
        return src, dst

    def wait_completed(self, src, dst, timeout=120):
        """Wait until the migration has completed on both sides; fail at
        once if the source says it failed or was cancelled."""
        def done():
            st = src.qmp('query-migrate')['status']
            self.assertNotIn(st, ('failed', 'cancelled'))
            return st == 'completed' and dst.qmp('query-migrate')['status'] == 'completed'
        wait_for(done, timeout, 'the migration to complete')

    def test_hostile_and_good_apps(self):
        """Nine ports, one well-behaved application and every kind of hostile
        or absent one, app-assist enabled with -global only (no QMP): the
        migration completes, the good app's memory is ballooned away and
        restored on the destination, where it gets RESUME; query-migrate
        reports each port's failure."""
        import hvlib
        kinds = ['good', None, 'sleeper', 'garbage', 'wrongtype', 'bigarray',
                 'flood', 'refuse', 'disconnect']
        glob = ['-global', 'migration.x-app-assist=on',
                '-global', 'migration.x-app-assist-deadline=2500']
        src, dst = self.boot_pair(len(kinds), glob)
        freed = 96 * MiB
        for i, kind in enumerate(kinds):
            if kind == 'good':
                start_app(src, kind, i, freed)
            elif kind:
                start_app(src, kind, i)
        # Every app has opened its port once its log exists.
        for i, kind in enumerate(kinds):
            if kind == 'sleeper':
                src.run(f'while [ ! -e /tmp/app-{i}.log ]; do sleep 0.1; done', timeout=30)
        full = balloon_actual(src)
        self.assertEqual(full, 512 * MiB)

        res = hvlib.migrate_postcopy(src, dst, precopy_seconds=0.5, bandwidth=125_000_000)
        self.log.info('migration: %s', res.row())
        self.assertEqual(res.status, 'completed')
        aa = res.info['app-assist']
        self.log.info('app-assist: %s', aa)
        self.assertEqual(aa['status'], 'completed')
        ports = {p['id']: p for p in aa['ports']}
        expect = {'aa0': 'answered', 'aa1': 'no-app', 'aa2': 'timeout', 'aa3': 'invalid',
                  'aa4': 'invalid', 'aa5': 'invalid', 'aa6': 'invalid', 'aa7': 'refused',
                  'aa8': 'disconnected'}
        self.assertEqual({k: v['status'] for k, v in ports.items()}, expect)
        self.assertEqual(ports['aa0']['freed-bytes'], freed)
        self.assertEqual(ports['aa0']['items'], 7)
        self.assertEqual(ports['aa0']['app-time'], 120)
        self.assertIn('busy', ports['aa7']['error'])
        self.assertIn('longer than', ports['aa6']['error'])
        self.assertIn('limits', ports['aa5']['error'])
        self.assertIn('freed-bytes', ports['aa4']['error'])
        self.assertIn('malformed', ports['aa3']['error'])
        self.assertEqual(aa['apps-contacted'], 8)
        self.assertEqual(aa['apps-answered'], 1)
        self.assertEqual(aa['freed-bytes'], freed)
        self.assertIn('did not answer', aa['reason'])
        self.assertEqual(aa['balloon-initial'], full)
        self.assertEqual(aa['balloon-target'], full - freed)
        self.assertLessEqual(aa['balloon-reached'], aa['balloon-target'])
        # The sleeper held the phase until the deadline: all of it is set-up time.
        self.assertGreaterEqual(aa['prepare-time'], 2400)
        self.assertLess(aa['prepare-time'], 4000)
        self.assertGreaterEqual(res.setup_time_ms, aa['prepare-time'] + aa['balloon-time'])

        # Destination: balloon back to full size, the good app got RESUME.
        wait_for(lambda: balloon_actual(dst) == full, 60, 'balloon deflated on the destination')
        out = dst.run('cat /tmp/app-0.log')
        self.assertIn('APPASSIST.PREPARE', out)
        self.assertIn('APPASSIST.RESUME', out)
        self.assertNotIn('APPASSIST.ABORT', out)
        dinfo = dst.qmp('query-migrate')['app-assist']
        self.assertEqual(dinfo['status'], 'resumed')
        self.assertEqual(dinfo['balloon-target'], full)
        # One MIGRATION_APP_ASSIST event on each side.
        ev = src.vm.event_wait('MIGRATION_APP_ASSIST', timeout=10)
        self.assertIsNotNone(ev)
        self.assertEqual(ev['data']['info']['status'], 'completed')
        self.assertEqual(ev['data']['info']['freed-bytes'], freed)
        ev = dst.vm.event_wait('MIGRATION_APP_ASSIST', timeout=10)
        self.assertIsNotNone(ev)
        self.assertEqual(ev['data']['info']['status'], 'resumed')
        # HMP shows the section too.
        hmp = src.qmp('human-monitor-command', **{'command-line': 'info migrate'})
        self.assertIn('app-assist: completed', hmp)
        self.assertIn('port aa2: timeout', hmp)

    def test_no_ports(self):
        """Capability on (QMP) but no app-assist port at all: the phase is
        skipped, query-migrate says why, the migration completes."""
        import hvlib
        src = self.guest('src', mem=self.MEM, redis=False).boot()
        dst = self.guest('dst', mem=self.MEM, redis=False, incoming='defer').launch()
        res = hvlib.migrate_postcopy(src, dst, precopy_seconds=0.3, bandwidth=125_000_000,
                                     capabilities=['app-assist'])
        self.assertEqual(res.status, 'completed')
        aa = res.info['app-assist']
        self.assertEqual(aa['status'], 'skipped')
        self.assertIn('no app-assist port', aa['reason'])
        self.assertEqual(aa['ports'], [])

    def test_no_app_and_balloon_off(self):
        """Ports but no application: skipped, 'no application' reason.  Then
        parameters over QMP: deadline bounds, balloon off is honoured."""
        src, dst = self.boot_pair(2)
        r = src.qmp_raw('migrate-set-parameters', **{'app-assist-deadline': 600001})
        self.assertIn('error', r)
        src.qmp('migrate-set-parameters', **{'app-assist-balloon': False,
                                            'app-assist-deadline': 1000})
        src.qmp('human-monitor-command',
                **{'command-line': 'migrate_set_parameter app-assist-balloon-wait 4000'})
        hmp = src.qmp('human-monitor-command', **{'command-line': 'info migrate_parameters'})
        self.assertIn('app-assist-balloon-wait: 4000 ms', hmp)
        self.assertIn('app-assist-balloon: off', hmp)
        params = src.qmp('query-migrate-parameters')
        self.assertEqual(params['app-assist-balloon-wait'], 4000)
        self.assertEqual(params['app-assist-deadline'], 1000)
        self.assertFalse(params['app-assist-balloon'])
        r = src.qmp_raw('migrate-set-capabilities', capabilities=[
            {'capability': 'app-assist', 'state': True},
            {'capability': 'background-snapshot', 'state': True}])
        self.assertIn('error', r)

        start_app(src, 'good', 1, 64 * MiB)
        import hvlib
        res = hvlib.migrate_postcopy(src, dst, precopy_seconds=0.3, bandwidth=125_000_000,
                                     capabilities=['app-assist'])
        self.assertEqual(res.status, 'completed')
        aa = res.info['app-assist']
        self.assertEqual(aa['status'], 'completed')
        self.assertEqual([p['status'] for p in aa['ports']], ['no-app', 'answered'])
        self.assertEqual(aa['freed-bytes'], 64 * MiB)
        self.assertEqual(aa['balloon-target'], 0)
        self.assertIn('app-assist-balloon=off', aa['reason'])
        out = wait_for(lambda: 'RESUME' in dst.run('cat /tmp/app-1.log') and
                       dst.run('cat /tmp/app-1.log'), 30, 'RESUME on the destination')
        self.assertIn('APPASSIST.RESUME', out)

    def test_cancel_during_balloon(self):
        """Cancel while the balloon inflates: the source deflates back to the
        full size, the app gets ABORT and keeps running; a second migration
        of the same guest then works."""
        src, dst = self.boot_pair(1)
        full = balloon_actual(src)
        start_app(src, 'good', 0, 256 * MiB)
        src.run('while [ ! -e /tmp/app-0.sh ]; do sleep 0.1; done')
        caps = [{'capability': 'postcopy-ram', 'state': True},
                {'capability': 'app-assist', 'state': True}]
        src.qmp('migrate-set-capabilities', capabilities=caps)
        src.qmp('migrate-set-parameters', **{'max-bandwidth': 125_000_000})
        import hvlib
        uri = f'tcp:127.0.0.1:{hvlib.free_port()}'
        dst.qmp('migrate-set-capabilities', capabilities=caps)
        dst.qmp('migrate-incoming', uri=uri)
        src.qmp('migrate', uri=uri)
        events = []

        def ballooning():
            info = src.qmp('query-migrate')
            events.append(info.get('app-assist', {}).get('status'))
            return info.get('app-assist', {}).get('status') == 'ballooning'
        wait_for(ballooning, 30, 'the ballooning phase', interval=0.01)
        src.qmp('migrate_cancel')
        wait_for(lambda: src.qmp('query-migrate')['status'] == 'cancelled', 30, 'cancelled')
        aa = src.qmp('query-migrate')['app-assist']
        self.log.info('after cancel: %s', aa)
        self.assertEqual(aa['status'], 'cancelled')
        self.assertIn('cancelled', aa['reason'])
        wait_for(lambda: balloon_actual(src) == full, 60, 'balloon deflated on the source')
        out = wait_for(lambda: 'ABORT' in src.run('cat /tmp/app-0.log') and
                       src.run('cat /tmp/app-0.log'), 30, 'ABORT in the app log')
        self.assertIn('APPASSIST.ABORT', out)
        self.assertEqual(src.qmp('query-status')['status'], 'running')
        src.run('true')     # the guest still answers

    def test_postcopy_preempt(self):
        """With postcopy-preempt (libvirt turns it on when both sides have
        it) the assisted migration completes and the app is resumed."""
        import hvlib
        src, dst = self.boot_pair(1)
        full = balloon_actual(src)
        start_app(src, 'good', 0, 48 * MiB)
        src.run('while [ ! -e /tmp/app-0.sh ]; do sleep 0.1; done')
        res = hvlib.migrate_postcopy(src, dst, precopy_seconds=0.2, bandwidth=50_000_000,
                                     capabilities=['app-assist', 'postcopy-preempt'])
        self.assertEqual(res.status, 'completed')
        self.assertTrue(res.switched_to_postcopy)
        aa = res.info['app-assist']
        self.assertEqual(aa['status'], 'completed')
        self.assertEqual(aa['balloon-target'], full - 48 * MiB)
        wait_for(lambda: balloon_actual(dst) == full, 60, 'balloon deflated on the destination')
        out = wait_for(lambda: 'RESUME' in dst.run('cat /tmp/app-0.log') and
                       dst.run('cat /tmp/app-0.log'), 30, 'RESUME on the destination')
        self.assertIn('APPASSIST.RESUME', out)

    def test_cancel_during_prepare(self):
        """Cancel while one app still has not answered PREPARE (the other
        has): the phase stops waiting at once, nothing is ballooned, the app
        that answered gets ABORT, the guest keeps running."""
        src, dst = self.boot_pair(2)
        full = balloon_actual(src)
        start_app(src, 'good', 0, 64 * MiB)
        start_app(src, 'sleeper', 1)
        src.run('while [ ! -e /tmp/app-1.log ]; do sleep 0.1; done')
        t0 = time.monotonic()
        start_assisted(src, dst, **{'app-assist-deadline': 20000})
        wait_for(lambda: 'PREPARE' in src.run('cat /tmp/app-0.log'), 30, 'PREPARE in the app')
        self.assertEqual(src.qmp('query-migrate')['status'], 'setup')
        src.qmp('migrate_cancel')
        wait_for(lambda: src.qmp('query-migrate')['status'] == 'cancelled', 30, 'cancelled')
        self.assertLess(time.monotonic() - t0, 15, 'cancel waited for the deadline')
        aa = src.qmp('query-migrate')['app-assist']
        self.assertEqual(aa['status'], 'cancelled')
        self.assertIn('cancelled during PREPARE', aa['reason'])
        self.assertEqual(aa['balloon-target'], 0)
        self.assertEqual(balloon_actual(src), full)
        out = wait_for(lambda: 'ABORT' in src.run('cat /tmp/app-0.log') and
                       src.run('cat /tmp/app-0.log'), 30, 'ABORT in the app log')
        self.assertIn('APPASSIST.ABORT', out)
        self.assertEqual(src.qmp('query-status')['status'], 'running')

    def test_no_balloon_and_firehose(self):
        """No balloon device, and an app that floods its port with zeros for
        the whole migration: the good app's PREPARE still counts (freed
        bytes reported, RESUME on the destination), the reason says the
        balloon is missing, and the flood costs no memory and does not stop
        the migration."""
        import hvlib
        src = self.guest('src', mem=self.MEM, redis=False, balloon=False,
                         args=port_args(2)).boot()
        dst = self.guest('dst', mem=self.MEM, redis=False, balloon=False, incoming='defer',
                         args=port_args(2)).launch()
        src.run(LINK_PORTS)
        start_app(src, 'good', 0, 32 * MiB)
        start_app(src, 'firehose', 1)
        src.run('while [ ! -e /tmp/app-1.log ]; do sleep 0.1; done')
        rss0 = int(open(f'/proc/{src.pid}/status').read().split('VmRSS:')[1].split()[0])
        res = hvlib.migrate_postcopy(src, dst, precopy_seconds=0.3, bandwidth=125_000_000,
                                     capabilities=['app-assist'],
                                     parameters={'app-assist-deadline': 1500})
        self.assertEqual(res.status, 'completed')
        aa = res.info['app-assist']
        self.log.info('app-assist: %s', aa)
        self.assertEqual(aa['status'], 'completed')
        self.assertEqual([p['status'] for p in aa['ports']], ['answered', 'invalid'])
        self.assertEqual(aa['freed-bytes'], 32 * MiB)
        self.assertEqual(aa['balloon-target'], 0)
        self.assertIn('cannot balloon', aa['reason'])
        rss1 = int(open(f'/proc/{src.pid}/status').read().split('VmRSS:')[1].split()[0])
        self.assertLess(rss1 - rss0, 64 * 1024, 'QEMU grew by more than 64 MiB during the flood')
        out = wait_for(lambda: 'RESUME' in dst.run('cat /tmp/app-0.log', timeout=120) and
                       dst.run('cat /tmp/app-0.log'), 120, 'RESUME on the destination')
        self.assertIn('APPASSIST.RESUME', out)

    def test_balloon_limited_by_guest_stats(self):
        """An app that over-reports what it freed, in a guest whose memory is
        mostly in use: with balloon statistics polled, the target keeps the
        guest's available memory (minus a margin) out of the balloon; the
        guest keeps running and the migration completes.  Statistics are
        polled every 10 s: the phase asks for a report after PREPARE instead
        of waiting for the next one (it would give up after 3 s and
        inflate unbounded)."""
        import hvlib
        src, dst = self.boot_pair(1)
        src.run('mkdir -p /fill && mount -t tmpfs -o size=300m tmpfs /fill && '
                'dd if=/dev/zero of=/fill/x bs=1M count=250 2>/dev/null')
        src.qmp('qom-set', path='/machine/peripheral/balloon0',
                property='guest-stats-polling-interval', value=10)
        full = balloon_actual(src)
        start_app(src, 'good', 0, 400 * MiB)
        src.run('while [ ! -e /tmp/app-0.sh ]; do sleep 0.1; done')
        res = hvlib.migrate_postcopy(src, dst, precopy_seconds=0.3, bandwidth=125_000_000,
                                     capabilities=['app-assist'])
        self.assertEqual(res.status, 'completed')
        aa = res.info['app-assist']
        self.log.info('app-assist: %s', aa)
        self.assertEqual(aa['freed-bytes'], 400 * MiB)
        self.assertIn("limited by the guest's available memory", aa['reason'])
        # 250 MiB are in use in tmpfs: the balloon may not take more than the rest.
        self.assertGreater(aa['balloon-target'], 250 * MiB)
        self.assertLess(aa['balloon-target'], full)
        self.assertGreaterEqual(res.setup_time_ms, aa['prepare-time'] + aa['balloon-time'])
        self.assertLess(aa['balloon-time'], 3000, 'waited for the periodic report')
        self.assertEqual(src.qmp('qom-get', path='/machine/peripheral/balloon0',
                                 property='guest-stats-polling-interval'), 10)
        wait_for(lambda: balloon_actual(dst) == full, 60, 'balloon deflated on the destination')
        dst.run('true')

    def test_destination_fills_ram_without_huge_pages(self):
        """An incoming migration with app-assist asks for no transparent
        huge pages on guest RAM while it runs (a page that arrives allocates
        4 KiB, not a cleared 2 MiB area: migration/app-assist/incoming.c) and
        for them again once it completes; a stock destination keeps them."""
        mem = 512 * MiB
        src = self.guest('src', mem=self.MEM, redis=False).boot()
        dst = self.guest('dst', mem=self.MEM, redis=False, incoming='defer',
                         args=['-trace', 'app_assist_incoming_huge_pages']).launch()
        pid = dst.vm.get_pid()
        self.assertTrue(any('hg' in f for f in ram_vma_flags(pid, mem)),
                        ram_vma_flags(pid, mem))
        start_assisted(src, dst, **{'max-bandwidth': 4_000_000})
        wait_for(lambda: any('nh' in f for f in ram_vma_flags(pid, mem)), 60,
                 'guest RAM without huge pages on the destination')
        self.assertEqual(src.qmp('query-migrate')['status'], 'active')
        src.qmp('migrate-set-parameters', **{'max-bandwidth': 125_000_000})
        self.wait_completed(src, dst)
        wait_for(lambda: all('nh' not in f and 'hg' in f for f in ram_vma_flags(pid, mem)),
                 30, 'huge pages asked for again')
        with open(os.path.join(dst.log_dir, f'{dst.name}.log'), errors='replace') as f:
            log = f.read()
        self.assertRegex(log, r'app_assist_incoming_huge_pages .*pc.ram: transparent huge pages off')
        self.assertRegex(log, r'app_assist_incoming_huge_pages .*pc.ram: transparent huge pages on')
        dst.run('true')     # the guest runs on the destination

    def test_destination_leaves_untouched_zero_pages_alone(self):
        """An assisted destination leaves a zero page for RAM it has not
        received yet untouched (no read, no fault: migration/app-assist/
        incoming.c), and clears one it had received with data: a file's
        pages zeroed on the source after they were sent read back as zero
        on the destination, and the rest of the file as it was."""
        self.zero_pages_migration(postcopy=False)

    def test_destination_places_left_zero_pages_in_postcopy(self):
        """The same through post-copy: the guest, running on the
        destination, writes 32 MiB of fresh pages while the source still
        sends; the pages left zero that it touches are placed there (the
        source never sends a page it has clean), the file reads back as
        expected and the migration completes."""
        self.zero_pages_migration(postcopy=True)

    def zero_pages_migration(self, postcopy):
        mnt = '/mnt/zp'
        src = self.guest('src', mem=self.MEM, redis=False).boot()
        dst = self.guest('dst', mem=self.MEM, redis=False, incoming='defer',
                         args=['-trace', 'app_assist_incoming_left_zero_fault']).launch()
        src.run(f'mkdir -p {mnt} && mount -t tmpfs -o size=96m tmpfs {mnt} && '
                f'dd if=/dev/urandom of={mnt}/data bs=1M count=8 2>/dev/null && '
                f'cp {mnt}/data {mnt}/want && '
                f'dd if=/dev/zero of={mnt}/want bs=1M seek=2 count=2 conv=notrunc 2>/dev/null')
        want = src.run(f'md5sum < {mnt}/want').split()[0]
        src.run(f'rm {mnt}/want')
        self.assertNotEqual(want, src.run(f'md5sum < {mnt}/data').split()[0])
        # Keep the migration from converging until the file is zeroed: 8 MiB
        # of zeros rewritten every 0.5 s against 8 MB/s, for at most 2 min.
        src.run(f'( (i=0; while [ $i -lt 240 ]; do dd if=/dev/zero of={mnt}/churn bs=1M '
                f'count=8 2>/dev/null; sleep 0.5; i=$((i+1)); done) >/dev/null 2>&1 & )')
        pid = dst.vm.get_pid()
        faults0 = minor_faults(pid)
        start_assisted(src, dst, **{'max-bandwidth': 8_000_000})

        def synced(n):
            info = src.qmp('query-migrate')
            self.assertIn(info['status'], ('setup', 'active'))
            return info.get('ram', {}).get('dirty-sync-count', 0) >= n
        # Every page of the file has been sent once: zero its middle 2 MiB.
        wait_for(lambda: synced(2), 120, 'the first pass over guest RAM')
        src.run(f'dd if=/dev/zero of={mnt}/data bs=1M seek=2 count=2 conv=notrunc 2>/dev/null')
        if postcopy:
            # 16 MiB left to send at 1 MB/s: post-copy lasts up to 16 s.
            src.qmp('migrate-set-parameters', **{'max-postcopy-bandwidth': 1_000_000})
            # Written into free pages the destination left zero: dirty at the
            # switch, so the source sends them, and they must not be placed
            # as zero there when the guest reads them first.
            src.run(f'dd if=/dev/urandom of={mnt}/late bs=1M count=16 2>/dev/null')
            late = src.run(f'md5sum < {mnt}/late').split()[0]
            src.qmp('migrate-start-postcopy')
            wait_for(lambda: dst.qmp('query-status')['status'] == 'running', 60,
                     'the guest to run on the destination')
            self.assertEqual(dst.qmp('query-migrate')['status'], 'postcopy-active')
            dst.run(f'dd if=/dev/zero of={mnt}/fresh bs=1M count=32 2>/dev/null && '
                    f'dd if=/dev/urandom of={mnt}/fresh bs=1M count=32 conv=notrunc 2>/dev/null')
            self.assertEqual(dst.qmp('query-migrate')['status'], 'postcopy-active')
            self.assertEqual(dst.run(f'md5sum < {mnt}/late').split()[0], late)
            src.qmp('migrate-set-parameters', **{'max-postcopy-bandwidth': 125_000_000})
        else:
            src.qmp('migrate-set-parameters', **{'max-bandwidth': 125_000_000})
        self.wait_completed(src, dst)
        faults = minor_faults(pid) - faults0
        ram = src.qmp('query-migrate')['ram']
        with open(os.path.join(dst.log_dir, f'{dst.name}.log'), errors='replace') as f:
            placed = f.read().count('a page left zero, faulted')
        self.log.info('destination main thread: %d minor faults; %d normal, %d zero pages; '
                      '%d pages left zero placed on a fault', faults, ram['normal'],
                      ram['duplicate'], placed)
        # Most of a 512 MiB guest's RAM is zero.
        self.assertGreater(ram['duplicate'], 2 * ram['normal'])
        if postcopy:
            self.assertGreater(placed, 0)
            self.assertEqual(len(dst.run(f'md5sum < {mnt}/fresh').split()[0]), 32)
        else:
            # One fault per page received with data, hardly any for the
            # zero ones (a destination that reads them takes one for each).
            self.assertLess(faults, ram['normal'] + ram['duplicate'] // 4)
            self.assertEqual(placed, 0)
        self.assertEqual(dst.run(f'md5sum < {mnt}/data').split()[0], want)

    def test_destination_without_ports(self):
        """An assisted source, a destination whose ports are null chardevs
        (no app-assist backend) and whose capability is off: the destination
        accepts the stream, restores the balloon, and reports (event, query,
        warning) that no application could be resumed; the guest runs."""
        import hvlib
        src = self.guest('src', mem=self.MEM, redis=False, args=port_args(1)).boot()
        dst = self.guest('dst', mem=self.MEM, redis=False, incoming='defer',
                         args=plain_port_args(1)).launch()
        src.run(LINK_PORTS)
        full = balloon_actual(src)
        start_app(src, 'good', 0, 64 * MiB)
        src.run('while [ ! -e /tmp/app-0.sh ]; do sleep 0.1; done')
        postcopy = [{'capability': 'postcopy-ram', 'state': True}]
        src.qmp('migrate-set-capabilities',
                capabilities=postcopy + [{'capability': 'app-assist', 'state': True}])
        dst.qmp('migrate-set-capabilities', capabilities=postcopy)
        src.qmp('migrate-set-parameters', **{'max-bandwidth': 125_000_000,
                                            'max-postcopy-bandwidth': 125_000_000})
        uri = f'tcp:127.0.0.1:{hvlib.free_port()}'
        dst.qmp('migrate-incoming', uri=uri)
        src.qmp('migrate', uri=uri)
        wait_for(lambda: src.qmp('query-migrate')['status'] in ('active', 'completed'),
                 60, 'the source to leave set-up')
        if src.qmp('query-migrate')['status'] == 'active':
            src.qmp('migrate-start-postcopy')

        def done():
            st = src.qmp('query-migrate')['status']
            self.assertNotIn(st, ('failed', 'cancelled'))
            return st == 'completed'
        wait_for(done, 120, 'the migration to complete')
        self.assertEqual(dst.qmp('query-migrate')['status'], 'completed')
        aa = src.qmp('query-migrate')['app-assist']
        self.assertEqual(aa['status'], 'completed')
        self.assertEqual(aa['balloon-target'], full - 64 * MiB)
        # The destination restores the balloon although it has no port.
        wait_for(lambda: balloon_actual(dst) == full, 60, 'balloon deflated on the destination')
        ev = dst.vm.event_wait('MIGRATION_APP_ASSIST', timeout=30)
        self.assertIsNotNone(ev)
        info = ev['data']['info']
        self.assertEqual(info['status'], 'resumed')
        self.assertEqual(info['apps-contacted'], 0)
        self.assertIn('no application has an app-assist port open', info['reason'])
        self.assertEqual(dst.qmp('query-migrate')['app-assist']['status'], 'resumed')
        self.assertEqual(dst.qmp('query-status')['status'], 'running')
        out = dst.run('cat /tmp/app-0.log')      # the guest runs on the destination
        self.assertIn('APPASSIST.PREPARE', out)
        self.assertNotIn('APPASSIST.RESUME', out)
        # QEMU's stderr (QEMUMachine writes it to <log_dir>/<name>.log).
        with open(os.path.join(dst.log_dir, f'{dst.name}.log'), errors='replace') as f:
            self.assertIn('app-assist: no application has an app-assist port open', f.read())
