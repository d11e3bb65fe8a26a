"""Input checks: volume names, sizes, paths and create options.

Everything that reaches this module may be hostile (a command line, later a
podman plugin request over a socket): each check bounds its input before
looking at it, and each refusal names the value (shortened and quoted, so a
NUL or a newline shows as such) and the rule.  Nothing here touches the
system but os.lstat of the paths it is asked about.
"""

import os
import re
import stat

from .errors import BadInput

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

# podman's rule for volume names, bounded: a name is also a directory and a
# socket path component (a Unix socket path holds at most 107 bytes).
NAME_RE = re.compile(r'[A-Za-z0-9][A-Za-z0-9_.-]*\Z')
NAME_MAX = 64

# Sizes: an ext4 with a journal needs a few MiB; 16 MiB is the smallest
# volume worth having.  The largest is what a hybrid image can address at
# its default block size and header (qemu-img refuses beyond, with its own
# message); 64 TiB is a bound on absurd input, not a promise.
SIZE_MIN = 16 * MiB
SIZE_MAX = 64 * TiB
BLOCK_SIZES = tuple(1 << s for s in range(12, 22))      # 4 KiB .. 2 MiB
DIRTY_LIMIT_MIN = 1 * MiB
MODES = ('sync', 'async')
FS_TYPES = ('ext4',)

_UNITS = {'': 1, 'K': KiB, 'M': MiB, 'G': GiB, 'T': TiB, 'P': TiB << 10}
_SIZE_RE = re.compile(r'([0-9]{1,20})([KMGTP]?)(i?B)?\Z', re.IGNORECASE)


