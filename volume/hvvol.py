"""Hybrid volumes for containers: a hybrid image as a mounted file system.

A volume is a name, a hybrid image (docs/hybrid.md) and the options it was
created with.  Mounting it starts a qemu-storage-daemon that holds the
image as one hybrid node (its RAM tier optionally a memory broker region,
held through `hvmem map --rw`), exports the node as a block device
(transport.py chooses how: FUSE + loop with direct I/O on hosts without
nbd/ublk/VDUSE), formats it on first use and mounts it.  Unmounting is the
reverse, and loses nothing: the file system is unmounted (refused while a
container or a process uses it), the device detached, the node written
back and flushed (refused, with the daemon kept running and holding every
write, if the persistent tier cannot take it), the node closed, the daemon
stopped, and the image checked clean.

Files (docs/containers.md):
  <config dir>/<name>/volume.json   what the volume is (created once)
  <config dir>/<name>/disk.hyb      its image, unless created elsewhere
  <run dir>/<name>.lock             serialises operations on the volume
  <run dir>/<name>/state.json       which daemon serves it, its QMP socket,
                                    loop device, mount point (while mounted)
  <run dir>/<name>/{qmp.sock,export,qsd.pid,qsd.log}

Every JSON file is written whole into a fresh file and renamed over the
old one, so a crash leaves the old or the new one, never a mixture.  The
state file is written before each step that leaves something behind (a
daemon, an export, a loop device, a mount), so that whatever dies, the
next mount or umount finds everything to clean or to take over: a daemon
that died (SIGKILL, OOM) leaves a dead mount, loop device and FUSE export,
which are removed (unless a container still has the mount) before a new
daemon opens the image; a daemon that still runs is taken over as it is.

The run and config directories are root's: before use, every directory on
the way must be owned by root and not writable by others (sticky
directories such as /tmp excepted), and the last one must be 0700.
"""

import errno
import fcntl
import json
import os
import shutil
import signal
import stat
import subprocess
import time

from . import host, transport
from .errors import (AlreadyMounted, BadInput, Busy, DaemonError, Exists, FlushFailed,
                     NoSpace, NotFound, NotMounted, VolumeError)
from .validate import (MiB, GiB, check_mountpoint, check_name, check_path, human,
                       parse_create_options, shown)

import hvfiles
import hvqmp

CONFIG_DIR = '/var/lib/hybridvm/volumes'
RUN_DIR = '/run/hybridvm/volumes'
BROKER_SOCKET = '/run/hybridvm-broker.sock'
CONFIG_VERSION = 1

NODE = 'hvvol'               # the node and export names inside the daemon
EXPORT = 'hvvol'
DEFAULT_RAM_SIZE = 1 * GiB   # the RAM tier when create does not say (at most the size)
REGION_ALIGN = 2 * MiB
MOUNT_OPTIONS = 'errors=remount-ro'

# Time bounds.  A daemon starts in well under a second here; a write-back is
# bounded by its progress, not its total (a large dirty RAM tier over a slow
# disk may take long, but must keep moving).
START_TIMEOUT = 30
QMP_TIMEOUT = 30
WRITEBACK_STALL = 60
EXIT_TIMEOUT = 60
LOCK_TIMEOUT = 120
LOG_MAX = 1 << 20

# Daemons this process started and has not reaped (pid -> Popen): polling
# them reaps them, so that a long-lived caller (a test, the podman plugin)
# sees them die instead of keeping zombies, and gets their exit status.
_CHILDREN = {}


class VolQMP(hvqmp.QMP):
    id_prefix = 'hvvol'


def _env_path(var, default):
    return os.environ.get(var) or default


class Tools:
    """The programs a volume needs.  HVVOL_QEMU_STORAGE_DAEMON, HVVOL_QEMU_IMG
    and HVVOL_HVMEM name them; else the build tree ($HYBRIDVM_BUILD, or
    build/ beside this file) if it has them; else $PATH."""

    def __init__(self):
        top = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
        build = os.environ.get('HYBRIDVM_BUILD') or os.path.join(top, 'build')
        self.qsd = self._find('HVVOL_QEMU_STORAGE_DAEMON', 'qemu-storage-daemon',
                              os.path.join(build, 'bin'))
        self.qemu_img = self._find('HVVOL_QEMU_IMG', 'qemu-img', os.path.join(build, 'bin'))
        self.hvmem = self._find('HVVOL_HVMEM', 'hvmem', os.path.join(build, 'broker'))

    @staticmethod
    def _find(var, name, build_dir):
        if os.environ.get(var):
            return os.environ[var]
        cand = os.path.join(build_dir, name)
        if os.access(cand, os.X_OK):
            return cand
        return shutil.which(name) or name


# -- files -------------------------------------------------------------------

def secure_dir(path, what):
    """Make sure path is a directory only root can change: each directory
    on the way owned by root and not writable by group or others unless
    sticky, no symbolic link on the way unless root owns it, the last one
    created 0700 if missing and refused if it is not root's 0700.  Those
    on the way are created 0755 whatever the umask (hvvol-plugin.service
    runs with 0077): /run/hybridvm is shared with the clone cache, whose
    sockets libvirt's QEMU must reach."""
    path = check_path(path, what)
    cur = '/'
    parts = [p for p in path.split('/') if p]
    for i, part in enumerate(parts):
        nxt = os.path.join(cur, part)
        last = i == len(parts) - 1
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            try:
                os.mkdir(nxt, 0o700 if last else 0o755)
                os.chmod(nxt, 0o700 if last else 0o755)
            except FileExistsError:
                pass
            st = os.lstat(nxt)
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid != 0:
                raise BadInput(f'{what} {path}: {nxt} is a symbolic link owned by uid '
                               f'{st.st_uid}, not root: it could lead anywhere')
            target = os.path.realpath(nxt)
            return secure_dir(os.path.join(target, *parts[i + 1:]), what)
        if not stat.S_ISDIR(st.st_mode):
            raise BadInput(f'{what} {path}: {nxt} is not a directory')
        if st.st_uid != 0:
            raise BadInput(f'{what} {path}: {nxt} is owned by uid {st.st_uid}, not root: '
                           'its owner could swap what is in it')
        if last:
            if st.st_mode & 0o077:
                raise BadInput(f'{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: '
                               f'it must be 0700 (chmod 700 {path})')
        elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise BadInput(f'{what} {path}: {nxt} is writable by others '
                           f'(mode {stat.S_IMODE(st.st_mode):04o})')
        cur = nxt
    return path


