#!/usr/bin/env python3
"""The main job, end to end on this machine.

Boots the Redis guest (our module loaded, the app-assist port attached) under
our QEMU, loads it with items of which 70 % are cold, and migrates it to a
second QEMU process with post-copy over a link capped at 1 Gbit/s, twice:
stock, then app-assisted (the module drops its cold set and leaves what it
freed as zero pages; QEMU balloons whatever the module reports it did not
clear, then migrates).  Checks the items on the destination and
prints both migrations' figures side by side.

--libvirt does the same through two private libvirtd instances and
`virsh migrate --live --postcopy --postcopy-after-precopy`.
"""
import argparse
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'tests'))
import hvlib  # noqa: E402

PORT_ARGS = ['-device', 'virtio-serial-pci,id=aaserial,bus=pci.0,addr=0x1d',
             '-chardev', 'app-assist,id=aa0',
             '-device', 'virtserialport,bus=aaserial.0,chardev=aa0,name=org.qemu.app-assist.0']


def table(rows, columns):
    widths = [max(len(str(c)), *(len(str(r.get(c, ''))) for r in rows)) for c in columns]
    out = ['  '.join(str(c).ljust(w) for c, w in zip(columns, widths)),
           '  '.join('-' * w for w in widths)]
    for r in rows:
        out.append('  '.join(str(r.get(c, '')).ljust(w) for c, w in zip(columns, widths)))
    return '\n'.join(out)


def run_qemu(args, mode, log_dir, data):
    assisted = mode == 'app-assisted'
    src = hvlib.Guest(f'{mode}-src', log_dir, mem=args.mem, module=True, args=PORT_ARGS)
    dst = hvlib.Guest(f'{mode}-dst', log_dir, mem=args.mem, module=True, args=PORT_ARGS,
                      incoming='defer')
    try:
        src.launch()
        src.wait_console(r'HV-READY redis', timeout=180)
        dst.launch()
        r = src.redis()
        hot, cold = hvlib.load_hot_cold(r, data, args.hot)
        r.close()
        res = hvlib.migrate_postcopy(src, dst, precopy_seconds=args.precopy, bandwidth=args.bandwidth,
                                     capabilities=['app-assist'] if assisted else [], timeout=900)
        aa = res.info.get('app-assist', {})
        wrong_hot, wrong_cold = hvlib.count_wrong(dst.redis(), hot, cold, cold_dropped=assisted)
        balloon = dst.qmp('query-balloon')['actual']
        row = {'migration': f'{mode} post-copy', **res.row(),
               'freed by apps (MiB)': round(aa.get('freed-bytes', 0) / 2**20, 1) if assisted else '-',
               'of it zero pages (MiB)': round(aa.get('zeroed-bytes', 0) / 2**20, 1) if assisted else '-',
               'prepare (ms)': aa.get('prepare-time', '-') if assisted else '-',
               'balloon (ms)': aa.get('balloon-time', '-') if assisted else '-',
               'hot items wrong': wrong_hot, 'cold items wrong': wrong_cold}
        ok = (res.status == 'completed' and not wrong_hot and not wrong_cold
              and balloon == hvlib.vm.parse_mem(args.mem))
        return row, ok
    finally:
        dst.shutdown()
        src.shutdown()


