"""What a benchmark measured: private copies of its programs (a rebuild
during the run changes nothing in it), their hashes and build times, the
commit and the uncommitted changes of the tree they came from, and the
line a report ends with (bench/hybrid-mirror.py, bench/clone-cache-local.py)."""

import hashlib
import os
import shutil
import subprocess
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def copy_binary(src, dst):
    """Copy program @src (symbolic links followed) to @dst; what the report
    says of it."""
    src = os.path.realpath(src)
    shutil.copy2(src, dst)
    with open(dst, 'rb') as f:
        return {'path': src, 'mtime': os.stat(src).st_mtime,
                'sha256': hashlib.sha256(f.read()).hexdigest()[:16]}


def changed(binaries):
    """The names of @binaries (name -> copy_binary()'s) whose source was
    rebuilt or removed since it was copied."""
    return [n for n, b in binaries.items()
            if not os.path.exists(b['path']) or os.stat(b['path']).st_mtime != b['mtime']]


def tree(*paths):
    """The commit checked out and the uncommitted changes (under @paths,
    else anywhere; at most 20 lines)."""
    git = ['git', '-C', REPO]
    head = subprocess.run(git + ['rev-parse', 'HEAD'], capture_output=True,
                          text=True).stdout.strip()
    status = subprocess.run(git + ['status', '--porcelain', '--untracked-files=no', '--',
                                   *paths], capture_output=True, text=True).stdout
    return {'head': head, 'tree_paths': list(paths),
            'tree_changes': [x.strip() for x in status.split('\n') if x.strip()][:20]}


def report_line(meta):
    """'Source: commit ... Binaries (copied at start): ...' from @meta
    (tree()'s fields, 'binaries' and 'binaries_changed'), or None."""
    if not meta.get('binaries'):
        return None
    where = ' under ' + ', '.join(p + '/' for p in meta['tree_paths']) \
        if meta.get('tree_paths') else ''
    changes = [x.strip() for x in meta.get('tree_changes') or [] if x.strip()]
    return (f'Source: commit {meta.get("head", "?")[:12]}'
            + (f' with uncommitted changes{where} ({"; ".join(changes)})' if changes else '')
            + '.  Binaries (copied at start): ' + ', '.join(
                f'{n} {b["sha256"]} (built '
                f'{time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(b["mtime"]))})'
                for n, b in meta['binaries'].items())
            + (f'; the build\'s {", ".join(meta["binaries_changed"])} changed during '
               'the run (the copies were measured)' if meta.get('binaries_changed') else '')
            + '.')