def shown(value, limit=80):
    """A value as an error message shows it: quoted, escapes visible, cut."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + '...'


def check_name(name):
    """The volume name, or BadInput saying why not."""
    if not isinstance(name, str):
        raise BadInput(f'volume name {shown(name)} is not a string')
    if len(name) > NAME_MAX:
        raise BadInput(f'volume name {shown(name, 40)} is {len(name)} characters long, '
                       f'at most {NAME_MAX}')
    if not NAME_RE.match(name):
        raise BadInput(f'volume name {shown(name)} is not a name: letters, digits, '
                       "'_', '.' and '-', starting with a letter or digit")
    return name


def parse_size(value, what, lo=0, hi=SIZE_MAX):
    """Bytes from 4096, 64M, 64MiB, 1G... (binary units), within [lo, hi]."""
    if isinstance(value, bool):
        raise BadInput(f'{what} {shown(value)} is not a size')
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and len(value) <= 32:
        m = _SIZE_RE.match(value.strip())
        if not m:
            raise BadInput(f'{what} {shown(value)} is not a size (e.g. 4096, 64M, 1G)')
        n = int(m.group(1)) * _UNITS[m.group(2).upper()]
    else:
        raise BadInput(f'{what} {shown(value)} is not a size (e.g. 4096, 64M, 1G)')
    if n < lo or n > hi:
        raise BadInput(f'{what} {shown(value)} ({n} bytes) is out of range: '
                       f'{human(lo)} to {human(hi)}')
    return n


def human(n):
    for unit, mult in (('T', TiB), ('G', GiB), ('M', MiB), ('K', KiB)):
        if n >= mult and n % mult == 0:
            return f'{n // mult}{unit}iB'
    return f'{n} bytes'


def check_path(value, what):
    """An absolute, normalised path without control characters or '..'."""
    if not isinstance(value, str) or not value or len(value) > 1024:
        raise BadInput(f'{what} {shown(value)} is not a path (absolute, at most 1024 bytes)')
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise BadInput(f'{what} {shown(value)} holds a control character')
    if not value.startswith('/'):
        raise BadInput(f'{what} {shown(value)} is not an absolute path')
    if '..' in value.split('/'):
        raise BadInput(f'{what} {shown(value)} goes through "..": give the path itself')
    norm = os.path.normpath(value)
    if norm.startswith('//'):
        norm = norm[1:]
    return norm


def check_no_links(path, what):
    """path (checked) when no component of it is a symbolic link: a root
    program must act on the path it was given, not where a link leads."""
    cur = '/'
    for part in path.strip('/').split('/'):
        if not part:
            continue
        cur = os.path.join(cur, part)
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return path
        except OSError as exc:
            raise BadInput(f'{what} {shown(path)}: {cur}: {exc.strerror}') from None
        if stat.S_ISLNK(st.st_mode):
            raise BadInput(f'{what} {shown(path)} goes through the symbolic link {cur} '
                           f'(to {shown(os.readlink(cur))}): give the real path')
    return path


_SYSTEM_TREES = ('/proc', '/sys', '/dev', '/run/hybridvm')


def check_image_path(value):
    """Where an image may be: absolute, no links, outside the kernel's
    trees and our run directory, a regular file if it exists."""
    path = check_no_links(check_path(value, 'image'), 'image')
    for tree in _SYSTEM_TREES:
        if path == tree or path.startswith(tree + '/'):
            raise BadInput(f'image {shown(path)} is under {tree}: not a place for an image')
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(f'image {shown(path)} exists and is not a regular file')
    return path


def check_mountpoint(value):
    """An existing directory, no links on the way, not the root."""
    path = check_no_links(check_path(value, 'mount point'), 'mount point')
    if path == '/':
        raise BadInput('mount point "/" is the root directory')
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise BadInput(f'mount point {shown(path)}: {exc.strerror}') from None
    if not stat.S_ISDIR(st.st_mode):
        raise BadInput(f'mount point {shown(path)} is not a directory')
    return path


# The options a volume is created with.  Keys are the hybrid format's own
# (docs/hybrid.md) where they are its; values arrive as strings from the
# command line or a plugin request.
CREATE_OPTIONS = ('size', 'ram-size', 'block-size', 'mode', 'dirty-limit',
                  'image', 'region', 'fs', 'prealloc')
_BOOLS = {'on': True, 'yes': True, 'true': True, '1': True,
          'off': False, 'no': False, 'false': False, '0': False}


def _bool(value, what):
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _BOOLS:
        return _BOOLS[value.lower()]
    raise BadInput(f'{what} {shown(value)} is not on/off')


def parse_create_options(opts):
    """A validated dict of the create options in opts (a mapping of at most
    len(CREATE_OPTIONS) string keys); unknown keys are refused by name."""
    if not isinstance(opts, dict) or len(opts) > 2 * len(CREATE_OPTIONS):
        raise BadInput('options must be a mapping of at most '
                       f'{len(CREATE_OPTIONS)} names to values')
    for key in opts:
        if key not in CREATE_OPTIONS:
            raise BadInput(f'unknown option {shown(key, 40)}: the options are '
                           + ', '.join(CREATE_OPTIONS))
    out = {}
    if 'size' in opts and opts['size'] is not None:
        out['size'] = parse_size(opts['size'], 'size', SIZE_MIN, SIZE_MAX)
    if opts.get('block-size') is not None:
        bs = parse_size(opts['block-size'], 'block-size', BLOCK_SIZES[0], BLOCK_SIZES[-1])
        if bs not in BLOCK_SIZES:
            raise BadInput(f'block-size {shown(opts["block-size"])} is not a power of '
                           'two from 4K to 2M')
        out['block-size'] = bs
    if opts.get('ram-size') is not None:
        out['ram-size'] = parse_size(opts['ram-size'], 'ram-size', 0, SIZE_MAX)
    if opts.get('mode') is not None:
        if opts['mode'] not in MODES:
            raise BadInput(f'mode {shown(opts["mode"])} is not sync or async')
        out['mode'] = opts['mode']
    if opts.get('dirty-limit') is not None:
        out['dirty-limit'] = parse_size(opts['dirty-limit'], 'dirty-limit',
                                        DIRTY_LIMIT_MIN, SIZE_MAX)
    if opts.get('image') is not None:
        out['image'] = check_image_path(opts['image'])
    if opts.get('region') is not None:
        region = opts['region']
        # the broker's own rule is wider; ours is the volume-name rule
        if not isinstance(region, str) or len(region) > 128 or \
                not NAME_RE.match(region):
            raise BadInput(f'region {shown(region)} is not a region name: letters, '
                           "digits, '_', '.' and '-', at most 128")
        out['region'] = region
    if opts.get('fs') is not None:
        if opts['fs'] not in FS_TYPES:
            raise BadInput(f'fs {shown(opts["fs"])} is not one of ' + ', '.join(FS_TYPES))
        out['fs'] = opts['fs']
    if opts.get('prealloc') is not None:
        out['prealloc'] = _bool(opts['prealloc'], 'prealloc')
    if 'ram-size' in out and 'size' in out and out['ram-size'] > out['size']:
        raise BadInput(f'ram-size {human(out["ram-size"])} is larger than the volume '
                       f'({human(out["size"])})')
    return out