def write_json(path, obj):
    """Replace path with obj as JSON, root-only, durably (hvfiles)."""
    hvfiles.replace_file(path, json.dumps(obj, indent=1, sort_keys=True) + '\n', mode=0o600,
                         durable=True)


def read_json(path, what, limit=1 << 20):
    """The JSON object in path (None if there is none); VolumeError if it
    is not a JSON object of at most limit bytes or is a symbolic link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise VolumeError(f'{what} {path}: {exc.strerror}') from None
    with os.fdopen(fd) as f:
        text = f.read(limit + 1)
    if len(text) > limit:
        raise VolumeError(f'{what} {path} is larger than {limit} bytes: damaged')
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise VolumeError(f'{what} {path} is damaged (not JSON: {exc})') from None
    if not isinstance(obj, dict):
        raise VolumeError(f'{what} {path} is damaged (not a JSON object)')
    return obj


def _typed(obj, what, path, spec):
    """Check obj's keys against spec {key: (type, required)}; a missing
    optional key reads as None."""
    for key, (typ, required) in spec.items():
        val = obj.get(key)
        if val is None:
            if required:
                raise VolumeError(f'{what} {path} is damaged: no {key}')
            obj[key] = None
        elif not isinstance(val, typ) or (typ is not bool and isinstance(val, bool)):
            raise VolumeError(f'{what} {path} is damaged: {key} is {shown(val)}')
    return obj


CONFIG_SPEC = {
    'version': (int, True), 'name': (str, True), 'image': (str, True),
    'image_owned': (bool, True), 'size': (int, True), 'block_size': (int, True),
    'ram_size': (int, True), 'mode': (str, True), 'dirty_limit': (int, False),
    'fs': (str, True), 'formatted': (bool, True), 'region': (str, False),
    'region_owned': (bool, False), 'region_size': (int, False),
    'broker_socket': (str, False),
}
STATE_SPEC = {
    'name': (str, True), 'phase': (str, True), 'pid': (int, False), 'start': (int, False),
    'wrapper_pid': (int, False), 'wrapper_start': (int, False),
    'transport': (str, False), 'loop': (str, False), 'dev': (list, False),
    'mountpoint': (str, False), 'own_mountpoint': (bool, False),
    'dio': (bool, False), 'notes': (list, False),
}


class _Lock:
    """An exclusive flock on <run dir>/<name>.lock for one operation; waits
    up to LOCK_TIMEOUT s for another hvvol working on the same volume."""

    def __init__(self, path, name):
        self.path, self.name, self.fd = path, name, None

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                          0o600)
        deadline = time.monotonic() + LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise Busy(f'volume {self.name}: another hvvol has been working on it '
                               f'for {LOCK_TIMEOUT} s (it holds {self.path})') from None
                time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


# -- the volumes ---------------------------------------------------------------

class Volumes:
    """The volumes of one config directory, served from one run directory.

    Every method takes the volume's lock, so two callers (two hvvol
    commands, or plugin requests) never work on one volume at once."""

    def __init__(self, config_dir=None, run_dir=None, tools=None, broker_socket=None):
        self.config_dir = secure_dir(config_dir or _env_path('HVVOL_DIR', CONFIG_DIR),
                                     'config directory')
        self.run_dir = secure_dir(run_dir or _env_path('HVVOL_RUN_DIR', RUN_DIR),
                                  'run directory')
        self.tools = tools or Tools()
        self.broker_socket = broker_socket or os.environ.get('HVMEM_SOCKET') or BROKER_SOCKET

    # -- paths and records --
    def _cdir(self, name):
        return os.path.join(self.config_dir, name)

    def _rdir(self, name):
        return os.path.join(self.run_dir, name)

    def _lock(self, name):
        return _Lock(os.path.join(self.run_dir, name + '.lock'), name)

    def _config(self, name):
        path = os.path.join(self._cdir(name), 'volume.json')
        cfg = read_json(path, 'volume file')
        if cfg is None:
            raise NotFound(f'volume {name} does not exist')
        cfg = _typed(cfg, 'volume file', path, CONFIG_SPEC)
        if cfg['name'] != name or cfg['version'] != CONFIG_VERSION:
            raise VolumeError(f'volume file {path} is damaged: it is for {shown(cfg["name"])} '
                              f'version {cfg["version"]}')
        return cfg

    def _save_config(self, cfg):
        write_json(os.path.join(self._cdir(cfg['name']), 'volume.json'), cfg)

    def _state(self, name):
        path = os.path.join(self._rdir(name), 'state.json')
        st = read_json(path, 'state file')
        return None if st is None else _typed(st, 'state file', path, STATE_SPEC)

    def _save_state(self, st):
        write_json(os.path.join(self._rdir(st['name']), 'state.json'), st)

    def _drop_state(self, name):
        """Remove the run files of a stopped volume, one by one: never a
        recursive removal, which would go through a mount left there.  The
        daemon's log stays (it is cut at the next start when large)."""
        rdir = self._rdir(name)
        for f in ('qmp.sock', 'qsd.pid', 'export', 'state.json'):
            try:
                os.unlink(os.path.join(rdir, f))
            except FileNotFoundError:
                pass
        mnt = os.path.join(rdir, 'mnt')
        if os.path.isdir(mnt) and not host.mount_at(mnt):
            try:
                os.rmdir(mnt)
            except OSError:
                pass

    def _sock(self, name):
        return os.path.join(self._rdir(name), 'qmp.sock')

    def _transport(self, name, kind='fuse'):
        cls = transport.IMPLEMENTED.get(kind)
        if cls is None:
            raise DaemonError(f'volume {name}: transport {shown(kind)} is not implemented')
        return cls(os.path.join(self._rdir(name), 'export'))

    # -- create / remove / list ------------------------------------------------
    def names(self):
        out = []
        for entry in sorted(os.listdir(self.config_dir)):
            if os.path.isfile(os.path.join(self.config_dir, entry, 'volume.json')):
                out.append(entry)
        return out

    def create(self, name, opts):
        """Create volume name from options (validate.CREATE_OPTIONS, values
        as strings or numbers): a new image (created; preallocated unless
        prealloc=off) or an existing hybrid image (image=PATH, adopted: kept
        at remove), and a broker region for its RAM tier if region= names
        one (created if missing, sized for the tier).  Returns the volume's
        record."""
        name = check_name(name)
        o = parse_create_options(opts)
        with self._lock(name):
            cdir = self._cdir(name)
            if os.path.exists(os.path.join(cdir, 'volume.json')):
                raise Exists(f'volume {name} exists already')
            os.makedirs(cdir, mode=0o700, exist_ok=True)
            image = o.get('image') or os.path.join(cdir, 'disk.hyb')
            for other in self.names():
                ocfg = self._config(other)
                if other != name and ocfg['image'] == image:
                    raise Exists(f'image {image} is volume {other}\'s already')
                if other != name and o.get('region') and ocfg['region'] == o['region']:
                    raise Exists(f'region {o["region"]} holds volume {other}\'s RAM tier '
                                 'already')
            undo = []
            try:
                cfg = self._create_image(name, image, o, undo)
                if o.get('region'):
                    self._create_region(cfg, o['region'], undo)
                self._save_config(cfg)
            except BaseException:
                for fn in reversed(undo):
                    try:
                        fn()
                    except (OSError, VolumeError):
                        pass
                self._remove_cdir(name)
                raise
            return cfg

    def _create_image(self, name, image, o, undo):
        cfg = dict(version=CONFIG_VERSION, name=name, image=image, fs=o.get('fs', 'ext4'),
                   dirty_limit=o.get('dirty-limit'), formatted=False, region=None,
                   region_owned=False, region_size=None, broker_socket=None)
        if os.path.exists(image):
            if o.get('ram-size') is not None or o.get('block-size') or o.get('mode'):
                raise BadInput(f'image {image} exists: its ram-size, block-size and mode are '
                               'its own (change them with qemu-img amend)')
            info = self._image_info(image)
            spec = info['format-specific']['data']
            if o.get('size') is not None and o['size'] != info['virtual-size']:
                raise BadInput(f'image {image} exists and holds {human(info["virtual-size"])}, '
                               f'not {human(o["size"])}')
            cfg.update(image_owned=False, size=info['virtual-size'],
                       block_size=spec['block-size'], ram_size=spec['ram-size'],
                       mode=spec['mode'])
            return cfg
        if o.get('size') is None:
            raise BadInput(f'volume {name}: size is required for a new image')
        size = o['size']
        ram = o.get('ram-size')
        if ram is None:
            ram = min(size, DEFAULT_RAM_SIZE)
        total = host.meminfo('MemTotal')
        if not o.get('region') and total and ram > total:
            raise BadInput(f'ram-size {human(ram)} is more than this host\'s memory '
                           f'({total >> 20} MiB)')
        d = os.path.dirname(image)
        if not os.path.isdir(d):
            raise NotFound(f'image {image}: directory {d} does not exist')
        prealloc = o.get('prealloc', True)
        if prealloc:
            vfs = os.statvfs(d)
            free = vfs.f_bavail * vfs.f_frsize
            if free < size + 4 * MiB:
                raise NoSpace(f'volume {name}: {d} has {free >> 20} MiB free, the image needs '
                              f'{(size >> 20) + 4} MiB (preallocated); free space there, or '
                              'create with prealloc=off (a full disk then shows as write '
                              'errors in the container)')
        cfg.update(image_owned=True, size=size, block_size=o.get('block-size', 65536),
                   ram_size=ram, mode=o.get('mode', 'sync'))
        opts = (f'ram-size={ram},block-size={cfg["block_size"]},mode={cfg["mode"]}')
        p = host.run([self.tools.qemu_img, 'create', '-q', '-f', 'hybrid', '-o', opts,
                      image, str(size)])
        if p.returncode != 0:
            raise BadInput(f'volume {name}: qemu-img create failed: '
                           f'{(p.stderr or p.stdout).strip()[-500:]}')
        undo.append(lambda: os.unlink(image))
        if prealloc:
            fd = os.open(image, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise NoSpace(f'volume {name}: cannot allocate {human(size)} in {d}: '
                                  f'{exc.strerror}') from None
                raise
            finally:
                os.close(fd)
        return cfg

    def _image_info(self, image):
        p = host.run([self.tools.qemu_img, 'info', '--output=json', '-f', 'hybrid', image])
        if p.returncode != 0:
            raise BadInput(f'image {image} is not a hybrid image: '
                           f'{(p.stderr or p.stdout).strip()[-300:]}')
        try:
            info = json.loads(p.stdout)
            info['format-specific']['data']['block-size']     # noqa: B018 (shape check)
        except (ValueError, KeyError, TypeError):
            raise BadInput(f'image {image}: qemu-img info said what is not a hybrid image\'s '
                           'information') from None
        return info

    def _hvmem(self, sock, *args, timeout=30):
        return host.run([self.tools.hvmem, '-s', sock] + list(args), timeout=timeout)

    def _create_region(self, cfg, region, undo):
        """The broker region for the RAM tier: header and bitmaps (3 bits a
        block, from 4 KiB, to a 2 MiB boundary), then the blocks."""
        blocks = min(cfg['ram_size'], cfg['size']) // cfg['block_size']
        bitmap = (blocks + 63) // 64 * 8
        need = -(-(4096 + 3 * bitmap) // REGION_ALIGN) * REGION_ALIGN + blocks * cfg['block_size']
        sock = self.broker_socket
        cfg.update(region=region, region_size=need, broker_socket=sock)
        p = self._hvmem(sock, 'lookup', region)
        if p.returncode == 0:
            fields = dict(kv.split('=', 1) for kv in p.stdout.split() if '=' in kv)
            have = int(fields.get('size', '0'))
            if have < need:
                raise BadInput(f'region {region} holds {human(have)}, the RAM tier needs '
                               f'{human(need)}')
            return
        if f"no region '{region}'" not in p.stderr:
            raise NotFound(f'volume {cfg["name"]}: the broker cannot be asked for region '
                           f'{region}: {p.stderr.strip()}')
        p = self._hvmem(sock, 'create', region, str(need), '--mode', '0600')
        if p.returncode != 0:
            err = p.stderr.strip()
            if 'full' in err or 'No space' in err or 'quota' in err.lower():
                raise NoSpace(f'volume {cfg["name"]}: the broker cannot hold a '
                              f'{human(need)} region for the RAM tier: {err}')
            raise VolumeError(f'volume {cfg["name"]}: hvmem create {region}: {err}')
        cfg['region_owned'] = True
        undo.append(lambda: self._hvmem(sock, 'destroy', region))

    def remove(self, name):
        """Delete the volume: its record, and the image and region if create
        made them.  Refused while it is mounted or has a daemon's state."""
        name = check_name(name)
        with self._lock(name):
            cfg = self._config(name)
            st = self._state(name)
            if st is not None:
                where = f' at {st["mountpoint"]}' if st.get('mountpoint') else ''
                raise Busy(f'volume {name} is in use{where} (state {st["phase"]}): '
                           f'run hvvol umount {name} first')
            if cfg['region'] and cfg['region_owned']:
                p = self._hvmem(cfg['broker_socket'] or self.broker_socket,
                                'destroy', cfg['region'])
                if p.returncode != 0 and f"no region '{cfg['region']}'" not in p.stderr:
                    raise VolumeError(f'volume {name}: hvmem destroy {cfg["region"]}: '
                                      f'{p.stderr.strip()}')
            if cfg['image_owned']:
                try:
                    os.unlink(cfg['image'])
                except FileNotFoundError:
                    pass
            os.unlink(os.path.join(self._cdir(name), 'volume.json'))
            self._remove_cdir(name)

    def _remove_cdir(self, name):
        """The volume's config directory, if nothing but ours is left in it."""
        try:
            os.rmdir(self._cdir(name))
        except OSError:
            pass

    # -- status -------------------------------------------------------------------
    def status(self, name):
        """What the volume is and where it stands: state is 'stopped',
        'mounted', 'attached' (daemon up, file system not mounted),
        'flush-failed' (umount could not write back; the daemon holds the
        data) or 'crashed' (the daemon died: the next mount or umount
        recovers)."""
        name = check_name(name)
        cfg = self._config(name)
        st = self._state(name)
        out = dict(name=name, image=cfg['image'], size=cfg['size'], ram_size=cfg['ram_size'],
                   mode=cfg['mode'], region=cfg['region'], formatted=cfg['formatted'])
        if st is None:
            out['state'] = 'stopped'
            return out
        out.update(pid=st['pid'], loop=st['loop'], mountpoint=st['mountpoint'],
                   transport=st['transport'], direct_io=st['dio'], notes=st['notes'] or [])
        if not host.alive(st['pid'], st['start']):
            out['state'] = 'crashed'
            return out
        if st['phase'] == 'flush-failed':
            out['state'] = 'flush-failed'
        elif st['mountpoint'] and self._mounted(st):
            out['state'] = 'mounted'
        else:
            out['state'] = 'attached'
        try:
            q = self._qmp(name, timeout=5)
            try:
                info = q.cmd('query-hybrid', **{'node-name': NODE})[0]
            finally:
                q.close()
            out['hybrid'] = {k: info.get(k) for k in
                             ('mode', 'dirty-bytes', 'ram-used', 'ram-loaded', 'restore-done',
                              'error', 'region')}
        except (hvqmp.QMPError, IndexError, KeyError, TypeError) as exc:
            out['hybrid'] = {'unavailable': str(exc)}
        return out

    def _own_loop(self, st):
        """Whether the state's loop device is still ours (attached to this
        volume's export file).  A loop device that was detached behind our
        back may serve someone else now: its number, and the device number
        of what is mounted from it, no longer say anything about us."""
        export = self._transport(st['name'], st['transport'] or 'fuse').export_file
        return bool(st['loop']) and st['loop'] in host.loops_backed_by(export)

    def _mounted(self, st):
        m = host.mount_at(st['mountpoint'])
        return bool(m and st['dev'] and list(m['dev']) == list(st['dev']) and
                    self._own_loop(st))

    # -- mount ------------------------------------------------------------------
    def mount(self, name, mountpoint=None):
        """Mount the volume on mountpoint (an existing empty directory;
        default <run dir>/<name>/mnt) and return its status, with
        'recovered' saying what was found and done if it was not stopped
        cleanly (else None).  A volume whose daemon still runs is taken over
        where it stands; one whose daemon died is cleaned up first (refused
        while a container still has its dead mount)."""
        name = check_name(name)
        if mountpoint is not None:
            mountpoint = check_mountpoint(mountpoint)
        with self._lock(name):
            cfg = self._config(name)
            st = self._state(name)
            recovered = None
            if st is not None and host.alive(st['pid'], st['start']):
                if st['mountpoint'] and self._mounted(st):
                    raise AlreadyMounted(f'volume {name} is mounted already, on '
                                         f'{st["mountpoint"]} (daemon pid {st["pid"]})',
                                         st['mountpoint'])
                recovered = f'took over its running daemon (pid {st["pid"]})'
            elif st is not None:
                self._clean_dead(cfg, st)
                recovered = (f'its daemon (pid {st["pid"]}) had died: its dead mount, loop '
                             'device and export were cleaned up and a new daemon started')
                st = None
            if mountpoint is None:
                mountpoint = os.path.join(self._rdir(name), 'mnt')
                own_mp = True
            else:
                own_mp = False
                self._check_mountpoint_free(name, mountpoint)
            if st is None:
                self._check_image(cfg)
                st = self._start(cfg)
            try:
                self._attach(cfg, st, mountpoint, own_mp)
            except BaseException:
                self._undo_mount(cfg, st)
                raise
        return dict(self.status(name), recovered=recovered)

    def _check_mountpoint_free(self, name, mp):
        m = host.mount_at(mp)
        if m:
            raise Busy(f'mount point {mp} is in use: {m["source"]} ({m["fstype"]}) is '
                       f'mounted there')
        try:
            if os.listdir(mp):
                raise Busy(f'mount point {mp} is not empty: mounting volume {name} there '
                           'would hide what is in it')
        except OSError as exc:
            raise BadInput(f'mount point {mp}: {exc.strerror}') from None

    def _check_image(self, cfg):
        img = cfg['image']
        try:
            st = os.lstat(img)
        except FileNotFoundError:
            raise NotFound(f'volume {cfg["name"]}: its image {img} is missing') from None
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(f'volume {cfg["name"]}: its image {img} is not a regular file')

    def _qmp(self, name, timeout=QMP_TIMEOUT):
        return VolQMP(self._sock(name), timeout=timeout).connect()

    def _start(self, cfg):
        """Start the daemon (under `hvmem map --rw` when the RAM tier is a
        region), add the node, choose the transport and export the node.
        Returns the state, saved."""
        name = cfg['name']
        rdir = self._rdir(name)
        os.makedirs(rdir, mode=0o700, exist_ok=True)
        os.chmod(rdir, 0o700)
        sock, pidfile = self._sock(name), os.path.join(rdir, 'qsd.pid')
        if len(sock) > 107:
            raise BadInput(f'run directory {self.run_dir} is too long: the QMP socket path '
                           f'{sock} has {len(sock)} bytes, a Unix socket at most 107')
        for f in (sock, pidfile):
            try:
                os.unlink(f)
            except FileNotFoundError:
                pass
        argv = [self.tools.qsd,
                '--chardev', f'socket,id=qmp,path={sock.replace(",", ",,")},server=on,wait=off',
                '--monitor', 'chardev=qmp,mode=control', '--pidfile', pidfile]
        if cfg['region']:
            argv = [self.tools.hvmem, '-s', cfg['broker_socket'] or self.broker_socket,
                    'map', cfg['region'], '--rw', '--'] + argv
        log = os.open(os.path.join(rdir, 'qsd.log'),
                      os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        if os.fstat(log).st_size > LOG_MAX:
            os.ftruncate(log, 0)
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True, close_fds=True,
                                    env=dict(PATH=os.environ.get('PATH', '/usr/bin:/bin'),
                                             LC_ALL='C'))
        except OSError as exc:
            raise DaemonError(f'volume {name}: cannot run {argv[0]}: {exc.strerror}') from None
        finally:
            os.close(log)
        _CHILDREN[proc.pid] = proc
        wrapped = bool(cfg['region'])
        st = dict(name=name, phase='starting',
                  pid=None if wrapped else proc.pid,
                  start=None if wrapped else host.start_time(proc.pid),
                  wrapper_pid=proc.pid if wrapped else None,
                  wrapper_start=host.start_time(proc.pid) if wrapped else None,
                  transport=None, loop=None, dev=None, mountpoint=None, own_mountpoint=None,
                  dio=None, notes=[])
        try:
            self._save_state(st)
            q = self._wait_daemon(name, proc, pidfile, st)
            try:
                self._save_state(st)
                self._add_node(cfg, q, st)
                kind, passed = self._choose(q)
                st['transport'] = kind
                st['notes'] = [f'{n} not used: {why}' for n, why in passed]
                self._save_state(st)
                tr = self._transport(name, kind)
                tr.prepare()
                try:
                    q.cmd('block-export-add', **tr.export_args(EXPORT, NODE))
                except hvqmp.QMPCommandError as exc:
                    raise DaemonError(f'volume {name}: cannot export the node: {exc.desc}') \
                        from None
                st['phase'] = 'exported'
                self._save_state(st)
            finally:
                q.close()
        except BaseException:
            self._kill_started(st, proc)
            raise
        return st

    def _wait_daemon(self, name, proc, pidfile, st):
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            rc = proc.poll()
            if rc is not None:
                _CHILDREN.pop(proc.pid, None)
                raise DaemonError(f'volume {name}: qemu-storage-daemon exited ({rc}) at '
                                  f'start: {self._log_tail(name)}')
            if st['pid'] is None:
                try:
                    with open(pidfile) as f:
                        pid = int(f.read().strip() or 0)
                    if pid > 0:
                        st['pid'], st['start'] = pid, host.start_time(pid)
                except (OSError, ValueError):
                    pass
            if st['pid'] is not None:
                try:
                    return self._qmp(name)
                except hvqmp.QMPError:
                    pass
            if time.monotonic() > deadline:
                raise DaemonError(f'volume {name}: qemu-storage-daemon did not answer on '
                                  f'{self._sock(name)} within {START_TIMEOUT} s: '
                                  f'{self._log_tail(name)}')
            time.sleep(0.02)

    def _log_tail(self, name, n=1500):
        try:
            with open(os.path.join(self._rdir(name), 'qsd.log'), errors='replace') as f:
                text = f.read()[-n:].strip()
        except OSError:
            return '(no log)'
        return text or '(nothing in its log)'

    def _add_node(self, cfg, q, st):
        node = {'driver': 'hybrid', 'node-name': NODE,
                'file': {'driver': 'file', 'filename': cfg['image']}}
        if cfg['dirty_limit']:
            node['dirty-limit'] = cfg['dirty_limit']
        if cfg['region']:
            fd = self._region_fd(st['pid'])
            node['ram-file'] = f'/proc/self/fd/{fd}'
        try:
            q.cmd('blockdev-add', **node)
        except hvqmp.QMPCommandError as exc:
            desc = exc.desc
            if 'lock' in desc:
                desc += ' (another program has the image open)'
            raise DaemonError(f'volume {cfg["name"]}: cannot open {cfg["image"]}: {desc}') \
                from None
        st['phase'] = 'node'

    @staticmethod
    def _region_fd(pid):
        """The region's descriptor number in the daemon (hvmem map passes it
        in $HVMEM_FD)."""
        try:
            with open(f'/proc/{pid}/environ', 'rb') as f:
                env = f.read(1 << 20).split(b'\0')
        except OSError as exc:
            raise DaemonError(f'cannot read the daemon\'s environment: {exc.strerror}') from None
        for kv in env:
            if kv.startswith(b'HVMEM_FD='):
                val = kv[9:].decode()
                if val.isdigit():
                    return int(val)
        raise DaemonError('hvmem passed the daemon no region descriptor ($HVMEM_FD)')

    @staticmethod
    def _export_types(q):
        """The daemon's BlockExportType members, from its QAPI schema."""
        schema = q.cmd('query-qmp-schema')
        by_name = {e.get('name'): e for e in schema if isinstance(e, dict)}
        cmd = by_name.get('block-export-add') or {}
        arg = by_name.get(cmd.get('arg-type')) or {}
        for m in arg.get('members', []):
            if m.get('name') == 'type':
                enum = by_name.get(m.get('type')) or {}
                return {v.get('name') if isinstance(v, dict) else v
                        for v in enum.get('members', enum.get('values', []))}
        return set()

    def _choose(self, q):
        kind, passed = transport.choose(transport.probe(), self._export_types(q),
                                        transport.IMPLEMENTED)
        if kind is None:
            raise DaemonError('no way to export the volume on this host: ' +
                              '; '.join(f'{n}: {why}' for n, why in passed))
        return kind, passed

    def _kill_started(self, st, proc):
        """A start that failed before anything used the node: nothing was
        written, the daemon goes."""
        for pid in (st['pid'], proc.pid):
            if pid:
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    pass
        try:
            proc.wait(EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _CHILDREN.pop(proc.pid, None)
        tr = self._transport(st['name'])
        try:
            tr.clean_dead_export()
        except VolumeError:
            pass
        self._drop_state(st['name'])

    def _attach(self, cfg, st, mountpoint, own_mp):
        """From a running daemon to a mounted file system, whatever of it
        is there already (node, export, loop device)."""
        name = cfg['name']
        tr = self._transport(name, st['transport'] or 'fuse')
        q = self._qmp(name)
        try:
            nodes = {n.get('node-name') for n in q.cmd('query-named-block-nodes', flat=True)}
            if NODE not in nodes:
                self._add_node(cfg, q, st)
            else:
                # a failed umount switched it to sync to write everything
                # back; back to its mode (which flushes, and may fail the
                # same way: then it stays sync, which loses nothing)
                try:
                    q.cmd('hybrid-set-mode', **{'node-name': NODE, 'mode': cfg['mode']})
                except hvqmp.QMPCommandError as exc:
                    st['notes'] = (st['notes'] or []) + [
                        f'left in sync mode: {exc.desc}']
            exports = {e.get('id') for e in q.cmd('query-block-exports')}
            if EXPORT not in exports:
                tr.prepare()
                q.cmd('block-export-add', **tr.export_args(EXPORT, NODE))
        except hvqmp.QMPCommandError as exc:
            raise DaemonError(f'volume {name}: {exc}') from None
        finally:
            q.close()
        st['phase'] = 'exported'
        self._save_state(st)
        loop, dio = tr.attach()
        st.update(loop=loop, dio=dio, dev=list(host.devno(loop)), phase='attached')
        if not dio:
            st['notes'] = (st['notes'] or []) + [f'{loop} runs without direct I/O']
        self._save_state(st)
        self._ensure_fs(cfg, loop)
        if own_mp:
            os.makedirs(mountpoint, mode=0o755, exist_ok=True)
        st.update(mountpoint=mountpoint, own_mountpoint=own_mp, phase='mounting')
        self._save_state(st)
        p = host.run(['mount', '-t', cfg['fs'], '-o', MOUNT_OPTIONS, loop, mountpoint])
        if p.returncode != 0:
            st.update(mountpoint=None, phase='attached')
            self._save_state(st)
            raise DaemonError(f'volume {name}: mount {loop} on {mountpoint} failed: '
                              f'{p.stderr.strip()} (see dmesg)')
        st['phase'] = 'mounted'
        self._save_state(st)

    def _ensure_fs(self, cfg, loop):
        """mkfs on first use.  What blkid finds decides, checked against
        what the volume's record says: a volume that was formatted and now
        shows no file system is refused, never formatted again."""
        p = host.run(['blkid', '-p', '-o', 'export', loop])
        fields = dict(line.split('=', 1) for line in p.stdout.splitlines() if '=' in line)
        if p.returncode == 0 and fields.get('TYPE'):
            if fields['TYPE'] != cfg['fs']:
                raise BadInput(f'volume {cfg["name"]}: its device holds a {fields["TYPE"]} '
                               f'file system, not {cfg["fs"]}')
            if not cfg['formatted']:
                cfg['formatted'] = True
                self._save_config(cfg)
            return
        if p.returncode != 2:
            raise DaemonError(f'volume {cfg["name"]}: blkid {loop} failed ({p.returncode}): '
                              f'{p.stderr.strip()}')
        if cfg['formatted']:
            raise DaemonError(f'volume {cfg["name"]} was formatted, but {loop} (its image '
                              f'{cfg["image"]}) shows no file system now: refusing to format '
                              'it again (was the image replaced?)')
        p = host.run(['mkfs.' + cfg['fs'], '-q', '-E', 'nodiscard', loop], timeout=600)
        if p.returncode != 0:
            raise DaemonError(f'volume {cfg["name"]}: mkfs.{cfg["fs"]} {loop} failed: '
                              f'{(p.stderr or p.stdout).strip()}')
        cfg['formatted'] = True
        self._save_config(cfg)

    def _undo_mount(self, cfg, st):
        """A mount that failed part-way: take it back down the way umount
        does (nothing is lost; if that fails too, the state stays for the
        next umount)."""
        try:
            if st.get('mountpoint') and self._mounted(st):
                host.run(['umount', st['mountpoint']])
            self._stop(cfg, st)
        except VolumeError:
            pass

    # -- umount -------------------------------------------------------------------
    def umount(self, name):
        """Unmount the volume, write back and flush its node, stop its
        daemon and check that the image was closed clean.  Returns
        {'recovered': bool}: True if the daemon had died (its leftovers were
        cleaned, and the image opened and closed again to write back what a
        region held)."""
        name = check_name(name)
        with self._lock(name):
            cfg = self._config(name)
            st = self._state(name)
            if st is None:
                raise NotMounted(f'volume {name} is not mounted')
            if not host.alive(st['pid'], st['start']):
                self._clean_dead(cfg, st)
                self._check_image(cfg)
                st = self._start(cfg)
                self._stop(cfg, st)
                return {'recovered': True}
            if st['mountpoint'] and self._mounted(st):
                self._unmount_fs(name, st)
            self._stop(cfg, st)
            return {'recovered': False}

    def _unmount_fs(self, name, st):
        mp, dev = st['mountpoint'], st['dev']
        found = host.users(dev, ignore_targets=[mp])
        if found:
            raise Busy(f'volume {name} (on {mp}) is in use: {host.describe_users(found)}; '
                       'stop those containers or processes first', found)
        p = host.run(['umount', mp])
        if p.returncode != 0:
            found = host.users(dev, ignore_targets=[mp])
            raise Busy(f'volume {name}: umount {mp} failed: {p.stderr.strip()}' +
                       (f': {host.describe_users(found)}' if found else ''), found)
        st['phase'] = 'unmounted'
        self._save_state(st)
        if st['own_mountpoint']:
            try:
                os.rmdir(mp)
            except OSError:
                pass

    def _stop(self, cfg, st):
        """Detach, write back, flush, close, quit, check; the state goes
        only when the image is clean.  FlushFailed leaves the daemon
        running with every write."""
        name = cfg['name']
        tr = self._transport(name, st['transport'] or 'fuse')
        if st['loop']:
            if self._own_loop(st):
                tr.detach(st['loop'])
            st.update(loop=None, phase='detached')
            self._save_state(st)
        q = self._qmp(name)
        try:
            nodes = {n.get('node-name') for n in q.cmd('query-named-block-nodes', flat=True)}
            exports = {e.get('id') for e in q.cmd('query-block-exports')}
            if NODE in nodes:
                self._write_back(cfg, q, tr if EXPORT in exports and tr.exported() else None, st)
            if EXPORT in exports:
                q.cmd('block-export-del', id=EXPORT)
                self._wait(lambda: EXPORT not in {e.get('id') for e in
                                                  q.cmd('query-block-exports')},
                           EXIT_TIMEOUT, f'volume {name}: the export did not go away')
            if NODE in nodes:
                # closing the node writes back (nothing is dirty now) and
                # clears the image's DIRTY flag
                q.cmd('blockdev-del', **{'node-name': NODE})
            st['phase'] = 'closed'
            self._save_state(st)
            try:
                q.cmd('quit')
            except hvqmp.QMPError:
                pass        # it may close the socket before answering
        except hvqmp.QMPCommandError as exc:
            raise DaemonError(f'volume {name}: {exc}') from None
        finally:
            q.close()
        self._wait_exit(cfg, st)
        self._verify_clean(cfg)
        self._drop_state(name)

    def _write_back(self, cfg, q, tr, st):
        """Every dirty block to the persistent tier, then a flush of it.
        The node is switched to sync (which starts the write-back of all
        dirty blocks), its progress watched; then the export file is
        fsync()ed (a flush of the node, returning its error)."""
        try:
            # the switch itself flushes: its error is the write-back's
            q.cmd('hybrid-set-mode', **{'node-name': NODE, 'mode': 'sync'})
        except hvqmp.QMPCommandError as exc:
            info = q.cmd('query-hybrid', **{'node-name': NODE})[0]
            self._flush_failed(cfg, st, info.get('error') or exc.desc, info.get('dirty-bytes'))
        last, since = None, time.monotonic()
        while True:
            info = q.cmd('query-hybrid', **{'node-name': NODE})[0]
            if info.get('error'):
                self._flush_failed(cfg, st, info['error'], info.get('dirty-bytes'))
            dirty = info.get('dirty-bytes', 0)
            if dirty == 0:
                break
            if last is None or dirty < last:
                last, since = dirty, time.monotonic()
            elif time.monotonic() - since > WRITEBACK_STALL:
                self._flush_failed(cfg, st, f'no progress for {WRITEBACK_STALL} s', dirty)
            time.sleep(0.05)
        if tr is not None:
            err = tr.flush(EXIT_TIMEOUT)
            if err:
                info = q.cmd('query-hybrid', **{'node-name': NODE})[0]
                self._flush_failed(cfg, st, info.get('error') or err, info.get('dirty-bytes'))

    def _flush_failed(self, cfg, st, err, dirty):
        st['phase'] = 'flush-failed'
        self._save_state(st)
        d = os.path.dirname(cfg['image'])
        try:
            vfs = os.statvfs(d)
            free = f'{vfs.f_bavail * vfs.f_frsize >> 20} MiB free in {d}'
        except OSError:
            free = f'{d} unreadable'
        raise FlushFailed(f'volume {cfg["name"]}: writing back to {cfg["image"]} failed: {err} '
                          f'({dirty} bytes not yet written back; {free}).  The daemon (pid '
                          f'{st["pid"]}) keeps every write: fix the cause and run hvvol umount '
                          f'{cfg["name"]} again (or hvvol mount to use the volume meanwhile)')

    @staticmethod
    def _wait(pred, timeout, msg):
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise DaemonError(msg)
            time.sleep(0.02)

    def _wait_exit(self, cfg, st):
        name = cfg['name']
        for pid, start in ((st['pid'], st['start']), (st['wrapper_pid'], st['wrapper_start'])):
            if pid and not host.wait_gone(pid, start, EXIT_TIMEOUT):
                raise DaemonError(f'volume {name}: the daemon (pid {pid}) did not exit '
                                  f'{EXIT_TIMEOUT} s after quit')
        # our own child: its exit status (through hvmem, the daemon's)
        child = _CHILDREN.pop(st['wrapper_pid'] or st['pid'], None)
        if child is not None:
            rc = child.wait(EXIT_TIMEOUT)
            if rc != 0:
                raise DaemonError(f'volume {name}: the daemon exited with status {rc}: '
                                  f'{self._log_tail(name)}')

    def _verify_clean(self, cfg):
        info = self._image_info(cfg['image'])['format-specific']['data']
        if info.get('dirty') or info.get('region-held'):
            held = ' (held by its region)' if info.get('region-held') else ''
            raise DaemonError(f'volume {cfg["name"]}: the daemon exited but {cfg["image"]} is '
                              f'still marked dirty{held}: {self._log_tail(cfg["name"])}')

    # -- recovery ---------------------------------------------------------------
    def _clean_dead(self, cfg, st):
        """The daemon died: remove what it leaves behind (its file system's
        mount, the loop device, the dead FUSE export) so that a new daemon
        can open the image.  Refused while a container or process still uses
        the dead mount; the data is safe meanwhile (what was flushed is in
        the image, and with a region every acknowledged write is in it)."""
        name = cfg['name']
        if st['wrapper_pid']:
            # hvmem ends when its daemon does, and the region's lease with it
            host.wait_gone(st['wrapper_pid'], st['wrapper_start'], 10)
        _reap(st['wrapper_pid'] or st['pid'])
        # our file system can only be mounted from our loop device; if that
        # is gone (detached by hand), so is the mount
        dev = st['dev'] if self._own_loop(st) else None
        if dev:
            targets = host.mounted_targets(dev)
            found = host.users(dev, ignore_targets=targets)
            if found:
                raise Busy(f'the daemon of volume {name} (pid {st["pid"]}) died; its file '
                           f'system is still in use: {host.describe_users(found)}; stop those '
                           'first (nothing more can be written to it)', found)
            for t in sorted(targets, key=len, reverse=True):
                p = host.run(['umount', t])
                if p.returncode != 0:
                    raise Busy(f'volume {name}: cannot unmount the dead file system on {t}: '
                               f'{p.stderr.strip()}')
        tr = self._transport(name, st['transport'] or 'fuse')
        for loop in host.loops_backed_by(tr.export_file):
            tr.detach(loop)
        tr.clean_dead_export()
        self._drop_state(name)


def _reap(pid):
    child = _CHILDREN.get(pid)
    if child is not None and child.poll() is not None:
        _CHILDREN.pop(pid, None)