def run_libvirt(args, mode, log_dir, data):
    from hvlib.libvirt import LibvirtPair, domain_xml
    assisted = mode == 'app-assisted'
    qargs = PORT_ARGS + (['-global', 'migration.x-app-assist=on'] if assisted else [])
    mem_mib = hvlib.vm.parse_mem(args.mem) // 2**20
    with LibvirtPair(log_dir=os.path.join(log_dir, mode)) as pair:
        ports = {}
        for side in ('src', 'dst'):
            ports[side] = hvlib.free_port()
            with open(os.path.join(pair.root, f'{side}.xml'), 'w') as f:
                f.write(domain_xml('hvdemo', pair_paths(), mem_mib=mem_mib, redis_port=ports[side],
                                   console_log=os.path.join(log_dir, f'{mode}-{side}-console.log'),
                                   append='hv.redis=1 hv.module=1', qemu_args=qargs))
        pair.src.virsh('define', os.path.join(pair.root, 'src.xml'))
        pair.src.virsh('start', 'hvdemo')
        r = hvlib.redis_client(ports['src'], timeout=180, name='src')
        hot, cold = hvlib.load_hot_cold(r, data, args.hot)
        r.close()
        mibps = str(max(1, args.bandwidth // 2**20))  # virsh takes MiB/s
        t = time.monotonic()
        pair.src.virsh('migrate', '--live', '--postcopy', '--postcopy-after-precopy',
                       '--bandwidth', mibps, '--postcopy-bandwidth', mibps,
                       '--xml', os.path.join(pair.root, 'dst.xml'), 'hvdemo', pair.dst.uri,
                       '--migrateuri', f'tcp://127.0.0.1:{hvlib.free_port()}',
                       '--listen-address', '127.0.0.1', timeout=900)
        wall = time.monotonic() - t
        job = pair.dst.virsh('domjobinfo', 'hvdemo', '--completed').stdout
        def field(name):
            m = re.search(rf'^{name}:\s+(.*)$', job, re.M)
            return ' '.join(m.group(1).split()) if m else '-'

        wrong_hot, wrong_cold = hvlib.count_wrong(hvlib.redis_client(ports['dst'], name='dst'), hot, cold,
                                                  cold_dropped=assisted)
        aa = json.loads(pair.dst.virsh('qemu-monitor-command', 'hvdemo',
                                       '{"execute": "query-migrate"}').stdout)['return'].get('app-assist', {})
        row = {'migration': f'{mode} (virsh)', 'virsh migrate (s)': round(wall, 1),
               'time elapsed': field('Time elapsed'), 'setup time': field('Setup time'),
               'downtime': field('Total downtime'), 'data processed': field('Data processed'),
               'app-assist on destination': aa.get('status', '-'),
               'hot items wrong': wrong_hot, 'cold items wrong': wrong_cold}
        return row, not wrong_hot and not wrong_cold


_paths = None


def pair_paths():
    global _paths
    if _paths is None:
        _paths = hvlib.BuildPaths()
    return _paths


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--mem', default='1G', help='guest RAM (default 1G)')
    ap.add_argument('--items', type=int, default=200000, help='Redis items (default 200000)')
    ap.add_argument('--value-size', type=int, default=100, help='bytes per value (default 100, as in the design)')
    ap.add_argument('--hot', type=float, default=0.3, help='hot fraction of the items (default 0.3)')
    ap.add_argument('--bandwidth', type=int, default=125_000_000, help='migration cap in bytes/s (1 Gbit/s)')
    ap.add_argument('--precopy', type=float, default=0.5, help='seconds of pre-copy before post-copy')
    ap.add_argument('--libvirt', action='store_true', help='migrate through libvirtd and virsh')
    ap.add_argument('--log-dir', default=None)
    args = ap.parse_args()

    paths = pair_paths()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix='demo-', dir=paths.build)
    os.makedirs(log_dir, exist_ok=True)
    print(f'demo: guest {args.mem}, {args.items} items of {args.value_size} B, {args.hot:.0%} hot, '
          f'link {args.bandwidth * 8 / 1e9:g} Gbit/s{", through libvirt" if args.libvirt else ""}; '
          f'logs in {log_dir}', flush=True)
    data = hvlib.make_items(args.items, args.value_size)
    rows, ok = [], True
    for mode in ('stock', 'app-assisted'):
        t = time.monotonic()
        row, good = (run_libvirt if args.libvirt else run_qemu)(args, mode, log_dir, data)
        rows.append(row)
        ok = ok and good
        print(f'demo: {mode} run done in {time.monotonic() - t:.0f} s', flush=True)
    print()
    print(table(rows, list(dict.fromkeys(c for r in rows for c in r))))
    print()
    if not ok:
        print('demo: FAILED (see the table and the logs)', file=sys.stderr)
        return 1
    print('demo: hot items intact on the destination; cold items dropped only with app-assist')
    return 0


if __name__ == '__main__':
    sys.exit(main())
